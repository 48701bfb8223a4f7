"""A request's whole flow, top to bottom: check the input, prefill the context, compress it, feed
the question, decode greedily.

Question-agnostic protocol (default): the context is compressed before the question is seen, then
the question is appended uncompressed. Question-aware: the question is part of the compressed
prompt, inside the protected recent window.
"""

from __future__ import annotations

import torch

from .context import CompressedContext
from .decoding import GenerationOutput, Sampling, cache_stats, cut_at_stop, decode, from_context, stop_strings, stopper
from .defaults import resolve
from .errors import InputError, ParameterTypeError, plural, refusing
from .graphs import check_cuda_graph
from .methods import Method
from .progress import bars_for, watching
from .prompt import (check_context_text, check_model, check_questions, check_tokenizer, common_prefix, end_ids, is_ids,
                     one_row, split_prompt, validate)
from .session import Session


@torch.inference_mode()
def generate_ids(model, context_ids, question_ids, method: Method | str | None = None, max_new_tokens: int = 32,
                 protocol: str = "agnostic", eos_token_id=None, tokenizer=None,
                 sampling: Sampling | None = None, streamer=None, stop=None,
                 prefill_chunk: int | None = None, progress=None,
                 budget: float | int | None = None, cuda_graph: bool = False) -> GenerationOutput:
    """Generation from token ids (one row, or a list of rows run as one padded batch); greedy unless
    `sampling` says otherwise. `streamer` (a transformers streamer: `put`, `end`) receives each new
    token of a single row; `stop(row_tokens) -> bool` ends a row early; `eos_token_id`: an id or ids
    that end a row. `prefill_chunk`: prefill and compress that many tokens at a time (bounded memory;
    see `Session.prefill`). `progress`: None (quiet), True (bars on stderr for steps over 2 s) or
    `progress(phase, done, total)`. `method`: None compresses with the default for this model
    (`kvmerge.defaults.default_method`: learnedzip where it has learned-scorer weights,
    `learnedzip:sliding=0.75` on models with sliding-window layers, else mixedmerge,
    which needs `tokenizer`); `get_method("full")` keeps the whole cache. `budget`: what the cache
    keeps, a fraction in (0, 1] or a whole number of entries, with a method name or None (a `Method`
    carries its own). `cuda_graph`: decode by replaying one captured CUDA graph (`kvmerge.GraphDecoder`;
    a model on one CUDA device, a method without a decode policy; each step reads every layer's slots
    plus room for `max_new_tokens`). Every check runs before the first forward pass. With a `tokenizer`
    that decodes, `.text` holds each row's text (a str for one row given flat)."""
    with refusing():
        check_model(model, "generate_ids(model, context_ids, question_ids, ...)")
        method, default = resolve(model, method, budget)
        contexts, questions, window = validate(model, context_ids, question_ids, protocol, max_new_tokens, method,
                                                prefill_chunk)
        lengths = {len(c) + (len(q) if protocol == "aware" else 0) for c, q in zip(contexts, questions)}
        if len(lengths) > 1 and (why := _one_length(method)):
            if not default:
                raise InputError(f"{method.label}: {why}, so it needs rows of one length, and these "
                                 f"have {len(lengths)} ({min(lengths):,}–{max(lengths):,} tokens): give it "
                                 "alloc=uniform (one count for every layer and head) or run the rows one at a time")
            method = resolve(model, None, method.budget, ragged=True)[0]
        if default:
            _check_tokenizer(method, tokenizer)
        if streamer is not None and len(contexts) > 1:
            raise InputError("a streamer takes a single row")
        check_cuda_graph(cuda_graph, method, model)
        session = Session(model, len(contexts), method, tokenizer)
    report = bars_for(progress)
    try:
        with watching(session, report, max(map(len, contexts))):
            logits = session.prefill(contexts, window, prefill_chunk)
        session.reserve(max(len(q) for q in questions) + (0 if cuda_graph else max_new_tokens))  # a graph: its own
        stats = cache_stats(session, contexts, protocol, prefill_chunk)
        if protocol == "agnostic":
            logits = session.forward(questions, decoding=False)
        out = decode(session, logits, stats, max_new_tokens, eos_token_id, sampling, streamer, stop, report,
                     cuda_graph)
    finally:
        getattr(report, "close", lambda: None)()
    if hasattr(tokenizer, "decode"):  # the text of each row (a str for one row given flat)
        texts = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in out.tokens]
        out.text = texts[0] if one_row(context_ids) else texts
    return out


def answer_questions(model, tokenizer, context, questions, method: Method | str | None = None,
                     max_new_tokens: int = 32, chat_template: bool = True, eos_token_id=None,
                     progress=None, budget: float | int | None = None,
                     prefill_chunk: int | None = None, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int | None = None,
                     stop: list[str] | None = None, cuda_graph: bool = False) -> list[GenerationOutput]:
    """Several questions (a list of str) about one `context` (a str), question-agnostic: the context
    is prefilled and compressed once, and each question decodes from that same compressed cache,
    as `generate` would answer it alone (chat template applied; each answer stops at the end of its
    turn). One `GenerationOutput` per question, `.text` set. `method`: a `Method`, a name or a spec;
    None: the default for this model (`kvmerge.defaults.default_method`); "full" keeps the whole cache;
    `budget`, `prefill_chunk` and `cuda_graph` as in `generate_ids`; `temperature`, `top_k`, `top_p`, `seed`
    and `stop` as in `generate`, for each question alike (a seed draws each answer as `generate` would alone).

    Token ids in the tokenizer's place, `answer_questions(model, context_ids, question_ids, method)`,
    run `answer_questions_ids`."""
    with refusing():
        sampling, stop = Sampling(temperature, top_k, top_p, seed), stop_strings(stop)
    if is_ids(tokenizer):  # answer_questions(model, context_ids, question_ids, method, ...)
        if method is not None:
            raise ParameterTypeError("answer_questions(model, context_ids, question_ids, method, ...) takes no fifth "
                                     "positional argument: pass max_new_tokens=... by name")
        if stop:
            raise InputError("stop strings need the tokenizer to read the text: answer_questions(model, tokenizer, "
                             "context, questions, ...)")
        return answer_questions_ids(model, tokenizer, context, questions, max_new_tokens, eos_token_id,
                                    progress=progress, budget=budget, prefill_chunk=prefill_chunk, sampling=sampling,
                                    cuda_graph=cuda_graph)
    if isinstance(context, CompressedContext):
        with refusing():
            _compressed_already(context, model, tokenizer, method, budget, prefill_chunk, chat_template=chat_template)
        ends = end_ids(tokenizer, chat_template) if eos_token_id is None else eos_token_id
        outs = []
        for q in [questions] if isinstance(questions, str) else questions:
            out = from_context(context, context.question_ids(q), max_new_tokens, ends, sampling,
                               stop=stopper(tokenizer, stop), progress=progress, cuda_graph=cuda_graph)
            out.text = cut_at_stop(tokenizer.decode(out.tokens[0], skip_special_tokens=True), stop).strip()
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
        call = "answer_questions(model, tokenizer, context, questions, ...)"
        check_model(model, call)
        check_questions(questions)
        check_context_text([context])
        method = resolve(model, method, budget)[0] if budget is not None or isinstance(method, str) else method
        check_tokenizer(tokenizer, call, model)
        pairs = [split_prompt(tokenizer, context, q, chat_template) for q in questions]
        shared = common_prefix([c for c, _ in pairs])
        question_rows = [(c + q)[len(shared):] for c, q in pairs]
    ends = end_ids(tokenizer, chat_template) if eos_token_id is None else eos_token_id
    outs = answer_questions_ids(model, shared, question_rows, method, max_new_tokens, ends, tokenizer, progress,
                                prefill_chunk=prefill_chunk, sampling=sampling, stop=stopper(tokenizer, stop),
                                cuda_graph=cuda_graph)
    for out in outs:
        out.text = cut_at_stop(tokenizer.decode(out.tokens[0], skip_special_tokens=True), stop).strip()
    return outs


@torch.inference_mode()
def answer_questions_ids(model, context_ids: list[int], questions: list[list[int]], method: Method | str | None = None,
                         max_new_tokens: int = 32, eos_token_id=None, tokenizer=None,
                         progress=None, budget: float | int | None = None,
                         prefill_chunk: int | None = None, sampling: Sampling | None = None,
                         stop=None, cuda_graph: bool = False) -> list[GenerationOutput]:
    """`answer_questions` from token ids: one context row, one row of ids per question; `.text` is
    decoded when `tokenizer` is given. `method` None: the default for this model; it, `budget`,
    `prefill_chunk`, `sampling`, `stop` and `cuda_graph` as in `generate_ids` (for each question alike)."""
    with refusing():
        check_model(model, "answer_questions_ids(model, context_ids, question_ids, ...)")
        method, default = resolve(model, method, budget)
        if not isinstance(questions, (list, tuple)) or not questions:
            raise InputError("questions must be a non-empty list of token-id rows")
        for q in questions:
            validate(model, [context_ids], [q], "agnostic", max_new_tokens, method, prefill_chunk)
        if default:
            _check_tokenizer(method, tokenizer)
        check_cuda_graph(cuda_graph, method, model)
        session = Session(model, 1, method, tokenizer)
    report = bars_for(progress)
    try:
        with watching(session, report, len(context_ids)):
            session.prefill([list(context_ids)], chunk=prefill_chunk)
        session.reserve(max(len(q) for q in questions) + (0 if cuda_graph else max_new_tokens))
        stats = cache_stats(session, [context_ids], "agnostic", prefill_chunk)
        stats["context_tokens"] = stats["context_tokens"][0]
        snapshot = session.snapshot()
        outs = []
        for q in questions:
            session.restore(snapshot)
            logits = session.forward([list(q)], decoding=False)
            out = decode(session, logits, dict(stats), max_new_tokens, eos_token_id, sampling, stop=stop, progress=report,
                         cuda_graph=cuda_graph)
            if tokenizer is not None and hasattr(tokenizer, "decode"):
                out.text = tokenizer.decode(out.tokens[0], skip_special_tokens=True).strip()
            outs.append(out)
        return outs
    finally:
        getattr(report, "close", lambda: None)()


def generate(model, tokenizer, context, question, method: Method | str | None = None, max_new_tokens: int = 32,
             protocol: str = "agnostic", chat_template: bool = True, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
             streamer=None, prefill_chunk: int | None = None, progress=None,
             budget: float | int | None = None, cuda_graph: bool = False) -> GenerationOutput:
    """Answer `question` about `context` (strings, or equal-length lists run as one batch). Greedy by
    default; `temperature` > 0 samples (with `top_k`, `top_p`, `seed`). Each row stops at the end of
    its turn (the tokenizer's eos and, with a chat template, its end-of-turn token) or after the first
    of the `stop` strings (cut from the text); `streamer` gets a single row's tokens as they come (e.g.
    `transformers.TextStreamer(tokenizer)`); `prefill_chunk`, `progress`, `cuda_graph`: see `generate_ids`.

    `method`: a `Method`, a name or a spec (`"snapkv:window=8"`); None compresses with the default for
    this model (`kvmerge.defaults.default_method`: learnedzip where the model has learned-scorer
    weights, else mixedmerge); "full" keeps the whole cache. `budget`: what the cache keeps, a fraction
    in (0, 1] or a whole number of entries (default: the method's, 0.25)."""
    if isinstance(context, CompressedContext):
        with refusing():
            _compressed_already(context, model, tokenizer, method, budget, prefill_chunk, protocol, chat_template)
            if not isinstance(question, str):
                raise ParameterTypeError("a compressed context answers one question str at a time here "
                                         "(several: kvmerge.answer_questions)")
            sampling, stop = Sampling(temperature, top_k, top_p, seed), stop_strings(stop)
        out = from_context(context, context.question_ids(question), max_new_tokens, end_ids(tokenizer, chat_template),
                           sampling, streamer, stopper(tokenizer, stop), progress, cuda_graph)
        out.text = cut_at_stop(tokenizer.decode(out.tokens[0], skip_special_tokens=True), stop).strip()
        return out
    with refusing():
        single = isinstance(context, str)
        if isinstance(context, torch.Tensor) or (isinstance(context, (list, tuple)) and context
                                                 and not isinstance(context[0], str)):
            raise ParameterTypeError("generate takes text (a str, or a list of str); token ids go to generate_ids")
        if not single and not isinstance(context, (list, tuple)):
            raise ParameterTypeError(f"generate takes the context as text (a str, or a list of str), got "
                                     f"{type(context).__name__}")
        if not isinstance(question, (str, list, tuple)):
            raise ParameterTypeError(f"generate takes the question as a str (or a list of str, one per context), got "
                                     f"{type(question).__name__}")
        contexts = [context] if single else list(context)
        questions = [question] if isinstance(question, str) else list(question)
        if any(not isinstance(q, str) for q in questions):
            raise ParameterTypeError("generate takes the question as text (a str, or a list of str, one per context); "
                                     "token ids go to generate_ids")
        if len(contexts) != len(questions):
            hint = " (several questions about one context: kvmerge.answer_questions)" if single else ""
            raise InputError(f"{plural(len(contexts), 'context')} but {plural(len(questions), 'question')}{hint}")
        call = "generate(model, tokenizer, context, question, ...)"
        check_model(model, call)
        check_tokenizer(tokenizer, call, model)
        check_questions(questions)
        check_context_text(contexts)
        if method == "default":
            method = None
        if method is not None and (isinstance(method, str) or budget is not None):
            method, budget = resolve(model, method, budget)[0], None  # the default resolves with the rows' lengths
        sampling, stop = Sampling(temperature, top_k, top_p, seed), stop_strings(stop)
        pairs = [split_prompt(tokenizer, c, q, chat_template) for c, q in zip(contexts, questions)]
    stopped = stopper(tokenizer, stop)
    out = generate_ids(model, [p[0] for p in pairs], [p[1] for p in pairs], method, max_new_tokens, protocol,
                       eos_token_id=end_ids(tokenizer, chat_template), tokenizer=tokenizer, sampling=sampling,
                       streamer=streamer, stop=stopped, prefill_chunk=prefill_chunk, progress=progress, budget=budget,
                       cuda_graph=cuda_graph)
    texts = [cut_at_stop(tokenizer.decode(t, skip_special_tokens=True), stop).strip() for t in out.tokens]
    out.text = texts[0] if single else texts
    if single:
        out.stats["context_tokens"] = out.stats["context_tokens"][0]
    return out


# -- the steps ---------------------------------------------------------------------------------
def _one_length(method) -> str | None:
    """Why `method` needs the rows it compresses at once to be of one length, or None."""
    from .allocation import is_global

    if is_global(method):
        return f"alloc={method.alloc!r} ranks every layer and head of the batch at once"
    if getattr(method, "sliding", None) is not None:
        return f"sliding={method.sliding} moves one count of slots from the sliding layers to the others"
    return None


def _compressed_already(context, model, tokenizer, method, budget, prefill_chunk, protocol="agnostic",
                        chat_template=True) -> None:
    """A compressed context was compressed with its own method and budget, before any question, framed
    by the chat template or not, by one model and tokenizer: refuse options that would compress it again
    or frame it otherwise, and another model or tokenizer."""
    context.check_for(model, tokenizer)
    given = [name for name, v in (("method", method), ("budget", budget), ("prefill_chunk", prefill_chunk))
             if v is not None]
    if given:
        raise InputError(f"a compressed context is answered as it was compressed: {', '.join(given)} goes to "
                         "compress_context")
    if protocol != "agnostic":
        raise InputError(f"a compressed context was compressed before any question (protocol 'agnostic'), got "
                         f"protocol={protocol!r}: to compress the question with it, pass the context's text")
    if not isinstance(chat_template, bool):
        raise ParameterTypeError(f"chat_template must be True or False, got {chat_template!r}")
    if context.meta["chat_template"] and not chat_template:
        raise InputError("this compressed context was framed by the chat template, so its questions are too: leave "
                         "chat_template=True (or compress the context with chat_template=False)")
    if not context.meta["chat_template"] and chat_template and getattr(tokenizer, "chat_template", None):
        raise InputError("this compressed context was not framed by the chat template (compressed from token ids, or "
                         "with chat_template=False), so its questions are not either: pass chat_template=False to "
                         "append the question as it is, or compress the context's text")


def _check_tokenizer(method, tokenizer) -> None:
    """The default method may read sentence ends (mixedmerge): refused in one line without a tokenizer."""
    if method.needs.tokenizer and tokenizer is None:
        name = method.label
        raise InputError(f"the default method for this model, {name}, needs the model's tokenizer (sentence ends, its "
                         f"chat template): pass tokenizer=tok, or a method (get_method('full') keeps the whole cache)")


