"""SemantiCache: vectorised GSC against a plain reference, mass, anchors, budget, delimiter tables."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import SentencePieceBPETokenizer
from transformers import PreTrainedTokenizerFast

import kvmerge
from kvmerge.cache import bytes_per_token
from kvmerge.methods.base import LayerContext
from kvmerge.ops.gsc import chunk_layout, delimiter_table, greedy_seed_clustering, token_kind

from .conftest import random_ids, tiny_model


def reference_gsc(sim, tau):
    """One chunk, token by token, exactly as the paper states it."""
    n = sim.shape[0]
    root, assigned = list(range(n)), [False] * n
    for i in range(n):
        if assigned[i]:
            continue
        assigned[i] = True
        for j in range(i + 1, n):
            if not assigned[j] and sim[i, j] >= tau:
                root[j], assigned[j] = i, True
    return root


def reference_semanticache(keys, values, kinds, tau, cap, sinks, window):
    """Whole method for one head: chunks between anchors (≤ cap), GSC, mean cores. Returns entry list."""
    s = keys.shape[0]
    lo, hi = sinks, s - window
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)
    groups, run = [], []
    for t in range(lo, hi):
        if kinds[t - lo]:
            if run:
                groups.append(run)
            groups.append([t])
            run = []
            continue
        run.append(t)
        if len(run) == cap:
            groups.append(run)
            run = []
    if run:
        groups.append(run)
    clusters = [[t] for t in range(lo)]
    for g in groups:
        if len(g) == 1 and kinds[g[0] - lo]:
            clusters.append(g)
            continue
        sim = unit[g] @ unit[g].T
        root = reference_gsc(sim, tau)
        for i in sorted(set(root)):
            clusters.append([g[j] for j in range(len(g)) if root[j] == i])
    clusters += [[t] for t in range(hi, s)]
    return [(keys[c].double().mean(0), values[c].double().mean(0), len(c)) for c in clusters]


@settings(max_examples=60, deadline=None)
@given(L=st.integers(1, 20), C=st.integers(1, 4), tau=st.floats(-1.0, 1.0), seed=st.integers(0, 10**6),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_vectorised_gsc_equals_reference(L, C, tau, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, L + 1, (C,), generator=g)
    valid = (torch.arange(L)[None, :] < lengths[:, None])[:, None, :].expand(C, 2, L)
    x = torch.randn(C, 2, L, 8, generator=g).to(dtype)
    x[..., 1::3, :] = x[..., :1, :]  # some near-duplicates so clusters form
    unit = torch.nn.functional.normalize(x.float(), dim=-1)
    sim = unit @ unit.transpose(-1, -2)
    root = greedy_seed_clustering(sim, valid, torch.full((C, 2), tau))
    for c in range(C):
        for h in range(2):
            n = int(lengths[c])
            assert root[c, h, :n].tolist() == reference_gsc(sim[c, h, :n, :n], tau)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(40, 120), tau=st.floats(-0.2, 0.9), cap=st.integers(2, 16), seed=st.integers(0, 10**6),
       anchor_rate=st.floats(0.0, 0.5))
def test_method_equals_reference_pipeline(n, tau, cap, seed, anchor_rate):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(1, 2, n, 8, generator=g), torch.randn(1, 2, n, 8, generator=g)
    keys[:, :, 5::4] = keys[:, :, 4::4][:, :, : keys[:, :, 5::4].shape[2]]
    ids = torch.randint(0, 10, (1, n), generator=g)
    table = (torch.rand(10, generator=g) < anchor_rate).to(torch.int8) * 2
    method = kvmerge.get_method("semanticache", budget=1.0, tau=tau, chunk_cap=cap, sinks=4, window=8)
    method.stats.update(fallback_layers=0, tau_mean=[])
    method._table = table
    ctx = LayerContext(0, 1, target=n, sinks=4, window=8, scaling=1.0, token_ids=ids)
    k, v, ln = method.compress(keys, values, torch.zeros(1, 2, n), ctx)
    kinds = table[ids[0, 4:n - 8]].tolist()
    for h in range(2):
        ref = reference_semanticache(keys[0, h], values[0, h], kinds, tau, cap, 4, 8)
        live = torch.isfinite(ln[0, h])
        assert int(live.sum()) == len(ref)
        for (rk, rv, size), gk, gv, gl in zip(ref, k[0, h][live], v[0, h][live], ln[0, h][live]):
            assert torch.allclose(gk.double(), rk, atol=1e-5) and torch.allclose(gv.double(), rv, atol=1e-5)
            assert math.isclose(float(gl), math.log(size), abs_tol=1e-6)


def _compress(budget, n=200, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 3, n, 16, generator=g), torch.randn(2, 3, n, 16, generator=g)
    ids = torch.randint(0, 50, (2, n), generator=g)
    method = kvmerge.get_method("semanticache", budget=budget, **kw)
    method.stats.update(fallback_layers=0, tau_mean=[])
    method._table = (torch.arange(50) % 7 == 0).to(torch.int8) * 2
    ctx = LayerContext(0, 1, target=method.target(n), sinks=4, window=32, scaling=1.0, token_ids=ids)
    return keys, values, ids, method, method.compress(keys, values, torch.zeros(2, 3, n), ctx)


@pytest.mark.parametrize("budget", [0.5, 0.45, 0.3, 0.2])
def test_mass_conserved_protected_untouched_budget_met(budget):
    keys, values, ids, method, (k, v, ln) = _compress(budget)
    n, target = keys.shape[2], method.target(keys.shape[2])
    anchor = ids[:, 4:n - 32] % 7 == 0
    runs = (~anchor & torch.nn.functional.pad(anchor, (1, 0), value=True)[:, :-1]).sum(-1)
    min_entries = int((36 + anchor.sum(-1) + runs).max())
    assert (method.stats["fallback_layers"] > 0) == (min_entries > target)
    assert k.shape[2] <= target  # entries per (row, head), padding included
    assert torch.allclose(ln.exp().sum(-1), torch.full((2, 3), float(n)))
    assert torch.equal(k[:, :, :4], keys[:, :, :4]) and torch.equal(v[:, :, :4], values[:, :, :4])
    live = torch.isfinite(ln)
    for b in range(2):
        for h in range(3):
            lk = k[b, h][live[b, h]]
            assert torch.equal(lk[-32:], keys[b, h, -32:])
            if min_entries <= target:  # no fallback: anchors kept bit for bit
                anchors = keys[b, h, 4:n - 32][anchor[b]]
                assert all(any(torch.equal(a, x) for x in lk) for a in anchors)


def test_every_core_is_the_mean_of_its_members():
    keys, values, _, method, (k, v, ln) = _compress(0.3, n=120, tau=0.2)
    # with a fixed τ, recover members by re-running the reference on row 0 head 0 is covered above;
    # here: the mass-weighted sum of cores equals the sum of all keys (means of a partition)
    total = (k.double() * ln.exp().double()[..., None]).nan_to_num().sum(2)
    assert torch.allclose(total, keys.double().sum(2), atol=1e-4)


def test_budget_met_in_bytes_on_a_model():
    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    ids = [i % len(tok) for i in random_ids(300, vocab=len(tok))]
    m = kvmerge.get_method("semanticache", budget=0.25)
    out = kvmerge.generate_ids(model, ids, [3, 4], m, max_new_tokens=1, tokenizer=tok)
    per_slot = bytes_per_token(model.config, torch.float32) // 2  # per layer
    log_n_bytes = 2 * 4  # per slot per layer: kv heads × float32
    assert max(out.stats["cache_entries"]) <= 75
    assert out.stats["cache_bytes"] <= 75 * 2 * (per_slot + log_n_bytes)


def test_tau_above_one_equals_full_cache():
    model = tiny_model()
    ids, q = random_ids(120, seed=3), random_ids(6, seed=4)
    full = kvmerge.generate_ids(model, ids, q, kvmerge.get_method("full"), max_new_tokens=12)
    m = kvmerge.get_method("semanticache", budget=1.0, tau=1.01, chunking="fixed")
    got = kvmerge.generate_ids(model, ids, q, m, max_new_tokens=12)
    assert got.tokens == full.tokens and got.stats["cache_entries"] == full.stats["cache_entries"]


def test_a_fixed_tau_says_it_does_not_meet_the_budget(caplog):
    """τ = 1.01 merges nothing, so a 0.5 budget is exceeded: a warning names it; none at budget 1.0."""
    model = tiny_model()
    ids, q = random_ids(120, seed=3), random_ids(6, seed=4)
    with caplog.at_level("WARNING", logger="kvmerge"):
        kvmerge.get_method("semanticache", budget=1.0, tau=1.01)
        assert caplog.messages == []
        m = kvmerge.get_method("semanticache", budget=0.5, tau=1.01, chunking="fixed")
    assert len(caplog.messages) == 1 and "not enforced" in caplog.messages[0]
    full = kvmerge.generate_ids(model, ids, q, kvmerge.get_method("full"), max_new_tokens=1)
    assert kvmerge.generate_ids(model, ids, q, m, max_new_tokens=1).stats["cache_entries"] == full.stats["cache_entries"]


@pytest.mark.parametrize("chunking", ["fixed", "none"])
def test_ablation_chunkings_meet_budget(chunking):
    _, _, _, method, (k, v, ln) = _compress(0.25, chunking=chunking)
    assert k.shape[2] <= method.target(200)


def test_chunk_layout_splits_runs_at_anchors_and_cap():
    anchors = torch.tensor([[0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 0]], dtype=torch.bool)
    chunk, offset, rows, longest = chunk_layout(anchors, cap=3)
    assert chunk.tolist() == [[0, 0, -1, 1, 1, 1, 2, 2, -1, -1, 3]]
    assert offset[0, [0, 1, 3, 4, 5, 6, 7, 10]].tolist() == [0, 1, 0, 1, 2, 0, 1, 0]
    assert longest == 3 and rows.tolist() == [0, 0, 0, 0]


def test_token_kinds():
    assert [token_kind(t) for t in [".", " ,", "\u0120;", ".\n\n", '."', "),", "\t", "word", " 3", "'", "?!"]] == \
        [2, 1, 1, 2, 2, 1, 2, 0, 0, 0, 2]


def _sp_tokenizer():
    sp = SentencePieceBPETokenizer(unk_token="<unk>")
    text = ["The cat sat. The dog ran, then stopped; why? Because: it was tired!\nNew line here.",
            "alpha . beta , gamma ; delta : epsilon ? zeta ! eta"] * 20
    sp.train_from_iterator(text, vocab_size=120, min_frequency=1, special_tokens=["<s>", "</s>", "<unk>"])
    return PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_delimiter_table_sentencepiece():
    tok = _sp_tokenizer()
    table = delimiter_table(tok)
    ids = tok("alpha . beta , gamma ; delta : epsilon ? zeta ! eta")["input_ids"]
    kinds = {tok.convert_ids_to_tokens(i): int(table[i]) for i in ids}
    assert [kinds[p] for p in ["▁.", "▁,", "▁;", "▁:", "▁?", "▁!"]] == [2, 1, 1, 1, 2, 2]
    assert kinds["▁alpha"] == 0 and kinds["▁beta"] == 0
    assert table[tok.convert_tokens_to_ids("▁sat.")] == 0  # a word with a period is not a delimiter
    assert table[tok.convert_tokens_to_ids("<s>")] == 2


@pytest.mark.ci_slow
def test_delimiter_table_smollm2():
    _, tok = kvmerge.load_model()
    table = delimiter_table(tok)
    kinds = {tok.decode([i]): int(table[i]) for i in tok('Hi. a, b; c: d?\n\nx."\ny),z <|im_start|>')["input_ids"]}
    assert kinds["."] == 2 and kinds[","] == 1 and kinds[";"] == 1 and kinds[":"] == 1
    assert kinds["Hi"] == 0 and kinds[" a"] == 0 and kinds["<|im_start|>"] == 2
    assert any("\n" in k and v == 2 for k, v in kinds.items())
