#!/usr/bin/env bash
# Issue #17's long-context needles on Gemma-3-270M (32k positions): 8k tokens, the table's methods,
# 25/10%, N samples (resumable), into results/anchors/gemma3-270m-8k. Single-threaded on a 2-core CPU.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
M=full,snapkv,streamingllm,kvzip,expected_attention,keydiff,surprisemerge
$K eval --model gemma3-270m --task niah --methods $M --budgets 0.25,0.1 --lengths ${LENGTH:-8192} --samples ${N:-5} --out results/anchors/gemma3-270m-${LENGTH:-8192}
