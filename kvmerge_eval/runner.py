"""Run methods × budgets over a task's samples: resumable JSONL per sample, CSV + JSON summaries.

Work runs sample by sample (each context's full-cache reference is computed once); samples sharing
a context are answered from one compression (question-agnostic protocol).
"""

from __future__ import annotations

import csv
import datetime
import io
import json
from collections import defaultdict
from pathlib import Path

from tqdm import tqdm

from kvmerge import get_method, split_prompt
from kvmerge.errors import InputError
from kvmerge.decoding import cache_stats, decode
from kvmerge.methods.registry import current_spec
from . import fidelity
from .corpus import GENRES
from .shared import compressed_once
from .tasks import TASKS as TASK_TABLE
from .tasks import get_task

TASKS = tuple(TASK_TABLE)


def build_samples(task: str, tok, lengths, samples: int, text=None, subtasks=None) -> list:
    """Every sample of `task` for each length: `samples` per length (per RULER subtask or family).
    With a genre as `text` (corpus.GENRES) the rows' task is `<task>/<genre>`, apart from prose's."""
    if text in ("table", "code") and task != "fidelity":
        raise ValueError(f"the {text!r} genre has no sentences to hide facts among: use it with the fidelity task")
    out = get_task(task).build(tok, lengths, samples, text, subtasks)
    if text in GENRES and task != "family":  # families name their genre themselves
        for s in out:
            s.meta["task"] = f"{s.meta.get('task', task)}/{text}"
    return out


def run_key(method, budget, meta) -> tuple:
    """What identifies one run in a results file: (method, budget, task, length, seed, needle depth)."""
    return (method, float(budget), meta.get("task", "niah"), meta["length"], meta["seed"], meta.get("depth"))


def model_label(name_or_path) -> str:
    """The model's name in results rows: a bundled name, a folder's or a hub id's last part."""
    return Path(str(name_or_path or "model")).name


def rows_of_model(path, model: str) -> list[dict]:
    """The rows of a results file a run of `model` resumes from; a file holding another model's rows
    is refused (`InputError`), since a results file is one model's (rows without a model predate the
    field and count as this model's)."""
    rows = _read(path, resuming=True)
    others = sorted({r["model"] for r in rows if r.get("model", model) != model})
    if others:
        raise InputError(f"results file {path} holds rows of model {', '.join(others)}, not {model}: give each "
                         f"model its own folder (--out {Path(path).parent / model})")
    return rows


def run(task, model, tok, methods, budgets, lengths, samples, out_dir, protocol="agnostic", text=None,
        limit=None, subtasks=None, prefill_chunk=None, model_name=None) -> list[dict]:
    """Append one JSON line per (method, budget, sample) to `out_dir/<task>.jsonl`, skipping finished
    ones; then write `<task>_summary.csv/json`. Returns the summary rows. `prefill_chunk`: chunked
    prefill, recorded as method `<spec>@chunk<N>` so that its rows stand beside one-shot ones. Rows
    record `model_name` (default: `model_label` of the model's folder); one file holds one model's."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{task}.jsonl"
    name = model_name or model_label(getattr(getattr(model, "config", None), "name_or_path", None))
    methods = [current_spec(m) for m in methods]  # rows are written under the current names
    done = {run_key(r["method"], r["budget"], r) for r in rows_of_model(path, name)}
    label = (lambda m: f"{m}@chunk{prefill_chunk}") if prefill_chunk else (lambda m: m)
    data = build_samples(task, tok, lengths, samples, text, subtasks)[:limit]
    for m in methods:
        get_method(m, budgets[0])  # unknown names and parameters fail now, not an hour in
    configs = [(m, b) for m in methods for b in ([1.0] if m == "full" else budgets)]
    todo = [(s, m, b) for s in data for m, b in configs if run_key(label(m), b, s.meta) not in done]
    groups = _by_prompt(task, tok, todo, protocol)  # refuses a length the task cannot write, before any write
    _write_whole(out / f"{task}_config.json", json.dumps(
        {"task": task, "methods": methods, "budgets": budgets, "lengths": lengths, "samples": samples,
         "protocol": protocol, "text": text, "limit": limit, "subtasks": subtasks, "prefill_chunk": prefill_chunk},
        indent=1))
    with path.open("ab", buffering=0) as f, tqdm(total=len(todo), desc=task, unit="run") as bar:
        if f.tell() and not _ends_a_line(path):
            _append(f, b"\n")  # a last row written whole but for its newline
        for i, (prompt, jobs) in enumerate(groups.items()):
            bar.set_postfix_str(f"prompt {i + 1}/{len(groups)}: {len(prompt)} tokens, {len(jobs)} runs")
            for row in _run_prompt(task, model, tok, list(prompt), jobs, protocol, prefill_chunk):
                _append(f, (json.dumps({"model": name, **row}) + "\n").encode())
                bar.update(1)
    return write_summary(out, task)


def prompt_ids(tok, sample, task: str | None = None) -> tuple[list[int], list[int]]:
    """(context ids, question ids) of a sample: the task's own rule where it has one (`Task.prompt`),
    else: without a chat template the question reads "Question: …\nAnswer: <answer prefix>"; `raw`
    samples are plain continuations."""
    own = get_task(task).prompt if task is not None else None
    if own is not None:
        return own(tok, sample)
    if sample.meta.get("raw"):
        ctx = tok(sample.context, add_special_tokens=False)["input_ids"]
        q = tok(sample.question, add_special_tokens=False)["input_ids"]
    else:
        question = sample.question
        if not getattr(tok, "chat_template", None):
            prefix = sample.meta.get("answer_prefix")
            question = f"Question: {question}\nAnswer:" + (f" {prefix}" if prefix else "")
        ctx, q = split_prompt(tok, sample.context, question)
    return ctx, q


def _by_prompt(task, tok, todo, protocol) -> dict:
    """Jobs `(sample, method, budget, ids fed after compression)` grouped by the ids compressed (the
    context; the whole prompt under the aware protocol): one prefill per group, one compression per method."""
    groups: dict = defaultdict(list)
    for s, m, b in todo:
        ctx, q = (s.context, []) if get_task(task).teacher_forced else prompt_ids(tok, s, task)
        if len(ctx) > 1.5 * s.meta["length"]:  # measured under the wrong length: refused before any run
            raise InputError(f"--lengths {s.meta['length']}: this task writes a context of {len(ctx)} tokens at that "
                             f"length (its facts and template alone): ask for at least {len(ctx)}")
        if protocol == "aware":
            ctx, q = ctx + q, []
        groups[tuple(ctx)].append((s, m, b, q))
    return groups


def _run_prompt(task, model, tok, ctx, jobs, protocol, chunk=None):
    """Yield each job's row as soon as it is measured (one prefill, one compression per config)."""
    configs = list(dict.fromkeys((m, b) for _, m, b, _ in jobs))
    question = 0  # under the aware protocol the question stays inside the protected window
    kind = get_task(task)
    if protocol == "aware" and not kind.teacher_forced:
        question = len(prompt_ids(tok, jobs[0][0], task)[1])
    references = {}  # a fidelity sample's (context, continuation) → its full-cache log-probs
    for spec, budget, session, logits in compressed_once(model, tok, [ctx], configs, question, chunk):
        base = {"method": f"{spec}@chunk{chunk}" if chunk else spec, "budget": budget,
                "date": datetime.date.today().isoformat()}
        mine = [(s, q) for s, m, b, q in jobs if (m, b) == (spec, budget)]
        if kind.teacher_forced:
            for s, _ in mine:
                logp = fidelity.teacher_forced(session, logits, s.answer)
                key = (tuple(s.context), tuple(s.answer))  # its full-cache log-probs, once per prompt
                if key not in references:
                    references[key] = fidelity.continuation_logits(model, s.context, s.answer)
                yield {**base, **s.meta, **fidelity.compare(references[key], logp, s.answer)}
            continue
        stats = cache_stats(session, [ctx], protocol)
        compressed = session.snapshot()
        for s, q in mine:
            session.restore(compressed)
            first = session.forward([q], decoding=False) if q else logits
            out = decode(session, first, dict(stats), kind.max_new_tokens(s), tok.eos_token_id)
            text = tok.decode(out.tokens[0], skip_special_tokens=True)
            text = text if s.meta.get("raw") else text.strip()
            yield {**base, **s.meta, "answer": s.answer, "prediction": text, "score": kind.score(text, s),
                   **{k: stats[k] for k in ("cache_bytes", "full_cache_bytes", "compress_seconds", "prefill_seconds")}}


def _read(path, resuming: bool = False) -> list[dict]:
    """The rows of a results file, one JSON object a line (none if there is no file). A line that is
    not one is refused (`InputError`) with the file and its line number; a last line cut off mid-write
    (a run stopped while writing it) is said to be so, with how to fix it (`resuming`: before a run
    appends to the file). A row measured under an older method name reads as the current one
    (`kvmerge.methods.registry.current_spec`), so renamed suites still find it."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as e:
        raise InputError(f"results file {path} is not UTF-8 text (byte {e.start}): not a file kvmerge eval "
                         "wrote") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if n == len(lines):  # the last line, without its newline: cut off mid-write
                fix = (f"delete it (sed -i '$d' {path}) and run the same command again: its run is redone"
                       if resuming else f"delete it (sed -i '$d' {path}), or resume the run that wrote it")
                raise InputError(f"results file {path}: the last line ({n}) is incomplete, cut off mid-write "
                                 f"when a run was stopped: {fix}") from None
            raise InputError(f"results file {path}, line {n}: not a JSON row ({e.msg.removesuffix(' at')} at column {e.colno}): "
                             "fix or delete that line") from None
        if not isinstance(row, dict) or not {"method", "budget"} <= set(row):
            raise InputError(f"results file {path}, line {n}: not a results row (a JSON object with a method and "
                             "a budget): fix or delete that line") from None
        if isinstance(row["method"], str):
            row["method"] = current_spec(row["method"])
        rows.append(row)
    return rows


def _ends_a_line(path: Path) -> bool:
    with path.open("rb") as f:
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _append(f, data: bytes) -> None:
    """Write `data` to the unbuffered file `f` at once (one system call, looping only if the system
    writes less), so that a row is on disk whole as soon as it is measured."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _write_whole(path: Path, text: str) -> None:
    """`path` gets `text` whole or keeps what it had: written beside it, then renamed over it."""
    import os

    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


METRICS = {name: t.metrics for name, t in TASK_TABLE.items() if t.metrics != ("score",)}


def summarize(rows: list[dict]) -> list[dict]:
    """Mean metrics per (task, method, budget, length)."""
    groups: dict = defaultdict(list)
    for r in rows:
        groups[(r.get("task", "niah"), r["method"], float(r["budget"]), r["length"])].append(r)
    out = []
    for (task, method, budget, length), rs in sorted(groups.items()):
        row = {"task": task, "method": method, "budget": budget, "length": length, "n": len(rs)}
        for metric in METRICS.get(task.split("/")[0], ("score",)):
            row[metric] = sum(r.get(metric, r.get("correct", 0.0)) for r in rs) / len(rs)
        if "cache_bytes" in rs[0]:
            row["cache_fraction"] = sum(r["cache_bytes"] for r in rs) / sum(r["full_cache_bytes"] for r in rs)
        out.append(row)
    return out


def write_summary(out: Path, task: str) -> list[dict]:
    rows = summarize(_read(out / f"{task}.jsonl"))
    _write_whole(out / f"{task}_summary.json", json.dumps(rows, indent=1))
    if rows:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
        _write_whole(out / f"{task}_summary.csv", text.getvalue())
    return rows
