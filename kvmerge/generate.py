"""A request's whole flow, top to bottom: check the input, prefill the context, compress it, feed
the question, decode greedily.

Question-agnostic protocol (default): the context is compressed before the question is seen, then
the question is appended uncompressed. Question-aware: the question is part of the compressed
prompt, inside the protected recent window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import stock_cache_bytes
from .errors import ContextTooLongError, InputError, ParameterTypeError, check_params, refusing
from .methods import Method, get_method
from .model import max_positions
from .progress import bars_for, watching
from .session import Session
from .stats import Stats

PROTOCOLS = ("agnostic", "aware")
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>")  # chat templates' end-of-turn tokens


@dataclass
class GenerationOutput:
    """Generated token ids per row, their text (str for a single prompt), and run statistics
    (`Stats`: a dict with a one-line `str`)."""

    tokens: list[list[int]]
    text: str | list[str] = ""
    stats: Stats = field(default_factory=Stats)


@dataclass
class Sampling:
    """How the next token is chosen: greedy when `temperature` is 0, else sampled after temperature,
    top-k (0: off) and nucleus top-p filtering, from a generator seeded with `seed`."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise InputError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got temperature="
                             f"{self.temperature}, top_k={self.top_k}, top_p={self.top_p}")

    def chooser(self):
        """A function logits `(batch, vocab)` → next token ids `(batch,)`."""
        if self.temperature == 0:
            return lambda logits: logits.argmax(-1)
        from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                            TopKLogitsWarper, TopPLogitsWarper)

        warpers = LogitsProcessorList([TemperatureLogitsWarper(self.temperature)]
                                      + ([TopKLogitsWarper(self.top_k)] if self.top_k else [])
                                      + ([TopPLogitsWarper(self.top_p)] if self.top_p < 1 else []))
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else torch.seed())

        def choose(logits):
            probs = warpers(None, logits.float().cpu()).softmax(-1)
            return torch.multinomial(probs, 1, generator=generator)[:, 0].to(logits.device)
        return choose


@torch.inference_mode()
def generate_ids(model, context_ids, question_ids, method: Method | str | None = None, max_new_tokens: int = 32,
                 protocol: str = "agnostic", eos_token_id=None, tokenizer=None,
                 sampling: Sampling | None = None, streamer=None, stop=None,
                 prefill_chunk: int | None = None, progress=None) -> GenerationOutput:
    """Generation from token ids (one row, or a list of rows run as one padded batch); greedy unless
    `sampling` says otherwise. `streamer` (a transformers streamer: `put`, `end`) receives each new
    token of a single row; `stop(row_tokens) -> bool` ends a row early; `eos_token_id`: an id or ids
    that end a row. `prefill_chunk`: prefill and compress that many tokens at a time (bounded memory;
    see `Session.prefill`). `progress`: None (quiet), True (bars on stderr for steps over 2 s) or
    `progress(phase, done, total)`. `method`: None compresses with the default for this model
    (`kvmerge.defaults.default_method`: learnedzip where it has learned-scorer weights, else mixedmerge,
    which needs `tokenizer`); `get_method("full")` keeps the whole cache. Every check runs before the
    first forward pass."""
    with refusing():
        method, default = _resolve(model, method)
        contexts, questions, window = _validate(model, context_ids, question_ids, protocol, max_new_tokens, method,
                                                prefill_chunk)
        if default:
            _check_tokenizer(method, tokenizer)
        if streamer is not None and len(contexts) > 1:
            raise InputError("a streamer takes a single row")
        session = Session(model, len(contexts), method, tokenizer)
    report = bars_for(progress)
    try:
        with watching(session, report, max(map(len, contexts))):
            logits = session.prefill(contexts, window, prefill_chunk)
        session.reserve(max(len(q) for q in questions) + max_new_tokens)
        stats = cache_stats(session, contexts, protocol)
        if protocol == "agnostic":
            logits = session.forward(questions, decoding=False)
        return decode(session, logits, stats, max_new_tokens, eos_token_id, sampling, streamer, stop, report)
    finally:
        getattr(report, "close", lambda: None)()


def answer_questions(model, tokenizer, context, questions, method: Method | str | None = None,
                     max_new_tokens: int = 32, chat_template: bool = True, eos_token_id=None,
                     progress=None) -> list[GenerationOutput]:
    """Several questions (a list of str) about one `context` (a str), question-agnostic: the context
    is prefilled and compressed once, and each question decodes from that same compressed cache,
    as `generate` would answer it alone (chat template applied; each answer stops at the end of its
    turn). One `GenerationOutput` per question, `.text` set. `method`: a `Method`, a name or a spec;
    None: the default for this model (`kvmerge.defaults.default_method`); "full" keeps the whole cache.

    Token ids in the tokenizer's place, `answer_questions(model, context_ids, question_ids, method)`,
    run `answer_questions_ids`."""
    if _is_ids(tokenizer):  # answer_questions(model, context_ids, question_ids, method, ...)
        if method is not None:
            raise ParameterTypeError("answer_questions(model, context_ids, question_ids, method, ...) takes no fifth "
                                     "positional argument: pass max_new_tokens=... by name")
        return answer_questions_ids(model, tokenizer, context, questions, max_new_tokens, eos_token_id,
                                    progress=progress)
    if _is_compressed(context):
        ends = end_ids(tokenizer, chat_template) if eos_token_id is None else eos_token_id
        outs = []
        for q in [questions] if isinstance(questions, str) else questions:
            out = from_context(context, context.question_ids(q), max_new_tokens, ends, progress=progress)
            out.text = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
            outs.append(out)
        return outs
    with refusing():
        if isinstance(questions, str):
            questions = [questions]
        if not isinstance(context, str) or not all(isinstance(q, str) for q in questions):
            raise ParameterTypeError("answer_questions(model, tokenizer, context, questions, method) takes a context "
                                     f"str and a list of question strs, got {type(context).__name__} and "
                                     f"{', '.join(sorted({type(q).__name__ for q in questions}))} "
                                     "(for token ids: kvmerge.answer_questions_ids)")
        if not questions:
            raise InputError("no questions to answer")
        method = get_method(method) if isinstance(method, str) else method
        pairs = [split_prompt(tokenizer, context, q, chat_template) for q in questions]
        shared = _common_prefix([c for c, _ in pairs])
        question_rows = [(c + q)[len(shared):] for c, q in pairs]
    ends = end_ids(tokenizer, chat_template) if eos_token_id is None else eos_token_id
    outs = answer_questions_ids(model, shared, question_rows, method, max_new_tokens, ends, tokenizer, progress)
    for out in outs:
        out.text = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
    return outs


@torch.inference_mode()
def answer_questions_ids(model, context_ids: list[int], questions: list[list[int]], method: Method | str | None = None,
                         max_new_tokens: int = 32, eos_token_id=None, tokenizer=None,
                         progress=None) -> list[GenerationOutput]:
    """`answer_questions` from token ids: one context row, one row of ids per question; `.text` is
    decoded when `tokenizer` is given. `method` None: the default for this model, as in `generate_ids`."""
    with refusing():
        method, default = _resolve(model, method)
        if not isinstance(questions, (list, tuple)) or not questions:
            raise InputError("questions must be a non-empty list of token-id rows")
        for q in questions:
            _validate(model, [context_ids], [q], "agnostic", max_new_tokens, method)
        if default:
            _check_tokenizer(method, tokenizer)
        session = Session(model, 1, method, tokenizer)
    report = bars_for(progress)
    try:
        with watching(session, report, len(context_ids)):
            session.prefill([list(context_ids)])
        session.reserve(max(len(q) for q in questions) + max_new_tokens)
        stats = cache_stats(session, [context_ids], "agnostic")
        stats["context_tokens"] = stats["context_tokens"][0]
        snapshot = session.snapshot()
        outs = []
        for q in questions:
            session.restore(snapshot)
            logits = session.forward([list(q)], decoding=False)
            out = decode(session, logits, dict(stats), max_new_tokens, eos_token_id, progress=report)
            if tokenizer is not None and hasattr(tokenizer, "decode"):
                out.text = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
            outs.append(out)
        return outs
    finally:
        getattr(report, "close", lambda: None)()


def generate(model, tokenizer, context, question, method: Method | str | None = None, max_new_tokens: int = 32,
             protocol: str = "agnostic", chat_template: bool = True, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
             streamer=None, prefill_chunk: int | None = None, progress=None) -> GenerationOutput:
    """Answer `question` about `context` (strings, or equal-length lists run as one batch). Greedy by
    default; `temperature` > 0 samples (with `top_k`, `top_p`, `seed`). Each row stops at the end of
    its turn (the tokenizer's eos and, with a chat template, its end-of-turn token) or after the first
    of the `stop` strings (cut from the text); `streamer` gets a single row's tokens as they come (e.g.
    `transformers.TextStreamer(tokenizer)`); `prefill_chunk`, `progress`: see `generate_ids`.

    `method`: a `Method`, a name or a spec (`"snapkv:window=8"`); None compresses with the default for
    this model (`kvmerge.defaults.default_method`: learnedzip where the model has learned-scorer
    weights, else mixedmerge), at that method's default budget; "full" keeps the whole cache."""
    if _is_compressed(context):
        with refusing():
            if not isinstance(question, str):
                raise ParameterTypeError("a compressed context answers one question str at a time here "
                                         "(several: kvmerge.answer_questions)")
            sampling = Sampling(temperature, top_k, top_p, seed)
        out = from_context(context, context.question_ids(question), max_new_tokens, end_ids(tokenizer, chat_template),
                           sampling, streamer, _stopper(tokenizer, stop), progress)
        out.text = _cut(tokenizer.decode(out.tokens[0], skip_special_tokens=True), _stops(stop)).strip()
        return out
    with refusing():
        single = isinstance(context, str)
        if isinstance(context, torch.Tensor) or (not single and context and not isinstance(context[0], str)):
            raise ParameterTypeError("generate takes text (a str, or a list of str); token ids go to generate_ids")
        contexts = [context] if single else list(context)
        questions = [question] if isinstance(question, str) else list(question)
        if len(contexts) != len(questions):
            raise InputError(f"{len(contexts)} contexts but {len(questions)} questions")
        if isinstance(method, str):
            method = get_method(method)
        sampling = Sampling(temperature, top_k, top_p, seed)
        pairs = [split_prompt(tokenizer, c, q, chat_template) for c, q in zip(contexts, questions)]
    stop, stopped = _stops(stop), _stopper(tokenizer, stop)
    out = generate_ids(model, [p[0] for p in pairs], [p[1] for p in pairs], method, max_new_tokens, protocol,
                       eos_token_id=end_ids(tokenizer, chat_template), tokenizer=tokenizer, sampling=sampling,
                       streamer=streamer, stop=stopped, prefill_chunk=prefill_chunk, progress=progress)
    texts = [_cut(tokenizer.decode(t, skip_special_tokens=True), stop).strip() for t in out.tokens]
    out.text = texts[0] if single else texts
    if single:
        out.stats["context_tokens"] = out.stats["context_tokens"][0]
    return out


def _stops(stop) -> list[str]:
    return [x for x in ([stop] if isinstance(stop, str) else stop or []) if x]


def _stopper(tokenizer, stop):
    """`stop(row_tokens)` for the stop strings, or None."""
    stop = _stops(stop)
    return (lambda row: any(x in tokenizer.decode(row, skip_special_tokens=True) for x in stop)) if stop else None


def _is_compressed(x) -> bool:
    from .context import CompressedContext

    return isinstance(x, CompressedContext)


@torch.inference_mode()
def from_context(context, question_ids: list[int], max_new_tokens: int = 32, eos_token_id=None, sampling=None,
                 streamer=None, stop=None, progress=None) -> GenerationOutput:
    """Answer from a `CompressedContext` (see `kvmerge.context`): the question's ids fed after the
    compressed context, then decoded; the context is as it was for the next question."""
    with refusing():
        session = context.session
        _validate(session.model, [[0] * context.tokens], [list(question_ids)], "agnostic", max_new_tokens,
                  session.method)
    session = context.rewind()
    session.reserve(len(question_ids) + max_new_tokens)
    stats = {**cache_stats(session, [[0] * context.tokens], "agnostic"), **context.meta.get("timings", {}),
             "context_tokens": context.tokens}
    report = bars_for(progress)
    try:
        logits = session.forward([list(question_ids)], decoding=False)
        return decode(session, logits, stats, max_new_tokens, eos_token_id, sampling, streamer, stop, report)
    finally:
        getattr(report, "close", lambda: None)()


@torch.inference_mode()
def answer_contexts(model, tokenizer, contexts, questions, max_new_tokens: int = 32, eos_token_id=None,
                    progress=None) -> GenerationOutput:
    """One question (a str) per compressed context (`kvmerge.compress_context` or `load_context`),
    answered in one ragged batch; `.text` one str per row. The contexts come from one model and method."""
    from .context import batch

    with refusing():
        if isinstance(questions, str) or len(questions) != len(contexts) or not contexts:
            raise InputError(f"answer_contexts takes one question per context: {len(contexts)} contexts, "
                             f"{1 if isinstance(questions, str) else len(questions)} questions")
        if not all(_is_compressed(c) for c in contexts):
            raise ParameterTypeError("answer_contexts takes compressed contexts (kvmerge.compress_context, load_context)")
        rows = [c.question_ids(q) for c, q in zip(contexts, questions)]
        for c, q in zip(contexts, rows):
            _validate(model, [[0] * c.tokens], [q], "agnostic", max_new_tokens, c.session.method)
    session = batch(contexts)
    session.reserve(max(map(len, rows)) + max_new_tokens)
    stats = {**cache_stats(session, [[0] * c.tokens for c in contexts], "agnostic")}
    ends = end_ids(tokenizer, contexts[0].meta["chat_template"]) if eos_token_id is None else eos_token_id
    logits = session.forward(rows, decoding=False)
    out = decode(session, logits, stats, max_new_tokens, ends, progress=bars_for(progress))
    out.text = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in out.tokens]
    return out


def end_ids(tokenizer, chat_template: bool = True) -> list[int]:
    """The ids that end an answer: the tokenizer's eos and, when its chat template is used, the
    template's end-of-turn token (`<|im_end|>`, `<end_of_turn>`, ...) where the vocabulary has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]
    if chat_template and getattr(tokenizer, "chat_template", None):
        vocab = tokenizer.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN if t in vocab]
    return list(dict.fromkeys(ids))


def split_prompt(tokenizer, context: str, question: str, chat_template: bool = True):
    """Tokenize the whole prompt once; split it at the context/question boundary by char offsets."""
    if not isinstance(context, str) or not isinstance(question, str):
        raise ParameterTypeError(f"context and question must be strings, got {type(context).__name__} and "
                                 f"{type(question).__name__} (token ids go to generate_ids)")
    if not context.strip():
        raise InputError("empty context: nothing to compress")
    if tokenizer is None:
        raise InputError("text needs a tokenizer: pass the one load_model returned")
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


# -- the steps ---------------------------------------------------------------------------------
def _resolve(model, method) -> tuple[Method, bool]:
    """(the method to run, whether it is the default): None → `default_method(model)`, built; a name
    or spec → built; a `Method` as it is (`_validate` refuses anything else)."""
    if method is None:
        from .defaults import default_method

        return get_method(default_method(model)), True
    return (get_method(method) if isinstance(method, str) else method), False


def _check_tokenizer(method, tokenizer) -> None:
    """The default method may read sentence ends (mixedmerge): refused in one line without a tokenizer."""
    if method.needs.tokenizer and tokenizer is None:
        name = getattr(method, "preset", None) or method.name
        raise InputError(f"the default method for this model, {name}, needs the model's tokenizer (sentence ends, its "
                         f"chat template): pass tokenizer=tok, or a method (get_method('full') keeps the whole cache)")


def _as_rows(x, what: str) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        x = x.tolist() if x.dim() == 2 else [x.tolist()]
    if isinstance(x, str) or not isinstance(x, (list, tuple)):
        raise ParameterTypeError(f"{what} must be a list of token ids or a list of such lists, got "
                                 f"{type(x).__name__} (text goes to kvmerge.generate / answer_questions)")
    if not x:
        return [[]]
    return [list(r) for r in x] if isinstance(x[0], (list, tuple)) else [list(x)]


def _is_ids(x) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, (list, tuple)) and (not x or not isinstance(x[0], str)))


def _common_prefix(rows: list[list[int]]) -> list[int]:
    n = min(map(len, rows))
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return rows[0][:i]
    return rows[0][:n]


def _validate(model, context_ids, question_ids, protocol, max_new_tokens, method, prefill_chunk=None):
    """Checked rows → (contexts, questions, protected window); raises a `KVMergeError` on bad input,
    all before any forward pass: types, vocabulary, the method's parameters, the model's positions,
    the budget against the context, and what a chunked prefill refuses."""
    from .capabilities import refusals

    if not isinstance(method, Method):
        raise ParameterTypeError(f"method must be a kvmerge Method (see kvmerge.get_method), got "
                                 f"{type(method).__name__}")
    check_params(method)
    if protocol not in PROTOCOLS:
        raise InputError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    contexts, questions = _as_rows(context_ids, "context_ids"), _as_rows(question_ids, "question_ids")
    if len(contexts) != len(questions):
        raise InputError(f"{len(contexts)} contexts but {len(questions)} questions")
    if any(len(c) == 0 for c in contexts):
        raise InputError("empty context: nothing to compress")
    vocab = model.config.get_text_config(decoder=True).vocab_size
    bad = [t for r in contexts + questions for t in r if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise InputError(f"token id {bad[0]!r} is outside the model's vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    limit = max_positions(model)
    longest = max(len(c) + len(q) for c, q in zip(contexts, questions))
    if limit and longest + max_new_tokens > limit:
        raise ContextTooLongError(f"the prompt is {longest:,} tokens and up to {max_new_tokens} more are generated, "
                                  f"over the model's {limit:,} positions (max_position_embeddings): shorten the "
                                  f"context to at most {limit - max_new_tokens - (longest - max(map(len, contexts))):,}"
                                  " tokens or lower max_new_tokens")
    if prefill_chunk is not None:
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise InputError(f"prefill chunk must be a positive number of tokens, got {prefill_chunk!r}")
        if prefill_chunk < max(map(len, contexts)) and refusals(method, "chunked"):
            raise InputError(refusals(method, "chunked")[0])
    if protocol == "aware":
        window = max([method.window] + [len(q) for q in questions])
        contexts, questions = [c + q for c, q in zip(contexts, questions)], [[] for _ in questions]
    else:
        window = method.window
        if any(len(q) == 0 for q in questions):
            raise InputError("empty question: the agnostic protocol needs question tokens to decode from")
    for c in contexts:
        method.target(len(c), window)  # raises early on a budget the context cannot meet
    return contexts, questions, window


def cache_stats(session, contexts, protocol) -> dict:
    """Sizes after compression. A budget applies to the full-attention layers (`compressed_layers_*`);
    `cache_bytes` is the whole cache, `full_cache_bytes` what transformers' own cache would hold."""
    config, dtype, cache = session.model.config, cache_dtype(session), session.cache
    width, rows, picked = max(len(c) for c in contexts), len(contexts), cache.compressible
    name = getattr(session.method, "preset", None) or session.method.name  # a preset by its own name
    return {"method": name, "budget": session.method.budget, "protocol": protocol,
            "context_tokens": [len(c) for c in contexts], **session.timings,
            "cache_entries": cache.entries, "cache_bytes": cache.nbytes,
            "full_cache_bytes": rows * stock_cache_bytes(config, dtype, width),
            "compressed_layers_bytes": sum(cache.layers[i].nbytes for i in picked),
            "compressed_layers_full_bytes": rows * stock_cache_bytes(config, dtype, width, picked)}


def cache_dtype(session) -> torch.dtype:
    return session.cache.layers[0].keys.dtype


def _cut(text: str, stop: list[str]) -> str:
    """`text` up to the first stop string."""
    ends = [text.find(x) for x in stop if x in text]
    return text[:min(ends)] if ends else text


def decode(session, logits, stats, max_new_tokens, eos_token_id=None, sampling=None, streamer=None,
           stop=None, progress=None) -> GenerationOutput:
    """Generate from `logits` `(batch, vocab)` on the session's cache until each row ends (an id of
    `eos_token_id`, an int or ids, or `stop(row)`); `progress(phase, done, total)` per token."""
    t0 = session._clock()
    choose = (sampling or Sampling()).chooser()
    ends = torch.tensor([] if eos_token_id is None else
                        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), dtype=torch.long)
    done = torch.zeros(logits.shape[0], dtype=torch.bool)
    tokens: list[list[int]] = [[] for _ in range(logits.shape[0])]
    for step in range(max_new_tokens):
        nxt = choose(logits).cpu()
        for b in range(len(tokens)):
            if not done[b]:
                tokens[b].append(int(nxt[b]))
                done[b] |= stop is not None and stop(tokens[b])
        if streamer is not None:
            streamer.put(nxt)
        if progress is not None:
            progress("decode", step + 1, max_new_tokens)
        done |= torch.isin(nxt, ends)
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = session.forward([[int(t)] for t in nxt])
    if streamer is not None:
        streamer.end()
    stats.update(decode_seconds=session._clock() - t0, new_tokens=[len(t) for t in tokens],
                 final_cache_bytes=session.cache.nbytes, **session.method.stats)
    return GenerationOutput(tokens=tokens, stats=Stats(stats))
