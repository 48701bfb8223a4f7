"""kvmerge inside vLLM (CPU): each prompt's KV entries compressed by a kvmerge method right after its
prefill, the freed blocks returned to vLLM's pool, decoding with proportional attention. See docs/vllm.md.

    LLM(model, enable_prefix_caching=False, additional_config={"kvmerge": {"method": "snapkv", "budget": 0.25}})

`register` is the `vllm.general_plugins` entry point. Without `additional_config["kvmerge"]` it changes
nothing vLLM does. `import kvmerge` never imports this package (it imports vLLM).
"""

from __future__ import annotations

import logging

from .config import SCHEDULER, WORKER, Settings, check, layout, refusal, settings_of

__all__ = ["Settings", "check", "configure", "layout", "refusal", "register", "settings_of"]

logger = logging.getLogger("vllm.plugins.kvmerge")  # under "vllm": printed with vLLM's own log lines


def configure(vllm_config) -> None:
    """Called after the platform's own config check: with the plugin off, return; else validate
    (raising a ValueError that names the problem) and install kvmerge's worker and scheduler. Chunked
    prefill is turned off (a prompt is compressed once, whole), with a warning if it was on."""
    settings = check(vllm_config)
    if settings is None:
        return
    from .compat import check_version

    check_version()
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise ValueError(f"kvmerge: the vLLM plugin runs on vLLM's CPU platform only (this is "
                         f"{current_platform.device_name}); the CUDA attention path is not written yet (docs/vllm.md)")
    scheduler = vllm_config.scheduler_config
    if scheduler.enable_chunked_prefill:
        logger.warning("kvmerge: chunked prefill turned off: each prompt is compressed once, whole, after its "
                       "prefill (max_num_batched_tokens raised to max_model_len)")
        scheduler.enable_chunked_prefill = False
        scheduler.max_num_batched_tokens = max(scheduler.max_num_batched_tokens, vllm_config.model_config.max_model_len)
    vllm_config.parallel_config.worker_cls = WORKER
    scheduler.scheduler_cls = SCHEDULER
    method = settings.build()
    if method.name == "full":
        logger.info("kvmerge: every prompt keeps its whole cache (method full)")
    else:
        logger.info("kvmerge: compressing every prompt with %s, budget %s", settings.method, method.budget)


def register() -> None:
    """The `vllm.general_plugins` entry point, run once in each vLLM process: wraps the current
    platform's `check_and_update_config` (run when vLLM builds its config) with `configure`."""
    from .compat import after_platform_config

    after_platform_config(configure)
