#!/bin/bash
# second stage for seed 0: from the step-600 exports, 600 more steps, lr 5e-4 cosine to 5e-5, new data order (seed 10),
# the same held-out sequences (split_seed 0); one process per drafter, one thread each
cd /work/main && . .venv/bin/activate
D=/work/data/copy/feat
for r in hyflash noslot; do
  (hyflash train --recipe smollm2-copy-$r-copytok --data $D/near --data $D/far --data $D/docs --init-from /work/runs/mix600/s0-$r/final \
     --set bf16=false --set seed=10 --set lr=5e-4 --set min_lr=5e-5 --threads 1 ${STOP:+--stop-at $STOP} --out /work/runs/mix2-s0/$r \
     >> /work/runs/mix2-s0-$r.log 2>&1; echo "rc $?" >> /work/runs/mix2-s0-$r.log) &
done
wait
for r in hyflash noslot; do hyflash train --export --out /work/runs/mix2-s0/$r >> /work/runs/mix2-s0-$r.log 2>&1; done
echo stage2 done >> /work/runs/mix2-s0-hyflash.log
