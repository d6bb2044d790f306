"""Turn the logs of N runs into a record folder and update the README's table for the track.

    python records/make_record.py --track track_cpu --name MyChange --logs logs/a.txt logs/b.txt logs/c.txt \
        [--baseline-logs ...] [--current-record-logs ...] [--description "what changed, in full"] \
        [--changed "what changed, in a few words"] [--author NAME] [--date YYYY-MM-DD] \
        [--mixed-machines-reason "why"] [--mixed-commits-reason "why"]
    python records/make_record.py --track track_cpu --remake records/track_cpu/<record> [--changed ...] [--author ...]
    python records/make_record.py --track track_cpu --tables

Every log is parsed and verified (records/logfile.py): it must be a regular file named
<run id>.txt, sealed (format version 2) with every line matching its seal, each embedded source
must match its declared sha256, every run must have finished, from a tree whose files are its
commit's (a git_commit without the "-dirty" mark), and the track's rules hold: the config names
the track, the run trained on the track's train data and evaluated on its val data (by
fingerprint) and val_tokens, on the track's hardware; all logs come from the same code (the same
set of (path, sha256) pairs) and the same config apart from the seed; every run (the baseline's
and the current record's re-runs too) ran on one machine (the environment's `cpu` and `hostname`,
and from format 4 on its core count, CPU flags and machine id) and every run at one commit
(`git_commit`), unless --mixed-machines-reason / --mixed-commits-reason says why not; --date is
neither before a run started nor in the future; no run id is already part of a record. Baseline
logs must be the track's baseline script with its config (track.json "baseline") where the track
defines one, agree among themselves and be part of a record folder of the track already (they are
referenced, not copied). Every other record of the track must still be what its logs give: its
statistics.json is recomputed from its sealed logs and compared, value for value, its README.md
and statistics.txt with what this tool writes from them, and the folder holds nothing else,
before any table is built from it. Any refusal prints one line and exits with code 2 before
anything is written; a refused result's line carries its statistics and what would change them.

One make_record.py at a time writes a records root: each takes its lock (waiting up to
LOCK_WAIT_S for another) before it reads the records and keeps it until it has written.

The tables are rewritten in the main README (--readme) and in the track's own README.md where
it holds the track's markers (records/FORMAT.md, "The README tables"). Nothing is visible before
every check has passed: the record folder is built in a hidden folder next to its destination,
the README tables (and track.json, with --set-target-from-these-logs) in temporary files next to
theirs; then the folder is renamed into place and each temporary file renamed over its
destination.

The record folder records/<track>/<date>_<name>/ holds the logs (and the current record's re-runs)
and what this tool computes from them: statistics.json and statistics.txt, val_loss.png and a
README, which names the author, what changed, the machine and the commit the runs ran on. A log
is its run's snapshot (records/reproduce.py recreates the sources from it). The statistics: n,
mean and sample std of the final val loss, a one-sided one-sample t-test of H1 "mean < target",
train time summaries, and with baseline logs one-sided Welch t-tests of H1 "record < baseline" on
final val loss and on train time, plus the speed-up of mean train times; with the current
record's re-runs the Welch test of the train time against them.

A result is a record when it has at least the track's min_runs runs and p < p_threshold, and on
a track ranked by train time when it is faster than the current record (decide_status): on a
track that defines its baseline (track_cpu) significantly faster than its interleaved baseline
runs, significantly faster than the current record's re-runs of the same series, and with a
speed-up over its baseline above the current record's. Anything else is refused unless
--allow-non-record is given, which writes the folder marked "not a record" (kept out of the
README table); such a folder gives its runs up to a later record made with all of them, which
replaces it. A track whose target is still null (the CPU track before its baseline) needs
--set-target-from-these-logs: the mean final val loss of these logs becomes the target in
track.json, and the record is marked as the one that set it. --remeasured-baseline keeps the
track's baseline runs on another machine (status "baseline", not in the table) for the records
made there.

A track whose track.json says "metric": "steps" (the optimization tracks) ranks its records by
the steps their runs trained, fewest first; a run that changes a value of the track's
fixed_config (its model, data, batch, validation) is refused; with z_margin the public
optimization track's rule decides a record, (target - mean) x sqrt(n) >= z_margin, else the
t-test; its table gives each record's pairwise statistic against the previous record (ordered
by date, then by when its runs started).

--remake rebuilds an existing record folder from its own logs with this tool's files (the same
numbers and status; --changed and --author may be given); --tables rebuilds the track's tables.
"""

import argparse
import contextlib
import datetime
import errno
import fcntl
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import stat
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RECORDS_DIR = Path(__file__).resolve().parent  # default root of the track folders
sys.path.insert(0, str(RECORDS_DIR.parent))
from errors import UserError  # noqa: E402
from records.logfile import DIRTY_MARK, LogError, parse_log, read_regular_file, verify  # noqa: E402
from records.significance import (margin_statistic, one_sample_test, pairwise_statistic, runs_needed,  # noqa: E402
                                  summary, val_loss_summary, welch_runs_needed, welch_test)

EXIT_REFUSED = 2  # exit code of every refusal
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # record and track names become folder names
LOG_NAME = re.compile(r"(?P<run_id>[A-Za-z0-9][A-Za-z0-9_-]*)\.txt")  # a log's file name: <run id>.txt
DATE_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")  # --date, the prefix of the record folder's name
SHORT_TEXT_MAX = 60  # characters of --changed and --author, which go into table cells
MS_PER_S = 1000.0  # logs count train time in ms; tables show seconds
STATUS_RECORD = "record"  # met the target at the track's significance level (and beat the current record)
STATUS_TARGET = "target"  # the record that set the track's target
STATUS_NOT_RECORD = "not a record"  # written only with --allow-non-record; never in the README table
STATUS_BASELINE = "baseline"  # the baseline re-measured on another machine (--remeasured-baseline); not in the table
PLOT_NAME = "val_loss.png"  # the record's loss-curve plot
RECORD_FOLDER_MODE = 0o755  # a record folder's permissions
PLOT_SIZE = (800, 500)  # its width and height in pixels (write_plot's figure size at its dpi)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"  # the first bytes of a PNG file, then its IHDR chunk
RECORD_FILES = ("README.md", "statistics.json", "statistics.txt", PLOT_NAME)  # besides the logs
FREE_CONFIG_KEYS = ("seed", "log_dir")  # the only config values the runs of one record may differ in
FINGERPRINT_KEYS = ("bytes", "tokens", "header_sha256", "head_sha256", "tail_sha256")  # a data file's identity
TRAIN_LOSS_SMOOTHING = 0.8  # EMA weight of the plotted train loss curve
STATISTICS_FORMAT = 4  # what this tool writes
READ_FORMATS = (2, 3, 4)  # the statistics.json formats this tool recomputes and checks
FORMAT_WITH_MACHINES = 3  # the first format whose statistics name each run's machine and commit
FORMAT_WITH_IDENTITY = 4  # the first with each run's machine identity and start, author, what changed, current record
MACHINE_KEYS = ("cpu", "hostname")  # the environment lines that name the machine a run ran on
IDENTITY_KEYS = ("cpu_count", "cpu_flags", "machine_id")  # from format 4 on: what tells machines of one name apart
RUN_KEYS = ("gpu", "bf16_gemm", "started")  # from format 4 on: more of each run's environment in its row
COMMIT_KEY = "git_commit"  # the environment line that names the commit a run ran at
UNKNOWN = "unknown"  # a machine or commit value of a log whose environment lacks the line
METADATA_KEYS = ("format", "track", "name", "date", "made", "description")  # statistics.json's command-line values
REASON_KEYS = ("mixed_machines_reason", "mixed_commits_reason")  # also from the command line, format 3 on
CREDIT_KEYS = ("author", "changed")  # also from the command line, format 4 on
METRIC_STEPS = "steps"  # track.json "metric" of a track ranked by steps (fewest first) instead of train time
LOCK_WAIT_S = 120.0  # how long make_record.py waits for another one holding the records root's lock
LOCK_POLL_S = 0.1  # how often it tries meanwhile


class RecordError(UserError):
    """A refusal: the message says what is wrong with the inputs."""


# ----------------------------------------------------------------------------- reading logs


def check_hardware(log, required):
    """Refuse a log whose environment does not fully match the track's required_environment regexes."""
    for key, pattern in required.items():
        value = log.environment.get(key, "")
        if not re.fullmatch(pattern, value):
            raise RecordError(
                f"{log.path}: environment {key} is {value!r}, the track requires /{pattern}/ "
                "(runs on other hardware belong in bench/, not in this track)"
            )


def data_read(log, pattern_key):
    """The data fingerprints of the log whose paths match its config's pattern `pattern_key`."""
    pattern = log.config.get(pattern_key)
    return [fp for fp in log.data if isinstance(pattern, str) and fnmatch.fnmatch(fp["path"], pattern)]


def data_identity(fingerprints):
    """The distinct (bytes, tokens, hashes) of the fingerprints, in order: what the data is, not where."""
    return list(dict.fromkeys(tuple(fp.get(k) for k in FINGERPRINT_KEYS) for fp in fingerprints))


def check_data(log, track):
    """The run trained on the track's train data and evaluated like every run of the track: on
    val_tokens of its val data (each compared by size and content hashes, where the track names it)."""
    if "val_tokens" in track and log.config.get("val_tokens") != track["val_tokens"]:
        raise RecordError(f"{log.path}: the run validated on val_tokens={log.config.get('val_tokens')}, "
                          f"the track evaluates on {track['val_tokens']}")
    for pattern_key, track_key, what in (("val_files", "val_data", "val"), ("train_files", "train_data", "train")):
        required = track.get(track_key)
        if not required:
            continue
        used = data_read(log, pattern_key)
        if data_identity(used) != data_identity(required):
            names = ", ".join(dict.fromkeys(fp["path"] for fp in used)) or "none"
            raise RecordError(f"{log.path}: the run's {what} data ({names}) is not the track's {what} data "
                              f"({', '.join(fp['path'] for fp in required)}, by size and content hashes)")


def read_log(path):
    """Parse and verify the log at `path` (a regular file named <run id>.txt); refuse an unsealed
    log and an unfinished run."""
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
    if not log.sealed:
        raise RecordError(f"{path}: a version-{log.version} log is not sealed; records are made from sealed "
                          f"logs (this repository's trainer writes them): rerun the run")
    if not log.finished:
        raise RecordError(f"{path}: the run {log.describe_ending()}; only finished runs make a record")
    return log


def check_fixed_config(log, fixed):
    """Refuse a run whose config differs from the track's fixed_config: the setup an entry may not
    change. A key the run's config lacks came after its code, whose behaviour is the key's default:
    the value a track fixes for a key it adds (a log's config replays with the defaults of the keys
    it lacks)."""
    for key, value in fixed.items():
        if key in log.config and log.config[key] != value:
            raise RecordError(f"{log.path}: the run's config changes {key}, which the track fixes (track.json "
                              "fixed_config): an entry may change the optimizer and its schedule, not the setup")


def check_baseline_run(log, baseline):
    """A run of the track's baseline: its script (track.json baseline.entry) in one of the versions
    baseline.entry_sha256 lists, with the baseline's config (baseline.config, free keys aside)."""
    entry = log.config.get("entry")
    if entry != baseline["entry"]:
        raise RecordError(f"{log.path}: runs {entry}, not the track's baseline script {baseline['entry']} "
                          f"(track.json baseline): baseline runs run the baseline")
    sha = log.declared_sha256.get(entry)
    if sha not in baseline["entry_sha256"]:
        raise RecordError(f"{log.path}: its {entry} has sha256 {sha}, which is not a version of the track's "
                          f"baseline script (track.json baseline.entry_sha256 lists them): run the baseline as it is")
    changed = sorted(k for k in set(free_config(log)) | set(baseline["config"])
                     if log.config.get(k) != baseline["config"].get(k))
    if changed:
        raise RecordError(f"{log.path}: the baseline run changes {', '.join(changed)} of the baseline's config "
                          f"(track.json baseline.config): run the baseline as it is")


def load_logs(paths, track, role, required_environment=None, fixed_config=None):
    """Read `paths` (read_log); refuse other tracks' runs, other hardware, data or fixed config,
    and mixed code or configs."""
    logs = []
    for path in paths:
        log = read_log(path)
        if log.config.get("track") != track["name"]:
            raise RecordError(f"{path}: the run's config says track {log.config.get('track')!r}, not {track['name']!r}")
        check_hardware(log, required_environment or {})
        check_fixed_config(log, fixed_config or {})
        check_data(log, track)
        logs.append(log)
    for other in logs[1:]:
        if other.code_id != logs[0].code_id:
            raise RecordError(f"{role} logs come from different code: {describe_code_difference(logs[0], other)}")
        if free_config(other) != free_config(logs[0]):
            raise RecordError(f"{role} logs ran different configs: {describe_config_difference(logs[0], other)}")
    return logs


def refuse_same_names(logs):
    """Refuse two logs with one run id (which is their file name) and a log named like a record file."""
    seen = {}
    for log in logs:
        if log.run_id in seen:
            raise RecordError(f"{log.path} and {seen[log.run_id]} have the same run id {log.run_id!r}")
        seen[log.run_id] = log.path


def free_config(log):
    """The config without the values runs of one record may differ in (FREE_CONFIG_KEYS)."""
    return {k: v for k, v in log.config.items() if k not in FREE_CONFIG_KEYS}


def describe_config_difference(a, b):
    keys = sorted(k for k in set(free_config(a)) | set(free_config(b)) if a.config.get(k) != b.config.get(k))
    return f"{a.path} and {b.path} differ in {', '.join(keys)} (only {', '.join(FREE_CONFIG_KEYS)} may differ)"


def describe_code_difference(a, b):
    """One line naming the source files whose hashes differ between logs a and b."""
    differing = sorted(
        path
        for path in set(a.declared_sha256) | set(b.declared_sha256)
        if a.declared_sha256.get(path) != b.declared_sha256.get(path)
    )
    return f"{a.path} and {b.path} differ in {', '.join(differing)}"


def started_at(log):
    """When the run started (its environment's `started`, with its offset), or None."""
    try:
        when = datetime.datetime.fromisoformat(log.environment.get("started", ""))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def check_date(date, logs, today):
    """--date is a record's day: not before any of its runs started (their own dates), not after today."""
    if date > today.isoformat():
        raise RecordError(f"--date {date} is in the future (today is {today.isoformat()}): give the day the record "
                          f"is made, or leave --date out")
    for log in logs:
        when = started_at(log)
        if when is None:
            raise RecordError(f"{log.path}: its environment has no start time (started: "
                              f"{log.environment.get('started')!r}), so the record's date cannot be checked")
        if date < when.date().isoformat():
            raise RecordError(f"--date {date} is before the run {log.run_id} started ({when.date().isoformat()}): "
                              f"a record's date is the day it is made, after its runs")


def refuse_dirty_trees(logs):
    """A run from a tree with uncommitted changes (git_commit marked DIRTY_MARK) names a commit whose
    files are not the code it ran: the record could not say which commit holds it."""
    for log in logs:
        if commit_of(log).endswith(DIRTY_MARK):
            raise RecordError(f"{log.path}: ran from a tree with uncommitted changes ({COMMIT_KEY} {commit_of(log)}): "
                              f"commit the change, then rerun from the clean tree (a clone at that commit)")


# ----------------------------------------------------------------------------- machines and commits


def machine_of(log, statistics_format=STATISTICS_FORMAT):
    """The machine a run ran on: {cpu, hostname} from its environment, from format 4 on with its core
    count, CPU flags and machine id."""
    keys = MACHINE_KEYS + (IDENTITY_KEYS if statistics_format >= FORMAT_WITH_IDENTITY else ())
    return {key: log.environment.get(key, UNKNOWN) for key in keys}


def commit_of(log):
    return log.environment.get(COMMIT_KEY, UNKNOWN)


def describe_machine(machine):
    return ", ".join(f"{key} {value!r}" for key, value in machine.items())


def check_one_machine(logs, reason, statistics_format=STATISTICS_FORMAT):
    """Refuse runs (the baseline's and the re-runs included) from more than one machine unless
    `reason` says why; refuse a reason where every run ran on one machine."""
    runs = list(logs)
    first = machine_of(runs[0], statistics_format)
    other = next((log for log in runs if machine_of(log, statistics_format) != first), None)
    if other is not None and not reason:
        theirs = machine_of(other, statistics_format)
        keys = [key for key in first if first[key] != theirs[key]]
        raise RecordError(
            f"{runs[0].path} ran on {describe_machine({k: first[k] for k in keys})}, {other.path} on "
            f"{describe_machine({k: theirs[k] for k in keys})}: a record's runs and its baseline's run on one machine "
            '(--mixed-machines-reason "why" makes the record anyway and states the reason)'
        )
    if other is None and reason is not None:
        raise RecordError(f"--mixed-machines-reason is given, but every run ran on {describe_machine(first)}")


def check_one_commit(logs, reason):
    """Refuse runs at more than one commit unless `reason` says why; refuse a reason where they ran at one."""
    other = next((log for log in logs if commit_of(log) != commit_of(logs[0])), None)
    if other is not None and not reason:
        raise RecordError(
            f"{logs[0].path} ran at {COMMIT_KEY} {commit_of(logs[0])}, {other.path} at {commit_of(other)}: "
            'a record\'s runs run at one commit (--mixed-commits-reason "why" makes the record anyway and states '
            "the reason)"
        )
    if other is None and reason is not None:
        raise RecordError(f"--mixed-commits-reason is given, but every run ran at {COMMIT_KEY} {commit_of(logs[0])}")


# ----------------------------------------------------------------------------- runs already in records


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
                runs = json.loads(read_regular_file(path / "statistics.json").decode("utf-8"))["runs"]
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
        runs = json.loads(read_regular_file(folder / "statistics.json").decode("utf-8"))["runs"]
        return any(isinstance(run, dict) and run.get("log") == name for run in runs)
    except (OSError, ValueError, KeyError, TypeError):
        return False


# ----------------------------------------------------------------------------- statistics


def run_row(log, statistics_format):
    """One run's line of statistics.json; from format 3 on with its machine and commit, from format 4
    on with its machine's identity, GPUs, bf16 path and start."""
    row = {
        "run_id": log.run_id,
        "log": Path(log.path).name,
        "final_val_loss": log.final["val_loss"],
        "train_time_ms": log.final["train_time_ms"],
        "steps": log.final["steps"],
    }
    if statistics_format >= FORMAT_WITH_MACHINES:
        row |= {**machine_of(log, statistics_format), COMMIT_KEY: commit_of(log)}
    if statistics_format >= FORMAT_WITH_IDENTITY:
        row |= {key: log.environment.get(key, UNKNOWN) for key in RUN_KEYS}
    return row


def group_statistics(logs, statistics_format=STATISTICS_FORMAT):
    """Statistics of one group of runs that need no target: val loss and train time summaries."""
    losses = [log.final["val_loss"] for log in logs]
    times_ms = [float(log.final["train_time_ms"]) for log in logs]
    return {
        "n": len(logs),
        "val_loss": val_loss_summary(losses),
        "train_time_ms": summary(times_ms),
        "train_time_s": summary([t / MS_PER_S for t in times_ms]),
        "runs": [run_row(log, statistics_format) for log in logs],
        "code": dict(sorted(logs[0].declared_sha256.items())),
    }


def train_times(logs):
    return [float(log.final["train_time_ms"]) for log in logs]


def baseline_statistics(logs, baseline_logs, repo_root, statistics_format=STATISTICS_FORMAT):
    """The baseline group's statistics, where its logs are, and how the record compares with it."""
    base = group_statistics(baseline_logs, statistics_format)
    base["logs"] = [Path(os.path.relpath(Path(log.path).resolve(), repo_root)).as_posix() for log in baseline_logs]
    record_losses = [log.final["val_loss"] for log in logs]
    base["welch_val_loss"] = welch_test(record_losses, base["val_loss"]["values"])
    base["welch_train_time"] = welch_test(train_times(logs), base["train_time_ms"]["values"])
    base["speedup"] = base["train_time_ms"]["mean"] / float(np.mean(train_times(logs)))
    return base


def current_record_statistics(logs, current, reruns, baseline):
    """How the record compares with the track's current record: `current` names it and gives its
    mean train time and listed speed-up; with `reruns` (its code re-run in this series) their
    statistics, the Welch test of the train time against them and their speed-up over `baseline`."""
    out = dict(current)
    out["reruns"] = None
    if reruns:
        group = group_statistics(reruns)
        group["welch_train_time"] = welch_test(train_times(logs), group["train_time_ms"]["values"])
        group["speedup"] = (baseline["train_time_ms"]["mean"] / group["train_time_ms"]["mean"]) if baseline else None
        out["reruns"] = group
    return out


def common_steps(logs):
    """The steps every run of a record trained (a steps track ranks records by them)."""
    steps = sorted({log.final["steps"] for log in logs})
    if len(steps) != 1:
        raise RecordError(f"the runs trained {', '.join(map(str, steps))} steps: the runs of a record on a steps "
                          "track train the same number of steps")
    return steps[0]


def time_rule_failure(s, track):
    """On a track ranked by train time (format 4 on), why the result is not faster than it must be,
    or None: slower than its baseline runs (on a track that defines its baseline: not significantly
    faster, or none given), or not faster than the current record (with its re-runs: not
    significantly, and its speed-up over the baseline not above the current record's)."""
    threshold, base, current = track["p_threshold"], s["baseline"], s.get("current_record")
    if "baseline" in track and base is None:
        return ("no baseline runs: a record of this track states its speed-up over baseline runs interleaved with "
                "its own on the same machine (--baseline-logs)")
    if "baseline" in track and not (base["welch_train_time"] or {}).get("p", 1.0) < threshold:
        p = (base["welch_train_time"] or {}).get("p")
        return (f"not significantly faster than its baseline runs (speed-up {base['speedup']:.2f}x, Welch p = "
                f"{fmt(p, '.3g')}, not below {threshold})")
    if current is None:
        return None
    reruns = current["reruns"]
    if "baseline" in track and reruns is None:
        return (f"no re-runs of the current record {current['record']}: a record of this track is compared with "
                f"the current record's code run in the same series (--current-record-logs)")
    if reruns is not None and not (reruns["welch_train_time"] or {}).get("p", 1.0) < threshold:
        p = (reruns["welch_train_time"] or {}).get("p")
        return (f"not significantly faster than the current record {current['record']} run in the same series "
                f"({s['train_time_s']['mean']:.1f} s against {reruns['train_time_s']['mean']:.1f} s, Welch p = "
                f"{fmt(p, '.3g')}, not below {threshold})")
    if current["speedup"] is not None and base is not None:
        if not base["speedup"] > current["speedup"]:
            return (f"its speed-up over its baseline runs, {base['speedup']:.2f}x, is not above the current record "
                    f"{current['record']}'s {current['speedup']:.2f}x (the table ranks by that ratio)")
    elif not s["train_time_ms"]["mean"] < current["mean_train_time_ms"]:
        return (f"not faster than the current record {current['record']} ({s['train_time_s']['mean']:.1f} s against "
                f"{current['mean_train_time_ms'] / MS_PER_S:.1f} s)")
    return None


def decide_status(s, track, set_target, remeasured_baseline=False):
    """(status, one-line reason) of the statistics `s` (its n, p_value, margin_statistic and, on a
    track ranked by train time from format 4 on, its comparisons: time_rule_failure); on a track
    with `z_margin`, the margin rule instead of the t-test."""
    n, p_value, margin_value = s["n"], s["p_value"], s.get("margin_statistic")
    min_runs, threshold = track.get("min_runs", 1), track["p_threshold"]
    if set_target:
        return STATUS_TARGET, f"sets the track's target: the mean final val loss of these {n} runs"
    if remeasured_baseline:
        return STATUS_BASELINE, (f"the track's baseline re-measured on another machine ({n} runs): records made "
                                 "there compare their train time with it, not with the first record's")
    if n < min_runs:
        return STATUS_NOT_RECORD, f"only {n} run(s); the track requires at least {min_runs}"
    if margin_value is not None:
        margin = track["z_margin"]
        if margin_value < margin:
            return STATUS_NOT_RECORD, (f"(target - mean) x sqrt(n) = {margin_value:.4g} is not at least {margin}: "
                                       "the target is not met significantly")
        return STATUS_RECORD, (f"(target - mean) x sqrt(n) = {margin_value:.4g} >= {margin}: the mean final val "
                               f"loss is below the target {track['target_val_loss']:.6f} by the margin rule")
    if p_value is None:
        return STATUS_NOT_RECORD, "the t-test is undefined (fewer than 2 runs or identical final losses)"
    if p_value >= threshold:
        return STATUS_NOT_RECORD, f"p = {p_value:.4g} is not below {threshold}: the target is not met significantly"
    if s["format"] >= FORMAT_WITH_IDENTITY and track.get("metric") != METRIC_STEPS:
        failure = time_rule_failure(s, track)
        if failure:
            return STATUS_NOT_RECORD, failure
    target = track["target_val_loss"]
    return STATUS_RECORD, f"mean final val loss is below the target {target:.6f} with p = {p_value:.4g} < {threshold}"


def record_statistics(logs, baseline_logs, track, set_target, repo_root, remeasured_baseline=False,
                      statistics_format=STATISTICS_FORMAT, current=None, reruns=()):
    """Everything statistics.json holds except what the command line gives (METADATA_KEYS,
    REASON_KEYS, CREDIT_KEYS). current: the track's current record ({record, mean_train_time_ms,
    speedup}) when this one must beat it (format 4 on), reruns: its re-runs in this series."""
    group = group_statistics(logs, statistics_format)
    target = group["val_loss"]["mean"] if set_target else track["target_val_loss"]
    t, p = (None, None) if set_target else one_sample_test(group["val_loss"]["values"], target)
    by_steps = track.get("metric") == METRIC_STEPS
    margin_value = (margin_statistic(group["val_loss"]["values"], target)
                    if by_steps and "z_margin" in track and not set_target else None)
    result = {
        "target_val_loss": target,
        "p_threshold": track["p_threshold"],
        "min_runs": track.get("min_runs", 1),
        "t_statistic": t,
        "p_value": p,
        **group,
    }
    if by_steps:
        result |= {"metric": METRIC_STEPS, "steps": common_steps(logs), "z_margin": track.get("z_margin"),
                   "margin_statistic": margin_value}
    result["baseline"] = (baseline_statistics(logs, baseline_logs, repo_root, statistics_format)
                          if baseline_logs else None)
    if statistics_format >= FORMAT_WITH_IDENTITY:
        result["current_record"] = (current_record_statistics(logs, current, reruns, result["baseline"])
                                    if current else None)
    status, reason = decide_status({"format": statistics_format, **result}, track, set_target, remeasured_baseline)
    return {"status": status, "status_reason": reason, **result}


def refusal_details(s, track):
    """The statistics behind a refusal, and what would change them: more runs where the mean is on
    the right side and only the spread keeps the test from passing."""
    vl, threshold = s["val_loss"], track["p_threshold"]
    parts = [f"n = {s['n']}, mean final val loss {vl['mean']:.4f}" + (f" ± {vl['std']:.4f} (sample std)"
                                                                        if vl["std"] is not None else ""),
             f"target {s['target_val_loss']:.4f}", f"p = {fmt(s['p_value'], '.3g')}"]
    ts = s["train_time_s"]
    parts.append(f"mean train time {ts['mean']:.1f} s")
    advice = ""
    if s["p_value"] is not None and s["p_value"] >= threshold:
        needed = runs_needed(vl["values"], s["target_val_loss"], threshold)
        advice = (f"with this mean and spread about {needed} runs would give p < {threshold}: run more seeds and give "
                  f"all their logs" if needed else "more runs of this code would not reach the target")
    reruns = (s.get("current_record") or {}).get("reruns")
    base = s["baseline"]
    comparisons = [("the current record's re-runs", reruns), ("its baseline runs", base)]
    for what, group in comparisons:
        if group and not (group["welch_train_time"] or {}).get("p", 1.0) < threshold:
            times = s["train_time_ms"]["values"]
            needed = welch_runs_needed(times, group["train_time_ms"]["values"], threshold)
            parts.append(f"{what}: {group['train_time_s']['mean']:.1f} s (n = {group['n']})")
            if not advice:
                advice = (f"with these times and spreads about {needed} runs of each would make the difference "
                          f"significant" if needed else f"more runs would not make it faster than {what}")
            break
    return "; ".join(parts) + (f"; {advice}" if advice else "")


# ----------------------------------------------------------------------------- checking existing records


def read_statistics(path):
    """A record's statistics.json, with the values needed to recompute it checked for their types."""
    try:
        s = json.loads(read_regular_file(path).decode("utf-8"))
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


def iso_time(text):
    """The time an ISO 8601 string with an offset names, or None."""
    try:
        when = datetime.datetime.fromisoformat(text) if isinstance(text, str) else None
    except ValueError:
        return None
    return when if when is not None and when.tzinfo is not None else None


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
    flags and the current record it was compared with taken from `s`."""
    statistics_format = s["format"]
    logs, reruns = record_folder_logs(folder, s)
    baseline_logs = [read_log(repo_root / path) for path in s["baseline"]["logs"]] if s["baseline"] else []
    given = {key: s[key] for key in METADATA_KEYS}
    current = None
    if statistics_format >= FORMAT_WITH_MACHINES:
        given |= {key: s[key] for key in REASON_KEYS}
        check_one_machine(logs + baseline_logs + reruns, s["mixed_machines_reason"], statistics_format)
        check_one_commit(logs, s["mixed_commits_reason"])
    if statistics_format >= FORMAT_WITH_IDENTITY:
        given |= {key: s[key] for key in CREDIT_KEYS}
        if s["current_record"]:
            current = {key: s["current_record"].get(key) for key in ("record", "mean_train_time_ms", "speedup")}
    computed = record_statistics(logs, baseline_logs, track, s["status"] == STATUS_TARGET, repo_root,
                                 s["status"] == STATUS_BASELINE, statistics_format, current, reruns)
    return json.loads(json.dumps({**given, **computed})), logs + reruns


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
        head = read_regular_file(path)[:24]
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
            same = read_regular_file(folder / name) == text.encode("utf-8")
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
    checked against its logs (check_record), no run in two records of any track."""
    refuse_runs_in_two_records(recorded_runs(track_dir.parent))
    found = []
    for path in sorted(track_dir.glob("*/statistics.json")):
        if path.parent.name.startswith("."):  # a folder being built, or left by a killed make_record.py
            continue
        s = read_statistics(path)
        check_record(path.parent, s, track, repo_root)
        found.append((path.parent, s))
    check_current_record_references(found)
    return found


# ----------------------------------------------------------------------------- writing the record


def fmt(x, spec):
    return "n/a" if x is None else format(x, spec)


def statistics_text(s):
    """The human-readable statistics.txt."""
    vl, ts = s["val_loss"], s["train_time_s"]
    lines = [
        f"track            {s['track']}: target val loss {fmt(s['target_val_loss'], '.6f')}, "
        f"p threshold {s['p_threshold']}, at least {s['min_runs']} runs",
        f"runs             n = {s['n']}",
        f"final val loss   mean {vl['mean']:.6f}  std {fmt(vl['std'], '.6f')}  "
        f"values {', '.join(f'{v:.4f}' for v in vl['values'])}",
        f"t-test           one-sided, H1 mean < target: t = {fmt(s['t_statistic'], '.4f')}, "
        f"p = {fmt(s['p_value'], '.4g')}",
        f"train time (s)   mean {ts['mean']:.3f}  median {ts['median']:.3f}  min {ts['min']:.3f}  max {ts['max']:.3f}",
    ]
    if s.get("metric") == METRIC_STEPS:
        lines.insert(2, f"steps            {s['steps']} (the track ranks records by steps, fewest first)")
        if s["z_margin"] is not None:
            lines.insert(5, f"margin rule      (target - mean) x sqrt(n) = {fmt(s['margin_statistic'], '.4f')}, "
                            f"at least {s['z_margin']} for a record")
    base = s["baseline"]
    if base:
        wv, wt = base["welch_val_loss"] or {}, base["welch_train_time"] or {}
        lines += [
            f"baseline         n = {base['n']}: mean val loss {base['val_loss']['mean']:.6f}, "
            f"mean train time {base['train_time_s']['mean']:.3f} s",
            f"Welch val loss   one-sided, H1 record < baseline: t = {fmt(wv.get('t'), '.4f')}, "
            f"p = {fmt(wv.get('p'), '.4g')}",
            f"Welch time       one-sided, H1 record < baseline: t = {fmt(wt.get('t'), '.4f')}, "
            f"p = {fmt(wt.get('p'), '.4g')}",
            f"speed-up         baseline mean time / record mean time = {base['speedup']:.4f}x",
        ]
    current = s.get("current_record")
    if current:
        speedup = f", speed-up {current['speedup']:.4f}x" if current["speedup"] is not None else ""
        lines.append(f"current record   {current['record']}: mean train time "
                     f"{current['mean_train_time_ms'] / MS_PER_S:.3f} s{speedup} (as its record states)")
        reruns = current["reruns"]
        if reruns:
            wt = reruns["welch_train_time"] or {}
            lines += [f"its re-runs      n = {reruns['n']} in this series: mean train time "
                      f"{reruns['train_time_s']['mean']:.3f} s" + (f", speed-up {reruns['speedup']:.4f}x"
                                                                   if reruns["speedup"] is not None else ""),
                      f"Welch time       one-sided, H1 record < re-runs: t = {fmt(wt.get('t'), '.4f')}, "
                      f"p = {fmt(wt.get('p'), '.4g')}"]
    lines.append(f"status           {s['status']}: {s['status_reason']}")
    return "\n".join(lines) + "\n"


def readme_text(s, folder_rel, first_log):
    """The record folder's README: what changed, status, per-run table, statistics, code, how to reproduce."""
    status_line = {
        STATUS_RECORD: "**Record**: " + s["status_reason"] + ".",
        STATUS_TARGET: f"**Sets the track's target**: track.json's target_val_loss was set to "
        f"{s['target_val_loss']!r}, the mean final val loss of these {s['n']} runs "
        "(this record's p-value against its own mean is not meaningful and is not computed).",
        STATUS_NOT_RECORD: "**Not a record**: " + s["status_reason"] + ". Kept for reference; not in the README table.",
        STATUS_BASELINE: "**Baseline**: " + s["status_reason"] + ". Not in the README table.",
    }[s["status"]]
    credit = s["format"] >= FORMAT_WITH_IDENTITY
    lines = [
        f"# {s['name']}",
        "",
        f"Track: [{s['track']}](../README.md) · date: {s['date']} · status: {s['status']}"
        + (f" · author: {s['author'] or 'not named'}" if credit else ""),
        "",
        "## What changed",
        "",
    ]
    if credit and s["changed"]:
        lines += [f"In short: {s['changed']}.", ""]
    lines += [
        s["description"] or "(no description given)",
        "",
        "## Result",
        "",
        status_line,
        "",
        "| run id | log | final val loss | train time (s) | steps |",
        "|---|---|---|---|---|",
    ]
    for run in s["runs"]:
        lines.append(
            f"| {run['run_id']} | [{run['log']}]({run['log']}) | {run['final_val_loss']:.4f} "
            f"| {run['train_time_ms'] / MS_PER_S:.3f} | {run['steps']} |"
        )
    lines += ["", "## Statistics", "", "```text", statistics_text(s).rstrip("\n"), "```", ""]
    if s["baseline"]:
        lines += ["Baseline runs (referenced, not copied): " + ", ".join(f"`{p}`" for p in s["baseline"]["logs"]), ""]
    reruns = (s.get("current_record") or {}).get("reruns")
    if reruns:
        lines += [f"Re-runs of the current record {s['current_record']['record']} in this series (kept here): "
                  + ", ".join(f"[{run['log']}]({run['log']})" for run in reruns["runs"]), ""]
    lines += [f"![train and val loss against train time]({PLOT_NAME})", ""]
    if s["format"] >= FORMAT_WITH_MACHINES:
        lines += machine_lines(s)
    lines += ["## Code", ""]
    lines += [f"Every log embeds the same {len(s['code'])} source file(s), verbatim, with these sha256 "
              f"(`records/reproduce.py` recreates them from any log):", ""]
    lines += ["| file | sha256 |", "|---|---|"] + [f"| `{p}` | `{h}` |" for p, h in s["code"].items()]
    lines += [
        "",
        "## Reproduce",
        "",
        "From the repository root (the data paths in the logged config are relative to it):",
        "",
        "```bash",
        f"python records/reproduce.py {shlex.quote(f'{folder_rel}/{first_log}')} --run",
        "```",
        "",
        "This recreates the exact sources embedded in the log in a fresh folder and runs them with the logged config.",
        "",
    ]
    return "\n".join(lines)


def machine_lines(s):
    """The record README's "Machine" section: the machines (CPU model, hostname; from format 4 on its
    identity) and commits the runs, the baseline's runs and the re-runs ran on, with the reasons
    given for more than one."""
    reruns = (s.get("current_record") or {}).get("reruns")
    groups = ([("", s["runs"])] + ([("baseline ", s["baseline"]["runs"])] if s["baseline"] else [])
              + ([("re-run ", reruns["runs"])] if reruns else []))
    identity = s["format"] >= FORMAT_WITH_IDENTITY
    machine_keys = MACHINE_KEYS + (IDENTITY_KEYS if identity else ())
    lines = ["## Machine", ""]
    for what, key, reason_key in (("machine", machine_keys, "mixed_machines_reason"),
                                  ("commit", (COMMIT_KEY,), "mixed_commits_reason")):
        used = {}
        for prefix, runs in groups:
            for run in runs:
                used.setdefault(tuple(run[k] for k in key), []).append(prefix + run["run_id"])
        for value, run_ids in used.items():
            if what == "machine":
                shown = f"CPU `{value[0]}`, hostname `{value[1]}`" + (
                    f", {value[2]} cores, CPU flags `{value[3]}`, machine id `{value[4]}`" if identity else "")
            else:
                shown = f"`{value[0]}`"
            runs_text = "every run" if len(used) == 1 else "runs " + ", ".join(run_ids)
            lines.append(f"- {what}: {shown} ({runs_text})")
        if s[reason_key]:
            lines.append(f"- more than one {what}, because: {s[reason_key]}")
    return lines + [""]


def smoothed(values, weight=TRAIN_LOSS_SMOOTHING):
    """Exponential moving average, bias-corrected so the curve starts at the first value."""
    out, average = [], 0.0
    for i, value in enumerate(values, start=1):
        average = weight * average + (1 - weight) * value
        out.append(average / (1 - weight ** i))
    return out


def write_plot(path, logs, baseline_logs, target, title, reruns=()):
    """Each run's losses against train time: the next-token train loss (smoothed, thin) and every
    validation (dots), the baseline's runs dashed in grey, the current record's re-runs dotted in
    brown, the target as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(PLOT_SIZE[0] / 100, PLOT_SIZE[1] / 100))
    groups = ((logs, "-", None, ""), (baseline_logs, "--", "grey", "baseline "), (reruns, ":", "brown", "re-run "))
    for group, style, color, prefix in groups:
        for log in group:
            steps = [p for p in log.steps if math.isfinite(p["train_loss"])]
            line = None
            if steps:
                seconds = [p["train_time_ms"] / MS_PER_S for p in steps]
                (line,) = ax.plot(seconds, smoothed([p["train_loss"] for p in steps]), style, linewidth=1,
                                  alpha=0.6, color=color, label=f"{prefix}{log.run_id} train")
            val_seconds = [ms / MS_PER_S for _, _, ms in log.val_points]
            ax.plot(val_seconds, [loss for _, loss, _ in log.val_points], "o", markersize=4,
                    color=line.get_color() if line else color, label=f"{prefix}{log.run_id} val")
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:.4f}")
    ax.set_xlabel("train time (s)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.legend(fontsize="x-small", ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_record(folder, s, logs, baseline_logs, folder_rel, reruns=()):
    """Fill `folder` (empty) with the record's logs (and re-runs), statistics, plot and README; the
    folder readable by every user, as a checkout's folders are (mkdtemp made it owner-only)."""
    folder.chmod(RECORD_FOLDER_MODE)
    for log in [*logs, *reruns]:
        shutil.copyfile(log.path, folder / Path(log.path).name)
    (folder / "statistics.json").write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")
    (folder / "statistics.txt").write_text(statistics_text(s), encoding="utf-8")
    title = f"{s['track']}: {s['name']} ({s['date']})"
    write_plot(folder / PLOT_NAME, logs, baseline_logs, s["target_val_loss"], title, reruns)
    (folder / "README.md").write_text(readme_text(s, folder_rel, Path(logs[0].path).name), encoding="utf-8")


def refuse_read_only(path):
    """Refuse to replace a file that is read-only: no write permission for its owner, or for this user."""
    if path.exists() and (not path.stat().st_mode & stat.S_IWUSR or not os.access(path, os.W_OK)):
        raise RecordError(f"{path} is read-only; make it writable (chmod u+w) for this tool to update it")


def staged_file(path, text):
    """A temporary file next to `path` holding `text` (UTF-8) with path's permission bits, for
    os.replace(tmp, path) to put in place in one step."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o644)
    except BaseException:
        os.unlink(tmp)
        raise
    return Path(tmp)


def publish(staging, folder, files, replaced=()):
    """Make the record built in `staging` (a hidden folder next to `folder`) and the {path: text} of
    `files` visible: each text goes to a temporary file next to its path, the `replaced` record
    folders (superseded, or the one being re-made) are renamed to hidden names, then the folder is
    renamed into place, each file over its destination, and the replaced folders removed. When
    anything fails before the folder's rename, the replaced folders get their names back and the
    staging folder and the temporary files are removed."""
    staged, hidden = {}, []
    try:
        for path, text in files.items():
            staged[path] = staged_file(path, text)
        for old in replaced:
            aside = old.parent / f".{old.name}.replaced-{os.getpid()}"
            old.rename(aside)
            hidden.append((old, aside))
        staging.rename(folder)
    except BaseException:
        for old, aside in reversed(hidden):
            aside.rename(old)
        shutil.rmtree(staging, ignore_errors=True)
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in staged.items():
        os.replace(tmp, path)
    for _, aside in hidden:
        shutil.rmtree(aside, ignore_errors=True)


# ----------------------------------------------------------------------------- the README table


def table_markers(track):
    return f"<!-- records:{track}:start -->", f"<!-- records:{track}:end -->"


def speedup(s, first_time):
    """A record's speed-up over the baseline: its own baseline runs' mean train time over its own
    where it has them (the same machine, interleaved), else the first record's over its own."""
    if s["status"] == STATUS_TARGET:
        return 1.0
    if s.get("baseline"):
        return s["baseline"]["speedup"]
    return first_time / s["train_time_ms"]["mean"]


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
    return text.replace("|", "/")


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
            pairwise = f"{stat:.4f} vs {old['name']} ({verdict} at {definition['pairwise_margin']})"
        lines.append(
            f"| {rank} | [{s['name']}]({link}) | {changed_cell(s)} | {machine_label(s)} | {s['steps']} "
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
            f"| {rank} | [{s['name']}]({link}) | {changed_cell(s)} | {machine_label(s)} | {s['val_loss']['mean']:.4f} "
            f"| {p} | {s['train_time_s']['mean']:.1f} s | {s['n']} | {speedup(s, first_time):.2f}x |"
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
    where the file or its markers are missing. definition: the track's track.json (records_table)."""
    start, end = table_markers(track)
    text = read_regular_file(readme).decode("utf-8") if readme.is_file() else ""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        return None
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


# ----------------------------------------------------------------------------- the lock


@contextlib.contextmanager
def records_lock(records_dir):
    """Hold the records root's lock (flock on the folder itself) inside the block: one
    make_record.py at a time reads the records and writes them. Waits up to LOCK_WAIT_S for another."""
    fd = os.open(records_dir, os.O_RDONLY | os.O_DIRECTORY)
    wait_s = LOCK_WAIT_S
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                raise RecordError(f"another make_record.py is writing {records_dir} (it has held its lock for over "
                                  f"{wait_s:g} s): wait for it to finish, then run this again")
            if not said:
                print(f"waiting for another make_record.py writing {records_dir} ...", flush=True)
                said = True
            time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)                   # closing the folder releases the lock


# ----------------------------------------------------------------------------- command line


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Build a record folder from run logs and update the README table.",
        epilog="Exit code 2 (and nothing written) when the logs are refused.",
    )
    parser.add_argument("--track", required=True, help="track folder name, e.g. track_cpu")
    parser.add_argument("--name", help="record name (letters, digits, '_', '-', '.')")
    parser.add_argument("--logs", nargs="+", default=[], help="logs of the runs (<run id>.txt)")
    parser.add_argument(
        "--baseline-logs", nargs="+", default=[], help="logs (or a record folder) to compare against: Welch t-tests"
    )
    parser.add_argument(
        "--current-record-logs", nargs="+", default=[],
        help="the track's current record re-run in the same series as --logs and --baseline-logs (on a track ranked "
        "by train time that defines its baseline, a record beats them significantly)",
    )
    parser.add_argument("--description", default="", help="what changed, in full (goes into the record README)")
    parser.add_argument("--changed", help=f"what changed, in at most {SHORT_TEXT_MAX} characters (the tables' "
                        "what-changed column)")
    parser.add_argument("--author", help=f"who made the change (at most {SHORT_TEXT_MAX} characters), credited in "
                        "the record")
    parser.add_argument("--date", default=None, help="YYYY-MM-DD (default: today)")
    parser.add_argument("--allow-non-record", action="store_true", help="write the folder even if not a record")
    parser.add_argument(
        "--set-target-from-these-logs",
        action="store_true",
        help="for a track whose target is null: set it to the mean final val loss of these logs",
    )
    parser.add_argument(
        "--remeasured-baseline",
        action="store_true",
        help="these runs re-measure the track's baseline on another machine: written with status "
        "'baseline', kept out of the README table, for records made there to pass as --baseline-logs",
    )
    parser.add_argument(
        "--mixed-machines-reason",
        help="why the runs (or the baseline's runs) ran on more than one machine (cpu, hostname): without it such "
        "logs are refused; the record's README and statistics state it",
    )
    parser.add_argument(
        "--mixed-commits-reason",
        help="why the runs ran at more than one git commit: without it such logs are refused; the record's README "
        "and statistics state it",
    )
    parser.add_argument("--remake", type=Path, help="rebuild this record folder of the track from its own logs "
                        "(the same numbers and status; --changed and --author may be given)")
    parser.add_argument("--tables", action="store_true", help="rebuild the track's tables from its records")
    parser.add_argument("--records-dir", type=Path, default=RECORDS_DIR, help="root of the track folders")
    parser.add_argument("--readme", type=Path, default=RECORDS_DIR.parent / "README.md", help="README to update")
    return parser.parse_args(argv)


def load_track(track_dir):
    path = track_dir / "track.json"
    try:
        track = json.loads(read_regular_file(path).decode("utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path}: no such track definition; is --track spelled right?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read it ({e.strerror})") from None
    return track


def utf8_argument(value, flag):
    """A command-line value as text. Under a locale whose encoding is not UTF-8, Python hands the
    non-ASCII bytes of argv over as surrogate escapes; os.fsencode gives the bytes back, read as UTF-8."""
    if value is None:
        return None
    try:
        return os.fsencode(value).decode("utf-8")
    except UnicodeError:
        raise RecordError(f"{flag}: not UTF-8 text") from None


def decode_text_arguments(args):
    """The free-text arguments (which records keep) as UTF-8 text (utf8_argument)."""
    for flag in ("description", "mixed_machines_reason", "mixed_commits_reason", "changed", "author"):
        setattr(args, flag, utf8_argument(getattr(args, flag), "--" + flag.replace("_", "-")))


def check_short_text(value, flag):
    """--changed and --author go into table cells: one line, no '|', at most SHORT_TEXT_MAX characters."""
    if value is not None and (not value.strip() or len(value) > SHORT_TEXT_MAX or "|" in value
                              or any(c in value for c in "\r\n\t")):
        raise RecordError(f"{flag} {value[:80]!r}: give 1 to {SHORT_TEXT_MAX} characters on one line, without '|' "
                          f"(it goes into a table cell)")


def check_arguments(args, track, today):
    if not args.name:
        raise RecordError("--name is required (with --logs) to make a record")
    if not args.logs:
        raise RecordError("--logs is required (the logs of the record's runs)")
    if not NAME_PATTERN.fullmatch(args.name):
        raise RecordError(f"--name {args.name!r}: use letters, digits, '_', '-', '.', starting with a letter or digit")
    args.date = args.date or today.isoformat()
    try:
        if not DATE_PATTERN.fullmatch(args.date):
            raise ValueError
        datetime.date.fromisoformat(args.date)
    except ValueError:
        raise RecordError(f"--date {args.date!r} is not a date in the form YYYY-MM-DD") from None
    if args.set_target_from_these_logs and track["target_val_loss"] is not None:
        raise RecordError(
            f"track {args.track} already has target {track['target_val_loss']}; "
            "--set-target-from-these-logs only sets a null target"
        )
    if not args.set_target_from_these_logs and track["target_val_loss"] is None:
        raise RecordError(
            f"track {args.track} has no target yet (target_val_loss is null); "
            "its baseline record sets it with --set-target-from-these-logs"
        )
    if args.remeasured_baseline and (args.set_target_from_these_logs or args.baseline_logs):
        raise RecordError("--remeasured-baseline takes only the baseline's own runs: no --set-target-from-these-logs, "
                          "no --baseline-logs")
    if args.remeasured_baseline and "baseline" not in track:
        raise RecordError(f"track {args.track} defines no baseline script (track.json \"baseline\"), so there is no "
                          f"baseline to re-measure")
    if args.set_target_from_these_logs and len(args.logs) < track.get("min_runs", 1):
        raise RecordError(f"setting the target needs at least {track['min_runs']} runs, got {len(args.logs)}")


def track_folder(args):
    if not NAME_PATTERN.fullmatch(args.track):
        raise RecordError(f"--track {args.track!r} is not a track folder name (letters, digits, '_', '-', '.')")
    return args.records_dir / args.track


def current_record_runs(args, track, track_dir, records, logs):
    """(the current record to beat, its re-runs in this series): on a track ranked by train time the
    best-ranked record, whose re-runs (--current-record-logs) must run its code and config."""
    current = current_record(records, track)
    if current is None:
        if args.current_record_logs:
            raise RecordError(f"--current-record-logs: track {args.track} has no current record to compare with")
        return None, []
    if not args.current_record_logs:
        return current, []
    reruns = load_logs(args.current_record_logs, track, "the current record's re-run",
                       track.get("required_environment"), track.get("fixed_config"))
    folder = track_dir / current["record"]
    s = next(s for f, s in records if f.name == current["record"])
    first = read_log(folder / s["runs"][0]["log"])
    if reruns[0].code_id != first.code_id:
        raise RecordError(f"--current-record-logs: {describe_code_difference(first, reruns[0])}: re-runs of the "
                          f"current record {current['record']} run its code (a clone at its commit)")
    if free_config(reruns[0]) != free_config(first):
        raise RecordError(f"--current-record-logs: {describe_config_difference(first, reruns[0])}: re-runs of the "
                          f"current record {current['record']} run its config")
    return current, reruns


def make_record(args):
    """Under the records root's lock (records_lock): remake, or check everything, then make the
    record folder, the target (if asked) and the README tables visible together (publish)."""
    decode_text_arguments(args)
    track_dir = track_folder(args)
    track = load_track(track_dir)
    with records_lock(args.records_dir):
        if args.remake or args.tables:
            remake(args, track_dir, track)
        else:
            make_new_record(args, track_dir, track)


def make_new_record(args, track_dir, track):
    """Check everything, then make the record folder, the target (if asked) and the README tables
    visible together (publish)."""
    today = datetime.date.today()
    check_arguments(args, track, today)
    check_short_text(args.changed, "--changed")
    check_short_text(args.author, "--author")
    folder = track_dir / f"{args.date}_{args.name}"
    if folder.exists():
        raise RecordError(f"{folder} already exists; choose another --name or --date")
    repo_root = args.readme.resolve().parent
    logs = load_logs(args.logs, track, "the", track.get("required_environment"), track.get("fixed_config"))
    if any(log.final["train_time_ms"] <= 0 for log in logs):
        raise RecordError("a run with 0 ms of training is not a run: check its num_iterations")
    refuse_dirty_trees(logs)
    baseline_paths = expand_record_folders(args.baseline_logs, track_dir)
    baseline_logs = load_logs(baseline_paths, track, "baseline") if baseline_paths else []
    refuse_same_names(baseline_logs)
    definition = track.get("baseline")
    for log in baseline_logs + (logs if args.remeasured_baseline or args.set_target_from_these_logs else []):
        if definition:
            check_baseline_run(log, definition)
    records = checked_track_records(track_dir, track, repo_root)
    current, reruns = current_record_runs(args, track, track_dir, records, logs)
    refuse_same_names(logs + reruns)
    check_date(args.date, logs + reruns, today)
    check_one_machine(logs + baseline_logs + reruns, args.mixed_machines_reason)
    check_one_commit(logs, args.mixed_commits_reason)
    recorded = recorded_runs(args.records_dir)
    superseded = superseded_folders(logs + reruns, recorded, records)
    flags = args.set_target_from_these_logs or args.remeasured_baseline
    s = {
        "format": STATISTICS_FORMAT,
        "track": args.track,
        "name": args.name,
        "date": args.date,
        "made": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "description": args.description,
        "mixed_machines_reason": args.mixed_machines_reason,
        "mixed_commits_reason": args.mixed_commits_reason,
        "author": args.author,
        "changed": args.changed,
        **record_statistics(logs, baseline_logs, track, args.set_target_from_these_logs, repo_root,
                            args.remeasured_baseline, STATISTICS_FORMAT, None if flags else current, reruns),
    }
    if s["status"] == STATUS_NOT_RECORD and not args.allow_non_record:
        raise RecordError(f"not a record: {s['status_reason']} ({refusal_details(s, track)}) (use --allow-non-record "
                          f"to keep it anyway)")

    kept = [(f, other) for f, other in records if f not in superseded]
    files, notes = table_files(args, track_dir, track, kept + [(folder, s)])
    if args.set_target_from_these_logs:
        track["target_val_loss"] = s["target_val_loss"]
        track["target_note"] = f"mean final val loss of the {s['n']} runs of record {folder.name}"
        files[track_dir / "track.json"] = json.dumps(track, indent=2) + "\n"
    for path in files:
        refuse_read_only(path)

    staging = Path(tempfile.mkdtemp(dir=track_dir, prefix=f".{folder.name}."))
    try:
        folder_rel = Path(os.path.relpath(folder, repo_root)).as_posix()
        write_record(staging, s, logs, baseline_logs, folder_rel, reruns)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, folder, files, superseded)
    print(statistics_text(s), end="")
    print(f"wrote {folder}")
    for old in superseded:
        print(f"replaced {old} (not a record): its runs are part of this record")
    for warning in notes:
        print(warning, file=sys.stderr)


def remake(args, track_dir, track):
    """--tables: rewrite the track's tables from its checked records. --remake FOLDER: rebuild one
    record folder with this tool's files (the current format) from its own logs, keeping its
    numbers, status and command-line values (--changed, --author replace theirs), then the tables."""
    repo_root = args.readme.resolve().parent
    records = checked_track_records(track_dir, track, repo_root)
    replaced = []
    if args.remake:
        check_short_text(args.changed, "--changed")
        check_short_text(args.author, "--author")
        folder = args.remake.resolve()
        old = next((s for f, s in records if f.resolve() == folder), None)
        if old is None:
            raise RecordError(f"--remake {args.remake}: not a record folder of {track_dir}")
        s, logs, baseline_logs, reruns = remade_statistics(folder, old, track, repo_root, args)
        records = [(f, s if f.resolve() == folder else other) for f, other in records]
        staging = Path(tempfile.mkdtemp(dir=track_dir, prefix=f".{folder.name}."))
        try:
            write_record(staging, s, logs, baseline_logs, Path(os.path.relpath(folder, repo_root)).as_posix(), reruns)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        replaced = [folder]
    files, notes = table_files(args, track_dir, track, records)
    for path in files:
        refuse_read_only(path)
    if replaced:
        publish(staging, replaced[0], files, replaced)
        print(f"re-made {replaced[0]}")
    else:
        publish_files(files)
        print(f"rewrote the {args.track} tables")
    for warning in notes:
        print(warning, file=sys.stderr)


def remade_statistics(folder, old, track, repo_root, args):
    """The statistics of the record in `folder` as this tool writes them now, from its logs and its
    command-line values; refused where a number or the status would change."""
    logs, reruns = record_folder_logs(folder, old)
    baseline_logs = [read_log(repo_root / path) for path in old["baseline"]["logs"]] if old["baseline"] else []
    current = ({key: old["current_record"][key] for key in ("record", "mean_train_time_ms", "speedup")}
               if old.get("current_record") else None)
    s = {key: old[key] for key in METADATA_KEYS} | {"format": STATISTICS_FORMAT}
    s |= {key: old.get(key) for key in REASON_KEYS}
    s |= {"author": args.author or old.get("author"), "changed": args.changed or old.get("changed")}
    s |= record_statistics(logs, baseline_logs, track, old["status"] == STATUS_TARGET, repo_root,
                           old["status"] == STATUS_BASELINE, STATISTICS_FORMAT, current, reruns)
    check_one_machine(logs + baseline_logs + reruns, s["mixed_machines_reason"])
    check_one_commit(logs, s["mixed_commits_reason"])
    s = json.loads(json.dumps(s))
    for key in ("status", "target_val_loss", "t_statistic", "p_value", "val_loss", "train_time_ms", "n"):
        if s[key] != old[key]:
            raise RecordError(f"--remake {folder}: its {key} would change ({json.dumps(old[key])[:60]} -> "
                              f"{json.dumps(s[key])[:60]}); a re-made record keeps its numbers and status")
    for key in ("speedup", "welch_train_time", "welch_val_loss"):
        if old["baseline"] and s["baseline"][key] != old["baseline"][key]:
            raise RecordError(f"--remake {folder}: its baseline.{key} would change; a re-made record keeps its "
                              f"numbers")
    return s, logs, baseline_logs, reruns


def publish_files(files):
    """Put each {path: text} in place through a temporary file next to it (staged_file)."""
    staged = {}
    try:
        for path, text in files.items():
            staged[path] = staged_file(path, text)
    except BaseException:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in staged.items():
        os.replace(tmp, path)


def main(argv=None):
    args = parse_args(argv)
    try:
        make_record(args)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:
        print(f"error: {e.filename or 'a file'}: {e.strerror}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
