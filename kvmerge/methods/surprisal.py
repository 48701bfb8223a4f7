"""Surprisal selection (kvmerge's own): keep the sentences the model found least predictable."""

from dataclasses import dataclass

from ..ops.gsc import STRONG_ANCHOR, delimiter_table
from ..ops.scores import sentence_mean
from .base import CarriedScores, Needs, ScoringMethod
from .registry import register


@register
@dataclass
class Surprisal(CarriedScores, ScoringMethod):
    """Every token scores its sentence's mean surprisal, −log p(token | prefix) from the prefill's own
    logits; whole sentences (ended by `. ? !`, newline or a special token) are kept best-first beside
    sinks and the recent window, the rest evicted. The same choice for every layer and head: what the
    model could not predict is what no later computation can rebuild once dropped.

    Chunked prefill: the fresh tokens (this chunk and the previous window) are scored as above, from
    each chunk's own logits; entries kept by an earlier chunk keep the score they were kept with. A
    sentence cut by a chunk boundary is averaged over each side separately."""

    name = "surprisal"
    requires = Needs(surprisal=True, tokenizer=True)

    def setup(self, runtime):
        if runtime.tokenizer is None:
            raise ValueError("surprisal needs the tokenizer to find sentence ends: use kvmerge.generate, "
                             "or pass tokenizer= to generate_ids")
        self._table = delimiter_table(runtime.tokenizer)

    def fresh_scores(self, keys, values, ctx):
        if ctx.surprisal is None or ctx.token_ids is None:
            raise ValueError("surprisal scores need the prompt's token ids and surprisal (prefill only)")
        is_end = self._table.to(keys.device)[ctx.token_ids] == STRONG_ANCHOR
        return sentence_mean(ctx.surprisal, is_end)[:, None].expand(keys.shape[0], keys.shape[1], -1)
