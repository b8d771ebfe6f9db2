"""Each drafter of one ``hyflash eval`` run against a base drafter on the same items: the mean of the per-item
differences in τ, its standard error, and on how many items the base is ahead or behind. A suite's table of mean τ
over a handful of long prompts cannot say whether a gap of a few hundredths is real; differences on the same prompts
can, because what makes one prompt easy makes it easy for both.

    python benchmarks/paired_items.py reports/runs/smollm2-dpfp4-probe --base hyflash-dpfp4

Reads ``raw.jsonl`` and ``run.json`` only (no model runs); prints the run's own machine, date and commit.
"""

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path


def paired_rows(rows: list[dict], base: str, temperature: float = 0.0) -> list[dict]:
    """Per suite and drafter (other than ``base`` and plain decoding): items shared with ``base``, both means, the
    mean difference base − drafter, its standard error (0 for a single item) and the items where base is ahead or
    behind."""
    tau = defaultdict(dict)  # suite -> {(item, drafter): τ}
    for r in rows:
        if r["temperature"] == temperature:
            tau[r["suite"]][r["item"], r["drafter"]] = r["tau"]
    out = []
    for suite, t in sorted(tau.items()):
        for d in sorted({d for _, d in t} - {base, "none"}):
            items = sorted(i for i, dd in t if dd == d and (i, base) in t)
            if not items:
                continue
            diffs = [t[i, base] - t[i, d] for i in items]
            n, mean = len(diffs), sum(diffs) / len(diffs)
            se = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1) / n) if n > 1 else 0.0
            out.append({"suite": suite, "drafter": d, "items": n, "base_tau": sum(t[i, base] for i in items) / n,
                        "tau": sum(t[i, d] for i in items) / n, "diff": mean, "se": se,
                        "ahead": sum(x > 0 for x in diffs), "behind": sum(x < 0 for x in diffs)})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a hyflash eval output folder (raw.jsonl, run.json)")
    ap.add_argument("--base", required=True, help="the drafter every other is compared with (its label)")
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    run = Path(args.run)
    meta = json.loads((run / "run.json").read_text())
    rows = [json.loads(line) for line in (run / "raw.jsonl").read_text().splitlines() if line.strip()]
    if not any(r["drafter"] == args.base for r in rows):
        raise SystemExit(f"no drafter {args.base!r} in {run} (it has {', '.join(sorted({r['drafter'] for r in rows}))})")
    m = meta["machine"]
    print(f"# {run}: started {meta['started']} | {m['cpu']} | {m['cores']} cores, torch threads {m['torch_threads']} | "
          f"commit {meta['commit']} | {meta['command']}")
    print(f"suite  drafter  items  tau_{args.base}  tau  {args.base}_minus_drafter  paired_standard_error  "
          f"{args.base}_ahead  {args.base}_behind")
    for r in paired_rows(rows, args.base, args.temperature):
        print(f"{r['suite']}  {r['drafter']}  {r['items']}  {r['base_tau']:.3f}  {r['tau']:.3f}  {r['diff']:+.3f}  "
              f"{r['se']:.3f}  {r['ahead']}  {r['behind']}")


if __name__ == "__main__":
    main()
