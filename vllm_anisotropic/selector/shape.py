"""The (K, L1, L2) shape of a delayed-expansion draft tree (arXiv 2602.16994, Def. 5.2).

The selector's action (``policy.ShapeSelector.choose``) and the plan ``proposers.draft_model``
drafts a tree from (``delayed_tree``, ``shape_parents``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DelayedShape"]


@dataclass(frozen=True)
class DelayedShape:
    """(K, L1, L2): ``branches`` paths of ``branch_length`` tokens after a trunk of ``trunk``.

    ``DelayedShape(2, 1, 2).num_drafts == 5``; with ``branch_length`` 0 the tree is the trunk."""

    branches: int
    trunk: int
    branch_length: int

    def __post_init__(self) -> None:
        if self.branches < 1 or self.trunk < 0 or self.branch_length < 0:
            raise ValueError(f"need branches >= 1, trunk >= 0, branch_length >= 0; got {self}")

    @property
    def num_drafts(self) -> int:
        return self.trunk + (self.branches * self.branch_length)
