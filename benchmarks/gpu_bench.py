"""kvmerge on a GPU at 8B shape: random weights in bf16 (speed and memory only, no quality), one
JSON line per configuration.

* `bandwidth`: the device-to-device copy rate measured here (bytes read + written / s).
* `kernel`: one decode step's attention for one layer (32 query heads, 8 KV heads, d 128), batch
  and slots given: SDPA on a plain cache (flash), kvmerge's log-mass attention (SDPA with a per-key
  bias, one fused kernel) and FlexAttention with a per-key `score_mod`, each against the bytes it
  must read at the HBM floor; and each one's error against a float64 reference.
* `model`: prefill, compression (and its ratio to the prefill), decode ms/token at batch 1 and at
  the largest batch whose cache fits in `--memory-gib` beside the weights, cache bytes and peak
  memory, for each method and budget at each context length, with the HBM floor of each decode
  step: (weights + cache bytes) / `--hbm-tbs`; and the same decode steps captured as a CUDA graph
  (`kvmerge.graphs.GraphDecoder`, `graph_decode_ms_*`) beside the eager ones.
  `max_batch` is the largest batch that fits at that length: full against compressed is the capacity.
* `profile`: the CUDA and CPU time of one batch-1 decode step, by operator (a text file).
* `profile-compress`: the same for one prefill and its compression with each `--profile-compress` method.

    python benchmarks/gpu_bench.py --out results/gpu.jsonl                    # the GPU machine, ~7 min
    python benchmarks/gpu_bench.py --shape tiny --device cpu --lengths 512 --out /tmp/gpu.jsonl   # smoke test

The learned scorer (`learnedzip`) gets random weights of its real shape: its cost is in the shapes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
import traceback
from contextlib import nullcontext
from pathlib import Path

import torch

SHAPES = {  # transformers config fields
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=131072, rope_theta=500000.0),
    "qwen3-8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=131072, rope_theta=1000000.0),
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192),
}
METHODS = ["full", "snapkv", "mixedmerge", "learnedzip", "learnedzip:alloc=uniform", "zipguardmerge"]
GIB = 1024 ** 3


class CharTokenizer:
    """A tokenizer stand-in for random-weight models: one id per character (the prompts a method writes
    itself, e.g. KVzip's repeat request); no chat template."""

    chat_template = None
    all_special_ids = [0, 1, 2]

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __len__(self):
        return self.vocab

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [13 if c == "." else 100 + ord(c) % (self.vocab - 100) for c in text]}

    def get_vocab(self):
        return {("." if i == 13 else f"w{i}"): i for i in range(self.vocab)}

    def convert_tokens_to_string(self, tokens):
        return " ".join(tokens)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


# datasheet HBM bandwidth (TB/s) by a part of the device's name, first match
HBM_TBS = [("H200", 4.8), ("H100 PCIe", 2.0), ("H100 NVL", 3.9), ("H100", 3.35), ("A100", 2.0)]


def hbm_tbs(gpu: str) -> float | None:
    return next((tbs for part, tbs in HBM_TBS if part in gpu), None)


def sig(x: float) -> float:
    """`x` to 4 significant digits."""
    return float(f"{x:.4g}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `fn()` over `reps` runs after `warmup`."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def build_model(shape: str, device, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_scorer(model, folder: Path) -> None:
    """Random learned-scorer weights of the model's real shape, where `learnedzip` finds them."""
    from kvmerge.scorer import LinearScorer, fingerprint

    c = model.config
    size = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim + 1
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(size, c.num_key_value_heads, generator=g) * 0.01 for _ in range(c.num_hidden_layers)]
    LinearScorer(weights, fingerprint(c), {"random": True}).save(folder / "random.safetensors")
    os.environ["KVMERGE_SCORERS"] = str(folder)


def bandwidth(device) -> dict:
    x = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    s = timed(lambda: y.copy_(x), device, reps=10)
    return {"kind": "bandwidth", "copy_tbs": sig(2 * x.numel() / s / 1e12)}


def kernel_rows(device, dtype, lengths, batches, hbm_tbs, flex_at: int) -> list[dict]:
    """One layer's decode attention: plain SDPA, kvmerge's biased SDPA, and at `flex_at` slots (each
    shape compiles anew) FlexAttention with a score_mod."""
    import torch.nn.functional as F

    from kvmerge.attention import biased_sdpa, fused_kernels, packed_sdpa

    hq, hkv, d = 32, 8, 128
    rows = []
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex = torch.compile(flex_attention, dynamic=False)
    except Exception:  # noqa: BLE001 - an older torch: no FlexAttention
        flex = None
    for s in lengths:
        for b in batches:
            if b * hkv * s * d * 2 * 2 > 40 * GIB:
                continue
            q = torch.randn(b, hq, 1, d, device=device, dtype=dtype)
            k = torch.randn(b, hkv, s, d, device=device, dtype=dtype)
            v = torch.randn(b, hkv, s, d, device=device, dtype=dtype)
            log_n = torch.randint(1, 5, (b, hkv, s), device=device).float().log()
            cache_bytes = 2 * k.numel() * k.element_size()
            rep = hq // hkv

            def plain(kernels=fused_kernels):
                with kernels(device):
                    return F.scaled_dot_product_attention(q.view(b, hkv, rep, d), k, v)

            def biased():
                with fused_kernels(device):
                    return biased_sdpa(q, k, v, log_n)

            def efficient():  # PyTorch's own kernel for a biased call
                with fused_kernels(device):
                    return packed_sdpa(q, k, v, log_n[:, :, None, :].to(dtype))
            row = {"kind": "kernel", "dtype": str(dtype).split(".")[-1], "slots": s, "batch": b,
                   "cache_mib": sig(cache_bytes / 2 ** 20),
                   "floor_us": sig(1e6 * (cache_bytes + log_n.numel() * 4) / (hbm_tbs * 1e12)),
                   "plain_us": sig(1e6 * timed(plain, device, 20)),
                   "plain_default_backends_us": sig(1e6 * timed(lambda: plain(lambda _: nullcontext()), device, 20)),
                   "kvmerge_us": sig(1e6 * timed(biased, device, 20)),
                   "sdpa_biased_us": sig(1e6 * timed(efficient, device, 20))}
            if flex is not None and s == flex_at:
                bias = log_n.to(dtype)

                def score_mod(score, bi, h, qi, ki):
                    return score + bias[bi, h // rep, ki]
                try:
                    run = lambda: flex(q, k, v, score_mod=score_mod, enable_gqa=True)  # noqa: E731
                    row["flex_us"] = sig(1e6 * timed(run, device, 20, warmup=3))
                    if b == batches[0]:
                        row["flex_err"] = _err(run().transpose(1, 2), q, k, v, log_n)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    row["flex_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if s == lengths[0] and b == batches[0]:
                row["kvmerge_err"] = _err(biased(), q, k, v, log_n)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _err(out, q, k, v, log_n) -> float:
    """Max abs error of `out` `(b, 1, hq, d)` against float64 softmax(q·k/√d + log_n) v."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    logits = qd @ kd.transpose(-1, -2) / q.shape[-1] ** 0.5 + log_n.double().repeat_interleave(rep, 1)[:, :, None]
    want = (logits.softmax(-1) @ vd).transpose(1, 2)
    return float((out.double() - want).abs().max())


def model_rows(model, tok, lengths, methods, budgets, device, args, deadline) -> list[dict]:
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    vocab = model.config.vocab_size
    rows = []
    for n in lengths:
        ids = torch.randint(100, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        for spec in methods:
            for budget in ([1.0] if spec == "full" else budgets):
                if time.time() > deadline:
                    print(json.dumps({"kind": "skipped", "tokens": n, "method": spec, "budget": budget}), flush=True)
                    continue
                if n > args.long_from and spec not in args.long_methods.split(","):
                    continue
                row = {"kind": "model", "shape": args.shape, "tokens": n, "method": spec, "budget": budget}
                try:
                    row.update(one_config(model, tok, ids, spec, budget, device, weight_bytes, args))
                except Exception as e:  # noqa: BLE001 - reported, the next configuration runs
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    traceback.print_exc()
                gc.collect()  # a Session and its cache form a cycle (the cache's listener): free it now
                torch.cuda.empty_cache() if device.type == "cuda" else None
                rows.append(row)
                print(json.dumps(row), flush=True)
                _write(args.out, row)
    return rows


def one_config(model, tok, ids, spec, budget, device, weight_bytes, args) -> dict:
    import kvmerge

    method = None if spec == "full" else kvmerge.get_method(spec, budget)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    session = kvmerge.Session(model, 1, method, tok)
    with torch.inference_mode():
        logits = session.prefill([ids])
        out = dict(prefill_s=sig(session.timings["prefill_seconds"]),
                   compress_s=sig(session.timings["compress_seconds"]))
        out["compress_ratio"] = sig(out["compress_s"] / out["prefill_s"])
        out["entries"] = max(session.cache.entries)
        out["cache_bytes"] = session.cache.nbytes
        out["peak_gib"] = sig(torch.cuda.max_memory_allocated(device) / GIB) if device.type == "cuda" else None
        token = [[int(logits.argmax(-1)[0])]]
        session.reserve(args.steps + 4)
        step = lambda: session.forward(token)  # noqa: E731
        out["decode_ms_b1"] = sig(1e3 * timed(step, device, args.steps))
        row_bytes = session.cache.nbytes
        floor = lambda batch: 1e3 * (weight_bytes + batch * row_bytes) / (args.hbm_tbs * 1e12)  # noqa: E731
        out["floor_ms_b1"] = sig(floor(1))
        out["b1_over_floor"] = sig(out["decode_ms_b1"] / out["floor_ms_b1"])
        room = args.memory_gib * GIB - weight_bytes - 2 * GIB  # 2 GiB for activations
        batch = max(1, int(min(args.max_batch, room // session.cache.allocated_bytes)))
        out["max_batch"] = batch
        if not args.no_graph:
            out.update(graph_decode(session, token, device, args.steps, "b1", out["floor_ms_b1"]))
        if batch > 1 and not args.no_batch:
            session.repeat_rows(batch)
            session.reserve(args.steps + 4)
            token = token * batch
            out["decode_ms_bmax"] = sig(1e3 * timed(step, device, args.steps // 2 or 1))
            out["floor_ms_bmax"] = sig(floor(batch))
            out["bmax_over_floor"] = sig(out["decode_ms_bmax"] / out["floor_ms_bmax"])
            out["tokens_per_s_bmax"] = sig(1e3 * batch / out["decode_ms_bmax"])
            if device.type == "cuda":
                out["peak_gib_bmax"] = sig(torch.cuda.max_memory_allocated(device) / GIB)
            if not args.no_graph:
                out.update(graph_decode(session, token, device, args.steps // 2 or 1, "bmax", out["floor_ms_bmax"]))
    return out


def graph_decode(session, token, device, steps: int, label: str, floor_ms: float) -> dict:
    """Decode ms/step with `kvmerge.graphs.GraphDecoder` (a captured CUDA graph on CUDA; elsewhere its
    fixed-shape steps run eagerly), beside the floor, and the seconds its capture took."""
    from kvmerge.graphs import GraphDecoder

    ids = torch.tensor([row[0] for row in token], device=device)
    t0 = time.perf_counter()
    with GraphDecoder(session, steps + 2) as decoder:
        sync(device)
        capture = time.perf_counter() - t0
        ms = 1e3 * timed(lambda: decoder.step(ids), device, steps)
    return {f"graph_decode_ms_{label}": sig(ms), f"{label}_graph_over_floor": sig(ms / floor_ms),
            f"graph_capture_s_{label}": sig(capture), "graph": decoder.graph}


def _write(path, row) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--lengths", default="32768,8192,131072",
                   help="context tokens, comma-separated, run in this order (the bars' 32k first)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--budgets", default="0.25,0.1")
    p.add_argument("--long-from", type=int, default=32768, help="above this length only --long-methods run")
    p.add_argument("--long-methods", default="full,snapkv,learnedzip:alloc=uniform")
    p.add_argument("--kernel-lengths", default="8192,32768,65536")
    p.add_argument("--kernel-batches", default="1,8")
    p.add_argument("--flex-at", type=int, default=32768, help="the kernel slots at which FlexAttention is compiled")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (median)")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="weights + caches for the largest batch (default: 72%% of the GPU's memory, 100 on an H200)")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--no-batch", action="store_true", help="batch 1 only")
    p.add_argument("--no-graph", action="store_true", help="no decode timing with kvmerge.graphs.GraphDecoder")
    p.add_argument("--hbm-tbs", type=float, default=None,
                   help="HBM bandwidth for the floor (default: the GPU's datasheet figure, `HBM_TBS`)")
    p.add_argument("--seconds", type=float, default=420, help="start no model configuration after this")
    p.add_argument("--parts", default="bandwidth,kernel,model,profile,profile-compress")
    p.add_argument("--profile-compress", default="learnedzip,mixedmerge", help="methods whose compression is profiled")
    p.add_argument("--out", default="results/gpu.jsonl")
    args = p.parse_args()
    start = time.time()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    parts = args.parts.split(",")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if args.memory_gib is None:
        args.memory_gib = 0.72 * torch.cuda.get_device_properties(device).total_memory / GIB if device.type == "cuda" else 8
    if args.hbm_tbs is None:
        args.hbm_tbs = 4.8 if device.type != "cuda" else hbm_tbs(gpu)  # a CPU smoke test: an H200's
        if args.hbm_tbs is None:
            raise SystemExit(f"no HBM bandwidth known for {gpu}: give --hbm-tbs")
    head = {"kind": "machine", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "gpu": gpu,
            "shape": args.shape, "memory_gib": sig(args.memory_gib), "hbm_tbs": args.hbm_tbs}
    import transformers

    head["transformers"] = transformers.__version__
    print(json.dumps(head), flush=True)
    _write(args.out, head)
    if "bandwidth" in parts and device.type == "cuda":
        _write(args.out, row := bandwidth(device))
        print(json.dumps(row), flush=True)
    if "kernel" in parts:
        lengths = [int(x) for x in args.kernel_lengths.split(",")]
        for row in kernel_rows(device, dtype, lengths, [int(x) for x in args.kernel_batches.split(",")], args.hbm_tbs,
                               args.flex_at):
            _write(args.out, row)
    if not {"model", "profile", "profile-compress"} & set(parts):
        return
    t0 = time.time()
    model = build_model(args.shape, device, dtype)
    tok = CharTokenizer(model.config.vocab_size)
    folder = Path(tempfile.mkdtemp())
    random_scorer(model, folder)
    print(json.dumps({"kind": "built", "seconds": sig(time.time() - t0)}), flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    profile_at = 32768 if 32768 in lengths else min(lengths)  # the bars' length
    from gpu_profile import profile_compression, profile_step

    if "profile" in parts:
        try:
            profile_step(model, tok, profile_at, "snapkv", 0.25, device,
                         Path(args.out).with_name("gpu_profile.txt"))
        except Exception:  # noqa: BLE001 - reported, the benchmark runs
            traceback.print_exc()
    if "model" in parts:
        model_rows(model, tok, lengths, args.methods.split(","), [float(x) for x in args.budgets.split(",")],
                   device, args, start + args.seconds)
    Path(args.out).with_name("gpu_profile_compress.txt").unlink(missing_ok=True)  # this run's profiles only
    for spec in args.profile_compress.split(",") if "profile-compress" in parts else []:
        try:
            profile_compression(model, tok, profile_at, spec, 0.25, device,
                                Path(args.out).with_name("gpu_profile_compress.txt"))
        except Exception:  # noqa: BLE001 - reported, the benchmark runs
            traceback.print_exc()
    print(json.dumps({"kind": "done", "seconds": sig(time.time() - start)}), flush=True)


if __name__ == "__main__":
    main()
