"""Gemma 3 270M's KV cache with its sliding-window layers keeping only what their window can still see (the
default: ``hyflash.fast.StaticCache``) against keeping every position in every layer (``new_cache(windowed=False)``),
side by side in one process: bytes held and allocated after a prompt of each of ``--contexts`` tokens, the forward of
k new tokens (a step for k = 1, a verify for more) timed both ways interleaved, with the logits compared bit for bit,
and greedy decoding of ``--decode`` tokens both ways (the windowed buffers slide down every ~256 tokens), compared
token for token.

    python benchmarks/bench_gemma3_kv.py [--contexts 4096,16384] [--tokens 1,8] [--repeats 11] [--decode 300]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.decoding import prompt_forward
from hyflash.target import Target


def mb(n: int) -> str:
    return f"{n / 2**20:7.1f} MiB"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--decode", type=int, default=300, help="greedy tokens decoded both ways after each prompt")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load("gemma3-270m", dtype="bf16", fast=True)
    lean = target.lean
    tokens = [int(t) for t in args.tokens.split(",")]
    print(machine_line())
    print(f"# {target.name} bf16; windowed: sliding layers keep their window + slack; whole: every position in every "
          f"layer. Forward of k tokens after the prompt: median of {args.repeats}, the two interleaved")
    g = torch.Generator().manual_seed(2)
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(1000, 100000, (context,), generator=g).tolist()
        capacity = context + max(max(tokens), args.decode) + 1
        caches, prefill_s, last = {}, {}, {}
        for way in ("windowed", "whole"):
            t0 = time.perf_counter()
            cache = lean.new_cache(capacity, windowed=way == "windowed")
            last[way] = prompt_forward(target, ids, cache, features=True)[0]
            prefill_s[way] = time.perf_counter() - t0
            caches[way] = cache
        w, a = caches["windowed"], caches["whole"]
        print(f"context {context:>6}: held {mb(w.nbytes())} windowed / {mb(a.nbytes())} whole = "
              f"{w.nbytes() / a.nbytes():.3f}x; allocated {mb(w.allocated_bytes())} / {mb(a.allocated_bytes())} = "
              f"{w.allocated_bytes() / a.allocated_bytes():.3f}x; prefill {prefill_s['windowed']:.1f} s / "
              f"{prefill_s['whole']:.1f} s")
        cells = []
        for n in tokens:
            new = torch.tensor(ids[-n:])
            times = {way: [] for way in caches}
            logits = {}
            for _ in range(args.repeats):
                for way, cache in caches.items():
                    t0 = time.perf_counter()
                    logits[way] = target.forward(new, cache, features=True).logits
                    times[way].append(time.perf_counter() - t0)
                    target.rollback(cache, context)
            same = torch.equal(logits["windowed"], logits["whole"])
            tw, ta = median(times["windowed"]), median(times["whole"])
            cells.append(f"k={n}: {1e3 * tw:6.1f} / {1e3 * ta:6.1f} ms = {tw / ta:4.2f}x, logits "
                         f"{'identical' if same else 'DIFFERENT'}")
        print("   " + "   ".join(cells))
        if args.decode:  # greedy decoding on the caches as the prompt left them, the two ways step by step in turn
            out = {way: [int(last[way].argmax())] for way in caches}
            spent = {way: 0.0 for way in caches}
            for _ in range(args.decode - 1):
                for way, cache in caches.items():
                    t0 = time.perf_counter()
                    logits = target.forward(torch.tensor(out[way][-1:]), cache, features=False).logits
                    out[way].append(int(logits[-1].argmax()))
                    spent[way] += time.perf_counter() - t0
            tw, ta = ((args.decode - 1) / spent[way] for way in ("windowed", "whole"))
            print(f"   greedy {args.decode} tokens: {tw:.1f} / {ta:.1f} tok/s = {tw / ta:.2f}x, "
                  f"{'identical' if out['windowed'] == out['whole'] else 'DIFFERENT'} tokens; at the end held "
                  f"{mb(w.nbytes())} / {mb(a.nbytes())}, allocated {mb(w.allocated_bytes())} / "
                  f"{mb(a.allocated_bytes())} ({w.base:,} positions dropped from each windowed layer)")


if __name__ == "__main__":
    main()
