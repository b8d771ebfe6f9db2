"""Recall sequences: training text in which passages from earlier in the same sequence come back verbatim.

The drafter's two branches see the committed history differently: local attention sees the last `window`
features, the recurrent memory everything before. Ordinary text rarely asks a drafter to carry an exact passage
across hundreds of tokens, so neither branch learns to: a drafter trained on it alone drafts a quoted passage no
better than any other text (reports/smollm2-long, the copying probes). A recall sequence is one of the training
sequences with passages of its own copied forward, so that learning to draft it means learning to copy:

    base text ... [P1] ... base text ... [copy of P1] ... base text ... [P2] ... [copy of P2] ...

- *near* copies (distance ≤ `near_max`, inside the drafter's window: the slots can read the source through attention
  to the committed features) and *far* copies (distance ≥ `far_min`, past the window: only the memory can carry the
  source), half and half;
- the span of every copy is supervised, and nothing else, so the anchors sit where copying is asked for;
- labels stay the target's own greedy tokens (``hyflash.data.features`` computes them), so a block is learned only
  where the target itself continues the copy (``follow_target_path``).

The base sequences are training sequences (``hyflash.data.sequences``); the ones a recipe holds out for validation
are skipped, so held-out text never enters training through a copy. The idea of training recall on synthetic
copies is the associative-recall literature's (Zoology, Arora et al. 2023); the mixture here is ours.

    python -m hyflash.data.recall --sequences /work/data_cache/full/sequences.jsonl \
        --out /work/data_cache/recall/sequences.jsonl --count 256 --recipe smollm2-hyflash
    python -m hyflash.data.features --sequences /work/data_cache/recall/sequences.jsonl \
        --out /work/data_cache/recall/features
    python -m hyflash.data.recall --check-features /work/data_cache/recall/features   # does the target copy?
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from hyflash import HyflashError
from hyflash.data.sources import sha256_file
from hyflash.data.split import write_json


def recall_sequence(ids: list[int], rng: np.random.Generator, max_len: int = 2048, copy_len: tuple = (32, 96),
                    gap: tuple = (96, 384), near_max: int = 224, far_min: int = 320,
                    far_fraction: float = 0.5, lead: tuple | None = None) -> tuple[list[int], list]:
    """(ids, spans): ``ids`` (a base sequence) with passages of what came before copied forward.

    The output starts with a stretch of base text (its length uniform in ``lead``, by default ``far_min`` to
    ``2 * far_min``: shorter for short training lengths, so that a copy still fits in ``max_len``); then, while room is left: a copy of L tokens (L uniform in
    ``copy_len``) of the output so far, from ``d`` tokens back (near: L < d ≤ near_max; far: d ≥ far_min, as far
    back as the output reaches), followed by the next ``gap`` tokens of base text. A copy's span is its own
    positions. A copy is far with probability ``far_fraction``; far copies fall back to near ones until the output
    is long enough, except when ``far_fraction`` is 1 (far copies only), where base text comes instead."""
    if not 0.0 <= far_fraction <= 1.0:
        raise HyflashError(f"far_fraction must lie in [0, 1], got {far_fraction}")
    lo, hi = copy_len
    lead_lo, lead_hi = lead if lead is not None else (far_min, 2 * far_min - 1)
    out = list(ids[:int(rng.integers(lead_lo, lead_hi + 1))])
    pos, spans = len(out), []
    while pos < len(ids):
        L = int(rng.integers(lo, hi + 1))
        if len(out) + L > max_len:
            break
        far = rng.random() < far_fraction
        if far and len(out) >= far_min + L:
            d = int(rng.integers(far_min + L, len(out) + 1))  # the whole source lies past the window
        elif far_fraction < 1.0 and len(out) > L:
            d = int(rng.integers(L + 1, min(near_max, len(out)) + 1))
        else:
            d = 0  # far copies only and none fits yet, or a short lead: base text instead
        if d:
            src = len(out) - d
            spans.append([len(out), len(out) + L])
            out += out[src:src + L]
        step = int(rng.integers(gap[0], gap[1] + 1))
        out += ids[pos:pos + step]
        pos += step
    return out[:max_len], [[s, min(e, max_len)] for s, e in spans if s < max_len]


def held_out_ids(sequences: list[dict], recipe: str | None) -> set[str]:
    """Ids of the sequences the recipe's split holds out (the same rule ``hyflash.train`` applies)."""
    if recipe is None:
        return set()
    from hyflash.train import load_recipe, split_indices

    _, val = split_indices(len(sequences), load_recipe(recipe))
    return {sequences[int(i)]["id"] for i in val}


def build_recall(sequences_path, out_path, count: int = 256, min_len: int = 1536, recipe: str | None = None,
                 seed: int = 0, chunk: int | None = None, **kw) -> dict:
    """Write ``count`` recall sequences built from a seeded sample of the base sequences of at least ``min_len``
    tokens (held-out ones skipped). With ``chunk``, each base sequence is first cut into pieces of ``chunk`` tokens
    (the remainder dropped), so that a short training length does not use a few hundred tokens of each long
    document and waste the rest. Returns the meta (also written next to the output)."""
    with open(sequences_path, encoding="utf-8") as f:
        base = [json.loads(line) for line in f if line.strip()]
    skip = held_out_ids(base, recipe)
    base = [s for s in base if s["id"] not in skip]
    if chunk:
        base = [{"id": f"{s['id']}@{k}", "ids": s["ids"][k:k + chunk]} for s in base
                for k in range(0, len(s["ids"]) - chunk + 1, chunk)]
    pool = [s for s in base if len(s["ids"]) >= min_len]
    if not pool:
        raise HyflashError(f"no sequence of {min_len}+ tokens in {sequences_path}")
    rng = np.random.default_rng([seed, 11])
    picks = rng.choice(len(pool), size=min(count, len(pool)), replace=False)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    n_tokens = n_copies = n_copied = 0
    with open(out.with_suffix(".jsonl.tmp"), "w", encoding="utf-8") as f:
        for k, i in enumerate(picks):
            s = pool[int(i)]
            ids, spans = recall_sequence(s["ids"], np.random.default_rng([seed, 12, k]), **kw)
            f.write(json.dumps({"id": f"recall/{s['id']}", "kind": "recall", "ids": ids, "spans": spans}) + "\n")
            n_tokens, n_copies = n_tokens + len(ids), n_copies + len(spans)
            n_copied += sum(e - s_ for s_, e in spans)
    out.with_suffix(".jsonl.tmp").replace(out)
    meta = {"inputs": {"sequences": str(sequences_path), "sha256": sha256_file(Path(sequences_path)),
                       "count": count, "min_len": min_len, "recipe": recipe, "seed": seed,
                       **({"chunk": chunk} if chunk else {}), **kw},
            "sequences": len(picks), "tokens": n_tokens, "copies": n_copies, "copied_tokens": n_copied,
            "held_out_skipped": len(skip)}
    write_json(out.with_suffix(".meta.json"), meta)
    return meta


def copy_follow_rate(store, by_offset: int = 8) -> tuple[float, int, list[float]]:
    """How often the target's greedy token continues a copy: over every copy position t but a copy's last,
    labels[t] == ids[t + 1]. Returns (rate, positions, rate by offset into the copy, the last bucket pooling
    offsets ≥ by_offset − 1): where it is low, ``follow_target_path`` masks the block, so nothing is learned there."""
    hits, counts = np.zeros(by_offset), np.zeros(by_offset)
    for i in range(len(store)):
        item = store[i]
        ids, labels = np.asarray(item["input_ids"]), np.asarray(item["labels"])
        for s, e in item["spans"]:
            t = np.arange(s, min(e, len(ids)) - 1)
            ok = labels[t] == ids[t + 1]
            off = np.minimum(t - s, by_offset - 1)
            np.add.at(hits, off, ok)
            np.add.at(counts, off, 1)
    return float(hits.sum() / max(counts.sum(), 1)), int(counts.sum()), (hits / np.maximum(counts, 1)).tolist()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyflash.data.recall", description=__doc__.split("\n")[0])
    p.add_argument("--sequences", help="base sequences.jsonl (hyflash.data.sequences)")
    p.add_argument("--out", help="recall sequences.jsonl to write")
    p.add_argument("--count", type=int, default=256)
    p.add_argument("--min-len", type=int, default=1536, help="base sequences shorter than this are not used")
    p.add_argument("--recipe", default=None, help="skip the sequences this recipe holds out for validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--far-fraction", type=float, default=0.5,
                   help="share of copies whose source lies past the window (0: near copies only, 1: far only)")
    p.add_argument("--max-len", type=int, default=2048, help="length of each recall sequence (the training length)")
    p.add_argument("--near-max", type=int, default=224, help="a near copy's source lies at most this far back")
    p.add_argument("--far-min", type=int, default=320,
                   help="a far copy's source ends at least this far back (past the drafter's window)")
    p.add_argument("--copy-len", type=int, nargs=2, default=(32, 96), metavar=("LO", "HI"), help="copy length range")
    p.add_argument("--gap", type=int, nargs=2, default=(96, 384), metavar=("LO", "HI"),
                   help="base text between copies")
    p.add_argument("--lead", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="base text before the first copy (default: far-min to twice it)")
    p.add_argument("--chunk", type=int, default=None,
                   help="cut the base sequences into pieces of this many tokens first (short training lengths)")
    p.add_argument("--check-features", metavar="DIR", default=None,
                   help="build nothing: report how often the target continues the copies of a recall feature store")
    args = p.parse_args(argv)
    if args.check_features:
        from hyflash.data.features import FeatureStore

        rate, n, by_off = copy_follow_rate(FeatureStore(args.check_features))
        print(f"the target's greedy token continues the copy at {rate:.3f} of {n:,} copy positions; by offset into "
              f"the copy (0..6, 7+): {' '.join(f'{r:.2f}' for r in by_off)}")
        return 0
    if not (args.sequences and args.out):
        p.error("--sequences and --out are required (unless --check-features)")
    try:
        kw = dict(far_fraction=args.far_fraction, max_len=args.max_len, near_max=args.near_max, far_min=args.far_min,
                  copy_len=tuple(args.copy_len), gap=tuple(args.gap))
        if args.lead is not None:
            kw["lead"] = tuple(args.lead)
        meta = build_recall(args.sequences, args.out, args.count, args.min_len, args.recipe, args.seed,
                            chunk=args.chunk, **kw)
    except HyflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"recall: {meta['sequences']} sequences, {meta['tokens']:,} tokens, {meta['copies']} copies "
          f"({meta['copied_tokens']:,} copied tokens); {meta['held_out_skipped']} held-out sequences skipped",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
