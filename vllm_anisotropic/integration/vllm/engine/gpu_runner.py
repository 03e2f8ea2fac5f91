"""The tree model runner on CUDA: ``TreeRunnerMixin`` on vLLM's V1 ``GPUModelRunner``.

Scope: what differs from the CPU runner. The attention plan becomes a
``tree_attention.TreeAttentionPlan`` on the device, built once per step from host arrays and
copied in one transfer (``gpu_attention.TreeFlashAttentionImpl`` reads it in every layer);
positions are scattered on the device by ``runner.scatter_tree_positions`` (one copy per step);
vLLM's ``self.positions`` is a device tensor whose slot mapping was derived before the scatter,
so slots stay contiguous. Installed by ``worker.TreeGPUWorker._make_model_runner``.
"""

from __future__ import annotations

import numpy as np
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_anisotropic.integration.vllm.engine.runner import TreePlan, TreeRunnerMixin
from vllm_anisotropic.attention.tree_attention import TreeAttentionPlan
from vllm_anisotropic.kernels import load

__all__ = ["TreeGPUModelRunner", "device_plan", "warm_up_device_plan"]


def device_plan(plan: TreePlan, device) -> TreeAttentionPlan:
    """The step's ``TreePlan`` (host arrays) as a ``TreeAttentionPlan`` on ``device``.

    Every node row of every tree request is recomputed (the chain-prefix rows too: their cost is
    one more FA row each, and it keeps one code path). Trees of at most 64 draft nodes: one
    compiled call for the whole step (``kernels/plan.py``, ``split_plan``), else per-request masks
    (``TreeAttentionPlan.build``)."""
    trees = plan.trees
    num = plan.num_nodes
    if int(num.max()) > 64:
        return TreeAttentionPlan.build(plan.req_index, plan.masks, plan.query_end, plan.seq_lens, device=device)
    seq_lens = np.asarray(plan.seq_lens, np.int64)
    flat = load("plan").split_plan(trees.parents, trees.offsets, np.asarray(plan.req_index, np.int64),
                                   np.asarray(plan.query_end, np.int64), seq_lens)
    return TreeAttentionPlan.from_buffer(flat, len(num), int(num.max()), int((seq_lens - num).max()), device)


def warm_up_device_plan() -> None:
    """Compile ``split_plan`` (or load it from numba's disk cache) for the types ``device_plan``
    passes, at the GPU worker's start (``worker.TreeGPUWorker.compile_or_warm_up_model``)."""
    one = np.ones(1, np.int64)
    load("plan").split_plan(np.array([-1, 0], np.int64), np.array([0, 2], np.int64), one, one + 1, one + 1)


class TreeGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
    """V1 GPU model runner with tree drafting, tree positions, tree attention and tree walk."""

    def _attention_plan(self, plan: TreePlan) -> TreeAttentionPlan:
        return device_plan(plan, self.device)
