// Shared by the kernels of hyflash.kernels (one extension, built at first use).
#pragma once
#include <torch/extension.h>
#include <vector>

namespace hyflash {
// AMX tile configuration (palette 1): the bytes per row and rows of each of the 8 tiles, loaded per thread
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool init();
torch::Tensor pack(torch::Tensor w);
torch::Tensor huge_empty(int64_t nbytes);
torch::Tensor pack_q8(torch::Tensor w);
torch::Tensor dequantise_q8(torch::Tensor packed, int64_t K);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed);
std::vector<torch::Tensor> llama_forward(
    torch::Tensor ids, torch::Tensor embed, std::vector<torch::Tensor> layers, torch::Tensor final_norm,
    torch::Tensor head, std::vector<torch::Tensor> cache_k, std::vector<torch::Tensor> cache_v, int64_t start,
    torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> parents, int64_t heads, int64_t kv_heads, double eps,
    double scale, std::vector<int64_t> feature_layers);
torch::Tensor gemma_norm(torch::Tensor x, torch::Tensor w1, double eps);
std::vector<torch::Tensor> gemma_qk(torch::Tensor qkv, int64_t heads, int64_t kv_heads, torch::Tensor qw1,
                                    torch::Tensor kw1, torch::Tensor cos, torch::Tensor sin, double eps);
torch::Tensor llama_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t start, torch::Tensor mask,
                              int64_t heads, double scale, int64_t window);
void cache_keep(std::vector<torch::Tensor> ks, std::vector<torch::Tensor> vs, int64_t start, std::vector<int64_t> nodes);
void drafter_commit(torch::Tensor feats, std::vector<torch::Tensor> glob, std::vector<torch::Tensor> layers,
                    std::vector<torch::Tensor> win_k, std::vector<torch::Tensor> win_v,
                    std::vector<torch::Tensor> mem, std::vector<torch::Tensor> conv, int64_t start,
                    torch::Tensor cos, torch::Tensor sin, std::vector<int64_t> dims, double eps);
torch::Tensor drafter_draft(torch::Tensor slots, std::vector<torch::Tensor> layers, std::vector<torch::Tensor> win_k,
                            std::vector<torch::Tensor> win_v, std::vector<torch::Tensor> mem, int64_t count,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor final_norm, torch::Tensor head,
                            std::vector<int64_t> dims, double eps);
std::vector<torch::Tensor> top_probs(torch::Tensor logits, int64_t k);
}  // namespace hyflash
