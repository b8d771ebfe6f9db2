"""Gemma 3 in bf16, its two ways of attending for a step or a verify of 1-16 tokens, side by side: the batch-invariant
way (``LeanGemma3.bitwise``: the C++ attention of csrc/lean_llama.cpp, so that k verified tokens get the bits of k
single steps and greedy speculative output equals plain decoding's) against torch's SDPA over all new tokens at once
(the way before: a token's attention then rounds differently in a verify than in a step, and greedy speculative
output can leave plain decoding's).

Both ways are timed in one process, interleaved, after prompts of ``--contexts`` tokens (the attention a new token
pays grows with the context in the full-attention layers); then greedy decoding plain and with prompt lookup, both
ways, on ``--prompts`` MT-Bench first turns: tokens/s, τ, and whether the output equals plain decoding's.

    python benchmarks/bench_gemma3_verify.py [--contexts 512,4096] [--tokens 1,2,4,8] [--repeats 20] [--prompts 5]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.data.sources import SOURCES
from hyflash.decoding import generate, prompt_forward
from hyflash.proposers import NgramProposer
from hyflash.target import Target

MODES = {"bitwise (C++ attention)": True, "SDPA, all at once": False}


def filler(target: Target, n: int) -> list[int]:
    """n tokens of plain prose-like text with numbers, so that no two stretches are alike."""
    parts, ids = [], []
    i = 0
    while len(ids) < n:
        parts.append(f"Entry {i}: the {['north', 'south', 'east', 'west'][i % 4]} gate opened at {i * 37 % 24} hours "
                     f"and {i * 11 % 60} minutes, and {i * 7 % 50} carts passed through it.")
        i += 1
        if i % 50 == 0:
            ids = target.encode(" ".join(parts), chat=False)
    return target.encode(" ".join(parts), chat=False)[:n]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load("gemma3-270m", dtype="bf16", fast=True)
    lean = target.lean
    if not lean.bitwise:
        raise SystemExit("our kernels do not serve this CPU (or HYFLASH_KERNELS=0): Gemma 3's verify is not "
                         "bitwise here, so there is nothing to compare")
    print(machine_line())
    print(f"# {target.name} bf16; verify = the target's forward of k new tokens (features on), median of "
          f"{args.repeats}, both ways interleaved")
    tokens = [int(k) for k in args.tokens.split(",")]
    for context in (int(c) for c in args.contexts.split(",")):
        ids = filler(target, context)
        cache = target.new_cache(context + max(tokens) + 1)
        prompt_forward(target, ids, cache, features=True)
        times = {(m, k): [] for m in MODES for k in tokens}
        for _ in range(args.repeats):
            for k in tokens:
                for mode, bitwise in MODES.items():
                    lean.bitwise = bitwise
                    t0 = time.perf_counter()
                    target.forward(torch.tensor(ids[-k:]), cache, features=True)
                    times[mode, k].append(time.perf_counter() - t0)
                    target.rollback(cache, context)
        lean.bitwise = True
        for mode in MODES:
            print(f"context {context:>6}  {mode:<23} ms by tokens: "
                  + "  ".join(f"{k}: {1e3 * median(times[mode, k]):6.1f}" for k in tokens))
        a, b = MODES
        print(f"context {context:>6}  {'ratio (bitwise / SDPA)':<23}             "
              + "  ".join(f"{k}: {median(times[a, k]) / median(times[b, k]):6.2f}" for k in tokens))

    prompts = [target.encode(q["turns"][0]) for q in list(SOURCES["mtbench"].read())[:args.prompts]]
    rows = {}
    for i, ids in enumerate(prompts):
        order = list(MODES.items()) if i % 2 == 0 else list(MODES.items())[::-1]
        for mode, bitwise in order:
            lean.bitwise = bitwise
            plain = generate(target, ids, None, max_new_tokens=args.max_new_tokens)
            spec = generate(target, ids, NgramProposer(), max_new_tokens=args.max_new_tokens)
            r = rows.setdefault(mode, dict(plain_tok=0, plain_s=0.0, spec_tok=0, spec_s=0.0, taus=[], same=0))
            r["plain_tok"] += len(plain.token_ids)
            r["plain_s"] += plain.stats.total_ms / 1e3
            r["spec_tok"] += len(spec.token_ids)
            r["spec_s"] += spec.stats.total_ms / 1e3
            r["taus"].append(spec.stats.acceptance_length)
            r["same"] += spec.token_ids == plain.token_ids
    lean.bitwise = True
    print(f"# greedy, {args.max_new_tokens} new tokens, MT-Bench first turns 1-{len(prompts)} (Target.encode), "
          f"prompt lookup (ngram) against plain decoding, both ways alternating per prompt")
    for mode, r in rows.items():
        plain_tps, spec_tps = r["plain_tok"] / r["plain_s"], r["spec_tok"] / r["spec_s"]
        print(f"{mode:<23} plain {plain_tps:6.1f} tok/s  ngram {spec_tps:6.1f} tok/s  = {spec_tps / plain_tps:.2f}x  "
              f"tau {sum(r['taus']) / len(r['taus']):.2f}  same tokens as plain {r['same']}/{len(prompts)}")


if __name__ == "__main__":
    main()
