"""The private vLLM surface check (``integration/vllm/frontdoor/vllm_surface.py``) against the installed
vLLM, and that a changed surface is refused with every mismatch named.

What each test would catch: a list that names something vLLM 0.32 does not have (the check
would refuse every start); a check that passes a renamed parameter, a removed method, a removed
dataclass field or a runner attribute that is gone (the failure it exists for)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_anisotropic.integration.vllm.frontdoor import vllm_surface
from vllm_anisotropic.integration.vllm.frontdoor.vllm_surface import VllmSurfaceError, check_runner, surface_problems


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_installed_vllm_has_the_surface(platform):
    assert surface_problems(platform) == []


def test_a_changed_signature_is_refused_naming_it(monkeypatch):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(Scheduler, "update_from_output", lambda self, output, runner_output: None)
    monkeypatch.delattr(GPUModelRunner, "_prepare_inputs")
    problems = surface_problems("cuda")
    assert len(problems) == 2, problems
    assert any("Scheduler.update_from_output: expected parameters ('self', 'scheduler_output', 'model_runner_output'), "
               "found ('self', 'output', 'runner_output')" in p for p in problems)
    assert any("GPUModelRunner._prepare_inputs: missing" in p for p in problems)
    vllm_surface.check_vllm_surface.cache_clear()
    try:
        with pytest.raises(VllmSurfaceError, match=r"does not have the surface(.|\n)*_prepare_inputs"):
            vllm_surface.check_vllm_surface("cuda")
    finally:
        vllm_surface.check_vllm_surface.cache_clear()


def test_a_removed_field_is_refused(monkeypatch):
    monkeypatch.setitem(vllm_surface.FIELDS, "vllm.v1.outputs:DraftTokenIds", ("req_ids", "tree_probs"))
    assert surface_problems("cpu") == ["vllm.v1.outputs:DraftTokenIds: missing dataclass field(s) ['tree_probs']"]


def test_runner_attributes():
    batch = SimpleNamespace(req_ids=[], num_reqs=0, num_computed_tokens_cpu=None, num_tokens_no_spec=None,
                            token_ids_cpu=None, req_id_to_index={}, block_table=None, logitsprocs=None,
                            sampling_metadata=None)
    runner = SimpleNamespace(drafter=None, rejection_sampler=SimpleNamespace(sampler=None), input_batch=batch,
                             query_start_loc=None, positions=None, requests={}, uses_mrope=False,
                             scheduler_config=None, model_config=None, speculative_config=None,
                             compilation_config=SimpleNamespace(static_forward_context={}))
    check_runner(runner)
    del batch.token_ids_cpu
    with pytest.raises(VllmSurfaceError, match=r"missing attribute\(s\) \['input_batch.token_ids_cpu'\]"):
        check_runner(runner)
