"""Compression methods, one per file; importing this package registers them all."""

from . import cam, centroidkv, d2o, evictmerge, full, h2o, kmeans, pyramidkv, semanticache, snapkv, streamingllm, surprisal, surprisemerge, tova  # noqa: F401
from .base import LayerContext, LayerState, Method, ScoringMethod
from .registry import available_methods, get_method, method_from_spec, register

__all__ = ["LayerContext", "LayerState", "Method", "ScoringMethod", "available_methods", "get_method",
           "method_from_spec", "register"]
