"""Stage 2: the target answers the training prompts itself, so the drafter learns the target's own distribution.

    <out>/responses-00000.jsonl   {"id", "source", "prompt_ids", "response_ids"}; the response is the greedy
                                  continuation, cut after (and including) its first EOS
    <out>/regenerate.json         the inputs (prompt file hash, target, decoding settings) and one entry per
                                  finished shard (prompts skipped, tokens, seconds)

The prompts are cut into shards of `shard_size` records in file order. A shard is written under a temporary
name and renamed when complete, so a rerun skips finished shards and redoes only the rest. Within a shard the
prompts are sorted by length and answered in batches with LEFT padding: greedy decoding of a padded row is the
decoding of the row alone (exactly so in fp32/fp64; in bf16 the padded shapes can flip a rare near-tie).

    python -m hyflash.data.regenerate --prompts /work/data_cache/split/train_prompts.jsonl \
        --out /work/data_cache/responses [--batch-size 32] [--max-new-tokens 256] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from hyflash import HyflashError
from hyflash.data.sources import sha256_file
from hyflash.data.split import load_json, read_jsonl, write_json
from hyflash.target import Target

FORMAT_VERSION = 1


def load_target(target: str | Target, dtype: str = "bf16") -> Target:
    """A `Target` as given, or loaded from its spec (embedded name, directory, GGUF file)."""
    return target if isinstance(target, Target) else Target.load(target, dtype=dtype)


def pad_token_id(target: Target) -> int:
    """The tokenizer's pad token, else the (smallest) EOS id."""
    pad = getattr(target.tokenizer, "pad_token_id", None) if target.tokenizer is not None else None
    return pad if pad is not None else min(target.eos_token_ids)


def cut_after_eos(ids: list[int], eos: set[int]) -> list[int]:
    """`ids` up to and including the first EOS (all of it when there is none)."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i + 1]
    return ids


@torch.inference_mode()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts in one left-padded `generate` call, each cut after its first EOS."""
    eos = sorted(target.eos_token_ids)
    pad = pad_token_id(target)
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [batch, width]
    mask = torch.zeros_like(ids)  # [batch, width], 1 on real tokens
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    out = target.model.generate(input_ids=ids.to(target.device), attention_mask=mask.to(target.device),
                                max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                                eos_token_id=eos, pad_token_id=pad)  # [batch, width + steps]
    return [cut_after_eos(row, set(eos)) for row in out[:, width:].tolist()]


def shard_name(index: int) -> str:
    return f"responses-{index:05d}.jsonl"


def regenerate(prompts_path, out_dir, target: str | Target = "smollm2-135m", dtype: str = "bf16",
               max_new_tokens: int = 256, batch_size: int = 32, limit: int | None = None, shard_size: int = 512,
               max_prompt_tokens: int = 1024) -> dict:
    """Answer every chat prompt of `prompts_path` (records {"id", "source", "messages"}) greedily with the target.

    Prompts longer than `max_prompt_tokens` (chat template included), or that leave no room for
    `max_new_tokens` in the target's context, are skipped and listed in the manifest.
    Returns the manifest (also written to <out>/regenerate.json).
    """
    tgt = load_target(target, dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = read_jsonl(Path(prompts_path))[:limit]
    config = {"format": FORMAT_VERSION, "prompts_sha256": sha256_file(Path(prompts_path)), "target": tgt.name,
              "fingerprint": tgt.fingerprint(), "dtype": str(tgt.dtype).removeprefix("torch."),
              "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "shard_size": shard_size}
    manifest_path = out / "regenerate.json"
    manifest = load_json(manifest_path) or {"config": config, "shards": {}}
    if manifest["config"] != config:
        changed = {k: (manifest["config"].get(k), v) for k, v in config.items() if manifest["config"].get(k) != v}
        raise HyflashError(f"{out} holds responses made with other settings {changed}; use another --out")
    manifest["prompts"] = str(prompts_path)

    shards = [(s, records[s:s + shard_size]) for s in range(0, len(records), shard_size)]
    todo = []
    for first, recs in shards:
        name = shard_name(first // shard_size)
        entry = manifest["shards"].get(name)
        done = (out / name).exists() and entry and entry["first"] == first and entry["count"] == len(recs)
        if not done:
            todo.append((name, first, recs))
    print(f"regenerate: {len(records)} prompts in {len(shards)} shards, {len(todo)} to do; target {tgt.name} "
          f"{config['dtype']}, batch {batch_size}, <= {max_new_tokens} new tokens", file=sys.stderr)

    eos = set(tgt.eos_token_ids)
    total_new, total_seconds = 0, 0.0
    bar = tqdm(total=sum(len(r) for _, _, r in todo), unit="prompt", desc="regenerate", dynamic_ncols=True)
    for name, first, recs in todo:
        prompts, skipped = [], []
        for r in recs:
            ids = tgt.encode(r["messages"])
            if len(ids) > max_prompt_tokens or len(ids) + max_new_tokens > tgt.max_context:
                skipped.append(r["id"])
            else:
                prompts.append((r, ids))
        bar.update(len(skipped))
        # longest first: the costliest batch runs first, and rows of a batch have similar lengths
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i][1]))
        responses: list[list[int] | None] = [None] * len(prompts)
        start = time.perf_counter()
        for b in range(0, len(order), batch_size):
            rows = order[b:b + batch_size]
            for i, resp in zip(rows, generate_batch(tgt, [prompts[i][1] for i in rows], max_new_tokens)):
                responses[i] = resp
            bar.update(len(rows))
            new = sum(len(responses[i]) for i in rows)
            total_new += new
            bar.set_postfix(tok_s=f"{total_new / (total_seconds + time.perf_counter() - start):.0f}")
        seconds = time.perf_counter() - start
        total_seconds += seconds
        tmp = out / (name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for (r, ids), resp in zip(prompts, responses):
                f.write(json.dumps({"id": r["id"], "source": r["source"], "prompt_ids": ids,
                                    "response_ids": resp}, separators=(",", ":")) + "\n")
        os.replace(tmp, out / name)
        manifest["shards"][name] = {
            "first": first, "count": len(recs), "written": len(prompts), "skipped": skipped,
            "prompt_tokens": sum(len(ids) for _, ids in prompts), "response_tokens": sum(map(len, responses)),
            "ended_with_eos": sum(bool(r) and r[-1] in eos for r in responses), "batch_size": batch_size,
            "seconds": round(seconds, 2)}
        write_json(manifest_path, manifest)
    bar.close()
    if todo:
        print(f"regenerate: {total_new:,} response tokens in {total_seconds:.1f} s = "
              f"{total_new / max(total_seconds, 1e-9):.1f} tokens/s (batch {batch_size})", file=sys.stderr)
    manifest["this_run"] = {"response_tokens": total_new, "seconds": round(total_seconds, 2),
                            "tokens_per_s": round(total_new / max(total_seconds, 1e-9), 1)}
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hyflash.data.regenerate", description=__doc__.split("\n")[0])
    p.add_argument("--prompts", required=True, help="train_prompts.jsonl from hyflash.data.split")
    p.add_argument("--out", required=True, help="output folder for responses-*.jsonl")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--shard-size", type=int, default=512)
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        regenerate(args.prompts, args.out, args.target, args.dtype, args.max_new_tokens, args.batch_size,
                   args.limit, args.shard_size, args.max_prompt_tokens)
    except HyflashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
