"""Attention features are implemented or refused, never dropped (issue 13, item 4): gpt-oss sinks run
exactly in the gather path, Llama 4's chunked attention is refused at construction, and any attention
argument the paged attention does not understand is refused."""

from __future__ import annotations

import functools

import pytest
import torch
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import AutoModelForCausalLM, GenerationConfig, GptOssConfig, Llama4TextConfig

from rollout import ContinuousBatchingConfig, generate_batch
from rollout.attention.interface import paged_attention_forward
from rollout.engine.core import EngineCore

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=6)


@functools.cache
def gpt_oss():
    torch.manual_seed(0)
    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          vocab_size=128, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                          max_position_embeddings=1024, initializer_range=0.3)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)  # sinks that matter (they start at 0)
    return model


def test_gpt_oss_sinks_match_hf_greedy():
    model = gpt_oss()
    prompts = random_prompts(5, 3, 30, seed=4) + [list(range(1, 41))] * 3  # windows moved on; a group
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=32)  # chunked prompts
    out = generate_batch(model, prompts, GREEDY, cfg)
    for i, p in enumerate(prompts):
        assert out[f"req_{i}"].generated_tokens == hf_greedy(model, p, 6), i


def test_sinks_are_refused_by_backends_without_them():
    with pytest.raises(ValueError, match="sinks"):
        EngineCore(gpt_oss(), GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8, attn_backend="cpu"))


def test_llama4_chunked_attention_is_refused_at_construction():
    config = Llama4TextConfig(hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
                              vocab_size=128, attention_chunk_size=16, max_position_embeddings=1024)
    assert "chunked_attention" in config.layer_types
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="chunked_attention"):
        EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=8))


def test_an_unknown_attention_argument_is_refused():
    model = make_model("qwen3")
    attn = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 3, 16)
    kv = torch.zeros(1, 2, 3, 16)
    with pytest.raises(ValueError, match="block_table_override"):
        paged_attention_forward(attn, q, kv, kv, None, scaling=0.25, rollout_meta=object(), block_table_override=1)
    with pytest.raises(ValueError, match="dropout"):
        paged_attention_forward(attn, q, kv, kv, None, scaling=0.25, rollout_meta=object(), dropout=0.1)
