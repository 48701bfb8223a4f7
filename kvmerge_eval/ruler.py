"""RULER-style synthetic tasks (Hsieh et al., 2024) from templates over prose haystacks.

Each generator: (tokenizer, n_tokens, seed, text) → `Sample`; answers are lists, scored by the
fraction of them found in the prediction (RULER's string match).
"""

from __future__ import annotations

import random
import re
import uuid
from collections import Counter

from .corpus import prose
from .niah import CITIES, Sample, haystack

KINDS = ("number", "word", "uuid")


def _words(text: str | None) -> list[str]:
    return sorted({w.lower() for w in re.findall(r"[A-Za-z]{4,9}", prose(text))})


def _value(kind: str, rng: random.Random, words: list[str]) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return rng.choice(words)
    return str(uuid.UUID(int=rng.getrandbits(128)))


def _insert(tokenizer, n_tokens, rng, text, needles: list[str]) -> str:
    """Needles at random depths of a prose haystack of about `n_tokens` tokens."""
    hay = haystack(tokenizer, n_tokens, offset=rng.randrange(10_000), text=text)
    for needle in needles:
        hay.insert(rng.randrange(len(hay) + 1), needle)
    return " ".join(hay)


def _needles(tokenizer, n_tokens, seed, text, kind, keys: int, values: int, queries: int, name: str) -> Sample:
    rng = random.Random(seed)
    words = _words(text)
    names = rng.sample(CITIES, keys)
    facts = {k: [_value(kind, rng, words) for _ in range(values)] for k in names}
    needles = [f"One of the special magic {kind}s for {k} is: {v}." for k in names for v in facts[k]]
    asked = names[:queries]
    context = _insert(tokenizer, n_tokens, rng, text, needles)
    if values > 1:
        question = f"What are all the special magic {kind}s for {asked[0]}? List them."
        prefix = f"The special magic {kind}s for {asked[0]} are"
    elif queries > 1:
        question = f"What are the special magic {kind}s for {', '.join(asked)}? List them."
        prefix = f"The special magic {kind}s for {', '.join(asked)} are"
    else:
        question = f"What is the special magic {kind} for {asked[0]}? Answer with the {kind} only."
        prefix = f"The special magic {kind} for {asked[0]} is"
    answers = [v for k in asked for v in facts[k]]
    return Sample(context, question, answers, {"task": name, "length": n_tokens, "seed": seed, "answer_prefix": prefix})


def single(kind):
    return lambda tok, n, seed, text=None: _needles(tok, n, seed, text, kind, 1, 1, 1, f"single_{kind}")


def multikey(tok, n, seed, text=None):
    return _needles(tok, n, seed, text, "number", 4, 1, 1, "multikey")


def multivalue(tok, n, seed, text=None):
    return _needles(tok, n, seed, text, "number", 1, 4, 1, "multivalue")


def multiquery(tok, n, seed, text=None):
    return _needles(tok, n, seed, text, "number", 4, 1, 4, "multiquery")


def variable_tracking(tok, n, seed, text=None, hops: int = 4):
    rng = random.Random(seed)
    value = str(rng.randint(10_000, 99_999))
    names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(hops)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops)]
    hay = haystack(tok, n, offset=rng.randrange(10_000), text=text)
    spots = sorted(rng.randrange(len(hay) + 1) for _ in chain)
    for i, (at, stmt) in enumerate(zip(spots, chain)):  # in order: each earlier insert shifts the rest by one
        hay.insert(at + i, stmt)
    question = f"Find all variables that are assigned the value {value}, directly or through other variables."
    return Sample(" ".join(hay), question, names, {"task": "variable_tracking", "length": n, "seed": seed})


def _word_list(tok, n, rng, counts: dict[str, int], filler: list[str]) -> str:
    """A numbered list of words: `counts` occurrences of the given words, topped up with `filler`
    words (3 each) until about `n` tokens, shuffled."""
    items = [w for w, c in counts.items() for _ in range(c)]
    per_word = len(tok(" 1. word", add_special_tokens=False)["input_ids"])
    pool = [w for w in filler if w not in counts]
    rng.shuffle(pool)
    while len(items) * per_word < n and pool:
        items += [pool.pop()] * 3
    rng.shuffle(items)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))


def common_words(tok, n, seed, text=None, top: int = 10):
    rng = random.Random(seed)
    words = _words(text)
    common = rng.sample(words, top)
    context = _word_list(tok, n, rng, {w: 30 for w in common}, words)
    question = f"What are the {top} most common words in the above list? List them."
    return Sample(context, question, common, {"task": "common_words", "length": n, "seed": seed})


def frequent_words(tok, n, seed, text=None, top: int = 3):
    rng = random.Random(seed)
    coded = ["".join(rng.choice("bcdfghjklmnpqrstvwxz") + rng.choice("aeiou") for _ in range(3)) for _ in range(200)]
    counts = Counter({w: max(1, int(80 / (i + 1))) for i, w in enumerate(coded)})  # Zipf
    context = _word_list(tok, n, rng, dict(counts.most_common(top)), coded[top:])
    question = f"What are the {top} most frequently appearing coded words in the above list? List them."
    return Sample(context, question, [w for w, _ in counts.most_common(top)],
                  {"task": "frequent_words", "length": n, "seed": seed})


INLINE = [  # (fact in the documentation's own register, question, answer prefix); {key} is an identifier
    ("In the {key} build the default recursion limit is {value}, and deeper calls raise RecursionError.",
     "What is the default recursion limit in the {key} build?", "The default recursion limit in the {key} build is"),
    ("Unless the environment overrides it, the buffer of the {key} module holds {value} bytes per read.",
     "How many bytes per read does the buffer of the {key} module hold?",
     "The buffer of the {key} module holds"),
    ("The {key} socket option accepts timeouts of at most {value} milliseconds; larger values raise ValueError.",
     "What is the largest timeout, in milliseconds, that the {key} socket option accepts?",
     "The largest timeout the {key} socket option accepts is"),
]


def single_inline(tokenizer, n_tokens, seed, text=None) -> Sample:
    """One number stated in the haystack's own register (not an out-of-place "special magic" sentence),
    asked about by its key; other keys of the same form may appear as distractor-free prose around it."""
    rng = random.Random(seed)
    fact, question, prefix = rng.choice(INLINE)
    key, value = rng.choice(CITIES).lower(), str(rng.randint(1000, 99999))
    context = _insert(tokenizer, n_tokens, rng, text, [fact.format(key=key, value=value)])
    return Sample(context, question.format(key=key), [value],
                  {"task": "single_inline", "length": n_tokens, "seed": seed, "answer_prefix": prefix.format(key=key)})


TASKS = {"single_number": single("number"), "single_inline": single_inline, "single_word": single("word"), "single_uuid": single("uuid"),
         "multikey": multikey, "multivalue": multivalue, "multiquery": multiquery,
         "variable_tracking": variable_tracking, "common_words": common_words, "frequent_words": frequent_words}


def score(prediction: str, answers: list[str]) -> float:
    """Fraction of the expected answers that appear in the prediction (case-insensitive)."""
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)
