#!/usr/bin/env python
"""A projection, not a measurement: GOOSE's tokens/s against plain decoding on a GPU, from the
GPU's measured forward costs, GOOSE's measured exact tau and this package's measured host work.

    ratio(batch, B) = tau_B * F(batch, 1) / (F(batch, B) + H(batch))

F(batch, n): the graph-captured forward of ``batch`` requests x ``n`` query rows at one context
(``vllm-anisotropic verify-cost --device cuda`` JSON, docs/gpu.md section 2); tau_B: GOOSE's exact
tau at a fixed budget of B nodes (``vllm-anisotropic tau`` text output, ``== B=N`` sections);
H(batch): the plugin's own host work per step (``profile-host --json`` records, by
``max_num_seqs``; ``--host-tag`` names a set of records, e.g. before / after). vLLM's own host work
per step is left out of both arms (plain decoding overlaps it with async scheduling; a spec step's
share is not measured on a GPU), so is the engine's one-step-late harvest (tau 1-3 % lower).
Batches without a host record take the nearest measured batch's host work (said in the output).

    python scripts/gpu_projection.py --cost docs/measurements/h100/verify_cost_smollm2_2026_11_26.json \\
        --tau docs/measurements/h100/tau_smollm2_goose_budgets_2026_11_26.txt --context 1024 \\
        --host before=docs/measurements/cpu/host_path_before_2026_11_28.jsonl \\
        --host after=docs/measurements/cpu/host_path_after_caa5b23_2026_11_28.jsonl --method goose-nogate
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path


def forward_ms(path: Path, context: int) -> dict[tuple[int, int], float]:
    """(batch, nodes) -> ms of the one architecture in a verify-cost JSON, at ``context``."""
    archs = json.loads(path.read_text())["archs"]
    (arch,) = archs.values()
    return {(r["batch"], r["nodes"]): r["ms"] for r in arch["graph_ms"] if r["context"] == context}


def tau_by_budget(path: Path) -> dict[int, float]:
    """B -> GOOSE's tau from a ``tau`` text output with ``== B=N`` sections."""
    out, budget = {}, None
    for line in path.read_text().splitlines():
        m = re.match(r"== B=(\d+)", line)
        if m:
            budget = int(m[1])
        elif budget is not None and line.startswith("goose ") and budget not in out:
            out[budget] = float(line.split()[1])
    return out


# phases of the CPU records that are not per-step host work on a GPU: the harvest's vocabulary
# pass (torch's topk on the device where the logits live) and the stats files (at most one write
# a second: ~0.5 ms a second, a few microseconds a step at GPU step rates)
NOT_GPU_HOST = ("topk", "stats")


def host_ms(path: Path, method: str, gpu_host: bool = False) -> dict[int, float]:
    """max_num_seqs -> the plugin's host ms per step (median of the records of ``method``);
    ``gpu_host``: without the ``NOT_GPU_HOST`` phases."""
    by: dict[int, list[float]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["method"] == method and not r.get("profiled"):
            off = sum(r["phases_ms"].get(k, 0.0) for k in NOT_GPU_HOST) if gpu_host else 0.0
            by.setdefault(r["max_num_seqs"], []).append(r["plugin_host_ms"] - off)
    return {b: statistics.median(v) for b, v in by.items()}


def nearest(table: dict[int, float], batch: int) -> tuple[float, int]:
    b = min(table, key=lambda k: (abs(k - batch), k))
    return table[b], b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cost", type=Path, required=True)
    ap.add_argument("--tau", type=Path, required=True)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--host", action="append", default=[], metavar="TAG=JSONL")
    ap.add_argument("--method", default="goose-nogate")
    ap.add_argument("--budgets", default="4,8,16")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--gpu-host", action="store_true",
                    help=f"leave out the phases that are not per-step host work on a GPU: {', '.join(NOT_GPU_HOST)}")
    args = ap.parse_args()
    fwd, tau = forward_ms(args.cost, args.context), tau_by_budget(args.tau)
    hosts = {"forward only": {1: 0.0}}
    for spec in args.host:
        tag, path = spec.split("=", 1)
        hosts[f"host {tag}"] = host_ms(Path(path), args.method, args.gpu_host)
    budgets = [int(b) for b in args.budgets.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    print(f"context {args.context}; tau " + ", ".join(f"B={b}: {tau[b]:.3f}" for b in budgets))
    head = "| batch | plain ms | " + " | ".join(f"{name} ms" for name in hosts if name != "forward only") + " | " + \
        " | ".join(f"B={b} {name}" for b in budgets for name in hosts) + " |"
    print(head)
    print("|" + "---:|" * (head.count("|") - 1))
    notes = []
    for batch in batches:
        cells, host_cells = [], []
        for name, table in hosts.items():
            h, at = nearest(table, batch)
            if name != "forward only":
                host_cells.append(f"{h:.2f}" + ("" if at == batch else f" (at {at})"))
                if at != batch:
                    notes.append(f"batch {batch}: {name} from batch {at}")
        for b in budgets:
            for name, table in hosts.items():
                h, _ = nearest(table, batch)
                cells.append(f"{tau[b] * fwd[(batch, 1)] / (fwd[(batch, b)] + h):.2f}x")
        print(f"| {batch} | {fwd[(batch, 1)]:.2f} | " + " | ".join(host_cells) + " | " + " | ".join(cells) + " |")
    for n in notes:
        print(n)


if __name__ == "__main__":
    main()
