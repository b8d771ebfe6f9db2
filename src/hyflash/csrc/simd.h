// The 16-lane fp32 vector the kernels are written in, for three kinds of build (hyflash.kernels chooses by the CPU):
//   AVX-512 (the AMX and AVX-512 BF16 builds): one __m512 register, bf16 pair products by VDPBF16PS;
//   AVX2 + FMA (x86-64-v3 CPUs with neither, e.g. most laptops): two __m256 halves, each bf16 pair product as two
//   FMAs on the pair's widened halves (a product of two bf16 values is exact in fp32, so each FMA rounds once,
//   as an add would);
//   NEON (AArch64: phones, Apple silicon, Arm servers): four float32x4_t quarters, pair products as on AVX2, and
//   every other operation as the AVX2 build does it (its max keeps x86's rule for NaN: the second operand), so the
//   two agree bit for bit.
// Every operation is lane by lane or a fixed-order reduction, so an output element's sum never depends on how many
// rows are computed together: the property that makes verification bit-identical to a single step in every build.
// The builds may round differently from each other (the AVX-512 exponential); each is identical to itself.
#pragma once
#include <ATen/ATen.h>
#if defined(__x86_64__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
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

#elif defined(__AVX2__) && defined(__FMA__)  // AVX2 + FMA: two halves

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

inline float vsum(vf x) {  // the tree of GCC's _mm512_reduce_add_ps: halves, quarters, then (0 + 2) + (1 + 3)
  const __m256 h = _mm256_add_ps(x.lo, x.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));  // lanes 0 + 2, 1 + 3
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
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
inline void widen16_q8(const int8_t* c, uint16_t* out) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes))), 16);
  const __m256i hi = _mm256_srli_epi32(
      _mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8)))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
}

#elif defined(__ARM_NEON)  // AArch64 NEON: four quarters, each operation as the AVX2 build does it

struct vf {
  float32x4_t q[4];  // lanes 0-3, 4-7, 8-11, 12-15
};
using vmask = uint16_t;

template <class F>
inline vf each(vf a, vf b, F f) { return {{f(a.q[0], b.q[0]), f(a.q[1], b.q[1]), f(a.q[2], b.q[2]), f(a.q[3], b.q[3])}}; }
// x86's max and min: the first operand when it is greater (less), else the second, so a NaN gives the second operand
inline float32x4_t max_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
inline float32x4_t min_x86(float32x4_t a, float32x4_t b) { return vbslq_f32(vcltq_f32(a, b), a, b); }

inline vf vset(float x) { const float32x4_t s = vdupq_n_f32(x); return {{s, s, s, s}}; }
inline vf vzero() { return vset(0.f); }
inline vf vload(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline void vstore(float* p, vf x) { for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, x.q[i]); }
inline vf vadd(vf a, vf b) { return each(a, b, [](float32x4_t u, float32x4_t v) { return vaddq_f32(u, v); }); }
inline vf vsub(vf a, vf b) { return each(a, b, [](float32x4_t u, float32x4_t v) { return vsubq_f32(u, v); }); }
inline vf vmul(vf a, vf b) { return each(a, b, [](float32x4_t u, float32x4_t v) { return vmulq_f32(u, v); }); }
inline vf vdiv(vf a, vf b) { return each(a, b, [](float32x4_t u, float32x4_t v) { return vdivq_f32(u, v); }); }
inline vf vmax(vf a, vf b) { return each(a, b, max_x86); }
inline vf vfma(vf a, vf b, vf c) {  // a * b + c, rounded once
  return {{vfmaq_f32(c.q[0], a.q[0], b.q[0]), vfmaq_f32(c.q[1], a.q[1], b.q[1]), vfmaq_f32(c.q[2], a.q[2], b.q[2]),
           vfmaq_f32(c.q[3], a.q[3], b.q[3])}};
}

inline float vsum(vf x) {  // the AVX2 build's tree: halves (lane i + lane i + 8), quarters, then (0 + 2) + (1 + 3)
  const float32x4_t s = vaddq_f32(vaddq_f32(x.q[0], x.q[2]), vaddq_f32(x.q[1], x.q[3]));
  return (vgetq_lane_f32(s, 0) + vgetq_lane_f32(s, 2)) + (vgetq_lane_f32(s, 1) + vgetq_lane_f32(s, 3));
}

inline float vmaxall(vf x) {  // the AVX2 build's tree, with its max
  const float32x4_t s = max_x86(max_x86(x.q[0], x.q[2]), max_x86(x.q[1], x.q[3]));
  const float32x4_t t = max_x86(s, vcombine_f32(vget_high_f32(s), vget_high_f32(s)));  // (0, 2), (1, 3)
  return vgetq_lane_f32(max_x86(t, vdupq_n_f32(vgetq_lane_f32(t, 1))), 0);
}

inline float vfirst(vf x) { return vgetq_lane_f32(x.q[0], 0); }

inline uint32x4_t lanes(vmask m, int quarter) {  // all-ones lanes of that quarter where m's bit is set
  const uint32_t bits[4] = {1, 2, 4, 8};
  return vtstq_u32(vdupq_n_u32((m >> (4 * quarter)) & 0xFu), vld1q_u32(bits));
}

inline vf vmax_where(vf best, vmask m, vf x) {
  vf out;
  for (int i = 0; i < 4; ++i) out.q[i] = vbslq_f32(lanes(m, i), max_x86(best.q[i], x.q[i]), best.q[i]);
  return out;
}

inline vf vkeep(vmask m, vf x) {
  vf out;
  for (int i = 0; i < 4; ++i) out.q[i] = vreinterpretq_f32_u32(vandq_u32(lanes(m, i), vreinterpretq_u32_f32(x.q[i])));
  return out;
}

inline float32x4_t widen4(const bf16* p) {  // 4 bf16 -> 4 fp32 (exact)
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
}

inline vf load16(const bf16* p) { return {{widen4(p), widen4(p + 4), widen4(p + 8), widen4(p + 12)}}; }

// fp32 bits rounded to the nearest bf16 (ties to even), in the high halves; a NaN stays a quiet NaN
inline uint32x4_t round4_bits(float32x4_t x) {
  const uint32x4_t u = vreinterpretq_u32_f32(x);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(u, vaddq_u32(odd, vdupq_n_u32(0x7FFF)));
  const uint32x4_t number = vceqq_f32(x, x);
  const uint32x4_t quiet = vorrq_u32(u, vdupq_n_u32(0x00400000));
  return vandq_u32(vbslq_u32(number, r, quiet), vdupq_n_u32(0xFFFF0000u));
}

inline vf round_bf16(vf x) {
  vf out;
  for (int i = 0; i < 4; ++i) out.q[i] = vreinterpretq_f32_u32(round4_bits(x.q[i]));
  return out;
}

inline void store16(bf16* p, vf x) {
  auto* out = reinterpret_cast<uint16_t*>(p);
  for (int i = 0; i < 4; i += 2)
    vst1q_u16(out + 4 * i, vcombine_u16(vshrn_n_u32(round4_bits(x.q[i]), 16), vshrn_n_u32(round4_bits(x.q[i + 1]), 16)));
}

// 16 pairs of bf16, widened: the even elements (low halves) and the odd ones, as fp32
struct vpairs {
  vf even, odd;
};
inline vpairs vload_pairs(const uint32_t* p) {
  vpairs b;
  for (int i = 0; i < 4; ++i) {
    const uint32x4_t a = vld1q_u32(p + 4 * i);
    b.even.q[i] = vreinterpretq_f32_u32(vshlq_n_u32(a, 16));
    b.odd.q[i] = vreinterpretq_f32_u32(vandq_u32(a, vdupq_n_u32(0xFFFF0000u)));
  }
  return b;
}

inline void widen16_q8(const int8_t* c, uint16_t* out) {  // int8 -> fp32 (exact) -> its high half (exact in bf16)
  const int8x16_t codes = vld1q_s8(c);
  const int16x8_t w[2] = {vmovl_s8(vget_low_s8(codes)), vmovl_s8(vget_high_s8(codes))};
  for (int h = 0; h < 2; ++h) {
    const float32x4_t lo = vcvtq_f32_s32(vmovl_s16(vget_low_s16(w[h]))), hi = vcvtq_f32_s32(vmovl_s16(vget_high_s16(w[h])));
    vst1q_u16(out + 8 * h, vcombine_u16(vshrn_n_u32(vreinterpretq_u32_f32(lo), 16), vshrn_n_u32(vreinterpretq_u32_f32(hi), 16)));
  }
}

#else
#error "hyflash kernels: need AVX-512, AVX2 with FMA, or NEON"
#endif

#ifndef __AVX512F__  // AVX2 and NEON alike
inline vf vload_first(const float* p, int n, float fill) {
  alignas(32) float buf[16];
  for (int i = 0; i < 16; ++i) buf[i] = i < n ? p[i] : fill;
  return vload(buf);
}

// The rows of x as the matmul reads them on AVX2 and NEON: widened to fp32 once per call (pair kp at 2 kp, 2 kp + 1), so
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
#elif defined(__AVX2__)
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
#else  // NEON: the AVX2 build's steps, per quarter
inline vf exp16(vf x) {
  vf r, k;
  uint32x4_t zero[4];
  const float32x4_t lo = vdupq_n_f32(-87.f);
  for (int i = 0; i < 4; ++i) {
    zero[i] = vcltq_f32(x.q[i], lo);
    const float32x4_t c = min_x86(max_x86(x.q[i], lo), vdupq_n_f32(88.f));
    k.q[i] = vrndnq_f32(vmulq_f32(c, vdupq_n_f32(1.44269504088896341f)));
    r.q[i] = vfmsq_f32(vfmsq_f32(c, k.q[i], vdupq_n_f32(0.693359375f)), k.q[i], vdupq_n_f32(-2.12194440e-4f));
  }
  const vf p = exp_poly(r);
  vf out;
  for (int i = 0; i < 4; ++i) {
    const float32x4_t two_k = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(k.q[i]), vdupq_n_s32(127)), 23));
    out.q[i] = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(vmulq_f32(p.q[i], two_k)), zero[i]));
  }
  return out;
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
