"""ZipGuard (kvmerge's own): KVzip's scores, with its copy heads ranked by another method."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.scores import guard_saturated
from .base import ScoringMethod
from .kvzip import KVzip
from .registry import get_method, register


@register
@dataclass
class ZipGuard(KVzip):
    """KVzip's reconstruction scores (see `kvzip`), except in the heads where they cannot rank: a head
    that copies the context while repeating it gives most entries a probability near 1, so its order
    says little. A head is saturated when more than `saturated` of its free entries (outside sinks and
    window) score above `level`. Its free entries keep exactly the multiset of their KVzip scores, so
    global allocation gives the head the same count, but are ranked by `fallback`
    (`ops.scores.guard_saturated`): scoring methods joined by `+`, each with its defaults, merged
    turn by turn (`round_robin`), so that each ranks an equal part of the head's entries.
    Heads that are not saturated keep KVzip's scores: on a model without copy heads this is KVzip.

    Selection as any `ScoringMethod` (`alloc="fit"` is KVzip's global ranking in real bytes); as the
    `base` of `zipmerge` / `evictmerge`, the evicted entries merge into these picks. Costs KVzip's
    second prefill plus the fallbacks' own scoring."""

    alloc: str = "uniform"
    fallback: str = "surprisal"
    saturated: float = 0.25
    level: float = 0.5
    name = "zipguard"
    experimental = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.saturated <= 1.0:
            raise ValueError(f"zipguard needs saturated in [0, 1], got {self.saturated}")
        self._fallbacks = [get_method(name.strip()) for name in str(self.fallback).split("+")]
        for part in self._fallbacks:
            if not isinstance(part, ScoringMethod):
                raise TypeError(f"zipguard's fallback must be scoring methods, got {part.name}")

    def parts(self):
        return self._fallbacks

    def scores(self, keys, log_n, ctx):
        zipped = super().scores(keys, log_n, ctx)
        order = round_robin(*(part.scores(keys, log_n, ctx).to(zipped.device) for part in self._fallbacks))
        n = zipped.shape[-1]
        lo = min(ctx.sinks, n)
        hi = max(n - ctx.window, lo)  # protected slots keep their scores: the free ones' multiset is KVzip's
        out = zipped.clone()
        out[..., lo:hi] = guard_saturated(zipped[..., lo:hi], order[..., lo:hi], self.saturated, self.level)
        return out


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

