"""TOVA (Oren et al., 2024, arXiv 2401.06104): keep the entries the last query attends to most."""

from dataclasses import dataclass

from ..ops.scores import attention_probs, evict_rows
from .base import Needs, ScoringMethod
from .registry import register


@register
@dataclass
class TOVA(ScoringMethod):
    """Prefill: keep the top entries under the last prompt query's attention (summed over the GQA
    group). Decoding: whenever a row exceeds its budget, evict the entry the current query attends
    to least (one per step)."""

    name = "tova"
    requires = Needs(queries=1, decode_policy=True)

    def scores(self, keys, log_n, ctx):
        return attention_probs(ctx.queries[:, :, -1:], keys, ctx.scaling, log_n)[:, :, -1]

    def on_decode(self, layer, query, state):
        if layer.entries <= int(state.targets.min()):
            return
        log_n = layer.full_log_n()
        scores = attention_probs(query, layer.keys, state.scaling, log_n)[:, :, -1]
        layer.select(*evict_rows(log_n, scores, state.targets, self.sinks, self.window))
