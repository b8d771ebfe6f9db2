"""Each drafter of one ``hyflash eval`` run against a base drafter on the same items: the mean of the per-item
differences in τ, its standard error, and on how many items the base is ahead or behind. A suite's table of mean τ
over a handful of long prompts cannot say whether a gap of a few hundredths is real; differences on the same prompts
can, because what makes one prompt easy makes it easy for both.

    python benchmarks/paired_items.py reports/runs/smollm2-dpfp4-probe --base hyflash-dpfp4

Several runs may be given: a drafter evaluated later on the same prompts is then paired with those of an earlier run.
They must share the target (its fingerprint), the settings that shape an item (suites' prompts, max new tokens, dtype)
and, on every item two runs share, its prompt length and plain decoding's greedy tokens; a drafter label may appear in
several runs only on different items (one run per bucket, say), never on the same item at the same temperature twice.
``--drop-differing`` leaves out the items whose plain greedy tokens differ instead (runs on CPUs whose matmuls round
differently: see reports/README.md) and says how many. ``--by-bucket`` pairs within each (suite, prompt-length
bucket) instead of over a suite's buckets, to see how a gap moves with the prompt's length. Reads ``raw.jsonl`` and
``run.json`` only (no model runs); prints each run's own machine, date and commit.
"""

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from hyflash.evaluation.report import _bucket_key, cpu_name


def paired_rows(rows: list[dict], base: str, temperature: float = 0.0, by_bucket: bool = False) -> list[dict]:
    """Per suite (with ``by_bucket``: per suite and bucket) and drafter (other than ``base`` and plain decoding):
    items shared with ``base``, both means, the mean difference base − drafter, its standard error (0 for a single
    item) and the items where base is ahead or behind."""
    tau = defaultdict(dict)  # (suite, bucket or "") -> {(item, drafter): τ}
    for r in rows:
        if r["temperature"] == temperature:
            tau[r["suite"], r.get("bucket", "") if by_bucket else ""][r["item"], r["drafter"]] = r["tau"]
    out = []
    for (suite, bucket), t in sorted(tau.items(), key=lambda kv: (kv[0][0], _bucket_key(kv[0][1]))):
        for d in sorted({d for _, d in t} - {base, "none"}):
            items = sorted(i for i, dd in t if dd == d and (i, base) in t)
            if not items:
                continue
            diffs = [t[i, base] - t[i, d] for i in items]
            n, mean = len(diffs), sum(diffs) / len(diffs)
            se = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1) / n) if n > 1 else 0.0
            out.append({"suite": suite, "bucket": bucket, "drafter": d, "items": n,
                        "base_tau": sum(t[i, base] for i in items) / n,
                        "tau": sum(t[i, d] for i in items) / n, "diff": mean, "se": se,
                        "ahead": sum(x > 0 for x in diffs), "behind": sum(x < 0 for x in diffs)})
    return out


SHARED_SETTINGS = ("target", "target_fingerprint", "max_new_tokens", "seed", "dtype")


def merge_runs(runs: list[tuple[str, dict, list[dict]]], dropped: set | None = None) -> list[dict]:
    """The rows of several runs (name, run.json, raw.jsonl rows) as one run's, after checking they can be paired: the
    same target and item-shaping settings, no (drafter, item, temperature) in two runs, and on each item two runs share
    the same prompt length and (greedy) the same plain-decoding tokens. Raises SystemExit saying what differs; given a
    set ``dropped``, items whose plain tokens differ are left out and added to it instead."""
    first_name, first, _ = runs[0]
    for name, meta, _ in runs[1:]:
        for key in SHARED_SETTINGS:
            a, b = first["settings"].get(key), meta["settings"].get(key)
            if a != b:
                raise SystemExit(f"{name} and {first_name} differ in {key} ({b!r} vs {a!r}): not the same items")
    owner: dict[tuple, str] = {}  # (drafter, item, temperature) -> run
    seen: dict[str, tuple[str, int, list | None]] = {}  # item -> (run, prompt tokens, plain greedy tokens)
    merged = []
    for name, _, rows in runs:
        for r in rows:
            key = (r["drafter"], r["item"], r["temperature"])
            if r["drafter"] != "none" and owner.setdefault(key, name) != name:
                raise SystemExit(f"drafter {r['drafter']!r} has item {r['item']} at temperature {r['temperature']} "
                                 f"in both {owner[key]} and {name}: label it differently in one of them")
            plain = r.get("token_ids") if r["drafter"] == "none" and r["temperature"] == 0 else None
            old = seen.get(r["item"])
            if old is None or (old[2] is None and plain is not None):
                seen[r["item"]] = (name, r["prompt_tokens"], plain)
            if old is not None and old[0] != name:
                if old[1] != r["prompt_tokens"]:
                    raise SystemExit(f"item {r['item']}: {r['prompt_tokens']} prompt tokens in {name}, {old[1]} in "
                                     f"{old[0]}: not the same prompt")
                if plain is not None and old[2] is not None and plain != old[2]:
                    if dropped is not None:
                        dropped.add(r["item"])
                        continue
                    raise SystemExit(f"item {r['item']}: plain greedy decoding differs between {name} and {old[0]}: "
                                     f"not the same target output")
            if r["drafter"] != "none" or old is None or old[0] == name:
                merged.append(r)
    return [r for r in merged if not dropped or r["item"] not in dropped]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", metavar="run", help="hyflash eval output folders (raw.jsonl, run.json)")
    ap.add_argument("--base", required=True, help="the drafter every other is compared with (its label)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--by-bucket", action="store_true", help="pair within each prompt-length bucket of a suite")
    ap.add_argument("--drop-differing", action="store_true",
                    help="leave out items whose plain greedy tokens differ between runs (else: refuse)")
    args = ap.parse_args()
    runs = []
    for run in map(Path, args.runs):
        meta = json.loads((run / "run.json").read_text())
        rows = [json.loads(line) for line in (run / "raw.jsonl").read_text().splitlines() if line.strip()]
        runs.append((str(run), meta, rows))
    dropped = set() if args.drop_differing else None
    rows = merge_runs(runs, dropped) if len(runs) > 1 else runs[0][2]
    if not any(r["drafter"] == args.base for r in rows):
        raise SystemExit(f"no drafter {args.base!r} in {', '.join(args.runs)} "
                         f"(they have {', '.join(sorted({r['drafter'] for r in rows}))})")
    for name, meta, _ in runs:
        m = meta["machine"]
        print(f"# {name}: started {meta['started']} | {cpu_name(m)} | {m['cores']} cores, torch threads "
              f"{m['torch_threads']} | commit {meta['commit']} | {meta['command']}"
              + (f" | env {' '.join(f'{k}={v}' for k, v in m['env'].items()) or '-'}" if "env" in m else ""))
    if dropped:
        items = {r["item"] for _, _, rs in runs for r in rs}
        print(f"# left out: {len(dropped)} of {len(items)} items, where plain greedy decoding differs between runs")
    print(f"suite  {'bucket  ' if args.by_bucket else ''}drafter  items  tau_{args.base}  tau  "
          f"{args.base}_minus_drafter  paired_standard_error  {args.base}_ahead  {args.base}_behind")
    for r in paired_rows(rows, args.base, args.temperature, args.by_bucket):
        bucket = r["bucket"] + "  " if args.by_bucket else ""
        print(f"{r['suite']}  {bucket}{r['drafter']}  {r['items']}  {r['base_tau']:.3f}  {r['tau']:.3f}  "
              f"{r['diff']:+.3f}  {r['se']:.3f}  {r['ahead']}  {r['behind']}")


if __name__ == "__main__":
    main()
