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
    """Real HumanEval and GSM8K prompt texts (raw: the tiny model is a random-weight model, chat formatting adds nothing)."""
    from vllm_anisotropic.data import load_dataset

    return [p.text for p in load_dataset("humaneval", limit=6)] + [
        p.text for p in load_dataset("gsm8k", limit=6)
    ]
