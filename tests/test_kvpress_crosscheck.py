"""kvmerge against NVIDIA's kvpress 0.5.5, an independent implementation (fixtures written by
benchmarks/kvpress_crosscheck.py in kvpress's own environment): which entries each eviction method keeps
on the bundled SmolLM2 (`ci_slow`), and `mergingpress`'s fold equal to kvpress's `MergingPress.merge`."""

import importlib.util
from pathlib import Path

import pytest
import torch

import kvmerge
from kvmerge.ops.merge import fold_values

from .conftest import TinyTokenizer, random_ids, tiny_model

FIXTURES = Path(__file__).parent / "fixtures" / "kvpress"


def _crosscheck():
    path = Path(__file__).parent.parent / "benchmarks" / "kvpress_crosscheck.py"
    spec = importlib.util.spec_from_file_location("kvpress_crosscheck", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- MergingPress's merge step (no model) ----------------------------------------------------------------
CASES = torch.load(FIXTURES / "merging.pt", weights_only=True)["cases"]


@pytest.mark.parametrize("case", CASES, ids=[f"{tuple(c['keys'].shape)}-thr{c['similarity_threshold']}-"
                                              f"frac{c['merge_fraction']}-{str(c['values'].dtype)[6:]}" for c in CASES])
def test_fold_values_equals_kvpress_merging_press(case):
    idx = case["indices"]  # kvpress's order (scores.topk: unsorted)
    d = case["values"].shape[-1]
    want = case["merged_values"].gather(2, idx[..., None].expand(-1, -1, -1, d))
    got = fold_values(case["keys"], case["values"], idx, case["similarity_threshold"], case["merge_fraction"])
    assert got.dtype == case["values"].dtype
    assert torch.allclose(got.float(), want.float(), atol=1e-5, rtol=0)
    # the order of idx does not matter beyond the output's order (kvmerge passes them sorted)
    order = idx.sort(-1)
    assert torch.allclose(fold_values(case["keys"], case["values"], order.values, case["similarity_threshold"],
                                      case["merge_fraction"]).float(),
                          got.float().gather(2, order.indices[..., None].expand(-1, -1, -1, d)), atol=1e-5, rtol=0)


def test_fold_values_folds_something_and_leaves_unreached_kept_values_exact():
    case = CASES[0]
    idx = case["indices"]
    d = case["values"].shape[-1]
    before = case["values"].gather(2, idx[..., None].expand(-1, -1, -1, d))
    got = fold_values(case["keys"], case["values"], idx, 0.0, 1.0)
    changed = (got != before).any(-1)
    assert changed.any() and not changed.all()
    # a threshold no cosine reaches folds nothing
    assert torch.equal(fold_values(case["keys"], case["values"], idx, 1.0, 1.0), before)


# -- mergingpress through the runtime (tiny models) -------------------------------------------------------
def test_mergingpress_keeps_the_base_selection_keys_and_log_mass_and_only_folds_values():
    model = tiny_model()
    ids = random_ids(160, seed=3)
    caches = {}
    for name in ("expectedattention", "mergingpress"):
        s = kvmerge.Session(model, 1, kvmerge.get_method(name, budget=0.25, window=8), TinyTokenizer())
        with torch.no_grad():
            s.prefill([ids])
        caches[name] = [s.cache.layers[i] for i in s.cache.compressible]
    for evict, merge in zip(caches["expectedattention"], caches["mergingpress"]):
        assert torch.equal(evict.keys, merge.keys)  # the base's picks, keys unchanged
        assert evict.log_n is None and merge.log_n is None  # no log-mass
        assert not torch.equal(evict.values, merge.values)  # evicted values folded in


@pytest.mark.parametrize("spec", ["mergingpress", "mergingpress:base=snapkv:merge_fraction=0.5",
                                  "mergingpress:base=kvzip:similarity_threshold=0.2"])
def test_mergingpress_runs_through_generate_ids_and_keeps_the_budget(spec):
    model = tiny_model()
    m = kvmerge.get_method(spec + ":window=8", 0.25)
    ctx, qs, tok = [random_ids(160, seed=1), random_ids(120, seed=2)], [[3, 4], [5]], TinyTokenizer()
    out = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=6, tokenizer=tok)
    assert max(out.stats["cache_entries"]) <= max(m.target(160), m.target(120))
    alone = [kvmerge.generate_ids(model, c, q, m, max_new_tokens=6, tokenizer=tok).tokens[0] for c, q in zip(ctx, qs)]
    assert out.tokens == alone  # a ragged batch answers as each row alone
    chunked = kvmerge.generate_ids(model, ctx, qs, m, max_new_tokens=6, tokenizer=tok, prefill_chunk=48)
    assert max(chunked.stats["cache_entries"]) <= max(m.target(160), m.target(120))
    assert chunked.tokens == [kvmerge.generate_ids(model, c, q, m, max_new_tokens=6, tokenizer=tok,
                                                   prefill_chunk=48).tokens[0] for c, q in zip(ctx, qs)]


def test_mergingpress_runs_on_a_hybrid_model():
    from .test_hybrid import WINDOW, gemma3

    m = kvmerge.get_method("mergingpress", budget=0.25, window=8)
    out = kvmerge.generate_ids(gemma3(), random_ids(160, seed=1), [3, 4], m, max_new_tokens=4,
                               tokenizer=TinyTokenizer())
    entries = out.stats["cache_entries"]
    assert entries[0] == entries[2] == WINDOW - 1 and entries[1] + entries[3] <= 2 * m.target(160)


def test_mergingpress_in_bfloat16_and_its_parameters_checked():
    model = tiny_model(dtype=torch.bfloat16)
    m = kvmerge.get_method("mergingpress", budget=0.25, window=8)
    out = kvmerge.generate_ids(model, random_ids(160, seed=4), [3, 4], m, max_new_tokens=4)
    assert max(out.stats["cache_entries"]) <= m.target(160)
    with pytest.raises(ValueError, match="merge_fraction"):
        kvmerge.get_method("mergingpress", merge_fraction=0.0)
    with pytest.raises(ValueError, match="similarity_threshold"):
        kvmerge.get_method("mergingpress", similarity_threshold=-0.1)
    with pytest.raises(TypeError, match="scoring method"):
        kvmerge.get_method("mergingpress", base="kmeans")
    with pytest.raises(ValueError, match="alloc='head' would be ignored"):
        kvmerge.get_method("mergingpress", base=kvmerge.get_method("snapkv", alloc="head"))
    with pytest.raises(ValueError, match="merges"):
        kvmerge.generate_ids(tiny_model(), random_ids(160, seed=4), [3], kvmerge.get_method(
            "mergingpress", budget=0.25, window=8, alloc="head"), max_new_tokens=2)


# -- which entries each method keeps, on the real SmolLM2 ---------------------------------------------------
@pytest.mark.ci_slow
def test_kvmerge_keeps_what_kvpress_keeps_with_parameters_aligned():
    """Measured (benchmarks/kvpress_crosscheck.py compare): aligned overlaps 0.9998 (SnapKV: 5 of 23,490
    entries, all at the pooled range's edges), 1.0 (StreamingLLM, Expected Attention, KeyDiff, KVzip
    with the prefix scored, MergingPress), 0.732 (KVzip as shipped: the chat-template prefix deviation)."""
    x = _crosscheck()
    import json

    data, kept = json.loads(x.INPUT.read_text()), json.loads(x.KEPT.read_text())
    ids, n = data["context_ids"], len(data["context_ids"])
    model, tok = kvmerge.load_model(dtype=torch.float32, device="cpu")
    # keys: the presses in kvpress's kept.json (its spelling); values: kvmerge specs
    specs = {"snapkv": "snapkv:obs_window=64:kernel=5:window=64:sinks=0", "streamingllm": "streamingllm",
             "expected_attention": "expectedattention:window=0", "keydiff": "keydiff:sinks=0:window=0",
             "kvzip_prefix_scored": "kvzip:alloc=head:window=0", "mergingpress": "mergingpress:window=0"}
    values = {}
    ours = x.kvmerge_kept(model, tok, ids, sorted(set(specs.values())), values=values)
    for key, spec in specs.items():
        theirs = kept["presses"][key]["kept"]
        assert sum(len(a) for layer in ours[spec] for a in layer) == sum(len(b) for layer in theirs for b in layer)
        assert x.overlap(ours[spec], theirs) >= 0.995, key
    # SnapKV's remaining difference is only the pooling edge: the first and the last two scored positions
    edges = {0, 1, n - 64 - 2, n - 64 - 1}
    for _layer, _head, ours_only, _theirs_only in x.differing(ours[specs["snapkv"]], kept["presses"]["snapkv"]["kept"]):
        assert set(ours_only) <= edges
    # KVzip as kvpress ships it leaves the chat template's prefix unscored: a measured, named deviation
    assert x.overlap(ours[specs["kvzip_prefix_scored"]], kept["presses"]["kvzip"]["kept"]) >= 0.65
    # mergingpress end to end: kvpress's MergingPress(ExpectedAttentionPress()) values (digest sums of ~261
    # values of magnitude ~1 per head; measured difference 0, the plain eviction's differs by far more)
    assert x.merged_difference(values[specs["mergingpress"]]) < 1e-3
    assert x.merged_difference(values[specs["expected_attention"]]) > 0.1
