"""Hybrid sliding-window models (Gemma 3 style) and all-sliding ones (Mistral style): sliding layers
behave exactly as transformers' own, full-attention layers get the merged cache and the method."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import kvmerge
from kvmerge.cache import SlidingLayer, bytes_per_token

from .conftest import TinyTokenizer, next_query, random_ids, session_logits, stock_logits

WINDOW = 8


def gemma3(seed=0, layers=4):
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "gemma3_text", vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64,
        intermediate_size=96, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=WINDOW, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def mistral_sliding():
    torch.manual_seed(0)
    config = AutoConfig.for_model("mistral", vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("build", [gemma3, mistral_sliding])
@pytest.mark.parametrize("split", [None, 20])
def test_full_cache_equals_stock_far_beyond_the_window(build, split):
    model = build()
    ids = random_ids(40, seed=1)
    ref = stock_logits(model, ids, 20)
    got, s = session_logits(model, ids, 20, method=kvmerge.get_method("full"), split=split)
    assert torch.allclose(ref, got, atol=1e-5)
    sliding = [layer for layer in s.cache.layers if isinstance(layer, SlidingLayer)]
    assert sliding and all(layer.entries == WINDOW - 1 for layer in sliding)  # what transformers keeps


def test_budget_is_met_on_the_full_attention_layers_and_sliding_layers_stay_as_they_are():
    model = gemma3()
    out = kvmerge.generate_ids(model, random_ids(120, seed=2), [5, 6], kvmerge.get_method("snapkv", budget=0.25,
                                                                                           window=4),
                               max_new_tokens=1)
    assert out.stats["cache_entries"] == [WINDOW - 1, 30, WINDOW - 1, 30]
    per_layer = bytes_per_token(model.config, torch.float32) // 4
    assert out.stats["compressed_layers_bytes"] == 2 * 30 * per_layer
    assert out.stats["compressed_layers_full_bytes"] == 2 * 120 * per_layer
    assert out.stats["cache_bytes"] == (2 * 30 + 2 * (WINDOW - 1)) * per_layer
    assert out.stats["full_cache_bytes"] == (2 * 120 + 2 * (WINDOW - 1)) * per_layer


def test_positions_continue_after_compression():
    model, ids = gemma3(), random_ids(80, seed=4)
    full, _ = next_query(model, ids, kvmerge.get_method("full"), 1)  # layer 1: full attention
    compressed, _ = next_query(model, ids, kvmerge.get_method("streamingllm", budget=0.25, window=8), 1)
    assert torch.allclose(full, compressed, atol=1e-6)


@pytest.mark.parametrize("method", ["full", "snapkv", "centroidkv"])
def test_ragged_batch_equals_one_at_a_time(method):
    model = gemma3()
    m = kvmerge.get_method(method) if method == "full" else kvmerge.get_method(method, budget=0.5, window=8,
                                                                                 **({"interval": 4} if method == "centroidkv" else {}))
    ctx = [random_ids(70, seed=5), random_ids(44, seed=6)]
    qs = [random_ids(5, seed=7), random_ids(9, seed=8)]
    batch = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=12)
    alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=12).tokens[0] for c, q in zip(ctx, qs)]
    assert batch.tokens == alone


@pytest.mark.parametrize("name", sorted(set(kvmerge.available_methods()) - {"full"}))
def test_every_method_runs_on_a_hybrid_model(name):
    model = gemma3()
    global_alloc = getattr(kvmerge.get_method(name), "alloc", "uniform") != "uniform"
    extra = {"alloc": "layer"} if global_alloc else {}  # per-head padding exceeds a layer's share (test_alloc)
    m = kvmerge.get_method(name, budget=0.25, window=8, **extra)
    out = kvmerge.generate_ids(model, random_ids(160, seed=1), [3, 4], m, max_new_tokens=4, tokenizer=TinyTokenizer())
    entries = out.stats["cache_entries"]
    assert entries[0] == entries[2] == WINDOW - 1
    assert entries[1] + entries[3] <= 2 * m.target(160) + 2


def test_model_generate_on_a_hybrid_model_equals_kvmerge_generate():
    model = gemma3()
    ctx, q = random_ids(100, seed=3), random_ids(4, seed=4)
    want = kvmerge.generate_ids(model, ctx, q, kvmerge.get_method("snapkv", budget=0.25, window=8), max_new_tokens=10)
    with kvmerge.compressing(model, "snapkv", budget=0.25, window=8) as kv:
        got = model.generate(torch.tensor([ctx + q]), cache=kv.prefill(ctx), max_new_tokens=10, do_sample=False)
    assert got[0, len(ctx + q):].tolist() == want.tokens[0]


def test_an_all_sliding_model_has_nothing_to_compress_and_says_so():
    with pytest.raises(ValueError, match="sliding-window layers only"):
        kvmerge.generate_ids(mistral_sliding(), random_ids(40), [3], kvmerge.get_method("snapkv", budget=0.5, window=4))
