"""Writing a record folder: statistics.txt and README.md from the statistics, the loss-curve plot,
and the files staged beside their destinations, then renamed into place (nothing is visible
before every file is written)."""

import json
import math
import os
import shlex
import shutil
import stat
import tempfile
from pathlib import Path

from records.record_files import (MS_PER_S, PLOT_NAME, PLOT_SIZE, STATUS_BASELINE, STATUS_NOT_RECORD, STATUS_RECORD,
                                  STATUS_TARGET, RecordError, fmt)
from records.rules import (COMMIT_KEY, FORMAT_WITH_IDENTITY, FORMAT_WITH_MACHINES, IDENTITY_KEYS, MACHINE_KEYS,
                           METRIC_STEPS)

RECORD_FOLDER_MODE = 0o755  # a record folder's permissions
TRAIN_LOSS_SMOOTHING = 0.8  # EMA weight of the plotted train loss curve


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
