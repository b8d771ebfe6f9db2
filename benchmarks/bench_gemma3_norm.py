"""Gemma 3 270M's forward with its RMSNorms in one C++ call each and each layer's query and key norms and RoPE in
one more (``LeanGemma3.cpp_norm``: csrc/lean_llama.cpp ``gemma_norm``, ``gemma_qk``) against the torch operations
they replace (eight a norm, 109 norms a step, about fourteen for a layer's RoPE), side by side in one process: the forward of k new tokens (a plain step for k = 1, a verify for more) after prompts of
``--contexts`` tokens, the two ways interleaved call by call. The two round differently (another order of the fp32
sum of squares), so each cell also says whether the next tokens agree and how far the logits are apart.

    python benchmarks/bench_gemma3_norm.py [--contexts 512,4096] [--tokens 1,3,8] [--repeats 15]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.decoding import prompt_forward
from hyflash.target import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="512,4096")
    ap.add_argument("--tokens", default="1,3,8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load("gemma3-270m", dtype="bf16", fast=True)
    lean = target.lean
    cpp = getattr(lean, "cpp_norm", None)
    if cpp is None:
        raise SystemExit("Gemma 3's norms do not run in C++ here (no kernels for this CPU, or HYFLASH_KERNELS=0)")
    ways = {"C++ norm": cpp, "torch norm": None}
    tokens = [int(t) for t in args.tokens.split(",")]
    print(machine_line())
    print(f"# {target.name} bf16, forward of k new tokens (features on) after the context, median of {args.repeats}, "
          "both ways interleaved; each cell: tokens: C++ ms / torch ms = ratio, same argmax, max |logit diff|")
    g = torch.Generator().manual_seed(1)
    for context in (int(c) for c in args.contexts.split(",")):
        ids = torch.randint(1000, 100000, (context + max(tokens),), generator=g).tolist()
        cache = target.new_cache(context + max(tokens) + 1)
        prompt_forward(target, ids[:context], cache, features=True)
        cells = []
        for n in tokens:
            new = torch.tensor(ids[context:context + n])
            times = {w: [] for w in ways}
            logits = {}
            for _ in range(args.repeats):
                for way, module in ways.items():
                    lean.cpp_norm = module
                    t0 = time.perf_counter()
                    logits[way] = target.forward(new, cache, features=True).logits
                    times[way].append(time.perf_counter() - t0)
                    target.rollback(cache, context)
            a, b = (logits[w] for w in ways)
            same = bool((a.argmax(-1) == b.argmax(-1)).all())
            ta, tb = (median(times[w]) for w in ways)
            cells.append(f"{n}: {1e3 * ta:6.1f} / {1e3 * tb:6.1f} = {ta / tb:4.2f}x  {'same' if same else 'DIFFERENT'} "
                         f"argmax  {float((a - b).abs().max()):.3f}")
        print(f"context {context:>6}  " + "   ".join(cells))
    lean.cpp_norm = cpp


if __name__ == "__main__":
    main()
