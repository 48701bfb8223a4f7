"""Progress of one request, reported as `progress(phase, done, total)`.

Phases: "prefill" and "compress" share one count, the context tokens fed so far out of the longest
row (`done` moves per decoder layer, so a single long forward moves too; a chunked prefill
alternates the two), then "decode", one call per new token out of `max_new_tokens`. The library
reports nothing unless asked; `progress=True` shows tqdm bars on stderr for phases that run longer
than two seconds (`ProgressBars`).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager


class ProgressBars:
    """`progress(phase, done, total)` as tqdm bars on `file` (stderr): one for the prompt (prefill and
    compression), one for decoding (`decode=False`: none, e.g. when the answer streams to a terminal).
    A bar appears once its phase has run `delay` seconds; a ticker keeps the clock moving while a
    step reports nothing (a compression). `close()` ends both."""

    def __init__(self, delay: float = 2.0, decode: bool = True, file=None):
        self.delay, self.decode, self.file = delay, decode, file or sys.stderr
        self.bar, self.kind = None, None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker = None

    def __call__(self, phase: str, done: float, total: float | None) -> None:
        from tqdm import tqdm

        kind = "decode" if phase == "decode" else "prompt"
        label = phase if kind == "decode" else f"prompt ({phase})"  # the clock is the whole prompt's
        if kind == "decode" and not self.decode:
            self._close_bar()
            return
        with self._lock:
            if kind != self.kind:
                self._close_bar(locked=True)
                unit = "token" if kind == "decode" else "context token"
                self.bar = tqdm(total=total, desc=label, unit=unit, delay=self.delay, file=self.file, leave=True,
                                dynamic_ncols=True, mininterval=0.25)
                self.kind = kind
            if self.bar.desc != label:
                self.bar.set_description_str(label, refresh=False)
            self.bar.update(max(0, round(done) - self.bar.n))
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                if self.bar is not None:
                    self.bar.update(0)  # redraws the clock once past the delay

    def _close_bar(self, locked: bool = False) -> None:
        if not locked:
            with self._lock:
                return self._close_bar(locked=True)
        if self.bar is not None:
            self.bar.close()
        self.bar, self.kind = None, None

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self._close_bar()


def bars_for(progress):
    """None/False → None; True → `ProgressBars()`; a callable as it is."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return ProgressBars()
    if not callable(progress):
        raise TypeError(f"progress must be None, True or a function (phase, done, total), got {progress!r}")
    return progress


@contextmanager
def watching(session, report, total: int):
    """During `session.prefill`: report "prefill" per decoder layer of each prompt forward (its tokens
    spread over the layers) and "compress" while the session compresses (second passes included),
    out of `total` context tokens. Wraps the session's `feed_prompt` and `compress` (instance
    attributes, removed on exit) and hooks the decoder layers; nothing when `report` is None."""
    if report is None:
        yield
        return
    layers = list(session.model.get_decoder().layers)
    state = {"phase": None, "tokens": 0, "done": 0.0}

    def before(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        state["tokens"] = 0 if ids is None else ids.shape[-1]

    def after_layer(*_):
        if state["phase"] == "prefill":
            state["done"] = min(total, state["done"] + state["tokens"] / len(layers))
            report("prefill", state["done"], total)

    def phase(name, step):
        def run(*args, **kwargs):
            state["phase"] = name
            report(name, state["done"], total)
            try:
                return step(*args, **kwargs)
            finally:
                state["phase"] = None
        return run

    feed, compress = session.feed_prompt, session.compress
    session.feed_prompt, session.compress = phase("prefill", feed), phase("compress", compress)
    hooks = [session.model.register_forward_pre_hook(before, with_kwargs=True)]
    hooks += [layer.register_forward_hook(after_layer) for layer in layers]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        del session.feed_prompt, session.compress
