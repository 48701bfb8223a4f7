"""The adapter between vLLM's tensors and kvmerge's methods: one prompt's entries of one layer, as
vLLM's attention sees them, compressed by the same method object kvmerge's transformers runtime uses,
and the result laid out as the paged slots it is written back to.

Pure functions on tensors (no vLLM import): `compress_prompt` hands one prompt's entries of one
layer to the planner, as `kvmerge.Session.compress` hands it a session's layers; `VllmRuntime`
(`kvmerge.vllm.runtime`) is all a method sees of the worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ..methods import LayerState, Method
from ..model import token_surprisal
from ..ops.kv import KV
from ..planner import Entries, View, compress_layers
from ..runtime import Runtime
from .runtime import VllmRuntime
from .config import Layout, settings_of

EMPTY_LOG_N = -1000.0  # log-mass of an empty slot: exp(-1000) is 0 in float32; finite, so fp16 keeps it


def compress_prompt(method: Method, layer_idx: int, num_layers: int, queries: torch.Tensor, keys: torch.Tensor,
                    values: torch.Tensor, token_ids: torch.Tensor, scaling: float, kept: int,
                    surprisal: torch.Tensor | None = None, runtime: Runtime | None = None) -> KV:
    """One prompt of P tokens in one layer → at most `kept` entries per KV head, by the planner
    (`kvmerge.planner.compress_layers`) as for one row without padding compressed one-shot.

    queries `(P', hq, d)` (the last P' ≤ P of the prompt's), keys/values `(P, hkv, d)` (post-RoPE, in
    prompt order, as vLLM's attention receives them), token_ids `(P,)`, `surprisal` `(P,)` → `KV`
    keys/values `(1, hkv, kept, d)`, log_n `(1, hkv, kept)` float32. A fresh memo on `runtime` and a
    fresh `LayerState` per call. Nothing is compressed when `kept` ≥ P."""
    n = keys.shape[0]
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    entries = Entries(KV(k, v, torch.zeros(k.shape[:3], dtype=torch.float32, device=k.device)))
    if kept >= n:
        return entries.kv()
    runtime = runtime or Runtime()
    runtime.memo = {}  # what a method computes here is this prompt's and this layer's
    state = LayerState(queries=None if method.needs.queries == 0 else queries.transpose(0, 1)[None])
    view = View(torch.tensor([n]), torch.tensor([n]), torch.tensor([queries.shape[0]]), method.window, scaling,
                [token_ids.tolist()], None if surprisal is None else surprisal[None], target=kept, layers=[layer_idx],
                positions=[layer_idx], num_layers=num_layers)
    compress_layers(method, runtime, [entries], [state], view)
    if entries.entries > kept:
        raise RuntimeError(f"{method.name} returned {entries.entries} entries for a target of {kept}")
    return entries.kv()


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
