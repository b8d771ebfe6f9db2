#!/usr/bin/env bash
# Train the Gemma 3 drafters side by side on one GPU (one process, one target forward per batch shared by every
# variant: `hyflash train` with several recipes; equal data, steps and seeds), from
# the files scripts/device_kit_gemma3.sh put in .device/: the target's GGUF (xz, in parts), the tokenised
# sequences, the draft vocabulary and the pure-Python packages the machine may lack. The target computes features
# online. Run from the repository root:
#   bash scripts/gpu_gemma3.sh check            # versions, the CUDA training test on a tiny model (~1 min)
#   bash scripts/gpu_gemma3.sh train SECONDS    # join + convert the target, time 12 steps, train to fit SECONDS
#   bash scripts/gpu_gemma3.sh continue STEPS SECONDS  # a second stage from the train call's drafters (lr 5e-4 ->
#                                                #   5e-5, seed 1), stopped and exported after SECONDS
#   bash scripts/gpu_gemma3.sh fetch K [results|results2]  # parts a call could not return: 4 per call, K = 1, 2
# Results: .device/results/gemma3-gpu.tar (each variant's final/, log.jsonl, train_config.json, loss.png, the probe
# log and the exact commands), cut into 16 MiB parts .device/results/part-NN. A call returns at most 64 MiB: the
# train call brings parts 00-02 and the tar's sha256, `fetch 1` parts 03-06, `fetch 2` parts 07-10. Join them
# here with `cat part-* > gemma3-gpu.tar` and check the sha256. `continue` does the same in .device/results2/.
# VARIANTS (default "hyflash full swa noslot"; also mem512 depth1 depth3 gdn floor, recipes/gemma3-*-gpu.json: all nine
# share each batch), DEVICE (default cuda) and EXTRA (more --set FIELD=VALUE) let the same script run a small smoke
# test on a CPU. More variants mean more result parts: `fetch K` for K = 1, 2, ... until none are left.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
MODE=${1:-check}
KIT=$PWD/.device
RESULTS=$KIT/results
TARGET_DIR=$KIT/gemma-3-270m
VARIANTS=(${VARIANTS:-hyflash full swa noslot})
OUT_DIR=${OUT:-$PWD/runs/gpu-out}
mkdir -p "$OUT_DIR"

# pure-Python packages the machine lacks (gguf), installed once per machine
if ls "$KIT"/whl/*.whl >/dev/null 2>&1 && [ ! -f /tmp/hyflash-site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hyflash-site \
    "$KIT"/whl/*.whl && touch /tmp/hyflash-site/.done
fi
[ -d /tmp/hyflash-site ] && export PYTHONPATH="$PYTHONPATH:/tmp/hyflash-site"

if [ "$MODE" = fetch ]; then
  K=${2:?usage: gpu_gemma3.sh fetch K [results|results2]}
  ls "$KIT/${3:-results}"/part-* | tail -n +$(( 4 * K )) | head -n 4 | xargs -r -I{} cp {} "$OUT_DIR"/
  ls -la "$OUT_DIR"
  exit 0
fi

pack() {  # pack RESULTS_DIR NAME RUN: each variant's run in /tmp/RUN/ into RESULTS_DIR/NAME.tar, cut into 16 MiB parts
  local results=$1 name=$2 run=/tmp/$3 pack=/tmp/$2
  rm -rf "$pack" && mkdir -p "$pack" "$results"
  for v in "${VARIANTS[@]}"; do
    mkdir -p "$pack/$v"
    for f in final log.jsonl train_config.json loss.png; do
      [ -e "$run/gemma3-$v-gpu/$f" ] && cp -r "$run/gemma3-$v-gpu/$f" "$pack/$v/"
    done
    [ -e "$run.probe/gemma3-$v-gpu/log.jsonl" ] && cp "$run.probe/gemma3-$v-gpu/log.jsonl" "$pack/$v/probe_log.jsonl"
    echo "== $v"; tail -n 1 "$run/gemma3-$v-gpu/log.jsonl" 2>/dev/null | cut -c1-400 || true
  done
  for f in command.txt; do [ -e "$run.$f" ] && cp "$run.$f" "$pack/$f"; done
  tail -c 6000 "$run.log" > "$pack/stderr_tail.txt"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$pack/gpu.txt" 2>/dev/null || true
  tar cf "$results/$name.tar" -C /tmp "$name"
  rm -f "$results"/part-*
  split -b 16M -d -a 2 "$results/$name.tar" "$results/part-"
  sha256sum "$results/$name.tar" | tee "$OUT_DIR/$name.tar.sha256"
  ls "$results"/part-* | head -n 3 | xargs -I{} cp {} "$OUT_DIR"/
  ls -la "$results" "$OUT_DIR"
}

train_for() {  # train_for RUN SECONDS STEPS COMMAND...: /tmp/RUN.{command.txt,log}; a run stopped by the time limit
  local run=/tmp/$1 seconds=$2 steps=$3; shift 3  # is exported from its latest checkpoints
  echo "$@" | tee "$run.command.txt"
  timeout "$seconds" "$@" > "$run.log" 2>&1 \
    || { echo "stopped before step $steps; exporting the latest checkpoints" | tee -a "$run.command.txt"
         python3 -m hyflash.train --export --out "$run" >> "$run.log" 2>&1 || echo "nothing to export"; }
}

recipes() {  # --recipe gemma3-V-gpu for every variant: one process trains them all
  for v in "${VARIANTS[@]}"; do echo --recipe "gemma3-$v-gpu"; done
}

if [ "$MODE" = continue ]; then  # the train call's target, data and drafters are still on this machine
  STEPS=${2:?usage: gpu_gemma3.sh continue STEPS SECONDS}; LEFT=${3:?seconds for the run}
  START=$(date +%s)
  rm -rf /tmp/s2
  INIT=$(for v in "${VARIANTS[@]}"; do echo --init-from "/tmp/run/gemma3-$v-gpu/final"; done)
  train_for s2 "$LEFT" "$STEPS" python3 -m hyflash.train $(recipes) $INIT --set target=$TARGET_DIR \
    --set init_from_target=false --set lr=0.0005 --set min_lr=0.00005 --set warmup=0.02 --set seed=1 \
    --set eval_every=1000000 --set ckpt_every=25 --device ${DEVICE:-cuda} ${EXTRA:-} --steps $STEPS --out /tmp/s2
  pack "$KIT/results2" gemma3-gpu2 s2
  echo "done after $(( $(date +%s) - START )) s"
  exit 0
fi

python3 scripts/device_versions.py

if [ "$MODE" = check ]; then
  du -sh "$KIT"/* 2>/dev/null || true; du -sh --exclude=.device --exclude=.git . ; command -v xz nvidia-smi || true
  nproc; free -g | head -2
  python3 -m pytest -q -p no:cacheprovider tests/test_data_pipeline.py -k "gpu or online" 2>&1 | tail -4
  exit 0
fi

BUDGET=${2:?usage: gpu_gemma3.sh train SECONDS}
START=$(date +%s)
if [ ! -f "$TARGET_DIR/config.json" ]; then
  if command -v xz >/dev/null; then cat "$KIT"/gguf.xz.part* | xz -d > "$KIT/target.gguf"
  else cat "$KIT"/gguf.xz.part* | python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" > "$KIT/target.gguf"; fi
  python3 - "$KIT" <<'PY'
import sys
from pathlib import Path
from hyflash.target import EMBEDDED_TARGETS, _sha256, convert_gguf
kit = Path(sys.argv[1])
gguf = kit / "target.gguf"
assert _sha256(gguf) == EMBEDDED_TARGETS["gemma3-270m"]["sha256"], "the joined GGUF has the wrong sha256"
convert_gguf(gguf, kit / "gemma-3-270m")
PY
  rm -f "$KIT/target.gguf"
fi
[ -d "$KIT/gemma3" ] || tar xzf "$KIT/gemma3.tar.gz" -C "$KIT"
echo "target and data ready after $(( $(date +%s) - START )) s"

COMMON="$(recipes) --set target=$TARGET_DIR --set draft_vocab_from=$KIT/gemma3/draft_vocab.json --device ${DEVICE:-cuda}
  ${EXTRA:-}"

# 12 steps of every variant in one process, timed as they will run; steps 1-4 (CUDA start-up, the allocator) are
# left out of the rate. Each log line's data_s is the shared batch (the target's forward), step_s adds one drafter.
rm -rf /tmp/run.probe
python3 -m hyflash.train $COMMON --steps 12 --set eval_every=1000000 --set val_fraction=0 --out /tmp/run.probe \
  > /tmp/run.probe.log 2>&1
tail -n 2 /tmp/run.probe.log
STEPS=$(python3 - "$BUDGET" "$START" "${VARIANTS[@]}" <<'PY'
import json, sys, time
budget, start, variants = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
logs = {v: [json.loads(l) for l in open(f"/tmp/run.probe/gemma3-{v}-gpu/log.jsonl")] for v in variants}
log = logs[variants[0]]
rate = (log[-1]["elapsed"] - log[3]["elapsed"]) / (len(log) - 4)  # seconds per step, all variants together
for v, lg in logs.items():
    data = sorted(r["data_s"] for r in lg[4:]); own = sorted(r["step_s"] - r["data_s"] for r in lg[4:])
    print(f"{v}: batch {data[len(data) // 2]:.3f} s, own step {own[len(own) // 2]:.3f} s (medians)", file=sys.stderr)
left = budget - (time.time() - start) - 75  # start-up, validations and the export
steps = max(20, int(0.85 * left / rate))
print(f"{rate:.3f} s/step for all; {left:.0f} s left -> {steps} steps", file=sys.stderr)
print(steps)
PY
)
EVAL=$(( STEPS / 3 > 0 ? STEPS / 3 : 1 ))
LEFT=$(( BUDGET - ($(date +%s) - START) - 25 ))
if [ "$LEFT" -lt 60 ]; then echo "the probe left ${LEFT} s of the budget; training for 60 s anyway"; LEFT=60; fi
rm -rf /tmp/run
train_for run "$LEFT" "$STEPS" python3 -m hyflash.train $COMMON --steps $STEPS --set eval_every=$EVAL --out /tmp/run
pack "$RESULTS" gemma3-gpu run
echo "done after $(( $(date +%s) - START )) s"
