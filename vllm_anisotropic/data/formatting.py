"""Turn a ``Prompt`` into the exact text a model is fed, per model (chat template) or raw.

Scope: string formatting only; tokenization and generation happen elsewhere.

Modes:
    chat  the tokenizer's own chat template (instruct models), with the generation prompt
          appended. HumanEval is a completion task, so the assistant turn is *pre-filled* with
          the code to complete: the model continues the function body, as in the raw setting.
    raw   plain completion text with the conventional zero-shot framing of each data set
          (``Question: ... Answer:`` for GSM8K, ``Problem: ... Solution:`` for MATH, ...).

Worked example (SmolLM2 template, HumanEval/0, chat)::

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, ...<|im_end|>\\n
    <|im_start|>user\\nComplete the following Python function:\\n```python\\nfrom typing ...```<|im_end|>\\n
    <|im_start|>assistant\\n```python\\nfrom typing import List\\n\\n\\ndef has_close_elements(...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from vllm_anisotropic.data.datasets import Prompt

__all__ = ["FormatMode", "HUMANEVAL_INSTRUCTION", "format_prompt", "user_message"]

FormatMode = Literal["chat", "raw"]
HUMANEVAL_INSTRUCTION = "Complete the following Python function:"


def user_message(prompt: Prompt, turn: int = 0) -> str:
    """The user message of ``turn`` for chat mode."""
    if turn > 0:
        if not prompt.turns or turn >= len(prompt.turns):
            raise ValueError(f"{prompt.id} has no turn {turn}")
        return prompt.turns[turn]
    if prompt.dataset == "humaneval":
        return f"{HUMANEVAL_INSTRUCTION}\n```python\n{prompt.text}```"
    if prompt.dataset == "math500":
        return f"{prompt.text}\nPut your final answer within \\boxed{{}}."
    return prompt.text


def _raw(prompt: Prompt, history: Sequence[str]) -> str:
    if history:
        raise ValueError("raw mode formats single-turn prompts only; use mode='chat'")
    if prompt.dataset == "humaneval":
        return prompt.text
    if prompt.dataset == "gsm8k":
        return f"Question: {prompt.text}\nAnswer:"
    if prompt.dataset == "math500":
        return f"Problem:\n{prompt.text}\n\nSolution:"
    if prompt.dataset == "mbpp":
        return f'"""\n{prompt.text}\n"""\n'
    return prompt.text


def format_prompt(
    prompt: Prompt,
    tokenizer,
    mode: FormatMode = "chat",
    history: Sequence[str] = (),
) -> str:
    """Text to feed the model for ``prompt``.

    Args:
        prompt: a loaded prompt.
        tokenizer: a Hugging Face tokenizer; chat mode needs its ``chat_template``.
        mode: ``"chat"`` (instruct models) or ``"raw"`` (plain completion).
        history: the model's answers to the earlier turns (MT-Bench turn 2: pass the turn-1
            answer); the returned text asks for turn ``len(history)``.
    """
    if mode == "raw":
        return _raw(prompt, history)
    if mode != "chat":
        raise ValueError(f"unknown mode {mode!r}; valid: 'chat', 'raw'")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat template; use mode='raw'")
    messages: list[dict[str, str]] = []
    for turn, answer in enumerate(history):
        messages.append({"role": "user", "content": user_message(prompt, turn)})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": user_message(prompt, len(history))})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if prompt.dataset == "humaneval" and not history:
        # Pre-fill the answer with the code so that the model completes the function body.
        text += f"```python\n{prompt.text}"
    return text
