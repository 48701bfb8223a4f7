"""The vLLM server with the kvmerge plugin under load, aborts and bad input, against stock vLLM (a benchmark;
a smaller run of the same functions is tests/test_vllm_load.py).

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_load.py --stock-exactness   # the run in docs/vllm.md
    HF_HUB_OFFLINE=1 .venv-vllm/bin/python benchmarks/vllm_load.py --requests 8 --aborts 4 --no-stock  # quick

Runs the server as users do (`python -m kvmerge.vllm.serve`, i.e. `vllm serve`, on 127.0.0.1) and drives
it with the `openai` client. For each configuration (the plugin; stock vLLM: the same command without
`--additional-config`), one server, in this order:

1. alone: each request that will complete, one at a time, greedy (temperature 0), streamed;
2. load: those `--requests` streaming clients and `--aborts` aborting ones, all at once, on a KV pool of
   `--pool-blocks` blocks (default: a quarter of the requests' uncompressed prompt + output blocks), so
   requests queue and are preempted. An abort closes its stream after 0 chunks (queued or prefilling),
   1 chunk (right after the prefill and its compression) or k chunks (decoding), or hits a client timeout
   at a random time, or times out a request that is not streamed;
3. afterwards the server must still serve: one request again, equal to its answer alone;
4. bad requests (a prompt longer than max_model_len, an empty prompt, an empty chat, n > 1 greedy): each
   must get HTTP 400 with a message, and the server must still answer afterwards;
5. leaks: when the last request has left, the plugin's scheduler logs its pool ("kvmerge: idle: F of T KV
   blocks free, H held; A requests aborted so far"; H must be 0), and vLLM's /metrics must show
   kv_cache_usage_perc 0 and no request running or waiting (stock: /metrics only). The plugin's
   scheduler also logs where each abort found its request (queued, right after its prefill step,
   decoding), tabulated with the aborts.

Then the start-up refusals (`--startup`): each bad plugin setting must make the serve command exit
non-zero with one line on stderr naming the problem. Every server is killed when its phase ends;
every request has a client timeout, and `--deadline` bounds the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MODEL_NAME = "smollm2"
ABORT_KINDS = ("close@0", "close@1", "close@k", "timeout", "nostream-timeout")
ABORTED = re.compile(r"kvmerge: request \S+ aborted (queued|right after its prefill step|decoding)")
IDLE = re.compile(r"kvmerge: idle: (\d+) of (\d+) KV blocks free, (\d+) held; (\d+) requests aborted")


def default_model() -> str:
    from kvmerge.model import cache_dir

    return str(cache_dir() / "smollm2-135m")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(model: str, port: int, *, max_model_len: int, block_size: int, pool_blocks: int | None,
                  kvmerge: dict | None, extra: tuple[str, ...] = ()) -> list[str]:
    """`python -m kvmerge.vllm.serve` (vllm serve) on 127.0.0.1; the plugin on when `kvmerge` is given."""
    cmd = [sys.executable, "-m", "kvmerge.vllm.serve", model, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
           "--block-size", str(block_size), "--no-enable-prefix-caching", "--served-model-name", MODEL_NAME]
    if pool_blocks is not None:
        cmd += ["--num-gpu-blocks-override", str(pool_blocks)]
    if kvmerge is not None:
        cmd += ["--additional-config", json.dumps({"kvmerge": kvmerge})]
    return cmd + list(extra)


def server_env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


@contextmanager
def server(cmd: list[str], log: Path, startup_s: float = 300):
    """Start `cmd` in its own process group, wait until it answers /v1/models, yield its base URL; always
    stop it (SIGTERM to the group, SIGKILL after 30 s)."""
    import httpx

    port = cmd[cmd.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=server_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            try:
                if httpx.get(f"{base}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start (exit {proc.poll()}):\n{log.read_text()[-4000:]}")
            time.sleep(1)
        yield base, proc
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 30)):
            if proc.poll() is not None:
                break
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # the engine core and its worker are in the same group; make sure none is left
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def messages(n: int, words: int, seed: int) -> list[list[dict]]:
    """`n` distinct one-turn chats of about `words` words each (numbered notes, then a question)."""
    out = []
    for i in range(n):
        notes, j = [], 0
        while sum(len(x.split()) for x in notes) < words:
            notes.append(f"Note {seed}.{i}.{j}: crate {(i * 7 + j * 37) % 101} left dock {(i + j) % 13} at "
                         f"{(j * 5 + i) % 24}:{(j * 7 + i) % 60:02d}.")
            j += 1
        out.append([{"role": "user", "content": " ".join(notes) + f"\nWhich dock did crate {i % 101} leave from?"}])
    return out


@dataclass
class Outcome:
    index: int
    kind: str  # "complete" or an abort kind
    text: str = ""
    chunks: int = 0
    ttft: float | None = None
    seconds: float = 0.0
    error: str | None = None
    prompt_tokens: int | None = None


@dataclass
class Workload:
    chats: list[list[dict]]
    complete: list[int]  # indexes into chats that run to the end
    aborts: list[tuple[int, str, float]]  # (index, kind, parameter: chunks to read, or a timeout in s)
    max_tokens: int
    request_timeout: float = 600.0
    extra: dict = field(default_factory=lambda: {"ignore_eos": True})


def workload(requests: int, aborts: int, words: int, max_tokens: int, seed: int, timeout_range=(0.2, 8.0)) -> Workload:
    rng = random.Random(seed)
    chats = messages(requests + aborts, words, seed)
    order = list(range(requests + aborts))
    rng.shuffle(order)
    complete, abort_ids = sorted(order[:requests]), order[requests:]
    planned = []
    for n, i in enumerate(abort_ids):
        kind = ABORT_KINDS[n % len(ABORT_KINDS)]
        param = {"close@0": 0, "close@1": 1, "close@k": rng.randint(2, max(2, max_tokens - 2))}.get(kind)
        planned.append((i, kind, float(param) if param is not None else round(rng.uniform(*timeout_range), 2)))
    return Workload(chats, complete, planned, max_tokens)


async def stream_one(client, w: Workload, index: int, kind: str = "complete", param: float = 0.0) -> Outcome:
    """One chat completion, greedy. `kind` complete: read it all; close@N: close the stream after N chunks
    with content (N=0: as soon as the response has started); timeout: the client gives up `param` s after
    sending (the whole request, not one read); nostream-timeout: the same, not streamed. An abort's
    `error` says how it ended ("closed", "timeout"; None: it finished before its abort)."""
    import openai

    o, start = Outcome(index, kind), time.perf_counter()
    kwargs = dict(model=MODEL_NAME, messages=w.chats[index], max_tokens=w.max_tokens, temperature=0,
                  extra_body=w.extra, timeout=w.request_timeout)

    async def run() -> None:
        if kind == "nostream-timeout":
            r = await client.chat.completions.create(**kwargs)
            o.text = r.choices[0].message.content or ""
            return
        stream = await client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
        try:
            if kind == "close@0":
                o.error = "closed"
                return
            async for chunk in stream:
                if chunk.usage is not None:
                    o.prompt_tokens = chunk.usage.prompt_tokens
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece:
                    if o.ttft is None:
                        o.ttft = time.perf_counter() - start
                    o.text += piece
                    o.chunks += 1
                    if kind.startswith("close@") and o.chunks >= param:
                        o.error = "closed"
                        return
        finally:
            await stream.close()

    try:
        if kind.endswith("timeout"):
            await asyncio.wait_for(run(), timeout=param)
        else:
            await run()
    except TimeoutError:
        o.error = "timeout"
    except openai.APIError as e:
        o.error = f"{type(e).__name__}: {e}"
    finally:
        o.seconds = time.perf_counter() - start
    return o


def client_for(base: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)


async def alone(base: str, w: Workload, indexes) -> dict[int, Outcome]:
    client = client_for(base)
    try:
        return {i: await stream_one(client, w, i) for i in indexes}
    finally:
        await client.close()


async def load(base: str, w: Workload) -> tuple[list[Outcome], list[Outcome], float]:
    """Every completing and aborting request at once; (completed, aborted, seconds)."""
    client = client_for(base)
    try:
        start = time.perf_counter()
        tasks = [stream_one(client, w, i) for i in w.complete] + [stream_one(client, w, i, k, p) for i, k, p in w.aborts]
        outs = await asyncio.gather(*tasks)
        return outs[:len(w.complete)], outs[len(w.complete):], time.perf_counter() - start
    finally:
        await client.close()


def metrics(base: str) -> dict[str, float]:
    """vLLM's /metrics gauges and counters, summed over labels (`name{finished_reason=...}` kept apart)."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if not line.startswith("vllm:") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        key = name.split("{")[0]
        reason = re.search(r'finished_reason="(\w+)"', name)
        if reason:
            key += f"[{reason.group(1)}]"
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            pass
    return out


def log_size(log: Path) -> int:
    return log.stat().st_size


def wait_idle(base: str, log: Path, plugin: bool, since: int = 0, timeout_s: float = 60) -> dict:
    """Wait until /metrics shows no request running or waiting and, with the plugin, the scheduler's
    idle line has been logged (after byte `since` of the log); the pool figures then."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        with open(log, "rb") as f:
            f.seek(since)
            idle = IDLE.findall(f.read().decode(errors="replace")) if plugin else []
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if busy == 0 and (idle or not plugin):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not go idle in {timeout_s} s: {busy} requests, idle lines {idle[-1:]}")
        time.sleep(1)
    out = {"kv_cache_usage_perc": m.get("vllm:kv_cache_usage_perc"), "running": m.get("vllm:num_requests_running"),
           "waiting": m.get("vllm:num_requests_waiting"), "preemptions": m.get("vllm:num_preemptions_total"),
           "aborted": None}
    if idle:
        free, total, held, aborted = map(int, idle[-1])
        out.update(free_blocks=free, pool_blocks=total, blocks_held=held, aborted=aborted)
    if plugin:
        points = ABORTED.findall(log.read_text(errors="replace"))
        out["abort_points"] = {p: points.count(p) for p in ("queued", "right after its prefill step", "decoding")}
    return out


# Per-request bad input: (name, request arguments, text the 400's message must contain)
def bad_requests(max_model_len: int) -> list[tuple[str, dict, str]]:
    return [
        ("prompt longer than max_model_len", dict(kind="chat", messages=[{"role": "user", "content": "hello " * (max_model_len + 8)}]),
         f"maximum context length is {max_model_len} tokens"),
        ("empty prompt", dict(kind="completion", prompt=""), "must be provided and non-empty"),
        ("empty chat", dict(kind="chat", messages=[]), "empty conversation"),
        ("n > 1, greedy", dict(kind="chat", messages=[{"role": "user", "content": "Name a colour."}], n=2, temperature=0),
         "n must be 1 when using greedy sampling"),
    ]


def send_bad(base: str, request: dict) -> tuple[int, str]:
    """(HTTP status, the error message) of one bad request (status 200 and "" if it was served)."""
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    args = {k: v for k, v in request.items() if k != "kind"}
    try:
        if request["kind"] == "chat":
            client.chat.completions.create(model=MODEL_NAME, max_tokens=4, **args)
        else:
            client.completions.create(model=MODEL_NAME, max_tokens=4, **args)
        return 200, ""
    except openai.APIStatusError as e:
        body = e.body if isinstance(e.body, dict) else {}
        message = body.get("message") or (body.get("error") or {}).get("message") or str(e)
        return e.status_code, str(message)
    finally:
        client.close()


# Start-up refusals: (name, --additional-config value, serve arguments changed, text the one line must contain)
STARTUP = [
    ("budget 0", '{"kvmerge": {"method": "snapkv", "budget": 0}}', "budget must be a float in (0, 1]"),
    ("budget 0.0", '{"kvmerge": {"method": "snapkv", "budget": 0.0}}', "budget fraction must be in (0, 1], got 0.0"),
    ("budget above 1", '{"kvmerge": {"method": "snapkv", "budget": 1.5}}', "budget fraction must be in (0, 1], got 1.5"),
    ("unknown method", '{"kvmerge": {"method": "nosuch", "budget": 0.25}}', "unknown method 'nosuch'"),
    ("method that cannot run in vLLM", '{"kvmerge": {"method": "kvzip", "budget": 0.25}}',
     "method 'kvzip' cannot run inside vLLM yet: kvzip runs another forward pass"),
    ("malformed additional_config (not JSON)", '{"kvmerge": {"method": "snapkv"', "--additional-config is not valid JSON"),
    ("malformed additional_config (not a dict)", '{"kvmerge": "snapkv"}', 'additional_config["kvmerge"] must be a dict'),
    ("unknown setting", '{"kvmerge": {"method": "snapkv", "bugdet": 0.25}}', "unknown setting(s) bugdet"),
    ("misspelled key", '{"kvmerg": {"method": "snapkv"}}', "additional_config has 'kvmerg', not 'kvmerge'"),
    ("prefix caching left on", '{"kvmerge": {"method": "snapkv", "budget": 0.25}}', "prefix caching is on"),
]


def startup_refusal(model: str, config: str, *, prefix_caching: bool = False, timeout_s: float = 180) -> tuple[int, str, float]:
    """(exit status, stderr's last line, seconds) of the serve command with `--additional-config config`
    (and prefix caching left at vLLM's default, on, when `prefix_caching`)."""
    cmd = serve_command(model, free_port(), max_model_len=1024, block_size=32, pool_blocks=None, kvmerge=None,
                        extra=("--additional-config", config))
    if prefix_caching:
        cmd.remove("--no-enable-prefix-caching")
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=server_env(),
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = [x for x in err.splitlines() if x.strip()]
    return proc.returncode, lines[-1] if lines else "", time.perf_counter() - start


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def run_config(args, w: Workload, kvmerge: dict | None, log: Path) -> dict:
    """One server, phases 1-5 (module docstring); a dict of what was found."""
    plugin = kvmerge is not None
    cmd = serve_command(args.model, free_port(), max_model_len=args.max_model_len, block_size=args.block_size,
                        pool_blocks=args.pool_blocks, kvmerge=kvmerge)
    with server(cmd, log) as (base, proc):
        solo = asyncio.run(alone(base, w, w.complete)) if plugin or args.stock_exactness else {}
        before = wait_idle(base, log, plugin)
        done, aborted, seconds = asyncio.run(load(base, w))
        again = asyncio.run(alone(base, w, w.complete[:1]))[w.complete[0]]
        bad = []
        for name, request, expect in bad_requests(args.max_model_len):
            status, message = send_bad(base, request)
            bad.append({"input": name, "status": status, "message": message, "ok": status == 400 and expect in message})
        mark = log_size(log)
        after_bad = asyncio.run(alone(base, w, w.complete[:1]))[w.complete[0]]
        idle = wait_idle(base, log, plugin, since=mark)
        alive = proc.poll() is None
    failed = [o for o in done if o.error or o.chunks == 0]
    mismatched = [o.index for o in done if solo and o.text != solo[o.index].text]
    ttft = [o.ttft for o in done if o.ttft is not None]
    return {
        "config": f"{kvmerge['method']}@{kvmerge.get('budget')}" if plugin else "stock",
        "requests": len(w.complete), "completed": len(done) - len(failed),
        "failed": [(o.index, o.error) for o in failed],
        "exact": (len(done) - len(mismatched)) if solo else None, "mismatched": mismatched,
        "aborts": sum(o.error in ("closed", "timeout") for o in aborted),
        "abort_outcomes": [(o.kind, round(o.seconds, 2), o.chunks, o.error) for o in aborted],
        "aborts_seen_by_server": idle["aborted"] - before["aborted"] if plugin else None,
        "abort_points": idle.get("abort_points"),
        "served_after_aborts": again.text == (solo.get(again.index).text if solo else again.text) and not again.error,
        "bad_inputs": bad, "served_after_bad_inputs": not after_bad.error and bool(after_bad.text),
        "alive": alive, "preemptions": idle.get("preemptions"),
        "kv_cache_usage_perc_idle": idle.get("kv_cache_usage_perc"), "running_idle": idle.get("running"),
        "waiting_idle": idle.get("waiting"), "blocks_free_before": before.get("free_blocks"),
        "blocks_free_after": idle.get("free_blocks"), "pool_blocks": idle.get("pool_blocks"),
        "blocks_leaked": idle.get("blocks_held"),
        "prompt_tokens_mean": round(statistics.mean(o.prompt_tokens for o in done if o.prompt_tokens)) if done else None,
        "load_seconds": round(seconds, 1),
        "ttft_p50_s": round(percentile(ttft, 0.5), 2) if ttft else None,
        "ttft_p99_s": round(percentile(ttft, 0.99), 2) if ttft else None,
    }


def table(rows: list[dict]) -> str:
    head = ("| config | requests completed | greedy = alone | aborts survived (queued / right after prefill / decoding) "
            "| bad inputs answered 400 | blocks leaked | preemptions | TTFT p50 s | TTFT p99 s | load s |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        bad_ok = sum(b["ok"] for b in r["bad_inputs"])
        leak = r["blocks_leaked"] if r["blocks_leaked"] is not None else f"usage {r['kv_cache_usage_perc_idle']:g}"
        exact = f"{r['exact']}/{r['requests']}" if r["exact"] is not None else "–"
        points = r.get("abort_points")
        where = f" ({' / '.join(str(v) for v in points.values())})" if points else ""
        lines.append(f"| {r['config']} | {r['completed']}/{r['requests']} | {exact} | "
                     f"{r['aborts'] if r['served_after_aborts'] and r['alive'] else 0}/{r['aborts']}{where} | "
                     f"{bad_ok}/{len(r['bad_inputs'])} | {leak} | {int(r['preemptions'] or 0)} | {r['ttft_p50_s']} | "
                     f"{r['ttft_p99_s']} | {r['load_seconds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=32, help="streaming clients that run to the end")
    parser.add_argument("--aborts", type=int, default=10, help="clients that abort (close or time out)")
    parser.add_argument("--timeouts", default="0.2,20", help="the range of the aborting clients' timeouts, s")
    parser.add_argument("--words", type=int, default=60, help="words of notes per prompt (60: about 220 tokens)")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 1024, or what the pool holds if less (vLLM refuses a pool below one full request)")
    parser.add_argument("--pool-blocks", type=int, default=None,
                        help="vLLM's --num-gpu-blocks-override (default: a quarter of the requests uncompressed)")
    parser.add_argument("--no-stock", action="store_true", help="skip stock vLLM")
    parser.add_argument("--stock-exactness", action="store_true", help="also run stock's requests alone")
    parser.add_argument("--no-startup", action="store_true", help="skip the start-up refusals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=1800, help="seconds; the run stops itself after this")
    parser.add_argument("--logs", default="runs/vllm_load")
    parser.add_argument("--out", default=None, help="append one JSON line per configuration here")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(TimeoutError(f"--deadline {args.deadline} s")))
    signal.alarm(int(args.deadline))
    args.model = args.model or default_model()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    w = workload(args.requests, args.aborts, args.words, args.output_tokens, args.seed,
                 tuple(float(x) for x in args.timeouts.split(",")))
    if args.pool_blocks is None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        longest = max(len(tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False)["input_ids"]) for c in w.chats)
        per = -(-(longest + args.output_tokens) // args.block_size)
        args.pool_blocks = -(-args.requests // 4) * per + 1  # + vLLM's null block
        print(f"prompts up to {longest} tokens + {args.output_tokens} out: {per} blocks a request uncompressed; "
              f"pool {args.pool_blocks} blocks", flush=True)
    args.max_model_len = args.max_model_len or min(1024, (args.pool_blocks - 1) * args.block_size)
    rows = []
    configs = [{"method": args.method, "budget": args.budget}] + ([] if args.no_stock else [None])
    for kvmerge in configs:
        row = run_config(args, w, kvmerge, logs / f"{'plugin' if kvmerge else 'stock'}.log")
        row.update(pool_blocks_arg=args.pool_blocks, output_tokens=args.output_tokens, date=time.strftime("%Y-%m-%d"),
                   load_avg_1min=round(os.getloadavg()[0], 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    print(table(rows))
    for r in rows:
        for b in r["bad_inputs"]:
            print(f"{r['config']}: bad input: {b['input']}: HTTP {b['status']}: {b['message']}")
    failures = [r["config"] for r in rows if r["completed"] < r["requests"] or r["mismatched"] or not r["alive"]
                or (r["blocks_leaked"] or 0) or r["kv_cache_usage_perc_idle"] != 0
                or not all(b["ok"] for b in r["bad_inputs"])]
    if not args.no_startup:
        for name, config, expect in STARTUP:
            rc, line, seconds = startup_refusal(args.model, config, prefix_caching=name == "prefix caching left on")
            ok = rc != 0 and expect in line
            failures += [] if ok else [f"start-up: {name}"]
            print(f"start-up: {name}: exit {rc} in {seconds:.0f} s: {line}")
    if failures:
        print(f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
