"""KV heads stored at their own lengths (global per-head allocation), packed back to back in one buffer
per layer: decoding, appends, batch operations, snapshots and chunked prefill give what the layout
padding every head to its layer's widest gives (logits to float tolerance, greedy tokens exactly)."""

import pytest
import torch

import kvmerge
from kvmerge import Session
from kvmerge.layer import MergedLayer

from .conftest import TinyTokenizer, random_ids, tiny_model

SNAP = "snapkv:alloc=head:window=8"


def _sessions(model, spec, rows, monkeypatch, chunk=None):
    """The same prefill compressed with ragged storage and with every head padded (no `compact`)."""
    out = []
    for padded in (False, True):
        with monkeypatch.context() as m:
            if padded:
                m.setattr(MergedLayer, "compact", lambda self: False)
            method = kvmerge.get_method(spec, 0.25)
            session = Session(model, len(rows), method, TinyTokenizer())
            out.append((session, session.prefill(rows, method.window, chunk)))
    (ragged, first), (padded, padded_first) = out
    assert any(ragged.cache.layers[i].ragged for i in ragged.cache.compressible)
    assert not any(padded.cache.layers[i].ragged for i in padded.cache.compressible)
    torch.testing.assert_close(first, padded_first, atol=1e-5, rtol=1e-5)
    return ragged, padded, first


def _same_layout(a, b):
    """The layers' padded views hold the same entries at the same slots."""
    for i in a.cache.compressible:
        x, y = a.cache.layers[i], b.cache.layers[i]
        assert x.entries == y.entries
        live = ~torch.isinf(y.full_log_n())
        for p, q in zip(x.kv(), y.kv()):
            torch.testing.assert_close(p[live], q[live], atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isinf(x.full_log_n()), ~live)


def _greedy(session, first, steps):
    tokens, logits, out = first.argmax(-1), [], []
    for _ in range(steps):
        out.append(tokens.tolist())
        step = session.forward([[int(t)] for t in tokens])
        logits.append(step)
        tokens = step.argmax(-1)
    return out, torch.stack(logits)


@pytest.mark.parametrize("spec", [SNAP, "learnedzip:window=8", "evictmerge:base=kvzip:alloc=head:recent=0:window=8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_ragged_decoding_equals_the_padded_layout(spec, batch, monkeypatch):
    """GQA (two query heads per KV head), one row or several of one length: the same greedy tokens,
    logits to float tolerance, the same entries at the same slots after a chunk and decoding steps."""
    model = tiny_model(num_hidden_layers=3)
    rows = [random_ids(160, seed=3 + r) for r in range(batch)]
    ragged, padded, first = _sessions(model, spec, rows, monkeypatch)
    assert ragged.cache.nbytes < padded.cache.nbytes
    chunk = [[7, 8, 9]] * batch  # a multi-token query over the ragged heads (causal over the new tokens)
    torch.testing.assert_close(ragged.forward(chunk), padded.forward(chunk), atol=1e-5, rtol=1e-5)
    tokens, logits = _greedy(ragged, first, 10)
    padded_tokens, padded_logits = _greedy(padded, first, 10)
    assert tokens == padded_tokens
    torch.testing.assert_close(logits, padded_logits, atol=1e-5, rtol=1e-5)
    _same_layout(ragged, padded)


@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (6, 3)])
def test_any_grouping_of_query_heads_onto_kv_heads(heads, monkeypatch):
    """MHA, four query heads per KV head, three KV heads: decoding equals the padded layout."""
    q, kv = heads
    model = tiny_model(num_hidden_layers=2, num_attention_heads=q, num_key_value_heads=kv, hidden_size=48 if q == 6 else 64)
    ragged, padded, first = _sessions(model, SNAP, [random_ids(150, seed=5), random_ids(150, seed=6)], monkeypatch)
    tokens, logits = _greedy(ragged, first, 6)
    padded_tokens, padded_logits = _greedy(padded, first, 6)
    assert tokens == padded_tokens
    torch.testing.assert_close(logits, padded_logits, atol=1e-5, rtol=1e-5)


def test_appends_write_every_head_in_place_and_grow_when_full(monkeypatch):
    """After `reserve`, appends write the packed buffers in place; past the capacity every head's
    segment grows. Bytes held grow by exactly the appended entries, and the buffers hold at least that."""
    model = tiny_model(num_hidden_layers=3)
    ragged, padded, _ = _sessions(model, SNAP, [random_ids(160, seed=3)], monkeypatch)
    layer = next(ragged.cache.layers[i] for i in ragged.cache.compressible if ragged.cache.layers[i].ragged)
    d = model.config.hidden_size // model.config.num_attention_heads
    slot = 2 * d * 4 + (0 if layer.packed()[2] is None else 4)
    heads = model.config.num_key_value_heads
    ragged.reserve(5)
    before, ptr = layer.nbytes, layer.packed()[0].data_ptr()
    for token in (11, 12, 13, 14, 15):
        ragged.forward([[token]])
        padded.forward([[token]])
    assert layer.packed()[0].data_ptr() == ptr  # written in place: no copy
    assert layer.nbytes == before + 5 * heads * slot
    ragged.forward([list(range(20, 40))])  # past the capacity: every segment grows
    padded.forward([list(range(20, 40))])
    assert layer.packed()[0].data_ptr() != ptr and layer.allocated_bytes >= layer.nbytes
    assert [n for _, n in layer.packed()[3]] == [h.entries for h in layer.heads]
    torch.testing.assert_close(ragged.forward([[3]]), padded.forward([[3]]), atol=1e-5, rtol=1e-5)
    _same_layout(ragged, padded)


def test_snapshot_and_restore_copy_the_packed_buffers(monkeypatch):
    """A snapshot is not written by later appends: restoring it twice gives the same decoding twice."""
    model = tiny_model(num_hidden_layers=3)
    ragged, padded, first = _sessions(model, SNAP, [random_ids(160, seed=4)], monkeypatch)
    ragged.reserve(8)
    saved, nbytes = ragged.snapshot(), ragged.cache.nbytes
    tokens, logits = _greedy(ragged, first, 6)
    ragged.restore(saved)
    assert ragged.cache.nbytes == nbytes
    again_tokens, again = _greedy(ragged, first, 6)
    assert again_tokens == tokens
    torch.testing.assert_close(again, logits, rtol=0, atol=0)
    ragged.restore(saved)
    padded_tokens, padded_logits = _greedy(padded, first, 6)
    assert _greedy(ragged, first, 6)[0] == padded_tokens == tokens


def test_batch_operations_map_the_packed_rows(monkeypatch):
    """Repeating and selecting rows of a ragged cache does what it does to the padded layout."""
    model = tiny_model(num_hidden_layers=3)
    ragged, padded, _ = _sessions(model, SNAP, [random_ids(160, seed=3), random_ids(160, seed=8)], monkeypatch)
    for s in (ragged, padded):
        s.repeat_rows(2)
    assert ragged.cache.nbytes < padded.cache.nbytes
    step = [[5], [6], [7], [8]]
    torch.testing.assert_close(ragged.forward(step), padded.forward(step), atol=1e-5, rtol=1e-5)
    for s in (ragged, padded):
        s.cache.batch_select_indices(torch.tensor([3, 0]))
        s.seen, s.plain, s.captured = s.seen[[3, 0]], s.plain[[3, 0]], s.captured[[3, 0]]
    torch.testing.assert_close(ragged.forward([[9], [10]]), padded.forward([[9], [10]]), atol=1e-5, rtol=1e-5)
    _same_layout(ragged, padded)


def test_chunked_prefill_recompresses_a_ragged_cache(monkeypatch):
    """Each chunk's compression reads the ragged layers as their padded layout and stores them ragged
    again: the chunked prefill and decoding equal the padded one's."""
    model = tiny_model(num_hidden_layers=3)
    ragged, padded, first = _sessions(model, SNAP, [random_ids(300, seed=9)], monkeypatch, chunk=64)
    tokens, logits = _greedy(ragged, first, 6)
    padded_tokens, padded_logits = _greedy(padded, first, 6)
    assert tokens == padded_tokens
    torch.testing.assert_close(logits, padded_logits, atol=1e-5, rtol=1e-5)
    _same_layout(ragged, padded)


def test_heads_read_and_written_back_keep_the_layer(monkeypatch):
    """`heads` (one single-head layer per KV head, as a context file stores them) assigned back gives
    the same layer: entries, bytes and padded layout."""
    model = tiny_model(num_hidden_layers=3)
    ragged, _, _ = _sessions(model, "evictmerge:base=kvzip:alloc=head:recent=0:window=8",
                             [random_ids(160, seed=3)], monkeypatch)
    layer = next(ragged.cache.layers[i] for i in ragged.cache.compressible if ragged.cache.layers[i].ragged)
    kv, nbytes, entries = layer.kv(), layer.nbytes, layer.entries
    layer.heads = layer.heads
    assert layer.ragged and layer.entries == entries and layer.nbytes == nbytes
    assert all(torch.equal(a, b) for a, b in zip(layer.kv(), kv))


@pytest.mark.parametrize("spec", ["learnedzip:window=8", "kvzip:alloc=head:window=8:chunk=64",
                                  "surprisal:alloc=head:window=8", "learnedzip:alloc=adakv:floor=0.5:window=8"])
@pytest.mark.parametrize("batch", [1, 3])
def test_compressing_on_the_packed_buffers_equals_compressing_each_padded_copy(spec, batch, monkeypatch):
    """The planner compresses a method that scores fresh slots alone (the default) on the layers' own
    buffers (`planner.on_packed_buffers`): chunk after chunk, the cache (entries, storage, empty slots),
    the scores carried and decoding are exactly those of the general path, which compresses a padded
    copy of each layer with `method.compress`."""
    from kvmerge import planner

    model = tiny_model(num_hidden_layers=3)
    rows = [random_ids(300, seed=20 + r) for r in range(batch)]
    sessions, calls = [], []
    for general in (False, True):
        with monkeypatch.context() as m:
            real = planner.on_packed_buffers
            m.setattr(planner, "on_packed_buffers", lambda method, layers, general=general:
                      calls.append(real(method, layers)) or (not general and calls[-1]))
            method = kvmerge.get_method(spec, 0.25)
            session = Session(model, batch, method, TinyTokenizer())
            first = session.prefill(rows, method.window, 64)
        sessions.append((session, first, _greedy(session, first, 4)))
    assert all(calls)  # the method and layers qualify: the first run took the packed path every time
    (packed, first, (tokens, logits)), (general, general_first, (general_tokens, general_logits)) = sessions
    assert any(packed.cache.layers[i].ragged for i in packed.cache.compressible)
    assert torch.equal(first, general_first) and tokens == general_tokens
    torch.testing.assert_close(logits, general_logits, atol=1e-6, rtol=1e-6)
    for i in packed.cache.compressible:
        x, y = packed.cache.layers[i], general.cache.layers[i]
        assert (x.ragged, x.entries, x._lens, x._kept) == (y.ragged, y.entries, y._lens, y._kept)
        assert (x.log_n is None) == (y.log_n is None)  # plain tokens only: attention's fast path
        assert all(torch.equal(a, b) for a, b in zip(x.kv(), y.kv()))
        name = kvmerge.get_method(spec).name
        carried, general_carried = packed.states[i].scratch[name], general.states[i].scratch[name]
        assert all(torch.equal(carried[r], general_carried[r]) for r in range(batch))


def test_small_decoding_calls_run_on_one_thread_and_the_count_comes_back(monkeypatch):
    """Each KV head's decoding call is small: on the CPU it runs on one thread (a parallel region costs more
    than it splits, most on a loaded machine); a large call keeps the threads, and the count is restored."""
    import kvmerge.attention as attention

    seen = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: (seen.append(torch.get_num_threads()), real(*a, **k))[1])
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: max(threads, 2))  # as on a machine of 2 threads or more
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    q, keys, values = torch.randn(1, 4, 1, 8), torch.randn(1, 30, 8), torch.randn(1, 30, 8)
    attention.ragged_sdpa(q, keys, values, None, ((0, 10), (10, 20)))
    assert set_to == [1, max(threads, 2)] and len(seen) == 2
    set_to.clear()
    monkeypatch.setattr(attention, "SMALL_CALL", 10)
    attention.ragged_sdpa(q, keys, values, None, ((0, 10), (10, 20)))
    assert set_to == []


def test_one_thread_blocks_overlapping_in_two_threads_give_the_count_back():
    """The thread count is the process's: blocks open in two threads at once (a server's requests) leave it
    as they found it, whichever closes first."""
    import threading

    from kvmerge.attention import one_thread

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        inside = []

        def first():
            with one_thread(torch.device("cpu"), 1):
                a_in.set()
                b_in.wait(10)
                inside.append(torch.get_num_threads())
            a_out.set()

        def second():
            a_in.wait(10)
            with one_thread(torch.device("cpu"), 1):
                b_in.set()
                a_out.wait(10)
                inside.append(torch.get_num_threads())

        threads = [threading.Thread(target=f) for f in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert inside == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
