"""Attention-score helpers for the eviction baselines (pure tensor functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .merge import take, topk_in_order


def attention_probs(queries, keys, scaling: float, chunk: int = 256):
    """Softmax attention of the captured queries over all keys, causal for the last queries.

    queries `(b, hq, q, d)` (the last q tokens), keys `(b, hkv, s, d)` → summed over each GQA group:
    `(b, hkv, q, s)` float32. Computed `chunk` queries at a time.
    """
    b, hq, q, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    k = keys.float()
    out = []
    for start in range(0, q, chunk):
        qc = queries[:, :, start:start + chunk].float().reshape(b, hkv, rep, -1, d)
        logits = torch.einsum("bgrqd,bgsd->bgrqs", qc, k) * scaling
        pos = s - q + start + torch.arange(qc.shape[3])
        logits = logits.masked_fill(torch.arange(s)[None, :] > pos[:, None], float("-inf"))
        out.append(logits.softmax(-1).sum(2))
    return torch.cat(out, dim=2)


def pool_scores(scores, kernel: int):
    """1-D average pooling along the slot axis (SnapKV's clustering of neighbours)."""
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    return F.avg_pool1d(scores.reshape(b * h, 1, s), kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False).reshape(b, h, s)


def keep_top(keys, values, log_n, scores, target: int, sinks: int, window: int):
    """Evict down to `target` entries: sinks and window always kept, the rest by highest score."""
    s = keys.shape[2]
    scores = scores.float().clone()
    scores[..., :sinks] = float("inf")
    scores[..., max(s - window, 0):] = float("inf")
    return take(keys, values, log_n, topk_in_order(scores, min(target, s)))
