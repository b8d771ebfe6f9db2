"""Held-out τ̂ of saved drafters, with its standard error over the held-out anchors: how large a difference between
two runs' τ̂ has to be before it means anything.

For each training run folder (``hyflash train`` output with ``final/``; ``hyflash train --export --out RUN`` makes one
from the latest checkpoint of a run stopped early), re-evaluates ``final/`` on the run's own held-out sequences and
anchors exactly as the training loop's validation does (``hyflash.train.evaluate``).

    python benchmarks/val_tau_se.py RUN_DIR [RUN_DIR ...]
"""

import json
import sys

import torch

from common import machine_line
from hyflash.drafter.model import from_pretrained
from hyflash.target import Target
from hyflash.train import TrainConfig, check_store, evaluate, open_store, split_indices


def main():
    torch.set_num_threads(1)
    print(machine_line())
    print("run  val_tau  standard_error  anchors")
    for run in sys.argv[1:]:
        cfg = TrainConfig.from_dict(json.load(open(f"{run}/train_config.json")))
        target = Target.load(cfg.target, "bf16", feature_layers=cfg.drafter.target_layers)
        store = open_store(cfg.data)
        check_store(store, target, cfg)
        _, val = split_indices(len(store), cfg)
        r = evaluate(from_pretrained(f"{run}/final", target, dtype=torch.float32), store, val, cfg)
        print(f"{run}  {r['val_tau']:.4f}  {r['val_tau_se']:.4f}  {r['val_anchors']}")


if __name__ == "__main__":
    main()
