"""How far KVzip agrees with itself: its per-head top-k picks under variants that are all "KVzip" (a
shorter reconstruction chunk, KVzip+'s normalisation, a reworded reconstruction prompt), beside the
learned scorers' agreement with it, on the pieces no shipped scorer fitted (docs/research-log.md R40):

    .venv/bin/python benchmarks/kvzip_self_agreement.py smollm2-135m [--pieces 10] [--threads 1]

Per variant: the mean over pieces of the top-10% and top-25% overlap per KV head with `kvzip` as
kvmerge runs it (chunk 2048: each 1,024-token piece reconstructed at once), judged as
`kvmerge train-scorer` judges its agreement (not the opening, the first 4 entries or the last 32)."""

import argparse
import time

import torch

import kvmerge
from kvmerge.scorer import find
from kvmerge.train_scorer import _opening, examples, overlap
from probe_cache import held_split

SINKS, WINDOW = 4, 32
VARIANTS = {
    "chunk=512": ("kvzip:chunk=512", None),
    "chunk=256": ("kvzip:chunk=256", None),
    "KVzip+": ("kvzip:plus=true", None),
    "reworded prompt": ("kvzip", "\n\nCopy the text above word for word."),
}


@torch.no_grad()
def kvzip_logs(model, tok, ids, spec, prompt=None):
    """Per compressed layer: log KVzip scores `(n, h)` for the context `ids` under `spec`."""
    method = kvmerge.get_method(spec)
    if prompt is not None:
        method.FIRST = prompt  # the reconstruction's opening line, reworded
    session = kvmerge.Session(model, 1, method, tok)
    session.feed_prompt([ids])
    layers = list(session.cache.compressible)
    method.prepare_all(session.runtime, [ids], layers)
    return [session.runtime.scratch(i)["_kvzip_fresh"][0].float().T.clamp_min(1e-12).log() for i in layers]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model")
    ap.add_argument("--pieces", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    head = _opening(tok)
    held = held_split(tok)[:args.pieces]
    scorers = {}
    for kind in ("linear", "mlp"):
        try:
            scorers[f"learnedzip ({kind})"] = find(model.config, kind)
        except Exception as e:  # noqa: BLE001 -- a kind without shipped weights is left out
            print(f"no {kind} scorer: {e}")
    found = {name: {0.1: [], 0.25: []} for name in [*VARIANTS, *scorers]}
    start = time.perf_counter()
    for j, piece in enumerate(held):
        ids = head + piece
        rows = examples(model, tok, ids)  # features and kvzip's own log scores
        ref = torch.stack([y for _, y in rows])  # (layers, n, h)
        cut = slice(len(head) + SINKS, ref.shape[1] - WINDOW)
        other = {name: torch.stack(kvzip_logs(model, tok, ids, spec, prompt)) for name, (spec, prompt) in VARIANTS.items()}
        for name, scorer in scorers.items():
            other[name] = torch.stack([scorer.calibrated(i, scorer.from_features(i, x)) for i, (x, _) in enumerate(rows)])
        for name, x in other.items():
            for fraction in (0.1, 0.25):
                found[name][fraction].append(overlap(x[:, cut].transpose(1, 2), ref[:, cut].transpose(1, 2), fraction))
        print(f"piece {j + 1}/{len(held)} ({time.perf_counter() - start:.0f} s)", flush=True)
    print(f"\n{args.model}, {len(held)} held-back pieces of 1,024 tokens: per-head overlap with kvzip, top-10% / top-25%")
    for name, by in found.items():
        print(f"  {name:22s} {sum(by[0.1]) / len(by[0.1]):.3f} / {sum(by[0.25]) / len(by[0.25]):.3f}")


if __name__ == "__main__":
    main()
