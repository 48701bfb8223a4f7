"""Peak memory of a chunked prefill, side by side in one run: each method prefills the same context
in chunks in a fresh process (so that no allocator reuse from an earlier method hides its peak), and
the table gives the peak resident memory above the loaded model, and its ratio to chunked SnapKV's
at the same budget. The full cache prefilled one-shot is the reference a chunked prefill avoids.

    .venv/bin/python benchmarks/chunk_memory.py --model gemma3-270m --length 16384 --chunk 1024 \\
        --methods snapkv,learnedzip,mixedmerge --budget 0.25
"""

import argparse
import json
import subprocess
import sys


def one(model_name, length, spec, budget, chunk, threads) -> dict:
    import torch

    import kvmerge
    from kvmerge_eval.bench import prefilled
    from kvmerge_eval.niah import haystack

    torch.set_num_threads(threads)
    model, tok = kvmerge.load_model(model_name)
    ids = tok(" ".join(haystack(tok, length)))["input_ids"][:length]
    prefilled(model, ids[:256], "snapkv", 0.25, tok, chunk=128)  # warm-up: first calls allocate
    _, t = prefilled(model, ids, spec, budget, tok, chunk=chunk)
    return {"spec": spec, "chunk": chunk, "tokens": len(ids), "peak_extra_mib": t["peak_extra_bytes"] / 2**20,
            "seconds": t["prefill_s"] + t["compress_s"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--methods", default="snapkv,learnedzip,mixedmerge")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one spec in this process
    args = p.parse_args()
    if args.one:
        chunk = None if args.one == "full" else args.chunk
        print(json.dumps(one(args.model, args.length, args.one, args.budget, chunk, args.threads)))
        return
    rows = []
    for spec in ["full"] + args.methods.split(","):
        out = subprocess.run([sys.executable, __file__, "--one", spec, "--model", args.model, "--length",
                              str(args.length), "--chunk", str(args.chunk), "--budget", str(args.budget),
                              "--threads", str(args.threads)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr, flush=True)
    snap = next((r["peak_extra_mib"] for r in rows if r["spec"] == "snapkv"), None)
    print(f"{args.model}, {rows[0]['tokens']} tokens, budget {args.budget}, chunks of {args.chunk} (full: one-shot)")
    print("| method | peak above the model (MiB) | / chunked snapkv | seconds |")
    print("|---|---|---|---|")
    for r in rows:
        ratio = f"{r['peak_extra_mib'] / snap:.2f}" if snap else "–"
        name = r["spec"] + ("" if r["chunk"] is None else f"@chunk{r['chunk']}")
        print(f"| {name} | {r['peak_extra_mib']:.0f} | {ratio} | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
