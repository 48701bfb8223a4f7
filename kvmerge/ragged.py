"""KV heads stored at their own lengths (global per-head allocation), packed back to back in one buffer
per tensor: the part of `MergedLayer` that holds them (`PackedHeads`, mixed in).

The buffers are `_pk`/`_pv` `(batch, capacity, head_dim)` and `_pl` `(batch, capacity)` (None: all
zeros); head i lives in the segment `[_starts[i], _starts[i] + _caps[i])` of which its first
`_lens[i]` slots are held (spare capacity at each segment's end, so a decoding step appends to every
head with one indexed write at `_next` `(kv_heads,)`, the slots `_starts + _lens`). `_live`
`(kv_heads, width)` bool marks the padded slots each head keeps (`_kept` their counts). The layer's
`keys`/`values`/`log_n` then read as the padded layout it replaced (its empty slots where they were,
as zeros with log_n -inf, then what was appended since), so every reader sees the same entries at the
same slots; appends and kvmerge's attention (`ragged_sdpa`) use the segments directly. Every tensor
is an attribute of its own (no views of one another), so copying the layer's attributes one by one
copies it; the tuples are replaced, never changed in place.
"""

from __future__ import annotations

import torch

from .ops import packed

LOG_N_DTYPE = torch.float32


class PackedHeads:
    """Ragged storage for a `MergedLayer` (which owns the dense buffers `_keys`/`_values`/`_log_n`)."""

    def _init_packed(self) -> None:
        self._live, self._kept = None, []  # (h, width) bool, the padded slots each head keeps; their counts
        self._pk = self._pv = self._pl = self._next = None  # packed buffers, next write slots
        self._starts = self._lens = self._caps = ()
        self._map = None  # (the `_live`, `_starts`, `_lens` it was made for, the slot map)

    def compact(self) -> bool:
        """Store each KV head at its own length when some head's slots are empty in every batch row
        (e.g. after global per-head allocation) and dropping them saves more than the one-byte-per-slot
        mask costs; → whether it did. The slots dropped are exactly those empty slots, so attention and
        `kv()` are unchanged while `nbytes` falls."""
        if self._pk is not None or self._log_n is None or self.entries == 0:
            return False
        kv = self.kv()
        live = ~torch.isinf(kv.log_n).all(0)  # (h, s): a slot some row still uses
        counts = live.sum(-1).tolist()
        if not packed.worth_packing(live, kv.keys.shape[0], _slot_bytes(kv.keys, kv.values)):
            return False
        flat = live.flatten().nonzero().squeeze(1)  # head by head, in slot order
        keys, values, log_n = (x.flatten(1, 2).index_select(1, flat) for x in kv)
        self._live, self._kept = live, counts
        self._set_packed(keys, values, None if bool((log_n == 0).all()) else log_n, tuple(counts))
        return True

    @property
    def ragged(self) -> bool:
        """Whether the KV heads are stored at their own lengths (packed segments)."""
        return self._pk is not None

    @property
    def heads(self) -> list | None:
        """Ragged storage: one single-head layer per KV head, viewing its segment (for readers: writing
        to them does not write the layer); otherwise None."""
        if self._pk is None:
            return None
        out = []
        for keys, values, log_n in self._segments():
            head = type(self)()
            head.is_initialized, head.device, head.seen = True, keys.device, self.seen
            head._keys, head._values, head._length = keys, values, keys.shape[2]
            head._log_n = None if self._pl is None else log_n
            out.append(head)
        return out

    @heads.setter
    def heads(self, heads: list | None) -> None:
        """Store single-head layers (each its own length) packed; None: leave the ragged storage. The
        padded layout's `_live`/`_kept` are the caller's to set."""
        if heads is None:
            self._pk = self._pv = self._pl = self._next = None
            self._starts = self._lens = self._caps = ()
            return
        lens = tuple(head.entries for head in heads)
        keys, values = (torch.cat([getattr(head, name)[:, 0] for head in heads], 1) for name in ("keys", "values"))
        log_n = (torch.cat([head.full_log_n()[:, 0] for head in heads], 1)
                 if any(head.log_n is not None for head in heads) else None)
        self._set_packed(keys, values, log_n, lens)
        self.seen = max(head.seen for head in heads)

    def _set_packed(self, keys, values, log_n, lens: tuple, caps: tuple | None = None) -> None:
        """Become ragged: `keys`/`values` `(b, Σ caps, d)` and `log_n` `(b, Σ caps)` (or None) hold the
        heads back to back, each head's segment `caps` slots (default: exactly its `lens`) of which the
        first `lens` are held."""
        self._keys = self._values = self._log_n = None
        self._length = 0
        self._pk, self._pv = keys.contiguous(), values.contiguous()
        self._pl = None if log_n is None else log_n.to(LOG_N_DTYPE).contiguous()
        self._lens = lens
        self._segment(lens if caps is None else caps)

    def _segment(self, caps: tuple) -> None:
        """Segments of `caps` slots back to back: their starts, and the next write slot of each head."""
        self._caps = caps
        self._starts = tuple(sum(caps[:i]) for i in range(len(caps)))
        self._next = torch.tensor([s + n for s, n in zip(self._starts, self._lens)], device=self._pk.device)

    def _segments(self):
        """Each KV head's held slots: `(keys (b, 1, n, d), values (b, 1, n, d), log_n (b, 1, n))`, views."""
        for s, n in zip(self._starts, self._lens):
            log_n = (self._pl[:, None, s:s + n] if self._pl is not None
                     else torch.zeros(self._pk.shape[0], 1, n, dtype=LOG_N_DTYPE, device=self._pk.device))
            yield self._pk[:, None, s:s + n], self._pv[:, None, s:s + n], log_n

    def _slot_map(self) -> torch.Tensor:
        """`(h, entries)` long: where each slot of the padded layout is in the packed buffers (-1: empty);
        kept while the layout is (every change replaces `_live` or the `_starts`/`_lens` tuples)."""
        memo = self._map
        if memo is None or memo[0] is not self._live or memo[1:3] != (self._starts, self._lens):
            device = self._pk.device
            self._map = memo = (self._live, self._starts, self._lens, packed.slot_map(
                self._live, torch.tensor(self._starts, device=device), torch.tensor(self._kept, device=device),
                self._lens[0] - self._kept[0]))
        return memo[3]

    def _padded(self, start: int = 0, names=("keys", "values", "log_n")) -> tuple:
        """The padded layout's `names` (of keys, values, log_n) from slot `start` on, from the packed buffers."""
        at = self._slot_map()[:, start:]
        h, n = at.shape
        flat = at.flatten()
        bufs = {"keys": self._pk, "values": self._pv, "log_n": self._pl}
        out = []
        for name in names:
            if bufs[name] is None:  # log-mass all zeros
                x = torch.zeros(self._pk.shape[0], h * n, dtype=LOG_N_DTYPE, device=at.device)
                out.append(x.masked_fill_((flat < 0)[None], float("-inf")).view(-1, h, n))
            else:
                x = packed.take(bufs[name], flat, float("-inf") if name == "log_n" else 0.0)
                out.append(x.view(x.shape[0], h, n, *x.shape[2:]))
        return tuple(out)

    def _repack(self, caps: tuple) -> None:
        """Segments of `caps` slots each (at least the slots held), the held slots copied."""
        if caps == self._caps:
            return
        caps = tuple(max(c, n) for c, n in zip(caps, self._lens))
        src = torch.cat([torch.arange(s, s + n) for s, n in zip(self._starts, self._lens)]).to(self._pk.device)
        self._segment(caps)
        dst = torch.cat([torch.arange(s, s + n) for s, n in zip(self._starts, self._lens)]).to(self._pk.device)

        def moved(buf):
            if buf is None:
                return None
            out = buf.new_zeros(buf.shape[0], sum(caps), *buf.shape[2:])
            return out.index_copy_(1, dst, buf.index_select(1, src))

        self._pk, self._pv, self._pl = moved(self._pk), moved(self._pv), moved(self._pl)

    def _append_heads(self, key_states, value_states, new_log_n) -> None:
        """Ragged: append `(b, h, q, d)` to every head's segment, one indexed write per buffer."""
        b, h, q, d = key_states.shape
        if any(n + q > c for n, c in zip(self._lens, self._caps)):
            self._repack(tuple(max(n + q, 2 * c) for n, c in zip(self._lens, self._caps)))
        at = self._next if q == 1 else (self._next[:, None] + torch.arange(q, device=self._next.device)).flatten()
        self._pk.index_copy_(1, at, key_states.reshape(b, h * q, d))
        self._pv.index_copy_(1, at, value_states.reshape(b, h * q, value_states.shape[-1]))
        if new_log_n is not None and self._pl is None:
            self._pl = torch.zeros(self._pk.shape[:2], dtype=LOG_N_DTYPE, device=self._pk.device)
        if self._pl is not None:
            if new_log_n is None:
                self._pl.index_fill_(1, at, 0.0)
            else:
                self._pl.index_copy_(1, at, new_log_n.to(self._pl.device, LOG_N_DTYPE).repeat(1, h))
        self._next = self._next + q
        self._lens = tuple(n + q for n in self._lens)

    def packed(self):
        """Ragged: `(keys (b, C, d), values (b, C, d), log_n (b, C) or None, spans)`, `spans` one
        `(start, length)` per KV head, what `ragged_sdpa` reads."""
        return self._pk, self._pv, self._pl, tuple(zip(self._starts, self._lens))

    def _dense(self) -> None:
        """Back to one padded buffer (before any operation that writes the whole layer)."""
        if self._pk is not None:
            kv = self.kv()
            self.heads, self._live = None, None
            self._keys, self._values, self._log_n, self._length = kv.keys, kv.values, kv.log_n, kv.slots

    def _select_packed(self, idx: torch.Tensor, empty: torch.Tensor | None, room: int) -> None:
        """`select` on ragged heads: the slots read from the packed buffers, one gather per tensor."""
        b, h, k = idx.shape
        at = self._slot_map()[None].expand(b, -1, -1).gather(2, idx)  # (b, h, k) packed positions
        if empty is not None:
            at = at.masked_fill(empty, -1)
        if self._pl is not None:
            at = at.masked_fill(torch.isneginf(packed.gather(self._pl, at, float("-inf"))), -1)
        live = (at >= 0).any(0)  # (h, k): a slot some row keeps
        if not packed.worth_packing(live, b, _slot_bytes(self._pk, self._pv)):
            self.replace(*(x.view(b, h, k, *x.shape[2:]) for x in self._taken(at.flatten(1))))
            return
        counts = live.sum(-1)
        caps = counts + room
        held = at[:, live]  # (b, Σ counts): head by head, in slot order
        into = at.new_zeros(b, int(caps.sum()))  # each head's held slots, then `room` free ones (never read)
        into[:, (live.cumsum(-1) - 1 + (caps.cumsum(0) - caps)[:, None])[live]] = held
        plain = not bool((held < 0).any()) and (self._pl is None or bool((packed.take(self._pl, held, 0.0) == 0).all()))
        keys, values, log_n = self._taken(into, log_n=not plain)  # plain: every held slot a plain token
        self._live, self._kept = live, counts.tolist()
        self._set_packed(keys, values, log_n, tuple(self._kept), tuple(caps.tolist()))

    def _taken(self, at: torch.Tensor, log_n: bool = True) -> tuple:
        """Ragged: the packed slots `at` `(b, n)` (-1: an empty slot, zeros with log-mass -inf), new tensors
        `(b, n, d)`, `(b, n, d)` and `(b, n)` (None unless `log_n`)."""
        mass = None if not log_n else packed.take(self._pl, at, float("-inf")) if self._pl is not None else \
            torch.zeros(at.shape, dtype=LOG_N_DTYPE, device=at.device).masked_fill(at < 0, float("-inf"))
        return packed.take(self._pk, at, 0.0), packed.take(self._pv, at, 0.0), mass


def _slot_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    """One row's bytes per slot: a key, a value and a log-mass."""
    return keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size() + LOG_N_DTYPE.itemsize
