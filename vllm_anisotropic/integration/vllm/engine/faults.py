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
ranks      tensor parallelism: the ranks disagree      each such tree's token sampled from its
           (``agree``), after a fault on one rank      root row on every rank (``verify``'s
           only (another rank's propose / harvest      fallback); its request loses trees on
           left it without this tree, or its verify    every rank. The faulting rank also counts
           raised)                                     its own stage
=========  ==========================================  =========================================

Tensor parallelism: every rank drafts and verifies with its own code on the same inputs, so a
fault that comes from the inputs is every rank's at once; one on a single rank (its own host
memory, say) would leave that rank with no tree, or another tree, for the drafts the scheduler
took from rank 0, or with other tokens than its peers. Each tree step the ranks therefore agree
(``agree``: one all-reduce of a flag per batch row on the group's CPU communicator, after the
verification, before anything is emitted or learned): a tree that any rank lacks, and every
tree of a step whose verification raised on any rank, is verified by no rank. The drafts of
such a tree were still scheduled; only their rows are wasted (their K/V is rolled back).

``VLLM_ANISOTROPIC_INJECT_FAULT="stage@n[:rankR][,...]"`` raises ``InjectedFault`` at the n-th
call of each named stage in every process that runs it (each once; ``@n`` omitted: the first),
or with ``:rankR`` in tensor-parallel rank R's worker only (the worker stages: ``propose``,
``verify``, ``harvest``; the scheduler's run in one process for all ranks). Examples:
``verify@5`` fails the fifth tree verification of each worker, ``propose@3:rank1`` the third
proposal of rank 1 alone. Unset (the default), ``inject`` is one dict lookup.
"""

from __future__ import annotations

import logging
import os

import numpy as np

__all__ = ["STAGES", "INJECT_ENV", "InjectedFault", "inject", "parse_injection", "report", "agree", "tp_group",
           "tp_rank", "tp_size"]

STAGES = ("propose", "allocator", "verify", "harvest", "grammar")
WORKER_STAGES = ("propose", "verify", "harvest")  # run by every tensor-parallel rank (a rank qualifier applies)
INJECT_ENV = "VLLM_ANISOTROPIC_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised by ``inject`` where ``VLLM_ANISOTROPIC_INJECT_FAULT`` asks for it."""


def parse_injection(spec: str | None, rank: int = 0) -> dict[str, int]:
    """``"verify@5,propose"`` -> ``{"verify": 5, "propose": 1}``: the faults of the process whose
    tensor-parallel rank is ``rank`` (an entry with ``:rankR`` only where R is ``rank``:
    ``"propose@3:rank1"`` -> ``{}`` on rank 0, ``{"propose": 3}`` on rank 1). A bad stage,
    count or rank raises a ValueError naming the valid ones."""
    out: dict[str, int] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        head, _, qualifier = part.partition(":")
        stage, _, count = head.partition("@")
        if stage not in STAGES:
            raise ValueError(f"{INJECT_ENV}: unknown stage {stage!r}; valid stages: {', '.join(STAGES)}")
        try:
            n = int(count) if count else 1
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{INJECT_ENV}: {part!r} needs a call count >= 1 after '@' (e.g. {stage}@3)")
        if qualifier:
            if not qualifier.startswith("rank") or not qualifier[4:].isdigit():
                raise ValueError(f"{INJECT_ENV}: {part!r}: after ':' a tensor-parallel rank, e.g. {head}:rank1")
            if stage not in WORKER_STAGES:
                raise ValueError(f"{INJECT_ENV}: {part!r}: stage {stage!r} runs in the scheduler, for all ranks at "
                                 f"once; a rank applies to the worker stages: {', '.join(WORKER_STAGES)}")
            if int(qualifier[4:]) != rank:
                continue
        out[stage] = n
    return out


_pending: dict[str, int] | None = None  # stage -> calls left before its fault (read from the env once)


def inject(stage: str) -> None:
    """Raise ``InjectedFault`` if this is the call of ``stage`` the environment asks to fail."""
    global _pending
    if _pending is None:
        spec = os.environ.get(INJECT_ENV)
        _pending = parse_injection(spec, tp_rank() if spec and ":" in spec else 0)
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


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed setup)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no process group yet / not distributed
        return 0


def tp_size() -> int:
    """The tensor-parallel world size (1 outside a distributed setup)."""
    try:
        from vllm.distributed import get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001 - no process group yet / not distributed
        return 1


def tp_group():
    """vLLM's tensor-parallel group coordinator, or None with one rank."""
    if tp_size() <= 1:
        return None
    from vllm.distributed.parallel_state import get_tp_group

    return get_tp_group()


def agree(flags: np.ndarray, group) -> np.ndarray:
    """Element-wise OR of the bool ``flags`` over the ranks of vLLM's ``group`` (every rank
    calls it at the same point of the same step, with flags of the same length): one sum
    all-reduce through vLLM's own communicator on the group's device (CPU: shared memory), as
    each layer of a TP forward runs two of (0.5-0.9 ms median at two ranks on a 2-core EPYC,
    no faster over gloo: docs/measurements/cpu/agree_cost_2026_11_29.txt)."""
    import torch

    t = torch.from_numpy(flags.astype(np.float32)).to(group.device)
    return group.all_reduce(t).cpu().numpy() > 0
