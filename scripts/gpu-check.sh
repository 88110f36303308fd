#!/usr/bin/env bash
# The whole GPU path in one command, on a bare GPU machine whose Python already holds PyTorch and JAX with CUDA:
#   scripts/gpu-check.sh --out DIR [--wheels DIR] [--python PY] [--allow-cpu] [--entry-python FRAMEWORK=PY ...]
# Installs what the harness lacks from a folder of wheels (requirements/gpu-check.txt says how to download them), runs
# `pytest -m gpu`, an Ohio-State-shaped sweep (PyTorch and JAX), `harness max-batch` for both and the sampler-overhead
# benchmark, and writes everything under --out with summary.json; exits 1 when a step failed. Each step's failure
# leaves the others running. --allow-cpu runs the same steps on the CPU with tiny sizes (the test suite does).
# The interpreter: --python, else $PYTHON, else python3; it runs the harness and is the entries' Python.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --python=*) PY="${1#--python=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
exec "$PY" scripts/gpu_check.py --interpreter "$PY" "${args[@]}"
