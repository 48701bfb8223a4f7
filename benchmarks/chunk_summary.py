"""Issue #15's quality cost of chunking, on the same samples: for each method, one-shot compression
against chunked prefill (`<spec>@chunk<N>` rows), restricted to the samples every chunk size ran.

    .venv/bin/python benchmarks/chunk_summary.py results/chunking/smollm2-135m
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def main(folder):
    for task, metric in (("niah", "score"), ("fidelity", "kl")):
        path = Path(folder) / f"{task}.jsonl"
        if not path.exists():
            continue
        rows = [json.loads(line) for line in path.open()]
        by = defaultdict(dict)  # (method, chunk) → seed → value
        for r in rows:
            method, _, chunk = r["method"].partition("@chunk")
            by[(method, chunk or "one-shot")][r["seed"]] = r[metric]
        chunks = sorted({c for _m, c in by if c != "one-shot"}, key=int)
        methods = sorted({m for m, _c in by if m != "full"})
        print(f"\n{task} ({metric}), 25%; n = samples every column ran\n")
        print("| method | one-shot | " + " | ".join(f"chunks of {c}" for c in chunks) + " | n |")
        print("|---|---|" + "---|" * (len(chunks) + 1))
        for m in methods:
            cols = ["one-shot"] + chunks
            seeds = set.intersection(*(set(by[(m, c)]) for c in cols if by.get((m, c))))
            fmt = (lambda x: f"{x:.4f}") if metric == "kl" else (lambda x: f"{x:.0%}")
            cells = [fmt(sum(by[(m, c)][s] for s in seeds) / len(seeds)) if by.get((m, c)) else "–" for c in cols]
            print(f"| {m} | " + " | ".join(cells) + f" | {len(seeds)} |")


if __name__ == "__main__":
    main(sys.argv[1])
