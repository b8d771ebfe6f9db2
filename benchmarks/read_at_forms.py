"""The memory's training read (``hyflash.drafter.memory.read_at``) in its chunked and quadratic forms, timed side by
side: forward and backward for ungrouped queries, as the copy memory reads (one query per anchor and slot head).

    python benchmarks/read_at_forms.py --kind gdn --dk 128,1024
"""

import argparse
import time

import torch
import torch.nn.functional as F

from common import machine_line
from hyflash.drafter import memory as mem


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=mem.MEMORY_KINDS, default="gdn")
    ap.add_argument("--dk", default="128,1024", help="key sizes to time")
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=7, help="the copy memory's heads: one per slot")
    ap.add_argument("--queries", type=int, default=64, help="anchors per sequence")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    B, T, H, dv, Q = args.batch, args.length, args.heads, args.dv, args.queries
    print(f"{machine_line()} | read_at {args.kind}: batch {B}, {T} features, {H} heads, {Q} queries a head, dv {dv}; "
          f"min of {args.repeats} forward + backward")
    for dk in (int(x) for x in args.dk.split(",")):
        k = F.normalize(torch.randn(B, T, H, dk), dim=-1).requires_grad_()
        v = torch.randn(B, T, H, dv, requires_grad=True)
        g = -torch.rand(B, T, H) * 0.01
        beta = torch.rand(B, T, H) if args.kind == "gdn" else None
        q = torch.randn(B, H, Q, dk, requires_grad=True)
        pos = torch.randint(0, T + 1, (B, Q))
        times = {}
        for form in ("chunked", "quadratic"):
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                mem.read_at(args.kind, k, v, g, q, pos, beta, form=form).sum().backward()
                runs.append(time.perf_counter() - t0)
            times[form] = min(runs)
        print(f"  dk {dk:5d}: chunked {times['chunked']:.2f} s, quadratic {times['quadratic']:.2f} s "
              f"(chunked / quadratic {times['chunked'] / times['quadratic']:.2f})", flush=True)


if __name__ == "__main__":
    main()
