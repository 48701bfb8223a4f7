"""Decode speed of global per-head allocation (each KV head at its own length) against the same
method with uniform allocation and against the full cache, side by side in one run: every round
times `--steps` decode steps of each cache in turn (alternated, each first in turn, median of rounds,
so the machine's noise and the order hit all alike). Prints decode ms/step, the ratio to the uniform and to the full cache, and
the cache's bytes.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/decode_alloc.py --lengths 2048 --batches 1,8

Batch > 1 repeats the one-row compressed cache (`Session.repeat_rows`): rows equal to a prefill of
that many copies of the prompt, without paying for it (`--batch-prefill`: prefill them all).
"""

import argparse
import time

import torch

import kvmerge
from kvmerge import Session
from kvmerge_eval.niah import haystack


def prefilled(model, tok, ids, spec, budget, rows):
    method = None if spec is None else kvmerge.get_method(spec, budget)
    session = Session(model, rows, method, tok)
    return session, session.prefill([ids] * rows, None if method is None else method.window)


@torch.inference_mode()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="2048")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--methods", default="learnedzip,snapkv")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-prefill", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = kvmerge.load_model(args.model)
    print(f"model {args.model or 'SmolLM2-135M (bundled)'}, budget {args.budget}, {args.threads} thread(s), "
          f"{args.steps} steps x {args.rounds} rounds, median")
    print("| length | batch | method | full ms | uniform ms | head ms | head/uniform | head/full "
          "| full MiB | uniform MiB | head MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for length in (int(x) for x in args.lengths.split(",")):
        ids = tok(" ".join(haystack(tok, length)))["input_ids"][:length]
        batches = [int(x) for x in args.batches.split(",")]
        specs = {"full": None, **{f"{m}:{a}": f"{m}:alloc={a}" for m in args.methods.split(",")
                                  for a in ("uniform", "head")}}
        one = {}  # one-row prefills, repeated per batch (unless --batch-prefill)
        for batch in batches:
            caches = {}
            for key, spec in specs.items():
                if args.batch_prefill or key not in one:
                    one[key] = prefilled(model, tok, ids, spec, args.budget, batch if args.batch_prefill else 1)
                s, first = one[key]
                base = s.snapshot()
                if s.seen.shape[0] < batch:
                    s.repeat_rows(batch)
                    first = first.repeat_interleave(batch, 0)
                s.reserve(args.steps + 1)
                caches[key] = (s, first, base)
            for name in args.methods.split(","):
                group = {"full": caches["full"], "uniform": caches[f"{name}:uniform"], "head": caches[f"{name}:head"]}
                mib = {k: s.cache.nbytes / 2**20 for k, (s, _, _) in group.items()}
                ms = {k: [] for k in group}
                for r in range(args.rounds):
                    order = list(group)[r % 3:] + list(group)[:r % 3]  # each layout first in turn
                    for k, (s, first, _) in ((k, group[k]) for k in order):
                        token = [[int(t)] for t in first.argmax(-1)]
                        snap = s.snapshot()
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            s.forward(token)
                        ms[k].append(1e3 * (time.perf_counter() - t0) / args.steps)
                        s.restore(snap)
                f, u, h = (sorted(ms[k])[args.rounds // 2] for k in ("full", "uniform", "head"))
                print(f"| {length} | {batch} | {name} | {f:.1f} | {u:.1f} | {h:.1f} | {h / u:.2f} | {h / f:.2f} "
                      f"| {mib['full']:.1f} | {mib['uniform']:.1f} | {mib['head']:.1f} |", flush=True)
            for s, _, base in caches.values():
                s.restore(base)

if __name__ == "__main__":
    main()
