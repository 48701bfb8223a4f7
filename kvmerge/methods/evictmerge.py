"""Merge instead of evict (kvmerge's own): any scoring eviction method turned into a merging one."""

from dataclasses import dataclass

import torch

from ..ops.merge import merge_into_kept
from ..ops.scores import fill_protected, received_attention, top_slots
from .base import Method, get_method, register


@register
@dataclass
class EvictMerge(Method):
    """The `base` eviction method's scores choose the kept entries, exactly as it would; then every
    evicted entry joins its most key-similar kept entry when their cosine is ≥ `floor` (sinks never
    absorb), as a degree-weighted mean of values (and of keys if `merge_keys`), with log-degree in
    the logits. Below the floor an entry is evicted. Prefill only: the base's decode policy is not used.

    `calibrate=True` (default; measured better than count weights on fidelity, benchmarks/NOTES.md):
    weights are the attention each entry received from the last `obs_window` prompt queries instead
    of token counts; kept keys stay, values are attention-weighted means and the logit bias is
    log(cluster attention / kept entry's attention), so `log_n` is a calibrated weight, not a count.
    `calibrate=False`: count weights (degree-weighted means, log-count bias, mass conserved).
    `recent`: the recent window grows to this fraction of the layer's budget (at least `window`);
    default 0.75, measured (NOTES.md): ties StreamingLLM on needles, beats SnapKV on fidelity.
    `exact_top`: the highest-scored fraction of the kept entries stay exact (absorb nothing).
    `exact`: this fraction of the budget is picked first by `exact_by`'s scores (outside sinks and
    window) and stays exact; the base fills the rest (`surprisemerge` is this with surprisal).
    """

    base: str = "snapkv"
    floor: float = -1.0
    merge_keys: bool = True
    calibrate: bool = True
    obs_window: int = 32
    recent: float = 0.75  # protect at least this fraction of the budget as the recent window
    exact_top: float = 0.0  # this fraction of the kept entries, the highest-scored, absorb nothing
    exact: float = 0.0  # this fraction of the budget is chosen by `exact_by` and absorbs nothing
    exact_by: str = "surprisal"
    whole: bool = False  # the exact share's last pick is completed (e.g. a whole sentence), if room
    name = "evictmerge"

    def __post_init__(self):
        super().__post_init__()
        self._base = get_method(self.base, budget=self.budget, sinks=self.sinks, window=self.window)
        if not hasattr(self._base, "scores"):
            raise ValueError(f"{self.base} has no per-entry scores to merge by; use one of "
                             "snapkv, pyramidkv, h2o, tova, streamingllm, surprisal")
        self.query_window = self._base.query_window
        self._exact_by = get_method(self.exact_by, budget=self.budget, sinks=self.sinks, window=self.window)
        if not 0.0 <= self.exact <= 1.0 or not hasattr(self._exact_by, "scores"):
            raise ValueError(f"exact must be a fraction in [0, 1] and exact_by a scoring method, got "
                             f"exact={self.exact}, exact_by={self.exact_by!r}")
        self.needs_surprisal = self._base.needs_surprisal or (self.exact > 0 and self._exact_by.needs_surprisal)
        if self.calibrate:
            self.query_window = -1 if self.query_window < 0 else max(self.query_window, self.obs_window)

    def setup(self, model, tokenizer):
        self._base.setup(model, tokenizer)
        if self.exact > 0:
            self._exact_by.setup(model, tokenizer)

    def _exact_slots(self, keys, log_n, ctx, target, window):
        """`(b, h, s)` bool: the `exact` share of the budget, best by `exact_by`, outside sinks and window."""
        room = max(target - min(ctx.sinks, target) - window, 0)
        k = min(round(self.exact * target), room)
        scores = fill_protected(self._exact_by.scores(keys, log_n, ctx), ctx.sinks, window, float("-inf"))
        top = scores.topk(k)
        exact = torch.zeros(scores.shape, dtype=torch.bool, device=keys.device).scatter_(-1, top.indices, True)
        if not self.whole or k == 0:
            return exact
        tied = scores >= top.values[..., -1:]  # every entry scoring as the last pick: its whole sentence
        return torch.where(tied.sum(-1, keepdim=True) <= room, tied, exact)

    def compress(self, keys, values, log_n, ctx):
        target = self._base.layer_target(ctx) if hasattr(self._base, "layer_target") else ctx.target
        window = max(ctx.window, round(self.recent * target))
        scores = self._base.scores(keys, log_n, ctx)
        exact = self._exact_slots(keys, log_n, ctx, target, window) if self.exact > 0 else None
        if exact is not None:
            scores = scores.float().masked_fill(exact, float("inf"))
        idx = top_slots(scores, target, ctx.sinks, window)
        protect = min(ctx.sinks, target)
        if exact is not None:
            protect = exact.gather(-1, idx) | (torch.arange(idx.shape[-1], device=idx.device) < protect)
        elif self.exact_top > 0:
            kept = scores.gather(-1, idx).float()
            kept[..., :protect] = float("inf")
            rank = kept.argsort(-1, descending=True).argsort(-1)
            protect = rank < protect + round(self.exact_top * (idx.shape[-1] - protect))
        attention = None
        if self.calibrate:
            attention = received_attention(ctx.queries[:, :, -self.obs_window:], keys, ctx.scaling, log_n)
        return merge_into_kept(keys, values, log_n, idx, self.floor, self.merge_keys, protect, attention)
