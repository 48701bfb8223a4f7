"""kvpress's `MergingPress` (kvpress 0.5.5, presses/merging_press.py) as a kvmerge anchor: a base
method's eviction, each evicted value folded into its most key-similar kept entry's value."""

from dataclasses import dataclass, field

from ..ops.kv import KV
from ..ops.merge import fold_values
from ..ops.scores import top_slots
from .base import Needs, ScoringMethod, check_scoring_part
from .expectedattention import ExpectedAttention
from .registry import register


@register
@dataclass
class MergingPress(ScoringMethod):
    """`base`'s scores choose the kept entries exactly as `base` would (beside kvmerge's protected
    sinks and window); then every evicted entry's value is folded into the kept entry whose key is most
    cosine-similar (sinks and window included, as kvpress), with weight max(cos, 0)·‖v_e‖ / (‖v_e‖ +
    ‖v_kept‖), the kept value becoming (v + Σ w v_e) / (1 + Σ w) (`kvmerge.ops.merge.fold_values`,
    tested equal to kvpress's `MergingPress.merge`). Keys and log-mass stay as they were: no log-mass,
    as in kvpress. `similarity_threshold`: a smaller cosine folds nothing; `merge_fraction`: only that
    fraction of each head's evicted entries (the most similar) folds. Prefill only: the base's decode
    policy is not used; global allocation (`alloc`) is refused, as for every merging method.

    kvpress's press has no default base (`press=None`, asserted to be a `ScorerPress`); its tests wrap
    `KnormPress` (and `AdaKVPress(SnapKVPress())`). kvmerge has no Knorm; the default base here is
    `expectedattention`, kvpress's own question-agnostic press (`mergingpress:base=snapkv` etc.)."""

    base: ScoringMethod = field(default_factory=ExpectedAttention)
    similarity_threshold: float = 0.0
    merge_fraction: float = 1.0
    name = "mergingpress"
    allocates = False  # kvpress's press: its base's selection per head, then folded values

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.similarity_threshold <= 1.0:
            raise ValueError(f"similarity_threshold must be in [0, 1], got {self.similarity_threshold}")
        if not 0.0 < self.merge_fraction <= 1.0:
            raise ValueError(f"merge_fraction must be in (0, 1], got {self.merge_fraction}")
        check_scoring_part(self, "base")

    requires = Needs(merges=True)

    def parts(self):
        return [self.base]

    def scores(self, keys, log_n, ctx):
        return self.base.scores(keys, log_n, ctx)

    def layer_target(self, ctx):
        return self.base.layer_target(ctx)

    def compress(self, keys, values, log_n, ctx):
        idx = top_slots(self.scores(keys, log_n, ctx), self.layer_target(ctx), ctx.sinks, ctx.window)
        self.tell_selected(idx, ctx)
        kept = KV(keys, values, log_n).take(idx)
        return KV(kept.keys, fold_values(keys, values, idx, self.similarity_threshold, self.merge_fraction), kept.log_n)
