"""k-means clustering of keys: the clustering baseline of CentroidKV's complexity comparison."""

from dataclasses import dataclass

from ..ops.kmeans import lloyd
from ..ops.merge import cat_slots, merge_clusters
from .base import Method, register, split_protected


@register
@dataclass
class KMeans(Method):
    """Per layer and KV head, the region between sinks and window is clustered into k = budget −
    protected clusters by `iters` Lloyd iterations on keys; each cluster becomes its mass-weighted
    centroid (keys and values) with log-mass in the logits. Cost O(iters · n · k · d) per head."""

    iters: int = 5
    name = "kmeans"

    def compress(self, keys, values, log_n, ctx):
        head, mid, tail = zip(*(split_protected(x, ctx.sinks, ctx.window) for x in (keys, values, log_n)))
        k = ctx.target - head[0].shape[2] - tail[0].shape[2]
        if k <= 0:
            return cat_slots(head, tail)
        assign = lloyd(mid[0], mid[2], k, self.iters)
        return cat_slots(head, merge_clusters(*mid, assign, k), tail)
