"""CentroidKV (arXiv 2506.11418): online clustering by Chunked Soft Matching, degree-weighted centroids."""

from __future__ import annotations

from dataclasses import dataclass

from ..ops.csm import PARTITIONS, csm_round, partition_a
from ..ops.kv import KV
from .base import Method, Needs
from .registry import register

DECODE_BUDGETS = ("fixed", "fraction")


@register
@dataclass
class CentroidKV(Method):
    """Rounds of Chunked Soft Matching until the cache fits: inside chunks of `chunk_size`, even
    offsets (A) find their most similar odd offset (B) by key cosine; the best-matched fraction r_j
    of A merges into B partners as degree-weighted centroids (log-degree in the logits).

    r_j = max(r_init − j·r_step, r_min), at most half the eligible entries per round. During decoding
    every `interval` steps the region between sinks and recent window (old centroids included) is
    re-clustered back under budget. `decode_budget="fixed"`: the number of entries kept after prefill;
    `"fraction"`: `budget` × the tokens seen so far. Between re-clusterings the cache grows by at
    most `interval` entries. Ablations: `partition` ("random", "halves"), `scope="chunk"`.
    """

    chunk_size: int = 32
    r_init: float = 0.5
    r_step: float = 0.05
    r_min: float = 0.05
    interval: int = 64
    decode_budget: str = "fixed"
    partition: str = "alternating"
    scope: str = "global"
    seed: int = 0
    name = "centroidkv"
    requires = Needs(merges=True, decode_policy=True)

    def __post_init__(self):
        super().__post_init__()
        if self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {self.partition!r}")
        if self.scope not in ("global", "chunk"):
            raise ValueError(f"scope must be 'global' or 'chunk', got {self.scope!r}")
        if self.decode_budget not in DECODE_BUDGETS:
            raise ValueError(f"decode_budget must be one of {DECODE_BUDGETS}, got {self.decode_budget!r}")
        if self.chunk_size < 2 or self.interval < 1 or not (0 < self.r_min <= self.r_init <= 0.5):
            raise ValueError("need chunk_size >= 2, interval >= 1 and 0 < r_min <= r_init <= 0.5")

    def reduce(self, kv: KV, target: int, sinks: int, window: int) -> KV:
        """Rounds of CSM on the region between sinks and window until at most `target` entries remain."""
        head, middle, tail = kv.split(sinks, window)
        allow = max(target - head.slots - tail.slots, 0)
        j = 0
        while middle.slots > allow and middle.slots >= 2:
            n = middle.slots
            r = max(self.r_init - j * self.r_step, self.r_min)
            m = min(max(1, round(r * n)), n // 2, n - allow)
            is_a = partition_a(n, self.chunk_size, self.partition, self.seed + j)
            middle = csm_round(*middle, m, self.chunk_size, is_a, self.scope)
            j += 1
        self.stats["rounds"] = self.stats.get("rounds", 0) + j
        return KV.cat(head, middle, tail)

    def compress(self, keys, values, log_n, ctx):
        return self.reduce(KV(keys, values, log_n), ctx.target, ctx.sinks, ctx.window)

    def on_decode(self, layer, query, state):
        if (layer.seen - state.compressed_at) % self.interval:
            return

        def run(kv, rows):
            if self.decode_budget == "fixed":
                target = int(state.targets[rows].min())
            else:
                target = self.target(int(kv.log_n.exp().sum(-1).round().max())) + state.extra
            return self.reduce(kv, target, self.sinks, self.window) if kv.slots > target else kv

        layer.map_rows(run)
