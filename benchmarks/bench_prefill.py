"""A long prompt's prefill in bf16 on a CPU without bf16 dot products (AVX2, or Arm without BF16): torch's bf16
matmul, which converts every operand there, against an fp32 matmul of the same bf16 values (``PackedLinear.upcast``,
what the engine does on such a CPU for the rows our kernels do not take: a prefill's chunks of up to 2,048 tokens).

Both ways run in one process, interleaved, on the same prompt: the median prefill time of each, their ratio, and
whether the prompt's last logits pick the same next token (values agree up to summation order, so a greedy
continuation can still part near a tie).

    python benchmarks/bench_prefill.py [--target gemma3-270m] [--lengths 1024,4096] [--repeats 3]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.decoding import prefill
from hyflash.target import Target

WAYS = {"torch bf16 matmul": False, "fp32 matmul of bf16": True}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype="bf16", fast=True)
    if target.lean is None:
        raise SystemExit(f"{args.target} has no fast path here: nothing to compare")
    linears = target.lean.linears
    print(machine_line())
    print(f"# {target.name} bf16 prefill (features on, as for a drafter), {len(linears)} matmuls switched, median of "
          f"{args.repeats}, both ways interleaved; the engine picks the fp32 way on this CPU: {linears[0].upcast}")
    text = " ".join(f"Line {i}: the {['red', 'green', 'blue'][i % 3]} lamp was lit at {i * 13 % 24} hours."
                    for i in range(4000))
    all_ids = target.encode(text, chat=False)
    for n in (int(x) for x in args.lengths.split(",")):
        ids = all_ids[:n]
        if len(ids) < n:
            raise SystemExit(f"the filler text has only {len(ids)} tokens")
        times, last = {w: [] for w in WAYS}, {}
        for _ in range(args.repeats):
            for way, upcast in WAYS.items():
                for lin in linears:
                    lin.upcast = upcast
                t0 = time.perf_counter()
                p = prefill(target, ids)
                times[way].append(time.perf_counter() - t0)
                last[way] = p.last_logits.float()
        a, b = WAYS
        same = int(last[a].argmax()) == int(last[b].argmax())
        diff = float((last[a] - last[b]).abs().max())
        print(f"prompt {n:>6}  " + "  ".join(f"{w}: {median(times[w]):7.2f} s ({n / median(times[w]):6.1f} tok/s)"
                                            for w in WAYS)
              + f"  speedup {median(times[a]) / median(times[b]):.2f}x  same next token: {same}  "
                f"max |logit diff| {diff:.3f}")


if __name__ == "__main__":
    main()
