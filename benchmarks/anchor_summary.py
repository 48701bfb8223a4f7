"""Issue #17's one table from the folders `anchor_tables.sh` and `anchor_followup.sh` write: a row per
method, columns task × budget (needle tasks: % found; fidelity: mean KL), samples per cell, and the
cache bytes against the full cache (log-mass included).

    .venv/bin/python benchmarks/anchor_summary.py results/anchors/smollm2-135m results/anchors/smollm2-135m-followup
    .venv/bin/python benchmarks/anchor_summary.py --methods full,kvzip,expectmerge results/anchors/gemma3-270m
"""

import argparse
import json
from collections import defaultdict
from pathlib import Path

from kvmerge_eval.runner import run_key, summarize

TASKS = [("niah", "needle"), ("multikey", "multikey"), ("single_inline", "in-style fact"), ("fidelity", "KL")]


def main(folders, only=None):
    raw = [json.loads(line) for f in folders for p in sorted(Path(f).glob("*.jsonl")) for line in p.open()]
    raw = [r for r in raw if only is None or r["method"] in only]
    # a run found in two folders counts once (a needle's depth depends on the run's sample count)
    raw = list({run_key(r["method"], r["budget"], r) + (r.get("depth"),): r for r in raw}.values())
    rows = summarize(raw)
    ran = defaultdict(set)  # task → budgets it ran at
    for r in rows:
        ran[r["task"]].add(r["budget"])
    budgets = sorted({b for bs in ran.values() for b in bs if b != 1.0}, reverse=True)
    columns = [(task, label, b) for task, label in TASKS for b in budgets if b in ran[task]]
    cell = {(r["task"], r["method"], r["budget"]): r for r in rows}
    methods = sorted({r["method"] for r in rows}, key=lambda m: (m != "full", m))
    head = [f"{label} {b:.0%}" for _t, label, b in columns]
    print("| method | " + " | ".join(head) + " | bytes/full at " + " / ".join(f"{b:.0%}" for b in budgets) + " |")
    print("|---|" + "---|" * (len(head) + 1))
    for m in methods:
        out, fractions = [], []
        for task, _label, b in columns:
            r = cell.get((task, m, 1.0 if m == "full" else b))
            if r is None:
                out.append("–")
                continue
            value = f"{r['kl']:.4f}" if task == "fidelity" else f"{r['score']:.0%}"
            out.append(f"{value} ({r['n']})")
        for b in budgets:
            rs = [r for r in rows if r["method"] == m and r["budget"] == (1.0 if m == "full" else b) and "cache_fraction" in r]
            fractions.append(f"{sum(r['cache_fraction'] for r in rs) / len(rs):.3f}" if rs else "–")
        print(f"| {m} | " + " | ".join(out) + " | " + " / ".join(fractions) + " |")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("folders", nargs="+")
    p.add_argument("--methods", default=None, help="comma-separated method labels to show (default: all)")
    args = p.parse_args()
    main(args.folders, args.methods.split(",") if args.methods else None)
