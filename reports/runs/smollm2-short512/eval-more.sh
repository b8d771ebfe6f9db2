#!/bin/bash
# Items 6-10 of each bucket for eval.sh's runs (--skip 5 --limit 5: the next five prompts, none repeated), the same
# drafters, settings and environment, one eval process per suite side by side.
cd /work/main && . .venv/bin/activate
export HYFLASH_KERNELS=avx2 HYFLASH_FAST_BF16=0 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2
R=/work/runs/short512
for s in hotpotqa reports; do
  (hyflash eval --drafters hyflash-512=$R/hyflash/final,full-512=$R/full/final,swa-512=$R/swa/final --suites $s \
     --buckets 512-1K,1K-2K,2K-4K,4K-8K --skip 5 --limit 5 --max-new-tokens 64 --temperatures 0 --threads 1 \
     --out /work/evals/short512-$s-more > /work/runs/eval-short512-$s-more.log 2>&1; echo "rc $?" >> /work/runs/eval-short512-$s-more.log) &
done
wait
