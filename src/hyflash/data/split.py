"""The train/eval split, decontaminated, as files.

    <out>/raw/<source>.jsonl          records as read (stage 1, one per source, with <source>.meta.json)
    <out>/eval/<suite>.jsonl          evaluation items, in source order
    <out>/train_prompts.jsonl         chat prompts, shuffled (seeded)
    <out>/train_documents.jsonl       long documents, shuffled (seeded)
    <out>/split.json, <out>/SPLIT.md  sources, versions, sha256, counts, decontamination result

Decontamination drops a training record when its normalised words (lowercased, punctuation stripped)
share an n-gram (n = 13) with any evaluation text (turns and reference answers), or contain a shorter
evaluation prompt (`min_verbatim_words` <= words < n) verbatim. A prompt of n words or more that occurs
verbatim shares an n-gram, so the two tests together cover "contains an eval prompt verbatim".
Degenerate n-grams (fewer than `min_distinct_words` distinct words that are not numbers or single
characters, e.g. "1 2 3 ... 13") are not counted: they occur in unrelated texts.

Every stage skips its work when its output exists and matches its inputs' hashes.

    python -m hyflash.data.split --out DIR [--sources sharegpt,mtbench] [--max-per-source N]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import re
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from hyflash import HyflashError
from hyflash.data.sources import NOT_AVAILABLE, SOURCES, Source, fetch, sha256_file

FORMAT_VERSION = 1  # bump when a reader or the decontamination changes what gets written


@dataclass
class SplitConfig:
    seed: int = 0
    ngram: int = 13
    min_verbatim_words: int = 5  # shorter eval prompts ("Rewrite it.") are not matched verbatim
    min_distinct_words: int = 6  # n-grams with fewer distinct informative words ("1 2 3 ...") are ignored
    max_per_source: int | None = None  # seeded sample of at most this many records per source


# --------------------------------------------------------------------------- normalised n-grams

_WORD = re.compile(r"\w+")
_MULT = np.uint64(0x100000001B3)


def normalise(text: str) -> list[str]:
    """Lowercased words with punctuation stripped."""
    return _WORD.findall(text.lower())


@functools.lru_cache(maxsize=1 << 21)
def _word_hash(word: str) -> int:
    return int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "little")


def word_hashes(words: list[str]) -> np.ndarray:
    return np.fromiter(map(_word_hash, words), dtype=np.uint64, count=len(words))  # [n_words]


def ngram_hashes(h: np.ndarray, n: int) -> np.ndarray:
    """64-bit hash of every run of n consecutive words: sum_k h[i+k] * M^(n-1-k) mod 2^64."""
    m = len(h) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    out = h[:m].copy()  # [m]
    for k in range(1, n):
        out = out * _MULT + h[k:k + m]  # uint64 arithmetic wraps
    return out


def informative(words: list[str], h: np.ndarray, n: int, min_distinct: int) -> np.ndarray:
    """Mask over the n-grams of `words`: True where the n-gram has at least `min_distinct` distinct
    informative words (two or more characters, not a number).

    Runs like "6 7 8 ... 18" or "a b a b ..." occur in unrelated texts and would drop them.
    """
    m = len(words) - n + 1
    if m <= 0:
        return np.zeros(0, dtype=bool)
    useful = np.fromiter((len(w) > 1 and not w.isdigit() for w in words), dtype=bool, count=len(words))
    order = np.argsort(h, kind="stable")  # equal words end up adjacent, in text order
    prev = np.full(len(words), -1, dtype=np.int64)  # index of the same word's previous occurrence
    same = h[order[1:]] == h[order[:-1]]
    prev[order[1:][same]] = order[:-1][same]
    start = np.arange(m)
    distinct = np.zeros(m, dtype=np.int64)  # [m]
    for k in range(n):
        distinct += useful[k:k + m] & (prev[k:k + m] < start)
    return distinct >= min_distinct


def eval_texts(item: dict) -> list[str]:
    """The texts of an evaluation item that training must not see: its turns and reference answers."""
    texts = list(item.get("turns") or [])
    for key in ("reference", "answer", "canonical_solution"):
        v = item.get(key)
        texts += [v] if isinstance(v, str) else [x for x in v or [] if isinstance(x, str)]
    return texts


def train_text(record: dict) -> str:
    if "text" in record:
        return record["text"]
    return "\n".join(m["content"] for m in record["messages"])


@dataclass
class EvalIndex:
    """Sorted n-gram hashes of the evaluation items, per n, with the item each came from."""

    ngram: int
    tables: dict[int, tuple[np.ndarray, np.ndarray]]  # n -> (sorted hashes [k], owner index [k])
    ids: list[str]
    unchecked_short: int  # eval prompts under min_verbatim_words words


def build_eval_index(items: list[dict], ngram: int = 13, min_verbatim_words: int = 5,
                     min_distinct_words: int = 6) -> EvalIndex:
    """Index the n-grams of every evaluation text (only informative ones, see `informative`) and the
    whole of every eval prompt of `min_verbatim_words` to n-1 words."""
    parts: dict[int, list[tuple[np.ndarray, int]]] = {}
    short = 0
    for i, item in enumerate(items):
        for text in eval_texts(item):
            words = normalise(text)
            h = word_hashes(words)
            grams = ngram_hashes(h, ngram)[informative(words, h, ngram, min_distinct_words)]
            parts.setdefault(ngram, []).append((grams, i))
        for turn in item.get("turns") or []:
            words = normalise(turn)
            if min_verbatim_words <= len(words) < ngram:
                parts.setdefault(len(words), []).append((ngram_hashes(word_hashes(words), len(words)), i))
            elif len(words) < min_verbatim_words:
                short += 1
    tables = {}
    for n, chunks in parts.items():
        hashes = np.concatenate([h for h, _ in chunks]) if chunks else np.empty(0, np.uint64)
        owners = np.concatenate([np.full(len(h), i, dtype=np.int64) for h, i in chunks])
        order = np.argsort(hashes, kind="stable")
        tables[n] = (hashes[order], owners[order])
    return EvalIndex(ngram, tables, [it["id"] for it in items], short)


def find_contamination(text: str, index: EvalIndex) -> tuple[str, str] | None:
    """(how, eval id) of the first evaluation item `text` overlaps, or None.

    how: "verbatim" (contains a short eval prompt) or "ngram" (shares an index.ngram-gram).
    """
    h = word_hashes(normalise(text))
    for n in sorted(index.tables):
        table, owners = index.tables[n]
        if len(h) < n or len(table) == 0:
            continue
        grams = ngram_hashes(h, n)
        pos = np.minimum(np.searchsorted(table, grams), len(table) - 1)
        hit = table[pos] == grams
        if hit.any():
            how = "ngram" if n == index.ngram else "verbatim"
            return how, index.ids[owners[pos[np.argmax(hit)]]]
    return None


def decontaminate(records: list[dict], index: EvalIndex) -> tuple[list[dict], list[dict]]:
    """Split training records into (kept, dropped); each dropped entry says why and against which item."""
    kept, dropped = [], []
    for r in records:
        found = find_contamination(train_text(r), index)
        if found is None:
            kept.append(r)
        else:
            dropped.append({"id": r["id"], "source": r["source"], "by": found[0], "eval_id": found[1]})
    return kept, dropped


# --------------------------------------------------------------------------- files


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, records: list[dict]) -> str:
    """Write atomically; return the file's sha256."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return sha256_file(path)


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def load_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def approx_tokens(records: list[dict]) -> int:
    """len(text) / 4 summed, a rough count."""
    return sum(len(train_text(r)) if "turns" not in r else sum(map(len, r["turns"])) for r in records) // 4


def extract_source(source: Source, out: Path, cfg: SplitConfig, cache=None) -> dict:
    """Stage 1: read one source into <out>/raw/<name>.jsonl; skip when the archive hash is unchanged."""
    raw = out / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    path, archive_sha = fetch(source, cache)
    data, meta_path = raw / f"{source.name}.jsonl", raw / f"{source.name}.meta.json"
    key = {"source": source.name, "package": source.package, "version": source.version,
           "archive_sha256": archive_sha, "seed": cfg.seed, "max_per_source": cfg.max_per_source,
           "format": FORMAT_VERSION}
    meta = load_json(meta_path)
    # Local folders (the stdlib) have no archive hash: they are re-read and compared by content.
    if (archive_sha and meta and meta.get("key") == key and data.exists()
            and sha256_file(data) == meta.get("sha256")):
        return meta
    records = list(source.reader(path))
    read = len(records)
    if cfg.max_per_source is not None and read > cfg.max_per_source:
        rng = random.Random(f"{cfg.seed}/{source.name}")
        records = [records[i] for i in sorted(rng.sample(range(read), cfg.max_per_source))]
    if not records:
        raise HyflashError(f"source {source.name} gave no records from {path}")
    meta = {"key": key, "kind": source.kind, "form": source.form, "license": source.license,
            "note": source.note, "read": read, "count": len(records),
            "approx_tokens": approx_tokens(records), "sha256": write_jsonl(data, records)}
    write_json(meta_path, meta)
    return meta


def select_sources(sources) -> list[Source]:
    if sources is None:
        return list(SOURCES.values())
    out = []
    for s in ([x.strip() for x in sources.split(",")] if isinstance(sources, str) else sources):
        if isinstance(s, Source):
            out.append(s)
        elif s in SOURCES:
            out.append(SOURCES[s])
        else:
            raise HyflashError(f"unknown source {s!r}; known: {', '.join(SOURCES)}")
    return out


def prepare_split(out_dir, sources=None, max_per_source=None, cache=None,
                  config: SplitConfig | None = None) -> dict:
    """Build the decontaminated split under `out_dir`; return the summary also written to split.json.

    sources: names from SOURCES (or Source objects), default all; the training records are
    decontaminated against the evaluation sources among them.
    """
    cfg = config or SplitConfig()
    if max_per_source is not None:
        cfg = SplitConfig(**{**asdict(cfg), "max_per_source": max_per_source})
    out = Path(out_dir)
    chosen = select_sources(sources)
    names = [s.name for s in chosen]
    if len(set(names)) != len(names):
        raise HyflashError(f"a source is named twice: {names}")
    metas = {s.name: extract_source(s, out, cfg, cache) for s in chosen}

    inputs = {"config": asdict(cfg), "format": FORMAT_VERSION,
              "raw_sha256": {n: m["sha256"] for n, m in metas.items()}}
    summary_path = out / "split.json"
    old = load_json(summary_path)
    if old and old.get("inputs") == inputs and all(
            (out / rel).exists() and sha256_file(out / rel) == sha for rel, sha in old["outputs"].items()):
        return old

    evals = {s.name: read_jsonl(out / "raw" / f"{s.name}.jsonl") for s in chosen if s.kind == "eval"}
    (out / "eval").mkdir(parents=True, exist_ok=True)
    outputs = {}
    for name in evals:
        rel = f"eval/{name}.jsonl"
        shutil.copyfile(out / "raw" / f"{name}.jsonl", out / rel)
        outputs[rel] = metas[name]["sha256"]

    index = build_eval_index([it for items in evals.values() for it in items], cfg.ngram,
                             cfg.min_verbatim_words, cfg.min_distinct_words)
    train: dict[str, list[dict]] = {"prompts": [], "documents": []}
    per_source, dropped_all = {}, []
    for s in chosen:
        if s.kind != "train":
            continue
        kept, dropped = decontaminate(read_jsonl(out / "raw" / f"{s.name}.jsonl"), index)
        train[s.form].extend(kept)
        dropped_all += dropped
        per_source[s.name] = {"kept": len(kept), "dropped": len(dropped),
                              "dropped_ngram": sum(d["by"] == "ngram" for d in dropped),
                              "dropped_verbatim": sum(d["by"] == "verbatim" for d in dropped),
                              "kept_approx_tokens": approx_tokens(kept)}
    for form, records in train.items():
        random.Random(f"{cfg.seed}/train_{form}").shuffle(records)
        outputs[f"train_{form}.jsonl"] = write_jsonl(out / f"train_{form}.jsonl", records)

    summary = {
        "inputs": inputs,
        "outputs": outputs,
        "sources": {n: {"kind": s.kind, "form": s.form, "package": s.package, "version": s.version,
                        "sha256": metas[n]["key"]["archive_sha256"] or None, "license": s.license,
                        "note": s.note, "read": metas[n]["read"], "count": metas[n]["count"],
                        "approx_tokens": metas[n]["approx_tokens"], **per_source.get(n, {})}
                    for n, s in zip(names, chosen)},
        "train": {form: {"count": len(r), "approx_tokens": approx_tokens(r)} for form, r in train.items()},
        "eval": {n: len(items) for n, items in evals.items()},
        "decontamination": {"ngram": cfg.ngram, "min_verbatim_words": cfg.min_verbatim_words,
                            "min_distinct_words": cfg.min_distinct_words,
                            "eval_prompts_too_short_for_verbatim": index.unchecked_short,
                            "dropped": dropped_all},
        "not_available": NOT_AVAILABLE,
    }
    (out / "SPLIT.md").write_text(split_markdown(summary), encoding="utf-8")
    write_json(summary_path, summary)
    return summary


def split_markdown(summary: dict) -> str:
    """SPLIT.md: what trained, what evaluates, and what decontamination removed."""
    d = summary["decontamination"]
    lines = ["# Train/eval split", "",
             "Made by `python -m hyflash.data.split` (`hyflash.data.split.prepare_split`). "
             f"Seed {summary['inputs']['config']['seed']}, max per source "
             f"{summary['inputs']['config']['max_per_source'] or 'none'}. Tokens are approximate (characters / 4).", "",
             "| source | kind | package==version | sha256 | license | read | kept | dropped (13-gram / verbatim) | ~tokens kept |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n, s in summary["sources"].items():
        pkg = f"{s['package']}=={s['version']}" if s["package"] else f"local (Python {s['version']})"
        if s["kind"] == "train":
            kept, drop = s["kept"], f"{s['dropped']} ({s['dropped_ngram']} / {s['dropped_verbatim']})"
            tok = s["kept_approx_tokens"]
        else:
            kept, drop, tok = s["count"], "-", s["approx_tokens"]
        lines.append(f"| {n} | {s['kind']} | {pkg} | `{s['sha256'] or '-'}` | {s['license']} | {s['read']} "
                     f"| {kept} | {drop} | {tok:,} |")
    lines += ["", "Training files: " + ", ".join(
        f"`train_{f}.jsonl` {v['count']} records, ~{v['approx_tokens']:,} tokens" for f, v in summary["train"].items()),
        "Evaluation files: " + ", ".join(f"`eval/{n}.jsonl` ({c})" for n, c in summary["eval"].items()), "",
        "## Decontamination", "",
        f"A training record is dropped when its normalised words share a {d['ngram']}-gram with any "
        "evaluation turn or reference answer, or contain an evaluation prompt of "
        f"{d['min_verbatim_words']}-{d['ngram'] - 1} words verbatim; {d['ngram']}-grams with fewer than "
        f"{d['min_distinct_words']} distinct words that are not numbers or single characters do not count. "
        f"{d['eval_prompts_too_short_for_verbatim']} evaluation turns are under "
        f"{d['min_verbatim_words']} words and were not matched verbatim. "
        f"{len(d['dropped'])} records dropped (all listed in split.json).", ""]
    for dr in d["dropped"][:20]:
        lines.append(f"- `{dr['id']}` ({dr['by']}, {dr['eval_id']})")
    if len(d["dropped"]) > 20:
        lines.append(f"- ... and {len(d['dropped']) - 20} more")
    lines += ["", "## Notes", ""]
    lines += [f"- {n}: {s['note']}" for n, s in summary["sources"].items() if s["note"]]
    lines += [f"- not available: {k}: {v}" for k, v in summary["not_available"].items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyflash.data.split", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--sources", default=None, help=f"comma-separated subset of: {','.join(SOURCES)}")
    p.add_argument("--max-per-source", type=int, default=None)
    p.add_argument("--cache", default=None, help="download cache (default $HYFLASH_DATA or ~/.cache/hyflash/data)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        summary = prepare_split(args.out, args.sources, args.max_per_source, args.cache,
                                SplitConfig(seed=args.seed))
    except HyflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for n, s in summary["sources"].items():
        extra = (f", kept {s['kept']} (~{s['kept_approx_tokens']:,} tokens), dropped {s['dropped']}"
                 if s["kind"] == "train" else "")
        print(f"{s['kind']:5s} {n:13s} {s['count']:7d} records ~{s['approx_tokens']:>11,} tokens{extra}")
    for form, v in summary["train"].items():
        print(f"train_{form}.jsonl: {v['count']} records, ~{v['approx_tokens']:,} tokens")
    print(f"wrote {Path(args.out) / 'SPLIT.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
