"""A lean forward of our own for Llama and Gemma 3 targets, with a preallocated (static) KV cache.

It reads the same weights as the transformers model (the fused q|k|v and gate|up matrices are copies, and in bf16
every matrix is also kept once packed, ``PackedLinear``: our AMX kernel's tiles, else oneDNN's layout) and computes
the same function — RMSNorm in fp32 then back to the model dtype, RoPE from the model's own inverse frequencies,
grouped-query attention by SDPA, SiLU-gated MLP — with a handful of tensor operations per layer and no per-step
allocation of the cache: keys and values are written in place, and a rollback only moves the length. For Llama in
bf16 on CPUs with our kernels, forwards of up to 16 tokens run as one C++ call instead (``LeanLlama.native``,
csrc/lean_llama.cpp), batch-invariant so that verifying k tokens gives each the bits of a single-token step. Gemma 3
gets the same property in its torch forward (``LeanGemma3.bitwise``): its matmuls run on our batch-invariant kernels
and its attention on the C++ attention of csrc/lean_llama.cpp. Used by ``Target`` when loaded with ``fast=True``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyflash import kernels
from hyflash.packed import AMX_MAX_ROWS, PackedLinear, gather_on_huge_pages


KEY_CHUNK = 64  # the C++ attention groups keys by position in chunks of this many (kChunk, csrc/lean_llama.cpp)
WINDOW_SLACK = 256  # a windowed layer's buffer: its window, a chunk, and this many slots for new tokens


def _round_up(n: int, to: int = KEY_CHUNK) -> int:
    return -(-n // to) * to


class StaticCache:
    """Keys/values preallocated per layer, each [1, kv_heads, slots, head_dim] (a buffer per layer rather than one
    shared tensor: writes into slices of one big tensor defeat torch.compile, TARGETS.md).

    Layers with a sliding window (``windows[i]``, Gemma 3's local layers) keep only what a window can still see: their
    buffers hold ``window − 1`` positions, a key chunk and ``slack`` more (rounded up to whole chunks), and slot 0 holds
    position ``base`` (the same for every windowed layer). When new tokens do not fit, the positions older than any of
    them can see are dropped by sliding the rest down (``make_room``), every ``slack`` tokens or so; ``base`` stays a
    multiple of ``KEY_CHUNK`` so that the C++ attention meets the same keys in the same chunks, and a token gets the same
    bits as with the whole history kept. A forward longer than the slack grows the buffers to take it (a prefill in
    chunks of 2,048), and the first short forward after it shrinks them back. Gemma 3 270M (1 KiB of keys/values a
    position and layer) at 32K tokens: each of its 15 windowed layers (window 512) holds 0.81 MiB while decoding,
    2.6 MiB during a chunked prefill, instead of 32 MiB."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, capacity: int, dtype, device=None,
                 windows: list[int | None] | None = None, slack: int = WINDOW_SLACK):
        windows = list(windows) if windows is not None else [None] * layers
        if len(windows) != layers:
            raise ValueError(f"{len(windows)} layer windows for {layers} layers")
        sizes = {w for w in windows if w}
        if len(sizes) > 1:
            raise ValueError(f"windowed layers must share one window length, not {sorted(sizes)}")
        self.window = sizes.pop() if sizes else None
        # windowed buffers only where they are shorter than the whole capacity
        self.window_slots = min(capacity, _round_up(self.window - 1 + KEY_CHUNK + slack)) if self.window else capacity
        self.windowed = [bool(w) and self.window_slots < capacity for w in windows]
        self.k = [torch.zeros(1, kv_heads, self.window_slots if w else capacity, head_dim, dtype=dtype, device=device)
                  for w in self.windowed]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.capacity, self.length = capacity, 0
        self.base = 0  # the position in slot 0 of every windowed layer's buffers
        # bf16 buffers on a CPU with our kernels: keep_path in C++ (csrc/lean_llama.cpp)
        self.native = dtype == torch.bfloat16 and (device is None or torch.device(device).type == "cpu") \
            and kernels.amx() is not None

    def span(self, n: int) -> tuple[int, int]:
        """Positions [start, end) that n new tokens take; raises ValueError when the buffers cannot hold them."""
        start, end = self.length, self.length + n
        if end > self.capacity:
            raise ValueError(f"static cache of {self.capacity} tokens is full ({end} needed)")
        return start, end

    def offset(self, layer: int) -> int:
        """The position in slot 0 of ``layer``'s buffers: a position p is at slot p − offset."""
        return self.base if self.windowed[layer] else 0

    def make_room(self, start: int, n: int, drop: bool = False) -> None:
        """Before n new tokens at ``start`` (= the length): make the windowed buffers take them, keeping every
        position from the oldest any of them can see (start − window + 1), rounded down to a chunk. Buffers grown
        for a long forward (a prefill's chunk) shrink back at the first short one after it. ``drop``: drop the
        positions no new token can see even where the buffers could take the new ones without it."""
        if not any(self.windowed):
            return
        slots_now = self.k[self.windowed.index(True)].shape[2]
        base = max(self.base, max(0, start - self.window + 1) // KEY_CHUNK * KEY_CHUNK)
        lo, keep = base - self.base, start - base
        slots = max(self.window_slots, _round_up(keep + n))
        if start + n - self.base <= slots_now and slots >= slots_now and not (drop and lo):
            return  # they fit, and no smaller buffers would
        with torch.inference_mode(False):  # ordinary tensors as new_cache makes, whether or not called in a forward
            for buffers in (self.k, self.v):
                for i, buf in enumerate(buffers):
                    if not self.windowed[i]:
                        continue
                    if slots != buf.shape[2]:
                        resized = buf.new_zeros(1, buf.shape[1], slots, buf.shape[3])
                        resized[0, :, :keep] = buf[0, :, lo:lo + keep]
                        buffers[i] = resized
                    elif lo:
                        buf[0, :, :keep] = buf[0, :, lo:lo + keep].clone()  # copy first: source and target overlap
        self.base = base

    def trim(self) -> None:
        """Drop what no window can see from the length on (after a prompt's prefill: its last chunk left up to 2,048
        more positions); a rollback below the length may then be refused (``truncate``)."""
        self.make_room(self.length, 0, drop=True)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions (a rollback: entries past it are overwritten later). Raises
        ValueError where windowed layers have already dropped keys that position ``length`` would see."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back a cache of {self.length} tokens to {length}")
        if length == 0:
            self.base = 0
        elif self.base and length - self.window + 1 < self.base:
            raise ValueError(f"the sliding-window layers no longer hold the positions before {self.base}: this cache "
                             f"can roll back to >= {self.base + self.window - 1} tokens, not to {length}")
        self.length = length

    def keep_path(self, start: int, nodes: list[int]) -> None:
        """After a tree of candidates was verified at [start, ...): keep the entries of ``nodes`` (offsets from
        ``start``, ascending, the first 0) packed at start, start+1, ..., and drop the rest."""
        end = start + len(nodes)
        groups = {}  # layers by the position in their slot 0
        for i in range(len(self.k)):
            groups.setdefault(self.offset(i), []).append(i)
        for offset, layers in groups.items():
            at = start - offset
            if self.native:  # one C++ call instead of two gathers per layer
                kernels.amx().cache_keep([self.k[i] for i in layers], [self.v[i] for i in layers], at, list(nodes))
                continue
            index = torch.tensor(nodes, device=self.k[0].device) + at
            for i in layers:
                for buf in (self.k[i], self.v[i]):
                    buf[0, :, at:at + len(nodes)] = buf[0, :, index]  # advanced indexing copies first: overlaps safe
        self.length = end

    def nbytes(self) -> int:
        """Bytes of the keys/values held: positions up to the committed length, from ``base`` on in windowed
        layers (the buffers themselves: ``allocated_bytes``)."""
        k = self.k[0]
        per_position = 2 * k.shape[1] * k.shape[3] * k.element_size()
        return per_position * sum(self.length - self.offset(i) for i in range(len(self.k)))

    def allocated_bytes(self) -> int:
        return 2 * sum(k.numel() * k.element_size() for k in self.k)


def supports(model) -> bool:
    """The lean path covers plain Llama decoders (SmolLM2 and the like) and Gemma 3 text models."""
    c = model.config
    kind = getattr(c, "model_type", "")
    if kind == "llama":
        return (not getattr(c, "attention_bias", False) and not getattr(c, "mlp_bias", False)
                and getattr(c, "hidden_act", "silu") == "silu"
                and (getattr(c, "rope_parameters", None) or {}).get("rope_type", "default") == "default")
    if kind == "gemma3_text":
        ropes = getattr(c, "rope_parameters", None) or {}
        return (not getattr(c, "attention_bias", False) and c.attn_logit_softcapping is None
                and not getattr(c, "use_bidirectional_attention", False)
                and c.hidden_activation in ("gelu_pytorch_tanh", "gelu")
                and all((r or {}).get("rope_type", "default") in ("default", "linear") for r in ropes.values()))
    return False


def tree_mask(parents: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For tokens 0..n−1 where token i ≥ 1 follows token parents[i − 1] (< i): their positions (start + depth)
    and which of them each sees ([n, n] bool: its ancestors and itself)."""
    n = len(parents) + 1
    sees = torch.eye(n, dtype=torch.bool)
    depth = [0] * n
    for i, p in enumerate(parents, start=1):
        if not 0 <= p < i:
            raise ValueError(f"tree token {i} has parent {p}; a parent must come before its child")
        sees[i] |= sees[p]
        depth[i] = depth[p] + 1
    return torch.tensor(depth) + start, sees


def lean_forward(model, pack: bool = True):
    """Our lean forward for ``model`` (``supports(model)`` must hold)."""
    return LeanGemma3(model, pack) if model.config.model_type == "gemma3_text" else LeanLlama(model, pack)


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
        # The whole forward of up to 16 new tokens in one C++ call (csrc/lean_llama.cpp) when every matmul runs on
        # our AMX kernel: the same computation and bf16 roundings as below, without ~1,500 small torch operations.
        self.native = None
        self.linears = linears = [lin for layer in self.layers for lin in (layer[1], layer[2], layer[4], layer[5])] \
            + [self.head]  # every PackedLinear of the forward
        gather_on_huge_pages(linears)
        if all(lin.amx is not None for lin in linears) and self.hd % 32 == 0 and self.H // self.Hkv <= 8 \
                and self.inter % 16 == 0 and self.embed.shape[1] % 16 == 0 and self.head.out_features % 16 == 0:
            self.native = [t for (w_in, qkv, o, w_post, gu, down) in self.layers
                           for t in (w_in.contiguous(), qkv.amx, o.amx, w_post.contiguous(), gu.amx, down.amx)]

    def new_cache(self, capacity: int) -> StaticCache:
        return StaticCache(self.n_layers, self.Hkv, self.hd, capacity, self.embed.dtype, self.embed.device)

    @property
    def bitwise(self) -> bool:
        """Whether a forward of 1-16 tokens gives each the bits a single-token step would (the C++ forward)."""
        return self.native is not None

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
    def forward(self, ids: torch.Tensor, cache: StaticCache, feature_layers: list[int] | None,
                parents: list[int] | None = None, last_only: bool = False):
        """ids [n] after cache.length cached tokens → (fp32 logits [n, V], features [n, F] or None, each row's
        argmax [n] int64 where the C++ forward computed it, else None). ``last_only``: logits of the last row only
        ([1, V]; a long prompt's [n, V] logits can outgrow memory when the vocabulary is large).
        ``parents``: the new tokens form a tree (token i follows token parents[i − 1] < i; token 0 follows the
        cache), each sees the cache and its own ancestors, at position start + its depth; None: a chain."""
        n = ids.shape[0]
        start, end = cache.span(n)
        if self.native is not None and n <= AMX_MAX_ROWS and ids.device.type == "cpu":
            logits, features, top = self._native_forward(ids, cache, feature_layers, parents, start, end)
            return (logits[-1:], features, None) if last_only else (logits, features, top)
        h = F.embedding(ids, self.embed)  # [n, d]
        if parents is None:
            positions = torch.arange(start, end, device=ids.device)
        else:
            positions, tree = tree_mask(parents, start)
            positions = positions.to(ids.device)
        cos, sin = self._rope(positions, h.dtype)  # [n, hd]
        cos, sin = cos[None], sin[None]  # broadcast over heads
        H, Hkv, hd = self.H, self.Hkv, self.hd
        mask = None
        if parents is not None:
            mask = torch.ones(n, end, dtype=torch.bool, device=ids.device)
            mask[:, start:] = tree.to(ids.device)
        elif n > 1:  # new token i sees cached tokens and new tokens 0..i
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
        logits = self.head(self._norm(h[-1:] if last_only else h, self.final_norm)).float()
        features = torch.cat([feats[sorted(keep).index(i)] for i in feature_layers], dim=-1) if feature_layers \
            else None
        return logits, features, None


    def _rope_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position up to the model's context, computed once: a position's values must not
        depend on which other positions a forward computes with it (vectorised and scalar cos can differ in the
        last bit), so that verifying k tokens together gives each the bits a single-token step would."""
        table = getattr(self, "_rope_cache", None)
        if table is None or table[0].shape[0] < length:
            n = max(length, getattr(self.model.config, "max_position_embeddings", 0) or 0)
            table = self._rope(torch.arange(n), self.embed.dtype)
            self._rope_cache = table
        return table

    def _native_forward(self, ids, cache, feature_layers, parents, start, end):
        n = end - start
        cos, sin = self._rope_table(end)  # the C++ side reads the rows of positions start + depth
        logits, features, top = kernels.amx().llama_forward(
            ids.long().contiguous(), self.embed, self.native, self.final_norm, self.head.amx, cache.k, cache.v, start,
            cos, sin, list(range(n - 1)) if parents is None else list(parents), self.H, self.Hkv, self.eps,
            self.scale, list(feature_layers or []))
        cache.length = end
        return logits, (features if feature_layers else None), top


class LeanGemma3:
    """Gemma 3 text models: the Llama layout plus q/k RMSNorms over each head, RMSNorms ``x·(1 + w)`` computed in
    fp32, norms after attention and after the MLP, a GELU(tanh)-gated MLP, the embedding scaled by √hidden, and
    layers of two kinds — sliding-window layers (each query sees the last ``sliding_window`` positions, itself
    included; RoPE with the local base) and full-attention layers (the global base, possibly linearly scaled).
    Its sliding-window layers keep only what their windows can still see (``StaticCache``: at 32K tokens Gemma 3 270M's
    KV cache falls from 576 to about 108 MiB); a rollback into the latest forward stays a move of the length.

    Batch invariance without a whole C++ forward (``bitwise``): when every matmul runs on our kernels (bf16 on a CPU
    they build for), a matmul row's bits do not depend on the rows multiplied with it, and the norms, RoPE and GELU
    work row by row. Attention is what remains: SDPA over several queries at once rounds differently from SDPA over
    one. So a forward of 1-16 new tokens (a decoding step, a verify, a tree) attends through the C++ attention of
    the Llama forward (csrc/lean_llama.cpp, with Gemma's sliding window), which gives a token the same bits alone,
    in a chain or in a tree, and is 10-20x faster than SDPA for one query here; where the geometry does not suit
    it, each token attends alone through SDPA, to exactly the keys a single-token step at its place would see.
    Verifying k tokens then gives each the bits of a single step, so greedy speculative decoding in bf16 is
    token-identical to plain decoding (tests/test_native.py). Longer forwards (prompts) attend all at once under a
    mask."""

    def __init__(self, model, pack: bool = True):
        c = model.config
        self.model = model
        self.H, self.Hkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.n_layers = c.num_hidden_layers
        self.window = c.sliding_window
        self.softcap = c.final_logit_softcapping
        self.approximate = "tanh" if c.hidden_activation == "gelu_pytorch_tanh" else "none"
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.embed_scale = inner.embed_tokens.embed_scale
        self.final_norm = self._scale(inner.norm.weight)
        self.head = PackedLinear(model.lm_head.weight, pack)
        rot = inner.rotary_emb
        self.rope = {t: (getattr(rot, f"{t}_inv_freq").float(), float(getattr(rot, f"{t}_attention_scaling")))
                     for t in set(c.layer_types)}
        self.scale = c.query_pre_attn_scalar ** -0.5
        self.layers = []
        with torch.no_grad():
            for layer, kind in zip(inner.layers, c.layer_types):
                a, m = layer.self_attn, layer.mlp
                self.layers.append(dict(
                    sliding=kind == "sliding_attention", rope=kind,
                    norm_in=self._scale(layer.input_layernorm.weight),
                    norm_attn=self._scale(layer.post_attention_layernorm.weight),
                    norm_pre_ff=self._scale(layer.pre_feedforward_layernorm.weight),
                    norm_post_ff=self._scale(layer.post_feedforward_layernorm.weight),
                    q_norm=self._scale(a.q_norm.weight), k_norm=self._scale(a.k_norm.weight),
                    qkv=PackedLinear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), pack),
                    o=PackedLinear(a.o_proj.weight, pack),
                    gate_up=PackedLinear(torch.cat([m.gate_proj.weight, m.up_proj.weight]), pack),
                    down=PackedLinear(m.down_proj.weight, pack)))
        self.inter = self.layers[0]["gate_up"].out_features // 2
        self.linears = linears = [L[name] for L in self.layers for name in ("qkv", "o", "gate_up", "down")] \
            + [self.head]  # every PackedLinear of the forward
        gather_on_huge_pages(linears)
        self.bitwise = all(lin.amx is not None for lin in linears)
        # the C++ attention where it takes this geometry (its checks: lean_llama.cpp llama_attention)
        self.cpp_attention = kernels.amx() if self.bitwise and self.hd % 32 == 0 and self.hd <= 256 \
            and self.H % self.Hkv == 0 and self.H // self.Hkv <= 8 else None
        # the norms in one C++ call each where our kernels are loaded (a decoding step makes 109 of them), the query
        # and key heads' norms and RoPE in one per layer (gemma_qk)
        self.cpp_norm = kernels.amx() if self.embed.dtype == torch.bfloat16 and self.hd % 32 == 0 \
            and self.hd <= 256 and self.final_norm.shape[-1] % 16 == 0 else None

    def new_cache(self, capacity: int, windowed: bool = True, slack: int = WINDOW_SLACK) -> StaticCache:
        """The static cache; its sliding-window layers keep only what their window can still see (``StaticCache``,
        ``slack``) unless ``windowed`` is False."""
        windows = [self.window if L["sliding"] and windowed else None for L in self.layers]
        return StaticCache(self.n_layers, self.Hkv, self.hd, capacity, self.embed.dtype, self.embed.device, windows,
                           slack)

    @staticmethod
    def _scale(w: torch.Tensor) -> torch.Tensor:
        """A norm's multiplier 1 + w in fp32, computed once."""
        return (1.0 + w.detach().float()).contiguous()

    def _norm(self, x: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
        """RMSNorm x · w1 (w1 = 1 + the norm's weight, fp32) with fp32 statistics, rounded to x's dtype once."""
        if self.cpp_norm is not None and x.dtype == torch.bfloat16:
            return self.cpp_norm.gemma_norm(x, w1, self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w1).to(x.dtype)

    def _rope(self, kind: str, positions: torch.Tensor, dtype):
        inv_freq, scaling = self.rope[kind]
        freqs = positions[:, None].float() * inv_freq[None]
        emb = torch.cat([freqs, freqs], dim=-1)
        return (emb.cos() * scaling).to(dtype)[None], (emb.sin() * scaling).to(dtype)[None]

    def _keys_each(self, start: int, parents: list[int] | None, n: int,
                   base: int = 0) -> list[dict[bool, slice | torch.Tensor]]:
        """For each new token, the cache entries it attends to in a sliding (True) and a full (False) layer: those a
        single-token step at its place would see, in the same order — the committed positions, then its ancestors
        and itself (their entries sit at start + node). A slice where they are contiguous, else an index; slots of
        a sliding layer counted from ``base`` (``StaticCache.offset``)."""
        paths = [[0]]
        for i, p in enumerate(parents or range(n - 1), start=1):
            paths.append(paths[p] + [i])
        out = []
        for path in paths:
            pos = start + len(path) - 1  # the token's position: start + its depth
            each = {}
            for sliding in (True, False):
                lo = max(0, pos - self.window + 1) if sliding else 0
                if path == list(range(len(path))):
                    each[sliding] = slice(lo, start + len(path))
                else:
                    tail = [start + node for depth, node in enumerate(path) if start + depth >= lo]
                    each[sliding] = torch.cat([torch.arange(lo, start), torch.tensor(tail)]) if lo < start \
                        else torch.tensor(tail)
            if base:
                e = each[True]
                each[True] = slice(e.start - base, e.stop - base) if isinstance(e, slice) else e - base
            out.append(each)
        return out

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: StaticCache, feature_layers: list[int] | None,
                parents: list[int] | None = None, last_only: bool = False):
        """ids [n] after cache.length cached tokens → (fp32 logits [n, V] ([1, V] with ``last_only``), features
        [n, F] or None, None). ``parents``: the new tokens form a tree, as in ``LeanLlama.forward``."""
        n = ids.shape[0]
        start, end = cache.span(n)
        cache.make_room(start, n)
        h = F.embedding(ids, self.embed) * self.embed_scale.to(self.embed.dtype)
        if parents is None:
            positions = torch.arange(start, end, device=ids.device)
        else:
            positions = tree_mask(parents, start)[0].to(ids.device)
        rope = {kind: self._rope(kind, positions, h.dtype) for kind in self.rope}
        H, Hkv, hd = self.H, self.Hkv, self.hd
        cpp = self.cpp_attention if self.bitwise and n <= AMX_MAX_ROWS else None
        each = None  # else one token at a time: a step, a tree, and every forward kept batch-invariant (the class)
        if cpp is not None:
            sees = tree_mask(parents, start)[1] if parents is not None else torch.ones(n, n, dtype=torch.bool).tril()
        elif n == 1 or parents is not None or (self.bitwise and n <= AMX_MAX_ROWS):
            each = self._keys_each(start, parents, n, cache.base)
        else:  # a chain of new tokens, all at once
            # keys a new query may see: full layers all of 0..q; sliding layers q − window < key ≤ q
            lo = max(0, start - self.window + 1)  # the oldest key any of the n queries sees in a sliding layer
            keys = torch.arange(end, device=ids.device)
            full_mask = keys[None, :] <= positions[:, None]
            k_abs = keys[lo:]
            sliding_mask = (k_abs[None, :] <= positions[:, None]) & (k_abs[None, :] > positions[:, None] - self.window)
        keep = set(feature_layers or [])
        feats = []
        for i, L in enumerate(self.layers):
            qkv = L["qkv"](self._norm(h, L["norm_in"]))
            v = qkv[:, (H + Hkv) * hd:].view(n, Hkv, hd).transpose(0, 1)
            cos, sin = rope[L["rope"]]
            if self.cpp_norm is not None and qkv.dtype == torch.bfloat16:  # the same bits in one call
                q, k = self.cpp_norm.gemma_qk(qkv.contiguous(), H, Hkv, L["q_norm"], L["k_norm"], cos[0], sin[0],
                                              self.eps)
                q, k = q.view(n, H, hd).transpose(0, 1), k.transpose(0, 1)
            else:
                q = self._norm(qkv[:, : H * hd].view(n, H, hd), L["q_norm"]).transpose(0, 1)
                k = self._norm(qkv[:, H * hd:(H + Hkv) * hd].view(n, Hkv, hd), L["k_norm"]).transpose(0, 1)
                q, k = LeanLlama._rotate(q, cos, sin), LeanLlama._rotate(k, cos, sin)
            ck, cv, at = cache.k[i], cache.v[i], cache.offset(i)  # position p sits at slot p - at
            ck[0, :, start - at:end - at] = k
            cv[0, :, start - at:end - at] = v
            if cpp is not None:
                attn = cpp.llama_attention(q.transpose(0, 1).reshape(n, H * hd).contiguous(), ck[0], cv[0], start - at,
                                           sees, H, self.scale, self.window if L["sliding"] else 0).to(h.dtype)
            else:
                if each is not None:
                    o = torch.cat([F.scaled_dot_product_attention(
                        q[None, :, j:j + 1], ck[:, :, e[L["sliding"]]], cv[:, :, e[L["sliding"]]], scale=self.scale,
                        enable_gqa=True) for j, e in enumerate(each)], dim=2)
                else:
                    first, mask = (lo, sliding_mask) if L["sliding"] else (0, full_mask)
                    o = F.scaled_dot_product_attention(q[None], ck[:, :, first - at:end - at],
                                                       cv[:, :, first - at:end - at],
                                                       attn_mask=mask, scale=self.scale, enable_gqa=True)
                attn = o[0].transpose(0, 1).reshape(n, H * hd)
            h = h + self._norm(L["o"](attn), L["norm_attn"])
            gu = L["gate_up"](self._norm(h, L["norm_pre_ff"]))
            mlp = L["down"](F.gelu(gu[:, : self.inter], approximate=self.approximate) * gu[:, self.inter:])
            h = h + self._norm(mlp, L["norm_post_ff"])
            if i in keep:
                feats.append(h)
        cache.length = end
        logits = self.head(self._norm(h[-1:] if last_only else h, self.final_norm)).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        features = torch.cat([feats[sorted(keep).index(i)] for i in feature_layers], dim=-1) if feature_layers \
            else None
        return logits, features, None
