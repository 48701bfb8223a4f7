"""The planner: how every runtime compresses. `compress_layers` takes a method, the layers a runtime
holds and what it knows of the rows (`View`), and does the whole compression: the target rule, the
method's `prepare` and `plan`, each layer's `LayerContext`, global allocation, scores carried under a
chunked prefill, and each layer's result written back. `Session.compress` (transformers, one-shot and
chunked) and `kvmerge.vllm.compress.compress_prompt` (one prompt, one layer) both call it.

A layer is anything with `kv()` → `KV`, `replace(keys, values, log_n)`, `map_rows(fn)` (fn on dense
groups of rows, see `MergedLayer.map_rows`), `compact()`, `entries` and `seen`: a `MergedLayer`, or
`Entries` (one batch of entries as tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .allocation import Allocation, is_global, top_slots_per_head
from .methods.base import CarriedScores, LayerContext, LayerState, Method, ScoringMethod, carry_all
from .ops.kv import KV
from .sliding import hold_sliding


@dataclass
class View:
    """What a runtime knows of the `batch` rows it compresses. Per row `(batch,)`: `seen` tokens seen,
    `plain` trailing slots that are plain tokens not yet compressed, `captured` real tokens among each
    layer's captured queries (`LayerState.queries`). `window`: the protected recent tokens; `scaling`:
    the model's factor on q·k; `token_rows` each row's prompt ids; `surprisal` `(batch, width)` their
    −log p, left-padded; `running`: a chunked prefill (the target grows with the tokens seen), `room`:
    slots per head it appends before the next compression (its chunk; kept free where heads are packed);
    `target`: a runtime's own count per head (vLLM's block layout), else the target rule's. `layers`:
    each layer's index in the model (what `prepare` and `runtime.scratch` take), `positions`: its index
    among the `num_layers` compressed layers (what `LayerContext.layer_idx` says); both default to 0,
    1, ... `model_layers`: every layer of the model's cache, the sliding-window ones `method.sliding`
    shortens included (None: none to shorten). `extra`, the entries the sliding share adds to every
    target, and `ids`, the fresh tokens' ids as tensors (keyed by rows and count), are the planner's."""

    seen: torch.Tensor
    plain: torch.Tensor
    captured: torch.Tensor
    window: int
    scaling: float
    token_rows: list[list[int]] | None = None
    surprisal: torch.Tensor | None = None
    running: bool = False
    target: int | None = None
    layers: list[int] | None = None
    positions: list[int] | None = None
    num_layers: int | None = None
    model_layers: list | None = None
    extra: int = 0
    room: int = 0
    ids: dict = field(default_factory=dict)


class Entries:
    """One layer's entries of a batch held as a `KV`, the simplest layer the planner compresses: every
    row dense, of one length."""

    def __init__(self, kv: KV):
        self._kv, self.seen = kv, kv.slots

    def kv(self) -> KV:
        return self._kv

    @property
    def entries(self) -> int:
        return self._kv.slots

    def replace(self, keys, values, log_n) -> None:
        self._kv = KV(keys, values, log_n)

    def map_rows(self, fn) -> None:
        self.replace(*fn(self._kv, torch.arange(self._kv.keys.shape[0])))

    def compact(self) -> bool:
        return False


def target_rule(method: Method, n: int, seen: int, window: int, running: bool = False, extra: int = 0) -> int:
    """Entries per (row, KV head) a layer of `n` slots keeps, having seen `seen` tokens: the method's
    `target` of the `n` entries (one-shot; raises when the protected tokens cannot fit) or its
    `running_target` of the tokens seen (`running`: chunked prefill, never below sinks + window),
    plus `extra` (the sliding share), never more than `n`."""
    want = method.running_target(seen, window) if running else method.target(n, window)
    return min(want + extra, n)


@torch.no_grad()
def compress_layers(method: Method, runtime, layers: list, states: list[LayerState], view: View) -> torch.Tensor:
    """Compress `layers` (each with its request state in `states`) with `method` on `runtime`; → `(batch,)`
    bool, the rows some layer compressed. Raises before changing anything when a global allocation
    meets padded rows or a decode policy."""
    num = view.num_layers or len(layers)
    positions = view.positions or list(range(len(layers)))
    n, seen = layers[0].entries, int(view.seen.max())
    rows, dense = torch.arange(len(view.seen)), len(set(view.seen.tolist())) == 1  # dense: no batch padding
    if is_global(method) and (not dense or method.needs.decode_policy):
        raise ValueError(f"{method.name}: alloc={method.alloc!r} spreads one budget over every layer at once, so it "
                         "needs rows without padding (one row, or rows of one length) and a method without a decode "
                         "policy")
    method.prepare_all(runtime, view.token_rows, view.layers or positions)  # a second pass sees the whole cache,
    if method.sliding is not None and view.model_layers is not None:  # then the sliding share shortens it
        view.extra = hold_sliding(view.model_layers, layers, method, view.seen.tolist())
    # under a chunked prefill a global allocation's layers differ in width: the budget is the tokens'
    target = view.target if view.target is not None else target_rule(
        method, seen if view.running and is_global(method) else n, seen, view.window, view.running, view.extra)
    method.plan(layers, states, LayerContext(
        layer_idx=-1, num_layers=num, target=target, sinks=method.sinks, window=view.window, scaling=view.scaling,
        rows=rows, surprisal=None if view.surprisal is None or not dense else view.surprisal[:, -n:]))
    compressed = torch.zeros(len(view.seen), dtype=torch.bool)
    for state in states:
        state.targets = torch.zeros(len(view.seen), dtype=torch.long)
        state.scaling, state.extra = view.scaling, view.extra
    if on_packed_buffers(method, layers):
        _compress_packed(method, view, layers, states, positions, num, target, compressed)
        return compressed
    allocation = None
    if is_global(method):  # every layer scored first, one at a time: a layer's copies are freed once scored
        allocation = Allocation.of(method, (_scored(method, kv, layer_context(method, view, p, num, kv, rows, state))
                                            for p, kv, state in zip(positions, (layer.kv() for layer in layers), states)),
                                   target, view.window)
    for j, (p, layer, state) in enumerate(zip(positions, layers, states)):
        alloc = None if allocation is None else allocation.layer(j)
        if alloc is None:
            layer.map_rows(lambda kv, r, p=p, state=state: _compress(method, view, p, num, kv, r, state, None, compressed))
        else:  # every row at once: the allocation ranked the whole layout, empty slots included (−inf)
            layer.replace(*_compress(method, view, p, num, layer.kv(), rows, state, alloc, compressed))
        state.compressed_at = layer.seen
        if not method.needs.decode_policy:  # heads left at different lengths are stored at their own,
            layer.compact()  # layer by layer: one padded layout at a time
    return compressed


def on_packed_buffers(method: Method, layers: list) -> bool:
    """Whether `compress_layers` compresses `layers` on their own buffers (`_compress_packed`): `method`
    keeps each head's top-scored slots by a global allocation and scores a chunk's fresh slots from
    those slots alone (`CarriedScores.fresh_scores`), and every layer reads its last slots (`last`) and
    keeps slots in place (`select`), as `MergedLayer` does."""
    kind = type(method)
    return (is_global(method) and isinstance(method, CarriedScores) and kind.scores is CarriedScores.scores
            and kind.fresh_scores is not CarriedScores.fresh_scores and kind.compress is ScoringMethod.compress
            and all(hasattr(layer, "last") and hasattr(layer, "select") for layer in layers))


def _compress_packed(method, view, layers, states, positions, num, target, compressed) -> None:
    """Global allocation read and written on the layers' own buffers: each layer's fresh slots scored
    from its last slots, carried scores in front; the allocation's picks kept with one `select` per
    layer (ragged heads stay packed). The same picks as `method.compress` on each layer's padded copy,
    which this never builds (under a chunked prefill it would grow with every chunk)."""
    rows = torch.arange(len(view.seen))
    fresh, contexts, scored = int(view.plain.min()), [], []
    for p, layer, state in zip(positions, layers, states):
        n = layer.entries
        tail = layer.last(min(n, fresh))
        ctx = layer_context(method, view, p, num, tail, rows, state, slots=n)
        scored.append((method.with_carried(method.fresh_scores(tail.keys, tail.values, ctx), n, ctx), layer.full_log_n()))
        contexts.append(replace(ctx, queries=None, values=None))  # what `selected` reads: rows and state
    allocation = Allocation.of(method, scored, target, view.window)
    for layer, state, ctx, (score, counts) in zip(layers, states, contexts, map(allocation.layer, range(len(layers)))):
        n = layer.entries
        state.targets[rows] = int(counts.max())
        if bool((counts < n).any()):
            compressed[rows] = True
            idx, filler = top_slots_per_head(score, counts, method.sinks, view.window)
            method.tell_selected(idx, ctx)
            layer.select(idx, filler, view.room)
        elif view.running and n:  # kept whole: the scores a later chunk cannot recompute are carried
            method.tell_selected(torch.arange(n).expand(score.shape), ctx)
        state.compressed_at = layer.seen
        layer.compact()


def _scored(method, kv: KV, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
    return method.scores(kv.keys, kv.log_n, ctx), kv.log_n


def _compress(method, view, position, num, kv, rows, state, alloc, compressed) -> KV:
    """One layer's rows `rows` (`kv` of those rows) compressed; marks them in `compressed` when smaller."""
    ctx = layer_context(method, view, position, num, kv, rows, state, alloc)
    keep = method.layer_target(ctx) if alloc is None else int(alloc[1].max())
    state.targets[rows] = keep
    smaller = keep < kv.slots if alloc is None else bool((alloc[1] < kv.slots).any())
    compressed[rows] |= smaller
    if not smaller and view.running and kv.slots:  # kept whole: scores a later chunk cannot recompute
        carry_all(method, kv, ctx)
    return method.compress(*kv, ctx) if smaller and kv.slots else kv


def layer_context(method: Method, view: View, position: int, num_layers: int, kv: KV, rows: torch.Tensor,
                  state: LayerState, alloc=None, slots: int | None = None) -> LayerContext:
    """The `LayerContext` of compressed layer `position` (of `num_layers`) for the batch `rows` of a
    cache `kv` (`KV` of those rows; or of its last slots only, `slots` being the layer's): the method
    sees at most its `needs.queries` of the layer's captured queries (the last `view.captured` of which
    are real for all `rows`), and the ids and surprisal of the last `fresh` tokens (the plain ones not
    yet compressed). `alloc`: this layer's global allocation (scores, counts)."""
    slots = kv.slots if slots is None else slots
    seen = int(view.seen[rows].max())
    fresh = min(slots, int(view.plain[rows].min()))
    queries = state.queries
    if queries is not None:
        keep = min(int(view.captured[rows].min()), queries.shape[2])
        keep = keep if method.needs.queries < 0 else min(keep, method.needs.queries)
        whole = rows.tolist() == list(range(queries.shape[0]))  # every row: a view, not a copy
        queries = (queries if whole else queries[rows])[:, :, queries.shape[2] - keep:]
    target = view.target if view.target is not None else target_rule(method, slots, seen, view.window,
                                                                      view.running, view.extra)
    device, token_rows, surprisal = kv.keys.device, view.token_rows, view.surprisal
    key = (tuple(rows.tolist()), fresh, device)  # the same for most layers: built once per compression
    if token_rows is not None and key not in view.ids:
        view.ids[key] = torch.tensor([token_rows[int(b)][len(token_rows[int(b)]) - fresh:] for b in rows], device=device)
    return LayerContext(
        layer_idx=position, num_layers=num_layers, target=target, sinks=method.sinks, window=view.window,
        scaling=view.scaling, queries=queries, rows=rows, state=state, values=kv.values, seen=seen, alloc=alloc,
        token_ids=None if token_rows is None else view.ids[key],
        surprisal=None if surprisal is None else surprisal[rows][:, surprisal.shape[1] - fresh:].to(device))
