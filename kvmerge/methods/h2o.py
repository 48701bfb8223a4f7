"""H2O (Zhang et al., 2023, arXiv 2306.14048): heavy hitters by accumulated attention, plus recent tokens."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops.merge import take
from ..ops.scores import attention_probs, evict_rows, received_attention, top_slots
from .base import Method, register


@register
@dataclass
class H2O(Method):
    """Scores: attention each entry received, summed over all prompt queries (and the group's query
    heads); the top-scored entries are kept beside sinks and the recent window.

    `decode=True` is the paper's generation setting: every decoding step adds the new query's
    attention to the accumulated scores and evicts the lowest-scored entry of a row over budget.
    """

    decode: bool = False
    name = "h2o"
    query_window = -1

    def __post_init__(self):
        super().__post_init__()
        self._prefill: dict = {}  # layer index → {row: scores of its kept entries after prefill}

    def setup(self, model, tokenizer):
        self._prefill = {}

    def scores(self, keys, log_n, ctx):
        return received_attention(ctx.queries, keys, ctx.scaling, log_n)

    def compress(self, keys, values, log_n, ctx):
        scores = self.scores(keys, log_n, ctx)
        idx = top_slots(scores, ctx.target, ctx.sinks, ctx.window)
        if self.decode:
            kept = scores.gather(-1, idx)
            for i, r in enumerate(ctx.rows.tolist()):
                self._prefill.setdefault(ctx.layer_idx, {})[r] = kept[i:i + 1]
        return take(keys, values, log_n, idx)

    def decode_hook(self):
        if not self.decode:
            return None

        def hook(layer, query):
            log_n = layer.full_log_n()
            acc = layer.slot_scores if layer.slot_scores is not None else self._from_prefill(layer)
            acc = F.pad(acc, (0, layer.entries - acc.shape[-1]))
            acc = acc + attention_probs(query, layer.keys, query.shape[-1] ** -0.5, log_n)[:, :, -1]
            idx, empty = evict_rows(log_n, acc, layer.targets, self.sinks, self.window)
            layer.select(idx, empty)
            layer.slot_scores = acc.gather(-1, idx)
        return hook

    def _from_prefill(self, layer) -> torch.Tensor:
        """Scores aligned with the layer's compressed slots: per-row prefill scores, zero-padded like
        the cache rows (rows that were not compressed start from zero)."""
        acc = self._prefill.get(layer.index, {})
        b, h = layer.keys.shape[:2]
        width = layer.entries - (layer.seen - layer.compressed_at)
        rows = [F.pad(acc[r], (0, width - acc[r].shape[-1])) if r in acc else
                torch.zeros(1, h, width, device=layer.keys.device) for r in range(b)]
        return torch.cat(rows, dim=0)
