"""Monte Carlo: the fast (vectorised) verifiers sample exactly the analytic output law.

For a fixed tree, 100,000 verifications in one batch (``TreeBatch.repeat``), fixed seeds
(deterministic in CI). Statistical test: Pearson chi-square of the emitted token blocks
against ``analytic.output_distribution`` (itself proven lossless by exact enumeration in
test_verifier_exact.py), cells with expected count < 5 pooled; the statistic is mapped to a
standard normal by the Wilson-Hilferty transform and must be below 5 (false-alarm rate
~3e-7 per test; the seeds are fixed, so the outcome is deterministic). Power check: samples
of NSS are rejected against the Traversal law.
"""

import math
from collections import Counter

import numpy as np
import pytest
import torch

from vllm_anisotropic.tree import pack_trees
from vllm_anisotropic.verifiers import TargetSampling, get_verifier, target_probs
from vllm_anisotropic.verifiers.analytic import output_distribution
from vllm_anisotropic.verifiers.toy import DraftTable, TableModel, paths_to_tree, sample_iid_paths, topk_tree, tree_rows

V = 5
N = 100_000
TARGET = TableModel(V, seed=3)
DRAFT = DraftTable(TARGET, seed=4, lam0=0.4, slope=0.2)
PREFIX = (1,)
SAMPLING = TargetSampling(0.9, top_k=4)


def chi2_z(counts: Counter, law: dict, n: int) -> float:
    stat, df, pool_o, pool_e = 0.0, -1, 0.0, 0.0
    for key in set(law) | set(counts):
        e = law.get(key, 0.0) * n
        o = counts.get(key, 0)
        if e < 5:
            pool_o, pool_e = pool_o + o, pool_e + e
            continue
        stat += (o - e) ** 2 / e
        df += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-12)
        df += 1
    df = max(df, 1)
    # Wilson-Hilferty: (X/df)^(1/3) ~ Normal(1 - 2/(9 df), 2/(9 df))
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def sample_counts(name, tree, logits, q, seed):
    batch = pack_trees([tree]).repeat(N)
    reps = lambda x: None if x is None else x.repeat(N, 1)  # noqa: E731
    v = get_verifier(name, torch.float64)
    res = v.verify_batch(batch, reps(logits), SAMPLING, torch.Generator().manual_seed(seed), reps(q))
    acc = res.accepted.numpy()
    k = res.num_accepted.numpy()
    tok = tree.tokens
    rows = [tuple(tok[acc[i, : k[i]]].tolist()) + (int(res.bonus_tokens[i]),) for i in range(N)]
    return Counter(rows)


def p_rows(tree, logits):
    n = tree.num_nodes
    return target_probs(logits, torch.full((n,), SAMPLING.temperature), torch.full((n,), SAMPLING.top_k),
                        torch.full((n,), SAMPLING.top_p), torch.float64)


def fixed_tree(kind):
    rng = np.random.default_rng(11)
    k, l1, l2 = {"chain": (1, 0, 3), "iid": (3, 0, 2), "delayed": (2, 1, 2)}[kind]
    # pick a draw with duplicate first tokens when possible, to exercise multiplicity
    return paths_to_tree(sample_iid_paths(DRAFT, PREFIX, k, l1, l2, rng), PREFIX[-1], l1)


CASES = (
    [(n, "iid") for n in ("nss", "naive", "naive_tree", "spectr", "specinfer", "khisti", "traversal", "block")]
    + [(n, "delayed") for n in ("spectr", "specinfer", "khisti", "traversal")]
    + [(n, "chain") for n in ("naive", "traversal", "block")]
)


@pytest.mark.parametrize("name,kind", CASES)
def test_fast_verifier_matches_exact_law(name, kind):
    tree = fixed_tree(kind)
    logits, q = tree_rows(tree, PREFIX, TARGET, DRAFT)
    law = output_distribution(name, tree, p_rows(tree, logits), q)
    counts = sample_counts(name, tree.with_draft_probs(q), logits, q, seed=1234)
    assert chi2_z(counts, law, N) < 5.0


@pytest.mark.parametrize("name", ["deterministic", "nss"])
def test_deterministic_tree_sampling(name):
    tree = topk_tree(TARGET, PREFIX, width=2, depth=2, spine=[0, 2, 3])
    logits, _ = tree_rows(tree, PREFIX, TARGET)
    law = output_distribution(name, tree, p_rows(tree, logits))
    assert chi2_z(sample_counts(name, tree, logits, None, seed=99), law, N) < 5.0


def test_chi2_has_power():
    tree = fixed_tree("iid")
    logits, q = tree_rows(tree, PREFIX, TARGET, DRAFT)
    wrong = output_distribution("traversal", tree, p_rows(tree, logits), q)
    counts = sample_counts("nss", tree.with_draft_probs(q), logits, q, seed=5)
    assert chi2_z(counts, wrong, N) > 5.0
