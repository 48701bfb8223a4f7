#!/usr/bin/env bash
# Issue #15's quality cost of chunking: needle and fidelity at 25%, one-shot vs chunks of 512/1024/2048,
# same samples. Resumable. SmolLM2 ~20 min, Gemma ~40 min on a 2-core CPU. MODEL=gemma3-270m for Gemma.
set -euo pipefail
K=${KVMERGE:-.venv/bin/kvmerge}
MODEL=${MODEL:-smollm2-135m}
OUT=results/chunking/$MODEL
M=streamingllm,snapkv,centroidkv,semanticache,surprisemerge
$K eval --model $MODEL --task niah --methods full,$M --budgets 0.25 --lengths 4096 --samples ${NEEDLES:-8} --out $OUT
$K eval --model $MODEL --task fidelity --methods full,$M --budgets 0.25 --lengths 4096 --samples ${TEXTS:-4} --out $OUT
for chunk in 512 1024 2048; do  # each method prefills on its own here: the first 3 needles and 1 text
  $K eval --model $MODEL --task niah --methods $M --budgets 0.25 --lengths 4096 --samples ${NEEDLES:-8} --limit 3 --prefill-chunk $chunk --out $OUT
  $K eval --model $MODEL --task fidelity --methods $M --budgets 0.25 --lengths 4096 --samples ${TEXTS:-4} --limit 1 --prefill-chunk $chunk --out $OUT
done
$K report $OUT
