#!/usr/bin/env bash
# R3/R4 of NOTES session 5 (and, on Gemma, R1'/R2'), on the samples of anchor_lanes.sh.
# MODEL=smollm2-135m N=6 NEEDLES=10 TEXTS=6 | MODEL=gemma3-270m N=5 NEEDLES=5 TEXTS=3
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
MODEL=${MODEL:-smollm2-135m}
OUT=results/anchors/$MODEL-${TAG:-r3}
M=${METHODS:-surprisemerge:base=expected_attention,evictmerge:base=expected_attention}
B=0.25,0.1
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
$K eval --model $MODEL --task niah --methods $M --budgets $B --lengths 2048 --samples ${NEEDLES:-10} --out $OUT
$K eval --model $MODEL --task fidelity --methods $M --budgets $B --lengths 2048 --samples ${TEXTS:-6} --out $OUT
$K eval --model $MODEL --task ruler --subtasks multikey --methods $M --budgets $B --lengths 2048 --samples ${N:-6} --out $OUT
$K eval --model $MODEL --task ruler --subtasks single_inline --methods $M --budgets $B --lengths 2048 --samples ${N:-6} --out $OUT
