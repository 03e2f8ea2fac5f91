"""A request's own tree options (``extra_args`` / ``vllm_xargs``) and which request types get trees.

Pure functions, no engine: ``config.request_tree_options`` (validated in the front end,
patches.py patch 9) and ``runner.ineligible_reason`` / ``runner.RowEdits`` (the worker). The
engine tests of every request type are in test_engine_request_types.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.frontdoor.config import request_tree_options


@pytest.mark.parametrize("extra, trees, cap", [
    (None, True, None), ({}, True, None), ({"other_tool": 1}, True, None),
    ({"trees": False}, False, None), ({"trees": 0}, False, None), ({"trees": "false"}, False, None),
    ({"trees": 1}, True, None), ({"tree_max_nodes": 4}, True, 4), ({"tree_max_nodes": 0}, True, 0),
])
def test_request_options_parse(extra, trees, cap):
    opts = request_tree_options(extra)
    assert (opts.trees, opts.max_nodes) == (trees, cap)
    assert opts.drafts == (trees and cap != 0)


@pytest.mark.parametrize("extra, named", [
    ({"tree_nodes": 3}, ["'tree_nodes'", "tree_max_nodes", "trees"]),
    ({"trees": "no"}, ["'trees'", "'no'", "true or false"]),
    ({"trees": 2}, ["'trees'", "2"]),
    ({"tree_max_nodes": -1}, ["tree_max_nodes", "-1", ">= 0"]),
    ({"tree_max_nodes": 2.5}, ["tree_max_nodes", "2.5"]),
    ({"tree_max_nodes": True}, ["tree_max_nodes", "True"]),
])
def test_bad_request_options_are_refused_by_name(extra, named):
    with pytest.raises(ValueError) as info:
        request_tree_options(extra)
    missing = [s for s in named if s not in str(info.value)]
    assert not missing, (missing, str(info.value))


def _params(**kw):
    """Greedy unless ``kw`` says otherwise (SamplingParams' own default temperature is 1.0)."""
    from vllm import SamplingParams

    return SamplingParams(**{"temperature": 0.0, **kw})


@pytest.mark.parametrize("kw, sampling_trees, reason", [
    ({}, False, None),
    ({"temperature": 0.8}, False, "sampled"),
    ({"temperature": 0.8}, True, None),
    ({"logit_bias": {5: 1.0}}, False, None),
    ({"allowed_token_ids": [1, 2, 3]}, False, None),
    ({"min_p": 0.2}, False, None),  # argmax-invariant: greedy keeps trees
    ({"min_p": 0.2, "temperature": 0.8}, True, None),  # masked at the temperature, RowEdits
    ({"logprobs": 1}, False, None),  # raw logprobs mode: the tree sampler reports them
    ({"presence_penalty": 0.5}, False, None),  # path-dependent edits: every row with its own past
    ({"frequency_penalty": 0.5}, False, None),
    ({"repetition_penalty": 1.1}, False, None),
    ({"min_tokens": 3}, False, None),
    ({"extra_args": {"trees": False}}, False, "request_opt_out"),
    ({"extra_args": {"tree_max_nodes": 0}}, False, "request_opt_out"),
    ({"extra_args": {"tree_max_nodes": 3}}, False, None),
])
def test_which_requests_get_trees(kw, sampling_trees, reason):
    from vllm_anisotropic.integration.vllm.engine.runner import ineligible_reason

    assert ineligible_reason(_params(**kw), sampling_trees) == reason


def test_structured_outputs_keep_trees_unless_sampled_from_a_draft_law():
    """Grammar-pruned trees (tree_grammar.py): greedy and sampled structured requests keep trees;
    sampled ones lose them where pruning would bias the draft law a verifier reads (draft-model
    trees under SpecTr, Khisti, ...: ``sampled_grammar_trees`` off)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_anisotropic.integration.vllm.engine.runner import ineligible_reason

    regex = StructuredOutputsParams(regex="(ab)+")
    greedy = SamplingParams(temperature=0.0, structured_outputs=regex)
    sampled = SamplingParams(temperature=0.8, structured_outputs=regex)
    assert ineligible_reason(greedy, True) is None and ineligible_reason(sampled, True) is None
    assert ineligible_reason(greedy, True, sampled_grammar_trees=False) is None
    assert ineligible_reason(sampled, True, sampled_grammar_trees=False) == "structured_output"
    assert ineligible_reason(_params(temperature=0.8), True, sampled_grammar_trees=False) is None


def test_logprobs_keep_trees_only_in_raw_modes():
    from vllm_anisotropic.integration.vllm.engine.runner import ineligible_reason

    assert ineligible_reason(_params(logprobs=2), logprobs_trees=False) == "logprobs"


def test_row_edits_apply_as_vllms_sampler_does():
    """Allowed set first (every other token -inf), then the bias at its tokens: the argmax of
    an edited row is the biased argmax among the allowed tokens."""
    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits

    assert RowEdits.of(_params()) is None
    rows = torch.tensor([[0.0, 5.0, 1.0, 2.0, 3.0], [4.0, 0.0, 0.0, 0.0, 0.0]])
    edits = RowEdits.of(_params(logit_bias={2: 2.5, 4: -1.0}, allowed_token_ids=[0, 2, 4]))
    edits.apply(rows)
    inf = float("-inf")
    assert rows.tolist() == [[0.0, inf, 3.5, inf, 2.0], [4.0, inf, 2.5, inf, -1.0]]
    assert rows.argmax(-1).tolist() == [2, 0]


def test_row_pasts_follow_each_nodes_path():
    import numpy as np

    from vllm_anisotropic.integration.vllm.engine.sampler import _row_pasts

    # root 9 -> a 1 -> b 2, root -> c 3 (sibling of a)
    assert _row_pasts(np.array([9, 1, 2, 3]), np.array([-1, 0, 1, 0]), [5, 9]) == [
        [5, 9], [5, 9, 1], [5, 9, 1, 2], [5, 9, 3]]


def test_min_tokens_masks_stop_tokens_on_rows_still_short():
    """``min_tokens`` 3 and output length 2: the root row (2 tokens before it) masks the stop
    token, a depth-1 row (3 before it) does not."""
    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits

    sp = _params(min_tokens=3, stop_token_ids=[4])
    edits = RowEdits.of(sp)
    assert edits.path and edits.stop_tokens.tolist() == [4]
    rows = torch.zeros(2, 6)
    edits.apply(rows, past=[[7, 8], [7, 8, 1]])
    assert rows[0, 4] == float("-inf") and rows[1, 4] == 0.0 and rows[0, :4].eq(0).all()


def test_penalties_count_each_rows_own_path():
    """Frequency penalty 1 on a tree ``root 9 -> 1 -> 1`` and ``root -> 3`` after output
    ``[5, 9]``: each row is penalised by the output plus its own path (vLLM's
    apply_all_penalties on the row's past), so the second 1 costs row 2 twice and row 3 never.
    A sampler that penalised every row by the output alone would leave rows 1-3 equal to row 0."""
    import numpy as np
    from types import SimpleNamespace

    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits
    from vllm_anisotropic.integration.vllm.engine.sampler import _row_pasts

    vocab = 10
    edits = RowEdits.of(_params(frequency_penalty=1.0))
    assert edits.path and edits.penalties
    metadata = SimpleNamespace(  # the SamplingMetadata fields RowEdits.apply reads, batch row 1 of 3
        bad_words_token_ids={}, prompt_token_ids=torch.tensor([[vocab, vocab], [7, vocab], [1, 3]]),
        presence_penalties=torch.tensor([0.0, 0.0, 2.0]), frequency_penalties=torch.tensor([0.0, 1.0, 3.0]),
        repetition_penalties=torch.tensor([1.0, 1.0, 1.5]))
    past = _row_pasts(np.array([9, 1, 1, 3]), np.array([-1, 0, 1, 0]), [5, 9])
    rows = torch.zeros(4, vocab)
    edits.apply(rows, past, metadata, index=1)
    expected = torch.zeros(4, vocab)
    expected[:, 5] = expected[:, 9] = -1.0
    expected[1, 1], expected[2, 1], expected[3, 3] = -1.0, -2.0, -1.0
    assert torch.equal(rows, expected), rows


def test_min_p_masks_as_vllms_processor_at_the_requests_temperature():
    """Sampled min_p 0.3 at temperature 0.5: the edited rows, divided by the temperature, equal
    vLLM's MinPLogitsProcessor applied to the rows divided by the temperature."""
    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits

    torch.manual_seed(0)
    rows = torch.randn(3, 50)
    edits = RowEdits.of(_params(temperature=0.5, min_p=0.3))
    assert edits.min_p == 0.3 and not edits.path
    ours = rows.clone()
    edits.apply(ours)
    scaled = rows / torch.tensor(0.5)
    probs = scaled.softmax(-1)
    reference = scaled.masked_fill(probs < probs.amax(-1, keepdim=True) * torch.tensor(0.3), float("-inf"))
    assert torch.equal(ours / torch.tensor(0.5), reference)
    assert 0 < int(torch.isinf(ours).sum()) < ours.numel() - 3
    assert RowEdits.of(_params(min_p=0.3)) is None  # greedy: min_p never moves the argmax


def test_eligibility_at_the_edges():
    """No sampling parameters (a pooling request): no trees. ``min_tokens`` 1 is path-dependent
    (the root row of an empty output masks the stop tokens, the rows after it do not)."""
    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits, ineligible_reason

    assert ineligible_reason(None) == "no_sampling_params"
    assert RowEdits.of(_params(min_tokens=1, stop_token_ids=[4])).path  # one token short: path-dependent


def test_bad_words_mask_each_rows_own_path_for_the_requests_batch_row():
    """Bad word ``[3, 7]`` of batch row 1: token 7 is masked on the rows whose past ends with 3
    (vLLM's apply_bad_words on each row's own past); batch row 0 has no bad words. A request
    with bad words known only as strings (before the tokenizer's ids) is edited too."""
    from types import SimpleNamespace

    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits

    edits = RowEdits.of(_params(bad_words=["x"]))
    assert edits.bad_words and edits.path
    metadata = SimpleNamespace(bad_words_token_ids={1: [[3, 7]]})
    past = [[5, 3], [5, 3, 1], [5, 3, 1, 3]]
    rows = torch.zeros(3, 10)
    edits.apply(rows, past, metadata, index=1)
    assert torch.isinf(rows[:, 7]).tolist() == [True, False, True] and int(torch.isinf(rows).sum()) == 2
    rows = torch.zeros(3, 10)
    edits.apply(rows, past, metadata, index=0)
    assert not torch.isinf(rows).any()


def test_min_p_of_one_keeps_exactly_the_most_likely_tokens():
    """vLLM masks tokens *below* min_p x the largest probability: at min_p 1 the tied maxima stay."""
    from vllm_anisotropic.integration.vllm.engine.runner import RowEdits

    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    RowEdits.of(_params(temperature=0.7, min_p=1.0)).apply(rows)
    inf = float("-inf")
    assert rows.tolist() == [[inf, 3.0, 3.0, inf]]
