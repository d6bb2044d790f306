"""records/plot.py: one picture of runs' losses from their logs. The plotted points are compared
with the log's own step and val lines, read here with a regex of their own."""
import os
import re
import subprocess
import sys

from tiny_runs import REPO

sys.path.insert(0, REPO)
from records import plot  # noqa: E402
from records.logfile import parse_log  # noqa: E402

RECORD = os.path.join(REPO, "records", "track_cpu", "2026-12-02_NorMuon25Steps")
STEP = re.compile(r"step:(\d+)/\d+ train_loss:(\S+) objective:\S+ train_time:(\d+)ms")
VAL = re.compile(r"step:(\d+)/\d+ val_loss:(\S+) train_time:(\d+)ms")


def record_logs():
    return sorted(os.path.join(RECORD, n) for n in os.listdir(RECORD) if re.fullmatch(r"\d{8}-\d{6}-\w+\.txt", n))


def written(path, pattern):
    """(step, loss, ms) of every line of the log's run that `pattern` matches."""
    text = open(path, encoding="utf-8").read().rsplit("\n=== run === #", 1)[1]
    return [(int(m[1]), float(m[2]), int(m[3])) for m in pattern.finditer(text)]


def test_the_plot_shows_each_runs_train_and_val_losses_by_step_and_by_time():
    paths = record_logs()
    logs = [parse_log(p) for p in paths]
    for x, column in (("step", 0), ("time", 2)):
        fig = plot.figure(logs, x)
        lines = fig.axes[0].get_lines()
        for i, path in enumerate(paths):
            train, val = lines[2 * i].get_xydata().tolist(), lines[2 * i + 1].get_xydata().tolist()
            scale = 1 if x == "step" else 1000
            assert train == [[row[column] / scale, row[1]] for row in written(path, STEP)]
            assert val == [[row[column] / scale, row[1]] for row in written(path, VAL)]
        target = lines[-1].get_ydata()
        assert list(target) == [5.726400000000001] * 2    # track_cpu's target, track.json


def test_the_command_writes_a_png_next_to_a_log_and_refuses_a_file_that_is_not_one(tmp_path):
    log = tmp_path / os.path.basename(record_logs()[0])
    log.write_bytes(open(record_logs()[0], "rb").read())
    done = subprocess.run([sys.executable, "records/plot.py", str(log)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    png = tmp_path / f"{log.stem}_loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    done = subprocess.run([sys.executable, "records/plot.py", "README.md"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: README.md: not a run log (its first line is '# GPT-2 speedrun', expected 'speedrun-log v2 "
        "run_id=<id>')"]


def test_a_record_logs_plot_goes_to_the_current_folder_not_into_records(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(REPO, "records", "plot.py"), record_logs()[0]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / (os.path.basename(record_logs()[0])[:-4] + "_loss.png")).exists()
    done = subprocess.run([sys.executable, "records/plot.py", record_logs()[0], "--out", f"{RECORD}/x.png"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "only records/make_record.py writes" in done.stderr
    assert not os.path.exists(f"{RECORD}/x.png")
