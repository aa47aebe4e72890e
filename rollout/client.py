"""`RolloutClient`: a trainer's handle on a `rollout serve` (or `vllm serve`-style) server: RL control and
weight pushes over `torch.distributed`.

    client = RolloutClient("http://127.0.0.1:8000", api_key="KEY")
    client.update_weights(model)           # joins a 2-rank gloo group on first use, broadcasts every tensor
    client.generate(prompt_ids, max_tokens=64, temperature=1.0)

The push follows vLLM's route names: `/init_weight_transfer_engine` (the server joins this trainer's group
as rank 1), `/start_weight_update`, `/update_weights` (names, dtypes and shapes of a chunk, checked by the
server before any tensor moves; then rank 0 broadcasts the chunk), `/finish_weight_update` (the server
copies everything in at once, bumps the weight version and drops stale prefix KV): one server's case of
`rollout.weights.broadcast.WeightBroadcaster`, one wire format for both. Needs `httpx`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from rollout.in_flight import PAUSE_DEFAULT, UPDATE_DEFAULT, InFlight, check_mode


class RolloutClient:
    """HTTP client of one rollout server.

    Args:
        base_url: e.g. "http://127.0.0.1:8000".
        api_key: the server's key (None when it has none).
        timeout: seconds per HTTP call.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        import httpx

        self.base_url, self.api_key = base_url.rstrip("/"), api_key
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

    def generate(self, prompt: list[int] | list[list[int]] | str, **fields) -> dict:
        """POST /v1/completions with token ids back (`return_token_ids`); `fields` are the request's fields."""
        return self._post("/v1/completions", {"prompt": prompt, "return_token_ids": True, **fields})

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

    def update_weights(self, model: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable,
                       in_flight: InFlight = UPDATE_DEFAULT) -> int:
        """Push every tensor of `model` (a module, a state dict, or (name, tensor) pairs) to the server in
        buckets, through the same wire format as a broadcast to many servers (`WeightBroadcaster`: a tensor
        shared by two names goes once); returns the server's new weight version. `in_flight`
        (`rollout.in_flight`, default "wait"): what the server's running requests do meanwhile."""
        check_mode(in_flight, "in_flight")
        if self.weights is None:
            self.init_weight_transfer()
        (version,) = self.weights.broadcast(model, in_flight=in_flight)
        return version

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
        if self.weights is not None:
            self.weights.close()
            self.weights = None
        self.http.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
