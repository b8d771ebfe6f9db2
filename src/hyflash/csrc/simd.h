// AVX-512 helpers shared by the kernels: bf16 <-> fp32 and a vectorised exponential.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>

namespace hyflash {

using bf16 = at::BFloat16;

inline __m512 load16(const bf16* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// e^x for 16 floats (|error| ~1 ulp): e^x = 2^k * e^r with k = round(x / ln 2), |r| <= ln(2) / 2, a degree-6
// Taylor polynomial for e^r, and scalef for 2^k. Inputs below -87 (and -inf) give 0.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(~zero, _mm512_scalef_ps(p, k));
}

inline __m512 round_bf16(__m512 x) {  // to the nearest bf16 (ties to even) and back to fp32
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline void store16(bf16* p, __m512 x) {  // round to bf16 and store 16 values
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}


inline void add_into(bf16* h, const bf16* y, int64_t count) {  // h = bf16(h + y); count a multiple of 16
  for (int64_t e = 0; e < count; e += 16) store16(h + e, _mm512_add_ps(load16(h + e), load16(y + e)));
}

// The gated MLP's activation as torch computes it on bf16 tensors: silu(gate) rounded to bf16, times up, rounded
// to bf16. gate_up [rows, 2 * inter] (gate | up), out [rows, inter]; inter a multiple of 16.
inline void silu_mul(const bf16* gate_up, bf16* out, int64_t rows, int64_t inter) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t e = 0; e < inter; e += 16) {
      const __m512 g = load16(gate_up + i * 2 * inter + e);
      const __m512 neg = _mm512_sub_ps(_mm512_setzero_ps(), g);
      const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg))));
      store16(out + i * inter + e, _mm512_mul_ps(silu, load16(gate_up + i * 2 * inter + inter + e)));
    }
}

}  // namespace hyflash
