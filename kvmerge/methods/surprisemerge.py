"""SurpriseMerge (kvmerge's own): surprising sentences kept exact, attended entries absorb the rest."""

from dataclasses import dataclass

from .evictmerge import EvictMerge
from .registry import register


@register
@dataclass
class SurpriseMerge(EvictMerge):
    """`evictmerge` with its budget in three shares: the recent window (`recent`, 50%), the sentences
    of highest mean surprisal (`exact`, 25%; kept bit-exact, they absorb nothing) and SnapKV's picks
    (the rest); the share's last sentence is completed from SnapKV's share (`whole`). Every evicted
    entry joins its most key-similar window or SnapKV entry with attention-calibrated weights.
    The exact share keeps out-of-place facts (a needle's digits) that similarity merging fuses and
    attention-scored eviction drops; the attended share and calibrated merging keep fidelity."""

    recent: float = 0.5
    exact: float = 0.25
    whole: bool = True
    name = "surprisemerge"
