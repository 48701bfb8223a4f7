"""Sliding-window layers of hybrid models (Gemma 3, Mistral-style): kept as transformers keeps them
(or, with `hold`, fewer of their last slots), never compressed, with the positions their window mask needs."""

from __future__ import annotations

import torch

from .layer import MergedLayer


class SlidingLayer(MergedLayer):
    """A sliding-window layer, never compressed: between steps it holds each row's last `held` positions,
    `window` − 1 (the slots the next queries can still see, as transformers keeps them) unless `hold`
    lowered it. `positions` `(batch, slots)` are the slots' true positions, which the attention's window
    mask reads; a step's queries see the held slots and the step's own, within the window."""

    is_sliding = True

    def __init__(self, window: int, **kwargs):
        super().__init__(**kwargs)
        self.window = window
        self.held = window - 1
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
        self._drop_unheld()
        return seen

    def hold(self, slots: int) -> int:
        """From now on keep each row's last `slots` positions between steps (at most `window` − 1),
        dropping older ones now; returns the slots per row and KV head freed (of a row holding all)."""
        if slots < 1:
            raise ValueError(f"a sliding layer must hold at least 1 slot, got {slots}")
        before = self.positions.shape[1] if self.positions is not None else 0
        self.held = min(slots, self.window - 1)
        if self.positions is not None:
            self._drop_unheld()
        freed = before - (self.positions.shape[1] if self.positions is not None else 0)
        if self._keys is not None and self._keys.untyped_storage().nbytes() > self._keys.nbytes:
            # own buffers, so dropped slots' memory is released, not kept under a view (a chunked
            # prefill's later chunks leave one too: each chunk's compression calls this again)
            self._keys, self._values = self._keys.clone(), self._values.clone()
            self._log_n = None if self._log_n is None else self._log_n.clone()
        return freed

    def _drop_unheld(self) -> None:
        live = torch.ones_like(self.positions, dtype=torch.bool) if self.log_n is None else ~torch.isinf(self.log_n[:, 0])
        next_pos = self.positions.masked_fill(~live, -1).amax(-1, keepdim=True) + 1
        needed = live & (self.positions >= next_pos - self.held)
        start = int(needed.any(0).long().argmax()) if bool(needed.any()) else self.positions.shape[1]
        if start:
            self.drop_first(start)
            self.positions = self.positions[:, start:]
            if self.log_n is not None and not bool(torch.isinf(self.log_n).any()):
                self._log_n = None

    def reset(self) -> None:
        super().reset()
        self.positions = None
        self.held = self.window - 1

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


def sliding_layer_count(config) -> int:
    """How many layers of the model with `config` attend in a sliding window (0 for a layer type
    kvmerge refuses anyway, with its own message elsewhere)."""
    try:
        return sum(w is not None for w in layer_windows(config))
    except ValueError:
        return 0


def sliding_only(config) -> bool:
    """Whether every layer of the model with `config` attends in a sliding window (no layer to compress)."""
    layers = config.get_text_config(decoder=True).num_hidden_layers
    return sliding_layer_count(config) == layers > 0


def sliding_layers(layers: list, method, lengths: list[int]) -> list[SlidingLayer]:
    """The sliding layers among `layers` that `method.sliding` trims for rows of these `lengths`, or a
    ValueError naming why it cannot apply."""
    sliding = [layer for layer in layers if getattr(layer, "is_sliding", False)]
    if not sliding:
        raise ValueError(f"{method.name}: sliding={method.sliding} shortens sliding-window layers, and this model "
                         "has none")
    if len(set(lengths)) > 1:
        raise ValueError(f"{method.name}: sliding={method.sliding} moves one count of slots from the sliding "
                         "layers to the compressed ones, so it needs rows of one length (one row, or rows of "
                         "one length)")
    share, window = method.sliding, min(layer.window for layer in sliding) - 1
    if isinstance(share, int) and share > window:
        raise ValueError(f"{method.name}: sliding={share} slots is more than this model's sliding layers hold "
                         f"({window}: the window's earlier tokens), so it would free nothing; give at most {window} "
                         "slots, or a fraction of the window in (0, 1]")
    return sliding


def hold_sliding(layers: list, compressed: list, method, seen: list[int]) -> int:
    """Apply `method.sliding` to the sliding layers among `layers` (rows that have seen `seen` tokens):
    each holds its last `sliding` slots from now on. Returns the entries this frees per KV head of the
    `compressed` layers: what a full window would hold against what is held, so that every chunk of a
    chunked prefill gets the same count."""
    freed, share = 0, method.sliding
    for layer in sliding_layers(layers, method, seen):
        layer.hold(share if isinstance(share, int) else max(1, round(share * (layer.window - 1))))
        full = min(layer.window - 1, seen[0])
        freed += (full - min(layer.held, full)) * layer.keys.shape[1]
    return freed // sum(layer.keys.shape[1] for layer in compressed)
