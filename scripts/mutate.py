#!/usr/bin/env python
"""A small AST mutation tester (stdlib ``ast`` only) for the core algorithms of this package.

Scope: generate first-order mutants of chosen functions of one module, run a pytest selection
against each, and report which mutants the tests kill. It never edits the repository: the
module's top-level package is copied into a temporary directory, the mutant is written into
the copy, and each test run is a forked child whose ``sys.path`` starts with that copy
(removed on every exit, Ctrl-C included). Heavy third-party imports (torch, numpy, pytest,
hypothesis) are done once in the parent before forking, so a mutant costs the tests' own
time, not an interpreter start.

Terms
-----
mutant
    The module with one small syntactic change (an *operator* applied at one AST node).
killed
    The tests fail (or error, or run past the per-mutant timeout: a hang counts as killed and
    is reported as ``timeout``).
survived
    The tests pass on the mutant: a missing test, or an *equivalent* mutant (behaviour cannot
    change), which a person must judge.
kill rate
    killed / mutants.

Operators (one mutant each; ``op`` names in the report)::

    compare    < -> <=, >      <= -> <, >=     > -> >=, <     >= -> >, <=
               == <-> !=       is <-> is not   in <-> not in
    binop      + <-> -   * <-> /   // -> /   % -> //   ** -> *   & <-> |   ^ -> |  (also a += b)
    boolop     and <-> or
    unary      drop ``not`` / unary ``-`` (a heapq max-heap key -> min-heap) / ``~``
    negate     if / while / conditional-expression test -> ``not (test)``
    constant   True <-> False (e.g. ``reverse=True``, ``descending=True``); int 0 -> 1,
               1 -> 2 (so -1 -> -2), n -> n-1 for n >= 2; float x -> 2x (0.0 -> 1.0);
               not the values of ``dim=`` / ``keepdim=`` / ``axis=`` keywords
    call       min <-> max, any <-> all, floor <-> ceil, argmax <-> argmin,
               minimum <-> maximum; ``sorted(x)`` -> ``sorted(x, reverse=True)``;
               ``reversed(x)`` -> ``x``; keyword ``min=`` <-> ``max=`` (``clamp``)
    return     ``return x`` -> ``return None``
    slice      a non-constant bound b -> b + 1, b - 1

Not mutated: the values of ``dim=`` / ``keepdim=`` / ``axis=``, docstrings, ``assert``
statements (checks, not algorithm), annotations, f-strings, default argument values,
decorators, code outside the named functions.

Determinism: mutants are numbered in source order (line, column, operator) and the same
source gives the same list; hypothesis tests here run with ``derandomize=True``.

Usage::

    # one module, named functions, the tests that should kill its mutants
    python scripts/mutate.py vllm_anisotropic/proposers/goose.py \\
        -f build_spine_tree,GooseState.observe -- tests/test_goose.py
    # the project's core targets (see CORE), one JSON report
    python scripts/mutate.py --preset core --json docs/measurements/mutation/after.json
    python scripts/mutate.py --preset core --only goose.py --ids 3,17   # re-run two mutants
    python scripts/mutate.py --preset core --only goose.py --list       # list, run nothing
    python scripts/mutate.py --preset core --only goose.py --show 17    # print a mutant
    # after adding tests only: re-run the survivors / timeouts of a report, carry its kills
    python scripts/mutate.py --preset core --rerun-survivors before.json --full goose.py

Exit status 0 when the run completed (whatever the kill rate); the report and docs/testing.md
say how to read it.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------------- targets
# The core algorithms (issue 14 item 1) and the tests meant to kill their mutants. Tests
# are ordered fastest / most targeted first, since each run stops at the first failure (-x).
# test_verifier_exact.py checks the analytic laws (verifiers/analytic.py), not the fast code,
# except in its greedy tests; the mutation run keeps only the tests that execute the fast code
_VERIFIER_TESTS = [
    "tests/test_mutants_verifiers.py",
    "tests/test_verifier_reference.py",
    "tests/test_verifier_exact.py::test_greedy_is_exact_greedy_decoding",
    "tests/test_verifier_exact.py::test_greedy_source_priority_spine_over_branch",
]
_GOOSE_TESTS = ["tests/test_goose.py", "tests/test_kernels_goose.py", "tests/test_baselines.py"]
_TABLE_TESTS = ["tests/test_mutants_adjacency.py", "tests/test_adjacency.py", "tests/test_kernels_goose.py"]
_MATCH_TESTS = ["tests/test_mutants_adjacency.py", "tests/test_context_match.py", "tests/test_kernels_goose.py"]
CORE: list[dict] = [
    dict(
        target="vllm_anisotropic/proposers/goose.py",
        functions=["harmonic_allocation", "spine_ratio_tier", "spine_chain", "build_spine_tree", "_build",
                   "propose_spine_trees", "_store_spines", "_spine_trees", "_in_order", "GooseState.observe",
                   "GooseProposer.learn_batch"],
        tests=_GOOSE_TESTS,
    ),
    dict(target="vllm_anisotropic/kernels/goose.py",
         functions=["harmonic_widths", "_candidates", "_heap_push", "_heap_pop", "_build_one", "_place", "build_trees",
                    "_scratch", "proposal_inputs", "spine_trees"],
         tests=_GOOSE_TESTS + ["tests/test_output_store.py", "tests/test_context_match.py"]),
    # learn_keys runs with --no-jit: GOOSE's harvest tests reach the vocabulary intrinsics (no pure-Python form)
    dict(target="vllm_anisotropic/kernels/goose.py", functions=["learn_keys"],
         tests=["tests/test_tree_drafter.py::test_learn_keys_against_their_definitions_on_random_batches"]),
    dict(target="vllm_anisotropic/proposers/treebuild.py", functions=["TreeBuilder.add", "TreeBuilder.finish"], tests=_GOOSE_TESTS),
    dict(
        target="vllm_anisotropic/proposers/adjacency.py",
        functions=["topk_scores", "AdjacencyTable.successors", "AdjacencyTable.update", "AdjacencyTable.harvest",
                   "AdjacencyTable.harvest_tree", "AdjacencyTable.harvest_sequence", "AdjacencyTable.skip_fresh", "AdjacencyTable.forget_writes",
                   "AdjacencyTable.allocated_bytes", "AdjacencyTable._allocate"],
        tests=_TABLE_TESTS + ["tests/test_kernels_harvest.py"],
    ),
    dict(target="vllm_anisotropic/kernels/table.py", functions=["_home", "find", "slot_of", "lookup", "update"],
         tests=_TABLE_TESTS),
    dict(target="vllm_anisotropic/kernels/table.py", functions=["skip_fresh", "update"],
         tests=["tests/test_adjacency.py", "tests/test_tree_drafter.py::"
                "test_refresh_steps_skip_the_rows_their_table_wrote_within_the_window_step_after_step"]),
    dict(target="vllm_anisotropic/kernels/table.py", functions=["last_writes"],
         tests=["tests/test_tree_drafter.py::test_last_writes_against_a_plain_loop_on_random_batches",
                "tests/test_tree_drafter.py::test_a_step_teaches_every_table_what_all_its_rows_teach_without_the_overwritten_ones"]),
    dict(target="vllm_anisotropic/kernels/vocab.py",
         functions=["_bits32", "as_float32", "pow2", "order_key", "_block_maxima", "_row_topk", "_sum_exp", "topk_probs", "argmax_rows",
                    "argmax_row"],
         tests=["tests/test_kernels_harvest.py", "tests/test_verifier_reference.py::test_bf16_and_float32_rows_argmaxed_as_torch"]),
    dict(target="vllm_anisotropic/kernels/vocab.py",
         functions=["_topk_probs_part", "topk_probs_threads", "_argmax_part", "argmax_rows_threads"],
         tests=["tests/test_split_rows.py", "tests/test_kernels_harvest.py",
                "tests/test_verifier_reference.py::test_bf16_and_float32_rows_argmaxed_as_torch"]),
    dict(target="vllm_anisotropic/kernels/split.py",
         functions=["_size_pool", "_process_cores", "_threads_wanted", "_launch",
                    "host_threads", "row_threads", "run_rows"],
         tests=["tests/test_split_rows.py"]),
    dict(
        target="vllm_anisotropic/proposers/context_match.py",
        functions=["ContextMatcher.extend", "ContextMatcher.sync", "ContextMatcher.lookup", "ContextMatcher.match"],
        tests=_MATCH_TESTS,
    ),
    dict(target="vllm_anisotropic/kernels/match.py", functions=["match_tokens"], tests=_MATCH_TESTS),
    dict(target="vllm_anisotropic/kernels/walk.py", functions=["_child", "descend_flat", "walk_rows", "walk_rows_threads",
                                                                "_walk_part"],
         tests=["tests/test_flat_trees.py", "tests/test_split_rows.py"]),
    dict(target="vllm_anisotropic/kernels/kv.py", functions=["_elements", "_move_part", "move_slots", "move_slots_threads"],
         tests=["tests/test_kv_moves.py"]),
    # plan.py runs with --no-jit: its selection leaves out the warm-up test (it reads numba's signatures)
    dict(target="vllm_anisotropic/kernels/plan.py", functions=["path_rounds"],
         tests=["tests/test_kernels_plan.py::test_path_rounds_match_the_per_leaf_reference",
                "tests/test_kernels_plan.py::test_path_rounds_worked_example_and_a_broken_tree",
                "tests/test_kernels_plan.py::test_path_rounds_refuse_rows_outside_the_arrays_and_skip_bushy_steps",
                "tests/test_cpu_attention.py::test_path_rounds_for_slim_trees_and_the_recompute_for_bushy_ones"]),
    dict(target="vllm_anisotropic/kernels/plan.py", functions=["main_rows"],
         tests=["tests/test_kernels_plan.py::test_main_rows_match_the_per_request_reference"]),
    dict(target="vllm_anisotropic/kernels/plan.py", functions=["step_rows"],
         tests=["tests/test_tree_runner.py::test_step_rows_place_every_draft_node_and_find_each_leading_chain",
                "tests/test_gpu_paths.py::test_scatter_tree_positions_worked_example"]),
    dict(target="vllm_anisotropic/kernels/plan.py", functions=["scheduled_prefixes", "gather_prefix"],
         tests=["tests/test_tree_drafter.py::test_scheduled_prefixes_against_their_definition_on_random_batches",
                "tests/test_tree_drafter.py::test_scheduled_prefixes_cut_each_tree_and_name_those_whose_drafts_differ_or_run_short",
                "tests/test_tree_drafter.py::test_take_step_refuses_what_is_not_a_pending_prefix"]),
    dict(target="vllm_anisotropic/kernels/plan.py", functions=["split_plan"],
         tests=["tests/test_kernels_plan.py::test_split_plan_worked_example_and_refusals",
                "tests/test_gpu_paths.py::test_device_plan_from_the_kernel_equals_the_plan_from_masks"]),
    dict(target="vllm_anisotropic/kernels/rank.py", functions=["_cap", "rank_trees"],
         tests=["tests/test_kernels_mutants.py", "tests/test_flat_trees.py", "tests/test_allocator.py"]),
    dict(target="vllm_anisotropic/kernels/allocate.py",
         functions=["concave_rows", "step_seconds", "scan_prefixes", "_best_of", "_scan_checked", "allocate_batch",
                    "_hull_gap", "allocate_one"],
         tests=["tests/test_kernels_mutants.py", "tests/test_allocator.py"]),
    dict(target="vllm_anisotropic/kernels/allocate.py", functions=["offer_budgets"],
         tests=["tests/test_tree_drafter.py::test_zero_cuts_back_off_and_kept_drafts_set_the_next_offer",
                "tests/test_kernels_mutants.py::test_offer_budgets_against_their_definition"]),
    dict(target="vllm_anisotropic/integration/vllm/engine/kv_moves.py",
         functions=["KVMover.plain_offsets", "KVMover.from_layers", "KVMover.move", "gather_scatter",
                    "_groups", "_elements"],
         tests=["tests/test_kv_moves.py"]),
    dict(target="vllm_anisotropic/kernels/emit.py", functions=["logits_starts", "emit_rows", "harvest_rows", "count_step"],
         tests=["tests/test_kv_moves.py::test_emitted_rows_paths_and_moves_worked_example_and_edges",
                "tests/test_kv_moves.py::test_emitted_rows_paths_and_moves_follow_their_definitions_on_random_batches",
                "tests/test_metrics.py", "tests/test_tree_sampler.py",
                "-knot warm_up"]),  # (the warm-up test reads numba's signatures: none under --no-jit)
    dict(target="vllm_anisotropic/verifiers/uniforms.py", functions=["_mix", "counter_uniforms", "request_seed"],
         tests=["tests/test_verifier_uniforms.py"]),
    dict(target="vllm_anisotropic/verifiers/greedy.py", functions=["rows_argmax", "GreedyVerifier._verify_batch_sparse"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/greedy.py", functions=["walk_flat"], tests=["tests/test_flat_trees.py"]),
    dict(target="vllm_anisotropic/verifiers/topdown.py", functions=["descend"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/topdown.py", functions=["TopDownVerifier.uniform_keys"],
         tests=["tests/test_verifier_uniforms.py"]),
    dict(target="vllm_anisotropic/verifiers/deterministic.py", functions=["_zero_tokens", "DeterministicVerifier.solve"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/nss.py", functions=["NSSVerifier.solve"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/naive.py", functions=["naive_solve"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/specinfer.py", functions=["_residual", "SpecInferVerifier.solve"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/spectr.py", functions=["spectr_residual", "SpecTrVerifier.solve"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/khisti.py", functions=["KhistiVerifier.solve"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/block.py", functions=["BlockVerifier._weights"], tests=_VERIFIER_TESTS),
    dict(target="vllm_anisotropic/verifiers/traversal.py", functions=["TraversalVerifier._verify_batch"], tests=_VERIFIER_TESTS),
    dict(
        target="vllm_anisotropic/tree.py",
        functions=["DraftTree.truncate", "DraftTree.chain_prefix", "pack_trees", "FlatTrees.from_trees", "FlatTrees.concat",
                   "FlatTrees.select", "FlatTrees.prefix", "FlatTrees.permuted", "FlatTrees.path_mask",
                   "FlatTrees.chain_prefix", "FlatTrees.ancestor_bits", "FlatTrees.to_batch"],
        tests=["tests/test_mutants_tree.py", "tests/test_tree.py", "tests/test_flat_trees.py",
               "tests/test_verifier_reference.py"],
    ),
]
PRESETS = {"core": CORE}

# modules imported once in the parent before forking (each is optional)
DEFAULT_PRELOAD = "numpy,torch,pydantic,hypothesis,pytest,_pytest.assertion.rewrite"
PYTEST_FLAGS = ["-x", "-q", "-p", "no:cacheprovider", "--import-mode=append"]

# ---------------------------------------------------------------------------- operators
_CMP = {
    ast.Lt: (ast.LtE, ast.Gt), ast.LtE: (ast.Lt, ast.GtE), ast.Gt: (ast.GtE, ast.Lt), ast.GtE: (ast.Gt, ast.LtE),
    ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,),
    ast.In: (ast.NotIn,), ast.NotIn: (ast.In,),
}
_BIN = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr,
    ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.MatMult: ast.Mult,
}
_NAME_SWAP = {"min": "max", "max": "min", "any": "all", "all": "any"}
_ATTR_SWAP = {
    "floor": "ceil", "ceil": "floor", "argmax": "argmin", "argmin": "argmax",
    "minimum": "maximum", "maximum": "minimum", "min": "max", "max": "min",
}
_KW_SWAP = {"min": "max", "max": "min"}
_UNARY = {ast.Not: "not", ast.USub: "-", ast.Invert: "~"}
# keyword values not mutated (axis choices: a wrong axis fails on shapes, not on the algorithm)
_SKIP_KEYWORDS = {"dim", "keepdim", "axis"}


@dataclass(frozen=True)
class Mutant:
    id: int  # 1-based, source order
    node: int  # index of the mutated node in ast.walk(module) order
    op: str  # operator family (see module docstring)
    arg: str  # operator argument (what to change into)
    line: int
    col: int
    function: str  # qualified name of the enclosing target function
    description: str  # e.g. "Lt->LtE", "2->3", "drop -"
    code: str  # the source line, stripped


def _name(node: ast.AST) -> str:
    return type(node).__name__


def _candidates(node: ast.AST, parent: ast.AST | None) -> list[tuple[str, str, str]]:
    """(op, arg, description) for every mutation of ``node``."""
    out: list[tuple[str, str, str]] = []
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _CMP.get(type(op), ()):
                out.append(("compare", f"{i}:{new.__name__}", f"{_name(op)}->{new.__name__}"))
    elif isinstance(node, (ast.BinOp, ast.AugAssign)):
        new = _BIN.get(type(node.op))
        if new is not None:
            out.append(("binop", new.__name__, f"{_name(node.op)}->{new.__name__}"))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        out.append(("boolop", new.__name__, f"{_name(node.op)}->{new.__name__}"))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        out.append(("unary", "drop", f"drop {_UNARY[type(node.op)]}"))
    elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
        if not (isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)):
            out.append(("negate", "not", f"negate {type(node).__name__.lower()} test"))
    elif isinstance(node, ast.Constant):
        v = node.value
        if isinstance(v, bool):
            out.append(("constant", str(not v), f"{v}->{not v}"))
        elif isinstance(v, int) and not (isinstance(parent, ast.keyword) and parent.arg in _SKIP_KEYWORDS):
            new = v + 1 if v in (0, 1) or isinstance(parent, ast.UnaryOp) else v - 1
            out.append(("constant", str(new), f"{v}->{new}"))
        elif isinstance(v, float):
            new = 1.0 if v == 0.0 else 2.0 * v
            out.append(("constant", repr(new), f"{v!r}->{new!r}"))
    elif isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in _NAME_SWAP:
            out.append(("call", _NAME_SWAP[f.id], f"{f.id}->{_NAME_SWAP[f.id]}"))
        if isinstance(f, ast.Attribute) and f.attr in _ATTR_SWAP:
            out.append(("call", _ATTR_SWAP[f.attr], f"{f.attr}->{_ATTR_SWAP[f.attr]}"))
        if isinstance(f, ast.Name) and f.id == "sorted" and not any(k.arg == "reverse" for k in node.keywords):
            out.append(("call", "reverse", "sorted->sorted(reverse=True)"))
        if isinstance(f, ast.Name) and f.id == "reversed" and len(node.args) == 1:
            out.append(("call", "unreversed", "drop reversed"))
        for i, kw in enumerate(node.keywords):
            if kw.arg in _KW_SWAP:
                out.append(("call", f"kw{i}", f"{kw.arg}=->{_KW_SWAP[kw.arg]}="))
    elif isinstance(node, ast.Return):
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            out.append(("return", "None", "return None"))
    elif isinstance(node, ast.Slice):
        for bound in ("lower", "upper"):
            b = getattr(node, bound)
            if b is not None and not isinstance(b, ast.Constant) and not (isinstance(b, ast.UnaryOp) and isinstance(b.operand, ast.Constant)):
                out.append(("slice", f"{bound}:+1", f"slice {bound}+1"))
                out.append(("slice", f"{bound}:-1", f"slice {bound}-1"))
    return out


def _mutate(node: ast.AST, op: str, arg: str) -> ast.AST:
    """The replacement of ``node`` (a modified copy, or another node)."""
    new = copy.deepcopy(node)
    if op == "compare":
        i, name = arg.split(":")
        new.ops[int(i)] = getattr(ast, name)()
    elif op in ("binop", "boolop"):
        new.op = getattr(ast, arg)()
    elif op == "unary":
        return new.operand
    elif op == "negate":
        new.test = ast.UnaryOp(op=ast.Not(), operand=new.test)
    elif op == "constant":
        new.value = ast.literal_eval(arg)
    elif op == "call":
        if arg == "reverse":
            new.keywords.append(ast.keyword(arg="reverse", value=ast.Constant(True)))
        elif arg == "unreversed":
            return new.args[0]
        elif arg.startswith("kw"):
            kw = new.keywords[int(arg[2:])]
            kw.arg = _KW_SWAP[kw.arg]
        elif isinstance(new.func, ast.Name):
            new.func.id = arg
        else:
            new.func.attr = arg
    elif op == "return":
        new.value = ast.Constant(None)
    elif op == "slice":
        bound, delta = arg.split(":")
        b = getattr(new, bound)
        setattr(new, bound, ast.BinOp(left=b, op=ast.Add() if delta == "+1" else ast.Sub(), right=ast.Constant(1)))
    else:
        raise ValueError(op)
    return new


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> None:
    for parent in ast.walk(tree):
        for fname, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, fname, new)
                return
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return
    raise LookupError("node not found")


def _function_nodes(tree: ast.Module, names: list[str] | None) -> list[tuple[str, ast.AST]]:
    """(qualname, def) of the target functions, source order; all top-level ones if no names."""
    found: list[tuple[str, ast.AST]] = []

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + node.name, node))
            elif isinstance(node, ast.ClassDef):
                visit(node.body, prefix + node.name + ".")

    visit(tree.body, "")
    if names is None:
        return found
    by_name = dict(found)
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"functions not found: {missing}; known: {sorted(by_name)}")
    return [(n, by_name[n]) for n in sorted(names, key=lambda n: by_name[n].lineno)]


def _mutable_nodes(func: ast.AST):
    """(node, parent) of the function body, skipping docstrings, asserts, annotations, f-strings."""
    body = list(func.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
        body = body[1:]
    stack = [(stmt, func) for stmt in reversed(body)]
    while stack:
        node, parent = stack.pop()
        if isinstance(node, (ast.Assert, ast.JoinedStr)):
            continue
        yield node, parent
        children = []
        for fname, value in ast.iter_fields(node):
            if fname in ("annotation", "returns", "decorator_list", "type_comment"):
                continue
            if fname == "args" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue  # parameters and their defaults
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and fname == "body":
                value = [s for s in value if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str))]
            if isinstance(value, ast.AST):
                children.append(value)
            elif isinstance(value, list):
                children.extend(v for v in value if isinstance(v, ast.AST))
        stack.extend((c, node) for c in reversed(children))


def generate(source: str, functions: list[str] | None) -> list[Mutant]:
    """Every mutant of the named functions, in source order (deterministic)."""
    tree = ast.parse(source)
    index = {id(n): i for i, n in enumerate(ast.walk(tree))}
    lines = source.splitlines()
    raw = []
    for qualname, func in _function_nodes(tree, functions):
        for node, parent in _mutable_nodes(func):
            for op, arg, desc in _candidates(node, parent):
                line = getattr(node, "lineno", getattr(parent, "lineno", 0))
                col = getattr(node, "col_offset", 0)
                raw.append((line, col, index[id(node)], op, arg, qualname, desc))
    raw.sort(key=lambda r: (r[0], r[1], r[2], r[3], r[4]))
    return [
        Mutant(i + 1, r[2], r[3], r[4], r[0], r[1], r[5], r[6], lines[r[0] - 1].strip() if r[0] else "")
        for i, r in enumerate(raw)
    ]


def mutant_source(source: str, m: Mutant) -> str:
    tree = ast.parse(source)
    node = list(ast.walk(tree))[m.node]
    _replace(tree, node, _mutate(node, m.op, m.arg))
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


# ---------------------------------------------------------------------------- running
def _package_root(target: Path) -> tuple[Path, str]:
    """(directory holding the top-level package, dotted module name) of a module file."""
    target = target.resolve()
    parts = [target.stem]
    d = target.parent
    while (d / "__init__.py").exists():
        parts.insert(0, d.name)
        d = d.parent
    if len(parts) == 1:
        raise SystemExit(f"{target} is not inside a package (no __init__.py next to it)")
    return d, ".".join(parts)


def _purge(package: str) -> None:
    for name in list(sys.modules):
        if name == package or name.startswith(package + "."):
            del sys.modules[name]


def _run_child(workdir: Path, module: str, pytest_args: list[str], log: Path, timeout: float,
               in_subprocesses: bool = False) -> tuple[str, float]:
    """Fork; the child runs pytest with ``workdir`` first on sys.path. (outcome, seconds)."""
    sys.stdout.flush()
    sys.stderr.flush()
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child
        code = 99
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.setpgid(0, 0)
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.chdir(workdir)
            sys.path.insert(0, str(workdir))
            # processes the tests start (vLLM's engine core and workers, offline jobs, servers)
            # import the mutant too; no bytecode cache, which could outlive a mutant written
            # in the same second as the previous one
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), os.environ.get("PYTHONPATH")]))
            os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
            importlib.invalidate_caches()
            import pytest

            code = int(pytest.main(list(pytest_args)))
            mod = sys.modules.get(module)
            if mod is None:
                # the tests never imported the target, unless it runs only in the processes they
                # start (engine tests: PYTHONPATH above)
                code = 97 if code == 0 and not in_subprocesses else code
            elif not str(Path(mod.__file__).resolve()).startswith(str(workdir.resolve())):
                print(f"\nmutate.py: {module} was imported from {mod.__file__}, not from {workdir}")
                code = 98
        except BaseException:  # noqa: BLE001 - the child must never return into the parent's code
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                rc = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() - start > timeout:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout", time.monotonic() - start
            time.sleep(0.02)
    except BaseException:
        try:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        raise
    seconds = time.monotonic() - start
    if rc == 0:
        return "survived", seconds
    if rc == 1:
        return "killed", seconds
    if rc in (97, 98):
        return f"setup-error-{rc}", seconds
    return "error", seconds  # collection / import error, crash: the tests did not pass


@dataclass
class TargetReport:
    target: str
    module: str
    functions: list[str] | None
    tests: list[str]
    baseline_seconds: float = 0.0
    timeout_seconds: float = 0.0
    seconds: float = 0.0
    mutants: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        n = len(self.mutants)
        survived = sum(m["status"] == "survived" for m in self.mutants)
        timeouts = sum(m["status"] == "timeout" for m in self.mutants)
        killed = n - survived
        return dict(mutants=n, killed=killed, survived=survived, timeouts=timeouts, kill_rate=round(killed / n, 4) if n else None)


def run_target(spec: dict, work: Path, args) -> TargetReport:
    target = (REPO / spec["target"]) if not Path(spec["target"]).is_absolute() else Path(spec["target"])
    root, module = _package_root(target)
    source = target.read_text()
    mutants = generate(source, spec.get("functions"))
    tests = [str((REPO / t) if not Path(t).is_absolute() and (REPO / t.split("::")[0]).exists() else t) for t in spec["tests"]]
    tests = [t for t in tests if Path(t.split("::")[0]).exists() or t.startswith("-")]
    rep = TargetReport(str(spec["target"]), module, spec.get("functions"), [os.path.relpath(t, REPO) if t.startswith(str(REPO)) else t for t in tests])
    if args.ids:
        mutants = [m for m in mutants if m.id in args.ids]
    name = target.name
    if args.list:
        for m in mutants:
            print(f"{name}:{m.line} #{m.id} {m.function} {m.description}: {m.code}")
        rep.mutants = [asdict(m) | {"status": "not-run"} for m in mutants]
        return rep
    carried: dict[int, dict] = {}
    previous = args.previous.get(str(spec["target"])) if args.previous else None
    if previous is not None and name not in args.full and str(spec["target"]) not in args.full:
        key = lambda m: (m["id"], m["node"], m["op"], m["arg"], m["line"])  # noqa: E731
        if [key(m) for m in previous["mutants"]] != [key(asdict(m)) for m in mutants]:
            raise SystemExit(f"{name}: the mutant list differs from the --rerun-survivors report (source changed?)")
        # only real kills are carried over: survivors and timeouts (perhaps a slow machine) run again
        carried = {m["id"]: m for m in previous["mutants"] if m["status"] == "killed"}
    copy_target = work / target.relative_to(root)
    log = work.parent / "pytest.log"
    pytest_args = PYTEST_FLAGS + tests
    try:
        # baseline: the unmutated module as ``ast.unparse`` writes it must pass
        copy_target.write_text(ast.unparse(ast.parse(source)) + "\n")
        outcome, base = _run_child(work, module, pytest_args, log, timeout=args.baseline_timeout,
                                   in_subprocesses=args.in_subprocesses)
        if outcome != "survived":
            sys.stdout.write(log.read_text()[-4000:])
            raise SystemExit(f"{name}: baseline tests did not pass ({outcome}); log above")
        rep.baseline_seconds = round(base, 2)
        rep.timeout_seconds = round(args.timeout or max(30.0, 4.0 * base), 1)
        print(f"== {spec['target']}: {len(mutants)} mutants, baseline {base:.1f}s, timeout {rep.timeout_seconds}s", flush=True)
        t0 = time.monotonic()
        for k, m in enumerate(mutants, 1):
            if m.id in carried:
                rep.mutants.append(carried[m.id] | {"outcome": "carried-over:" + carried[m.id]["outcome"], "seconds": 0.0})
                continue
            copy_target.write_text(mutant_source(source, m))
            if "kernels" in target.parts:
                _drop_numba_caches(work)
            outcome, secs = _run_child(work, module, pytest_args, log, timeout=rep.timeout_seconds,
                                       in_subprocesses=args.in_subprocesses)
            if outcome.startswith("setup-error"):
                sys.stdout.write(log.read_text()[-4000:])
                raise SystemExit(f"{name}: mutant #{m.id}: {outcome} (tests ran against the wrong module)")
            status = "survived" if outcome == "survived" else ("timeout" if outcome == "timeout" else "killed")
            rec = asdict(m) | {"status": status, "outcome": outcome, "seconds": round(secs, 2)}
            rep.mutants.append(rec)
            shown = "killed (timeout)" if status == "timeout" else ("killed (error)" if outcome == "error" else status)
            print(f"[{k}/{len(mutants)}] {name}:{m.line} #{m.id} {m.description} {shown} ({secs:.1f}s)", flush=True)
        rep.seconds = round(time.monotonic() - t0, 1)
    finally:
        copy_target.write_text(source)
    return rep


def _drop_numba_caches(work: Path) -> None:
    """Delete numba's disk caches in the copy. numba checks a cached function against its own
    source file only: other modules' cached kernels that call a mutated kernel module (``goose``
    calls ``table``) would keep machine code compiled against the module before the mutant."""
    for path in work.rglob("*.nb[ic]"):
        path.unlink(missing_ok=True)


def table(reports: list[TargetReport]) -> str:
    rows = ["| module | mutants | killed | survived | timeouts | kill rate |", "|---|---:|---:|---:|---:|---:|"]
    tot = dict(mutants=0, killed=0, survived=0, timeouts=0)
    for r in reports:
        s = r.summary()
        for k in tot:
            tot[k] += s[k]
        rate = "-" if s["kill_rate"] is None else f"{100 * s['kill_rate']:.1f}%"
        rows.append(f"| {r.target} | {s['mutants']} | {s['killed']} | {s['survived']} | {s['timeouts']} | {rate} |")
    rate = f"{100 * tot['killed'] / tot['mutants']:.1f}%" if tot["mutants"] else "-"
    rows.append(f"| **total** | {tot['mutants']} | {tot['killed']} | {tot['survived']} | {tot['timeouts']} | {rate} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], usage="%(prog)s [options] (TARGET [-f NAMES] -- TESTS... | --preset core)"
    )
    ap.add_argument("target", nargs="?", help="module file to mutate (omit with --preset)")
    ap.add_argument("-f", "--functions", help="comma-separated function / Class.method names (default: all top-level; with --preset: only its entries naming them)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="run a built-in target list")
    ap.add_argument("--only", help="comma-separated target file names of the preset to run (e.g. goose.py,tree.py)")
    ap.add_argument("--ids", help="comma-separated mutant ids to run (with one target)")
    ap.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    ap.add_argument(
        "--rerun-survivors", metavar="REPORT",
        help="run only the mutants that survived in REPORT (same target, same mutant list); carry the "
        "others over as killed. Valid when tests were only added since REPORT (see --full)",
    )
    ap.add_argument("--full", default="", help="comma-separated target file names always run in full (with --rerun-survivors)")
    ap.add_argument("--json", help="write the JSON report here")
    ap.add_argument("--timeout", type=float, help="seconds per mutant (default max(30, 4 x baseline)); a hang counts as killed")
    ap.add_argument("--baseline-timeout", type=float, default=900.0)
    ap.add_argument("--preload", default=DEFAULT_PRELOAD, help="modules imported once before forking (missing ones skipped)")
    ap.add_argument(
        "--no-jit", action="store_true",
        help="run numba kernels as Python (NUMBA_DISABLE_JIT=1): no compile per mutant (seconds each), the "
        "same array semantics; a mutant only numba's typing would reject is judged by its Python behaviour",
    )
    ap.add_argument(
        "--in-subprocesses", action="store_true",
        help="the tests import the target only in processes they start (engine tests: vLLM's engine core and "
        "workers); skip the check that pytest's own process imported it from the copy",
    )
    ap.add_argument("--show", type=int, metavar="ID", help="print the mutated function of mutant ID (one target) and exit")
    argv = list(sys.argv[1:] if argv is None else argv)
    # everything after '--' is the pytest selection (test files or node ids)
    tests = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.tests = tests
    args.ids = {int(x) for x in args.ids.split(",")} if args.ids else None
    args.full = set(filter(None, args.full.split(",")))
    args.previous = None
    if args.rerun_survivors:
        doc = json.loads(Path(args.rerun_survivors).read_text())
        args.previous = {t["target"]: t for t in doc["targets"]}

    if args.preset:
        specs = PRESETS[args.preset]
        if args.only:
            keep = set(args.only.split(","))
            specs = [s for s in specs if Path(s["target"]).name in keep or s["target"] in keep]
        if args.functions:  # the entries naming these functions, narrowed to them
            wanted = args.functions.split(",")
            named = sorted({f for s in specs for f in s.get("functions") or ()})
            specs = [dict(s, functions=[f for f in s["functions"] if f in wanted])
                     for s in specs if set(wanted) & set(s.get("functions") or ())]
            if not specs:
                ap.error(f"-f {args.functions}: no entry of the preset (after --only) names it; "
                         f"its functions: {', '.join(named)}")
    else:
        if not args.target or not args.tests:
            ap.error("give a target module and its tests after '--' (or --preset)")
        specs = [dict(target=str(Path(args.target).resolve()), functions=args.functions.split(",") if args.functions else None, tests=[str(Path(t).resolve()) if Path(t.split("::")[0]).exists() else t for t in args.tests])]
    if (args.ids or args.show) and len(specs) != 1:
        ap.error("--ids / --show need exactly one target (use --only)")

    if args.show:
        spec = specs[0]
        path = Path(spec["target"]) if Path(spec["target"]).is_absolute() else REPO / spec["target"]
        src = path.read_text()
        m = next(m for m in generate(src, spec.get("functions")) if m.id == args.show)
        print(f"#{m.id} {path.name}:{m.line} {m.function} {m.description}: {m.code}")
        tree = ast.parse(mutant_source(src, m))
        for qualname, func in _function_nodes(tree, [m.function.split(".")[0]] if "." not in m.function else [m.function]):
            print(ast.unparse(func))
        return 0

    def interrupted(signum, frame):
        raise KeyboardInterrupt

    # Ctrl-C and kill (SIGTERM) both end in the cleanup below, also when started in the background
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    if args.no_jit:  # before numba is first imported (preload or tests), inherited by every fork
        os.environ["NUMBA_DISABLE_JIT"] = "1"
    for name in [] if args.list else args.preload.split(","):
        try:
            importlib.import_module(name.strip())
        except ImportError:
            pass
    reports: list[TargetReport] = []
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="mutate-"))
    try:
        roots: dict[Path, Path] = {}
        for spec in specs:
            path = Path(spec["target"]) if Path(spec["target"]).is_absolute() else REPO / spec["target"]
            root, module = _package_root(path)
            package = module.split(".")[0]
            if root not in roots:
                work = tmp / f"src{len(roots)}"
                work.mkdir()
                shutil.copytree(root / package, work / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
                roots[root] = work
            _purge(package)  # the children import the package from the copy
            reports.append(run_target(spec, roots[root], args))
            if args.json and not args.list:
                _write_json(args.json, reports, started)
    except KeyboardInterrupt:
        print("\ninterrupted: the repository was never modified; removing the temporary copy", file=sys.stderr)
        return 130
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if not args.list:
        print()
        print(table(reports))
        total = sum(r.seconds + r.baseline_seconds for r in reports)
        print(f"\nwall time {time.time() - started:.0f}s (mutants + baselines {total:.0f}s)")
    if args.json:
        _write_json(args.json, reports, started)
        print(f"report: {args.json}")
    return 0


def _write_json(path: str, reports: list[TargetReport], started: float) -> None:
    """The report so far (rewritten after every target, so an interrupted run keeps its results)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(
        tool="scripts/mutate.py",
        python=sys.version.split()[0],
        started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        wall_seconds=round(time.time() - started, 1),
        pytest_flags=PYTEST_FLAGS,
        table=table(reports),
        targets=[asdict(r) | {"summary": r.summary()} for r in reports],
    )
    out.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
