#!/usr/bin/env bash
# Rebuild every report in reports/ from the raw results kept in reports/runs/ (no model runs: tables and plots only).
# Run from the repository root:   bash scripts/make_reports.sh
# The commands are the ones each report names in its first line; reports/README.md says what each report shows.
set -euo pipefail
cd "$(dirname "$0")/.."
R=reports/runs

# hyflash eval results -> long-context, short-suite and probe tables, and their plots
hyflash report $R/smollm2-variants-mtbench --out reports/smollm2-variants-mtbench
hyflash report $R/smollm2-long --out reports/smollm2-long
hyflash report $R/smollm2-slot-probe --out reports/smollm2-slot-probe
hyflash report $R/smollm2-recall-probe --out reports/smollm2-recall-probe
hyflash report $R/gemma3-long --out reports/gemma3-long
hyflash report $R/gemma3-long-1200 --out reports/gemma3-long-1200
hyflash report $R/gemma3-slot-probe --out reports/gemma3-slot-probe
hyflash report $R/gemma3-gpu-long $R/gemma3-gpu-hotpotqa --out reports/gemma3-gpu-long
hyflash report $R/gemma3-gpu-slot-probe --out reports/gemma3-gpu-slot-probe
hyflash report $R/gemma3-gpu-long-t1 $R/gemma3-gpu-hotpotqa-t1 --out reports/gemma3-gpu-long-t1
hyflash report $R/gemma3-mem512-distant --out reports/gemma3-mem512-distant
hyflash report $R/gemma3-gdn-depth1-distant --out reports/gemma3-gdn-depth1-distant
hyflash report $R/gemma3-gdn-depth1-distant $R/gemma3-depth3-distant --out reports/gemma3-depth-distant
hyflash report $R/gemma3-cpp-attention-ngram --out reports/gemma3-cpp-attention-ngram
hyflash report $R/gemma3-floor-distant --out reports/gemma3-floor-distant
hyflash report $R/smollm2-copy-probe --out reports/smollm2-copy-probe
hyflash report $R/smollm2-copytok-probe --out reports/smollm2-copytok-probe
hyflash report $R/smollm2-copytok-slot-probe --out reports/smollm2-copytok-slot-probe
hyflash report $R/smollm2-dpfp4-probe --out reports/smollm2-dpfp4-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-probe --base hyflash-dpfp4 > $R/smollm2-dpfp4-probe/paired.txt
hyflash report $R/smollm2-dpfp4-1200-probe --out reports/smollm2-dpfp4-1200-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-1200-probe --base hyflash-dpfp4-1200 \
    > $R/smollm2-dpfp4-1200-probe/paired.txt
hyflash report $R/smollm2-dpfp4-mem256-probe --out reports/smollm2-dpfp4-mem256-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-probe $R/smollm2-dpfp4-mem256-probe --base hyflash-dpfp4 \
    > $R/smollm2-dpfp4-mem256-probe/paired.txt
hyflash report $R/smollm2-dpfp4-slot-noslot-probe --out reports/smollm2-dpfp4-slot-noslot-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-slot-noslot-probe --base hyflash-dpfp4 \
    > $R/smollm2-dpfp4-slot-noslot-probe/paired.txt
python benchmarks/paired_items.py $R/smollm2-dpfp4-slot-noslot-probe $R/smollm2-dpfp4-noslot-cut-probe --base dpfp4-noslot \
    > $R/smollm2-dpfp4-noslot-cut-probe/paired.txt
python benchmarks/paired_items.py $R/smollm2-dpfp4-probe $R/smollm2-dpfp4-noslot-probe --base hyflash-dpfp4 --drop-differing \
    > $R/smollm2-dpfp4-noslot-probe/paired.txt
hyflash report $R/smollm2-dpfp4-noslot-four-probe --out reports/smollm2-dpfp4-noslot-four-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-four-probe --base dpfp4-noslot \
    > $R/smollm2-dpfp4-noslot-four-probe/paired.txt
hyflash report $R/smollm2-dpfp4-noslot-three-probe-t1 --out reports/smollm2-dpfp4-noslot-three-probe-t1
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-three-probe-t1 --base dpfp4-noslot --temperature 1.0 \
    > $R/smollm2-dpfp4-noslot-three-probe-t1/paired.txt
hyflash report $R/smollm2-dpfp4-noslot-1200-probe $R/smollm2-dpfp4-noslot-1200-swa-probe \
    --out reports/smollm2-dpfp4-noslot-1200-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-1200-probe --base dpfp4-noslot-1200 \
    > $R/smollm2-dpfp4-noslot-1200-probe/paired.txt
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-1200-probe $R/smollm2-dpfp4-noslot-1200-swa-probe \
    --base dpfp4-noslot-1200 > $R/smollm2-dpfp4-noslot-1200-swa-probe/paired.txt
M=$R/smollm2-dpfp4-noslot-mem256-probe
hyflash report $R/smollm2-dpfp4-noslot-1200-probe $R/smollm2-dpfp4-noslot-1200-swa-probe $M \
    --out reports/smollm2-dpfp4-noslot-mem256-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-1200-probe $R/smollm2-dpfp4-noslot-1200-swa-probe $M \
    --base dpfp4-noslot > $M/paired.txt
M=$R/smollm2-dpfp4-noslot-mem256-1200-probe
hyflash report $R/smollm2-dpfp4-noslot-1200-probe $R/smollm2-dpfp4-noslot-1200-swa-probe $M \
    --out reports/smollm2-dpfp4-noslot-mem256-1200-probe
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-1200-probe $R/smollm2-dpfp4-noslot-1200-swa-probe $M \
    --base dpfp4-noslot-1200 > $M/paired.txt
hyflash report $R/smollm2-dpfp4-noslot-1200-t1 --out reports/smollm2-dpfp4-noslot-1200-t1
python benchmarks/paired_items.py $R/smollm2-dpfp4-noslot-1200-t1 --base dpfp4-noslot-1200 --temperature 1.0 \
    > $R/smollm2-dpfp4-noslot-1200-t1/paired.txt
P=$R/smollm2-dpfp4-noslot-1200-t1-30
hyflash report $P-distant $P-distant-cut-a $P-distant-cut-b $P-distant-argmax $P-nearby $P-nearby-argmax \
    --out reports/smollm2-dpfp4-noslot-1200-t1-30
python benchmarks/paired_items.py $P-distant $P-distant-cut-a $P-distant-cut-b $P-distant-argmax \
    --base dpfp4-noslot-1200 --temperature 1.0 > $P-distant/paired.txt
python benchmarks/paired_items.py $P-distant-argmax --base dpfp4-noslot-1200-argmax --temperature 1.0 \
    > $P-distant-argmax/paired.txt
python benchmarks/paired_items.py $P-nearby $P-nearby-argmax --base dpfp4-noslot-1200 --temperature 1.0 \
    > $P-nearby/paired.txt
python benchmarks/paired_items.py $P-nearby-argmax --base dpfp4-noslot-1200-argmax --temperature 1.0 \
    > $P-nearby-argmax/paired.txt
hyflash report $R/smollm2-mtbench-t1-argmax --out reports/smollm2-mtbench-t1-argmax
python benchmarks/paired_items.py $R/smollm2-mtbench-t1-argmax --base auto --temperature 1.0 \
    > $R/smollm2-mtbench-t1-argmax/paired.txt
L=$R/smollm2-noslot-1200-long
hyflash report $L-docs $L-probes --out reports/smollm2-noslot-1200-long
python benchmarks/paired_items.py $L-docs --base dpfp4-noslot-1200 > $L-docs/paired.txt
python benchmarks/paired_items.py $L-probes --base dpfp4-noslot-1200 > $L-probes/paired.txt
hyflash report $L-docs-t1 $L-probes-t1 --out reports/smollm2-noslot-1200-long-t1
python benchmarks/paired_items.py $L-docs-t1 --base dpfp4-noslot-1200 --temperature 1.0 > $L-docs-t1/paired.txt
python benchmarks/paired_items.py $L-probes-t1 --base dpfp4-noslot-1200 --temperature 1.0 > $L-probes-t1/paired.txt
python benchmarks/compare_eval_runs.py $R/gemma3-gpu-long $R/gemma3-cpp-attention-ngram \
    > $R/gemma3-cpp-attention-ngram/compare_with_gemma3-gpu-long.txt
# the 512-token families: long_report NAME BASE SUFFIX... reports the runs $R/NAME-SUFFIX beyond a 512-token training
# length into reports/NAME-long, with paired.txt and paired_by_bucket.txt against BASE in $R/NAME; t1_report NAME BASE
# does the same for the temperature-1.0 runs $R/NAME-reports-t1{,-more} into reports/NAME-long-t1
long_report() {
  local name=$1 base=$2 runs=() s
  shift 2
  for s in "$@"; do runs+=("$R/$name-$s"); done
  hyflash report "${runs[@]}" --training-length 512 --out reports/$name-long
  python benchmarks/paired_items.py "${runs[@]}" --base $base > $R/$name/paired.txt
  python benchmarks/paired_items.py "${runs[@]}" --base $base --by-bucket > $R/$name/paired_by_bucket.txt
}
t1_report() {
  local name=$1 base=$2 runs=("$R/$1-reports-t1" "$R/$1-reports-t1-more")
  hyflash report "${runs[@]}" --training-length 512 --out reports/$name-long-t1
  python benchmarks/paired_items.py "${runs[@]}" --base $base --temperature 1.0 > $R/$name/paired_t1.txt
  python benchmarks/paired_items.py "${runs[@]}" --base $base --temperature 1.0 --by-bucket \
      > $R/$name/paired_by_bucket_t1.txt
}
SH=$R/smollm2-short512 CS=$R/smollm2-copy-short512 CC=$R/smollm2-copy512-short512 CT=$R/smollm2-copy512s2-short512
C3=$R/smollm2-copy512s3-short512
long_report smollm2-short512 hyflash-512 hotpotqa hotpotqa-more reports reports-more probe_distant probe_nearby
t1_report smollm2-short512 hyflash-512
long_report smollm2-copy-short512 hyflash-c512 reports reports-more probe_distant
long_report smollm2-copy512-short512 hyflash-cc512 reports reports-more probe_distant probe_distant-more
python benchmarks/paired_items.py $CC-reports $CC-reports-more $CS-reports $CS-reports-more --base hyflash-cc512 \
    --by-bucket > $CC/paired_by_bucket_vs_docs_only.txt
t1_report smollm2-copy512-short512 hyflash-cc512
long_report smollm2-copy512-short512-slot slot-cc512 probe_nearby probe_nearby-more
long_report smollm2-copy512s2-short512 hyflash-cc512s2 reports reports-more probe_distant probe_distant-more
python benchmarks/paired_items.py $CT-reports $CT-reports-more $CC-reports $CC-reports-more --base hyflash-cc512s2 \
    --by-bucket > $CT/paired_by_bucket_vs_stage1.txt
t1_report smollm2-copy512s2-short512 hyflash-cc512s2
long_report smollm2-copy512s2-short512-slot slot-cc512s2 probe_nearby probe_nearby-more
long_report smollm2-copy512s3-short512-slot slot-cc512s3 probe_nearby probe_nearby-more
python benchmarks/paired_items.py $C3-slot-probe_nearby $C3-slot-probe_nearby-more $CT-slot-probe_nearby \
    $CT-slot-probe_nearby-more --base slot-cc512s3 > $C3-slot/paired_vs_stage2.txt
# the general 512-token family trained again on another CPU (its own features): report QA at 4–8K, 20 items, T 0 and 1;
# then report QA at 2–4K (20 items) and HotpotQA at 2–4K and 4–8K (10 items each), greedy; and its HyFlash drafter
# with the memory cut to the window (256) and to the training length (512) on the report-QA items
S2=$R/smollm2-short512r2
hyflash report $S2-reports-2K4K-t0 $S2-reports-4K8K-t0 $S2-hotpotqa-t0 $S2-reports-4K8K-t1 $S2-cut-reports-2K-4K-t0 \
    $S2-cut-reports-4K-8K-t0 --training-length 512 --out reports/smollm2-short512r2-long
python benchmarks/paired_items.py $S2-reports-4K8K-t0 --base hyflash-512r > $S2/paired.txt
python benchmarks/paired_items.py $S2-reports-4K8K-t1 --base hyflash-512r --temperature 1.0 > $S2/paired_t1.txt
python benchmarks/paired_items.py $S2-hotpotqa-t0 $S2-reports-2K4K-t0 --base hyflash-512r --by-bucket \
    > $S2/paired_2K4K_hotpotqa.txt
python benchmarks/paired_items.py $S2-reports-2K4K-t0 $S2-reports-4K8K-t0 $S2-cut-reports-2K-4K-t0 $S2-cut-reports-4K-8K-t0 \
    --base hyflash-512r --by-bucket > $S2/paired_memory_cut.txt
python benchmarks/paired_items.py $S2-reports-4K8K-t0 $SH-reports $SH-reports-more --base hyflash-512r --by-bucket \
    --drop-differing > $S2/paired_vs_first_training.txt
python benchmarks/paired_items.py $S2-reports-4K8K-t1 $SH-reports-t1 $SH-reports-t1-more --base hyflash-512r \
    --temperature 1.0 --by-bucket > $S2/paired_vs_first_training_t1.txt

# training logs -> held-out τ̂ at equal steps (the ablation and depth tables)
A=$R/smollm2-ablations
hyflash training-report $A/hyflash $A/full $A/swa $A/noslot $A/mem512 $A/depth1 $A/depth3 $A/gdn --at-step 500 \
    --out reports/smollm2-ablations
hyflash training-report $A/hyflash $A/full $A/swa $A/noslot $A/depth1 --at-step 2000 --out reports/smollm2-ablations-2000
G=$R/gemma3-training
hyflash training-report $G/hyflash $G/full $G/swa $G/noslot $G/mem512 $G/gdn $G/depth1 $G/depth3 --at-step 600 \
    --out reports/gemma3-training
G=$R/gemma3-training-stage2
hyflash training-report $G/hyflash $G/full $G/swa --at-step 600 --out reports/gemma3-training-stage2
G=$R/gemma3-gpu-training
hyflash training-report $G/stage1/hyflash $G/stage1/full $G/stage1/swa $G/stage1/noslot --at-step 248 \
    --out reports/gemma3-gpu-training
hyflash training-report $G/stage2/hyflash $G/stage2/full $G/stage2/swa $G/stage2/noslot --at-step 115 \
    --out reports/gemma3-gpu-training-stage2
G=$R/gemma3-floor-cpu
hyflash training-report $G/hyflash $G/floor --at-step 400 --out reports/gemma3-floor-cpu
hyflash training-report $SH/hyflash $SH/full $SH/swa --at-step 600 --out reports/smollm2-short512-training
hyflash training-report $CS/hyflash $CS/full $CS/swa --at-step 600 --out reports/smollm2-copy-short512-training
hyflash training-report $CC/hyflash $CC/full $CC/swa --at-step 600 --out reports/smollm2-copy512-short512-training
hyflash training-report $CC/hyflash $CC/slot $CC/swa $CC/full --at-step 600 \
    --out reports/smollm2-copy512-short512-slot-training
hyflash training-report $CT/hyflash $CT/full $CT/swa --at-step 600 --out reports/smollm2-copy512s2-short512-training
hyflash training-report $CT/hyflash $CT/slot $CT/swa $CT/full --at-step 600 \
    --out reports/smollm2-copy512s2-short512-slot-training
hyflash training-report $C3/hyflash $C3/slot --at-step 600 --out reports/smollm2-copy512s3-short512-slot-training
hyflash training-report $S2/hyflash $S2/full $S2/swa --at-step 600 --out reports/smollm2-short512r2-training
G=$R/smollm2-copy
hyflash training-report $G/hyflash $G/noslot $G/swa $G/gdn --at-step 400 --out reports/smollm2-copy
L=$R/smollm2-copy-lags
hyflash training-report $G/hyflash $G/noslot $G/swa $L/hyflash-lags $L/noslot-lags $L/swa-lags --at-step 400 \
    --out reports/smollm2-copy-lags
H=$R/smollm2-copyhead
hyflash training-report $G/hyflash $G/noslot $G/swa $H/hyflash-copyhead $H/noslot-copyhead $H/swa-copyhead \
    --at-step 100 --out reports/smollm2-copyhead
T=$R/smollm2-copytok
hyflash training-report $G/hyflash $H/hyflash-copyhead $T/hyflash-copytok --at-step 400 --out reports/smollm2-copytok
hyflash training-report $G/hyflash $G/noslot $T/hyflash-copytok $T/noslot-copytok --at-step 200 \
    --out reports/smollm2-copytok-noslot
C=$R/smollm2-copymemtok
D=$R/smollm2-copymemtok-dpfp4
hyflash training-report $C/hyflash-copymemtok $D/hyflash-copymemtok-dpfp4 $D/hyflash-copymemtok-dpfp4-gate \
    $D/swa-copytok --at-step 600 --out reports/smollm2-copymemtok-dpfp4
D=$R/smollm2-copymemtok-dpfp4-stage2
hyflash training-report $D/hyflash-copymemtok-dpfp4 $D/swa-copytok --at-step 600 \
    --out reports/smollm2-copymemtok-dpfp4-stage2
D=$R/smollm2-copymemtok-dpfp4
hyflash training-report $D/hyflash-copymemtok-dpfp4 $R/smollm2-copymemtok-dpfp4-mem256/dpfp4-mem256 $D/swa-copytok \
    --at-step 600 --out reports/smollm2-copymemtok-dpfp4-mem256
D=$R/smollm2-copymemtok-dpfp4-stage2
hyflash training-report $D/hyflash-copymemtok-dpfp4 $R/smollm2-copymemtok-dpfp4-mem256/dpfp4-mem256-stage2 \
    $D/swa-copytok --at-step 300 --out reports/smollm2-copymemtok-dpfp4-mem256-stage2
N=$R/smollm2-copymemtok-dpfp4-noslot
hyflash training-report $R/smollm2-copymemtok-dpfp4/hyflash-copymemtok-dpfp4 $N/dpfp4-same-machine $N/dpfp4-noslot \
    $R/smollm2-copymemtok-dpfp4/swa-copytok --at-step 600 --out reports/smollm2-copymemtok-dpfp4-noslot
C=$R/smollm2-copymemtok-dpfp4-noslot-controls
hyflash training-report $N/dpfp4-noslot $C/dpfp4-noslot-mem256 $C/swa-noslot --at-step 600 \
    --out reports/smollm2-copymemtok-dpfp4-noslot-controls
S=$R/smollm2-copymemtok-dpfp4-noslot-stage2
D=$R/smollm2-copymemtok-dpfp4-stage2
hyflash training-report $S/dpfp4-noslot-1200 $S/full-noslot-1200 $S/swa-noslot-1200 $D/hyflash-copymemtok-dpfp4 \
    $D/swa-copytok --at-step 600 --out reports/smollm2-copymemtok-dpfp4-noslot-stage2
hyflash training-report $S/dpfp4-noslot-1200 $S/dpfp4-noslot-mem256-1200 $S/swa-noslot-1200 --at-step 600 \
    --out reports/smollm2-copymemtok-dpfp4-noslot-mem256-stage2
T=$R/smollm2-copytok-slot-seeds
hyflash report $T/probe-nearby-200 $T/probe-distant-200 $T/probe-nearby-400-512-1K $T/probe-nearby-400-1K-2K \
    --out reports/smollm2-copytok-slot-seeds-probe
{ for s in 0 1; do python benchmarks/paired_items.py $T/probe-nearby-200 $T/probe-distant-200 --base copytok-s$s-200; done
  for s in 0 1; do python benchmarks/paired_items.py $T/probe-nearby-400-512-1K $T/probe-nearby-400-1K-2K --base copytok-s$s-400; done
} > $T/paired.txt
hyflash training-report $T/copytok-s0-hyflash $T/copytok-s0-noslot $T/copytok-s1-hyflash $T/copytok-s1-noslot \
    --at-step 400 --out reports/smollm2-copytok-slot-seeds
T=$R/smollm2-mix-copytok-slot
hyflash report $T/probe-nearby-{200,400,600}-512-1K $T/probe-nearby-{200,400,600}-1K-2K \
    --out reports/smollm2-mix-copytok-slot-probe
for k in 200 400 600; do
  for s in 0 1; do python benchmarks/paired_items.py $T/probe-nearby-$k-512-1K $T/probe-nearby-$k-1K-2K --base mix-s$s-$k; done
done > $T/paired.txt
hyflash training-report $T/mix-s0-hyflash $T/mix-s0-noslot $T/mix-s1-hyflash $T/mix-s1-noslot \
    --at-step 600 --out reports/smollm2-mix-copytok-slot
for st in 2 3; do  # the later stages of the mixed copy-token pair: stage st ends at step 600 × st
  n=$((600 * st)); T=$R/smollm2-mix-copytok-slot-stage$st
  hyflash report $T/probe-nearby-$n-s{0,1}-512-1K $T/probe-nearby-$n-s{0,1}-1K-2K \
      --out reports/smollm2-mix-copytok-slot-stage$st-probe
  for s in 0 1; do
    python benchmarks/paired_items.py $T/probe-nearby-$n-s$s-512-1K $T/probe-nearby-$n-s$s-1K-2K --base mix-s$s-$n
  done > $T/paired.txt
  hyflash training-report $T/mix$st-s0-hyflash $T/mix$st-s0-noslot $T/mix$st-s1-hyflash $T/mix$st-s1-noslot \
      --at-step 600 --out reports/smollm2-mix-copytok-slot-stage$st
done
echo "make_reports: every report rebuilt from reports/runs/"
