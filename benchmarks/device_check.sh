#!/usr/bin/env bash
# The device check (see benchmarks/device_check.py): gpu tests + throughput on one CUDA device, < 8 min (--budget, default 420 s).
#   bash benchmarks/device_check.sh [--dry-run] [--out FILE]
# PYTHON selects the interpreter (default: python). The whole run is capped at 470 s.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 480 "${PYTHON:-python}" benchmarks/device_check.py "$@"
