"""advice.md: the answer first (one line per entry and objective, with how sure it is), then the evidence (the
noise scale and its trajectory, the throughput curve, the predicted time to target per size)."""

from __future__ import annotations

from typing import Any

WHAT = {"memory": "largest that holds", "throughput": "fastest (samples/s)", "time": "least time to target",
        "energy": "least energy to target"}


def _num(value: Any, fmt: str = ",.0f") -> str:
    return "" if value is None else format(value, fmt)


def answer_line(objective: str, answer: dict[str, Any]) -> str:
    """One objective's answer in words: the size and how sure, or why there is none."""
    size = answer.get("batch_size")
    if size is None:
        return f"- **{WHAT[objective]}**: no answer: {answer.get('reason')}"
    if objective == "memory":
        return f"- **{WHAT[objective]}**: **{size}** (limit {answer.get('limit')}; held in max-batch's run checks)"
    if objective == "throughput":
        interval = answer.get("interval")
        sure = (f", 95 % interval {_num(interval[0])}..{_num(interval[1])}" if interval else
                ", one repeat: no interval")
        return (f"- **{WHAT[objective]}**: **{size}** ({_num(answer.get('throughput'))} samples/s{sure}); the knee "
                f"(95 % of it) at **{answer.get('knee')}**")
    spread = answer.get("range")
    sure = (f"any of {spread[0]}..{spread[1]} across the noise scale's interval" if spread and spread[0] != spread[1]
            else "the same across the noise scale's interval")
    unit = "s" if objective == "time" else "J"
    value = answer.get("predicted")
    predicted = (f"predicted {_num(value, ',.2f')} {unit}, {_num(answer.get('predicted_steps'))} steps"
                 if value is not None else answer.get("note") or "")
    note = f"; {answer['note']}" if value is not None and answer.get("note") else ""
    return (f"- **{WHAT[objective]}**: **{size}** ({sure}; {predicted}; B_noise {_num(answer.get('b_noise'), '.1f')})"
            f"{note}{verdict(answer.get('validation'))}")


def verdict(validation: dict[str, Any] | None) -> str:
    """The validation's verdict on the time answer in words ("" without ``--validate``)."""
    if not validation:
        return ""
    best, held = validation.get("measured_best"), validation.get("held")
    seeds = max((row["seeds"] for row in validation["sizes"].values()), default=0)
    if best is None:
        return "; validated: no size reached the target in the spec's epochs" + (
            " (the budget cut the validation)" if validation.get("cut") else "")
    measured = f"measured best **{best}** ({_num(validation['measured_best_s'], '.3f')} s, median of {seeds} seeds)"
    if held is None:
        return f"; validated: {measured}; the predicted size was not trained"
    ratio = validation.get("ratio")
    mine = ("never reached the target" if ratio is None else
            f"{_num(validation['predicted_measured_s'], '.3f')} s, {ratio:.2f}x")
    rule = f"within {validation['hold_ratio']:.2f}x"
    return (f"; validated: **held** ({rule}): {measured}, this size {mine}" if held else
            f"; validated: **did not hold** (not {rule}): {measured}, this size {mine}")


def global_line(plans: dict[str, Any]) -> str:
    """The ``--global-batch`` answer in words: the plan with the highest throughput and its runner-up, or why none."""
    size = plans["global_batch"]
    if plans.get("batch_size") is None:
        return f"- **a global batch of {size}**: no answer: {plans.get('reason')}"
    best = next(r for r in plans["rows"] if r["plan"] == plans["batch_size"])
    interval = best.get("throughput_interval")
    sure = f", 95 % interval {_num(interval[0])}..{_num(interval[1])}" if interval else ", one repeat: no interval"
    runner = f"; runner-up {plans['runner_up']}" if plans.get("runner_up") else ""
    notes = "".join(f"; {note}" for note in plans.get("notes", []))
    return (f"- **a global batch of {size}**: **{plans['batch_size']}** ({_num(best['throughput_median'])} "
            f"samples/s{sure}; micro-batches up to {plans['largest_that_holds']} hold){runner}{notes}")


def global_table(label: str, plans: dict[str, Any]) -> list[str]:
    """The ``--global-batch`` evidence: per plan its throughput and seconds per optimizer step."""
    lines = [f"## {label}: plans for a global batch of {plans['global_batch']}", "",
             "| plan | devices | micro-batch | accumulation | samples/s (median) | 95 % interval | s per step |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in plans["rows"]:
        interval = r.get("throughput_interval")
        lines.append(f"| {r['plan']} | {r['devices']} | {r['micro_batch']} | {r['accumulation']} | "
                     f"{_num(r['throughput_median']) or (r.get('failed') or '')[:80]} | "
                     f"{f'{_num(interval[0])}..{_num(interval[1])}' if interval else ''} | "
                     f"{_num(r['step_s'], '.4f')} |")
    return lines + [""]


def validation_table(label: str, validation: dict[str, Any]) -> list[str]:
    """The validation's evidence: per size the seeds trained, how many reached the target, the median seconds."""
    rounds = " / ".join(str(len(r)) for r in validation["rounds"])
    lines = [f"## {label}: validation (successive halving; sizes per round {rounds})", "",
             "| batch size | seeds | reached | median s to target | per seed (s) |",
             "| ---: | ---: | ---: | ---: | --- |"]
    for size, row in validation["sizes"].items():
        per_seed = ", ".join("-" if v is None else f"{v:.3f}" for v in row["seconds"])
        lines.append(f"| {size} | {row['seeds']} | {row['reached']} | {_num(row['median_s'], '.3f')} | {per_seed} |")
    return lines + [""]


def markdown(advice: dict[str, Any]) -> str:
    """advice.md of an ``advice.json`` object."""
    target = advice.get("target_accuracy")
    lines = [f"# Which batch size? {advice['spec']} on {advice['device']}", "",
             f"Target test accuracy: {target if target is not None else 'none given'}. Candidates: "
             f"{', '.join(str(c) for c in advice.get('candidates', []))}.", ""]
    for label, entry in advice["entries"].items():
        lines.append(f"## {label}")
        lines.append("")
        for objective, answer in entry["objectives"].items():
            lines.append(answer_line(objective, answer))
        if entry.get("global_batch"):
            lines.append(global_line(entry["global_batch"]))
        lines.append("")
    for note in advice.get("notes", []):
        lines.append(f"Note: {note}")
    lines += ["", "The time and energy answers assume a learning rate that suits each size (the spec's "
              "learning_rate_scaling sets it): S(B) = S_min (1 + B_noise / B), McCandlish et al. 2018. The noise "
              "scale grows as the loss falls; it is taken where the noise trial first reached the target.", ""]
    lines += ["# Evidence", ""]
    for label, entry in advice["entries"].items():
        noise = entry.get("noise_scale")
        if noise and noise.get("b_simple") is not None:
            interval = noise.get("interval")
            lines += [f"## {label}: gradient noise scale", "",
                      f"B_simple **{noise['b_simple']:.1f}**" + (
                          f" (95 % interval {interval[0]:.1f}..{interval[1]:.1f})" if interval else "") +
                      f" at epoch {noise['at_epoch']}, from {noise['probes']} probes of {noise['batch']} samples in "
                      f"micro-batches of {noise['micro_batch']}.", "",
                      "| epoch | train loss | test accuracy | B_simple (moving average) |",
                      "| ---: | ---: | ---: | ---: |"]
            for row in noise["trajectory"]:
                lines.append(f"| {row['epoch']} | {_num(row['train_loss'], '.4f')} | "
                             f"{_num(row['test_accuracy'], '.4f')} | {_num(row['b_simple'], '.1f')} |")
            lines.append("")
        elif noise:
            lines += [f"## {label}: gradient noise scale", "", f"Not estimated: {noise.get('reason')}", ""]
        if entry.get("speeds"):
            time_rows = {r["batch_size"]: r for r in (entry["objectives"].get("time") or {}).get("rows") or []}
            lines += [f"## {label}: throughput and predicted time to target", "",
                      "| batch size | samples/s (median) | 95 % interval | s per step | J per step | predicted steps "
                      "| predicted s |", "| ---: | ---: | --- | ---: | ---: | ---: | ---: |"]
            for s in entry["speeds"]:
                interval = s.get("throughput_interval")
                row = time_rows.get(s["batch_size"], {})
                lines.append(f"| {s['batch_size']} | {_num(s['throughput_median'])} | "
                             f"{f'{_num(interval[0])}..{_num(interval[1])}' if interval else ''} | "
                             f"{_num(s['step_s_median'], '.5f')} | {_num(s.get('energy_per_step_j'), '.3f')} | "
                             f"{_num(row.get('steps'))} | {_num(row.get('seconds'), '.2f')} |")
            lines.append("")
        if entry.get("plot"):
            lines += [f"![{label}: predicted and measured time to the target]({entry['plot']})", ""]
        if entry.get("global_batch", {}).get("rows"):
            lines += global_table(label, entry["global_batch"])
        validation = (entry["objectives"].get("time") or {}).get("validation")
        if validation:
            lines += validation_table(label, validation)
    spent = advice.get("spent", {})
    stages = ", ".join(f"{k} {v} s" for k, v in spent.get("seconds", {}).items())
    lines.append(f"Spent: {spent.get('wall_s')} s in all ({stages}).")
    return "\n".join(lines) + "\n"
