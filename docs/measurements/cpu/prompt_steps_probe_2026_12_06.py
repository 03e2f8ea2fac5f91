"""Per-step composition of an offline batch (the steps with prompt tokens at 64 requests).

Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/prompt_steps_probe_2026_12_06.py METHOD SEQS PROMPTS OUT.jsonl
Builds the LLM as ``profile-host`` does (smollm2-135m, bf16, mbpp + math500, 128 tokens) and writes
one line per step: its arm (profile_host.step_arm), prompt tokens scheduled, decode requests,
their query tokens and draft tokens, running / waiting requests at the schedule call, the
forward's seconds and the step's wall seconds (one schedule call to the next)."""
import json
import os
import sys
import time
import types

from vllm_anisotropic.bench import profile_host

method, seqs, nprompts, out_path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
captured = {}
orig_probe = profile_host.StepProbe


class Probe(orig_probe):
    def __init__(self, llm):
        super().__init__(llm)
        sched = self.scheduler
        budget = getattr(sched, "budget", None)
        print("max_num_batched_tokens", sched.scheduler_config.max_num_batched_tokens,
              "long_prefill_token_threshold", sched.scheduler_config.long_prefill_token_threshold, flush=True)
        self.rows = []
        inner = sched.schedule
        fwd = self.runner._model_forward
        self._fwd = 0.0

        def timed_forward(*a, **k):
            t0 = time.perf_counter()
            try:
                return fwd(*a, **k)
            finally:
                self._fwd += time.perf_counter() - t0

        self.runner._model_forward = timed_forward

        def schedule(*a, **k):
            t0 = time.perf_counter()
            if self.rows:
                self.rows[-1]["wall_s"] = t0 - self.rows[-1].pop("_t0")
                self.rows[-1]["forward_s"] = self._fwd
            self._fwd = 0.0
            before = {r.request_id: (r.num_computed_tokens, r.num_prompt_tokens) for r in sched.running}
            nrun, nwait = len(sched.running), len(sched.waiting)
            out = inner(*a, **k)
            prompt = dec_q = dec_n = spec = 0
            for rid, n in out.num_scheduled_tokens.items():
                c = before.get(rid)
                if c is None or c[0] < c[1]:
                    prompt += n
                else:
                    dec_n += 1
                    dec_q += n
                    spec += len(out.scheduled_spec_decode_tokens.get(rid, ()))
            self.rows.append({"arm": profile_host.step_arm(out, budget), "prompt": prompt, "new": len(out.scheduled_new_reqs),
                              "decode_reqs": dec_n, "decode_q": dec_q, "spec": spec, "running": nrun,
                              "waiting": nwait, "_t0": t0})
            return out

        sched.schedule = schedule
        captured["probe"] = self


profile_host.StepProbe = Probe
args = types.SimpleNamespace(model="smollm2-135m", dataset="mbpp,math500", num_prompts=nprompts, max_tokens=128,
                             method=method, max_num_seqs=seqs, dtype="bfloat16", draft=None, max_model_len=None,
                             temperature=0.0, top_p=1.0, seed=None, no_profile=True, top=0, dump=None, json=None)
profile_host.run(args)
rows = captured["probe"].rows
if rows and "_t0" in rows[-1]:
    rows[-1].pop("_t0")
with open(out_path, "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
pr = [r for r in rows if r["arm"] == "prompt" and "wall_s" in r]
print(f"{method}: {len(rows)} steps; prompt steps {len(pr)}: prompt tokens {sum(r['prompt'] for r in pr)}, "
      f"decode reqs in them {sum(r['decode_reqs'] for r in pr)}, draft tokens in them {sum(r['spec'] for r in pr)}, "
      f"wall {sum(r['wall_s'] for r in pr):.2f} s, forward {sum(r['forward_s'] for r in pr):.2f} s")
