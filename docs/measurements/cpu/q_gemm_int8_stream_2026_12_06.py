# Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_gemm_int8_stream_2026_12_06.py  (~2 min; random weights, no model needed)
"""q's GEMMs streamed as a forward streams them (24 distinct weights a shape): bf16 oneDNN (vLLM's dispatch) vs
vLLM's CPU W4A16 kernel (cpu_gemm_wna16, uint4b8, group 128) vs W8A8 oneDNN (dynamic per-token)."""
import time, torch, numpy as np, sys
torch.set_num_threads(2)
from vllm import _custom_ops as ops
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
G = 128
def quant4(w):  # w [N, K] float -> packed [N/16, K*2] int32, scales [K/G, N] bf16
    N, K = w.shape
    wg = w.float().view(N, K // G, G)
    s = (wg.abs().amax(-1) / 7.0).clamp(min=1e-8)  # [N, K/G]
    q = torch.round(wg / s[..., None]).clamp(-8, 7).to(torch.int32).view(N, K) + 8  # uint4b8
    qt = q.t().contiguous()  # [K, N]
    packed = torch.zeros(K, N // 8, dtype=torch.int32)
    for i in range(8):
        packed |= (qt[:, i::8] & 15) << (4 * i)
    packed = packed.view(K, N // 16, 2).permute(1, 0, 2).reshape(N // 16, K * 2).contiguous()
    deq = ((q - 8).float().view(N, K // G, G) * s.to(torch.bfloat16).float()[..., None]).view(N, K)
    return packed, s.t().contiguous().to(torch.bfloat16), deq
def w4(x, p, s): return ops.cpu_gemm_wna16(input=x, q_weight=p, scales=s, zeros=None, bias=None, pack_factor=8, isa_hint="vec")
def quant8(w):  # W8A8 per-channel weights for oneDNN scaled mm
    s = (w.float().abs().amax(1) / 127).clamp(min=1e-8)
    q = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
    sc = s.view(-1, 1).float().contiguous()
    h = ops.create_onednn_scaled_mm(q.t(), sc, torch.bfloat16, True, False)
    h.keep = sc  # the handler reads the scales in place
    return h
def w8(x, h, N):
    xq, xs, _ = ops.onednn_scaled_int8_quant(x)
    out = torch.empty(x.shape[0], N, dtype=torch.bfloat16)
    return ops.onednn_scaled_mm(h, xq, out, xs, None, None, None)
shapes = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (out N, in K)
head = (151936, 896)
layers = {}
torch.manual_seed(0)
for (n, k) in shapes + [head]:
    reps = 24 if n != head[0] else 1
    L = []
    for _ in range(reps):
        w = (torch.randn(n, k) * 0.02).to(torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False).to(torch.bfloat16); lin.weight.data.copy_(w)
        dispatch_cpu_unquantized_gemm(lin, remove_weight=True)
        p, s, deq = quant4(w)
        h8 = quant8(w)
        L.append((lin, p, s, h8, w, deq))
    layers[(n, k)] = L
for M in (1, 2, 4, 8):
    x = {k: torch.randn(M, k, dtype=torch.bfloat16) for (_, k) in shapes + [head]}
    # correctness once
    lin, p, s, h8, w, deq = layers[shapes[2]][0]; xx = x[896]
    ref = xx.float() @ deq.t(); y = w4(xx, p, s).float()
    ref8 = xx.float() @ w.float().t(); y8 = w8(xx, h8, shapes[2][0]).float()
    if M == 1: print("w4 maxerr vs its dequant", (y - ref).abs().max().item(), "scale", ref.abs().max().item(), "| w8 vs bf16", (y8 - ref8).abs().max().item())
    res = {}
    for name in ("bf16", "w4", "w8"):
        ts = []
        for rep in range(7):
            t = time.perf_counter()
            for (n, k) in shapes + [head]:
                for (lin, p, s, h8, w, deq) in layers[(n, k)]:
                    if name == "bf16": lin.cpu_linear(x[k], None, None)
                    elif name == "w4": w4(x[k], p, s)
                    else: w8(x[k], h8, n)
            ts.append(time.perf_counter() - t)
        res[name] = 1e3 * np.median(ts[2:])
    print(f"M={M}: forward's GEMMs streamed: bf16 {res['bf16']:.1f} ms  w4a16 {res['w4']:.1f} ms  w8a8 {res['w8']:.1f} ms")
