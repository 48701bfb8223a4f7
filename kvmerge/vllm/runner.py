"""The worker side: vLLM's CPU worker with kvmerge's attention backend and a runner that tells the
attention, each step, which prompts to compress and which requests read from a shifted block table.

Positions and slots are vLLM's own (num_computed_tokens + offset; table[pos // bs] · bs + pos % bs):
nothing here changes them, so decoded tokens keep their true positions. The runner's block table is
append-only and never learns of freed blocks; attention simply reads each compressed request's table
from its first kept block (`Layout.freed`), with that many blocks' tokens fewer.
"""

from __future__ import annotations

import inspect
import time

import torch
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from .attention import KvmergeCPUBuilder, KvmergeCPUImpl, Prompt, StepPlan
from .compat import clear_backend_cache, swap_class
from .compress import prompt_surprisal, worker_state
from .config import layout, needs_channel, settings_of

BACKEND = "kvmerge.vllm.attention.KvmergeCPUBackend"  # with the log-mass channel
PLAIN_BACKEND = "kvmerge.vllm.attention.KvmergePlainCPUBackend"  # full, and methods that only select


class KvmergeCPURunner(CPUModelRunner):
    """`CPUModelRunner` plus the step plan. `kvmerge_freed[req_id]`: blocks a request's compression
    freed (kept until the request leaves the batch or is prefilled again after a preemption)."""

    kvmerge_freed: dict

    def kvmerge_start(self) -> None:
        self.kvmerge = worker_state(self.vllm_config)
        self.kvmerge_method = self.kvmerge.method
        self.kvmerge_freed = {}
        self.kvmerge_step: StepPlan | None = None
        self.kvmerge_lm_head: torch.Tensor | None = None

    def load_model(self, *args, **kwargs):
        """vLLM's model load, then every kvmerge attention layer gets this worker's `WorkerState`."""
        out = super().load_model(*args, **kwargs)
        for module in self.get_model().modules():
            if isinstance(getattr(module, "impl", None), KvmergeCPUImpl):
                module.impl.state = self.kvmerge
        return out

    def _model_forward(self, *args, **kwargs):
        """vLLM's forward, then the step's deferred compressions, given each prompt's surprisal from the
        final hidden states (methods that need it; their layers' inputs were kept by the attention)."""
        out = super()._model_forward(*args, **kwargs)
        plan, self.kvmerge_step = self.kvmerge_step, None
        if plan is not None and plan.deferred:
            start = time.perf_counter()
            hidden = out[0] if isinstance(out, tuple) else out
            config = self.vllm_config.model_config.hf_text_config
            surprisal = {p.row: prompt_surprisal(self._lm_head(), config, hidden[p.start:p.start + p.layout.prompt],
                                                 p.token_ids) for p in plan.prompts}
            self.kvmerge.stats["compress_seconds"] += time.perf_counter() - start
            for prompt, compress in plan.deferred:
                compress(surprisal=surprisal[prompt.row])
            plan.deferred.clear()
        return out

    def _lm_head(self) -> torch.Tensor:
        """vLLM's LM head weight, its first vocab_size rows: the surprisal's logits."""
        if self.kvmerge_lm_head is None:
            config = self.vllm_config.model_config.hf_text_config
            head = getattr(self.get_model(), "lm_head", None)
            if getattr(head, "weight", None) is None:
                raise ValueError(f"kvmerge: {self.kvmerge_method.name} needs each token's surprisal, and the model "
                                 "has no LM head weight (lm_head.weight) to compute it from")
            self.kvmerge_lm_head = head.weight[:config.vocab_size]
        return self.kvmerge_lm_head

    def _block_size(self) -> int:
        groups = self.kv_cache_config.kv_cache_groups
        if len(groups) != 1:
            raise ValueError(f"kvmerge: the model has {len(groups)} KV cache groups; the plugin handles one")
        if any(g.kernel_block_size is not None for g in self.attn_groups[0]):
            raise ValueError("kvmerge: kernel blocks smaller than the cache's blocks are not supported")
        return groups[0].kv_cache_spec.block_size

    def kvmerge_plan(self, num_reqs: int, scheduled: dict | None) -> StepPlan | None:
        """This step's plan from the persistent batch (before the step: `num_computed_tokens_cpu` are
        the tokens computed so far). A row starting at token 0 with more than one token is a whole
        prompt (chunked prefill is off): it is compressed after its attention, and its layout recorded.
        Other rows read their table shifted by the blocks their compression freed."""
        if not scheduled:
            return None
        batch, bs = self.input_batch, self._block_size()
        self.kvmerge_freed = {r: f for r, f in self.kvmerge_freed.items() if r in batch.req_id_to_index}
        starts = self.query_start_loc.cpu[:num_reqs + 1].tolist()
        shift = torch.zeros(num_reqs, dtype=torch.int64)
        prompts = []
        for row, req_id in enumerate(batch.req_ids[:num_reqs]):
            n, done = scheduled.get(req_id, 0), int(batch.num_computed_tokens_cpu[row])
            if done == 0 and n > 1:
                # a whole prompt; or, resumed after a preemption, the prompt alone (its decoded tokens follow)
                if n < int(batch.num_tokens_no_spec[row]) and n != int(batch.num_prompt_tokens[row]):
                    raise RuntimeError("kvmerge: a prompt was split across steps (chunked prefill), which the plugin "
                                       "turned off; its compression would miss the earlier chunks")
                lay = layout(self.kvmerge_method, n, bs)
                self.kvmerge_freed[req_id] = lay.freed
                if lay.kept < n:
                    ids = torch.from_numpy(batch.token_ids_cpu[row, :n].copy()).long()
                    prompts.append(Prompt(row, starts[row], lay, ids))
            elif done > 0:
                shift[row] = self.kvmerge_freed.get(req_id, 0) * bs
        return StepPlan(shift if bool(shift.any()) else None, tuple(prompts))

    def _build_attention_metadata(self, *args, **kwargs):
        bound = inspect.signature(CPUModelRunner._build_attention_metadata).bind(self, *args, **kwargs).arguments
        plan = self.kvmerge_step = self.kvmerge_plan(bound["num_reqs"], bound.get("num_scheduled_tokens"))
        for group in self.attn_groups[0] if self.attn_groups else ():
            for builder in group.metadata_builders:
                if isinstance(builder, KvmergeCPUBuilder):
                    builder.plan = plan
        return super()._build_attention_metadata(*args, **kwargs)


class KvmergeCPUWorker(CPUWorker):
    """vLLM's CPU worker with kvmerge's `CPU_ATTN` backend registered before the model is built, and
    `KvmergeCPURunner` as its runner. Named by `parallel_config.worker_cls` when the plugin is on."""

    def __init__(self, vllm_config, *args, **kwargs):
        method = settings_of(vllm_config.additional_config).build()
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND if needs_channel(method) else PLAIN_BACKEND)
        # vLLM caches each backend lookup for the process: a second engine in this process (tests,
        # benchmarks) with the other kind of method must not get the first one's backend
        clear_backend_cache()
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self):
        super().init_device()
        if type(self.model_runner) is not CPUModelRunner:
            raise ValueError(f"kvmerge: unexpected model runner {type(self.model_runner).__name__}")
        swap_class(self.model_runner, KvmergeCPURunner)  # the same object, with the plan hook
        self.model_runner.kvmerge_start()
