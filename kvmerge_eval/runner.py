"""Run methods × budgets over a task's samples: resumable JSONL per sample, CSV + JSON summaries.

Work runs sample by sample (each context's full-cache reference is computed once); samples sharing
a context are answered from one compression (question-agnostic protocol).
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from kvmerge import answer_questions, generate, generate_ids, method_from_spec, split_prompt
from . import code, fidelity, niah, ruler

TASKS = ("niah", "ruler", "fidelity", "code")
MAX_NEW = {"niah": 24, "ruler": 48, "code": 32}


def build_samples(task: str, tok, lengths, samples: int, text=None, subtasks=None) -> list:
    """Every sample of `task` for each length: `samples` per length (per RULER subtask)."""
    if task == "niah":
        depths = [0.1 + 0.8 * i / max(samples - 1, 1) for i in range(samples)]
        return [niah.make_sample(tok, n, d, seed=1000 * n + i, text=text) for n in lengths for i, d in enumerate(depths)]
    if task == "ruler":
        names = subtasks or list(ruler.TASKS)
        return [ruler.TASKS[t](tok, n, 1000 * n + i, text) for t in names for n in lengths for i in range(samples)]
    if task == "fidelity":
        return [fidelity.make_sample(tok, n, seed=1000 * n + i, text=text) for n in lengths for i in range(samples)]
    if task == "code":
        return [code.make_sample(tok, n, seed=1000 * n + i) for n in lengths for i in range(samples)]
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def _key(method, budget, meta) -> tuple:
    return (method, float(budget), meta.get("task", "niah"), meta["length"], meta["seed"])


def run(task, model, tok, methods, budgets, lengths, samples, out_dir, protocol="agnostic", text=None,
        limit=None, subtasks=None) -> list[dict]:
    """Append one JSON line per (method, budget, sample) to `out_dir/<task>.jsonl`, skipping finished
    ones; then write `<task>_summary.csv/json`. Returns the summary rows."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{task}.jsonl"
    done = {_key(r["method"], r["budget"], r) for r in _read(path)}
    data = build_samples(task, tok, lengths, samples, text, subtasks)[:limit]
    for m in methods:
        method_from_spec(m, budgets[0])  # unknown names and parameters fail now, not an hour in
    configs = [(m, b) for m in methods for b in ([1.0] if m == "full" else budgets)]
    (out / f"{task}_config.json").write_text(json.dumps(
        {"task": task, "methods": methods, "budgets": budgets, "lengths": lengths, "samples": samples,
         "protocol": protocol, "text": text, "limit": limit, "subtasks": subtasks}, indent=1))
    todo = [(s, m, b) for s in data for m, b in configs if _key(m, b, s.meta) not in done]
    with path.open("a") as f, tqdm(total=len(todo), desc=task, unit="run") as bar:
        for group in _by_context(todo):
            for row in _run_group(task, model, tok, group, protocol):
                f.write(json.dumps(row) + "\n")
                f.flush()
                bar.update(1)
    return write_summary(out, task)


def _by_context(todo):
    """Jobs grouped by (context, method, budget): one compression per group."""
    groups: dict = defaultdict(list)
    for s, m, b in todo:
        groups[(str(s.context), m, b)].append((s, m, b))
    return list(groups.values())


_REFERENCE: dict = {}  # (length, seed, text) → full-cache log-probs of a fidelity sample


def _run_group(task, model, tok, group, protocol):
    s0, name, budget = group[0]
    method = method_from_spec(name, budget)
    base = {"method": name, "budget": budget}
    if task == "fidelity":
        ref_key = (s0.meta["length"], s0.meta["seed"], len(s0.answer))
        if ref_key not in _REFERENCE:
            _REFERENCE.clear()
            _REFERENCE[ref_key] = fidelity.continuation_logits(model, s0.context, s0.answer)
        logp = fidelity.continuation_logits(model, s0.context, s0.answer, method, tok)
        return [{**base, **s0.meta, **fidelity.compare(_REFERENCE[ref_key], logp, s0.answer)}]
    if s0.meta.get("raw"):  # plain completion, no chat template
        ctx = tok(s0.context, add_special_tokens=False)["input_ids"]
        q = tok(s0.question, add_special_tokens=False)["input_ids"]
        res = generate_ids(model, ctx, q, method, MAX_NEW[task], protocol, tokenizer=tok)
        outs = [(s0, res, tok.decode(res.tokens[0], skip_special_tokens=True))]
    elif len(group) > 1 and protocol == "agnostic":
        pairs = [split_prompt(tok, s.context, s.question) for s, _, _ in group]
        results = answer_questions(model, pairs[0][0], [p[1] for p in pairs], method, MAX_NEW[task],
                                   tok.eos_token_id, tok)
        outs = [(s, r, tok.decode(r.tokens[0], skip_special_tokens=True).strip()) for (s, _, _), r in zip(group, results)]
    else:
        outs = []
        for s, _, _ in group:
            r = generate(model, tok, s.context, s.question, method, MAX_NEW[task], protocol)
            outs.append((s, r, r.text))
    score = {"niah": niah.score, "ruler": ruler.score, "code": code.score}[task]
    return [{**base, **s.meta, "answer": s.answer, "prediction": text, "score": score(text, s.answer),
             "cache_bytes": r.stats["cache_bytes"], "full_cache_bytes": r.stats["full_cache_bytes"],
             "compress_seconds": r.stats["compress_seconds"], "prefill_seconds": r.stats["prefill_seconds"]}
            for s, r, text in outs]


def _read(path) -> list[dict]:
    path = Path(path)
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


METRICS = {"fidelity": ("kl", "ppl_ratio", "top1")}


def summarize(rows: list[dict]) -> list[dict]:
    """Mean metrics per (task, method, budget, length)."""
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r.get("task", "niah"), r["method"], float(r["budget"]), r["length"])].append(r)
    out = []
    for (task, method, budget, length), rs in sorted(groups.items()):
        row = {"task": task, "method": method, "budget": budget, "length": length, "n": len(rs)}
        for metric in METRICS.get(task, ("score",)):
            row[metric] = sum(r.get(metric, r.get("correct", 0.0)) for r in rs) / len(rs)
        if "cache_bytes" in rs[0]:
            row["cache_fraction"] = sum(r["cache_bytes"] for r in rs) / sum(r["full_cache_bytes"] for r in rs)
        out.append(row)
    return out


def write_summary(out: Path, task: str) -> list[dict]:
    rows = summarize(_read(out / f"{task}.jsonl"))
    (out / f"{task}_summary.json").write_text(json.dumps(rows, indent=1))
    if rows:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with (out / f"{task}_summary.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
    return rows
