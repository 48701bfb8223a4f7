"""ZipMerge (kvmerge's own): KVzip's global picks kept exact, every other entry merged into them."""

from dataclasses import dataclass, field

from .base import ScoringMethod
from .evictmerge import EvictMerge
from .kvzip import KVzip
from .registry import register


@register
@dataclass
class ZipMerge(EvictMerge):
    """KVzip's selection as its paper makes it: the entries the model attends to most while repeating
    the context, one top-k over every layer and KV head (`alloc="head"`: heads keep different counts,
    each layer's heads padded to its largest with empty slots, counted in bytes). Then every evicted
    entry joins its most key-similar kept entry of the same head (`evictmerge`'s merging; sinks and
    padding absorb nothing), weighted by KVzip's own scores (`calibrate_with="base"`: the attention an
    entry got while the context was repeated, so an entry KVzip ranks low moves the entry it joins
    little): kept keys stay, values become weighted means and log(cluster's weight / kept entry's) is
    added to the logits. `calibrate_with="observed"` weighs by the last `obs_window` prompt queries'
    attention instead. Costs KVzip's second prefill.
    Equal to `evictmerge:base=kvzip:alloc=head:recent=0:calibrate_with=base`."""

    base: ScoringMethod = field(default_factory=KVzip)
    alloc: str = "head"
    recent: float = 0.0
    calibrate_with: str = "base"
    name = "zipmerge"
