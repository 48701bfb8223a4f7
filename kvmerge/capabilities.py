"""Where a method runs, derived in one place from what it declares (`Method.needs`): the transformers
runtime one-shot, the transformers runtime under a chunked prefill, and the vLLM plugin. Every
refusal here is structural and says why; checks that depend on the input (rows of one length, a
chunk longer than sinks + window, a model with sliding layers) stay where the input is known.
"""

from __future__ import annotations

from .planner import is_global

RUNTIMES = ("transformers", "chunked", "vllm")


def refusals(method, runtime: str) -> list[str]:
    """Why `runtime` cannot run `method` (empty: it can), each reason naming the method."""
    if runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; runtimes: {', '.join(RUNTIMES)}")
    needs, name, out = method.needs, method.name, []
    if runtime != "vllm":
        return out
    if needs.decode_policy:
        out.append(f"{name} changes the cache while decoding (a decode-time policy); the plugin compresses once, "
                   "after the prefill, and vLLM's blocks of decoded tokens are not rewritten")
    if needs.second_pass:
        out.append(f"{name} runs another forward pass over the prompt before compressing (e.g. KVzip's "
                   "reconstruction); the plugin compresses inside one forward and has no second pass")
    if needs.head_counts or needs.layer_counts:
        what = f": alloc={method.alloc!r} gives" if is_global(method) else " sets per-layer budgets, giving"
        hint = f" ({name}:alloc=uniform runs there)" if is_global(method) else ""
        out.append(f"{name}{what} layers or heads different entry counts; vLLM's block table is shared by every "
                   f"layer and head of a request, so each keeps the same count{hint}")
    if needs.sliding:
        out.append(f"{name}: sliding={method.sliding} shortens sliding-window layers; the plugin serves models with "
                   "full-attention layers only")
    return out


def check(method, runtime: str) -> None:
    """Raise a ValueError with the first reason `runtime` cannot run `method`."""
    reasons = refusals(method, runtime)
    if reasons:
        raise ValueError(reasons[0])


def where(method) -> dict[str, bool]:
    """Runtime → whether it runs `method`."""
    return {runtime: not refusals(method, runtime) for runtime in RUNTIMES}
