"""Run in verifiers' own venv (`pip install verifiers==0.4.0`): its `TrainClient.get_response` against a `rollout
serve` at URL (the model dir MODEL gives the renderer's tokenizer); prints one JSON line of what came back.

    python drive_verifiers.py URL KEY MODEL
"""

import asyncio
import json
import os
import sys


async def main(url: str, key: str, model_dir: str) -> dict:
    from verifiers.v1.clients.train import TrainClient
    from verifiers.v1.configs.client import TrainClientConfig
    from verifiers.v1.dialects.chat import ChatDialect
    from verifiers.v1.types import SamplingConfig

    os.environ["ROLLOUT_TEST_KEY"] = key
    config = TrainClientConfig(base_url=url + "/v1", api_key_var="ROLLOUT_TEST_KEY", renderer_model_name=model_dir)
    client = TrainClient(config)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Reverse the word hello."}]}
    sampling = SamplingConfig(max_tokens=8, temperature=1.0, seed=5, top_k=4, return_sampling_mask=True,
                              ignore_eos=True)
    try:
        response = await client.get_response(ChatDialect(), body, sampling, session_id="sess-1")
    finally:
        await client.close()
    tokens = response.tokens
    mask = tokens.sampling_mask
    return {"prompt_ids": tokens.prompt_ids, "completion_ids": tokens.completion_ids,
            "completion_logprobs": tokens.completion_logprobs, "content": response.message.content,
            "finish_reason": response.finish_reason, "id": response.id,
            "mask_counts": None if mask is None else [int(c) for c in mask.counts],
            "mask_ids": None if mask is None else [int(i) for i in mask.ids]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:4]))))
