"""kvmerge_eval.ruler_real: NVIDIA's RULER generators driven offline, split as kvpress's RULER dataset,
scored by RULER's own metrics; and benchmarks/kvpress_ruler.py's copies of the cache key and scorer.

Generation runs on the bundled SmolLM2's tokenizer into kvmerge's cache dir, once per machine (about
20 s: niah.py builds wonderwords' 6M-word list), later runs read the cache."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
from pathlib import Path

import pytest

from kvmerge_eval import ruler_real
from kvmerge_eval.niah import Sample

pytest.importorskip("long_context_eval", reason="NVIDIA's RULER package is not installed: make setup-ruler")

ROOT = Path(__file__).resolve().parent.parent
LENGTH, N = 1024, 2


@pytest.fixture(scope="module")
def folder() -> Path:
    from kvmerge.model import cache_dir

    path = cache_dir() / "smollm2-135m"
    if not (path / "tokenizer.json").exists():
        pytest.skip("the bundled SmolLM2 is not converted yet (kvmerge.load_model() converts it)")
    return path


@pytest.fixture(scope="module")
def tok(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.fixture(scope="module")
def generated(folder) -> dict[str, list[dict]]:
    for dep in ("wonderwords", "nltk", "scipy", "tenacity"):
        pytest.importorskip(dep, reason="RULER's generation deps: make setup-ruler")
    return {task: ruler_real.generate(folder, LENGTH, N, [task]) for task in ("niah_single_1", "vt")}


def test_tasks_are_synthetic_yaml_in_order():
    assert ruler_real.TASKS == tuple(ruler_real._config())


@pytest.mark.parametrize("task", ["niah_single_1", "vt"])
def test_split_of_generated_samples(generated, task):
    family, rows = task.split("_")[0], generated[task]
    assert [r["index"] for r in rows] == list(range(N)) and all(r["task"] == task for r in rows)
    for r in rows:
        context, question, prefix = r["context"], r["question"], r["answer_prefix"]
        assert ruler_real.split(task, context + question + prefix) == (context, question, prefix)
        assert ruler_real.QUESTION[family].match(question) and ruler_real.ANSWER[family].match(prefix)
        assert not ruler_real.QUESTION[family].search(prefix)
        assert r["max_new_tokens"] == {"niah": 128, "vt": 30}[family] and r["ruler_length"] <= LENGTH
        assert r["answers"] and all(a in context for a in r["answers"])
    if family == "niah":
        assert rows[0]["context"].startswith("A special magic number is hidden within the following text.")
        assert rows[0]["question"].startswith("What is the special magic number for ")
        assert rows[0]["answer_prefix"].startswith("The special magic number for ")
        assert not any(a in rows[0]["question"] for a in rows[0]["answers"])
    else:  # the in-context example repeats the question: the context runs to the last one
        assert rows[0]["context"].count("Question: Find all variables") == 1
        assert rows[0]["answer_prefix"].startswith("Answer: According to the chain(s) of variable assignment")


def test_second_call_reads_the_cache(generated, folder, monkeypatch):
    def no_subprocess(*args, **kwargs):
        raise AssertionError("a generator ran although the samples are cached")

    monkeypatch.setattr(subprocess, "run", no_subprocess)
    again = ruler_real.generate(folder, LENGTH, N, ["niah_single_1", "vt"])
    assert again == generated["niah_single_1"] + generated["vt"]
    path = ruler_real.cache_path(folder, LENGTH, "vt", N)
    assert path.exists() and path.parts[-3:] == (ruler_real.tokenizer_id(folder), str(LENGTH), f"vt_{N}.jsonl")
    sample = ruler_real.samples(folder, LENGTH, N, ["vt"])[1]
    assert sample.answer == generated["vt"][1]["answers"] and sample.meta == {
        "task": "vt", "length": LENGTH, "seed": 1, "answer_prefix": generated["vt"][1]["answer_prefix"],
        "max_new_tokens": 30}


def test_failures_are_loud(folder, tmp_path):
    with pytest.raises(ValueError, match="question marker"):
        ruler_real.split("vt", "no question here. Answer: 1")
    with pytest.raises(ValueError, match="answer marker"):
        ruler_real.split("cwe", "list\nQuestion: What are the 10 most common words in the above list? ")
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler_real.generate(folder, LENGTH, N, ["niah_single_9"])
    with pytest.raises(RuntimeError, match="ran past"):
        ruler_real._run("vt", folder, LENGTH, N, timeout_s=0.05)


CASES = [  # (task, prediction, answers, expected score)
    ("niah_multivalue", " 1234567, and 7654321.", ["1234567", "7654321", "1111111", "2222222"], 0.5),
    ("niah_single_1", "The number is 1234567", ["1234567"], 1.0),
    ("vt", "VAR ABCDE, vAr fghij", ["ABCDE", "FGHIJ", "KLMNO"], 2 / 3),
    ("cwe", "", ["word"], 0.0),
    ("qa_1", "It is in FRANCE.", ["France", "Paris"], 1.0),
    ("qa_2", "no", ["yes"], 0.0),
    ("niah_single_1", "\n 12\x0034\t ", ["1234"], 1.0),  # kvpress drops control characters
]


@pytest.mark.parametrize("task, prediction, answers, expected", CASES)
def test_score_is_rulers_metric(task, prediction, answers, expected):
    from long_context_eval.eval.synthetic import constants

    assert ruler_real.score(task, prediction, answers) == pytest.approx(expected)
    metric = constants.string_match_part if task.startswith("qa") else constants.string_match_all
    assert ruler_real.score(task, prediction, answers) * 100 == pytest.approx(
        metric([ruler_real.postprocess(prediction)], [answers]), abs=0.005)  # the batch metric rounds to 2 digits


def _sample(context="Some text.\n\n", question="Question: What? ", prefix="Answer:"):
    return Sample(context, question, ["x"], {"answer_prefix": prefix})


@pytest.mark.parametrize("context", ["Some text.\n", "Some text.\n\n"])
def test_prompt_ids_chat_template(tok, context):
    s = _sample(context)
    ctx, q = ruler_real.prompt_ids(tok, s)
    full = tok.apply_chat_template([{"role": "user", "content": s.context + s.question}], add_generation_prompt=True,
                                   tokenize=False) + "Answer:"
    head = tok.apply_chat_template([{"role": "user", "content": "#"}], add_generation_prompt=True,
                                   tokenize=False).split("#")[0]
    assert tok.decode(ctx) == head + context and tok.decode(ctx + q) == full
    assert tok.decode(q).startswith(s.question) and tok.decode(q).endswith("<|im_start|>assistant\nAnswer:")
    ids = tok.encode(full, add_special_tokens=False)
    if context.endswith("\n\n"):  # the boundary: "\n\n" is one token before the split, two in the whole text
        newline = tok.encode("\n", add_special_tokens=False)
        assert ctx[-1:] == tok.encode("\n\n", add_special_tokens=False) and ctx[:-1] + 2 * newline + q == ids
    else:
        assert ctx + q == ids


def test_prompt_ids_without_chat_template(tok):
    plain = copy.deepcopy(tok)
    plain.chat_template = None
    ctx, q = ruler_real.prompt_ids(plain, _sample())
    assert ctx == plain.encode(plain.bos_token + "Some text.\n\n", add_special_tokens=False)
    assert q == plain.encode("Question: What? \nAnswer:", add_special_tokens=False)


def test_benchmark_copies_agree(folder):
    spec = importlib.util.spec_from_file_location("kvpress_ruler", ROOT / "benchmarks" / "kvpress_ruler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.TASKS == ruler_real.TASKS
    assert bench.tokenizer_id(folder) == ruler_real.tokenizer_id(folder)
    score = bench.scorer()
    for task, prediction, answers, _expected in CASES:
        assert score(task, prediction, answers) == ruler_real.score(task, prediction, answers)


def test_benchmark_compares_on_the_samples_both_ran(tmp_path):
    spec = importlib.util.spec_from_file_location("kvpress_ruler", ROOT / "benchmarks" / "kvpress_ruler.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    theirs = [{"method": "kvpress:snapkv", "budget": 0.25, "task": t, "length": 4096, "seed": i, "score": s, "model": "m"}
              for t, i, s in (("vt", 0, 1.0), ("cwe", 0, 0.5), ("qa_1", 1, 1.0))]
    ours = [{"method": "snapkv", "budget": 0.25, "task": t, "length": n, "seed": i, "score": s}
            for t, n, i, s in (("vt", 4096, 0, 1.0), ("cwe", 4096, 0, 0.0), ("qa_1", 16384, 1, 1.0))]  # qa_1#1 not at 4k
    ours += [{**r, "method": bench.ALIGNED["snapkv"], "score": 1.0 - r["score"] / 2} for r in ours]
    for name, rows in (("p.jsonl", theirs), ("k.jsonl", ours)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = bench.compare(tmp_path / "p.jsonl", tmp_path / "k.jsonl", "m")
    assert "| `snapkv` | `snapkv` | 25% (0.75) | 2 (2) | 75.0% | 50.0% | 1 of 2 |" in table
    assert f"| `snapkv` | `{bench.ALIGNED['snapkv']}` | 25% (0.75) | 2 (2) | 75.0% | 75.0% | 0 of 2 |" in table
