"""TOVA (Oren et al., 2024, arXiv 2401.06104): keep the entries the last query attends to most."""

from dataclasses import dataclass

import torch

from ..ops.scores import keep_top
from .base import Method, register


def _last_query_scores(query, keys, log_n, scaling):
    """Attention of one query `(b, hq, 1, d)` over the cache, averaged over heads of a group."""
    b, hq, _, d = query.shape
    hkv = keys.shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, d)
    logits = torch.einsum("bgrd,bgsd->bgrs", q, keys.float()) * scaling + log_n[:, :, None, :]
    return logits.softmax(-1).mean(2)


@register
@dataclass
class TOVA(Method):
    """Prefill: keep the top entries under the last prompt query's attention. Decoding: whenever a row
    exceeds its budget, evict the entry the current query attends to least (one per step)."""

    name = "tova"
    query_window = 1

    def compress(self, keys, values, log_n, ctx):
        scores = _last_query_scores(ctx.queries[:, :, -1:], keys, log_n, ctx.scaling)
        return keep_top(keys, values, log_n, scores, ctx.target, ctx.sinks, ctx.window)

    def decode_hook(self):
        def hook(layer, query):
            scaling = query.shape[-1] ** -0.5

            def run(k, v, ln, rows):
                target = int(layer.targets[rows].min())
                if k.shape[2] <= target:
                    return k, v, ln
                scores = _last_query_scores(query[rows], k, ln, scaling)
                return keep_top(k, v, ln, scores, target, self.sinks, self.window)

            layer.map_rows(run)
        return hook
