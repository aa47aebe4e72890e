"""Run in SkyRL's venv: its Tinker server's `ExternalInferenceClient._forward_to_engine` (base-model sampling: token
prompts to `/v1/completions` with `n`, `seed`, `logprobs: true`, `prompt_logprobs`, `X-Session-ID`) against a `rollout
serve` at URL; prints one JSON line of the `SampleOutput`.

    python drive_skyrl_tinker.py URL PROMPT_IDS_JSON
"""

import asyncio
import json
import sys
import typing
from types import SimpleNamespace

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # NOTE: SkyRL's pydantic models need it on Python 3.11 (FACTS.md)


async def main(url: str, prompt: list[int]) -> dict:
    import httpx
    from skyrl.tinker.api import ModelInput, SampleRequest, SamplingParams
    from skyrl.tinker.extra.external_inference import ExternalInferenceClient

    config = SimpleNamespace(external_inference_url=url, external_inference_api_key="unused", checkpoints_base=None,
                             external_inference_lora_base=None)
    client = ExternalInferenceClient(config, db_engine=None)
    request = SampleRequest(
        num_samples=2, base_model="tiny", sampling_session_id="sess-A", seq_id=3, prompt_logprobs=True,
        topk_prompt_logprobs=1,
        prompt=ModelInput.model_validate({"chunks": [{"type": "encoded_text", "tokens": prompt}]}),
        sampling_params=SamplingParams(max_tokens=5, seed=11, temperature=1.0))
    async with httpx.AsyncClient(base_url=client.base_url, timeout=120) as http:
        out = await client._forward_to_engine(request, "m", "c", http, base_model="tiny")
    return json.loads(out.model_dump_json())


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], json.loads(sys.argv[2])))))
