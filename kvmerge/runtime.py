"""Runtimes: where a method runs, and the interface it sees in `setup` and `prepare` (what it may ask
for, never the session or the model object). Each runtime declares what it offers as a `Needs`
(`offers`) and why it lacks the rest (`lacks`); a method runs there when every need it declares is
offered, and is refused with one reason per missing need otherwise (`refusals`). A new runtime is one
subclass. `SessionRuntime` is the transformers runtime (one-shot and chunked prefill: it offers
everything); the vLLM plugin's is `kvmerge.vllm.runtime.VllmRuntime`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import fields
from typing import ClassVar

import torch

from .methods.base import Needs

EVERYTHING = Needs(**{f.name: -1 if f.name == "queries" else True for f in fields(Needs)})


class Runtime:
    """`tokenizer` (None where the caller gave none), `rotary` (positions `(n,)` → (cos, sin), each
    `(n, head_dim)` float32, the model's own RoPE of its full-attention layers; None where unknown),
    `scaling` (the model's factor on q·k), `config` (the model's transformers config, read only: its
    shapes) and `memo`, a dict for what a method computed from the cache as it is now (kept across
    methods compressing one prefill). The second-pass calls raise: a runtime without one does not
    offer `second_pass`, and so refuses methods that declare it.

    `name`: the runtime's short name (`kvmerge methods`' columns); `offers`: the needs it meets;
    `lacks`: for each need it does not meet, in the order reasons are given, why, as a format string
    (fields: `name`, the method's label; `sliding`, `alloc`; `what` and `hint`, the allocation's)."""

    name: ClassVar[str] = "runtime"
    offers: ClassVar[Needs] = Needs()
    lacks: ClassVar[dict[str, str]] = {}

    @classmethod
    def refusals(cls, method) -> list[str]:
        """Why this runtime cannot run `method` (empty: it can): one reason per need that `method`
        declares and this runtime does not offer, each naming the method; a reason shared by two
        needs is given once."""
        needs, offers, out = method.needs, cls.offers, []
        missing = [f.name for f in fields(Needs) if getattr(needs, f.name) and not _offered(f.name, needs, offers)]
        ordered = [f for f in cls.lacks if f in missing] + [f for f in missing if f not in cls.lacks]
        spread = getattr(method, "alloc", "uniform") != "uniform"
        only_alloc = set(missing) <= {"all_layers", "layer_counts", "head_counts"}  # uniform counts would run
        words = {"name": method.label, "sliding": method.sliding, "alloc": getattr(method, "alloc", None),
                 "what": f": alloc={getattr(method, 'alloc', None)!r} gives" if spread else " sets per-layer budgets, giving",
                 "hint": f" ({method.label}:alloc=uniform runs there)" if spread and only_alloc else ""}
        for need in ordered:
            reason = cls.lacks.get(need, "{name} needs " + need + ", which the " + cls.name + " runtime does not offer")
            reason = reason.format(**words)
            if reason not in out:
                out.append(reason)
        return out

    @classmethod
    def check(cls, method) -> None:
        """Raise a ValueError with the first reason this runtime cannot run `method`."""
        reasons = cls.refusals(method)
        if reasons:
            raise ValueError(reasons[0])

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
    """The transformers runtime's interface for one `Session` (one-shot and chunked prefill): everything
    `Runtime` offers, plus the second pass (`probe`), each row's plain slots, per-layer scratch and the
    attention's weights. It offers every need."""

    name = "transformers"
    offers = EVERYTHING

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


def _offered(need: str, needs: Needs, offers: Needs) -> bool:
    if need == "queries":  # a count: -1 is every query
        return offers.queries < 0 or 0 <= needs.queries <= offers.queries
    return bool(getattr(offers, need))
