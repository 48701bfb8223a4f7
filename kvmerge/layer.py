"""One layer of the merged KV cache: keys, values and a per-entry log-mass.

Per layer, `keys`/`values` are `(batch, kv_heads, slots, head_dim)` (keys already rotated by RoPE)
and `log_n` is `(batch, kv_heads, slots)` float32: log of how many original tokens an entry stands
for (0 for a plain token), `-inf` for an empty padding slot. `log_n is None` means "all zeros": the
cache is then an ordinary cache and attention takes the stock SDPA path. `seen` counts the tokens
appended, so new tokens keep their true positions however few entries remain.

When a compression leaves a layer's KV heads with different numbers of live slots, `compact` (or
`select`) stores each head at its own length: `kvmerge.ragged.PackedHeads`, which the layer mixes in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer

from .ops.kv import KV
from .ragged import LOG_N_DTYPE, PackedHeads


class MergedLayer(PackedHeads, DynamicLayer):
    """One layer's merged cache: `keys`, `values`, `log_n` and the token counter `seen`, nothing else.

    The tensors are views of the first `entries` slots of preallocated buffers: appending writes in
    place (capacity grows geometrically, or is set by `reserve`), and `replace` writes a compressed
    cache into the same buffers when it fits, so decoding copies nothing per step.
    """

    is_croppable = False  # entries no longer map to token positions once merged

    def __init__(self, **kwargs):
        self._keys = self._values = self._log_n = None  # buffers (b, h, capacity, d) and (b, h, capacity)
        self._length = 0
        self._init_packed()
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
    def mean_entries(self) -> float:
        """Entries held per (batch row, kv head), averaged over the heads (ragged heads: each at its own
        length, padding excluded)."""
        if self._pk is not None:
            return sum(self._lens) / len(self._lens)
        return float(self.entries)

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
        self._select_packed(idx, empty, room)

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


def stack_rows(parts: list[KV]) -> KV:
    """Stack per-row KVs of different slot counts, padding with empty slots."""
    width = max(p.slots for p in parts)
    padded = [KV(F.pad(k, (0, 0, 0, width - k.shape[2])), F.pad(v, (0, 0, 0, width - k.shape[2])),
                 F.pad(ln, (0, width - k.shape[2]), value=float("-inf"))) for k, v, ln in parts]
    return KV(*(torch.cat(xs, dim=0) for xs in zip(*padded)))
