"""Where a training step's time goes: one step (fuse, forward, backward) per drafter variant, and the Mamba-2 memory's
training read in its chunked and quadratic forms. Random features of SmolLM2-135M shape; timings of the second rep.

    python benchmarks/bench_train_step.py [--batch 4] [--length 2048] [--anchors 32]
"""

import argparse
import time

import torch

from common import machine_line
from hyflash.drafter import memory
from hyflash.drafter.config import DrafterConfig
from hyflash.drafter.model import new_drafter
from hyflash.target import Target


def step_ms(drafter, feats, ids, anchors):
    for _ in range(2):
        drafter.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = drafter.forward_train(feats, ids, anchors)
        t1 = time.perf_counter()
        logits.float().logsumexp(-1).mean().backward()
        t2 = time.perf_counter()
    return 1e3 * (t1 - t0), 1e3 * (t2 - t1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load("smollm2-135m", dtype="bf16")
    B, L, n = args.batch, args.length, args.anchors
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, L, 5 * 576, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, target.vocab_size, (B, L), generator=g)
    anchors = torch.sort(torch.randint(1, L - 8, (B, n), generator=g), dim=1).values
    print(machine_line())
    print(f"# one training step: {B} sequences x {L} tokens x {n} anchors (7 slots), draft vocabulary 8192, bf16 autocast")
    for name, kw in [("hyflash", {}), ("swa", dict(variant="swa", intermediate_size=2240))]:
        torch.manual_seed(0)
        d = new_drafter(DrafterConfig(draft_vocab_size=8192, **kw), target, dtype=torch.float32).train()
        fwd, bwd = step_ms(d, feats, ids, anchors)
        print(f"{name:<10} forward {fwd:7.0f} ms  backward {bwd:7.0f} ms  {B * n / ((fwd + bwd) / 1e3):6.0f} anchors/s")
    # the memory's training read (one layer), both exact forms
    H, dk, Q = 8, 64, 7 * n
    k = torch.randn(B, L, 1, dk, generator=g).expand(B, L, H, dk).requires_grad_()
    v = torch.randn(B, L, H, dk, generator=g, requires_grad=True)
    gl = (-torch.nn.functional.softplus(torch.randn(B, L, H, generator=g)) * 0.05).requires_grad_()
    q = torch.randn(B, H, Q, dk, generator=g, requires_grad=True)
    pos = anchors.repeat_interleave(7, 1)
    forms = {f"{form}{', grouped' if g > 1 else ''}":
             (lambda form=form, g=g: memory.read_at("mamba2", k, v, gl, q, pos, form=form, group=g))
             for form in ("chunked", "quadratic") for g in (1, 7)}
    out = {}
    for name, fn in forms.items():
        for _ in range(2):
            t0 = time.perf_counter()
            out[name] = fn()
            t1 = time.perf_counter()
            out[name].sum().backward()
            t2 = time.perf_counter()
        print(f"mamba2 read_at, {name:<18} forward {1e3 * (t1 - t0):5.0f} ms  backward {1e3 * (t2 - t1):5.0f} ms")
    diff = max((o - out["chunked"]).abs().max().item() for o in out.values())
    print(f"# max difference between the forms = {diff:.1e} (outputs up to {out['chunked'].abs().max().item():.0f})")


if __name__ == "__main__":
    main()
