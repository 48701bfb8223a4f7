"""SemantiCache (arXiv 2603.14303): delimiter chunks, Greedy Seed-based Clustering, semantic cores."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..ops.gsc import STRONG_ANCHOR, chunk_layout, delimiter_table, greedy_seed_clustering
from ..ops.merge import merge_clusters
from .base import Method, Needs
from .registry import register

CHUNKINGS = ("delimiter", "fixed", "none")


@register
@dataclass
class SemantiCache(Method):
    """Split the context at punctuation, cluster keys inside each chunk with GSC (cosine ≥ τ to the
    seed), merge each cluster into its mass-weighted mean with log-mass log|S|; delimiters stay.

    τ is found per layer and KV head by bisection (least merging within the budget) unless `tau` is
    given: a fixed τ alone decides what merges (the paper's fixed-τ ablation) and the budget is not
    enforced (a warning says so; `cache_entries` in the stats is what was kept). Below the floor
    (anchors + one core per chunk) chunks grow hierarchically: weak delimiters `,;:` are merged into
    chunks, then sentences, then chunks double; `stats["fallback_layers"]` counts it.
    Ablations: `chunking="fixed"` (64-token chunks), `"none"` (one global cluster pass),
    `proportional=False` (no log-mass bias), `shared_heads=True` (one clustering for all KV heads).
    """

    tau: float | None = None
    chunk_cap: int = 64
    chunking: str = "delimiter"
    shared_heads: bool = False
    proportional: bool = True
    search_rounds: int = 3
    search_width: int = 7
    name = "semanticache"

    def __post_init__(self):
        super().__post_init__()
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking must be one of {CHUNKINGS}, got {self.chunking!r}")
        if self.chunk_cap < 1:
            raise ValueError(f"chunk_cap must be >= 1, got {self.chunk_cap}")
        if self.tau is not None and self.budget != 1.0:
            logging.getLogger("kvmerge").warning(
                f"kvmerge: semanticache with tau={self.tau} merges by that threshold alone; the budget "
                f"{self.budget} is not enforced (leave tau out to meet it)")
        self._table = None

    @property
    def requires(self) -> Needs:
        return Needs(merges=True, tokenizer=self.chunking == "delimiter")

    def setup(self, runtime):
        if self.chunking == "delimiter":
            if runtime.tokenizer is None:
                raise ValueError("SemantiCache's delimiter chunking needs the tokenizer: use kvmerge.generate, "
                                 "or pass tokenizer= to generate_ids")
            self._table = delimiter_table(runtime.tokenizer)
        self.stats.clear()
        self.stats.update(fallback_layers=0, tau_mean=[])

    def _levels(self, kinds: torch.Tensor, n: int):
        """(is_anchor, cap) from the finest chunking to the coarsest (the hierarchical fallback)."""
        none = torch.zeros_like(kinds, dtype=torch.bool)
        if self.chunking == "none":
            yield none, max(n, 1)
            return
        if self.chunking == "delimiter":
            yield kinds > 0, self.chunk_cap
            yield kinds == STRONG_ANCHOR, self.chunk_cap
        cap = self.chunk_cap
        while True:
            yield none, cap
            if cap >= n:
                return
            cap *= 2

    def compress(self, keys, values, log_n, ctx):
        b, h, s, d = keys.shape
        lo, hi = self._middle(s, ctx)
        rep = self._representatives(keys, ctx, lo, hi)
        rep_full = torch.arange(s, device=keys.device).expand(b, h, s).clone()
        rep_full[:, :, lo:hi] = rep + lo
        is_rep = rep_full == torch.arange(s, device=keys.device)
        slot = is_rep.long().cumsum(-1) - 1
        assign = slot.gather(-1, rep_full)
        merged = merge_clusters(keys, values, log_n, assign, int(is_rep.sum(-1).max()))
        if not self.proportional:
            merged = merged._replace(log_n=torch.where(torch.isfinite(merged.log_n), 0.0, merged.log_n))
        return merged

    @staticmethod
    def _middle(s: int, ctx) -> tuple[int, int]:
        """The slots clustered: between sinks and window, and (chunked prefill) only among the plain
        tokens not yet compressed; earlier cores stay as they are."""
        fresh = s if ctx.token_ids is None else ctx.token_ids.shape[1]
        lo = max(min(ctx.sinks, s), s - fresh)
        return lo, max(lo, s - ctx.window)

    def _representatives(self, keys, ctx, lo, hi):
        """Representative index `(b, h, hi - lo)` of each middle token."""
        b, h, s, d = keys.shape
        n = hi - lo
        allow = ctx.target - lo - (s - hi)
        if self.chunking == "delimiter":
            if ctx.token_ids is None:
                raise ValueError("SemantiCache needs the token ids of the context (compress at prefill)")
            first = s - ctx.token_ids.shape[1]
            kinds = self._table.to(keys.device)[ctx.token_ids[:, lo - first:hi - first]]
        else:
            kinds = torch.zeros(b, n, dtype=torch.int8, device=keys.device)
        for level, (is_anchor, cap) in enumerate(self._levels(kinds, n)):
            layout = chunk_layout(is_anchor, cap)
            min_entries = is_anchor.sum(-1) + torch.bincount(layout[2], minlength=b)
            if self.tau is not None or bool((min_entries <= allow).all()):
                break
        self.stats["fallback_layers"] += int(level > 0)
        return self._cluster(keys[:, :, lo:hi], is_anchor, layout, allow)

    def _cluster(self, keys, is_anchor, layout, allow):
        """Representative index `(b, h, n)` of each middle token (itself for anchors and seeds)."""
        b, h, n, d = keys.shape
        chunk_of, offset, row_of_chunk, longest = layout
        rep = torch.arange(n, device=keys.device).expand(b, h, n).clone()
        if longest == 0:
            return rep
        C = len(row_of_chunk)
        member = chunk_of >= 0
        dev = keys.device
        slot_token = torch.zeros(C, longest, dtype=torch.long, device=dev)
        valid = torch.zeros(C, longest, dtype=torch.bool, device=dev)
        t = torch.arange(n, device=dev).expand(b, n)
        slot_token[chunk_of[member], offset[member]] = t[member]
        valid[chunk_of[member], offset[member]] = True
        unit = torch.nn.functional.normalize(keys.float(), dim=-1)
        ck = unit[row_of_chunk[:, None], :, slot_token]  # (C, L, h, d)
        ck = ck.permute(0, 2, 1, 3)
        if self.shared_heads:
            ck = torch.nn.functional.normalize(ck.mean(1, keepdim=True), dim=-1)
        sim = ck @ ck.transpose(-1, -2)  # (C, h or 1, L, L)
        valid = valid[:, None, :].expand(C, sim.shape[1], longest)
        fixed = is_anchor.sum(-1)[:, None]  # anchors are kept, (b, 1)

        def roots(tau):  # tau (..., b, heads) → root (..., C, heads, L)
            return greedy_seed_clustering(sim, valid, tau[..., row_of_chunk, :])

        def fits(tau):  # entries(τ) within the budget, (..., b, heads)
            is_root = (roots(tau) == torch.arange(longest, device=dev)) & valid
            per_chunk = is_root.sum(-1)
            total = torch.zeros(*per_chunk.shape[:-2], b, per_chunk.shape[-1], dtype=torch.long, device=dev)
            return fixed + total.index_add_(-2, row_of_chunk, per_chunk) <= allow

        heads = sim.shape[1]
        if self.tau is not None:
            tau = torch.full((b, heads), float(self.tau), device=dev)
        else:  # largest feasible τ, by a parallel grid search refined `search_rounds` times
            lo_t, hi_t = torch.full((b, heads), -1.01, device=dev), torch.full((b, heads), 1.0 + 1e-6, device=dev)
            ok_hi = fits(hi_t)
            steps = torch.arange(1, self.search_width + 1, device=dev)[:, None, None] / (self.search_width + 1)
            for _ in range(self.search_rounds):
                cands = lo_t + (hi_t - lo_t) * steps  # (K, b, heads), increasing
                best = (fits(cands).long() * torch.arange(1, self.search_width + 1, device=dev)[:, None, None]).amax(0)
                pick = lambda i: cands.gather(0, (i - 1).clamp(0, self.search_width - 1)[None])[0]  # noqa: E731
                lo_t = torch.where(best > 0, pick(best), lo_t)
                hi_t = torch.where(best < self.search_width, pick(best + 1), hi_t)
            tau = torch.where(ok_hi, hi_t, lo_t)
        self.stats["tau_mean"].append(round(float(tau.mean()), 4))
        root = roots(tau).expand(C, h, longest)  # (C, h, L) offsets of seeds
        root_token = slot_token[torch.arange(C, device=dev)[:, None, None], root]  # (C, h, L)
        rows = row_of_chunk[:, None].expand(C, longest)[valid[:, 0]]
        toks = slot_token[valid[:, 0]]
        rep[rows, :, toks] = root_token.permute(0, 2, 1)[valid[:, 0]]
        return rep
