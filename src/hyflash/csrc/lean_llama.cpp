// One forward of a Llama decoder over up to 16 new tokens, in C++: what hyflash.fast.LeanLlama.forward computes
// in Python, with the same bf16 roundings at the same places, in one call instead of ~1,500 small torch operations
// (about half of a decoding step's time on a 2-core CPU once the matmuls run on AMX). Matmuls: amx_linear() of
// amx_linear.cpp. Attention: the new tokens see every cached key and, among themselves, what `mask` allows (a chain:
// the lower triangle; a tree of candidates: each node's ancestors and itself), in fp32 with one rounding to bf16.
#include "amx.h"
#include "simd.h"
#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <memory>

namespace hyflash {
namespace {

constexpr int64_t kMaxGroup = 8;  // query heads per kv head

// torch's RMSNorm of fast.py: fp32 statistics, the normalised row rounded to bf16, then times the weight in bf16.
// d is a multiple of 16 (checked by the caller).
void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t n, int64_t d, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const bf16* row = x + i * d;
    vf ss = vzero();
    for (int64_t j = 0; j < d; j += 16) { const vf v = load16(row + j); ss = vfma(v, v, ss); }
    const vf r = vset(1.f / std::sqrt(vsum(ss) / d + eps));
    for (int64_t j = 0; j < d; j += 16)
      store16(out + i * d + j, vmul(load16(w + j), round_bf16(vmul(load16(row + j), r))));
  }
}

// x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16 (as torch does on bf16 tensors);
// hd a multiple of 32
void rope(bf16* x, const bf16* cos, const bf16* sin, int64_t hd) {
  const int64_t half = hd / 2;
  vf out[16];
  for (int64_t e = 0; e < hd; e += 16) {
    const vf rot = e < half ? vsub(vzero(), load16(x + e + half)) : load16(x + e - half);
    out[e / 16] = vadd(round_bf16(vmul(load16(x + e), load16(cos + e))),
                                round_bf16(vmul(rot, load16(sin + e))));
  }
  for (int64_t e = 0; e < hd; e += 16) store16(x + e, out[e / 16]);
}



// Attention of the new tokens' query heads over the cache, split into tasks of (kv head, chunk of kChunk keys) so
// that both cores share even a single token's attention, with q·k on AMX tiles: a tile of 16 keys times one of up
// to 16 query rows (a kv head's query heads for each new token) in one instruction per 32 dimensions.
//
// Batch invariance (a verified token gets the bits of a single-token step): keys are grouped into chunks by their
// *logical* position — a cached key's index, a new token's start + its depth in the tree — so a token meets the
// same keys in the same chunks in the same order whether it is verified alone, in a chain or in a tree (where a
// node's ancestors sit at other slots than their positions). Each (query row, key) score is one AMX dot product,
// independent of the other rows and keys in the tile; within a chunk, a row's maximum, exponentials, sum and
// p·v run in key order with masked keys adding exact zeros; chunks are merged in order, skipping those where the
// row sees nothing. Softmax and p·v are fp32, the output is rounded to bf16 once.
//
// A sliding window (`window` > 0, Gemma 3's local layers): a token at position p sees only keys at positions
// p - window + 1 .. p. Keys outside a row's window are masked like any unseen key, and chunks wholly below every
// row's window are not computed at all. A row alone runs from its own first chunk, in a block from the block's
// first: the chunks in between are ones it sees nothing of, which the merge skips, so its bits are the same.
constexpr int64_t kChunk = 64;
// p·v takes 4 query rows by this many dimensions at a time: 16 accumulators of AVX-512's 32 registers; on AVX2, whose
// 16-lane vector is two of its 16 registers, 64 would spill every accumulator to the stack, so 16 there
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kPvDims = 16;
#else
constexpr int64_t kPvDims = 64;
#endif

class Attention {
 public:
  Attention(int64_t n, int64_t start, int64_t H, int64_t Hkv, int64_t hd, float scale, const bool* mask,
            int64_t window = 0)
      : n_(n), start_(start), H_(H), Hkv_(Hkv), hd_(hd), group_(H / Hkv), scale_(scale), mask_(mask) {
    R_ = n * group_;
    RB_ = (R_ + 15) / 16;
    depth_.resize(n);
    int64_t deepest = 0;
    for (int64_t i = 0; i < n; ++i) {  // a token sees its ancestors and itself: its depth is that count - 1
      int64_t seen = 0;
      for (int64_t j = 0; j < n; ++j) seen += mask[i * n + j];
      depth_[i] = seen - 1;
      deepest = std::max(deepest, depth_[i]);
    }
    chunks_ = (start + deepest) / kChunk + 1;
    // the first key each token sees: start + depth - window + 1 in a sliding window, else 0
    low_.assign(n, 0);
    if (window > 0)
      for (int64_t i = 0; i < n; ++i) low_[i] = std::max<int64_t>(0, start + depth_[i] - window + 1);
    first_chunk_ = *std::min_element(low_.begin(), low_.end()) / kChunk;
    chunks_ -= first_chunk_;  // chunks are counted from first_chunk_ on
    // which of a row block's 16 query rows see new token j: bit c for row rb * 16 + c
    new_sees_.assign(RB_ * n, 0);
    for (int64_t rb = 0; rb < RB_; ++rb)
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t r = rb * 16 + c;
        if (r >= R_) break;
        const int64_t i = r / group_;
        for (int64_t j = 0; j < n; ++j)
          if (mask[i * n + j] && start + depth_[j] >= low_[i])
            new_sees_[rb * n + j] |= static_cast<uint16_t>(1u << c);
      }
    qt_.resize(Hkv * RB_ * (hd / 32) * 512);
    part_m_.resize(Hkv * chunks_ * RB_ * 16);
    part_s_.resize(part_m_.size());
    part_o_.resize(part_m_.size() * hd);
  }

  // q: the layer's qkv rows (stride `row` elements, queries first, rotated); keys/values of this layer's cache
  void run(const bf16* q, int64_t row, const bf16* kc, const bf16* vc, int64_t cap, bf16* out, float* out32 = nullptr) {
    transpose_queries(q, row);
    at::parallel_for(0, Hkv_ * chunks_, 1, [&](int64_t first, int64_t last) {
#ifdef __AMX_TILE__
      TileConfig cfg;
      for (int t = 0; t < 3; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
      _tile_loadconfig(&cfg);
#endif
      for (int64_t task = first; task < last; ++task) chunk(task / chunks_, task % chunks_, kc, vc, cap);
#ifdef __AMX_TILE__
      _tile_release();
#endif
    });
    at::parallel_for(0, Hkv_ * R_, 1, [&](int64_t first, int64_t last) {
      for (int64_t t = first; t < last; ++t) merge(t / R_, t % R_, out, out32);
    });
  }

 private:
  // B tiles of the queries: for kv head, row block rb and 32 dimensions h, 16 rows of pairs x 16 query rows
  void transpose_queries(const bf16* q, int64_t row) {
    const auto* q32 = reinterpret_cast<const uint32_t*>(q);
    auto* t32 = reinterpret_cast<uint32_t*>(qt_.data());
    const int64_t halves = hd_ / 32;
    for (int64_t kv = 0; kv < Hkv_; ++kv)
      for (int64_t rb = 0; rb < RB_; ++rb)
        for (int64_t h = 0; h < halves; ++h) {
          uint32_t* tile = t32 + ((kv * RB_ + rb) * halves + h) * 256;
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t r = rb * 16 + c;
            const uint32_t* src = r < R_ ? q32 + ((r / group_) * row + (kv * group_ + r % group_) * hd_) / 2 + 16 * h
                                         : nullptr;
            for (int64_t p = 0; p < 16; ++p) tile[p * 16 + c] = src ? src[p] : 0u;
          }
        }
  }

#if defined(__AVX2__) && !defined(__AVX512F__)
  // scores() on AVX2. One key's sum is a chain of dependent FMAs (two per pair), so computing one key at a time
  // waits on FMA latency; here 4 keys (16 query rows: 8 accumulators) or, when the block has at most 8 real query
  // rows (a single token's heads, a short verify), 8 keys on the low half only run side by side. The 16 keys are
  // widened to fp32 once and each pair of queries once for all of them. Every (key, row) sum takes the same
  // operations in the same order as vdot_pair, so the bits are those of the one-key loop (and of the other builds'
  // scheme).
  static void scores_avx2(const uint32_t* a32, const bf16* qt, int64_t halves, float* score, int64_t rows) {
    const int64_t ks = halves * 16;  // pairs per key
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    alignas(32) float kw[16 * 256];  // the 16 keys widened to fp32 once (exact), each element then broadcast
    const auto* a = reinterpret_cast<const bf16*>(a32);
    for (int64_t e = 0; e < 16 * 2 * ks; e += 8) _mm256_store_ps(kw + e, widen8(a + e));
    if (rows <= 8) {
      for (int u0 = 0; u0 < 16; u0 += 8) {
        __m256 acc[8];
        for (auto& x : acc) x = _mm256_setzero_ps();
        for (int64_t h = 0; h < halves; ++h) {
          const auto* q32 = reinterpret_cast<const uint32_t*>(qt + h * 512);
          for (int64_t p = 0; p < 16; ++p) {
            const __m256i qp = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q32 + p * 16));
            const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(qp, 16));
            const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(qp, high));
            const float* kp = kw + u0 * 2 * ks + 2 * (16 * h + p);
            for (int u = 0; u < 8; ++u)  // the odd product first, as vdot_pair
              acc[u] = _mm256_fmadd_ps(_mm256_broadcast_ss(kp + u * 2 * ks), even,
                                       _mm256_fmadd_ps(_mm256_broadcast_ss(kp + u * 2 * ks + 1), odd, acc[u]));
          }
        }
        for (int u = 0; u < 8; ++u) {
          _mm256_storeu_ps(score + (u0 + u) * 16, acc[u]);
          _mm256_storeu_ps(score + (u0 + u) * 16 + 8, _mm256_setzero_ps());
        }
      }
      return;
    }
    for (int u0 = 0; u0 < 16; u0 += 4) {
      vf acc[4];
      for (auto& x : acc) x = vzero();
      for (int64_t h = 0; h < halves; ++h) {
        const auto* q32 = reinterpret_cast<const uint32_t*>(qt + h * 512);
        for (int64_t p = 0; p < 16; ++p) {
          const vpairs qrow = vload_pairs(q32 + p * 16);
          const float* kp = kw + u0 * 2 * ks + 2 * (16 * h + p);
          for (int u = 0; u < 4; ++u) acc[u] = vdot(acc[u], kp + u * 2 * ks, qrow);
        }
      }
      for (int u = 0; u < 4; ++u) vstore(score + (u0 + u) * 16, acc[u]);
    }
  }
#endif

  // score[u * 16 + c] = key u's dot product with query row c, for 16 keys (a, stride hd) and a row block's query
  // tiles (qt: `halves` tiles of 32 dimensions), each sum in order of dimension pairs
  // (rows: how many of the block's 16 query rows are real; the AVX2 build leaves lanes 8-15 zero when it is 8 or fewer)
  void scores(const bf16* a, const bf16* qt, int64_t halves, float* score, int64_t rows) const {
    (void)rows;
#ifdef __AMX_TILE__
    _tile_zero(0);
    for (int64_t h = 0; h < halves; ++h) {
      _tile_loadd(1, a + 32 * h, hd_ * sizeof(bf16));
      _tile_loadd(2, qt + h * 512, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, score, 64);
#elif defined(__AVX512BF16__)  // the tile product on AVX-512 BF16: a key's pair broadcast against 16 query rows' pairs
    vf acc[16];
    for (auto& v : acc) v = vzero();
    const auto* a32 = reinterpret_cast<const uint32_t*>(a);
    const int64_t ks = hd_ / 2;  // pairs per key
    for (int64_t h = 0; h < halves; ++h) {
      const auto* q32 = reinterpret_cast<const uint32_t*>(qt + h * 512);
      for (int64_t p = 0; p < 16; ++p) {
        const vpairs qrow = vload_pairs(q32 + p * 16);
        for (int u = 0; u < 16; ++u) acc[u] = vdot_pair(acc[u], a32[u * ks + 16 * h + p], qrow);
      }
    }
    for (int u = 0; u < 16; ++u) vstore(score + u * 16, acc[u]);
#elif defined(__AVX2__)  // the same sums in the same order, the FMA chains of several keys interleaved (below)
    scores_avx2(reinterpret_cast<const uint32_t*>(a), qt, halves, score, rows);
#else  // NEON: the same sums in the same order, one key at a time (16 accumulators would not fit its registers)
    const auto* a32 = reinterpret_cast<const uint32_t*>(a);
    const int64_t ks = hd_ / 2;
    for (int u = 0; u < 16; ++u) {
      vf acc = vzero();
      for (int64_t h = 0; h < halves; ++h) {
        const auto* q32 = reinterpret_cast<const uint32_t*>(qt + h * 512);
        for (int64_t p = 0; p < 16; ++p) acc = vdot_pair(acc, a32[u * ks + 16 * h + p], vload_pairs(q32 + p * 16));
      }
      vstore(score + u * 16, acc);
    }
#endif
  }

  // chunk c (of those from first_chunk_ on): keys at positions (first_chunk_ + c) * kChunk and the next kChunk - 1
  void chunk(int64_t kv, int64_t c, const bf16* kc, const bf16* vc, int64_t cap) {
    const int64_t lo = (first_chunk_ + c) * kChunk, hi = lo + kChunk, halves = hd_ / 32;
    const bf16* kb = kc + kv * cap * hd_;
    const bf16* vb = vc + kv * cap * hd_;
    int64_t keys[kChunk + 16];  // physical slots in logical order
    int64_t count = 0, cached = 0;
    for (int64_t j = lo; j < std::min(hi, start_); ++j) keys[count++] = j;
    cached = count;
    for (int64_t j = 0; j < n_; ++j)
      if (start_ + depth_[j] >= lo && start_ + depth_[j] < hi) keys[count++] = start_ + j;
    const int64_t blocks = (count + 15) / 16;
    alignas(64) float score[(kChunk + 16) * 16];
    alignas(64) bf16 gathered[16 * 256];
    for (int64_t rb = 0; rb < RB_; ++rb) {
      const uint16_t valid = static_cast<uint16_t>(R_ - rb * 16 >= 16 ? 0xFFFF : (1u << (R_ - rb * 16)) - 1);
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t k0 = keys[16 * b], in_block = std::min<int64_t>(16, count - 16 * b);
        const bool direct = in_block == 16 && keys[16 * b + 15] == k0 + 15 && k0 + 16 <= cap;
        const bf16* a = kb + k0 * hd_;
        if (!direct) {  // the chunk's last keys or new tokens out of slot order: copy them, zeros after
          std::memset(gathered, 0, sizeof(bf16) * 16 * hd_);
          for (int64_t u = 0; u < in_block; ++u)
            std::memcpy(gathered + u * hd_, kb + keys[16 * b + u] * hd_, sizeof(bf16) * hd_);
          a = gathered;
        }
        scores(a, qt_.data() + (kv * RB_ + rb) * halves * 512, halves, score + 16 * b * 16, R_ - rb * 16);
      }
      // which rows see each cached key: all valid rows, but in a sliding window only those whose window holds it
      uint16_t cached_sees[kChunk];
      for (int64_t k = 0; k < cached; ++k) {
        uint16_t bits = valid;
        for (int64_t c2 = 0; c2 < 16 && rb * 16 + c2 < R_; ++c2)
          if (keys[k] < low_[(rb * 16 + c2) / group_]) bits &= static_cast<uint16_t>(~(1u << c2));
        cached_sees[k] = bits;
      }
      // per query row (a lane): the chunk's maximum, exponentials and their sum, in key order
      const vf scale = vset(scale_);
      vf best = vset(-INFINITY);
      for (int64_t k = 0; k < count; ++k) {
        const vmask sees = k < cached ? cached_sees[k] : new_sees_[rb * n_ + (keys[k] - start_)];
        const vf s = vmul(vload(score + k * 16), scale);
        vstore(score + k * 16, s);
        best = vmax_where(best, sees, s);
      }
      vf total = vzero();
      for (int64_t k = 0; k < count; ++k) {
        const vmask sees = k < cached ? cached_sees[k] : new_sees_[rb * n_ + (keys[k] - start_)];
        const vf p = vkeep(sees, exp16(vsub(vload(score + k * 16), best)));
        vstore(score + k * 16, p);
        total = vadd(total, p);
      }
      const int64_t slot = (kv * chunks_ + c) * RB_ * 16 + rb * 16;
      vstore(&part_m_[slot], best);
      vstore(&part_s_[slot], total);
      // p·v, four query rows by kPvDims dimensions at a time (the last piece of hd may be shorter)
      for (int64_t r0 = 0; r0 < 16 && rb * 16 + r0 < R_; r0 += 4)
        for (int64_t e0 = 0; e0 < hd_; e0 += kPvDims) {
          const int ne = static_cast<int>(std::min<int64_t>(kPvDims / 16, (hd_ - e0) / 16));
          vf o[4][kPvDims / 16];
          for (auto& orow : o) for (auto& x : orow) x = vzero();
          for (int64_t k = 0; k < count; ++k) {
            const bf16* v = vb + keys[k] * hd_ + e0;
            vf vv[4];
            for (int e = 0; e < ne; ++e) vv[e] = load16(v + 16 * e);
            for (int u = 0; u < 4; ++u) {
              const vf p = vset(score[k * 16 + r0 + u]);
              for (int e = 0; e < ne; ++e) o[u][e] = vfma(p, vv[e], o[u][e]);
            }
          }
          for (int u = 0; u < 4; ++u)
            for (int e = 0; e < ne; ++e) vstore(&part_o_[(slot + r0 + u) * hd_ + e0 + 16 * e], o[u][e]);
        }
    }
  }

  // a query row's chunks merged in order: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) s_c
  void merge(int64_t kv, int64_t r, bf16* out, float* out32) {
    const int64_t stride = RB_ * 16;
    float best = -INFINITY;
    for (int64_t c = 0; c < chunks_; ++c) best = std::max(best, part_m_[(kv * chunks_ + c) * stride + r]);
    vf o[16];
    for (int64_t e = 0; e < hd_ / 16; ++e) o[e] = vzero();
    float total = 0.f;
    for (int64_t c = 0; c < chunks_; ++c) {
      const int64_t slot = (kv * chunks_ + c) * stride + r;
      if (part_m_[slot] == -INFINITY) continue;  // the row sees no key of this chunk
      const vf f = exp16(vset(part_m_[slot] - best));
      total += part_s_[slot] * vfirst(f);
      for (int64_t e = 0; e < hd_ / 16; ++e) o[e] = vfma(f, vload(&part_o_[slot * hd_ + 16 * e]), o[e]);
    }
    const int64_t at = (r / group_) * H_ * hd_ + (kv * group_ + r % group_) * hd_;
    const vf inv = vset(1.f / total);
    for (int64_t e = 0; e < hd_ / 16; ++e) {
      if (out32 != nullptr) vstore(out32 + at + 16 * e, vmul(o[e], inv));
      else store16(out + at + 16 * e, vmul(o[e], inv));
    }
  }

  int64_t n_, start_, H_, Hkv_, hd_, group_, R_, RB_, chunks_, first_chunk_ = 0;
  float scale_;
  const bool* mask_;
  std::vector<int64_t> depth_, low_;
  std::vector<uint16_t> new_sees_;
  std::vector<bf16> qt_;  // query B tiles (uint32 pairs viewed as bf16)
  std::vector<float> part_m_, part_s_, part_o_;
};

}  // namespace

std::vector<torch::Tensor> llama_forward(
    torch::Tensor ids, torch::Tensor embed, std::vector<torch::Tensor> layers, torch::Tensor final_norm,
    torch::Tensor head, std::vector<torch::Tensor> cache_k, std::vector<torch::Tensor> cache_v, int64_t start,
    torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> parents, int64_t H, int64_t Hkv, double eps_d,
    double scale_d, std::vector<int64_t> feature_layers) {
  const int64_t n = ids.size(0), d = embed.size(1), L = static_cast<int64_t>(cache_k.size());
  const int64_t hd = cache_k[0].size(3), cap = cache_k[0].size(2), end = start + n, group = H / Hkv;
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  TORCH_CHECK(n >= 1 && n <= 16, "llama_forward: 1 to 16 new tokens");
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 6 * L, "llama_forward: 6 weights per layer");
  TORCH_CHECK(end <= cap, "llama_forward: the cache holds ", cap, " tokens, ", end, " needed");
  TORCH_CHECK(hd % 32 == 0 && hd <= 256 && H % Hkv == 0 && H / Hkv <= kMaxGroup && d % 16 == 0,
              "llama_forward: unsupported geometry");
  TORCH_CHECK(static_cast<int64_t>(parents.size()) == n - 1, "llama_forward: one parent per token after the first");
  // token i > 0 follows parents[i - 1] < i (a chain: i - 1) and sees its ancestors and itself, at start + its depth
  std::unique_ptr<bool[]> sees(new bool[n * n]());
  std::vector<int64_t> depth(n, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (i > 0) {
      const int64_t p = parents[i - 1];
      TORCH_CHECK(p >= 0 && p < i, "llama_forward: token ", i, " has parent ", p, "; a parent must come before it");
      std::memcpy(&sees[i * n], &sees[p * n], n * sizeof(bool));
      depth[i] = depth[p] + 1;
    }
    sees[i * n + i] = true;
  }
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(start + depth[i] < cos.size(0), "llama_forward: the RoPE table is too short");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd && sin.sizes() == cos.sizes(),
              "llama_forward: RoPE tables [positions, head_dim]");
  auto opt = embed.options();
  auto h = embed.index_select(0, ids).contiguous();  // [n, d] bf16
  auto x = torch::empty({n, d}, opt);
  auto attn = torch::empty({n, H * hd}, opt);
  std::vector<torch::Tensor> kept(L);
  const bool* mk = sees.get();
  const bf16* cs = cos.data_ptr<bf16>();
  const bf16* sn = sin.data_ptr<bf16>();
  Attention attention(n, start, H, Hkv, hd, scale, mk);

  for (int64_t l = 0; l < L; ++l) {
    const auto& w_in = layers[6 * l];
    const auto& w_post = layers[6 * l + 3];
    rms_norm(h.data_ptr<bf16>(), w_in.data_ptr<bf16>(), x.data_ptr<bf16>(), n, d, eps);
    auto qkv = amx_linear(x, layers[6 * l + 1]);  // [n, (H + 2 Hkv) hd]
    bf16* qp = qkv.data_ptr<bf16>();
    const int64_t row = qkv.size(1);
    bf16* kc = cache_k[l].data_ptr<bf16>();
    bf16* vc = cache_v[l].data_ptr<bf16>();
    for (int64_t i = 0; i < n; ++i) {  // RoPE on q and k; k and v into the cache at start + i
      bf16* r = qp + i * row;
      const int64_t at = (start + depth[i]) * hd;
      for (int64_t a = 0; a < H + Hkv; ++a) rope(r + a * hd, cs + at, sn + at, hd);
      for (int64_t a = 0; a < Hkv; ++a) {
        std::memcpy(kc + (a * cap + start + i) * hd, r + (H + a) * hd, hd * sizeof(bf16));
        std::memcpy(vc + (a * cap + start + i) * hd, r + (H + Hkv + a) * hd, hd * sizeof(bf16));
      }
    }
    attention.run(qp, row, kc, vc, cap, attn.data_ptr<bf16>());
    auto o = amx_linear(attn, layers[6 * l + 2]);  // [n, d]
    bf16* hp = h.data_ptr<bf16>();
    const bf16* op = o.data_ptr<bf16>();
    add_into(hp, op, n * d);
    rms_norm(hp, w_post.data_ptr<bf16>(), x.data_ptr<bf16>(), n, d, eps);
    auto gu = amx_linear(x, layers[6 * l + 4]);  // [n, 2 inter]
    const int64_t inter = gu.size(1) / 2;
    auto act = torch::empty({n, inter}, opt);
    TORCH_CHECK(inter % 16 == 0, "llama_forward: intermediate size must be a multiple of 16");
    silu_mul(gu.data_ptr<bf16>(), act.data_ptr<bf16>(), n, inter);
    auto down = amx_linear(act, layers[6 * l + 5]);
    const bf16* dp = down.data_ptr<bf16>();
    add_into(hp, dp, n * d);
    for (int64_t want : feature_layers)
      if (want == l) { kept[l] = h.clone(); break; }
  }
  rms_norm(h.data_ptr<bf16>(), final_norm.data_ptr<bf16>(), x.data_ptr<bf16>(), n, d, eps);
  auto head_out = amx_linear(x, head);  // [n, V rounded up to 16] bf16
  // each row's first maximal logit (greedy verification needs only these), read from the bf16 values: the fp32
  // copy below holds the same values, so this is its argmax
  auto top = torch::empty({n}, torch::TensorOptions().dtype(torch::kInt64));
  {
    const int64_t V = head.size(0) * 16;
    const bf16* lp = head_out.data_ptr<bf16>();
    int64_t* tp = top.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const bf16* row = lp + i * V;
      vf best = vset(-INFINITY);
      for (int64_t j = 0; j < V; j += 16) best = vmax(best, load16(row + j));
      const float m = vmaxall(best);
      int64_t j = 0;
      while (static_cast<float>(row[j]) != m) ++j;
      tp[i] = j;
    }
  }
  auto logits = head_out.to(torch::kFloat32);
  torch::Tensor features;
  if (!feature_layers.empty()) {
    std::vector<torch::Tensor> parts;
    for (int64_t want : feature_layers) parts.push_back(kept[want]);
    features = torch::cat(parts, 1);
  }
  return std::vector<torch::Tensor>{logits, features, top};
}

// Gemma 3's RMSNorm, x · (1 + w) with fp32 statistics (LeanGemma3._norm in one call instead of eight torch
// operations, which cost more than the arithmetic for a decoding step's few rows): each row of d elements (the last
// dimension of x, any leading shape and row stride) gets its mean square summed in 16 lanes, then those lanes
// summed in a fixed tree, x · r and then · w1 in fp32 (w1 = 1 + w, fp32), one rounding to bf16. Row by row, so a
// row's bits do not depend on the rows normalised with it. d a multiple of 16.
static void gemma_norm_row(const bf16* row, const float* w1, bf16* out, int64_t d, float eps) {
  vf ss = vzero();
  for (int64_t j = 0; j < d; j += 16) { const vf v = load16(row + j); ss = vfma(v, v, ss); }
  const vf r = vset(1.f / std::sqrt(vsum(ss) / static_cast<float>(d) + eps));
  for (int64_t j = 0; j < d; j += 16) store16(out + j, vmul(vmul(load16(row + j), r), vload(w1 + j)));
}

torch::Tensor gemma_norm(torch::Tensor x, torch::Tensor w1, double eps_d) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w1.scalar_type() == torch::kFloat32 && w1.is_contiguous()
              && w1.numel() == d && d % 16 == 0, "gemma_norm: x bf16 [..., d], w1 fp32 [d], d a multiple of 16");
  auto xc = x.reshape({-1, d}).contiguous();
  const int64_t n = xc.size(0);
  auto out = torch::empty_like(xc);
  const bf16* xp = xc.data_ptr<bf16>();
  const float* wp = w1.data_ptr<float>();
  bf16* op = out.data_ptr<bf16>();
  const float eps = static_cast<float>(eps_d);
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / d), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) gemma_norm_row(xp + i * d, wp, op + i * d, d, eps);
  });
  return out.view(x.sizes());
}

// Gemma 3's query and key heads from a block of qkv rows [n, (H + 2 Hkv) hd]: each head normalised (its q or k norm,
// as gemma_norm) and rotated (as rope above: torch's bf16 x cos + rotate_half(x) sin), so the bits are those of
// gemma_norm followed by LeanLlama._rotate, in one call instead of about twenty. cos, sin [n, hd] bf16 (each row's
// position). Returns queries [n, H hd] (the layout the C++ attention reads) and keys [n, Hkv, hd].
std::vector<torch::Tensor> gemma_qk(torch::Tensor qkv, int64_t H, int64_t Hkv, torch::Tensor qw1, torch::Tensor kw1,
                                    torch::Tensor cos, torch::Tensor sin, double eps_d) {
  const int64_t n = qkv.size(0), hd = qw1.numel(), row = qkv.size(1);
  TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16 && qkv.is_contiguous() && row == (H + 2 * Hkv) * hd
              && hd % 32 == 0 && hd <= 256 && kw1.numel() == hd && qw1.scalar_type() == torch::kFloat32
              && kw1.scalar_type() == torch::kFloat32 && qw1.is_contiguous() && kw1.is_contiguous(),
              "gemma_qk: qkv bf16 [n, (H + 2 Hkv) hd], norm scales fp32 [hd], hd a multiple of 32 up to 256");
  TORCH_CHECK(cos.scalar_type() == torch::kBFloat16 && cos.is_contiguous() && sin.is_contiguous()
              && cos.size(0) == n && cos.size(1) == hd && sin.sizes() == cos.sizes(), "gemma_qk: cos, sin bf16 [n, hd]");
  auto q = torch::empty({n, H * hd}, qkv.options());
  auto k = torch::empty({n, Hkv, hd}, qkv.options());
  const bf16* src = qkv.data_ptr<bf16>();
  const float *qw = qw1.data_ptr<float>(), *kw = kw1.data_ptr<float>();
  const bf16 *cs = cos.data_ptr<bf16>(), *sn = sin.data_ptr<bf16>();
  bf16 *qp = q.data_ptr<bf16>(), *kp = k.data_ptr<bf16>();
  const float eps = static_cast<float>(eps_d);
  at::parallel_for(0, n, 64, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i)
      for (int64_t a = 0; a < H + Hkv; ++a) {
        bf16* out = a < H ? qp + (i * H + a) * hd : kp + (i * Hkv + a - H) * hd;
        gemma_norm_row(src + i * row + a * hd, a < H ? qw : kw, out, hd, eps);
        rope(out, cs + i * hd, sn + i * hd, hd);
      }
  });
  return {q, k};
}

// The attention of llama_forward alone, before its rounding to bf16 (for tests of its batch invariance):
// q [n, H * hd] bf16 (rotated), k/v caches [Hkv, cap, hd] holding the new tokens' entries at start.., mask [n, n]
torch::Tensor llama_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, torch::Tensor mask,
                              int64_t H, double scale, int64_t window) {
  const int64_t n = q.size(0), Hkv = k.size(0), cap = k.size(1), hd = k.size(2);
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 && q.is_contiguous()
              && k.is_contiguous() && v.is_contiguous() && q.size(1) == H * hd && hd % 32 == 0 && hd <= 256
              && H % Hkv == 0 && n >= 1 && n <= 16 && start + n <= cap, "llama_attention: unsupported arguments");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.size(0) == n && mask.size(1) == n && mask.is_contiguous());
  auto out = torch::empty({n, H * hd}, q.options().dtype(torch::kFloat32));
  TORCH_CHECK(window >= 0, "llama_attention: window must be >= 0 (0: none)");
  Attention attention(n, start, H, Hkv, hd, static_cast<float>(scale), mask.data_ptr<bool>(), window);
  attention.run(q.data_ptr<bf16>(), H * hd, k.data_ptr<bf16>(), v.data_ptr<bf16>(), cap, nullptr,
                out.data_ptr<float>());
  return out;
}

// StaticCache.keep_path: the entries at start + nodes[i] move to start + i (nodes ascending, nodes[0] = 0; a source
// is never overwritten before it is read, since start + i <= start + nodes[i] and later sources lie further on)
void cache_keep(std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs, int64_t start, std::vector<int64_t> nodes) {
  for (size_t l = 0; l < ks.size(); ++l)
    for (torch::Tensor* buf : {&ks[l], &vs[l]}) {
      const int64_t heads = buf->size(1), cap = buf->size(2), hd = buf->size(3);
      TORCH_CHECK(start + nodes.back() < cap, "cache_keep: node outside the cache");
      bf16* p = buf->data_ptr<bf16>();
      for (int64_t a = 0; a < heads; ++a)
        for (size_t i = 1; i < nodes.size(); ++i)
          if (nodes[i] != static_cast<int64_t>(i))
            std::memcpy(p + (a * cap + start + i) * hd, p + (a * cap + start + nodes[i]) * hd, hd * sizeof(bf16));
    }
}

}  // namespace hyflash
