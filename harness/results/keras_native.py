"""The report's "Keras over native" section: each row of an adapter whose declaration names a ``native`` adapter
(Keras 3 on a backend, ``adapters.keras``: keras-jax over jax, keras-torch over pytorch, keras-tensorflow over
tensorflow) against that native adapter's rows in the same run, per batch size: the ratio of their throughputs and
of their peak memory, each with the report's noise verdict (``harness.results.tables.noise_verdict``: whether the
95% bootstrap intervals of the two medians overlap)."""

from __future__ import annotations

from typing import Any

import adapters  # the registry of declarations: imports no framework
from harness.record.trial import TrialRecord
from harness.results.metrics import Metric, title
from harness.results.sections import Paragraph, Section, simple_table
from harness.results.tables import ReportData, ci_map, noise_verdict


def pairs(data: ReportData) -> list[tuple[str, str]]:
    """(Keras row, native row) for each row of the run (``data.frameworks``, records' ``row``s) whose framework's
    declaration names a ``native`` adapter, with every row of that native adapter that has the same variant (rows of
    one framework under several labels: one pair each), in the report's row order; [] when none."""
    first: dict[str, TrialRecord] = {}
    for record in data.records:
        first.setdefault(record.row, record)
    found = []
    for row in data.frameworks:
        keras = first.get(row)
        declaration = adapters.BUILTIN.get(keras.framework) if keras is not None else None
        if keras is None or declaration is None or not declaration.family.native:
            continue
        found += [(row, other) for other in data.frameworks if (native := first.get(other)) is not None
                  and native.framework == declaration.family.native and native.variant == keras.variant]
    return found


def _median(data: ReportData, key: str, row: str, batch_size: int) -> float | None:
    """The report's cell (``data.tables``: the median over the ok repeats), or None where it shows a status."""
    value = data.tables[key].loc[row, batch_size]
    return float(value) if isinstance(value, float) else None


def _memory_words(data: ReportData, metric: Metric) -> str:
    """Which peak memory the ratio compares, on a GPU or on the host."""
    if data.backend == "nvml":
        return (f"the report's {metric.title} ({metric.unit}): the peak NVML memory of the worker process on the GPU, "
                "what its allocator reserved plus the CUDA context (the device's used memory where NVML gives no "
                "per-process figure), not the framework allocator's own peak, which each framework counts its own "
                "way")
    return (f"the report's {metric.title} ({metric.unit}): the peak anonymous resident memory of the worker's process "
            "tree (RSS less its file-backed and shared pages), which includes the interpreter's heap, the framework's "
            "allocations (Keras's own among them) and the dataset, not the libraries' code")


def keras_native_section(data: ReportData) -> Section | None:
    """Per (Keras row, native row) pair (``pairs``) and batch size at which both have ok trials: the throughput
    ratio, Keras / native of the median throughput over the ok repeats (samples/s; below 1 Keras trains fewer samples
    per second: 0.80 is 20 % slower), and the peak memory ratio, Keras / native of the median of the report's memory
    metric (on a GPU the worker process's NVML peak, on the host the worker tree's peak anonymous RSS; above 1 Keras
    needs more), each with ``noise_verdict`` on the two cells' 95% bootstrap intervals of the median. None when no Keras
    row's native adapter is in the run."""
    found = pairs(data)
    if not found:
        return None
    memory = next(m for m in data.metrics if m.key == "memory")
    rows_in = sorted({row for pair in found for row in pair})
    throughput_cis = data.cis.get("throughput", {})
    memory_cis = ci_map(data.records, memory, rows_in, data.batch_sizes)
    rows: list[list[str]] = []
    missing: list[str] = []
    for keras, native in found:
        before = len(rows)
        for batch_size in data.batch_sizes:
            k, n = _median(data, "throughput", keras, batch_size), _median(data, "throughput", native, batch_size)
            if k is None or n is None or n <= 0:
                continue
            cells = [title(keras), title(native), str(batch_size), f"{k / n:.2f}",
                     noise_verdict(throughput_cis.get((native, batch_size)), throughput_cis.get((keras, batch_size)),
                                   k / n - 1)]
            km, nm = _median(data, "memory", keras, batch_size), _median(data, "memory", native, batch_size)
            if km is None or nm is None or nm <= 0:
                cells += ["n/a", ""]
            else:
                cells += [f"{km / nm:.2f}", noise_verdict(memory_cis.get((native, batch_size)),
                                                          memory_cis.get((keras, batch_size)), km / nm - 1,
                                                          "more memory", "less memory")]
            rows.append(cells)
        if len(rows) == before:
            missing.append(f"{title(keras)} and {title(native)}")
    blocks: list[Any] = [
        Paragraph("Each Keras 3 row against the native adapter of the framework it runs on, in this run and with the "
                  "same variant (a native framework under several labels: one line each), at each batch size where "
                  "both have ok trials. Throughput ratio = Keras throughput / native throughput (samples/s, each the "
                  "median over the ok repeats, as in the Throughput table): below 1 Keras trains fewer samples per "
                  "second (0.80: 20 % slower). It measures Keras's whole step as a Keras user's own loop drives it: "
                  "`Model.train_on_batch` hands its loss back to the host, so every step waits for the device, a "
                  "per-step host synchronisation that the native adapters pay only at the edges of the timed windows "
                  "(in latency mode both pay it every step), on top of Keras's own dispatch and layers."),
        Paragraph(f"Peak memory ratio = Keras / native of {_memory_words(data, memory)}; the medians over the ok "
                  "repeats, above 1 Keras needs more."),
        Paragraph("Verdicts as elsewhere in the report: faster or slower (more or less memory) where the 95% "
                  "bootstrap intervals of the two medians do not overlap, 'no measurable difference' where they do "
                  "(within the noise of this run), 'single runs: no interval' where a side has fewer than two ok "
                  "repeats."),
    ]
    if rows:
        blocks.append(simple_table(["Keras", "native", "batch size", "throughput ratio", "throughput verdict",
                                    "peak memory ratio", "memory verdict"], rows, "llrrlrl"))
    if missing:
        blocks.append(Paragraph("No batch size at which both have ok trials: " + "; ".join(missing) + "."))
    return Section("keras_native", "Keras over native", tuple(blocks))
