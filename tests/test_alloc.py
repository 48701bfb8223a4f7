"""Global budget allocation (`alloc="layer"` / `"head"` / `"fit"`, KVzip's and AdaKV's): counts equal a brute-force
global top-k, every head keeps its own top entries, padding slots get no attention, budgets hold."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmerge
from kvmerge import Session
from kvmerge.layer import MergedLayer
from kvmerge.allocation import global_counts, top_slots_per_head

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
@given(L=st.integers(1, 4), h=st.integers(1, 3), s=st.integers(8, 40), frac=st.floats(0.2, 1.0),
       floor=st.floats(0.0, 1.0), seed=st.integers(0, 99))
def test_floor_guarantees_each_heads_share_then_spends_the_rest_globally(L, h, s, frac, floor, seed):
    """AdaKV's safeguard: every head first keeps its own top entries up to round(floor·target) in all;
    the rest of the pool goes to the highest remaining scores over every layer and head (brute force)."""
    g = torch.Generator().manual_seed(seed)
    scores = [torch.rand(2, h, s, generator=g) * (l + 1) ** 2 for l in range(L)]  # later layers rank first
    sinks, window = 2, 3
    target = max(int(frac * s), sinks + window)
    counts = global_counts(scores, target, sinks, window, "head", floor)
    prot = sinks + window
    safe = min(max(round(floor * target) - prot, 0), target - prot)
    brute = torch.full((L, 2, h), prot + safe)
    for r in range(2):
        rest = []
        for l in range(L):
            for j in range(h):
                free = sorted((float(scores[l][r, j, i]) for i in range(sinks, s - window)), reverse=True)
                rest += [(v, l, j) for v in free[safe:]]
        for _, l, j in sorted(rest, key=lambda c: -c[0])[:L * h * (target - prot - safe)]:
            brute[l, r, j] += 1
    assert torch.equal(counts, brute)
    assert (counts >= min(max(round(floor * target), prot), target)).all()
    assert (counts.sum((0, 2)) == L * h * target).all()  # the same total: only its spread changes
    if floor == 0.0:
        assert torch.equal(counts, global_counts(scores, target, sinks, window, "head"))
    if floor == 1.0:  # the whole budget guaranteed: the uniform allocation
        assert (counts == target).all()


@settings(max_examples=40, deadline=None)
@given(L=st.integers(1, 4), h=st.integers(1, 3), s=st.integers(8, 40), frac=st.floats(0.2, 1.0),
       floor=st.sampled_from([0.0, 0.2, 1.0]), seed=st.integers(0, 99))
def test_adakv_spreads_each_layers_own_share_over_its_heads(L, h, s, frac, floor, seed):
    """AdaKV (kvpress's AdaKVPress): a layer's h·target entries go to its own heads' highest scores
    (brute force per layer, after the floor), whatever the other layers score."""
    g = torch.Generator().manual_seed(seed)
    scores = [torch.rand(2, h, s, generator=g) * (l + 1) ** 2 for l in range(L)]
    sinks, window = 2, 3
    target = max(int(frac * s), sinks + window)
    counts = global_counts(scores, target, sinks, window, "adakv", floor)
    for l in range(L):
        alone = global_counts(scores[l:l + 1], target, sinks, window, "head", floor)[0]
        assert torch.equal(counts[l], alone)  # one layer: AdaKV and the global ranking agree
    assert (counts.sum(-1) == h * target).all()  # every layer keeps its uniform share
    if floor == 1.0:
        assert (counts == target).all()


def test_floor_is_refused_where_nothing_is_allocated_globally():
    with pytest.raises(ValueError, match="floor"):
        kvmerge.get_method("snapkv", floor=0.2)
    with pytest.raises(ValueError, match="floor"):
        kvmerge.get_method("kvzip", alloc="head", floor=1.5)
    assert kvmerge.get_method("kvzip", alloc="head", floor=0.2).floor == 0.2


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
    if h == 1:  # one KV head per layer (Gemma-3-270M): nothing to pad, so fit is head
        assert torch.equal(fit, global_counts(scores, target, sinks, window, "head"))
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
    method = kvmerge.get_method(spec, 0.25) if isinstance(spec, str) else spec
    session = Session(model, 1, method, TinyTokenizer())
    logits = session.prefill([random_ids(n, seed=3)], method.window)
    return method, session, logits


def _live(layer):
    """Row 0's live slots, head by head, as one flat tensor each of keys, values and log_n."""
    kv = layer.kv()
    live = ~torch.isinf(kv.log_n[0])
    return [torch.cat([x[0, j][live[j]].flatten() for j in range(live.shape[0])]) for x in kv]


def _padded(model, spec, monkeypatch):
    """The same compression with every head padded to its layer's widest (no ragged storage)."""
    with monkeypatch.context() as m:
        m.setattr(MergedLayer, "compact", lambda self: False)
        return _compressed(model, spec)


@pytest.mark.parametrize("spec", ["snapkv:alloc=head:window=8", "kvzip:alloc=head:window=8:chunk=64",
                                  "expectedattention:alloc=head:window=8", "expectedattention:alloc=adakv:window=8",
                                  "evictmerge:base=kvzip:alloc=head:recent=0:window=8"])
def test_per_head_allocation_meets_the_budget_in_bytes_and_equals_the_padded_layout(spec, monkeypatch):
    """Each head is stored at its own count: the bytes are the budget's entries exactly, and attention,
    decoding and the layer's padded view are those of the layout padding every head to the widest."""
    model = tiny_model(num_hidden_layers=3)
    method, session, first = _compressed(model, spec)
    _, padded, padded_first = _padded(model, spec, monkeypatch)
    layers = [session.cache.layers[i] for i in session.cache.compressible]
    flat = [padded.cache.layers[i] for i in padded.cache.compressible]
    live = torch.stack([(~torch.isinf(layer.full_log_n()[0])).sum(-1) for layer in flat])  # (L, h)
    assert int(live.sum()) == live.numel() * method.target(160)  # the global budget, exactly
    if method.alloc == "adakv":  # and each layer's own share
        assert (live.sum(-1) == live.shape[1] * method.target(160)).all()
    assert (live >= method.sinks + method.window).all() and len({int(x) for x in live.flatten()}) > 1
    assert [layer.entries for layer in flat] == [int(c.max()) for c in live]  # padded to the widest head
    d = model.config.hidden_size // model.config.num_attention_heads
    for ragged, dense, counts in zip(layers, flat, live):
        saved = (len(counts) * dense.entries - int(counts.sum())) * (2 * d * 4 + 4)
        assert (ragged.heads is not None) == (saved > len(counts) * dense.entries)  # ragged iff that saves bytes
        if ragged.heads is None:
            assert ragged.nbytes == dense.nbytes
            continue
        assert [head.entries for head in ragged.heads] == counts.tolist()
        assert ragged.nbytes == sum(c * (2 * d * 4 + (0 if head.log_n is None else 4))  # and a byte per
                                    for c, head in zip(counts.tolist(), ragged.heads)) + len(counts) * dense.entries  # slot
    assert sum(layer.nbytes for layer in layers) < sum(layer.nbytes for layer in flat)
    assert session.cache.allocated_bytes < padded.cache.allocated_bytes
    assert all(layer.allocated_bytes >= layer.nbytes for layer in layers)
    for ragged, dense in zip(layers, flat):  # the same entries in the same order, head by head
        assert ragged.entries == dense.entries and all(torch.equal(a, b) for a, b in zip(_live(ragged), _live(dense)))
        if ragged.heads is not None:  # and the same empty slots, zeros with log_n -inf, at the same places
            assert all(torch.equal(a, b) for a, b in zip(ragged.kv(), dense.kv()))
    torch.testing.assert_close(first, padded_first)
    for step in ([[7, 8, 9]], [[11]], [[12]]):  # a chunk, then decoding steps: appended to every head
        torch.testing.assert_close(session.forward(step), padded.forward(step), atol=1e-5, rtol=1e-5)
    for ragged, dense in zip(layers, flat):
        assert ragged.entries == dense.entries
        for a, b in zip(_live(ragged), _live(dense)):
            torch.testing.assert_close(a, b)

    empty = 0  # the padded layout's empty slots get no attention: scrambling them changes nothing
    for layer in flat:
        mask = torch.isinf(layer.full_log_n())
        empty += int(mask.sum())
        layer.keys[mask], layer.values[mask] = 50.0, -50.0
    assert empty
    torch.testing.assert_close(padded.forward([[13]]), session.forward([[13]]), atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("spec", ["snapkv:alloc=head:window=8", "zipmerge:window=8"])
def test_a_full_floor_is_the_uniform_allocation_and_a_partial_one_lifts_the_poorest_head(spec):
    """floor=1 guarantees every head the uniform count, so it keeps exactly the uniform cache; a partial
    floor keeps the total and lifts the poorest head to at least its share."""
    model = tiny_model(num_hidden_layers=3)
    uniform_spec = spec.replace("alloc=head", "alloc=uniform") if "alloc=head" in spec else spec + ":alloc=uniform"
    _, uniform, _ = _compressed(model, uniform_spec)
    _, floored, _ = _compressed(model, spec + ":floor=1")
    for i in uniform.cache.compressible:
        (ka, va, la), (kb, vb, lb) = _live(uniform.cache.layers[i]), _live(floored.cache.layers[i])
        assert torch.equal(ka, kb)  # the same picks in the same order (kept keys are copies: bit for bit)
        torch.testing.assert_close((va, la), (vb, lb))  # merged values and log-mass: two code paths, float error

    def live_counts(session):  # (layers, heads): row 0's live slots
        return torch.stack([(~torch.isinf(session.cache.layers[i].kv().log_n[0])).sum(-1)
                            for i in session.cache.compressible])

    free = live_counts(_compressed(model, spec)[1])
    method, lifted, _ = _compressed(model, spec + ":floor=0.9")
    lifted, share = live_counts(lifted), round(0.9 * method.target(160))
    assert int(free.min()) < share  # the floor has something to do here
    assert int(lifted.min()) >= share
    assert int(lifted.sum()) == int(free.sum())


def test_global_allocation_greedy_generation_runs_and_refuses_what_it_cannot_do():
    model = tiny_model()
    m = kvmerge.get_method("kvzip", budget=0.25, window=8, chunk=64, alloc="layer")
    out = kvmerge.generate_ids(model, random_ids(160, seed=1), [3, 4], m, max_new_tokens=4, tokenizer=TinyTokenizer())
    assert len(out.tokens[0]) == 4
    chunked = kvmerge.generate_ids(model, random_ids(300, seed=1), [3], kvmerge.get_method("snapkv", alloc="head",
                                                                                            window=8),
                                   max_new_tokens=2, prefill_chunk=128)  # runs chunked: test_global_..._chunked_...
    assert len(chunked.tokens[0]) == 2
    with pytest.raises(ValueError, match="needs rows of one length, and these have 2"):  # before any forward
        kvmerge.generate_ids(model, [random_ids(160, seed=1), random_ids(120, seed=2)], [[3], [4]],
                             kvmerge.get_method("snapkv", alloc="head", window=8), max_new_tokens=2)
    session = kvmerge.Session(model, 2, kvmerge.get_method("snapkv", alloc="head", window=8))
    with pytest.raises(ValueError, match="rows without padding"), torch.no_grad():  # the planner's own guard
        session.prefill([random_ids(160, seed=1), random_ids(120, seed=2)])
    with pytest.raises(ValueError, match="set recent=0, and exact=0 or absorb='none'"):  # a fixed share bypasses alloc
        kvmerge.get_method("evictmerge:alloc=head", 0.25)
    with pytest.raises(ValueError, match="exact=0 or absorb='none'"):  # an exact share ranks first only evicting
        kvmerge.get_method("evictmerge:alloc=head:recent=0:exact=0.25", 0.25)
    for spec in ("mergingpress:alloc=head", "pyramidkv:alloc=layer"):  # merging otherwise, or budgets of its own
        with pytest.raises(ValueError, match="applies to methods that keep their highest-scored"):
            kvmerge.generate_ids(model, random_ids(160, seed=1), [3], kvmerge.get_method(spec + ":window=8", 0.25),
                                 max_new_tokens=2)
    for name in ("evictmerge", "surprisemerge", "d2o"):  # a base's alloc would be ignored: refused
        with pytest.raises(ValueError, match="alloc='head' would be ignored"):
            kvmerge.get_method(name, base=kvmerge.get_method("snapkv", alloc="head"))
    with pytest.raises(ValueError, match="alloc must be one of uniform, layer, head, fit"):
        kvmerge.get_method("snapkv:alloc=global", 0.25)


def test_merging_with_per_head_allocation_keeps_the_same_picks_and_conserves_mass():
    """evictmerge with alloc=head keeps exactly the entries its base keeps with alloc=head (calibrated
    merging leaves kept keys as they are; only values and log-mass change), and with count weights every
    head's live slots hold all 160 tokens' mass (each evicted token joined a kept entry)."""
    model = tiny_model(num_hidden_layers=3)
    def merging(**kw):
        return kvmerge.get_method("evictmerge", budget=0.25, base=kvmerge.get_method("kvzip", window=8, chunk=64, alloc="uniform"),
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


def test_zipmerge_is_kvzip_global_picks_with_evictmerge_merging_and_runs_chunked():
    model = tiny_model(num_hidden_layers=3)
    kvzip = kvmerge.get_method("kvzip", window=8, chunk=64, alloc="uniform")
    _, named, _ = _compressed(model, kvmerge.get_method("zipmerge", budget=0.25, window=8, base=kvzip))
    _, spelled, _ = _compressed(model, kvmerge.get_method("evictmerge", budget=0.25, window=8, base=kvzip, alloc="head",
                                                          recent=0.0, calibrate_with="base"))
    _, observed, _ = _compressed(model, kvmerge.get_method("zipmerge", budget=0.25, window=8, base=kvzip,
                                                           calibrate_with="observed"))
    for i in named.cache.compressible:
        a, b = named.cache.layers[i], spelled.cache.layers[i]
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert torch.equal(a.full_log_n(), b.full_log_n())
    # the default weighs merges by KVzip's own scores, not by the last prompt queries' attention
    assert any(not torch.equal(named.cache.layers[i].full_log_n(), observed.cache.layers[i].full_log_n())
               for i in named.cache.compressible)
    out = kvmerge.generate_ids(model, random_ids(300, seed=1), [3], kvmerge.get_method("zipmerge", window=8),
                               max_new_tokens=2, prefill_chunk=128, tokenizer=TinyTokenizer())
    assert len(out.tokens[0]) == 2 and max(out.stats["cache_entries"]) > 0



def test_a_ragged_cache_survives_snapshots_probes_row_repeats_and_a_second_compression(monkeypatch):
    """Every operation on a cache whose heads have their own lengths does what it does on the padded
    layout: snapshot/restore and probes leave it as it was, rows repeat, a later compression sees the
    same entries; outside kvmerge's attention it is refused, not misread."""
    model = tiny_model(num_hidden_layers=3)
    spec = "snapkv:alloc=head:window=8"
    _, session, _ = _compressed(model, spec)
    _, padded, _ = _padded(model, spec, monkeypatch)
    assert any(session.cache.layers[i].heads is not None for i in session.cache.compressible)
    nbytes = session.cache.nbytes
    saved = session.snapshot()
    seen = []
    session.probe([[20, 21, 22]], lambda i, query, layer: seen.append(layer.entries))
    assert seen and session.cache.nbytes == nbytes
    first = session.forward([[7, 8]])
    session.restore(saved)
    assert session.cache.nbytes == nbytes
    torch.testing.assert_close(session.forward([[7, 8]]), first)
    torch.testing.assert_close(padded.forward([[7, 8]]), first, atol=1e-5, rtol=1e-5)

    layer = next(session.cache.layers[i] for i in session.cache.compressible if session.cache.layers[i].heads)
    held = [(x.seen, x.entries, x.nbytes) for x in session.cache.layers]
    with pytest.raises(ValueError, match="kvmerge_attention"):
        with torch.no_grad():
            model(torch.tensor([[9]]), cache=session.cache, use_cache=True)
    assert layer.heads is not None
    assert [(x.seen, x.entries, x.nbytes) for x in session.cache.layers] == held  # refused before any layer took it

    for s in (session, padded):
        s.use(kvmerge.get_method("streamingllm:window=8", 20))
        s.compress()
    torch.testing.assert_close(session.forward([[9]]), padded.forward([[9]]), atol=1e-5, rtol=1e-5)
    session.repeat_rows(2)
    padded.repeat_rows(2)
    out = session.forward([[10], [11]])
    torch.testing.assert_close(out, padded.forward([[10], [11]]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["kvzip:window=8:chunk=64", "snapkv:alloc=head:window=8", "learnedzip:window=8",
                                  "learnedzip:scorer=mlp:window=8",
                                  "zipmerge:window=8:calibrate=false", "kvzip:alloc=fit:window=8:chunk=64"])
def test_global_allocation_runs_under_a_chunked_prefill_within_budget_plus_chunk(spec):
    """Chunk by chunk, one budget spread over every layer and head: after each chunk the live entries
    are the running budget's (L·h·target, or the fitted widths' bytes), no head keeps an empty slot
    while it has an entry left, and each head holds at most its count + one chunk at any time. With
    count weights, merging keeps every token's mass."""
    model = tiny_model(num_hidden_layers=3)
    method = kvmerge.get_method(spec, 0.25)  # learnedzip: the tiny model's scorer (conftest, random weights)
    session = Session(model, 1, method, TinyTokenizer())
    ids, chunk, seen = random_ids(300, seed=5), 64, []
    real = session.compress

    def compress(*args, **kwargs):
        real(*args, **kwargs)
        n = int(session.seen[0])
        layers = [session.cache.layers[i] for i in session.cache.compressible]
        live = torch.stack([(~torch.isinf(layer.full_log_n()[0])).sum(-1) for layer in layers])  # (L, h)
        target = method.running_target(n)
        if method.alloc == "fit":
            assert int(live.amax(-1).sum()) <= 3 * target
        else:
            assert int(live.sum()) == min(3 * 2 * target, 3 * 2 * n)
        for layer in layers:
            assert all(int(mass) >= 1 for mass in (~torch.isinf(layer.full_log_n()[0])).sum(-1))
        if spec.startswith("zipmerge"):
            for layer in layers:
                torch.testing.assert_close(layer.mass()[0], torch.full((2,), float(n)))
        seen.append(max(layer.entries for layer in layers) - chunk)

    session.compress = compress
    with torch.no_grad():
        session.prefill([ids], method.window, chunk=chunk)
    assert len(seen) == 5 and max(seen) <= 3 * 2 * method.running_target(300)
