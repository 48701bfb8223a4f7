"""Task families that do not mark the fact as unusual: each writes its facts in the haystack's own
register (no "special magic", no answer prefix) and asks by a paraphrase, on haystacks of two genres
(`docs`: Python's language reference; `legal`: the licence texts every Debian system ships).

Each generator: (tokenizer, n_tokens, seed, genre) → `Sample`, `meta["task"]` = "<family>/<genre>";
answers are lists scored like RULER (the fraction found in the prediction). Families:

* `own_words`: one number stated mid-sentence in the genre's words, asked by a paraphrase;
* `same_template_K` (K = 2, 4, 8): K facts written with one template, one of them asked;
* `two_hop`: one statement points to another ("the same value as ..."), the question asks the first;
* `counting`: how many sentences of one kind the context holds (2 to 6), answered as a digit.
"""

from __future__ import annotations

import random
import re

from .corpus import genre_text
from .niah import Sample, haystack

GENRES = ("docs", "legal")

OWN_WORDS = {  # genre → (statement, paraphrased question); {noun} an ordinary word of the genre, {value} a number
    "docs": [
        ("When the interpreter starts, it reserves {value} slots for the {noun} table before any module is imported, "
         "so that later lookups need no resizing.",
         "Before any module is imported, how many slots are set aside for the {noun} table?"),
        ("By default a {noun} object keeps at most {value} entries in its cache, after which the oldest entries are "
         "discarded in the order they were added.",
         "What is the largest number of cached entries a {noun} object holds by default?"),
        ("The loop that reads the {noun} stream stops after {value} iterations even if more data remains, and the "
         "caller is expected to resume it.",
         "After how many iterations does reading the {noun} stream stop?"),
    ],
    "legal": [
        ("Notice of any termination concerning the {noun} must be given in writing at least {value} days before it "
         "takes effect, and the remaining terms continue to apply until then.",
         "How many days in advance must written notice of termination concerning the {noun} be given?"),
        ("Any claim arising from the {noun} shall be brought within {value} days of the event giving rise to it, "
         "after which the claim is barred under this section.",
         "Within how many days must a claim arising from the {noun} be brought?"),
        ("The total liability of the licensor for the {noun} shall not exceed {value} dollars, regardless of the "
         "form of the action or the theory of liability.",
         "What is the most the licensor can be liable for regarding the {noun}, in dollars?"),
    ],
}
SAME_TEMPLATE = {  # (statement, question) with {key} distinguishing the K facts
    "docs": ("By default the buffer for the {key} holds {value} bytes, and it grows only when a larger object "
             "is stored.",
             "How many bytes does the buffer for the {key} hold by default?"),
    "legal": ("Under the {key} clause, the fee payable by the recipient is {value} dollars per year.",
              "How much does the recipient pay per year under the {key} clause, in dollars?"),
}
TWO_HOP = {  # (the pointing statement, the target statement, question)
    "docs": ("The {a} setting always takes the same value as the {b} setting, whatever the platform.",
             "The {b} setting is {value} on every supported platform.",
             "What value does the {a} setting take?"),
    "legal": ("The period stated for the {a} shall be equal to the period stated for the {b}.",
              "The period stated for the {b} is {value} days from the date of distribution.",
              "How many days is the period stated for the {a}?"),
}
COUNTING = {  # (the counted sentence, question)
    "docs": ("A warning was reported while the {noun} module was being compiled.",
             "How many warnings were reported while modules were being compiled? Answer with a digit."),
    "legal": ("A separate notice was attached for the {noun} component.",
              "How many separate notices were attached for components? Answer with a digit."),
}


def _vocabulary(genre: str) -> list[str]:
    """Ordinary nouns of the genre's own text: lower-case words of 5 to 10 letters that follow "the" at
    least 3 times, in a fixed order."""
    counts: dict[str, int] = {}
    for w in re.findall(r"\bthe ([a-z]{5,10})\b", genre_text(genre)):
        counts[w] = counts.get(w, 0) + 1
    return sorted(w for w, c in counts.items() if c >= 3)


def score(prediction: str, answers: list[str]) -> float:
    """Fraction of the expected answers found in the prediction as whole words ("78" is not in "1978")."""
    return sum(bool(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", prediction, re.I)) for a in answers) / len(answers)


def _place(tok, n_tokens: int, rng: random.Random, genre: str, statements: list[str], low: float = 0.1,
           high: float = 0.9) -> str:
    """About `n_tokens` tokens: the statements in order, each at a random depth in [low, high) of the
    genre's haystack, which makes up the rest."""
    own = sum(len(tok(" " + s, add_special_tokens=False)["input_ids"]) for s in statements)
    hay = haystack(tok, max(n_tokens - own, 1), offset=rng.randrange(10_000), text=genre)
    spots = sorted(rng.randrange(int(low * len(hay)), max(int(high * len(hay)), int(low * len(hay)) + 1))
                   for _ in statements)
    for i, (at, s) in enumerate(zip(spots, statements)):
        hay.insert(at + i, s)
    return " ".join(hay)


def _check(genre: str) -> None:
    if genre not in GENRES:
        raise ValueError(f"unknown genre {genre!r}; genres: {', '.join(GENRES)}")


def own_words(tok, n, seed, genre="docs") -> Sample:
    _check(genre)
    rng = random.Random(seed)
    statement, question = rng.choice(OWN_WORDS[genre])
    noun, value = rng.choice(_vocabulary(genre)), str(rng.randint(12, 980))
    context = _place(tok, n, rng, genre, [statement.format(noun=noun, value=value)])
    return Sample(context, question.format(noun=noun), [value], {"task": f"own_words/{genre}", "length": n, "seed": seed})


def same_template(k: int):
    def make(tok, n, seed, genre="docs") -> Sample:
        _check(genre)
        rng = random.Random(seed)
        statement, question = SAME_TEMPLATE[genre]
        keys = rng.sample(_vocabulary(genre), k)
        values = [str(v) for v in rng.sample(range(12, 980), k)]
        facts = [statement.format(key=key, value=v) for key, v in zip(keys, values)]
        asked = rng.randrange(k)
        context = _place(tok, n, rng, genre, rng.sample(facts, k))
        return Sample(context, question.format(key=keys[asked]), [values[asked]],
                      {"task": f"same_template_{k}/{genre}", "length": n, "seed": seed})
    return make


def two_hop(tok, n, seed, genre="docs") -> Sample:
    _check(genre)
    rng = random.Random(seed)
    pointing, target, question = TWO_HOP[genre]
    a, b = rng.sample(_vocabulary(genre), 2)
    value = str(rng.randint(12, 980))
    pair = [pointing.format(a=a, b=b), target.format(b=b, value=value)]
    context = _place(tok, n, rng, genre, pair if rng.random() < 0.5 else pair[::-1])
    return Sample(context, question.format(a=a), [value], {"task": f"two_hop/{genre}", "length": n, "seed": seed})


def counting(tok, n, seed, genre="docs") -> Sample:
    _check(genre)
    rng = random.Random(seed)
    statement, question = COUNTING[genre]
    count = rng.randint(2, 6)
    nouns = rng.sample(_vocabulary(genre), count)
    context = _place(tok, n, rng, genre, [statement.format(noun=x) for x in nouns])
    return Sample(context, question, [str(count)], {"task": f"counting/{genre}", "length": n, "seed": seed})


TASKS = {"own_words": own_words, "same_template_2": same_template(2), "same_template_4": same_template(4),
         "same_template_8": same_template(8), "two_hop": two_hop, "counting": counting}
