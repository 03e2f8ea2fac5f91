"""Learned (K, L1, L2) selector for ``draft_tree`` (arXiv 2602.16994 Sec. 6): per request-step,
the delayed-tree shape with the highest predicted tokens per second.

``features``: what the drafter knows at the root; ``policy``: the MLP, its file format and
loading checks; ``train``: labels from ``bench.draft_tree_grid`` records (exact E[tau + 1] of
every action divided by its Eq. 11 time), training and the held-out evaluation
(``vllm-anisotropic selector train``). Never imports vLLM.
"""

from vllm_anisotropic.selector.features import FEATURES, record_features, root_features
from vllm_anisotropic.selector.policy import SelectorFileError, ShapeSelector, action_grid

__all__ = ["FEATURES", "SelectorFileError", "ShapeSelector", "action_grid", "record_features", "root_features"]
