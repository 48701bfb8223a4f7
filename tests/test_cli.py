"""The command line: every mistake ends in one line on stderr naming the problem and the fix, exit
status 2, before any model loads; --debug shows the traceback; --help and `methods` load no torch."""

import json
import os
import subprocess
import sys

import pytest

import kvmerge
import kvmerge.model
from kvmerge.cli import main
from kvmerge.errors import InputError


class ModelLoaded(Exception):
    pass


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    """Loading a model fails the test: a refusal must come first."""
    def refuse(*_a, **_k):
        raise ModelLoaded("the model was loaded")

    monkeypatch.setattr(kvmerge, "load_model", refuse)  # `from kvmerge import load_model` too (patched first:
    monkeypatch.setattr(kvmerge.model, "load_model", refuse)  # reading kvmerge's caches kvmerge.model's)


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ctx.txt").write_text("The code is 4721. It was hidden in the library.\n")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "binary.dat").write_bytes(b"\x7fELF\x00\x01\x02" * 40)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "folder").mkdir()
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text('{"model_type": "llama"}')
    return tmp_path


def fails(capsys, argv, *expected):
    """Run `kvmerge argv`: exit status 2 and one stderr line holding every `expected` string."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.endswith("\n") and err.count("\n") == 1, err
    for text in expected:
        assert text in err, err
    return err


G = ["generate", "--context", "ctx.txt", "--question", "What is the code?"]

MISTAKES = [  # argv, what the line must say
    (["gen"], "unknown command 'gen' (did you mean generate?)"),
    (["generate", "--context", "paper.txt", "--question", "q"], "paper.txt: no such file"),
    (G + ["--method", "snapkv:kernel=five"], "kernel must be a whole number (default 7), got 'five'"),
    (G + ["--method", "snapkv:window=abc"], "window must be a whole number"),
    (G + ["--method", "snapvk"], "unknown method 'snapvk' (did you mean snapkv?)"),
    (G + ["--method", "snapkv:kernal=5"], "no parameter 'kernal' (did you mean kernel?)"),
    (G + ["--method", "snapkv:kernel"], "expected param=value"),
    (G + ["--method", "h2o:decode=1"], "decode must be true or false"),
    (G + ["--method", "mixedmerge:sliding=0.75"], "smollm2-135m has none"),
    (G + ["--model", "gemma-3-270m"], "did you mean gemma3-270m?"),
    (G + ["--model", "./missing"], "no model at ./missing"),
    (G + ["--model", "folder"], "folder without a model"),
    (G + ["--model", "noweights"], "noweights has a config.json but no weights", "save_pretrained"),
    (["train-scorer", "--model", "noweights"], "noweights has a config.json but no weights"),
    (G + ["--budget", "0"], "--budget", "got '0'"),
    (G + ["--budget", "-1"], "got '-1'"),
    (G + ["--budget", "1.5"], "fraction of the context in (0, 1]"),
    (G + ["--budget", "half"], "got 'half'"),
    (G + ["--budget", "1"], "below the 36 tokens every method keeps", "written with a point"),
    (G + ["--budget", "5", "--method", "snapkv:sinks=2:window=4"], "--budget 5 entries is below the 6 tokens"),
    (G + ["--max-new-tokens", "-3"], "--max-new-tokens", "got '-3'"),
    (G + ["--max-new-tokens", "0"], "got '0'"),
    (G + ["--temperature", "-1"], "--temperature"),
    (G + ["--top-p", "2"], "--top-p", "(0, 1]"),
    (G + ["--top-k", "-2"], "--top-k"),
    (G + ["--prefill-chunk", "0"], "--prefill-chunk"),
    (G + ["--prefill-chunk", "8"], "below the protected sinks + window (4 + 32)", "use at least 36"),
    (G + ["--stop", ""], "--stop"),
    (G + ["--stop", ","], "--stop"),
    (G + ["--temperature", "nan"], "--temperature", "a number >= 0"),
    (G + ["--temperature", "inf"], "--temperature", "a number >= 0"),
    (["compress", "--context", "ctx.txt", "--out", "./ctx.txt"], "--out ./ctx.txt is the --context file"),
    (G + ["--budgte", "0.5"], "unknown option '--budgte' (did you mean --budget"),
    (["generate", "--context", "ctx.txt", "--question", " "], "--question is empty"),
    (["generate", "--context", "empty.txt", "--question", "q"], "empty.txt is empty"),
    (["generate", "--context", "folder", "--question", "q"], "is a folder"),
    (["generate", "--context", "binary.dat", "--question", "q"], "binary file"),
    (["generate", "--context", "latin1.txt", "--question", "q"], "not UTF-8"),
    (["generate", "--question", "q"], "required: --context"),
    (["report", "missing_folder"], "no results folder missing_folder"),
    (["report", "ctx.txt"], "is a file"),
    (["report"], "needs a results folder"),
    (["report", "--suite", "ancors"], "unknown suite 'ancors' (did you mean anchors"),
    (["eval", "--suite", "nosuch"], "unknown suite 'nosuch'"),
    (["eval", "--task", "nia"], "unknown --task 'nia' (did you mean niah?)"),
    (["eval", "--methods", "full,snapkv:kernel=x"], "kernel must be a whole number"),
    (["eval", "--budgets", "0.5,2"], "--budgets"),
    (["eval", "--text", "lega"], "neither a genre (did you mean legal?)"),
    (["eval", "--model", "smollm3"], "unknown model 'smollm3'"),
    (["bench", "--methods", "nosuch"], "unknown method 'nosuch'"),
    (["demo", "--methods", "full,default,mixedmerg"], "unknown method 'mixedmerg' (did you mean mixedmerge"),
    (["demo", "--length", "0"], "--length"),
    (["methods", "snapvk"], "unknown method 'snapvk' (did you mean snapkv?)"),
    (["train-scorer", "--model", "gemma-3-270m"], "unknown model 'gemma-3-270m' (did you mean gemma3-270m?)"),
    (["train-scorer", "--texts", "0"], "argument --texts"),
    (["train-scorer", "--length", "36"], "argument --length", ">= 64"),
    (["train-scorer", "--ridge", "-1"], "argument --ridge", ">= 0"),
    (["train-scorer", "--out", "."], "--out . is a folder"),
    (["train-scorer", "--out", "w.bin"], "NAME.safetensors"),
    (["train-scorer", "--out", "nodir/w.safetensors"], "no folder 'nodir'"),
    (G + ["--method", "snapkv:window=16:window=8"], "sets window twice"),
    (G + ["--seed", "3"], "--seed shapes sampling", "set --temperature"),
    (G + ["--top-k", "5", "--top-p", "0.9"], "--top-k, --top-p shape sampling"),
    (G + ["--method", "full", "--budget", "0.1"], "--budget does not apply"),
    (["compress", "--context", "ctx.txt", "--out", "c.kvz", "--method", "full", "--budget", "0.1"],
     "--budget does not apply"),
    (G + ["--out", "x.kvz"], "kvmerge generate: unknown option '--out'", "kvmerge generate --help"),
    (["methods", "snapkv", "mixedmerge"], "kvmerge methods: unknown argument 'mixedmerge'"),
    (["ask", "c.kvz", "--question", "q", "--method", "snapkv"], "kvmerge ask: --method does not apply",
     "as kvmerge compress made it"),
    (G + ["--method", ""], "names no method"),
    (G + ["--method", "snapkv,mixedmerge"], "names several methods", "eval/bench --methods"),
    (G + ["--method", "snapkv:budget=0.1", "--budget", "0.5"], "budget=0.1", "--budget 0.5", "give the budget once"),
    (["eval", "--task", "ruler", "--subtasks", "multikye"], "no subtask 'multikye' (did you mean multikey"),
    (["eval", "--task", "niah", "--subtasks", "multikey"], "the niah task has none"),
    (["compress", "--context", "ctx.txt", "--out", "nodir/c.kvz"], "no folder 'nodir'"),
]


@pytest.mark.parametrize("mistake", MISTAKES, ids=[" ".join(m[0])[-60:] for m in MISTAKES])
def test_each_mistake_is_one_line_and_exit_status_2_before_the_model_loads(capsys, files, mistake):
    fails(capsys, mistake[0], *mistake[1:])


def test_cuda_without_a_gpu_is_refused_before_the_model_loads(capsys, files, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fails(capsys, G + ["--device", "cuda"], "no CUDA GPU", "--device cpu")
    fails(capsys, G + ["--device", "tpu9"], "unknown device 'tpu9'")
    fails(capsys, G + ["--cuda-graph"], "--cuda-graph replays decoding steps on a CUDA GPU", "torch sees no CUDA GPU")
    fails(capsys, G + ["--cuda-graph", "--device", "cpu"], "would run on cpu: leave --cuda-graph out")
    fails(capsys, ["ask", "no-such.kvz", "--question", "Why?", "--cuda-graph", "--device", "cpu"],
          "would run on cpu: leave --cuda-graph out")


def test_hub_ids_are_refused_at_once_offline_when_not_cached(capsys, files, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fails(capsys, G + ["--model", "nobody/no-such-model"], "not in the local Hugging Face cache", "HF_HUB_OFFLINE")


def test_valid_requests_reach_the_model_with_an_int_budget(capsys, files):
    """`--budget 400` is a number of entries (as in bench and the README): the checks pass."""
    for extra in (["--budget", "400"], ["--budget", "25%"], ["--method", "snapkv:kernel=5", "--prefill-chunk", "64"]):
        with pytest.raises(SystemExit) as e:
            main(G + extra)
        assert e.value.code == 1 and "the model was loaded" in capsys.readouterr().err


def test_a_spec_budget_stands_alone_and_method_names_read_as_specs_do(capsys, files):
    """`--method snapkv:budget=0.1` alone is the spec's budget (no conflict with an unset --budget);
    `kvmerge methods SnapKV` finds snapkv as `--method SnapKV` does."""
    with pytest.raises(SystemExit) as e:
        main(G + ["--method", "snapkv:budget=0.1"])
    assert e.value.code == 1 and "the model was loaded" in capsys.readouterr().err
    for command in (["demo", "--methods", "snapkv:budget=0.1"], ["bench", "--methods", "snapkv:budget=0.1"],
                    ["eval", "--methods", "kvzip:budget=0.4:alloc=uniform"]):  # a suite's spec, as suites run it
        with pytest.raises(SystemExit) as e:
            main(command)
        assert e.value.code == 1 and "the model was loaded" in capsys.readouterr().err, command
    for name in ("SnapKV", "snapkv:window=8"):
        assert main(["methods", name]) == 0
        assert capsys.readouterr().out.startswith("snapkv (method)")


def test_debug_shows_the_traceback(files, monkeypatch):
    with pytest.raises(InputError, match="no such file"):
        main(["--debug", "generate", "--context", "missing.txt", "--question", "q"])
    monkeypatch.setenv("KVMERGE_DEBUG", "1")
    with pytest.raises(InputError, match="no such file"):
        main(["generate", "--context", "missing.txt", "--question", "q"])


def test_methods_table_says_what_each_does_its_cost_and_where_it_runs(capsys, monkeypatch):
    import re

    monkeypatch.setenv("COLUMNS", "120")
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    cols = {c[0].lstrip("* "): c for c in (re.split(r"\s{2,}", line.strip()) for line in out.splitlines())
            if len(c) == 5}
    cols = {re.sub(r" \((default|default in vLLM|fallback)\)$", "", name): c for name, c in cols.items()}
    assert cols["surprisezip"][0] == "surprisezip (default in vLLM)"
    assert cols["zipguardmerge"][0] == "* zipguardmerge" and cols["mixedmerge"][0].startswith("* mixedmerge")
    assert cols["kvzip"][2] == "2nd pass" and cols["snapkv"][2] == "one pass" and "vLLM" in cols["snapkv"][3]
    assert "vLLM" not in cols["kvzip"][3] and cols["zipguard"][1] == "part"
    assert cols["learnedzip"][3] == "hf, vLLM (alloc=uniform)" and cols["snapkv"][3] == "hf, vLLM"
    assert set(kvmerge.available_methods()) <= set(cols)
    from kvmerge.catalog import SHORT

    assert {c[4] for c in cols.values()} - {"what it does"} <= set(SHORT.values())  # every row a short line, none cut
    assert main(["methods", "mixedmerge"]) == 0  # an old name: tests/test_names.py
    detail = capsys.readouterr().out
    assert detail.startswith("mixedmerge (preset, recommended") and "spec: evictmerge:" in detail
    assert main(["methods", "snapkv"]) == 0
    assert "kernel = 7  (int)" in capsys.readouterr().out


def test_methods_fit_the_terminal_and_name_the_default(capsys, monkeypatch):
    """At 100 columns: one line per method within the width, the legend wrapped, the default named;
    `kvmerge methods NAME` has the description the table shortens, and the method's source."""
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    rows = [line for line in lines if line[2:].split(" ")[0] in kvmerge.available_methods()]
    assert len(rows) == len(kvmerge.available_methods())
    assert [r for r in rows if "(default)" in r] == [r for r in rows if r.startswith("* learnedzip (default) ")]
    assert [r for r in rows if "(fallback)" in r] == [r for r in rows if r.startswith("* mixedmerge (fallback) ")]
    legend = " ".join(out.split())
    assert ("Default (kvmerge generate, kvmerge.compressing, the vLLM plugin): learnedzip where the model has "
            "learned-scorer weights (both bundled models; learnedzip:sliding=0.75 on models with sliding-window layers, "
            "surprisezip in vLLM and for a batch of prompts of different lengths), else mixedmerge, which logs one line naming "
            "`kvmerge train-scorer --model PATH`.") in legend
    assert main(["methods", "snapkv"]) == 0
    detail = capsys.readouterr().out
    assert max(map(len, detail.splitlines())) <= 100
    text = " ".join(detail.split())
    assert ("snapkv (method): Scores: attention of the last `obs_window` prompt queries, summed over the group's "
            "query heads, average-pooled with `kernel`; the top-scored entries are kept beside sinks and the recent "
            "window.") in text
    assert "source: SnapKV (Li et al., 2024, arXiv 2404.14469)" in text
    assert main(["methods", "mixedmerge"]) == 0
    assert " ".join(capsys.readouterr().out.split()).startswith(
        "mixedmerge (preset, recommended, the default where the model has no learned-scorer weights): ")
    assert main(["methods", "learnedzip"]) == 0
    assert "default: learnedzip where the model has learned-scorer weights" in " ".join(capsys.readouterr().out.split())


def test_specs_are_read_at_colons_outside_brackets_and_values_as_json():
    from kvmerge.spec import parse_spec

    assert parse_spec("snapkv") == ("snapkv", {})
    assert parse_spec("snapkv:kernel=5:window=8") == ("snapkv", {"kernel": 5, "window": 8})
    assert parse_spec('evictmerge:base={"name":"snapkv","kernel":3}:recent=0.5') == (
        "evictmerge", {"base": {"name": "snapkv", "kernel": 3}, "recent": 0.5})
    assert parse_spec("zipguardmerge:fallback=surprisal+echo") == ("zipguardmerge", {"fallback": "surprisal+echo"})
    assert parse_spec('kvzip:alloc="fit":plus=true') == ("kvzip", {"alloc": "fit", "plus": True})
    with pytest.raises(ValueError, match="expected param=value"):
        parse_spec("snapkv:kernel")


def test_help_and_methods_answer_without_torch(tmp_path):
    code = ("import sys; from kvmerge.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['methods']):\n"
            "    try: main(argv)\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ)
    subprocess.run([sys.executable, "-c", "from kvmerge import catalog; catalog.rows()"], check=True, env=env)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "--budget B" in out.stdout and "(default: 0.25)" in out.stdout and "mixedmerge" in out.stdout


def test_help_texts_name_what_runs(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for name in ("full", "semanticache", "centroidkv", "streamingllm", "snapkv", "surprisemerge", "mixedmerge"):
        assert name in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--question TEXT the question" in out and "(default: 64)" in out
    assert "(default: learnedzip where the model has learned-scorer weights (both bundled models; " in out


def test_report_says_what_it_wrote_with_readable_axes(capsys, tmp_path):
    rows = [{"task": "niah", "method": m, "budget": b, "length": 300, "depth": 0.5, "score": s,
             "cache_bytes": 1, "full_cache_bytes": 4} for m, b, s in [("full", 1.0, 1.0), ("snapkv", 0.25, 0.5)]]
    (tmp_path / "niah.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "| niah | snapkv | 50% |" in out
    assert err.startswith(f"kvmerge report: wrote 2 plot(s) to {tmp_path}: ") and "niah_heatmaps.png" in err
    assert (tmp_path / "niah_score_vs_budget.png").stat().st_size > 0


def test_results_cut_off_or_of_another_model_are_refused_in_one_line(capsys, files):
    (files / "runs").mkdir()
    (files / "runs" / "niah.jsonl").write_text('{"method": "full", "budget": 1.0, "length": 300, "seed": 0}\n'
                                               '{"method": "full", "bud')
    fails(capsys, ["report", "runs"], "results file runs/niah.jsonl: the last line (2) is incomplete", "sed -i")
    fails(capsys, ["eval", "--task", "niah", "--methods", "full", "--out", "runs"],  # before the model loads
          "the last line (2) is incomplete", "run the same command again")
    (files / "runs" / "niah.jsonl").write_text('{"model": "gemma3-270m", "method": "full", "budget": 1.0, '
                                               '"length": 300, "seed": 0}\n')
    fails(capsys, ["eval", "--task", "niah", "--methods", "full", "--out", "runs"],  # the default model's run
          "holds rows of model gemma3-270m, not smollm2-135m", "--out runs/smollm2-135m")


def test_help_shows_every_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split()).split(" options: ", 1)[1]
    for option, default in (("--temperature T 0: greedy", "0.0"), ("--top-k K", "0"), ("--top-p P", "1.0"),
                            ("--seed N seed of the sampler", "none, a fresh seed each run"), ("--max-new-tokens N", "64")):
        start = out.index(option)
        assert f"(default: {default})" in out[start:out.index(" --", start + 3)], option
    assert "--context FILE UTF-8 text file with the context; - reads stdin --question" in out  # required: no default
    assert "--no-progress no progress bars on stderr Errors" in out  # a flag: none
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.5,0.25)" in out and "(default: niah)" in out and "--debug print tracebacks" in out


def test_debug_works_after_the_command_too(files):
    with pytest.raises(InputError, match="no such file"):
        main(["generate", "--context", "missing.txt", "--question", "q", "--debug"])
    with pytest.raises(InputError, match="no results folder"):
        main(["report", "nowhere", "--debug"])


def test_generate_without_a_method_checks_the_default_for_the_model_before_loading_it(capsys, files, monkeypatch,
                                                                                      caplog):
    """`kvmerge generate` without --method: the model's default (learnedzip with learned-scorer weights,
    else mixedmerge and one line naming kvmerge train-scorer), read from its config before it loads."""
    import kvmerge.commands
    import kvmerge.defaults

    from .conftest import tiny_model

    monkeypatch.setattr(kvmerge.defaults, "_told", set())
    checked = []
    real = kvmerge.commands.method
    monkeypatch.setattr(kvmerge.commands, "method", lambda spec, *a: checked.append(spec) or real(spec, *a))
    for name, model in (("weights", tiny_model()), ("none", tiny_model(hidden_size=32, num_attention_heads=2,
                                                                       num_key_value_heads=1))):
        model.config.save_pretrained(files / name)
        (files / name / "model.safetensors").write_bytes(b"")  # weights the test's load_model never reads
        with pytest.raises(SystemExit) as e:
            main(G + ["--model", str(files / name)])
        assert e.value.code == 1 and "the model was loaded" in capsys.readouterr().err
    assert checked == ["learnedzip", "mixedmerge"]
    told = [r.getMessage() for r in caplog.records if r.name == "kvmerge"]
    assert len(told) == 1 and "kvmerge train-scorer --model" in told[0] and "\n" not in told[0]


def test_eval_refuses_lengths_beyond_the_models_positions_before_any_run(capsys, files, monkeypatch):
    from .conftest import TinyTokenizer, tiny_model

    monkeypatch.setattr(kvmerge.model, "load_model", lambda *a, **k: (tiny_model(max_position_embeddings=512),
                                                                      TinyTokenizer()))
    fails(capsys, ["eval", "--lengths", "256,1000", "--out", "out"], "--lengths 1000", "512 positions",
          "ask for fewer tokens")
    assert not (files / "out" / "niah.jsonl").exists()


@pytest.mark.parametrize("pieces, stop, shown", [
    (["\n\n The ferry", " times are: 10:15, 1", "3:30 and", " more"], ["13"], "The ferry times are: 10:15, \n"),
    (["\n\n The ferry", " times", ""], None, "The ferry times\n"),
    (["a", "b", "c"], ["xyz"], "abc\n"),
    (["  ", "\n", ""], ["13"], "\n"),
])
def test_the_streamed_answer_starts_at_its_first_visible_character_and_ends_before_a_stop(capsys, pieces, stop,
                                                                                         shown):
    from kvmerge.commands import Streamer

    streamer = Streamer(object(), stop)
    for piece in pieces[:-1]:
        streamer.on_finalized_text(piece)
    streamer.on_finalized_text(pieces[-1], stream_end=True)
    assert capsys.readouterr().out == shown


def test_the_word_default_in_a_method_list_names_the_models_default_method():
    from kvmerge.eval_commands import with_default
    from kvmerge.defaults import default_method

    from .conftest import tiny_model
    from .test_defaults import no_weights

    assert with_default(["full", "default", "snapkv"], tiny_model()) == ["full", "learnedzip", "snapkv"]
    assert with_default(["default", "mixedmerge"], no_weights()) == ["mixedmerge"]  # once, not twice
    assert with_default(["full", "snapkv", "snapkv"], "no-such-folder") == ["full", "snapkv"]
    assert with_default(["default", "snapkv"], "no-such-folder") == ["snapkv"]  # known once the model loads
    assert default_method(tiny_model()) == "learnedzip"


@pytest.mark.parametrize("argv, stops", [
    (["--stop", "\\n"], ["\n"]),
    (["--stop", "\n"], ["\n"]),  # a real newline (bash's $'\n')
    (["--stop", "Q:, A:"], ["Q:", "A:"]),
    (["--stop", "a\\,b", "--stop", "\\\\n\\tx"], ["a,b", "\\n\tx"]),
])
def test_stop_strings_take_newlines_commas_and_repeat(argv, stops):
    from kvmerge.cli import _parser

    assert _parser().parse_args(G + argv).stop == stops


def test_the_default_method_has_its_name_on_the_command_line_too():
    from kvmerge.cli import _parser

    assert _parser().parse_args(G + ["--method", "default"]).method is None
    assert _parser().parse_args(["compress", "--context", "c.txt", "--out", "c.kvz", "--method", "default"]).method is None


def test_no_progress_silences_transformers_bars(monkeypatch):
    """--no-progress reaches the GGUF conversion's plain tqdm bar as well as transformers' own switch."""
    import argparse

    import transformers.modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging

    from kvmerge.commands import quiet_loading

    monkeypatch.setattr(gguf, "tqdm", gguf.tqdm)  # restored after the test
    monkeypatch.setattr(logging, "_tqdm_active", logging.is_progress_bar_enabled())
    quiet_loading(argparse.Namespace(no_progress=False))
    assert not gguf.tqdm([1], file=open(os.devnull, "w")).disable
    quiet_loading(argparse.Namespace(no_progress=True))
    assert gguf.tqdm([1]).disable and not logging.is_progress_bar_enabled()


def test_training_a_bundled_model_says_its_shipped_weights_give_way(capsys, files, monkeypatch):
    monkeypatch.setenv("KVMERGE_CACHE", str(files / "cache"))
    with pytest.raises(SystemExit):
        main(["train-scorer"])  # the model's loading fails here (no_model): the line comes first
    err = capsys.readouterr().err
    assert err.startswith("training smollm2-135m, a bundled model whose weights ship with kvmerge: these take their "
                          "place (delete the file written to go back); --model FOLDER trains your own model's\n")
    main_out = files / "w.safetensors"
    with pytest.raises(SystemExit):
        main(["train-scorer", "--out", str(main_out)])
    assert "a bundled model" not in capsys.readouterr().err
