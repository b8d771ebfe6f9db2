"""Stage 3: tokenised training sequences, each with the spans of tokens the drafter is trained to predict.

    <out>.jsonl        {"id", "kind", "ids": [...], "spans": [[start, end], ...]} in a seeded shuffled order
    <out>.meta.json    the inputs and counts; a rerun with the same inputs does nothing

A span [s, e) marks positions s..e-1 whose tokens are supervised (predicted from what comes before them).
Three kinds of sequence:

- ``chat``: prompt_ids + response_ids of one regenerated answer; the span covers the response.
- ``packed``: several conversations end to end, up to `max_len` tokens, one span per response; the later
  answers sit thousands of tokens after the start, which exercises the drafter's long-range memory.
- ``document``: a long document tokenised without the chat template and cut into chunks of `max_len`
  tokens (each chunk starts with the tokenizer's own prefix, e.g. BOS, when it adds one); the span is
  [1, len): every token but the first.

    python -m hyflash.data.sequences --responses /work/data_cache/responses \
        --documents /work/data_cache/split/train_documents.jsonl --out /work/data_cache/sequences.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

from tqdm import tqdm

from hyflash import HyflashError
from hyflash.data.sources import sha256_file
from hyflash.data.split import load_json, write_json
from hyflash.target import Target, resolve_target_path, transformers_quiet

FORMAT_VERSION = 1


def load_tokenizer(target: str | Target):
    """The target's tokenizer, without loading its weights when given a spec."""
    if isinstance(target, Target):
        return target.tokenizer
    from transformers import AutoTokenizer

    transformers_quiet()
    return AutoTokenizer.from_pretrained(resolve_target_path(target)[1])


def response_shards(responses_dir) -> list[Path]:
    """The finished shards of `hyflash.data.regenerate` (unfinished ones still have a .tmp name)."""
    shards = sorted(Path(responses_dir).glob("responses-*.jsonl"))
    if not shards:
        raise HyflashError(f"no responses-*.jsonl in {responses_dir}; run hyflash.data.regenerate first")
    return shards


def chat_sequence(rec: dict, max_len: int) -> dict | None:
    """prompt + response, cut to `max_len`; the span covers the response tokens."""
    prompt, response = rec["prompt_ids"], rec["response_ids"]
    ids = (prompt + response)[:max_len]
    if len(ids) <= len(prompt):
        return None
    return {"id": rec["id"], "kind": "chat", "ids": ids, "spans": [[len(prompt), len(ids)]]}


def pack_conversations(chats: list[dict], max_len: int, seed: int) -> list[dict]:
    """Conversations (chat sequences) in a seeded order, laid end to end while they fit in `max_len`.

    A pack holds at least two conversations; the spans of each are shifted by its offset in the pack.
    """
    order = list(chats)
    random.Random(f"{seed}/pack").shuffle(order)
    packs, current = [], []

    def flush():
        if len(current) >= 2:
            ids, spans = [], []
            for c in current:
                spans += [[s + len(ids), e + len(ids)] for s, e in c["spans"]]
                ids += c["ids"]
            packs.append({"id": f"packed/{len(packs):05d}", "kind": "packed", "ids": ids, "spans": spans,
                          "parts": [c["id"] for c in current]})
        current.clear()

    used = 0
    for c in order:
        if used + len(c["ids"]) > max_len:
            flush()
            used = 0
        current.append(c)
        used += len(c["ids"])
    flush()
    return packs


def special_prefix(tokenizer) -> list[int]:
    """The ids the tokenizer puts in front of a text on its own (BOS for most base models, none for SmolLM2)."""
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for k in range(len(full) - len(plain) + 1):
        if full[k:k + len(plain)] == plain:
            return full[:k]
    return []


def document_chunks(doc: dict, tokenizer, prefix: list[int], max_len: int, min_len: int) -> list[dict]:
    """A document cut into chunks of `max_len` tokens (prefix included); a last piece under `min_len` is dropped."""
    body = tokenizer.encode(doc["text"], add_special_tokens=False)
    step = max_len - len(prefix)
    chunks = []
    for k, i in enumerate(range(0, len(body), step)):
        ids = prefix + body[i:i + step]
        if len(ids) < min_len:
            break
        chunks.append({"id": f"{doc['id']}#{k}", "kind": "document", "ids": ids,
                       "spans": [[max(1, len(prefix)), len(ids)]]})
    return chunks


def build_sequences(responses_dir, documents_path, out_path, target: str | Target = "smollm2-135m",
                    max_len: int = 2048, doc_tokens: int | None = None, pack: bool = True, min_len: int = 64,
                    seed: int = 0, singles: bool = True) -> dict:
    """Write the chat, packed and document sequences to `out_path` (see the module docstring); return counts.

    doc_tokens: stop taking document chunks (in the split's shuffled document order) at this many tokens;
    0 takes none, None takes all. documents_path may be None for chat only, and responses_dir None for documents
    only (a base-model target, which has no chat template to regenerate answers with). singles=False keeps
    conversations only inside packs (each answer once, in full-length sequences: cheaper to train on than many short
    ones).
    """
    out = Path(out_path)
    if responses_dir is None and not documents_path:
        raise HyflashError("nothing to build: give regenerated responses, documents, or both")
    shards = response_shards(responses_dir) if responses_dir is not None else []
    tokenizer = load_tokenizer(target)
    inputs = {"format": FORMAT_VERSION, "responses": {p.name: sha256_file(p) for p in shards},
              "documents_sha256": sha256_file(Path(documents_path)) if documents_path else None,
              "tokenizer_vocab": len(tokenizer), "max_len": max_len, "doc_tokens": doc_tokens, "pack": pack,
              "min_len": min_len, "seed": seed}
    if not singles:
        inputs["singles"] = False  # recorded only when off, so that older metadata stays valid
    meta_path = out.with_suffix(".meta.json")
    old = load_json(meta_path)
    if old and old.get("inputs") == inputs and out.exists() and sha256_file(out) == old.get("sha256"):
        print(f"sequences: {out} is up to date", file=sys.stderr)
        return old

    chats = []
    for path in shards:
        with open(path, encoding="utf-8") as f:
            chats += [c for line in f if line.strip() and (c := chat_sequence(json.loads(line), max_len))]
    packs = pack_conversations(chats, max_len, seed) if pack else []

    docs, taken = [], 0
    if documents_path and doc_tokens != 0:
        prefix = special_prefix(tokenizer)
        room = (lambda: float("inf")) if doc_tokens is None else (lambda: doc_tokens - taken)
        transformers_quiet()  # long documents exceed the tokenizer's nominal max length: expected
        with open(documents_path, encoding="utf-8") as f, tqdm(desc="tokenise documents", unit="tok",
                                                              total=doc_tokens, dynamic_ncols=True) as bar:
            for line in f:
                if room() < min_len:
                    break
                if not line.strip():
                    continue
                for c in document_chunks(json.loads(line), tokenizer, prefix, max_len, min_len):
                    if room() < min_len:
                        break
                    if len(c["ids"]) > room():  # the cap cuts the last chunk
                        c["ids"] = c["ids"][:int(room())]
                        c["spans"][0][1] = len(c["ids"])
                    docs.append(c)
                    taken += len(c["ids"])
                    bar.update(len(c["ids"]))

    if chats and not pack and not singles:
        raise HyflashError("no conversations left: both packing and single conversations are off")
    packed_ids = {p for q in packs for p in q["parts"]}
    singles_kept = chats if singles else [c for c in chats if c["id"] not in packed_ids]  # a lone leftover stays
    sequences = singles_kept + packs + docs
    random.Random(f"{seed}/sequences").shuffle(sequences)
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8") as f:
        for s in sequences:
            f.write(json.dumps(s, separators=(",", ":")) + "\n")
    os.replace(tmp, out)

    counts = {}
    for kind, group in (("chat", singles_kept), ("packed", packs), ("document", docs)):
        counts[kind] = {"sequences": len(group), "tokens": sum(len(s["ids"]) for s in group),
                        "supervised": sum(e - s for q in group for s, e in q["spans"])}
    meta = {"inputs": inputs, "counts": counts, "sha256": sha256_file(out),
            "responses_dir": str(responses_dir) if responses_dir is not None else None,
            "documents": str(documents_path) if documents_path else None}
    write_json(meta_path, meta)
    for kind, c in counts.items():
        print(f"sequences: {kind:8s} {c['sequences']:6d} sequences {c['tokens']:>11,} tokens "
              f"({c['supervised']:,} supervised)", file=sys.stderr)
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyflash.data.sequences", description=__doc__.split("\n")[0])
    p.add_argument("--responses", default=None,
                   help="folder of responses-*.jsonl (hyflash.data.regenerate); omit for documents only")
    p.add_argument("--documents", default=None, help="train_documents.jsonl (hyflash.data.split)")
    p.add_argument("--out", required=True, help="sequences.jsonl to write")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--doc-tokens", type=int, default=None, help="cap on document tokens (default: all)")
    p.add_argument("--no-pack", action="store_true", help="no packed multi-conversation sequences")
    p.add_argument("--no-singles", action="store_true",
                   help="conversations only inside packs (not also one per sequence)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        build_sequences(args.responses, args.documents, args.out, args.target, args.max_len, args.doc_tokens,
                        not args.no_pack, seed=args.seed, singles=not args.no_singles)
    except HyflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
