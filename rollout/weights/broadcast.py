"""`WeightBroadcaster`: the learner's end of one weight broadcast to every rollout server at once.

    sync = WeightBroadcaster(["http://127.0.0.1:8001", "http://127.0.0.1:8002"], api_key="KEY")
    sync.init()                  # one group: this process rank 0, server i rank i + 1 (gloo, or NCCL on CUDA)
    versions = sync.broadcast(model)     # every server's new weight version, equal
    sync.close()

A broadcast is vLLM's weight-transfer sequence, sent to all servers: `/start_weight_update`, then per bucket
(tensors of one dtype flattened into at most `bucket_bytes`, `rollout.weights.transfer`) `/update_weights` with
`packed: true` to every server and ONE `broadcast` of the flat buffer, which reaches all of them; then
`/finish_weight_update` (each server copies the staged tensors into its engine in place, bumps its version,
drops stale prefix KV). A server that dies breaks the group: `init(urls)` again over the survivors (the
rollout pool does that, `rollout.fleet.pool`). Needs `httpx`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from rollout.in_flight import UPDATE_DEFAULT, InFlight, check_mode
from rollout.weights.transfer import buckets, free_port, named_tensors, new_group, pack_bucket

logger = logging.getLogger("rollout.weights.broadcast")

DEFAULT_BUCKET_BYTES = 64 * 2**20


class WeightBroadcaster:
    """Rank 0 of a broadcast group whose other ranks are `rollout serve` processes.

    Args:
        urls: the servers' base URLs; server i joins as rank i + 1.
        api_key: their key (None when they have none).
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors; every server on a GPU); None: "nccl" when
            CUDA is available, else "gloo".
        bucket_bytes: the largest flat buffer one broadcast sends (a larger tensor goes alone).
        timeout_s: bounds joining the group, each HTTP call and each broadcast (a hung server fails the
            update after this long instead of hanging the learner).
        master_address: where this process hosts the group's `TCPStore` (an address the servers reach).
    """

    def __init__(self, urls: Sequence[str], api_key: str | None = None, backend: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 120.0,
                 master_address: str = "127.0.0.1") -> None:
        import httpx

        if not urls:
            raise ValueError("urls must name at least one rollout server")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and not (
            torch.cuda.is_available() and hasattr(torch.distributed, "ProcessGroupNCCL")
        ):
            raise ValueError("backend 'nccl' needs CUDA and a torch built with NCCL; use 'gloo'")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.urls = [u.rstrip("/") for u in urls]
        self.bucket_bytes, self.timeout_s, self.master_address = bucket_bytes, timeout_s, master_address
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout_s)
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        )
        self.group = None
        self._store = None
        self.members: list[str] = []  # the servers in the current group, in rank order
        self._buffers: dict[torch.dtype, torch.Tensor] = {}  # [<= bucket elements] per dtype, reused
        self._calls = ThreadPoolExecutor(max(2, len(self.urls)), thread_name_prefix="weight-sync")

    # ----------------------------------------------------------------------------- http
    def _post(self, url: str, path: str, body: dict | None = None) -> dict:
        r = self.http.post(url + path, json=body)
        if r.status_code >= 400:
            raise RuntimeError(f"{url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else {}

    def _all(self, fn: Callable[[str], dict], urls: Iterable[str] | None = None) -> list[dict]:
        """`fn(url)` on every member at once; the first failure is raised (after all have answered)."""
        futures = [self._calls.submit(fn, u) for u in (self.members if urls is None else urls)]
        results, errors = [], []
        for f in futures:
            try:
                results.append(f.result(timeout=self.timeout_s + 5))
            except Exception as e:  # NOTE: a timeout here too: never wait on a hung server for ever
                errors.append(e)
        if errors:
            raise errors[0]
        return results

    # ---------------------------------------------------------------------------- group
    def init(self, urls: Sequence[str] | None = None) -> None:
        """Form the group over `urls` (default: all the servers given), leaving any earlier one."""
        if urls is not None:
            self.urls = [u.rstrip("/") for u in urls]
        if not self.urls:
            raise RuntimeError("no rollout server left to send weights to")
        self.close_group()
        port = free_port(self.master_address)
        world = len(self.urls) + 1
        answers: dict[str, BaseException | None] = {}

        def ask(rank: int, url: str) -> None:
            info = {"master_address": self.master_address, "master_port": port, "rank_offset": rank,
                    "world_size": world, "backend": self.backend, "timeout_s": self.timeout_s}
            try:
                self._post(url, "/init_weight_transfer_engine", {"init_info": info})
                answers[url] = None
            except BaseException as e:
                answers[url] = e

        askers = [threading.Thread(target=ask, args=(i + 1, u), daemon=True) for i, u in enumerate(self.urls)]
        for a in askers:
            a.start()
        try:
            self._store, self.group = new_group(self.master_address, port, 0, world, self.timeout_s, self.backend,
                                                is_master=True)
        finally:
            for a in askers:
                a.join(self.timeout_s + 5)
        failed = {u: e for u, e in answers.items() if e is not None}
        if failed or len(answers) < len(self.urls):
            self.group = self._store = None
            raise RuntimeError(f"weight group not formed: {failed or 'a server did not answer'}")
        self.members = list(self.urls)
        logger.info("weight broadcast group formed: learner rank 0, %d rollout server(s) (%s, %s)",
                    len(self.members), self.backend, ", ".join(self.members))

    def close_group(self) -> None:
        """Leave the current group (each member is told to leave it too, best effort)."""
        if self.group is None:
            return
        for url in self.members:
            try:
                self.http.post(url + "/close_communicator", timeout=5)
            except Exception:  # NOTE: a dead member cannot answer; it leaves with its process
                pass
        self.group = self._store = None
        self.members = []

    # ------------------------------------------------------------------------ broadcast
    def broadcast(self, model: torch.nn.Module | Mapping[str, torch.Tensor] | Iterable,
                  in_flight: InFlight = UPDATE_DEFAULT) -> list[int]:
        """Send every tensor of `model` (a module, a state dict, or (name, tensor) pairs) to every member in
        buckets; returns each member's new weight version (rank order). `in_flight` (`rollout.in_flight`):
        what each member's running requests do ("wait", the default: they finish under the old weights first;
        "keep": the weights land between two engine steps, the requests kept; "abort")."""
        answers = self._push(named_tensors(model), {"is_checkpoint_format": True}, in_flight)
        return [int(a["weight_version"]) for a in answers]

    def broadcast_lora(self, name: str, adapter, config=None, in_flight: InFlight = UPDATE_DEFAULT) -> list[int]:
        """Send LoRA adapter `name` (a PeftModel, a PEFT state dict with its `config`, or a directory) to every
        member, in memory: its tensors only, through the same buckets; each member adds it, or updates it in
        place (`in_flight` as `broadcast`). Returns each member's adapter version (`rollout.serve.lora_routes`)."""
        from rollout.weights.lora_adapters import as_state_dict  # noqa: PLC0415

        check_mode(in_flight, "in_flight")
        state, fields = as_state_dict(adapter, config)
        answers = self._push(list(state.items()), {"lora_name": name, "lora_config": fields}, in_flight)
        return [int(a["lora_version"]) for a in answers]

    def _push(self, items: list, start: dict, in_flight: InFlight) -> list[dict]:
        """One transfer of `items` ((name, tensor) pairs) opened with the `start` body; each member's answer."""
        check_mode(in_flight, "in_flight")
        if self.group is None:
            self.init()
        self._all(lambda u: self._post(u, "/start_weight_update", start))
        sent = 0
        for bucket in buckets(items, self.bucket_bytes):
            info = {"names": [n for n, _ in bucket],
                    "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                    "shapes": [list(t.shape) for _, t in bucket], "packed": True}
            # NOTE: every member checks the names and shapes and answers before it receives, so a refused
            # bucket never leaves this side waiting in the broadcast.
            self._all(lambda u, info=info: self._post(u, "/update_weights", {"update_info": info}))
            flat = self._flat([t for _, t in bucket])
            self.group.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
        finish = f"/finish_weight_update?in_flight={in_flight}"
        answers = self._all(lambda u: self._post(u, finish))
        logger.info("%s broadcast to %d server(s): %.1f MB, versions %s", start.get("lora_name") or "weights",
                    len(self.members), sent / 2**20, [a.get("lora_version", a["weight_version"]) for a in answers])
        return answers

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return pack_bucket(tensors, self._buffers, self.device)

    def close(self) -> None:
        self._buffers.clear()
        self.close_group()
        self._calls.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def __enter__(self) -> WeightBroadcaster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
