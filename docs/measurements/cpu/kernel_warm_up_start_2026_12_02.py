"""An engine's start and its first generation (SmolLM2-135M bf16, GOOSE with the allocator, 16
HumanEval prompts x 64 tokens, in process), for the tree on PYTHONPATH, with numba's disk cache
of its kernels emptied first (cold: a fresh install) or left (warm). Before = e3fd241, after =
51bcea4 (every kernel of a tree step compiled or loaded at the start). Run on 2026-12-02
(2-core Intel Xeon; results in kernel_warm_up_start_2026_12_02.txt):

    git worktree add /tmp/g1 e3fd241
    for rep in 1 2; do for tree in /tmp/g1 /work/main; do for cache in cold warm; do
      [ $cache = cold ] && rm -rf $tree/vllm_anisotropic/kernels/__pycache__
      (cd /tmp && PYTHONPATH=$tree VLLM_LOGGING_LEVEL=ERROR /work/main/.venv/bin/python \
        /work/main/docs/measurements/cpu/kernel_warm_up_start_2026_12_02.py $tree $cache | grep TIMES)
    done; done; done
"""
import os, sys, time, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
t0 = time.perf_counter()
from vllm import LLM, SamplingParams
from vllm_anisotropic.models.prepare import model_path
from vllm_anisotropic.data import load_dataset
t1 = time.perf_counter()
llm = LLM(str(model_path("smollm2-135m")), dtype="bfloat16", max_model_len=1024, max_num_seqs=16,
          speculative_config={"method": "goose"}, enforce_eager=True)
t2 = time.perf_counter()
prompts = [p.text for p in load_dataset("humaneval", limit=16)]
llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0), use_tqdm=False)
t3 = time.perf_counter()
print("TIMES", json.dumps({"tree": sys.argv[1], "cache": sys.argv[2], "import_s": t1 - t0, "start_s": t2 - t1, "generate_s": t3 - t2}))
