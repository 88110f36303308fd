"""``harness export RUN --mlflow``: a run in an MLflow tracking store, where teams keep experiment results. One parent
MLflow run for the sweep (params: the spec's name, device, harness version, git commit; artifacts: run.json and
report.md) and one child run per trial (params: framework, row, environment, batch size, precision, mode, seed,
repeat, status; metrics: every numeric column of ``Run.trials`` that the trial has, and per epoch ``epoch_train_loss``,
``epoch_test_loss``, ``epoch_test_accuracy`` with the epoch as the step; artifacts: the trial's samples and events).

Exporting twice does not duplicate: the parent is found again by its tag ``harness.run`` (the run directory's name
and start time) and each child by ``harness.trial_id``; a trial already exported is left as it is. Uses
``mlflow.tracking.MlflowClient`` (https://mlflow.org/docs/latest/api_reference/python_api/mlflow.client.html):
``create_run``, ``log_batch``, ``log_artifact``, ``set_terminated``, ``search_runs``. ``mlflow`` (or
``mlflow-skinny``) is an optional extra: ``pip install -e .[mlflow]``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.results.data import TRIAL_COLUMNS, Run

#: The trial columns logged as params (strings), the rest of the numeric ones as metrics.
PARAMS = ("framework", "row", "label", "environment", "variant", "batch_size", "effective_batch_size",
          "accumulation_steps", "precision", "compile", "seed", "repeat", "device", "threads", "learning_rate",
          "status", "reason")
_NOT_METRICS = {"sampler_backend", "node", "pinned_cpus", "finished"}


@dataclass
class Exported:
    """What an export did: the parent run's id, the experiment's, and the trial ids created and already there."""

    parent_run_id: str
    experiment_id: str
    created: list[str]
    existing: list[str]


def _client(tracking_uri: str | None) -> Any:
    try:
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise ValueError("MLflow export needs mlflow: pip install -e '.[mlflow]' (or pip install mlflow-skinny)") \
            from None
    return MlflowClient(tracking_uri=tracking_uri)


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _find(client: Any, experiment_id: str, **tags: str) -> list[Any]:
    query = " and ".join(f"tags.`{key}` = '{_escape(value)}'" for key, value in tags.items())
    return client.search_runs([experiment_id], filter_string=query, max_results=10_000)


def _param(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value)[:6000]


def default_store(run: Run) -> tuple[str, str]:
    """The local store used when neither ``--tracking-uri`` nor ``MLFLOW_TRACKING_URI`` names one: an SQLite database
    beside the run directories (``<results>/mlflow.db``, MLflow's own default backend since its file store went into
    maintenance) and the artifacts in ``<results>/mlartifacts``. Returns (tracking URI, artifact location)."""
    folder = run.path.resolve().parent
    return f"sqlite:///{folder / 'mlflow.db'}", str(folder / "mlartifacts")


def export_run(run: Run, tracking_uri: str | None = None, experiment: str | None = None) -> Exported:
    """Logs ``run`` to the MLflow store at ``tracking_uri`` (None: ``MLFLOW_TRACKING_URI``, else ``default_store``)
    under ``experiment`` (default: the spec's name), as the module docstring says. A new experiment in a local
    SQLite store keeps its artifacts in ``mlartifacts/<experiment>`` beside the database (MLflow would otherwise
    use ./mlruns in the current directory). Raises ValueError when mlflow is
    not installed and, in one line, when MLflow refuses (an unreachable server, a store it cannot open)."""
    import os

    artifacts = None
    if tracking_uri is None and not os.environ.get("MLFLOW_TRACKING_URI"):
        tracking_uri, artifacts = default_store(run)
    elif tracking_uri is not None and tracking_uri.startswith("sqlite:///"):
        # a local database: its artifacts beside it, not in the cwd
        artifacts = str(Path(tracking_uri[len("sqlite:///"):]).parent / "mlartifacts")
    client = _client(tracking_uri)
    from mlflow.exceptions import MlflowException

    try:
        return _export(client, run, experiment, artifacts)
    except MlflowException as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"MLflow at {tracking_uri or os.environ.get('MLFLOW_TRACKING_URI')}: {first}") from None


def _export(client: Any, run: Run, experiment: str | None, artifacts: str | None) -> Exported:
    from mlflow.entities import Metric, Param, RunTag

    name = experiment or run.spec["name"]
    found = client.get_experiment_by_name(name)
    experiment_id = (found.experiment_id if found is not None else
                     client.create_experiment(name, artifact_location=artifacts and f"{artifacts}/{name}"))
    run_key = f"{run.path.name}@{run.info.started or ''}"
    parents = _find(client, experiment_id, **{"harness.run": run_key, "harness.kind": "sweep"})
    if parents:
        parent_id = parents[0].info.run_id
    else:
        parent = client.create_run(experiment_id, run_name=run.path.name,
                                   tags={"harness.run": run_key, "harness.kind": "sweep"})
        parent_id = parent.info.run_id
        sweep_params = {"spec": run.spec["name"], "device": run.info.device,
                        "harness_version": run.info.harness_version,
                        "git_commit": (run.machine.get("git") or {}).get("commit"),
                        "schema_version": run.schema_version,
                        "batch_sizes": ",".join(map(str, run.spec.get("batch_sizes", []))),
                        "epochs": run.spec.get("epochs"), "trials": len(run.records)}
        client.log_batch(parent_id, params=[Param(k, _param(v)) for k, v in sweep_params.items()])
        for artifact in ("run.json", "report.md"):
            if (run.path / artifact).exists():
                client.log_artifact(parent_id, str(run.path / artifact))
        client.set_terminated(parent_id, "FINISHED")
    done = {r.data.tags.get("harness.trial_id") for r in _find(client, experiment_id, **{"harness.run": run_key,
                                                                                         "harness.kind": "trial"})}
    created, existing = [], []
    epochs = run.epochs
    now = int(time.time() * 1000)
    for row in run.trials.to_dict("records"):
        trial = row["id"]
        if trial in done:
            existing.append(trial)
            continue
        child = client.create_run(experiment_id, run_name=trial, tags={
            "mlflow.parentRunId": parent_id, "harness.run": run_key, "harness.kind": "trial",
            "harness.trial_id": trial, "harness.status": row["status"]})
        child_id = child.info.run_id
        metrics = [Metric(key, float(row[key]), now, 0) for key in TRIAL_COLUMNS
                   if key not in _NOT_METRICS and isinstance(row[key], (int, float)) and math.isfinite(row[key])]
        for epoch in epochs[epochs["id"] == trial].to_dict("records"):
            for key in ("train_loss", "test_loss", "test_accuracy"):
                value = epoch[key]
                if value is not None and math.isfinite(value):
                    metrics.append(Metric(f"epoch_{key}", float(value), now, int(epoch["epoch"])))
        params = [Param(key, _param(row.get(key))) for key in PARAMS]
        for start in range(0, len(metrics), 900):  # log_batch takes at most 1000 metrics
            client.log_batch(child_id, metrics=metrics[start:start + 900], params=params if start == 0 else [],
                             tags=[RunTag("harness.row", str(row["row"]))] if start == 0 else [])
        if not metrics:
            client.log_batch(child_id, params=params)
        for folder in ("samples", "events"):
            path = run.path / folder / f"{trial}.jsonl"
            if path.exists():
                client.log_artifact(child_id, str(path), artifact_path=folder)
        client.set_terminated(child_id, "FINISHED" if row["status"] == "ok" else "FAILED")
        created.append(trial)
    return Exported(parent_id, experiment_id, created, existing)
