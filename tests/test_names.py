"""One name for each method: names follow one spelling rule, the older names live in one table
(`kvmerge.methods.registry.OLD_NAMES`) and resolve wherever a name is read, and no tracked file but
that table and this test writes them."""

import re
import subprocess
from pathlib import Path

import pytest

import kvmerge
from kvmerge.methods.registry import OLD_NAMES, canonical, current_spec

ROOT = Path(__file__).parents[1]

# Files another worker owned when the names changed: rename there, then drop the file from this set.
PENDING: set[str] = set()
# History, kept verbatim.
EXCLUDED = ("docs/research-log.md",)
# The table and this test.
HOME = {"kvmerge/methods/registry.py", "tests/test_names.py"}
# `expected_attention` is also kvpress's own name for its press (its evaluation registry, kept.json's keys):
# allowed where presses are named (a kvpress-facing file, a line that names presses, the press column of
# the kvpress-against-kvmerge table in docs/kvpress.md), never as a kvmerge spec (followed by `:` or `@`).
KVPRESS_FILES = {"benchmarks/kvpress_crosscheck.py", "benchmarks/kvpress_ruler.py", "kvmerge_eval/report.py",
                 "tests/test_kvpress_crosscheck.py"}
PRESS_NAME = "expected_attention"


def test_every_name_is_one_lowercase_word():
    """The rule (docs/design.md, "Names"): letters and digits, lowercase, no `_` or `-`."""
    for name in kvmerge.available_methods():
        assert re.fullmatch(r"[a-z][a-z0-9]*", name), name
    assert not set(OLD_NAMES) & set(kvmerge.available_methods())


@pytest.mark.parametrize("old, new", OLD_NAMES.items())
def test_an_old_name_builds_the_current_method_everywhere_a_name_is_read(old, new):
    assert canonical(old) == new and canonical(old.upper().replace("_", "-")) == new
    a, b = kvmerge.get_method(old, budget=0.1), kvmerge.get_method(new, budget=0.1)
    assert a == b and a.label == new
    part = kvmerge.get_method(f"evictmerge:base={old}") if new in ("expectedattention", "mixedattention") else None
    assert part is None or part.base.name == new
    assert current_spec(f"{old}:budget=0.1@chunk1024") == f"{new}:budget=0.1@chunk1024"


def test_current_spec_renames_the_method_and_its_parts_only():
    assert current_spec("evictmerge:base=expected_attention:recent=0") == "evictmerge:base=expectedattention:recent=0"
    assert current_spec("guardmerge:fallback=surprisal") == "zipguardmerge:fallback=surprisal"
    assert current_spec("kvpress:expected_attention") == "kvpress:expected_attention"  # kvpress's row: its name
    assert current_spec("snapkv:window=8") == "snapkv:window=8"


def test_the_methods_command_finds_an_old_name_and_lists_it(capsys):
    from kvmerge.cli import main

    for old, new in OLD_NAMES.items():
        assert main(["methods", old]) == 0
        detail = capsys.readouterr().out
        assert detail.startswith(f"{new} (") and f"old names: {old}" in detail


def test_results_rows_measured_under_an_old_name_read_as_the_current_one(tmp_path):
    import json

    from kvmerge_eval.runner import _read

    rows = [{"method": "guardmerge:sliding=0.75", "budget": 0.25}, {"method": "expectmerge@chunk1024", "budget": 0.1},
            {"method": "kvpress:expected_attention", "budget": 0.25}]
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["method"] for r in _read(tmp_path / "r.jsonl")] == [
        "zipguardmerge:sliding=0.75", "mixedmerge@chunk1024", "kvpress:expected_attention"]


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if not p.startswith(EXCLUDED) and p not in HOME | PENDING]


def test_no_old_name_is_written_outside_the_table_and_this_test():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    old = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, OLD_NAMES)) + r")(?![\w-])", re.I)
    found = []
    for path in _tracked():
        file = ROOT / path
        if not file.is_file():  # deleted in the work tree, not yet in the index
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in old.finditer(line):
                press = (m.group(1) == PRESS_NAME and line[m.end():m.end() + 1] not in (":", "@")
                         and (path in KVPRESS_FILES or "press" in line.lower()
                              or line.startswith(f"| `{PRESS_NAME}` | `")))  # the press, then its twin
                if not press:
                    found.append(f"{path}:{n}: {m.group(1)}")
    assert not found, "old method names (use the current ones; aliases live in OLD_NAMES):\n" + "\n".join(found)
