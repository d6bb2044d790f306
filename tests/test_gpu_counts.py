"""What ./run.sh starts on 1 to 8 GPUs of an 80 GB H100 or a 141 GB H200 (simulated: no GPU is
used), and that each of those configurations passes the checks a run makes at its start: the
config's, the batch split (setup_distributed), the validation split, check_ngram_table and the
memory budget (check_memory), for its process count."""
import stat
import subprocess
import sys

import pytest
import torch

from launch import cpu_env
from tiny_runs import REPO

sys.path.insert(0, REPO)
import memory_budget  # noqa: E402
import train_gpt as tg  # noqa: E402

GiB = 2**30
H100 = 81_559 * 2**20              # an 80 GB H100 SXM's memory as nvidia-smi reports it (MiB)
H200 = 143_771 * 2**20             # a 141 GB H200's
HOST = 1024 * GiB                  # a GPU server's host memory
SPEEDRUN = ("--preset", "speedrun")
SPLIT = ("--preset", "1gpu", "--ngram_cache_rows=0")   # the table split across the processes' GPUs
HOST_TABLE = ("--preset", "1gpu")                       # one process, the table in host memory
# (preset arguments, processes) by GPU count, worked out from the budget's items (README, bench/cpu_results.md):
# a quarter of the table (32.6 GB) fits an H100 beside the rest, half of it (65.3 GB) only an H200.
EXPECTED = {
    H100: {1: (HOST_TABLE, 1), 2: (HOST_TABLE, 1), 3: (HOST_TABLE, 1), 4: (SPLIT, 4), 5: (SPLIT, 4), 6: (SPLIT, 4),
           7: (SPLIT, 4), 8: (SPEEDRUN, 8)},
    H200: {1: (HOST_TABLE, 1), 2: (SPLIT, 2), 3: (SPLIT, 2), 4: (SPLIT, 4), 5: (SPLIT, 4), 6: (SPLIT, 4),
           7: (SPLIT, 4), 8: (SPEEDRUN, 8)},
}


def memory_of(gpu, host=HOST):
    """available_memory_bytes of a machine with GPUs of `gpu` bytes and `host` bytes of host memory."""
    return lambda device: gpu if device.type == "cuda" else host


def start_up_checks(args, processes, available):
    """The checks of a run of train_gpt.py `args` on `processes` processes, one GPU each, made as
    each process makes them before it allocates anything; ConfigError names the first that fails."""
    h = tg.parse_config(list(args))
    env = tg.ProcessGroup(0, processes, 0, torch.device("cuda", 0))
    if h.batch_ranks % processes:
        raise tg.ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by the {processes} processes")
    tg.check_validation_split(h, env)
    tg.check_ngram_table(h, env, available)
    tg.check_memory(h, env, available)


@pytest.mark.parametrize("gpu", [H100, H200], ids=["h100", "h200"])
def test_every_gpu_count_gets_a_configuration_that_passes_its_start_up_checks(gpu):
    available = memory_of(gpu)
    for gpus in range(1, 9):
        args, processes, reason = tg.launch_plan(gpus, [], available)
        assert (args, processes) == EXPECTED[gpu][gpus], (gpus, reason)
        assert processes <= gpus and reason.startswith(f"{gpus} GPU(s) of {gpu / GiB:.1f} GiB: ")
        start_up_checks(args, processes, available)


def test_a_configuration_passed_over_is_named_in_the_reason():
    _, _, reason = tg.launch_plan(2, [], memory_of(H100))
    assert "(the n-gram table in host memory; the budget: " in reason
    assert reason.endswith("; not --preset 1gpu --ngram_cache_rows=0 on 2 processes: the run needs "
                           f"{memory_budget.memory_budget(tg.parse_config(list(SPLIT)), 2).device_total(H100) / GiB:.1f} GiB "
                           "of memory on each GPU, 79.6 GiB are there")


def test_the_users_preset_gets_the_most_processes_that_pass():
    """A --preset of the user's keeps its settings: speedrun on 4 H200s runs on 4 processes, the
    1gpu preset (its table in host memory) on one, whatever the GPU count."""
    assert tg.launch_plan(4, ["--preset", "speedrun"], memory_of(H200))[:2] == ((), 4)
    assert tg.launch_plan(8, ["--preset=1gpu"], memory_of(H200))[:2] == ((), 1)


def test_the_medium_preset_runs_on_8_processes_of_8_h100s():
    """--preset medium (16 slices of a global batch) on 8 H100s: all 8, two slices each; on 3
    the most that divide 16 is 2. Each passes the start-up checks on its process count."""
    for gpus, processes in ((8, 8), (3, 2)):
        args, n, reason = tg.launch_plan(gpus, ["--preset", "medium"], memory_of(H100))
        assert (args, n) == ((), processes), reason
        start_up_checks(("--preset", "medium"), n, memory_of(H100))


def test_the_optimization_preset_runs_on_every_gpu_count_that_divides_its_8_slices():
    """--preset optimization (8 slices of 65,536 tokens) on 1 to 8 H100s or H200s: the most processes
    that divide 8, each passing the start-up checks (about 51 GiB of an H100 on each)."""
    for gpu in (H100, H200):
        for gpus, processes in ((8, 8), (7, 4), (4, 4), (3, 2), (2, 2), (1, 1)):
            args, n, reason = tg.launch_plan(gpus, ["--preset", "optimization"], memory_of(gpu))
            assert (args, n) == ((), processes), reason
            start_up_checks(("--preset", "optimization"), n, memory_of(gpu))


def test_no_configuration_fits_a_small_machine():
    """16 GB GPUs and 64 GiB of host memory: every candidate refused, each refusal in the message."""
    with pytest.raises(tg.ConfigError, match=r"nothing fits 4 GPU\(s\) of 15.0 GiB and 64.0 GiB of host memory: "
                                             r"--preset 1gpu --ngram_cache_rows=0 on 4 processes: .*; "
                                             r"--preset 1gpu --ngram_cache_rows=0 on 2 processes: .*; "
                                             r"--preset 1gpu on 1 process: --ngram_rows=84602880 needs .* on the cpu"):
        tg.launch_plan(4, [], memory_of(15 * GiB, 64 * GiB))


FAKE_PYTHON = """#!/bin/bash
# Python as run.sh calls it, on a machine with $FAKE_GPUS GPUs of $FAKE_GPU_GIB GiB and
# $FAKE_HOST_GIB GiB of host memory: the GPU count, the plan for that machine, no download, and
# the torch.distributed launch printed instead of run.
case "$1" in
    -c) if [[ "$2" == *device_count* ]]; then echo "$FAKE_GPUS"; exit 0; fi ;;
    -m) if [ "$2" = torch.distributed.run ]; then shift 2; echo "LAUNCH $*"; exit 0; fi ;;
    data/cached_fineweb10B.py) exit 0 ;;
    train_gpt.py) if [ "$2" = --plan ]; then
        shift 2
        exec "$REAL_PYTHON" train_gpt.py --plan --gpus="$FAKE_GPUS" --gpu_gib="$FAKE_GPU_GIB" \\
            --host_gib="$FAKE_HOST_GIB" "$@"
    fi ;;
esac
exec "$REAL_PYTHON" "$@"
"""


def run_sh_launch(tmp_path, gpus, gpu, *args):
    """(processes, train_gpt.py arguments, its run.sh: lines) of what ./run.sh `args` launches on
    that machine."""
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    done = subprocess.run(["./run.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=cpu_env(PYTHON=str(python), REAL_PYTHON=sys.executable, FAKE_GPUS=str(gpus),
                                      FAKE_GPU_GIB=str(gpu / GiB), FAKE_HOST_GIB=str(HOST / GiB)))
    assert done.returncode == 0, done.stderr
    (launch,) = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("LAUNCH ")]
    processes = next(int(a.split("=")[1]) for a in launch if a.startswith("--nproc_per_node="))
    assert launch[launch.index("train_gpt.py") - 1].startswith("--nproc_per_node=")
    said = [line for line in done.stdout.splitlines() if line.startswith("run.sh: ")]
    return processes, launch[launch.index("train_gpt.py") + 1:], said


@pytest.mark.parametrize("gpus", [2, 4])
def test_run_sh_launches_a_configuration_that_passes_its_start_up_checks(tmp_path, gpus):
    """./run.sh on 2 and 4 H100s (a Python that reports them and prints the launch): the
    launched configuration passes the start-up checks on its process count, and run.sh says why
    it chose it, in launch_plan's words."""
    processes, args, said = run_sh_launch(tmp_path, gpus, H100)
    start_up_checks(args, processes, memory_of(H100))
    assert (tuple(args), processes) == EXPECTED[H100][gpus]
    assert said == [f"run.sh: {tg.launch_plan(gpus, [], memory_of(H100))[2]}"]


def test_run_sh_with_the_medium_preset_launches_it_on_8_processes(tmp_path):
    """./run.sh --preset medium on 8 H100s: the user's preset (run.sh adds none), 8 processes."""
    processes, args, said = run_sh_launch(tmp_path, 8, H100, "--preset", "medium")
    assert (processes, args) == (8, ["--preset", "medium"])
    assert said == [f"run.sh: {tg.launch_plan(8, ['--preset', 'medium'], memory_of(H100))[2]}"]
