"""Merge instead of evict (kvmerge's own): any scoring eviction method turned into a merging one."""

from dataclasses import dataclass

from ..ops.merge import merge_into_kept
from ..ops.scores import received_attention, top_slots
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
    """

    base: str = "snapkv"
    floor: float = -1.0
    merge_keys: bool = True
    calibrate: bool = True
    obs_window: int = 32
    recent: float = 0.75  # protect at least this fraction of the budget as the recent window
    exact_top: float = 0.0  # this fraction of the kept entries, the highest-scored, absorb nothing
    name = "evictmerge"

    def __post_init__(self):
        super().__post_init__()
        self._base = get_method(self.base, budget=self.budget, sinks=self.sinks, window=self.window)
        if not hasattr(self._base, "scores"):
            raise ValueError(f"{self.base} has no per-entry scores to merge by; use one of "
                             "snapkv, pyramidkv, h2o, tova, streamingllm")
        self.query_window = self._base.query_window
        if self.calibrate:
            self.query_window = -1 if self.query_window < 0 else max(self.query_window, self.obs_window)

    def compress(self, keys, values, log_n, ctx):
        target = self._base.layer_target(ctx) if hasattr(self._base, "layer_target") else ctx.target
        window = max(ctx.window, round(self.recent * target))
        scores = self._base.scores(keys, log_n, ctx)
        idx = top_slots(scores, target, ctx.sinks, window)
        protect = min(ctx.sinks, target)
        if self.exact_top > 0:
            kept = scores.gather(-1, idx).float()
            kept[..., :protect] = float("inf")
            rank = kept.argsort(-1, descending=True).argsort(-1)
            protect = rank < protect + round(self.exact_top * (idx.shape[-1] - protect))
        attention = None
        if self.calibrate:
            attention = received_attention(ctx.queries[:, :, -self.obs_window:], keys, ctx.scaling, log_n)
        return merge_into_kept(keys, values, log_n, idx, self.floor, self.merge_keys, protect, attention)
