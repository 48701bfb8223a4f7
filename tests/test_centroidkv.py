"""CentroidKV: vectorised CSM against a per-token reference, exact centroids across rounds, decoding."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvmerge
from kvmerge.methods.base import LayerContext
from kvmerge.ops.csm import csm_round, partition_a

from .conftest import random_ids, tiny_model


def reference_round(keys, log_n, m, chunk):
    """One head, plain Python: A = even offsets, best B in the chunk, top-m A merge into partners."""
    n = keys.shape[0]
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    cands = []
    for a in range(n):
        if (a % chunk) % 2:
            continue
        start = a - a % chunk
        best, partner = float("-inf"), None
        for bb in range(start, min(start + chunk, n)):
            if (bb % chunk) % 2 == 1:
                s = float(unit[a] @ unit[bb])
                if s > best:
                    best, partner = s, bb
        if partner is not None:
            cands.append((best, a, partner))
    cands.sort(key=lambda c: -c[0])
    into = {a: p for _, a, p in cands[:m]}
    groups = {t: [t] for t in range(n) if t not in into}
    for a, p in into.items():
        groups[p].append(a)
    mass = log_n.exp()
    out = []
    for t in sorted(groups):
        members = groups[t]
        w = mass[members].double()
        out.append(((keys[members].double() * w[:, None]).sum(0) / w.sum(), float(w.sum())))
    return out


@settings(max_examples=60, deadline=None)
@given(n=st.integers(4, 90), chunk=st.sampled_from([2, 4, 8, 32]), frac=st.floats(0.05, 0.5),
       seed=st.integers(0, 10**6))
def test_vectorised_round_equals_reference(n, chunk, frac, seed):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64)
    log_n = torch.randint(1, 4, (1, 2, n), generator=g).double().log()
    n_a = int(partition_a(n, chunk).sum())
    m = max(1, min(round(frac * n), n // 2, n_a - (1 if n % chunk == 1 else 0)))
    k, _, ln = csm_round(keys, keys.clone(), log_n.float(), m, chunk, partition_a(n, chunk))
    for h in range(2):
        ref = reference_round(keys[0, h], log_n[0, h], m, chunk)
        assert k.shape[2] == len(ref) == n - m
        for (rk, rm), gk, gl in zip(ref, k[0, h], ln[0, h]):
            assert torch.allclose(gk, rk, atol=1e-9) and abs(float(gl.exp()) - rm) < 1e-4


def _tracked_compress(n=300, rounds_budget=0.2, seed=0):
    """Keys carry one-hot identity channels so every centroid's members can be read back."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 2, n, 8, generator=g)
    ident = torch.eye(n).expand(1, 2, n, n)
    keys = torch.cat([base, ident * 1e-3], dim=-1).double()
    values = torch.randn(1, 2, n, 4, generator=g).double()
    method = kvmerge.get_method("centroidkv", budget=rounds_budget, window=16, chunk_size=8)
    ctx = LayerContext(0, 1, target=method.target(n), sinks=4, window=16, scaling=1.0)
    return keys, values, method, method.compress(keys, values, torch.zeros(1, 2, n), ctx)


def test_centroids_are_exact_means_after_many_rounds():
    keys, values, method, (k, v, ln) = _tracked_compress()
    assert method.stats["rounds"] > 3 and k.shape[2] == method.target(300)
    weights = k[..., 8:] * 1e3 * ln.exp()[..., None]  # membership counts per original token
    assert torch.allclose(weights.sum(2), torch.ones(1, 2, 300, dtype=torch.float64), atol=1e-6)
    members = weights / weights.sum(-1, keepdim=True)
    assert torch.allclose(k[..., :8], members @ keys[..., :8], atol=1e-9)
    assert torch.allclose(v, members @ values, atol=1e-9)
    assert torch.allclose(ln.exp().sum(-1), torch.full((1, 2), 300.0, dtype=torch.float32))


def test_merging_adjacent_duplicates_leaves_attention_unchanged():
    model = tiny_model()
    ids = random_ids(64, seed=1)
    outs = []
    for merge in (False, True):
        s = kvmerge.Session(model, 1)
        with torch.no_grad():
            s.forward([ids])
            for layer in s.cache.layers:
                k, v = layer.keys.clone(), layer.values.clone()
                k[:, :, 1::2], v[:, :, 1::2] = k[:, :, 0::2], v[:, :, 0::2]  # pairs (A, B) identical
                ln = torch.zeros(1, 2, 64)
                if merge:
                    k, v, ln = csm_round(k, v, ln, 32, 32, partition_a(64, 32))
                layer.replace(k, v, ln)
            outs.append(s.forward([[7, 8]]))
    assert s.cache.layers[0].entries == 32 + 2
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


@pytest.mark.parametrize("decode_budget", ["fixed", "fraction"])
def test_long_generation_stays_in_budget(decode_budget):
    model = tiny_model()
    method = kvmerge.get_method("centroidkv", budget=0.25, window=16, interval=64, decode_budget=decode_budget)
    s = kvmerge.Session(model, 1, method)
    ids = random_ids(400, seed=2)
    seen_entries = []
    with torch.no_grad():
        logits = s.prefill([ids])
        target = method.target(400)
        for step in range(1000):
            logits = s.forward([[int(logits.argmax(-1))]])
            assert torch.isfinite(logits).all()
            layer = s.cache.layers[-1]
            tokens = 401 + step
            limit = target if decode_budget == "fixed" else method.target(tokens)
            assert layer.entries <= limit + 64
            seen_entries.append(layer.entries)
            assert round(float(layer.mass().sum())) == tokens * 2  # degrees sum to tokens seen (2 heads)
    assert s.cache.get_seq_length() == 1400 and max(seen_entries) > min(seen_entries)
    # positions: layer 0 query for a fresh token equals the one of an uncompressed session at position 1400
    q = []
    for sess in (s, None):
        if sess is None:
            sess = kvmerge.Session(model, 1)
            with torch.no_grad():
                sess.forward([ids + [1] * 1000])
        with torch.no_grad():
            sess.forward([[9]], capture=1)
        q.append(sess.states[0].queries)
    assert torch.allclose(q[0], q[1], atol=1e-5)


@pytest.mark.parametrize("partition", ["alternating", "random", "halves"])
@pytest.mark.parametrize("scope", ["global", "chunk"])
def test_ablation_options_meet_budget(partition, scope):
    model = tiny_model()
    m = kvmerge.get_method("centroidkv", budget=0.3, window=8, partition=partition, scope=scope)
    out = kvmerge.generate_ids(model, random_ids(200), [3], m, max_new_tokens=2)
    assert out.stats["cache_entries"] == [60, 60]


def test_batch_and_bf16():
    model = tiny_model(dtype=torch.bfloat16)
    m = kvmerge.get_method("centroidkv", budget=0.5, window=8, interval=4)
    ctx = [random_ids(90, seed=3), random_ids(70, seed=4)]
    batch = kvmerge.generate_ids(model, ctx, [[3], [4, 5]], m, max_new_tokens=12)
    alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=12).tokens[0] for c, q in zip(ctx, [[3], [4, 5]])]
    assert batch.tokens == alone
