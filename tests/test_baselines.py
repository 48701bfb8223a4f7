"""Eviction baselines: selections right on constructed cases; every method: budget, batch, bf16."""

import pytest
import torch

import kvmerge
from kvmerge.methods.base import LayerContext

from .conftest import random_ids, tiny_model

EXTRA = {"semanticache": {"chunking": "fixed"}}


def _case(n=100, hot=(20, 41, 63), seed=0):
    """Keys pointing away from the queries, except `hot` ones aligned with them."""
    g = torch.Generator().manual_seed(seed)
    q_dir = torch.randn(8, generator=g)
    keys = torch.randn(1, 1, n, 8, generator=g) * 0.1 - q_dir
    keys[0, 0, list(hot)] = q_dir * 3
    queries = (q_dir + 0.05 * torch.randn(1, 2, 32, 8, generator=g))
    return keys, torch.randn(1, 1, n, 4, generator=g), queries


@pytest.mark.parametrize("name", ["snapkv", "h2o", "tova", "pyramidkv"])
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
    s = kvmerge.Session(model, 1)
    m = kvmerge.get_method("tova", budget=0.25, window=8)
    for layer in s.cache.layers:
        layer.capture_queries = m.query_window
    ids = random_ids(160)
    with torch.no_grad():
        logits = s.forward([ids])
        s.compress(m, [ids])
        for _ in range(30):
            logits = s.forward([[int(logits.argmax(-1))]])
            assert all(e == 40 for e in s.cache.entries)


@pytest.mark.parametrize("name", sorted(set(kvmerge.available_methods()) - {"full"}))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_method_batch_budget_and_dtype(name, dtype):
    model = tiny_model(dtype=dtype)
    m = kvmerge.get_method(name, budget=0.25, window=8, **EXTRA.get(name, {}))
    ctx = [random_ids(160, seed=1), random_ids(120, seed=2)]
    qs = [[3, 4], [5]]
    out = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=6)
    slots = max(m.target(160), m.target(120))
    if name == "pyramidkv":
        slots = 2 * slots
    assert max(out.stats["cache_entries"]) <= slots
    if name != "pyramidkv":
        per_slot = 2 * 2 * 16 * torch.empty((), dtype=dtype).element_size() + 2 * 4  # K+V over 2 heads + log_n
        assert out.stats["cache_bytes"] <= 2 * 2 * slots * per_slot  # 2 layers, 2 rows
    if dtype == torch.float32:  # bf16 batched kernels are not bitwise equal to single-row ones
        alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=6).tokens[0] for c, q in zip(ctx, qs)]
        assert out.tokens == alone
    s = kvmerge.Session(model, 1)
    with torch.no_grad():
        for layer in s.cache.layers:
            layer.capture_queries = m.query_window
        s.forward([ctx[0]])
        s.compress(m, [ctx[0]])
        assert torch.isfinite(s.forward([[3]])).all()


def test_available_methods_are_reachable_by_name():
    names = kvmerge.available_methods()
    assert {"full", "streamingllm", "semanticache", "centroidkv", "snapkv", "pyramidkv", "h2o", "tova"} <= set(names)
    for name in names:
        assert kvmerge.get_method(name, budget=0.5).budget == 0.5
