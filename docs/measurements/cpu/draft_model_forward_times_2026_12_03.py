"""Per-forward times of vLLM draft_model's draft model inside profile-host (2026-12-03).

Run: PYTHONPATH=. .venv/bin/python docs/measurements/cpu/draft_model_forward_times_2026_12_03.py profile-host \
    --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --method draft_model-k2 --max-num-seqs 4 \
    --num-prompts 8 --max-tokens 64 --max-model-len 2048 --no-profile 2> err.txt
prints to stderr "DFWD tokens ms" per draft forward (layers) and "DLOG rows ms" per logits call.
"""
import sys, time
import vllm_anisotropic.bench.profile_host as ph
orig = ph.StepProbe.__init__
def init(self, llm):
    orig(self, llm)
    d = self.runner.drafter
    m = d.model
    f = m.forward
    def fw(*a, **k):
        t = time.perf_counter()
        out = f(*a, **k)
        ids = k.get("input_ids", a[0] if a else None)
        n = ids.shape[0] if ids is not None else -1
        print("DFWD", n, "%.1f" % ((time.perf_counter() - t) * 1000), file=sys.stderr)
        return out
    m.forward = fw
    cl = m.compute_logits
    def lg(h, *a, **k):
        t = time.perf_counter(); out = cl(h, *a, **k)
        print("DLOG", h.shape[0], "%.1f" % ((time.perf_counter() - t) * 1000), file=sys.stderr)
        return out
    m.compute_logits = lg
ph.StepProbe.__init__ = init
from vllm_anisotropic.cli import main
sys.exit(main())
