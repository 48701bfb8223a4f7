"""ExpectMerge (kvmerge's own): `surprisemerge` whose picks and merge weights come from expected attention."""

from dataclasses import dataclass, field

from .base import ScoringMethod
from .mixed_attention import MixedAttention
from .registry import register
from .surprisemerge import SurpriseMerge


@register
@dataclass
class ExpectMerge(SurpriseMerge):
    """The budget in `surprisemerge`'s three shares: the recent window (50%), the sentences of highest
    mean surprisal (25%, kept exact) and the picks of `mixed_attention` (the rest): future attention
    estimated as the mean of Expected Attention's and the last prompt queries' distributions, × ‖v‖.
    Every other entry joins its most key-similar window or picked entry, weighted by that same
    estimate (kept keys stay, values become weighted means, log(cluster's estimate / kept entry's)
    is added to the logits), so that the merges follow the model the picks were made by.
    Equal to `surprisemerge:base=mixed_attention:calibrate_with=expected`."""

    base: ScoringMethod = field(default_factory=MixedAttention)
    calibrate_with: str = "expected"
    name = "expectmerge"
