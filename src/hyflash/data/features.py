"""Stage 4: target features, the target's greedy labels and its top-k logits for every training token.

    <out>/features.json            the inputs (sequences hash, target, layers, dtype, top-k) and finished shards
    <out>/feats-00000.npy          [n_tokens, len(feature_layers) * hidden] outputs of the feature layers,
                                   concatenated; bf16 stored as its uint16 bit pattern (other dtypes as is)
    <out>/labels-00000.npy         [n_tokens] int32: label[t] = argmax logits[t], the target's next token after t
    <out>/topk_vals-00000.npy      [n_tokens, topk] fp16 logits, largest first (for distillation)
    <out>/topk_ids-00000.npy       [n_tokens, topk] int32
    <out>/index-00000.json         per sequence: id, kind, offset, length, ids, spans (written last)

Each sequence gets one `Target.forward` from an empty cache, so its features and labels are exactly what
the target computes at inference, in one precision (labels from the same bf16 pass as the features).
Features are stored raw: layer outputs carry huge outliers (RMS ~1000 at position 0); the drafter normalises.
Sequences are grouped in file order into shards of about `shard_tokens` tokens; a shard's arrays are written
under temporary names and renamed, then its index is written, so a rerun skips finished shards.
`FeatureStore` reads the shards back through memory maps.

    python -m hyflash.data.features --sequences /work/data_cache/sequences.jsonl --out /work/data_cache/features
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from hyflash import HyflashError
from hyflash.data.regenerate import load_target
from hyflash.data.sources import sha256_file
from hyflash.data.split import load_json, write_json
from hyflash.packed import pack_linears, unpack_linears
from hyflash.target import Target

FORMAT_VERSION = 1
ARRAYS = ("feats", "labels", "topk_vals", "topk_ids")
# how each feature dtype is stored: numpy has no bfloat16, so its bits go in uint16
STORED = {torch.bfloat16: np.uint16, torch.float16: np.float16, torch.float32: np.float32,
          torch.float64: np.float64}


def bytes_per_token(feature_dim: int, feature_dtype: torch.dtype, topk: int) -> int:
    """Disk bytes per token: features + int32 label + top-k (fp16 value, int32 id); the index adds ~8 more."""
    return feature_dim * np.dtype(STORED[feature_dtype]).itemsize + 4 + topk * (2 + 4)


def plan_shards(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Consecutive sequence indices, a new shard whenever the next sequence would pass `shard_tokens`."""
    shards, current, used = [], [], 0
    for i, n in enumerate(lengths):
        if current and used + n > shard_tokens:
            shards.append(current)
            current, used = [], 0
        current.append(i)
        used += n
    if current:
        shards.append(current)
    return shards


def shard_path(out: Path, kind: str, index: int) -> Path:
    return out / (f"index-{index:05d}.json" if kind == "index" else f"{kind}-{index:05d}.npy")


@torch.inference_mode()
def sequence_outputs(target: Target, ids: list[int], topk: int):
    """(features [T, F] model dtype, labels [T] int32, top-k values [T, k] fp16, top-k ids [T, k] int32)."""
    out = target.sequence_forward(torch.tensor(ids, dtype=torch.long), features=True)
    logits = out.logits  # [T, vocab] fp32 copy of the model-dtype logits
    vals, top = logits.topk(topk, dim=-1)  # [T, k], sorted: top[:, 0] is the argmax
    labels = logits.argmax(dim=-1)  # first index on ties, as greedy decoding picks
    return out.features, labels.to(torch.int32), vals.to(torch.float16), top.to(torch.int32)


def as_stored(features: torch.Tensor) -> np.ndarray:
    if features.dtype == torch.bfloat16:
        return features.view(torch.int16).numpy().view(np.uint16)
    return features.numpy()


def pack_where_bf16_is_slow(tgt: Target) -> bool:
    """On a CPU without bf16 dot products torch's bf16 matmul converts every operand (Gemma 3 270M on a 2-core AVX2
    EPYC: 14.8 tokens/s, against 102.7 in fp32). There a bf16 target's matmuls are routed through
    ``PackedLinear``, which multiplies such rows as fp32 sums of the bf16 values, rounded once: features and labels
    still come from one bf16 pass. Returns whether it did (``unpack_linears`` undoes it)."""
    from hyflash.kernels import cpu_has_fast_bf16

    if tgt.dtype != torch.bfloat16 or tgt.device.type != "cpu" or cpu_has_fast_bf16():
        return False
    if not pack_linears(tgt.model):
        return False
    print("features: this CPU has no bf16 dot-product instructions: the bf16 matmuls run as fp32 sums of the bf16 "
          "values (torch's own bf16 matmul is ~5x slower here)", file=sys.stderr)
    return True


def extract_features(sequences_path, out_dir, target: str | Target = "smollm2-135m", dtype: str = "bf16",
                     shard_tokens: int = 262144, topk: int = 32, limit: int | None = None) -> dict:
    """Run the target over every sequence of `sequences_path` and store features, labels and top-k logits.

    limit: only the first N sequences. Refuses to start when the disk lacks the estimated size + 10%.
    Returns the manifest (also written to <out>/features.json).
    """
    tgt = load_target(target, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(sequences_path, encoding="utf-8") as f:
        sequences = [json.loads(line) for line in f if line.strip()][:limit]
    for s in sequences:
        if len(s["ids"]) > tgt.max_context:
            raise HyflashError(f"sequence {s['id']} has {len(s['ids'])} tokens, over the target's "
                               f"{tgt.max_context}")
    feature_dim = len(tgt.feature_layers) * tgt.hidden_size
    topk = min(topk, tgt.vocab_size)
    config = {"format": FORMAT_VERSION, "sequences_sha256": sha256_file(Path(sequences_path)), "target": tgt.name,
              "fingerprint": tgt.fingerprint(), "dtype": str(tgt.dtype).removeprefix("torch."),
              "feature_layers": tgt.feature_layers, "hidden_size": tgt.hidden_size, "feature_dim": feature_dim,
              "topk": topk, "shard_tokens": shard_tokens}
    manifest_path = out / "features.json"
    manifest = load_json(manifest_path) or {"config": config, "shards": {}}
    if manifest["config"] != config:
        changed = {k: (manifest["config"].get(k), v) for k, v in config.items() if manifest["config"].get(k) != v}
        raise HyflashError(f"{out} holds features made with other settings {changed}; use another --out")
    manifest["sequences"] = str(sequences_path)

    plan = plan_shards([len(s["ids"]) for s in sequences], shard_tokens)
    todo = []
    for k, members in enumerate(plan):
        index = load_json(shard_path(out, "index", k))
        n_tokens = sum(len(sequences[i]["ids"]) for i in members)
        done = (index and index.get("n_tokens") == n_tokens and len(index["sequences"]) == len(members)
                and all(shard_path(out, a, k).exists() for a in ARRAYS))
        if not done:
            todo.append((k, members, n_tokens))

    per_token = bytes_per_token(feature_dim, tgt.dtype, topk)
    total = sum(len(s["ids"]) for s in sequences)
    to_write = sum(n for _, _, n in todo)
    need, free = to_write * (per_token + 8), shutil.disk_usage(out).free
    print(f"features: {len(sequences):,} sequences, {total:,} tokens x {per_token:,} B/token = "
          f"{total * per_token / 1e9:.2f} GB; {len(todo)} of {len(plan)} shards to write "
          f"({need / 1e9:.2f} GB, {free / 1e9:.1f} GB free)", file=sys.stderr)
    if free < need * 1.1:
        raise HyflashError(f"not enough disk for the features: need {need / 1e9:.2f} GB + 10%, "
                           f"{free / 1e9:.2f} GB free in {out}")

    stored = STORED[tgt.dtype]
    done_tokens, seconds = 0, 0.0
    packed = to_write and pack_where_bf16_is_slow(tgt)
    bar = tqdm(total=to_write, unit="tok", desc="features", dynamic_ncols=True)
    try:
        for k, members, n_tokens in todo:
            tmp = {a: shard_path(out, a, k).with_suffix(".npy.tmp") for a in ARRAYS}
            arrays = {
                "feats": np.lib.format.open_memmap(tmp["feats"], "w+", stored, (n_tokens, feature_dim)),
                "labels": np.lib.format.open_memmap(tmp["labels"], "w+", np.int32, (n_tokens,)),
                "topk_vals": np.lib.format.open_memmap(tmp["topk_vals"], "w+", np.float16, (n_tokens, topk)),
                "topk_ids": np.lib.format.open_memmap(tmp["topk_ids"], "w+", np.int32, (n_tokens, topk))}
            entries, offset = [], 0
            start = time.perf_counter()
            for i in members:
                s = sequences[i]
                n = len(s["ids"])
                feats, labels, vals, top = sequence_outputs(tgt, s["ids"], topk)
                arrays["feats"][offset:offset + n] = as_stored(feats)
                arrays["labels"][offset:offset + n] = labels.numpy()
                arrays["topk_vals"][offset:offset + n] = vals.numpy()
                arrays["topk_ids"][offset:offset + n] = top.numpy()
                entries.append({"id": s["id"], "kind": s.get("kind"), "offset": offset, "length": n, "ids": s["ids"],
                                "spans": s["spans"]})
                offset += n
                bar.update(n)
                bar.set_postfix(tok_s=f"{(done_tokens + offset) / (seconds + time.perf_counter() - start):.0f}")
            for a in ARRAYS:
                arrays[a].flush()
            del arrays
            for a in ARRAYS:
                os.replace(tmp[a], shard_path(out, a, k))
            shard_seconds = time.perf_counter() - start
            write_json(shard_path(out, "index", k), {"shard": k, "n_tokens": n_tokens, "feature_dim": feature_dim,
                                                     "feature_dtype": config["dtype"], "topk": topk,
                                                     "sequences": entries})
            seconds += shard_seconds
            done_tokens += n_tokens
            manifest["shards"][f"{k:05d}"] = {"sequences": len(members), "tokens": n_tokens,
                                              "seconds": round(shard_seconds, 2)}
            write_json(manifest_path, manifest)
        bar.close()
    finally:
        if packed:
            unpack_linears(tgt.model)
    if todo:
        print(f"features: {done_tokens:,} tokens in {seconds:.1f} s = {done_tokens / max(seconds, 1e-9):.1f} "
              f"tokens/s; {done_tokens * per_token / 1e9:.2f} GB written", file=sys.stderr)
    manifest["bytes_per_token"] = per_token
    manifest["this_run"] = {"tokens": done_tokens, "seconds": round(seconds, 2),
                            "tokens_per_s": round(done_tokens / max(seconds, 1e-9), 1)}
    return manifest


class FeatureStore:
    """The stored features as a sequence dataset, read through memory maps (only the items asked for are read).

    store[i] -> {"id", "kind", "features" [T, F] (bf16 for a bf16 target), "input_ids" [T] int64,
                 "labels" [T] int64, "spans" [[s, e], ...], "topk_vals" [T, k] fp16, "topk_ids" [T, k] int64}
    """

    def __init__(self, path):
        self.path = Path(path)
        self.meta = load_json(self.path / "features.json")
        if self.meta is None:
            raise HyflashError(f"{self.path} holds no features.json; run hyflash.data.features first")
        self.config = self.meta["config"]
        self.feature_dtype = getattr(torch, self.config["dtype"])
        self._items = []  # (shard, offset, length, id, kind, spans)
        self._ids = {}  # shard -> [n_tokens] int32 input ids
        for index_path in sorted(self.path.glob("index-*.json")):
            index = load_json(index_path)
            k = index["shard"]
            if not all(shard_path(self.path, a, k).exists() for a in ARRAYS):
                continue
            ids = np.empty(index["n_tokens"], dtype=np.int32)
            for e in index["sequences"]:
                ids[e["offset"]:e["offset"] + e["length"]] = e["ids"]
                self._items.append((k, e["offset"], e["length"], e["id"], e.get("kind"), e["spans"]))
            self._ids[k] = ids
        self._maps: dict[int, dict[str, np.ndarray]] = {}
        self.total_tokens = sum(n for _, _, n, _, _, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def _arrays(self, k: int) -> dict[str, np.ndarray]:
        if k not in self._maps:
            self._maps[k] = {a: np.load(shard_path(self.path, a, k), mmap_mode="r") for a in ARRAYS}
        return self._maps[k]

    def lengths(self) -> list[int]:
        return [n for _, _, n, _, _, _ in self._items]

    def kinds(self) -> list[str | None]:
        """Each sequence's kind ("chat", "packed", "document") as recorded by hyflash.data.sequences."""
        return [kind for _, _, _, _, kind, _ in self._items]

    def __getitem__(self, i: int) -> dict:
        k, off, n, seq_id, kind, spans = self._items[i]
        arrays = self._arrays(k)
        feats = np.array(arrays["feats"][off:off + n])  # copies just this slice
        if self.feature_dtype == torch.bfloat16:
            feats = torch.from_numpy(feats.view(np.int16)).view(torch.bfloat16)
        else:
            feats = torch.from_numpy(feats)
        return {"id": seq_id, "kind": kind, "features": feats,
                "input_ids": torch.from_numpy(self._ids[k][off:off + n].astype(np.int64)),
                "labels": torch.from_numpy(arrays["labels"][off:off + n].astype(np.int64)),
                "spans": [list(s) for s in spans],
                "topk_vals": torch.from_numpy(np.array(arrays["topk_vals"][off:off + n])),
                "topk_ids": torch.from_numpy(arrays["topk_ids"][off:off + n].astype(np.int64))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyflash.data.features", description=__doc__.split("\n")[0])
    p.add_argument("--sequences", required=True, help="sequences.jsonl (hyflash.data.sequences)")
    p.add_argument("--out", required=True, help="output folder for the feature shards")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--shard-tokens", type=int, default=262144)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--limit", type=int, default=None, help="only the first N sequences")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        extract_features(args.sequences, args.out, args.target, args.dtype, args.shard_tokens, args.topk,
                         args.limit)
    except HyflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
