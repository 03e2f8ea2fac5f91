"""Tree metrics (integration/vllm/engine/metrics.py) without an engine: counting, the stats file and
the Prometheus collector that reads it."""

from __future__ import annotations

import json

import numpy as np
import pytest
from random_trees import random_paths, random_trees

from vllm_anisotropic.integration.vllm.engine.metrics import (
    STATS_ENV,
    TRACE_ENV,
    MetricsSink,
    TreeMetrics,
    TreeMetricsCollector,
)
from vllm_anisotropic.proposers.base import MODE_CODES, ProposalMode
from vllm_anisotropic.tree import DraftTree, FlatTrees, NodeSource

S, B = NodeSource.SPINE, NodeSource.BRANCH
# root 5; spine 17 -> 9; branch 23 at the root, branch 4 under 17
TREE = DraftTree(tokens=[5, 17, 9, 23, 4], parents=[-1, 0, 1, 0, 1], sources=[NodeSource.ROOT, S, S, B, B])


def record(m: TreeMetrics, steps, trace: bool) -> None:
    """``TreeMetrics.record_step`` of one step's ``(req_id, tree, accepted nodes, mode)``."""
    trees = FlatTrees.from_trees([t for _, t, _, _ in steps])
    num = np.array([len(a) for _, _, a, _ in steps], np.int64)
    accepted = np.full((len(steps), max(1, int(num.max()))), -1, np.int64)
    for k, (_, _, a, _) in enumerate(steps):
        accepted[k, : len(a)] = a
    modes = np.array([MODE_CODES[ProposalMode(mode)] for *_, mode in steps], np.int8)
    m.record_step(trees, trees.path_mask(accepted, num), num, modes, [r for r, *_ in steps], trace)


STEPS = [
    ("a", TREE, [1, 2], "tree"),  # spine chain 1 -> 2: K/V in place
    ("a", TREE, [1, 4], "tree"),  # spine then branch: node 4's K/V moved
    ("b", TREE, [3], "bypass"),  # a branch off the first chain: moved
    ("b", DraftTree.chain([], root_token=7), [], "plain"),
]


def test_record_counts_sources_moves_and_modes():
    m = TreeMetrics()
    record(m, STEPS[:2], trace=True)
    record(m, STEPS[2:], trace=False)
    assert (m.steps, m.plain_steps, m.bypass_steps, m.verified_trees) == (4, 1, 1, 3)
    assert (m.spine_nodes, m.branch_nodes, m.draft_nodes) == (6, 6, 12)
    assert (m.accepted_nodes, m.accepted_spine_nodes, m.accepted_branch_nodes) == (5, 3, 2)
    assert m.accepted_off_chain == 2 and m.moved_tokens == 2
    assert m.requests == {"a": [2, 2]}
    one_by_one = TreeMetrics()
    for step in STEPS:
        record(one_by_one, [step], trace=False)
    whole = TreeMetrics()
    record(whole, STEPS, trace=False)
    assert {k: v for k, v in vars(whole).items() if k != "requests"} == {
        k: v for k, v in vars(one_by_one).items() if k != "requests"}
    assert whole.branching_trees == 3 and whole.max_nodes == 5
    assert abs(m.tau - 9 / 4) < 1e-12
    assert "tau 2.25" in m.summary_line() and "spine acceptance 0.500" in m.summary_line()
    assert m.draft_model_nodes == 0 and "draft-model acceptance n/a" in m.summary_line()


def test_the_steps_counts_follow_their_definitions_on_random_batches():
    """``kernels.emit.count_step`` (every counter of ``record_step``) against plain loops over
    random trees (chains and branches, every source), random root-to-node paths and modes."""
    from vllm_anisotropic import kernels

    count_step = kernels.load("emit").count_step
    rng = np.random.default_rng(0)
    for _ in range(300):
        trees = random_trees(rng, sources=True)
        paths = random_paths(rng, trees)
        flat = FlatTrees.from_trees(trees)
        num = np.array([len(p) for p in paths], np.int64)
        accepted = np.full((len(paths), 10), -1, np.int64)
        for k, p in enumerate(paths):
            accepted[k, : len(p)] = p
        modes = rng.integers(0, len(MODE_CODES), len(trees)).astype(np.int8)
        bypass = MODE_CODES[ProposalMode.BYPASS]
        on_path = flat.path_mask(accepted, num)
        got = count_step(flat.parents, flat.sources, flat.depths, flat.offsets, on_path, num, modes, bypass,
                         len(NodeSource)).tolist()
        lead = [next((c for c in range(len(p)) if p[c] != c + 1), len(p)) for p in paths]
        want = [
            sum(len(t.tokens) == 1 for t in trees),
            int(np.count_nonzero(modes == bypass)),
            sum(len(t.tokens) > 1 for t in trees),
            sum(max(list(t.parents[1:]).count(p) for p in range(len(t.tokens))) >= 2 for t in trees),
            sum(len(t.tokens) - 1 for t in trees),
            max(len(t.tokens) for t in trees),
            int(num.sum()),
            sum(c != len(p) for c, p in zip(lead, paths)),
            sum(len(p) - c for c, p in zip(lead, paths)),
        ]
        bins = [0] * (2 * len(NodeSource))
        for t, p in zip(trees, paths):
            for j, s in enumerate(t.sources):
                bins[2 * int(s) + (j in p)] += 1
        assert got == want + bins


def test_record_counts_draft_model_nodes_apart():
    D = NodeSource.DRAFT
    # draft_tree: trunk 11 -> 12, then branches 13 and 14 under 12
    tree = DraftTree(tokens=[5, 11, 12, 13, 14], parents=[-1, 0, 1, 2, 2], sources=[NodeSource.ROOT, D, D, D, D])
    m = TreeMetrics()
    record(m, [("a", tree, [1, 2, 4], "tree")], trace=False)
    assert (m.draft_model_nodes, m.accepted_draft_model_nodes) == (4, 3)
    assert (m.spine_nodes, m.branch_nodes, m.accepted_spine_nodes, m.accepted_branch_nodes) == (0, 0, 0, 0)
    assert "draft-model acceptance 0.750" in m.summary_line()


def test_sink_writes_rank0_only_and_collector_exports(tmp_path, monkeypatch):
    path = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_ENV, str(path))
    monkeypatch.setenv(TRACE_ENV, "1")
    m = TreeMetrics()
    MetricsSink(m, rank=1).tick(force=True)
    assert not path.exists()
    sink = MetricsSink(m, rank=0)
    assert sink.trace
    record(m, [("r", TREE, [1, 4], "tree")], trace=sink.trace)
    m.table_bytes = 10_200_000
    sink.tick(force=True)
    assert json.loads(path.read_text())["accepted_branch_nodes"] == 1
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in TreeMetricsCollector(str(path)).collect()
        for s in fam.samples
    }
    assert samples[("vllm_anisotropic:tree_steps_total", ())] == 1
    assert samples[("vllm_anisotropic:tree_source_accepted_nodes_total", (("source", "branch"),))] == 1
    assert samples[("vllm_anisotropic:tree_source_accepted_nodes_total", (("source", "spine"),))] == 1
    assert samples[("vllm_anisotropic:tree_moved_tokens_total", ())] == 1
    assert samples[("vllm_anisotropic:tree_table_bytes", ())] == 10_200_000
    assert samples[("vllm_anisotropic:tree_source_draft_nodes_total", (("source", "draft"),))] == 0
    assert not any(name.startswith("vllm_anisotropic:draft_tree_selector") for name, _ in samples)  # no selector
    # draft_tree's selector: one labelled counter per shape it chose
    m.selector_shapes.update({"1,2,0": 7, "2,0,1": 3})
    sink.tick(force=True)
    samples = {(s.name, tuple(s.labels.items())): s.value for fam in TreeMetricsCollector(str(path)).collect()
               for s in fam.samples}
    assert samples[("vllm_anisotropic:draft_tree_selector_shapes_total", (("shape", "1,2,0"),))] == 7
    assert samples[("vllm_anisotropic:draft_tree_selector_shapes_total", (("shape", "2,0,1"),))] == 3
    # a missing file reads as zeros (the API server may scrape before any worker wrote)
    empty = {s.name: s.value for fam in TreeMetricsCollector(str(tmp_path / "none.json")).collect() for s in fam.samples}
    assert empty["vllm_anisotropic:tree_steps_total"] == 0


def test_our_env_vars_pass_vllm_strict_environment_validation(monkeypatch):
    """With ``fail_on_environ_validation`` vLLM refuses unknown ``VLLM_*`` variables; the plugin
    declares ours (the stats file variable is set by the plugin itself in every server)."""
    from vllm.platforms import current_platform

    from vllm_anisotropic.integration.vllm.frontdoor.plugin import OUR_ENV_VARS, register

    register()
    for name in OUR_ENV_VARS:
        monkeypatch.setenv(name, "x")
    current_platform.validate_environ(hard_fail=True)
    monkeypatch.setenv("VLLM_ANISOTROPIC_NOT_OURS", "x")
    import pytest

    with pytest.raises(ValueError, match="VLLM_ANISOTROPIC_NOT_OURS"):
        current_platform.validate_environ(hard_fail=True)


def test_collector_exports_the_budget_allocator_counters(tmp_path):
    from vllm_anisotropic.integration.vllm.engine.budget import BudgetMetrics

    path = tmp_path / "stats.json"
    b = BudgetMetrics(steps=10, steps_without_drafts=4, tree_rows=30, tree_rows_offered=300, cost_samples=8,
                      cost_abs_rel_err=0.8, predicted_accepted=12.5, realized_accepted=11, last_budget=3)
    (tmp_path / "stats.json.budget").write_text(json.dumps(b.__dict__))
    samples = {s.name: s.value for fam in TreeMetricsCollector(str(path)).collect() for s in fam.samples}
    assert samples["vllm_anisotropic:budget_steps_total"] == 10
    assert samples["vllm_anisotropic:budget_steps_without_drafts_total"] == 4
    assert samples["vllm_anisotropic:budget_tree_rows_total"] == 30
    assert samples["vllm_anisotropic:budget_tree_rows_offered_total"] == 300
    assert samples["vllm_anisotropic:budget_predicted_accepted_total"] == 12.5
    assert samples["vllm_anisotropic:budget_realized_accepted_total"] == 11
    assert samples["vllm_anisotropic:budget_cost_model_error"] == pytest.approx(0.1)
    assert samples["vllm_anisotropic:budget_last_tree_rows"] == 3
