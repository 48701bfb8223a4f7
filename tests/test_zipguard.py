"""ZipGuard: KVzip's scores, saturated heads reordered by a fallback. Checked against a reordering done by
hand on a tiny model: same counts as KVzip's global allocation, fallback's top entries in guarded heads."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmerge
from kvmerge import Session
from kvmerge.methods.zipguard import round_robin
from kvmerge.ops.scores import guard_saturated

from .conftest import TinyTokenizer, random_ids, tiny_model


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 4), s=st.integers(2, 30), share=st.floats(0.0, 1.0), seed=st.integers(0, 999))
def test_guarded_heads_keep_their_values_in_the_fallbacks_order(h, s, share, seed):
    g = torch.Generator().manual_seed(seed)
    scores, order = torch.rand(2, h, s, generator=g), torch.randn(2, h, s, generator=g)
    out = guard_saturated(scores, order, share)
    hot = (scores > 0.5).float().mean(-1) > share
    assert torch.equal(out.sort(-1).values, scores.sort(-1).values)  # the same multiset in every head
    assert torch.equal(out[~hot], scores[~hot])  # unsaturated heads untouched
    if hot.any():  # guarded heads rank as the fallback does (no ties in randn)
        assert torch.equal(out[hot].argsort(-1, descending=True), order[hot].argsort(-1, descending=True))


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 3), s=st.integers(1, 30), j=st.integers(0, 30), seed=st.integers(0, 999))
def test_round_robin_ranks_first_the_union_of_each_rankings_top_entries(m, s, j, seed):
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randn(2, 3, s, generator=g) for _ in range(m)]
    merged = round_robin(*parts)
    for r in range(2):
        for h in range(3):
            union = set().union(*(p[r, h].argsort(descending=True)[:j].tolist() for p in parts))
            first = merged[r, h].argsort(descending=True)[:len(union)].tolist()
            assert set(first) == union  # after j turns each ranking's top j, nothing else, are ahead


def _kept(session, full_keys):
    """Per compressible layer: each head's kept positions (live slots matched to the uncompressed keys)."""
    out = {}
    for i in session.cache.compressible:
        layer = session.cache.layers[i]
        live = ~torch.isinf(layer.full_log_n()[0])
        out[i] = [sorted(int((full_keys[i][j] == k).all(-1).nonzero()[0]) for k in layer.keys[0, j][live[j]])
                  for j in range(layer.keys.shape[1])]
    return out


def test_zipguard_keeps_kvzips_counts_and_the_fallbacks_top_entries_in_saturated_heads():
    model, ctx, n = tiny_model(num_hidden_layers=3), random_ids(160, seed=3), 160
    with torch.no_grad():
        full = Session(model, 1, None, TinyTokenizer())
        full.prefill([ctx])
        full_keys = {i: full.cache.layers[i].keys[0] for i in full.cache.compressible}
        zipped = Session(model, 1, kvmerge.get_method("kvzip", budget=0.25, window=8, chunk=64, alloc="head"),
                         TinyTokenizer())
        zipped.prefill([ctx], 8)
        fresh = {i: zipped.states[i].scratch["_kvzip_fresh"][0][:, 4:n - 8]  # outside sinks and window
                 for i in zipped.cache.compressible}
        level = float(torch.cat([f.flatten() for f in fresh.values()]).quantile(0.75))  # a tiny model's scale
        shares = torch.cat([(f > level).float().mean(-1) for f in fresh.values()])
        cut = float(shares.median())  # some heads above the line, some not
        hot = {i: (f > level).float().mean(-1) > cut for i, f in fresh.items()}
        assert 0 < sum(int(x.sum()) for x in hot.values()) < len(shares)
        method = kvmerge.get_method("zipguard", budget=0.25, window=8, chunk=64, alloc="head", saturated=cut, level=level,
                                    fallback="keydiff")
        guarded = Session(model, 1, method, TinyTokenizer())
        guarded.prefill([ctx], 8)
    before, after = _kept(zipped, full_keys), _kept(guarded, full_keys)
    protected = set(range(method.sinks)) | set(range(n - method.window, n))
    for i in guarded.cache.compressible:
        unit = torch.nn.functional.normalize(full_keys[i].float(), dim=-1)
        keydiff = -(unit @ torch.nn.functional.normalize(unit.mean(1), dim=-1)[..., None]).squeeze(-1)  # (h, n)
        for j, (a, b) in enumerate(zip(before[i], after[i])):
            assert len(a) == len(b)  # the same global allocation
            if not hot[i][j]:
                assert a == b
                continue
            free = [p for p in keydiff[j].argsort(descending=True).tolist() if p not in protected]
            assert set(b) == protected | set(free[:len(b) - len(protected)])


def test_zipguard_without_saturated_heads_is_kvzip_and_refuses_what_it_cannot_use():
    model, ctx = tiny_model(num_hidden_layers=2), random_ids(120, seed=4)
    caches = []
    for method in (kvmerge.get_method("kvzip", budget=0.25, window=8, chunk=64, alloc="uniform"),
                   kvmerge.get_method("zipguard", budget=0.25, window=8, chunk=64, saturated=1.0)):
        s = Session(model, 1, method, TinyTokenizer())
        with torch.no_grad():
            s.prefill([ctx], 8)
        caches.append([(s.cache.layers[i].keys, s.cache.layers[i].values) for i in s.cache.compressible])
    for (k0, v0), (k1, v1) in zip(*caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)
    with pytest.raises(ValueError, match="saturated in"):
        kvmerge.get_method("zipguard", saturated=1.5)
    with pytest.raises(TypeError, match="scoring method"):
        kvmerge.get_method("zipguard", fallback="snapkv+full")
