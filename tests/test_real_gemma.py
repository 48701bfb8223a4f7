"""The bundled Gemma-3-270M (hybrid: 15 sliding-window layers of 512, 3 global). `ci_slow` ones run in CI."""

import pytest
import torch

import kvmerge

from .conftest import session_logits, stock_logits


@pytest.fixture(scope="module")
def gemma():
    return kvmerge.load_model("gemma3-270m")


@pytest.mark.ci_slow
def test_full_cache_equals_stock_beyond_the_sliding_window(gemma):
    model, tok = gemma
    ids = tok("The quick brown fox jumps over the lazy dog. " * 70)["input_ids"]
    assert len(ids) > 600  # beyond the 512-token window of the sliding layers
    ref = stock_logits(model, ids, 8)
    got, s = session_logits(model, ids, 8, method=kvmerge.get_method("full"), split=len(ids) - 8)
    assert torch.allclose(ref, got, atol=1e-3, rtol=1e-4)
    assert s.cache.compressible == [5, 11, 17] and s.cache.layers[0].entries == 511


@pytest.mark.ci_slow
def test_a_needle_is_found_with_the_full_cache_and_with_surprisemerge_at_a_quarter(gemma):
    from kvmerge_eval.niah import make_sample, score
    from kvmerge_eval.runner import prompt_ids

    model, tok = gemma
    s = make_sample(tok, 1500, depth=0.4, seed=5)
    ctx, q = prompt_ids(tok, s)
    for method in (kvmerge.get_method("full"), kvmerge.get_method("surprisemerge", budget=0.25)):
        out = kvmerge.generate_ids(model, ctx, q, method, max_new_tokens=8, tokenizer=tok)
        assert score(tok.decode(out.tokens[0], skip_special_tokens=True), s.answer) == 1.0, method.name
    assert out.stats["compressed_layers_bytes"] <= 0.26 * out.stats["compressed_layers_full_bytes"]


@pytest.mark.ci_slow
def test_zipguardmerge_evicts_in_gemmas_copy_heads_and_keeps_the_needle_merging_there_loses(gemma):
    """Gemma-3's global layers: in those whose KVzip scores saturate (copy heads) `zipguardmerge` keeps
    exactly `zipguard`'s eviction (same entries, log-mass 0); in the others it merges. A dev needle that
    merging into the copy heads turns into "1." (R21) is kept at 10%."""
    from kvmerge.decoding import cache_stats, decode
    from kvmerge_eval.niah import score
    from kvmerge_eval.runner import build_samples, prompt_ids
    from kvmerge_eval.shared import compressed_once

    model, tok = gemma
    s = build_samples("niah", tok, [2048], 10, text="docs")[3]
    ctx, q = prompt_ids(tok, s)
    caches, answers = {}, {}
    evicting = f"zipguard:alloc=head:fallback={kvmerge.get_method('zipguardmerge').base.fallback}"  # zipguardmerge's picks
    specs = ["zipguardmerge", evicting, "zipmerge:base=zipguard"]
    with torch.inference_mode():
        for spec, _b, session, _ in compressed_once(model, tok, [ctx], [(m, 0.1) for m in specs]):
            caches[spec] = {i: session.cache.layers[i].kv() for i in session.cache.compressible}
            first = session.forward([q], decoding=False)
            out = decode(session, first, dict(cache_stats(session, [ctx], "agnostic")), 8, tok.eos_token_id)
            answers[spec] = score(tok.decode(out.tokens[0], skip_special_tokens=True), s.answer)
    guarded = merged = 0
    for i, kv in caches["zipguardmerge"].items():
        evicted = caches[evicting][i]
        live = torch.isfinite(kv.log_n)
        if torch.equal(kv.keys, evicted.keys) and torch.allclose(kv.values, evicted.values, atol=1e-6) \
                and torch.allclose(kv.log_n[live], torch.zeros_like(kv.log_n[live]), atol=1e-6):
            guarded += 1
        else:
            assert torch.equal(kv.keys, evicted.keys)  # the same picks, values merged
            merged += 1
    assert guarded >= 1 and merged >= 1, (guarded, merged)
    assert answers == {"zipguardmerge": 1.0, evicting: 1.0, "zipmerge:base=zipguard": 0.0}


@pytest.mark.ci_slow
def test_the_sliding_share_moves_gemmas_local_slots_to_its_global_layers_in_the_same_bytes(gemma):
    """`sliding=0.5`: the 15 sliding layers hold their last 256 slots, the 15 × 255 freed go to the
    three global layers (1 KV head each), the cache's bytes stay SnapKV's own; with the trim alone the
    needle stays."""
    from kvmerge_eval.niah import make_sample, score
    from kvmerge_eval.runner import prompt_ids

    model, tok = gemma
    s = make_sample(tok, 1500, depth=0.4, seed=5)
    ctx, q = prompt_ids(tok, s)
    plain, shared = (kvmerge.generate_ids(model, ctx, q, kvmerge.get_method("snapkv", budget=0.1, **kw),
                                          max_new_tokens=8, tokenizer=tok) for kw in ({}, {"sliding": 0.5}))
    target = kvmerge.get_method("snapkv", budget=0.1).target(len(ctx))
    entries = shared.stats["cache_entries"]
    assert [entries[i] for i in (0, 4, 6)] == [256] * 3 and plain.stats["cache_entries"][0] == 511
    assert entries[5] == plain.stats["cache_entries"][5] + 15 * 255 // 3 == target + 1275
    assert shared.stats["cache_bytes"] == plain.stats["cache_bytes"]
    trimmed = kvmerge.generate_ids(model, ctx, q, kvmerge.get_method("full", sliding=0.5), max_new_tokens=8,
                                   tokenizer=tok)  # the trim alone: the global layers whole, the needle kept
    assert score(tok.decode(trimmed.tokens[0], skip_special_tokens=True), s.answer) == 1.0
