"""Hybrid sliding-window models (Gemma 3 style) and all-sliding ones (Mistral style): sliding layers
behave exactly as transformers' own, full-attention layers get the merged cache and the method."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import kvmerge
from kvmerge.cache import SlidingLayer, bytes_per_token

from .conftest import TinyTokenizer, next_query, random_ids, session_logits, stock_logits, tiny_model

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


# -- sliding=k: sliding layers hold their last k slots, the freed slots go to the compressed layers ------

def test_a_held_sliding_layer_keeps_its_last_slots_between_steps():
    layer = SlidingLayer(WINDOW)
    kv = lambda q: (torch.randn(1, 2, q, 4), torch.randn(1, 2, q, 4))  # noqa: E731
    layer.update(*kv(20))
    assert layer.positions.tolist() == [list(range(13, 20))]  # window - 1, as transformers keeps
    assert layer.hold(3) == 4 and layer.positions.tolist() == [[17, 18, 19]]
    _, _, _, seen = layer.update(*kv(5))
    assert seen.tolist() == [[17, 18, 19, 20, 21, 22, 23, 24]]  # a step sees the held slots and its own
    assert layer.positions.tolist() == [[22, 23, 24]] and layer.keys.shape[2] == 3
    with pytest.raises(ValueError, match="at least 1 slot"):
        layer.hold(0)


def _held_sliding_mask(n, split, held, steps):
    """Stock transformers masks (bool, True = attend) for `sliding=held`: prefill `split` tokens, feed
    the rest in one step, then `steps` tokens one by one."""
    p = torch.arange(n)[:, None]
    return _masks(n, torch.where(p < split, 0, torch.where(p < n - steps, split - held, p - held)))


def _masks(n, first):
    """Causal masks per layer type; a sliding query at p sees keys within the window and from `first[p]` on."""
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= p
    return {"full_attention": causal[None, None], "sliding_attention": (causal & (p - j < WINDOW) & (j >= first))[None, None]}


def test_full_with_held_sliding_layers_equals_stock_model_with_that_mask():
    model, ids, held = gemma3(), random_ids(44, seed=9), 3
    s = kvmerge.Session(model, 1, kvmerge.get_method("full", sliding=held))
    with torch.no_grad():
        s.prefill([ids[:30]])
        got = [s.forward([ids[30:40]], all_logits=True)[0]] + [s.forward([[t]])[0][None] for t in ids[40:]]
        ref = model(torch.tensor([ids]), attention_mask=_held_sliding_mask(44, 30, held, 4)).logits[0, 30:]
    assert torch.allclose(torch.cat(got), ref, atol=1e-5)
    assert [layer.entries for layer in s.cache.layers[::2]] == [held, held]


def test_sliding_moves_freed_slots_to_the_compressed_layers_in_the_same_bytes():
    model, ctx = gemma3(), random_ids(120, seed=2)
    plain = kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method("snapkv", budget=0.25, window=4), max_new_tokens=1)
    held = kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method("snapkv", budget=0.25, window=4, sliding=3),
                                max_new_tokens=1)
    # 2 sliding layers x 2 KV heads free 4 slots each: 16 entries, 4 more per compressed KV head
    assert held.stats["cache_entries"] == [3, 34, 3, 34]
    assert held.stats["cache_bytes"] == plain.stats["cache_bytes"]
    half = kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method("snapkv", budget=0.25, window=4, sliding=0.5),
                                max_new_tokens=1)  # half of window - 1 = 7: 4 slots held, 3 freed per head
    assert half.stats["cache_entries"] == [4, 33, 4, 33]
    same = kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method("snapkv", budget=0.25, window=4,
                                                                       sliding=WINDOW - 1), max_new_tokens=6)
    assert same.tokens == kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method("snapkv", budget=0.25, window=4),
                                               max_new_tokens=6).tokens


def test_sliding_is_refused_where_it_cannot_apply():
    for bad in (0, 0.0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="sliding must be"):
            kvmerge.get_method("snapkv", sliding=bad)
    with pytest.raises(ValueError, match="has none"):
        kvmerge.generate_ids(tiny_model(), random_ids(60), [3], kvmerge.get_method("snapkv", budget=0.5, window=4,
                                                                                    sliding=4))
    session = kvmerge.Session(gemma3(), 2, kvmerge.get_method("snapkv", budget=0.5, window=4, sliding=4))
    with pytest.raises(ValueError, match="rows of one length"):
        session.prefill([random_ids(60), random_ids(50)])
    with pytest.raises(ValueError, match=rf"sliding={WINDOW} slots is more than .* \({WINDOW - 1}: "):
        kvmerge.generate_ids(gemma3(), random_ids(60), [3], kvmerge.get_method("snapkv", budget=0.5, window=4,
                                                                                 sliding=WINDOW))


def _chunked_held_mask(n, chunk, held):
    """Stock transformers masks for `sliding=held` under a prefill in chunks of `chunk`: from the first
    compression on, a chunk's queries see only the `held` slots before it (and their own chunk)."""
    return _masks(n, (torch.arange(n)[:, None] // chunk) * chunk - held)


def test_chunked_prefill_holds_the_sliding_layers_between_chunks():
    model, ids, held = gemma3(), random_ids(40, seed=4), 3
    s = kvmerge.Session(model, 1, kvmerge.get_method("full", sliding=held))
    with torch.no_grad():
        s.prefill([ids[:30]], chunk=10)
        got = s.forward([ids[30:40]], all_logits=True)[0]
        ref = model(torch.tensor([ids]), attention_mask=_chunked_held_mask(40, 10, held)).logits[0, 30:]
    assert torch.allclose(got, ref, atol=1e-5)


def test_chunked_sliding_moves_the_same_slots_in_the_same_bytes():
    model, ctx = gemma3(), random_ids(120, seed=2)
    run = lambda **kw: kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method(  # noqa: E731
        "snapkv", budget=0.25, window=4, **kw), max_new_tokens=1, prefill_chunk=40)
    plain, held = run(), run(sliding=3)
    assert held.stats["cache_entries"] == [3, 34, 3, 34]  # as one-shot: 4 more per compressed KV head
    assert held.stats["cache_bytes"] == plain.stats["cache_bytes"]


@pytest.mark.parametrize("spec", ["learnedzip", "learnedzip:alloc=uniform", "learnedmerge", "surprisemerge"])
def test_a_chunk_that_keeps_a_layer_whole_still_carries_its_scores(spec):
    """With the share at one slot, the first chunks' targets exceed the chunk, so a layer (or, under global
    allocation, some layers) keeps every entry; methods whose scores come from that chunk's queries or
    tokens must still score them then, since the next compression ranks them without those queries."""
    model, ids = gemma3(), random_ids(120, seed=3)
    method = kvmerge.get_method(f"{spec}:window=2:sinks=1:sliding=1", 0.5)  # learnedzip: conftest's scorer
    s = kvmerge.Session(model, 1, method, TinyTokenizer())
    with torch.no_grad():
        s.prefill([ids], chunk=12)
    assert sum(layer.entries for layer in s.cache.layers[1::2]) < 2 * 120


def test_chunked_sliding_releases_the_dropped_slots_memory():
    model, ids = gemma3(), random_ids(120, seed=3)
    s = kvmerge.Session(model, 1, kvmerge.get_method("snapkv", budget=0.25, window=4, sliding=3))
    with torch.no_grad():
        s.prefill([ids], chunk=40)
    for layer in s.cache.layers[::2]:  # no view over a longer buffer is left
        assert layer.entries == 3 and layer._keys.untyped_storage().nbytes() == layer._keys.nbytes


def test_a_merging_method_moves_the_same_entries_and_pays_their_log_mass():
    model, ctx = gemma3(), random_ids(120, seed=2)
    run = lambda **kw: kvmerge.generate_ids(model, ctx, [5, 6], kvmerge.get_method(  # noqa: E731
        "evictmerge", budget=0.25, window=4, **kw), max_new_tokens=1)
    plain, held = run(), run(sliding=3)
    assert held.stats["cache_entries"] == [3, 34, 3, 34]
    # the same keys and values bytes; each of the 16 moved entries carries a float32 log-mass
    assert held.stats["cache_bytes"] - plain.stats["cache_bytes"] == 16 * 4


def test_a_decode_policy_that_recomputes_its_target_keeps_the_share():
    model, ctx = gemma3(), random_ids(120, seed=5)

    def global_entries(**kw):  # after 12 decoding steps, re-clustered every 2 to budget x tokens seen
        s = kvmerge.Session(model, 1, kvmerge.get_method("centroidkv", budget=0.25, window=4,
                                                         decode_budget="fraction", interval=2, **kw))
        with torch.no_grad():
            s.prefill([ctx])
            for t in range(12):
                s.forward([[5 + t]])
        return [layer.entries for layer in s.cache.layers[1::2]]
    assert [h - p for h, p in zip(global_entries(sliding=3), global_entries())] == [4, 4]
