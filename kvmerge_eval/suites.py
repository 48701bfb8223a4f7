"""Named benchmark suites, defined as data (`kvmerge_eval/suites/<name>.toml`).

A suite lists runs of `kvmerge eval`: models × task × methods × budgets × lengths × samples. Keys at
the top level are defaults every `[[run]]` may override:

    title = "..."                          # heading of the suite's tables
    models = ["smollm2-135m", "gemma3-270m"]
    methods = ["full", "snapkv"]
    budgets = [0.25, 0.1]
    [[run]]
    label = "needle"                       # the column's name in the table (default: the task)
    task = "niah"                          # niah | ruler | fidelity | code | family
    subtasks = ["multikey"]                # RULER subtasks or task families (one column each)
    text = "legal"                         # optional: the haystack's genre (docs, legal, code, table, dialogue) or a file
    lengths = [2048]
    samples = 10
    limit = 3                              # optional: the first N samples only
    prefill_chunk = 1024                   # optional: chunked prefill, rows named <method>@chunk<N>

`kvmerge eval --suite NAME` runs it, resumably, into `results/NAME/<model>/`; `kvmerge report --suite
NAME` prints one table per model: a row per method, a column per (run, length, budget), cells `score
(samples)` (KL for fidelity), and the cache's bytes against the full cache. docs/results.md carries
these tables as printed.
"""

from __future__ import annotations

import tomllib
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .corpus import GENRES
from .runner import METRICS, TASKS, _read, rows_of_model, run_key, summarize

SUITES = Path(__file__).parent / "suites"
_RUN_KEYS = {"label", "task", "subtasks", "lengths", "samples", "limit", "prefill_chunk", "models", "methods",
             "budgets", "text"}
_TOP_KEYS = {"title", "description", "models", "methods", "budgets", "lengths", "samples", "run"}


@dataclass(frozen=True)
class Run:
    label: str
    task: str
    models: list[str]
    methods: list[str]
    budgets: list[float]
    lengths: list[int]
    samples: int
    subtasks: list[str] | None = None
    limit: int | None = None
    prefill_chunk: int | None = None
    text: str | None = None

    def labels(self) -> list[str]:
        """Method labels as the runner records them."""
        return [f"{m}@chunk{self.prefill_chunk}" if self.prefill_chunk else m for m in self.methods]


@dataclass(frozen=True)
class Suite:
    name: str
    title: str
    runs: list[Run] = field(default_factory=list)
    description: str = ""

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(m for r in self.runs for m in r.models))


def available() -> list[str]:
    return sorted(p.stem for p in SUITES.glob("*.toml"))


def load(name: str) -> Suite:
    """The suite `name` (or a path to a .toml file), checked: unknown keys, tasks and methods fail here."""
    path = Path(name) if name.endswith(".toml") else SUITES / f"{name}.toml"
    if not path.exists():
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(available())}")
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    _unknown(data, _TOP_KEYS, path.name)
    if not data.get("run"):
        raise ValueError(f"{path.name}: a suite needs at least one [[run]]")
    runs = []
    for i, r in enumerate(data["run"]):
        _unknown(r, _RUN_KEYS, f"{path.name} run {i + 1}")
        get = lambda k: r.get(k, data.get(k))  # noqa: E731 - a run's key, else the suite's default
        missing = [k for k in ("task", "models", "methods", "budgets", "lengths", "samples") if get(k) is None]
        if missing:
            raise ValueError(f"{path.name} run {i + 1}: missing {', '.join(missing)}")
        if r["task"] not in TASKS:
            raise ValueError(f"{path.name} run {i + 1}: unknown task {r['task']!r}; tasks: {', '.join(TASKS)}")
        runs.append(Run(r.get("label", r["task"]), r["task"], list(get("models")), list(get("methods")),
                        [float(b) for b in get("budgets")], list(get("lengths")), int(get("samples")),
                        r.get("subtasks"), r.get("limit"), r.get("prefill_chunk"), r.get("text")))
    _check_methods(runs, path.name)
    return Suite(path.stem, data.get("title", path.stem), runs, data.get("description", ""))


def _unknown(table: dict, allowed: set, where: str) -> None:
    extra = sorted(set(table) - allowed)
    if extra:
        raise ValueError(f"{where}: unknown key(s) {', '.join(extra)}; allowed: {', '.join(sorted(allowed))}")


def _check_methods(runs, where) -> None:
    from kvmerge import get_method

    for r in runs:
        for m in r.methods:
            try:
                get_method(m, r.budgets[0])
            except (ValueError, TypeError, KeyError) as e:
                raise ValueError(f"{where}: method {m!r}: {e}") from e


def folder(suite: Suite, model: str, root="results") -> Path:
    return Path(root) / suite.name / model


def run_suite(suite: Suite, models=None, root="results", load_model=None) -> None:
    """Every run of `suite` for `models` (default: the suite's), one model loaded at a time; resumable."""
    from kvmerge.model import load_model as default_loader

    from .runner import run as run_task

    load_model = load_model or default_loader
    for model_name in models or suite.models:
        runs = [r for r in suite.runs if model_name in r.models]
        if not runs:
            raise ValueError(f"suite {suite.name!r} has no run for model {model_name!r}; models: {', '.join(suite.models)}")
        for r in runs:  # a results file cut off mid-line, or another model's, is refused before a model loads
            rows_of_model(folder(suite, model_name, root) / f"{r.task}.jsonl", model_name)
    for model_name in models or suite.models:
        runs = [r for r in suite.runs if model_name in r.models]
        model, tok = load_model(model_name)
        for r in runs:
            run_task(r.task, model, tok, r.methods, r.budgets, r.lengths, r.samples, folder(suite, model_name, root),
                     text=r.text, limit=r.limit, subtasks=r.subtasks, prefill_chunk=r.prefill_chunk,
                     model_name=model_name)


def columns(run: Run) -> list[tuple]:
    """(column name, task name in the rows, length, budget) of one run: subtask × length × budget."""
    from .tasks import get_task

    own = get_task(run.task).subtasks
    tasks = run.subtasks or (own() if own is not None else [run.task])
    if run.task == "family":  # rows name the haystack's genre: <family>/<genre>
        tasks = [f"{t}/{run.text or 'docs'}" for t in tasks]
    elif run.text in GENRES:
        tasks = [f"{t}/{run.text}" for t in tasks]
    out = []
    for t in tasks:
        name = run.label if len(tasks) == 1 else t if run.label == run.task else f"{run.label} {t}"
        for n in run.lengths:
            length = f" {n / 1024:g}k" if len(run.lengths) > 1 else ""
            out += [(f"{name}{length} {b:.0%}", t, n, b) for b in run.budgets]
    return out


def _columns(suite: Suite, model: str, budgets=None) -> list[tuple]:
    cols = [c for r in suite.runs if model in r.models for c in columns(r) if budgets is None or c[3] in budgets]
    return list(dict.fromkeys(cols))


def header(suite: Suite, model: str, budgets=None) -> list[str]:
    """The column names of `model`'s table: one per (run, subtask, length, budget), then the bytes."""
    cols = _columns(suite, model, budgets)
    shown = sorted({c[3] for c in cols}, reverse=True)
    return ["method"] + [c[0] for c in cols] + ["bytes/full at " + " / ".join(f"{b:.0%}" for b in shown)]


def _budget(label: str, budget: float) -> float:
    """The budget `label`'s rows are stored under: the full cache runs once, at 1.0."""
    return 1.0 if label.split("@")[0] == "full" else budget


def _cells(rows_raw: list[dict]) -> list[dict]:
    """Summarized rows (`runner.summarize`), a run found twice counted once."""
    return summarize(list({run_key(r["method"], r["budget"], r): r for r in rows_raw}.values()))


def table(suite: Suite, model: str, rows_raw: list[dict], budgets=None) -> str:
    """One model's markdown table: a row per method label, a column per (run, subtask, length, budget)."""
    labels = list(dict.fromkeys(m for r in suite.runs if model in r.models for m in r.labels()))
    rows = [r for r in _cells(rows_raw) if r["method"] in labels]
    cell = {(r["task"], r["method"], r["budget"], r["length"]): r for r in rows}
    cols = _columns(suite, model, budgets)
    shown = sorted({c[3] for c in cols}, reverse=True)
    head = header(suite, model, budgets)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        out = []
        for _name, task, n, b in cols:
            r = cell.get((task, label, _budget(label, b), n))
            metric = METRICS.get(task.split("/")[0], ("score",))[0]
            out.append("–" if r is None else
                       (f"{r[metric]:.4f}" if metric == "kl" else f"{r[metric]:.0%}") + f" ({r['n']})")
        fractions = []
        for b in shown:
            rs = [r for r in rows if r["method"] == label and "cache_fraction" in r and r["budget"] == _budget(label, b)]
            fractions.append(f"{sum(r['cache_fraction'] for r in rs) / len(rs):.3f}" if rs else "–")
        if any(x != "–" for x in out):
            lines.append(f"| {label} | " + " | ".join(out) + " | " + " / ".join(fractions) + " |")
    return "\n".join(lines)


def totals(suite: Suite, model: str, cells: list[dict], budgets=None) -> str | None:
    """Answers summed over the genres of each family measured on several (`answered/asked`), a row per
    method measured on every one of them: a cell of 10 questions moves by 10 points with one answer, the sum
    over three genres by 3.3. `cells`: summarized rows (`runner.summarize`: task, method, budget,
    length, score, n). None when no family has results on two genres at one length."""
    measured = {(r["task"], r["length"]) for r in cells}
    genres: dict = defaultdict(list)  # (family, length) -> its task names with results, one per genre
    for r in suite.runs:
        if r.task == "family" and model in r.models:
            for _name, task, n, _b in columns(r):
                if (task, n) in measured:
                    genres[(task.split("/")[0], n)].append(task)
    groups = {k: list(dict.fromkeys(v)) for k, v in genres.items() if len(set(v)) > 1}
    if not groups:
        return None
    cell = {(r["task"], r["method"], r["budget"], r["length"]): r for r in cells}
    labels = list(dict.fromkeys(m for r in suite.runs if model in r.models and r.task == "family" for m in r.labels()))
    shown = sorted({b for r in suite.runs if model in r.models for b in r.budgets if budgets is None or b in budgets},
                   reverse=True)
    cols = [(fam, n, b) for (fam, n) in groups for b in shown]
    head = ["method (summed over genres)"] + [f"{fam} {n / 1024:g}k {b:.0%} ({len(groups[fam, n])} genres)"
                                               for fam, n, b in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label in labels:
        out = []
        for fam, n, b in cols:
            rs = [cell.get((t, label, _budget(label, b), n)) for t in groups[fam, n]]
            out.append("–" if None in rs else f"{round(sum(r['score'] * r['n'] for r in rs))}/{sum(r['n'] for r in rs)}")
        if any(x != "–" for x in out):
            lines.append(f"| {label} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def averages(suite: Suite, model: str, cells: list[dict], budgets=None) -> str | None:
    """For runs of tasks with subtasks averaged as a benchmark (RULER): per method and budget, the mean
    of the subtasks' mean scores, as RULER averages its tasks (a subtask with more samples measured
    weighs no more), with the subtasks and samples it covers; the budget also named as kvpress's
    compression ratio. None when the suite has no such run."""
    runs = [r for r in suite.runs if model in r.models and r.task == "ruler-real"]
    if not runs:
        return None
    cols = sorted({(n, b) for r in runs for n in r.lengths for b in r.budgets if budgets is None or b in budgets},
                  key=lambda c: (c[0], -c[1]))  # the (length, budget) pairs some run measures
    head = ["method (RULER average)"] + [f"{n / 1024:g}k {b:.0%} (ratio {1 - b:.2f})" for n, b in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    tasks = {t for r in runs for _name, t, _n, _b in columns(r)}
    for label in dict.fromkeys(m for r in runs for m in r.labels()):
        out = []
        for n, b in cols:
            rs = [c for c in cells if c["method"] == label and c["task"] in tasks and c["length"] == n
                  and c["budget"] == _budget(label, b)]
            total = sum(c["n"] for c in rs)
            out.append("–" if not rs else f"{sum(c['score'] for c in rs) / len(rs):.1%} ({len(rs)} tasks, {total})")
        if any(x != "–" for x in out):
            lines.append(f"| {label} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def report(suite: Suite, root="results", models=None, budgets=None) -> str:
    """The suite's tables, one per model with results, each under `#### <model>`, headed by the command
    that regenerates them and the dates its rows were measured."""
    parts = [f"### {suite.title}", "",
             f"Suite `{suite.name}` · `kvmerge eval --suite {suite.name} && kvmerge report --suite {suite.name}`"]
    found = False
    for model in models or suite.models:
        raw = [r for p in sorted(folder(suite, model, root).glob("*.jsonl")) for r in _read(p)]
        if not raw:
            continue
        found = True
        dates = sorted({r["date"] for r in raw if "date" in r})
        when = f"measured {dates[0]}" + (f" to {dates[-1]}" if len(dates) > 1 else "") if dates else "undated"
        parts += ["", f"#### {model} ({when}; samples per cell in brackets)", "", table(suite, model, raw, budgets)]
        for extra in (totals(suite, model, _cells(raw), budgets), averages(suite, model, _cells(raw), budgets)):
            if extra:
                parts += ["", extra]
    if not found:
        raise FileNotFoundError(f"no results for suite {suite.name!r} under {Path(root) / suite.name}: "
                                f"run `kvmerge eval --suite {suite.name}` first")
    return "\n".join(parts)


def plots(suite: Suite, plot_dir, root="results", models=None) -> list[Path]:
    """The suite's plots written to `plot_dir`: for a RULER suite, its average against the budget per
    model at the suite's shortest length (`report.ruler_curves`), with kvpress's rows from `<root>/kvpress_ruler.jsonl` when there."""
    from .report import ruler_curves

    if not any(r.task == "ruler-real" for r in suite.runs):
        return []
    length = min(n for r in suite.runs if r.task == "ruler-real" for n in r.lengths)  # one length a plot
    labels = {m for r in suite.runs if r.task == "ruler-real" for m in r.labels()}  # the suite's methods only
    by_model = {m: list({run_key(r["method"], r["budget"], r): r
                         for r in _read(folder(suite, m, root) / "ruler-real.jsonl")
                         if r["length"] == length and r["method"] in labels}.values())
                for m in models or suite.models}
    kvpress = Path(root) / "kvpress_ruler.jsonl"
    rows = list({(r["model"], r["method"], r["budget"], r["task"], r["seed"]): r
                 for r in _read(kvpress) if r["length"] == length}.values())
    return [ruler_curves(by_model, rows, Path(plot_dir) / f"{suite.name}_vs_budget.png", length)]
