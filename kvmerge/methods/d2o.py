"""D2O (Wan et al., 2024, arXiv 2406.13035): Dynamic Discriminative Operations."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..ops.kv import KV, gather_slots
from ..ops.merge import nearest_kept, weighted_mean
from ..ops.scores import received_attention, top_slots
from .base import Method, Needs, ScoringMethod, check_scoring_part
from .h2o import H2O
from .registry import register


@register
@dataclass
class D2O(Method):
    """Layer level: each layer's budget is proportional to its attention density (inverse variance
    of the attention the entries receive from the last `obs_window` prompt queries), clipped to
    [1/`max_ratio`, `max_ratio`] × budget and renormalised so the total is unchanged.
    Token level: `base`'s scores (H2O's accumulated attention, as in the paper) pick the kept entries; each evicted token finds
    its most similar kept entry (key cosine u) and is merged into it when u ≥ τ, with weights
    exp(u) / (Σ exp(u) + e) and e for the kept entry itself (keys and values). τ is an exponential
    moving average (`ema`) over layers of each layer's mean best similarity. No log-mass, as in the paper.
    """

    obs_window: int = 32
    max_ratio: float = 2.0
    ema: float = 0.5
    base: ScoringMethod = field(default_factory=H2O)
    name = "d2o"

    @property
    def requires(self) -> Needs:
        return Needs(queries=self.obs_window, all_layers=True, layer_counts=True, merges=True)

    def parts(self):
        return [self.base]

    def __post_init__(self):
        super().__post_init__()
        if not (0.0 <= self.ema < 1.0) or self.max_ratio < 1.0:
            raise ValueError(f"need 0 <= ema < 1 and max_ratio >= 1, got ema={self.ema}, max_ratio={self.max_ratio}")
        check_scoring_part(self, "base")
        self._scale: list[float] = []
        self._tau: float | None = None

    def plan(self, layers, states, ctx):
        density = []
        for layer, state in zip(layers, states):
            q = state.queries[:, :, -self.obs_window:]
            received = received_attention(q, layer.keys, ctx.scaling, layer.full_log_n()).nan_to_num()  # (b, h, s); a row of padding only gives NaN
            density.append(1.0 / float(received.var(-1).mean().clamp_min(1e-12)))
        scale = torch.tensor(density) / (sum(density) / len(density))
        for _ in range(8):  # clip, renormalise the rest
            scale = scale.clamp(1 / self.max_ratio, self.max_ratio)
            scale = scale / scale.mean()
        self._scale, self._tau = scale.tolist(), None

    def layer_target(self, ctx):
        scale = self._scale[ctx.layer_idx] if self._scale else 1.0
        return max(round(ctx.target * scale), ctx.sinks + ctx.window)

    def compress(self, keys, values, log_n, ctx):
        n = keys.shape[2]
        target = min(self.layer_target(ctx), n)
        scores = self.base.scores(keys, log_n, ctx)
        idx = top_slots(scores, target, ctx.sinks, ctx.window)
        self.tell_selected(idx, ctx)
        kept = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
        best, partner = nearest_kept(keys, idx)
        live = ~torch.isinf(log_n)  # empty slots (a head's padding) are neither merged nor averaged
        evicted_best = best[~kept & live]
        layer_mean = float(evicted_best.mean()) if evicted_best.numel() else 1.0
        self._tau = layer_mean if self._tau is None else self.ema * self._tau + (1 - self.ema) * layer_mean
        merge = ~kept & live & (best >= self._tau)
        self.stats["merged_fraction"] = float(merge.sum() / max(int((~kept & live).sum()), 1))
        slot = torch.arange(idx.shape[-1], device=idx.device).expand_as(idx)
        assign = partner.scatter(-1, idx, slot)  # kept entries map to themselves
        weight = torch.where(kept, math.e, torch.where(merge, best.exp(), 0.0))
        t = idx.shape[-1]
        return KV(weighted_mean(keys, assign, weight, t), weighted_mean(values, assign, weight, t),
                  gather_slots(log_n, idx))
