"""Without the [serve] extra, `import rollout` works, `rollout serve` says what to install, and the serve
tests skip with a reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BLOCK = "import sys; sys.modules['fastapi'] = None; sys.modules['uvicorn'] = None\n"


def test_rollout_imports_and_serve_explains_without_fastapi(tmp_path):
    script = BLOCK + (
        "import rollout, rollout.serve, rollout.client\n"
        "from rollout.__main__ import main\n"
        "try:\n"
        f"    main(['serve', {str(tmp_path)!r}])\n"
        "except SystemExit as e:\n"
        "    print('EXIT', e)\n"
        "import pytest\n"
        "rc = pytest.main(['-q', '-rs', '-p', 'no:cacheprovider', "
        f"{str(REPO / 'tests' / 'serve' / 'test_serve.py')!r}])\nprint('PYTEST', int(rc))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180,
                         cwd=REPO)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "EXIT rollout serve needs the [serve] extra" in out.stdout
    assert "PYTEST 5" in out.stdout  # 5: nothing ran (the module skipped), rather than a failure
    assert "1 skipped" in out.stdout and "rollout serve tests need fastapi" in out.stdout
