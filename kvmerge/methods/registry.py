"""Methods by name: the registry, and spec strings (`"evictmerge:base=h2o:min_cosine=0.5"`) parsed in one place."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields

from .base import Method

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def available_methods() -> list[str]:
    return sorted(_REGISTRY)


def _normal(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def get_method(name: str, **params) -> Method:
    """A method instance by registered name, e.g. `get_method("streamingllm", budget=0.25)`.

    A parameter that takes a method (`evictmerge`'s `base`) also accepts a name or a
    `{"name": ..., **params}` dict."""
    cls = next((c for n, c in _REGISTRY.items() if _normal(n) == _normal(name)), None)
    if cls is None:
        raise ValueError(f"unknown method {name!r}; available: {', '.join(available_methods())}")
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = set(params) - set(known)
    if unknown:
        raise TypeError(f"{name} has no parameter(s) {', '.join(sorted(unknown))}; it takes "
                        f"{', '.join(sorted(known))}")
    for key, value in params.items():
        f = known[key]
        takes_method = f.default_factory is not MISSING and isinstance(f.default_factory(), Method)
        if takes_method and isinstance(value, str):
            params[key] = get_method(value)
        elif takes_method and isinstance(value, dict):
            params[key] = get_method(**value)
    return cls(**params)


def method_from_spec(spec: str, budget: float | int | None = None) -> Method:
    """A method from `name[:param=value...]` (values are JSON; a bare word is a string), with `budget`
    unless the spec sets one (`full` takes none)."""
    name, *params = spec.split(":")
    kwargs = {}
    for p in params:
        key, sep, value = p.partition("=")
        if not sep:
            raise ValueError(f"method spec {spec!r}: expected param=value, got {p!r}")
        try:
            kwargs[key] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[key] = value
    if budget is not None and _normal(name) != "full":
        kwargs.setdefault("budget", budget)
    return get_method(name, **kwargs)
