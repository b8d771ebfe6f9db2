// Shared by the kernels of hyflash.kernels (one extension, built at first use).
#pragma once
#include <torch/extension.h>
#include <vector>

namespace hyflash {
bool init();
torch::Tensor pack(torch::Tensor w);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed);
std::vector<torch::Tensor> llama_forward(
    torch::Tensor ids, torch::Tensor embed, std::vector<torch::Tensor> layers, torch::Tensor final_norm,
    torch::Tensor head, std::vector<torch::Tensor> cache_k, std::vector<torch::Tensor> cache_v, int64_t start,
    torch::Tensor cos, torch::Tensor sin, torch::Tensor mask, int64_t heads, int64_t kv_heads, double eps,
    double scale, std::vector<int64_t> feature_layers);
}  // namespace hyflash
