"""The README tables of a track: its records ranked by train time (with the speed-up over the
baseline) or by steps (with each record's pairwise statistic against the previous one), between
the track's markers in the main README and in the track's own README.md."""

import os
import re
from pathlib import Path

from records.logfile import read_regular_file
from records.record_files import (SHORT_TEXT_MAX, STATUS_RECORD, STATUS_TARGET, TEXT_MAX_BYTES, RecordError, fmt,
                                  iso_time)
from records.rules import FORMAT_WITH_IDENTITY, METRIC_STEPS, UNKNOWN
from records.series_stats import speedup
from records.significance import pairwise_statistic


def table_markers(track):
    return f"<!-- records:{track}:start -->", f"<!-- records:{track}:end -->"


def steps_rank(s):
    """A steps track's order: fewest steps first, then the lower mean final val loss."""
    return s["steps"], s["val_loss"]["mean"]


def made_order(s):
    """When a record was made, as its sealed logs tell: its date, then when the last of its runs
    started (from format 4 on; before, the time the tool was run)."""
    starts = [iso_time(run.get("started")) for run in s["runs"]]
    last = max(starts) if s["format"] >= FORMAT_WITH_IDENTITY and all(starts) else iso_time(s["made"])
    return s["date"], last


def previous_record(s, found):
    """The record that was the track's best (steps_rank) when `s` was made: among those made
    before it (made_order), or None for the first."""
    earlier = [t for _, t in found if made_order(t) < made_order(s)]
    return min(earlier, key=steps_rank) if earlier else None


def short_cpu(name):
    """A CPU model name without its trademarks and filler: 'Intel(R) Xeon(R) Processor' -> 'Intel Xeon'."""
    name = re.sub(r"\((R|TM|r|tm)\)|\bProcessor\b|\bCPU\b|@.*$|\d+-Core", " ", name)
    return " ".join(name.split()) or UNKNOWN


def machine_label(s):
    """The table's machine cell: the GPUs (count x model) or the CPU of the record's runs; from
    format 4 on "no bf16" for a CPU without bf16 units (its bf16 products ran as fp32 GEMMs)."""
    labels = []
    for run in s["runs"]:
        gpu = run.get("gpu", "none")
        if gpu not in ("none", UNKNOWN):
            names = [g.strip().removeprefix("NVIDIA ") for g in gpu.split(",")]
            label = f"{len(names)}x {names[0]}" if len(set(names)) == 1 else " + ".join(names)
        elif "cpu" in run:
            label = short_cpu(run["cpu"]) + (", no bf16" if run.get("bf16_gemm") == "fp32" else "")
        else:
            label = UNKNOWN
        labels.append(label)
    return " / ".join(dict.fromkeys(labels))


def changed_cell(s):
    """The table's what-changed cell: --changed, or the description cut to SHORT_TEXT_MAX characters."""
    text = s.get("changed") or " ".join((s["description"] or "").split()) or "-"
    text = text if len(text) <= SHORT_TEXT_MAX else text[:SHORT_TEXT_MAX - 1].rstrip() + "…"
    return cell(text.replace("|", "/"))


def cell(text):
    """Text as a table cell shows it: the characters markdown and HTML give meaning to (emphasis,
    code, links, tags, comments, entities, the cell's bar) escaped, line breaks as spaces."""
    text = re.sub(r"[\r\n]+", " ", str(text))
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([\\`*_\[\]|~])", r"\\\1", text)


def steps_table(found, link_base, definition):
    """A steps track's table: fewest steps first, each record's significance and its pairwise
    statistic against the previous record (previous_record)."""
    margin_rule = "z_margin" in definition
    significance = "(target - mean) x sqrt(n)" if margin_rule else "p"
    lines = [
        f"| # | record | what changed | machine | steps | val loss | {significance} | runs | pairwise vs previous |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ranked = sorted(found, key=lambda item: steps_rank(item[1]))
    for rank, (folder, s) in enumerate(ranked, start=1):
        link = Path(os.path.relpath(folder, link_base)).as_posix()
        value = fmt(s["margin_statistic"], ".4f") if margin_rule else fmt(s["p_value"], ".2g")
        old = previous_record(s, found)
        if old is None:
            pairwise = "first record"
        elif definition.get("loss_per_step") is None or definition.get("pairwise_margin") is None:
            pairwise = "n/a (track.json sets no loss_per_step and pairwise_margin)"
        else:
            stat = pairwise_statistic(s, old, definition["loss_per_step"])
            verdict = "significant" if stat >= definition["pairwise_margin"] else "not significant"
            pairwise = f"{stat:.4f} vs {cell(old['name'])} ({verdict} at {definition['pairwise_margin']})"
        lines.append(
            f"| {rank} | [{cell(s['name'])}]({link}) | {changed_cell(s)} | {cell(machine_label(s))} | {s['steps']} "
            f"| {s['val_loss']['mean']:.4f} | {value} | {s['n']} | {pairwise} |"
        )
    return "\n".join(lines)


def ranked_by_time(found):
    """The (folder, statistics) of records and the target, largest speed-up first, and the first
    record's mean train time (the speed-up of a record without its own baseline is over it)."""
    first_time = min(found, key=lambda item: made_order(item[1]))[1]["train_time_ms"]["mean"]
    return sorted(found, key=lambda item: -speedup(item[1], first_time)), first_time


def records_table(records, link_base, definition=None):
    """The markdown table of the (folder, statistics) `records` whose status is record or target,
    largest speed-up first (a steps track: steps_table); links are relative to link_base.
    definition: the track's track.json (default: a track ranked by train time)."""
    found = [(folder, s) for folder, s in records if s["status"] in (STATUS_RECORD, STATUS_TARGET)]
    if not found:
        return "_No records yet._"
    if definition and definition.get("metric") == METRIC_STEPS:
        return steps_table(found, link_base, definition)
    lines = [
        "| # | record | what changed | machine | val loss | p | train time | runs | speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ranked, first_time = ranked_by_time(found)
    for rank, (folder, s) in enumerate(ranked, start=1):
        link = Path(os.path.relpath(folder, link_base)).as_posix()
        p = "sets target" if s["status"] == STATUS_TARGET else fmt(s["p_value"], ".2g")
        lines.append(
            f"| {rank} | [{cell(s['name'])}]({link}) | {changed_cell(s)} | {cell(machine_label(s))} "
            f"| {s['val_loss']['mean']:.4f} | {p} | {s['train_time_s']['mean']:.1f} s | {s['n']} "
            f"| {speedup(s, first_time):.2f}x |"
        )
    return "\n".join(lines)


def current_record(records, definition):
    """The record a new one on a track ranked by train time must beat, as {record, mean_train_time_ms,
    speedup}: the best-ranked of status record (the target is the baseline itself), or None."""
    found = [(folder, s) for folder, s in records if s["status"] in (STATUS_RECORD, STATUS_TARGET)]
    if not found or definition.get("metric") == METRIC_STEPS:
        return None
    ranked, _ = ranked_by_time(found)
    best = next(((folder, s) for folder, s in ranked if s["status"] == STATUS_RECORD), None)
    if best is None:
        return None
    folder, s = best
    return {"record": folder.name, "mean_train_time_ms": s["train_time_ms"]["mean"],
            "speedup": s["baseline"]["speedup"] if s["baseline"] else None}


def with_table(readme, records, track, definition=None):
    """The text of `readme` with the track's table between its markers rebuilt from `records`, or None
    where the file has neither marker; a README with a marker twice, or one without the other after
    it, is refused (which pair would the table go between?). definition: the track's track.json."""
    start, end = table_markers(track)
    text = read_regular_file(readme, TEXT_MAX_BYTES).decode("utf-8") if readme.is_file() else ""
    i, j = text.find(start), text.find(end)
    if i < 0 and j < 0:
        return None
    if text.count(start) > 1 or text.count(end) > 1 or i < 0 or j < i:
        raise RecordError(f"{readme}: holds '{start}' {text.count(start)} time(s) and '{end}' {text.count(end)} "
                          f"time(s), the end after the start {'once' if 0 <= i < j else 'never'}: keep one pair, where "
                          "the table goes (this tool rewrites what lies between them)")
    table = records_table(records, readme.resolve().parent, definition)
    return text[: i + len(start)] + "\n" + table + "\n" + text[j:]


def missing_markers_warning(readme, track):
    start, end = table_markers(track)
    return (f"warning: {readme} has no '{start}' ... '{end}' markers; "
            f"add both where the {track} table should go and run this tool again to fill it")


def table_files(args, track_dir, track, records):
    """{README path: its new text} of the READMEs holding the track's markers, and the warnings."""
    files, notes = {}, []
    for readme in (args.readme, track_dir / "README.md"):
        text = with_table(readme, records, args.track, track)
        if text is not None:
            files[readme] = text
        elif readme == args.readme:
            notes.append(missing_markers_warning(readme, args.track))
    return files, notes
