// A bf16 GEMM for a few query rows on x86 CPUs with AVX512-BF16 (an experiment of
// scripts/cpu_gemm_rows.py, not used by the package).
//
// out[M][N] = x[M][K] @ W[N][K]^T, bf16 in and out, float32 accumulation. W is packed once as
// [N/16][K/2][16][2]: for 16 outputs, each pair of K positions is one 64-byte vector, so one load
// feeds VDPBF16PS for every row (the row's K pair broadcast), and each weight byte is read once
// per call however many rows there are (up to 8; more rows are done 8 at a time). BLOCKS output
// blocks run side by side (more independent streams and accumulators), and the weights are
// prefetched PREFETCH pairs ahead. Each output's sum runs over K in order, so a row's result does
// not depend on the other rows (batch-invariant).
// Build: g++ -O3 -march=native -shared -fPIC gemm_bf16_rows.cpp -o libgemm_bf16_rows.so
#include <immintrin.h>
#include <stdint.h>

#ifndef BLOCKS
#define BLOCKS 4
#endif
#ifndef PREFETCH
#define PREFETCH 16
#endif

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

// N a multiple of 16, K even; x and out row-major and contiguous.
extern "C" void gemm_bf16_rows(const uint16_t* wp, const uint16_t* x, uint16_t* out, int M, int N, int K) {
  const uint32_t* xp = (const uint32_t*)x;
  const int K2 = K / 2;
  switch (M) {
    case 1: rows<1>(wp, xp, out, N, K2); break;
    case 2: rows<2>(wp, xp, out, N, K2); break;
    case 3: rows<3>(wp, xp, out, N, K2); break;
    case 4: rows<4>(wp, xp, out, N, K2); break;
    case 5: rows<5>(wp, xp, out, N, K2); break;
    case 6: rows<6>(wp, xp, out, N, K2); break;
    case 7: rows<7>(wp, xp, out, N, K2); break;
    case 8: rows<8>(wp, xp, out, N, K2); break;
    default:
      for (int m0 = 0; m0 < M; m0 += 8) {
        int mm = M - m0 < 8 ? M - m0 : 8;
        gemm_bf16_rows(wp, x + (size_t)m0 * K, out + (size_t)m0 * N, mm, N, K);
      }
  }
}
