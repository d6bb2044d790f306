"""Turn the logs of N runs into a record folder and update the README's table for the track.

    python records/make_record.py --track track_cpu --name MyChange --logs logs/a.txt logs/b.txt logs/c.txt \
        [--baseline-logs ...] [--description "what changed"] [--date YYYY-MM-DD]

Every log is parsed and verified (records/logfile.py): each embedded source must
match its declared sha256, every run must have finished, every log must name
the track in its config, and all logs must come from the same code (the same
set of (path, sha256) pairs). Baseline logs must agree among themselves but may
come from other code. Any refusal prints one line and exits with code 2 before
anything is written.

The record folder records/<track>/<date>_<name>/ holds the logs, the sources
they embed (source/), statistics.json and statistics.txt, val_loss.png and a
README. The statistics: n, mean and sample std of the final val loss, a
one-sided one-sample t-test of H1 "mean < target", train time summaries, and
with baseline logs one-sided Welch t-tests of H1 "record < baseline" on final
val loss and on train time, plus the speed-up of mean train times.

A result is a record when it has at least the track's min_runs runs and
p < p_threshold. Anything else is refused unless --allow-non-record is given,
which writes the folder marked "not a record" (kept out of the README table).
A track whose target is still null (the CPU track before its baseline) needs
--set-target-from-these-logs: the mean final val loss of these logs becomes the
target in track.json, and the record is marked as the one that set it.
"""

import argparse
import datetime
import json
import math
import os
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
PLOT_NAME = "val_loss.png"  # the record's loss-curve plot
RECORD_FILES = ("README.md", "statistics.json", "statistics.txt", PLOT_NAME, "source", "baseline")  # besides logs


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


def load_logs(paths, track, role, required_environment=None):
    """Parse and verify `paths`; refuse unfinished runs, runs of another track or hardware, and mixed code."""
    logs = []
    for path in paths:
        try:
            log = parse_log(path)
            verify(log)
        except LogError as e:
            raise RecordError(str(e)) from None
        if not log.finished:
            raise RecordError(f"{path}: the run did not finish (no final line); only finished runs make a record")
        if log.config.get("track") != track:
            raise RecordError(f"{path}: the run's config says track {log.config.get('track')!r}, not {track!r}")
        check_hardware(log, required_environment or {})
        logs.append(log)
    for other in logs[1:]:
        if other.code_id != logs[0].code_id:
            raise RecordError(f"{role} logs come from different code: {describe_code_difference(logs[0], other)}")
    seen = {}
    for log in logs:
        if Path(log.path).name in RECORD_FILES:
            raise RecordError(f"{log.path}: a log may not be named like a record file ({', '.join(RECORD_FILES)})")
        for key, what in ((log.run_id, "run id"), (Path(log.path).name, "file name")):
            if key in seen:
                raise RecordError(f"{log.path} and {seen[key]} have the same {what} {key!r}")
            seen[key] = log.path
    return logs


def expand_record_folders(paths):
    """Replace each record folder in `paths` by the logs of its runs (listed in its statistics.json)."""
    expanded = []
    for path in map(Path, paths):
        if path.is_dir():
            try:
                runs = json.loads((path / "statistics.json").read_text())["runs"]
            except (OSError, json.JSONDecodeError, KeyError):
                raise RecordError(f"{path}: a folder given as logs must be a record folder (statistics.json)") from None
            expanded += [str(path / run["log"]) for run in runs]
        else:
            expanded.append(str(path))
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


def baseline_statistics(logs, baseline_logs):
    """The baseline group's statistics and how the record compares with it."""
    base = group_statistics(baseline_logs)
    record_losses = [log.final["val_loss"] for log in logs]
    record_times = [float(log.final["train_time_ms"]) for log in logs]
    base["welch_val_loss"] = welch_test(record_losses, base["val_loss"]["values"])
    base["welch_train_time"] = welch_test(record_times, base["train_time_ms"]["values"])
    base["speedup"] = base["train_time_ms"]["mean"] / float(np.mean(record_times))
    return base


def decide_status(n, p_value, track, set_target):
    """(status, one-line reason) for a group of n runs with t-test p-value p_value."""
    min_runs, threshold = track.get("min_runs", 1), track["p_threshold"]
    if set_target:
        return STATUS_TARGET, f"sets the track's target: the mean final val loss of these {n} runs"
    if n < min_runs:
        return STATUS_NOT_RECORD, f"only {n} run(s); the track requires at least {min_runs}"
    if p_value is None:
        return STATUS_NOT_RECORD, "the t-test is undefined (fewer than 2 runs or identical final losses)"
    if p_value >= threshold:
        return STATUS_NOT_RECORD, f"p = {p_value:.4g} is not below {threshold}: the target is not met significantly"
    target = track["target_val_loss"]
    return STATUS_RECORD, f"mean final val loss is below the target {target:.6f} with p = {p_value:.4g} < {threshold}"


def record_statistics(logs, baseline_logs, track, set_target):
    """Everything statistics.json holds except the names and dates."""
    group = group_statistics(logs)
    target = group["val_loss"]["mean"] if set_target else track["target_val_loss"]
    t, p = (None, None) if set_target else one_sample_test(group["val_loss"]["values"], target)
    status, reason = decide_status(len(logs), p, track, set_target)
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
    result["baseline"] = baseline_statistics(logs, baseline_logs) if baseline_logs else None
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
        lines += ["Baseline logs (and their own sources, embedded in them) are in `baseline/`.", ""]
    lines += [f"![val loss against train time]({PLOT_NAME})", "", "## Code", ""]
    lines += [f"Every log embeds the same {len(s['code'])} source file(s); they are in `source/`:", ""]
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


def write_plot(path, logs, baseline_logs, target, title):
    """Val loss against train time for every run (baseline runs dashed), with the target as a horizontal line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for group, style, prefix in ((logs, "-", ""), (baseline_logs, "--", "baseline ")):
        for log in group:
            points = log.val_points or [(log.final["steps"], log.final["val_loss"], log.final["train_time_ms"])]
            seconds = [ms / MS_PER_S for _, _, ms in points]
            losses = [loss for _, loss, _ in points]
            ax.plot(seconds, losses, style, marker="o", markersize=3, label=prefix + log.run_id)
    if target is not None:
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"target {target:.4f}")
    ax.set_xlabel("train time (s)")
    ax.set_ylabel("val loss")
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_sources(folder, sources):
    for relpath, content in sources.items():
        dest = folder / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(content)


def write_record(folder, s, logs, baseline_logs, folder_rel):
    """Fill `folder` (empty) with the record's logs, sources, statistics, plot and README."""
    for log in logs:
        shutil.copyfile(log.path, folder / Path(log.path).name)
    write_sources(folder / "source", logs[0].sources)
    if baseline_logs:
        (folder / "baseline").mkdir()
        for log in baseline_logs:
            shutil.copyfile(log.path, folder / "baseline" / Path(log.path).name)
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


def records_table(track_dir, link_base):
    """The markdown table of a track's records, fastest first; links are relative to link_base."""
    found = load_track_records(track_dir)
    if not found:
        return "_No records yet._"
    first_time = min(found, key=lambda item: (item[1]["date"], item[1]["made"]))[1]["train_time_ms"]["mean"]
    lines = [
        "| # | date | record | mean val loss | p | mean train time | runs | speed-up vs first record |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ranked = sorted(found, key=lambda item: item[1]["train_time_ms"]["mean"])
    for rank, (folder, s) in enumerate(ranked, start=1):
        link = Path(os.path.relpath(folder, link_base)).as_posix()
        p = "sets target" if s["status"] == STATUS_TARGET else fmt(s["p_value"], ".2g")
        speedup = first_time / s["train_time_ms"]["mean"]
        lines.append(
            f"| {rank} | {s['date']} | [{s['name']}]({link}) | {s['val_loss']['mean']:.4f} | {p} "
            f"| {s['train_time_s']['mean']:.1f} s | {s['n']} | {speedup:.2f}x |"
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
    logs = load_logs(args.logs, args.track, "the", track.get("required_environment"))
    baseline_paths = expand_record_folders(args.baseline_logs)
    baseline_logs = load_logs(baseline_paths, args.track, "baseline") if baseline_paths else []
    s = {
        "format": 1,
        "track": args.track,
        "name": args.name,
        "date": args.date,
        "made": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "description": args.description,
        **record_statistics(logs, baseline_logs, track, args.set_target_from_these_logs),
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
