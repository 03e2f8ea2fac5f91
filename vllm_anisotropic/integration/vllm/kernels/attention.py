"""Tree attention for vLLM's CPU backend: CPU_ATTN without the tree rows off the leading chains,
then those rows, by path rounds or a masked recompute.

Scope: decoder self-attention of the draft-tree rows only. vLLM's CPU kernel
(``ops.cpu_attention_with_kv_cache``) supports causal or per-sequence ``dynamic_causal``
masks, not arbitrary ones (shared/notes section 3b). So ``TreeCPUAttentionImpl.forward`` lets
the kernel compute the rows it gets right (prompts, re-run tokens, each tree's root and its
leading chain; the other tree rows are left out of its call, ``_main_plan``: its cost grows with
each request's query rows), then computes the rows of the other tree nodes (``tree_rows``), once
per step choosing between:

* **path rounds** (``_tree_rows_paths``, slim trees): a node's tree-masked attention is causal
  attention over its context and its root-to-node path. Each path is written (K/V) at the
  positions right after the context and its uncovered nodes are queried causally by vLLM's own
  kernel, round by round (paths of one request share those positions); the tree's K/V is put
  back after. Exact in the kernel's own arithmetic, and it reads the paged cache in place.
* **masked recompute** (``_tree_rows``, bushy trees: more than ``PATHS_MAX_MEAN`` paths per
  request, as each path re-reads the context): a masked softmax (batched matmuls, float32,
  query heads grouped by kv head) over the request's paged KV cache, unpacked to float32.

Mask of tree request r (context length ``c = seq_len - n``, ``n`` draft nodes in the last n
logical KV positions): node i may attend every context position ``< c`` (prompt, accepted
tokens, the root) and node j iff j is i or an ancestor of i (``DraftTree.ancestor_mask``).
Example: parents ``[-1, 0, 0, 1]``, c = 5 -> row of node 3: ``[1,1,1,1,1 | 1,0,1]``.

KV layout: the cache of one layer is ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
holding, per (block, head), a K region then a V region whose inner order depends on the ISA
(the ``vec`` kernels store K transposed, ``[head_size, block_size]``). Rather than hard-code
it, ``kv_layout`` writes probe tokens through vLLM's own ``cpu_attn_reshape_and_cache`` once
per (isa, dtype, block_size, head_size) and reads back where each (token, dim) landed (the
recompute unpacks it; the path rounds leave layouts to vLLM's own writer and kernel).
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import replace

import numpy as np
import torch

from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_anisotropic.kernels import load

__all__ = ["TreeCPUBackend", "TreeCPUAttentionImpl", "kv_layout", "warm_up_paths", "TREE_BACKEND_CLS"]

TREE_BACKEND_CLS = f"{__name__}.TreeCPUBackend"
# path rounds vs the masked recompute, measured on 2 Xeon cores (SmolLM2 heads 9:3 x 64, bf16, 30
# layers): 4 paths per request 4.2 vs 5.6 ms (1 request, 300 context tokens), 8 vs 18 ms (4
# requests); 5 paths (8-node binary trees) 6.7 vs 7.2 ms (1 request), 52 vs 56 ms (8 x 500);
# 8 paths (8-node stars) 7.8 vs 6.8 ms, 57 vs 52 ms
PATHS_MAX_MEAN = 6
# diagnostics and A/B runs (bench's ``+recompute`` modifier): "recompute" forces the masked
# recompute for every step, "auto" (default) decides per step as above
TREE_ROWS_ENV = "VLLM_ANISOTROPIC_TREE_ROWS"
_TREE_ROWS_MODES = ("auto", "recompute")


def _tree_rows_mode() -> str:
    mode = os.environ.get(TREE_ROWS_ENV, "auto")
    if mode not in _TREE_ROWS_MODES:
        raise ValueError(f"{TREE_ROWS_ENV}={mode!r}: valid values are {', '.join(_TREE_ROWS_MODES)}")
    return mode


def warm_up_paths() -> None:
    """Compile the plan kernels (or load them from numba's disk cache) for the argument types a
    step passes (int64 arrays, vLLM's int32 query starts, KV lengths and block table), at the CPU
    worker's start (``worker.TreeCPUWorker.compile_or_warm_up_model``) rather than in the first
    tree step."""
    plan, one, one32 = load("plan"), np.zeros(1, np.int64), np.array([0, 2], np.int32)
    plan.main_rows(one32, one32[1:], one, one + 1, np.empty(2, np.int64), np.empty(2, np.int32),
                   np.empty(1, np.int32))
    plan.path_rounds(np.array([-1, 0], np.int64), np.array([0, 2], np.int64), one, one32, one32[1:] + 1, one,
                     np.zeros((1, 1), np.int32), 16, 2, PATHS_MAX_MEAN)


@functools.cache
def _split_kv() -> bool:
    """vLLM's ``VLLM_CPU_ATTN_SPLIT_KV`` (its ``envs`` reads the environment at every access, ~10 us)."""
    return bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


_DIGIT = 16  # probe values stay in 1..16: exact in every cache dtype


@functools.lru_cache(maxsize=16)
def kv_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple:
    """Where token t, dim d of one (block, kv head) lives in its ``2 * block_size * head_size``
    elements: ``(k_offsets, v_offsets, k_kind, v_kind)``, offsets ``[block_size, head_size]``
    int64, and kinds: the layout's address-bit permutation (``bit_permutation``: plain
    ``t * head_size + d``, transposed ``d * block_size + t``, the AMX tiles) or ``"permuted"``
    (anything else; gathered element by element).

    Probes: four writes of the whole block with K (and V) set to one base-16 digit of t or d.
    """
    t = torch.arange(block_size).view(block_size, 1).expand(block_size, head_size)
    d = torch.arange(head_size).view(1, head_size).expand(block_size, head_size)
    digits = [t // _DIGIT, t % _DIGIT, d // _DIGIT, d % _DIGIT]
    region = 2 * block_size * head_size
    reads = []
    for digit in digits:
        cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
        view = cache.view(1, 1, 2 * block_size, head_size)
        key_cache, value_cache = view.chunk(2, dim=2)
        value = (digit + 1).to(dtype).view(block_size, 1, head_size)
        ops.cpu_attn_reshape_and_cache(
            value, value, key_cache, value_cache, torch.arange(block_size, dtype=torch.int64),
            isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )
        reads.append(cache.view(region).float().round().long() - 1)
    tt = reads[0] * _DIGIT + reads[1]
    dd = reads[2] * _DIGIT + reads[3]
    if bool((tt < 0).any() or (dd < 0).any()):
        raise RuntimeError(f"CPU KV layout probe failed for isa={isa} dtype={dtype} (unfilled elements)")
    offsets = torch.arange(region)
    half = block_size * head_size
    k_off = torch.full((block_size, head_size), -1, dtype=torch.int64)
    v_off = torch.full((block_size, head_size), -1, dtype=torch.int64)
    k_off[tt[:half], dd[:half]] = offsets[:half]
    v_off[tt[half:], dd[half:]] = offsets[half:]
    if bool((k_off < 0).any() or (v_off < 0).any()):
        raise RuntimeError(f"CPU KV layout probe for isa={isa} is not a K-then-V permutation")

    def kind(off: torch.Tensor, base: int):
        return bit_permutation(off, base, block_size, head_size) or "permuted"

    return k_off, v_off, kind(k_off, 0), kind(v_off, half)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """``CPUAttentionBackendImpl`` whose tree rows are recomputed with a tree mask."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # refused when the model is built, not at the first tree step (the engine would serve
        # prompts, then die under traffic); patches.attention_refusals names most of these
        # from the model's config before any weights load
        why = [name for name, on in (
            ("ALiBi", self.alibi_slopes is not None), ("sliding windows", self.sliding_window != -1),
            ("logit soft-capping", bool(self.logits_soft_cap)), ("attention sinks", self.sinks is not None),
            ("fp8 KV caches", self.is_fp8_kv_cache)) if on]
        if why:
            raise NotImplementedError(f"vllm-anisotropic CPU tree attention does not support {', '.join(why)}; use a "
                                      "model without it, or plain vLLM speculative decoding")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        plan = getattr(attn_metadata, "tree_plan", None) if attn_metadata is not None else None
        if plan is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        main = self._main_plan(plan, attn_metadata, query.dtype, layer.isa)
        if main is None:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        else:
            # vLLM's kernel over every row but the tree rows off the leading chain, which the
            # tree rows below compute: its cost grows with the query rows of each request
            keep, meta = main
            if isinstance(keep, int):  # the leading rows (one tree request, the batch's last): views
                super().forward(layer, query[:keep], key, value, kv_cache, meta, output[:keep], *args, **kwargs)
            else:
                part = output.new_empty((keep.shape[0], *output.shape[1:]))
                super().forward(layer, query.index_select(0, keep), key, value, kv_cache, meta, part, *args, **kwargs)
                output.index_copy_(0, keep, part)
        self.tree_rows(layer, query, key, value, kv_cache, attn_metadata, plan, output)
        return output

    def _main_plan(self, plan, attn_metadata, dtype: torch.dtype, isa: str):
        """The first kernel call without the rows ``tree_rows`` computes again, built once per
        step: ``(keep, metadata)``, ``keep`` the query rows it computes (int64; an int m when
        they are rows 0..m-1, as when the one tree request is the batch's last) and vLLM's
        metadata with each tree request's query and KV shortened by its ``n - c`` rows off the
        leading chain (the last rows of its query, the last positions of its KV: a causal row
        sees the same context, root and chain as before). None: vLLM's own call, as it is
        (per-sequence ``dynamic_causal`` masks, or no such rows).

        Example: queries of 8, 1 and 6 rows, trees in requests 0 and 2 with 1 and 3 rows off
        their chains -> keep rows 0-6, 8, 9-11; ``query_start_loc`` [0, 7, 8, 11], ``seq_lens``
        each minus 1, 0, 3."""
        key = ("main", dtype, isa)
        if key in plan.cache:
            return plan.cache[key]
        t0 = time.perf_counter()
        out = None
        off = plan.num_nodes - plan.chain_prefix  # [T] rows off each tree's leading chain
        if attn_metadata.dynamic_causal is None and attn_metadata.causal and off.any():
            qsl, lens = attn_metadata.query_start_loc.numpy(), attn_metadata.seq_lens.numpy()
            rows = np.empty(int(qsl[-1]), np.int64)
            query_start, seq_lens = np.empty(qsl.shape[0], np.int32), np.empty(lens.shape[0], np.int32)
            m, leading = load("plan").main_rows(qsl, lens, np.asarray(plan.req_index, np.int64), off, rows,
                                                query_start, seq_lens)
            query_start, seq_lens = torch.from_numpy(query_start), torch.from_numpy(seq_lens)
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=lens.shape[0], num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=query_start, causal=True,
                sliding_window_size=-1, isa=isa, enable_kv_split=_split_kv(), kv_cache_dtype=self.kv_cache_dtype,
            )
            out = (m if leading else torch.from_numpy(rows[:m]),
                   replace(attn_metadata, num_actual_tokens=m, query_start_loc=query_start,
                           seq_lens=seq_lens, scheduler_metadata=meta))
        plan.cache[key] = out
        _clock(plan, t0)  # host work, once a step (the other layers' lookups are not clocked)
        return out

    def tree_rows(self, layer, query, key, value, kv_cache, attn_metadata, plan, output) -> None:
        """The rows of the step's tree nodes: by path rounds through vLLM's kernel
        (``_tree_rows_paths``) unless the trees are bushy, then by the masked recompute
        (``_tree_rows``); decided once per step (``_path_plan``)."""
        paths = None if key is None or value is None else self._path_plan(
            plan, attn_metadata, kv_cache.shape[2], query.dtype, layer.isa, key.shape[0])
        gathered = None if paths is not None else self._gather_plan(plan, attn_metadata, kv_cache.shape[2])
        t0 = time.perf_counter()  # the plans (host work, clocked as "plan") are built by the first layer
        if paths is not None:
            self._tree_rows_paths(layer, query, key, value, kv_cache, paths, output)
        else:
            self._tree_rows(layer, query, kv_cache, gathered, plan, output)
        _clock(plan, t0, "tree_rows")  # compute inside the forward, not host work

    # ------------------------------------------------------------ path rounds (vLLM's kernel)
    def _path_plan(self, plan, attn_metadata, block_size: int, dtype: torch.dtype, isa: str, num_tokens: int):
        """Rounds of root-to-leaf paths, built once per step and shared by all layers.

        A node's tree-masked attention is exactly causal attention over (context, its path from
        the root): so a path laid out at the KV positions right after the context and queried
        causally by vLLM's own kernel gives its nodes' rows. Paths are taken leaf by leaf (node
        order); a path queries only its nodes no earlier path (nor the leading chain, whose rows
        the first kernel call got right) covered: an ancestor-closed set, so a suffix of the path.
        Paths of one request overwrite the same positions, so round k holds the k-th path of
        every tree request (one kernel call per round and layer). ``(rounds, queried, restore, span)``:
        per round, the slot of every K/V row it writes (-1: not written; so each write reads the
        layer's K/V where it is, no gather), its query rows (a slice of ``queried``),
        ``query_start_loc``, ``seq_lens``, the block table rows and the kernel's scheduler
        metadata; ``restore``: every node row's own slot, to put the tree back (the accepted
        chain's KV is kept in place, ``kv_in_place``); and ``span``: the slice ``queried`` is when
        it holds consecutive rows in order (one tree request, the batch's last, whose paths'
        rows follow each other: the rounds then read and write the layer's query and output rows
        in place; None: gathered and scattered). Built in one compiled call (``kernels/plan.py``,
        ``path_rounds``) over all ``num_tokens`` K/V rows.
        None: this step takes the recompute (bushy trees, or ``VLLM_ANISOTROPIC_TREE_ROWS``)."""
        key = ("paths", block_size, dtype, isa)
        if key in plan.cache:
            return plan.cache[key]
        t0 = time.perf_counter()
        out = None
        if _tree_rows_mode() != "recompute":
            out = self._build_paths(plan, attn_metadata, block_size, dtype, isa, num_tokens)
        plan.cache[key] = out
        _clock(plan, t0)  # host work, once a step
        return out

    def _build_paths(self, plan, attn_metadata, block_size: int, dtype: torch.dtype, isa: str, num_tokens: int):
        req = np.asarray(plan.req_index, np.int64)  # [T] batch row of each tree request
        table = attn_metadata.block_table.numpy()
        (round_paths, round_queries, queried, query_start, seq_lens, path_tree, slots, reads,
         context) = load("plan").path_rounds(plan.trees.parents, plan.trees.offsets, plan.chain_prefix,
                                             attn_metadata.query_start_loc.numpy(), attn_metadata.seq_lens.numpy(),
                                             req, table, block_size, num_tokens, PATHS_MAX_MEAN)
        # each path re-reads its request's context: past PATHS_MAX_MEAN paths per request
        # (context-weighted) the recompute's one float32 pass over it is cheaper (the kernel then
        # builds no rounds)
        if reads > PATHS_MAX_MEAN * context:
            return None
        query_start, seq_lens = torch.from_numpy(query_start), torch.from_numpy(seq_lens)
        slots = torch.from_numpy(slots)
        tables = torch.from_numpy(table[req[path_tree]])
        split_kv = _split_kv()
        rounds = []
        p0 = q0 = 0
        for k, (p1, q1) in enumerate(zip(round_paths.tolist(), round_queries.tolist())):
            qsl, sl = query_start[p0 + k : p1 + k + 1], seq_lens[p0:p1]
            meta = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=p1 - p0, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, seq_lens=sl, dtype=dtype, query_start_loc=qsl, causal=True,
                sliding_window_size=-1, isa=isa, enable_kv_split=split_kv, kv_cache_dtype=self.kv_cache_dtype,
            )
            rounds.append((slots[k], slice(q0, q1), qsl, sl, tables[p0:p1], meta))
            p0, q0 = p1, q1
        first = int(queried[0]) if queried.shape[0] else 0
        span = slice(first, first + queried.shape[0]) if np.array_equal(
            queried, np.arange(first, first + queried.shape[0])) else None
        return rounds, torch.from_numpy(queried), slots[-1], span

    def _tree_rows_paths(self, layer, query, key, value, kv_cache, paths, output) -> None:
        """The tree rows by vLLM's own kernel, path round by path round (``_path_plan``). When
        the queried rows are one span and the output has the query's dtype (as in the engine),
        the kernel reads and writes the layer's rows in place (no gather, no scatter)."""
        num_blocks, num_kv_heads, block_size, two_hs = kv_cache.shape
        head_size = two_hs // 2
        rounds, qrows, restore, span = paths
        kc, vc = self._kv_halves(kv_cache)
        k = key.view(-1, num_kv_heads, head_size)
        v = value.view(-1, num_kv_heads, head_size)
        q3 = query.view(-1, self.num_heads, head_size)
        o3 = output.view(output.shape[0], self.num_heads, head_size)
        in_place = span is not None and output.dtype == query.dtype
        if in_place:
            qs, res = q3[span], o3[span]
        else:
            qs = q3.index_select(0, qrows)
            res = torch.empty_like(qs)
        k_scale, v_scale = getattr(layer, "_k_scale_float", 1.0), getattr(layer, "_v_scale_float", 1.0)
        for slots, s_q, qsl, sl, bt, meta in rounds:
            ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, layer.isa, k_scale=k_scale,
                                           v_scale=v_scale, kv_cache_dtype=self.kv_cache_dtype)
            ops.cpu_attention_with_kv_cache(
                query=qs[s_q], key_cache=kc, value_cache=vc, output=res[s_q], query_start_loc=qsl, seq_lens=sl,
                scale=self.scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=bt, softcap=0.0,
                scheduler_metadata=meta, s_aux=None, k_scale=k_scale, v_scale=v_scale,
                kv_cache_dtype=self.kv_cache_dtype,
            )
        if not in_place:
            o3.index_copy_(0, qrows, res.to(output.dtype))
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, restore, layer.isa,
                                       k_scale=k_scale, v_scale=v_scale, kv_cache_dtype=self.kv_cache_dtype)

    def _kv_halves(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V halves of ``kv_cache`` as vLLM's kernels take them, kept while the
        layer's cache is the same tensor (a view and a chunk cost ~3 us a layer and step)."""
        held = getattr(self, "_halves", None)
        if held is None or held[0] is not kv_cache:
            num_blocks, num_kv_heads, block_size, two_hs = kv_cache.shape
            held = self._halves = (kv_cache, *kv_cache.view(num_blocks, num_kv_heads, 2 * block_size,
                                                            two_hs // 2).chunk(2, dim=2))
        return held[1], held[2]

    def _gather_plan(self, plan, attn_metadata, block_size: int):
        """Per-step indices shared by all layers (built by the first layer):
        ``[R * B]`` block ids of each tree request's KV blocks (B = most blocks of any tree
        request; padding repeats block 0), ``[R, N]`` query rows and their validity, and the
        ``[R, 1, N, B * block_size]`` additive mask (0 = may attend, -inf = not)."""
        key = ("gather", block_size)
        if key in plan.cache:
            return plan.cache[key]
        t0 = time.perf_counter()
        seq_lens = attn_metadata.seq_lens.tolist()
        q_end = attn_metadata.query_start_loc[1:].tolist()
        block_table = attn_metadata.block_table
        lens = [seq_lens[i] for i in plan.req_index]
        num_reqs = len(plan.req_index)
        max_nodes = int((plan.num_nodes - plan.chain_prefix).max())
        num_blocks = -(-max(lens) // block_size)
        blocks = torch.zeros(num_reqs, num_blocks, dtype=torch.int64)
        rows = torch.zeros(num_reqs, max_nodes, dtype=torch.int64)
        valid = torch.zeros(num_reqs, max_nodes, dtype=torch.bool)
        allowed = torch.zeros(num_reqs, max_nodes, num_blocks * block_size, dtype=torch.bool)
        for r, (i, n, m, c) in enumerate(zip(plan.req_index, plan.num_nodes.tolist(), plan.masks,
                                             plan.chain_prefix.tolist())):
            seq_len = lens[r]
            ctx = seq_len - n
            used = -(-seq_len // block_size)
            blocks[r, :used] = block_table[i, :used].to(torch.int64)
            # rows of nodes c+1..n (nodes 1..c form a chain: the kernel's causal rows are exact)
            k = n - c
            rows[r, :k] = torch.arange(q_end[i] - k, q_end[i])
            valid[r, :k] = True
            allowed[r, :k, :ctx] = True
            allowed[r, :k, ctx:seq_len] = torch.from_numpy(np.ascontiguousarray(m[c:]))
            allowed[r, k:, 0] = True  # padding rows attend something (their output is dropped)
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
        out = (blocks.flatten(), rows, valid, mask.unsqueeze(1))
        plan.cache[key] = out
        _clock(plan, t0)  # host work, once a step
        return out

    def _tree_rows(self, layer, query, kv_cache, gathered, plan, output) -> None:
        """The tree rows by a masked recompute over each tree request's whole KV, float32
        (``gathered``: ``_gather_plan``)."""
        num_blocks, num_kv_heads, block_size, two_hs = kv_cache.shape
        head_size = two_hs // 2
        layout = kv_layout(layer.isa, kv_cache.dtype, block_size, head_size)
        blocks, rows, valid, mask = gathered
        num_reqs, max_nodes = rows.shape
        group = self.num_queries_per_kv
        # [R * B, num_kv_heads, 2 * block_size * head_size]: whole blocks, one copy
        blk = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size * head_size).index_select(0, blocks)
        # K^T [R * kv_heads, head_size, L] and V [R * kv_heads, L], L = B * block_size
        kt = _unpack(blk, layout[0], layout[2], num_reqs, block_size, head_size, 0, transpose=True)
        v = _unpack(blk, layout[1], layout[3], num_reqs, block_size, head_size, block_size * head_size)
        kt = kt.view(num_reqs * num_kv_heads, head_size, -1)
        v = v.view(num_reqs * num_kv_heads, -1, head_size)
        # queries grouped by their kv head (query head h reads kv head h // group):
        # [R * kv_heads, group * N, head_size]
        q = query.view(query.shape[0], num_kv_heads, group, self.head_size)[rows]
        q = q.permute(0, 2, 3, 1, 4).float().reshape(num_reqs * num_kv_heads, group * max_nodes, head_size)
        # softmax(q k^T * scale + mask) v: one batched matmul per factor, float32
        scores = torch.baddbmm(self._grouped_mask(plan, mask, num_kv_heads, group), q, kt, alpha=self.scale)
        o = torch.bmm(scores.softmax(dim=-1), v)
        o = o.view(num_reqs, num_kv_heads, group, max_nodes, head_size).permute(0, 3, 1, 2, 4)
        out = output.view(output.shape[0], self.num_heads, self.head_size)
        out[rows[valid]] = o[valid].reshape(-1, self.num_heads, self.head_size).to(output.dtype)

    @staticmethod
    def _grouped_mask(plan, mask, num_kv_heads: int, group: int) -> torch.Tensor:
        """The ``[R, 1, N, L]`` mask repeated for every (kv head, query head of its group):
        ``[R * kv_heads, group * N, L]``, built once per step and shared by all layers."""
        key = ("grouped_mask", num_kv_heads, group)
        if key not in plan.cache:
            r, _, n, length = mask.shape
            plan.cache[key] = mask.unsqueeze(1).expand(r, num_kv_heads, group, n, length).reshape(
                r * num_kv_heads, group * n, length)
        return plan.cache[key]


def _clock(plan, t0: float, phase: str = "plan") -> None:
    """The seconds since ``t0`` go to the plan's host clock under ``phase``."""
    clock = getattr(plan, "clock", None)
    if clock is not None:
        clock.add(phase, time.perf_counter() - t0)


def bit_permutation(off: torch.Tensor, base: int, block_size: int, head_size: int) -> tuple[int, ...] | None:
    """The layout ``off`` (``[block_size, head_size]`` offsets, ``base`` = start of the region)
    as a permutation of address bits, or None: ``p`` with bit i of ``t * head_size + d``
    stored at address bit ``p[i]`` (bit 0 = least significant). Plain, transposed and the
    AMX tile layouts are all bit permutations (``d % 2`` lowest, then ``t % 16``, ...), so a
    view of the region as ``[2] * bits`` dims and one ``permute`` unpacks it (one strided copy
    instead of an element gather). Example: transposed, block 2, head 2 -> ``(1, 0)``."""
    if block_size & (block_size - 1) or head_size & (head_size - 1):
        return None
    t_bits, d_bits = block_size.bit_length() - 1, head_size.bit_length() - 1
    rel = off - base
    if int(rel[0, 0]) != 0:
        return None
    # logical bit i: d bits are 0..d_bits-1, t bits are d_bits..d_bits+t_bits-1
    steps = [int(rel[0, 1 << j]) for j in range(d_bits)] + [int(rel[1 << i, 0]) for i in range(t_bits)]
    if any(x <= 0 or x & (x - 1) for x in steps):
        return None
    perm = tuple(x.bit_length() - 1 for x in steps)
    if sorted(perm) != list(range(t_bits + d_bits)):
        return None
    logical = torch.arange(block_size * head_size).view(block_size, head_size)
    predicted = torch.zeros_like(logical)
    for i, p in enumerate(perm):
        predicted |= ((logical >> i) & 1) << p
    return perm if torch.equal(predicted, rel) else None


def _unpack(blk, offsets, kind, num_reqs, block_size, head_size, base, transpose=False) -> torch.Tensor:
    """K or V of gathered blocks as float32 ``[R, num_kv_heads, B * block_size, head_size]``,
    or with ``transpose`` as ``[R, num_kv_heads, head_size, B * block_size]`` (K^T for the
    score matmul; free of a transposing copy when the cache already stores K transposed).

    ``kind``: a bit permutation (``bit_permutation``): one strided copy; otherwise an element
    gather through a flat index (``index_select`` along the last dim is ~4x slower)."""
    n, num_kv_heads, _ = blk.shape
    region = block_size * head_size
    per_req = n // num_reqs
    x = blk[..., base : base + region].reshape(num_reqs, per_req, num_kv_heads, region)
    if isinstance(kind, tuple):
        bits = len(kind)
        d_bits = head_size.bit_length() - 1
        # address bit p is view dim (bits - 1 - p); logical bit i < d_bits is a d bit, else a t bit
        t_order = [bits - 1 - kind[i] for i in reversed(range(d_bits, bits))]
        d_order = [bits - 1 - kind[i] for i in reversed(range(d_bits))]
        x = x.reshape(num_reqs, per_req, num_kv_heads, *([2] * bits))
        if transpose:  # [R, kv_heads, d bits, per_req, t bits]
            x = x.permute(0, 2, *(3 + o for o in d_order), 1, *(3 + o for o in t_order))
            out = torch.empty(num_reqs, num_kv_heads, head_size, per_req, block_size, dtype=torch.float32)
        else:  # [R, kv_heads, per_req, t bits, d bits]
            x = x.permute(0, 2, 1, *(3 + o for o in t_order + d_order))
            out = torch.empty(num_reqs, num_kv_heads, per_req, block_size, head_size, dtype=torch.float32)
        out.view(x.shape).copy_(x)
    else:
        flat = (torch.arange(per_req * num_kv_heads).view(-1, 1) * region + (offsets.flatten() - base).view(1, -1))
        x = x.reshape(num_reqs, per_req * num_kv_heads * region).index_select(1, flat.flatten())
        x = x.view(num_reqs, per_req, num_kv_heads, block_size, head_size)
        x = x.permute(0, 2, 4, 1, 3) if transpose else x.transpose(1, 2)
        out = torch.empty(x.shape, dtype=torch.float32).copy_(x)
    if transpose:
        return out.view(num_reqs, num_kv_heads, head_size, per_req * block_size)
    return out.view(num_reqs, num_kv_heads, per_req * block_size, head_size)


class TreeCPUBackend(CPUAttentionBackend):
    """``CPU_ATTN`` with ``TreeCPUAttentionImpl``; registered by the tree worker."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl
