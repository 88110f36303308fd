"""Framework environments: each framework entry runs its workers in its own interpreter or behind a command prefix,
probed before anything is written; the worker protocol crosses any prefix (only standard streams), and a worker
dies with its orchestrator.

The per-framework virtualenvs are envs/<framework> (``make envs``, which ``make test`` runs first); the fixture
makes any that are missing or out of date, so the suite also runs from a bare ``pytest``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.execution import environments
from harness.plan import checked_spec
from harness.results import report, store
from harness.spec import ROOT, SpecError
from harness.studies.sweep import run_spec
from tests.helpers import TINY_CNN, base_spec

ENVS = ROOT / "envs"


def cli(*args, cwd, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env or {**os.environ, "PYTHONPATH": str(ROOT)})


def test_two_entries_of_one_framework_are_two_rows(envs, tmp_path):
    frameworks = [{"name": "pytorch", "label": "torch (envs)", "python": envs["pytorch"]},
                  {"name": "pytorch", "label": "torch (harness)"}]
    spec = checked_spec(base_spec(frameworks=frameworks, batch_sizes=[32, 64]), tmp_path / "s.yaml")
    run_dir = run_spec(spec, tmp_path / "r")
    records = store.read_trials(run_dir)
    assert [r.id for r in records] == ["torch-envs-bs32-r0", "torch-harness-bs32-r0", "torch-envs-bs64-r0",
                                          "torch-harness-bs64-r0"]
    assert all(r.status == "ok" for r in records), [r.reason for r in records]
    text = report.write(run_dir).read_text()
    assert "| torch (envs) CPU use % |" in text and "| torch (harness) CPU use % |" in text
    from harness.studies.compare import compare_runs

    rows, _ = compare_runs(run_dir, run_dir)
    assert {r.framework for r in rows} == {"torch (envs)", "torch (harness)"}


def test_command_prefixes_taskset_env_and_a_wrapper_that_closes_every_descriptor(fault_adapter, tmp_path):
    """taskset pins the worker; `env -i` starts it with an empty environment (a container inherits none: the
    payload carries what the worker needs); a wrapper that closes every inherited descriptor before starting Python
    stands in for a container or a remote shell."""
    wrapper = tmp_path / "wrap.sh"
    wrapper.write_text('#!/bin/bash\n# close every descriptor but the standard streams, then start the command\n'
                       'for fd in $(ls /proc/$$/fd); do [ "$fd" -gt 2 ] && eval "exec $fd>&-"; done\n'
                       'export HARNESS_TEST_MARK=wrapped\nexec "$@"\n')
    wrapper.chmod(0o755)
    frameworks = [{"name": fault_adapter, "label": "taskset", "command": ["taskset", "-c", "0", "{python}"]},
                  {"name": fault_adapter, "label": "env", "command": ["env", "-i", "HARNESS_TEST_MARK=x", "{python}"]},
                  {"name": fault_adapter, "label": "wrapper", "command": [str(wrapper), "{python}"]}]
    spec = checked_spec(base_spec(frameworks=frameworks, cpu_threads=1), tmp_path / "s.yaml")
    run_dir = run_spec(spec, tmp_path / "r")
    records = {r.label: r for r in store.read_trials(run_dir)}
    assert all(r.status == "ok" for r in records.values()), {k: r.reason for k, r in records.items()}
    starts = {label: next(e for e in store.read_lines(run_dir / "events" / f"{label}-bs32-r0.jsonl")
                          if e["event"] == "start") for label in records}
    assert starts["taskset"]["affinity"] == [0]
    env = records["env"].settings  # the payload's variables reached the worker behind `env -i`
    assert (env["test_mark"], env["omp_threads"]) == ("x", "1") and "cuda_visible_devices" not in env
    assert records["wrapper"].settings["test_mark"] == "wrapped"


def test_a_worker_outside_the_launched_process_tree_is_sampled_by_its_pid(fault_adapter, tmp_path, monkeypatch):
    """As with a container run with --pid=host: `setsid -f` starts the worker in a new session and exits at once,
    so the worker is no descendant of what the launcher started; the sampler follows the pid the worker reports."""
    monkeypatch.setenv("HARNESS_STEP_SLEEP", "*:0.01")  # about 1.3 s of timed steps: several samples inside them
    spec = checked_spec(base_spec(frameworks=[{"name": fault_adapter, "command": ["setsid", "-f", "{python}"]}],
                                  epochs=3), tmp_path / "s.yaml")
    record = store.read_trials(run_spec(spec, tmp_path / "r"))[0]
    assert record.status == "ok", record.reason
    assert "runs outside the launched command's process tree; sampled by its pid" in record.sampler.note
    assert record.sampler.stat("rss_bytes", "max") > 30e6  # the worker's interpreter with numpy, not setsid


@pytest.mark.parametrize("entry, words", [
    ({"name": "pytorch", "command": ["/nonexistent/python"]}, "cannot start '/nonexistent/python'"),
    ({"name": "pytorch", "python": "MXNET"}, "pytorch is not installed in"),
    ({"name": "pytorch", "python": "BARE"}, "lacks numpy, pydantic, PyYAML"),
    ({"name": "pytorch", "python": "{root}/envs/nothing/bin/python"}, "no interpreter at"),
    ({"name": "pytorch", "command": ["sh", "-c", "exit 7", "{python}"]}, "exited with status 7 without reporting"),
])
def test_an_entry_whose_interpreter_cannot_run_a_worker_is_one_line_and_exit_2(envs, write_spec, tmp_path, entry,
                                                                                 words):
    if entry.get("python") == "MXNET":
        entry = {**entry, "python": envs["mxnet"]}
    if entry.get("python") == "BARE":
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
        entry = {**entry, "python": str(tmp_path / "bare" / "bin" / "python")}
    path = write_spec(base_spec(frameworks=[entry]))
    proc = cli("run", str(path), "--out", str(tmp_path / "results"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith(f"{path}: frameworks.0: "), proc.stderr
    assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results").exists()


def test_a_dataset_that_needs_more_is_checked_in_the_interpreter(envs):
    """A module the spec's dataset needs (scikit-learn for digits) is checked in the worker's interpreter."""
    assert environments.DATASET_DEPENDENCIES["digits"] == {"sklearn": "scikit-learn"}
    entry = environments.FrameworkEntry(name="pytorch", python=envs["pytorch"])
    assert environments.probe(entry, environments.DATASET_DEPENDENCIES["digits"])["numpy"].startswith("2.")
    with pytest.raises(ValueError, match="lacks xyz-dist, which the spec's dataset needs in the worker"):
        environments.probe(entry, {"no_such_module_xyz": "xyz-dist"})


@pytest.mark.parametrize("frameworks, field, words", [
    (["pytorch", "pytorch"], "frameworks", "a framework is listed twice"),
    ([{"name": "pytorch", "label": "a"}, {"name": "mxnet", "label": "a"}], "frameworks", "label 'a' is used twice"),
    ([{"name": "pytorch", "label": "A b"}, {"name": "mxnet", "label": "a-b"}], "frameworks", "same trial id 'a-b'"),
    ([{"name": "pytorch", "python": "/usr/bin/python3", "command": ["taskset", "-c", "0"]}], "frameworks.0",
     "command must start the python through {python}"),
    ([{"name": "pytorch", "pyhton": "x"}], "frameworks.0", "unknown field"),
])
def test_framework_entries_are_validated(write_spec, frameworks, field, words):
    path = write_spec(base_spec(frameworks=frameworks))
    with pytest.raises(SpecError) as info:
        from harness import plan

        plan.load(path)
    assert str(info.value).startswith(f"{path}: {field}"), str(info.value)
    assert words in str(info.value)


def test_cli_frameworks_picks_entries_by_label_or_name(write_spec, envs):
    from harness import plan

    entries = [{"name": "pytorch", "label": "torch env", "python": "{root}/envs/pytorch/bin/python"},
               {"name": "mxnet", "python": "{root}/envs/mxnet/bin/python"}, "tensorflow"]
    path = write_spec(base_spec(frameworks=entries, model={"layers": TINY_CNN}))
    spec = plan.load(path, {"frameworks": ["mxnet", "torch env"]})
    assert [(e.name, e.row, e.python) for e in spec.entries] == [
        ("mxnet", "mxnet", envs["mxnet"]), ("pytorch", "torch env", envs["pytorch"])]
    assert [e.name for e in plan.load(path, {"frameworks": ["tensorflow"]}).entries] == ["tensorflow"]


def test_shipped_quick_spec_uses_the_framework_environments(envs):
    from harness import plan

    spec = plan.load(ROOT / "specs" / "quick.yaml")
    assert {e.name: e.python for e in spec.entries} == envs


def test_envs_create_keeps_an_up_to_date_environment_and_names_unknown_ones(envs, tmp_path):
    proc = cli("envs", "create", "pytorch", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "(up to date)" in proc.stderr
    assert '- {name: pytorch, python: "{root}/envs/pytorch/bin/python"}' in proc.stdout
    proc = cli("envs", "create", "caffe", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("harness envs create: no requirements/caffe-cpu.txt")
    assert len(proc.stderr.strip().splitlines()) == 1
