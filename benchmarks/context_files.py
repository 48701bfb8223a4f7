"""Compressed contexts as files, side by side: prefill + compression against load + first token in a
new process, the file's bytes against budget × the full cache's, and whether the new process answers
as the compression did in memory (greedy tokens). One JSON line per model × length × method.

    python benchmarks/context_files.py --out results/context_files.jsonl   # both bundled models, 2k and 7.5k

Contexts are needle prompts (kvmerge_eval.niah); the question asks for the needle. Rows already in
`--out` are skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import kvmerge

CHILD = """
import json, sys, time, torch, kvmerge
model, tok = kvmerge.load_model({model!r})
start = time.perf_counter()
ctx = kvmerge.load_context({path!r}, model, tok)
loaded = time.perf_counter() - start
first = kvmerge.generate(model, tok, ctx, {question!r}, max_new_tokens=1)
first_s = time.perf_counter() - start
out = kvmerge.generate(model, tok, ctx, {question!r}, max_new_tokens={tokens})
print(json.dumps({{"load_s": loaded, "load_first_token_s": first_s, "tokens": out.tokens[0]}}))
"""


def one(model, tok, name, length, spec, budget, tokens, folder) -> dict:
    from kvmerge_eval.niah import make_sample

    sample = make_sample(tok, length, depth=0.5, seed=1)
    start = time.perf_counter()
    ctx = kvmerge.compress_context(model, tok, sample.context, spec, budget)
    made = time.perf_counter() - start
    want = kvmerge.generate(model, tok, ctx, sample.question, max_new_tokens=tokens)
    path = ctx.save(Path(folder) / "c.kvz")
    timings, tokens_n, cache_bytes, full = ctx.meta["timings"], ctx.tokens, ctx.nbytes, ctx.meta["full_bytes"]
    del ctx  # the new process loads the model too: free this one's cache first
    gc.collect()
    code = CHILD.format(model=name, path=str(path), question=sample.question, tokens=tokens)
    child = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                      check=True).stdout.strip().splitlines()[-1])
    return {"model": name, "tokens": tokens_n, "method": spec, "budget": budget,
            "prefill_s": round(timings["prefill_seconds"], 2),
            "compress_s": round(timings["compress_seconds"], 2), "made_s": round(made, 2),
            "load_s": round(child["load_s"], 3), "load_first_token_s": round(child["load_first_token_s"], 3),
            "speedup": round(made / child["load_first_token_s"], 1),
            "file_bytes": path.stat().st_size, "cache_bytes": cache_bytes, "full_bytes": full,
            "file_over_cache": round(path.stat().st_size / cache_bytes, 4),
            "file_over_budget": round(path.stat().st_size / (budget * full), 3),
            "same_answer": child["tokens"] == want.tokens[0], "answer": want.text}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m")
    p.add_argument("--lengths", default="2048,7680", help="context tokens (SmolLM2 has 8,192 positions)")
    p.add_argument("--methods", default="snapkv,zipguardmerge")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--tokens", type=int, default=16, help="answer tokens compared")
    p.add_argument("--out", default="results/context_files.jsonl")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["model"], r["tokens_asked"], r["method"]) for r in map(json.loads, out.read_text().splitlines())} \
        if out.exists() else set()
    torch.set_num_threads(torch.get_num_threads())
    for name in args.models.split(","):
        model, tok = kvmerge.load_model(name)
        for length in map(int, args.lengths.split(",")):
            for spec in args.methods.split(","):
                if (name, length, spec) in done:
                    continue
                spec_here = f"{spec}:sliding=0.75" if name.startswith("gemma") and "sliding" not in spec else spec
                with tempfile.TemporaryDirectory() as folder:
                    row = {"tokens_asked": length, **one(model, tok, name, length, spec_here, args.budget,
                                                         args.tokens, folder)}
                row["method"] = spec
                print(json.dumps(row), flush=True)
                with out.open("a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
