#!/bin/bash
# The three drafters of train.sh on HotpotQA and report QA, 5 items a bucket, greedy, 64 new tokens: one eval process
# per suite (one thread each, side by side), in the AVX2 environment of the other SmolLM2 long-context reports.
cd /work/main && . .venv/bin/activate
export HYFLASH_KERNELS=avx2 HYFLASH_FAST_BF16=0 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
    ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2
R=/work/runs/short512
for s in hotpotqa reports; do
  (hyflash eval --drafters hyflash-512=$R/hyflash/final,full-512=$R/full/final,swa-512=$R/swa/final --suites $s \
     --buckets 512-1K,1K-2K,2K-4K,4K-8K --limit 5 --max-new-tokens 64 --temperatures 0 --threads 1 \
     --out /work/evals/short512-$s > /work/runs/eval-short512-$s.log 2>&1; echo "rc $?" >> /work/runs/eval-short512-$s.log) &
done
wait
