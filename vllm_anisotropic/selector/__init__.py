"""Learned (K, L1, L2) selector for ``draft_tree`` (arXiv 2602.16994 Sec. 6): per request-step,
the delayed-tree shape with the highest predicted tokens per second.

``features``: what the drafter knows at the root; ``policy``: the MLP, its file format and
loading checks; ``train``: labels from ``bench.draft_tree_grid`` records (exact E[tau + 1] of
every action divided by its Eq. 11 time), training and the held-out evaluation
(``vllm-anisotropic selector train``); ``shipped``: the selectors in the package and the
model pair each is for; ``shape``: the (K, L1, L2) ``DelayedShape`` the selector chooses and
``proposers.draft_model`` drafts. Never imports vLLM, nor ``proposers`` (which imports it).
"""
