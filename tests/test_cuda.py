"""The CUDA rows (skipped without a GPU): kvmerge's attention on fused kernels against a float64
reference, and the runtime on the GPU (nothing merged equals the stock model, every method in a
ragged batch, chunked prefill, hybrid sliding layers, the `model.generate` drop-in).

Decisions are compared within one device; across devices only what does not depend on float bits
(entries, budgets, finiteness)."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import kvmerge
from kvmerge.attention import biased_sdpa

from .conftest import TinyTokenizer, random_ids, tiny_model
from .test_chunked_prefill import CHUNKED
from .test_hybrid import WINDOW, gemma3

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference(query, key, value, log_n, causal_from=None):
    """softmax(q·k/√d + log_n) v in float64, GQA by repeating KV heads; `causal_from`: the last q slots
    are the queries' own (causal among them). → `(b, q, hq, d)`."""
    q, k, v, ln = (x.double().cpu() for x in (query, key, value, log_n))
    rep = q.shape[1] // k.shape[1]
    k, v, ln = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), ln.repeat_interleave(rep, 1)
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + ln[:, :, None, :]
    if causal_from is not None:
        n, s = q.shape[2], k.shape[2]
        hidden = torch.arange(s)[None, :] - (s - n) > torch.arange(n)[:, None]
        logits = logits.masked_fill(hidden, float("-inf"))
    return (logits.softmax(-1) @ v).transpose(1, 2)


def merged_inputs(b, hq, hkv, q_len, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    query, key, value = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, q_len), (hkv, s), (hkv, s)))
    log_n = torch.randint(1, 6, (b, hkv, s), generator=g).float().log()  # entries standing for 1–5 tokens
    log_n[:, :, 3:9] = float("-inf")  # empty slots
    log_n[:, :, -q_len:] = 0.0  # the new tokens are plain
    return [x.cuda().to(dtype) for x in (query, key, value)] + [log_n.cuda()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("hq", [4, 8])
def test_log_mass_attention_on_fused_kernels_equals_the_reference(dtype, q_len, hq):
    query, key, value, log_n = merged_inputs(2, hq, 2, q_len, 300, 64, dtype)
    with sdpa_kernel(FUSED):  # no math fallback: raises if no fused kernel takes the call
        out = biased_sdpa(query, key, value, log_n)
    want = reference(query, key, value, log_n, causal_from=q_len if q_len > 1 else None)
    assert torch.allclose(out.double().cpu(), want, atol=TOL[dtype], rtol=0)


def test_an_entry_for_n_identical_tokens_is_exactly_those_tokens_on_cuda():
    query, key, value, _ = merged_inputs(1, 4, 2, 1, 40, 32, torch.float32)
    counts = torch.randint(1, 5, (40,))
    k_all, v_all = key.repeat_interleave(counts.cuda(), 2), value.repeat_interleave(counts.cuda(), 2)
    log_n = counts.float().log().cuda().expand(1, 2, 40).contiguous()
    merged = biased_sdpa(query, key, value, log_n)
    plain = biased_sdpa(query, k_all, v_all, torch.zeros(k_all.shape[:3], device="cuda"))
    assert torch.allclose(merged, plain, atol=1e-6)


def _stock(model, ids, steps):
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda"), cache=cache, use_cache=True).logits[:, -1]
        for _ in range(steps + 1):
            out.append(logits)
            logits = model(logits.argmax(-1, keepdim=True), cache=cache, use_cache=True).logits[:, -1]
    return torch.cat(out)


@pytest.mark.parametrize("build", [tiny_model, gemma3])
def test_nothing_merged_equals_the_stock_model_on_cuda(build):
    model = build().cuda()
    ids = random_ids(150, seed=1)
    want = _stock(model, ids, 6)
    s = kvmerge.Session(model, 1, None)
    with torch.no_grad():
        got = [s.prefill([ids])]
        for _ in range(6):
            got.append(s.forward([[int(got[-1].argmax(-1))]]))
    assert torch.allclose(torch.cat(got), want, atol=1e-4)


@pytest.mark.parametrize("name", CHUNKED)
def test_chunked_prefill_on_cuda_holds_the_budget_and_equals_the_cpus_entries(name):
    m = kvmerge.get_method(name, budget=0.25, window=8)
    rows = [random_ids(400, seed=3), random_ids(330, seed=4)]
    entries = []
    for device in ("cpu", "cuda"):
        s = kvmerge.Session(tiny_model().to(device), 2, m, TinyTokenizer())
        with torch.no_grad():
            logits = s.prefill(rows, chunk=64)
            entries.append(s.cache.entries)
            assert torch.isfinite(s.forward([[3], [4]])).all() and torch.isfinite(logits).all()
    assert entries[0] == entries[1]
    assert (sum(entries[1]) <= 2 * m.target(400) + 2) if name in ("pyramidkv", "d2o") else max(entries[1]) <= m.target(400)


@pytest.mark.parametrize("name", sorted(set(kvmerge.available_methods()) - {"full"}))
def test_every_method_runs_on_a_hybrid_model_on_cuda(name):
    model = gemma3().cuda().to(torch.bfloat16)
    global_alloc = getattr(kvmerge.get_method(name), "alloc", "uniform") != "uniform"
    m = kvmerge.get_method(name, budget=0.25, window=8, **({"alloc": "layer"} if global_alloc else {}))
    out = kvmerge.generate_ids(model, random_ids(160, seed=1), [3, 4], m, max_new_tokens=4, tokenizer=TinyTokenizer())
    entries = out.stats["cache_entries"]
    assert entries[0] == entries[2] == WINDOW - 1
    assert entries[1] + entries[3] <= 2 * m.target(160) + 2


@pytest.mark.parametrize("spec", ["snapkv", "centroidkv:interval=4", "learnedzip:alloc=uniform"])
def test_model_generate_on_cuda_equals_kvmerge_generate(spec):
    model, tok = tiny_model().cuda(), TinyTokenizer()
    ctx, q = random_ids(160, seed=1), random_ids(6, seed=2)
    method = kvmerge.get_method(f"{spec}:window=8", 0.25)
    want = kvmerge.generate_ids(model, ctx, q, method, max_new_tokens=12, tokenizer=tok)
    with kvmerge.compressing(model, method, tokenizer=tok) as kv:
        cache = kv.prefill(ctx)
        got = model.generate(torch.tensor([ctx + q], device="cuda"), cache=cache, max_new_tokens=12, do_sample=False)
    assert got[0, len(ctx + q):].tolist() == want.tokens[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 32, 8, 5000, 128), (3, 12, 4, 77, 80), (2, 4, 4, 1, 64), (1, 16, 1, 700, 256)])
def test_the_decode_kernel_equals_the_reference(dtype, shape):
    from kvmerge.ops.decode_attention import available, decode_attention

    b, hq, hkv, s, d = shape
    query, _, _, log_n = merged_inputs(b, hq, hkv, 1, s + 9, d, dtype)
    key, value = (torch.randn(b, hkv, s + 9, d, device="cuda", dtype=dtype)[:, :, :s] for _ in range(2))  # strided
    log_n = log_n[:, :, :s].contiguous()
    assert available(query)
    out = decode_attention(query, key, value, log_n)
    assert torch.allclose(out.double().cpu(), reference(query, key, value, log_n), atol=TOL[dtype], rtol=0)
