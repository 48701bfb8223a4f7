"""Generation with a compressed cache: prefill the context, compress, append the question, decode.

Batches of different lengths run as one left-padded batch: padding tokens get log_n = -inf, so
they receive exactly zero attention, and every row keeps its own true positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import MergedCache, bytes_per_token
from .methods import LayerContext, Method, get_method
from .model import prepare, token_surprisal

PROTOCOLS = ("agnostic", "aware")


@dataclass
class GenerationOutput:
    """Generated token ids per row, their text (str for a single prompt), and run statistics."""

    tokens: list[list[int]]
    text: str | list[str] = ""
    stats: dict = field(default_factory=dict)


class Session:
    """A model plus a `MergedCache`, fed left-padded chunks of token rows at true positions."""

    def __init__(self, model, batch_size: int):
        prepare(model)
        self.model = model
        self.cache = MergedCache(model.config.num_hidden_layers)
        self.seen = torch.zeros(batch_size, dtype=torch.long)
        self.timings: dict = {}

    @property
    def device(self):
        return next(self.model.parameters()).device

    def forward(self, rows: list[list[int]], pad_id: int = 0, decoding: bool = True,
                all_logits: bool = False, surprisal: bool = False):
        """Feed one chunk per row; returns next-token logits `(batch, vocab)` at each row's last token
        (`all_logits`: `(batch, width, vocab)` at every position, left-padded rows included).
        `surprisal`: returns `(logits, surprisal (batch, width))`, −log p of each fed token given the
        ones before it in this chunk (0 at a row's first token and on padding).

        Decode hooks run on one-token chunks only when `decoding` (not for a one-token question)."""
        lengths = torch.tensor([len(r) for r in rows])
        width = int(lengths.max())
        pad = torch.arange(width)[None, :] < (width - lengths)[:, None]
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r):] = torch.tensor(r, dtype=torch.long)
        pos = self.seen[:, None] + (torch.arange(width)[None, :] - (width - lengths)[:, None]).clamp_min(0)
        log_n = torch.zeros(pad.shape).masked_fill_(pad, float("-inf")) if bool(pad.any()) else None
        self.cache.set_pending_log_n(None if log_n is None else log_n.to(self.device))
        for layer in self.cache.layers:
            layer.run_hooks = decoding
        hidden = []
        hook = (self.model.get_decoder().register_forward_hook(lambda _m, _a, o: hidden.append(o[0]))
                if surprisal else None)
        try:
            out = self.model(input_ids=ids.to(self.device), position_ids=pos.to(self.device), cache=self.cache,
                             use_cache=True, logits_to_keep=0 if all_logits else 1)
        finally:
            if hook is not None:
                hook.remove()
        self.seen += lengths
        logits = out.logits.float() if all_logits else out.logits[:, -1].float()
        if not surprisal:
            return logits
        t0 = time.perf_counter()
        surp = token_surprisal(self.model, hidden[0], ids)
        self.timings["surprisal_seconds"] = time.perf_counter() - t0
        return logits, surp.masked_fill(pad | torch.nn.functional.pad(pad, (1, 0), value=True)[:, :-1], 0.0)

    def snapshot(self):
        """The cache state (tensors are never modified in place, so references suffice)."""
        return self.seen.clone(), [dict(vars(layer)) for layer in self.cache.layers]

    def restore(self, snapshot) -> None:
        seen, layers = snapshot
        self.seen = seen.clone()
        for layer, state in zip(self.cache.layers, layers):
            vars(layer).update(state)

    def prefill(self, rows: list[list[int]], method: Method | None = None, window: int | None = None):
        """Feed the prompts, then compress them with `method` (None: the cache stays full); returns the
        last-token logits `(batch, vocab)`. Seconds spent go to `self.timings` (a method's surprisal
        pass counts as compression, not prefill)."""
        if method is not None:
            for layer in self.cache.layers:
                layer.capture_queries = method.query_window
        t0 = time.perf_counter()
        surprisal = None
        if method is not None and method.needs_surprisal:
            logits, surprisal = self.forward(rows, surprisal=True)
        else:
            logits = self.forward(rows)
        t1 = time.perf_counter()
        if method is not None:
            self.compress(method, rows, window, surprisal)
        extra = self.timings.pop("surprisal_seconds", 0.0) if surprisal is not None else 0.0
        self.timings = {"prefill_seconds": t1 - t0 - extra, "compress_seconds": time.perf_counter() - t1 + extra}
        return logits

    def compress(self, method: Method, token_rows: list[list[int]] | None = None, window: int | None = None,
                 surprisal: torch.Tensor | None = None):
        """Compress every layer with `method`; padding slots are stripped per row first."""
        compress_cache(self.cache, method, self.model.config, token_rows, window, surprisal)


def compress_cache(cache: MergedCache, method: Method, config, token_rows=None, window=None,
                   surprisal=None) -> None:
    """Run `method.compress` on each layer of `cache` (at most `method.target(n)` entries per row/head).
    `surprisal` `(batch, width)`, left-padded like the rows, reaches methods as `ctx.surprisal`."""
    window = method.window if window is None else window
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    n_layers = len(cache.layers)
    first = cache.layers[0]
    dense = first.log_n is None  # no padding: every row has the same tokens count
    n = first.keys.shape[2]
    method.plan(cache.layers, LayerContext(
        layer_idx=-1, num_layers=n_layers, target=method.target(n, window), sinks=method.sinks, window=window,
        scaling=head_dim ** -0.5, rows=torch.arange(first.keys.shape[0]), dense=dense,
        token_ids=None if token_rows is None or not dense else torch.tensor([r[-n:] for r in token_rows]),
        surprisal=None if surprisal is None or not dense else surprisal[:, -n:]))
    for layer in cache.layers:
        layer.targets = torch.zeros(layer.keys.shape[0], dtype=torch.long)

        def run(keys, values, log_n, rows, layer=layer):
            n = keys.shape[2]
            ids = None
            if token_rows is not None:
                ids = torch.tensor([token_rows[int(b)][-n:] for b in rows], device=keys.device)
            queries = None
            if layer.queries is not None:
                q = layer.queries[rows]
                queries = q[:, :, -n:] if method.query_window < 0 else q[:, :, -min(n, q.shape[2]):]
            ctx = LayerContext(layer_idx=layer.index, num_layers=n_layers, target=method.target(n, window),
                               sinks=method.sinks, window=window, scaling=head_dim ** -0.5,
                               token_ids=ids, queries=queries, rows=rows,
                               surprisal=None if surprisal is None else surprisal[rows][:, -n:].to(keys.device))
            layer.targets[rows] = ctx.target
            if ctx.target >= n:
                return keys, values, log_n
            return method.compress(keys, values, log_n, ctx)

        layer.map_rows(run)
        layer.queries = None
        layer.capture_queries = 0
        layer.compressed_at = layer.seen
        layer.decode_hook = method.decode_hook()


def _as_rows(x, what: str) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        x = x.tolist() if x.dim() == 2 else [x.tolist()]
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{what} must be a list of token ids or a list of such lists")
    if not x:
        return [[]]
    return [list(r) for r in x] if isinstance(x[0], (list, tuple)) else [list(x)]


@torch.inference_mode()
def generate_ids(model, context_ids, question_ids, method: Method | None = None, max_new_tokens: int = 32,
                 protocol: str = "agnostic", eos_token_id: int | None = None, tokenizer=None) -> GenerationOutput:
    """Greedy generation from token ids (one row, or a list of rows run as one padded batch)."""
    method = method or get_method("full")
    contexts, questions, window = _validate(model, context_ids, question_ids, protocol, max_new_tokens, method)
    method.setup(model, tokenizer)
    session, logits, stats = _prefill_and_compress(model, contexts, method, window, protocol)
    if protocol == "agnostic":
        logits = session.forward(questions, decoding=False)
    return _decode(session, logits, method, stats, max_new_tokens, eos_token_id)


@torch.inference_mode()
def answer_questions(model, context_ids: list[int], questions: list[list[int]], method: Method,
                     max_new_tokens: int = 32, eos_token_id: int | None = None, tokenizer=None):
    """Several questions about one context (question-agnostic): the context is prefilled and
    compressed once, and each question decodes from that same compressed cache."""
    outs = []
    for q in questions:
        _validate(model, [context_ids], [q], "agnostic", max_new_tokens, method)
    method.setup(model, tokenizer)
    session, _, stats = _prefill_and_compress(model, [list(context_ids)], method, method.window, "agnostic")
    snapshot = session.snapshot()
    for q in questions:
        session.restore(snapshot)
        logits = session.forward([list(q)], decoding=False)
        outs.append(_decode(session, logits, method, dict(stats), max_new_tokens, eos_token_id))
    return outs


def _validate(model, context_ids, question_ids, protocol, max_new_tokens, method):
    """Checked rows → (contexts, questions, protected window); raises a clear error on bad input."""
    if not isinstance(method, Method):
        raise TypeError(f"method must be a kvmerge Method (see kvmerge.get_method), got {type(method).__name__}")
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    contexts, questions = _as_rows(context_ids, "context_ids"), _as_rows(question_ids, "question_ids")
    if len(contexts) != len(questions):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions")
    if any(len(c) == 0 for c in contexts):
        raise ValueError("empty context: nothing to compress")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    bad = [t for r in contexts + questions for t in r if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {vocab})")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if protocol == "aware":
        window = max([method.window] + [len(q) for q in questions])
        contexts, questions = [c + q for c, q in zip(contexts, questions)], [[] for _ in questions]
    else:
        window = method.window
        if any(len(q) == 0 for q in questions):
            raise ValueError("empty question: the agnostic protocol needs question tokens to decode from")
    for c in contexts:
        method.target(len(c), window)  # raises early on a budget the context cannot meet
    return contexts, questions, window


def _prefill_and_compress(model, contexts, method, window, protocol):
    session = Session(model, len(contexts))
    stats = {"method": method.name, "budget": method.budget, "protocol": protocol,
             "context_tokens": [len(c) for c in contexts]}
    logits = session.prefill(contexts, method, window)
    per_token = bytes_per_token(model.config, session.cache.layers[0].keys.dtype)
    stats.update(**session.timings, cache_entries=session.cache.entries,
                 cache_bytes=session.cache.nbytes,
                 full_cache_bytes=per_token * len(contexts) * max(len(c) for c in contexts))
    return session, logits, stats


def _decode(session, logits, method, stats, max_new_tokens, eos_token_id) -> GenerationOutput:
    t0 = time.perf_counter()
    done = torch.zeros(logits.shape[0], dtype=torch.bool)
    tokens: list[list[int]] = [[] for _ in range(logits.shape[0])]
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1).cpu()
        for b in range(len(tokens)):
            if not done[b]:
                tokens[b].append(int(nxt[b]))
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = session.forward([[int(t)] for t in nxt])
    stats.update(decode_seconds=time.perf_counter() - t0, new_tokens=[len(t) for t in tokens],
                 final_cache_bytes=session.cache.nbytes, **method.stats)
    return GenerationOutput(tokens=tokens, stats=stats)


def split_prompt(tokenizer, context: str, question: str, chat_template: bool = True):
    """Tokenize the whole prompt once; split it at the context/question boundary by char offsets."""
    if not isinstance(context, str) or not context.strip():
        raise ValueError("empty context: nothing to compress")
    user = f"{context}\n\n{question}"
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        special = False
    else:
        text, special = user, True
    q_start = text.rfind(question) if question else text.rfind(user) + len(user)
    enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    boundary = sum(1 for (_s, e) in offsets if e <= q_start)
    return ids[:boundary], ids[boundary:]


def generate(model, tokenizer, context, question, method: Method | str | None = None, max_new_tokens: int = 32,
             protocol: str = "agnostic", chat_template: bool = True) -> GenerationOutput:
    """Answer `question` about `context` (strings, or equal-length lists run as one batch)."""
    single = isinstance(context, str)
    contexts = [context] if single else list(context)
    questions = [question] if isinstance(question, str) else list(question)
    if len(contexts) != len(questions):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions")
    if isinstance(method, str):
        method = get_method(method)
    pairs = [split_prompt(tokenizer, c, q, chat_template) for c, q in zip(contexts, questions)]
    out = generate_ids(model, [p[0] for p in pairs], [p[1] for p in pairs], method, max_new_tokens, protocol,
                       eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer)
    texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in out.tokens]
    out.text = texts[0] if single else texts
    if single:
        out.stats["context_tokens"] = out.stats["context_tokens"][0]
    return out
