"""Reward functions are called as TRL calls them; the math verifier extracts final answers."""

from __future__ import annotations

import math

import pytest
import torch

from trainers.rewards import score_completions
from trainers.verifiers import extract_final_answer, math_reward


# TRL-style functions, written as in TRL's documentation: keyword arguments, **kwargs for the rest.
def format_reward(completions, **kwargs):
    return [1.0 if c.strip().isdigit() else 0.0 for c in completions]


def accuracy(completions, solution, **kwargs):
    # None = "not applicable": rows without a reference solution are left out of the sum.
    return [None if s is None else float(c.strip() == s) for c, s in zip(completions, solution, strict=True)]


def never(completions, **kwargs):
    return [None] * len(completions)


def test_trl_style_functions_with_none_combine_like_trl():
    rows = [{"prompt": "1+1=", "solution": "2"}, {"prompt": "say hi", "solution": None}]
    completions = ["2", "x", "hi", "7"]
    rewards, metrics = score_completions(
        [format_reward, accuracy], rows, completions, group_size=2, weights=[0.5, 2.0]
    )
    # row 0: 0.5*1 + 2*1; row 1: 0 + 0; rows 2-3: accuracy is None, so only the format term counts
    assert rewards.tolist() == [2.5, 0.0, 0.0, 0.5]
    assert metrics["reward/format_reward"] == pytest.approx(0.5)
    assert metrics["reward/accuracy"] == pytest.approx(0.5)  # mean over the two rows it scored


def test_rows_no_function_scores_are_nan_and_functions_get_trl_kwargs():
    seen = {}

    def spy(prompts, completions, completion_ids, finish_reasons, trainer_state, log_metric, **columns):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, reasons=finish_reasons,
                    step=trainer_state.global_step, columns=columns)
        log_metric("custom", 3.0)
        return [None, 1.0]

    rows = [{"prompt": [{"role": "user", "content": "hi"}], "level": 3}]
    rewards, metrics = score_completions(
        [spy, never], rows, ["a", "b"], group_size=2,
        completion_ids=[[5, 2], [6]], finish_reasons=["stop", "length"],
        trainer_state=type("State", (), {"global_step": 7})(),
    )
    assert math.isnan(rewards[0].item()) and rewards[1].item() == 1.0
    assert math.isnan(metrics["reward/never"]) and metrics["custom"] == 3.0
    # conversational rows: completions as assistant messages, prompts as given, columns repeated
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert seen["prompts"] == [rows[0]["prompt"]] * 2
    assert seen["ids"] == [[5, 2], [6]] and seen["reasons"] == ["stop", "length"] and seen["step"] == 7
    assert seen["columns"] == {"level": [3, 3]}


def test_bad_reward_output_is_refused():
    rows = [{"prompt": "p"}]
    with pytest.raises(ValueError, match="returned 1 scores for 2"):
        score_completions([lambda completions, **kw: [1.0]], rows, ["a", "b"], group_size=2)
    with pytest.raises(ValueError, match="NaN"):
        score_completions([lambda completions, **kw: [1.0, math.nan]], rows, ["a", "b"], group_size=2)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She has 3 * 4 = <<3*4=12>>12 apples.\n#### 12", "12"),
        ("1000 - 875 = 125 rolls.\n#### 1,250", "1250"),
        ("so the answer is \\boxed{\\frac{1}{2}} and 7", "\\frac{1}{2}"),
        ("The total is $1,024.00.", "1024"),
        ("first 5, then 7.5 apples", "7.5"),
        ("#### -3", "-3"),
        ("no number at all", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_math_reward_compares_final_answers_of_both_sides():
    answers = ["Each box has 4 apples, 3 * 4 = 12.\n#### 12"] * 4
    completions = ["3 boxes of 4 make 12", "it is 13", "#### 12.0", [{"role": "assistant", "content": "\\boxed{12}"}]]
    assert math_reward(completions=completions, answer=answers) == [1.0, 0.0, 1.0, 1.0]
    # the old exact-match rule compared against the whole answer column and always scored 0
    assert math_reward(completions=["nothing"], answer=["#### 12"]) == [0.0]


def test_unscorable_reward_tensor_is_float32():
    rewards, _ = score_completions([never], [{"prompt": "p"}], ["a"], group_size=1)
    assert rewards.dtype == torch.float32 and rewards.isnan().all()
