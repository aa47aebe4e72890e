"""Helpers shared by the manager tests."""

from __future__ import annotations

import threading

import pytest


def guarded(fn, timeout: float):
    """Run `fn()` on a helper thread; fail the test if it does not return within `timeout` seconds."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # re-raised on the test thread
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {timeout}s (the manager hangs)")
    if "error" in box:
        raise box["error"]
    return box.get("value")
