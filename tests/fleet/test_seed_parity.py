"""One seed, one set of samples (issue 39): `RolloutEngine.generate(..., seed=s)` in this process, one
`/v1/completions` request carrying the same call, and `RolloutPool.generate(..., seed=s)` over 2 `rollout serve`
child processes give the same token ids and the same logprobs, bit for bit, for several prompts with
group_size > 1 (`rollout.sampling.seeding`). Both sides run batch-invariant, so what else shares a batch on
either side changes no bit and only the seed rule is under test. The pool refuses bad temperatures and unknown
in-flight modes by name before it sends anything. The servers bind 127.0.0.1 on free ports and are stopped by the
fixture."""

from __future__ import annotations

import math

import pytest
import torch

for _mod in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_mod, reason=f"disaggregated rollout tests need {_mod} (pip install -e '.[serve,dev]')")

import httpx  # noqa: E402
from support.serving import save_tiny  # noqa: E402

from rollout import ContinuousBatchingConfig, RolloutEngine  # noqa: E402
from rollout.fleet.pool import RolloutPool  # noqa: E402
from rollout.fleet.server_procs import ServerProcesses  # noqa: E402
from rollout.serve.cli import load  # noqa: E402

pytestmark = pytest.mark.timeout(300)

KEY = "seed-key"
PROMPTS = [[7, 30, 41, 9, 77, 12], [5, 66, 90, 3], [21, 54, 18, 33, 71]]
TEMPS = [1.0, 0.7, 1.3]
GROUP, MAX_NEW, SEED = 4, 10, 11
ENGINE = dict(page_size=16, num_blocks=256, batch_invariant=True)
SERVE_ARGS = ["--api-key", KEY, "--page-size", "16", "--num-blocks", "256", "--batch-invariant", "--dtype", "float32",
              "--log-level", "warning"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model_dir = save_tiny(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    with ServerProcesses(str(model_dir), n=2, threads=1, serve_args=SERVE_ARGS,
                         log_dir=str(tmp_path_factory.mktemp("logs")), start_timeout_s=180) as procs:
        yield model_dir, procs
    assert all(p.poll() is not None for p in procs.procs)  # stopped: no orphan server


def rows(batch) -> list[tuple[list[int], list[float]]]:
    """(token ids, logprobs) of every row, padding cut."""
    out = []
    for r in range(len(batch)):
        k = int(batch.completion_mask[r].sum())
        out.append((batch.completion_ids[r, :k].tolist(), batch.logprobs[r, :k].tolist()))
    return out


def in_process(model_dir, seed: int | None = SEED):
    model, tokenizer, gc = load(str(model_dir), "float32")
    with RolloutEngine(model, tokenizer=tokenizer, config=ContinuousBatchingConfig(**ENGINE),
                       generation_config=gc) as engine:
        return rows(engine.generate(PROMPTS, temps=TEMPS, group_size=GROUP, max_new_tokens=MAX_NEW, seed=seed))


def test_one_seed_gives_the_same_samples_in_process_from_a_server_and_through_a_pool(setup):
    model_dir, servers = setup
    want = in_process(model_dir)
    assert len(want) == len(PROMPTS) * GROUP
    assert len({tuple(t) for t, _ in want}) == len(want)  # every sample its own stream

    with RolloutPool(servers.urls, api_key=KEY, request_timeout_s=120) as pool:
        got = rows(pool.generate(PROMPTS, temps=TEMPS, group_size=GROUP, max_new_tokens=MAX_NEW, seed=SEED))
        assert pool.in_flight == {u: 0 for u in servers.urls}
    assert got == want  # token ids and logprobs, exactly

    # one request holding the whole call (its prompts are the groups) on either server: the same samples
    for url in servers.urls:
        choices = []
        for i in range(len(PROMPTS)):  # NOTE: one temperature per request, so one request per prompt ...
            r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=120,
                           json={"prompt": PROMPTS[: i + 1], "n": GROUP, "seed": SEED, "temperature": TEMPS[i],
                                 "max_tokens": MAX_NEW, "logprobs": 0, "return_token_ids": True})
            assert r.status_code == 200, r.text
            # ... of which the call's prompt i (choices i * n ... i * n + n - 1) ran at temperature TEMPS[i]
            mine = sorted(r.json()["choices"], key=lambda c: c["index"])[i * GROUP : (i + 1) * GROUP]
            choices += [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in mine]
        assert choices == want


def test_unseeded_calls_are_not_the_seeded_ones(setup):
    model_dir, _ = setup
    assert [t for t, _ in in_process(model_dir, None)] != [t for t, _ in in_process(model_dir)]


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, [1.0, -1.0, 1.0], [1.0, 1.0, math.nan], "hot"])
def test_the_pool_refuses_bad_temperatures_by_name_before_sending(setup, bad):
    _, servers = setup
    with RolloutPool(servers.urls, api_key=KEY, request_timeout_s=60) as pool:
        sent = []
        real = pool.http.post
        pool.http.post = lambda *a, **kw: sent.append(a) or real(*a, **kw)
        with pytest.raises(ValueError, match="temps must be a non-negative number"):
            pool.generate(PROMPTS, temps=bad, group_size=2, max_new_tokens=4)
        assert sent == []  # refused here, not by a server's 400
        batch = pool.generate(PROMPTS, temps=0.0, group_size=2, max_new_tokens=4)  # the pool still serves
        assert len(sent) == len(PROMPTS) and len(batch) == len(PROMPTS) * 2
        assert torch.equal(batch.temperatures, torch.zeros(len(PROMPTS) * 2))


def test_the_pool_refuses_an_unknown_in_flight_mode_before_sending(setup):
    _, servers = setup
    with RolloutPool(servers.urls, api_key=KEY, request_timeout_s=60) as pool:
        sent = []
        pool.http.post = lambda *a, **kw: sent.append(a)
        pool.sync.http.post = lambda *a, **kw: sent.append(a)
        for mode in ("finish", "later", None):
            with pytest.raises(ValueError, match="in_flight must be one of 'abort', 'wait', 'keep'"):
                pool.update_weights({}, in_flight=mode)
        assert sent == [] and pool.sync.group is None  # no route called, no weight group formed
