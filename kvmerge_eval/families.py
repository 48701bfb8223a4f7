"""Task families that do not mark the fact as unusual: each writes its facts in the haystack's own
register (no "special magic", no answer prefix) and asks by a paraphrase, on haystacks of three genres
(`docs`: Python's language reference; `legal`: the licence texts every Debian system ships; `manual`:
the manual pages of Debian's essential commands).

Each generator: (tokenizer, n_tokens, seed, genre) → `Sample`, `meta["task"]` = "<family>/<genre>";
answers are lists, scored by the fraction found in the prediction as whole words (`score`). Families:

* `own_words`: one number stated mid-sentence in the genre's words, asked by a paraphrase;
  keys are names the genre uses itself (standard-library modules in the docs, section numbers in the
  legal text, command names in the manual pages), not out-of-place names;
* `same_template_K` (K = 2, 4, 8): K facts written with one template, one of them asked;
* `two_hop`: one statement points to another ("the same value as ..."), the question asks the first;
* `counting`: how many sentences of one kind the context holds (2 to 6), answered as a digit.
"""

from __future__ import annotations

import random
import re

from .niah import Sample, haystack

GENRES = ("docs", "legal", "manual")

# Keys are names the genre itself uses: standard-library module names in the docs, section numbers in
# the legal text; {value} is a number.
OWN_WORDS = {  # genre → (statement, paraphrased question)
    "docs": [
        ("When the interpreter starts, the {key} module reserves {value} slots for its lookup table before any "
         "other module is imported, so that later lookups need no resizing.",
         "Before other modules are imported, how many slots does the {key} module set aside for its lookup table?"),
        ("By default an object of the {key} module keeps at most {value} entries in its cache, after which the "
         "oldest entries are discarded in the order they were added.",
         "What is the largest number of cached entries an object of the {key} module holds by default?"),
        ("The loop that reads a stream in the {key} module stops after {value} iterations even if more data "
         "remains, and the caller is expected to resume it.",
         "After how many iterations does the {key} module stop reading a stream?"),
    ],
    "legal": [
        ("Notice of any termination under Section {key} must be given in writing at least {value} days before it "
         "takes effect, and the remaining terms continue to apply until then.",
         "How many days in advance must written notice of a termination under Section {key} be given?"),
        ("Any claim arising under Section {key} shall be brought within {value} days of the event giving rise to "
         "it, after which the claim is barred.",
         "Within how many days must a claim arising under Section {key} be brought?"),
        ("The total liability of the licensor under Section {key} shall not exceed {value} dollars, regardless of "
         "the form of the action or the theory of liability.",
         "What is the most the licensor can be liable for under Section {key}, in dollars?"),
    ],
    "manual": [
        ("By default, {key} waits {value} seconds for the device to respond before it gives up and exits with a "
         "nonzero status.",
         "How many seconds does {key} wait by default for a response before giving up?"),
        ("Unless a larger limit is given on the command line, {key} reads at most {value} lines from standard "
         "input and ignores the rest.",
         "How many lines of standard input will {key} read if no other limit is set?"),
        ("If the output file already exists, {key} keeps up to {value} numbered backups of it, removing the "
         "oldest backup first.",
         "How many numbered backups of an existing output file does {key} keep?"),
    ],
}
SAME_TEMPLATE = {  # (statement, question): K facts, one asked by its key
    "docs": ("By default the buffer of the {key} module holds {value} bytes, and it grows only when a larger "
             "object is stored.",
             "How many bytes does the {key} module's buffer hold by default?"),
    "legal": ("Under Section {key}, the fee payable by the recipient is {value} dollars per year.",
              "What yearly fee, in dollars, does Section {key} require the recipient to pay?"),
    "manual": ("By default {key} uses a block size of {value} bytes when it writes to a pipe.",
               "What block size, in bytes, does {key} use by default when writing to a pipe?"),
}
TWO_HOP = {  # (the pointing statement, the target statement, question)
    "docs": ("The {a} module always uses the same buffer size as the {b} module, whatever the platform.",
             "The {b} module uses a buffer size of {value} bytes on every supported platform.",
             "What buffer size does the {a} module use, in bytes?"),
    "legal": ("The period stated in Section {a} shall be equal to the period stated in Section {b}.",
              "The period stated in Section {b} is {value} days from the date of distribution.",
              "How many days is the period stated in Section {a}?"),
    "manual": ("When no timeout is given, {a} uses the same default timeout as {b}.",
               "The default timeout of {b} is {value} seconds.",
               "How many seconds is the default timeout of {a}?"),
}
COUNTING = {  # (the counted sentence, question)
    "docs": ("A warning was reported while the {key} module was being compiled.",
             "How many warnings were reported while modules were being compiled? Answer with a digit."),
    "legal": ("A separate notice was attached for the component covered by Section {key}.",
              "How many separate notices were attached for components? Answer with a digit."),
    "manual": ("A warning about an unknown option was printed by {key}.",
               "How many warnings about an unknown option were printed? Answer with a digit."),
}


def _keys(genre: str, rng: random.Random, k: int) -> list[str]:
    """k distinct keys of the genre: standard-library module names (docs), section numbers (legal) or
    command names (manual)."""
    if genre == "manual":
        from .corpus import COMMANDS

        return rng.sample(COMMANDS, k)
    if genre == "docs":
        import sys

        names = sorted(n for n in sys.stdlib_module_names if n.isalpha() and n.islower() and 4 <= len(n) <= 10)
        return rng.sample(names, k)
    return [f"{a}.{b}" for a, b in rng.sample([(a, b) for a in range(2, 15) for b in range(1, 10)], k)]


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
    key, value = _keys(genre, rng, 1)[0], str(rng.randint(12, 980))
    context = _place(tok, n, rng, genre, [statement.format(key=key, value=value)])
    return Sample(context, question.format(key=key), [value], {"task": f"own_words/{genre}", "length": n, "seed": seed})


def same_template(k: int):
    def make(tok, n, seed, genre="docs") -> Sample:
        _check(genre)
        rng = random.Random(seed)
        statement, question = SAME_TEMPLATE[genre]
        keys = _keys(genre, rng, k)
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
    a, b = _keys(genre, rng, 2)
    value = str(rng.randint(12, 980))
    pair = [pointing.format(a=a, b=b), target.format(b=b, value=value)]
    context = _place(tok, n, rng, genre, pair if rng.random() < 0.5 else pair[::-1])
    return Sample(context, question.format(a=a), [value], {"task": f"two_hop/{genre}", "length": n, "seed": seed})


def counting(tok, n, seed, genre="docs") -> Sample:
    _check(genre)
    rng = random.Random(seed)
    statement, question = COUNTING[genre]
    count = rng.randint(2, 6)
    context = _place(tok, n, rng, genre, [statement.format(key=x) for x in _keys(genre, rng, count)])
    return Sample(context, question, [str(count)], {"task": f"counting/{genre}", "length": n, "seed": seed})


TASKS = {"own_words": own_words, "same_template_2": same_template(2), "same_template_4": same_template(4),
         "same_template_8": same_template(8), "two_hop": two_hop, "counting": counting}
