"""Shared fixtures. Engine tests start real vLLM (CPU build) in separate processes."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """A deterministic tiny random-weight Llama with the real SmolLM2 tokenizer."""
    from vllm_anisotropic.models import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_prompts() -> list[str]:
    """Real HumanEval and GSM8K prompt texts (raw, no chat template: the tiny model has none)."""
    from vllm_anisotropic.data import load_dataset

    return [p.text for p in load_dataset("humaneval", limit=6)] + [
        p.text for p in load_dataset("gsm8k", limit=6)
    ]
