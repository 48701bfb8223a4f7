#!/usr/bin/env bash
# Issue #14's tables: needles and fidelity on Gemma-3-270M (hybrid) beside SmolLM2, budgets 25% and 10%.
# Resumable (rows already in results/hybrid/* are skipped). About 2 h on a 2-core CPU. The decode row:
#   kvmerge bench --model gemma3-270m --methods snapkv --budget 0.25 --lengths 16384 --batches 4 --steps 8 --prefill-chunk 1024
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
M=full,streamingllm,snapkv,semanticache,centroidkv,surprisemerge,evictmerge
$K eval --model gemma3-270m --task niah --methods $M --budgets 0.25,0.1 --lengths 4096,8192 --samples 5 --out results/hybrid/gemma
$K eval --task niah --methods $M --budgets 0.25,0.1 --lengths 4096,8192 --samples 5 --out results/hybrid/smollm2
$K eval --model gemma3-270m --task fidelity --methods $M --budgets 0.25,0.1 --lengths 4096,8192 --samples 2 --out results/hybrid/gemma
$K eval --task fidelity --methods $M --budgets 0.25,0.1 --lengths 4096 --samples 2 --out results/hybrid/smollm2
$K eval --model gemma3-270m --task niah --methods $M --budgets 0.25,0.1 --lengths 16384 --samples 3 --out results/hybrid/gemma
$K eval --model gemma3-270m --task fidelity --methods $M --budgets 0.25,0.1 --lengths 16384 --samples 1 --out results/hybrid/gemma
