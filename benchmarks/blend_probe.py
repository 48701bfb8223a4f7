"""Does averaging two learned scorers' predictions keep what each keeps? A probe on the dev split
(R37 in docs/research-log.md): the shipped ridge (fitted to KVzip's log scores) and an MLP fitted to
each head's rank (`kvmerge train-scorer --kind mlp --target rank --out FILE`), both on KVzip's log
scale, averaged per entry:

    .venv/bin/python benchmarks/blend_probe.py gemma3-270m --rank FILE --spec learnedzip:sliding=0.75

`blendzip`: `learnedzip` scoring each entry exp((ridge + rank MLP) / 2). Runs it on the dev split's
cells for the model (as benchmarks/calibration_probe.py; 2k, 10 samples, 25% and 10%); rows in
`results/blend/<split>/<model>/`; `--split test` runs generalise-test's 2k cells."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import kvmerge
from kvmerge.methods.learnedzip import LearnedZip
from kvmerge.methods.registry import register
from kvmerge.scorer import Scorer

TEST = [("family", ["own_words", "two_hop"], g) for g in ("docs", "legal", "manual")] + [
    ("fidelity", None, g) for g in ("legal", "table")]  # generalise-test's 2k cells
RANK: dict = {}  # "path": the rank-fitted scorer's file


@register
@dataclass
class BlendZip(LearnedZip):
    """`learnedzip` whose log score is the mean of the ridge's and the rank-fitted MLP's (this probe's)."""

    name = "blendzip"

    def setup(self, runtime):
        super().setup(runtime)
        self._rank = Scorer.load(Path(RANK["path"]), runtime.config)

    def fresh_scores(self, keys, values, ctx):
        ridge = super().fresh_scores(keys, values, ctx).log()
        scorer, self._scorer = self._scorer, self._rank
        try:
            rank = super().fresh_scores(keys, values, ctx).log()
        finally:
            self._scorer = scorer
        return ((ridge + rank) / 2).exp()


def main():
    from calibration_probe import CELLS

    from kvmerge_eval.runner import run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=list(CELLS))
    ap.add_argument("--rank", required=True, help="the rank-fitted MLP's weights file")
    ap.add_argument("--spec", default="learnedzip", help="the method as run (blendzip takes its parameters)")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--split", choices=("dev", "test"), default="dev",
                    help="test: generalise-test's 2k cells instead (own words and two-hop on three genres, KL)")
    ap.add_argument("--out", default="results/blend")
    args = ap.parse_args()
    RANK["path"] = args.rank
    model, tok = kvmerge.load_model(args.model)
    rest = args.spec.partition(":")[2]
    cells = CELLS[args.model] if args.split == "dev" else TEST
    for task, subtasks, genre in cells:
        out = Path(args.out) / args.split / args.model / f"{task}-{genre}"
        samples = 3 if task == "fidelity" else args.samples
        for row in run(task, model, tok, ["blendzip" + (f":{rest}" if rest else "")], [0.25, 0.1], [2048],
                       samples, out, text=genre, subtasks=subtasks, model_name=args.model):
            print({k: row[k] for k in row if k in ("method", "budget", "task", "score", "n")}, flush=True)


if __name__ == "__main__":
    main()
