import random
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainers.tasks import AdditionTask, addition_reward, build_tiny_model, greedy_accuracy, score_answer
from trainers.warm_start import _sft_batch, sft_warm_start

# ------------------------------------------------------------------------------------------- task


def test_sample_is_deterministic_by_seed():
    a = AdditionTask(num_digits=3, seed=0).sample(50)
    assert a == AdditionTask(num_digits=3, seed=0).sample(50)
    assert a != AdditionTask(num_digits=3, seed=1).sample(50)

    task = AdditionTask(seed=0)
    first, second = task.sample(10), task.sample(10)
    assert first != second  # the task's own stream advances
    assert first + second == AdditionTask(seed=0).sample(20)

    # An explicit int seed ignores the task's stream; a Random is drawn from.
    assert task.sample(10, seed=7) == AdditionTask(seed=99).sample(10, seed=7)
    assert task.sample(10, seed=random.Random(7)) == task.sample(10, seed=7)


@pytest.mark.parametrize("pad_operands", [True, False])
@pytest.mark.parametrize("num_digits", [1, 3, 5])
def test_answers_are_correct(num_digits, pad_operands):
    rows = AdditionTask(num_digits=num_digits, seed=3, pad_operands=pad_operands).sample(500)
    for row in rows:
        m = re.fullmatch(r"(\d+)\+(\d+)=", row["prompt"])
        assert m, row
        a, b = int(m.group(1)), int(m.group(2))
        assert a < 10**num_digits and b < 10**num_digits
        width = num_digits if pad_operands else 0
        assert (m.group(1), m.group(2)) == (f"{a:0{width}d}", f"{b:0{width}d}")
        assert row["answer"] == str(a + b)  # the answer is never padded
    # Operands cover the whole range, up to the longest answer.
    assert max(len(r["answer"]) for r in rows) == num_digits + 1
    if pad_operands:
        assert {len(r["prompt"]) for r in rows} == {2 * num_digits + 2}


def test_padding_only_changes_the_format():
    padded = AdditionTask(seed=4, pad_operands=True).sample(100)
    plain = AdditionTask(seed=4, pad_operands=False).sample(100)
    for p, q in zip(padded, plain, strict=True):
        assert p["answer"] == q["answer"]
        assert [int(x) for x in p["prompt"][:-1].split("+")] == [int(x) for x in q["prompt"][:-1].split("+")]


def test_to_dataset_columns():
    ds = AdditionTask(seed=0).to_dataset(32, seed=5)
    assert ds.column_names == ["prompt", "answer"]
    assert len(ds) == 32
    assert ds.to_list() == AdditionTask(seed=1).sample(32, seed=5)


def test_bad_task_arguments():
    with pytest.raises(ValueError):
        AdditionTask(num_digits=0)
    with pytest.raises(ValueError):
        AdditionTask().sample(-1)


# ----------------------------------------------------------------------------------------- reward


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("579", "579", 1.0),
        (" 579\n", "579", 1.0),
        ("579<eos>", "579", 1.0),
        ("579<eos><pad><pad>", "579", 1.0),
        ("579<eos>123", "579", 1.0),  # text after eos is not part of the answer
        ("579<pad><pad>", "579", 1.0),  # cut by length, right-padded
        ("579 <pad>", "579", 1.0),
        ("<pad>579<eos>", "579", 0.0),
        ("5<unk>79", "579", 0.0),  # special-token text inside is garbage, not stripped
        ("5<bos>79<eos>", "579", 0.0),
        ("1035", "1035", 1.0),
        ("578", "579", 2 / 3),  # last digit wrong
        ("479", "579", 2 / 3),  # first digit wrong
        ("000", "579", 0.0),
        ("79", "579", 0.5 * 2 / 3),  # too short: 2 of 3 right-aligned digits, halved
        ("1579", "579", 0.5 * 3 / 4),  # too long
        ("35", "1035", 0.5 * 2 / 4),
        ("57<eos>9", "579", 0.0),
        ("", "579", 0.0),
        ("   ", "579", 0.0),
        ("<eos>", "579", 0.0),
        ("abc", "579", 0.0),
        ("5a9", "579", 0.0),
        ("579=", "579", 0.0),
        ("+=+", "579", 0.0),
        ("-579", "579", 0.0),
        ("５７９", "579", 0.0),  # non-ASCII digits are garbage
    ],
)
def test_score_answer(completion, answer, expected):
    assert score_answer(completion, answer) == pytest.approx(expected)


def test_addition_reward_convention_and_range():
    rng = random.Random(0)
    answers, completions = [], []
    for _ in range(2000):
        answer = str(rng.randrange(2000))
        length = rng.randrange(0, 7)
        completions.append("".join(rng.choice("0123456789+= x") for _ in range(length)))
        answers.append(answer)
    prompts = ["1+1="] * len(answers)
    rewards = addition_reward(prompts, completions, answer=answers, other_column=[0] * len(answers))
    assert len(rewards) == len(completions)
    for c, a, r in zip(completions, answers, rewards, strict=True):
        assert 0.0 <= r <= 1.0
        assert (r == 1.0) == (c.strip() == a)
    with pytest.raises(ValueError):
        addition_reward(["1+1="], ["2", "2"], answer=["2"])


# -------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_encodes_characters(tokenizer):
    assert len(tokenizer) == 16
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    ids = tokenizer("123+456=").input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert len(ids) == 1 + len("123+456=")
    assert tokenizer("123+456=", add_special_tokens=False).input_ids == ids[1:]
    assert len(set(tokenizer("0123456789+=", add_special_tokens=False).input_ids)) == 12
    assert tokenizer.decode(ids, skip_special_tokens=True) == "123+456="
    assert tokenizer.decode(ids) == "<bos>123+456="
    assert tokenizer.decode(tokenizer("579", add_special_tokens=False).input_ids + [2]) == "579<eos>"
    assert tokenizer.unk_token_id in tokenizer("1 x", add_special_tokens=False).input_ids


def test_tokenizer_left_pads(tokenizer):
    enc = tokenizer(["1+2=", "123+456="], padding=True, return_tensors="pt")
    assert enc.input_ids.shape == (2, 9)
    assert enc.input_ids[0, :4].tolist() == [tokenizer.pad_token_id] * 4
    assert enc.attention_mask[0].tolist() == [0] * 4 + [1] * 5


def test_tokenizer_save_load_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    prompts = [r["prompt"] + r["answer"] for r in AdditionTask(seed=0).sample(64)]
    assert loaded(prompts).input_ids == tokenizer(prompts).input_ids
    assert loaded(prompts, padding=True).input_ids == tokenizer(prompts, padding=True).input_ids
    assert loaded.get_vocab() == tokenizer.get_vocab()
    for attr in ("pad_token_id", "bos_token_id", "eos_token_id", "unk_token_id", "padding_side"):
        assert getattr(loaded, attr) == getattr(tokenizer, attr)
    ids = tokenizer(prompts[0]).input_ids
    assert loaded.decode(ids, skip_special_tokens=True) == prompts[0]


# ------------------------------------------------------------------------------------------ model


def test_build_tiny_model(tokenizer):
    state = torch.random.get_rng_state()
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)  # global RNG untouched
    cfg = model.config
    assert cfg.vocab_size == len(tokenizer)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())
    again = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=3)
    for (name, p), q in zip(model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError):
        build_tiny_model(tokenizer, hidden_size=66, num_heads=4)


def test_model_save_load_round_trip(tokenizer, tmp_path):
    model = build_tiny_model(tokenizer, seed=1).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = tokenizer(["123+456=", "9+99="], padding=True, return_tensors="pt")
    with torch.no_grad():
        a = model(**ids).logits  # [2, 9, 16]
        b = loaded(**ids).logits
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a, b)


# -------------------------------------------------------------------------------------------- SFT


def test_sft_batch_labels_only_answer_and_eos(tokenizer):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "123+456=", "answer": "579"}]
    input_ids, attention_mask, labels = _sft_batch(tokenizer, rows)
    assert input_ids.shape == labels.shape == attention_mask.shape == (2, 13)
    assert tokenizer.decode(input_ids[1]) == "<bos>123+456=579<eos>"
    assert tokenizer.decode(input_ids[0]) == "<bos>1+2=3<eos>" + "<pad>" * 6
    assert tokenizer.decode(labels[0][labels[0] != -100]) == "3<eos>"
    assert tokenizer.decode(labels[1][labels[1] != -100]) == "579<eos>"
    assert attention_mask[0].tolist() == [1] * 7 + [0] * 6
    # Labels sit on the same positions as the tokens they name (the model shifts them).
    keep = labels != -100
    assert torch.equal(labels[keep], input_ids[keep])


def test_short_sft_lowers_loss_and_raises_reward(tokenizer):
    task = AdditionTask(num_digits=2, seed=0)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    input_ids, _, labels = _sft_batch(tokenizer, task.sample(256, seed=123))
    with torch.no_grad():
        before_loss = model(input_ids=input_ids, labels=labels).loss.item()
    before = greedy_accuracy(model, tokenizer, task, n=128)
    model.train()
    final = sft_warm_start(
        model, tokenizer, task, steps=80, batch_size=32, seed=0, progress=False, target_exact=None
    )
    assert not model.training
    with torch.no_grad():
        after_loss = model(input_ids=input_ids, labels=labels).loss.item()
    after = greedy_accuracy(model, tokenizer, task, n=128)
    assert after_loss < 0.6 * before_loss
    assert final < 0.6 * before_loss
    assert after["reward"] > before["reward"] + 0.1
    assert 0.0 <= after["exact"] <= 1.0


def test_greedy_accuracy_keeps_mode_and_matches_unpadded(tokenizer):
    task = AdditionTask(num_digits=3, seed=0)
    model = build_tiny_model(tokenizer, hidden_size=64, num_layers=2, num_heads=4, seed=0)
    # A short warm start so greedy outputs differ between prompts.
    sft_warm_start(model, tokenizer, task, steps=30, batch_size=32, progress=False, target_exact=None)
    model.train()
    result = greedy_accuracy(model, tokenizer, task, n=16, seed=5, batch_size=16)
    assert model.training
    assert set(result) == {"exact", "reward"}
    # Left-padded batched greedy equals one-prompt-at-a-time greedy.
    one_by_one = greedy_accuracy(model, tokenizer, task, n=16, seed=5, batch_size=1)
    assert one_by_one == pytest.approx(result)


def test_warm_start_stops_at_target(tokenizer, capsys):
    task = AdditionTask(num_digits=2, seed=0)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    # Any accuracy reaches a target of 0, so the first evaluation (step 5) ends the run.
    sft_warm_start(model, tokenizer, task, steps=1000, batch_size=8, target_exact=0.0, eval_every=5)
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("sft step 5/1000 ")
    assert "exact" in lines[-1]
    with pytest.raises(ValueError):
        sft_warm_start(model, tokenizer, task, steps=0)


def test_warm_start_lands_in_its_band_going_back_where_a_step_jumps_past_it(tokenizer, monkeypatch, capsys):
    """The stop's evaluations scripted: coarse on 256 problems every 5 steps until exact reaches target/4 (then
    measured again on 512), then on 512 every step; a check at or above target-band/2 is measured again on 2048
    other problems and that figure decides: above target+band/2 goes back to the last check's weights (coarse:
    retrace every step; fine: at half the learning rate too), below target-band/2 goes on, within stops there."""
    import trainers.warm_start as warm_start

    task = AdditionTask(num_digits=2, seed=0)
    model = build_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, seed=0)
    # NOTE: step 5; step 10 (256, 512, confirm: back to step 5); 11; 12; 13 (confirm: back to 12, half rate);
    # 14; 15 (confirm below: go on); 16 (confirm within: stop)
    script = iter([0.0, 0.6, 0.6, 0.6, 0.1, 0.15, 0.9, 0.9, 0.2, 0.28, 0.22, 0.36, 0.31, 0.5])
    seen, lrs = [], []

    def fake_accuracy(model, tokenizer, task, n=256, seed=0, batch_size=256):
        seen.append((n, {k: v.clone() for k, v in model.state_dict().items()}))
        return {"exact": next(script), "reward": 0.0}

    monkeypatch.setattr(warm_start, "greedy_accuracy", fake_accuracy)
    real_scale = warm_start.SupervisedSteps.scale_lr
    monkeypatch.setattr(warm_start.SupervisedSteps, "scale_lr", lambda self, f: (lrs.append(f), real_scale(self, f)))
    sft_warm_start(model, tokenizer, task, steps=100, batch_size=8, target_exact=0.3, band=0.05, eval_every=5)
    out = capsys.readouterr().out
    assert [n for n, _ in seen] == [256, 256, 512, 2048, 512, 512, 512, 2048, 512, 512, 2048, 512, 2048]
    assert "0.600 jumped past" in out and "back to the last check (0.000)" in out
    assert "0.900 jumped past" in out and "back to the last check (0.150), half the learning rate" in out
    assert lrs == [0.5]  # NOTE: only the jump met at every-step evaluation halves the rate
    last = out.strip().splitlines()[-1]
    assert last.startswith("sft step 16/100 ") and "exact 0.310" in last  # NOTE: the confirmation's figure
    final = model.state_dict()  # NOTE: the weights of the confirmed in-band check, step 16
    assert all(torch.equal(final[k], v) for k, v in seen[12][1].items())
    # NOTE: the 512-problem 0.36 at step 16 alone would have gone back; the 2048-problem 0.31 decided
    assert not all(torch.equal(final[k], v) for k, v in seen[9][1].items())
