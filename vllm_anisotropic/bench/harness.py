"""Exact tau harness: a tree speculative-decoding loop over a Hugging Face causal LM.

Scope: batch size 1, greedy (temperature 0) decoding with any ``proposers`` method, verified
by the greedy walk of ``verifiers.greedy`` (GOOSE arXiv 2604.02047 Algorithm 3). It measures tau, the
number of tokens emitted per target forward call (accepted drafts + 1 bonus), per step and per
source, and checks that the output equals plain greedy decoding. It does not model serving
cost (no batching, no CUDA graphs); use vLLM for throughput.

One step (gpt-fast's decode loop, with a tree):

1. ``tree = state.propose(context)``; the root is the last context token, whose KV is not yet
   in the cache (``cache_len == len(context) - 1``).
2. One forward of all ``num_nodes`` tree tokens with
   positions ``cache_len + depth`` and a 4D additive mask ``[1, 1, num_nodes, cache_len +
   num_nodes]``: 0 on every cached column and on ``ancestor_mask[i, j]``, -inf elsewhere.
   Example: depths [0, 1, 1, 2], cache_len 7 -> positions [7, 8, 8, 9].
3. ``greedy.verify(tree, logits)`` -> accepted node path + bonus token; emitted tokens =
   accepted path tokens + bonus.
4. ``state.observe(tree, accepted, logits)`` (harvest every node, EMA update).
5. KV compaction: keep cache rows ``[0, cache_len)`` and the tree rows of the root and the
   accepted nodes, in path order. Example: cache_len 7, accepted nodes [2, 5] -> keep
   ``0..6, 7 + 0, 7 + 2, 7 + 5``; the new ``cache_len`` is 10 = len(new context) - 1.

Numerics: a tree forward computes the same function as sequential decoding, but with
different reduction shapes, so logits differ by float rounding (~1e-6 relative in float32).
Where the top-2 logits of the target are closer than that, the argmax can differ from the
sequential one. The harness therefore reports token identity against a plain greedy loop
(``greedy_decode``) instead of assuming it; use float32 for exactness checks.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from vllm_anisotropic.proposers.adjacency import TopKRows
from vllm_anisotropic.proposers.base import ProposalMode, RequestState
from vllm_anisotropic.tree import DraftTree, NodeSource
from vllm_anisotropic.verifiers import get_verifier

__all__ = ["StepRecord", "DecodeResult", "tree_attention_mask", "TreeDecoder", "load_model"]

logger = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One verification step."""

    accepted: int  # draft tokens accepted (root excluded); emitted = accepted + 1
    spine_accepted: int  # of which SPINE (context-match) tokens
    branch_accepted: int  # of which BRANCH (adjacency) tokens
    tree_size: int  # nodes verified, root included
    spine_size: int  # SPINE nodes in the tree
    branch_size: int  # BRANCH nodes in the tree
    mode: str  # ProposalMode value: tree / bypass / chain / plain
    propose_s: float  # proposer time (propose + observe), seconds
    forward_s: float  # target forward, seconds
    verify_s: float  # greedy walk, seconds


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded), truncated at max_new_tokens / EOS
    steps: list[StepRecord] = field(default_factory=list)
    prompt_len: int = 0
    prefill_s: float = 0.0
    wall_s: float = 0.0

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def tau(self) -> float:
        """Mean tokens per verification call: mean over steps of (accepted + 1)."""
        return float(np.mean([s.accepted + 1 for s in self.steps])) if self.steps else 0.0

    def summary(self) -> dict:
        st = self.steps
        n = max(len(st), 1)
        return {
            "num_tokens": len(self.tokens),
            "num_steps": len(st),
            "tau": self.tau,
            "accepted": int(sum(s.accepted for s in st)),
            "spine_accepted": int(sum(s.spine_accepted for s in st)),
            "branch_accepted": int(sum(s.branch_accepted for s in st)),
            "spine_proposed": int(sum(s.spine_size for s in st)),
            "branch_proposed": int(sum(s.branch_size for s in st)),
            "mean_tree_size": float(sum(s.tree_size for s in st) / n),
            "bypass_steps": int(sum(s.mode == ProposalMode.BYPASS.value for s in st)),
            # accepted path = spine prefix then branch suffix (GOOSE Sec. 4.2 "spine continuation")
            "spine_continuation_steps": int(sum(s.spine_accepted > 0 and s.branch_accepted > 0 for s in st)),
            "plain_steps": int(sum(s.mode == ProposalMode.PLAIN.value for s in st)),
            "propose_ms_per_step": 1e3 * float(sum(s.propose_s for s in st) / n),
            "forward_ms_per_step": 1e3 * float(sum(s.forward_s for s in st) / n),
            "prefill_s": self.prefill_s,
            "wall_s": self.wall_s,
        }

    def step_dicts(self) -> list[dict]:
        return [asdict(s) for s in self.steps]


def tree_attention_mask(tree: DraftTree, cache_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[1, 1, num_nodes, cache_len + num_nodes]`` additive mask (0 = attend, finfo.min = not).

    ``parents [-1, 0, 0], cache_len 2 -> rows [0 0 0 m m], [0 0 0 0 m], [0 0 0 m 0]`` (m = min).
    """
    n = tree.num_nodes
    allowed = torch.ones(n, cache_len + n, dtype=torch.bool)
    allowed[:, cache_len:] = torch.from_numpy(tree.ancestor_mask)
    mask = torch.zeros(n, cache_len + n, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, n, cache_len + n).to(device)


def load_model(path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """An HF causal LM in eval mode (SDPA attention) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


def _compact(cache, keep: torch.Tensor) -> None:
    """Keep only cache positions ``keep`` (in that order) in every layer."""
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(-2, keep)
        layer.values = layer.values.index_select(-2, keep)


class TreeDecoder:
    """Greedy tree decoding and the plain greedy reference over one HF model."""

    def __init__(self, model, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        self.dtype = next(model.parameters()).dtype
        self.verifier = get_verifier("greedy")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def greedy_decode(self, prompt: list[int], max_new_tokens: int, eos_ids=()) -> DecodeResult:
        """Plain greedy decoding (one token per forward, HF's own causal mask): the reference."""
        t0 = time.perf_counter()
        cache = self._new_cache()
        ids = torch.tensor([prompt], device=self.device)
        logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0, -1]
        self._sync()
        res = DecodeResult(tokens=[], prompt_len=len(prompt), prefill_s=time.perf_counter() - t0)
        eos = set(int(e) for e in eos_ids)
        while True:
            tok = int(logits.argmax())
            res.tokens.append(tok)
            if len(res.tokens) >= max_new_tokens or tok in eos:
                break
            t1 = time.perf_counter()
            logits = self.model(input_ids=torch.tensor([[tok]], device=self.device), past_key_values=cache, use_cache=True).logits[0, -1]
            self._sync()
            res.steps.append(StepRecord(0, 0, 0, 1, 0, 0, ProposalMode.PLAIN.value, 0.0, time.perf_counter() - t1, 0.0))
        res.wall_s = time.perf_counter() - t0
        return res

    @torch.inference_mode()
    def generate(
        self,
        prompt: list[int],
        state: RequestState,
        max_new_tokens: int,
        eos_ids=(),
        harvest_prefill: bool = True,
        first_token_from_prefill: bool = False,
        harvest_lag: bool = False,
    ) -> DecodeResult:
        """Tree speculative decoding of ``prompt`` with ``state`` (see module docstring).

        ``first_token_from_prefill=True`` starts the way vLLM does: the whole prompt is
        prefilled, its last row's argmax is the first output token (no tree, no harvest: vLLM
        computes only that row), and the first tree is rooted at that token. ``res.steps`` then
        holds the verification steps only; ``bench/crosscheck.py`` compares them with the
        engine's per-step accepted lengths.

        ``harvest_lag=True`` learns in the engine's order: a step's harvest (top-k rows,
        adjacency / EMA updates) is applied after the next tree is proposed, so each proposal
        sees the tables as they were one step earlier (``TreeDrafter.observe_step``).
        """
        assert len(prompt) >= 1
        t_start = time.perf_counter()
        eos = set(int(e) for e in eos_ids)
        cache = self._new_cache()
        context = list(int(t) for t in prompt)
        res = DecodeResult(tokens=[], prompt_len=len(prompt))
        if first_token_from_prefill:
            out = self.model(input_ids=torch.tensor([context], device=self.device), past_key_values=cache, use_cache=True)
            first = int(out.logits[0, -1].argmax())
            context.append(first)
            res.tokens.append(first)
        elif len(context) > 1:  # prefill all but the last prompt token (the first root)
            ids = torch.tensor([context[:-1]], device=self.device)
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
            if harvest_prefill:
                tp = time.perf_counter()
                state.observe_prefill(context[:-1], out.logits[0])
                logger.debug("prefill harvest %.1f ms", 1e3 * (time.perf_counter() - tp))
        cache_len = len(context) - 1
        self._sync()
        res.prefill_s = time.perf_counter() - t_start
        done = bool(res.tokens) and (len(res.tokens) >= max_new_tokens or res.tokens[-1] in eos)
        pending = None  # harvest_lag: the previous step's bound harvest
        while not done:
            t0 = time.perf_counter()
            tree = state.propose(np.asarray(context, dtype=np.int64))
            if pending is not None:
                pending()
                pending = None
            t1 = time.perf_counter()
            n = tree.num_nodes
            ids = torch.from_numpy(tree.tokens).view(1, n).to(self.device)
            pos = torch.from_numpy(tree.positions(cache_len)).view(1, n).to(self.device)
            mask = tree_attention_mask(tree, cache_len, self.dtype, self.device)
            logits = self.model(
                input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
            ).logits[0]  # [num_nodes, vocab_size]
            self._sync()
            t2 = time.perf_counter()
            result = self.verifier.verify(tree, logits.float())
            t3 = time.perf_counter()
            if harvest_lag and state.harvest_top_k:
                pending = functools.partial(state.observe_later(tree, result.accepted),
                                            TopKRows.of(logits, state.harvest_top_k))
            else:
                state.observe(tree, result.accepted, logits)
            t4 = time.perf_counter()
            accepted = list(result.accepted)
            keep = torch.cat(
                [torch.arange(cache_len), cache_len + torch.tensor([0] + accepted, dtype=torch.long)]
            ).to(self.device)
            _compact(cache, keep)
            cache_len += 1 + len(accepted)
            emitted = [int(tree.tokens[i]) for i in accepted] + [int(result.bonus_token)]
            src = tree.sources[np.asarray(accepted, np.int64)] if accepted else np.zeros(0, np.int8)
            res.steps.append(
                StepRecord(
                    accepted=len(accepted),
                    spine_accepted=int(np.count_nonzero(src == NodeSource.SPINE)),
                    branch_accepted=int(np.count_nonzero(src == NodeSource.BRANCH)),
                    tree_size=n,
                    spine_size=int(np.count_nonzero(tree.sources == NodeSource.SPINE)),
                    branch_size=int(np.count_nonzero(tree.sources == NodeSource.BRANCH)),
                    mode=ProposalMode(state.last_info.mode).value,
                    propose_s=(t1 - t0) + (t4 - t3),
                    forward_s=t2 - t1,
                    verify_s=t3 - t2,
                )
            )
            for tok in emitted:
                context.append(tok)
                res.tokens.append(tok)
                if len(res.tokens) >= max_new_tokens or tok in eos:
                    done = True
                    break
        state.finish(np.asarray(context))
        res.wall_s = time.perf_counter() - t_start
        return res


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token over the common length, -1 if none."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return -1
