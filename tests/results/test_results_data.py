"""Results as data, on a real run (``real_run`` in conftest.py: PyTorch on digits, on the CPU): ``harness.load_run``'s
frames against the records and the report, the schema (versions, the published JSON Schema), damaged run directories (a
torn last line, a newer schema, a missing samples file), ``load_history`` and ``harness export`` in each format."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

import harness
from harness.record import STATUSES, phase_windows
from harness.results import export
from harness.results.schema import SCHEMA_VERSION, SchemaError, Status, TrialRecord, trial_schema_json
from harness.results.store import read_lines, read_trials
from tests.helpers import ROOT


def _copy(run_dir, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(run_dir, target)
    return target


def test_trials_frame_has_one_flat_row_per_record_with_units_in_its_names(real_run):
    run = harness.load_run(real_run)
    records = read_trials(real_run)
    frame = run.trials
    assert list(frame["id"]) == [r.id for r in records] and len(frame) == 8
    assert {"throughput_samples_per_s", "peak_memory_bytes", "cpu_util_mean_pct", "test_accuracy", "row",
            "environment", "precision", "compile", "seed", "repeat", "status", "reason"} <= set(frame.columns)
    assert set(frame["status"]) == {"ok", "unsupported"}
    for record in records:
        row = frame.set_index("id").loc[record.id]
        if record.status == "ok":
            assert row["throughput_samples_per_s"] == record.metrics.throughput_samples_per_s
            assert row["peak_memory_bytes"] == record.sampler.stat("rss_anon_bytes", "max")  # the CPU figure
            cpu = record.sampler.stat("cpu_pct", "mean")  # None where no sample was >= 50 ms after its base
            assert np.isnan(row["cpu_util_mean_pct"]) if cpu is None else row["cpu_util_mean_pct"] == cpu
            assert row["test_accuracy"] == record.metrics.test_accuracy
        else:
            assert np.isnan(row["throughput_samples_per_s"]) and row["reason"].startswith("not run")
    assert frame["schema_version"].eq(SCHEMA_VERSION).all() and run.schema_version == SCHEMA_VERSION
    assert run.spec["name"] == "data" and run.machine["python"]


def test_five_lines_of_pandas_reproduce_the_reports_throughput_table(real_run):
    run = harness.load_run(real_run)
    ok = run.trials[run.trials.status == "ok"]
    table = ok.pivot_table(index="row", columns="batch_size", values="throughput_samples_per_s", aggfunc="median")
    summary = run.summary().query("metric == 'throughput'").pivot(index="row", columns="batch_size", values="value")
    pd.testing.assert_frame_equal(table, summary.loc[table.index], check_names=False)
    text = (real_run / "report.md").read_text()
    section = text[text.index("## Throughput"):]
    for value in table.to_numpy().ravel():
        assert f"{value:,.1f}" in section.split("\n## ")[0]
    cells = run.summary().query("metric == 'throughput' and cell != ''")
    assert set(cells["cell"]) == {"unsupported"} and cells["value"].isna().all()
    assert run.summary().query("metric == 'throughput' and cell == ''")["ci_low"].notna().all()  # 2 repeats


def test_epochs_and_samples_frames(real_run):
    run = harness.load_run(real_run)
    epochs = run.epochs
    ok = run.trials[run.trials.status == "ok"]
    assert set(epochs["id"]) == set(ok["id"])
    last = epochs.sort_values("epoch").groupby("id").tail(1).set_index("id")
    assert np.allclose(last.loc[ok["id"], "test_accuracy"].to_numpy(), ok["test_accuracy"].to_numpy())
    trial = ok["id"].iloc[0]
    samples = run.samples(trial)
    assert {"t", "t_s", "edge", "phase", "cpu_percent", "rss_bytes"} <= set(samples.columns)
    assert samples["t_s"].iloc[0] == 0 and samples["t"].is_monotonic_increasing
    assert "train" in set(samples["phase"]) and set(samples["phase"]) <= {"warmup", "train", "eval", "other"}
    for phase in ("warmup", "train", "eval"):  # a sample is labelled with the phase whose window holds it
        windows = phase_windows(run.events(trial), phase)
        inside = samples["t"].map(lambda t, windows=windows: any(a <= t <= b for a, b in windows))
        assert (inside == (samples["phase"] == phase)).all(), phase
    with pytest.raises(KeyError, match="no trial"):
        run.samples("nope-bs1-r0")


def test_a_torn_last_line_is_dropped_and_nothing_else_lost(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    with open(run_dir / "trials.jsonl", "ab") as f:
        f.write(b'{"schema_version": 1, "id": "pytorch-bs128-r0", "stat')  # a write cut short by a crash
    assert len(harness.load_run(run_dir).trials) == 8
    done = subprocess.run([sys.executable, "-m", "harness", "report", str(run_dir)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_a_newer_schema_is_one_line_naming_the_file_and_version(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    lines = (run_dir / "trials.jsonl").read_text().splitlines()
    newer = json.loads(lines[3]) | {"schema_version": SCHEMA_VERSION + 1}
    (run_dir / "trials.jsonl").write_text("\n".join([*lines[:3], json.dumps(newer), *lines[4:]]) + "\n")
    with pytest.raises(SchemaError, match=f"record 4 .*schema version {SCHEMA_VERSION + 1}.*upgrade"):
        harness.load_run(run_dir)
    for argv in (["report", str(run_dir)], ["export", str(run_dir)], ["compare", str(real_run), str(run_dir)]):
        done = subprocess.run([sys.executable, "-m", "harness", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 2 and "Traceback" not in done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "trials.jsonl" in done.stderr
    info = json.loads((real_run / "run.json").read_text()) | {"schema_version": 99}
    (run_dir / "run.json").write_text(json.dumps(info))
    with pytest.raises(SchemaError, match="run.json: written with schema version 99"):
        harness.load_run(run_dir)


def test_version_0_runs_from_before_the_schema_still_read(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    info = json.loads((run_dir / "run.json").read_text())
    info.pop("schema_version")
    (run_dir / "run.json").write_text(json.dumps(info))
    records = [{k: v for k, v in r.items() if k not in ("schema_version", "placement", "precision", "compile")}
               for r in read_lines(run_dir / "trials.jsonl")]
    (run_dir / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = harness.load_run(run_dir)
    assert run.schema_version == 0 and run.trials["schema_version"].eq(0).all()
    assert run.trials["throughput_samples_per_s"].notna().sum() == 4 and run.trials["node"].isna().all()


def test_a_missing_samples_file_is_a_clear_error_and_the_rest_reads(real_run, tmp_path):
    run_dir = _copy(real_run, tmp_path)
    run = harness.load_run(run_dir)
    ok = list(run.trials.query("status == 'ok'")["id"])
    (run_dir / "samples" / f"{ok[0]}.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match=f"samples/{ok[0]}.jsonl: the samples of trial {ok[0]} are missing"):
        run.samples(ok[0])
    assert len(run.samples(ok[1])) > 0 and len(run.trials) == 8
    paths = export.write(run, "csv", tmp_path / "out")
    samples = pd.read_csv(tmp_path / "out" / "samples.csv")
    assert set(samples["id"]) == set(ok[1:]) and len(paths) == 4


def test_every_record_matches_the_published_schema(real_run):
    for line in read_lines(real_run / "trials.jsonl"):
        TrialRecord.model_validate(line)
    assert (ROOT / "results" / "trial.schema.json").read_text() == trial_schema_json()
    printed = subprocess.run([sys.executable, "-m", "harness", "schema"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
    assert printed.returncode == 0 and json.loads(printed.stdout)["properties"]["status"]["enum"] == list(STATUSES)
    assert list(Status.__args__) == list(STATUSES)
    with pytest.raises(ValueError, match="status"):
        TrialRecord.model_validate(read_lines(real_run / "trials.jsonl")[0] | {"status": "fine"})


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_export_writes_the_tidy_tables_that_read_back_equal(real_run, tmp_path, fmt):
    run = harness.load_run(real_run)
    done = subprocess.run([sys.executable, "-m", "harness", "export", str(real_run), "--format", fmt, "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    read = {"csv": pd.read_csv, "json": pd.read_json, "parquet": pd.read_parquet}[fmt]
    trials = read(tmp_path / f"trials.{fmt}")
    assert list(trials["id"]) == list(run.trials["id"])
    assert np.allclose(trials["throughput_samples_per_s"].astype(float), run.trials["throughput_samples_per_s"],
                       equal_nan=True)
    summary = read(tmp_path / f"summary.{fmt}")
    assert len(summary) == len(run.summary())
    samples = read(tmp_path / f"samples.{fmt}")
    assert len(samples) == sum(len(run.samples(i)) for i in run.trials.query("status == 'ok'")["id"])
    assert len(read(tmp_path / f"epochs.{fmt}")) == len(run.epochs)


def test_export_refuses_a_wrong_format_and_parquet_without_pyarrow(real_run, tmp_path, monkeypatch):
    run = harness.load_run(real_run)
    with pytest.raises(ValueError, match="--format must be one of csv, parquet, json, not 'xlsx'"):
        export.write(run, "xlsx", tmp_path)
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an environment without the extra sees
    with pytest.raises(ValueError, match=r"Parquet needs pyarrow: pip install"):
        export.write(run, "parquet", tmp_path)


def test_load_history_reads_many_runs_oldest_first(real_run, tmp_path):
    older, newer = _copy(real_run, tmp_path / "runs", "b-older"), _copy(real_run, tmp_path / "runs", "a-newer")
    for path, started in ((older, "2026-01-01T00:00:00+00:00"), (newer, "2026-02-01T00:00:00+00:00")):
        info = json.loads((path / "run.json").read_text()) | {"started": started}
        (path / "run.json").write_text(json.dumps(info))
    (tmp_path / "runs" / "not-a-run").mkdir()
    history = harness.load_history(tmp_path / "runs")
    assert len(history) == 16 and list(dict.fromkeys(history["run"])) == ["b-older", "a-newer"]
    assert history["git_commit"].notna().all()
    with pytest.raises(FileNotFoundError, match="no run directories"):
        harness.load_history(tmp_path / "runs" / "not-a-run")


def test_mlflow_export_round_trips_through_a_real_local_store_and_is_idempotent(real_run, tmp_path):
    """A parent run and a child per trial in a real local MLflow store (SQLite), read back through
    ``mlflow.search_runs``: params, metrics (per-epoch ones as steps) and artifacts; a second export adds nothing."""
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    argv = [sys.executable, "-m", "harness", "export", str(real_run), "--mlflow", "--tracking-uri", uri,
            "--experiment", "nightly"]
    first = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0 and "8 trial run(s) logged, 0 already there" in first.stdout, first.stderr[-3000:]
    second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0 and "0 trial run(s) logged, 8 already there" in second.stdout, second.stderr

    mlflow.set_tracking_uri(uri)
    try:
        runs = mlflow.search_runs(experiment_names=["nightly"])
    finally:
        mlflow.set_tracking_uri(None)
    assert len(runs) == 9  # nothing duplicated
    parent = runs[runs["tags.harness.kind"] == "sweep"].iloc[0]
    children = runs[runs["tags.harness.kind"] == "trial"].set_index("tags.harness.trial_id")
    assert (children["tags.mlflow.parentRunId"] == parent["run_id"]).all()
    assert parent["params.spec"] == "data" and parent["params.trials"] == "8"
    run = harness.load_run(real_run)
    trials = run.trials.set_index("id")
    assert sorted(children.index) == sorted(trials.index)
    for trial, row in trials.iterrows():
        child = children.loc[trial]
        assert child["params.batch_size"] == str(row["batch_size"]) and child["params.status"] == row["status"]
        assert child["params.precision"] == row["precision"] and child["params.seed"] == str(row["seed"])
        if row["status"] == "ok":
            assert child["metrics.throughput_samples_per_s"] == pytest.approx(row["throughput_samples_per_s"])
            assert child["metrics.peak_memory_bytes"] == pytest.approx(row["peak_memory_bytes"])
            assert child["status"] == "FINISHED"
        else:
            assert child["status"] == "FAILED" and np.isnan(child.get("metrics.throughput_samples_per_s", np.nan))
    client = MlflowClient(tracking_uri=uri)
    trial = trials.index[trials["status"] == "ok"][0]
    history = client.get_metric_history(children.loc[trial, "run_id"], "epoch_test_accuracy")
    epochs = run.epochs[run.epochs["id"] == trial]
    assert sorted((m.step, m.value) for m in history) == sorted(zip(epochs["epoch"], epochs["test_accuracy"]))
    artifacts = [a.path for a in client.list_artifacts(children.loc[trial, "run_id"], "samples")]
    assert artifacts == [f"samples/{trial}.jsonl"]
    local = client.download_artifacts(children.loc[trial, "run_id"], f"samples/{trial}.jsonl", str(tmp_path))
    assert open(local).read() == (real_run / "samples" / f"{trial}.jsonl").read_text()
    assert {a.path for a in client.list_artifacts(parent["run_id"])} == {"run.json", "report.md"}
    assert (tmp_path / "mlartifacts" / "nightly").is_dir() and not (ROOT / "mlruns").exists()
