"""`rollout serve` on a PEFT adapter directory, as a LoRA recipe's `final/` is (issue 62): the base is found (as
saved, or beside the adapter), the adapter is served on it and answers as the PeftModel does; without the base,
or without peft, the server refuses in one line naming `--enable-lora`."""

from __future__ import annotations

import json
import sys

import pytest

for _mod in ("fastapi", "uvicorn", "httpx", "peft"):
    pytest.importorskip(_mod, reason=f"these tests need {_mod} (pip install -e '.[serve,lora,dev]')")

import httpx  # noqa: E402
from support.lora import make_peft  # noqa: E402
from support.serving import make_tokenizer, save_tiny, serving  # noqa: E402
from support.tiny_models import hf_greedy, random_prompts  # noqa: E402

from rollout.serve import cli  # noqa: E402

NEW = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A recipe's layout: OUTPUT_DIR/init (the base) and OUTPUT_DIR/final (the adapter and the tokenizer), the
    adapter's `base_model_name_or_path` relative to a directory the server does not run in."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("runs") / "grpo_r4"
    save_tiny(out / "init")
    policy = make_peft(AutoModelForCausalLM.from_pretrained(out / "init"), seed=3, r=4)
    policy.save_pretrained(out / "final")
    make_tokenizer().save_pretrained(out / "final")
    config = out / "final" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "runs/grpo_r4/init"}))
    return out, policy


def test_serve_answers_on_a_lora_final_dir_as_the_peft_model_does(run_dir):
    out, policy = run_dir
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(out / "init").eval()
    with serving(out / "final") as s:
        for prompt in random_prompts(3, 4, 9, seed=5):
            r = httpx.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {s.key}"}, timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": NEW, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            served = r.json()["choices"][0]["token_ids"]
            assert served == hf_greedy(policy, prompt, NEW)
        # NOTE: the adapter matters on these prompts: the base alone answers otherwise
        assert any(hf_greedy(base, p, NEW) != hf_greedy(policy, p, NEW) for p in random_prompts(3, 4, 9, seed=5))


def refusal(argv) -> str:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    return str(exited.value)


def test_an_adapter_whose_base_is_gone_is_refused_in_one_line(run_dir, tmp_path):
    out, _ = run_dir
    lonely = tmp_path / "final"
    lonely.mkdir()
    for f in (out / "final").iterdir():
        (lonely / f.name).write_bytes(f.read_bytes())
    config = lonely / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": "/nowhere/init"}))
    message = refusal([str(lonely), "--port", "0"])
    assert "\n" not in message and "PEFT adapter of /nowhere/init" in message and "--enable-lora" in message


def test_without_peft_the_refusal_names_the_extra_and_enable_lora(run_dir, monkeypatch):
    out, _ = run_dir
    monkeypatch.setitem(sys.modules, "peft", None)
    message = refusal([str(out / "final"), "--port", "0"])
    assert "\n" not in message and "needs peft (the [lora] extra)" in message and "--enable-lora" in message


@pytest.mark.timeout(600)
def test_a_lora_recipe_final_dir_is_served(tmp_path, keep_rng):
    """The GRPO recipe with `--lora_rank` (its default learning rate 1e-3), then `rollout serve OUTPUT_DIR/final`."""
    import importlib.util
    from pathlib import Path

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    sys.path.insert(0, str(recipes))
    spec = importlib.util.spec_from_file_location("recipe_grpo_lora_serve", recipes / "grpo.py")
    grpo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(grpo)
    out = tmp_path / "grpo_r2"
    grpo.main(["--lora_rank", "2", "--steps", "2", "--sft_steps", "3", "--prompts_per_step", "4", "--group_size",
               "4", "--output_dir", str(out)])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in records] == [1e-3, 1e-3]  # NOTE: the recipes' LoRA default, not 10x (docs/lora.md)
    assert (out / "final" / "adapter_config.json").exists()
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "init"), out / "final").eval()
    prompts = [[1, 5, 6, 7, 14, 8, 9, 10, 15], [1, 9, 9, 9, 14, 1, 2, 3, 15]]  # NOTE: "123+456=", "999+123="-like ids
    with serving(out / "final") as s:
        for prompt in prompts:
            r = httpx.post(s.url + "/v1/completions", headers={"Authorization": f"Bearer {s.key}"}, timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(policy, prompt, 4)
