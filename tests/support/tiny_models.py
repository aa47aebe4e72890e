"""Tiny random models of several architectures, built locally (no download).

`initializer_range` is raised so logits are peaked: greedy comparisons against `model.generate` must
not hinge on near-ties that differ in the last bit between two correct attention kernels.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    GptOssConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    OlmoeConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, initializer_range=0.3)


def _llama() -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024, **COMMON)


def _qwen3() -> Qwen3Config:
    return Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, **COMMON)


def _mistral(sliding_window: int = 24) -> MistralConfig:
    return MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024, sliding_window=sliding_window,
                         **COMMON)


def _gemma2() -> Gemma2Config:
    return Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=16,
                        query_pre_attn_scalar=16, attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                        **COMMON)


def _gpt2() -> GPT2Config:
    return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **COMMON)


def _gpt_neox() -> GPTNeoXConfig:
    return GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         rotary_pct=0.5, max_position_embeddings=1024, **COMMON)


def _phi3() -> Phi3Config:
    return Phi3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2, **COMMON)


# NOTE: mixture-of-experts models: 8 (gpt-oss 4) experts, 2 per token, every layer sparse; gpt-oss with its
# sinks and a sliding layer. Routers are initialised like the other weights (peaked, no near-ties).
def _qwen3_moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                          num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=1024, **COMMON)


def _mixtral() -> MixtralConfig:
    return MixtralConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=1024, **COMMON)


def _olmoe() -> OlmoeConfig:
    return OlmoeConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=1024,
                       eos_token_id=2, pad_token_id=1, **COMMON)


def _gpt_oss() -> GptOssConfig:
    return GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                        max_position_embeddings=1024, **COMMON)


CONFIGS = {
    "llama": _llama,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "phi3": _phi3,
}
# NOTE: apart from CONFIGS, whose matrices (batch-invariant mode...) do not all take MoE models
MOE_CONFIGS = {"qwen3_moe": _qwen3_moe, "mixtral": _mixtral, "olmoe": _olmoe, "gpt_oss": _gpt_oss}
MOE_ARCHS = list(MOE_CONFIGS)


def make_model(arch: str = "qwen3", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A tiny random model in eval mode; Gemma 2 and gpt-oss use eager attention (no sdpa path), and gpt-oss's
    sinks are drawn so that they matter (they start at 0)."""
    torch.manual_seed(seed)
    make = CONFIGS.get(arch) or MOE_CONFIGS[arch]
    config = make(**overrides)
    attn = "eager" if arch in ("gemma2", "gpt_oss") else "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if arch == "gpt_oss":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    return model.eval()


def random_prompts(n: int, lo: int, hi: int, seed: int = 0, shared_prefix: int = 0, n_shared: int = 0):
    """`n` random prompts of lengths in [lo, hi]; the last `n_shared` start with a common prefix."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, VOCAB, (shared_prefix,), generator=g).tolist()
    out = []
    for i in range(n):
        length = int(torch.randint(lo, hi + 1, (1,), generator=g))
        body = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        out.append(prefix + body[: max(3, length - shared_prefix)] if i >= n - n_shared else body)
    return out


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: plain `model.generate`, one prompt at a time, no EOS."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def teacher_forced_logits(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """fp32 logits [len(completion), V] predicting each completion token."""
    ids = torch.tensor([prompt + completion], device=model.device)
    logits = model(ids).logits[0].float()
    return logits[len(prompt) - 1 : -1]


@torch.no_grad()
def teacher_forced_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """fp32 log_softmax(logits / temperature) of each completion token, [len(completion)], teacher-forced."""
    logprobs = (teacher_forced_logits(model, prompt, completion) / temperature).log_softmax(-1)
    rows = torch.arange(len(completion), device=logprobs.device)
    return logprobs[rows, torch.tensor(completion, device=logprobs.device)]
