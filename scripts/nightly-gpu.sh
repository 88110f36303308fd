#!/usr/bin/env bash
# The nightly GPU job: check the environment, run the spec, compare with the last good run, update the history,
# and exit non-zero on a regression (or when the machine is not what the job expects).
#
# Settings (environment variables):
#   PYTHON     the harness's own interpreter (default .venv/bin/python); the frameworks run in the environments the
#              spec's entries name (specs/nightly.yaml: envs/<framework>, made by `harness envs create --gpu`)
#   SPEC       the spec to run (default specs/nightly.yaml: the Ohio State CNN on synthetic CIFAR-shaped data, 2
#              epochs, 5 interleaved repeats, about 46 min on one GPU; FRAMEWORKS, e.g. pytorch,jax, limits it to
#              those entries). Its repeats give compare a noise estimate from the first comparison; the Ohio State
#              reproduction (specs/cnn.yaml) has one repeat a cell and is not meant for this job.
#   RESULTS    where runs, history.jsonl and the last-good pointer live; keep it outside the checkout so that it
#              survives between jobs (default results/nightly)
#   THRESHOLD  percent change that counts as a regression (default 5)
#   DRIFT_PCT  until the history has two earlier runs, the run-to-run drift compare assumes (default: compare's, 5 %,
#              measured on a shared CPU VM; a GPU box that measured its own can set it lower)
#   HARNESS_MLFLOW_URI  when set, each night's run is also logged to this MLflow tracking store (a parent run for
#              the sweep, a child per trial; HARNESS_MLFLOW_EXPERIMENT names the experiment, default the spec's name)
#   ALLOW_CPU  1 to run without a GPU (for trying the job out; a nightly GPU job should leave it unset)
# Exit status: 0 no regression; 1 regression; 2 bad setup (no GPU, bad spec); other: the run itself failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
SPEC=${SPEC:-specs/nightly.yaml}
RESULTS=${RESULTS:-results/nightly}
THRESHOLD=${THRESHOLD:-5}
mkdir -p "$RESULTS"

echo "== environment"
"$PYTHON" -m harness env > "$RESULTS/env-latest.json"
if [ "${ALLOW_CPU:-0}" != 1 ]; then
  "$PYTHON" - "$RESULTS/env-latest.json" <<'PY' || exit 2
import json, sys
gpu = json.load(open(sys.argv[1]))["gpu"]
if not gpu.get("available"):
    sys.exit(f"no GPU visible to NVML: {gpu.get('reason', 'unknown reason')}")
print("GPU:", ", ".join(d["name"] for d in gpu["devices"]), "driver", gpu["driver"])
PY
fi

echo "== run $SPEC"
log="$RESULTS/run-latest.log"
set +e
"$PYTHON" -m harness run "$SPEC" ${FRAMEWORKS:+--frameworks "$FRAMEWORKS"} --out "$RESULTS" \
  --history "$RESULTS/history.jsonl" --no-progress 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || exit "$status"
run_dir=$(sed -n 's/^run directory: //p' "$log" | tail -n 1)

echo "== compare"
verdict=0
if [ -f "$RESULTS/last-good" ] && [ -d "$(cat "$RESULTS/last-good")" ]; then
  "$PYTHON" -m harness compare "$(cat "$RESULTS/last-good")" "$run_dir" --threshold "$THRESHOLD" \
    --history "$RESULTS/history.jsonl" ${DRIFT_PCT:+--drift-pct "$DRIFT_PCT"} || verdict=$?
else
  echo "no last good run yet: this run becomes the baseline"
fi
if [ "$verdict" -eq 0 ]; then
  echo "$run_dir" > "$RESULTS/last-good"
fi
if [ -n "${HARNESS_MLFLOW_URI:-}" ]; then
  echo "== MLflow $HARNESS_MLFLOW_URI"
  "$PYTHON" -m harness export "$run_dir" --mlflow --tracking-uri "$HARNESS_MLFLOW_URI" \
    ${HARNESS_MLFLOW_EXPERIMENT:+--experiment "$HARNESS_MLFLOW_EXPERIMENT"} \
    || echo "MLflow export failed; the run directory holds everything (harness export $run_dir --mlflow)"
fi
"$PYTHON" -m harness history --file "$RESULTS/history.jsonl" --metric throughput > /dev/null
exit "$verdict"
