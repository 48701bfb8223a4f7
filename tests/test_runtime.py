"""The runtime's invariants: equality with the stock model, exact proportional attention, positions."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import kvmerge
from kvmerge.attention import biased_sdpa
from kvmerge.cache import bytes_per_token

from .conftest import TinyTokenizer, next_query, random_ids, session_logits, stock_logits, tiny_model


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_noop_compression_equals_stock_model(arch):
    model = tiny_model(arch)
    ids = random_ids(50)
    ref = stock_logits(model, ids, 16)
    got, _ = session_logits(model, ids, 16, method=kvmerge.get_method("full"), split=40)
    assert torch.allclose(ref, got, atol=1e-5)


def test_full_method_reproduces_model_generate(llama):
    ids = random_ids(60, seed=1)
    ref = llama.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, 60:].tolist()
    out = kvmerge.generate_ids(llama, ids[:45], ids[45:], "full", max_new_tokens=12)
    assert out.tokens[0] == ref


def test_merged_cache_under_model_generate(llama):
    ids = torch.tensor([random_ids(30, seed=2)])
    ref = llama.generate(ids, max_new_tokens=10, do_sample=False)
    with kvmerge.kvmerge_attention(llama):
        got = llama.generate(ids, max_new_tokens=10, do_sample=False, cache=kvmerge.MergedCache(2))
    assert ref.tolist() == got.tolist()
    assert llama.config._attn_implementation == "sdpa"  # restored after the scope


def test_biased_attention_with_zero_mass_equals_sdpa():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 16), torch.randn(2, 3, 12, 16), torch.randn(2, 3, 12, 16)
    got = biased_sdpa(q, k, v, torch.zeros(2, 3, 12))
    causal = torch.ones(5, 12, dtype=torch.bool).tril(12 - 5)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           attn_mask=causal)
    assert torch.allclose(got, ref.transpose(1, 2), atol=1e-6)


def test_proportional_attention_is_exact_on_identical_tokens(llama):
    """n copies of a slot in the cache == one slot with log_n = log n (attention output and logits)."""
    ids = random_ids(24, seed=3)
    copies = torch.tensor([1, 3, 1, 1, 4, 1, 2] + [1] * 17)

    def run(dup: bool):
        s = kvmerge.Session(llama, 1)
        with torch.no_grad():
            s.forward([ids])
            for layer in s.cache.layers:
                if dup:
                    idx = torch.arange(24).repeat_interleave(copies)
                    layer.replace(layer.keys[:, :, idx], layer.values[:, :, idx], None)
                else:
                    layer.replace(layer.keys, layer.values, copies.float().log().expand(1, 2, 24))
            return s.forward([[5, 6, 7]]), s.forward([[8]])

    (a1, a2), (b1, b2) = run(True), run(False)
    assert torch.allclose(a1, b1, atol=1e-5) and torch.allclose(a2, b2, atol=1e-5)


def test_positions_continue_from_tokens_seen(llama):
    """Layer 0's post-RoPE query depends only on token and position: it must match the uncompressed run."""
    ids = random_ids(80, seed=4)
    full, _ = next_query(llama, ids, kvmerge.get_method("full"), 0)
    compressed, s = next_query(llama, ids, kvmerge.get_method("streamingllm", budget=0.5, window=8), 0)
    assert s.cache.layers[0].entries == 41  # 40 kept + the new token
    assert s.cache.get_seq_length() == 81
    assert torch.allclose(full, compressed, atol=1e-6)


@pytest.mark.parametrize("method", ["full", "streamingllm"])
def test_padded_batch_equals_one_at_a_time(llama, method):
    m = kvmerge.get_method(method, budget=0.5, window=8) if method != "full" else kvmerge.get_method("full")
    ctx = [random_ids(70, seed=5), random_ids(44, seed=6)]
    qs = [random_ids(5, seed=7), random_ids(9, seed=8)]
    batch = kvmerge.generate_ids(llama, ctx, qs, m, max_new_tokens=10)
    alone = [kvmerge.generate_ids(llama, c, q, m, max_new_tokens=10).tokens[0] for c, q in zip(ctx, qs)]
    assert batch.tokens == alone


def test_cache_bytes_meet_the_budget(llama):
    ids = random_ids(100, seed=9)
    out = kvmerge.generate_ids(llama, ids, [3, 4], kvmerge.get_method("streamingllm", budget=0.25, window=8),
                               max_new_tokens=1)
    per_token = bytes_per_token(llama.config, torch.float32)
    assert out.stats["cache_entries"] == [25, 25]
    assert out.stats["cache_bytes"] == 25 * per_token
    assert out.stats["full_cache_bytes"] == 100 * per_token


def test_budget_as_absolute_entries(llama):
    out = kvmerge.generate_ids(llama, random_ids(100), [3], kvmerge.get_method("streamingllm", budget=40),
                               max_new_tokens=1)
    assert out.stats["cache_entries"] == [40, 40]


@pytest.mark.parametrize("budget", [0.0, 1.5, -0.1, float("nan"), 10])
def test_invalid_budget_is_refused(budget):
    with pytest.raises(ValueError, match="budget"):
        kvmerge.get_method("streamingllm", budget=budget)


def test_bad_inputs_get_clear_errors(llama):
    with pytest.raises(ValueError, match="unknown method"):
        kvmerge.get_method("nope")
    with pytest.raises(TypeError, match="no parameter"):
        kvmerge.get_method("streamingllm", tau=0.5)
    with pytest.raises(ValueError, match="empty context"):
        kvmerge.generate_ids(llama, [], [1, 2])
    with pytest.raises(ValueError, match="context too short"):
        kvmerge.generate_ids(llama, random_ids(50), [1], kvmerge.get_method("streamingllm", budget=0.25))
    with pytest.raises(ValueError, match="protocol"):
        kvmerge.generate_ids(llama, random_ids(50), [1], protocol="sideways")
    with pytest.raises(ValueError, match="vocabulary"):
        kvmerge.generate_ids(llama, [1, 2, 500], [1])
    with pytest.raises(TypeError, match="budget"):
        kvmerge.get_method("streamingllm", budget="half")


def test_unsupported_models_are_refused():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ValueError, match="unsupported model type 'gpt2'"):
        kvmerge.check_supported(gpt2)
    no_rope = tiny_model("llama")
    no_rope.config.rope_parameters = None
    with pytest.raises(ValueError, match="RoPE"):
        kvmerge.check_supported(no_rope)
    with pytest.raises(TypeError):
        kvmerge.check_supported(object())


def test_padded_attention_mask_is_refused_not_ignored(llama):
    with kvmerge.kvmerge_attention(llama), pytest.raises(ValueError, match="padded"):
        llama(torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))


def test_log_mass_of_merged_entries_is_kept_in_float32(llama):
    s = kvmerge.Session(llama, 1)
    with torch.no_grad():
        s.forward([random_ids(10)])
    layer = s.cache.layers[0]
    layer.replace(layer.keys, layer.values, torch.full((1, 2, 10), math.log(3)))
    assert layer.log_n.dtype == torch.float32 and layer.mass().sum() == pytest.approx(60, rel=1e-6)


def test_sampling_is_seeded_greedy_at_zero_temperature_and_streams(llama):
    ctx, q = random_ids(80, seed=11), [5, 6]
    m = kvmerge.get_method("snapkv", budget=0.5, window=8)
    greedy = kvmerge.generate_ids(llama, ctx, q, m, max_new_tokens=8).tokens
    assert kvmerge.generate_ids(llama, ctx, q, m, max_new_tokens=8, sampling=kvmerge.Sampling(0.0)).tokens == greedy
    runs = [kvmerge.generate_ids(llama, ctx, q, m, max_new_tokens=8,
                                 sampling=kvmerge.Sampling(temperature=1.5, top_k=50, top_p=0.95, seed=s)).tokens
            for s in (1, 1, 2)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    seen = []

    class Streamer:
        def put(self, value):
            seen.append(int(value[0]))

        def end(self):
            seen.append("end")

    out = kvmerge.generate_ids(llama, ctx, q, m, max_new_tokens=8, streamer=Streamer(),
                               stop=lambda row: len(row) == 3)
    assert out.tokens[0] == greedy[0][:3] and seen == greedy[0][:3] + ["end"]
    with pytest.raises(ValueError, match="top_p"):
        kvmerge.Sampling(temperature=1.0, top_p=0.0)
    for options, match in [({"temperature": float("nan")}, "temperature >= 0 .finite."),
                           ({"temperature": "0.7"}, "temperature must be a number, got '0.7'"),
                           ({"temperature": 0.7, "top_k": 2.5}, "top_k must be a whole number"),
                           ({"seed": 3}, "seed shapes sampling, and temperature 0 decodes greedily"),
                           ({"top_k": 5, "top_p": 0.9}, "top_k, top_p shape sampling")]:
        with pytest.raises(kvmerge.KVMergeError, match=match):  # the command line's rule, in Python's names
            kvmerge.Sampling(**options)
    import numpy as np

    assert kvmerge.Sampling(np.float32(0.7), np.int64(5)).top_k == 5  # numpy numbers are numbers
    for stop in ([""], "", ["a", 3]):
        with pytest.raises(kvmerge.KVMergeError, match="stop strings must be non-empty strs"):
            kvmerge.generate(llama, TinyTokenizer(), "a b c", "q", method="full", stop=stop)
    with pytest.raises(ValueError, match="single row"):
        kvmerge.generate_ids(llama, [ctx, ctx], [q, q], m, streamer=Streamer())


def test_get_method_takes_a_name_or_a_spec_with_budget_and_keywords():
    """One implementation: `kvmerge.get_method` reads specs as `get_method` does (which calls it)."""
    m = kvmerge.get_method("snapkv:alloc=head", budget=0.1, window=8)
    assert (m.name, m.alloc, m.budget, m.window) == ("snapkv", "head", 0.1, 8)
    z = kvmerge.get_method("zipguardmerge:sliding=0.75", budget=0.25)
    assert z.preset == "zipguardmerge" and z.sliding == 0.75 and z.budget == 0.25
    assert kvmerge.get_method("snapkv:budget=400", budget=0.25).budget == 400  # the spec's budget wins
    assert kvmerge.get_method("full", budget=0.25).budget == 1.0  # the full cache takes no budget
    for spec in ("snapkv:alloc=head:window=8", "zipguardmerge:sliding=0.75", "evictmerge:base=h2o:recent=0.5"):
        assert kvmerge.get_method(spec, budget=0.3) == kvmerge.get_method(spec, 0.3) \
            == kvmerge.methods.get_method(spec, budget=0.3), spec
    with pytest.raises(kvmerge.KVMergeError, match=r"^method spec 'snapkv:window=8' sets window=8 and the call "
                       r"window=16: give window once$"):
        kvmerge.get_method("snapkv:window=8", window=16)
    with pytest.raises(kvmerge.KVMergeError, match=r"^unknown method 'snapvk' \(did you mean snapkv\?\)"):
        kvmerge.get_method("snapvk:alloc=head")
    with pytest.raises(kvmerge.KVMergeError, match="snapkv: parameter kernel must be a whole number"):
        kvmerge.get_method("snapkv:kernel=five", budget=0.25)
    with pytest.raises(kvmerge.KVMergeError, match=r"^a method is named by a string \(a name or a spec such as "
                       r"'snapkv:window=8'\), got int$"):
        kvmerge.get_method(3)
