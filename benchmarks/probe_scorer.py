"""Which context-wide signal, cheap enough for one pass, adds to the learned scorer's per-token features?
Ridge regressions per compressed layer on KVzip targets cached by benchmarks/probe_cache.py, fitted on
its `train` pieces and judged on its `held` ones (stdlib/Perl text, 1024 tokens after the chat opening):

    .venv/bin/python benchmarks/probe_cache.py smollm2-135m --train 24 --dev 0
    .venv/bin/python benchmarks/probe_scorer.py smollm2-135m

Feature sets (each = the learned scorer's features, pre-RoPE queries, keys and values, plus extras per
KV head; extras cost O(P·n·d) per head, P probes):

* `base`: none (learnedzip's ridge);
* `meanq`: each query head's mean pre-RoPE query over the context as a probe: log-softmax over the
  context's keys of q̄·k/√d (a direction the context chooses, normalised by its competition);
* `kmeans`: `--probes` k-means centroids of the KV head's pre-RoPE queries: log Σ_p softmax_p and
  max_p log softmax_p over the context's keys;
* `stride`: `--probes` of the context's own queries at evenly spaced positions, rotated, attending
  causally: the log of the most attention each key gets from them (echo on a sample of queries);
* `ngram`: per token, how often its token and its n-grams occur in the context (`ngrams`);
* `all`: the four together; `a+b`: any two;
* `SET@next`, `SET@prev`, `SET@last`: SET plus the same token's features in the next compressed layer,
  the one before, or the last (the deeper layers' read of the token: free where compression waits for
  the forward's end); `SET@left`, `SET@right`: SET plus the features of the token before or after.

`--target` is what is fitted: `log`, KVzip's log scores; `clip:Q`, each head's log scores in each
piece floored at their Q-quantile (the fit spends nothing on the order below the cut's region);
`rank`, each head's rank quantile in its piece (0 to 1; per-head order only, no scale across heads);
`pow:K`, that quantile to the power K; `normal`, it through the normal's inverse CDF.
Judged against the log scores either way.

`--kind mlp` fits one hidden layer of GELUs per layer (as `kvmerge train-scorer --kind mlp`) on the
same rows instead of the ridge.

Printed: top-10% and top-25% overlap with KVzip per head (mean over layers and heads) and over all
layers and heads at once (what `alloc=head` ranks), away from the first 4 and last 32 tokens; the
last also after mapping each head's predictions onto KVzip's log-score quantiles (65, from 12 of the
training pieces; R35's map), which leaves each head's order as it is."""

import argparse
import time
from pathlib import Path

import torch

import kvmerge
from kvmerge.ops.scores import rotate_half
from kvmerge.session import Session
from kvmerge.train_scorer import fit, fit_mlp, overlap

SINKS, WINDOW = 4, 32


def split(x, hq, h, d):
    n = x.shape[0]
    q, k = x[:, :hq * d].view(n, hq, d), x[:, hq * d:(hq + h) * d].view(n, h, d)
    return q.float(), k.float()


def meanq(q, k):
    """q `(n, hq, d)`, k `(n, h, d)` → `(n, h, g)`: log-softmax over n of k·mean(q)/√d per query head."""
    n, h, d = k.shape
    qbar = q.mean(0).view(h, -1, d)  # (h, g, d)
    s = torch.einsum("nhd,hgd->nhg", k, qbar) / d ** 0.5
    return s.log_softmax(0)


def kmeans(q, k, probes, iters=6):
    """`(n, h, 2)`: log Σ_p softmax_p(k) and max_p log softmax_p(k), p over `probes` centroids of the
    KV head's queries (pre-RoPE, init at evenly spaced tokens)."""
    n, h, d = k.shape
    g = q.shape[1] // h
    out = []
    for i in range(h):
        pts = q[:, i * g:(i + 1) * g].reshape(-1, d)
        c = pts[torch.linspace(0, len(pts) - 1, probes).long()].clone()
        for _ in range(iters):
            a = torch.cdist(pts, c).argmin(1)
            c = torch.zeros_like(c).index_add_(0, a, pts) / torch.bincount(a, minlength=probes).clamp_min(1)[:, None]
        ls = (k[:, i] @ c.T / d ** 0.5).log_softmax(0)  # (n, P)
        out.append(torch.stack([ls.logsumexp(1), ls.amax(1)], -1))
    return torch.stack(out, 1)


def stride(q, k, probes, cos, sin):
    """`(n, h, 2)`: log of the most and of the summed attention each key gets from `probes` of the
    context's queries at evenly spaced positions (all query heads of its group), rotated, causal."""
    n, h, d = k.shape
    g = q.shape[1] // h
    t = torch.linspace(n // probes, n - 1, probes).long()
    qr = q[t] * cos[t, None] + rotate_half(q[t]) * sin[t, None]  # (P, hq, d)
    kr = k * cos[:, None] + rotate_half(k) * sin[:, None]
    s = torch.einsum("phd,nhd->hpn", qr.view(probes, h, g, d).reshape(probes, h * g, d),
                     kr.repeat_interleave(g, 1)) / d ** 0.5  # (hq, P, n)
    s = s.masked_fill(torch.arange(n)[None, :] > t[:, None], float("-inf")).softmax(-1)
    s = s.view(h, g * probes, n)
    return torch.stack([s.amax(1), s.sum(1)], -1).transpose(0, 1).clamp_min(1e-12).log()


def ngrams(ids):
    """`(n, 6)`: log(1 + how often) the token, the one before, the one after, the pair ending and the
    pair starting with it, and the triple ending with it occur in the context (O(n), no attention)."""
    from collections import Counter

    ids = list(ids)
    n = len(ids)
    prev = [None] + ids[:-1]
    nxt = ids[1:] + [None]
    prev2 = [None, None] + ids[:-2]
    grams = [ids, prev, nxt, list(zip(prev, ids)), list(zip(ids, nxt)), list(zip(prev2, prev, ids))]
    cols = []
    for g in grams:
        count = Counter(g)
        cols.append([count[x] for x in g])
    return torch.tensor(cols, dtype=torch.float32).T.log1p().view(n, 6)


def extras(name, q, k, probes, cos, sin, ids):
    parts = {"meanq": lambda: meanq(q, k), "kmeans": lambda: kmeans(q, k, probes),
             "stride": lambda: stride(q, k, probes, cos, sin), "ngram": lambda: ngrams(ids)}
    names = list(parts) if name == "all" else [] if name == "base" else name.split("+")
    n = k.shape[0]
    return torch.cat([parts[p]().reshape(n, -1) for p in names], -1) if names else k.new_zeros(n, 0)


def target(y, how):
    """Log scores `(n, h)` → what is fitted (`--target`), per head over this piece's tokens."""
    if how == "log":
        return y
    if how == "rank":
        return y.argsort(0).argsort(0).float() / (len(y) - 1)
    if how == "normal":  # the rank quantile through the normal's inverse CDF
        u = (y.argsort(0).argsort(0).float() + 0.5) / len(y)
        return torch.special.ndtri(u)
    if how.startswith("pow:"):
        return (y.argsort(0).argsort(0).float() / (len(y) - 1)) ** float(how[4:])
    if how.startswith("clip:"):
        return torch.maximum(y, y[SINKS:].quantile(float(how[5:]), dim=0))
    raise ValueError(f"unknown target {how!r}")


def rows(path, name, shape, probes, rotary):
    hq, h, d = shape
    blob = torch.load(path)
    n = len(blob["ids"])
    cos, sin = (t.float() for t in rotary(torch.arange(n)))
    layers, own = blob["rows"], name.split("@")[0]
    out = []
    for i, (x, y) in enumerate(layers):
        q, k = split(x, hq, h, d)
        e = extras(own, q, k, probes, cos, sin, blob["ids"])
        other = [layers[j][0].float() for j in other_layers(name, i, len(layers))]
        shift = {"left": 1, "right": -1}.get(name.partition("@")[2])
        if shift:  # the neighbour's own features: the token before (left) or after (right), zeros past the ends
            other = [torch.roll(x.float(), shift, 0).index_fill_(0, torch.tensor([0 if shift > 0 else n - 1]), 0)]
        out.append((torch.cat([x.float(), e, *other, torch.ones(n, 1)], -1), y.float()))
    return out


def other_layers(name: str, i: int, count: int) -> list[int]:
    """`set@next`, `set@prev`, `set@last`: the features of that other compressed layer's token too (the
    next layer's, the one before's, the last's; itself where there is none other)."""
    where = name.partition("@")[2]
    if not where:
        return []
    if where in ("left", "right"):
        return []
    j = {"next": min(i + 1, count - 1), "prev": max(i - 1, 0), "last": count - 1}[where]
    return [j] if j != i else []


def predict(x, w):
    """Rows `(n, F)` → `(n, h)` log scores: ridge weights `(F, h)`, or an MLP's parameters (`fit_mlp`)."""
    if isinstance(w, torch.Tensor):
        return x @ w
    hidden = torch.nn.functional.gelu(((x - w["mu"]) / w["sd"]) @ w["w1"] + w["b1"])
    return hidden @ w["w2"] + w["b2"]


def mapped(p, xs, ys):
    """Predictions `(L, h, n)` → mapped per layer and head onto KVzip's log-score quantiles: piecewise
    linear from the prediction's quantiles `xs` `(L, h, K)` to the scores' `ys` (a monotone map)."""
    i = torch.searchsorted(xs.contiguous(), p.contiguous()).clamp(1, xs.shape[-1] - 1)
    x0, x1, y0, y1 = (t.gather(-1, j) for t, j in ((xs, i - 1), (xs, i), (ys, i - 1), (ys, i)))
    return y0 + (p - x0).clamp(min=0) * (y1 - y0) / (x1 - x0).clamp_min(1e-6)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--dir", default="/tmp/kvprobe")
    ap.add_argument("--sets", default="base,meanq,kmeans,stride,all")
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--ridge", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kind", choices=("linear", "mlp"), default="linear",
                    help="ridge, or one hidden layer of GELUs (as `train-scorer --kind mlp`)")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--targets", default="log", help="comma list of log, clip:Q, rank, pow:K, normal")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    c = model.config.get_text_config(decoder=True)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = (c.num_attention_heads, c.num_key_value_heads, d)
    rotary = Session(model, 1, None, tok).runtime.rotary
    folder = Path(args.dir) / args.model
    train = sorted(folder.glob("train*.pt"))
    held = sorted(folder.glob("held*.pt"))
    print(f"{args.model}: {len(train)} train pieces, {len(held)} held, {args.probes} probes, "
          + (f"MLP of {args.hidden}, {args.epochs} epochs" if args.kind == "mlp" else f"ridge {args.ridge}"))
    print("| features | target | extra columns | top-10% per head | top-25% per head | top-10% all heads | the same, mapped | time s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, how in [(n, t) for n in args.sets.split(",") for t in args.targets.split(",")]:
        start = time.perf_counter()
        if args.kind == "mlp":  # every training row in memory, per layer
            parts = [rows(path, name, shape, args.probes, rotary) for path in train]
            layers = [(torch.cat([p[i][0] for p in parts]), torch.cat([target(p[i][1], how) for p in parts]))
                      for i in range(len(parts[0]))]
            width = layers[0][0].shape[1]
            weights = fit_mlp(layers, args.hidden, args.epochs, seed=0)
            del parts, layers
        else:
            sums = None
            for path in train:
                part = [(x.T.double() @ x.double(), x.T.double() @ target(y, how).double()) for x, y in rows(path, name, shape, args.probes, rotary)]
                sums = part if sums is None else [(a + p, b + r) for (a, b), (p, r) in zip(sums, part)]
            weights, width = fit(sums, args.ridge), sums[0][0].shape[0]
        o10, o25, og, oc = [], [], [], []
        levels = torch.linspace(0, 1, 65)
        fitted = [[], []]  # the training pieces' predictions and log scores, per layer `(h, n')`
        for path in train[:12]:
            for i, ((x, y), w) in enumerate(zip(rows(path, name, shape, args.probes, rotary), weights)):
                for j, v in enumerate((predict(x, w), y)):
                    if len(fitted[j]) <= i:
                        fitted[j].append([])
                    fitted[j][i].append(v[SINKS:-WINDOW].T)
        qs = [torch.stack([torch.quantile(torch.cat(v, 1), levels, dim=1).T for v in f]) for f in fitted]  # (L, h, 65)
        for path in held:
            pred, true = [], []
            for (x, y), w in zip(rows(path, name, shape, args.probes, rotary), weights):
                pred.append(predict(x, w)[SINKS:-WINDOW].T)
                true.append(y[SINKS:-WINDOW].T)
            p, t = torch.stack(pred), torch.stack(true)  # (L, h, n')
            o10.append(overlap(p, t, 0.10))
            o25.append(overlap(p, t, 0.25))
            og.append(overlap(p.reshape(1, -1), t.reshape(1, -1), 0.10))
            oc.append(overlap(mapped(p, *qs).reshape(1, -1), t.reshape(1, -1), 0.10))
        extra = width - 1 - c.num_attention_heads * d - 2 * shape[1] * d  # varies by layer with @: the first's
        mean = lambda v: sum(v) / len(v)  # noqa: E731
        print(f"| {name} | {how} | {extra} | {mean(o10):.3f} | {mean(o25):.3f} | {mean(og):.3f} | {mean(oc):.3f} | "
              f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
