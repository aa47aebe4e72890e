"""The embedded synthetic verifiable task: integer addition, "123+456=" -> "579".

Everything here is built locally (tokenizer, model, data), so the GRPO demo runs offline on a CPU:

    tokenizer = make_addition_tokenizer()
    task = AdditionTask(num_digits=3, seed=0)
    model = build_tiny_model(tokenizer)
    sft_warm_start(model, tokenizer, task)            # trainers.warm_start: a short supervised warm start
    greedy_accuracy(model, tokenizer, task)           # {"exact": ..., "reward": ...}
    addition_reward(prompts, completions, answer=answers)   # reward-function convention

Operands are zero-padded by default ("007+045=" -> "52"). The tokenizer has one token per
character (digits, "+", "=") plus pad/bos/eos/unk, and prepends bos when asked for special
tokens (the default), so a prompt string tokenizes exactly as the warm start saw it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
CHARS = tuple("0123456789+=")

# ---------------------------------------------------------------------------------------- tokenizer


def make_addition_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer for the addition task, built offline.

    Vocabulary (16 ids): ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3, digits ``0``-``9``
    4-13, ``+`` 14, ``=`` 15. Encoding with ``add_special_tokens=True`` (the default) prepends
    ``<bos>``; ``decode`` joins characters with no spaces. Padding side is left (for ``generate``).
    Round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``. Its chat template writes
    ``<bos>`` and the messages' text (so a chat request on the demo model means what a completion does).
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # NOTE: an empty pattern with "isolated" splits into single characters.
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()  # concatenate tokens; WordLevel's default joins with spaces
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",
        model_max_length=128,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# NOTE: chat on the demo model (`rollout serve runs/grpo/final`): the messages' text after <bos>, the same ids
# as the completion prompt "123+456=" ; the model knows no roles, so none are written
CHAT_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"


# --------------------------------------------------------------------------------------------- task


class AdditionTask:
    """Random additions of two non-negative integers with at most ``num_digits`` digits each.

    Args:
        num_digits: digits per operand (operands are uniform in ``[0, 10**num_digits)``).
        seed: seed of the task's own stream, used by ``sample(n)`` when no seed is given.
        pad_operands: write operands zero-padded to ``num_digits`` ("007+045="), so every prompt
            has the same length and digit i of both operands sits at a fixed distance. The
            answer is never padded ("52").

    ``sample`` returns ``[{"prompt": "123+456=", "answer": "579"}, ...]``.
    """

    def __init__(self, num_digits: int = 3, seed: int = 0, pad_operands: bool = True) -> None:
        if num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {num_digits}")
        self.num_digits = num_digits
        self.seed = seed
        self.pad_operands = pad_operands
        self._rng = random.Random(seed)

    @property
    def max_answer_len(self) -> int:
        """Longest answer in characters (one carry digit more than an operand)."""
        return self.num_digits + 1

    def sample(self, n: int, seed: int | random.Random | None = None) -> list[dict[str, str]]:
        """``n`` problems. ``seed``: an int (fresh, reproducible stream), a ``random.Random``
        (drawn from and advanced), or None (the task's own stream, advanced between calls)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if seed is None:
            rng = self._rng
        elif isinstance(seed, random.Random):
            rng = seed
        else:
            rng = random.Random(seed)
        hi, width = 10**self.num_digits, self.num_digits if self.pad_operands else 0
        out = []
        for _ in range(n):
            a, b = rng.randrange(hi), rng.randrange(hi)
            out.append({"prompt": f"{a:0{width}d}+{b:0{width}d}=", "answer": str(a + b)})
        return out

    def to_dataset(self, n: int, seed: int | None = None) -> Dataset:
        """A ``datasets.Dataset`` of ``n`` problems with columns ``prompt`` and ``answer``."""
        rows = self.sample(n, seed)
        return Dataset.from_dict(
            {"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]}
        )


# ------------------------------------------------------------------------------------------- reward


def _clean_completion(text: str) -> str:
    """Drop everything from the first eos text on, then trailing pad text and outer whitespace.

    NOTE: special-token text anywhere else stays, so it makes the completion garbage: stripping
    "<unk>" from "5<unk>79" would reward a malformed answer as exact.
    """
    text = text.split(EOS, 1)[0].strip()
    while text.endswith(PAD):
        text = text[: -len(PAD)].rstrip()
    return text


def score_answer(completion: str, answer: str) -> float:
    """Credit in [0, 1] for one decoded completion against the true answer.

    1.0 for the exact answer. Otherwise the fraction of right-aligned digit positions that
    match, over the longer of the two lengths, halved when the lengths differ. 0.0 for an empty
    completion or one with anything but ASCII digits before its first eos text (trailing pad text
    and whitespace aside).
    """
    pred, answer = _clean_completion(completion), str(answer).strip()
    if not pred or not pred.isascii() or not pred.isdigit():
        return 0.0
    if pred == answer:
        return 1.0
    matches = sum(p == a for p, a in zip(reversed(pred), reversed(answer), strict=False))
    credit = matches / max(len(pred), len(answer))
    if len(pred) != len(answer):
        credit *= 0.5
    # NOTE: a non-exact digit string always misses a position, so credit < 1 here.
    return credit


def addition_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **kwargs
) -> list[float]:
    """Reward function ``(prompts, completions, **dataset_columns) -> list[float]``.

    Args:
        prompts: the prompts (unused; part of the convention).
        completions: decoded completion strings, one per sample.
        answer: the dataset's ``answer`` column, aligned with ``completions``.
    Returns:
        one credit in [0, 1] per completion (see ``score_answer``).
    """
    if len(completions) != len(answer):
        raise ValueError(f"answer has {len(answer)} entries but completions has {len(completions)}")
    return [score_answer(c, a) for c, a in zip(completions, answer, strict=True)]


# -------------------------------------------------------------------------------------------- model


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int | None = None,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 128,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A freshly initialised fp32 Qwen3 causal LM sized to ``tokenizer`` (no download).

    ``intermediate_size`` defaults to 4x ``hidden_size``; ``num_kv_heads`` to ``num_heads``.
    Initialisation is seeded by ``seed`` without touching the global RNG.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.float()


# -------------------------------------------------------------------------------------------- eval


@torch.no_grad()
def greedy_accuracy(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    task: AdditionTask,
    n: int = 256,
    seed: int = 12345,
    batch_size: int = 256,
) -> dict[str, float]:
    """Greedy ``model.generate`` (left padding) on ``n`` held-out problems.

    Returns ``{"exact": share of exact answers, "reward": mean addition_reward}``. The model's
    train/eval mode is restored afterwards.
    """
    rows = task.sample(n, seed)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    completions: list[str] = []
    for i in range(0, n, batch_size):
        chunk = rows[i : i + batch_size]
        enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True, padding_side="left")
        out = model.generate(
            input_ids=enc.input_ids.to(device),
            attention_mask=enc.attention_mask.to(device),
            max_new_tokens=task.max_answer_len + 1,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )  # [B, P + T]
        # NOTE: keep special tokens so the verifier cuts at eos, as it would in a rollout.
        completions += tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :])
    model.train(was_training)
    rewards = addition_reward([r["prompt"] for r in rows], completions, answer=[r["answer"] for r in rows])
    exact = sum(r == 1.0 for r in rewards) / max(n, 1)
    return {"exact": exact, "reward": sum(rewards) / max(n, 1)}
