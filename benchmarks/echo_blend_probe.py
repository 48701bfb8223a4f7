"""Does `echo`'s context-wide attention, blended into `learnedzip`'s prediction, keep Gemma-3's facts
at 10%? A probe on the dev split (R44 in docs/research-log.md):

    .venv/bin/python benchmarks/echo_blend_probe.py gemma3-270m --spec learnedzip:sliding=0.75

R30 found `echo` (every prefill query moved one context on, attending to every key) the one signal
that adds to the learned prediction, and on Gemma-3 it ranks entries across its three compressed
layers far better than the prediction (top-10% over all heads 0.874 against 0.459). There only three
layers are compressed, so it costs 9% / 15% of the prefill at 2k / 8k (performance.md), not the
65–80% it costs on SmolLM2. `echoblendzip` scores each entry exp((1 − mix) · the prediction's log +
mix · echo's log); both are logs of an attention probability, on one scale. One-shot prefill only.
Runs `learnedzip` and `echoblendzip` on the dev split's cells for the model (as
benchmarks/calibration_probe.py; 2k, 10 samples, 25% and 10%); rows in `results/echoblend/<model>/`."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

import kvmerge
from kvmerge.methods.echo import echo_attention
from kvmerge.methods.learnedzip import LearnedZip
from kvmerge.methods.registry import register


@register
@dataclass
class EchoBlendZip(LearnedZip):
    """`learnedzip` whose log score is blended with `echo`'s (this probe's; one-shot prefill)."""

    mix: float = 0.5
    own: int = 16
    name = "echoblendzip"

    def scores(self, keys, log_n, ctx):
        learned = self.fresh_scores(keys, ctx.values, ctx)  # (b, h, fresh)
        fresh = learned.shape[-1]
        if fresh != keys.shape[2]:
            raise ValueError("echoblendzip is a one-shot probe")
        cos, sin = (x[0] for x in self._rotary(torch.tensor([ctx.seen])))
        echo = torch.stack([echo_attention(ctx.queries[b, :, ctx.queries.shape[2] - fresh:], keys[b],
                                           None if log_n is None else log_n[b], ctx.scaling, cos, sin, self.own)
                            for b in range(keys.shape[0])])
        blended = (1 - self.mix) * learned.log() + self.mix * echo.clamp_min(1e-30).log().to(learned.device)
        return self.with_carried(blended.exp(), keys.shape[2], ctx)


def main():
    from calibration_probe import CELLS

    from kvmerge_eval.runner import run

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=list(CELLS))
    ap.add_argument("--spec", default="learnedzip", help="the baseline as run (echoblendzip takes its parameters)")
    ap.add_argument("--mix", type=float, default=0.5)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--out", default="results/echoblend")
    args = ap.parse_args()
    model, tok = kvmerge.load_model(args.model)
    rest = args.spec.partition(":")[2]
    blend = f"echoblendzip:mix={args.mix}" + (f":{rest}" if rest else "")
    for task, subtasks, genre in CELLS[args.model]:
        out = Path(args.out) / args.model / f"{task}-{genre}"
        for row in run(task, model, tok, [args.spec, blend], [0.25, 0.1], [2048], args.samples, out, text=genre,
                       subtasks=subtasks, model_name=args.model):
            print({k: row[k] for k in row if k in ("method", "budget", "task", "subtask", "score", "n")}, flush=True)


if __name__ == "__main__":
    main()
