"""The compression-method interface, budgets, and the method registry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

_REGISTRY: dict[str, type["Method"]] = {}


@dataclass
class LayerContext:
    """What a method sees besides one layer's keys, values and log_n.

    `token_ids` `(batch, slots)` are the ids of the cached plain tokens (prefill only), `surprisal` their
    −log p given the prefix (when the method sets `needs_surprisal`); `queries`
    `(batch, heads, n, head_dim)` are the captured post-RoPE prompt queries (the last `n`).
    """

    layer_idx: int
    num_layers: int
    target: int
    sinks: int
    window: int
    scaling: float
    token_ids: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    decoding: bool = False
    rows: torch.Tensor | None = None  # which batch rows these are
    dense: bool = True  # False in `plan` when rows are padded (then per-row work belongs in `compress`)
    surprisal: torch.Tensor | None = None  # (batch, slots) −log p(token | prefix), if the method asks


@dataclass
class Method:
    """Base of every compression method: a dataclass of its parameters and one `compress` entry point.

    `budget`: a float in (0, 1] is the fraction of context tokens kept per layer and KV head; an int is
    an absolute number of entries. The `sinks` first and `window` last tokens are protected and count
    inside the budget.
    """

    budget: float | int = 0.25
    sinks: int = 4
    window: int = 32
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    name: ClassVar[str] = ""
    query_window: ClassVar[int] = 0  # prompt queries to capture at prefill (-1: all of them)
    needs_surprisal: ClassVar[bool] = False  # prefill also computes each token's surprisal

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise TypeError(f"budget must be a float in (0, 1] or an int number of entries, got {self.budget!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got sinks={self.sinks}, window={self.window}")
        if isinstance(self.budget, float):
            if not (0.0 < self.budget <= 1.0) or math.isnan(self.budget):
                raise ValueError(f"budget fraction must be in (0, 1], got {self.budget}")
        elif self.budget < self.sinks + self.window:
            raise ValueError(f"budget of {self.budget} entries is below the protected sinks + window "
                             f"({self.sinks} + {self.window})")

    def target(self, n_tokens: int, window: int | None = None) -> int:
        """Entries per (row, KV head) after compressing `n_tokens`; raises if protection cannot fit."""
        window = self.window if window is None else window
        if n_tokens <= 0:
            raise ValueError("empty context: nothing to compress")
        want = round(self.budget * n_tokens) if isinstance(self.budget, float) else self.budget
        want = min(max(want, 1), n_tokens)
        if want < n_tokens and want < self.sinks + window:
            raise ValueError(f"context too short for budget {self.budget}: {n_tokens} tokens give {want} entries, "
                             f"fewer than the protected sinks + window ({self.sinks} + {window})")
        return want

    def setup(self, model, tokenizer) -> None:
        """Called once per generation before prefill (e.g. to build token tables)."""

    def plan(self, layers, ctx: LayerContext) -> None:
        """Called once with all `MergedLayer`s (queries captured) before any layer is compressed;
        `ctx` describes the whole batch (layer_idx -1)."""

    def compress(self, keys, values, log_n, ctx: LayerContext):
        """`(b, h, s, d)`, `(b, h, s, d)`, `(b, h, s)` → the same with at most `ctx.target` slots."""
        raise NotImplementedError

    def decode_hook(self):
        """A callable `(layer, query)` run after each decoding step's attention, or None."""
        return None


def register(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def get_method(name: str, **params) -> Method:
    """A method instance by registered name, e.g. `get_method("streamingllm", budget=0.25)`."""
    key = name.lower().replace("-", "").replace("_", "")
    for registered, cls in _REGISTRY.items():
        if registered.replace("-", "").replace("_", "") == key:
            known = {f.name for f in fields(cls) if f.init}
            unknown = set(params) - known
            if unknown:
                raise TypeError(f"{name} has no parameter(s) {', '.join(sorted(unknown))}; it takes "
                                f"{', '.join(sorted(known))}")
            return cls(**params)
    raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")


def split_protected(x: torch.Tensor, sinks: int, window: int, dim: int = 2):
    """Split along `dim` into (sinks, middle, recent window)."""
    s = x.shape[dim]
    head = x.narrow(dim, 0, min(sinks, s))
    tail_len = min(window, s - head.shape[dim])
    middle = x.narrow(dim, head.shape[dim], s - head.shape[dim] - tail_len)
    tail = x.narrow(dim, s - tail_len, tail_len)
    return head, middle, tail
