"""The plugin's server under load, aborts and bad input: a small run of benchmarks/vllm_load.py (the full
run and its table are in docs/vllm.md). `python -m kvmerge.vllm.serve` (vllm serve) on 127.0.0.1 with a KV
pool that holds a quarter of the requests uncompressed, driven by the `openai` client: every streamed
request completes with the greedy answer it gets alone, aborted ones leave no block behind, bad requests
get HTTP 400 and bad plugin settings stop the command at start-up with one line. Runs in .venv-vllm
(make test-vllm)."""

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("openai")

from benchmarks.vllm_load import (ABORT_KINDS, STARTUP, alone, bad_requests, default_model, free_port,  # noqa: E402
                                  load, log_size, send_bad, serve_command, server, startup_refusal, wait_idle,
                                  workload)

MODEL = default_model()
REQUESTS, ABORTS, WORDS, OUTPUT = 12, len(ABORT_KINDS), 60, 48
BLOCK = 32
POOL = 3 * -(-(236 + OUTPUT) // BLOCK) + 1  # a quarter of the 12 requests uncompressed (prompts <= 236 tokens), + null block
MAX_LEN = (POOL - 1) * BLOCK

pytestmark = pytest.mark.skipif(not (Path(MODEL) / "model.safetensors").exists(),
                                reason="bundled SmolLM2 not converted yet (make test-vllm converts it)")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log = tmp_path_factory.mktemp("load") / "server.log"
    cmd = serve_command(MODEL, free_port(), max_model_len=MAX_LEN, block_size=BLOCK, pool_blocks=POOL,
                        kvmerge={"method": "snapkv", "budget": 0.25})
    with server(cmd, log) as (base, proc):
        yield base, proc, log


def test_load_with_aborts_answers_as_alone_and_leaks_no_block(served):
    base, proc, log = served
    w = workload(REQUESTS, ABORTS, WORDS, OUTPUT, seed=1, timeout_range=(0.2, 4.0))
    solo = asyncio.run(alone(base, w, w.complete))
    assert all(not o.error and o.prompt_tokens <= 236 for o in solo.values()), solo
    before = wait_idle(base, log, plugin=True)
    assert before["blocks_held"] == 0 and before["free_blocks"] == POOL - 1
    done, aborted, _ = asyncio.run(load(base, w))
    assert all(not o.error and o.chunks > 0 for o in done), [(o.index, o.error) for o in done if o.error]
    assert [o.text for o in done] == [solo[o.index].text for o in done]  # greedy under load = alone
    assert {o.kind for o in aborted} == set(ABORT_KINDS)
    stopped = sum(o.error in ("closed", "timeout") for o in aborted)
    mark = log_size(log)
    again = asyncio.run(alone(base, w, w.complete[:1]))[w.complete[0]]
    assert again.text == solo[w.complete[0]].text and proc.poll() is None  # still serving
    after = wait_idle(base, log, plugin=True, since=mark)
    # A stream closed (or a client timing out) before vLLM's API server has handed the request to the engine
    # is stopped on the client only: the engine never held it, so the scheduler sees at most `stopped` aborts.
    # A stream closed after a content chunk was held by the engine with tokens still to come (ignore_eos: 48
    # tokens; this workload's close@k stops at chunk 19), so the scheduler sees at least those, whatever the timing.
    held = sum(o.error == "closed" and o.chunks >= 1 for o in aborted)
    seen = after["aborted"] - before["aborted"]
    assert held >= 2 and held <= seen <= stopped, (held, seen, [o.__dict__ for o in aborted])
    assert sum(after["abort_points"].values()) == seen and after["abort_points"]["decoding"] >= 1, after
    assert after["blocks_held"] == 0 and after["free_blocks"] == POOL - 1  # every block back in the pool
    assert after["kv_cache_usage_perc"] == 0 and after["running"] == 0 and after["waiting"] == 0
    assert after["preemptions"] >= 1, after  # the pool was tight enough to preempt: those answered as alone too


@pytest.mark.parametrize("name,request_args,message", bad_requests(MAX_LEN), ids=[b[0] for b in bad_requests(MAX_LEN)])
def test_bad_request_gets_400_with_a_message_and_the_server_keeps_serving(served, name, request_args, message):
    base, proc, log = served
    status, text = send_bad(base, request_args)
    assert status == 400 and message in text, (status, text)
    w = workload(1, 0, 10, 4, seed=2)
    ok = asyncio.run(alone(base, w, [0]))[0]
    assert not ok.error and ok.text and proc.poll() is None


def test_n_above_1_sampled_is_served_each_choice_compressed(served):
    """n > 1 is refused by vLLM itself only with greedy sampling (above); sampled, each choice is its own
    request, compressed like any other."""
    import openai

    base, proc, log = served
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
    mark = log_size(log)
    notes = " ".join(f"Crate {i} left dock {i % 7}." for i in range(40))
    r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": notes + " Which dock?"}],
                                       n=3, temperature=0.8, max_tokens=8, seed=0)
    client.close()
    assert sorted(c.index for c in r.choices) == [0, 1, 2] and all(c.message.content for c in r.choices)
    assert wait_idle(base, log, plugin=True, since=mark)["blocks_held"] == 0
    with open(log, "rb") as f:
        f.seek(mark)
        assert f.read().count(b"kvmerge: request") == 3


@pytest.mark.parametrize("name,config,message", STARTUP, ids=[s[0] for s in STARTUP])
def test_bad_setting_is_refused_at_startup_in_one_line(name, config, message):
    rc, line, seconds = startup_refusal(MODEL, config, prefix_caching=name == "prefix caching left on")
    assert rc != 0 and line.startswith("kvmerge: ") and message in line, (rc, line)
    assert json.dumps(line).count("\\n") == 0
