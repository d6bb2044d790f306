"""What a record folder holds and how its runs are found: the files besides the logs, the
statuses a record can have, reading and verifying a log (records/logfile.py), the runs already in
the records of every track (a run counts once), and the baseline logs a new record references."""

import datetime
import json
import re
from pathlib import Path

from machinery.errors import UserError
from records.logfile import LogError, parse_log, read_regular_file, verify

LOG_NAME = re.compile(r"(?P<run_id>[A-Za-z0-9][A-Za-z0-9_-]*)\.txt")  # a log's file name: <run id>.txt
DATE_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")  # --date, the prefix of the record folder's name
SHORT_TEXT_MAX = 60  # characters of --changed and --author, which go into table cells
MS_PER_S = 1000.0  # logs count train time in ms; tables show seconds
STATUS_RECORD = "record"  # met the target at the track's significance level (and beat the current record)
STATUS_TARGET = "target"  # the record that set the track's target
STATUS_NOT_RECORD = "not a record"  # written only with --allow-non-record; never in the README table
STATUS_BASELINE = "baseline"  # the baseline re-measured on another machine (--remeasured-baseline); not in the table
PLOT_NAME = "val_loss.png"  # the record's loss-curve plot
PLOT_SIZE = (800, 500)  # its width and height in pixels (write_plot's figure size at its dpi)
RECORD_FILES = ("README.md", "statistics.json", "statistics.txt", PLOT_NAME)  # besides the logs
STATISTICS_FORMAT = 4  # what this tool writes
METADATA_KEYS = ("format", "track", "name", "date", "made", "description")  # statistics.json's command-line values
REASON_KEYS = ("mixed_machines_reason", "mixed_commits_reason")  # also from the command line, format 3 on
TEXT_MAX_BYTES = 16 * 2**20  # a README, track.json or a record's file other than its logs is read up to this size


class RecordError(UserError):
    """A refusal: the message says what is wrong with the inputs."""


def read_log(path):
    """Parse and verify the log at `path`, a regular file named <run id>.txt (what the log says is
    checked by the rules, records/rules.py)."""
    name = Path(path).name
    m = LOG_NAME.fullmatch(name)
    if m is None:
        raise RecordError(f"{path}: a log's file name is its run id and .txt (letters, digits, '-', '_'; it names "
                          f"a file of the record and goes into its README's commands): rename it")
    try:
        log = parse_log(path)
        verify(log)
    except LogError as e:
        raise RecordError(str(e)) from None
    if name in RECORD_FILES:
        raise RecordError(f"{path}: a log may not be named like a record file ({', '.join(RECORD_FILES)})")
    if m["run_id"] != log.run_id:
        raise RecordError(f"{path}: holds run {log.run_id}, so its name is {log.run_id}.txt (a log is named by its "
                          f"run id): rename it")
    return log


def refuse_same_names(logs):
    """Refuse two logs with one run id (which is their file name) and a log named like a record file."""
    seen = {}
    for log in logs:
        if log.run_id in seen:
            raise RecordError(f"{log.path} and {seen[log.run_id]} have the same run id {log.run_id!r}")
        seen[log.run_id] = log.path


def recorded_runs(records_dir):
    """{run id: [record folders]} of every run in any record of any track (the logs inside record
    folders; hidden folders, being built or left by a killed make_record.py, left out)."""
    found = {}
    for log_path in sorted(records_dir.glob("*/*/*.txt")):
        if log_path.parent.name.startswith(".") or not log_path.is_file():
            continue
        with open(log_path, "rb") as f:
            first = f.readline(200)
        m = re.fullmatch(rb"speedrun-log v\d+ run_id=(\S+)\n?", first)
        if m:
            found.setdefault(m[1].decode("ascii", errors="replace"), []).append(log_path.parent)
    return found


def refuse_runs_in_two_records(recorded):
    """A run counts once: no two record folders hold the same run (a folder copied under a new name)."""
    for run_id, folders in recorded.items():
        if len(folders) > 1:
            raise RecordError(f"run {run_id} is part of two records, {folders[0]} and {folders[1]}: a run counts "
                              f"once; remove the copy")


def superseded_folders(logs, recorded, records):
    """The record folders the new record takes its runs from: a run already in a record is refused,
    unless that folder is "not a record" (kept with --allow-non-record), no record of the track
    uses it as its baseline, and every one of its runs is among `logs`; then the new record
    replaces it. `records`: the track's checked (folder, statistics)."""
    statistics = {folder.resolve(): s for folder, s in records}
    given = {log.run_id for log in logs}
    taken = []
    for log in logs:
        for folder in recorded.get(log.run_id, []):
            s = statistics.get(folder.resolve())
            if s is None or s["status"] != STATUS_NOT_RECORD:
                raise RecordError(f"{log.path}: run {log.run_id} is already part of the record {folder}; "
                                  f"a run counts once")
            users = [f.name for f, other in records if other["baseline"] and any(
                Path(p).parent.name == folder.name for p in other["baseline"]["logs"])]
            if users:
                raise RecordError(f"{log.path}: run {log.run_id} is part of {folder}, which the record {users[0]} "
                                  f"uses as its baseline: a run counts once")
            held = s["runs"] + (((s.get("current_record") or {}).get("reruns") or {}).get("runs") or [])
            missing = [run["run_id"] for run in held if run["run_id"] not in given]
            if missing:
                raise RecordError(f"{log.path}: run {log.run_id} is part of {folder} (not a record), with "
                                  f"{', '.join(missing)}: give all of its runs to make them a record, which then "
                                  f"replaces it")
            if folder not in taken:
                taken.append(folder)
    return taken


def expand_record_folders(paths, track_dir):
    """Replace each record folder in `paths` by the logs of its runs (listed in its statistics.json);
    every baseline log must be one of the runs of a record folder of this track, which the new
    record then references."""
    expanded = []
    for path in map(Path, paths):
        if path.is_dir():
            try:
                runs = json.loads(read_regular_file(path / "statistics.json", TEXT_MAX_BYTES).decode("utf-8"))["runs"]
                expanded += [str(path / run["log"]) for run in runs]
            except (OSError, ValueError, KeyError, TypeError):
                raise RecordError(f"{path}: a folder given as baseline logs must be a record folder "
                                  f"(its statistics.json lists each run's log)") from None
        else:
            expanded.append(str(path))
    for path in expanded:
        folder = Path(path).resolve().parent
        if folder.parent != track_dir.resolve() or not listed_in_record(folder, Path(path).name):
            raise RecordError(f"{path}: baseline logs are referenced, not copied, so they must be runs of a record "
                              f"of this track ({track_dir}/<record>/); make one of them first (--remeasured-baseline "
                              f"for the track's baseline runs)")
    return expanded


def listed_in_record(folder, name):
    """Whether the record folder's statistics.json lists the log file `name` among its runs."""
    try:
        runs = json.loads(read_regular_file(folder / "statistics.json", TEXT_MAX_BYTES).decode("utf-8"))["runs"]
        return any(isinstance(run, dict) and run.get("log") == name for run in runs)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def iso_time(text):
    """The time an ISO 8601 string with an offset names, or None."""
    try:
        when = datetime.datetime.fromisoformat(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return when if when is not None and when.tzinfo is not None else None


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)
