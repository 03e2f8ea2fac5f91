"""Which surviving mutants of ``kernels/allocate.py`` change a decision on some input? A
differential search: each mutant's ``allocate_batch`` (pure Python, numba off) against the
original's on the same random batches, every output compared exactly (the cuts, T, expected
tokens, seconds, plain rate, rate_upper, hull gap, or the exception raised). A batch where they
differ is printed (the first per mutant) and becomes a worked example in tests/test_allocator.py;
a mutant with no such batch in ``--trials`` is one the search could not tell from the original.

Batches: 2-6 requests, lists (1-6 entries; non-increasing unless --unsorted-share) of gains drawn
from a small set (ties; --set-share) or uniformly, contexts from --ctx (all equal in
--equal-ctx-share of the batches), token budgets none or small, cost models with the context
(tree_ctx, 1e-6..1e-2) and b_D (spec_request) terms on or off, contexts not given in
--no-ctx-share of them.

    NUMBA_DISABLE_JIT=1 PYTHONPATH=. .venv/bin/python docs/measurements/cpu/allocate_mutant_search_2026_12_02.py \
        --ids 13,28,29,107,110,113,118,130,139,140,141,142,151,165 --trials 4000
"""
import argparse
import inspect
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("NUMBA_DISABLE_JIT", "1")
import numpy as np  # noqa: E402

from vllm_anisotropic import kernels  # noqa: E402
from vllm_anisotropic.allocator import CostModel, allocate  # noqa: E402

FUNCS = "_best_of,_scan_checked,allocate_batch"
TARGET = "vllm_anisotropic/kernels/allocate.py"


def mutant_source(mid: int) -> str:
    """The mutated function's source (scripts/mutate.py --show), decorator dropped."""
    out = subprocess.run([sys.executable, "scripts/mutate.py", TARGET, "-f", FUNCS, "--show", str(mid), "--", "tests"],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()[1:]  # the header line names the mutant
    return "\n".join(line for line in lines if not line.startswith("@"))


def namespace(src: str | None):
    """A copy of the module's globals with the mutated function (if any) and every function of the
    chain re-defined there, so that allocate_batch calls the mutant."""
    mod = kernels.load("allocate")
    ns = dict(vars(mod))
    for name in FUNCS.split(","):
        code = textwrap.dedent(inspect.getsource(getattr(mod, name).py_func if hasattr(getattr(mod, name), "py_func")
                                                 else getattr(mod, name)))
        exec("\n".join(line for line in code.splitlines() if not line.startswith("@")), ns)
    if src is not None:
        exec(src, ns)
    return ns


def batch(rng, args):
    b = int(rng.integers(2, 7))
    if rng.random() < args.set_share:
        lists = [rng.choice(args.gains, int(rng.integers(1, 7))) for _ in range(b)]
    else:
        lists = [rng.random(int(rng.integers(1, 7))) for _ in range(b)]
    if rng.random() >= args.unsorted_share:
        lists = [np.sort(p)[::-1].copy() for p in lists]
    cost = CostModel.from_coefficients([0.0], base=float(rng.uniform(0.01, 0.2)), slopes=[float(rng.uniform(0, 0.05))],
                                       tree_row=float(rng.uniform(0, 0.02)),
                                       tree_ctx=float(rng.choice([0.0, 10 ** rng.uniform(-6, -2)])),
                                       spec_request=float(rng.choice([0.0, rng.uniform(0, 0.05)])))
    ctx = rng.choice(args.ctx, b) if rng.random() >= args.equal_ctx_share else np.full(b, args.ctx[0])
    budget = None if rng.random() < 0.7 else int(rng.integers(0, 8))
    if rng.random() < args.no_ctx_share:
        ctx = None  # no contexts given: no context rounds
    return lists, cost, ctx, budget


def outcome(ns, lists, cost, ctx, budget):
    mod = kernels.load("allocate")
    saved = mod.allocate_batch
    mod.allocate_batch = ns["allocate_batch"]
    try:
        a = allocate(lists, cost, ctx_lens=ctx, token_budget=budget)
        return (a.cuts.tolist(), a.tree_rows, a.expected_tokens, a.seconds, a.plain_rate, a.rate_upper, a.hull_gap)
    except Exception as e:  # noqa: BLE001 - a mutant may raise where the original does not
        return ("raised", type(e).__name__, str(e))
    finally:
        mod.allocate_batch = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ids", required=True)
    ap.add_argument("--trials", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ctx", default="0,10,300,3000", help="contexts drawn from these (comma-separated)")
    ap.add_argument("--equal-ctx-share", type=float, default=0.2, help="batches whose contexts are all the first of --ctx")
    ap.add_argument("--set-share", type=float, default=0.5, help="batches with gains from a small set (ties), the rest uniform")
    ap.add_argument("--gains", default="0.05,0.3,0.5,0.7,0.9", help="the small set of gains (comma-separated)")
    ap.add_argument("--no-ctx-share", type=float, default=0.0, help="batches allocated without contexts (ctx_lens None)")
    ap.add_argument("--unsorted-share", type=float, default=0.0, help="batches whose lists are not sorted")
    args = ap.parse_args()
    args.ctx = np.array([float(c) for c in args.ctx.split(",")])
    args.gains = np.array([float(g) for g in args.gains.split(",")])
    original = namespace(None)
    rng = np.random.default_rng(args.seed)
    inputs = [batch(rng, args) for _ in range(args.trials)]
    want = [outcome(original, *x) for x in inputs]
    for mid in (int(i) for i in args.ids.split(",")):
        ns = namespace(mutant_source(mid))
        hit = next((t for t, x in enumerate(inputs) if outcome(ns, *x) != want[t]), None)
        if hit is None:
            print(f"#{mid}: no difference in {args.trials} batches")
            continue
        lists, cost, ctx, budget = inputs[hit]
        print(f"#{mid}: differs at trial {hit}: lists={[p.tolist() for p in lists]} weights={cost.weights.tolist()} "
              f"ctx={None if ctx is None else ctx.tolist()} budget={budget}\n  original {want[hit]}\n  mutant   {outcome(ns, *inputs[hit])}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
