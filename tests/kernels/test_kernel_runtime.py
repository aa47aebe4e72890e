"""How the C++ CPU kernels (rollout.kernels.cpu_kernels) run and load: torch's intra-op threads, the GIL, the build
lock.

- built with OpenMP, ATen's `parallel_for` inside the kernels runs on every thread torch may use;
- a kernel call releases the GIL, so the caller's other Python threads keep running during it;
- a finished build loads without any lock (a lock left by a killed process never blocks it); a lock
  held by a live process past the timeout gives one warning and the SDPA fallback; torch's own
  `lock` file left by a killed build is removed under our lock instead of being waited on forever.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import threading
import time

import pytest
import torch

from rollout.kernels import cpu_kernels

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="module")
def module():
    mod = cpu_kernels.load()
    if mod is None and not HAVE_COMPILER:
        pytest.skip("no C++ compiler: the kernels cannot be built here")
    assert mod is not None, "a C++ compiler is present but the kernels did not build"
    return mod


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs")
def test_parallel_for_in_the_kernels_uses_torch_threads(module, threads):
    torch.set_num_threads(2)
    assert module.parallel_threads(64) == 2  # NOTE: 1 when built without -fopenmp (a plain loop)
    torch.set_num_threads(1)
    assert module.parallel_threads(64) == 1


def _long_call(module):
    """A paged-kernel call (rows re-reading the same pages) that takes at least 0.3 s here: returns it."""
    heads, kv_heads, dim, ps, length = 8, 2, 64, 16, 2048
    g = torch.Generator().manual_seed(0)
    k = torch.randn(kv_heads, length, dim, generator=g)
    v = torch.randn(kv_heads, length, dim, generator=g)
    rows = 16
    while True:
        table = torch.arange(length // ps).repeat(rows, 1)  # [rows, P]: every row reads the same pages
        start, end = torch.zeros(rows, dtype=torch.long), torch.full((rows,), length)
        q = torch.randn(rows, heads, dim, generator=g)
        out = torch.empty_like(q)

        def call(q=q, table=table, start=start, end=end, out=out):
            module.paged_decode_attention(q, k, v, table, torch.arange(len(start)), start, end, ps, 0.125, 0.0, out)

        t0 = time.perf_counter()
        call()
        if time.perf_counter() - t0 >= 0.3:
            return call
        rows *= 2


def test_a_kernel_call_releases_the_gil(module):
    """A Python thread keeps running during one long kernel call: its longest stall is a fraction of the
    call (with the GIL held it stalls for the whole call)."""
    call = _long_call(module)
    stop = threading.Event()
    gaps: list[tuple[float, float]] = []  # (from, to) of the spinner's pauses longer than 20 ms

    def spin():
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            if now - last > 0.02:
                gaps.append((last, now))
            last = now

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    call()
    t1 = time.perf_counter()
    stop.set()
    spinner.join()
    inside = [min(b, t1) - max(a, t0) for a, b in gaps if b > t0 and a < t1]
    assert max(inside, default=0.0) < 0.5 * (t1 - t0), (t1 - t0, inside)


# ------------------------------------------------------------------ loading and the build lock


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    """An empty build directory for the real build name; fresh module state."""
    monkeypatch.setattr(cpu_kernels, "build_directory", lambda name: tmp_path)
    monkeypatch.setattr(cpu_kernels, "STATE", {})
    return tmp_path


def _hold_lock(directory):
    """Another holder of the build lock (a process stuck in its build); close the fd to release."""
    fd = os.open(directory / cpu_kernels.LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_a_cached_build_loads_without_the_lock(module, build_dir, monkeypatch):
    """A finished build is imported even while the lock is held and torch's baton is stale: no wait."""
    name = cpu_kernels.build_name()
    shutil.copy(module.__file__, build_dir / f"{name}.so")
    (build_dir / cpu_kernels.DONE_MARKER).write_text(name)
    (build_dir / "lock").write_text("")  # NOTE: torch's FileBaton, left by a killed build: load() waits forever
    monkeypatch.setattr(cpu_kernels, "compile_sources", lambda *a: pytest.fail("a cached build was rebuilt"))
    fd = _hold_lock(build_dir)
    try:
        loaded = cpu_kernels.build(timeout=0.2)  # NOTE: would raise TimeoutError if it took the lock
    finally:
        os.close(fd)
    assert callable(loaded.paged_decode_attention)


def test_a_held_lock_without_a_build_times_out_with_one_warning(build_dir, monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "BUILD_LOCK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(cpu_kernels, "compile_sources", lambda *a: pytest.fail("built while another process held the "
                                                                               "lock"))
    fd = _hold_lock(build_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="rollout"):
            assert cpu_kernels.paged_decode_attention() is None
            assert cpu_kernels.paged_decode_attention() is None  # remembered: no second wait or warning
    finally:
        os.close(fd)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "build lock" in warnings[0] and "SDPA" in warnings[0], warnings


def test_a_killed_builds_stale_baton_is_removed_and_the_build_runs(build_dir, monkeypatch):
    """Nobody holds our lock, torch's `lock` file is left over: it is removed, the build runs and is marked."""
    (build_dir / "lock").write_text("")
    built = object()

    def fake_compile(name, directory):
        assert not (directory / "lock").exists()
        return built

    monkeypatch.setattr(cpu_kernels, "compile_sources", fake_compile)
    assert cpu_kernels.build(timeout=5.0) is built
    assert (build_dir / cpu_kernels.DONE_MARKER).exists()


def test_a_build_in_this_process_leaves_the_build_name_alone(build_dir, monkeypatch):
    """torch's loader appends its own flags to `extra_ldflags` in place; the name of the build must not move.

    NOTE: it did on a fresh machine: the first engine compiled the kernel, and every later lookup of the
    cached build in that process used another name (the cached-build test failed in CI only).
    """
    from torch.utils import cpp_extension

    def fake_load(name, sources, extra_cflags, extra_ldflags, **kwargs):
        extra_cflags.append("-DTORCH_EXTENSION_NAME=" + name)  # what torch's JIT loader does to the lists
        extra_ldflags += ["-ltorch_cpu", "-ltorch_python"]
        return object()

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    before = cpu_kernels.build_name()
    cpu_kernels.compile_sources(before, build_dir)
    assert cpu_kernels.build_name() == before


# ------------------------------------------------------------------ what the warning says when they are off


def test_why_off_names_a_file_the_package_lacks_before_anything_else(tmp_path, monkeypatch):
    """A wheel without `kernels.h` fails with a compiler error that reads like a broken toolchain: say the file."""
    monkeypatch.setattr(cpu_kernels, "HEADERS", (tmp_path / "kernels.h",))
    why = cpu_kernels.why_off(RuntimeError("Error building extension: fatal error: kernels.h: No such file"))
    assert "lacks kernels.h" in why and "reinstall" in why, why


def test_why_off_tells_no_compiler_from_a_failed_build(monkeypatch):
    failed = RuntimeError("Error building extension 'rollout_cpu'\nsmall_gemm.cpp:12: error: expected ';'")
    why = cpu_kernels.why_off(failed)
    assert why.startswith("the build failed") and "expected ';'" in why, why
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    why = cpu_kernels.why_off(failed)
    assert "no C++ compiler" in why and "g++" in why, why
    assert "build lock" in cpu_kernels.why_off(TimeoutError("another process has held the build lock x for 3 s"))
