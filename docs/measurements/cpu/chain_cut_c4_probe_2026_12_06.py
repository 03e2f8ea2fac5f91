"""The chain steps at 4 requests in process: drafts kept per chain step, the depth values (2026-12-06).

Run in a git worktree of 5cfb6e5 (chain steps cut) and of 280d737 (whole chains), venv linked:

    cd /tmp/after && PYTHONPATH=/tmp/after VLLM_LOGGING_LEVEL=WARNING .venv/bin/python \
        /work/main/docs/measurements/cpu/chain_cut_c4_probe_2026_12_06.py REQUESTS [PROMPTS_PER_DATASET]

SmolLM2-135M bf16, mbpp + math500 (8 prompts each by default, 128 tokens), goose-auto, in
process; run as ``4`` and as ``64 64``.
Output: chain_cut_c4_probe_2026_12_06.txt (AMD EPYC, 2 cores, AVX-512, no AMX, 03:59-04:07Z).
"""
import json, os, sys, tempfile
from pathlib import Path
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
from vllm_anisotropic.bench.sweep import resolve_config
from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS
seqs = int(sys.argv[1])
model_dir = _resolve_model("smollm2-135m")
prompts = build_prompts(model_dir, "mbpp,math500", int(sys.argv[2]) if len(sys.argv) > 2 else 8)
llm = LLM(model=str(model_dir), speculative_config=resolve_config("goose-auto", Path(tempfile.mkdtemp()), None),
          max_num_seqs=seqs, **{**CPU_LLM_DEFAULTS, "dtype": "bfloat16"})
b = llm.llm_engine.engine_core.engine_core.scheduler.budget
import time; t0 = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
sec = time.perf_counter() - t0
tok = sum(len(o.outputs[0].token_ids) for o in outs)
m = b.metrics
print(f"{seqs} requests: {tok} tokens {sec:.2f} s = {tok/sec:.1f} tok/s; chain steps {m.chain_steps}, chain drafts {m.chain_drafts} "
      f"({m.chain_drafts / max(m.chain_steps, 1):.2f} a chain step), steps {m.steps}, tree rows {m.tree_rows}")
cd = getattr(b, "chain_depths", None)
if cd is not None:
    print("  depth rates", [round(x, 3) for x in cd.rates()], "reach", [round(x, 3) for x in cd.reach()],
          "tried", [round(x, 1) for x in cd.tried])
print("  gate", json.dumps({k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in b.gate.rates().items()}))
print("  cost now", {k: round(v * 1e3, 3) for k, v in b.cost.coefficients.items() if v})
