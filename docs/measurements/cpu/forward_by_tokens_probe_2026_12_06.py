"""Per-step forward time against the step's query tokens, one method, in process (2026-12-06).

Run from the repository root (AMD EPYC, 2 cores, AVX-512, no AMX; SmolLM2-135M bf16, mbpp +
math500, 64 prompts each, 128 tokens, 64 requests):

    PYTHONPATH=. VLLM_LOGGING_LEVEL=WARNING .venv/bin/python docs/measurements/cpu/forward_by_tokens_probe_2026_12_06.py METHOD OUT.json [MAX_NUM_SEQS]

Prints tokens/s, the forwards' total, the median forward at 64 / 48 / 32 / 16 / 8 query tokens,
and the steps of more than 64 (drafts, or prompt chunks) with their time beyond the median
64-token forward. Outputs: floor_c64_2026_12_06.txt.
"""
import json, os, sys, tempfile, time
from pathlib import Path
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import numpy as np
from vllm import LLM, SamplingParams
from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
from vllm_anisotropic.bench.sweep import resolve_config, method_llm_kwargs
from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS

method, out = sys.argv[1], sys.argv[2]
seqs = int(sys.argv[3]) if len(sys.argv) > 3 else 64
model_dir = _resolve_model("smollm2-135m")
prompts = build_prompts(model_dir, "mbpp,math500", 64)
llm = LLM(model=str(model_dir), speculative_config=resolve_config(method, Path(tempfile.mkdtemp()), None),
          max_num_seqs=seqs, **{**CPU_LLM_DEFAULTS, "dtype": "bfloat16", **method_llm_kwargs(method)})
llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
rec = []
fwd = runner._model_forward
def timed(*a, **k):
    ids = k.get("input_ids", a[0] if a else None)
    n = int(ids.shape[0]) if ids is not None else -1
    t0 = time.perf_counter()
    try:
        return fwd(*a, **k)
    finally:
        rec.append((n, time.perf_counter() - t0))
runner._model_forward = timed
t0 = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
sec = time.perf_counter() - t0
tok = sum(len(o.outputs[0].token_ids) for o in outs)
json.dump({"method": method, "tokens": tok, "seconds": sec, "steps": rec}, open(out, "w"))
r = np.array(rec)
print(f"{method}: {tok} tokens {sec:.2f} s = {tok/sec:.1f} tok/s; {len(rec)} forwards, {r[:,1].sum():.2f} s forward")
for n in (64, 48, 32, 16, 8):
    sel = r[r[:, 0] == n, 1]
    if sel.size:
        print(f"  {n} tokens: {sel.size} steps, median {np.median(sel)*1e3:.2f} ms, mean {sel.mean()*1e3:.2f}")
base = np.median(r[r[:, 0] == 64, 1]) if (r[:, 0] == 64).any() else float("nan")
spec = r[(r[:, 0] > 64) & (r[:, 0] <= 64 * 6)]
print(f"  >64 tokens: {len(spec)} steps, {int(spec[:,0].sum() - 64*len(spec))} tokens beyond 64, "
      f"{spec[:,1].sum():.2f} s, beyond the 64-token median {spec[:,1].sum() - base*len(spec):.2f} s")
