#!/usr/bin/env bash
# Wheels the GPU machine lacks, for `benchmarks/device_check.sh` there (its image has torch, triton,
# accelerate, an older transformers; no trl/datasets). Run HERE (package registries reachable), then
# pass `.whl` in the device tool's `carry` and start the device command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# Used on 2026-11-30 (transformers only): benchmarks/RESULTS.md, "On a GPU".
#   bash benchmarks/device_wheels.sh            # transformers (the version installed here)
#   bash benchmarks/device_wheels.sh --trl      # + trl, datasets, dill, multiprocess (for TRL tests there)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >> .git/info/exclude; }
PY=${PYTHON:-python}
pins=("transformers==$($PY -c 'import transformers; print(transformers.__version__)')")
if [[ "${1:-}" == "--trl" ]]; then
  for p in trl datasets dill multiprocess; do pins+=("$p==$($PY -c "import importlib.metadata as m; print(m.version('$p'))")"); done
fi
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls -la .whl
