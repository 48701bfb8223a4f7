"""A request's whole flow, top to bottom: check the input, prefill the context, compress it, feed
the question, decode greedily.

Question-agnostic protocol (default): the context is compressed before the question is seen, then
the question is appended uncompressed. Question-aware: the question is part of the compressed
prompt, inside the protected recent window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cache import stock_cache_bytes
from .methods import Method, get_method
from .session import Session

PROTOCOLS = ("agnostic", "aware")


@dataclass
class GenerationOutput:
    """Generated token ids per row, their text (str for a single prompt), and run statistics."""

    tokens: list[list[int]]
    text: str | list[str] = ""
    stats: dict = field(default_factory=dict)


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
            raise ValueError(f"need temperature >= 0, top_k >= 0 and 0 < top_p <= 1, got {self}")

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
def generate_ids(model, context_ids, question_ids, method: Method | None = None, max_new_tokens: int = 32,
                 protocol: str = "agnostic", eos_token_id: int | None = None, tokenizer=None,
                 sampling: Sampling | None = None, streamer=None, stop=None,
                 prefill_chunk: int | None = None) -> GenerationOutput:
    """Generation from token ids (one row, or a list of rows run as one padded batch); greedy unless
    `sampling` says otherwise. `streamer` (a transformers streamer: `put`, `end`) receives each new
    token of a single row; `stop(row_tokens) -> bool` ends a row early. `prefill_chunk`: prefill and
    compress that many tokens at a time (bounded memory; see `Session.prefill`)."""
    method = method or get_method("full")
    contexts, questions, window = _validate(model, context_ids, question_ids, protocol, max_new_tokens, method)
    if streamer is not None and len(contexts) > 1:
        raise ValueError("a streamer takes a single row")
    session = Session(model, len(contexts), method, tokenizer)
    logits = session.prefill(contexts, window, prefill_chunk)
    session.reserve(max(len(q) for q in questions) + max_new_tokens)
    stats = cache_stats(session, contexts, protocol)
    if protocol == "agnostic":
        logits = session.forward(questions, decoding=False)
    return decode(session, logits, stats, max_new_tokens, eos_token_id, sampling, streamer, stop)


@torch.inference_mode()
def answer_questions(model, context_ids: list[int], questions: list[list[int]], method: Method,
                     max_new_tokens: int = 32, eos_token_id: int | None = None, tokenizer=None):
    """Several questions about one context (question-agnostic): the context is prefilled and
    compressed once, and each question decodes from that same compressed cache."""
    for q in questions:
        _validate(model, [context_ids], [q], "agnostic", max_new_tokens, method)
    session = Session(model, 1, method, tokenizer)
    session.prefill([list(context_ids)])
    session.reserve(max(len(q) for q in questions) + max_new_tokens)
    stats = cache_stats(session, [context_ids], "agnostic")
    snapshot = session.snapshot()
    outs = []
    for q in questions:
        session.restore(snapshot)
        logits = session.forward([list(q)], decoding=False)
        outs.append(decode(session, logits, dict(stats), max_new_tokens, eos_token_id))
    return outs


def generate(model, tokenizer, context, question, method: Method | str | None = None, max_new_tokens: int = 32,
             protocol: str = "agnostic", chat_template: bool = True, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
             streamer=None, prefill_chunk: int | None = None) -> GenerationOutput:
    """Answer `question` about `context` (strings, or equal-length lists run as one batch). Greedy by
    default; `temperature` > 0 samples (with `top_k`, `top_p`, `seed`). Each row stops at the end token
    or after the first of the `stop` strings (cut from the text); `streamer` gets a single row's tokens
    as they come (e.g. `transformers.TextStreamer(tokenizer)`); `prefill_chunk`: see `generate_ids`."""
    single = isinstance(context, str)
    contexts = [context] if single else list(context)
    questions = [question] if isinstance(question, str) else list(question)
    if len(contexts) != len(questions):
        raise ValueError(f"{len(contexts)} contexts but {len(questions)} questions")
    if isinstance(method, str):
        method = get_method(method)
    pairs = [split_prompt(tokenizer, c, q, chat_template) for c, q in zip(contexts, questions)]
    stop = [x for x in (stop or []) if x]
    stopped = (lambda row: any(x in tokenizer.decode(row, skip_special_tokens=True) for x in stop)) if stop else None
    out = generate_ids(model, [p[0] for p in pairs], [p[1] for p in pairs], method, max_new_tokens, protocol,
                       eos_token_id=tokenizer.eos_token_id, tokenizer=tokenizer,
                       sampling=Sampling(temperature, top_k, top_p, seed), streamer=streamer, stop=stopped,
                       prefill_chunk=prefill_chunk)
    texts = [_cut(tokenizer.decode(t, skip_special_tokens=True), stop).strip() for t in out.tokens]
    out.text = texts[0] if single else texts
    if single:
        out.stats["context_tokens"] = out.stats["context_tokens"][0]
    return out


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


# -- the steps ---------------------------------------------------------------------------------
def _as_rows(x, what: str) -> list[list[int]]:
    if isinstance(x, torch.Tensor):
        x = x.tolist() if x.dim() == 2 else [x.tolist()]
    if not isinstance(x, (list, tuple)):
        raise TypeError(f"{what} must be a list of token ids or a list of such lists")
    if not x:
        return [[]]
    return [list(r) for r in x] if isinstance(x[0], (list, tuple)) else [list(x)]


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


def cache_stats(session, contexts, protocol) -> dict:
    """Sizes after compression. A budget applies to the full-attention layers (`compressed_layers_*`);
    `cache_bytes` is the whole cache, `full_cache_bytes` what transformers' own cache would hold."""
    config, dtype, cache = session.model.config, cache_dtype(session), session.cache
    width, rows, picked = max(len(c) for c in contexts), len(contexts), cache.compressible
    return {"method": session.method.name, "budget": session.method.budget, "protocol": protocol,
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
           stop=None) -> GenerationOutput:
    """Generate from `logits` `(batch, vocab)` on the session's cache until each row ends."""
    t0 = time.perf_counter()
    choose = (sampling or Sampling()).chooser()
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
        if eos_token_id is not None:
            done |= nxt == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        logits = session.forward([[int(t)] for t in nxt])
    if streamer is not None:
        streamer.end()
    stats.update(decode_seconds=time.perf_counter() - t0, new_tokens=[len(t) for t in tokens],
                 final_cache_bytes=session.cache.nbytes, **session.method.stats)
    return GenerationOutput(tokens=tokens, stats=stats)
