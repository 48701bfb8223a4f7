"""The merged KV cache: keys, values and a per-entry log-mass, as a transformers `Cache`.

Per layer, `keys`/`values` are `(batch, kv_heads, slots, head_dim)` (keys already rotated by RoPE)
and `log_n` is `(batch, kv_heads, slots)` float32: log of how many original tokens an entry stands
for (0 for a plain token), `-inf` for an empty padding slot. `log_n is None` means "all zeros": the
cache is then an ordinary cache and attention takes the stock SDPA path. `seen` counts the tokens
appended, so new tokens keep their true positions however few entries remain.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

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
        super().__init__(**kwargs)
        self.seen = 0

    # -- the tensors: views of the buffers ----------------------------------------------------
    keys = property(lambda self: None if self._keys is None else self._keys[:, :, :self._length],
                    lambda self, x: self._install(keys=x))
    values = property(lambda self: None if self._values is None else self._values[:, :, :self._length],
                      lambda self, x: self._install(values=x))
    log_n = property(lambda self: None if self._log_n is None else self._log_n[:, :, :self._length],
                     lambda self, x: self._install(log_n=x))

    def _install(self, **tensors) -> None:
        """Plain assignment (transformers' own batch operations): the tensor becomes the buffer."""
        for name, x in tensors.items():
            setattr(self, f"_{name}", x)
            if x is not None and name != "log_n":
                self._length = x.shape[2] if x.dim() == 4 else 0

    def drop_first(self, count: int) -> None:
        """Forget the first `count` slots (the buffers become views from there on)."""
        self._keys, self._values = self._keys[:, :, count:], self._values[:, :, count:]
        if self._log_n is not None:
            self._log_n = self._log_n[:, :, count:]
        self._length -= count

    @property
    def capacity(self) -> int:
        return 0 if self._keys is None or self._keys.dim() < 4 else self._keys.shape[2]

    def reserve(self, slots: int) -> None:
        """Set the buffers' capacity to `slots` (at least the entries held), copying what is held."""
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
        self._keys = self._values = self._log_n = None
        self._length, self.seen, self.is_initialized = 0, 0, False

    def _map_batch(self, fn) -> None:
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
        """Physical slots per (batch row, kv head), padding included."""
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        extra = 0 if self.log_n is None else self.log_n.numel() * self.log_n.element_size()
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size() + extra

    def full_log_n(self) -> torch.Tensor:
        """`log_n` materialised (zeros when the cache holds plain tokens only)."""
        if self.log_n is not None:
            return self.log_n
        b, h, s, _ = self.keys.shape
        return torch.zeros(b, h, s, dtype=LOG_N_DTYPE, device=self.keys.device)

    def kv(self) -> KV:
        return KV(self.keys, self.values, self.full_log_n())

    def replace(self, keys: torch.Tensor, values: torch.Tensor, log_n: torch.Tensor | None, fit: bool = False) -> None:
        """Install compressed tensors, written into the buffers when they fit and have the same batch
        (`fit`: new buffers of exactly their size); an all-zero `log_n` is dropped so attention stays on
        the fast path."""
        if log_n is not None and bool((log_n == 0).all()):
            log_n = None
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

    def select(self, idx: torch.Tensor, empty: torch.Tensor | None = None) -> None:
        """Keep slots `idx` `(batch, kv_heads, k)`; those flagged in `empty` become empty slots."""
        keys, values, log_n = self.kv().take(idx)
        self.replace(keys, values, log_n if empty is None else log_n.masked_fill(empty, float("-inf")))

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


class SlidingLayer(MergedLayer):
    """A sliding-window layer, kept exactly as transformers keeps it: never compressed, it holds the
    slots the next queries can still see (each row's last `window` − 1 positions). `positions`
    `(batch, slots)` are the slots' true positions, which the attention's window mask reads."""

    is_sliding = True

    def __init__(self, window: int, **kwargs):
        super().__init__(**kwargs)
        self.window = window
        self.positions: torch.Tensor | None = None

    def update(self, key_states, value_states, new_log_n=None, new_positions=None):
        """Append; returns (keys, values, log_n or None, positions) of every slot this step attends to,
        then drops the slots no later query can see."""
        b, _h, q, _d = key_states.shape
        if new_positions is None:
            new_positions = self.seen + torch.arange(q, device=key_states.device).expand(b, q)
        keys, values = super().update(key_states, value_states, new_log_n)
        new_positions = new_positions.to(key_states.device).expand(b, q)
        self.positions = new_positions if self.positions is None else torch.cat([self.positions, new_positions], -1)
        seen = (keys, values, self.log_n, self.positions)
        live = torch.ones_like(self.positions, dtype=torch.bool) if self.log_n is None else ~torch.isinf(self.log_n[:, 0])
        next_pos = self.positions.masked_fill(~live, -1).amax(-1, keepdim=True) + 1
        needed = live & (self.positions > next_pos - self.window)
        start = int(needed.any(0).long().argmax()) if bool(needed.any()) else self.positions.shape[1]
        if start:
            self.drop_first(start)
            self.positions = self.positions[:, start:]
            if self.log_n is not None and not bool(torch.isinf(self.log_n).any()):
                self._log_n = None
        return seen

    def reset(self) -> None:
        super().reset()
        self.positions = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: its sliding window, or None for full attention (what transformers' own
    `DynamicCache(config=...)` would build). Raises on a layer type kvmerge does not handle."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    types, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = []
    for kind, kw in zip(types, kwargs):
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"layers of type {kind!r} are not supported (kvmerge handles full and sliding attention)")
        windows.append(kw.get("sliding_window") if kind == "sliding_attention" else None)
    return windows


class MergedCache(Cache):
    """A `Cache` of `MergedLayer`s (full attention, compressible) and `SlidingLayer`s, one per decoder layer.

    Two things beside the layers, both set by whoever feeds the model (the kvmerge runtime):
    `next_log_n` `(batch, new)`, the log-mass of the tokens of the next forward (0 real, -inf
    padding; None: all real), and `listener`, called by kvmerge's attention as
    `listener(layer_idx, query)` after each layer's attention with its post-RoPE queries
    `(batch, heads, q, head_dim)`: the one hook through which the runtime captures queries and runs
    decode-time policies.
    """

    def __init__(self, num_layers_or_config):
        """`MergedCache(num_layers)`: all layers full attention; `MergedCache(config)`: the model's own
        layer types (sliding-window layers become `SlidingLayer`s)."""
        windows = ([None] * num_layers_or_config if isinstance(num_layers_or_config, int)
                   else layer_windows(num_layers_or_config))
        super().__init__(layers=[MergedLayer() if w is None else SlidingLayer(w) for w in windows])
        self.next_log_n: torch.Tensor | None = None
        self.listener: Callable[[int, torch.Tensor], None] | None = None

    @property
    def compressible(self) -> list[int]:
        """Indices of the full-attention layers, the ones a method compresses."""
        return [i for i, layer in enumerate(self.layers) if not isinstance(layer, SlidingLayer)]

    def update(self, key_states, value_states, layer_idx: int, kwargs: dict | None = None):
        """Append to layer `layer_idx`. Transformers passes the same `kwargs` dict on to the attention
        function, so the layer's log-mass, a sliding layer's window and positions, and the listener
        reach kvmerge's attention through it."""
        layer = self.layers[layer_idx]
        kwargs = {} if kwargs is None else kwargs
        with torch.profiler.record_function("kvmerge::cache_append"):
            return self._update(layer, layer_idx, key_states, value_states, kwargs)

    def _update(self, layer, layer_idx, key_states, value_states, kwargs):
        if isinstance(layer, SlidingLayer):
            keys, values, log_n, positions = layer.update(key_states, value_states, self.next_log_n,
                                                          kwargs.get("position_ids"))
            kwargs["kvmerge_window"] = (layer.window, positions, positions[:, -key_states.shape[2]:])
        else:
            keys, values = layer.update(key_states, value_states, self.next_log_n)
            log_n = layer.log_n
        kwargs["kvmerge_log_n"] = log_n
        kwargs["kvmerge_listener"] = None if self.listener is None else (layer_idx, self.listener)
        return keys, values

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def allocated_bytes(self) -> int:
        """Bytes the layers' buffers take, spare capacity included."""
        return sum(x.numel() * x.element_size() for layer in self.layers
                   for x in (layer._keys, layer._values, layer._log_n) if x is not None)

    @property
    def entries(self) -> list[int]:
        return [layer.entries for layer in self.layers]


def stack_rows(parts: list[KV]) -> KV:
    """Stack per-row KVs of different slot counts, padding with empty slots."""
    width = max(p.slots for p in parts)
    padded = [KV(F.pad(k, (0, 0, 0, width - k.shape[2])), F.pad(v, (0, 0, 0, width - k.shape[2])),
                 F.pad(ln, (0, width - k.shape[2]), value=float("-inf"))) for k, v, ln in parts]
    return KV(*(torch.cat(xs, dim=0) for xs in zip(*padded)))


def stock_cache_bytes(config, dtype: torch.dtype, n_tokens: int, layers: list[int] | None = None) -> int:
    """Bytes transformers' own cache holds for one row of `n_tokens` (keys + values; sliding layers
    keep their last window − 1 tokens), over all layers or the `layers` given."""
    per_layer = bytes_per_token(config, dtype) // config.get_text_config(decoder=True).num_hidden_layers
    windows = layer_windows(config)
    layers = range(len(windows)) if layers is None else layers
    return per_layer * sum(n_tokens if windows[i] is None else min(n_tokens, windows[i] - 1) for i in layers)


def bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one uncompressed token takes in the cache across all layers (keys + values)."""
    config = config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem
