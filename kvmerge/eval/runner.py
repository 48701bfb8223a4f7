"""Run methods × budgets over a task's samples; resumable JSONL results and a summary table."""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from ..methods import get_method
from ..runtime import generate


def niah_samples(tok, lengths, samples, text=None):
    from .niah import make_sample

    depths = [0.1 + 0.8 * i / max(samples - 1, 1) for i in range(samples)]
    return [make_sample(tok, n, d, seed=1000 * n + i, text=text) for n in lengths for i, d in enumerate(depths)]


def run_niah(model, tok, methods, budgets, lengths, samples, out_dir, protocol="agnostic", text=None):
    """Append one JSON line per (method, budget, sample) to `out_dir/niah.jsonl`, skipping finished ones."""
    from .niah import score

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "niah.jsonl"
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["method"], r["budget"], r["length"], r["seed"]))
    data = niah_samples(tok, lengths, samples, text)
    jobs = [(m, b, s) for m in methods for b in ([1.0] if m == "full" else budgets) for s in data]
    (out / "config.json").write_text(json.dumps({"task": "niah", "methods": methods, "budgets": budgets,
                                                 "lengths": lengths, "samples": samples,
                                                 "protocol": protocol}, indent=1))
    with path.open("a") as f:
        for m, b, s in tqdm(jobs, desc="niah", unit="prompt"):
            key = (m, b, s.meta["length"], s.meta["seed"])
            if key in done:
                continue
            method = get_method(m) if m == "full" else get_method(m, budget=b)
            res = generate(model, tok, s.context, s.question, method=method, max_new_tokens=24, protocol=protocol)
            row = {"method": m, "budget": b, **s.meta, "answer": s.answer, "prediction": res.text,
                   "correct": score(res.text, s.answer), "cache_bytes": res.stats["cache_bytes"],
                   "full_cache_bytes": res.stats["full_cache_bytes"],
                   "compress_seconds": res.stats["compress_seconds"]}
            f.write(json.dumps(row) + "\n")
            f.flush()
    return summarize(path)


def summarize(path) -> dict:
    """{(method, budget, length): (correct, total)} from a JSONL results file."""
    table: dict = {}
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        key = (r["method"], r["budget"], r["length"])
        c, t = table.get(key, (0.0, 0))
        table[key] = (c + r["correct"], t + 1)
    return table


def print_table(table) -> str:
    lengths = sorted({k[2] for k in table})
    cols = sorted({(k[0], k[1]) for k in table}, key=lambda x: (x[0] != "full", x[0], -x[1]))
    lines = ["| method | budget | " + " | ".join(f"{n} tok" for n in lengths) + " |",
             "|---|---|" + "---|" * len(lengths)]
    for m, b in cols:
        cells = [f"{table[(m, b, n)][0]:.0f}/{table[(m, b, n)][1]}" if (m, b, n) in table else "–" for n in lengths]
        lines.append(f"| {m} | {b} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    return text
