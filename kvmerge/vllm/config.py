"""The plugin's settings and the checks run once at startup, in the process that builds vLLM's config.

Switched on by `additional_config={"kvmerge": {"method": SPEC, "budget": B}}` (`LLM(...)` or
`vllm serve --additional-config`); without that key nothing here changes vLLM. Every refusal is a
`ValueError` naming what and why. Also the one layout rule the scheduler and the workers share
(`layout`), so that both sides agree on which blocks a compression frees without talking.

This module imports no vLLM: it reads the config object's attributes only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..methods import Method, get_method
from ..methods.registry import load_plugins
from ..spec import check_budget_once
from ..allocation import is_global
from .runtime import VllmRuntime

KEY = "kvmerge"
WORKER = "kvmerge.vllm.runner.KvmergeCPUWorker"
SCHEDULER = "kvmerge.vllm.scheduler.KvmergeScheduler"
STOCK_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
# Decoder-only RoPE models whose vLLM implementation has one full-attention KV cache group (tested: llama).
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
KERNEL_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # what CPU_ATTN's kernel accepts


@dataclass(frozen=True)
class Settings:
    """`additional_config["kvmerge"]`: `method`, a spec `kvmerge.get_method` accepts (left out:
    the default for the model, `kvmerge.defaults.default_method(..., runtime="vllm")`, which `check`
    writes into the config: `surprisezip` where it has learned-scorer weights, else
    `mixedmerge`), and
    `budget` (a float in (0, 1]: the fraction of each prompt's entries kept per layer and KV head; an
    int: a number of entries; None: the spec's or the method's default) and `imports`: modules or
    Python files that register methods of one's own, imported in every vLLM process before `method`
    is resolved (`kvmerge.methods.registry.load_plugins`)."""

    method: str
    budget: float | int | None = None
    imports: tuple[str, ...] = ()

    def build(self) -> Method:
        """A fresh method object (raises on an unknown method, parameter, a budget out of range, or a
        budget given both in the spec and as `budget` that disagree)."""
        load_plugins(list(self.imports))
        check_budget_once(self.method, self.budget, '"budget":')
        return get_method(self.method, self.budget)


def _near_key(key: str) -> bool:
    """Whether `key` is "kvmerge" mistyped: the same without case, "_" and "-", or one letter off and
    starting with "kv" (another plugin's "merge" or "kvmerge_v2" is not)."""
    k = key.lower().replace("_", "").replace("-", "")
    if k == KEY:
        return True
    if not k.startswith("kv") or abs(len(k) - len(KEY)) > 1:
        return False
    if len(k) == len(KEY):
        return sum(a != b for a, b in zip(k, KEY)) == 1
    short, long = sorted((k, KEY), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def settings_of(additional_config) -> Settings | None:
    """The plugin's settings from vLLM's `additional_config` (None: the plugin is off). A key spelled
    nearly as "kvmerge", or "kvmerge" set to None, is refused: either would leave vLLM stock without a word."""
    if not isinstance(additional_config, dict):
        return None
    if KEY not in additional_config:
        near = [k for k in additional_config if isinstance(k, str) and _near_key(k)]
        if near:
            raise ValueError(f"kvmerge: additional_config has {near[0]!r}, not {KEY!r}: the plugin reads only "
                             f'"{KEY}" (with {near[0]!r} it would stay off)')
        return None
    raw = additional_config[KEY]
    if raw is None:
        raise ValueError(f'kvmerge: additional_config["{KEY}"] is None: give the settings ({{}} for the default '
                         f"method at budget 0.25), or leave the key out for stock vLLM")
    if not isinstance(raw, dict):
        raise ValueError(f'kvmerge: additional_config["kvmerge"] must be a dict like {{"method": "snapkv", '
                         f'"budget": 0.25}}, got {raw!r}')
    unknown = set(raw) - {"method", "budget", "imports"}
    if unknown:
        raise ValueError(f"kvmerge: unknown setting(s) {', '.join(sorted(unknown))}; "
                         "the settings are method, budget and imports")
    imports = raw.get("imports", [])
    if not isinstance(imports, (list, tuple)) or not all(isinstance(x, str) for x in imports):
        raise ValueError(f'kvmerge: "imports" must be a list of module names or .py paths, got {imports!r}')
    if not isinstance(raw.get("method"), str):
        raise ValueError(f'kvmerge: "method" must be a method spec string (kvmerge.available_methods()), or left '
                         f"out for the default, got {raw.get('method')!r}")
    budget = raw.get("budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))):
        raise ValueError(f"kvmerge: budget must be a float in (0, 1] or an int number of entries, got {budget!r}")
    if isinstance(budget, float) and not 0 < budget <= 1:
        raise ValueError(f"kvmerge: budget fraction must be in (0, 1], got {budget!r}")
    if isinstance(budget, int) and budget <= 0:
        raise ValueError(f"kvmerge: budget must be a float in (0, 1] (the fraction of each prompt's entries kept) or "
                         f"an int > 0 (the entries kept), got {budget!r}")
    return Settings(raw["method"], budget, tuple(imports))


def refusal(method: Method) -> str | None:
    """Why the plugin cannot run `method` (None: it can), every reason, from its declared needs
    (`VllmRuntime.refusals`). The plugin compresses each prompt once, after the prompt's prefill
    (inside each layer's attention, or after the last layer for methods that need each token's
    surprisal), with one slot count for every layer and head."""
    reasons = VllmRuntime.refusals(method)
    return "; and ".join(reasons) if reasons else None


def padded_head_size(head_size: int) -> int:
    """The smallest head size CPU_ATTN's kernel accepts with room for the log-mass channel."""
    fits = [s for s in KERNEL_HEAD_SIZES if s > head_size]
    if not fits:
        raise ValueError(f"kvmerge: head size {head_size} leaves no room for the log-mass channel in CPU_ATTN's "
                         f"kernel (largest {KERNEL_HEAD_SIZES[-1]})")
    return fits[0]


@dataclass(frozen=True)
class Layout:
    """Where a compressed prompt of `prompt` tokens lives in its request's blocks.

    The `kept` entries (per layer and KV head) are written right-aligned in the logical slots
    [`start`, `prompt`) with `start` = `freed` · block size; the `start`..`prompt` − `kept` slots before
    them are empty (log-mass −1000: zero attention). Blocks [0, `freed`) go back to vLLM's pool and
    attention reads the request's block table from block `freed` on, with `freed` · block size fewer
    tokens; decoded tokens keep landing at positions `prompt`, `prompt` + 1, ... (their true ones)."""

    prompt: int
    kept: int
    freed: int
    block_size: int

    @property
    def start(self) -> int:
        return self.freed * self.block_size

    @property
    def empty(self) -> int:
        """Slots in [start, prompt) before the kept entries, masked out."""
        return self.prompt - self.start - self.kept


def needs_channel(method: Method) -> bool:
    """Whether the cache needs the log-mass channel: `method` merges (`Needs.merges`: its entries are
    not plain tokens only, so it keeps exactly its target and may carry a log-mass) or spreads its
    budget globally (empty slots). `full` and methods that only select keep plain tokens: their cache
    keeps vLLM's head size and no slot is left empty."""
    return method.needs.merges or is_global(method)


def layout(method: Method, prompt: int, block_size: int) -> Layout:
    """The layout of a prompt of `prompt` tokens compressed by `method` in blocks of `block_size`.

    `kept` is `method.running_target(prompt)`: the budget, never below the protected sinks + window
    (a prompt too short for its budget keeps sinks + window entries instead of being refused; for
    prompts long enough this equals `method.target(prompt)`, what kvmerge's transformers runtime keeps).
    Without the log-mass channel (`needs_channel`) no slot can be masked, so the kept entries fill the
    first kept block: `kept` is rounded up to `prompt − freed · block_size`, at most `block_size − 1`
    more entries than the budget, in a block the request holds anyway."""
    kept = prompt if prompt <= 1 else method.running_target(prompt)
    freed = (prompt - kept) // block_size
    return Layout(prompt, kept if needs_channel(method) else prompt - freed * block_size, freed, block_size)


def check(vllm_config) -> Settings | None:
    """Validate the plugin's settings against vLLM's config: None when the plugin is off, else the
    settings; raises a ValueError naming the problem (and what to pass instead)."""
    additional = getattr(vllm_config, "additional_config", None)
    raw = additional.get(KEY) if isinstance(additional, dict) else None
    if isinstance(raw, dict) and "method" not in raw:  # the default, written into the config every process reads
        from ..defaults import default_method

        raw["method"] = default_method(vllm_config.model_config.hf_text_config, runtime="vllm")
    settings = settings_of(additional)
    if settings is None:
        return None
    try:
        method = settings.build()
    except (ValueError, TypeError) as e:
        raise ValueError(f"kvmerge: {str(e).removeprefix('kvmerge: ')}") from e
    reason = refusal(method)
    if reason is not None:
        raise ValueError(f"kvmerge: method {settings.method!r} cannot run inside vLLM yet: {reason}")
    model = vllm_config.model_config
    text = model.hf_text_config
    kind = getattr(text, "model_type", None)
    if getattr(model.hf_config, "is_encoder_decoder", False) or kind not in MODEL_TYPES:
        raise ValueError(f"kvmerge: unsupported model type {kind!r}: the vLLM plugin compresses decoder-only RoPE "
                         f"models whose layers all use full attention; supported: {', '.join(MODEL_TYPES)}")
    layer_types = set(getattr(text, "layer_types", None) or ["full_attention"])
    if getattr(text, "sliding_window", None) is not None or layer_types != {"full_attention"}:
        raise ValueError(f"kvmerge: model {kind!r} has sliding-window layers; their blocks are managed by vLLM's "
                         "sliding-window manager and would need their own layout (a hybrid model's sliding layers "
                         "are not compressed by kvmerge either): not supported by the plugin yet")
    padded_head_size(model.get_head_size())
    cache = vllm_config.cache_config
    if cache.enable_prefix_caching:
        raise ValueError("kvmerge: prefix caching is on: compression rewrites a prompt's blocks, which prefix caching "
                         "would share with other requests. Pass enable_prefix_caching=False "
                         "(vllm serve: --no-enable-prefix-caching)")
    if cache.cache_dtype not in ("auto", None) and not str(cache.cache_dtype).startswith(("float", "bfloat", "half")):
        raise ValueError(f"kvmerge: kv_cache_dtype={cache.cache_dtype!r}: quantized KV caches are not supported "
                         "(the log-mass channel needs a float cache)")
    if vllm_config.speculative_config is not None:
        raise ValueError("kvmerge: speculative decoding is not supported (draft tokens write and drop KV entries)")
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size * parallel.pipeline_parallel_size * parallel.data_parallel_size != 1:
        raise ValueError("kvmerge: the vLLM plugin runs one worker (tensor, pipeline and data parallel size 1)")
    if vllm_config.use_v2_model_runner:
        raise ValueError("kvmerge: vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1, or a Triton CPU backend) "
                         "is not supported; the plugin hooks the V1 runner")
    if parallel.worker_cls not in ("auto", STOCK_CPU_WORKER, WORKER):
        raise ValueError(f"kvmerge: a custom worker_cls ({parallel.worker_cls}) cannot be combined with the plugin")
    scheduler_cls = vllm_config.scheduler_config.scheduler_cls
    if scheduler_cls not in (None, SCHEDULER, "vllm.v1.core.sched.scheduler.Scheduler"):
        raise ValueError(f"kvmerge: a custom scheduler_cls ({scheduler_cls}) cannot be combined with the plugin")
    return settings
