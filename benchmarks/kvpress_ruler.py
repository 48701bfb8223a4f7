"""kvpress's presses on NVIDIA's RULER samples, the very samples `kvmerge_eval.ruler_real` generated and
cached, through kvpress's own pipeline, as its RULER leaderboard runs them: question-agnostic (the
context compressed alone), greedy, each task's max_new_tokens, scored by RULER's own metric functions
after kvpress's post-processing. One JSON line per (press, ratio, sample), in kvmerge's results-row
format, so that kvmerge's and kvpress's rows stand side by side.

Run from the repository root (`make setup-kvpress setup-ruler` first; this file imports no kvmerge):

    .venv/bin/python -c "from kvmerge_eval import ruler_real; ruler_real.generate('smollm2-135m', 4096, 3)"
    .venv-kvpress/bin/python benchmarks/kvpress_ruler.py --model smollm2-135m --length 4096 --samples 3 \\
        --presses snapkv,expected_attention --ratios 0.5,0.75,0.9 --out results/kvpress_ruler.jsonl

The model is the bundled model's converted folder `$KVMERGE_CACHE/<model>` (default ~/.cache/kvmerge; made
by `kvmerge.load_model(<model>)` in kvmerge's venv), loaded float32 on CPU with sdpa attention. The samples
are read from `$KVMERGE_CACHE/ruler/<tokenizer id>/<length>/<task>_<samples>.jsonl` (the tokenizer id is
`ruler_real.tokenizer_id`'s hash, recomputed here). Rows already in `--out` are skipped (resumable).
A row: {"method": "kvpress:<press>", "budget": 1 - ratio, "task", "length", "seed" (the sample's index),
"answer", "prediction", "score", "answer_prefix", "max_new_tokens", "model", "press", "seconds", "date"}.

Gemma-3's sliding-window layers: kvmerge keeps them whole (or, with `sliding=`, their last slots) and
compresses the global layers. kvpress 0.5.5 means to skip them too, but its check names only
`Gemma3ForConditionalGeneration`; on the text-only `Gemma3ForCausalLM` (Gemma-3-270M) its pipeline's cache
(a `DynamicCache` made without the model's config) holds every position of every layer, windowed by the mask,
and every layer is compressed. Its own rule cannot be forced there: the question's pass then sizes the
global layers' mask from layer 0 (a sliding layer held whole) and fails. So on such a model the rows of a
press are named `kvpress:<press>:compress-sliding` (`no_press` keeps its name: nothing is compressed):
another method than kvmerge's twin, not compared.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
         "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
PRESS_NAMES = ("no_press", "snapkv", "expected_attention", "expected_attention_uniform", "streaming_llm", "keydiff",
               "kvzip", "kvzip_plus", "tova", "pyramidkv", "knorm", "merging_expected_attention")
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt", "*.model")


def presses() -> dict:
    """Press name → constructor: no press, kvpress's leaderboard presses on RULER (question-agnostic),
    named as in kvpress's evaluation/evaluate_registry.py, and MergingPress over Expected Attention."""
    from kvpress import (
        AdaKVPress,
        ExpectedAttentionPress,
        KeyDiffPress,
        KnormPress,
        KVzipPress,
        MergingPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    return {  # the keys are PRESS_NAMES
        "no_press": lambda: None,  # the full cache, once per sample (budget 1)
        "snapkv": SnapKVPress,
        "expected_attention": lambda: AdaKVPress(ExpectedAttentionPress(epsilon=1e-2)),
        "expected_attention_uniform": ExpectedAttentionPress,  # no AdaKV: what kvmerge's default compares with
        "streaming_llm": StreamingLLMPress,
        "keydiff": KeyDiffPress,
        "kvzip": KVzipPress,
        "kvzip_plus": lambda: KVzipPress(kvzip_plus_normalization=True),
        "tova": TOVAPress,
        "pyramidkv": PyramidKVPress,
        "knorm": KnormPress,
        "merging_expected_attention": lambda: MergingPress(ExpectedAttentionPress()),
    }


def cache_dir() -> Path:
    return Path(os.environ.get("KVMERGE_CACHE", Path.home() / ".cache" / "kvmerge"))


def tokenizer_id(folder: Path) -> str:
    """12 hex digits of a SHA-256 over the folder's tokenizer files, as `kvmerge_eval.ruler_real.tokenizer_id`."""
    h = hashlib.sha256()
    files = sorted({p for pattern in TOKENIZER_FILES for p in Path(folder).glob(pattern) if p.is_file()})
    if not files:
        raise ValueError(f"no tokenizer files in {folder}")
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def load_samples(model: str, length: int, samples: int, tasks) -> list[dict]:
    """The cached rows of `kvmerge_eval.ruler_real.generate(model, length, samples, tasks)`."""
    folder = cache_dir() / model
    rows = []
    for task in tasks:
        path = cache_dir() / "ruler" / tokenizer_id(folder) / str(length) / f"{task}_{samples}.jsonl"
        if not path.exists():
            sys.exit(f"no RULER samples at {path}: generate them in kvmerge's venv: .venv/bin/python -c \"from "
                     f"kvmerge_eval import ruler_real; ruler_real.generate('{model}', {length}, {samples})\"")
        rows += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def _package_file(relative: str):
    """A module of NVIDIA's RULER package loaded by file path (none of its package __init__ runs)."""
    spec = importlib.util.find_spec("long_context_eval")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("NVIDIA's RULER package is not installed in this venv: run `make setup-ruler`")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    module_spec = importlib.util.spec_from_file_location(f"ruler_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return path, module


def scorer():
    """(task, prediction, answers) → score in [0, 1]: RULER's per-sample metric of the task's generator
    (synthetic.yaml), after kvpress's post-processing (strip, drop \\x00-\\x1f, strip)."""
    import yaml

    path, metrics = _package_file("eval/synthetic/constants.py")
    generators = {t: c["task"] for t, c in yaml.safe_load((path.parents[2] / "synthetic.yaml").read_text()).items()}

    def score(task: str, prediction: str, answers) -> float:
        text = re.sub(r"[\x00-\x1f]", "", prediction.strip()).strip()
        return metrics.TASKS[generators[task]]["metric_fn_per_sample"]([text], [list(answers)])[0] / 100

    return score


def run(args) -> None:
    import kvpress  # noqa: F401  (registers the "kv-press-text-generation" pipeline)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    from transformers.utils import logging

    torch.set_num_threads(args.threads)
    logging.disable_progress_bar()
    registry = presses()
    names = args.presses.split(",")
    for name in names:
        if name not in registry:
            sys.exit(f"unknown press {name!r}; presses: {', '.join(registry)}")
    ratios = [float(r) for r in args.ratios.split(",")]
    data = load_samples(args.model, args.length, args.samples, args.tasks.split(",") if args.tasks else TASKS)
    data = sorted(data, key=lambda r: r["index"])[: args.limit]  # every task's first sample first, as the suite
    score = scorer()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def key(r: dict) -> tuple:  # one file holds every model's rows
        return r["model"], r["method"], round(float(r["budget"]), 6), r["task"], r["length"], r["seed"]

    done = {key(json.loads(line)) for line in out.read_text().splitlines() if line.strip()} if out.exists() else set()

    folder = cache_dir() / args.model
    if not (folder / "config.json").exists():
        sys.exit(f"no converted model at {folder}: run .venv/bin/python -c \"import kvmerge; "
                 f"kvmerge.load_model('{args.model}')\" first")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tok, device="cpu")
    from transformers import Gemma3ForConditionalGeneration  # the one class kvpress skips sliding layers of

    sliding = "sliding_attention" in (getattr(model.config, "layer_types", None) or [])
    suffix = ":compress-sliding" if sliding and not isinstance(model, Gemma3ForConditionalGeneration) else ""
    with out.open("a") as f:
        for name in names:
            method = f"kvpress:{name}" + ("" if name == "no_press" else suffix)  # no press compresses nothing
            for ratio in [0.0] if name == "no_press" else ratios:
                for s in data:
                    row = {"method": method, "budget": round(1 - ratio, 6), "task": s["task"],
                           "length": s["length"], "seed": s["index"], "model": args.model}
                    if key(row) in done:
                        continue
                    press = registry[name]()
                    if press is not None:
                        press.compression_ratio = ratio  # as kvpress's evaluate.py sets it
                    start = time.perf_counter()
                    with torch.inference_mode():
                        prediction = pipe(s["context"], questions=[s["question"]], answer_prefix=s["answer_prefix"],
                                          press=press, max_new_tokens=s["max_new_tokens"])["answers"][0]
                    row.update({"answer": s["answers"], "prediction": prediction,
                                "score": score(s["task"], prediction, s["answers"]),
                                "answer_prefix": s["answer_prefix"], "max_new_tokens": s["max_new_tokens"],
                                "press": repr(press),
                                "seconds": round(time.perf_counter() - start, 2),
                                "date": datetime.date.today().isoformat()})
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    print(f"{name} {ratio} {s['task']}#{s['index']}: {row['score']:.2f} {prediction[:60]!r}",
                          file=sys.stderr)


# keys: press names as kvpress spells them (PRESS_NAMES); values: kvmerge method specs
TWINS = {"no_press": "full", "snapkv": "snapkv", "expected_attention": "expectedattention:alloc=adakv:floor=0.2:epsilon=0.01",
         "expected_attention_uniform": "expectedattention", "keydiff": "keydiff", "streaming_llm": "streamingllm",
         "kvzip": "kvzip", "kvzip_plus": "kvzip:plus=true", "merging_expected_attention": "mergingpress"}
# the twins with kvpress's own parameters, as benchmarks/kvpress_crosscheck.py aligns them (docs/kvpress.md)
ALIGNED = {"snapkv": "snapkv:obs_window=64:kernel=5:window=64:sinks=0", "kvzip": "kvzip:alloc=head:window=0",
           "expected_attention": "expectedattention:alloc=adakv:floor=0.2:epsilon=0.01:window=0",
           "expected_attention_uniform": "expectedattention:window=0", "keydiff": "keydiff:sinks=0:window=0",
           "merging_expected_attention": "mergingpress:window=0"}


def compare(kvpress_rows: Path, kvmerge_rows: Path, model: str) -> str:
    """A markdown table: per press and budget, kvpress's score and kvmerge's twin method's (`TWINS`, and
    `ALIGNED` where those rows exist) on the samples both ran, and on how many of them the two scored
    the same."""
    def read(path):
        return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

    ours = {(r["method"], round(float(r["budget"]), 6), r["task"], r["length"], r["seed"]): r["score"]
            for r in read(kvmerge_rows)}
    theirs = [r for r in read(kvpress_rows) if r["model"] == model]
    lines = ["| kvpress 0.5.5 | kvmerge | budget (ratio) | samples (tasks) | kvpress | kvmerge | same score on |",
             "|---|---|---|---|---|---|---|"]
    pairs = [(press, twin) for press in TWINS for twin in (TWINS[press], ALIGNED.get(press)) if twin]
    for press, twin in pairs:
        for budget in (1.0, 0.5, 0.25, 0.1):
            both = [(r, ours[key]) for r in theirs if r["method"] == f"kvpress:{press}" and abs(r["budget"] - budget) < 1e-6
                    and (key := (twin, budget, r["task"], r["length"], r["seed"])) in ours]
            if both:
                same = sum(abs(r["score"] - o) < 1e-9 for r, o in both)
                lines.append(f"| `{press}` | `{twin}` | {budget:.0%} ({1 - budget:.2f}) | {len(both)} "
                             f"({len({r['task'] for r, _ in both})}) | {sum(r['score'] for r, _ in both) / len(both):.1%} | "
                             f"{sum(o for _, o in both) / len(both):.1%} | {same} of {len(both)} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m (a folder under the cache)")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--samples", type=int, default=3, help="per task, as generated by ruler_real.generate")
    p.add_argument("--tasks", default="", help="comma list (default: all 13)")
    p.add_argument("--presses", default="snapkv", help="comma list of: " + ", ".join(PRESS_NAMES))
    p.add_argument("--ratios", default="0.5,0.75,0.9", help="kvpress compression ratios (budget = 1 - ratio)")
    p.add_argument("--out", default="results/kvpress_ruler.jsonl")
    p.add_argument("--limit", type=int, default=None, help="the first N samples only (every task's first sample first)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument("--compare", default=None, metavar="ROWS",
                   help="print kvpress's rows (--out) beside kvmerge's in ROWS (a ruler-real.jsonl) and exit")
    args = p.parse_args(argv)
    if args.compare:
        print(compare(Path(args.out), Path(args.compare), args.model))
        return
    run(args)


if __name__ == "__main__":
    main()
