"""Does mapping `learnedzip`'s predictions onto KVzip's score distribution, head by head, change
what the global allocation keeps, and the answers? A probe on the dev split (R35 in
docs/research-log.md):

    .venv/bin/python benchmarks/calibration_probe.py gemma3-270m --spec learnedzip:sliding=0.75
    .venv/bin/python benchmarks/calibration_probe.py smollm2-135m --spec learnedzip

1. Quantiles (65 levels) of the shipped scorer's predictions and of KVzip's log scores, per compressed
   layer and KV head, on `--fit` pieces of the training text that the scorer never fitted (pieces 110
   on, as benchmarks/scorer_probe.py), away from the first 4 and last 32 tokens.
2. `calibratedzip`: `learnedzip` whose prediction goes through that map (piecewise linear between
   the quantiles, a monotone map per head: the picks within a head do not change, only how the
   global allocation splits the budget between heads and layers).
3. Both, one prefill per sample, on the dev split's cells for the model (`generalise-dev`'s family
   tasks and needles, 2k, 10 samples), at 25% and 10%; rows in `results/calibration/<model>/`.

Printed: the share of the budget each compressed layer gets, averaged over the judged pieces, with
the prediction, the calibrated prediction and KVzip's own scores; then the answers per cell."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import kvmerge
from kvmerge.methods.learnedzip import LearnedZip
from kvmerge.methods.registry import register
from kvmerge.scorer import find
from kvmerge.train_scorer import _opening, corpus, examples, pieces

SINKS, WINDOW, LEVELS = 4, 32, 65
MAP: dict = {}  # "xs", "ys": (layers, heads, LEVELS) quantiles of the prediction and of KVzip's log score

CELLS = {  # the dev split's cells (kvmerge_eval/suites/generalise-dev.toml): (task, subtasks, genre)
    "smollm2-135m": [("family", ["same_template_2", "same_template_4", "same_template_8"], "docs"),
                     ("family", ["same_template_2", "same_template_4", "same_template_8"], "legal"),
                     ("niah", None, "docs"), ("niah", None, "legal")],
    "gemma3-270m": [("family", ["same_template_2", "same_template_4"], "docs"),
                    ("family", ["same_template_2"], "legal"), ("niah", None, "docs")],
}
# R41's dev needles where the default's 10% falls short of KVzip's (`--cells ruler-legal --lengths 4096`)
RULER_LEGAL = [("ruler", ["single_number", "single_uuid", "multivalue", "multiquery"], "legal")]


def through(layer: int, p: torch.Tensor) -> torch.Tensor:
    """Predicted log scores `(b, h, n)` of compressed layer `layer` → mapped onto KVzip's quantiles."""
    xs, ys = MAP["xs"][layer].to(p), MAP["ys"][layer].to(p)  # (h, K)
    b, h, n = p.shape
    x = xs.expand(b, h, LEVELS).contiguous()
    i = torch.searchsorted(x, p.contiguous()).clamp(1, LEVELS - 1)
    y = ys.expand(b, h, LEVELS)
    x0, x1, y0, y1 = (t.gather(-1, j) for t, j in ((x, i - 1), (x, i), (y, i - 1), (y, i)))
    return y0 + (p - x0) * (y1 - y0) / (x1 - x0).clamp_min(1e-6)


@register
@dataclass
class CalibratedZip(LearnedZip):
    """`learnedzip` with its prediction mapped per head onto KVzip's score distribution (this probe's)."""

    name = "calibratedzip"

    def fresh_scores(self, keys, values, ctx):
        log = super().fresh_scores(keys, values, ctx).log() / self.sharpen
        return (self.sharpen * through(ctx.layer_idx, log)).exp()


def fit_map(model, tok, count: int) -> tuple[list, list]:
    """Quantile maps from `count` unfitted training pieces; returns the pieces' (predictions, truths)."""
    scorer, head = find(model.config), _opening(tok)
    preds, trues = [], []
    for ids in pieces(tok, corpus(), 1024, 0)[110:110 + count]:
        rows = examples(model, tok, head + ids)
        cut = slice(len(head) + SINKS, len(head) + len(ids) - WINDOW)
        preds.append(torch.stack([scorer.from_features(i, x)[cut] for i, (x, _) in enumerate(rows)]))  # (L, n, h)
        trues.append(torch.stack([y[cut] for _, y in rows]))
    k = torch.linspace(0, 1, LEVELS)
    for key, data in (("xs", preds), ("ys", trues)):
        MAP[key] = torch.quantile(torch.cat(data, 1), k, dim=1).permute(1, 2, 0).contiguous()  # (L, h, K)
    return preds, trues


def shares(scores: list[torch.Tensor], fraction: float) -> torch.Tensor:
    """The share of a global top-`fraction` cut over every layer and head that each layer gets."""
    out = []
    for s in scores:  # (L, n, h)
        flat = s.reshape(-1)
        cut = flat.topk(max(1, round(fraction * flat.numel()))).values[-1]
        out.append((s >= cut).float().sum((1, 2)) / (s >= cut).sum())
    return torch.stack(out).mean(0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=list(CELLS))
    ap.add_argument("--spec", default="learnedzip", help="the method as run (calibratedzip takes its parameters)")
    ap.add_argument("--fit", type=int, default=12, help="unfitted training pieces the quantiles come from")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", default="results/calibration")
    ap.add_argument("--cells", choices=("dev", "ruler-legal"), default="dev",
                    help="the dev split's cells for the model, or R41's needles on the legal haystack")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--budgets", default="0.25,0.1")
    ap.add_argument("--mapped-only", action="store_true", help="run calibratedzip alone (the spec's rows exist)")
    args = ap.parse_args()
    model, tok = kvmerge.load_model(args.model)
    start = time.perf_counter()
    preds, trues = fit_map(model, tok, args.fit)
    mapped = [through_all(p) for p in preds]
    print(f"{args.model}: quantiles from {args.fit} pieces in {time.perf_counter() - start:.0f} s")
    for fraction in (0.25, 0.1):
        rows = {"prediction": shares(preds, fraction), "calibrated": shares(mapped, fraction),
                "KVzip": shares(trues, fraction)}
        print(f"share of a global {fraction:.0%} cut per compressed layer (fitted pieces):")
        for name, s in rows.items():
            print(f"  {name:11} " + " ".join(f"{v:.3f}" for v in s.tolist()))
    from kvmerge_eval.runner import run

    rest = args.spec.partition(":")[2]
    methods = [args.spec] * (not args.mapped_only) + ["calibratedzip" + (f":{rest}" if rest else "")]
    budgets, lengths = [float(b) for b in args.budgets.split(",")], [int(n) for n in args.lengths.split(",")]
    for task, subtasks, genre in CELLS[args.model] if args.cells == "dev" else RULER_LEGAL:
        out = Path(args.out) / args.model / f"{task}-{genre}"
        for row in run(task, model, tok, methods, budgets, lengths, args.samples, out, text=genre,
                       subtasks=subtasks, model_name=args.model):
            print({k: row[k] for k in row if k in ("method", "budget", "task", "score", "n")})


def through_all(p: torch.Tensor) -> torch.Tensor:
    """`through` for every layer at once: `(L, n, h)` predictions → mapped."""
    return torch.stack([through(i, layer.T[None])[0].T for i, layer in enumerate(p)])


if __name__ == "__main__":
    main()
