"""The chain steps' values by depth (``allocator/chain_depths.py``).

What each test would catch: a depth counted as tried without the depths above it accepted (or
with ``a >= d`` for ``a >= d - 1``), reach as the rates themselves instead of their running
product, the decay applied to one sum only or not at all, the prior fading with the counts,
verified drafts beyond the table's depth or accepted counts above the verified not clipped.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_anisotropic.allocator.chain_depths import ChainDepths


def test_the_docstring_example():
    c = ChainDepths(3)
    c.observe([3, 2], [1, 2])
    np.testing.assert_allclose(c.tried, [2, 2, 0])
    np.testing.assert_allclose(c.accepted, [2, 1, 0])
    np.testing.assert_allclose(c.rates(), [0.9, 0.65, 0.8])
    np.testing.assert_allclose(c.reach(), [0.9, 0.585, 0.468])


def test_untouched_depths_read_the_prior_and_reach_is_its_powers():
    c = ChainDepths(4, prior=0.7, weight=3.0)
    np.testing.assert_allclose(c.rates(), [0.7] * 4)
    np.testing.assert_allclose(c.reach(), 0.7 ** np.arange(1, 5))
    c.observe([1], [0])  # depth 1 tried and refused: depths 2..4 untouched
    np.testing.assert_allclose(c.rates(), [2.1 / 4, 0.7, 0.7, 0.7])


def test_counts_decay_per_step_and_the_prior_stays():
    c = ChainDepths(1, prior=0.8, weight=2.0, decay=0.5)
    c.observe([1], [0])
    c.observe([1], [1])
    # tried 0.5 x 1 + 1, accepted 0.5 x 0 + 1
    assert c.rates()[0] == pytest.approx((1.6 + 1.0) / (2.0 + 1.5))
    for _ in range(60):
        c.observe([1, 1], [0, 0])
    # the counts settle at 2 / (1 - 0.5) = 4 tried, 0 accepted; the prior's 1.6 / 2 remains
    assert c.rates()[0] == pytest.approx(1.6 / 6.0)


def test_long_chains_and_excess_acceptances_are_clipped():
    c = ChainDepths(2, decay=1.0)
    c.observe([5, 1], [4, 3])  # as (2, 2) and (1, 1)
    np.testing.assert_allclose(c.tried, [2, 1])
    np.testing.assert_allclose(c.accepted, [2, 1])
    c.observe([], [])  # nothing verified: no decay, no count
    np.testing.assert_allclose(c.tried, [2, 1])


@pytest.mark.parametrize("kwargs", [dict(depth=0), dict(depth=2, prior=0.0), dict(depth=2, prior=1.5),
                                    dict(depth=2, weight=0.0), dict(depth=2, decay=0.0)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ChainDepths(**kwargs)
