"""Plot the losses of one run or several, from their logs.

    python records/plot.py LOG [LOG ...] [--x step|time] [--out PATH]

Each log's next-token train loss (a line) and its validations (dots) against the step (or the
train time), the track's target as a horizontal line, one colour per run. The picture goes to
--out, by default next to the first log as <run id>_loss.png (in the current folder when that log
lies in records/, which only make_record.py writes). A run that did not finish is plotted as far
as it went. A file that is not a run log ends the command with one `error:` line.
"""
import argparse
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from records.logfile import LogError, inside_records, parse_log, track_target  # noqa: E402

FIGURE_INCHES = (8, 5)             # width, height of the picture
FIGURE_DPI = 100                   # pixels per inch of the saved picture
MS_PER_S = 1000
EXIT_REFUSED = 2                   # a file that is not a run log, or a picture that cannot be written


def series(log, x):
    """((xs, train losses), (xs, val losses)) of a parsed log, xs the steps or the train time in s;
    non-finite train losses left out."""
    def at(step, ms):
        return step if x == "step" else ms / MS_PER_S
    train = [(at(p["step"], p["train_time_ms"]), p["train_loss"]) for p in log.steps if math.isfinite(p["train_loss"])]
    val = [(at(step, ms), loss) for step, loss, ms in log.val_points]
    return tuple(zip(*train)) or ((), ()), tuple(zip(*val)) or ((), ())


def figure(logs, x="step"):
    """The matplotlib Figure of the logs' losses (see the module's docstring)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=FIGURE_INCHES)
    for log in logs:
        (train_x, train_y), (val_x, val_y) = series(log, x)
        (line,) = ax.plot(train_x, train_y, "-", linewidth=1, label=f"{log.run_id} train")
        ax.plot(val_x, val_y, "o", markersize=5, color=line.get_color(), label=f"{log.run_id} val")
    targets = {(log.config.get("track"), track_target(log.config.get("track", "none"))) for log in logs}
    for track, target in sorted(t for t in targets if t[1] is not None):
        ax.axhline(target, color="black", linestyle=":", linewidth=1, label=f"{track} target {target:.4f}")
    ax.set_xlabel("step" if x == "step" else "train time (s)")
    ax.set_ylabel("loss (nats per token)")
    presets = ", ".join(sorted({str(log.config.get("preset", "?")) for log in logs}))
    ax.set_title(f"{logs[0].run_id} ({presets}): {logs[0].describe_ending()}" if len(logs) == 1 else
                 f"{len(logs)} runs ({presets})", fontsize="small")
    ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def default_out(log_path):
    """<run id>_loss.png next to the log, or in the current folder for a log in records/."""
    folder = Path(".") if inside_records(log_path) else Path(log_path).parent
    return folder / f"{Path(log_path).stem}_loss.png"


def out_refusal(out, given):
    """Why the picture cannot go to `out`, checked before the logs are read: in records/, a kind of
    file matplotlib does not write (by its suffix), a missing folder, a file that exists where --out
    is `given` (the default, <run id>_loss.png, is this tool's own); or None."""
    if inside_records(out):
        return f"{out} lies in records/, which only records/make_record.py writes: give --out elsewhere"
    if given and os.path.lexists(out):
        return f"--out {out} exists: plot.py writes a new file, never over one; give --out a new path"
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in kinds:
        return (f"--out {out}: matplotlib writes no {out.suffix or 'suffix-less'} files; end it in one of "
                f"{', '.join('.' + kind for kind in sorted(kinds))}")
    if not out.parent.is_dir():
        return f"cannot write {out} (its folder {out.parent} does not exist): give --out a writable path"
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("logs", nargs="+", metavar="LOG", help="run logs (logs/<run id>.txt)")
    parser.add_argument("--x", choices=("step", "time"), default="step", help="the horizontal axis")
    parser.add_argument("--out", default=None, help="where the PNG goes (default: <run id>_loss.png next to the "
                                                     "first log)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else default_out(args.logs[0])
    refusal = out_refusal(out, given=args.out is not None)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        logs = [parse_log(path) for path in args.logs]
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    fig = figure(logs, args.x)
    try:
        fig.savefig(out, dpi=FIGURE_DPI)
    except OSError as e:
        print(f"error: cannot write {out} ({e.strerror}): give --out a writable path", file=sys.stderr)
        return EXIT_REFUSED
    print(f"wrote {out}: {len(logs)} run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
