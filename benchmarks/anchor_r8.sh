#!/usr/bin/env bash
# Session 7's runs for issue #17 (single-threaded, resumable; run as lanes side by side on 2 cores):
# R6/R7 (merges calibrated by Expected Attention), R8 = `expectmerge` on both models at 2k, its
# ablations, SmolLM2's multikey to 20 samples for the close call, and expectmerge's long needles.
# Gemma's 4k/8k needles at 10 samples for every method: benchmarks/anchor_r7.sh. Then, e.g.:
#   .venv/bin/python benchmarks/anchor_summary.py results/anchors/smollm2-135m-r8
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
R6=evictmerge:base=expected_attention:recent=0:calibrate_with=expected
R7=surprisemerge:base=expected_attention:calibrate_with=expected
R9=evictmerge:base=mixed_attention:recent=0:calibrate_with=expected
suite() {  # model, folder, methods, budgets
  $K eval --model $1 --task fidelity --methods $3 --budgets $4 --lengths 2048 --samples 6 --out $2
  $K eval --model $1 --task niah --methods $3 --budgets $4 --lengths 2048 --samples 10 --out $2
  $K eval --model $1 --task ruler --subtasks multikey --methods $3 --budgets $4 --lengths 2048 --samples 10 --out $2
  $K eval --model $1 --task ruler --subtasks single_inline --methods $3 --budgets $4 --lengths 2048 --samples 10 --out $2
}
for model in smollm2-135m gemma3-270m; do
  suite $model results/anchors/$model-r6 $R6,$R7 0.25,0.1
  suite $model results/anchors/$model-r8 expectmerge 0.5,0.25,0.1
done
# Gemma's main table has its needles at 5 depths: the 10-depth run above moves beside gemma3-270m-n10
mkdir -p results/anchors/gemma3-270m-r8-n10 && mv results/anchors/gemma3-270m-r8/niah* results/anchors/gemma3-270m-r8-n10/
$K eval --model gemma3-270m --task niah --methods expectmerge --budgets 0.5,0.25,0.1 --lengths 2048 --samples 5 --out results/anchors/gemma3-270m-r8
for model in smollm2-135m gemma3-270m; do
  $K eval --model $model --task fidelity --methods mixed_attention,$R9 --budgets 0.25,0.1 --lengths 2048 --samples 6 --out results/anchors/$model-r8
done
$K eval --model smollm2-135m --task ruler --subtasks multikey --methods full,kvzip,kvzip:plus=true,surprisemerge,expectmerge --budgets 0.25,0.1 --lengths 2048 --samples 20 --out results/anchors/smollm2-135m
$K eval --model smollm2-135m --task niah --methods expectmerge --budgets 0.25,0.1 --lengths 4096 --samples 10 --out results/anchors/smollm2-135m-4k
# Gemma's 50% needles at 10 depths for the table's methods (beside the 25/10% ones of anchor_r6.sh):
$K eval --model gemma3-270m --task niah --methods full,snapkv,streamingllm,kvzip,kvzip:plus=true,expected_attention,keydiff,surprisemerge --budgets 0.5 --lengths 2048 --samples 10 --out results/anchors/gemma3-270m-n10
