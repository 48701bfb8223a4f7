"""Eviction baselines: selections right on constructed cases; every method: budget, batch, bf16."""

import pytest
import torch

import kvmerge
from kvmerge.cache import bytes_per_token
from kvmerge.methods.base import LayerContext

from .conftest import TinyTokenizer, random_ids, tiny_model

# zipmerge's global allocation needs rows without padding (tests/test_alloc.py): here, its uniform form
EXTRA = {"semanticache": {"chunking": "fixed"}, "kvzip": {"alloc": "uniform"}, "learnedzip": {"alloc": "uniform"}, "learnedmerge": {"alloc": "uniform"}, "zipmerge": {"alloc": "uniform"}, "zipguardmerge": {"alloc": "uniform"}}
LAYER_ADAPTIVE = {"pyramidkv", "d2o"}  # per-layer budgets: the total, not each layer, meets the budget


def _case(n=100, hot=(20, 41, 63), seed=0):
    """Keys pointing away from the queries, except `hot` ones aligned with them."""
    g = torch.Generator().manual_seed(seed)
    q_dir = torch.randn(8, generator=g)
    keys = torch.randn(1, 1, n, 8, generator=g) * 0.1 - q_dir
    keys[0, 0, list(hot)] = q_dir * 3
    queries = (q_dir + 0.05 * torch.randn(1, 2, 32, 8, generator=g))
    return keys, torch.randn(1, 1, n, 4, generator=g), queries


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "pyramidkv", "cam"])
def test_score_methods_keep_what_is_attended(name):
    keys, values, queries = _case()
    m = kvmerge.get_method(name, budget=20, sinks=4, window=8)
    ctx = LayerContext(0, 1, target=20, sinks=4, window=8, scaling=8 ** -0.5, queries=queries)
    k, v, ln = m.compress(keys, values, torch.zeros(1, 1, 100), ctx)
    kept = [i for i in range(100) if any(torch.equal(keys[0, 0, i], x) for x in k[0, 0])]
    assert k.shape[2] == 20
    assert {20, 41, 63} <= set(kept) and set(range(4)) <= set(kept) and set(range(92, 100)) <= set(kept)


def test_streamingllm_keeps_exactly_sinks_and_recent():
    keys, values, _ = _case()
    m = kvmerge.get_method("streamingllm", budget=20, sinks=4, window=8)
    ctx = LayerContext(0, 1, target=20, sinks=4, window=8, scaling=1.0)
    k, _, _ = m.compress(keys, values, torch.zeros(1, 1, 100), ctx)
    assert torch.equal(k, keys[:, :, list(range(4)) + list(range(84, 100))])


def test_pyramid_budgets_shrink_with_depth_and_average_to_budget():
    m = kvmerge.get_method("pyramidkv", budget=200)
    targets = [m.layer_target(LayerContext(i, 8, 200, 4, 32, 1.0)) for i in range(8)]
    assert targets == sorted(targets, reverse=True) and abs(sum(targets) / 8 - 200) <= 1


def test_tova_evicts_during_decoding_to_stay_in_budget():
    model = tiny_model()
    m = kvmerge.get_method("tova", budget=0.25, window=8)
    s = kvmerge.Session(model, 1, m)
    ids = random_ids(160)
    with torch.no_grad():
        logits = s.prefill([ids])
        for _ in range(30):
            logits = s.forward([[int(logits.argmax(-1))]])
            assert all(e == 40 for e in s.cache.entries)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(set(kvmerge.available_methods()) - {"full"}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_method_batch_budget_and_dtype(name, dtype, device):
    model = tiny_model(dtype=dtype).to(device)
    m = kvmerge.get_method(name, budget=0.25, window=8, **EXTRA.get(name, {}))
    ctx = [random_ids(160, seed=1), random_ids(120, seed=2)]
    qs = [[3, 4], [5]]
    tok = TinyTokenizer()
    out = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=6, tokenizer=tok)
    slots = max(m.target(160), m.target(120))
    entries = out.stats["cache_entries"]
    assert (sum(entries) <= 2 * slots + 2) if name in LAYER_ADAPTIVE else max(entries) <= slots
    per_slot = 2 * 2 * 16 * torch.empty((), dtype=dtype).element_size() + 2 * 4  # K+V over 2 heads + log_n
    assert out.stats["cache_bytes"] <= 2 * (2 * slots + 2) * per_slot  # 2 layers, 2 rows
    if dtype == torch.float32:  # bf16 batched kernels are not bitwise equal to single-row ones
        alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=6, tokenizer=tok).tokens[0]
                 for c, q in zip(ctx, qs)]
        assert out.tokens == alone
    s = kvmerge.Session(model, 1, m, tok)
    with torch.no_grad():
        s.prefill([ctx[0]])
        assert torch.isfinite(s.forward([[3]])).all()


def test_available_methods_are_reachable_by_name():
    names = kvmerge.available_methods()
    assert {"full", "streamingllm", "semanticache", "centroidkv", "snapkv", "pyramidkv", "h2o", "tova"} <= set(names)
    for name in names:  # the full cache keeps everything: a budget given to it is ignored, as in a spec list
        assert kvmerge.get_method(name, budget=0.5).budget == (1.0 if name == "full" else 0.5), name


def test_h2o_decode_variant_keeps_accumulating_and_stays_in_budget():
    model = tiny_model(dtype=torch.float64)  # accumulated scores of a random model nearly tie; fp32 rounding flips them
    m = kvmerge.get_method("h2o", budget=0.25, window=8, decode=True)
    ctx = [random_ids(160, seed=1), random_ids(120, seed=2)]
    out = kvmerge.generate_ids(model, ctx, [[3, 4], [5]], m, max_new_tokens=20)
    assert out.stats["cache_entries"] == [m.target(160)] * 2  # one eviction per step, rows at their own targets
    alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=20).tokens[0] for c, q in zip(ctx, [[3, 4], [5]])]
    assert out.tokens == alone
    assert out.stats["final_cache_bytes"] == out.stats["cache_bytes"]
    prefill_only = kvmerge.generate_ids(model, ctx[0], [3, 4], kvmerge.get_method("h2o", budget=0.25, window=8),
                                        max_new_tokens=20)
    per_token = bytes_per_token(model.config, torch.float64)
    assert prefill_only.stats["final_cache_bytes"] == prefill_only.stats["cache_bytes"] + 21 * per_token


def test_evict_rows_matches_per_row_eviction_under_padding():
    from kvmerge.ops.scores import evict_rows, top_slots

    g = torch.Generator().manual_seed(0)
    scores = torch.rand(2, 3, 50, generator=g)
    log_n = torch.zeros(2, 3, 50)
    log_n[1, :, 30:40] = float("-inf")  # row 1: 10 empty slots in the middle
    idx, empty = evict_rows(log_n, scores, torch.tensor([20, 12]), sinks=2, window=5)
    assert idx.shape[-1] == 20
    assert not empty[0].any() and torch.equal(idx[0], top_slots(scores[:1], 20, 2, 5)[0])
    live = torch.cat([torch.arange(30), torch.arange(40, 50)])
    expect = live[top_slots(scores[1:, :, live], 12, 2, 5)[0]]
    assert torch.equal(idx[1][~empty[1]].view(3, 12), expect)


def test_kmeans_recovers_duplicate_groups_exactly():
    """Keys in 10 groups of identical tokens: k-means with k = 10 finds the groups, so proportional
    attention over the centroids equals attention over all tokens."""
    from kvmerge.attention import biased_sdpa

    g = torch.Generator().manual_seed(0)
    protos_k, protos_v = torch.randn(1, 2, 10, 8, generator=g) * 3, torch.randn(1, 2, 10, 8, generator=g)
    member = torch.randint(0, 10, (60,), generator=g)
    member[:10] = torch.arange(10)  # every group present
    keys, values = protos_k[:, :, member], protos_v[:, :, member]
    m = kvmerge.get_method("kmeans", budget=10, sinks=0, window=0, iters=10)
    k, v, ln = m.compress(keys, values, torch.zeros(1, 2, 60), LayerContext(0, 1, 10, 0, 0, 1.0))
    assert k.shape[2] == 10 and torch.allclose(ln.exp().sum(-1), torch.full((1, 2), 60.0))
    q = torch.randn(1, 4, 1, 8, generator=g)
    full = torch.nn.functional.scaled_dot_product_attention(q, keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1))
    merged = biased_sdpa(q, k, v, ln, scaling=8 ** -0.5).transpose(1, 2)
    assert torch.allclose(full, merged, atol=1e-5)


def test_cam_spreads_evicted_values_over_the_next_positions():
    from kvmerge.methods.cam import merge_evicted_values

    values = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1) + 1
    scores = torch.full((1, 1, 10), 0.5)
    scores[..., 2] = 0.25  # half the mean score of the positions it merges into -> p = 0.5
    idx = torch.tensor([[[0, 1, 4, 5, 6, 7, 8, 9]]])  # slots 2 and 3 evicted
    scores[..., 3] = 0.0  # never merged (p = 0)
    out = merge_evicted_values(values, scores, idx, m=2, sample=False)
    expect = values[:, :, idx[0, 0]].clone()
    p2 = 0.25 / ((0.0 + 0.5) / 2)  # mean over positions 3 and 4 -> p = 1
    expect[0, 0, 2] += p2 * 3.0 / 2  # position 4 (kept, compact index 2) receives; position 3 is evicted
    assert torch.allclose(out, expect)
    scores[..., 0] = 3.0  # a heavy sink enters the mean: (3 + 0 + 0.5) / 3 -> p = 0.25 / (3.5 / 3)
    low = merge_evicted_values(values, scores, idx, m=2, sinks=1, sample=False)
    assert torch.allclose(low[0, 0, 2] - values[0, 0, 4], torch.tensor([0.25 / (3.5 / 3) * 3.0 / 2]))


def test_d2o_layer_budgets_and_threshold_merging():
    model = tiny_model()
    m = kvmerge.get_method("d2o", budget=0.25, window=8)
    s = kvmerge.Session(model, 1, m)
    ids = random_ids(200, seed=3)
    with torch.no_grad():
        s.prefill([ids])
    assert abs(sum(s.cache.entries) - 2 * m.target(200)) <= 2  # total preserved across layers
    assert 0.0 < m.stats["merged_fraction"] < 1.0
    # an evicted duplicate of a kept key merges as the average with weights e and e
    keys = torch.randn(1, 1, 40, 8)
    keys[0, 0, 20] = keys[0, 0, 21]
    queries = torch.zeros(1, 1, 40, 8)
    queries[..., 0] = 1.0
    keys[0, 0, :, 0] = -5.0
    keys[0, 0, 21, 0] = 5.0  # 21 is attended (kept); 20 equals it but is not
    keys[0, 0, 20] = keys[0, 0, 21]
    scores_ctx = LayerContext(0, 1, target=13, sinks=2, window=10, scaling=1.0, queries=queries)
    values = torch.randn(1, 1, 40, 4)
    k, v, _ = kvmerge.get_method("d2o", budget=13, sinks=2, window=10).compress(keys, values, torch.zeros(1, 1, 40),
                                                                                scores_ctx)
    assert k.shape[2] == 13 and torch.allclose(k[0, 0, 2], keys[0, 0, 21])
    assert torch.allclose(v[0, 0, 2], (values[0, 0, 20] + values[0, 0, 21]) / 2, atol=1e-6)


def test_evictmerge_min_cosine_above_one_is_its_base_and_merging_conserves_mass():
    keys, values, queries = _case()
    ctx = LayerContext(0, 1, target=20, sinks=4, window=8, scaling=8 ** -0.5, queries=queries)
    log_n = torch.zeros(1, 1, 100)
    base = kvmerge.get_method("snapkv", budget=20, sinks=4, window=8).compress(keys, values, log_n, ctx)
    same = kvmerge.get_method("evictmerge", budget=20, sinks=4, window=8, min_cosine=1.5,
                              calibrate=False, recent=0.0).compress(keys, values, log_n, ctx)
    assert all(torch.equal(a, b) for a, b in zip(base[:2], same[:2])) and bool((same[2] == 0).all())
    k, v, ln = kvmerge.get_method("evictmerge", budget=20, sinks=4, window=8, calibrate=False, recent=0.0).compress(
        keys, values, log_n, ctx)
    assert torch.allclose(ln.exp().sum(), torch.tensor(100.0)) and bool((ln[..., :4] == 0).all())  # sinks absorb nothing


def test_evictmerge_of_duplicates_leaves_attention_unchanged():
    """Evicted entries identical to kept ones: proportional attention over the merged cache is exact."""
    from kvmerge.attention import biased_sdpa

    g = torch.Generator().manual_seed(1)
    keys, values = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    keys[:, :, :10], values[:, :, :10] = keys[:, :, 20:30], values[:, :, 20:30]  # evicted 0..9 twin kept 20..29
    m = kvmerge.get_method("evictmerge", budget=30, sinks=0, window=10, base="streamingllm", min_cosine=0.999,
                           calibrate=False, recent=0.0)
    k, v, ln = m.compress(keys, values, torch.zeros(1, 2, 40), LayerContext(0, 1, 30, 0, 10, 8 ** -0.5))
    assert k.shape[2] == 30 and torch.equal(ln.exp().round()[0, 0, 10:20], torch.full((10,), 2.0))
    q = torch.randn(1, 4, 1, 8, generator=g)
    full = torch.nn.functional.scaled_dot_product_attention(q, keys.repeat_interleave(2, 1),
                                                            values.repeat_interleave(2, 1))
    merged = biased_sdpa(q, k, v, ln, scaling=8 ** -0.5).transpose(1, 2)
    assert torch.allclose(full, merged, atol=1e-5)


def test_attention_probs_equals_naive_causal_softmax():
    from kvmerge.ops.scores import attention_probs

    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 4, 300, 8, generator=g), torch.randn(2, 2, 500, 8, generator=g)
    log_n = torch.randn(2, 2, 500, generator=g).clamp_min(0)
    logits = torch.einsum("bhqd,bhsd->bhqs", q, k.repeat_interleave(2, 1)) * 0.3 + log_n.repeat_interleave(2, 1)[:, :, None]
    causal = torch.arange(500)[None, :] > (200 + torch.arange(300))[:, None]
    naive = logits.masked_fill(causal, float("-inf")).softmax(-1).view(2, 2, 2, 300, 500).sum(2)
    assert torch.allclose(attention_probs(q, k, 0.3, log_n, chunk=64), naive, atol=1e-6)


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_received_attention_equals_summed_naive_softmax(chunk):
    from kvmerge.ops.scores import received_attention

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 6, 300, 8, generator=g), torch.randn(2, 2, 500, 8, generator=g)
    log_n = torch.randn(2, 2, 500, generator=g).clamp_min(0)
    logits = torch.einsum("bhqd,bhsd->bhqs", q, k.repeat_interleave(3, 1)) * 0.3 + log_n.repeat_interleave(3, 1)[:, :, None]
    causal = torch.arange(500)[None, :] > (200 + torch.arange(300))[:, None]
    naive = logits.masked_fill(causal, float("-inf")).softmax(-1).view(2, 2, 3, 300, 500).sum((2, 3))
    assert torch.allclose(received_attention(q, k, 0.3, log_n, chunk=chunk), naive, rtol=1e-5, atol=1e-5)


def test_calibrated_merge_reproduces_the_observed_attention_output():
    """With attention-calibrated merging, a query from the observation window sees the same
    attention output when evicted entries share their kept partner's key (weights are attention)."""
    from kvmerge.attention import biased_sdpa
    from kvmerge.ops.merge import merge_into_kept
    from kvmerge.ops.scores import attention_probs

    g = torch.Generator().manual_seed(3)
    keys, values = torch.randn(1, 1, 30, 8, generator=g), torch.randn(1, 1, 30, 8, generator=g)
    keys[:, :, 20:30] = keys[:, :, 10:20] * 1.0  # evicted 20..29 share keys with kept 10..19
    q = torch.randn(1, 1, 1, 8, generator=g)
    idx = torch.arange(20).view(1, 1, 20)
    probs = attention_probs(q, keys, 8 ** -0.5)[:, :, -1]
    k, v, ln = merge_into_kept(keys, values, torch.zeros(1, 1, 30), idx, floor=0.999, attention=probs)
    assert torch.equal(k, keys[:, :, :20])
    full = torch.nn.functional.scaled_dot_product_attention(q, keys, values)
    assert torch.allclose(full, biased_sdpa(q, k, v, ln, scaling=8 ** -0.5).transpose(1, 2), atol=1e-5)
