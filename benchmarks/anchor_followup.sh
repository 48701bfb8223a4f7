#!/usr/bin/env bash
# The research step's single changes (NOTES, session 5: R1', R2'), on the samples of anchor_tables.sh.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
MODEL=${MODEL:-smollm2-135m}
OUT=results/anchors/$MODEL-followup
M=evictmerge:base=kvzip:recent=0,surprisemerge:base=kvzip:recent=0
B=0.25,0.1
N=${N:-10}
$K eval --model $MODEL --task niah --methods "$M" --budgets $B --lengths 2048 --samples $N --out $OUT
$K eval --model $MODEL --task ruler --subtasks multikey --methods "$M" --budgets $B --lengths 2048 --samples $N --out $OUT
$K eval --model $MODEL --task ruler --subtasks single_inline --methods "$M" --budgets $B --lengths 2048 --samples $N --out $OUT
$K eval --model $MODEL --task fidelity --methods "$M" --budgets $B --lengths 2048 --samples ${TEXTS:-6} --out $OUT
$K report $OUT
