#!/usr/bin/env bash
# Session 6's additions to issue #17's table, two single-threaded lanes on a 2-core CPU (resumable):
# SmolLM2 at 50% and needles at 4k; Gemma's needle tasks to 10 samples, KL to 6 texts, then 50%.
# The research variants of anchor_tables.sh are not rerun. Then:
#   .venv/bin/python benchmarks/anchor_summary.py results/anchors/<model>
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
M=full,snapkv,streamingllm,kvzip,expected_attention,keydiff,surprisemerge
tasks() {  # model, out, budgets, needle samples, ruler samples, texts
  $K eval --model $1 --task ruler --subtasks multikey --methods $M --budgets $3 --lengths 2048 --samples $5 --out $2
  $K eval --model $1 --task ruler --subtasks single_inline --methods $M --budgets $3 --lengths 2048 --samples $5 --out $2
  $K eval --model $1 --task fidelity --methods $M --budgets $3 --lengths 2048 --samples $6 --out $2
  $K eval --model $1 --task niah --methods $M --budgets $3 --lengths 2048 --samples $4 --out $2
}
smol() {
  tasks smollm2-135m results/anchors/smollm2-135m 0.5 10 10 6
  $K eval --model smollm2-135m --task niah --methods $M --budgets 0.25,0.1 --lengths 4096 --samples 10 --out results/anchors/smollm2-135m-4k
}
gemma() {  # niah stays at 5 samples: its depths depend on the sample count
  tasks gemma3-270m results/anchors/gemma3-270m 0.25,0.1 5 10 6
  tasks gemma3-270m results/anchors/gemma3-270m 0.5 5 10 6
}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
mkdir -p /work/logs
smol > /work/logs/r6_smol.log 2>&1 &
gemma > /work/logs/r6_gemma.log 2>&1 &
wait
# Then (session 6, after the lanes above): Gemma's 2k needles at 10 samples (new depths, so a new
# folder) and at 4k:
#   .venv/bin/kvmerge eval --model gemma3-270m --task niah --methods full,snapkv,streamingllm,kvzip,kvzip:plus=true,expected_attention,keydiff,surprisemerge --budgets 0.25,0.1 --lengths 2048 --samples 10 --out results/anchors/gemma3-270m-n10
#   LENGTH=4096 N=5 benchmarks/anchor_gemma_long.sh
#   .venv/bin/kvmerge eval --model gemma3-270m --task niah --methods kvzip:plus=true --budgets 0.25,0.1 --lengths 4096 --samples 5 --out results/anchors/gemma3-270m-4096-plus
