"""Count the target forward's rows (tokens a step) under profile-host, to see whether two commits run the
same trees: PYTHONPATH=<tree> .venv/bin/python docs/measurements/cpu/harvest_forward_rows_2026_12_05.py profile-host \
  --method goose-b8 --max-num-seqs 8 --num-prompts 8 --dataset humaneval,gsm8k,mtbench --max-tokens 128 --no-profile
"""
import sys, atexit
import vllm_anisotropic.bench.profile_host as m
stats = {"rows": 0, "calls": 0}
init = m.StepProbe.__init__
def new_init(self, llm):
    init(self, llm)
    runner = self.runner
    fwd = runner._model_forward
    def counting(*a, **k):
        ids = k.get("input_ids")
        pos = k.get("positions")
        t = ids if ids is not None else pos
        if t is not None:
            stats["rows"] += int(t.shape[-1]); stats["calls"] += 1
        return fwd(*a, **k)
    runner._model_forward = counting
m.StepProbe.__init__ = new_init
atexit.register(lambda: print("ROWS", stats))
from vllm_anisotropic.cli import main
sys.exit(main(sys.argv[1:]))
