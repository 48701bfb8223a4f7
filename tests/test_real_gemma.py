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
