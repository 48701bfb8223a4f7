"""KVzip (Kim et al. 2025, arXiv 2505.23416): keep what the model needs to repeat the context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..model import attention_scaling
from ..ops.scores import reconstruction_attention
from .base import CarriedScores, ScoringMethod
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
    second prefill. Budget: uniform per layer and head (equal bytes; the paper's global budget
    across layers and heads would need ragged heads). Chunked prefill: each fresh chunk is
    reconstructed when it arrives; kept entries keep their scores."""

    chunk: int = 2048
    postfix: int = 8
    name = "kvzip"
    FIRST: ClassVar[str] = "\n\nRepeat the previous context exactly."
    LATER: ClassVar[str] = "\n\nRepeat the part of the previous context exactly, starting with"

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1 or self.postfix < 0:
            raise ValueError(f"kvzip needs chunk >= 1 and postfix >= 0, got chunk={self.chunk}, postfix={self.postfix}")

    def setup(self, model, tokenizer):
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

    def before_compress(self, session, token_rows, layers):
        if token_rows is None:
            raise ValueError("kvzip needs the prompt's token ids to reconstruct it")
        key = (self.name, self.chunk, self.postfix, self.sinks)  # one pass serves every budget
        if key not in session.memo:
            session.memo[key] = self._reconstruct(session, token_rows, layers)
        for i in layers:
            session.states[i].scratch["_kvzip_fresh"] = session.memo[key][i]

    def _reconstruct(self, session, token_rows, layers) -> dict:
        """Layer index → each row's fresh slots' scores `(h, fresh)`."""
        fresh = [context[len(context) - min(int(p), len(context)):] for context, p in zip(token_rows, session.plain)]
        scaling = attention_scaling(session.model.config)
        found = {i: [[] for _ in fresh] for i in layers}  # layer → row → chunks' scores (h, c)

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
                    found[i][b].append(reconstruction_attention(
                        query[b, :, query.shape[2] - q:], layer.keys[b][:, picked], log_n, len(sinks),
                        scaling))

            session.probe(rows, listen)
        return {i: [torch.cat(chunks, -1) if chunks else None for chunks in found[i]] for i in layers}

    def scores(self, keys, log_n, ctx):
        fresh = ctx.state.scratch.get("_kvzip_fresh") if ctx.state is not None else None
        if fresh is None:
            raise ValueError("kvzip scores come from its reconstruction pass: compress through a Session")
        f = min(fresh[int(b)].shape[-1] for b in ctx.rows)
        return self.with_carried(torch.stack([fresh[int(b)][:, -f:] for b in ctx.rows]).to(keys.device),
                                 keys.shape[2], ctx)


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
