"""Tiny random models built from configs (no downloads) and shared helpers."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a hub (kvmerge itself sets nothing)

import pytest  # noqa: E402
import torch
from transformers import (DynamicCache, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

import kvmerge

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
}


def tiny_model(arch="llama", seed=0, dtype=torch.float32, **overrides):
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = cfg_cls(**{**TINY, **extra, **overrides})
    config._attn_implementation = "sdpa"
    return model_cls(config).to(dtype).eval()


@pytest.fixture
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="session", autouse=True)
def tiny_scorers(tmp_path_factory):
    """Learned scorers (random weights) for the tiny models' shapes, so that `learnedzip` runs on them."""
    from kvmerge.scorer import LinearScorer, MLPScorer, fingerprint

    from .test_hybrid import gemma3

    folder = tmp_path_factory.mktemp("scorers")
    g = torch.Generator().manual_seed(0)
    for i, model in enumerate([tiny_model(), tiny_model(num_hidden_layers=3), gemma3()]):
        c = model.config
        d = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        layers = sum(1 for t in (getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
                     if t == "full_attention")
        size = (c.num_attention_heads + 2 * c.num_key_value_heads) * d + 1
        weights = [torch.randn(size, c.num_key_value_heads, generator=g) * 0.1 for _ in range(layers)]
        LinearScorer(weights, fingerprint(c), {"random": True}).save(folder / f"tiny{i}.safetensors")
        mlp = [{"mu": torch.zeros(size - 1), "sd": torch.ones(size - 1), "w1": torch.randn(size - 1, 8, generator=g) * 0.1,
                "b1": torch.zeros(8), "w2": torch.randn(8, c.num_key_value_heads, generator=g), "b2": torch.zeros(
                    c.num_key_value_heads)} for _ in range(layers)]
        MLPScorer(mlp, fingerprint(c), {"random": True}).save(folder / f"tiny{i}-mlp.safetensors")
    os.environ["KVMERGE_SCORERS"] = str(folder)
    yield folder
    os.environ.pop("KVMERGE_SCORERS", None)


def random_ids(n, seed=0, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def stock_logits(model, ids, steps):
    """Logits of stock sdpa + DynamicCache: prefill, then `steps` greedy decode steps."""
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        logits = model(torch.tensor([ids]), cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for _ in range(steps):
            nxt = logits.argmax(-1, keepdim=True)
            logits = model(nxt, cache=cache, use_cache=True).logits[:, -1]
            out.append(logits)
    return torch.cat(out)


def session_logits(model, ids, steps, method=None, split=None):
    """The same through kvmerge's Session (optionally compressing after the first `split` tokens)."""
    s = kvmerge.Session(model, 1, method)
    out = []
    with torch.no_grad():
        first = ids if split is None else ids[:split]
        logits = s.prefill([first])
        if split is not None:
            logits = s.forward([ids[split:]])
        out.append(logits)
        for _ in range(steps):
            logits = s.forward([[int(logits.argmax(-1))]])
            out.append(logits)
    return torch.cat(out), s


class TinyTokenizer:
    """Tokenizer stand-in for the tiny models: id 5 is ".", id 6 is ","; 0-2 are special."""

    all_special_ids = [0, 1, 2]
    PIECES = {5: ".", 6: ","}

    def __len__(self):
        return TINY["vocab_size"]

    def get_vocab(self):
        return {self.PIECES.get(i, f"w{i}"): i for i in range(len(self))}

    def convert_tokens_to_string(self, tokens):
        return " ".join(tokens)

    def __call__(self, text, add_special_tokens=False):
        """One id per character (ids 10 and up; "." → 5), for prompts a method writes itself."""
        return {"input_ids": [5 if c == "." else 10 + ord(c) % (TINY["vocab_size"] - 10) for c in text]}


def next_query(model, ids, method, layer: int):
    """Layer `layer`'s post-RoPE query for one more token after `ids` compressed by `method`, and the
    session: it depends only on token and position, so it must not depend on the compression."""
    s = kvmerge.Session(model, 1, method)
    with torch.no_grad():
        s.prefill([ids])
        s.forward([[9]], capture=1)
    return s.states[layer].queries, s
