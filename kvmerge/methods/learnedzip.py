"""LearnedZip (kvmerge's own): KVzip's scores predicted from the prefill's own queries, keys and values."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scorer import KINDS, find, unrotate
from .base import CarriedScores, Needs, ScoringMethod
from .registry import register


@register
@dataclass
class LearnedZip(CarriedScores, ScoringMethod):
    """Each entry scores exp(the learned scorer's prediction of its log KVzip score) (`kvmerge.scorer`):
    a ridge regression per compressed layer from the token's pre-RoPE queries, key and value to the
    attention KVzip would find it gets while the model repeats the context, trained offline on text
    shipped with Python and Perl (`kvmerge train-scorer`). No second forward: the prefill's own
    queries, un-rotated. Selection as any `ScoringMethod`; by default KVzip's global per-head
    allocation (`alloc="head"`), which also runs under a chunked prefill (each chunk's entries scored
    as it arrives, kept entries keep their scores).

    `scorer`: the learned model's kind, "linear" (ridge regression) or "mlp" (one hidden layer, as
    KVzap's MLP; `kvmerge train-scorer --kind mlp`).

    `sharpen`: the scores are exp(`sharpen` × the prediction). A monotone change: the picks, global
    allocation included, do not depend on it; as merge weights (`learnedmerge`) a larger `sharpen`
    lets an entry predicted low move the entry it joins less (a ridge's predictions are shrunk towards
    their mean, so their spread is below the true scores')."""

    alloc: str = "head"
    sharpen: float = 1.0
    scorer: str = "linear"
    name = "learnedzip"
    requires = Needs(queries=-1, rotary=True)

    def __post_init__(self):
        super().__post_init__()
        if not self.sharpen > 0:
            raise ValueError(f"learnedzip needs sharpen > 0, got {self.sharpen}")
        if self.scorer not in KINDS:
            raise ValueError(f"learnedzip's scorer must be one of {', '.join(KINDS)}, got {self.scorer!r}")

    def setup(self, runtime):
        if runtime.config is None:
            raise ValueError("learnedzip needs the model's config to find its scorer's weights")
        self._scorer, self._rotary = find(runtime.config, self.scorer), runtime.rotary
        self._cos_sin = (None, None, None)  # (the positions they are for, cos, sin)

    def fresh_scores(self, keys, values, ctx):
        if ctx.queries is None or not hasattr(self, "_scorer"):
            raise ValueError("learnedzip scores the prompt's own queries: compress through a runtime, at prefill")
        fresh = min(ctx.queries.shape[2], keys.shape[2])
        if self._cos_sin[0] != (ctx.seen, fresh):  # the same positions in every layer
            self._cos_sin = ((ctx.seen, fresh), *self._rotary(torch.arange(ctx.seen - fresh, ctx.seen)))
        _, cos, sin = self._cos_sin
        q, k, v = (x[:, :, x.shape[2] - fresh:] for x in (ctx.queries, keys, values))
        q, k = unrotate(q.float(), cos, sin), unrotate(k.float(), cos, sin)
        return (self.sharpen * self._scorer.predict(ctx.layer_idx, q, k, v)).exp()
