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


def reconstruction_attention(queries, keys, log_n, sinks: int, scaling: float, row_scale=None, column_scale=None,
                             block: int = 128):
    """KVzip's score for one row's context chunk: queries `(hq, q, d)` of the reconstruction, keys
    `(h, k, d)` and log_n `(h, k)` (or None) laid out [sinks; chunk; the q reconstruction tokens' own]
    → `(h, k - sinks - q)`: for each chunk key, the highest attention probability any query head of
    its group gives it at any reconstruction position, the softmax over all k keys (causal among the
    reconstruction's own). KVzip+: each probability times `row_scale` `(q,)` of its position and
    `column_scale` `(hq, k)` of its query head and key before the max.

    Computed in log space, `block` queries at a time: max exp(x − lse) = exp(max(x − lse)), so no
    probability matrix is formed, and a block's logits stay in cache."""
    hq, q, _d = queries.shape
    h, k, _ = keys.shape
    g, chunk = hq // h, k - sinks - q
    causal = torch.full((q, q), float("-inf"), device=keys.device).triu(1)
    log_row = None if row_scale is None else row_scale.float().log()[None, :, None]
    best = torch.full((h, chunk), float("-inf"), device=keys.device)
    for j in range(h):  # one KV head at a time: (g, block, k) logits
        keys_t = keys[j].float().T * scaling
        group = queries[j * g:(j + 1) * g].float()
        bias = None if log_n is None else log_n[j].float()
        log_col = (None if column_scale is None
                   else column_scale[j * g:(j + 1) * g, None, sinks:sinks + chunk].float().log())
        for s in range(0, q, block):
            logits = group[:, s:s + block] @ keys_t
            if bias is not None:
                logits += bias
            logits[..., k - q:] += causal[s:s + block]
            part = logits[..., sinks:sinks + chunk].sub_(logits.logsumexp(-1, keepdim=True))
            if log_row is not None:
                part = part + log_row[:, s:s + block] + log_col
            best[j] = torch.maximum(best[j], part.amax((0, 1)))
    return best.exp()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's pairing (transformers' convention): x = [x1, x2] → [−x2, x1] on the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def echo_attention(queries, keys, log_n, scaling: float, cos, sin, own: int = 16, block: int = 256):
    """KVzip's reconstruction scores guessed from the prefill's own queries, with no second forward.

    queries `(hq, q, d)` post-RoPE, of the positions of the last q of the s keys `(h, s, d)`; log_n
    `(h, s)` or None; cos, sin `(d,)` a RoPE rotation by Δ (about the context's length: where a repeat
    of the context would ask each query again). Each query, moved Δ on, attends to all s keys; beside
    them, as the repeat's own recent keys, it sees its last `own` keys at their true distance (causal).
    → `(h, q)`: for each of the last q keys, the highest probability any query head of its group gives it
    at any position (softmax over the s keys and the `own` ones)."""
    hq, q, _ = queries.shape
    h, s, _ = keys.shape
    g = hq // h
    moved = queries.float() * cos + rotate_half(queries.float()) * sin
    at = torch.arange(s - q, s, device=keys.device)  # each query's own position among the key slots
    near = at[:, None] - torch.arange(own, device=keys.device)  # (q, own): its last `own` slots
    bias = torch.zeros(h, s, device=keys.device) if log_n is None else log_n.float()
    out = torch.zeros(h, s, device=keys.device)
    for j in range(h):
        k = keys[j].float()
        for c in range(0, q, block):
            z = moved[j * g:(j + 1) * g, c:c + block] @ k.T * scaling + bias[j]  # (g, blk, s)
            idx = near[c:c + block]
            z_own = torch.einsum("gbd,bod->gbo", queries[j * g:(j + 1) * g, c:c + block].float(),
                                 k[idx.clamp(min=0)]) * scaling + bias[j][idx.clamp(min=0)]
            z_own = z_own.masked_fill(idx < 0, float("-inf"))
            lse = torch.logaddexp(torch.logsumexp(z, -1, keepdim=True), torch.logsumexp(z_own, -1, keepdim=True))
            out[j] = torch.maximum(out[j], z.sub_(lse).amax((0, 1)).exp())
    return out[:, s - q:]


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


def round_robin(*scores):
    """Rankings `(…, s)` (higher first) merged turn by turn: the best of the first, the best of the
    second, …, then each one's second best; an entry two rankings share is placed at its earliest
    turn → `(…, s)` float scores, higher first. After j turns of every ranking, exactly the union of
    each ranking's top j entries is ahead of the rest."""
    turn = None
    for i, x in enumerate(scores):
        order = torch.argsort(x.float(), dim=-1, descending=True, stable=True)
        steps = torch.arange(x.shape[-1], device=x.device).expand_as(order).contiguous()
        t = torch.empty_like(order).scatter_(-1, order, steps) * len(scores) + i
        turn = t if turn is None else torch.minimum(turn, t)
    return -turn.float()


def global_counts(scores: list[torch.Tensor], target: int, sinks: int, window: int, mode: str,
                  floor: float = 0.0) -> torch.Tensor:
    """How many entries each (layer, row, head) keeps when the budget is spent globally (KVzip, AdaKV).

    scores: one `(b, h, s_l)` per layer (same b, h; a layer narrower than the widest, s, is padded with
    −inf after its own window: a chunked prefill's layers differ in width). Every head keeps its protected sinks + window
    and, with `floor` > 0 (AdaKV's safeguard), its own best entries up to round(`floor`·`target`) in
    all; the rest of the row's L·h·`target` entries go to the highest unprotected scores over every
    layer and head together. `mode`:
    * "head": counts per (layer, row, head), as picked (a layer's heads are later padded to its largest);
    * "layer": each layer's picks evened out over its heads (one count per layer and row, the total kept);
    * "fit": the per-head picks with the padding paid for: the longest prefix of the global ranking whose
      layers, each as wide as its widest head, fit in L·`target` slots per head; every head of a layer
      then keeps that width (its padding filled with its own next-best entries).
    → `(L, b, h)` long; "head" and "layer" rows sum to at most L·h·`target`, "fit" rows' layer widths
    (max over heads) sum to at most L·`target`.
    """
    L, (b, h, _), s = len(scores), scores[0].shape, max(x.shape[-1] for x in scores)
    target = min(target, s)
    protected = min(sinks + window, s)
    free = torch.stack([F.pad(fill_protected(x, sinks, window, float("-inf")), (0, s - x.shape[-1]), value=float("-inf"))
                        for x in scores], 1)  # (b, L, h, s)
    safe = min(max(round(floor * target) - protected, 0), max(target - protected, 0))
    if safe:  # each head's own top `safe` free entries rank first (AdaKV's safeguard)
        free = free.float()
        free = free.scatter(-1, free.topk(safe, dim=-1).indices, torch.finfo(torch.float32).max)
    if mode == "fit":
        return _fitted_widths(free, protected, L * target).permute(1, 0, 2).contiguous()
    if mode == "adakv":  # each layer's own pool, over its heads only
        widths = [min(target, x.shape[-1]) for x in scores]
        counts = torch.stack([protected + _per_head(_top(free[:, i].reshape(b, -1), h * max(w - protected, 0)) // s, h)
                              for i, w in enumerate(widths)])
        return counts
    picked = _top(free.reshape(b, -1), L * h * max(target - protected, 0)) // s
    counts = protected + _per_head(picked, L * h).view(b, L, h)
    if mode == "layer":  # each layer's total over its heads, floored, the remainders to the largest fractions
        total = counts.sum(-1)  # (b, L)
        even, extra = total // h, total % h
        spare = (extra.sum(-1, keepdim=True) // h)  # whole entries per head left to hand out, per row
        order = torch.argsort(extra, dim=-1, descending=True, stable=True)
        bonus = torch.zeros_like(even).scatter_(-1, order, (torch.arange(L, device=even.device) < spare).long())
        counts = (even + bonus).clamp(max=s)[..., None].expand(b, L, h)
    return counts.permute(1, 0, 2).contiguous()


def _top(flat: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the `k` highest of each row of `flat` `(b, n)` → `(b, k)` long."""
    return flat.topk(k, dim=1).indices if k else flat.new_zeros(flat.shape[0], 0, dtype=torch.long)


def _per_head(picked: torch.Tensor, heads: int) -> torch.Tensor:
    """Flat (layer·head) indices `(b, k)` → how many fall in each of `heads` groups `(b, heads)`."""
    return torch.zeros(picked.shape[0], heads, dtype=torch.long, device=picked.device).scatter_add_(
        1, picked, torch.ones_like(picked))


def _fitted_widths(free: torch.Tensor, protected: int, slots: int) -> torch.Tensor:
    """free `(b, L, h, s)` unprotected scores (-inf where protected) → `(b, L, h)` widths: for each row,
    the most top-ranked entries k such that Σ_layers max_head(protected + picks) ≤ `slots` (found by
    bisection: the sum only grows with k), each layer's width given to all its heads."""
    b, L, h, s = free.shape
    order = free.reshape(b, -1).argsort(dim=1, descending=True, stable=True) // s  # (b, L·h·s) → layer·head
    out = []
    for r in range(b):
        def widths(k):
            return (protected + _per_head(order[r:r + 1, :k], L * h).view(L, h)).amax(-1)

        lo, hi = 0, L * h * (s - protected)  # widths(lo) fits (if anything does), find the largest k that does
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if int(widths(mid).sum()) <= slots else (lo, mid - 1)
        out.append(widths(lo).clamp(max=s)[:, None].expand(L, h))
    return torch.stack(out)


def top_slots_per_head(scores: torch.Tensor, counts: torch.Tensor, sinks: int, window: int):
    """Each head keeps its own number of slots: scores `(b, h, s)`, counts `(b, h)` → (idx `(b, h, W)` in
    position order, W the largest count; `filler` `(b, h, W)` bool: slots beyond a head's count, to be
    marked empty). Protected slots are always kept, so the last `window` slots stay the recent window."""
    s = scores.shape[-1]
    value = fill_protected(scores, sinks, window, float("inf"))
    order = torch.argsort(value, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(s, device=order.device).expand_as(order).contiguous())
    keep = rank < counts[..., None]
    pos = torch.arange(s, device=scores.device).expand_as(order)
    idx = torch.where(keep, pos, pos + s).argsort(-1)[..., :int(counts.max())].sort(-1).values
    return idx, ~keep.gather(-1, idx)
