"""The Python API refuses bad input before any forward pass, with `KVMergeError`s; a compressed cache
answers many questions correctly; stats read as one line; progress is reported only when asked."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvmerge
from kvmerge.errors import ContextTooLongError, InputError, KVMergeError, ParameterTypeError, suggest
from kvmerge.params import check_params

from .conftest import TinyTokenizer, random_ids, tiny_model


@pytest.fixture
def no_forward():
    """A tiny model whose forward fails the test: a refusal must come before any forward pass."""
    model = tiny_model()

    def refuse(*_):
        raise AssertionError("a forward pass ran before the refusal")

    model.register_forward_pre_hook(refuse)
    return model


@pytest.mark.parametrize("name, params", [("snapkv", dict(budget=0.25, window=8)),
                                          ("centroidkv", dict(budget=0.25, window=8, interval=4))])
def test_a_compressed_cache_answers_a_second_question_as_a_fresh_compression(name, params):
    model = tiny_model()
    ctx, q1, q2 = random_ids(160, seed=1), random_ids(6, seed=2), random_ids(9, seed=3)
    with kvmerge.compressing(model, name, **params) as kv:
        cache = kv.prefill(ctx)
        first = model.generate(torch.tensor([ctx + q1]), cache=cache, max_new_tokens=10, do_sample=False)
        second = model.generate(torch.tensor([ctx + q2]), cache=cache, max_new_tokens=10, do_sample=False)
        again = model.generate(torch.tensor([ctx + q1]), cache=cache, max_new_tokens=10, do_sample=False)
    for q, got in ((q1, first), (q2, second), (q1, again)):
        want = kvmerge.generate_ids(model, ctx, q, kvmerge.get_method(name, **params), max_new_tokens=10).tokens[0]
        assert got[0, len(ctx + q):].tolist() == want
    assert "generate" not in vars(model)  # model.generate is the class's again


def test_a_reused_cache_needs_its_context_first():
    model = tiny_model()
    ctx = random_ids(120, seed=1)
    with kvmerge.compressing(model, "streamingllm", budget=0.25, window=8) as kv:
        cache = kv.prefill(ctx)
        with pytest.raises(InputError, match="must start with"):
            model.generate(torch.tensor([random_ids(130, seed=9)]), cache=cache, max_new_tokens=2)
        with pytest.raises(InputError, match="only the context"):
            model.generate(torch.tensor([ctx]), cache=cache, max_new_tokens=2)
        with pytest.raises(ParameterTypeError, match="not text"):
            kv.prefill("some text")


def test_contexts_beyond_the_model_positions_are_refused_with_both_numbers(no_forward):
    ctx = random_ids(4100)
    with pytest.raises(ContextTooLongError, match=r"4,10\d tokens .* 4,096 positions"):
        kvmerge.generate_ids(no_forward, ctx, [3, 4], kvmerge.get_method("snapkv", budget=0.25))
    with pytest.raises(ContextTooLongError, match="4,096 positions"):
        kvmerge.generate_ids(no_forward, ctx[:4090], [3, 4], max_new_tokens=32)  # no room to answer
    with kvmerge.compressing(no_forward, "snapkv", budget=0.25) as kv:
        with pytest.raises(ContextTooLongError, match="4,100 tokens"):
            kv.prefill(ctx)


def test_the_context_too_long_fix_names_tokens_to_cut_that_make_it_fit(no_forward):
    """The cut is counted from the whole prompt, so it holds when the context row carries a chat template."""
    from kvmerge.prompt import validate

    ctx, method = random_ids(4100), kvmerge.get_method("snapkv", budget=0.25)
    with pytest.raises(ContextTooLongError, match=r"shorten the context by at least 38 tokens"):
        validate(no_forward, [ctx], [[3, 4]], "agnostic", 32, method)
    validate(no_forward, [ctx[:-38]], [[3, 4]], "agnostic", 32, method)  # fits: no error
    with pytest.raises(ContextTooLongError, match="by at least 1 token "):
        validate(no_forward, [ctx[:-37]], [[3, 4]], "agnostic", 32, method)


def test_parameter_types_and_runtime_refusals_come_before_any_forward(no_forward, monkeypatch):
    ctx = random_ids(300)
    with pytest.raises(ParameterTypeError, match="kernel must be a whole number"):
        kvmerge.get_method("snapkv:kernel=five", 0.25)  # kvmerge's own constructors check types
    with pytest.raises(ParameterTypeError, match="window must be a whole number"):
        kvmerge.get_method("snapkv", window="abc")
    bad = kvmerge.get_method("snapkv", 0.25)
    bad.kernel = "five"  # a method changed after it was built is checked again where it is used
    with pytest.raises(ParameterTypeError, match="kernel must be a whole number .*'five'") as e:
        kvmerge.generate_ids(no_forward, ctx, [3], bad)
    assert isinstance(e.value, TypeError) and isinstance(e.value, KVMergeError)
    with pytest.raises(ParameterTypeError, match="kernel"):
        with kvmerge.compressing(no_forward, bad):
            pass
    with pytest.raises(InputError, match="prefill chunk"):
        kvmerge.generate_ids(no_forward, ctx, [3], prefill_chunk=0)
    with pytest.raises(InputError, match="max_new_tokens"):
        kvmerge.generate_ids(no_forward, ctx, [3], max_new_tokens=-1)
    with pytest.raises(ValueError, match="budget"):  # still a ValueError: existing handlers keep working
        kvmerge.generate_ids(no_forward, ctx[:20], [3], kvmerge.get_method("snapkv", budget=0.25))


def test_param_checks_follow_the_declarations():
    from kvmerge.methods import get_method

    check_params(get_method("snapkv:kernel=5:floor=0", 0.25))  # an int where a float goes is fine
    for name in kvmerge.available_methods():
        check_params(kvmerge.get_method(name))
    with pytest.raises(ParameterTypeError, match="true or false"):
        check_params(get_method("h2o:decode=1", 0.25))
    with pytest.raises(ParameterTypeError, match="obs_window"):  # a part's parameters too
        check_params(get_method('evictmerge:base={"name":"snapkv","obs_window":"x"}', 0.25))
    assert suggest("snapvk", ["snapkv", "h2o"]) == " (did you mean snapkv?)"
    assert suggest("zzz", ["snapkv"]) == ""


def test_stats_read_as_one_line_and_as_a_dict(llama):
    out = kvmerge.generate_ids(llama, random_ids(200), [3, 4], kvmerge.get_method("snapkv", budget=0.25, window=8),
                               max_new_tokens=3)
    st = out.stats
    assert isinstance(st, dict) and st["cache_bytes"] < st["full_cache_bytes"] and st.get("method") == "snapkv:window=8"
    line = str(st)
    assert "\n" not in line and "snapkv:window=8 at budget 0.25" in line and "MiB" in line and "(25.0%)" in line
    assert "prefill" in line and "decode" in line and st.layers == st["cache_entries"] == [50, 50]
    assert set(st.seconds) == {"prefill", "compress", "decode"}
    assert all(v == round(v, 2) for v in st.seconds.values())


def test_stats_name_the_layers_the_budget_applies_to_when_others_keep_their_window():
    from kvmerge.stats import Stats

    base = {"method": "learnedzip", "budget": 0.25, "context_tokens": 205, "cache_entries": [42, 205],
            "cache_bytes": 875, "full_cache_bytes": 1000}
    assert "budget applies to" not in str(Stats(base, compressed_layers_bytes=875, compressed_layers_full_bytes=1000))
    line = str(Stats(base, compressed_layers_bytes=50, compressed_layers_full_bytes=200))
    assert "(87.5%)" in line and "the layers the budget applies to 25.0% (sliding-window layers keep their window)" in line


def test_stats_say_when_a_count_budget_holds_the_whole_context(llama):
    out = kvmerge.generate_ids(llama, random_ids(200), [3, 4], "snapkv", budget=2000, max_new_tokens=1)
    assert "at budget 2000 (entries, at least the context's tokens: nothing was compressed)" in str(out.stats)
    assert out.stats["cache_bytes"] == out.stats["full_cache_bytes"]
    out = kvmerge.generate_ids(llama, random_ids(200), [3, 4], "snapkv", budget=100, max_new_tokens=1)
    assert "nothing was compressed" not in str(out.stats)


def test_budget_goes_with_a_name_and_a_method_object_carries_its_own(llama):
    ids = random_ids(200, seed=3)
    out = kvmerge.generate_ids(llama, ids, [3, 4], "snapkv:window=8", max_new_tokens=2, budget=0.5)
    want = kvmerge.generate_ids(llama, ids, [3, 4], kvmerge.get_method("snapkv", budget=0.5, window=8), max_new_tokens=2)
    assert out.stats["budget"] == 0.5 and out.tokens == want.tokens
    assert out.stats["cache_entries"] == want.stats["cache_entries"] == [100, 100]
    rows = kvmerge.answer_questions_ids(llama, ids, [[3, 4]], "snapkv:window=8", max_new_tokens=2, budget=0.5)
    assert rows[0].stats["cache_entries"] == [100, 100]
    chunked = kvmerge.answer_questions_ids(llama, ids, [[3, 4]], "snapkv:window=8", max_new_tokens=2, prefill_chunk=64)
    alone = kvmerge.generate_ids(llama, ids, [3, 4], "snapkv:window=8", max_new_tokens=2, prefill_chunk=64)
    assert chunked[0].tokens == alone.tokens and chunked[0].stats["cache_entries"] == alone.stats["cache_entries"]
    with pytest.raises(ParameterTypeError, match="budget= goes with a method name"):
        kvmerge.generate_ids(llama, ids, [3], kvmerge.get_method("snapkv"), budget=0.5)


def test_swapped_arguments_and_empty_questions_are_refused_before_any_forward(no_forward):
    tok = TinyTokenizer()
    with pytest.raises(ParameterTypeError, match="takes a transformers model first"):
        kvmerge.generate(tok, no_forward, "a context", "q")
    with pytest.raises(ParameterTypeError, match="tokenizer second"):
        kvmerge.generate(no_forward, no_forward, "a context", "q")
    with pytest.raises(ParameterTypeError, match="takes a transformers model first"):
        kvmerge.generate_ids(tok, [1, 2], [3])
    with pytest.raises(InputError, match="a question is empty"):
        kvmerge.generate(no_forward, tok, "a context", "  ")
    with pytest.raises(InputError, match="a question is empty"):
        kvmerge.answer_questions(no_forward, tok, "a context", ["q", ""])
    with pytest.raises(InputError, match="needs the model's tokenizer"):
        kvmerge.generate(no_forward, None, "a context", "q")
    with pytest.raises(InputError, match="1 context but 2 questions .*kvmerge.answer_questions"):
        kvmerge.generate(no_forward, tok, "a context", ["q", "r"])


def test_a_misspelt_parameter_is_answered_with_the_closest_names_in_python_as_on_the_command_line():
    with pytest.raises(ParameterTypeError, match=r"snapkv has no parameter\(s\) windw \(did you mean window or obs_window\?\)"):
        kvmerge.get_method("snapkv:windw=3")


def test_a_spec_budget_and_budget_given_apart_must_agree(llama):
    ids = random_ids(200, seed=3)
    with pytest.raises(InputError, match=r"snapkv:budget=0.1 sets budget=0.1 and budget= 0.5: give the budget once"):
        kvmerge.generate_ids(llama, ids, [3], "snapkv:budget=0.1", budget=0.5)
    out = kvmerge.generate_ids(llama, ids, [3], "snapkv:budget=0.5:window=8", max_new_tokens=1, budget=0.5)
    assert out.stats["cache_entries"] == [100, 100]


@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_below_one_entry_names_both_forms(budget):
    with pytest.raises(InputError, match=r"a fraction in \(0, 1\] \(e.g. 0.25\) or a whole number of entries >= 1"):
        kvmerge.get_method("snapkv", budget=budget)


def test_a_context_too_short_for_the_budget_names_the_ways_out(llama):
    with pytest.raises(InputError, match=r"keep at least 36 entries .*protect fewer recent tokens \(window=(\d+).*method full"
                       ) as refused:
        kvmerge.generate_ids(llama, random_ids(50), [1], "streamingllm")
    window = int(re.search(r"window=(\d+)", str(refused.value)).group(1))
    assert window == 12 - 4  # 50 tokens at 0.25 keep round(12.5) = 12 entries, 4 of them sinks
    out = kvmerge.generate_ids(llama, random_ids(50), [1], f"streamingllm:window={window}", max_new_tokens=1)
    assert set(out.stats.layers) == {12}  # the way out it names works: 12 entries in every layer


def test_a_context_shorter_than_the_protected_tokens_is_not_told_to_keep_more_than_it_has(llama):
    with pytest.raises(ValueError, match=r"3 tokens give 1 entry, .*; keep the whole cache \(method full\)$"):
        kvmerge.get_method("streamingllm", budget=0.25).target(3)


@pytest.mark.parametrize("chunk", [None, 64])
def test_progress_is_reported_when_asked_and_only_then(llama, capsys, chunk):
    events = []
    ctx = random_ids(200)
    m = kvmerge.get_method("snapkv", budget=0.25, window=8)
    kvmerge.generate_ids(llama, ctx, [3, 4], m, max_new_tokens=4, prefill_chunk=chunk,
                         progress=lambda *e: events.append(e))
    phases = [e[0] for e in events]
    assert phases[0] == "prefill" and "compress" in phases and phases[-4:] == ["decode"] * 4
    prompt = [e[1] for e in events if e[0] != "decode"]
    assert prompt == sorted(prompt) and prompt[-1] == pytest.approx(200) and {e[2] for e in events[:-4]} == {200}
    assert [e[1] for e in events[-4:]] == [1, 2, 3, 4]
    kvmerge.generate_ids(llama, ctx, [3, 4], m, max_new_tokens=4, progress=True)  # under 2 s: no bar drawn
    assert capsys.readouterr() == ("", "")
    assert not hasattr(vars(kvmerge.Session(llama, 1)), "feed_prompt")


def test_text_apis_refuse_token_ids_and_ids_apis_refuse_text(llama):
    with pytest.raises(ParameterTypeError, match="token ids go to generate_ids"):
        kvmerge.generate(llama, object(), [1, 2], "q")
    with pytest.raises(ParameterTypeError, match="token ids go to generate_ids"):
        kvmerge.generate(llama, object(), "a context", [5, 6, 7])  # the question as ids, not three questions
    with pytest.raises(ParameterTypeError, match="text goes to"):
        kvmerge.generate_ids(llama, "a long context", [1])
    with pytest.raises(InputError, match="unknown method"):
        kvmerge.answer_questions(llama, object(), "context", ["q"], "nosuch")


def test_inputs_of_the_wrong_type_are_named_not_met_deep_inside(llama):
    """None, a number, a list of texts where one context goes, floats for token ids, one context where a
    list goes: each refused naming the parameter and what it takes."""
    tok = TinyTokenizer()
    for call, match in [(lambda: kvmerge.generate(llama, tok, None, "q"), "takes the context as text .*got NoneType"),
                        (lambda: kvmerge.generate(llama, tok, 123, "q"), "takes the context as text .*got int"),
                        (lambda: kvmerge.generate(llama, tok, "ctx", None), "takes the question as a str .*NoneType"),
                        (lambda: kvmerge.compress_context(llama, tok, None, "snapkv"), "takes one context: .*NoneType"),
                        (lambda: kvmerge.compress_context(llama, tok, ["a", "b"], "snapkv"),
                         "takes one context: .*a list of str"),
                        (lambda: kvmerge.generate_ids(llama, [1.0] * 50, [3], "snapkv"),
                         "token ids must be ints, got float '1.0'"),
                        (lambda: kvmerge.answer_contexts(llama, tok, object(), "q"),
                         "answer_contexts takes a list of compressed contexts .*got object")]:
        with pytest.raises(ParameterTypeError, match=match):
            call()
    for spec, match in [("pyramidkv:beta=0", "beta >= 1"), ("expectedattention:n_future=-1", "n_future >= 1"),
                        ("snapkv:sliding=0.75", "sliding=0.75 shortens sliding-window layers, and this model has none")]:
        with pytest.raises(InputError, match=match):
            kvmerge.generate_ids(llama, random_ids(120), [3], spec, max_new_tokens=1)


def test_import_is_light_and_names_still_import():
    code = ("import sys, kvmerge, kvmerge.cli; assert 'torch' not in sys.modules, 'torch imported'; "
            "from kvmerge import generate, compressing, KVMergeError, Stats; import kvmerge.layer; "
            "assert kvmerge.layer.MergedLayer and 'generate' in dir(kvmerge)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.ci_slow
def test_smollm2_answers_two_questions_from_one_compressed_cache():
    model, tok = kvmerge.load_model()
    context = "The library opens at nine. The code of the back door is 4721. Visitors sign the book. " * 12
    questions = ["What is the code of the back door?", "When does the library open?"]
    ctx = kvmerge.split_prompt(tok, context, questions[0])[0]
    rows = [kvmerge.split_prompt(tok, context, q)[1] for q in questions]
    from kvmerge.prompt import end_ids

    ends = end_ids(tok)
    assert tok.convert_tokens_to_ids("<|im_end|>") in ends

    def answer(tokens):  # up to the end of the turn
        cut = [i for i, t in enumerate(tokens) if t in ends]
        return tokens[:cut[0] + 1] if cut else tokens

    with kvmerge.compressing(model, "snapkv", budget=0.25, tokenizer=tok) as kv:
        cache = kv.prefill(ctx)
        got = [model.generate(torch.tensor([ctx + q]), cache=cache, max_new_tokens=12, do_sample=False)
               [0, len(ctx + q):].tolist() for q in rows]
    want = [kvmerge.generate_ids(model, ctx, q, kvmerge.get_method("snapkv", budget=0.25), max_new_tokens=12,
                                 tokenizer=tok).tokens[0] for q in rows]
    assert [answer(g) for g in got] == [answer(w) for w in want]
    outs = kvmerge.answer_questions(model, tok, context, questions, "snapkv", max_new_tokens=24)
    alone = kvmerge.generate(model, tok, context, questions[1], "snapkv", max_new_tokens=24)
    assert outs[1].text == alone.text and all(out.text for out in outs)
    for out in outs:
        tokens = out.tokens[0]
        assert len(tokens) == 24 or tokens[-1] in ends  # stopped at the end of its turn
        assert not any(t in ends for t in tokens[:-1]) and "<|im_start|>" not in tok.decode(tokens)


def test_model_names_are_checked_before_anything_loads(monkeypatch, tmp_path):
    from kvmerge.errors import UnknownNameError

    with pytest.raises(UnknownNameError, match=r"'gemma-3-270m' \(did you mean gemma3-270m\?\); bundled models: "
                                               r"smollm2-135m, gemma3-270m"):
        kvmerge.load_model("gemma-3-270m")
    with pytest.raises(InputError, match="no model at ./missing"):
        kvmerge.load_model("./missing")
    with pytest.raises(InputError, match="folder without a model"):
        kvmerge.load_model(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="not in the local Hugging Face cache and HF_HUB_OFFLINE is set"):
        kvmerge.load_model("nobody/no-such-model")


def test_processes_loading_a_bundled_model_at_once_convert_it_once(monkeypatch, tmp_path):
    """The first load converts the GGUF; loads started meanwhile wait on the lock and read its folder, and
    a folder left half-written by a stopped conversion is replaced."""
    import threading
    import time

    from kvmerge import model as m

    class Saved:  # what _load_gguf returns, reduced to save_pretrained
        def __init__(self, file):
            self.file, self.config = file, type("Config", (), {})()

        def save_pretrained(self, folder):
            Path(folder).mkdir(exist_ok=True)
            time.sleep(0.2)
            (Path(folder) / self.file).write_text("x")

    converted = []
    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path))
    monkeypatch.setattr(m, "_bundled_gguf", lambda name: Path("/bundled/model.gguf"))
    monkeypatch.setattr(m, "_load_gguf", lambda gguf, dtype: converted.append(1) or (Saved("model.safetensors"), Saved("tokenizer.json")))
    (tmp_path / "smollm2-135m.tmp").mkdir()
    (tmp_path / "smollm2-135m.tmp" / "stale").write_text("half")
    out = []
    threads = [threading.Thread(target=lambda: out.append(m._convert_once("smollm2-135m"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert converted == [1] and out == [tmp_path / "smollm2-135m"] * 3
    assert sorted(f.name for f in out[0].iterdir()) == ["model.safetensors", "tokenizer.json"]
    assert not (tmp_path / "smollm2-135m.tmp").exists()


@pytest.mark.parametrize("spec, problem", [("snapkv:kernel=4", "kernel must be an odd"), ("snapkv:kernel=0", "kernel must be an odd"),
                                           ("snapkv:obs_window=0", "obs_window must be >= 1"),
                                           ("mixedattention:obs_window=-2", "obs_window must be >= 1")])
def test_a_pooling_kernel_or_query_window_that_cannot_score_is_refused_by_name(spec, problem):
    with pytest.raises(kvmerge.KVMergeError, match=problem):
        kvmerge.get_method(spec)


def test_a_hub_id_that_cannot_be_downloaded_is_refused_at_once(monkeypatch):
    """Not cached and the hub unreachable: one line in seconds, not minutes of retries."""
    import time

    for name in ("HF_HUB_OFFLINE", "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens
    start = time.perf_counter()
    with pytest.raises(InputError, match="not in the local Hugging Face cache and the hub cannot be reached"):
        kvmerge.load_model("nobody/no-such-model")
    assert time.perf_counter() - start < 10


def test_a_model_type_kvmerge_cannot_run_is_refused_before_its_weights_load(tmp_path):
    """The config decides: its weights (here an empty, unreadable file) are never read."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="unsupported model type 'gpt2': kvmerge needs a decoder-only RoPE model"):
        kvmerge.load_model(tmp_path)


def test_generate_ids_decodes_its_rows_when_given_a_tokenizer_that_decodes(llama):
    class Decoding(TinyTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    one = kvmerge.generate_ids(llama, random_ids(200), [3], "snapkv", max_new_tokens=2, tokenizer=Decoding())
    assert one.text == " ".join(map(str, one.tokens[0]))
    rows = kvmerge.generate_ids(llama, [random_ids(200)] * 2, [[3], [4]], "snapkv", max_new_tokens=2,
                                tokenizer=Decoding())
    assert rows.text == [" ".join(map(str, t)) for t in rows.tokens]
    assert kvmerge.generate_ids(llama, random_ids(200), [3], "snapkv", max_new_tokens=2).text == ""  # no tokenizer


def test_spaces_around_a_specs_parts_are_read_past_and_an_entry_budget_of_one_is_told_about_the_fraction():
    assert kvmerge.get_method(" snapkv : window = 8 ").window == 8
    assert kvmerge.get_method("snapkv: window=8:sinks =2").sinks == 2
    with pytest.raises(InputError, match=r"budget of 1 entries is below .*: budget=1.0 keeps every entry"):
        kvmerge.get_method("snapkv", budget=1)
    with pytest.raises(InputError, match=r"budget of 25 entries is below .* \(for 25%, write 0.25\)"):
        kvmerge.get_method("snapkv", budget=25)
    for text, want in (("25%", "budget=0.25"), ("0.1", "budget=0.1")):  # the command line's spellings
        with pytest.raises(ParameterTypeError, match=f"parameter budget must be a number .*got '{text}': write {want}$"):
            kvmerge.get_method("snapkv", budget=text)


def test_answer_questions_samples_each_answer_as_generate_would_alone(llama):
    from kvmerge.decoding import Sampling

    ctx, questions = random_ids(200, seed=4), [[3, 4], [5]]
    drawn = kvmerge.answer_questions(llama, ctx, questions, None, max_new_tokens=6, temperature=1.5, seed=3)
    again = kvmerge.answer_questions(llama, ctx, questions, None, max_new_tokens=6, temperature=1.5, seed=3)
    alone = [kvmerge.generate_ids(llama, ctx, q, max_new_tokens=6, sampling=Sampling(1.5, seed=3)) for q in questions]
    assert [o.tokens for o in drawn] == [o.tokens for o in again] == [o.tokens for o in alone]
    greedy = kvmerge.answer_questions(llama, ctx, questions, None, max_new_tokens=6)
    assert [o.tokens for o in greedy] != [o.tokens for o in drawn]
    with pytest.raises(InputError, match="stop strings need the tokenizer"):
        kvmerge.answer_questions(llama, ctx, questions, None, stop=["x"])
    with pytest.raises(InputError, match="temperature"):
        kvmerge.answer_questions(llama, ctx, questions, None, temperature=-1)


def test_another_models_tokenizer_is_refused_by_its_ids(llama):
    """A tokenizer with over 10% more ids than the model's vocabulary, or over 10% fewer and neither
    special id in common, is another model's: refused in one line; the others pass."""

    class Other(TinyTokenizer):
        def __init__(self, bos, eos, size=None):
            self.bos_token_id, self.eos_token_id, self.size = bos, eos, size

        def __len__(self):
            return self.size or super().__len__()

    text = random_ids(160)  # the check runs on token ids too
    assert (llama.config.bos_token_id, llama.config.eos_token_id) == (1, 2)
    for tok, why in ((Other(7, 8, size=20), "it has 20 ids, the model's vocabulary 96, and neither its beginning- nor"),
                     (Other(1, 2, size=10 * llama.config.vocab_size), "it has 960 ids, the model's vocabulary")):
        with pytest.raises(KVMergeError, match=f"the tokenizer is not this model's \\({why}"):
            kvmerge.compress_context(llama, tok, text, "snapkv")
        with pytest.raises(KVMergeError, match="compressing.*the tokenizer is not this model's"):
            with kvmerge.compressing(llama, "snapkv", tokenizer=tok):
                pass
    for tok in (Other(1, 8), Other(None, 9), Other(1, 2), Other(1, 2, size=llama.config.vocab_size + 1),
                Other(7, 8)):  # the last: one vocabulary, other special ids (a base model's instruct tokenizer)
        assert kvmerge.compress_context(llama, tok, text, "snapkv").tokens == len(text)


def test_the_prompt_bar_names_its_phase_within_the_prompt():
    """Prefill and compression share one bar and one clock: its label says the clock is the prompt's."""
    import io

    from kvmerge.progress import ProgressBars

    out = io.StringIO()
    bars = ProgressBars(delay=0, file=out)
    bars("prefill", 10, 20)
    bars("compress", 20, 20)
    bars("decode", 1, 2)
    bars.close()
    shown = out.getvalue()
    assert "prompt (prefill)" in shown and "prompt (compress)" in shown and "decode" in shown
    assert "\rcompress" not in shown and not shown.startswith("compress")
