"""The vLLM plugin switched on and off: settings checked at startup with clear errors, the stock config
untouched when off, and with `full` the same greedy tokens as stock vLLM. Runs in .venv-vllm
(make test-vllm); skipped where vLLM is not installed."""

import gc
import json
import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402

import kvmerge  # noqa: E402
from kvmerge.model import cache_dir  # noqa: E402
from kvmerge.vllm.config import SCHEDULER, WORKER, layout, needs_channel, refusal, settings_of  # noqa: E402

MODEL = cache_dir() / "smollm2-135m"
ENGINE = dict(model=str(MODEL), dtype="float32", max_model_len=4096, enforce_eager=True, block_size=32,
              enable_prefix_caching=False)
needs_model = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(),
                                 reason="bundled SmolLM2 not converted yet (make test-vllm converts it)")


def config(kvmerge_settings=None, **overrides):
    kwargs = {**ENGINE, **overrides}
    if kvmerge_settings is not None:
        kwargs["additional_config"] = {"kvmerge": kvmerge_settings}
    return EngineArgs(**kwargs).create_engine_config()


@needs_model
def test_plugin_off_leaves_the_config_stock_and_on_installs_its_worker_and_scheduler():
    stock = config()
    assert stock.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert stock.scheduler_config.scheduler_cls is None
    assert stock.scheduler_config.enable_chunked_prefill
    on = config({"method": "snapkv", "budget": 0.25})
    assert on.parallel_config.worker_cls == WORKER and on.scheduler_config.scheduler_cls == SCHEDULER
    assert not on.scheduler_config.enable_chunked_prefill
    assert on.scheduler_config.max_num_batched_tokens >= 4096


@needs_model
@pytest.mark.parametrize("settings, message", [
    ({"method": "nosuch", "budget": 0.25}, "unknown method 'nosuch'"),
    ({"method": "snapkv", "budget": 1.5}, r"budget fraction must be in \(0, 1\], got 1.5"),
    ({"method": "snapkv", "budget": 0.0}, r"budget fraction must be in \(0, 1\], got 0.0"),
    ({"method": "snapkv", "budget": 3}, "below the protected sinks"),
    ({"method": "snapkv", "budget": 25}, r"below the protected sinks \+ window \(4 \+ 32\) \(for 25%, write 0.25\)"),
    ({"method": "snapkv", "budget": 0.25, "imports": ["nosuchmod"]}, r"(^|Value error, )kvmerge: no module or file 'nosuchmod'"),
    ({"method": "snapkv", "budget": "half"}, "budget must be a float"),
    ({"method": "snapkv:kernal=5"}, "snapkv has no parameter"),
    ({"method": 3, "budget": 0.25}, '"method" must be a method spec'),  # left out: the default (test_defaults.py)
    ({"method": "snapkv", "ratio": 0.25}, "unknown setting"),
    ({"method": "evictmerge:base=kvzip", "budget": 0.25}, "evictmerge runs another forward pass"),
    ({"method": "kvzip", "budget": 0.25}, "kvzip runs another forward pass"),
    ({"method": "pyramidkv", "budget": 0.25}, "pyramidkv sets per-layer budgets"),
    ({"method": "tova", "budget": 0.25}, "tova changes the cache while decoding"),
    ({"method": "evictmerge:base=kvzip:alloc=head:recent=0", "budget": 0.25}, "alloc='head'"),
    ({"method": "snapkv:alloc=head", "budget": 0.25}, "alloc='head'"),
    ({"method": "zipguardmerge", "budget": 0.25}, r"zipguardmerge runs another forward pass(?!.*alloc=uniform runs)"),
    ({"method": "kvzip", "budget": 0.25}, r"^(?!.*kvzip:alloc=uniform runs there)"),  # it would not: a second pass
    ({"method": "snapkv:budget=0.1", "budget": 0.5}, r'snapkv:budget=0.1 sets budget=0.1 and "budget": 0.5: '
                                                     r"give the budget once"),
])
def test_bad_settings_fail_at_startup_naming_the_problem(settings, message):
    with pytest.raises(ValueError, match=message):
        config(settings)


@needs_model
def test_prefix_caching_with_compression_is_refused():
    with pytest.raises(ValueError, match="enable_prefix_caching=False"):
        config({"method": "snapkv", "budget": 0.25}, enable_prefix_caching=True)


@needs_model
def test_unsupported_model_type_is_refused(tmp_path):
    """A Gemma-3 (sliding-window layers) config: refused before any weight is read."""
    text = json.loads((MODEL / "config.json").read_text())
    text.update(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], sliding_window=512,
                layer_types=["sliding_attention"] * 29 + ["full_attention"], query_pre_attn_scalar=64,
                head_dim=64, rope_local_base_freq=10000.0)
    (tmp_path / "config.json").write_text(json.dumps(text))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((MODEL / name).read_text())
    with pytest.raises(ValueError, match="unsupported model type 'gemma3_text'"):
        config({"method": "snapkv", "budget": 0.25}, model=str(tmp_path))


@pytest.mark.parametrize("additional", [{"kvmerg": {"method": "snapkv"}}, {"KVMerge": {}}, {"kv_merge": {}},
                                        {"kvmerge": None}])
def test_a_misspelled_or_empty_key_is_refused_not_left_stock(additional):
    with pytest.raises(ValueError, match=r"^kvmerge: additional_config(\[\"kvmerge\"\] is None| has '.*', not 'kvmerge')"):
        settings_of(additional)
    for other in ({"other_plugin": {"a": 1}}, {"merge": {}}, {"vmerge": {}}, {"kvmerge_v2": {}}, {"kvcache": {}}):
        assert settings_of(other) is None  # another plugin's key: vLLM stays stock
    assert settings_of(None) is None


def test_every_registered_method_is_runnable_or_refused_with_a_reason():
    runnable = {n for n in kvmerge.available_methods() if refusal(kvmerge.get_method(n)) is None}
    assert runnable >= {"full", "snapkv", "h2o", "keydiff", "streamingllm", "evictmerge", "cam", "kmeans",
                        "semanticache", "surprisal", "surprisemerge", "mixedmerge", "expectedattention",
                        "mixedattention", "echo"}
    for name in {"kvzip", "pyramidkv", "d2o", "tova", "centroidkv"}:
        assert refusal(kvmerge.get_method(name)).startswith(name)


def test_layout_frees_whole_blocks_before_the_kept_entries():
    lay = layout(kvmerge.get_method("evictmerge", budget=0.25), 2123, 32)  # merging: the channel masks 24 slots
    assert (lay.kept, lay.freed, lay.start, lay.empty) == (531, 49, 1568, 24)
    plain = layout(kvmerge.get_method("snapkv", budget=0.25), 2123, 32)  # selecting: the kept fill the block
    assert (plain.kept, plain.freed, plain.start, plain.empty) == (555, 49, 1568, 0)
    assert layout(kvmerge.get_method("full"), 2123, 32).freed == 0
    short = layout(kvmerge.get_method("evictmerge", budget=0.25), 50, 32)  # below sinks + window: 36 kept
    assert (short.kept, short.freed) == (36, 0)
    assert layout(kvmerge.get_method("snapkv", budget=0.25), 50, 32).kept == 50  # nothing freed: nothing dropped


def test_only_merging_methods_widen_the_cache_with_the_channel():
    assert not any(needs_channel(kvmerge.get_method(m, 0.25)) for m in ("full", "snapkv", "keydiff",
                                                                                "streamingllm", "expectedattention"))
    assert all(needs_channel(kvmerge.get_method(m, 0.25)) for m in ("evictmerge", "mixedmerge", "cam",
                                                                            "kmeans", "semanticache", "surprisemerge"))


def prompts_of_8(tokenizer) -> list[list[int]]:
    """8 chat prompts of 20 to ~900 tokens."""
    topics = ["the tides", "a bakery", "volcanoes", "chess openings", "a lighthouse", "honey bees", "old maps",
              "the violin"]
    out = []
    for i, topic in enumerate(topics):
        body = " ".join(f"Note {j}: something worth knowing about {topic}, item {j * 7 % 13}."
                        for j in range(i * i * 4))
        message = {"role": "user", "content": f"{body}\nWrite two sentences about {topic}."}
        text = tokenizer.apply_chat_template([message], tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def greedy(llm, prompts, tokens=24):
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def slot_width(llm) -> int:
    """The head size of the engine's KV cache slots (the engine runs in this process)."""
    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups
    return groups[0].kv_cache_spec.head_size


def close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@needs_model
def test_full_and_the_channel_give_the_tokens_of_stock_vllm_on_8_prompts(monkeypatch):
    from vllm import envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: its cache spec is readable
    envs.disable_envs_cache()
    stock = LLM(**ENGINE)
    prompts = prompts_of_8(stock.get_tokenizer())
    want = greedy(stock, prompts)
    close(stock)
    plugin = LLM(**ENGINE, additional_config={"kvmerge": {"method": "full"}})  # vLLM's head size, no channel
    got, plain = greedy(plugin, prompts), slot_width(plugin)
    close(plugin)
    # a merging method with nothing to merge: every slot widened by the log-mass channel (64 → 80), all 0
    channel = LLM(**ENGINE, additional_config={"kvmerge": {"method": "evictmerge", "budget": 1.0}})
    widened, wide = greedy(channel, prompts), slot_width(channel)
    close(channel)
    envs.disable_envs_cache()
    assert (plain, wide) == (64, 80)
    assert len({len(p) for p in prompts}) == 8 and max(len(p) for p in prompts) > 500
    assert got == want and widened == want
