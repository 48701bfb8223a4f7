#!/usr/bin/env bash
# One run on a GPU machine (docs/performance.md, "On a GPU"): a sanity check, the CUDA test rows, then
# benchmarks/gpu_bench.py at 8B shape. Results go to $OUT (default results/). Wheels in .whl/ (e.g.
# transformers 5.24 where the machine has another) are installed first, beside the machine's torch.
#     OUT=results bash benchmarks/gpu_session.sh [gpu_bench.py options]
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 - <<'PY' || exit 1
import torch, transformers, kvmerge
from tests.conftest import tiny_model, random_ids
model = tiny_model().cuda()
out = kvmerge.generate_ids(model, random_ids(200), [3, 4], kvmerge.get_method("snapkv", budget=0.25, window=8),
                           max_new_tokens=4)
print("sanity:", torch.__version__, transformers.__version__, torch.cuda.get_device_name(), out.tokens)
PY
timeout "${TEST_SECONDS:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="" -m "not slow and not ci_slow" \
    tests/test_cuda.py tests/test_graphs.py tests/test_baselines.py::test_every_method_batch_budget_and_dtype -k cuda 2>&1 \
    | tee "$OUT/gpu_tests.txt" | tail -25
timeout "${BENCH_SECONDS:-420}" python3 benchmarks/gpu_bench.py --out "$OUT/gpu.jsonl" "$@"
