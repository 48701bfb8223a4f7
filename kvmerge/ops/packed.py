"""KV heads stored at their own lengths, packed back to back in one buffer: pure tensor functions.

A packed buffer is `(b, C, ...)` (keys/values `(b, C, d)`, log-mass `(b, C)`): head i's slots are a
segment of it. The padded layout it stands for, `(b, h, n, ...)`, is read through a slot map `(h, n)`
long: the packed position of each padded slot, -1 where the slot is empty (zeros, log-mass -inf).
"""

from __future__ import annotations

import torch


def slot_map(live: torch.Tensor, starts: torch.Tensor, kept: torch.Tensor, appended: int) -> torch.Tensor:
    """live `(h, w)` bool: the padded slots each head holds (its first kept[i] packed slots, in order,
    from starts[i]); then `appended` slots every head appended since, after them. → `(h, w + appended)`
    long, -1 where a padded slot is empty."""
    held = (live.cumsum(1) - 1 + starts[:, None]).masked_fill(~live, -1)
    new = starts[:, None] + kept[:, None] + torch.arange(appended, device=live.device)
    return torch.cat([held, new], 1)


def take(buf: torch.Tensor, at: torch.Tensor, fill: float) -> torch.Tensor:
    """buf `(b, C, ...)`, at `(n,)` (the same for every row) or `(b, n)` packed positions (-1: empty) →
    `(b, n, ...)`, a new tensor, `fill` where `at` is -1."""
    rest, safe = buf.shape[2:], at.clamp(min=0)
    if buf.shape[0] == 1 and not (buf.requires_grad and torch.is_grad_enabled()):  # rows of a matrix: faster
        out = buf.new_empty(1, safe.numel(), *rest)
        torch.index_select(buf[0], 0, safe.reshape(-1), out=out[0])
    elif at.dim() == 1 or at.shape[0] == 1:
        out = buf.index_select(1, safe.reshape(-1))
    else:
        out = buf.gather(1, safe.view(*safe.shape, *(1,) * len(rest)).expand(*safe.shape, *rest))
    empty = at < 0
    if bool(empty.any()):
        out.masked_fill_(empty.view(-1 if at.dim() == 2 else 1, at.shape[-1], *(1,) * len(rest)), fill)
    return out


def gather(buf: torch.Tensor, at: torch.Tensor, fill: float) -> torch.Tensor:
    """buf `(b, C, ...)`, at `(h, n)` (the same for every row) or `(b, h, n)` packed positions (-1:
    empty) → `(b, h, n, ...)`, `fill` where `at` is -1."""
    return take(buf, at.flatten(-2), fill).view(buf.shape[0], *at.shape[-2:], *buf.shape[2:])


def worth_packing(live: torch.Tensor, batch: int, slot_bytes: int) -> bool:
    """Whether storing each head at its own length (`live` `(h, w)`: the padded slots some row uses)
    saves more bytes than the one-byte-per-slot mask it needs; `slot_bytes`: one row's bytes per slot."""
    return (live.numel() - int(live.sum())) * batch * slot_bytes > live.numel()
