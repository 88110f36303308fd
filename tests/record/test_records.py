"""One typed record from the worker to the report (``harness.record``): the worker's metrics and events strict and
typed, units in every name with one suffix convention, older versions read through one mapping (a stored version-1
run, ``data/v1-run``, written by the harness before this schema, and the report its harness wrote of it), run.json
changed only through ``RunFile``, one ``Placement`` type, MFU and energy per sample derived once, and no import
circle inside ``harness.results``."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import shutil
from pathlib import Path

import grimp
import pytest
from pydantic import BaseModel, ValidationError

import harness
from harness.execution.protocol import event_line, parse_event
from harness.record import (
    SCHEMA_VERSION,
    Epoch,
    EpochMetrics,
    FrameworkEnvironment,
    Phase,
    Placement,
    Result,
    RunRecord,
    SamplerInfo,
    SchemaError,
    TrialMetrics,
    TrialRecord,
    legacy,
    phase_windows,
)
from harness.results import derived, report
from harness.results.store import RunFile, read_events, read_lines, read_run, read_trials
from tests.helpers import ROOT

DATA = Path(__file__).parent / "data"
V1 = DATA / "v1-run"


def _copy(tmp_path: Path, name: str = "v1-run") -> Path:
    target = tmp_path / name
    shutil.copytree(V1, target)
    return target


def _raw(run_dir: Path) -> list[dict]:
    return read_lines(run_dir / "trials.jsonl")


def test_a_stored_version_1_run_reads_as_this_versions_records(tmp_path):
    run_dir = _copy(tmp_path)
    raw = {r["id"]: r for r in _raw(run_dir)}
    run = harness.load_run(run_dir)
    assert run.schema_version == 1 and isinstance(run.info, RunRecord) and run.info.frameworks[0].label == "fault"
    assert all(isinstance(r, TrialRecord) and r.schema_version == 1 for r in run.records)
    for record in run.records:
        old = raw[record.id]
        assert record.wall_s == old["wall_seconds"]
        assert record.placement is not None and record.placement.started_unix_s == old["placement"]["started"]
        if record.status != "ok":
            assert record.metrics == TrialMetrics() and record.status == "unsupported" and record.reason
            continue
        m, o = record.metrics, old["metrics"]
        assert (m.throughput_samples_per_s, m.epoch_time_s, m.measured_s, m.first_step_s, m.achieved_flops_per_s) == (
            o["throughput"], o["seconds_per_epoch"], o["measured_seconds"], o["first_step_seconds"],
            o["achieved_flops"])
        assert m.time_to_target.training_s == o["time_to_target"]["training_seconds"]
        assert [e.timed_s for e in m.epochs] == [e["timed_seconds"] for e in o["epochs"]]
        assert m.memory_predicted.total_bytes == o["memory_predicted"]["total"]
        assert m.memory_predicted.activations_per_sample_bytes == o["memory_predicted"]["activations_per_sample"]
        assert record.sampler.stat("cpu_pct", "mean") == old["sampler"]["stats"]["cpu_percent"]["mean"]
        assert "cpu_percent" not in record.sampler.stats
        assert record.sampler.energy.duration_s == old["sampler"]["energy"]["seconds"]
    frame = run.trials.set_index("id")
    ok = [i for i, r in raw.items() if r["status"] == "ok"]
    assert list(frame.loc[ok, "throughput_samples_per_s"]) == [raw[i]["metrics"]["throughput"] for i in ok]
    assert list(frame.loc[ok, "cpu_util_mean_pct"]) == [raw[i]["sampler"]["stats"]["cpu_percent"]["mean"] for i in ok]
    assert list(frame.loc[ok, "started_unix_s"]) == [raw[i]["placement"]["started"] for i in ok]
    events = run.events(ok[0])  # an old events file: its epoch's timed_seconds and result's metrics mapped too
    assert isinstance(events[-1], Result) and events[-1].metrics.throughput_samples_per_s == raw[ok[0]]["metrics"][
        "throughput"]
    assert [e.timed_s for e in events if isinstance(e, Epoch)] == [e.timed_s for e in run.records[0].metrics.epochs]


def test_the_report_of_a_stored_version_1_run_is_the_one_its_own_harness_wrote(tmp_path):
    """What a run measures and writes stays the same: the report of the stored run, written now, is line for line
    the one the harness that wrote the run made of it (``data/v1-run.report.md``), but for changes made on purpose:
    the training loss's and MFU's meaning, and CPU memory reported as anonymous resident memory (an old run has only
    RSS, which stands in for it, with the same figures)."""
    text = report.write(_copy(tmp_path)).read_text().splitlines()
    # added on purpose since: the answer section after the header, the short windows named (this run's were 5 ms),
    # and what the Ohio State layout is
    for title in ("## The answer", "## Short and slow windows, recompilations"):
        start = text.index(title)
        end = next(i for i in range(start + 1, len(text)) if text[i].startswith("## "))
        text = text[:start] + text[end:]
    assert text[text.index("## The Ohio State layout") + 2].startswith("The layout of the Ohio State thesis tables")
    at = text.index("## The Ohio State layout") + 2
    text = text[:at] + text[at + 2:]
    before = (DATA / "v1-run.report.md").read_text().splitlines()
    changed, added = [], []
    for op, a0, a1, b0, b1 in difflib.SequenceMatcher(None, before, text, autojunk=False).get_opcodes():
        if op == "delete":
            raise AssertionError(f"lines dropped: {before[a0:a1]}")
        if op in ("replace", "insert"):
            changed += list(zip(before[a0:a1], text[b0:b1]))
            added += range(b0 + (a1 - a0), b1)
    # on purpose: the footnote of a metric over seeds (accuracy, loss) no longer calls its spread timing noise
    seeds = [(a, b) for a, b in changed if a.replace("timing noise of the same training", "the same seed, weights and "
                                                     "batches each time, so only nondeterministic kernels differ") == b]
    changed = [pair for pair in changed if pair not in seeds]
    meaning = [(a, b) for a, b in changed if "memory" not in (a + b).lower() and "RSS" not in a]
    assert meaning == [("mean of the losses read at each sync during the last epoch.",
                        "mean training loss over every optimizer step since the evaluation before the last one (the "
                        "last epoch's steps, with an evaluation every epoch), warm-up steps included: each step's loss "
                        "is summed on the device and read outside the timed windows, so the figure does not depend on "
                        "where they end."),
                       ("throughput x training FLOPs per sample (3 x forward; 2 FLOPs per multiply-accumulate).",
                        "throughput x training FLOPs per sample (forward and backward, 2 FLOPs per "
                        "multiply-accumulate: the neutral model's counted per layer, a model of your own's by its "
                        "framework's counter, none where it has none).")]
    rows = [(a, b) for a, b in changed if a.startswith("|")]
    assert rows and all(a.replace("RSS MB", "memory MB") == b for a, b in rows)  # renamed, same figures
    assert all("memory" in b.lower() for a, b in changed if (a, b) not in meaning)
    # the memory section gains a "memory MB" row above each configuration's RSS row, with its figures
    assert [text[i] for i in added] == [text[i + 1].replace("RSS MB", "memory MB") for i in added]
    assert len(added) == 2


def test_version_0_runs_from_before_the_schema_still_read(tmp_path):
    run_dir = _copy(tmp_path)
    info = json.loads((run_dir / "run.json").read_text())
    info.pop("schema_version")
    (run_dir / "run.json").write_text(json.dumps(info))
    old = [{k: v for k, v in r.items() if k not in ("schema_version", "placement", "precision", "compile", "label")}
           for r in _raw(run_dir)]
    (run_dir / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    run = harness.load_run(run_dir)
    assert run.schema_version == 0 and run.trials["schema_version"].eq(0).all()
    assert run.trials["throughput_samples_per_s"].notna().sum() == 4 and run.trials["node"].isna().all()
    assert {r.label for r in run.records} == {"fault"} and {r.precision for r in run.records} == {"fp32"}


#: A version-1 record of a data-parallel trial on two GPUs, as that harness wrote it: the stored MFU (computed then
#: from the same figures), energy per sample and the devices loose in ``metrics``.
V1_GPU = {
    "schema_version": 1, "id": "pytorch-bs64-r0", "framework": "pytorch", "label": "pytorch", "batch_size": 64,
    "repeat": 0, "device": "cuda:0", "data_parallel": 2, "devices": ["cuda:0", "cuda:1"], "status": "ok",
    "wall_seconds": 12.5, "precision": "fp32",
    "metrics": {"throughput": 1000.0, "seconds_per_epoch": 1.5, "measured_samples": 4000, "achieved_flops": 67e12,
                "mfu": 0.5, "peak_flops": 134e12, "peak_source": "datasheet", "devices": ["cuda:0", "cuda:1"],
                "sync_batchnorm": True, "data_parallel_mechanism": "DistributedDataParallel",
                "memory": {"allocator_peak_bytes": 3_000_000}, "a_field_no_version_reads": 1,
                "time_to_target": None},
    "sampler": {"backend": "nvml", "name": "NVIDIA H100 80GB HBM3", "interval_s": 0.1,
                "stats": {"gpu_util_percent": {"mean": 40.0, "max": 60.0, "count": 5, "scope": "windows"},
                          "gpu_util_percent@1": {"mean": 30.0, "max": 50.0, "count": 5, "scope": "windows"},
                          "power_w": {"mean": 200.0, "max": 250.0, "count": 5, "scope": "windows"}},
                "energy": {"joules": 800.0, "method": "counter", "seconds": 4.0, "mean_power_w": 200.0,
                           "joules_per_sample": 0.2},
                "devices": [{"index": 0, "gpu_util_mean_percent": 40.0, "joules": 420.0, "memory_peak_bytes": 2e9},
                            {"index": 1, "gpu_util_mean_percent": 30.0, "joules": 380.0, "memory_peak_bytes": 1e9}],
                "memory_peak_over_devices_bytes": 2e9},
    "placement": {"node": "gpu1", "device": "cuda:0", "cpus": None, "started": 10.0, "ended": 22.5, "beside": [],
                  "devices": ["cuda:0", "cuda:1"]},
}


def test_every_old_name_of_a_version_1_record_maps_in_one_place():
    record = legacy.trial(json.loads(json.dumps(V1_GPU)), 1)
    m, s = record.metrics, record.sampler
    assert (m.throughput_samples_per_s, m.epoch_time_s, m.achieved_flops_per_s) == (1000.0, 1.5, 67e12)
    assert m.data_parallelism.devices == ["cuda:0", "cuda:1"] and m.data_parallelism.sync_batchnorm
    assert m.data_parallelism.mechanism == "DistributedDataParallel"
    assert not hasattr(m, "mfu") and "a_field_no_version_reads" not in m.model_dump()
    assert set(s.stats) == {"gpu_util_pct", "gpu_util_pct@1", "power_w"}
    assert (s.energy.energy_j, s.energy.duration_s) == (800.0, 4.0) and "joules_per_sample" not in s.energy.model_dump()
    assert [(d.gpu_util_mean_pct, d.energy_j) for d in s.devices] == [(40.0, 420.0), (30.0, 380.0)]
    assert record.placement.ended_unix_s == 22.5 and record.wall_s == 12.5
    # derived once, here: the same MFU and energy per sample as the ones stored then
    found = derived.mfu(record)
    assert found.fraction == pytest.approx(V1_GPU["metrics"]["mfu"]) and found.peak_flops_per_s == 134e12
    assert derived.energy_per_sample_j(record) == pytest.approx(V1_GPU["sampler"]["energy"]["joules_per_sample"])
    assert derived.mean_power_w(record) == 200.0 and derived.peak_memory_bytes(record) is None


def test_newer_versions_and_records_that_are_not_records_are_one_line_errors(tmp_path):
    run_dir = _copy(tmp_path)
    lines = _raw(run_dir)
    lines[1]["schema_version"] = SCHEMA_VERSION + 1
    (run_dir / "trials.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(SchemaError, match=f"record 2 .*schema version {SCHEMA_VERSION + 1}.*upgrade"):
        read_trials(run_dir)
    current = TrialRecord.model_validate(legacy.trial(_raw(_copy(tmp_path, "b"))[0], 1).data()).data()
    current["schema_version"] = SCHEMA_VERSION
    (run_dir / "trials.jsonl").write_text(json.dumps(current) + "\n")
    assert read_trials(run_dir)[0].metrics.throughput_samples_per_s  # this version's record reads as it is
    current["metrics"]["throughput"] = 1.0  # an old name in a record of this version: a misspelt field
    (run_dir / "trials.jsonl").write_text(json.dumps(current) + "\n")
    with pytest.raises(SchemaError) as caught:
        read_trials(run_dir)
    assert "record 1" in str(caught.value) and "metrics.throughput" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_worker_side_types_are_strict_and_name_their_units():
    with pytest.raises(ValidationError):
        TrialMetrics(throughput=1.0)  # the old name is no field
    with pytest.raises(ValidationError):
        EpochMetrics(timed_seconds=1.0)
    from harness.record import metrics, sampler

    models = [TrialRecord, RunRecord, *(v for module in (metrics, sampler) for v in vars(module).values()
                                        if isinstance(v, type) and issubclass(v, BaseModel))]
    names = {name for model in models for name in model.model_fields}
    names |= {f.name for f in dataclasses.fields(Placement)}
    assert not [n for n in names if n.endswith(("_seconds", "_percent", "_secs", "_joules"))], names
    sampled = SamplerInfo.from_measure({"backend": "nvml", "stats": {"cpu_percent": {"mean": 1.0},
                                                                     "sm_active_percent@2": {"mean": 2.0}},
                                        "energy": {"joules": 3.0, "seconds": 1.0, "joules_per_sample": 0.1}})
    assert set(sampled.stats) == {"cpu_pct", "sm_active_pct@2"} and sampled.energy.energy_j == 3.0
    assert "joules_per_sample" not in sampled.energy.model_dump()


def test_events_travel_typed_and_come_back_as_they_went():
    metrics = TrialMetrics(throughput_samples_per_s=10.0, epochs=[EpochMetrics(epoch=0, train_loss=math.nan)])
    line, data = event_line(Result(metrics=metrics), 5.0)
    event = parse_event(line)
    assert isinstance(event, Result) and event.t == 5.0 and math.isnan(event.metrics.epochs[0].train_loss)
    assert event.metrics.throughput_samples_per_s == 10.0 and data["event"] == "result"
    with pytest.raises(ValueError):  # a metric the record has no field for fails the worker, not a reader
        parse_event(line.replace("throughput_samples_per_s", "throughput"))
    assert parse_event("a wrapper's own line") is None
    events = [parse_event(event_line(e, t)[0]) for e, t in (
        (Phase(name="train", edge="start"), 1.0), (Phase(name="eval", edge="start"), 1.5),
        (Phase(name="train", edge="end"), 2.0), (Phase(name="train", edge="start"), 3.0),
        (Phase(name="train", edge="end"), 3.5))]
    assert phase_windows(events) == [(1.0, 2.0), (3.0, 3.5)] and phase_windows(events, "eval") == []
    old = legacy.event({"event": "epoch", "t": 1.0, "epoch": 0, "train_loss": 1.0, "train_loss_steps": 3,
                        "test_loss": 1.0, "test_accuracy": 0.5, "timed_seconds": 0.25})
    assert isinstance(old, Epoch) and old.timed_s == 0.25


def test_run_json_is_created_and_changed_through_run_file_only(tmp_path):
    record = RunRecord(spec={"name": "t"}, device="cpu", planned_trials=["a", "b", "c"], started="t0",
                       frameworks=[FrameworkEnvironment(label="x", name="x")])
    run_file = RunFile.create(tmp_path, record)
    run_file.update(lambda run: run.session({"executor": "local"}))
    run_file.update(lambda run: run.interrupt("SIGTERM", "t1", ["a"]))
    stopped = read_run(tmp_path)
    assert stopped.interrupted.not_run == ["b", "c"] and stopped.executors == [{"executor": "local"}]
    assert json.loads((tmp_path / "run.json").read_text())["interrupted"]["by"] == "SIGTERM"
    run_file.update(lambda run: run.resume("t2", []))
    run_file.update(lambda run: run.session({"executor": "local"}))
    done = run_file.update(lambda run: run.finish("t3"))
    assert (done.interrupted, [i.by for i in done.interruptions], done.resumed, done.finished) == (
        None, ["SIGTERM"], ["t2"], "t3")
    written = json.loads((tmp_path / "run.json").read_text())
    assert "interrupted" not in written and len(written["executors"]) == 2 and written["schema_version"] == 2
    with pytest.raises(ValidationError):
        RunRecord(spec={}, unknown=1)


def test_placement_is_one_type_from_the_executor_to_the_record():
    from harness.execution import executors
    from harness.studies.records import placement_record

    assert executors.Placement is Placement
    made = Placement("node", "cuda:1", [0, 1], 10.0, 20.0, devices=["cuda:1", "cuda:2"])  # as an executor makes it
    assert Placement(**dataclasses.asdict(made)) == made  # as the Ray executor sends it back
    before = Placement("node", "cuda:0", None, 5.0, 12.0)
    elsewhere = Placement("other", "cuda:0", None, 5.0, 12.0)
    placed = placement_record(made, [("t1", before), ("t2", elsewhere)], {"t3": 19.0, "t4": 21.0})
    assert placed.beside == ["t1", "t3"]
    record = TrialRecord(id="t", framework="f", label="f", batch_size=1, repeat=0, device="cuda:1", status="ok",
                         wall_s=1.0, placement=placed)
    assert TrialRecord.model_validate(json.loads(json.dumps(record.data()))).placement == placed


def _circles() -> list[list[str]]:
    spec = importlib.util.spec_from_file_location("import_cycles", ROOT / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.circles(grimp.build_graph("harness"))


def test_no_import_circle_inside_the_readers_or_the_record():
    """data <-> tables and html <-> report were circles; the report's input is one typed object now."""
    inside = [c for c in _circles() if any(m.startswith(("harness.results", "harness.record")) for m in c)]
    assert inside == []


def test_read_events_of_a_stored_run(tmp_path):
    run_dir = _copy(tmp_path)
    trial = "fault-bs15-r0-v0"
    events = read_events(run_dir, trial)
    assert len(events) == len(read_lines(run_dir / "events" / f"{trial}.jsonl"))
    assert phase_windows(events) and all(a < b for a, b in phase_windows(events))
    with pytest.raises(FileNotFoundError, match="no events for trial nope"):
        read_events(run_dir, "nope")
