"""Does mixed precision move the accuracy-vs-batch-size curve? The report's section that sets each precision's test
accuracy against fp32's, per framework, execution mode and batch size, from rows that differ only in precision."""

from __future__ import annotations

from harness.record.trial import TrialRecord
from harness.results.metrics import title
from harness.results.sections import Block, Paragraph, Section, batch_table
from harness.results.stats import overlaps
from harness.results.tables import ReportData, metric_table

REFERENCE = "fp32"


def _without_precision(record: TrialRecord) -> tuple[str, str]:
    """The row a record would be in if precision were not varied: its label and the other parts of its variant."""
    parts = [p for p in record.variant.split(", ") if p and p != record.precision]
    return (record.label, ", ".join(parts))


def precision_pairs(records: list[TrialRecord]) -> list[tuple[str, str, str]]:
    """(reference row, other row, other precision) for every pair of report rows that differ only in precision,
    the reference being the fp32 row; in the order the rows first appear."""
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for r in records:
        rows.setdefault(_without_precision(r), {}).setdefault(r.precision or REFERENCE, r.row)
    return [(by[REFERENCE], row, precision) for by in rows.values() if REFERENCE in by
            for precision, row in by.items() if precision != REFERENCE and row != by[REFERENCE]]


def _verdict(a: tuple[float, float] | None, b: tuple[float, float] | None) -> str:
    overlap = overlaps(a, b)
    return "" if overlap is None else " (within noise)" if overlap else " (beyond noise)"


def precision_accuracy_section(data: ReportData) -> Section | None:
    """Per pair of rows that differ only in precision (``precision_pairs``): at each batch size the change of test
    accuracy in percentage points (the other precision's cell minus fp32's, each the report's accuracy cell: the
    median over ok repeats, or the mean over seeds), marked within/beyond noise where both cells have 95% intervals;
    then per pair the change of the curve itself: the accuracy drop from the smallest to the largest batch size that
    both precisions ran, in each precision. None when no two rows differ only in precision."""
    metric = next(m for m in data.metrics if m.key == "accuracy")
    sizes, records = data.batch_sizes, data.records
    cis = data.cis.get("accuracy", {})
    pairs = precision_pairs(records)
    if not pairs:
        return None
    rows, curves, changes = [], [], []
    for reference, other, precision in pairs:
        table = metric_table(records, metric, [reference, other], sizes)
        cells, both = [], []
        for bs in sizes:
            a, b = table.loc[reference, bs], table.loc[other, bs]
            if isinstance(a, float) and isinstance(b, float):
                change = b - a
                both.append((bs, a, b))
                changes.append((abs(change), change, title(other), bs))
                cells.append(f"{change:+.2f}{_verdict(cis.get((reference, bs)), cis.get((other, bs)))}")
            else:
                cells.append(b if isinstance(b, str) and b else a if isinstance(a, str) else "")
        rows.append((f"{title(other)} - {REFERENCE}", cells))
        if len(both) >= 2:
            (lo, a_lo, b_lo), (hi, a_hi, b_hi) = both[0], both[-1]
            curves.append(f"{title(other)}: from batch size {lo} to {hi} accuracy moves {a_hi - a_lo:+.2f} points "
                          f"in {REFERENCE} and {b_hi - b_lo:+.2f} in {precision} (the curve's slope changes by "
                          f"{(b_hi - b_lo) - (a_hi - a_lo):+.2f} points)")
    blocks: list[Block] = [Paragraph("Test accuracy after the last epoch in each precision minus the same row in "
                                     "fp32 (same framework, execution mode, optimizer and seeds), in percentage "
                                     "points, per batch size. With repeats or seeds, 'within noise' means the two "
                                     "cells' 95% "
                                     "intervals overlap. bf16 and fp16 are mixed precision: fp32 master weights and "
                                     "optimizer state, low-precision matrix work, the loss in fp32."),
                           batch_table(rows, sizes)]
    if curves:
        blocks.append(Paragraph("Does it move the accuracy-vs-batch-size curve? " + "; ".join(curves) + "."))
    if changes:
        _, change, row, bs = max(changes)
        blocks.append(Paragraph(f"Largest change: {change:+.2f} points ({row}, batch size {bs})."))
    return Section("precision", "Mixed precision and accuracy", tuple(blocks))
