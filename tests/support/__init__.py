"""Helpers shared by the test suite (not tests themselves: pytest collects only `test_*.py`).

Imported as `support.<module>`: pytest puts `tests/` on `sys.path` (rootdir-relative "prepend" import
mode, no `tests/__init__.py`), and scripts the tests spawn get `tests/` on their PYTHONPATH or insert it.

- `tiny_models`: tiny random models of several architectures (`make_model`, `CONFIGS`, `MOE_CONFIGS`, `VOCAB`), random
  prompts (`random_prompts`), and the oracles: greedy `generate` (`hf_greedy`), teacher-forced logits and
  log-probabilities (`teacher_forced_logits`, `teacher_forced_logprobs`).
- `chat_model`: a tiny chat model built offline (character tokenizer with a chat template, a small Qwen3);
  `python tests/support/chat_model.py runs/tiny_chat` saves one.
- `serving`: `rollout serve` in the test process (`serving`, `Served`), a tiny saved model with a chat
  template (`save_tiny`, `make_tokenizer`), and `free_port`.
- `ddp_worker`: the two-rank script of tests/trainers/test_ddp.py (`accelerate launch ... tests/support/ddp_worker.py`),
  and its trainer builder for the single-process references.
- `threads`: `guarded`, a call that fails the test instead of hanging.
- `training`: helpers of the trainer tests on the addition task: the `digit_share` reward, `trained_state`
  (a trainer's weights), `save_tiny_addition_checkpoint`, `build_tiny_moe_model` (a Qwen3-MoE policy).
- `markdown`: the fenced code blocks of the README and docs pages (`FENCE`, `fenced_blocks`).
- `routes`: the oracle of recorded MoE routes (`hf_routes`: top-k of HF's router logits) and `assert_row_routes`.
"""
