"""SnapKV (Li et al., 2024, arXiv 2404.14469): keep what the last prompt queries attend to."""

from dataclasses import dataclass

from ..ops.scores import pool_scores, received_attention
from .base import Needs, ScoringMethod
from .registry import register


@register
@dataclass
class SnapKV(ScoringMethod):
    """Scores: attention of the last `obs_window` prompt queries, summed over the group's query heads,
    average-pooled with `kernel`; the top-scored entries are kept beside sinks and the recent window."""

    obs_window: int = 32
    kernel: int = 7
    name = "snapkv"

    @property
    def requires(self) -> Needs:
        return Needs(queries=self.obs_window)

    def scores(self, keys, log_n, ctx):
        received = received_attention(ctx.queries[:, :, -self.obs_window:], keys, ctx.scaling, log_n)
        return pool_scores(received, self.kernel)
