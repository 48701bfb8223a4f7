#!/usr/bin/env bash
# Issue #17's table: the question-agnostic anchors against kvmerge's merging methods, budgets 50/25/10%,
# on one model (MODEL=smollm2-135m | gemma3-270m). Resumable (finished rows are skipped).
# About 1 h (SmolLM2) / 2 h (Gemma) on a 2-core CPU. `kvmerge report results/anchors/$MODEL` prints it.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
MODEL=${MODEL:-smollm2-135m}
OUT=results/anchors/$MODEL
M=full,snapkv,streamingllm,kvzip,expected_attention,keydiff,surprisemerge,evictmerge:base=kvzip,surprisemerge:base=kvzip
B=0.5,0.25,0.1
$K eval --model $MODEL --task niah --methods $M --budgets $B --lengths 2048,4096 --samples 10 --out $OUT
$K eval --model $MODEL --task ruler --subtasks multikey --methods $M --budgets $B --lengths 2048 --samples 10 --out $OUT
$K eval --model $MODEL --task ruler --subtasks single_inline --methods $M --budgets $B --lengths 2048,4096 --samples 10 --out $OUT
$K eval --model $MODEL --task fidelity --methods $M --budgets $B --lengths 2048 --samples 6 --out $OUT
if [ "$MODEL" = gemma3-270m ]; then
  $K eval --model $MODEL --task niah --methods $M --budgets 0.25,0.1 --lengths 8192 --samples ${LONG:-5} --out $OUT
fi
$K report $OUT
