"""One target forward at a given context: transformers' path against our fast path (static cache, packed weights).

For each engine: ms for a forward over k new tokens (k = 1: a decoding step; k = 8: a verify pass) after a prompt
of --context tokens, min and median over repeats. The two engines run side by side in one process.

    python benchmarks/bench_target.py [--target gemma3-270m] [--context 4096] [--repeats 10] [--threads 2]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.target import Target


def forward_ms(target, context_ids, k, repeats):
    cache = target.new_cache(len(context_ids) + 16)
    target.forward(torch.tensor(context_ids), cache, features=False)
    n = len(context_ids)
    new = torch.arange(1, k + 1) + 100
    times = []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        target.forward(new, cache, features=True)
        times.append(1e3 * (time.perf_counter() - t0))
        target.rollback(cache, n)
    return min(times[2:]), median(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engines = {"transformers": Target.load(args.target, dtype=args.dtype, fast=False),
               "ours fast": Target.load(args.target, dtype=args.dtype, fast=True)}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(200, 20000, (args.context,), generator=g).tolist()
    rows = {name: {k: forward_ms(t, ids, k, args.repeats) for k in (1, 8)} for name, t in engines.items()}
    print(machine_line())
    print(f"# {engines['ours fast'].name} {args.dtype} | context {args.context} | ms per forward (min / median of "
          f"{args.repeats}), features of the drafter's layers included")
    print(f"{'engine':<16}{'k=1 min':>10}{'k=1 med':>10}{'k=8 min':>10}{'k=8 med':>10}")
    for name, r in rows.items():
        print(f"{name:<16}{r[1][0]:>10.1f}{r[1][1]:>10.1f}{r[8][0]:>10.1f}{r[8][1]:>10.1f}")
    base = rows["transformers"]
    print(f"# ours fast vs transformers (min): k=1 {base[1][0] / rows['ours fast'][1][0]:.2f}x, "
          f"k=8 {base[8][0] / rows['ours fast'][8][0]:.2f}x faster")


if __name__ == "__main__":
    main()
