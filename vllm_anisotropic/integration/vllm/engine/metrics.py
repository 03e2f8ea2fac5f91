"""Tree-decoding metrics: counted in the worker, shown in vLLM's log and on its ``/metrics``.

Scope: what vLLM's own spec-decode counters cannot say about a tree (they see a flat draft
list): acceptance per draft source (SPINE = context match, BRANCH = adjacency table, DRAFT =
a draft model's sample), tree size, bypass and plain steps.

Path of a number (vLLM runs the drafter in a worker process, ``/metrics`` is served by the
API-server process, and vLLM's ``SchedulerStats`` cannot carry extra fields across its
msgspec boundary):

1. ``TreeMetrics.record_step`` in the worker, once per step for all its verified trees
   (``drafter.TreeDrafter.observe_step``), and ``record_root_only`` for a chain step's requests
   without a draft, which hold no tree (``drafter.TreeDrafter.propose_trees``);
2. at most every ``WRITE_INTERVAL_S`` and when the batch drains, rank 0 writes the counters as JSON
   (atomic rename) to the file named by ``VLLM_ANISOTROPIC_TREE_STATS``. ``plugin.register``
   creates a temporary file name in the first vLLM process (the user's / API server's) when
   the variable is unset; every process vLLM starts afterwards inherits it;
3. ``TreeMetricsCollector``, registered in prometheus_client's default registry in every
   process, reads that file at scrape time and exports ``vllm_anisotropic:*`` counters; the
   API server's ``/metrics`` (vLLM's default registry outside multi-API-server mode) includes
   them. The worker also logs a one-line summary every ``LOG_INTERVAL_S`` through the ``vllm``
   logger, next to vLLM's own "SpecDecoding metrics" line.

Definitions (per request-step that had a tree pending; vLLM's prefill step is not one):
``tau = (steps + accepted) / steps``; ``p_s = accepted_spine / spine_nodes``, ``p_t =
accepted_branch / branch_nodes``. ``VLLM_ANISOTROPIC_TREE_TRACE=1`` also keeps, per request,
the list of accepted lengths per step (tests and ``bench/crosscheck.py`` compare it with the
exact harness); it grows with the run, so it is off by default.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Sequence

import numpy as np

from vllm_anisotropic import kernels
from vllm_anisotropic.proposers.base import MODE_CODES, ProposalMode
from vllm_anisotropic.tree import FlatTrees, NodeSource

__all__ = [
    "STATS_ENV", "TRACE_ENV", "TreeMetrics", "MetricsSink", "ensure_stats_file", "install_collector",
]

STATS_ENV = "VLLM_ANISOTROPIC_TREE_STATS"
TRACE_ENV = "VLLM_ANISOTROPIC_TREE_TRACE"
WRITE_INTERVAL_S = 1.0
LOG_INTERVAL_S = 10.0

# vLLM's handlers sit on the "vllm" logger: a child of it prints like vLLM's own lines.
log = logging.getLogger("vllm.anisotropic")
_BYPASS = MODE_CODES[ProposalMode.BYPASS]
_SPINE, _BRANCH, _DRAFT = int(NodeSource.SPINE), int(NodeSource.BRANCH), int(NodeSource.DRAFT)
_NUM_SOURCES = len(NodeSource)


@dataclass
class TreeMetrics:
    """Cumulative counters of one worker (see module docstring for the definitions)."""

    steps: int = 0  # request-steps with a tree pending (root-only trees and chain steps' drafts-less requests included)
    plain_steps: int = 0  # root-only trees: nothing to draft
    bypass_steps: int = 0  # GOOSE verified its context-match spine alone
    verified_trees: int = 0  # trees with >= 1 draft node
    branching_trees: int = 0  # trees with a node of >= 2 children
    draft_nodes: int = 0
    spine_nodes: int = 0
    branch_nodes: int = 0
    draft_model_nodes: int = 0  # sampled or greedy from a draft model (draft_tree)
    max_nodes: int = 0
    accepted_nodes: int = 0
    accepted_spine_nodes: int = 0
    accepted_branch_nodes: int = 0
    accepted_draft_model_nodes: int = 0
    accepted_off_chain: int = 0  # accepted paths that are not nodes 1..a (their K/V moved)
    moved_tokens: int = 0  # accepted tokens whose K/V was moved to the sequence's slots (kv_moves.py): a - c
    live_requests: int = 0  # gauge: per-request proposer states alive (dropped on finish / abort)
    tenant_tables: int = 0  # gauge: adjacency tables of cache_salt tenants held (adjacency.TenantTables)
    table_bytes: int = 0  # gauge: bytes of every adjacency table in use (AdjacencyTable.memory_bytes)
    store_bytes: int = 0  # gauge: bytes of GOOSE's cross-request stores' arrays (OutputStore.memory_bytes)
    state_budget_bytes: int = 0  # gauge: the proposer's draft_state_bytes (0: no vocabulary to size it)
    draft_kv_bytes: int = 0  # gauge: bytes the draft model's KV takes (draft_tree: its rows of every request)
    draft_kv_peak_bytes: int = 0  # gauge: the most bytes q's KV took (``draft_kv.DraftKV``)
    draft_kv_bound_bytes: int = 0  # gauge: their bound, reserved out of vLLM's KV memory (draft_kv_bytes)
    draft_kv_evictions: int = 0  # q sessions dropped, or request-steps left without drafts, to stay within the bound
    disabled_requests: int = 0  # requests whose trees were turned off after a fault (drafter.disabled)
    faults: dict[str, int] = field(default_factory=dict)  # stage -> contained exceptions
    without_trees: dict[str, int] = field(default_factory=dict)  # reason -> requests decoded without trees (runner.ineligible_reason)
    requests: dict[str, list[int]] = field(default_factory=dict)  # traces (TRACE_ENV only)
    selector_shapes: dict[str, int] = field(default_factory=dict)  # draft_tree: "K,L1,L2" -> request-steps the selector chose it
    draft_quantization: str = ""  # draft_tree: what q's linear layers run in ("none", "int8"; cpu_gemm.resolve_quantization)

    def record_step(self, trees: FlatTrees, on_path: np.ndarray, num_accepted: np.ndarray, modes: np.ndarray,
                    req_ids: Sequence[str], trace: bool) -> None:
        """Count a step's verified trees (root-only ones included) from their flat arrays:
        ``on_path`` ``[num_nodes]`` marks the accepted nodes, ``num_accepted`` ``[T]`` their count
        per tree, ``modes`` ``[T]`` the proposal modes (``proposers.base.MODE_CODES``)."""
        num = trees.num_trees
        self.steps += num
        if trace:
            for r, a in zip(req_ids, num_accepted.tolist()):
                self.requests.setdefault(r, []).append(a)
        # every count in one compiled pass over the step's nodes (kernels/emit.py)
        counts = kernels.load("emit").count_step(trees.parents, trees.sources, trees.depths, trees.offsets, on_path,
                                                 num_accepted, modes, _BYPASS, _NUM_SOURCES).tolist()
        (plain, bypass, verified, branching, draft_nodes, largest, accepted, off_chain, moved), by = counts[:9], counts[9:]
        self.plain_steps += plain
        self.bypass_steps += bypass
        if not verified:
            return
        self.verified_trees += verified
        self.branching_trees += branching
        self.draft_nodes += draft_nodes  # every node but the roots
        # nodes and accepted nodes per source: bin 2 * source + on the path
        self.spine_nodes += by[2 * _SPINE] + by[2 * _SPINE + 1]
        self.branch_nodes += by[2 * _BRANCH] + by[2 * _BRANCH + 1]
        self.draft_model_nodes += by[2 * _DRAFT] + by[2 * _DRAFT + 1]
        self.max_nodes = max(self.max_nodes, largest)
        self.accepted_nodes += accepted
        self.accepted_spine_nodes += by[2 * _SPINE + 1]
        self.accepted_branch_nodes += by[2 * _BRANCH + 1]
        self.accepted_draft_model_nodes += by[2 * _DRAFT + 1]
        # accepted paths that leave the leading chain (nodes 1..c at depths 1..c), and the
        # accepted nodes after it: the K/V moves (kv_moves.py)
        self.accepted_off_chain += off_chain
        self.moved_tokens += moved

    def record_root_only(self, modes: np.ndarray, req_ids: Sequence[str], trace: bool) -> None:
        """Count root-only trees that are never verified as trees (a chain step's requests
        without a draft, ``TreeDrafter.propose_trees``) as ``record_step`` counts them."""
        num = len(req_ids)
        self.steps += num
        self.plain_steps += num
        self.bypass_steps += int(np.count_nonzero(modes == _BYPASS))
        if trace:
            for r in req_ids:
                self.requests.setdefault(r, []).append(0)

    @property
    def tau(self) -> float:
        return (self.steps + self.accepted_nodes) / self.steps if self.steps else 0.0

    def summary_line(self) -> str:
        def rate(x: int, n: int) -> str:
            return f"{x / n:.3f}" if n else "n/a"

        trees = max(self.verified_trees, 1)
        return (
            f"vllm-anisotropic tree metrics: steps {self.steps}, tau {self.tau:.2f}, "
            f"spine acceptance {rate(self.accepted_spine_nodes, self.spine_nodes)}, "
            f"branch acceptance {rate(self.accepted_branch_nodes, self.branch_nodes)}, "
            f"draft-model acceptance {rate(self.accepted_draft_model_nodes, self.draft_model_nodes)}, "
            f"mean draft nodes {self.draft_nodes / trees:.1f}, "
            f"bypass rate {rate(self.bypass_steps, self.steps)}, plain rate {rate(self.plain_steps, self.steps)}"
        )


class MetricsSink:
    """Writes ``TreeMetrics`` to the stats file (rank 0 only) and logs the summary line."""

    def __init__(self, metrics: TreeMetrics, rank: int = 0) -> None:
        self.metrics = metrics
        self.path = os.environ.get(STATS_ENV) if rank == 0 else None
        self.trace = os.environ.get(TRACE_ENV, "") not in ("", "0")
        self.log_enabled = rank == 0
        self._last_write = 0.0
        self._last_log = -LOG_INTERVAL_S  # the first verified step logs at once, then every 10 s
        self._last_logged_steps = 0

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.path and (force or now - self._last_write >= WRITE_INTERVAL_S):
            self._last_write = now
            write_json_atomic(self.path, asdict(self.metrics))
        if self.log_enabled and now - self._last_log >= LOG_INTERVAL_S and self.metrics.steps != self._last_logged_steps:
            self._last_log, self._last_logged_steps = now, self.metrics.steps
            log.info(self.metrics.summary_line())


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    text = json.dumps(obj)  # one call into the C encoder (json.dump encodes piece by piece in Python)
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def budget_stats_path() -> str | None:
    """The allocator's stats file (scheduler process): the tree stats file's name + ``.budget``."""
    path = os.environ.get(STATS_ENV)
    return f"{path}.budget" if path else None


def ensure_stats_file() -> str:
    """The stats file path, creating a temporary one (and exporting it) when unset."""
    path = os.environ.get(STATS_ENV)
    if not path:
        path = os.path.join(tempfile.mkdtemp(prefix="vllm-anisotropic-"), "tree_stats.json")
        os.environ[STATS_ENV] = path
    return path


# Prometheus: gauge name -> (TreeMetrics field, help)
_GAUGES = {
    "tree_live_requests": ("live_requests", "requests holding proposer state in the worker"),
    "tree_tenant_tables": ("tenant_tables", "adjacency tables of cache_salt tenants held in the worker"),
    "tree_table_bytes": ("table_bytes", "bytes of the adjacency tables held in the worker (fixed per table)"),
    "tree_store_bytes": ("store_bytes", "bytes of the cross-request stores' arrays in the worker"),
    "tree_state_budget_bytes": ("state_budget_bytes",
                                "draft_state_bytes: the bound of the tenants' tables and stores in the worker"),
    "draft_kv_bytes": ("draft_kv_bytes", "bytes of K/V the draft model's sessions hold in the worker (draft_tree)"),
    "draft_kv_peak_bytes": ("draft_kv_peak_bytes", "draft_tree: the most bytes the draft model's KV took"),
    "draft_kv_bound_bytes": ("draft_kv_bound_bytes",
                             "draft_tree: the bound of the draft model's K/V, reserved out of vLLM's KV memory"),
}
# Prometheus: counter name -> (TreeMetrics fields or source split, help)
_COUNTERS = {
    "tree_steps": ("steps", "request-steps verified with a draft tree pending (root-only trees included)"),
    "tree_plain_steps": ("plain_steps", "request-steps whose tree was the root alone (nothing to draft)"),
    "tree_bypass_steps": ("bypass_steps", "request-steps that verified the context-match spine alone (GOOSE bypass)"),
    "tree_verified_trees": ("verified_trees", "verified trees with at least one draft node"),
    "tree_draft_nodes": ("draft_nodes", "draft nodes verified (root excluded)"),
    "tree_accepted_nodes": ("accepted_nodes", "draft nodes accepted; tau = (steps + accepted) / steps"),
    "tree_moved_tokens": ("moved_tokens", "accepted tokens whose K/V was moved to the sequence's slots (off the first chain)"),
    "tree_disabled_requests": ("disabled_requests", "requests whose trees were turned off after a contained fault"),
    "draft_kv_evictions": ("draft_kv_evictions", "draft_tree: draft-model sessions dropped, or request-steps left "
                           "without drafts, to stay within draft_kv_bound_bytes"),
}
_BY_SOURCE = {
    "tree_source_draft_nodes": ({"spine": "spine_nodes", "branch": "branch_nodes", "draft": "draft_model_nodes"}, "draft nodes verified, by source"),
    "tree_source_accepted_nodes": (
        {"spine": "accepted_spine_nodes", "branch": "accepted_branch_nodes",
         "draft": "accepted_draft_model_nodes"},
        "draft nodes accepted, by source (spine = context match, branch = adjacency table, draft = draft model)",
    ),
}


# the budget allocator's counters (scheduler process, ``budget.BudgetMetrics``)
_BUDGET_COUNTERS = {
    "budget_steps": ("steps", "decode steps in which the budget allocator cut draft lists or the measured gate kept drafting off"),
    "budget_steps_without_drafts": ("steps_without_drafts", "of those, steps where it kept no draft at all"),
    "budget_probe_steps": ("probe_steps", "steps that verified one node to keep the cost model measured"),
    "budget_gate_plain_steps": ("gate_plain_steps",
                                "steps the measured gate decoded plainly, nothing drafted (speculation measured slower at that batch size)"),
    "budget_chain_steps": ("chain_steps",
                           "steps the measured gate made chain steps (each request's chain alone, not cut)"),
    "budget_chain_drafts": ("chain_drafts", "draft tokens the chain steps verified"),
    "budget_draft_resume_seconds": ("draft_resume_seconds",
                                    "draft_tree: seconds the draft model caught up on what the target decoded while "
                                    "the measured gate rested drafting, or on new prompts (counted in neither of "
                                    "its arms)"),
    "budget_draft_unrepaid_catchups": ("draft_unrepaid_catchups",
                                       "draft_tree: request-steps without drafts because the request's remaining tokens "
                                       "would not repay the draft model's catch-up"),
    "budget_tree_rows": ("tree_rows", "draft nodes the allocator kept"),
    "budget_tree_rows_offered": ("tree_rows_offered", "draft nodes the proposers offered"),
    "budget_tree_rows_within_caps": ("tree_rows_within_caps",
                                     "offered draft nodes within vLLM's caps (token budget, k, max_model_len)"),
    "budget_given_up_accepted": ("given_up_accepted",
                                 "expected accepted drafts of the nodes within vLLM's caps the allocator did not keep"),
    "budget_predicted_accepted": ("predicted_accepted", "accepted drafts the acceptance model predicted for the kept nodes"),
    "budget_realized_accepted": ("realized_accepted", "accepted drafts in the same steps"),
    "grammar_pruned_nodes": ("grammar_pruned_nodes",
                             "offered draft nodes dropped before verification because the request's grammar rejects them"),
}


class TreeMetricsCollector:
    """prometheus_client collector over the stats files (read at scrape time)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def read(self, path: str | None = None) -> dict:
        try:
            with open(path or self.path, encoding="utf-8") as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        data = self.read()
        for name, (key, doc) in _GAUGES.items():
            fam = GaugeMetricFamily(f"vllm_anisotropic:{name}", doc)
            fam.add_metric([], float(data.get(key, 0)))
            yield fam
        for name, (key, doc) in _COUNTERS.items():
            fam = CounterMetricFamily(f"vllm_anisotropic:{name}", doc)
            fam.add_metric([], float(data.get(key, 0)))
            yield fam
        for name, (keys, doc) in _BY_SOURCE.items():
            fam = CounterMetricFamily(f"vllm_anisotropic:{name}", doc, labels=["source"])
            for source, key in keys.items():
                fam.add_metric([source], float(data.get(key, 0)))
            yield fam
        faults = CounterMetricFamily("vllm_anisotropic:tree_faults", "contained exceptions of the tree path, by stage "
                                     "(the requests concerned decode on without trees)", labels=["stage"])
        for stage, count in sorted((data.get("faults") or {}).items()):
            faults.add_metric([stage], float(count))
        yield faults
        without = CounterMetricFamily("vllm_anisotropic:tree_requests_without_trees",
                                      "requests that decode without drafts, by reason (runner.ineligible_reason)",
                                      labels=["reason"])
        for reason, count in sorted((data.get("without_trees") or {}).items()):
            without.add_metric([reason], float(count))
        yield without
        shapes = data.get("selector_shapes") or {}
        if shapes:
            fam = CounterMetricFamily("vllm_anisotropic:draft_tree_selector_shapes",
                                      "request-steps in which draft_tree's selector chose the shape (K, L1, L2)",
                                      labels=["shape"])
            for shape, count in sorted(shapes.items()):
                fam.add_metric([shape], float(count))
            yield fam
        budget = self.read(f"{self.path}.budget")
        for name, (key, doc) in _BUDGET_COUNTERS.items():
            fam = CounterMetricFamily(f"vllm_anisotropic:{name}", doc)
            fam.add_metric([], float(budget.get(key, 0)))
            yield fam
        samples = budget.get("cost_samples", 0)
        err = GaugeMetricFamily("vllm_anisotropic:budget_cost_model_error",
                                "mean |predicted - measured| / measured step time of the allocator's cost model")
        err.add_metric([], float(budget.get("cost_abs_rel_err", 0.0)) / samples if samples else 0.0)
        yield err
        last = GaugeMetricFamily("vllm_anisotropic:budget_last_tree_rows", "draft nodes the allocator kept in the latest step")
        last.add_metric([], float(budget.get("last_budget", 0)))
        yield last


_collector_pid: int | None = None


def install_collector() -> None:
    """Register the collector in prometheus_client's default registry (once per process)."""
    global _collector_pid
    if _collector_pid == os.getpid():
        return
    try:
        from prometheus_client import REGISTRY
    except ImportError:  # prometheus_client is a vLLM dependency; nothing to do without it
        return
    REGISTRY.register(TreeMetricsCollector(ensure_stats_file()))
    _collector_pid = os.getpid()
