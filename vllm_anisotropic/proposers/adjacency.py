"""Adjacency table: top-K next tokens harvested from the target model's own logits.

Scope: storage, lookup and batched harvest of successor lists. No tree building, no vLLM.

Sources: Token Recycling (Luo et al., ACL 2025, arXiv 2408.08696): an adjacency matrix with one
row of top-k candidate next tokens per vocabulary token, overwritten with the newest top-k of
every forward pass (draft tokens included) and inherited across queries ("hot start"). GOOSE
(arXiv 2604.02047 Sec. 4.1 and Appendix C.1) extends it to two tiers: a dense unigram table
``[vocab_size, K]`` of token ids and logit-derived scores, and a bigram table keyed by the last
two tokens ``(t_{i-1}, t_i)``; logits of every verified node, rejected branches included, and of
the prefill are harvested with one batched top-k.

Terms
-----
successors of a key
    The K most likely next tokens after the key, best first, with their *scores*: softmax
    probabilities (temperature 1) of the target at the harvested position, so scores of one
    row sum to <= 1 and are comparable with the min-branch-score threshold 0.01.
harvest
    For each verified node i with token ``t_i`` and previous token ``t_{i-1}`` (its parent's
    token; for the tree root, the context token before it): row ``t_i`` of the unigram table
    and bigram entry ``(t_{i-1}, t_i)`` are overwritten by the top-K of ``softmax(logits[i])``.
    Within one batch, the last row for a key wins (deterministic). With ``refresh_steps`` (not
    in the papers; off by default) a row whose entries the table wrote in its last
    ``refresh_steps`` harvests is skipped (``AdjacencyTable.skip_fresh``).

Storage (array-backed, so lookups and updates run in compiled kernels, ``kernels.table``):
the unigram tier is dense, ``[vocab_size, K]`` int32 ids and float32 scores; the bigram tier is
an open-addressing hash table of ``bigram_capacity`` slots (a power of two): ``[capacity]``
int64 keys ``prev * vocab_size + token`` (-1 = empty), ``[capacity]`` int64 last-use stamps and
``[capacity, K]`` rows. A key lives in one of the ``WAYS`` = 8 slots that follow its hash (linear
probing, never deleted: a slot is only ever overwritten), so a lookup reads at most 8 keys. A
lookup hit or an overwrite refreshes the entry's stamp; inserting a key whose 8 slots are all
taken evicts the least recently used of them (an 8-way set-associative LRU: exact LRU whenever
the capacity is at most 8).

Memory (``memory_bytes``, fixed at allocation, nothing grows): unigram ``V * K * 8`` bytes
(3.9 MB at V = 49,152, 12.2 MB at V = 151,936 for K = 10), bigram ``capacity * (16 + 8 K)``
bytes (6.3 MB at the default 65,536 slots, K = 10): 18.4 MB a table at V = 151,936; with
``refresh_steps`` int32 written stamps too, ``(V + capacity) * 4`` bytes (19.3 MB).

Tenants (``TenantTables``): with ``shared_table`` every request of one tenant reads and feeds
one table, the hot start of Token Recycling. A shared table is a side channel: what one
request's text taught the table shapes another request's drafts, hence its acceptance and its
latency. So tables are per tenant, the tenant being vLLM's ``cache_salt`` (the key vLLM already
uses to keep tenants' prefix-cache blocks apart); requests without a salt share one table, as
they share prefix-cache blocks. ``shared_table: false`` gives every request a table of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections import OrderedDict

import numpy as np
import torch

from vllm_anisotropic import kernels
from vllm_anisotropic.kernels.split import run_rows
from vllm_anisotropic.proposers.base import RequestState
from vllm_anisotropic.tree import DraftTree

__all__ = ["AdjacencyTable", "DEFAULT_TENANTS", "MAX_TENANT_TABLES", "TenantTables", "TopKRows", "tenant_budget",
           "topk_scores"]

_EMPTY = -1
_CLOCK, _HELD, _EVICTED = 0, 1, 2  # AdjacencyTable.counters (kernels.table: CLOCK, HELD, EVICTED, HARVESTS)
MAX_REFRESH_STEPS = 1 << 20  # refresh_steps' bound: far below the written stamps' 2^30 (kernels.table.NEVER)
_NO_ROW = (np.zeros(0, np.int32), np.zeros(0, np.float32))
MAX_TENANT_TABLES = 64  # salted tables kept per proposer when the vocabulary is not known
DEFAULT_TENANTS = 32  # salted tenants the default draft_state_bytes has room for


def _power_of_two(n: int) -> int:
    """The bigram tier's slot count: ``n`` rounded up to a power of two (65536 -> 65536, 1000 -> 1024)."""
    return 1 << (int(n) - 1).bit_length()


def tenant_budget(config, vocab_size: int | None, extra_bytes: int = 0) -> tuple[int, int | None]:
    """``(salted tenants kept, budget bytes)`` of a harvesting proposer's ``draft_state_bytes``
    (``proposers.config.AdjacencyConfig``): a tenant costs its table's bytes
    (``AdjacencyTable.allocated_bytes``) plus ``extra_bytes`` (GOOSE: its store's bound); the
    unsalted tenant and ``TenantTables``' overflow table take one share each, the rest go to
    salted tenants (at least one). Without a vocabulary (tables sized at their first harvest):
    ``(MAX_TENANT_TABLES, None)``.
    49k vocabulary, top-k 10, 65,536 bigram rows: 10.2 MB a table (10.7 MB with ``refresh_steps``)."""
    if vocab_size is None:
        return MAX_TENANT_TABLES, config.draft_state_bytes
    per = AdjacencyTable.allocated_bytes(vocab_size, config.top_k, config.bigram, config.bigram_capacity,
                                         config.refresh_steps) + extra_bytes
    budget = config.draft_state_bytes or per * (DEFAULT_TENANTS + 2)
    return max(1, budget // per - 2), int(budget)


def topk_scores(logits: torch.Tensor, k: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Batched top-k of ``softmax(logits)``, from the top-k of the logits and one log-sum-exp
    per row: ``p_j = exp(l_j - lse(l))`` for the k largest ``l_j`` (same ids as the top-k of the
    softmax; among equal logits the lower token id first). No normalised copy of the vocabulary
    is written: on the CPU one compiled pass per row, bf16 rows read as they are, in place
    (``kernels.vocab``: ~3x faster than torch's topk + exp + sum), on a GPU torch's topk and
    an in-place exp-sum.

    Args:
        logits: ``[num_rows, vocab_size]`` raw target logits (any float dtype, any device).
        k: number of successors kept per row.
        rows: the rows to take (int, any order, repeats allowed); None: every row. On the CPU
            the kernel reads them where they are (no gathered copy).

    Returns:
        ``([len(rows), k] int32 ids, [len(rows), k] float32 probabilities)``, best first, on CPU.
    """
    assert logits.ndim == 2, logits.shape
    k = min(int(k), int(logits.shape[-1]))
    if logits.device.type == "cpu":
        logits = logits.detach()
        if logits.dtype not in (torch.bfloat16, torch.float32) and rows is not None:
            logits, rows = logits[torch.from_numpy(np.asarray(rows, np.int64))], None  # widened below: the rows only
        # bf16 rows as their 16 bits (the kernel reads them in registers), others as float32
        x = logits.view(torch.int16) if logits.dtype == torch.bfloat16 else logits.to(torch.float32)
        x = np.ascontiguousarray(x.numpy())
        rows = np.arange(x.shape[0], dtype=np.int64) if rows is None else np.asarray(rows, np.int64)
        ids = np.empty((rows.shape[0], k), np.int32)
        probs = np.empty((rows.shape[0], k), np.float32)
        if rows.shape[0] and k:
            vocab = kernels.load("vocab")  # threads: a part of 2 rows or more (kernels.split)
            run_rows(vocab.topk_probs, vocab.topk_probs_threads, rows.shape[0], 2, x, rows, k, ids, probs)
        return ids, probs
    if rows is not None:
        logits = logits.index_select(0, torch.from_numpy(np.asarray(rows, np.int64)).to(logits.device))
    x = logits.to(torch.float32, copy=rows is None)  # [num_rows, vocab_size], ours to overwrite (a gather is)
    top, ids = torch.topk(x, k, dim=-1)
    m = top[:, :1]  # p_j = exp(l_j - m) / sum_i exp(l_i - m), m the row's largest logit
    total = x.sub_(m).exp_().sum(dim=-1, keepdim=True)
    probs = torch.exp(top - m) / total
    return ids.to(torch.int32).cpu().numpy(), probs.cpu().numpy().astype(np.float32)


@dataclasses.dataclass(frozen=True)
class TopKRows:
    """``topk_scores`` of logits rows computed once for a whole step (one top-k of the logits, one
    log-sum-exp and one device-to-host copy for every verified row of the batch); passed where
    logits are accepted, sliced per request like the logits it replaces."""

    ids: np.ndarray  # [num_rows, k] int32
    scores: np.ndarray  # [num_rows, k] float32
    vocab_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.ids.shape[0]), self.vocab_size)

    def __getitem__(self, rows) -> "TopKRows":
        return TopKRows(self.ids[rows], self.scores[rows], self.vocab_size)

    @staticmethod
    def of(logits: torch.Tensor, k: int, rows: np.ndarray | None = None) -> "TopKRows":
        """``topk_scores(logits, k, rows)``: rows ``rows`` of ``logits`` (None: all), in that order."""
        ids, scores = topk_scores(logits, k, rows)
        return TopKRows(ids, scores, int(logits.shape[-1]))


class AdjacencyTable:
    """Two-tier successor table (dense unigram + bounded hash-table bigram); see module docstring.

    ``vocab_size=None`` allocates the arrays lazily at the first harvest (its size read from the
    logits), so a proposer can be built before the model's vocabulary is known.
    """

    def __init__(
        self,
        vocab_size: int | None = None,
        top_k: int = 10,
        bigram: bool = True,
        bigram_capacity: int = 65536,
        refresh_steps: int = 0,
    ) -> None:
        if top_k < 1:
            raise ValueError("top_k must be >= 1")
        if bigram_capacity < 1:
            raise ValueError("bigram_capacity must be >= 1")
        if not 0 <= refresh_steps <= MAX_REFRESH_STEPS:
            raise ValueError(f"refresh_steps must be in [0, {MAX_REFRESH_STEPS}], got {refresh_steps}")
        self.top_k = int(top_k)
        self.use_bigram = bool(bigram)
        self.bigram_capacity = _power_of_two(bigram_capacity)
        self.refresh_steps = int(refresh_steps)
        self.vocab_size: int | None = None
        # [vocab_size, top_k] int32 successor ids (-1 = empty); [vocab_size, top_k] float32 scores
        self.unigram_ids: np.ndarray | None = None
        self.unigram_scores: np.ndarray | None = None
        # bigram tier: [capacity] int64 keys (-1 = empty) and last-use stamps, [capacity, top_k] rows
        self.bigram_keys: np.ndarray | None = None
        self.bigram_stamps: np.ndarray | None = None
        self.bigram_ids: np.ndarray | None = None
        self.bigram_scores: np.ndarray | None = None
        # [vocab_size], [capacity] int32: the harvest clock when an entry was last written
        # (empty without refresh_steps)
        self.unigram_written: np.ndarray | None = None
        self.bigram_written: np.ndarray | None = None
        # [4] int64: the stamp clock, bigram entries held, evictions, the harvest clock (mutated by the kernels)
        self.counters = np.zeros(4, np.int64)
        self.num_harvested = 0
        self.num_skipped = 0  # rows not harvested: their entries were written within refresh_steps
        self.frozen = False  # True: stays empty, harvests are dropped (TenantTables' overflow tenant)
        if vocab_size is not None:
            self._allocate(int(vocab_size))

    @classmethod
    def for_config(cls, config, vocab_size: int | None) -> "AdjacencyTable":
        """An empty table with an ``AdjacencyConfig``'s keys."""
        return cls(vocab_size, config.top_k, bigram=config.bigram, bigram_capacity=config.bigram_capacity,
                   refresh_steps=config.refresh_steps)

    @staticmethod
    def allocated_bytes(vocab_size: int, top_k: int, bigram: bool, bigram_capacity: int, refresh_steps: int = 0) -> int:
        """Bytes of a table's arrays once allocated (``memory_bytes()["total"]``), from its keys."""
        cap = _power_of_two(bigram_capacity) if bigram else 1
        written = (int(vocab_size) + cap) * 4 if refresh_steps else 0
        return int(vocab_size) * int(top_k) * 8 + cap * (16 + int(top_k) * 8) + written

    def _allocate(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.unigram_ids = np.full((vocab_size, self.top_k), _EMPTY, np.int32)
        self.unigram_scores = np.zeros((vocab_size, self.top_k), np.float32)
        cap = self.bigram_capacity if self.use_bigram else 1
        self.bigram_keys = np.full(cap, _EMPTY, np.int64)
        self.bigram_stamps = np.zeros(cap, np.int64)
        self.bigram_ids = np.full((cap, self.top_k), _EMPTY, np.int32)
        self.bigram_scores = np.zeros((cap, self.top_k), np.float32)
        stamped = (vocab_size, cap) if self.refresh_steps else (0, 0)
        self.unigram_written = np.full(stamped[0], kernels.load("table").NEVER, np.int32)
        self.bigram_written = np.full(stamped[1], kernels.load("table").NEVER, np.int32)

    @property
    def arrays(self) -> tuple:
        """The arrays the kernels read and write, in ``kernels.table``'s argument order."""
        return (self.unigram_ids, self.unigram_scores, self.bigram_keys, self.bigram_stamps, self.bigram_ids,
                self.bigram_scores, self.counters)

    # ------------------------------------------------------------------ state
    @property
    def is_empty(self) -> bool:
        return self.num_harvested == 0

    def __len__(self) -> int:
        """Number of bigram entries held."""
        return int(self.counters[_HELD])

    @property
    def evictions(self) -> int:
        """Bigram entries evicted so far (their 8 slots were full)."""
        return int(self.counters[_EVICTED])

    def bigram_slot(self, prev_token: int, token: int) -> int:
        """The slot holding bigram ``(prev_token, token)``, or -1 (no refresh)."""
        if self.bigram_keys is None or not self.use_bigram:
            return -1
        return int(kernels.load("table").find(self.bigram_keys, int(prev_token) * self.vocab_size + int(token)))

    def bigram_key_set(self) -> set[int]:
        """The bigram keys held (``prev * vocab_size + token``)."""
        if self.bigram_keys is None or not self.use_bigram:
            return set()
        return set(self.bigram_keys[self.bigram_keys >= 0].tolist())

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held: unigram arrays, bigram rows, bigram keys and stamps, written stamps, total."""
        if self.unigram_ids is None:
            return {"unigram": 0, "bigram_rows": 0, "bigram_index": 0, "written": 0, "total": 0}
        uni = self.unigram_ids.nbytes + self.unigram_scores.nbytes
        bi = self.bigram_ids.nbytes + self.bigram_scores.nbytes
        index = self.bigram_keys.nbytes + self.bigram_stamps.nbytes
        written = self.unigram_written.nbytes + self.bigram_written.nbytes
        return {"unigram": uni, "bigram_rows": bi, "bigram_index": index, "written": written,
                "total": uni + bi + index + written}

    # ------------------------------------------------------------------ lookup
    def successors(self, prev_token: int, token: int) -> tuple[np.ndarray, np.ndarray]:
        """Successor ids and scores of ``(prev_token, token)``: the bigram row when present
        (its stamp refreshed), else the unigram row of ``token``; only the filled entries.

        ``prev_token < 0`` skips the bigram tier.
        """
        if self.unigram_ids is None or not 0 <= token < self.vocab_size:
            return _NO_ROW
        tk = kernels.load("table")
        tier, row = tk.lookup(*self.arrays, int(prev_token), int(token), self.vocab_size, self.use_bigram)
        ids, scores = (self.bigram_ids[row], self.bigram_scores[row]) if tier == tk.BIGRAM else (
            self.unigram_ids[row], self.unigram_scores[row])
        filled = ids >= 0
        return ids[filled], scores[filled]

    # ------------------------------------------------------------------ updates
    def update(
        self,
        prev_tokens,  # [num_tokens] int, -1 = no previous token (skip bigram)
        tokens,  # [num_tokens] int
        top_ids: np.ndarray,  # [num_tokens, top_k] int32
        top_scores: np.ndarray,  # [num_tokens, top_k] float32
    ) -> None:
        """Overwrite the rows of ``tokens`` (and bigram keys) with the given successors, in
        order (duplicate keys in one call: the last row wins). Rows narrower than ``top_k``
        leave the rest empty; wider ones are cut to ``top_k``. A ``frozen`` table ignores it."""
        if self.frozen:
            return
        tokens = np.ascontiguousarray(tokens, np.int64).reshape(-1)
        prev_tokens = np.ascontiguousarray(prev_tokens, np.int64).reshape(-1)
        n = tokens.shape[0]
        assert prev_tokens.shape == (n,) and top_ids.shape[0] == n and top_scores.shape == top_ids.shape
        if n == 0:
            return
        if self.unigram_ids is None:
            raise ValueError("vocab_size unknown: harvest logits first or pass vocab_size")
        kernels.load("table").update(*self.arrays, prev_tokens, tokens, np.ascontiguousarray(top_ids, np.int32),
                                     np.ascontiguousarray(top_scores, np.float32), self.vocab_size, self.use_bigram,
                                     self.unigram_written, self.bigram_written)
        self.num_harvested += n

    def skip_fresh(self, prev_tokens: np.ndarray, tokens: np.ndarray, live: np.ndarray) -> int:
        """One harvest's rows against ``refresh_steps``: ``live[k]`` (int64 ``prev_tokens`` /
        ``tokens``, bool ``live``, one per row) becomes False where every entry row k would write
        was written in the table's last ``refresh_steps`` harvests (``kernels.table.skip_fresh``;
        the harvest clock ticks once a call, whether or not anything is written). Called once a
        harvest, before the rows' top-k; returns the rows left live."""
        num_live = int(np.count_nonzero(live))
        if not self.refresh_steps or self.unigram_written is None or not self.unigram_written.size or self.frozen:
            return num_live
        left = kernels.load("table").skip_fresh(self.unigram_written, self.bigram_keys, self.bigram_stamps,
                                                self.bigram_written, self.counters, prev_tokens, tokens,
                                                self.vocab_size, self.use_bigram, self.refresh_steps, live)
        self.num_skipped += num_live - left
        return int(left)

    def forget_writes(self) -> None:
        """Every entry taken as never written (the next row of each key is harvested): what the
        tensor-parallel ranks do together when their trees differ (``TreeDrafter.forget_writes``), so
        that one rank's missed harvest does not keep its windows out of step with the others'."""
        if self.unigram_written is not None:
            self.unigram_written.fill(kernels.load("table").NEVER)
            self.bigram_written.fill(kernels.load("table").NEVER)

    def harvest(
        self,
        prev_tokens,  # [num_tokens] int, -1 = none
        tokens,  # [num_tokens] int
        logits: torch.Tensor | TopKRows,  # [num_tokens, vocab_size], or their top-k
        checked: bool = False,
    ) -> None:
        """One batched top-k over ``softmax(logits)`` rows (unless given), then ``update``. With
        ``refresh_steps``, the rows whose entries are fresh (``skip_fresh``: one tick of the
        harvest clock) are neither ranked nor written, unless ``checked``: the caller ran
        ``skip_fresh`` for this harvest and passes the live rows only (``learn_batch``)."""
        if logits.shape[0] == 0 or self.frozen:
            return
        if self.unigram_ids is None:
            self._allocate(int(logits.shape[-1]))
        assert logits.shape[-1] >= self.vocab_size, (logits.shape, self.vocab_size)
        rows = None
        if not checked:
            prev_tokens, tokens, rows = self._unfresh(prev_tokens, tokens)
        if isinstance(logits, TopKRows):
            if logits.ids.shape[1] < min(self.top_k, logits.vocab_size):
                raise ValueError(f"precomputed top-{logits.ids.shape[1]} rows, table keeps top-{self.top_k}")
            top = logits if rows is None else logits[rows]
            ids, scores = top.ids[:, : self.top_k], top.scores[:, : self.top_k]
        else:
            ids, scores = topk_scores(logits, self.top_k, rows)
        self.update(prev_tokens, tokens, ids, scores)

    def _unfresh(self, prev_tokens, tokens) -> tuple:
        """``(prev_tokens, tokens, rows)`` of one harvest without its fresh rows (``skip_fresh``):
        ``rows`` the kept rows' indices, None when every row is kept (or no window)."""
        if not self.refresh_steps:
            return prev_tokens, tokens, None
        prev_tokens = np.ascontiguousarray(prev_tokens, np.int64).reshape(-1)
        tokens = np.ascontiguousarray(tokens, np.int64).reshape(-1)
        live = np.ones(tokens.shape[0], np.bool_)
        if self.skip_fresh(prev_tokens, tokens, live) == tokens.shape[0]:
            return prev_tokens, tokens, None
        rows = np.flatnonzero(live)
        return prev_tokens[rows], tokens[rows], rows

    def harvest_tree(self, tree, prev_root_token: int, logits: torch.Tensor) -> None:
        """Harvest every node of a verified ``DraftTree`` (rejected branches included).

        Node i is keyed by ``(tokens[parents[i]], tokens[i])``; the root by
        ``(prev_root_token, tokens[0])``. ``logits`` is ``[num_nodes, vocab_size]``.
        """
        assert logits.shape[0] == tree.num_nodes, (logits.shape, tree.num_nodes)
        prev = np.empty(tree.num_nodes, np.int64)
        prev[0] = prev_root_token
        prev[1:] = tree.tokens[tree.parents[1:]]
        self.harvest(prev, tree.tokens, logits)

    def harvest_sequence(self, tokens, logits: torch.Tensor, chunk: int = 1024) -> None:
        """Harvest a prefill: row j of ``logits`` follows ``tokens[j]`` (prev ``tokens[j-1]``);
        one harvest (one ``skip_fresh`` over the whole prompt), its top-k ``chunk`` rows at a time."""
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        assert logits.shape[0] == tokens.shape[0], (logits.shape, tokens.shape)
        if tokens.shape[0] == 0 or self.frozen:
            return
        if self.unigram_ids is None:
            self._allocate(int(logits.shape[-1]))
        assert logits.shape[-1] >= self.vocab_size, (logits.shape, self.vocab_size)
        prev, tokens, rows = self._unfresh(np.concatenate([[-1], tokens[:-1]]), tokens)
        for s in range(0, tokens.shape[0], chunk):  # the kept rows (all: rows None), chunk by chunk
            if rows is None:
                ids, scores = topk_scores(logits[s : s + chunk], self.top_k)
            else:
                ids, scores = topk_scores(logits, self.top_k, rows[s : s + chunk])
            self.update(prev[s : s + chunk], tokens[s : s + chunk], ids, scores)


class HarvestingState(RequestState):
    """Per-request state of a proposer whose drafts come from an ``AdjacencyTable``.

    Harvests the logits of every verified node (rejected branches included) and of the prefill
    into ``self.table``; subclasses set ``table`` and keep ``_prev_root`` (the token before the
    root, the bigram key of the root's successors) up to date in ``propose``.
    """

    table: AdjacencyTable
    _prev_root: int = -1

    @property
    def harvest_top_k(self) -> int:
        return self.table.top_k

    def observe(self, tree: DraftTree, accepted, logits: torch.Tensor | None, prev_root: int | None = None) -> None:
        """Harvest the verified rows; ``prev_root``: the bigram key's first token, the token
        before ``tree``'s root (default: the one ``propose`` saw last)."""
        if logits is not None:
            self.table.harvest_tree(tree, self._prev_root if prev_root is None else prev_root, logits)

    def observe_later(self, tree: DraftTree, accepted):
        # the next propose moves _prev_root to the next root's predecessor
        return functools.partial(self.observe, tree, accepted, prev_root=self._prev_root)

    def observe_prefill(self, prompt_tokens, logits: torch.Tensor | None) -> None:
        if logits is not None:
            self.table.harvest_sequence(prompt_tokens, logits)


class TenantTables:
    """The adjacency tables (or any per-tenant state: GOOSE's stores) of one harvesting
    proposer: one per tenant (module docstring).

    ``for_request(tenant)``: with ``shared`` the tenant's table (created empty at its first
    request; tenant None = requests without a ``cache_salt``), else a new empty table. At most
    ``max_tenants`` salted tables are alive at once, which bounds memory at ``max_tenants + 2``
    tables (the unsalted one and the overflow one below): a new tenant takes the place of the
    least recently used tenant that no request in flight holds (dropped, it starts cold again
    when it returns). When every place is held, a new tenant's requests get the *overflow*
    table: one per proposer, ``frozen`` (always empty, never harvested, so no tenant learns
    from another), until a place frees. "Held" is read from the table's references (a weak
    reference outlives the proposer's own only if a request holds the table).
    ``tables.for_request("a") is tables.for_request("a") is not tables.for_request("b")``.
    """

    def __init__(self, make, shared: bool, max_tenants: int = MAX_TENANT_TABLES) -> None:
        self.make = make  # () -> a table (or store) with a ``frozen`` attribute
        self.shared = bool(shared)
        self.max_tenants = max(1, int(max_tenants))
        self.default: AdjacencyTable | None = make() if self.shared else None
        self._salted: OrderedDict[str, AdjacencyTable] = OrderedDict()  # least recently used first
        self._overflow = None  # the frozen table, made at the first overflow

    def for_request(self, tenant: str | None = None):
        if not self.shared:
            return self.make()
        if tenant is None:
            return self.default
        table = self._salted.pop(tenant, None)
        if table is None:
            if len(self._salted) >= self.max_tenants and not self._drop_one():
                return self.overflow()  # every place is held: not kept, not learned
            table = self.make()
        self._salted[tenant] = table  # most recently used last
        return table

    def _drop_one(self) -> bool:
        """Drop the least recently used salted table no request holds; False: all are held."""
        held = []
        dropped = False
        for tenant in list(self._salted):  # least recently used first
            probe = weakref.ref(self._salted.pop(tenant))
            if probe() is None:  # the proposer's reference was the last: freed
                dropped = True
                break
            held.append((tenant, probe()))
        rest, self._salted = self._salted, OrderedDict(held)  # the held ones keep their places
        self._salted.update(rest)
        return dropped

    def overflow(self):
        """The frozen table of tenants that found every place in use."""
        if self._overflow is None:
            self._overflow = self.make()
            self._overflow.frozen = True
        return self._overflow

    def all(self) -> list:
        """Every table held: the unsalted default (if any), the salted ones and the overflow one
        (if made)."""
        return ([self.default] if self.default is not None else []) + list(self._salted.values()) + \
            ([self._overflow] if self._overflow is not None else [])

    @property
    def num_tenants(self) -> int:
        """Salted tables held (the unsalted default and the overflow table not counted)."""
        return len(self._salted)
