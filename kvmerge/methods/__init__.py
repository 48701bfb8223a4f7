"""Compression methods, one per file; importing this package registers them all."""

from . import cam, centroidkv, d2o, evictmerge, full, h2o, kmeans, pyramidkv, semanticache, snapkv, streamingllm, surprisal, surprisemerge, tova  # noqa: F401
from .base import LayerContext, Method, available_methods, get_method, register

__all__ = ["LayerContext", "Method", "available_methods", "get_method", "register"]
