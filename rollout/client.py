"""`RolloutClient`: a trainer's handle on a `rollout serve` (or `vllm serve`-style) server: RL control and
weight pushes over `torch.distributed`.

    client = RolloutClient("http://127.0.0.1:8000", api_key="KEY")
    client.update_weights(model)           # joins a 2-rank gloo group on first use, broadcasts every tensor
    batch = client.generate(prompt_ids, temps=1.0, group_size=8, max_new_tokens=64, seed=0)   # a RolloutBatch
    client.complete(prompt_ids, max_tokens=64, temperature=1.0)    # the raw /v1/completions answer

It is a `rollout.Rollout` like `RolloutEngine`: `generate` / `score` take the same arguments (through a one-server
`RolloutPool`), `update_weights(source, in_flight, recompute_kv)` the same door.

The push follows vLLM's route names: `/init_weight_transfer_engine` (the server joins this trainer's group
as rank 1), `/start_weight_update`, `/update_weights` (names, dtypes and shapes of a chunk, checked by the
server before any tensor moves; then rank 0 broadcasts the chunk), `/finish_weight_update` (the server
copies everything in at once, bumps the weight version and drops stale prefix KV): one server's case of
`rollout.weights.broadcast.WeightBroadcaster`, one wire format for both. Needs `httpx`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence

import torch

from rollout.api.batch import RolloutBatch
from rollout.api.score_batch import ScoreBatch
from rollout.in_flight import PAUSE_DEFAULT, UPDATE_DEFAULT, InFlight, check_mode, check_remote_update
from rollout.sampling_params import SamplingParams


class RolloutClient:
    """HTTP client of one rollout server.

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        api_key: the server's key (None when it has none).
        timeout: seconds per HTTP call.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, tokenizer=None) -> None:
        import httpx

        self.base_url, self.api_key, self.tokenizer, self.timeout = base_url.rstrip("/"), api_key, tokenizer, timeout
        self._pool = None  # the one-server RolloutPool behind generate / score, made on first use
        self._version = 0
        self.device = torch.device("cpu")  # NOTE: batches are built here; the trainer moves them
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = 0 if pad is None else int(pad)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self.weights = None  # the WeightBroadcaster of the weight push, formed on first use

    # ------------------------------------------------------------- plain calls
    def _post(self, path: str, json: dict | None = None, params: dict | None = None) -> dict:
        r = self.http.post(path, json=json, params=params)
        if r.status_code >= 400:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text}")
        return r.json() if r.content else {}

    def _get(self, path: str) -> dict:
        r = self.http.get(path)
        if r.status_code >= 400:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text}")
        return r.json()

    def health(self) -> bool:
        return self.http.get("/health").status_code == 200

    def complete(self, prompt: list[int] | list[list[int]] | str, **fields) -> dict:
        """POST /v1/completions with token ids back (`return_token_ids`); `fields` are the request's fields."""
        return self._post("/v1/completions", {"prompt": prompt, "return_token_ids": True, **fields})

    def generate(self, prompts, temps=None, group_size: int = 1, max_new_tokens: int | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None, *,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 return_routed_experts: bool = False) -> RolloutBatch:
        """`RolloutEngine.generate` on this server (a one-server `RolloutPool`: the same seeds, the same batch)."""
        return self._rollouts().generate(prompts, temps, group_size, max_new_tokens, top_k, top_p, seed,
                                         sampling=sampling, return_routed_experts=return_routed_experts)

    def score(self, prompt_ids, completion_ids=None, top_logprobs: int = 0, prompt_logprobs: bool = False,
              temps=None, progress: bool = False, *, sampling: SamplingParams | Sequence[SamplingParams] | None = None,
              return_routed_experts: bool = False) -> ScoreBatch:
        """`RolloutEngine.score` on this server (`RolloutPool.score`: the completions' logprobs)."""
        return self._rollouts().score(prompt_ids, completion_ids, top_logprobs, prompt_logprobs, temps, progress,
                                      sampling=sampling, return_routed_experts=return_routed_experts)

    def _rollouts(self):
        if self._pool is None:
            from rollout.fleet.pool import RolloutPool  # noqa: PLC0415 (the pool's thread pool on first use)

            self._pool = RolloutPool([self.base_url], api_key=self.api_key, tokenizer=self.tokenizer,
                                     request_timeout_s=self.timeout, weight_transfer="disk", routing="least_loaded")
        return self._pool

    @property
    def policy_version(self) -> int:
        """The server's weight version (the last one seen when the server does not answer)."""
        try:
            self._version = self.weight_version()
        except Exception:  # NOTE: `isinstance(client, Rollout)` reads it; a down server must not raise there
            pass
        return self._version

    def pause(self, mode: InFlight = PAUSE_DEFAULT) -> dict:
        """`POST /pause?mode=`: "abort" (default) | "wait" | "keep" (`rollout.in_flight`)."""
        return self._post("/pause", params={"mode": check_mode(mode, "mode")})

    def resume(self) -> dict:
        return self._post("/resume")

    def is_paused(self) -> bool:
        return bool(self._get("/is_paused")["is_paused"])

    def reset_prefix_cache(self) -> dict:
        return self._post("/reset_prefix_cache")

    def sleep(self) -> dict:
        return self._post("/sleep")

    def wake_up(self) -> dict:
        return self._post("/wake_up")

    def wake(self) -> dict:
        """`RolloutEngine.wake`'s name for `wake_up`."""
        return self.wake_up()

    def weight_version(self) -> int:
        return int(self._get("/get_weight_version")["weight_version"])

    def update_weights_from_disk(self, model_path: str, in_flight: InFlight = UPDATE_DEFAULT) -> int:
        """The server loads `model_path`; `in_flight` (`rollout.in_flight`, default "wait") says what its running
        requests do meanwhile. Returns the new weight version."""
        params = {"in_flight": check_mode(in_flight, "in_flight")}
        return int(self._post("/update_weights_from_disk", {"model_path": model_path}, params)["weight_version"])

    # ------------------------------------------------------------ weight push
    def init_weight_transfer(self, master_address: str = "127.0.0.1", timeout_s: float = 120.0) -> None:
        """Form the 2-rank group (this process rank 0, the server rank 1; gloo, or NCCL on CUDA)."""
        from rollout.weights.broadcast import WeightBroadcaster  # noqa: PLC0415 (torch.distributed on first push)

        if self.weights is not None:
            self.weights.close()
        self.weights = WeightBroadcaster([self.base_url], api_key=self.api_key, timeout_s=timeout_s,
                                         master_address=master_address)
        self.weights.init()

    def update_weights(self, source: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable | str,
                       in_flight: InFlight = UPDATE_DEFAULT, recompute_kv: bool = False, *,
                       version: int | None = None) -> int:
        """Push every tensor of `model` (a module, a state dict, or (name, tensor) pairs) to the server in
        buckets, through the same wire format as a broadcast to many servers (`WeightBroadcaster`: a tensor
        shared by two names goes once); returns the server's new weight version. `in_flight`
        (`rollout.in_flight`, default "wait"): what the server's running requests do meanwhile. `source` may be a
        `save_pretrained` directory the server can read (`/update_weights_from_disk`). `recompute_kv` and `version`
        are `RolloutEngine.update_weights`' (the server counts its own versions: `version` is refused)."""
        check_mode(in_flight, "in_flight")
        check_remote_update(recompute_kv, version, "RolloutClient")
        if isinstance(source, (str, os.PathLike)):
            return self.update_weights_from_disk(str(source), in_flight)
        if self.weights is None:
            self.init_weight_transfer()
        (new_version,) = self.weights.broadcast(source, in_flight=in_flight)
        return new_version

    def push_lora(self, name: str, adapter, config=None, in_flight: InFlight = UPDATE_DEFAULT) -> int:
        """Push LoRA adapter `name` (a PeftModel, a PEFT state dict with its `config`, or a directory) to the
        server in memory, over the weight-transfer group: its tensors only, never a file. The server adds it or
        updates it in place (`in_flight` as `update_weights`); returns its adapter version (1 when added)."""
        check_mode(in_flight, "in_flight")
        if self.weights is None:
            self.init_weight_transfer()
        (version,) = self.weights.broadcast_lora(name, adapter, config, in_flight=in_flight)
        return version

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
