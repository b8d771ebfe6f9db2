#!/bin/bash
# usage: copy_data.sh — copy data built for the 512-token training length, for FAMILY=copy512 of train.sh: the
# document sequences that docs300 (the plain documents of the 512-token runs) leaves out — sequences 300..485 of
# scripts/make_copy_data.sh's docs.jsonl — cut into 512-token chunks; the first 93 sequences' chunks make the pool of
# near copies (source at most 224 tokens back: inside the drafter's 256-token window), the rest the pool of far copies
# (source ending at least 272 tokens back: past the window, so that only the memory can carry it), 192 recall
# sequences of 512 tokens each, then the target's features (hyflash.data.features) of each.
set -euo pipefail
cd /work/main && . .venv/bin/activate
C=/work/data/copy512
mkdir -p $C
python - <<'PY'
import json
seqs = [json.loads(line) for line in open("/work/data/copy/docs.jsonl")]
if len(seqs) != 486:
    raise SystemExit(f"expected 486 document sequences, got {len(seqs)}: the split or tokenizer differs")
for name, part in (("near_pool", seqs[300:393]), ("far_pool", seqs[393:])):
    with open(f"/work/data/copy512/{name}.jsonl", "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in part)
PY
COMMON="--count 192 --min-len 512 --chunk 512 --max-len 512 --copy-len 32 96 --gap 32 128"
python -m hyflash.data.recall --sequences $C/near_pool.jsonl --out $C/near.jsonl $COMMON --seed 0 --far-fraction 0 \
    --near-max 224 --lead 96 160
python -m hyflash.data.recall --sequences $C/far_pool.jsonl --out $C/far.jsonl $COMMON --seed 1 --far-fraction 1 \
    --far-min 272 --lead 288 384
for x in near far; do
  python -m hyflash.data.features --sequences $C/$x.jsonl --out $C/feat/$x --threads 1 &
done
wait
for x in near far; do python -m hyflash.data.recall --check-features $C/feat/$x; done
