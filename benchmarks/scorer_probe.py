"""What could a cheap scorer add to the shipped learned one? Probes on held-back training text (the
stdlib/Perl pieces `kvmerge train-scorer` did not fit on; no evaluation genre), against KVzip's scores:

    .venv/bin/python benchmarks/scorer_probe.py smollm2-135m
    .venv/bin/python benchmarks/scorer_probe.py gemma3-270m --kind mlp
    .venv/bin/python benchmarks/scorer_probe.py smollm2-135m --judge-text docs   # judged on the dev genre

Each probe is a second-stage ridge per (layer, KV head) on [the scorer's prediction, the probe's
features, 1], fitted on `--fit` pieces and judged on `--judge` others (pieces 110 on, after the 100
fitted and 6 held back by training; 1024 tokens each), or on `--judge` pieces of an
evaluation genre's text (`--judge-text docs`: Python's language reference, the dev genre). Features, all from the one prefill unless said:

* `calibrated`: no features; the prediction mapped per head onto KVzip's score distribution (65
  quantiles of each, fitted pieces): global allocation then gives each head KVzip's typical count;
* `local`: the attention logits q(t+δ)·k(t)/√d, δ = −2..2, of every query head of the key's group;
* `surprisal`: the token's surprisal, its neighbours', and the predictive entropy before it and it;
* `echo`: log of `echo`'s score (the prefill queries moved one context on, attending to every key:
  n² per head, 65–80% of a prefill; not a cheap feature, the probe's ceiling for attention context).

Printed: top-10% and top-25% overlap with KVzip per head (mean over layers and heads) and over all
layers and heads at once (what `alloc=head` ranks), away from the first 4 and last 32 tokens."""

import argparse
import time

import torch

import kvmerge
from kvmerge.methods import get_method
from kvmerge.methods.echo import echo_attention
from kvmerge.ops.scores import rotate_half
from kvmerge.scorer import KINDS, find
from kvmerge.session import Session
from kvmerge.train_scorer import _opening, corpus, examples, overlap, pieces
from kvmerge_eval.corpus import GENRES, genre_text

SINKS, WINDOW, DELTAS = 4, 32, (-2, -1, 0, 1, 2)


def local_logits(q, k):
    """q `(n, hq, d)`, k `(n, h, d)` → `(n, h, g·5)`: q(t+δ)·k(t)/√d, 0 where t+δ is outside."""
    n, h, d = k.shape
    q = q.view(n, h, -1, d)
    out = []
    for s in DELTAS:
        lg = (torch.roll(q, -s, 0) * k[:, :, None]).sum(-1) / d ** 0.5
        if s > 0:
            lg[n - s:] = 0
        elif s < 0:
            lg[:-s] = 0
        out.append(lg)
    return torch.stack(out, -1).reshape(n, h, -1)


def piece_rows(model, tok, ids, scorer, shape):
    """One piece → (prediction `(L, n, h)`, KVzip's log scores `(L, n, h)`, {probe: `(L, n, h, f)`})."""
    hq, h, d = shape
    rows = examples(model, tok, ids)
    n = len(ids)
    with torch.no_grad():
        pred = torch.stack([scorer.from_features(i, x) for i, (x, _) in enumerate(rows)]).clamp_max(0)
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    rotary = Session(model, 1, get_method("full"), tok).runtime.rotary
    cos, sin = rotary(torch.arange(n))
    c1, s1 = (v[0] for v in rotary(torch.tensor([n])))
    local, echo = [], []
    for x, _ in rows:
        q = x[:, :hq * d].view(n, hq, d)
        k = x[:, hq * d:(hq + h) * d].view(n, h, d)
        local.append(local_logits(q, k))
        qr, kr = (z.transpose(0, 1) * cos + rotate_half(z.transpose(0, 1)) * sin for z in (q, k))
        echo.append(echo_attention(qr, kr, None, d ** -0.5, c1, s1, 16).T.clamp_min(1e-12).log()[..., None])
    ids_t = torch.tensor(ids)
    s = torch.zeros(n)
    s[1:] = -logp[:-1].gather(-1, ids_t[1:, None])[:, 0]
    ent = torch.zeros(n)
    ent[1:] = -(logp[:-1].exp() * logp[:-1]).sum(-1)
    surprisal = torch.stack([s, s.roll(-1), s.roll(1), ent, ent.roll(-1)], -1)[None, :, None].expand(len(rows), n, h, 5)
    probes = {"local": torch.stack(local), "surprisal": surprisal, "echo": torch.stack(echo)}
    return pred, torch.stack([y for _, y in rows]), probes


def design(pred, feats):
    """[prediction, features, 1] per entry: `(L, n, h)`, `(L, n, h, f)` → `(L, n, h, f + 2)`."""
    return torch.cat([pred[..., None], feats, torch.ones_like(pred)[..., None]], -1)


def stage_two(preds, trues, feats):
    """Ridge per (layer, head) of KVzip's log score on `design` → weights `(L, h, f + 2)`."""
    x = torch.cat([design(p, f) for p, f in zip(preds, feats)], 1).double()
    y = torch.cat(trues, 1).double()
    w = torch.zeros(x.shape[0], x.shape[2], x.shape[3], dtype=torch.float64)
    for layer in range(x.shape[0]):
        for a in range(x.shape[2]):
            xa, ya = x[layer, :, a], y[layer, :, a]
            reg = torch.eye(xa.shape[1], dtype=xa.dtype) * 1e-2 * (xa * xa).mean()
            reg[-1, -1] = 0
            w[layer, a] = torch.linalg.solve(xa.T @ xa + reg, xa.T @ ya)
    return w


def calibrator(preds, trues, levels=65):
    """Per (layer, head) quantiles of predictions and of KVzip's scores → a monotone map of predictions."""
    k = torch.linspace(0, 1, levels)
    qp, qy = torch.quantile(torch.cat(preds, 1), k, dim=1), torch.quantile(torch.cat(trues, 1), k, dim=1)  # (K, L, h)

    def apply(p):  # (L, n, h), piecewise linear between the quantiles
        xs, ys = qp.permute(1, 2, 0).contiguous(), qy.permute(1, 2, 0).contiguous()  # (L, h, K)
        pt = p.permute(0, 2, 1).contiguous()
        i = torch.searchsorted(xs, pt).clamp(1, levels - 1)
        x0, x1, y0, y1 = (t.gather(-1, j) for t, j in ((xs, i - 1), (xs, i), (ys, i - 1), (ys, i)))
        return (y0 + (pt - x0) * (y1 - y0) / (x1 - x0).clamp_min(1e-6)).permute(0, 2, 1)
    return apply


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--kind", default="linear", choices=KINDS, help="the shipped scorer to probe")
    ap.add_argument("--fit", type=int, default=10)
    ap.add_argument("--judge", type=int, default=10)
    ap.add_argument("--judge-text", default=None, choices=GENRES, help="judge on this evaluation genre's text (docs: the dev genre)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    c = model.config.get_text_config(decoder=True)
    hq, h = c.num_attention_heads, c.num_key_value_heads
    shape = (hq, h, getattr(c, "head_dim", None) or c.hidden_size // hq)
    scorer, head = find(model.config, args.kind), _opening(tok)
    chosen = pieces(tok, corpus(), 1024, 0)[110:110 + args.fit + (0 if args.judge_text else args.judge)]
    if args.judge_text:
        chosen += pieces(tok, [genre_text(args.judge_text)], 1024, 0)[:args.judge]
    start, data = time.perf_counter(), []
    for ids in chosen:
        pred, true, probes = piece_rows(model, tok, head + ids, scorer, shape)
        cut = slice(len(head) + SINKS, pred.shape[1] - WINDOW)
        data.append((pred[:, cut], true[:, cut], {k: v[:, cut] for k, v in probes.items()}))
    print(f"{args.model}, {args.kind} scorer: {len(chosen)} pieces in {time.perf_counter() - start:.0f} s "
          f"(fitted on {args.fit}, judged on {args.judge}{' of ' + args.judge_text if args.judge_text else ''})")
    fit, judge = data[:args.fit], data[args.fit:]
    preds, trues = [p for p, _, _ in fit], [y for _, y, _ in fit]
    cal = calibrator(preds, trues)
    variants = {"prediction": lambda p, f: p, "calibrated": lambda p, f: cal(p), "echo alone": lambda p, f: f["echo"][..., 0]}
    for name in ("local", "surprisal", "echo"):
        w = stage_two(preds, trues, [f[name] for _, _, f in fit])
        variants[f"+ {name}"] = lambda p, f, w=w, name=name: (design(p, f[name]).double() * w[:, None]).sum(-1).float()
    print("| scores | per head top-10% | top-25% | all heads top-10% | top-25% |\n|---|---|---|---|---|")
    for name, score in variants.items():
        cells = []
        for per_head in (True, False):
            for fraction in (0.1, 0.25):
                vals = []
                for p, y, f in judge:
                    s = score(p, f)
                    a, b = (s.transpose(1, 2), y.transpose(1, 2)) if per_head else (s.reshape(1, -1), y.reshape(1, -1))
                    vals.append(overlap(a, b, fraction))
                cells.append(f"{sum(vals) / len(vals):.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
