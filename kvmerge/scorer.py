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
from dataclasses import dataclass
from pathlib import Path

import torch

from .ops.scores import rotate_half

SHIPPED = Path(__file__).parent / "scorers"


def fingerprint(config) -> str:
    """What identifies a model's attention for the scorer: its type and attention shapes (12 hex)."""
    c = config.get_text_config(decoder=True)
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "intermediate_size")
    return hashlib.sha256(json.dumps({k: getattr(c, k, None) for k in keys}).encode()).hexdigest()[:12]


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `(..., n, d)` rotated by RoPE at positions with (cos, sin) `(n, d)` → x before the rotation."""
    return x * cos - rotate_half(x) * sin


def features(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE queries `(b, hq, n, d)`, keys and values `(b, h, n, d)` → `(b, n, (hq + 2h)·d)` float32."""
    b, _, n, _ = keys.shape
    return torch.cat([x.float().transpose(1, 2).reshape(b, n, -1) for x in (queries, keys, values)], -1)


class Scorer:
    """What both kinds share: `model` (the model's `fingerprint`), `meta` (how it was trained: texts,
    tokens, seed, fit on held-back texts), `tensors()` / `from_tensors` for safetensors, and
    `from_features(layer, x)`: features `(..., F)` → predicted log scores `(..., h)`."""

    kind: str
    model: str
    meta: dict

    def predict(self, layer: int, queries, keys, values) -> torch.Tensor:
        """Pre-RoPE queries `(b, hq, n, d)`, keys, values `(b, h, n, d)` of compressed layer `layer` →
        predicted log KVzip scores `(b, h, n)`, at most 0 (a probability's log)."""
        return self.from_features(layer, features(queries, keys, values)).clamp_max(0.0).transpose(1, 2)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors().items()}, str(path),
                  metadata={"model": self.model, "kind": self.kind, "meta": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: Path) -> Scorer:
        """The scorer in `path`, of the kind its metadata names (files without one are linear)."""
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        kind = KINDS[meta.get("kind", "linear")]
        return kind.from_tensors(tensors, meta["model"], json.loads(meta["meta"]))


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

    @classmethod
    def from_tensors(cls, tensors: dict, model: str, meta: dict) -> LinearScorer:
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

    @classmethod
    def from_tensors(cls, tensors: dict, model: str, meta: dict) -> MLPScorer:
        n = len(tensors) // len(cls.PARTS)
        return cls([{k: tensors[f"layer{i}.{k}"] for k in cls.PARTS} for i in range(n)], model, meta)


KINDS = {"linear": LinearScorer, "mlp": MLPScorer}


def trained_path(config, kind: str = "linear") -> Path:
    """Where `kvmerge train-scorer` writes a model's weights: `<cache dir>/scorers/<fingerprint>.safetensors`
    (`<fingerprint>-mlp.safetensors` for an MLP)."""
    from .model import cache_dir

    return cache_dir() / "scorers" / (f"{fingerprint(config)}" + ("" if kind == "linear" else f"-{kind}") + ".safetensors")


def find(config, kind: str = "linear") -> Scorer:
    """The scorer of `kind` for the model with `config`: trained here (`trained_path`), in a folder of
    `$KVMERGE_SCORERS` (os.pathsep-separated) or shipped with kvmerge; a ValueError saying how to
    train one when there is none."""
    import os

    if kind not in KINDS:
        raise ValueError(f"no scorer kind {kind!r}; kinds: {', '.join(KINDS)}")
    key = fingerprint(config)
    folders = [Path(p) for p in os.environ.get("KVMERGE_SCORERS", "").split(os.pathsep) if p] + [SHIPPED]
    from safetensors import safe_open

    for path in (trained_path(config, kind), *(p for folder in folders for p in sorted(folder.glob("*.safetensors")))):
        if path.exists():
            with safe_open(str(path), "pt") as f:  # the metadata only: is it this model's, of this kind?
                meta = f.metadata()
            if meta.get("model") == key and meta.get("kind", "linear") == kind:
                return Scorer.load(path)
    name = getattr(config, "name_or_path", "") or config.get_text_config(decoder=True).model_type
    flag = "" if kind == "linear" else f" --kind {kind}"
    raise ValueError(f"no learned {kind} scorer for this model ({name}, fingerprint {key}): train one with "
                     f"`kvmerge train-scorer --model <the model's name or path>{flag}` (about 15 minutes on a CPU)")
