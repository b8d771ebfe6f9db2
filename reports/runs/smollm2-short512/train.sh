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
# What ran: `SWA=1 STEPS=600 train.sh`, then `FAMILY=copy SWA=1 STEPS=600 train.sh`, then (after copy_data.sh)
# `FAMILY=copy512 SWA=1 STEPS=600 train.sh`.
STEPS=${STEPS:-600}
cd /work/main && . .venv/bin/activate
D="--data /work/data/feat/docs300"
declare -A RECIPE
if [ "${FAMILY:-general}" = copy ] || [ "${FAMILY:-general}" = copy512 ]; then
  OUT=/work/runs/copy-short512
  if [ "$FAMILY" = copy512 ]; then
    OUT=/work/runs/copy512-short512
    D="$D --data /work/data/copy512/feat/near --data /work/data/copy512/feat/far"
  fi
  RECIPE=([hyflash]=smollm2-copy-noslot-copymemtok-dpfp4 [full]=smollm2-copy-full-noslot-copytok
          [swa]=smollm2-copy-swa-noslot-copytok)
else
  OUT=/work/runs/short512
  RECIPE=([hyflash]=smollm2-hyflash [full]=smollm2-full [swa]=smollm2-swa)
fi
mkdir -p $OUT
RUNS="hyflash full"
[ "${SWA:-0}" = 1 ] && RUNS="$RUNS swa"
for r in $RUNS; do
  (hyflash train --recipe ${RECIPE[$r]} $D --set seq_len=512 --set steps=$STEPS --set eval_every=100 \
     --set bf16=false --threads 1 ${STOP:+--stop-at $STOP} --out $OUT/$r >> $OUT-$r.log 2>&1; echo "rc $?" >> $OUT-$r.log) &
done
wait
for r in $RUNS; do hyflash train --export --out $OUT/$r >> $OUT-$r.log 2>&1; done
echo "done" >> $OUT-hyflash.log
