"""One layer planner for every runtime: the target rule, each layer's `LayerContext`, and global
allocation. Pure functions of what the runtime holds; `Session.compress` (transformers, one-shot and
chunked) and the vLLM plugin (`kvmerge.vllm.compress`) build every context here."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .methods.base import LayerContext, LayerState, Method
from .ops.scores import global_counts


def target_rule(method: Method, n: int, seen: int, window: int, running: bool = False, extra: int = 0) -> int:
    """Entries per (row, KV head) a layer of `n` slots keeps, having seen `seen` tokens: the method's
    `target` of the `n` entries (one-shot; raises when the protected tokens cannot fit) or its
    `running_target` of the tokens seen (`running`: chunked prefill, never below sinks + window),
    plus `extra` (the sliding share), never more than `n`."""
    want = method.running_target(seen, window) if running else method.target(n, window)
    return min(want + extra, n)


def plan_layer(method: Method, layer_idx: int, num_layers: int, kv, rows: torch.Tensor, *, target: int, window: int,
               scaling: float, seen: int, fresh: int, queries: torch.Tensor | None = None, captured: int | None = None,
               token_rows: list[list[int]] | None = None, surprisal: torch.Tensor | None = None,
               state: LayerState | None = None, alloc=None) -> LayerContext:
    """The `LayerContext` of layer `layer_idx` (of `num_layers` compressed) for the batch `rows` of a
    cache `kv` (`KV` of those rows): `queries` `(batch, hq, n, d)` are every row's captured queries
    (the last `captured` of which are real for all `rows`; the method sees at most its
    `needs.queries`), `token_rows` every row's prompt ids and `surprisal` `(batch, width)` their
    surprisal, left-padded; the method sees the ids and surprisal of the last `fresh` tokens (the
    plain ones not yet compressed). `alloc`: this layer's global allocation (scores, counts)."""
    if queries is not None:
        keep = queries.shape[2] if captured is None else min(captured, queries.shape[2])
        wanted = method.needs.queries
        keep = keep if wanted < 0 else min(keep, wanted)
        queries = queries[rows][:, :, queries.shape[2] - keep:]
    device = kv.keys.device
    return LayerContext(
        layer_idx=layer_idx, num_layers=num_layers, target=target, sinks=method.sinks, window=window,
        scaling=scaling, queries=queries, rows=rows, state=state, values=kv.values, seen=seen, alloc=alloc,
        token_ids=None if token_rows is None else torch.tensor(
            [token_rows[int(b)][len(token_rows[int(b)]) - fresh:] for b in rows], device=device),
        surprisal=None if surprisal is None else surprisal[rows][:, -fresh:].to(device))


@dataclass
class Allocation:
    """Global allocation (`ScoringMethod.alloc` "layer", "head" or "fit"): every compressed layer is
    scored first, then one budget is spread over layers and KV heads by those scores (with the
    method's `floor`). `scores[i]` `(b, h, s)` and `counts[i]` `(b, h)`: layer i's scores and the
    entries each of its heads keeps (`LayerContext.alloc`)."""

    scores: list[torch.Tensor]
    counts: list[torch.Tensor]

    @classmethod
    def of(cls, method, contexts: Iterable[tuple], target: int, window: int) -> Allocation:
        """`contexts`: per layer `(kv, ctx)` of every row, an iterable read once (a generator keeps one
        layer's tensors alive at a time); `target`: the uniform count per head. Empty
        slots (a head's padding from an earlier global compression: log-mass −inf) score −inf, so
        that no head keeps one while it has an entry (a chunked prefill compresses such a cache again)."""
        check_global(method)
        scores = [method.scores(kv.keys, kv.log_n, ctx).masked_fill(torch.isneginf(kv.log_n), float("-inf"))
                  for kv, ctx in contexts]
        return cls(scores, global_counts(scores, target, method.sinks, window, method.alloc, method.floor))

    def layer(self, i: int):
        return self.scores[i], self.counts[i]


def check_global(method) -> None:
    """Raise unless `method` keeps its highest-scored entries (or merges the rest into them) with
    the same budget rule in every layer: what global allocation ranks."""
    own = method.requires.layer_counts or any(p.requires.layer_counts for p in method.parts())
    if not getattr(method, "allocates", False) or own:
        raise ValueError(f"{method.name}: alloc={method.alloc!r} applies to methods that keep their highest-scored "
                         "entries (and evictmerge, which merges the rest into them); this one compresses "
                         "otherwise, or sets its own per-layer budgets")


def is_global(method) -> bool:
    return getattr(method, "alloc", "uniform") != "uniform"
