"""Where feature extraction's time goes (``hyflash.data.features.sequence_outputs``) for one sequence: the model's
layers, the LM head over the whole vocabulary, the fp32 copy, top-k and argmax; and the same head, top-k and argmax
computed in row chunks (checked to give identical results). Seconds, the minimum over ``--repeats``.

    python benchmarks/bench_features.py --target gemma3-270m --sequences SEQUENCES.jsonl [--tokens 2048]
"""

import argparse
import json
import time

import torch

from common import machine_line
from hyflash.target import Target


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="gemma3-270m")
    ap.add_argument("--sequences", required=True, help="a hyflash.data.sequences JSONL; its first sequence is used")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256, help="rows per chunk in the chunked variant")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(args.target, dtype="bf16")
    with open(args.sequences, encoding="utf-8") as f:
        ids = json.loads(f.readline())["ids"][:args.tokens]
    x = torch.tensor(ids).reshape(1, -1)
    model = target.model
    if getattr(getattr(model.config, "text_config", model.config), "final_logit_softcapping", None):
        raise SystemExit("this target caps its logits; the head below would leave that out")
    print(machine_line())
    names = ["layers", "head", "fp32 copy", "top-32", "argmax", "head+top-32+argmax in chunks"]
    best = {n: float("inf") for n in names}
    with torch.inference_mode():
        for _ in range(args.repeats):
            marks = [time.perf_counter()]
            h = model.model(input_ids=x, use_cache=False, output_hidden_states=True).last_hidden_state[0]
            marks.append(time.perf_counter())
            logits = model.lm_head(h)
            marks.append(time.perf_counter())
            full = logits.float()
            marks.append(time.perf_counter())
            vals, top = full.topk(32, dim=-1)
            marks.append(time.perf_counter())
            labels = full.argmax(-1)
            marks.append(time.perf_counter())
            same = True
            for k in range(0, len(h), args.chunk):
                part = model.lm_head(h[k:k + args.chunk]).float()
                v, t = part.topk(32, dim=-1)
                same &= torch.equal(v, vals[k:k + args.chunk]) and torch.equal(t, top[k:k + args.chunk]) \
                    and torch.equal(part.argmax(-1), labels[k:k + args.chunk])
            marks.append(time.perf_counter())
            for n, a, b in zip(names, marks, marks[1:]):
                best[n] = min(best[n], b - a)
    print(f"# {target.name}, {len(ids)} tokens, vocabulary {target.vocab_size:,}, {args.threads} threads, "
          f"chunks of {args.chunk} rows identical: {same}")
    for n in names:
        print(f"{n:32s} {best[n]:6.2f} s")
    whole = sum(best[n] for n in names[:5])
    print(f"{'all (whole head)':32s} {whole:6.2f} s = {len(ids) / whole:.0f} tokens/s")


if __name__ == "__main__":
    main()
