"""Behaviour pinned as a fixture: for every method and preset, one-shot and chunked, the entries each
compressed layer keeps (a hash of its keys, values and log-mass, bit for bit) and the greedy answer.

A refactor of the runtime must leave every row bit-identical; a change that is meant to change
behaviour regenerates the fixture in its own commit and says why (`python -m tests.test_behaviour`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import kvmerge
from kvmerge.generate import decode

from .conftest import TinyTokenizer, random_ids, tiny_model
from .test_hybrid import gemma3

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour.json"
CHUNK = 48

# (model, spec): every registered method with its defaults, the presets' variants and the allocation
# and sliding options. Ragged rows (two contexts of different lengths) where the method takes them;
# one row where global allocation or the sliding share needs rows of one length.
RAGGED = ["cam", "centroidkv", "d2o", "echo", "evictmerge", "expected_attention", "expectmerge", "full", "h2o", "keydiff", "kmeans", "kvzip:alloc=uniform", "mergingpress", "mixed_attention", "pyramidkv", "semanticache", "snapkv", "streamingllm", "surprisal", "surprisemerge", "tova", "zipguard"]  # the names as they were when the fixture was made (old names resolve)
ONE_ROW = ["zipmerge", "guardmerge", "kvzip", "kvzip:alloc=head", "kvzip:alloc=layer", "kvzip:alloc=fit", "snapkv:alloc=head",
           "snapkv:alloc=head:floor=0.5", "echo:alloc=fit", "zipguard:alloc=fit", "evictmerge:base=h2o",
           "evictmerge:base=kvzip:alloc=head:recent=0:calibrate_with=base", "d2o:base=snapkv",
           "mergingpress:base=snapkv", "kvzip:plus=true:alloc=uniform", "kvzip:plus=true", "evictmerge:exact=0.25:whole=true",
           "surprisemerge:absorb=picks", "zipmerge:alloc=uniform", "guardmerge:alloc=uniform"]
HYBRID = ["full:sliding=3", "snapkv:sliding=0.5", "expectmerge:sliding=3", "guardmerge:sliding=0.75",
          "kvzip:alloc=head:sliding=3", "snapkv"]
CASES = ([("llama", "ragged", s) for s in RAGGED] + [("llama", "one", s) for s in ONE_ROW]
         + [("gemma3", "one", s) for s in HYBRID])


# The bundled SmolLM2 on one needle sample of 1k tokens (slow: real weights), chunks of 256.
REAL = [("smollm2", "needle", s) for s in RAGGED + ONE_ROW]
REAL_CHUNK = 256
REAL_FIXTURE = Path(__file__).parent / "fixtures" / "behaviour_smollm2.json"
REAL_CI = {"expectmerge", "guardmerge", "snapkv"}  # the rows CI runs (make test-ci)


def _model(name):
    if name == "smollm2":
        return kvmerge.load_model()
    return (tiny_model() if name == "llama" else gemma3()), TinyTokenizer()


def _rows(kind, tok):
    if kind == "needle":
        from kvmerge_eval.niah import make_sample

        sample = make_sample(tok, 1024, depth=0.5, seed=7)
        context, question = kvmerge.split_prompt(tok, sample.context, sample.question)
        return [context], [question]
    return ([random_ids(160, seed=1), random_ids(120, seed=2)], [[3, 4], [5]]) if kind == "ragged" \
        else ([random_ids(200, seed=3)], [[3, 4]])


def _digest(session) -> list[str]:
    """Per compressed layer: sha256 of its padded keys, values and log-mass (float32 bytes)."""
    out = []
    for i in session.cache.compressible:
        kv = session.cache.layers[i].kv()
        h = hashlib.sha256()
        for t in kv:
            h.update(t.detach().float().contiguous().numpy().tobytes())
        out.append(h.hexdigest()[:16])
    return out


@torch.no_grad()
def behaviour(model_name, kind, spec, chunk) -> dict:
    """One row of the fixture: the kept entries' digests and the greedy answers (or "refused")."""
    model, tok = _model(model_name)
    contexts, questions = _rows(kind, tok)
    try:
        method = kvmerge.method_from_spec(spec if model_name == "smollm2" else f"{spec}:window=8", 0.25)
        session = kvmerge.Session(model, len(contexts), method, tok)
        session.prefill(contexts, chunk=chunk)
    except (ValueError, TypeError):
        return {"refused": True}
    digest, entries = _digest(session), list(session.cache.entries)
    logits = session.forward(questions, decoding=False)
    out = decode(session, logits, {}, max_new_tokens=6 if model_name != "smollm2" else 12)
    return {"kept": digest, "entries": entries, "tokens": out.tokens}


def _key(model_name, kind, spec, chunk):
    return f"{model_name}|{kind}|{spec}|{'chunk' if chunk else 'once'}"


def _all_keys(cases=CASES, chunk=CHUNK):
    return [(m, k, s, c) for m, k, s in cases for c in (None, chunk)]


def _check(path, case):
    pinned = json.loads(path.read_text())
    key = _key(*case)
    assert key in pinned, f"{key} is not in the fixture: regenerate it with python -m tests.test_behaviour"
    assert behaviour(*case) == pinned[key]


@pytest.mark.parametrize("case", _all_keys(), ids=[_key(*c) for c in _all_keys()])
def test_behaviour_is_pinned(case):
    _check(FIXTURE, case)


REAL_CASES = [pytest.param(c, marks=pytest.mark.ci_slow if c[2] in REAL_CI else pytest.mark.slow)
              for c in _all_keys(REAL, REAL_CHUNK)]


@pytest.mark.parametrize("case", REAL_CASES, ids=[_key(*c.values[0]) for c in REAL_CASES])
def test_behaviour_on_smollm2_is_pinned(case):
    _check(REAL_FIXTURE, case)


if __name__ == "__main__":
    import sys

    real = "--real" in sys.argv
    path, keys = (REAL_FIXTURE, _all_keys(REAL, REAL_CHUNK)) if real else (FIXTURE, _all_keys())
    rows = {_key(*c): behaviour(*c) for c in keys}
    path.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    print(f"{len(rows)} rows, {sum('refused' in r for r in rows.values())} refused -> {path}")
