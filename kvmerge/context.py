"""Compressed contexts as files: compress a context once (with any method, however costly), save it
with safetensors, and answer questions from it in any process.

    ctx = kvmerge.compress_context(model, tok, document, "zipguardmerge", budget=0.25)
    ctx.save("doc.kvz")
    ctx = kvmerge.load_context("doc.kvz", model, tok)         # another process, milliseconds
    kvmerge.generate(model, tok, ctx, "Who signed it?").text   # also answer_questions, model.generate

A file holds one context row: per layer its entries at their real lengths (a layer whose KV heads
keep different counts is stored head by head), a sliding layer's window and its positions, the
request's counters (the positions the next token continues from) and each layer's state; the
metadata holds the model's fingerprint, the tokenizer's hash, the context's token ids (or only their
hash), the method spec, the budget, whether the chat template framed the context, the dtype and the
format's version. Every question starts from the compressed context again.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .decoding import GenerationOutput, cache_stats, decode, from_context
from .graphs import check_cuda_graph
from .errors import InputError, KVMergeError, ParameterTypeError, one_line, refusing
from .context_file import (ContextFileError, OtherModelError, check_file, ids_hash, layer_in, layer_out, read, state_in,
                           state_out, write)
from .progress import bars_for
from .prompt import (check_context_text, check_model, check_questions, check_tokenizer, end_ids, split_prompt,
                     validate)
from .session import Session
from .spec import spec_of
from .sliding import SlidingLayer

PLACEHOLDER = "x"  # the context text a question's ids are cut after (they do not depend on it)


@dataclass
class CompressedContext:
    """One compressed context: the `session` holding it (a snapshot is restored before each
    question), the tokenizer, `meta` (what a file's metadata holds) and `context_ids` (None when only
    their hash was kept). `kept`: per compressed layer, `(kv_heads, slots)` the context position each
    entry is (−1: a merged entry, −2: an empty slot), when known (compressed here, or loaded from a file
    that kept its token ids)."""

    session: Session
    tokenizer: object
    meta: dict
    context_ids: list[int] | None
    kept: list[torch.Tensor] | None = None
    _snapshot: tuple = field(default=None, repr=False)

    def __post_init__(self):
        self._snapshot = self.session.snapshot()

    @property
    def model(self):
        return self.session.model

    @property
    def tokens(self) -> int:
        return int(self.meta["tokens"])

    def check_for(self, model, tokenizer) -> None:
        """Refuse (one line) answering with a model object other than the one holding this context, or a
        tokenizer of other ids than the one it was compressed with."""
        if model is not self.model:
            raise OtherModelError(f"this compressed context is held by another model object "
                                  f"({_name(self.meta.get('model_name'))}, fingerprint {self.meta['model']}): answer "
                                  "with the model it was compressed or loaded with, or load its file for this model "
                                  "(kvmerge.load_context)")
        check_tokenizer(tokenizer, "answering a compressed context")
        if tokenizer is not self.tokenizer and tokenizer_hash(tokenizer) != self.meta["tokenizer"]:
            raise OtherModelError(f"this compressed context was made with another tokenizer (hash "
                                  f"{self.meta['tokenizer']}, this one's {tokenizer_hash(tokenizer)}): answer with "
                                  "the model's own tokenizer")

    def question_ids(self, question: str) -> list[int]:
        """The ids that follow the context for `question` (the chat template's rest included)."""
        with refusing():
            check_questions([question])
        return split_prompt(self.tokenizer, PLACEHOLDER, question, self.meta["chat_template"])[1]

    def generate_ids(self, question_ids: list[int], max_new_tokens: int = 32, **kwargs):
        """Answer from token ids (`kvmerge.decoding.from_context`'s keywords)."""
        return from_context(self, question_ids, max_new_tokens, **kwargs)

    def rewind(self) -> Session:
        """The session, back at the compressed context."""
        self.session.restore(self._snapshot)
        return self.session

    def save(self, path) -> Path:
        """Write the file (safetensors with a checksum; written whole to a temporary name, then renamed)."""
        self.rewind()
        tensors = {}
        layers = [layer_out(layer, f"l{i}.", tensors) for i, layer in enumerate(self.session.cache.layers)]
        policy = self.session.method.needs.decode_policy  # else scratch is compression-time state only
        states = [state_out(state, f"s{i}.", tensors, policy) for i, state in enumerate(self.session.states)]
        for name in ("seen", "plain", "captured"):
            tensors[name] = getattr(self.session, name)
        if self.context_ids is not None:
            tensors["context_ids"] = torch.tensor(self.context_ids, dtype=torch.int64)
            for i, pos in enumerate(self.kept or []):
                tensors[f"kept.{i}"] = pos.to(torch.int32)
        with refusing():
            return write(path, tensors, {**self.meta, "layers": layers, "states": states})

    @property
    def nbytes(self) -> int:
        """The compressed context's bytes (keys, values, log-mass), sliding layers included."""
        return self.rewind().cache.nbytes

    def summary(self) -> str:
        """One line: tokens, method and budget, entries per compressed layer and head, bytes."""
        from .context_view import entries_line

        size = self.nbytes
        return (f"{self.tokens:,} tokens, {self.meta['method']} at budget {self.meta['budget']}: entries per "
                f"compressed layer and head {entries_line(self)}; {size / 2**20:.2f} MiB, "
                f"{size / self.meta['full_bytes']:.1%} of the full cache"
                + (" (sliding-window layers keep their window)" if self.session.cache.compressible !=
                   list(range(len(self.session.cache.layers))) else ""))

    __str__ = summary

    def __repr__(self) -> str:
        return f"CompressedContext({self.summary()})"


def batch(contexts: list[CompressedContext]) -> Session:
    """One session holding several compressed contexts of one model and method as the rows of a
    batch (each row keeps its own entries and positions; shorter rows get empty slots), for
    `kvmerge.answer_contexts`."""
    from .layer import stack_rows

    first = contexts[0]
    with refusing():
        if len({c.meta["model"] for c in contexts}) > 1 or len({c.meta["method"] for c in contexts}) > 1:
            raise InputError("contexts answered in one batch must come from one model and one method spec; got "
                             + ", ".join(sorted({f"{c.meta['method']} ({c.meta['model']})" for c in contexts})))
        if any(c.model is not first.model for c in contexts):
            raise InputError("contexts answered in one batch must be loaded for the same model object")
    session = Session(first.model, len(contexts), first.session.method, first.tokenizer)
    rows = [c.rewind() for c in contexts]
    for i, layer in enumerate(session.cache.layers):
        parts = [row.cache.layers[i].kv() for row in rows]
        layer.is_initialized, layer.device = True, parts[0].keys.device
        layer.replace(*stack_rows(parts), fit=True)
        layer.seen = max(row.cache.layers[i].seen for row in rows)
        if isinstance(layer, SlidingLayer):
            width = layer.keys.shape[2]
            layer.positions = torch.cat([torch.nn.functional.pad(row.cache.layers[i].positions, (0, width - p.slots),
                                                                 value=-(2 ** 40)) for row, p in zip(rows, parts)])
        elif not session.method.needs.decode_policy:
            layer.compact()
    for name in ("seen", "plain", "captured"):
        setattr(session, name, torch.cat([getattr(row, name) for row in rows]))
    for i, state in enumerate(session.states):
        targets = [row.states[i].targets for row in rows]
        state.targets = None if targets[0] is None else torch.cat(targets)
        state.compressed_at, state.scaling, state.extra = (getattr(rows[0].states[i], k)
                                                           for k in ("compressed_at", "scaling", "extra"))
    return session


@torch.inference_mode()
def answer_contexts(model, tokenizer, contexts, questions, max_new_tokens: int = 32, eos_token_id=None,
                    progress=None, cuda_graph: bool = False) -> GenerationOutput:
    """One question (a str) per compressed context (`kvmerge.compress_context` or `load_context`),
    answered in one ragged batch; `.text` one str per row. The contexts come from one model and method.
    `cuda_graph`: as in `kvmerge.generate_ids`."""
    with refusing():
        if not isinstance(contexts, (list, tuple)):
            raise ParameterTypeError(f"answer_contexts takes a list of compressed contexts and a list of questions, "
                                     f"one each, got {type(contexts).__name__} (one context: kvmerge.generate)")
        if isinstance(questions, str) or len(questions) != len(contexts) or not contexts:
            raise InputError(f"answer_contexts takes one question per context: {len(contexts)} contexts, "
                             f"{1 if isinstance(questions, str) else len(questions)} questions")
        if not all(isinstance(c, CompressedContext) for c in contexts):
            raise ParameterTypeError("answer_contexts takes compressed contexts (kvmerge.compress_context, load_context)")
        for c in contexts:
            c.check_for(model, tokenizer)
        rows = [c.question_ids(q) for c, q in zip(contexts, questions)]
        for c, q in zip(contexts, rows):
            validate(model, [[0] * c.tokens], [q], "agnostic", max_new_tokens, c.session.method)
        check_cuda_graph(cuda_graph, contexts[0].session.method, model)
    session = batch(contexts)
    session.reserve(max(map(len, rows)) + (0 if cuda_graph else max_new_tokens))
    stats = {**cache_stats(session, [[0] * c.tokens for c in contexts], "agnostic")}
    ends = end_ids(tokenizer, contexts[0].meta["chat_template"]) if eos_token_id is None else eos_token_id
    logits = session.forward(rows, decoding=False)
    out = decode(session, logits, stats, max_new_tokens, ends, progress=bars_for(progress), cuda_graph=cuda_graph)
    out.text = [tokenizer.decode(t, skip_special_tokens=True).strip() for t in out.tokens]
    return out



def tokenizer_hash(tokenizer) -> str:
    """What identifies a tokenizer's ids: its vocabulary and chat template (12 hex)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    text = json.dumps(sorted(vocab.items())) + str(getattr(tokenizer, "chat_template", None))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def weights_sample(model) -> list[float] | None:
    """Two values of every weight tensor of `model`, at fixed places (a third and two thirds in), as
    floats: what tells two checkpoints of one architecture apart (the fingerprint holds only shapes).
    None when the weights cannot be read here (offloaded to the meta device, say)."""
    params = list(model.parameters())
    if any(p.device.type == "meta" or p.numel() == 0 for p in params):
        return None
    with torch.no_grad():  # gathered on each device, then one copy to the CPU per device
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in params:
            at = torch.tensor([p.numel() // 3, 2 * p.numel() // 3], device=p.device)
            by_device.setdefault(p.device, []).append(p.detach().reshape(-1)[at].float())
        read = {device: torch.cat(picks).cpu() for device, picks in by_device.items()}
    offsets = {device: 0 for device in read}
    out = []
    for p in params:  # back in the parameters' order
        out += read[p.device][offsets[p.device]:offsets[p.device] + 2].tolist()
        offsets[p.device] += 2
    return out


def _precision(x: torch.Tensor) -> torch.dtype:
    """The coarsest of bfloat16, float16 and float32 that holds every value of `x` (float32) exactly."""
    for dtype in (torch.bfloat16, torch.float16):
        if torch.equal(x.to(dtype).float(), x):
            return dtype
    return torch.float32


def same_weights(stored: list[float], here: list[float] | None) -> bool:
    """Whether two `weights_sample`s come from one checkpoint: equal once both are rounded to the coarser
    of the dtypes the two runs held them in (a bfloat16 run's file loads into the same checkpoint in
    float32; a fine-tune moves most values across a rounding step). bfloat16 against float16: within
    one bfloat16 step (rounding twice)."""
    if here is None:
        return True  # nothing to compare here: the fingerprint and shapes stand alone
    a, b = torch.tensor(stored, dtype=torch.float32), torch.tensor(here, dtype=torch.float32)
    if a.shape != b.shape:
        return False
    held = {_precision(a), _precision(b)}
    dtype = next(d for d in (torch.bfloat16, torch.float16, torch.float32) if d in held)
    a, b = a.to(dtype).float(), b.to(dtype).float()
    if held == {torch.bfloat16, torch.float16}:
        return bool(torch.allclose(a, b, rtol=2 ** -7, atol=0))
    return torch.equal(a, b)


def compress_context(model, tokenizer, context, method=None, budget: float | int | None = None,
                     chat_template: bool = True, prefill_chunk: int | None = None, keep_ids: bool = True,
                     progress=None) -> CompressedContext:
    """Prefill and compress `context` (a str, framed as the start of a user turn by the chat template
    when the tokenizer has one, or token ids used as they are) with `method` (a name, spec or Method;
    None: the default for this model) at `budget`. `keep_ids=False` stores only the ids' hash."""
    from .cache import stock_cache_bytes
    from .context_view import Provenance
    from .defaults import default_method, resolve
    from .progress import watching
    from .scorer import fingerprint, model_label

    with refusing():
        call = "compress_context(model, tokenizer, context, ...)"
        check_model(model, call)
        check_tokenizer(tokenizer, call, model)
        if not isinstance(context, (str, list, tuple, torch.Tensor)) or (
                isinstance(context, (list, tuple)) and context and isinstance(context[0], str)):
            raise ParameterTypeError(f"{call} takes one context: a str, or its token ids (a list of ints); got "
                                     + ("a list of str (compress each on its own)"
                                        if isinstance(context, (list, tuple)) else type(context).__name__))
        if isinstance(context, str):
            check_context_text([context])
            ids = split_prompt(tokenizer, context, PLACEHOLDER, chat_template)[0]
            chat = bool(chat_template and getattr(tokenizer, "chat_template", None))
        else:
            ids = list(context.tolist() if isinstance(context, torch.Tensor) else context)
            chat = False
        if method is None or method == "default":
            method = default_method(model)
        spec = method if isinstance(method, str) else None
        method = resolve(model, method, budget)[0]
        spec = spec or spec_of(method)
        validate(model, [ids], [[0]], "agnostic", 1, method, prefill_chunk)
        session = Session(model, 1, method, tokenizer)
    positions = Provenance(session)
    report = bars_for(progress)
    try:
        with watching(session, report, len(ids)):
            session.prefill([ids], chunk=prefill_chunk)
    finally:
        getattr(report, "close", lambda: None)()
    dtype = session.cache.layers[0].keys.dtype
    meta = {"model": fingerprint(model.config), "model_name": model_label(model.config, ""),
            "tokenizer": tokenizer_hash(tokenizer), "ids_hash": ids_hash(ids), "tokens": len(ids),
            "method": spec, "budget": method.budget, "chat_template": chat,
            "dtype": str(dtype).removeprefix("torch."), "full_bytes": stock_cache_bytes(model.config, dtype, len(ids)),
            "timings": session.timings, "weights_sample": weights_sample(model)}
    return CompressedContext(session, tokenizer, meta, ids if keep_ids else None, positions.kept())


def load_context(path, model, tokenizer) -> CompressedContext:
    """A context saved by `CompressedContext.save`, for `model` and `tokenizer`: refused in one line
    (a `KVMergeError`) before any forward when the file is not one, is cut off, damaged (its checksum,
    shapes or ids) or of a newer format, or was made for another model or tokenizer; its tensors go to
    the model's device, converted to the model's dtype where that loses nothing."""
    from .cache import kv_shape
    from .methods import get_method
    from .scorer import fingerprint, fingerprints

    with refusing():
        if not isinstance(path, (str, os.PathLike)):
            raise ParameterTypeError(f"load_context(path, model, tokenizer) takes the file's path first, got "
                                     f"{type(path).__name__}")
        check_model(model, "load_context(path, model, tokenizer)")
        check_tokenizer(tokenizer, "load_context(path, model, tokenizer)", model)
        path = Path(path)
        tensors, meta = read(path, check_file(path))
        if meta["model"] not in fingerprints(model.config):
            here = getattr(model.config, "name_or_path", "") or "this model"
            raise OtherModelError(f"{path} was made for another model ({_name(meta.get('model_name'))}, fingerprint "
                                  f"{meta['model']}), not {_name(here)} (fingerprint {fingerprint(model.config)})")
        if isinstance(meta.get("weights_sample"), list) and not same_weights(meta["weights_sample"],
                                                                              weights_sample(model)):
            raise OtherModelError(f"{path} was made with another checkpoint of this architecture "
                                  f"({_name(meta.get('model_name'))}: the same shapes, other weights): load the "
                                  "model it was made with, or compress the context again with this one")
        if meta["tokenizer"] != tokenizer_hash(tokenizer):
            raise OtherModelError(f"{path} was made with another tokenizer (hash {meta['tokenizer']}, this one's "
                                  f"{tokenizer_hash(tokenizer)}): load the model's own tokenizer")
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        stored = getattr(torch, meta["dtype"])
        if stored != dtype and torch.finfo(dtype).bits <= torch.finfo(stored).bits:  # only widening is lossless
            raise ContextFileError(f"{path} holds {meta['dtype']} entries and the model runs in "
                                   f"{str(dtype).removeprefix('torch.')}, which would round them: load the model "
                                   f"with dtype=torch.{meta['dtype']}")
        try:
            method = get_method(meta["method"], budget=meta["budget"])
        except KVMergeError as e:
            raise ContextFileError(f"{path} names a method this kvmerge cannot build: {one_line(e)}") from None
        session = Session(model, 1, method, tokenizer)
        if (len(session.cache.layers), len(session.states)) != (len(meta["layers"]), len(meta["states"])):
            raise ContextFileError(f"{path} has {len(meta['layers'])} layers and {len(meta['states'])} layer states, "
                                   f"the model {len(session.cache.layers)} layers")
        tensors = {k: v.to(device, dtype) if v.is_floating_point() and k.rsplit(".", 1)[-1] in ("keys", "values")
                   else v.to(device) for k, v in tensors.items()}
        if stored != dtype:  # widened: the context now holds the model's dtype
            meta.update(dtype=str(dtype).removeprefix("torch."),
                        full_bytes=meta["full_bytes"] * torch.finfo(dtype).bits // torch.finfo(stored).bits)
        shape = kv_shape(model.config)
        try:
            for i, (layer, m) in enumerate(zip(session.cache.layers, meta.pop("layers"))):
                layer_in(layer, m, f"l{i}.", tensors, device, shape, path)
            for i, (state, m) in enumerate(zip(session.states, meta.pop("states"))):
                state_in(state, m, f"s{i}.", tensors)
            session.seen, session.plain, session.captured = (tensors[k].cpu() for k in ("seen", "plain", "captured"))
            ids = tensors["context_ids"].tolist() if "context_ids" in tensors else None
            kept = [tensors[f"kept.{i}"].long().cpu() for i in range(len(session.cache.compressible))] \
                if "kept.0" in tensors else None
        except (KeyError, IndexError, AttributeError, TypeError) as e:  # a file written before its checksum
            raise ContextFileError(f"{path} is damaged: its layers do not read back ({type(e).__name__}: "
                                   f"{one_line(e)})") from None
    return CompressedContext(session, tokenizer, meta, ids, kept)


def _name(path) -> str:
    """A model's name from its `name_or_path` (a converted cache folder's last part), or 'unnamed'."""
    return Path(str(path)).name if path else "unnamed"
