"""The runtime interface a method sees in `setup` and `prepare`: what it may ask for, never the session
or the model object. `Runtime` offers what every runtime has (the tokenizer, the rotary embedding, a
memo); `SessionRuntime` adds the transformers runtime's second pass over the context (`probe`) for
methods that declare `Needs.second_pass`.
"""

from __future__ import annotations

from contextlib import contextmanager
from collections.abc import Callable

import torch


class Runtime:
    """`tokenizer` (None where the caller gave none), `rotary` (positions `(n,)` → (cos, sin), each
    `(n, head_dim)` float32, the model's own RoPE of its full-attention layers; None where unknown),
    `scaling` (the model's factor on q·k), `config` (the model's transformers config, read only: its
    shapes) and `memo`, a dict for what a method computed from the cache as it is now (kept across
    methods compressing one prefill). The second-pass calls raise: a runtime without one refuses
    methods that declare it (`kvmerge.capabilities`)."""

    def __init__(self, tokenizer=None, rotary: Callable | None = None, scaling: float = 1.0, config=None):
        self.tokenizer, self.rotary, self.scaling, self.config = tokenizer, rotary, scaling, config
        self.memo: dict = {}

    def probe(self, rows: list[list[int]], listener) -> None:
        """Feed `rows` after what the cache holds, calling `listener(layer_idx, query, layer)` after each
        compressed layer's attention, then forget the feed (see `kvmerge.Session.probe`)."""
        raise NotImplementedError("this runtime has no second pass over the context")

    @property
    def plain(self) -> torch.Tensor:
        """`(batch,)`: each row's trailing slots that are plain tokens not yet compressed."""
        raise NotImplementedError("this runtime keeps no per-row state between passes")

    def scratch(self, layer: int) -> dict:
        """Layer `layer`'s request scratch (a method's own per-layer state, e.g. scores a pass found)."""
        raise NotImplementedError("this runtime keeps no per-layer state between passes")

    @contextmanager
    def input_norms(self, layers: list[int]):
        """While active, `{layer: (batch, width) norms}` of each layer's attention input (its normalised
        hidden state) for every forward, e.g. a `probe`'s."""
        raise NotImplementedError("this runtime does not expose the attention inputs")
        yield {}

    def output_weight(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s attention output projection `(hidden, q_heads · head_dim)`."""
        raise NotImplementedError("this runtime does not expose the output projection")


class SessionRuntime(Runtime):
    """The transformers runtime's interface for one `Session`: everything `Runtime` offers, plus the
    second pass (`probe`), each row's plain slots, per-layer scratch and the attention's weights."""

    def __init__(self, session, tokenizer=None):
        from .model import attention_scaling

        self.tokenizer, self.config = tokenizer, session.model.config
        self.scaling = attention_scaling(self.config)
        self._session = session
        self._rotary = self._modules = None

    @property
    def rotary(self):
        if self._rotary is None:
            from .model import rotary_cos_sin

            self._rotary = rotary_cos_sin(self._session.model)
        return self._rotary

    @property
    def memo(self) -> dict:
        """The session's memo: a new dict whenever the cache changes."""
        return self._session.memo

    def probe(self, rows, listener) -> None:
        self._session.probe(rows, listener)

    @property
    def plain(self) -> torch.Tensor:
        return self._session.plain

    def scratch(self, layer: int) -> dict:
        return self._session.states[layer].scratch

    def _attention(self, layer: int):
        if self._modules is None:
            self._modules = {m.layer_idx: m for m in self._session.model.modules()
                             if getattr(m, "layer_idx", None) is not None and hasattr(m, "o_proj")}
        return self._modules[layer]

    @contextmanager
    def input_norms(self, layers: list[int]):
        norms: dict = {}

        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            norms[module.layer_idx] = hidden.float().norm(dim=-1)  # (b, width)
        hooks = [self._attention(i).register_forward_pre_hook(hook, with_kwargs=True) for i in layers]
        try:
            yield norms
        finally:
            for h in hooks:
                h.remove()

    def output_weight(self, layer: int) -> torch.Tensor:
        return self._attention(layer).o_proj.weight
