"""kvmerge: compress the KV cache of Hugging Face LLMs by merging tokens.

    model, tok = kvmerge.load_model()
    method = kvmerge.get_method("centroidkv", budget=0.25)
    out = kvmerge.generate(model, tok, context=..., question=..., method=method)
"""

from .attention import kvmerge_attention
from .cache import MergedCache, MergedLayer
from .compressing import Compressor, compressing
from .generate import GenerationOutput, Sampling, answer_questions, generate, generate_ids, split_prompt
from .methods import (LayerContext, LayerState, Method, Needs, ScoringMethod, available_methods, get_method,
                      method_from_spec, register)
from .model import check_supported, load_model
from .ops.kv import KV
from .session import Session

__all__ = [
    "KV", "Compressor", "GenerationOutput", "LayerContext", "LayerState", "MergedCache", "MergedLayer", "Method", "Needs",
    "ScoringMethod",
    "Sampling", "Session", "answer_questions", "available_methods", "check_supported", "compressing", "generate", "generate_ids", "get_method",
    "kvmerge_attention", "load_model", "method_from_spec", "register", "split_prompt",
]
__version__ = "0.2.0"
