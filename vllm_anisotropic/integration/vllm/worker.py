"""The CPU worker that vllm-anisotropic's tree methods select (``parallel_config.worker_cls``).

Scope: installation only. vLLM's ``CPUWorker`` builds its model runner inline from the module
global ``cpu_worker.CPUModelRunner`` (``init_device``), so the global is swapped for
``runner.TreeCPUModelRunner`` around the call; the CPU attention backend is overridden with
``attention.TreeCPUBackend`` (``register_backend(AttentionBackendEnum.CPU_ATTN, ...)``, a
process-local registry, read when the model's attention layers are built in ``load_model``).
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_worker import CPUWorker

__all__ = ["TreeCPUWorker"]


class TreeCPUWorker(CPUWorker):
    def init_device(self):
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        from vllm_anisotropic.integration.vllm.attention import TREE_BACKEND_CLS
        from vllm_anisotropic.integration.vllm.runner import TreeCPUModelRunner

        if getattr(self, "use_v2_model_runner", False):
            raise ValueError("vllm-anisotropic tree methods need vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        register_backend(AttentionBackendEnum.CPU_ATTN, TREE_BACKEND_CLS)
        original = cpu_worker.CPUModelRunner
        cpu_worker.CPUModelRunner = TreeCPUModelRunner
        try:
            return super().init_device()
        finally:
            cpu_worker.CPUModelRunner = original
