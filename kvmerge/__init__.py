"""kvmerge: compress the KV cache of Hugging Face LLMs by merging tokens.

    model, tok = kvmerge.load_model()
    method = kvmerge.get_method("centroidkv", budget=0.25)
    out = kvmerge.generate(model, tok, context=..., question=..., method=method)
"""

from . import attention  # noqa: F401  (registers the "kvmerge" attention with transformers)
from .cache import MergedCache, MergedLayer
from .methods import LayerContext, Method, available_methods, get_method
from .model import check_supported, load_model, prepare
from .runtime import (GenerationOutput, Session, answer_questions, compress_cache, generate, generate_ids,
                      split_prompt)

__all__ = [
    "GenerationOutput", "LayerContext", "MergedCache", "MergedLayer", "Method", "Session", "available_methods",
    "answer_questions", "check_supported", "compress_cache", "generate", "generate_ids", "get_method", "load_model", "prepare",
    "split_prompt",
]
__version__ = "0.1.0"
