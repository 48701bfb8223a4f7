"""What `kvmerge suites`, `eval`, `bench` and `report` run (`kvmerge.cli` parses the arguments): the
commands that measure, on `kvmerge_eval`. As in `kvmerge.commands`, each checks what it can without
the model first."""

from __future__ import annotations

import sys
from pathlib import Path

from .commands import default_spec, eval_module, method, model_name, read_text, runs_here
from .errors import InputError, UnknownNameError, suggest

COMMANDS = ("suites", "eval", "bench", "report")  # `kvmerge NAME`, dispatched here by the command line


def _known_suite(name: str) -> None:
    import kvmerge_eval

    folder = Path(kvmerge_eval.__file__).parent / "suites"
    names = sorted(p.stem for p in folder.glob("*.toml"))
    if not name.endswith(".toml") and name not in names:
        raise UnknownNameError(f"unknown suite {name!r}{suggest(name, names)}; suites: {', '.join(names)}")
    if name.endswith(".toml") and not Path(name).is_file():
        raise InputError(f"no suite file {name}")


def _check_subtasks(task: str, subtasks: list[str] | None) -> None:
    """Refuse --subtasks for a task without subtasks, and a name the task does not have."""
    if subtasks is None:
        return
    kind = eval_module("tasks").get_task(task)
    if kind.subtasks is None:
        with_ = ", ".join(n for n, t in eval_module("tasks").TASKS.items() if t.subtasks is not None)
        raise InputError(f"--subtasks: the {task} task has none ({with_} have)")
    names = kind.subtasks()
    for name in subtasks:
        if name not in names:
            raise UnknownNameError(f"--subtasks: {task} has no subtask {name!r}{suggest(name, names)}; it has "
                                   f"{', '.join(names)}")


def with_default(specs: list[str], model) -> list[str]:
    """`specs` with the word "default" replaced by the model's default method, each spec once. `model`:
    a loaded model, or a name (None: the bundled default model) whose config is read without loading
    it where it can be; where it cannot, "default" is left out until the model loads."""
    if "default" in specs:
        if model is None or isinstance(model, str):
            model = default_spec(model)
        else:
            from .defaults import default_method

            model = default_method(model)
        specs = [model if s == "default" else s for s in specs]
    return [s for i, s in enumerate(specs) if s is not None and s not in specs[:i]]


def suites(args) -> int:
    s = eval_module("suites")
    for name in s.available():
        print(f"{name:16} {s.load(name).title}")
    return 0


def eval(args) -> int:  # noqa: A001 - the command's name
    if args.suite:
        _known_suite(args.suite)
        s = eval_module("suites")
        suite = s.load(args.suite)
        s.run_suite(suite, args.models, args.out)
        print(s.report(suite, args.out, args.models))
        return 0
    model_name(args.model)
    if args.text is not None:
        genres = eval_module("corpus").GENRES
        if args.text not in genres:
            if not Path(args.text).exists():
                raise InputError(f"--text {args.text!r} is neither a genre{suggest(args.text, genres)} ("
                                 f"{', '.join(genres)}) nor a file")
            read_text(args.text, "--text")
    _check_subtasks(args.task, args.subtasks)
    for spec in with_default(args.methods, args.model):
        m = method(spec, args.budgets[0], args.prefill_chunk)
        runs_here(m, args.model)
    from .model import DEFAULT_MODEL, load_model, max_positions

    runner, report = eval_module("runner"), eval_module("report")
    name = runner.model_label(args.model or DEFAULT_MODEL)  # a cut-off last line or another model's rows: refused before loading
    runner.rows_of_model(Path(args.out) / f"{args.task}.jsonl", name)
    model, tok = load_model(args.model)
    specs = with_default(args.methods, model)
    for spec in specs:
        method(spec, args.budgets[0], args.prefill_chunk)
    limit = max_positions(model)
    if limit and max(args.lengths) > limit:
        raise InputError(f"--lengths {max(args.lengths)}: {args.model or DEFAULT_MODEL} has {limit:,} positions: ask "
                         f"for fewer tokens (a question and its answer follow most tasks' contexts)")
    runner.run(args.task, model, tok, specs, args.budgets, args.lengths, args.samples, args.out,
               args.protocol, args.text, args.limit, args.subtasks, args.prefill_chunk, model_name=name)
    print(report.report(args.out, plots=False))
    return 0


def bench(args) -> int:
    model_name(args.model)
    for spec in with_default(args.methods, args.model):
        method(spec, args.budget)
    if args.memory:
        memory = eval_module("memory")
        print(memory.HEADER)
        first = args.methods[0]
        if first == "default":
            first = default_spec(args.model)
            if first is None:  # known once the model loads
                from .model import load_model

                first = with_default(["default"], load_model(args.model)[0])[0]
        print(f"method: {first}")
        memory.table(args.model, first, args.budget, args.lengths, args.prefill_chunk or 1024)
        return 0
    from .model import load_model

    b = eval_module("bench")
    model, tok = load_model(args.model)
    specs = with_default(args.methods, model)
    for spec in specs:
        method(spec, args.budget)
    rows, profiles = b.run_bench(model, specs, args.budget, args.lengths, args.batches, args.steps,
                                 args.out, tok, args.prefill_chunk)
    cols = ["length", "batch", "method", "ms_per_step", "tokens_per_s", "speedup", "cache_vs_full",
            "compress_vs_prefill", "peak_extra_mb", "floor_ms", "vs_floor", "kernel_floor_ms", "vs_kernel_floor"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    r = rows[0]
    print(f"floor = (weights + cache bytes) / copy bandwidth {r['bandwidth_gbs']:.1f} GB/s (best of "
          f"{r['bandwidth_before_gbs']:.1f} before and {r['bandwidth_after_gbs']:.1f} after the decode runs)")
    print("kernel floor = torch's own linears over the weights (" + ", ".join(
          f"batch {k}: {x['linear_ms']:.1f} ms" for k, x in {x["batch"]: x for x in rows}.items())
          + f") + cache bytes / packed decode SDPA's read rate {r['attention_gbs']:.1f} GB/s, same run")
    for spec, parts in profiles.items():
        print(f"profile, {spec}, batch {max(args.batches)} x {max(args.lengths)} tokens, ms/step: "
              + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    o = b.bias_overhead(model, max(args.lengths), max(args.batches), args.steps)
    print(f"attention alone, biased with log_n = 0 vs stock SDPA, batch {o['batch']} x {o['length']} tokens: "
          f"{o['biased_ms']:.1f} vs {o['stock_ms']:.1f} ms/step ({o['overhead']:+.1%})")
    return 0


def report(args) -> int:
    if args.suite:
        _known_suite(args.suite)
        s = eval_module("suites")
        suite = s.load(args.suite)
        print(s.report(suite, args.root, args.models, args.budgets))
        if args.plots_to and not args.no_plots:
            for path in s.plots(suite, args.plots_to, args.root, args.models):
                print(f"kvmerge report: wrote {path}", file=sys.stderr)
        return 0
    if args.folder is None:
        raise InputError("report needs a results folder (kvmerge eval --out FOLDER writes one) or --suite NAME")
    folder = Path(args.folder)
    if not folder.is_dir():
        raise InputError(f"no results folder {args.folder}: kvmerge eval --out {args.folder} writes one"
                         if not folder.exists() else f"{args.folder} is a file: give the results folder")
    wrote: list[Path] = []
    print(eval_module("report").report(folder, plots=not args.no_plots, methods=args.methods, plot_dir=args.plots_to,
                                 wrote=wrote))
    if wrote:
        print(f"kvmerge report: wrote {len(wrote)} plot(s) to {wrote[0].parent}: "
              + ", ".join(p.name for p in wrote), file=sys.stderr)
    return 0
