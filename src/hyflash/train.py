"""Training the drafter: blocks drafted at sampled anchors of target-feature sequences, one readable loop.

A training example is a sequence from a feature store (target features, token ids, the target's greedy labels, the
spans of tokens to learn). We sample anchors a inside the spans; the block at a drafts S tokens in one pass (all
anchors of a sequence in one ``forward_train``), and slot j is trained to predict ``labels[a + j]`` — the target's own
token at position a + j + 1 — with position-decayed weights w_k = exp(−(k−1)/γ) (DFlash/DSpark):

    loss = Σ_{a,k} w_k·m_{a,k}·[(1 − λ)·CE_{a,k} + λ·D_{a,k}] / Σ_{a,k} w_k·m_{a,k}

m masks slots whose token a + j + 1 is past the sequence end or outside the anchor's span; D is an optional
distillation term against the target's top-k distribution (DSpark's ‖p_d − p_t‖₁, or KL(p_t‖p_d)); λ = kl_weight.

Run: ``hyflash train --recipe smollm2-hyflash --out runs/x`` or, on several processes,
``torchrun --nproc_per_node=2 -m hyflash.train --config recipes/smollm2-hyflash.json --out runs/x``.
A run killed at any point resumes from its last checkpoint to the same weights as an uninterrupted run.
On a GPU: ``hyflash train --recipe smollm2-hyflash-gpu --data SEQUENCES.jsonl --device cuda --out runs/x`` computes
the target's features as it goes (``hyflash.data.online``) instead of reading a cache; ``--set FIELD=VALUE``
overrides any recipe field; ``--export`` writes ``final/`` from the latest checkpoint of a run stopped early.
Several ``--recipe``s train side by side in one process (``train_many``): each batch — with an online store, the
target's forward over it — is made once and every drafter takes its step on it, reaching the weights it would reach
alone; the recipes must agree on what decides a batch (``SHARED_FIELDS``).
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache, partial
from pathlib import Path
from typing import Protocol

import click
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyflash import HyflashError
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import HyFlashDrafter, half_lives, new_drafter, save_pretrained

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"  # the repository's recipes/ (src layout)
CONFIG_NAME, LOG_NAME, CKPT_DIR = "train_config.json", "log.jsonl", "checkpoints"


# -------------------------------------------------------------------------------------------------- config
@dataclass
class TrainConfig:
    drafter: DrafterConfig = field(default_factory=DrafterConfig)  # saved as a nested dict
    # data
    target: str = "smollm2-135m"  # the target whose features are in the store (embedding + LM head come from it)
    data: str | list = ""  # feature store directory, or a sequences JSONL whose features the target computes as it
    # trains; or a list of them, read as one mixture (each keeps its own validation split: see split_store)
    online_topk: int = 32  # with a sequences JSONL: the target's top-k logits kept per token (distillation)
    seq_len: int = 2048  # training length: longer sequences are cropped at a random offset
    anchors_per_seq: int = 32
    batch_seqs: int = 8  # sequences per step per process
    val_fraction: float = 0.02  # held-out sequences (at most val_sequences of them)
    val_sequences: int = 64
    follow_target_path: bool = False  # also mask slot j once the text left the target's greedy path inside the block
    kind_weights: dict = field(default_factory=dict)  # e.g. {"packed": 3}: such sequences come 3 times per epoch
    # optimisation
    steps: int = 10000
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup: float = 0.04  # fraction of steps with linear warmup, then cosine to min_lr
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    gamma: float = 4.0  # position decay of the slot weights (DSpark: 4 for block 7)
    kl_weight: float = 0.0  # λ: weight of the distillation term (DSpark: 0.9 with l1)
    distill: str = "l1"  # l1: ‖p_d − p_t‖₁ on the renormalised top-k support | kl: KL(p_t ‖ p_d) on it
    bf16: bool | str = "auto"  # bf16 autocast (fp32 master weights): true, false, or "auto" (where it is fast:
    # a GPU, or a CPU with bf16 dot products; elsewhere it is several times slower than fp32: see autocast_bf16)
    init_from_target: bool = False  # drafter layers start as copies of target layers from the top half
    draft_vocab: int = 0  # reduced output vocabulary: the N most frequent target labels (0 = the full vocabulary)
    init_from: str = ""  # a saved drafter (save_pretrained directory) to start from: a second training stage
    draft_vocab_from: str = ""  # a JSON list of token ids, or a saved drafter, giving the draft vocabulary instead of
    # counting training labels (which, with an online store, runs the target over every training sequence first)
    # bookkeeping
    seed: int = 0  # anchors, crops and the data order
    split_seed: int = 0  # which sequences are held out: the same for every stage and seed unless changed
    ckpt_every: int = 250
    keep_checkpoints: int = 2  # the newest N checkpoints are kept (0: all of them)
    eval_every: int = 250
    threads: int = 0  # torch CPU threads per process (0: torch's default)
    device: str = "cpu"  # where the drafter (and an online target) runs: cpu | cuda | cuda:N | auto (cuda if present)

    def __post_init__(self):
        if isinstance(self.drafter, dict):
            self.drafter = DrafterConfig.from_dict(self.drafter)
        self.betas = tuple(self.betas)
        if self.distill not in ("l1", "kl"):
            raise HyflashError(f"distill must be 'l1' or 'kl', not {self.distill!r}")
        if not 0.0 <= self.kl_weight <= 1.0:
            raise HyflashError("kl_weight must be in [0, 1]")
        if self.steps < 1 or self.batch_seqs < 1 or self.anchors_per_seq < 1:
            raise HyflashError("steps, batch_seqs and anchors_per_seq must be >= 1")
        if self.ckpt_every < 1 or self.eval_every < 1:
            raise HyflashError("ckpt_every and eval_every must be >= 1 (a value above steps means only at the end)")
        if self.keep_checkpoints < 0:
            raise HyflashError("keep_checkpoints must be >= 0 (0 keeps every checkpoint)")
        if self.bf16 not in (True, False, "auto"):
            raise HyflashError(f"bf16 must be true, false or \"auto\", not {self.bf16!r}")
        if any(not isinstance(w, int) or w < 0 for w in self.kind_weights.values()):
            raise HyflashError(f"kind_weights must be whole numbers >= 0, got {self.kind_weights}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = {k: v for k, v in d.items() if not k.startswith("_")}  # "_comment" keys in recipes
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise HyflashError(f"train config has unknown fields {sorted(unknown)}")
        return cls(**d)

    def save(self, path) -> None:
        _atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")


def apply_overrides(cfg: TrainConfig, overrides) -> TrainConfig:
    """``cfg`` with fields set from ``FIELD=VALUE`` strings (VALUE parsed as JSON, else taken as a string)."""
    d = cfg.to_dict()
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise HyflashError(f"--set expects FIELD=VALUE, got {item!r}")
        try:
            d[key] = json.loads(value)
        except json.JSONDecodeError:
            d[key] = value
    return TrainConfig.from_dict(d)


def load_recipe(name_or_path: str | os.PathLike) -> TrainConfig:
    """A recipe by name (``recipes/<name>.json``, looked up in ./recipes then the repository's) or a JSON path."""
    path = Path(name_or_path)
    if not path.suffix:
        candidates = [Path("recipes") / f"{path}.json", RECIPES_DIR / f"{path}.json"]
        path = next((p for p in candidates if p.exists()), candidates[-1])
    if not path.exists():
        known = sorted(p.stem for p in RECIPES_DIR.glob("*.json"))
        raise HyflashError(f"no recipe {name_or_path!r} (known: {', '.join(known) or 'none'})")
    try:
        return TrainConfig.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise HyflashError(f"bad recipe {path}: {e}") from None


# ---------------------------------------------------------------------------------------------------- data
class FeatureStore(Protocol):
    """What the loop reads (``hyflash.data.features.FeatureStore`` implements it). ``store[i]`` is a dict:
    features [T, F] bf16, input_ids [T] int64, labels [T] int64 (labels[t]: the target's greedy token at t + 1 given
    tokens ≤ t), spans [[s, e), ..] the tokens to learn (e.g. a response), topk_vals [T, K] (the target's top-k
    logits; their softmax is its distribution renormalised to the top-k support), topk_ids [T, K]."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict: ...


class MixedStore:
    """Several stores read as one: item i of the mixture is item i − offset of the part it falls in. Every part must
    hold features of the same target layers. ``parts`` keeps them apart for the split and for validation."""

    def __init__(self, parts: list):
        configs = [getattr(p, "config", None) or {} for p in parts]
        cached = [c for c in configs if c.get("feature_layers") is not None]  # an online store computes any layers
        if len({json.dumps(c["feature_layers"]) for c in cached}) > 1:
            raise HyflashError("the stores of a mixture hold features of different target layers: "
                               f"{[c['feature_layers'] for c in cached]}")
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(p) for p in parts])
        self.config = cached[0] if cached else configs[0]
        self.total_tokens = sum(getattr(p, "total_tokens", 0) for p in parts)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> dict:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        if not 0 <= k < len(self.parts):
            raise IndexError(i)
        return self.parts[k][i - int(self.offsets[k])]

    def lengths(self) -> list[int]:
        return [n for p in self.parts for n in p.lengths()]

    def kinds(self) -> list[str | None]:
        return [kind for p in self.parts for kind in p.kinds()]


def open_store(path: str | list, target=None, topk: int = 32) -> FeatureStore:
    """A feature store directory (``hyflash.data.features``), or a sequences JSONL (``hyflash.data.sequences``)
    whose features ``target`` computes when the loop reads them (``hyflash.data.online``: for GPUs); a list of
    them is one ``MixedStore``."""
    from hyflash.data.features import FeatureStore as Store

    if isinstance(path, (list, tuple)):
        if not path:
            raise HyflashError("data is an empty list")
        parts = [open_store(p, target, topk) for p in path]
        return parts[0] if len(parts) == 1 else MixedStore(parts)
    if not path or not Path(path).exists():
        raise HyflashError(f"feature store not found: {path!r} (set `data` in the recipe)")
    if Path(path).is_file():
        if target is None:
            raise HyflashError(f"{path} is a sequences file: its features need the target")
        from hyflash.data.online import OnlineFeatureStore

        return OnlineFeatureStore(path, target, topk=topk)
    return Store(path)


def resolve_device(name: str) -> torch.device:
    """``auto``: the first CUDA device if there is one, else the CPU. A CUDA device that is absent is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise HyflashError(f"device {name!r} asked for, but this torch sees no CUDA device")
    return device


def autocast_bf16(setting: bool | str, device: torch.device) -> tuple[bool, str | None]:
    """Whether training autocasts to bf16 on ``device`` for the recipe's ``bf16`` setting, and a note to print.

    "auto" takes bf16 on a GPU and on a CPU whose bf16 matmuls are fast (``kernels.cpu_has_fast_bf16``), fp32
    elsewhere: without bf16 dot products torch converts every operand, and a step ran 16x slower than in fp32
    (111 s vs 7 s for the Gemma 3 HyFlash recipe on a 2-core AVX2 EPYC). ``true`` forces bf16 even there, with a
    warning; ``false`` is fp32. Either precision trains the same drafter, saved in bf16."""
    from hyflash.kernels import cpu_has_fast_bf16

    fast = device.type != "cpu" or cpu_has_fast_bf16()
    if setting == "auto":
        return fast, None if fast else ("this CPU has no bf16 dot-product instructions, where bf16 autocast runs "
                                        "many times slower than fp32: training in fp32 (bf16=true forces bf16)")
    if setting and not fast:
        return True, ("bf16=true on a CPU without bf16 dot-product instructions: expect steps many times slower "
                      "than in fp32 (bf16=\"auto\" picks fp32 here)")
    return bool(setting), None


def on_device(b: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in b.items()}


def check_store(store, target, cfg: TrainConfig) -> None:
    """The store's features must come from the target layers the drafter reads (the drafter's config decides)."""
    store_layers = (getattr(store, "config", None) or {}).get("feature_layers")  # recorded by data.features
    if store_layers is not None and list(store_layers) != list(cfg.drafter.target_layers):
        raise HyflashError(f"the store holds features of target layers {list(store_layers)}; the drafter config "
                           f"reads {cfg.drafter.target_layers}")
    target.feature_layers = list(cfg.drafter.target_layers)
    feat_dim = _as_tensor(store[0]["features"][:1]).shape[-1]
    if feat_dim != len(target.feature_layers) * target.hidden_size:
        raise HyflashError(f"store features have {feat_dim} channels; target layers {target.feature_layers} give "
                           f"{len(target.feature_layers) * target.hidden_size}")


def split_indices(n: int, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) sequence indices: a seeded random choice of min(val_sequences, ⌈val_fraction·n⌉) held out."""
    n_val = min(cfg.val_sequences, math.ceil(cfg.val_fraction * n)) if cfg.val_fraction > 0 else 0
    n_val = min(n_val, n - 1)
    perm = np.random.default_rng([cfg.split_seed, 7]).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def split_store(store, cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray]:
    """``split_indices`` applied to each part of a ``MixedStore`` on its own (indices shifted to the mixture): a
    store keeps the held-out sequences it had alone, so a later stage that mixes in new data still validates on
    what no stage trained on."""
    if not isinstance(store, MixedStore):
        return split_indices(len(store), cfg)
    splits = [split_indices(len(p), cfg) for p in store.parts]
    return (np.concatenate([t + off for (t, _), off in zip(splits, store.offsets)]),
            np.concatenate([v + off for (_, v), off in zip(splits, store.offsets)]))


def part_indices(store: "MixedStore", idx: np.ndarray) -> list[np.ndarray]:
    """``idx`` cut by the part each index falls in."""
    return [idx[(idx >= lo) & (idx < hi)] for lo, hi in zip(store.offsets[:-1], store.offsets[1:])]


def weighted_indices(store, idx: np.ndarray, kind_weights: dict) -> np.ndarray:
    """``idx`` with each sequence repeated ``kind_weights[kind]`` times (1 for kinds not named): one epoch of the data
    order then visits, e.g., every packed conversation three times and every document once."""
    if not kind_weights:
        return idx
    if not hasattr(store, "kinds"):
        raise HyflashError("kind_weights needs a feature store that records sequence kinds")
    kinds = store.kinds()
    reps = np.array([kind_weights.get(kinds[i], 1) for i in idx], dtype=np.int64)
    if reps.sum() == 0:
        raise HyflashError(f"kind_weights {kind_weights} leave no training sequences")
    return np.repeat(idx, reps)


@lru_cache(maxsize=2)
def _epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def sequence_ids(train_idx: np.ndarray, seed: int, position: int, count: int) -> list[int]:
    """Sequences ``position .. position+count−1`` of the data order (a fresh seeded permutation every epoch): a pure
    function of the position, which is all a checkpoint needs to continue the same order."""
    n = len(train_idx)
    return [int(train_idx[_epoch_order(n, seed, p // n)[p % n]]) for p in range(position, position + count)]


def _as_tensor(x) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))


def supervised_labels(spans, T: int, offset: int = 0) -> torch.Tensor:
    """[T] bool: labels[t] is supervised — tokens t and t + 1 both lie in a span. (A span [s, e) marks tokens the
    drafter learns to predict, e.g. a response; labels[t] is the target's token at t + 1.) ``offset``: where a crop of
    the sequence starts (spans are given in the uncropped sequence)."""
    inside = torch.zeros(T + 1, dtype=torch.bool)
    for s, e in spans:
        inside[max(s - offset, 0):max(min(e - offset, T), 0)] = True
    return inside[:-1] & inside[1:]


def sample_anchors(supervised: torch.Tensor, n: int, rng: np.random.Generator) -> torch.Tensor:
    """Up to n distinct anchors a ≥ 1 whose own label (slot 0) is supervised, sorted."""
    valid = torch.nonzero(supervised[1:])[:, 0] + 1
    if len(valid) > n:
        valid = torch.from_numpy(np.sort(rng.choice(valid.numpy(), size=n, replace=False)))
    return valid


def block_targets(labels, input_ids, supervised, anchors, S: int, follow_target_path: bool = False):
    """targets [n, S] = labels[a + j] and mask [n, S]: labels[a..a+j] all supervised (the block stays inside the
    anchor's span and the sequence); with ``follow_target_path`` also tokens a+1..a+j equal the target's greedy
    tokens, so the block is one the target could have accepted."""
    T = len(labels)
    pos = (anchors[:, None] + torch.arange(S)).clamp(max=T - 1)  # [n, S]
    ok = supervised[pos] & (anchors[:, None] + torch.arange(S) < T)
    if follow_target_path and S > 1:
        ok[:, 1:] &= input_ids[pos[:, 1:]] == labels[pos[:, 1:] - 1]  # token a+j was the target's choice
    mask = torch.cumprod(ok.long(), dim=1).bool()
    return labels[pos], mask, pos


def make_batch(store, ids: list[int], cfg: TrainConfig, rng: np.random.Generator, with_topk: bool) -> dict:
    """Crop, sample anchors, gather targets; pad to the longest sequence and the most anchors (padding is masked).

    Returns features [B, T, F], input_ids [B, T], anchors [B, n], prev_ids [B, n, S] (the token before each slot,
    for the causal head), targets/mask [B, n, S], and topk_vals/topk_ids [B, n, S, K] when ``with_topk``."""
    S = cfg.drafter.block_size
    rows = []
    for i in ids:
        item = store[i]
        T_full = len(item["input_ids"])
        start = int(rng.integers(0, T_full - cfg.seq_len + 1)) if T_full > cfg.seq_len else 0
        crop = slice(start, start + cfg.seq_len)
        ids_ = _as_tensor(item["input_ids"][crop]).long()
        labels = _as_tensor(item["labels"][crop]).long()
        sup = supervised_labels(item["spans"], len(ids_), start)
        anchors = sample_anchors(sup, cfg.anchors_per_seq, rng)
        targets, mask, pos = block_targets(labels, ids_, sup, anchors, S, cfg.follow_target_path)
        prev = torch.cat([ids_[anchors][:, None], targets[:, :-1]], dim=1)  # slot j follows labels[a+j−1]
        row = dict(features=_as_tensor(item["features"][crop]), input_ids=ids_, anchors=anchors, prev_ids=prev,
                   targets=targets, mask=mask)
        if with_topk:
            row["topk_vals"] = _as_tensor(item["topk_vals"][crop])[pos]
            row["topk_ids"] = _as_tensor(item["topk_ids"][crop]).long()[pos]
        rows.append(row)
    T = max(len(r["input_ids"]) for r in rows)
    n = max(1, max(len(r["anchors"]) for r in rows))

    def pad(x, length, value=0):  # pad dim 0 (masked: its slots are left out of the loss)
        return F.pad(x, [0, 0] * (x.dim() - 1) + [0, length - x.shape[0]], value=value)

    # a padding anchor is 1, a valid anchor (the copy head reads the feature before it), not 0
    batch = {k: torch.stack([pad(r[k], T if k in ("features", "input_ids") else n, int(k == "anchors"))
                             for r in rows]) for k in rows[0]}
    batch.setdefault("topk_vals", None)
    batch.setdefault("topk_ids", None)
    return batch


# ---------------------------------------------------------------------------------------------------- loss
def position_weights(S: int, gamma: float) -> torch.Tensor:
    """w_k = exp(−(k−1)/γ) for slots k = 1..S (unnormalised: w_1 = 1; the loss divides by Σ w·mask)."""
    return torch.exp(-torch.arange(S, dtype=torch.float32) / gamma)


def distill_term(logits, lse, topk_vals, topk_ids, kind: str) -> torch.Tensor:
    """Distance to the target's top-k distribution p_t (renormalised on its support 𝒦), per slot [..]:
    l1: ‖p_d − p_t‖₁ = Σ_𝒦 |p_d − p_t| + (1 − Σ_𝒦 p_d);  kl: Σ_𝒦 p_t (log p_t − log p_d)."""
    lp_t = topk_vals.float().log_softmax(-1)  # [.., K]
    lp_d = logits.gather(-1, topk_ids).float() - lse[..., None]
    p_t, p_d = lp_t.exp(), lp_d.exp()
    if kind == "kl":
        return torch.where(p_t > 0, p_t * (lp_t - lp_d), 0.0).sum(-1)
    return (p_d - p_t).abs().sum(-1) + (1 - p_d.sum(-1)).clamp_min(0)


def block_loss(logits, targets, mask, weights, kl_weight=0.0, topk_vals=None, topk_ids=None, distill="l1",
               loss_mask=None):
    """logits [B, n, S, V], targets/mask [B, n, S], weights [S] → (loss, per-slot correct [S], per-slot count [S]).
    A target of −1 (outside a reduced draft vocabulary) is a miss; ``loss_mask`` (default ``mask``) leaves it out
    of the loss."""
    lse = logits.float().logsumexp(-1)  # [B, n, S]
    per = lse - logits.gather(-1, targets.clamp_min(0)[..., None])[..., 0].float()  # CE against the target's token
    if kl_weight > 0:
        per = (1 - kl_weight) * per + kl_weight * distill_term(logits, lse, topk_vals, topk_ids, distill)
    w = weights.to(per.device) * (mask if loss_mask is None else loss_mask)
    # padded anchors and unsupervised slots weigh 0; their terms may be undefined (a batch without any anchor)
    loss = (per.masked_fill(w == 0, 0.0) * w).sum() / w.sum().clamp_min(1e-9)
    correct = ((logits.argmax(-1) == targets) & mask).sum((0, 1))
    return loss, correct, mask.sum((0, 1))


def label_order(store, train_idx, vocab_size: int, max_sequences: int = 4096) -> np.ndarray:
    """Token ids from the most to the least frequent target label over (up to ``max_sequences`` of) the training
    sequences (ties and unused ids broken by the lower id)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for i in train_idx[:max_sequences]:
        counts += np.bincount(np.asarray(store[int(i)]["labels"], dtype=np.int64), minlength=vocab_size)
    return np.argsort(-counts, kind="stable")


def draft_vocabulary(store, train_idx, size: int, vocab_size: int, max_sequences: int = 4096) -> torch.Tensor:
    """The ``size`` most frequent target labels over (up to ``max_sequences`` of) the training sequences, as sorted
    ids (ties and unused ids broken by the lower id)."""
    return torch.from_numpy(np.sort(label_order(store, train_idx, vocab_size, max_sequences)[:size]))


def load_draft_vocab(path, size: int, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary in ``path``: a JSON list of token ids, or a saved drafter directory (its ``draft_vocab``
    buffer). Checked against the recipe's ``draft_vocab`` size and the target's vocabulary."""
    path = Path(path)
    if path.is_dir():
        from safetensors import safe_open

        weights = path / "model.safetensors"
        if not weights.is_file():
            raise HyflashError(f"draft_vocab_from: {path} holds no model.safetensors")
        with safe_open(str(weights), framework="pt") as f:
            if "draft_vocab" not in f.keys():
                raise HyflashError(f"draft_vocab_from: the drafter in {path} has no draft vocabulary")
            ids = f.get_tensor("draft_vocab").long()
    elif path.is_file():
        try:
            ids = torch.tensor(json.loads(path.read_text()), dtype=torch.long)
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise HyflashError(f"draft_vocab_from: {path} is not a JSON list of token ids ({e})") from None
    else:
        raise HyflashError(f"draft_vocab_from: {path} not found")
    if ids.ndim != 1 or ids.numel() != size:
        raise HyflashError(f"draft_vocab_from: {path} holds {ids.numel()} ids; the recipe's draft_vocab is {size}")
    if len(ids.unique()) != size or ids.min() < 0 or ids.max() >= vocab_size:
        raise HyflashError(f"draft_vocab_from: {path} needs {size} distinct ids in [0, {vocab_size})")
    return ids.sort().values


@torch.no_grad()
def draft_vocab_ceiling(store, train_idx, val_idx, cfg: "TrainConfig", sizes: list[int], vocab_size: int) -> list[dict]:
    """What a reduced draft vocabulary can cost, before any drafter is trained: for each size N (0 = the full
    vocabulary), the N most frequent training labels (``draft_vocabulary``), then on the held-out blocks that
    ``evaluate`` scores (same sequences, crops and anchors) the share of supervised target tokens inside the vocabulary
    and the ceiling τ = 1 + mean all-correct prefix of a drafter that is right whenever the token is in its
    vocabulary. The difference between two sizes' ceilings bounds what the smaller one can cost a drafter in τ."""
    S = cfg.drafter.block_size
    targets, mask = [torch.zeros(0, S, dtype=torch.long)], [torch.zeros(0, S, dtype=torch.bool)]
    for b in validation_batches(store, val_idx, cfg):
        real = b["mask"][..., 0]
        targets.append(b["targets"][real])
        mask.append(b["mask"][real])
    targets, mask = torch.cat(targets), torch.cat(mask)  # [anchors, S]
    order = torch.from_numpy(label_order(store, train_idx, vocab_size))
    out = []
    for size in sizes:
        inside = torch.zeros(vocab_size, dtype=torch.bool)
        inside[order[:size or vocab_size]] = True
        ok = inside[targets] & mask
        prefix = all_correct_prefix(ok).double()
        out.append({"draft_vocab": size or vocab_size, "coverage": float(ok.sum() / mask.sum().clamp_min(1)),
                    "ceiling_tau": 1 + float(prefix.mean()) if len(prefix) else float("nan"),
                    "anchors": len(prefix)})
    return out


def to_draft_vocab(b: dict, index_of: torch.Tensor) -> dict:
    """Targets and top-k ids as draft-vocabulary indices. A target outside the draft vocabulary becomes −1 (a certain
    miss, left out of the loss); top-k entries outside it get −inf, so the distillation target renormalises on the
    rest."""
    b = dict(b)
    b["targets"] = index_of[b["targets"]]
    b["loss_mask"] = b["mask"] & (b["targets"] >= 0)
    if b.get("topk_ids") is not None:
        ids = index_of[b["topk_ids"]]
        outside = ids < 0  # a row with no entry inside stays finite (it is left out of the loss below)
        b["topk_vals"] = b["topk_vals"].float().masked_fill(outside & ~outside.all(-1, keepdim=True), float("-inf"))
        b["topk_ids"] = ids.clamp_min(0)
        b["loss_mask"] &= (ids >= 0).any(-1)
    return b


def all_correct_prefix(ok: torch.Tensor) -> torch.Tensor:
    """ok [.., S] → [..]: how many leading slots are all correct."""
    return torch.cumprod(ok.long(), dim=-1).sum(-1)


def accepted_prefix(logits, targets, mask) -> torch.Tensor:
    """Per anchor, the length of the longest prefix of argmax drafts that are all correct (a masked slot ends it)."""
    return all_correct_prefix((logits.argmax(-1) == targets) & mask)  # [B, n, S] → [B, n]


# ------------------------------------------------------------------------------------------ model set-up
def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup·steps, then cosine from lr to min_lr (a multiplier of lr)."""
    warm = max(1, round(cfg.warmup * cfg.steps))
    if step < warm:
        return (step + 1) / warm
    t = min(1.0, (step - warm) / max(1, cfg.steps - warm))
    return (cfg.min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (cfg.lr - cfg.min_lr)) / cfg.lr


# parameters that are rows of vectors, one per draft slot (DrafterConfig.slot_embeddings, slot_query_scales): they
# decay as little as the one vector they stand in for (the mask embedding, a query norm's weights)
PER_SLOT_VECTORS = ("slot_embedding", "slot_q_scale")


def make_optimizer(drafter: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices decay, vectors (norms, biases, gates, the mask embedding, per-slot vectors) do not."""
    named = [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]
    vector = {n for n, p in named if p.dim() < 2 or n.rsplit(".", 1)[-1] in PER_SLOT_VECTORS}
    groups = [{"params": [p for n, p in named if n not in vector], "weight_decay": cfg.weight_decay},
              {"params": [p for n, p in named if n in vector], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


def top_half_layers(n_target: int, n_drafter: int) -> list[int]:
    """Target layers to copy: evenly spaced over the top half, the last one being the target's last layer."""
    lo, hi = n_target // 2, n_target - 1
    return [round(lo + (hi - lo) * (i + 1) / n_drafter) for i in range(n_drafter)]


def init_from_drafter(drafter: HyFlashDrafter, path, target) -> list[str]:
    """Copy every weight (and the draft vocabulary) of the saved drafter at ``path`` into ``drafter``, which must
    have the same architecture: a later training stage continues where an earlier one ended."""
    from hyflash.drafter.model import from_pretrained

    source = from_pretrained(path, target, dtype=torch.float32)
    ignore = {"target_name", "target_fingerprint"}
    mine = {k: v for k, v in drafter.config.to_dict().items() if k not in ignore}
    theirs = {k: v for k, v in source.config.to_dict().items() if k not in ignore}
    if mine != theirs:
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        raise HyflashError(f"init_from drafter {path} differs from the recipe's drafter in {diff}")
    state = source.state_dict()
    drafter.load_state_dict(state)
    if drafter.draft_vocab is not None:
        drafter.set_draft_vocab(drafter.draft_vocab.clone())
    return sorted(state)


@torch.no_grad()
def init_from_target(drafter: HyFlashDrafter, target) -> list[str]:
    """Copy attention q/k/v/o (and q/k norms where the target has them), MLP gate/up/down and both norms from target
    layers chosen by ``top_half_layers``, and the target's final norm (Gemma's norms as the scales they apply; its
    MLP's GELU becomes our SiLU, so there the copy is a starting point, not the target's function). Anything whose
    shape differs is skipped, except a drafter MLP wider than the target's: the target's units go first and the extra
    units start with zero output weights, so the widened MLP computes the target's MLP at initialisation. Returns
    what was copied."""
    t_layers = target.model.get_decoder().layers
    copied = []

    def put(dst: torch.Tensor, src: torch.Tensor | None, name: str):
        if src is not None and dst.shape == src.shape:
            dst.copy_(src.to(dst.dtype))
            copied.append(name)

    def norm_weight(norm) -> torch.Tensor | None:
        """The scale an RMSNorm applies: Gemma's norms compute x·(1 + w), ours x·w."""
        if norm is None:
            return None
        return norm.weight + 1 if type(norm).__name__.startswith("Gemma") else norm.weight

    for i, j in enumerate(top_half_layers(len(t_layers), len(drafter.layers))):
        d, t = drafter.layers[i], t_layers[j]
        att, mlp = t.self_attn, t.mlp
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            put(getattr(d.attn, name).weight, getattr(att, name).weight, f"layers.{i}.attn.{name} <- {j}")
        for name in ("q_norm", "k_norm"):
            if hasattr(att, name):
                put(getattr(d.attn, name).weight, norm_weight(getattr(att, name)), f"layers.{i}.attn.{name} <- {j}")
        put(d.norm.weight, norm_weight(t.input_layernorm), f"layers.{i}.norm <- {j}")
        # the norm in front of the MLP: Gemma has one of its own (its post-attention norm scales the attention output)
        mlp_norm = getattr(t, "pre_feedforward_layernorm", None)
        mlp_norm = t.post_attention_layernorm if mlp_norm is None else mlp_norm
        put(d.mlp_norm.weight, norm_weight(mlp_norm), f"layers.{i}.mlp_norm <- {j}")
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight  # [I, d], [I, d], [d, I]
        I, I_d = gate.shape[0], d.mlp.down.weight.shape[1]
        if d.mlp.gate_up.weight.shape[1] == gate.shape[1] and d.mlp.down.weight.shape[0] == down.shape[0] and I <= I_d:
            d.mlp.gate_up.weight[:I] = gate  # gate first, then up
            d.mlp.gate_up.weight[I_d:I_d + I] = up
            d.mlp.down.weight.zero_()[:, :I] = down
            copied.append(f"layers.{i}.mlp <- {j}" + (f" (widened {I} -> {I_d})" if I < I_d else ""))
    put(drafter.norm.weight, norm_weight(getattr(target.model.get_decoder(), "norm", None)), "norm <- final norm")
    return copied


class BlockDrafting(nn.Module):
    """What DDP wraps: its forward is the drafter's training forward (DDP syncs gradients of what forward uses)."""

    def __init__(self, drafter: HyFlashDrafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, features, input_ids, anchors, prev_ids=None):
        return self.drafter.forward_train(features, input_ids, anchors, prev_ids=prev_ids)


def draft_index(drafter: HyFlashDrafter) -> torch.Tensor | None:
    """Target id → draft-vocabulary index (−1 outside it); None without a draft vocabulary."""
    if drafter.draft_vocab is None:
        return None
    index_of = torch.full((drafter.head_weight.shape[0],), -1, dtype=torch.long)
    index_of[drafter.draft_vocab.cpu()] = torch.arange(len(drafter.draft_vocab))  # batches are made on the CPU
    return index_of


# ------------------------------------------------------------------------------------------- validation
def validation_batches(store, val_idx, cfg: TrainConfig):
    """The held-out batches validation scores: fixed crops and anchors, seeded by position and by the split's seed —
    not by the data-order seed, so a later stage with a new data order is scored on the same blocks as the stage
    before it, and its τ̂ curve continues the earlier one."""
    for k in range(0, len(val_idx), cfg.batch_seqs):
        ids = [int(i) for i in val_idx[k:k + cfg.batch_seqs]]
        yield make_batch(store, ids, cfg, np.random.default_rng([cfg.split_seed, 99, k]), with_topk=False)


def evaluate(drafter: HyFlashDrafter, store, val_idx, cfg: TrainConfig) -> dict:
    """Per-slot accuracy and τ̂ = 1 + mean over anchors of the longest all-correct prefix of argmax drafts, on the
    held-out sequences with fixed anchors, with its standard error over those anchors (``val_tau_se``). With a
    reduced draft vocabulary also ``val_tau_vocab_free``: τ̂ counting every target token outside the vocabulary as
    drafted right, an upper bound on τ̂ had the same drafter kept the full vocabulary."""
    return evaluate_many([drafter], store, val_idx, cfg)[0]


@torch.no_grad()
def evaluate_many(drafters: list[HyFlashDrafter], store, val_idx, cfg: TrainConfig,
                  per_anchor: bool = False) -> list[dict]:
    """``evaluate`` for each drafter on the same held-out batches, each batch made (and an online store's target
    run) once for all of them. ``per_anchor`` adds ``val_prefixes``, each anchor's accepted prefix (a tensor, in the
    same anchor order for every drafter: for paired comparisons)."""
    S = cfg.drafter.block_size
    sums = [dict(correct=torch.zeros(S), count=torch.zeros(S), prefix=0.0, prefix_sq=0.0, anchors=0, free=0.0,
                 decays=[[] for _ in d.layers], prefixes=[]) for d in drafters]  # sums on the CPU
    was_training = [d.training for d in drafters]
    for d in drafters:
        d.eval()
    for batch in validation_batches(store, val_idx, cfg):
        for drafter, acc in zip(drafters, sums):
            b = to_draft_vocab(batch, draft_index(drafter)) if drafter.draft_vocab is not None else batch
            device = drafter.head_weight.device
            b = on_device(b, device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16(cfg.bf16, device)[0]):
                logits = drafter.forward_train(b["features"], b["input_ids"], b["anchors"], prev_ids=b["prev_ids"])
            hit = logits.argmax(-1) == b["targets"]
            ok = hit & b["mask"]
            acc["correct"] += ok.sum((0, 1)).float().cpu()
            acc["count"] += b["mask"].sum((0, 1)).float().cpu()
            real = b["mask"][..., 0]  # padded anchors have no supervised slot
            accepted = all_correct_prefix(ok)[real].double()
            acc["prefix"] += float(accepted.sum())
            acc["prefix_sq"] += float((accepted ** 2).sum())
            acc["anchors"] += int(real.sum())
            if per_anchor:
                acc["prefixes"].append(accepted.cpu())
            if drafter.draft_vocab is not None:  # as if every token outside the draft vocabulary was drafted right
                acc["free"] += float(all_correct_prefix((hit | (b["targets"] < 0)) & b["mask"])[real].sum())
            if drafter.config.has_memory:  # how fast its memory forgets, over the real (not padded) positions
                real_pos = b["features"].abs().sum(-1) > 0
                for layer_g, g in zip(acc["decays"], drafter.memory_log_decays(b["features"])):
                    if g is not None:
                        layer_g.append(g[real_pos].cpu())
    outs = []
    for drafter, training, acc in zip(drafters, was_training, sums):
        drafter.train(training)
        n = max(acc["anchors"], 1)
        mean = acc["prefix"] / n
        se = math.sqrt(max(acc["prefix_sq"] / n - mean ** 2, 0.0) / max(acc["anchors"] - 1, 1))  # over anchors
        out = {"val_acc": [round(a, 4) for a in (acc["correct"] / acc["count"].clamp_min(1)).tolist()],
               "val_tau": round(1 + mean, 4), "val_tau_se": round(se, 4), "val_anchors": acc["anchors"]}
        if drafter.draft_vocab is not None:  # minus val_tau: at most what the reduced draft vocabulary costs it
            out["val_tau_vocab_free"] = round(1 + acc["free"] / n, 4)
        if any(acc["decays"]):  # per layer, each memory head's median half-life in features (how far it can reach)
            out["val_half_life"] = [[round(min(float(x), 1e9), 1) for x in half_lives(torch.cat(gs))]
                                    for gs in acc["decays"] if gs]
        if per_anchor:
            out["val_prefixes"] = torch.cat(acc["prefixes"]) if acc["prefixes"] else torch.zeros(0, dtype=torch.float64)
        outs.append(out)
    return outs


# ------------------------------------------------------------------------------------------- checkpoints
def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def checkpoints(out_dir: Path) -> list[Path]:
    return sorted((out_dir / CKPT_DIR).glob("step_*.pt"))


def save_checkpoint(out_dir: Path, state: dict, keep: int | None) -> Path:
    """Write checkpoints/step_NNNNNNN.pt atomically (temp file + rename) and keep only the last ``keep`` (None: drop
    nothing yet, ``prune_checkpoints`` later)."""
    path = out_dir / CKPT_DIR / f"step_{state['step']:07d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)
    if keep is not None:
        prune_checkpoints(out_dir, keep)
    return path


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    for old in checkpoints(out_dir)[:-keep]:
        old.unlink()


def rng_states() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_states(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def _clock(device: torch.device) -> float:
    """time.perf_counter() once the device's queued work is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _truncate_log(path: Path, step: int) -> None:
    """On resume, drop log lines the killed run wrote after its last checkpoint (they are about to be redone)."""
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        _atomic_write_text(path, "".join(line + "\n" for line in keep))


# ------------------------------------------------------------------------------------------ distributed
def setup_distributed() -> tuple[int, int]:
    """(rank, world size). Under torchrun (WORLD_SIZE > 1) joins the process group (gloo: CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def all_sum(x: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(x)
    return x


# ------------------------------------------------------------------------------------------------- train
# Recipes trained in one process read the same batches, so they must agree on everything that decides a batch and
# the loop: the target (and the layers the drafter reads), the data, its split and order, crops, anchors and blocks.
SHARED_FIELDS = ("target", "data", "online_topk", "seq_len", "anchors_per_seq", "batch_seqs", "val_fraction",
                 "val_sequences", "follow_target_path", "kind_weights", "steps", "seed", "split_seed", "threads",
                 "device", "ckpt_every")
SHARED_DRAFTER_FIELDS = ("target_layers", "block_size")


def check_shareable(cfgs: list[TrainConfig], names: list[str]) -> None:
    """Raise HyflashError naming every field on which the recipes of one process disagree."""
    ref = cfgs[0].to_dict()
    bad = []
    for cfg, name in zip(cfgs[1:], names[1:]):
        d = cfg.to_dict()
        bad += [f"{f}: {names[0]} {ref[f]!r} vs {name} {d[f]!r}" for f in SHARED_FIELDS if d[f] != ref[f]]
        bad += [f"drafter.{f}: {names[0]} {ref['drafter'][f]!r} vs {name} {d['drafter'][f]!r}"
                for f in SHARED_DRAFTER_FIELDS if d["drafter"][f] != ref["drafter"][f]]
    if bad:
        raise HyflashError("drafters trained in one process share every batch, so their recipes must agree on "
                           + ", ".join(SHARED_FIELDS) + " and the drafter's " + ", ".join(SHARED_DRAFTER_FIELDS)
                           + "; they differ in " + "; ".join(bad))


class _Run:
    """One drafter's training state: weights, optimiser, schedule, its output directory and log."""

    def __init__(self, cfg: TrainConfig, out_dir: Path, target, store, train_idx, device, main: bool, world: int,
                 vocabularies: dict):
        self.cfg, self.out_dir, self.main = cfg, out_dir, main
        self.name = out_dir.name
        self.found = {int(p.stem.split("_")[1]): p for p in checkpoints(out_dir)}
        torch.manual_seed(cfg.seed)
        dcfg = DrafterConfig.from_dict({**cfg.drafter.to_dict(), "draft_vocab_size": cfg.draft_vocab})
        self.drafter = drafter = new_drafter(dcfg, target, dtype=torch.float32).to(device).train()
        fresh = not self.found
        if cfg.init_from and fresh:
            copied = init_from_drafter(drafter, cfg.init_from, target)
            self.say(f"started from the drafter in {cfg.init_from} ({len(copied)} tensors)")
        elif cfg.draft_vocab and fresh:
            if cfg.draft_vocab_from:
                drafter.set_draft_vocab(load_draft_vocab(cfg.draft_vocab_from, cfg.draft_vocab, target.vocab_size))
            else:  # counted once for every drafter of the process that wants this size
                if cfg.draft_vocab not in vocabularies:
                    vocabularies[cfg.draft_vocab] = draft_vocabulary(store, train_idx, cfg.draft_vocab,
                                                                     target.vocab_size)
                drafter.set_draft_vocab(vocabularies[cfg.draft_vocab])
        if cfg.init_from_target and fresh and not cfg.init_from:
            copied = init_from_target(drafter, target)
            self.say(f"initialised {len(copied)} tensors from the target: {copied}")
        self.model = BlockDrafting(drafter)
        if world > 1:  # embed/head buffers are frozen
            self.model = nn.parallel.DistributedDataParallel(self.model, broadcast_buffers=False)
        self.opt = make_optimizer(drafter, cfg)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, partial(lr_factor, cfg=cfg))
        self.weights = position_weights(cfg.drafter.block_size, cfg.gamma)
        self.index_of = self._index()
        self.log = None

    def _index(self) -> torch.Tensor | None:
        index_of = draft_index(self.drafter)  # batches reach train_step on the drafter's device
        return None if index_of is None else index_of.to(self.drafter.head_weight.device)

    def say(self, text: str) -> None:
        if self.main:
            print(f"hyflash: {text}", file=sys.stderr)

    def resume(self, step: int) -> dict:
        """Load the checkpoint of ``step`` (weights, optimiser, schedule); returns it (RNG states, data position)."""
        ckpt = torch.load(self.found[step], map_location="cpu", weights_only=False)  # our own file (RNG states)
        self.drafter.load_state_dict(ckpt["model"])
        if self.drafter.draft_vocab is not None:
            self.drafter.set_draft_vocab(self.drafter.draft_vocab.clone())
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.index_of = self._index()  # the checkpoint's draft vocabulary
        self.say(f"resuming {self.out_dir} at step {step}")
        return ckpt

    def start_log(self, step: int, n_train: int, n_val: int, world: int) -> None:
        if not self.main:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.cfg.save(self.out_dir / CONFIG_NAME)
        _truncate_log(self.out_dir / LOG_NAME, step)
        self.say(f"{self.cfg.drafter.variant} drafter, {self.drafter.num_parameters():,} trainable parameters; "
                 f"{n_train} train / {n_val} val sequences; {world} process(es) [{self.out_dir}]")
        self.log = open(self.out_dir / LOG_NAME, "a")

    def train_step(self, b: dict, world: int) -> tuple[torch.Tensor, float, float]:
        """One optimiser step on batch ``b``; returns (mean loss, slot correct, slot counts, anchors) summed over
        processes, the pre-clip gradient norm and the learning rate used."""
        cfg = self.cfg
        if self.drafter.draft_vocab is not None:
            b = to_draft_vocab(b, self.index_of)
        b = on_device(b, self.drafter.head_weight.device)
        with torch.autocast(b["features"].device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
            logits = self.model(b["features"], b["input_ids"], b["anchors"], b["prev_ids"])  # [B, n, S, V]
        loss, correct, count = block_loss(logits, b["targets"], b["mask"], self.weights, cfg.kl_weight,
                                          b["topk_vals"], b["topk_ids"], cfg.distill, b.get("loss_mask"))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.sched.step()
        stats = all_sum(torch.cat([loss.detach()[None] / world, correct.float(), count.float(),
                                   b["mask"][..., 0].sum()[None].float()]))  # mean loss, slot counts, anchors
        return stats, float(grad_norm), lr

    def checkpoint(self, state: dict) -> None:
        save_checkpoint(self.out_dir, {**state, "model": self.drafter.state_dict(),
                                       "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                                       "config": self.cfg.to_dict()}, keep=None)


def train(cfg: TrainConfig, out_dir, target=None, store=None, resume: bool = True,
          stop_at: int | None = None) -> HyFlashDrafter:
    """Train a drafter for ``cfg.steps`` steps into ``out_dir`` (config, log.jsonl, checkpoints/, final/, loss.png).

    ``target``/``store`` default to ``Target.load(cfg.target)`` and the feature store at ``cfg.data``. With
    ``resume`` a run continues from its latest checkpoint. ``stop_at`` ends the run after that step (checkpointed) as if it were
    killed there (no final export). Returns the drafter (fp32)."""
    return train_many([cfg], [out_dir], target, store, resume, stop_at)[0]


def train_many(cfgs: list[TrainConfig], out_dirs: list, target=None, store=None, resume: bool = True,
               stop_at: int | None = None) -> list[HyFlashDrafter]:
    """Train several drafters in one process on the same batches: each batch (with an online store, the target's
    forward over its sequences) is made once and every drafter takes its step on it. Each drafter trains exactly as
    ``train`` would train it alone (the same weights, bit for bit) into its own directory. The recipes must agree on
    ``SHARED_FIELDS`` (``check_shareable``); they may differ in the drafter, the optimiser and the loss. A killed
    group resumes from the last step every run has a checkpoint of."""
    out_dirs = [Path(d) for d in out_dirs]
    if len(cfgs) != len(out_dirs) or not cfgs:
        raise HyflashError("train_many needs one output directory per recipe")
    if len({d.resolve() for d in out_dirs}) < len(out_dirs):
        raise HyflashError(f"two recipes would train into the same directory: {[str(d) for d in out_dirs]}")
    check_shareable(cfgs, [d.name for d in out_dirs])
    cfg = cfgs[0]  # what decides the batches, the same for all
    rank, world = setup_distributed()
    main = rank == 0
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if not resume:
        for d in out_dirs:
            if checkpoints(d):
                raise HyflashError(f"{d} already holds checkpoints; resume it or choose another output directory")

    # ---- data, target, models, optimisers
    device = resolve_device(cfg.device)
    if world > 1 and device.type == "cuda":
        raise HyflashError("multi-process training runs on CPUs (gloo); use one process per machine with a GPU")
    notes = []
    for c in cfgs:  # the precision this machine trains in, recorded as such in each run's train_config.json
        c.bf16, note = autocast_bf16(c.bf16, device)
        notes += [note] if note and note not in notes else []
    for note in notes if main else []:
        print(f"hyflash: {note}", file=sys.stderr)
    if target is None:
        from hyflash.target import Target

        target = Target.load(cfg.target, dtype="bf16", feature_layers=cfg.drafter.target_layers, device=device)
    store = store if store is not None else open_store(cfg.data, target, cfg.online_topk)
    check_store(store, target, cfg)
    train_idx, val_idx = split_store(store, cfg)
    order_idx = weighted_indices(store, train_idx, cfg.kind_weights)
    vocabularies = {}  # draft vocabulary size -> the training labels' most frequent tokens
    runs = [_Run(c, d, target, store, train_idx, device, main, world, vocabularies) for c, d in zip(cfgs, out_dirs)]
    step, position, elapsed_before = 0, 0, 0.0
    if any(r.found for r in runs):  # resume exactly: weights, optimiser, schedule, RNG, place in the data order
        common = set.intersection(*(set(r.found) for r in runs))
        if not common:
            raise HyflashError("these runs have no checkpoint of a common step to resume from: "
                               + "; ".join(f"{r.out_dir}: steps {sorted(r.found) or 'none'}" for r in runs)
                               + ". Resume them one at a time to the same step (--stop-at), then together")
        step = max(common)
        ckpt = [r.resume(step) for r in runs][0]
        set_rng_states(ckpt["rng"])
        position, elapsed_before = ckpt["data_position"], ckpt["elapsed"]
    for r in runs:
        r.start_log(step, len(train_idx), len(val_idx), world)

    # ---- the loop
    from tqdm import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=cfg.steps, initial=step, disable=not main, dynamic_ncols=True)
    S = cfg.drafter.block_size
    while step < cfg.steps:
        t_step = time.perf_counter()
        rng = np.random.default_rng([cfg.seed, step, rank])  # crops and anchors: a function of (seed, step, rank)
        ids = sequence_ids(order_idx, cfg.seed, position + rank * cfg.batch_seqs, cfg.batch_seqs)
        b = on_device(make_batch(store, ids, cfg, rng, with_topk=any(c.kl_weight > 0 for c in cfgs)), device)
        t_data = _clock(device) - t_step  # the batch: the store (an online target's forward too) and the copy
        step, position = step + 1, position + world * cfg.batch_seqs
        recs = []
        for r in runs:
            t_run = _clock(device)
            stats, grad_norm, lr = r.train_step(b, world)
            acc = (stats[1:1 + S] / stats[1 + S:1 + 2 * S].clamp_min(1)).tolist()
            step_s = t_data + _clock(device) - t_run  # what the step costs this drafter: the batch and its own work
            recs.append({"step": step, "loss": round(stats[0].item(), 5), "acc": [round(a, 4) for a in acc],
                         "lr": lr, "grad_norm": round(grad_norm, 4),
                         "anchors_per_s": round(stats[-1].item() / step_s, 1), "data_s": round(t_data, 4),
                         "step_s": round(step_s, 4)} | ({"drafters_sharing_batch": len(runs)} if len(runs) > 1 else {}))
        due = [k for k, r in enumerate(runs) if step % r.cfg.eval_every == 0 or step == cfg.steps]
        if main and due and len(val_idx):
            for k, res in zip(due, evaluate_many([runs[k].drafter for k in due], store, val_idx, cfg)):
                recs[k].update(res)
            if isinstance(store, MixedStore):  # each part's held-out τ̂ on its own (part 0: the earlier stages')
                parts = [evaluate_many([runs[k].drafter for k in due], store, v, cfg) if len(v) else None
                         for v in part_indices(store, val_idx)]
                for j, k in enumerate(due):
                    recs[k]["val_tau_parts"] = [p[j]["val_tau"] if p else None for p in parts]
        if main:
            elapsed = elapsed_before + time.perf_counter() - t0  # this process's time (shared by its drafters)
            for r, rec in zip(runs, recs):
                rec["elapsed"] = round(elapsed, 2)
                r.log.write(json.dumps(rec) + "\n")
                r.log.flush()
            bar.set_postfix_str(" | ".join(  # several drafters: each one's loss (and τ̂) only
                (f"{r.name} loss {rec['loss']:.3f}" if len(runs) > 1 else f"loss {rec['loss']:.3f} acc "
                 + " ".join(f"{a * 100:.0f}" for a in rec["acc"]))
                + (f" val τ̂ {rec['val_tau']:.2f}" if "val_tau" in rec else "") for r, rec in zip(runs, recs)))
            bar.update(1)
            if step % cfg.ckpt_every == 0 or step == cfg.steps or step == stop_at:
                state = {"step": step, "data_position": position, "elapsed": elapsed, "rng": rng_states()}
                for r in runs:  # every run's new checkpoint is on disk before any run drops an old one
                    r.checkpoint(state)
                for r in runs:
                    prune_checkpoints(r.out_dir, r.cfg.keep_checkpoints)
        if stop_at is not None and step >= stop_at:
            break
    bar.close()

    # ---- export
    if main:
        for r in runs:
            r.log.close()
            if step >= cfg.steps:
                save_pretrained(r.drafter, r.out_dir / "final", dtype=torch.bfloat16)
                plot_losses(r.out_dir)
    if dist.is_initialized():
        dist.barrier()
    return [r.drafter for r in runs]


def export_latest(out_dir, target=None) -> Path:
    """Write ``out_dir/final`` from the run's latest checkpoint: the drafter of a run stopped before its last step
    (e.g. at the end of a time budget), usable by ``hyflash generate`` as it is. Returns the export directory."""
    out_dir = Path(out_dir)
    found = checkpoints(out_dir)
    if not found:
        raise HyflashError(f"{out_dir} holds no checkpoints to export")
    ckpt = torch.load(found[-1], map_location="cpu", weights_only=False)  # our own file (holds RNG states)
    cfg = TrainConfig.from_dict(ckpt["config"])
    if target is None:
        from hyflash.target import Target

        target = Target.load(cfg.target, dtype="bf16", feature_layers=cfg.drafter.target_layers)
    target.feature_layers = list(cfg.drafter.target_layers)
    dcfg = DrafterConfig.from_dict({**cfg.drafter.to_dict(), "draft_vocab_size": cfg.draft_vocab})
    drafter = new_drafter(dcfg, target, dtype=torch.float32)
    drafter.load_state_dict(ckpt["model"])
    save_pretrained(drafter, out_dir / "final", dtype=torch.bfloat16)
    if (out_dir / LOG_NAME).exists():
        plot_losses(out_dir)
    return out_dir / "final"


def plot_losses(out_dir) -> Path | None:
    """out_dir/loss.png: training loss per step (and held-out τ̂) from log.jsonl."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("hyflash: matplotlib is not installed (pip install 'hyflash[plot]'); skipping loss.png", file=sys.stderr)
        return None
    out_dir = Path(out_dir)
    recs = [json.loads(line) for line in (out_dir / LOG_NAME).read_text().splitlines() if line]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in recs], [r["loss"] for r in recs], lw=0.8, label="train loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    val = [r for r in recs if "val_tau" in r]
    if val:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in val], [r["val_tau"] for r in val], "o-", color="C1", label="held-out τ̂")
        ax2.set_ylabel("held-out τ̂ (acceptance-length proxy)")
        ax.legend(ax.get_lines() + ax2.get_lines(), ["train loss", "held-out τ̂"], loc="center right")
    ax.set_title(out_dir.name)
    fig.tight_layout()
    path = out_dir / "loss.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------------- CLI
@click.command("train")
@click.option("--recipe", "--config", "recipes", multiple=True,
              help="Recipe name (e.g. smollm2-hyflash) or path to a TrainConfig JSON. Given more than once: the "
                   "drafters train side by side in one process on the same batches (one target forward per batch "
                   "with an online store), each into --out/<recipe name>.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Output directory (with several recipes: the directory that holds one per recipe).")
@click.option("--steps", type=int, default=None, help="Override the recipe's number of steps.")
@click.option("--data", multiple=True,
              help="Override the recipe's data: a feature store directory, or a sequences JSONL (features computed "
                   "online by the target: for GPUs). Given more than once: a mixture of them.")
@click.option("--init-from", multiple=True, type=click.Path(file_okay=False),
              help="Override the recipe's init_from: a saved drafter to continue training from (with several "
                   "recipes: one per recipe, in their order).")
@click.option("--threads", type=int, default=None, help="Override the recipe's torch CPU threads per process.")
@click.option("--device", default=None,
              help="Override the recipe's device: cpu, cuda, cuda:N or auto (a GPU if there is one).")
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE",
              help="Override any recipe field, e.g. --set batch_seqs=32 --set lr=3e-4 (VALUE is read as JSON, else "
                   "as a string).")
@click.option("--resume/--no-resume", default=True, show_default=True,
              help="Continue from the latest checkpoint in --out (--no-resume refuses a directory that has one).")
@click.option("--stop-at", type=int, default=None,
              help="Stop after this step as if killed (a checkpoint is written there; rerun without it to go on).")
@click.option("--export", "export_only", is_flag=True,
              help="Train nothing: write --out/final from the run's latest checkpoint (a run stopped early); for a "
                   "directory of runs trained together, each run's.")
def train_command(recipes, out, steps, data, init_from, threads, device, overrides, resume, stop_at, export_only):
    """Train a drafter from a recipe (or several side by side); resumable; several processes under torchrun."""
    if export_only:
        runs = [Path(out)] if checkpoints(Path(out)) or not Path(out).is_dir() else \
            sorted(d for d in Path(out).iterdir() if d.is_dir() and checkpoints(d))
        for run in runs or [Path(out)]:
            click.echo(f"exported {export_latest(run)}")
        return
    if not recipes:
        raise click.UsageError("--recipe is required (except with --export)")
    names = [Path(r).stem for r in recipes]
    if len(set(names)) < len(names):
        raise click.UsageError(f"a recipe is named twice: {list(recipes)}")
    if len(init_from) not in (0, len(recipes)):
        raise click.UsageError(f"--init-from: give one per recipe ({len(recipes)}), not {len(init_from)}")
    if stop_at is not None and stop_at < 1:
        raise click.UsageError("--stop-at must be >= 1")
    cfgs = []
    for k, recipe in enumerate(recipes):
        cfg = apply_overrides(load_recipe(recipe), overrides)
        if steps is not None:
            cfg.steps = steps
        if data:
            cfg.data = data[0] if len(data) == 1 else list(data)
        if init_from:
            cfg.init_from = init_from[k]
        if threads is not None:
            cfg.threads = threads
        if device is not None:
            cfg.device = device
        cfgs.append(cfg)
    out_dirs = [Path(out)] if len(cfgs) == 1 else [Path(out) / name for name in names]
    train_many(cfgs, out_dirs, resume=resume, stop_at=stop_at)


if __name__ == "__main__":
    try:
        train_command.main(standalone_mode=False)
    except HyflashError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
