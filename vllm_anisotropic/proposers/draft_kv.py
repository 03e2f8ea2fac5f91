"""q's KV cache for all of an engine's requests: one slot per request, tree tokens masked in place.

Scope: the draft model q of ``draft_tree`` as the engine runs it (``draft_batch.py``). Per
layer, one K and one V tensor ``[slots, kv_heads, columns, head_dim]`` on q's device and in its
dtype (``DraftKV``). A request's session (``DraftSession.slot``) owns one slot: its tokens from
column 0 on, contiguous, column = position. A step's drafting requests sit in slots 0..R-1
(``DraftKV.place`` moves rows only when the set of drafting requests changes), so a forward's
keys and values are views of the first R slots, never a copy.

A forward (``DraftKV.forward``) packs the step's new tokens of every row into one sequence: the
linear layers see only real tokens (a new prompt runs in the same forward as the others'
accepted tokens, no padding), and only the attention pads the queries: the rows of at most
``LONG_ROW`` new tokens in one call, ``[R, n]`` for the longest n of them, and each longer row
(a prompt) in a call of its own (``_groups``); on the CPU the short rows' call is
``short_rows_attention`` (float32, two batched matmuls), the others torch's SDPA. Each
token's K/V is written into its row at its column before the attention reads the row. Tokens
are of two kinds:

* **chain** tokens (a request's context, the trunk): column = position, and each sees every
  column before it and itself;
* **lane** tokens (the branches of a delayed tree): branch k at depth j sits at column
  ``base + j K + k`` after the trunk (``base``, the trunk's end) and position ``base + j``; it
  sees the chain before ``base`` and the tokens of its own lane up to itself (tree attention).

After the step a session keeps its chain (context + trunk); the lane columns are overwritten by
the next step. Cropping a session (a rejected trunk) is setting its length.

Memory: slots x columns x ``DraftLM.kv_bytes_per_token``. Columns grow by doubling to what the
longest row of a step needs; slots grow by one per new request and are reused when requests
finish. ``bound`` (bytes; the engine's reserve out of vLLM's KV memory) caps it: a growth that
would pass it first drops the sessions that are not drafting in this step, least recently
drafted first, and rows of the step that still do not fit draft nothing this step (``DraftKV.fit``;
both counted in ``evictions``). A dropped session is rebuilt from the context when its request drafts again.

The attention runs through transformers' attention interface (``ATTENTION``, registered once):
a forward runs q without a transformers cache and passes its ``_Forward`` down to the attention
(``draft_forward``), which writes the tokens' K/V (after RoPE) and attends over the rows; every
other call of q (the one-request reference path, ``draft_model.py``) goes to transformers' SDPA
as before. On the engine's CPU, q's decoder is instead one loop on vLLM's kernels
(``DraftLM.layers_forward``, integration/vllm/kernels/cpu_draft.py) that calls the same plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from vllm_anisotropic.proposers.draft_common import attention_dims

__all__ = ["ATTENTION", "DraftKV", "short_rows_attention"]

ATTENTION = "vllm_anisotropic_draft"
MIN_COLUMNS = 256
LONG_ROW = 32  # a row with more new tokens than this attends in a call of its own (``_groups``)


def _attention(module, query, key, value, attention_mask, scaling=None, draft_forward=None, **kwargs):
    """transformers' attention interface: a ``_Forward``'s rows (this module's docstring), else SDPA."""
    if draft_forward is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    draft_forward.write(module.layer_idx, key, value)
    return draft_forward.attend(module.layer_idx, query, scaling)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)


@dataclass
class _Group:
    """Rows ``start``..``stop`` - 1 attending in one call: their tokens ``tokens`` (indices into
    the packed tokens) padded to ``n`` queries per row, over the first ``width`` columns."""

    start: int
    stop: int
    n: int
    width: int
    tokens: torch.Tensor | None  # [t] the group's packed tokens, None: all of the forward's, in order
    pad: torch.Tensor | None  # [t] their indices in the group's [(stop - start) * n] padded queries; None: no padding
    mask: torch.Tensor  # [stop - start, 1, n, width] bool: query i of a row sees column c


@dataclass
class _Forward:
    """One packed forward's plan (``DraftKV.forward``): where each token goes and what it sees."""

    kv: "DraftKV"
    rows: torch.Tensor  # [T] row of each packed token
    columns: torch.Tensor  # [T] its column
    groups: list  # [_Group]: every token in exactly one

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The packed tokens' K/V ([1, kv_heads, T, dim], after RoPE) into their rows and columns."""
        self.kv.keys[layer][self.rows, :, self.columns] = key[0].transpose(0, 1)
        self.kv.values[layer][self.rows, :, self.columns] = value[0].transpose(0, 1)

    def attend(self, layer: int, query: torch.Tensor, scaling) -> tuple[torch.Tensor, None]:
        heads, dim = query.shape[1], query.shape[3]
        packed = query[0].transpose(0, 1)  # [T, heads, dim]
        out = None
        for g in self.groups:
            rows = g.stop - g.start
            if g.pad is None:  # every row of the forward holds n tokens: the packed queries as they are
                padded = packed
            else:
                padded = packed.new_zeros(rows * g.n, heads, dim)
                padded[g.pad] = packed if g.tokens is None else packed[g.tokens]
            padded = padded.view(rows, g.n, heads, dim).transpose(1, 2)
            keys = self.kv.keys[layer][g.start : g.stop, :, : g.width]  # views: no copy
            values = self.kv.values[layer][g.start : g.stop, :, : g.width]
            if not padded.is_cuda and g.n <= LONG_ROW:
                got = short_rows_attention(padded, keys, values, g.mask, scaling)
            else:
                with _backends(padded, g.n):
                    got = torch.nn.functional.scaled_dot_product_attention(padded, keys, values, attn_mask=g.mask,
                                                                           scale=scaling, enable_gqa=True)
            got = got.transpose(1, 2).reshape(rows * g.n, heads, dim)
            if g.pad is not None:
                got = got[g.pad]  # padding dropped
            if g.tokens is None:  # the forward's only call: every token, in order
                return got[None], None
            if out is None:
                out = packed.new_empty(packed.shape)
            out[g.tokens] = got
        return out[None], None


class DraftKV:
    """q's KV for every request of the engine (module docstring)."""

    def __init__(self, lm, bound: int | None = None) -> None:
        _register()
        self.lm = lm
        config = lm.model.config
        _, self.kv_heads, self.head_dim = attention_dims(config)
        self.num_layers = int(config.num_hidden_layers)
        self.bound = bound
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots: list = []  # the session in each slot, None: free
        self.columns = 0
        self.evictions = 0  # sessions dropped, or request-steps left without drafts, to stay within the bound
        self.peak = 0  # the most bytes the slots took
        if lm.model.config._attn_implementation != ATTENTION:
            lm.model.set_attn_implementation(ATTENTION)

    def bytes(self) -> int:
        return len(self.slots) * self.columns * self.lm.kv_bytes_per_token

    def free(self, session) -> None:
        """The session's request finished, was preempted or was dropped: its slot is free (the
        tensors go when no session holds one)."""
        if session.slot is not None and session.slot < len(self.slots) and self.slots[session.slot] is session:
            self.slots[session.slot] = None
        session.slot = None
        if all(s is None for s in self.slots):
            self.keys, self.values, self.slots, self.columns = [], [], [], 0

    def drop(self, session, refused: bool = False) -> None:
        """Evict ``session`` (its request drafts again from a rebuilt cache), counted if it held
        tokens or its request-step is ``refused`` drafts."""
        self.free(session)
        if session.tokens or refused:
            self.evictions += 1
        session.tokens = []

    def fit(self, sessions: list, needs: list[int]) -> list[int]:
        """The indices of ``sessions`` (this step's drafting requests, ``needs[i]`` columns each)
        that draft this step: every one, unless the bound is reached, then those that fit,
        shortest need first; the others are dropped (module docstring)."""
        if self.bound is None:
            return list(range(len(sessions)))
        per_token = self.lm.kv_bytes_per_token
        kept, widest = [], 0
        for i in sorted(range(len(sessions)), key=lambda i: needs[i]):
            columns = _columns(max(widest, needs[i]))
            if (len(kept) + 1) * columns * per_token > self.bound:
                self.drop(sessions[i], refused=True)
                continue
            kept.append(i)
            widest = max(widest, needs[i])
        return sorted(kept)

    def place(self, sessions: list, needs: list[int]) -> None:
        """Sessions ``sessions`` (this step's, already ``fit``) in slots 0..R-1 with at least
        ``needs[i]`` columns each. Rows are copied only when the columns grow or a session has to
        move (the step's set changed); the other requests' sessions are kept after the step's,
        or dropped, least recently drafted first, when keeping them would pass the bound."""
        rows = len(sessions)
        columns = max(self.columns, _columns(max(needs, default=0)))
        step = {id(s) for s in sessions}
        outsiders = [s for s in self.slots if s is not None and id(s) not in step]
        if self.bound is not None:
            room = max(0, self.bound // (columns * self.lm.kv_bytes_per_token) - rows)  # outsiders kept
            for s in sorted(outsiders, key=lambda s: (s.last_step, -len(s.tokens)))[: max(0, len(outsiders) - room)]:
                self.drop(s)
            outsiders = [s for s in outsiders if s.slot is not None]
        for s in sessions:
            if s.slot is None:
                s.tokens = []  # nothing of it in the slots (a new or dropped session)
        free = [j for j in range(min(rows, len(self.slots))) if self.slots[j] is None]
        homeless = [s for s in sessions if s.slot is None]
        if (columns == self.columns and len(self.slots) >= rows and len(homeless) <= len(free)
                and all(s.slot is None or s.slot < rows for s in sessions)):
            for s, j in zip(homeless, free):  # free rows below R: no copy
                s.slot, self.slots[j] = j, s
            return
        self._relayout([s.slot for s in sessions] + [s.slot for s in outsiders], sessions + outsiders, columns)

    def _relayout(self, order: list, sessions: list, columns: int) -> None:
        """New tensors: row j holds old slot ``order[j]``'s entries (None: an empty row) and
        belongs to ``sessions[j]``; ``columns`` columns."""
        shape = (len(order), self.kv_heads, columns, self.head_dim)
        width = min(columns, self.columns)
        moved = [j for j, old in enumerate(order) if old is not None]
        into = torch.tensor(moved, dtype=torch.long, device=self.lm.device)
        source = torch.tensor([order[j] for j in moved], dtype=torch.long, device=self.lm.device)

        def moved_copy(tensor):
            out = torch.zeros(shape, dtype=self.lm.dtype, device=self.lm.device)
            if moved and width:
                out[into, :, :width] = tensor.index_select(0, source)[:, :, :width]
            return out

        empty = [None] * self.num_layers  # the first placement: nothing to move
        self.keys = [moved_copy(t) for t in self.keys or empty]
        self.values = [moved_copy(t) for t in self.values or empty]
        for j, s in enumerate(sessions):
            s.slot = j
        self.slots, self.columns = list(sessions), columns
        self.peak = max(self.peak, self.bytes())

    @torch.inference_mode()
    def forward(self, rows: int, tokens: list[list[int]], starts: list[int], lanes: list[int | None],
                bases: list[int], want: str = "last") -> torch.Tensor:
        """Run row b's ``tokens[b]`` at columns ``starts[b]``.. (row b of slots 0..R-1): chain
        tokens when ``lanes[b]`` is None (positions = columns), else ``lanes[b]`` lanes of a
        delayed tree's branches after the trunk's end ``bases[b]`` (one token per lane, the
        tokens at columns ``starts[b]`` + k for lane k, depth (starts[b] - bases[b]) / lanes[b]).
        Returns q's logits (float32, on the host) after the last token of each row (``want``
        "last": [R, vocab]) or after every token ([T, vocab] in row order)."""
        counts = [len(t) for t in tokens]
        total = sum(counts)
        device = self.lm.device
        row_of = np.repeat(np.arange(rows), counts)
        offset = np.arange(total) - np.repeat(np.cumsum([0] + counts[:-1]), counts)  # index within its row
        start = np.asarray(starts, np.int64)[row_of]
        columns = start + offset
        lane_count = np.asarray([k or 0 for k in lanes], np.int64)[row_of]  # K of each token's row, 0: chain
        is_lane = lane_count > 0
        k = np.maximum(lane_count, 1)
        base = np.asarray(bases, np.int64)[row_of]
        depth = np.where(is_lane, (start - base) // k, 0)
        positions = np.where(is_lane, base + depth, columns)
        width = int(columns.max()) + 1 if total else 0
        if width > self.columns:
            raise ValueError(f"draft KV: column {width - 1} past the {self.columns} placed")
        # what each query sees: chain queries, the columns up to their own; lane k at depth j,
        # the chain before the base and columns base + j' K + k for j' <= j
        col = np.arange(width)[None, :]
        chain_end = np.where(is_lane, base, columns + 1)[:, None]
        sees = col < chain_end
        if is_lane.any():
            rel = col - base[:, None]
            same_lane = (rel >= 0) & (rel % k[:, None] == ((columns - base) % k)[:, None]) & (col <= columns[:, None])
            sees |= is_lane[:, None] & same_lane
        plan = _Forward(self, torch.from_numpy(row_of).to(device), torch.from_numpy(columns).to(device),
                        _groups(counts, row_of, offset, columns, sees, device))
        ids = torch.tensor(np.concatenate([np.asarray(t, np.int64) for t in tokens if len(t)]), dtype=torch.long)
        model = self.lm.model
        ids, positions = ids.to(device), torch.from_numpy(positions).to(device)
        if self.lm.layers_forward is not None:
            hidden = self.lm.layers_forward(ids, positions, plan)
        else:
            hidden = model.get_decoder()(input_ids=ids[None], position_ids=positions[None], use_cache=False,
                                         draft_forward=plan).last_hidden_state[0]
        if want == "last":
            last = np.cumsum(counts) - 1
            hidden = hidden[torch.from_numpy(np.where(np.asarray(counts) > 0, last, 0)).to(device)]
        return model.get_output_embeddings()(hidden).float().cpu()  # the laws and draws on the host


def short_rows_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                         scale: float | None) -> torch.Tensor:
    """Masked attention of short rows on the CPU (decode steps, lane depths: at most ``LONG_ROW``
    queries a row), in float32: ``query [R, heads, n, dim]``, ``keys`` / ``values`` ``[R, kv_heads,
    width, dim]`` (query head h reads kv head ``h // (heads / kv_heads)``), ``mask [R, 1, n,
    width]`` bool (True: may attend); returns ``[R, heads, n, dim]`` in the query's dtype. A row
    whose mask is all False (padding) comes out NaN; callers drop it.

    Why not torch's SDPA: on a CPU without AMX its bf16 kernel is slow for these shapes. Measured
    on a 2-core AMD EPYC with AVX-512 (Qwen2.5-0.5B's 14:2 heads x 64, bf16,
    docs/measurements/cpu/q_short_rows_attention_2026_12_04.txt): 4 rows x 1 query over 301
    columns 1,870 us against 159 us here, 8 x 1 over 601 3,898 against 403 us; its math backend
    is slower still; q's decode forward of 8 rows after 600 tokens 144-151 -> 58-64 ms. On the
    Xeon with AMX SDPA took ~140 us a call (4 x 1); this function was not timed there. float32
    is what the scores accumulate in either way. The query heads of one kv head are one matrix:
    ``[R, kv_heads, group * n, dim]`` against ``[R, kv_heads, dim, width]``, two batched matmuls."""
    rows, heads, n, dim = query.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = query.float().reshape(rows, kv_heads, group * n, dim)
    scores = torch.matmul(q, keys.float().transpose(-1, -2)).view(rows, kv_heads, group, n, width)
    scores.mul_(dim ** -0.5 if scale is None else scale)
    scores.masked_fill_(~mask.view(rows, 1, 1, n, width), float("-inf"))
    weights = torch.softmax(scores, dim=-1).view(rows, kv_heads, group * n, width)
    return torch.matmul(weights, values.float()).view(rows, heads, n, dim).to(query.dtype)


def _backends(query: torch.Tensor, n: int):
    """SDPA's backend for one attention call: on CUDA, rows of at most ``LONG_ROW`` queries
    (decode steps, lane depths) take the math backend; else torch's choice. With a boolean mask
    and GQA torch picks cuDNN on an H200, which plans each new mask shape on the host: measured
    there (docs/measurements/h200/gpu_kv_sdpa_probe_2026_12_04.txt, random q of Qwen2.5-0.5B's
    shape, 8 requests, bf16) 151 ms a drafting forward against 38.5 ms with the math backend
    (flash takes no mask; memory-efficient no GQA with a mask). The math backend's scores are
    ``[rows, heads, n, width]``: small for short rows, not for a prompt's."""
    if query.is_cuda and n <= LONG_ROW:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()


def _groups(counts: list[int], row_of: np.ndarray, offset: np.ndarray, columns: np.ndarray, sees: np.ndarray,
            device) -> list[_Group]:
    """The attention calls of a forward: each row with more than ``LONG_ROW`` tokens alone (a
    prompt), the others together padded to the longest of them. One call for all rows would pad
    every row to the prompt's length: measured on this project's Xeon (Qwen2.5-0.5B, bf16), a
    250-token prompt next to three rows of 2 tokens spent 81 of its forward's 212 ms in the
    attention that way."""
    rows = len(counts)
    short = [b for b in range(rows) if 0 < counts[b] <= LONG_ROW]
    spans = ([(0, rows, short)] if short else []) + [(b, b + 1, [b]) for b in range(rows) if counts[b] > LONG_ROW]
    groups = []
    for start, stop, members in spans:  # the short rows' call has the long rows as empty rows: views, no copy
        chosen = np.flatnonzero(np.isin(row_of, members))
        n = max(counts[b] for b in members)
        width = int(columns[chosen].max()) + 1
        pad = (row_of[chosen] - start) * n + offset[chosen]
        mask = np.zeros(((stop - start) * n, width), bool)
        mask[pad] = sees[chosen, :width]
        tokens = None if len(chosen) == len(row_of) else torch.from_numpy(chosen).to(device)
        if tokens is None and len(chosen) == (stop - start) * n:  # no padding (a decode step, a lane depth)
            pad_t = None
        else:
            pad_t = torch.from_numpy(pad).to(device)
        groups.append(_Group(start, stop, n, width, tokens, pad_t,
                             torch.from_numpy(mask).view(stop - start, 1, n, width).to(device)))
    return groups


def _columns(need: int) -> int:
    """Columns for ``need``: the next power of two from ``MIN_COLUMNS``."""
    columns = MIN_COLUMNS
    while columns < need:
        columns *= 2
    return columns
