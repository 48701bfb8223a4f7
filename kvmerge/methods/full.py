"""The uncompressed cache: the reference every method is measured against."""

from dataclasses import dataclass

from ..ops.kv import KV
from .base import Method
from .registry import register


@register
@dataclass
class Full(Method):
    """No compression (budget 1.0)."""

    budget: float | int = 1.0
    name = "full"

    def target(self, n_tokens, window=None):
        if n_tokens <= 0:
            raise ValueError("empty context: nothing to compress")
        return n_tokens

    def compress(self, keys, values, log_n, ctx):
        return KV(keys, values, log_n)
