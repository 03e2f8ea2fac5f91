"""Tree decoding harness: greedy output equality with plain greedy decoding on the tiny model,
tree-mask / position construction, per-step records."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic.bench.harness import TreeDecoder, first_divergence, load_model, tree_attention_mask
from vllm_anisotropic.proposers import get_proposer
from vllm_anisotropic.tree import DraftTree

METHODS = ["ar", "pld", "tr", "iso3", "iso5", "goose", "goose-no-bypass", "goose-no-spine", "goose-unigram"]
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "1, 2, 3, 4, 5, 6, 7",
]


@pytest.fixture(scope="module")
def tiny():
    from vllm_anisotropic.models import build_tiny_model

    torch.manual_seed(0)
    model, tok = load_model(build_tiny_model(), dtype=torch.float32)
    dec = TreeDecoder(model)
    prompts = [tok.encode(t) for t in TEXTS]
    refs = [dec.greedy_decode(p, 40).tokens for p in prompts]
    return dec, prompts, refs


def test_mask_and_positions():
    tree = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 1])
    m = tree_attention_mask(tree, 2, torch.float32, "cpu")[0, 0]
    allowed = (m == 0).int().tolist()
    assert allowed == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert tree.positions(7).tolist() == [7, 8, 8, 9]


@pytest.mark.parametrize("method", METHODS)
def test_greedy_equality(tiny, method):
    dec, prompts, refs = tiny
    prop = get_proposer(method)  # shared table: later prompts start warm
    for p, ref in zip(prompts, refs):
        res = dec.generate(p, prop.new_request(), 40)
        assert first_divergence(ref, res.tokens) == -1 and len(res.tokens) == len(ref), method
        assert sum(s.accepted + 1 for s in res.steps) >= len(res.tokens)
        for s in res.steps:
            assert s.tree_size <= 60 and s.accepted == s.spine_accepted + s.branch_accepted
        if method == "ar":
            assert res.tau == 1.0
        if method in ("pld", "goose"):
            assert res.tau > 1.0  # the tiny model repeats: drafts get accepted


def test_eos_and_budget(tiny):
    dec, prompts, refs = tiny
    eos = refs[0][5]
    res = dec.generate(prompts[0], get_proposer("goose", budget=8).new_request(), 40, eos_ids=[eos])
    assert res.tokens == refs[0][: refs[0].index(eos) + 1]
    assert all(s.tree_size <= 8 for s in res.steps)


def test_qwen2_arch_equality():
    """Qwen2 (q/k/v biases) through the same tree path."""
    from vllm_anisotropic.models import build_tiny_model

    model, tok = load_model(build_tiny_model(arch="qwen2"), dtype=torch.float32)
    dec = TreeDecoder(model)
    prop = get_proposer("goose")
    for text in TEXTS[:2]:
        p = tok.encode(text)
        ref = dec.greedy_decode(p, 32).tokens
        res = dec.generate(p, prop.new_request(), 32)
        assert res.tokens == ref


def test_summary_counts_each_prompt_method_once_and_only_complete_prompts():
    from vllm_anisotropic.bench.tau import complete_prompts, summarize

    def rec(p, m, acc, steps=10):
        s = {"num_steps": steps, "accepted": acc, "spine_accepted": 0, "spine_proposed": 0, "branch_accepted": acc,
             "branch_proposed": 5 * steps, "bypass_steps": 0, "propose_ms_per_step": 1.0,
             "num_tokens": steps + acc, "wall_s": 0.5 * steps}
        return {"dataset": "d", "prompt_index": p, "method": m, "summary": s, "identical_to_ar": True}

    records = [rec(0, "ar", 0), rec(0, "tr", 10), rec(1, "ar", 0),  # prompt 1 partial in run A
               rec(1, "ar", 0), rec(1, "tr", 20), rec(2, "ar", 0)]  # run B redoes prompt 1; prompt 2 partial
    kept = complete_prompts(records)
    assert sorted((r["prompt_index"], r["method"]) for r in kept) == [(0, "ar"), (0, "tr"), (1, "ar"), (1, "tr")]
    out = summarize(kept)
    assert out[("d", "ar")]["prompts"] == 2 and out[("d", "tr")]["tau"] == (20 + 30) / 20
    # tokens/s from tokens over wall time, summed before dividing: (20 + 30) / (5 + 5); plain 20 / 10
    assert out[("d", "tr")]["tok_s"] == 5.0 and out[("d", "ar")]["tok_s"] == 2.0
