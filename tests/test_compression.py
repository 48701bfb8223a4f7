"""Compression under `model.generate`, and no side effects outside kvmerge's own scopes."""

import os
import subprocess
import sys

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import kvmerge
from kvmerge.methods.snapkv import SnapKV

from .conftest import TinyTokenizer, random_ids, tiny_model

METHODS = {
    "snapkv": dict(budget=0.25, window=8),
    "centroidkv": dict(budget=0.25, window=8, interval=4),  # re-clusters every 4 decoding steps
    "surprisemerge": dict(budget=0.25, window=8),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_model_generate_on_a_compressed_context_equals_kvmerge_generate(name):
    model, tok = tiny_model(), TinyTokenizer()
    ctx, q = random_ids(160, seed=1), random_ids(6, seed=2)
    want = kvmerge.generate_ids(model, ctx, q, kvmerge.get_method(name, **METHODS[name]), max_new_tokens=16,
                                tokenizer=tok)
    with kvmerge.compressing(model, name, tokenizer=tok, **METHODS[name]) as kv:
        cache = kv.prefill(ctx)
        assert cache.entries == want.stats["cache_entries"]
        got = model.generate(torch.tensor([ctx + q]), cache=cache, max_new_tokens=16, do_sample=False)
    assert got[0, len(ctx + q):].tolist() == want.tokens[0]
    if name == "centroidkv":  # the decode policy ran: the cache stayed within target + interval
        assert max(cache.entries) <= kvmerge.get_method(name, **METHODS[name]).target(160) + 4


def test_question_aware_generate_compresses_right_after_the_prompt():
    model = tiny_model()
    prompt = random_ids(150, seed=3)
    m = dict(budget=0.25, window=8)
    want = kvmerge.generate_ids(model, prompt[:-5], prompt[-5:], kvmerge.get_method("snapkv", **m),
                                max_new_tokens=10, protocol="aware")
    with kvmerge.compressing(model, "snapkv", **m):
        out = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                             return_dict_in_generate=True)
    assert out.sequences[0, 150:].tolist() == want.tokens[0]
    assert isinstance(out.cache, kvmerge.MergedCache) and out.cache.layers[0].entries == 38 + 9


def test_sampling_and_streaming_run_on_the_compressed_cache_and_the_model_is_restored():
    class Collect(BaseStreamer):
        def __init__(self):
            self.seen = []

        def put(self, value):
            self.seen.append(value.tolist())

        def end(self):
            self.seen.append("end")

    model = tiny_model()
    ctx = random_ids(120, seed=4)
    streamer = Collect()
    with kvmerge.compressing(model, "streamingllm", budget=0.25, window=8) as kv:
        cache = kv.prefill(ctx)
        torch.manual_seed(0)
        out = model.generate(torch.tensor([ctx + [5, 6]]), cache=cache, max_new_tokens=8, do_sample=True,
                             temperature=0.7, top_k=20, top_p=0.9, streamer=streamer)
    assert out.shape[1] == 122 + 8 and streamer.seen[-1] == "end" and len(streamer.seen) == 1 + 8 + 1
    assert model.config._attn_implementation == "sdpa"
    assert not model._forward_pre_hooks and not model._forward_hooks
    with pytest.raises(ValueError, match="one length"):
        with kvmerge.compressing(model, "snapkv") as kv:
            kv.prefill([ctx, ctx[:50]])


def test_import_leaves_the_environment_and_transformers_alone():
    code = ("import os, transformers; before = dict(os.environ); "
            "from transformers import AttentionInterface; names = set(AttentionInterface._global_mapping); "
            "import kvmerge; assert dict(os.environ) == before, 'environment changed'; "
            "assert set(AttentionInterface._global_mapping) == names, 'attention registry changed'")
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_python_dash_m_runs_the_cli():
    out = subprocess.run([sys.executable, "-m", "kvmerge", "methods"], check=True, capture_output=True, text=True)
    assert "centroidkv" in out.stdout.split()


@pytest.mark.parametrize("spec", ["full", "snapkv:alloc=head:window=8"])
def test_beam_search_and_several_sequences_expand_a_prefilled_cache(spec, monkeypatch):
    """generate repeats the prompt for beams / num_return_sequences; the prefilled cache repeats with it.
    Nothing compressed: the beams equal stock transformers'; per-head lengths: equal the padded layout's."""
    model = tiny_model(num_hidden_layers=3)
    ctx, q = random_ids(160, seed=1), random_ids(6, seed=2)
    args = dict(max_new_tokens=6, num_beams=2, num_return_sequences=2, do_sample=False)

    def run():
        with kvmerge.compressing(model, kvmerge.get_method(spec, 0.25)) as kv:
            cache = kv.prefill(ctx)
            return cache, model.generate(torch.tensor([ctx + q]), cache=cache, **args)

    cache, got = run()
    assert got.shape == (2, len(ctx + q) + 6)
    if spec == "full":
        want = model.generate(torch.tensor([ctx + q]), **args)
    else:
        assert any(layer.heads is not None for layer in cache.layers)
        monkeypatch.setattr(kvmerge.layer.MergedLayer, "compact", lambda self: False)
        _, want = run()
    assert got.tolist() == want.tolist()


def test_a_padded_batch_is_refused_in_one_line_before_the_model_runs():
    """A left-padded batch (attention_mask with zeros, given or built by generate from pad_token_id) is
    refused with a KVMergeError naming kvmerge.generate, before any layer runs and without torch's
    warning about a silenced hook error; the same rows unpadded still run."""
    import warnings

    model = tiny_model()
    a, b = random_ids(60, seed=1), random_ids(50, seed=2)
    ids, mask = torch.tensor([a, [0] * 10 + b]), torch.tensor([[1] * 60, [0] * 10 + [1] * 50])
    ran = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(1))
    message = ("kvmerge.compressing runs rows of one length, and this batch is padded (its attention_mask has zeros): "
               "use kvmerge.generate (or generate_ids) for batches of different lengths, or run model.generate one "
               "row at a time")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with kvmerge.compressing(model, "snapkv", budget=0.25, window=8) as kv:
            with pytest.raises(kvmerge.KVMergeError) as e:
                model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            assert str(e.value) == message
            model.generation_config.pad_token_id = 0  # no mask given: generate builds it from the pad tokens
            with pytest.raises(kvmerge.KVMergeError, match="this batch is padded"):
                model.generate(ids, max_new_tokens=4, do_sample=False)
            cache = kv.prefill(a)
            with pytest.raises(kvmerge.KVMergeError, match="this batch is padded"):
                model.generate(torch.tensor([a + [5, 6]]), attention_mask=torch.tensor([[0] + [1] * 61]),
                               cache=cache, max_new_tokens=4, do_sample=False)
    assert not [w for w in caught if "silenced" in str(w.message)], [str(w.message) for w in caught]
    model.generation_config.pad_token_id = None
    n = len(ran)
    assert n == 1  # kv.prefill's forward only
    with kvmerge.compressing(model, "snapkv", budget=0.25, window=8):
        out = model.generate(torch.tensor([a, b + a[:10]]), attention_mask=torch.ones(2, 60, dtype=torch.long),
                             max_new_tokens=4, do_sample=False)
    hook.remove()
    assert out.shape == (2, 64)


@pytest.mark.parametrize("spec", ["snapkv", "mixedmerge", "learnedzip", "snapkv:alloc=head"])
def test_a_cache_used_after_its_block_ends_is_refused_in_one_line(spec):
    """Outside the block the model's own attention would read merged entries as plain ones (a wrong
    answer), or fail deep inside; the cache refuses instead. A compressed context still answers."""
    model, tok = tiny_model(), TinyTokenizer()
    ctx, q = random_ids(160, seed=1), random_ids(6, seed=2)
    with kvmerge.compressing(model, spec, budget=0.25, window=8, tokenizer=tok) as kv:
        cache = kv.prefill(ctx)
        inside = model.generate(torch.tensor([ctx + q]), cache=cache, max_new_tokens=4, do_sample=False)
    with pytest.raises(kvmerge.KVMergeError, match="block has ended.* inside that block"):
        model.generate(torch.tensor([ctx + q]), cache=cache, max_new_tokens=4, do_sample=False)
    with kvmerge.compressing(model, spec, budget=0.25, window=8, tokenizer=tok) as kv:
        again = model.generate(torch.tensor([ctx + q]), cache=kv.prefill(ctx), max_new_tokens=4, do_sample=False)
    assert again.tolist() == inside.tolist()
    compressed = kvmerge.compress_context(model, tok, ctx, f"{spec}:window=8", 0.25)
    with kvmerge.compressing(model, spec, budget=0.25, window=8, tokenizer=tok) as kv:
        kv.prefill(compressed)
    assert kvmerge.generate_ids(model, ctx, q, kvmerge.get_method(f"{spec}:window=8", budget=0.25), max_new_tokens=4,
                                tokenizer=tok).tokens == compressed.generate_ids(q, 4).tokens


def test_a_compressed_context_is_refused_by_a_block_of_another_method():
    model, tok = tiny_model(), TinyTokenizer()
    compressed = kvmerge.compress_context(model, tok, random_ids(160, seed=1), "learnedzip:window=8", 0.25)
    with kvmerge.compressing(model, "snapkv", budget=0.25) as kv:
        with pytest.raises(kvmerge.KVMergeError, match="compressed with learnedzip .* not with this block's snapkv: "
                           "open kvmerge.compressing"):
            kv.prefill(compressed)
    with kvmerge.compressing(model, tokenizer=tok) as kv:  # no method asked for: the context's own answers
        kv.prefill(compressed)
    with kvmerge.compressing(model, "default", tokenizer=tok) as kv:
        kv.prefill(compressed)
    with kvmerge.compressing(model, "learnedzip", budget=0.5) as kv:
        with pytest.raises(kvmerge.KVMergeError, match="compressed at budget 0.25 and answers so, not at this block's 0.5"):
            kv.prefill(compressed)
    preset = kvmerge.compress_context(model, tok, random_ids(160, seed=1), "mixedmerge:window=8", 0.25)
    with kvmerge.compressing(model, "zipguardmerge", budget=0.25, tokenizer=tok) as kv:  # presets, by their names
        with pytest.raises(kvmerge.KVMergeError, match="compressed with mixedmerge .* not with this block's zipguardmerge"):
            kv.prefill(preset)


def test_stats_name_the_method_as_it_was_named_settings_included():
    """Two runs with different settings are told apart by their stats, each under the method's own name;
    a plain name stays plain."""
    model, ids = tiny_model(), random_ids(120, seed=3)
    named = kvmerge.generate_ids(model, [ids], [[5]], "SnapKV: window=8", max_new_tokens=1, budget=0.5)
    plain = kvmerge.generate_ids(model, [ids], [[5]], "snapkv", max_new_tokens=1, budget=0.5)
    assert named.stats["method"] == "snapkv:window=8" and plain.stats["method"] == "snapkv"
    assert kvmerge.get_method("mixedmerge", budget=0.5, recent=0.4).described == "mixedmerge:recent=0.4"
    assert kvmerge.get_method("zipguardmerge", budget=0.5).described == "zipguardmerge"
    by_hand = kvmerge.generate_ids(model, [ids], [[5]], SnapKV(budget=0.5, window=8), max_new_tokens=1)
    assert by_hand.stats["method"] == "snapkv:window=8" and by_hand.tokens == named.tokens
