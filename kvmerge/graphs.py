"""Decoding steps of fixed shapes, so that a step is captured once as a CUDA graph and replayed.

`GraphDecoder(session, steps)` turns each layer of the session's cache into a `GraphLayer`: keys and
values `(batch, kv_heads, filled + steps, head_dim)` and a log-mass `(batch, kv_heads, filled + steps)`
that is −inf on the slots not written yet. Every step then reads the same shapes and writes its token
at slot `filled + t`, `t` a counter on the device, so no step needs a value from the host.
Attention over the whole buffer with that log-mass equals attention over the slots written (an empty
slot's weight is exp(−inf) = 0). A sliding-window layer keeps its slots' positions and adds −inf to the
slots outside the window of the step's position. KV heads stored at their own lengths stay packed
(`PackedGraphLayer`: each head's segment gets its empty slots).

On CUDA the step (the model's forward and the counters' advance) is captured once, after two warm-up
steps whose writes are undone, and replayed; on other devices it runs eagerly, the same operators.
`close()` writes the slots back into the session's own layers, which then hold the decoded tokens as
if the session had fed them one by one.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .errors import InputError, ParameterTypeError, UnsupportedError
from .layer import MergedLayer
from .ragged import LOG_N_DTYPE


def check_cuda_graph(cuda_graph, method, model) -> None:
    """The `cuda_graph` argument of kvmerge's answering functions: a bool, and where True, a `method`
    and `model` whose decoding steps can be captured (`refuse_graph`)."""
    if not isinstance(cuda_graph, bool):
        raise ParameterTypeError(f"cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph:
        refuse_graph(method, model)


def refuse_graph(method, model=None) -> None:
    """An InputError where decoding steps cannot be captured as a CUDA graph: `method` chooses entries
    while decoding (a decode policy, which needs the host), or `model`, where given, is not on one
    CUDA device."""
    if method is not None and method.needs.decode_policy:
        raise InputError(f"{method.name} chooses entries while decoding (a decode policy), which a captured "
                         "step cannot run: decode it without a CUDA graph")
    if model is None:
        return
    devices = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        raise InputError(f"a CUDA graph captures one device's work, and this model is spread over {len(devices)} "
                         f"({', '.join(sorted(devices))}): decode it without a CUDA graph")
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise InputError(f"a CUDA graph needs the model on a CUDA device; it is on {device}")


class GraphLayer(CacheLayerMixin):
    """One layer's cache during graph decoding: `keys`/`values` `(b, h, capacity, d)`, `log_n`
    `(b, h, capacity)` (−inf: empty), `filled` slots before the first step, and for a sliding layer
    `positions` `(b, capacity)` and its `window`. `step` `(1,)` and `query_pos` `(b, 1)` are the
    decoder's counters, shared by every layer."""

    ragged = False
    is_compileable = False

    def __init__(self, layer: MergedLayer, steps: int, step: torch.Tensor, query_pos: torch.Tensor):
        super().__init__()
        keys, values, log_n = layer.kv()
        b, h, filled, d = keys.shape
        self.is_initialized, self.device, self.dtype = True, keys.device, keys.dtype
        self.filled, self.seen = filled, layer.seen
        # a sliding layer holding fewer slots than its window (`sliding=`) sees only those and the step's own
        self.window = min(layer.window, layer.held + 1) if getattr(layer, "is_sliding", False) else None
        self.is_sliding = self.window is not None
        self.keys = keys.new_zeros(b, h, filled + steps, d)
        self.values = values.new_zeros(b, h, filled + steps, values.shape[-1])
        self.log_n = torch.full((b, h, filled + steps), float("-inf"), dtype=LOG_N_DTYPE, device=keys.device)
        self.keys[:, :, :filled], self.values[:, :, :filled], self.log_n[:, :, :filled] = keys, values, log_n
        self.positions = None
        if self.is_sliding:
            self.positions = torch.zeros(b, filled + steps, dtype=torch.long, device=keys.device)
            self.positions[:, :filled] = layer.positions.to(keys.device)
        self.base = torch.tensor([filled], device=keys.device)
        self.step, self.query_pos = step, query_pos

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one token `(b, h, 1, d)` at slot `filled + step`; → keys, values and the log-mass the
        step attends with (a sliding layer's: −inf outside its window), all of the full capacity, and
        None (no packed heads)."""
        at = self.base + self.step
        self.keys.index_copy_(2, at, key_states)
        self.values.index_copy_(2, at, value_states)
        self.log_n.index_fill_(2, at, 0.0)
        if not self.is_sliding:
            return self.keys, self.values, self.log_n, None
        self.positions.index_copy_(1, at, self.query_pos)
        diff = self.query_pos - self.positions  # (b, capacity)
        outside = (diff < 0) | (diff >= self.window)
        return self.keys, self.values, self.log_n.masked_fill(outside[:, None], float("-inf")), None

    def emptied(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `(b, h, 0, d)`: what the replaced layer holds meanwhile."""
        return self.keys[:, :, :0], self.values[:, :, :0]

    def undo(self) -> None:
        """Empty every slot written since the first step (after warm-up or capture)."""
        self.log_n[:, :, self.filled:] = float("-inf")

    def written_back(self, layer: MergedLayer, done: int) -> None:
        """Install the filled slots and the `done` decoded ones into `layer`, the one this replaced (a
        sliding layer: the slots it would hold had it decoded them itself)."""
        n = self.filled + done
        layer.replace(self.keys[:, :, :n], self.values[:, :, :n], self.log_n[:, :, :n], fit=True)
        layer.seen = self.seen + done
        if self.is_sliding:
            layer.positions = self.positions[:, :n].clone()
            layer._drop_unheld()
            layer.replace(layer.keys, layer.values, layer.log_n, fit=True)  # own buffers of the slots kept

    # what transformers' `Cache` asks of a layer
    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    @property
    def entries(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for x in (self.keys, self.values, self.log_n))

    allocated_bytes = nbytes


class PackedGraphLayer(GraphLayer):
    """A layer whose KV heads are stored at their own lengths (`kvmerge.ragged`), during graph decoding:
    each head's segment of the packed buffers `(b, Σ capacity, d)` holds its slots and `steps` empty
    ones (log-mass −inf), read by `ragged_sdpa` one head at a time at fixed shapes, with no padding
    to the longest head."""

    ragged = True

    def __init__(self, layer: MergedLayer, steps: int, step: torch.Tensor, query_pos: torch.Tensor):
        CacheLayerMixin.__init__(self)
        pk, pv, pl, spans = layer.packed()
        device, b = pk.device, pk.shape[0]
        self.is_initialized, self.device, self.dtype = True, device, pk.dtype
        self.seen, self.window, self.is_sliding, self.positions = layer.seen, None, False, None
        self.lens = [n for _, n in spans]
        caps = [n + steps for n in self.lens]
        starts = [sum(caps[:i]) for i in range(len(caps))]
        self.spans = tuple(zip(starts, caps))
        self.live, self.kept = layer._live, layer._kept  # the padded layout's map, unchanged by appends
        src = torch.cat([torch.arange(s, s + n) for s, n in spans]).to(device)
        self.filled_at = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, self.lens)]).to(device)
        self.future = torch.cat([torch.arange(s + n, s + c) for s, n, c in zip(starts, self.lens, caps)]).to(device)
        self.keys = pk.new_zeros(b, sum(caps), pk.shape[-1]).index_copy_(1, self.filled_at, pk.index_select(1, src))
        self.values = pv.new_zeros(b, sum(caps), pv.shape[-1]).index_copy_(1, self.filled_at, pv.index_select(1, src))
        self.log_n = torch.full((b, sum(caps)), float("-inf"), dtype=LOG_N_DTYPE, device=device)
        self.log_n.index_copy_(1, self.filled_at, pl.index_select(1, src) if pl is not None
                               else torch.zeros(b, len(src), dtype=LOG_N_DTYPE, device=device))
        self.base = torch.tensor([s + n for s, n in zip(starts, self.lens)], device=device)  # (h,)
        self.step, self.query_pos = step, query_pos

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write one token `(b, h, 1, d)` at each head's slot `start + filled + step`; → the step's keys and
        values, no dense log-mass, and the packed heads `ragged_sdpa` reads."""
        b, h, _, d = key_states.shape
        at = self.base + self.step
        self.keys.index_copy_(1, at, key_states.reshape(b, h, d))
        self.values.index_copy_(1, at, value_states.reshape(b, h, value_states.shape[-1]))
        self.log_n.index_fill_(1, at, 0.0)
        return key_states, value_states, None, (self.keys, self.values, self.log_n, self.spans)

    def emptied(self) -> tuple[torch.Tensor, torch.Tensor]:
        h = len(self.spans)
        return tuple(x[:, None, :0].expand(x.shape[0], h, 0, x.shape[-1]).contiguous() for x in (self.keys, self.values))

    def undo(self) -> None:
        self.log_n.index_fill_(1, self.future, float("-inf"))

    def written_back(self, layer: MergedLayer, done: int) -> None:
        lens = tuple(n + done for n in self.lens)
        at = torch.cat([torch.arange(s, s + n) for (s, _), n in zip(self.spans, lens)]).to(self.keys.device)
        log_n = self.log_n.index_select(1, at)
        layer._set_packed(self.keys.index_select(1, at), self.values.index_select(1, at),
                          None if bool((log_n == 0).all()) else log_n, lens)
        layer._live, layer._kept = self.live, self.kept
        layer.seen = self.seen + done

    def get_max_length(self) -> int:
        return max(c for _, c in self.spans)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_max_length(), 0

    @property
    def entries(self) -> int:
        return self.get_max_length()


class GraphDecoder:
    """Up to `steps` decoding steps of one token per row on `session`, each the same captured graph on
    CUDA (`graph=None`: on CUDA; True: required; False: eager everywhere).

        with GraphDecoder(session, steps=64) as decoder:
            logits = decoder.step(next_ids)  # (batch, vocab), valid until the next step

    The session's method must not run a decode policy (entries chosen while decoding need the host).
    """

    def __init__(self, session, steps: int, graph: bool | None = None):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InputError(f"steps must be a positive int (the most tokens to decode), got {steps!r}")
        device = session.device
        refuse_graph(session.method, session.model if graph else None)
        cache = session.cache
        if any(isinstance(layer, GraphLayer) for layer in cache.layers):
            raise InputError("the cache is already in a GraphDecoder: close that one first")
        if cache.entries[0] == 0:
            raise InputError("the session holds no tokens: prefill a prompt before decoding")
        self.session, self.steps, self.done = session, steps, 0
        self.graph = device.type == "cuda" if graph is None else graph
        batch = len(session.seen)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.start = session.seen[:, None].to(device)
        self.pos = self.start.clone()
        self.layers, self.logits, self._graph = list(cache.layers), None, None
        self._listener, cache.listener = cache.listener, None
        try:
            for i, layer in enumerate(self.layers):  # one layer at a time: at most one layer held twice
                cache.layers[i] = static = (PackedGraphLayer if layer.ragged else GraphLayer)(layer, steps, self.t,
                                                                                             self.pos)
                layer.replace(*static.emptied(), None, fit=True)  # its slots moved
            session.peak_cache_bytes = max(session.peak_cache_bytes, cache.allocated_bytes)
            if self.graph:
                with torch.cuda.device(device):
                    self._capture()
        except BaseException:
            self._restore(0)  # the session as it was
            raise

    def _forward(self) -> torch.Tensor:
        from .attention import kvmerge_attention

        with kvmerge_attention(self.session.model):
            out = self.session.model(input_ids=self.ids, position_ids=self.pos, cache=self.session.cache,
                                     use_cache=True, logits_to_keep=1)
        self.t.add_(1)
        self.pos.add_(1)
        return out.logits[:, -1].float()

    def _undo(self) -> None:
        self.t.zero_()
        self.pos.copy_(self.start)
        for layer in self.session.cache.layers:
            layer.undo()

    def _capture(self) -> None:
        """Warm up (kernels compiled, workspaces allocated) on a side stream, each warm-up step undone,
        then capture one step; its logits buffer becomes `self.logits`."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(2):
                self._forward()
                self._undo()
        torch.cuda.current_stream().wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        try:
            with torch.inference_mode(), torch.cuda.graph(self._graph):
                self.logits = self._forward()
        except RuntimeError as e:  # e.g. a value read on the host inside this model's forward
            raise UnsupportedError(f"this model's decoding step cannot be captured as a CUDA graph ({str(e)[:200]}): "
                                   "decode it without a CUDA graph") from e
        self._undo()

    @torch.inference_mode()
    def step(self, ids) -> torch.Tensor:
        """Feed one token per row (`ids` `(batch,)`, a tensor or list; on the model's device, no
        transfer); → the next-token logits `(batch, vocab)` float32, one buffer that every step
        overwrites (with or without a graph)."""
        if self.layers is None:
            raise InputError("this GraphDecoder is closed")
        if self.done == self.steps:
            raise InputError(f"this GraphDecoder has room for {self.steps} steps, all taken: open one with more")
        ids = torch.as_tensor(ids).reshape(-1, 1)
        if ids.shape[0] != self.ids.shape[0]:
            raise InputError(f"one token per row: the session has {self.ids.shape[0]} rows, got {ids.shape[0]} ids")
        self.ids.copy_(ids)
        if self.graph:
            with torch.cuda.device(self.ids.device):
                self._graph.replay()
        elif self.logits is None:
            self.logits = self._forward()
        else:
            self.logits.copy_(self._forward())
        self.done += 1
        return self.logits

    def close(self) -> None:
        """The session's own layers back, holding the decoded tokens; the counters advanced."""
        if self.layers is None:
            return
        self._restore(self.done)
        self.session.fed(torch.full(self.session.seen.shape, self.done, dtype=torch.long))

    def _restore(self, done: int) -> None:
        """Each layer back in the cache with its filled slots and `done` decoded ones, one at a time."""
        cache = self.session.cache
        self._graph = self.logits = None
        try:
            for i, layer in enumerate(self.layers):
                if isinstance(cache.layers[i], GraphLayer):
                    cache.layers[i].written_back(layer, done)
                    cache.layers[i] = layer
        finally:
            self.layers = None
            cache.listener = self._listener

    def __enter__(self) -> GraphDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
