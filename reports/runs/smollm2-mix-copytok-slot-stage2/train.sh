#!/bin/bash
# usage: [S=seed] [STOP=step] train.sh — the second stage for one seed's pair (S=0, the default, is the run kept here):
# from the step-600 exports, 600 more steps, lr 5e-4 cosine to 5e-5, a new data order (seed 10 + S) shared by both,
# the same held-out sequences (split_seed 0); one process per drafter, one thread each; STOP stops both at that step
S=${S:-0}
cd /work/main && . .venv/bin/activate
D=/work/data/copy/feat
for r in hyflash noslot; do
  (hyflash train --recipe smollm2-copy-$r-copytok --data $D/near --data $D/far --data $D/docs --init-from /work/runs/mix600/s$S-$r/final \
     --set bf16=false --set seed=$((10 + S)) --set lr=5e-4 --set min_lr=5e-5 --threads 1 ${STOP:+--stop-at $STOP} --out /work/runs/mix2-s$S/$r \
     >> /work/runs/mix2-s$S-$r.log 2>&1; echo "rc $?" >> /work/runs/mix2-s$S-$r.log) &
done
wait
for r in hyflash noslot; do hyflash train --export --out /work/runs/mix2-s$S/$r >> /work/runs/mix2-s$S-$r.log 2>&1; done
echo stage2 done >> /work/runs/mix2-s$S-hyflash.log
