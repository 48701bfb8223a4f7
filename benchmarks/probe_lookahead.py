"""Lookahead tokens (the design of LookaheadKV and Judge Q, #50's anchors): P learned input embeddings,
appended after the context, pass through the frozen model; at each compressed layer their attention
over the context ranks its entries. Unlike R32's probes they are not fixed vectors in a layer's key
space: each layer's lookahead queries come from hidden states that have read the whole context.

    .venv/bin/python benchmarks/probe_lookahead.py smollm2-135m --tokens 16 --epochs 4

On the KVzip targets cached by benchmarks/probe_cache.py (trained on its `train` pieces, judged on
`held`). The lookahead's score of entry t at a layer and KV head is the most attention any of its P
queries, over the head's query group, gives t (KVzip's reduction over its reconstruction queries).
The embeddings start from KVzip's reconstruction prompt ("Repeat the previous context exactly.",
tiled to P) and train by AdamW on one minus the Pearson correlation with KVzip's log scores, per layer
and head. Rows: the untrained prompt, the trained lookahead, and each of them added to the shipped
scorer's prediction by a second-stage ridge per (layer, head) (`scorer_probe.stage_two`), against the
prediction alone. Printed: top-10% / top-25% overlap with KVzip per head, and top-10% over all heads,
away from the opening, the first 4 and the last 32 tokens; the lookahead's cost against the prefill."""

import argparse
import copy
import time
from pathlib import Path

import torch
from scorer_probe import SINKS, WINDOW, design, stage_two

import kvmerge
from kvmerge.methods.kvzip import KVzip
from kvmerge.scorer import find
from kvmerge.session import Session
from kvmerge.train_scorer import overlap


def lookahead_scores(model, cache, embeds, layers, h, n):
    """Log of the most attention each context entry gets from the lookahead, `(L, n, h)`."""
    out = model(inputs_embeds=embeds[None], cache=copy.deepcopy(cache), use_cache=True, output_attentions=True)
    rows = []
    for i in layers:
        a = out.attentions[i][0, :, :, :n]  # (hq, P, n)
        a = a.reshape(h, -1, n).amax(1)  # over the group's heads and the P queries
        rows.append(a.T.clamp_min(1e-12).log())
    return torch.stack(rows)


def corr_loss(s, y):
    """1 − Pearson correlation over entries, mean over layers and heads: `(L, n, h)` each."""
    s = (s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)
    y = (y - y.mean(1, keepdim=True)) / (y.std(1, keepdim=True) + 1e-6)
    return 1 - (s * y).mean(1).mean()


def judge(scores, trues):
    """Mean over pieces of (top-10% per head, top-25% per head, top-10% over all heads)."""
    cells = []
    for per_head, fraction in ((True, 0.1), (True, 0.25), (False, 0.1)):
        vals = [overlap(s.transpose(1, 2), y.transpose(1, 2), fraction) if per_head
                else overlap(s.reshape(1, -1), y.reshape(1, -1), fraction) for s, y in zip(scores, trues)]
        cells.append(sum(vals) / len(vals))
    return " / ".join(f"{v:.3f}" for v in cells)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--dir", default="/tmp/kvprobe")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--train", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = kvmerge.load_model(args.model)
    model.set_attn_implementation("eager")
    model.requires_grad_(False)
    c = model.config.get_text_config(decoder=True)
    h = c.num_key_value_heads
    layers = list(Session(model, 1, kvmerge.methods.get_method("full"), tok).cache.compressible)
    scorer = find(model.config, "linear")
    folder = Path(args.dir) / args.model

    def load(split, count):
        data = []
        for path in sorted(folder.glob(f"{split}*.pt"), key=lambda p: int(p.stem[len(split):]))[:count]:
            blob = torch.load(path)
            ids, n = blob["ids"], len(blob["ids"])
            with torch.no_grad():
                cache = model(torch.tensor([ids]), use_cache=True).past_key_values
                pred = torch.stack([scorer.from_features(i, x.float()) for i, (x, _) in enumerate(blob["rows"])]).clamp_max(0)
            true = torch.stack([y.float() for _, y in blob["rows"]])
            data.append((cache, n, slice(blob["opening"] + SINKS, n - WINDOW), pred, true))
        return data

    start = time.perf_counter()
    train, held = load("train", args.train), load("held", 10)
    print(f"{args.model}: {len(train)} train pieces, {len(held)} held, {len(layers)} compressed layers, "
          f"{args.tokens} lookahead tokens; loaded in {time.perf_counter() - start:.0f} s", flush=True)
    prompt = tok(KVzip.FIRST, add_special_tokens=False)["input_ids"]
    ids = torch.tensor((prompt * args.tokens)[:args.tokens])
    embeds = torch.nn.Parameter(model.get_input_embeddings()(ids).detach().float().clone())

    def scores(data):
        with torch.no_grad():
            return [lookahead_scores(model, cache, embeds, layers, h, n)[:, cut] for cache, n, cut, _, _ in data]

    cache, n, _, _, _ = held[0]
    with torch.no_grad():
        t0 = time.perf_counter()
        model(torch.tensor([[0] * n]))
        t1 = time.perf_counter()
        lookahead_scores(model, cache, embeds, layers, h, n)
        t2 = time.perf_counter()
    print(f"cost: prefill {t1 - t0:.2f} s, lookahead {t2 - t1:.3f} s (eager attention, {n} tokens)")
    rows = {"the prediction": [p[:, cut] for _, _, cut, p, _ in held]}
    trues = [y[:, cut] for _, _, cut, _, y in held]

    def with_prediction(name):
        fit_s = scores(train)
        w = stage_two([p[:, cut] for _, _, cut, p, _ in train], [y[:, cut] for _, _, cut, _, y in train], [s[..., None] for s in fit_s])
        held_s = scores(held)
        rows[name] = held_s
        rows[f"{name} + the prediction"] = [(design(p[:, cut], s[..., None]).double() * w[:, None]).sum(-1).float()
                                            for (_, _, cut, p, _), s in zip(held, held_s)]

    with_prediction("the prompt, untrained")
    opt = torch.optim.AdamW([embeds], lr=args.lr, weight_decay=0.0)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        total = 0.0
        for j in torch.randperm(len(train)).tolist():
            cache, n, cut, _, y = train[j]
            loss = corr_loss(lookahead_scores(model, cache, embeds, layers, h, n)[:, cut], y[:, cut])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach())
        print(f"epoch {epoch + 1}: loss {total / len(train):.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    with_prediction("trained lookahead")
    print("| scores | top-10% per head / top-25% per head / top-10% all heads |\n|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {judge(s, trues)} |", flush=True)


if __name__ == "__main__":
    main()
