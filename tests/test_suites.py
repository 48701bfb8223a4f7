"""Named suites: every shipped suite loads, bad suites are refused by name, a suite runs and reports, and
every table in docs/results.md names a suite that exists, a command that parses, and the suite's columns."""

import json
import re
import shlex
from pathlib import Path

import pytest

from kvmerge.cli import _parser, main
from kvmerge_eval import suites

from .conftest import tiny_model
from .test_semanticache import _sp_tokenizer

DOCS = Path(__file__).parent.parent / "docs" / "results.md"


@pytest.mark.parametrize("name", suites.available())
def test_every_shipped_suite_loads(name):
    suite = suites.load(name)
    assert suite.runs and suite.models and suite.title
    for model in suite.models:
        head = suites.header(suite, model)
        assert len(head) == len(set(head)), f"{name}/{model}: two columns share a name: {head}"


def _write(tmp_path, text):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, error", [
    ('models = ["m"]\n[[run]]\ntask = "niah"\nmethods = ["full"]\nbudgets = [0.5]\nlengths = [9]\nsamples = 1\nsample = 2',
     "unknown key.*sample"),
    ('models = ["m"]\n[[run]]\ntask = "nope"\nmethods = ["full"]\nbudgets = [0.5]\nlengths = [9]\nsamples = 1',
     "unknown task 'nope'"),
    ('models = ["m"]\n[[run]]\ntask = "niah"\nmethods = ["nosuch"]\nbudgets = [0.5]\nlengths = [9]\nsamples = 1',
     "method 'nosuch'"),
    ('models = ["m"]\n[[run]]\ntask = "niah"\nmethods = ["full"]\nbudgets = [0.5]\nsamples = 1', "missing lengths"),
    ('title = "no runs"', "at least one"),
])
def test_bad_suites_are_refused_by_name(tmp_path, text, error):
    with pytest.raises(ValueError, match=error):
        suites.load(_write(tmp_path, text))
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        suites.load("nope")


def test_a_suite_runs_resumably_and_reports_its_table(tmp_path):
    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    suite = suites.load(_write(tmp_path, """
title = "tiny"
models = ["tiny"]
methods = ["full", "streamingllm"]
budgets = [0.5, 0.25]
lengths = [300]
[[run]]
label = "needle"
task = "niah"
samples = 2
[[run]]
label = "KL"
task = "fidelity"
budgets = [0.5]
samples = 1
"""))
    loads = []
    loader = lambda name: loads.append(name) or (model, tok)  # noqa: E731
    suites.run_suite(suite, root=tmp_path / "r", load_model=loader)
    first = (tmp_path / "r" / "s" / "tiny" / "niah.jsonl").read_text()
    suites.run_suite(suite, root=tmp_path / "r", load_model=loader)
    assert (tmp_path / "r" / "s" / "tiny" / "niah.jsonl").read_text() == first  # nothing rerun
    assert loads == ["tiny", "tiny"]
    text = suites.report(suite, tmp_path / "r")
    lines = text.splitlines()
    assert lines[0] == "### tiny" and "kvmerge eval --suite s" in lines[2]
    assert re.match(r"#### tiny \(measured \d{4}-\d\d-\d\d; samples per cell in brackets\)", lines[4])
    assert lines[6] == "| method | needle 50% | needle 25% | KL 50% | bytes/full at 50% / 25% |"
    full = next(x for x in lines if x.startswith("| full |")).split(" | ")
    stream = next(x for x in lines if x.startswith("| streamingllm |")).split(" | ")
    assert full[1].endswith("(2)") and full[3] == "0.0000 (1)" and full[4].startswith("1.000 / 1.000")
    assert stream[1].endswith("(2)") and stream[3].endswith("(1)")
    fractions = [float(x) for x in stream[4].strip(" |").split(" / ")]
    assert abs(fractions[0] - 0.5) < 0.05 and abs(fractions[1] - 0.25) < 0.05
    only = suites.report(suite, tmp_path / "r", budgets=[0.25])
    assert "| method | needle 25% | bytes/full at 25% |" in only
    with pytest.raises(ValueError, match="no run for model 'other'"):
        suites.run_suite(suite, ["other"], tmp_path / "r", loader)


def _family_suite(tmp_path, genres):
    head = 'models = ["tiny"]\nmethods = ["full", "snapkv", "keydiff"]\nbudgets = [0.25]\nlengths = [2048]\nsamples = 10\n'
    runs = "".join(f'[[run]]\ntask = "family"\nsubtasks = ["own_words"]\ntext = "{g}"\n' for g in genres)
    return suites.load(_write(tmp_path, head + runs + '[[run]]\ntask = "fidelity"\nsamples = 3\n'))


def test_family_totals_sum_answers_over_genres_for_methods_measured_on_each(tmp_path):
    suite = _family_suite(tmp_path, ["docs", "legal"])
    cell = lambda task, method, budget, score, n=10: dict(task=task, method=method, budget=budget,  # noqa: E731
                                                          length=2048, score=score, n=n)
    cells = [cell("own_words/docs", "full", 1.0, 0.4), cell("own_words/legal", "full", 1.0, 0.9),
             cell("own_words/docs", "snapkv", 0.25, 0.3), cell("own_words/legal", "snapkv", 0.25, 0.2, n=5),
             cell("own_words/docs", "keydiff", 0.25, 0.5)]  # keydiff: no legal row
    lines = suites.totals(suite, "tiny", cells).splitlines()
    assert lines[0] == "| method (summed over genres) | own_words 2k 25% (2 genres) |"
    assert lines[2:] == ["| full | 13/20 |", "| snapkv | 4/15 |"]
    assert suites.totals(_family_suite(tmp_path, ["docs"]), "tiny", cells) is None
    docs_only = [c for c in cells if c["task"] == "own_words/docs"]  # a genre nobody ran is not asked for
    assert suites.totals(suite, "tiny", docs_only) is None


def test_report_without_results_says_what_to_run(tmp_path, capsys):
    with pytest.raises(SystemExit, match="run `kvmerge eval --suite ruler` first"):
        main(["report", "--suite", "ruler", "--root", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown suite 'nope'"):
        main(["eval", "--suite", "nope"])


def _doc_tables(text):
    """(suite name, command, model, header, rows) for every table under a `Suite `name`` line."""
    out, suite, command, model = [], None, None, None
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if m := re.match(r"Suite `([\w-]+)` · `([^`]+)`", line):
            suite, command, model = m.group(1), m.group(2), None
        elif m := re.match(r"#### ([\w.-]+) \(", line):
            model = m.group(1)
        elif line.startswith("| ") and not lines[i - 1].startswith("|"):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(row)
            out.append((suite, command, model, [c.strip() for c in line.strip("|").split("|")], rows))
    return out


def test_every_table_in_the_results_doc_names_a_suite_a_command_and_its_columns():
    tables = _doc_tables(DOCS.read_text(encoding="utf-8"))
    assert tables
    seen = set()
    for name, command, model, head, rows in tables:
        assert name is not None and model is not None, f"a table with no suite or model line above it: {head}"
        suite = suites.load(name)  # exists and loads
        seen.add(name)
        for part in command.split("&&"):
            argv = shlex.split(part)
            assert argv[0] == "kvmerge"
            args = _parser().parse_args(argv[1:])  # parses
            assert args.suite == name
        if head[0] == "method (summed over genres)":  # suites.totals: family × length × budget of the suite
            families = {(t.split("/")[0], f"{n / 1024:g}k {b:.0%}") for r in suite.runs if model in r.models
                        for _c, t, n, b in suites.columns(r) if r.task == "family"}
            for col in head[1:]:
                m = re.fullmatch(r"(\w+) (\S+ \d+%) \(\d genres\)", col)
                assert m and m.groups() in families, f"{name}/{model}: summed column {col!r} is not the suite's"
        elif head[0] == "method (RULER average)":  # suites.averages: length × budget of the suite's RULER runs
            want = {f"{n / 1024:g}k {b:.0%} (ratio {1 - b:.2f})" for r in suite.runs if model in r.models
                    and r.task == "ruler-real" for n in r.lengths for b in r.budgets}
            assert set(head[1:]) <= want, f"{name}/{model}: average columns {head[1:]} are not the suite's"
        else:
            assert head == suites.header(suite, model), f"{name}/{model}: columns differ from the suite's"
        labels = {m for r in suite.runs if model in r.models for m in r.labels()}
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert cells[0] in labels and len(cells) == len(head)
    named = set(re.findall(r"^Suite `([\w-]+)` · ", DOCS.read_text(encoding="utf-8"), re.M))
    assert seen <= named and named == set(suites.available()), f"suites not in the doc: {set(suites.available()) - named}"


def test_ruler_plot_draws_one_length_and_the_models_kvpress_rows(tmp_path, monkeypatch):
    from kvmerge_eval import report

    suite = suites.load(_write(tmp_path, 'models = ["m"]\n[[run]]\ntask = "ruler-real"\nmethods = ["full", "snapkv"]\n'
                                         'budgets = [0.25]\nlengths = [4096]\nsamples = 1\n[[run]]\ntask = "ruler-real"\n'
                                         'methods = ["snapkv"]\nbudgets = [0.25]\nlengths = [16384]\nsamples = 1\n'
                                         'prefill_chunk = 1024'))
    row = {"task": "niah_single_1", "seed": 0, "score": 1.0, "date": "2026-12-03"}
    rows = [{**row, "method": "full", "budget": 1.0, "length": 4096}, {**row, "method": "snapkv", "budget": 0.25, "length": 4096},
            {**row, "method": "snapkv@chunk1024", "budget": 0.25, "length": 16384},
            {**row, "method": "keydiff", "budget": 0.25, "length": 4096}]  # not the suite's
    out = suites.folder(suite, "m", tmp_path)
    out.mkdir(parents=True)
    (out / "ruler-real.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    press = [{**row, "method": "kvpress:snapkv", "budget": 0.25, "length": n, "model": model}
             for n, model in [(4096, "m"), (16384, "m"), (4096, "other")]]
    (tmp_path / "kvpress_ruler.jsonl").write_text("".join(json.dumps(r) + "\n" for r in press))
    seen = {}
    monkeypatch.setattr(report, "ruler_curves", lambda by_model, kvpress, path, length: seen.update(
        by_model=by_model, kvpress=kvpress, length=length) or path)
    suites.plots(suite, tmp_path / "plots", root=tmp_path)
    assert seen["length"] == 4096
    assert sorted(r["method"] for r in seen["by_model"]["m"]) == ["full", "snapkv"]
    assert [(r["model"], r["length"]) for r in seen["kvpress"]] == [("m", 4096), ("other", 4096)]
    monkeypatch.undo()  # the real plot, from the same rows
    (path,) = suites.plots(suite, tmp_path / "plots", root=tmp_path)
    assert path.stat().st_size > 0


def test_ruler_average_is_the_mean_of_task_means_over_the_measured_lengths_and_budgets(tmp_path):
    suite = suites.load(_write(tmp_path, 'models = ["m"]\n[[run]]\ntask = "ruler-real"\nmethods = ["snapkv"]\n'
                                         'budgets = [0.5, 0.25]\nlengths = [4096]\nsamples = 2\n[[run]]\n'
                                         'task = "ruler-real"\nmethods = ["snapkv"]\nbudgets = [0.25]\n'
                                         'lengths = [16384]\nsamples = 2\nprefill_chunk = 1024'))
    rows = [{"method": "snapkv", "budget": 0.25, "length": 4096, "task": t, "seed": i, "score": s}
            for t, i, s in (("vt", 0, 1.0), ("vt", 1, 1.0), ("cwe", 0, 0.0))]
    table = suites.averages(suite, "m", suites._cells(rows)).splitlines()
    assert table[0] == ("| method (RULER average) | 4k 50% (ratio 0.50) | 4k 25% (ratio 0.75) | "
                        "16k 25% (ratio 0.75) |")  # no 16k 50%: no run measures it
    assert table[2] == "| snapkv | – | 50.0% (2 tasks, 3) | – |"  # (1 + 0) / 2, not 2 of 3 samples
