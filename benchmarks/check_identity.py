"""Is greedy speculative decoding token-identical to plain decoding on this machine, per dtype?

It is by construction where a many-token verify gives each token the bits a single step would
(``Target.bitwise_verify``: our C++ forward on x86-64 CPUs with AMX, AVX-512 BF16 or AVX2, and on 64-bit Arm Linux,
or fp32); elsewhere bf16 rounding can flip a near-tie. ``HYFLASH_KERNELS=0`` switches the C++ kernels off, to see the difference on one machine.

    python benchmarks/check_identity.py --dtypes bf16,fp32 --drafter ngram+auto --max-new-tokens 64
"""

import argparse

from common import machine_line
from hyflash.decoding import generate
from hyflash.proposers import load_proposer
from hyflash.target import Target

PROMPTS = ["Explain speculative decoding in two sentences.", "Write a haiku about autumn.",
           "Give me three facts about octopuses.", "What is the capital of France and why is it famous?",
           "Write a Python function that reverses a string.", "Describe how a bicycle works.",
           "List five tips for better sleep.", "What causes rain?"]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--drafter", default="ngram+auto")
    p.add_argument("--max-new-tokens", type=int, default=64)
    args = p.parse_args()
    print(machine_line())
    for dtype in args.dtypes.split(","):
        t = Target.load(args.target, dtype=dtype, fast=True)
        same = 0
        for prompt in PROMPTS:
            ids = t.encode(prompt)
            plain = generate(t, ids, None, max_new_tokens=args.max_new_tokens).token_ids
            spec = generate(t, ids, load_proposer(args.drafter, t), max_new_tokens=args.max_new_tokens).token_ids
            first = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
            same += plain == spec
            print(f"{dtype}  {'identical' if plain == spec else f'differs from token {first}'}  {prompt!r}")
        print(f"{dtype}: {same}/{len(PROMPTS)} identical (bitwise_verify={t.bitwise_verify})")


if __name__ == "__main__":
    main()
