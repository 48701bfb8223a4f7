"""Needle in a haystack: a fact hidden at a given depth of natural prose, retrieved by exact match."""

from __future__ import annotations

import random
from dataclasses import dataclass

from .corpus import prose, sentences

CITIES = ["Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito", "Dublin", "Cairo", "Perth", "Riga",
          "Accra", "Bern", "Kyoto", "Porto", "Tunis", "Zagreb"]


@dataclass
class Sample:
    context: str
    question: str
    answer: str
    meta: dict


def haystack(tokenizer, n_tokens: int, offset: int = 0, text: str | None = None) -> list[str]:
    """Whole sentences of prose, starting at sentence `offset`, adding up to about `n_tokens` tokens."""
    pool = sentences(prose(text))
    out, total, i = [], 0, offset % len(pool)
    while total < n_tokens:
        s = pool[i % len(pool)]
        total += len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        out.append(s)
        i += 1
    return out


def make_sample(tokenizer, n_tokens: int, depth: float, seed: int, text: str | None = None) -> Sample:
    """One needle "The special magic number for {city} is {number}." at `depth` (0 = start, 1 = end)."""
    rng = random.Random(seed)
    city, number = rng.choice(CITIES), str(rng.randint(1000, 99999))
    needle = f"The special magic number for {city} is {number}."
    hay = haystack(tokenizer, n_tokens, offset=rng.randrange(10_000), text=text)
    at = round(depth * len(hay))
    context = " ".join(hay[:at] + [needle] + hay[at:])
    question = f"What is the special magic number for {city}? Answer with the number only."
    return Sample(context, question, number, {"length": n_tokens, "depth": depth, "seed": seed, "city": city,
                                              "answer_prefix": f"The special magic number for {city} is"})


def score(prediction: str, answer: str) -> float:
    """1.0 when the answer appears in the prediction as a whole number."""
    import re

    return float(answer in re.findall(r"\d+", prediction))
