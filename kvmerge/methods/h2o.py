"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention, plus recent tokens."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.kv import KV
from ..ops.scores import attention_probs, evict_rows, received_attention, top_slots
from .base import Needs, ScoringMethod
from .registry import register


@register
@dataclass
class H2O(ScoringMethod):
    """Scores: attention each entry received, summed over all prompt queries (and the group's query
    heads); the top-scored entries are kept beside sinks and the recent window.

    `decode=True` is the paper's generation setting: every decoding step adds the new query's
    attention to the accumulated scores and evicts the lowest-scored entry of a row over budget.
    """

    decode: bool = False
    name = "h2o"
    allocates = False  # its compress keeps the prefill's scores for decoding

    @property
    def requires(self) -> Needs:
        return Needs(queries=-1, decode_policy=self.decode)

    def scores(self, keys, log_n, ctx):
        return received_attention(ctx.queries, keys, ctx.scaling, log_n)

    def compress(self, keys, values, log_n, ctx):
        scores = self.scores(keys, log_n, ctx)
        idx = top_slots(scores, ctx.target, ctx.sinks, ctx.window)
        if self.decode:  # each row's kept scores, to go on accumulating while decoding
            kept = scores.gather(-1, idx)
            for i, r in enumerate(ctx.rows.tolist()):
                ctx.state.scratch.setdefault("prefill", {})[r] = kept[i:i + 1]
        return KV(keys, values, log_n).take(idx)

    def on_decode(self, layer, query, state):
        log_n = layer.full_log_n()
        acc = state.scratch.get("scores")
        acc = self._from_prefill(layer, state) if acc is None else acc
        acc = F.pad(acc, (0, layer.entries - acc.shape[-1]))
        acc = acc + attention_probs(query, layer.keys, state.scaling, log_n)[:, :, -1]
        idx, empty = evict_rows(log_n, acc, state.targets, self.sinks, self.window)
        layer.select(idx, empty)
        state.scratch["scores"] = acc.gather(-1, idx)

    @staticmethod
    def _from_prefill(layer, state) -> torch.Tensor:
        """Scores aligned with the layer's compressed slots: per-row prefill scores, zero-padded like
        the cache rows (rows that were not compressed start from zero)."""
        acc = state.scratch.get("prefill", {})
        b, h = layer.keys.shape[:2]
        width = layer.entries - (layer.seen - state.compressed_at)
        rows = [F.pad(acc[r], (0, width - acc[r].shape[-1])) if r in acc else
                torch.zeros(1, h, width, device=layer.keys.device) for r in range(b)]
        return torch.cat(rows, dim=0)
