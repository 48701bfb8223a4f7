#!/usr/bin/env bash
# How the session-5 table was finished: two single-threaded lanes (one per model) on a 2-core CPU,
# the same rows as anchor_tables.sh + anchor_followup.sh with fewer samples where time ran short.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
M=full,snapkv,streamingllm,kvzip,expected_attention,keydiff,surprisemerge,evictmerge:base=kvzip,surprisemerge:base=kvzip
F=evictmerge:base=kvzip:recent=0,surprisemerge:base=kvzip:recent=0
B=0.25,0.1
lane() {  # model, samples per needle task, texts
  local out=results/anchors/$1
  $K eval --model $1 --task ruler --subtasks multikey --methods $M --budgets $B --lengths 2048 --samples $2 --out $out
  $K eval --model $1 --task fidelity --methods $M --budgets $B --lengths 2048 --samples $3 --out $out
  $K eval --model $1 --task ruler --subtasks single_inline --methods $M --budgets $B --lengths 2048 --samples $2 --out $out
  $K eval --model $1 --task niah --methods $F --budgets $B --lengths 2048 --samples 10 --out $out-followup
  $K eval --model $1 --task fidelity --methods $F --budgets $B --lengths 2048 --samples $3 --out $out-followup
  $K eval --model $1 --task ruler --subtasks multikey --methods $F --budgets $B --lengths 2048 --samples $2 --out $out-followup
  $K eval --model $1 --task ruler --subtasks single_inline --methods $F --budgets $B --lengths 2048 --samples $2 --out $out-followup
}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1
lane smollm2-135m 6 6 > /work/logs/lane_smol.log 2>&1 &
lane gemma3-270m 5 3 > /work/logs/lane_gemma.log 2>&1 &
wait
