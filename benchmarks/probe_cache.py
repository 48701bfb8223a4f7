"""KVzip targets and features per piece, cached on disk for scorer experiments (benchmarks/probe_scorer.py,
docs/research-log.md R31):

    .venv/bin/python benchmarks/probe_cache.py smollm2-135m --train 40

Writes `<dir>/<model>/<split><i>.pt`: per compressed layer (features `(n, F)` float16, log KVzip
scores `(n, h)` float32), the context `ids` and the opening's length, from `kvmerge.train_scorer.examples`.
Splits: `docs` (the dev genre's first `--dev` pieces), `held` (training pieces 100–105 and 110–113:
neither the shipped scorers nor `--train` fitted them), `train` (pieces 0 on). Existing files are kept."""

import argparse
import time
from pathlib import Path

import torch

import kvmerge
from kvmerge.train_scorer import _opening, corpus, examples, pieces
from kvmerge_eval.corpus import genre_text


def held_split(tok) -> list[list[int]]:
    """Training pieces 100–105 and 110–113 of 1,024 tokens: neither the shipped scorers nor `--train` fitted them."""
    train = pieces(tok, corpus(), 1024, 0)
    return train[100:106] + train[110:114]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--train", type=int, default=40)
    ap.add_argument("--dev", type=int, default=10)
    ap.add_argument("--dir", default="/tmp/kvprobe")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    head = _opening(tok)
    splits = [("docs", pieces(tok, [genre_text("docs")], 1024, 0)[:args.dev]),
              ("held", held_split(tok)), ("train", pieces(tok, corpus(), 1024, 0)[:args.train])]
    out = Path(args.dir) / args.model
    out.mkdir(parents=True, exist_ok=True)
    for split, chosen in splits:
        for i, ids in enumerate(chosen):
            path = out / f"{split}{i}.pt"
            if path.exists():
                continue
            start = time.perf_counter()
            rows = examples(model, tok, head + ids)
            tmp = path.with_suffix(".tmp")
            torch.save({"rows": [(x.half(), y) for x, y in rows], "ids": head + ids, "opening": len(head)}, tmp)
            tmp.rename(path)
            print(f"{path} {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
