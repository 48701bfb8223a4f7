"""CaM (Zhang et al., ICML 2024, "Cache Merging for Memory-efficient LLMs Inference")."""

from dataclasses import dataclass

import torch

from ..ops.kv import KV, gather_slots
from ..ops.scores import received_attention, top_slots
from .base import Method, Needs
from .registry import register


@register
@dataclass
class CaM(Method):
    """Evict by accumulated attention (H2O scores), then merge each evicted token's value into the
    `merge_window` positions that follow it (those kept receive value / merge_window) with
    probability p = min(1, A_evicted / mean A over the sinks and those positions) (Bernoulli, seeded;
    `sample=False` uses p). Values only: keys and log-mass are untouched, as in the paper. The paper
    merges one token per step as it leaves the recent window (shares reaching a token evicted later
    travel on with it); here all evicted tokens are merged at once and such second-order shares are dropped."""

    merge_window: int = 32
    sample: bool = True
    seed: int = 0
    name = "cam"
    requires = Needs(queries=-1, merges=True)

    def compress(self, keys, values, log_n, ctx):
        scores = received_attention(ctx.queries, keys, ctx.scaling, log_n)
        idx = top_slots(scores, ctx.target, ctx.sinks, ctx.window)
        merged = merge_evicted_values(values, scores, idx, self.merge_window, min(ctx.sinks, idx.shape[-1]),
                                      self.sample, self.seed)
        return KV(gather_slots(keys, idx), merged, gather_slots(log_n, idx))


def merge_evicted_values(values, scores, idx, m: int, sinks: int = 0, sample: bool = True, seed: int = 0):
    """values `(b, h, s, d)`, scores `(b, h, s)`, kept idx `(b, h, t)` (sorted, sinks first) → kept
    values `(b, h, t, d)`: every evicted value i adds p_i · v_i / m to each kept entry among the m
    positions after it, p_i = min(1, A_i / mean A over the sinks and those m positions) (CaM)."""
    b, h, s, d = values.shape
    kept = torch.zeros(b, h, s, dtype=torch.bool, device=values.device).scatter_(-1, idx, True)
    a = scores.float()
    window = torch.nn.functional.pad(a, (0, m)).unfold(-1, m, 1)[..., 1:, :]  # (b, h, s, m): positions i+1..i+m
    inside = torch.nn.functional.pad(torch.ones_like(a), (0, m)).unfold(-1, m, 1)[..., 1:, :]
    sink_sum = a[..., :sinks].sum(-1, keepdim=True)
    mean = (window.sum(-1) + sink_sum) / (inside.sum(-1) + sinks).clamp_min(1)
    p = (a / mean.clamp_min(1e-30)).clamp(0, 1) * ~kept
    if sample:
        # one generator per row, so that a row's draws do not depend on the rows batched with it
        p = torch.stack([torch.bernoulli(row, generator=torch.Generator(device=p.device).manual_seed(seed)) for row in p])
    share = values.float() * (p / m)[..., None]
    out = values.float().clone()
    for o in range(1, min(m, s - 1) + 1):  # position i + o receives share i
        out[:, :, o:] += share[:, :, :-o]
    return gather_slots(out, idx).to(values.dtype)
