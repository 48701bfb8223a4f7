"""Decoding on a prepared session: the next token chosen (`Sampling`), stop ids and strings, and
the run's statistics; `from_context` answers a question from a compressed context (`kvmerge.context`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import stock_cache_bytes
from .errors import InputError, check_sampling, refusing
from .graphs import GraphDecoder, check_cuda_graph
from .progress import bars_for
from .prompt import validate
from .stats import Stats


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
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)

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


def stop_strings(stop) -> list[str]:
    """The stop strings, `stop` a str or a list of them; an empty one is refused (it would match at once)."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(x, str) and x for x in stop):
        raise InputError(f"stop strings must be non-empty strs, got {stop!r}")
    return stop


def stopper(tokenizer, stop):
    """`stop(row_tokens)` for the stop strings, or None."""
    stop = stop_strings(stop)
    return (lambda row: any(x in tokenizer.decode(row, skip_special_tokens=True) for x in stop)) if stop else None


@torch.inference_mode()
def from_context(context, question_ids: list[int], max_new_tokens: int = 32, eos_token_id=None, sampling=None,
                 streamer=None, stop=None, progress=None, cuda_graph: bool = False) -> GenerationOutput:
    """Answer from a `CompressedContext` (see `kvmerge.context`): the question's ids fed after the
    compressed context, then decoded (`cuda_graph`: by replaying one captured CUDA graph); the context
    is as it was for the next question."""
    with refusing():
        session = context.session
        validate(session.model, [[0] * context.tokens], [list(question_ids)], "agnostic", max_new_tokens,
                  session.method)
        check_cuda_graph(cuda_graph, session.method, session.model)
    session = context.rewind()
    session.reserve(len(question_ids) + (0 if cuda_graph else max_new_tokens))
    stats = {**cache_stats(session, [[0] * context.tokens], "agnostic"), "context_tokens": context.tokens,
             "compressed_before": dict(context.meta.get("timings", {}))}  # this run neither prefills nor compresses
    for phase in ("prefill_seconds", "compress_seconds"):
        stats.pop(phase, None)
    report = bars_for(progress)
    try:
        logits = session.forward([list(question_ids)], decoding=False)
        return decode(session, logits, stats, max_new_tokens, eos_token_id, sampling, streamer, stop, report,
                      cuda_graph)
    finally:
        getattr(report, "close", lambda: None)()


def cache_stats(session, contexts, protocol, prefill_chunk: int | None = None) -> dict:
    """Sizes after compression. A budget applies to the full-attention layers (`compressed_layers_*`);
    `cache_bytes` is the whole cache, `full_cache_bytes` what transformers' own cache would hold;
    `prefill_chunk` where the prefill ran in chunks."""
    config, dtype, cache = session.model.config, cache_dtype(session), session.cache
    width, rows, picked = max(len(c) for c in contexts), len(contexts), cache.compressible
    return {"method": session.method.described, "budget": session.method.budget, "protocol": protocol,
            "context_tokens": [len(c) for c in contexts], **session.timings,
            "cache_entries": cache.entries, "cache_bytes": cache.nbytes,
            "full_cache_bytes": rows * stock_cache_bytes(config, dtype, width),
            "compressed_layers_bytes": sum(cache.layers[i].nbytes for i in picked),
            "compressed_layers_full_bytes": rows * stock_cache_bytes(config, dtype, width, picked),
            **({"prefill_chunk": prefill_chunk} if prefill_chunk else {})}


def cache_dtype(session) -> torch.dtype:
    return session.cache.layers[0].keys.dtype


def cut_at_stop(text: str, stop: list[str]) -> str:
    """`text` up to the first stop string."""
    ends = [text.find(x) for x in stop if x in text]
    return text[:min(ends)] if ends else text


def decode(session, logits, stats, max_new_tokens, eos_token_id=None, sampling=None, streamer=None,
           stop=None, progress=None, cuda_graph: bool = False) -> GenerationOutput:
    """Generate from `logits` `(batch, vocab)` on the session's cache until each row ends (an id of
    `eos_token_id`, an int or ids, or `stop(row)`); `progress(phase, done, total)` per token;
    `cuda_graph`: the steps replay one captured CUDA graph (`kvmerge.graphs.GraphDecoder`)."""
    t0 = session._clock()
    decoder = GraphDecoder(session, max_new_tokens - 1, graph=True) if cuda_graph and max_new_tokens > 1 else None
    if decoder is not None:
        stats["graph_capture_seconds"] = session._clock() - t0
    t0 = session._clock()
    try:
        tokens = _tokens(logits, max_new_tokens, eos_token_id, sampling, streamer, stop, progress,
                         session.forward if decoder is None else lambda rows: decoder.step([r[0] for r in rows]))
    finally:
        if decoder is not None:
            decoder.close()
    stats.update(decode_seconds=session._clock() - t0, new_tokens=[len(t) for t in tokens],
                 final_cache_bytes=session.cache.nbytes, **session.method.stats)
    return GenerationOutput(tokens=tokens, stats=Stats(stats))


def _tokens(logits, max_new_tokens, eos_token_id, sampling, streamer, stop, progress, forward) -> list[list[int]]:
    """Each row's new tokens, chosen from `logits` and then from `forward(rows)`'s, one token a step."""
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
        logits = forward([[int(t)] for t in nxt])
    if streamer is not None:
        streamer.end()
    return tokens

