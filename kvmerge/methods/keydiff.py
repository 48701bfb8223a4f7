"""KeyDiff (Park et al., 2025, arXiv 2504.15364): keep the keys least like the average key."""

from dataclasses import dataclass

import torch.nn.functional as F

from .base import ScoringMethod
from .registry import register


@register
@dataclass
class KeyDiff(ScoringMethod):
    """Score = −cos(k, anchor) per KV head, the anchor being the mean of the unit keys (weighted by
    each entry's mass, which is the plain mean on an uncompressed cache). No attention needed."""

    name = "keydiff"

    def scores(self, keys, log_n, ctx):
        unit = F.normalize(keys.float(), dim=-1)
        anchor = (unit * log_n.exp()[..., None]).sum(2, keepdim=True)
        return -(unit * F.normalize(anchor, dim=-1)).sum(-1)
