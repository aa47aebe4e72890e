"""Which thread steps the engine: the caller of a blocking `RolloutEngine.generate`, else the manager's loop.

One OpenMP team (the caller's) then runs every forward of a trainer's rollouts, instead of the engine
thread's team competing with the trainer's main-thread team (benchmarks/PROFILE.md, "Threads").
"""

from __future__ import annotations

import threading

import torch
from support.tiny_models import hf_greedy, make_model, random_prompts
from transformers import GenerationConfig

from rollout import ContinuousBatchingConfig, RolloutEngine

GREEDY = GenerationConfig(do_sample=False, eos_token_id=None, max_new_tokens=6)


def spy_steps(engine: RolloutEngine) -> list[str]:
    """Record the name of the thread that runs each engine step."""
    names: list[str] = []
    core = engine.manager.core
    step = core.step

    def recorded():
        names.append(threading.current_thread().name)
        return step()

    core.step = recorded
    return names


def test_generate_steps_on_the_calling_thread_and_the_loop_serves_the_rest():
    model = make_model("qwen3")
    prompts = random_prompts(3, 5, 20, seed=7)
    with RolloutEngine(model, config=ContinuousBatchingConfig(page_size=16), generation_config=GREEDY) as engine:
        names = spy_steps(engine)
        batch = engine.generate(prompts, temps=0.0, max_new_tokens=6)
        assert names and set(names) == {threading.current_thread().name}, set(names)
        want = [hf_greedy(model, p, 6) for p in prompts]
        assert [
            row[m.bool()].tolist() for row, m in zip(batch.completion_ids, batch.completion_mask, strict=True)
        ] == want
        # NOTE: requests submitted straight to the manager (a server's path) are stepped by its loop thread
        names.clear()
        rid = engine.manager.add_request(prompts[0], max_new_tokens=4, temperature=0.0)
        out = engine.manager.get_result(rid, timeout=60)
        assert out is not None and out.generated_tokens == want[0][:4]
        assert set(names) == {"rollout-engine"}


def test_generate_from_two_threads_at_once_is_served_whole():
    model = make_model("qwen3")
    prompts = random_prompts(4, 5, 20, seed=8)
    want = [hf_greedy(model, p, 6) for p in prompts]
    with RolloutEngine(model, config=ContinuousBatchingConfig(page_size=16), generation_config=GREEDY) as engine:
        got: dict[int, list] = {}

        def run(i: int) -> None:
            b = engine.generate(prompts[2 * i : 2 * i + 2], temps=0.0, max_new_tokens=6)
            got[i] = [row[m.bool()].tolist() for row, m in zip(b.completion_ids, b.completion_mask, strict=True)]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got[0] + got[1] == want
    assert torch.get_num_threads() >= 1
