"""Counter-based uniforms (``verifiers/uniforms.py``): a tree's sampled verification depends on
its request's seed and output position, never on its batch mates. For every sampling verifier,
each tree verified alone and inside batches of other trees (which change the uniform block's
shape: the batch's deepest tree and widest node) accepts the same path and emits the same
bonus token."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_anisotropic.tree import DraftTree, NodeSource, pack_trees
from vllm_anisotropic.verifiers import VERIFIERS, SamplingTensors, get_verifier
from vllm_anisotropic.verifiers.uniforms import counter_uniforms, request_seed

VOCAB = 6


def _tree(rng, n, draft: bool) -> DraftTree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    src = NodeSource.DRAFT if draft else NodeSource.BRANCH
    tree = DraftTree(tokens=rng.integers(0, VOCAB, n), parents=parents, sources=[0] + [src] * (n - 1))
    if draft:
        q = torch.softmax(torch.randn(n, VOCAB, dtype=torch.float64), -1).float()
        tree = tree.with_draft_probs(q)
    return tree


def test_uniforms_worked_example_and_range():
    u = counter_uniforms([7, 7], [100, 101], np.array([[0, 1]]))
    assert u.shape == (2, 1, 2) and u.dtype == torch.float64 and not torch.equal(u[0], u[1])
    again = counter_uniforms([3, 7], [5, 100], np.array([[0, 1]]))
    assert torch.equal(again[1], u[0])  # request 0's uniforms in another batch
    big = counter_uniforms(np.arange(1000), np.zeros(1000), np.arange(64).reshape(1, 64))
    assert float(big.min()) >= 0.0 and float(big.max()) < 1.0 and abs(float(big.mean()) - 0.5) < 0.01
    assert request_seed(5, "a", 0) == request_seed(5, "b", 9)  # a request's own seed wins
    assert request_seed(None, "a", 0) != request_seed(None, "b", 0)


@pytest.mark.parametrize("name", sorted(n for n in VERIFIERS if n != "greedy"))
def test_a_trees_verification_does_not_depend_on_its_batch(name):
    verifier = get_verifier(name)
    draft = verifier.requires_draft_probs
    rng = np.random.default_rng(11)
    for trial in range(8):
        trees = [_tree(rng, int(rng.integers(1, 9)), draft) for _ in range(5)]
        logits = [torch.randn(t.num_nodes, VOCAB) * 2 for t in trees]
        seeds, positions = rng.integers(0, 1 << 40, 5), rng.integers(0, 5000, 5)
        sampling = SamplingTensors(torch.full((5,), 0.9), torch.full((5,), -1, dtype=torch.long), torch.ones(5))

        def run(index):
            batch = pack_trees([trees[i] for i in index])
            keys = verifier.uniform_keys(batch)
            u = counter_uniforms(seeds[index], positions[index], keys)
            q = torch.cat([trees[i].draft_probs for i in index]) if draft else None
            sub = SamplingTensors(sampling.temperature[index], sampling.top_k[index], sampling.top_p[index])
            out = verifier.verify_batch(batch, torch.cat([logits[i] for i in index]), sub, None, q, uniforms=u)
            return out.to_list()

        alone = [run([i])[0] for i in range(5)]
        for index in ([0, 1, 2, 3, 4], [4, 2, 0], [3, 1]):
            for i, res in zip(index, run(index)):
                assert (res.accepted, res.bonus_token) == (alone[i].accepted, alone[i].bonus_token), (name, trial, i)


def test_given_uniforms_must_fit_the_batch():
    verifier = get_verifier("nss")
    batch = pack_trees([DraftTree.chain([1, 2])])
    with pytest.raises(ValueError, match="uniforms must be"):
        verifier.verify_batch(batch, torch.randn(3, VOCAB), uniforms=torch.zeros(1, 1, 1, dtype=torch.float64))
