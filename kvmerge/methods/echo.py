"""Echo (kvmerge's own): KVzip's scores guessed from the prefill's own queries, without its second forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.scores import rotate_half
from .base import CarriedScores, Needs, ScoringMethod
from .registry import register


@register
@dataclass
class Echo(CarriedScores, ScoringMethod):
    """KVzip keeps what the model attends to while repeating the context. A repeat's query for token t
    is much like the prefill's own query at t (the same token, the same text before it), asked about
    one context length later. Echo takes every prefill query, rotates it `shift` positions on (RoPE;
    default: the tokens seen), and lets it attend to the whole prompt, beside its own last `own` keys
    at their true distance (standing in for the repeat's own recent tokens): an entry's score is the
    highest probability any query head of its KV group gives it (`echo_attention`).
    Costs the prefill's attention once more (n² per head), not a second forward. Selection as any
    `ScoringMethod` (`alloc` included); under chunked prefill each chunk's queries score its own
    fresh entries and kept entries keep their scores."""

    own: int = 16
    shift: int = 0
    name = "echo"
    experimental = True
    requires = Needs(queries=-1, rotary=True)

    def __post_init__(self):
        super().__post_init__()
        if self.own < 0 or self.shift < 0:
            raise ValueError(f"echo needs own >= 0 and shift >= 0, got own={self.own}, shift={self.shift}")

    def setup(self, runtime):
        self._cos_sin = runtime.rotary

    def prepare(self, runtime, token_rows, layers):
        self._memo = runtime.memo  # shared by every restore of one prefill: one pass serves every budget

    def scores(self, keys, log_n, ctx):
        if ctx.queries is None:
            raise ValueError("echo needs the prompt's queries (prefill)")
        if not hasattr(self, "_cos_sin"):
            raise ValueError("echo reads the model's rotary embedding: compress through a Session")
        memo = getattr(self, "_memo", {})
        key = ("echo", self.own, self.shift, ctx.layer_idx, tuple(ctx.rows.tolist()), keys.shape[2], ctx.seen)
        if key not in memo:
            fresh = min(ctx.queries.shape[2], keys.shape[2])
            cos, sin = (x[0] for x in self._cos_sin(torch.tensor([self.shift or ctx.seen or keys.shape[2]])))
            memo[key] = torch.stack([echo_attention(ctx.queries[b, :, ctx.queries.shape[2] - fresh:], keys[b],
                                                    None if log_n is None else log_n[b], ctx.scaling, cos, sin,
                                                    self.own) for b in range(keys.shape[0])])
        return self.with_carried(memo[key], keys.shape[2], ctx)


def echo_attention(queries, keys, log_n, scaling: float, cos, sin, own: int = 16, block: int = 256):
    """KVzip's reconstruction scores guessed from the prefill's own queries, with no second forward.

    queries `(hq, q, d)` post-RoPE, of the positions of the last q of the s keys `(h, s, d)`; log_n
    `(h, s)` or None; cos, sin `(d,)` a RoPE rotation by Δ (about the context's length: where a repeat
    of the context would ask each query again). Each query, moved Δ on, attends to all s keys; beside
    them, as the repeat's own recent keys, it sees its last `own` keys at their true distance (causal).
    → `(h, q)`: for each of the last q keys, the highest probability any query head of its group gives it
    at any position (softmax over the s keys and the `own` ones)."""
    hq, q, _ = queries.shape
    h, s, _ = keys.shape
    g = hq // h
    moved = queries.float() * cos + rotate_half(queries.float()) * sin
    at = torch.arange(s - q, s, device=keys.device)  # each query's own position among the key slots
    near = at[:, None] - torch.arange(own, device=keys.device)  # (q, own): its last `own` slots
    bias = torch.zeros(h, s, device=keys.device) if log_n is None else log_n.float()
    out = torch.zeros(h, s, device=keys.device)
    for j in range(h):
        k = keys[j].float()
        for c in range(0, q, block):
            z = moved[j * g:(j + 1) * g, c:c + block] @ k.T * scaling + bias[j]  # (g, blk, s)
            idx = near[c:c + block]
            z_own = torch.einsum("gbd,bod->gbo", queries[j * g:(j + 1) * g, c:c + block].float(),
                                 k[idx.clamp(min=0)]) * scaling + bias[j][idx.clamp(min=0)]
            z_own = z_own.masked_fill(idx < 0, float("-inf"))
            lse = torch.logaddexp(torch.logsumexp(z, -1, keepdim=True), torch.logsumexp(z_own, -1, keepdim=True))
            out[j] = torch.maximum(out[j], z.sub_(lse).amax((0, 1)).exp())
    return out[:, s - q:]

