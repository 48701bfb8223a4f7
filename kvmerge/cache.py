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
    """One layer's merged cache: `keys`, `values`, `log_n` and the token counter `seen`, nothing else."""

    is_croppable = False  # entries no longer map to token positions once merged

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log_n: torch.Tensor | None = None
        self.seen = 0

    # -- transformers Cache protocol -------------------------------------------------------
    def update(self, key_states, value_states, new_log_n: torch.Tensor | None = None):
        """Append `(b, h, q, d)` keys/values; `new_log_n` `(b, q)` is their log-mass (None: zeros)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _d = key_states.shape
        if new_log_n is not None or self.log_n is not None:
            if new_log_n is None:
                new_log_n = torch.zeros(b, q, dtype=LOG_N_DTYPE, device=key_states.device)
            new_log_n = new_log_n.to(device=key_states.device, dtype=LOG_N_DTYPE)[:, None, :].expand(b, h, q)
            old = self.log_n
            if old is None:
                old = torch.zeros(b, h, self.entries, dtype=LOG_N_DTYPE, device=key_states.device)
            self.log_n = torch.cat([old, new_log_n], dim=-1)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
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
        super().reset()
        self.log_n, self.seen = None, 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.log_n is not None:
            self.log_n = self.log_n[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.log_n is not None:
            self.log_n = self.log_n.repeat_interleave(repeats, dim=0)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.log_n is not None:
            self.log_n = self.log_n.index_select(0, beam_idx.to(self.log_n.device))

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

    def replace(self, keys: torch.Tensor, values: torch.Tensor, log_n: torch.Tensor | None) -> None:
        """Install compressed tensors; an all-zero `log_n` is dropped so attention stays on the fast path."""
        if log_n is not None and not bool((log_n == 0).all()):
            self.log_n = log_n.to(LOG_N_DTYPE).contiguous()
        else:
            self.log_n = None
        self.keys, self.values = keys.contiguous(), values.contiguous()

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
            self.keys, self.values = self.keys[:, :, start:], self.values[:, :, start:]
            self.positions = self.positions[:, start:]
            if self.log_n is not None:
                self.log_n = self.log_n[:, :, start:]
                if not bool(torch.isinf(self.log_n).any()):
                    self.log_n = None
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
