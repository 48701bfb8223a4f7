"""The merged KV cache, a transformers `Cache`: full-attention `MergedLayer`s (compressible) and
`SlidingLayer`s, one per decoder layer, and what a stock cache would hold in bytes."""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.cache_utils import Cache

from .attention import attention_active
from .errors import InputError
from .graphs import GraphLayer
from .layer import MergedLayer
from .sliding import SlidingLayer, layer_windows


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
        self.block_ended = False  # set when the `kvmerge.compressing` block that made this cache ends

    def check_free(self) -> None:
        """An InputError while a `GraphDecoder` holds this cache (its layers are the decoder's until it closes)."""
        if any(isinstance(layer, GraphLayer) for layer in self.layers):
            raise InputError("the cache is in a GraphDecoder: close it (leave its `with` block) first")

    @property
    def compressible(self) -> list[int]:
        """Indices of the full-attention layers, the ones a method compresses."""
        return [i for i, layer in enumerate(self.layers) if not getattr(layer, "is_sliding", False)]

    def update(self, key_states, value_states, layer_idx: int, kwargs: dict | None = None):
        """Append to layer `layer_idx`. Transformers passes the same `kwargs` dict on to the attention
        function, so the layer's log-mass, a sliding layer's window and positions, and the listener
        reach kvmerge's attention through it."""
        layer = self.layers[layer_idx]
        kwargs = {} if kwargs is None else kwargs
        if layer_idx == 0 and not attention_active() and self.block_ended:
            raise InputError("this cache's `with kvmerge.compressing(...)` block has ended, and the model's own "
                             "attention cannot read its merged entries: call model.generate(..., cache=cache) inside "
                             "that block")
        if layer_idx == 0 and not attention_active() and any(x.ragged for x in self.layers):
            raise InputError("this cache stores the KV heads of some layers at different lengths (global per-head "
                             "allocation), which only kvmerge's attention reads: run the model inside "
                             "kvmerge.kvmerge_attention(model)")
        with torch.profiler.record_function("kvmerge::cache_append"):
            return self._update(layer, layer_idx, key_states, value_states, kwargs)

    def _update(self, layer, layer_idx, key_states, value_states, kwargs):
        if isinstance(layer, GraphLayer):  # graph decoding: fixed shapes, a sliding window already in log_n
            if key_states.shape[2] != 1:
                raise InputError("this cache is in a GraphDecoder, which feeds one token per row at a time: "
                                 "close it before feeding more")
            keys, values, log_n, heads = layer.update(key_states, value_states)
            kwargs["kvmerge_masked"] = True
            if heads is not None:
                kwargs["kvmerge_heads"] = heads
        elif isinstance(layer, SlidingLayer):
            keys, values, log_n, positions = layer.update(key_states, value_states, self.next_log_n,
                                                          kwargs.get("position_ids"))
            kwargs["kvmerge_window"] = (layer.window, positions, positions[:, -key_states.shape[2]:])
        elif layer.ragged:  # KV heads stored at their own lengths, packed
            keys, values = layer.update(key_states, value_states, self.next_log_n)
            kwargs["kvmerge_heads"] = layer.packed()
            log_n = None
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
        return sum(layer.allocated_bytes for layer in self.layers)

    @property
    def entries(self) -> list[int]:
        return [layer.entries for layer in self.layers]


def stock_cache_bytes(config, dtype: torch.dtype, n_tokens: int, layers: list[int] | None = None) -> int:
    """Bytes transformers' own cache holds for one row of `n_tokens` (keys + values; sliding layers
    keep their last window − 1 tokens), over all layers or the `layers` given."""
    per_layer = bytes_per_token(config, dtype) // config.get_text_config(decoder=True).num_hidden_layers
    windows = layer_windows(config)
    layers = range(len(windows)) if layers is None else layers
    return per_layer * sum(n_tokens if windows[i] is None else min(n_tokens, windows[i] - 1) for i in layers)


def kv_shape(config) -> tuple[int, int]:
    """`(kv_heads, head_dim)` of each layer's cache."""
    config = config.get_text_config(decoder=True)
    return config.num_key_value_heads, getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one uncompressed token takes in the cache across all layers (keys + values)."""
    heads, head_dim = kv_shape(config)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.get_text_config(decoder=True).num_hidden_layers * heads * head_dim * elem
