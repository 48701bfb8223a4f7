"""How much of `echo`'s ranking does a cheap read of it keep? A probe (R51 in docs/research-log.md):

    .venv/bin/python benchmarks/echo_cheap_probe.py smollm2-135m --pieces 4

R50 found `echo` blended into `learnedzip`'s prediction keeps more of SmolLM2's dev needles at 10%,
at 1.7× the prefill's time (every query moved one context on, against every key: n² per query head).
A repeat of the context reads a key i chiefly from the query before it (the copy of token i − 1 asks
for what followed it), so `echo` may be carried by one query per key. Per compressed layer and KV
head, each key i's score from query i − 1 alone (moved one context on, as `echo` moves it), the
highest over the group's query heads, under two normalisations:

* `exact`: the query's log-sum-exp over every key and its own recent 16, as `echo` takes it (n² still:
  says whether the one query carries `echo`'s ranking);
* `sampled`: that log-sum-exp estimated from the first 4 keys and the recent 16 exactly and `--keys`
  other keys drawn at random, their sum scaled to the keys they stand for (O(n · keys)).

Printed per variant: the top-10% and top-25% overlap per head with `echo`, and of the blend
(½ the prediction's log + ½ the variant's) with `echoblendzip`'s blend; and the seconds each took.
Pieces: the training text's pieces 110 on (1,024 tokens, none fitted by the shipped scorer)."""

from __future__ import annotations

import argparse
import time

import torch

import kvmerge
from kvmerge.methods import get_method
from kvmerge.methods.echo import echo_attention
from kvmerge.ops.scores import rotate_half
from kvmerge.scorer import find, unrotate
from kvmerge.session import Session
from kvmerge.train_scorer import _opening, corpus, overlap, pieces

SINKS, OWN, WINDOW = 4, 16, 32


def one_query(q, k, scaling, cos, sin, keys: int | None, g: torch.Generator) -> torch.Tensor:
    """q `(hq, n, d)`, k `(h, n, d)` post-RoPE → `(h, n)`: key i's probability under query i − 1 moved
    by (cos, sin), the most over the group's heads; the log-sum-exp over every key and the query's own
    last `OWN` (`keys` None) or estimated from `keys` sampled ones."""
    hq, n, d = q.shape
    h = k.shape[0]
    gr = hq // h
    moved = q.float() * cos + rotate_half(q.float()) * sin
    kk = k.float().repeat_interleave(gr, 0)  # (hq, n, d)
    prev = moved[:, :-1]  # query i − 1 for key i = 1..n-1
    z_diag = (prev * kk[:, 1:]).sum(-1) * scaling  # (hq, n - 1)
    at = torch.arange(n)
    near = at[:, None] - torch.arange(OWN)  # (n, OWN)
    z_own = torch.einsum("hnd,hnod->hno", q.float(), kk[:, near.clamp(min=0)]) * scaling
    z_own = z_own.masked_fill(near < 0, float("-inf"))
    if keys is None:
        z = moved @ kk.transpose(1, 2) * scaling  # (hq, n, n)
        lse = torch.logaddexp(z.logsumexp(-1), z_own.logsumexp(-1))
    else:
        pick = SINKS + torch.randperm(n - SINKS, generator=g)[:keys]
        z_s = moved @ kk[:, :SINKS].transpose(1, 2) * scaling
        z_r = moved @ kk[:, pick].transpose(1, 2) * scaling
        rest = z_r.logsumexp(-1) + torch.log(torch.tensor((n - SINKS) / len(pick)))
        lse = torch.logaddexp(torch.logaddexp(z_s.logsumexp(-1), rest), z_own.logsumexp(-1))
    p = (z_diag - lse[:, :-1]).exp()
    out = torch.zeros(hq, n)
    out[:, 1:] = p
    return out.view(h, gr, n).amax(1)


def strided(q, k, scaling, cos, sin, stride: int) -> torch.Tensor:
    """`echo` from every `stride`-th query only (exact softmax over every key and its own last `OWN`):
    `(h, n)`, the most any of them in the group gives each key."""
    hq, n, d = q.shape
    h = k.shape[0]
    gr = hq // h
    sel = torch.arange(stride - 1, n, stride)
    moved = (q.float() * cos + rotate_half(q.float()) * sin)[:, sel]
    kk = k.float().repeat_interleave(gr, 0)
    z = moved @ kk.transpose(1, 2) * scaling  # (hq, m, n)
    near = sel[:, None] - torch.arange(OWN)
    z_own = torch.einsum("hmd,hmod->hmo", q.float()[:, sel], kk[:, near.clamp(min=0)]) * scaling
    z_own = z_own.masked_fill(near < 0, float("-inf"))
    lse = torch.logaddexp(z.logsumexp(-1), z_own.logsumexp(-1))
    return (z - lse[..., None]).exp().amax(1).view(h, gr, n).amax(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--pieces", type=int, default=4)
    ap.add_argument("--keys", type=lambda s: [int(x) for x in s.split(",")], default=[128, 512])
    ap.add_argument("--strides", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    scorer = find(model.config)
    head = _opening(tok)
    chosen = pieces(tok, corpus(), 1024, 0)[110:110 + args.pieces]
    g = torch.Generator().manual_seed(0)
    stats, seconds = {}, {}
    for ids in chosen:
        ids = head + ids
        n = len(ids)
        with torch.no_grad():
            session = Session(model, 1, get_method("full"), tok)
            session.feed_prompt([ids], capture=-1)
            rot = session.runtime.rotary
            cos, sin = rot(torch.arange(n))
            c1, s1 = (v[0] for v in rot(torch.tensor([n])))
            for j, i in enumerate(session.cache.compressible):
                q = session.states[i].queries[0].float()  # (hq, n, d) post-RoPE
                k = session.cache.layers[i].keys[0].float()  # (h, n, d)
                d = q.shape[-1]
                pred = scorer.predict(j, unrotate(q[None], cos, sin), unrotate(k[None], cos, sin),
                                      session.cache.layers[i].values[None, 0].float())[0]  # (h, n) log
                t = time.perf_counter()
                echo = echo_attention(q, k, None, d ** -0.5, c1, s1, OWN)
                seconds["echo"] = seconds.get("echo", 0) + time.perf_counter() - t
                variants = {"exact": None, **{f"sampled {m}": m for m in args.keys},
                            **{f"stride {m}": -m for m in args.strides}}
                cut = slice(len(head) + SINKS, n - WINDOW)
                blend_ref = 0.5 * pred + 0.5 * echo.clamp_min(1e-30).log()
                for name, m in variants.items():
                    t = time.perf_counter()
                    v = strided(q, k, d ** -0.5, c1, s1, -m) if m is not None and m < 0 \
                        else one_query(q, k, d ** -0.5, c1, s1, m, g)
                    seconds[name] = seconds.get(name, 0) + time.perf_counter() - t
                    blend = 0.5 * pred + 0.5 * v.clamp_min(1e-30).log()
                    for f in (0.1, 0.25):
                        stats.setdefault((name, "echo", f), []).append(overlap(v[:, cut], echo[:, cut], f))
                        stats.setdefault((name, "blend", f), []).append(overlap(blend[:, cut], blend_ref[:, cut], f))
                for f in (0.1, 0.25):
                    stats.setdefault(("prediction", "blend", f), []).append(overlap(pred[:, cut], blend_ref[:, cut], f))
    for name in ["prediction", "exact", *[f"sampled {m}" for m in args.keys], *[f"stride {m}" for m in args.strides]]:
        row = {what: " / ".join(f"{sum(stats[(name, what, f)]) / len(stats[(name, what, f)]):.3f}" for f in (0.1, 0.25))
               for what in ("echo", "blend") if (name, what, 0.1) in stats}
        print(name, row, f"{seconds.get(name, 0):.1f} s")
    print("echo", f"{seconds['echo']:.1f} s")


if __name__ == "__main__":
    main()
