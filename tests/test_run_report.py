"""What a run tells its user: the time left on each step line (the terminal's, not the log's),
the last line (the track's target, whether the run met it, the log's path), the load average at
the start and the end with a warning when other work held the CPUs, and a warm-up line that says
what the warm-up did on this device. Tiny CPU runs in subprocesses, and the pieces against
references written here."""
import json
import math
import os
import re
import subprocess
import sys

import pytest
from launch import cpu_env
from tiny_runs import REPO, TINY, data_args, run_trainer

sys.path.insert(0, REPO)
import train_gpt as tg  # noqa: E402
from machinery import progress, run_report  # noqa: E402
from records.logfile import other_load, parse_log  # noqa: E402

STEP_LINE = re.compile(r"step:(\d+)/(\d+) train_loss:\S+ objective:\S+ train_time:(\d+)ms step_avg:\S+ms eta:(\S+)")
LOAD_WINDOW_S = 60                 # the kernel's 1-minute load average: an exponential average over 60 s


def target_of(track):
    return json.loads((open(os.path.join(REPO, "records", track, "track.json")).read()))["target_val_loss"]


def seconds_of(eta):
    """45s, 3m05s or 1h02m as seconds."""
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", eta)
    hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return 3600 * hours + 60 * minutes + seconds


def the_log(folder):
    (name,) = [n for n in os.listdir(folder) if n.endswith(".txt")]
    return os.path.join(folder, name)


def test_a_run_shows_the_time_left_and_ends_with_its_target_and_its_log(shards, tmp_path):
    """Step lines on the terminal end with the time the rest of the run takes at its pace so far
    (equal batches here: elapsed x steps left / steps done, and the final validation's slices,
    each estimated from the time per trained token); the log's step lines stay as they were. The
    last line names track_cpu's target, says it was not met by this tiny model, and gives the
    log's path."""
    res = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=6", "--log_every=2",
                       f"--log_dir={tmp_path}"])
    assert res.returncode == 0, res.stderr
    path = the_log(tmp_path)
    log = parse_log(path)
    shown = [STEP_LINE.fullmatch(line) for line in res.stdout.splitlines() if " train_loss:" in line]
    assert shown and all(shown) and len(shown) == len(log.steps)
    slices, slice_tokens = 2, 1024                       # TINY: val_tokens 2048 in slices of 1024
    for m in shown:
        step, total, elapsed_ms = int(m[1]), int(m[2]), int(m[3])
        per_token_s = elapsed_ms / 1000 / (step * 512)   # TINY: 512 tokens a step
        validation = slices * progress.VAL_TOKEN_SHARE * slice_tokens * per_token_s
        assert abs(seconds_of(m[4]) - elapsed_ms / 1000 * (total - step) / step - validation) <= 1, m[0]
    val = log.final["val_loss"]
    assert res.stdout.splitlines()[-1] == (
        f"target: val_loss below {target_of('track_cpu'):.4f} (track_cpu): {'met' if val < target_of('track_cpu') else 'not met'}, "
        f"{val:.4f} (one run: a record takes several, records/track_cpu/README.md); log: {path}")


def test_the_warm_up_line_says_what_the_warm_up_did_on_a_cpu(shards, tmp_path):
    """On a CPU a warm-up only runs each shape's steps: the line counts them and says that nothing
    was compiled, captured or calibrated; without a warm-up it says there was none."""
    args = ["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=4", "--untie_frac=0.5",
            "--warmup_steps=1"]
    lines = {}
    for warm in ("auto", "always"):
        res = run_trainer([*args, f"--warm_up={warm}", f"--log_dir={tmp_path}/{warm}"])
        assert res.returncode == 0, res.stderr
        (lines[warm],) = [line for line in res.stdout.splitlines() if line.startswith("warm-up: ")]
    device = "on this cpu: no compilation, no Triton JIT, no CUDA graphs, no FP8 calibration); train_time counts"
    assert re.fullmatch(r"warm-up: 0\.0s untimed \(none: nothing to compile or warm; " + re.escape(device)
                        + " from step 0", lines["auto"]), lines["auto"]
    # the second stage and the untie both start at step 2: 2 graph keys, one step each; one validation
    assert re.fullmatch(r"warm-up: [0-9.]+s untimed \(2 training steps and 1 validation forward\(s\) at every "
                        r"shape the run uses; " + re.escape(device) + " from step 0", lines["always"]), lines["always"]


def run_at_load(load, shards, tmp_path):
    """A 2-step tiny run in a process whose os.getloadavg says `load` at every horizon: (the
    finished process, its parsed log)."""
    code = (f"import os, runpy, sys; os.getloadavg = lambda: ({load}, {load}, {load}); sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    args = ["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=2", f"--log_dir={tmp_path}"]
    res = subprocess.run([sys.executable, "-c", code, os.path.join(REPO, "train_gpt.py"), *args], cwd=REPO,
                         capture_output=True, text=True, timeout=300, env=cpu_env(OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr
    return res, parse_log(the_log(tmp_path))


def test_a_busy_machine_is_warned_of_and_the_log_keeps_its_load(shards, tmp_path):
    """With a 1-minute load average of 9 on this machine from start to end (os.getloadavg replaced
    in the run's process), the run notes the load at its start and warns at its end that the
    machine was busy, on the terminal and in the log, whose environment and last lines record the
    load."""
    res, log = run_at_load(9.0, shards, tmp_path)
    assert log.environment["load_average"] == "9.00"
    warnings = [line for line in log.info if line.startswith("warning: the machine was busy")]
    notes = [line for line in log.info if line.startswith("note: a 1-minute load average of 9.00")]
    assert [w.split(":")[1] for w in warnings] == [" the machine was busy during the run"] and len(notes) == 1
    assert all(w in res.stdout for w in warnings + notes)
    assert "load average: 9.00 at the start, 9.00 at the end (1 minute; " in "\n".join(log.info)


def test_an_idle_machine_gets_no_warning(shards, tmp_path):
    """A load average of 0 at both ends: no warning, the load recorded."""
    _, log = run_at_load(0.0, shards, tmp_path)
    assert log.environment["load_average"] == "0.00" and not any("busy" in line for line in log.info)


@pytest.mark.parametrize("load, cpus, threads, seconds, at_start, busy", [
    (0.4, 2, 2, 0, None, False),         # a quiet 2-core machine before a 2-thread run
    (1.17, 2, 2, 0, None, True),         # another job on one of its cores
    (1.3, 2, 2, 64, None, False),        # 64 s into the run: its own 2 threads make 2 x (1 - e^-64/60) = 1.31
    (2.9, 2, 2, 64, None, True),         # ... and 1.6 more of other work
    (30.0, 192, 8, 0, None, False),      # 8 GPU processes on a 192-core host: 30 runnable tasks leave it cores enough
    (186.0, 192, 8, 0, None, True),      # ... 186 do not
    # a 2-thread run of 60 s started right after another: 1.94 at its start decays to 1.94 / e,
    # its own 2 threads add 2 (1 - 1/e): 1.978 at its end, no other work; one more task adds 1 - 1/e
    (1.94 / math.e + 2 * (1 - 1 / math.e), 2, 2, 60, 1.94, False),
    (1.94 / math.e + 3 * (1 - 1 / math.e), 2, 2, 60, 1.94, True),
])
def test_other_work_is_the_load_beyond_the_runs_own_share(load, cpus, threads, seconds, at_start, busy):
    decay = math.exp(-seconds / LOAD_WINDOW_S)
    others = other_load(load, cpus, threads, seconds, at_start)
    assert (others is not None) == busy
    if busy:
        want = load - threads * (1 - decay) if at_start is None else (load - at_start * decay) / (1 - decay) - threads
        assert others == pytest.approx(want)
    if at_start is not None:           # without the start's load, the previous run counts as other work
        assert other_load(load, cpus, threads, seconds) is not None


def test_the_time_left_follows_the_tokens_of_the_steps_left():
    """With stages of 1 and 3 units of tokens a step, the time left after the first stage is three
    times the time so far per step of it (the step's time follows its batch)."""
    h = tg.parse_config(["--preset", "cpu", "--num_iterations=10", "--batch_ranks=1",
                         '--stages=[{"end":0.5,"tokens_per_rank":1024,"max_doc_len":512,"short_window":1,'
                         '"long_window":2},{"end":1.0,"tokens_per_rank":3072,"max_doc_len":512,"short_window":1,'
                         '"long_window":2}]'])
    tokens = tg.tokens_after_steps(h)
    assert tokens[5] == 5 * 1024 and tokens[10] == 5 * 1024 + 5 * 3072
    clock = progress.RunClock(tokens, [], 0, 1024, 1)  # (no validation: the steps alone)
    assert clock.eta_text(5_000, 5) == "15s"          # 5 s for 5 steps of 1 unit; 5 steps of 3 units left
    assert clock.eta_text(5_000 * 13, 5) == "3m15s"
    assert clock.eta_text(5_000 * 800, 5) == "3h20m"


def test_the_time_left_counts_every_validation_left_at_its_time_per_slice():
    """Validations at steps 4, 8 and 10 (the final one), 3 slices each: before one ran, each slice
    is estimated from the time per trained token; once one ran, at its measured time per slice;
    a validation at the step a line reports has not run yet (it runs before the next step)."""
    tokens = [1000 * step for step in range(11)]
    clock = progress.RunClock(tokens, [4, 8, 10], 3, 500, 2)
    per_slice = progress.VAL_TOKEN_SHARE * 500 * (2.0 / 2000) * 2      # 2 s for 2,000 tokens, on 2 processes
    assert clock.seconds_left(2_000, 2) == pytest.approx(8.0 + 3 * 3 * per_slice)
    clock.validated(6.0)                                                # the validation at step 4: 2 s a slice
    assert clock.seconds_left(4_000, 4) == pytest.approx(6.0 + 3 * 3 * 2.0)
    assert clock.seconds_left(10_000, 10) == pytest.approx(3 * 2.0)    # the final validation alone
    assert progress.duration_text(3 * 2.0) == "6s"


def test_a_run_says_how_far_its_warm_up_and_final_validation_are(shards, tmp_path):
    """Each warm-up step and validation forward, and each slice of the final validation, is a line
    in the log and on the terminal, in order, with the phase's seconds so far; an intermediate
    validation's slices only on the terminal."""
    res = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=4", "--untie_frac=0.5",
                       "--warm_up=always", "--warmup_steps=1", "--val_every=2", f"--log_dir={tmp_path}"])
    assert res.returncode == 0, res.stderr
    log = parse_log(the_log(tmp_path))
    said = r", \d+\.\ds so far"
    warm = [line for line in log.info if line.startswith("warming up: ")]
    assert [re.sub(said, "", line) for line in warm] == [
        "warming up: training step 1/2 (graph 1/2: the shape of step 0)",
        "warming up: training step 2/2 (graph 2/2: the shape of step 2)",
        "warming up: validation forward 1/2", "warming up: validation forward 2/2"]
    final = [line for line in log.info if line.startswith("validating at step")]
    assert [re.sub(said, "", line) for line in final] == ["validating at step 4/4: slice 1/2",
                                                          "validating at step 4/4: slice 2/2"]
    terminal = res.stdout.splitlines()
    assert all(line in terminal for line in warm + final)
    assert [re.sub(said, "", line) for line in terminal if line.startswith("validating at step 2/4")] == [
        "validating at step 2/4: slice 1/2", "validating at step 2/4: slice 2/2"]
    assert all(re.search(said + "$", line) for line in warm + final)
    lines = log.info
    assert lines.index(warm[-1]) < next(i for i, line in enumerate(lines) if line.startswith("warm-up: "))


def test_a_run_on_no_track_is_held_to_the_target_of_the_tokens_it_validates_on():
    """The 1gpu presets are on no track but validate on the speedrun preset's tokens: their last
    line compares with track_1_short's target; a run on no track with other validation data has
    none."""
    target, speedrun = target_of("track_1_short"), tg.parse_config(["--preset", "speedrun"])
    line = run_report.target_line(tg.parse_config(["--preset", "1gpu_24gb"]), target - 0.01, "logs/x.txt", speedrun)
    assert line == (f"target: val_loss below {target:.4f} (track_1_short, for comparison: this run is on no track): "
                    f"met, {target - 0.01:.4f} (one run: a record takes several, records/track_1_short/README.md); "
                    f"log: logs/x.txt")
    assert run_report.target_line(speedrun, target, "x", speedrun).split(": ")[2] == "not met, 3.2800 (one run"
    tiny = tg.parse_config(["--preset", "cpu", "--track=none"])
    assert (run_report.target_line(tiny, 5.0, "logs/y.txt", speedrun)
            == "target: none (the run is on no track); log: logs/y.txt")
