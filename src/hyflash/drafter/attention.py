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


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [.., N, hd/2] of absolute ``positions`` [N] ([B, 1, N, hd/2] for [B, N]), computed in fp64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim))
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [.., N, hd/2]
    if ang.dim() == 3:
        ang = ang[:, None]  # [B, 1, N, hd/2]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (half-split convention) of x [B, H, N, hd] with tables from ``rope_tables``."""
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class LocalAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, theta: float, eps: float,
                 slots: int = 0):
        super().__init__()
        self.h, self.hkv, self.hd, self.theta = num_heads, num_kv_heads, head_dim, theta
        self.q_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)
        # DrafterConfig.slot_query_scales: slot j's queries are further scaled by slot_q_scale[j] (ones at the start)
        self.slot_q_scale = nn.Parameter(torch.ones(slots, head_dim)) if slots else None

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of context features or slots. x [B, N, d] -> 2 x [B, Hkv, N, hd]."""
        return self.heads_kv(self.k_proj(x), self.v_proj(x), *rope_tables(positions, self.hd, self.theta, x.dtype))

    def heads_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Query projections [B, Q, H·hd] → normed, rotated queries [B, H, Q, hd]. With per-slot query scales, the Q
        rows are whole blocks of slots 0..S−1 in order, or the first Q slots of one block."""
        B, Q, _ = q.shape
        q = self.q_norm(q.view(B, Q, self.h, self.hd))
        if self.slot_q_scale is not None:
            S = self.slot_q_scale.shape[0]
            scale = self.slot_q_scale[:Q] if Q <= S else self.slot_q_scale.repeat(Q // S, 1)
            q = q * scale[:, None, :].to(q.dtype)
        return apply_rope(q.transpose(1, 2), cos, sin)

    def heads_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Key/value projections [B, N, Hkv·hd] → normed, rotated keys and values, 2 x [B, Hkv, N, hd]."""
        B, N, _ = k.shape
        k = self.k_norm(k.view(B, N, self.hkv, self.hd)).transpose(1, 2)
        return apply_rope(k, cos, sin), v.view(B, N, self.hkv, self.hd).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, H, Q, hd], k/v [B, Hkv, T, hd], mask [B, Q, T] or None → [B, Q, H·hd] (before o_proj)."""
        B, _, Q, _ = q.shape
        g = self.h // self.hkv
        if mask is None:  # the runtime: each kv head serves its g query heads, no k/v copies (as hyflash.fast)
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=g > 1)
        else:
            if g > 1:
                k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None])
        return o.transpose(1, 2).reshape(B, Q, self.h * self.hd)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, Q, d] slot states at ``positions`` [B, Q]; ctx_k/ctx_v [B, Hkv, T, hd]; mask [B, Q, T + Q] bool
        (True = may attend) or None (everything visible). Returns [B, Q, d]."""
        cos, sin = rope_tables(positions, self.hd, self.theta, x.dtype)
        q = self.heads_q(self.q_proj(x), cos, sin)
        k_s, v_s = self.heads_kv(self.k_proj(x), self.v_proj(x), cos, sin)
        k = torch.cat([ctx_k, k_s], dim=2)  # [B, Hkv, T + Q, hd]
        v = torch.cat([ctx_v, v_s], dim=2)
        return self.o_proj(self.attend(q, k, v, mask))
