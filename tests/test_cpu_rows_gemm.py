"""The rows GEMM kernel (cpu_rows_gemm.py) against vLLM's CPU GEMM and float32, and patch 8.

Which bugs these catch: a wrong packed layout or K pairing (the outputs would not match vLLM's
matmul at all), a remainder block dropped when N / 16 is not a multiple of the four side-by-side
blocks (the last outputs uninitialised), rows past 8 lost or mixed up (more than one pass),
a row's result depending on the other rows, and the patch routing a layer it must not (float32)
or not routing a bf16 one."""

import pytest
import torch

from vllm_anisotropic.cpu_rows_gemm import RowsGemm, pack, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=f"rows kernel: {unavailable_reason()}")


@pytest.fixture(scope="module")
def gemm():
    return RowsGemm()


def _vllm_linear(w: torch.Tensor):
    """vLLM's oneDNN matmul on a pre-packed weight: what it runs for these layers on CPUs without
    AMX (with AMX, weights under 1 MiB go to its sgl kernel instead; the patch leaves those alone)."""
    from vllm import _custom_ops as ops

    handler = ops.create_onednn_mm(w.t(), 32)
    return lambda x: ops.onednn_mm(handler, x, None)


# (N, K): N / 16 = 60, 36, 5 (a remainder after four blocks), 1; K = 576, 1536, 34
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (80, 34), (16, 576)])
def test_matches_vllms_gemm_and_float32(gemm, n, k):
    torch.manual_seed(n + k)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    packed = pack(w)
    ref_fn = _vllm_linear(w)
    for m in (1, 3, 8, 11, 17):
        x = torch.randn(m, k, dtype=torch.bfloat16)
        out = gemm(packed, x)
        exact = (x.float() @ w.float().T)
        ref = ref_fn(x)
        # one bf16 ulp of the exact result at most, and (nearly) vLLM's bits
        ulp = exact.abs().clamp(min=1e-30) * 2.0 ** -7
        assert ((out.float() - exact).abs() <= ulp).all(), (m, n, k)
        assert (out == ref).float().mean() > 0.999, (m, n, k)


def test_a_rows_result_does_not_depend_on_the_other_rows(gemm):
    torch.manual_seed(0)
    w = torch.randn(336, 128, dtype=torch.bfloat16)
    packed = pack(w)
    x = torch.randn(13, 128, dtype=torch.bfloat16)
    together = gemm(packed, x)
    for i in range(13):
        assert torch.equal(gemm(packed, x[i:i + 1]), together[i:i + 1])


def test_pack_refuses_shapes_it_cannot_take():
    with pytest.raises(ValueError, match="N % 16"):
        pack(torch.zeros(24, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        pack(torch.zeros(16, 8))


def test_patch_routes_bf16_layers_and_keeps_vllms_matmul_past_the_row_limit(monkeypatch):
    from vllm.model_executor.layers import utils

    from vllm_anisotropic.integration.vllm.frontdoor import patches

    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", utils.dispatch_cpu_unquantized_gemm)
    monkeypatch.setenv(patches.CPU_GEMM_ENV, "rows")
    patches._patch_cpu_gemm()
    torch.manual_seed(1)
    # 2 MiB of bf16: above vLLM's 1 MiB limit for its small-weight AMX kernel, so routed on every CPU
    bf16 = torch.nn.Linear(1024, 1024, bias=True).to(torch.bfloat16)
    small = torch.nn.Linear(64, 96, bias=False).to(torch.bfloat16)  # AMX CPUs: vLLM's sgl kernel keeps it
    f32 = torch.nn.Linear(64, 96, bias=False)
    w = bf16.weight.data.clone()
    for layer in (bf16, small):
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    utils.dispatch_cpu_unquantized_gemm(f32, remove_weight=False)
    assert bf16.weight.numel() == 0  # vLLM's own dispatch ran (and dropped the weight)
    calls = []
    real = RowsGemm.__call__
    monkeypatch.setattr(RowsGemm, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    f32.cpu_linear(torch.randn(2, 64), f32.weight, None)
    assert not calls  # float32 layers keep vLLM's kernel
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        small.cpu_linear(torch.randn(2, 64, dtype=torch.bfloat16), small.weight, None)
        assert len(calls) == (0 if utils.check_cpu_sgl_kernel(96, 64, torch.bfloat16) else 1)
        calls.clear()
        for n_threads, m in [(1, 1), (1, 4), (1, patches.ROWS_MAX), (1, patches.ROWS_MAX + 1), (1, 40), (2, 4)]:
            torch.set_num_threads(n_threads)
            x = torch.randn(m, 1024, dtype=torch.bfloat16)
            out = bf16.cpu_linear(x, bf16.weight, bf16.bias)
            exact = x.float() @ w.float().T + bf16.bias.float()
            assert out.shape == (m, 1024)
            assert (out.float() - exact).abs().max() <= 0.05 * exact.abs().max(), m
    finally:
        torch.set_num_threads(threads)
    # the rows kernel for 1, 4 and ROWS_MAX rows on one thread; vLLM's matmul past the row limit
    # and with two threads
    assert len(calls) == 3
    # the registry does not keep a freed layer's packed weight
    import gc

    before = len(patches._ROWS_LAYERS)
    del bf16
    gc.collect()
    assert len(patches._ROWS_LAYERS) == before - 1


_ENGINE_SCRIPT = r"""
import json, sys
from vllm_anisotropic.cpu_rows_gemm import RowsGemm
rows_seen = []
real = RowsGemm.__call__
RowsGemm.__call__ = lambda self, packed, x, out=None: rows_seen.append(int(x.shape[0])) or real(self, packed, x, out)

def main():
    from vllm import LLM, SamplingParams
    from vllm_anisotropic.integration.vllm.frontdoor import patches
    fallback_rows = []
    llm = LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=512, max_num_seqs=2, seed=0,
              gpu_memory_utilization=0.2, speculative_config={"method": "goose", "budget": 8, "allocator": "off"})
    for entry in list(patches._ROWS_LAYERS.values()):
        entry.fallback = lambda x, w, b, _fb=entry.fallback: fallback_rows.append(x.reshape(-1, x.shape[-1]).shape[0]) or _fb(x, w, b)
    rows_seen.clear()
    out = llm.generate(sys.argv[2:], SamplingParams(temperature=0, max_tokens=24))
    print(json.dumps({"layers": len(patches._ROWS_LAYERS), "rows": rows_seen, "fallback": fallback_rows,
                      "tokens": [len(o.outputs[0].token_ids) for o in out]}))

if __name__ == "__main__":
    main()
"""


def test_engine_runs_tree_steps_through_the_kernel(tiny_model_dir, tiny_prompts, tmp_path):
    """Real vLLM (bf16, GOOSE B = 8, in-process engine, one thread) with the switch on: every
    linear of every step up to ROWS_MAX rows goes through the kernel, tree steps included (calls
    with several rows), and only longer steps (the prompts' prefill) take vLLM's matmul."""
    import json
    import os
    import subprocess
    import sys

    from vllm_anisotropic.integration.vllm.frontdoor.patches import CPU_GEMM_ENV, ROWS_MAX

    script = tmp_path / "engine_rows.py"
    script.write_text(_ENGINE_SCRIPT)
    env = {**os.environ, CPU_GEMM_ENV: "rows", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir), *tiny_prompts[:2]], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["layers"] > 0 and res["tokens"] == [24, 24]
    assert res["rows"] and max(res["rows"]) <= ROWS_MAX
    assert max(res["rows"]) > 2, "no tree step went through the kernel"
    assert all(r > ROWS_MAX for r in res["fallback"]), res["fallback"][:10]


def test_a_failed_build_leaves_vllms_kernels_in_place(monkeypatch, caplog):
    from vllm.model_executor.layers import utils

    from vllm_anisotropic.integration.vllm.frontdoor import patches

    original = utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setattr(utils, "dispatch_cpu_unquantized_gemm", original)
    monkeypatch.setattr(patches, "_rows_linear_op", lambda: (_ for _ in ()).throw(RuntimeError("g++ said no")))
    with caplog.at_level("WARNING", logger=patches.logger.name):
        patches._patch_cpu_gemm()
    assert utils.dispatch_cpu_unquantized_gemm is original
    assert "g++ said no" in caplog.text
