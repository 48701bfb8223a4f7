"""The compression-method interface: `Method` (one `compress` entry point) and `ScoringMethod`
(define `scores`, get selection for free), the per-layer context and the per-layer request state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..ops.kv import KV
from ..ops.scores import top_slots, top_slots_per_head


@dataclass
class LayerState:
    """What the runtime keeps for one layer during one request, beside the cache: the captured
    post-RoPE queries `(batch, heads, n, head_dim)`, each row's compression target `(batch,)`, the
    tokens seen when it was compressed, the model's attention scaling, `extra`, the entries the
    sliding share adds to every target (a decode policy that recomputes a target adds them too), and
    `scratch`, a decode policy's own state (e.g. H2O's accumulated scores)."""

    queries: torch.Tensor | None = None
    targets: torch.Tensor | None = None
    compressed_at: int = 0
    scaling: float = 1.0
    extra: int = 0
    scratch: dict = field(default_factory=dict)


@dataclass
class LayerContext:
    """What a method sees besides one layer's keys, values and log_n.

    `token_ids` `(batch, fresh)` are the ids of the last `fresh` slots, plain tokens not yet compressed
    (all slots at a one-shot prefill; the new chunk and the previous window under chunked prefill),
    `surprisal` their −log p given the prefix (when the method sets `needs_surprisal`); `queries`
    `(batch, heads, n, head_dim)` are the captured post-RoPE prompt queries (the last `n` tokens seen);
    `values` the layer's values (for scores weighted by them); `seen` the tokens these rows have seen;
    `rows` which batch rows these are; `state` the layer's request state.
    """

    layer_idx: int
    num_layers: int
    target: int
    sinks: int
    window: int
    scaling: float
    token_ids: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    surprisal: torch.Tensor | None = None
    state: LayerState | None = None
    values: torch.Tensor | None = None
    seen: int = 0


@dataclass
class Method:
    """Base of every compression method: a dataclass of its parameters and one `compress` entry point.

    `budget`: a float in (0, 1] is the fraction of context tokens kept per layer and KV head; an int is
    an absolute number of entries. The `sinks` first and `window` last tokens are protected and count
    inside the budget. `sliding` (models with sliding-window layers): from the compression on, each
    sliding layer holds only its last `sliding` slots (an int; a float in (0, 1] is that fraction of its
    window − 1) instead of its window − 1, and the slots this frees go to the compressed layers' budget,
    spread evenly over their KV heads, so the keys' and values' bytes do not grow (a merging method's
    log-mass, 4 bytes an entry, covers the moved entries too); None keeps sliding layers as
    transformers does. The runtime calls `setup` once per request, captures the last `query_window`
    prompt queries (-1: all) and computes surprisal if `needs_surprisal`, calls `plan` once with every
    layer, `compress` per layer, and `on_decode` after each decoding step's attention per layer.
    """

    budget: float | int = 0.25
    sinks: int = 4
    window: int = 32
    sliding: int | float | None = None
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    name: ClassVar[str] = ""
    query_window: ClassVar[int] = 0
    needs_surprisal: ClassVar[bool] = False
    has_decode_policy: ClassVar[bool] = False

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise TypeError(f"budget must be a float in (0, 1] or an int number of entries, got {self.budget!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got sinks={self.sinks}, window={self.window}")
        slots = isinstance(self.sliding, int) and not isinstance(self.sliding, bool) and self.sliding >= 1
        fraction = isinstance(self.sliding, float) and 0.0 < self.sliding <= 1.0
        if self.sliding is not None and not (slots or fraction):
            raise ValueError(f"sliding must be a number of slots >= 1 or a fraction of the window in (0, 1] "
                             f"(or None), got {self.sliding!r}")
        if isinstance(self.budget, float):
            if not (0.0 < self.budget <= 1.0) or math.isnan(self.budget):
                raise ValueError(f"budget fraction must be in (0, 1], got {self.budget}")
        elif self.budget < self.sinks + self.window:
            raise ValueError(f"budget of {self.budget} entries is below the protected sinks + window "
                             f"({self.sinks} + {self.window})")

    def target(self, n_tokens: int, window: int | None = None) -> int:
        """Entries per (row, KV head) after compressing `n_tokens`; raises if protection cannot fit."""
        window = self.window if window is None else window
        if n_tokens <= 0:
            raise ValueError("empty context: nothing to compress")
        want = round(self.budget * n_tokens) if isinstance(self.budget, float) else self.budget
        want = min(max(want, 1), n_tokens)
        if want < n_tokens and want < self.sinks + window:
            raise ValueError(f"context too short for budget {self.budget}: {n_tokens} tokens give {want} entries, "
                             f"fewer than the protected sinks + window ({self.sinks} + {window})")
        return want

    def running_target(self, n_tokens: int, window: int | None = None) -> int:
        """`target` for a cache that has seen `n_tokens` so far (chunked prefill): never below the
        protected sinks + window, so early chunks are kept whole instead of refused."""
        window = self.window if window is None else window
        want = round(self.budget * n_tokens) if isinstance(self.budget, float) else self.budget
        return min(max(want, self.sinks + window, 1), n_tokens)

    def layer_target(self, ctx: LayerContext) -> int:
        """Entries this layer keeps (per-layer budgets override this; the mean stays `ctx.target`)."""
        return ctx.target

    def setup(self, model, tokenizer) -> None:
        """Called once per request before prefill (e.g. to build token tables)."""

    def before_compress(self, session, token_rows: list[list[int]] | None, layers: list[int]) -> None:
        """Called by `session.compress` before anything else, with the rows' prompt ids and the indices
        of the layers it compresses: a method that needs another pass over the prompt (KVzip's
        reconstruction) runs it here with `session.probe` and keeps what it learns in
        `session.states[i].scratch`."""

    def plan(self, layers, states: list[LayerState], ctx: LayerContext) -> None:
        """Called once with every `MergedLayer` and its state before any layer is compressed; `ctx`
        describes the whole batch (layer_idx -1)."""

    def compress(self, keys, values, log_n, ctx: LayerContext) -> KV:
        """`(b, h, s, d)`, `(b, h, s, d)`, `(b, h, s)` → a `KV` with at most `ctx.target` slots."""
        raise NotImplementedError

    def on_decode(self, layer, query: torch.Tensor, state: LayerState) -> None:
        """Decode-time policy, run after each one-token step's attention in every layer (when
        `has_decode_policy`): may shrink `layer` (a `MergedLayer`) given the step's query `(b, hq, 1, d)`."""


ALLOCATIONS = ("uniform", "layer", "head", "fit")


@dataclass
class ScoringMethod(Method):
    """An eviction method defined by its scores: the `layer_target(ctx)` highest-scored entries are
    kept beside sinks and the recent window. Subclasses define `scores` only (and `layer_target` for
    per-layer budgets).

    `alloc`: how the budget is spread. "uniform": the same count in every layer and head. "layer": the
    entries go to the highest scores over all layers and heads together (KVzip's and AdaKV's global
    selection), then each layer's share is evened out over its heads (no padding within a row; rows of
    a batch may differ, and shorter rows are padded). "head": each
    (layer, head) keeps its own count; a layer's heads are padded to its largest count with empty
    slots (zeros, log-mass -inf, no attention), which the layer then drops by storing each head at
    its own length (`MergedLayer.compact`).
    "fit": the per-head global ranking with that padding paid for: the longest prefix of the ranking
    whose layers, each as wide as its widest head, fit in the uniform bytes; every head of a layer keeps
    that width, its would-be padding filled with its own next-best entries (no empty slots).
    `floor` (global allocation only; AdaKV's `alpha_safeguard`): every (layer, head) keeps at least this
    fraction of the uniform count, its own best entries, before the rest is spent globally.
    Global allocation needs a one-shot compression of rows without padding."""

    alloc: str = "uniform"
    floor: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.alloc not in ALLOCATIONS:
            raise ValueError(f"alloc must be one of {', '.join(ALLOCATIONS)}, got {self.alloc!r}")
        if not 0.0 <= self.floor <= 1.0 or (self.floor > 0 and self.alloc == "uniform"):
            raise ValueError(f"floor must be a fraction in [0, 1], above 0 only with a global alloc ('layer', "
                             f"'head' or 'fit': it bounds how few entries a head keeps there), got "
                             f"floor={self.floor}, alloc={self.alloc!r}")

    def scores(self, keys, log_n, ctx: LayerContext) -> torch.Tensor:
        """`(b, h, s)`: higher is kept first."""
        raise NotImplementedError

    def selected(self, idx: torch.Tensor, ctx: LayerContext) -> None:
        """Told the kept slots `(b, h, t)`, in order, after each selection (see `CarriedScores`)."""

    def compress(self, keys, values, log_n, ctx):
        scratch = ctx.state.scratch if ctx.state is not None else {}
        if "_alloc_counts" in scratch:  # global allocation: the session scored every layer first
            idx, filler = top_slots_per_head(scratch["_alloc_scores"], scratch["_alloc_counts"], ctx.sinks, ctx.window)
            self.selected(idx, ctx)
            kv = KV(keys, values, log_n).take(idx)  # a filler slot is empty: zeros, log_n -inf
            return KV(kv.keys.masked_fill(filler[..., None], 0), kv.values.masked_fill(filler[..., None], 0),
                      kv.log_n.masked_fill(filler, float("-inf")))
        idx = top_slots(self.scores(keys, log_n, ctx), self.layer_target(ctx), ctx.sinks, ctx.window)
        self.selected(idx, ctx)
        return KV(keys, values, log_n).take(idx)


class CarriedScores:
    """For a `ScoringMethod` whose scores come from the prompt's tokens (not from the cache), so that
    under chunked prefill only the fresh slots can be scored: the entries an earlier compression kept
    keep the score they were kept with, carried per row in `ctx.state.scratch[name]`."""

    def with_carried(self, fresh: torch.Tensor, n: int, ctx: LayerContext) -> torch.Tensor:
        """Fresh scores `(b, h, f)` of the last f slots → `(b, h, n)`, older slots' carried in front."""
        if fresh.shape[-1] < n:
            carried = ctx.state.scratch.get(self.name, {}) if ctx.state is not None else {}
            old = [carried.get(int(row)) for row in (ctx.rows if ctx.rows is not None else [])]
            if not old or any(c is None or c.shape[-1] < n - fresh.shape[-1] for c in old):
                raise ValueError(f"{self.name}: the scores of entries kept by an earlier compression are missing")
            fresh = torch.cat([torch.stack([c[:, :n - fresh.shape[-1]] for c in old]).to(fresh.device), fresh], -1)
        if ctx.state is not None:
            ctx.state.scratch["_" + self.name] = fresh
        return fresh

    def selected(self, idx, ctx):
        if ctx.state is None or ctx.rows is None or "_" + self.name not in ctx.state.scratch:
            return
        scores = ctx.state.scratch.pop("_" + self.name)
        carried = dict(ctx.state.scratch.get(self.name, {}))  # a new dict: snapshots share the old one
        for j, row in enumerate(ctx.rows.tolist()):
            carried[row] = scores[j].gather(-1, idx[j])
        ctx.state.scratch[self.name] = carried
