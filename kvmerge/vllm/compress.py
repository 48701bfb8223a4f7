"""The adapter between vLLM's tensors and kvmerge's methods: one prompt's entries of one layer, as
vLLM's attention sees them, compressed by the same method object kvmerge's transformers runtime uses,
and the result laid out as the paged slots it is written back to.

Pure functions on tensors (no vLLM import): `compress_prompt` builds the `LayerContext` that
`kvmerge.Session.compress` builds for one row compressed one-shot, and calls `method.compress`.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import torch

from ..methods import LayerContext, LayerState, Method
from ..model import token_surprisal
from ..ops.kv import KV
from .config import Layout, hook_reads, settings_of

EMPTY_LOG_N = -1000.0  # log-mass of an empty slot: exp(-1000) is 0 in float32; finite, so fp16 keeps it


def compress_prompt(method: Method, layer_idx: int, num_layers: int, queries: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, token_ids: torch.Tensor, scaling: float, kept: int,
                    surprisal: torch.Tensor | None = None) -> KV:
    """One prompt of P tokens in one layer → at most `kept` entries per KV head.

    queries `(P, hq, d)`, keys/values `(P, hkv, d)` (post-RoPE, in prompt order, as vLLM's attention
    receives them), token_ids `(P,)` → `KV` keys/values `(1, hkv, kept, d)`, log_n `(1, hkv, kept)`
    float32. Like `Session.compress` for one row without padding: the method sees the last
    `method.query_window` queries (-1: all; 0: none), the target `kept`, its own sinks and window, the
    layer's scaling, each token's `surprisal` `(P,)` (methods that need it) and a fresh `LayerState`;
    nothing is compressed when `kept` ≥ P."""
    n = keys.shape[0]
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    log_n = torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)
    if kept >= n:
        return KV(k, v, log_n)
    window = method.query_window
    q = None if window == 0 else queries.transpose(0, 1)[None]
    if q is not None and 0 < window < q.shape[2]:
        q = q[:, :, -window:]
    ctx = LayerContext(layer_idx=layer_idx, num_layers=num_layers, target=kept, sinks=method.sinks,
                       window=method.window, scaling=scaling, token_ids=token_ids[None].to(k.device), queries=q,
                       rows=torch.tensor([0]), state=LayerState(scaling=scaling), values=v, seen=n,
                       surprisal=None if surprisal is None else surprisal[None, -n:].to(k.device))
    out = method.compress(k, v, log_n, ctx)
    if out.slots > kept:
        raise RuntimeError(f"{method.name} returned {out.slots} entries for a target of {kept}")
    return out


def paged_entries(kv: KV, layout: Layout, scale: float, size: int, dtype: torch.dtype):
    """The slots [layout.start, layout.prompt) as written to vLLM's cache: `KV` of one row `(1, h, k, d)`
    → (keys', values') `(layout.prompt − layout.start, h, size)` in `dtype`: first the empty slots
    (zeros, log-mass `EMPTY_LOG_N`), then the k entries, each key carrying log_n / scale in channel d.
    `size` = d (a cache without the channel): the k plain entries fill every slot."""
    keys, values, log_n = (x[0].transpose(0, 1) for x in kv)  # (k, h, d), (k, h)
    slots, heads, d = layout.prompt - layout.start, keys.shape[1], keys.shape[2]
    if keys.shape[0] > slots:
        raise ValueError(f"{keys.shape[0]} entries do not fit the layout's {slots} slots")
    if size == d:  # no log-mass channel: plain tokens filling every slot
        if keys.shape[0] != slots or bool((log_n != 0).any()):
            raise RuntimeError(f"a cache without the log-mass channel takes {slots} plain tokens; got "
                               f"{keys.shape[0]} entries, {int((log_n != 0).sum())} of them with a log-mass")
        return keys.to(dtype), values.to(dtype)
    out_k = torch.zeros(slots, heads, size, dtype=dtype, device=keys.device)
    out_v = torch.zeros(slots, heads, size, dtype=dtype, device=keys.device)
    first = slots - keys.shape[0]
    out_k[:first, :, d] = EMPTY_LOG_N / scale
    out_k[first:, :, :d] = keys.to(dtype)
    out_k[first:, :, d] = (log_n.float().clamp_min(EMPTY_LOG_N) / scale).to(dtype)
    out_v[first:, :, :values.shape[2]] = values.to(dtype)
    return out_k, out_v


class ModelStandIn:
    """What kvmerge's methods read of a transformers model, for vLLM's workers (which hold vLLM's model):
    the decoder's rotary embedding (Expected Attention undoes RoPE on the queries), built from the
    model's config by transformers itself; a parameter (its device); and, once `lm_head` is set, the
    output embeddings and config that `kvmerge.model.token_surprisal` reads. `hf_config`: the model's
    transformers config (vLLM's `model_config.hf_text_config`)."""

    def __init__(self, hf_config, lm_head: torch.Tensor | None = None):
        self.config = hf_config
        self.lm_head = lm_head
        self._rotary = None

    def get_decoder(self):
        if self._rotary is None:
            self._rotary = _rotary_embedding(self.config)
        return SimpleNamespace(rotary_emb=self._rotary)

    def parameters(self):
        return iter([torch.zeros(1) if self.lm_head is None else self.lm_head])

    def get_output_embeddings(self):
        if self.lm_head is None:
            raise RuntimeError("kvmerge: the stand-in model has no LM head yet")
        return SimpleNamespace(weight=self.lm_head, bias=None)


def _rotary_embedding(hf_config):
    """transformers' rotary embedding module for `hf_config`'s model type (e.g. `LlamaRotaryEmbedding`)."""
    kind = hf_config.model_type
    module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    found = [getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    if not found:
        raise ValueError(f"kvmerge: transformers has no rotary embedding for model type {kind!r}")
    return min(found, key=lambda c: len(c.__name__))(config=hf_config)


_METHODS: dict = {}


def _method_for(spec: str, budget, tokenizer_path: str | None, hf_config) -> Method:
    key = (spec, budget, tokenizer_path, hf_config.to_json_string())  # not id(): ids are reused
    if key not in _METHODS:
        method = settings_of({"kvmerge": {"method": spec, "budget": budget}}).build()
        tokenizer = None
        if hook_reads(method, "setup") == "tokenizer":
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        method.setup(ModelStandIn(hf_config), tokenizer)  # the stand-in builds its rotary module only if read
        _METHODS[key] = method
    return _METHODS[key]


def worker_method(vllm_config) -> Method | None:
    """The worker's method object for vLLM's config (one per process and settings; None: plugin off),
    set up with the model's tokenizer and a `ModelStandIn` when the method's setup reads them."""
    settings = settings_of(getattr(vllm_config, "additional_config", None))
    if settings is None:
        return None
    model = vllm_config.model_config
    return _method_for(settings.method, settings.budget, model.tokenizer, model.hf_text_config)


def prompt_surprisal(stand_in: ModelStandIn, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each prompt token's surprisal `(P,)` float32 (−log p given the prefix; the first token 0) from the
    final hidden states `(P, d)` vLLM's model returns: `kvmerge.model.token_surprisal`, the function
    kvmerge's transformers runtime uses, on the stand-in's LM head."""
    return token_surprisal(stand_in, hidden[None], token_ids[None].to(hidden.device))[0]
