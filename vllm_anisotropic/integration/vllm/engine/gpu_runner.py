"""The tree model runner on CUDA: ``TreeRunnerMixin`` on vLLM's V1 ``GPUModelRunner``.

Scope: what differs from the CPU runner. The attention plan becomes a
``tree_attention.TreeAttentionPlan`` on the device, built once per step from host arrays and
copied in one transfer (``gpu_attention.TreeFlashAttentionImpl`` reads it in every layer);
positions are scattered on the device by ``runner.scatter_tree_positions`` (one copy per step);
vLLM's ``self.positions`` is a device tensor whose slot mapping was derived before the scatter,
so slots stay contiguous. Installed by ``worker.TreeGPUWorker._make_model_runner``.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_anisotropic.integration.vllm.engine.runner import TreePlan, TreeRunnerMixin
from vllm_anisotropic.attention.tree_attention import TreeAttentionPlan

__all__ = ["TreeGPUModelRunner", "device_plan"]


def device_plan(plan: TreePlan, device) -> TreeAttentionPlan:
    """The step's ``TreePlan`` (host lists) as a ``TreeAttentionPlan`` on ``device``.

    Every node row of every tree request is recomputed (the chain-prefix rows too: their cost is
    one more FA row each, and it keeps one code path). From the trees' packed ancestor bits
    (no loop over requests) unless a tree has more than 64 nodes."""
    if int(plan.trees.sizes().max()) <= 64:
        return TreeAttentionPlan.from_bits(plan.req_index, plan.num_nodes, plan.draft_bits(), plan.query_end,
                                           plan.seq_lens, device=device)
    return TreeAttentionPlan.build(plan.req_index, plan.masks, plan.query_end, plan.seq_lens, device=device)


class TreeGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
    """V1 GPU model runner with tree drafting, tree positions, tree attention and tree walk."""

    def _attention_plan(self, plan: TreePlan) -> TreeAttentionPlan:
        return device_plan(plan, self.device)
