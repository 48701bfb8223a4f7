"""Method specs (`"evictmerge:base=h2o:min_cosine=0.5"`) read in one place, with no heavy import (the
command line reads them before torch loads)."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields, is_dataclass

from .errors import InputError


def parse_spec(spec: str) -> tuple[str, dict]:
    """`name[:param=value...]` → (name, params): split at the colons outside brackets, braces and
    quotes; each value is JSON (a bare word is a string). Refuses an empty name, a list of names and
a parameter set twice."""
    parts, depth, quoted, start = [], 0, False, 0
    for i, c in enumerate(spec):
        if c == '"':
            quoted = not quoted
        elif not quoted and c in "[{":
            depth += 1
        elif not quoted and c in "]}":
            depth -= 1
        elif c == ":" and depth == 0 and not quoted:
            parts.append(spec[start:i])
            start = i + 1
    name, *rest = parts + [spec[start:]]
    name = name.strip()
    if not name:
        raise InputError(f"method spec {spec!r} names no method: give one, e.g. snapkv or snapkv:window=8 "
                         "(kvmerge methods lists them)")
    if "," in name:
        raise InputError(f"method spec {spec!r} names several methods: one goes here (a comma-separated list "
                         "goes to kvmerge eval/bench --methods)")
    params = {}
    for p in rest:
        key, sep, value = p.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise InputError(f"method spec {spec!r}: expected param=value, got {p!r}")
        if key in params:
            raise InputError(f"method spec {spec!r} sets {key} twice: give it once")
        try:
            params[key] = json.loads(value)
        except ValueError:
            params[key] = value
    return name, params


def check_budget_once(spec: str, budget, option: str = "--budget") -> None:
    """Refuse a `budget` given beside a spec that sets another one (`snapkv:budget=0.1` and 0.5):
    one of the two would be silently ignored."""
    if budget is None:
        return
    name, params = parse_spec(spec)
    given = params.get("budget")
    if given is not None and given != budget and name != "full":
        raise InputError(f"{spec} sets budget={given} and {option} {budget}: give the budget once")


def spec_text(name: str, params: dict) -> str:
    """`name:k=v...` that `parse_spec` reads back to (name, params): a string bare where JSON would not
    read it as something else (`alloc=uniform`), every other value as JSON."""
    def shown(value) -> str:
        value = _part(value)
        if isinstance(value, str) and ":" not in value:
            try:
                json.loads(value)
            except ValueError:
                return value
        return json.dumps(value, separators=(",", ":"))

    return ":".join([name, *(f"{k}={shown(v)}" for k, v in params.items())])


def spec_of(method) -> str:
    """A spec that rebuilds `method`: its registered name and every parameter off its class default
    (a method-valued parameter as `{"name": ..., **params}`)."""
    return spec_text(method.name, _params(method))


def _params(method) -> dict:
    out = {}
    for f in fields(method):
        if not f.init or f.name == "budget":
            continue
        value = getattr(method, f.name)
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        value = _part(value)
        if value != default:
            out[f.name] = value
    return out


def _part(value):
    """A method-valued parameter (a part, a `Method`) as `{"name": ..., **params}`; any other value as it is."""
    return {"name": value.name, **_params(value)} if is_dataclass(value) and not isinstance(value, type) else value
