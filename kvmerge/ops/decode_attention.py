"""One decoding step's attention over a merged cache on the GPU: softmax(q·k·scale + log_n) v, split
over the keys (flash-decoding) in a Triton kernel, so a per-key log-mass costs what a plain cache
costs. PyTorch's SDPA takes such a bias only in its memory-efficient kernel, which does not split the
keys: at batch 1 it runs one block per KV head and reads the cache far below the memory's bandwidth.

query `(b, hq, 1, d)`, key/value `(b, hkv, s, d)` (any strides with the last dim contiguous), log_n
`(b, hkv, s)` float32 (−inf: an empty slot) → `(b, 1, hq, d)`, equal to `biased_sdpa` to rounding.
Each KV head's `hq / hkv` query heads are one block's rows (GQA without repeating K/V).
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None


def _block_n(block_d: int) -> int:
    """Keys per step of a program: 64, fewer for wide heads (the K and V tiles live in shared memory)."""
    return 64 if block_d <= 128 else 32


def available(query: torch.Tensor) -> bool:
    """Whether the kernel can run `query`'s decoding step: Triton present, a CUDA tensor (or Triton's
    interpreter, `TRITON_INTERPRET=1`, on CPU), one query token."""
    import os

    return (triton is not None and query.shape[2] == 1
            and (query.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"))


if triton is not None:
    @triton.jit
    def _partial(q_ptr, k_ptr, v_ptr, ln_ptr, out_ptr, lse_ptr, scale, s, rep, split_len,
                 q_sb, q_sh, q_sr, k_sb, k_sh, k_ss, v_sb, v_sh, v_ss, ln_sb, ln_sh, ln_ss,
                 hkv, splits, d: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
        """One (row, KV head, split): the attention of its `rep` query heads over the split's keys →
        the normalised partial output `(rep, d)` and its log-sum-exp `(rep,)`."""
        bh, sp = tl.program_id(0), tl.program_id(1)
        b, h = bh // hkv, bh % hkv
        r, dd = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * q_sb + h * q_sh + r[:, None] * q_sr + dd[None, :],
                    mask=(r[:, None] < rep) & (dd[None, :] < d), other=0.0)
        m = tl.full([BLOCK_R], -1.0e30, tl.float32)  # finite: a block of empty slots leaves it as it was
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
        start = sp * split_len
        end = tl.minimum(start + split_len, s)
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            live = n < s
            k = tl.load(k_ptr + b * k_sb + h * k_sh + n[:, None] * k_ss + dd[None, :],
                        mask=live[:, None] & (dd[None, :] < d), other=0.0)
            v = tl.load(v_ptr + b * v_sb + h * v_sh + n[:, None] * v_ss + dd[None, :],
                        mask=live[:, None] & (dd[None, :] < d), other=0.0)
            ln = tl.load(ln_ptr + b * ln_sb + h * ln_sh + n * ln_ss, mask=live, other=float("-inf"))
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale + ln[None, :]
            new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp(scores - new[:, None])
            keep = tl.exp(m - new)
            total = total * keep + tl.sum(p, 1)
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m = new
        seen = total > 0
        out = tl.where(seen[:, None], acc / tl.where(seen, total, 1.0)[:, None], 0.0)
        lse = tl.where(seen, m + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        row = (bh * splits + sp) * BLOCK_R + r
        tl.store(out_ptr + row[:, None] * BLOCK_D + dd[None, :], out)
        tl.store(lse_ptr + row, lse)


def _pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(x)))


def decode_attention(query, key, value, log_n, scaling=None, splits=None) -> torch.Tensor:
    """See the module docstring; `splits`: key ranges per (row, KV head), by default enough programs
    for about two per multiprocessor."""
    b, hq, _, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    rep = hq // hkv
    scale = d ** -0.5 if scaling is None else scaling
    sms = torch.cuda.get_device_properties(query.device).multi_processor_count if query.is_cuda else 4
    block_r, block_d = max(16, _pow2(rep)), max(16, _pow2(d))
    block_n = _block_n(block_d)
    if splits is None:
        splits = max(1, min(math.ceil(2 * sms / (b * hkv)), math.ceil(s / block_n)))
    split_len = math.ceil(math.ceil(s / splits) / block_n) * block_n
    splits = math.ceil(s / split_len)
    q = query.reshape(b, hkv, rep, d)
    if q.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        q, key, value = q.contiguous(), key.contiguous(), value.contiguous()
    out = torch.empty(b * hkv, splits, block_r, block_d, dtype=torch.float32, device=query.device)
    lse = torch.empty(b * hkv, splits, block_r, dtype=torch.float32, device=query.device)
    log_n = log_n.float()
    _partial[(b * hkv, splits)](
        q, key, value, log_n, out, lse, scale, s, rep, split_len,
        q.stride(0), q.stride(1), q.stride(2), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), log_n.stride(0), log_n.stride(1), log_n.stride(2),
        hkv, splits, d=d, BLOCK_R=block_r, BLOCK_D=block_d, BLOCK_N=block_n, num_stages=2,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")  # float32 stays float32 (no TF32)
    weights = torch.softmax(lse, dim=1).nan_to_num_(0.0)  # each split's share; a split of empty slots gets 0
    merged = (weights[..., None] * out).sum(1)[:, :rep, :d]  # (b·hkv, rep, d)
    return merged.reshape(b, hq, 1, d).transpose(1, 2).to(query.dtype)
