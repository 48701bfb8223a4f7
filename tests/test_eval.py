"""Task generators, scorers, the resumable runner and the report."""

import json
import re

import pytest

import kvmerge
from kvmerge_eval import code, fidelity, niah, ruler
from kvmerge_eval.report import report
from kvmerge_eval.runner import run

from .conftest import random_ids, tiny_model
from .test_semanticache import _sp_tokenizer


class WordTokenizer:
    """Counts whitespace-separated words as tokens (stands in for a real tokenizer in length checks)."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": text.split()}


def test_needle_sample_length_depth_and_answer():
    tok = WordTokenizer()
    for depth in (0.1, 0.5, 0.9):
        s = niah.make_sample(tok, 800, depth, seed=7)
        words = s.context.split()
        assert 800 <= len(words) <= 800 + 80  # whole sentences: overshoot < one sentence
        needle_at = s.context.index("The special magic number")
        assert abs(needle_at / len(s.context) - depth) < 0.1
        assert s.answer in s.context and s.meta["city"] in s.question


def test_needle_score():
    assert niah.score("The special magic number for Oslo is 48213.", "48213") == 1.0
    assert niah.score("It is 481.", "48213") == 0.0
    assert niah.score("482131", "48213") == 0.0


@pytest.mark.parametrize("name", sorted(ruler.TASKS))
def test_ruler_samples_hit_length_and_answers_are_in_the_context(name):
    tok = WordTokenizer()
    s = ruler.TASKS[name](tok, 600, seed=3)
    n = len(s.context.split())
    assert 600 <= n <= 600 + 150
    assert all(a in s.context for a in s.answer) and s.answer
    if name == "variable_tracking":  # the chain is in order: the value first, each hop after its source
        value = re.search(r"value (\d+)", s.question).group(1)
        hops = [s.context.index(f"VAR {s.answer[0]} = {value}.")]
        hops += [s.context.index(f"VAR {b} = VAR {a}.") for a, b in zip(s.answer, s.answer[1:])]
        assert hops == sorted(hops)
    if name in ("common_words", "frequent_words"):
        items = [w for w in s.context.split() if not w.endswith(".")]
        counts = {w: items.count(w) for w in set(items)}
        top = sorted(counts, key=counts.get, reverse=True)[:len(s.answer)]
        assert set(top) == set(s.answer)
    if name == "single_inline":  # the fact reads like the documentation around it: no "special magic"
        assert "special magic" not in s.context and s.answer[0] not in s.meta["answer_prefix"]
    assert ruler.TASKS[name](tok, 600, seed=3) == s  # seeded


def test_ruler_score_is_the_fraction_found():
    assert ruler.score("They are 123 and 456.", ["123", "456"]) == 1.0
    assert ruler.score("123", ["123", "456"]) == 0.5
    assert ruler.score("nothing", ["abc"]) == 0.0


def test_code_sample_is_a_prefix_and_the_answer_the_next_line():
    tok = WordTokenizer()
    s = code.make_sample(tok, 500, seed=1)
    source = next(p for p in code.source_files(2500) if p.name == s.meta["file"]).read_text(encoding="utf-8")
    assert source.startswith(s.context + s.question)
    rest = source[len(s.context + s.question):]
    assert next(ln.strip() for ln in rest.splitlines() if ln.strip()) == s.answer
    assert 500 <= len((s.context + s.question).split()) <= 500 + 60
    assert code.score("  " + s.answer + "\nmore", s.answer) == 1.0 and code.score("", s.answer) == 0.0


def test_fidelity_of_the_full_cache_is_perfect_and_compression_is_not():
    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    s = fidelity.make_sample(tok, 200, seed=0, continuation=40)
    assert len(s.context) == 200 and len(s.answer) == 40
    ref = fidelity.continuation_logits(model, s.context, s.answer)
    same = fidelity.compare(ref, fidelity.continuation_logits(model, s.context, s.answer, kvmerge.get_method("full")),
                            s.answer)
    assert same["kl"] < 1e-6 and abs(same["ppl_ratio"] - 1) < 1e-5 and same["top1"] == 1.0
    for name in ("streamingllm", "tova", "semanticache"):  # one block / token by token (decode hook) / tokenizer
        m = kvmerge.get_method(name, budget=0.25, window=8)
        worse = fidelity.compare(ref, fidelity.continuation_logits(model, s.context, s.answer, m, tok), s.answer)
        # merging on a random model's near-uniform attention is almost exact; eviction is not
        assert worse["kl"] > (0 if name == "semanticache" else 1e-4) and worse["top1"] <= 1.0


def test_answer_questions_compresses_once_and_equals_separate_runs():
    model = tiny_model()
    ctx, qs = random_ids(150, seed=4), [[3, 4], [5, 6, 7], [8]]
    for name, extra in [("streamingllm", {}), ("centroidkv", {"interval": 4}), ("h2o", {"decode": True})]:
        m = kvmerge.get_method(name, budget=0.3, window=8, **extra)
        shared = kvmerge.answer_questions(model, ctx, qs, m, max_new_tokens=12)
        alone = [kvmerge.generate_ids(model, ctx, q, m, max_new_tokens=12).tokens for q in qs]
        assert [o.tokens for o in shared] == alone, name


def test_runner_resumes_writes_summaries_and_reports(tmp_path):
    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    args = ("niah", model, tok, ["full", "streamingllm"], [0.5], [300], 2, tmp_path)
    rows = run(*args)
    lines = (tmp_path / "niah.jsonl").read_text().splitlines()
    assert len(lines) == 4 and {(r["method"], r["n"]) for r in rows} == {("full", 2), ("streamingllm", 2)}
    run(*args)
    assert (tmp_path / "niah.jsonl").read_text().splitlines() == lines
    assert all({"prediction", "score", "cache_bytes"} <= set(json.loads(x)) for x in lines)
    assert json.loads((tmp_path / "niah_summary.json").read_text()) == rows
    assert (tmp_path / "niah_summary.csv").read_text().startswith("task,method,budget,length,n,score")
    run("fidelity", model, tok, ["full", "streamingllm"], [0.5], [300], 1, tmp_path)
    text = report(tmp_path)
    assert "| niah (beyond the model: full < 50%) | streamingllm | " in text and "50% · 300" in text  # random model
    assert "### fidelity: kl" in text
    assert (tmp_path / "niah_heatmaps.png").exists() and (tmp_path / "fidelity_kl_vs_budget.png").exists()
    only = report(tmp_path, methods=["full"], plot_dir=tmp_path / "plots")
    assert "| full |" in only and "streamingllm" not in only and (tmp_path / "plots" / "niah_heatmaps.png").exists()


def test_rows_record_their_model_and_a_file_of_another_model_is_refused_before_any_forward(tmp_path):
    """A results file is one model's: resuming keys on (method, budget, sample), so a second model's run
    into the same folder would otherwise skip every run the first one made and report its rows."""
    from kvmerge.errors import KVMergeError

    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path, model_name="first")
    lines = (tmp_path / "niah.jsonl").read_text()
    assert [json.loads(x)["model"] for x in lines.splitlines()] == ["first"]
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(KVMergeError, match=re.escape(
            f"results file {tmp_path / 'niah.jsonl'} holds rows of model first, not second: give each model its "
            f"own folder (--out {tmp_path / 'second'})")):
        run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path, model_name="second")
    assert calls == [] and (tmp_path / "niah.jsonl").read_text() == lines
    run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path, model_name="first")  # its own model resumes
    assert calls == [] and (tmp_path / "niah.jsonl").read_text() == lines
    run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path / "second", model_name="second")
    assert calls and (tmp_path / "second" / "niah.jsonl").exists()


def test_a_length_the_task_cannot_write_is_refused_before_any_row(tmp_path):
    from kvmerge.errors import InputError

    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    with pytest.raises(InputError, match=r"--lengths 10: this task writes a context of \d+ tokens"):
        run("niah", model, tok, ["full"], [0.5], [10], 1, tmp_path)
    assert not (tmp_path / "niah.jsonl").exists() or not (tmp_path / "niah.jsonl").read_text()


def test_unknown_task_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        run("nope", None, None, ["full"], [0.5], [100], 1, tmp_path)


def test_bench_writes_side_by_side_rows(tmp_path):
    from kvmerge_eval.bench import bias_overhead, run_bench

    tok = _sp_tokenizer()
    rows, profiles = run_bench(tiny_model(vocab_size=len(tok)), ["streamingllm"], 0.25, [256], [1, 2], 2, tmp_path, tok)
    assert [(r["batch"], r["method"]) for r in rows] == [(1, "full"), (1, "streamingllm"), (2, "full"),
                                                         (2, "streamingllm")]
    assert all(r["speedup"] == 1.0 for r in rows if r["method"] == "full")
    assert abs(rows[1]["cache_vs_full"] - 0.25) < 0.01 and rows[3]["cache_bytes"] == 2 * rows[1]["cache_bytes"]
    assert (tmp_path / "bench.csv").exists() and (tmp_path / "bench_speedup.png").exists()
    assert bias_overhead(tiny_model(), 128, 2, 2)["biased_ms"] > 0
    assert all(r["vs_floor"] > 0 and r["bandwidth_gbs"] >= r["bandwidth_before_gbs"] for r in rows)
    for r in rows:  # the kernel floor: the linears at this batch plus the cache read at SDPA's measured rate
        assert r["kernel_floor_ms"] == pytest.approx(r["linear_ms"] + r["cache_bytes"] / r["attention_gbs"] / 1e6)
        assert r["linear_ms"] > 0 and r["vs_kernel_floor"] > 0
    for parts in profiles.values():  # the parts add up to the profiled step
        assert parts["attention"] > 0 and parts["cache append"] > 0
        assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], rel=1e-6)


def test_report_marks_tasks_beyond_the_model():
    from kvmerge_eval.report import table

    rows = [{"task": "multikey", "method": "full", "budget": 1.0, "length": 100, "n": 2, "score": 0.25},
            {"task": "multikey", "method": "snapkv", "budget": 0.5, "length": 100, "n": 2, "score": 0.0},
            {"task": "single_word", "method": "full", "budget": 1.0, "length": 100, "n": 2, "score": 1.0}]
    text = table(rows, "score")
    assert "| multikey (beyond the model: full < 50%) | snapkv | 0% |" in text
    assert "| single_word | full | 100% |" in text


@pytest.mark.parametrize("protocol", ["agnostic", "aware"])
def test_one_prefill_for_many_methods_equals_each_method_on_its_own(tmp_path, protocol):
    """The runner prefills a context once and compresses copies; every row must equal a separate run."""
    from kvmerge_eval.runner import prompt_ids

    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    specs = ["full", "snapkv", "h2o:decode=true", "centroidkv:interval=4", "surprisemerge", "semanticache", "kvzip",
             "evictmerge:base=kvzip"]
    run("niah", model, tok, specs, [0.3], [300], 2, tmp_path, protocol=protocol)
    rows = [json.loads(x) for x in (tmp_path / "niah.jsonl").read_text().splitlines()]
    samples = {s.meta["seed"]: s for s in niah_samples(tok)}
    for r in rows:
        ctx, q = prompt_ids(tok, samples[r["seed"]])
        method = kvmerge.get_method(r["method"], r["budget"])
        alone = kvmerge.generate_ids(model, ctx, q, method, 24, protocol, tok.eos_token_id, tokenizer=tok)
        assert r["prediction"] == tok.decode(alone.tokens[0], skip_special_tokens=True).strip(), r["method"]
        assert r["cache_bytes"] == alone.stats["cache_bytes"]
    fid = run("fidelity", model, tok, specs, [0.3], [300], 1, tmp_path)
    s = fidelity.make_sample(tok, 300, seed=1000 * 300)
    ref = fidelity.continuation_logits(model, s.context, s.answer)
    for spec in specs[1:]:
        alone = fidelity.compare(ref, fidelity.continuation_logits(
            model, s.context, s.answer, kvmerge.get_method(spec, 0.3), tok), s.answer)
        shared = next(r for r in fid if r["method"] == spec)
        assert shared["kl"] == pytest.approx(alone["kl"], rel=1e-5, abs=1e-7), spec


def niah_samples(tok):
    from kvmerge_eval.runner import build_samples

    return build_samples("niah", tok, [300], 2)


@pytest.mark.parametrize("genre", ["docs", "legal", "manual"])
@pytest.mark.parametrize("name", ["own_words", "same_template_2", "same_template_4", "same_template_8", "two_hop",
                                  "counting"])
def test_task_families_state_facts_in_the_haystacks_register(name, genre):
    from kvmerge_eval import corpus, families

    if genre == "manual" and not all((corpus.MANUAL / f"{c}.1.gz").is_file() for c in corpus.COMMANDS):
        pytest.skip("this system ships no manual pages")
    tok = WordTokenizer()
    s = families.TASKS[name](tok, 600, seed=4, genre=genre)
    assert 600 <= len(s.context.split()) <= 600 + 120
    assert "special magic" not in s.context and "answer_prefix" not in s.meta  # no marker, no prefix
    assert s.meta["task"] == f"{name}/{genre}" and s.answer and s.answer[0] not in s.question
    if name == "counting":
        statement = families.COUNTING[genre][0].split("{key}")[0]
        assert s.context.count(statement) == int(s.answer[0])
    else:
        assert re.search(rf"\b{s.answer[0]}\b", s.context)
    if name.startswith("same_template"):
        k = int(name.rsplit("_", 1)[1])
        template = families.SAME_TEMPLATE[genre][0].split("{key}")[1].split("{value}")[0]
        assert s.context.count(template) == k
    if name == "two_hop":  # the question names the pointing key; the value sits beside the other key
        a = re.search(r"does the (\w+) module use|stated in Section ([\d.]+)\?|timeout of (\w+)\?", s.question)
        pointing = families.TWO_HOP[genre][0].split("{b}")[0].format(a=a.group(1) or a.group(2) or a.group(3))
        assert pointing in s.context
    assert families.TASKS[name](tok, 600, seed=4, genre=genre) == s  # seeded
    with pytest.raises(ValueError, match="unknown genre 'poetry'"):
        families.TASKS[name](tok, 600, seed=4, genre="poetry")


def test_manual_pages_read_as_running_text():
    from kvmerge_eval.corpus import _roff_text

    page = "\n".join([
        '.TH SORT 1', '.SH NAME', 'sort \\- sort lines', '.SH DESCRIPTION', '.PP',
        'Write sorted concatenation of all \\fIFILE\\fR(s) to standard output, and with no FILE, or when FILE',
        'is \\-, read standard input; mandatory arguments to long options are mandatory for short ones too.',
        '.TP', '\\fB\\-b\\fR, \\fB\\-\\-ignore\\-leading\\-blanks\\fR', 'ignore leading blanks',
        '.PP', 'See', '.B info sort', 'for the whole manual, which describes every option in much more detail than',
        'this short page can, with examples of each of them and of the locale settings that affect the order.'])
    paras = _roff_text(page)
    assert paras == [
        "Write sorted concatenation of all FILE(s) to standard output, and with no FILE, or when FILE is -, read "
        "standard input; mandatory arguments to long options are mandatory for short ones too.",
        "See info sort for the whole manual, which describes every option in much more detail than this short "
        "page can, with examples of each of them and of the locale settings that affect the order."]


def test_runner_runs_a_family_and_keeps_genres_apart(tmp_path):
    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    for genre in ("docs", "legal"):
        run("family", model, tok, ["full"], [0.5], [300], 1, tmp_path, text=genre, subtasks=["own_words"])
        run("fidelity", model, tok, ["full"], [0.5], [300], 1, tmp_path, text=genre)
        run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path, text=genre)
    assert sorted(r["task"] for r in json.loads((tmp_path / "niah_summary.json").read_text())) == ["niah/docs", "niah/legal"]
    rows = [json.loads(x) for x in (tmp_path / "family.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in rows) == ["own_words/docs", "own_words/legal"]
    kl = json.loads((tmp_path / "fidelity_summary.json").read_text())
    assert sorted(r["task"] for r in kl) == ["fidelity/docs", "fidelity/legal"] and all(abs(r["kl"]) < 1e-5 for r in kl)
    with pytest.raises(ValueError, match="'table' genre has no sentences"):
        run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path, text="table")
    with pytest.raises(ValueError, match="unknown family 'nope'"):
        run("family", model, tok, ["full"], [0.5], [300], 1, tmp_path, subtasks=["nope"])


def _rows_file(folder, cut=False, bad_middle=False):
    """A niah results file of three rows: the last one cut off mid-line (`cut`), or the second not JSON."""
    rows = [{"method": "full", "budget": 1.0, "task": "niah", "length": 300, "seed": s, "depth": 0.5, "score": 1.0}
            for s in range(3)]
    lines = [json.dumps(r) for r in rows]
    if bad_middle:
        lines[1] = lines[1][:20]
    text = "\n".join(lines) + "\n"
    if cut:
        text = text[:-15]
    path = folder / "niah.jsonl"
    path.write_text(text)
    return path


def test_a_results_file_cut_off_mid_line_is_refused_with_its_file_and_line(tmp_path):
    from kvmerge.errors import KVMergeError

    path = _rows_file(tmp_path, cut=True)
    with pytest.raises(KVMergeError, match=re.escape(
            f"results file {path}: the last line (3) is incomplete, cut off mid-write when a run was stopped: "
            f"delete it (sed -i '$d' {path}), or resume the run that wrote it")):
        report(tmp_path, plots=False)
    path = _rows_file(tmp_path, bad_middle=True)
    with pytest.raises(KVMergeError, match=re.escape(
            f"results file {path}, line 2: not a JSON row (Unterminated string starting at column 20): "
            "fix or delete that line")):
        report(tmp_path, plots=False)
    path.write_text('{"method": "full", "budget": 1.0}\n[1, 2]\n')
    with pytest.raises(KVMergeError, match=re.escape(
            f"results file {path}, line 2: not a results row (a JSON object with a method and a budget)")):
        report(tmp_path, plots=False)


def test_resuming_from_a_cut_off_last_line_is_refused_before_any_forward(tmp_path):
    from kvmerge.errors import KVMergeError

    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    calls = []
    model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    path = _rows_file(tmp_path, cut=True)
    before = path.read_text()
    with pytest.raises(KVMergeError, match=re.escape(
            f"results file {path}: the last line (3) is incomplete, cut off mid-write when a run was stopped: "
            f"delete it (sed -i '$d' {path}) and run the same command again: its run is redone")):
        run("niah", model, tok, ["full"], [0.5], [300], 1, tmp_path)
    assert calls == [] and path.read_text() == before


def test_rows_are_written_whole_and_a_last_row_without_its_newline_is_kept(tmp_path, monkeypatch):
    """A run stopped between rows leaves whole lines only; resuming after a last row that lacks only
    its newline completes that line before appending."""
    import kvmerge_eval.runner as runner

    tok = _sp_tokenizer()
    model = tiny_model(vocab_size=len(tok))
    own = runner._run_prompt

    def stopped(*args, **kwargs):
        gen = own(*args, **kwargs)
        yield next(gen)
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "_run_prompt", stopped)
    with pytest.raises(KeyboardInterrupt):
        run("niah", model, tok, ["full", "streamingllm"], [0.5], [300], 1, tmp_path)
    path = tmp_path / "niah.jsonl"
    text = path.read_text()
    assert text.endswith("\n") and len([json.loads(x) for x in text.splitlines()]) == 1
    monkeypatch.setattr(runner, "_run_prompt", own)
    path.write_text(text.rstrip("\n"))
    rows = run("niah", model, tok, ["full", "streamingllm"], [0.5], [300], 1, tmp_path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and all(json.loads(x) for x in lines) and {r["method"] for r in rows} == {"full",
                                                                                                     "streamingllm"}
