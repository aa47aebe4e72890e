"""`rollout tinker-serve` driven by the `tinker` SDK itself (0.38, the `tinker` extra): training lowers the
loss, the sampler serves the adapter (greedy tokens equal to the PeftModel's `generate`, prompt logprobs equal
to its teacher forcing), two training clients keep their adapters apart, bad requests are errors the SDK
raises while the server keeps serving, and in batch-invariant mode the sampler's logprobs are the trainer's
bits."""

from __future__ import annotations

import pytest
import torch

# NOTE: the submodule: on the tests' path this folder alone would import as a namespace package `tinker`
pytest.importorskip(
    "tinker.proto.tinker_public_pb2", reason="the tinker SDK is not installed (pip install 'rollout[tinker]')"
)
import tinker  # noqa: E402

pytest.importorskip("peft", reason="the Tinker service trains PEFT LoRA adapters (the lora extra)")

from support.serving import save_tiny  # noqa: E402
from support.tinker_service import tinker_serving  # noqa: E402
from support.tiny_models import hf_greedy, teacher_forced_logprobs  # noqa: E402
from tinker import types  # noqa: E402

SEQ_A = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23]
SEQ_B = [40, 52, 41, 53, 42, 54, 43, 55, 44, 56, 45, 57, 46, 58]
GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)


def datum(seq: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * (len(seq) - 1)},
    )


def train(tc, seq: list[int], steps: int, lr: float = 2e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([datum(seq)], "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tinker_model") / "tiny")


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    with tinker_serving(model_dir, tmp_path_factory.mktemp("tinker_ckpt")) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    return served.client()


def base_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def peft_oracle(served, model_dir, tc, name: str):
    """The trained adapter as a `PeftModel`, loaded from the PEFT directory `save_state` wrote."""
    from peft import PeftModel

    path = tc.save_state(name).result().path
    model_id, _, ckpt = path.removeprefix("tinker://").split("/")
    directory = served.service.checkpoint_dir / model_id / "weights" / ckpt
    return PeftModel.from_pretrained(base_model(model_dir), str(directory)).eval()


def test_forward_backward_and_optim_step_lower_the_loss(client, served):
    tc = client.create_lora_training_client(base_model=str(served.model_dir), rank=4, seed=0).result()
    losses = train(tc, SEQ_A, 6)
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.5 * losses[0], losses
    fwd = tc.forward([datum(SEQ_A)], "cross_entropy").result()
    lp = fwd.loss_fn_outputs[0]["logprobs"].to_torch()
    assert lp.shape == (len(SEQ_A) - 1,)
    # NOTE: the reported loss is the sum of -logprobs; a forward changes nothing (same loss twice)
    again = tc.forward([datum(SEQ_A)], "cross_entropy").result()
    assert fwd.metrics["loss:sum"] == pytest.approx(-lp.sum().item(), rel=1e-5)
    assert again.metrics["loss:sum"] == fwd.metrics["loss:sum"]
    assert fwd.metrics["loss:sum"] < losses[-1]


def test_sampler_serves_the_adapter_as_the_peft_model(client, served, model_dir):
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=1).result()
    train(tc, SEQ_A, 5)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQ_A[:4]
    out = sampler.sample(types.ModelInput.from_ints(prompt), 2, GREEDY).result()
    oracle = peft_oracle(served, model_dir, tc, "oracle")
    want = hf_greedy(oracle, prompt, 8)
    assert want != hf_greedy(base_model(model_dir), prompt, 8)  # NOTE: the adapter changes the greedy tokens
    for seq in out.sequences:
        n = len(seq.tokens)
        assert seq.tokens == want[:n] and (n == 8 or seq.stop_reason == "stop"), (seq.tokens, want)
        tf = teacher_forced_logprobs(oracle, prompt, seq.tokens)
        torch.testing.assert_close(torch.tensor(seq.logprobs), tf, atol=1e-4, rtol=0)
    # prompt logprobs: teacher forcing of the prompt under the adapter (None at position 0), top-k too
    long_prompt = SEQ_B[:9]
    res = sampler.sample(
        types.ModelInput.from_ints(long_prompt),
        1,
        types.SamplingParams(max_tokens=2),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(long_prompt)
    tf = teacher_forced_logprobs(oracle, long_prompt[:1], long_prompt[1:])
    torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:]), tf, atol=1e-4, rtol=0)
    assert res.topk_prompt_logprobs[0] is None
    with torch.no_grad():
        logits = oracle(torch.tensor([long_prompt])).logits[0, :-1].float().log_softmax(-1)
    for pos, top in enumerate(res.topk_prompt_logprobs[1:]):
        vals, ids = logits[pos].topk(3)
        assert [t for t, _ in top] == ids.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in top]), vals, atol=1e-4, rtol=0)


def test_two_training_clients_do_not_see_each_others_adapters(client, served, model_dir):
    a = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=2).result()
    b = client.create_lora_training_client(
        base_model=str(model_dir), rank=8, seed=3, train_unembed=False
    ).result()
    train(a, SEQ_A, 5)
    before = a.forward([datum(SEQ_A)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    sampler_a = a.save_weights_and_get_sampling_client().result()
    greedy_a = sampler_a.sample(types.ModelInput.from_ints(SEQ_A[:4]), 1, GREEDY).result().sequences[0].tokens
    train(b, SEQ_B, 5)
    sampler_b = b.save_weights_and_get_sampling_client().result()
    # NOTE: b's training and save moved nothing of a's: its forward and its sampler are bit for bit the same
    after = a.forward([datum(SEQ_A)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after == before
    again = sampler_a.sample(types.ModelInput.from_ints(SEQ_A[:4]), 1, GREEDY).result().sequences[0].tokens
    assert again == greedy_a
    # each sampler continues its own sequence; the other one's adapter does not
    on_b = sampler_b.sample(types.ModelInput.from_ints(SEQ_B[:4]), 1, GREEDY).result().sequences[0].tokens
    a_on_b = sampler_a.sample(types.ModelInput.from_ints(SEQ_B[:4]), 1, GREEDY).result().sequences[0].tokens
    assert on_b[:4] == SEQ_B[4:8] and a_on_b[:4] != SEQ_B[4:8], (on_b, a_on_b)
    b_loss = b.forward([datum(SEQ_B)], "cross_entropy").result().metrics["loss:sum"]
    a_loss_on_b = a.forward([datum(SEQ_B)], "cross_entropy").result().metrics["loss:sum"]
    assert b_loss < 0.5 * a_loss_on_b


def test_bad_requests_are_errors_and_the_server_keeps_serving(client, served, model_dir):
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=4).result()
    with pytest.raises(tinker.RequestFailedError, match="loss_fn 'nope' is not supported"):
        tc.forward_backward([datum(SEQ_A)], "nope").result()
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
    )
    with pytest.raises(tinker.RequestFailedError, match="2 entries for 3 input tokens"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="outside"):
        tc.forward_backward([datum([1, 2, 100_000])], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="needs loss_fn_inputs\\['logprobs'\\]"):
        tc.forward_backward([datum(SEQ_A)], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="learning_rate"):
        tc.optim_step(types.AdamParams(learning_rate=float("nan"))).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match="outside"):
        sampler.sample(types.ModelInput.from_ints([1, 99_999]), 1, GREEDY).result()
    with pytest.raises(tinker.BadRequestError, match="not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="top_p"):
        sampler.sample(
            types.ModelInput.from_ints(SEQ_A[:3]), 1, types.SamplingParams(max_tokens=2, top_p=0.0)
        ).result()
    # and the same clients go on working
    losses = train(tc, SEQ_A, 2)
    assert losses[1] < losses[0]
    assert (
        len(sampler.sample(types.ModelInput.from_ints(SEQ_A[:3]), 1, GREEDY).result().sequences[0].tokens) > 0
    )


def test_seeded_samples_repeat_and_sampler_logprobs_follow_the_adapter(client, served, model_dir):
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=5).result()
    train(tc, SEQ_B, 3)
    sampler = tc.save_weights_and_get_sampling_client().result()
    sp = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    one = sampler.sample(types.ModelInput.from_ints(SEQ_B[:3]), 3, sp).result()
    two = sampler.sample(types.ModelInput.from_ints(SEQ_B[:3]), 3, sp).result()
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]
    assert len({tuple(s.tokens) for s in one.sequences}) > 1  # NOTE: n samples, different streams
    # stop token ids end a completion at (and with) that token; stop=[] runs to max_tokens
    greedy = sampler.sample(types.ModelInput.from_ints(SEQ_B[:3]), 1, GREEDY).result().sequences[0].tokens
    stop = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[greedy[2]])
    cut = sampler.sample(types.ModelInput.from_ints(SEQ_B[:3]), 1, stop).result().sequences[0]
    first = greedy.index(greedy[2])
    assert cut.tokens == greedy[: first + 1] and cut.stop_reason == "stop"


def test_eos_stops_a_sample_unless_stop_is_empty(client, served, model_dir):
    eos = 3  # NOTE: the tiny tokenizer's </s>
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=10).result()
    train(tc, [30, 31, 32, 33, eos, 30, 31, 32, 33, eos], 8)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints([30, 31])
    plain = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result().sequences[0]
    )
    assert plain.tokens == [32, 33, eos] and plain.stop_reason == "stop"
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
    assert free.sequences[0].tokens[:3] == [32, 33, eos] and len(free.sequences[0].tokens) == 6
    assert free.sequences[0].stop_reason == "length"


@pytest.fixture(scope="module")
def invariant(model_dir, tmp_path_factory):
    with tinker_serving(model_dir, tmp_path_factory.mktemp("tinker_inv"), batch_invariant=True) as s:
        yield s


def test_batch_invariant_sampler_logprobs_equal_the_trainers_forward(invariant, model_dir):
    client = invariant.client()
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=6).result()
    prompt = SEQ_A[:5]
    for round_ in range(2):  # NOTE: the second save is copied into the client's engine in place
        train(tc, SEQ_A, 3)
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(
            types.ModelInput.from_ints(prompt),
            4,
            types.SamplingParams(max_tokens=6, seed=3),
            include_prompt_logprobs=True,
        ).result()
        data = []
        for s in out.sequences:
            full = prompt + s.tokens
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)},
                )
            )
        fwd = tc.forward(data, "cross_entropy").result()
        for s, o in zip(out.sequences, fwd.loss_fn_outputs, strict=True):
            trainer = o["logprobs"].tolist()
            assert trainer[len(prompt) - 1 :] == s.logprobs, round_  # NOTE: exactly: the same bits
            assert trainer[: len(prompt) - 1] == out.prompt_logprobs[1:]
    # forward_backward reports the same logprobs (the cookbook's kl_sample_train reads these)
    fb = tc.forward_backward(data[:1], "cross_entropy").result()
    assert fb.loss_fn_outputs[0]["logprobs"].tolist()[len(prompt) - 1 :] == out.sequences[0].logprobs


def test_save_state_and_load_state_round_trip(client, served, model_dir):
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=8).result()
    train(tc, SEQ_A, 3)
    path = tc.save_state("rt").result().path
    want = tc.forward([datum(SEQ_B)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    other = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=9).result()
    assert (
        other.forward([datum(SEQ_B)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        != want
    )
    other.load_state_with_optimizer(path).result()
    assert (
        other.forward([datum(SEQ_B)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        == want
    )
    fresh = client.create_training_client_from_state(path).result()
    assert (
        fresh.forward([datum(SEQ_B)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        == want
    )
    # the same Adam state: one more step from each gives the same adapter
    for c in (tc, other):
        train(c, SEQ_A, 1)
    assert (
        other.forward([datum(SEQ_B)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
        == tc.forward([datum(SEQ_B)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )
    with pytest.raises(tinker.BadRequestError, match="not tinker://MODEL_ID/weights/NAME"):
        other.load_state("tinker://x/y").result()


def test_importance_sampling_and_ppo_losses_are_tinkers(client, served, model_dir):
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=11).result()
    train(tc, SEQ_A, 2)
    seq = SEQ_A
    n = len(seq) - 1
    lp = torch.tensor(
        tc.forward([datum(seq)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    )
    old = lp + torch.linspace(-0.5, 0.5, n)  # NOTE: ratios exp(lp - old) from e^0.5 to e^-0.5: some clip
    adv = torch.linspace(1.0, -1.0, n)  # NOTE: positive where the ratio is above 1: the clip bites

    def loss(fn, **config):
        d = types.Datum(
            model_input=types.ModelInput.from_ints(seq[:-1]),
            loss_fn_inputs={"target_tokens": seq[1:], "logprobs": old.tolist(), "advantages": adv.tolist()},
        )
        return tc.forward([d], fn, loss_fn_config=config or None).result().metrics["loss:sum"]

    ratio = torch.exp(lp - old)
    assert loss("importance_sampling") == pytest.approx(-(ratio * adv).sum().item(), rel=1e-4)
    clipped = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert loss("ppo") == pytest.approx(-clipped.sum().item(), rel=1e-4)
    assert -clipped.sum().item() != pytest.approx(-(ratio * adv).sum().item(), rel=1e-3)
    wide = torch.minimum(ratio * adv, ratio.clamp(0.5, 2.0) * adv)
    assert loss("ppo", clip_low_threshold=0.5, clip_high_threshold=2.0) == pytest.approx(
        -wide.sum().item(), rel=1e-4
    )


def test_concurrent_samples_run_as_one_generate_and_each_gets_its_own(client, served, model_dir, monkeypatch):
    tc = client.create_lora_training_client(base_model=str(model_dir), rank=4, seed=12).result()
    train(tc, SEQ_B, 3)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [SEQ_B[:3], SEQ_A[:4], SEQ_B[2:6], SEQ_A[5:7]]
    alone = [sampler.sample(types.ModelInput.from_ints(p), 2, GREEDY).result() for p in prompts]
    calls = []
    inner = served.service.sampler.sample
    monkeypatch.setattr(
        served.service.sampler, "sample", lambda t, ps, params: calls.append(len(ps)) or inner(t, ps, params)
    )
    monkeypatch.setattr(served.service, "batch_wait_s", 0.5)  # NOTE: the four requests arrive in the window
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, GREEDY) for p in prompts]
    together = [f.result() for f in futures]
    assert sum(calls) == len(prompts) and max(calls) > 1, calls  # NOTE: at least two requests shared a call
    for a, b in zip(alone, together, strict=True):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
