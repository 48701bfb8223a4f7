"""Compression methods, one per file: importing this package imports (and so registers) every module
in it, so a new method is one new file."""

import importlib
import pkgutil

from .base import LayerContext, LayerState, Method, Needs, ScoringMethod
from .registry import available_methods, get_method, register

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LayerContext", "LayerState", "Method", "Needs", "ScoringMethod", "available_methods", "get_method",
           "register"]
