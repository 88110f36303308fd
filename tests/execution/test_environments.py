"""Framework environments: each framework entry runs its workers in its own interpreter or behind a command prefix,
probed before anything is written; the worker protocol crosses any prefix (only standard streams), and a worker
dies with its orchestrator.

The per-framework virtualenvs are envs/<framework> (``make envs``, which ``make test`` runs first); the fixture
makes any that are missing or out of date, so the suite also runs from a bare ``pytest``."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from harness.execution import environments, installers, probes
from harness.plan import checked_spec
from harness.results import store
from harness.spec import ROOT, SpecError
from harness.studies.sweep import run_spec
from tests.helpers import TINY_CNN, base_spec, report_text

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
    text = report_text(run_dir)
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
    if words == "no interpreter at":  # an environment under envs/: the command that makes the spec's
        assert proc.stderr.strip().endswith(f"`harness envs create --spec {path}` makes the environments this spec "
                                            "runs in"), proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "results").exists()


def test_a_dataset_that_needs_more_is_checked_in_the_interpreter(envs):
    """A module the spec's dataset needs (scikit-learn for digits) is checked in the worker's interpreter."""
    assert probes.DATASET_DEPENDENCIES["digits"] == {"sklearn": "scikit-learn"}
    entry = probes.FrameworkEntry(name="pytorch", python=envs["pytorch"])
    assert probes.probe(entry, probes.DATASET_DEPENDENCIES["digits"])["numpy"].startswith("2.")
    with pytest.raises(ValueError, match="lacks xyz-dist, which the spec's dataset needs in the worker"):
        probes.probe(entry, {"no_such_module_xyz": "xyz-dist"})


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
    assert "envs/pytorch/bin/python (up to date; torch 2.13.0+cpu CPU build; " in proc.stderr  # the build, the size
    assert '- {name: pytorch, python: "{root}/envs/pytorch/bin/python"}' in proc.stdout
    proc = cli("envs", "create", "caffe", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("harness envs create: no requirements/caffe-cpu.txt")
    assert len(proc.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------- installing: uv, told pip's sources, else pip

PIP_CONFIG = """global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/opt/wheels'
global.constraint='/etc/xdg/pip/constraints.txt'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.index-url='https://global.example/simple'
install.index-url='https://install.example/simple'
download.only-binary=':all:'
:env:.find-links='/opt/wheels /srv/more'
:env:.disable-pip-version-check='1'
"""


def test_pips_configuration_is_read_in_its_order_and_told_to_uv():
    settings = installers.parse_pip_config(PIP_CONFIG)
    assert settings["index-url"] == "https://install.example/simple"  # the install section over the global one
    assert settings["find-links"] == "/opt/wheels /srv/more"  # PIP_FIND_LINKS over the files
    assert "only-binary" not in settings  # another command's section
    options, env, said = installers.uv_options(settings)
    pairs = list(zip(options, options[1:]))
    assert ("--index-strategy", "unsafe-best-match") in pairs  # the best match over all sources, as pip takes
    assert ("--index-url", "https://install.example/simple") in pairs
    assert [v for k, v in pairs if k == "--find-links"] == ["/opt/wheels", "/srv/more"]
    assert [v for k, v in pairs if k == "--extra-index-url"] == ["file:///opt/pypi/simple",
                                                                 "file:///opt/pypi-more/simple"]
    assert ("--constraint", "/etc/xdg/pip/constraints.txt") in pairs
    assert "--compile-bytecode" in options  # pip compiles what it installs
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt"}
    assert "find-links /opt/wheels /srv/more" in said
    assert "--compile-bytecode" not in installers.uv_options({"no-compile": "1"})[0]


def test_uv_is_found_beside_the_interpreter_and_pip_installs_what_uv_cannot_be_told(tmp_path, monkeypatch):
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    uv = bin_dir / "uv"
    uv.write_text("#!/bin/sh\necho 'uv 9.9.9 (fake)'\n")
    uv.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(bin_dir / "python"))  # .venv/bin/python, not activated
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert installers.find_uv() == str(uv)
    monkeypatch.setattr(installers, "pip_settings", lambda python=None: {"find-links": "/opt/wheels",
                                                                         "prefer-binary": "1"})
    chosen = installers.choose()
    assert chosen.kind == "pip" and "prefer-binary" in chosen.why
    with pytest.raises(ValueError, match="prefer-binary"):
        installers.choose("uv")
    monkeypatch.setattr(installers, "pip_settings", lambda python=None: {"find-links": "/opt/wheels"})
    monkeypatch.setenv("UV_INDEX_URL", "https://elsewhere.example/simple")  # not pip's: left out
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "cache"))
    chosen = installers.choose()
    assert (chosen.kind, chosen.uv, chosen.version) == ("uv", str(uv), "uv 9.9.9")
    env = chosen.environment()
    assert "UV_INDEX_URL" not in env and env["UV_CACHE_DIR"] == str(tmp_path / "cache")
    assert installers.choose("pip").kind == "pip"
    monkeypatch.setattr(sys, "executable", str(tmp_path / "elsewhere" / "python"))
    assert installers.find_uv() is None and installers.choose().kind == "pip"


def test_environments_are_made_side_by_side_with_uv_where_cores_and_memory_allow(monkeypatch):
    uv, pip = installers.Installer("uv", "found", uv="/bin/uv"), installers.Installer("pip", "asked for")
    assert environments._available_gib() >= 0
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(environments, "_available_gib", lambda: 64)
    assert (environments.default_jobs(uv), environments.default_jobs(pip), environments.default_jobs(None)) == (2, 1, 1)
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert environments.default_jobs(uv) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(environments, "_available_gib", lambda: 0)
    assert environments.default_jobs(uv) == 1


def _installers():
    return ["pip", *(["uv"] if installers.find_uv() else [])]


@pytest.mark.parametrize("kind", _installers())
def test_a_failed_install_leaves_no_half_made_environment_and_the_others_whole(kind, tmp_path, monkeypatch, capsys):
    """Two environments side by side, one of which cannot be installed (offline: local wheel files): the other is
    made whole, the failed one is removed, and each message is one line. An interrupted one is removed too."""
    from harness.cli import main

    wheel = next(w for w in installers.ensurepip_wheels() if Path(w).name.startswith("setuptools-"))
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "good-cpu.txt").write_text(f"{wheel}\n")  # already there: nothing to fetch
    (tmp_path / "requirements" / "bad-cpu.txt").write_text(f"{tmp_path / 'no_such-1.0-py3-none-any.whl'}\n")
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    envs_dir = tmp_path / "envs"
    status = main(["envs", "create", "good", "bad", "--cpu", "--dir", str(envs_dir), "--jobs", "2",
                   "--installer", kind])
    err = capsys.readouterr().err
    assert status == 1, err
    assert (envs_dir / "good" / ".harness-stamp").exists() and not (envs_dir / "bad").exists()
    assert f"installed with {kind}" in (envs_dir / "good" / ".harness-stamp").read_text()
    failed = [line for line in err.splitlines() if "bad" in line]
    assert len(failed) == 1 and failed[0].startswith("harness envs create: bad: `") and "bad-cpu.txt" in failed[0]
    assert (envs_dir / "bad.failed.log").exists() and str(envs_dir / "bad.failed.log") in failed[0]
    assert f"installing with {kind}" in err and "2 environments at a time" in err
    assert all(line.startswith(("harness envs create: ", "good: ")) for line in err.splitlines()), err

    def interrupted(command, env):  # the environment's folder made (as by venv), then Ctrl-C in the next command
        if "venv" not in command:
            raise KeyboardInterrupt
        (Path(command[-1]) / "bin").mkdir(parents=True)
        return ""

    monkeypatch.setattr(installers, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        environments.create("good", envs_dir, name="again", installer=installers.choose(kind))
    assert not (envs_dir / "again").exists()


def test_after_a_failure_side_by_side_no_further_environment_starts_and_no_traceback(tmp_path, monkeypatch, capsys):
    """Three environments two at a time, the first failing while the second is under way: the second is made whole,
    the third never starts, and the command says so in one line each (exit 1). The install commands are faked here
    (a real install cannot be made to end in this order every time)."""
    import time

    from harness.cli import main

    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "x-cpu.txt").write_text("six\n")
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    monkeypatch.setattr(environments, "spec_environments", lambda spec: [])
    started = []

    def fake_run(command, env):
        target = next(Path(c) for c in command if "/envs/" in str(c))
        name = next(p.name for p in [target, *target.parents] if p.parent.name == "envs")
        started.append(name) if "venv" in command else None
        if name == "bad" and "venv" not in command:
            raise subprocess.CalledProcessError(1, command, output="error: no matching distribution")
        if "venv" in command:
            (target / "bin").mkdir(parents=True)
            (target / "bin" / "python").touch()
        time.sleep(0.5 if name == "good" else 0)
        return ""

    monkeypatch.setattr(installers, "run", fake_run)
    monkeypatch.setattr(installers, "choose", lambda preference=None, python=None: installers.Installer("pip", "x"))
    monkeypatch.setattr(environments, "requirements_for", lambda framework, gpu: tmp_path / "requirements" /
                        "x-cpu.txt")
    envs_dir = tmp_path / "envs"
    status = main(["envs", "create", "bad", "good", "later", "--cpu", "--dir", str(envs_dir), "--jobs", "2"])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err, err
    assert sorted(started) == ["bad", "good"]
    assert (envs_dir / "good" / ".harness-stamp").exists() and not (envs_dir / "bad").exists()
    assert not (envs_dir / "later").exists()
    assert [line for line in err.splitlines() if "bad" in line][0].startswith("harness envs create: bad: `")


def _distributions(python):
    code = ("import importlib.metadata as m, re; print('\\n'.join(sorted(re.sub(r'[-_.]+', '-', "
            "d.metadata['Name']).lower() + '==' + d.version for d in m.distributions())))")
    return subprocess.run([str(python), "-I", "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(python).parent).stdout.split()  # -I, not here: only the environment's own


def _wheel(folder, name, version, requires=()):
    """A pure-Python wheel of one module, ``name``, in ``folder`` (made here: nothing is downloaded)."""
    import base64
    import hashlib
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" +
                                 "".join(f"Requires-Dist: {r}\n" for r in requires),
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip('=')},"
              f"{len(text.encode())}" for path, text in files.items()]
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def _simple_index(root, wheels):
    """A PEP 503 index at ``root`` (file://) of ``wheels``, as /opt/pypi is laid out."""
    for wheel in wheels:
        project = root / wheel.name.split("-")[0]
        project.mkdir(parents=True, exist_ok=True)
        with (project / "index.html").open("a") as page:
            page.write(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    return root.as_uri()


def test_uv_installs_exactly_what_pip_installs_from_pips_sources(tmp_path, monkeypatch):
    """pip configured as this project's CPU machines are (an index, an extra index, a find-links folder whose local
    build of a pinned release pip prefers, as torch 2.13.0+cpu over PyPI's CUDA build, and a constraint file), with
    wheels made here: uv, told pip's configuration, installs the same distributions and versions as pip (pip and
    setuptools included), and compiles them to bytecode as pip does. Were uv not told the find-links, the
    constraint or to take pip's best match over every source, it would take harnesstiny 1.0, harnessdep 2.0 or 1.0."""
    if not installers.find_uv():
        pytest.skip("uv is not installed here (make install puts it in .venv)")
    files = tmp_path / "files"
    main = _simple_index(tmp_path / "main", [_wheel(files / "main", "harnesstiny", v, ["harnessdep>=1"])
                                             for v in ("1.0", "1.1", "2.0")] +
                         [_wheel(files / "main", "harnessdep", v) for v in ("1.0", "1.5", "2.0")] +
                         [_wheel(files / "main", "harnessother", v) for v in ("1.0", "1.9", "2.0")])
    extra = _simple_index(tmp_path / "extra", [_wheel(files / "extra", "harnessdep", "1.0")])
    _wheel(tmp_path / "links", "harnesstiny", "1.0+cpu", ["harnessdep>=1"])
    (tmp_path / "constraints.txt").write_text("harnessdep<2\n")
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "tiny-cpu.txt").write_text("harnesstiny==1.0\nharnessother>=1,<2\n")
    for variable in [v for v in os.environ if v.startswith("PIP_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no configuration file: only these
    monkeypatch.setenv("PIP_INDEX_URL", main)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", extra)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    monkeypatch.setenv("PIP_CONSTRAINT", str(tmp_path / "constraints.txt"))
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    seen = {}
    for kind in ("pip", "uv"):
        chosen = installers.choose(kind)
        assert chosen.kind == kind
        python, made = environments.create("tiny", tmp_path / kind, installer=chosen, packages=("harnessother<1.5",))
        target = python.parent.parent
        assert made and f"installed with {chosen.version or kind}" in (target / ".harness-stamp").read_text()
        seen[kind] = _distributions(python)
        assert list(target.glob("lib/python3*/site-packages/__pycache__/harnesstiny.*.pyc")), kind  # compiled
    assert seen["uv"] == seen["pip"]
    assert {d for d in seen["pip"] if d.startswith("harness")} == {"harnesstiny==1.0+cpu", "harnessdep==1.5",
                                                                  "harnessother==1.0"}
    assert {d.split("==")[0] for d in seen["pip"]} == {"harnesstiny", "harnessdep", "harnessother", "pip",
                                                        "setuptools"}


def test_a_tiny_real_install_from_the_registry_is_the_same_with_uv_and_pip(tmp_path, monkeypatch):
    """This machine's own pip configuration, told to uv, and a small pure-Python release from the package registry
    under a range pin: pip and uv make environments with the same distributions and versions."""
    if not installers.find_uv():
        pytest.skip("uv is not installed here (make install puts it in .venv)")
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "six-cpu.txt").write_text("six>=1.16,<1.17\n")
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    made = {kind: _distributions(environments.create("six", tmp_path / kind, installer=installers.choose(kind))[0])
            for kind in ("pip", "uv")}
    assert made["uv"] == made["pip"]
    assert "six==1.16.0" in made["pip"]


def _module_wheel(folder: Path, name: str, init: str) -> Path:
    """A wheel of one module ``name`` whose ``__init__`` is ``init`` (pip installs a wheel without building it)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": init, f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
             f"{info}/top_level.txt": f"{name}\n"}
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            wheel.writestr(member, text)
        wheel.writestr(f"{info}/RECORD", "".join(f"{m},,\n" for m in [*files, f"{info}/RECORD"]))
    return path


def test_a_package_that_cannot_be_imported_is_named_with_its_error(tmp_path):
    """timm beside the CPU torch resolved to a CUDA build of torchvision and was reported "created"; it failed only at
    the run (issue 59). The import check names the package, the module and the error, and says where CUDA is named."""
    from harness.execution.probes import package_problem

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True)
    python = tmp_path / "env" / "bin" / "python"
    site = next((tmp_path / "env" / "lib").glob("python3*/site-packages"))
    good = _module_wheel(tmp_path, "goodpkg", "VALUE = 1\n")
    broken = _module_wheel(tmp_path, "brokenpkg", "raise OSError('libtorch_cuda.so: cannot open shared object file')\n")
    for wheel in (good, broken):
        zipfile.ZipFile(wheel).extractall(site)  # what pip does with a pure-Python wheel
    assert package_problem(python, ["goodpkg==1.0"]) is None
    assert package_problem(python, ["goodpkg", str(broken)]) == (
        "brokenpkg cannot be imported (brokenpkg: OSError: libtorch_cuda.so: cannot open shared object file) "
        "(a CUDA build beside CPU ones? pin the package's CPU build)")
    assert package_problem(python, ["nosuchpkg>=1"]) == "nosuchpkg is not installed"


def test_an_environment_whose_framework_cannot_be_imported_is_not_reported_created(tmp_path, monkeypatch, capsys):
    """envs create pytorch from requirements without torch (offline: a wheel already there): the probe a trial would
    make fails, so the environment is removed and named in one line, exit 1, never "created"."""
    from harness.cli import main

    wheel = next(w for w in installers.ensurepip_wheels() if Path(w).name.startswith("setuptools-"))
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "pytorch-cpu.txt").write_text(f"{wheel}\n")
    monkeypatch.setattr(environments, "ROOT", tmp_path)
    status = main(["envs", "create", "pytorch", "--cpu", "--dir", str(tmp_path / "envs"), "--installer", "pip"])
    err = capsys.readouterr().err
    assert status == 1 and not (tmp_path / "envs" / "pytorch").exists()
    (line,) = [x for x in err.splitlines() if x.startswith("harness envs create: pytorch:")]
    assert "lacks numpy, pydantic, PyYAML" in line and line.endswith("; removed") and "created" not in err


def test_envs_create_says_which_entries_it_does_not_make(write_spec, tmp_path, capsys):
    from harness.cli import main

    spec = write_spec(base_spec(frameworks=[{"name": "pytorch", "python": sys.executable}]))
    assert main(["envs", "create", "--spec", str(spec), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert f"harness envs create: pytorch: its interpreter {sys.executable} is not made here" in err
