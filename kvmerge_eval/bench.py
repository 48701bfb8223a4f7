"""`kvmerge bench`: decode speed, compression cost, cache bytes and peak memory, side by side with the
full cache in one run, against this machine's memory-bandwidth floor."""

from __future__ import annotations

import csv
import json
import threading
import time
from pathlib import Path

import torch

from kvmerge import Session, get_method
from kvmerge.attention import biased_sdpa, packed_sdpa
from kvmerge.cache import stock_cache_bytes
from . import fidelity


def bandwidth(mbytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second of a large tensor copy (read + write counted), the best of `repeats`."""
    a = torch.ones(mbytes * 2**20 // 4)
    b = torch.empty_like(a)
    return 2 * a.numel() * 4 / (_best_ms(lambda: b.copy_(a), repeats) / 1e3)


def _best_ms(fn, repeats: int = 5) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


@torch.inference_mode()
def kernel_floor(model, batches, length: int) -> dict:
    """What torch's own kernels reach on this machine, measured in this run: the ms of every `nn.Linear`
    of the model applied to `batch` rows (best of 5), and the bytes/s at which packed decode SDPA reads
    a plain cache of `length` tokens at the largest batch. With them, floor = linears + cache bytes /
    that rate: the time left above it is kvmerge's own overhead, the time between it and the copy
    floor is the kernels'."""
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    linear_ms = {}
    for batch in batches:
        xs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in linears}
        linear_ms[batch] = _best_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in linears])
    cfg = model.config.get_text_config(decoder=True)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    b = max(batches)
    p = next(model.parameters())
    q = torch.randn(b, hq, 1, d, dtype=p.dtype, device=p.device)
    k, v = (torch.randn(b, hkv, length, d, dtype=p.dtype, device=p.device) for _ in range(2))
    ms = _best_ms(lambda: packed_sdpa(q, k, v))
    return {"linear_ms": linear_ms, "attention_gbs": 2 * k.numel() * k.element_size() / ms / 1e6}


class PeakRSS:
    """Peak resident memory above the level at entry, sampled every 2 ms (bytes)."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = False
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while not self._stop:
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.extra = self.peak - self.base


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def prefilled(model, ids, spec, budget, tokenizer=None, chunk=None):
    """A batch-1 session with `ids` prefilled (`chunk` tokens at a time if given) and compressed by
    `spec` (`"full"`: nothing compressed), and its timings with the peak resident memory above the
    level before it."""
    method = None if spec == "full" else get_method(spec, budget)
    s = Session(model, 1, method, tokenizer)
    with torch.inference_mode(), PeakRSS() as mem:
        s.prefill([ids], chunk=chunk)
    return s, {"prefill_s": s.timings["prefill_seconds"], "compress_s": s.timings.get("compress_seconds", 0.0),
               "peak_extra_bytes": mem.extra}


def decode_seconds(session, batch, steps, warmup=2) -> float:
    session.reserve(warmup + steps)
    token = [[7]] * batch
    for _ in range(warmup):
        session.forward(token)
    t0 = time.perf_counter()
    for _ in range(steps):
        session.forward(token)
    return (time.perf_counter() - t0) / steps


@torch.inference_mode()
def run_bench(model, methods, budget, lengths, batches, steps, out_dir, tokenizer=None, prefill_chunk=None):
    """One row per (length, batch, method): decode ms/token, tokens/s, speedup vs full (same run),
    cache bytes, compression/prefill fraction, peak memory, bandwidth floor. Contexts are prose
    (random ids without a tokenizer). The floor's bandwidth is the best of a copy benchmark run before
    and after the decode runs (both kept in the rows)."""
    bw_before = bandwidth()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    rows = []
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for n in lengths:
        if tokenizer is not None:
            ids = fidelity.make_sample(tokenizer, n, seed=n, continuation=0).context
        else:
            ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        prepared = {spec: prefilled(model, ids, spec, budget, tokenizer, prefill_chunk)
                    for spec in ["full"] + list(methods)}
        for batch in batches:
            full_s = None
            for spec, (session, info) in prepared.items():
                snap = session.snapshot()
                session.repeat_rows(batch)
                cache_bytes = session.cache.nbytes
                sec = decode_seconds(session, batch, steps)
                session.restore(snap)
                full_s = sec if spec == "full" else full_s
                rows.append({"length": n, "batch": batch, "method": spec, "budget": 1.0 if spec == "full" else budget,
                             "ms_per_step": 1e3 * sec, "tokens_per_s": batch / sec, "speedup": full_s / sec,
                             "cache_bytes": cache_bytes, "cache_vs_full": cache_bytes / (batch * stock_cache_bytes(model.config, dtype, n)),
                             "compress_vs_prefill": info["compress_s"] / info["prefill_s"],
                             "prefill_s": info["prefill_s"], "compress_s": info["compress_s"],
                             "peak_extra_mb": info["peak_extra_bytes"] / 2**20})
    profiles = {spec: profile_step(session, max(batches)) for spec, (session, _) in list(prepared.items())[:2]}
    bw_after = bandwidth()
    bw = max(bw_before, bw_after)
    kernels = kernel_floor(model, batches, max(lengths))
    for r in rows:
        floor = (weights + r["cache_bytes"]) / bw
        kfloor = kernels["linear_ms"][r["batch"]] + r["cache_bytes"] / kernels["attention_gbs"] / 1e6
        r.update(floor_ms=1e3 * floor, vs_floor=r["ms_per_step"] / (1e3 * floor), bandwidth_gbs=bw / 1e9,
                 bandwidth_before_gbs=bw_before / 1e9, bandwidth_after_gbs=bw_after / 1e9,
                 kernel_floor_ms=kfloor, vs_kernel_floor=r["ms_per_step"] / kfloor,
                 linear_ms=kernels["linear_ms"][r["batch"]], attention_gbs=kernels["attention_gbs"])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(rows, indent=1))
    (out / "profile.json").write_text(json.dumps({"length": lengths[-1], "batch": max(batches), **profiles}, indent=1))
    with (out / "bench.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    _plot(rows, out)
    return rows, profiles


PARTS = {"kvmerge::attention": "attention", "kvmerge::cache_append": "cache append",
         "kvmerge::listener": "decode policy"}


def profile_step(session, batch: int, steps: int = 4) -> dict:
    """Where one decode step's time goes (ms per step, from torch.profiler): attention (kvmerge's
    attention function, bias included), cache append, the decode policy, matrix products outside
    those (weights), other."""
    from torch.profiler import ProfilerActivity, profile

    snap = session.snapshot()
    session.repeat_rows(batch)
    session.reserve(steps + 1)
    token = [[7]] * batch
    session.forward(token)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            session.forward(token)
    session.restore(snap)
    events = prof.events()
    total = sum(e.self_cpu_time_total for e in events)
    out = {name: 0.0 for name in (*PARTS.values(), "weights (matmul)", "other")}
    inside = {label: [(e.time_range.start, e.time_range.end) for e in events if e.name == label] for label in PARTS}
    for e in events:
        part = PARTS.get(e.name) or next((PARTS[label] for label, spans in inside.items()
                     if any(a <= e.time_range.start and e.time_range.end <= b for a, b in spans)), None)
        if part is None:
            part = "weights (matmul)" if e.name in ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
                                                    "aten::linear") else "other"
        out[part] += e.self_cpu_time_total
    return {k: v / 1e3 / steps for k, v in out.items()} | {"total": total / 1e3 / steps}


def bias_overhead(model, length: int, batch: int, steps: int) -> dict:
    """One decode step's attention over a full-size cache, every layer's shapes: stock SDPA (GQA by
    `enable_gqa`) vs kvmerge's biased SDPA with log_n = 0 (query heads packed), ms per step."""
    cfg = model.config.get_text_config(decoder=True)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    dtype = next(model.parameters()).dtype
    q = torch.randn(batch, hq, 1, d, dtype=dtype)
    k, v = (torch.randn(batch, hkv, length, d, dtype=dtype) for _ in range(2))
    log_n = torch.zeros(batch, hkv, length)

    def stock():  # what transformers' sdpa runs for an unmasked decoding step
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=hq > hkv)

    def timed(fn):
        fn()
        t0 = time.perf_counter()
        for _ in range(steps):
            for _layer in range(cfg.num_hidden_layers):
                fn()
        return (time.perf_counter() - t0) / steps

    with torch.inference_mode():
        a, b, c = timed(stock), timed(lambda: biased_sdpa(q, k, v, log_n)), timed(stock)
    return {"length": length, "batch": batch, "stock_ms": 1e3 * (a + c) / 2, "biased_ms": 1e3 * b,
            "overhead": b / ((a + c) / 2) - 1}


def _plot(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in sorted({r["method"] for r in rows} - {"full"}):
        for batch in sorted({r["batch"] for r in rows}):
            pts = sorted((r["length"], r["speedup"]) for r in rows if r["method"] == method and r["batch"] == batch)
            ax.plot(*zip(*pts), marker="o", label=f"{method} batch {batch}")
    ax.axhline(1.0, color="black", linestyle="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode speedup vs full cache (same run)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bench_speedup.png", dpi=120)
    plt.close(fig)
