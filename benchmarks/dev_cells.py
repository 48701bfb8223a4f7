"""The dev cells a scorer design is judged on at 10% (research log R41–R50), shared by the probes:
kvmerge's RULER-style needles on the legal haystack (4k, 12 samples a subtask) and the facts of one
template on the docs genre (2k, 10 samples a cell), rows written resumably under
`<out>/<model>/<task>-<genre>/`, so methods run on another day share a file and their prompts."""

from __future__ import annotations

from pathlib import Path

CELLS = [("ruler", ["single_number", "single_uuid", "multivalue", "multiquery"], "legal", 4096, 12),
         ("family", ["same_template_2", "same_template_4", "same_template_8"], "docs", 2048, 10)]


def add_arguments(parser, methods: str) -> None:
    """The dev runs' options: `--methods` (default `methods`), `--first`/`--cells` (a slice of `CELLS`),
    `--budgets`, `--threads`."""
    parser.add_argument("--methods", default=methods)
    parser.add_argument("--first", type=int, default=0, help="1: skip the needles")
    parser.add_argument("--cells", type=int, default=len(CELLS), help="1: the needles only")
    parser.add_argument("--budgets", type=lambda s: [float(x) for x in s.split(",")], default=[0.1, 0.25])
    parser.add_argument("--threads", type=int, default=2)


def run_cells(model, tok, model_name: str, methods: list[str], budgets: list[float], out: str,
              first: int = 0, last: int = len(CELLS)) -> None:
    """Run `methods` at `budgets` on `CELLS[first:last]`, printing each summary row."""
    from kvmerge_eval.runner import run

    for task, subtasks, genre, length, samples in CELLS[first:last]:
        folder = Path(out) / model_name / f"{task}-{genre}"
        for row in run(task, model, tok, methods, budgets, [length], samples, folder, text=genre,
                       subtasks=subtasks, model_name=model_name):
            print({k: row[k] for k in row if k in ("method", "budget", "task", "subtask", "score", "n")}, flush=True)
