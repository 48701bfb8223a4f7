"""The operators of one decode step and of one prefill with its compression, by CUDA and CPU time
(`gpu_bench.py --parts profile,profile-compress` writes them beside its rows)."""

from __future__ import annotations

from pathlib import Path

import torch


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_step(model, tok, n, spec, budget, device, out_path: Path) -> None:
    """The operators of one batch-1 decode step, by CUDA and by CPU time."""
    import kvmerge
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(100, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    session = kvmerge.Session(model, 1, None if spec == "full" else kvmerge.get_method(spec, budget), tok)
    with torch.inference_mode():
        session.prefill([ids])
        session.reserve(16)
        for _ in range(3):
            session.forward([[7]])
        sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            session.forward([[7]])
            sync(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    text = (f"one decode step, {spec} at {budget}, {n} tokens, batch 1\n\n"
            + prof.key_averages().table(sort_by=key, row_limit=25) + "\n\nby CPU time\n\n"
            + prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    out_path.write_text(text)
    print(text[:3000], flush=True)


def profile_compression(model, tok, n, spec, budget, device, out_path: Path) -> None:
    """The operators of one batch-1 prefill and its compression with `spec`, by CPU time (where a
    host-bound compression spends it) and by CUDA time: `kvmerge::compress` is the compression (a
    surprisal pass runs before it), syncs show as `aten::_local_scalar_dense`."""
    import kvmerge
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(100, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        kvmerge.Session(model, 1, kvmerge.get_method(spec, budget), tok).prefill([ids[:1024]])  # warm-up
        session = kvmerge.Session(model, 1, kvmerge.get_method(spec, budget), tok)
        sync(device)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            session.prefill([ids])
            sync(device)
    t = session.timings
    text = (f"one prefill and compression, {spec} at {budget}, {n} tokens, batch 1: prefill "
            f"{t['prefill_seconds']:.3f} s, compression {t['compress_seconds']:.3f} s (under the profiler)\n\n"
            "by CPU time\n\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    if device.type == "cuda":
        text += "\n\nby CUDA time\n\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
    with open(out_path, "a") as f:
        f.write(text + "\n\n")
    print(text[:3000], flush=True)
