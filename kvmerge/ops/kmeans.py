"""Mass-weighted k-means (Lloyd) on keys, per row and KV head: the k-means baseline's pure part."""

from __future__ import annotations

import torch

from .merge import masses, weighted_mean


def lloyd(keys: torch.Tensor, log_n: torch.Tensor, k: int, iters: int = 5) -> torch.Tensor:
    """Cluster ids `(b, h, n)` in [0, k) after `iters` Lloyd steps (L2 on keys, each entry weighted
    by its mass) from k evenly spaced seeds. An empty cluster is reseeded on the entry farthest from
    its centroid (the i-th empty cluster on the i-th farthest)."""
    n = keys.shape[2]
    x = keys.float()
    weight = masses(log_n)
    centroids = x[:, :, torch.linspace(0, n - 1, k, device=x.device).round().long()]
    dist = torch.cdist(x, centroids)
    for _ in range(iters):
        assign = dist.argmin(-1)
        used = torch.zeros_like(centroids[..., 0]).scatter_add_(2, assign, weight) > 0
        far = (dist.min(-1).values * (weight > 0)).topk(k, dim=-1).indices  # (b, h, k) farthest first
        empty_rank = ((~used).long().cumsum(-1) - 1).clamp_min(0)
        reseed = x.gather(2, far.gather(-1, empty_rank)[..., None].expand_as(centroids))
        centroids = torch.where(used[..., None], weighted_mean(x, assign, weight, k), reseed)
        dist = torch.cdist(x, centroids)
    return dist.argmin(-1)
