"""A learned stand-in for KVzip's score: per compressed layer, a ridge regression from what the layer's
attention already has at prefill (each token's pre-RoPE queries, key and value) to the log of the
score KVzip would give the token in every KV head (the highest attention it gets while the model
repeats the context). Queries, keys and values are linear in the layer's normalised input, so this is
the linear surrogate of KVzap (kvpress), fitted on what vLLM's attention layer sees too.

Weights: one `(F + 1, h)` matrix per compressed layer (F = (hq + 2 h) · d features, then a bias),
stored with safetensors. The bundled models' weights ship in `kvmerge/scorers/`; `kvmerge
train-scorer --model NAME` fits them (kvmerge/train_scorer.py) and writes them under the cache dir.
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


@dataclass
class LinearScorer:
    """`weights[i]` `(F + 1, h)`: compressed layer i's ridge weights (bias last); `model`: the model's
    `fingerprint`; `meta`: how it was trained (texts, tokens, seed, ridge, fit on held-back texts)."""

    weights: list[torch.Tensor]
    model: str
    meta: dict

    def predict(self, layer: int, queries, keys, values) -> torch.Tensor:
        """Pre-RoPE queries `(b, hq, n, d)`, keys, values `(b, h, n, d)` of compressed layer `layer` →
        predicted log KVzip scores `(b, h, n)`, at most 0 (a probability's log)."""
        w = self.weights[layer].to(keys.device)
        x = features(queries, keys, values)
        return (x @ w[:-1] + w[-1]).clamp_max(0.0).transpose(1, 2)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({f"layer{i}": w.contiguous() for i, w in enumerate(self.weights)}, str(path),
                  metadata={"model": self.model, "meta": json.dumps(self.meta)})

    @classmethod
    def load(cls, path: Path) -> LinearScorer:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            weights = [f.get_tensor(f"layer{i}") for i in range(len(list(f.keys())))]
        return cls(weights, meta["model"], json.loads(meta["meta"]))


def trained_path(config) -> Path:
    """Where `kvmerge train-scorer` writes a model's weights: `<cache dir>/scorers/<fingerprint>.safetensors`."""
    from .model import cache_dir

    return cache_dir() / "scorers" / f"{fingerprint(config)}.safetensors"


def find(config) -> LinearScorer:
    """The scorer for the model with `config`: trained here (`trained_path`), in a folder of
    `$KVMERGE_SCORERS` (os.pathsep-separated) or shipped with kvmerge; a ValueError saying how to
    train one when there is none."""
    import os

    key = fingerprint(config)
    folders = [Path(p) for p in os.environ.get("KVMERGE_SCORERS", "").split(os.pathsep) if p] + [SHIPPED]
    for path in (trained_path(config), *(p for folder in folders for p in sorted(folder.glob("*.safetensors")))):
        if path.exists():
            scorer = LinearScorer.load(path)
            if scorer.model == key:
                return scorer
    name = getattr(config, "name_or_path", "") or config.get_text_config(decoder=True).model_type
    raise ValueError(f"no learned scorer for this model ({name}, fingerprint {key}): train one with "
                     f"`kvmerge train-scorer --model <the model's name or path>` (about 15 minutes on a CPU)")
