"""Fidelity: compress the first N tokens of a long text, teacher-force the next M, compare the
next-token distributions with the full cache (KL, perplexity ratio, top-1 agreement)."""

from __future__ import annotations

import random

import torch

from kvmerge import Session
from .corpus import prose
from .niah import Sample


def make_sample(tokenizer, n_tokens: int, seed: int, text: str | None = None, continuation: int = 256) -> Sample:
    """`n_tokens` of prose starting at a seeded paragraph as context, the next `continuation` tokens
    as the teacher-forced part (`answer`: their ids)."""
    paragraphs = prose(text).split("\n\n")
    rng = random.Random(seed)
    start = rng.randrange(len(paragraphs))
    ids: list[int] = []
    i = start
    while len(ids) < n_tokens + continuation:
        ids += tokenizer(paragraphs[i % len(paragraphs)] + "\n\n", add_special_tokens=False)["input_ids"]
        i += 1
    return Sample(ids[:n_tokens], "", ids[n_tokens:n_tokens + continuation],
                  {"task": "fidelity", "length": n_tokens, "seed": seed})


@torch.inference_mode()
def continuation_logits(model, context: list[int], continuation: list[int], method=None,
                        tokenizer=None) -> torch.Tensor:
    """Log-probabilities `(M, vocab)` for each continuation token, the context compressed by `method`
    (None: full cache)."""
    s = Session(model, 1, method, tokenizer)
    return teacher_forced(s, s.prefill([context]), continuation)


@torch.inference_mode()
def teacher_forced(session, first: torch.Tensor, continuation: list[int]) -> torch.Tensor:
    """Log-probabilities `(M, vocab)` of the continuation fed after the session's (compressed)
    context, `first` being the context's last-token logits. With a decode policy the continuation is
    fed one token at a time."""
    rest = continuation[:-1]
    if session.method is not None and session.method.needs.decode_policy:
        steps = [session.forward([[t]]) for t in rest]
    else:
        steps = [session.forward([rest], all_logits=True)[0]] if rest else []
    return torch.cat([first] + steps).log_softmax(-1)


def compare(reference: torch.Tensor, logp: torch.Tensor, targets: list[int]) -> dict:
    """KL(full ‖ method) per token, perplexity ratio method/full, top-1 agreement."""
    t = torch.tensor(targets)
    kl = (reference.exp() * (reference - logp)).sum(-1).mean()
    nll_ref = -reference.gather(-1, t[:, None]).mean()
    nll = -logp.gather(-1, t[:, None]).mean()
    return {"kl": float(kl), "ppl_ratio": float((nll - nll_ref).exp()),
            "top1": float((reference.argmax(-1) == logp.argmax(-1)).float().mean()),
            "ppl_full": float(nll_ref.exp())}
