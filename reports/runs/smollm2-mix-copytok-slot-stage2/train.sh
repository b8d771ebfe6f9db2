#!/bin/bash
# usage: [S=seed] [STAGE=n] [STOP=step] train.sh — one more 600-step stage for one seed's slot / no-slot pair.
# Stage 2 (the default) starts from the first stage's step-600 exports, stage n from stage n-1's exports; each stage is
# the same warm restart: lr 5e-4 cosine to 5e-5, a fresh optimiser, a new data order (seed 10 × (n − 1) + S) shared by
# both drafters, the same held-out sequences (split_seed 0); one process per drafter, one thread each.
# S=0 STAGE=2 is the run kept here; STOP stops both at that step (rerun without it to resume).
S=${S:-0}
STAGE=${STAGE:-2}
cd /work/main && . .venv/bin/activate
D=/work/data/copy/feat
if [ "$STAGE" = 2 ]; then FROM=/work/runs/mix600/s$S-; else FROM=/work/runs/mix$((STAGE - 1))-s$S/; fi
OUT=/work/runs/mix$STAGE-s$S
for r in hyflash noslot; do
  (hyflash train --recipe smollm2-copy-$r-copytok --data $D/near --data $D/far --data $D/docs --init-from $FROM$r/final \
     --set bf16=false --set seed=$((10 * (STAGE - 1) + S)) --set lr=5e-4 --set min_lr=5e-5 --threads 1 \
     ${STOP:+--stop-at $STOP} --out $OUT/$r >> $OUT-$r.log 2>&1; echo "rc $?" >> $OUT-$r.log) &
done
wait
for r in hyflash noslot; do hyflash train --export --out $OUT/$r >> $OUT-$r.log 2>&1; done
echo "stage $STAGE done" >> $OUT-hyflash.log
