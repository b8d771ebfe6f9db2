#!/usr/bin/env bash
# Prepare .device/ (ignored by git) for training the SmolLM2 drafter on a lent GPU machine that has torch and
# transformers but no network, where one call carries at most 64 MiB of ignored files:
#   .device/pylib/          pure-Python packages the machine may lack (click, gguf, pyyaml, accelerate), put last on PYTHONPATH
#   .device/sequences.jsonl the tokenised training sequences (hyflash.data.sequences output, ~10 MB)
#   .device/gguf.part0, .device/gguf.part1   the target's 98 MB GGUF in two pieces (joined and checked there)
# Then: run `bash scripts/gpu_train.sh check` carrying [.device/pylib, .device/sequences.jsonl, .device/gguf.part0],
# and at once `bash scripts/gpu_train.sh train SECONDS` carrying [.device/gguf.part1] (see scripts/gpu_train.sh).
# Usage: bash scripts/device_kit.sh SEQUENCES_JSONL
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:?usage: device_kit.sh SEQUENCES_JSONL}
mkdir -p .device
rm -rf .device/pylib && python -m pip install -q --no-deps --target .device/pylib click gguf pyyaml accelerate
cp "$SEQ" .device/sequences.jsonl
GGUF=$(python -c "from hyflash.target import EMBEDDED_TARGETS, _find_embedded_gguf; print(_find_embedded_gguf(EMBEDDED_TARGETS['smollm2-135m']))")
split -b 50M -d -a 1 "$GGUF" .device/gguf.part
du -sh .device/* | sed 's/^/device kit: /'
