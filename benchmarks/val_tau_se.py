"""Held-out τ̂ of saved drafters, with its standard error over the held-out anchors: how large a difference between
two runs' τ̂ has to be before it means anything.

For each training run folder (``hyflash train`` output with ``final/``; ``hyflash train --export --out RUN`` makes one
from the latest checkpoint of a run stopped early), re-evaluates ``final/`` on the run's own held-out sequences and
anchors exactly as the training loop's validation does (``hyflash.train.evaluate``). The crops and anchors follow the
split's seed (``split_seed``); logs written before that change by a run with another data-order ``seed`` (a later
stage) scored other crops of the same sequences, so this script's τ̂ for such a run can differ from its log.

    python benchmarks/val_tau_se.py RUN_DIR [RUN_DIR ...]

``--data STORE`` (repeatable) evaluates every run on those stores instead of its own (e.g. a first-stage drafter on
the recall stage's mixture, for a before/after); a mixture is reported store by store, each on its own held-out
sequences (``hyflash.train.split_store``).

    python benchmarks/val_tau_se.py --data /work/data_cache/full/features --data /work/data_cache/recall/features \
        /work/runs/hyflash /work/runs/hyflash-recall

Runs trained with different recipes validate on different anchors (``anchors_per_seq``, ``seq_len``) and may name a
target path of another machine (a GPU run's converted target): ``--anchors``, ``--seq-len`` and ``--target`` set them
for every run, so that all are scored on the same held-out blocks with the same target.

    python benchmarks/val_tau_se.py --data /work/data/gemma/features --anchors 64 --target gemma3-270m \
        /work/runs/gemma-hyflash-s2 /work/runs/gpu/gemma3-gpu2/hyflash

``--paired`` scores every run on the same held-out blocks in one pass (the first run's recipe decides the data and
anchors) and reports each run's difference from the first with its paired standard error: the SE of the mean of
per-anchor differences, much smaller than either run's own when two drafters share most of their weights (a
drafter against its own memory cut to the window).

    python benchmarks/val_tau_se.py --paired --data …/feat/far /work/runs/dp600 /work/runs/dp600-cut

``--train-sequences N`` scores the first N *training* sequences of each store instead (same anchors and crop as the
held-out check): a difference between two drafters that holds on held-out text but flips on training text is
over-fitting, one that holds on both is a weakness of the training itself.
"""

import argparse
import json

import numpy as np
import torch

from common import machine_line
from hyflash.drafter.model import from_pretrained
from hyflash.target import Target
from hyflash.train import (MixedStore, TrainConfig, check_store, evaluate, evaluate_many, open_store, part_indices,
                           split_store)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="training run folders (with train_config.json and final/)")
    p.add_argument("--data", action="append", help="feature store(s) to evaluate on instead of each run's own")
    p.add_argument("--anchors", type=int, default=None, help="held-out anchors per sequence for every run")
    p.add_argument("--seq-len", type=int, default=None, help="held-out crop length for every run")
    p.add_argument("--target", default=None, help="the target for every run (instead of each run's own)")
    p.add_argument("--paired", action="store_true", help="each run against the first on the same blocks, paired SE")
    p.add_argument("--train-sequences", type=int, default=0, metavar="N",
                   help="score the first N training sequences of each store instead of the held-out ones (does the "
                        "drafter do on what it trained on what it does on held-out text?)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(machine_line())
    if args.paired:
        return paired(args)
    print("run  store  val_tau  standard_error  anchors")
    for run in args.runs:
        cfg, target, store, parts, names = setup(run, args)
        drafter = from_pretrained(f"{run}/final", target, dtype=torch.float32)
        for name, v in zip(names, parts):
            r = evaluate(drafter, store, v, cfg)
            print(f"{run}  {name}  {r['val_tau']:.4f}  {r['val_tau_se']:.4f}  {r['val_anchors']}")


def setup(run, args):
    """The run's recipe with the command line's data, anchors, crop and target; the target, the store, its held-out
    sequences part by part and the parts' names."""
    cfg = TrainConfig.from_dict(json.load(open(f"{run}/train_config.json")))
    if args.data:
        cfg.data = args.data[0] if len(args.data) == 1 else args.data
    cfg.anchors_per_seq = args.anchors or cfg.anchors_per_seq
    cfg.seq_len = args.seq_len or cfg.seq_len
    cfg.target = args.target or cfg.target
    target = Target.load(cfg.target, "bf16", feature_layers=cfg.drafter.target_layers)
    store = open_store(cfg.data)
    check_store(store, target, cfg)
    train, val = split_store(store, cfg)
    parts = part_indices(store, train if args.train_sequences else val) if isinstance(store, MixedStore) \
        else [train if args.train_sequences else val]
    if args.train_sequences:
        parts = [np.sort(p)[: args.train_sequences] for p in parts]
    return cfg, target, store, parts, cfg.data if isinstance(cfg.data, list) else [cfg.data]


def paired(args):
    cfg, target, store, parts, names = setup(args.runs[0], args)
    drafters = [from_pretrained(f"{run}/final", target, dtype=torch.float32) for run in args.runs]
    print(f"run  store  val_tau  standard_error  anchors  minus_{args.runs[0]}  paired_standard_error")
    for name, v in zip(names, parts):
        rs = evaluate_many(drafters, store, v, cfg, per_anchor=True)
        base = rs[0]["val_prefixes"]
        for run, r in zip(args.runs, rs):
            d = r["val_prefixes"] - base
            se = float(d.std() / len(d) ** 0.5) if len(d) > 1 else 0.0
            print(f"{run}  {name}  {r['val_tau']:.4f}  {r['val_tau_se']:.4f}  {r['val_anchors']}  "
                  f"{float(d.mean()):+.4f}  {se:.4f}")


if __name__ == "__main__":
    main()
