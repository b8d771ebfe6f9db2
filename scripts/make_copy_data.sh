#!/bin/bash
# The copy-only SmolLM2 data of recipes/smollm2-copy-*.json, rebuilt from the pinned offline sources:
#   split -> document sequences (900K tokens) -> two disjoint pools of 1,536+-token sequences (the first 96 skipped,
#   then 154 near, 163 far) -> recall sequences (near copies only / far copies only) -> target features (96 each).
# Also a store of plain documents (the first 96 long sequences, which the pools skip; every position supervised), for
# the runs that mix copies with ordinary text (--data .../feat/docs).
# The pools' sha256 are those reports/runs/smollm2-copy/recall_*.meta.json record (the documents' is recorded here);
# the script stops if any differs.
#
#   bash scripts/make_copy_data.sh DATA_DIR            # everything (features: ~14 min a store on a 2-core EPYC)
#   bash scripts/make_copy_data.sh DATA_DIR --no-features
#
# Then: hyflash train --recipe smollm2-copy-hyflash ... --data DATA_DIR/copy/feat/near --data DATA_DIR/copy/feat/far
set -euo pipefail
DATA=${1:?usage: make_copy_data.sh DATA_DIR [--no-features]}
FEATURES=1
[ "${2:-}" = "--no-features" ] && FEATURES=0
mkdir -p "$DATA/copy"
[ -f "$DATA/split/train_documents.jsonl" ] || python -m hyflash.data.split --out "$DATA/split"
python -m hyflash.data.sequences --documents "$DATA/split/train_documents.jsonl" --out "$DATA/copy/docs.jsonl" \
    --doc-tokens 900000
python - "$DATA/copy" <<'EOF'
import hashlib, json, sys
from pathlib import Path

out = Path(sys.argv[1])
seqs = [json.loads(line) for line in (out / "docs.jsonl").open()]
long = [s for s in seqs if len(s["ids"]) >= 1536]
if len(long) != 413:
    sys.exit(f"expected 413 sequences of 1,536+ tokens, got {len(long)}: the split or tokenizer differs")
expect = {"near_pool": "0b3459c43fe8969058110b90fe4151c5b86d9c2ef22d870433f89700d9ef9121",
          "far_pool": "048a69d8d4f5cf627faca94fcd58d0974a4fb6c476c5907dbf6e85d27dd78051",
          "docs96": "bd6bf6a2878fa6881a4fc86bf45e31275ea48b09d210034a0c8f621cf732ae84"}
for name, part in (("near_pool", long[96:250]), ("far_pool", long[250:]), ("docs96", long[:96])):
    text = "".join(json.dumps(s) + "\n" for s in part)
    (out / f"{name}.jsonl").write_text(text)
    got = hashlib.sha256(text.encode()).hexdigest()
    if got != expect[name]:
        sys.exit(f"{name}: sha256 {got}, expected {expect[name]}")
    print(f"{name}: {len(part)} sequences, sha256 as recorded")
EOF
python -m hyflash.data.recall --sequences "$DATA/copy/near_pool.jsonl" --out "$DATA/copy/near.jsonl" --count 128 \
    --min-len 1536 --seed 0 --far-fraction 0
python -m hyflash.data.recall --sequences "$DATA/copy/far_pool.jsonl" --out "$DATA/copy/far.jsonl" --count 128 \
    --min-len 1536 --seed 1 --far-fraction 1
if [ "$FEATURES" = 1 ]; then
    for x in near far; do
        python -m hyflash.data.features --sequences "$DATA/copy/$x.jsonl" --out "$DATA/copy/feat/$x" --limit 96
    done
    python -m hyflash.data.features --sequences "$DATA/copy/docs96.jsonl" --out "$DATA/copy/feat/docs" --limit 96
fi
