"""Proportional attention: softmax(q·k/√d + log_n) over a merged cache, on SDPA.

An entry standing for n identical tokens gets exactly the attention those n tokens would get, so
merging identical tokens is lossless. With `log_n is None` (plain cache) the stock transformers
`sdpa` function runs unchanged.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from .ops import decode_attention as decode_kernel

ATTN_NAME = "kvmerge"
# On CUDA: flash, or the memory-efficient kernel where a log-mass bias is given. cuDNN's kernel is left out:
# it plans a graph for every new key length, which costs more CPU time per decoding step than the step itself.
CUDA_KERNELS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def fused_kernels(device: torch.device):
    """The SDPA backends kvmerge's attention runs on `device` with (CUDA: `CUDA_KERNELS`)."""
    return sdpa_kernel(CUDA_KERNELS) if device.type == "cuda" else nullcontext()


SMALL_CALL = 1 << 20  # multiply-adds below which a CPU attention call runs on one thread


@contextmanager
def one_thread(device: torch.device, work: int):
    """On the CPU, for calls of at most `SMALL_CALL` multiply-adds (`work`), torch's intra-op threads
    set to one inside the block (restored after): there a call's parallel region costs more than it
    splits, most of all on a loaded machine, where threads wait for busy cores."""
    if device.type != "cpu" or work > SMALL_CALL:
        yield
        return
    with _threads_lock:  # the count is the process's: the first block in saves it, the last out restores it
        if _one_thread["open"] == 0:
            _one_thread["saved"] = torch.get_num_threads()
            if _one_thread["saved"] != 1:
                torch.set_num_threads(1)
        _one_thread["open"] += 1
    try:
        yield
    finally:
        with _threads_lock:
            _one_thread["open"] -= 1
            if _one_thread["open"] == 0 and _one_thread["saved"] != 1:
                torch.set_num_threads(_one_thread["saved"])


_threads_lock = threading.Lock()
_one_thread = {"open": 0, "saved": 1}  # one_thread blocks open in any thread, the count they found


def attention_bias(log_n: torch.Tensor, q_len: int, dtype: torch.dtype, window=None) -> torch.Tensor:
    """Additive bias `(batch, kv_heads, q_len, slots)`: log_n, causal over the last `q_len` slots, or
    with `window = (w, key_positions (b, s), query_positions (b, q))` visible iff 0 ≤ q_pos − k_pos < w.

    Each query always sees its own slot (bias 0), so a padding query stays finite.
    """
    b, h, s = log_n.shape
    bias = log_n.to(dtype)[:, :, None, :]
    if q_len == 1 and window is None:  # a decoding token is never padding
        return bias
    past = s - q_len
    if window is None:
        i = torch.arange(q_len, device=log_n.device)[:, None]
        j = torch.arange(s, device=log_n.device)[None, :] - past
        hidden = j > i
    else:
        w, key_pos, query_pos = window
        diff = query_pos[:, :, None] - key_pos[:, None, :]  # (b, q, s)
        hidden = ((diff < 0) | (diff >= w))[:, None]
    bias = bias + torch.zeros(hidden.shape, dtype=dtype, device=log_n.device).masked_fill_(hidden, float("-inf"))
    bias[..., torch.arange(q_len), past + torch.arange(q_len)] = 0.0
    return bias


def biased_sdpa(query, key, value, log_n, scaling=None, window=None):
    """SDPA with the log-mass bias, GQA by packing query heads onto their KV head (no repeat_kv).

    query `(b, hq, q, d)`, key/value `(b, hkv, s, d)`, log_n `(b, hkv, s)` → `(b, q, hq, d)`;
    `window`: a sliding layer's mask (see `attention_bias`).
    """
    q, hkv = query.shape[2], key.shape[1]
    rep = query.shape[1] // hkv
    if q == 1 and window is None and decode_kernel.available(query):  # a decoding step on the GPU
        return decode_kernel.decode_attention(query, key, value, log_n, scaling)
    if q > 1 and (hkv == 1 or bool((log_n == log_n[:, :1]).all())):  # one mask for every head (no merges yet)
        bias = attention_bias(log_n[:, :1], q, query.dtype, window)  # (b, 1, q, s): not repeated per head
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scaling, enable_gqa=rep > 1)
        return out.transpose(1, 2)
    return packed_sdpa(query, key, value, attention_bias(log_n, q, query.dtype, window), scaling)


def packed_sdpa(query, key, value, bias=None, scaling=None):
    """SDPA with GQA by packing each KV group's query heads as that head's queries (no repeat_kv; on
    CPU this also reads K/V faster than SDPA's `enable_gqa`). query `(b, hq, q, d)`, key/value
    `(b, hkv, s, d)`, optional additive bias `(b, hkv, q, s)` → `(b, q, hq, d)`."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    rep = hq // hkv
    if bias is not None and q > 1 and rep > 1:
        bias = bias[:, :, None].expand(b, hkv, rep, q, bias.shape[-1]).reshape(b, hkv, rep * q, -1)
    out = F.scaled_dot_product_attention(query.reshape(b, hkv, rep * q, d), key, value, attn_mask=bias, scale=scaling)
    return out.reshape(b, hq, q, value.shape[-1]).transpose(1, 2)


def ragged_sdpa(query, keys, values, log_n, spans, scaling=None):
    """Attention over KV heads stored at their own lengths, packed back to back: query `(b, hq, q, d)`,
    `keys`/`values` `(b, C, d)`, `log_n` `(b, C)` or None (all zeros), `spans` one `(start, length)`
    per KV head (its held slots, the last q of them the new tokens) → `(b, q, hq, d)`; equal to
    `biased_sdpa` over the heads padded to one length with empty slots. One SDPA call per KV head on
    views of the packed buffers (exact: each head's queries see its own keys only, nothing copied)."""
    b, hq, q, d = query.shape
    hkv = len(spans)
    rep = hq // hkv
    if q == 1 and (log_n is None or not decode_kernel.available(query)):  # a decoding step
        grouped = query.reshape(b, hkv, rep, d)  # each KV head's query heads as its queries (GQA)
        bias = None if log_n is None else log_n.to(query.dtype)[:, None, None]
        with one_thread(query.device, b * rep * d * max(n for _, n in spans)):  # one small call per KV head
            outs = [F.scaled_dot_product_attention(grouped[:, i:i + 1], keys[:, None, s:s + n], values[:, None, s:s + n],
                                                   attn_mask=None if bias is None else bias[..., s:s + n], scale=scaling)
                    for i, (s, n) in enumerate(spans)]
        return torch.cat(outs, dim=1).reshape(b, hq, 1, values.shape[-1]).transpose(1, 2)
    outs = []
    for i, (start, n) in enumerate(spans):  # a chunk (causal over its tokens), or the GPU's decoding kernel
        key, value = keys[:, None, start:start + n], values[:, None, start:start + n]
        ln = (log_n[:, None, start:start + n] if log_n is not None
              else torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device))
        outs.append(biased_sdpa(query[:, i * rep:(i + 1) * rep], key, value, ln, scaling))
    return torch.cat(outs, dim=2)


def proportional_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                           is_causal=None, kvmerge_log_n=None, kvmerge_listener=None, kvmerge_window=None,
                           kvmerge_heads=None, kvmerge_masked=False, **kwargs):
    """Registered as transformers attention `"kvmerge"`. `kvmerge_log_n` `(b, hkv, s)`,
    `kvmerge_window` (a sliding layer's window and positions), `kvmerge_heads` (a layer whose KV heads
    have their own lengths: `MergedLayer.packed()`, see `ragged_sdpa`), `kvmerge_listener` `(layer_idx, fn)`
    and `kvmerge_masked` (the log-mass carries every mask, a sliding window included: graph decoding) come
    from `MergedCache.update`; with another cache all are None and this is stock causal SDPA."""
    with torch.profiler.record_function("kvmerge::attention"), fused_kernels(query.device):
        if kvmerge_heads is not None:
            out = ragged_sdpa(query, *kvmerge_heads, scaling)
        else:
            out = _attention(module, query, key, value, attention_mask, dropout, scaling, kvmerge_log_n,
                             kvmerge_window, kvmerge_masked, **kwargs)
    if kvmerge_listener is not None:
        layer_idx, listener = kvmerge_listener
        with torch.profiler.record_function("kvmerge::listener"):
            listener(layer_idx, query)
    return out, None


def _attention(module, query, key, value, attention_mask, dropout, scaling, kvmerge_log_n, kvmerge_window,
               kvmerge_masked=False, **kwargs):
    if attention_mask is not None:
        raise ValueError("kvmerge attention builds its own mask; pass no 4D attention_mask "
                         "(for padded batches use kvmerge.generate)")
    q_len, kv_len = query.shape[2], key.shape[2]
    if kvmerge_window is None and not kvmerge_masked and (kwargs.get("sliding_window") or kv_len) < kv_len:
        raise ValueError("a sliding-window layer under kvmerge attention needs a kvmerge cache (kvmerge.MergedCache "
                         "or kvmerge.compressing), which carries the positions its window mask needs")
    window_binds = kvmerge_window is not None and kv_len > kvmerge_window[0]
    small = one_thread(query.device, query.shape[0] * query.shape[1] * query.shape[3] * kv_len) if q_len == 1 \
        else nullcontext()  # a decoding step
    if kvmerge_log_n is None and q_len == 1 and not window_binds:
        with small:
            out = packed_sdpa(query, key, value, None, scaling)  # a decoding step on a plain cache
    elif kvmerge_log_n is None and kv_len == q_len and not window_binds:
        out, _ = sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                        is_causal=True, **kwargs)
    else:
        log_n = kvmerge_log_n
        if log_n is None:
            log_n = torch.zeros(key.shape[:3], dtype=torch.float32, device=key.device)
        with small:
            out = biased_sdpa(query, key, value, log_n, scaling, kvmerge_window if window_binds else None)
    return out


def padding_free_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                      attention_mask=None, **kwargs):
    """Mask function paired with `"kvmerge"`: masks come from log_n, so none is built here."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("a padded attention_mask is not supported with kvmerge attention: padding lives in "
                         "the cache's log_n; use kvmerge.generate(...) for batches of different lengths")
    return None


_scopes = threading.local()  # kvmerge_attention scopes open in this thread


def attention_active() -> bool:
    """Whether this thread has a `kvmerge_attention` scope open (a ragged cache is read by kvmerge's
    attention only)."""
    return getattr(_scopes, "open", 0) > 0


@contextmanager
def _scope():
    _scopes.open = getattr(_scopes, "open", 0) + 1
    try:
        yield
    finally:
        _scopes.open -= 1


@contextmanager
def kvmerge_attention(model):
    """Run `model` with kvmerge's attention inside the block; its previous implementation is restored
    on exit (nested scopes are free). Identical to `sdpa` on a cache with nothing merged."""
    previous = model.config._attn_implementation
    if previous == ATTN_NAME:
        with _scope():
            yield model
        return
    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, proportional_attention)
        AttentionMaskInterface.register(ATTN_NAME, padding_free_mask)
    model.set_attn_implementation(ATTN_NAME)
    try:
        with _scope():
            yield model
    finally:
        model.set_attn_implementation(previous)
