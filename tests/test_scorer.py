"""The learned scorer behind `learnedzip`: its features are the layer's own pre-RoPE projections, its
fit is ridge regression, its weights round-trip, and a model without weights is told how to train."""

import pytest
import torch

import kvmerge
from kvmerge.scorer import LinearScorer, features, find, fingerprint, unrotate
from kvmerge.train_scorer import examples, fit, overlap

from .conftest import TinyTokenizer, random_ids, tiny_model


def test_features_are_the_layers_own_projections_before_rope():
    """Un-rotating the captured queries and cached keys gives q_proj / k_proj of the attention's input
    (an independent computation from the model's weights), so the scorer reads what any runtime can."""
    model = tiny_model()
    ids = random_ids(40, seed=2)
    inputs = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, a, kw, i=i: inputs.__setitem__(i, kw["hidden_states"]), with_kwargs=True)
        for i, layer in enumerate(model.model.layers)]
    session = kvmerge.Session(model, 1)
    with torch.no_grad():
        session.feed_prompt([ids], capture=-1)
    for h in hooks:
        h.remove()
    cos, sin = session.runtime.rotary(torch.arange(40))
    for i, layer in enumerate(model.model.layers):
        attn, x = layer.self_attn, inputs[i][0]
        q = attn.q_proj(x).view(40, -1, 16).transpose(0, 1)
        k = attn.k_proj(x).view(40, -1, 16).transpose(0, 1)
        torch.testing.assert_close(unrotate(session.states[i].queries[0], cos, sin), q, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(unrotate(session.cache.layers[i].keys[0], cos, sin), k, rtol=1e-4, atol=1e-5)
        got = features(q[None], k[None], session.cache.layers[i].values)[0]
        assert got.shape == (40, (4 + 2 + 2) * 16)


def test_ridge_fit_equals_a_direct_solve_and_examples_align_with_kvzip():
    model, tok = tiny_model(), TinyTokenizer()
    rows = examples(model, tok, random_ids(120, seed=3))
    assert len(rows) == 2 and all(x.shape == (120, 128) and y.shape == (120, 2) for x, y in rows)
    x, y = rows[0]
    assert bool((y <= 0).all()) and bool(torch.isfinite(y).all())  # logs of attention probabilities
    x1 = torch.cat([x, torch.ones(120, 1)], 1).double()
    (w,) = fit([(x1.T @ x1, x1.T @ y.double())], 1e-2)
    reg = torch.eye(129, dtype=torch.float64) * 1e-2 * (x1.T @ x1).diagonal()[:-1].mean()
    reg[-1, -1] = 0
    direct = torch.linalg.lstsq(torch.cat([x1, reg.sqrt()]), torch.cat([y.double(), torch.zeros(129, 2,
                                                                                         dtype=torch.float64)])).solution
    torch.testing.assert_close(w.double(), direct, rtol=1e-3, atol=1e-4)


def test_weights_round_trip_and_predictions_are_log_probabilities(tmp_path):
    g = torch.Generator().manual_seed(1)
    scorer = LinearScorer([torch.randn(129, 2, generator=g) for _ in range(2)], "abc", {"texts": 3})
    scorer.save(tmp_path / "s.safetensors")
    back = LinearScorer.load(tmp_path / "s.safetensors")
    assert back.model == "abc" and back.meta == {"texts": 3}
    assert all(torch.equal(a, b) for a, b in zip(scorer.weights, back.weights))
    q, k, v = torch.randn(1, 4, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16)
    out = back.predict(1, q, k, v)
    assert out.shape == (1, 2, 10) and bool((out <= 0).all())


def test_overlap_counts_shared_top_entries():
    a = torch.tensor([[4.0, 3, 2, 1]])
    assert overlap(a, a, 0.5) == 1.0 and overlap(a, -a, 0.5) == 0.0 and overlap(a, torch.tensor([[4.0, 1, 3, 2]]), 0.5) == 0.5


def test_a_model_without_weights_is_told_how_to_train_them():
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="kvmerge train-scorer --model"):
        find(model.config)
    with pytest.raises(ValueError, match="kvmerge train-scorer"):
        kvmerge.generate_ids(model, random_ids(100), [3], kvmerge.get_method("learnedzip", window=8),
                             max_new_tokens=1)


def test_bundled_weights_match_their_model_when_present():
    """The weights shipped for SmolLM2 name its fingerprint (so `find` picks them), one matrix per layer."""
    from kvmerge.scorer import SHIPPED

    path = SHIPPED / "smollm2-135m.safetensors"
    if not path.exists():
        pytest.skip("no shipped weights")
    scorer = LinearScorer.load(path)
    assert len(scorer.weights) == 30 and scorer.weights[0].shape == ((9 + 3 + 3) * 64 + 1, 3)
    assert scorer.meta["top25_overlap"] > 0.5
    from kvmerge.model import cache_dir

    folder = cache_dir() / "smollm2-135m"
    if (folder / "config.json").exists():
        from transformers import AutoConfig

        assert scorer.model == fingerprint(AutoConfig.from_pretrained(folder))
