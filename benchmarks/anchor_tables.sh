#!/usr/bin/env bash
# Issue #17's table: the question-agnostic anchors against kvmerge's merging methods, budgets 25/10%
# (a 2-core CPU's session allows no more), at 2k, on one model (MODEL=smollm2-135m | gemma3-270m). Resumable (finished rows are skipped).
# About 45 min (SmolLM2) on a 2-core CPU; Gemma was run with N=5 TEXTS=3. `kvmerge report results/anchors/$MODEL` prints it.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
MODEL=${MODEL:-smollm2-135m}
OUT=results/anchors/$MODEL
M=full,snapkv,streamingllm,kvzip,expected_attention,keydiff,surprisemerge,evictmerge:base=kvzip,surprisemerge:base=kvzip
B=0.25,0.1
N=${N:-10}
$K eval --model $MODEL --task niah --methods $M --budgets $B --lengths 2048 --samples $N --out $OUT
$K eval --model $MODEL --task ruler --subtasks multikey --methods $M --budgets $B --lengths 2048 --samples $N --out $OUT
$K eval --model $MODEL --task ruler --subtasks single_inline --methods $M --budgets $B --lengths 2048 --samples $N --out $OUT
$K eval --model $MODEL --task fidelity --methods $M --budgets $B --lengths 2048 --samples ${TEXTS:-6} --out $OUT
$K report $OUT
