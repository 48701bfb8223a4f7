"""What `kvmerge generate`, `methods`, `demo` and `train-scorer` run, and the checks every command
shares (`kvmerge.cli` parses the arguments; `context_commands` and `eval_commands` hold the others).
Each command checks what it can without the model first (files, model name, method specs, budgets,
what a runtime refuses), so a mistake costs a second, not a model load and a prefill."""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
from pathlib import Path

from .errors import InputError, UnsupportedError, check_chunk, plural
from .errors import check_sampling as check_sampling_options
from .spec import check_budget_once, parse_spec


def eval_module(module: str):
    """A module of `kvmerge_eval`, or a clear error if the eval extra is not installed."""
    try:
        return importlib.import_module(f"kvmerge_eval.{module}")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith(("kvmerge_eval", "tqdm", "rich", "matplotlib")):
            raise
        raise InputError(f"this command needs the evaluation extra ({e.name} is missing): "
                         "pip install 'kvmerge[eval]'") from e


# -- checks that need no model -----------------------------------------------------------------
def read_text(name: str, what: str = "--context") -> str:
    """The UTF-8 text of file `name` ("-": stdin), refusing a missing, unreadable, binary or empty one."""
    if name == "-":
        text = sys.stdin.read()
    else:
        path = Path(name).expanduser()
        if path.is_dir():
            raise InputError(f"{what} {name} is a folder: give a UTF-8 text file")
        if not path.exists():
            raise InputError(f"{what} {name}: no such file (give a UTF-8 text file, or - to read stdin)")
        try:
            data = path.read_bytes()
        except OSError as e:
            raise InputError(f"{what} {name} cannot be read: {e.strerror}") from e
        if b"\0" in data[:4096]:
            raise InputError(f"{what} {name} is a binary file: give UTF-8 text (e.g. pdftotext paper.pdf paper.txt)")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{what} {name} is not UTF-8 (byte {e.start}): convert it, e.g. iconv -t utf-8") from e
    if not text.strip():
        raise InputError(f"{what} {name} is empty: nothing to compress")
    return text


def writable(option: str, name: str) -> Path:
    """The file `name` an option writes, refused before any work when it is a folder or its folder
    does not exist."""
    out = Path(name).expanduser()
    if out.is_dir():
        raise InputError(f"{option} {name} is a folder: give a file name")
    if not out.parent.exists():
        raise InputError(f"{option} {name}: no folder {str(out.parent)!r}")
    return out


def protected(spec: str) -> tuple[int, int]:
    """(sinks, window) of the method `spec` names, from the methods table (no torch)."""
    import ast

    from . import catalog

    name, params = parse_spec(spec)
    row = catalog.row(name)
    defaults = {p: d for p, d, _t, _a in row["params"]} if row else {}
    value = {k: params.get(k, ast.literal_eval(defaults.get(k, "0"))) for k in ("sinks", "window")}
    return tuple(v if isinstance(v, int) else 0 for v in (value["sinks"], value["window"]))


def check_protected(spec: str, budget=None, chunk: int | None = None) -> None:
    """Refuse an int `budget` or a `chunk` below the tokens the method of `spec` always keeps (its
    sinks and window), from the methods table alone."""
    if parse_spec(spec)[0] == "full":
        return
    sinks, window = protected(spec)
    keep = sinks + window
    if isinstance(budget, int) and budget < keep:
        raise InputError(f"--budget {budget} entries is below the {keep} tokens every method keeps (the first and "
                         f"the last ones); a fraction of the context is written with a point, e.g. 1.0 or 0.25")
    if chunk is not None:
        check_chunk(chunk, sinks, window, "--prefill-chunk")


def check_budget_given(spec: str, budget) -> None:
    """Refuse a --budget the user gave that the spec cannot take: beside another `budget=` in it, or
    with `full` (which keeps the whole cache)."""
    check_budget_once(spec, budget)
    if parse_spec(spec)[0] == "full" and budget is not None:
        raise InputError("--method full keeps the whole cache: --budget does not apply")


def method(spec: str, budget=None, chunk: int | None = None):
    """The method of `spec` with `budget`, checked: a known name (close names suggested), known
    parameters of the declared types, an int budget and a `chunk` above its protected tokens (all
    from the methods table first, without torch), then the method's own checks."""
    from . import catalog

    catalog.check_spec(spec)
    check_protected(spec, budget, chunk)

    from .errors import refusing
    from .params import check_params
    from .methods import get_method

    with refusing():
        try:
            m = get_method(spec, budget)
        except ValueError as e:
            hint = (" (a fraction of the context is written with a point, e.g. 1.0 or 0.25)"
                    if isinstance(budget, int) and "entries" in str(e) else "")
            raise InputError(f"{e}{hint}") from e
        check_params(m)
    return m


def model_name(name) -> None:
    from .model import check_model_name

    check_model_name(name)


def runs_here(m, model) -> None:
    """Refuse what this method cannot do with these options: `sliding` on a model without
    sliding-window layers."""
    from .model import DEFAULT_MODEL, has_sliding_layers

    if m.sliding is not None and has_sliding_layers(model) is False:
        raise UnsupportedError(f"{m.label}: sliding={m.sliding} shortens sliding-window layers, and "
                               f"{model or DEFAULT_MODEL} has none: drop :sliding, or use a model with sliding-window "
                               "layers (e.g. --model gemma3-270m)")


def Streamer(tok, stop: list[str] | None = None):  # noqa: N802 - builds a class's instance
    """A `transformers.TextStreamer` that prints the answer from its first visible character (a
    model's leading blank lines are not shown; `.text` is stripped the same way) and, with `stop`
    strings, up to the first of them (held back until it cannot be the start of one)."""
    from transformers import TextStreamer

    stops = [x for x in stop or [] if x]
    hold = max(map(len, stops), default=1) - 1

    class _Streamer(TextStreamer):
        started, pending, stopped = False, "", False

        def on_finalized_text(self, text: str, stream_end: bool = False):
            if not self.started:
                text = text.lstrip()
                self.started = bool(text)
            if self.stopped:
                return super().on_finalized_text("", True) if stream_end else None
            text, self.pending = self.pending + text, ""
            found = [i for i in (text.find(x) for x in stops) if i >= 0]
            if found:
                self.stopped = True
                return super().on_finalized_text(text[:min(found)], stream_end)
            if not stream_end and hold:
                text, self.pending = text[:-hold], text[-hold:]
            super().on_finalized_text(text, stream_end)

    return _Streamer(tok, skip_special_tokens=True)


def check_sampling(args) -> None:
    """Sampling options (`generate`, `ask`) refused where they cannot act, before the model loads."""
    check_sampling_options(args.temperature, args.top_k, args.top_p, args.seed, lambda name: "--" + name.replace("_", "-"))


def sampling(args) -> dict:
    """The answer options as `kvmerge.generation.generate` takes them."""
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed, "stop": args.stop}


def quiet_loading(args) -> None:
    """With --no-progress, transformers' own bars stay off too: loading the weights, and converting a GGUF file
    (a plain tqdm there, which transformers' switch does not reach)."""
    if getattr(args, "no_progress", False):
        import functools

        import transformers.modeling_gguf_pytorch_utils as gguf
        from tqdm.auto import tqdm
        from transformers.utils import logging

        logging.disable_progress_bar()
        gguf.tqdm = functools.partial(tqdm, disable=True)


def device(name: str | None) -> None:
    if name is None:
        return
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise InputError(f"unknown device {name!r}: use cpu, cuda or cuda:N") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"--device {name}: torch sees no CUDA GPU here; use --device cpu (or leave it out)")


def graph_device(name: str | None) -> None:
    """--cuda-graph: the model goes to a CUDA device (`name`, or the default where torch sees one)."""
    import torch

    if (name is None and not torch.cuda.is_available()) or (name is not None and torch.device(name).type != "cuda"):
        raise UnsupportedError(f"--cuda-graph replays decoding steps on a CUDA GPU, and the model would run on "
                               f"{name or 'cpu (torch sees no CUDA GPU here)'}: leave --cuda-graph out")


# -- the commands ------------------------------------------------------------------------------
def generate(args) -> int:
    text = read_text(args.context)
    if not args.question.strip():
        raise InputError("--question is empty: ask something about the context")
    check_sampling(args)
    model_name(args.model)
    spec = args.method if args.method is not None else default_spec(args.model)  # None: known once loaded
    if spec is not None:
        name, params = parse_spec(spec)
        if params.get("sliding") is not None:  # refused before torch loads, where it can be
            runs_here(argparse.Namespace(name=name, sliding=params["sliding"], label=name), args.model)
        check_budget_given(spec, args.budget)
        m = method(spec, args.budget, args.prefill_chunk)
        runs_here(m, args.model)
        if args.cuda_graph:
            from .graphs import refuse_graph

            refuse_graph(m)
    else:  # the default is known once the model loads: what every candidate refuses is refused now
        from .defaults import CANDIDATES

        check_protected(min(CANDIDATES, key=lambda c: sum(protected(c))), args.budget, args.prefill_chunk)
    device(args.device)
    if args.cuda_graph:
        graph_device(args.device)

    from .generation import generate as run
    from .model import load_model
    from .progress import ProgressBars

    if sys.stderr.isatty() and not args.no_progress:
        print(f"loading {args.model or 'smollm2-135m'} ...", file=sys.stderr, end="\r", flush=True)
    quiet_loading(args)
    model, tok = load_model(args.model, device=args.device)
    if spec is None:  # the default method, for the loaded model (checked before any forward)
        from .defaults import default_method

        spec = default_method(model)
        m = method(spec, args.budget, args.prefill_chunk)
        runs_here(m, args.model)
    bars = None if args.no_progress else ProgressBars(decode=not sys.stdout.isatty())
    out = run(model, tok, text, args.question, m, args.max_new_tokens, **sampling(args),
              streamer=Streamer(tok, args.stop), prefill_chunk=args.prefill_chunk, progress=bars,
              cuda_graph=args.cuda_graph)
    print(f"[{out.stats}]", file=sys.stderr)
    return 0


def default_spec(name) -> str | None:
    """The default method's spec for the model `name`, from its config alone where that can be read
    without loading the model (a bundled model once converted, a local folder); None otherwise."""
    from .model import BUNDLED, DEFAULT_MODEL, cache_dir

    text = str(name or DEFAULT_MODEL)
    folder = cache_dir() / text if text in BUNDLED else Path(text).expanduser()
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig

    from .defaults import default_method

    try:
        config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError):
        return None
    return default_method(config)


def methods(args) -> int:
    from . import catalog

    width = shutil.get_terminal_size((1000, 24)).columns  # $COLUMNS, else the terminal's; piped: whole lines
    print(catalog.detail(args.name, width) if args.name else catalog.table(width))
    return 0


def demo(args) -> int:
    model_name(args.model)
    for spec in args.methods or []:
        if spec != "default":  # the model's default method, named once the model loads
            method(spec, None if spec == "full" else args.budget)
    eval_module("demo").run_demo(args.methods, args.budget, args.length, args.samples, args.model)
    return 0


def train_scorer(args) -> int:
    """`kvmerge train-scorer`: fit and save the learned scorer for a model (kvmerge/train_scorer.py)."""
    import time

    from tqdm import tqdm

    model_name(args.model)
    out = None
    if args.out is not None:  # checked before the model loads
        out = writable("--out", args.out)
        if out.suffix != ".safetensors":
            raise InputError(f"--out {args.out}: name the weights file NAME.safetensors (learnedzip looks for those)")
    quiet_loading(args)
    from .model import BUNDLED, DEFAULT_MODEL
    from .scorer import Scorer, check_destination, search_folders, trained_path
    from .train_scorer import main as train

    check_destination(out)
    start, bar = time.perf_counter(), None
    if out is None and (args.model is None or args.model in BUNDLED):
        print(f"training {args.model or DEFAULT_MODEL}, a bundled model whose weights ship with kvmerge: these take "
              "their place (delete the file written to go back); --model FOLDER trains your own model's",
              file=sys.stderr)
    print("loading the model and cutting the training text ...", file=sys.stderr, flush=True)

    def progress(done, total):
        nonlocal bar
        bar = bar or tqdm(total=total, desc="KVzip targets", unit="piece", file=sys.stderr, disable=args.no_progress)
        bar.update(done - bar.n)

    try:
        path = train(args.model, out, texts=args.texts, held=args.held, length=args.length, seed=args.seed,
                     ridge=args.ridge, kind=args.kind, hidden=args.hidden, epochs=args.epochs, target=args.target,
                     progress=progress)
    finally:
        if bar is not None:
            bar.close()
    scorer = Scorer.load(path)
    meta = scorer.meta
    print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB) in {time.perf_counter() - start:.0f} s; agreement with "
          f"KVzip on {plural(meta['held_back'], 'held-back piece')}: top-10% {meta['top10_overlap']:.3f}, "
          f"top-25% {meta['top25_overlap']:.3f} per head (a random ranking's: 0.100, 0.250)")
    if meta["top10_overlap"] <= 0.1 or meta["top25_overlap"] <= 0.25:
        print("these weights rank no better than chance on the held-back pieces: train on more or longer pieces "
              "(--texts, --length)", file=sys.stderr)
    if args.kind != "linear":
        print(f"{args.kind} weights are read by --method learnedzip:scorer={args.kind}; the default method reads the "
              "linear scorer's (train-scorer without --kind)", file=sys.stderr)
    own = trained_path(scorer.model, args.kind)  # the cache's file for this model: read before any folder
    searched = out is None or bool({out.resolve(), out.resolve().parent} & {f.resolve() for f in search_folders()})
    steps = [] if searched else [f"set KVMERGE_SCORERS={out.resolve().parent} in the environment"]
    if out is not None and own.exists() and own.resolve() != out.resolve():
        steps.insert(0, f"delete {own}, trained here earlier, which learnedzip reads before any folder")
    if steps:
        print(f"for learnedzip to read {out}: {' and '.join(steps)}", file=sys.stderr)
    return 0


