"""Decode lanes (rollout/lanes.py): decode attention reads a per-request contiguous copy of the KV.

Lanes are a cache of the paged KV, so every test checks greedy outputs against `model.generate`
(or against the same engine with lanes off) on workloads that exercise each way a lane can go
stale: requests entering decode at different steps and finishing at different steps (holes, then
compaction), prompts longer than a lane (the lanes grow), a lane budget too small for every row
(some rows take the gather path in the same step), a failed step, a weight update.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

import rollout.runner as runner_mod
from rollout import ContinuousBatchingConfig, RequestStatus
from rollout.core import EngineCore
from rollout.lanes import LANE_LEN_QUANTUM, DecodeLanes

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None)


def mixed_workload(seed: int = 0, n: int = 14):
    g = torch.Generator().manual_seed(seed)
    prompts = random_prompts(n, 3, 300, seed=seed, shared_prefix=30, n_shared=4)
    max_new = torch.randint(1, 40, (n,), generator=g).tolist()
    return prompts, max_new


@pytest.fixture(scope="module")
def model():
    return make_model("qwen3")


@pytest.fixture(autouse=True)
def lanes_not_pages(monkeypatch):
    """fp32 and bf16 engines decode through the paged kernel by default (test_cpu_kernels.py); lanes serve
    when that is off, when the kernel cannot be built, and for fp16."""
    monkeypatch.setenv("ROLLOUT_PAGED_KERNEL", "0")


def test_lanes_are_on_without_the_paged_kernel(model):
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig())
    assert isinstance(core.cache.lanes, DecodeLanes)
    assert core.cache.lanes.dtype == torch.float32
    assert core.cache.paged_kernel is None


def test_lanes_off_by_env(model, monkeypatch):
    monkeypatch.setenv("ROLLOUT_DECODE_LANES", "0")
    assert EngineCore(model, GREEDY, ContinuousBatchingConfig()).cache.lanes is None


@pytest.mark.parametrize("kernel", ["1", "0"])
def test_mixed_workload_matches_generate_with_holes_growth_and_arrivals(model, monkeypatch, kernel):
    """Chunked prefill (budget 64), staggered decode entry, late arrivals, prompts longer than a lane;
    decode attention through the C++ kernel (`rollout.cpu_kernels`) and through SDPA over lane buckets."""
    monkeypatch.setenv("ROLLOUT_CPU_KERNELS", kernel)
    prompts, max_new = mixed_workload()
    late = [(p, n) for p, n in zip(*mixed_workload(seed=1, n=6), strict=True)]
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, max_batch_tokens=64, num_blocks=512))
    reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    late_reqs = [core.make_request(p, request_id=f"late{i}", max_new_tokens=n) for i, (p, n) in enumerate(late)]
    for r in reqs:
        core.add(r)
    steps = 0
    while core.has_work() or late_reqs:
        if steps == 12:
            for r in late_reqs:
                core.add(r)
            reqs += late_reqs
            late_reqs = []
        core.step()
        steps += 1
        assert steps < 2000
    all_prompts = prompts + [p for p, _ in late]
    all_new = max_new + [n for _, n in late]
    for r, p, n in zip(reqs, all_prompts, all_new, strict=True):
        assert r.status == RequestStatus.FINISHED
        assert r.generated == hf_greedy(model, p, n), f"{r.request_id} ({len(p)}-token prompt) differs"
    lanes = core.cache.lanes
    assert lanes.fills >= len(reqs) - sum(n == 1 for n in all_new)  # every decoding request got a lane
    if kernel == "1":
        assert lanes.kernel is not None, "the decode-attention kernel did not build on this machine"
        assert lanes.compactions == 0  # the kernel reads each lane in place: holes cost nothing
    else:
        assert lanes.kernel is None
        assert lanes.compactions > 0  # finished requests left holes that were compacted away
    assert lanes.lane_len > LANE_LEN_QUANTUM  # prompts near 300 tokens grew the lanes
    assert core.cache_stats()["free_blocks"] == core.cache_stats()["num_blocks"]


def test_small_lane_budget_mixes_lanes_and_gather_in_one_step(model, monkeypatch):
    prompts, max_new = mixed_workload(seed=2, n=12)
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16, num_blocks=512))
    lanes = core.cache.lanes
    lanes.budget_bytes = 3 * LANE_LEN_QUANTUM * lanes.bytes_per_token  # room for 3 lanes
    mixed = []
    plan = runner_mod._plan_lanes

    def spy(g, *args):
        left = plan(g, *args)
        mixed.append(g.lanes is not None and len(left) > 0)
        return left

    monkeypatch.setattr(runner_mod, "_plan_lanes", spy)
    reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n + 5) for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
    for r in reqs:
        core.add(r)
    while core.has_work():
        core.step()
    assert any(mixed), "no step served rows from lanes and from the gather path at once"
    assert 0 < lanes.num_lanes * lanes.lane_len <= 3 * LANE_LEN_QUANTUM  # the budget held
    for r, p, n in zip(reqs, prompts, max_new, strict=True):
        assert r.generated == hf_greedy(model, p, n + 5)


def test_lanes_and_gather_give_the_same_tokens_under_preemption(model, monkeypatch):
    """A pool too small for the workload: preempted requests lose their lane and are refilled."""
    prompts = random_prompts(8, 20, 60, seed=3)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=14, max_batch_tokens=64)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ROLLOUT_DECODE_LANES", flag)
        core = EngineCore(model, GREEDY, cfg)
        reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=40) for i, p in enumerate(prompts)]
        for r in reqs:
            core.add(r)
        while core.has_work():
            core.step()
        assert core.cache_stats()["preemptions"] > 0
        outs[flag] = [r.generated for r in reqs]
        if flag == "1":
            assert core.cache.lanes.fills > len(prompts)  # refills after preemption
    assert outs["1"] == outs["0"]
    assert outs["1"][0] == hf_greedy(model, prompts[0], 40)


def test_failed_step_drops_every_lane_and_the_engine_goes_on(model):
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16))
    prompts = random_prompts(4, 10, 40, seed=4)
    reqs = [core.make_request(p, request_id=f"a{i}", max_new_tokens=20) for i, p in enumerate(prompts)]
    for r in reqs:
        core.add(r)
    for _ in range(5):
        core.step()
    assert core.cache.lanes.num_lanes > 0 and any(o is not None for o in core.cache.lanes.owner)
    view = core.runner.model
    real = view.forward

    def boom(*a, **k):
        real(*a, **k)  # NOTE: every layer has written its lanes: the step still fails after
        raise RuntimeError("injected")

    view.forward = boom
    core.step()
    del view.forward
    assert all(r.status == RequestStatus.FAILED for r in reqs)
    assert all(o is None for o in core.cache.lanes.owner)  # no lane is trusted after a failed step
    fills = core.cache.lanes.fills
    fresh = [core.make_request(p, request_id=f"b{i}", max_new_tokens=12) for i, p in enumerate(prompts)]
    for r in fresh:
        core.add(r)
    while core.has_work():
        core.step()
    for r, p in zip(fresh, prompts, strict=True):
        assert r.generated == hf_greedy(model, p, 12)
    assert core.cache.lanes.fills >= fills + len(fresh)  # every new request filled its lane again


def test_weight_update_drops_lanes(model):
    core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16))
    r = core.make_request(list(range(1, 30)), request_id="x", max_new_tokens=50)
    core.add(r)
    for _ in range(4):
        core.step()
    lanes = core.cache.lanes
    assert lanes.num_lanes > 0 and any(o is r for o in lanes.owner)
    core.reset_prefix_cache()  # what RolloutEngine.update_weights calls
    assert all(o is None for o in lanes.owner) and lanes.nbytes > 0  # forgotten, tensors kept for reuse
    fills = lanes.fills
    core.step()  # r goes on decoding: its lane is filled again from the pages, never reused as it was
    assert lanes.fills == fills + 1 and lanes.owner[lanes._of[id(r)]] is r
    while core.has_work():
        core.step()
    held = lanes.nbytes
    assert core.release_memory() >= held > 0 and lanes.nbytes == 0  # release frees the lane tensors


def test_bf16_lanes_are_fp32_and_agree_with_the_gather_path(monkeypatch):
    model = make_model("qwen3", dtype=torch.bfloat16)
    prompts, max_new = mixed_workload(seed=5, n=8)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ROLLOUT_DECODE_LANES", flag)
        core = EngineCore(model, GREEDY, ContinuousBatchingConfig(page_size=16))
        reqs = [core.make_request(p, request_id=f"r{i}", max_new_tokens=n) for i, (p, n) in enumerate(zip(prompts, max_new, strict=True))]
        for r in reqs:
            core.add(r)
        while core.has_work():
            core.step()
        if flag == "1":
            assert all(t.dtype == torch.float32 for t in core.cache.lanes.keys.values())
        outs[flag] = [r.generated for r in reqs]
    same = sum(a == b for a, b in zip(outs["1"], outs["0"], strict=True))
    assert same == len(prompts), f"{same}/{len(prompts)} bf16 completions agree between lanes and gather"


class _Req:  # a stand-in request: lanes use its identity and its longest possible length
    num_prompt_tokens = 0
    max_new_tokens = 0


def test_plan_assigns_keeps_refills_and_releases():
    lanes = DecodeLanes(budget_bytes=10**9, bytes_per_token=64, dtype=torch.float32, device=torch.device("cpu"))
    a, b, c = _Req(), _Req(), _Req()
    served, ids, fill = lanes.plan([a, b], [10, 30])
    assert served == [1, 0] and ids == [0, 1] and fill == [0, 1]  # longest first, both filled
    served, ids, fill = lanes.plan([a, b], [11, 31])
    assert sorted(zip(served, ids, strict=True)) == [(0, 1), (1, 0)] and fill == []  # kept, nothing to fill
    served, ids, fill = lanes.plan([b, c], [40, 5])  # b skipped a position: refill; a left: freed
    assert lanes.owner[0] is b and lanes.length[0] == 41 and a not in lanes.owner
    assert lanes.owner[1] is c  # a's lane was freed and is reused lowest first
    assert sorted(served[i] for i in fill) == [0, 1]  # b refilled, c new
    served, ids, fill = lanes.plan([b], [LANE_LEN_QUANTUM + 3])  # beyond a lane: lanes grow
    assert lanes.lane_len == 2 * LANE_LEN_QUANTUM and served == [0]


def test_plan_respects_the_budget():
    per_lane = LANE_LEN_QUANTUM * 64
    lanes = DecodeLanes(budget_bytes=2 * per_lane, bytes_per_token=64, dtype=torch.float32, device=torch.device("cpu"))
    reqs = [_Req() for _ in range(5)]
    served, ids, _ = lanes.plan(reqs, [5] * 5)
    assert len(served) == 2 and lanes.num_lanes == 2
    served, _, _ = lanes.plan(reqs[:1], [LANE_LEN_QUANTUM * 3])  # 2 lanes of 768 do not fit: gather
    assert served == [] and lanes.lane_len == LANE_LEN_QUANTUM

