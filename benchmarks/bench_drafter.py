"""Drafter variants at 2 layers on SmolLM2-135M geometry: trainable parameters, time of one drafting round
(commit the round's features + draft a block + LM head), and drafter context bytes at 512, 2K and 8K committed
features. Untrained weights: timing and bytes depend on shapes only.

    python benchmarks/bench_drafter.py [--dtype bf16] [--repeats 20]
"""

import argparse
import time

import torch

from common import machine_line, median
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import new_drafter
from hyflash.drafter.state import DrafterState
from hyflash.target import Target, resolve_dtype

CONTEXTS = (512, 2048, 8192)


def fill(drafter, n, feat_dim, dtype):
    state = DrafterState(drafter)
    feats = torch.randn(n, feat_dim, dtype=dtype)
    for s in range(0, n, 1024):
        state.commit(feats[s:s + 1024])
    return state


def round_ms(drafter, state, feat_dim, dtype, repeats):
    """One round: commit 3 verified features, draft a block, LM head + argmax. The state keeps growing by 3 per
    round, as in generation."""
    times = []
    for r in range(repeats):
        f = torch.randn(3, feat_dim, dtype=dtype)
        t0 = time.perf_counter()
        state.commit(f)
        drafter.logits(state.draft_hidden(100)).argmax(-1)
        times.append(1e3 * (time.perf_counter() - t0))
    return median(times[2:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype)
    target = Target.load("smollm2-135m", dtype=dtype)
    feat_dim = len(target.feature_layers) * target.hidden_size
    print(machine_line())
    print(f"# drafter dtype {args.dtype}; round = commit 3 features + draft 7 slots + LM head; median of {args.repeats}")
    print(f"{'variant':<18}{'params':>12}" + "".join(f"{'ms @' + str(c):>11}" for c in CONTEXTS) +
          "".join(f"{'bytes @' + str(c):>14}" for c in CONTEXTS))
    variants = [("hyflash", dict(variant="hyflash")), ("hyflash-gdn", dict(variant="hyflash", memory="gdn")),
                ("full", dict(variant="full")), ("swa", dict(variant="swa"))]
    for name, kw in variants:
        torch.manual_seed(0)
        drafter = new_drafter(DrafterConfig(num_layers=2, **kw), target, dtype=dtype).eval()
        ms, nbytes = [], []
        with torch.no_grad():
            for c in CONTEXTS:
                state = fill(drafter, c, feat_dim, dtype)
                nbytes.append(state.nbytes())
                ms.append(round_ms(drafter, state, feat_dim, dtype, args.repeats))
        print(f"{name:<18}{drafter.num_parameters():>12,}" + "".join(f"{m:>11.1f}" for m in ms) +
              "".join(f"{b:>14,}" for b in nbytes))


if __name__ == "__main__":
    main()
