"""The merged KV cache: keys, values and a per-entry log-mass, as a transformers `Cache`.

Per layer, `keys`/`values` are `(batch, kv_heads, slots, head_dim)` (keys already rotated by RoPE)
and `log_n` is `(batch, kv_heads, slots)` float32: log of how many original tokens an entry stands
for (0 for a plain token), `-inf` for an empty padding slot. `log_n is None` means "all zeros": the
cache is then an ordinary cache and attention takes the stock SDPA path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicLayer

from .ops.merge import take

LOG_N_DTYPE = torch.float32


class MergedLayer(DynamicLayer):
    """One layer's merged cache. `seen` counts tokens appended (positions); `entries` counts slots."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.log_n: torch.Tensor | None = None
        self.seen = 0
        self.pending_log_n: torch.Tensor | None = None  # (batch, new) log-mass of the next update
        self.capture_queries = 0  # how many of the latest queries to keep (-1: all)
        self.queries: torch.Tensor | None = None
        self.decode_hook = None  # callable(layer, query) run after attention during decoding
        self.run_hooks = True  # False while feeding a prompt one token at a time
        self.slot_scores: torch.Tensor | None = None  # (batch, kv_heads, slots) a decode hook keeps in step
        self.targets: torch.Tensor | None = None  # (batch,) entries each row was compressed to
        self.compressed_at = 0  # `seen` when the last prefill compression ran
        self.index = 0

    # -- transformers Cache protocol -------------------------------------------------------
    def update(self, key_states, value_states, *args, kwargs=None, **_):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _d = key_states.shape
        new_log_n = self.pending_log_n
        self.pending_log_n = None
        if new_log_n is not None or self.log_n is not None:
            if new_log_n is None:
                new_log_n = torch.zeros(b, q, dtype=LOG_N_DTYPE, device=key_states.device)
            new_log_n = new_log_n.to(LOG_N_DTYPE)[:, None, :].expand(b, h, q)
            old = self.log_n
            if old is None:
                old = torch.zeros(b, h, self.entries, dtype=LOG_N_DTYPE, device=key_states.device)
            self.log_n = torch.cat([old, new_log_n], dim=-1)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.seen += q
        if kwargs is not None:
            kwargs["kvmerge_layer"] = self
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
        self.log_n, self.seen, self.queries, self.pending_log_n = None, 0, None, None

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

    def replace(self, keys: torch.Tensor, values: torch.Tensor, log_n: torch.Tensor | None) -> None:
        """Install compressed tensors; an all-zero `log_n` is dropped so attention stays on the fast path."""
        if log_n is not None and not bool((log_n == 0).all()):
            self.log_n = log_n.to(LOG_N_DTYPE).contiguous()
        else:
            self.log_n = None
        self.keys, self.values = keys.contiguous(), values.contiguous()

    def select(self, idx: torch.Tensor, empty: torch.Tensor | None = None) -> None:
        """Keep slots `idx` `(batch, kv_heads, k)`; those flagged in `empty` become empty slots."""
        keys, values, log_n = take(self.keys, self.values, self.full_log_n(), idx)
        self.replace(keys, values, log_n if empty is None else log_n.masked_fill(empty, float("-inf")))

    def capture(self, query: torch.Tensor) -> None:
        """Keep the latest `capture_queries` post-RoPE queries `(batch, heads, n, head_dim)`."""
        n = self.capture_queries
        if n == 0:
            return
        q = query if self.queries is None else torch.cat([self.queries, query], dim=2)
        self.queries = q if n < 0 else q[:, :, -n:]

    def map_rows(self, fn) -> None:
        """Replace the layer by `fn(keys, values, log_n, rows)` applied to dense groups of batch rows.

        Slots empty in every head (batch padding) are stripped first, row by row when there are any;
        results of different lengths are re-padded with empty slots. Slots empty in only some heads
        (ragged heads) stay and reach `fn` with log_n = -inf.
        """
        log_n = self.full_log_n()
        dead = torch.isinf(log_n).all(dim=1)
        if not bool(dead.any()):
            self.replace(*fn(self.keys, self.values, log_n, torch.arange(log_n.shape[0])))
            return
        parts = []
        for b in range(log_n.shape[0]):
            idx = (~dead[b]).nonzero().squeeze(1)
            k, v, ln = self.keys[b:b + 1, :, idx], self.values[b:b + 1, :, idx], log_n[b:b + 1, :, idx]
            parts.append(fn(k, v, ln, torch.tensor([b])))
        self.replace(*stack_rows(parts))

    def mass(self) -> torch.Tensor:
        """Tokens each (row, head) stands for: sum of exp(log_n), `(batch, kv_heads)`."""
        return self.full_log_n().exp().sum(-1)


class MergedCache(Cache):
    """A `Cache` of `MergedLayer`s, one per decoder layer."""

    def __init__(self, num_layers: int):
        layers = [MergedLayer() for _ in range(num_layers)]
        for i, layer in enumerate(layers):
            layer.index = i
        super().__init__(layers=layers)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    @property
    def entries(self) -> list[int]:
        return [layer.entries for layer in self.layers]

    def set_pending_log_n(self, log_n: torch.Tensor | None) -> None:
        """Log-mass of the tokens of the next forward, `(batch, new)`: 0 real, -inf padding."""
        for layer in self.layers:
            layer.pending_log_n = log_n


def stack_rows(parts):
    """Stack per-row (keys, values, log_n) of different slot counts, padding with empty slots."""
    width = max(p[0].shape[2] for p in parts)
    out = []
    for k, v, ln in parts:
        pad = width - k.shape[2]
        out.append((F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad)), F.pad(ln, (0, pad), value=float("-inf"))))
    return tuple(torch.cat(xs, dim=0) for xs in zip(*out))


def bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one uncompressed token takes in the cache across all layers (keys + values)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * elem
