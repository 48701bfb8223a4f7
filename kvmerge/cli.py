"""Command line: `kvmerge demo | eval | report | bench | methods`."""

from __future__ import annotations

import argparse
import sys


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvmerge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="full cache vs SemantiCache vs CentroidKV on needle prompts")
    demo.add_argument("--methods", type=_csv(str), default=None)
    demo.add_argument("--budget", type=float, default=0.25)
    demo.add_argument("--length", type=int, default=2048)
    demo.add_argument("--samples", type=int, default=3)
    demo.add_argument("--model", default=None, help="local HF folder or .gguf (default: bundled SmolLM2)")

    sub.add_parser("methods", help="list the available methods")

    args = parser.parse_args(argv)
    if args.command == "methods":
        from .methods import available_methods

        print("\n".join(available_methods()))
    elif args.command == "demo":
        from .demo import run_demo

        run_demo(args.methods, args.budget, args.length, args.samples, args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
