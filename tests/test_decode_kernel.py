"""kvmerge's Triton decoding kernel (`kvmerge.ops.decode_attention`) on any machine: run by Triton's
interpreter (`TRITON_INTERPRET=1`, in a child process: the mode is read when Triton is imported)
against a float64 reference, alone and as `ragged_sdpa` calls it on heads stored at their own lengths
(what graph decoding runs on CUDA). Skipped where Triton is not installed; on a GPU, `test_cuda.py`
runs the compiled kernel."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHILD = r"""
import json, torch
from kvmerge.attention import ragged_sdpa
from kvmerge.ops.decode_attention import available, decode_attention

def reference(q, k, v, log_n):  # q (b, hq, 1, d), k/v (b, hkv, s, d), log_n (b, hkv, s) -> (b, 1, hq, d), float64
    rep = q.shape[1] // k.shape[1]
    q, k, v, ln = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1), log_n.double()
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + ln.repeat_interleave(rep, 1)[:, :, None]
    return (logits.softmax(-1) @ v).transpose(1, 2)

g = torch.Generator().manual_seed(0)
errors = {}
for b, hq, hkv, s, d, splits in [(1, 8, 2, 700, 64, 4), (3, 12, 4, 77, 80, None), (2, 4, 4, 1, 64, None),
                                 (1, 16, 1, 300, 128, 3)]:
    q = torch.randn(b, hq, 1, d, generator=g)
    k, v = (torch.randn(b, hkv, s + 5, d, generator=g)[:, :, :s] for _ in range(2))  # strided views
    log_n = torch.randint(1, 5, (b, hkv, s), generator=g).float().log()
    log_n[:, :, : s // 3] = float("-inf")  # empty slots: with splits, whole splits of them
    log_n[:, :, -1] = 0.0
    assert available(q)
    out = decode_attention(q, k, v, log_n, splits=splits)
    errors[f"{b}x{hq}x{hkv}x{s}x{d}"] = float((out.double() - reference(q, k, v, log_n)).abs().max())

# heads stored at their own lengths, packed, each segment with empty slots at its end (graph decoding's layout)
b, hq, d, lens, caps = 2, 8, 32, [40, 7, 90, 1], [44, 11, 94, 5]
starts = [sum(caps[:i]) for i in range(len(caps))]
keys, values = torch.randn(b, sum(caps), d, generator=g), torch.randn(b, sum(caps), d, generator=g)
log_n = torch.full((b, sum(caps)), float("-inf"))
for s0, n in zip(starts, lens):
    log_n[:, s0:s0 + n] = torch.randint(1, 4, (b, n), generator=g).float().log()
q = torch.randn(b, hq, 1, d, generator=g)
out = ragged_sdpa(q, keys, values, log_n, tuple(zip(starts, caps)))
rep = hq // len(lens)
want = torch.cat([reference(q[:, i * rep:(i + 1) * rep], keys[:, None, s0:s0 + n], values[:, None, s0:s0 + n],
                            log_n[:, None, s0:s0 + n]) for i, (s0, n) in enumerate(zip(starts, lens))], dim=2)
errors["packed heads"] = float((out.double() - want).abs().max())
print(json.dumps(errors))
"""


def test_the_decode_kernel_in_tritons_interpreter_equals_the_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    errors = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(errors) == 5 and max(errors.values()) < 2e-5, errors
