"""The learned scorer behind `learnedzip`: its features are the layer's own pre-RoPE projections, its
fit is ridge regression, its weights round-trip, and a model without weights is told how to train."""

import logging
import os
import re

import pytest
import torch

import kvmerge
import kvmerge.scorer as scorer_module
from kvmerge.scorer import LinearScorer, MLPScorer, Scorer, features, find, fingerprint, locate, unrotate
from kvmerge.train_scorer import examples, fit, fit_mlp, overlap

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


def test_mlp_weights_round_trip_by_kind_and_compute_the_stated_network(tmp_path):
    g = torch.Generator().manual_seed(4)
    layers = [{"mu": torch.randn(128, generator=g), "sd": torch.rand(128, generator=g) + 0.5,
               "w1": torch.randn(128, 8, generator=g), "b1": torch.randn(8, generator=g),
               "w2": torch.randn(8, 2, generator=g), "b2": torch.randn(2, generator=g)} for _ in range(2)]
    MLPScorer(layers, "abc", {"hidden": 8}).save(tmp_path / "m.safetensors")
    back = Scorer.load(tmp_path / "m.safetensors")
    assert isinstance(back, MLPScorer) and back.model == "abc" and back.meta == {"hidden": 8}
    q, k, v = torch.randn(1, 4, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16)
    x = features(q, k, v)
    p = {n: t.half().float() for n, t in layers[1].items()}  # stored in float16
    direct = torch.nn.functional.gelu((x - p["mu"]) / p["sd"] @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    torch.testing.assert_close(back.predict(1, q, k, v), direct.clamp_max(0).transpose(1, 2))


def test_fit_mlp_is_reproducible_and_learns_what_a_ridge_cannot():
    """On y = −|x·a| (no linear signal), the MLP's held-out error is well below the ridge's; the same
    seed gives the same weights."""
    g = torch.Generator().manual_seed(5)
    a = torch.randn(16, generator=g)
    x = torch.randn(6000, 16, generator=g)
    y = -(x @ a).abs()[:, None] / 4
    train, test = slice(0, 5000), slice(5000, None)
    layers = fit_mlp([(x[train], y[train])], hidden=32, epochs=60, seed=0)
    mlp = MLPScorer(layers, "abc", {})
    x1 = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    ridge = LinearScorer(fit([(x1[train].T @ x1[train], x1[train].T @ y[train].double())], 1e-2), "abc", {})
    err = {name: float(((s.from_features(0, x[test]) - y[test]) ** 2).mean()) for name, s in (("mlp", mlp), ("ridge", ridge))}
    assert err["mlp"] < 0.25 * err["ridge"], err
    once, again = (fit_mlp([(x[:1024], y[:1024])], hidden=8, epochs=2, seed=0) for _ in range(2))
    assert all(torch.equal(once[0][n], again[0][n]) for n in once[0])


def test_overlap_counts_shared_top_entries():
    a = torch.tensor([[4.0, 3, 2, 1]])
    assert overlap(a, a, 0.5) == 1.0 and overlap(a, -a, 0.5) == 0.0 and overlap(a, torch.tensor([[4.0, 1, 3, 2]]), 0.5) == 0.5


def test_a_model_without_weights_is_told_how_to_train_them():
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="kvmerge train-scorer --model"):
        find(model.config)
    with pytest.raises(ValueError, match="--kind mlp"):
        find(model.config, "mlp")
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


@pytest.mark.parametrize("name,layers,features,heads", [("smollm2-135m", 30, (9 + 3 + 3) * 64, 3),
                                                        ("gemma3-270m", 3, (4 + 1 + 1) * 256, 1)])
def test_bundled_mlp_weights_are_mlps_of_their_models_shape(name, layers, features, heads):
    from kvmerge.scorer import SHIPPED

    path = SHIPPED / f"{name}-mlp.safetensors"
    if not path.exists():
        pytest.skip("no shipped MLP weights")
    scorer = Scorer.load(path)
    assert isinstance(scorer, MLPScorer) and len(scorer.layers) == layers
    assert scorer.layers[0]["w1"].shape == (features, scorer.meta["hidden"]) and scorer.layers[0]["b2"].shape == (heads,)
    assert scorer.meta["top25_overlap"] > 0.55


@pytest.mark.parametrize("kind", ["linear", "mlp"])
def test_train_fits_either_kind_and_reports_its_agreement(kind, monkeypatch):
    """`kvmerge train-scorer`'s function end to end on a tiny model (the corpus replaced by a few texts)."""
    import kvmerge.train_scorer as ts

    monkeypatch.setattr(ts, "corpus", lambda: ["".join(chr(97 + (7 * i + j) % 26) for i in range(400)) for j in range(6)])
    scorer = ts.train(tiny_model(), TinyTokenizer(), texts=3, held=1, length=96, kind=kind, hidden=4, epochs=2,
                      rows_per_text=32)
    assert scorer.kind == kind and scorer.meta["texts"] == 3 and 0.0 <= scorer.meta["top25_overlap"] <= 1.0
    q, k, v = torch.randn(1, 4, 10, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 10, 16)
    assert scorer.predict(0, q, k, v).shape == (1, 2, 10)


def _weights_for(model, seed=0) -> LinearScorer:
    """Random linear weights of the right shapes for `model`."""
    from kvmerge.scorer import model_shape

    layers, size, heads = model_shape(model.config)
    g = torch.Generator().manual_seed(seed)
    return LinearScorer([torch.randn(size + 1, heads, generator=g) * 0.1 for _ in range(layers)],
                        fingerprint(model.config), {"model_name": "tiny-a"})


def test_weights_made_for_another_model_are_refused_naming_both(tmp_path, monkeypatch):
    """A file at this model's place (`trained_path`, named by its fingerprint) or loaded for it whose
    metadata names another model is refused with both models' fingerprints and shapes, before a forward."""
    from kvmerge.scorer import trained_path

    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path))
    other = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    theirs = _weights_for(tiny_model())
    path = trained_path(other.config)
    theirs.save(path)
    a, b = fingerprint(tiny_model().config), fingerprint(other.config)
    expected = (rf"scorer weights {path} were made for another model \(tiny-a, fingerprint {a}, 2 layers of 128 "
                rf"features to 2 KV heads\), not for this one \(fingerprint {b}, 2 layers of 64 features to "
                r"1 KV heads\): train this model's with `kvmerge train-scorer --model PATH`")  # built in memory: no name
    with pytest.raises(kvmerge.KVMergeError, match=expected):
        find(other.config)
    with pytest.raises(kvmerge.KVMergeError, match=expected):
        Scorer.load(path, other.config)
    calls = []
    hook = other.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(kvmerge.KVMergeError, match="were made for another model"):
        kvmerge.generate_ids(other, random_ids(100), [3], kvmerge.get_method("learnedzip", window=8), max_new_tokens=1)
    hook.remove()
    assert calls == []  # refused before the model ran


def test_weights_naming_this_model_with_other_shapes_are_refused(tmp_path, monkeypatch):
    """Same fingerprint, other shapes (a file edited or written by hand): refused, both shapes named."""
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    wrong = LinearScorer([torch.zeros(65, 1) for _ in range(3)], fingerprint(model.config), {})
    wrong.save(tmp_path / "w.safetensors")
    monkeypatch.setenv("KVMERGE_SCORERS", str(tmp_path))
    with pytest.raises(kvmerge.KVMergeError, match=r"were made for another model \(fingerprint \w+, 3 layers of 64 "
                       r"features to 1 KV heads\), not for this one \(fingerprint \w+, 2 layers of 64"):
        find(model.config)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_truncated_or_corrupt_weights_file_is_refused_naming_it(tmp_path, monkeypatch, caplog, damage):
    """Loaded directly, a damaged file is refused naming it; among the files searched, it is skipped
    with one logged line, and other models' weights are still found."""
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "w.safetensors"
    _weights_for(model).save(path)
    data = path.read_bytes()
    path.write_bytes({"truncated": data[:len(data) // 2], "garbage": b"not weights at all " * 20, "empty": b""}[damage])
    message = (rf"scorer weights {path} are truncated or corrupt, not a whole safetensors file \([^)]*\): delete the "
               r"file and train them again with `kvmerge train-scorer --model <the model>`$")
    with pytest.raises(kvmerge.KVMergeError, match=message):
        Scorer.load(path)
    good = tmp_path / "good"
    good.mkdir()
    _weights_for(model).save(good / "z.safetensors")  # a whole file in a later folder is still found
    monkeypatch.setenv("KVMERGE_SCORERS", f"{tmp_path}{os.pathsep}{good}")
    monkeypatch.setattr(scorer_module, "_skipped", set())
    with caplog.at_level(logging.WARNING, logger="kvmerge"):
        assert locate(model.config) == good / "z.safetensors"
        assert locate(model.config) == good / "z.safetensors"
    said = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 1 and re.search(message.removesuffix("$"), said[0]), said


def test_weights_without_kvmerge_metadata_are_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(kvmerge.KVMergeError, match=rf"scorer weights {tmp_path / 'x.safetensors'} name no model in "
                       r"their metadata: not a file `kvmerge train-scorer` wrote"):
        Scorer.load(tmp_path / "x.safetensors")
    save_file({"layer0": torch.zeros(3, 2), "layer1": torch.zeros(4, 2)}, str(tmp_path / "y.safetensors"),
              metadata={"model": "abc", "kind": "linear", "meta": "{}"})
    with pytest.raises(kvmerge.KVMergeError, match=r"y.safetensors are incomplete or corrupt \(ValueError: layer "
                       r"weights of shapes"):
        Scorer.load(tmp_path / "y.safetensors")


@pytest.mark.parametrize("damage", ["b1", "sd", "calibration"])
def test_weights_whose_parts_do_not_chain_are_refused_at_load(tmp_path, damage):
    """Every part of an MLP layer and a calibration's quantiles are checked when the file loads, not
    when a compression first uses them."""
    from safetensors.torch import load_file, save_file

    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    layers, features_, heads = scorer_module.model_shape(model.config)
    mlp = MLPScorer([{"mu": torch.zeros(features_), "sd": torch.ones(features_), "w1": torch.zeros(features_, 4),
                      "b1": torch.zeros(4), "w2": torch.zeros(4, heads), "b2": torch.zeros(heads)}
                     for _ in range(layers)], fingerprint(model.config), {})
    mlp.calibration = (torch.zeros(layers, heads, 3), torch.zeros(layers, heads, 3))
    mlp.save(tmp_path / "w.safetensors")
    assert Scorer.load(tmp_path / "w.safetensors", model.config).shape() == (layers, features_, heads)
    tensors = load_file(str(tmp_path / "w.safetensors"))
    if damage == "calibration":  # one quantile: nothing to map between
        tensors.update({f"calibration.{k}": torch.zeros(layers, heads, 1) for k in "xy"})
    else:
        tensors[f"layer0.{damage}"] = torch.zeros(tensors[f"layer0.{damage}"].shape[0] + 1)
    save_file(tensors, str(tmp_path / "bad.safetensors"), metadata={"model": mlp.model, "kind": "mlp", "meta": "{}"})
    with pytest.raises(kvmerge.KVMergeError, match=r"bad.safetensors are incomplete or corrupt \(ValueError: "):
        Scorer.load(tmp_path / "bad.safetensors", model.config)


def test_weights_this_process_cannot_read_are_named_so_not_corrupt(tmp_path, monkeypatch):
    """(A file without read permission, as a non-root user meets it: root reads any file.)"""
    import safetensors

    path = tmp_path / "w.safetensors"
    _weights_for(tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)).save(path)

    def unreadable(name, framework):
        raise PermissionError(13, "Permission denied", name)

    monkeypatch.setattr(safetensors, "safe_open", unreadable)
    with pytest.raises(kvmerge.KVMergeError, match=rf"^cannot read the scorer weights {path} \(.*Permission denied"):
        Scorer.load(path)


def test_saving_weights_leaves_nothing_half_written(tmp_path, monkeypatch):
    """A save that fails mid-write leaves neither a partial file nor its temporary beside it; an old
    file at the place is kept whole."""
    import safetensors.torch

    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "w.safetensors"
    _weights_for(model, seed=1).save(path)
    before = path.read_bytes()

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        _weights_for(model, seed=2).save(path)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]


def test_calibration_keeps_each_heads_order_maps_quantiles_and_round_trips(tmp_path):
    """A rank-fitted scorer's outputs go through a monotone map per layer and head: each head's order is
    unchanged, its output quantiles land on KVzip's, and the map is saved with the weights."""
    import os

    g = torch.Generator().manual_seed(3)
    scorer = LinearScorer([torch.randn(129, 2, generator=g) * 0.1 for _ in range(2)], "abc", {})
    levels = torch.linspace(0, 1, 5)
    xs = torch.stack([torch.stack([levels, levels * 2]) for _ in range(2)])  # (2 layers, 2 heads, 5)
    ys = torch.stack([torch.stack([levels * 10 - 20, levels * 3 - 5]) for _ in range(2)])
    scorer.calibration = (xs, ys)
    p = torch.tensor([[0.0, 0.0], [0.5, 1.0], [1.0, 2.0], [0.3, 1.5], [-1.0, -1.0]])  # (n, h)
    out = scorer.calibrated(1, p)
    torch.testing.assert_close(out[:3], torch.tensor([[-20.0, -5.0], [-15.0, -3.5], [-10.0, -2.0]]))
    assert out[4].tolist() == [-20.0, -5.0]  # below the lowest quantile: the lowest score
    assert scorer.calibrated(1, torch.tensor([[9.0, 9.0]])).tolist() == [[-10.0, -2.0]]  # above: the highest
    for h in range(2):  # monotone: the head's order is the model's
        assert torch.equal(out[:4, h].argsort(), p[:4, h].argsort())
    scorer.save(tmp_path / "c.safetensors")
    back = Scorer.load(tmp_path / "c.safetensors")
    assert torch.equal(back.calibration[0], xs) and torch.equal(back.calibration[1], ys)
    q, k, v = torch.randn(1, 4, 10, 16, generator=g), torch.randn(1, 2, 10, 16, generator=g), torch.randn(1, 2, 10, 16)
    torch.testing.assert_close(back.predict(0, q, k, v), scorer.predict(0, q, k, v))
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "c.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # as any file the user writes


def test_rank_target_is_each_heads_order_to_the_fourth_power():
    from kvmerge.train_scorer import fitted_target

    y = torch.tensor([[-3.0, 0.0], [-1.0, -2.0], [-2.0, -1.0]])
    assert fitted_target(y, "log") is y
    torch.testing.assert_close(fitted_target(y, "rank"), torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0625, 0.0625]]))


def test_train_to_ranks_calibrates_onto_kvzips_scores(monkeypatch):
    import kvmerge.train_scorer as ts

    monkeypatch.setattr(ts, "corpus", lambda: ["".join(chr(97 + (7 * i + j) % 26) for i in range(400)) for j in range(6)])
    scorer = ts.train(tiny_model(), TinyTokenizer(), texts=3, held=1, length=96, kind="mlp", hidden=4, epochs=2,
                      rows_per_text=32, target="rank")
    xs, ys = scorer.calibration
    assert scorer.meta["target"] == "rank" and xs.shape == ys.shape == (2, 2, ts.LEVELS)
    assert bool((xs.diff(dim=-1) >= 0).all()) and bool((ys.diff(dim=-1) >= 0).all()) and bool((ys <= 0).all())


def test_training_refuses_what_it_cannot_train_on_before_any_piece(monkeypatch):
    import kvmerge.train_scorer as ts
    from kvmerge.errors import InputError

    monkeypatch.setattr(ts, "examples", lambda *a: pytest.fail("a piece ran"))
    with pytest.raises(InputError, match="too short to train on: --length 64 at least"):
        ts.train(tiny_model(), TinyTokenizer(), length=40)
    with pytest.raises(InputError, match="need 7,112 positions .* beyond the model's 4,096: --length 2016 at most"):
        ts.train(tiny_model(), TinyTokenizer(), length=5000)
    ts.check_trainable(tiny_model(), 0, 2016)  # the length named fits exactly: one more does not
    with pytest.raises(InputError, match="--length 2016 at most"):
        ts.check_trainable(tiny_model(), 0, 2017)
    assert ts.piece_length(tiny_model(), 0, None) == 1024  # the default where it fits
    small = tiny_model(max_position_embeddings=512)
    assert ts.piece_length(small, 7, None) == ts.longest_fitting(7, 512) == 220  # else the longest that fits
    ts.check_trainable(small, 7, 220)
    with pytest.raises(InputError, match="--length 220 at most"):
        ts.check_trainable(small, 7, 221)
    with pytest.raises(InputError, match="ridge penalty must be >= 0"):
        ts.train(tiny_model(), TinyTokenizer(), ridge=-1)
    monkeypatch.setattr(ts, "corpus", lambda: ["abcdefghij" * 40])
    with pytest.raises(InputError, match="only 4 pieces of 96 tokens .* 106 needed: lower --length, --texts or --held"):
        ts.train(tiny_model(), TinyTokenizer(), length=96)
    every = tiny_model(sliding_window=16, layer_types=["sliding_attention", "sliding_attention"])
    with pytest.raises(InputError, match="sliding-window layers only.*no scorer to train"):
        ts.train(every, TinyTokenizer())


def test_other_programs_safetensors_in_a_scorer_folder_are_passed_over(tmp_path, monkeypatch):
    """A folder of `$KVMERGE_SCORERS` may hold a model's own weights (model.safetensors): finding the
    scorer passes over files that name no model, and still finds the one that does."""
    from safetensors.torch import save_file

    from kvmerge.scorer import locate

    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVMERGE_SCORERS", str(tmp_path))
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a-model.safetensors"))
    assert locate(model.config) is None
    _weights_for(model).save(tmp_path / "z.safetensors")
    assert locate(model.config) == tmp_path / "z.safetensors"


def test_the_fingerprint_tells_layer_layouts_apart_and_accepts_files_from_before_it_did(tmp_path):
    """Two models of one type and shapes whose layers attend differently (sliding windows) get their own
    fingerprints, so their weights and contexts are kept apart; weights and contexts written when the
    fingerprint held the shapes only still load (their shapes checked)."""
    import copy

    from kvmerge.scorer import fingerprints

    from .test_context import _tamper
    from .test_hybrid import gemma3

    model = gemma3()
    full = copy.deepcopy(model.config)
    full.layer_types = ["full_attention"] * full.num_hidden_layers
    (now, before), (only,) = fingerprints(model.config), fingerprints(full)
    assert now != before == only  # the shapes alone could not tell them apart
    assert fingerprints(tiny_model().config) == (fingerprint(tiny_model().config),)  # full attention: unchanged
    old = find(model.config)
    old.model = before
    old.save(tmp_path / "old.safetensors")
    assert Scorer.load(tmp_path / "old.safetensors", model.config).model == before
    ctx = kvmerge.compress_context(model, TinyTokenizer(), random_ids(120, seed=1), "snapkv:window=8", 0.25)
    assert ctx.meta["model"] == now
    path = _tamper(ctx.save(tmp_path / "c.kvz"), tmp_path / "old.kvz", lambda t, m: m.update(model=before), True)
    assert kvmerge.load_context(path, model, TinyTokenizer()).tokens == 120


def test_a_full_attention_models_weights_under_the_old_fingerprint_do_not_hide_a_sliding_models(tmp_path,
                                                                                                  monkeypatch):
    """The fingerprint before layer windows counted is a full-attention model's of the same shapes now: its
    weights trained here are passed over for the sliding model, whose own weights are still found."""
    import copy

    from kvmerge.scorer import model_shape, trained_path

    from .test_hybrid import gemma3

    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path))
    model = gemma3()
    full = copy.deepcopy(model.config)
    full.layer_types = ["full_attention"] * full.num_hidden_layers
    layers, features_, heads = model_shape(full)
    theirs = LinearScorer([torch.zeros(features_ + 1, heads) for _ in range(layers)], fingerprint(full), {})
    theirs.save(trained_path(full))
    assert locate(full) == trained_path(full)
    assert locate(model.config) not in (None, trained_path(full))
    assert find(model.config).shape() == model_shape(model.config) != model_shape(full)


def test_the_training_text_is_pythons_own_library_wherever_python_lives(tmp_path, monkeypatch):
    """Modules installed into Python's own site-packages are not read (a `pip install` would change the
    pieces and their shuffle), nor are its tests; a Python under a folder named like a test is read."""
    import kvmerge.train_scorer as ts

    stdlib = tmp_path / "envs" / "test" / "lib" / "python3"
    text = '"""' + "A sentence of documentation that is long enough. " * 80 + '"""\n'
    for name in ("os.py", "shelve.py", "json/decoder.py", "unittest/case.py", "site-packages/extra.py"):
        (stdlib / name).parent.mkdir(parents=True, exist_ok=True)
        (stdlib / name).write_text(text.replace("A sentence", name))
    monkeypatch.setattr(ts.os, "__file__", str(stdlib / "os.py"))
    monkeypatch.setattr(ts, "PERL_PODS", ())
    assert [t.split(" of ")[0] for t in ts.corpus()] == ["json/decoder.py", "os.py", "shelve.py"]


def test_kvmerge_scorers_may_name_a_weights_file_and_a_missing_entry_is_said_once(tmp_path, monkeypatch, caplog):
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    path = tmp_path / "mine.safetensors"
    _weights_for(model).save(path)
    missing = tmp_path / "nowhere"
    monkeypatch.setenv("KVMERGE_SCORERS", f"{missing}{os.pathsep}{path}")
    monkeypatch.setattr(scorer_module, "_skipped", set())
    with caplog.at_level("WARNING", logger="kvmerge"):
        assert scorer_module.locate(model.config) == path
        assert scorer_module.locate(model.config) == path
    told = [r.getMessage() for r in caplog.records if "KVMERGE_SCORERS" in r.getMessage()]
    assert told == [f"kvmerge: KVMERGE_SCORERS names {missing}, which is not a folder or a file: skipped"]


def test_two_weights_files_for_one_model_in_the_folders_searched_are_said_naming_the_one_read(tmp_path, monkeypatch,
                                                                                              caplog):
    model = tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    first, second = tmp_path / "a", tmp_path / "b"
    for folder in (first, second):
        folder.mkdir()
        _weights_for(model).save(folder / "w.safetensors")
    monkeypatch.setenv("KVMERGE_SCORERS", f"{second}{os.pathsep}{first}")
    monkeypatch.setattr(scorer_module, "_told", set())
    with caplog.at_level("WARNING", logger="kvmerge"):
        assert scorer_module.locate(model.config) == second / "w.safetensors"
        assert scorer_module.locate(model.config) == second / "w.safetensors"
    told = [r.getMessage() for r in caplog.records if "weights files for this model" in r.getMessage()]
    assert told == [f"kvmerge: 2 weights files for this model in $KVMERGE_SCORERS: {second / 'w.safetensors'} is read "
                    f"(the first in its order), not {first / 'w.safetensors'}"]
