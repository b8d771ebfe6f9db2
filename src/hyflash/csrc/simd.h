// The 16-lane fp32 vector the kernels are written in, for two builds (hyflash.kernels chooses by the CPU):
//   AVX-512 (the AMX and AVX-512 BF16 builds): one __m512 register, bf16 pair products by VDPBF16PS;
//   AVX2 + FMA (x86-64-v3 CPUs with neither, e.g. most laptops): two __m256 halves, each bf16 pair product as two
//   FMAs on the pair's widened halves (a product of two bf16 values is exact in fp32, so each FMA rounds once,
//   as an add would).
// Every operation is lane by lane or a fixed-order reduction, so an output element's sum never depends on how many
// rows are computed together: the property that makes verification bit-identical to a single step in either build.
// The two builds may round differently from each other (exponential, reductions); each is identical to itself.
#pragma once
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace hyflash {

using bf16 = at::BFloat16;

#ifdef __AVX512F__

using vf = __m512;
using vmask = __mmask16;

inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, rounded once
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline float vmaxall(vf x) { return _mm512_reduce_max_ps(x); }
inline float vfirst(vf x) { return _mm512_cvtss_f32(x); }
inline vf vmax_where(vf best, vmask m, vf x) { return _mm512_mask_max_ps(best, m, best, x); }  // lanes in m only
inline vf vkeep(vmask m, vf x) { return _mm512_maskz_mov_ps(m, x); }  // zero outside m
inline vf vload_first(const float* p, int n, float fill) {  // p[0..n), fill after (n <= 16)
  return _mm512_mask_loadu_ps(_mm512_set1_ps(fill), static_cast<__mmask16>((1u << n) - 1), p);
}

inline vf load16(const bf16* p) {  // 16 bf16 -> 16 fp32 (exact)
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline vf round_bf16(vf x) {  // to the nearest bf16 (ties to even) and back to fp32
  const __m256i b = (__m256i)_mm512_cvtneps_pbh(x);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

inline void store16(bf16* p, vf x) {  // round to bf16 and store 16 values
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}

// 16 pairs of bf16 (uint32 each, the even element in the low half) and the product with one broadcast pair
using vpairs = __m512i;
inline vpairs vload_pairs(const uint32_t* p) { return _mm512_loadu_si512(p); }
inline vf vdot_pair(vf c, uint32_t a, vpairs b) {  // c + a.even * b.even + a.odd * b.odd, lane by lane
  return _mm512_dpbf16_ps(c, (__m512bh)_mm512_set1_epi32(static_cast<int>(a)), (__m512bh)b);
}

// The rows of x as the matmul reads them: bf16 pairs as they are (one uint32 a pair)
using xpair = uint32_t;
constexpr int64_t kPairStep = 1;  // xpair elements per pair
inline const xpair* matmul_rows(const bf16* x, int64_t /*count*/, std::vector<float>& /*scratch*/) {
  return reinterpret_cast<const xpair*>(x);
}
inline vf vdot(vf c, const xpair* a, vpairs b) { return vdot_pair(c, *a, b); }

// 16 int8 codes -> 16 bf16 integers (exact: |code| <= 127 fits bf16's significand)
inline void widen16_q8(const int8_t* c, uint16_t* out) {
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(f));
}

#else  // AVX2 + FMA: two halves

struct vf {
  __m256 lo, hi;
};
using vmask = uint16_t;

inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vset(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
inline vf vadd(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vdiv(vf a, vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vf vmax(vf a, vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vf vfma(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }

inline float vsum(vf x) {  // the tree of GCC's _mm512_reduce_add_ps: halves, quarters, then (0 + 1) + (2 + 3)
  const __m256 h = _mm256_add_ps(x.lo, x.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
  s = _mm_add_ss(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(s);
}

inline float vmaxall(vf x) {
  const __m256 h = _mm256_max_ps(x.lo, x.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float vfirst(vf x) { return _mm256_cvtss_f32(x.lo); }

inline vf lanes(vmask m) {  // all-ones lanes where m's bit is set
  const __m256i bits_lo = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i bits_hi = _mm256_slli_epi32(bits_lo, 8);
  const __m256i mm = _mm256_set1_epi32(m);
  return {_mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(mm, bits_lo), bits_lo)),
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(mm, bits_hi), bits_hi))};
}

inline vf vmax_where(vf best, vmask m, vf x) {
  const vf l = lanes(m), mx = vmax(best, x);
  return {_mm256_blendv_ps(best.lo, mx.lo, l.lo), _mm256_blendv_ps(best.hi, mx.hi, l.hi)};
}

inline vf vkeep(vmask m, vf x) {
  const vf l = lanes(m);
  return {_mm256_and_ps(x.lo, l.lo), _mm256_and_ps(x.hi, l.hi)};
}

inline vf vload_first(const float* p, int n, float fill) {
  alignas(32) float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = i < n ? p[i] : fill;
  return vload(buf);
}

inline __m256 widen8(const bf16* p) {  // 8 bf16 -> 8 fp32 (exact)
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

inline vf load16(const bf16* p) { return {widen8(p), widen8(p + 8)}; }

// fp32 bits rounded to the nearest bf16 (ties to even), in the high halves; a NaN stays a quiet NaN
inline __m256i round8_bits(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
  return _mm256_and_si256(_mm256_blendv_epi8(r, quiet, nan), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
}

inline vf round_bf16(vf x) { return {_mm256_castsi256_ps(round8_bits(x.lo)), _mm256_castsi256_ps(round8_bits(x.hi))}; }

inline void store16(bf16* p, vf x) {
  const __m256i lo = _mm256_srli_epi32(round8_bits(x.lo), 16), hi = _mm256_srli_epi32(round8_bits(x.hi), 16);
  // packus works within 128-bit lanes: [lo0-3 hi0-3 | lo4-7 hi4-7]; the permute puts them in order
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

// 16 pairs of bf16, widened: the even elements (low halves) and the odd ones, as fp32
struct vpairs {
  vf even, odd;
};
inline vpairs vload_pairs(const uint32_t* p) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 8));
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(a, high)), _mm256_castsi256_ps(_mm256_and_si256(b, high))}};
}
// The rows of x as the matmul reads them on AVX2: widened to fp32 once per call (pair kp at 2 kp, 2 kp + 1), so
// that each product broadcasts its operand straight from memory
using xpair = float;
constexpr int64_t kPairStep = 2;
inline const xpair* matmul_rows(const bf16* x, int64_t count, std::vector<float>& scratch) {
  scratch.resize(count);
  for (int64_t i = 0; i < count; i += 16) vstore(scratch.data() + i, load16(x + i));
  return scratch.data();
}
// c + a.even * b.even + a.odd * b.odd lane by lane, a's pair already widened: the odd product first, as
// VDPBF16PS is specified
inline vf vdot(vf c, const xpair* a, const vpairs& b) {
  return vfma(vset(a[0]), b.even, vfma(vset(a[1]), b.odd, c));
}
inline vf vdot_pair(vf c, uint32_t a, const vpairs& b) {  // the same with a's pair as bf16 bits
  const uint32_t halves[2] = {a << 16, a & 0xFFFF0000u};
  float widened[2];
  std::memcpy(widened, halves, sizeof widened);
  return vdot(c, widened, b);
}

inline void widen16_q8(const int8_t* c, uint16_t* out) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes))), 16);
  const __m256i hi = _mm256_srli_epi32(
      _mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
}

#endif

// e^x for 16 floats (|error| ~1 ulp): e^x = 2^k * e^r with k = round(x / ln 2), |r| <= ln(2) / 2, a degree-6
// Taylor polynomial for e^r (below, shared), and 2^k applied exactly. Inputs below -87 (and -inf) give 0.
inline vf exp_poly(vf r) {  // e^r for |r| <= ln(2) / 2
  vf p = vset(1.f / 720);
  p = vfma(p, r, vset(1.f / 120));
  p = vfma(p, r, vset(1.f / 24));
  p = vfma(p, r, vset(1.f / 6));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.f));
  return vfma(p, r, vset(1.f));
}

#ifdef __AVX512F__
inline vf exp16(vf x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __mmask16 zero = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  return _mm512_maskz_mov_ps(~zero, _mm512_scalef_ps(exp_poly(r), k));
}
#else
// per half: the clamp, k and r as the AVX-512 build computes them; 2^k built in the exponent bits (k in
// [-126, 127] after the clamp), so p * 2^k is exact as scalef's is
inline __m256 exp_reduce(__m256 x, __m256& k, __m256& zero) {
  const __m256 lo = _mm256_set1_ps(-87.f);
  zero = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.f));
  k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  return _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
}

inline __m256 exp_scale(__m256 p, __m256 k, __m256 zero) {
  const __m256 two_k = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(zero, _mm256_mul_ps(p, two_k));
}

inline vf exp16(vf x) {
  __m256 k0, k1, z0, z1;
  const vf r = {exp_reduce(x.lo, k0, z0), exp_reduce(x.hi, k1, z1)};
  const vf p = exp_poly(r);
  return {exp_scale(p.lo, k0, z0), exp_scale(p.hi, k1, z1)};
}
#endif

inline void add_into(bf16* h, const bf16* y, int64_t count) {  // h = bf16(h + y); count a multiple of 16
  for (int64_t e = 0; e < count; e += 16) store16(h + e, vadd(load16(h + e), load16(y + e)));
}

// The gated MLP's activation as torch computes it on bf16 tensors: silu(gate) rounded to bf16, times up, rounded
// to bf16. gate_up [rows, 2 * inter] (gate | up), out [rows, inter]; inter a multiple of 16.
inline void silu_mul(const bf16* gate_up, bf16* out, int64_t rows, int64_t inter) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t e = 0; e < inter; e += 16) {
      const vf g = load16(gate_up + i * 2 * inter + e);
      const vf silu = round_bf16(vdiv(g, vadd(vset(1.f), exp16(vsub(vzero(), g)))));
      store16(out + i * inter + e, vmul(silu, load16(gate_up + i * 2 * inter + inter + e)));
    }
}

}  // namespace hyflash
