"""Prefill speed, one-shot against chunked, side by side in one run: tokens/s of the whole prefill
and the share of it spent compressing (the compression runs after every chunk).

    .venv/bin/python benchmarks/chunk_time.py --model smollm2-135m --length 4096 --chunks 512,1024,2048
"""

import argparse

import torch

import kvmerge
from kvmerge_eval.bench import prefilled
from kvmerge_eval.niah import haystack


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunks", default="512,1024,2048")
    p.add_argument("--methods", default="snapkv,centroidkv,semanticache,surprisemerge")
    args = p.parse_args()
    torch.set_num_threads(2)
    model, tok = kvmerge.load_model(args.model)
    ids = tok(" ".join(haystack(tok, args.length)))["input_ids"][:args.length]
    prefilled(model, ids[:256], "snapkv", 0.25, tok)  # warm-up
    chunks = [None] + [int(c) for c in args.chunks.split(",")]
    print("| method | " + " | ".join("one-shot" if c is None else f"chunks of {c}" for c in chunks) + " |")
    print("|---|" + "---|" * len(chunks))
    for spec in ["full"] + args.methods.split(","):
        cells = []
        for c in chunks:
            t = prefilled(model, ids, spec, 0.25, tok, chunk=c)[1]
            total = t["prefill_s"] + t["compress_s"]
            cells.append(f"{len(ids) / total:.0f} tok/s ({100 * t['compress_s'] / total:.1f}% compressing)")
        print(f"| {spec} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
