# Run: for q in none int8; do PYTHONPATH=. .venv/bin/python docs/measurements/cpu/q_int8_rss_2026_12_06.py $q; done   (~1 min; one process each)
import os, sys, gc, torch, resource
torch.set_num_threads(2)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
from vllm_anisotropic.proposers.draft_model import DraftLM
from vllm_anisotropic.integration.vllm.kernels.cpu_draft import use_vllm_cpu_layers, warm_up
from vllm_anisotropic.integration.vllm.kernels.cpu_gemm import use_vllm_cpu_gemm
q = sys.argv[1]
base = rss()
lm = DraftLM(os.path.expanduser("~/.cache/vllm-anisotropic/models/qwen2.5-coder-0.5b"), dtype=torch.bfloat16)
loaded = rss()
use_vllm_cpu_layers(lm, q); use_vllm_cpu_gemm(lm.model, q); gc.collect(); warm_up(lm); gc.collect()
print(f"q {q}: RSS after load +{loaded-base:.0f} MiB, after routing + warm-up +{rss()-base:.0f} MiB")
