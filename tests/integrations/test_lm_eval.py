"""lm-evaluation-harness end to end: a loglikelihood (multiple-choice) task and a generate_until task of our
own (local JSON, no hub) through `rollout serve` with lm-eval's `local-completions` backend give the same
scores as lm-eval's in-process `hf` backend on the same saved model: the same accuracy and exact match,
each continuation's loglikelihood within 1e-4 and the same greedy flags, the same generated strings.
lm-eval sends `echo: true, logprobs: 1, max_tokens: 1` for loglikelihoods; the server runs on 127.0.0.1
and is stopped by the test."""

from __future__ import annotations

import pytest

for _mod in ("lm_eval", "fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_mod, reason=f"the lm-eval test needs {_mod} (pip install -e '.[dev,serve]')")

from support.lm_eval_tasks import write_tasks  # noqa: E402
from support.serving import save_tiny, serving  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_local_completions_through_rollout_serve_scores_like_the_hf_backend(tmp_path, monkeypatch):
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_dir = save_tiny(tmp_path / "model")
    include, tasks = write_tasks(tmp_path / "tasks")
    manager = TaskManager(include_path=str(include))
    hf = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32,device=cpu",
                                 tasks=tasks, task_manager=manager, log_samples=True, batch_size=1)
    monkeypatch.setenv("OPENAI_API_KEY", "test-key")  # NOTE: lm-eval's local-completions reads its key here
    with serving(model_dir, key="test-key") as server:
        api = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=(f"model=tiny,base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                        f"tokenizer={model_dir},num_concurrent=1,max_retries=1,max_length=1024"),
            tasks=tasks, task_manager=manager, log_samples=True)
    mc, gen = tasks
    assert api["results"][mc]["acc,none"] == hf["results"][mc]["acc,none"]
    assert api["results"][gen]["exact_match,none"] == hf["results"][gen]["exact_match,none"]
    for a, b in zip(hf["samples"][mc], api["samples"][mc], strict=True):
        assert len(a["filtered_resps"]) == len(b["filtered_resps"]) == 3
        for (lp_hf, greedy_hf), (lp_api, greedy_api) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            assert lp_api == pytest.approx(lp_hf, abs=1e-4)
            assert greedy_api == greedy_hf
    assert [s["filtered_resps"] for s in api["samples"][gen]] == [s["filtered_resps"] for s in hf["samples"][gen]]
    assert any(s["filtered_resps"][0] for s in api["samples"][gen])  # NOTE: some text was generated and compared
