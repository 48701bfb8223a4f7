"""CentroidKV's pure part: one round of Chunked Soft Matching on the eligible region.

Shapes: keys/values `(b, h, n, d)`, log_n `(b, h, n)`; entries are merged as degree-weighted means.
"""

from __future__ import annotations

import torch

from .merge import cosine_sim, merge_clusters

PARTITIONS = ("alternating", "random", "halves")


def partition_a(n: int, chunk: int, how: str = "alternating", seed: int = 0) -> torch.Tensor:
    """`(n,)` bool, True for set A: even offsets in each chunk (alternating), a random half, or the
    first half of each chunk (halves). The rest is set B."""
    offset = torch.arange(n) % chunk
    if how == "alternating":
        return offset % 2 == 0
    if how == "halves":
        size = torch.full((n,), chunk)
        tail = n % chunk
        if tail:
            size[n - tail:] = tail
        return offset < (size + 1) // 2
    if how == "random":
        g = torch.Generator().manual_seed(seed)
        keys = torch.rand(n, generator=g) + torch.div(torch.arange(n), chunk, rounding_mode="floor")
        rank = keys.argsort().argsort() % chunk  # rank inside the chunk
        return rank % 2 == 0
    raise ValueError(f"partition must be one of {PARTITIONS}, got {how!r}")


def best_partners(keys: torch.Tensor, is_a: torch.Tensor, chunk: int):
    """For every A entry, its most cosine-similar B entry in the same chunk.

    → (score `(b, h, n)` (-inf for B entries and A entries without a B), partner `(b, h, n)` index).
    """
    b, h, n, d = keys.shape
    pad = (-n) % chunk
    k = torch.nn.functional.pad(keys, (0, 0, 0, pad)).reshape(b, h, -1, chunk, d)
    a = torch.nn.functional.pad(is_a.to(keys.device), (0, pad), value=False).reshape(-1, chunk)
    real = torch.nn.functional.pad(torch.ones(n, dtype=torch.bool, device=keys.device), (0, pad)).reshape(-1, chunk)
    sim = cosine_sim(k, k)  # (b, h, nc, c, c)
    allowed = (a[:, :, None] & ~a[:, None, :] & real[:, None, :])  # row A, column B
    sim = sim.masked_fill(~allowed, float("-inf"))
    score, col = sim.max(-1)
    partner = col + torch.arange(0, n + pad, chunk, device=keys.device)[:, None]
    return score.reshape(b, h, -1)[..., :n], partner.reshape(b, h, -1)[..., :n]


def csm_round(keys, values, log_n, m: int, chunk: int, is_a: torch.Tensor, scope: str = "global"):
    """Merge the `m` best-matched A entries (per row and head) into their B partners.

    `scope="global"` ranks all A entries of the stream; `"chunk"` takes the top share in each chunk.
    Survivors keep their order; returns `n - m` entries (fewer if fewer A entries have a partner).
    """
    b, h, n, _ = keys.shape
    score, partner = best_partners(keys, is_a, chunk)
    if scope == "chunk":
        nc = -(-n // chunk)
        per_chunk = torch.nn.functional.pad(score, (0, nc * chunk - n), value=float("-inf")).reshape(b, h, nc, chunk)
        share = -(-m // nc)
        top = per_chunk.topk(min(share, chunk), dim=-1)
        rank_in_chunk = torch.full_like(per_chunk, float("inf")).scatter_(-1, top.indices,
                                                                           torch.arange(share, dtype=score.dtype, device=score.device)
                                                                           .expand_as(top.values))
        # round-robin over chunks so exactly m are taken, best-in-chunk first
        key = rank_in_chunk.reshape(b, h, -1)[..., :n] - score.clamp(-1, 1) * 1e-3
        chosen = (-key).topk(m, dim=-1).indices
    else:
        chosen = score.topk(m, dim=-1).indices
    ok = score.gather(-1, chosen) > float("-inf")
    target = torch.arange(n, device=keys.device).expand(b, h, n).clone()
    target.scatter_(-1, chosen, torch.where(ok, partner.gather(-1, chosen), chosen))
    is_root = target == torch.arange(n, device=keys.device)
    slot = is_root.long().cumsum(-1) - 1
    return merge_clusters(keys, values, log_n, slot.gather(-1, target), int(is_root.sum(-1).max()))
