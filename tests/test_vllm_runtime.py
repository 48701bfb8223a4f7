"""The vLLM plugin's runtime interface (kvmerge/vllm/compress.py imports no vLLM, so this runs in the
main venv): what methods read through it equals what they read through the transformers runtime, so
that Expected Attention's rotation and the surprisal of `mixedmerge` are the same numbers inside
vLLM as in kvmerge's runtime."""

import torch

from kvmerge import Session, get_method
from kvmerge.vllm.compress import build_method, compress_prompt, prompt_surprisal
from kvmerge.vllm.runtime import VllmRuntime
from kvmerge.vllm.config import Settings, refusal

from .conftest import random_ids, tiny_model


def test_the_vllm_runtimes_rotary_gives_the_models_rotation():
    model = tiny_model("llama")
    ours, theirs = get_method("expectedattention"), get_method("expectedattention")
    ours.setup_all(VllmRuntime(model.config))
    theirs.setup_all(Session(model, 1).runtime)
    positions = torch.arange(0, 3000, 7)
    for a, b in zip(ours._cos_sin(positions), theirs._cos_sin(positions)):
        assert torch.equal(a, b)
    cos, _ = ours._cos_sin(positions)
    assert not torch.allclose(cos, torch.ones_like(cos))  # a real rotation, not the probe's unit one


def test_prompt_surprisal_equals_the_runtimes():
    model = tiny_model("llama")
    ids = random_ids(60, seed=3)
    want = Session(model, 1).forward_surprisal([ids])[0]
    hidden = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, o: hidden.append(o[0]))
    with torch.inference_mode():
        model(input_ids=torch.tensor([ids]))
    hook.remove()
    got = prompt_surprisal(model.get_output_embeddings().weight, model.config, hidden[0][0], torch.tensor(ids))
    assert got.shape == (60,) and got[0] == 0 and float(got[1:].min()) > 0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_methods_that_read_the_rotary_or_surprisal_are_accepted_and_others_are_not():
    assert get_method("mixedmerge").needs.tokenizer and get_method("mixedmerge").needs.rotary  # the sentence ends
    assert not get_method("expectedattention").needs.tokenizer
    for name in ("mixedmerge", "surprisemerge", "surprisal", "expectedattention", "mixedattention"):
        assert refusal(get_method(name)) is None, name
    assert refusal(get_method("kvzip")).startswith("kvzip")
    assert "sliding=0.5 shortens sliding-window layers" in refusal(get_method("snapkv", sliding=0.5))


def test_compress_prompt_passes_the_surprisal_and_a_pre_sliced_query_window():
    """`surprisal` reaches the method's context as `(1, P)`, and a query window already cut to the
    method's window gives the same entries as all the prompt's queries."""
    torch.manual_seed(0)
    p, h, d = 96, 2, 8
    q, k, v = torch.randn(p, 2 * h, d), torch.randn(p, h, d), torch.randn(p, h, d)
    ids = torch.tensor(random_ids(p, seed=1))
    snap = get_method("snapkv", budget=0.25)
    whole = compress_prompt(snap, 0, 2, q, k, v, ids, 0.3, 24)
    cut = compress_prompt(snap, 0, 2, q[-snap.needs.queries:], k, v, ids, 0.3, 24)
    assert torch.equal(whole.keys, cut.keys) and torch.equal(whole.values, cut.values)
    seen, scores = [], snap.scores
    snap.scores = lambda keys, log_n, ctx: (seen.append(ctx.surprisal), scores(keys, log_n, ctx))[1]
    surprisal = torch.linspace(0, 5, p)
    compress_prompt(snap, 0, 2, q, k, v, ids, 0.3, 24, surprisal)
    assert torch.equal(seen[0], surprisal[None])


def test_the_worker_sets_up_a_method_that_reads_only_the_rotary_embedding():
    """expectedattention's setup reads the rotary embedding and no tokenizer: the worker's method gets
    the runtime all the same, no tokenizer is loaded, and its rotation is the model's."""
    model = tiny_model("llama")
    method, runtime = build_method(Settings("expectedattention", 0.25), None, model.config)
    assert runtime.tokenizer is None
    theirs = get_method("expectedattention")
    theirs.setup_all(Session(model, 1).runtime)
    positions = torch.arange(0, 300, 11)
    for a, b in zip(method._cos_sin(positions), theirs._cos_sin(positions)):
        assert torch.equal(a, b)
