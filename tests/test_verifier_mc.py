"""Monte Carlo: the fast (vectorised) verifiers sample exactly the analytic output law.

For a fixed tree, 100,000 verifications in one batch (``TreeBatch.repeat``), fixed seeds
(deterministic in CI). Statistical test: Pearson chi-square of the emitted token blocks
against ``analytic.output_distribution`` (itself proven lossless by exact enumeration in
test_verifier_exact.py), cells with expected count < 5 pooled; the statistic is mapped to a
standard normal by the Wilson-Hilferty transform and must be below 5 (false-alarm rate
~3e-7 per test; the seeds are fixed, so the outcome is deterministic). The omnibus statistic
has little power against a bias in one cell (measured: a 5 % relative excess in the most
likely cell fails z < 5 in only 45-92 % of simulated samples), so every cell is also tested on
its own: |o - n p| / sqrt(n p (1 - p)) < 5.5 for every cell with n p >= 5 (Bonferroni over
<= 25 cells: false-alarm rate <= 25 x 3.8e-8 ~ 1e-6 per test). A 5 % relative excess in a
cell of probability p >= 0.2 shifts that cell's z by >= 0.05 sqrt(n p / (1.05 (1 - 1.05 p)))
>= 6.7 at n = 100,000: ``test_threshold_catches_a_5_percent_bias`` checks by simulation that
it fails for every case's most likely cell while the true law passes. Power against a
different verifier: samples of NSS are rejected against the Traversal law.
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


def cell_z(counts: Counter, law: dict, n: int) -> float:
    """Largest |o - n p| / sqrt(n p (1 - p)) over the cells with n p >= 5 (a binomial z per cell)."""
    zs = [abs(counts.get(k, 0) - n * p) / math.sqrt(n * p * (1 - p)) for k, p in law.items() if 5 <= n * p < n]
    return max(zs, default=0.0)


def assert_law(counts: Counter, law: dict, n: int) -> None:
    """The sample is consistent with ``law``: omnibus chi-square z < 5 and every cell's z < 5.5."""
    z, zc = chi2_z(counts, law, n), cell_z(counts, law, n)
    assert z < 5.0 and zc < 5.5, (round(z, 2), round(zc, 2))


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
    assert_law(sample_counts(name, tree.with_draft_probs(q), logits, q, seed=1234), law, N)


@pytest.mark.parametrize("name", ["deterministic", "nss"])
def test_deterministic_tree_sampling(name):
    tree = topk_tree(TARGET, PREFIX, width=2, depth=2, spine=[0, 2, 3])
    logits, _ = tree_rows(tree, PREFIX, TARGET)
    law = output_distribution(name, tree, p_rows(tree, logits))
    assert_law(sample_counts(name, tree, logits, None, seed=99), law, N)


def test_chi2_has_power():
    tree = fixed_tree("iid")
    logits, q = tree_rows(tree, PREFIX, TARGET, DRAFT)
    wrong = output_distribution("traversal", tree, p_rows(tree, logits), q)
    counts = sample_counts("nss", tree.with_draft_probs(q), logits, q, seed=5)
    assert chi2_z(counts, wrong, N) > 5.0


def test_threshold_catches_a_5_percent_bias():
    """Power and false-alarm rate of ``assert_law`` at N = 100,000, by simulation. For each
    case's exact law: 100 multinomial samples of N blocks (seeded) pass against the law itself
    and fail against the law whose most likely cell is 5 % heavier (p -> 1.05 p, the other
    cells scaled down to keep the total) -- a verifier that over-emits one block by 5 %
    relative cannot pass. The omnibus z alone would let 8-55 % of those through."""
    rng = np.random.default_rng(2024)
    for name, kind in CASES:
        tree = fixed_tree(kind)
        logits, q = tree_rows(tree, PREFIX, TARGET, DRAFT)
        law = output_distribution(name, tree, p_rows(tree, logits), q)
        keys = sorted(law)
        probs = np.array([law[k] for k in keys])
        probs /= probs.sum()
        top = int(np.argmax(probs))
        biased = probs * (1 - 1.05 * probs[top]) / (1 - probs[top])
        biased[top] = 1.05 * probs[top]
        wrong = dict(zip(keys, biased))
        for counts in rng.multinomial(N, probs, size=100):
            sample = Counter({k: int(c) for k, c in zip(keys, counts) if c})
            assert_law(sample, law, N)
            assert chi2_z(sample, wrong, N) > 5.0 or cell_z(sample, wrong, N) > 5.5, (name, kind, probs[top])
