"""Per-step timeline of the bench's cells (report split, 48 tokens, warm-up at 4 then 2 requests, repeat 0: c2 then c4), as `bench` runs them (sweep_engine.run_job, vLLM multiprocess): each engine.step()'s wall time, the unfinished requests, the tokens each request emitted. Run: TL_METHOD=plain|dtree-default PYTHONPATH=<tree> VLLM_LOGGING_LEVEL=WARNING .venv/bin/python docs/measurements/cpu/c4_timeline_2026_12_07.py (writes /tmp/tl/log_METHOD.json)."""
import json, os, sys, time, tempfile
from pathlib import Path
sys.argv = ["x"]
from vllm_anisotropic.bench import sweep, sweep_engine
from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
from vllm_anisotropic.bench.offline import CPU_LLM_DEFAULTS
def main():
    METHOD = os.environ.get("TL_METHOD", "dtree-default")
    conc = [2, 4]
    model_dir = _resolve_model("qwen2.5-coder-1.5b"); draft_dir = str(_resolve_model("qwen2.5-coder-0.5b"))
    datasets = ["mbpp", "math500"]
    sizes = sweep.cell_sizes(conc, 2, 2 * len(datasets))
    warmup_size = min(max(conc), 8)
    per_dataset = [build_prompts(model_dir, d, sum(sizes) + warmup_size, context_tokens=0) for d in datasets]
    cell_prompts, warmup = sweep.split_prompts(per_dataset, sizes, warmup_size)
    cells = sweep.cell_order(range(2), conc)
    mine = [(c, p) for c, p in zip(cells, cell_prompts) if c[0] == 0]
    print("cells", [c for c, _ in mine], "prompt tokens", [[len(x) if isinstance(x, list) else None for x in p] for _, p in mine], flush=True)
    tmp = tempfile.mkdtemp()
    job = sweep_engine.SweepJob(model=str(model_dir), method=METHOD,
        speculative_config=sweep.resolve_config(METHOD, Path(tmp), draft_dir, "auto") if METHOD != "plain" else None,
        cells=[c for c, _ in mine], cell_prompts=[p for _, p in mine], warmup_prompts=warmup, warmup="each",
        max_tokens=48, concurrency=conc, temperature=0.0, top_p=1.0,
        llm_kwargs={**CPU_LLM_DEFAULTS, "dtype": "bfloat16", "max_model_len": 2048, **sweep.method_llm_kwargs(METHOD)},
        record_base={})
    orig = sweep_engine.closed_loop
    log = []
    def closed_loop(engine, prompts, params, concurrency, tag):
        step0 = engine.step
        seen = {}
        def step():
            t = time.perf_counter()
            outs = step0()
            dt = time.perf_counter() - t
            emitted = {}
            for o in outs:
                n = len(o.outputs[0].token_ids); emitted[o.request_id] = n - seen.get(o.request_id, 0); seen[o.request_id] = n
            log.append((tag, round(dt, 4), engine.get_num_unfinished_requests(), sorted(emitted.values())))
            return outs
        engine.step = step
        try:
            return orig(engine, prompts, params, concurrency, tag)
        finally:
            engine.step = step0
    sweep_engine.closed_loop = closed_loop
    sweep_engine.run_job(job, Path(tmp, "out.jsonl"))
    for l in open(Path(tmp, "out.jsonl")):
        r = json.loads(l); print(r["concurrency"], r["seconds"], r.get("budget"), flush=True)
    json.dump(log, open(f"/tmp/tl/log_{METHOD}.json", "w"))
    for tag, dt, n, em in log:
        if tag.startswith("r0"):
            print(tag, dt, n, em)


if __name__ == "__main__":
    main()
