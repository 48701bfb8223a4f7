"""`kvmerge compress`, `kvmerge ask` and `kvmerge inspect`: a compressed context as a file."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from .errors import InputError

COMMANDS = ("compress", "ask", "inspect")  # `kvmerge NAME`, dispatched here by the command line


def _file(name: str) -> tuple[Path, dict]:
    """The file and its metadata, checked before any model loads."""
    from .context_file import check_file, metadata

    path = Path(name).expanduser()
    return path, metadata(path, check_file(path))


def _model_of(args, meta: dict | None = None):
    """The model to load: --model, else the one the file names when it is a bundled name or a folder."""
    from .commands import device, model_name, quiet_loading

    name = args.model
    made_with = (meta or {}).get("model_name") or None
    if name is None and made_with:
        from .model import BUNDLED

        bundled = next((b for b in BUNDLED if Path(made_with).name == b), None)
        name = bundled or (made_with if Path(made_with).exists() else None)
        if name is None:
            raise InputError(f"the file was made with the model {made_with!r}, which is neither a bundled model nor a "
                             "folder here: give --model with that model's folder")
    model_name(name)
    device(getattr(args, "device", None))
    quiet_loading(args)
    from .model import load_model

    return load_model(name, device=getattr(args, "device", None))


def _load(args, path, model, tok):
    """`load_context`, its refusal of another model extended by the fix: the file names its own model."""
    from .context import OtherModelError, load_context

    try:
        return load_context(path, model, tok)
    except OtherModelError as e:
        if args.model is None:
            raise
        raise OtherModelError(f"{e}; leave out --model to load the model the file names") from None


def compress(args) -> int:
    from .commands import check_budget_given, method, read_text, runs_here, writable

    out = writable("--out", args.out)
    if args.context != "-" and Path(args.context).expanduser().resolve() == out.resolve():
        raise InputError(f"--out {args.out} is the --context file: writing it would destroy the text; give the .kvz "
                         "file another name")
    from .context_file import replaceable

    replaces = replaceable(out, f"--out {args.out}")
    text = read_text(args.context)
    if args.method is not None:  # checked before the model loads
        check_budget_given(args.method, args.budget)
        runs_here(method(args.method, args.budget, args.prefill_chunk), args.model)
    model, tok = _model_of(args)
    from .context import compress_context
    from .defaults import default_method
    from .progress import ProgressBars

    spec = args.method
    if spec is None:
        spec = default_method(model)
        method(spec, args.budget, args.prefill_chunk)
    start = time.perf_counter()
    ctx = compress_context(model, tok, text, spec, args.budget, keep_ids=not args.no_ids,
                           prefill_chunk=args.prefill_chunk, progress=None if args.no_progress else ProgressBars())
    size = ctx.save(out).stat().st_size
    print(f"[{ctx}; file {size / 2**20:.2f} MiB; {time.perf_counter() - start:.1f} s] → {out}"
          + (" (replaced the compressed context it held)" if replaces else ""))
    return 0


def ask(args) -> int:
    from .commands import Streamer, check_sampling, sampling

    if args.cuda_graph:
        from .commands import graph_device

        graph_device(args.device)
    path, meta = _file(args.file)
    check_sampling(args)
    questions = list(args.question)
    if questions == ["-"]:
        questions = [line.strip() for line in sys.stdin if line.strip()]
    if not questions or not all(q.strip() for q in questions):
        raise InputError("--question is empty: ask something (or --question - to read one question per line)")
    model, tok = _model_of(args, meta)
    from .generation import generate

    start = time.perf_counter()
    ctx = _load(args, path, model, tok)
    loaded = time.perf_counter() - start
    for q in questions:
        if len(questions) > 1:
            print(f"Q: {q}\nA: ", end="", flush=True)
        out = generate(model, tok, ctx, q, max_new_tokens=args.max_new_tokens, **sampling(args),
                       streamer=Streamer(tok, args.stop), cuda_graph=args.cuda_graph)
        print(f"[{out.stats['method']}: {ctx.tokens:,} context tokens; loaded in {loaded * 1e3:.0f} ms; "
              f"answered in {out.stats['decode_seconds']:.2f} s]", file=sys.stderr)
    return 0


def inspect(args) -> int:
    from .commands import writable

    path, meta = _file(args.file)
    for option, name, kinds in (("--png", args.png, (".png",)), ("--html", args.html, (".html", ".htm"))):
        if name is None:
            continue
        out = writable(option, name)
        if out.resolve() == path.resolve():
            raise InputError(f"{option} {name} is the compressed-context file: writing it would destroy it; give "
                             "another name")
        if out.is_file() and out.stat().st_size and out.suffix.lower() not in kinds:
            raise InputError(f"{option} {name} exists and is not a {kinds[0]} file, which kvmerge inspect will not "
                             "overwrite; give another name, or remove it")
    model, tok = _model_of(args, meta)
    from . import context_view

    ctx = _load(args, path, model, tok)
    print(context_view.summary(ctx, path.stat().st_size))
    if ctx.kept is None:
        print("(the file kept only its token ids' hash: no text to show)")
        return 0
    if args.png:
        context_view.heatmap(ctx, args.png)
        print(f"wrote {args.png}", file=sys.stderr)
    if args.html:
        png = None
        if args.png:
            png = str(Path(args.png).resolve())
        Path(args.html).write_text(context_view.page(ctx, png), encoding="utf-8")
        print(f"wrote {args.html}", file=sys.stderr)
    if not args.no_text:
        color = sys.stdout.isatty() or args.color
        print()
        print(context_view.terminal(ctx, color=color))
        print(context_view.legend(color))
    return 0
