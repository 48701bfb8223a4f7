"""Learned probe queries, trained end to end (#50's proposed design), against the ridge scorer alone, on
the KVzip targets cached by benchmarks/probe_cache.py (fit on its `train` pieces, judged on `held`):

    .venv/bin/python benchmarks/probe_train.py smollm2-135m --probes 16

Per compressed layer and KV head, P probe vectors in the pre-RoPE key space; each probe's attention
over the context's keys, g_p(n) = log softmax_n(k_n·w_p/√d), is read through
c · log Σ_p exp(g_p(n) + b_p) + Σ_p a_p g_p(n) and added to the ridge prediction. The probe term is the
only part that is not linear in the token's own features: a key ranks high when some probe picks it
out against the rest of this context. Trained with AdamW from the ridge solution (ridge weights
trainable too), on mean squared error of the log score (`--loss mse`) or on binary cross-entropy at
each head's top 10% (`--loss cut`). The `ridge+adam` row trains the same way without probes, so that
the probes' gain is not the optimiser's.

Printed: top-10% and top-25% overlap with KVzip per head (mean over layers and heads), away from the
first 4 and last 32 tokens, and the training time."""

import argparse
import time
from pathlib import Path

import torch

from kvmerge.train_scorer import fit, overlap

SINKS, WINDOW = 4, 32


def load(paths, layer, hq, h, d):
    """Per piece: (features with a 1 appended `(n, F + 1)`, pre-RoPE keys `(n, h, d)`, log scores `(n, h)`)."""
    out = []
    for blob in paths:
        x, y = blob["rows"][layer]
        x = x.float()
        n = x.shape[0]
        out.append((torch.cat([x, torch.ones(n, 1)], -1), x[:, hq * d:(hq + h) * d].view(n, h, d), y.float()))
    return out


class Probes(torch.nn.Module):
    def __init__(self, w0, h, d, probes, keys):
        super().__init__()
        self.w = torch.nn.Parameter(w0.clone())
        self.p = torch.nn.Parameter(keys[torch.randperm(len(keys), generator=torch.Generator().manual_seed(0))[:probes]]
                                    .permute(1, 0, 2).clone() if probes else torch.zeros(h, 0, d))
        self.a = torch.nn.Parameter(torch.zeros(h, probes))
        self.b = torch.nn.Parameter(torch.zeros(h, probes))
        self.c = torch.nn.Parameter(torch.zeros(h))
        self.d = d

    def forward(self, x, k):
        y = x @ self.w
        if self.p.shape[1]:
            g = (torch.einsum("nhd,hpd->nhp", k, self.p) / self.d ** 0.5).log_softmax(0)
            y = y + (g * self.a).sum(-1) + self.c * (g + self.b).logsumexp(-1)
        return y


def loss_of(pred, y, kind):
    core = slice(SINKS, -WINDOW)
    if kind == "mse":
        return ((pred - y)[core] ** 2).mean()
    yc, pc = y[core], pred[core]
    top = (yc >= yc.quantile(0.9, dim=0, keepdim=True)).float()
    return torch.nn.functional.binary_cross_entropy_with_logits(pc - pc.quantile(0.9, dim=0, keepdim=True).detach(), top)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--dir", default="/tmp/kvprobe")
    ap.add_argument("--probes", type=int, default=16)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--loss", default="mse", choices=("mse", "cut"))
    ap.add_argument("--ridge", type=float, default=1e-2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    folder = Path(args.dir) / args.model
    train = [torch.load(p) for p in sorted(folder.glob("train*.pt"))]
    held = [torch.load(p) for p in sorted(folder.glob("held*.pt"))]
    from transformers import AutoConfig

    from kvmerge.model import cache_dir
    c = AutoConfig.from_pretrained(cache_dir() / args.model).get_text_config(decoder=True)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    hq, h = c.num_attention_heads, c.num_key_value_heads
    layers = len(train[0]["rows"])
    print(f"{args.model}: {len(train)} train pieces, {len(held)} held, {layers} layers, {args.probes} probes, "
          f"loss {args.loss}, {args.steps} steps")
    print("| scorer | top-10% per head | top-25% per head | time s |")
    print("|---|---|---|---|")
    for name, probes, steps in (("ridge", 0, 0), ("ridge+adam", 0, args.steps), ("ridge+probes", args.probes, args.steps)):
        start, o10, o25 = time.perf_counter(), [[] for _ in held], [[] for _ in held]
        for layer in range(layers):
            rows = load(train, layer, hq, h, d)
            sums = [(sum(x.T.double() @ x.double() for x, _, _ in rows), sum(x.T.double() @ y.double() for x, _, y in rows))]
            w0 = fit(sums, args.ridge)[0]
            net = Probes(w0, h, d, probes, torch.cat([k for _, k, _ in rows]))
            if steps:
                opt = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0)
                for _ in range(steps):
                    opt.zero_grad()
                    loss = sum(loss_of(net(x, k), y, args.loss) for x, k, y in rows) / len(rows)
                    loss.backward()
                    opt.step()
            with torch.no_grad():
                for i, (x, k, y) in enumerate(load(held, layer, hq, h, d)):
                    p = net(x, k)[SINKS:-WINDOW].T
                    t = y[SINKS:-WINDOW].T
                    o10[i].append(overlap(p, t, 0.10))
                    o25[i].append(overlap(p, t, 0.25))
        mean = lambda v: sum(sum(r) / len(r) for r in v) / len(v)  # noqa: E731
        print(f"| {name} | {mean(o10):.3f} | {mean(o25):.3f} | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
