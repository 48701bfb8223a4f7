"""CaM (Zhang et al., ICML 2024, "Cache Merging for Memory-efficient LLMs Inference")."""

from dataclasses import dataclass

import torch

from ..ops.merge import gather_slots
from ..ops.scores import attention_probs, top_slots
from .base import Method, register


@register
@dataclass
class CaM(Method):
    """Evict by accumulated attention (H2O scores), then merge each evicted token's value into the
    `merge_window` kept entries that follow it: each receives value / merge_window, with probability
    p = min(1, A_evicted / mean A of those entries) (Bernoulli, seeded; `sample=False` uses p).
    Values only: keys and log-mass are untouched, as in the paper."""

    merge_window: int = 32
    sample: bool = True
    seed: int = 0
    name = "cam"
    query_window = -1

    def compress(self, keys, values, log_n, ctx):
        scores = attention_probs(ctx.queries, keys, ctx.scaling).sum(2)
        idx = top_slots(scores, ctx.target, ctx.sinks, ctx.window)
        return gather_slots(keys, idx), merge_evicted_values(values, scores, idx, self.merge_window,
                                                             self.sample, self.seed), gather_slots(log_n, idx)


def merge_evicted_values(values, scores, idx, m: int, sample: bool = True, seed: int = 0):
    """values `(b, h, s, d)`, scores `(b, h, s)`, kept idx `(b, h, t)` (sorted) → kept values
    `(b, h, t, d)` with every evicted value spread over the m kept entries after it (CaM)."""
    b, h, s, d = values.shape
    t = idx.shape[-1]
    kept = torch.zeros(b, h, s, dtype=torch.bool, device=values.device).scatter_(-1, idx, True)
    first_after = kept.long().cumsum(-1) - kept.long()  # compact index of the next kept entry
    targets = first_after[..., None] + torch.arange(m, device=values.device)  # (b, h, s, m)
    valid = ~kept[..., None] & (targets < t)
    targets = targets.clamp(max=t - 1)
    kept_scores = scores.gather(-1, idx)
    mean_target = (kept_scores.gather(-1, targets.flatten(2)).view(b, h, s, m) * valid).sum(-1)
    mean_target = mean_target / valid.sum(-1).clamp_min(1)
    p = (scores / mean_target.clamp_min(1e-30)).clamp(0, 1)
    if sample:
        p = torch.bernoulli(p, generator=torch.Generator(device=p.device).manual_seed(seed))
    out = gather_slots(values, idx).float()
    share = values.float() * (p / m)[..., None]
    for o in range(m):
        w = valid[..., o, None].to(share.dtype)
        out.scatter_add_(2, targets[..., o, None].expand(b, h, s, d), share * w)
    return out.to(values.dtype)
