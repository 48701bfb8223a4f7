"""The adapter between vLLM's tensors and kvmerge's methods: one prompt's entries of one layer, as
vLLM's attention sees them, compressed by the same method object kvmerge's transformers runtime uses,
and the result laid out as the paged slots it is written back to.

Pure functions on tensors (no vLLM import): `compress_prompt` asks the one layer planner for the
`LayerContext` that `kvmerge.Session.compress` builds for one row compressed one-shot, and calls
`method.compress`; `VllmRuntime` is all a method sees of the worker.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..methods import LayerState, Method
from ..model import attention_scaling, rotary_function, token_surprisal
from ..ops.kv import KV
from ..planner import plan_layer
from ..runtime import Runtime
from .config import Layout, settings_of

EMPTY_LOG_N = -1000.0  # log-mass of an empty slot: exp(-1000) is 0 in float32; finite, so fp16 keeps it


def compress_prompt(method: Method, layer_idx: int, num_layers: int, queries: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, token_ids: torch.Tensor, scaling: float, kept: int,
                    surprisal: torch.Tensor | None = None, runtime: Runtime | None = None) -> KV:
    """One prompt of P tokens in one layer → at most `kept` entries per KV head.

    queries `(P', hq, d)` (the last P' ≤ P of the prompt's), keys/values `(P, hkv, d)` (post-RoPE, in
    prompt order, as vLLM's attention receives them), token_ids `(P,)` → `KV` keys/values
    `(1, hkv, kept, d)`, log_n `(1, hkv, kept)` float32. The context comes from the one layer planner
    (`kvmerge.planner.plan_layer`) as `Session.compress` builds it for one row without padding: the
    last `needs.queries` queries, the target `kept`, each token's `surprisal` `(P,)`, a fresh
    `LayerState`; `method.prepare` runs first with a fresh memo on `runtime`. Nothing is compressed
    when `kept` ≥ P."""
    n = keys.shape[0]
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    log_n = torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)
    if kept >= n:
        return KV(k, v, log_n)
    runtime = runtime or Runtime()
    runtime.memo = {}  # what a method computes here is this prompt's and this layer's
    method.prepare_all(runtime, None, [layer_idx])
    ctx = plan_layer(method, layer_idx, num_layers, KV(k, v, log_n), torch.tensor([0]), target=kept,
                     window=method.window, scaling=scaling, seen=n, fresh=n,
                     queries=None if method.needs.queries == 0 else queries.transpose(0, 1)[None],
                     token_rows=[token_ids.tolist()],
                     surprisal=None if surprisal is None else surprisal[None],
                     state=LayerState(scaling=scaling))
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


class VllmRuntime(Runtime):
    """The plugin's `Runtime` in a vLLM worker (which holds vLLM's model, not a transformers one): the
    tokenizer (loaded when the method declares `Needs.tokenizer`), the model's rotary embedding built
    from its transformers config by transformers itself (Expected Attention undoes RoPE on the
    queries), its attention scaling, and a memo per compression. It has no second pass."""

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


def build_method(settings, tokenizer_path: str | None, hf_config) -> tuple[Method, VllmRuntime]:
    """A worker's method object for the plugin's `settings`, set up on a `VllmRuntime`, and that runtime."""
    method = settings.build()
    tokenizer = None
    if method.needs.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    runtime = VllmRuntime(hf_config, tokenizer)
    method.setup_all(runtime)
    return method, runtime


@dataclass
class WorkerState:
    """What a worker's runner owns and hands to every kvmerge attention layer of its model: the method
    object, its runtime, and the worker's compression figures (`stats`: seconds, layers compressed)."""

    method: Method
    runtime: VllmRuntime
    stats: dict = field(default_factory=lambda: {"compress_seconds": 0.0, "compressed_layers": 0})


def worker_state(vllm_config) -> WorkerState | None:
    """A worker's `WorkerState` for vLLM's config (None: the plugin is off)."""
    settings = settings_of(getattr(vllm_config, "additional_config", None))
    if settings is None:
        return None
    model = vllm_config.model_config
    return WorkerState(*build_method(settings, model.tokenizer, model.hf_text_config))


def prompt_surprisal(lm_head: torch.Tensor, hf_config, hidden: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Each prompt token's surprisal `(P,)` float32 (−log p given the prefix; the first token 0) from the
    final hidden states `(P, d)` vLLM's model returns and its LM head weight `(vocab, d)`:
    `kvmerge.model.token_surprisal`, the function kvmerge's transformers runtime uses."""
    head = SimpleNamespace(config=hf_config, get_output_embeddings=lambda: SimpleNamespace(weight=lm_head, bias=None))
    return token_surprisal(head, hidden[None], token_ids[None].to(hidden.device))[0]
