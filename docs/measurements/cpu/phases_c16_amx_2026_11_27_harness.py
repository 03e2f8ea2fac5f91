"""In-process per-step timing of the tree path's phases (measuring only; docs/allocator.md,
"What a speculative step costs at sixteen requests", 2026-11-27). Wraps the runner's, drafter's,
sampler's and scheduler's methods with timers and writes one JSON line per engine step:
requests R, query tokens Q, new requests, drafts scheduled, step seconds (schedule to
update_from_output), tokens sampled and each phase's milliseconds. With PROFILE_FORWARD=1 it
also runs torch.profiler over the first 15 forwards at 16 requests with 20-40 query tokens (no
new request) and prints their operators' self CPU time per forward.

    python phases_c16_amx_2026_11_27_harness.py METHOD MAX_NUM_SEQS PROMPTS_PER_DATASET OUT.jsonl
"""
import os, sys, time, json, tempfile, functools
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from pathlib import Path
method, seqs, nprompt, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
from vllm import LLM, SamplingParams
from vllm_anisotropic.bench.demo import _resolve_model, build_prompts
from vllm_anisotropic.bench.sweep import method_llm_kwargs, resolve_config
from vllm_anisotropic.integration.vllm.offline import CPU_LLM_DEFAULTS
from vllm_anisotropic.integration.vllm import runner as RN, drafter as DR, sampler as SA, scheduler as SC, budget as B
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.core.sched.scheduler import Scheduler
T = {}
LOG = open(out, "w")
def wrap(cls, name, label=None):
    orig = getattr(cls, name)
    label = label or f"{cls.__name__}.{name}"
    @functools.wraps(orig)
    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            T[label] = T.get(label, 0.0) + time.perf_counter() - t0
    setattr(cls, name, w)
tree = method.startswith(("goose", "tr-"))
PROF = {"n": 0, "tables": []}


def profile_forwards(cls) -> None:
    """torch.profiler around ``_model_forward`` of the steps described in the docstring."""
    import torch
    ex, fwd = cls.execute_model, cls._model_forward

    @functools.wraps(ex)
    def execute_model(self, so, *a, **k):
        self._sl_q = so.total_num_scheduled_tokens if so.num_scheduled_tokens and not so.scheduled_new_reqs else 0
        return ex(self, so, *a, **k)

    @functools.wraps(fwd)
    def model_forward(self, *a, **k):
        if self.input_batch.num_reqs == 16 and 20 <= getattr(self, "_sl_q", 0) <= 40 and PROF["n"] < 15:
            PROF["n"] += 1
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                out = fwd(self, *a, **k)
            PROF["tables"].append(p.key_averages())
            return out
        return fwd(self, *a, **k)

    cls.execute_model, cls._model_forward = execute_model, model_forward

R = RN.TreeCPUModelRunner if tree else CPUModelRunner
if os.environ.get("PROFILE_FORWARD") == "1":
    profile_forwards(R)
for n in ["execute_model", "_prepare_inputs", "_model_forward", "_sample", "sample_tokens", "_bookkeeping_sync",
          "_update_states", "_calc_spec_decode_metadata", "_build_attention_metadata", "propose_draft_token_ids", "take_draft_token_ids"]:
    if hasattr(R, n):
        wrap(R, n, "runner." + n)
if tree:
    from vllm_anisotropic.proposers import adjacency as ADJ, goose as GO
    _tk = ADJ.topk_scores
    def topk_scores(logits, k):
        t0 = time.perf_counter(); r = _tk(logits, k); T["topk"] = T.get("topk", 0) + time.perf_counter() - t0
        T["topk_rows"] = T.get("topk_rows", 0) + logits.shape[0] / 1000; T["dtype_bf16"] = float(logits.dtype == __import__("torch").bfloat16) / 1000
        return r
    ADJ.topk_scores = topk_scores
    import torch as _torch
    T["threads"] = 0
    for n in ["propose_trees", "run_deferred", "_rank", "_label", "observe_batch", "rest", "take_tree"]:
        wrap(DR.TreeDrafter, n, "drafter." + n)
    wrap(SA.TreeRejectionSampler, "forward", "sampler.forward")
    wrap(B.BatchBudget, "cut", "budget.cut"); wrap(B.BatchBudget, "on_output", "budget.on_output")
    S = SC.TreeScheduler
else:
    S = Scheduler
_sch, _upd = S.schedule, S.update_from_output
state = {}
@functools.wraps(_sch)
def schedule(self, *a, **k):
    state["t0"] = time.perf_counter()
    t0 = time.perf_counter(); so = _sch(self, *a, **k); T["sched.schedule"] = T.get("sched.schedule", 0) + time.perf_counter() - t0
    return so
@functools.wraps(_upd)
def update_from_output(self, so, mro):
    bstep = getattr(getattr(self, "budget", None), "_step", None)
    t0 = time.perf_counter(); r = _upd(self, so, mro); now = time.perf_counter()
    T["sched.update"] = T.get("sched.update", 0) + now - t0
    if so.num_scheduled_tokens:
        tok = sum(len(x) for x in mro.sampled_token_ids) if mro.sampled_token_ids else 0
        LOG.write(json.dumps(dict(R=len(so.num_scheduled_tokens), Q=so.total_num_scheduled_tokens, new=len(so.scheduled_new_reqs),
              ndraft=sum(len(v) for v in so.scheduled_spec_decode_tokens.values()), propose=getattr(so, "tree_propose", None),
              T=(bstep[2] if bstep else None), arm=(bstep[6] if bstep else None), sec=now - state.get("t0", now), tok=tok, t={k: round(v * 1e3, 3) for k, v in T.items()})) + "\n")
    T.clear(); T["threads"] = _torch.get_num_threads() / 1000 if tree else 0
    return r
S.schedule, S.update_from_output = schedule, update_from_output
model_dir = _resolve_model("smollm2-135m")
prompts = build_prompts(model_dir, "humaneval,gsm8k,mtbench", nprompt)
spec = resolve_config(method, Path(tempfile.mkdtemp()), None) if method != "plain" else None
kw = {} if spec is None else {"speculative_config": spec}
llm = LLM(model=str(model_dir), max_num_seqs=seqs, **kw, **{**CPU_LLM_DEFAULTS, "dtype": "bfloat16", **method_llm_kwargs(method)})
llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
# compute_logits on the model class
m = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model if hasattr(llm.llm_engine, "model_executor") else None
LOG.write(json.dumps({"mark": "start"}) + "\n")
for rep in range(int(os.environ.get("REPS", "1"))):
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
    s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"RESULT {method} seqs {seqs} rep {rep}: {tokens} tokens {s:.2f} s {tokens/s:.1f} tok/s", flush=True)
LOG.close()
if PROF["tables"]:
    from collections import defaultdict
    agg = defaultdict(lambda: [0.0, 0])
    for t in PROF["tables"]:
        for e in t:
            agg[e.key][0] += e.self_cpu_time_total
            agg[e.key][1] += e.count
    nst = len(PROF["tables"])
    print(f"PROFILED {nst} forwards (R=16, Q 20-40): self CPU ms per forward")
    for k, (us, c) in sorted(agg.items(), key=lambda x: -x[1][0])[:25]:
        print(f"  {us / nst / 1e3:8.3f} ms  {c / nst:6.1f} calls  {k}")
os._exit(0)
