"""Compression inside `model.generate` (sampling, streamers, stopping criteria: all of generate):

    with kvmerge.compressing(model, "snapkv", budget=0.25, tokenizer=tok) as kv:
        cache = kv.prefill(context_ids)              # question-agnostic: compress the context once
        out = model.generate(torch.tensor([context_ids + question_ids]), cache=cache, do_sample=True)
        out = model.generate(prompt, do_sample=True)  # question-aware: compressed right after its prefill

Inside the block the model runs kvmerge's attention, and a forward that starts on an empty
non-kvmerge cache (what `generate` creates) gets a fresh compressed session instead; decode
policies run on every one-token step. A cache from `kv.prefill` answers many questions: each
`model.generate(..., cache=cache)` inside the block starts from the compressed context again (what
the previous call appended is dropped), so its input must start with that context. The model is as
before once the block ends, and a cache the block made is refused by it (a `KVMergeError`).
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager

import torch

from .attention import kvmerge_attention
from .cache import MergedCache
from .errors import ContextTooLongError, InputError, ParameterTypeError, refusing
from .params import check_params
from .methods import Method, get_method
from .model import max_positions
from .session import Session


class Compressor:
    """Sessions for the caches `model.generate` runs on inside `compressing`."""

    def __init__(self, model, method: Method, tokenizer=None, named: bool = True):
        self.model, self.method, self.tokenizer = model, method, tokenizer
        self.named = named  # the method was asked for (not the model's default): a context of another is refused
        self._sessions: dict[int, Session] = {}  # id(cache) → its session
        self._fed: set[int] = set()  # caches that have seen a forward under generate
        self._pending = None  # (session, input ids) of a question-aware prefill in flight
        self._stack: ExitStack | None = None
        self._contexts: dict[int, tuple] = {}  # id(cache) of kv.prefill → (its rows, a snapshot after compression)

    @torch.no_grad()
    def prefill(self, context_ids) -> MergedCache:
        """Prefill and compress `context_ids` (one row or equal-length rows; or take a `CompressedContext`
        as it is, its context's ids from `context.context_ids`, answered with its own method: a block
        that names another method refuses it); pass the cache to
        `model.generate(input_ids=context + question, cache=...)`, once per question: every such call
        starts from this compressed context (the cache keeps a copy of it, restored per call)."""
        from .context import CompressedContext

        if isinstance(context_ids, CompressedContext):  # compressed before (or loaded from a file)
            return self._adopt(context_ids)
        with refusing():
            if isinstance(context_ids, str):
                raise ParameterTypeError("kv.prefill takes token ids, not text: kvmerge.split_prompt(tok, context, "
                                         "question) gives (context_ids, question_ids)")
            rows = context_ids.tolist() if isinstance(context_ids, torch.Tensor) else context_ids
            rows = [list(r) for r in rows] if rows and isinstance(rows[0], (list, tuple)) else [list(rows)]
            if len({len(r) for r in rows}) != 1 or not rows[0]:
                raise InputError("kv.prefill takes non-empty rows of one length: model.generate cannot run a padded "
                                 "batch on a kvmerge cache (use kvmerge.generate for rows of different lengths)")
            _check_length(self.model, len(rows[0]))
            self.method.target(len(rows[0]))
            session = Session(self.model, len(rows), self.method, self.tokenizer)
        session.prefill(rows)
        self._sessions[id(session.cache)] = session
        self._contexts[id(session.cache)] = (rows, session.snapshot())
        return session.cache

    def _adopt(self, context) -> MergedCache:
        with refusing():
            if context.context_ids is None:
                raise InputError("this compressed context kept only its token ids' hash: model.generate needs the "
                                 "ids (compress with keep_ids=True), or answer with kvmerge.generate")
            if context.model is not self.model:
                raise InputError("this compressed context belongs to another model object than the one compressing")
            made, here = context.session.method.label, self.method.label  # presets by their own names
            if self.named and made == here and context.meta["budget"] != self.method.budget:
                raise InputError(f"this compressed context was compressed at budget {context.meta['budget']} and "
                                 f"answers so, not at this block's {self.method.budget}: open kvmerge.compressing("
                                 f"model, {context.meta['method']!r}, budget={context.meta['budget']}) for it")
            if self.named and made != here:
                raise InputError(f"this compressed context was compressed with {made} and answers with it, not with "
                                 f"this block's {here}: open kvmerge.compressing(model, {context.meta['method']!r}) "
                                 "for it")
        session = context.rewind()
        self._sessions[id(session.cache)] = session
        self._contexts[id(session.cache)] = ([list(context.context_ids)], context._snapshot)
        return session.cache

    def rewind(self, cache: MergedCache, input_ids=None) -> None:
        """Put a cache from `prefill` back to its compressed context (what later forwards appended is
        dropped), checking that `input_ids` `(batch, n)`, if given, start with that context and go on."""
        rows, snapshot = self._contexts[id(cache)]
        if input_ids is not None:
            ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else [list(r) for r in input_ids]
            n = len(rows[0])
            if len(ids) != len(rows) or any(r[:n] != c for r, c in zip(ids, rows)):
                raise InputError(f"model.generate's input_ids must start with the {len(rows)} x {n} context ids given "
                                 "to kv.prefill (the cache holds that context, compressed): pass context_ids + "
                                 "question_ids")
            if any(len(r) <= n for r in ids):
                raise InputError("model.generate's input_ids hold only the context given to kv.prefill: append the "
                                 "question's ids (context_ids + question_ids)")
        self._sessions[id(cache)].restore(snapshot)
        self._fed.discard(id(cache))

    def wrap_generate(self, generate):
        """`model.generate` that rewinds a cache from `prefill` before transformers reads its length."""
        @functools.wraps(generate)
        def run(*args, **kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            _refuse_padding(kwargs.get("attention_mask"))
            if isinstance(cache, MergedCache) and id(cache) in self._contexts:
                ids = kwargs.get("input_ids", args[0] if args else None)
                with refusing():
                    self.rewind(cache, ids)
            return generate(*args, **kwargs)
        return run

    def before_forward(self, _module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        ids = kwargs.get("input_ids", args[0] if args else None)
        kwargs.pop("past_key_values", None)
        fresh = cache is None or (isinstance(cache, MergedCache) and id(cache) not in self._fed) or \
            (not isinstance(cache, MergedCache) and cache.get_seq_length() == 0)
        if fresh:  # a prompt's first forward (generate may have built the mask from pad_token_id)
            _refuse_padding(kwargs.get("attention_mask"))
        if isinstance(cache, MergedCache) and id(cache) in self._sessions:
            session = self._sessions[id(cache)]
            rows = len(session.seen)
            if ids is not None and ids.shape[0] != rows and id(cache) not in self._fed:
                if ids.shape[0] % rows:  # generate expanded the prompt (num_return_sequences, beams)
                    raise InputError(f"model.generate runs {ids.shape[0]} rows on a cache of {rows} from kv.prefill")
                session.repeat_rows(ids.shape[0] // rows)
            decoding = id(cache) in self._fed  # the first forward feeds the question
            self._fed.add(id(cache))
            self._stack = ExitStack()
            self._stack.enter_context(session.observing(decoding=decoding))
        elif not isinstance(cache, MergedCache) and (cache is None or cache.get_seq_length() == 0):
            if ids is None:
                raise InputError("kvmerge compresses prompts given as input_ids, not inputs_embeds")
            _check_length(self.model, ids.shape[1])
            session = Session(self.model, ids.shape[0], self.method, self.tokenizer)
            self._sessions[id(session.cache)] = session
            self._fed.add(id(session.cache))
            self._stack = ExitStack()
            needs = self.method.needs
            hidden = self._stack.enter_context(session.observing(capture=needs.queries, hidden=needs.surprisal))
            self._pending = (session, ids, hidden)
            cache = session.cache
        kwargs["cache"] = cache
        return args, kwargs

    def after_forward(self, _module, _args, _kwargs, output):
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
        if self._pending is not None:
            session, ids, hidden = self._pending
            self._pending = None
            if output is None:  # the forward raised: its error stands, nothing to compress
                return output
            session.fed(torch.full((ids.shape[0],), ids.shape[1]), captured=1)
            session.method.target(ids.shape[1])  # a clear error if the prompt cannot meet the budget
            session.compress_prompt(ids.tolist(), hidden[0] if hidden else None)
        return output


@contextmanager
def compressing(model, method: Method | str | None = None, tokenizer=None, **params):
    """Compress the caches of `model.generate` (and plain forwards) inside the block; yields the
    `Compressor` (its `prefill` compresses a context for the question-agnostic recipe). `method` is a
    `Method`, or a name or spec with `params` (`compressing(model, "snapkv", budget=0.25)`); None: the
    default for this model (`kvmerge.defaults.default_method`: learnedzip where it has learned-scorer
    weights, `learnedzip:sliding=0.75` on models with sliding-window layers, else mixedmerge), with `params`."""
    named = method not in (None, "default")
    with refusing():
        if not named:
            from .defaults import default_method

            method = default_method(model)
        if isinstance(method, str):
            method = get_method(method, **params)
        elif params:
            raise ParameterTypeError("parameters go with a method name, not with a Method object")
        if not isinstance(method, Method):
            raise ParameterTypeError(f"method must be a name or a kvmerge Method, got {type(method).__name__}")
        check_params(method)
        if method.needs.tokenizer and tokenizer is None:
            name = method.label
            raise InputError(f"{name} needs the model's tokenizer (sentence ends, its chat template): pass "
                             f"tokenizer=tok to kvmerge.compressing")
        if tokenizer is not None:
            from .prompt import check_tokenizer

            check_tokenizer(tokenizer, "compressing(model, method, tokenizer=...)", model)
    compressor = Compressor(model, method, tokenizer, named)
    own = vars(model).get("generate")  # an instance attribute set before, if any
    with kvmerge_attention(model):
        pre = model.register_forward_pre_hook(compressor.before_forward, with_kwargs=True)
        post = model.register_forward_hook(compressor.after_forward, with_kwargs=True, always_call=True)
        model.generate = compressor.wrap_generate(model.generate)
        try:
            yield compressor
        finally:
            pre.remove()
            post.remove()
            for session in compressor._sessions.values():
                session.cache.block_ended = True
            if own is None:
                del model.generate
            else:
                model.generate = own


def _refuse_padding(mask) -> None:
    """An `InputError` for a padded batch (an attention_mask with zeros), before the model runs."""
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and not bool(mask.all()):
        raise InputError("kvmerge.compressing runs rows of one length, and this batch is padded (its attention_mask "
                         "has zeros): use kvmerge.generate (or generate_ids) for batches of different lengths, or run "
                         "model.generate one row at a time")


def _check_length(model, n: int) -> None:
    limit = max_positions(model)
    if limit and n > limit:
        raise ContextTooLongError(f"the prompt is {n:,} tokens, over the model's {limit:,} positions "
                                  f"(max_position_embeddings): shorten it to at most {limit:,} tokens")
