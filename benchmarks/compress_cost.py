"""Compression cost against prefill, side by side in one run, on one bundled model: every shipped
method by default, each compressing a copy of one prefill (a surprisal method's LM-head pass counts
as compression, KVzip's reconstruction too). Methods built on KVzip's reconstruction (its variants,
`zipmerge`, `zipguard`) share one pass per prefill: only the first listed pays for it, so time them
in separate runs.

    .venv/bin/python benchmarks/compress_cost.py --model gemma3-270m --lengths 1024,2048,4096 --budget 0.25
"""

import argparse
import sys

import torch

import kvmerge
import kvmerge.model
from kvmerge_eval.shared import compressed_once
from kvmerge_eval.niah import haystack


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--methods", default="all", help="comma-separated specs, or all")
    p.add_argument("--model", default=None)
    p.add_argument("--threads", type=int, default=2, help="torch threads (1 beside another job on 2 cores)")
    p.add_argument("--surprisal-exact-below", type=int, default=None,
                   help="vocabulary size from which surprisal's normaliser is estimated (0: always)")
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    torch.set_num_threads(args.threads)
    if args.surprisal_exact_below is not None:
        kvmerge.model.EXACT_SURPRISAL_BELOW = args.surprisal_exact_below
    model, tok = kvmerge.load_model(args.model)
    methods = ([m for m in kvmerge.available_methods() if m != "full"] if args.methods == "all"
               else args.methods.split(","))
    print("| method | " + " | ".join(f"{n} tokens: s (% of prefill)" for n in lengths) + " |")
    rows, prefill = {m: [] for m in methods}, []
    for _ in compressed_once(model, tok, [list(range(10, 300))], [(m, args.budget) for m in methods]):
        pass  # warm-up: first calls pay for allocation and setup
    for n in lengths:
        ids = tok(" ".join(haystack(tok, n)))["input_ids"][:n]
        for name, _b, session, _logits in compressed_once(model, tok, [ids], [(m, args.budget) for m in methods]):
            rows[name].append(session.timings["compress_seconds"])  # one prefill, every method compresses a copy
        prefill.append(session.timings["prefill_seconds"])
        print(f"{n} tokens, prefill {prefill[-1]:.2f} s: " + ", ".join(
            f"{m} {rows[m][-1]:.3f}" for m in methods), file=sys.stderr, flush=True)
    print("| prefill | " + " | ".join(f"{p:.2f}" for p in prefill) + " |")
    for name in methods:
        print(f"| {name} | " + " | ".join(f"{c:.3f} ({100 * c / p:.0f}%)" for c, p in zip(rows[name], prefill)) + " |")


if __name__ == "__main__":
    main()
