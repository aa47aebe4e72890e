"""verl 0.9.1 with `rollout.integrations.verl` as its rollout backend, on a local Ray cluster (CPU): verl's
own `LLMServerClient.generate` and `SingleTurnAgentLoop.run` reach our server actor through the plug-in
(`VERL_USE_EXTERNAL_MODULES=rollout.integrations.verl`), the logprobs equal teacher forcing, and a
`ServerAdapter` (built as verl's checkpoint engine builds one) updating the weights from a `(name, tensor)`
generator changes what it generates.

verl pins other versions of our dependencies, so it lives in a venv of its own (`.ci/framework_clients`); the
test runs this file as a client script with the Python named by `ROLLOUT_VERL_PYTHON` (ours on its path) and
skips without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = os.environ.get("ROLLOUT_VERL_PYTHON")
if __name__ != "__main__":
    if not PYTHON or not Path(PYTHON).is_file():
        pytest.skip(
            "no verl client (pip install --no-deps verl==0.9.1 and its imports in a venv of its own, as "
            ".ci/framework_clients does, then set ROLLOUT_VERL_PYTHON to its python)",
            allow_module_level=True,
        )
    pytestmark = pytest.mark.timeout(600)

sys.path.insert(0, str(Path(__file__).parents[1]))

PROMPT = [7, 30, 41, 9, 77, 12, 5, 66, 90, 3, 21, 54]
MESSAGES = [{"role": "user", "content": "add 12 and 30"}]


def test_verl_llm_server_client_agent_loop_and_server_adapter(tmp_path):
    import torch
    from support.serving import make_tokenizer, save_tiny
    from support.tiny_models import hf_greedy, make_model, teacher_forced_logits

    model_dir, new_dir = save_tiny(tmp_path / "model"), save_tiny(tmp_path / "new", seed=1)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VERL_USE_EXTERNAL_MODULES": "rollout.integrations.verl"}
    proc = subprocess.run(
        [PYTHON, __file__, "client", str(model_dir), str(new_dir)],
        capture_output=True,
        text=True,
        timeout=500,
        env=env,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    old, new = make_model("qwen3", seed=0), make_model("qwen3", seed=1)
    eos = make_tokenizer().eos_token_id

    def greedy_prefix(model, prompt, tokens):
        """Each token is the argmax of the model's teacher-forced logits (a near tie may go either way over 28
        tokens of a random model), and the sample ran verl's budget or ended at EOS."""
        logits = teacher_forced_logits(model, prompt, tokens)
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (chosen >= logits.max(dim=1).values - 1e-4).all(), tokens
        assert len(tokens) == 32 + 8 - len(prompt) or tokens[-1] == eos  # verl's budget, or EOS

    greedy_prefix(old, PROMPT, out["client"]["token_ids"])
    assert out["client"]["stop_reason"] == "completed"
    logits = teacher_forced_logits(old, PROMPT, out["client"]["token_ids"])
    forced = torch.log_softmax(logits, -1).gather(1, torch.tensor(out["client"]["token_ids"])[:, None])[:, 0]
    assert out["client"]["log_probs"] == pytest.approx(forced.tolist(), abs=1e-4)
    loop = out["agent_loop"]
    prompt_ids = make_tokenizer().apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert loop["prompt_ids"] == list(prompt_ids)
    assert loop["response_ids"] == hf_greedy(old, list(prompt_ids), len(loop["response_ids"]))  # 8: no tie
    logits = teacher_forced_logits(old, list(prompt_ids), loop["response_ids"])
    forced = torch.log_softmax(logits, -1).gather(1, torch.tensor(loop["response_ids"])[:, None])[:, 0]
    assert loop["response_logprobs"] == pytest.approx(forced.tolist(), abs=1e-4)
    assert loop["response_mask"] == [1] * len(loop["response_ids"])
    assert out["update"]["version"] == 1 and out["update"]["global_steps"] == 7
    greedy_prefix(new, PROMPT, out["update"]["token_ids"])
    assert out["update"]["token_ids"] != out["client"]["token_ids"]
    assert set(out["update"]["weight_versions"]) == {1}


# ------------------------------------------------------------------------------------- the verl client
def _client(model_dir: str, new_dir: str) -> None:
    import asyncio

    import ray
    import torch
    from omegaconf import OmegaConf

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            "env_vars": {
                "VERL_USE_EXTERNAL_MODULES": "rollout.integrations.verl",
                "PYTHONPATH": os.environ["PYTHONPATH"],
            }
        },
    )
    import verl  # noqa: F401  (imports the plug-in: VERL_USE_EXTERNAL_MODULES)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
    from verl.utils.dataset.rl_dataset import RLHFDataset
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutReplicaRegistry
    from verl.workers.rollout.router import GlobalRequestLoadBalancer

    rollout = RolloutConfig(
        name="rollout",
        mode="async",
        prompt_length=32,
        response_length=8,
        tensor_model_parallel_size=1,
        calculate_log_probs=True,
        free_cache_engine=False,
        dtype="float32",
    )  # NOTE: verl's default is bfloat16; the checks compare fp32 math
    model_config = HFModelConfig(path=model_dir)
    config = OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {
                    "name": "rollout",
                    "prompt_length": 32,
                    "response_length": 8,
                    "full_determinism": False,
                }
            }
        }
    )
    result: dict = {}

    async def main():
        replica = RolloutReplicaRegistry.get("rollout")(
            replica_rank=0, config=rollout, model_config=model_config, gpus_per_node=1
        )
        await replica.init_standalone()
        balancer = ray.remote(GlobalRequestLoadBalancer).remote(
            servers={replica.server_address: replica.server_handle}
        )
        client = LLMServerClient(config=config, load_balancer_handle=balancer)
        greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
        out = await client.generate("req-1", prompt_ids=list(PROMPT), sampling_params=dict(greedy))
        result["client"] = {
            "token_ids": out.token_ids,
            "log_probs": out.log_probs,
            "stop_reason": out.stop_reason,
        }

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        loop = SingleTurnAgentLoop(
            trainer_config=DictConfigWrap(config),
            server_manager=client,
            tokenizer=tokenizer,
            processor=None,
            dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(OmegaConf.create({})),
        )
        episode = await loop.run(dict(greedy), raw_prompt=MESSAGES)
        result["agent_loop"] = {
            "prompt_ids": list(episode.prompt_ids),
            "response_ids": list(episode.response_ids),
            "response_mask": list(episode.response_mask),
            "response_logprobs": list(episode.response_logprobs or []),
        }

        # the trainer side: a ServerAdapter as verl's checkpoint engine builds it, fed (name, tensor) pairs
        adapter = get_rollout_class("rollout", "async")(
            config=rollout, model_config=model_config, device_mesh=None
        )
        new = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32)
        version = await adapter.update_weights(
            ((n, p.detach()) for n, p in new.named_parameters()), global_steps=7
        )
        out = await client.generate("req-2", prompt_ids=list(PROMPT), sampling_params=dict(greedy))
        result["update"] = {
            "version": version,
            "token_ids": out.token_ids,
            "global_steps": out.extra_fields.get("global_steps"),
            "weight_versions": out.extra_fields.get("weight_versions"),
        }

    asyncio.run(main())
    ray.shutdown()
    print(json.dumps(result))


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "client":
    _client(sys.argv[2], sys.argv[3])
