"""kvmerge: compress the KV cache of Hugging Face LLMs by merging tokens.

    model, tok = kvmerge.load_model()
    method = kvmerge.get_method("mixedmerge", budget=0.25)
    out = kvmerge.generate(model, tok, context=..., question=..., method=method)

Names are imported on first use (PEP 562), so `import kvmerge` and the command line's `--help`
load neither torch nor transformers; `from kvmerge import generate` works as usual.
"""

from __future__ import annotations

import importlib

from .errors import KVMergeError  # noqa: F401 - public, in __all__

__version__ = "0.2.0"

_WHERE = {  # public name → the submodule that defines it
    "kvmerge_attention": "attention", "MergedCache": "cache", "MergedLayer": "cache",
    "Compressor": "compression", "compressing": "compression", "default_method": "defaults",
    "GenerationOutput": "decoding", "Sampling": "decoding", "Stats": "stats", "answer_questions": "generation",
    "answer_questions_ids": "generation", "answer_contexts": "context",
    "generate": "generation", "generate_ids": "generation", "split_prompt": "prompt",
    "LayerContext": "methods", "LayerState": "methods", "Method": "methods", "Needs": "methods",
    "ScoringMethod": "methods", "available_methods": "methods", "get_method": "methods",
    "register": "methods",
    "CompressedContext": "context", "compress_context": "context", "load_context": "context",
    "check_supported": "model", "load_model": "model", "KV": "ops.kv", "Session": "session",
    "GraphDecoder": "graphs",
}

__all__ = sorted([*_WHERE, "KVMergeError"])


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
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
