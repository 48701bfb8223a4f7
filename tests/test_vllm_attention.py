"""The plugin's attention path in vLLM's own CPU paged-attention kernel: proportional attention by one
extra key channel, on a compressed prompt written right-aligned after freed blocks, read through the
shifted block table, equals softmax(q·k·scale + log_n)·V. Runs in .venv-vllm (make test-vllm)."""

import math

import pytest
import torch

pytest.importorskip("vllm")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from kvmerge import KV, get_method  # noqa: E402
from kvmerge.vllm.attention import channel_query, shifted, with_channel  # noqa: E402
from kvmerge.vllm.compress import EMPTY_LOG_N, compress_prompt, paged_entries  # noqa: E402
from kvmerge.vllm.config import layout, padded_head_size  # noqa: E402

HQ, HKV, D, BS = 9, 3, 64, 32
SCALE = D ** -0.5


def reference(q, k, v, log_n, scale):
    """softmax(q·k·scale + log_n)·V per query head: q `(T, hq, d)`, k/v `(S, hkv, d)`, log_n `(S, hkv)`,
    the last T keys being the queries' own (causal among them) → `(T, hq, d)`."""
    t, rep = q.shape[0], q.shape[1] // k.shape[1]
    kk, vv, ln = (x.repeat_interleave(rep, dim=1) for x in (k, v, log_n))
    logits = torch.einsum("thd,shd->hts", q.double(), kk.double()) * scale + ln.double().T[:, None, :]
    s = k.shape[0]
    causal = torch.arange(s)[None, :] > (s - t + torch.arange(t))[:, None]
    logits = logits.masked_fill(causal[None], float("-inf"))
    return torch.einsum("hts,shd->thd", logits.softmax(-1), vv.double()).float()


def new_cache(blocks: int, size: int):
    kv_cache = torch.zeros(blocks, HKV, BS, 2 * size)
    return kv_cache.view(blocks, HKV, BS * 2, size).chunk(2, dim=2)


def write(key_cache, value_cache, keys, values, slots, isa):
    ops.cpu_attn_reshape_and_cache(keys.contiguous(), values.contiguous(), key_cache, value_cache,
                                   torch.tensor(slots, dtype=torch.int64), isa)


def reused_blocks(freed: int, size: int, isa):
    """A request's block table over a 16-block cache of slots `size` wide, its first `freed` blocks full of
    someone else's entries (as after a compression freed them): (table, key_cache, value_cache, slot(pos))."""
    table = torch.tensor([[11, 4, 9, 2, 15, 7, 13, 1, 8, 3, 12, 0]], dtype=torch.int32)
    key_cache, value_cache = new_cache(16, size)
    for b in table[0, :freed].tolist():
        write(key_cache, value_cache, torch.randn(BS, HKV, size) * 50, torch.randn(BS, HKV, size) * 50,
              [b * BS + i for i in range(BS)], isa)
    return table, key_cache, value_cache, lambda pos: int(table[0, pos // BS]) * BS + pos % BS


def run_kernel(q, key_cache, value_cache, table, seq_len, isa, size):
    out = torch.zeros(q.shape[0], HQ, size)
    qsl = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    lens = torch.tensor([seq_len], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=HQ, num_kv_heads=HKV, head_dim=size,
                                               seq_lens=lens, dtype=torch.float32, query_start_loc=qsl, causal=True,
                                               sliding_window_size=-1, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(query=channel_query(q, size) if size > D else q, key_cache=key_cache, value_cache=value_cache,
                                    output=out, query_start_loc=qsl, seq_lens=lens, scale=SCALE, causal=True,
                                    alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
                                    scheduler_metadata=meta, s_aux=None)
    return out


def test_padded_head_sizes():
    assert padded_head_size(64) == 80 and padded_head_size(128) == 160 and padded_head_size(80) == 96
    with pytest.raises(ValueError, match="no room"):
        padded_head_size(512)


def test_shifted_reads_from_the_first_kept_block():
    table = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 0]], dtype=torch.int32)
    lens = torch.tensor([100, 70], dtype=torch.int32)
    t, s = shifted(table, lens, torch.tensor([2 * BS, 0]), BS)
    assert t[0, :2].tolist() == [7, 8] and t[1].tolist() == [1, 2, 3, 0] and s.tolist() == [100 - 2 * BS, 70]
    assert table[0].tolist() == [5, 6, 7, 8]  # inputs untouched


@pytest.mark.parametrize("queries", [1, 5])
def test_compressed_prompt_in_the_kernel_equals_proportional_attention(queries):
    """A 300-token prompt compressed by snapkv to 25% and given random log-masses (as a merging method
    would), written right-aligned after 7 freed blocks (filled with garbage, as if reused), then
    `queries` new tokens at their true slots: the kernel's output through the shifted table equals
    the reference over the kept entries and the new tokens, and the padded channels stay 0."""
    torch.manual_seed(0)
    size = padded_head_size(D)
    isa = _get_attn_isa(torch.float32, BS, size)
    prompt = 300
    method = get_method("snapkv", budget=0.25)
    lay = layout(get_method("evictmerge", budget=0.25), prompt, BS)  # a merging method's layout: the channel's
    assert (lay.kept, lay.freed) == (75, 7)
    q_all = torch.randn(prompt, HQ, D)
    k_all, v_all = torch.randn(prompt, HKV, D), torch.randn(prompt, HKV, D)
    kv = compress_prompt(method, 0, 1, q_all, k_all, v_all, torch.zeros(prompt, dtype=torch.long), SCALE, lay.kept)
    log_n = torch.rand(kv.log_n.shape) * 3  # as merged entries carry
    log_n[..., 3] = 0.0
    kv = KV(kv.keys, kv.values, log_n)
    table, key_cache, value_cache, slot = reused_blocks(lay.freed, size, isa)

    keys, values = paged_entries(kv, lay, SCALE, size, torch.float32)
    write(key_cache, value_cache, keys, values, [slot(p) for p in range(lay.start, prompt)], isa)
    q = torch.randn(queries, HQ, D)
    k_new, v_new = torch.randn(queries, HKV, D), torch.randn(queries, HKV, D)
    write(key_cache, value_cache, with_channel(k_new, size), with_channel(v_new, size),
          [slot(prompt + i) for i in range(queries)], isa)
    view, lens = shifted(table, torch.tensor([prompt + queries]), torch.tensor([lay.start]), BS)
    out = run_kernel(q, key_cache, value_cache, view, int(lens[0]), isa, size)

    keys_ref = torch.cat([kv.keys[0].transpose(0, 1), k_new])
    values_ref = torch.cat([kv.values[0].transpose(0, 1), v_new])
    log_ref = torch.cat([kv.log_n[0].T, torch.zeros(queries, HKV)])
    want = reference(q, keys_ref, values_ref, log_ref, SCALE)
    assert torch.allclose(out[..., :D], want, atol=2e-5, rtol=1e-4), (out[..., :D] - want).abs().max()
    assert out[..., D:].abs().max() == 0
    assert lay.empty == prompt - lay.start - lay.kept and math.exp(EMPTY_LOG_N) == 0.0


def test_identical_tokens_merged_with_log_mass_attend_as_the_tokens():
    """Proportional attention's defining property, in the kernel: one entry with log-mass log 5 gets
    exactly the attention of 5 identical plain entries."""
    torch.manual_seed(1)
    size = padded_head_size(D)
    isa = _get_attn_isa(torch.float32, BS, size)
    k, v = torch.randn(8, HKV, D), torch.randn(8, HKV, D)
    q = torch.randn(1, HQ, D)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    outs = []
    for keys, values, log_n in [
        (torch.cat([k, k[2:3].expand(4, -1, -1)]), torch.cat([v, v[2:3].expand(4, -1, -1)]),
         torch.zeros(12, HKV)),
        (k, v, torch.zeros(8, HKV).index_fill(0, torch.tensor([2]), math.log(5))),
    ]:
        key_cache, value_cache = new_cache(2, size)
        write(key_cache, value_cache, with_channel(keys, size, log_n / SCALE), with_channel(values, size),
              list(range(keys.shape[0])), isa)
        outs.append(run_kernel(q, key_cache, value_cache, table, keys.shape[0], isa, size)[..., :D])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_a_selecting_method_fills_its_first_block_and_needs_no_channel():
    """snapkv's layout without the channel: the kept entries fill the slots from the first kept block
    on (76 of a 300-token prompt at 25%, not 75: no slot can be masked), written at vLLM's own head
    size; the kernel through the shifted table equals plain softmax attention over them and the new
    tokens. A merged entry (log-mass ≠ 0) cannot be written there and is refused."""
    torch.manual_seed(1)
    isa = _get_attn_isa(torch.float32, BS, D)
    prompt, method = 300, get_method("snapkv", budget=0.25)
    lay = layout(method, prompt, BS)
    assert (lay.kept, lay.freed, lay.empty) == (76, 7, 0)
    q_all, k_all, v_all = torch.randn(prompt, HQ, D), torch.randn(prompt, HKV, D), torch.randn(prompt, HKV, D)
    kv = compress_prompt(method, 0, 1, q_all, k_all, v_all, torch.zeros(prompt, dtype=torch.long), SCALE, lay.kept)
    table, key_cache, value_cache, slot = reused_blocks(lay.freed, D, isa)

    keys, values = paged_entries(kv, lay, SCALE, D, torch.float32)
    write(key_cache, value_cache, keys, values, [slot(p) for p in range(lay.start, prompt)], isa)
    q, k_new, v_new = torch.randn(3, HQ, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    write(key_cache, value_cache, k_new, v_new, [slot(prompt + i) for i in range(3)], isa)
    view, lens = shifted(table, torch.tensor([prompt + 3]), torch.tensor([lay.start]), BS)
    out = run_kernel(q, key_cache, value_cache, view, int(lens[0]), isa, D)
    want = reference(q, torch.cat([kv.keys[0].transpose(0, 1), k_new]), torch.cat([kv.values[0].transpose(0, 1), v_new]),
                     torch.zeros(lay.kept + 3, HKV), SCALE)
    assert torch.allclose(out, want, atol=2e-5, rtol=1e-4), (out - want).abs().max()
    merged = KV(kv.keys, kv.values, kv.log_n + 0.5)
    with pytest.raises(RuntimeError, match="without the log-mass channel"):
        paged_entries(merged, lay, SCALE, D, torch.float32)
