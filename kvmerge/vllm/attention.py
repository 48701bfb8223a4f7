"""Proportional attention inside vLLM's CPU paged-attention kernel, by one extra key channel.

The kernel computes softmax(q·k·scale)·V over a request's blocks and has no per-entry bias. With
k' = [k, log_n / scale, 0…], q' = [q, 1, 0…] and v' = [v, 0…], padded to the next head size the
kernel accepts (64 → 80), q'·k'·scale = q·k·scale + log_n: exactly kvmerge's proportional attention,
and the output's first `head_size` channels are softmax(q·k·scale + log_n)·V. A plain token has
log_n = 0; an empty slot has `EMPTY_LOG_N` (its weight exp(−1000) is 0 in float32).

`KvmergeCPUBackend` is registered as `CPU_ATTN` in the workers when the plugin is on (vLLM looks the
backend up by that name). Its builder reads the step's `StepPlan` (set by the runner): compressed
requests attend to their block table from their first kept block on, with that many fewer tokens,
and prompts whose prefill ends in this step are compressed by the impl right after their attention
(or, for methods that need each token's surprisal, by the runner once the last layer is done).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata, CPUAttentionMetadataBuilder)

from .compress import EMPTY_LOG_N, compress_prompt, paged_entries
from .config import Layout, padded_head_size

__all__ = ["EMPTY_LOG_N", "KvmergeCPUBackend", "KvmergePlainCPUBackend", "Prompt", "StepPlan", "channel_query", "shifted",
           "with_channel"]


def with_channel(x: torch.Tensor, size: int, channel: torch.Tensor | float | None = None) -> torch.Tensor:
    """`(T, h, d)` → `(T, h, size)`: x, then `channel` (`(T, h)` or a number; None: 0) at index d, zeros after."""
    d = x.shape[-1]
    out = x.new_empty(*x.shape[:-1], size)
    out[..., :d] = x
    out[..., d:] = 0
    if channel is not None:
        out[..., d] = channel
    return out


def channel_query(query: torch.Tensor, size: int) -> torch.Tensor:
    """q' = [q, 1, 0…] `(T, hq, size)`: picks up each key's log-mass channel."""
    return with_channel(query, size, 1.0)


def shifted(block_table: torch.Tensor, seq_lens: torch.Tensor, shift: torch.Tensor, block_size: int):
    """Each row's view from its first kept block: `block_table` `(R, W)`, `seq_lens` `(R,)` and
    `shift` `(R,)` tokens (a multiple of `block_size`) → new (table, seq_lens); row r's table starts at
    block shift[r] / block_size and its sequence is shift[r] tokens shorter. Inputs are not written."""
    table, lens = block_table.clone(), seq_lens.clone()
    for row in shift.nonzero().flatten().tolist():
        blocks = int(shift[row]) // block_size
        table[row, :table.shape[1] - blocks] = block_table[row, blocks:].clone()
        lens[row] -= int(shift[row])
    return table, lens


@dataclass(frozen=True)
class Prompt:
    """A prompt whose prefill ends in this step, to compress: its batch `row`, its first token's index
    `start` in the step's flattened tokens (the whole prompt is in this step), its `layout` and its
    `token_ids` `(P,)`."""

    row: int
    start: int
    layout: Layout
    token_ids: torch.Tensor


@dataclass(frozen=True)
class StepPlan:
    """What the runner tells the attention about one step: `shift` `(num_reqs,)` tokens each row's
    attention skips (its freed blocks × block size; 0 for rows not compressed or prefilling now), the
    `prompts` to compress after this step's attention, and `deferred`: (prompt, compress(surprisal))
    per prompt and layer whose compression waits for the logits (methods that need each token's
    surprisal), filled by the attention and run by the runner after the last layer."""

    shift: torch.Tensor | None
    prompts: tuple[Prompt, ...] = ()
    deferred: list = field(default_factory=list)


@dataclass
class KvmergeMetadata(CPUAttentionMetadata):
    """CPU_ATTN's metadata plus the step's plan (None: nothing to compress or shift)."""

    plan: StepPlan | None = None


class KvmergeCPUBuilder(CPUAttentionMetadataBuilder):
    """CPU_ATTN's builder reading the runner's `plan` for the step (None: a stock build)."""

    plan: StepPlan | None = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        plan, cm = self.plan, common_attn_metadata
        if plan is not None and plan.shift is not None:
            n = cm.block_table_tensor.shape[0]
            shift = torch.zeros(n, dtype=torch.int64)
            shift[:min(n, len(plan.shift))] = plan.shift[:n]
            table, lens = shifted(cm.block_table_tensor, cm.seq_lens, shift, self.block_size)
            cm = dataclasses.replace(cm, block_table_tensor=table, seq_lens=lens)
        meta = super().build(common_prefix_len, cm, fast_build)
        fields = {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta)}
        return KvmergeMetadata(**fields, plan=plan)


class KvmergeCPUImpl(CPUAttentionBackendImpl):
    """CPU_ATTN with the log-mass channel: writes k' = [k, 0, 0…], v' = [v, 0…]; attends with
    q' = [q, 1, 0…]; after a prompt's attention, compresses it and overwrites its slots [start, P)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        self.num_layers = config.model_config.hf_text_config.num_hidden_layers
        self.state = None  # the worker's `WorkerState`, set by its runner once the model is loaded

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        size = kv_cache.shape[-1] // 2
        if size > self.head_size:
            key, value = with_channel(key, size), with_channel(value, size)
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if attn_metadata is None:  # warm-up
            return output
        size = kv_cache.shape[-1] // 2
        if size == self.head_size:  # no channel (a method that only selects): vLLM's attention as it is
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                            output_block_scale)
        else:
            n = attn_metadata.num_actual_tokens
            wide = query.new_empty(query.shape[0], self.num_heads, size)
            super().forward(layer, channel_query(query, size), key, value, kv_cache, attn_metadata, wide,
                            output_scale, output_block_scale)
            output[:n] = wide[:n, :, :self.head_size]
        plan = getattr(attn_metadata, "plan", None)
        for prompt in () if plan is None else plan.prompts:
            span = slice(prompt.start, prompt.start + prompt.layout.prompt)
            q, k, v, slots = query[span], key[span], value[span], attn_metadata.slot_mapping[span]
            if not self.state.method.needs.surprisal:
                self._compress(layer, prompt, q, k, v, kv_cache, slots, size)
                continue
            # the logits exist only after the last layer: keep this layer's inputs (the queries it reads) till then
            window = self.state.method.needs.queries
            q = q if window < 0 else q[max(q.shape[0] - window, 0):]
            plan.deferred.append((prompt, functools.partial(self._compress, layer, prompt, q.clone(), k.clone(),
                                                            v.clone(), kv_cache, slots.clone(), size)))
        return output

    def _compress(self, layer, prompt: Prompt, query, key, value, kv_cache, slots, size, surprisal=None) -> None:
        """Compress one prompt's entries of this layer (its queries (the method's window or all), keys and
        values, `slots` `(P,)`) and write them into its slots [start, P)."""
        start = time.perf_counter()
        lay = prompt.layout
        kv = compress_prompt(self.state.method, extract_layer_index(layer.layer_name), self.num_layers, query, key, value,
                             prompt.token_ids, self.scale, lay.kept, surprisal, self.state.runtime)
        keys, values = paged_entries(kv, lay, self.scale, size, key.dtype)
        CPUAttentionBackendImpl.do_kv_cache_update(self, layer, keys, values, kv_cache, slots[lay.start:])
        self.state.stats["compress_seconds"] += time.perf_counter() - start
        self.state.stats["compressed_layers"] += 1


class KvmergePlainCPUBackend(CPUAttentionBackend):
    """CPU_ATTN with vLLM's own head size, for `full` and methods that only select
    (`config.needs_channel`): the builder's shifted tables and the impl's compression, no channel."""

    @staticmethod
    def get_name() -> str:
        return "CPU_ATTN"

    @staticmethod
    def get_impl_cls():
        return KvmergeCPUImpl

    @staticmethod
    def get_builder_cls():
        return KvmergeCPUBuilder


class KvmergeCPUBackend(KvmergePlainCPUBackend):
    """CPU_ATTN with a head size padded by the log-mass channel (`customize_spec`: the cache's slots
    are `padded_head_size(head_size)` wide, e.g. 80 for 64: +25% bytes per slot)."""

    @classmethod
    def customize_spec(cls, spec):
        size = padded_head_size(spec.head_size)
        return dataclasses.replace(spec, head_size=size, head_size_v=size)
