"""Turn the logs of N runs into a record folder and update the README's table for the track.

    python records/make_record.py --track track_cpu --name MyChange --logs logs/a.txt logs/b.txt logs/c.txt \
        [--baseline-logs ...] [--description "what changed"] [--date YYYY-MM-DD] \
        [--mixed-machines-reason "why"] [--mixed-commits-reason "why"]

Every log is parsed and verified (records/logfile.py): it must be sealed (format
version 2) with every line matching its seal, each embedded source must match
its declared sha256, every run must have finished, and the track's rules hold:
the config names the track, the run evaluated on the track's val data (by
fingerprint) and val_tokens, on the track's hardware; all logs come from the
same code (the same set of (path, sha256) pairs) and the same config apart from
the seed; every run (and every baseline run) ran on one machine (the environment's
`cpu` and `hostname`) and every run at one commit (`git_commit`), unless
--mixed-machines-reason / --mixed-commits-reason says why not; no run id is
already part of a record. Baseline logs must agree among themselves and be part
of a record already (they are referenced, not copied). Every other record of the
track must still be what its logs give: its statistics.json is recomputed from
its sealed logs and compared, value for value, before any table is built from it.
Any refusal prints one line and exits with code 2 before anything is written.

The tables are rewritten in the main README (--readme) and in the track's own
README.md where it holds the track's markers (records/README.md, "The README
table"). Nothing is visible before every check has passed: the record folder is built in
a hidden folder next to its destination, the README tables (and track.json, with
--set-target-from-these-logs) in temporary files next to theirs; then the folder
is renamed into place and each temporary file renamed over its destination.

The record folder records/<track>/<date>_<name>/ holds the logs and what this
tool computes from them: statistics.json and statistics.txt, val_loss.png and a
README, which names the machine (CPU model, hostname) and the commit the runs
ran on. A log is its run's snapshot (records/reproduce.py recreates the sources
from it). The statistics: n, mean and sample std of the final val loss, a
one-sided one-sample t-test of H1 "mean < target", train time summaries, and
with baseline logs one-sided Welch t-tests of H1 "record < baseline" on final
val loss and on train time, plus the speed-up of mean train times.

A result is a record when it has at least the track's min_runs runs and
p < p_threshold. Anything else is refused unless --allow-non-record is given,
which writes the folder marked "not a record" (kept out of the README table).
A track whose target is still null (the CPU track before its baseline) needs
--set-target-from-these-logs: the mean final val loss of these logs becomes the
target in track.json, and the record is marked as the one that set it.
--remeasured-baseline keeps the baseline's runs on another machine (status
"baseline", not in the table) for the records made there: the README table
gives each record's speed-up over its own --baseline-logs where it has them,
so that records made on different machines are never divided by each other.

A track whose track.json says "metric": "steps" (the optimization tracks) ranks its records by
the steps their runs trained, fewest first; a run that changes a value of the track's
fixed_config (its model, data, batch, validation) is refused; with z_margin the public
optimization track's rule decides a record, (target - mean) x sqrt(n) >= z_margin, else the
t-test; its table gives each record's pairwise statistic against the previous record.
"""

import argparse
import datetime
import json
import math
import os
import fnmatch
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import numpy as np

RECORDS_DIR = Path(__file__).resolve().parent  # default root of the track folders
sys.path.insert(0, str(RECORDS_DIR.parent))
from records.logfile import LogError, parse_log, verify  # noqa: E402
from records.significance import (margin_statistic, one_sample_test, pairwise_statistic, summary,  # noqa: E402
                                  val_loss_summary, welch_test)

EXIT_REFUSED = 2  # exit code of every refusal
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # record names become folder names
DATE_PATTERN = re.compile(r"\d{4}-\d{2}-\d{2}")  # --date, the prefix of the record folder's name
MS_PER_S = 1000.0  # logs count train time in ms; tables show seconds
STATUS_RECORD = "record"  # met the target at the track's significance level
STATUS_TARGET = "target"  # the record that set the track's target
STATUS_NOT_RECORD = "not a record"  # written only with --allow-non-record; never in the README table
STATUS_BASELINE = "baseline"  # the baseline re-measured on another machine (--remeasured-baseline); not in the table
PLOT_NAME = "val_loss.png"  # the record's loss-curve plot
RECORD_FILES = ("README.md", "statistics.json", "statistics.txt", PLOT_NAME)  # besides the logs
FREE_CONFIG_KEYS = ("seed", "log_dir")  # the only config values the runs of one record may differ in
FINGERPRINT_KEYS = ("bytes", "tokens", "header_sha256", "head_sha256", "tail_sha256")  # a data file's identity
TRAIN_LOSS_SMOOTHING = 0.8  # EMA weight of the plotted train loss curve
STATISTICS_FORMAT = 3  # what this tool writes; 3 adds each run's machine and commit and the reasons for mixing them
READ_FORMATS = (2, 3)  # the statistics.json formats this tool recomputes and checks
FORMAT_WITH_MACHINES = 3  # the first format whose statistics name each run's machine and commit
MACHINE_KEYS = ("cpu", "hostname")  # the environment lines that name the machine a run ran on
COMMIT_KEY = "git_commit"  # the environment line that names the commit a run ran at
UNKNOWN = "unknown"  # a machine or commit value of a log whose environment lacks the line
METADATA_KEYS = ("format", "track", "name", "date", "made", "description")  # statistics.json's command-line values
REASON_KEYS = ("mixed_machines_reason", "mixed_commits_reason")  # also from the command line, format 3 on
METRIC_STEPS = "steps"  # track.json "metric" of a track ranked by steps (fewest first) instead of train time


class RecordError(Exception):
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


def check_evaluation(log, track):
    """The run evaluated like every run of the track: on val_tokens of the track's val data."""
    if "val_tokens" in track and log.config.get("val_tokens") != track["val_tokens"]:
        raise RecordError(f"{log.path}: the run validated on val_tokens={log.config.get('val_tokens')}, "
                          f"the track evaluates on {track['val_tokens']}")
    required = track.get("val_data")
    if not required:
        return
    pattern = log.config.get("val_files", "")
    used = [fp for fp in log.data if fnmatch.fnmatch(fp.get("path", ""), pattern)]
    identity = list(dict.fromkeys(tuple(fp.get(k) for k in FINGERPRINT_KEYS) for fp in used))
    if identity != [tuple(fp[k] for k in FINGERPRINT_KEYS) for fp in required]:
        names = ", ".join(dict.fromkeys(fp.get("path", "?") for fp in used)) or "none"
        raise RecordError(f"{log.path}: the run's val data ({names}) is not the track's val data "
                          f"({', '.join(fp['path'] for fp in required)}, by size and content hashes)")


def read_log(path):
    """Parse and verify the log at `path`; refuse an unsealed log and an unfinished run."""
    try:
        log = parse_log(path)
        verify(log)
    except LogError as e:
        raise RecordError(str(e)) from None
    if not log.sealed:
        raise RecordError(f"{path}: a version-{log.version} log is not sealed; records are made from sealed "
                          f"logs (this repository's trainer writes them): rerun the run")
    if not log.finished:
        raise RecordError(f"{path}: the run {log.describe_ending()}; only finished runs make a record")
    return log


def check_fixed_config(log, fixed):
    """Refuse a run whose config differs from the track's fixed_config: the setup an entry may not change."""
    for key, value in fixed.items():
        if key not in log.config or log.config[key] != value:
            raise RecordError(f"{log.path}: the run's config changes {key}, which the track fixes (track.json "
                              "fixed_config): an entry may change the optimizer and its schedule, not the setup")


def load_logs(paths, track, role, required_environment=None, fixed_config=None):
    """Read `paths` (read_log); refuse other tracks' runs, other hardware, evaluation or fixed config,
    and mixed code or configs."""
    logs = []
    for path in paths:
        log = read_log(path)
        if log.config.get("track") != track["name"]:
            raise RecordError(f"{path}: the run's config says track {log.config.get('track')!r}, not {track['name']!r}")
        check_hardware(log, required_environment or {})
        check_fixed_config(log, fixed_config or {})
        check_evaluation(log, track)
        logs.append(log)
    for other in logs[1:]:
        if other.code_id != logs[0].code_id:
            raise RecordError(f"{role} logs come from different code: {describe_code_difference(logs[0], other)}")
        if free_config(other) != free_config(logs[0]):
            raise RecordError(f"{role} logs ran different configs: {describe_config_difference(logs[0], other)}")
    seen = {}
    for log in logs:
        if Path(log.path).name in RECORD_FILES:
            raise RecordError(f"{log.path}: a log may not be named like a record file ({', '.join(RECORD_FILES)})")
        for key, what in ((log.run_id, "run id"), (Path(log.path).name, "file name")):
            if key in seen:
                raise RecordError(f"{log.path} and {seen[key]} have the same {what} {key!r}")
            seen[key] = log.path
    return logs


def free_config(log):
    """The config without the values runs of one record may differ in (FREE_CONFIG_KEYS)."""
    return {k: v for k, v in log.config.items() if k not in FREE_CONFIG_KEYS}


def describe_config_difference(a, b):
    keys = sorted(k for k in set(free_config(a)) | set(free_config(b)) if a.config.get(k) != b.config.get(k))
    return f"{a.path} and {b.path} differ in {', '.join(keys)} (only {', '.join(FREE_CONFIG_KEYS)} may differ)"


def recorded_run_ids(records_dir):
    """{run id: record folder} of every run in any record of any track (logs inside record folders)."""
    found = {}
    for log_path in sorted(records_dir.glob("*/*/*.txt")):
        if log_path.parent.name.startswith("."):
            continue
        with log_path.open("rb") as f:
            first = f.readline()
        m = re.fullmatch(rb"speedrun-log v\d+ run_id=(\S+)\n?", first)
        if m:
            found[m[1].decode("ascii", errors="replace")] = log_path.parent
    return found


def refuse_recorded_runs(logs, records_dir):
    """A run counts in one record only: refuse logs whose run id is already part of one."""
    recorded = recorded_run_ids(records_dir)
    for log in logs:
        if log.run_id in recorded:
            raise RecordError(f"{log.path}: run {log.run_id} is already part of the record {recorded[log.run_id]}; "
                              f"a run counts once")


def expand_record_folders(paths, records_dir):
    """Replace each record folder in `paths` by the logs of its runs (listed in its statistics.json);
    every baseline log must lie inside a record folder, which the new record then references."""
    expanded = []
    for path in map(Path, paths):
        if path.is_dir():
            try:
                runs = json.loads((path / "statistics.json").read_text(encoding="utf-8"))["runs"]
                expanded += [str(path / run["log"]) for run in runs]
            except (OSError, json.JSONDecodeError, KeyError, TypeError):
                raise RecordError(f"{path}: a folder given as baseline logs must be a record folder "
                                  f"(its statistics.json lists each run's log)") from None
        else:
            expanded.append(str(path))
    root = records_dir.resolve()
    for path in expanded:
        if not Path(path).resolve().is_relative_to(root) or Path(path).resolve().parent == root:
            raise RecordError(f"{path}: baseline logs are referenced, not copied, so they must be part of a record; "
                              f"make one of them first (--allow-non-record if they are not a record)")
    return expanded


def describe_code_difference(a, b):
    """One line naming the source files whose hashes differ between logs a and b."""
    differing = sorted(
        path
        for path in set(a.declared_sha256) | set(b.declared_sha256)
        if a.declared_sha256.get(path) != b.declared_sha256.get(path)
    )
    return f"{a.path} and {b.path} differ in {', '.join(differing)}"


def machine_of(log):
    """The machine a run ran on: {cpu, hostname} from its environment."""
    return {key: log.environment.get(key, UNKNOWN) for key in MACHINE_KEYS}


def commit_of(log):
    return log.environment.get(COMMIT_KEY, UNKNOWN)


def describe_machine(machine):
    return f"cpu {machine['cpu']!r}, hostname {machine['hostname']!r}"


def check_one_machine(logs, baseline_logs, reason):
    """Refuse runs, the baseline's included, from more than one machine unless `reason` says why;
    refuse a reason where every run ran on one machine."""
    runs = list(logs) + list(baseline_logs)
    other = next((log for log in runs if machine_of(log) != machine_of(runs[0])), None)
    if other is not None and not reason:
        raise RecordError(
            f"{runs[0].path} ran on {describe_machine(machine_of(runs[0]))}, {other.path} on "
            f"{describe_machine(machine_of(other))}: a record's runs and its baseline's run on one machine "
            '(--mixed-machines-reason "why" makes the record anyway and states the reason)'
        )
    if other is None and reason is not None:
        raise RecordError(f"--mixed-machines-reason is given, but every run ran on "
                          f"{describe_machine(machine_of(runs[0]))}")


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


# ----------------------------------------------------------------------------- statistics


def run_row(log, statistics_format):
    """One run's line of statistics.json; from format 3 on with its machine and commit."""
    row = {
        "run_id": log.run_id,
        "log": Path(log.path).name,
        "final_val_loss": log.final["val_loss"],
        "train_time_ms": log.final["train_time_ms"],
        "steps": log.final["steps"],
    }
    if statistics_format >= FORMAT_WITH_MACHINES:
        row |= {**machine_of(log), COMMIT_KEY: commit_of(log)}
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


def baseline_statistics(logs, baseline_logs, repo_root, statistics_format=STATISTICS_FORMAT):
    """The baseline group's statistics, where its logs are, and how the record compares with it."""
    base = group_statistics(baseline_logs, statistics_format)
    base["logs"] = [Path(os.path.relpath(Path(log.path).resolve(), repo_root)).as_posix() for log in baseline_logs]
    record_losses = [log.final["val_loss"] for log in logs]
    record_times = [float(log.final["train_time_ms"]) for log in logs]
    base["welch_val_loss"] = welch_test(record_losses, base["val_loss"]["values"])
    base["welch_train_time"] = welch_test(record_times, base["train_time_ms"]["values"])
    base["speedup"] = base["train_time_ms"]["mean"] / float(np.mean(record_times))
    return base


def common_steps(logs):
    """The steps every run of a record trained (a steps track ranks records by them)."""
    steps = sorted({log.final["steps"] for log in logs})
    if len(steps) != 1:
        raise RecordError(f"the runs trained {', '.join(map(str, steps))} steps: the runs of a record on a steps "
                          "track train the same number of steps")
    return steps[0]


def decide_status(n, p_value, track, set_target, remeasured_baseline=False, margin_value=None):
    """(status, one-line reason) for a group of n runs with t-test p-value p_value; on a track with
    `z_margin` (margin_value given), by the margin rule instead of the t-test."""
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
    target = track["target_val_loss"]
    return STATUS_RECORD, f"mean final val loss is below the target {target:.6f} with p = {p_value:.4g} < {threshold}"


def record_statistics(logs, baseline_logs, track, set_target, repo_root, remeasured_baseline=False,
                      statistics_format=STATISTICS_FORMAT):
    """Everything statistics.json holds except what the command line gives (METADATA_KEYS, REASON_KEYS)."""
    group = group_statistics(logs, statistics_format)
    target = group["val_loss"]["mean"] if set_target else track["target_val_loss"]
    t, p = (None, None) if set_target else one_sample_test(group["val_loss"]["values"], target)
    by_steps = track.get("metric") == METRIC_STEPS
    margin_value = (margin_statistic(group["val_loss"]["values"], target)
                    if by_steps and "z_margin" in track and not set_target else None)
    status, reason = decide_status(len(logs), p, track, set_target, remeasured_baseline, margin_value)
    result = {
        "status": status,
        "status_reason": reason,
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
    return result


# ----------------------------------------------------------------------------- checking existing records


def read_statistics(path):
    """A record's statistics.json, with the values needed to recompute it checked for their types."""
    try:
        s = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON ({e}); restore what make_record.py wrote, or re-make the record") \
            from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text; restore what make_record.py wrote, or re-make the record") from None
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
    keys = METADATA_KEYS + ("status",) + (REASON_KEYS if s["format"] >= FORMAT_WITH_MACHINES else ())
    missing = [key for key in keys + ("runs", "baseline") if key not in s]
    if missing:
        return f"no {', '.join(missing)}"
    runs, baseline = s["runs"], s["baseline"]
    if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) and isinstance(r.get("log"), str)
                                                          for r in runs):
        return "runs is not a list of runs with their log files"
    if baseline is not None and not (isinstance(baseline, dict) and isinstance(baseline.get("logs"), list)
                                     and all(isinstance(p, str) for p in baseline["logs"])):
        return "baseline is neither null nor a group with its logs"
    return None


def record_folder_logs(folder, s):
    """The record's logs in the order its statistics list them; the folder must hold exactly those logs."""
    listed = [run["log"] for run in s["runs"]]
    present = sorted(p.name for p in folder.glob("*.txt") if p.name not in RECORD_FILES)
    if sorted(listed) != present:
        raise RecordError(f"{folder / 'statistics.json'}: lists the logs {', '.join(listed)}, but the folder holds "
                          f"{', '.join(present) or 'none'}")
    return [read_log(folder / name) for name in listed]


def recomputed_statistics(folder, s, track, repo_root):
    """What make_record.py writes for the record in `folder`, recomputed from its sealed logs (and its
    baseline's), with the command-line values (METADATA_KEYS, REASON_KEYS) and status flags taken from `s`."""
    statistics_format = s["format"]
    logs = record_folder_logs(folder, s)
    baseline_logs = [read_log(repo_root / path) for path in s["baseline"]["logs"]] if s["baseline"] else []
    given = {key: s[key] for key in METADATA_KEYS}
    if statistics_format >= FORMAT_WITH_MACHINES:
        given |= {key: s[key] for key in REASON_KEYS}
        check_one_machine(logs, baseline_logs, s["mixed_machines_reason"])
        check_one_commit(logs, s["mixed_commits_reason"])
    computed = record_statistics(logs, baseline_logs, track, s["status"] == STATUS_TARGET, repo_root,
                                 s["status"] == STATUS_BASELINE, statistics_format)
    return json.loads(json.dumps({**given, **computed}))


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


def check_record(folder, s, track, repo_root):
    """Refuse a record whose statistics.json is not what its logs give, or that is not the track's."""
    path = folder / "statistics.json"
    if s["track"] != track["name"] or folder.name != f"{s['date']}_{s['name']}":
        raise RecordError(f"{path}: names the record {s['track']}/{s['date']}_{s['name']}, but lies in "
                          f"{folder.parent.name}/{folder.name}")
    expected = recomputed_statistics(folder, s, track, repo_root)
    difference = first_difference(s, expected)
    if difference:
        raise RecordError(f"{path}: {difference} from the record's logs (and track.json): the file is not what "
                          "make_record.py wrote; restore it, or re-make the record")
    if s["status"] == STATUS_TARGET and s["target_val_loss"] != track["target_val_loss"]:
        raise RecordError(f"{path}: sets the target {s['target_val_loss']!r}, but the track's target_val_loss is "
                          f"{track['target_val_loss']!r}")


def checked_track_records(track_dir, track, repo_root):
    """(folder, statistics) of every record of the track (its folders holding a statistics.json), each
    checked against its logs (check_record)."""
    found = []
    for path in sorted(track_dir.glob("*/statistics.json")):
        if path.parent.name.startswith("."):  # a folder being built, or left by a killed make_record.py
            continue
        s = read_statistics(path)
        check_record(path.parent, s, track, repo_root)
        found.append((path.parent, s))
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
    lines = [
        f"# {s['name']}",
        "",
        f"Track: [{s['track']}](../README.md) · date: {s['date']} · status: {s['status']}",
        "",
        "## What changed",
        "",
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
        f"python records/reproduce.py {folder_rel}/{first_log} --run",
        "```",
        "",
        "This recreates the exact sources embedded in the log in a fresh folder and runs them with the logged config.",
        "",
    ]
    return "\n".join(lines)


def machine_lines(s):
    """The record README's "Machine" section: the machines (CPU model, hostname) and commits the runs
    and the baseline's runs ran on, with the reasons given for more than one."""
    groups = [("", s["runs"])] + ([("baseline ", s["baseline"]["runs"])] if s["baseline"] else [])
    lines = ["## Machine", ""]
    for what, key, reason_key in (("machine", MACHINE_KEYS, "mixed_machines_reason"),
                                  ("commit", (COMMIT_KEY,), "mixed_commits_reason")):
        used = {}
        for prefix, runs in groups:
            for run in runs:
                used.setdefault(tuple(run[k] for k in key), []).append(prefix + run["run_id"])
        for value, run_ids in used.items():
            shown = f"CPU `{value[0]}`, hostname `{value[1]}`" if what == "machine" else f"`{value[0]}`"
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


def write_plot(path, logs, baseline_logs, target, title):
    """Each run's losses against train time: the next-token train loss (smoothed, thin) and every
    validation (dots), the baseline's runs dashed in grey, the target as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    groups = ((logs, "-", None, ""), (baseline_logs, "--", "grey", "baseline "))
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


def write_record(folder, s, logs, baseline_logs, folder_rel):
    """Fill `folder` (empty) with the record's logs, statistics, plot and README."""
    for log in logs:
        shutil.copyfile(log.path, folder / Path(log.path).name)
    (folder / "statistics.json").write_text(json.dumps(s, indent=2) + "\n", encoding="utf-8")
    (folder / "statistics.txt").write_text(statistics_text(s), encoding="utf-8")
    title = f"{s['track']}: {s['name']} ({s['date']})"
    write_plot(folder / PLOT_NAME, logs, baseline_logs, s["target_val_loss"], title)
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


def publish(staging, folder, files):
    """Make the record built in `staging` (a hidden folder next to `folder`) and the {path: text} of
    `files` visible: each text goes to a temporary file next to its path, then the folder is renamed into
    place and each file over its destination. When anything fails before the folder's rename, the
    staging folder and the temporary files are removed."""
    staged = {}
    try:
        for path, text in files.items():
            staged[path] = staged_file(path, text)
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
        raise
    for path, tmp in staged.items():
        os.replace(tmp, path)


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


def previous_record(s, found):
    """The record that was the track's best (steps_rank) when `s` was made: among those made
    before it (date, then time made), or None for the first."""
    earlier = [t for _, t in found if (t["date"], t["made"]) < (s["date"], s["made"])]
    return min(earlier, key=steps_rank) if earlier else None


def steps_table(found, link_base, definition):
    """A steps track's table: fewest steps first, each record's significance and its pairwise
    statistic against the previous record (previous_record)."""
    margin_rule = "z_margin" in definition
    significance = "(target - mean) x sqrt(n)" if margin_rule else "p"
    lines = [
        f"| # | date | record | steps | mean val loss | {significance} | runs | pairwise vs previous record |",
        "|---|---|---|---|---|---|---|---|",
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
            f"| {rank} | {s['date']} | [{s['name']}]({link}) | {s['steps']} | {s['val_loss']['mean']:.4f} | {value} "
            f"| {s['n']} | {pairwise} |"
        )
    return "\n".join(lines)


def records_table(records, link_base, definition=None):
    """The markdown table of the (folder, statistics) `records` whose status is record or target,
    largest speed-up first (a steps track: steps_table); links are relative to link_base.
    definition: the track's track.json (default: a track ranked by train time)."""
    found = [(folder, s) for folder, s in records if s["status"] in (STATUS_RECORD, STATUS_TARGET)]
    if not found:
        return "_No records yet._"
    if definition and definition.get("metric") == METRIC_STEPS:
        return steps_table(found, link_base, definition)
    first_time = min(found, key=lambda item: (item[1]["date"], item[1]["made"]))[1]["train_time_ms"]["mean"]
    lines = [
        "| # | date | record | mean val loss | p | mean train time | runs | speed-up vs baseline |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ranked = sorted(found, key=lambda item: -speedup(item[1], first_time))
    for rank, (folder, s) in enumerate(ranked, start=1):
        link = Path(os.path.relpath(folder, link_base)).as_posix()
        p = "sets target" if s["status"] == STATUS_TARGET else fmt(s["p_value"], ".2g")
        lines.append(
            f"| {rank} | {s['date']} | [{s['name']}]({link}) | {s['val_loss']['mean']:.4f} | {p} "
            f"| {s['train_time_s']['mean']:.1f} s | {s['n']} | {speedup(s, first_time):.2f}x |"
        )
    return "\n".join(lines)


def with_table(readme, records, track, definition=None):
    """The text of `readme` with the track's table between its markers rebuilt from `records`, or None
    where the file or its markers are missing. definition: the track's track.json (records_table)."""
    start, end = table_markers(track)
    text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        return None
    table = records_table(records, readme.resolve().parent, definition)
    return text[: i + len(start)] + "\n" + table + "\n" + text[j:]


def missing_markers_warning(readme, track):
    start, end = table_markers(track)
    return (f"warning: {readme} has no '{start}' ... '{end}' markers; "
            f"add both where the {track} table should go and run this tool again to fill it")


# ----------------------------------------------------------------------------- command line


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Build a record folder from run logs and update the README table.",
        epilog="Exit code 2 (and nothing written) when the logs are refused.",
    )
    parser.add_argument("--track", required=True, help="track folder name, e.g. track_cpu")
    parser.add_argument("--name", required=True, help="record name (letters, digits, '_', '-', '.')")
    parser.add_argument("--logs", nargs="+", required=True, help="logs of the runs")
    parser.add_argument(
        "--baseline-logs", nargs="+", default=[], help="logs (or a record folder) to compare against: Welch t-tests"
    )
    parser.add_argument("--description", default="", help="what changed (goes into the record README)")
    parser.add_argument("--date", default=datetime.date.today().isoformat(), help="YYYY-MM-DD (default: today)")
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
    parser.add_argument("--records-dir", type=Path, default=RECORDS_DIR, help="root of the track folders")
    parser.add_argument("--readme", type=Path, default=RECORDS_DIR.parent / "README.md", help="README to update")
    return parser.parse_args(argv)


def load_track(track_dir):
    path = track_dir / "track.json"
    try:
        track = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path}: no such track definition; is --track spelled right?") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON ({e})") from None
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
    args.description = utf8_argument(args.description, "--description")
    args.mixed_machines_reason = utf8_argument(args.mixed_machines_reason, "--mixed-machines-reason")
    args.mixed_commits_reason = utf8_argument(args.mixed_commits_reason, "--mixed-commits-reason")


def check_arguments(args, track):
    if not NAME_PATTERN.fullmatch(args.name):
        raise RecordError(f"--name {args.name!r}: use letters, digits, '_', '-', '.', starting with a letter or digit")
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
    if args.set_target_from_these_logs and len(args.logs) < track.get("min_runs", 1):
        raise RecordError(f"setting the target needs at least {track['min_runs']} runs, got {len(args.logs)}")


def make_record(args):
    """Check everything, then make the record folder, the target (if asked) and the README tables
    visible together (publish)."""
    decode_text_arguments(args)
    track_dir = args.records_dir / args.track
    track = load_track(track_dir)
    check_arguments(args, track)
    folder = track_dir / f"{args.date}_{args.name}"
    if folder.exists():
        raise RecordError(f"{folder} already exists; choose another --name or --date")
    logs = load_logs(args.logs, track, "the", track.get("required_environment"), track.get("fixed_config"))
    refuse_recorded_runs(logs, args.records_dir)
    if any(log.final["train_time_ms"] <= 0 for log in logs):
        raise RecordError("a run with 0 ms of training is not a run: check its num_iterations")
    baseline_paths = expand_record_folders(args.baseline_logs, args.records_dir)
    baseline_logs = load_logs(baseline_paths, track, "baseline") if baseline_paths else []
    check_one_machine(logs, baseline_logs, args.mixed_machines_reason)
    check_one_commit(logs, args.mixed_commits_reason)
    repo_root = args.readme.resolve().parent
    s = {
        "format": STATISTICS_FORMAT,
        "track": args.track,
        "name": args.name,
        "date": args.date,
        "made": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "description": args.description,
        "mixed_machines_reason": args.mixed_machines_reason,
        "mixed_commits_reason": args.mixed_commits_reason,
        **record_statistics(logs, baseline_logs, track, args.set_target_from_these_logs, repo_root,
                            args.remeasured_baseline),
    }
    if s["status"] == STATUS_NOT_RECORD and not args.allow_non_record:
        raise RecordError(f"not a record: {s['status_reason']} (use --allow-non-record to keep it anyway)")

    records = checked_track_records(track_dir, track, repo_root) + [(folder, s)]
    files, notes = {}, []
    for readme in (args.readme, track_dir / "README.md"):
        text = with_table(readme, records, args.track, track)
        if text is not None:
            files[readme] = text
        elif readme == args.readme:
            notes.append(missing_markers_warning(readme, args.track))
    if args.set_target_from_these_logs:
        track["target_val_loss"] = s["target_val_loss"]
        track["target_note"] = f"mean final val loss of the {s['n']} runs of record {folder.name}"
        files[track_dir / "track.json"] = json.dumps(track, indent=2) + "\n"
    for path in files:
        refuse_read_only(path)

    staging = Path(tempfile.mkdtemp(dir=track_dir, prefix=f".{folder.name}."))
    try:
        folder_rel = Path(os.path.relpath(folder, repo_root)).as_posix()
        write_record(staging, s, logs, baseline_logs, folder_rel)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish(staging, folder, files)
    print(statistics_text(s), end="")
    print(f"wrote {folder}")
    for warning in notes:
        print(warning, file=sys.stderr)


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
