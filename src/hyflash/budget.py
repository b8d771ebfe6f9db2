"""Device memory budget: what a target and a drafter need at a context length, and what is left of a budget.

Everything is computed from geometry (a target's ``config.json``, a drafter's config) under assumptions that
``Budget.assumptions`` spells out and ``hyflash budget`` prints. Nothing is fitted to a published figure.

    target weights      parameters × weight bits (embedding and LM head at ``embed_bits``, default the same)
    target KV cache     Σ_layers 2 · kv_heads · head_dim · min(context, layer window) · kv bytes
    drafter weights     the drafter's own parameters × drafter bits (it shares the target's embedding and LM head)
    drafter context     window keys/values (layers · 2 · kv_heads · head_dim · window · 2 bytes)
                        + recurrent state (layers · heads · d_state · head_dim · 4 bytes, fp32)
                        + conv state (layers · (kernel − 1) · conv channels · 2 bytes)

``measure_target_kv`` and ``measure_drafter_context`` give the bytes our runtime actually holds, to print next
to the computed ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hyflash import HyflashError

GiB, MiB = float(1 << 30), float(1 << 20)
PRESETS_DIR = Path(__file__).resolve().parent / "configs"


# ------------------------------------------------------------------------------------------------ target
@dataclass
class TargetGeometry:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    max_context: int
    layer_windows: list[int | None]  # per layer: sliding window length, None = global attention
    norms_per_layer: int = 2  # hidden-size norms per layer (Gemma 3 has four)
    qk_norm: bool = False  # per-head query/key norms (Gemma 3, Qwen 3)

    @classmethod
    def from_config(cls, cfg: dict, name: str = "") -> "TargetGeometry":
        """From a Hugging Face ``config.json`` dict (Llama, Qwen, Phi-3/4, Gemma 3 with or without text_config)."""
        cfg = cfg.get("text_config", cfg)
        try:
            layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            inter, vocab = int(cfg["intermediate_size"]), int(cfg["vocab_size"])
        except KeyError as e:
            raise HyflashError(f"target config lacks {e.args[0]!r}: not a decoder config this calculator knows") from None
        window = cfg.get("sliding_window")
        types = cfg.get("layer_types")
        if window and types:
            windows = [int(window) if t == "sliding_attention" else None for t in types]
        elif window and cfg.get("use_sliding_window", "sliding_window_pattern" in cfg):
            pattern = int(cfg.get("sliding_window_pattern", 1))  # every pattern-th layer is global
            windows = [None if (i + 1) % pattern == 0 else int(window) for i in range(layers)]
        else:
            windows = [None] * layers
        kind = str(cfg.get("model_type", ""))
        gemma3, qk = kind.startswith("gemma3"), kind.startswith(("gemma3", "qwen3"))
        return cls(name=name or cfg.get("_name_or_path", "") or kind or "target", layers=layers,
                   hidden=hidden, heads=heads, kv_heads=kv, head_dim=head_dim, intermediate=inter, vocab=vocab,
                   tied=bool(cfg.get("tie_word_embeddings", False)),
                   max_context=int(cfg.get("max_position_embeddings", 0)), layer_windows=windows,
                   norms_per_layer=4 if gemma3 else 2, qk_norm=qk)

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2)

    def layer_params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        mlp = 3 * self.hidden * self.intermediate  # gated MLP: gate, up, down
        return attn + mlp + self.norms_per_layer * self.hidden + (2 * self.head_dim if self.qk_norm else 0)

    def params(self) -> int:
        return self.embedding_params() + self.layers * self.layer_params() + self.hidden  # + final norm

    def kv_bytes(self, context: int, kv_bits: float = 16) -> float:
        per_token_layer = 2 * self.kv_heads * self.head_dim * kv_bits / 8
        return sum(per_token_layer * (context if w is None else min(context, w)) for w in self.layer_windows)


def load_target_geometry(spec: str) -> TargetGeometry:
    """A preset name (``phi-4-reasoning``), a ``config.json`` path, a model directory, or a target spec."""
    preset = PRESETS_DIR / f"{spec}.json"
    path, name = Path(spec), None
    if preset.exists():
        path = preset
    elif path.is_dir():
        path = path / "config.json"
    elif not path.exists():
        from hyflash.target import resolve_target_path

        name, local = resolve_target_path(spec)
        path = Path(local) / "config.json"
    if not path.exists():
        raise HyflashError(f"no config.json for target {spec!r}")
    cfg = json.loads(path.read_text())
    name = name or cfg.get("_hyflash_name") or (path.parent.name if path.name == "config.json" else path.stem)
    return TargetGeometry.from_config(cfg, name=name)


# ----------------------------------------------------------------------------------------------- drafter
@dataclass
class DrafterGeometry:
    layers: int
    window: int | None  # None: full attention over every committed feature
    kv_heads: int
    head_dim: int
    memory_heads: int  # 0: no recurrent memory
    memory_state_dim: int
    memory_head_dim: int
    conv_channels: int
    conv_kernel: int
    params: int  # the drafter's own parameters (embedding and LM head are the target's)
    note: str = ""
    copy_rank: int = 0  # the copy head's keys and values per held feature (DrafterConfig.copy_head_rank)
    fixed_extra: int = 0  # bytes of the lag state, the copy head's last feature and the copy memory (constant)

    @classmethod
    def from_drafter_config(cls, cfg, params: int) -> "DrafterGeometry":
        has_mem = cfg.variant == "hyflash"
        n_k = cfg.memory_state_dim if cfg.memory == "mamba2" else cfg.memory_heads * cfg.memory_state_dim
        return cls(layers=cfg.num_layers, window=cfg.window if cfg.variant != "full" else None,
                   kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                   memory_heads=cfg.memory_heads if has_mem else 0, memory_state_dim=cfg.memory_state_dim,
                   memory_head_dim=cfg.memory_head_dim,
                   conv_channels=(cfg.memory_heads * cfg.memory_head_dim + n_k) if has_mem else 0,
                   conv_kernel=cfg.conv_kernel, params=params, note=f"{cfg.variant} drafter",
                   copy_rank=cfg.copy_head_rank, fixed_extra=cls._extra_state_bytes(cfg))

    @staticmethod
    def _extra_state_bytes(cfg) -> int:
        """What DrafterState keeps besides rings, memories and convs: the last L fused features (context_lags), the
        last committed feature (copy head) and token's embedding (copy_head_tokens), per slot a K × rank fp32 state
        and the last S keys of size K (copy memory; K = copy_memory_key_dim)."""
        total = cfg.context_lags * cfg.hidden_size * 2
        if cfg.copy_head_rank:
            total += cfg.hidden_size * 2 * (1 + cfg.copy_head_tokens)
        if cfg.copy_memory:
            total += cfg.block_size * cfg.copy_memory_key_dim * (cfg.copy_head_rank * 4 + 2)
        return total

    def window_kv_bytes(self, context: int) -> float:
        held = context if self.window is None else self.window  # the ring is allocated whole (DrafterState)
        return self.layers * 2 * self.kv_heads * self.head_dim * held * 2  # bf16

    def memory_bytes(self) -> float:
        return self.layers * self.memory_heads * self.memory_state_dim * self.memory_head_dim * 4  # fp32

    def conv_bytes(self) -> float:
        return self.layers * (self.conv_kernel - 1) * self.conv_channels * 2

    def copy_head_bytes(self, context: int) -> float:
        held = context if self.window is None else self.window
        return 2 * self.copy_rank * held * 2  # bf16 keys and values

    def context_bytes(self, context: int) -> float:
        return (self.window_kv_bytes(context) + self.memory_bytes() + self.conv_bytes() + self.copy_head_bytes(context)
                + self.fixed_extra)


def paper_drafter_for(t: TargetGeometry, params: int = 0) -> DrafterGeometry:
    """The paper's 2-layer drafter laid out on a target's geometry, under stated assumptions: attention with the
    target's KV heads and head size, window 256; a Mamba-2 memory with expand 1 (heads · 64 = hidden) and
    d_state 64; conv kernel 4 over x and B."""
    heads = t.hidden // 64
    return DrafterGeometry(layers=2, window=256, kv_heads=t.kv_heads, head_dim=t.head_dim, memory_heads=heads,
                           memory_state_dim=64, memory_head_dim=64, conv_channels=heads * 64 + 64, conv_kernel=4,
                           params=params, note="paper layout: 2 layers, window 256, Mamba-2 expand 1, d_state 64")


# ------------------------------------------------------------------------------------------------ budget
@dataclass
class Budget:
    target: TargetGeometry
    drafter: DrafterGeometry | None
    context: int
    weight_bits: float = 16
    embed_bits: float | None = None  # None: same as weight_bits
    kv_bits: float = 16
    drafter_bits: float = 16
    budget_gib: float | None = None
    rows: list[tuple[str, float]] = field(default_factory=list)

    def __post_init__(self):
        if self.context < 1:
            raise HyflashError(f"context must be >= 1, got {self.context}")
        for name in ("weight_bits", "kv_bits", "drafter_bits"):
            if not 0 < getattr(self, name) <= 32:
                raise HyflashError(f"{name} must be in (0, 32], got {getattr(self, name)}")
        t, e = self.target, self.embed_bits if self.embed_bits is not None else self.weight_bits
        body = t.params() - t.embedding_params()
        self.rows = [("target weights", body * self.weight_bits / 8 + t.embedding_params() * e / 8),
                     ("target KV cache", t.kv_bytes(self.context, self.kv_bits))]
        if self.drafter is not None:
            d = self.drafter
            self.rows += [("drafter weights", d.params * self.drafter_bits / 8)] if d.params else []
            self.rows += [("drafter window KV", d.window_kv_bytes(self.context)),
                          ("drafter recurrent state", d.memory_bytes()),
                          ("drafter conv state", d.conv_bytes())]

    @property
    def total(self) -> float:
        return sum(b for _, b in self.rows)

    def left(self) -> float | None:
        return None if self.budget_gib is None else self.budget_gib * GiB - self.total

    def assumptions(self) -> list[str]:
        t, d = self.target, self.drafter
        e = self.embed_bits if self.embed_bits is not None else self.weight_bits
        out = [f"target {t.name}: {t.layers} layers, hidden {t.hidden}, {t.heads} heads / {t.kv_heads} KV heads x "
               f"{t.head_dim}, MLP {t.intermediate} (gated), vocab {t.vocab}, embeddings "
               f"{'tied' if t.tied else 'untied'}",
               f"target parameters counted from that geometry: {t.params():,} (no biases; norms included)",
               f"target weights at {self.weight_bits:g} bits, embedding/LM head at {e:g} bits; quantisation scales "
               f"and zero points not counted",
               f"target KV cache at {self.kv_bits:g} bits for {self.context:,} tokens; "
               + ("every layer global" if all(w is None for w in t.layer_windows) else
                  f"{sum(w is not None for w in t.layer_windows)} sliding layers hold at most their window"),
               "not counted: activations, logits, runtime/allocator overhead, the OS"]
        if d is not None:
            out += [f"drafter: {d.note}; {d.layers} layers, "
                    + (f"window {d.window}" if d.window is not None else "attention over every committed feature")
                    + f", {d.kv_heads} KV heads x {d.head_dim} in bf16",
                    f"drafter memory: {d.memory_heads} heads x d_state {d.memory_state_dim} x head dim "
                    f"{d.memory_head_dim} in fp32; conv state {d.conv_kernel - 1} x {d.conv_channels} in bf16"
                    if d.memory_heads else "drafter memory: none",
                    f"drafter weights: {d.params:,} own parameters at {self.drafter_bits:g} bits "
                    f"(embedding and LM head shared with the target)" if d.params else
                    "drafter weights: not known for this layout, not counted"]
        return out

    def table(self) -> str:
        lines = [f"{name:<26}{b / MiB:>14,.2f} MiB{b / GiB:>10.3f} GiB" for name, b in self.rows]
        lines.append(f"{'total':<26}{self.total / MiB:>14,.2f} MiB{self.total / GiB:>10.3f} GiB")
        if self.budget_gib is not None:
            left = self.left()
            lines.append(f"{'left of ' + format(self.budget_gib, 'g') + ' GiB':<26}{left / MiB:>14,.2f} MiB"
                         f"{left / GiB:>10.3f} GiB" + ("  (over budget)" if left < 0 else ""))
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- measured
def cache_nbytes(cache) -> int:
    """Bytes of key/value tensors a transformers cache holds."""
    from hyflash.decoding import _cache_nbytes

    return _cache_nbytes(cache)


def measure_target_kv(target, context: int) -> int:
    """Run the target over `context` tokens, in chunks as a prompt's prefill, and count the bytes its cache holds."""
    import torch

    from hyflash.decoding import PREFILL_CHUNK

    ids = torch.randint(0, target.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    cache = target.new_cache()
    with torch.no_grad():
        for start in range(0, context, PREFILL_CHUNK):
            target.forward(ids[start:start + PREFILL_CHUNK], cache, features=False, last_only=True)
    if hasattr(cache, "trim"):  # as after a prompt's prefill (decoding.prompt_forward)
        cache.trim()
    return cache_nbytes(cache)


def measure_drafter_context(drafter, context: int) -> int:
    """Commit `context` random features into a fresh drafter state and count its bytes."""
    import torch

    from hyflash.drafter.state import DrafterState

    state = DrafterState(drafter)
    cfg = drafter.config
    feats = torch.randn(context, len(cfg.target_layers) * cfg.target_hidden_size,
                        generator=torch.Generator().manual_seed(0)).to(state.dtype)
    ids = torch.zeros(context, dtype=torch.long)  # the tokens matter to no byte count (copy_head_tokens reads them)
    for i in range(0, context, 1024):
        state.commit(feats[i:i + 1024], ids[i:i + 1024])
    return state.nbytes()


# --------------------------------------------------------------------------------------------------- CLI
def _drafter_geometry(spec: str, t: TargetGeometry):
    """(DrafterGeometry or None, loaded drafter or None) for --drafter none | paper | auto | PATH."""
    from hyflash.drafter.config import DrafterConfig
    from hyflash.drafter.model import CONFIG_NAME, WEIGHTS_NAME

    if spec == "none":
        return None
    if spec == "paper":
        return paper_drafter_for(t)
    path = None
    if spec == "auto":
        from hyflash.proposers import SHIPPED

        path = SHIPPED / t.name / "hyflash"
        if not (path / CONFIG_NAME).exists():
            return paper_drafter_for(t)  # nothing shipped for this target: the paper's layout on its geometry
    else:
        path = Path(spec)
    if not (path / CONFIG_NAME).exists():
        raise HyflashError(f"no drafter checkpoint at {path} (expected {CONFIG_NAME})")
    cfg = DrafterConfig.load(path / CONFIG_NAME)
    params = 0
    if (path / WEIGHTS_NAME).exists():
        from safetensors import safe_open

        with safe_open(str(path / WEIGHTS_NAME), "pt") as f:  # a reduced draft vocabulary is an index, not weights
            params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys() if k != "draft_vocab")
    g = DrafterGeometry.from_drafter_config(cfg, params)
    g.note = f"{cfg.variant} drafter {path}"
    return g


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def budget_command_impl(target, drafter, context, weight_bits, embed_bits, kv_bits, drafter_bits, budget_gib,
                        measure) -> str:
    t = load_target_geometry(target)
    context = context or t.max_context or 2048
    d = _drafter_geometry(drafter, t)
    b = Budget(t, d, context, weight_bits, embed_bits, kv_bits, drafter_bits, budget_gib)
    out = ["assumptions:"] + [f"  - {a}" for a in b.assumptions()]
    out += [f"memory at {context:,} tokens of context:", b.table()]
    if measure:
        out += [_measured(target, drafter, t, d, min(context, measure))]
    return "\n".join(out)


def _measured(target_spec, drafter_spec, t: TargetGeometry, d: DrafterGeometry | None, n: int) -> str:
    """Computed next to measured bytes at n tokens (runs the target and the drafter state on this machine)."""
    from hyflash.target import Target

    tgt = Target.load(target_spec, dtype="bf16", fast=None)  # as `hyflash generate` runs it
    lines = [f"computed vs measured at {n:,} tokens (this machine, bf16):"]
    weights = sum(p.numel() * p.element_size() for p in tgt.model.parameters())
    lines.append(f"  target weights      computed {Budget(t, None, n).rows[0][1]:>14,.0f} B   measured {weights:>14,} B")
    kv = measure_target_kv(tgt, n)
    lines.append(f"  target KV cache     computed {t.kv_bytes(n):>14,.0f} B   measured {kv:>14,} B")
    if d is not None and drafter_spec not in ("paper",) and d.params:
        from hyflash.proposers import load_proposer

        prop = load_proposer(drafter_spec, tgt)
        dr = prop.drafter
        own = sum(p.numel() * p.element_size() for p in dr.parameters())  # embedding/head are buffers
        lines.append(f"  drafter weights     computed {d.params * 2:>14,.0f} B   measured {own:>14,} B")
        ctx = measure_drafter_context(dr, n)
        lines.append(f"  drafter context     computed {d.context_bytes(n):>14,.0f} B   measured {ctx:>14,} B")
    return "\n".join(lines)
