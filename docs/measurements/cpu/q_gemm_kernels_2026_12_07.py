"""q's GEMM shapes (Qwen2.5-0.5B), one thread: vLLM's oneDNN W8A8 (what draft_quantization int8 runs) against torch's weight-only int8 (_weight_int8pack_mm, bf16 activations) and vLLM's bf16 dispatch. Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_gemm_kernels_2026_12_07.py 1 2 4 8 16 64 256. Each shape is one weight timed over and over: the per-layer weights (<= 8.7 MB) stay in cache, so these are the kernels' compute, not q's memory-bound forward (the head, 136 MB, is not cached)."""
import time, sys, torch
torch.set_num_threads(1)
from vllm import _custom_ops as ops
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
torch.manual_seed(0)
SHAPES = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "head": (151936, 896)}
COUNT = {"qkv": 24, "o": 24, "gate_up": 24, "down": 24, "head": 1}
def timeit(f, n):
    f(); f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e3
rows_list = [int(x) for x in sys.argv[1:]] or [1, 4, 16]
tot = {}
for name, (N, K) in SHAPES.items():
    w = (torch.randn(N, K) * 0.02).to(torch.bfloat16)
    scale = w.float().abs().amax(1, keepdim=True) / 127
    q = torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8)
    h = ops.create_onednn_scaled_mm(q.t(), scale.float(), torch.bfloat16, True, False, 32)
    lin = torch.nn.Linear(K, N, bias=False, dtype=torch.bfloat16); lin.weight.data.copy_(w)
    dispatch_cpu_unquantized_gemm(lin, remove_weight=True)
    s_bf = scale[:, 0].to(torch.bfloat16)
    n = 3 if name == "head" else 20
    for rows in rows_list:
        x = torch.randn(rows, K).to(torch.bfloat16)
        def a():
            xq, xs, _ = ops.onednn_scaled_int8_quant(x)
            out = torch.empty(rows, N, dtype=torch.bfloat16)
            return ops.onednn_scaled_mm(h, xq, out, xs, None, None, None)
        def b():
            return torch._weight_int8pack_mm(x, q, s_bf)
        def c():
            return lin.cpu_linear(x, lin.weight, None)
        ta, tb, tc = timeit(a, n), timeit(b, n), timeit(c, n)
        ra, rb = a().float(), b().float(); ref = x.float() @ w.float().t()
        err = lambda r: ((r - ref).norm() / ref.norm()).item()
        print(f"{name:8s} rows {rows:3d}: w8a8 {ta:7.3f} ms  w8(int8pack) {tb:7.3f} ms  bf16 {tc:7.3f} ms   rel.err w8a8 {err(ra):.4f} w8 {err(rb):.4f}", flush=True)
        for k, t in (("w8a8", ta), ("w8", tb), ("bf16", tc)):
            tot[(rows, k)] = tot.get((rows, k), 0) + t * COUNT[name]
for rows in rows_list:
    print(f"a forward's GEMMs at {rows} rows: " + ", ".join(f"{k} {tot[(rows, k)]:.1f} ms" for k in ("w8a8", "w8", "bf16")))
