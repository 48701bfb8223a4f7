"""The plugin against kvmerge's transformers runtime: snapkv and echo (eviction), evictmerge (merging: entries
with log-mass, attended through the extra key channel) and mixedmerge (merging whose picks need each
prompt token's surprisal and Expected Attention's rotation; surprisezip: the same surprisal share beside the
learned scorer's picks) at 25% inside vLLM give the same greedy tokens,
with the same log-probabilities, as `kvmerge.Session` on kvmerge's NIAH prompts of ~2.1k tokens, while
vLLM's pool is small enough that freed blocks are reused by the other requests; and the scheduler's
own figures show the blocks released and the requests admitted.

The reference runs in kvmerge's main environment (.venv, transformers 5.24: the runtime needs it) as
`benchmarks/vllm_reference.py`; this test runs in .venv-vllm (make test-vllm). A method of one's own
(tests/plugins/lastquery.py) runs through the plugin's `imports` setting."""

import gc
import json
import math
import os
from pathlib import Path

import pytest

pytest.importorskip("vllm")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from vllm import LLM, SamplingParams  # noqa: E402

from kvmerge.model import cache_dir  # noqa: E402
from benchmarks.vllm_reference import MAIN_PYTHON, call, greedy_as_vllm_keeps  # noqa: E402

MODEL = cache_dir() / "smollm2-135m"
TOKENS, BLOCK = 32, 32
LEARNED = "learnedzip:alloc=uniform"  # the shipped scorer's picks, one count per layer and head
LEARNED_MLP = "learnedzip:alloc=uniform:scorer=mlp"  # the same with the shipped MLP scorer
# snapkv: 130 blocks of 32, room for one uncompressed 2.1k prompt (67 blocks) at a time, so each prompt's
# blocks include blocks freed by the ones before; evictmerge: a roomy pool and all 4 prompts in one step.
# mixedmerge and surprisezip: all 4 in one step too, each layer's compression deferred until the step's logits exist.
SETTINGS = {"snapkv": dict(num_gpu_blocks_override=130), "evictmerge": dict(max_num_batched_tokens=9000),
            "mixedmerge": dict(max_num_batched_tokens=9000), "surprisezip": dict(max_num_batched_tokens=9000),
            "echo": dict(num_gpu_blocks_override=130),
            "lastquery": dict(num_gpu_blocks_override=130), LEARNED: dict(num_gpu_blocks_override=130),
            LEARNED_MLP: dict(num_gpu_blocks_override=130)}
IMPORTS = {"lastquery": (str(Path(__file__).parent / "plugins" / "lastquery.py"),)}
pytestmark = pytest.mark.skipif(not MAIN_PYTHON.exists() or not (MODEL / "model.safetensors").exists(),
                                reason="needs kvmerge's main venv (.venv: make setup) and the converted SmolLM2")


@pytest.fixture(scope="module")
def prompts():
    return call("prompts", "--samples", "4", "--length", "2048", timeout=1800)


def first_divergence(got_tokens, got_logprobs, want) -> dict:
    """Where two greedy runs part (None: nowhere) and, up to there, the largest difference between the
    log-probabilities both give the reference's token; at the divergence, both tokens' log-probabilities."""
    at = next((i for i, (a, b) in enumerate(zip(got_tokens, want["tokens"])) if a != b), None)
    upto = len(want["tokens"]) if at is None else at
    diffs = [abs(got_logprobs[i][t].logprob - dict(want["top"][i])[t])
             for i, t in enumerate(want["tokens"][:upto]) if t in got_logprobs[i]]
    out = {"first_divergence": at, "max_logprob_diff": max(diffs, default=math.inf)}
    if at is not None:
        ref_top = dict(want["top"][at])
        out["at_divergence"] = {"vllm": {t: lp.logprob for t, lp in got_logprobs[at].items()}, "transformers": ref_top}
    return out


@pytest.mark.parametrize("method", ["snapkv", "evictmerge", "mixedmerge", "surprisezip", "echo", "lastquery", LEARNED,
                                    LEARNED_MLP])
def test_method_matches_the_transformers_runtime_and_frees_blocks(monkeypatch, prompts, method):
    from vllm import envs

    imports = IMPORTS.get(method, ())
    want = greedy_as_vllm_keeps(prompts, method, 0.25, TOKENS, BLOCK, timeout=1800, imports=imports)  # snapkv: block filled
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in this process: its scheduler is readable
    llm = LLM(model=str(MODEL), dtype="float32", max_model_len=4096, enforce_eager=True, block_size=BLOCK,
              enable_prefix_caching=False,
              additional_config={"kvmerge": {"method": method, "budget": 0.25, "imports": list(imports)}},
              **SETTINGS[method])
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=5)
        outs = llm.generate([{"prompt_token_ids": p["ids"]} for p in prompts], params)
        stats, peak = dict(scheduler.kvmerge_stats), scheduler.kvmerge_peak_running
        together = scheduler.kvmerge_peak_prompts
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        envs.disable_envs_cache()
    report = [first_divergence(list(o.outputs[0].token_ids), o.outputs[0].logprobs, w) for o, w in zip(outs, want)]
    print(method, json.dumps(report))
    assert all(r["first_divergence"] is None for r in report), report
    # learnedzip's scores are a linear map of 960 features per token: vLLM's float32 projections, which differ
    # from transformers' in the last bits, can swap near-tied picks (measured: 1.0e-3 at most, same tokens;
    # a different cache, e.g. the uncompressed one, moves these log-probabilities by 0.04-0.41)
    learned = method in (LEARNED, LEARNED_MLP, "surprisezip")
    assert max(r["max_logprob_diff"] for r in report) < (5e-3 if learned else 1e-3), report
    assert len(stats) == 4 and peak == 4, (stats, peak)  # on snapkv's pool stock vLLM runs one at a time
    assert together == {"snapkv": 1, "evictmerge": 4, "mixedmerge": 4, "surprisezip": 4, "echo": 1, "lastquery": 1,
                        LEARNED: 1, LEARNED_MLP: 1}[method]
    for p, s in zip(prompts, [stats[k] for k in sorted(stats, key=lambda k: int(k.split("-")[0]))]):
        budget = round(0.25 * len(p["ids"]))
        selects = method in ("snapkv", "echo", "lastquery", "surprisezip", LEARNED, LEARNED_MLP)
        assert s["prompt"] == len(p["ids"]) and budget <= s["kept"] < budget + (BLOCK if selects else 1)
        assert s["freed"] == (s["prompt"] - s["kept"]) // BLOCK and s["listed"] == math.ceil(s["prompt"] / BLOCK)
        assert s["held"] <= math.ceil(s["kept"] / BLOCK) + 1  # the budget's blocks plus at most one
