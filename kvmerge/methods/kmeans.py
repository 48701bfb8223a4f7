"""k-means clustering of keys: the clustering baseline of CentroidKV's complexity comparison."""

from dataclasses import dataclass

from ..ops.kmeans import lloyd
from ..ops.kv import KV
from ..ops.merge import merge_clusters
from .base import Method, Needs
from .registry import register


@register
@dataclass
class KMeans(Method):
    """Per layer and KV head, the region between sinks and window is clustered into k = budget −
    protected clusters by `iters` Lloyd iterations on keys; each cluster becomes its mass-weighted
    centroid (keys and values) with log-mass in the logits (at least one cluster: mass is never
    dropped). Cost O(iters · n · k · d) per head."""

    iters: int = 5
    name = "kmeans"
    requires = Needs(merges=True)

    def compress(self, keys, values, log_n, ctx):
        sinks, middle, recent = KV(keys, values, log_n).split(ctx.sinks, ctx.window)
        k = max(ctx.target - sinks.slots - recent.slots, 1)  # no room: one cluster keeps the middle's mass
        if middle.slots <= k:
            return KV(keys, values, log_n)
        assign = lloyd(middle.keys, middle.log_n, k, self.iters)
        return KV.cat(sinks, merge_clusters(*middle, assign, k), recent)
