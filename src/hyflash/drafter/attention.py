"""Local attention: queries from the draft slots; keys/values over the committed window plus the slots.

Context features and slots go through the same key/value projections (DFlash-style injection); RoPE on absolute
positions, so cached context keys stay valid however they are stored (a ring buffer needs no reordering).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * w, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split convention). x [B, H, N, hd]; positions [N] or [B, N] absolute positions."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float64) / hd))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [.., N, hd/2]
    if ang.dim() == 3:
        ang = ang[:, None]  # [B, 1, N, hd/2]
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LocalAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, theta: float, eps: float):
        super().__init__()
        self.h, self.hkv, self.hd, self.theta = num_heads, num_kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of context features or slots. x [B, N, d] -> 2 x [B, Hkv, N, hd]."""
        B, N, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, N, self.hkv, self.hd)).transpose(1, 2)
        v = self.v_proj(x).view(B, N, self.hkv, self.hd).transpose(1, 2)
        return rope(k, positions, self.theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, d] slot states at ``positions`` [B, Q]; ctx_k/ctx_v [B, Hkv, T, hd]; mask [B, Q, T + Q] bool
        (True = may attend) or None (everything visible). Returns [B, Q, d]."""
        B, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, Q, self.h, self.hd)).transpose(1, 2)
        q = rope(q, positions, self.theta)
        k_s, v_s = self.keys_values(x, positions)
        k = torch.cat([ctx_k, k_s], dim=2)  # [B, Hkv, T + Q, hd]
        v = torch.cat([ctx_v, v_s], dim=2)
        if self.hkv != self.h:
            k = k.repeat_interleave(self.h // self.hkv, dim=1)
            v = v.repeat_interleave(self.h // self.hkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, Q, self.h * self.hd))
