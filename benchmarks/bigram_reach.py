"""How far back an exact prompt lookup would have to reach in a sequence file: for every position, the bigram ending
there is looked up at its most recent earlier occurrence, and the token after that occurrence is the prediction.
Counts hits and misses by how far back the occurrence lies (within ``--window`` or beyond), and the distances of the
hits beyond it: what a memory that keeps every bigram → next-token pair could add to a window of that size.

    python benchmarks/bigram_reach.py /work/data/copy/far.jsonl --window 256 --length 2048
"""

import argparse
import collections
import json

import numpy as np

from common import machine_line


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sequences", help="JSONL with an 'ids' list per line")
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--length", type=int, default=2048, help="the first N tokens of each sequence (the training crop)")
    args = ap.parse_args()
    counts, far_hits, n_seqs = collections.Counter(), [], 0
    with open(args.sequences) as f:
        for line in f:
            ids = json.loads(line)["ids"][: args.length]
            n_seqs += 1
            last = {}
            for p in range(1, len(ids) - 1):
                key = (ids[p - 1], ids[p])
                if key in last:
                    i = last[key]
                    where = "beyond" if p - i > args.window else "within"
                    hit = ids[i + 1] == ids[p + 1]
                    counts[where, hit] += 1
                    if hit and where == "beyond":
                        far_hits.append(p - i)
                else:
                    counts["unseen", False] += 1
                last[key] = p
    total = sum(counts.values())
    print(f"{machine_line()} | {args.sequences}: {n_seqs} sequences, first {args.length} tokens, window {args.window}")
    for where in ("within", "beyond"):
        for hit in (True, False):
            print(f"  last seen {where:6s} the window, {'hit ' if hit else 'miss'}: {counts[where, hit]:7d} "
                  f"({counts[where, hit] / total:.3f} of {total} positions)")
    print(f"  bigram not seen before: {counts['unseen', False]:7d} ({counts['unseen', False] / total:.3f})")
    d = np.array(far_hits)
    if len(d):
        pct = np.percentile(d, [10, 25, 50, 75, 90]).round().astype(int).tolist()
        print(f"  hits beyond the window lie {pct} back (10/25/50/75/90th percentile)")
        edges = [args.window, 2 * args.window, 4 * args.window, args.length]
        for lo, hi in zip(edges[:-1], edges[1:]):
            print(f"    {lo + 1}-{hi} back: {((d > lo) & (d <= hi)).mean():.3f} of them")


if __name__ == "__main__":
    main()
