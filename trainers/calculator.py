"""The embedded agentic task: multi-digit addition with a calculator tool, built offline.

A user message holds a problem ("4821+377"); the model either answers at once ("5198") or calls the
calculator by writing `<tool_call>` and an expression ("<tool_call>4821+377"), which ends its turn; the
environment answers with a `tool` message holding the result ("5198"), and the model answers in its next
turn. Reward 1 for the exact sum in the final answer, else 0. A tiny model cannot add 4-digit numbers, but
it can copy, so the tool is the way to a high reward:

    tokenizer = make_calculator_tokenizer()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2)       # trainers.tasks
    calculator_warm_start(model, tokenizer, tool_share=0.15)    # SFT: 15% of demos use the tool
    batch = run_episodes(engine, CalculatorEnv, rows, group_size=8, max_turns=2)   # rollout.agents

Conversations go through the tokenizer's chat template (`<|user|>...<eos><|assistant|>...<eos>
<|tool|>...<eos><|assistant|>`); the warm start's demos are built with the same `ChatBridge` that
`run_episodes` uses, so supervised and RL trajectories are the same token sequences.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Sequence

import torch
from datasets import Dataset
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rollout.agents import Action, ChatBridge
from trainers.warm_start import SupervisedSteps, pad_right

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ROLES = ("<|user|>", "<|assistant|>", "<|tool|>")
CALL = "<tool_call>"  # NOTE: an added token that is not special: it survives decoding without specials
CHARS = tuple("0123456789+")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
_EXPRESSION = re.compile(r"\s*(\d{1,12})\s*\+\s*(\d{1,12})\s*")


def make_calculator_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (digits, "+"), the specials pad/bos/eos/unk, one token per chat role and
    the tool-call marker `<tool_call>`; `CHAT_TEMPLATE` as its chat template."""
    names = (PAD, BOS, EOS, UNK, *ROLES, CALL, *CHARS)
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([PAD, BOS, EOS, UNK, *ROLES])
    backend.add_tokens([AddedToken(CALL, special=False, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                        unk_token=UNK, padding_side="left", model_max_length=256)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def calculator_problems(n: int, num_digits: int = 4, seed: int = 0) -> list[dict[str, str]]:
    """`n` problems `{"prompt": "4821+0377", "answer": "5198"}`: operands uniform in [0, 10**num_digits),
    zero-padded to `num_digits` (every prompt has the same length, so copying is a fixed offset)."""
    rng = random.Random(seed)
    hi = 10**num_digits
    rows = []
    for _ in range(n):
        a, b = rng.randrange(hi), rng.randrange(hi)
        rows.append({"prompt": f"{a:0{num_digits}d}+{b:0{num_digits}d}", "answer": str(a + b)})
    return rows


def calculator_dataset(n: int, num_digits: int = 4, seed: int = 0) -> Dataset:
    rows = calculator_problems(n, num_digits, seed)
    return Dataset.from_dict({k: [r[k] for r in rows] for k in ("prompt", "answer")})


def calculate(expression: str) -> str:
    """The calculator: "a+b" (non-negative integers) -> the sum as text; anything else -> "error"."""
    match = _EXPRESSION.fullmatch(expression)
    return str(int(match[1]) + int(match[2])) if match else "error"


class CalculatorEnv:
    """One episode (`rollout.agents.Environment`): the user's problem, at most `max_calls` calculator calls
    (a model turn that starts with `<tool_call>`), then the answer turn, rewarded 1.0 when it is exactly the
    sum (0.0 otherwise). `calls` counts the tool calls made."""

    def __init__(self, max_calls: int = 1) -> None:
        self.max_calls = max_calls
        self.answer = ""
        self.calls = 0

    def reset(self, row) -> list[dict[str, str]]:
        self.answer, self.calls = str(row["answer"]), 0
        return [{"role": "user", "content": str(row["prompt"])}]

    def step(self, action: Action):
        text = str(action).strip()
        if text.startswith(CALL) and self.calls < self.max_calls:
            self.calls += 1
            return [{"role": "tool", "content": calculate(text[len(CALL):])}], 0.0, False
        return None, float(text == self.answer), True


# --------------------------------------------------------------------------------------- warm start


def demo_tokens(tokenizer, bridge: ChatBridge, row: dict[str, str], use_tool: bool,
                teach_call: bool = True) -> tuple[list[int], list[int]]:
    """One supervised episode `(input ids, labels)`: labels on the model's turns only (-100 elsewhere),
    token for token what `run_episodes` would produce for the same turns. `teach_call=False` leaves the
    `<tool_call>` token itself unlabelled (the demo teaches how to call, not whether to)."""
    eos = tokenizer.eos_token_id
    ids = bridge.first([{"role": "user", "content": row["prompt"]}])
    labels = [-100] * len(ids)

    def model_turn(text: str) -> list[int]:
        turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        ids.extend(turn)
        labels.extend(turn)
        return turn

    if use_tool:
        call = model_turn(CALL + row["prompt"])
        if not teach_call:
            labels[len(labels) - len(call)] = -100
        observation = bridge.next([{"role": "tool", "content": calculate(row["prompt"])}], call)
        ids.extend(observation)
        labels.extend([-100] * len(observation))
    model_turn(row["answer"])
    return ids, labels


def calculator_warm_start(
    model: torch.nn.Module,
    tokenizer,
    tool_share: float = 0.15,
    tool_demos: float = 0.5,
    steps: int = 300,
    batch_size: int = 64,
    lr: float = 3e-3,
    num_digits: int = 4,
    seed: int = 0,
    progress: bool = True,
) -> float:
    """Supervised warm start on a mix of episodes: a share `tool_demos` of them call the calculator (copy
    the problem into the call, then copy its result), the rest answer directly (the true sum, which a tiny
    model learns only poorly). The first token (`<tool_call>` or a digit) is labelled so that the policy
    starts calling the tool with probability `tool_share`: the `<tool_call>` label of a tool demo is kept
    with probability q, `tool_demos * q / (tool_demos * q + 1 - tool_demos) = tool_share`; so the warm start
    teaches how to use the tool on many demos and leaves whether to use it rare (RL's job). AdamW, constant
    `lr` after a short warmup, grad-norm clip 1.0; trains in place, leaves eval mode; returns the mean
    loss of the last 10 steps."""
    if not 0.0 <= tool_share <= tool_demos <= 1.0 or (tool_demos == 1.0 and tool_share < 1.0):
        raise ValueError(f"need 0 <= tool_share <= tool_demos <= 1 (and tool_demos < 1 unless tool_share is 1), "
                         f"got tool_share={tool_share}, tool_demos={tool_demos}")
    keep_call = 1.0 if tool_demos == 1.0 else tool_share * (1 - tool_demos) / (tool_demos * (1 - tool_share) or 1.0)
    rng = random.Random(seed)
    bridge = ChatBridge(tokenizer, [tokenizer.eos_token_id])
    sft = SupervisedSteps(model, lr, steps)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        rows = calculator_problems(batch_size, num_digits, seed=rng.randrange(1 << 30))
        demos = [demo_tokens(tokenizer, bridge, row, rng.random() < tool_demos, rng.random() < keep_call)
                 for row in rows]
        input_ids, _, labels = pad_right([ids for ids, _ in demos], [lab for _, lab in demos], tokenizer.pad_token_id)
        mean = sft(input_ids, labels)
        if progress and (step % 50 == 0 or step == steps):
            print(f"sft step {step}/{steps} loss {mean:.4f} ({time.perf_counter() - start:.1f}s)")
    model.eval()
    return sft.mean_loss


def episode_stats(batch, tokenizer) -> dict[str, float]:
    """Per-batch agent metrics of a `run_episodes` batch on `CalculatorEnv`: `tool_use_rate` (share of
    episodes whose first model turn called the calculator), `num_turns`, `model_tokens` (mean per episode)."""
    call = tokenizer.convert_tokens_to_ids(CALL)
    first = batch.completion_ids[:, 0] if batch.completion_ids.shape[1] else torch.zeros(0, dtype=torch.long)
    used = (first == call) & batch.loss_mask[:, 0].bool() if first.numel() else first.bool()
    return {
        "tool_use_rate": used.float().mean().item() if used.numel() else 0.0,
        "num_turns": batch.num_turns.float().mean().item(),
        "model_tokens": batch.trained_mask.sum(1).float().mean().item(),
    }


def describe(batch, tokenizer, rows: Sequence[int] = (0,)) -> list[str]:
    """Readable trajectories (specials kept) of some rows of a batch, for logs and the README."""
    out = []
    for r in rows:
        n = int(batch.completion_mask[r].sum())
        out.append(tokenizer.decode(batch.completion_ids[r, :n].tolist(), skip_special_tokens=False))
    return out
