"""One layer of the merged KV cache: keys, values and a per-entry log-mass.

Per layer, `keys`/`values` are `(batch, kv_heads, slots, head_dim)` (keys already rotated by RoPE)
and `log_n` is `(batch, kv_heads, slots)` float32: log of how many original tokens an entry stands
for (0 for a plain token), `-inf` for an empty padding slot. `log_n is None` means "all zeros": the
cache is then an ordinary cache and attention takes the stock SDPA path. `seen` counts the tokens
appended, so new tokens keep their true positions however few entries remain.

When a compression leaves the KV heads of a layer with different numbers of live slots (global
per-head allocation), `compact` stores each head at its own length instead of padding every head to
the widest: the empty slots are not kept. The heads then live packed back to back in one buffer per
tensor, `_pk`/`_pv` `(batch, capacity, head_dim)` and `_pl` `(batch, capacity)` (None: all zeros),
head i in the segment `[_starts[i], _starts[i] + _caps[i])` of which its first `_lens[i]` slots are
held (spare capacity at each segment's end, so a decoding step appends to every head with one
indexed write at `_next` `(kv_heads,)`, the slots `_starts + _lens`). The layer's `keys`/`values`/
`log_n` then read as the padded layout it replaced (its empty slots where they were, as zeros with
log_n -inf, then what was appended since), so every reader sees the same entries at the same slots;
appends and kvmerge's attention (`ragged_sdpa`) use the segments directly. Every tensor of the ragged
layout is an attribute of its own (no views of one another), so copying the layer's attributes one
by one copies it; the tuples are replaced, never changed in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from .ops import packed
from .ops.kv import KV

LOG_N_DTYPE = torch.float32


class MergedLayer(DynamicLayer):
    """One layer's merged cache: `keys`, `values`, `log_n` and the token counter `seen`, nothing else.

    The tensors are views of the first `entries` slots of preallocated buffers: appending writes in
    place (capacity grows geometrically, or is set by `reserve`), and `replace` writes a compressed
    cache into the same buffers when it fits, so decoding copies nothing per step.
    """

    is_croppable = False  # entries no longer map to token positions once merged

    def __init__(self, **kwargs):
        self._keys = self._values = self._log_n = None  # buffers (b, h, capacity, d) and (b, h, capacity)
        self._length = 0
        self._live, self._kept = None, []  # ragged: (h, width) bool, the padded slots each head keeps; their counts
        self._pk = self._pv = self._pl = self._next = None  # ragged: packed buffers, next write slots (see above)
        self._starts = self._lens = self._caps = ()
        self._map = None  # ragged: (the `_live`, `_starts`, `_lens` it was made for, the slot map)
        super().__init__(**kwargs)
        self.seen = 0

    # -- the tensors: views of the buffers ----------------------------------------------------
    def _view(self, name: str) -> torch.Tensor | None:
        if self._pk is not None:
            return self._padded(names=(name,))[0]
        buf = getattr(self, "_" + name)
        return None if buf is None else buf[:, :, :self._length]

    keys = property(lambda self: self._view("keys"), lambda self, x: self._install(keys=x))
    values = property(lambda self: self._view("values"), lambda self, x: self._install(values=x))
    log_n = property(lambda self: self._view("log_n"), lambda self, x: self._install(log_n=x))

    def _install(self, **tensors) -> None:
        """Plain assignment (transformers' own batch operations): the tensor becomes the buffer."""
        self._dense()
        for name, x in tensors.items():
            setattr(self, f"_{name}", x)
            if x is not None and name != "log_n":
                self._length = x.shape[2] if x.dim() == 4 else 0

    def drop_first(self, count: int) -> None:
        """Forget the first `count` slots (the buffers become views from there on)."""
        self._dense()
        self._keys, self._values = self._keys[:, :, count:], self._values[:, :, count:]
        if self._log_n is not None:
            self._log_n = self._log_n[:, :, count:]
        self._length -= count

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None or self._keys.dim() < 4 else self._keys.shape[2]

    def reserve(self, slots: int) -> None:
        """Set the buffers' capacity to `slots` (at least the entries held), copying what is held."""
        if self._pk is not None:  # room for as many appends in every head
            extra = slots - self.entries
            self._repack(tuple(max(n, n + extra) for n in self._lens))
            return
        if self._keys is None or self._keys.dim() < 4 or slots == self.capacity:
            return
        slots = max(slots, self._length)
        n = self._length

        def grown(buf):
            if buf is None:
                return None
            out = buf.new_empty(*buf.shape[:2], slots, *buf.shape[3:])
            out[:, :, :n] = buf[:, :, :n]
            return out

        self._keys, self._values, self._log_n = grown(self._keys), grown(self._values), grown(self._log_n)

    def update(self, key_states, value_states, new_log_n: torch.Tensor | None = None):
        """Append `(b, h, q, d)` keys/values in place; `new_log_n` `(b, q)` is their log-mass (None: zeros)."""
        b, h, q, _d = key_states.shape
        if self._pk is not None:
            self._append_heads(key_states, value_states, new_log_n)
            self.seen += q
            return key_states, value_states
        if not self.is_initialized or self.capacity == 0:
            self.lazy_initialization(key_states, value_states)
            self._keys, self._values = key_states.new_empty(b, h, 0, _d), value_states.new_empty(b, h, 0, _d)
            self._log_n, self._length = None, 0
        n = self._length
        if n + q > self.capacity:
            self.reserve(max(n + q, 2 * self.capacity))
        if new_log_n is not None and self._log_n is None:
            self._log_n = torch.zeros(b, h, self.capacity, dtype=LOG_N_DTYPE, device=key_states.device)
        self._keys[:, :, n:n + q] = key_states
        self._values[:, :, n:n + q] = value_states
        if self._log_n is not None:
            self._log_n[:, :, n:n + q] = 0.0 if new_log_n is None else new_log_n.to(key_states.device)[:, None, :]
        self._length = n + q
        self.seen += q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # kv index i is "virtual position" i + (seen - entries): new tokens line up with their true positions.
        return self.entries + query_length, self.seen - self.entries

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("kvmerge caches cannot be cropped (entries no longer map to tokens)")

    def reset(self) -> None:
        self.heads, self._live = None, None
        self._keys = self._values = self._log_n = None
        self._length, self.seen, self.is_initialized = 0, 0, False

    def _map_batch(self, fn) -> None:
        if self._pk is not None:  # every row's segments sit at the same places: map the buffers whole
            self._pk, self._pv = fn(self._pk), fn(self._pv)
            self._pl = None if self._pl is None else fn(self._pl)
            return
        log_n = self.log_n
        self.replace(fn(self.keys), fn(self.values), None if log_n is None else fn(log_n), fit=True)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda x: x[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda x: x.repeat_interleave(repeats, dim=0))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda x: x.index_select(0, beam_idx.to(x.device)))

    # -- kvmerge ---------------------------------------------------------------------------
    @property
    def entries(self) -> int:
        """Slots per (batch row, kv head), padding included (ragged heads: as the padded layout)."""
        if self._pk is not None:
            return self._live.shape[1] + self._lens[0] - self._kept[0]
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes held: keys, values and log_n (ragged heads: each at its own length)."""
        if self._pk is not None:  # the heads' held slots, and one byte per padded slot saying which each head keeps
            b, _, d = self._pk.shape
            slot = self._pk.element_size() * d + self._pv.element_size() * self._pv.shape[-1]
            slot += 0 if self._pl is None else self._pl.element_size()
            return b * sum(self._lens) * slot + self._live.numel()
        if self.keys is None:
            return 0
        extra = 0 if self.log_n is None else self.log_n.numel() * self.log_n.element_size()
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size() + extra

    @property
    def allocated_bytes(self) -> int:
        """Bytes the buffers take, spare capacity included (ragged heads: theirs and the mask)."""
        held = (self._pk, self._pv, self._pl, self._live) if self._pk is not None else (self._keys, self._values, self._log_n)
        return sum(x.numel() * x.element_size() for x in held if x is not None)

    def full_log_n(self) -> torch.Tensor:
        """`log_n` materialised (zeros when the cache holds plain tokens only)."""
        if self._pk is not None:
            return self._padded(names=("log_n",))[0]
        if self.log_n is not None:
            return self.log_n
        b, h, s, _ = self.keys.shape
        return torch.zeros(b, h, s, dtype=LOG_N_DTYPE, device=self.keys.device)

    def kv(self) -> KV:
        if self._pk is None:
            return KV(self.keys, self.values, self.full_log_n())
        return KV(*self._padded())

    def last(self, count: int) -> KV:
        """Each head's last `count` slots of the padded layout, `KV` `(b, h, count, ...)`: what the
        scores of a chunk's fresh slots read, without the rest of the layer."""
        if self._pk is None:
            return self.kv().narrow(self.entries - count, count)
        return KV(*self._padded(self.entries - count))

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

    # -- ragged heads: packed segments ------------------------------------------------------------
    @property
    def ragged(self) -> bool:
        """Whether the KV heads are stored at their own lengths (packed segments)."""
        return self._pk is not None

    @property
    def heads(self) -> list[MergedLayer] | None:
        """Ragged storage: one single-head layer per KV head, viewing its segment (for readers: writing
        to them does not write the layer); otherwise None."""
        if self._pk is None:
            return None
        out = []
        for keys, values, log_n in self._segments():
            head = MergedLayer()
            head.is_initialized, head.device, head.seen = True, keys.device, self.seen
            head._keys, head._values, head._length = keys, values, keys.shape[2]
            head._log_n = None if self._pl is None else log_n
            out.append(head)
        return out

    @heads.setter
    def heads(self, heads: list[MergedLayer] | None) -> None:
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
        self._lens, self._caps = lens, lens if caps is None else caps
        self._starts = tuple(sum(self._caps[:i]) for i in range(len(lens)))
        self._next = torch.tensor([s + n for s, n in zip(self._starts, lens)], device=keys.device)

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
        starts = tuple(sum(caps[:i]) for i in range(len(caps)))
        src = torch.cat([torch.arange(s, s + n) for s, n in zip(self._starts, self._lens)]).to(self._pk.device)
        dst = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, self._lens)]).to(self._pk.device)

        def moved(buf):
            if buf is None:
                return None
            out = buf.new_zeros(buf.shape[0], sum(caps), *buf.shape[2:])
            return out.index_copy_(1, dst, buf.index_select(1, src))

        self._pk, self._pv, self._pl = moved(self._pk), moved(self._pv), moved(self._pl)
        self._starts, self._caps = starts, caps
        self._next = torch.tensor([s + n for s, n in zip(starts, self._lens)], device=self._pk.device)

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

    def replace(self, keys: torch.Tensor, values: torch.Tensor, log_n: torch.Tensor | None, fit: bool = False) -> None:
        """Install compressed tensors, written into the buffers when they fit and have the same batch
        (`fit`: new buffers of exactly their size); an all-zero `log_n` is dropped so attention stays on
        the fast path."""
        if log_n is not None and bool((log_n == 0).all()):
            log_n = None
        self.heads, self._live = None, None
        n = keys.shape[2]
        if fit or self._keys is None or self._keys.dim() < 4 or n > self.capacity or keys.shape[:2] != self._keys.shape[:2]:
            self._keys, self._values = keys.clone(), values.clone()
            self._log_n = None if log_n is None else log_n.to(LOG_N_DTYPE).clone()
            self._length = n
            return
        keys, values = keys.clone(), values.clone()  # they may be views of the buffers themselves
        log_n = None if log_n is None else log_n.to(LOG_N_DTYPE).clone()
        self._keys[:, :, :n], self._values[:, :, :n] = keys, values
        if log_n is None:
            self._log_n = None
        else:
            if self._log_n is None:
                self._log_n = torch.zeros(*keys.shape[:2], self.capacity, dtype=LOG_N_DTYPE, device=keys.device)
            self._log_n[:, :, :n] = log_n
        self._length = n

    def select(self, idx: torch.Tensor, empty: torch.Tensor | None = None, room: int = 0) -> None:
        """Keep slots `idx` `(batch, kv_heads, k)` of the padded layout; those flagged in `empty` become
        empty slots. Ragged heads are read from their packed buffers and stay packed when `compact`
        would pack the result (one gather per buffer, no padded copy of the layer), with `room` spare
        slots after each head's (for appends to come: a chunked prefill's next chunk)."""
        if self._pk is None:
            keys, values, log_n = self.kv().take(idx)
            if empty is not None:  # empty slots are zeros with log-mass -inf
                keys, values = keys.masked_fill(empty[..., None], 0), values.masked_fill(empty[..., None], 0)
                log_n = log_n.masked_fill(empty, float("-inf"))
            self.replace(keys, values, log_n)
            return
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

    def map_rows(self, fn: Callable[[KV, torch.Tensor], KV]) -> None:
        """Replace the layer by `fn(kv, rows)` applied to dense groups of batch rows.

        Slots empty in every head (batch padding) are stripped first, row by row when there are any;
        results of different lengths are re-padded with empty slots. Slots empty in only some heads
        (ragged heads) stay and reach `fn` with log_n = -inf.
        """
        kv = self.kv()
        dead = torch.isinf(kv.log_n).all(dim=1)
        if not bool(dead.any()):
            self.replace(*fn(kv, torch.arange(kv.keys.shape[0])))
            return
        parts = []
        for b in range(kv.keys.shape[0]):
            idx = (~dead[b]).nonzero().squeeze(1)
            parts.append(fn(KV(*(x[b:b + 1, :, idx] for x in kv)), torch.tensor([b])))
        self.replace(*stack_rows(parts))

    def mass(self) -> torch.Tensor:
        """Tokens each (row, head) stands for: sum of exp(log_n), `(batch, kv_heads)`."""
        return self.full_log_n().exp().sum(-1)


def _slot_bytes(keys: torch.Tensor, values: torch.Tensor) -> int:
    """One row's bytes per slot: a key, a value and a log-mass."""
    return keys.shape[-1] * keys.element_size() + values.shape[-1] * values.element_size() + LOG_N_DTYPE.itemsize


def stack_rows(parts: list[KV]) -> KV:
    """Stack per-row KVs of different slot counts, padding with empty slots."""
    width = max(p.slots for p in parts)
    padded = [KV(F.pad(k, (0, 0, 0, width - k.shape[2])), F.pad(v, (0, 0, 0, width - k.shape[2])),
                 F.pad(ln, (0, width - k.shape[2]), value=float("-inf"))) for k, v, ln in parts]
    return KV(*(torch.cat(xs, dim=0) for xs in zip(*padded)))
