"""Tree drafting that computes only the block's first min(N, block) slots (HyFlashProposer's rule) against the same
drafter computing all of them, side by side in one process on MT-Bench first turns (greedy, 128 new tokens; the
order of the systems alternates per prompt). A system ending in /all runs with DrafterState.draft_logits patched
here to ignore the slot count it is asked for. Prints τ and pooled tok/s over plain decoding's.

    python benchmarks/ab_draft_slots.py [--systems none,ngram+auto,ngram+auto/all,auto,auto/all] [--limit 20]
"""

import argparse

import torch

from common import machine_line
from hyflash.data.sources import SOURCES
from hyflash.decoding import generate
from hyflash.drafter.state import DrafterState
from hyflash.proposers import load_proposer
from hyflash.target import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default="none,ngram+auto,ngram+auto/all,auto,auto/all")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    every_slot = [False]
    asked = DrafterState.draft_logits

    def draft_logits(self, anchor, slots=None):
        return asked(self, anchor, None if every_slot[0] else slots)

    DrafterState.draft_logits = draft_logits
    target = Target.load("smollm2-135m", dtype="bf16", fast=True)
    systems = args.systems.split(",")
    if "none" not in systems:
        systems.insert(0, "none")
    proposers = {s: None if s == "none" else load_proposer(s.split("/")[0], target, seed=0) for s in systems}
    generate(target, target.encode("Hello"), None, max_new_tokens=4)  # warm-up
    totals = {s: [0, 0.0, 0] for s in systems}  # tokens, decode seconds, rounds
    for i, item in enumerate(list(SOURCES["mtbench"].read())[:args.limit]):
        ids = target.encode(item["turns"][0])
        for s in systems if i % 2 == 0 else systems[::-1]:
            every_slot[0] = s.endswith("/all")
            stats = generate(target, ids, proposers[s], max_new_tokens=128).stats
            t = totals[s]
            t[0] += stats.new_tokens - 1
            t[1] += (stats.total_ms - stats.prefill_ms) / 1e3
            t[2] += stats.rounds
    plain = totals["none"][0] / totals["none"][1]
    print(machine_line())
    print(f"# MT-Bench first turns 1-{args.limit}, greedy, 128 new tokens; plain decoding {plain:.1f} tok/s")
    for s, (tokens, seconds, rounds) in totals.items():
        if s != "none":
            print(f"{s:<20} tau {tokens / max(1, rounds):.3f}  {tokens / seconds / plain:.3f}x plain")


if __name__ == "__main__":
    main()
