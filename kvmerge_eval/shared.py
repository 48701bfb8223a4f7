"""One prefill, many compressions: a context is fed once with every query captured (and surprisal
when a method needs it), then each method compresses a copy of that cache in turn. Equal to running
each method on its own (tests/test_eval.py), and as many times faster as there are methods."""

from __future__ import annotations

import time

import torch

from kvmerge import Session, get_method


@torch.inference_mode()
def compressed_once(model, tok, rows: list[list[int]], configs: list[tuple[str, float]], min_window: int = 0,
                    chunk: int | None = None):
    """Yield `(spec, budget, session, logits)` for each `(spec, budget)`: the session holds `rows`
    compressed by that method (`session.timings`: the shared prefill, and this method's compression
    plus the surprisal pass if it uses it); `logits` are the prompts' last-token logits. The session
    is reused: consume each before asking for the next. Each method protects at least the last
    `min_window` tokens (the question, under the question-aware protocol). With `chunk` (chunked
    prefill, where compression happens between chunks) each method prefills on its own."""
    methods = [(spec, budget, get_method(spec, budget)) for spec, budget in configs]
    if chunk is not None:
        for spec, budget, method in methods:
            session = Session(model, len(rows), method, tok)
            logits = session.prefill(rows, max(method.window, min_window), chunk)
            yield spec, budget, session, logits
        return
    session = Session(model, len(rows))
    t0 = time.perf_counter()
    wants_surprisal = any(m.needs.surprisal for *_, m in methods)
    capture = -1 if any(m.needs.queries for *_, m in methods) else 0
    logits, surprisal, t1 = session.feed_prompt(rows, capture, wants_surprisal)
    surprisal_seconds = time.perf_counter() - t1
    prefilled = session.snapshot()
    for spec, budget, method in methods:
        session.restore(prefilled)
        session.use(method, tok)
        t2 = time.perf_counter()
        session.compress(rows, max(method.window, min_window), surprisal if method.needs.surprisal else None)
        extra = surprisal_seconds if method.needs.surprisal else 0.0
        session.timings = {"prefill_seconds": t1 - t0, "compress_seconds": time.perf_counter() - t2 + extra}
        yield spec, budget, session, logits
