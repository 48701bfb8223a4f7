"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): attention sinks plus a recent window."""

from dataclasses import dataclass

import torch

from .base import ScoringMethod
from .registry import register


@register
@dataclass
class StreamingLLM(ScoringMethod):
    """Keep the first `sinks` tokens and the most recent ones, filling the budget; evict the rest."""

    name = "streamingllm"

    def scores(self, keys, log_n, ctx):
        """Recency: later entries score higher."""
        return torch.arange(keys.shape[2], device=keys.device, dtype=torch.float32).expand(keys.shape[:3])
