"""Optional C++ kernel for the CPU decode path, built once per machine by torch's JIT extension loader.

`paged_decode_attention` attends decode rows (one query token per request) in place over the paged
cache through page tables, for fp32, bf16 and fp16 caches. torch's CPU SDPA with one query row per
request runs at a third to a half of the memory bandwidth (PROFILE.md); this kernel streams each
request's K and V once for all the query heads that share them, at each row's own length, so no row
is padded. Without it (no compiler, `ROLLOUT_CPU_KERNELS=0`) decode rows take the gather + SDPA path
of `rollout.attention.backends.sdpa`.

The source is `rollout/kernels/csrc/decode_attention.cpp`. It is compiled with `-O3 -march=native -fopenmp`
the first time a CPU engine starts on a machine (about 30 s; cached under `TORCH_EXTENSIONS_DIR`,
default `~/.cache/torch_extensions`); the name of the build carries a hash of the CPU flags, the torch
version, the flags and the source, so a shared home directory never hands one machine another's
binary, and a new version of the source is a new build. `-fopenmp` makes ATen's inline `parallel_for`
inside the kernels use torch's intra-op threads (it links the OpenMP runtime torch already loaded);
every entry point releases the GIL while it runs.

Loading and building (several processes may start at once, e.g. DDP ranks):
- a finished build (the library plus the `rollout.ok` marker written after it loaded) is imported
  directly, without any lock, so a lock left behind by a killed process never blocks it;
- otherwise one process builds under an `flock` on `rollout.lock` in the build directory (the kernel
  frees it when its holder dies), waiting at most `BUILD_LOCK_TIMEOUT_S`; under that lock, torch's own
  `lock` file, if a killed build left one, is stale and removed first;
- no compiler, no ninja, a failed build or a lock held past the timeout: one warning, and decode
  attention stays on torch's SDPA. `ROLLOUT_CPU_KERNELS=0` skips the kernels (and the build) altogether.
  Without a compiler torch's loader is not called at all (it would print its own compiler banners first).

A build prints one line when it starts and one every `PROGRESS_EVERY_S` seconds with the time elapsed (it takes
1-5 minutes on 2 cores, longer when they are busy), then one when it is done. `status_line` is the one line an
engine logs when it starts (which attention path and which kernels run), and `rollout doctor` prints it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger("rollout")

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "module.cpp", CSRC / "decode_attention.cpp", CSRC / "small_gemm.cpp", CSRC / "rms_norm.cpp",
           CSRC / "silu_mul.cpp", CSRC / "kv_write.cpp", CSRC / "argmax.cpp", CSRC / "suffix_drafts.cpp",
           CSRC / "decoder_layer.cpp")
HEADERS = (CSRC / "kernels.h", CSRC / "vec_exp.h")
# NOTE: tuples, and copies handed to torch: its loader appends to extra_ldflags in place, which would change
# build_name() for the rest of a process that built the kernel (the cached-build lookup then misses).
CFLAGS = ("-O3", "-march=native", "-fopenmp")
LDFLAGS = ("-fopenmp",)
BUILD_LOCK_TIMEOUT_S = 300.0  # most seconds to wait for another process's build
DONE_MARKER = "rollout.ok"  # written once a build has loaded: the library in that directory is whole
LOCK_FILE = "rollout.lock"
PROGRESS_EVERY_S = 30.0  # a line with the seconds elapsed while a build runs
# NOTE: measured on 2 shared cores: ~60-120 s calm, 292 s at load ~8 (issue 62)
BUILD_TIME = "1-5 minutes on 2 cores, longer on a busy machine"

_lock = threading.Lock()
STATE: dict[str, object] = {}


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
    key = f"{flags}|{torch.__version__}|{' '.join(CFLAGS + LDFLAGS)}".encode() + b"".join(
        f.read_bytes() for f in SOURCES + HEADERS
    )
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


def build_name() -> str:
    return f"rollout_cpu_{_cpu_tag()}"


def build_directory(name: str) -> Path:
    """Where torch's loader keeps the build `name` (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions)."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    return Path(cpp_extension._get_build_directory(name, False))  # NOTE: private, stable since torch 1.x


def _import(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cached(directory: Path, name: str):
    """The finished build in `directory`, imported, or None."""
    lib = directory / f"{name}.so"
    if (directory / DONE_MARKER).exists() and lib.exists():
        return _import(lib, name)
    return None


@contextlib.contextmanager
def _file_lock(path: Path, timeout: float):
    """An exclusive `flock` on `path` (released by the kernel if the holder dies); TimeoutError after `timeout` s."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held the build lock {path} for {timeout:.0f} s"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # NOTE: closing the descriptor drops the lock


class NoCompiler(RuntimeError):
    """No C++ compiler on PATH: the build is not tried."""


def compiler() -> str | None:
    """The C++ compiler torch's loader would run (`CXX`, else `c++`, else `g++`), or None."""
    for name in (os.environ.get("CXX"), "c++", "g++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@contextlib.contextmanager
def build_progress(what: str, every: float = PROGRESS_EVERY_S, say=None):
    """While the block runs, `say` (default: the "rollout" logger's warning) one line every `every` seconds with
    the seconds elapsed, so a long build does not look hung; then one line with the total."""
    say = say or logger.warning
    start, done = time.monotonic(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            say("rollout: %s: %.0f s so far", what, time.monotonic() - start)

    thread = threading.Thread(target=tick, name="rollout-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    say("rollout: %s: done in %.0f s", what, time.monotonic() - start)


def compile_sources(name: str, directory: Path):
    """Compile the kernels' sources into `directory` as the extension `name` and import it (the build step
    `build` runs under its lock; a test replaces it to check the lock). NoCompiler without a C++ compiler."""
    from torch.utils import cpp_extension  # noqa: PLC0415

    if compiler() is None:
        raise NoCompiler("no C++ compiler")
    _ensure_ninja()
    logger.warning("rollout: building the C++ CPU kernels (%s) into %s: once per machine, %s; a line every %.0f s "
                   "until done; ROLLOUT_CPU_KERNELS=0 skips them", KERNELS, directory, BUILD_TIME, PROGRESS_EVERY_S)
    with build_progress("building the C++ CPU kernels"):
        return cpp_extension.load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=list(CFLAGS),
                                  extra_ldflags=list(LDFLAGS), build_directory=str(directory), verbose=False)


def build(timeout: float | None = None):
    """The cached build, else a build under the lock (see module doc); raises what the build raised."""
    name = build_name()
    directory = build_directory(name)
    module = _cached(directory, name)
    if module is not None:
        return module
    directory.mkdir(parents=True, exist_ok=True)
    with _file_lock(directory / LOCK_FILE, BUILD_LOCK_TIMEOUT_S if timeout is None else timeout):
        module = _cached(directory, name)  # NOTE: built by the process we waited for
        if module is not None:
            return module
        # NOTE: under our lock no rollout process is building here: torch's baton is a killed build's.
        (directory / "lock").unlink(missing_ok=True)
        (directory / DONE_MARKER).unlink(missing_ok=True)
        module = compile_sources(name, directory)
        (directory / DONE_MARKER).write_text(f"{name}\n")
        return module


KERNELS = (
    "decode attention, small-batch linears, RMSNorm, RoPE, SiLU-and-mul, KV writes, greedy argmax, suffix drafts, "
    "decoder layers of decode rows"
)


def why_off(error: BaseException) -> str:
    """What kept the kernels from loading, said so a user can act on it: files the installed package lacks
    (a wheel without the headers), no C++ compiler, another process's build lock, or the build's own error."""
    missing = [f.name for f in SOURCES + HEADERS if not f.exists()]
    if missing:
        return (f"the installed package lacks {', '.join(missing)} in {CSRC} (reinstall rollout: the wheel must "
                "carry every file the C++ sources include)")
    if isinstance(error, TimeoutError):
        return str(error)
    if isinstance(error, NoCompiler) or compiler() is None:
        cxx = os.environ.get("CXX", "c++")
        return f"no C++ compiler found (`{cxx}` and `g++` are not on PATH; install g++ to get the kernels)"
    text = str(error).strip()
    return f"the build failed ({type(error).__name__}: {text.splitlines()[-1] if text else ''})"


def load():
    """The compiled extension, or None (see module doc). Builds (or loads the cached build) on first
    call; thread-safe; the outcome is remembered. When the kernels are off, one warning names every
    kernel and the cause (`why_off`)."""
    if not enabled():
        return None
    if "module" in STATE:  # NOTE: settled: no lock (attention asks for `write_kv` every layer of every step)
        return STATE["module"]
    with _lock:
        if "module" not in STATE:
            module = None
            try:
                module = build()
            except Exception as e:  # NOTE: no compiler, no ninja, a missing header, a failed build: torch still works
                STATE["why_off"] = why_off(e)
                logger.warning("rollout: the C++ CPU kernels are off (%s); using torch SDPA and torch ops: %s",
                               KERNELS, STATE["why_off"])
            STATE["module"] = module
        return STATE["module"]


# NOTE: what each attention backend (rollout.attention.backends) runs, as the engine's start line says it
ATTENTION_PATHS = {
    "cpu": "rollout's C++ paged decode kernel for decode rows, torch SDPA for prompt chunks",
    "sdpa": "torch SDPA over each request's gathered pages",
    "flex": "torch FlexAttention over the paged cache, compiled",
    "flash": "flash-attn with page tables",
    "triton": "rollout's Triton paged decode and cascade kernels for decode rows, its varlen kernel for prompt chunks",
}
ANNOUNCED: set[str] = set()  # NOTE: the lines `announce` said in this process


def status_line(attention: str, device: torch.device | str = "cpu", onednn_linears: int | None = None) -> str:
    """One line: the attention path `attention` (a backend name) and whether rollout's C++ CPU kernels run (and
    from where), or why not; `onednn_linears`: how many linears run through oneDNN on packed copies."""
    path = f"rollout: attention {attention!r} ({ATTENTION_PATHS.get(attention, 'a backend of its own')})"
    if torch.device(device).type != "cpu":
        return f"{path} on {device}"
    if not enabled():
        kernels = "C++ CPU kernels off (ROLLOUT_CPU_KERNELS=0)"
    elif STATE.get("module") is None:
        kernels = f"C++ CPU kernels off ({STATE.get('why_off', 'not loaded')})"
    else:
        small = STATE["module"].small_gemm_available()
        kernels = (f"C++ CPU kernels on ({KERNELS}; small-batch linears {'on' if small else 'off: no AVX-512'}), "
                   f"built in {build_directory(build_name())}")
    linears = "" if not onednn_linears else f"; {onednn_linears} linears through oneDNN on packed weights"
    return f"{path}; {kernels}{linears}"


def announce(line: str) -> None:
    """Say `line` once per process: on the "rollout" logger at INFO where logging is set up, else on stderr (a
    script that configured no logging would otherwise never see it)."""
    if line in ANNOUNCED:
        return
    ANNOUNCED.add(line)
    if logger.hasHandlers():
        logger.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def parallel_threads():
    """`parallel_threads(items)`: threads an ATen `parallel_for` inside the kernels runs on, or None."""
    module = load()
    return None if module is None else module.parallel_threads


def paged_decode_attention():
    """`paged_decode_attention(q, k_cache, v_cache, table, row, start, end, page_size, scale, softcap, out)`
    over the paged cache (fp32, bf16 or fp16), or None."""
    module = load()
    return None if module is None else module.paged_decode_attention


def cascade_plan():
    """`cascade_plan(table, row, start, end, page_size, alias=None)` (int64): the groups `cascade_decode_attention`
    forms, as (first shared page, shared full pages, member queries, block whose first slots extend the shared keys
    or -1, how many) tuples (tests), or None."""
    module = load()
    return None if module is None else module.cascade_plan


def cascade_decode_attention():
    """`paged_decode_attention`'s signature and result (up to float rounding), with rows whose page tables name
    the same full pages (forks of one prompt, prefix-cache hits) reading those pages once per group, and with
    `alias` ([n, 3] int64: logical page, block, slots; page -1 for none) the slots forks copied from one partial
    page too (`Request.fork_alias`): or None."""
    module = load()
    return None if module is None else module.cascade_decode_attention


def small_linear():
    """`small_linear(x [M, K], panels, bias or None, N)`: fp32 `x @ W.T + bias` for decode-sized M, W given as
    `pack_panels(W)` (rollout/kernels/csrc/small_gemm.cpp), or None (no kernels, or a build without AVX-512)."""
    module = load()
    return None if module is None or not module.small_gemm_available() else module.small_linear


def small_linears():
    """`small_linears(x [M, K], [panels_i], [bias_i or None], [N_i])` -> [y_i]: several `small_linear`s of one input
    in one call (q / k / v, gate / up; each bitwise `small_linear`), or None (see `small_linear`)."""
    module = load()
    return None if module is None or not module.small_gemm_available() else module.small_linears


def pack_panels():
    """`pack_panels(W [N, K] fp32)` -> the panels `small_linear` reads, or None (see `small_linear`)."""
    module = load()
    return None if module is None or not module.small_gemm_available() else module.pack_panels


def rms_norm():
    """`rms_norm(x fp32, weight [H] fp32, eps)`: Llama's RMSNorm in one call (rollout/kernels/csrc/rms_norm.cpp), or
    None."""
    module = load()
    return None if module is None else module.rms_norm


def qk_norm_rope():
    """`qk_norm_rope(q [T, H*D], k [T, Hkv*D], q_weight or None, k_weight or None, q_eps, k_eps, cos [T, D], sin [T, D],
    D)` -> (q [T, H, D], k [T, Hkv, D]): each head RMS-normed (when a weight is given) then rotated, as
    transformers' Qwen3 / Llama attention does, bit for bit (rollout/kernels/csrc/rms_norm.cpp), or None."""
    module = load()
    return None if module is None else module.qk_norm_rope


def silu_mul():
    """`silu_mul(gate, up)` (fp32, same shapes): `F.silu(gate) * up` in one pass (rollout/kernels/csrc/silu_mul.cpp),
    or None."""
    module = load()
    return None if module is None else module.silu_mul


def argmax_rows():
    """`argmax_rows(x [R, V] fp32 CPU)` -> [R] int64, index for index `x.argmax(dim=-1)` in one vectorised pass
    (rollout/kernels/csrc/argmax.cpp), or None."""
    module = load()
    return None if module is None else module.argmax_rows


def greedy_verify():
    """`greedy_verify(logits [P, V] fp32 CPU, lens, drafts, logprobs)` -> [2 P] floats: a greedy speculative step's
    verification in one call -- each row's argmax position after position until its draft is rejected, and each
    emitted position's log-softmax (rollout/kernels/csrc/argmax.cpp) -- or None."""
    module = load()
    return None if module is None else module.greedy_verify


def suffix_drafts():
    """The C++ suffix drafter (`SuffixIndexNative`, `suffix_drafts`: rollout/kernels/csrc/suffix_drafts.cpp, the same
    drafts and estimates as `rollout.sampling.drafts`) when the kernels are loaded already, else None: drafting never
    starts a build (an engine on a GPU, which loads no CPU kernels, drafts in Python)."""
    return STATE.get("module") if enabled() else None


def decoder_layer():
    """`decoder_layer(...)`: one Llama-family decoder layer of decode rows, the kernels of the Python path in its
    order (rollout/kernels/csrc/decoder_layer.cpp; `rollout.kernels.fused_decoder` calls it), or None."""
    module = load()
    return None if module is None or not module.small_gemm_available() else module.decoder_layer


def write_kv():
    """`write_kv(k_cache, v_cache, slots, key, value)`: key/value [Hkv, T, D] into the caches [Hkv, S, D] at `slots`
    (the caches' dtype; rollout/kernels/csrc/kv_write.cpp), or None."""
    module = load()
    return None if module is None else module.write_kv
