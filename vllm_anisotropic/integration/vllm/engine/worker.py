"""The workers that vllm-anisotropic's tree methods select (``parallel_config.worker_cls``).

Scope: installation only.

GPU (``TreeGPUWorker``): vLLM's ``Worker._make_model_runner`` is the documented hook for a
runner subclass (``gpu_runner.TreeGPUModelRunner``); ``FLASH_ATTN`` is overridden with
``gpu_attention.TreeFlashAttentionBackend`` in ``init_device``; after ``load_model`` the tree
attention of the model's first attention layer is checked on the device against float64
(``gpu_attention.self_test``): a mismatch refuses to start.

Both: ``determine_available_memory`` gives the target's KV cache what vLLM found less what
``draft_tree`` reserves for its draft model's KV (``TreeDrafter.reserve_draft_kv``; nothing for
the other methods). On a GPU, q's weights are loaded with the runner, before vLLM's memory
profile, which counts them.

CPU (``TreeCPUWorker``): vLLM's ``CPUWorker`` builds its model runner inline from the module
global ``cpu_worker.CPUModelRunner`` (``init_device``), so the global is swapped for
``runner.TreeCPUModelRunner`` around the call; the CPU attention backend is overridden with
``attention.TreeCPUBackend`` (``register_backend(AttentionBackendEnum.CPU_ATTN, ...)``, a
process-local registry, read when the model's attention layers are built in ``load_model``).
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

__all__ = ["TreeCPUWorker", "TreeGPUWorker"]

_V2_REFUSAL = "vllm-anisotropic tree methods need vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)"


class TreeCPUWorker(CPUWorker):
    def init_device(self):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from vllm_anisotropic.integration.vllm.kernels.attention import TREE_BACKEND_CLS
        from vllm_anisotropic.integration.vllm.engine.runner import TreeCPUModelRunner

        if getattr(self, "use_v2_model_runner", False):
            raise ValueError(_V2_REFUSAL)
        register_backend(AttentionBackendEnum.CPU_ATTN, TREE_BACKEND_CLS)
        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = TreeCPUModelRunner
        try:
            return super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original

    def determine_available_memory(self) -> int:
        return _reserve_draft_kv(self.model_runner, super().determine_available_memory())

    def compile_or_warm_up_model(self, *args, **kwargs):
        from vllm_anisotropic.integration.vllm.kernels.attention import warm_up_paths
        from vllm_anisotropic.verifiers.greedy import warm_up_walk

        out = super().compile_or_warm_up_model(*args, **kwargs)
        warm_up_paths()  # the CPU tree attention's kernel (after vLLM's start-up scan: kernels/__init__.py)
        self.model_runner.warm_up_kv_moves()  # and the K/V moves' (the caches exist now)
        warm_up_walk()  # and the greedy walk's
        _calibrate(self.model_runner)
        return out


def _gpu_worker_base():
    from vllm.v1.worker.gpu_worker import Worker

    return Worker


class TreeGPUWorker(_gpu_worker_base()):
    def init_device(self):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from vllm_anisotropic.integration.vllm.kernels.gpu_attention import TREE_FLASH_BACKEND_CLS

        if getattr(self, "use_v2_model_runner", False):
            raise ValueError(_V2_REFUSAL)
        register_backend(AttentionBackendEnum.FLASH_ATTN, TREE_FLASH_BACKEND_CLS)
        return super().init_device()

    def _make_model_runner(self):
        from vllm_anisotropic.integration.vllm.engine.gpu_runner import TreeGPUModelRunner

        if getattr(self, "use_v2_model_runner", False):
            raise ValueError(_V2_REFUSAL)
        return TreeGPUModelRunner(self.vllm_config, self.device)

    def determine_available_memory(self) -> int:
        return _reserve_draft_kv(self.model_runner, super().determine_available_memory())

    def load_model(self, *args, **kwargs):
        out = super().load_model(*args, **kwargs)
        tree_attention_self_test(self.model_runner.model, self.vllm_config, self.device)
        return out

    def compile_or_warm_up_model(self, *args, **kwargs):
        from vllm_anisotropic.integration.vllm.engine.gpu_runner import warm_up_device_plan

        out = super().compile_or_warm_up_model(*args, **kwargs)
        warm_up_device_plan()  # the CUDA split's plan kernel (after vLLM's start-up scan: kernels/__init__.py)
        _calibrate(self.model_runner)
        return out


def _reserve_draft_kv(runner, available: int) -> int:
    """vLLM's KV memory less what draft_tree reserves for q's KV (``TreeDrafter.reserve_draft_kv``),
    given the target's KV bytes per token on this worker (every layer's page / block size)."""
    per_token = sum(spec.page_size_bytes / spec.block_size for spec in runner.get_kv_cache_spec().values())
    return runner.drafter.reserve_draft_kv(int(available), per_token, runner.device)


def _calibrate(runner) -> None:
    """The compiled kernels' warm-up (``TreeDrafter.warm_up``, ``runner.warm_up_step_rows``,
    ``sampler.warm_up_emit``), then the allocator's start-up sweep of real forwards (skipped
    when it is off or a cost-model file is given)."""
    from vllm_anisotropic.integration.vllm.engine.runner import warm_up_step_rows
    from vllm_anisotropic.integration.vllm.engine.sampler import warm_up_emit

    runner.drafter.warm_up(runner.input_batch.token_ids_cpu.dtype, runner.model_config.dtype,
                           runner.model_config.get_vocab_size(), cpu_logits=runner.device.type == "cpu")
    warm_up_step_rows()  # the step's node rows and positions
    warm_up_emit()  # the sampler's bookkeeping after the walk
    engine = runner.drafter.config.engine
    if engine.allocator == "auto" and not engine.cost_model:
        runner.calibrate_step_cost()


def tree_attention_self_test(model, vllm_config, device) -> float | None:
    """Check the first ``TreeFlashAttentionImpl`` of ``model`` on ``device`` (see module doc)."""
    import logging

    from vllm_anisotropic.integration.vllm.kernels.gpu_attention import TreeFlashAttentionImpl, self_test

    for module in model.modules():
        impl = getattr(module, "impl", None)
        if isinstance(impl, TreeFlashAttentionImpl):
            err = self_test(impl, vllm_config.model_config.dtype, device,
                            block_size=vllm_config.cache_config.block_size or 16)
            logging.getLogger(__name__).info("vllm-anisotropic tree attention self-test: max |error| %.3g", err)
            return err
    raise RuntimeError("vllm-anisotropic: no FLASH_ATTN tree attention layer found in the model; "
                       "the tree backend was not installed")
