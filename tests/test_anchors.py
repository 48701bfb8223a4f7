"""The question-agnostic anchors: scores checked against hand-computed cases."""

import pytest
import torch

import kvmerge
from kvmerge.methods.base import LayerContext


def test_keydiff_scores_are_minus_cosine_to_the_mean_unit_key_and_keep_the_odd_keys():
    keys = torch.zeros(1, 2, 6, 2)
    keys[0, 0, :, 0] = torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 0.5])  # all along x ...
    keys[0, 0, 3] = torch.tensor([0.0, 4.0])  # ... but one along y
    keys[0, 1] = torch.randn(6, 2)
    m = kvmerge.get_method("keydiff", budget=3, sinks=0, window=0)
    ctx = LayerContext(0, 1, target=3, sinks=0, window=0, scaling=1.0)
    scores = m.scores(keys, torch.zeros(1, 2, 6), ctx)
    anchor = torch.tensor([5.0, 1.0]) / 26 ** 0.5  # mean of unit keys (5 along x, 1 along y), normalised
    assert torch.allclose(scores[0, 0], -torch.tensor([anchor[0]] * 3 + [anchor[1]] + [anchor[0]] * 2), atol=1e-6)
    unit = torch.nn.functional.normalize(keys[0, 1], dim=-1)  # the other head has its own anchor
    assert torch.allclose(scores[0, 1], -(unit @ torch.nn.functional.normalize(unit.mean(0), dim=0)), atol=1e-6)
    k, _, _ = m.compress(keys, keys, torch.zeros(1, 2, 6), ctx)
    assert any(torch.equal(k[0, 0, i], keys[0, 0, 3]) for i in range(3))  # the odd key is kept
    # mass weighting: an entry standing for 3 tokens counts 3 times in the anchor
    log_n = torch.zeros(1, 2, 6)
    log_n[0, 0, 3] = torch.tensor(3.0).log()
    anchor = torch.nn.functional.normalize(torch.tensor([5.0, 3.0]), dim=0)
    assert torch.allclose(m.scores(keys, log_n, ctx)[0, 0, 3], -anchor[1], atol=1e-6)


def test_expectedattention_equals_a_direct_computation_from_pre_rope_queries():
    """Scores from captured post-RoPE queries (un-rotated) == the paper's formula computed from the
    q_proj outputs, with the mean rotation over future positions built matrix by matrix."""
    from .conftest import random_ids, tiny_model

    model = tiny_model()
    ids = random_ids(60, seed=2)
    pre = {}
    hook = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, o: pre.setdefault("q", o))
    m = kvmerge.get_method("expectedattention", budget=20, sinks=4, window=8, n_future=16, epsilon=0.01)
    s = kvmerge.Session(model, 1, m)
    compress = s.compress
    seen = {}

    def keep(*args, **kwargs):  # the layer's cache and captured queries just before compression
        seen.update(keys=s.cache.layers[1].keys.clone(), values=s.cache.layers[1].values.clone(),
                    queries=s.states[1].queries.clone())
        compress(*args, **kwargs)

    s.compress = keep
    with torch.no_grad():
        s.prefill([ids])
    hook.remove()
    d, hq, hkv = 16, 4, 2
    q = pre["q"][0].view(60, hq, d)[4:].double()  # pre-RoPE queries, sinks left out: (56, hq, d)
    inv_freq = model.model.rotary_emb.inv_freq.double()

    def rotation(p):  # HF's RoPE as a d×d matrix (halves layout)
        c, s_ = torch.cos(p * inv_freq), torch.sin(p * inv_freq)
        r = torch.zeros(d, d, dtype=torch.float64)
        half = d // 2
        r[:half, :half], r[:half, half:] = torch.diag(c), -torch.diag(s_)
        r[half:, :half], r[half:, half:] = torch.diag(s_), torch.diag(c)
        return r

    bar = sum(rotation(p) for p in range(60, 76)) / 16
    k, v = seen["keys"][0].double(), seen["values"][0].double()  # (hkv, 60, d)
    want = torch.zeros(hkv, 60, dtype=torch.float64)
    for h in range(hq):
        mu = bar @ q[:, h].mean(0)
        cov = (q[:, h] - q[:, h].mean(0)).T @ (q[:, h] - q[:, h].mean(0)) / q.shape[0]
        sig = bar @ cov @ bar.T
        kk = k[h // 2]
        z = kk @ mu / d ** 0.5 + 0.5 * torch.einsum("sd,de,se->s", kk, sig, kk) / d
        z[:4] = float("-inf")
        want[h // 2] += z.softmax(-1) / 2
    want = (want + 0.01) * v.norm(dim=-1)
    ctx = LayerContext(1, 2, target=20, sinks=4, window=8, scaling=d ** -0.5, queries=seen["queries"],
                       values=seen["values"], seen=60)
    got = m.scores(seen["keys"], torch.zeros(1, hkv, 60), ctx)[0].double()
    assert torch.allclose(got[:, 4:], want[:, 4:], rtol=1e-4, atol=1e-7)
    assert s.cache.entries == [20, 20]


def _kvzip_explicit(queries, keys, sinks, chunk, scaling, plus=None, log_n=None):
    """KVzip's score written out: query head by query head, position by position. `plus`: KVzip+'s
    (attention-input norm per position `(q,)`, values `(h, k, d)`, o_proj weight `(hidden, hq·d)`);
    `log_n` `(h, k)`: merged entries' log-mass in the logits."""
    hq, q, d = queries.shape
    h = keys.shape[0]
    best = torch.zeros(h, chunk)
    for head in range(hq):
        kv = head // (hq // h)  # GQA: query head → its KV head
        for j in range(q):
            visible = keys[kv, :sinks + chunk + j + 1]  # sinks, chunk, own keys up to itself
            bias = 0 if log_n is None else log_n[kv, :sinks + chunk + j + 1]
            probs = torch.softmax(visible @ queries[head, j] * scaling + bias, -1)
            if plus is not None:
                norms, values, w_o = plus
                through = values[kv, :sinks + chunk + j + 1] @ w_o[:, head * d:(head + 1) * d].T  # (k, hidden)
                probs = probs * through.norm(dim=-1) / norms[j]
            best[kv] = torch.maximum(best[kv], probs[sinks:sinks + chunk])
    return best


@pytest.mark.parametrize("block", [1, 2, 64])
@pytest.mark.parametrize("merged", [False, True])
def test_reconstruction_attention_equals_the_explicit_softmax_with_gqa(block, merged):
    torch.manual_seed(0)
    queries, keys = torch.randn(6, 5, 8), torch.randn(2, 3 + 7 + 5, 8)
    log_n = torch.rand(2, 15).mul(2).log1p() if merged else None
    got = kvmerge.methods.kvzip.reconstruction_attention(queries, keys, log_n, sinks=3, scaling=0.3, block=block)
    assert torch.allclose(got, _kvzip_explicit(queries, keys, 3, 7, 0.3, log_n=log_n), atol=1e-6)


def _kvzip_session(model, ctx, chunk, plus=False):
    from .conftest import TinyTokenizer
    m = kvmerge.get_method("kvzip", budget=0.5, window=8, chunk=chunk, plus=plus)
    s = kvmerge.Session(model, 1, m, TinyTokenizer())
    fed = []
    probe = s.probe
    s.probe = lambda rows, listener: (fed.append(rows[0]), probe(rows, listener))
    with torch.no_grad():
        s.feed_prompt([ctx])
        m.prepare_all(s.runtime, [ctx], s.cache.compressible)
    return m, s, fed


def test_kvzip_reconstruction_repeats_the_context_chunk_by_chunk():
    from .conftest import random_ids, tiny_model
    ctx = random_ids(120, seed=4)
    m, _s, fed = _kvzip_session(tiny_model(), ctx, chunk=50)
    later = m._later
    assert fed == [m._first + m._turn_end + ctx[:50],
                   later + ctx[42:50] + m._turn_end + ctx[50:100],
                   later + ctx[92:100] + m._turn_end + ctx[100:]]
    assert m._turn_end == [10 + ord("\n")]  # no chat template: a newline opens the answer


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("plus", [False, True])
def test_kvzip_scores_equal_an_explicit_reconstruction_and_the_probe_leaves_the_cache_as_it_was(plus, arch):
    from kvmerge.model import attention_scaling
    from .conftest import random_ids, tiny_model
    from .test_hybrid import gemma3
    model, ctx = gemma3() if arch == "gemma3" else tiny_model(), random_ids(60, seed=5)
    m, s, fed = _kvzip_session(model, ctx, chunk=30, plus=plus)
    scaling = attention_scaling(model.config)
    reference = kvmerge.Session(model, 1)
    with torch.no_grad():
        reference.feed_prompt([ctx])
        assert torch.equal(s.forward([[7, 8]]), reference.forward([[7, 8]]))  # the probe left no trace
        for c, (rows, sinks) in enumerate(zip(fed, (0, 4))):
            r = kvmerge.Session(model, 1)
            r.feed_prompt([ctx])
            r.forward([rows], capture=-1)
            inputs = model(torch.tensor([ctx + rows]), output_hidden_states=True).hidden_states
            for i in r.cache.compressible:
                keys, values = (torch.cat([x[:, :sinks], x[:, 30 * c:30 * c + 30], x[:, 60:]], 1)
                                for x in (r.cache.layers[i].keys[0], r.cache.layers[i].values[0]))
                layer = model.model.layers[i]
                norms = layer.input_layernorm(inputs[i])[0, 60:].norm(dim=-1)  # the attention input
                want = _kvzip_explicit(r.states[i].queries[0], keys, sinks, 30, scaling,
                                       (norms, values, layer.self_attn.o_proj.weight) if plus else None)
                got = s.states[i].scratch["_kvzip_fresh"][0][:, 30 * c:30 * c + 30]
                assert torch.allclose(got, want, atol=1e-5), (c, i)


def test_kvzip_reconstructs_a_prefill_once_for_every_budget_and_base():
    from kvmerge_eval.shared import compressed_once

    from .conftest import TinyTokenizer, random_ids, tiny_model
    model, ctx = tiny_model(), random_ids(200, seed=6)
    probes = []
    real = kvmerge.Session.probe
    kvmerge.Session.probe = lambda self, rows, listener: (probes.append(1), real(self, rows, listener))
    try:
        configs = [("kvzip", 0.25), ("kvzip", 0.5), ("evictmerge:base=kvzip", 0.25), ("d2o:base=kvzip", 0.25)]
        with torch.no_grad():
            shared = {(spec, b): s.cache.layers[0].keys.clone()
                      for spec, b, s, _ in compressed_once(model, TinyTokenizer(), [ctx], configs)}
    finally:
        kvmerge.Session.probe = real
    assert len(probes) == 1  # 200 tokens: one reconstruction chunk, run once
    for (spec, budget), keys in shared.items():
        s = kvmerge.Session(model, 1, kvmerge.get_method(spec, budget), TinyTokenizer())
        with torch.no_grad():
            s.prefill([ctx])
        assert torch.equal(s.cache.layers[0].keys, keys), spec


def test_probe_leaves_a_hybrid_models_sliding_layers_as_they_were():
    from .conftest import random_ids
    from .test_hybrid import gemma3
    model, ctx = gemma3(), random_ids(150, seed=7)
    probed, plain = kvmerge.Session(model, 2), kvmerge.Session(model, 2)
    seen = []
    with torch.no_grad():
        for s in (probed, plain):
            s.prefill([ctx, ctx[:90]])
        probed.probe([random_ids(40, seed=8), random_ids(25, seed=9)], lambda i, q, layer: seen.append(i))
        assert sorted(set(seen)) == probed.cache.compressible  # full-attention layers only
        for step in ([[3, 4], [5]], [[6], [7]]):
            assert torch.equal(probed.forward(step), plain.forward(step))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kvzip_plus_on_a_ragged_batch_equals_each_row_alone(arch):
    from .conftest import TinyTokenizer, random_ids, tiny_model
    from .test_hybrid import gemma3
    model = gemma3() if arch == "gemma3" else tiny_model()
    m = kvmerge.get_method("kvzip", budget=0.25, window=8, plus=True, chunk=64, alloc="uniform")
    ctx, qs = [random_ids(160, seed=1), random_ids(120, seed=2)], [[3, 4], [5]]
    out = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=6, tokenizer=TinyTokenizer())
    alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=6, tokenizer=TinyTokenizer()).tokens[0]
             for c, q in zip(ctx, qs)]
    assert out.tokens == alone
    if arch == "llama":  # (a hybrid's sliding layers keep their window)
        assert max(out.stats["cache_entries"]) <= m.target(160)


@pytest.mark.parametrize("with_mass", [False, True])
def test_merges_calibrated_by_expectedattention_keep_its_selection_and_reproduce_the_expected_query(with_mass):
    """`evictmerge:base=expectedattention:recent=0:calibrate_with=expected`: the kept entries are
    exactly EA's, and the mean future query μ̄ (no GQA, no covariance) reads the same attention output
    from the merged cache as from the full one: each cluster's expected mass lands on its kept entry."""
    from kvmerge.attention import biased_sdpa
    from kvmerge.ops.scores import top_slots

    g = torch.Generator().manual_seed(5)
    b, h, s, d = 1, 2, 40, 8
    keys, values, queries = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    log_n = torch.randint(1, 4, (b, h, s), generator=g).float().log() if with_mass else torch.zeros(b, h, s)
    ctx = LayerContext(0, 1, target=16, sinks=4, window=4, scaling=d ** -0.5, queries=queries, values=values, seen=s)
    identity = lambda p: (torch.ones(len(p), d), torch.zeros(len(p), d))  # noqa: E731 (no rotation)
    ea = kvmerge.get_method("expectedattention", budget=16, sinks=4, window=4, use_covariance=False)
    ea._cos_sin = identity
    m = kvmerge.get_method("evictmerge", base=ea, budget=16, sinks=4, window=4, recent=0.0,
                           calibrate_with="expected")
    k, v, ln = m.compress(keys, values, log_n, ctx)
    idx = top_slots(ea.scores(keys, log_n, ctx), 16, 4, 4)
    assert torch.equal(k, keys.gather(2, idx[..., None].expand(-1, -1, -1, d)))  # EA's picks, keys unmoved
    mu = queries[:, :, 4:].mean(2, keepdim=True)  # μ̄: the mean query after the sinks, not rotated
    full = (ctx.scaling * mu @ keys.transpose(-1, -2) + log_n[:, :, None]).softmax(-1) @ values
    merged = biased_sdpa(mu, k, v, ln, scaling=ctx.scaling).transpose(1, 2)
    assert torch.allclose(merged, full, atol=1e-5)
    observed = kvmerge.get_method("evictmerge", base=ea, budget=16, sinks=4, window=4, recent=0.0)
    k2, v2, ln2 = observed.compress(keys, values, log_n, ctx)
    assert not torch.allclose(biased_sdpa(mu, k2, v2, ln2, scaling=ctx.scaling).transpose(1, 2), full, atol=1e-3)


@pytest.mark.parametrize("absorb", ["kept", "picks"])
@pytest.mark.parametrize("alloc", ["uniform", "head"])
def test_merges_calibrated_by_the_base_conserve_its_scores_mass_and_weighted_values(alloc, absorb):
    """`calibrate_with="base"`: the weights are the base's own scores w. The picks are the base's,
    kept keys stay, and over the kept slots Σ exp(log_n)·w_kept = Σ w and Σ exp(log_n)·w_kept·v =
    Σ w·v over the whole head (every entry joins, mass and weighted values conserved). With
    `absorb="picks"` the sinks and window come out exactly as they went in, and a head with no pick
    beside them evicts the rest."""
    from dataclasses import dataclass

    from kvmerge.methods.base import ScoringMethod
    from kvmerge.allocation import global_counts, top_slots_per_head
    from kvmerge.ops.scores import top_slots

    g = torch.Generator().manual_seed(6)
    b, h, s, d = 1, 3, 40, 8
    keys, values = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    w = torch.rand(b, h, s, generator=g) ** 3
    w[0, 0, 4:s - 4] *= 1e-6  # a head whose free entries all score low: global allocation gives it no pick

    @dataclass
    class Fixed(ScoringMethod):
        name = "fixed"

        def scores(self, keys, log_n, ctx):
            return w

    m = kvmerge.get_method("evictmerge", base=Fixed(), budget=16, sinks=4, window=4, recent=0.0, calibrate_with="base",
                           alloc=alloc, absorb=absorb)
    ctx = LayerContext(0, 1, target=16, sinks=4, window=4, scaling=d ** -0.5, values=values, seen=s)
    if alloc == "head":
        ctx.alloc = (w, global_counts([w], 16, 4, 4, "head")[0])
        idx, empty = top_slots_per_head(*ctx.alloc, 4, 4)
    else:
        idx, empty = top_slots(w, 16, 4, 4), torch.zeros(b, h, 16, dtype=torch.bool)
    k, v, ln = m.compress(keys, values, torch.zeros(b, h, s), ctx)
    live = ~empty
    assert torch.equal(k[live], keys.gather(2, idx[..., None].expand(-1, -1, -1, d))[live])  # the base's picks
    mass = ln.exp() * w.gather(-1, idx) * live
    protected = live & ((idx < 4) | (idx >= s - 4))
    picked = (live & ~protected).any(-1)  # (b, h): a head with a pick beside sinks and window
    if absorb == "picks":
        assert torch.allclose(v[protected], values.gather(2, idx[..., None].expand(-1, -1, -1, d))[protected], atol=1e-6)
        assert torch.allclose(ln[protected], torch.zeros_like(ln[protected]), atol=1e-6)
        lonely = ~picked[..., None].expand_as(ln) & live  # kept slots of heads with no pick: nothing joined them
        assert lonely.any() == (alloc == "head")
        assert torch.allclose(ln[lonely], torch.zeros_like(ln[lonely]), atol=1e-6)
    else:
        picked = torch.ones_like(picked)
    assert picked.any()
    assert torch.allclose(mass.sum(-1)[picked], w.sum(-1)[picked], rtol=1e-5)
    assert torch.allclose((mass[..., None] * v).sum(2)[picked], (w[..., None] * values).sum(2)[picked], atol=1e-5)
    with pytest.raises(ValueError, match="negative"):
        w.sub_(0.5)
        m.compress(keys, values, torch.zeros(b, h, s), ctx)


@pytest.mark.parametrize("alloc", ["uniform", "head"])
def test_heads_whose_base_scores_saturate_evict_and_the_others_merge_as_before(alloc):
    """`saturated`: a head in which more than that fraction of the free entries (between the sinks and
    the window) score above one half comes out as plain eviction of the same picks (kept keys and
    values exact, log-mass 0); every other head comes out exactly as without the option: one whose
    sinks and window score high but not its free entries, one with a few free entries above one half."""
    from dataclasses import dataclass

    from kvmerge.methods.base import ScoringMethod
    from kvmerge.allocation import global_counts, top_slots_per_head
    from kvmerge.ops.scores import top_slots

    g = torch.Generator().manual_seed(7)
    b, h, s, d = 1, 3, 40, 8
    keys, values = torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)
    w = torch.rand(b, h, s, generator=g) * 0.5  # nobody above one half...
    w[0, 1, 4:s - 4] = 0.5 + 0.5 * torch.rand(s - 8, generator=g)  # ...but head 1's free entries all are,
    w[0, 0, :4], w[0, 0, s - 4:] = 0.9, 0.9  # head 0's sinks and window (8 of 40: 20% of the head),
    w[0, 2, [10, 20, 30]] = 0.9  # and 3 of head 2's 32 free entries (9%)

    @dataclass
    class Fixed(ScoringMethod):
        name = "fixed"

        def scores(self, keys, log_n, ctx):
            return w

    def run(**kw):
        m = kvmerge.get_method("evictmerge", base=Fixed(), budget=16, sinks=4, window=4, recent=0.0,
                               calibrate_with="base", alloc=alloc, **kw)
        ctx = LayerContext(0, 1, target=16, sinks=4, window=4, scaling=d ** -0.5, values=values, seen=s)
        if alloc == "head":
            ctx.alloc = (w, global_counts([w], 16, 4, 4, "head")[0])
        return m.compress(keys, values, torch.zeros(b, h, s), ctx)

    if alloc == "head":
        idx, empty = top_slots_per_head(w, global_counts([w], 16, 4, 4, "head")[0], 4, 4)
    else:
        idx, empty = top_slots(w, 16, 4, 4), torch.zeros(b, h, 16, dtype=torch.bool)
    guarded, plain = run(saturated=0.15), run()
    live = ~empty[0, 1]
    picked = idx[0, 1][live]
    assert torch.equal(guarded.keys[0, 1][live], keys[0, 1, picked])
    torch.testing.assert_close(guarded.values[0, 1][live], values[0, 1, picked])  # evicted: nothing joined
    torch.testing.assert_close(guarded.log_n[0, 1][live], torch.zeros(int(live.sum())))
    assert not torch.allclose(plain.values[0, 1][live], values[0, 1, picked])  # without the option it merges
    for other in (0, 2):
        for a, c in zip(guarded, plain):
            assert torch.equal(a[0, other], c[0, other])
    for bad in ({"saturated": 1.5, "calibrate_with": "base"}, {"saturated": 0.2}, {"saturated": 0.2, "calibrate": False}):
        with pytest.raises(ValueError, match="saturated"):
            kvmerge.get_method("evictmerge", **bad)


def test_zipguardmerge_is_zipmerge_on_zipguard_with_its_guarded_heads_evicting():
    m = kvmerge.get_method("zipguardmerge")
    assert (m.base.name, m.saturated, m.calibrate_with, m.alloc) == ("zipguard", 0.25, "base", "head")
    assert m.saturated == m.base.saturated  # the heads zipguard guards are the heads that evict
    assert kvmerge.get_method("zipguardmerge:saturated=0.4", 0.25).base.saturated == 0.4
    assert [part.name for part in m.base._fallbacks] == ["surprisal", "echo"]  # R22
    m = kvmerge.get_method("zipguardmerge:fallback=surprisal", 0.25)
    assert [part.name for part in m.base._fallbacks] == ["surprisal"]
    with pytest.raises(ValueError, match="echoo"):
        kvmerge.get_method("zipguardmerge:fallback=surprisal+echoo", 0.25)


def test_calibrate_with_names_its_choices():
    with pytest.raises(ValueError, match="calibrate_with"):
        kvmerge.get_method("evictmerge", calibrate_with="expectation")
    with pytest.raises(ValueError, match="absorb"):
        kvmerge.get_method("zipmerge", absorb="window")


def test_mixedmerge_is_surprisemerge_on_mixedattention_with_expected_calibration():
    from .conftest import TinyTokenizer, random_ids, tiny_model

    model, tok = tiny_model(), TinyTokenizer()
    ctx, q = random_ids(160, seed=4), [3, 4]
    spec = kvmerge.get_method("surprisemerge:base=mixedattention:calibrate_with=expected", 0.25)
    named = kvmerge.get_method("mixedmerge", budget=0.25)
    a, b = (kvmerge.generate_ids(model, ctx, q, m, max_new_tokens=8, tokenizer=tok) for m in (spec, named))
    assert a.tokens == b.tokens and a.stats["cache_entries"] == b.stats["cache_entries"]
    assert named._expected is named.base and named.needs.queries == -1


def test_mixedattention_is_the_mean_of_expected_and_normalised_observed_attention():
    from kvmerge.ops.scores import attention_probs

    g = torch.Generator().manual_seed(6)
    b, hq, hkv, s, d = 1, 4, 2, 30, 8
    keys, values = torch.randn(b, hkv, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    queries = torch.randn(b, hq, s, d, generator=g)
    ctx = LayerContext(0, 1, target=12, sinks=4, window=4, scaling=d ** -0.5, queries=queries, values=values, seen=s)
    identity = lambda p: (torch.ones(len(p), d), torch.zeros(len(p), d))  # noqa: E731
    mixed = kvmerge.get_method("mixedattention", budget=12, sinks=4, window=4, obs_window=5)
    ea = kvmerge.get_method("expectedattention", budget=12, sinks=4, window=4)
    mixed._cos_sin = ea._cos_sin = identity
    log_n = torch.zeros(b, hkv, s)
    observed = attention_probs(queries[:, :, -5:], keys, ctx.scaling).sum(2)  # (b, hkv, s), group-summed
    observed[..., :4] = 0
    want = 0.5 * ea.probabilities(keys, log_n, ctx) + 0.5 * observed / observed.sum(-1, keepdim=True)
    got = mixed.probabilities(keys, log_n, ctx)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(got.sum(-1), torch.ones(b, hkv))
    assert torch.allclose(mixed.scores(keys, log_n, ctx), got * values.norm(dim=-1), atol=1e-6)
