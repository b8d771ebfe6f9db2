"""What a reduced draft vocabulary costs in τ (EAGLE-3's technique: the drafter's LM head covers only the target's most
frequent tokens, whose ids map back to the target's; verification is unchanged, so output stays exact).

Two measurements, both on the recipe's held-out sequences and the anchors its validation scores:

1. Before training, per vocabulary size: the share of the target's tokens inside the vocabulary, and the ceiling τ
   of a drafter that is right whenever the token is inside (``hyflash.train.draft_vocab_ceiling``). Comparing a
   size's ceiling with the full vocabulary's bounds what that size can cost.
2. For trained runs: held-out τ̂, and τ̂ counting every out-of-vocabulary token as drafted right
   (``val_tau_vocab_free``): the gap is at most what the reduced vocabulary costs that drafter.

    python benchmarks/draft_vocab_cost.py --recipe gemma3-hyflash --data /work/data/gemma/features \
        --sizes 4096,8192,16384,32768,65536,0 [RUN_DIR ...]
"""

import argparse
import json

import torch

from common import machine_line
from hyflash.drafter.model import from_pretrained
from hyflash.target import Target
from hyflash.train import TrainConfig, draft_vocab_ceiling, evaluate, load_recipe, open_store, split_store


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="*", help="training run folders (train_config.json and final/) to score as well")
    p.add_argument("--recipe", required=True, help="recipe whose split, crops and anchors to use")
    p.add_argument("--data", required=True, help="feature store")
    p.add_argument("--sizes", default="4096,8192,16384,32768,65536,0", help="vocabulary sizes (0: the full one)")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = load_recipe(args.recipe)
    cfg.data = args.data
    store = open_store(cfg.data)
    target = Target.load(cfg.target, "bf16", feature_layers=cfg.drafter.target_layers)
    vocab_size = target.vocab_size
    train_idx, val_idx = split_store(store, cfg)
    print(machine_line())
    print(f"recipe {args.recipe}  store {args.data}  train {len(train_idx)} / held-out {len(val_idx)} sequences")
    print("draft_vocab  coverage  ceiling_tau  anchors")
    sizes = [int(s) for s in args.sizes.split(",")]
    for r in draft_vocab_ceiling(store, train_idx, val_idx, cfg, sizes, vocab_size):
        print(f"{r['draft_vocab']:>11,}  {r['coverage']:.4f}  {r['ceiling_tau']:.3f}  {r['anchors']}")
    if args.runs:
        print("run  draft_vocab  val_tau  standard_error  val_tau_vocab_free")
    for run in args.runs:
        rcfg = TrainConfig.from_dict(json.load(open(f"{run}/train_config.json")))
        rcfg.data = args.data
        _, val = split_store(store, rcfg)
        drafter = from_pretrained(f"{run}/final", target, dtype=torch.float32)
        r = evaluate(drafter, store, val, rcfg)
        size = drafter.config.draft_vocab_size or target.vocab_size
        print(f"{run}  {size:,}  {r['val_tau']:.4f}  {r['val_tau_se']:.4f}  {r.get('val_tau_vocab_free', r['val_tau']):.4f}")


if __name__ == "__main__":
    main()
