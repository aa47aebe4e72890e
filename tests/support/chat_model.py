"""A tiny chat model built offline: a character-level tokenizer over printable ASCII with a chat
template, and a small random Qwen3, saved with `save_pretrained` (the shape of a hub instruct model).

    python tests/support/chat_model.py runs/tiny_chat      # writes model + tokenizer there
"""

from __future__ import annotations

import string
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

SPECIAL = ("<pad>", "<bos>", "<eos>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def make_chat_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, the specials above, and `CHAT_TEMPLATE`."""
    chars = [c for c in string.printable if c not in "\r\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL + tuple(chars))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def make_tiny_chat_model(tokenizer, seed: int = 0) -> Qwen3ForCausalLM:
    """A random Qwen3 (hidden 32, 1 layer) over the chat tokenizer's vocabulary."""
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    torch.random.set_rng_state(generator_state)  # NOTE: leave the caller's global RNG as it was
    return model


def save_tiny_chat_model(path: str, seed: int = 0) -> str:
    """Save `make_tiny_chat_model` and the chat tokenizer to `path`."""
    tokenizer = make_chat_tokenizer()
    model = make_tiny_chat_model(tokenizer, seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


if __name__ == "__main__":
    print(save_tiny_chat_model(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny_chat"))
