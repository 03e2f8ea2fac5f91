"""How far the gate's chain steps' drafts get accepted, by depth: the values that cut a chain step.

Scope: a chain step (``gate``, the third arm) verifies each request's spine chain as drafted,
unranked (no acceptance-model score per node: that is its host-cost advantage). Verifying every
chain whole made a chain step at 64 requests on the 2-core EPYC ~2x a plain step (320 more query
rows) for ~1.07 tokens per request, and the gate's warm-up and exploration pay that at every batch
size. So the step is cut like a tree step (``allocate_flat`` with the cost model, chain rows as plain
query rows), with one value per depth measured from the chain steps themselves:

    p_d   = P(draft d accepted | drafts 1..d-1 accepted),  estimated as
            (prior x weight + accepted_d) / (weight + tried_d)
    reach_d = p_1 ... p_d      (the value of a chain's d-th node: P(it is on the accepted path))

where a verified chain of n drafts with a accepted *tried* depths 1..min(n, a + 1) and
*accepted* depths 1..a. Observed counts decay by ``decay`` per chain step (the text changes);
the prior stays (a floor of ``weight`` pseudo-chains), so a depth nobody tried reads ``prior``.

Example (prior 0.8, weight 2): chains (3 drafts, 1 accepted) and (2 drafts, 2 accepted) try
depth 1 twice (2 accepted), depth 2 twice (1), depth 3 never: p = (3.6/4, 2.6/4, 1.6/2) =
(0.9, 0.65, 0.8), reach = (0.9, 0.585, 0.468).

The prior is optimistic on purpose: a chain step keeps what would pay at 80 % per draft, so
every batch size where that much could pay tries chains and measures them; where not even that
pays (the forward's cost per query row is high against its cost per request) nothing is kept
and the chain step costs what a plain step costs. A decision here reads past steps' outcomes
only, never the verified step's own samples, so the verifiers' output law is unchanged.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ChainDepths"]


class ChainDepths:
    """Per-depth acceptance of chain drafts (module docstring)."""

    def __init__(self, depth: int, prior: float = 0.8, weight: float = 2.0, decay: float = 0.98) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if not 0.0 < prior <= 1.0 or weight <= 0.0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need 0 < prior <= 1, weight > 0, 0 < decay <= 1; got {prior}, {weight}, {decay}")
        self.prior, self.weight, self.decay = float(prior), float(weight), float(decay)
        self.tried = np.zeros(depth)  # decayed chains that tried depth d (index d - 1)
        self.accepted = np.zeros(depth)  # of them, those whose depth d was accepted
        self._depths = np.arange(1, depth + 1)

    @property
    def depth(self) -> int:
        return int(self.tried.size)

    def rates(self) -> np.ndarray:
        """[depth] p_d (module docstring)."""
        return (self.prior * self.weight + self.accepted) / (self.weight + self.tried)

    def reach(self) -> np.ndarray:
        """[depth] reach_d = p_1 ... p_d: the value of a chain's d-th draft."""
        return np.cumprod(self.rates())

    def observe(self, verified, accepted) -> None:
        """One chain step's outcome: per request, drafts verified (beyond ``depth``: ignored)
        and drafts accepted (at most verified)."""
        n = np.minimum(np.asarray(verified, np.int64), self.depth)
        if n.size == 0:
            return
        a = np.clip(np.asarray(accepted, np.int64), 0, n)
        d = self._depths
        tried = ((n[:, None] >= d) & (a[:, None] >= d - 1)).sum(axis=0)
        kept = (a[:, None] >= d).sum(axis=0)
        self.tried = self.decay * self.tried + tried
        self.accepted = self.decay * self.accepted + kept
