"""`rollout serve`: an OpenAI-compatible HTTP server over one persistent `RolloutEngine`, with the RL
control routes (pause / resume, weight updates, prefix-cache reset, sleep) of vLLM and SGLang.

Needs the `[serve]` extra (fastapi, uvicorn, prometheus_client); `import rollout` never needs it.
"""

from __future__ import annotations


def build_app(*args, **kwargs):
    """See `rollout.serve.app.build_app` (imported on use, so this package imports without fastapi)."""
    from rollout.serve.app import build_app as _build_app

    return _build_app(*args, **kwargs)


__all__ = ["build_app"]
