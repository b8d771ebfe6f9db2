"""The drafter's runtime state: a ring buffer of window keys/values and a recurrent memory per layer.

``commit(features)`` folds newly verified target features in (the only thing that changes the state);
``draft_hidden(anchor)`` drafts a block from it and changes nothing. For ``hyflash`` and ``swa`` the state has a fixed
size however long the context; ``full`` keeps keys/values of every committed feature (it grows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyflash.drafter import memory as mem
from hyflash.drafter.attention import rope_tables
from hyflash.drafter.model import HyFlashDrafter, _state_dtype
from hyflash.packed import PackedLinear


class KVWindow:
    """Keys/values of the last ``capacity`` committed features (a ring; ``capacity=None``: grow without bound).
    Entries are already rotated at their absolute positions, so their order inside the buffer does not matter."""

    def __init__(self, heads: int, head_dim: int, capacity: int | None, dtype, device):
        self.capacity, self.count = capacity, 0
        size = capacity if capacity is not None else 64
        self.k = torch.zeros(1, heads, size, head_dim, dtype=dtype, device=device)  # [1, Hkv, cap, hd]
        self.v = torch.zeros_like(self.k)

    def append(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """k, v [1, Hkv, n, hd] of features at positions start..start+n−1."""
        n = k.shape[2]
        if self.capacity is None:
            need = start + n
            if need > self.k.shape[2]:
                grow = max(need, 2 * self.k.shape[2])
                self.k = torch.cat([self.k, self.k.new_zeros(*self.k.shape[:2], grow - self.k.shape[2], self.k.shape[3])], 2)
                self.v = torch.cat([self.v, self.v.new_zeros(*self.v.shape[:2], grow - self.v.shape[2], self.v.shape[3])], 2)
            self.k[:, :, start:start + n] = k
            self.v[:, :, start:start + n] = v
        else:
            keep = min(n, self.capacity)  # a long prefill only leaves its last `capacity` features
            slots = torch.arange(start + n - keep, start + n, device=k.device) % self.capacity
            self.k[:, :, slots] = k[:, :, n - keep:]
            self.v[:, :, slots] = v[:, :, n - keep:]
        self.count = start + n

    def visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.count if self.capacity is None else min(self.count, self.capacity)
        return self.k[:, :, :n], self.v[:, :, :n]

    def nbytes(self) -> int:
        """Bytes of context held: the whole ring (fixed), or the keys/values of every committed feature (full)."""
        per_entry = 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return per_entry * (self.capacity if self.capacity is not None else self.count)


class _LayerWeights:
    """One layer's projections concatenated for inference: a drafting round makes four matmuls per layer (slot
    projections q|k|v|memory q|gate z, attention and memory outputs, MLP up, MLP down) and a commit one (k|v|memory
    write), instead of nine and three. Same function as the modules', up to the order of float additions."""

    def __init__(self, layer):
        a, m = layer.attn, layer.memory
        read = [a.q_proj, a.k_proj, a.v_proj] + ([m.q_proj, m.z_proj] if m is not None else [])
        write = [a.k_proj, a.v_proj] + ([m.in_proj] if m is not None else [])
        self.read_sizes = [p.out_features for p in read]
        self.write_sizes = [p.out_features for p in write]
        self.read = PackedLinear(torch.cat([p.weight for p in read]))
        self.write = PackedLinear(torch.cat([p.weight for p in write]))
        self.out = PackedLinear(torch.cat([a.o_proj.weight] + ([m.out_proj.weight] if m is not None else []), dim=1))
        self.gate_up, self.down = PackedLinear(layer.mlp.gate_up.weight), PackedLinear(layer.mlp.down.weight)


def _runtime_weights(drafter: HyFlashDrafter) -> list[_LayerWeights]:
    """The fused weights of ``drafter``, built once and rebuilt whenever a parameter changed (training)."""
    key = tuple((id(p), p._version, p.dtype) for p in drafter.parameters())
    cached = getattr(drafter, "_runtime_weights", None)
    if cached is None or cached[0] != key:
        with torch.no_grad():
            cached = (key, [_LayerWeights(layer) for layer in drafter.layers])
        drafter._runtime_weights = cached
    return cached[1]


class DrafterState:
    def __init__(self, drafter: HyFlashDrafter):
        self.drafter = drafter
        cfg = drafter.config
        p = next(drafter.parameters())
        self.dtype, self.device = p.dtype, p.device
        # the recurrent state is kept in fp32 (fp64 when the drafter runs in fp64)
        self.state_dtype = _state_dtype(p.dtype)
        self.weights = _runtime_weights(drafter)
        self.n = 0  # committed features so far
        self.windows = [KVWindow(cfg.num_kv_heads, cfg.head_dim, cfg.attention_window, p.dtype, p.device)
                        for _ in drafter.layers]
        self.memories, self.convs, self.recent = [], [], []
        for layer in drafter.layers:
            m = layer.memory
            if m is None:
                continue
            self.memories.append(mem.init_state(1, m.H, m.dk, m.dv, dtype=self.state_dtype, device=p.device))
            self.convs.append(torch.zeros(1, *m.conv_state_shape(), dtype=p.dtype, device=p.device))
            self.recent.append(None)  # memory_limit ablation: the last N write inputs

    @torch.no_grad()
    def commit(self, features: torch.Tensor) -> None:
        """Fold verified target features [n, n_layers·D_t] (positions self.n .. self.n+n−1) into the state."""
        d = self.drafter
        c = d.fuse_features(features.to(self.device)[None])  # [1, n, d]
        cos, sin = rope_tables(torch.arange(self.n, self.n + c.shape[1], device=self.device), d.config.head_dim,
                               d.config.rope_theta, c.dtype)
        i = 0
        for layer, w, window in zip(d.layers, self.weights, self.windows):
            k, v, *write = w.write(c).split(w.write_sizes, dim=-1)
            window.append(*layer.attn.heads_kv(k, v, cos, sin), self.n)
            if layer.memory is None:
                continue
            mk, mv, mg, mb, self.convs[i] = layer.memory.write_inputs(c, self.convs[i], proj=write[0])
            mk, mv, mg = mk.to(self.state_dtype), mv.to(self.state_dtype), mg.to(self.state_dtype)
            mb = None if mb is None else mb.to(self.state_dtype)
            limit = d.config.memory_limit
            if limit is None:
                self.memories[i] = mem.step(layer.memory.kind, self.memories[i], mk, mv, mg, mb)
            else:  # keep the last `limit` write inputs; the state is refolded from zero at each draft
                new = (mk, mv, mg, mb)
                old = self.recent[i]
                if old is not None:
                    new = tuple(None if a is None else torch.cat([a, b], 1) for a, b in zip(old, new))
                self.recent[i] = tuple(None if a is None else a[:, -limit:] for a in new)
            i += 1
        self.n += c.shape[1]

    def _memory(self, i: int, kind: str) -> torch.Tensor:
        if self.drafter.config.memory_limit is None or self.recent[i] is None:
            return self.memories[i]
        k, v, g, b = self.recent[i]
        return mem.step(kind, self.memories[i].new_zeros(self.memories[i].shape), k, v, g, b)

    @torch.no_grad()
    def draft_hidden(self, anchor: int) -> torch.Tensor:
        """Final slot states [S, d] of the block anchored at ``anchor`` (position self.n). Reads only.
        The layers' computation (DrafterLayer.forward) with the fused projections of ``_LayerWeights``."""
        d, cfg = self.drafter, self.drafter.config
        S = cfg.block_size
        h = d.slot_inputs(torch.tensor([[anchor]], device=self.device))[0]  # [1, S, d]
        cos, sin = rope_tables(torch.arange(self.n, self.n + S, device=self.device), cfg.head_dim, cfg.rope_theta,
                               h.dtype)
        mask = None
        if not cfg.slot_attention:
            ctx = self.windows[0].visible()[0].shape[2]
            mask = torch.cat([torch.ones(1, S, ctx, dtype=torch.bool, device=self.device),
                              torch.eye(S, dtype=torch.bool, device=self.device)[None]], dim=-1)
        i = 0
        for layer, w, window in zip(d.layers, self.weights, self.windows):
            x = layer.norm(h)
            q, k, v, *mem_proj = w.read(x).split(w.read_sizes, dim=-1)
            k, v = layer.attn.heads_kv(k, v, cos, sin)
            ctx_k, ctx_v = window.visible()
            out = layer.attn.attend(layer.attn.heads_q(q, cos, sin), torch.cat([ctx_k, k], dim=2),
                                    torch.cat([ctx_v, v], dim=2), mask)
            if layer.memory is not None:
                state = self._memory(i, layer.memory.kind)
                y = mem.read(state, layer.memory.heads_q(mem_proj[0]).to(state.dtype))
                out = torch.cat([out, layer.memory.gated(y, mem_proj[1])], dim=-1)
                i += 1
            h = h + w.out(out)
            gate, up = w.gate_up(layer.mlp_norm(h)).chunk(2, dim=-1)
            h = h + w.down(F.silu(gate) * up)
        return h[0]

    def nbytes(self) -> int:
        """Drafter context bytes: window keys/values plus recurrent and conv states."""
        total = sum(w.nbytes() for w in self.windows)
        total += sum(s.numel() * s.element_size() for s in self.memories)
        total += sum(c.numel() * c.element_size() for c in self.convs)
        for r in self.recent:
            if r is not None:
                limit = self.drafter.config.memory_limit
                total += sum(a[0, 0].numel() * a.element_size() * limit for a in r if a is not None)
        return total
