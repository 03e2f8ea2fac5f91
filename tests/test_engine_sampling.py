"""Sampling with trees inside real vLLM: the token law equals plain vLLM's.

Engine runs (real vLLM CPU build, tiny Llama whose text is not a pure cycle): the same prompt
N times with per-request seeds, temperature 0.8, top-p 0.95, ``max_tokens`` 24; once plain, once
with GOOSE trees verified by the default sampling verifier (NSS through vLLM's own sampler). The
two sides draw from *independent* seeds (plain 1000 + i, trees 1,000,000 + i), so this tests the
law itself; that the default verifier emits plain vLLM's very tokens under the *same* seeds is
``test_seeded_sampled_trees_emit_plain_vllms_tokens``. Each run is seeded, so the outcome is
deterministic in CI.

Two statistical tests, both must pass:

* **The exact conditional law** (``exact_law.py``, the one with stated power): every emitted
  token against the law the target model gives its prefix (computed in float32 outside vLLM),
  a weighted martingale z of the most likely token's frequency and one of the second most
  likely, each |z| < 4 (false alarm ~1e-4 each, simulated). Power: a 5 % relative bias of the
  most likely token (either way) fails it with probability >= 0.9, simulated on the run's own
  laws and asserted (1.000 on the 9,600 tokens here); on a real run, plain decoding at
  temperature 0.9 judged against the 0.8 law fails it at z ~ -33
  (``test_the_law_test_detects_a_temperature_change``).
* **The two-sample family** (broad, low power): the Pearson chi-square of the token counts
  against plain vLLM's samples (a 2 x k contingency table, outcomes with a pooled expected count
  < 5 merged into one cell), mapped to a standard normal by the Wilson-Hilferty transform, per
  output position t and jointly over the first 3 tokens (the law of the triple, not only its
  marginals); each z < 4 (~3e-5 each). It sees any change of the marginal laws, not only of the
  top two tokens, but only gross ones: past the first positions the samples spread over many
  prefixes.

The spec run must actually accept drafts (else the check is vacuous) and produce many distinct
continuations.

``n > 1`` (vLLM forks a request into n children sharing its parameters; with a seed they share
it and are identical, so the law test above uses n = 1): an unseeded n = 2 run with trees must
return two independent-looking completions per prompt.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from vllm_anisotropic.bench.offline import IN_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

N = 400
MAX_TOKENS = 24
TEMPERATURE, TOP_P = 0.8, 0.95
# max_num_seqs x (prompt or tree) tokens stays under the step budget: no chunked prefill (that
# seeded requests draw the same tokens with it: test_seeded_requests_draw_the_same_tokens_in_chunked_prefill)
ENGINE = {"enforce_eager": True, "max_model_len": 512, "max_num_seqs": 32, "max_num_batched_tokens": 8192}


def two_sample_z(a: Counter, b: Counter) -> float:
    """Wilson-Hilferty z of the 2 x k chi-square homogeneity statistic of counts a, b."""
    na, nb = sum(a.values()), sum(b.values())
    cells, pool = [], [0, 0]
    for key in set(a) | set(b):
        oa, ob = a.get(key, 0), b.get(key, 0)
        if min((oa + ob) * na, (oa + ob) * nb) / (na + nb) < 5:
            pool[0] += oa
            pool[1] += ob
        else:
            cells.append((oa, ob))
    if sum(pool):
        cells.append(tuple(pool))
    stat = 0.0
    for oa, ob in cells:
        tot = oa + ob
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (oa - ea) ** 2 / ea + (ob - eb) ** 2 / eb
    df = max(len(cells) - 1, 1)
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def test_two_sample_z_detects_a_different_law():
    same = two_sample_z(Counter({1: 500, 2: 300, 3: 200}), Counter({1: 490, 2: 310, 3: 200}))
    different = two_sample_z(Counter({1: 500, 2: 300, 3: 200}), Counter({1: 350, 2: 400, 3: 250}))
    assert same < 4 < different


# trees every step, whatever this machine's speed: with the allocator on, its gate may decide that
# plain decoding is faster here, and a run without a tree tests nothing (one full-suite run
# drafted nothing in test_n2_sampled_children_with_trees)
FIXED_TREES = {"method": "goose", "allocator": "off", "budget": 8}


@pytest.fixture(scope="module")
def law_job(tiny_prompts):
    """N seeded samples of one prompt (temperature 0.8, top-p 0.95) and plain vLLM's outputs."""
    from vllm_anisotropic.models import build_tiny_model

    # lm_head_alpha 0.25: the most likely token ~0.8 on average at temperature 0.8 (the default head
    # is so sharp that sampling would equal greedy decoding). Top-p 0.95 rather than 0.9: a row
    # that top-p cuts to one token carries no evidence, and at 0.9 70 % of the rows were such
    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    job = OfflineJob(model=model, prompts=[tiny_prompts[0]] * N, max_tokens=MAX_TOKENS, temperature=TEMPERATURE,
                     top_p=TOP_P, seed=1000, seed_per_prompt=True, llm_kwargs=ENGINE)
    return job, run_offline_job(job, env=IN_PROCESS)


def exact_law_z(job: OfflineJob, result, power: bool = True, **edits) -> list[float]:
    """``exact_law.law_z`` of ``result`` under ``job``'s model and sampling (and ``edits``)."""
    from exact_law import law_z as exact_z

    return exact_z(job.model, result, power=power, temperature=job.temperature, top_p=job.top_p, **edits)


def test_sampled_tokens_follow_plain_vllm_law(law_job):
    job, plain = law_job
    spec = run_offline_job(job.model_copy(update={"speculative_config": FIXED_TREES, "seed": 1_000_000}), env=IN_PROCESS)
    assert spec.spec.num_accepted_tokens > 100, spec.spec  # trees were verified and accepted
    outs_plain = [r[0] for r in plain.token_ids]
    outs_spec = [r[0] for r in spec.token_ids]
    assert len({tuple(o) for o in outs_spec}) > N // 4  # sampling, not a deterministic walk
    assert sum(a == b for a, b in zip(outs_plain, outs_spec)) < N // 2  # the seeds are independent
    zs = law_z(outs_plain, outs_spec)
    print(f"spec counters {spec.spec}, tau {spec.spec.tau:.2f}, distinct outputs {len({tuple(o) for o in outs_spec})}/{N}, "
          f"z per position {zs[:-1]}, joint z of the first 3 tokens {zs[-1]}")
    assert max(zs) < 4.0, zs
    assert max(exact_law_z(job, plain, power=False)) < 4.0  # the reference law is plain vLLM's
    assert max(exact_law_z(job, spec)) < 4.0


def test_sampled_trees_with_logit_bias_and_min_p_follow_plain_vllm_law(law_job):
    """A sampled request with ``logit_bias`` and ``min_p`` keeps its trees (every tree row edited
    as vLLM edits its one row, ``runner.RowEdits``): the law test above, both sides edited. The
    bias moves mass from the most frequent token at the first position with a choice to the
    second; min_p 0.05 cuts the tail top-p 0.95 leaves. A tree path that forgot either fails
    (checked with each edit removed: docs/testing.md; the edited plain law differs from the
    free one). min_p 0.05 rather than 0.15: at 0.15 most rows keep one token and the exact-law
    test's power against a 5 % bias was 0.19; at 0.05 it is 0.95 (plain's run, this workload),
    and a forgotten min_p still moves z to ~+19."""
    job, free = law_job
    outs = [r[0] for r in free.token_ids]
    t = next(t for t in range(MAX_TOKENS) if len({o[t] for o in outs if len(o) > t}) > 2)
    top = Counter(o[t] for o in outs if len(o) > t).most_common(2)
    bias = {"logit_bias": {str(top[0][0]): -1.5, str(top[1][0]): 1.5}, "min_p": 0.05}
    biased = job.model_copy(update={"per_prompt": [bias] * N})
    plain = run_offline_job(biased, env=IN_PROCESS)
    spec = run_offline_job(biased.model_copy(update={"speculative_config": FIXED_TREES, "seed": 1_000_000}),
                           env=IN_PROCESS)
    assert spec.spec.num_accepted_tokens > 100, spec.spec
    outs_free, outs_plain, outs_spec = ([r[0] for r in res.token_ids] for res in (free, plain, spec))
    assert max(law_z(outs_free, outs_plain)) >= 4.0  # the bias really changes the law
    zs = law_z(outs_plain, outs_spec)
    print(f"biased: spec counters {spec.spec}, z per position {zs[:-1]}, joint {zs[-1]}")
    assert max(zs) < 4.0, zs
    edits = {"logit_bias": {int(k): v for k, v in bias["logit_bias"].items()}, "min_p": bias["min_p"]}
    assert max(exact_law_z(job, plain, power=False, **edits)) < 4.0
    assert max(exact_law_z(job, spec, **edits)) < 4.0  # and power >= 0.9 against a 5 % bias
    assert max(exact_law_z(job, spec, power=False, min_p=edits["min_p"])) >= 4.0  # without the bias: another law
    assert max(exact_law_z(job, spec, power=False, logit_bias=edits["logit_bias"])) >= 4.0  # without min_p


def test_vllm_draft_model_verifies_sampled_drafts_against_the_requests_law(law_job):
    """vLLM's own ``draft_model`` (the tiny model drafting for itself, 2 tokens) with the plugin
    installed: its rejection sampler reads each draft row's temperature and top-p from
    ``expand_batch_to_tokens``, which vLLM 0.32's CPU kernel leaves uninitialised for floats;
    patches.py patch 11 fills them. The exact-law test on its samples (independent seeds).

    Measured (12-04, AMD EPYC with AVX-512): with the patch tau 2.38 (5,570 of 7,922 drafts accepted), exact-law
    z 0.29 / 0.02; with patch 11 off the draft rows are verified and resampled under whatever the
    memory held: tau 1.13 (1,091 of 16,296), z 26.6 / 17.8, so vLLM's own method is not lossless
    on a CPU without it."""
    job, _ = law_job
    speculative = {"method": "draft_model", "model": job.model, "num_speculative_tokens": 2}
    spec = run_offline_job(job.model_copy(update={"speculative_config": speculative, "seed": 3_000_000}),
                           env=IN_PROCESS)
    assert spec.spec.num_draft_tokens > 1000, spec.spec  # vLLM drafted: its rejection sampler ran
    outs = [r[0] for r in spec.token_ids]
    assert len({tuple(o) for o in outs}) > N // 4
    zs = exact_law_z(job, spec)
    print(f"vLLM draft_model: spec counters {spec.spec}, tau {spec.spec.tau:.2f}, exact-law z {zs}")
    assert max(zs) < 4.0, zs


def law_z(outs_a, outs_b) -> list[float]:
    """z of each output position, then of the first-3-token triple (the 25 tests above)."""
    zs = []
    for t in range(MAX_TOKENS):
        a = Counter(o[t] for o in outs_a if len(o) > t)
        b = Counter(o[t] for o in outs_b if len(o) > t)
        zs.append(round(two_sample_z(a, b), 2))
    zs.append(round(two_sample_z(Counter(tuple(o[:3]) for o in outs_a), Counter(tuple(o[:3]) for o in outs_b)), 2))
    return zs


def test_the_law_test_detects_a_temperature_change(law_job):
    """Power of both tests on a real run at N = 400: plain decoding at temperature 0.9 against
    0.8 (independent seeds) must fail them, or they could not tell a wrong law from the right one."""
    job, a = law_job
    b = run_offline_job(job.model_copy(update={"temperature": 0.9, "seed": 1_000_000}), env=IN_PROCESS)
    zs = law_z([r[0] for r in a.token_ids], [r[0] for r in b.token_ids])
    print(f"T 0.8 vs 0.9: z per position {zs[:-1]}, joint {zs[-1]}")
    assert max(zs) >= 4.0, zs
    assert exact_law_z(job, b, power=False)[0] >= 4.0  # the T 0.9 samples judged by the T 0.8 law


STRUCTURED_REGEX = r"((cat|dog) (runs|sleeps)\. ){2,8}"


def test_structured_sampled_trees_follow_the_masked_law(law_job):
    """Sampled structured-output requests (a regex) with trees, verified by one-hot SpecInfer
    (``sampling_verifier: deterministic``: plain vLLM's law, not its tokens; the default ``nss``
    emits plain's very tokens, test_engine_request_types.py): every token follows the target's
    law masked by the grammar state of its own prefix (``tree_grammar.py``), judged by the exact
    law with the grammar's masks (stated power asserted); the same samples judged without the
    masks must fail. The grammar allows many tokenizations of its words, so most rows hold a
    choice (evidence), not one forced token."""
    from exact_law import grammar_masks

    job, _ = law_job
    n = N // 2
    trees = {**FIXED_TREES, "sampling_verifier": "deterministic"}
    structured = job.model_copy(update={"prompts": job.prompts[:n], "per_prompt": [
        {"structured_outputs": {"regex": STRUCTURED_REGEX}}] * n, "speculative_config": trees, "seed": 3_000_000})
    spec = run_offline_job(structured, env=IN_PROCESS)
    assert spec.spec.num_accepted_tokens > 100, spec.spec
    outs = [r[0] for r in spec.token_ids]
    masks = grammar_masks(job.model, STRUCTURED_REGEX, outs)  # asserts every token obeys the grammar
    assert max(exact_law_z(job, spec, masks=masks)) < 4.0
    assert max(exact_law_z(job, spec, power=False)) >= 4.0  # judged without the grammar, the law is another


def test_n2_sampled_children_with_trees(tiny_prompts):
    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    job = OfflineJob(model=model, prompts=tiny_prompts[:8], n=2, max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.9,
                     speculative_config=FIXED_TREES, llm_kwargs=ENGINE)
    spec = run_offline_job(job, env=IN_PROCESS)
    assert spec.spec.num_accepted_tokens > 0
    assert all(len(r) == 2 and all(len(c) == MAX_TOKENS for c in r) for r in spec.token_ids)
    assert sum(r[0] != r[1] for r in spec.token_ids) >= 6  # children sample independently


def _seeded_requests(n: int) -> list[dict]:
    """Per-request sampling of the identity test: every request seeded; top-k, min_p with a
    logit bias, and penalties on every other one of them (each edit a different path of
    ``sampler._walk_sampled``: vLLM's top-k, ``RowEdits``' mask, its path-dependent penalties)."""
    kinds = [{}, {"top_k": 12}, {"min_p": 0.1, "logit_bias": {"7": 1.5, "11": -2.0}},
             {"presence_penalty": 0.4, "repetition_penalty": 1.2}]
    return [{"seed": 5000 + 37 * i, **kinds[i % len(kinds)]} for i in range(n)]


def test_seeded_sampled_trees_emit_plain_vllms_tokens(tiny_prompts):
    """The default sampling verifier (NSS through vLLM's own sampler, ``sampler._walk_sampled``)
    emits, for a seeded request in float32, exactly the tokens plain vLLM emits with the same
    seed: each token is vLLM's own sample at its position, drawn once from the request's own
    generator as plain decoding draws once per token. So the law is plain vLLM's by identity
    (seed by seed), and the output depends neither on the tree nor on the batch: the tree run
    gets the requests in reverse order, each beside an unseeded request of other parameters.

    Fails with: one-hot SpecInfer or any verifier drawing its own uniforms (another stream: 20
    of 24 outputs differ), the step's bonus sampler also drawing from the walked requests'
    generators (two draws a step: 19 differ), a walk without the request's temperature, top-k,
    bias or penalties."""
    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    prompts = tiny_prompts[:12] * 2  # each prompt under two seeds
    per = _seeded_requests(len(prompts))
    engine = {**ENGINE, "dtype": "float32"}
    job = OfflineJob(model=model, prompts=prompts, per_prompt=per, max_tokens=32, temperature=0.8, top_p=0.95,
                     llm_kwargs=engine)
    plain = run_offline_job(job, env=IN_PROCESS)
    mixed_prompts, mixed_per = [], []
    for i in reversed(range(len(prompts))):
        mixed_prompts += [prompts[i], tiny_prompts[(i + 5) % 12]]
        mixed_per += [per[i], {"temperature": 1.0, "top_p": 1.0, "seed": None}]
    spec = run_offline_job(job.model_copy(update={"speculative_config": FIXED_TREES, "prompts": mixed_prompts,
                                                  "per_prompt": mixed_per}), env=IN_PROCESS)
    assert spec.spec.num_accepted_tokens > 50, spec.spec  # trees were verified and accepted
    outs_plain = [r[0] for r in plain.token_ids]
    outs_spec = [r[0] for r in spec.token_ids[::2]][::-1]
    assert sum(a != b for a, b in zip(outs_plain[:12], outs_plain[12:])) >= 10  # the seeds matter: sampling
    differ = [i for i, (a, b) in enumerate(zip(outs_plain, outs_spec)) if a != b]
    print(f"spec counters {spec.spec}, tau {spec.spec.tau:.2f}, outputs differing from plain vLLM: {differ}")
    assert not differ


def test_seeded_requests_draw_the_same_tokens_in_chunked_prefill(tiny_prompts):
    """A step budget of 64 tokens splits 9 of the 12 prompts into chunks; vLLM samples each
    chunk, drops the sample and rewinds the request's generator (``set_offset(get_offset() - 4)``),
    which raises on a CPU generator and killed the engine core, in plain decoding too. With
    patches.py patch 10 the rewind undoes the dropped draw: plain decoding and trees, both
    chunked, emit the tokens of plain decoding without chunks, seed by seed (float32).

    Fails with: the patch off (the engine dies: "CPU Generator does not use offset"), a rewind
    that undoes nothing, as vLLM-rbln's fix does (the stream shifts one draw per dropped chunk:
    10 of 12 outputs differ), a rewind to another state."""
    from transformers import AutoTokenizer

    from vllm_anisotropic.models import build_tiny_model

    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    budget = 64
    tokenizer = AutoTokenizer.from_pretrained(model)
    assert sum(len(tokenizer(p).input_ids) > budget for p in tiny_prompts) >= 8  # chunked prompts
    per = [{"seed": 5000 + 37 * i} for i in range(len(tiny_prompts))]
    job = OfflineJob(model=model, prompts=tiny_prompts, per_prompt=per, max_tokens=32, temperature=0.8, top_p=0.95,
                     llm_kwargs={**ENGINE, "dtype": "float32"})
    whole = run_offline_job(job, env=IN_PROCESS)
    chunked = job.model_copy(update={"llm_kwargs": {**ENGINE, "dtype": "float32", "max_num_batched_tokens": budget}})
    plain = run_offline_job(chunked, env=IN_PROCESS)
    trees = run_offline_job(chunked.model_copy(update={"speculative_config": FIXED_TREES}), env=IN_PROCESS)
    assert trees.spec.num_accepted_tokens > 50, trees.spec
    outs = [r[0] for r in whole.token_ids]
    assert len(set(map(tuple, outs))) == len(outs)  # the seeds matter: sampling
    assert [r[0] for r in plain.token_ids] == outs
    assert [r[0] for r in trees.token_ids] == outs
