"""`RolloutPool`: a learner's rollouts from one or more `rollout serve` processes, with the engine's RL API.

    pool = RolloutPool(urls, tokenizer=tok)          # or RolloutPool(urls, api_key=..., pad_token_id=0)
    batch = pool.generate(prompt_ids, temps=1.0, group_size=8, max_new_tokens=64, seed=0)   # RolloutBatch
    version = pool.update_weights(model)             # one broadcast to every live server
    pool.close()

Each prompt's group is one `/v1/completions` request (token ids in, `n=group_size`, `return_token_ids`,
`logprobs=0`: token ids and logprobs out, no retokenisation; the answering weights' version from the
`X-Weight-Version` header, or per token from `weight_versions` where the server reports them), sent to the live
server holding the prompt's longest cached prefix (`routing="prefix"`, the default; a later agent turn or a
revisited prompt then prefills only its new tokens), unless that server is busier than the least-loaded by more
than a few groups, else to the least loaded. Group i of a call seeded `s` goes out seeded `group_seed(s, i)`
(`rollout.sampling.seeding`), so its samples are the in-process engine's for the same call, whichever server
runs it. Bad `temps` are refused (ValueError naming `temps`) before any request is sent. Liveness: every request has a
deadline (`request_timeout_s`); a request that fails (refused connection, timeout, 5xx) makes the pool probe that
server's `/health` (`health_timeout_s`); a server that does not answer is marked dead with a log line and its groups go
to the others, each group at most `max_attempts` times; with no server left the call raises. Nothing waits without a
deadline.

Weights: `weight_transfer="broadcast"` (default) keeps one `WeightBroadcaster` group over the live servers,
rebuilt without a server once it is dead; `"disk"` saves the model to `disk_dir` and has every server load it
(`/update_weights_from_disk`).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from rollout.api.batch import RolloutBatch, pack_batch
from rollout.api.route_wire import decode_routes
from rollout.api.score_batch import ScoreBatch, pack_scores, score_inputs
from rollout.fleet.prefix_routing import PrefixRouter
from rollout.fleet.sessions import SessionTable, check_session_ids
from rollout.in_flight import UPDATE_DEFAULT, InFlight, check_mode, check_remote_update
from rollout.requests import GenerationOutput, RequestStatus
from rollout.sampling.seeding import group_seed
from rollout.sampling_params import SamplingParams, per_prompt
from rollout.weights.broadcast import DEFAULT_BUCKET_BYTES, WeightBroadcaster

logger = logging.getLogger("rollout.fleet.pool")


class RolloutPool:
    """Groups of samples from several rollout servers, as a `RolloutEngine` gives them.

    Args:
        urls: the servers' base URLs.
        api_key: their key (None when they have none).
        tokenizer: encodes string prompts, decodes completions (`completions_text`), gives the pad id.
        pad_token_id: the padding id of batches (default: the tokenizer's, else 0).
        request_timeout_s: deadline of one group's request.
        health_timeout_s: deadline of a `/health` probe.
        max_attempts: how many servers one group may be tried on.
        weight_transfer: "broadcast" (torch.distributed, `rollout.weights.broadcast`) or "disk".
        backend, bucket_bytes, sync_timeout_s: the broadcast's (see `WeightBroadcaster`).
        disk_dir: where "disk" saves the weights (default: a temporary folder).
        routing: "prefix" (default: to the server holding the prompt's longest prefix, unless it is busier than
            the least-loaded by more than a few requests; `rollout.fleet.prefix_routing`) or "least_loaded".
    """

    def __init__(self, urls: Sequence[str], api_key: str | None = None, tokenizer=None,
                 pad_token_id: int | None = None, request_timeout_s: float = 300.0, health_timeout_s: float = 5.0,
                 max_attempts: int = 3, weight_transfer: str = "broadcast", backend: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, sync_timeout_s: float = 120.0,
                 disk_dir: str | None = None, routing: str = "prefix") -> None:
        import httpx

        if not urls:
            raise ValueError("urls must name at least one rollout server")
        if weight_transfer not in ("broadcast", "disk"):
            raise ValueError(f"weight_transfer must be 'broadcast' or 'disk', got {weight_transfer!r}")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be at least 1, got {max_attempts}")
        if routing not in ("prefix", "least_loaded"):
            raise ValueError(f"routing must be 'prefix' or 'least_loaded', got {routing!r}")
        self.router = PrefixRouter() if routing == "prefix" else None
        self.sessions = SessionTable()  # NOTE: X-Session-ID -> its server (`rollout.fleet.sessions`)
        self.urls = [u.rstrip("/") for u in urls]
        self.alive = list(self.urls)
        self.tokenizer = tokenizer
        pad = getattr(tokenizer, "pad_token_id", None) if pad_token_id is None else pad_token_id
        self.pad_token_id = 0 if pad is None else int(pad)
        self.request_timeout_s, self.health_timeout_s, self.max_attempts = (
            request_timeout_s,
            health_timeout_s,
            max_attempts,
        )
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(request_timeout_s, connect=health_timeout_s),
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.weight_transfer = weight_transfer
        self.sync = (WeightBroadcaster(self.urls, api_key, backend, bucket_bytes, sync_timeout_s)
                     if weight_transfer == "broadcast" else None)
        self.disk_dir = disk_dir
        self.device = torch.device("cpu")  # NOTE: batches are built here; the trainer moves them
        self.in_flight = {u: 0 for u in self.urls}
        self.resubmitted = 0  # groups sent again after their server failed
        self.prompt_tokens = self.cached_tokens = 0  # NOTE: of every answered group (`cached_fraction`)
        self.closed = False
        self._lock = threading.Lock()
        versions = {}
        for url in self.urls:
            try:
                versions[url] = self._version(url)
            except Exception as e:
                self.mark_dead(url, f"{type(e).__name__}: {e}")
        if not versions:
            raise RuntimeError(f"no rollout server answers: {', '.join(self.urls)}")
        if len(set(versions.values())) > 1:
            logger.warning("the rollout servers start at different weight versions %s: batches report the "
                           "oldest", versions)
        self.policy_version = min(versions.values())
        self._workers = ThreadPoolExecutor(64, thread_name_prefix="rollout-pool")

    # ------------------------------------------------------------------------ liveness
    def _version(self, url: str) -> int:
        r = self.http.get(url + "/get_weight_version", timeout=self.health_timeout_s)
        r.raise_for_status()
        return int(r.json()["weight_version"])

    def healthy(self, url: str) -> bool:
        try:
            return self.http.get(url + "/health", timeout=self.health_timeout_s).status_code == 200
        except Exception:
            return False

    def mark_dead(self, url: str, reason: str) -> None:
        with self._lock:
            if url not in self.alive:
                return
            self.alive.remove(url)
            lost = self.in_flight.get(url, 0)
            if self.router is not None:
                self.router.forget(url)
            self.sessions.forget(url)
        left = ", ".join(self.alive) or "none"
        logger.warning("rollout server %s is down (%s): resubmitting its %d group(s) to the %d live server(s) "
                       "left (%s)", url, reason, lost, len(self.alive), left)

    def check_servers(self) -> list[str]:
        """Probe every live server's /health; mark the silent ones dead. Returns the live ones."""
        for url in list(self.alive):
            if not self.healthy(url):
                self.mark_dead(url, "no answer to /health")
        return list(self.alive)

    def _pick(self, tried: set[str], ids: Sequence[int] = (), session: str | None = None) -> str:
        with self._lock:
            if not self.alive:
                raise RuntimeError(f"no rollout server left alive (of {len(self.urls)}: {', '.join(self.urls)})")
            fresh = [u for u in self.alive if u not in tried] or self.alive
            url = None if session is None else self.sessions.get(session, fresh)  # NOTE: a session sticks
            if url is None:
                url = (self.router.pick(ids, self.in_flight, fresh) if self.router is not None
                       else min(fresh, key=lambda u: self.in_flight[u]))
                if session is not None:
                    self.sessions.stick(session, url)
            self.in_flight[url] += 1
            return url

    # ---------------------------------------------------------------------- generation
    def _group(self, i: int, body: dict, session: str | None = None) -> dict:
        """One group's response from some live server (its session's, if it has one), trying others when one
        fails."""
        tried: set[str] = set()
        errors: list[str] = []
        headers = {} if session is None else {"X-Session-ID": session}
        for attempt in range(self.max_attempts):
            url = self._pick(tried, body["prompt"], session)
            tried.add(url)
            try:
                r = self.http.post(url + "/v1/completions", json=body, headers=headers)
            except Exception as e:  # connection refused / reset, read timeout (the request's deadline)
                if self.closed:  # NOTE: the learner is leaving (Ctrl-C): no server is to blame
                    self._done(url)
                    raise RuntimeError("the rollout pool was closed") from None
                reason = f"{type(e).__name__}: {e}"
            else:
                if r.status_code == 200 or r.status_code < 500:
                    self._done(url)
                    if r.status_code != 200:  # NOTE: a bad request fails the same on every server
                        raise ValueError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
                    if attempt:
                        logger.warning("group %d done on %s after %d failed attempt(s)", i, url, attempt)
                    answer = r.json()
                    answer["weight_version"] = int(r.headers.get("x-weight-version", self.policy_version))
                    self._remember(body["prompt"], answer, url)
                    return answer
                reason = f"HTTP {r.status_code}"
            errors.append(f"{url}: {reason}")
            if not self.healthy(url):
                self.mark_dead(url, reason)  # NOTE: before this group leaves in_flight: the log counts it
            else:
                logger.warning("group %d failed on %s (%s), server still healthy: trying again", i, url, reason)
            self._done(url)
            with self._lock:
                self.resubmitted += 1
        raise RuntimeError(f"group {i} failed on {self.max_attempts} attempt(s): {'; '.join(errors)}")

    def _remember(self, prompt: list[int], answer: dict, url: str) -> None:
        """The server now caches each completion after its prompt too: a later turn extending one routes there.
        Counts the prompt tokens sent and those the server's prefix cache served (`cached_fraction`)."""
        usage = answer.get("usage") or {}
        with self._lock:
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.cached_tokens += int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            if self.router is not None:
                for c in answer.get("choices", ()):
                    self.router.record(self.router.block_hashes(prompt + list(c.get("token_ids") or ())), url)

    @property
    def cached_fraction(self) -> float:
        """The share of the prompt tokens sent so far that the servers' prefix caches served."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _done(self, url: str) -> None:
        with self._lock:
            self.in_flight[url] -= 1

    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], temps: float | Sequence[float] | None = None,
                 group_size: int = 1, max_new_tokens: int | None = None, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, *,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 return_routed_experts: bool = False,
                 session_ids: Sequence[str | None] | None = None) -> RolloutBatch:
        """`group_size` samples per prompt from the servers; returns a `RolloutBatch` on the CPU, rows grouped
        by prompt, `policy_version` the oldest weight version that answered. `return_routed_experts` (an MoE
        policy) adds `batch.routed_experts` [N, P + T, L, k], from each choice's `routed_experts`. `session_ids`
        (one per prompt, or None): a prompt's group goes to the server its session's earlier groups went to
        (sent as `X-Session-ID`), until `finish_session`."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        ids = [self._encode(p) for p in prompts]
        each = per_prompt(sampling, len(ids), temps=temps, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens)  # NOTE: refused here, before any request leaves
        sessions = check_session_ids(session_ids, len(ids))
        bodies = [{"prompt": p, "n": group_size, "return_token_ids": True, **completion_fields(each[i], i),
                   **({"return_routed_experts": True} if return_routed_experts else {})}
                  for i, p in enumerate(ids)]
        futures = [self._workers.submit(self._group, i, b, sessions[i]) for i, b in enumerate(bodies)]
        # NOTE: each future ends within max_attempts x (request deadline + health probe)
        bound = self.max_attempts * (self.request_timeout_s + 2 * self.health_timeout_s) + 30
        outputs: list[GenerationOutput] = []
        for i, f in enumerate(futures):
            answer = f.result(timeout=bound)
            outputs += self.outputs_from_answer(i, ids[i], group_size, answer, answer["weight_version"])
        if return_routed_experts and any(o.routed_experts is None for o in outputs):
            raise RuntimeError("return_routed_experts: a server answered without routed_experts (an old server?)")
        return pack_batch(
            ids,
            outputs,
            [sp.temperature for sp in each],
            group_size,
            self.pad_token_id,
            self.policy_version,
            self.device,
            self.tokenizer,
            routed_experts=return_routed_experts,
        )

    def score(self, prompt_ids, completion_ids=None, top_logprobs: int = 0, prompt_logprobs: bool = False,
              temps: float | Sequence[float] | None = None, progress: bool = False, *,
              sampling: SamplingParams | Sequence[SamplingParams] | None = None,
              return_routed_experts: bool = False) -> ScoreBatch:
        """`RolloutEngine.score` through the servers: each row one `/v1/completions` request (`echo`, `max_tokens`
        0, `logprobs` 0) on prompt + completion, at its temperature; the completion tokens' logprobs come back. The
        pool scores completions only: `top_logprobs`, `prompt_logprobs` and routed experts are refused."""
        if top_logprobs or prompt_logprobs or return_routed_experts:
            raise ValueError("RolloutPool.score returns the completions' logprobs only: score on a RolloutEngine "
                             "for top_logprobs, prompt_logprobs or routed experts")
        prompts, completions, each, width = score_inputs(prompt_ids, completion_ids, temps, self._encode,
                                                         lambda c: [int(t) for t in c] if not isinstance(c, str)
                                                         else self._encode_text(c), sampling)
        # NOTE: a row's fields, then scoring's own: no seed (nothing is drawn), no new tokens, no top logprobs
        bodies = [{**{k: v for k, v in completion_fields(each[i], i).items() if k != "seed"}, "prompt": p + c,
                   "max_tokens": 0, "echo": True, "return_token_ids": True, "logprobs": 0}
                  for i, (p, c) in enumerate(zip(prompts, completions, strict=True))]
        futures = [self._workers.submit(self._group, i, b) for i, b in enumerate(bodies)]
        bound = self.max_attempts * (self.request_timeout_s + 2 * self.health_timeout_s) + 30
        outputs = []
        for i, f in enumerate(futures):
            choice = f.result(timeout=bound)["choices"][0]
            lps = (choice.get("logprobs") or {}).get("token_logprobs") or []
            scored = [float(x) for x in lps[len(prompts[i]):]]
            if len(scored) != len(completions[i]):
                raise RuntimeError(f"row {i}: the server scored {len(scored)} of {len(completions[i])} tokens")
            outputs.append(GenerationOutput(request_id=f"pool_score_{i}", prompt_ids=prompts[i], scores=scored,
                                            status=RequestStatus.FINISHED, finish_reason="length"))
        return pack_scores(prompts, completions, outputs, 0, None, width, self.device, False)

    def _encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("string completions need a tokenizer: pass tokenizer= to RolloutPool")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("string prompts need a tokenizer: pass tokenizer= to RolloutPool")
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return [int(t) for t in prompt]

    @staticmethod
    def outputs_from_answer(i: int, prompt: list[int], n: int, answer: dict, version: int) -> list[GenerationOutput]:
        """Group `i`'s `n` outputs from a `/v1/completions` answer (weight versions per token where the server
        sends them, else `version` for every token)."""
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise RuntimeError(f"group {i}: the server answered {len(choices)} choices for n={n}")
        outs = []
        for j, c in enumerate(choices):
            tokens = [int(t) for t in c["token_ids"]]
            lps = [float(x) for x in (c.get("logprobs") or {}).get("token_logprobs") or []]
            if len(lps) != len(tokens):
                raise RuntimeError(f"group {i}: {len(tokens)} tokens but {len(lps)} logprobs")
            versions = c.get("weight_versions")  # NOTE: per-token versions where the server reports them
            if versions is not None and len(versions) != len(tokens):
                raise RuntimeError(f"group {i}: {len(tokens)} tokens but {len(versions)} weight versions")
            versions = [int(v) for v in versions] if versions else None
            outs.append(GenerationOutput(
                request_id=f"pool_{i}_{j}", prompt_ids=prompt, generated_tokens=tokens, logprobs=lps,
                status=RequestStatus.FINISHED, finish_reason=c["finish_reason"],
                policy_version=min(versions) if versions else version, versions=versions,
                routed_experts=_routes(i, c, len(prompt) + len(tokens)), sampling_masks=_masks(i, c, len(tokens))))
        return outs

    # ------------------------------------------------------------------------- weights
    def update_weights(self, source, in_flight: InFlight = UPDATE_DEFAULT, recompute_kv: bool = False, *,
                       version: int | None = None) -> int:
        """New weights on every live server (one broadcast, or one checkpoint on disk); returns the version.
        A server found dead meanwhile is dropped from the group and the update retried once. `in_flight`
        (`rollout.in_flight`): "wait" (default) lets requests running on a server finish under the old weights
        first; "keep" (async GRPO) has them go on under the new weights from its next step, KV kept (their
        tokens' `weight_versions` show the switch); "abort" cancels them. `recompute_kv` / `version`: refused
        (`rollout.in_flight.check_remote_update`)."""
        check_mode(in_flight, "in_flight")
        check_remote_update(recompute_kv, version, "RolloutPool")
        model = source
        if self.router is not None:  # NOTE: the servers drop their prefix KV with the old weights
            with self._lock:
                self.router.clear()
        if self.sync is None:
            return self._update_from_disk(model, in_flight)
        start = time.perf_counter()
        for attempt in (0, 1):
            live = self.check_servers()
            if not live:
                raise RuntimeError("no rollout server left alive to send weights to")
            try:
                if self.sync.members != live:
                    self.sync.init(live)
                versions = self.sync.broadcast(model, in_flight)
                break
            except Exception as e:
                if attempt:
                    raise
                logger.warning("weight broadcast failed (%s: %s): checking the servers and trying again",
                               type(e).__name__, e)
                self.sync.close_group()
        if len(set(versions)) != 1:
            logger.warning("the servers hold the same weights under different versions %s (they started apart): "
                           "batches report the oldest", versions)
        self.policy_version = min(versions)
        logger.info("weights v%d on %d server(s) in %.2fs", self.policy_version, len(live), time.perf_counter() - start)
        return self.policy_version

    def _update_from_disk(self, model, in_flight: InFlight = UPDATE_DEFAULT) -> int:
        path = self.disk_dir or tempfile.mkdtemp(prefix="rollout-weights-")
        model.save_pretrained(path)
        versions = set()
        for url in self.check_servers():
            r = self.http.post(url + "/update_weights_from_disk", json={"model_path": path},
                               params={"in_flight": in_flight})
            if r.status_code != 200:
                raise RuntimeError(f"{url}/update_weights_from_disk: HTTP {r.status_code}: {r.text[:500]}")
            versions.add(int(r.json()["weight_version"]))
        if len(versions) != 1:
            raise RuntimeError(f"the servers disagree on the weight version after loading {path}: {sorted(versions)}")
        self.policy_version = versions.pop()
        return self.policy_version

    # ------------------------------------------------------------- the engine's API
    def finish_session(self, session_id: str) -> None:
        """Forget `session_id`'s server (its next group routes afresh) and tell that server (`POST /finish_session`,
        best effort: a server that does not know the route or is gone changes nothing here)."""
        with self._lock:
            url = self.sessions.finish(session_id)
        if url is None:
            return
        try:
            self.http.post(url + "/finish_session", params={"session_id": session_id}, timeout=self.health_timeout_s)
        except Exception as e:
            logger.info("finish_session %s on %s: %s: %s", session_id, url, type(e).__name__, e)

    def sleep(self) -> None:  # NOTE: the servers' memory is theirs; nothing to free on the learner
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        if self.sync is not None:
            self.sync.close()
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.http.close()

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _masks(i: int, choice: dict, num_tokens: int) -> list[list[int]] | None:
    """A choice's `sampling_mask` (one id list per generated token), None when the server sent none."""
    masks = choice.get("sampling_mask")
    if masks is None:
        return None
    if len(masks) != num_tokens:
        raise RuntimeError(f"group {i}: sampling_mask has {len(masks)} rows for {num_tokens} tokens")
    return [[int(t) for t in row] for row in masks]


def _routes(i: int, choice: dict, num_tokens: int) -> torch.Tensor | None:
    """A choice's `routed_experts` ([num_tokens - 1, L, k] on the wire) as the engine's `[num_tokens, L, k]`
    int16, -1 at the last sampled token; None when the server sent none."""
    if choice.get("routed_experts") is None:
        return None
    try:
        routes = decode_routes(choice["routed_experts"])
    except ValueError as e:
        raise RuntimeError(f"group {i}: {e}") from None
    if routes.shape[0] != num_tokens - 1:
        raise RuntimeError(f"group {i}: routed_experts has {routes.shape[0]} rows for {num_tokens} tokens "
                           f"(want prompt + completion - 1)")
    return torch.cat([routes, torch.full((1, *routes.shape[1:]), -1, dtype=routes.dtype)])


# NOTE: the fields `/v1/completions` takes under the same name (vLLM's), and those it cannot carry
WIRE_FIELDS = ("temperature", "top_p", "min_p", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos",
               "repetition_penalty", "presence_penalty", "frequency_penalty", "return_sampling_mask")
OFF_WIRE = ("bad_words_ids", "no_repeat_ngram_size", "min_length", "sequence_bias", "suppress_tokens",
            "begin_suppress_tokens", "forced_bos_token_id", "forced_eos_token_ids", "prompt_lookup_num_tokens",
            "max_matching_ngram_size", "prompt_logprobs")


def completion_fields(sp: SamplingParams, group: int) -> dict:
    """Group `group`'s `/v1/completions` fields for `sp` (seeded `group_seed(seed, group)`, so a server runs the
    in-process engine's streams); ValueError naming a set field the wire cannot carry."""
    off = sorted(f for f in OFF_WIRE if f in sp.given) + (["logprobs"] if sp.logprobs else [])
    if off:
        raise ValueError(f"RolloutPool cannot send {off} to a server: use a RolloutEngine for those fields")
    body = {f: getattr(sp, f) for f in WIRE_FIELDS if f in sp.given}
    body.update(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k or -1, logprobs=sp.logprobs)
    if sp.stop_token_ids:
        body["stop_token_ids"] = list(sp.stop_token_ids)
    if sp.logit_bias:
        body["logit_bias"] = {str(t): b for t, b in sp.logit_bias}
    if sp.seed is not None:
        body["seed"] = group_seed(sp.seed, group)
    return body
