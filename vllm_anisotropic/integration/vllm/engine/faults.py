"""Contained faults of the tree path, and the switch that injects them for tests and drills.

Every stage of a step that runs the plugin's own code runs contained: an exception there is
logged with the request ids it concerns (the first of a stage with its traceback, later ones on
one line), counted on /metrics by stage (``vllm_anisotropic:tree_faults{stage}``), and those
requests decode without trees from then on, with plain decoding's tokens; the engine goes on.

=========  ==========================================  =========================================
stage      where (what raised)                         the step, and the requests it concerns
=========  ==========================================  =========================================
propose    ``TreeDrafter.propose_trees`` (worker)      no drafts for the batch; its drafting
                                                       requests lose trees
allocator  ``BatchBudget`` hooks (scheduler)           the running requests' drafts are dropped
                                                       before vLLM schedules (a plain step); they
                                                       lose trees (the workers are told with the
                                                       step: ``tree_faults``)
verify     ``TreeRejectionSampler._verify`` (worker)   each tree's token is sampled from its root
                                                       row by vLLM's sampler (nothing accepted),
                                                       the walked requests' generators restored
                                                       first; they lose trees
harvest    the deferred learning (worker)              nothing more to do; its requests lose trees
grammar    ``TreeGrammars.prune`` (scheduler): a       the request's drafts are dropped (a plain
           structured-output tree pruned by its        step for it), its grammar as it was; it
           grammar                                     loses trees (the workers are told with the
                                                       step: ``tree_faults``)
=========  ==========================================  =========================================

``VLLM_ANISOTROPIC_INJECT_FAULT="stage@n[,stage@n...]"`` raises ``InjectedFault`` at the n-th
call of each named stage in every process that runs it (each once; ``@n`` omitted: the first).
Example: ``verify@5`` fails the fifth tree verification of each worker. Unset (the default),
``inject`` is one dict lookup.
"""

from __future__ import annotations

import logging
import os

__all__ = ["STAGES", "INJECT_ENV", "InjectedFault", "inject", "parse_injection", "report"]

STAGES = ("propose", "allocator", "verify", "harvest", "grammar")
INJECT_ENV = "VLLM_ANISOTROPIC_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised by ``inject`` where ``VLLM_ANISOTROPIC_INJECT_FAULT`` asks for it."""


def parse_injection(spec: str | None) -> dict[str, int]:
    """``"verify@5,propose"`` -> ``{"verify": 5, "propose": 1}``; a bad stage or count raises a
    ValueError naming the valid ones."""
    out: dict[str, int] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        stage, _, count = part.partition("@")
        if stage not in STAGES:
            raise ValueError(f"{INJECT_ENV}: unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")
        try:
            n = int(count) if count else 1
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{INJECT_ENV}: {part!r} needs a call count >= 1 after '@' (e.g. {stage}@3)")
        out[stage] = n
    return out


_pending: dict[str, int] | None = None  # stage -> calls left before its fault (read from the env once)


def inject(stage: str) -> None:
    """Raise ``InjectedFault`` if this is the call of ``stage`` the environment asks to fail."""
    global _pending
    if _pending is None:
        _pending = parse_injection(os.environ.get(INJECT_ENV))
    left = _pending.get(stage)
    if left is None:
        return
    if left > 1:
        _pending[stage] = left - 1
        return
    del _pending[stage]
    raise InjectedFault(f"fault injected in stage {stage!r} ({INJECT_ENV})")


_logged: set[str] = set()  # stages whose first fault was logged with its traceback


def report(logger: logging.Logger, stage: str, req_ids) -> None:
    """Log a contained fault of ``stage`` (inside the ``except``): the first of each stage with
    its traceback, later ones on one line."""
    message = ("vllm-anisotropic: the tree path failed in stage %r for requests %s; trees are off for them from now "
               "on (their outputs are plain decoding's)")
    if stage in _logged:
        logger.error(message, stage, list(req_ids))
    else:
        _logged.add(stage)
        logger.exception(message, stage, list(req_ids))
