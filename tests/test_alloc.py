"""Global budget allocation (`alloc="layer"` / `"head"` / `"fit"`, KVzip's and AdaKV's): counts equal a brute-force
global top-k, every head keeps its own top entries, padding slots get no attention, budgets hold."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmerge
from kvmerge import Session
from kvmerge.ops.scores import global_counts, top_slots_per_head

from .conftest import TinyTokenizer, random_ids, tiny_model


def _brute_counts(scores, target, sinks, window):
    """Per (layer, row, head): protected slots plus its share of the row's global top unprotected scores."""
    L, (b, h, s) = len(scores), scores[0].shape
    prot = min(sinks + window, s)
    out = torch.zeros(L, b, h, dtype=torch.long)
    for r in range(b):
        cand = [(float(scores[l][r, j, i]), l, j) for l in range(L) for j in range(h)
                for i in range(s) if sinks <= i < s - window]
        cand.sort(key=lambda c: -c[0])
        for _, l, j in cand[:L * h * max(min(target, s) - prot, 0)]:
            out[l, r, j] += 1
    return out + prot


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 4), h=st.integers(1, 3), s=st.integers(8, 40), frac=st.floats(0.2, 1.0), seed=st.integers(0, 99))
def test_global_counts_equal_a_brute_force_global_top_k(L, h, s, frac, seed):
    g = torch.Generator().manual_seed(seed)
    scores = [torch.rand(2, h, s, generator=g) * (l + 1) for l in range(L)]  # distinct values: no ties
    sinks, window = 2, 3
    target = max(int(frac * s), sinks + window)
    heads = global_counts(scores, target, sinks, window, "head")
    assert torch.equal(heads, _brute_counts(scores, target, sinks, window))
    layers = global_counts(scores, target, sinks, window, "layer")
    assert (layers == layers[..., :1]).all()  # one count per layer and row
    assert (layers.sum((0, 2)) <= L * h * target).all() and (layers.sum((0, 2)) > L * h * target - h * L).all()
    assert (layers >= sinks + window).all() and (layers <= s).all()
    # each layer's count is its heads' total evened out: within one entry of the mean
    assert ((layers[..., 0] - heads.sum(-1).float() / h).abs() <= 1).all()


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 4), h=st.integers(1, 3), s=st.integers(8, 40), frac=st.floats(0.2, 1.0), seed=st.integers(0, 99))
def test_fitted_widths_are_the_longest_global_prefix_whose_padded_layers_fit(L, h, s, frac, seed):
    """alloc="fit": walk the global ranking one entry at a time; stop before the first entry that would
    widen some layer past the budget of L·target slots per head. Each layer keeps its widest head's count."""
    g = torch.Generator().manual_seed(seed)
    scores = [torch.rand(2, h, s, generator=g) * (l + 1) for l in range(L)]
    sinks, window = 2, 3
    target = max(int(frac * s), sinks + window)
    fit = global_counts(scores, target, sinks, window, "fit")
    assert (fit == fit[..., :1]).all()  # one width per layer and row: no padding
    assert (fit[..., 0].sum(0) <= L * min(target, s)).all()
    for r in range(2):
        cand = sorted(((float(scores[l][r, j, i]), l, j) for l in range(L) for j in range(h)
                       for i in range(s) if sinks <= i < s - window), key=lambda c: -c[0])
        counts = torch.full((L, h), sinks + window)
        for _, l, j in cand:
            counts[l, j] += 1
            if int(counts.amax(-1).sum()) > L * min(target, s):
                counts[l, j] -= 1
                break
        assert torch.equal(fit[:, r, 0], counts.amax(-1))


def test_top_slots_per_head_keeps_each_heads_own_top_entries_in_order():
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(2, 3, 30, generator=g)
    counts = torch.tensor([[6, 12, 9], [30, 5, 7]])
    idx, filler = top_slots_per_head(scores, counts, 2, 3)
    assert idx.shape == (2, 3, 30)
    for b in range(2):
        for j in range(3):
            kept = idx[b, j][~filler[b, j]].tolist()
            assert idx[b, j].tolist() == sorted(idx[b, j].tolist()) and len(kept) == counts[b, j]
            assert idx[b, j, -3:].tolist() == [27, 28, 29] and not filler[b, j, -3:].any()  # the window last
            rest = sorted(range(2, 27), key=lambda i: -float(scores[b, j, i]))[:counts[b, j] - 5]
            assert set(kept) == {0, 1, 27, 28, 29} | set(rest)


def _compressed(model, spec, n=160):
    method = kvmerge.method_from_spec(spec, 0.25) if isinstance(spec, str) else spec
    session = Session(model, 1, method, TinyTokenizer())
    logits = session.prefill([random_ids(n, seed=3)], method.window)
    return method, session, logits


@pytest.mark.parametrize("spec", ["snapkv:alloc=head:window=8", "kvzip:alloc=head:window=8:chunk=64",
                                  "expected_attention:alloc=head:window=8",
                                  "evictmerge:base=kvzip:alloc=head:recent=0:window=8"])
def test_per_head_allocation_meets_the_budget_and_its_padding_gets_no_attention(spec):
    model = tiny_model(num_hidden_layers=3)
    method, session, _ = _compressed(model, spec)
    layers = [session.cache.layers[i] for i in session.cache.compressible]
    live = torch.stack([(~torch.isinf(layer.full_log_n())).sum(-1) for layer in layers])  # (L, b, h)
    assert int(live.sum()) == len(layers) * live.shape[-1] * method.target(160)  # the global budget, exactly
    assert (live >= method.sinks + method.window).all()
    assert len({int(x) for x in live.flatten()}) > 1  # the counts do differ
    widths = [layer.entries for layer in layers]
    assert all(w == int(c.max()) for w, c in zip(widths, live))  # each layer padded to its largest head
    before = session.forward([[7, 8, 9]])
    _, again, _ = _compressed(model, spec)  # the same compression; its padding slots scrambled
    scrambled = 0
    for layer in [again.cache.layers[i] for i in again.cache.compressible]:
        empty = torch.isinf(layer.full_log_n())
        scrambled += int(empty.sum())
        layer.keys[empty] = 50.0
        layer.values[empty] = -50.0
    assert scrambled
    after = again.forward([[7, 8, 9]])
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["snapkv:alloc=layer:window=8", "snapkv:alloc=fit:window=8",
                                  "kvzip:alloc=fit:window=8:chunk=64", "zipmerge:alloc=fit:window=8"])
def test_per_layer_and_fitted_allocation_pad_nothing_and_keep_the_uniform_bytes(spec):
    model = tiny_model(num_hidden_layers=3)
    _, uniform, _ = _compressed(model, spec.replace("alloc=layer", "alloc=uniform").replace("alloc=fit", "alloc=uniform"))
    method, layered, _ = _compressed(model, spec)
    assert layered.cache.allocated_bytes <= uniform.cache.allocated_bytes
    entries = [layered.cache.layers[i].entries for i in layered.cache.compressible]
    assert len(set(entries)) > 1  # layers differ
    assert all(not torch.isinf(layered.cache.layers[i].full_log_n()).any() for i in layered.cache.compressible)
    assert sum(entries) <= sum(uniform.cache.layers[i].entries for i in uniform.cache.compressible)
    assert sum(entries) > len(entries) * (method.target(160) - 1)


def test_global_allocation_greedy_generation_runs_and_refuses_what_it_cannot_do():
    model = tiny_model()
    m = kvmerge.get_method("kvzip", budget=0.25, window=8, chunk=64, alloc="layer")
    out = kvmerge.generate_ids(model, random_ids(160, seed=1), [3, 4], m, max_new_tokens=4, tokenizer=TinyTokenizer())
    assert len(out.tokens[0]) == 4
    with pytest.raises(ValueError, match="one-shot compression"):
        kvmerge.generate_ids(model, random_ids(300, seed=1), [3], kvmerge.get_method("snapkv", alloc="head", window=8),
                             max_new_tokens=2, prefill_chunk=128)
    with pytest.raises(ValueError, match="rows without padding"):
        kvmerge.generate_ids(model, [random_ids(160, seed=1), random_ids(120, seed=2)], [[3], [4]],
                             kvmerge.get_method("snapkv", alloc="head", window=8), max_new_tokens=2)
    with pytest.raises(ValueError, match="set recent=0 and exact=0"):  # a fixed per-head share bypasses alloc
        kvmerge.method_from_spec("evictmerge:alloc=head", 0.25)
    for spec in ("mergingpress:alloc=head", "pyramidkv:alloc=layer"):  # merging otherwise, or budgets of its own
        with pytest.raises(ValueError, match="applies to methods that keep their highest-scored"):
            kvmerge.generate_ids(model, random_ids(160, seed=1), [3], kvmerge.method_from_spec(spec + ":window=8", 0.25),
                                 max_new_tokens=2)
    for name in ("evictmerge", "surprisemerge", "d2o"):  # a base's alloc would be ignored: refused
        with pytest.raises(ValueError, match="alloc='head' would be ignored"):
            kvmerge.get_method(name, base=kvmerge.get_method("snapkv", alloc="head"))
    with pytest.raises(ValueError, match="alloc must be one of uniform, layer, head, fit"):
        kvmerge.method_from_spec("snapkv:alloc=global", 0.25)


def test_merging_with_per_head_allocation_keeps_the_same_picks_and_conserves_mass():
    """evictmerge with alloc=head keeps exactly the entries its base keeps with alloc=head (calibrated
    merging leaves kept keys as they are; only values and log-mass change), and with count weights every
    head's live slots hold all 160 tokens' mass (each evicted token joined a kept entry)."""
    model = tiny_model(num_hidden_layers=3)
    def merging(**kw):
        return kvmerge.get_method("evictmerge", budget=0.25, base=kvmerge.get_method("kvzip", window=8, chunk=64),
                                  alloc="head", recent=0.0, window=8, **kw)

    _, picked, _ = _compressed(model, "kvzip:alloc=head:window=8:chunk=64")
    _, merged, _ = _compressed(model, merging())
    _, counted, _ = _compressed(model, merging(calibrate=False))
    changed = 0
    for i in picked.cache.compressible:
        a, b, c = picked.cache.layers[i], merged.cache.layers[i], counted.cache.layers[i]
        live = ~torch.isinf(a.full_log_n())
        assert torch.equal(live, ~torch.isinf(b.full_log_n())) and torch.equal(live, ~torch.isinf(c.full_log_n()))
        assert torch.equal(a.keys[live], b.keys[live])  # the same picks, in the same slots
        changed += int((a.values[live] != b.values[live]).any(-1).sum())
        mass = c.full_log_n().exp().sum(-1)  # (b, h): empty slots add exp(-inf) = 0
        torch.testing.assert_close(mass, torch.full_like(mass, 160.0))
    assert changed  # and merging did change values


def test_zipmerge_is_kvzip_global_picks_with_evictmerge_merging_and_refuses_chunks():
    model = tiny_model(num_hidden_layers=3)
    kvzip = kvmerge.get_method("kvzip", window=8, chunk=64)
    _, named, _ = _compressed(model, kvmerge.get_method("zipmerge", budget=0.25, window=8, base=kvzip))
    _, spelled, _ = _compressed(model, kvmerge.get_method("evictmerge", budget=0.25, window=8, base=kvzip, alloc="head",
                                                          recent=0.0))
    for i in named.cache.compressible:
        a, b = named.cache.layers[i], spelled.cache.layers[i]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.full_log_n(), b.full_log_n())
    with pytest.raises(ValueError, match="one-shot compression"):
        kvmerge.generate_ids(model, random_ids(300, seed=1), [3], kvmerge.get_method("zipmerge", window=8),
                             max_new_tokens=2, prefill_chunk=128, tokenizer=TinyTokenizer())

