"""Surprisal selection (kvmerge's own): keep the sentences the model found least predictable."""

from dataclasses import dataclass

import torch

from ..ops.gsc import STRONG_ANCHOR, delimiter_table
from ..ops.scores import sentence_mean
from .base import ScoringMethod
from .registry import register


@register
@dataclass
class Surprisal(ScoringMethod):
    """Every token scores its sentence's mean surprisal, −log p(token | prefix) from the prefill's own
    logits; whole sentences (ended by `. ? !`, newline or a special token) are kept best-first beside
    sinks and the recent window, the rest evicted. The same choice for every layer and head: what the
    model could not predict is what no later computation can rebuild once dropped.

    Chunked prefill: the fresh tokens (this chunk and the previous window) are scored as above, from
    each chunk's own logits; entries kept by an earlier chunk keep the score they were kept with. A
    sentence cut by a chunk boundary is averaged over each side separately."""

    name = "surprisal"
    needs_surprisal = True

    def setup(self, model, tokenizer):
        if tokenizer is None:
            raise ValueError("surprisal needs the tokenizer to find sentence ends: use kvmerge.generate, "
                             "or pass tokenizer= to generate_ids")
        self._table = delimiter_table(tokenizer)

    def scores(self, keys, log_n, ctx):
        if ctx.surprisal is None or ctx.token_ids is None:
            raise ValueError("surprisal scores need the prompt's token ids and surprisal (prefill only)")
        is_end = self._table.to(keys.device)[ctx.token_ids] == STRONG_ANCHOR
        b, h, n = keys.shape[:3]
        scores = sentence_mean(ctx.surprisal, is_end)[:, None].expand(b, h, -1)
        if scores.shape[-1] < n:  # entries an earlier chunk kept
            carried = ctx.state.scratch.get(self.name, {})
            old = [carried.get(int(row)) for row in ctx.rows]
            if any(c is None or c.shape[-1] < n - scores.shape[-1] for c in old):
                raise ValueError("surprisal scores of the entries kept by an earlier compression are missing")
            scores = torch.cat([torch.stack([c[:, :n - scores.shape[-1]] for c in old]).to(scores.device), scores], -1)
        if ctx.state is not None:
            ctx.state.scratch["_" + self.name] = scores
        return scores

    def selected(self, idx, ctx):
        if ctx.state is None or ctx.rows is None:
            return
        scores = ctx.state.scratch.pop("_" + self.name)
        carried = dict(ctx.state.scratch.get(self.name, {}))  # a new dict: snapshots share the old one
        for j, row in enumerate(ctx.rows.tolist()):
            carried[row] = scores[j].gather(-1, idx[j])
        ctx.state.scratch[self.name] = carried
