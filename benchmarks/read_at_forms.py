"""The memory's training read (``hyflash.drafter.memory.read_at``) in its chunked and quadratic forms, timed side by
side: forward and backward for ungrouped queries, as the copy memory reads (one query per anchor and slot head).
For gdn also ``read_at_delayed``, the copy memory's own read (its heads write one key stream at delays 1..7 and share
values, strengths and queries), on the same per-head inputs.

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
    shared = args.kind == "gdn"  # the copy memory's inputs: heads that differ only in their key's delay
    print(f"{machine_line()} | read_at {args.kind}: batch {B}, {T} features, {H} heads, {Q} queries a head, dv {dv}"
          f"{' (no decay; the heads share values, strengths and queries and write one key stream at delays 1..H)' if shared else ''}; "
          f"min of {args.repeats} forward + backward")
    for dk in (int(x) for x in args.dk.split(",")):
        stream = F.normalize(torch.randn(B, T + H - 1, dk), dim=-1).requires_grad_()
        v1 = torch.randn(B, T, dv, requires_grad=True)
        q1 = torch.randn(B, Q, dk, requires_grad=True)
        beta1 = torch.rand(B, T)
        g = -torch.rand(B, T, H) * 0.01 if not shared else torch.zeros(B, T, H)
        pos = torch.randint(0, T + 1, (B, Q))

        def generic(form):
            k = torch.stack([stream[:, H - 1 - h: H - 1 - h + T] for h in range(H)], 2)
            beta = beta1[..., None].expand(-1, -1, H) if shared else None
            return mem.read_at(args.kind, k, v1[:, :, None].expand(-1, -1, H, -1), g, q1[:, None].expand(-1, H, -1, -1),
                               pos, beta, form=form)

        forms = {"chunked": lambda: generic("chunked"), "quadratic": lambda: generic("quadratic")}
        if shared:
            forms["delayed"] = lambda: mem.read_at_delayed(stream, v1, beta1, q1, pos, H)
        times = {}
        for form, read in forms.items():
            runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                read().sum().backward()
                runs.append(time.perf_counter() - t0)
            times[form] = min(runs)
        line = f"  dk {dk:5d}: " + ", ".join(f"{f} {t:.2f} s" for f, t in times.items())
        line += f" (chunked / quadratic {times['chunked'] / times['quadratic']:.2f}"
        if shared:
            line += f"; quadratic / delayed {times['quadratic'] / times['delayed']:.2f}"
        print(line + ")", flush=True)


if __name__ == "__main__":
    main()
