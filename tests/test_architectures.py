"""The architecture matrix: every supported model type on a tiny random config passes the exactness
test (full cache == stock transformers) and the budget test; others are refused with a clear reason."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import kvmerge
from kvmerge.cache import bytes_per_token

from .conftest import random_ids, session_logits, stock_logits

DEC = dict(vocab_size=96, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=64, intermediate_size=96,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
SUPPORTED = {
    "llama": {}, "mistral": dict(sliding_window=None), "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2": {}, "qwen2_moe": dict(MOE, shared_expert_intermediate_size=48), "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(MOE, head_dim=16), "phi3": {}, "olmo": {}, "olmo2": {}, "gemma": dict(head_dim=16),
    "granite": dict(attention_multiplier=0.3), "starcoder2": {},
    "gemma3_text": dict(num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention"] * 2),
}


def build(model_type, **overrides):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**DEC, **overrides})
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_matrix_covers_every_supported_type():
    assert set(SUPPORTED) == set(kvmerge.model.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("model_type", sorted(SUPPORTED))
def test_full_cache_equals_stock_and_budgets_are_met(model_type):
    model = build(model_type, **SUPPORTED[model_type])
    ids = random_ids(60, seed=1)
    ref = stock_logits(model, ids, 8)
    got, _ = session_logits(model, ids, 8, method=kvmerge.get_method("full"), split=40)
    assert torch.allclose(ref, got, atol=1e-4)
    m = kvmerge.get_method("snapkv", budget=0.25, window=8)
    out = kvmerge.generate_ids(model, random_ids(120, seed=2), [5, 6], m, max_new_tokens=4)
    full_layers = kvmerge.MergedCache(model.config).compressible
    assert [out.stats["cache_entries"][i] for i in full_layers] == [30] * len(full_layers)
    per_layer = bytes_per_token(model.config, torch.float32) // model.config.num_hidden_layers
    assert out.stats["compressed_layers_bytes"] == 30 * per_layer * len(full_layers)


@pytest.mark.parametrize("model_type, config, reason", [
    ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=128, vocab_size=96), "unsupported model type 'gpt2'"),
    ("gpt_neox", dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=96), "unsupported model type 'gpt_neox'"),
    ("mistral", dict(DEC, sliding_window=16), "sliding-window layers only"),
])
def test_unsupported_architectures_are_refused_with_the_reason(model_type, config, reason):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))
    with pytest.raises(ValueError, match=reason):
        kvmerge.generate_ids(model, random_ids(40), [3], kvmerge.get_method("streamingllm", budget=0.5, window=4))


def test_encoder_decoder_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(d_model=16, d_kv=4, d_ff=16, num_layers=1, num_heads=2, vocab_size=32))
    with pytest.raises(ValueError, match="encoder-decoder"):
        kvmerge.check_supported(t5)
