# Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_catchup_cost_2026_12_07.py   (needs qwen2.5-coder-0.5b prepared; ~1 min)
"""q (Qwen2.5-Coder-0.5B, int8 linears as draft_tree runs it on this CPU, one thread as vLLM binds its CPU worker): a catch-up forward of N tokens after 300 in its KV, best of three. What a resume or a new prompt costs q (docs/draft_tree.md, "A catch-up must repay")."""
import os, time, numpy as np, torch
from vllm_anisotropic.proposers.draft_model import DraftLM
from vllm_anisotropic.proposers.draft_kv import DraftKV
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers, warm_up
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm
torch.set_num_threads(1)
M = os.path.expanduser("~/.cache/vllm-anisotropic/models/")
lm = DraftLM(M + "qwen2.5-coder-0.5b", dtype=torch.bfloat16)
assert use_vllm_cpu_layers(lm, "int8"); use_vllm_cpu_gemm(lm.model, "int8"); warm_up(lm)
kv = DraftKV(lm)
class S:
    def __init__(s): s.tokens=[]; s.forwarded=0; s.slot=None; s.last_step=0
with torch.inference_mode():
    for n in (1, 8, 32, 128, 300, 600):
        ts = []
        for rep in range(3):
            sess=[S()]; kv.place(sess, [n + 400])
            kv.forward(1, [list(range(100, 400))], [0], [None], [0])
            t = time.perf_counter(); kv.forward(1, [list(range(500, 500 + n))], [300], [None], [300]); ts.append(time.perf_counter() - t)
            kv.drop(sess[0])
        print(f"catch-up of {n} tokens after 300: {1e3*min(ts):.1f} ms ({1e3*min(ts)/n:.2f} ms a token)", flush=True)
