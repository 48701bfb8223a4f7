"""Peak memory of a prefill, one fresh process per measurement: full cache, one-shot compression and
chunked compression side by side; and the capped demonstration (a context that does not fit under a
memory limit with a full cache, answered with chunked compression under the same limit).

    python -m kvmerge_eval.memory --model gemma3-270m --method snapkv --lengths 4096,8192 --chunk 1024
    python -m kvmerge_eval.memory --model gemma3-270m --method snapkv --lengths 32768 --chunk 1024 --cap-gb 5
    python -m kvmerge_eval.memory --model gemma3-270m --method snapkv,learnedzip --lengths 16384 --chunk 1024 --compare

`--compare`: chunked prefills only, one row per method, with each method's memory above the loaded
model as a ratio to the first method's (chunked SnapKV is the reference a bounded prefill is held to).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(model: str | None, spec: str, budget: float, length: int, chunk: int | None) -> dict:
    """In this process: load, prefill a needle context of `length` tokens with `spec` (chunked if
    `chunk`), answer; → peak RSS, RSS after loading, peak cache bytes, prefill seconds, the answer."""
    import torch

    import kvmerge
    from kvmerge.decoding import decode

    from .niah import make_sample, score
    from .runner import prompt_ids

    torch.set_num_threads(2)
    mdl, tok = kvmerge.load_model(model)
    with torch.no_grad():  # page the (memory-mapped) weights in, so the baseline holds them
        sum(float(p.float().sum()) for p in mdl.parameters())
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    sample = make_sample(tok, length, depth=0.5, seed=length)
    ctx, q = prompt_ids(tok, sample)
    method = kvmerge.get_method(spec, budget)
    session = kvmerge.Session(mdl, 1, method, tok)
    t0 = time.perf_counter()
    with torch.inference_mode():
        logits = session.prefill([ctx], chunk=chunk)
        seconds = time.perf_counter() - t0
        peak_cache = session.peak_cache_bytes
        out = decode(session, session.forward([q], decoding=False), {}, 24, tok.eos_token_id)
    answer = tok.decode(out.tokens[0], skip_special_tokens=True).strip()
    del logits
    return {"method": spec, "chunk": chunk, "length": len(ctx), "peak_rss": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss * 1024, "rss_after_load": loaded, "peak_cache": peak_cache,
        "final_cache": session.cache.nbytes, "prefill_s": seconds, "answer": answer,
        "correct": score(answer, sample.answer)}


def in_subprocess(args: list[str], cap_bytes: int | None = None, timeout: float = 3600) -> dict:
    """Run `measure` in a fresh interpreter (address space capped at `cap_bytes` if given)."""
    cmd = [sys.executable, "-m", "kvmerge_eval.memory", "--one", *args]
    if cap_bytes:
        cmd += ["--cap", str(cap_bytes)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"failed": tail[:160]}
    return json.loads(lines[-1])


HEADER = ("| tokens | prefill | peak cache MB | peak RSS MB | RSS above the loaded model MB | prefill tokens/s | "
          "needle found |\n|---|---|---|---|---|---|---|")


def table(model, spec, budget, lengths, chunk) -> list[dict]:
    rows = []
    for n in lengths:
        for mode, (s, c) in {"full": ("full", None), "one-shot": (spec, None), f"chunk {chunk}": (spec, chunk)}.items():
            r = in_subprocess([json.dumps([model, s, budget, n, c])])
            rows.append({"length": n, "mode": mode, **r})
            print(_line(rows[-1]), flush=True)
    return rows


def compare(model, specs, budget, lengths, chunk) -> list[dict]:
    """Chunked prefills of several methods, each in a fresh process: rows with the ratio of each one's
    RSS above the loaded model to the first method's at the same length."""
    print(f"| tokens | method, chunks of {chunk} | peak cache MB | RSS above the loaded model MB | / {specs[0]}'s "
          "| prefill s |")
    print("|---|---|---|---|---|---|")
    rows = []
    for n in lengths:
        first = None
        for spec in specs:
            r = in_subprocess([json.dumps([model, spec, budget, n, chunk])])
            rows.append({"length": n, "mode": spec, **r})
            if "failed" in r:
                print(f"| {n} | {spec} | failed: {r['failed']} |", flush=True)
                continue
            above = r["peak_rss"] - r["rss_after_load"]
            first = above if first is None else first
            print(f"| {r['length']} | {spec} | {r['peak_cache'] / 2**20:.0f} | {above / 2**20:.0f} | "
                  f"{above / first:.2f} | {r['prefill_s']:.1f} |", flush=True)
    return rows


def _line(r: dict) -> str:
    if "failed" in r:
        return f"| {r['length']} | {r['mode']} | failed: {r['failed']} |"
    mb = 2 ** 20
    return (f"| {r['length']} | {r['mode']} | {r['peak_cache'] / mb:.0f} | {r['peak_rss'] / mb:.0f} | "
            f"{(r['peak_rss'] - r['rss_after_load']) / mb:.0f} | {r['length'] / r['prefill_s']:.0f} | "
            f"{'yes' if r['correct'] else 'no'} ({r['answer'][:24]!r}) |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--cap", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None)
    p.add_argument("--method", default="snapkv")
    p.add_argument("--budget", type=lambda x: int(x) if x.isdigit() else float(x), default=0.25,
                   help="a fraction, or a whole number of entries (flat memory under chunking)")
    p.add_argument("--lengths", default="4096,8192,16384")
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--cap-gb", type=float, default=None, help="the demonstration: run full and chunked under this cap")
    p.add_argument("--compare", action="store_true", help="chunked only, several --method specs (comma-separated) "
                   "side by side, as ratios to the first")
    args = p.parse_args()
    if args.one:
        if args.cap:
            resource.setrlimit(resource.RLIMIT_AS, (args.cap, args.cap))
        print(json.dumps(measure(*json.loads(args.one))))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.cap_gb:
        cap = int(args.cap_gb * 2 ** 30)
        for n in lengths:
            for s, c in (("full", None), (args.method, args.chunk)):
                r = in_subprocess([json.dumps([args.model, s, args.budget, n, c])], cap)
                print(f"address space capped at {args.cap_gb} GB, {n} tokens, {s}"
                      + (f", prefill chunk {c}" if c else "") + ": "
                      + (f"FAILED ({r['failed']})" if "failed" in r else
                         f"answer {r['answer']!r} ({'correct' if r['correct'] else 'wrong'}), "
                         f"peak RSS {r['peak_rss'] / 2**20:.0f} MB"), flush=True)
        return
    if args.compare:
        compare(args.model, args.method.split(","), args.budget, lengths, args.chunk)
        return
    print(HEADER)
    table(args.model, args.method, args.budget, lengths, args.chunk)


if __name__ == "__main__":
    main()
