"""Long-context code completion on the Python standard library's own source (LongBench LCC style):
a long file prefix as context, predict the next non-empty line, scored by edit similarity."""

from __future__ import annotations

import difflib
import random
import sysconfig
from pathlib import Path

from .niah import Sample


def source_files(min_chars: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.glob("*.py")) if p.stat().st_size >= min_chars]
    if not files:
        raise RuntimeError(f"no standard-library source files of {min_chars}+ characters under {root}")
    return files


def make_sample(tokenizer, n_tokens: int, seed: int, question_lines: int = 2) -> Sample:
    """The first lines of a stdlib file adding up to about `n_tokens` tokens; the last
    `question_lines` of them are the (uncompressed) question, the next non-empty line the answer."""
    rng = random.Random(seed)
    files = source_files(min_chars=n_tokens * 5)
    path = rng.choice(files)
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    total, cut = 0, 0
    for cut, line in enumerate(lines):
        total += len(tokenizer(line, add_special_tokens=False)["input_ids"])
        if total >= n_tokens and line.strip() and cut + 1 < len(lines):
            break
    nxt = next((i for i in range(cut + 1, len(lines)) if lines[i].strip()), None)
    if nxt is None:
        raise RuntimeError("file too short for the requested length")
    q_at = cut + 1 - question_lines
    return Sample("".join(lines[:q_at]), "".join(lines[q_at:nxt]), lines[nxt].strip(),
                  {"task": "code", "length": n_tokens, "seed": seed, "file": path.name, "raw": True})


def first_line(prediction: str) -> str:
    return next((ln.strip() for ln in prediction.splitlines() if ln.strip()), "")


def score(prediction: str, answer: str) -> float:
    """Edit similarity of the first non-empty predicted line to the true line, in [0, 1]."""
    return difflib.SequenceMatcher(None, first_line(prediction), answer).ratio()
