"""The target's matmuls for 1..16 tokens: torch's bf16 matmul, oneDNN's packed weights, and our kernel (its AMX
or AVX-512 BF16 build, ``kernels.isa()``).

Runs every linear layer of one forward with the target's shapes (weights of those shapes; timing does not depend on
their values) — what one decoding step (1 token) or one verification (k tokens) multiplies. The weights are far
larger than the caches, so each pass streams them from memory, as decoding does. GB/s: weight bytes per second.

    python benchmarks/bench_kernels.py [--tokens 1,4,8,13,16] [--repeats 9]
"""

import argparse

import torch

from bench_int4 import linear_shapes
from common import machine_line, time_median
from hyflash import kernels
from hyflash.target import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--tokens", default="1,4,8,13,16")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype="bf16")
    shapes = linear_shapes(target)
    del target
    amx = kernels.amx()
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g).to(torch.bfloat16) for n, k in shapes]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    tiles = [amx.pack(w) for w in weights] if amx is not None else None
    nbytes = sum(2 * n * k for n, k in shapes)

    systems = {
        "torch": lambda x: [x[w.shape[1]] @ w.t() for w in weights],
        "onednn": lambda x: [torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                             for w, p in zip(weights, onednn)],
    }
    ours = kernels.isa() or "ours"
    if tiles is not None:
        systems[ours] = lambda x: [amx.linear(x[w.shape[1]], t) for w, t in zip(weights, tiles)]

    print(machine_line())
    print(f"# {args.target}: {len(shapes)} matmuls per forward, {nbytes / 2**20:.0f} MiB of bf16 weights; "
          f"median of {args.repeats} passes" + ("" if tiles is not None else "; our kernel is unavailable here"))
    print(f"{'tokens':>6}  " + "  ".join(f"{s + ' ms':>9}  {s + ' GB/s':>11}" for s in systems)
          + (f"  {ours} vs onednn" if tiles is not None else ""))
    for m in [int(t) for t in args.tokens.split(",")]:
        x = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in {k for _, k in shapes}}
        times = {}
        for name, fn in systems.items():
            times[name] = time_median(lambda: fn(x), args.repeats)
        line = f"{m:>6}  " + "  ".join(f"{1e3 * t:>9.1f}  {nbytes / t / 1e9:>11.1f}" for t in times.values())
        if ours in times:
            line += f"  {times['onednn'] / times[ours]:>{len(ours) + 10}.2f}x"
        print(line)


if __name__ == "__main__":
    main()
