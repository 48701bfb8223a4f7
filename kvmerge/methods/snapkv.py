"""SnapKV (Li et al., 2024, arXiv 2404.14469): keep what the last prompt queries attend to."""

from dataclasses import dataclass

from ..ops.scores import keep_top, pool_scores, received_attention
from .base import Method, register


@register
@dataclass
class SnapKV(Method):
    """Scores: attention of the last `obs_window` prompt queries, summed over the group's query heads,
    average-pooled with `kernel`; the top-scored entries are kept beside sinks and the recent window."""

    obs_window: int = 32
    kernel: int = 7
    name = "snapkv"
    query_window = 32

    def scores(self, keys, log_n, ctx):
        received = received_attention(ctx.queries[:, :, -self.obs_window:], keys, ctx.scaling, log_n)
        return pool_scores(received, self.kernel)

    def layer_target(self, ctx):
        return ctx.target

    def compress(self, keys, values, log_n, ctx):
        target = self.layer_target(ctx)
        return keep_top(keys, values, log_n, self.scores(keys, log_n, ctx), target, ctx.sinks, ctx.window)
