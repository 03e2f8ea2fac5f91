"""Proposers plugged into vLLM's ``custom_class`` speculative method.

vLLM's V1 model runner builds the class named by ``speculative_config.model`` with
``cls(vllm_config)`` and calls, after every step's bookkeeping,
``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=...)``
(``v1/worker/gpu_model_runner.py``, ``propose_draft_token_ids``), expecting one draft list per
request in the batch. ``load_model(target_model)`` is called on CPU (``cpu_model_runner.py``).

Usage::

    LLM(model, speculative_config={
        "method": "custom_class",
        "model": "vllm_anisotropic.integration.vllm.frontdoor.proposer.PromptLookupProposer",
        "num_speculative_tokens": 5,
    })
"""

from __future__ import annotations

import numpy as np

from vllm_anisotropic.proposers.pld import propose_prompt_lookup

PROMPT_LOOKUP_CLASS = f"{__name__}.PromptLookupProposer"


class PromptLookupProposer:
    """Chain drafts from prompt lookup (PLD), one list per request, run inside vLLM."""

    def __init__(self, vllm_config) -> None:
        spec = vllm_config.speculative_config
        self.num_speculative_tokens: int = spec.num_speculative_tokens
        self.min_ngram: int = spec.prompt_lookup_min or 3
        self.max_ngram: int = spec.prompt_lookup_max or 5
        self.max_model_len: int = vllm_config.model_config.max_model_len

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,  # [max_num_reqs]
        token_ids_cpu: np.ndarray,  # [max_num_reqs, max_model_len]
        slot_mappings=None,  # unused: no draft model, no KV of our own
    ) -> list[list[int]]:
        drafts: list[list[int]] = []
        for i, sampled in enumerate(sampled_token_ids):
            num_tokens = int(num_tokens_no_spec[i])
            # No sampled token: a partial prefill chunk or a discarded request; no room: done.
            if not sampled or num_tokens >= self.max_model_len:
                drafts.append([])
                continue
            budget = min(self.num_speculative_tokens, self.max_model_len - num_tokens - 1)
            draft = propose_prompt_lookup(
                token_ids_cpu[i, :num_tokens], budget, self.min_ngram, self.max_ngram
            )
            drafts.append(draft.tolist())
        return drafts

    def load_model(self, *args, **kwargs) -> None:
        """No draft model to load: drafts come from the context alone."""
