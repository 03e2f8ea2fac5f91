"""Tokens/s of one method at one batch size, vLLM's engine core in-process or in its own
processes (VLLM_ENABLE_V1_MULTIPROCESSING=0/1), no hooks: the measurement behind
docs/allocator.md "One process or three" (2026-11-27). Usage: tput.py METHOD MAX_NUM_SEQS PROMPTS_PER_DATASET"""
import os, sys, time, tempfile
from pathlib import Path


def main() -> None:
    method, seqs, nprompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from vllm import LLM, SamplingParams
    from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
    from vllm_anisotropic.bench.sweep import method_llm_kwargs, resolve_config
    from vllm_anisotropic.integration.vllm.offline import CPU_LLM_DEFAULTS

    model_dir = _resolve_model("smollm2-135m")
    prompts = build_prompts(model_dir, "humaneval,gsm8k,mtbench", nprompt)
    spec = resolve_config(method, Path(tempfile.mkdtemp()), None) if method != "plain" else None
    kw = {} if spec is None else {"speculative_config": spec}
    llm = LLM(model=str(model_dir), max_num_seqs=seqs, **kw,
              **{**CPU_LLM_DEFAULTS, "dtype": "bfloat16", **method_llm_kwargs(method)})
    warm = build_prompts(model_dir, "humaneval", 2, skip=100)  # prompts of their own
    llm.generate(warm, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
    s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    mode = "in-process" if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0" else "multiprocess"
    print(f"RESULT {mode} {method} max_num_seqs {seqs}: {len(prompts)} prompts, {tokens} tokens in {s:.2f} s = {tokens / s:.1f} tokens/s",
          flush=True)
    if mode == "multiprocess":
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
