"""The default method, defined once (`kvmerge.defaults.default_method`): learnedzip where the model has
learned-scorer weights (with the sliding share on a model with sliding-window layers; uniform
allocation in vLLM), else mixedmerge with one line naming `kvmerge train-scorer`."""

import os
from types import SimpleNamespace

import pytest
import torch

import kvmerge
import kvmerge.defaults
from kvmerge.errors import InputError
from kvmerge.defaults import default_method
from kvmerge.scorer import fingerprint

from .conftest import TinyTokenizer, random_ids, tiny_model
from .test_hybrid import gemma3


def no_weights():
    """A tiny model whose shapes no scorer in the tests' folder (conftest) was made for."""
    return tiny_model(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(kvmerge.defaults, "_told", set())  # every test sees the first telling
    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path))  # no weights trained on this machine


def told(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvmerge"]


def test_a_model_without_weights_defaults_to_mixedmerge_with_one_line_naming_the_training_command(caplog):
    model = no_weights()
    assert default_method(model) == "mixedmerge" and default_method(model.config, runtime="vllm") == "mixedmerge"
    (line,) = told(caplog)  # once per model, however often asked
    assert "\n" not in line and "so the default method is mixedmerge" in line
    assert "`kvmerge train-scorer --model PATH` fits them" in line and "then the default is learnedzip" in line
    kvmerge.defaults._told.clear()
    assert default_method(model.config, runtime="vllm") == "mixedmerge"
    assert told(caplog)[-1].endswith("then the default is surprisezip")  # vLLM's, once trained


def test_weights_that_do_not_fit_or_a_model_kvmerge_cannot_run_fall_back_to_mixedmerge(caplog, monkeypatch, tmp_path):
    """Weights of this fingerprint made for other shapes (another layer layout): the fallback, with one
    line naming the misfit and the command; a model type kvmerge refuses gets no advice to train."""
    from transformers import GPT2Config

    from kvmerge.scorer import LinearScorer, fingerprint

    model = no_weights()
    LinearScorer([torch.zeros(65, 1) for _ in range(3)], fingerprint(model.config), {}).save(tmp_path / "w.safetensors")
    monkeypatch.setenv("KVMERGE_SCORERS", str(tmp_path))
    assert default_method(model) == "mixedmerge"
    (line,) = told(caplog)
    assert "the learned-scorer weights found do not fit this model (scorer weights" in line
    assert "so the default method is mixedmerge; `kvmerge train-scorer --model" in line and "\n" not in line
    assert default_method(GPT2Config()) == "mixedmerge" and len(told(caplog)) == 1


def test_a_model_with_weights_defaults_to_learnedzip_as_its_results_were_measured(caplog):
    """conftest's folder holds (random) weights for tiny_model() and the tiny Gemma-3."""
    assert default_method(tiny_model()) == "learnedzip"
    assert default_method(tiny_model(), runtime="vllm") == "surprisezip"
    assert default_method(gemma3()) == "learnedzip:sliding=0.75"  # sliding-window layers: the share
    assert told(caplog) == []


def test_weights_trained_here_switch_the_default(monkeypatch, caplog):
    """`kvmerge train-scorer`'s function on a tiny model (its corpus replaced) writes weights where the
    default finds them: mixedmerge before, learnedzip after."""
    import kvmerge.train_scorer as ts

    model = no_weights()
    assert default_method(model) == "mixedmerge"
    monkeypatch.setattr(ts, "corpus", lambda: ["".join(chr(97 + (7 * i + j) % 26) for i in range(400)) for j in range(6)])
    monkeypatch.setattr(ts, "load_model", lambda name: (model, TinyTokenizer()), raising=False)
    monkeypatch.setattr("kvmerge.model.load_model", lambda name: (model, TinyTokenizer()))
    path = ts.main("tiny", texts=3, held=1, length=96)
    assert path.exists() and default_method(model) == "learnedzip"
    assert len(told(caplog)) == 1


def _train_tiny(monkeypatch, model):
    import kvmerge.train_scorer as ts

    monkeypatch.setattr(ts, "corpus", lambda: ["".join(chr(97 + (7 * i + j) % 26) for i in range(400)) for j in range(6)])
    monkeypatch.setattr("kvmerge.model.load_model", lambda name: (model, TinyTokenizer()))
    return ts


def test_training_over_found_weights_says_which_it_replaces_and_one_run_writes_a_file_at_a_time(monkeypatch, caplog,
                                                                                                  tmp_path):
    from filelock import FileLock, Timeout

    model = tiny_model()  # conftest's folder holds weights for it: training here takes their place
    before = kvmerge.scorer.locate(model.config)
    ts = _train_tiny(monkeypatch, model)
    path = ts.main("tiny", texts=3, held=1, length=96)
    (line,) = told(caplog)
    assert f"now uses {path} instead of {before}; delete {path} to go back to it" in line
    assert kvmerge.scorer.locate(model.config) == path
    out = tmp_path / "w.safetensors"
    lock = next(iter((tmp_path / "locks").glob("*.lock")))  # the one lock file, beside no weights
    monkeypatch.setattr(ts, "train", lambda *a, **k: pytest.fail("trained while another run held the file"))
    original = FileLock.acquire

    def held(self, timeout=None, **kwargs):  # another process holds every lock
        raise Timeout(self.lock_file)

    monkeypatch.setattr(FileLock, "acquire", held)
    with pytest.raises(InputError, match=rf"another `kvmerge train-scorer` is writing {out}: wait for it"):
        ts.main("tiny", out=str(out), texts=3, held=1, length=96)
    monkeypatch.setattr(FileLock, "acquire", original)
    assert lock.exists() and not out.exists()


def test_training_into_another_models_weights_is_refused_before_training(monkeypatch, tmp_path, capsys):
    """--out holding weights of another fingerprint would lose them: refused before any piece; an --out the
    model's own earlier file would hide is named; a cache that cannot hold locks does not stop --out."""
    from kvmerge.commands import train_scorer
    from kvmerge.scorer import trained_path

    model, other = no_weights(), tiny_model()
    theirs = tmp_path / "team.safetensors"
    kvmerge.scorer.find(other.config).save(theirs)
    ts = _train_tiny(monkeypatch, model)
    monkeypatch.setattr(ts, "train", lambda *a, **k: pytest.fail("trained over another model's weights"))
    with pytest.raises(InputError, match=rf"--out {theirs} holds weights made for another model \(.*fingerprint "
                                         rf"{fingerprint(other.config)}; this one's is {fingerprint(model.config)}\): "
                                         "give a new file name"):
        ts.main("tiny", out=str(theirs), texts=3, held=1, length=96)
    monkeypatch.undo()
    ts = _train_tiny(monkeypatch, model)
    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path / "cache"))
    ts.main("tiny", texts=3, held=1, length=96)  # the cache's own file: read before any folder
    for lock in (tmp_path / "cache" / "locks").glob("*"):
        lock.unlink()
    (tmp_path / "cache" / "locks").rmdir()
    (tmp_path / "cache" / "locks").write_text("not a folder")  # no locks in the cache: the temporary folder's
    out = tmp_path / "mine.safetensors"
    import transformers.modeling_gguf_pytorch_utils as gguf
    from transformers.utils import logging as hf_logging

    monkeypatch.setattr(gguf, "tqdm", gguf.tqdm)  # --no-progress's switches, restored after the test
    monkeypatch.setattr(hf_logging, "_tqdm_active", hf_logging.is_progress_bar_enabled())
    train_scorer(SimpleNamespace(model=None, out=str(out), texts=3, held=1, length=96, seed=0, ridge=1e-2,
                                         kind="linear", hidden=64, epochs=8, target="log", no_progress=True,
                                 debug=False))
    err = capsys.readouterr().err
    assert out.exists() and f"for learnedzip to read {out}: delete {trained_path(model.config)}, trained here " \
        f"earlier, which learnedzip reads before any folder and set KVMERGE_SCORERS={tmp_path} in the environment" in err


def test_training_with_a_tokenizer_that_is_not_the_models_is_refused_naming_it(monkeypatch):
    model = tiny_model(vocab_size=40)  # TinyTokenizer's ids reach 95
    ts = _train_tiny(monkeypatch, model)
    monkeypatch.setattr(ts, "examples", lambda *a: pytest.fail("a forward ran"))
    with pytest.raises(InputError, match=r"the tokenizer gives token id \d+, outside the model's vocabulary \[0, 40\): "
                                         r"the folder's tokenizer is not the model's"):
        ts.train(model, TinyTokenizer(), texts=3, held=1, length=96)


def test_train_scorer_refuses_a_destination_it_must_not_replace_or_cannot_write(tmp_path, monkeypatch, capsys):
    """Before the model loads: an existing file that is not scorer weights, a folder it cannot write."""
    from safetensors.torch import save_file

    from .test_cli import fails

    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"  # a model's own weights: not scorer weights
    save_file({"w": torch.ones(3)}, str(weights), metadata={"format": "pt"})
    model = ["train-scorer", "--model", str(tmp_path)]
    fails(capsys, model + ["--out", str(weights)],
          f"--out {weights} exists and is not scorer weights `kvmerge train-scorer` wrote (scorer weights {weights} "
          "name no model in their metadata", "): give a new file name")
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if not os.access(locked, os.W_OK):  # (root writes anywhere)
            fails(capsys, model + ["--out", str(locked / "w.safetensors")],
                  f"cannot write in {locked}: give --out in a folder you can write")
    finally:
        locked.chmod(0o700)
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("KVMERGE_CACHE", str(tmp_path / "file" / "cache"))
    fails(capsys, model, f"cannot make the folder {tmp_path / 'file' / 'cache' / 'scorers'} for the scorer's weights",
          "set KVMERGE_CACHE to a folder you can write, or give --out")


def test_compressing_without_a_method_uses_the_default():
    for model, name in ((tiny_model(), "learnedzip"), (no_weights(), "mixedmerge")):
        ctx = random_ids(120, seed=5)
        with kvmerge.compressing(model, budget=0.25, window=8, tokenizer=TinyTokenizer()) as kv:
            assert kv.method.label == name and kv.method.budget == 0.25
            out = model.generate(torch.tensor([ctx]), max_new_tokens=2, do_sample=False)
        assert out.shape == (1, 122)


def _vllm_config(model, settings):
    """What `kvmerge.vllm.config.check` reads of vLLM's config, for a transformers model."""
    text = model.config
    return SimpleNamespace(
        additional_config={"kvmerge": settings},
        model_config=SimpleNamespace(hf_text_config=text, hf_config=text, get_head_size=lambda: 16),
        cache_config=SimpleNamespace(enable_prefix_caching=False, cache_dtype="auto"), speculative_config=None,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
                                        worker_cls="auto"),
        use_v2_model_runner=False, scheduler_config=SimpleNamespace(scheduler_cls=None))


def test_the_vllm_plugin_without_a_method_runs_the_default_written_into_its_config(caplog):
    from kvmerge.vllm.config import check

    for model, spec in ((tiny_model(), "surprisezip"), (no_weights(), "mixedmerge")):
        config = _vllm_config(model, {"budget": 0.25})
        settings = check(config)
        assert settings.method == spec and config.additional_config["kvmerge"]["method"] == spec  # every process
        assert settings.build().budget == 0.25
    assert len(told(caplog)) == 1
    with pytest.raises(ValueError, match=r'"method" must be a method spec string .*, or left out for the default'):
        check(_vllm_config(tiny_model(), {"method": 3}))


def test_compressing_refuses_a_method_that_needs_the_tokenizer_without_one():
    """mixedmerge (the default without weights) reads sentence ends: refused at the block's start, in one
    line, not as an error inside the first forward."""
    with pytest.raises(kvmerge.KVMergeError, match=r"^mixedmerge needs the model's tokenizer \(sentence ends, its chat "
                       r"template\): pass tokenizer=tok to kvmerge.compressing$"):
        with kvmerge.compressing(no_weights()):
            pass


class CharTokenizer(TinyTokenizer):
    """TinyTokenizer for text: one id per character, with offsets (what split_prompt reads) and decode."""

    eos_token_id = 2
    chat_template = None

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        out = super().__call__(text)
        if return_offsets_mapping:
            out["offset_mapping"] = [(i, i + 1) for i in range(len(text))]
        return out

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


def test_generate_and_answer_questions_without_a_method_compress_with_the_default():
    """None is the default for the model (not the full cache): mixedmerge on a model without weights,
    learnedzip on one with them, each at its default budget; "full" keeps everything."""
    tok, ctx, q = CharTokenizer(), "The door code is 4721. The library opens at nine. " * 8, "Code?"
    for model, name in ((no_weights(), "mixedmerge"), (tiny_model(), "learnedzip")):
        out = kvmerge.generate(model, tok, ctx, q, max_new_tokens=4)
        want = kvmerge.generate(model, tok, ctx, q, kvmerge.get_method(name), max_new_tokens=4)
        assert out.stats["method"] == name and out.stats["budget"] == 0.25 and out.tokens == want.tokens
        full = kvmerge.generate(model, tok, ctx, q, "full", max_new_tokens=4)
        assert out.stats["cache_entries"] < full.stats["cache_entries"]
        (answer,) = kvmerge.answer_questions(model, tok, ctx, [q], max_new_tokens=4)
        assert answer.stats["method"] == name and answer.tokens == want.tokens
        assert kvmerge.generate(model, tok, ctx, q, "default", max_new_tokens=4).tokens == want.tokens
        assert kvmerge.compress_context(model, tok, ctx, "default").meta["method"] == name  # the name, not "default"
        ids = kvmerge.split_prompt(tok, ctx, q)
        assert kvmerge.generate_ids(model, *ids, max_new_tokens=4, tokenizer=tok).stats["method"] == name
        assert kvmerge.answer_questions_ids(model, ids[0], [ids[1]], tokenizer=tok)[0].stats["method"] == name


def test_the_default_that_reads_sentence_ends_is_refused_without_a_tokenizer_in_one_line():
    ctx = random_ids(200, seed=3)
    with pytest.raises(InputError, match=r"^the default method for this model, mixedmerge, needs the model's "
                       r"tokenizer .*: pass tokenizer=tok, or a method \(get_method\('full'\) keeps the whole cache\)$"):
        kvmerge.generate_ids(no_weights(), ctx, [3, 4])
    with pytest.raises(InputError, match="the default method for this model, mixedmerge"):
        kvmerge.answer_questions_ids(no_weights(), ctx, [[3, 4]])
    full = kvmerge.generate_ids(no_weights(), ctx, [3, 4], "full", max_new_tokens=2)  # a name works too
    assert full.stats["method"] == "full"


def test_a_model_with_sliding_window_layers_only_is_not_sent_to_train(caplog):
    """Nothing to compress or train there: the fallback is named by the session's own refusal, and no
    line advises `kvmerge train-scorer`."""
    every = tiny_model(sliding_window=16, layer_types=["sliding_attention", "sliding_attention"])
    assert default_method(every) == "mixedmerge" and told(caplog) == []


def test_rows_of_different_lengths_run_the_default_with_one_count_per_layer_and_head():
    """A global ranking and the sliding share need rows of one length: the default runs uniformly for
    such a batch, a named method that needs them is refused before any forward, naming alloc=uniform."""
    model = tiny_model()
    rows, questions = [random_ids(150, seed=1), random_ids(170, seed=2)], [[3], [4]]
    out = kvmerge.generate_ids(model, rows, questions, max_new_tokens=2, tokenizer=TinyTokenizer())
    assert out.stats["method"] == "surprisezip" and out.tokens
    alone = kvmerge.generate_ids(model, rows[:1], questions[:1], "surprisezip", max_new_tokens=2,
                                 tokenizer=TinyTokenizer())
    assert out.tokens[0] == alone.tokens[0]  # row 0 as the uniform default runs it alone
    calls = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *a: calls.append(1))
    for spec, why in (("snapkv:alloc=head", "alloc='head' ranks every layer and head of the batch at once"),
                      ("learnedzip", "alloc='head' ranks")):
        with pytest.raises(InputError, match=rf"{why}.*, so it needs rows of one length, and these have 2 \(150–170 "
                                             r"tokens\): give it alloc=uniform"):
            kvmerge.generate_ids(model, rows, questions, spec, max_new_tokens=2)
    hook.remove()
    assert calls == []


def test_weights_that_rank_no_better_than_chance_are_said_so(monkeypatch, tmp_path, capsys):
    from kvmerge.commands import train_scorer

    model = no_weights()
    out = tmp_path / "mine.safetensors"
    ts = _train_tiny(monkeypatch, model)
    real = ts.train

    def chance(*a, **k):
        scorer = real(*a, **k)
        scorer.meta.update(top10_overlap=0.08, top25_overlap=0.3)
        return scorer

    monkeypatch.setattr(ts, "train", chance)
    train_scorer(SimpleNamespace(model=None, out=str(out), texts=3, held=1, length=96, seed=0, ridge=1e-2,
                                 kind="linear", hidden=64, epochs=8, target="log", no_progress=True, debug=False))
    captured = capsys.readouterr()
    assert "1 held-back piece:" in captured.out
    assert "rank no better than chance on the held-back pieces: train on more or longer pieces" in captured.err
