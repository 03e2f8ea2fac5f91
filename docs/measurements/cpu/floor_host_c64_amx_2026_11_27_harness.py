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
CHAIN = method.startswith("goosechain")
if CHAIN:
    from vllm_anisotropic.bench import sweep as SW
    SW.METHODS["goosechain-b6"] = {"method": "goose", "budget": 6, "allocator": "off"}
    SW.METHODS["goosechain-auto"] = {"method": "goose", "num_speculative_tokens": 5}
    from vllm_anisotropic.proposers import goose as GO0, adjacency as ADJ0
    import numpy as _np
    _prop = GO0.GooseState.propose
    def propose(self, context_tokens, max_nodes=None):
        cfg = self.config
        context = _np.asarray(context_tokens)
        root = int(context[-1])
        if self._prompt_len < 0:
            self._prompt_len = len(context) - 1
        self.matcher.sync(context)
        limit = min(cfg.max_continuation, 5, (max_nodes or 6) - 1)
        hit = self.matcher.match(limit)
        draft = hit.draft
        if not hit.found and self.store is not None:
            draft, n = self.store.match(self.matcher.tokens, limit)
        self.last_info = GO0.ProposalInfo(GO0.ProposalMode.BYPASS, spine_len=len(draft))
        return GO0.spine_chain(root, _np.asarray(draft[:limit], _np.int64), self.spine_acceptance)
    GO0.GooseState.propose = propose
    ADJ0.HarvestingState.harvest_top_k = property(lambda self: 0)
    _obs = GO0.GooseState.observe
    GO0.GooseState.observe = lambda self, tree, accepted, logits, prev_root=None: _obs(self, tree, accepted, None, prev_root)
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
    if os.environ.get("FINE") == "1":
        from vllm_anisotropic.allocator import cost as _C, gate as _G2
        wrap(_C.CostModel, "update", "cost.update"); wrap(_G2.SpeculationGate, "observe", "gate.observe")
        wrap(B.BatchBudget, "_tick", "budget._tick"); wrap(B.BatchBudget, "_score", "budget._score")
        wrap(B.BatchBudget, "on_scheduled", "budget.on_scheduled"); wrap(DR.TreeDrafter, "drop", "drafter.drop")
        wrap(SC.TreeScheduler, "_apply_drafts", "sched._apply_drafts")
        from vllm_anisotropic.integration.vllm import metrics as _M
        wrap(_M.MetricsSink, "tick", "sink.tick"); wrap(_M, "write_json_atomic", "write_json")
        wrap(GO.GooseState if hasattr(GO, "GooseState") else GO.GooseProposer, "finish", "state.finish")
        from vllm.v1.core.sched.scheduler import Scheduler as _S0
        wrap(_S0, "update_from_output", "sched.vllm_update")
        wrap(CPUModelRunner, "_update_states", "runner.vllm_update_states")
        wrap(CPUModelRunner, "sample_tokens", "runner.vllm_sample_tokens")
        wrap(CPUModelRunner, "take_draft_token_ids", "runner.vllm_take_draft")
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
if os.environ.get("NPPROBE") == "1":
    import numpy as _np, math as _math
    _row = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    _upd2 = S.update_from_output
    def update_from_output2(self, so, mro):
        t0 = time.perf_counter(); _np.all(_np.isfinite(_row)); t1 = time.perf_counter()
        _np.all(_np.isfinite(_row)); t2 = time.perf_counter()
        all(map(_math.isfinite, _row)); t3 = time.perf_counter()
        _a = _np.arange(64.0); _a.sum(); t4 = time.perf_counter()
        T["np.first"] = T.get("np.first", 0) + t1 - t0; T["np.second"] = T.get("np.second", 0) + t2 - t1
        T["py.isfinite"] = T.get("py.isfinite", 0) + t3 - t2; T["np.arange_sum"] = T.get("np.arange_sum", 0) + t4 - t3
        return _upd2(self, so, mro)
    S.update_from_output = update_from_output2
if os.environ.get("GATE_CLOSED") == "1":
    from vllm_anisotropic.allocator import gate as _G
    _G.SpeculationGate.decide = lambda self, n: _G.PLAIN
model_dir = _resolve_model("smollm2-135m")
prompts = build_prompts(model_dir, "humaneval,gsm8k,mtbench", nprompt)
spec = resolve_config(method, Path(tempfile.mkdtemp()), None, "bfloat16") if method != "plain" else None
kw = {} if spec is None else {"speculative_config": spec}
llm = LLM(model=str(model_dir), max_num_seqs=seqs, **kw, **{**CPU_LLM_DEFAULTS, "dtype": "bfloat16", **method_llm_kwargs(method)})
llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
# compute_logits on the model class
m = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model if hasattr(llm.llm_engine, "model_executor") else None
LOG.write(json.dumps({"mark": "start"}) + "\n")
import gc as _gc
GCT = {"t0": 0.0, 0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
def _gccb(phase, info):
    if phase == "start":
        GCT["t0"] = time.perf_counter()
    else:
        g = GCT[info["generation"]]; g[0] += 1; g[1] += time.perf_counter() - GCT["t0"]
_gc.callbacks.append(_gccb)
for rep in range(int(os.environ.get("REPS", "1"))):
    t0 = time.perf_counter()
    if os.environ.get("CPROF"):
        import cProfile; pr = cProfile.Profile(); pr.enable()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0.0), use_tqdm=False)
    if os.environ.get("CPROF"):
        pr.disable(); pr.dump_stats(os.environ["CPROF"])
    s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print("GC", {k: (v[0], round(v[1]*1e3, 1)) for k, v in GCT.items() if k != "t0"}, "frozen", _gc.get_freeze_count(), "thresholds", _gc.get_threshold(), flush=True)
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
