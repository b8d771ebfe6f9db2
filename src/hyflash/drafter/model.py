"""The HyFlash drafter network: feature fusion, layers with two branches (local attention + recurrent memory), heads.

Every layer: h ← h + Attn(n(h)) + Mem(n(h)); h ← h + MLP(n'(h)).
- Attn: slots attend to the last W committed features and to each other (bidirectionally).
- Mem: the committed features are written into a fixed-size recurrent state (Mamba-2 or Gated DeltaNet); each slot
  reads it with its own query. The write path sees only committed features, so drafting never changes it.

``forward_train`` drafts blocks at many anchors of one sequence in a single pass; it computes exactly what the
runtime (``state.DrafterState``: commit features, then draft) computes for each anchor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hyflash.drafter import memory as mem
from hyflash.drafter.attention import LocalAttention, RMSNorm
from hyflash.drafter.config import DrafterConfig

# copy_head_tokens: the score (after copy_read's r^-0.5) of a token against itself at initialisation; other tokens
# score ~N(0, 8/√r) (σ 1 at rank 64), so over a window of 256 a unigram match takes much of the weight and a bigram
# (twice the score) nearly all of it
COPY_MATCH_SCORE = 8.0


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class MemoryBranch(nn.Module):
    """Write: committed feature c_t → causal conv → (k_t, v_t, g_t[, β_t]) folded into S (see memory.py).
    Read: slot state x → query q, gate z; y = RMSNorm(Sᵀq) ⊙ silu(z) → out projection.

    mamba2 (SSD): k = B_t, v = x_t·Δ_t, g = A·Δ_t, Δ = softplus(·+dt_bias), A = −exp(A_log) per head.
    gdn: k, q L2-normalised, v = x_t, β = sigmoid(·), g = −exp(A_log)·softplus(·+dt_bias).
    """

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.kind = cfg.memory
        self.H, self.dk, self.dv, self.K = cfg.memory_heads, cfg.memory_state_dim, cfg.memory_head_dim, cfg.conv_kernel
        self.long_heads = cfg.memory_long_heads
        self.decay_cap = math.log(2) / cfg.memory_min_half_life  # the long heads' largest per-feature forgetting
        d = cfg.hidden_size
        n_k = self.dk if self.kind == "mamba2" else self.H * self.dk  # Mamba-2 shares B over heads (one group)
        self.conv_dim = self.H * self.dv + n_k
        n_gates = self.H * (1 if self.kind == "mamba2" else 2)  # Δ (and β for gdn)
        self.in_proj = nn.Linear(d, self.conv_dim + n_gates, bias=False)
        self.conv = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=True)
        self.q_proj = nn.Linear(d, self.H * self.dk, bias=False)
        self.z_proj = nn.Linear(d, self.H * self.dv, bias=False)
        self.norm = RMSNorm(self.dv, cfg.rms_eps)
        self.out_proj = nn.Linear(self.H * self.dv, d, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.linspace(1.0, 16.0, self.H)))
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), self.H))
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)
        with torch.no_grad():  # long heads (the reach floor) start at twice the floor's half-life: sigmoid(0) = 1/2
            self.dt_bias[: self.long_heads] = 0.0

    def conv_state_shape(self) -> tuple[int, int]:
        return (self.K - 1, self.conv_dim)

    def write_inputs(self, c: torch.Tensor, conv_state: torch.Tensor | None = None, proj: torch.Tensor | None = None):
        """c [B, T, d] committed (fused) features → k [B,T,H,dk], v [B,T,H,dv], g [B,T,H], β [B,T,H] or None,
        and the new conv state [B, K−1, conv_dim] (the last K−1 conv inputs). ``proj``: in_proj(c), if computed."""
        B, T, _ = c.shape
        proj = self.in_proj(c) if proj is None else proj
        xk, gates = proj[..., : self.conv_dim], proj[..., self.conv_dim:]
        if conv_state is None:
            conv_state = xk.new_zeros(B, self.K - 1, self.conv_dim)
        padded = torch.cat([conv_state.to(xk.dtype), xk], dim=1)  # [B, K-1+T, C]
        new_state = padded[:, -(self.K - 1):] if self.K > 1 else padded[:, :0]
        # the depthwise causal conv as K shifted multiply-adds: same function as self.conv (cross-correlation over
        # the padded stream), but its backward is far cheaper on CPU than the convolution kernel's
        w = self.conv.weight[:, 0]                                 # [C, K]
        acc = self.conv.bias + padded[:, 0:T] * w[:, 0]
        for i in range(1, self.K):
            acc = acc + padded[:, i:i + T] * w[:, i]
        xk = F.silu(acc)  # [B, T, C], causal
        x, k = xk[..., : self.H * self.dv], xk[..., self.H * self.dv:]
        x = x.view(B, T, self.H, self.dv)
        f = _state_dtype(c.dtype)  # decay and gates in fp32 even when the drafter runs in bf16
        A = -torch.exp(self.A_log.to(f))
        gates = gates.to(f)
        if self.kind == "mamba2":
            pre = gates + self.dt_bias.to(f)
            dt = F.softplus(pre)  # [B, T, H]
            k = k.view(B, T, 1, self.dk).expand(B, T, self.H, self.dk)
            v = x * dt.to(x.dtype)[..., None]
            return k, v, self._floor(A * dt, pre), None, new_state
        a, b = gates[..., : self.H], gates[..., self.H:]
        pre = a + self.dt_bias.to(f)
        g = A * F.softplus(pre)
        k = F.normalize(k.view(B, T, self.H, self.dk), dim=-1)
        return k, x, self._floor(g, pre), torch.sigmoid(b), new_state

    def _floor(self, g: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Log-decays g [.., H] (≤ 0) with the first ``long_heads`` replaced by −decay_cap · sigmoid(pre), pre the
        gate's pre-activation (``DrafterConfig``: the reach floor): a rate the gate still chooses per feature, within
        (0, decay_cap), so such a head's half-life stays above memory_min_half_life."""
        if not self.long_heads:
            return g
        n = self.long_heads
        return torch.cat([-self.decay_cap * torch.sigmoid(pre[..., :n]), g[..., n:]], dim=-1)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Slot states [B, Q, d] → read queries [B, H, Q, dk]."""
        return self.heads_q(self.q_proj(x))

    def heads_q(self, q: torch.Tensor) -> torch.Tensor:
        """Query projections [B, Q, H·dk] → read queries [B, H, Q, dk]."""
        B, Q, _ = q.shape
        q = q.view(B, Q, self.H, self.dk)
        if self.kind == "gdn":
            q = F.normalize(q, dim=-1)
        return q.transpose(1, 2) * self.dk ** -0.5

    def output(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x [B, Q, d] slot states, y [B, H, Q, dv] memory read → [B, Q, d]."""
        return self.out_proj(self.gated(y, self.z_proj(x)))

    def gated(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [B, H, Q, dv] memory read, z [B, Q, H·dv] gate projections → RMSNorm(y) ⊙ silu(z), [B, Q, H·dv]."""
        B, Q, _ = z.shape
        y = self.norm(y.transpose(1, 2).to(z.dtype)) * F.silu(z.view(B, Q, self.H, self.dv))
        return y.reshape(B, Q, self.H * self.dv)


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.attn = LocalAttention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                   cfg.rope_theta, cfg.rms_eps, cfg.block_size if cfg.slot_query_scales else 0)
        self.memory = MemoryBranch(cfg) if cfg.has_memory else None
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, positions, ctx_k, ctx_v, mask, read_memory):
        """h [B, Q, d]; ``read_memory(q [B,H,Q,dk]) -> [B,H,Q,dv]`` reads this layer's committed-feature memory."""
        x = self.norm(h)
        out = self.attn(x, positions, ctx_k, ctx_v, mask)
        if self.memory is not None:
            out = out + self.memory.output(x, read_memory(self.memory.query(x)))
        h = h + out
        return h + self.mlp(self.mlp_norm(h))


def dpfp(x: torch.Tensor, nu: int) -> torch.Tensor:
    """Deterministic parameter-free projection (Schlag, Irie & Schmidhuber 2021, "Linear Transformers Are Secretly
    Fast Weight Programmers"): [.., r] → [.., 2·r·ν], ReLU([x, −x]) times itself rolled by 1..ν, concatenated."""
    y = F.relu(torch.cat([x, -x], dim=-1))
    return torch.cat([y * torch.roll(y, shifts=i, dims=-1) for i in range(1, nu + 1)], dim=-1)


class HyFlashDrafter(nn.Module):
    """The drafter. ``embed_weight`` / ``head_weight`` are the target's input embedding and LM head (frozen,
    shared, never saved with the drafter)."""

    def __init__(self, cfg: DrafterConfig, embed_weight: torch.Tensor, head_weight: torch.Tensor):
        super().__init__()
        self.config = cfg
        d, n_feat = cfg.hidden_size, len(cfg.target_layers)
        # per-target-layer norm first: target features differ in scale by orders of magnitude across layers
        self.feature_norms = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_eps) for _ in range(n_feat))
        self.fuse = nn.Linear(n_feat * cfg.target_hidden_size, d, bias=False)
        self.fuse_norm = RMSNorm(d, cfg.rms_eps)
        if cfg.context_lags:  # lagged context features (DrafterConfig.context_lags)
            self.lag_down = nn.Linear(d, cfg.context_lag_rank, bias=False)
            self.lag_up = nn.Linear(cfg.context_lags * cfg.context_lag_rank, d, bias=False)
            nn.init.zeros_(self.lag_up.weight)
        self.mask_embedding = nn.Parameter(torch.randn(d) * 0.02)
        if cfg.slot_embeddings:  # DrafterConfig.slot_embeddings: one more learned input per mask slot
            self.slot_embedding = nn.Parameter(torch.randn(cfg.block_size - 1, d) * 0.02)
        if cfg.copy_head_rank:  # DrafterConfig.copy_head_rank: the copy head
            r = cfg.copy_head_rank
            self.copy_q = nn.Linear(2 * d, r, bias=False)  # [anchor embedding; committed feature before the anchor]
            self.copy_k = nn.Linear(2 * d, r, bias=False)  # [committed feature t; committed feature t − 1]
            self.copy_v = nn.Linear(d, r, bias=False)
            self.copy_up = nn.Linear(r, d, bias=False)
            nn.init.zeros_(self.copy_up.weight)
        if cfg.copy_head_tokens:  # DrafterConfig.copy_head_tokens: [token; token before] into keys and queries
            self.copy_qt = nn.Linear(2 * d, r, bias=False)
            self.copy_kt = nn.Linear(2 * d, r, bias=False)
            self.copy_vt = nn.Linear(d, r, bias=False)
            with torch.no_grad():  # q = k at init: an exact bigram lookup
                # orthonormal rows: a normalised embedding (unit variance per component) projects to r components of
                # unit variance, so a token scores s²·r·r^-0.5 against itself in copy_read and ~N(0, s²) against
                # another; s² = COPY_MATCH_SCORE / √r puts a unigram match at COPY_MATCH_SCORE, a bigram at twice it
                w = torch.cat([nn.init.orthogonal_(torch.empty(r, d)) for _ in range(2)], dim=1)
                w *= (COPY_MATCH_SCORE / r ** 0.5) ** 0.5
                self.copy_qt.weight.copy_(w)
                self.copy_kt.weight.copy_(w)
        if cfg.copy_memory:  # DrafterConfig.copy_memory
            self.copy_beta = nn.Linear(d, 1)  # write strength of each committed feature's value
            self.copy_memory_up = nn.Linear(cfg.copy_head_rank, d, bias=False)
            nn.init.zeros_(self.copy_memory_up.weight)
        if cfg.copy_memory_gate:  # DrafterConfig.copy_memory_gate: per slot, a scale and a bias of the best score
            self.copy_gate_scale = nn.Parameter(torch.zeros(cfg.block_size))
            self.copy_gate_bias = nn.Parameter(torch.zeros(cfg.block_size))
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_eps)
        if cfg.causal_head_rank:
            self.causal_down = nn.Linear(d, cfg.causal_head_rank, bias=False)
            self.causal_up = nn.Linear(cfg.causal_head_rank, d, bias=False)
            nn.init.zeros_(self.causal_up.weight)
        self._packed_head = None  # set by pack_for_inference
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("head_weight", head_weight.detach(), persistent=False)
        if cfg.draft_vocab_size:  # saved with the drafter; set from token frequencies before training
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))
            self.register_buffer("draft_head_weight", self.head_weight[: cfg.draft_vocab_size], persistent=False)
        else:
            self.draft_vocab = None

    # --------------------------------------------------------------------------------------- pieces
    def fuse_features(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [.., n_layers * D_t] → committed features [.., d]: per-layer RMSNorm, concat, linear,
        RMSNorm."""
        x = feats.to(self.fuse.weight.dtype).unflatten(-1, (len(self.feature_norms), -1))  # [.., n_layers, D_t]
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x  # as RMSNorm, all layers at once
        w = torch.stack([n.weight for n in self.feature_norms]).to(xf.dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.feature_norms[0].eps) * w
        return self.fuse_norm(self.fuse(y.to(x.dtype).flatten(-2)))

    def lag_state_shape(self) -> tuple[int, int]:
        """The fused features the runtime keeps for the lagged context features: the last L (0 without them)."""
        return (self.config.context_lags, self.config.hidden_size)

    def committed(self, feats: torch.Tensor, lag_state: torch.Tensor | None = None):
        """Target features [B, T, n_layers * D_t] of positions n..n+T−1 → (committed features [B, T, d] the layers
        read, new lag state [B, L, d]). With lagged context features, c'_t = c_t + up([down(c_{t−1}); …;
        down(c_{t−L})]), where ``lag_state`` holds c_{n−L}..c_{n−1} (zeros before position 0: None)."""
        c = self.fuse_features(feats)
        L = self.config.context_lags
        if not L:
            return c, c[:, :0]
        B, T, d = c.shape
        if lag_state is None:
            lag_state = c.new_zeros(B, L, d)
        stream = torch.cat([lag_state.to(c.dtype), c], dim=1)  # [B, L + T, d]: positions n−L .. n+T−1
        low = self.lag_down(stream)  # [B, L + T, r]
        lagged = torch.cat([low[:, L - l: L - l + T] for l in range(1, L + 1)], dim=-1)  # lag l: positions t − l
        return c + self.lag_up(lagged), stream[:, -L:]

    def slot_inputs(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor_ids [B, n] → slot inputs [B, n, S, d]: the anchor's embedding, then mask embeddings (plus each
        slot's own with ``slot_embeddings``)."""
        S, d = self.config.block_size, self.config.hidden_size
        anchor = F.embedding(anchor_ids, self.embed_weight).to(self.mask_embedding.dtype)  # [B, n, d]
        masks = self.mask_embedding.expand(*anchor_ids.shape, S - 1, d)
        if self.config.slot_embeddings:
            masks = masks + self.slot_embedding
        return torch.cat([anchor[..., None, :], masks], dim=-2)

    def copy_token_embeddings(self, ids: torch.Tensor, dtype: torch.dtype, e: torch.Tensor | None = None):
        """RMS-normalised token embeddings [.., d] of ids [..] (copy_head_tokens' keys, queries and values); ``e``:
        their embeddings, when already looked up."""
        e = F.embedding(ids, self.embed_weight) if e is None else e
        return F.rms_norm(e.float(), (e.shape[-1],), eps=self.config.rms_eps).to(dtype)

    def copy_keys_values(self, c: torch.Tensor, before: torch.Tensor, e: torch.Tensor | None = None,
                         e_before: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy head's keys and values [B, T, r] of committed features c [B, T, d] (positions n..n+T−1), given
        the one before them, ``before`` [B, 1, d] (zeros at position 0). With copy_head_tokens also their tokens'
        normalised embeddings e [B, T, d] and the one before them, ``e_before`` [B, 1, d] (zeros at position 0)."""
        prev = torch.cat([before.to(c.dtype), c[:, :-1]], dim=1)
        k, v = self.copy_k(torch.cat([c, prev], dim=-1)), self.copy_v(c)
        if self.config.copy_head_tokens:
            e_prev = torch.cat([e_before.to(e.dtype), e[:, :-1]], dim=1)
            k = k + self.copy_kt(torch.cat([e, e_prev], dim=-1).to(k.dtype))
            v = v + self.copy_vt(e.to(v.dtype))
        return k, v

    def copy_query(self, anchor_ids: torch.Tensor, before: torch.Tensor,
                   e_before: torch.Tensor | None = None) -> torch.Tensor:
        """The copy head's queries [B, n, r] of anchors [B, n] and the committed feature before each [B, n, d] (with
        copy_head_tokens also the normalised embedding of the token before each, ``e_before`` [B, n, d])."""
        e = F.embedding(anchor_ids, self.embed_weight)
        q = self.copy_q(torch.cat([e.to(before.dtype), before], dim=-1))
        if self.config.copy_head_tokens:
            ea = self.copy_token_embeddings(anchor_ids, q.dtype, e)
            q = q + self.copy_qt(torch.cat([ea, e_before.to(q.dtype)], dim=-1))
        return q

    def copy_read(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, anchors: torch.Tensor,
                  start: int, best: bool = False):
        """The copy head's slot inputs [B, n, S, d] for blocks at ``anchors`` [B, n] with queries q [B, n, r], from
        keys and values k, v [B, M, r] of committed features at positions start..start+M−1. One softmax per slot: slot
        j of the block at a weighs positions t within the window (t ≥ a − W) whose feature j + 1 later is committed
        (t + 1 + j ≤ a − 1) by q·k_t, and reads v_{t+1+j}; a slot with no such t reads nothing. Returns them and,
        with ``best``, each slot's best score [B, n, S] (0 where it sees nothing; copy_memory_gate reads it), else
        None."""
        S, W = self.config.block_size, self.config.attention_window
        B, M, r = k.shape
        scores = torch.einsum("bnr,bmr->bnm", q, k) * r ** -0.5
        t = start + torch.arange(M, device=k.device)
        a = anchors[..., None]  # [B, n, 1]
        seen = (t >= a - W) if W is not None else torch.ones_like(t >= a)
        reads, tops = [], []
        for j in range(S):
            ok = seen & (t <= a - 2 - j)
            masked = scores.masked_fill(~ok, torch.finfo(scores.dtype).min)
            w = torch.softmax(masked, dim=-1) * ok.any(-1, keepdim=True)
            later = F.pad(v[:, 1 + j:], (0, 0, 0, min(1 + j, M)))  # later[t] = v[t + 1 + j]
            reads.append(torch.einsum("bnm,bmr->bnr", w, later))
            if best:
                tops.append(torch.where(ok.any(-1), masked.amax(-1), 0.0))
        return self.copy_up(torch.stack(reads, dim=2)), torch.stack(tops, dim=-1) if best else None

    def copy_memory_read(self, y: torch.Tensor, best: torch.Tensor | None) -> torch.Tensor:
        """The copy memory's slot inputs [B, n, S, d] from its reads y [B, n, S, r], gated by the window's best
        scores [B, n, S] with copy_memory_gate (``best`` is then required)."""
        if self.config.copy_memory_gate:
            y = y * torch.sigmoid(best * self.copy_gate_scale + self.copy_gate_bias)[..., None].to(y.dtype)
        return self.copy_memory_up(y)

    def copy_memory_key(self, x: torch.Tensor) -> torch.Tensor:
        """A copy key or query [.., r] as the copy memory writes or reads it: L2-normalised, after the DPFP expansion
        to [.., 2·r·ν] with copy_memory_dpfp = ν."""
        nu = self.config.copy_memory_dpfp
        return F.normalize(dpfp(x, nu) if nu else x, dim=-1)

    def copy_memory_inputs(self, c: torch.Tensor, k: torch.Tensor, v: torch.Tensor, recent: torch.Tensor):
        """The copy memory's writes for committed features c [B, T, d] (positions n..n+T−1) with copy keys and values
        k, v [B, T, r], given ``recent`` [B, S, K], the memory keys (``copy_memory_key``) of positions n−S..n−1 (zeros
        before position 0). Head j of position p pairs the key of feature p − 1 − j with the value of feature p: →
        keys [B, T, S, K], values [B, T, S, r], log-decays (zeros) and write strengths [B, T, S], and the new
        ``recent``."""
        return self.copy_memory_writes(k, v, self.copy_memory_beta(c), recent)

    def copy_memory_beta(self, c: torch.Tensor) -> torch.Tensor:
        """The copy memory's write strength [B, T] of committed features c [B, T, d], shared by its heads."""
        return torch.sigmoid(self.copy_beta(c)).squeeze(-1)

    def copy_memory_writes(self, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, recent: torch.Tensor):
        """``copy_memory_inputs`` from the copy keys and values k, v [B, T, r] and write strengths beta [B, T] of
        positions n..n+T−1 (what a delayed copy memory keeps queued until it folds them)."""
        S, T = self.config.block_size, k.shape[1]
        stream = torch.cat([recent.to(k.dtype), self.copy_memory_key(k)], dim=1)  # positions n−S .. n+T−1
        keys = torch.stack([stream[:, S - 1 - j: S - 1 - j + T] for j in range(S)], dim=2)
        beta = beta[..., None].expand(-1, -1, S)
        return keys, v[:, :, None].expand(-1, -1, S, -1), torch.zeros_like(beta), beta, stream[:, -S:]

    def copy_slot_inputs(self, c: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Training: the copy head's slot inputs [B, n, S, d] at every anchor of a sequence (committed features c of
        positions 0..T−1). Anchors are ≥ 1 (a batch pads with anchor 1, masked: see train.make_batch)."""
        zero = c.new_zeros(c.shape[0], 1, c.shape[-1])
        at = (anchors - 1)[..., None].expand(-1, -1, c.shape[-1])
        e = e_before = None
        if self.config.copy_head_tokens:
            e = self.copy_token_embeddings(input_ids, c.dtype)
            e_before = torch.gather(e, 1, at)  # token a − 1
        k, v = self.copy_keys_values(c, zero, e, zero)
        q = self.copy_query(torch.gather(input_ids, 1, anchors), torch.gather(c, 1, at), e_before)  # feature a − 1
        out, best = self.copy_read(q, k, v, anchors, 0, best=self.config.copy_memory_gate)
        if self.config.copy_memory:
            S = self.config.block_size
            K = self.config.copy_memory_key_dim
            f = _state_dtype(q.dtype)
            folded = (anchors - self.config.copy_memory_delay).clamp(min=0)  # the memory at a holds writes < a − delay
            # the heads' keys are one stream at delays 1..S (as copy_memory_inputs): read it once
            stream = torch.cat([k.new_zeros(k.shape[0], S, K), self.copy_memory_key(k)], dim=1)[:, :-1]
            beta = self.copy_memory_beta(c)  # shared by the heads
            y = mem.read_at_delayed(stream.to(f), v.to(f), beta.to(f), self.copy_memory_key(q).to(f), folded, S,
                                    limit=self.config.memory_limit)
            out = out + self.copy_memory_read(y.transpose(1, 2).to(q.dtype), best)
        return out

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Restrict the LM head to ``token_ids`` (e.g. the target's most frequent tokens)."""
        if self.draft_vocab is None or token_ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"expected {self.config.draft_vocab_size} draft-vocabulary ids")
        self.draft_vocab.copy_(token_ids)
        self.draft_head_weight = self.head_weight[self.draft_vocab.to(self.head_weight.device)]
        self._packed_head = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., d] → [.., V], or [.., draft_vocab_size] over the draft vocabulary (see ``token_ids``)."""
        if self._packed_head is not None and not self.training:
            return self._packed_head(self.norm(h))
        w = self.head_weight if self.draft_vocab is None else self.draft_head_weight
        return F.linear(self.norm(h), w.to(h.dtype))

    def pack_for_inference(self) -> int:
        """Pack the LM head's (and the causal head's) bf16 weights once (``hyflash.packed``): a drafting
        round reads them faster on CPU. The layers' weights are packed, fused, by the runtime (``state.DrafterState``)
        and are not packed here a second time. For inference with fixed weights; ``unpack`` undoes it. Returns how
        many matrices were packed."""
        from hyflash.packed import PackedLinear, pack_linears

        n = sum(pack_linears(m) for m in (getattr(self, "causal_down", None), getattr(self, "causal_up", None))
                if m is not None)
        w = self.head_weight if self.draft_vocab is None else self.draft_head_weight
        head = PackedLinear(w) if w.dtype == torch.bfloat16 else None
        self._packed_head = head if head is not None and head.is_packed else None
        return n + (self._packed_head is not None)

    def unpack(self) -> None:
        from hyflash.packed import unpack_linears

        unpack_linears(self)
        self._packed_head = None

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into ``logits``' last dimension → target token ids."""
        return index if self.draft_vocab is None else self.draft_vocab[index]

    def full_vocab(self, probs: torch.Tensor) -> torch.Tensor:
        """A distribution over ``logits``' last dimension → the same distribution over the target's vocabulary."""
        if self.draft_vocab is None:
            return probs
        full = probs.new_zeros(*probs.shape[:-1], self.head_weight.shape[0])
        return full.index_copy_(-1, self.draft_vocab, probs)

    def causal_bias_hidden(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """DSpark's intra-block causal head: a rank-r hidden offset from the previous slot's token, which the LM head
        turns into a low-rank logit bias."""
        e = F.embedding(prev_ids, self.embed_weight).to(self.causal_down.weight.dtype)
        return self.causal_up(self.causal_down(e))

    # ------------------------------------------------------------------------------------- training
    def block_mask(self, anchors: torch.Tensor, T: int) -> torch.Tensor:
        """[B, n·S, T + n·S] bool: a slot of the block at anchor a sees committed features t < a (and t ≥ a − W with
        a window) and the slots of its own block (only itself when slot attention is off)."""
        cfg, S = self.config, self.config.block_size
        B, n = anchors.shape
        a = anchors.repeat_interleave(S, dim=1)[..., None]  # [B, Q, 1]
        t = torch.arange(T, device=anchors.device)
        ctx = t < a
        if cfg.attention_window is not None:
            ctx &= t >= a - cfg.attention_window
        block = torch.arange(n * S, device=anchors.device) // S
        if cfg.slot_attention:
            slots = block[:, None] == block[None, :]
        else:
            slots = torch.eye(n * S, dtype=torch.bool, device=anchors.device)
        return torch.cat([ctx, slots.expand(B, -1, -1)], dim=-1)

    def forward_train(self, features: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor,
                      prev_ids: torch.Tensor | None = None, return_hidden: bool = False) -> torch.Tensor:
        """Draft a block at every anchor of a sequence in one pass.

        features [B, T, n_layers·D_t] target features of positions 0..T−1; input_ids [B, T]; anchors [B, n] positions
        (1 ≤ a < T) whose token is the anchor and whose committed prefix is 0..a−1. ``prev_ids`` [B, n, S]: the token
        before each slot (teacher forcing of the causal head; needed only when it is on).
        Returns logits [B, n, S, V] (or final hidden states with ``return_hidden``).
        """
        cfg, S = self.config, self.config.block_size
        B, T, _ = features.shape
        n = anchors.shape[1]
        c = self.committed(features)[0]  # [B, T, d]
        ctx_pos = torch.arange(T, device=c.device)
        h = self.slot_inputs(torch.gather(input_ids, 1, anchors))  # [B, n, S, d]
        if cfg.copy_head_rank:
            h = h + self.copy_slot_inputs(c, input_ids, anchors).to(h.dtype)
        h = h.reshape(B, n * S, -1)
        slot_pos = (anchors[..., None] + torch.arange(S, device=c.device)).reshape(B, n * S)
        mask = self.block_mask(anchors, T)
        q_pos = anchors.repeat_interleave(S, dim=1)  # memory for anchor a holds features 0..a−1
        for layer in self.layers:
            ctx_k, ctx_v = layer.attn.keys_values(c, ctx_pos)
            read = None
            if layer.memory is not None:
                k, v, g, beta, _ = layer.memory.write_inputs(c)

                def read(q, k=k, v=v, g=g, beta=beta, kind=layer.memory.kind):
                    f = _state_dtype(q.dtype)  # the memory runs in fp32 (fp64 for fp64 checks)
                    return mem.read_at(kind, k.to(f), v.to(f), g.to(f), q.to(f), q_pos,
                                       beta=None if beta is None else beta.to(f), limit=cfg.memory_limit, group=S)
            h = layer(h, slot_pos, ctx_k, ctx_v, mask, read)
        h = h.view(B, n, S, -1)
        if cfg.causal_head_rank and prev_ids is not None:
            h = h + self.causal_bias_hidden(prev_ids) * (torch.arange(S, device=h.device) > 0)[:, None]
        return h if return_hidden else self.logits(h)

    def num_parameters(self, trainable_only: bool = True) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable_only)

    @torch.no_grad()
    def memory_log_decays(self, features: torch.Tensor) -> list[torch.Tensor | None]:
        """Per layer, its memory's log-decays g [.., T, H] (fp32, ≤ 0) on target features [.., T, F]: a head
        multiplies its state by exp(g_t) at each committed feature, so what it wrote d features back is kept scaled
        by exp(g_{t+1} + … + g_{t+d}) whatever it reads (benchmarks/memory_horizon.py). None for a layer without
        memory."""
        c = self.committed(features)[0]
        return [None if layer.memory is None else layer.memory.write_inputs(c)[2].float() for layer in self.layers]


def half_lives(g: torch.Tensor) -> torch.Tensor:
    """Per head, the median half-life in features of log-decays g [N, H]: ln 2 / median(−g)."""
    return math.log(2) / (-g).median(dim=0).values.clamp_min(1e-12)


# ------------------------------------------------------------------------------------------- checkpoints
WEIGHTS_NAME, CONFIG_NAME = "model.safetensors", "config.json"


def target_weights(target) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding and LM head weights (shared with the drafter, frozen)."""
    return target.model.get_input_embeddings().weight, target.model.get_output_embeddings().weight


def new_drafter(cfg: DrafterConfig, target, dtype: torch.dtype | None = None) -> HyFlashDrafter:
    """A freshly initialised drafter for ``target``; records the target's name and fingerprint in its config."""
    cfg.target_name, cfg.target_fingerprint = target.name, target.fingerprint()
    cfg.vocab_size, cfg.target_hidden_size = target.vocab_size, target.hidden_size
    cfg.target_layers = list(target.feature_layers)
    embed, head = target_weights(target)
    drafter = HyFlashDrafter(cfg, embed, head)
    return drafter.to(dtype or embed.dtype)


def save_pretrained(drafter: HyFlashDrafter, path, dtype: torch.dtype | None = torch.bfloat16) -> None:
    """Write ``config.json`` and ``model.safetensors`` (the drafter's own weights only; bf16 by default)."""
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).contiguous().cpu()
             for k, v in drafter.state_dict().items()}
    tmp = path / (WEIGHTS_NAME + ".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "hyflash": "drafter"})
    tmp.replace(path / WEIGHTS_NAME)
    drafter.config.save(path / CONFIG_NAME)


def from_pretrained(path, target, dtype: torch.dtype | None = None) -> HyFlashDrafter:
    """Load a drafter saved by ``save_pretrained`` for ``target``. Raises HyflashError on a missing, corrupt or
    incompatible checkpoint, or one trained for another target."""
    from pathlib import Path

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from hyflash import HyflashError

    path = Path(path)
    if not (path / CONFIG_NAME).exists() or not (path / WEIGHTS_NAME).exists():
        raise HyflashError(f"no drafter checkpoint at {path} (expected {CONFIG_NAME} and {WEIGHTS_NAME})")
    cfg = DrafterConfig.load(path / CONFIG_NAME)
    fingerprint = target.fingerprint()
    if cfg.target_fingerprint != fingerprint:
        raise HyflashError(
            f"drafter {path} was trained for target {cfg.target_name!r} (fingerprint {cfg.target_fingerprint}), "
            f"not for {target.name!r} (fingerprint {fingerprint})")
    if list(cfg.target_layers) != list(target.feature_layers):
        target.feature_layers = list(cfg.target_layers)  # the drafter decides which target layers it reads
    try:
        if (path / "quantization.json").exists():  # a 4-bit GPTQ checkpoint (hyflash.quant): dequantise
            from hyflash.quant import dequantized_state

            state = dequantized_state(path)
        else:
            state = load_file(str(path / WEIGHTS_NAME))
    except (SafetensorError, OSError, ValueError, KeyError) as e:
        raise HyflashError(f"corrupt drafter weights {path / WEIGHTS_NAME}: {e}") from None
    embed, head = target_weights(target)
    drafter = HyFlashDrafter(cfg, embed, head)
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise HyflashError(f"drafter weights in {path} do not match its config: {str(e)[:300]}") from None
    if drafter.draft_vocab is not None:
        drafter.set_draft_vocab(drafter.draft_vocab.clone())
    return drafter.to(dtype or embed.dtype).eval()
