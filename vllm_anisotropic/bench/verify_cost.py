"""``vllm-anisotropic verify-cost``: latency of one target step verifying trees, by batch and tree size.

Scope: the cost model's measurements (budget allocator issue) on one device. For a Qwen2 /
Llama-shaped model built by transformers from its config (random weights: latency does not
depend on the values), it times one forward of ``batch`` requests, each with ``nodes`` query
rows (a tree of ``nodes`` tokens, root included; ``nodes = 1`` is a plain decode step) over a
KV cache of ``context`` tokens per request, logits for every row (tree verification needs them):

    graph    our own forward over the transformers module's weights (RMSNorm, RoPE, GQA SDPA
             with a tree mask over a dense KV cache, SwiGLU, lm_head), captured in a CUDA graph
             per shape: the GPU's cost without Python launch overhead, close to what vLLM's
             CUDA-graph replay pays. Checked against transformers' own forward once.
    eager    transformers' forward (SDPA, 4D mask, DynamicCache cropped back after each call):
             what the tau harness pays, launch overhead included.

Prints a table of milliseconds per step and the ratio to the decode step of the same batch.

Example::

    vllm-anisotropic verify-cost --device cuda --arch qwen2.5-0.5b --out results/verify_cost.json
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["add_parser", "run", "ARCHS", "GraphForward"]

logger = logging.getLogger(__name__)

# Published configs (Hugging Face config.json of the Instruct checkpoints).
ARCHS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         max_position_embeddings=32768),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         max_position_embeddings=8192),
}
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("verify-cost", help="latency of a tree-verification step by batch x tree size")
    p.add_argument("--device", default="cuda")
    p.add_argument("--arch", default="qwen2.5-0.5b", help=f"one of {sorted(ARCHS)} (comma-separated for several)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--batches", default="1,2,4,8,16,32")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--eager", action="store_true", help="also time transformers' eager forward (batch 1)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    p.set_defaults(func=run)
    return p


def build_model(arch: str, dtype, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(ARCHS[arch])
    config = AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x, cos, sin):  # x [b, h, n, d]; cos/sin [b, 1, n, d]
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], dim=-1)
    return x * cos + rot * sin


class GraphForward:
    """One step of ``batch`` x ``nodes`` query rows over a static dense KV cache of ``context``
    tokens per request, on the weights of a transformers Qwen2/Llama module; ``capture()`` makes
    a CUDA graph of it. The step's K/V are written at positions ``context .. context+nodes-1``;
    the mask lets row i attend the context and node j iff ``allowed[b, i, j]``."""

    def __init__(self, model, batch: int, nodes: int, context: int) -> None:
        cfg = model.config
        self.m, self.cfg = model.model, cfg
        self.lm_head = model.lm_head
        dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
        self.h, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = cfg.hidden_size // self.h
        self.b, self.n, self.c = batch, nodes, context
        L = cfg.num_hidden_layers
        self.k_cache = torch.randn(L, batch, self.kvh, context + nodes, self.d, device=dev, dtype=dt)
        self.v_cache = torch.randn_like(self.k_cache)
        self.ids = torch.randint(0, cfg.vocab_size, (batch, nodes), device=dev)
        self.pos = (context + torch.arange(nodes, device=dev)).expand(batch, nodes).contiguous()
        allowed = torch.ones(batch, nodes, context + nodes, dtype=torch.bool, device=dev)
        allowed[:, :, context:] = torch.tril(torch.ones(nodes, nodes, dtype=torch.bool, device=dev))
        self.mask = torch.zeros(batch, 1, nodes, context + nodes, device=dev, dtype=dt)
        self.mask.masked_fill_(~allowed.unsqueeze(1), float("-inf"))
        self.graph = None
        self.logits = None

    def set_tree(self, allowed_nodes: torch.Tensor, depths: torch.Tensor) -> None:
        """Tree mask ``[batch, nodes, nodes]`` and positions ``context + depth`` (in place)."""
        c = self.c
        self.mask[:, :, :, c:] = 0.0
        self.mask[:, :, :, c:].masked_fill_(~allowed_nodes.unsqueeze(1), float("-inf"))
        self.pos.copy_(c + depths)

    def forward(self):
        cfg, b, n, c = self.cfg, self.b, self.n, self.c
        x = self.m.embed_tokens(self.ids)  # [b, n, hidden]
        cos, sin = self.m.rotary_emb(x, self.pos)  # transformers' own RoPE: [b, n, head_size]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for li, layer in enumerate(self.m.layers):
            a = layer.self_attn
            hs = _rms(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
            q = a.q_proj(hs).view(b, n, self.h, self.d).transpose(1, 2)
            k = a.k_proj(hs).view(b, n, self.kvh, self.d).transpose(1, 2)
            v = a.v_proj(hs).view(b, n, self.kvh, self.d).transpose(1, 2)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
            self.k_cache[li, :, :, c:] = k
            self.v_cache[li, :, :, c:] = v
            o = F.scaled_dot_product_attention(q, self.k_cache[li], self.v_cache[li], attn_mask=self.mask,
                                               enable_gqa=self.h != self.kvh)
            x = x + a.o_proj(o.transpose(1, 2).reshape(b, n, self.h * self.d))
            hs = _rms(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
            mlp = layer.mlp
            x = x + mlp.down_proj(F.silu(mlp.gate_proj(hs)) * mlp.up_proj(hs))
        x = _rms(x, self.m.norm.weight, cfg.rms_norm_eps)
        return self.lm_head(x)  # [b, n, vocab]

    def capture(self) -> None:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.inference_mode():
            for _ in range(2):
                self.forward()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph), torch.inference_mode():
            self.logits = self.forward()

    def replay(self):
        if self.graph is None:
            with torch.inference_mode():
                self.logits = self.forward()
        else:
            self.graph.replay()
        return self.logits


def check_against_transformers(model, device, context=40, nodes=6) -> float:
    """Max |logit difference| between ``GraphForward`` (eager) and transformers on one request
    with a random tree; context K/V come from a transformers prefill."""
    from transformers import DynamicCache

    from vllm_anisotropic.bench.harness import tree_attention_mask
    from vllm_anisotropic.attention.random_batch import random_tree

    cfg = model.config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=g).to(device)
    tree = random_tree(np.random.default_rng(2), nodes)
    tree.tokens[:] = torch.randint(0, cfg.vocab_size, (nodes,), generator=g).numpy()
    with torch.inference_mode():
        cache = DynamicCache(config=cfg)
        model(input_ids=prompt, past_key_values=cache, use_cache=True)
        dtype = next(model.parameters()).dtype
        mask = tree_attention_mask(tree, context, dtype, device)
        pos = torch.from_numpy(tree.positions(context)).view(1, nodes).to(device)
        ids = torch.from_numpy(tree.tokens).view(1, nodes).to(device)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True).logits
        gf = GraphForward(model, 1, nodes, context)
        for li, layer in enumerate(cache.layers):
            gf.k_cache[li, :, :, :context] = layer.keys[:, :, :context]
            gf.v_cache[li, :, :, :context] = layer.values[:, :, :context]
        gf.ids.copy_(ids)
        gf.set_tree(torch.from_numpy(tree.ancestor_mask).to(device).unsqueeze(0),
                    torch.from_numpy(tree.depths).to(device).unsqueeze(0))
        out = gf.forward()
    return float((out.float() - ref.float()).abs().max()), float(ref.float().abs().max())


def _median_ms(fn, repeats: int, device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return float(np.median(times))


def eager_ms(model, device, nodes: int, context: int, repeats: int) -> float:
    """transformers' forward of one request's ``nodes`` rows over a ``context``-token cache."""
    from transformers import DynamicCache

    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (1, context), device=device)
    dtype = next(model.parameters()).dtype
    with torch.inference_mode():
        cache = DynamicCache(config=cfg)
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        q = torch.randint(0, cfg.vocab_size, (1, nodes), device=device)
        pos = (context + torch.arange(nodes, device=device)).view(1, nodes)
        mask = torch.zeros(1, 1, nodes, context + nodes, device=device, dtype=dtype)
        mask[..., context:] = torch.triu(torch.full((nodes, nodes), float("-inf"), device=device, dtype=dtype), 1)

        def step():
            model(input_ids=q, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
            cache.crop(-nodes)
            if device.type == "cuda":
                torch.cuda.synchronize()

        # wall clock: includes the launch overhead that dominates eager forwards
        for _ in range(3):
            step()
        t = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            t.append(1e3 * (time.perf_counter() - t0))
        return float(np.median(t))


def run(args) -> int:
    device = torch.device(args.device)
    dtype = _DTYPES[args.dtype]
    torch.backends.cuda.matmul.allow_tf32 = False
    batches = [int(x) for x in args.batches.split(",")]
    nodes = [int(x) for x in args.nodes.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "archs": {}}
    for arch in args.arch.split(","):
        model = build_model(arch, dtype, device)
        err, mag = check_against_transformers(model, device)
        rec = {"check_max_abs_logit_err": err, "check_max_abs_logit": mag, "graph_ms": [], "eager_ms": []}
        print(f"{arch}: own forward vs transformers, max |logit diff| {err:.3g} (max |logit| {mag:.3g}, {args.dtype})")
        for context in contexts:
            print(f"{arch} {args.dtype} context {context}: graph ms per step (ratio to nodes=1)")
            print("batch " + "".join(f"{n:>14d}" for n in nodes))
            for b in batches:
                row = []
                for n in nodes:
                    gf = GraphForward(model, b, n, context)
                    captured = False
                    if device.type == "cuda":
                        try:
                            gf.capture()
                            captured = True
                        except RuntimeError as e:  # timed eagerly instead, and marked so
                            logger.warning("CUDA graph capture failed (%s): timing eagerly", e)
                            gf.graph = None
                    ms = _median_ms(gf.replay, args.repeats, device)
                    row.append(ms)
                    rec["graph_ms"].append({"batch": b, "nodes": n, "context": context, "ms": ms,
                                            "cuda_graph": captured})
                    del gf
                print(f"{b:5d} " + "".join(f"{ms:8.3f} ({ms / row[0]:4.2f})" for ms in row))
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if args.eager:
                line = []
                for n in nodes:
                    ms = eager_ms(model, device, n, context, args.repeats)
                    rec["eager_ms"].append({"batch": 1, "nodes": n, "context": context, "ms": ms})
                    line.append(ms)
                print("eager b=1 " + "".join(f"{ms:8.3f}" for ms in line))
        result["archs"][arch] = rec
        del model
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0
