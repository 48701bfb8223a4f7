"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention, plus recent tokens."""

from dataclasses import dataclass

from ..ops.scores import attention_probs, keep_top
from .base import Method, register


@register
@dataclass
class H2O(Method):
    """Scores: attention each entry received, summed over all prompt queries (and the group's query
    heads); the top-scored entries are kept beside sinks and the recent window."""

    name = "h2o"
    query_window = -1

    def compress(self, keys, values, log_n, ctx):
        scores = attention_probs(ctx.queries, keys, ctx.scaling).sum(2)
        return keep_top(keys, values, log_n, scores, ctx.target, ctx.sinks, ctx.window)
