#!/bin/bash
# usage: mix.sh STOP_AT  — both seeds side by side, one process each
cd /work/main && . .venv/bin/activate
D=/work/data/copy/feat
for s in 0 1; do
  (hyflash train --recipe smollm2-copy-hyflash-copytok --recipe smollm2-copy-noslot-copytok --data $D/near --data $D/far --data $D/docs --set bf16=false --set seed=$s --threads 1 --stop-at $1 --out /work/runs/mix-s$s >> /work/runs/mix-s$s.log 2>&1; echo "rc $?" >> /work/runs/mix-s$s.log) &
done
wait
for s in 0 1; do hyflash train --export --out /work/runs/mix-s$s >> /work/runs/mix-s$s.log 2>&1; done
echo done >> /work/runs/mix-s0.log
