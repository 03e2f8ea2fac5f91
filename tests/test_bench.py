"""``vllm-anisotropic bench`` (``bench/sweep.py``): the closed loop keeps exactly the asked
concurrency, the summary takes medians and compares with plain at the same concurrency, the
plot is a real PNG, bad arguments are refused by name; and one bounded run in real vLLM (CPU
build, tiny model, float32) whose GOOSE outputs equal plain decoding's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_anisotropic.bench import sweep, sweep_engine
from vllm_anisotropic.cli import main as cli_main


class _Engine:
    """Stand-in for ``LLMEngine``: each request finishes after a per-request number of steps
    (later requests finish first, so outputs arrive out of order)."""

    def __init__(self):
        self.live: dict[str, int] = {}
        self.max_live = 0
        self.added: list[str] = []

    def add_request(self, request_id, prompt, params):
        self.live[request_id] = 1 + (len(prompt) % 3)
        self.added.append(request_id)
        self.max_live = max(self.max_live, len(self.live))

    def step(self):
        out = []
        for rid in list(self.live):
            self.live[rid] -= 1
            if self.live[rid] == 0:
                del self.live[rid]
                out.append(SimpleNamespace(request_id=rid, finished=True,
                                           outputs=[SimpleNamespace(token_ids=[int(rid.rsplit("-", 1)[1])] * 2)]))
        return out[::-1]


@pytest.mark.parametrize("concurrency", [1, 3, 16])
def test_closed_loop_keeps_the_concurrency_and_the_prompt_order(concurrency):
    engine = _Engine()
    prompts = ["a" * (7 - i % 5) for i in range(10)]
    outputs, seconds = sweep_engine.closed_loop(engine, prompts, None, concurrency, "t")
    assert engine.max_live == min(concurrency, len(prompts))  # never more, and filled up to c
    assert outputs == [[i, i] for i in range(10)]  # outputs[i] belongs to prompt i
    assert len(engine.added) == 10 and seconds >= 0


@pytest.mark.parametrize("warmup, concurrency, runs", [("each", [4, 1, 2], [4, 1, 2]), ("largest", [4, 1, 2], [4]),
                                                      ("each", [16, 1, 32], [8, 1]), ("each", [1], [1])])
def test_the_warm_up_runs_at_each_concurrency_or_the_largest(warmup, concurrency, runs):
    """``--warmup each`` fills every measured batch size up to the warm-up's 8 prompts before the
    cells (the gate's warm-up there), the largest first (it takes the engine's cold first
    steps), ``largest`` the largest alone. Catches: one concurrency only, every one at the
    largest, the same loop of 8 run again for each larger one, or the smallest first."""
    job = sweep_engine.SweepJob(model="m", method="plain", speculative_config=None, cell_prompts=[["p"]],
                                cells=[(0, 1)], warmup_prompts=["a" * (i + 1) for i in range(8)], max_tokens=4,
                                concurrency=concurrency, warmup=warmup)
    engine = _Engine()
    peaks = []
    engine_step = engine.step
    def step():  # the most requests in flight during each concurrency's loop
        peaks[-1] = max(peaks[-1], len(engine.live))
        return engine_step()
    engine.step = step
    add = engine.add_request
    def add_request(rid, prompt, params):
        if rid.endswith("-0"):
            peaks.append(0)
        add(rid, prompt, params)
    engine.add_request = add_request
    assert sweep_engine.warm_up(engine, job, None) == runs
    assert peaks == runs and len(engine.added) == 8 * len(runs)


@pytest.mark.parametrize("warmup_tokens, expected", [(None, 48), (16, 16)])
def test_the_warm_ups_requests_are_as_long_as_the_cells_unless_told(warmup_tokens, expected):
    """Catches: the old fixed 16 tokens, ``--warmup-tokens`` ignored, or the cells' law lost."""
    job = sweep_engine.SweepJob(model="m", method="dtree", speculative_config=None, cell_prompts=[["p"]],
                                cells=[(0, 1)], warmup_prompts=["w"], max_tokens=48, warmup_tokens=warmup_tokens,
                                concurrency=[1], temperature=0.7, top_p=0.9)
    assert sweep_engine.warmup_params(job, dict) == {"max_tokens": expected, "temperature": 0.7, "top_p": 0.9}


@pytest.mark.parametrize("grows, loops", [((3, 8, None), [2, 2, 2, 1]), ((8, 3, None), [2, 2, 2, 1]), ((8, 8, 3), [2, 2, 2, 1]),
                                          ((0, 0, None), [2, 2, 2, 2, 1]), ((8, 8, None), [2, 1]), (None, [2, 1])])
def test_the_warm_up_loops_again_on_other_prompts_while_the_gate_warms_up(tmp_path, monkeypatch, grows, loops):
    """A tree method's warm-up at a concurrency runs again, on the next prompts, while an arm of
    the gate's bucket there (plain, tree, chain where it has chains) has fewer than min_steps (8)
    steps, by the allocator's stats file, which each loop here advances by ``grows`` (plain, tree,
    chain steps) at its batch size; at most WARMUP_ROUNDS loops; one request's bucket, warm
    already, runs once; a stats file without a gate (``grows`` None: the allocator or its gate
    off) one loop each. Catches: no second loop, the same prompts again, no cap, another bucket
    read, an arm left out (plain, tree or chain), the file not read, a gate-less file read as a
    gate that never warms."""
    from vllm_anisotropic.integration.vllm.engine import metrics

    stats = tmp_path / "tree_stats.json"
    monkeypatch.setenv(metrics.STATS_ENV, str(stats))
    gate = {"1": {"plain_steps": 9, "spec_steps": 30, "chain_steps": 30, "decisions": 40}}
    def write():
        Path(f"{stats}.budget").write_text(json.dumps({"steps": 1, **({"gate": gate} if grows else {})}))
    write()
    job = sweep_engine.SweepJob(model="m", method="dtree", speculative_config=None, cell_prompts=[["p"]],
                                cells=[(0, 1)], warmup_prompts=[f"w{i}" for i in range(8)], warmup_loop=2,
                                max_tokens=4, concurrency=[1, 2])
    engine = _Engine()
    add = engine.add_request
    def add_request(rid, prompt, params):
        if rid.endswith("-0") and grows:  # a loop starts: the steps it adds at its batch size
            b = gate.setdefault(str(sweep_engine.gate_bucket(int(rid[4:].split("-")[0]))),
                                {"plain_steps": 0, "spec_steps": 0, **({"chain_steps": 0} if grows[2] is not None else {})})
            for arm, n in zip(("plain_steps", "spec_steps", "chain_steps"), grows):
                if n is not None:
                    b[arm] = b.get(arm, 0) + n
            write()
        sent.append(prompt)
        add(rid, prompt, params)
    sent = []
    engine.add_request = add_request
    assert sweep_engine.warm_up(engine, job, None) == loops
    twos = len(loops) - 1
    assert sorted(sent[: 2 * twos]) == [f"w{i}" for i in range(2 * twos)]  # the next prompts each loop
    assert sorted(sent[2 * twos :]) == ["w0", "w1"]  # one request's loop: the first prompts


def test_the_bench_reads_the_gates_buckets_and_warm_up_length_as_the_package_defines_them():
    from vllm_anisotropic.allocator.config import GateConfig
    from vllm_anisotropic.allocator.gate import bucket

    c = GateConfig()
    assert sweep_engine.GATE_EXACT_BUCKETS == c.exact_buckets
    assert sweep_engine.GATE_MIN_STEPS == c.min_steps
    assert [sweep_engine.gate_bucket(r) for r in range(1, 70)] == [bucket(r, c.exact_buckets) for r in range(1, 70)]


def test_cells_get_disjoint_prompts_mixed_from_every_dataset():
    sizes = sweep.cell_sizes([1, 8], repeats=2, per_cell=6)
    assert sizes == [6, 16, 6, 16]  # at least twice the concurrency
    data = [[f"h{i}" for i in range(40)], [f"g{i}" for i in range(40)], [f"m{i}" for i in range(5)]]
    cells, warm = sweep.split_prompts(data, sizes, 4)
    assert [len(c) for c in cells] == sizes and len(warm) == 4
    everything = [p for c in cells for p in c] + warm
    assert len(set(everything)) == len(everything)  # no prompt seen twice by one engine
    assert cells[0] == ["h0", "g0", "m0", "h1", "g1", "m1"]  # round robin over the datasets
    with pytest.raises(ValueError, match="hold 85 prompts"):
        sweep.split_prompts(data, [40, 40], 8)


def _rec(method, c, r, tps, tau=1.0, sha=("a", "b")):
    return {"method": method, "concurrency": c, "repeat": r, "tokens_per_s": tps, "tau": tau, "output_sha1": list(sha)}


def test_summary_takes_medians_and_compares_with_plain_at_the_same_concurrency():
    records = [
        _rec("plain", 1, 0, 10.0), _rec("plain", 1, 1, 12.0), _rec("plain", 1, 2, 100.0),  # median 12, not mean
        _rec("plain", 8, 0, 40.0),
        _rec("goose-auto", 1, 3, 18.0, 1.5), _rec("goose-auto", 1, 4, 24.0, 1.7, ("a", "x")), _rec("goose-auto", 1, 5, 30.0, 1.6),
        _rec("goose-auto", 8, 0, 20.0, 1.2, ("x", "y")),
        {"method": "suffix", "skipped": "no arctic_inference"},
    ]
    rows = {(r["method"], r.get("concurrency")): r for r in sweep.summarize(records)}
    g1 = rows[("goose-auto", 1)]  # repeats plain did not run: against plain's median
    assert (g1["median"], g1["min"], g1["max"], g1["tau"]) == (24.0, 18.0, 30.0, 1.6)
    assert g1["speedup"] == pytest.approx(2.0) and g1["speedup_min"] == pytest.approx(1.5)
    assert g1["identical"] == (2, 2)  # the first repeat's outputs against plain's first repeat
    g8 = rows[("goose-auto", 8)]
    assert g8["speedup"] == pytest.approx(0.5) and g8["identical"] == (0, 2)
    assert rows[("plain", 1)]["speedup"] == pytest.approx(1.0)
    assert rows[("suffix", None)]["skipped"] == "no arctic_inference"
    table = sweep.format_table(sweep.summarize(records))
    assert "| goose-auto | 8 | 20.0 (20.0..20.0) | **0.50x** (0.50..0.50) | 1.20 | 0/2 |" in table
    assert "suffix: not run: no arctic_inference" in table
    # methods listed in registry order, plain first
    assert table.splitlines()[2].startswith("| plain | 1 |")


def test_cells_record_the_gates_decode_steps_from_the_allocators_stats_file(tmp_path, monkeypatch):
    """The engine process reads the allocator's counters from ``<stats>.budget`` (the name the
    plugin gives it), splits a cell's decode steps by the gate's decision (tree = the rest of
    plain and chain steps), and the table sums them over the repeats in a last column."""
    from vllm_anisotropic.integration.vllm.engine import metrics

    assert sweep_engine.STATS_ENV == metrics.STATS_ENV
    stats = tmp_path / "tree_stats.json"
    monkeypatch.setenv(metrics.STATS_ENV, str(stats))
    assert metrics.budget_stats_path() == f"{stats}.budget"
    assert sweep_engine.budget_counters() == {} and sweep_engine.gate_rates() == {}  # no allocator: no file
    fields = {"steps": 40, "steps_without_drafts": 15, "gate_plain_steps": 12, "chain_steps": 5, "chain_drafts": 9,
              "tree_rows": 70, "draft_resume_seconds": 1.25, "cost_samples": 3}
    Path(metrics.budget_stats_path()).write_text(json.dumps(fields))
    assert sweep_engine.gate_rates() == {}  # the gate off
    got = sweep_engine.budget_counters()
    assert got == {**{k: v for k, v in fields.items() if k in sweep_engine.BUDGET_FIELDS}, "draft_unrepaid_catchups": 0}
    gate = {"1": {"plain_rate": 4.4, "plain_steps": 30, "spec_rate": 3.9, "spec_steps": 9, "decisions": 40}}
    Path(metrics.budget_stats_path()).write_text(json.dumps({**fields, "gate": gate}))
    assert sweep_engine.gate_rates() == gate and sweep_engine.budget_counters() == got
    assert sweep_engine.step_kinds(got) == {"trees": 23, "chains": 5, "plain": 12}
    assert sweep_engine.step_kinds({"steps": 0, "gate_plain_steps": 0, "chain_steps": 0}) == {}
    records = [_rec("plain", 8, 0, 40.0), _rec("plain", 8, 1, 40.0),
               {**_rec("goose-auto", 8, 0, 44.0), "decode_steps": {"trees": 23, "chains": 5, "plain": 12}},
               {**_rec("goose-auto", 8, 1, 44.0), "decode_steps": {"trees": 7, "chains": 15, "plain": 38}}]
    rows = {(r["method"], r["concurrency"]): r for r in sweep.summarize(records)}
    assert rows[("goose-auto", 8)]["decode_steps"] == {"trees": 30, "chains": 20, "plain": 50}
    assert rows[("plain", 8)]["decode_steps"] is None
    table = sweep.format_table(sweep.summarize(records)).splitlines()
    assert table[0].endswith("| decode steps tree / chain / plain |")
    assert table[2].startswith("| plain | 8 |") and table[2].endswith("| — |")
    assert table[3].endswith("| 30 / 20 / 50 % of 100 |")
    assert "decode steps" not in sweep.format_table(sweep.summarize(records[:2]))  # no allocator: no column


def test_speedup_pairs_each_repeat_with_plains_same_repeat():
    """The machine slows down 20 % between repeats; the method is 1.10x plain in each. Paired
    ratios say 1.10x in every repeat; medians over unpaired repeats would say 1.00x..1.21x."""
    records = []
    for r, speed in enumerate([1.0, 0.8, 0.9]):
        records += [_rec("plain", 4, r, 100.0 * speed), _rec("ngram5", 4, r, 110.0 * speed)]
    row = {(x["method"], x["concurrency"]): x for x in sweep.summarize(records)}[("ngram5", 4)]
    assert row["speedup"] == pytest.approx(1.1) and row["speedup_min"] == pytest.approx(1.1)
    assert row["speedup_max"] == pytest.approx(1.1)
    assert (row["min"], row["max"]) == (88.0, 110.0)  # tokens/s themselves keep the drift


def test_speedup_interval_is_paired_and_marks_cells_that_contain_one():
    """Three repeats: ratios 1.10 / 1.20 / 1.15 give the geometric mean 1.149 and the t-interval
    [1.032, 1.280] (t(0.975, 2) = 4.303 on the logs); ratios around 1.0 give an interval
    containing 1.00x, marked "~". An interval from unpaired medians, or a wrong t quantile
    (1.96 instead of 4.303 gives [1.09, 1.21]), fails the numbers."""
    records = []
    for r, (p, g, n) in enumerate([(100.0, 110.0, 102.0), (80.0, 96.0, 78.4), (90.0, 103.5, 94.5)]):
        records += [_rec("plain", 4, r, p), _rec("goose-auto", 4, r, g), _rec("ngram5", 4, r, n)]
    rows = {x["method"]: x for x in sweep.summarize(records)}
    g = rows["goose-auto"]
    assert (g["speedup"], g["speedup_low"], g["speedup_high"]) == pytest.approx((1.1493, 1.0315, 1.2805), abs=1e-4)
    table = sweep.format_table(list(rows.values()))
    assert "| goose-auto | 4 | 103.5 (96.0..110.0) | **1.15x** [1.03, 1.28] (1.10..1.20) |" in table
    ngram_line = next(line for line in table.splitlines() if line.startswith("| ngram5 |"))
    assert "~ (0.98..1.05)" in ngram_line and "~" not in table.split("| goose-auto |")[1].splitlines()[0]
    assert rows["plain"]["speedup_low"] == pytest.approx(1.0)  # plain against itself: [1, 1]


def test_splits_are_disjoint_datasets_and_records_name_theirs():
    """The held-out split shares no dataset with the one the defaults were tuned on; a run over
    datasets of both is "mixed", never passed off as held out."""
    from vllm_anisotropic.data import dataset_names

    assert not set(sweep.SPLITS["tune"]) & set(sweep.SPLITS["report"])
    assert set(sweep.SPLITS["tune"]) | set(sweep.SPLITS["report"]) <= set(dataset_names())
    assert sweep.split_of(["mbpp", "math500"]) == "report" and sweep.split_of(["humaneval"]) == "tune"
    assert sweep.split_of(["mbpp", "humaneval"]) == "mixed"
    assert "(report split)" in sweep._title([{**_rec("plain", 1, 0, 1.0), "split": "report", "dataset": "mbpp"}])


def test_demo_bootstrap_pairs_prompts():
    """The one-at-a-time interval resamples prompts with both passes' times together: a method
    2x faster on every prompt, whatever the prompts' lengths, has the interval [2, 2]; unpaired
    resampling would spread it by the prompts' own spread (here 1 s .. 9 s)."""
    from vllm_anisotropic.bench.stats import bootstrap_rate_ratio, format_speedup, ratio_interval

    plain_s = [1.0, 3.0, 9.0, 2.0]
    point, low, high = bootstrap_rate_ratio([50] * 4, [t / 2 for t in plain_s], [50] * 4, plain_s)
    assert (point, low, high) == pytest.approx((2.0, 2.0, 2.0))
    point, low, high = bootstrap_rate_ratio([50] * 4, [0.5, 3.0, 4.5, 2.0], [50] * 4, plain_s)
    assert low < point < high and point == pytest.approx(15 / 10)
    assert format_speedup(1.02, 0.97, 1.08) == "1.02x [0.97, 1.08] ~" and format_speedup(1.5, None, None) == "1.50x"
    assert ratio_interval([1.3]) == (pytest.approx(1.3), None, None)


def test_interleaved_plan_alternates_the_method_order_per_repeat():
    plan = sweep.job_plan(["plain", "ngram5", "goose-auto"], 3, "interleaved")
    assert [m for m, _ in plan] == ["plain", "ngram5", "goose-auto", "goose-auto", "ngram5", "plain",
                                    "plain", "ngram5", "goose-auto"]
    assert [r for _, r in plan] == [[0]] * 3 + [[1]] * 3 + [[2]] * 3  # one engine per (repeat, method)
    # a linear drift lands on every method alike: mean position over the repeats is the same
    pos = {m: sum(i for i, (x, _) in enumerate(plan[:6]) if x == m) for m in ("plain", "ngram5", "goose-auto")}
    assert len(set(pos.values())) == 1
    assert sweep.job_plan(["plain", "ngram5"], 2, "grouped") == [("plain", [0, 1]), ("ngram5", [0, 1])]
    with pytest.raises(ValueError, match="valid: interleaved, grouped"):
        sweep.job_plan(["plain"], 1, "random")


def test_plot_is_a_png(tmp_path):
    records = [_rec("plain", c, 0, 10.0 * c) for c in (1, 2, 4)] + [_rec("goose-b4", c, 0, 12.0 * c) for c in (1, 2, 4)]
    path = tmp_path / "fig" / "bench.png"
    sweep.plot(sweep.summarize(records), path, "test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # one repeat whose ratio's geometric mean rounds below it (exp(log(108 / 37)) = 108 / 37 - 4.4e-16:
    # a full suite run's bench test failed in matplotlib on such a negative error bar)
    rows = sweep.summarize([_rec("plain", 1, 0, 37.0), _rec("goose-b4", 1, 0, 108.0)])
    sweep.plot(rows, path, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_title_gives_the_range_of_prompts_per_cell():
    # cells hold at least twice their concurrency: a title naming the first cell's size alone
    # said "24 prompts" over a plot whose 64-request cells had 128
    records = [{**_rec("plain", c, 0, 10.0 * c), "num_prompts": max(24, 2 * c)} for c in (1, 16, 64)]
    assert "24-128 prompts per cell" in sweep._title(records)
    assert "24 prompts per cell" in sweep._title(records[:1])


def test_summarize_mode_reads_records_and_draws(tmp_path, capsys):
    out = tmp_path / "b.jsonl"
    out.write_text("\n".join(json.dumps(_rec("plain", c, 0, 5.0)) for c in (1, 2)) + "\n")
    assert cli_main(["bench", "--summarize", str(out), "--plot", str(tmp_path / "b.png")]) == 0
    assert "| plain | 2 | 5.0 (5.0..5.0) | 1.00x |" in capsys.readouterr().out
    assert (tmp_path / "b.png").exists()


def test_bad_arguments_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--methods", "plain,goose-b5", "--out", str(tmp_path / "x.jsonl")])
    assert "goose-b5" in str(e.value) and "goose-b4" in str(e.value) and "tr-auto" in str(e.value)
    assert "NAME+iomp" in str(e.value)
    with pytest.raises(SystemExit):
        cli_main(["bench", "--concurrency", "1,0"])
    assert "concurrencies must be >= 1" in capsys.readouterr().err
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit, match=rf"--top-p must be in \(0, 1\], got {bad}"):
            cli_main(["bench", "--top-p", bad, "--methods", "plain", "--out", str(tmp_path / "x.jsonl")])
    with pytest.raises(SystemExit, match=r"--warmup-tokens must be >= 1 \(or left out: --max-tokens\), got 0"):
        cli_main(["bench", "--warmup-tokens", "0", "--methods", "plain", "--out", str(tmp_path / "x.jsonl")])


def test_registry_is_what_the_issue_asks_for():
    assert sweep.METHODS["goose-b60"] == {"method": "goose", "budget": 60, "allocator": "off"}
    assert sweep.METHODS["goose-auto"] == {"method": "goose"}  # allocator on by default
    assert sweep.METHODS["ngram3"]["num_speculative_tokens"] == 3 and sweep.METHODS["ngram5"]["num_speculative_tokens"] == 5
    assert sweep.METHODS["plain"] is None


def test_every_tree_method_of_the_registry_passes_the_front_doors_validation(tmp_path):
    """Each bench method of this package's (GOOSE, token recycling) is a speculative_config a user
    could pass: its keys and values validate as ``vllm serve`` would validate them (a renamed or
    out-of-range tunable fails here, not minutes into a bench's engine start)."""
    from vllm.config import SpeculativeConfig

    from vllm_anisotropic.integration.vllm.frontdoor.config import TREE_METHODS, TreeSpecConfig, split_speculative_dict

    built = {}
    for name in sweep.METHODS:
        spec = sweep.resolve_config(name, tmp_path)
        if spec and spec["method"] in TREE_METHODS:  # the front door's split (patches.py, patch 3), then its check
            _, ours = split_speculative_dict(dict(spec), set(SpeculativeConfig.__dataclass_fields__))
            built[name] = TreeSpecConfig.build(spec["method"], ours)
    assert {"goose-auto", "goose-closed", "goose-never", "tr-auto"} <= set(built)
    closed = built["goose-closed"]
    assert closed.engine.allocator_gate_margin == 0.99 and closed.engine.allocator_gate_explore_every == 1_000_000


@pytest.mark.engine
def test_bench_runs_in_real_vllm_and_goose_outputs_equal_plain(tiny_model_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench.jsonl"
    # a stats file the user exported, an earlier run's gate in it: no engine may read or write it
    user_stats = tmp_path / "user_stats.json"
    stale = json.dumps({"steps": 999, "gate": {str(b): {"plain_steps": 99, "spec_steps": 99} for b in (1, 3)}})
    Path(f"{user_stats}.budget").write_text(stale)
    monkeypatch.setenv(sweep_engine.STATS_ENV, str(user_stats))
    repo = Path(sweep.__file__).parents[2]
    rc = cli_main(["bench", "--model", str(tiny_model_dir), "--dataset", "humaneval", "--num-prompts", "3",
                   "--max-tokens", "24", "--methods", "plain,goose-b8,goose-auto+src", "--src", str(repo),
                   "--concurrency", "1,3", "--repeats", "1", "--dtype", "float32", "--out", str(out)])
    assert rc == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["method"], r["concurrency"]) for r in records] == [
        (m, c) for m in ("plain", "goose-b8", "goose-auto+src") for c in (1, 3)]
    assert all(r["output_tokens"] > 0 and r["tokens_per_s"] > 0 for r in records)
    assert all(r["draft_tokens"] > 0 for r in records if r["method"] == "goose-b8")  # it did speculate
    # the allocator's engine (+src: started through the harness run by path) records its decode
    # steps by the gate's decision, one per step it counted; the others record none
    auto = [r for r in records if r["method"] == "goose-auto+src"]
    assert all(r["src"] == str(repo) and r["budget"]["steps"] > 0 for r in auto)
    assert all(sum(r["decode_steps"].values()) == r["budget"]["steps"] for r in auto)
    assert all("decode_steps" not in r and "gate" not in r for r in records if r["method"] != "goose-auto+src")
    assert Path(f"{user_stats}.budget").read_text() == stale and not user_stats.exists()
    # the warm-up's loops, by concurrency, the largest first: one each without a gate, the gate's
    # engine up to WARMUP_ROUNDS at each while its bucket there is still warming up
    assert all(r["warmup_loops"] == [3, 1] for r in records if r["method"] != "goose-auto+src")
    assert all(r["warmup_tokens"] == 24 for r in records)  # the cells' --max-tokens
    loops = auto[0]["warmup_loops"]
    assert loops == [3] * loops.count(3) + [1] * loops.count(1)
    assert all(1 <= loops.count(c) <= sweep_engine.WARMUP_ROUNDS for c in (1, 3)), loops
    plain = {r["concurrency"]: r["output_sha1"] for r in records if r["method"] == "plain"}
    for r in records:  # float32: every method, every concurrency, token-identical to plain
        assert r["output_sha1"] == plain[r["concurrency"]], r["method"]
    text = capsys.readouterr().out
    assert "| goose-b8 | 3 |" in text and Path(out.with_suffix(".png")).exists()


def test_divergences_and_their_margins():
    """The demo's bf16 report: the first differing token of each output and, from a plain
    prefill's top logprobs there, the rank of the speculative token and the logprob gap."""
    from vllm_anisotropic.bench.demo import Divergence, divergences, margin_report

    plain = [[[1, 2, 3]], [[4, 5, 6]], [[7, 8]]]
    spec = [[[1, 2, 3]], [[4, 9, 6]], [[7, 5]]]
    found = divergences("goose", plain, spec)
    assert found == [Divergence("goose", 1, 1, 5, 9), Divergence("goose", 2, 1, 8, 5)]
    lines = margin_report(found, [[{5: -0.70, 9: -0.72, 11: -3.0}], [{8: -0.1, 3: -4.0}]])
    assert lines[0].startswith("divergences: 2 outputs; the speculative token is among the recomputed top 2 in 1/2")
    assert "median 0.020 max 0.020" in lines[0]
    assert "prompt 1: first difference at output token 1, plain 5 vs 9 (rank 2" in lines[1] and "gap 0.020" in lines[1]
    assert "(rank >5 in the recomputed distribution, logprob gap n/a)" in lines[2]


def test_iomp_variant_preloads_intel_openmp_into_the_engine_process(tmp_path, monkeypatch):
    """``NAME+iomp``: the same speculative config, the engine process started with Intel's
    OpenMP runtime in ``LD_PRELOAD`` (in front of what is already preloaded)."""
    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(sweep, "iomp_library", lambda: lib)
    monkeypatch.setenv("LD_PRELOAD", "/x/libtcmalloc.so")
    assert sweep.valid_method("goose-auto+iomp") and not sweep.valid_method("goose-b5+iomp")
    assert sweep.resolve_config("goose-auto+iomp", tmp_path) == sweep.METHODS["goose-auto"]
    assert sweep.method_env("plain+iomp") == {"LD_PRELOAD": f"{lib}:/x/libtcmalloc.so"}
    assert sweep.method_env("plain") == {}
    monkeypatch.setattr(sweep, "iomp_library", lambda: None)
    assert "libiomp5" in sweep.unavailable_reason("plain+iomp")
    assert sweep.unavailable_reason("plain") is None


def test_sync_variant_turns_async_scheduling_off_and_combines_with_iomp(tmp_path, monkeypatch):
    """``NAME+sync``: the same speculative config, the engine built with ``async_scheduling=False``
    (vLLM's default turns it on for plain decoding only); modifiers combine in any order."""
    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    monkeypatch.setattr(sweep, "iomp_library", lambda: lib)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert sweep.method_llm_kwargs("plain+sync") == {"async_scheduling": False}
    assert sweep.method_llm_kwargs("plain") == {} and sweep.method_llm_kwargs("plain+iomp") == {}
    for method in ("goose-auto+sync+iomp", "goose-auto+iomp+sync"):
        assert sweep.valid_method(method) and sweep.base_method(method) == "goose-auto"
        assert sweep.method_llm_kwargs(method) == {"async_scheduling": False}
        assert sweep.method_env(method) == {"LD_PRELOAD": str(lib)}
    assert not sweep.valid_method("plain+syncx") and not sweep.valid_method("goose-b5+sync")
    assert sweep.resolve_config("ngram5+sync", tmp_path) == sweep.METHODS["ngram5"]
    rows = sweep.summarize([
        {"method": m, "concurrency": 8, "repeat": 0, "tokens_per_s": tps, "tau": 1.0, "output_sha1": ["a"]}
        for m, tps in (("plain+sync", 90.0), ("plain", 100.0))])
    assert [r["method"] for r in rows] == ["plain", "plain+sync"]
    assert rows[1]["speedup"] == pytest.approx(0.9)


def test_recompute_variant_sets_the_tree_rows_mode(monkeypatch):
    """``NAME+recompute``: the engine process gets VLLM_ANISOTROPIC_TREE_ROWS=recompute, which
    the CPU tree attention reads (and refuses when misspelled)."""
    from vllm_anisotropic.integration.vllm.kernels import attention

    assert sweep.valid_method("goose-b4+recompute") and sweep.base_method("goose-b4+recompute") == "goose-b4"
    env = sweep.method_env("goose-b4+recompute")
    assert env == {attention.TREE_ROWS_ENV: "recompute"}
    assert sweep.method_env("goose-b4") == {}
    monkeypatch.setenv(attention.TREE_ROWS_ENV, "recompute")
    assert attention._tree_rows_mode() == "recompute"
    monkeypatch.setenv(attention.TREE_ROWS_ENV, "paths")
    with pytest.raises(ValueError, match="valid values are auto, recompute"):
        attention._tree_rows_mode()


def test_q8_variant_quantizes_draft_tree_s_q_only(tmp_path):
    """``NAME+q8`` / ``NAME+qnone``: a dtree method's config gains ``draft_quantization`` int8 /
    none, the rest of it unchanged; on any other method, or both at once, refused, naming why."""
    for method in ("dtree-default", "dtree-1.3.0", "dtree-auto"):
        plain_q = sweep.resolve_config(method, tmp_path, draft="D")
        assert sweep.valid_method(method + "+q8")
        assert sweep.resolve_config(method + "+q8", tmp_path, draft="D") == {**plain_q, "draft_quantization": "int8"}
        assert sweep.unavailable_reason(method + "+q8", draft="D") is None
        assert sweep.resolve_config(method + "+qnone", tmp_path, draft="D") == {**plain_q, "draft_quantization": "none"}
    assert "dtree-* method only" in sweep.unavailable_reason("goose-auto+q8")
    assert "dtree-* method only" in sweep.unavailable_reason("draft_model-k2+qnone", draft="D")
    assert "one draft_quantization a method" in sweep.unavailable_reason("dtree-default+q8+qnone", draft="D")


def test_environment_names_the_cpu_model_and_its_vector_extensions(tmp_path):
    from vllm_anisotropic.bench.machine import cpu_model

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f avx512_bf16 sse\n\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f avx512_bf16 sse\n")
    assert cpu_model(str(info)) == {"cpu_model": "AMD EPYC", "cpu_isa": ["avx512f", "avx512_bf16"]}
    info.write_text("model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: amx_tile amx_bf16 avx512f\n")
    assert cpu_model(str(info))["cpu_isa"] == ["amx_tile", "avx512f"]
    assert cpu_model(str(tmp_path / "missing")) == {}


def test_draft_model_methods_name_their_shape_and_need_a_draft(tmp_path):
    """``draft_model-kN`` is vLLM's draft_model with N tokens; ``dtree-K.L1.L2`` the package's
    draft_tree with that fixed shape (allocator off); both name the --draft directory and are
    refused, with the reason, without one."""
    assert sweep.valid_method("draft_model-k4") and sweep.valid_method("dtree-2.1.3+sync")
    assert not sweep.valid_method("dtree-2.1") and not sweep.valid_method("dtree-0.1.1")
    assert not sweep.valid_method("draft_model-k0")
    assert sweep.resolve_config("draft_model-k4", tmp_path, "/d") == {
        "method": "draft_model", "model": "/d", "num_speculative_tokens": 4}
    assert sweep.resolve_config("dtree-3.1.2", tmp_path, "/d") == {
        "method": "draft_tree", "model": "/d", "branches": 3, "trunk": 1, "branch_length": 2, "allocator": "off"}
    assert "--draft" in sweep.unavailable_reason("dtree-2.2.2")
    assert sweep.unavailable_reason("dtree-2.2.2", "/d") is None and sweep.unavailable_reason("plain") is None
    # dtree-auto: no shape key, so the front door's "auto" selector applies; dtree-default: a user's config
    assert sweep.resolve_config("dtree-auto", tmp_path, "/d") == {"method": "draft_tree", "model": "/d", "allocator": "off"}
    assert sweep.resolve_config("dtree-default+sync", tmp_path, "/d") == {"method": "draft_tree", "model": "/d"}
    assert "--draft" in sweep.unavailable_reason("dtree-auto") and not sweep.valid_method("dtree-autox")
    # dtree-sel: dtree-default with the --selector directory
    assert sweep.resolve_config("dtree-sel+src", tmp_path, "/d", "/s") == {"method": "draft_tree", "model": "/d",
                                                                           "selector": "/s"}
    assert "--selector" in sweep.unavailable_reason("dtree-sel", "/d") and sweep.unavailable_reason("dtree-sel", "/d",
                                                                                                     None, "/s") is None


def test_src_variant_puts_the_source_tree_first_on_the_engine_path(monkeypatch, tmp_path):
    """``NAME+src``: the engine imports vllm_anisotropic from ``--src`` (in front of any PYTHONPATH
    already set, and of a suffix build's), and a +src method without ``--src`` does not run."""
    monkeypatch.setenv("PYTHONPATH", "/x/lib")
    assert sweep.valid_method("goose-auto+src") and sweep.base_method("goose-auto+src") == "goose-auto"
    assert sweep.method_env("goose-auto+src", tmp_path) == {"PYTHONPATH": f"{tmp_path}{os.pathsep}/x/lib"}
    assert sweep.method_env("goose-auto", tmp_path) == {}
    assert "--src" in sweep.unavailable_reason("goose-auto+src")
    assert sweep.unavailable_reason("goose-auto+src", src=tmp_path) is None
    assert sweep.src_record("goose-auto", tmp_path) == {}
    assert sweep.src_record("goose-auto+src", tmp_path)["src"] == str(tmp_path)


def test_src_tree_without_the_installed_plugin_module_is_named_before_any_engine(tmp_path):
    """An older ``--src`` tree that lacks the module vLLM's entry point names (the plugin moved
    since) is refused up front, naming the module; this repository's own tree passes."""
    from importlib.metadata import entry_points

    plugin = [e.value.split(":")[0] for e in entry_points(group="vllm.general_plugins") if e.name == "vllm_anisotropic"]
    assert plugin == ["vllm_anisotropic.integration.vllm.frontdoor.plugin"]
    (tmp_path / "vllm_anisotropic").mkdir()
    (tmp_path / "vllm_anisotropic" / "__init__.py").write_text("")
    assert plugin[0] in sweep.src_missing_modules(tmp_path)
    assert sweep.src_missing_modules(Path(sweep.__file__).parents[2]) == []
    with pytest.raises(SystemExit, match="frontdoor.plugin"):
        cli_main(["bench", "--methods", "plain,goose-auto+src", "--src", str(tmp_path)])


def test_profile_host_counts_decode_steps_by_kind():
    """profile-host's step kinds: plain = steps without a kept draft, chains = chain steps that
    kept some, trees = the rest; the report prints each kind's share."""
    from types import SimpleNamespace

    from vllm_anisotropic.bench.profile_host import StepProbe, format_report

    metrics = SimpleNamespace(steps=10, chain_steps=3, steps_without_drafts=2)
    probe = StepProbe.__new__(StepProbe)
    probe.scheduler = SimpleNamespace(budget=SimpleNamespace(metrics=metrics))
    probe.empty_chain_steps = 0
    assert probe.step_kinds() == {"trees": 5, "chains": 3, "plain": 2}
    probe.empty_chain_steps = 1  # a chain step that kept nothing is plain, not a chain
    assert probe.step_kinds() == {"trees": 6, "chains": 2, "plain": 2}
    probe.scheduler = SimpleNamespace()
    assert probe.step_kinds() == {}
    report = {"steps": 4, "wall_ms": 1.0, "forward_ms": 0.5, "tree_rows_ms": 0.0, "outside_forward_ms": 0.5,
              "plugin_host_ms": 0.2, "plugin_host_no_topk_ms": 0.1, "vllm_propose_ms": 0.0, "phases_ms": {},
              "decode_steps": {"trees": 6, "chains": 2, "plain": 0}}
    assert "trees 6 (75%), chains 2 (25%), plain 0 (0%)" in format_report(report)


def test_profile_host_splits_steps_by_the_gates_arm():
    """profile-host's per-arm split: a step runs from one ``schedule`` call to the next and is
    charged to the arm of the step scheduled; a schedule that ran no forward counts nowhere;
    prompt tokens make ``prompt``, a decode step the allocator gave no arm ``switch``, and without
    the allocator drafts make ``drafts``."""
    from types import SimpleNamespace

    from vllm_anisotropic.bench.profile_host import StepProbe, format_report, step_arm
    from vllm_anisotropic.integration.vllm.engine.host_clock import HostClock

    out = SimpleNamespace(scheduled_new_reqs=[], scheduled_spec_decode_tokens={}, num_scheduled_tokens={"a": 1, "b": 1})
    assert step_arm(out) == "plain"
    out.scheduled_spec_decode_tokens = {"a": [5, 6]}
    out.num_scheduled_tokens = {"a": 3, "b": 1}
    assert step_arm(out) == "drafts"
    out.num_scheduled_tokens = {"a": 3, "b": 2}  # b runs a prompt chunk
    assert step_arm(out) == "prompt"
    out.num_scheduled_tokens, out.scheduled_new_reqs = {"a": 3, "b": 1}, ["c"]
    assert step_arm(out) == "prompt"
    budget = SimpleNamespace(_step=(8, 20, 4, 0, 2, 0.0, None), _decoding={"a": 0, "b": 2})
    assert step_arm(out, budget) == "prompt"  # a new request: prompt tokens, whatever the allocator says
    out.scheduled_new_reqs = []
    budget._decoding = {"a": 0}
    assert step_arm(out, budget) == "prompt"  # b is not past its prompt
    budget._decoding = {"a": 0, "b": 2}  # b re-runs two accepted tokens: a decode step
    budget._step = (8, 20, 4, 0, 2, 0.0, 2)
    assert step_arm(out, budget) == "chains"  # the allocator's arm, not the drafts it sees
    budget._step = (8, 8, 0, 0, 0, 0.0, 0)
    assert step_arm(out, budget) == "plain"
    budget._step = (8, 8, 0, 0, 0, 0.0, None)
    assert step_arm(out, budget) == "switch"
    budget._step = None
    assert step_arm(out, budget) == "switch"

    clock = HostClock()
    probe = StepProbe.__new__(StepProbe)
    probe.clocks = lambda: [clock]
    probe.forward_s = probe.logits_s = 0.0
    probe.steps = probe.tokens = 0
    probe.arms, probe._open = {}, None

    def step(arm, forward, logits, phases, tokens=0):
        probe._close_step(probe._snapshot())
        probe._open = (arm, probe._snapshot())
        probe.forward_s += forward
        probe.logits_s += logits
        probe.steps += 1 if forward else 0
        probe.tokens += tokens
        for k, v in phases.items():
            clock.add(k, v)

    step("plain", 0.010, 0.002, {"cut": 0.0001}, tokens=8)
    step("trees", 0.030, 0.004, {"walk": 0.002, "topk": 0.001}, tokens=21)
    step("plain", 0.012, 0.002, {"cut": 0.0003}, tokens=8)
    step("prompt", 0.0, 0.0, {"stats": 0.5})  # an idle schedule: no forward, counted nowhere
    arms = probe.by_arm()
    assert set(arms) == {"plain", "trees"}
    assert arms["plain"]["steps"] == 2 and arms["trees"]["steps"] == 1
    assert arms["plain"]["tokens"] == 16 and arms["trees"]["tokens"] == 21
    assert arms["trees"]["tokens_per_s"] > 0
    assert arms["plain"]["forward_ms"] == pytest.approx(11.0) and arms["plain"]["logits_ms"] == pytest.approx(2.0)
    assert arms["plain"]["plugin_host_ms"] == pytest.approx(0.2) and arms["plain"]["phases_ms"] == {"cut": pytest.approx(0.2)}
    assert arms["trees"]["plugin_host_ms"] == pytest.approx(3.0)
    assert arms["trees"]["plugin_host_no_topk_ms"] == pytest.approx(2.0)
    report = {"steps": 3, "wall_ms": 1.0, "forward_ms": 0.5, "tree_rows_ms": 0.0, "outside_forward_ms": 0.5,
              "logits_ms": 0.1, "plugin_host_ms": 0.2, "plugin_host_no_topk_ms": 0.1, "vllm_propose_ms": 0.0,
              "phases_ms": {}, "decode_steps": {}, "by_arm": arms}
    text = format_report(report)
    assert "(of which the LM head 0.10)" in text
    assert "plain       2 steps," in text and "LM head 2.00, plugin host 0.200" in text and "walk 2.000" in text


def test_demo_dtype_auto_is_bf16_only_with_native_bf16():
    """Emulated bf16 (no AMX, no AVX512-BF16) is 2-3x slower than float32 on vLLM's CPU build:
    ``--dtype auto`` picks float32 there and says why; explicit choices are kept."""
    from vllm_anisotropic.bench.demo import resolve_dtype

    assert resolve_dtype("auto", ["amx_tile", "avx512f"])[0] == "bfloat16"
    assert resolve_dtype("auto", ["avx512f", "avx512_bf16"]) == ("bfloat16", "auto: native bf16 (avx512_bf16)")
    dtype, why = resolve_dtype("auto", ["avx512f"])
    assert dtype == "float32" and "no native bf16" in why
    assert resolve_dtype("auto", [])[0] == "float32"
    assert resolve_dtype("bfloat16", []) == ("bfloat16", "chosen")


def _result(solo_secs, batch_secs, tokens=10, accepted=0, batch_tokens=None):
    """An ``OfflineResult`` of a demo engine: one-at-a-time prompts timed ``solo_secs``, batch
    repeats of two prompts timed ``batch_secs``, every output ``tokens`` long."""
    from vllm_anisotropic.bench.offline import OfflineResult, SpecStats, TimedPass

    def timed(ids, secs, prompt_secs=()):
        n = sum(len(t) for t in ids)
        return TimedPass(token_ids=ids, generate_seconds=secs, prompt_seconds=list(prompt_secs),
                         spec=SpecStats(num_output_tokens=n, num_accepted_tokens=accepted * len(ids)))

    solo_ids = [[i] * tokens for i in range(len(solo_secs))]
    batch_ids = batch_tokens or [[7] * tokens, [8] * tokens]
    repeats = [timed(batch_ids, s) for s in batch_secs]
    return OfflineResult(token_ids=[[t] for t in batch_ids], texts=[[""]] * 2, finish_reasons=[["length"]] * 2,
                         startup_seconds=1.0, generate_seconds=batch_secs[0], spec=repeats[0].spec, pid=1,
                         solo=timed(solo_ids, sum(solo_secs), solo_secs), repeats=repeats)


def test_demo_table_pairs_each_pass_with_plains_and_counts_identical_outputs():
    """One row per method: the one-at-a-time speedup over plain's same prompts (2x on each:
    [2.00, 2.00]), the batch's geometric mean over repeats paired with plain's same repeat, tau
    from vLLM's counters, identical outputs over every repeat. A method whose repeats straddle
    1.00x is marked "~"; a differing output turns all_identical off."""
    from vllm_anisotropic.bench.demo import MethodRun, demo_table

    plain = _result([1.0, 2.0], [1.0, 2.0])
    fast = _result([0.5, 1.0], [0.5, 1.0], accepted=5)  # 2x everywhere, tau 10 / (10 - 5) = 2
    even = _result([1.0, 2.0], [0.9, 2.2], batch_tokens=[[7] * 10, [9] * 10])
    table = demo_table(plain, [MethodRun("goose", {}, fast, None, None), MethodRun("ngram", {}, even, None, None)],
                       solo=True)
    text = "\n".join(table.lines)
    goose = next(line for line in table.lines if line.startswith("goose"))
    assert goose.count("2.00x [2.00, 2.00]") == 2 and goose.count("2.00  2/2") == 1 and "4/4" in goose
    ngram = next(line for line in table.lines if line.startswith("ngram"))
    assert "~" in ngram and "2/4" in ngram  # 1.11x and 0.91x: an interval across 1.00x
    assert table.rows[0]["batch"]["repeat_speedups"] == pytest.approx([2.0, 2.0])
    assert not table.all_identical and "one request at a time (2 prompts, 20 tokens)" in text and "(2 repeats, 20 tokens each)" in text
    assert demo_table(plain, [MethodRun("goose", {}, fast, None, None)], solo=True).all_identical


def test_profile_host_phases_name_functions_that_exist():
    """Every phase of ``profile-host`` names a function defined in its file: a renamed function
    (``observe_batch`` -> ``observe_step``) made a phase read 0 ms with no error."""
    import ast

    from vllm_anisotropic.bench.profile_host import PHASES

    root = Path(__file__).resolve().parents[1] / "vllm_anisotropic"
    for label, suffix, name in PHASES:
        tree = ast.parse((root / suffix).read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert name in defined, f"profile-host phase {label!r}: no function {name} in {suffix}"


def test_long_context_prompts_take_unshared_examples_from_the_datasets_end():
    """``--context-tokens``: each prompt's text comes after solved examples (problem and
    reference) of at least N tokens, taken from the dataset's end, each used once, never one
    the bench asks; too few left, or humaneval (code the model continues), is refused. Catches:
    examples shared between prompts (a prefix cache would hide the target's prefill), taken
    from the prompts the bench asks, too few tokens, the task lost or put first."""
    from vllm_anisotropic.bench.demo import CONTEXT_HEADER, with_context
    from vllm_anisotropic.data.datasets import Prompt

    class Words:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    # each example 7 words; 17 is too long (over half of the 14 words asked): passed over
    every = [Prompt("math500", f"m/{i}", f"problem {i} " + "w " * (3 if i != 17 else 30), reference=f"answer {i}")
             for i in range(21)]
    got = with_context(every[:2], every, 4, 14, Words())
    shots = [g.text.split("\n\nNow the task:\n") for g in got]
    assert all(s[0].startswith(CONTEXT_HEADER) and len(s[0].split()) >= 14 for s in shots)
    assert [s[1] for s in shots] == [every[0].text, every[1].text] and got[0].id == "m/0"
    used = [set(int(w) for w in s[0].replace("problem", " P").split() if w.isdigit()) for s in shots]
    assert used[0] == {20, 19} and used[1] == {18, 16} and not used[0] & used[1]  # 2 x 7 words each
    with pytest.raises(ValueError, match="too few examples"):
        with_context(every[:2], every, 18, 14, Words())
    with pytest.raises(ValueError, match="humaneval"):
        with_context([Prompt("humaneval", "h/0", "def f():")], every, 1, 12, Words())
