"""Seeded requests' CPU generators (``platform_fixes/cpu_generators.py``, patches.py patch 10).

vLLM 0.32 undoes a dropped chunked-prefill sample with ``gen.set_offset(gen.get_offset() - 4)``,
which raises on a CPU generator. What each test would catch: a rewind that restores a state
other than the step's first (the request's next token would be drawn from the wrong place), one
that undoes nothing (the stream shifts by one draw per dropped chunk), one that accepts an
offset vLLM never asks for (two steps back, or twice), a copy that loses the seed or the state,
and the patch not installed, the step not marked, or a generator marked whose sample is kept. The engine side (chunked prompts, plain
decoding and trees): ``test_engine_sampling.py::test_seeded_requests_draw_the_same_tokens_in_chunked_prefill``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.platform_fixes.cpu_generators import StepRewindGenerator, rewindable


def _seeded(seed: int) -> torch.Generator:
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def test_a_copy_draws_what_its_source_draws():
    source = _seeded(1234)
    torch.rand(5, generator=source)  # not at the seed's start
    copy = StepRewindGenerator.copy_of(source)
    assert copy.initial_seed() == 1234
    assert torch.equal(torch.randint(0, 2**31, (8,), generator=copy), torch.randint(0, 2**31, (8,), generator=source))
    assert torch.equal(torch.empty(6).exponential_(generator=copy), torch.empty(6).exponential_(generator=source))


@pytest.mark.parametrize("draws_in_step", [1, 3])
def test_undoing_a_step_restores_its_first_state(draws_in_step):
    gen, reference = StepRewindGenerator.copy_of(_seeded(7)), _seeded(7)
    # two kept steps, each one draw, as in decoding
    for _ in range(2):
        gen.mark()
        assert torch.equal(torch.rand(1, generator=gen), torch.rand(1, generator=reference))
    # a step whose sample is dropped: vLLM's rewind
    gen.mark()
    for _ in range(draws_in_step):
        torch.randint(0, 2**31, (1,), generator=gen)
    gen.set_offset(gen.get_offset() - 4)
    assert gen.get_offset() == 8
    # the next step draws what the dropped step drew: the reference never drew it
    gen.mark()
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=reference))


def test_two_dropped_steps_in_a_row_draw_from_the_same_state():
    gen, reference = StepRewindGenerator.copy_of(_seeded(11)), _seeded(11)
    for _ in range(2):  # a prompt in three chunks: two dropped samples
        gen.mark()
        torch.rand(1, generator=gen)
        gen.set_offset(gen.get_offset() - 4)
    gen.mark()
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=reference))


def test_only_the_last_step_can_be_undone():
    gen = StepRewindGenerator.copy_of(_seeded(3))
    with pytest.raises(RuntimeError, match=r"set_offset\(-4\).*no step has been marked"):
        gen.set_offset(gen.get_offset() - 4)
    gen.mark()
    gen.mark()
    with pytest.raises(RuntimeError, match=r"set_offset\(0\): only the last sampling step can be undone, "
                                           r"set_offset\(4\) \(get_offset\(\) is 8\)"):
        gen.set_offset(gen.get_offset() - 8)
    gen.set_offset(4)
    with pytest.raises(RuntimeError, match="no step has been marked"):  # twice: the state before is gone
        gen.set_offset(0)


def test_rewindable_converts_plain_cpu_generators_only():
    assert rewindable(None) is None
    gen = rewindable(_seeded(5))
    assert isinstance(gen, StepRewindGenerator) and gen.initial_seed() == 5
    assert rewindable(gen) is gen
    if torch.cuda.is_available():
        cuda = torch.Generator(device="cuda")
        assert rewindable(cuda) is cuda


def test_patch_converts_added_requests_and_marks_each_sampling_step():
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_input_batch import InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_anisotropic.integration.vllm.frontdoor import patches

    patches.apply()  # what plugin.register() does in every vLLM process; on this CPU it installs patch 10
    assert getattr(InputBatch.add_request, patches._MARK, False)
    assert getattr(GPUModelRunner._sample, patches._MARK, False)

    # add_request: the request's own cached state gets the converted generator
    request = SimpleNamespace(generator=_seeded(9))
    with pytest.raises(AttributeError):  # the stand-in request is not vLLM's; the conversion ran first
        InputBatch.add_request(object.__new__(InputBatch), request)
    assert isinstance(request.generator, StepRewindGenerator)

    # _sample: the generators of the requests whose sample vLLM will drop are marked before it
    # samples; the others are left untouched
    import numpy as np

    gens = {i: StepRewindGenerator.copy_of(_seeded(i)) for i in (0, 2, 3)}
    mask = SimpleNamespace(np=np.array([True, True, False, True, True]))  # row 4: not a request
    runner = SimpleNamespace(input_batch=SimpleNamespace(generators=gens, num_reqs=4), discard_request_mask=mask)
    with pytest.raises(AttributeError):  # the stand-in runner has no sampler; the marks came first
        GPUModelRunner._sample(runner, None, None)
    assert [gens[i].get_offset() for i in (0, 2, 3)] == [4, 0, 4]
