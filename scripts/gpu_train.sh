#!/usr/bin/env bash
# Train the SmolLM2 HyFlash drafter on one GPU for a wall-clock budget, from the files scripts/device_kit.sh put in
# .device/ (the target's GGUF in two parts, the tokenised sequences, pure-Python packages). The target computes
# features online (no 13 GB cache to move). Run from the repository root:
#   bash scripts/gpu_train.sh check            # versions, a CUDA training test on a tiny model (~1 min)
#   bash scripts/gpu_train.sh train SECONDS    # join + convert the target, time 12 steps, train to fit SECONDS
# Results land in $OUT/hyflash-gpu/ (or ./runs/hyflash-gpu without $OUT): final/ (the drafter, bf16 safetensors),
# log.jsonl, loss.png, train_config.json and the exact command, to be evaluated on the CPU with bench_mtbench.py.
#
# With the device tool (15 minutes of device time in all, start-up included; one call at most 600 s; a call carries
# at most 64 MiB of ignored files; the machine stays warm ~30 s between calls, so issue the second call at once):
#   1. bash scripts/device_kit.sh data/sequences.jsonl              (here, once)
#   2. run  "bash scripts/gpu_train.sh check"         carry [.device/pylib, .device/sequences.jsonl, .device/gguf.part0]
#   3. run  "bash scripts/gpu_train.sh train 500"     carry [.device/gguf.part1], timeout_s 600
#   4. copy $OUT/hyflash-gpu/final next to the shipped drafter's stages, then on the CPU:
#      python benchmarks/bench_mtbench.py --drafters "none,ngram,auto,new=runs/hyflash-gpu/final" --limit 80
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}:$PWD/.device/pylib"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
MODE=${1:-check}
RESULTS=${OUT:-$PWD/runs}/hyflash-gpu
TARGET_DIR=.device/SmolLM2-135M-Instruct

python scripts/device_versions.py

if [ "$MODE" = check ]; then
  ls -la .device || true
  if python -c "import pytest" 2>/dev/null; then
    python -m pytest -q -p no:cacheprovider tests/test_data_pipeline.py -k "gpu or online" 2>&1 | tail -5
  else
    echo "pytest is not installed here: the CUDA training test was not run"
  fi
  exit 0
fi

BUDGET=${2:?usage: gpu_train.sh train SECONDS}
START=$(date +%s)
if [ ! -f "$TARGET_DIR/config.json" ]; then
  cat .device/gguf.part0 .device/gguf.part1 > .device/target.gguf
  python - <<'PY'
from pathlib import Path
from hyflash.target import EMBEDDED_TARGETS, _sha256, convert_gguf
gguf = Path(".device/target.gguf")
assert _sha256(gguf) == EMBEDDED_TARGETS["smollm2-135m"]["sha256"], "the joined GGUF has the wrong sha256"
convert_gguf(gguf, Path(".device/SmolLM2-135M-Instruct"))
PY
fi
# DEVICE and EXTRA (more --set FIELD=VALUE) let the same script run a small smoke test on a CPU
COMMON=(--recipe smollm2-hyflash-gpu --data .device/sequences.jsonl --set target="$TARGET_DIR" --device "${DEVICE:-cuda}"
        ${EXTRA:-})

# 12 steps to time this GPU; the first 4 (CUDA start-up, allocator) are left out of the rate
rm -rf /tmp/hyflash-probe
python -m hyflash.train "${COMMON[@]}" --steps 12 --set eval_every=1000000 --out /tmp/hyflash-probe
STEPS=$(python - "$BUDGET" "$START" <<'PY'
import json, sys, time
budget, start = float(sys.argv[1]), float(sys.argv[2])
log = [json.loads(l) for l in open("/tmp/hyflash-probe/log.jsonl")]
rate = (log[-1]["elapsed"] - log[3]["elapsed"]) / (len(log) - 4)  # seconds per step
left = budget - (time.time() - start) - 60  # a minute for start-up, validation and the export
steps = max(20, int(0.85 * left / rate))
print(f"{rate:.3f} s/step; {left:.0f} s left -> {steps} steps", file=sys.stderr)
print(steps)
PY
)
RUN=/tmp/hyflash-gpu
CMD=(python -m hyflash.train "${COMMON[@]}" --steps "$STEPS" --out "$RUN")
echo "${CMD[*]}"
LEFT=$(( BUDGET - ($(date +%s) - START) - 20 ))
mkdir -p "$RESULTS"
echo "${CMD[*]}" > "$RESULTS/command.txt"
if ! timeout "$LEFT" "${CMD[@]}"; then  # over time: keep what the last checkpoint holds
  echo "stopped before step $STEPS; exporting the latest checkpoint" | tee -a "$RESULTS/command.txt"
  python -m hyflash.train --export --out "$RUN" || echo "no checkpoint was written: nothing to export"
fi
for f in final log.jsonl train_config.json loss.png; do [ -e "$RUN/$f" ] && cp -r "$RUN/$f" "$RESULTS"/; done
cp /tmp/hyflash-probe/log.jsonl "$RESULTS/probe_log.jsonl"
tail -n 3 "$RUN/log.jsonl" 2>/dev/null || true
