// y = x @ w.T for bf16 on CPUs with AMX (Intel Sapphire Rapids and later), for the few rows (<= 16) that a
// decoding step, a verification block or a drafter pass multiplies. Built at first use by hyflash.kernels.
// Built without AMX (-mamx-tile absent: CPUs with AVX-512 BF16 but no tiles, such as AMD Zen 4), the same packed
// weights go through VDPBF16PS instead, one fp32 accumulator per output element (see `dp_rows`).
//
// Why: oneDNN's bf16 matmul costs 20-80 us a call at these sizes, most of it fixed overhead, so a step of a
// 135M-parameter model reads its weights at ~11 GB/s. Here the weight is reordered once into AMX's B-tile layout
// ([N/16][K/2][16][2]: 16 output columns x a pair of k per 4 bytes, 64 bytes a tile row) and each call streams it
// through TDPBF16PS once, with x's rows as the A tile: the cost barely grows from 1 row to 16, so verifying a block
// of drafted tokens costs about what one token does. Accumulation is fp32, the result is rounded to bf16 once.
#include "amx.h"
#include "simd.h"
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#include <ATen/Parallel.h>

namespace {

constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl: ask the kernel for the AMX tile state
constexpr long kXfeatureXtiledata = 18;

#ifdef __AMX_TILE__
// Tiles: 0-3 accumulators (M x 16 fp32 each), 4 the rows of x (M x 32 bf16), 5-7 weight tiles (16 x 32 bf16).
void configure(int64_t M) {
  hyflash::TileConfig cfg;
  for (int t = 0; t < 5; ++t) { cfg.rows[t] = static_cast<uint8_t>(M); cfg.colsb[t] = 64; }
  for (int t = 5; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  _tile_loadconfig(&cfg);
}
#else
// Without tiles: R rows of x against NB 16-column blocks, each output element one fp32 accumulator that takes
// k's pairs in order (vdot_pair of simd.h: VDPBF16PS, or two FMAs on AVX2 and NEON: x's pair broadcast against 16 columns'
// pairs). The sum an element gets does not depend on how many rows are multiplied with it, so verifying k tokens
// gives each the bits a 1-token step would.
// x: rows of x (matmul_rows of simd.h; stride xs elements, kPairStep a pair); w[u]: block u's pairs in kernel order ([K/2][16] uint32);
// acc: row r's block u at r * 64 + u * 16.
// add: continue the sums already in acc (a later range of k), else start from zero.
template <int R, int NB>
inline void dp_rows(const hyflash::xpair* x, int64_t xs, int64_t K2, const uint32_t* const* w, float* acc, bool add) {
  using namespace hyflash;
  vf c[R][NB];
  for (int r = 0; r < R; ++r)
    for (int u = 0; u < NB; ++u) c[r][u] = add ? vload(acc + r * 64 + u * 16) : vzero();
  for (int64_t kp = 0; kp < K2; ++kp) {
    vpairs b[NB];
    for (int u = 0; u < NB; ++u) b[u] = vload_pairs(w[u] + kp * 16);
    for (int r = 0; r < R; ++r) {
      const xpair* a = x + r * xs + kp * kPairStep;
      for (int u = 0; u < NB; ++u) c[r][u] = vdot(c[r][u], a, b[u]);
    }
  }
  for (int r = 0; r < R; ++r) for (int u = 0; u < NB; ++u) vstore(acc + r * 64 + u * 16, c[r][u]);
}

#ifdef __AVX512BF16__
constexpr int kRowGroup = 6;  // 6 rows x 4 blocks: 24 accumulators in AVX-512's 32 registers
#else
constexpr int kRowGroup = 4;  // NEON: 4 rows x 1 block x 4 quarters, plus the block's 8 widened quarters, in its 32
                               // registers (this is how the AVX2 build ran before dp_stream, below)
#endif

template <int NB>
inline void dp_rows_nb(const hyflash::xpair* x32, int64_t xs, int64_t K2, int64_t rows, const uint32_t* const* w, float* acc,
                       bool add) {
  switch (rows) {
    case 1: dp_rows<1, NB>(x32, xs, K2, w, acc, add); break;
    case 2: dp_rows<2, NB>(x32, xs, K2, w, acc, add); break;
#ifdef __AVX512BF16__
    case 3: dp_rows<3, NB>(x32, xs, K2, w, acc, add); break;
    case 4: dp_rows<4, NB>(x32, xs, K2, w, acc, add); break;
    case 5: dp_rows<5, NB>(x32, xs, K2, w, acc, add); break;
    default: dp_rows<6, NB>(x32, xs, K2, w, acc, add); break;
#else
    case 3: dp_rows<3, NB>(x32, xs, K2, w, acc, add); break;
    default: dp_rows<4, NB>(x32, xs, K2, w, acc, add); break;
#endif
  }
}

// all M rows of x (stride xs pairs; in groups of kRowGroup) against nb <= 4 blocks over K2 pairs of k, into
// acc [M x 64]; on NEON one block at a time (the AVX2 build has dp_stream, below, instead)
inline void dp_block_group(const hyflash::xpair* x32, int64_t xs, int64_t M, int64_t K2, const uint32_t* const* w,
                           int64_t nb, float* acc, bool add) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowGroup) {
    const int64_t rows = std::min<int64_t>(kRowGroup, M - m0);
    const hyflash::xpair* xr = x32 + m0 * xs;
    float* ar = acc + m0 * 64;
#ifdef __AVX512BF16__
    switch (nb) {
      case 1: dp_rows_nb<1>(xr, xs, K2, rows, w, ar, add); break;
      case 2: dp_rows_nb<2>(xr, xs, K2, rows, w, ar, add); break;
      case 3: dp_rows_nb<3>(xr, xs, K2, rows, w, ar, add); break;
      default: dp_rows_nb<4>(xr, xs, K2, rows, w, ar, add); break;
    }
#else  // 3-4 rows: one block at a time; fewer rows: 2 or 4 blocks at once, so that 8 sums are in flight either way
    if (rows >= 3) {
      for (int64_t u = 0; u < nb; ++u) dp_rows_nb<1>(xr, xs, K2, rows, w + u, ar + u * 16, add);
    } else if (rows == 2) {
      for (int64_t u = 0; u < nb; u += 2)
        if (u + 1 < nb) dp_rows<2, 2>(xr, xs, K2, w + u, ar + u * 16, add);
        else dp_rows<2, 1>(xr, xs, K2, w + u, ar + u * 16, add);
    } else {
      switch (nb) {
        case 1: dp_rows<1, 1>(xr, xs, K2, w, ar, add); break;
        case 2: dp_rows<1, 2>(xr, xs, K2, w, ar, add); break;
        case 3: dp_rows<1, 3>(xr, xs, K2, w, ar, add); break;
        default: dp_rows<1, 4>(xr, xs, K2, w, ar, add); break;
      }
    }
#endif
  }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2, the weights streamed from memory: amx_linear's bf16 blocks and, without the bf16 tile buffer the other builds
// widen them into, its int8 codes. A loader gives a block's 8-column half h of pair kp as fp32 (even, odd) vectors and
// prefetches 4 KiB ahead (the next page, where the hardware's stream prefetchers stop).
struct Bf16Pairs {  // [K/2][16] uint32: column c's pair at kp * 16 + c, the even element in the low half
  const uint32_t* w;
  void prefetch(int64_t kp) const { __builtin_prefetch(w + (kp + 64) * 16); }
  void half(int64_t kp, int h, __m256& even, __m256& odd) const {
    const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kp * 16 + 8 * h));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(p, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
};
struct Q8Pairs {  // [K/2][16][2] int8 (pack_q8): column c's even and odd codes at kp * 32 + 2c, + 1; exact in fp32,
  const int8_t* w;  // so the products and sums are those of the bf16 tile path
  void prefetch(int64_t kp) const { if (kp % 2 == 0) __builtin_prefetch(w + (kp + 128) * 32); }
  void half(int64_t kp, int h, __m256& even, __m256& odd) const {
    // each column's two codes as one int16 (even in the low byte), sign-extended to 32 bits
    const __m256i v = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + kp * 32 + 16 * h)));
    even = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    odd = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 8));
  }
};

// R rows of x (fp32 pairs, stride xs) against one 16-column block over K2 pairs into acc (row r at r * 64), each sum
// taking k's pairs in order, the odd product first (vdot's order, so the bits are those of every other build).
// Split: one 8-column half at a time, so that 5-6 rows' 10-12 sums fit in the 16 registers beside the half's pair;
// else both halves of a pair at once (up to 4 rows: 8 sums and 4 widened vectors).
template <int R, bool Split, class Pairs>
__attribute__((noinline)) void dp_avx2(const float* x, int64_t xs, int64_t K2, Pairs pairs, float* acc) {
  __m256 c[2][R];
  for (int r = 0; r < R; ++r) c[0][r] = c[1][r] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < K2; ++kp) {
    pairs.prefetch(kp);
    if constexpr (Split) {
      for (int h = 0; h < 2; ++h) {
        __m256 even, odd;
        pairs.half(kp, h, even, odd);
        for (int r = 0; r < R; ++r) {
          const float* a = x + r * xs + kp * 2;
          c[h][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(a), even, _mm256_fmadd_ps(_mm256_broadcast_ss(a + 1), odd, c[h][r]));
        }
      }
    } else {
      __m256 even[2], odd[2];
      pairs.half(kp, 0, even[0], odd[0]);
      pairs.half(kp, 1, even[1], odd[1]);
      for (int r = 0; r < R; ++r) {
        const float* a = x + r * xs + kp * 2;
        const __m256 xe = _mm256_broadcast_ss(a), xo = _mm256_broadcast_ss(a + 1);
        for (int h = 0; h < 2; ++h) c[h][r] = _mm256_fmadd_ps(xe, even[h], _mm256_fmadd_ps(xo, odd[h], c[h][r]));
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * 64, c[0][r]);
    _mm256_storeu_ps(acc + r * 64 + 8, c[1][r]);
  }
}

// All M rows against nb blocks (pairs(u): block u's loader), block by block, each block's rows in one pass where they
// fit (1-4 rows, or 5-6 split; more: groups of 4, then 1-6). One stream at a time per thread, and every row sharing
// each load of it, let the FMAs overlap the memory reads: SmolLM2's bf16 matmuls for 4 rows took 8.8 ms against 11.3
// for dp_block_group's schedule, 6 rows 11.8 against 17.9 (2-core AMD EPYC, 2026-12-01, a standalone copy of both).
template <class PairsOf>
inline void dp_stream(const float* x32, int64_t xs, int64_t M, int64_t K2, PairsOf pairs, int64_t nb, float* acc) {
  for (int64_t u = 0; u < nb; ++u) {
    const auto p = pairs(u);
    for (int64_t m0 = 0; m0 < M;) {
      const int64_t left = M - m0;
      const int64_t rows = left == 5 || left == 6 ? left : std::min<int64_t>(4, left);
      const float* xr = x32 + m0 * xs;
      float* ar = acc + m0 * 64 + u * 16;
      switch (rows) {
        case 1: dp_avx2<1, false>(xr, xs, K2, p, ar); break;
        case 2: dp_avx2<2, false>(xr, xs, K2, p, ar); break;
        case 3: dp_avx2<3, false>(xr, xs, K2, p, ar); break;
        case 4: dp_avx2<4, false>(xr, xs, K2, p, ar); break;
        case 5: dp_avx2<5, true>(xr, xs, K2, p, ar); break;
        default: dp_avx2<6, true>(xr, xs, K2, p, ar); break;
      }
      m0 += rows;
    }
  }
}
#endif
#endif

// fp32 rows [M x 16*nb] (stride 64 floats) -> bf16 output columns col..col+16*nb of y (stride N)
inline void store_bf16(const float* acc, int64_t M, int nb, at::BFloat16* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int b = 0; b < nb; ++b) {
      hyflash::store16(y + m * N + b * 16, hyflash::vload(acc + m * 64 + b * 16));
    }
}


// int8 weights: as store_bf16, each column's fp32 sum first times its scale (the 16 fp32 scales after each block's
// K * 16 codes; blocks: the first of the nb blocks, row bytes apart)
inline void store_scaled_bf16(const float* acc, int64_t M, int64_t nb, const int8_t* blocks, int64_t row, int64_t K,
                              at::BFloat16* y, int64_t N) {
  for (int64_t u = 0; u < nb; ++u) {
    const hyflash::vf scale = hyflash::vload(reinterpret_cast<const float*>(blocks + u * row + K * 16));
    for (int64_t m = 0; m < M; ++m)
      hyflash::store16(y + m * N + u * 16, hyflash::vmul(hyflash::vload(acc + m * 64 + u * 16), scale));
  }
}

}  // namespace

namespace hyflash {

bool init() {  // true when this process may use AMX tiles (always, built without them)
#ifdef __AMX_TILE__
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return true;
#endif
}

torch::Tensor pack(torch::Tensor w) {  // out_features are padded with zero rows to a multiple of 16
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack: a 2-D bf16 weight");
  const int64_t N = w.size(0), K = w.size(1), padded = (N + 15) / 16 * 16;
  TORCH_CHECK(K % 32 == 0, "pack: in_features % 32 must be 0");
  auto full = padded == N ? w.contiguous() : torch::cat({w, w.new_zeros({padded - N, K})}, 0);
  return full.view({padded / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// Uninitialised bytes on memory the kernel is asked to back with 2 MiB pages (transparent huge pages, "madvise"
// mode), advised before the first touch. Packed weights copied there are streamed with ~500x fewer TLB misses:
// a decoding step of SmolLM2 took ~5% less time in an interleaved comparison (2-core VM, 2026-11-30).
torch::Tensor huge_empty(int64_t nbytes) {
  TORCH_CHECK(nbytes > 0, "huge_empty: a positive size");
  constexpr int64_t kHuge = int64_t{2} << 20;
  const int64_t size = (nbytes + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, size);
  TORCH_CHECK(p != nullptr, "huge_empty: could not allocate ", size, " bytes");
  madvise(p, size, MADV_HUGEPAGE);  // advice only: without THP the memory simply keeps 4 KiB pages
  return torch::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, torch::TensorOptions().dtype(torch::kUInt8));
}

// int8 weights for the drafter (a round reads half the bytes): per output column a symmetric scale (max |w| / 127)
// and the codes in the bf16 tile order, each 16-column block as K * 16 codes followed by its 16 fp32 scales:
// [N/16, K * 16 + 64] int8. amx_linear widens a block's codes to bf16 integers in a tile buffer just before
// multiplying (the AVX2 build: straight to fp32 in registers, Q8Pairs) and scales each column's fp32 sum: y = bf16(scale * sum_k x_k code_k), the product with the weights
// dequantise_q8 returns, up to fp32 rounding.
torch::Tensor pack_q8(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "pack_q8: a 2-D bf16 weight");
  const int64_t N = w.size(0), K = w.size(1), padded = (N + 15) / 16 * 16;
  TORCH_CHECK(K % 32 == 0, "pack_q8: in_features % 32 must be 0");
  auto wf = w.to(torch::kFloat32);
  if (padded != N) wf = torch::cat({wf, wf.new_zeros({padded - N, K})}, 0);
  auto scale = wf.abs().amax(1).div(127.f);
  scale = torch::where(scale > 0, scale, torch::ones_like(scale));
  auto codes = wf.div(scale.unsqueeze(1)).round().clamp(-127, 127).to(torch::kInt8);
  auto tiles = codes.view({padded / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).reshape({padded / 16, K * 16});
  auto scales = scale.view({padded / 16, 16}).contiguous();
  auto scale_bytes = torch::from_blob(scales.data_ptr(), {padded / 16, 64}, torch::TensorOptions().dtype(torch::kInt8));
  return torch::cat({tiles, scale_bytes}, 1).contiguous();
}

torch::Tensor dequantise_q8(torch::Tensor packed, int64_t K) {  // the weight [N rounded up to 16, K] it holds, fp32
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kInt8 && packed.size(1) == K * 16 + 64,
              "dequantise_q8: a pack_q8 tensor");
  const int64_t blocks = packed.size(0);
  auto codes = packed.narrow(1, 0, K * 16).reshape({blocks, K / 2, 16, 2}).permute({0, 2, 1, 3})
                   .reshape({blocks * 16, K}).to(torch::kFloat32);
  auto scales = packed.narrow(1, K * 16, 64).contiguous().view(torch::kFloat32).reshape({blocks * 16, 1});
  return codes.mul(scales);
}

namespace {

// one 16-column block's 32 x 16 tile at k (codes: the block's K * 16 codes) as bf16 integers into `tile` (exact:
// |code| <= 127 fits bf16's 8-bit significand); the column scales are applied to the fp32 sums afterwards
inline void widen_q8(const int8_t* codes, int64_t k, uint16_t* tile) {
  const int8_t* c = codes + k * 16;
  for (int i = 0; i < 32; ++i) widen16_q8(c + 16 * i, tile + 16 * i);  // 16 tile rows: 16 columns x a pair of k
}

torch::Tensor amx_linear_q8(torch::Tensor x, torch::Tensor packed) {
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * 16, row = packed.size(1);
  TORCH_CHECK(row == K * 16 + 64, "linear: x has ", K, " columns, the int8 weight ", (row - 64) / 16);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int8_t* wp = packed.data_ptr<int8_t>();
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t groups = (blocks + 3) / 4;
  // as amx_linear: four column blocks share each load of x (and four streams of codes are in flight)
#ifndef __AMX_TILE__
  std::vector<float> scratch;
  const xpair* xr = matmul_rows(x.data_ptr<at::BFloat16>(), M * K, scratch);
#if defined(__AVX2__) && !defined(__AVX512F__)
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[16 * 64];
    for (int64_t g = first; g < last; ++g) {
      const int64_t b0 = g * 4, nb = std::min<int64_t>(4, blocks - b0);
      dp_stream(xr, K, M, K / 2, [&](int64_t u) { return Q8Pairs{wp + (b0 + u) * row}; }, nb, acc);
      store_scaled_bf16(acc, M, nb, wp + b0 * row, row, K, yp + b0 * 16, N);
    }
  });
#else
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[16 * 64];
    alignas(64) uint16_t tile[4][16 * 32];
    for (int64_t g = first; g < last; ++g) {
      const int64_t b0 = g * 4, nb = std::min<int64_t>(4, blocks - b0);
      const uint32_t* w[4] = {};
      for (int64_t u = 0; u < nb; ++u) w[u] = reinterpret_cast<const uint32_t*>(tile[u]);
      for (int64_t k = 0; k < K; k += 32) {  // 32 k at a time: widen the codes, then 16 pairs into the sums
        for (int64_t u = 0; u < nb; ++u) widen_q8(wp + (b0 + u) * row, k, tile[u]);
        dp_block_group(xr + k / 2 * kPairStep, K / 2 * kPairStep, M, 16, w, nb, acc, k > 0);
      }
      store_scaled_bf16(acc, M, nb, wp + b0 * row, row, K, yp + b0 * 16, N);
    }
  });
#endif
#else
  const int64_t xs = K * 2;  // bytes per row of x (the A tile's stride)
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[16 * 64];
    alignas(64) uint16_t tile[4][16 * 32];
    configure(M);
    for (int64_t g = first; g < last; ++g) {
      const int64_t b0 = g * 4, nb = std::min<int64_t>(4, blocks - b0);
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t k = 0; k < K; k += 32) {
        for (int64_t u = 0; u < nb; ++u) {
          const int8_t* codes = wp + (b0 + u) * row;
          if (k + 64 < K)  // the next tiles but one of this stream: the hardware prefetcher stops at 4 KiB pages
            for (int line = 0; line < 8; ++line)
              _mm_prefetch(reinterpret_cast<const char*>(codes + (k + 64) * 16) + 64 * line, _MM_HINT_T0);
          widen_q8(codes, k, tile[u]);
        }
        _tile_loadd(4, xp + k, xs);
        _tile_loadd(5, tile[0], 64);
        _tile_dpbf16ps(0, 4, 5);
        if (nb > 1) { _tile_loadd(6, tile[1], 64); _tile_dpbf16ps(1, 4, 6); }
        if (nb > 2) { _tile_loadd(7, tile[2], 64); _tile_dpbf16ps(2, 4, 7); }
        if (nb > 3) { _tile_loadd(5, tile[3], 64); _tile_dpbf16ps(3, 4, 5); }
      }
      _tile_stored(0, acc, 256); _tile_stored(1, acc + 16, 256);
      _tile_stored(2, acc + 32, 256); _tile_stored(3, acc + 48, 256);
      store_scaled_bf16(acc, M, nb, wp + b0 * row, row, K, yp + b0 * 16, N);
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace

torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(), "linear: contiguous 2-D bf16 x");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  TORCH_CHECK(M >= 1 && M <= 16, "linear: 1 to 16 rows");
  if (packed.scalar_type() == torch::kInt8) return amx_linear_q8(x, packed);
  TORCH_CHECK(packed.size(1) * 2 == K, "linear: x has ", K, " columns, the weight ", packed.size(1) * 2);
  auto y = torch::empty({M, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = y.data_ptr<at::BFloat16>();
  const int64_t blocks = N / 16, groups = (blocks + 3) / 4, bs = K * 16;  // bs: elements per 16-column block
#ifndef __AMX_TILE__
  std::vector<float> scratch;
  const xpair* xr = matmul_rows(x.data_ptr<at::BFloat16>(), M * K, scratch);
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[16 * 64];
    for (int64_t g = first; g < last; ++g) {
      const int64_t b0 = g * 4, nb = std::min<int64_t>(4, blocks - b0);
      const uint32_t* w[4] = {};
      for (int64_t u = 0; u < nb; ++u) w[u] = reinterpret_cast<const uint32_t*>(wp + (b0 + u) * bs);
#if defined(__AVX2__) && !defined(__AVX512F__)
      dp_stream(xr, K / 2 * kPairStep, M, K / 2, [&](int64_t u) { return Bf16Pairs{w[u]}; }, nb, acc);
#else
      dp_block_group(xr, K / 2 * kPairStep, M, K / 2, w, nb, acc, false);
#endif
      store_bf16(acc, M, static_cast<int>(nb), yp + b0 * 16, N);
    }
  });
#else
  const int64_t xs = K * 2;  // bytes per row of x (the A tile's stride)
  // torch's own thread pool (torch.set_num_threads); tile configuration is per thread, so per chunk
  at::parallel_for(0, groups, 1, [&](int64_t first, int64_t last) {
    alignas(64) float acc[16 * 64];
    configure(M);
    for (int64_t g = first; g < last; ++g) {
      const int64_t b0 = g * 4;
      const uint16_t* wg = wp + b0 * bs;
      if (b0 + 4 <= blocks) {  // four column blocks share each load of x
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < K; k += 32) {
          _tile_loadd(4, xp + k, xs);
          _tile_loadd(5, wg + k * 16, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, wg + bs + k * 16, 64);
          _tile_dpbf16ps(1, 4, 6);
          _tile_loadd(7, wg + 2 * bs + k * 16, 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_loadd(5, wg + 3 * bs + k * 16, 64);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, acc, 256); _tile_stored(1, acc + 16, 256);
        _tile_stored(2, acc + 32, 256); _tile_stored(3, acc + 48, 256);
        store_bf16(acc, M, 4, yp + b0 * 16, N);
      } else {  // the last 1-3 blocks
        for (int64_t b = b0; b < blocks; ++b) {
          _tile_zero(0);
          for (int64_t k = 0; k < K; k += 32) {
            _tile_loadd(4, xp + k, xs);
            _tile_loadd(5, wp + b * bs + k * 16, 64);
            _tile_dpbf16ps(0, 4, 5);
          }
          _tile_stored(0, acc, 256);
          store_bf16(acc, M, 1, yp + b * 16, N);
        }
      }
    }
    _tile_release();
  });
#endif
  return y;
}

}  // namespace hyflash

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace hyflash;
  m.def("init", &init, "ask the OS for AMX tile state; true when granted");
  m.def("pack", &pack, "reorder a bf16 weight [N, K] into AMX B tiles");
  m.def("huge_empty", &huge_empty, "uninitialised bytes on memory advised for 2 MiB pages (packed weights)");
  m.def("pack_q8", &pack_q8, "a bf16 weight [N, K] as int8 codes and per-column scales in tile order");
  m.def("dequantise_q8", &dequantise_q8, "the weight a pack_q8 tensor stands for (given K), fp32");
  m.def("linear", &amx_linear, "x [M<=16, K] bf16 @ w.T from pack(w) -> [M, N rounded up to 16] bf16");
  m.def("llama_forward", &llama_forward, "one forward of a Llama decoder over <= 16 new tokens (lean_llama.cpp)");
  m.def("gemma_norm", &gemma_norm, "Gemma 3's RMSNorm x * (1 + w), fp32 statistics, row by row (lean_llama.cpp)");
  m.def("gemma_qk", &gemma_qk, "Gemma 3's query and key heads normalised and rotated (lean_llama.cpp)");
  m.def("llama_attention", &llama_attention,
        "llama_forward's attention alone, in fp32, optionally in a sliding window (Gemma 3's; lean_llama.cpp)",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("start"), pybind11::arg("mask"),
        pybind11::arg("heads"), pybind11::arg("scale"), pybind11::arg("window") = 0);
  m.def("cache_keep", &cache_keep, "keep a verified tree path in bf16 static-cache buffers (lean_llama.cpp)");
  m.def("drafter_commit", &drafter_commit, "fold <= 16 verified features into a drafter's state (drafter.cpp)");
  m.def("top_probs", &top_probs, "the k most probable entries of each row of softmax(logits) (drafter.cpp)");
  m.def("drafter_draft", &drafter_draft, "a drafter's block logits from its state (drafter.cpp)");
}
