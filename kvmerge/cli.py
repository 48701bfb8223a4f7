"""Command line: `kvmerge generate | demo | eval | report | bench | methods | suites` (also `python -m kvmerge`).

Everything but `generate` and `methods` runs the evaluation package `kvmerge_eval` (`pip install kvmerge[eval]`).
"""

from __future__ import annotations

import argparse
import importlib
import sys


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def _budget(text: str) -> float | int:
    return int(text) if text.isdigit() else float(text)


def _eval(module: str):
    """A module of `kvmerge_eval`, or a clear error if the eval extra is not installed."""
    try:
        return importlib.import_module(f"kvmerge_eval.{module}")
    except ModuleNotFoundError as e:
        raise SystemExit(f"kvmerge: this command needs the evaluation extra ({e.name} is missing): "
                         "pip install 'kvmerge[eval]'") from e


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmerge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="full cache vs SemantiCache vs CentroidKV on needle prompts")
    demo.add_argument("--methods", type=_csv(str), default=None,
                      help="default: full, semanticache, centroidkv, streamingllm, snapkv, surprisemerge, expectmerge")
    demo.add_argument("--budget", type=float, default=0.25)
    demo.add_argument("--length", type=int, default=2048)
    demo.add_argument("--samples", type=int, default=3)
    demo.add_argument("--model", default=None, help="gemma3-270m, a local folder, .gguf or model id (default: bundled SmolLM2)")

    sub.add_parser("methods", help="list the available methods")

    gen = sub.add_parser("generate", help="answer a question about a text file, streaming the answer")
    gen.add_argument("--context", required=True, help="UTF-8 text file with the context (- reads stdin)")
    gen.add_argument("--question", required=True)
    gen.add_argument("--method", default="expectmerge", help="a method spec, e.g. snapkv:kernel=5 (full: none)")
    gen.add_argument("--budget", type=float, default=0.25)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", type=_csv(str), default=None, help="comma-separated stop strings")
    gen.add_argument("--model", default=None, help="local folder, .gguf or model id (default: bundled SmolLM2)")
    gen.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    gen.add_argument("--prefill-chunk", type=int, default=None, help="prefill and compress N tokens at a time")

    sub.add_parser("suites", help="list the named benchmark suites (kvmerge eval --suite NAME)")

    ev = sub.add_parser("eval", help="accuracy / fidelity per method and budget on a task, or a named suite")
    ev.add_argument("--suite", default=None, help="run a named suite (kvmerge suites) into <out>/<suite>/<model>/; "
                    "the other options then do not apply, except --models and --out")
    ev.add_argument("--models", type=_csv(str), default=None, help="with --suite: only these of its models")
    ev.add_argument("--task", choices=["niah", "ruler", "fidelity", "code", "family", "ruler-real"], default="niah")
    ev.add_argument("--methods", type=_csv(str), default=["full", "streamingllm", "snapkv", "semanticache",
                                                           "centroidkv"])
    ev.add_argument("--budgets", type=_csv(float), default=[0.5, 0.25])
    ev.add_argument("--lengths", type=_csv(int), default=[1024, 2048])
    ev.add_argument("--samples", type=int, default=3, help="samples per length (per RULER subtask)")
    ev.add_argument("--subtasks", type=_csv(str), default=None, help="RULER subtasks or task families (default: all)")
    ev.add_argument("--limit", type=int, default=None, help="run only the first N samples")
    ev.add_argument("--protocol", choices=["agnostic", "aware"], default="agnostic")
    ev.add_argument("--text", default=None, help="a genre (docs, legal, code, table, dialogue) or a UTF-8 file instead of the built-in prose")
    ev.add_argument("--prefill-chunk", type=int, default=None,
                    help="prefill and compress N tokens at a time (rows named <method>@chunk<N>)")
    ev.add_argument("--out", default="results")
    ev.add_argument("--model", default=None, help="gemma3-270m, a local folder, .gguf or model id (default: SmolLM2)")

    bench = sub.add_parser("bench", help="decode speed, compression cost and memory vs the full cache")
    bench.add_argument("--methods", type=_csv(str), default=["streamingllm", "centroidkv", "semanticache"])
    bench.add_argument("--budget", type=_budget, default=0.25, help="a fraction, or a whole number of entries")
    bench.add_argument("--lengths", type=_csv(int), default=[1024, 2048, 4096, 8192])
    bench.add_argument("--batches", type=_csv(int), default=[1, 4, 8])
    bench.add_argument("--steps", type=int, default=32)
    bench.add_argument("--out", default="results/bench")
    bench.add_argument("--memory", action="store_true",
                       help="peak cache and process memory of the prefill instead (full, one-shot, chunked; "
                            "the first method), each in a fresh process")
    bench.add_argument("--prefill-chunk", type=int, default=None,
                       help="prefill N tokens at a time (decode rows), the chunk of --memory's rows (default 1024)")
    bench.add_argument("--model", default=None, help="gemma3-270m, a local folder, .gguf or model id (default: SmolLM2)")

    rep = sub.add_parser("report", help="tables and plots of a results folder, or a suite's tables")
    rep.add_argument("folder", nargs="?", default=None)
    rep.add_argument("--suite", default=None, help="print a named suite's tables (results in <root>/<suite>/<model>/)")
    rep.add_argument("--root", default="results", help="with --suite: where its results are")
    rep.add_argument("--models", type=_csv(str), default=None, help="with --suite: only these models")
    rep.add_argument("--budgets", type=_csv(float), default=None, help="with --suite: only these budgets' columns")
    rep.add_argument("--no-plots", action="store_true")
    rep.add_argument("--methods", type=_csv(str), default=None, help="only these method specs, as run")
    rep.add_argument("--plots-to", default=None, help="folder for the PNGs (default: the results folder)")

    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return _run(parser, args)
    except (ValueError, FileNotFoundError) as e:
        if getattr(args, "suite", None) is None:
            raise
        raise SystemExit(f"kvmerge {args.command}: {e}") from e


def _run(parser, args) -> int:
    if args.command == "methods":
        from .methods import available_methods

        print("\n".join(available_methods()))
    elif args.command == "generate":
        _generate(args)
    elif args.command == "demo":
        _eval("demo").run_demo(args.methods, args.budget, args.length, args.samples, args.model)
    elif args.command == "suites":
        suites = _eval("suites")
        for name in suites.available():
            print(f"{name:16} {suites.load(name).title}")
    elif args.command == "eval" and args.suite:
        suites = _eval("suites")
        suite = suites.load(args.suite)
        suites.run_suite(suite, args.models, args.out)
        print(suites.report(suite, args.out, args.models))
    elif args.command == "eval":
        from .model import load_model

        runner, report = _eval("runner"), _eval("report")
        model, tok = load_model(args.model)
        runner.run(args.task, model, tok, args.methods, args.budgets, args.lengths, args.samples, args.out,
                   args.protocol, args.text, args.limit, args.subtasks, args.prefill_chunk)
        print(report.report(args.out, plots=False))
    elif args.command == "bench":
        from .model import load_model

        if args.memory:
            memory = _eval("memory")
            print(memory.HEADER)
            memory.table(args.model, args.methods[0], args.budget, args.lengths, args.prefill_chunk or 1024)
            return 0
        bench = _eval("bench")
        model, tok = load_model(args.model)
        rows, profiles = bench.run_bench(model, args.methods, args.budget, args.lengths, args.batches, args.steps,
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
              f"batch {b}: {x['linear_ms']:.1f} ms" for b, x in {x["batch"]: x for x in rows}.items())
              + f") + cache bytes / packed decode SDPA's read rate {r['attention_gbs']:.1f} GB/s, same run")
        for spec, parts in profiles.items():
            print(f"profile, {spec}, batch {max(args.batches)} x {max(args.lengths)} tokens, ms/step: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
        o = bench.bias_overhead(model, max(args.lengths), max(args.batches), args.steps)
        print(f"attention alone, biased with log_n = 0 vs stock SDPA, batch {o['batch']} x {o['length']} tokens: "
              f"{o['biased_ms']:.1f} vs {o['stock_ms']:.1f} ms/step ({o['overhead']:+.1%})")
    elif args.command == "report" and args.suite:
        suites = _eval("suites")
        print(suites.report(suites.load(args.suite), args.root, args.models, args.budgets))
    elif args.command == "report":
        if args.folder is None:
            parser.error("report needs a results folder or --suite NAME")
        print(_eval("report").report(args.folder, plots=not args.no_plots, methods=args.methods, plot_dir=args.plots_to))
    return 0


def _generate(args) -> None:
    from transformers import TextStreamer

    from .generate import generate
    from .methods import method_from_spec
    from .model import load_model

    text = sys.stdin.read() if args.context == "-" else open(args.context, encoding="utf-8").read()
    model, tok = load_model(args.model, device=args.device)
    method = method_from_spec(args.method, args.budget)
    out = generate(model, tok, text, args.question, method, args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop=args.stop,
                   streamer=TextStreamer(tok, skip_special_tokens=True), prefill_chunk=args.prefill_chunk)
    st = out.stats
    print(f"[{st['method']}: {st['context_tokens']} context tokens, cache {st['cache_bytes'] / 2**20:.1f} MiB of "
          f"{st['full_cache_bytes'] / 2**20:.1f} MiB, prefill {st['prefill_seconds']:.1f} s, "
          f"compress {st['compress_seconds']:.1f} s]", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
