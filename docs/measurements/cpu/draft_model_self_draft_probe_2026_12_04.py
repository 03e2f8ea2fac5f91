"""vLLM's own draft_model at T = 0.7, the target drafting for itself (k = 2), float32, 4 prompts x 48
tokens: acceptance with / without the plugin loaded, seeded / unseeded requests.

    .venv/bin/python docs/measurements/cpu/draft_model_self_draft_probe_2026_12_04.py MODEL_DIR seeded|unseeded
    VLLM_PLUGINS=none ...   (the plugin not loaded: plain vLLM 0.32)

Prints one JSON line (vLLM's spec-decode counters); draft_model_self_draft_probe_2026_12_04.jsonl
holds the runs, each with the tree it ran on.
"""
import os, sys, json, time
from vllm import LLM, SamplingParams
def main():
    model = sys.argv[1]; seeded = sys.argv[2] == "seeded"; draft = sys.argv[3] if len(sys.argv) > 3 else model
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
              speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2},
              disable_log_stats=False)
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "Explain why the sky is blue in three sentences.",
               "def quicksort(xs):", "The capital of France is"]
    sps = [SamplingParams(temperature=0.7, max_tokens=48, seed=(100 + i) if seeded else None, ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    m = {x.name: getattr(x, "value", None) for x in llm.get_metrics()}
    dr = {k: v for k, v in m.items() if "spec_decode" in k}
    print(json.dumps({"plugins": os.environ.get("VLLM_PLUGINS"), "seeded": seeded, **dr}))

if __name__ == "__main__":
    main()
