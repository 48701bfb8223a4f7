"""Parameter types, checked against a method's declarations (its dataclass fields' annotations): what
`get_method` checks before and after building a method, and what `kvmerge methods` checks from its
cached table without torch. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass

from .errors import ParameterTypeError

_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),),
          "dict": (dict,), "list": (list,), "tuple": (tuple, list)}
_WORDS = {int: "a whole number", float: "a number", str: "a word", bool: "true or false", dict: "a JSON object",
          list: "a JSON list", tuple: "a JSON list", type(None): "null"}


def _accepted(f) -> tuple[type, ...] | None:
    """The Python types a dataclass field accepts, from its annotation (`"int | float"`) or else its
    default's type; None when that cannot be told (a method-valued or otherwise custom parameter)."""
    annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    parts = [p.strip() for p in annotation.split("|")]
    if parts and all(p in _TYPES for p in parts):
        return tuple(t for p in parts for t in _TYPES[p])
    if f.default is not MISSING and type(f.default) in (int, float, str, bool):
        return _TYPES[type(f.default).__name__]
    return None


def accepted_names(f) -> list[str] | None:
    """`_accepted(f)` as type names ("int", "float", ...), for a table that outlives the classes."""
    types = _accepted(f)
    return None if types is None else [t.__name__ for t in types]


def check_value(method: str, param: str, value, accepted: list[str] | None, default=MISSING) -> None:
    """Raise `ParameterTypeError` unless `value` is of one of the `accepted` type names (None: any).
    Bools are not numbers."""
    if accepted is None:
        return
    ok = [t for t in (int, float, str, bool, dict, list, tuple, type(None)) if t.__name__ in accepted]
    if isinstance(value, tuple(ok)) and not (isinstance(value, bool) and bool not in ok):
        return
    words = [t for t in ok if not (t is int and float in ok)]  # "a number" covers whole numbers
    want = " or ".join(dict.fromkeys(_WORDS.get(t, t.__name__) for t in words))
    shown = "" if default is MISSING else f" (default {default})"
    hint = ""
    if param == "budget" and isinstance(value, str):  # "25%", "0.25": what the command line takes
        try:
            hint = f": write budget={float(value.rstrip('%')) / (100 if value.endswith('%') else 1):g}"
        except ValueError:
            pass
    raise ParameterTypeError(f"{method}: parameter {param} must be {want}{shown}, got {value!r}{hint}")


def check_params(method) -> None:
    """Raise `ParameterTypeError` if a parameter of `method` (or of one of its parts) has a type its
    declaration does not allow, e.g. `snapkv:kernel=five` (kernel is an int). Bools are not numbers."""
    for m in method.walk() if hasattr(method, "walk") else [method]:
        if not is_dataclass(m):
            continue
        for f in fields(m):
            if not f.init:
                continue
            check_value(m.name or type(m).__name__, f.name, getattr(m, f.name), accepted_names(f),
                        MISSING if f.default is MISSING else repr(f.default))


def check_fields(cls, name: str, params: dict) -> None:
    """Raise `ParameterTypeError` if a value in `params` has a type that the field of that name of the
    method class `cls` (shown as `name`) does not allow; before the method is built, since its own
    checks may compare a word with a number."""
    for f in fields(cls):
        if f.init and f.name in params:
            check_value(name, f.name, params[f.name], accepted_names(f),
                        MISSING if f.default is MISSING else repr(f.default))
