"""The vLLM plugin's runtime: what a method sees of a vLLM worker, and what the plugin offers.

The plugin compresses each prompt once, after its prefill, inside each layer's attention call (or
after the last layer for methods that need each token's surprisal), into vLLM's paged blocks: one
slot count for every layer and head of a request, no second pass, no rewriting of decoded blocks.
Imports no vLLM.
"""

from __future__ import annotations

import importlib

import torch

from ..methods.base import Needs
from ..model import attention_scaling, rotary_function
from ..runtime import Runtime


class VllmRuntime(Runtime):
    """The plugin's `Runtime` in a vLLM worker (which holds vLLM's model, not a transformers one): the
    tokenizer (loaded when the method declares `Needs.tokenizer`), the model's rotary embedding built
    from its transformers config by transformers itself (Expected Attention undoes RoPE on the
    queries), its attention scaling, and a memo per compression. It has no second pass."""

    name = "vllm"
    offers = Needs(queries=-1, surprisal=True, tokenizer=True, rotary=True, merges=True)
    lacks = {
        "decode_policy": "{name} changes the cache while decoding (a decode-time policy); the plugin compresses once, "
                         "after the prefill, and vLLM's blocks of decoded tokens are not rewritten",
        "second_pass": "{name} runs another forward pass over the prompt before compressing (e.g. KVzip's "
                       "reconstruction); the plugin compresses inside one forward and has no second pass",
        "layer_counts": "{name}{what} layers or heads different entry counts; vLLM's block table is shared by every "
                        "layer and head of a request, so each keeps the same count{hint}",
        "head_counts": "{name}{what} layers or heads different entry counts; vLLM's block table is shared by every "
                       "layer and head of a request, so each keeps the same count{hint}",
        "sliding": "{name}: sliding={sliding} shortens sliding-window layers; the plugin serves models with "
                   "full-attention layers only",
        "all_layers": "{name} plans every layer before compressing any; the plugin compresses each layer inside its "
                      "own attention call, before the next layer has run",
    }

    def __init__(self, hf_config, tokenizer=None):
        super().__init__(tokenizer, None, attention_scaling(hf_config), hf_config)
        self._rotary = None

    @property
    def rotary(self):
        if self._rotary is None:
            self._rotary = rotary_function(_rotary_embedding(self.config), torch.device("cpu"))
        return self._rotary

    @rotary.setter
    def rotary(self, value):
        self._rotary = value


def _rotary_embedding(hf_config):
    """transformers' rotary embedding module for `hf_config`'s model type (e.g. `LlamaRotaryEmbedding`)."""
    kind = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    found = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    if not found:
        raise ValueError(f"kvmerge: transformers has no rotary embedding for model type {kind!r}")
    return min(found, key=lambda c: len(c.__name__))(config=hf_config)


