"""q's decode forward alone (Qwen2.5-Coder-0.5B bf16, vLLM's CPU kernels and GEMM as the engine routes them):
4 rows of 1 token after 300 context tokens through DraftKV.forward, median of 15 after 3 warm ("time"), or a torch profiler
table of 5 forwards ("prof"). Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_decode_forward_2026_12_03.py [time|prof]
[R ctx] (R rows after ctx tokens instead of 4 after 300: added 12-04; for an A/B, PYTHONPATH names the source tree)"""
import time, sys, numpy as np, torch
torch.set_num_threads(2)
from vllm_anisotropic.proposers.draft_model import DraftLM
from vllm_anisotropic.proposers.draft_kv import DraftKV
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers, warm_up
import os
path = os.path.expanduser("~/.cache/vllm-anisotropic/models/qwen2.5-coder-0.5b")
lm = DraftLM(path, dtype=torch.bfloat16)
assert use_vllm_cpu_layers(lm); from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm; use_vllm_cpu_gemm(lm.model); warm_up(lm)
kv = DraftKV(lm)
R, ctx = (int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else (4, 300)
class S:  # minimal session
    def __init__(s): s.tokens=[]; s.forwarded=0; s.slot=None; s.last_step=0
sess=[S() for _ in range(R)]
kv.place(sess, [ctx+16]*R)
rng=np.random.default_rng(0)
toks=[list(rng.integers(0,1000,ctx)) for _ in range(R)]
kv.forward(R, toks, [0]*R, [None]*R, [0]*R)
mode = sys.argv[1] if len(sys.argv)>1 else "time"
def step():
    return kv.forward(R, [[5]]*R, [ctx]*R, [None]*R, [ctx]*R)
for _ in range(3): step()
if mode=="time":
    ts=[]
    for _ in range(15):
        t=time.perf_counter(); step(); ts.append(time.perf_counter()-t)
    print("q decode forward R=%d ctx=%d: median %.1f ms" % (R, ctx, 1e3*np.median(ts)))
else:
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(5): step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
