"""The question-agnostic anchors: scores checked against hand-computed cases."""

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


def test_expected_attention_equals_a_direct_computation_from_pre_rope_queries():
    """Scores from captured post-RoPE queries (un-rotated) == the paper's formula computed from the
    q_proj outputs, with the mean rotation over future positions built matrix by matrix."""
    from .conftest import random_ids, tiny_model

    model = tiny_model()
    ids = random_ids(60, seed=2)
    pre = {}
    hook = model.model.layers[1].self_attn.q_proj.register_forward_hook(lambda m, a, o: pre.setdefault("q", o))
    m = kvmerge.get_method("expected_attention", budget=20, sinks=4, window=8, n_future=16, epsilon=0.01)
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
