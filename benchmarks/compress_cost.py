"""Compression cost against prefill, side by side in one run, on the bundled model.

    .venv/bin/python benchmarks/compress_cost.py --lengths 1024,2048,4096 --budget 0.25
"""

import argparse

import torch

import kvmerge
from kvmerge_eval.bench import prefilled
from kvmerge_eval.niah import haystack


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
        runs = [prefilled(model, ids, name, args.budget, tok)[1] for name in args.methods.split(",")]
        prefill = min(r["prefill_s"] for r in runs)
        print(f"| {n} | {prefill:.2f} | " + " | ".join(
            f"{r['compress_s']:.3f} ({100 * r['compress_s'] / prefill:.0f}%, {1e6 * r['compress_s'] / n:.0f})"
            for r in runs) + " |")


if __name__ == "__main__":
    main()
