"""Drafters trained together vs one at a time, with the target computing features online (a sequences JSONL, as on a
GPU): `hyflash train` with several recipes makes each batch once, so the target's forward is paid once per step
instead of once per drafter. Prints the wall time of the same steps both ways, side by side, and their ratio.

    python benchmarks/bench_train_together.py --data SEQUENCES.jsonl --recipes gemma3-hyflash-gpu,gemma3-full-gpu,\
gemma3-swa-gpu,gemma3-noslot-gpu --set draft_vocab_from=VOCAB.json --set batch_seqs=1 --set anchors_per_seq=16 \
        --truncate 1024 [--steps 6]

Each way runs ``--repeats`` times, alternating; the first ``--skip`` steps of each run (start-up) are left out, and
the figure is the median over repeats. Every run trains from scratch into a temporary directory. ``--truncate N``
keeps each sequence's first N tokens (an online store runs the target over whole sequences, which on a CPU is slow).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from common import machine_line, median
from hyflash.target import Target
from hyflash.train import apply_overrides, load_recipe, open_store, train_many


def loop_seconds(run_dir: Path, skip: int) -> tuple[float, float, float]:
    """(seconds of steps skip+1..last, summed batch seconds, summed own-step seconds) from a run's log."""
    log = [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]
    rest = log[skip:]
    return (log[-1]["elapsed"] - log[skip - 1]["elapsed"], sum(r["data_s"] for r in rest),
            sum(r["step_s"] - r["data_s"] for r in rest))


def truncated(path: str, n: int, folder: Path) -> str:
    """A copy of the sequences file with each sequence's first n tokens (spans clipped to them)."""
    out = folder / "sequences.jsonl"
    with open(path, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as g:
        for line in f:
            if line.strip():
                s = json.loads(line)
                s["ids"] = s["ids"][:n]
                s["spans"] = [[a, min(b, n)] for a, b in s["spans"] if a < n]
                g.write(json.dumps(s) + "\n")
    return str(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a sequences JSONL (features computed online by the target)")
    ap.add_argument("--recipes", required=True, help="comma-separated recipe names that may share batches")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    ap.add_argument("--target", default=None, help="the recipes' target unless given (a name or a local path)")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the timing")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--truncate", type=int, default=0, help="keep each sequence's first N tokens (0: all)")
    args = ap.parse_args()
    if args.steps <= args.skip:
        sys.exit("--steps must exceed --skip")
    torch.set_num_threads(args.threads)
    names = args.recipes.split(",")
    fixed = [f"steps={args.steps}", "eval_every=1000000", f"ckpt_every={args.steps}", "val_fraction=0",
             f"threads={args.threads}", "device=cpu", "init_from_target=false"]
    cfgs = [apply_overrides(load_recipe(n), args.overrides + fixed) for n in names]
    work = tempfile.TemporaryDirectory()
    data = truncated(args.data, args.truncate, Path(work.name)) if args.truncate else args.data
    for c in cfgs:
        c.data = data
        if args.truncate:
            c.seq_len = min(c.seq_len, args.truncate)
        if c.draft_vocab and not c.draft_vocab_from:
            sys.exit(f"{c.drafter.variant}: give --set draft_vocab_from=... (counting labels would run the target "
                     "over every sequence first)")
    target = Target.load(args.target or cfgs[0].target, dtype="bf16", feature_layers=cfgs[0].drafter.target_layers)
    print(machine_line())
    print(f"# {len(names)} drafters, {args.steps} steps each ({args.skip} left out), seq_len {cfgs[0].seq_len}, "
          f"batch {cfgs[0].batch_seqs} x {cfgs[0].anchors_per_seq} anchors, target {target.name}")
    alone_s, together_s = [], []
    batch_s = own_s = 0.0
    for rep in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            # a fresh store each time: an online store keeps its last few sequences, which would favour a later run
            total = 0.0
            for name, cfg in zip(names, cfgs):
                train_many([cfg], [tmp / "alone" / name], target, open_store(data, target, cfg.online_topk))
                total += loop_seconds(tmp / "alone" / name, args.skip)[0]
            alone_s.append(total)
            train_many(cfgs, [tmp / "together" / n for n in names], target,
                       open_store(data, target, cfgs[0].online_topk))
            together_s.append(loop_seconds(tmp / "together" / names[0], args.skip)[0])
            parts = [loop_seconds(tmp / "together" / n, args.skip) for n in names]
            batch_s, own_s = parts[0][1], sum(p[2] for p in parts)
        print(f"repeat {rep + 1}: one at a time {alone_s[-1]:.2f} s, together {together_s[-1]:.2f} s "
              f"(together: batches {batch_s:.2f} s, drafters' own steps {own_s:.2f} s)")
    a, t = median(alone_s), median(together_s)
    print(f"median: one at a time {a:.2f} s, together {t:.2f} s for {args.steps - args.skip} steps of "
          f"{len(names)} drafters -> {a / t:.2f}x")


if __name__ == "__main__":
    main()
