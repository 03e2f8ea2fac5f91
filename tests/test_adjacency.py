"""Adjacency table: harvest vs a naive top-k loop, tiers, LRU bound, memory."""

from __future__ import annotations

import numpy as np
import torch

from vllm_anisotropic.proposers.adjacency import AdjacencyTable, topk_scores
from vllm_anisotropic.tree import DraftTree


def _naive_topk(row: torch.Tensor, k: int):
    p = torch.softmax(row.double(), -1).tolist()
    order = sorted(range(len(p)), key=lambda j: (-p[j], j))[:k]
    return order, [p[j] for j in order]


def test_harvest_matches_naive_topk():
    g = torch.Generator().manual_seed(0)
    vocab, k = 50, 10
    tokens = [3, 7, 3, 9, 12]
    prev = [1, 3, 2, -1, 9]
    logits = torch.randn(len(tokens), vocab, generator=g) * 3
    t = AdjacencyTable(vocab, k)
    t.harvest(prev, tokens, logits)
    for i, (pv, tok) in enumerate(zip(prev, tokens)):
        ids, scores = _naive_topk(logits[i], k)
        if pv >= 0:
            got_ids, got_scores = t.successors(pv, tok)
            assert got_ids.tolist() == ids
            np.testing.assert_allclose(got_scores, scores, rtol=1e-5)
    # unigram row of token 3 = last harvested row for 3 (index 2)
    ids2, _ = _naive_topk(logits[2], k)
    assert t.unigram_ids[3].tolist() == ids2
    # bigram miss -> unigram row
    assert t.successors(40, 3)[0].tolist() == ids2
    assert t.successors(-1, 9)[0].tolist() == _naive_topk(logits[3], k)[0]


def test_empty_table_and_lazy_allocation():
    t = AdjacencyTable(None, 4)
    assert t.is_empty and t.successors(0, 1)[0].size == 0
    t.harvest([-1], [2], torch.randn(1, 30))
    assert t.vocab_size == 30 and t.successors(-1, 2)[0].size == 4
    assert t.successors(-1, 5)[0].size == 0


def test_topk_scores_dtype_and_sum():
    ids, p = topk_scores(torch.randn(3, 100), 10)
    assert ids.dtype == np.int32 and p.shape == (3, 10) and np.all(p.sum(1) <= 1 + 1e-6)
    assert np.all(np.diff(p, axis=1) <= 0)


def test_bigram_lru_bound():
    vocab, k, cap = 20, 3, 4
    t = AdjacencyTable(vocab, k, bigram_capacity=cap)
    rows = np.arange(k, dtype=np.int32)[None].repeat(1, 0)
    sc = np.full((1, k), 0.2, np.float32)
    for key in range(6):
        t.update([key], [key + 1], rows, sc)
        if key == 3:
            t.successors(0, 1)  # refresh (0, 1): it survives the next evictions
    assert len(t) == cap and t.evictions == 2
    keys = t.bigram_key_set()
    assert 0 * vocab + 1 in keys and 1 * vocab + 2 not in keys and 5 * vocab + 6 in keys
    assert sorted(t.bigram_slot(k // vocab, k % vocab) for k in keys) == list(range(cap))


def test_harvest_tree_keys():
    vocab = 16
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 1, 0])
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1))
    t = AdjacencyTable(vocab, 2)
    t.harvest_tree(tree, 4, logits)
    assert t.successors(4, 5)[0].tolist() == _naive_topk(logits[0], 2)[0]
    assert t.successors(6, 7)[0].tolist() == _naive_topk(logits[2], 2)[0]
    assert t.successors(5, 8)[0].tolist() == _naive_topk(logits[3], 2)[0]


def test_memory_numbers():
    for vocab, mb in ((49152, 3.93), (151936, 12.15)):
        m = AdjacencyTable(vocab, 10).memory_bytes()
        assert abs(m["unigram"] / 1e6 - mb) < 0.01
        assert m["bigram_rows"] == 65536 * 10 * 8 and m["bigram_index"] == 65536 * 16
        assert m["total"] == m["unigram"] + m["bigram_rows"] + m["bigram_index"]
    assert AdjacencyTable(None).memory_bytes()["total"] == 0
    assert AdjacencyTable(8, 2, bigram_capacity=100).bigram_capacity == 128  # a power of two


def _one_hot_rows(favourites, vocab=16):
    """Logits rows whose top-1 is ``favourites[i]`` (so a table's successors name the row that
    wrote them)."""
    x = torch.zeros(len(favourites), vocab)
    x[torch.arange(len(favourites)), torch.as_tensor(favourites)] = 5.0
    return x


def test_refresh_steps_skip_entries_written_within_the_window():
    """``refresh_steps`` (GOOSE's key; ``kernels.table.skip_fresh``): a row whose unigram row, and
    bigram when it has a previous token, were written in the table's last ``refresh_steps``
    harvests is neither ranked nor written. Window 2: a key written at harvest 1 is skipped at
    harvests 2 and 3 and rewritten at 4; a new bigram over a fresh unigram row is written (its
    bigram is not held); a row without a previous token needs only a fresh unigram row; the
    harvest clock ticks when every row is skipped; 0 keeps the papers' rule. Catches: ``<`` for
    ``<=`` at the window's edge, a clock ticked per write instead of per harvest, ``or`` for
    ``and`` between the tiers, the vocabulary pass run on the skipped rows."""
    from vllm_anisotropic import kernels
    from vllm_anisotropic.proposers import adjacency

    def top1(t, p, tok):
        return t.successors(p, tok)[0][:1].tolist()

    t = AdjacencyTable(16, 2, refresh_steps=2)
    ranked = []
    real = adjacency.topk_scores
    adjacency.topk_scores = lambda x, k, rows=None: (ranked.append(None if rows is None else rows.tolist()),
                                                     real(x, k, rows))[1]
    try:
        t.harvest([1, -1], [2, 4], _one_hot_rows([10, 11]))  # harvest 1: both written
        assert top1(t, 1, 2) == [10] and top1(t, -1, 4) == [11] and ranked[-1] is None
        t.harvest([1, 5, -1], [2, 2, 4], _one_hot_rows([12, 13, 14]))  # 2: (1, 2) and 4 fresh; (5, 2) new
        assert ranked[-1] == [1] and top1(t, 1, 2) == [10] and top1(t, 5, 2) == [13] and top1(t, -1, 4) == [11]
        assert top1(t, 9, 2) == [13]  # the unigram row of 2: the new bigram's row wrote it
        t.harvest([1, -1], [2, 4], _one_hot_rows([15, 15]))  # 3: (1, 2) two harvests old: skipped
        assert ranked[-1] == [] and top1(t, 1, 2) == [10] and t.num_skipped == 4
        t.harvest([1, -1], [2, 4], _one_hot_rows([6, 7]))  # 4: three old: rewritten
        assert top1(t, 1, 2) == [6] and top1(t, -1, 4) == [7] and ranked[-1] is None
    finally:
        adjacency.topk_scores = real
    assert t.counters[kernels.load("table").HARVESTS] == 4 and t.num_harvested == 5
    plain = AdjacencyTable(16, 2)
    for i in range(3):
        plain.harvest([1], [2], _one_hot_rows([10 + i]))
        assert top1(plain, 1, 2) == [10 + i]
    # previous token 0 is a token: its bigram is checked like any other
    zero = AdjacencyTable(16, 2, refresh_steps=3)
    zero.harvest([5], [3], _one_hot_rows([10]))
    zero.harvest([0], [3], _one_hot_rows([11]))  # unigram row 3 fresh, bigram (0, 3) not held: written
    assert top1(zero, 0, 3) == [11] and zero.num_skipped == 0
    one = AdjacencyTable(16, 2, bigram_capacity=1, refresh_steps=1)  # the key's slot is slot 0
    one.harvest([1], [2], _one_hot_rows([10]))
    one.harvest([1], [2], _one_hot_rows([11]))
    assert top1(one, 1, 2) == [10] and one.num_skipped == 1
    # without the bigram tier a row's entry is its unigram row
    uni = AdjacencyTable(16, 2, bigram=False, refresh_steps=1)
    uni.harvest([1], [2], _one_hot_rows([10]))
    uni.harvest([5], [2], _one_hot_rows([11]))
    assert top1(uni, -1, 2) == [10]
    uni.harvest([5], [2], _one_hot_rows([12]))
    assert top1(uni, -1, 2) == [12]


def test_refresh_steps_the_same_with_given_top_k_rows_over_a_prefill_and_after_an_eviction():
    """The window applies however the rows come: precomputed top-k rows (the exact harness's
    lagged harvest) leave the table that the logits leave; a prefill is one harvest (one tick),
    so a key an earlier chunk of it wrote is written again by a later one (the last row wins,
    as without a window); an evicted bigram is not fresh (its row is written again); a skipped
    row refreshes its bigram's LRU stamp as its write would; ``forget_writes`` makes every entry
    stale. Catches: given rows written unfiltered, a tick per chunk, the bigram read at its home
    slot without ``find``, the LRU stamp left behind, a bound above the stamps' range."""
    import pytest

    from vllm_anisotropic.proposers.adjacency import TopKRows

    rng = np.random.default_rng(3)
    a, b = AdjacencyTable(16, 2, refresh_steps=3), AdjacencyTable(16, 2, refresh_steps=3)
    for _ in range(30):
        prev, tok = rng.integers(-1, 4, 6), rng.integers(0, 4, 6)
        x = torch.randn(6, 16, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
        a.harvest(prev, tok, x)
        b.harvest(prev, tok, TopKRows.of(x, 2))
    assert a.num_skipped == b.num_skipped > 30 and np.array_equal(a.unigram_ids, b.unigram_ids)
    assert a.bigram_key_set() == b.bigram_key_set()
    assert all(a.successors(*divmod(k, 16))[0].tolist() == b.successors(*divmod(k, 16))[0].tolist()
               for k in a.bigram_key_set())
    seq = AdjacencyTable(16, 2, refresh_steps=3)
    seq.harvest_sequence([1, 2, 1, 2], _one_hot_rows([10, 11, 12, 13]), chunk=2)
    assert seq.counters[3] == 1 and seq.num_skipped == 0 and seq.successors(1, 2)[0][0] == 13
    seq.harvest_sequence([5, 1, 2], _one_hot_rows([6, 7, 8]), chunk=2)  # (1, 2) written a tick ago
    assert seq.counters[3] == 2 and seq.num_skipped == 1 and seq.successors(1, 2)[0][0] == 13
    small = AdjacencyTable(16, 2, bigram_capacity=8, refresh_steps=5)  # one window of 8 slots
    small.harvest(np.arange(9), np.full(9, 3), _one_hot_rows(list(range(9))))  # (0, 3) evicted by (8, 3)
    assert small.bigram_slot(0, 3) == -1 and len(small) == 8
    small.harvest([0, 1], [3, 3], _one_hot_rows([14, 15]))  # (0, 3) not held: written; (1, 3) fresh
    assert small.successors(0, 3)[0][0] == 14 and small.successors(1, 3)[0][0] == 1 and small.num_skipped == 1
    assert small.bigram_slot(2, 3) == -1  # (0, 3) took the least recently used slot: (2, 3)'s
    slot = small.bigram_slot(3, 3)
    before = small.bigram_stamps[slot]
    small.harvest([3], [3], _one_hot_rows([9]))  # skipped: its stamp moves as a write's would
    assert small.num_skipped == 2 and small.bigram_stamps[slot] > before
    small.forget_writes()
    small.harvest([3], [3], _one_hot_rows([9]))
    assert small.successors(3, 3)[0][0] == 9 and small.num_skipped == 2
    with pytest.raises(ValueError, match="refresh_steps"):
        AdjacencyTable(16, 2, refresh_steps=(1 << 20) + 1)
    # a token outside the vocabulary is never fresh (the kernel reads no stamp for it)
    from vllm_anisotropic import kernels

    t = AdjacencyTable(16, 2, refresh_steps=3)
    t.harvest([-1], [5], _one_hot_rows([1]))
    live = np.ones(3, np.bool_)
    assert kernels.load("table").skip_fresh(t.unigram_written[:5], t.bigram_keys, t.bigram_stamps, t.bigram_written,
                                            t.counters, np.array([-1, -1, -1]), np.array([5, -1, 4]), 5, True, 3,
                                            live) == 3 and live.all()
    assert kernels.load("table").skip_fresh(t.unigram_written, t.bigram_keys, t.bigram_stamps, t.bigram_written,
                                            t.counters, np.array([-1]), np.array([5]), 16, True, 3, live[:1]) == 0


def test_refresh_steps_compare_stamps_across_the_clocks_wrap():
    """The written stamps are the harvest clock modulo 2^31 (int32): a key written just before
    the clock passes 2^31 is fresh just after it, and the entries of a new table are stale from
    the first harvest on (``kernels.table.NEVER``)."""
    from vllm_anisotropic import kernels

    tk = kernels.load("table")
    t = AdjacencyTable(16, 2, refresh_steps=1)
    t.harvest([1], [2], _one_hot_rows([10]))
    assert t.num_skipped == 0 and t.unigram_written.dtype == np.int32
    t.counters[tk.HARVESTS] = (1 << 31) - 2
    t.harvest([1], [2], _one_hot_rows([11]))  # written at 2^31 - 1
    assert t.successors(1, 2)[0][0] == 11 and t.unigram_written[2] == (1 << 31) - 1
    t.harvest([1], [2], _one_hot_rows([12]))  # clock 2^31, stamp 0: one harvest old
    assert t.successors(1, 2)[0][0] == 11 and t.num_skipped == 1
    t.harvest([1], [2], _one_hot_rows([13]))
    assert t.successors(1, 2)[0][0] == 13 and t.unigram_written[2] == 1


def test_refresh_steps_cost_their_stamps_in_memory():
    """The written stamps are int32 per vocabulary token and bigram slot, allocated only with a
    window, and counted by ``allocated_bytes`` (hence by ``draft_state_bytes``' tenants)."""
    for cfg in [dict(refresh_steps=4), dict(refresh_steps=4, bigram=False), dict()]:
        m = AdjacencyTable(500, **cfg).memory_bytes()
        cap = 65536 if cfg.get("bigram", True) else 1
        assert m["written"] == ((500 + cap) * 4 if cfg else 0)
        assert m["total"] == AdjacencyTable.allocated_bytes(500, 10, cfg.get("bigram", True), 65536,
                                                            cfg.get("refresh_steps", 0))


def test_tenants_never_read_each_others_tables():
    """Issue 14 item 7: per-tenant tables (vLLM's cache_salt). What tenant "a" harvested shapes
    a's drafts and nobody else's; requests without a salt share their own table; without
    shared_table every request starts empty; the salted tables are bounded (LRU)."""
    from vllm_anisotropic.proposers import get_proposer
    from vllm_anisotropic.proposers.adjacency import TenantTables

    logits = torch.arange(32, dtype=torch.float32).repeat(32, 1)  # every row: 31 > 30 > ...
    context = np.array([1, 2])
    for name in ("goose", "tr", "iso3"):
        prop = get_proposer(name, vocab_size=32, bigram=False)
        a1 = prop.new_request("a")
        a1.table.harvest(np.full(32, -1), np.arange(32), logits)  # a's request learns
        assert prop.new_request("a").propose(context).num_nodes > 1, name  # a's next request reads it
        for other in ("b", None):
            assert prop.new_request(other).propose(context).num_nodes == 1, (name, other)  # cold
        prop.new_request(None).table.harvest(np.full(32, -1), np.arange(32), logits)
        assert prop.new_request("c").propose(context).num_nodes == 1, name  # unsalted -> c: no
        assert prop.new_request(None).propose(context).num_nodes > 1, name
        private = get_proposer(name, vocab_size=32, bigram=False, shared_table=False)
        r = private.new_request("a")
        r.table.harvest(np.full(32, -1), np.arange(32), logits)
        assert private.new_request("a").propose(context).num_nodes == 1, name

    made = []

    class Table:
        frozen = False

        def __init__(self):
            self.n = len(made)
            made.append(self.n)

    tables = TenantTables(Table, shared=True, max_tenants=2)
    ta, tb = tables.for_request("a"), tables.for_request("b")
    assert tables.for_request("a") is ta  # a is now the most recently used
    tb_n = tb.n
    del tb  # b's last request finished: only the proposer holds b's table
    tc = tables.for_request("c")  # takes the place of b, the least recently used
    assert tables.num_tenants == 2 and tables.for_request("a") is ta and tables.for_request("c") is tc
    # a and c are in use (ta, tc held by requests): b finds no place, gets the frozen overflow
    tb = tables.for_request("b")
    assert tb.frozen and tb is tables.for_request("d") and tables.num_tenants == 2
    del tc  # c's request finished
    tb = tables.for_request("b")  # a (held, least recently used) stays; c goes; b starts cold
    assert not tb.frozen and tables.num_tenants == 2 and tb.n not in (tb_n, ta.n)
    assert list(tables._salted) == ["a", "b"] and tables.for_request("a") is ta


def test_bigram_table_matches_a_set_associative_lru_model():
    """The compiled bigram tier against a plain model of its documented rule (kernels.table):
    key k lives in one of the WAYS slots after its home slot; an update takes the key's own slot,
    else the first empty one, else the least recently used one of the window; a lookup hit
    refreshes. 2,000 random updates and lookups on 32 slots (keys collide and evict)."""
    from vllm_anisotropic.kernels import table as tk

    vocab, cap = 50, 32
    t = AdjacencyTable(vocab, top_k=1, bigram_capacity=cap)
    keys = [-1] * cap
    stamps = [0] * cap
    rows = {}
    clock = 0
    rng = np.random.default_rng(7)
    for step in range(2000):
        prev, tok = int(rng.integers(0, 12)), int(rng.integers(0, 12))
        key = prev * vocab + tok
        window = [(int(tk._home(key, cap - 1)) + w) % cap for w in range(tk.WAYS)]
        if rng.random() < 0.6:  # update
            t.update([prev], [tok], np.array([[step % vocab]], np.int32), np.array([[0.5]], np.float32))
            slot = next((s for s in window if keys[s] in (key, -1)), None)
            if slot is None:
                slot = min(window, key=lambda s: stamps[s])
            keys[slot] = key
            clock += 1
            stamps[slot] = clock
            rows[key] = step % vocab
        else:  # lookup
            got = t.successors(prev, tok)[0].tolist()
            slot = next((s for s in window if keys[s] == key), None)
            if slot is not None:
                clock += 1
                stamps[slot] = clock
                assert got == [rows[key]], step
        assert t.bigram_keys.tolist() == keys and t.bigram_stamps.tolist() == stamps, step
    assert len(t) == sum(k >= 0 for k in keys) and t.evictions > 0


def test_bigram_keys_spread_over_the_table():
    """The home-slot hash spreads neighbouring keys: 1,024 bigrams of consecutive tokens in
    4,096 slots (a quarter full) all stay, none evicted. A hash that sends keys to a few windows
    (e.g. ``z | mask`` instead of ``z & mask``) evicts almost all of them."""
    vocab = 2048
    t = AdjacencyTable(vocab, top_k=2, bigram_capacity=4096)
    prev = np.full(1024, 7)
    tokens = np.arange(1024)
    t.update(prev, tokens, np.tile(np.array([[1, 2]], np.int32), (1024, 1)),
             np.tile(np.array([[0.5, 0.25]], np.float32), (1024, 1)))
    assert t.evictions == 0
    assert all(t.bigram_slot(7, int(tok)) >= 0 for tok in tokens)


def test_lookup_refuses_tokens_outside_the_vocabulary():
    """The compiled lookup answers (NONE, -1) for a token below 0 or at / past the vocabulary
    (the tree builder calls it directly, without ``successors``' guard), and the unigram row of
    the last token in it."""
    from vllm_anisotropic.kernels import table as tk

    vocab = 10
    t = AdjacencyTable(vocab, top_k=2, bigram_capacity=8)
    t.update([-1], [9], np.array([[1, 2]], np.int32), np.array([[0.5, 0.25]], np.float32))
    for token in (-1, vocab, vocab + 5):
        assert tuple(tk.lookup(*t.arrays, -1, token, vocab, True)) == (tk.NONE, -1)
    assert tuple(tk.lookup(*t.arrays, -1, vocab - 1, vocab, True)) == (tk.UNIGRAM, vocab - 1)


def test_draft_state_bytes_bounds_the_tenants_tables_and_stores():
    """Issue 47 item 2: one byte budget for the learned draft state (``draft_state_bytes``). A
    tenant's share is fixed (its table's allocated bytes plus its store's bound); as many salted
    tenants as fit beside the unsalted one are kept, least recently used dropped first, tables
    and stores of the same tenants; the held bytes never exceed the budget, whatever the number
    of salts; the budget's default has room for 32 salted tenants."""
    from vllm_anisotropic.proposers import get_proposer
    from vllm_anisotropic.proposers.adjacency import DEFAULT_TENANTS, tenant_budget
    from vllm_anisotropic.proposers.config import GooseConfig
    from vllm_anisotropic.proposers.output_store import OutputStore

    for cfg in [dict(), dict(bigram=False), dict(top_k=3, bigram_capacity=1000)]:
        t = AdjacencyTable(500, **cfg)
        assert t.memory_bytes()["total"] == AdjacencyTable.allocated_bytes(
            500, t.top_k, t.use_bigram, cfg.get("bigram_capacity", 65536)), cfg
    c = GooseConfig(bigram_capacity=64, store_capacity=256)
    per = AdjacencyTable.allocated_bytes(1000, c.top_k, c.bigram, c.bigram_capacity, c.refresh_steps) + \
        OutputStore.max_bytes(c.store_capacity, c.ngram_sizes)
    assert tenant_budget(c, 1000, OutputStore.max_bytes(256, c.ngram_sizes)) == (DEFAULT_TENANTS, per * 34)
    prop = get_proposer("goose", vocab_size=1000, bigram_capacity=64, store_capacity=256,
                        draft_state_bytes=5 * per + per // 2)  # unsalted, overflow and 3 salted tenants
    assert prop.tables.max_tenants == prop.stores.max_tenants == 3
    rng = np.random.default_rng(0)
    for salt in ["a", "b", "c", "a", "d", "e"]:  # b and c are the least recently used when d, e arrive
        state = prop.new_request(salt)
        state.table.harvest(np.full(8, -1), rng.integers(0, 1000, 8), torch.randn(8, 1000))
        state.store.add(rng.integers(0, 1000, 300))
        del state  # finished: nothing holds its tenant's table but the proposer
    assert list(prop.tables._salted) == list(prop.stores._salted) == ["a", "d", "e"]
    held = sum(t.memory_bytes()["total"] for t in prop.tables.all()) + sum(s.memory_bytes() for s in prop.stores.all())
    assert held <= prop.state_budget == 5 * per + per // 2
    # three tenants in flight hold every place: a fourth gets the frozen overflow, which learns
    # nothing (no tenant reads what another's requests harvested) and stores nothing
    busy = [prop.new_request(salt) for salt in "xyz"]
    late = prop.new_request("w")
    assert late.table.frozen and late.store.frozen and not any(b.table.frozen for b in busy)
    late.table.harvest(np.full(8, -1), rng.integers(0, 1000, 8), torch.randn(8, 1000))
    late.store.add(rng.integers(0, 1000, 300))
    assert late.table.is_empty and late.store.num_tokens == 0 and prop.new_request("v").table is late.table
    held = sum(t.memory_bytes()["total"] for t in prop.tables.all()) + sum(s.memory_bytes() for s in prop.stores.all())
    assert held <= prop.state_budget and prop.tables.num_tenants == 3
    assert get_proposer("goose", vocab_size=1000, draft_state_bytes=1).tables.max_tenants == 1  # at least one


def test_the_output_stores_memory_bound_holds():
    """``OutputStore.max_bytes`` bounds what a full store holds (tracemalloc), rebuilds included,
    and ``memory_bytes`` (the /metrics gauge) is it from the first document on: fails if the
    store grew per document or per rebuild, or the bound were too low or too loose."""
    import tracemalloc

    from vllm_anisotropic.proposers.output_store import OutputStore

    warm = OutputStore((3, 4, 5), capacity=64)  # the kernels loaded before tracing (numba allocates)
    warm.add(np.arange(10))
    warm.match([1, 2, 3], 5)
    rng = np.random.default_rng(1)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        store = OutputStore((3, 4, 5), capacity=2048)
        assert store.memory_bytes() == 0  # nothing allocated before the first document
        most = 0
        for _ in range(60):
            store.add(rng.integers(0, 50_000, 200))
            store.match(rng.integers(0, 50_000, 5), 20)
            most = max(most, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    bound = OutputStore.max_bytes(2048, (3, 4, 5))
    assert store.num_tokens <= 2048 and store.rebuilds > 0 and store.memory_bytes() == bound
    assert 0.98 * bound < most <= bound, (most, bound)
