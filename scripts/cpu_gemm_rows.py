"""CPU: what the linear layers of one SmolLM2-135M forward cost by query rows, through vLLM's GEMM.

Every linear weight of the model's shape (30 layers of qkv 576->960, o 576->576, gate_up
576->3072, down 1536->576, and the 576->49152 output head), bf16, each routed through vLLM's
CPU dispatch (``dispatch_cpu_unquantized_gemm``: a oneDNN matmul on a pre-packed weight here),
run in model order on M rows, so the 268 MB of weights stream from memory as in a real forward.
One thread, as vLLM's CPU worker runs on this 2-core machine. Median of 9 after 2 warm calls.

With ``--rows-kernel`` (x86 with AVX512-BF16 and g++), the same weights also through
``vllm_anisotropic.cpu_rows_gemm`` (built with g++, called through ctypes), checked against
vLLM's kernel first: every output element of a few shapes
and row counts compared (the share that is bitwise equal, and the largest difference).

Usage: .venv/bin/python scripts/cpu_gemm_rows.py [--rows-kernel]  (records:
docs/measurements/cpu/gemm_rows_smollm2_2026_11_26.txt, gemm_rows_kernel_smollm2_2026_11_26.txt)
"""

import statistics
import sys
import time

import torch
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

from vllm_anisotropic.cpu_rows_gemm import RowsGemm, pack

LAYERS = 30
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # qkv, o, gate_up, down
HEAD = (576, 49152)
ROWS = (1, 2, 3, 4, 5, 8, 16)


def linear(i: int, o: int) -> torch.nn.Linear:
    lin = torch.nn.Linear(i, o, bias=False).to(torch.bfloat16)
    dispatch_cpu_unquantized_gemm(lin, remove_weight=False)
    return lin


def check_rows_kernel(call) -> None:
    same = total = 0
    worst = 0.0
    for i, o in SHAPES + [HEAD, (896, 4864), (4864, 896)]:
        lin = linear(i, o)
        wp = pack(lin.weight.data)
        for m in (1, 2, 4, 7, 8, 13):
            x = torch.randn(m, i, dtype=torch.bfloat16)
            ref = lin.cpu_linear(x, lin.weight, None)
            out = torch.empty(m, o, dtype=torch.bfloat16)
            call(wp, x, out)
            same += int((out == ref).sum())
            total += out.numel()
            worst = max(worst, float((out.float() - ref.float()).abs().max() / ref.float().abs().max()))
    print(f"rows kernel vs vLLM's: {same} of {total} output elements bitwise equal ({100 * same / total:.3f} %), "
          f"largest difference {worst:.2g} of the output's largest magnitude")


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    call = RowsGemm() if "--rows-kernel" in sys.argv else None
    if call is not None:
        check_rows_kernel(call)
    layers = [[linear(i, o) for i, o in SHAPES] for _ in range(LAYERS)]
    head = linear(*HEAD)
    packed = [[pack(lin.weight.data) for lin in layer] for layer in layers] if call else None
    head_packed = pack(head.weight.data) if call else None
    mb = sum(p.numel() * 2 for layer in layers for lin in layer for p in lin.parameters()) / 2**20
    mb += head.weight.numel() * 2 / 2**20
    print(f"torch {torch.__version__}, one thread, {mb:.0f} MiB of bf16 weights")
    base = None
    print(f"{'rows':>5} {'layers ms':>10} {'head ms':>8} {'total ms':>9} {'vs 1 row':>9}"
          + (f" {'rows kernel ms':>15} {'vs 1 row':>9} {'vs vLLM':>8}" if call else ""))
    base_rows = None
    for m in ROWS:
        xs = {i: torch.randn(m, i, dtype=torch.bfloat16) for i, _ in SHAPES}

        def layers_pass():
            for layer in layers:
                for lin, (i, _) in zip(layer, SHAPES):
                    lin.cpu_linear(xs[i], lin.weight, None)

        def head_pass():
            head.cpu_linear(xs[576], head.weight, None)

        outs = {o: torch.empty(m, o, dtype=torch.bfloat16) for _, o in SHAPES + [HEAD]}

        def rows_pass():
            for layer in packed:
                for wp, (i, o) in zip(layer, SHAPES):
                    call(wp, xs[i], outs[o])
            call(head_packed, xs[576], outs[HEAD[1]])

        times = {}
        passes = (("layers", layers_pass), ("head", head_pass)) + ((("rows", rows_pass),) if call else ())
        for name, fn in passes:
            for _ in range(2):
                fn()
            runs = []
            for _ in range(9):
                t = time.perf_counter()
                fn()
                runs.append(1e3 * (time.perf_counter() - t))
            times[name] = statistics.median(runs)
        total = times["layers"] + times["head"]
        base = base or total
        line = f"{m:>5} {times['layers']:>10.2f} {times['head']:>8.2f} {total:>9.2f} {total / base:>8.2f}x"
        if call:
            base_rows = base_rows or times["rows"]
            line += f" {times['rows']:>15.2f} {times['rows'] / base_rows:>8.2f}x {times['rows'] / total:>7.2f}x"
        print(line)


if __name__ == "__main__":
    main()
