"""Graph decoding (`kvmerge.graphs.GraphDecoder`): fixed-shape steps equal the session's own decoding
(tokens exactly, logits to rounding, the cache it leaves), every step runs the same operators on the
same shapes with no value read back to the host (what a CUDA graph's capture needs), and misuse is
refused. The CUDA rows replay a captured graph against the eager steps."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvmerge
import kvmerge.decoding
import kvmerge.generation
from kvmerge import graphs
from kvmerge.errors import InputError, UnsupportedError
from kvmerge.graphs import GraphDecoder, GraphLayer, PackedGraphLayer

from .conftest import TinyTokenizer, random_ids, tiny_model
from .test_hybrid import gemma3

STEPS = 12
# reads of a tensor's value on the host: a CUDA graph cannot capture them
HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.is_nonzero.default",
              "aten.equal.default", "aten.item.default", "aten.masked_select.default", "aten._unique2.default",
              "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor", "aten.nonzero_static.default"}
CASES = {  # name: (model, method, prompt lengths)
    "full": (tiny_model, "full", (300, 250)),
    "selected": (tiny_model, "snapkv", (300, 250)),
    "merged": (tiny_model, "kmeans", (300, 250)),
    "heads at their own lengths": (tiny_model, "snapkv:alloc=head", (300, 300)),
    "hybrid, past the window": (gemma3, "snapkv", (300, 250)),
    "hybrid, sliding layers holding 3": (gemma3, "snapkv:window=4:sliding=3", (300,)),
    "hybrid, the default there": (gemma3, "learnedzip:sliding=0.75", (300,)),
}


def prefilled(make_model, spec, lengths, device="cpu", dtype=torch.float32):
    model = make_model().to(device, dtype)
    session = kvmerge.Session(model, len(lengths), None if spec == "full" else kvmerge.get_method(spec, budget=0.25))
    logits = session.prefill([random_ids(n, seed=i) for i, n in enumerate(lengths)])
    return session, logits.argmax(-1)


def decoded(session, first, graph=None):
    """Greedy tokens `(steps, batch)` and logits `(steps, batch, vocab)`, then the logits of one more
    token fed by the session itself (what the cache left behind answers)."""
    tokens, logits, ids = [], [], first
    with torch.inference_mode():
        if graph is None:
            for _ in range(STEPS):
                logits.append(session.forward([[int(x)] for x in ids]))
                ids = logits[-1].argmax(-1)
                tokens.append(ids)
        else:
            with GraphDecoder(session, STEPS, graph=graph) as decoder:
                for _ in range(STEPS):
                    logits.append(decoder.step(ids).clone())
                    ids = logits[-1].argmax(-1)
                    tokens.append(ids)
        after = session.forward([[5]] * len(ids))
    return torch.stack(tokens), torch.stack(logits), after


@pytest.mark.parametrize("case", CASES)
def test_graph_decoding_equals_the_sessions_own(case):
    make_model, spec, lengths = CASES[case]
    ref, first = prefilled(make_model, spec, lengths)
    ragged = [layer.ragged for layer in ref.cache.layers]
    merged = any(bool((layer.kv().log_n > 0).any()) for layer in ref.cache.layers)  # an entry for several tokens
    assert merged == (spec == "kmeans") and any(ragged) == (spec.endswith("alloc=head") or "learnedzip" in spec)
    want = decoded(ref, first)
    session, _ = prefilled(make_model, spec, lengths)
    got = decoded(session, first, graph=False)
    assert torch.equal(got[0], want[0])
    assert torch.allclose(got[1], want[1], atol=1e-5, rtol=0)
    assert torch.allclose(got[2], want[2], atol=1e-5, rtol=0)
    assert session.cache.entries == ref.cache.entries and session.seen.tolist() == ref.seen.tolist()
    assert [layer.ragged for layer in session.cache.layers] == ragged  # packed again where it was


def test_heads_at_their_own_lengths_stay_packed_while_decoding():
    session, first = prefilled(tiny_model, "snapkv:alloc=head", (300, 300))
    layer, steps = session.cache.layers[0], 4
    rows, d, lens = layer.keys.shape[0], layer.keys.shape[-1], layer._lens
    assert len(set(lens)) > 1  # the heads hold different counts
    slot = rows * (2 * d * 4 + 4)  # keys, values and log-mass of one slot, float32, every row
    with torch.inference_mode(), GraphDecoder(session, steps, graph=False) as decoder:
        fixed = session.cache.layers[0]
        for _ in range(steps):
            decoder.step(first)
        assert isinstance(fixed, PackedGraphLayer)
        assert fixed.nbytes == sum(n + steps for n in lens) * slot < len(lens) * (max(lens) + steps) * slot
    assert layer.ragged and layer._lens == tuple(n + steps for n in lens)


class Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((str(func), tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", ["merged", "heads at their own lengths", "hybrid, past the window"])
def test_every_step_runs_the_same_operators_without_reading_a_value_back(case):
    make_model, spec, lengths = CASES[case]
    session, first = prefilled(make_model, spec, lengths)
    traces = []
    with torch.inference_mode(), GraphDecoder(session, 3, graph=False) as decoder:
        decoder.ids.copy_(first[:, None])
        for _ in range(3):
            with Trace() as trace:
                decoder._forward()  # what a graph captures: the model's forward and the counters' advance
            traces.append(trace.ops)
    forward = [op for op in traces[0] if op[0] == "aten.embedding.default"]
    assert len(forward) == 1 and len(traces[0]) > 50  # the model's forward was traced
    assert traces[0] == traces[1] == traces[2]
    assert not [op for op in traces[0] if op[0] in HOST_READS]


def test_misuse_is_refused_with_the_reason():
    session, first = prefilled(tiny_model, "snapkv", (300,))
    for steps in (0, 2.0, True):
        with pytest.raises(InputError, match="steps must be a positive int"):
            GraphDecoder(session, steps)
    with pytest.raises(InputError, match="needs the model on a CUDA device; it is on cpu"):
        GraphDecoder(session, 4, graph=True)
    with GraphDecoder(session, 2, graph=False) as decoder:
        with pytest.raises(InputError, match="already in a GraphDecoder"):
            GraphDecoder(session, 2)
        with pytest.raises(InputError, match="one token per row: the session has 1 rows, got 2"):
            decoder.step([1, 2])
        decoder.step(first)
        decoder.step(first)
        with pytest.raises(InputError, match="room for 2 steps"):
            decoder.step(first)
    with pytest.raises(InputError, match="closed"):
        decoder.step(first)
    assert session.seen.tolist() == [302]
    policy = kvmerge.Session(tiny_model(), 1, kvmerge.get_method("centroidkv", budget=0.25))
    policy.prefill([random_ids(300)])
    with pytest.raises(InputError, match="decode policy"):
        GraphDecoder(policy, 4)


def test_a_failure_on_the_way_in_leaves_the_session_as_it_was(monkeypatch):
    ref, first = prefilled(gemma3, "snapkv", (300, 250))
    session, _ = prefilled(gemma3, "snapkv", (300, 250))
    built = []
    real = GraphLayer.__init__

    def fails_third(self, *args):
        if len(built) == 2:
            raise MemoryError("out of memory (simulated)")
        built.append(real(self, *args))
    monkeypatch.setattr(GraphLayer, "__init__", fails_third)
    with pytest.raises(MemoryError):
        GraphDecoder(session, 4)
    monkeypatch.undo()
    assert session.cache.listener is not None and session.cache.entries == ref.cache.entries
    assert torch.equal(decoded(session, first, graph=False)[0], decoded(ref, first)[0])


def test_a_failed_capture_leaves_the_session_as_it_was(monkeypatch):
    ref, first = prefilled(tiny_model, "snapkv:alloc=head", (300, 300))
    session, _ = prefilled(tiny_model, "snapkv:alloc=head", (300, 300))

    def fails(self):
        raise UnsupportedError("this model's decoding step cannot be captured (simulated)")
    monkeypatch.setattr(graphs, "refuse_graph", lambda *_: None)  # as if on CUDA
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())
    monkeypatch.setattr(GraphDecoder, "_capture", fails)
    with pytest.raises(UnsupportedError, match="cannot be captured"):
        GraphDecoder(session, 4, graph=True)
    monkeypatch.undo()
    assert [layer.ragged for layer in session.cache.layers] == [layer.ragged for layer in ref.cache.layers]
    assert torch.equal(decoded(session, first, graph=False)[0], decoded(ref, first)[0])


def test_the_session_is_refused_while_a_decoder_holds_its_cache():
    session, first = prefilled(tiny_model, "snapkv", (300,))
    with torch.inference_mode(), GraphDecoder(session, 2, graph=False):
        for use in (lambda: session.forward([[1]]), session.snapshot, lambda: session.reserve(4),
                    lambda: session.repeat_rows(2), lambda: session.compress()):
            with pytest.raises(InputError, match="in a GraphDecoder: close it"):
                use()
    session.forward([[1]])  # closed: the session's own again


def test_generate_with_cuda_graph_decodes_through_the_decoder(monkeypatch):
    """The wiring of `generate_ids(..., cuda_graph=True)`, its fixed-shape steps run eagerly on the CPU."""
    opened = []

    class Eager(GraphDecoder):
        def __init__(self, session, steps, graph=None):
            opened.append(steps)
            super().__init__(session, steps, graph=False)
    monkeypatch.setattr(graphs, "refuse_graph", lambda *_: None)
    monkeypatch.setattr(kvmerge.decoding, "GraphDecoder", Eager)
    model, rows, questions = tiny_model(), [random_ids(300), random_ids(250, seed=1)], [random_ids(5, seed=9)] * 2
    plain = kvmerge.generate_ids(model, rows, questions, "kmeans", max_new_tokens=10, eos_token_id=7)
    graph = kvmerge.generate_ids(model, rows, questions, "kmeans", max_new_tokens=10, eos_token_id=7, cuda_graph=True)
    assert opened == [9] and graph.tokens == plain.tokens and "graph_capture_seconds" in graph.stats
    assert graph.stats["final_cache_bytes"] == plain.stats["final_cache_bytes"]
    # several questions from one compressed prefill, and answers from a compressed context
    asks = [random_ids(5, seed=9), random_ids(7, seed=8)]
    plain = kvmerge.answer_questions_ids(model, rows[0], asks, "snapkv", max_new_tokens=6)
    graph = kvmerge.answer_questions_ids(model, rows[0], asks, "snapkv", max_new_tokens=6, cuda_graph=True)
    assert [o.tokens for o in graph] == [o.tokens for o in plain] and opened[1:] == [5, 5]
    class Tok(TinyTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))
    tok = Tok()
    context = kvmerge.compress_context(model, tok, rows[0], "snapkv", 0.25)
    plain, graph = (context.generate_ids(asks[1], max_new_tokens=6, cuda_graph=flag) for flag in (False, True))
    assert graph.tokens == plain.tokens and opened[3:] == [5]
    other = kvmerge.compress_context(model, tok, rows[1], "snapkv", 0.25)
    monkeypatch.setattr(type(context), "question_ids", lambda _, q: random_ids(len(q), seed=3))  # no text tokenizer
    plain, graph = (kvmerge.answer_contexts(model, tok, [context, other], ["a b", "c d e"], max_new_tokens=6,
                                            cuda_graph=flag) for flag in (False, True))
    assert graph.tokens == plain.tokens and opened[4:] == [5]


def test_generate_with_cuda_graph_refuses_before_any_forward():
    model, calls = tiny_model(), []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    ids, question = random_ids(300), random_ids(5, seed=9)
    with pytest.raises(InputError, match="needs the model on a CUDA device; it is on cpu"):
        kvmerge.generate_ids(model, ids, question, "snapkv", cuda_graph=True)
    with pytest.raises(InputError, match="centroidkv chooses entries while decoding"):
        kvmerge.generate_ids(model, ids, question, "centroidkv", cuda_graph=True)
    with pytest.raises(kvmerge.KVMergeError, match="cuda_graph must be True or False"):
        kvmerge.generate_ids(model, ids, question, "snapkv", cuda_graph="yes")
    assert not calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("spec", ["snapkv", "kmeans", "learnedzip"])
def test_generate_with_a_cuda_graph_answers_as_without(spec):
    model = tiny_model().cuda()
    rows, questions = [random_ids(300), random_ids(250, seed=1)], [random_ids(5, seed=9)] * 2
    if spec == "learnedzip":
        rows = [random_ids(300), random_ids(300, seed=1)]
    plain = kvmerge.generate_ids(model, rows, questions, spec, max_new_tokens=12)
    graph = kvmerge.generate_ids(model, rows, questions, spec, max_new_tokens=12, cuda_graph=True)
    assert graph.tokens == plain.tokens and graph.stats["graph_capture_seconds"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_a_replayed_cuda_graph_equals_the_eager_steps(case, dtype):
    make_model, spec, lengths = CASES[case]
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    runs = []
    for graph in (None, False, True):  # the session's own steps, the fixed-shape ones eagerly, replayed
        session, first = prefilled(make_model, spec, lengths, "cuda", dtype)
        runs.append((decoded(session, first, graph=graph), session.cache.entries))
    (own, own_entries), (eager, entries), (replayed, replayed_entries) = runs
    assert torch.equal(replayed[0], eager[0]) and replayed_entries == entries == own_entries  # the same kernels
    assert torch.allclose(replayed[1], eager[1], atol=tol, rtol=0)
    assert torch.allclose(replayed[2], eager[2], atol=tol, rtol=0)  # what the cache written back answers
    # against the session's own steps (other kernels: bf16 rounds otherwise, so its tokens may part later)
    assert torch.allclose(replayed[1][0], own[1][0], atol=tol, rtol=0)
    if dtype == torch.float32:
        assert torch.equal(replayed[0], own[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_a_one_step_graph_on_cuda():
    eager, first = prefilled(tiny_model, "snapkv", (300,), "cuda")
    want = eager.forward([[int(first[0])]])
    session, _ = prefilled(tiny_model, "snapkv", (300,), "cuda")
    with torch.inference_mode(), GraphDecoder(session, 1) as decoder:
        assert decoder.graph
        got = decoder.step(first).clone()
    assert torch.allclose(got, want, atol=1e-4, rtol=0) and session.seen.tolist() == eager.seen.tolist()
