"""kvmerge's command line: generate, compress, ask, inspect, methods, demo, eval, report, bench, suites,
train-scorer (also `python -m kvmerge`).

A mistake ends in one line on stderr that names the problem and the fix, with exit status 2; `--debug`
(or KVMERGE_DEBUG=1) shows the traceback instead. Everything that can be checked without the model
(method spec and parameter types, budget, files, model name, what a runtime refuses) is checked
before the model loads. `--help` imports neither torch nor transformers, and
`methods` neither once its table is cached (the first run, and the first after an upgrade, builds it).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from .defaults import RULE
from .errors import KVMergeError, one_line, suggest

TASKS = ("niah", "ruler", "fidelity", "code", "family", "ruler-real")
DEMO_METHODS = ("full", "semanticache", "centroidkv", "streamingllm", "snapkv", "surprisemerge", "mixedmerge")
EPILOG = "Errors print one line; --debug or KVMERGE_DEBUG=1 prints the traceback."


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, with close names suggested for unknown commands and options."""

    _command = None  # the subcommand named in the arguments, for suggestions among its options

    def parse_args(self, args=None, namespace=None):
        _Parser._command = next((a for a in args or [] if not a.startswith("-")), None)
        return super().parse_args(args, namespace)

    def error(self, message):
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            what, word, options = choice.groups()
            options = [o.strip(" '") for o in options.split(",")]
            what = "command" if what in ("command", "COMMAND") else what
            message = f"unknown {what} {word!r}{suggest(word, options)}; choose from {', '.join(options)}"
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        prog = self.prog
        if unknown:
            word = unknown.group(1).split()[0]
            command = self._command if self._command in _commands(self) else None
            prog = f"kvmerge {command}" if command else prog
            what = "option" if word.startswith("-") else "argument"
            message = f"unknown {what} {word!r}{suggest(word, _options(self, command))}" + \
                (f" (kvmerge {command} --help lists its options)" if command else "")
            if command in ("ask", "inspect") and word.split("=")[0] in ("--method", "--budget", "--prefill-chunk"):
                message = f"{word.split('=')[0]} does not apply: a .kvz file is answered as kvmerge compress made it"
        raise _fail(prog, message)


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every option that takes a value shows its default, "(default: none)" for None, unless its help
    says it already; flags (on when given) and positionals show none."""

    def _get_help_string(self, action):
        help = action.help or ""
        if "default" in help or not action.option_strings or action.nargs == 0 or action.required \
                or action.default is argparse.SUPPRESS:
            return help
        value = action.default
        shown = "none" if value is None else ",".join(map(str, value)) if isinstance(value, list) else str(value)
        return f"{help} (default: {shown.replace('%', '%%')})"


def _commands(parser) -> list[str]:
    return [name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices]


def _options(parser, command: str | None = None) -> list[str]:
    """The option strings of `parser` and of its subcommand `command` (None: of every subcommand)."""
    out = [o for a in parser._actions for o in a.option_strings]
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            out += [o for name, p in a.choices.items() if command in (None, name) for o in _options(p)]
    return sorted(set(out))


class Exit(SystemExit):
    """Exit status `code` (2: a mistake) after the one line on stderr; `str()` is that line."""

    def __init__(self, line: str, code: int = 2):
        super().__init__(code)
        self.line = line

    def __str__(self) -> str:
        return self.line


def _fail(prog: str, message: str, code: int = 2) -> Exit:
    line = f"{prog}: {one_line(message)}"
    print(line, file=sys.stderr)
    return Exit(line, code)


# -- argument types: each refuses a bad value in one line -------------------------------------
def _csv(kind):
    def parse(text):
        items = [kind(x.strip()) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        return items
    parse.__name__ = getattr(kind, "__name__", "list")
    return parse


ESCAPES = {"n": "\n", "t": "\t", ",": ",", "\\": "\\"}


def _stops(text: str) -> list[str]:
    """Stop strings: split at commas, `\\n` a newline, `\\t` a tab, `\\,` a comma, `\\\\` a backslash
    (a real newline, as from bash's $'\\n', is taken as it is); spaces around each are dropped."""
    items, part, i = [], "", 0
    while i < len(text):
        if text[i] == "\\" and text[i + 1:i + 2] in ESCAPES:
            part, i = part + ESCAPES[text[i + 1]], i + 2
            continue
        if text[i] == ",":
            items.append(part)
            part = ""
        else:
            part += text[i]
        i += 1
    items = [x.strip(" ") for x in [*items, part] if x.strip(" ")]
    if not items:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of stop strings (\\n a newline, \\, a "
                                         f"comma), got {text!r}")
    return items


def _method(text: str) -> str | None:
    """A method spec; "default" (as in eval's --methods) is the model's default, as if left out."""
    return None if text == "default" else text


def _budget(text: str) -> float | int:
    """A fraction in (0, 1] ("0.25", "25%") or a whole number of entries ("400")."""
    try:
        value = float(text.rstrip("%")) / 100 if text.endswith("%") else int(text) if text.isdigit() else float(text)
    except ValueError:
        value = None
    if value is None or isinstance(value, float) and not 0 < value <= 1 or isinstance(value, int) and value < 1:
        raise argparse.ArgumentTypeError(f"a budget is a fraction of the context in (0, 1] (e.g. 0.25) or a whole "
                                         f"number of entries (e.g. 400), got {text!r}")
    return value


def _number(kind, low=None, high=None, low_open=False, what="a number"):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        bad = value is None or not math.isfinite(value) or \
            (low is not None and (value <= low if low_open else value < low)) or \
            (high is not None and value > high)
        if bad:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    parse.__name__ = kind.__name__
    return parse


_positive = _number(int, 1, what="a whole number >= 1")
_count = _number(int, 0, what="a whole number >= 0")


def _fraction_list(text):
    return [_number(float, 0, 1, low_open=True, what="fractions in (0, 1], e.g. 0.5,0.25")(x) for x in
            _csv(str)(text)]


def _answer_args(p) -> None:
    """The options of an answer, `generate`'s and `ask`'s: its length, sampling and stop strings."""
    p.add_argument("--max-new-tokens", type=_positive, default=64, metavar="N", help="the longest answer, in tokens")
    p.add_argument("--temperature", type=_number(float, 0, what="a number >= 0"), default=0.0, metavar="T", help="0: greedy")
    p.add_argument("--top-k", type=_count, default=0, metavar="K", help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=_number(float, 0, 1, low_open=True, what="a number in (0, 1]"), default=1.0,
                   metavar="P", help="sample from the smallest set of tokens with this probability")
    p.add_argument("--seed", type=int, default=None, metavar="N", help="seed of the sampler (default: none, a fresh seed each "
                   "run)")
    p.add_argument("--stop", type=_stops, action="extend", default=None, metavar="TEXT",
                   help="strings that end the answer, comma-separated or the option repeated; \\n is a newline, \\, a "
                   "comma (default: none; the end of the model's turn ends it)")


def _parser() -> argparse.ArgumentParser:
    fmt = _Help
    parser = _Parser(prog="kvmerge", description="KV-cache compression by merging tokens, for Hugging Face models. "
                     "Start with: kvmerge generate --context FILE --question TEXT, or kvmerge demo.",
                     epilog=EPILOG, formatter_class=fmt)
    debug_help = "print tracebacks instead of one-line errors (before or after the command)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    common = argparse.ArgumentParser(add_help=False)  # every command takes --debug too (set only when given)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    add_parser = sub.add_parser
    sub.add_parser = lambda *a, **kw: add_parser(*a, parents=[common], **kw)
    model_help = "a bundled model (smollm2-135m, gemma3-270m), a local folder, a .gguf file or a hub id org/name"

    gen = sub.add_parser("generate", help="answer a question about a text file, streaming the answer",
                         formatter_class=fmt, epilog=EPILOG)
    gen.add_argument("--context", required=True, metavar="FILE", help="UTF-8 text file with the context; - reads stdin")
    gen.add_argument("--question", required=True, metavar="TEXT", help="the question, asked after the context is compressed")
    gen.add_argument("--method", type=_method, default=None, metavar="SPEC",
                     help="a method spec NAME[:param=value...], e.g. snapkv:kernel=5 (kvmerge methods lists them; "
                     f"full: no compression) (default: {RULE})")
    gen.add_argument("--budget", type=_budget, default=None, metavar="B",
                     help="what the cache keeps: a fraction of the context in (0, 1] (0.25 or 25%%) or a whole number of entries "
                     "(or a spec's budget=) (default: 0.25)")
    _answer_args(gen)
    gen.add_argument("--model", default=None, metavar="NAME", help=f"{model_help} (default: smollm2-135m)")
    gen.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    gen.add_argument("--prefill-chunk", type=_positive, default=None, metavar="N",
                     help="prefill and compress N tokens at a time (bounded memory; not every method) (default: "
                     "none, the whole context at once)")
    gen.add_argument("--cuda-graph", action="store_true",
                     help="decode by replaying one captured CUDA graph (a CUDA device; not for methods that choose "
                     "entries while decoding)")
    gen.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    comp = sub.add_parser("compress", help="compress a text file once into a .kvz file (kvmerge ask answers from it)",
                          formatter_class=fmt, epilog=EPILOG)
    comp.add_argument("--context", required=True, metavar="FILE", help="UTF-8 text file with the context; - reads stdin")
    comp.add_argument("--out", required=True, metavar="FILE.kvz", help="the compressed context's file")
    comp.add_argument("--method", type=_method, default=None, metavar="SPEC", help=f"a method spec (default: {RULE}); a costly one "
                      "pays off here, e.g. zipguardmerge")
    comp.add_argument("--budget", type=_budget, default=None, metavar="B",
                      help="what the cache keeps: a fraction of the context in (0, 1] (0.25 or 25%%) or a whole number of entries "
                      "(or a spec's budget=) (default: 0.25)")
    comp.add_argument("--model", default=None, metavar="NAME", help=f"{model_help} (default: smollm2-135m)")
    comp.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    comp.add_argument("--prefill-chunk", type=_positive, default=None, metavar="N",
                      help="prefill and compress N tokens at a time (default: none, the whole context at once)")
    comp.add_argument("--no-ids", action="store_true", help="store only a hash of the context's token ids (no text "
                      "can be shown by kvmerge inspect, nor model.generate check its input)")
    comp.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    ask = sub.add_parser("ask", help="answer questions from a .kvz file, streaming the answers",
                         formatter_class=fmt, epilog=EPILOG)
    ask.add_argument("file", metavar="FILE.kvz", help="a compressed context (kvmerge compress)")
    ask.add_argument("--question", action="append", required=True, metavar="TEXT",
                     help="a question (repeat for several; - reads one per line from stdin)")
    _answer_args(ask)
    ask.add_argument("--model", default=None, metavar="NAME", help=f"{model_help} (default: the model the file names)")
    ask.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    ask.add_argument("--cuda-graph", action="store_true", help="decode by replaying one captured CUDA graph (a CUDA device)")
    ask.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    insp = sub.add_parser("inspect", help="what a .kvz file holds and which parts of the text it kept",
                          formatter_class=fmt, epilog=EPILOG)
    insp.add_argument("file", metavar="FILE.kvz", help="a compressed context (kvmerge compress)")
    insp.add_argument("--html", default=None, metavar="FILE", help="also write the shaded text as a page")
    insp.add_argument("--png", default=None, metavar="FILE", help="also write a per-layer heatmap")
    insp.add_argument("--color", action="store_true", help="shade the text even when stdout is not a terminal")
    insp.add_argument("--no-text", action="store_true", help="the summary only")
    insp.add_argument("--model", default=None, metavar="NAME", help=f"{model_help} (default: the model the file names)")
    insp.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")

    meth = sub.add_parser("methods", help="the methods: what each does, its cost, where it runs",
                          formatter_class=fmt, epilog=EPILOG)
    meth.add_argument("name", nargs="?", default=None, help="show this method's parameters and refusals")

    demo = sub.add_parser("demo", help="full cache against several methods on needle prompts",
                          formatter_class=fmt, epilog=EPILOG)
    demo.add_argument("--methods", type=_csv(str), default=None, help="method specs, comma-separated (default: "
                      f"{','.join(DEMO_METHODS)} and the model's default method)")
    demo.add_argument("--budget", type=_number(float, 0, 1, low_open=True, what="a fraction in (0, 1]"),
                      default=0.25, help="fraction of the context kept")
    demo.add_argument("--length", type=_positive, default=2048, help="context tokens")
    demo.add_argument("--samples", type=_positive, default=3, help="needle prompts")
    demo.add_argument("--model", default=None, help=f"{model_help} (default: smollm2-135m)")

    sub.add_parser("suites", help="the named benchmark suites (kvmerge eval --suite NAME)", formatter_class=fmt,
                   epilog=EPILOG)

    train = sub.add_parser("train-scorer", help="fit learnedzip's scorer for a model (minutes on a CPU)",
                           formatter_class=fmt, epilog=EPILOG)
    train.add_argument("--model", default=None, help=f"{model_help} (default: smollm2-135m)")
    train.add_argument("--texts", type=_positive, default=100, help="training pieces of --length tokens")
    train.add_argument("--held", type=_positive, default=6, help="held-back pieces the agreement with KVzip is read on")
    train.add_argument("--length", type=_number(int, 64, what="a whole number >= 64"), default=None,
                       help="tokens per piece (default: 1024, or the longest the model's positions fit; time grows "
                       "about 2.4x per doubling)")
    train.add_argument("--seed", type=int, default=0, help="the pieces' order and split")
    train.add_argument("--kind", choices=["linear", "mlp"], default="linear",
                       help="linear: ridge regression per layer; mlp: one hidden layer (learnedzip:scorer=mlp)")
    train.add_argument("--ridge", type=_number(float, 0, what="a number >= 0"), default=1e-2, help="linear: penalty, relative to the features' mean square")
    train.add_argument("--target", choices=["log", "rank"], default="log",
                       help="log: fit KVzip's log scores; rank: fit each head's order (its rank, to the 4th power), "
                       "then map each head onto KVzip's scores by quantiles")
    train.add_argument("--hidden", type=_positive, default=64, help="mlp: hidden units per layer")
    train.add_argument("--epochs", type=_positive, default=8, help="mlp: passes over the rows")
    train.add_argument("--out", default=None, metavar="FILE.safetensors",
                       help="weights file (default: <cache dir>/scorers/<the model's fingerprint>.safetensors, where "
                       "learnedzip finds them; the cache dir is $KVMERGE_CACHE or ~/.cache/kvmerge; learnedzip also "
                       "looks in the folders of $KVMERGE_SCORERS)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    ev = sub.add_parser("eval", help="accuracy / fidelity per method and budget on a task, or a named suite",
                        formatter_class=fmt, epilog=EPILOG)
    ev.add_argument("--suite", default=None, help="run a named suite (kvmerge suites) into <out>/<suite>/<model>/; "
                    "the other options then do not apply, except --models and --out")
    ev.add_argument("--models", type=_csv(str), default=None, help="with --suite: only these of its models")
    ev.add_argument("--task", choices=TASKS, default="niah", help="the task")
    ev.add_argument("--methods", type=_csv(str), default=["full", "streamingllm", "snapkv", "default", "semanticache",
                                                           "centroidkv"],
                    help="method specs, comma-separated; the word default names the model's default method (default: "
                    "full,streamingllm,snapkv,default,semanticache,centroidkv)")
    ev.add_argument("--budgets", type=_fraction_list, default=[0.5, 0.25], help="fractions kept, comma-separated")
    ev.add_argument("--lengths", type=_csv(_positive), default=[1024, 2048], help="context tokens, comma-separated")
    ev.add_argument("--samples", type=_positive, default=3, help="samples per length (per RULER subtask)")
    ev.add_argument("--subtasks", type=_csv(str), default=None, help="RULER subtasks or task families (default: all)")
    ev.add_argument("--limit", type=_positive, default=None, help="run only the first N samples")
    ev.add_argument("--protocol", choices=["agnostic", "aware"], default="agnostic",
                    help="agnostic: compress before the question is seen; aware: compress with the question")
    ev.add_argument("--text", default=None, help="a genre (docs, legal, manual, code, table, dialogue) or a UTF-8 "
                    "file instead of the built-in prose")
    ev.add_argument("--prefill-chunk", type=_positive, default=None,
                    help="prefill and compress N tokens at a time (rows named <method>@chunk<N>)")
    ev.add_argument("--out", default="results", help="results folder")
    ev.add_argument("--model", default=None, help=f"{model_help} (default: smollm2-135m)")

    bench = sub.add_parser("bench", help="decode speed, compression cost and memory against the full cache",
                           formatter_class=fmt, epilog=EPILOG)
    bench.add_argument("--methods", type=_csv(str), default=["default", "streamingllm", "centroidkv", "semanticache"],
                       help="method specs, comma-separated; the word default names the model's default method "
                       "(default: default,streamingllm,centroidkv,semanticache)")
    bench.add_argument("--budget", type=_budget, default=0.25, help="a fraction (0.25 or 25%%), or a whole number of entries")
    bench.add_argument("--lengths", type=_csv(_positive), default=[1024, 2048, 4096, 8192], help="context tokens")
    bench.add_argument("--batches", type=_csv(_positive), default=[1, 4, 8], help="batch sizes")
    bench.add_argument("--steps", type=_positive, default=32, help="decode steps timed")
    bench.add_argument("--out", default="results/bench", help="results folder")
    bench.add_argument("--memory", action="store_true",
                       help="peak cache and process memory of the prefill instead (full, one-shot, chunked; "
                            "the first method), each in a fresh process")
    bench.add_argument("--prefill-chunk", type=_positive, default=None,
                       help="prefill N tokens at a time (decode rows), the chunk of --memory's rows (default 1024)")
    bench.add_argument("--model", default=None, help=f"{model_help} (default: smollm2-135m)")

    rep = sub.add_parser("report", help="tables and plots of a results folder, or a suite's tables",
                         formatter_class=fmt, epilog=EPILOG)
    rep.add_argument("folder", nargs="?", default=None, help="a results folder (kvmerge eval --out)")
    rep.add_argument("--suite", default=None, help="print a named suite's tables (results in <root>/<suite>/<model>/)")
    rep.add_argument("--root", default="results", help="with --suite: where its results are")
    rep.add_argument("--models", type=_csv(str), default=None, help="with --suite: only these models")
    rep.add_argument("--budgets", type=_fraction_list, default=None, help="with --suite: only these budgets' columns")
    rep.add_argument("--no-plots", action="store_true", help="tables only")
    rep.add_argument("--methods", type=_csv(str), default=None, help="only these method specs, as run")
    rep.add_argument("--plots-to", default=None, help="folder for the PNGs (default: the results folder; with --suite, "
                     "plots only when given: a RULER suite's average against the budget)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    debug = args.debug or os.environ.get("KVMERGE_DEBUG", "") not in ("", "0")
    try:
        return _run(args) or 0
    except BrokenPipeError:  # the reader went away (`kvmerge methods | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        if debug:
            raise
        raise _fail(f"kvmerge {args.command}", "interrupted", 130) from None
    except Exception as e:  # noqa: BLE001 - one line for every failure unless --debug
        if debug:
            raise
        if isinstance(e, (KVMergeError, ValueError, TypeError, OSError, LookupError)):
            raise _fail(f"kvmerge {args.command}", one_line(e)) from None
        message = f"{type(e).__name__}: {one_line(e)} (unexpected: run again with --debug for the traceback)"
        raise _fail(f"kvmerge {args.command}", message, 1) from None


def _run(args) -> int:
    from . import commands, context_commands, eval_commands

    name = args.command.replace("-", "_")
    module = next((m for m in (context_commands, eval_commands) if name in m.COMMANDS), commands)
    return getattr(module, name)(args)


if __name__ == "__main__":
    sys.exit(main())
