"""Throughput of vLLM with and without the kvmerge plugin on one fixed KV pool (a benchmark, not a test).

    .venv-vllm/bin/python benchmarks/vllm_throughput.py                      # the issue's setting (hours on 2 cores)
    .venv-vllm/bin/python benchmarks/vllm_throughput.py --requests 16 --prompt-tokens 1024 --output-tokens 32 \\
        --pool-mib 190 --max-model-len 2048 --out results/vllm_throughput.jsonl   # the scaled run in docs/vllm.md

All requests arrive at once; every configuration gets the same pool in bytes (`--pool-mib`), so the
plugin with a merging method, whose slots are wider by the log-mass channel (80 channels for SmolLM2's
64: +25% bytes), has fewer slots; `full` and methods that only select keep vLLM's slots. Configurations alternate within one run (`--rounds`), each in its own process with the
engine in-process, driven step by step: stock vLLM (defaults, prefix caching off: the prompts share
nothing), the plugin with `full` (its worker, scheduler and attention path, no compression), and the plugin at each budget with
`--method`. Reported per run: requests/s, output tokens/s, peak running requests, preemptions,
mean and median time to first token, and the seconds the workers spent compressing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def prompts(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` distinct chat prompts of about `length` tokens (numbered notes, then a question)."""
    out = []
    for i in range(n):
        notes, body = [], 0
        while body < length - 40:
            j = len(notes)
            notes.append(f"Note {seed}.{i}.{j}: parcel {j * 37 % 101} left depot {j % 13} "
                         f"at {j % 24}:{j * 7 % 60:02d}.")
            body += 22
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": " ".join(notes) + f"\nWhich depot did parcel {i % 101} leave from?"}],
            tokenize=False, add_generation_prompt=True)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def block_bytes(config, block_size: int, head_size: int) -> int:
    """Bytes of one block across all layers (keys + values, float32)."""
    text = config.get_text_config()
    return 2 * text.num_hidden_layers * text.num_key_value_heads * block_size * head_size * 4


def run_one(args, method: str | None, budget: float | None) -> dict:
    """One configuration, in this process: the engine in-process, every request added at once."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, -(-int(args.pool_mib) // 1024)))  # GiB; blocks set below
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams

    from kvmerge import get_method
    from kvmerge.vllm.config import needs_channel, padded_head_size

    config = AutoConfig.from_pretrained(args.model)
    head = config.get_text_config().head_dim
    widened = method is not None and needs_channel(get_method(method, budget))  # merging: the log-mass channel
    width = padded_head_size(head) if widened else head
    blocks = int(args.pool_mib * 2 ** 20) // block_bytes(config, args.block_size, width)
    kwargs = dict(model=args.model, dtype="float32", max_model_len=args.max_model_len, enforce_eager=True,
                  block_size=args.block_size, enable_prefix_caching=False, num_gpu_blocks_override=blocks)
    if method is not None:
        kwargs["additional_config"] = {"kvmerge": {"method": method, "budget": budget}}
    llm = LLM(**kwargs)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    todo = prompts(llm.get_tokenizer(), args.requests, args.prompt_tokens, args.seed)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    first, preempted, peak, produced = {}, {}, 0, 0
    start = time.perf_counter()
    for i, p in enumerate(todo):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - start
        peak = max(peak, len(scheduler.running))
        for r in scheduler.requests.values():
            preempted[r.request_id] = max(preempted.get(r.request_id, 0), r.num_preemptions)
        for o in outs:
            if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                first[o.request_id] = now
            if o.finished:
                produced += len(o.outputs[0].token_ids)
    wall = time.perf_counter() - start
    runner = engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    compress_seconds = runner.kvmerge.stats["compress_seconds"] if method is not None else 0.0
    engine.engine_core.shutdown()
    ttft = list(first.values())
    return {"config": "stock" if method is None else f"{method}@{budget}", "pool_blocks": blocks,
            "pool_tokens": blocks * args.block_size, "requests": args.requests,
            "prompt_tokens_mean": round(statistics.mean(len(p) for p in todo)),
            "output_tokens": args.output_tokens, "seconds": round(wall, 2),
            "requests_per_s": round(args.requests / wall, 4), "output_tokens_per_s": round(produced / wall, 3),
            "peak_running": peak, "preemptions": sum(preempted.values()),
            "ttft_mean_s": round(statistics.mean(ttft), 2), "ttft_median_s": round(statistics.median(ttft), 2),
            "compress_seconds": round(compress_seconds, 2)}


def main(argv=None) -> None:
    from kvmerge.model import cache_dir

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(cache_dir() / "smollm2-135m"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=3500)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--pool-mib", type=float, default=1024.0, help="KV pool in MiB, the same for every config")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--method", default="snapkv", help="a method spec, or several separated by commas")
    parser.add_argument("--budgets", default="0.5,0.25,0.1")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-full", action="store_true", help="skip the plugin with `full` (the plugin's own cost, nothing compressed)")
    parser.add_argument("--out", default=None, help="append one JSON line per run here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one config, print JSON
    args = parser.parse_args(argv)
    if args.one is not None:
        spec = json.loads(args.one)
        print("RESULT " + json.dumps(run_one(args, spec["method"], spec["budget"])), flush=True)
        return
    configs = [{"method": None, "budget": None}] + ([] if args.no_full else [{"method": "full", "budget": None}])
    configs += [{"method": m, "budget": float(b)} for m in args.method.split(",") for b in args.budgets.split(",")]
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("out", "one", "no_full", "rounds")]
    for r in range(args.rounds):
        for spec in configs:
            proc = subprocess.run([sys.executable, __file__, *forwarded, "--one", json.dumps(spec)],
                                  capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                raise SystemExit(f"run {spec} failed")
            row = {"round": r, **json.loads(line[len("RESULT "):]),
                   "date": time.strftime("%Y-%m-%d"), "load_avg_1min": round(os.getloadavg()[0], 2)}
            print(json.dumps(row), flush=True)
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
