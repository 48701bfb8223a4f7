"""Attention-score helpers for the eviction baselines (pure tensor functions)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .merge import topk_in_order


def attention_probs(queries, keys, scaling: float, log_n=None, chunk: int = 256):
    """Softmax attention of the captured queries over all keys, causal for the last queries.

    queries `(b, hq, q, d)` (the last q tokens), keys `(b, hkv, s, d)`, optional log_n `(b, hkv, s)`
    added to the logits → summed over each GQA group: `(b, hkv, q, s)` float32, `chunk` queries at a time.
    """
    b, hq, q, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    k = keys.float()
    out = []
    for start in range(0, q, chunk):
        qc = queries[:, :, start:start + chunk].float().reshape(b, hkv, rep, -1, d)
        end = s - q + start + qc.shape[3]  # keys after the chunk's last query are masked anyway
        logits = torch.einsum("bgrqd,bgsd->bgrqs", qc, k[:, :, :end]) * scaling
        if log_n is not None:
            logits = logits + log_n[:, :, None, None, :end]
        pos = end - qc.shape[3] + torch.arange(qc.shape[3], device=k.device)
        logits = logits.masked_fill(torch.arange(end, device=k.device)[None, :] > pos[:, None], float("-inf"))
        out.append(F.pad(logits.softmax(-1).sum(2), (0, s - end)))
    return torch.cat(out, dim=2)


def received_attention(queries, keys, scaling: float, log_n=None, chunk: int = 256):
    """Attention each slot received, summed over the queries and each GQA group: `(b, hkv, s)`
    float32; equal to `attention_probs(...).sum(2)` without holding the `(q, s)` probabilities.

    Per chunk of queries: one product for the logits, the causal mask on the chunk's own diagonal
    block only, exp in place, and the row normalisation folded into the sum over rows (a product).
    """
    b, hq, q, d = queries.shape
    hkv, s = keys.shape[1], keys.shape[2]
    rep = hq // hkv
    k = keys.float()
    total = torch.zeros(b, hkv, s, dtype=torch.float32, device=keys.device)
    for start in range(0, q, chunk):
        c = min(chunk, q - start)
        end = s - q + start + c  # keys after the chunk's last query are masked anyway
        qc = queries[:, :, start:start + c].float().reshape(b, hkv, rep * c, d)
        logits = torch.matmul(qc, k[:, :, :end].transpose(-1, -2)).mul_(scaling)  # (b, hkv, rep·c, end)
        if log_n is not None:
            logits += log_n[:, :, None, :end]
        own = logits.view(b, hkv, rep, c, end)[..., end - c:]  # each query against the chunk's own keys
        own.masked_fill_(torch.ones(c, c, dtype=torch.bool, device=keys.device).triu(1), float("-inf"))
        logits.sub_(logits.amax(-1, keepdim=True)).exp_()
        weight = logits.sum(-1).reciprocal_()[:, :, None, :]  # (b, hkv, 1, rep·c): 1 / softmax normaliser
        total[:, :, :end] += torch.matmul(weight, logits).squeeze(2)
    return total


def pool_scores(scores, kernel: int):
    """1-D average pooling along the slot axis (SnapKV's clustering of neighbours)."""
    if kernel <= 1:
        return scores
    b, h, s = scores.shape
    return F.avg_pool1d(scores.reshape(b * h, 1, s), kernel, stride=1, padding=kernel // 2,
                        count_include_pad=False).reshape(b, h, s)


def top_slots(scores, target: int, sinks: int, window: int):
    """Indices `(b, h, target)` in order: sinks and window always, the rest by highest score."""
    return topk_in_order(fill_protected(scores, sinks, window, float("inf")), min(target, scores.shape[-1]))


def fill_protected(scores, sinks: int, window: int, value: float):
    """A float copy of `scores` `(..., s)` with the first `sinks` and last `window` slots set to `value`."""
    s = scores.shape[-1]
    scores = scores.float().clone()
    scores[..., :sinks] = value
    scores[..., max(s - window, 0):] = value
    return scores


def evict_rows(log_n, scores, targets, sinks: int, window: int):
    """Per-row eviction on a padded cache: row b keeps at most `targets[b]` live slots (its first
    `sinks` and last `window` live slots always, then the highest scores).

    log_n `(b, h, s)` (-inf = empty slot), scores `(b, h, s)`, targets `(b,)` → (idx `(b, h, W)` in
    order, `filler` `(b, h, W)` bool: slots kept only to give every row the same width W; the caller
    marks them empty).
    """
    live = ~torch.isinf(log_n)
    n_live = live.sum(-1, keepdim=True)
    rank = live.long().cumsum(-1) - 1
    protect = live & ((rank < sinks) | (rank >= n_live - window))
    value = torch.where(protect, float("inf"), scores.float()).masked_fill(~live, float("-inf"))
    order = value.sort(dim=-1, descending=True, stable=True).indices
    by_value = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1], device=order.device)
                                                 .expand_as(order).contiguous())
    keep_live = torch.minimum(n_live, targets.to(n_live.device)[:, None, None])
    keep = live & (by_value < keep_live)
    width = int(keep_live.max())
    # fill each row to `width` with empty slots first, then the lowest-valued evicted ones
    preference = keep.float() * 2 + (~live).float()
    idx = preference.topk(width, dim=-1, sorted=True).indices.sort(-1).values
    return idx, ~keep.gather(-1, idx)


def sentence_mean(values, is_end):
    """Each position's sentence average of `values` `(b, n)`; a sentence ends at an `is_end` position
    `(b, n)` bool, which belongs to it. Returns `(b, n)` float32."""
    seg = F.pad(is_end.long().cumsum(-1), (1, 0))[:, :-1]  # sentence index of every position
    total = torch.zeros(values.shape, dtype=torch.float32, device=values.device).scatter_add_(-1, seg, values.float())
    count = torch.zeros_like(total).scatter_add_(-1, seg, torch.ones_like(total))
    return (total / count.clamp_min(1)).gather(-1, seg)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's pairing (transformers' convention): x = [x1, x2] → [−x2, x1] on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def saturated_heads(scores, saturated: float, level: float = 0.5):
    """`(b, h, 1)` bool: the heads of `scores` `(b, h, s)` with more than `saturated` of their entries
    above `level` (a copy head's KVzip scores; an empty head is not saturated)."""
    return (scores.float() > level).float().mean(-1, keepdim=True) > saturated


def guard_saturated(scores, order, saturated: float, level: float = 0.5):
    """`scores` `(b, h, s)` with each saturated head (`saturated_heads`) reordered by `order` `(b, h, s)`:
    the head's own score values, sorted, handed out by `order`'s rank (the same multiset, so any
    allocation by value is unchanged; `order`'s ties kept in position order)."""
    hot = saturated_heads(scores, saturated, level)
    if not bool(hot.any()):
        return scores
    values = scores.sort(-1, descending=True).values
    rank = torch.argsort(order.float(), dim=-1, descending=True, stable=True)
    return torch.where(hot, torch.empty_like(scores).scatter_(-1, rank, values), scores)


