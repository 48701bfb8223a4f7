"""Does the learned scorer keep more needles at 10% when its training text holds facts? A probe on the
dev split (R49 in docs/research-log.md):

    .venv/bin/python benchmarks/facts_probe.py fit smollm2-135m --out /tmp/facts-smollm2.safetensors
    .venv/bin/python benchmarks/facts_probe.py dev smollm2-135m --weights /tmp/facts-smollm2.safetensors

`kvmerge train-scorer` fits KVzip's scores on the docstrings of Python's standard library and Perl's
pod pages: prose about code, nearly free of the arbitrary values (identifiers, codes, long numbers)
a model can only repeat by reading them back. KVzip ranks such tokens high (its second pass must copy
them), so a scorer that never saw one predicts them from tokens it did see. `fit` trains the same
ridge on the same text with short records inserted at sentence ends, about one per `--every`
characters: a few words drawn from the text around it, then a random value of one of seven kinds
(an integer of 4–10 digits, a UUID, a hex string, a code of letters and digits, a decimal, a date, a
made-up name), in one of six sentence shapes. Nothing of an evaluation task is copied: the words are
the training text's own, the values random.

`dev` runs `factzip` (`learnedzip` with the scorer from `--weights`) on the dev needles (kvmerge's
RULER-style task on the legal haystack, 4k, 12 samples) and the dev facts of one template (docs, 2k,
10 samples), 25% and 10%, into `results/lookahead/<model>/`, where `learnedzip`'s rows already are."""

from __future__ import annotations

import argparse
import random
import re
import string
import uuid
from dataclasses import dataclass

import torch
from dev_cells import add_arguments, run_cells

import kvmerge
from kvmerge import train_scorer
from kvmerge.methods.learnedzip import LearnedZip
from kvmerge.methods.registry import register
from kvmerge.scorer import Scorer

SHAPES = ("The {a} {b} is {v}.", "{A} {b}: {v}.", "Note that {a} was set to {v} for the {b}.",
          "Reference {v} refers to the {a} {b}.", "For {a}, use {v}.", "The value recorded for {a} {b} was {v}.")


def value(rng: random.Random) -> str:
    """A random value of one of seven kinds."""
    kind = rng.randrange(7)
    if kind == 0:
        return str(rng.randrange(10 ** 3, 10 ** rng.randint(4, 10)))
    if kind == 1:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == 2:
        return "".join(rng.choice("0123456789abcdef") for _ in range(rng.randint(7, 16)))
    if kind == 3:
        chars = string.ascii_uppercase + string.digits
        return "-".join("".join(rng.choice(chars) for _ in range(rng.randint(2, 5))) for _ in range(rng.randint(1, 3)))
    if kind == 4:
        return f"{rng.uniform(0, 1000):.{rng.randint(1, 5)}f}"
    if kind == 5:
        return f"{rng.randint(1900, 2099)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    syllables = ["ka", "lo", "mi", "ra", "ten", "vu", "zor", "el", "quin", "dar", "bel", "sto"]
    return "".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))).capitalize()


def with_facts(text: str, rng: random.Random, every: int) -> str:
    """`text` with a record inserted after about one sentence end in `every` characters."""
    words = re.findall(r"[a-z]{4,}", text) or ["item", "entry"]
    ends = [m.end() for m in re.finditer(r"\.\s", text)]
    picks = sorted(rng.sample(ends, min(len(ends), max(1, len(text) // every))))
    out, last = [], 0
    for at in picks:
        a, b = rng.choice(words), rng.choice(words)
        record = rng.choice(SHAPES).format(a=a, A=a.capitalize(), b=b, v=value(rng))
        out += [text[last:at], record + " "]
        last = at
    return "".join(out + [text[last:]])


def fit(args):
    model, tok = kvmerge.load_model(args.model)
    plain, rng = train_scorer.corpus, random.Random(args.seed)
    train_scorer.corpus = lambda: [with_facts(t, rng, args.every) for t in plain()]
    scorer = train_scorer.train(model, tok, progress=lambda i, n: print(f"{i}/{n}", flush=True))
    scorer.save(args.out)
    print(scorer.meta)


@register
@dataclass
class FactZip(LearnedZip):
    """`learnedzip` with the scorer in the file `weights`."""

    weights: str = ""
    name = "factzip"

    def setup(self, runtime):
        super().setup(runtime)
        self._scorer = Scorer.load(self.weights, runtime.config)


def dev(args):
    model, tok = kvmerge.load_model(args.model)
    methods = [f"factzip:weights={args.weights}" if m == "factzip" else m for m in args.methods.split(",")]
    run_cells(model, tok, args.model, methods, args.budgets, args.out, args.first, args.cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["fit", "dev"])
    ap.add_argument("model")
    ap.add_argument("--out", default=None)
    ap.add_argument("--weights", default="/tmp/facts.safetensors")
    ap.add_argument("--every", type=int, default=1000, help="characters of text per inserted record")
    ap.add_argument("--seed", type=int, default=0)
    add_arguments(ap, "factzip")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.step == "fit":
        args.out = args.out or args.weights
        fit(args)
    else:
        args.out = args.out or "results/lookahead"
        dev(args)


if __name__ == "__main__":
    main()
