"""KVzip (Kim et al. 2025, arXiv 2505.23416): keep what the model needs to repeat the context."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import CarriedScores, Needs, ScoringMethod
from .registry import register


@register
@dataclass
class KVzip(CarriedScores, ScoringMethod):
    """After the prefill the model is asked to repeat the context, teacher-forced, `chunk` tokens at a
    time ("Repeat the previous context exactly." + end of the user turn + the chunk; later chunks
    "Repeat the part of the previous context exactly, starting with" + the previous chunk's last
    `postfix` tokens). An entry's score is the highest attention any query head of its KV group gives
    it at any reconstruction position, the softmax running over the first `sinks` entries, the chunk
    and the reconstruction's own keys (causal). The reconstruction's KV is discarded. Costs about a
    second prefill. Budget: the paper's global selection across layers and heads by default
    (`alloc="head"`: each head at its own length, one row or rows of one length, one-shot or chunked);
    `alloc="uniform"` keeps the same count in every layer and head (also for ragged batches),
    `alloc="layer"` the global ranking evened out per layer (see `ScoringMethod`). Chunked prefill:
    each fresh chunk is reconstructed when it arrives; kept entries keep their scores.

    `plus=True` is KVzip+ (kvpress's `kvzip_plus_normalization`): each probability is divided by the
    norm of the reconstruction position's attention input (the layer's normalised hidden state) and
    multiplied by the norm of the entry's value through its query head's output projection,
    ‖W_O,head · v‖, before the max."""

    alloc: str = "head"
    chunk: int = 2048
    postfix: int = 8
    plus: bool = False
    name = "kvzip"
    requires = Needs(tokenizer=True, second_pass=True)
    FIRST: ClassVar[str] = "\n\nRepeat the previous context exactly."
    LATER: ClassVar[str] = "\n\nRepeat the part of the previous context exactly, starting with"

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1 or self.postfix < 0:
            raise ValueError(f"kvzip needs chunk >= 1 and postfix >= 0, got chunk={self.chunk}, postfix={self.postfix}")

    def setup(self, runtime):
        tokenizer = runtime.tokenizer
        if tokenizer is None or not callable(tokenizer):
            raise ValueError("kvzip needs the tokenizer to write its reconstruction prompt: use kvmerge.generate, "
                             "or pass tokenizer= to generate_ids")
        def encode(text):
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        self._first, self._later, self._turn_end = encode(self.FIRST), encode(self.LATER), encode(_turn_end(tokenizer))

    def reconstruction(self, context: list[int], start: int) -> list[int]:
        """The ids fed to reconstruct `context[start:start + chunk]`."""
        prompt = self._first if start == 0 else self._later + context[max(start - self.postfix, 0):start]
        return prompt + self._turn_end + context[start:start + self.chunk]

    def prepare(self, runtime, token_rows, layers):
        if token_rows is None:
            raise ValueError("kvzip needs the prompt's token ids to reconstruct it")
        key = ("kvzip", self.chunk, self.postfix, self.sinks, self.plus)  # one pass serves every budget and variant
        if key not in runtime.memo:
            runtime.memo[key] = self._reconstruct(runtime, token_rows, layers)
        for i in layers:
            runtime.scratch(i)["_kvzip_fresh"] = runtime.memo[key][i]

    def _reconstruct(self, runtime, token_rows, layers) -> dict:
        """Layer index → each row's fresh slots' scores `(h, fresh)`."""
        fresh = [context[len(context) - min(int(p), len(context)):] for context, p in zip(token_rows, runtime.plain)]
        scaling = runtime.scaling
        found = {i: [[] for _ in fresh] for i in layers}  # layer → row → chunks' scores (h, c)
        plus = _PlusNorms(runtime, layers) if self.plus else None

        for start in range(0, max(len(f) for f in fresh), self.chunk):
            rows = [self.reconstruction(f, start) if start < len(f) else [] for f in fresh]

            def listen(i, query, layer, start=start, rows=rows):
                live = _live_slots(layer, layer.entries - query.shape[2])  # the slots before the probe
                for b, ids in enumerate(rows):
                    if not ids:
                        continue
                    q = len(ids)
                    slots = live[b][len(live[b]) - len(fresh[b]):][start:start + self.chunk]
                    sinks = live[b][:min(self.sinks, len(live[b]) - len(fresh[b]) + start)]
                    own = torch.arange(layer.entries - q, layer.entries, device=slots.device)
                    picked = torch.cat([sinks, slots, own])
                    log_n = None if layer.log_n is None else layer.log_n[b][:, picked]
                    rows_cols = (None, None) if plus is None else plus.scales(i, b, q, layer.values[b][:, picked])
                    found[i][b].append(reconstruction_attention(
                        query[b, :, query.shape[2] - q:], layer.keys[b][:, picked], log_n, len(sinks),
                        scaling, *rows_cols))

            with plus or nullcontext():
                runtime.probe(rows, listen)
        return {i: [torch.cat(chunks, -1) if chunks else None for chunks in found[i]] for i in layers}

    def fresh_scores(self, keys, values, ctx):
        fresh = ctx.state.scratch.get("_kvzip_fresh") if ctx.state is not None else None
        if fresh is None:
            raise ValueError("kvzip scores come from its reconstruction pass: compress through a Session")
        f = min(fresh[int(b)].shape[-1] for b in ctx.rows)
        return torch.stack([fresh[int(b)][:, -f:] for b in ctx.rows]).to(keys.device)


class _PlusNorms:
    """KVzip+'s scales: while active, the runtime records the norm of each layer's attention input per
    position; `scales` gives (1 / those norms for a row's last q positions `(q,)`, ‖W_O,j v‖ `(hq, k)`
    for values `(h, k, d)`), the latter through each head's Gram matrix W_O,j W_O,jᵀ `(d, d)`."""

    def __init__(self, runtime, layers):
        self.runtime, self.layers, self._gram, self._active = runtime, layers, {}, None

    def __enter__(self):
        self._active = self.runtime.input_norms(self.layers)
        self.norms = self._active.__enter__()
        return self

    def __exit__(self, *exc):
        self._active.__exit__(*exc)

    def scales(self, i: int, b: int, q: int, values: torch.Tensor):
        if i not in self._gram:
            w = self.runtime.output_weight(i).float().T  # (hq·d, hidden)
            per_head = w.reshape(-1, values.shape[-1], w.shape[1])  # (hq, d, hidden)
            self._gram[i] = per_head @ per_head.transpose(1, 2)  # (hq, d, d)
        gram = self._gram[i]
        g = gram.shape[0] // values.shape[0]
        v = values.float().repeat_interleave(g, 0)  # (hq, k, d)
        column = ((v @ gram) * v).sum(-1).clamp_min(0).sqrt()
        return 1.0 / self.norms[i][b, -q:], column


def _live_slots(layer, entries: int) -> list[torch.Tensor]:
    """Each row's slots (among the first `entries`) that are not empty in every head."""
    if layer.log_n is None:
        return [torch.arange(entries, device=layer.keys.device)] * layer.keys.shape[0]
    live = ~torch.isinf(layer.log_n[:, :, :entries]).all(1)
    return [row.nonzero().squeeze(1) for row in live]


def _turn_end(tokenizer) -> str:
    """What closes the user's turn and opens the assistant's in the tokenizer's chat template
    ("\\n" without one): the reconstruction is the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    marker = "\u2063kvzip\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    return text.split(marker, 1)[1]


def reconstruction_attention(queries, keys, log_n, sinks: int, scaling: float, row_scale=None, column_scale=None,
                             block: int = 128):
    """KVzip's score for one row's context chunk: queries `(hq, q, d)` of the reconstruction, keys
    `(h, k, d)` and log_n `(h, k)` (or None) laid out [sinks; chunk; the q reconstruction tokens' own]
    → `(h, k - sinks - q)`: for each chunk key, the highest attention probability any query head of
    its group gives it at any reconstruction position, the softmax over all k keys (causal among the
    reconstruction's own). KVzip+: each probability times `row_scale` `(q,)` of its position and
    `column_scale` `(hq, k)` of its query head and key before the max.

    Computed in log space, `block` queries at a time: max exp(x − lse) = exp(max(x − lse)), so no
    probability matrix is formed, and a block's logits stay in cache."""
    hq, q, _d = queries.shape
    h, k, _ = keys.shape
    g, chunk = hq // h, k - sinks - q
    causal = torch.full((q, q), float("-inf"), device=keys.device).triu(1)
    log_row = None if row_scale is None else row_scale.float().log()[None, :, None]
    best = torch.full((h, chunk), float("-inf"), device=keys.device)
    for j in range(h):  # one KV head at a time: (g, block, k) logits
        keys_t = keys[j].float().T * scaling
        group = queries[j * g:(j + 1) * g].float()
        bias = None if log_n is None else log_n[j].float()
        log_col = (None if column_scale is None
                   else column_scale[j * g:(j + 1) * g, None, sinks:sinks + chunk].float().log())
        for s in range(0, q, block):
            logits = group[:, s:s + block] @ keys_t
            if bias is not None:
                logits += bias
            logits[..., k - q:] += causal[s:s + block]
            part = logits[..., sinks:sinks + chunk].sub_(logits.logsumexp(-1, keepdim=True))
            if log_row is not None:
                part = part + log_row[:, s:s + block] + log_col
            best[j] = torch.maximum(best[j], part.amax((0, 1)))
    return best.exp()

