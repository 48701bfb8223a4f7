"""ExpectMerge (kvmerge's own): `surprisemerge` with Expected Attention in place of observed attention."""

from dataclasses import dataclass, field

from .base import ScoringMethod
from .expected_attention import ExpectedAttention
from .registry import register
from .surprisemerge import SurpriseMerge


@register
@dataclass
class ExpectMerge(SurpriseMerge):
    """The budget in `surprisemerge`'s three shares: the recent window (50%), the sentences of highest
    mean surprisal (25%, kept exact) and Expected Attention's picks (the rest). Every other entry joins
    its most key-similar window or EA entry, weighted by EA's expected attention (kept keys stay,
    values become expected-attention-weighted means, log(cluster's expected mass / kept entry's) is
    added to the logits): the query model the picks were made by also weighs the merges, so the mean
    future query reads the same output from a merged cluster as from its members.
    Equal to `surprisemerge:base=expected_attention:calibrate_with=expected`."""

    base: ScoringMethod = field(default_factory=ExpectedAttention)
    calibrate_with: str = "expected"
    name = "expectmerge"
