"""Does R34's lookahead, added to `learnedzip`'s prediction, keep the needles `learnedzip` loses at 10%?
A probe on the dev split (R47 in docs/research-log.md):

    .venv/bin/python benchmarks/lookahead_probe.py fit smollm2-135m --out /tmp/look.pt
    .venv/bin/python benchmarks/lookahead_probe.py dev smollm2-135m --weights /tmp/look.pt

R34 found that KVzip's own prompt ("Repeat the previous context exactly.", tiled to 16 tokens), read
once after the context by the frozen model, adds the most per-head agreement with KVzip of any
single-pass signal on SmolLM2 (+0.045, at 4–8% of the prefill), through a second-stage ridge per layer
and KV head on [the prediction, the lookahead's log score, 1]; its answers were never run.

`lookzip` runs that lookahead as a second pass of 16 tokens (`runtime.probe`): an entry's lookahead
score in a KV head is the most attention any of the 16 queries of the head's group gives it, the
softmax over the whole context and the probe's own keys (KVzip's reduction). Its log score per layer
and head is w0 · prediction + w1 · lookahead + w2, the weights fitted by `fit` against KVzip's log
scores on training pieces 120–143, which the shipped scorer never fitted, then judged on pieces
100–105 (held back from it). One-shot prefill only (a probe).

`dev` runs `learnedzip` and `lookzip` on the dev needles (kvmerge's RULER-style task on the legal
haystack, 4k, 12 samples) and the dev facts of one template (docs, 2k, 10 samples), 25% and 10%; rows
in `results/lookahead/<model>/`."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from dev_cells import add_arguments, run_cells
from probe_lookahead import judge
from scorer_probe import SINKS, WINDOW, design, stage_two

import kvmerge
from kvmerge.methods.base import Needs
from kvmerge.methods.kvzip import KVzip, _live_slots, reconstruction_attention
from kvmerge.methods.learnedzip import LearnedZip
from kvmerge.methods.registry import register



@register
@dataclass
class LookZip(LearnedZip):
    """`learnedzip` whose log score is w0 · prediction + w1 · lookahead + w2 per layer and KV head
    (`weights`: a file of `(layers, h, 3)`; empty: the prediction alone, the lookahead kept in
    `runtime.scratch(i)["_look"]` for `fit`)."""

    weights: str = ""
    tokens: int = 16
    name = "lookzip"
    requires = Needs(queries=-1, rotary=True, tokenizer=True, second_pass=True)

    def setup(self, runtime):
        super().setup(runtime)
        ids = runtime.tokenizer(KVzip.FIRST, add_special_tokens=False)["input_ids"]
        self._probe = (list(ids) * self.tokens)[:self.tokens]
        self._w = torch.load(self.weights) if self.weights else None

    def prepare(self, runtime, token_rows, layers):
        if token_rows is None or len(token_rows) != 1:
            raise ValueError("lookzip is a one-row probe")
        found = {}

        def listen(i, query, layer):
            q = query.shape[2]
            slots = _live_slots(layer, layer.entries - q)[0]
            own = torch.arange(layer.entries - q, layer.entries, device=slots.device)
            picked = torch.cat([slots, own])
            log_n = None if layer.log_n is None else layer.log_n[0][:, picked]
            found[i] = reconstruction_attention(query[0], layer.keys[0][:, picked], log_n, 0,
                                                runtime.scaling).clamp_min(1e-12).log()  # (h, n)

        runtime.probe([self._probe], listen)
        for i in layers:
            runtime.scratch(i)["_look"] = found[i]

    def fresh_scores(self, keys, values, ctx):
        learned = super().fresh_scores(keys, values, ctx)  # (b, h, fresh)
        if self._w is None:
            return learned
        look = ctx.state.scratch["_look"]
        if look.shape[-1] != learned.shape[-1]:
            raise ValueError("lookzip is a one-shot probe")
        w = self._w[ctx.layer_idx].to(learned.device, torch.float32)  # (h, 3)
        log = w[None, :, 0, None] * learned.log() + w[None, :, 1, None] * look[None].to(learned.device) + w[None, :, 2, None]
        return log.clamp_max(0.0).exp()


@torch.no_grad()
def _piece(model, tok, ids, method):
    """Per compressed layer: (prediction, lookahead, KVzip) log scores `(n, h)` of one piece."""
    from kvmerge.session import Session
    from kvmerge.train_scorer import examples

    session = Session(model, 1, method, tok)
    session.feed_prompt([ids], capture=-1)
    layers = list(session.cache.compressible)
    method.prepare_all(session.runtime, [ids], layers)
    looks = [session.runtime.scratch(i)["_look"].float().T for i in layers]
    out = []
    for j, (x, y) in enumerate(examples(model, tok, ids)):
        pred = method._scorer.from_features(j, x.float()).clamp_max(0.0)
        out.append((pred, looks[j], y))
    return out


def _stack(rows, cut):
    return [torch.stack([r[k][cut] for r in rows]) for k in range(3)]  # each (L, n', h)


def fit(args):
    from kvmerge.methods import get_method
    from kvmerge.train_scorer import _opening, corpus, pieces

    model, tok = kvmerge.load_model(args.model)
    method = get_method("lookzip")
    all_pieces = pieces(tok, corpus(), 1024, 0)
    head = _opening(tok)
    start = time.perf_counter()

    def gather(chosen):
        data = []
        for ids in chosen:
            rows = _piece(model, tok, head + ids, method)
            data.append(_stack(rows, slice(len(head) + SINKS, len(head) + len(ids) - WINDOW)))
            print(f"piece {len(data)}/{len(chosen)} ({time.perf_counter() - start:.0f} s)", flush=True)
        return data

    train, held = gather(all_pieces[120:120 + args.train]), gather(all_pieces[100:106])
    w = stage_two([p for p, _, _ in train], [t for _, _, t in train], [s[..., None] for _, s, _ in train])  # (L, h, 3)
    torch.save(w.float(), args.out)
    print(f"weights {tuple(w.shape)} → {args.out}; w0 mean {w[..., 0].mean():.3f}, w1 mean {w[..., 1].mean():.3f}")
    scores = {"the prediction": [p for p, _, _ in held], "the lookahead": [s for _, s, _ in held],
              "both (fitted)": [(design(p, s[..., None]) * w.float()[:, None]).sum(-1) for p, s, _ in held]}
    for name, rows in scores.items():
        print(f"| {name} | {judge(rows, [t for _, _, t in held])} |", flush=True)


def dev(args):
    model, tok = kvmerge.load_model(args.model)
    methods = [f"lookzip:weights={args.weights}" if m == "lookzip" else m for m in args.methods.split(",")]
    run_cells(model, tok, args.model, methods, args.budgets, args.out, args.first, args.cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["fit", "dev"])
    ap.add_argument("model")
    ap.add_argument("--train", type=int, default=24)
    ap.add_argument("--out", default="/tmp/look.pt")
    ap.add_argument("--weights", default="/tmp/look.pt")
    add_arguments(ap, "learnedzip,lookzip")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.step == "fit":
        fit(args)
    else:
        if args.out == "/tmp/look.pt":
            args.out = "results/lookahead"
        dev(args)


if __name__ == "__main__":
    main()
