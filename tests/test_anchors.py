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
