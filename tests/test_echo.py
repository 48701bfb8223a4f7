"""Echo: KVzip's reconstruction scores guessed from the prefill's own queries."""

import pytest
import torch


def _echo_dense(queries, keys, log_n, scaling, cos, sin, own):
    """The same scores from one dense softmax per query head: [all keys moved on; own last keys]."""
    hq, q, d = queries.shape
    h, s, _ = keys.shape
    g = hq // h
    rot = torch.cat([-queries[..., d // 2:], queries[..., :d // 2]], -1)
    moved = queries * cos + rot * sin
    bias = torch.zeros(h, s) if log_n is None else log_n
    out = torch.zeros(h, s)
    for a in range(hq):
        j = a // g
        for i in range(q):
            pos = s - q + i
            near = [pos - o for o in range(own) if pos - o >= 0]
            z = torch.cat([moved[a, i] @ keys[j].T * scaling + bias[j],
                           queries[a, i] @ keys[j, near].T * scaling + bias[j, near]])
            out[j] = torch.maximum(out[j], z.softmax(-1)[:s])
    return out[:, s - q:]


@pytest.mark.parametrize("q,own,log_n", [(20, 4, False), (12, 1, True), (20, 0, False)])
def test_echo_attention_equals_a_dense_softmax_over_moved_and_own_keys(q, own, log_n):
    from kvmerge.methods.echo import echo_attention

    g = torch.Generator().manual_seed(q + own)
    queries, keys = torch.randn(4, q, 8, generator=g), torch.randn(2, 20, 8, generator=g)
    ln = torch.randn(2, 20, generator=g).clamp(max=0) if log_n else None
    angle = torch.rand(4, generator=g) * 3
    cos, sin = torch.cat([angle.cos()] * 2), torch.cat([angle.sin()] * 2)
    got = echo_attention(queries, keys, ln, 0.35, cos, sin, own, block=7)
    torch.testing.assert_close(got, _echo_dense(queries, keys, ln, 0.35, cos, sin, own))
    assert got.shape == (2, q) and (got > 0).all() and (got <= 1).all()
