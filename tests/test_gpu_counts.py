"""What ./run.sh starts on 1 to 8 GPUs of an 80 GB H100 or a 141 GB H200, and on the machines
users have (one 80 GB GPU with 64 GiB of host memory, one 24 GB card, 8 40 GB A100s), simulated:
no GPU is used. Each configuration passes the checks a run makes at its start: the config's, the
batch split (setup_distributed), the validation split, check_ngram_table and the memory budget
(check_memory), for its process count; and the next larger one (twice the n-gram rows, or half
the micro-batches) does not."""
import json
import re
import stat
import subprocess
import sys

import pytest
import torch
from launch import cpu_env
from tiny_runs import REPO

sys.path.insert(0, REPO)
import train_gpt as tg  # noqa: E402
from machinery import memory_budget  # noqa: E402
from machinery.config import ConfigError  # noqa: E402

GiB = 2**30
H100 = 81_559 * 2**20              # an 80 GB H100 SXM's memory as nvidia-smi reports it (MiB)
H200 = 143_771 * 2**20             # a 141 GB H200's
HOST = 1024 * GiB                  # a GPU server's host memory
SPEEDRUN = ("--preset", "speedrun")
SPLIT = ("--preset", "1gpu", "--ngram_cache_rows=0")   # the table split across the processes' GPUs
HOST_TABLE = ("--preset", "1gpu")                       # one process, the table in host memory
# (preset arguments, processes) by GPU count, worked out from the budget's items (README;
# bench/results/2026-12-02_cpu-xeon.md, "Memory budget per preset and GPU, ..."):
# a quarter of the table (32.6 GB) fits an H100 beside the rest with the record's micro-batches
# (within 0.05 GiB), half of it (65.3 GB) only an H200.
EXPECTED = {
    H100: {1: (HOST_TABLE, 1), 2: (HOST_TABLE, 1), 3: (HOST_TABLE, 1), 4: (SPLIT, 4), 5: (SPLIT, 4),
           6: (SPLIT, 4), 7: (SPLIT, 4), 8: (SPEEDRUN, 8)},
    H200: {1: (HOST_TABLE, 1), 2: (SPLIT, 2), 3: (SPLIT, 2), 4: (SPLIT, 4), 5: (SPLIT, 4), 6: (SPLIT, 4),
           7: (SPLIT, 4), 8: (SPEEDRUN, 8)},
}


def expected(gpu, gpus):
    """EXPECTED's preset arguments with its --stages written out."""
    return tuple(a for arg in EXPECTED[gpu][gpus][0] for a in (slices_in(2)[1:2] if arg == "STAGES_IN_2" else [arg]))


def memory_of(gpu, host=HOST):
    """available_memory_bytes of a machine with GPUs of `gpu` bytes and `host` bytes of host memory."""
    return lambda device: gpu if device.type == "cuda" else host


def start_up_checks(args, processes, available):
    """The checks of a run of train_gpt.py `args` on `processes` processes, one GPU each, made as
    each process makes them before it allocates anything; ConfigError names the first that fails."""
    h = tg.parse_config(list(args))
    env = tg.ProcessGroup(0, processes, 0, torch.device("cuda", 0))
    if h.batch_ranks % processes:
        raise ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by the {processes} processes")
    tg.check_validation_split(h, env)
    tg.check_ngram_table(h, env, available)
    memory_budget.check_memory(tg, h, env, available)


@pytest.mark.parametrize("gpu", [H100, H200], ids=["h100", "h200"])
def test_every_gpu_count_gets_a_configuration_that_passes_its_start_up_checks(gpu):
    available = memory_of(gpu)
    for gpus in range(1, 9):
        args, processes, reason = memory_budget.launch_plan(tg, gpus, [], available)
        assert (as_written(args), processes) == (as_written(expected(gpu, gpus)), EXPECTED[gpu][gpus][1]), (gpus, reason)
        assert processes <= gpus and reason.startswith(f"{gpus} GPU{'s' * (gpus > 1)} of {gpu / GiB:.1f} GiB, "
                                                       f"{HOST / GiB:.1f} GiB of host memory: ")
        start_up_checks(args, processes, available)


def test_a_configuration_passed_over_is_named_in_the_reason():
    _, _, reason = memory_budget.launch_plan(tg, 2, [], memory_of(H100))
    assert ("on 1 process: n-gram table 84,602,880 rows (the record's) in host memory, its rows cached on the GPU, "
            "by the public table-size test on 8xH100, 84.60M rows val 3.2791 in 39.52 s; micro-batches as the "
            "record's; budget ") in reason
    one_gpu = memory_budget.memory_budget(tg, tg.parse_config(["--preset", "1gpu", "--ngram_cache_rows=0"]), 1)
    assert reason.endswith("; not --preset 1gpu --ngram_cache_rows=0 --batch_ranks=32 --stages=[...] "
                           "--val_tokens_per_rank=65536 on 1 process "
                           "(n-gram table 84,602,880 rows (the record's) whole on the GPU): --ngram_rows=84602880 needs "
                           f"{one_gpu.device['n-gram table'] / GiB:.1f} GiB on the cuda (all in one process: 1544 B per "
                           "row, bfloat16 values of 768 and the optimizer state), 79.6 GiB are available: lower "
                           "--ngram_rows")


def test_the_users_preset_gets_the_most_processes_that_pass():
    """A --preset of the user's keeps its settings: speedrun on 4 H200s runs on 4 processes, the
    1gpu preset (its table in host memory) on one, whatever the GPU count."""
    assert memory_budget.launch_plan(tg, 4, ["--preset", "speedrun"], memory_of(H200))[:2] == ((), 4)
    assert memory_budget.launch_plan(tg, 8, ["--preset=1gpu"], memory_of(H200))[:2] == ((), 1)


def test_the_medium_preset_runs_on_8_processes_of_8_h100s():
    """--preset medium (16 slices of a global batch) on 8 H100s: all 8, two slices each; on 3
    the most that divide 16 is 2. Each passes the start-up checks on its process count."""
    for gpus, processes in ((8, 8), (3, 2)):
        args, n, reason = memory_budget.launch_plan(tg, gpus, ["--preset", "medium"], memory_of(H100))
        assert (args, n) == ((), processes), reason
        start_up_checks(("--preset", "medium"), n, memory_of(H100))


def test_the_optimization_preset_runs_on_every_gpu_count_that_divides_its_8_slices():
    """--preset optimization (8 slices of 65,536 tokens) on 1 to 8 H100s or H200s: the most processes
    that divide 8, each passing the start-up checks (about 51 GiB of an H100 on each)."""
    for gpu in (H100, H200):
        for gpus, processes in ((8, 8), (7, 4), (4, 4), (3, 2), (2, 2), (1, 1)):
            args, n, reason = memory_budget.launch_plan(tg, gpus, ["--preset", "optimization"], memory_of(gpu))
            assert (args, n) == ((), processes), reason
            start_up_checks(("--preset", "optimization"), n, memory_of(gpu))


def test_no_configuration_fits_a_small_machine():
    """8 GiB GPUs: every table size, placement and micro-batch refused; the one line names the least
    configuration tried (record 89's bigram table's size, the most micro-batches) and its refusal."""
    with pytest.raises(ConfigError, match=r"^nothing fits 4 GPUs of 8.0 GiB, 64.0 GiB of host memory; the least "
                                             r"configuration tried: --preset 1gpu --ngram_cache_rows=0 "
                                             r"--ngram_rows=377280 --batch_ranks=32 --stages=\[\.\.\.\] "
                                             r"--val_tokens_per_rank=65536 on 1 "
                                             r"process \(n-gram table 377,280 rows \(record 89's bigram table's "
                                             r"size\) whole on the GPU\): the run needs .* GiB of memory on each "
                                             r"GPU, 8.0 GiB are there"):
        memory_budget.launch_plan(tg, 4, [], memory_of(8 * GiB, 64 * GiB))


# ----------------------------------------------------------------------------- the machines users have

RECORD_ROWS = 84_602_880           # record 92's n-gram table
A100_40 = 40_536 * 2**20           # a 40 GB A100's memory as nvidia-smi reports it (MiB)
CARD_24 = int(23.6 * GiB)          # a 24 GB card's (an RTX 4090's 24,564 MiB) free memory with no display on it
DESKTOP = 64 * GiB                 # a workstation's host memory


def slices_in(k, preset="1gpu"):
    """The --batch_ranks, --stages and --val_tokens_per_rank of `preset` with each slice of its
    global batch in k micro-batches, written out here: k x the slices, each stage's
    tokens_per_rank / k, the validation's windows / k."""
    h = tg.parse_config(["--preset", preset])
    stages = [{**json.loads(json.dumps(tg.config_to_dict(h)["stages"][i])), "tokens_per_rank": s.tokens_per_rank // k}
              for i, s in enumerate(h.stages)]
    return (f"--batch_ranks={8 * k}", "--stages=" + json.dumps(stages), f"--val_tokens_per_rank={h.val_tokens_per_rank // k}")


# (GPUs, each GPU's bytes, host bytes) -> what the plan starts, worked out from the budget's items
# (docs/gpu.md): 80 GB with 64 GiB of host memory cannot hold half the table on the GPU (65 GB) nor
# in host memory (64 GiB pinned + 16 GiB margin), a quarter fits on the GPU in 2 micro-batches a
# slice; a 24 GB card holds 1/64 of the table with 4 micro-batches; 8 40 GB A100s cannot hold the
# whole table split, even with 8 micro-batches, so it lives in host memory, one process, with 4.
MACHINES = {
    (1, H100, DESKTOP): ((*SPLIT, "--ngram_rows=21150720", *slices_in(2)), 1, 21_150_720, 2),
    (1, CARD_24, DESKTOP): (("--preset", "1gpu_24gb"), 1, RECORD_ROWS // 64, 4),
    (8, A100_40, HOST): (("--preset", "1gpu", *slices_in(4)), 1, RECORD_ROWS, 4),
    (8, H100, HOST): (SPEEDRUN, 8, RECORD_ROWS, 1),
}


def as_written(args):
    """The preset arguments with any --stages read as the config reads it (compared by value, not
    by JSON spelling)."""
    return [tg.parse_config(["--preset", "1gpu", a]).stages if a.startswith("--stages=") else a for a in args]


@pytest.mark.parametrize("machine", MACHINES, ids=["80gb_64gib_host", "24gb", "8x40gb", "8x80gb"])
def test_each_machine_gets_the_largest_configuration_that_fits(machine):
    """The plan's choice on each machine passes its start-up checks; twice its n-gram rows, or half
    its micro-batches, in the same place, would not."""
    gpus, gpu, host = machine
    available = memory_of(gpu, host)
    args, processes, reason = memory_budget.launch_plan(tg, gpus, [], available)
    expected_args, expected_processes, rows, k = MACHINES[machine]
    assert (as_written(args), processes) == (as_written(expected_args), expected_processes), reason
    start_up_checks(args, processes, available)
    h = tg.parse_config(list(args))
    assert h.ngram_rows == rows and h.batch_ranks == 8 * k
    if rows < RECORD_ROWS:
        with pytest.raises(ConfigError):
            start_up_checks([*args, f"--ngram_rows={2 * rows}"], processes, available)
    if k > 1:
        half = [*args, f"--batch_ranks={4 * k}", f"--val_tokens_per_rank={2 * h.val_tokens_per_rank}",
                "--stages=" + json.dumps([{**tg.config_to_dict(h)["stages"][i], "tokens_per_rank": 2 * s.tokens_per_rank}
                                          for i, s in enumerate(h.stages)])]
        with pytest.raises(ConfigError):
            start_up_checks(half, processes, available)


def test_the_plan_says_what_the_smaller_table_costs():
    """One 80 GB GPU with 64 GiB of host memory: the line names the table it keeps and the public
    table-size test's numbers for it beside the record's table's, and the target it misses."""
    _, _, reason = memory_budget.launch_plan(tg, 1, [], memory_of(H100, DESKTOP))
    assert reason.startswith("1 GPU of 79.6 GiB, 64.0 GiB of host memory: --preset 1gpu --ngram_cache_rows=0 "
                             "--ngram_rows=21150720 --batch_ranks=16 --stages=[...] --val_tokens_per_rank=131072 on 1 "
                             "process: n-gram table 21,150,720 rows (1/4 of the record's) "
                             "whole on the GPU, by the public table-size test on 8xH100, 21.15M rows val 3.2825-3.2863 "
                             "in 39.35 s (the record's 84.60M: 3.2791 in 39.52 s): above the 3.28 target; "
                             "each slice of the global batch in 2 micro-batches of at most 24,576 tokens"), reason


def test_the_24gb_preset_is_the_1gpu_preset_with_a_smaller_table_and_4_micro_batches():
    """1gpu_24gb differs from 1gpu only in the table's rows and place, the micro-batches (and the
    validation's windows with them) and its track (a 24 GB card is not the single-GPU track's), and
    keeps every stage's global batch."""
    one, card = (tg.config_to_dict(tg.parse_config(["--preset", name])) for name in ("1gpu", "1gpu_24gb"))
    assert {k for k in one if one[k] != card[k]} == {"preset", "ngram_rows", "ngram_cache_rows", "batch_ranks", "stages",
                                                     "track", "val_tokens_per_rank"}
    assert (card["ngram_rows"], card["ngram_cache_rows"]) == (RECORD_ROWS // 64, 0)
    assert tg.parse_config(["--preset", "1gpu_24gb"]).stages == as_written(slices_in(4))[1]
    assert [s["tokens_per_rank"] * card["batch_ranks"] for s in card["stages"]] == \
        [s["tokens_per_rank"] * one["batch_ranks"] for s in one["stages"]]


def test_a_lever_the_user_sets_stays_as_set():
    """--ngram_rows given: the plan varies where the table lives and the micro-batches, never the rows."""
    args, processes, reason = memory_budget.launch_plan(tg, 1, ["--ngram_rows=5287680"], memory_of(H100, DESKTOP))
    assert (args, processes) == (SPLIT, 1), reason


def test_plan_on_a_machine_without_a_gpu_plans_for_a_named_one():
    """--plan --gpus --gpu_gib --host_gib on this CPU: the three lines run.sh reads; without
    --gpu_gib, one line asking for it."""
    done = subprocess.run([sys.executable, "train_gpt.py", "--plan", "--gpus=1", "--gpu_gib=23.6", "--host_gib=64"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=cpu_env())
    assert done.returncode == 0, done.stderr
    processes, args, reason = done.stdout.splitlines()
    assert (processes, args) == ("1", "--preset 1gpu_24gb")
    assert reason == memory_budget.launch_plan(tg, 1, [], memory_of(CARD_24, DESKTOP))[2]
    done = subprocess.run([sys.executable, "train_gpt.py", "--plan", "--gpus=2"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cpu_env())
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: --plan for 2 GPU(s) on a machine without one needs their memory: add --gpu_gib=G (GiB each, e.g. "
        "79.6 for an 80 GB H100, 23.6 for a 24 GB card)"]


FAKE_PYTHON = """#!/bin/bash
# Python as run.sh calls it, on a machine with $FAKE_GPUS GPUs of $FAKE_GPU_GIB GiB and
# $FAKE_HOST_GIB GiB of host memory: the GPU count, the plan for that machine, no download, and
# the torch.distributed launch printed instead of run.
case "$1" in
    -c) if [[ "$2" == *device_count* ]]; then exec "$REAL_PYTHON" -c "${2//torch.cuda.device_count()/$FAKE_GPUS}"; fi ;;
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


TRACK_LINE = ("run.sh: one GPU: the single-GPU track's recipe (records/track_1gpu/README.md: a record runs on "
              "one H100 or H200)")


def track_line(args, processes):
    """The line run.sh adds when it starts one process of the single-GPU track's recipe."""
    return [TRACK_LINE] if processes == 1 and tg.parse_config(list(args)).track == "track_1gpu" else []


def run_sh_launch(tmp_path, gpus, gpu, *args, host=HOST):
    """(processes, train_gpt.py arguments, its run.sh: lines) of what ./run.sh `args` launches on
    that machine."""
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    done = subprocess.run(["./run.sh", *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=cpu_env(PYTHON=str(python), REAL_PYTHON=sys.executable, FAKE_GPUS=str(gpus),
                                      FAKE_GPU_GIB=str(gpu / GiB), FAKE_HOST_GIB=str(host / GiB)))
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
    assert (as_written(args), processes) == (as_written(expected(H100, gpus)), EXPECTED[H100][gpus][1])
    assert said == [f"run.sh: {memory_budget.launch_plan(tg, gpus, [], memory_of(H100))[2]}",
                    *track_line(args, processes)]


def test_run_sh_with_the_medium_preset_launches_it_on_8_processes(tmp_path):
    """./run.sh --preset medium on 8 H100s: the user's preset (run.sh adds none), 8 processes."""
    processes, args, said = run_sh_launch(tmp_path, 8, H100, "--preset", "medium")
    assert (processes, args) == (8, ["--preset", "medium"])
    assert said == [f"run.sh: {memory_budget.launch_plan(tg, 8, ['--preset', 'medium'], memory_of(H100))[2]}"]


@pytest.mark.parametrize("machine", [(1, CARD_24, DESKTOP), (8, A100_40, HOST)], ids=["24gb", "8x40gb"])
def test_run_sh_launches_the_plan_on_the_machines_users_have(tmp_path, machine):
    """./run.sh on one 24 GB card (the 1gpu_24gb preset) and on 8 40 GB A100s (the 1gpu preset
    with the table in host memory, in 4 micro-batches: its --stages list reaches train_gpt.py
    whole): the launch is the plan's,
    passes its start-up checks, and run.sh says why in the plan's words."""
    gpus, gpu, host = machine
    processes, args, said = run_sh_launch(tmp_path, gpus, gpu, host=host)
    expected_args, expected_processes, _, _ = MACHINES[machine]
    assert (as_written(args), processes) == (as_written(expected_args), expected_processes)
    start_up_checks(args, processes, memory_of(gpu, host))
    assert said == [f"run.sh: {memory_budget.launch_plan(tg, gpus, [], memory_of(gpu, host))[2]}",
                    *track_line(args, processes)]


def test_docs_show_the_plans_the_planner_makes_now():
    """Each `$ python train_gpt.py --plan --gpus=N --gpu_gib=G --host_gib=H` in docs/gpu.md is
    followed by the three lines the planner prints for that machine today."""
    text = open(f"{REPO}/docs/gpu.md", encoding="utf-8").read()
    shown = re.findall(r"^\$ python train_gpt.py --plan --gpus=(\d+) --gpu_gib=([\d.]+) --host_gib=([\d.]+)\n"
                       r"(.*)\n(.*)\n(.*)$", text, re.M)
    assert len(shown) == 2
    for gpus, gpu_gib, host_gib, *lines in shown:
        args, processes, reason = memory_budget.launch_plan(tg, int(gpus), [], memory_of(int(float(gpu_gib) * GiB),
                                                                          int(float(host_gib) * GiB)))
        assert lines == [str(processes), " ".join(args), reason]


def test_run_sh_on_one_h100_names_the_single_gpu_track(tmp_path):
    """./run.sh on one H100: the plan's 1gpu configuration, and a line naming the single-GPU track
    whose recipe it is."""
    processes, args, said = run_sh_launch(tmp_path, 1, H100)
    assert processes == 1 and args[:2] == ["--preset", "1gpu"]
    assert said == [f"run.sh: {memory_budget.launch_plan(tg, 1, [], memory_of(H100))[2]}", TRACK_LINE]
