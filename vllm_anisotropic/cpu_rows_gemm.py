"""A bf16 GEMM for a few query rows on x86 CPUs with AVX512-BF16 (experimental, opt-in).

Why: on the 2-core Xeon of docs/allocator.md vLLM's CPU GEMM (a oneDNN matmul on a pre-packed
weight) pays for every query row in arithmetic: the linears of a 4-row SmolLM2 step cost 1.27x
a 1-row step's, and that per-row cost is what caps one request's speedup from speculation. This
kernel reads each weight once per call whatever the rows: the weight is packed as
``[N/16][K/2][16][2]``, so one 64-byte load holds 16 outputs x 2 K positions and feeds
VDPBF16PS for every row (the row's K pair broadcast); four output blocks run side by side and
the weight is prefetched ahead. Up to 8 rows at a time (more rows: 8 at a time, re-reading the
weights). Each output sums over K in order in float32, so a row's result does not depend on
the other rows (batch-invariant), and matches oneDNN's bit for bit in ~99.996 % of outputs
(the rest one bf16 ulp apart). One thread.

Timed alone on that machine (``scripts/cpu_gemm_rows.py --rows-kernel``): 0.79x vLLM's time at
one row, 0.71x at four, 0.66x at eight. It is an engine speed-up (plain decoding gains as much
as trees); ``integration/vllm/frontdoor/patches.py`` routes vLLM's linear layers through it only when
``VLLM_ANISOTROPIC_CPU_GEMM=rows`` is set.

Built on first use with the system's g++ into the cache directory (keyed by the source's
hash; an atomic rename, so concurrent workers do not race) and called through ctypes. No vLLM
import here.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["SOURCE", "ROWS_PER_PASS", "unavailable_reason", "pack", "RowsGemm"]

logger = logging.getLogger(__name__)

ROWS_PER_PASS = 8

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

#define BLOCKS 4
#define PREFETCH 16

template <int M, int B>
static void blocks(const uint16_t* __restrict wp, const uint32_t* __restrict xp, uint16_t* __restrict out,
                   int N, int K2, int nb0, int nb1) {
  int nb = nb0;
  for (; nb + B <= nb1; nb += B) {
    __m512 acc[B][M];
    const uint16_t* w[B];
    for (int b = 0; b < B; ++b) {
      w[b] = wp + (size_t)(nb + b) * K2 * 32;
      for (int m = 0; m < M; ++m) acc[b][m] = _mm512_setzero_ps();
    }
    for (int k2 = 0; k2 < K2; ++k2) {
      __m512i wv[B];
      for (int b = 0; b < B; ++b) {
        _mm_prefetch((const char*)(w[b] + (size_t)(k2 + PREFETCH) * 32), _MM_HINT_T0);
        wv[b] = _mm512_loadu_si512((const void*)(w[b] + (size_t)k2 * 32));
      }
      for (int m = 0; m < M; ++m) {
        __m512i xb = _mm512_set1_epi32((int)xp[(size_t)m * K2 + k2]);
        for (int b = 0; b < B; ++b) acc[b][m] = _mm512_dpbf16_ps(acc[b][m], (__m512bh)wv[b], (__m512bh)xb);
      }
    }
    for (int b = 0; b < B; ++b)
      for (int m = 0; m < M; ++m)
        _mm256_storeu_si256((__m256i*)(out + (size_t)m * N + (nb + b) * 16), (__m256i)_mm512_cvtneps_pbh(acc[b][m]));
  }
  if (nb < nb1) blocks<M, 1>(wp, xp, out, N, K2, nb, nb1);
}

template <int M>
static void rows(const uint16_t* wp, const uint32_t* xp, uint16_t* out, int N, int K2) {
  blocks<M, BLOCKS>(wp, xp, out, N, K2, 0, N / 16);
}

// out[M][N] = x[M][K] @ W^T; wp = W packed [N/16][K/2][16][2]; N % 16 == 0, K even; row-major.
extern "C" void gemm_bf16_rows(const uint16_t* wp, const uint16_t* x, uint16_t* out, int M, int N, int K) {
  const int K2 = K / 2;
  for (int m0 = 0; m0 < M; m0 += 8) {
    const int mm = M - m0 < 8 ? M - m0 : 8;
    const uint32_t* xp = (const uint32_t*)(x + (size_t)m0 * K);
    uint16_t* o = out + (size_t)m0 * N;
    switch (mm) {
      case 1: rows<1>(wp, xp, o, N, K2); break;
      case 2: rows<2>(wp, xp, o, N, K2); break;
      case 3: rows<3>(wp, xp, o, N, K2); break;
      case 4: rows<4>(wp, xp, o, N, K2); break;
      case 5: rows<5>(wp, xp, o, N, K2); break;
      case 6: rows<6>(wp, xp, o, N, K2); break;
      case 7: rows<7>(wp, xp, o, N, K2); break;
      default: rows<8>(wp, xp, o, N, K2); break;
    }
  }
}
"""

FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC"]


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"an x86-64 CPU is needed (this is {platform.machine()})"
    if not torch.cpu._is_avx512_bf16_supported():
        return "the CPU has no AVX512-BF16"
    if shutil.which("g++") is None:
        return "no g++ on PATH to build it"
    return None


def _cache_dir() -> Path:
    base = os.environ.get("VLLM_ANISOTROPIC_CACHE") or Path.home() / ".cache" / "vllm-anisotropic"
    return Path(base) / "kernels"


def build() -> Path:
    """The shared library, built once per source and flags (cached)."""
    digest = hashlib.sha256((SOURCE + " ".join(FLAGS)).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"gemm_bf16_rows_{digest}.so"
    if lib.is_file():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src = Path(tmp, "gemm_bf16_rows.cpp")
        src.write_text(SOURCE)
        out = Path(tmp, lib.name)
        proc = subprocess.run(["g++", *FLAGS, str(src), "-o", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"building the rows GEMM kernel failed (g++ {' '.join(FLAGS)}):\n{proc.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: a concurrent builder's copy is the same bytes
    logger.info("built the rows GEMM kernel: %s", lib)
    return lib


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` bf16 -> the kernel's ``[N/16][K/2][16][2]`` layout (a new contiguous tensor)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or n % 16 or k % 2:
        raise ValueError(f"the rows kernel needs a bf16 [N, K] weight with N % 16 == 0 and K even, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    return weight.detach().reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


class RowsGemm:
    """``y = x @ W^T`` for bf16 ``x [M, K]`` and a ``pack``-ed ``W`` (M rows, any count)."""

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(f"the rows GEMM kernel cannot run here: {reason}")
        self._fn = ctypes.CDLL(str(build())).gemm_bf16_rows
        self._fn.restype = None
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]

    def __call__(self, packed: torch.Tensor, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        m, k = x.shape
        n = packed.shape[0] * 16
        if x.dtype != torch.bfloat16 or packed.shape[1] * 2 != k:
            raise ValueError(f"x must be bf16 [M, {packed.shape[1] * 2}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        if out is None:
            out = torch.empty(m, n, dtype=torch.bfloat16)
        self._fn(packed.data_ptr(), x.data_ptr(), out.data_ptr(), m, n, k)
        return out
