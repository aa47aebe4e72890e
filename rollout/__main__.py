"""`rollout` console script and `python -m rollout`: `rollout serve MODEL_PATH [flags]`,
`rollout tinker-serve BASE_MODEL_DIR [flags]`, `rollout doctor`."""

from __future__ import annotations

import os
import sys

USAGE = ("usage: rollout serve MODEL_PATH [flags]   (rollout serve --help for the flags)\n"
         "       rollout tinker-serve BASE_MODEL_DIR [flags]   (the Tinker API; rollout tinker-serve --help)\n"
         "       rollout doctor   (versions, compiler, kernels and the attention path an engine takes here)")
# NOTE: the recipes' warm-start cache (recipes/_common.py WARM_START_CACHE; rollout never imports recipes)
WARM_START_CACHE = "~/.cache/rollout/warm_starts"
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "peft", "trl", "ray", "triton", "fastapi", "uvicorn")


def version_of(package: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor(out=sys.stdout) -> int:
    """Print what a bug report needs: versions, the machine, the compiler, the C++ kernels (built here when they
    are not yet: with a progress line) and the attention path an engine on this machine takes; 0."""
    import platform

    import torch

    from rollout.attention.backends import resolve
    from rollout.kernels import cpu_kernels
    from rollout.kernels import linear as onednn_linear

    say = lambda text: print(text, file=out, flush=True)  # noqa: E731
    say(f"rollout {version_of('rollout')} ({os.path.dirname(os.path.abspath(__file__))})")
    say(f"python {platform.python_version()} on {platform.system()} {platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}")
    say("packages: " + ", ".join(f"{p} {version_of(p)}" for p in PACKAGES))
    cuda = torch.cuda.is_available()
    say(f"CUDA: {torch.cuda.get_device_name(0) if cuda else 'none'}")
    say(f"C++ compiler: {cpu_kernels.compiler() or 'none (the C++ CPU kernels cannot build; install g++)'}")
    if cpu_kernels.enabled():
        directory = cpu_kernels.build_directory(cpu_kernels.build_name())
        built = (directory / cpu_kernels.DONE_MARKER).exists()
        say(f"C++ CPU kernels: {'built' if built else 'not built yet: building now'} in {directory}")
        cpu_kernels.load()
    device = torch.device("cuda" if cuda else "cpu")
    attention = resolve("auto", device, torch.float32)
    say(cpu_kernels.status_line(attention, device))  # NOTE: the line an engine here logs when it starts
    say(f"oneDNN linears: {'on' if onednn_linear.enabled() else 'off (ROLLOUT_ONEDNN_LINEARS=0)'}")
    switches = {k: v for k, v in sorted(os.environ.items())
                if k.startswith(("ROLLOUT_", "OMP_")) or k in ("TORCH_EXTENSIONS_DIR", "CXX")}
    say("environment: " + (", ".join(f"{k}={v}" for k, v in switches.items()) or "no ROLLOUT_ / OMP_ switches set"))
    cache = os.path.expanduser(os.environ.get("ROLLOUT_WARM_START_CACHE", WARM_START_CACHE))
    entries = sorted(e for e in os.listdir(cache) if ".building-" not in e) if os.path.isdir(cache) else []
    say(f"recipes' warm-start cache: {cache} ({len(entries)} entries{': ' + ', '.join(entries) if entries else ''})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "tinker-serve":
        from rollout.tinker.cli import main as tinker_main

        return tinker_main(argv[1:])
    if argv[:1] == ["doctor"]:
        return doctor()
    if not argv or argv[0] != "serve":
        print(USAGE, file=sys.stderr)
        return 2
    from rollout.serve.cli import main as serve_main

    return serve_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
