"""The compressed-context file: safetensors, with the context's metadata as JSON.

Tensors: per layer `l{i}.keys` / `.values` `(1, kv_heads, n, head_dim)` and `.log_n` `(1, kv_heads, n)`
(a layer whose heads keep different counts: `l{i}.h{j}.keys` ... `(1, 1, n_j, head_dim)` and
`l{i}.live` `(kv_heads, width)`), a sliding layer's `l{i}.positions` `(1, n)`, each layer state's
`s{i}.targets` and scratch, the session's counters `seen` / `plain` / `captured` `(1,)`, and, when kept,
`context_ids` `(tokens,)` and `kept.{i}` `(kv_heads, slots)`.

The safetensors header holds `format`, `version`, `meta` (the JSON) and `digest`: a SHA-256 over the
JSON and every tensor's name, dtype, shape and bytes. A file whose digest does not match, or whose
tensors do not fit the model, hold a NaN or disagree with the metadata, is refused in one line
before any forward.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .errors import InputError, KVMergeError, one_line
from .files import written
from .layer import MergedLayer
from .sliding import SlidingLayer

FORMAT, VERSION = "kvmerge-context", 2  # 2: a checksum in every file (1: none)


class ContextFileError(KVMergeError, ValueError):
    """A compressed-context file that cannot be used here (corrupt, newer, another model...)."""


class NotAContextError(ContextFileError):
    """A file that is not a compressed context at all (text, or another safetensors file)."""


class OtherModelError(ContextFileError):
    """A compressed-context file made for another model or tokenizer."""


def digest(meta: str, tensors: dict) -> str:
    """SHA-256 (32 hex) of the metadata JSON and every CPU tensor's name, dtype, shape and bytes."""
    h = hashlib.sha256(meta.encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"\n{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()[:32]


def ids_hash(ids) -> str:
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:16]


def write(path, tensors: dict, meta: dict) -> Path:
    """Write `tensors` and `meta` to `path` whole (a temporary name, then renamed)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = Path(path)
    if path.is_dir() or not path.parent.is_dir():
        raise InputError(f"cannot save to {path}: " + ("it is a folder" if path.is_dir() else
                                                     f"no folder {str(path.parent)!r}"))
    replaceable(path, f"cannot save to {path}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    text = json.dumps(meta)
    try:
        with written(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": FORMAT, "version": str(VERSION), "meta": text,
                                                   "digest": digest(text, tensors)})
    except (OSError, SafetensorError) as e:
        raise InputError(f"cannot save to {path}: {one_line(e)}") from None
    return path


def _opened(path, take):
    """`take(f)` of the safetensors file at `path`; a `ContextFileError` when it is not a whole one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return take(f)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        extra = _bytes_after_end(path)
        if extra:
            raise ContextFileError(f"{path} has {extra:,} bytes after its end (something was appended to it): "
                                   "compress the context again") from None
        raise ContextFileError(f"{path} is cut off or corrupt (not a whole safetensors file: {e})") from None


def _bytes_after_end(path) -> int:
    """How many bytes `path` holds beyond the end its safetensors header declares (0 when none or unreadable)."""
    try:
        total = Path(path).stat().st_size
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if size > total:
                return 0
            header = json.loads(f.read(size))
        end = 8 + size + max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        return max(total - end, 0)
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return 0


def replaceable(path, what: str) -> bool:
    """True when `path` holds a compressed context that writing it would replace, False when there is
    nothing to lose (no file, or an empty one); an `InputError` starting with `what` for any other file."""
    path = Path(path)
    if not path.is_file() or not path.stat().st_size:
        return False
    try:
        check_file(path)
    except (KVMergeError, OSError) as e:
        ours = isinstance(e, ContextFileError) and not isinstance(e, NotAContextError)
        kind = (f"a compressed context this kvmerge cannot read ({one_line(str(e).removeprefix(f'{path} '))})" if ours
                else "not a compressed context")
        raise InputError(f"{what}: it exists and is {kind}, which saving will not overwrite; give another name, or "
                         "remove it") from None
    return True


def check_file(path) -> dict:
    """The metadata of a compressed-context file, read without its tensors; a `ContextFileError` when
    it is missing, not a whole safetensors file, not a kvmerge context or of a newer format."""
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path} is a folder, not a compressed-context file (kvmerge compress --out writes one)")
    if not path.is_file():
        raise InputError(f"no compressed-context file {str(path)!r} (kvmerge compress --out writes one)")
    with path.open("rb") as f:
        start = f.read(9)
    if len(start) == 9 and start[8:9] != b"{":  # a safetensors file opens with its header's length, then JSON
        raise NotAContextError(f"{path} is not a compressed-context file (kvmerge compress --out writes one; a text "
                               "file goes to kvmerge generate --context)")
    head = _opened(path, lambda f: f.metadata() or {})
    if head.get("format") != FORMAT:
        raise NotAContextError(f"{path} is not a compressed-context file (a safetensors file, but not one kvmerge "
                               "compress --out wrote)")
    if not str(head.get("version", "")).isdigit():
        raise ContextFileError(f"{path} is damaged: its format version {head.get('version')!r} is not a number")
    if int(head["version"]) > VERSION:
        raise ContextFileError(f"{path} is format version {head['version']}, newer than this kvmerge reads "
                               f"({VERSION}): upgrade kvmerge")
    return head


REQUIRED = {"model": str, "tokenizer": str, "tokens": int, "dtype": str, "layers": list, "states": list,
            "method": str, "budget": (int, float), "ids_hash": str, "chat_template": bool, "full_bytes": int}


def metadata(path, head: dict) -> dict:
    """The file's metadata JSON (from `check_file`'s header), refused unless it holds every field a
    compressed context needs, of its type."""
    try:
        meta = json.loads(head["meta"])
        if not isinstance(meta, dict):
            raise TypeError(f"it is a {type(meta).__name__}")
        for key, kind in REQUIRED.items():
            if isinstance(meta[key], bool) and kind is not bool or not isinstance(meta[key], kind):
                raise TypeError(f"{key} is a {type(meta[key]).__name__}")
        sample = meta.get("weights_sample")  # optional: files written before it, weights it could not read
        if sample is not None and not (isinstance(sample, list) and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) for x in sample)):
            raise TypeError("weights_sample is not a list of numbers")
    except (KeyError, TypeError, ValueError) as e:
        raise ContextFileError(f"{path} is damaged: its metadata is not a compressed context's "
                               f"({type(e).__name__}: {one_line(e)})") from None
    return meta


def read(path, head: dict) -> tuple[dict, dict]:
    """The tensors (on the CPU) and metadata of the file `check_file` accepted, the digest checked."""
    tensors = _opened(path, lambda f: {k: f.get_tensor(k) for k in f.keys()})
    if "digest" not in head and int(head["version"]) >= 2:
        raise ContextFileError(f"{path} is damaged: its checksum is missing (format version {head['version']} writes "
                               "one); compress the context again")
    if "digest" in head and digest(head.get("meta", ""), tensors) != head["digest"]:
        raise ContextFileError(f"{path} is damaged: its contents changed after it was saved (the checksum does not "
                               "match); compress the context again")
    meta = metadata(path, head)
    if not isinstance(getattr(torch, meta["dtype"], None), torch.dtype) or not getattr(torch, meta["dtype"]).is_floating_point:
        raise ContextFileError(f"{path} is damaged: its dtype {meta['dtype']!r} is not a floating-point torch dtype")
    stored = getattr(torch, meta["dtype"])
    for name, t in tensors.items():
        kind = name.rsplit(".", 1)[-1]
        if kind in ("keys", "values") and t.dtype != stored:
            raise ContextFileError(f"{path} is damaged: {name} is {str(t.dtype).removeprefix('torch.')}, its metadata "
                                   f"says {meta['dtype']}")
        if kind not in ("keys", "values", "log_n"):
            continue
        finite = torch.isfinite(t) if kind != "log_n" else t.isfinite() | (t == float("-inf"))  # -inf: an empty slot
        if not bool(finite.all()):
            raise ContextFileError(f"{path} is damaged: {name} holds a NaN or an infinity")
    for name in ("seen", "plain", "captured"):
        t = tensors.get(name)
        if t is None or t.shape != (1,) or t.is_floating_point() or not 0 <= int(t[0]) <= meta["tokens"]:
            raise ContextFileError(f"{path} is damaged: its counter {name} is not a position within its "
                                   f"{meta['tokens']:,} tokens")
    for name, t in tensors.items():
        if name.startswith("kept.") and (t.is_floating_point() or t.numel() and not (-2 <= int(t.min()) and
                                                                                      int(t.max()) < meta["tokens"])):
            raise ContextFileError(f"{path} is damaged: {name} names positions outside its {meta['tokens']:,} tokens")
    if "context_ids" in tensors:
        ids = tensors["context_ids"]
        if ids.dim() != 1 or len(ids) != meta["tokens"] or ids_hash(ids.tolist()) != meta["ids_hash"]:
            raise ContextFileError(f"{path} is damaged: its context_ids are not the {meta['tokens']:,} tokens it was "
                                   "compressed from (their hash differs)")
    return tensors, meta


def _tensor(tensors: dict, name: str, shape: tuple, path, whose: str = "for this model it") -> torch.Tensor:
    """`tensors[name]`, refused unless it is there with `shape` (None: any size)."""
    if name not in tensors:
        raise ContextFileError(f"{path} is damaged: it has no tensor {name}")
    t = tensors[name]
    if t.dim() != len(shape) or any(want is not None and have != want for have, want in zip(t.shape, shape)):
        raise ContextFileError(f"{path} is damaged: {name} has shape {tuple(t.shape)}, {whose} must be "
                               f"({', '.join('n' if s is None else str(s) for s in shape)})")
    return t


# -- layers and states, out and in ----------------------------------------------------------------
def layer_out(layer, prefix: str, tensors: dict) -> dict:
    meta = {"type": type(layer).__name__, "seen": layer.seen}
    if layer.heads is not None:
        tensors[prefix + "live"] = layer._live
        meta["kept"] = list(layer._kept)
        meta["heads"] = [layer_out(head, f"{prefix}h{i}.", tensors) for i, head in enumerate(layer.heads)]
    else:
        for name in ("keys", "values", "log_n"):
            if getattr(layer, name) is not None:
                tensors[prefix + name] = getattr(layer, name)
    if isinstance(layer, SlidingLayer):
        meta.update(window=layer.window, held=layer.held)
        if layer.positions is not None:
            tensors[prefix + "positions"] = layer.positions
    return meta


def layer_in(layer, meta: dict, prefix: str, tensors: dict, device, shape: tuple, path) -> None:
    """Fill `layer` from the file; `shape` is the model's `(kv_heads, head_dim)` for this layer."""
    if type(layer).__name__ != meta["type"] or (isinstance(layer, SlidingLayer) and layer.window != meta["window"]):
        def kind(name, window):
            return f"{name} (window {window})" if window is not None else name
        raise ContextFileError(f"{path}'s layer {prefix[1:-1]} is a {kind(meta['type'], meta.get('window'))}, the "
                               f"model's a {kind(type(layer).__name__, getattr(layer, 'window', None))}")
    heads, dim = shape
    layer.is_initialized, layer.device = True, device
    if "heads" in meta:
        if len(meta["heads"]) != heads or len(meta["kept"]) != heads:
            raise ContextFileError(f"{path} is damaged: layer {prefix[1:-1]} stores {len(meta['heads'])} heads, "
                                   f"this model's has {heads}")
        parts = []
        for i, m in enumerate(meta["heads"]):
            head = MergedLayer()
            layer_in(head, m, f"{prefix}h{i}.", tensors, device, (1, dim), path)
            parts.append(head)
        live = _tensor(tensors, prefix + "live", (heads, None), path)
        extra = {head.keys.shape[2] - k for head, k in zip(parts, meta["kept"])}  # slots appended after compression
        if live.dtype != torch.bool or live.sum(1).tolist() != meta["kept"] or len(extra) != 1 or min(extra) < 0:
            raise ContextFileError(f"{path} is damaged: layer {prefix[1:-1]}'s heads do not hold the entries its "
                                   f"slot map ({prefix}live) and counts say")
        layer.heads, layer._live, layer._kept = parts, live, meta["kept"]
        layer._keys = layer._values = layer._log_n = None
        layer._length = 0
    else:
        keys = _tensor(tensors, prefix + "keys", (1, heads, None, dim), path)
        n = keys.shape[2]
        whose = f"to match {prefix}keys it"
        values = _tensor(tensors, prefix + "values", (1, heads, n, dim), path, whose)
        log_n = _tensor(tensors, prefix + "log_n", (1, heads, n), path, whose) if prefix + "log_n" in tensors else None
        layer.replace(keys, values, log_n, fit=True)
    if isinstance(layer, SlidingLayer):
        layer.held, layer.positions = meta["held"], tensors.get(prefix + "positions")
    layer.seen = meta["seen"]


def state_out(state, prefix: str, tensors: dict, scratch: bool) -> dict:
    meta = {"compressed_at": state.compressed_at, "scaling": state.scaling, "extra": state.extra, "scratch": {}}
    if state.targets is not None:
        tensors[prefix + "targets"] = state.targets
    for key, value in (state.scratch if scratch else {}).items():
        if isinstance(value, torch.Tensor):
            tensors[f"{prefix}scratch.{key}"] = value
            meta["scratch"][key] = None
        else:
            try:
                meta["scratch"][key] = json.loads(json.dumps(value))
            except TypeError:
                raise InputError(f"this method keeps state that cannot be saved ({key}: {type(value).__name__})") from None
    return meta


def state_in(state, meta: dict, prefix: str, tensors: dict) -> None:
    for key, kind in (("compressed_at", int), ("scaling", (int, float)), ("extra", int)):
        if isinstance(meta[key], bool) or not isinstance(meta[key], kind):
            raise TypeError(f"layer state {prefix[1:-1]}'s {key} is {meta[key]!r}")
    state.compressed_at, state.scaling, state.extra = meta["compressed_at"], meta["scaling"], meta["extra"]
    state.targets = tensors[prefix + "targets"].cpu() if prefix + "targets" in tensors else None
    state.scratch = {k: tensors[f"{prefix}scratch.{k}"] if v is None else v for k, v in meta["scratch"].items()}
