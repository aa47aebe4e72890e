"""The engine view runs the model class's own forward with our attention (issue 13, item 3).

TRL's `GRPOTrainer` (through `add_fused_lm_head`) and accelerate's mixed-precision preparation replace
`model.forward` on the instance; TRL's wrapper closes over the original module's bound forward. The
engine must still run our paged attention in every layer, and refuse a model where it did not.
"""

from __future__ import annotations

import functools
import types

import pytest
import torch
from support.tiny_models import hf_greedy, make_model
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine
from rollout.engine.core import EngineCore

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=8)
SMALL = dict(page_size=16, num_blocks=64)
PROMPT = [5, 17, 99, 3, 42, 8, 61, 2, 77, 13, 29]


def trl_wrap(model: torch.nn.Module) -> torch.nn.Module:
    """What TRL's `add_fused_lm_head` does: a wrapper over the original bound forward, set on the instance."""
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def _fused_forward(self, *args, fused_lm_head=False, **kwargs):
        if not fused_lm_head:
            return original_forward(*args, **kwargs)
        raise NotImplementedError

    model.forward = types.MethodType(_fused_forward, model)
    model.config.use_cache = False
    return model


def accelerate_wrap(model: torch.nn.Module) -> torch.nn.Module:
    """accelerate's mixed-precision `prepare_model` shape: the forward wrapped and rebound on the instance."""
    from accelerate.utils import convert_outputs_to_fp32

    model._original_forward = model.forward
    forward = model.forward.__func__
    model.forward = types.MethodType(convert_outputs_to_fp32(forward), model)
    return model


@pytest.mark.parametrize("wrap", [trl_wrap, accelerate_wrap])
def test_replaced_forward_still_runs_our_attention(wrap):
    model = make_model("qwen3", seed=0)
    expected = hf_greedy(model, PROMPT, 8)
    wrap(model)
    engine = RolloutEngine(model, config=ContinuousBatchingConfig(**SMALL), generation_config=GREEDY)
    try:
        batch = engine.generate([PROMPT], temps=0.0, group_size=4, max_new_tokens=8)
    finally:
        engine.close()
    for row in batch.completion_ids.tolist():
        assert row == expected
    assert model.forward.__func__ is not type(model).forward  # the user's wrapper is left in place


def test_trl_grpo_trainer_model_generates_like_hf(tmp_path):
    """A real `trl.GRPOTrainer` patches the policy; the engine on its model still matches HF greedy."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    model = make_model("qwen3", seed=0)
    expected = hf_greedy(model, PROMPT, 8)
    vocab = {f"t{i}": i for i in range(model.config.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                  pad_token="t0", eos_token="t1")
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                          max_completion_length=4, report_to=[], use_cpu=True)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["t5 t6"] * 2}),
                              processing_class=tok)
    assert "forward" in vars(trainer.model)  # TRL did replace the instance's forward
    engine = RolloutEngine(trainer.model, config=ContinuousBatchingConfig(**SMALL), generation_config=GREEDY)
    try:
        batch = engine.generate([PROMPT], temps=0.0, group_size=2, max_new_tokens=8)
    finally:
        engine.close()
    for row in batch.completion_ids.tolist():
        assert row == expected


def test_a_layer_bypassing_our_attention_is_refused():
    """An attention module whose forward was replaced by the original's: the first step refuses, saying why."""
    model = make_model("qwen3", seed=0)
    attn = model.model.layers[1].self_attn
    original = attn.forward
    attn.forward = lambda *args, **kwargs: original(*args, **kwargs)  # NOTE: bound to the user's module
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(**SMALL))
    req = core.make_request(PROMPT, max_new_tokens=4)
    core.add(req)
    news = core.step()
    assert news == [req] and req.status.name == "FAILED"
    assert "layer" in req.error and "[1]" in req.error and "attention" in req.error
