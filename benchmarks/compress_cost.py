"""Compression cost against prefill, side by side in one run, on the bundled model.

    .venv/bin/python benchmarks/compress_cost.py --lengths 1024,2048,4096 --budget 0.25
"""

import argparse

import torch

import kvmerge
from kvmerge.eval.niah import haystack


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--methods", default="semanticache,centroidkv,snapkv,streamingllm")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = kvmerge.load_model()
    print("| tokens | prefill s | " + " | ".join(f"{m} s (% of prefill, ms/1k tok)" for m in args.methods.split(","))
          + " |")
    for n in [int(x) for x in args.lengths.split(",")]:
        ids = tok(" ".join(haystack(tok, n)))["input_ids"][:n]
        cells, prefill = [], None
        for name in args.methods.split(","):
            method = kvmerge.get_method(name, budget=args.budget)
            method.setup(model, tok)
            s = kvmerge.Session(model, 1)
            with torch.inference_mode():
                s.prefill([ids], method)
            t = s.timings
            prefill = t["prefill_seconds"] if prefill is None else min(prefill, t["prefill_seconds"])
            cells.append(t["compress_seconds"])
        print(f"| {n} | {prefill:.2f} | " + " | ".join(
            f"{c:.3f} ({100 * c / prefill:.0f}%, {1000 * c / n * 1000:.0f})" for c in cells) + " |")


if __name__ == "__main__":
    main()
