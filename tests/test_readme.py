"""The README's code blocks run as written (on the bundled SmolLM2, `make test-ci`), and its shape
stays what a new reader needs: set-up first, short tables, a RULER section, the help's words."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def commands() -> list[str]:
    """The command lines of the bash blocks after the first (that one is `make demo` / `make test`,
    which this test is part of), comments dropped."""
    lines = [line.split("  #")[0].strip() for block in blocks("bash")[1:] for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_readme_starts_with_the_two_set_up_commands_and_stays_short():
    text = README.read_text()
    first = blocks("bash")[0].splitlines()
    assert [line.split()[:2] for line in first] == [["make", "demo"], ["make", "test"]]
    assert text.index("make demo") < text.index("## ")
    assert len(text.splitlines()) <= 200
    tables = re.findall(r"((?:^\|.*\n)+)", text, re.M)
    assert tables and all(len(t.splitlines()) - 2 <= 10 for t in tables)
    assert "## RULER" in text and "docs/results.md" in text.split("## RULER")[1].split("##")[0]
    for jargon in ("R25", "copy head", "alloc=head", "long_text", "paper.txt", "faithful"):
        assert jargon not in text, jargon
    for command in commands():
        assert command.startswith("kvmerge "), command


def test_readme_commands_parse_and_name_real_methods():
    from kvmerge import catalog
    from kvmerge.cli import _parser

    for command in commands():
        args = _parser().parse_args([w.strip('"') for w in re.findall(r'"[^"]*"|\S+', command)[1:]])
        for spec in getattr(args, "methods", None) or [getattr(args, "method", None)]:
            if spec and spec != "default":  # the word for the model's default method (eval, bench)
                catalog.check_spec(spec)


@pytest.mark.ci_slow
@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python_block_runs_as_written(index, tmp_path, monkeypatch, capsys):
    shutil.copytree(README.parent / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks("python")[index], f"README.md python block {index + 1}", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert out.strip()
    if index == 0:
        assert "2,914" in out.splitlines()[0] and "MiB" in out


@pytest.mark.ci_slow
def test_readme_command_lines_run_as_written(tmp_path):
    shutil.copy(README, tmp_path / "README.md")
    shutil.copytree(README.parent / "examples", tmp_path / "examples")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in commands():
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, (command, done.stderr[-2000:])
        assert done.stdout.strip(), command
    assert (tmp_path / "runs" / "niah" / "niah_score_vs_budget.png").exists()
