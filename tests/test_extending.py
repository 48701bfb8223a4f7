"""Extending kvmerge: a new scoring method is one file (tests/plugins/lastquery.py, about 20 lines) with
no runtime code, and it runs one-shot and under a chunked prefill (and inside vLLM:
tests/test_vllm_transformers.py). Composites declare their parts, whose needs and hooks they get. A
new runtime is one subclass of `Runtime` that declares what it offers, and compresses through the
planner."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import kvmerge
from kvmerge.vllm.runtime import VllmRuntime
from kvmerge.methods import LayerState, Needs
from kvmerge.methods import registry
from kvmerge.methods.registry import load_plugins
from kvmerge.ops.kv import KV
from kvmerge.planner import Entries, View, compress_layers
from kvmerge.runtime import Runtime, SessionRuntime

from .conftest import TinyTokenizer, random_ids, tiny_model

PLUGIN = Path(__file__).parent / "plugins" / "lastquery.py"


@pytest.fixture(scope="module", autouse=True)
def lastquery():
    """The plugin registered for this module's tests only: later modules see the built-in methods."""
    load_plugins([str(PLUGIN)])
    yield
    registry._REGISTRY.pop("lastquery", None)
    sys.modules.pop(f"kvmerge_plugin_{PLUGIN.stem}", None)


def _kept(spec, chunk=None, ids=None):
    model = tiny_model()
    method = kvmerge.get_method(f"{spec}:window=8", 0.25)
    session = kvmerge.Session(model, 1, method, TinyTokenizer())
    with torch.no_grad():
        session.prefill([ids or random_ids(200, seed=11)], chunk=chunk)
    return [session.cache.layers[i].kv() for i in session.cache.compressible]


def test_the_file_is_about_twenty_lines_and_declares_what_it_needs():
    code = [line for line in PLUGIN.read_text().splitlines() if line.strip()]
    assert len(code) <= 22
    method = kvmerge.get_method("lastquery")
    assert method.needs == kvmerge.Needs(queries=1)
    assert SessionRuntime.refusals(method) == VllmRuntime.refusals(method) == []


@pytest.mark.parametrize("chunk", [None, 48])
def test_a_new_method_runs_one_shot_and_chunked_and_keeps_tovas_prefill_picks(chunk):
    """TOVA's prefill selection is the same score (its decode policy aside): the same entries, bit for bit."""
    ours, tova = _kept("lastquery", chunk), _kept("tova", chunk)
    for a, b in zip(ours, tova):
        assert a.slots == b.slots == round(0.25 * 200)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_plugins_load_by_module_or_path_and_refuse_what_is_not_there():
    load_plugins([str(PLUGIN)])  # again: a no-op, the name stays registered once
    assert kvmerge.available_methods().count("lastquery") == 1
    with pytest.raises(ValueError, match="no module or file 'no_such_plugin'"):
        load_plugins(["no_such_plugin"])
    assert importlib.util.find_spec("kvmerge.methods.snapkv")
    load_plugins(["kvmerge.methods.snapkv"])  # a module name works too


def test_a_plugin_that_fails_to_import_is_refused_in_one_line_naming_it(tmp_path):
    bad = tmp_path / "badplug.py"
    bad.write_text("import nothing_here_xyz\n")
    with pytest.raises(ValueError, match=rf"^kvmerge: importing methods from {bad} failed: ModuleNotFoundError: No "
                                         "module named 'nothing_here_xyz'$"):
        load_plugins([str(bad)])
    bad.write_text("def (:\n")
    with pytest.raises(ValueError, match="importing methods from .* failed: SyntaxError"):
        load_plugins([str(bad)])  # the failed module was not kept: the file is read again


def test_a_composite_gets_its_parts_needs_and_hooks():
    """d2o on a base that needs each token's surprisal and carries scores across chunks: the base's
    needs are d2o's, and its `selected` hook runs (chunked prefill needs it)."""
    method = kvmerge.get_method("d2o", base="surprisal")
    assert method.needs.surprisal and method.needs.tokenizer and method.needs.queries == 32
    kept = _kept("d2o:base=surprisal", chunk=48)
    assert all(kv.slots <= 2 * 50 for kv in kept)
    assert VllmRuntime.refusals(method)[0].startswith("d2o sets per-layer budgets")


class TensorsRuntime(Runtime):
    """A throwaway runtime: a prompt's entries held as plain tensors, compressed once; no tokenizer, no
    second pass, one count for every layer and head."""

    name = "tensors"
    offers = Needs(queries=-1, merges=True)
    lacks = {"tokenizer": "{name} reads the tokenizer, and the tensors runtime has none"}


def test_a_new_runtime_is_one_subclass_refusing_what_it_does_not_offer():
    assert TensorsRuntime.refusals(kvmerge.get_method("lastquery")) == []
    assert TensorsRuntime.refusals(kvmerge.get_method("kvzip:alloc=uniform")) == [
        "kvzip reads the tokenizer, and the tensors runtime has none",
        "kvzip needs second_pass, which the tensors runtime does not offer"]
    assert TensorsRuntime.refusals(kvmerge.get_method("snapkv:alloc=head")) == [
        f"snapkv needs {need}, which the tensors runtime does not offer"
        for need in ("all_layers", "layer_counts", "head_counts")]
    with pytest.raises(ValueError, match="tova needs decode_policy"):
        TensorsRuntime.check(kvmerge.get_method("tova"))
    assert SessionRuntime.refusals(kvmerge.get_method("kvzip")) == []  # the transformers runtime offers every need


def test_a_new_runtime_compresses_through_the_planner_as_the_session_does():
    """The throwaway runtime hands the planner a prefill's entries and captured queries: the entries
    kept equal the transformers runtime's, layer by layer, bit for bit."""
    method = kvmerge.get_method("lastquery:window=8", 0.25)
    session = kvmerge.Session(tiny_model(), 1, method, TinyTokenizer())
    ids = random_ids(200, seed=3)
    with torch.no_grad():
        session.feed_prompt([ids], capture=-1)
    picked = session.cache.compressible
    held = [Entries(KV(*(x.clone() for x in session.cache.layers[i].kv()))) for i in picked]
    states = [LayerState(queries=session.states[i].queries.clone()) for i in picked]
    n = torch.tensor([200])
    compressed = compress_layers(method, TensorsRuntime(scaling=session.runtime.scaling), held, states,
                                 View(n, n, n, 8, session.runtime.scaling, [ids]))
    session.compress([ids])
    assert compressed.tolist() == [True]
    for entries, i in zip(held, picked):
        assert entries.entries == round(0.25 * 200)
        for x, y in zip(entries.kv(), session.cache.layers[i].kv()):
            assert torch.equal(x, y)
