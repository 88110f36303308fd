"""Command line: ``python -m harness run|report|compare|history|max-batch|env|envs`` (also installed as ``harness``).

The parsers of every subcommand and the dispatch to the studies and results that do the work; nothing is computed
here. Imports are made inside the commands so that ``--help`` and a bad argument answer at once.

Exit status: 0 on success (a sweep whose trials failed still succeeds: failures are results); 2 for a bad spec or
bad arguments, with one line on standard error and no traceback; 1 when ``compare`` finds a regression; 3 when a
``run`` had no trial that ended ok and at least one in error, crashed or timeout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

EXIT_USAGE = 2
EXIT_NOTHING_RAN = 3


def _int_list(text: str) -> list[int | str]:
    # Values are validated by the spec (so errors name the spec file and field); here they are only split.
    out: list[int | str] = []
    for part in text.split(","):
        part = part.strip()
        out.append(int(part) if part.lstrip("-").isdigit() else part)
    return out


def _str_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="harness", description="Batch-size benchmarks across PyTorch, TensorFlow "
                                                                 "and MXNet: throughput, utilization, memory, accuracy.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every trial of a spec, then write the report")
    run.add_argument("spec", help="a YAML spec, e.g. specs/quick.yaml")
    run.add_argument("--frameworks", type=_str_list, help="comma-separated subset, e.g. pytorch,mxnet")
    run.add_argument("--batch-sizes", type=_int_list, help="comma-separated batch sizes, e.g. 8,64,512")
    run.add_argument("--epochs", type=int, help="epochs per trial")
    run.add_argument("--out", default="results", help="folder that receives the run directory (default: results)")
    run.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    run.add_argument("--resume", metavar="RUN_DIR", help="finish an interrupted run of the same spec")
    run.add_argument("--history", metavar="FILE", help="append the run's summary row to this history file")
    run.add_argument("--executor", choices=("local", "ray"), default="local",
                     help="local: trials on this machine (default); ray: each trial a Ray task on a cluster")
    run.add_argument("--parallel", type=int, default=1, metavar="N",
                     help="local: N trials at once, one per GPU (cuda:0..N-1) or per set of cpu_threads cores")
    run.add_argument("--devices", metavar="LIST", help="local: GPUs side by side, e.g. cuda:0,cuda:1 (one trial each "
                                                       "at a time; default: the spec's devices)")
    run.add_argument("--address", help="ray: the cluster's address (auto, host:6379, ray://host:10001); default: a "
                                       "local Ray instance on this machine")
    run.add_argument("--retries", type=int, default=0, metavar="N",
                     help="ray: run a trial again up to N times when its node or worker dies (default 0: recorded "
                          "crashed, 'node lost')")
    _results_parsers(sub)
    history = sub.add_parser("history", help="plot the trend of a metric over the runs in a history file")
    history.add_argument("--file", default="results/history.jsonl", help="default: results/history.jsonl")
    history.add_argument("--metric", default="throughput",
                         help="throughput, seconds_per_epoch, accuracy, memory or util (default throughput)")
    history.add_argument("--frameworks", type=_str_list, help="only these frameworks")
    history.add_argument("--batch-sizes", type=lambda t: [int(x) for x in _str_list(t)], help="only these sizes")
    history.add_argument("--out", default=None, help="PNG path (default: next to the history file)")
    sub.add_parser("env", help="print what a run would record about this machine (JSON)")
    _max_batch_parser(sub)
    envs = sub.add_parser("envs", help="framework environments: one virtualenv per framework under envs/")
    envs_sub = envs.add_subparsers(dest="envs_command", required=True)
    create = envs_sub.add_parser("create", help="create (or keep, when up to date) envs/<framework> from "
                                                "requirements/<framework>-cpu.txt or -gpu.txt")
    create.add_argument("frameworks", nargs="*", help="default: every built-in framework")
    build = create.add_mutually_exclusive_group()
    build.add_argument("--gpu", action="store_true", help="use requirements/<framework>-gpu.txt (CUDA builds) "
                                                          "whatever the machine")
    build.add_argument("--cpu", action="store_true", help="use requirements/<framework>-cpu.txt (CPU builds) "
                                                          "whatever the machine")
    create.add_argument("--dry-run", action="store_true", help="say which requirements would be installed where, "
                                                               "and change nothing")
    create.add_argument("--dir", default=None, help="where the environments go (default: envs/ beside the harness)")
    return parser


def _envs_create(args: argparse.Namespace) -> int:
    from harness.execution import environments
    from harness.spec import ROOT

    envs_dir = Path(args.dir) if args.dir else ROOT / "envs"
    gpu, why = environments.choose_build(args.gpu, args.cpu)
    frameworks = args.frameworks or environments.default_frameworks()
    try:  # every name first: an unknown one is one line, before anything is made
        for framework in frameworks:
            environments.requirements_for(framework, gpu)
    except ValueError as err:
        print(f"harness envs create: {err}", file=sys.stderr)
        return EXIT_USAGE
    print(f"harness envs create: {'CUDA' if gpu else 'CPU'} builds (requirements/<framework>-"
          f"{'gpu' if gpu else 'cpu'}.txt): {why}", file=sys.stderr)
    lines = []
    for framework in frameworks:
        if args.dry_run:
            print(environments.plan_create(framework, envs_dir, gpu))
            continue
        try:
            python, made = environments.create(framework, envs_dir, gpu=gpu)
        except ValueError as err:
            print(f"harness envs create: {err}", file=sys.stderr)
            return EXIT_USAGE
        except subprocess.CalledProcessError as err:
            print(f"harness envs create: {framework}: `{' '.join(map(str, err.cmd))}` failed with status "
                  f"{err.returncode}", file=sys.stderr)
            return 1
        print(f"{framework}: {python} ({'created' if made else 'up to date'})", file=sys.stderr)
        lines.append(environments.spec_entry(framework, python))
    if lines:
        print("frameworks:\n" + "\n".join(lines))
    return 0


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated batch sizes, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("batch sizes must be positive")
    return sizes


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), not {text}")
    return value


def _results_parsers(sub: Any) -> None:
    """``report`` (one run, or two side by side), ``export`` (tidy tables, MLflow) and ``schema``."""
    report = sub.add_parser("report", help="(re)write report.md, report.html and plots/ of a run directory; with "
                                           "two runs and --html, a page with both side by side")
    report.add_argument("run_dir", help="the run (with a second run: the base)")
    report.add_argument("new_run", nargs="?", help="a second run to set beside the first (needs --html)")
    report.add_argument("--html", action="store_true", help="with two runs: write NEW_RUN/compare-<base>.html")
    report.add_argument("--threshold", type=float, default=5.0, metavar="PCT",
                        help="with two runs: compare's regression threshold (default 5)")
    compare = sub.add_parser("compare", help="compare two runs, or two rows of one run (--rows); exit 1 on a "
                                             "regression beyond the threshold")
    compare.add_argument("base_run", help="the baseline run (with --rows: the one run)")
    compare.add_argument("new_run", nargs="?", help="the new run (not with --rows)")
    compare.add_argument("--rows", nargs=2, metavar=("BASE_ROW", "NEW_ROW"),
                         help="compare two rows of one run, e.g. the baseline and the candidate as two framework "
                              "entries of one spec, interleaved: the machine's run-to-run drift then falls on both")
    compare.add_argument("--threshold", type=float, default=5.0, metavar="PCT",
                         help="percent change that counts as a regression (default 5)")
    compare.add_argument("--alpha", type=float, default=0.05, metavar="P",
                         help="the chance of any false alarm allowed in one comparison of runs of the same code "
                              "(default 0.05)")
    compare.add_argument("--history", metavar="FILE",
                         help="a history file (run --history): the run-to-run spread of its last runs of the spec on "
                              "this device joins the noise")
    compare.add_argument("--history-runs", type=int, default=10, metavar="N",
                         help="how many of the newest history runs (default 10)")
    compare.add_argument("--drift-pct", type=float, default=None, metavar="PCT",
                         help="without a history: the run-to-run drift of throughput assumed between the two runs "
                              "(default 5, measured on a shared 2-core VM; 0: the repeats alone are the noise)")
    compare.add_argument("--out", help="write the Markdown here (default: NEW_RUN/compare-<base run>.md; with --rows "
                                       "RUN/compare-rows.md)")
    export = sub.add_parser("export", help="a run's tidy tables as CSV, Parquet or JSON files")
    export.add_argument("run_dir")
    export.add_argument("--format", default="csv", help="csv (default), parquet (needs pyarrow) or json")
    export.add_argument("--out", help="folder for the files (default: RUN_DIR/export)")
    export.add_argument("--mlflow", action="store_true", help="log the run to MLflow instead: a parent run for the "
                                                              "sweep, a child run per trial (needs mlflow)")
    export.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else an SQLite "
                                               "store beside the run directories, mlflow.db)")
    export.add_argument("--experiment", help="MLflow experiment (default: the spec's name)")
    schema = sub.add_parser("schema", help="print the JSON Schema of a trial record (trials.jsonl)")
    schema.add_argument("--out", help="write it to this file instead")


def _max_batch_parser(subparsers: Any) -> argparse.ArgumentParser:
    """``max-batch SPEC --framework NAME [--memory-limit-mb X] [--margin F] [--with-dataset] [--out DIR] ...``."""
    tolerance = 0.05  # harness.studies.max_batch.search.DEFAULT_TOLERANCE, not imported to keep startup light
    parser = subparsers.add_parser(
        "max-batch", help="find the largest batch size that fits the memory cap (one worker per probe)",
        description="Probes batch sizes, each in its own worker, fits peak memory = fixed + per-sample x batch, "
                    "predicts the limit from the cap and bisects to it. The answer is ok in two probes; a size "
                    "seen both fitting and running out of memory is reported as 'fits sometimes', never as the "
                    "answer. Exit 0 with the result, 1 when a probe failed otherwise than out of memory, 2 for a "
                    "bad spec or arguments.")
    parser.add_argument("spec", help="a YAML spec, e.g. specs/max_batch.yaml")
    parser.add_argument("--framework", required=True, help="pytorch, tensorflow, mxnet (or a registered adapter)")
    parser.add_argument("--memory-limit-mb", type=float, help="the cap (MB = 10^6 bytes); default: the spec's "
                                                              "memory_limit_mb, else the device's memory")
    parser.add_argument("--margin", type=_fraction, default=0.0,
                        help="fraction of the limit kept free in the recommendation (default 0)")
    parser.add_argument("--tolerance", type=_fraction, default=tolerance,
                        help=f"stop when the bracket is within this fraction (default {tolerance})")
    parser.add_argument("--initial-sizes", type=_sizes,
                        help="small sizes probed first (default: 16, then the neutral memory model's guess)")
    parser.add_argument("--max-batch", type=int, help="the largest size to try")
    parser.add_argument("--with-dataset", action="store_true",
                        help="probe with the spec's real dataset resident, as in a run (default: synthetic data of "
                             "the batch's size); sizes are then at most the training set's")
    parser.add_argument("--device", help="cpu or cuda:N (default: the spec's device)")
    parser.add_argument("--timeout", type=float, help="seconds per probe (default: the spec's timeout_s)")
    parser.add_argument("--out", default="results", help="folder that receives the run directory (default: results)")
    return parser


def _summary_console() -> Any:
    from rich.console import Console

    console = Console()
    # Piped output (CI logs, `| tee`) gets rich's 80-column default, which truncates the headers: widen it.
    return console if console.is_terminal else Console(width=120)


def _print_summary(data: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    from harness.results.tables import summary_rows

    util = "GPU use %" if data["backend"] == "nvml" else "CPU use %"
    memory = "GPU mem MB" if data["backend"] == "nvml" else "RSS MB"
    table = Table(title=f"{data['run']['spec']['name']} on {data['run']['device']}")
    for title in ("framework", "batch", "status", "samples/s", "s/epoch", util, memory, "accuracy %"):
        table.add_column(title, justify="left" if title in ("framework", "status") else "right")
    for row in summary_rows(data):
        table.add_row(*row)
    console.print(table)


def _executor(args: argparse.Namespace, spec: Any) -> Any:
    """The executor the flags and the spec ask for (``harness.execution.executors``), or None for the default (one
    trial at a time on this machine). Raises ValueError (or ExecutorError) for flags that do not go together."""
    from harness.execution.executors import ExecutorError, LocalExecutor, RayExecutor, local_slots
    from harness.measure.machine import resolve_device

    if args.executor == "local" and (args.address or args.retries):
        raise ValueError("--address and --retries apply to --executor ray")
    if args.retries < 0:
        raise ValueError(f"--retries must be 0 or more, not {args.retries}")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else spec.devices
    if args.executor == "ray":
        if args.parallel != 1 or args.devices:
            raise ValueError("--parallel and --devices apply to --executor local (Ray places trials itself)")
        device = resolve_device(spec.device)
        if device.startswith("cuda") and device != "cuda:0":
            raise ExecutorError(f"--executor ray gives each trial a GPU of its own; the spec's device {device} "
                                "cannot be honoured (use device: auto or cuda:0)")
        return RayExecutor(args.address, device.startswith("cuda"), spec.cpu_threads or _plan_threads(),
                           retries=args.retries, exclusive=spec.exclusive)
    if args.parallel == 1 and not devices:
        return None
    return LocalExecutor(local_slots(resolve_device(spec.device), args.parallel, devices, spec.cpu_threads))


def _plan_threads() -> int:
    """The threads a trial gets when the spec does not say (the available cores, as the plan counts them)."""
    from harness.plan import available_cpus

    return available_cpus()


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from harness import plan
    from harness.results import report
    from harness.studies.sweep import raise_on_signals, run_spec

    overrides = {"frameworks": args.frameworks, "batch_sizes": args.batch_sizes, "epochs": args.epochs}
    spec = plan.load(args.spec, overrides)
    from harness.measure.sampler import interval_warning

    if (warning := interval_warning(spec.sampler.interval_s)) is not None:
        print(f"{args.spec}: sampler.interval_s: {warning}", file=sys.stderr)
    console = Console(stderr=True)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        console=console, disable=args.no_progress or not console.is_terminal)
    state: dict[str, Any] = {}

    def on_start(trial: Any, index: int, total: int) -> None:
        state["trial"] = trial.id
        if "task" not in state:
            state["task"] = progress.add_task("starting", total=total)
        progress.update(state["task"], description=f"{trial.id}: starting")

    def on_event(event: dict[str, Any]) -> None:
        if "task" in state and event.get("event") == "epoch":
            progress.update(state["task"], description=f"{state.get('trial', '')} epoch {event['epoch'] + 1}: "
                                                       f"accuracy {100 * event['test_accuracy']:.1f}%")

    def on_end(trial: Any, record: dict[str, Any]) -> None:
        progress.advance(state["task"])
        throughput = record["metrics"].get("throughput")
        detail = f"{throughput:,.0f} samples/s" if throughput else record["reason"]
        progress.console.print(f"{trial.id}: {record['status']} ({detail}) in {record['wall_seconds']:.1f} s")

    try:
        executor = _executor(args, spec)
    except ValueError as err:  # ExecutorError too: no cluster, too few cores, Ray not installed
        print(f"harness run: {err}", file=sys.stderr)
        return EXIT_USAGE
    raise_on_signals()  # SIGTERM, SIGHUP: the run is marked interrupted, its report written (see main)
    try:
        with progress:
            run_dir = run_spec(spec, args.out, args.spec, on_start=on_start, on_end=on_end, on_event=on_event,
                               resume=args.resume, executor=executor)
    finally:
        if executor is not None:
            executor.close()
    path = report.write(run_dir)
    if args.history:
        from harness.studies import history

        history.append(args.history, run_dir)
    data = report.build(run_dir)
    _print_summary(data, _summary_console())
    print(f"run directory: {run_dir}\nreport: {path}")
    return _run_status(run_dir)


def _run_status(run_dir: Path) -> int:
    """EXIT_NOTHING_RAN when no trial ended ok and at least one ended in error, crashed or timeout (a broken
    environment, driver or adapter: a nightly job must notice); else 0, whatever else failed (an OOM, a skipped or
    unsupported trial is a result)."""
    from harness.results.store import read_trials

    statuses = {r["status"] for r in read_trials(run_dir)}
    if "ok" not in statuses and statuses & {"error", "crashed", "timeout"}:
        failed = ", ".join(sorted(statuses & {"error", "crashed", "timeout"}))
        print(f"harness run: no trial ended ok ({failed}): exit {EXIT_NOTHING_RAN}", file=sys.stderr)
        return EXIT_NOTHING_RAN
    return 0


def _compare(args: argparse.Namespace) -> int:
    from rich.table import Table

    from harness.studies.compare import compare_rows, compare_runs, resolvable_lines, to_markdown

    try:
        if not 0 < args.alpha < 1:
            raise ValueError(f"--alpha must be between 0 and 1, not {args.alpha:g}")
        if args.rows:
            if args.new_run or args.history or args.drift_pct is not None:
                raise ValueError("--rows compares two rows of one run: give one run and no --history or --drift-pct")
            rows, summary = compare_rows(args.base_run, *args.rows, args.threshold, alpha=args.alpha)
            default_out = Path(args.base_run) / "compare-rows.md"
        else:
            if not args.new_run:
                raise ValueError("give two runs, or one run and --rows BASE_ROW NEW_ROW")
            rows, summary = compare_runs(args.base_run, args.new_run, args.threshold, alpha=args.alpha,
                                         history_file=args.history, history_runs=args.history_runs,
                                         **({} if args.drift_pct is None else {"drift_pct": args.drift_pct}))
            default_out = Path(args.new_run) / f"compare-{Path(args.base_run).name}.md"
    except (FileNotFoundError, ValueError) as err:
        print(f"harness compare: {err}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.out) if args.out else default_out
    out.write_text(to_markdown(rows, summary), encoding="utf-8")
    table = Table(title=f"{summary['base']} -> {summary['new']} (threshold {args.threshold:g}%)")
    for title in ("framework", "batch", "metric", "base", "new", "change %", "noise", "verdict"):
        table.add_column(title, justify="right" if title in ("batch", "base", "new", "change %") else "left")
    for r in rows:
        style = "bold red" if r.verdict == "regression" else None
        table.add_row(r.framework, str(r.batch_size), r.metric, "" if r.base is None else f"{r.base:,.2f}",
                      "" if r.new is None else f"{r.new:,.2f}",
                      "" if r.change_pct is None else f"{r.change_pct:+.1f}", r.noise, r.verdict, style=style)
    _summary_console().print(table)
    for missing in summary["missing"]:
        print(f"missing or failed on one side: {missing}")
    for line in resolvable_lines(summary):
        print(line[2:])
    print(f"{summary['regressions']} regression(s); comparison: {out}")
    return 1 if summary["regressions"] else 0


def _report_pair(args: argparse.Namespace) -> int:
    """``harness report BASE NEW --html``: compare's verdicts and both runs side by side in one HTML page."""
    from harness.results import html
    from harness.studies.compare import compare_runs, to_markdown

    if not args.html:
        print("harness report: two runs need --html (a page with both side by side)", file=sys.stderr)
        return EXIT_USAGE
    try:
        rows, summary = compare_runs(args.run_dir, args.new_run, args.threshold)
        page = html.render_pair(Path(args.run_dir), Path(args.new_run), to_markdown(rows, summary))
    except (FileNotFoundError, ValueError) as err:
        print(f"harness report: {err}", file=sys.stderr)
        return EXIT_USAGE
    out = Path(args.new_run) / f"compare-{Path(args.run_dir).name}.html"
    out.write_text(page, encoding="utf-8")
    print(f"{summary['regressions']} regression(s); page: {out}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from harness.results import export
    from harness.results.data import load_run

    try:
        run = load_run(args.run_dir)
        if args.mlflow:
            from harness.results.mlflow_export import export_run

            done = export_run(run, args.tracking_uri, args.experiment)
            print(f"MLflow experiment {done.experiment_id}, parent run {done.parent_run_id}: {len(done.created)} "
                  f"trial run(s) logged, {len(done.existing)} already there")
            return 0
        paths = export.write(run, args.format, args.out)
    except ValueError as err:  # a format, pyarrow or mlflow missing, a newer schema
        print(f"harness export: {err}", file=sys.stderr)
        return EXIT_USAGE
    for path in paths:
        print(path)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from harness.results.schema import SchemaError
    from harness.spec import SpecError

    try:
        if args.command == "run":
            return _run(args)
        if args.command == "report":
            from harness.results import report

            if args.new_run is not None:
                return _report_pair(args)
            try:
                path = report.write(args.run_dir)
            except FileNotFoundError as err:
                print(f"harness report: {err}", file=sys.stderr)
                return EXIT_USAGE
            _print_summary(report.build(args.run_dir), _summary_console())
            print(f"report: {path}")
            return 0
        if args.command == "compare":
            return _compare(args)
        if args.command == "history":
            from harness.studies import history

            try:
                out = history.plot(args.file, args.metric, args.out or Path(args.file).with_suffix(f".{args.metric}.png"),
                                   args.frameworks, args.batch_sizes)
            except (ValueError, FileNotFoundError) as err:
                print(f"harness history: {err}", file=sys.stderr)
                return EXIT_USAGE
            print(f"plot: {out}")
            return 0
        if args.command == "max-batch":
            from harness.studies.max_batch import command

            return command.run(args)
        if args.command == "envs":
            return _envs_create(args)
        if args.command == "export":
            return _export(args)
        if args.command == "schema":
            from harness.results.schema import trial_schema_json

            if args.out:
                Path(args.out).write_text(trial_schema_json(), encoding="utf-8")
                print(f"schema: {args.out}")
            else:
                print(trial_schema_json(), end="")
            return 0
        if args.command == "env":
            from harness.measure import machine

            print(json.dumps(machine.collect(), indent=2))
            return 0
    except SpecError as err:
        print(err, file=sys.stderr)
        return EXIT_USAGE
    except (FileNotFoundError, SchemaError) as err:  # --resume of a directory that is not a run, or a newer one
        print(f"harness {args.command}: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BaseException as exc:
        from harness.studies.sweep import Interrupted

        if not isinstance(exc, (KeyboardInterrupt, Interrupted)):
            raise
        return _interrupted(exc)
    return EXIT_USAGE


def _interrupted(exc: BaseException) -> int:
    """Ctrl-C, SIGTERM or SIGHUP during a run: the worker is already gone and run.json says what finished; write the
    report of what finished and exit 128 + the signal's number (130, 143, 129)."""
    import signal

    from harness.results import report

    signum = getattr(exc, "signum", signal.SIGINT)
    run_dir = getattr(exc, "run_dir", None)
    where = ""
    if run_dir is not None:
        try:
            where = f"; report of the finished trials: {report.write(run_dir)}"
        except Exception as err:  # noqa: BLE001 - the interruption is the news, a report failure only a detail
            where = f"; the report of the finished trials failed ({type(err).__name__}: {err})"
        where += f"; continue with --resume {run_dir}"
    print(f"interrupted by {signal.Signals(signum).name}: finished trials are in trials.jsonl{where}", file=sys.stderr)
    return 128 + int(signum)
