"""The allocator's compiled kernels (``kernels.rank``, ``kernels.allocate``) called directly on
hand-built inputs: golden values derived by hand, or an independent reference (a min-max
formula for the antitonic regression, ``CostModel.predict`` for the step cost, a plain loop for
the prefix scan). Written for the mutants of ``scripts/mutate.py`` that the allocator's own
tests let through (docs/testing.md); each test runs the kernels compiled, in well under a second
once they are compiled."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_anisotropic import kernels
from vllm_anisotropic.allocator.cost import CostModel
from vllm_anisotropic.tree import DraftTree, FlatTrees


# ------------------------------------------------------------------------------------ rank
def _rank(trees, alpha, beta, max_depth):
    """``kernels.rank.rank_trees`` on ``trees`` (a list of DraftTree): (changed, order, probs);
    the ranked node arrays it writes are checked here to be ``FlatTrees.permuted(order)``'s."""
    flat = FlatTrees.from_trees(trees)
    n = flat.num_nodes
    order, probs = np.full(n, -7, np.int64), np.full(n, np.nan)
    nodes = (np.full(n, -7, np.int64), np.full(n, -7, np.int64), np.full(n, -7, np.int8), np.full(n, np.nan),
             np.full(n, -7, np.int64))
    chains = np.full(flat.num_trees, -7, np.int64)
    changed = kernels.load("rank").rank_trees(
        flat.offsets, flat.tokens, flat.parents, flat.sources, flat.values, flat.depths,
        np.ascontiguousarray(alpha, np.float64), np.ascontiguousarray(beta, np.float64), max_depth, order, probs,
        *nodes, chains)
    want = flat.permuted(order)
    for got, name in zip(nodes, ("tokens", "parents", "sources", "values", "depths")):
        np.testing.assert_array_equal(got, getattr(want, name), err_msg=name)
    np.testing.assert_array_equal(chains, want._chain_prefix(), err_msg="chains")
    return changed, order, probs


def _identity_model(num_sources=3, max_depth=3):
    """alpha = 0, beta = 1: sigmoid(logit(v)) = v, so the raw probabilities are the values."""
    return np.zeros((num_sources, max_depth + 1)), np.ones((num_sources, max_depth + 1))


def test_rank_reports_no_change_for_trees_already_in_rank_order():
    """Two trees whose (-p, depth, index) order is their own: the kernel returns False (the
    caller then keeps the trees as they are), the identity order, the capped probabilities.
    Tree A parents [-1, 0, 0, 1], values [-, 0.6, 0.3, 0.2]: capped [1, 0.6, min(0.3, 1 - 0.6),
    min(0.2, 0.6)] = [1, 0.6, 0.3, 0.2]; tree B a root alone. With the docstring's example tree
    appended the batch changes (True)."""
    a = DraftTree(tokens=[1, 2, 3, 4], parents=[-1, 0, 0, 1], sources=[0, 1, 1, 1], values=[1.0, 0.6, 0.3, 0.2])
    b = DraftTree(tokens=[9], parents=[-1])
    alpha, beta = _identity_model()
    changed, order, probs = _rank([a, b], alpha, beta, 3)
    assert not changed
    assert order.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(probs, [1.0, 0.6, 0.3, 0.2, 1.0], rtol=1e-12)
    # the module docstring's worked example: raw [-, 0.2, 0.6, 0.5], parents [-1, 0, 0, 2] ->
    # order [0, 2, 3, 1], probabilities in the new order [1, 0.6, 0.5, min(0.2, 1 - 0.6)]
    ex = DraftTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 2], sources=[0, 1, 1, 1], values=[1.0, 0.2, 0.6, 0.5])
    changed, order, probs = _rank([a, ex, b], alpha, beta, 3)
    assert changed
    assert order.tolist() == [0, 1, 2, 3, 4, 6, 7, 5, 8]
    np.testing.assert_allclose(probs, [1.0, 0.6, 0.3, 0.2, 1.0, 0.6, 0.5, 0.2, 1.0], rtol=1e-12)


def _sigmoid(z):
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def test_rank_clips_values_0_and_1_inside_the_logit():
    """Values exactly 1 and 0 are clipped to 1 - 1e-9 and 1e-9 inside the logit (module
    docstring; ``acceptance.logit``): with beta = 0.5 the probabilities are sigmoid(+-0.5
    logit(1 - 1e-9)) = 1 - 3.16e-5 and 3.16e-5, not 1 (an unclipped logit is +inf) and not
    the value of another clip bound (2e-9 gives 4.47e-5). The 0-valued node hangs under the
    1-valued one so the tree bound (min(raw, parent's)) does not act."""
    tree = DraftTree(tokens=[1, 2, 3], parents=[-1, 0, 1], sources=[0, 1, 1], values=[1.0, 1.0, 0.0])
    alpha, beta = np.zeros((3, 3)), np.full((3, 3), 0.5)
    _, order, probs = _rank([tree], alpha, beta, 2)
    x = math.log(1e-9) - math.log1p(-1e-9)  # logit(1e-9) = -logit(1 - 1e-9) = -20.72
    hi, lo = _sigmoid(-0.5 * x), _sigmoid(0.5 * x)
    assert hi == pytest.approx(1 - 3.162e-5, abs=1e-8) and lo == pytest.approx(3.162e-5, rel=1e-3)
    assert order.tolist() == [0, 1, 2]
    np.testing.assert_allclose(probs, [1.0, hi, lo], rtol=1e-9)


def test_rank_sigmoid_is_stable_for_large_logits_and_buckets_deep_nodes():
    """alpha = +-800 (any beta): the probability is 1 and 0, never NaN (exp(800) overflows:
    the stable sigmoid takes 1 / (1 + exp(-z)) for z >= 0 and e^z / (1 + e^z) below). Depth
    buckets: d = min(depth, max_depth), so with max_depth 1 the depth-2 and depth-3 nodes use
    the depth-1 key (alpha = 800 for source 1, -800 for source 2; deeper keys would read 0)."""
    tree = DraftTree(tokens=[1, 2, 3, 4, 5], parents=[-1, 0, 1, 2, 0], sources=[0, 1, 1, 1, 2],
                     values=[1.0, 0.5, 0.25, 0.125, 0.9])
    alpha = np.array([[0.0, 0.0], [0.0, 800.0], [0.0, -800.0]])
    beta = np.ones((3, 2))
    _, order, probs = _rank([tree], alpha, beta, 1)
    assert order.tolist() == [0, 1, 2, 3, 4]  # p = [1, 1, 1, 1, 0]
    assert probs.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]


# -------------------------------------------------------------------------------- allocate
def _antitonic(p):
    """The non-increasing regression of ``p`` (unit weights) by the min-max formula:
    f(k) = min over i <= k of max over j >= k of mean(p[i..j])."""
    n = len(p)
    return [min(max(float(np.mean(p[i:j + 1])) for j in range(k, n)) for i in range(k + 1)) for k in range(n)]


def test_concave_rows_worked_examples_and_a_min_max_reference():
    """Rows of different lengths in one call (the stack restarts per row), entries past a row's
    length ignored and returned as 0, every entry written (``out`` starts as NaN). Examples of
    ``concave_slopes``: [0.1, 0.9, 0.2] -> [0.5, 0.5, 0.2]; [2, 1, 4] -> [7/3] * 3; [0.9, 0.1]
    unchanged; then random rows against the min-max formula."""
    f = kernels.load("allocate").concave_rows
    p = np.array([[0.1, 0.9, 0.2, 0.7, 0.3],
                  [2.0, 1.0, 4.0, 9.0, 9.0],
                  [0.9, 0.1, 0.8, 0.8, 0.8],
                  [0.5, 0.5, 0.5, 0.5, 0.5],
                  [0.3, 0.3, 0.3, 0.3, 0.3]])
    lengths = np.array([3, 3, 2, 0, 5], np.int64)
    out = np.full(p.shape, np.nan)
    f(p, lengths, out)
    want = [[0.5, 0.5, 0.2, 0, 0], [7 / 3] * 3 + [0, 0], [0.9, 0.1, 0, 0, 0], [0] * 5, [0.3] * 5]
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=0)
    rng = np.random.default_rng(3)
    for width in (1, 2, 7, 12):
        p = rng.random((9, width))
        p[1] = np.sort(p[1])  # increasing: one block
        p[2] = np.sort(p[2])[::-1]  # already non-increasing: unchanged
        lengths = rng.integers(0, width + 1, 9)
        lengths[:3] = width
        out = np.full(p.shape, np.nan)
        f(p, lengths, out)
        for i in range(9):
            n = int(lengths[i])
            np.testing.assert_allclose(out[i, :n], _antitonic(p[i, :n]), rtol=1e-12, atol=1e-15, err_msg=str(i))
            assert np.all(out[i, n:] == 0.0), i


def _cost_model():
    """Knots [0, 4, 16, 64] and every coefficient distinct and > 0, so each one is seen."""
    knots = [0.0, 4.0, 16.0, 64.0]
    weights = [0.011, 0.0013,  # base, per request
               0.0021, 0.00037, 0.0051, 0.0009,  # Q slopes on [0, 4], [4, 16], [16, 64], past 64
               0.017, 0.0029, 0.00043, 7.1e-6, 0.0031, 0.00083, 0.0053]  # b_on .. b_step (_TAIL)
    return CostModel(knots, np.array(weights))


def test_step_seconds_equals_the_cost_models_predict_at_every_segment():
    """``step_seconds`` against ``CostModel.predict`` (np.interp over the knots) below, on and
    between the knots and past the last one, with and without tree rows and speculating
    requests. One value by hand: R 2, Q 10, T 3, C 100, D 1 -> 0.011 + 0.0026 + (4 x 0.0021 +
    6 x 0.00037) + 0.017 + 0.0058 + 0.00129 + 0.00071 + 0.0031 + 0.00083 + 0.0053."""
    model = _cost_model()
    step = kernels.load("allocate").step_seconds
    params = model.kernel_params()
    by_hand = (0.011 + 0.0026 + (4 * 0.0021 + 6 * 0.00037) + 0.017 + 0.0058 + 0.00129 + 0.00071
               + 0.0031 + 0.00083 + 0.0053)
    assert step(2.0, 10.0, 3.0, 100.0, 1.0, *params) == pytest.approx(by_hand, rel=1e-12)
    for q in (0.0, 1.0, 4.0, 10.0, 16.0, 40.0, 63.5, 64.0, 65.0, 1000.0):
        for r, t, c, d in [(1, 0, 0.0, 0), (5, 3, 0.0, 0), (5, 0, 250.0, 2), (3, 7, 90.0, 3)]:
            got = step(float(r), q, float(t), c, float(d), *params)
            assert got == pytest.approx(float(model.predict(r, q, t, c, d)), rel=1e-12), (q, r, t, c, d)


def test_scan_prefixes_equals_a_plain_loop_over_the_order():
    """Every prefix T = 0 .. t_max of a shuffled order (t_max below the node count): gains,
    hull gains, context and first-node counts summed in that order, the step cost with D and
    with D = 0 (``predict``); nothing written past index t_max."""
    model = _cost_model()
    rng = np.random.default_rng(5)
    nodes = 9
    order = rng.permutation(nodes).astype(np.int64)
    gain, slope = rng.random(nodes), rng.random(nodes)
    node_ctx = rng.integers(0, 500, nodes).astype(np.float64)
    first = np.array([1, 0, 0, 1, 0, 1, 0, 0, 1], np.int64)
    base, num_reqs, q0 = 2.5, 3.0, 4.0
    for t_max in (0, 6):
        out = np.full((4, t_max + 3), np.nan)
        kernels.load("allocate").scan_prefixes(order, t_max, gain, slope, node_ctx, first, base, num_reqs, q0,
                                               *model.kernel_params(), out[0], out[1], out[2], out[3])
        g, h, c, d = base, base, 0.0, 0
        for t in range(t_max + 1):
            if t:
                node = order[t - 1]
                g, h, c, d = g + gain[node], h + slope[node], c + node_ctx[node], d + first[node]
            assert out[0, t] == pytest.approx(g, rel=1e-12) and out[1, t] == pytest.approx(h, rel=1e-12), t
            assert out[2, t] == pytest.approx(model.predict(num_reqs, q0 + t, t, c, d), rel=1e-12), t
            assert out[3, t] == pytest.approx(model.predict(num_reqs, q0 + t, t, c, 0), rel=1e-12), t
        assert np.all(np.isnan(out[:, t_max + 1:])), t_max


# ------------------------------------------------------------------------------------ offers
def test_offer_budgets_against_their_definition():
    """``kernels.allocate.offer_budgets`` against the drafter's offer rule written out in numpy
    (max(min_drafts, ceil(factor x mark)) drafts + the root; 0 without a mark (negative or NaN)
    or where the drafts reach the room, infinite and huge marks included), on random marks (none, 0, fractional, exact multiples), rooms at,
    below and above the drafts, and the docstring's example. The boundary cases a reversed
    comparison or a floor for the ceil would pass are fixed: a mark whose drafts equal the room
    (0), one below it, a mark of exactly 0 (min_drafts), a fractional product (rounded up)."""
    off = kernels.load("allocate").offer_budgets

    def run(marks, room, factor, min_drafts):
        out = np.full(len(marks), -7, np.int64)
        off(np.asarray(marks, np.float64), np.asarray(room, np.int64), float(factor), int(min_drafts), out)
        return out.tolist()

    assert run([5.0, -1.0, 2.0], [60, 60, 8], 3.0, 8) == [16, 0, 0]
    assert run([3.0, 3.0, 0.0, 2.1, 2.1], [9, 10, 60, 60, 7], 3.0, 2) == [0, 10, 3, 8, 0]
    # no mark (NaN), and marks whose drafts pass any room (infinite, huge): the proposer's own;
    # a room the minimum reaches though the product does not (min_drafts 8 >= room 8)
    assert run([np.nan, np.inf, 1e300, 1.0, 1.0], [60, 60, 60, 8, 9], 3.0, 8) == [0, 0, 0, 0, 9]
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 9))
        marks = np.where(rng.random(n) < 0.2, -1.0, np.round(rng.uniform(0, 12, n) * rng.choice([1, 4], n)) / 4)
        room = rng.integers(0, 40, n)
        factor, min_drafts = float(rng.choice([0.5, 1.0, 1.5, 3.0])), int(rng.integers(1, 10))
        drafts = np.maximum(min_drafts, np.ceil(factor * marks)).astype(np.int64)
        want = np.where((marks < 0) | (drafts >= room), 0, drafts + 1)
        assert run(marks, room, factor, min_drafts) == want.tolist()


def test_cut_accounts_against_their_definition():
    """``kernels.allocate.cut_accounts`` against the cut's metrics written out in numpy (as
    ``BatchBudget.cut`` computed them: ``request_caps``, prefix sums, their differences at each
    cut and cap), on random lists with cuts from 0 to the cap, caps set by the list, the
    per-request maximum (or none) and a headroom that may be negative, and the docstring's
    example. Kept drafts and their sum exactly; the given-up sum to rounding (numpy sums it
    pairwise)."""
    from vllm_anisotropic.allocator import request_caps

    acc = kernels.load("allocate").cut_accounts

    def run(flat, lengths, max_per_request, headroom, cuts):
        kept = np.full(len(lengths), -7.0)
        out = acc(np.asarray(flat, np.float64), np.asarray(lengths, np.int64), max_per_request,
                  np.asarray(headroom, np.int64), np.asarray(cuts, np.int64), kept)
        return out, kept

    (caps, given_up, drafts), kept = run([0.9, 0.5, 0.8], [2, 1], -1, [9, 9], [1, 0])
    assert (caps, drafts, kept.tolist()) == (3, 1, [0.9, 0.0]) and given_up == pytest.approx(1.3)
    rng = np.random.default_rng(11)
    for _ in range(300):
        n = int(rng.integers(1, 7))
        lengths = rng.integers(0, 9, n)
        flat = rng.random(int(lengths.sum()))
        max_per_request = int(rng.choice([-1, 0, 1, 3, 20]))
        headroom = rng.integers(-2, 10, n)
        cap = request_caps(lengths, None if max_per_request < 0 else max_per_request, headroom)
        cuts = np.array([rng.integers(0, c + 1) for c in cap], np.int64)
        sums = np.concatenate([[0.0], np.cumsum(flat)])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        (caps, given_up, drafts), kept = run(flat, lengths, max_per_request, headroom, cuts)
        assert (caps, drafts) == (int(cap.sum()), int(cuts.sum()))
        assert np.array_equal(kept, sums[starts + cuts] - sums[starts])
        assert given_up == pytest.approx(float(np.sum(sums[starts + cap] - sums[starts + cuts])), rel=1e-12, abs=1e-12)
