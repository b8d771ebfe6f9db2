"""Two `hyflash eval` runs on the items they share: per item and drafter, tokens/s, the speedup over the same run's
plain decoding, τ, and whether greedy output equals that run's plain decoding — e.g. the same prompts before and after
an engine change. Each run's own machine line and commit are printed from its run.json.

    python benchmarks/compare_eval_runs.py reports/runs/gemma3-gpu-long reports/runs/gemma3-cpp-attention-ngram \
        --drafters ngram
"""

import argparse
import json
from pathlib import Path


def load(run: Path) -> tuple[dict, dict]:
    meta = json.loads((run / "run.json").read_text())
    rows: dict[tuple[str, str, float], dict] = {}
    for line in (run / "raw.jsonl").read_text().splitlines():
        r = json.loads(line)
        rows[r["item"], r["drafter"], r["temperature"]] = r
    return meta, rows


def describe(meta: dict) -> str:
    m = meta.get("machine", {})
    return (f"{meta.get('started', '?')} | {m.get('cpu', '?')} | {m.get('cores', '?')} cores | "
            f"commit {meta.get('commit', '?')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--drafters", default="ngram", help="comma-separated labels present in both runs")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    runs = {"before": load(args.before), "after": load(args.after)}
    for name, (meta, _) in runs.items():
        print(f"# {name}: {describe(meta)} | {meta.get('command', '')}")
    drafters = args.drafters.split(",")
    items = sorted({i for (i, d, t) in runs["after"][1] if d == "none" and t == args.temperature}
                   & {i for (i, d, t) in runs["before"][1] if d == "none" and t == args.temperature})
    if not items:
        raise SystemExit("the two runs share no item with a plain-decoding row at this temperature")
    print(f"{'item':<44} {'run':<6} {'prompt':>7} {'plain tok/s':>11}  "
          + "  ".join(f"{d + ' tok/s':>12} {'speedup':>7} {'tau':>5} {'same':>5}" for d in drafters))
    totals = {name: {"plain": [], **{d: [] for d in drafters}} for name in runs}
    for item in items:
        for name, (_, rows) in runs.items():
            plain = rows[item, "none", args.temperature]
            cells = []
            totals[name]["plain"].append(plain["tokens_per_s"])
            for d in drafters:
                r = rows.get((item, d, args.temperature))
                if r is None:
                    cells.append(f"{'-':>12} {'-':>7} {'-':>5} {'-':>5}")
                    continue
                same = r["token_ids"] == plain["token_ids"]
                totals[name][d].append((r["tokens_per_s"] / plain["tokens_per_s"], same))
                cells.append(f"{r['tokens_per_s']:12.1f} {r['tokens_per_s'] / plain['tokens_per_s']:6.2f}x "
                             f"{r['tau']:5.2f} {str(same):>5}")
            print(f"{item:<44} {name:<6} {plain['prompt_tokens']:7d} {plain['tokens_per_s']:11.1f}  " + "  ".join(cells))
    for name, t in totals.items():
        line = f"# {name}: {len(items)} items, plain {min(t['plain']):.1f}-{max(t['plain']):.1f} tok/s"
        for d in drafters:
            if t[d]:
                ratios = sorted(x for x, _ in t[d])
                line += (f"; {d} {ratios[0]:.2f}-{ratios[-1]:.2f}x plain (median {ratios[len(ratios) // 2]:.2f}x), "
                         f"same tokens as plain {sum(s for _, s in t[d])}/{len(t[d])}")
        print(line)


if __name__ == "__main__":
    main()
