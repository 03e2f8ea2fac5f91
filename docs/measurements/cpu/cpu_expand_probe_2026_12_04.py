"""vLLM 0.32's CPU replacement for the rejection sampler's expand_kernel, on a float32 output (a
temperature) and on an int64 one (a top-k), against patches.py patch 11's ``expanding_any_dtype``.

    .venv/bin/python docs/measurements/cpu/cpu_expand_probe_2026_12_04.py
"""
import torch
import vllm._C  # noqa: F401  (registers torch.ops._C)
from vllm.utils import cpu_triton_utils

from vllm_anisotropic.integration.vllm.platform_fixes.cpu_expand import expanding_any_dtype

cu = torch.tensor([2, 3, 6], dtype=torch.int32)  # drafts per request: 2, 1, 3
vllms = getattr(cpu_triton_utils._expand_kernel_impl, "__wrapped__", cpu_triton_utils._expand_kernel_impl)
for name, fn in (("vLLM 0.32", vllms), ("patch 11", expanding_any_dtype(vllms))):
    temperature = torch.full((6,), -123.0)  # what new_empty could hold
    fn(temperature, torch.tensor([0.7, 0.0, 1.5]), cu, 0, 1)  # greedy temperature 0 -> 1, as the sampler asks
    top_k = torch.full((6,), -123, dtype=torch.int64)
    fn(top_k, torch.tensor([5, 6, 7]), cu, 0, 0)
    print(f"{name:10s} float32 temperature rows {temperature.tolist()}  int64 top-k rows {top_k.tolist()}")
