"""Pure tensor functions shared by the methods: select, merge by assignment, compact ragged heads.

Shapes: keys/values `(b, h, s, d)`, log_n `(b, h, s)` float32 (log of token counts, -inf = empty).
"""

from __future__ import annotations

import torch

from .kv import KV, gather_slots


def masses(log_n: torch.Tensor) -> torch.Tensor:
    """Token counts from log-mass (integers by construction, so rounded), 0 for empty slots."""
    return log_n.exp().round()


def topk_in_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices `(b, h, k)` of the k highest scores, sorted by position (survivors keep their order)."""
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def weighted_mean(x, assign, weight, num_clusters: int):
    """x `(b, h, s, d)`, assign `(b, h, s)`, weight `(b, h, s)` → weighted means `(b, h, C, d)`
    (accumulated in float32 at least; zeros for a cluster with no weight)."""
    b, h, _, d = x.shape
    acc = torch.zeros(b, h, num_clusters, d, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
    total = torch.zeros(b, h, num_clusters, dtype=acc.dtype, device=x.device).scatter_add_(2, assign, weight.to(acc.dtype))
    acc.scatter_add_(2, assign[..., None].expand(*assign.shape, d), x.to(acc.dtype) * weight[..., None].to(acc.dtype))
    return (acc / total.clamp_min(1e-30)[..., None]).to(x.dtype)


def merge_clusters(keys, values, log_n, assign, num_clusters: int):
    """Mass-weighted means of the slots sharing a cluster id.

    assign `(b, h, s)` in [0, num_clusters) → keys/values `(b, h, C, d)` and log_n `(b, h, C)`
    (log of summed masses; -inf and zeros for a cluster nobody joined). Mass is conserved.
    """
    b, h = keys.shape[:2]
    n = masses(log_n)
    count = torch.zeros(b, h, num_clusters, dtype=torch.float32, device=keys.device).scatter_add_(2, assign, n)
    return KV(weighted_mean(keys, assign, n, num_clusters), weighted_mean(values, assign, n, num_clusters),
              count.log())


def cosine_sim(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the last axes, float32: a `(..., m, d)`, b `(..., n, d)` → `(..., m, n)`."""
    a = torch.nn.functional.normalize(a.float(), dim=-1)
    b = torch.nn.functional.normalize(b.float(), dim=-1)
    return a @ b.transpose(-1, -2)


def nearest_kept(keys, idx, protect=0, chunk: int = 1024):
    """(cosine, index into idx) `(b, h, s)`, `(b, h, s)` of each slot's most key-similar kept slot
    `idx` `(b, h, t)`, kept slots in `protect` excluded (the first `protect` if an int, else a
    `(b, h, t)` bool mask). Rows go `chunk` at a time, so the `(s, t)` similarities are never held."""
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    kept_t = gather_slots(unit, idx).transpose(-1, -2)  # (b, h, d, t)
    barred = torch.zeros(idx.shape, dtype=torch.float32, device=keys.device)
    if isinstance(protect, int):
        barred[..., :protect] = float("-inf")
    else:
        barred.masked_fill_(protect, float("-inf"))
    best = torch.empty(keys.shape[:3], dtype=torch.float32, device=keys.device)
    partner = torch.empty(keys.shape[:3], dtype=torch.long, device=keys.device)
    for start in range(0, keys.shape[2], chunk):
        sim = torch.matmul(unit[:, :, start:start + chunk], kept_t).add_(barred[:, :, None, :])
        torch.max(sim, -1, out=(best[:, :, start:start + chunk], partner[:, :, start:start + chunk]))
    return best, partner


def merge_into_kept(keys, values, log_n, idx, floor: float = -1.0, protect=0, attention=None, empty=None):
    """Every slot not in `idx` `(b, h, t)` joins its most key-similar kept slot when their cosine is
    ≥ `floor` (a float, or per head `(b, h, 1)`; else it is dropped); kept slots in `protect` (the first `protect` if an int, else a
    `(b, h, t)` bool mask) absorb nothing. Kept slots become degree-weighted means of keys and values
    with log_n = log of their summed mass (mass is conserved).

    With `attention` `(b, h, s)` (observed attention per slot) the merge is attention-calibrated
    instead: keys stay, values are attention-weighted means, and log_n += log(Σ A_cluster / A_kept),
    so a merged slot receives the attention its whole cluster received.

    `empty` `(b, h, t)` bool: slots of `idx` that only pad a head to the row's width (per-head counts):
    their tokens are treated as evicted (they join a kept slot), they absorb nothing, and they come
    out empty (zeros, log_n -inf)."""
    b, h, s, _ = keys.shape
    t = idx.shape[-1]
    real = torch.ones(idx.shape, dtype=torch.bool, device=idx.device) if empty is None else ~empty
    if empty is not None:
        protect = empty | (protect if not isinstance(protect, int) else torch.arange(t, device=idx.device) < protect)
    kept = torch.zeros(b, h, s, dtype=torch.bool, device=keys.device).scatter_(-1, idx, real)
    best, partner = nearest_kept(keys, idx, protect)
    join = ~kept & (best >= floor)
    own = torch.arange(t, device=idx.device).expand_as(idx)
    assign = partner.scatter(-1, idx, torch.where(real, own, partner.gather(-1, idx)))
    if attention is not None:
        weight = attention.float().clamp_min(1e-30) * (kept | join)
        total = torch.zeros(b, h, t, dtype=torch.float32, device=keys.device).scatter_add_(2, assign, weight)
        bias = gather_slots(log_n, idx) + (total / gather_slots(weight, idx).clamp_min(1e-30)).log()
        out = KV(gather_slots(keys, idx), weighted_mean(values, assign, weight, t), bias)
    else:
        weight = masses(log_n) * (kept | join)
        count = torch.zeros(b, h, t, dtype=torch.float32, device=keys.device).scatter_add_(2, assign, weight)
        out = KV(weighted_mean(keys, assign, weight, t), weighted_mean(values, assign, weight, t), count.log())
    return out if empty is None else out.emptied(empty)


def fold_values(keys, values, idx, similarity_threshold: float = 0.0, merge_fraction: float = 1.0,
                eps: float = 1e-6):
    """kvpress 0.5.5's `MergingPress.merge`: each slot not in `idx` folds its value into the kept slot
    whose key is most cosine-similar (every kept slot a candidate, sinks and window included).

    keys, values `(b, h, s, d)`, idx `(b, h, t)` kept slots (any order, no repeats, the same t per
    head) → the kept slots' values `(b, h, t, d)` in idx's order, in values' dtype. Keys, log-mass and
    everything else are left as they are: no log-mass, a merged entry gets what its key alone gets.

    An evicted slot e with best cosine c_e to kept slot k weighs w_e = max(c_e, 0)·‖v_e‖ / (‖v_e‖ +
    ‖v_k‖ + eps) when c_e ≥ `similarity_threshold` and (if `merge_fraction` < 1) c_e is at least the
    head's (1 − merge_fraction)-quantile of its evicted slots' c (those under the threshold counted as
    −inf; as in kvpress, a quantile that falls between −inf and a finite value is NaN and that head
    then folds nothing), else 0. Invariant: v_k ← (v_k + Σ_{e→k} w_e v_e) / (1 + Σ_{e→k} w_e), accumulated in float32;
    a kept slot that receives no weight keeps its value bit for bit.
    """
    b, h, s, d = values.shape
    t = idx.shape[-1]
    kept_values = gather_slots(values, idx)
    if t == 0 or t == s:
        return kept_values
    evicted = torch.ones(b, h, s, dtype=torch.bool, device=keys.device).scatter_(-1, idx, False)
    where = evicted.nonzero()[:, 2].reshape(b, h, s - t)  # evicted slots in order, as kvpress
    unit = keys.float() / keys.float().norm(dim=-1, keepdim=True).clamp(min=eps)
    best = torch.empty(b, h, s - t, dtype=torch.float32, device=keys.device)
    target = torch.empty(b, h, s - t, dtype=torch.long, device=keys.device)
    kept_t = gather_slots(unit, idx).transpose(-1, -2)  # (b, h, d, t)
    for start in range(0, s - t, 1024):  # the (evicted, kept) similarities a block of rows at a time
        sim = torch.matmul(gather_slots(unit, where[..., start:start + 1024]), kept_t)
        torch.max(sim, -1, out=(best[..., start:start + 1024], target[..., start:start + 1024]))
    ok = best >= similarity_threshold
    if merge_fraction < 1.0 and bool(ok.any()):
        floor = best.masked_fill(~ok, float("-inf")).quantile(1.0 - merge_fraction, dim=-1, keepdim=True)
        ok = ok & (best >= floor)
    evicted_values = gather_slots(values, where).float()
    evicted_norm = evicted_values.norm(dim=-1)
    target_norm = kept_values.float().norm(dim=-1).gather(2, target)
    weight = best.clamp(min=0) * ok.float() * evicted_norm / (evicted_norm + target_norm + eps)
    total = torch.zeros(b, h, t, dtype=torch.float32, device=keys.device).scatter_add_(2, target, weight)
    acc = torch.zeros(b, h, t, d, dtype=torch.float32, device=keys.device).scatter_add_(
        2, target[..., None].expand(b, h, s - t, d), weight[..., None] * evicted_values)
    folded = ((kept_values.float() + acc) / (1.0 + total)[..., None]).to(values.dtype)
    return torch.where((total > 0)[..., None], folded, kept_values)
