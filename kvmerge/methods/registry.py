"""Methods by name: the registry of method classes, the presets (`presets.py`: named specs, as data),
the older names (`OLD_NAMES`, the one table of them), and spec strings
(`"evictmerge:base=h2o:min_cosine=0.5"`) parsed in one place.

Names are one lowercase word: letters and digits, no `_` or `-` (`snapkv`, `streamingllm`,
`expectedattention`, `zipguardmerge`). A name is matched case-, `_`- and `-`-blind, so
`Expected-Attention` finds `expectedattention` too.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, replace

from ..errors import UnknownNameError, refusing, suggest
from ..params import check_fields, check_params
from ..spec import parse_spec, spec_text
from .base import Method
from .presets import PRESETS, Preset

_REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    _REGISTRY[cls.name] = cls
    return cls


def _normal(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


# Older names → current ones: they resolve everywhere a name is read (specs, suites, results rows,
# `kvmerge methods OLD`), and are written nowhere else in the tree (tests/test_names.py checks).
OLD_NAMES = {
    "expectmerge": "mixedmerge",                # the preset's name until presets became data
    "guardmerge": "zipguardmerge",              # the preset's name until presets became data
    "expected_attention": "expectedattention",  # spelt as a Python identifier until the one-word rule
    "mixed_attention": "mixedattention",        # spelt as a Python identifier until the one-word rule
}

_PRESETS = {_normal(p.name): p for p in PRESETS}
_ALIASES = {_normal(old): new for old, new in OLD_NAMES.items()}


def available_methods() -> list[str]:
    """Every method and preset name (older names not included)."""
    return sorted(set(_REGISTRY) | {p.name for p in PRESETS})


def canonical(name: str) -> str | None:
    """The registered or preset name that `name` means (an older name resolved), or None."""
    key = _normal(name)
    key = _normal(_ALIASES.get(key, name))
    if key in _PRESETS:
        return _PRESETS[key].name
    return next((n for n in _REGISTRY if _normal(n) == key), None)


def old_names(name: str) -> list[str]:
    """The older names of the method or preset `name` (from `OLD_NAMES`)."""
    return [old for old, new in OLD_NAMES.items() if new == name]


def current_spec(spec: str) -> str:
    """`spec` (a results row's label: `name[:param=value...][@chunkN]`) with every older name in it,
    the method's or a part's (`base=...`), written as the current one; anything else unchanged."""
    head, at, tail = spec.partition("@")
    pieces = head.split(":")
    renamed = [OLD_NAMES.get(pieces[0], pieces[0])]
    for piece in pieces[1:]:
        key, eq, value = piece.partition("=")
        renamed.append(f"{key}={OLD_NAMES.get(value, value)}" if eq else piece)
    return ":".join(renamed) + at + tail


def get_method(name: str, budget: float | int | None = None, **params) -> Method:
    """A method instance by registered or preset name, or by spec `name[:param=value...]` (values are
    JSON; a bare word is a string): `get_method("streamingllm", budget=0.25)`,
    `get_method("zipguardmerge:sliding=0.75", budget=0.1)`, `get_method("snapkv:alloc=head", window=8)`.

    `budget` applies unless the spec sets one (`full` keeps everything and ignores it); any other
    parameter given both in the spec and as a keyword must agree. A parameter that takes a method
    (`evictmerge`'s `base`) also accepts a name or a `{"name": ..., **params}` dict; a part named so
    keeps uniform allocation unless told otherwise (the composite owns the allocation).

    Refusals are `KVMergeError`s, one line each: `UnknownNameError` (close names suggested),
    `ParameterTypeError` (a value of the wrong type, checked against the fields' declarations before
    the method is built, or an unknown parameter) and `InputError` (a value the method refuses)."""
    with refusing():
        method = _build(name, budget, params)
    check_params(method)
    settings = {k: v for k, v in {**parse_spec(name)[1], **params}.items() if k != "budget"}
    method.spec = spec_text(method.label, settings) if settings else None  # as given, under its own name
    return method


def _build(name, budget, params: dict) -> Method:
    if not isinstance(name, str):
        raise TypeError(f"a method is named by a string (a name or a spec such as 'snapkv:window=8'), got "
                        f"{type(name).__name__}")
    base, given = parse_spec(name)
    for key, value in params.items():
        if key in given and given[key] != value:
            raise ValueError(f"method spec {name!r} sets {key}={given[key]!r} and the call {key}={value!r}: give "
                             f"{key} once")
    params = {**given, **params}
    if budget is not None and _normal(base) != "full":
        params.setdefault("budget", budget)
    found = canonical(base)
    if found is None:
        raise UnknownNameError(f"unknown method {base!r}{suggest(base, available_methods())}; available: "
                               f"{', '.join(available_methods())}")
    preset = _PRESETS.get(_normal(found))
    cls = _REGISTRY[preset.method if preset else found]
    check_fields(cls, found, params)
    if preset is not None:
        return from_preset(preset, params)
    known = {f.name: f for f in fields(cls) if f.init}
    unknown = set(params) - set(known)
    if unknown:
        close = suggest(sorted(unknown)[0], known) if len(unknown) == 1 else ""
        raise TypeError(f"{base} has no parameter(s) {', '.join(sorted(unknown))}{close}; it takes "
                        f"{', '.join(sorted(known))}")
    for key, value in params.items():
        f = known[key]
        takes_method = f.default_factory is not MISSING and isinstance(f.default_factory(), Method)
        if takes_method and isinstance(value, (str, dict)):
            spec = {"name": value} if isinstance(value, str) else dict(value)
            part = canonical(parse_spec(spec["name"])[0])
            if part in _REGISTRY and any(p.name == "alloc" for p in fields(_REGISTRY[part])):
                spec.setdefault("alloc", "uniform")
            params[key] = get_method(**spec)
    return cls(**params)


def from_preset(preset: Preset, params: dict) -> Method:
    """The method object of `preset`, with `params` (a user's) over the preset's own."""
    merged = dict(preset.params)
    if "base" in params:  # another base: the preset's settings of its own base no longer apply
        merged = {k: v for k, v in merged.items() if not k.startswith("base.")}
    for key, value in params.items():
        for target in preset.ties.get(key, (key,)):
            if not (target.startswith("base.") and "base" in params and target != key):
                merged[target] = value
    nested = {k.split(".", 1)[1]: merged.pop(k) for k in list(merged) if k.startswith("base.")}
    if nested:
        base = merged.get("base")
        if isinstance(base, Method):
            merged["base"] = replace(base, **nested)
        elif isinstance(base, dict):
            merged["base"] = {**base, **nested}
        else:
            merged["base"] = {"name": base, **nested}
    method = get_method(preset.method, **merged)
    method.preset = preset.name
    return method


def load_plugins(names: list[str]) -> None:
    """Import each module (a dotted name) or Python file (a path ending in .py) in `names`, so that the
    methods it registers can be named in specs (the vLLM plugin's `imports` setting, run in every
    process). Raises a ValueError naming what is not there."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    for name in names:
        path = Path(name)
        if name.endswith(".py"):
            if not path.is_file():
                raise ValueError(f"kvmerge: no module or file {name!r} to import methods from")
            module = f"kvmerge_plugin_{path.stem}"
            if module in sys.modules:
                continue
            spec = importlib.util.spec_from_file_location(module, path)
            sys.modules[module] = importlib.util.module_from_spec(spec)
            _importing(name, lambda: spec.loader.exec_module(sys.modules[module]), undo=lambda: sys.modules.pop(module))
        else:
            try:
                found = importlib.util.find_spec(name) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                raise ValueError(f"kvmerge: no module or file {name!r} to import methods from")
            _importing(name, lambda: importlib.import_module(name))


def _importing(name: str, run, undo=lambda: None) -> None:
    """`run()`, the import of plugin `name`; its own error (a missing module, a syntax error) becomes one
    ValueError line naming the plugin, after `undo()`."""
    try:
        run()
    except Exception as e:  # noqa: BLE001 - the plugin's own error, in one line naming it
        undo()
        raise ValueError(f"kvmerge: importing methods from {name} failed: {type(e).__name__}: {e}") from e
