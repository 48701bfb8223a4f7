"""The compression-method interface: `Needs` (what a method asks of the runtime, as data), `Method`
(one `compress` entry point) and `ScoringMethod` (define `scores`, get selection for free), the
per-layer context and the per-layer request state."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from ..ops.kv import KV
from ..allocation import top_slots_per_head
from ..ops.scores import top_slots
from ..errors import plural
from ..spec import spec_of


@dataclass(frozen=True)
class Needs:
    """What a method needs from the runtime that runs it, declared as data. Runtimes read it to feed
    the method (queries captured, surprisal computed) and to derive their refusals in one place
    (`kvmerge.capabilities`); a composite's needs are the union of its own and its parts'.

    `queries`: the last prompt queries captured per layer (0 none, -1 all). `surprisal`: each prompt
    token's −log p (the logits of every prompt position). `tokenizer`, `rotary` (the model's RoPE as
    `cos, sin = rotary(positions)`): read in `setup`. `second_pass`: another forward over the context
    before compressing (`prepare` uses `runtime.probe`). `all_layers`: every layer's scores before any
    layer is compressed (`plan`, global allocation). `layer_counts` / `head_counts`: layers / KV heads
    keep different numbers of entries. `decode_policy`: changes the cache while decoding (`on_decode`).
    `merges`: the kept entries are not plain tokens only (merged keys or values, a log-mass). `sliding`:
    shortens a hybrid model's sliding-window layers."""

    queries: int = 0
    surprisal: bool = False
    tokenizer: bool = False
    rotary: bool = False
    second_pass: bool = False
    all_layers: bool = False
    layer_counts: bool = False
    head_counts: bool = False
    decode_policy: bool = False
    merges: bool = False
    sliding: bool = False

    def __or__(self, other: Needs) -> Needs:
        q = -1 if min(self.queries, other.queries) < 0 else max(self.queries, other.queries)
        return Needs(queries=q, **{f.name: getattr(self, f.name) or getattr(other, f.name)
                                   for f in fields(self) if f.name != "queries"})

    def listed(self) -> list[str]:
        """The needs that are set, as words (`kvmerge methods`)."""
        out = [] if not self.queries else [f"queries={'all' if self.queries < 0 else self.queries}"]
        return out + [f.name for f in fields(self) if f.name != "queries" and getattr(self, f.name)]


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
    """What a method sees besides one layer's keys, values and log_n (built by `kvmerge.planner.layer_context`).

    `token_ids` `(batch, fresh)` are the ids of the last `fresh` slots, plain tokens not yet compressed
    (all slots at a one-shot prefill; the new chunk and the previous window under chunked prefill),
    `surprisal` their −log p given the prefix (when the method needs it); `queries`
    `(batch, heads, n, head_dim)` are the captured post-RoPE prompt queries (the last `n` tokens seen);
    `values` the layer's values (for scores weighted by them); `seen` the tokens these rows have seen;
    `rows` which batch rows these are; `state` the layer's request state; `alloc`: under global
    allocation, this layer's `(scores (b, h, s), counts (b, h))`, the entries each head keeps.
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
    alloc: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Method:
    """Base of every compression method: a dataclass of its parameters and one `compress` entry point.

    `budget`: a float in (0, 1] is the fraction of context tokens kept per layer and KV head; an int is
    an absolute number of entries. The `sinks` first and `window` last tokens are protected and count
    inside the budget. `sliding` (models with sliding-window layers) is a policy the runtime applies,
    not the method: from the compression on, each sliding layer holds only its last `sliding` slots
    (an int; a float in (0, 1] is that fraction of its window − 1) instead of its window − 1, and the
    slots this frees go to the compressed layers' budget, spread evenly over their KV heads, so the
    keys' and values' bytes do not grow (a merging method's log-mass, 4 bytes an entry, covers the
    moved entries too); None keeps sliding layers as transformers does.

    A method declares what it needs in `requires` (a `Needs`; a class attribute, or a property when it
    depends on the parameters) and its parts in `parts()` (a composite: `evictmerge`'s base...); the
    runtime reads `needs`, calls `setup(runtime)` and `prepare(runtime, ...)` on the method and every
    part (`walk`), `plan` once with every layer, `compress` per layer, and `on_decode` after each
    decoding step's attention per layer. A method never sees the runtime's session or the model:
    only the `kvmerge.runtime.Runtime` interface.
    """

    budget: float | int = 0.25
    sinks: int = 4
    window: int = 32
    sliding: int | float | None = None
    stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    preset: str | None = field(default=None, init=False, repr=False, compare=False)  # the preset it was built as
    spec: str | None = field(default=None, init=False, repr=False, compare=False)  # its name and the settings `get_method` was given

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for `kvmerge methods` (default: the docstring's first sentence)
    experimental: ClassVar[bool] = False  # a part of presets, not a method to pick alone (`kvmerge methods` marks it)
    requires: ClassVar[Needs] = Needs()

    def __post_init__(self):
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise TypeError(f"budget must be a float in (0, 1] or an int number of entries, got {self.budget!r}")
        if self.sinks < 0 or self.window < 0:
            raise ValueError(f"sinks and window must be >= 0, got sinks={self.sinks}, window={self.window}")
        if getattr(self, "obs_window", 1) < 1:
            raise ValueError(f"obs_window must be >= 1 (the prompt queries that score), got {self.obs_window}")
        kernel = getattr(self, "kernel", 1)
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd whole number >= 1 (1: no pooling), got {kernel}")
        slots = isinstance(self.sliding, int) and not isinstance(self.sliding, bool) and self.sliding >= 1
        fraction = isinstance(self.sliding, float) and 0.0 < self.sliding <= 1.0
        if self.sliding is not None and not (slots or fraction):
            raise ValueError(f"sliding must be a number of slots >= 1 or a fraction of the window in (0, 1] "
                             f"(or None), got {self.sliding!r}")
        if isinstance(self.budget, float):
            if not (0.0 < self.budget <= 1.0) or math.isnan(self.budget):
                raise ValueError(f"budget fraction must be in (0, 1], got {self.budget}")
        elif self.budget < 1:
            raise ValueError(f"budget must be a fraction in (0, 1] (e.g. 0.25) or a whole number of entries >= 1, "
                             f"got {self.budget}")
        elif self.budget < self.sinks + self.window:
            hint = (": budget=1.0 keeps every entry" if self.budget == 1 else
                    f" (for {self.budget}%, write {self.budget / 100:g})" if self.budget <= 100 else "")
            raise ValueError(f"budget of {self.budget} entries is below the protected sinks + window "
                             f"({self.sinks} + {self.window}){hint}")

    @property
    def label(self) -> str:
        """The name a user knows this method by: its preset's (`mixedmerge`), else its own (`evictmerge`)."""
        return self.preset or self.name

    @property
    def described(self) -> str:
        """The method with the settings it was given, under its label: `snapkv:window=8` from
        `get_method("SnapKV:window=8")`, a preset by its name, a method object built by hand by its
        settings off their defaults (`spec_of`). What `stats["method"]` reports, the budget beside it."""
        return self.spec or self.preset or spec_of(self)

    # -- what it needs and what it is made of ------------------------------------------------------
    def parts(self) -> list[Method]:
        """The methods this one uses (a composite's base and helpers); their needs and hooks are its own too."""
        return []

    def walk(self) -> list[Method]:
        """This method and every part, depth first, each once."""
        out, seen = [], set()
        stack = [self]
        while stack:
            m = stack.pop(0)
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
                stack[:0] = m.parts()
        return out

    def policy_needs(self) -> Needs:
        """What the runtime policies set on this method (`sliding`, a global `alloc`) add to its needs."""
        return Needs(sliding=self.sliding is not None)

    @property
    def needs(self) -> Needs:
        """`requires` of this method and every part, with the policies' needs."""
        out = self.policy_needs()
        for m in self.walk():
            out = out | m.requires
        return out

    # -- hooks -------------------------------------------------------------------------------------
    def target(self, n_tokens: int, window: int | None = None) -> int:
        """Entries per (row, KV head) after compressing `n_tokens`; raises if protection cannot fit."""
        window = self.window if window is None else window
        if n_tokens <= 0:
            raise ValueError("empty context: nothing to compress")
        want = round(self.budget * n_tokens) if isinstance(self.budget, float) else self.budget
        want = min(max(want, 1), n_tokens)
        if want < n_tokens and want < self.sinks + window:
            ways = []
            if self.sinks + window < n_tokens:
                ways.append(f"keep at least {self.sinks + window} entries (a budget of {self.sinks + window})")
            if window == self.window and want - self.sinks >= 1:  # not the question's own tokens (the aware protocol)
                ways.append(f"protect fewer recent tokens (window={want - self.sinks}, which fits {want} entries)")
            ways.append("keep the whole cache (method full)")
            raise ValueError(f"context too short for budget {self.budget}: {plural(n_tokens, 'token')} give {plural(want, 'entry', 'entries')}, "
                             f"fewer than the protected sinks + window ({self.sinks} + {window}); "
                             f"{', '.join(ways[:-1]) + ' or ' if len(ways) > 1 else ''}{ways[-1]}")
        return want

    def running_target(self, n_tokens: int, window: int | None = None) -> int:
        """`target` for a cache that has seen `n_tokens` so far (chunked prefill): never below the
        protected sinks + window, so early chunks are kept whole instead of refused."""
        window = self.window if window is None else window
        want = round(self.budget * n_tokens) if isinstance(self.budget, float) else self.budget
        return min(max(want, self.sinks + window, 1), n_tokens)

    def layer_target(self, ctx: LayerContext) -> int:
        """Entries this layer keeps (per-layer budgets override this and declare `layer_counts`; the
        mean stays `ctx.target`)."""
        return ctx.target

    def setup(self, runtime) -> None:
        """Called once per request before prefill, with the `Runtime` (its tokenizer, rotary embedding)."""

    def prepare(self, runtime, token_rows: list[list[int]] | None, layers: list[int]) -> None:
        """Called before anything is compressed, with the rows' prompt ids and the indices of the layers
        compressed: a method that declares `second_pass` runs it here (`runtime.probe`) and keeps what it
        learns in `runtime.scratch(i)` (layer i's request state) or `runtime.memo`."""

    def plan(self, layers, states: list[LayerState], ctx: LayerContext) -> None:
        """Called once with every `MergedLayer` and its state before any layer is compressed (declare
        `all_layers`); `ctx` describes the whole batch (layer_idx -1)."""

    def compress(self, keys, values, log_n, ctx: LayerContext) -> KV:
        """`(b, h, s, d)`, `(b, h, s, d)`, `(b, h, s)` → a `KV` with at most `ctx.target` slots."""
        raise NotImplementedError

    def selected(self, idx: torch.Tensor, ctx: LayerContext) -> None:
        """Told the kept slots `(b, h, t)`, in order, after each selection (see `CarriedScores`)."""

    def setup_all(self, runtime) -> None:
        """`setup` on this method and every part: what a runtime calls once per request."""
        for m in self.walk():
            m.setup(runtime)

    def prepare_all(self, runtime, token_rows: list[list[int]] | None, layers: list[int]) -> None:
        """`prepare` on this method and every part: what a runtime calls before compressing."""
        for m in self.walk():
            m.prepare(runtime, token_rows, layers)

    def tell_selected(self, idx: torch.Tensor, ctx: LayerContext) -> None:
        """`selected` on this method and every part."""
        for m in self.walk():
            m.selected(idx, ctx)

    def on_decode(self, layer, query: torch.Tensor, state: LayerState) -> None:
        """Decode-time policy, run after each one-token step's attention in every layer (when it declares
        `decode_policy`): may shrink `layer` (a `MergedLayer`) given the step's query `(b, hq, 1, d)`."""


ALLOCATIONS = ("uniform", "layer", "head", "fit", "adakv")


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
    "adakv": AdaKV's allocation (kvpress's `AdaKVPress`): every layer keeps its uniform share, spread
    over its own heads by score; each head at its own length as with "head".
    `floor` (global allocation only; AdaKV's `alpha_safeguard`): every (layer, head) keeps at least this
    fraction of the uniform count, its own best entries, before the rest is spent globally.
    Global allocation runs one-shot and under a chunked prefill; it needs rows without padding (one
    row, or rows of one length) and a method without a decode policy."""

    alloc: str = "uniform"
    floor: float = 0.0
    allocates: ClassVar[bool] = True  # its `compress` keeps `ctx.alloc`'s counts (False: it compresses otherwise)

    def __post_init__(self):
        super().__post_init__()
        if self.alloc not in ALLOCATIONS:
            raise ValueError(f"alloc must be one of {', '.join(ALLOCATIONS)}, got {self.alloc!r}")
        if not 0.0 <= self.floor <= 1.0 or (self.floor > 0 and self.alloc == "uniform"):
            raise ValueError(f"floor must be a fraction in [0, 1], above 0 only with a global alloc ('layer', "
                             f"'head', 'fit' or 'adakv': it bounds how few entries a head keeps there), got "
                             f"floor={self.floor}, alloc={self.alloc!r}")

    def policy_needs(self) -> Needs:
        spread = self.alloc != "uniform"
        per_head = self.alloc in ("head", "adakv")
        return super().policy_needs() | Needs(all_layers=spread, layer_counts=spread, head_counts=per_head)

    def scores(self, keys, log_n, ctx: LayerContext) -> torch.Tensor:
        """`(b, h, s)`: higher is kept first."""
        raise NotImplementedError

    def compress(self, keys, values, log_n, ctx):
        if ctx.alloc is not None:  # global allocation: the planner scored every layer first
            idx, filler = top_slots_per_head(*ctx.alloc, ctx.sinks, ctx.window)
            self.tell_selected(idx, ctx)
            return KV(keys, values, log_n).take(idx).emptied(filler)
        idx = top_slots(self.scores(keys, log_n, ctx), self.layer_target(ctx), ctx.sinks, ctx.window)
        self.tell_selected(idx, ctx)
        return KV(keys, values, log_n).take(idx)


def check_scoring_part(owner: Method, part: str) -> None:
    """Raise unless `owner`'s part `part` is a `ScoringMethod` with uniform counts: a composite that uses
    a part's scores (not its selection) would silently ignore the part's own global allocation."""
    got = getattr(owner, part)
    if not isinstance(got, ScoringMethod):
        raise TypeError(f"{owner.name}'s {part} must be a scoring method (one that defines scores), "
                        f"got {type(got).__name__}")
    if got.alloc != "uniform":
        raise ValueError(f"{owner.name} uses its {part}'s scores, not its selection: {part}'s alloc={got.alloc!r} "
                         f"would be ignored" + (f"; set {owner.name}'s own alloc" if hasattr(owner, "alloc") else ""))


def carry_all(method: Method, kv, ctx: LayerContext) -> None:
    """Under a chunked prefill, a layer (or row) kept whole: every part of `method` that carries its
    kept entries' scores (`CarriedScores`) scores them now and records all of them as kept, since the
    chunk's queries are gone by the next compression. The cache is not changed."""
    idx = None
    for m in method.walk():
        if isinstance(m, CarriedScores):
            idx = torch.arange(kv.slots, device=kv.keys.device).expand(kv.log_n.shape) if idx is None else idx
            m.scores(kv.keys, kv.log_n, ctx)
            m.selected(idx, ctx)


class CarriedScores:
    """For a `ScoringMethod` whose scores come from the prompt's tokens (not from the cache), so that
    under chunked prefill only the fresh slots can be scored: the entries an earlier compression kept
    keep the score they were kept with, carried per row in `ctx.state.scratch[name]`."""

    def fresh_scores(self, keys, values, ctx: LayerContext) -> torch.Tensor:
        """Scores `(b, h, f)` of the last f slots of `keys`/`values` `(b, h, ≥ f, d)` (f: the slots the
        method scores afresh), read from those slots alone: the planner may pass a layer's last slots
        only (`MergedLayer.last`). A method whose fresh scores read the whole cache defines `scores`
        instead."""
        raise NotImplementedError

    def scores(self, keys, log_n, ctx: LayerContext) -> torch.Tensor:
        return self.with_carried(self.fresh_scores(keys, ctx.values, ctx), keys.shape[2], ctx)

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
