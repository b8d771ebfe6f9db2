#!/bin/bash
# usage: [FAMILY=copy] [SWA=1] [STEPS=n] [STOP=step] train.sh — HyFlash and full attention (and, with SWA=1, the sliding
# window) trained alike at a 512-token training length on plain documents only (the first 300 document sequences of
# scripts/make_copy_data.sh's docs.jsonl, every position supervised), cropped at 512 tokens, fp32, one process per
# drafter, one thread each, the same data order (seed 0). STOP stops every run at that step (rerun without it to
# resume).
# FAMILY=general (default): the general recipes recipes/smollm2-{hyflash,full,swa}.json, into /work/runs/short512.
# FAMILY=copy: the no-slot copy family at equal parameters — the DPFP copy-memory drafter
# (smollm2-copy-noslot-copymemtok-dpfp4) and its full-attention and sliding-window controls
# (smollm2-copy-{full,swa}-noslot-copytok) — on the same documents, into /work/runs/copy-short512.
# FAMILY=copy512: the same three recipes on the same documents mixed with copy data built for this length
# (copy_data.sh: 192 sequences of near copies and 192 of far copies, 512 tokens each), into /work/runs/copy512-short512.
# FAMILY=copy512s2: a second stage of copy512 — each drafter starts from its copy512 weights (final/) and trains STEPS
# more steps on the same mixture (the recipe's schedule again, data order seed 1, the same held-out sequences), into
# /work/runs/copy512s2-short512. FAMILY=copy512s3: a third stage, from the copy512s2 weights (data order seed 2), into
# /work/runs/copy512s3-short512.
# RUNS="..." picks the runs (default: hyflash full, and swa with SWA=1); in the copy families the run `slot` is the
# HyFlash drafter *with* attention among the draft slots (smollm2-copy-hyflash-copymemtok-dpfp4, otherwise the same
# recipe as `hyflash`), for the nearby-evidence probe.
# What ran: `SWA=1 STEPS=600 train.sh`, then `FAMILY=copy SWA=1 STEPS=600 train.sh`, then (after copy_data.sh)
# `FAMILY=copy512 SWA=1 STEPS=600 train.sh`, then `FAMILY=copy512s2 SWA=1 STEPS=600 train.sh`; then
# `FAMILY=copy512 RUNS=slot STEPS=600 train.sh` and `FAMILY=copy512s2 RUNS=slot STEPS=600 train.sh`; then
# `FAMILY=copy512s3 RUNS="hyflash slot" STEPS=600 train.sh`, then `FAMILY=copy512s3 RUNS="full swa" STEPS=600 train.sh`.
# On a new machine (2026-12-08, its own data and features) `SWA=1 STEPS=600 train.sh` again: runs/smollm2-short512r2/.
STEPS=${STEPS:-600}
cd /work/main && . .venv/bin/activate
D="--data /work/data/feat/docs300"
COPY512="--data /work/data/copy512/feat/near --data /work/data/copy512/feat/far"
declare -A RECIPE=([hyflash]=smollm2-copy-noslot-copymemtok-dpfp4 [full]=smollm2-copy-full-noslot-copytok
                   [swa]=smollm2-copy-swa-noslot-copytok [slot]=smollm2-copy-hyflash-copymemtok-dpfp4)
INIT_FROM=""  # a later stage: each run starts from INIT_FROM/<run>/final, data order seed SEED
case "${FAMILY:-general}" in
  general) OUT=/work/runs/short512; RECIPE=([hyflash]=smollm2-hyflash [full]=smollm2-full [swa]=smollm2-swa [slot]=) ;;
  copy) OUT=/work/runs/copy-short512 ;;
  copy512) OUT=/work/runs/copy512-short512; D="$D $COPY512" ;;
  copy512s2) OUT=/work/runs/copy512s2-short512; D="$D $COPY512"; INIT_FROM=/work/runs/copy512-short512; SEED=1 ;;
  copy512s3) OUT=/work/runs/copy512s3-short512; D="$D $COPY512"; INIT_FROM=/work/runs/copy512s2-short512; SEED=2 ;;
  *) echo "unknown FAMILY=$FAMILY" >&2; exit 2 ;;
esac
mkdir -p $OUT
if [ -z "$RUNS" ]; then RUNS="hyflash full"; [ "${SWA:-0}" = 1 ] && RUNS="$RUNS swa"; fi
for r in $RUNS; do [ -n "${RECIPE[$r]}" ] || { echo "no run $r in FAMILY=${FAMILY:-general}" >&2; exit 2; }; done
for r in $RUNS; do
  (hyflash train --recipe ${RECIPE[$r]} $D ${INIT_FROM:+--init-from $INIT_FROM/$r/final --set seed=$SEED} \
     --set seq_len=512 --set steps=$STEPS --set eval_every=100 --set bf16=false --threads 1 ${STOP:+--stop-at $STOP} --out $OUT/$r >> $OUT-$r.log 2>&1; echo "rc $?" >> $OUT-$r.log) &
done
wait
for r in $RUNS; do hyflash train --export --out $OUT/$r >> $OUT-$r.log 2>&1; done
echo "done" >> $OUT-${RUNS%% *}.log  # in the first run's log
