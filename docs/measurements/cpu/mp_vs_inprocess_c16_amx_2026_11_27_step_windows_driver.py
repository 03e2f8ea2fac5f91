def main():
    import os, sys, time, json, tempfile
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from pathlib import Path
    method, seqs, nprompt, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    from vllm import LLM, SamplingParams
    from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
    from vllm_anisotropic.bench.sweep import method_llm_kwargs, resolve_config
    from vllm_anisotropic.integration.vllm.offline import CPU_LLM_DEFAULTS
    from vllm_anisotropic.integration.vllm import budget as B
    global LOG
    LOG = open(out, "w")
    if method != "plain":
        _cut, _ons, _out = B.BatchBudget.cut, B.BatchBudget.on_scheduled, B.BatchBudget.on_output
        def cut(self, running):
            offered = sum(len(r.spec_token_ids) for r in running)
            _cut(self, running)
            self._dx = dict(offered=offered, kept=sum(self._kept.values()), allowed=self._drafting,
                            spd=self.metrics.last_predicted_speedup)
        def on_scheduled(self, so):
            _ons(self, so)
            self._dx2 = dict(getattr(self, "_dx", {}), new=len(so.scheduled_new_reqs),
                             ndraft=sum(len(v) for v in so.scheduled_spec_decode_tokens.values()))
        def on_output(self, so, mro):
            step = self._step; dx = getattr(self, "_dx2", {})
            pred = None
            if step is not None:
                r, q, t, c, d, t0, arm = step
                pred = float(self.cost.predict(r, q, t, c, d))
            _out(self, so, mro)
            now = time.perf_counter()
            if step is not None:
                tok = sum(len(x) for x in mro.sampled_token_ids) if mro.sampled_token_ids else 0
                LOG.write(json.dumps(dict(dx, R=r, Q=q, T=t, C=c, D=d, arm=arm, sec=now - t0, pred=pred, tok=tok,
                                          prop=float(getattr(mro, "tree_propose_s", 0.0) or 0.0), t=now)) + "\n")
        B.BatchBudget.cut, B.BatchBudget.on_scheduled, B.BatchBudget.on_output = cut, on_scheduled, on_output
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as S
        _sch, _upd = S.schedule, S.update_from_output
        def schedule(self, *a, **k):
            self._t0 = time.perf_counter(); return _sch(self, *a, **k)
        def update_from_output(self, so, mro):
            now = time.perf_counter()
            if so.num_scheduled_tokens:
                tok = sum(len(x) for x in mro.sampled_token_ids) if mro.sampled_token_ids else 0
                LOG.write(json.dumps(dict(R=len(so.num_scheduled_tokens), Q=so.total_num_scheduled_tokens, new=len(so.scheduled_new_reqs),
                                          ndraft=sum(len(v) for v in so.scheduled_spec_decode_tokens.values()), sec=now - self._t0, tok=tok, t=now)) + "\n")
            return _upd(self, so, mro)
        S.schedule, S.update_from_output = schedule, update_from_output
    model_dir = _resolve_model("smollm2-135m")
    prompts = build_prompts(model_dir, "humaneval,gsm8k,mtbench", nprompt)
    spec = None if method == "plain" else resolve_config(method, Path(tempfile.mkdtemp()), None, "bfloat16")
    kw = {} if spec is None else {"speculative_config": spec}
    llm = LLM(model=str(model_dir), max_num_seqs=seqs, **kw, **{**CPU_LLM_DEFAULTS, "dtype": "bfloat16", **method_llm_kwargs(method)})
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    LOG.write(json.dumps({"mark": "start"}) + "\n")
    for rep in range(int(os.environ.get("REPS", "1"))):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
        s = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        print(f"RESULT {method} seqs {seqs} rep {rep}: {len(prompts)} prompts {tokens} tokens {s:.2f} s {tokens/s:.1f} tok/s", flush=True)
        LOG.write(json.dumps({"mark": "rep", "rep": rep, "sec": s, "tokens": tokens}) + "\n")
    LOG.flush()
    llm.llm_engine.engine_core.shutdown()
if __name__ == '__main__':
    main()
