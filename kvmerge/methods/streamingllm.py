"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks plus a recent window."""

from dataclasses import dataclass

import torch

from .base import Method, register


@register
@dataclass
class StreamingLLM(Method):
    """Keep the first `sinks` tokens and the most recent ones, filling the budget; evict the rest."""

    name = "streamingllm"

    def scores(self, keys, log_n, ctx):
        """Recency: later entries score higher (used by merge-instead-of-evict)."""
        return torch.arange(keys.shape[2], device=keys.device, dtype=torch.float32).expand(keys.shape[:3])

    def compress(self, keys, values, log_n, ctx):
        s = keys.shape[2]
        if ctx.target >= s:
            return keys, values, log_n
        recent = ctx.target - min(ctx.sinks, ctx.target)
        keep = list(range(min(ctx.sinks, ctx.target))) + list(range(s - recent, s))
        return keys[:, :, keep], values[:, :, keep], log_n[:, :, keep]
