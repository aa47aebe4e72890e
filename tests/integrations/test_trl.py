"""`rollout.integrations.trl.make_rollout_func` against a stand-in for TRL's trainer (no trl needed):
TRL's row order and counts, chat templates, sampling settings, weight changes between steps, eval.

The stand-in carries exactly the attributes `GRPOTrainer` exposes and the rollout function reads;
tests/integrations/test_trl_trainer.py runs the same function inside TRL's real `GRPOTrainer`.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from support.tiny_models import teacher_forced_logprobs

from rollout import ContinuousBatchingConfig
from rollout.integrations.trl import make_rollout_func
from trainers.tasks import build_tiny_model, make_addition_tokenizer

ENGINE = ContinuousBatchingConfig(page_size=4, num_blocks=128, max_batch_tokens=256)
# renders "<bos>" + the user turns + "=" (the generation prompt): characters the tokenizer knows
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}={% endif %}"
)


class StandInAccelerator:
    device = torch.device("cpu")
    process_index = 0

    @staticmethod
    def unwrap_model(model):
        return model

    @staticmethod
    def gather(tensor):
        return tensor


class StandInTrainer:
    """The attributes of `trl.GRPOTrainer` that a rollout_func reads."""

    def __init__(self, model, tokenizer, **settings) -> None:
        self.model = model
        self.processing_class = tokenizer
        self.accelerator = StandInAccelerator()
        self.state = SimpleNamespace(global_step=0)
        self.args = SimpleNamespace(seed=0, generation_kwargs=None)
        self.num_generations = settings.pop("num_generations", 4)
        self.num_generations_eval = settings.pop("num_generations_eval", self.num_generations)
        self.temperature = settings.pop("temperature", 1.0)
        self.top_p = settings.pop("top_p", 1.0)
        self.top_k = settings.pop("top_k", 0)
        self.min_p = settings.pop("min_p", None)
        self.repetition_penalty = settings.pop("repetition_penalty", 1.0)
        self.max_completion_length = settings.pop("max_completion_length", 6)
        self.eos_token_ids = [tokenizer.eos_token_id]
        self.chat_template_kwargs = {}
        self.tools = None
        self.chat_template = None
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        assert not settings, settings


@pytest.fixture(scope="module")
def tokenizer():
    return make_addition_tokenizer()


@pytest.fixture
def model(tokenizer):
    return build_tiny_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0).train()


def repeated(prompts: list, times: int) -> list:
    return [p for p in prompts for _ in range(times)]


@torch.no_grad()
def tf_logprobs(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """The oracle: teacher-forced log_softmax(logits / T) of each completion token, [len(completion)]."""
    was = model.training
    model.eval()
    logprobs = teacher_forced_logprobs(model, prompt, completion, temperature)
    model.train(was)
    return logprobs


@torch.no_grad()
def hf_greedy(model, tokenizer, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: `model.generate` greedy, stopping at eos (which stays in the completion, as in TRL)."""
    was = model.training
    model.eval()
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)[0, len(prompt):]
    model.train(was)
    out = out.tolist()
    return out[: out.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in out else out


def test_rows_follow_trls_order_and_counts(model, tokenizer):
    """One completion per row, in TRL's order: each prompt's num_generations rows adjacent, each row's
    prompt_ids its own prompt's tokens, logprobs as long as the completion and equal to the teacher-forced
    log_softmax(logits / T) (T = the trainer's temperature)."""
    trainer = StandInTrainer(model, tokenizer, num_generations=4, temperature=0.7)
    prompts = ["12+34=", "5+6=", "99+1=", "12+34="]  # the same text twice, apart: two groups
    rollout = make_rollout_func(ENGINE)
    try:
        out = rollout(repeated(prompts, 4), trainer)
        assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "finish_reasons"}
        assert all(len(v) == 16 for v in out.values())
        for row in range(16):
            assert out["prompt_ids"][row] == tokenizer(prompts[row // 4])["input_ids"]
            comp, lps = out["completion_ids"][row], out["logprobs"][row]
            assert 1 <= len(comp) <= 6 and len(lps) == len(comp)
            assert all(isinstance(t, int) for t in comp) and all(isinstance(x, float) for x in lps)
            reason = out["finish_reasons"][row]
            assert reason == ("stop" if comp[-1] == tokenizer.eos_token_id else "length")
            oracle = tf_logprobs(model, out["prompt_ids"][row], comp, 0.7)
            torch.testing.assert_close(torch.tensor(lps), oracle, atol=1e-4, rtol=0)
    finally:
        rollout.close()


def test_a_group_cut_by_the_process_slice_keeps_its_row_count(model, tokenizer):
    """TRL splits rows, not groups, over processes: a slice may start or end inside a group."""
    trainer = StandInTrainer(model, tokenizer, num_generations=4)
    prompts = ["1+2="] * 3 + ["3+4="] * 4 + ["5+6="]
    rollout = make_rollout_func(ENGINE)
    try:
        out = rollout(prompts, trainer)
        assert [tokenizer.decode(p, skip_special_tokens=True) for p in out["prompt_ids"]] == prompts
        assert len(out["completion_ids"]) == len(prompts)
    finally:
        rollout.close()


def test_conversational_prompts_go_through_the_chat_template(model, tokenizer):
    tokenizer = make_addition_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    trainer = StandInTrainer(model, tokenizer, num_generations=2)
    prompts = [[{"role": "user", "content": "12+34"}], [{"role": "user", "content": "7+8"}]]
    rollout = make_rollout_func(ENGINE)
    try:
        out = rollout(repeated(prompts, 2), trainer)
        expected = [tokenizer("12+34=")["input_ids"]] * 2 + [tokenizer("7+8=")["input_ids"]] * 2
        assert out["prompt_ids"] == expected
        assert len(out["completion_ids"]) == 4
    finally:
        rollout.close()


def test_weight_change_between_steps_reaches_the_next_rollout(model, tokenizer):
    """The policy version moves when (and only when) trainer.state.global_step does, and greedy
    completions follow the weights of the moment (a stale prefix cache would serve old prompt KV)."""
    trainer = StandInTrainer(model, tokenizer, num_generations=2, temperature=0.0, max_completion_length=5)
    prompts = ["12+34=", "567+8="]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    rollout = make_rollout_func(ENGINE)
    try:
        first = rollout(repeated(prompts, 2), trainer)
        version = rollout.engine.policy_version
        assert first["completion_ids"][::2] == [hf_greedy(model, tokenizer, p, 5) for p in ids]
        rollout(repeated(prompts, 2), trainer)  # same step (e.g. gradient accumulation): same version
        assert rollout.engine.policy_version == version
        with torch.no_grad():  # an optimizer step, in place
            g = torch.Generator().manual_seed(1)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.5)
        trainer.state.global_step += 1
        second = rollout(repeated(prompts, 2), trainer)
        assert rollout.engine.policy_version == version + 1
        new = [hf_greedy(model, tokenizer, p, 5) for p in ids]
        assert second["completion_ids"][::2] == new
        assert second["completion_ids"] != first["completion_ids"]  # the change is visible at all
        assert trainer._metrics["train"]["rollout/policy_version"] == [version, version, version + 1]
    finally:
        rollout.close()


def test_eval_uses_num_generations_eval(model, tokenizer):
    trainer = StandInTrainer(model, tokenizer, num_generations=4, num_generations_eval=2)
    rollout = make_rollout_func(ENGINE)
    try:
        model.eval()
        out = rollout(repeated(["1+1=", "2+2=", "3+3="], 2), trainer)
        assert len(out["completion_ids"]) == 6
        assert [len(p) for p in out["prompt_ids"]] == [5] * 6
        assert trainer._metrics["eval"]["rollout/generate_s"] and not trainer._metrics["train"]
    finally:
        rollout.close()


def test_sampling_settings_come_from_the_trainer(model, tokenizer):
    trainer = StandInTrainer(model, tokenizer, num_generations=8, max_completion_length=2, top_k=1)
    rollout = make_rollout_func(ENGINE)
    try:
        out = rollout(["12+34="] * 8, trainer)
        assert max(len(c) for c in out["completion_ids"]) <= 2
        # top_k=1 is greedy whatever the temperature: every sample equal, processed logprob 0
        assert len({tuple(c) for c in out["completion_ids"]}) == 1
        assert all(abs(x) < 1e-6 for row in out["logprobs"] for x in row)
    finally:
        rollout.close()
    trainer.top_k = 0
    rollout = make_rollout_func(ENGINE, max_new_tokens=1)  # an override wins over the trainer's setting
    try:
        assert {len(c) for c in rollout(["12+34="] * 8, trainer)["completion_ids"]} == {1}
    finally:
        rollout.close()


def test_seeded_calls_reproduce(model, tokenizer):
    trainer = StandInTrainer(model, tokenizer, num_generations=4)
    outs = []
    for _ in range(2):
        rollout = make_rollout_func(ENGINE)
        outs.append([rollout(["1+2="] * 4, trainer)["completion_ids"] for _ in range(2)])
        rollout.close()
    assert outs[0] == outs[1]
    assert outs[0][0] != outs[0][1]  # the second call of a run draws fresh samples


def test_unsupported_generation_kwargs_are_refused(model, tokenizer):
    """min_p and repetition_penalty are honoured (tests/sampling/test_sampling_entry_points.py); a generation
    kwarg the backend does not implement is refused by name."""
    trainer = StandInTrainer(model, tokenizer)
    rollout = make_rollout_func(ENGINE)
    try:
        for key in ("no_repeat_ngram_size", "num_beams"):
            trainer.args.generation_kwargs = {key: 2}
            with pytest.raises(ValueError, match=key):
                rollout(["1+2="] * 4, trainer)
    finally:
        rollout.close()


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="group_size"):
        make_rollout_func(group_size=4)
    with pytest.raises(ValueError, match="config"):
        make_rollout_func({"page_size": 4})


def test_conversational_prompts_with_content_parts_are_joined_as_the_server_does():
    """TRL datasets in the OpenAI parts format: on a string template the text parts are joined with "\\n"
    (the ids a string prompt gives), not rendered as the Python repr of the list."""
    from support.chat_model import make_chat_tokenizer

    from rollout.integrations.trl import tokenize_prompts

    tokenizer = make_chat_tokenizer()
    trainer = SimpleNamespace(processing_class=tokenizer, tools=None, chat_template=None, chat_template_kwargs=None)
    parts = [[{"role": "user", "content": [{"type": "text", "text": "12+"}, {"type": "text", "text": "34"}]}]]
    joined = [[{"role": "user", "content": "12+\n34"}]]
    assert tokenize_prompts(trainer, parts) == tokenize_prompts(trainer, joined)
    assert tokenizer.decode(tokenize_prompts(trainer, parts)[0]) == "<|user|>12+\n34<eos><|assistant|>"
    with pytest.raises(ValueError, match="'image' part"):
        tokenize_prompts(trainer, [[{"role": "user", "content": [{"type": "image"}]}]])
