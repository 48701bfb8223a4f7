"""Surprisal selection and exact picks: the plumbing, the sentence scores, what stays exact."""

import functools
from dataclasses import replace

import torch

import kvmerge
from kvmerge.runtime import Runtime
import kvmerge.model as km
from kvmerge.methods.base import LayerContext
from kvmerge.ops.scores import sentence_mean

from .conftest import TinyTokenizer, random_ids, tiny_model


def test_prefill_surprisal_is_the_models_own_next_token_loss_under_padding():
    model = tiny_model()
    rows = [random_ids(50, seed=1), random_ids(30, seed=2)]
    s = kvmerge.Session(model, 2)
    with torch.no_grad():
        surp = s.forward_surprisal(rows)
        for b, r in enumerate(rows):
            logp = tiny_model().forward(torch.tensor([r])).logits[0].log_softmax(-1)
            want = torch.cat([torch.zeros(1), -logp[:-1].gather(-1, torch.tensor(r[1:])[:, None])[:, 0]])
            assert torch.allclose(surp[b, -len(r):], want, atol=1e-4)
    assert bool((surp[1, :20] == 0).all()) and bool((surp[1, 21:] > 0).all())  # padding and first token


def test_sentence_mean_averages_within_sentences_ending_at_the_mark():
    values = torch.tensor([[1.0, 3.0, 5.0, 10.0, 0.0, 2.0]])
    is_end = torch.tensor([[False, False, True, False, False, False]])
    assert torch.equal(sentence_mean(values, is_end), torch.tensor([[3.0, 3.0, 3.0, 4.0, 4.0, 4.0]]))


def _surprising_sentence_case(n=60):
    """Sentences of 5 tokens (id 5 ends each); the one at 20..24 is far less predictable."""
    ids = torch.tensor([[5 if i % 5 == 4 else 10 + i % 7 for i in range(n)]])
    surp = torch.ones(1, n)
    surp[0, 20:25] = 8.0
    surp[0, 40] = 12.0  # one surprising token in an ordinary sentence: its sentence mean is only 3.2
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    ctx = LayerContext(0, 1, target=17, sinks=2, window=10, scaling=8 ** -0.5, token_ids=ids, surprisal=surp,
                       queries=torch.randn(1, 4, 32, 8, generator=g))
    return keys, values, ctx


def test_surprisal_keeps_the_least_predictable_sentence_whole():
    keys, values, ctx = _surprising_sentence_case()
    m = kvmerge.get_method("surprisal", budget=17, sinks=2, window=10)
    m.setup_all(Runtime(TinyTokenizer()))
    k, v, ln = m.compress(keys, values, torch.zeros(1, 2, 60), ctx)
    assert torch.equal(k, keys[:, :, [0, 1, 20, 21, 22, 23, 24] + list(range(50, 60))])
    assert torch.equal(v, values[:, :, [0, 1, 20, 21, 22, 23, 24] + list(range(50, 60))])


def test_exact_share_stays_bit_exact_while_the_rest_absorbs_and_mass_is_conserved():
    keys, values, ctx = _surprising_sentence_case()
    m = kvmerge.get_method("evictmerge", budget=17, sinks=2, window=10, base="snapkv", recent=0.0,
                           exact=5 / 17, calibrate=False)
    m.setup_all(Runtime(TinyTokenizer()))
    assert m.needs.surprisal
    k, v, ln = m.compress(keys, values, torch.zeros(1, 2, 60), ctx)
    picks = [0, 1, 20, 21, 22, 23, 24]
    assert torch.equal(k[:, :, :7], keys[:, :, picks]) and torch.equal(v[:, :, :7], values[:, :, picks])
    assert bool((ln[..., :7] == 0).all()) and bool((ln[..., 7:] > 0).any())
    assert torch.allclose(ln.exp().sum(-1), torch.full((1, 2), 60.0))
    merged = kvmerge.get_method("evictmerge", budget=17, sinks=2, window=10, base="surprisal", recent=0.0,
                                calibrate=False)  # the same picks, not kept exact
    merged.setup_all(Runtime(TinyTokenizer()))
    assert bool((merged.compress(keys, values, torch.zeros(1, 2, 60), ctx)[2][..., 2:7] > 0).any())


def test_absorb_none_evicts_beside_the_exact_share_and_keeps_what_a_merge_nobody_joins_keeps():
    """`absorb="none"`: the picks are the merging form's, every kept entry comes out exactly as it went in,
    no mass moves; equal to the merging form whose cosine floor (2) no entry reaches."""
    keys, values, ctx = _surprising_sentence_case()
    log_n = torch.zeros(1, 2, 60)
    out = {}
    for how in ({"absorb": "none"}, {"min_cosine": 2.0}, {}):
        m = kvmerge.get_method("evictmerge", budget=17, sinks=2, window=10, base="snapkv", recent=0.0,
                               exact=5 / 17, whole=True, **how)
        m.setup_all(Runtime(TinyTokenizer()))
        out[str(how)] = m.compress(keys, values, log_n, ctx)
        if how:
            assert m.needs.merges == ("absorb" not in how) and m.needs.surprisal
    k, v, ln = out[str({"absorb": "none"})]
    picked = [torch.where((keys[0, h, :, None, :] == k[0, h, None]).all(-1))[0].tolist() for h in range(2)]
    assert all(p[:7] == [0, 1, 20, 21, 22, 23, 24] and p[-10:] == list(range(50, 60)) for p in picked)
    assert torch.equal(v, torch.stack([values[0, h, p] for h, p in enumerate(picked)])[None])
    assert bool((ln == 0).all())
    floor = out[str({"min_cosine": 2.0})]
    assert torch.equal(floor[0], k) and torch.allclose(floor[1], v, atol=1e-6) and torch.allclose(floor[2], ln)
    assert not torch.equal(out["{}"][1], v)  # the merging form moves values: the test can tell them apart


def test_under_global_allocation_every_heads_exact_share_is_kept_and_the_rest_follows_the_global_ranking():
    """`exact` with `alloc="head"` and `absorb="none"`: each head's exact share (whole sentences, of the
    uniform count) ranks before every score, the rest of the budget goes by the base's global ranking:
    without the share, the same picks as the base alone with `alloc="head"`."""
    from kvmerge.allocation import Allocation

    keys, values, ctx = _surprising_sentence_case()
    log_n = torch.zeros(1, 2, 60)
    base = kvmerge.get_method("snapkv", budget=17, sinks=2, window=10, alloc="head")
    shared = kvmerge.get_method("evictmerge", budget=17, sinks=2, window=10, base="snapkv", alloc="head", recent=0.0,
                                exact=5 / 17, whole=True, absorb="none")
    plain = kvmerge.get_method("evictmerge", budget=17, sinks=2, window=10, base="snapkv", alloc="head", recent=0.0,
                               absorb="none")
    kept = {}
    for name, m in (("base", base), ("shared", shared), ("plain", plain)):
        m.setup_all(Runtime(TinyTokenizer()))
        layers = [(keys, values), (values, keys)]  # two layers: one budget over both
        allocation = Allocation.of(m, ((m.scores(k, log_n, ctx), log_n) for k, _ in layers), 17, 10)
        kept[name] = []
        for i, (k, v) in enumerate(layers):
            out = m.compress(k, v, log_n, replace(ctx, layer_idx=i, alloc=allocation.layer(i)))
            real = ~torch.isneginf(out.log_n)
            kept[name].append([sorted(torch.where((k[0, h, :, None] == out.keys[0, h, None, real[0, h]]).all(-1))[0]
                                      .tolist()) for h in range(2)])
        assert sum(int(c.sum()) for c in allocation.counts) == 2 * 2 * 17
    assert kept["plain"] == kept["base"]
    assert all(set(range(20, 25)) <= set(head) for layer in kept["shared"] for head in layer)
    assert any(not set(range(20, 25)) <= set(head) for layer in kept["base"] for head in layer)  # the share decides


def test_surprisal_without_a_tokenizer_says_so():
    import pytest

    with pytest.raises(ValueError, match="tokenizer"):
        kvmerge.generate_ids(tiny_model(), random_ids(100), [3], kvmerge.get_method("surprisal", window=8))


def test_whole_completes_the_last_sentence_of_the_exact_share_when_there_is_room():
    keys, values, ctx = _surprising_sentence_case()
    kept = {}
    for whole in (False, True):
        m = kvmerge.get_method("evictmerge", budget=17, sinks=2, window=10, recent=0.0, exact=3 / 17, whole=whole)
        m.setup_all(Runtime(TinyTokenizer()))
        exact = m._exact_slots(keys, torch.zeros(1, 2, 60), ctx, 17, 10)
        kept[whole] = set(exact[0, 0].nonzero().squeeze(1).tolist())
    assert len(kept[False]) == 3 and kept[False] < set(range(20, 25)) and kept[True] == set(range(20, 25))
    ctx.target = 14  # room for 2 only: the sentence cannot be completed, the plain top-k stays
    m = kvmerge.get_method("evictmerge", budget=14, sinks=2, window=10, recent=0.0, exact=0.2, whole=True)
    m.setup_all(Runtime(TinyTokenizer()))
    assert int(m._exact_slots(keys, torch.zeros(1, 2, 60), ctx, 14, 10).sum(-1).max()) == 2


def test_estimated_normaliser_is_exact_when_its_sample_covers_the_vocabulary(monkeypatch):
    model = tiny_model(vocab_size=3000)
    ids = torch.tensor([random_ids(200, seed=11, vocab=3000)])
    s = kvmerge.Session(model, 1)
    with torch.no_grad():
        _, hidden, x, _ = s._feed(ids.tolist(), hidden=True)
        exact = km.token_surprisal(model, hidden, x)  # 3000 ids: below the threshold, exact
        with monkeypatch.context() as m:  # a tail sample as large as the vocabulary is all the rest
            m.setattr(km, "_normaliser_ids", functools.partial(km._normaliser_ids, tail=3000))
            covered = km.token_surprisal(model, hidden, x, exact_below=100)
        loss = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
    assert torch.allclose(exact[0, 1:], loss, atol=1e-4)
    assert torch.allclose(covered, exact, atol=1e-4)


def test_the_estimate_threshold_is_read_at_call_time(monkeypatch):
    model = tiny_model(vocab_size=3000)
    s = kvmerge.Session(model, 1)
    with torch.no_grad():
        _, hidden, x, _ = s._feed([random_ids(100, seed=12, vocab=3000)], hidden=True)
        calls = []
        real = km._normaliser_ids
        monkeypatch.setattr(km, "_normaliser_ids", lambda *a: calls.append(1) or real(*a))
        km.token_surprisal(model, hidden, x)
        assert calls == []  # 3000 ids: exact
        monkeypatch.setattr(km, "EXACT_SURPRISAL_BELOW", 0)
        km.token_surprisal(model, hidden, x)
        assert calls == [1]


def test_the_estimate_samples_a_sixteenth_of_the_vocabulary_at_most_16384_outside_the_shortlist():
    hidden, ids = torch.zeros(1, 64, 4), torch.arange(10)[None]
    for vocab, want in ((3000, 187), (49152, 3072), (262144, 16384)):
        def logits_of(h, vocab=vocab):
            return torch.arange(vocab, dtype=torch.float32).expand(*h.shape[:-1], vocab)
        shortlist, sample = km._normaliser_ids(logits_of, hidden, ids, vocab)
        assert set(shortlist.tolist()) == set(range(10)) | set(range(vocab - 256, vocab))  # own ids and the top
        assert len(sample) == want and not set(sample.tolist()) & set(shortlist.tolist())
