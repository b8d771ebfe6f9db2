#!/bin/bash
# usage: [FAMILY=copy] [SKIP=n] [T=temperature] eval.sh SUITE... — train.sh's three drafters on each suite (buckets
# 0.5–1K to 4–8K, 5 items a bucket, greedy, 64 new tokens), one eval process per suite side by side (one thread each),
# in the AVX2 environment of the other SmolLM2 long-context reports. SKIP=5: the next five items of each bucket
# (--skip), none repeated; T=1: at temperature 1.0 instead of greedy. FAMILY=copy: the copy family's three drafters
# (labels hyflash-c512, full-c512, swa-c512) into /work/evals/copy-short512-*; FAMILY=copy512: those trained with
# copy data of this length (labels hyflash-cc512, full-cc512, swa-cc512) into /work/evals/copy512-short512-*;
# FAMILY=copy512s2: their second stage (labels hyflash-cc512s2, …) into /work/evals/copy512s2-short512-*. SLOT=1 adds
# train.sh's run `slot` of the family (label slot-cc512 etc.: HyFlash with attention among the draft slots) and writes
# to /work/evals/<family>-slot-*. FAMILY=copy512s3: the third stage (labels hyflash-cc512s3,
# …). RUNS="..." picks train.sh's runs to evaluate (default: hyflash full swa; SLOT=1 adds slot).
# What ran: `eval.sh hotpotqa reports`, then `SKIP=5 eval.sh hotpotqa reports`, then `eval.sh probe_distant
# probe_nearby`, then `T=1 eval.sh reports` beside `T=1 SKIP=5 eval.sh reports`; for the copy family (another day and
# machine) `FAMILY=copy eval.sh reports probe_distant`, then `FAMILY=copy SKIP=5 eval.sh reports`; the same two for
# FAMILY=copy512, then `FAMILY=copy512 T=1 eval.sh reports` beside `FAMILY=copy512 T=1 SKIP=5 eval.sh reports`;
# for FAMILY=copy512s2 `eval.sh reports probe_distant`, then `SKIP=5 eval.sh reports probe_distant`, then `T=1 eval.sh
# reports` beside `T=1 SKIP=5 eval.sh reports`; `FAMILY=copy512 SLOT=1 eval.sh probe_nearby` beside the same with
# SKIP=5, and the same two for FAMILY=copy512s2; then `FAMILY=copy512s3 RUNS=hyflash SLOT=1 eval.sh probe_nearby`
# beside the same with SKIP=5.
cd /work/main && . .venv/bin/activate
export HYFLASH_KERNELS=avx2 HYFLASH_FAST_BF16=0 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2
case "${FAMILY:-general}" in
  general) R=/work/runs/short512; P=short512; L=512 ;;
  copy) R=/work/runs/copy-short512; P=copy-short512; L=c512 ;;
  copy512) R=/work/runs/copy512-short512; P=copy512-short512; L=cc512 ;;
  copy512s2) R=/work/runs/copy512s2-short512; P=copy512s2-short512; L=cc512s2 ;;
  copy512s3) R=/work/runs/copy512s3-short512; P=copy512s3-short512; L=cc512s3 ;;
  *) echo "unknown FAMILY=$FAMILY" >&2; exit 2 ;;
esac
RUNS=${RUNS:-hyflash full swa}
[ "${SLOT:-0}" = 1 ] && RUNS="$RUNS slot" && P=$P-slot
DRAFTERS=""
for r in $RUNS; do
  [ -d $R/$r/final ] || { echo "no trained run $r in $R" >&2; exit 2; }
  DRAFTERS=$DRAFTERS${DRAFTERS:+,}$r-$L=$R/$r/final
done
for s in "$@"; do
  O=$P-$s${T:+-t$T}${SKIP:+-more}
  (hyflash eval --drafters $DRAFTERS --suites $s \
     --buckets 512-1K,1K-2K,2K-4K,4K-8K ${SKIP:+--skip $SKIP} --limit 5 --max-new-tokens 64 --temperatures ${T:-0} \
     --threads 1 --out /work/evals/$O > /work/runs/eval-$O.log 2>&1; echo "rc $?" >> /work/runs/eval-$O.log) &
done
wait
