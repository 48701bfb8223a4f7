#!/usr/bin/env bash
# Issue #18: decode ms/step of the state before this work (358c2fe) and of HEAD, back to back on the
# same machine (each run prints its own floor and bandwidth). Needs `make setup` first.
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=${BEFORE:-358c2fe}
[ -d /tmp/kvmerge-before ] || git worktree add -f /tmp/kvmerge-before "$BEFORE"
ARGS="bench --methods streamingllm --budget 0.25 --lengths 1024,2048,4096,8192 --batches 1,8 --steps 8"
echo "== before ($BEFORE)"
# -P: the current folder (this checkout) must not shadow the old tree on PYTHONPATH
PYTHONPATH=/tmp/kvmerge-before .venv/bin/python -P -c "
import sys, kvmerge
assert kvmerge.__file__.startswith('/tmp/kvmerge-before'), kvmerge.__file__
from kvmerge.cli import main; sys.exit(main(sys.argv[1:]))" $ARGS --out results/bench_before
echo "== after (HEAD)"
.venv/bin/python -m kvmerge $ARGS --out results/bench_after
