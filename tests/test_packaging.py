"""What `pip install` gives a user: the wheel carries every file the C++ kernels are built from, and a
non-editable install builds and uses them (issue 39: the wheel shipped `csrc/*.cpp` without `kernels.h`,
so a non-editable install silently fell back to SDPA, 1.3-1.5x slower; CI installs editable and never saw it).

The install test is `slow` (a fresh build of the kernels: 1-5 minutes on 2 calm cores); `.ci/run` runs it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "rollout" / "kernels" / "csrc"


def _included(path: Path) -> set[str]:
    return set(re.findall(r'#include\s+"([^"]+)"', path.read_text()))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (whl,) = out.glob("rollout-*.whl")
    return whl


def test_the_wheel_carries_every_file_the_cpp_sources_include(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(CSRC.glob("*.cpp"))
    assert sources, "no C++ sources found"
    wanted = {f"rollout/kernels/csrc/{p.name}" for p in sources}
    wanted |= {f"rollout/kernels/csrc/{h}" for p in sources for h in _included(p)}
    assert "rollout/kernels/csrc/kernels.h" in wanted  # NOTE: the include scan itself sees the header
    assert wanted <= names, f"the wheel lacks {sorted(wanted - names)}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_non_editable_install_builds_and_uses_the_cpp_kernels(wheel, tmp_path):
    """A fresh venv holding only the wheel (its dependencies come from this environment's site-packages on
    PYTHONPATH, so no editable finder is active), a fresh kernel build directory, a tiny engine: the kernels
    build from the installed files and the engine's backend is the C++ one."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                   check=True, timeout=300, capture_output=True)
    script = (
        "import torch, rollout\n"
        "from rollout.kernels import cpu_kernels\n"
        "from rollout.engine.core import EngineCore\n"
        "from rollout import ContinuousBatchingConfig\n"
        "from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM\n"
        "print('FILE', rollout.__file__)\n"
        "print('KERNELS', cpu_kernels.load() is not None)\n"
        "torch.manual_seed(0)\n"
        "m = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=4, num_key_value_heads=2))\n"
        "core = EngineCore(m, GenerationConfig(do_sample=False, max_new_tokens=2), ContinuousBatchingConfig())\n"
        "print('BACKEND', core.backend.name)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ROLLOUT_CPU_KERNELS")}
    env["PYTHONPATH"] = sysconfig.get_paths()["purelib"]  # NOTE: no .pth runs from a PYTHONPATH entry
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")
    proc = subprocess.run([str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert lines["FILE"].startswith(str(venv)), lines  # the installed copy ran, not this checkout
    assert lines["KERNELS"] == "True", proc.stderr[-3000:]
    assert lines["BACKEND"] == "cpu", proc.stderr[-3000:]
    assert "C++ CPU kernels are off" not in proc.stderr
    assert any((tmp_path / "torch_extensions").rglob("*.so")), "nothing was built in the fresh build directory"
