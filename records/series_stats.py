"""The statistics of a series and the status they give (records/significance.py has the tests):
each run's row, the runs' and the baseline's summaries, the current record's re-runs, the rule of
a time-ranked or a steps-ranked track, and the line a refused result prints."""

import os
from pathlib import Path

import numpy as np

from records.record_files import (MS_PER_S, STATISTICS_FORMAT, STATUS_BASELINE, STATUS_NOT_RECORD, STATUS_RECORD,
                                  STATUS_TARGET, RecordError, fmt)
from records.rules import (COMMIT_KEY, FORMAT_WITH_IDENTITY, FORMAT_WITH_MACHINES, METRIC_STEPS, UNKNOWN, commit_of,
                           machine_of)
from records.significance import (margin_statistic, one_sample_test, runs_needed, summary, val_loss_summary,
                                  welch_runs_needed, welch_test)

RUN_KEYS = ("gpu", "bf16_gemm", "started")  # from format 4 on: more of each run's environment in its row


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


def speedup(s, first_time):
    """A record's speed-up over the baseline: its own baseline runs' mean train time over its own
    where it has them (the same machine, interleaved), else the first record's over its own."""
    if s["status"] == STATUS_TARGET:
        return 1.0
    if s.get("baseline"):
        return s["baseline"]["speedup"]
    return first_time / s["train_time_ms"]["mean"]
