"""The shipped drafter's draft call against the number of block slots it computes, and the target's forward against
the number of tokens it verifies: the two costs a drafting round adds up, on whichever build of our kernels runs.

A tree of N nodes is at most N slots deep, so ``HyFlashProposer`` asks the drafter for the block's first min(N, block)
slots only (``DrafterState.draft_logits(anchor, slots)``); the target then verifies the anchor and the N nodes. Both
are timed here in one process, interleaved, after a prompt has been committed; medians of ``--repeats``.

    python benchmarks/bench_draft.py [--repeats 100]
    HYFLASH_KERNELS=avx2 python benchmarks/bench_draft.py
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.decoding import generate
from hyflash.proposers import load_proposer
from hyflash.target import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype="bf16", fast=True)
    proposer = load_proposer("auto", target, seed=0)
    prompt = target.encode("Explain speculative decoding in a few sentences, with an example of how it works.")
    generate(target, prompt, proposer, max_new_tokens=64)  # commits the prompt and 64 tokens to the drafter's state
    state, block = proposer.state, proposer.block_size
    cache = target.new_cache(len(prompt) + 80)
    target.forward(torch.tensor(prompt), cache, features=True, last_only=True)
    n0 = len(prompt)

    draft = {s: [] for s in range(1, block + 1)}
    verify = {r: [] for r in range(1, block + 2)}
    for _ in range(args.repeats):
        for s in draft:
            t0 = time.perf_counter()
            state.draft_logits(100, slots=s)
            draft[s].append(time.perf_counter() - t0)
        for r in verify:  # the anchor and r - 1 nodes as a chain-shaped tree, with the drafter's features
            t0 = time.perf_counter()
            target.forward(torch.tensor([100] * r), cache, features=True,
                           parents=list(range(r - 1)) if r > 1 else None)
            verify[r].append(time.perf_counter() - t0)
            target.rollback(cache, n0)

    print(machine_line())
    print(f"# {target.name}, the shipped drafter ({proposer.drafter.native_weights} weights, a block of {block} slots); "
          f"median of {args.repeats}")
    print("draft ms by slots computed:  " + "  ".join(f"{s}: {1e3 * median(v):.2f}" for s, v in draft.items()))
    print("verify ms by tokens:         " + "  ".join(f"{r}: {1e3 * median(v):.2f}" for r, v in verify.items()))


if __name__ == "__main__":
    main()
