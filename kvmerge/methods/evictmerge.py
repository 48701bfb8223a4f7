"""Merge instead of evict (kvmerge's own): any scoring eviction method turned into a merging one."""

from dataclasses import dataclass, field

import torch

from ..ops.kv import KV
from ..ops.merge import merge_into_kept
from ..allocation import top_slots_per_head
from ..ops.scores import fill_protected, received_attention, saturated_heads, top_slots
from .base import Needs, ScoringMethod, check_scoring_part
from .expectedattention import ExpectedAttention
from .registry import register
from .snapkv import SnapKV
from .surprisal import Surprisal


@register
@dataclass
class EvictMerge(ScoringMethod):
    """`base`'s scores choose the kept entries, exactly as it would; then every evicted entry joins its
    most key-similar kept entry when their cosine is ≥ `min_cosine` (sinks never absorb), with the
    log of the cluster's weight in the logits; below `min_cosine` an entry is evicted. Prefill only:
    the base's decode policy is not used.

    `calibrate=True`: weights are the attention each entry received from the last `obs_window`
    prompt queries; kept keys stay, values are attention-weighted means and the logit bias is
    log(cluster attention / kept entry's attention). `calibrate=False`: count weights (degree-weighted
    means of keys and values, log-count bias, mass conserved). `calibrate_with="expected"`: the
    weights are Expected Attention's expected probabilities instead (`base`'s own `probabilities` when
    it is `expectedattention` or `mixedattention`, so merges follow the model its picks were made by).
    `calibrate_with="base"`: the weights are `base`'s own scores, which must be non-negative (KVzip's
    and `echo`'s: the attention an entry got while the context was repeated; `zipguard` reorders those
    values in its copy heads), so an entry the base ranks low shifts the entry it joins little.
    `recent`: the recent window grows to this fraction of the layer's budget (at least `window`).
    `exact`: this fraction of the budget is picked first by `exact_by`'s scores (outside sinks and
    window) and absorbs nothing; `whole`: the exact share's last pick is completed (all entries
    scoring as it does, e.g. its whole sentence) when there is room.
    `absorb="picks"`: only `base`'s picks absorb; the sinks and the recent window keep their own
    entries exactly, so a head that keeps nothing else evicts the rest instead of folding it in.
    `alloc` ("layer", "head", "fit"; needs recent=0, and exact=0 unless absorb="none"): the kept
    entries are chosen by global allocation over every layer and head (`ScoringMethod`), then the rest
    merge into them as above; a head's padding slots absorb nothing and stay empty. An exact share
    there is each head's own (of the uniform count), ranked before every other score.
    `saturated` (< 1, with `calibrate_with="base"`): a head in which more than this fraction of the
    free entries (outside sinks and window) have base scores above one half (the base's `level`, if it
    has one) evicts instead of merging:
    such scores (a copy head's, while KVzip repeats the context) do not rank, and as weights they
    would fold unrelated entries into every pick almost as heavily as the pick itself.
    """
    base: ScoringMethod = field(default_factory=SnapKV)
    min_cosine: float = -1.0
    calibrate: bool = True
    calibrate_with: str = "observed"
    obs_window: int = 32
    recent: float = 0.75
    exact: float = 0.0
    exact_by: ScoringMethod = field(default_factory=Surprisal)
    whole: bool = False
    absorb: str = "kept"
    saturated: float = 1.0
    name = "evictmerge"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.exact <= 1.0 or not 0.0 <= self.recent <= 1.0:
            raise ValueError(f"exact and recent must be fractions in [0, 1], got exact={self.exact}, "
                             f"recent={self.recent}")
        if self.absorb not in ("kept", "picks", "none"):
            raise ValueError(f"absorb must be 'kept' (every kept entry but the sinks), 'picks' (the base's "
                             f"picks only) or 'none' (nothing: the rest is evicted), got {self.absorb!r}")
        weighed_by_base = self.calibrate and self.calibrate_with == "base"
        if not 0.0 <= self.saturated <= 1.0 or (self.saturated < 1.0 and not weighed_by_base):
            raise ValueError(f"saturated must be a fraction in [0, 1], below 1 only with calibrate=True and "
                             f"calibrate_with='base' (it reads the base's scores as probabilities), got "
                             f"saturated={self.saturated}, calibrate={self.calibrate}, calibrate_with={self.calibrate_with!r}")
        if self.calibrate_with not in ("observed", "expected", "base"):
            raise ValueError(f"calibrate_with must be 'observed', 'expected' or 'base', got {self.calibrate_with!r}")
        self._expected = (self.base if isinstance(self.base, ExpectedAttention) else ExpectedAttention()) \
            if self.calibrate and self.calibrate_with == "expected" else None
        for part in ("base", "exact_by"):
            check_scoring_part(self, part)
        if self.alloc != "uniform" and (self.recent > 0 or (self.exact > 0 and self.absorb != "none")):
            raise ValueError(f"{self.name}: alloc={self.alloc!r} spends the whole budget by {self.name}'s scores over "
                             f"every layer and head; a fixed recent share (recent={self.recent}) per head would "
                             f"bypass it, and an exact share (exact={self.exact}) ranks first there only when "
                             f"nothing merges: set recent=0, and exact=0 or absorb='none'")

    def parts(self):
        parts = [self.base] + ([self.exact_by] if self.exact > 0 else [])
        return parts + ([self._expected] if self._expected is not None and self._expected is not self.base else [])

    @property
    def requires(self) -> Needs:
        merges = self.absorb != "none"
        observed = merges and self.calibrate and self.calibrate_with == "observed"
        return Needs(queries=self.obs_window if observed else 0, merges=merges)

    def scores(self, keys, log_n, ctx):
        scores = self.base.scores(keys, log_n, ctx)
        if self.exact > 0 and self.alloc != "uniform":  # each head's exact share ranks first, as AdaKV's floor
            exact = self._exact_slots(keys, log_n, ctx, ctx.target, ctx.window)
            scores = scores.float().masked_fill(exact, torch.finfo(torch.float32).max)
        return scores

    def layer_target(self, ctx):
        return self.base.layer_target(ctx)

    def _exact_slots(self, keys, log_n, ctx, target, window):
        """`(b, h, s)` bool: the `exact` share of the budget, best by `exact_by`, outside sinks and window."""
        room = max(target - min(ctx.sinks, target) - window, 0)
        k = min(round(self.exact * target), room)
        scores = fill_protected(self.exact_by.scores(keys, log_n, ctx), ctx.sinks, window, float("-inf"))
        top = scores.topk(k)
        exact = torch.zeros(scores.shape, dtype=torch.bool, device=keys.device).scatter_(-1, top.indices, True)
        if not self.whole or k == 0:
            return exact
        tied = scores >= top.values[..., -1:]  # every entry scoring as the last pick: its whole sentence
        return torch.where(tied.sum(-1, keepdim=True) <= room, tied, exact)

    def compress(self, keys, values, log_n, ctx):
        if ctx.alloc is not None:  # global allocation: each head keeps its own count, padded to the widest
            scores = ctx.alloc[0].masked_fill(torch.isneginf(log_n), 0.0)  # an empty slot weighs nothing
            idx, empty = top_slots_per_head(*ctx.alloc, ctx.sinks, ctx.window)
            self.tell_selected(idx, ctx)
            if self.absorb == "none":
                return KV(keys, values, log_n).take(idx).emptied(empty)
            protect = self._protected(idx, min(ctx.sinks, idx.shape[-1]), keys.shape[2], ctx.window)
            return merge_into_kept(keys, values, log_n, idx, self._floor(scores, ctx), protect,
                                   self._weights(keys, log_n, ctx, scores), empty)
        target = self.layer_target(ctx)
        window = max(ctx.window, round(self.recent * target))
        attention = self._expected.probabilities(keys, log_n, ctx) if self._expected is not None else None
        scores = self.base.weigh(attention, ctx) if self._expected is self.base else self.scores(keys, log_n, ctx)
        protect = min(ctx.sinks, target)
        if self.exact > 0:
            exact = self._exact_slots(keys, log_n, ctx, target, window)
            idx = top_slots(scores.float().masked_fill(exact, float("inf")), target, ctx.sinks, window)
            protect = exact.gather(-1, idx) | (torch.arange(idx.shape[-1], device=idx.device) < protect)
        else:
            idx = top_slots(scores, target, ctx.sinks, window)
        self.tell_selected(idx, ctx)
        if self.absorb == "none":
            return KV(keys, values, log_n).take(idx)
        if self.calibrate and attention is None:
            attention = self._weights(keys, log_n, ctx, scores)
        protect = self._protected(idx, protect, keys.shape[2], window)
        return merge_into_kept(keys, values, log_n, idx, self._floor(scores, ctx), protect, attention)

    def _floor(self, scores, ctx):
        """`min_cosine`, or with `saturated` < 1 a `(b, h, 1)` floor that is +inf (nothing joins: the head
        evicts) in the heads whose base `scores` `(b, h, s)` saturate: more than `saturated` of the
        entries between the sinks and the last `ctx.window` above the base's `level` (one half if it
        has none; `zipguard`'s test)."""
        if self.saturated >= 1.0:
            return self.min_cosine
        n = scores.shape[-1]
        lo = min(ctx.sinks, n)
        hot = saturated_heads(scores[..., lo:max(n - ctx.window, lo)], self.saturated, getattr(self.base, "level", 0.5))
        return torch.full(hot.shape, self.min_cosine, device=scores.device).masked_fill(hot, float("inf"))

    def _protected(self, idx, protect, n, window):
        """The kept slots that absorb nothing: `protect` (the first slots if an int, else a `(b, h, t)`
        mask), and under `absorb="picks"` also the sinks and the last `window` of the n slots."""
        if self.absorb == "kept":
            return protect
        first = torch.arange(idx.shape[-1], device=idx.device) < protect if isinstance(protect, int) else protect
        return first | (idx < self.sinks) | (idx >= n - window)

    def _weights(self, keys, log_n, ctx, scores):
        """Calibrated merging's per-slot weights `(b, h, s)` (None: count weights); `scores`: the
        base's scores `(b, h, s)`, the weights under `calibrate_with="base"`."""
        if not self.calibrate:
            return None
        if self.calibrate_with == "base":
            if (scores < 0).any():
                raise ValueError(f"{self.name}: calibrate_with='base' weighs merges by the base's scores, but "
                                 f"{self.base.name}'s are negative; use 'observed' or 'expected'")
            return scores.float()
        if self._expected is not None:
            return self._expected.probabilities(keys, log_n, ctx)
        return received_attention(ctx.queries[:, :, -self.obs_window:], keys, ctx.scaling, log_n)
