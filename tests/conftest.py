"""Suite-wide fixtures."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

# NOTE: Triton reads TRITON_INTERPRET when a kernel's module is imported; set before any test module (or torch's
# compiler) imports triton, so the Triton kernels' tests run under the interpreter on a CPU instead of skipping
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _warm_start_cache(tmp_path_factory):
    """The recipes' shared warm-start cache (recipes/_common.py) in a temporary folder, not the user's home."""
    import os

    os.environ["ROLLOUT_WARM_START_CACHE"] = str(tmp_path_factory.mktemp("warm_starts"))
    yield


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Each test starts and ends with no accelerate singleton state (also none left by a module fixture).

    NOTE: `AcceleratorState` is a process-wide singleton: a `trl.GRPOTrainer` built in one test (its
    GRPOConfig defaults to bf16) would make every later `Accelerator()` run in bf16 autocast, so a later
    test's trainer would recompute logprobs in bf16 (a 2e-3 mismatch against the fp32 engine).
    """
    _reset_accelerate()
    yield
    _reset_accelerate()


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture
def keep_rng():
    """For tests of code that seeds the global RNGs (the recipes): leave them as the other tests found them."""
    state = random.getstate(), np.random.get_state(), torch.get_rng_state()
    yield
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])


def pytest_sessionstart(session):
    """Build rollout's C++ kernels before the first test, visibly (else the first engine's test sits silent for
    the minutes of a first build); a cached build loads in a moment and prints nothing."""
    import time

    from rollout.kernels import cpu_kernels

    name = cpu_kernels.build_name()
    if not cpu_kernels.enabled() or (cpu_kernels.build_directory(name) / cpu_kernels.DONE_MARKER).exists():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else print
    say(f"rollout: building the C++ CPU kernels first (once per machine, {cpu_kernels.BUILD_TIME})...")
    start = time.perf_counter()
    # NOTE: a line every 30 s with the time so far: pytest captures the kernels' own log lines
    with cpu_kernels.build_progress("building the C++ CPU kernels", say=lambda fmt, *args: say(fmt % args)):
        built = cpu_kernels.load() is not None
    say(f"rollout: C++ kernels {'built' if built else 'OFF (see the warning)'} in {time.perf_counter() - start:.0f} s")
