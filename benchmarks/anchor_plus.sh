#!/usr/bin/env bash
# KVzip+ (kvzip:plus=true) beside issue #17's table: the same tasks, samples and budgets, into
# results/anchors/<model>-plus (resumable). MODEL=smollm2-135m | gemma3-270m.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
MODEL=${MODEL:-smollm2-135m}
OUT=results/anchors/$MODEL-plus
M=kvzip:plus=true
B=${B:-0.25,0.1}
$K eval --model $MODEL --task niah --methods $M --budgets $B --lengths 2048 --samples ${N:-10} --out $OUT
$K eval --model $MODEL --task ruler --subtasks multikey --methods $M --budgets $B --lengths 2048 --samples 10 --out $OUT
$K eval --model $MODEL --task ruler --subtasks single_inline --methods $M --budgets $B --lengths 2048 --samples 10 --out $OUT
$K eval --model $MODEL --task fidelity --methods $M --budgets $B --lengths 2048 --samples 6 --out $OUT

.venv/bin/kvmerge eval --model smollm2-135m --task niah --methods kvzip:plus=true --budgets 0.25,0.1 --lengths 4096 --samples 10 --out results/anchors/smollm2-135m-4k-plus
