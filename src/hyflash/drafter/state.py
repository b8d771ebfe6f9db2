"""The drafter's runtime state: a ring buffer of window keys/values and a recurrent memory per layer.

``commit(features)`` folds newly verified target features in (the only thing that changes the state);
``draft_hidden(anchor)`` drafts a block from it and changes nothing. For ``hyflash`` and ``swa`` the state has a fixed
size however long the context; ``full`` keeps keys/values of every committed feature (it grows).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hyflash import HyflashError, kernels
from hyflash.drafter import memory as mem
from hyflash.drafter.attention import rope_tables
from hyflash.drafter.model import HyFlashDrafter, _state_dtype
from hyflash.packed import PackedLinear, gather_on_huge_pages


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


class _NativeWeights:
    """The drafter's weights as our C++ commit and draft take them (csrc/drafter.cpp), for the configurations it
    covers: bf16 on a CPU with our AMX kernel, a ring window, Mamba-2 memory or none, the full memory, slot attention,
    no causal head, no lagged context features, no per-slot query scales, no copy head. ``build`` returns None for
    anything else (the torch path then runs)."""

    @staticmethod
    def build(drafter: HyFlashDrafter, weights: list[_LayerWeights]) -> "_NativeWeights | None":
        cfg, module = drafter.config, kernels.amx()
        head = drafter._packed_head
        linears = [lin for w in weights for lin in (w.read, w.write, w.out, w.gate_up, w.down)]
        m = drafter.layers[0].memory
        if (module is None or next(drafter.parameters()).dtype != torch.bfloat16 or cfg.attention_window is None
                or cfg.head_dim % 32 or cfg.hidden_size % 16 or cfg.intermediate_size % 16
                or (m is not None and (m.dv % 16 or m.dk > 256 or m.dv > 256))
                or cfg.memory_limit is not None or not cfg.slot_attention or cfg.causal_head_rank or cfg.context_lags
                or cfg.slot_query_scales or cfg.copy_head_rank
                or (cfg.has_memory and cfg.memory != "mamba2") or head is None or head.amx is None
                or any(lin.amx is None for lin in linears)):
            return None
        fuse = PackedLinear(drafter.fuse.weight)
        if fuse.amx is None:
            return None
        # in the order a round reads them: commit (fuse, the layers' writes), then draft (the layers, the head)
        ordered = [fuse] + [w.write for w in weights] + [lin for w in weights for lin in (w.read, w.out, w.gate_up,
                                                                                      w.down)] + [head]
        if getattr(drafter, "native_weights", "bf16") == "int8":  # half the bytes a round reads (pack_q8)
            for lin in ordered:
                lin.amx = module.pack_q8(lin.w)
        gather_on_huge_pages(ordered)
        return _NativeWeights(drafter, weights, module, fuse)

    @staticmethod
    def _decay_rates(m) -> torch.Tensor:
        """A per memory head for the C++ commit: −exp(A_log), or +decay_cap for a head under the reach floor
        (``memory_long_heads``: csrc/drafter.cpp decays it by exp(−cap · sigmoid(gate + dt_bias)))."""
        a = -torch.exp(m.A_log.detach().float())
        a[: m.long_heads] = m.decay_cap
        return a.contiguous()

    def __init__(self, drafter, weights, module, fuse):
        cfg = drafter.config
        f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
        self.module, self.fuse = module, fuse
        self.glob = [torch.stack([f32(n.weight) for n in drafter.feature_norms]), fuse.amx, f32(drafter.fuse_norm.weight)]
        self.layers = []
        none = torch.empty(0)
        for layer, w in zip(drafter.layers, weights):
            m = layer.memory
            memory = [m.conv.weight[:, 0].detach().contiguous(), m.conv.bias.detach().contiguous(),
                      self._decay_rates(m), f32(m.dt_bias), f32(m.norm.weight)] if m is not None else [none] * 5
            self.layers += [f32(layer.norm.weight), w.read.amx, w.write.amx, w.out.amx, w.gate_up.amx, w.down.amx,
                            f32(layer.attn.q_norm.weight), f32(layer.attn.k_norm.weight), f32(layer.mlp_norm.weight),
                            *memory]
        m = drafter.layers[0].memory
        self.dims = [cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     m.H if m else 0, m.dk if m else 0, m.dv if m else 0, m.K if m else 1, m.conv_dim if m else 0,
                     cfg.attention_window, int(m is not None)]
        self.eps = cfg.rms_eps
        self.final_norm = f32(drafter.norm.weight)
        self.head = drafter._packed_head.amx


def _native_weights(drafter: HyFlashDrafter, weights: list[_LayerWeights]) -> _NativeWeights | None:
    """Built once per set of weights, like ``_runtime_weights``."""
    cached = getattr(drafter, "_native_weights", None)
    if cached is None or cached[0] is not weights or cached[1] is not drafter._packed_head:
        with torch.no_grad():
            cached = (weights, drafter._packed_head, _NativeWeights.build(drafter, weights))
        drafter._native_weights = cached
    return cached[2]


def _last_writes(old: tuple | None, new: tuple, limit: int) -> tuple:
    """The memory_limit ablation's kept writes: (k, v, g, beta) of the last ``limit`` features, from those kept so far
    and the new ones (beta None for mamba2)."""
    if old is not None:
        new = tuple(None if a is None else torch.cat([a, b], 1) for a, b in zip(old, new))
    return tuple(None if a is None else a[:, -limit:] for a in new)


def _writes_bytes(writes: tuple | None, limit: int) -> int:
    """Bytes of per-feature rows [1, n, ...] such as ``_last_writes``', counted at their capacity of ``limit``
    features (by shape, so an empty queue counts too)."""
    return 0 if writes is None else sum(math.prod(a.shape[2:]) * a.element_size() * limit
                                        for a in writes if a is not None)


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
        self.lags = torch.zeros(1, *drafter.lag_state_shape(), dtype=p.dtype, device=p.device)  # context_lags
        # copy_head_rank: the copy head's keys and values of the last W committed features (all of them for full),
        # and the last committed feature (its next key's and every query's "feature before")
        r = cfg.copy_head_rank
        self.copy_k = self.copy_v = torch.zeros(1, 0, r, dtype=p.dtype, device=p.device)
        self.copy_last = torch.zeros(1, 1, cfg.hidden_size if r else 0, dtype=p.dtype, device=p.device)
        # copy_head_tokens: the normalised embedding of the last committed token (the next key's and every query's
        # "token before")
        self.copy_last_token = torch.zeros(1, 1, cfg.hidden_size if cfg.copy_head_tokens else 0, dtype=p.dtype,
                                           device=p.device)
        # copy_memory: one delta-rule state per slot, the normalised copy keys of the last S features, and with
        # memory_limit the last N writes (the state is then refolded from zero at each draft, as for the memory)
        S = cfg.block_size if cfg.copy_memory else 0
        K = cfg.copy_memory_key_dim  # r, or 2·r·ν with copy_memory_dpfp
        self.copy_mem = mem.init_state(1, S, K, r, dtype=self.state_dtype, device=p.device)
        self.copy_recent_keys = torch.zeros(1, S, K, dtype=p.dtype, device=p.device)
        self.copy_writes = None
        # copy_memory_delay: the write strengths of the newest features, not yet folded (their copy keys and values
        # are those copy_k / copy_v keep for the window)
        self.copy_queue = torch.zeros(1, 0, dtype=p.dtype, device=p.device)
        for layer in drafter.layers:
            m = layer.memory
            if m is None:
                continue
            self.memories.append(mem.init_state(1, m.H, m.dk, m.dv, dtype=self.state_dtype, device=p.device))
            self.convs.append(torch.zeros(1, *m.conv_state_shape(), dtype=p.dtype, device=p.device))
            self.recent.append(None)  # memory_limit ablation: the last N write inputs
        # our C++ commit and draft (csrc/drafter.cpp) where they cover this drafter; they update these same tensors
        self.native = _native_weights(drafter, self.weights) if p.device.type == "cpu" else None
        self._slots = None  # the native draft's slot inputs, reused (see draft_logits)
        self._win_k, self._win_v = [w.k for w in self.windows], [w.v for w in self.windows]  # rings: fixed buffers

    @torch.no_grad()
    def commit(self, features: torch.Tensor, token_ids=None) -> None:
        """Fold verified target features [n, n_layers·D_t] (positions self.n .. self.n+n−1) into the state.
        ``token_ids``: the n tokens at those positions, which a drafter with copy_head_tokens needs (others ignore
        them)."""
        d = self.drafter
        if d.config.copy_head_tokens and (token_ids is None or len(token_ids) != features.shape[0]):
            raise HyflashError(f"this drafter's copy head reads the committed tokens: commit needs the "
                               f"{features.shape[0]} token ids of these features, got "
                               f"{'none' if token_ids is None else len(token_ids)}")  # before any state changes
        if self.native is not None and 1 <= features.shape[0] <= 16 and not d.training:
            return self._native_commit(features)
        c, self.lags = d.committed(features.to(self.device)[None], self.lags)  # [1, n, d]
        if d.config.copy_head_rank:
            e = None
            if d.config.copy_head_tokens:
                ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.device).reshape(1, -1)
                e = d.copy_token_embeddings(ids, c.dtype)
            k, v = d.copy_keys_values(c, self.copy_last, e, self.copy_last_token)
            if e is not None:
                self.copy_last_token = e[:, -1:]
            keep = d.config.attention_window or self.n + c.shape[1]
            held_k, held_v = torch.cat([self.copy_k, k], dim=1), torch.cat([self.copy_v, v], dim=1)
            self.copy_k, self.copy_v = held_k[:, -keep:], held_v[:, -keep:]
            self.copy_last = c[:, -1:]
            if d.config.copy_memory:
                self._copy_memory_commit(held_k, held_v, d.copy_memory_beta(c))
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
                self.recent[i] = _last_writes(self.recent[i], (mk, mv, mg, mb), limit)
            i += 1
        self.n += c.shape[1]

    def _copy_memory_commit(self, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor) -> None:
        """Fold the copy memory's writes of n new features (write strengths beta [1, n]). k, v [1, m, r]: the copy
        keys and values of the last m ≥ n committed features, the new ones last (with copy_memory_delay D, m ≥ n +
        min(n_before, D): the window's and the new ones). With D, queue the strengths and fold only the writes now
        more than D features old."""
        d = self.drafter
        delay = d.config.copy_memory_delay
        if delay:
            queue = torch.cat([self.copy_queue, beta.to(self.copy_queue.dtype)], 1)  # the last q features' strengths
            q, due = queue.shape[1], queue.shape[1] - delay
            self.copy_queue = queue[:, max(due, 0):]
            if due <= 0:
                return
            first = k.shape[1] - q  # the oldest queued feature in k, v (D <= window: the window still holds it)
            k, v, beta = k[:, first:first + due], v[:, first:first + due], queue[:, :due]
        else:
            k, v = k[:, -beta.shape[1]:], v[:, -beta.shape[1]:]
        keys, vals, g, beta, self.copy_recent_keys = d.copy_memory_writes(k, v, beta, self.copy_recent_keys)
        new = tuple(x.to(self.state_dtype) for x in (keys, vals, g, beta))
        limit = d.config.memory_limit
        if limit is None:
            self.copy_mem = mem.step("gdn", self.copy_mem, *new[:3], new[3])
        else:
            self.copy_writes = _last_writes(self.copy_writes, new, limit)

    def _slot_count(self, slots: int | None) -> int:
        block = self.drafter.config.block_size
        if slots is None:
            return block
        if not 1 <= slots <= block:
            raise HyflashError(f"slots must be 1..{block} (the drafter's block), got {slots}")
        return slots

    def _rope(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE tables of positions start..end-1 from a table kept on the drafter (grown by doubling): the same
        values as ``rope_tables``, without computing them in fp64 twice a round."""
        cfg = self.drafter.config
        table = getattr(self.drafter, "_rope_table", None)
        if table is None or table[0].shape[0] < end:
            n = max(end, 4096, 2 * (0 if table is None else table[0].shape[0]))
            table = rope_tables(torch.arange(n), cfg.head_dim, cfg.rope_theta, self.dtype)
            self.drafter._rope_table = table
        return table[0][start:end], table[1][start:end]

    def _native_commit(self, features: torch.Tensor) -> None:
        n, nat = features.shape[0], self.native
        cos, sin = self._rope(self.n, self.n + n)
        if not all(m.is_contiguous() for m in self.memories + self.convs):  # updated in place
            self.memories = [m.contiguous() for m in self.memories]
            self.convs = [c.contiguous() for c in self.convs]
        nat.module.drafter_commit(features.to(self.dtype).contiguous(), nat.glob, nat.layers, self._win_k,
                                  self._win_v, self.memories, self.convs, self.n, cos.contiguous(), sin.contiguous(),
                                  nat.dims, nat.eps)
        self.n += n
        for w in self.windows:
            w.count = self.n

    @torch.no_grad()
    def draft_logits(self, anchor: int, slots: int | None = None) -> torch.Tensor:
        """The block's draft logits [S, V'] (``drafter.logits`` of ``draft_hidden``). Reads only. ``slots``: compute
        only the block's first ``slots`` slots (they then attend only among themselves: their guesses move a little)."""
        if self.native is None or self.drafter.training:
            return self.drafter.logits(self.draft_hidden(anchor, slots))
        d, cfg, nat = self.drafter, self.drafter.config, self.native
        S = self._slot_count(slots)
        if self._slots is None:  # the mask embeddings once; each round writes only the anchor's row
            self._slots = d.slot_inputs(torch.tensor([[anchor]]))[0, 0].contiguous()  # [S, d]
        else:
            self._slots[0] = d.embed_weight[anchor]
        cos, sin = self._rope(self.n, self.n + S)
        return nat.module.drafter_draft(self._slots[:S], nat.layers, self._win_k, self._win_v, self.memories, self.n,
                                        cos.contiguous(), sin.contiguous(), nat.final_norm, nat.head, nat.dims,
                                        nat.eps)

    def _memory(self, i: int, kind: str) -> torch.Tensor:
        if self.drafter.config.memory_limit is None or self.recent[i] is None:
            return self.memories[i]
        k, v, g, b = self.recent[i]
        return mem.step(kind, self.memories[i].new_zeros(self.memories[i].shape), k, v, g, b)

    @torch.no_grad()
    def draft_hidden(self, anchor: int, slots: int | None = None) -> torch.Tensor:
        """Final slot states [S, d] of the block anchored at ``anchor`` (position self.n), or of its first ``slots``
        slots. Reads only. The layers' computation (DrafterLayer.forward) with the fused projections of
        ``_LayerWeights``."""
        d, cfg = self.drafter, self.drafter.config
        S = self._slot_count(slots)
        h = d.slot_inputs(torch.tensor([[anchor]], device=self.device))[0][:, :S]  # [1, S, d]
        if cfg.copy_head_rank:
            q = d.copy_query(torch.tensor([[anchor]], device=self.device), self.copy_last,
                             self.copy_last_token if cfg.copy_head_tokens else None)
            start = self.n - self.copy_k.shape[1]
            read, best = d.copy_read(q, self.copy_k, self.copy_v, torch.tensor([[self.n]], device=self.device), start,
                                     best=cfg.copy_memory_gate)
            if cfg.copy_memory:
                state = self.copy_mem
                if self.copy_writes is not None:  # memory_limit: the last N writes, folded from zero
                    state = mem.step("gdn", torch.zeros_like(state), *self.copy_writes[:3], self.copy_writes[3])
                y = mem.read(state, d.copy_memory_key(q)[:, None].expand(-1, state.shape[1], -1, -1).to(state.dtype))
                read = read + d.copy_memory_read(y.transpose(1, 2).to(q.dtype), best)
            h = h + read[0, :, :S].to(h.dtype)
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
        total += self.lags.numel() * self.lags.element_size()
        if self.drafter.config.copy_head_rank:  # bounded like the rings: counted at the window's capacity
            held = self.drafter.config.attention_window or self.copy_k.shape[1]
            total += 2 * held * self.copy_k.shape[2] * self.copy_k.element_size()
            total += self.copy_last.numel() * self.copy_last.element_size()
            total += self.copy_last_token.numel() * self.copy_last_token.element_size()
        for t in (self.copy_mem, self.copy_recent_keys):
            total += t.numel() * t.element_size()
        limit = self.drafter.config.memory_limit
        total += _writes_bytes(self.copy_writes, limit)  # memory_limit: counted at N writes
        total += _writes_bytes((self.copy_queue,), self.drafter.config.copy_memory_delay)  # strengths of D features
        total += sum(_writes_bytes(r, limit) for r in self.recent)
        return total
