"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV scores, budgets shrinking with depth."""

from dataclasses import dataclass

from .base import Needs
from .registry import register
from .snapkv import SnapKV


@register
@dataclass
class PyramidKV(SnapKV):
    """Layer l keeps a linearly decreasing share: from 2T − T/β at the first layer to T/β at the last
    (mean T, the budget), never below sinks + window."""

    beta: int = 20
    name = "pyramidkv"

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1:
            raise ValueError(f"pyramidkv needs beta >= 1 (the last layer keeps budget / beta), got {self.beta}")

    @property
    def requires(self) -> Needs:
        return super().requires | Needs(layer_counts=True)

    def layer_target(self, ctx):
        L, T = ctx.num_layers, ctx.target
        low = max(T // self.beta, ctx.sinks + ctx.window)
        high = 2 * T - low
        if L == 1:
            return T
        return int(round(high - (high - low) * ctx.layer_idx / (L - 1)))
