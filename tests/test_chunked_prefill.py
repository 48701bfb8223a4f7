"""Chunked prefill: the context fed `chunk` tokens at a time, compressed after each chunk."""

import pytest
import torch

import kvmerge

from .conftest import TinyTokenizer, random_ids, tiny_model
from .test_hybrid import gemma3

# every method that keeps one count per layer and head by default; global allocation under a chunked
# prefill is tested in test_alloc
CHUNKED = sorted(n for n in kvmerge.available_methods()
                 if n != "full" and getattr(kvmerge.get_method(n), "alloc", "uniform") == "uniform")


@pytest.mark.parametrize("build", [tiny_model, gemma3])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_full_cache_chunked_equals_one_shot_at_any_chunk_size(build, chunk):
    model = build()
    ids = random_ids(150, seed=1)
    logits = []
    for c in (None, chunk):
        s = kvmerge.Session(model, 1, kvmerge.get_method("full"))
        with torch.no_grad():
            logits.append(torch.cat([s.prefill([ids], chunk=c), s.forward([[5, 6]]), s.forward([[7]])]))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


@pytest.mark.parametrize("name", ["snapkv", "centroidkv", "semanticache", "surprisemerge"])
def test_a_chunk_as_long_as_the_context_is_one_shot_compression(name):
    model = tiny_model()
    m = kvmerge.get_method(name, budget=0.25, window=8)
    ctx, q = random_ids(160, seed=2), [3, 4]
    tok = TinyTokenizer()
    one_shot = kvmerge.generate_ids(model, ctx, q, m, max_new_tokens=8, tokenizer=tok)
    chunked = kvmerge.generate_ids(model, ctx, q, m, max_new_tokens=8, tokenizer=tok, prefill_chunk=160)
    assert chunked.tokens == one_shot.tokens and chunked.stats["cache_entries"] == one_shot.stats["cache_entries"]
    assert "160 context tokens (prefilled in chunks of 160);" in str(chunked.stats)  # the stats line says so
    assert "chunks" not in str(one_shot.stats) and "prefill_chunk" not in one_shot.stats


@pytest.mark.parametrize("name", CHUNKED)
def test_the_cache_never_holds_more_than_budget_plus_a_chunk(name):
    model = tiny_model()
    m = kvmerge.get_method(name, budget=0.25, window=8)
    s = kvmerge.Session(model, 2, m, TinyTokenizer())
    peaks = []
    compress = s.compress

    def watched(token_rows, *args, **kwargs):  # entries held just before each compression
        peaks.append((int(s.seen.max()), max(s.cache.entries)))
        compress(token_rows, *args, **kwargs)

    s.compress = watched
    with torch.no_grad():
        s.prefill([random_ids(400, seed=3), random_ids(330, seed=4)], chunk=64)
        final = s.cache.entries
    assert len(peaks) == 7
    for (seen, held), (before, _) in zip(peaks[1:], peaks):
        assert held <= m.running_target(before) + 64 + (2 if name in ("pyramidkv", "d2o") else 0) * m.running_target(before)
    per_layer = m.target(400)
    assert (sum(final) <= 2 * per_layer + 2) if name in ("pyramidkv", "d2o") else max(final) <= per_layer


def test_merging_methods_conserve_the_mass_of_every_token_seen_across_chunks():
    model = tiny_model()
    for name in ("centroidkv", "semanticache", "kmeans"):
        s = kvmerge.Session(model, 1, kvmerge.get_method(name, budget=0.25, window=8), TinyTokenizer())
        with torch.no_grad():
            s.prefill([random_ids(300, seed=5)], chunk=50)
        for layer in s.cache.layers:
            assert round(float(layer.mass().sum())) == 300 * 2, name  # 2 KV heads
            assert layer.entries <= kvmerge.get_method(name, budget=0.25, window=8).target(300) or name == "semanticache"


@pytest.mark.parametrize("name", CHUNKED)
def test_ragged_batch_chunked_equals_one_at_a_time(name):
    model = tiny_model()
    m = kvmerge.get_method(name, budget=0.3, window=8)
    ctx, qs = [random_ids(200, seed=6), random_ids(130, seed=7)], [[3, 4], [5]]
    tok = TinyTokenizer()
    batch = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=6, tokenizer=tok, prefill_chunk=48)
    alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=6, tokenizer=tok, prefill_chunk=48).tokens[0]
             for c, q in zip(ctx, qs)]
    assert batch.tokens == alone


def test_bad_chunks_and_unsupported_methods_get_clear_errors():
    model = tiny_model()
    ctx = random_ids(200)
    snap = kvmerge.get_method("snapkv", budget=0.25, window=8)
    for chunk in (0, -3, 2.5):
        with pytest.raises(ValueError, match="positive number of tokens"):
            kvmerge.generate_ids(model, ctx, [3], snap, prefill_chunk=chunk)
    with pytest.raises(ValueError, match=r"10 is below the protected sinks \+ window \(4 \+ 8\)"):
        kvmerge.generate_ids(model, ctx, [3], snap, prefill_chunk=10)
    with pytest.raises(ValueError, match="below the protected sinks"):
        kvmerge.get_method("snapkv", budget=10, window=8)


def _surprisal_seen(chunk):
    """The surprisal the last compression of a `budget=1.0` surprisal prefill was given."""
    s = kvmerge.Session(tiny_model(), 2, kvmerge.get_method("surprisal", budget=1.0, window=8), TinyTokenizer())
    given = []
    compress = s.compress
    s.compress = lambda rows, window=None, surprisal=None, running=False, room=0: (
        given.append(surprisal), compress(rows, window, surprisal, running, room))
    with torch.no_grad():
        s.prefill([random_ids(150, seed=8), random_ids(97, seed=9)], chunk=chunk)
    return given[-1]


def test_chunked_surprisal_is_each_tokens_surprisal_given_everything_before_it():
    """Nothing compressed (budget 1.0): chunk by chunk, every token's surprisal (a chunk's first
    token's from the previous chunk's logits) equals the one-shot prefill's."""
    one_shot = _surprisal_seen(None)
    for chunk in (16, 40):
        assert torch.allclose(_surprisal_seen(chunk), one_shot, atol=1e-4)


def test_chunked_surprisal_keeps_each_entry_with_the_score_it_was_kept_with():
    model = tiny_model()
    m = kvmerge.get_method("surprisal", budget=0.25, window=8)
    s = kvmerge.Session(model, 1, m, TinyTokenizer())
    with torch.no_grad():
        s.prefill([random_ids(300, seed=10)], chunk=50)
    for i in s.cache.compressible:
        carried = s.states[i].scratch["surprisal"][0]
        assert carried.shape == s.cache.layers[i].keys.shape[1:3]  # one score per kept entry and head
        assert torch.equal(carried, s.states[s.cache.compressible[0]].scratch["surprisal"][0])  # same in every layer
