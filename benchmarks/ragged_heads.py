"""Per-head allocation stored two ways, side by side in one run: each KV head at its own length
(`MergedLayer.compact`, what kvmerge does) against every head padded to its layer's widest (compaction
switched off). Prints the cache's bytes against the full cache's, the decode step's time (the two
alternated, median of rounds, so the machine's noise hits both alike) and the largest logit gap.

    .venv/bin/python benchmarks/ragged_heads.py --length 2048 --budgets 0.25,0.1 --method snapkv:alloc=head
"""

import argparse
import time
from contextlib import nullcontext
from unittest import mock

import torch

import kvmerge
from kvmerge import Session
from kvmerge.layer import MergedLayer
from kvmerge_eval.niah import haystack


def compressed(model, tok, ids, spec, budget, padded):
    method = kvmerge.get_method(spec, budget)
    session = Session(model, 1, method, tok)
    with mock.patch.object(MergedLayer, "compact", lambda self: False) if padded else nullcontext():
        logits = session.prefill([ids], method.window)
    return session, logits


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--budgets", default="0.25,0.1")
    p.add_argument("--method", default="snapkv:alloc=head")
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 beside another job on 2 cores)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    ids = tok(" ".join(haystack(tok, args.length)))["input_ids"][:args.length]
    full = Session(model, 1, None, tok)
    full.prefill([ids])
    print(f"{args.method}, {len(ids)} tokens, full cache {full.cache.nbytes / 2**20:.1f} MiB")
    print("| budget | bytes/full, own lengths | bytes/full, padded | decode ms/step, own lengths | padded | ratio | max logit gap |")
    print("|---|---|---|---|---|---|---|")
    for budget in (float(b) for b in args.budgets.split(",")):
        (ragged, first), (padded, first_padded) = (compressed(model, tok, ids, args.method, budget, flag)
                                                   for flag in (False, True))
        held = [s.cache.nbytes / full.cache.nbytes for s in (ragged, padded)]  # before decoding appends
        for s in (ragged, padded):
            s.reserve(2 * args.rounds * (args.steps + 1))
        gap = float((first - first_padded).abs().max())
        ms = {"ragged": [], "padded": []}
        token = [[int(first.argmax(-1))]]
        for _ in range(args.rounds):
            outs = {}
            for name, s in (("ragged", ragged), ("padded", padded)):
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    outs[name] = s.forward(token)
                ms[name].append(1e3 * (time.perf_counter() - t0) / args.steps)
            gap = max(gap, float((outs["ragged"] - outs["padded"]).abs().max()))
        r, q = (sorted(ms[k])[args.rounds // 2] for k in ("ragged", "padded"))
        print(f"| {budget:g} | {held[0]:.3f} | {held[1]:.3f} "
              f"| {r:.1f} | {q:.1f} | {r / q:.2f} | {gap:.1e} |", flush=True)


if __name__ == "__main__":
    main()
