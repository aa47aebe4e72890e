"""Run in SkyRL's own venv (`pip install --no-deps --ignore-requires-python skyrl==0.4.0` + its small deps): its
`RemoteInferenceClient` against a `rollout serve` at URL (no API key: SkyRL sends none); prints one JSON line.

    python drive_skyrl.py URL
"""

import asyncio
import json
import sys
import typing

import typing_extensions

typing.TypedDict = typing_extensions.TypedDict  # NOTE: SkyRL's pydantic models need it on Python 3.11 (FACTS.md)


async def main(url: str) -> dict:
    from skyrl.backends.skyrl_train.inference_servers.remote_inference_client import RemoteInferenceClient

    client = RemoteInferenceClient(proxy_url=url, server_urls=[url], data_parallel_size=1, model_name="tiny")
    out: dict = {}
    try:
        out["world_size"] = list(await client.get_world_size())
        (ids,) = await client.tokenize(["Reverse the word hello."])
        out["prompt_ids"] = ids
        batch = {"prompt_token_ids": [ids, ids], "session_ids": ["sess-1", "sess-2"],
                 "sampling_params": {"max_tokens": 6, "temperature": 1.0, "logprobs": 0, "seed": 1,
                                     "ignore_eos": True}}
        gen = await client.generate(batch)
        out["generate"] = {"response_ids": gen["response_ids"], "responses": gen["responses"],
                           "stop_reasons": gen["stop_reasons"], "logprobs": gen["response_logprobs"]}
        sample = await client.sample({"json": {
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": ids}]}, "num_samples": 2,
            "sampling_params": {"max_tokens": 4, "temperature": 1.0, "seed": 3},
            "session_id": "sess-3", "prompt_logprobs": True, "topk_prompt_logprobs": 2}})
        out["sample"] = sample
        # keep-mode pause: a request in flight freezes and finishes after /resume, no retry
        long = asyncio.create_task(client.generate({"prompt_token_ids": [ids], "sampling_params": {
            "max_tokens": 900, "temperature": 1.0, "ignore_eos": True, "logprobs": 0}}))
        await asyncio.sleep(0.3)
        await client.pause(mode="keep")
        out["paused_while_running"] = not long.done()
        await asyncio.sleep(0.5)
        await client.resume()
        held = await long
        out["kept_tokens"] = len(held["response_ids"][0])
        out["kept_stop"] = held["stop_reasons"][0]
        await client.reset_prefix_cache()
        await client.finish_session("sess-1")
        await client.sleep(level=1)
        out["asleep"] = await client.is_sleeping()
        await client.wake_up()
        out["awake_again"] = not await client.is_sleeping()
        after = await client.generate({"prompt_token_ids": [ids], "sampling_params": {
            "max_tokens": 6, "temperature": 1.0, "logprobs": 0, "seed": 1, "ignore_eos": True}})
        out["after_wake"] = after["response_ids"][0]
        out["detok"] = (await client.detokenize([gen["response_ids"][0]]))[0]
    finally:
        await client.teardown()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
