// One forward of a Llama decoder over up to 16 new tokens, in C++: what hyflash.fast.LeanLlama.forward computes
// in Python, with the same bf16 roundings at the same places, in one call instead of ~1,500 small torch operations
// (about half of a decoding step's time on a 2-core CPU once the matmuls run on AMX). Matmuls: amx_linear() of
// amx_linear.cpp. Attention: the new tokens see every cached key and, among themselves, what `mask` allows (a chain:
// the lower triangle; a tree of candidates: each node's ancestors and itself), in fp32 with one rounding to bf16.
#include "amx.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace hyflash {
namespace {

constexpr int64_t kMaxGroup = 8;  // query heads per kv head

// torch's RMSNorm of fast.py: fp32 statistics, the normalised row rounded to bf16, then times the weight in bf16.
// d is a multiple of 16 (checked by the caller).
void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t n, int64_t d, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    const bf16* row = x + i * d;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) { const __m512 v = load16(row + j); ss = _mm512_fmadd_ps(v, v, ss); }
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / d + eps));
    for (int64_t j = 0; j < d; j += 16)
      store16(out + i * d + j, _mm512_mul_ps(load16(w + j), round_bf16(_mm512_mul_ps(load16(row + j), r))));
  }
}

// x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16 (as torch does on bf16 tensors);
// hd a multiple of 32
void rope(bf16* x, const bf16* cos, const bf16* sin, int64_t hd) {
  const int64_t half = hd / 2;
  __m512 out[16];
  for (int64_t e = 0; e < hd; e += 16) {
    const __m512 rot = e < half ? _mm512_sub_ps(_mm512_setzero_ps(), load16(x + e + half)) : load16(x + e - half);
    out[e / 16] = _mm512_add_ps(round_bf16(_mm512_mul_ps(load16(x + e), load16(cos + e))),
                                round_bf16(_mm512_mul_ps(rot, load16(sin + e))));
  }
  for (int64_t e = 0; e < hd; e += 16) store16(x + e, out[e / 16]);
}


}  // namespace

std::vector<torch::Tensor> llama_forward(
    torch::Tensor ids, torch::Tensor embed, std::vector<torch::Tensor> layers, torch::Tensor final_norm,
    torch::Tensor head, std::vector<torch::Tensor> cache_k, std::vector<torch::Tensor> cache_v, int64_t start,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor mask, int64_t H, int64_t Hkv, double eps_d,
    double scale_d, std::vector<int64_t> feature_layers) {
  const int64_t n = ids.size(0), d = embed.size(1), L = static_cast<int64_t>(cache_k.size());
  const int64_t hd = cache_k[0].size(3), cap = cache_k[0].size(2), end = start + n, group = H / Hkv;
  const float eps = static_cast<float>(eps_d), scale = static_cast<float>(scale_d);
  TORCH_CHECK(n >= 1 && n <= 16, "llama_forward: 1 to 16 new tokens");
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 6 * L, "llama_forward: 6 weights per layer");
  TORCH_CHECK(end <= cap, "llama_forward: the cache holds ", cap, " tokens, ", end, " needed");
  TORCH_CHECK(hd % 32 == 0 && hd <= 256 && H % Hkv == 0 && H / Hkv <= kMaxGroup && d % 16 == 0,
              "llama_forward: unsupported geometry");
  TORCH_CHECK(mask.scalar_type() == torch::kBool && mask.size(0) == n && mask.size(1) == n && mask.is_contiguous());
  auto opt = embed.options();
  auto h = embed.index_select(0, ids).contiguous();  // [n, d] bf16
  auto x = torch::empty({n, d}, opt);
  auto attn = torch::empty({n, H * hd}, opt);
  std::vector<torch::Tensor> kept(L);
  const bool* mk = mask.data_ptr<bool>();
  const bf16* cs = cos.data_ptr<bf16>();
  const bf16* sn = sin.data_ptr<bf16>();

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
      for (int64_t a = 0; a < H + Hkv; ++a) rope(r + a * hd, cs + i * hd, sn + i * hd, hd);
      for (int64_t a = 0; a < Hkv; ++a) {
        std::memcpy(kc + (a * cap + start + i) * hd, r + (H + a) * hd, hd * sizeof(bf16));
        std::memcpy(vc + (a * cap + start + i) * hd, r + (H + Hkv + a) * hd, hd * sizeof(bf16));
      }
    }
    bf16* out = attn.data_ptr<bf16>();
    // one task per (kv head, new token), covering the kv head's `group` query heads (each value is read once for
    // them); q·k by bf16 dot products with fp32 accumulation, 16 keys at a time; softmax and p·v in fp32
    at::parallel_for(0, Hkv * n, 1, [&](int64_t first, int64_t last) {
      std::vector<float> score(group * end);
      for (int64_t t = first; t < last; ++t) {
        const int64_t kv = t / n, i = t % n;
        const bf16* kb = kc + kv * cap * hd;
        const bf16* vb = vc + kv * cap * hd;
        __m512i q[kMaxGroup][8];
        for (int64_t g = 0; g < group; ++g)
          for (int64_t e = 0; e < hd / 32; ++e)
            q[g][e] = _mm512_loadu_si512(qp + i * row + (kv * group + g) * hd + 32 * e);
        // scores of every key 0..end-1 (16 at a time), then the mask: -inf where a new token may not look
        float best[kMaxGroup];
        for (int64_t g = 0; g < group; ++g) {
          float* sg = &score[g * end];
          // every key through the same instructions wherever it falls (a block of 16 or the last, partial one),
          // so a token's result does not depend on how many tokens are verified together
          for (int64_t j = 0; j < end; j += 16) {
            const int64_t count = std::min<int64_t>(16, end - j);
            __m512 acc[16];
            for (int64_t u = 0; u < 16; ++u) {
              acc[u] = _mm512_setzero_ps();
              if (u >= count) continue;
              for (int64_t e = 0; e < hd / 32; ++e)
                acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)q[g][e], (__m512bh)_mm512_loadu_si512(kb + (j + u) * hd + 32 * e));
            }
            _mm512_mask_storeu_ps(sg + j, static_cast<__mmask16>((1u << count) - 1),
                                  _mm512_mul_ps(hsum16(acc), _mm512_set1_ps(scale)));
          }
          int64_t j;
          for (j = start; j < end; ++j)
            if (!mk[i * n + (j - start)]) sg[j] = -INFINITY;
          best[g] = -INFINITY;  // a maximum is exact in any order
          for (j = 0; j < end; ++j) best[g] = std::max(best[g], sg[j]);
        }
        float total[kMaxGroup];
        for (int64_t g = 0; g < group; ++g) {
          float* sg = &score[g * end];
          for (int64_t j = 0; j < end; j += 16) {
            const __mmask16 lanes = static_cast<__mmask16>((1u << std::min<int64_t>(16, end - j)) - 1);
            const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, sg + j);
            _mm512_mask_storeu_ps(sg + j, lanes, exp16(_mm512_sub_ps(x, _mm512_set1_ps(best[g]))));
          }
          total[g] = 0.f;  // in key order: masked keys add exact zeros
          for (int64_t j = 0; j < end; ++j) total[g] += sg[j];
        }
        __m512 o[kMaxGroup][16];
        for (int64_t g = 0; g < group; ++g)
          for (int64_t e = 0; e < hd / 16; ++e) o[g][e] = _mm512_setzero_ps();
        for (int64_t j = 0; j < end; ++j) {
          if (j >= start && !mk[i * n + (j - start)]) continue;
          __m512 vv[16];
          for (int64_t e = 0; e < hd / 16; ++e) vv[e] = load16(vb + j * hd + 16 * e);
          for (int64_t g = 0; g < group; ++g) {
            const __m512 p = _mm512_set1_ps(score[g * end + j]);
            for (int64_t e = 0; e < hd / 16; ++e) o[g][e] = _mm512_fmadd_ps(p, vv[e], o[g][e]);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          bf16* dst = out + i * H * hd + (kv * group + g) * hd;
          const __m512 inv = _mm512_set1_ps(1.f / total[g]);
          for (int64_t e = 0; e < hd / 16; ++e) store16(dst + 16 * e, _mm512_mul_ps(o[g][e], inv));
        }
      }
    });
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
  auto logits = amx_linear(x, head).to(torch::kFloat32);
  torch::Tensor features;
  if (!feature_layers.empty()) {
    std::vector<torch::Tensor> parts;
    for (int64_t want : feature_layers) parts.push_back(kept[want]);
    features = torch::cat(parts, 1);
  }
  return std::vector<torch::Tensor>{logits, features};
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
