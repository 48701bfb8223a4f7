"""A throwaway scoring method, as a user would write one: keep what the last prompt query attends to.
One file; declared needs, no runtime code. It runs one-shot, chunked and inside vLLM (tests/test_extending.py,
tests/test_vllm_transformers.py)."""

from dataclasses import dataclass

from kvmerge import Needs, ScoringMethod, register
from kvmerge.ops.scores import attention_probs


@register
@dataclass
class LastQuery(ScoringMethod):
    """Score: the attention the last prompt query gives each entry, summed over its KV group."""

    name = "lastquery"
    requires = Needs(queries=1)

    def scores(self, keys, log_n, ctx):
        return attention_probs(ctx.queries[:, :, -1:], keys, ctx.scaling, log_n)[:, :, -1]
