"""What a user is told about the C++ kernels (issue 62): without a compiler one warning and nothing from torch's
loader; a build says the seconds elapsed while it runs; an engine names its attention path and kernels once when
it starts; `rollout doctor` prints that with the versions."""

from __future__ import annotations

import io
import logging
import time
import warnings

import pytest
import torch
from support.tiny_models import make_model

from rollout.kernels import cpu_kernels


def test_without_a_compiler_there_is_one_warning_and_torch_is_not_asked(tmp_path, monkeypatch, caplog):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpu_kernels, "STATE", {})
    monkeypatch.setattr(cpu_kernels, "build_directory", lambda name: tmp_path / name)  # NOTE: no cached build
    monkeypatch.setattr(cpu_kernels, "compiler", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("torch's loader ran without a compiler"))
    with caplog.at_level(logging.INFO, logger="rollout"), warnings.catch_warnings(record=True) as python_warnings:
        warnings.simplefilter("always")
        assert cpu_kernels.load() is None
    said = [r for r in caplog.records if r.name == "rollout"]
    assert [r.levelno for r in said] == [logging.WARNING] and not python_warnings
    assert "no C++ compiler found" in said[0].getMessage() and "install g++" in said[0].getMessage()
    assert "building" not in said[0].getMessage()  # NOTE: nothing announced a build that never started
    line = cpu_kernels.status_line("sdpa")
    assert line.startswith("rollout: attention 'sdpa' (torch SDPA") and "C++ CPU kernels off (no C++ compiler" in line


def test_a_build_says_the_seconds_elapsed_while_it_runs():
    lines = []
    with cpu_kernels.build_progress("building the kernels", every=0.05, say=lambda fmt, *a: lines.append(fmt % a)):
        time.sleep(0.32)
    ticks = [line for line in lines if "s so far" in line]
    assert len(ticks) >= 3 and ticks[0] == "rollout: building the kernels: 0 s so far", lines
    assert lines[-1].startswith("rollout: building the kernels: done in ") and lines[-1].endswith(" s")


def test_a_line_is_announced_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(cpu_kernels, "ANNOUNCED", set())
    with caplog.at_level(logging.INFO, logger="rollout"):
        cpu_kernels.announce("rollout: attention 'x'")
        cpu_kernels.announce("rollout: attention 'x'")
        cpu_kernels.announce("rollout: attention 'y'")
    assert [r.getMessage() for r in caplog.records] == ["rollout: attention 'x'", "rollout: attention 'y'"]


def test_an_engine_names_its_attention_path_and_kernels_when_it_starts(monkeypatch, caplog):
    from rollout import RolloutEngine

    monkeypatch.setattr(cpu_kernels, "ANNOUNCED", set())
    with caplog.at_level(logging.INFO, logger="rollout"):
        engine = RolloutEngine(make_model("qwen3"))
        engine.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rollout: attention")]
    assert len(lines) == 1, lines
    if cpu_kernels.load() is None:
        assert lines[0].startswith("rollout: attention 'sdpa'") and "C++ CPU kernels off" in lines[0]
    else:
        assert lines[0].startswith("rollout: attention 'cpu' (rollout's C++ paged decode kernel")
        assert "C++ CPU kernels on (decode attention" in lines[0] and str(cpu_kernels.build_directory(
            cpu_kernels.build_name())) in lines[0]


def test_rollout_doctor_prints_versions_and_the_attention_path(monkeypatch):
    import transformers

    from rollout.__main__ import doctor, main

    out = io.StringIO()
    assert doctor(out) == 0
    text = out.getvalue()
    assert f"torch {torch.__version__}" in text and f"transformers {transformers.__version__}" in text
    assert "C++ compiler: " in text and "recipes' warm-start cache: " in text
    assert any(line.startswith("rollout: attention '") for line in text.splitlines()), text
    assert main(["nonsense"]) == 2
