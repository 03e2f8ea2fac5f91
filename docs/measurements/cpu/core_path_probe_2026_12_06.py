"""The engine core's own work per step, in process: seconds a step in the scheduler's ``schedule``
and ``update_from_output`` (both on a step's critical path when scheduling is synchronous, as
with a tree method), by the step's arm, at 64 requests.

Usage: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/core_path_probe_2026_12_06.py METHOD [SEQS PROMPTS]
(smollm2-135m, bf16, mbpp + math500, 128 tokens, as profile-host builds it)."""
import collections
import sys
import time
import types

from vllm_anisotropic.bench import profile_host

method = sys.argv[1]
seqs = int(sys.argv[2]) if len(sys.argv) > 2 else 64
nprompts = int(sys.argv[3]) if len(sys.argv) > 3 else 64
sums = collections.defaultdict(lambda: [0, 0.0, 0.0])  # arm -> steps, schedule s, update s
orig = profile_host.StepProbe


class Probe(orig):
    def __init__(self, llm):
        super().__init__(llm)  # wraps schedule (by arm) and update_from_output first
        sched = self.scheduler
        budget = getattr(sched, "budget", None)
        schedule, update = sched.schedule, sched.update_from_output
        state = {}

        def timed_schedule(*a, **k):
            t0 = time.perf_counter()
            out = schedule(*a, **k)
            state["arm"] = profile_host.step_arm(out, budget)
            state["s"] = time.perf_counter() - t0
            return out

        def timed_update(*a, **k):
            t0 = time.perf_counter()
            out = update(*a, **k)
            s = sums[state.get("arm", "?")]
            s[0] += 1
            s[1] += state.get("s", 0.0)
            s[2] += time.perf_counter() - t0
            return out

        sched.schedule, sched.update_from_output = timed_schedule, timed_update


profile_host.StepProbe = Probe
args = types.SimpleNamespace(model="smollm2-135m", dataset="mbpp,math500", num_prompts=nprompts, max_tokens=128,
                             method=method, max_num_seqs=seqs, dtype="bfloat16", draft=None, max_model_len=None,
                             temperature=0.0, top_p=1.0, seed=None, no_profile=True, top=0, dump=None, json=None)
profile_host.run(args)
total = [0, 0.0, 0.0]
for arm, (n, s, u) in sorted(sums.items()):
    print(f"CORE {method} {arm:7s} {n:4d} steps: schedule {s / n * 1e3:.3f} ms, update_from_output {u / n * 1e3:.3f} ms a step")
    total = [total[0] + n, total[1] + s, total[2] + u]
print(f"CORE {method} all     {total[0]:4d} steps: schedule {total[1] / total[0] * 1e3:.3f} ms, "
      f"update_from_output {total[2] / total[0] * 1e3:.3f} ms a step")
