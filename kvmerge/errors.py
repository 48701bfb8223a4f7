"""What kvmerge refuses, as exception types, and the checks that need no model.

Every refusal raised by the public API before a forward pass is a `KVMergeError`; each concrete
class also derives from the built-in it refines (`ValueError` or `TypeError`), so code that catches
those keeps working. Messages are one line: the problem, then the fix.

Imports nothing heavy (no torch): the command line uses this module before it loads anything.
"""

from __future__ import annotations

import difflib
from contextlib import contextmanager
from dataclasses import MISSING, fields, is_dataclass


class KVMergeError(Exception):
    """Base of every error kvmerge raises on bad input."""


class InputError(KVMergeError, ValueError):
    """A value kvmerge cannot use: an out-of-range budget, a missing file, a too-long context..."""


class ParameterTypeError(KVMergeError, TypeError, ValueError):
    """A parameter of the wrong type (a word where a number goes, an unknown parameter name); also a
    `ValueError`, since such a value is out of range for the parameter too."""


class UnknownNameError(InputError):
    """A method, model, task or suite name that does not exist; the message suggests close names."""


class UnsupportedError(InputError):
    """A valid request this runtime or model cannot run (a method chunked, `sliding` without sliding layers)."""


class ContextTooLongError(InputError):
    """A prompt longer than the model's positions (`config.max_position_embeddings`)."""


def suggest(word: str, choices, n: int = 3) -> str:
    """' (did you mean X?)' for the choices closest to `word` (difflib), or ''."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=n, cutoff=0.6)
    if not close:
        close = [c for c in choices if str(word).lower().replace("-", "").replace("_", "") in
                 str(c).lower().replace("-", "").replace("_", "")][:n]
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def one_line(error: BaseException | str) -> str:
    """An error's message on one line (whitespace runs collapsed)."""
    text = str(error) if not isinstance(error, KeyError) else str(error.args[0] if error.args else error)
    return " ".join(text.split())


@contextmanager
def refusing():
    """Inside the block (the checks before a forward pass), a plain `ValueError` / `TypeError` is
    raised again as an `InputError` / `ParameterTypeError` with the same message, chained."""
    try:
        yield
    except KVMergeError:
        raise
    except TypeError as e:
        raise ParameterTypeError(str(e)) from e
    except ValueError as e:
        raise InputError(str(e)) from e


def checked(make):
    """`make` (`get_method`, `method_from_spec`) raising `KVMergeError`s: a plain ValueError or
    TypeError becomes one (same message; an unknown name gets close names suggested), and the
    method's parameter types are checked (`check_params`)."""
    import functools

    @functools.wraps(make)
    def run(*args, **kwargs):
        try:
            with refusing():
                _precheck(make.__name__, args, kwargs)
                method = make(*args, **kwargs)
        except UnknownNameError:
            raise
        except InputError as e:
            import re

            found = re.match(r"unknown method '([^']*)'(.*)", str(e), re.S)
            if found is None:
                raise
            from .methods import available_methods

            word, rest = found.groups()
            raise UnknownNameError(f"unknown method {word!r}{suggest(word, available_methods())}{rest}") from e
        check_params(method)
        return method
    return run


def _precheck(maker: str, args, kwargs) -> None:
    """The parameter values of a `get_method` / `method_from_spec` call (a name or a spec, `budget` and
    keyword parameters) against the declared types of
    the method's fields, before the method is built (its own checks may compare a word with a number)."""
    from .methods.presets import PRESETS
    from .methods.registry import _REGISTRY, canonical, parse_spec

    if not args or not isinstance(args[0], str):
        return
    name, params = parse_spec(args[0])
    params = {**params, **{k: v for k, v in kwargs.items() if k != "budget"}}
    found = canonical(name)
    budget = kwargs.get("budget", args[1] if len(args) > 1 else None)
    if budget is not None and found != "full":
        params.setdefault("budget", budget)
    preset = next((p for p in PRESETS if p.name == found), None)
    cls = _REGISTRY.get(preset.method if preset else found)
    if cls is None:
        return
    for f in fields(cls):
        if f.init and f.name in params:
            check_value(found, f.name, params[f.name], accepted_names(f),
                        MISSING if f.default is MISSING else repr(f.default))


# -- parameter types, checked against the method's declarations ----------------------------------
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
    raise ParameterTypeError(f"{method}: parameter {param} must be {want}{shown}, got {value!r}")


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
