"""The embedded agentic task (`trainers.calculator`), `AgentGRPOTrainer`'s config, and a smoke run of
`recipes/agent_grpo.py`. (The update of `AgentGRPOTrainer` against a hand gradient that counts model tokens
only is in `test_trainer_gradients.py`.)"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from rollout.agents import Action, ChatBridge
from trainers.agent_grpo import AgentGRPOConfig
from trainers.calculator import (
    CALL,
    CalculatorEnv,
    calculate,
    calculator_problems,
    demo_tokens,
    make_calculator_tokenizer,
)

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


@pytest.fixture(scope="module")
def tok():
    return make_calculator_tokenizer()


def test_calculator_and_environment(tok):
    assert calculate("4821+0377") == "5198" and calculate(" 12 + 30 ") == "42"
    for bad in ("12*3", "12+", "+3", "a+b", "", "1+2+3"):
        assert calculate(bad) == "error", bad
    env = CalculatorEnv()
    assert env.reset({"prompt": "0012+0030", "answer": "42"}) == [{"role": "user", "content": "0012+0030"}]
    ids = tok(CALL + "0012+0030", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(CALL) and len(ids) == 10  # NOTE: the marker is one token
    text = tok.decode(ids, skip_special_tokens=True)
    assert text == CALL + "0012+0030"  # NOTE: not special: decoding without specials keeps it
    assert env.step(Action(text, ids)) == ([{"role": "tool", "content": "42"}], 0.0, False)
    # a second call is refused (max_calls=1): the turn is taken as the answer, and it is wrong
    assert env.step(Action(text, ids)) == (None, 0.0, True)
    env.reset({"prompt": "0012+0030", "answer": "42"})
    assert env.step(Action("42", [8, 6])) == (None, 1.0, True)
    env.reset({"prompt": "0012+0030", "answer": "42"})
    assert env.step(Action("43", [8, 7])) == (None, 0.0, True)
    rows = calculator_problems(50, num_digits=4, seed=1)
    assert all(len(r["prompt"]) == 9 and calculate(r["prompt"]) == r["answer"] for r in rows)


@pytest.mark.parametrize("use_tool", [True, False])
def test_warm_start_demos_are_the_chat_template_rendering_with_labels_on_model_turns(tok, use_tool):
    """A demo is token for token the conversation through the chat template (the same ids `run_episodes`
    builds with the bridge), with labels exactly on the assistant turns (content + eos)."""
    row = {"prompt": "4821+0377", "answer": "5198"}
    ids, labels = demo_tokens(tok, ChatBridge(tok, [tok.eos_token_id]), row, use_tool)
    messages = [{"role": "user", "content": row["prompt"]}]
    turns = [CALL + row["prompt"], row["answer"]] if use_tool else [row["answer"]]
    if use_tool:
        messages += [{"role": "assistant", "content": turns[0]}, {"role": "tool", "content": "5198"}]
    messages.append({"role": "assistant", "content": turns[-1]})
    rendered = tok.apply_chat_template(messages, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert ids == rendered
    expected = [t for turn in turns for t in tok(turn, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
    assert [t for t, lab in zip(ids, labels, strict=True) if lab != -100] == expected
    if use_tool:  # the call token can be left unlabelled: the demo then teaches how to call, not whether
        _, unlabelled = demo_tokens(tok, ChatBridge(tok, [tok.eos_token_id]), row, True, teach_call=False)
        assert [lab for lab in unlabelled if lab != -100] == expected[1:]


def test_agent_config_refuses_bad_values():
    with pytest.raises(ValueError, match="max_turns"):
        AgentGRPOConfig(max_turns=0)
    with pytest.raises(ValueError, match="max_episode_tokens"):
        AgentGRPOConfig(max_episode_tokens=0)
    with pytest.raises(ValueError, match="overlong_buffer"):
        AgentGRPOConfig(overlong_buffer=4)


@pytest.mark.timeout(180)
def test_agent_recipe_runs_and_writes_metrics(tmp_path, keep_rng):
    sys.path.insert(0, str(RECIPES))
    spec = importlib.util.spec_from_file_location("recipe_agent_grpo", RECIPES / "agent_grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    out = tmp_path / "run"
    summary = recipe.main(["--steps", "2", "--sft_steps", "3", "--prompts_per_step", "2", "--group_size", "4",
                           "--heldout", "8", "--output_dir", str(out)])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["tool_use_rate"] <= 1.0
        assert 1.0 <= r["num_turns"] <= 2.0 and r["response_length"] <= r["trajectory_length"]
        assert 0.0 <= r["prefix_cached_fraction"] <= 1.0
    assert (out / "reward.png").stat().st_size > 0 and (out / "final" / "config.json").exists()
    saved = json.loads((out / "summary.json").read_text())
    assert saved["steps"] == summary["steps"] == 2
    assert set(saved["greedy_before"]) >= {"accuracy", "tool_use_rate", "num_turns"}
