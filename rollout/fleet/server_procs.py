"""`ServerProcesses`: `rollout serve` child processes started by a learner, and stopped with it.

    with ServerProcesses(model_dir, n=2, cpus=[0], threads=1, serve_args=["--page-size", "16"]) as servers:
        servers.urls          # ["http://127.0.0.1:PORT", ...], each answering /health

Each child runs `rollout serve` on 127.0.0.1 and a free port, in a session (process group) of its
own, optionally pinned to `cpus` (`os.sched_setaffinity`) with `OMP_NUM_THREADS=threads`. No orphans: the
children are stopped (SIGTERM to their group, SIGKILL after a grace period) by `stop()`, on leaving the
`with`, at interpreter exit (`atexit`), and, on Linux, by the kernel when the learner dies without cleaning
up (`PR_SET_PDEATHSIG`). The learner's SIGTERM is turned into `SystemExit` by `install_signal_handlers`, so a
`kill` runs the same cleanup as Ctrl-C.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rollout.weights.transfer import free_port

logger = logging.getLogger("rollout.fleet.server_procs")


# NOTE: each child starts through this bootstrap instead of a `preexec_fn` (unsafe in a process with threads):
# it pins itself before torch starts its threads, asks the kernel for SIGTERM when the learner dies
# (Linux `PR_SET_PDEATHSIG`), leaves at once if the learner is already gone, then runs `rollout serve`.
BOOTSTRAP = """
import ctypes, os, signal, sys
cpus = os.environ.pop("ROLLOUT_SERVER_CPUS", "")
if cpus:
    os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
if sys.platform.startswith("linux"):
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass
if os.getppid() != int(os.environ.pop("ROLLOUT_PARENT_PID", os.getppid())):
    sys.exit("rollout serve: the learner that started this server is gone")
from rollout.__main__ import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


class ServerProcesses:
    """`n` rollout servers as child processes of this one.

    Args:
        model_path: the `save_pretrained` directory (or hub id) every server loads.
        n: how many servers.
        cpus: the CPU ids every server is pinned to (None: not pinned).
        threads: `OMP_NUM_THREADS` (torch threads) of each server.
        serve_args: extra `rollout serve` flags (engine config, `--api-key`, ...).
        log_dir: each server's stdout and stderr go to `log_dir/server{i}.log`, its pid to `server{i}.pid`
            (None: a temporary folder).
        start_timeout_s: how long all servers may take to answer /health.
        python: the interpreter that runs them (default: this one).
    """

    def __init__(self, model_path: str, n: int = 1, cpus: Sequence[int] | None = None, threads: int = 1,
                 serve_args: Sequence[str] = (), log_dir: str | None = None, start_timeout_s: float = 300.0,
                 python: str | None = None) -> None:
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        import tempfile

        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="rollout-servers-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []
        self.logs: list[Path] = []
        atexit.register(self.stop)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "ROLLOUT_PARENT_PID": str(os.getpid()),
               "ROLLOUT_SERVER_CPUS": ",".join(str(c) for c in cpus or ())}
        # NOTE: the children import this very package (a source checkout on PYTHONPATH included)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        try:
            for i in range(n):
                port = free_port("127.0.0.1")
                log = self.log_dir / f"server{i}.log"
                cmd = [python or sys.executable, "-c", BOOTSTRAP, str(model_path), "--host", "127.0.0.1",
                       "--port", str(port), *serve_args]
                with open(log, "w") as out:
                    self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                                       start_new_session=True))
                self.urls.append(f"http://127.0.0.1:{port}")
                self.logs.append(log)
                (self.log_dir / f"server{i}.pid").write_text(str(self.procs[-1].pid))
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        logger.info("%d rollout server(s) up: %s (logs in %s)", n, ", ".join(self.urls), self.log_dir)

    def _wait_healthy(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        waiting = set(range(len(self.procs)))
        while waiting:
            for i in sorted(waiting):
                if self.procs[i].poll() is not None:
                    raise RuntimeError(f"rollout server {i} exited with {self.procs[i].returncode}: "
                                       f"{self.tail(i)}")
                try:
                    if httpx.get(self.urls[i] + "/health", timeout=2).status_code == 200:
                        waiting.discard(i)
                except httpx.TransportError:
                    pass
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"rollout server(s) {sorted(waiting)} did not answer /health within "
                                   f"{timeout_s:.0f}s: {self.tail(min(waiting))}")
            time.sleep(0.2)

    def tail(self, i: int, chars: int = 2000) -> str:
        try:
            return self.logs[i].read_text()[-chars:]
        except OSError:
            return "(no log)"

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to server `i`'s process group (tests: a server that dies, or hangs with SIGSTOP)."""
        proc = self.procs[i]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop every server: SIGTERM to its group, SIGKILL after `grace_s`. Safe to call again."""
        alive = [p for p in self.procs if p.poll() is None]
        for p in alive:
            for sig in (signal.SIGCONT, signal.SIGTERM):  # NOTE: a stopped (SIGSTOP) process needs CONT first
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in alive:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)
        atexit.unregister(self.stop)

    def __enter__(self) -> ServerProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def install_signal_handlers() -> None:
    """SIGTERM (and SIGHUP) raise `SystemExit` in the main thread, as Ctrl-C raises `KeyboardInterrupt`, so
    `with` blocks and `atexit` stop the child servers on any of them. Call from the main thread."""

    def leave(signum, frame) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, leave)
