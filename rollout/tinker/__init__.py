"""A Tinker-compatible service (`rollout tinker-serve`): the tinker SDK's REST API on our engine and a LoRA
trainer.

`wire` (the SDK's protobuf messages), `training` (PEFT LoRA adapters, losses, Adam), `sampling` (adapters
pushed into the engine, `asample`), `service` (sessions, models, futures, the two workers), `app` (the
routes), `cli`.
"""
