"""Every request type a plain vLLM engine serves is served with a tree method on, exactly.

vLLM refuses ``min_p`` and ``logit_bias`` with any speculative config (a 400 over HTTP); with
``{"method": "goose"}`` they are accepted (patches.py, patch 9). One tiny-Llama workload
(20 prompts, 48 tokens, float32), each prompt with its own request type, run three times: plain
vLLM without the per-prompt parameters (to pick biases that change the output), plain vLLM with
them, GOOSE with them. GOOSE must match plain token for token on every prompt, and the
requests whose law trees keep (all but the opted-out one) must have had trees and accepted
drafts, the others none (counted by reason on /metrics).

Which bug each check catches: tree rows verified without the request's bias or allowed set
(the walk accepts the unbiased argmax: the output equals the unbiased run, not plain's);
logprobs taken from the wrong row (the bonus row, or a rejected sibling: values differ);
min_p / logit_bias dropped for requests without trees (vLLM builds only min_tokens' processor
under speculation); a request type given trees whose law they do not keep (penalties, bad
words: outputs differ, and the reason counts are off by one). The seeded sampled requests (min_p,
a bias, a JSON schema) keep trees and emit plain's very tokens (NSS through vLLM's sampler with
the request's generator, ``sampler._walk_sampled``), and the token the bias bans never appears.
Structured outputs (regex, JSON schema, choice, EBNF grammar; ``tree_grammar.py``): a tree row
masked by the grammar state after the previous *listed* node (vLLM's chain semantics) or not
masked at all lets the walk accept a token plain's masked argmax would not take (outputs
differ, or are invalid); trees not pruned fail in the scheduler (``node_rows``), and the
pruned-node counter must move."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from vllm_anisotropic.integration.vllm.engine.metrics import STATS_ENV, TRACE_ENV
from vllm_anisotropic.bench.offline import IN_PROCESS, WORKER_PROCESS, OfflineJob, run_offline_job

pytestmark = pytest.mark.engine

# compact JSON (xgrammar's default allows any whitespace, which this model emits until max_tokens)
ENGINE = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32", "max_num_seqs": 24,
          "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
WIDE_GOOSE = {"method": "goose", "bypass": False, "min_branch_score": 0.0, "allocator": "off"}
MAX_TOKENS = 48

# structured outputs: outputs this tiny model repeats (so trees get accepted) and finishes
REGEX = "((cat|dog) (runs|sleeps)\\. ){2,8}"
SCHEMA = {"type": "object", "required": ["name", "items"], "properties": {
    "name": {"type": "string", "maxLength": 4},
    "items": {"type": "array", "minItems": 3, "maxItems": 4, "items": {
        "type": "object", "required": ["key", "on"],
        "properties": {"key": {"enum": ["alpha", "beta"]}, "on": {"type": "boolean"}}}}}}
CHOICES = ["the cat runs and the cat runs and the cat sleeps", "the cat runs and the dog runs and the dog sleeps", "no"]
GRAMMAR = 'root ::= item (", " item){6,12}\nitem ::= "x" [0-9] | "yy"'
GRAMMAR_RE = r"(x[0-9]|yy)(, (x[0-9]|yy)){6,12}"

# prompt index -> (its SamplingParams over greedy, whether it gets trees); biases filled in below
KINDS = [
    ("greedy", {}, True),
    ("logit_bias", None, True),
    ("allowed_token_ids", None, True),
    ("min_p greedy", {"min_p": 0.3}, True),
    ("min_p sampled (seeded)", {"temperature": 0.8, "min_p": 0.05, "seed": 11}, True),
    ("bad_words", None, True),
    ("frequency and presence penalties", {"frequency_penalty": 1.5, "presence_penalty": 0.5}, True),
    ("repetition_penalty", {"repetition_penalty": 1.3}, True),
    ("min_tokens", None, True),
    ("trees off", {"extra_args": {"trees": False}}, False),
    ("node cap 2", {"extra_args": {"tree_max_nodes": 2}}, True),
    ("logit_bias sampled (seeded)", None, True),
    ("logprobs greedy", {"logprobs": 3}, True),
    ("logprobs and logit_bias", None, True),
    ("prompt logprobs", {"prompt_logprobs": 2, "logprobs": 1}, True),
    ("structured output (regex)", {"structured_outputs": {"regex": REGEX}}, True),
    ("structured output (json schema)", {"structured_outputs": {"json": SCHEMA}, "max_tokens": 96}, True),
    ("structured output (choice)", {"structured_outputs": {"choice": CHOICES}}, True),
    ("structured output (grammar)", {"structured_outputs": {"grammar": GRAMMAR}}, True),
    ("structured output (json schema), sampled (seeded)",
     {"structured_outputs": {"json": SCHEMA}, "temperature": 0.8, "seed": 3, "max_tokens": 96}, True),
]
LOGPROBS = (12, 13, 14)
REASONS = {"request_opt_out": 1}
STRUCTURED = range(15, 20)


@pytest.fixture(scope="module")
def setup(tiny_prompts):
    from transformers import AutoTokenizer

    from vllm_anisotropic.models import build_tiny_model

    from vllm_anisotropic.data import load_dataset

    # lm_head_alpha 0.25: a flatter head (top-1 ~0.76 at temperature 0.7), so that penalties and
    # path-dependent edits move the argmax (the default head's logit gaps absorb them)
    model = str(build_tiny_model(block_std=0.1, lm_head_alpha=0.25))
    tok = AutoTokenizer.from_pretrained(model)
    prompts = (tiny_prompts + [p.text for p in load_dataset("mbpp", limit=8)])[: len(KINDS)]
    assert len(prompts) == len(KINDS)
    free = run_offline_job(OfflineJob(model=model, prompts=prompts, max_tokens=MAX_TOKENS, llm_kwargs=ENGINE), env=IN_PROCESS)
    per_prompt = []
    for i, (name, params, _) in enumerate(KINDS):
        out = free.token_ids[i][0]
        common = [t for t, _ in Counter(out).most_common()]
        if name.startswith("logit_bias"):
            # ban the unbiased output's most common token, favour its third
            params = {"logit_bias": {str(common[0]): -100.0, str(common[min(2, len(common) - 1)]): 3.0}}
            if "sampled" in name:
                params.update(temperature=0.7, seed=5)
        elif name == "logprobs and logit_bias":
            params = {"logprobs": 2, "logit_bias": {str(common[0]): -100.0}}
        elif name == "allowed_token_ids":
            # the prompt's own tokens minus the unbiased output's most common one
            params = {"allowed_token_ids": sorted(set(tok.encode(prompts[i])) - {common[0]})}
        elif name == "bad_words":
            # two consecutive tokens of the unbiased output that are a word of their own: the
            # second is banned only right after the first (path-dependent)
            pair = next(out[k:k + 2] for k in range(3, len(out) - 1)
                        if tok.encode(tok.decode(out[k:k + 2]), add_special_tokens=False) == out[k:k + 2])
            params = {"bad_words": [tok.decode(pair)]}
        elif name == "min_tokens":
            # a stop token the unbiased output emits early and again later: masked until 24
            # tokens are out, counted per row along its path
            stop = next(t for k, t in enumerate(out[2:20], 2) if t in out[k + 1:])
            params = {"min_tokens": 24, "stop_token_ids": [stop]}
        per_prompt.append(params)
    return OfflineJob(model=model, prompts=prompts, max_tokens=MAX_TOKENS, per_prompt=per_prompt,
                      llm_kwargs=ENGINE), free


def test_every_request_type_is_served_exactly_with_trees_where_the_law_allows(setup, tmp_path):
    job, free = setup
    plain = run_offline_job(job, env=IN_PROCESS)
    # the parameters really act: biased / restricted / banned outputs differ from the free run
    for i in (1, 2, 5, 6, 8):
        assert plain.token_ids[i] != free.token_ids[i], KINDS[i][0]
    stats = tmp_path / "tree_stats.json"
    # the worker in a process of its own (the production executor): the grammar-pruned trees'
    # reorders reach it with the scheduler's output over vLLM's message queue
    goose = run_offline_job(job.model_copy(update={"speculative_config": WIDE_GOOSE,
                                                   "llm_kwargs": {**ENGINE, **WORKER_PROCESS}}),
                            env={**IN_PROCESS, STATS_ENV: str(stats), TRACE_ENV: "1"})
    for i, (a, b) in enumerate(zip(plain.token_ids, goose.token_ids)):
        assert a == b, f"prompt {i} ({KINDS[i][0]}): plain {a} vs goose {b}"
    # logprobs of every emitted token as plain reports them (raw log-softmax of the row that
    # predicted it: the root's, then each accepted node's), top-k ids and values
    for i in LOGPROBS:
        a, b = plain.logprobs[i], goose.logprobs[i]
        assert len(a) == len(b) == MAX_TOKENS, (i, len(a), len(b))
        for step, (x, y) in enumerate(zip(a, b)):
            assert x.keys() == y.keys(), (i, step, x, y)
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x), (i, step, x, y)
    # prompt logprobs as plain computes them at prefill (trees never touch the prompt)
    a, b = plain.prompt_logprobs[14], goose.prompt_logprobs[14]
    assert len(a) == len(b) == len(plain.prompt_token_ids[14]) - 1
    for step, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x), (step, x, y)
    # structured outputs with trees: every output whole and valid (and plain's, above)
    texts = [goose.texts[i][0] for i in STRUCTURED]
    assert re.fullmatch(REGEX, texts[0]), texts[0]
    print("structured outputs:", texts)
    for text in (texts[1], texts[4]):
        value = json.loads(text)
        assert set(value) == {"name", "items"} and len(value["name"]) <= 4 and 3 <= len(value["items"]) <= 4, text
        assert all(x["key"] in ("alpha", "beta") and isinstance(x["on"], bool) for x in value["items"]), text
    assert texts[2] in CHOICES and re.fullmatch(GRAMMAR_RE, texts[3]), texts[2:4]
    # sampled trees verified on the biased law: the banned token (-100) is never emitted
    banned = [int(t) for t, v in job.per_prompt[11]["logit_bias"].items() if v < 0]
    assert not set(banned) & set(goose.token_ids[11][0]), (banned, goose.token_ids[11])
    data = json.loads(stats.read_text())
    assert data["without_trees"] == REASONS, data["without_trees"]
    # the grammars pruned draft nodes before verification (scheduler.TreeScheduler, tree_grammar.py)
    budget = json.loads((tmp_path / "tree_stats.json.budget").read_text())
    assert budget["grammar_pruned_nodes"] > 0 and budget["grammar_reordered_trees"] > 0, budget
    # the requests that keep trees had them and accepted drafts (traces by request id "<i>-...")
    traced = {int(r.split("-")[0]): steps for r, steps in data["requests"].items()}
    expected = {i for i, (_, _, trees) in enumerate(KINDS) if trees}
    assert set(traced) == expected, (sorted(traced), sorted(expected))
    for i in expected:
        assert sum(traced[i]) > 0, (KINDS[i][0], traced[i])
    # the node cap held: at most 2 accepted per step for its request (others exceed it)
    assert max(traced[10]) <= 2 and max(max(traced[i]) for i in (0, 1, 2, 3)) > 2, traced
