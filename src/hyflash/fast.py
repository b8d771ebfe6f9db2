"""A lean forward of our own for Llama-architecture targets, with a preallocated (static) KV cache.

It reads the same weights as the transformers model (the fused q|k|v and gate|up matrices are copies, and in bf16
every matrix is also kept once in oneDNN's packed layout, ``PackedLinear``) and computes the same function — RMSNorm in fp32 then back to the model dtype, RoPE from the model's own
inverse frequencies, grouped-query attention by SDPA, SiLU-gated MLP — with a handful of tensor operations per
layer and no per-step allocation of the cache: keys and values are written in place, and a rollback only moves
the length. Used by ``Target`` when loaded with ``fast=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyflash.packed import PackedLinear


class StaticCache:
    """Keys/values preallocated per layer, each [1, kv_heads, capacity, head_dim] (a buffer per layer rather than one
    shared tensor: writes into slices of one big tensor defeat torch.compile, TARGETS.md)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device=None):
        self.k = [torch.zeros(1, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.capacity, self.length = capacity, 0

    def nbytes(self) -> int:
        """Bytes of the keys/values held (the committed length; the buffers are ``capacity`` long)."""
        k = self.k[0]
        return 2 * len(self.k) * k.shape[1] * k.shape[3] * k.element_size() * self.length

    def allocated_bytes(self) -> int:
        return 2 * len(self.k) * self.k[0].numel() * self.k[0].element_size()


def supports(model) -> bool:
    """The lean path covers plain Llama decoders (SmolLM2 and the like)."""
    c = model.config
    return (getattr(c, "model_type", "") == "llama" and not getattr(c, "attention_bias", False)
            and not getattr(c, "mlp_bias", False) and getattr(c, "hidden_act", "silu") == "silu"
            and (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default") == "default")


class LeanLlama:
    def __init__(self, model, pack: bool = True):
        c = model.config
        self.model = model
        self.H, self.Hkv = c.num_attention_heads, c.num_key_value_heads
        self.hd = getattr(c, "head_dim", None) or c.hidden_size // self.H
        self.eps = c.rms_norm_eps
        self.n_layers = c.num_hidden_layers
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.head = PackedLinear(model.lm_head.weight, pack)
        rot = inner.rotary_emb
        self.inv_freq = rot.inv_freq.float()
        self.rope_scale = float(getattr(rot, "attention_scaling", 1.0))
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append((layer.input_layernorm.weight,
                                    PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), pack),
                                    PackedLinear(a.o_proj.weight, pack), layer.post_attention_layernorm.weight,
                                    PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), pack),
                                    PackedLinear(m.down_proj.weight, pack)))
        self.inter = self.layers[0][4].out_features // 2
        self.scale = self.hd ** -0.5

    def new_cache(self, capacity: int) -> StaticCache:
        return StaticCache(self.n_layers, self.Hkv, self.hd, capacity, self.embed.dtype, self.embed.device)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _rope(self, positions: torch.Tensor, dtype):
        freqs = positions[:, None].float() * self.inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * self.rope_scale).to(dtype), (emb.sin() * self.rope_scale).to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: StaticCache, feature_layers: list[int] | None):
        """ids [n] after cache.length cached tokens → (fp32 logits [n, V], features [n, F] or None)."""
        n, start = ids.shape[0], cache.length
        end = start + n
        if end > cache.capacity:
            raise ValueError(f"static cache of {cache.capacity} tokens is full ({end} needed)")
        h = F.embedding(ids, self.embed)  # [n, d]
        cos, sin = self._rope(torch.arange(start, end, device=ids.device), h.dtype)  # [n, hd]
        cos, sin = cos[None], sin[None]  # broadcast over heads
        H, Hkv, hd = self.H, self.Hkv, self.hd
        mask = None
        if n > 1:  # new token i sees cached tokens and new tokens 0..i
            mask = torch.ones(n, end, dtype=torch.bool, device=ids.device).tril(start)
        keep = set(feature_layers or [])
        feats = []
        for i, (w_in, w_qkv, w_o, w_post, w_gu, w_down) in enumerate(self.layers):
            x = self._norm(h, w_in)
            qkv = w_qkv(x)
            q = qkv[:, : H * hd].view(n, H, hd).transpose(0, 1)
            k = qkv[:, H * hd:(H + Hkv) * hd].view(n, Hkv, hd).transpose(0, 1)
            v = qkv[:, (H + Hkv) * hd:].view(n, Hkv, hd).transpose(0, 1)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            ck, cv = cache.k[i], cache.v[i]
            ck[0, :, start:end] = k
            cv[0, :, start:end] = v
            o = F.scaled_dot_product_attention(q[None], ck[:, :, :end], cv[:, :, :end],
                                               attn_mask=mask, scale=self.scale, enable_gqa=True)
            h = h + w_o(o[0].transpose(0, 1).reshape(n, H * hd))
            gu = w_gu(self._norm(h, w_post))
            h = h + w_down(F.silu(gu[:, : self.inter]) * gu[:, self.inter:])
            if i in keep:
                feats.append(h)
        cache.length = end
        logits = self.head(self._norm(h, self.final_norm)).float()
        features = torch.cat([feats[sorted(keep).index(i)] for i in feature_layers], dim=-1) if feature_layers \
            else None
        return logits, features
