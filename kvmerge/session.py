"""One request's runtime: a model, a `MergedCache`, the method and its per-layer state, fed
left-padded rows at true positions.

Padding tokens get log_n = -inf, so they receive exactly zero attention, and every row keeps its own
true positions. The method's hooks run from here: queries are captured during `prefill`, `compress`
runs the method on every layer, and its decode policy runs after each one-token step's attention
(through the cache's `listener`, so it also runs under `model.generate`).
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import torch

from .attention import kvmerge_attention
from .cache import MergedCache
from .errors import check_chunk
from .methods import LayerState, Method
from .methods.full import Full
from .model import check_supported, token_surprisal
from .planner import View, compress_layers
from .runtime import SessionRuntime
from .sliding import sliding_layers


class Session:
    def __init__(self, model, batch_size: int, method: Method | None = None, tokenizer=None):
        check_supported(model)
        self.model, self.method = model, method
        self.cache = MergedCache(model.config)
        self.cache.listener = self._listen
        self.states = [LayerState() for _ in self.cache.layers]
        self._compressible = set(self.cache.compressible)
        self.seen = torch.zeros(batch_size, dtype=torch.long)
        self.plain = torch.zeros(batch_size, dtype=torch.long)  # trailing slots that are uncompressed tokens
        self.peak_cache_bytes = 0  # the most the cache's buffers held after a forward
        self.captured = torch.zeros(batch_size, dtype=torch.long)  # each row's real tokens among captured queries
        self.timings: dict = {}
        self._capture = 0  # queries kept per layer during this forward (-1: all)
        self._decoding = False
        self._probe = None  # during `probe`: its listener
        self.memo: dict = {}  # what methods computed from the cache as it is now (a new dict once it changes)
        self.runtime = SessionRuntime(self, tokenizer)  # all a method sees of the Session
        self._decode_policy = False
        self.before_compress = None  # called with no arguments as each compression starts (an observer)
        if method is not None:
            self.use(method, tokenizer)

    @property
    def device(self):
        return next(self.model.parameters()).device

    def _clock(self) -> float:
        """`time.perf_counter()` once the device's queued work is done (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # -- feeding tokens ----------------------------------------------------------------------
    def forward(self, rows: list[list[int]], decoding: bool = True, all_logits: bool = False,
                capture: int = 0) -> torch.Tensor:
        """Feed one chunk per row; returns next-token logits `(batch, vocab)` at each row's last token
        (`all_logits`: `(batch, width, vocab)` at every position, left-padded rows included).
        The decode policy runs on one-token chunks when `decoding` (not for a one-token question);
        `capture`: keep the last `capture` queries of each layer in `states[i].queries` (-1: all)."""
        return self._feed(rows, decoding, all_logits, capture)[0]

    def _feed(self, rows, decoding=True, all_logits=False, capture=0, hidden=False):
        """→ (logits, final hidden states `(b, width, d)` if `hidden`, ids `(b, width)`, padding mask)."""
        self.cache.check_free()
        lengths = torch.tensor([len(r) for r in rows])
        width = int(lengths.max())
        pad = torch.arange(width)[None, :] < (width - lengths)[:, None]
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
        pos = self.seen[:, None] + (torch.arange(width)[None, :] - (width - lengths)[:, None]).clamp_min(0)
        self.cache.next_log_n = (torch.zeros(pad.shape).masked_fill_(pad, float("-inf")).to(self.device)
                                 if bool(pad.any()) else None)
        try:
            with self.observing(capture, decoding, hidden) as states, kvmerge_attention(self.model):
                out = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), cache=self.cache,
                                 use_cache=True, logits_to_keep=0 if all_logits else 1)
        finally:
            self.cache.next_log_n = None
        self.fed(lengths, capture)
        logits = out.logits.float() if all_logits else out.logits[:, -1].float()
        return logits, states[0] if hidden else None, ids, pad

    def hidden_states(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the rows like `forward`; returns the decoder's final hidden states `(batch, width, d)` and
        the left-padded ids `(batch, width)` fed (what `kvmerge.model.token_surprisal` reads)."""
        _, hidden, ids, _ = self._feed(rows, hidden=True)
        return hidden, ids

    def fed(self, lengths: torch.Tensor, captured: int = 0) -> None:
        """Account for a forward that appended `lengths` `(batch,)` tokens to the cache (queries kept if
        `captured`): the counters advance and the memo is dropped (the cache changed)."""
        self.memo = {}
        self.seen += lengths
        self.plain += lengths
        if captured:
            self.captured += lengths
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache.allocated_bytes)

    def compress_prompt(self, rows: list[list[int]], hidden: torch.Tensor | None = None, pad=None) -> None:
        """Compress a prompt just fed (`rows`, left-padded as fed): the surprisal, when the method needs
        it, from the final hidden states `hidden` `(b, width, d)` and the padding mask `pad`."""
        surprisal = None
        if self.method.needs.surprisal:
            ids = torch.tensor([[0] * (max(map(len, rows)) - len(r)) + list(r) for r in rows])
            surprisal = self.surprisal_of(hidden, ids, torch.zeros(ids.shape, dtype=torch.bool) if pad is None else pad)
        self.compress(rows, surprisal=surprisal)

    @contextmanager
    def observing(self, capture: int = 0, decoding: bool = True, hidden: bool = False):
        """During one forward: keep the last `capture` queries per layer (-1: all), run the decode policy
        on one-token steps if `decoding`, and collect the final hidden states into the yielded list."""
        states: list = []
        self._capture, self._decoding = capture, decoding
        hook = (self.model.get_decoder().register_forward_hook(lambda _m, _a, o: states.append(o[0]))
                if hidden else None)
        try:
            yield states
        finally:
            self._capture, self._decoding = 0, False
            if hook is not None:
                hook.remove()

    def _listen(self, layer_idx: int, query: torch.Tensor) -> None:
        """Called by kvmerge's attention after each layer's attention (see `MergedCache.listener`)."""
        state = self.states[layer_idx]
        if self._probe is not None:
            if layer_idx in self._compressible:
                self._probe(layer_idx, query, self.cache.layers[layer_idx])
        elif self._capture and layer_idx in self._compressible:
            q = query if state.queries is None else torch.cat([state.queries, query], dim=2)
            state.queries = q if self._capture < 0 else q[:, :, -self._capture:]
        elif self._decoding and query.shape[2] == 1 and state.targets is not None and self._decode_policy:
            self.method.on_decode(self.cache.layers[layer_idx], query, state)

    # -- prefill and compression ------------------------------------------------------------
    def prefill(self, rows: list[list[int]], window: int | None = None, chunk: int | None = None) -> torch.Tensor:
        """Feed the prompts, then compress them with the session's method (None: the cache stays
        full); returns the last-token logits `(batch, vocab)`. Seconds go to `self.timings` (a
        method's surprisal pass counts as compression, not prefill).

        `chunk`: feed `chunk` tokens at a time and compress after each to the budget of the tokens seen
        so far, so the cache never holds more than budget + chunk entries per layer and head; the
        queries a method scores with are the current chunk's."""
        method = self.method
        width = max(len(r) for r in rows)
        if chunk is not None:  # refused before any forward, not after
            plain = method is None or isinstance(method, Full)
            check_chunk(chunk, 0 if plain else method.sinks, 0 if plain else method.window if window is None else window)
        if method is not None and method.sliding is not None:  # refused before any forward, not after
            sliding_layers(self.cache.layers, method, [int(s) + len(r) for s, r in zip(self.seen, rows)])
        if chunk is None or chunk >= width:
            t0 = self._clock()
            logits, surprisal, t1 = self.feed_prompt(rows, 0 if method is None else method.needs.queries,
                                                     method is not None and method.needs.surprisal)
            if method is not None:
                self.compress(rows, window, surprisal)
            self.timings = {"prefill_seconds": t1 - t0, "compress_seconds": self._clock() - t1}
            return logits
        self.timings = {"prefill_seconds": 0.0, "compress_seconds": 0.0}
        last = None
        wants_surprisal = method is not None and method.needs.surprisal
        history = [torch.zeros(0) for _ in rows]  # each row's surprisal so far (chunked: per chunk's logits)
        for start in range(0, width, chunk):  # each row's own chunks, as if it were alone
            part = [r[start:start + chunk] for r in rows]
            self.reserve(chunk)  # room for exactly this chunk: capacity follows budget + chunk
            t0 = self._clock()
            logits, surprisal, t1 = self.feed_prompt(part, 0 if method is None else method.needs.queries,
                                                     wants_surprisal)
            if surprisal is not None:
                history = [torch.cat([h, _continued(s[s.shape[0] - len(p):], p, prev)]) for h, s, p, prev
                           in zip(history, surprisal.cpu(), part, [None] * len(rows) if last is None else last)]
                surprisal = _left_padded(history)
            fed = torch.tensor([len(p) > 0 for p in part])
            last = logits if last is None else torch.where(fed[:, None].to(logits.device), logits, last)
            if method is not None:
                self.compress([r[:start + chunk] for r in rows], window, surprisal, running=True,
                              room=chunk if start + chunk < width else 0)
            self.timings["prefill_seconds"] += t1 - t0
            self.timings["compress_seconds"] += self._clock() - t1
        return last

    def feed_prompt(self, rows: list[list[int]], capture: int = 0, surprisal: bool = False):
        """Feed prompts keeping the last `capture` queries per full-attention layer (-1: all);
        → (last-token logits, each token's surprisal `(batch, width)` if asked else None, the clock
        when the forward ended)."""
        if not surprisal:
            logits = self.forward(rows, capture=capture)
            return logits, None, self._clock()
        logits, hidden, ids, pad = self._feed(rows, capture=capture, hidden=True)
        end = self._clock()
        return logits, self.surprisal_of(hidden, ids, pad), end

    def forward_surprisal(self, rows: list[list[int]]) -> torch.Tensor:
        """Feed the rows like `forward`; returns each fed token's surprisal `(batch, width)`, −log p
        given the tokens before it in this chunk (0 at a row's first token and on padding)."""
        return self.feed_prompt(rows, surprisal=True)[1]

    def probe(self, rows: list[list[int]], listener) -> None:
        """Feed `rows` (left-padded) after what the cache holds, calling `listener(layer_idx, query,
        layer)` right after each full-attention layer's attention with its post-RoPE queries
        `(b, hq, width, d)` and the layer holding the new keys last; then forget the feed: the cache
        and every counter are as before (appends never write below a layer's filled length)."""
        self.cache.check_free()
        marks = [_fields(layer) for layer in self.cache.layers]
        counters = self.seen.clone(), self.plain.clone(), self.captured.clone(), self.memo
        self._probe = listener
        try:
            self._feed(rows, decoding=False)
        finally:
            self._probe = None
            for layer, mark in zip(self.cache.layers, marks):
                _set_fields(layer, mark)
            self.seen, self.plain, self.captured, self.memo = counters

    def use(self, method: Method, tokenizer=None) -> None:
        """Switch the session to `method` (after `feed_prompt` with every query captured, one prefill
        can be compressed by several methods in turn: snapshot, compress, restore)."""
        self.method = method
        self.runtime.tokenizer = tokenizer
        self._decode_policy = method.needs.decode_policy
        method.setup_all(self.runtime)

    def surprisal_of(self, hidden, ids, pad):
        surprisal = token_surprisal(self.model, hidden, ids)
        return surprisal.masked_fill(pad | torch.nn.functional.pad(pad, (1, 0), value=True)[:, :-1], 0.0)

    @torch.no_grad()
    def compress(self, token_rows: list[list[int]] | None = None, window: int | None = None,
                 surprisal: torch.Tensor | None = None, running: bool = False, room: int = 0) -> None:
        """Compress every full-attention layer with the session's method (`kvmerge.planner.compress_layers`;
        padding slots are stripped per row first). `surprisal` `(batch, width)`, left-padded like the
        rows, reaches methods as `ctx.surprisal`; captured queries are released afterwards. `running`
        (chunked prefill): the target is `method.running_target` of the tokens seen so far, and methods
        see the ids of the plain tokens not yet compressed only (`ctx.token_ids`); `room`: the slots the
        next chunk appends."""
        self.cache.check_free()
        method, picked = self.method, self.cache.compressible
        if self.before_compress is not None:
            self.before_compress()
        if not picked and isinstance(method, Full):
            return
        if not picked:
            raise ValueError("this model has sliding-window layers only: its cache is already bounded by the "
                             "window and has no full-attention layer to compress: use method 'full' (--method full)")
        window = method.window if window is None else window
        layers = [self.cache.layers[i] for i in picked]
        # the counters copied: a method's second pass feeds the session and restores them
        view = View(self.seen.clone(), self.plain.clone(), self.captured.clone(), window, self.runtime.scaling,
                    token_rows, surprisal, running, layers=picked, model_layers=self.cache.layers, room=room)
        with torch.profiler.record_function("kvmerge::compress"):
            compressed = compress_layers(method, self.runtime, layers, [self.states[i] for i in picked], view)
        for state in self.states:
            state.queries = None
        self.captured.zero_()
        self.memo = {}
        self.plain = torch.where(compressed, self.plain.clamp(max=window), self.plain)  # the window stays plain

    # -- batch and state ----------------------------------------------------------------------
    def snapshot(self):
        """A copy of the cache and request state (the cache's buffers are written in place, so copied).
        Its `memo` is shared by every restore of it: what one method computes there, the next reuses."""
        self.cache.check_free()
        layers = [_fields(layer, clone=True) for layer in self.cache.layers]
        states = _copied_states(self.states)
        return (self.seen.clone(), self.plain.clone(), self.captured.clone(), self.memo), layers, states

    def restore(self, snapshot) -> None:
        self.cache.check_free()
        (seen, plain, captured, self.memo), layers, states = snapshot
        self.seen, self.plain, self.captured = seen.clone(), plain.clone(), captured.clone()
        for layer, fields in zip(self.cache.layers, layers):
            _set_fields(layer, fields, clone=True)
        self.states = _copied_states(states)

    def reserve(self, extra: int) -> None:
        """Room for `extra` more slots in every full-attention layer, so that many appends copy nothing."""
        self.cache.check_free()
        for i in self.cache.compressible:
            self.cache.layers[i].reserve(self.cache.layers[i].entries + extra)

    def repeat_rows(self, repeats: int) -> None:
        """Every row repeated `repeats` times (cache, positions and targets)."""
        self.cache.check_free()
        self.cache.batch_repeat_interleave(repeats)
        for state in self.states:
            if state.targets is not None:
                state.targets = state.targets.repeat_interleave(repeats)
        self.seen = self.seen.repeat_interleave(repeats)
        self.plain = self.plain.repeat_interleave(repeats)
        self.captured = self.captured.repeat_interleave(repeats)


def _continued(surprisal, ids, previous_logits):
    """One row's chunk surprisal `(len(ids),)`, its first token's taken from the previous chunk's
    last-token logits (None: the context's first chunk, where it stays 0)."""
    if previous_logits is None or not ids:
        return surprisal
    first = -torch.log_softmax(previous_logits.float().cpu(), -1)[ids[0]]
    return torch.cat([first[None], surprisal[1:]])


def _left_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """1-D tensors → `(len(rows), longest)`, left-padded with zeros."""
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for b, r in enumerate(rows):
        out[b, out.shape[1] - len(r):] = r
    return out


def _fields(layer, clone: bool = False) -> dict:
    """A layer's attributes (tensors cloned if `clone`), its per-head layers' (`heads`) included."""
    out = {k: v.clone() if clone and isinstance(v, torch.Tensor) else v for k, v in vars(layer).items()}
    if out.get("heads") is not None:
        out["heads"] = [(head, _fields(head, clone)) for head in out["heads"]]
    return out


def _set_fields(layer, fields: dict, clone: bool = False) -> None:
    """Give `layer` the attributes `fields` (from `_fields`) back, tensors cloned if `clone`."""
    fields = dict(fields)
    if fields.get("heads") is not None:
        for head, own in fields["heads"]:
            _set_fields(head, own, clone)
        fields["heads"] = [head for head, _ in fields["heads"]]
    vars(layer).clear()
    vars(layer).update({k: v.clone() if clone and isinstance(v, torch.Tensor) else v for k, v in fields.items()})


def _copied_states(states: list[LayerState]) -> list[LayerState]:
    """Layer states with their own scratch dicts (tensors in them are never written in place)."""
    return [dataclasses.replace(s, scratch=dict(s.scratch)) for s in states]
