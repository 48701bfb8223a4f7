"""Global allocation: one budget spread over every compressed layer and KV head by the method's scores
(KVzip's and AdaKV's selection; `ScoringMethod.alloc` "layer", "head", "fit" or "adakv"), then each
head's own entries picked. `Allocation` holds what the planner computes for one compression; the
count and pick rules are pure tensor functions."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .ops.scores import fill_protected


@dataclass
class Allocation:
    """Global allocation (`ScoringMethod.alloc` "layer", "head" or "fit"): every compressed layer is
    scored first, then one budget is spread over layers and KV heads by those scores (with the
    method's `floor`). `scores[i]` `(b, h, s)` and `counts[i]` `(b, h)`: layer i's scores and the
    entries each of its heads keeps (`LayerContext.alloc`)."""

    scores: list[torch.Tensor]
    counts: list[torch.Tensor]

    @classmethod
    def of(cls, method, scored: Iterable[tuple], target: int, window: int) -> Allocation:
        """`scored`: per layer `(scores (b, h, s), log_n (b, h, s))` of every row, an iterable read once
        (a generator keeps one layer's tensors alive at a time); `target`: the uniform count per head.
        Empty slots (a head's padding from an earlier global compression: log-mass −inf) score −inf, so
        that no head keeps one while it has an entry (a chunked prefill compresses such a cache again)."""
        check_global(method)
        scores = [s.masked_fill(torch.isneginf(log_n), float("-inf")) for s, log_n in scored]
        return cls(scores, global_counts(scores, target, method.sinks, window, method.alloc, method.floor))

    def layer(self, i: int):
        return self.scores[i], self.counts[i]


def check_global(method) -> None:
    """Raise unless `method` keeps its highest-scored entries (or merges the rest into them) with
    the same budget rule in every layer: what global allocation ranks."""
    own = method.requires.layer_counts or any(p.requires.layer_counts for p in method.parts())
    if not getattr(method, "allocates", False) or own:
        raise ValueError(f"{method.name}: alloc={method.alloc!r} applies to methods that keep their highest-scored "
                         "entries (and evictmerge, which merges the rest into them); this one compresses "
                         "otherwise, or sets its own per-layer budgets")


def is_global(method) -> bool:
    return getattr(method, "alloc", "uniform") != "uniform"


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
    """The indices of the `k` highest of each row of `flat` `(b, n)`, in no order → `(b, k)` long."""
    return flat.topk(k, dim=1, sorted=False).indices if k else flat.new_zeros(flat.shape[0], 0, dtype=torch.long)


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
    s, width = scores.shape[-1], int(counts.max())
    value = fill_protected(scores, sinks, window, float("inf"))
    order = torch.argsort(value, dim=-1, descending=True, stable=True)
    ranked_in = torch.arange(s, device=scores.device) < counts[..., None]  # (b, h, s): rank r is kept
    keep = torch.zeros_like(ranked_in).scatter_(-1, order, ranked_in)
    filler = ~keep & ((~keep).cumsum(-1) <= (width - counts)[..., None])  # each head's first unkept slots
    pos = torch.arange(s, device=scores.device).expand_as(keep)
    idx = pos.masked_select(keep | filler).view(*counts.shape, width)  # exactly `width` per head, in order
    return idx, ~keep.gather(-1, idx)
