"""`KV`: one layer's (keys, values, log_n) as one value, with the few slot operations methods share.

Shapes: keys/values `(b, h, s, d)`, log_n `(b, h, s)` float32 (log of token counts, -inf = empty slot).
A `KV` unpacks like the tuple it is: `k, v, ln = kv`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


def gather_slots(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x `(b, h, s, ...)`, idx `(b, h, k)` → `(b, h, k, ...)`."""
    if x.dim() == 3:
        return x.gather(2, idx)
    return x.gather(2, idx[..., None].expand(*idx.shape, x.shape[-1]))


class KV(NamedTuple):
    keys: torch.Tensor
    values: torch.Tensor
    log_n: torch.Tensor

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def take(self, idx: torch.Tensor) -> KV:
        """The slots `idx` `(b, h, k)`, in that order."""
        return KV(*(gather_slots(x, idx) for x in self))

    def emptied(self, empty: torch.Tensor) -> KV:
        """The slots where `empty` `(b, h, k)` bool is set made empty: zeros, log_n −inf (a head's padding)."""
        return KV(self.keys.masked_fill(empty[..., None], 0), self.values.masked_fill(empty[..., None], 0),
                  self.log_n.masked_fill(empty, float("-inf")))

    def narrow(self, start: int, length: int) -> KV:
        return KV(*(x.narrow(2, start, length) for x in self))

    def split(self, sinks: int, window: int) -> tuple[KV, KV, KV]:
        """(the first `sinks` slots, the middle, the last `window` slots); shorter caches give short parts."""
        s = self.slots
        head = min(sinks, s)
        tail = min(window, s - head)
        return self.narrow(0, head), self.narrow(head, s - head - tail), self.narrow(s - tail, tail)

    @staticmethod
    def cat(*parts: KV) -> KV:
        """Concatenate along the slot axis."""
        return KV(*(torch.cat(xs, dim=2) for xs in zip(*parts)))
