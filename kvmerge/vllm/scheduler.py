"""The scheduler side: after a step that prefilled a whole prompt, the blocks its compression freed
go back to vLLM's block pool, so the scheduler admits more requests.

A request whose step started at token 0 with more than one token is a whole prompt (chunked prefill
is off), compressed by the workers in that step to `layout(...)`; the same rule gives the same
layout here. Its blocks [0, freed) are replaced by the pool's null block and freed, as vLLM's
sliding-window manager does for blocks out of its window: the request's block list keeps its length,
so block index = position // block size stays true for the tokens that follow. A preempted request
frees all its blocks as usual and is compressed again when vLLM recomputes it.
"""

from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.request import RequestStatus

from .compat import free_leading_blocks, request_blocks
from .config import layout, settings_of

logger = init_logger("vllm.plugins.kvmerge")  # under "vllm": printed with vLLM's own log lines
STATS_KEPT = 4096  # the most recent compressions whose figures `kvmerge_stats` keeps


class KvmergeScheduler(Scheduler):
    """vLLM's scheduler freeing the blocks each compression releases. `kvmerge_stats`: per compressed
    request (the latest `STATS_KEPT`), its last layout, the blocks it held (non-null) right after the
    release, the pool's usage then, and how many times it was compressed (more than once when vLLM
    preempted and recomputed it); `kvmerge_peak_running`: the most requests running at once;
    `kvmerge_peak_prompts`: the most prompts compressed in one step; `kvmerge_idle`: the pool's free
    blocks when the last request left (also logged: "kvmerge: idle: F of T KV blocks free, H held; A requests
    aborted so far"); `kvmerge_aborted`: requests finished from outside a step (clients' aborts);
    `kvmerge_aborts`: the aborts by where they found the request (`finish_requests`)."""

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
        super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
        self.kvmerge_method = settings_of(vllm_config.additional_config).build()
        groups = kv_cache_config.kv_cache_groups
        if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
            raise ValueError("kvmerge: the plugin needs one full-attention KV cache group (no sliding-window or "
                             f"hybrid layers); this model has {[type(g.kv_cache_spec).__name__ for g in groups]}")
        self.kvmerge_block_size = groups[0].kv_cache_spec.block_size
        self.kvmerge_prefilling: dict[str, int] = {}
        self.kvmerge_stats: dict[str, dict] = {}
        self.kvmerge_peak_running = 0
        self.kvmerge_peak_prompts = 0
        self.kvmerge_idle: dict | None = None  # the pool when the scheduler last ran out of requests
        self.kvmerge_busy = False
        self.kvmerge_aborted = 0  # requests finished from outside a step: clients' aborts (and stop strings)
        self.kvmerge_aborts: dict[str, int] = {"queued": 0, "right after its prefill step": 0, "decoding": 0}
        self.kvmerge_just_prefilled: set[str] = set()  # the requests the latest step prefilled and compressed

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        """vLLM's last word on how many tokens a request gets this step (called for running and waiting
        requests alike, `compat` lists it), then: a request resumed after a preemption (nothing computed,
        tokens decoded before) gets its prompt alone. It is compressed as it was the first time (same
        prompt, same queries, same layout); its decoded tokens follow in the next step as a running
        request's tokens, attending to the compressed prompt as they did when they were decoded. So the
        cache is rebuilt as it was, and the request goes on as if never preempted. (Recomputing prompt and
        decoded tokens as one new prompt would compress a different sequence and change its answer.)"""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if num_computed_tokens == 0 and request.num_tokens > request.num_prompt_tokens > 1:
            n = min(n, request.num_prompt_tokens)
        return n

    def add_request(self, request) -> None:
        super().add_request(request)
        self.kvmerge_busy = True

    def finish_requests(self, request_ids, finished_status):
        """vLLM's finish from outside a step (a client's abort), then the idle check. Each abort is logged
        with where it found the request: queued (nothing computed: not yet prefilled, or preempted), right
        after its prefill step (the step that just ran prefilled and compressed it: vLLM handles an abort
        between steps, so one that arrives during the prefill and compression lands here) or decoding."""
        if finished_status == RequestStatus.FINISHED_ABORTED:
            request_ids = ([request_ids] if isinstance(request_ids, str) else
                           list(self.requests) if request_ids is None else list(request_ids))
            for req_id in request_ids:
                request = self.requests.get(req_id)
                if request is None or request.is_finished():
                    continue
                where = ("queued" if request.num_computed_tokens == 0 else "right after its prefill step"
                         if req_id in self.kvmerge_just_prefilled else "decoding")
                self.kvmerge_aborts[where] += 1
                logger.info("kvmerge: request %s aborted %s (%d tokens computed, %d out)", req_id, where,
                            request.num_computed_tokens, request.num_output_tokens)
        out = super().finish_requests(request_ids, finished_status)
        if finished_status == RequestStatus.FINISHED_ABORTED:
            self.kvmerge_aborted += len(out)
        self.kvmerge_check_idle()
        return out

    def kvmerge_check_idle(self) -> None:
        """When the last request has left (finished or aborted), log the pool's free blocks once: with no
        request left every block but the pool's null block must be free, so `held` is the blocks leaked."""
        if not self.kvmerge_busy or self.requests:
            return
        self.kvmerge_busy = False
        pool = self.kv_cache_manager.block_pool
        free, total = pool.get_num_free_blocks(), pool.num_gpu_blocks - 1  # the null block is never free
        self.kvmerge_idle = {"free": free, "total": total, "held": total - free, "aborted": self.kvmerge_aborted}
        logger.info("kvmerge: idle: %d of %d KV blocks free, %d held; %d requests aborted so far", free, total,
                    total - free, self.kvmerge_aborted)

    def schedule(self, *args, **kwargs):
        out = super().schedule(*args, **kwargs)
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            if n > 1 and request.num_computed_tokens == n:  # started at token 0 (already advanced by n)
                self.kvmerge_prefilling[req_id] = n
        self.kvmerge_peak_running = max(self.kvmerge_peak_running, len(self.running))
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        out = super().update_from_output(scheduler_output, model_runner_output)
        prompts = 0
        self.kvmerge_just_prefilled = set()
        for req_id in scheduler_output.num_scheduled_tokens:
            n = self.kvmerge_prefilling.pop(req_id, None)
            if n is None or request_blocks(self, req_id) is None:  # not a prefill, or finished already
                continue
            lay = layout(self.kvmerge_method, n, self.kvmerge_block_size)
            prompts += 1
            self.kvmerge_just_prefilled.add(req_id)
            if lay.freed:
                free_leading_blocks(self, req_id, lay.freed)
            blocks = request_blocks(self, req_id)
            held = sum(not b.is_null for b in blocks)
            times = self.kvmerge_stats.pop(req_id, {}).get("compressions", 0) + 1  # > 1: recomputed after preemption
            self.kvmerge_stats[req_id] = {"prompt": lay.prompt, "kept": lay.kept, "freed": lay.freed, "held": held,
                                          "compressions": times,
                                          "listed": len(blocks), "pool_usage": self.kv_cache_manager.usage,
                                          "pool_free": self.kv_cache_manager.block_pool.get_num_free_blocks()}
            logger.info("kvmerge: request %s: %d prompt tokens kept as %d entries per layer and KV head; %d blocks "
                        "freed, %d held", req_id, lay.prompt, lay.kept, lay.freed, held)
            if len(self.kvmerge_stats) > STATS_KEPT:
                self.kvmerge_stats.pop(next(iter(self.kvmerge_stats)))
        self.kvmerge_peak_prompts = max(self.kvmerge_peak_prompts, prompts)
        self.kvmerge_check_idle()
        return out
