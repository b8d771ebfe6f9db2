"""The drafter's configuration: one dataclass, saved as ``config.json`` next to the weights."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from hyflash import HyflashError

VARIANTS = ("hyflash", "full", "swa")
MEMORY_KINDS = ("mamba2", "gdn")


@dataclass
class DrafterConfig:
    # what the drafter is
    variant: str = "hyflash"  # hyflash: window + memory | full: all committed features, no memory | swa: window only
    num_layers: int = 2
    block_size: int = 7  # draft slots: the anchor + (block_size - 1) mask slots; each slot drafts one token
    window: int = 256  # committed features local attention sees (hyflash, swa)
    memory: str = "mamba2"  # mamba2 | gdn
    # ablations
    memory_limit: int | None = None  # memory folds only the last N committed features (None: all of them)
    # a reach floor: the first N memory heads cannot forget faster than this half-life (in committed features): their
    # per-feature log-decay is g = -c * sigmoid(gate pre-activation), c = ln 2 / half-life, instead of A * softplus(.).
    # Trained drafters' heads can forget within tens of features (benchmarks/memory_horizon.py); this keeps some able
    # to reach far back while their gates still choose how fast, within the floor.
    memory_long_heads: int = 0
    memory_min_half_life: float = 2048.0
    slot_attention: bool = True  # draft slots attend to each other (bidirectionally)
    causal_head_rank: int = 0  # DSpark's intra-block causal head: low-rank bias from the previous slot's token
    # lagged context features: each committed feature c_t also carries low-rank projections of c_{t-1} .. c_{t-L}
    # (a zero-initialised mix, so the drafter starts as without it). Attention keys then say what came *before* a
    # position, which copying needs: a slot finds where its anchor occurred before by matching the token l back
    # (induction heads, Olsson et al. 2022; H3's shift SSM, Fu et al. 2023, gives its memory the same). Ours; not
    # in the paper. The runtime keeps the last L features: constant memory.
    context_lags: int = 0
    context_lag_rank: int = 64
    # each mask slot its own learned input embedding instead of one shared mask embedding, so a slot knows which
    # token of the block it drafts without working it out from positions. Ours; not in the paper. Not shown to help:
    # in benchmarks/copy_toy.py slots after the first never learned to copy, with it or without.
    slot_embeddings: bool = False
    # each slot its own query-norm weights in every layer (a per-slot elementwise scale of its attention queries), so a
    # slot can ask for a different part of the keys than its neighbours with the same content, e.g. the token j + 1
    # back for slot j when copying with context_lags (a sum of content and slot embeddings cannot: that needs a
    # product). Ours; not in the paper. Not shown to help either (benchmarks/copy_toy.py, reports/README.md).
    slot_query_scales: bool = False
    # a copy head (soft prompt lookup): one attention from the anchor (its embedding and the feature before it) to
    # each committed feature in the window (its own and the one before it) finds where the anchor occurred before;
    # slot j then reads the value of the feature j + 1 after each match, so every slot of a copied block has its
    # token in one hop, which the layers need not chain (benchmarks/copy_toy.py: without it no slot after the first
    # ever learned to copy). Added to the slot inputs through a zero-initialised projection. Rank of its queries, keys
    # and values; 0: off. Ours, not in the paper (induction heads, Olsson et al. 2022; prompt lookup decoding).
    copy_head_rank: int = 0
    # the copy head also reads the committed tokens themselves: its keys add a projection of the (RMS-normalised)
    # embeddings of token t and token t − 1, its query the same of the anchor and the token before it, through
    # projections equal at initialisation, so that from step 0 the head is an exact prompt lookup of the last two
    # tokens (bigram matches score twice a unigram one), which training then refines with the features; its values
    # add a projection of token t's embedding. A real target's fused features name their own token only weakly (on
    # SmolLM2 the copy head without this learned no copying in 400 steps). Needs copy_head_rank; the runtime then
    # needs the committed tokens' ids with their features. Ours (prompt lookup decoding's match, made soft).
    copy_head_tokens: bool = False
    # the copy head's memory, for copies from further back than the window: per slot j a fixed-size delta-rule state
    # (Gated DeltaNet's update, no decay) that pairs each committed feature's copy key with the value of the feature
    # j + 1 later, read with the same query. Needs copy_head_rank and a memory (hyflash); its state is
    # block_size × rank² fp32 however long the context. memory_limit limits it too. Ours, not in the paper.
    copy_memory: bool = False
    # the copy memory's keys (and its query) expanded from copy_head_rank to 2·rank·ν dimensions by the parameter-free
    # DPFP map (Schlag, Irie & Schmidhuber 2021) before normalisation, ν = this (0: the rank's own keys): sparser keys
    # overlap less, so the delta-rule state gives back a write from further back (benchmarks/copy_memory_capacity.py:
    # at write strength 1, rank 128 recalls 47% of writes 128 back and none 256 back; expanded ×4, all at 256 and 89%
    # at 512). Its state is then block_size × 2·rank·ν × rank fp32. Needs copy_memory.
    copy_memory_dpfp: int = 0
    # the copy memory's read gated per slot by how well the window matched: slot j's read is scaled by
    # sigmoid(a_j·m_j + b_j), m_j the best score of the copy head's window attention for that slot (0 where the slot
    # sees nothing), a_j and b_j learned (zero at the start: a constant ½). Without it the memory's read, which also
    # holds every copy inside the window, blurs them: on SmolLM2 zeroing the trained read gained 0.14 on near copies,
    # on training text as on held-out (reports/README.md), so the read cannot tell when the window already has the
    # answer. Needs copy_memory. Ours. Not shown to help: trained so on SmolLM2 near copies got worse (held-out τ̂
    # 3.01 against 3.26), far ones stayed (1.97), the gates barely moved (reports/README.md).
    copy_memory_gate: bool = False
    # the copy memory folds a committed feature's write only once it is this many features old (0: at once); at the
    # attention window's length it holds only copies the window no longer does, so its read cannot blur a near copy
    # the copy head's window attention already answers, and all its training signal comes from far copies. At most
    # the window: the writes not yet folded are the window's copy keys and values, so only their write strengths
    # wait in a queue (this many numbers). With memory_limit N the memory holds the last N writes it has folded.
    # Needs copy_memory. Ours.
    copy_memory_delay: int = 0
    draft_vocab_size: int = 0  # >0: the LM head covers only these most frequent target tokens (EAGLE-3's reduced
    #                            draft vocabulary); ids are mapped back to the target's, verification is unchanged
    # geometry
    hidden_size: int = 576
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    memory_heads: int = 8
    memory_head_dim: int = 64  # dv: values per head
    memory_state_dim: int = 64  # dk: keys per head (Mamba-2's d_state)
    conv_kernel: int = 4  # short causal conv over the committed stream before the memory
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    # the target it belongs to
    vocab_size: int = 49152
    target_hidden_size: int = 576
    target_layers: list[int] = field(default_factory=lambda: [1, 8, 14, 20, 27])
    target_name: str = ""
    target_fingerprint: str = ""
    mask_token_id: int | None = None  # None: a learned mask embedding

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise HyflashError(f"unknown drafter variant {self.variant!r}; choose one of {VARIANTS}")
        if self.memory not in MEMORY_KINDS:
            raise HyflashError(f"unknown memory type {self.memory!r}; choose one of {MEMORY_KINDS}")
        if not 1 <= self.num_layers <= 8:
            raise HyflashError("num_layers must be between 1 and 8")
        if self.block_size < 1:
            raise HyflashError("block_size must be >= 1")
        if self.window < 1:
            raise HyflashError("window must be >= 1")
        if self.num_heads % self.num_kv_heads:
            raise HyflashError("num_heads must be a multiple of num_kv_heads")
        if not 0 <= self.memory_long_heads <= self.memory_heads:
            raise HyflashError(f"memory_long_heads must be between 0 and memory_heads ({self.memory_heads})")
        if self.context_lags < 0 or (self.context_lags and self.context_lag_rank < 1):
            raise HyflashError("context_lags must be >= 0 and context_lag_rank >= 1")
        if self.copy_head_rank < 0:
            raise HyflashError("copy_head_rank must be >= 0")
        if self.copy_head_tokens and not self.copy_head_rank:
            raise HyflashError("copy_head_tokens needs copy_head_rank > 0 (it is a part of the copy head)")
        if self.copy_memory and not (self.copy_head_rank and self.has_memory):
            raise HyflashError("copy_memory needs copy_head_rank > 0 and the hyflash variant (a memory)")
        if self.copy_memory_dpfp < 0 or (self.copy_memory_dpfp and not self.copy_memory):
            raise HyflashError("copy_memory_dpfp must be >= 0 and needs copy_memory (it shapes the copy memory's keys)")
        if self.copy_memory_gate and not self.copy_memory:
            raise HyflashError("copy_memory_gate needs copy_memory (it gates the copy memory's read)")
        if self.copy_memory_delay < 0 or (self.copy_memory_delay and not self.copy_memory):
            raise HyflashError("copy_memory_delay must be >= 0 and needs copy_memory (it delays its writes)")
        if self.copy_memory_delay > self.window:  # the writes waiting are read from the copy head's window
            raise HyflashError(f"copy_memory_delay ({self.copy_memory_delay}) must be <= window ({self.window}): the "
                               f"writes not yet folded are read from the copy head's window")
        if self.memory_min_half_life <= 0:
            raise HyflashError("memory_min_half_life must be > 0")

    @property
    def copy_memory_key_dim(self) -> int:
        """Size of the copy memory's keys: copy_head_rank, or 2·rank·ν with copy_memory_dpfp."""
        return 2 * self.copy_head_rank * self.copy_memory_dpfp if self.copy_memory_dpfp else self.copy_head_rank

    @property
    def has_memory(self) -> bool:
        return self.variant == "hyflash"

    @property
    def attention_window(self) -> int | None:
        """How many committed features local attention sees (None: all of them)."""
        return None if self.variant == "full" else self.window

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise HyflashError(f"drafter config has unknown fields {sorted(unknown)} (made by a newer hyflash?)")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "DrafterConfig":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise HyflashError(f"corrupt drafter config {path}: {e}") from None
