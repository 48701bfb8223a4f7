"""GuardMerge (kvmerge's own): `zipguard`'s picks; the rest merged by KVzip's scores where they rank."""

from dataclasses import dataclass, field, replace

from .base import ScoringMethod
from .registry import register
from .zipguard import ZipGuard
from .zipmerge import ZipMerge


@register
@dataclass
class GuardMerge(ZipMerge):
    """`zipmerge` on `zipguard`'s picks (KVzip's global per-head ranking; each copy head ranked by
    `fallback`, surprisal and echo turn by turn: `ops.scores.round_robin`). Every evicted entry joins
    its most key-similar kept entry of its head, weighted by KVzip's own scores, except in the heads
    whose scores saturate (more than `saturated` of the free entries above zipguard's `level`, one
    half: the heads `zipguard` guards, its own `saturated` and `fallback` set to these), which evict:
    there KVzip's scores say nothing about an entry, and as weights they would blur the picks' values
    (a copied fact's digits) with unrelated entries. On a model without copy heads this is `zipmerge`.
    Equal to `zipmerge:saturated=0.25` with `base=ZipGuard(fallback="surprisal+echo")`. Costs KVzip's
    second prefill and echo's attention pass."""

    base: ScoringMethod = field(default_factory=ZipGuard)
    saturated: float = 0.25
    fallback: str = "surprisal+echo"
    name = "guardmerge"

    def __post_init__(self):
        if isinstance(self.base, ZipGuard):  # one test: the guarded heads evict; one ranking for them
            self.base = replace(self.base, saturated=self.saturated, fallback=self.fallback)
        super().__post_init__()
