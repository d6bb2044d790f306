"""The records already made, checked before a table is built from them: each folder's
statistics.json recomputed from its sealed logs by the same rules (all but the made-only ones) and
compared value for value, its README.md and statistics.txt with what records/record_writer.py
writes, and the folder holding nothing else."""

import json
import math
import os
import struct
from pathlib import Path

from records import rules
from records.logfile import read_regular_file
from records.readme_tables import made_order
from records.record_files import (DATE_PATTERN, METADATA_KEYS, PLOT_NAME, PLOT_SIZE, REASON_KEYS, RECORD_FILES,
                                  STATUS_BASELINE, STATUS_RECORD, STATUS_TARGET, TEXT_MAX_BYTES, RecordError, iso_time,
                                  read_log, recorded_runs, refuse_runs_in_two_records)
from records.record_writer import readme_text, statistics_text
from records.rules import FORMAT_WITH_IDENTITY, FORMAT_WITH_MACHINES, RuleError, Series, started_at
from records.series_stats import record_statistics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # the first bytes of a PNG file, then its IHDR chunk
READ_FORMATS = (2, 3, 4)  # the statistics.json formats this tool recomputes and checks
CREDIT_KEYS = ("author", "changed")  # also from the command line, format 4 on


def read_statistics(path):
    """A record's statistics.json, with the values needed to recompute it checked for their types."""
    try:
        s = json.loads(read_regular_file(path, TEXT_MAX_BYTES).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON ({e}); restore what make_record.py wrote, or re-make the record") \
            from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text; restore what make_record.py wrote, or re-make the record") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read it ({e.strerror})") from None
    shape_error = statistics_shape_error(s)
    if shape_error:
        raise RecordError(f"{path}: not the statistics make_record.py writes ({shape_error})")
    return s


def statistics_shape_error(s):
    """What keeps `s` from being recomputed (a missing key, a wrong type), or None."""
    if not isinstance(s, dict):
        return "not a JSON object"
    if s.get("format") not in READ_FORMATS:
        return f"format {s.get('format')!r}; this tool reads formats {', '.join(map(str, READ_FORMATS))}"
    keys = (METADATA_KEYS + ("status",) + (REASON_KEYS if s["format"] >= FORMAT_WITH_MACHINES else ())
            + (CREDIT_KEYS + ("current_record",) if s["format"] >= FORMAT_WITH_IDENTITY else ()))
    missing = [key for key in keys + ("runs", "baseline") if key not in s]
    if missing:
        return f"no {', '.join(missing)}"
    for key in ("track", "name", "description", "status"):
        if not isinstance(s[key], str):
            return f"{key} is not text"
    if not isinstance(s["date"], str) or not DATE_PATTERN.fullmatch(s["date"]):
        return "date is not YYYY-MM-DD"
    if iso_time(s["made"]) is None:
        return f"made is {json.dumps(s['made'])[:40]}, not a time with its offset (ISO 8601)"
    for key in REASON_KEYS + CREDIT_KEYS:
        if key in s and s[key] is not None and not isinstance(s[key], str):
            return f"{key} is neither null nor text"
    runs, baseline = s["runs"], s["baseline"]
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and isinstance(r.get("log"), str)
                                                          for r in runs):
        return "runs is not a list of runs with their log files"
    if baseline is not None and not (isinstance(baseline, dict) and isinstance(baseline.get("logs"), list)
                                     and all(isinstance(p, str) for p in baseline["logs"])):
        return "baseline is neither null nor a group with its logs"
    current = s.get("current_record")
    if current is not None and not (isinstance(current, dict) and isinstance(current.get("record"), str)
                                    and is_number_or_none(current.get("speedup"))
                                    and is_number_or_none(current.get("mean_train_time_ms"))
                                    and (current.get("reruns") is None or rerun_logs_listed(current["reruns"]))):
        return "current_record is neither null nor the current record with its re-runs"
    return None


def is_number_or_none(value):
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value))


def rerun_logs_listed(group):
    return (isinstance(group, dict) and isinstance(group.get("runs"), list) and group["runs"]
            and all(isinstance(r, dict) and isinstance(r.get("log"), str) for r in group["runs"]))


def rerun_log_names(s):
    """The log files of the current record's re-runs that the record holds (format 4 on)."""
    reruns = (s.get("current_record") or {}).get("reruns")
    return [run["log"] for run in reruns["runs"]] if reruns else []


def record_folder_logs(folder, s):
    """The record's logs in the order its statistics list them, and its re-runs of the current
    record; the folder must hold exactly those logs and the files this tool writes."""
    listed = [run["log"] for run in s["runs"]] + rerun_log_names(s)
    present = sorted(p.name for p in folder.iterdir() if p.name not in RECORD_FILES)
    if sorted(listed) != present:
        raise RecordError(f"{folder / 'statistics.json'}: lists the logs {', '.join(listed)}, but the folder holds "
                          f"{', '.join(present) or 'none'} beside {', '.join(RECORD_FILES)}: a record folder holds "
                          f"its logs and what make_record.py writes, nothing else")
    logs = [read_log(folder / name) for name in listed]
    return logs[:len(s["runs"])], logs[len(s["runs"]):]


def recomputed_statistics(folder, s, track, repo_root):
    """What make_record.py writes for the record in `folder`, recomputed from its sealed logs (and its
    baseline's), with the command-line values (METADATA_KEYS, REASON_KEYS, CREDIT_KEYS), the status
    flags and the current record it was compared with taken from `s`; its series checked by the
    rules (rules.check) first."""
    statistics_format = s["format"]
    logs, reruns = record_folder_logs(folder, s)
    baseline_logs = [read_log(repo_root / path) for path in s["baseline"]["logs"]] if s["baseline"] else []
    given = {key: s[key] for key in METADATA_KEYS}
    if statistics_format >= FORMAT_WITH_MACHINES:
        given |= {key: s[key] for key in REASON_KEYS}
    current = None
    if statistics_format >= FORMAT_WITH_IDENTITY:
        given |= {key: s[key] for key in CREDIT_KEYS}
        if s["current_record"]:
            current = {key: s["current_record"].get(key) for key in ("record", "mean_train_time_ms", "speedup")}
    rules.check(Series(logs, track, baseline_logs, reruns, current and first_log_of(folder.parent / current["record"]),
                       current["record"] if current else "", statistics_format=statistics_format,
                       machines_reason=s.get("mixed_machines_reason"), commits_reason=s.get("mixed_commits_reason"),
                       runs_are_baseline=s["status"] in (STATUS_TARGET, STATUS_BASELINE)))
    computed = record_statistics(logs, baseline_logs, track, s["status"] == STATUS_TARGET, repo_root,
                                 s["status"] == STATUS_BASELINE, statistics_format, current, reruns)
    return json.loads(json.dumps({**given, **computed})), logs + reruns


def first_log_of(folder):
    """The first run's log of the record in `folder`, or None where it has none."""
    try:
        return read_log(folder / read_statistics(folder / "statistics.json")["runs"][0]["log"])
    except RecordError:
        return None


def first_difference(stored, expected, where=""):
    """Where two JSON values first differ ('val_loss.mean is 3.0, recomputed 5.68'), or None.
    Numbers compare exactly, as json writes and reads them back (int and float apart)."""
    if isinstance(stored, dict) and isinstance(expected, dict):
        for key in [*expected, *(k for k in stored if k not in expected)]:
            if key not in stored:
                return f"{where}{key} is missing"
            if key not in expected:
                return f"{where}{key} is not a value make_record.py writes"
            difference = first_difference(stored[key], expected[key], f"{where}{key}.")
            if difference:
                return difference
        return None
    if isinstance(stored, list) and isinstance(expected, list) and len(stored) == len(expected):
        for i, (a, b) in enumerate(zip(stored, expected)):
            difference = first_difference(a, b, f"{where.rstrip('.')}[{i}].")
            if difference:
                return difference
        return None
    if type(stored) is not type(expected) or stored != expected:
        return f"{where.rstrip('.')} is {json.dumps(stored)}, recomputed {json.dumps(expected)}"
    return None


def png_size(path):
    """(width, height) of the PNG file at `path`, or None when it is not one."""
    try:
        head = read_regular_file(path, TEXT_MAX_BYTES)[:24]
    except OSError:
        return None
    if len(head) < 24 or head[:8] != PNG_SIGNATURE or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def check_record_files(folder, s, repo_root):
    """The files make_record.py writes beside the statistics are what it writes from them: README.md
    and statistics.txt byte for byte, the plot a PNG of its size (its bytes depend on the plotting
    library's version)."""
    folder_rel = Path(os.path.relpath(folder, repo_root)).as_posix()
    expected = {"README.md": readme_text(s, folder_rel, s["runs"][0]["log"]), "statistics.txt": statistics_text(s)}
    for name, text in expected.items():
        try:
            same = read_regular_file(folder / name, TEXT_MAX_BYTES) == text.encode("utf-8")
        except OSError:
            same = False
        if not same:
            raise RecordError(f"{folder / name}: is not what make_record.py writes from the record's statistics "
                              f"(edited by hand?): restore it, or re-make the record (--remake {folder})")
    if png_size(folder / PLOT_NAME) != PLOT_SIZE:
        raise RecordError(f"{folder / PLOT_NAME}: is not the {PLOT_SIZE[0]}x{PLOT_SIZE[1]} PNG make_record.py "
                          f"draws: restore it, or re-make the record (--remake {folder})")


def check_record(folder, s, track, repo_root):
    """Refuse a record whose statistics.json is not what its logs give, that is not the track's, or
    whose other files are not what this tool writes; its logs (and re-runs)."""
    path = folder / "statistics.json"
    if s["track"] != track["name"] or folder.name != f"{s['date']}_{s['name']}":
        raise RecordError(f"{path}: names the record {s['track']}/{s['date']}_{s['name']}, but lies in "
                          f"{folder.parent.name}/{folder.name}")
    expected, logs = recomputed_statistics(folder, s, track, repo_root)
    difference = first_difference(s, expected)
    if difference:
        raise RecordError(f"{path}: {difference} from the record's logs (and track.json): the file is not what "
                          "make_record.py wrote; restore it, or re-make the record")
    if s["status"] == STATUS_TARGET and s["target_val_loss"] != track["target_val_loss"]:
        raise RecordError(f"{path}: sets the target {s['target_val_loss']!r}, but the track's target_val_loss is "
                          f"{track['target_val_loss']!r}")
    last_start = max(filter(None, map(started_at, logs)), default=None)
    if last_start is not None and iso_time(s["made"]) < last_start:
        raise RecordError(f"{path}: made {s['made']} is before its last run started ({last_start.isoformat()}): the "
                          f"file is not what make_record.py wrote; restore it, or re-make the record")
    check_record_files(folder, s, repo_root)
    return logs


def check_current_record_references(found):
    """Each record compared with a current record names one of the track's records, with its mean
    train time and speed-up as that record's statistics give them."""
    by_name = {folder.name: s for folder, s in found}
    for folder, s in found:
        current = s.get("current_record")
        if not current:
            continue
        other = by_name.get(current["record"])
        values = None if other is None else (other["train_time_ms"]["mean"],
                                             other["baseline"]["speedup"] if other["baseline"] else None)
        if values != (current["mean_train_time_ms"], current["speedup"]):
            raise RecordError(f"{folder / 'statistics.json'}: its current_record ({current['record']}) is not a "
                              f"record of the track with these values: restore the file, or re-make the record")


def checked_track_records(track_dir, track, repo_root):
    """(folder, statistics) of every record of the track (its folders holding a statistics.json), each
    checked against its logs (check_record), no run in two records of any track, each record of the
    table a program none made before it ran (rules.new_program_refusal)."""
    refuse_runs_in_two_records(recorded_runs(track_dir.parent))
    found, first_logs = [], {}
    for path in sorted(track_dir.glob("*/statistics.json")):
        if path.parent.name.startswith("."):  # a folder being built, or left by a killed make_record.py
            continue
        s = read_statistics(path)
        logs = check_record(path.parent, s, track, repo_root)
        found.append((path.parent, s))
        first_logs[path.parent.name] = logs[0]
    check_current_record_references(found)
    table = sorted((item for item in found if item[1]["status"] in (STATUS_RECORD, STATUS_TARGET)),
                   key=lambda item: made_order(item[1]))
    for i, (folder, _) in enumerate(table):
        earlier = [(f.name, first_logs[f.name]) for f, _ in table[:i]]
        refusal = rules.new_program_refusal(first_logs[folder.name], earlier)
        if refusal:
            raise RuleError(refusal)
    return found
