"""kvmerge: compress the KV cache of Hugging Face LLMs by merging tokens.

    model, tok = kvmerge.load_model()
    method = kvmerge.get_method("mixedmerge", budget=0.25)
    out = kvmerge.generate(model, tok, context=..., question=..., method=method)

Names are imported on first use (PEP 562), so `import kvmerge` and the command line's `--help`
load neither torch nor transformers; `from kvmerge import generate` works as usual.
"""

from __future__ import annotations

import importlib
import sys
import types

from .errors import KVMergeError  # noqa: F401 - public, in __all__

__version__ = "0.2.0"

_WHERE = {  # public name → the submodule that defines it
    "kvmerge_attention": "attention", "MergedCache": "cache", "MergedLayer": "cache",
    "Compressor": "compressing", "compressing": "compressing", "default_method": "defaults",
    "GenerationOutput": "generate", "Sampling": "generate", "Stats": "stats", "answer_questions": "generate",
    "answer_questions_ids": "generate", "answer_contexts": "generate",
    "generate": "generate", "generate_ids": "generate", "split_prompt": "generate",
    "LayerContext": "methods", "LayerState": "methods", "Method": "methods", "Needs": "methods",
    "ScoringMethod": "methods", "available_methods": "methods", "get_method": "methods",
    "method_from_spec": "methods", "register": "methods",
    "CompressedContext": "context", "compress_context": "context", "load_context": "context",
    "check_supported": "model", "load_model": "model", "KV": "ops.kv", "Session": "session",
}

__all__ = sorted([*_WHERE, "KVMergeError"])


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        if name in ("get_method", "method_from_spec"):  # refusals as KVMergeErrors, parameter types checked
            from .errors import checked

            value = checked(value)
    else:
        try:  # a submodule: kvmerge.layer, kvmerge.methods, ...
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(types.ModuleType):
    """`kvmerge.generate` and `kvmerge.compressing` are the functions, not the submodules of the same
    name: importing such a submodule sets the package attribute, and this puts the function back."""

    def __setattr__(self, name, value):
        if isinstance(value, types.ModuleType) and _WHERE.get(name) == name:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
