"""Preemption with the plugin: on a pool too small for every request's decoded tokens, vLLM preempts a
request, frees all its blocks and recomputes it later; the plugin recomputes its prompt alone and
compresses it again as the first time, then its decoded tokens attend to that compressed prompt, so
every request, the preempted ones too, decodes exactly as on a pool large enough for all. Runs in
.venv-vllm (make test-vllm), the engine in this process."""

import gc
import os

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

from kvmerge.model import cache_dir  # noqa: E402

MODEL = cache_dir() / "smollm2-135m"
OUTPUT = 400  # 4 prompts of ~600 tokens: 5 blocks each after compression, then 13 more each while decoding


def run(pool_blocks: int | None, prompts):
    """(tokens per request, the scheduler's kvmerge_stats by request index)."""
    from vllm import envs

    kwargs = dict(model=str(MODEL), dtype="float32", max_model_len=1024, enforce_eager=True, block_size=32,
                  enable_prefix_caching=False, additional_config={"kvmerge": {"method": "snapkv", "budget": 0.25}})
    if pool_blocks is not None:
        kwargs["num_gpu_blocks_override"] = pool_blocks
    llm = LLM(**kwargs)
    try:
        params = SamplingParams(max_tokens=OUTPUT, temperature=0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        stats = llm.llm_engine.engine_core.engine_core.scheduler.kvmerge_stats
        by_index = {int(k.split("-")[0]): v for k, v in stats.items()}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        envs.disable_envs_cache()
    return [list(o.outputs[0].token_ids) for o in outs], by_index


@pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="bundled SmolLM2 not converted yet")
def test_preempted_request_is_compressed_again_as_before_and_decodes_as_if_never_preempted(monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    tok = AutoTokenizer.from_pretrained(str(MODEL))
    prompts = []
    for i in range(4):
        notes = " ".join(f"Log {i}.{j}: valve {j % 7} read {j * 13 % 97} psi." for j in range(36))
        text = tok.apply_chat_template([{"role": "user", "content": f"{notes}\nSummarise log {i}."}], tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    assert all(550 < len(p) < 650 for p in prompts), [len(p) for p in prompts]
    roomy, roomy_stats = run(None, prompts)
    tight, tight_stats = run(40, prompts)
    assert all(len(t) == OUTPUT for t in tight)
    assert all(s["compressions"] == 1 for s in roomy_stats.values())
    again = [i for i, s in tight_stats.items() if s["compressions"] > 1]
    assert again, tight_stats  # some request was preempted and recomputed...
    for i in again:  # ...its prompt alone, compressed again to the same layout
        assert tight_stats[i]["prompt"] == len(prompts[i]), tight_stats[i]
        assert (tight_stats[i]["kept"], tight_stats[i]["freed"]) == (roomy_stats[i]["kept"], roomy_stats[i]["freed"])
    for i in range(4):  # every request decodes as on a pool large enough for all, the preempted ones too
        assert tight[i] == roomy[i], (i, i in again)
