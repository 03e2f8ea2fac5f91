# Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_head_share_2026_12_07.py   (needs qwen2.5-coder-0.5b prepared; ~1 min)
"""q (Qwen2.5-Coder-0.5B, int8, one thread): a decode forward (1 token a row after 300) against its output head alone (151,936 rows) and heads cut to the first 16k / 32k / 64k token ids (weights reused from cache in this loop: a forward streams them, so a cut head saves about its share of the bytes); then torch.profiler over 10 forwards."""
import os, time, numpy as np, torch
from vllm_anisotropic.proposers.draft_model import DraftLM
from vllm_anisotropic.proposers.draft_kv import DraftKV
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers, warm_up
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm, dispatch_linear, _routed_forward
torch.set_num_threads(1)
M = os.path.expanduser("~/.cache/vllm-anisotropic/models/")
lm = DraftLM(M + "qwen2.5-coder-0.5b", dtype=torch.bfloat16)
assert use_vllm_cpu_layers(lm, "int8"); use_vllm_cpu_gemm(lm.model, "int8"); warm_up(lm)
emb = lm.model.get_input_embeddings().weight
heads = {}
for n in (16384, 32768, 65536):
    lin = torch.nn.Linear(emb.shape[1], n, bias=False, dtype=emb.dtype)
    lin.weight.data.copy_(emb[:n]); dispatch_linear(lin, "int8"); lin.forward = _routed_forward(lin); heads[n] = lin
kv = DraftKV(lm)
class S:
    def __init__(s): s.tokens=[]; s.forwarded=0; s.slot=None; s.last_step=0
def med(f, k=25):
    ts=[]
    for i in range(k):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return 1e3*np.median(ts[5:])
with torch.inference_mode():
    for rows in (1, 4):
        sess=[S() for _ in range(rows)]; kv.place(sess, [340]*rows)
        kv.forward(rows, [list(range(100, 400))]*rows, [0]*rows, [None]*rows, [0]*rows)
        full = med(lambda: kv.forward(rows, [[5]]*rows, [300]*rows, [None]*rows, [300]*rows))
        h = torch.randn(rows, emb.shape[1], dtype=emb.dtype)
        head = med(lambda: lm.model.get_output_embeddings()(h))
        out = " ".join(f"head[{n//1024}k] {med(lambda: heads[n](h)):.2f}" for n in heads)
        print(f"rows {rows}: q forward (1 token a row after 300) {full:.2f} ms; full head (151936) {head:.2f} ms; {out}", flush=True)
        for s in sess: kv.drop(s)
from torch.profiler import profile, ProfilerActivity
with torch.inference_mode():
    sess=[S()]; kv.place(sess, [340]); kv.forward(1, [list(range(100, 400))], [0], [None], [0])
    for _ in range(5): kv.forward(1, [[5]], [300], [None], [300])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10): kv.forward(1, [[5]], [300], [None], [300])
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
