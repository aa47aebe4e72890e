"""Optional C++ kernels for the CPU decode path, built once per machine by torch's JIT extension loader.

Decode attention, one query token per request, in two addressings: `paged_decode_attention` reads
the paged cache in place through block tables (the default for fp32 and bf16 caches), and
`decode_attention` reads decode lanes (`rollout.lanes`; fp16 caches, `ROLLOUT_PAGED_KERNEL=0`).
torch's CPU SDPA with one query row per request runs at a third to a half of the memory bandwidth
(PROFILE.md); these kernels stream each request's K and V once for all the query heads that share
them, at each row's own length, so no row is padded.

The source is `rollout/csrc/decode_attention.cpp`. It is compiled with `-O3 -march=native` the first
time a CPU engine with lanes starts on a machine (about 30 s; torch caches the build under
`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); the name of the build carries a hash
of the CPU flags, the torch version and the source, so a shared home directory never hands one
machine another's binary, and a new version of the source is a new build. No compiler, no ninja, or a failed build: one warning, and decode attention stays on torch's
SDPA over lanes. `ROLLOUT_CPU_KERNELS=0` skips the kernels (and the build) altogether.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

logger = logging.getLogger("rollout")

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.cpp"
CFLAGS = ["-O3", "-march=native", "-fopenmp-simd"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def enabled() -> bool:
    """False when `ROLLOUT_CPU_KERNELS=0`."""
    return os.environ.get("ROLLOUT_CPU_KERNELS", "1") != "0"


def _cpu_tag() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    key = f"{flags}|{torch.__version__}|{' '.join(CFLAGS)}".encode() + SOURCE.read_bytes()
    return hashlib.sha1(key).hexdigest()[:12]


def _ensure_ninja() -> None:
    """torch's JIT loader runs `ninja`; the `ninja` wheel puts one in the venv, which may not be on PATH."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # noqa: PLC0415

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass


def _build():
    from torch.utils import cpp_extension  # noqa: PLC0415

    _ensure_ninja()
    name = f"rollout_cpu_{_cpu_tag()}"
    try:  # NOTE: only to say why the first engine takes longer; a private helper, so optional
        cached = any(Path(cpp_extension._get_build_directory(name, False)).glob("*.so"))
    except Exception:
        cached = False
    if not cached:
        logger.warning(
            "rollout: compiling the CPU decode-attention kernel (once per machine, about 30 s; "
            "ROLLOUT_CPU_KERNELS=0 skips it)"
        )
    return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=CFLAGS, verbose=False)


def _module():
    """The compiled extension, or None (see module doc). Builds (or loads the cached build) on first
    call; thread-safe; the outcome is remembered."""
    if not enabled():
        return None
    with _lock:
        if "module" not in _state:
            module = None
            try:
                module = _build()
            except Exception as e:  # NOTE: no compiler, no ninja, a failed build: SDPA still works
                logger.warning("rollout: CPU decode-attention kernel unavailable, using torch SDPA (%s: %s)",
                               type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
            _state["module"] = module
        return _state["module"]


def decode_attention():
    """`decode_attention(q, k, v, lane, len, scale, softcap, out)` over decode lanes, or None."""
    module = _module()
    return None if module is None else module.decode_attention


def paged_decode_attention():
    """`paged_decode_attention(q, k_cache, v_cache, table, start, end, page_size, scale, softcap, out)`
    over the paged cache (fp32), or None."""
    module = _module()
    return None if module is None else module.paged_decode_attention
