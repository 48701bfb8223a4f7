"""A learned stand-in for KVzip's score: per compressed layer, a small model from what the layer's
attention already has at prefill (each token's pre-RoPE queries, key and value) to the log of the
score KVzip would give the token in every KV head (the highest attention it gets while the model
repeats the context). Queries, keys and values are linear in the layer's normalised input, so these
are KVzap's (kvpress) surrogates, fitted on what vLLM's attention layer sees too. Two kinds:

* "linear" (`LinearScorer`): a ridge regression, one `(F + 1, h)` matrix per compressed layer
  (F = (hq + 2 h) · d features, then a bias);
* "mlp" (`MLPScorer`): one hidden layer of GELUs on standardised features, as KVzap's MLP.

Stored with safetensors. The bundled models' weights ship in `kvmerge/scorers/`; `kvmerge
train-scorer --model NAME [--kind mlp]` fits them (kvmerge/train_scorer.py) and writes them under the
cache dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError, one_line

SHIPPED = Path(__file__).parent / "scorers"


def fingerprint(config) -> str:
    """What identifies a model's attention for the scorer and its compressed contexts (12 hex): its type,
    attention shapes and, on a model with sliding-window layers, each layer's window (None: full)."""
    return fingerprints(config)[0]


def fingerprints(config) -> tuple[str, ...]:
    """(`fingerprint`, and the one files written before it held the windows when it differs): what a
    weights file or a compressed context made for this model may name."""
    from .sliding import layer_windows

    c = config.get_text_config(decoder=True)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "intermediate_size")
    fields = {k: getattr(c, k, None) for k in keys}
    try:
        windows = layer_windows(config)
    except (ValueError, TypeError, AttributeError, KeyError):  # a layer kvmerge refuses elsewhere, naming it
        windows = []
    shapes = hashlib.sha256(json.dumps(fields).encode()).hexdigest()[:12]
    if not any(w is not None for w in windows):  # full attention throughout: the shapes say it all
        return (shapes,)
    return hashlib.sha256(json.dumps({**fields, "windows": windows}).encode()).hexdigest()[:12], shapes


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `(..., n, d)` rotated by RoPE at positions with (cos, sin) `(n, d)` → x before the rotation:
    x·cos − rotate_half(x)·sin, on the halves [x1, x2] → [x1·c1 + x2·s1, x2·c2 − x1·s2]."""
    half = x.shape[-1] // 2
    (x1, x2), (c1, c2), (s1, s2) = (t.split(half, -1) for t in (x, cos, sin))
    return torch.cat([torch.addcmul(x1 * c1, x2, s1), torch.addcmul(x2 * c2, x1, s2, value=-1)], -1)


def features(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE queries `(b, hq, n, d)`, keys and values `(b, h, n, d)` → `(b, n, (hq + 2h)·d)` float32."""
    b, _, n, _ = keys.shape
    # every size spelled out: n may be 0 (a row whose prompt ended in an earlier chunk)
    return torch.cat([x.float().transpose(1, 2).reshape(b, n, x.shape[1] * x.shape[3]) for x in (queries, keys, values)], -1)


class Scorer:
    """What both kinds share: `model` (the model's `fingerprint`), `meta` (how it was trained: texts,
    tokens, seed, fit on held-back texts), `tensors()` / `from_tensors` for safetensors, and
    `from_features(layer, x)`: features `(..., F)` → predicted log scores `(..., h)`."""

    kind: str
    model: str
    meta: dict

    calibration: tuple[torch.Tensor, torch.Tensor] | None = None  # (xs, ys) `(layers, h, K)`: see `calibrated`

    def predict(self, layer: int, queries, keys, values) -> torch.Tensor:
        """Pre-RoPE queries `(b, hq, n, d)`, keys, values `(b, h, n, d)` of compressed layer `layer` →
        predicted log KVzip scores `(b, h, n)`, at most 0 (a probability's log)."""
        raw = self.from_features(layer, features(queries, keys, values))
        return self.calibrated(layer, raw).clamp_max(0.0).transpose(1, 2)

    def calibrated(self, layer: int, p: torch.Tensor) -> torch.Tensor:
        """The model's outputs `(..., h)` → log KVzip scores. Without `calibration` they are the log scores
        (a model fitted on them); with it (a model fitted on each head's rank), each head's output goes
        through a monotone piecewise-linear map from its K output quantiles `xs` to KVzip's log-score
        quantiles `ys`: the order within a head is the model's, the scale across heads and layers KVzip's
        (what a global allocation compares). Below the lowest quantile the lowest score, above the highest
        the highest."""
        if self.calibration is None:
            return p
        xs, ys = (t[layer].to(p.device, torch.float32) for t in self.calibration)  # (h, K)
        flat = p.reshape(-1, p.shape[-1]).T.contiguous()  # (h, N)
        i = torch.searchsorted(xs.contiguous(), flat).clamp(1, xs.shape[-1] - 1)
        x0, x1, y0, y1 = (t.gather(-1, j) for t, j in ((xs, i - 1), (xs, i), (ys, i - 1), (ys, i)))
        out = y0 + (flat - x0).clamp_min(0) * (y1 - y0) / (x1 - x0).clamp_min(1e-6)
        return torch.minimum(out, ys[:, -1:]).T.reshape(p.shape)

    def save(self, path: Path) -> None:
        """Write the weights to `path` whole: into a temporary file beside it, then renamed over it, so
        that a run stopped mid-write leaves no half-written weights where `find` looks."""
        from safetensors.torch import save_file

        from .files import written

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = self.tensors()
        if self.calibration is not None:
            tensors.update({"calibration.x": self.calibration[0], "calibration.y": self.calibration[1]})
        with written(path) as tmp:
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp),
                      metadata={"model": self.model, "kind": self.kind, "meta": json.dumps(self.meta)})

    def shape(self) -> tuple[int, int, int]:
        """(compressed layers, features per token, KV heads) the weights are for."""
        raise NotImplementedError

    @classmethod
    def load(cls, path: Path, config=None) -> Scorer:
        """The scorer in `path`, of the kind its metadata names (files without one are linear). With the
        model's `config`, weights made for another model (fingerprint or shapes) are refused, naming
        both. A truncated or corrupt file, or one `kvmerge train-scorer` did not write, is refused
        naming the file (an `InputError`), before any tensor is used."""
        path = Path(path)
        meta, tensors = _read(path)
        kind = meta.get("kind", "linear")
        if kind not in KINDS:
            raise InputError(f"scorer weights {path} are of an unknown kind {kind!r} (kinds: {', '.join(KINDS)}): "
                             "not a file this kvmerge wrote; train them again with `kvmerge train-scorer`")
        try:
            extra = json.loads(meta.get("meta", "{}"))
            calibration = tuple(tensors.pop(f"calibration.{k}") for k in "xy" if f"calibration.{k}" in tensors)
            scorer = KINDS[kind].from_tensors(tensors, meta["model"], extra)
            layers, _, heads = scorer.shape()
            if calibration:
                if len(calibration) != 2 or calibration[0].shape != calibration[1].shape \
                        or calibration[0].ndim != 3 or calibration[0].shape[:2] != (layers, heads) \
                        or calibration[0].shape[2] < 2:
                    raise ValueError(f"calibration of shapes {[tuple(t.shape) for t in calibration]}, expected two "
                                     f"({layers}, {heads}, K), K >= 2")
                scorer.calibration = calibration
        except (KeyError, IndexError, ValueError, TypeError, RuntimeError) as e:
            raise InputError(f"scorer weights {path} are incomplete or corrupt ({type(e).__name__}: {one_line(e)}): "
                             "delete them and train them again with `kvmerge train-scorer --model <the model>`") from None
        if config is not None:
            scorer.check(config, path)
        return scorer

    def check(self, config, path: Path | str = "") -> None:
        """Refuse (`InputError`, naming both) unless these weights were made for the model with `config`:
        its fingerprint and its attention's shapes."""
        mine = model_shape(config)
        if self.model in fingerprints(config) and self.shape() == mine:
            return
        name = model_label(config, "")
        theirs = self.meta.get("model_name") or (Path(path).stem.removesuffix("-mlp") if Path(path).parent == SHIPPED
                                                   else None)
        raise InputError(f"scorer weights {path or '(in memory)'} were made for another model "
                         f"({_describe(theirs, self.model, self.shape())}), not for this one "
                         f"({_describe(name, fingerprint(config), mine)}): train this model's with "
                         f"`kvmerge train-scorer --model {name or 'PATH'}`")


@dataclass
class LinearScorer(Scorer):
    """`weights[i]` `(F + 1, h)`: compressed layer i's ridge weights (bias last)."""

    weights: list[torch.Tensor]
    model: str
    meta: dict
    kind = "linear"

    def from_features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        w = self.weights[layer].to(x.device)
        return x @ w[:-1] + w[-1]

    def tensors(self) -> dict:
        return {f"layer{i}": w for i, w in enumerate(self.weights)}

    def shape(self) -> tuple[int, int, int]:
        sizes = {tuple(w.shape) for w in self.weights}
        if len(sizes) != 1 or len(next(iter(sizes))) != 2:
            raise ValueError(f"layer weights of shapes {sorted(sizes)}, expected one (features + 1, heads)")
        rows, heads = next(iter(sizes))
        return len(self.weights), rows - 1, heads

    @classmethod
    def from_tensors(cls, tensors: dict, model: str, meta: dict) -> LinearScorer:
        if not tensors:
            raise ValueError("no tensors")
        return cls([tensors[f"layer{i}"] for i in range(len(tensors))], model, meta)


@dataclass
class MLPScorer(Scorer):
    """`layers[i]`: compressed layer i's network, GELU(((x − mu) / sd) w1 + b1) w2 + b2 with `mu`, `sd`
    `(F,)`, `w1` `(F, H)`, `b1` `(H,)`, `w2` `(H, h)`, `b2` `(h,)` (stored in float16, run in float32)."""

    layers: list[dict[str, torch.Tensor]]
    model: str
    meta: dict
    kind = "mlp"
    PARTS = ("mu", "sd", "w1", "b1", "w2", "b2")

    def from_features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = {k: v.to(x.device, torch.float32) for k, v in self.layers[layer].items()}
        hidden = torch.nn.functional.gelu(((x - p["mu"]) / p["sd"]) @ p["w1"] + p["b1"])
        return hidden @ p["w2"] + p["b2"]

    def tensors(self) -> dict:
        return {f"layer{i}.{k}": v.half() for i, layer in enumerate(self.layers) for k, v in layer.items()}

    def shape(self) -> tuple[int, int, int]:
        sizes = {tuple(tuple(p[k].shape) for k in self.PARTS) for p in self.layers}
        if len(sizes) != 1:
            raise ValueError(f"layers of different shapes {sorted(sizes)}")
        shapes = dict(zip(self.PARTS, next(iter(sizes))))
        (features,), (hidden,), (heads,) = shapes["mu"], shapes["b1"], shapes["b2"]
        expected = dict(mu=(features,), sd=(features,), w1=(features, hidden), b1=(hidden,), w2=(hidden, heads),
                        b2=(heads,))
        if shapes != expected:
            raise ValueError(f"parts of shapes {shapes} do not chain from {features} features")
        if not all(v.is_floating_point() for p in self.layers for v in p.values()):
            raise ValueError("parts that are not floating point")
        return len(self.layers), features, heads

    @classmethod
    def from_tensors(cls, tensors: dict, model: str, meta: dict) -> MLPScorer:
        n = len(tensors) // len(cls.PARTS)
        if not n or n * len(cls.PARTS) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors, not {len(cls.PARTS)} per layer")
        return cls([{k: tensors[f"layer{i}.{k}"] for k in cls.PARTS} for i in range(n)], model, meta)


KINDS = {"linear": LinearScorer, "mlp": MLPScorer}


def model_shape(config) -> tuple[int, int, int]:
    """(compressed layers, features per token, KV heads) a scorer for the model with `config` has: its
    full-attention layers, (query heads + 2 × KV heads) × head size, its KV heads."""
    from .sliding import layer_windows

    c = config.get_text_config(decoder=True)
    d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    layers = sum(1 for w in layer_windows(config) if w is None)
    return layers, (c.num_attention_heads + 2 * c.num_key_value_heads) * d, c.num_key_value_heads


def model_label(config, missing: str = "PATH") -> str:
    """How files and advice name the model with `config`: its folder's resolved path (found again from
    any folder), else its name (a hub id), else `missing` (a model built in memory has neither)."""
    name = str(getattr(config, "name_or_path", "") or "")
    if not name:
        return missing
    return str(Path(name).expanduser().resolve()) if Path(name).expanduser().exists() else name


def _describe(name: str | None, key: str, shape: tuple[int, int, int]) -> str:
    layers, features, heads = shape
    return (f"{name + ', ' if name else ''}fingerprint {key}, {layers} layers of {features} features "
            f"to {heads} KV heads")


def _read(path: Path, tensors: bool = True, anonymous: bool = False) -> tuple[dict, dict]:
    """(metadata, tensors) of the safetensors file `path` (no tensors read unless `tensors`); an
    `InputError` naming the file when it is missing, truncated or corrupt, or names no model (with
    `anonymous`, such a file's metadata is returned as it is)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            out = {k: f.get_tensor(k) for k in f.keys()} if tensors else {}
    except FileNotFoundError:
        raise InputError(f"no scorer weights file {path}") from None
    except (PermissionError, IsADirectoryError) as e:
        raise InputError(f"cannot read the scorer weights {path} ({one_line(e)})") from None
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        reason = one_line(e).removeprefix("Error while deserializing header: ")
        raise InputError(f"scorer weights {path} are truncated or corrupt, not a whole safetensors file ({reason}): "
                         "delete the file and train them again with `kvmerge train-scorer --model <the model>`") from None
    if "model" not in meta and not anonymous:
        raise InputError(f"scorer weights {path} name no model in their metadata: not a file `kvmerge train-scorer` "
                         "wrote")
    return meta, out


def check_destination(out: Path | None) -> None:
    """Refuse, before any training, a weights file `train-scorer` could not write or must not replace:
    `out` (None: the cache's scorers folder) in a folder this process cannot write, or an existing
    file that is not scorer weights (a model's own weights, say)."""
    import os

    from .model import cache_dir

    folder = out.parent if out is not None else cache_dir() / "scorers"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot make the folder {folder} for the scorer's weights ({one_line(e)}): "
                         + ("give --out in a folder you can write" if out is not None else
                            "set KVMERGE_CACHE to a folder you can write, or give --out")) from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"cannot write in {folder}: give --out in a folder you can write"
                         + ("" if out is not None else ", or set KVMERGE_CACHE"))
    if out is not None and out.exists():
        try:
            _read(out, tensors=False)
        except InputError as e:
            raise InputError(f"--out {out} exists and is not scorer weights `kvmerge train-scorer` wrote "
                             f"({one_line(e)}): give a new file name (it would be overwritten)") from None


TRAINING_TIME = "4–8 minutes for the bundled models on 2 CPU cores, more in proportion to a model's prefill"


def trained_path(model, kind: str = "linear") -> Path:
    """Where `kvmerge train-scorer` writes the weights for a model (its config, or its fingerprint):
    `<cache dir>/scorers/<fingerprint>.safetensors` (`<fingerprint>-mlp.safetensors` for an MLP)."""
    from .model import cache_dir

    key = model if isinstance(model, str) else fingerprint(model)
    return cache_dir() / "scorers" / (key + ("" if kind == "linear" else f"-{kind}") + ".safetensors")


def find(config, kind: str = "linear") -> Scorer:
    """The scorer of `kind` for the model with `config`: trained here (`trained_path`), in a folder of
    `$KVMERGE_SCORERS` (os.pathsep-separated) or shipped with kvmerge; an `InputError` saying how to
    train one when there is none. The file at `trained_path` must be this model's (it is named by its
    fingerprint): one whose metadata names another model is refused, naming both; elsewhere files of
    other models are passed over, and one naming this model is checked against its shapes."""
    if kind not in KINDS:
        raise InputError(f"no scorer kind {kind!r}; kinds: {', '.join(KINDS)}")
    path = locate(config, kind)
    if path is None:
        key, name = fingerprint(config), model_label(config)
        flag = "" if kind == "linear" else f" --kind {kind}"
        raise InputError(f"no learned {kind} scorer for this model ({model_label(config, 'unnamed')}, fingerprint {key}): "
                         "train one with "
                         f"`kvmerge train-scorer --model {name}{flag}` ({TRAINING_TIME})")
    return Scorer.load(path, config)


def search_folders() -> list[Path]:
    """The folders `find` reads beyond `trained_path`: those of `$KVMERGE_SCORERS` (os.pathsep-separated;
    an entry may name a weights file instead), then the shipped weights'."""
    import os

    return [Path(p) for p in os.environ.get("KVMERGE_SCORERS", "").split(os.pathsep) if p] + [SHIPPED]


_skipped: set[Path] = set()  # damaged files and missing folders among the candidates, already reported


def _weights_in(entry: Path) -> list[Path]:
    """The weights files of a folder searched (an entry of `$KVMERGE_SCORERS` may also name one file);
    an entry that is neither is said once and passed over."""
    if entry.is_dir():
        return sorted(entry.glob("*.safetensors"))
    if entry.is_file():
        return [entry]
    if entry not in _skipped:
        _skipped.add(entry)
        logging.getLogger("kvmerge").warning(f"kvmerge: KVMERGE_SCORERS names {entry}, which is not a folder or a file: "
                                             "skipped")
    return []


def locate(config, kind: str = "linear") -> Path | None:
    """The weights file `find` would load for the model with `config` (None: there is none). Reads
    metadata only, except for a file naming the fingerprint before layer windows counted (another
    model's now, when it attends in full throughout): loaded and passed over unless it fits. A damaged
    file among the candidates is skipped with one logged line; a file at `trained_path` made for
    another model, or of another kind, is refused naming both."""

    keys = fingerprints(config)
    for key in keys:  # trained here: named by the fingerprint (or by the one before layer windows counted)
        own = trained_path(key, kind)
        if not own.exists() or (key != keys[0] and not _fits(own, config)):
            continue
        meta, _ = _read(own, tensors=False)
        if meta.get("kind", "linear") != kind:
            raise InputError(f"scorer weights {own} are a {meta.get('kind', 'linear')} scorer, not {kind}: "
                             f"train them again with `kvmerge train-scorer --kind {kind}`")
        if meta.get("model") != key:
            Scorer.load(own, config)  # refused, naming both models, unless they fit this one
        return own
    found = []  # this model's files of this kind, in the order searched; the shipped folder's once one is found
    for path in (p for folder in search_folders() for p in _weights_in(folder)):
        if found and path.parent == SHIPPED:
            break
        try:
            meta, _ = _read(path, tensors=False, anonymous=True)  # is it this model's, of this kind?
        except InputError as e:  # another file's damage is not this model's: skipped, said once
            if path not in _skipped:
                _skipped.add(path)
                logging.getLogger("kvmerge").warning(f"kvmerge: skipped {e}")
            continue
        if meta.get("model") in keys and meta.get("kind", "linear") == kind \
                and (meta["model"] == keys[0] or _fits(path, config)):
            if path.parent == SHIPPED:
                return path
            found.append(path)
    if len(found) > 1 and tuple(found) not in _told:
        _told.add(tuple(found))
        logging.getLogger("kvmerge").warning(f"kvmerge: {len(found)} weights files for this model in $KVMERGE_SCORERS: "
                                             f"{found[0]} is read (the first in its order), not "
                                             f"{', '.join(map(str, found[1:]))}")
    return found[0] if found else None


_told: set[tuple] = set()  # sets of this model's files found together, already said


def _fits(path: Path, config) -> bool:
    """Whether the weights in `path` load for the model with `config`."""
    try:
        Scorer.load(path, config)
    except InputError:
        return False
    return True
