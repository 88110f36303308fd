"""``harness run`` on the command line: a bad spec, a bad override or a malformed block is one line on standard error
naming the file and the field, exit status 2, no traceback and no run directory (``harness.cli``); the parser knows
every command."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.cli import build_parser, main
from tests.helpers import ROOT, base_spec


def run_cli(*args, cwd):
    """``python -m harness ARGS`` in ``cwd``, with nothing of this environment but the harness on the path."""
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)


def test_cli_bad_spec_exits_2_with_one_line_and_no_run_directory(write_spec, tmp_path):
    path = write_spec(base_spec(batch_sizes=[-1]))
    out = tmp_path / "results"
    proc = run_cli("run", str(path), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"{path}: batch_sizes.0: Input should be greater than 0"
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not out.exists()


@pytest.mark.parametrize("command", ["run", "advise"])
def test_a_bad_spec_is_answered_before_the_sweep_and_report_code_loads(write_spec, tmp_path, command):
    """A bad spec is one line and exit 2 from the spec's own code: neither the sweep, the report (pandas, matplotlib)
    nor advise's studies are imported for it (0.3-0.6 s of a CPU before)."""
    path = write_spec(base_spec(batch_sizes=[-1]))
    code = ("import sys; from harness import cli; status = cli.main([sys.argv[1], sys.argv[2]]); "
            "print(status, *sorted(m for m in sys.modules if m in sys.argv[3:]))")
    heavy = ["pandas", "matplotlib", "harness.results.report", "harness.studies.sweep", "harness.studies.advise"]
    proc = subprocess.run([sys.executable, "-c", code, command, str(path), *heavy], cwd=tmp_path, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert proc.stdout.split() == ["2"], proc.stdout + proc.stderr
    assert proc.stderr.strip() == f"{path}: batch_sizes.0: Input should be greater than 0"


def test_cli_override_error_names_the_spec_file(write_spec, tmp_path):
    path = write_spec(base_spec())
    proc = run_cli("run", str(path), "--frameworks", "pytorch,theano", "--out", str(tmp_path / "r"), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"{path}: frameworks: unknown framework 'theano'")
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("layers, dataset, field, words", [
    ([{"type": "conv2d", "filters": 4, "kernel_size": 3, "padding": 1},
      {"type": "residual", "shortcut": "identity", "body": [
          {"type": "conv2d", "filters": 8, "kernel_size": 3, "stride": 2, "padding": 1}, {"type": "batchnorm"}]},
      {"type": "global_avgpool2d"}, {"type": "dense", "units": 10}], {"name": "digits"}, "model.layers.1.body",
     "the body changes (4, 8, 8) to (8, 4, 4) and shortcut is identity"),
    ([{"type": "embedding", "vocab": 16, "dim": 30},
      {"type": "residual", "body": [{"type": "layernorm"}, {"type": "attention", "heads": 4, "causal": True}]},
      {"type": "dense", "units": 16}], {"name": "synthetic_tokens", "vocab": 16, "length": 8},
     "model.layers.1.body.1", "attention width 30 is not divisible by its 4 heads"),
])
def test_cli_malformed_block_is_one_line_naming_the_layer(write_spec, tmp_path, layers, dataset, field, words):
    path = write_spec(base_spec(model={"layers": layers}, dataset=dataset))
    proc = run_cli("run", str(path), "--out", str(tmp_path / "results"), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"{path}: {field}: {words}"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "results").exists()


def test_the_parser_has_every_command_and_a_handler_for_each():
    """One subcommand per module of harness.cli, each with its handler; an unknown command is argparse's usage error
    (exit 2)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert sorted(commands) == ["advise", "compare", "env", "envs", "export", "history", "max-batch", "report", "run",
                                "schema"]
    for name, sub in commands.items():
        assert callable(sub.get_default("handler")), name
    with pytest.raises(SystemExit) as exited:
        main(["train"])
    assert exited.value.code == 2


def test_schema_prints_the_trial_record_schema_of_this_version(tmp_path, capsys):
    """``harness schema`` prints (or writes with --out) the JSON Schema of a trial record, naming the schema version
    this harness writes."""
    import json

    from harness.results.schema import SCHEMA_VERSION

    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert f"Schema version {SCHEMA_VERSION}." in printed["description"] and "metrics" in printed["properties"]
    out = tmp_path / "trial.schema.json"
    assert main(["schema", "--out", str(out)]) == 0
    assert json.loads(out.read_text()) == printed


def test_report_of_a_folder_that_is_no_run_is_one_line_and_exit_2(tmp_path):
    proc = run_cli("report", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("harness report: ") and str(tmp_path) in proc.stderr, proc.stderr


def test_a_spec_that_is_not_utf8_is_one_line_and_exit_2(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\nframeworks: [pytorch]\n".encode("latin-1"))
    proc = run_cli("run", str(path), "--out", str(tmp_path / "results"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"{path}: not UTF-8 text: byte 0xe9 at line 1"


@pytest.mark.parametrize(("changes", "framework", "words"), [
    ({"frameworks": [{"name": "pytorch", "label": "a"}, {"name": "pytorch", "label": "b"}]}, "pytorch",
     "--framework: pytorch names 2 entries (labels a, b): give one of their labels"),
    ({"frameworks": [{"name": "pytorch", "model": {"factory": "models.py:torch_cnn"}}], "model": None}, "tensorflow",
     "--framework: tensorflow is not an entry of the spec (its entries: pytorch), and the spec has no neutral model"),
])
def test_max_batch_says_which_entry_it_cannot_choose(write_spec, tmp_path, changes, framework, words):
    """Two entries of one framework and no label (it took the first silently), or a framework the spec does not list
    and has no neutral model for (a ValueError's traceback)."""
    (tmp_path / "models.py").write_text((ROOT / "specs" / "models.py").read_text())
    data = {**base_spec(), **changes}
    path = write_spec({k: v for k, v in data.items() if v is not None})
    proc = run_cli("max-batch", str(path), "--framework", framework, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith(f"{path}: {words}") and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("made", "trial", "words"), [
    (False, False, "interrupted by SIGINT: before the run directory was made: nothing was run"),
    (True, False, "interrupted by SIGTERM: before any trial finished: nothing is in "),
    (True, True, "interrupted by SIGTERM: finished trials are in "),
])
def test_the_interruption_message_says_what_exists(tmp_path, capsys, made, trial, words):
    import signal

    from harness.cli import _interrupted
    from harness.studies.sweep import Interrupted

    exc = Interrupted(signal.SIGTERM) if made else KeyboardInterrupt()
    if made:
        exc.run_dir = tmp_path
        if trial:
            (tmp_path / "trials.jsonl").write_text('{"id": "x"}\n')
    code = _interrupted(exc)
    err = capsys.readouterr().err
    assert code == (143 if made else 130) and err.startswith(words), err
    assert ("--resume" in err) == made
