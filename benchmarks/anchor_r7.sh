#!/usr/bin/env bash
# Session 7: Gemma-3-270M's long needles at 10 samples (issue #17 asks for >= 10 per cell).
# The needle depths depend on the sample count, so these are new folders beside the 5-sample ones.
# Single-threaded, resumable. Then: .venv/bin/python benchmarks/anchor_summary.py <folder>
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
M=${METHODS:-full,snapkv,streamingllm,kvzip,kvzip:plus=true,expected_attention,keydiff,surprisemerge,expectmerge}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
for L in ${LENGTHS:-4096 8192}; do
  $K eval --model gemma3-270m --task niah --methods $M --budgets 0.25,0.1 --lengths $L --samples 10 \
    --out results/anchors/gemma3-270m-$L-n10
done
