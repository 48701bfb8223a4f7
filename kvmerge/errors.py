"""What kvmerge refuses, as exception types, and how a refusal is worded.

Every refusal raised by the public API before a forward pass is a `KVMergeError`; each concrete
class also derives from the built-in it refines (`ValueError` or `TypeError`), so code that catches
those keeps working. Messages are one line: the problem, then the fix.

Imports nothing heavy (no torch): the command line uses this module before it loads anything.
"""

from __future__ import annotations

import difflib
import math
import numbers
from contextlib import contextmanager


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


def plural(n: int, one: str, many: str | None = None) -> str:
    """'1 context', '2 contexts' (`many`: the plural where it is not `one` + 's'): a count in a message."""
    return f"{n} {one if n == 1 else many or one + 's'}"


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


def check_chunk(chunk, sinks: int = 0, window: int = 0, what: str = "prefill chunk") -> None:
    """The one check of a prefill chunk size: a whole number of tokens ≥ 1, and at least the `sinks`
    + `window` tokens a method protects (0 for none), else every chunk would be kept whole."""
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise InputError(f"{what} must be a positive number of tokens, got {chunk!r}")
    if chunk < sinks + window:
        raise InputError(f"{what} {chunk} is below the protected sinks + window ({sinks} + {window}): every chunk "
                         f"would be kept whole; use at least {sinks + window}")


def check_sampling(temperature, top_k, top_p, seed, option=str) -> None:
    """The one check of the sampling options (Python's and the command line's); `option(name)` words a
    name as the caller knows it (the command line: `--top-k`)."""
    number, whole = numbers.Real, numbers.Integral
    for name, value, kind in (("temperature", temperature, number), ("top_k", top_k, whole), ("top_p", top_p, number),
                              ("seed", seed, (whole, type(None)))):
        if isinstance(value, bool) or not isinstance(value, kind):
            raise ParameterTypeError(f"{option(name)} must be {'a whole number' if kind is whole else 'a number'}, "
                                     f"got {value!r}")
    if not math.isfinite(temperature) or temperature < 0 or top_k < 0 or not 0 < top_p <= 1:
        raise InputError(f"need {option('temperature')} >= 0 (finite), {option('top_k')} >= 0 and 0 < "
                         f"{option('top_p')} <= 1, got {temperature}, {top_k} and {top_p}")
    shaping = [option(name) for name, on in (("top_k", top_k), ("top_p", top_p < 1), ("seed", seed is not None)) if on]
    if shaping and temperature == 0:
        raise InputError(f"{', '.join(shaping)} {'shape' if len(shaping) > 1 else 'shapes'} sampling, and "
                         f"{option('temperature')} 0 decodes greedily: set {option('temperature')} (e.g. 0.7), or "
                         "leave them out")
