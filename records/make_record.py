"""Turn the logs of N runs into a record folder and update the README's table for the track.

    python records/make_record.py --track track_cpu --name MyChange --logs logs/a.txt logs/b.txt logs/c.txt \
        [--baseline-logs ...] [--description "what changed"] [--date YYYY-MM-DD]

Every log is parsed and verified (records/logfile.py): it must be sealed (format
version 2) with every line matching its seal, each embedded source must match
its declared sha256, every run must have finished, and the track's rules hold:
the config names the track, the run evaluated on the track's val data (by
fingerprint) and val_tokens, on the track's hardware; all logs come from the
same code (the same set of (path, sha256) pairs) and the same config apart from
the seed; no run id is already part of a record. Baseline logs must agree among
themselves and be part of a record already (they are referenced, not copied).
Any refusal prints one line and exits with code 2 before anything is written.

The record folder records/<track>/<date>_<name>/ holds the logs and what this
tool computes from them: statistics.json and statistics.txt, val_loss.png and a
README. A log is its run's snapshot (records/reproduce.py recreates the sources
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
"""

import argparse
import datetime
import json
import math
import os
import fnmatch
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
from scipy import stats

RECORDS_DIR = Path(__file__).resolve().parent  # default root of the track folders
sys.path.insert(0, str(RECORDS_DIR.parent))
from records.logfile import LogError, parse_log, verify  # noqa: E402

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


def load_logs(paths, track, role, required_environment=None):
    """Parse and verify `paths`; refuse unsealed, unfinished or other tracks' runs, other hardware
    or evaluation, and mixed code or configs."""
    logs = []
    for path in paths:
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
        if log.config.get("track") != track["name"]:
            raise RecordError(f"{path}: the run's config says track {log.config.get('track')!r}, not {track['name']!r}")
        check_hardware(log, required_environment or {})
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
        first = log_path.open("rb").readline()
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
                runs = json.loads((path / "statistics.json").read_text())["runs"]
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


# ----------------------------------------------------------------------------- statistics


def finite_or_none(x):
    x = float(x)
    return x if math.isfinite(x) else None


def t_test_applicable(*samples):
    """A t-test needs two or more values per sample and a nonzero standard error (some spread somewhere)."""
    return all(len(s) >= 2 for s in samples) and any(np.ptp(s) > 0 for s in samples)


def summary(values):
    return {
        "values": list(values),
        "mean": float(np.mean(values)),
        "median": float(np.median(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
    }


def val_loss_summary(values):
    return {
        "values": list(values),
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
    }


def one_sample_test(values, target):
    """One-sided one-sample t-test of H1: mean(values) < target; (t, p), or (None, None) when undefined."""
    if target is None or not t_test_applicable(values):
        return None, None
    result = stats.ttest_1samp(values, target, alternative="less")
    return finite_or_none(result.statistic), finite_or_none(result.pvalue)


def welch_test(record, baseline):
    """One-sided Welch t-test of H1: mean(record) < mean(baseline); a dict, or None when undefined."""
    if not t_test_applicable(record, baseline):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(record, baseline, equal_var=False, alternative="less")
    return {
        "alternative": "record mean < baseline mean",
        "t": finite_or_none(result.statistic),
        "p": finite_or_none(result.pvalue),
    }


def run_rows(logs):
    return [
        {
            "run_id": log.run_id,
            "log": Path(log.path).name,
            "final_val_loss": log.final["val_loss"],
            "train_time_ms": log.final["train_time_ms"],
            "steps": log.final["steps"],
        }
        for log in logs
    ]


def group_statistics(logs):
    """Statistics of one group of runs that need no target: val loss and train time summaries."""
    losses = [log.final["val_loss"] for log in logs]
    times_ms = [float(log.final["train_time_ms"]) for log in logs]
    return {
        "n": len(logs),
        "val_loss": val_loss_summary(losses),
        "train_time_ms": summary(times_ms),
        "train_time_s": summary([t / MS_PER_S for t in times_ms]),
        "runs": run_rows(logs),
        "code": dict(sorted(logs[0].declared_sha256.items())),
    }


def baseline_statistics(logs, baseline_logs, repo_root):
    """The baseline group's statistics, where its logs are, and how the record compares with it."""
    base = group_statistics(baseline_logs)
    base["logs"] = [Path(os.path.relpath(Path(log.path).resolve(), repo_root)).as_posix() for log in baseline_logs]
    record_losses = [log.final["val_loss"] for log in logs]
    record_times = [float(log.final["train_time_ms"]) for log in logs]
    base["welch_val_loss"] = welch_test(record_losses, base["val_loss"]["values"])
    base["welch_train_time"] = welch_test(record_times, base["train_time_ms"]["values"])
    base["speedup"] = base["train_time_ms"]["mean"] / float(np.mean(record_times))
    return base


def decide_status(n, p_value, track, set_target, remeasured_baseline=False):
    """(status, one-line reason) for a group of n runs with t-test p-value p_value."""
    min_runs, threshold = track.get("min_runs", 1), track["p_threshold"]
    if set_target:
        return STATUS_TARGET, f"sets the track's target: the mean final val loss of these {n} runs"
    if remeasured_baseline:
        return STATUS_BASELINE, (f"the track's baseline re-measured on another machine ({n} runs): records made "
                                 "there compare their train time with it, not with the first record's")
    if n < min_runs:
        return STATUS_NOT_RECORD, f"only {n} run(s); the track requires at least {min_runs}"
    if p_value is None:
        return STATUS_NOT_RECORD, "the t-test is undefined (fewer than 2 runs or identical final losses)"
    if p_value >= threshold:
        return STATUS_NOT_RECORD, f"p = {p_value:.4g} is not below {threshold}: the target is not met significantly"
    target = track["target_val_loss"]
    return STATUS_RECORD, f"mean final val loss is below the target {target:.6f} with p = {p_value:.4g} < {threshold}"


def record_statistics(logs, baseline_logs, track, set_target, repo_root, remeasured_baseline=False):
    """Everything statistics.json holds except the names and dates."""
    group = group_statistics(logs)
    target = group["val_loss"]["mean"] if set_target else track["target_val_loss"]
    t, p = (None, None) if set_target else one_sample_test(group["val_loss"]["values"], target)
    status, reason = decide_status(len(logs), p, track, set_target, remeasured_baseline)
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
    result["baseline"] = baseline_statistics(logs, baseline_logs, repo_root) if baseline_logs else None
    return result


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
    lines += [f"![train and val loss against train time]({PLOT_NAME})", "", "## Code", ""]
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
    (folder / "statistics.json").write_text(json.dumps(s, indent=2) + "\n")
    (folder / "statistics.txt").write_text(statistics_text(s))
    title = f"{s['track']}: {s['name']} ({s['date']})"
    write_plot(folder / PLOT_NAME, logs, baseline_logs, s["target_val_loss"], title)
    (folder / "README.md").write_text(readme_text(s, folder_rel, Path(logs[0].path).name))


def write_json_atomically(path, value):
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- the README table


def table_markers(track):
    return f"<!-- records:{track}:start -->", f"<!-- records:{track}:end -->"


def load_track_records(track_dir):
    """(folder, statistics) of every record in the track that belongs in the table (status record or target)."""
    found = []
    for stats_path in sorted(track_dir.glob("*/statistics.json")):
        s = json.loads(stats_path.read_text())
        if s.get("status") in (STATUS_RECORD, STATUS_TARGET):
            found.append((stats_path.parent, s))
    return found


def speedup(s, first_time):
    """A record's speed-up over the baseline: its own baseline runs' mean train time over its own
    where it has them (the same machine, interleaved), else the first record's over its own."""
    if s["status"] == STATUS_TARGET:
        return 1.0
    if s.get("baseline"):
        return s["baseline"]["speedup"]
    return first_time / s["train_time_ms"]["mean"]


def records_table(track_dir, link_base):
    """The markdown table of a track's records, largest speed-up first; links are relative to link_base."""
    found = load_track_records(track_dir)
    if not found:
        return "_No records yet._"
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


def update_readme_table(readme, track_dir, track):
    """Regenerate the track's table between its markers in `readme`; warn (do not fail) if they are missing."""
    start, end = table_markers(track)
    text = readme.read_text() if readme.is_file() else ""
    i, j = text.find(start), text.find(end)
    if i < 0 or j < i:
        print(
            f"warning: {readme} has no '{start}' ... '{end}' markers; "
            f"add both where the {track} table should go and run this tool again to fill it",
            file=sys.stderr,
        )
        return False
    table = records_table(track_dir, readme.resolve().parent)
    readme.write_text(text[: i + len(start)] + "\n" + table + "\n" + text[j:])
    return True


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
    parser.add_argument("--records-dir", type=Path, default=RECORDS_DIR, help="root of the track folders")
    parser.add_argument("--readme", type=Path, default=RECORDS_DIR.parent / "README.md", help="README to update")
    return parser.parse_args(argv)


def load_track(track_dir):
    path = track_dir / "track.json"
    try:
        track = json.loads(path.read_text())
    except FileNotFoundError:
        raise RecordError(f"{path}: no such track definition; is --track spelled right?") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON ({e})") from None
    return track


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
    """Validate everything, then write the record folder, the target (if asked) and the README table."""
    track_dir = args.records_dir / args.track
    track = load_track(track_dir)
    check_arguments(args, track)
    folder = track_dir / f"{args.date}_{args.name}"
    if folder.exists():
        raise RecordError(f"{folder} already exists; choose another --name or --date")
    logs = load_logs(args.logs, track, "the", track.get("required_environment"))
    refuse_recorded_runs(logs, args.records_dir)
    if any(log.final["train_time_ms"] <= 0 for log in logs):
        raise RecordError("a run with 0 ms of training is not a run: check its num_iterations")
    baseline_paths = expand_record_folders(args.baseline_logs, args.records_dir)
    baseline_logs = load_logs(baseline_paths, track, "baseline") if baseline_paths else []
    s = {
        "format": 2,  # 2: logs and computed files only; baseline runs referenced by path
        "track": args.track,
        "name": args.name,
        "date": args.date,
        "made": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "description": args.description,
        **record_statistics(logs, baseline_logs, track, args.set_target_from_these_logs, args.readme.resolve().parent,
                            args.remeasured_baseline),
    }
    if s["status"] == STATUS_NOT_RECORD and not args.allow_non_record:
        raise RecordError(f"not a record: {s['status_reason']} (use --allow-non-record to keep it anyway)")

    staging = Path(tempfile.mkdtemp(dir=track_dir, prefix=f".{folder.name}."))
    try:
        folder_rel = os.path.relpath(folder, args.readme.resolve().parent)
        write_record(staging, s, logs, baseline_logs, Path(folder_rel).as_posix())
        staging.rename(folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if args.set_target_from_these_logs:
        track["target_val_loss"] = s["target_val_loss"]
        track["target_note"] = f"mean final val loss of the {s['n']} runs of record {folder.name}"
        write_json_atomically(track_dir / "track.json", track)
    print(statistics_text(s), end="")
    print(f"wrote {folder}")
    update_readme_table(args.readme, track_dir, args.track)


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
