// The HyFlash drafter's two runtime calls in C++ — commit (fold up to 16 verified target features into the window
// and the recurrent memory) and draft (the block's slot states and draft logits) — for the shipped configuration:
// local attention over a ring window plus the slots, Mamba-2 memory (or none: the sliding-window variant), in bf16
// with fp32 memory. Same computation and roundings as drafter/state.py (DrafterState.commit / draft_hidden) and
// drafter.logits, in one call each instead of ~250 small torch operations per round. The state lives in torch
// tensors owned by DrafterState and is updated in place.
#include "amx.h"
#include "simd.h"
#include <ATen/Parallel.h>
#include <cmath>

namespace hyflash {
namespace {

struct Dims {
  int64_t d, H, Hkv, hd, mH, dk, dv, K, C, cap;
  bool memory;
  float eps;
};

Dims dims_of(const std::vector<int64_t>& v, double eps) {
  TORCH_CHECK(v.size() == 11, "drafter: 11 dimensions");
  Dims g{v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10] != 0, static_cast<float>(eps)};
  TORCH_CHECK(g.d % 16 == 0 && g.hd % 32 == 0 && g.hd <= 256 && g.dv % 16 == 0 && g.H % g.Hkv == 0,
              "drafter: unsupported geometry");
  return g;
}

// RMSNorm of attention.py: fp32, times an fp32 weight, one rounding to bf16. len a multiple of 16.
void norm_row(const bf16* x, const float* w, bf16* out, int64_t len, float eps) {
  vf ss = vzero();
  for (int64_t j = 0; j < len; j += 16) { const vf v = load16(x + j); ss = vfma(v, v, ss); }
  const vf r = vset(1.f / std::sqrt(vsum(ss) / len + eps));
  for (int64_t j = 0; j < len; j += 16)
    store16(out + j, vmul(vmul(load16(x + j), r), vload(w + j)));
}

// apply_rope of attention.py (half split): [x1 cos - x2 sin, x2 cos + x1 sin], products and sums rounded to bf16.
// cos/sin: hd/2 values.
void rope_half(bf16* x, const bf16* cos, const bf16* sin, int64_t hd) {
  const int64_t half = hd / 2;
  for (int64_t e = 0; e < half; e += 16) {
    const vf x1 = load16(x + e), x2 = load16(x + half + e), c = load16(cos + e), s = load16(sin + e);
    const vf a = vsub(round_bf16(vmul(x1, c)), round_bf16(vmul(x2, s)));
    const vf b = vadd(round_bf16(vmul(x2, c)), round_bf16(vmul(x1, s)));
    store16(x + e, a);
    store16(x + half + e, b);
  }
}

// k_norm + RoPE on keys [T, Hkv, hd] (in place) and both into the ring at (start + t) % cap
void keys_into_window(bf16* k, const bf16* v, int64_t T, int64_t ldkv, const Dims& g, const float* k_norm,
                      const bf16* cos, const bf16* sin, int64_t start, bf16* wk, bf16* wv) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t a = 0; a < g.Hkv; ++a) {
      bf16* kr = k + t * ldkv + a * g.hd;
      norm_row(kr, k_norm, kr, g.hd, g.eps);
      rope_half(kr, cos + t * g.hd / 2, sin + t * g.hd / 2, g.hd);
      const int64_t slot = (start + t) % g.cap;
      std::memcpy(wk + (a * g.cap + slot) * g.hd, kr, g.hd * sizeof(bf16));
      std::memcpy(wv + (a * g.cap + slot) * g.hd, v + t * ldkv + a * g.hd, g.hd * sizeof(bf16));
    }
}

inline float silu_bf16(float x) { return static_cast<float>(bf16(x / (1.f + std::exp(-x)))); }
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

}  // namespace

// glob: feature-norm weights fp32 [nf, Dt], fuse (packed), fuse_norm fp32 [d]
// layers, 14 each: norm fp32, read, write, out, gate_up, down (packed), q_norm fp32, k_norm fp32, mlp_norm fp32,
//                  conv weight bf16 [C, K], conv bias bf16 [C], A fp32 [mH] (= -exp(A_log); a positive A[h] = ln 2 /
//                  memory_min_half_life marks a head under the reach floor), dt_bias fp32 [mH],
//                  memory norm fp32 [dv] (the last five empty without memory)
void drafter_commit(torch::Tensor feats, std::vector<torch::Tensor> glob, std::vector<torch::Tensor> layers,
                    std::vector<torch::Tensor> win_k, std::vector<torch::Tensor> win_v,
                    std::vector<torch::Tensor> mem, std::vector<torch::Tensor> conv, int64_t start,
                    torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> dims, double eps) {
  const Dims g = dims_of(dims, eps);
  const int64_t T = feats.size(0), nf = glob[0].size(0), Dt = glob[0].size(1);
  TORCH_CHECK(T >= 1 && T <= 16 && feats.size(1) == nf * Dt && feats.is_contiguous(), "drafter_commit: 1-16 rows");
  auto opt = feats.options();
  auto y = torch::empty({T, nf * Dt}, opt);
  const float* fw = glob[0].data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t l = 0; l < nf; ++l)
      norm_row(feats.data_ptr<bf16>() + t * nf * Dt + l * Dt, fw + l * Dt, y.data_ptr<bf16>() + t * nf * Dt + l * Dt,
               Dt, g.eps);
  auto fused = amx_linear(y, glob[1]);
  auto c = torch::empty({T, g.d}, opt);
  for (int64_t t = 0; t < T; ++t)
    norm_row(fused.data_ptr<bf16>() + t * g.d, glob[2].data_ptr<float>(), c.data_ptr<bf16>() + t * g.d, g.d, g.eps);
  const bf16* cs = cos.data_ptr<bf16>();
  const bf16* sn = sin.data_ptr<bf16>();
  const int64_t L = static_cast<int64_t>(win_k.size());
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &layers[14 * l];
    auto proj = amx_linear(c, w[2]);  // [T, k | v | in_proj]
    const int64_t row = proj.size(1), kv = g.Hkv * g.hd;
    bf16* p = proj.data_ptr<bf16>();
    keys_into_window(p, p + kv, T, row, g, w[7].data_ptr<float>(), cs, sn, start, win_k[l].data_ptr<bf16>(),
                     win_v[l].data_ptr<bf16>());
    if (!g.memory) continue;
    // causal depthwise conv over [conv state (K-1 rows); this block's inputs], as MemoryBranch.write_inputs
    const bf16* xk = p + 2 * kv;  // C conv inputs then mH gates per row
    bf16* st = conv[l].data_ptr<bf16>();
    const bf16* cw = w[9].data_ptr<bf16>();
    const bf16* cb = w[10].data_ptr<bf16>();
    std::vector<bf16> padded((g.K - 1 + T) * g.C);
    std::memcpy(padded.data(), st, (g.K - 1) * g.C * sizeof(bf16));
    for (int64_t t = 0; t < T; ++t) std::memcpy(&padded[(g.K - 1 + t) * g.C], xk + t * row, g.C * sizeof(bf16));
    std::vector<float> act(T * g.C);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t ch = 0; ch < g.C; ++ch) {
        float acc = static_cast<float>(bf16(static_cast<float>(cb[ch]) +
                    static_cast<float>(bf16(static_cast<float>(padded[t * g.C + ch]) * static_cast<float>(cw[ch * g.K])))));
        for (int64_t i = 1; i < g.K; ++i)
          acc = static_cast<float>(bf16(acc + static_cast<float>(bf16(static_cast<float>(padded[(t + i) * g.C + ch]) *
                                                                       static_cast<float>(cw[ch * g.K + i])))));
        act[t * g.C + ch] = silu_bf16(acc);
      }
    std::memcpy(st, &padded[T * g.C], (g.K - 1) * g.C * sizeof(bf16));
    // Mamba-2: dt = softplus(gate + dt_bias), v = x * bf16(dt) (bf16), k shared by the heads, S <- exp(A dt) S + k vᵀ;
    // a head under the reach floor (A[h] > 0: DrafterConfig.memory_long_heads) decays by exp(-A[h] sigmoid(gate + dt_bias))
    const float* A = w[11].data_ptr<float>();
    const float* dtb = w[12].data_ptr<float>();
    float* S = mem[l].data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      const float* k = &act[t * g.C + g.mH * g.dv];
      for (int64_t h = 0; h < g.mH; ++h) {
        const float pre = static_cast<float>(xk[t * row + g.C + h]) + dtb[h];
        const float dt = softplus(pre);
        const float dtb16 = static_cast<float>(bf16(dt));
        const float decay = A[h] > 0.f ? std::exp(-A[h] / (1.f + std::exp(-pre))) : std::exp(A[h] * dt);
        float v[256];
        for (int64_t e = 0; e < g.dv; ++e) v[e] = static_cast<float>(bf16(act[t * g.C + h * g.dv + e] * dtb16));
        float* Sh = S + h * g.dk * g.dv;
        const vf dec = vset(decay);
        for (int64_t i = 0; i < g.dk; ++i) {
          const vf ki = vset(static_cast<float>(bf16(k[i])));
          for (int64_t e = 0; e < g.dv; e += 16) {
            float* s = Sh + i * g.dv + e;
            vstore(s, vfma(ki, vload(v + e), vmul(dec, vload(s))));
          }
        }
      }
    }
  }
}

// slots [S, d] bf16 (anchor embedding, then mask embeddings); count: features committed so far. Returns the draft
// logits [S, V'] (bf16) from the final norm and the (draft-vocabulary) head.
torch::Tensor drafter_draft(torch::Tensor slots, std::vector<torch::Tensor> layers, std::vector<torch::Tensor> win_k,
                            std::vector<torch::Tensor> win_v, std::vector<torch::Tensor> mem, int64_t count,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm, torch::Tensor head,
                            std::vector<int64_t> dims, double eps) {
  const Dims g = dims_of(dims, eps);
  const int64_t S = slots.size(0), ctx = std::min(count, g.cap), L = static_cast<int64_t>(win_k.size());
  const int64_t T = ctx + S, group = g.H / g.Hkv;
  TORCH_CHECK(S >= 1 && S <= 16 && slots.is_contiguous(), "drafter_draft: 1-16 slots");
  auto opt = slots.options();
  auto h = slots.clone();
  auto x = torch::empty({S, g.d}, opt);
  const bf16* cs = cos.data_ptr<bf16>();
  const bf16* sn = sin.data_ptr<bf16>();
  const int64_t attn_w = g.H * g.hd, mem_w = g.memory ? g.mH * g.dv : 0;
  auto cat = torch::empty({S, attn_w + mem_w}, opt);
  for (int64_t l = 0; l < L; ++l) {
    const torch::Tensor* w = &layers[14 * l];
    bf16* hp = h.data_ptr<bf16>();
    for (int64_t s = 0; s < S; ++s) norm_row(hp + s * g.d, w[0].data_ptr<float>(), x.data_ptr<bf16>() + s * g.d, g.d, g.eps);
    auto rd = amx_linear(x, w[1]);  // [S, q | k | v | memory q | z]
    bf16* r = rd.data_ptr<bf16>();
    const int64_t row = rd.size(1), kv = g.Hkv * g.hd;
    bf16* q = r;
    bf16* k = r + attn_w;
    bf16* v = k + kv;
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t a = 0; a < g.H; ++a) {
        bf16* qa = q + s * row + a * g.hd;
        norm_row(qa, w[6].data_ptr<float>(), qa, g.hd, g.eps);
        rope_half(qa, cs + s * g.hd / 2, sn + s * g.hd / 2, g.hd);
      }
      for (int64_t a = 0; a < g.Hkv; ++a) {
        bf16* ka = k + s * row + a * g.hd;
        norm_row(ka, w[7].data_ptr<float>(), ka, g.hd, g.eps);
        rope_half(ka, cs + s * g.hd / 2, sn + s * g.hd / 2, g.hd);
      }
    }
    const bf16* wk = win_k[l].data_ptr<bf16>();
    const bf16* wv = win_v[l].data_ptr<bf16>();
    bf16* out = cat.data_ptr<bf16>();
    const float scale = 1.f / std::sqrt(static_cast<float>(g.hd));
    // every slot sees the window and every slot (bidirectional slot attention)
    at::parallel_for(0, g.H * S, 1, [&](int64_t first, int64_t last) {
      std::vector<float> score(T);
      for (int64_t task = first; task < last; ++task) {
        const int64_t a = task / S, s = task % S, kh = a / group;
        const bf16* qa = q + s * row + a * g.hd;
        float best = -INFINITY;
        for (int64_t j = 0; j < T; ++j) {
          const bf16* kj = j < ctx ? wk + (kh * g.cap + j) * g.hd : k + (j - ctx) * row + kh * g.hd;
          vf acc = vzero();
          for (int64_t e = 0; e < g.hd; e += 16) acc = vfma(load16(qa + e), load16(kj + e), acc);
          score[j] = vsum(acc) * scale;
          best = std::max(best, score[j]);
        }
        int64_t j = 0;
        for (; j + 16 <= T; j += 16)
          vstore(&score[j], exp16(vsub(vload(&score[j]), vset(best))));
        for (; j < T; ++j) score[j] = std::exp(score[j] - best);
        float total = 0.f;
        vf o[16];
        for (int64_t e = 0; e < g.hd / 16; ++e) o[e] = vzero();
        for (j = 0; j < T; ++j) {
          const bf16* vj = j < ctx ? wv + (kh * g.cap + j) * g.hd : v + (j - ctx) * row + kh * g.hd;
          const vf p = vset(score[j]);
          total += score[j];
          for (int64_t e = 0; e < g.hd / 16; ++e) o[e] = vfma(p, load16(vj + 16 * e), o[e]);
        }
        bf16* dst = out + s * (attn_w + mem_w) + a * g.hd;
        for (int64_t e = 0; e < g.hd / 16; ++e) store16(dst + 16 * e, vdiv(o[e], vset(total)));
      }
    });
    if (g.memory) {  // y = Sᵀ q (fp32), RMSNorm(y) ⊙ silu(z)
      const float* St = mem[l].data_ptr<float>();
      const bf16* mq = v + kv;
      const bf16* z = mq + g.mH * g.dk;
      const float qscale = 1.f / std::sqrt(static_cast<float>(g.dk));
      for (int64_t s = 0; s < S; ++s)
        for (int64_t a = 0; a < g.mH; ++a) {
          vf y[16];
          for (int64_t e = 0; e < g.dv / 16; ++e) y[e] = vzero();
          const float* Sh = St + a * g.dk * g.dv;
          for (int64_t i = 0; i < g.dk; ++i) {
            const vf qi = vset(static_cast<float>(bf16(static_cast<float>(mq[s * row + a * g.dk + i]) * qscale)));
            for (int64_t e = 0; e < g.dv / 16; ++e) y[e] = vfma(qi, vload(Sh + i * g.dv + 16 * e), y[e]);
          }
          alignas(64) bf16 yb[256];
          for (int64_t e = 0; e < g.dv / 16; ++e) store16(yb + 16 * e, y[e]);
          norm_row(yb, w[13].data_ptr<float>(), yb, g.dv, g.eps);
          bf16* dst = out + s * (attn_w + mem_w) + attn_w + a * g.dv;
          for (int64_t e = 0; e < g.dv; ++e) {
            const float zz = static_cast<float>(z[s * row + a * g.dv + e]);
            dst[e] = bf16(static_cast<float>(yb[e]) * silu_bf16(zz));
          }
        }
    }
    auto o = amx_linear(cat, w[3]);
    const bf16* op = o.data_ptr<bf16>();
    add_into(hp, op, S * g.d);
    for (int64_t s = 0; s < S; ++s) norm_row(hp + s * g.d, w[8].data_ptr<float>(), x.data_ptr<bf16>() + s * g.d, g.d, g.eps);
    auto gu = amx_linear(x, w[4]);
    const int64_t inter = gu.size(1) / 2;
    TORCH_CHECK(inter % 16 == 0, "drafter: the MLP width must be a multiple of 16");
    auto act = torch::empty({S, inter}, opt);
    silu_mul(gu.data_ptr<bf16>(), act.data_ptr<bf16>(), S, inter);
    auto down = amx_linear(act, w[5]);
    const bf16* dp = down.data_ptr<bf16>();
    add_into(hp, dp, S * g.d);
  }
  for (int64_t s = 0; s < S; ++s)
    norm_row(h.data_ptr<bf16>() + s * g.d, final_norm.data_ptr<float>(), x.data_ptr<bf16>() + s * g.d, g.d, g.eps);
  return amx_linear(x, head);
}

// The k most probable entries of each row of softmax(logits) (bf16 or fp32 [S, V]), best first (ties: the lower
// index): a drafting round's tree needs only these, not the whole [S, V] distribution in fp32.
std::vector<torch::Tensor> top_probs(torch::Tensor logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= 16 && k <= logits.size(1), "top_probs: [S, V] logits, 1 <= k <= 16");
  TORCH_CHECK(logits.scalar_type() == torch::kBFloat16 || logits.scalar_type() == torch::kFloat32,
              "top_probs: bf16 or fp32 logits");
  const auto x = logits.contiguous();
  const bool f32 = x.scalar_type() == torch::kFloat32;
  const int64_t S = x.size(0), V = x.size(1);
  auto probs = torch::empty({S, k}, torch::TensorOptions().dtype(torch::kFloat32));
  auto index = torch::empty({S, k}, torch::TensorOptions().dtype(torch::kInt64));
  std::vector<float> widened(f32 ? 0 : V);  // a bf16 row widened once to fp32; fp32 rows are read in place
  for (int64_t s = 0; s < S; ++s) {
    const float* row = f32 ? x.data_ptr<float>() + s * V : widened.data();
    if (!f32) {
      const bf16* src = x.data_ptr<bf16>() + s * V;
      int64_t j = 0;
      for (; j + 16 <= V; j += 16) vstore(&widened[j], load16(src + j));
      for (; j < V; ++j) widened[j] = static_cast<float>(src[j]);
    }
    float best_v[16];
    int64_t best_i[16];
    int64_t have = 0;
    float best = -INFINITY;
    for (int64_t j0 = 0; j0 < V; j0 += 16) {
      const int64_t len = std::min<int64_t>(16, V - j0);
      // a block of 16 whose largest value is not above the k-th best so far changes nothing (most blocks)
      const vf blk = vload_first(&row[j0], static_cast<int>(len), -INFINITY);
      const float top = vmaxall(blk);
      best = std::max(best, top);
      if (have == k && !(top > best_v[k - 1])) continue;
      for (int64_t j = j0; j < j0 + len; ++j) {
        const float v = row[j];
        if (have == k && !(v > best_v[k - 1])) continue;  // equal values: the lower index keeps its place
        int64_t at = have < k ? have++ : k - 1;
        while (at > 0 && v > best_v[at - 1]) { best_v[at] = best_v[at - 1]; best_i[at] = best_i[at - 1]; --at; }
        best_v[at] = v;
        best_i[at] = j;
      }
    }
    vf acc = vzero();
    int64_t j = 0;
    for (; j + 16 <= V; j += 16) acc = vadd(acc, exp16(vsub(vload(&row[j]), vset(best))));
    float total = vsum(acc);
    for (; j < V; ++j) total += std::exp(row[j] - best);
    for (int64_t r = 0; r < k; ++r) {
      probs.data_ptr<float>()[s * k + r] = std::exp(best_v[r] - best) / total;
      index.data_ptr<int64_t>()[s * k + r] = best_i[r];
    }
  }
  return {probs, index};
}

}  // namespace hyflash
