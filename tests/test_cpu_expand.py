"""vLLM's rejection sampler expands per-request parameters to draft rows (``platform_fixes/cpu_expand.py``,
patches.py patch 11).

vLLM 0.32's C++ replacement for ``expand_kernel`` writes int64 outputs only: a float32 temperature
or top-p of the draft rows stays uninitialised, and vLLM's own speculative methods verify sampled
requests against a wrong law on a CPU. What each test would catch: an expansion that puts a
request's value on another request's rows or an off-by-one row, a replacement (greedy temperature
0 -> 1) not applied or applied to every value, rows past the last request overwritten, int64
outputs no longer going to vLLM's function, the patch not installed, or installed after the
platform has registered its kernels (the rejection sampler's ``expand_batch_to_tokens`` would
return garbage). The engine side: ``test_engine_sampling.py::test_vllm_draft_model_verifies_sampled_drafts_against_the_requests_law``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_anisotropic.integration.vllm.platform_fixes.cpu_expand import expand_rows, expanding_any_dtype


def _reference(values, counts, replace_from, replace_to, length):
    out = [None] * length
    row = 0
    for value, count in zip(values, counts):
        for _ in range(count):
            out[row] = replace_to if value == replace_from else value
            row += 1
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32])
def test_each_request_value_lands_on_its_own_rows(dtype):
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        counts = torch.randint(0, 5, (batch,), generator=gen)
        if dtype.is_floating_point:
            values = (torch.rand(batch, generator=gen, dtype=torch.float64) * 2).to(dtype)
        else:
            values = torch.randint(1, 50, (batch,), generator=gen, dtype=dtype)
        values[torch.rand(batch, generator=gen) < 0.3] = 0  # greedy requests' temperature
        cu = torch.cumsum(counts, 0).to(torch.int32)
        length = int(counts.sum()) + 3  # rows past the last request: untouched
        out = torch.full((length,), -7, dtype=dtype)
        expand_rows(out, values, cu, 0, 1)
        expected = _reference(values.tolist(), counts.tolist(), 0, 1, length)
        expected = [-7 if e is None else e for e in expected]
        assert out.tolist() == pytest.approx(expected), (trial, counts.tolist(), values.tolist())


def test_worked_example():
    out = torch.empty(6)
    expand_rows(out, torch.tensor([0.7, 0.0, 1.5]), torch.tensor([2, 3, 6], dtype=torch.int32), 0, 1)
    assert out.tolist() == pytest.approx([0.7, 0.7, 1.0, 1.5, 1.5, 1.5])


def test_an_empty_batch_writes_nothing():
    out = torch.full((3,), -7.0)
    expand_rows(out, torch.empty(0), torch.empty(0, dtype=torch.int32), 0, 1)
    assert out.tolist() == [-7.0, -7.0, -7.0]


def test_int64_outputs_go_to_vllms_function():
    calls = []

    def original(*args):
        calls.append(args)

    fixed = expanding_any_dtype(original)
    out64 = torch.zeros(2, dtype=torch.int64)
    fixed(out64, torch.tensor([5]), torch.tensor([2]), 0, 0)
    assert len(calls) == 1 and calls[0][0] is out64 and out64.tolist() == [0, 0]  # vLLM's did the work (here: none)
    out32 = torch.zeros(2)
    fixed(out32, torch.tensor([0.5]), torch.tensor([2]), 0, 1, 8)
    assert len(calls) == 1 and out32.tolist() == [0.5, 0.5]


_WORKER_START = """
from vllm.platforms import current_platform
from vllm.utils import cpu_triton_utils
from vllm.v1.sample import rejection_sampler
import torch

from vllm_anisotropic.integration.vllm.frontdoor import patches

assert current_platform.is_cpu()
patches.apply()
assert getattr(cpu_triton_utils._expand_kernel_impl, patches._MARK, False), "patch 11 not installed"
current_platform.register_triton_kernel_overrides()
cu = torch.tensor([2, 2, 5], dtype=torch.int32)
temperature = rejection_sampler.expand_batch_to_tokens(torch.tensor([0.7123, 0.0, 0.0]), cu, 5, replace_from=0,
                                                       replace_to=1)
top_k = rejection_sampler.expand_batch_to_tokens(torch.tensor([3, 4, 5]), cu, 5)  # int64: vLLM's C++
print("ROWS", [round(t, 6) for t in temperature.tolist()], top_k.tolist())
"""


def test_patch_reaches_the_rejection_sampler():
    """What a CPU worker does at start, in a fresh interpreter as a worker is (vLLM's kernel
    registration scans every loaded module, and a test process holds modules a worker never
    loads): plugins first (patches.apply), then the platform's kernel replacements; the rejection
    sampler's float expansion then holds each request's value."""
    import subprocess
    import sys

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("patch 11 is for vLLM's CPU platform")
    done = subprocess.run([sys.executable, "-c", _WORKER_START], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = next(line for line in done.stdout.splitlines() if line.startswith("ROWS"))
    assert rows == "ROWS [0.7123, 0.7123, 1.0, 1.0, 1.0] [3, 3, 5, 5, 5]"
