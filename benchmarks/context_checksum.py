"""What the compressed-context file's checks cost: `kvmerge.load_context` of one file with its checksum
against the same file without it (as format version 1 wrote it: the other checks still run),
alternating, median of `--repeats` loads each. One JSON line per model × length.

    python benchmarks/context_checksum.py --model smollm2-135m --lengths 2048,8000 --method snapkv
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

import kvmerge


def without_checksum(path: Path, out: Path) -> Path:
    with safe_open(str(path), "pt") as f:
        head, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    head.pop("digest")
    save_file(tensors, str(out), metadata={**head, "version": "1"})  # as written before checksums
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--lengths", default="2048,8000")
    p.add_argument("--method", default="snapkv")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    model, tok = kvmerge.load_model(args.model)
    vocab = model.config.vocab_size
    for length in map(int, args.lengths.split(",")):
        ids = [(i * 7919 + 13) % (vocab - 1000) + 500 for i in range(length)]  # a fixed, varied context
        ctx = kvmerge.compress_context(model, tok, ids, args.method, args.budget)
        with tempfile.TemporaryDirectory() as folder:
            checked = ctx.save(Path(folder) / "c.kvz")
            plain = without_checksum(checked, Path(folder) / "plain.kvz")
            times = {"checksum": [], "none": []}
            for _ in range(args.repeats):
                for name, path in (("checksum", checked), ("none", plain)):
                    start = time.perf_counter()
                    kvmerge.load_context(path, model, tok)
                    times[name].append(time.perf_counter() - start)
            size = checked.stat().st_size
        with_s, without_s = (statistics.median(times[k]) for k in ("checksum", "none"))
        print(json.dumps({"model": args.model, "tokens": length, "method": args.method, "budget": args.budget,
                          "file_mib": round(size / 2**20, 2), "load_ms_checksum": round(with_s * 1e3, 1),
                          "load_ms_without": round(without_s * 1e3, 1), "ratio": round(with_s / without_s, 2)}),
              flush=True)


if __name__ == "__main__":
    main()
