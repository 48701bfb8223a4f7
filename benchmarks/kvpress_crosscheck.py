"""Cross-check of kvmerge's eviction methods against NVIDIA's kvpress 0.5.5, an independent implementation:
which entries each keeps per (layer, KV head), on the same model (the bundled SmolLM2-135M-Instruct,
float32, CPU) and the same context ids, keeping 25% (kvpress `compression_ratio=0.75`), the context
compressed alone (question-agnostic).

Four sub-commands, run from the repository root (`make setup-kvpress` makes .venv-kvpress) (fixtures under tests/fixtures/kvpress/):

    .venv/bin/python benchmarks/kvpress_crosscheck.py input                  # input.json
    .venv-kvpress/bin/python benchmarks/kvpress_crosscheck.py kvpress   # kept.json, merged_values.pt
    .venv/bin/python benchmarks/kvpress_crosscheck.py compare                # the markdown table
    .venv-kvpress/bin/python benchmarks/kvpress_crosscheck.py merging   # merging.pt

`input` (kvmerge's venv): a ~1,000-token prose context from `kvmerge_eval.niah.haystack`, split from its
question by `kvmerge.split_prompt` exactly as kvmerge's question-agnostic protocol does (the chat
template's prefix, the context and the "\\n\\n" before the question are the context ids). The first
haystack offset whose context length is a multiple of 4 is taken, so that 25% is a whole number of
entries under both libraries' rounding (kvpress `int(n·0.25)`, kvmerge `round(0.25·n)`).

`kvpress` (kvpress's venv; imports no kvmerge): runs each press on those ids as kvpress's pipeline
prefills (`with press(model): model.model(input_ids=..., past_key_values=DynamicCache())`, sdpa) and
records the kept positions, sorted, per layer and KV head:
- a `ScorerPress` (SnapKV, StreamingLLM, Expected Attention, KeyDiff): its `score` is wrapped on the
  instance to record each layer's scores, and the kept positions are `scores.topk(n_kept)` with
  `n_kept = compute_n_kept(k_len, compression_ratio)`, the very step of `ScorerPress.compress`. The
  capture is checked: the compressed cache's keys must equal the full keys gathered at those positions.
- `KVzipPress` masks instead of evicting: after the press exits each attention module holds
  `masked_key_indices` (batch, head, position) of the evicted entries; kept = the complement.
  Also run with `prefix_length` forced to 0 (its `prepare` wrapped), i.e. the chat template's prefix
  reconstructed and scored like the rest, as kvmerge does: the prefix deviation, measured.
- `MergingPress(ExpectedAttentionPress())`: kept positions as for a ScorerPress (its inner press's score
  wrapped), and a digest of the merged values per (layer, head) in tests/fixtures/kvpress/merged_values.pt
  (their sum and position-weighted sum, float64), to check `mergingpress` end to end.

`compare` (kvmerge's venv): runs kvmerge's methods on the same ids through `kvmerge.Session` (one
prefill capturing every query, then a snapshot compressed by each spec in turn, as
`kvmerge_eval.shared.compressed_once` does) and recovers kvmerge's kept positions exactly: a
`ScoringMethod` is told its kept slots `(b, h, t)` by `selected(idx, ctx)` after every layer's
selection (wrapped on the instance); on a one-shot prefill of one row slot i is position i; the
padding slots of `alloc=head` (log-mass −inf after compression) are dropped; checked: the compressed
cache's keys equal the prefilled keys at those positions. Overlap = |kvmerge ∩ kvpress| / |kvpress|
per (layer, KV head), averaged.

`merging` (kvpress's venv): random keys, values and kept indices and kvpress's `MergingPress.merge`
on them, for the equality test of `kvmerge.ops.merge.fold_values` (tests/test_kvpress_crosscheck.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "kvpress"
INPUT, KEPT, MERGING = FIXTURES / "input.json", FIXTURES / "kept.json", FIXTURES / "merging.pt"
MERGED = FIXTURES / "merged_values.pt"  # MergingPress(ExpectedAttentionPress) on SmolLM2: digest of its values
RATIO = 0.75  # kvpress compression_ratio: keep 25%
BUDGET = 0.25
QUESTION = "What is the text above about?"

# (kvpress press, kvmerge spec with its defaults, kvmerge spec aligned to the press, deviation named)
ROWS = [
    ("SnapKVPress(window_size=64, kernel_size=5)", "snapkv", "snapkv:obs_window=64:kernel=5:window=64:sinks=0",
     "kvmerge's defaults obs_window=32, kernel=7, sinks 4 + window 32 protected; kvpress: 64 queries, kernel 5, the "
     "64 observation positions kept, no sinks. Aligned, what is left is pooling at the edges: kvpress pools the "
     "n-64 scored positions alone (zero-padded, count_include_pad), kvmerge pools the whole row (the window's "
     "columns included, padding not counted)"),
    ("StreamingLLMPress(n_sink=4)", "streamingllm", "streamingllm",
     "none: 4 sinks + the most recent tokens in both"),
    ("ExpectedAttentionPress()", "expectedattention", "expectedattention:window=0",
     "kvmerge also protects a 32-token recent window; kvpress protects only its n_sink=4 (window=0 aligns). "
     "Aligned: identical (kvmerge recovers pre-RoPE queries by undoing RoPE on the captured ones, kvpress "
     "recomputes them from hidden states: the rounding flips no pick here)"),
    ("KeyDiffPress()", "keydiff", "keydiff:sinks=0:window=0",
     "kvmerge protects 4 sinks + a 32-token window; kvpress protects nothing (sinks=0, window=0 align)"),
    ("KVzipPress() (global, layerwise=False)", "kvzip", "kvzip:alloc=head:window=0",
     "kvmerge's kvzip is uniform per head (alloc=head is kvpress's global ranking) and protects a 32-token window "
     "(window=0 aligns). Left: the chat template's prefix (24 tokens): kvpress neither reconstructs nor scores it "
     "(score 0, evicted first but for its 4 sinks) and leaves it out of the reconstruction's softmax; kvmerge "
     "scores it. The prefix's attention mass then changes every head's ranking, not only the allocation: "
     "kvmerge's scores cut to kvpress's own per-head counts overlap 0.73 too"),
    ("KVzipPress(), prefix scored (prefix_length=0)", "kvzip", "kvzip:alloc=head:window=0",
     "the prefix deviation removed on kvpress's side (its prepare wrapped to set prefix_length=0)"),
    ("MergingPress(ExpectedAttentionPress())", "mergingpress", "mergingpress:window=0",
     "as Expected Attention: kvmerge protects a 32-token window (window=0 aligns); aligned, the merged "
     "values' digest is compared too (see below)"),
]
# the presses' keys in kvpress_kept.json (tests/fixtures/kvpress/kept.json): "expected_attention" is kvpress's
# spelling of its press, kept so the stored fixture reads as written
PRESS_KEYS = ["snapkv", "streamingllm", "expected_attention", "keydiff", "kvzip", "kvzip_prefix_scored",
              "mergingpress"]


def model_folder() -> Path:
    """The bundled SmolLM2 converted to safetensors by kvmerge.load_model() (config and tokenizer there)."""
    return Path(os.environ.get("KVMERGE_CACHE", Path.home() / ".cache" / "kvmerge")) / "smollm2-135m"


# -- input (kvmerge's venv) -------------------------------------------------------------------------
def make_input(n_tokens: int = 1000) -> dict:
    import torch

    import kvmerge
    from kvmerge_eval.niah import haystack

    _model, tok = kvmerge.load_model(dtype=torch.float32, device="cpu")
    for offset in range(64):
        context = " ".join(haystack(tok, n_tokens, offset=offset))
        ids, question = kvmerge.split_prompt(tok, context, QUESTION)
        if len(ids) % 4 == 0:
            break
    return {"model": "smollm2-135m", "haystack_offset": offset, "n_tokens": n_tokens, "question": QUESTION,
            "context_ids": ids, "question_ids": question,
            "note": "kvmerge.split_prompt(tok, ' '.join(kvmerge_eval.niah.haystack(tok, n_tokens, offset)), question)"}


# -- kvpress (kvpress's venv; no kvmerge) ------------------------------------------------------------
def _kvpress_model():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_folder(), dtype=torch.float32, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.eval()


def _record_topk(press):
    """Wrap a ScorerPress's `score` on the instance: each layer's kept positions (its score → topk step,
    `ScorerPress.compress`'s) and full keys land in the two dicts returned, by layer index."""
    from kvpress.utils import compute_n_kept

    kept, full = {}, {}
    score = press.score

    def recording(module, hidden_states, keys, values, attentions, kwargs):
        scores = score(module, hidden_states, keys, values, attentions, kwargs)
        kept[module.layer_idx] = scores.topk(compute_n_kept(keys.shape[2], press.compression_ratio), dim=-1).indices
        full[module.layer_idx] = keys.clone()
        return scores

    press.score = recording
    return kept, full


def _scorer_kept(model, press, ids):
    """Kept positions [layer][head] of a ScorerPress, from its own score → topk step (checked on the cache)."""
    import torch
    from transformers import DynamicCache

    kept, full = _record_topk(press)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    out = []
    for i in range(model.config.num_hidden_layers):
        idx = kept[i]
        gathered = full[i].gather(2, idx[..., None].expand(-1, -1, -1, full[i].shape[-1]))
        assert torch.equal(gathered, cache.layers[i].keys), f"layer {i}: capture differs from the compressed cache"
        out.append([sorted(row.tolist()) for row in idx[0]])
    return out


def _kvzip_kept(model, press, ids):
    """Kept positions [layer][head] of KVzipPress: the complement of each module's masked_key_indices."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    n, heads = len(ids), model.config.num_key_value_heads
    out = []
    for layer in model.model.layers:
        _b, h, s = layer.self_attn.masked_key_indices
        keep = torch.ones(heads, n, dtype=torch.bool)
        keep[h.long(), s.long()] = False
        out.append([row.nonzero().squeeze(1).tolist() for row in keep])
        layer.self_attn.masked_key_indices = None
    return out


def _merging_kept(model, ids):
    """MergingPress(ExpectedAttentionPress) end to end: kept positions [layer][head] (the inner press's
    score → topk, as for a ScorerPress) and a digest of the merged values per (layer, head)."""
    import torch
    from transformers import DynamicCache

    from kvpress import ExpectedAttentionPress, MergingPress

    inner = ExpectedAttentionPress(compression_ratio=RATIO)
    press = MergingPress(press=inner)
    kept, full = _record_topk(inner)
    cache = DynamicCache()
    with torch.no_grad(), press(model):
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
    positions, values = [], []
    for i in range(model.config.num_hidden_layers):
        order = kept[i].sort(-1)  # the cache holds the kept entries in topk order
        at = order.indices[..., None].expand(-1, -1, -1, full[i].shape[-1])
        assert torch.equal(cache.layers[i].keys.gather(2, at), full[i].gather(2, order.values[..., None].expand_as(at)))
        positions.append([row.tolist() for row in order.values[0]])
        values.append(cache.layers[i].values.gather(2, at)[0])
    return repr(press), positions, digest(values)


def digest(values) -> dict:
    """Per (layer, head), float64: the kept values' sum over entries and their position-weighted sum (entry
    j of t weighs (j + 1) / t), `(L, h, d)` each: small, yet any changed fold or order shows."""
    import torch

    v = torch.stack([x.double().cpu() for x in values])  # (L, h, t, d)
    w = torch.arange(1, v.shape[2] + 1, dtype=torch.float64) / v.shape[2]
    return {"sum": v.sum(2), "weighted": (v * w[:, None]).sum(2)}


def run_kvpress() -> dict:
    import importlib.metadata

    import torch
    import transformers
    from kvpress import ExpectedAttentionPress, KeyDiffPress, KVzipPress, SnapKVPress, StreamingLLMPress

    data = json.loads(INPUT.read_text())
    ids = data["context_ids"]
    model = _kvpress_model()
    presses = {
        "snapkv": SnapKVPress(compression_ratio=RATIO),
        "streamingllm": StreamingLLMPress(compression_ratio=RATIO),
        "expected_attention": ExpectedAttentionPress(compression_ratio=RATIO),
        "keydiff": KeyDiffPress(compression_ratio=RATIO),
    }
    out = {"kvpress": importlib.metadata.version("kvpress"),
           "torch": torch.__version__, "transformers": transformers.__version__, "n": len(ids), "presses": {}}
    for key, press in presses.items():
        out["presses"][key] = {"press": repr(press), "kept": _scorer_kept(model, press, ids)}
        print(key, "done", file=sys.stderr)

    press = KVzipPress(compression_ratio=RATIO)
    prefix = {}
    prepare = press.prepare

    def noting(model_, tokenizer, *a, **k):
        prefix["length"] = press.prefix_length
        return prepare(model_, tokenizer, *a, **k)

    press.prepare = noting
    out["presses"]["kvzip"] = {"press": repr(press), "kept": _kvzip_kept(model, press, ids)}
    out["kvzip_prefix_length"] = prefix["length"]
    print("kvzip done", file=sys.stderr)

    press = KVzipPress(compression_ratio=RATIO)
    prepare = press.prepare

    def unprefixed(model_, tokenizer, *a, **k):
        press.prefix_length = 0  # the chat template's prefix reconstructed and scored like the rest
        return prepare(model_, tokenizer, *a, **k)

    press.prepare = unprefixed
    out["presses"]["kvzip_prefix_scored"] = {"press": repr(press) + " with prefix_length=0",
                                             "kept": _kvzip_kept(model, press, ids)}
    print("kvzip (prefix scored) done", file=sys.stderr)

    name, kept, values = _merging_kept(model, ids)
    out["presses"]["mergingpress"] = {"press": name, "kept": kept}
    torch.save(values, MERGED)
    print("mergingpress done", file=sys.stderr)
    return out


def write_kept(data: dict) -> None:
    """Compact JSON, one line per press and layer, so the file stays small and diffable."""
    lines = ["{"]
    for key in ("kvpress", "torch", "transformers", "n", "kvzip_prefix_length"):
        lines.append(f"{json.dumps(key)}: {json.dumps(data[key])},")
    lines.append('"presses": {')
    names = list(data["presses"])
    for j, name in enumerate(names):
        p = data["presses"][name]
        lines.append(f'{json.dumps(name)}: {{"press": {json.dumps(p["press"])}, "kept": [')
        rows = [json.dumps(layer, separators=(",", ":")) for layer in p["kept"]]
        lines.append(",\n".join(rows))
        lines.append("]}" + ("," if j < len(names) - 1 else ""))
    lines.append("}}")
    KEPT.write_text("\n".join(lines) + "\n")


def make_merging_fixture() -> None:
    """Random (keys, values, kept indices) and kvpress's MergingPress.merge on them, for several settings."""
    import torch
    from kvpress import KnormPress, MergingPress

    g = torch.Generator().manual_seed(0)
    cases = []
    for b, h, s, d, t, thr, frac, dtype in [(2, 3, 40, 16, 12, 0.0, 1.0, torch.float32),
                                            (1, 2, 64, 8, 20, 0.3, 1.0, torch.float32),
                                            (2, 2, 50, 16, 10, 0.0, 0.75, torch.float32),
                                            (1, 3, 33, 8, 9, 0.1, 0.5, torch.float32),
                                            (1, 1, 1100, 4, 60, 0.0, 1.0, torch.float32),  # > 1024 evicted
                                            (1, 2, 48, 16, 12, 0.0, 1.0, torch.bfloat16)]:
        keys = torch.randn(b, h, s, d, generator=g)
        keys[..., : d // 2] += 0.5 * torch.randn(b, h, 1, d // 2, generator=g)  # some shared direction: real merges
        values = torch.randn(b, h, s, d, generator=g) * (1 + torch.rand(b, h, s, 1, generator=g))
        keys, values = keys.to(dtype), values.to(dtype)
        idx = torch.rand(b, h, s, generator=g).topk(t, dim=-1).indices  # unsorted, as scores.topk gives
        press = MergingPress(press=KnormPress(compression_ratio=0.5), similarity_threshold=thr, merge_fraction=frac)
        out_keys, out_values = press.merge(keys, values, idx)
        assert torch.equal(out_keys, keys)
        cases.append({"keys": keys, "values": values, "indices": idx, "similarity_threshold": thr,
                      "merge_fraction": frac, "merged_values": out_values})
    torch.save({"kvpress": "0.5.5", "cases": cases}, MERGING)


# -- compare (kvmerge's venv) ------------------------------------------------------------------------
def kvmerge_kept(model, tok, ids: list[int], specs: list[str], budget=BUDGET, scores: dict | None = None,
                 values: dict | None = None) -> dict:
    """spec → kept positions [layer][head] (sorted), one prefill shared by every spec. `scores`, if
    given, receives spec → each layer's scores `(h, n)` of the specs with global allocation; `values`
    spec → each layer's compressed values `(h, t, d)` (entries in position order)."""
    import torch

    import kvmerge

    session = kvmerge.Session(model, 1)
    with torch.inference_mode():
        session.feed_prompt([ids], -1)  # every query captured, as kvmerge_eval.shared.compressed_once
        prefilled = session.snapshot()
        full = {i: session.cache.layers[i].keys[0].clone() for i in session.cache.compressible}
        out = {}
        for spec in specs:
            method = kvmerge.get_method(spec, budget)
            picked = {}
            told = method.selected

            def selected(idx, ctx, told=told, picked=picked, spec=spec):
                picked[ctx.layer_idx] = idx[0].clone()
                if scores is not None and "_alloc_scores" in ctx.state.scratch:
                    scores.setdefault(spec, {})[ctx.layer_idx] = ctx.state.scratch["_alloc_scores"][0].clone()
                told(idx, ctx)

            method.selected = selected
            session.restore(prefilled)
            session.use(method, tok)
            session.compress([ids], method.window)
            kept = []
            for j, i in enumerate(session.cache.compressible):
                layer = session.cache.layers[i]
                idx = picked[j]
                live = (torch.ones(idx.shape, dtype=torch.bool) if layer.log_n is None
                        else ~torch.isinf(layer.log_n[0]).cpu())
                kept.append([sorted(row[m].tolist()) for row, m in zip(idx.cpu(), live)])
                for h, (row, m) in enumerate(zip(idx, live)):  # the capture checked on the compressed cache
                    m = m.to(row.device)
                    assert torch.equal(layer.keys[0, h, :len(row)][m], full[i][h, row[m]]), (spec, i, h)
            out[spec] = kept
            if values is not None:
                values[spec] = [session.cache.layers[i].values[0].clone() for i in session.cache.compressible]
    return out


def overlap(ours: list, theirs: list) -> float:
    """|ours ∩ theirs| / |theirs| per (layer, head), averaged."""
    values = [len(set(a) & set(b)) / len(b) for la, lb in zip(ours, theirs) for a, b in zip(la, lb)]
    return sum(values) / len(values)


def differing(ours: list, theirs: list) -> list[tuple[int, int, list[int], list[int]]]:
    """(layer, head, kept by kvmerge only, kept by kvpress only) for every (layer, head) that differs."""
    return [(i, j, sorted(set(a) - set(b)), sorted(set(b) - set(a)))
            for i, (la, lb) in enumerate(zip(ours, theirs)) for j, (a, b) in enumerate(zip(la, lb)) if set(a) != set(b)]


def compare(model=None, tok=None) -> list[dict]:
    import torch

    import kvmerge

    data, kept = json.loads(INPUT.read_text()), json.loads(KEPT.read_text())
    if model is None:
        model, tok = kvmerge.load_model(dtype=torch.float32, device="cpu")
    ids = data["context_ids"]
    specs = sorted({s for _p, d, a, _dev in ROWS for s in (d, a)})
    scores, values = {}, {}
    ours = kvmerge_kept(model, tok, ids, specs, scores=scores, values=values)
    rows = []
    for (press, default, aligned, deviation), key in zip(ROWS, PRESS_KEYS):
        theirs = kept["presses"][key]["kept"]
        diff = differing(ours[aligned], theirs)
        rows.append({"press": press, "key": key, "default": default, "aligned": aligned, "deviation": deviation,
                     "overlap_default": overlap(ours[default], theirs),
                     "overlap_aligned": overlap(ours[aligned], theirs),
                     "kept_kvpress": sum(len(b) for layer in theirs for b in layer),
                     "kept_kvmerge": sum(len(a) for layer in ours[aligned] for a in layer),
                     "missed": sum(len(d[3]) for d in diff), "heads": sum(len(layer) for layer in theirs),
                     "heads_differing": len(diff), "differing": diff})
        if key == "kvzip":  # is the prefix deviation in the allocation or in each head's ranking?
            matched = count_matched(scores[aligned], theirs, kept["kvzip_prefix_length"])
            rows[-1]["note"] = ("kvmerge's KVzip scores, the prefix evicted (but its 4 sinks), each head cut to "
                                f"kvpress's own count: overlap {matched:.4f}")
        if key == "mergingpress":
            gap = merged_difference(values[aligned])
            rows[-1]["note"] = f"`{aligned}`'s merged values, largest difference of the digests: {gap:.3g}"
    return rows


def merged_difference(values: list) -> float:
    """The largest absolute difference between the digest of kvmerge's merged values and kvpress's."""
    import torch

    theirs, ours = torch.load(MERGED, weights_only=True), digest(values)
    return max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)


def count_matched(scores: dict, theirs: list, prefix: int, sinks: int = 4) -> float:
    """Overlap with `theirs` of each (layer, head)'s top entries by `scores`, as many as `theirs` keeps, with
    positions sinks..prefix barred (as kvpress leaves the chat template's prefix unscored)."""
    values = []
    for i, layer in enumerate(theirs):
        for h, kept in enumerate(layer):
            x = scores[i][h].float().clone()
            x[sinks:prefix] = float("-inf")
            x[:sinks] = float("inf")
            top = set(x.topk(len(kept)).indices.tolist())
            values.append(len(top & set(kept)) / len(kept))
    return sum(values) / len(values)


def table(rows: list[dict], n: int) -> str:
    out = [f"Context: {n} tokens (SmolLM2-135M-Instruct, float32, CPU), 25% kept, question-agnostic.", "",
           "| kvpress press | kvmerge spec (default) | overlap | kvmerge spec (aligned) | overlap | kvpress entries "
           "missed, aligned (heads) | deviation |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['press']} | `{r['default']}` | {r['overlap_default']:.4f} | `{r['aligned']}` | "
                   f"{r['overlap_aligned']:.4f} | {r['missed']} of {r['kept_kvpress']} ({r['heads_differing']} of "
                   f"{r['heads']}) | {r['deviation']} |")
    for r in rows:
        if "note" in r:
            out.append(f"\n{r['key']}: {r['note']}")
        if 0 < r["heads_differing"] <= 5:
            out.append(f"\n{r['key']} aligned, (layer, head, kvmerge only, kvpress only): {r['differing']}")
    return "\n".join(out)


def main(argv: list[str]) -> None:
    command = argv[0] if argv else ""
    if command == "input":
        FIXTURES.mkdir(parents=True, exist_ok=True)
        data = make_input()
        INPUT.write_text(json.dumps(data) + "\n")
        print(f"{INPUT}: {len(data['context_ids'])} context ids (haystack offset {data['haystack_offset']})")
    elif command == "kvpress":
        data = run_kvpress()
        write_kept(data)
        print(f"{KEPT}: {KEPT.stat().st_size} bytes; kvzip prefix_length {data['kvzip_prefix_length']}")
    elif command == "merging":
        make_merging_fixture()
        print(f"{MERGING}: {MERGING.stat().st_size} bytes")
    elif command == "compare":
        rows = compare()
        print(table(rows, len(json.loads(INPUT.read_text())["context_ids"])))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
