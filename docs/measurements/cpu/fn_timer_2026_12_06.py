"""Per-function wall time in the engine: ``profile-host`` with named functions wrapped in a
``perf_counter`` pair (installed after the engine's start, so vLLM's start-up scan never sees the
wrappers); the mean us a call and the calls are printed at exit (stderr, ``fn_timer`` lines).

Usage: FN_TIMER_TARGETS=targets.txt PYTHONPATH=. .venv/bin/python docs/measurements/cpu/fn_timer_2026_12_06.py \
    profile-host --method goose-auto --max-num-seqs 1 --num-prompts 4 --dataset mbpp,math500 --max-tokens 128 --no-profile
targets.txt: one ``module:Qualified.name`` a line (a module-level name is wrapped where it is looked up)."""
import functools, os, sys, time, atexit, importlib
acc = {}
TARGETS = [t for t in open(os.environ['FN_TIMER_TARGETS']).read().split() if t]
def wrap(owner, name, label):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            s = acc.setdefault(label, [0.0, 0]); s[0] += time.perf_counter() - t; s[1] += 1
    setattr(owner, name, w)
def install():
    for t in TARGETS:
        mod, qual = t.split(":")
        owner = importlib.import_module(mod)
        parts = qual.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p)
        wrap(owner, parts[-1], qual)
def report():
    print("fn_timer: label calls mean_us total_ms", file=sys.stderr)
    for k, (s, n) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        print(f"fn_timer {k:45s} {n:6d} {1e6*s/n:9.1f} {1e3*s:9.1f}", file=sys.stderr)
atexit.register(report)
import vllm_anisotropic.bench.profile_host as PH
_orig = PH.StepProbe.__init__
def _init(self, *a, **k):
    install(); _orig(self, *a, **k)
PH.StepProbe.__init__ = _init
from vllm_anisotropic.cli import main
sys.exit(main())
