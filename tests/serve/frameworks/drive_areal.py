"""Run in AReaL's own venv (`pip install --no-deps areal==1.0.4` + its small deps): its `RemotevLLMEngine.agenerate`
(the default vLLM backend, token prompts to `/v1/completions`) against a `rollout serve` at HOST:PORT (no API key);
prints one JSON line.

    python drive_areal.py HOST:PORT PROMPT_IDS_JSON
"""

import asyncio
import json
import sys


async def main(addr: str, prompt: list[int]) -> dict:
    from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
    from areal.api.io_struct import ModelRequest
    from areal.engine.vllm_remote import RemotevLLMEngine

    engine = RemotevLLMEngine(InferenceEngineConfig(backend="vllm:d1", experiment_name="rollout-test",
                                                    trial_name="t0", request_timeout=120, setup_timeout=60))
    engine.initialize(addr=[addr])
    try:
        gconfig = GenerationHyperparameters(max_new_tokens=6, temperature=1.0, n_samples=1)
        resp = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig))
        greedy = GenerationHyperparameters(max_new_tokens=6, greedy=True, n_samples=1)
        g = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=greedy))
    finally:
        engine.destroy()
    return {"input_tokens": resp.input_tokens, "output_tokens": resp.output_tokens,
            "output_logprobs": resp.output_logprobs, "output_versions": resp.output_versions,
            "stop_reason": resp.stop_reason, "greedy_tokens": g.output_tokens}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))))
