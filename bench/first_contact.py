"""The first GPU minutes: one self-sufficient command that answers, in order, what a first run
of this trainer on a GPU must tell, each part within its own cap, the compiled run first.

    python3 bench/first_contact.py              # on an H100/H200, from the repository root
    python3 bench/first_contact.py --dry        # on a CPU: tiny shapes, the Triton interpreter,
                                                # the same parts in the same order

What fits. A GPU machine is lent for DEVICE_TIME_S = 900 s of device time, its start-up included.
One call of this command costs at most START_UP_S (120 s: a cold machine's start) + BUDGET_S
(300 s: the command's caps, PART_LIMITS_S, and REPORT_RESERVE_S) + TRANSFER_S (30 s: the tree
sent, the files fetched) = 450 s, so a second call fits the 900 s even on a fresh machine: two
are 900 s at most. A cold first call spends its compiled part compiling (4-8 minutes cold, more
than its cap): it is stopped there, having printed each compile's seconds, and leaves the Triton
and Inductor caches in OUT/compile_cache.tgz; the second call carries them (copy the file to
bench/compile_cache.tgz, pass `carry bench/compile_cache.tgz`) and starts warm.

In order (PART_LIMITS_S: each part gets what is left of the budget, at most its cap):
  1. environment: versions, commit, `nvidia-smi`, the memory budget's prediction for the
     compiled run (machinery/memory_budget.py), and the data: the tiny corpus's real text when it travelled
     with the tree (`carry data/tiny_corpus`), else shards drawn from its token statistics
     (bench/representative_tokens.py), said so;
  2. compiled: train_gpt.py, the 1gpu preset compiled with CUDA graphs and the sync check, one
     GPU's share of the n-gram table resident, two stages of different micro-batches with the
     untie inside the second (the speedrun's stage 2, 49,152 tokens x 14,336 candidates, then its
     stage 4, 32,768 tokens x the full vocabulary): each warm-up part's seconds and compiled
     graphs as it ends, step times per stage, losses, compiled graphs and eager runs in the timed
     run (both must be 0), peak memory beside the budget, and the implementation the warm-up timed
     fastest at each GEMM and attention shape (its log's kernel choice lines);
  3. tests: the GPU kernel tests (tests/test_kernels.py -k gpu);
  4. training:triton and training:reference: eager steps at one micro-batch of the first stage
     with a small n-gram table in host memory (its device cache at the fewest rows allowed, so
     that rows go back to the host), from the same FP8-calibrated start, with the Triton kernels
     (under the sync check) and with the plain-torch references: losses side by side;
  5. routing: the split n-gram table's host routing of one micro-batch, at one thread;
  6. kernels: each kernel family against its torch peer (torch._scaled_mm in the accumulation
     mode production uses, flex_attention and SDPA, F.cross_entropy, ...) at the presets' shapes,
     each implementation (the FP8 GEMM's persistent descriptor and pointer kernels, attention's
     atomic and deterministic backwards) checked against torch or the reference before it is
     timed, with the time that is left; from those times the efficiencies by kernel structure
     that the step model's measured line reads (bench/measured_efficiency.json);
  7. the projection of the 8xH100 run: the step model (bench/step_model.py, run beside the parts
     on the CPU) corrected by the measured compiled step, with the model's communication terms.
The step model's prediction stands beside every measured time.

Isolation. This process imports neither torch nor triton: every part runs in a process of its
own (a child forked from a server that has them imported, or a program: pytest, train_gpt.py),
so a sticky CUDA error or a crash costs that part only. A part still running at its deadline is
killed with its process group and reported with what it had reported.

Output. The section is printed at the end and appended to bench/results.md; with $OUT set,
results.md and bench.json there are rewritten after every part (a run stopped from outside still
leaves what it measured), with parts.log, gpu_tests.txt, compiled_run.txt, compile_cache.tgz and
measured_efficiency.json: seven files (the machine returns at most 8, of at most 16 MiB each). Exit status 1 when a part
failed; a missed speed target is reported, not a failure; 2 without a CUDA GPU.

For tests only: `--fail-part NAME` makes the child of part NAME raise once its work is done,
`--crash-part NAME` makes it exit then without reporting its result (NAME: a part that runs in a
child, see `child_part_names`).
"""
import argparse
import collections
import dataclasses
import datetime
import faulthandler
import json
import multiprocessing
import os
import pathlib
import platform
import re
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
import warnings

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_PATH = pathlib.Path(__file__).resolve().parent / "results.md"
sys.path.insert(0, str(REPO_ROOT))

from kernel_timings import (KERNEL_BENCHES, KERNEL_HEADER, ROUTING_WAYS, Line, Timer, markdown_table,  # noqa: E402
                            routing_host_ms, routing_line)
from representative_tokens import write_representative_shard  # noqa: E402

# Per-GPU speedrun shapes and the tiny ones of the dry mode. softmax_widths: the speedrun's sampled
# softmax widths, the dominant stage's first (train_gpt.SOFTMAX_LATE, _EARLY, _LAST; the test checks);
# windows: the dominant stage's short and long windows in tokens; doc_len: the equal documents of the
# SDPA comparison; doc_median / max_doc_len: the uneven documents of the flex_attention one.
# ngram_rows: one rank's share of the full n-gram table (84,602,880 rows over 8 GPUs).
GPU_SHAPES = dict(tokens=49152, width=768, hidden=2816, vocab=50304, softmax_widths=(14336, 10240, 24576),
                  doc_len=3072, doc_median=600, max_doc_len=3072, windows=(640, 1408),
                  muon=((16, 768, 768), (8, 768, 2816)), ngram_rows=10_575_360)
DRY_SHAPES = dict(tokens=96, width=32, hidden=64, vocab=300, softmax_widths=(100, 60, 150), doc_len=48,
                  doc_median=20, max_doc_len=48, windows=(12, 20), muon=((2, 32, 32), (2, 32, 64)), ngram_rows=1000)

# The training runs: the 1gpu preset with one GPU's share of the speedrun's n-gram table resident
# (the preset's whole table, 130 GB in host memory, does not fit the bench machine's RAM). The dry
# mode shrinks the cpu preset to a 2-layer model with sampled softmax in its first stage, no FP8
# layers and Adam only, so that the interpreter runs only the attention and a cheap
# cross-entropy (the kernel part runs the others); its stages stand for the GPU run's two.
GPU_TRAIN_CONFIG = ["--preset", "1gpu", f"--ngram_rows={GPU_SHAPES['ngram_rows']}", "--ngram_cache_rows=0"]
DRY_TRAIN_CONFIG = [
    "--preset", "cpu", "--device=cpu", "--num_layers=2", "--model_dim=64", "--num_heads=1", "--head_dim=64",
    "--mlp_hidden=128", "--bigram_rows=1024", "--ngram_rows=2048", "--long_window_layers=[1]",
    "--narrow_qk_layers=[]", "--fp8_mlp=false", "--fp8_qkv=false", "--fp8_head=false", "--optimizer=adamw",
    "--batch_ranks=1", "--val_tokens=128", "--val_tokens_per_rank=128",
    '--stages=[{"end":0.5,"tokens_per_rank":64,"max_doc_len":64,"short_window":1,"long_window":1,"candidates":128},'
    '{"end":1.0,"tokens_per_rank":32,"max_doc_len":32,"short_window":1,"long_window":1}]',
]
# The compiled run's stages: (the preset's stage index, its steps), the untie inside the second.
COMPILED_STAGES = dict(gpu=((2, 8), (4, 4)), dry=((0, 2), (1, 2)))
UNTIE_STEP = dict(gpu=10, dry=3)  # the first untied step
DOMINANT_STAGE = COMPILED_STAGES["gpu"][0][0]  # the speedrun's stage 2: the most steps at the largest micro-batch
EAGER_STEPS = 5           # eager steps of each kernel set, from the calibrated start, the first untimed
EAGER_NGRAM_ROWS = dict(gpu=1_321_920, dry=2048)  # the eager runs' small table (1/64 of the record's on a GPU)
EAGER_VAL_TOKENS = dict(gpu=16384, dry=32)  # a validation slice the eager runs' device cache leaves room for
VAL_TOKENS = dict(gpu=65536, dry=128)  # the compiled run's one validation slice: not what it measures
TRAIN_SHARD_TOKENS = dict(gpu=1 << 23, dry=1 << 14)  # representative shards: the loader cycles through them
VAL_SHARD_TOKENS = 1 << 17  # more than the compiled run's validation reads
TINY_CORPUS = REPO_ROOT / "data" / "tiny_corpus"  # real text, when it travelled with the tree

# What fits in a loan of the GPU machine (see the docstring): a call's start-up, command and
# transfers, twice.
DEVICE_TIME_S = 900       # the device time a task is lent, start-ups included
START_UP_S = 120          # a cold machine's start, at most
TRANSFER_S = 30           # the tree sent and the files fetched, per call
# Each part's cap, in the order the parts run; with REPORT_RESERVE_S (the report and the caches'
# archive) they fill BUDGET_S.
PART_LIMITS_S = {"environment": 25, "compiled": 150, "tests": 30, "training:triton": 20, "training:reference": 20,
                 "routing": 10, "kernels": 20}
REPORT_RESERVE_S = 25
MEASURE_LIMIT_S = 10       # the efficiencies' child (it imports the step model)
# The kernel bench's efficiencies by structure, which bench/step_model.py's measured line reads.
MEASURED_EFFICIENCY = pathlib.Path(__file__).resolve().parent / "measured_efficiency.json"
BUDGET_S = 300
DRY_SLACK = 4             # the dry mode's caps: the Triton interpreter on a shared CPU is slower than a GPU
KERNEL_BENCH_LIMIT_S = 10  # the most one kernel bench may take of the kernels' cap
MIN_PART_S = 1            # a part with less time left than this is not started
NVIDIA_SMI_TIMEOUT_S = 20
DRY_NOTE = ("dry: flex_attention runs uncompiled and forward-only (no CPU backward); SDPA uses its CPU "
            "backend; the compiled run is train_gpt.py with --compile=false")
PARTS = ("tests", "compiled", "training", "routing", "kernels")  # what --parts can select

# The compile caches: Triton's and Inductor's, in one folder at a fixed path (Triton's cache
# records its files' absolute paths), packed after the compiled run and at the end into one
# archive that comes back with the results and that a later call unpacks before it starts.
CACHE_DIR = pathlib.Path(tempfile.gettempdir()) / "first_contact_cache"
CACHE_NAME = "compile_cache.tgz"
DEFAULT_CACHE = pathlib.Path(__file__).resolve().parent / CACHE_NAME   # what a call carries (git-ignored)
RETURNED_FILE_BYTES = 16 * 2**20  # the most one file under $OUT may hold and come back from the GPU machine
# Triton's intermediate code: a cache hit reads a kernel's metadata and its binary only
# (triton.compiler.CompiledKernel), so an archive too large to come back leaves these out.
TRITON_IR_SUFFIXES = (".ttir", ".ttgir", ".llir", ".ptx", ".source", ".amdgcn")

# Child processes: the modules their server imports once (third-party only: each child imports
# the trainer's own modules, so that an error in one is that child's to report), how long a
# killed child may take to go, and how much of its output a failure quotes.
PRELOADED_MODULES = ("numpy", "torch", "torch._dynamo", "triton", "triton.language")
START_METHODS = ("forkserver", "spawn")
KILL_WAIT_S = 30
QUOTED_OUTPUT_LINES = 20
GIT_TIMEOUT_S = 30


class Deadline:
    """Seconds left of a time budget, less a reserve kept back for the report; every budget, cap
    and reserve times `scale` (the dry mode's DRY_SLACK)."""

    def __init__(self, budget_s, reserve_s=REPORT_RESERVE_S, scale=1):
        self.scale = scale
        self.end = time.monotonic() + budget_s * scale
        self.reserve_s = reserve_s * scale

    def scaled(self, seconds):
        return seconds * self.scale

    def left(self, limit_s=float("inf")):
        return max(0.0, min(limit_s * self.scale, self.end - time.monotonic() - self.reserve_s))


def kernel_block(outcomes, dry):
    """The kernel table of the benches that finished, with a note for those that did not."""
    lines = kernel_lines(outcomes)
    notes = [DRY_NOTE] if dry else []
    untimed = [f"{name} ({outcome.describe()})" for name, outcome in outcomes.items() if not outcome.finished]
    if untimed:
        notes.append("not timed: " + "; ".join(untimed))
    missed = [line.name for line in lines if line.missed()]
    if missed and not dry:
        notes.append("targets missed (the FP8 GEMMs can run on torch._scaled_mm: --fp8_gemm=scaled_mm): "
                     + ", ".join(missed))
    differ = [f"{line.name} {line.shape}" for line in lines if line.disagrees()]
    if differ:
        notes.append("outputs differ from torch's beyond their tolerance: " + "; ".join(differ))
    return "\n\n".join([markdown_table(KERNEL_HEADER, [line.cells() for line in lines])] + notes)


def kernel_lines(outcomes):
    return [Line(**fields) for outcome in outcomes.values() for fields in outcome.result.get("lines", [])]


# -----------------------------------------------------------------------------------------------
# The data, the runs' arguments, the eager steps
# -----------------------------------------------------------------------------------------------

# Each eager variant: its --kernels; a variant's key names its part, training:KEY.
TRAINING_VARIANTS = dict(triton="triton", reference="reference")


def mode(dry):
    return "dry" if dry else "gpu"


def training_data(data_dir, dry):
    """(train files, val files, what they are): the tiny corpus's real text when it is here, else
    shards drawn from its token statistics, written to data_dir."""
    train, val = sorted(TINY_CORPUS.glob("tiny_train_*.bin")), sorted(TINY_CORPUS.glob("tiny_val_*.bin"))
    if train and val:
        return [str(f) for f in train], [str(f) for f in val], "the tiny corpus (real text)"
    generator = np.random.default_rng(0)
    train, val = os.path.join(data_dir, "train_000000.bin"), os.path.join(data_dir, "val_000000.bin")
    write_representative_shard(train, TRAIN_SHARD_TOKENS[mode(dry)], generator)
    write_representative_shard(val, VAL_SHARD_TOKENS, generator)
    return [train], [val], ("tokens drawn from the tiny corpus's statistics (bench/representative_tokens.py; "
                            "data/tiny_corpus did not travel with the tree)")


def compiled_args(dry):
    """train_gpt.py arguments of the compiled run: the preset's two COMPILED_STAGES, each for its
    steps, the head untied at UNTIE_STEP."""
    import train_gpt as tg
    base = DRY_TRAIN_CONFIG if dry else GPU_TRAIN_CONFIG
    h = tg.parse_config(base)
    (first, first_steps), (second, second_steps) = COMPILED_STAGES[mode(dry)]
    steps = first_steps + second_steps
    stages = [tg.config_to_dict(h)["stages"][first] | {"end": first_steps / steps},
              tg.config_to_dict(h)["stages"][second] | {"end": 1.0}]
    return [a for a in base if not a.startswith("--stages=")] + [
        f"--stages={json.dumps(stages)}", f"--num_iterations={steps}",
        f"--untie_frac={(UNTIE_STEP[mode(dry)] + 0.5) / steps}"]   # untie_step rounds down


def eager_args(dry):
    """train_gpt.py arguments of the eager runs: the compiled run's first stage alone, one
    micro-batch a step, the head tied, a small n-gram table in host memory with a device cache of
    the fewest rows allowed (one Adam event a step: the fewest rows a cache may have)."""
    import torch

    import train_gpt as tg
    from machinery import sparse_tables
    stage = tg.config_to_dict(tg.parse_config(compiled_args(dry)))["stages"][0] | {"end": 1.0}
    kept = [a for a in compiled_args(dry) if not a.startswith(("--stages=", "--untie_frac=", "--ngram_", "--batch_ranks=",
                                                                "--val_tokens", "--num_iterations="))]
    args = kept + [
        f"--stages={json.dumps([stage])}", f"--num_iterations={EAGER_STEPS}", "--untie_frac=1.0", "--batch_ranks=1",
        "--table_phases=[]",
        "--ngram_step_every=1", f"--ngram_rows={EAGER_NGRAM_ROWS[mode(dry)]}",
        f"--val_tokens_per_rank={EAGER_VAL_TOKENS[mode(dry)]}", f"--val_tokens={EAGER_VAL_TOKENS[mode(dry)]}"]
    rows = sparse_tables.min_cache_rows(tg.parse_config(args), tg.ProcessGroup(0, 1, 0, torch.device("cpu")))
    return args + [f"--ngram_cache_rows={rows}"]


def files_args(plan):
    return [f"--train_files={plan['train_files'][0]}", f"--val_files={plan['val_files'][0]}"]


def wall_ms(fn, device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def eager_steps(args, device, steps, progress, sync_check):
    """Losses and ms of `steps` optimizer steps of train_gpt's config `args`, eager, from its
    start with its FP8 scales calibrated on the first batch (as train_gpt.train starts), each
    step under the sync check when `sync_check` (on CUDA); with the table in host memory, the
    rows its cache wrote back. progress(losses=, ms=) after each step."""
    import train_gpt as tg
    h = tg.parse_config(args)
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, device), tg.RunLog("unused", active=False))
    loader = tg.train_loader(h, tg.shards_of(h.train_files))
    stage = h.stages[0]
    batches = [loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
               for _ in range(steps)]
    if device.type == "cuda":
        batches = [[s.pinned() for s in slices] for slices in batches]
    trainer.calibrate_fp8(batches[0])
    losses, times = [], []
    for step, slices in enumerate(batches):
        trainer.advance_to(step)
        out = []

        def checked_step():
            with tg.host_syncs_are_errors(sync_check and device.type == "cuda"):
                out.append(trainer.train_step(step, slices))
        times.append(wall_ms(checked_step, device))
        losses.append(float(out[0][0]))
        progress(losses=losses, ms=times)
    host = trainer.tables.host
    return dict(losses=losses, ms=times, sync_check=sync_check and device.type == "cuda",
                written_back=host.evicted if host else 0, write_backs=host.rounds if host else 0)


def eager_table(results):
    """Losses of the eager variants side by side, their difference and step times."""
    header = ["step", "triton loss", "reference loss", "difference", "triton ms", "reference ms"]
    rows = []
    for step in range(EAGER_STEPS):
        cells = {key: results.get(key) or {} for key in TRAINING_VARIANTS}
        loss = {key: (r.get("losses") or [])[step] if step < len(r.get("losses") or []) else None
                for key, r in cells.items()}
        ms = {key: (r.get("ms") or [])[step] if step < len(r.get("ms") or []) else None for key, r in cells.items()}
        both = None not in loss.values()
        rows.append([str(step)] + [f"{loss[k]:.4f}" if loss[k] is not None else "-" for k in TRAINING_VARIANTS]
                    + [f"{loss['triton'] - loss['reference']:+.4f}" if both else "-"]
                    + [f"{ms[k]:.0f}" if ms[k] is not None else "-" for k in TRAINING_VARIANTS])
    return markdown_table(header, rows)


def host_table_line(result):
    """What the eager Triton run's host table did: the rows it wrote back, under the sync check."""
    if not result or "written_back" not in result:
        return "host table: not exercised (the eager Triton run did not finish)"
    check = " under the sync check" if result.get("sync_check") else ""
    if not result["write_backs"]:
        return f"host table: no row written back{check} (the device cache did not fill)"
    return (f"host table: {result['written_back']:,} rows written back to host memory in {result['write_backs']} "
            f"round(s){check}, the losses above with them")


# -----------------------------------------------------------------------------------------------
# Programs; the compiled run, the step model and the projection
# -----------------------------------------------------------------------------------------------

def run_command(command, timeout_s, env=None):
    """(exit status, stdout, stderr) of a program run in a process group of its own; status None
    when it was killed, whole group, at the timeout. An interruption (SIGTERM, Ctrl-C) kills the
    group too before it goes on."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                          start_new_session=True, env=env) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_process_group(process.pid)
            try:
                stdout, stderr = process.communicate(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                stdout, stderr = "", "(its output was lost: something it started kept the pipes open)"
            return None, stdout, stderr
        except BaseException:
            kill_process_group(process.pid)
            raise
    return process.returncode, stdout, stderr


def kill_process_group(pgid):
    """SIGKILL every process of the group (none left: nothing to do)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def compiled_run_command(plan, dry, log_dir):
    """train_gpt.py compiled (--compile=false in the dry mode, with the warm-up it would have) on
    the compiled run's arguments, with the sync check (a host sync inside a timed step is an error)."""
    settings = ["--compile=false", "--warm_up=always"] if dry else []
    return [sys.executable, "train_gpt.py", *plan["compiled_args"], *settings,
            f"--val_tokens={VAL_TOKENS[mode(dry)]}", "--sync_check=true", "--log_every=1", *files_args(plan),
            f"--log_dir={log_dir}"]


# Lines of train_gpt.py's output: the warm-up's parts, the graph counts, the steps, memory, and
# the final summary.
WARM_UP_PART_LINE = re.compile(r"^warm-up part: (.*): ([\d.]+) s, (\d+) graph\(s\) compiled$", re.MULTILINE)
COMPILE_LINE = re.compile(r"compile: (\d+) graphs in the warm-up, (\d+) in the timed run")
CUDA_GRAPHS_LINE = re.compile(r"cuda graphs: (\d+) training steps and (\d+) optimizer updates captured in the "
                              r"warm-up, (\d+) ran eagerly in the timed run")
FINAL_LINE = re.compile(r"final val_loss:(\S+) train_time:(\d+)ms steps:(\d+)")
STEP_LINE = re.compile(r"step:(\d+)/\d+ train_loss:(\S+) .*train_time:(\d+)ms")
MEMORY_LINES = re.compile(r"^(memory budget: .*|memory: .*)$", re.MULTILINE)
RECOMPILE_LINE = re.compile(r"Recompiling function|torch._dynamo hit config.recompile_limit")
KERNEL_CHOICE = "kernel choice: "  # starts each line of the log that says a shape's implementation (kernel_choice.py)


def stage_step_ms(steps, first, last):
    """ms of each step from `first` to `last` (0-based, within one stage) but the first, from the
    cumulative train_time of the step lines [(step count, loss, ms)]: the stage's first step
    changes graphs and its host work differs."""
    at = {count: ms for count, _, ms in steps}
    return [at[k + 1] - at[k] for k in range(first + 1, last + 1) if k in at and k + 1 in at]


def compiled_run(plan, dry, timeout_s):
    """Run train_gpt.py compiled; returns a dict of what it reported (ok False on any failure),
    the warm-up's parts as they ended even when it was stopped in the warm-up."""
    with tempfile.TemporaryDirectory() as log_dir:
        command = compiled_run_command(plan, dry, log_dir)
        start = time.perf_counter()
        status, stdout, stderr = run_command(command, timeout_s, env=os.environ | {"TORCH_LOGS": "recompiles",
                                                                                  "PYTHONUNBUFFERED": "1"})
        seconds = time.perf_counter() - start
        choices = [line for log in sorted(pathlib.Path(log_dir).glob("*.txt"))
                   for line in log.read_text(errors="replace").splitlines() if line.startswith(KERNEL_CHOICE)]
    output = stdout + stderr
    compile_match, final_match = COMPILE_LINE.search(stdout), FINAL_LINE.search(stdout)
    steps = [(int(m[1]), float(m[2]), int(m[3])) for m in STEP_LINE.finditer(stdout)]
    result = dict(command=" ".join(command[1:]), exit_status=status, wall_s=seconds, output=output,
                  losses=[loss for _, loss, _ in steps], memory=MEMORY_LINES.findall(stdout),
                  recompiles=len(RECOMPILE_LINE.findall(output)), kernel_choices=choices,
                  warm_up=[(what, float(s), int(graphs)) for what, s, graphs in WARM_UP_PART_LINE.findall(stdout)])
    (_, first_steps), (_, second_steps) = COMPILED_STAGES[mode(dry)]
    result["stage_ms"] = [stage_step_ms(steps, 0, first_steps - 1),
                          stage_step_ms(steps, first_steps, first_steps + second_steps - 1)]
    if compile_match:
        result.update(warm_up_graphs=int(compile_match[1]), timed_graphs=int(compile_match[2]))
    cuda_graphs_match = CUDA_GRAPHS_LINE.search(stdout)   # on CUDA only
    if cuda_graphs_match:
        result.update(captured_steps=int(cuda_graphs_match[1]), captured_updates=int(cuda_graphs_match[2]),
                      eager_runs=int(cuda_graphs_match[3]))
    if final_match:
        result.update(val_loss=float(final_match[1]), mean_step_ms=int(final_match[2]) / int(final_match[3]))
    if status is None:
        where = f"after {result['warm_up'][-1][0]}" if result["warm_up"] else "before its first warm-up part ended"
        where = f"at step {steps[-1][0]}" if steps else f"in the warm-up, {where}"
        result["error"] = f"stopped at the time limit after {seconds:.0f} s, {where}"
    elif status != 0 or not (final_match and compile_match):
        last = (stderr.strip() or stdout.strip() or "no output").splitlines()[-1]
        result["error"] = f"exit status {status}: {last}"
    result["ok"] = ("error" not in result and result.get("timed_graphs") == 0 and not result.get("eager_runs")
                    and result["recompiles"] == 0)
    return result


IN_TIMED_RUN = "graphs built, recompiles, or steps run without their CUDA graph, in the timed run"


def warm_up_line(run):
    """The warm-up's parts that ended, each with its seconds and compiled graphs."""
    if not run.get("warm_up"):
        return "warm-up parts: none ended"
    return "warm-up parts: " + "; ".join(f"{what} {s:.1f} s ({graphs} graphs)" for what, s, graphs in run["warm_up"])


def compiled_run_block(run, model_ms, dry):
    """The compiled run's lines: its warm-up's parts, each stage's steps (the first beside the
    step model's), graphs, memory, losses."""
    (first, first_steps), (second, second_steps) = COMPILED_STAGES[mode(dry)]
    what = ("train_gpt.py --compile=false (dry), tiny config, two stages" if dry else
            f"train_gpt.py, the 1gpu preset compiled, the speedrun's stage {first} ({first_steps} steps) then "
            f"its stage {second} ({second_steps} steps, the head untied at step {UNTIE_STEP['gpu']})")
    if "error" in run:
        return "\n\n".join([f"compiled run: FAILED ({run['error']}); {what}", warm_up_line(run)])
    times = [t or [run["mean_step_ms"]] for t in run["stage_ms"]]
    model = f", the step model {model_ms:.1f} ms (measured/model {statistics.median(times[0]) / model_ms:.2f})" \
        if model_ms else ""
    graphs = f"compile: {run['warm_up_graphs']} graphs in the warm-up, {run['timed_graphs']} in the timed run"
    if "captured_steps" in run:
        graphs += (f"; CUDA graphs: {run['captured_steps']} training steps and {run['captured_updates']} optimizer "
                   f"updates captured, {run['eager_runs']} eager runs in the timed run")
    verdict = "" if run["ok"] else f" (FAILED: {IN_TIMED_RUN})"
    steps = [f"stage {i}: median step {statistics.median(t):.1f} ms (steps {', '.join(f'{x:.0f}' for x in t)})"
             for i, t in enumerate(times)]
    lines = [f"compiled run: {steps[0]}{model}; {steps[1]}; {graphs}; {run['recompiles']} recompiles logged"
             f"{verdict}; {run['wall_s']:.0f} s wall with compilation; {what}",
             warm_up_line(run),
             "losses: " + ", ".join(f"{loss:.4f}" for loss in run["losses"]) + f"; val_loss {run['val_loss']:.4f}"]
    return "\n\n".join(lines + run["memory"] + [kernel_choices_block(run)])


def kernel_choices_block(run):
    """The implementation the warm-up chose at each shape, with the candidates' times."""
    choices = run.get("kernel_choices") or []
    if not choices:
        return "kernel choices: none logged (nothing was timed: no CUDA, or no warm-up)"
    return "kernel choices (the warm-up's, rank 0's on every rank):\n\n" + "\n".join(
        f"- {line[len(KERNEL_CHOICE):]}" for line in choices)


def start_step_model(plan_args, out_dir, dry):
    """The step model of the compiled run on one H200 and of the speedrun on 8 H100s, in a
    process of its own on the CPU, beside the parts (its JSON files land in out_dir)."""
    run = ["--preset", "cpu", "--gpus", "1", "--gpu", "h200"] if dry else ["--preset", "1gpu", "--gpus", "1",
                                                                           "--gpu", "h200"]
    overrides = [a for a in plan_args if a not in ("--preset", "cpu", "1gpu")]
    speedrun = ["--preset", "cpu", "--gpus", "1"] if dry else ["--preset", "speedrun", "--gpus", "8", "--gpu", "h100"]
    script = ("import subprocess, sys; [subprocess.run(a, stdout=subprocess.DEVNULL) for a in "
              f"[{[sys.executable, 'bench/step_model.py', *run, '--json', str(out_dir / 'model.json'), '--', *overrides]!r}, "
              f"{[sys.executable, 'bench/step_model.py', *speedrun, '--json', str(out_dir / 'speedrun.json')]!r}]]")
    return subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def read_model(out_dir, name):
    try:
        return json.loads((out_dir / name).read_text())
    except (OSError, ValueError):
        return None


def projection_line(compiled, model, speedrun):
    """The 8xH100 run projected from the measured compiled step: the step model's compute time of
    the speedrun scaled by measured/model at the dominant shape (the compiled run's first stage)
    on this GPU, plus the model's communication time (one GPU has no NCCL to measure)."""
    if speedrun is None:
        return "projection: not available: the step model did not finish in time"
    plain = f"the step model alone: {speedrun['run_s']:.1f} s ({speedrun['peak_s']:.1f} s at the peaks)"
    if not compiled or "error" in compiled or not model:
        return f"projection (an estimate, not a measurement): 8xH100 speedrun {plain}; no measured step to correct it"
    measured = statistics.median(compiled["stage_ms"][0] or [compiled["mean_step_ms"]])
    ratio = measured / model["stages"][0]["ms"]
    seconds = ratio * speedrun["compute_s"] + speedrun["communication_s"]
    return (f"projection (an estimate, not a measurement): 8xH100 speedrun {seconds:.1f} s = measured/model "
            f"{ratio:.2f} (this GPU, the dominant shape) x the model's compute {speedrun['compute_s']:.1f} s + its "
            f"communication {speedrun['communication_s']:.1f} s; {plain}")


# -----------------------------------------------------------------------------------------------
# The compile caches
# -----------------------------------------------------------------------------------------------

def cache_environment(cache_dir):
    """The variables that put Triton's and Inductor's caches in cache_dir."""
    return {"TRITON_CACHE_DIR": str(cache_dir / "triton"), "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor")}


def unpack_caches(archive, cache_dir):
    """Put an earlier call's caches (the archive pack_caches made) into cache_dir; a line saying
    what was found."""
    archive = pathlib.Path(archive)
    if not archive.is_file():
        return f"compile caches: cold (no {archive.name} carried)"
    try:
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
            tar.extractall(cache_dir, members=members, filter="data")
    except (OSError, tarfile.TarError) as error:
        return f"compile caches: cold ({archive.name} could not be read: {error})"
    return f"compile caches: warm, {sum(m.isfile() for m in members)} files from {archive.name}"


def pack_caches(cache_dir, archive):
    """Write the caches in cache_dir to one archive, without Triton's intermediate code when the
    whole would be too large to come back; (files, bytes, whether it left that code out)."""
    files = sorted(p for p in pathlib.Path(cache_dir).rglob("*") if p.is_file())
    archive = pathlib.Path(archive)
    archive.parent.mkdir(parents=True, exist_ok=True)
    for lean in (False, True):
        kept = [p for p in files if not (lean and p.suffix in TRITON_IR_SUFFIXES)]
        staging = archive.with_name(archive.name + ".partial")
        with tarfile.open(staging, "w:gz") as tar:
            for path in kept:
                tar.add(path, arcname=str(path.relative_to(cache_dir)))
        os.replace(staging, archive)
        if archive.stat().st_size <= RETURNED_FILE_BYTES:
            break
    return len(kept), archive.stat().st_size, lean


def cache_line(cache_dir, archive, found):
    """Pack the caches (pack_caches) and say what the archive holds and how a later call uses it."""
    try:
        count, size, lean = pack_caches(cache_dir, archive)
    except OSError as error:
        return f"{found}; not packed ({error})"
    note = (" (over the 16 MiB that come back: it stays behind)" if size > RETURNED_FILE_BYTES else
            " (Triton's intermediate code left out to fit)" if lean else "")
    return (f"{found}; now {count} files, {size / 2**20:.1f} MiB in {archive}{note}: carry it as "
            f"bench/{CACHE_NAME} for a warm call")


# -----------------------------------------------------------------------------------------------
# Parts in child processes
# -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Task:
    """One part as its child runs it: function(task, progress) returns the part's result (a dict
    of JSON values), progress(**fields) records some of it as it goes."""
    name: str
    function: object
    dry: bool
    seconds: float            # the child's deadline, counted from its start
    result_path: str
    log_path: str
    injected: str = ""        # "raise" or "crash" (tests only); "" for none
    params: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Outcome:
    """How a part ended: what it reported (partial when it did not finish), its seconds, and, when
    it failed, a one-line error with the details (traceback, or the end of its output)."""
    result: dict
    seconds: float = 0.0
    error: str = ""
    details: str = ""
    timed_out: bool = False
    not_run: str = ""         # why the part did not start
    log_path: str = ""        # its child's output

    @property
    def finished(self):
        return not (self.error or self.not_run)

    def describe(self):
        return "ok" if self.finished else f"not run: {self.not_run}" if self.not_run else self.error


def is_failure(name, outcome):
    """Whether the part counts as failed: any error, but for a deadline that stopped the reference
    timings (the budget cuts them by design)."""
    return bool(outcome.error) and not (name == "training:reference" and outcome.timed_out)


class ChildReport:
    """A child's result file, rewritten whole (written aside, then renamed) at every change, so
    that the parent finds what the part reported even when it was killed."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        self.result = {}

    def progress(self, **fields):
        self.result.update(fields)
        self.write()

    def finish(self, result):
        self.result.update(result)
        self.write(finished=True)

    def fail(self, text):
        self.write(error=text)

    def write(self, **status):
        staging = self.path.with_suffix(".partial")
        staging.write_text(json.dumps(dict(result=self.result, **status), default=str))
        os.replace(staging, self.path)


def read_child_report(path):
    """The child's last report ({} when it wrote none)."""
    try:
        return json.loads(pathlib.Path(path).read_text())
    except (OSError, ValueError):
        return {}


def child_main(task):
    """The body of a part's child: a process group of its own (the parent kills it whole), its
    output to its log, then the part. An exception is reported with its traceback, exit status 1.
    Once it has reported, the child exits at once: the interpreter's teardown (CUDA's, after a
    CUDA error) cannot hold it up."""
    os.setsid()
    redirect_output(task.log_path)
    report = ChildReport(task.result_path)
    try:
        prepare_child(task.dry)
        result = task.function(task, report.progress) or {}
        inject_failure(task)
        report.finish(result)
        status = 0
    except BaseException:
        text = traceback.format_exc()
        print(text, file=sys.stderr)
        report.fail(text)
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def redirect_output(path):
    """Send this process's stdout and stderr, and those of what it starts, to the file `path`;
    a fatal signal's traceback goes there too."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    faulthandler.enable()


def prepare_child(dry):
    """Seed torch; in the dry mode, install the interpreter shim (tests/helpers/interpreter_shim.py)."""
    import torch
    if dry:
        from interpreter_shim import install_shim
        install_shim()
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)


def inject_failure(task):
    """After the part's work (so that a test of the failure still runs its code), --fail-part:
    raise; --crash-part: end the process at once, reporting nothing more."""
    if task.injected == "crash":
        os._exit(1)
    if task.injected == "raise":
        raise RuntimeError(f"injected by --fail-part {task.name}")


class PartRunner:
    """Runs each part in a child process and collects how it ended. With the forkserver start
    method the children fork from a server that has imported PRELOADED_MODULES once; this process
    imports none of them."""

    def __init__(self, work_dir, dry, start_method="forkserver", injected=None):
        self.context = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            self.context.set_forkserver_preload(list(PRELOADED_MODULES))
        self.work_dir = pathlib.Path(work_dir)
        self.dry = dry
        self.injected = injected or {}     # part name -> "raise" or "crash"

    def run(self, name, function, seconds, **params):
        """function(task, progress) in a child that is killed, with its process group, when it runs
        past `seconds`; not started with less than MIN_PART_S."""
        if seconds < MIN_PART_S:
            return Outcome({}, not_run="out of time budget")
        stem = self.work_dir / re.sub(r"\W", "_", name)
        task = Task(name, function, self.dry, seconds, f"{stem}.json", f"{stem}.log", self.injected.get(name, ""),
                    params)
        start = time.monotonic()
        process = self.context.Process(target=child_main, args=(task,), name=f"first_contact {name}")
        try:
            process.start()
        except Exception as error:
            return Outcome({}, time.monotonic() - start, f"its process did not start: {error!r}",
                           traceback.format_exc())
        try:
            process.join(seconds)
        finally:
            timed_out = process.exitcode is None
            kill_child(process)
        return child_outcome(task, process.exitcode, timed_out, time.monotonic() - start)


def kill_child(process):
    """Kill the child's process group (what it started but left running goes too) and the child,
    and wait for it."""
    kill_process_group(process.pid)
    process.kill()
    process.join(KILL_WAIT_S)


def child_outcome(task, exitcode, timed_out, seconds):
    """The Outcome of a child from its report file, its exit status and its log."""
    report = read_child_report(task.result_path)
    outcome = Outcome(report.get("result", {}), seconds, log_path=task.log_path)
    if report.get("finished"):
        return outcome
    if "error" in report:
        outcome.error, outcome.details = last_line(report["error"]), report["error"]
    elif timed_out:
        outcome.error, outcome.timed_out = f"stopped at its deadline ({task.seconds:.0f} s)", True
        outcome.details = output_tail(task.log_path)
    else:
        outcome.error = f"its process died ({exit_description(exitcode)}) before it reported"
        outcome.details = output_tail(task.log_path)
    return outcome


def exit_description(exitcode):
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit status {exitcode}"


def last_line(text):
    return (text.strip().splitlines() or ["(empty)"])[-1]


def read_log(path):
    try:
        return pathlib.Path(path).read_text(errors="replace")
    except OSError:
        return ""


def output_tail(path):
    """The last QUOTED_OUTPUT_LINES lines of a child's log."""
    return "\n".join(read_log(path).splitlines()[-QUOTED_OUTPUT_LINES:]) or "(no output)"


def child_part_names():
    """The parts that run in a child (those that --fail-part and --crash-part take)."""
    return (["environment"] + [f"training:{key}" for key in TRAINING_VARIANTS] + ["routing"]
            + [f"kernel:{key}" for key in KERNEL_BENCHES])


def part_device(dry):
    import torch
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def report_versions(task, progress):
    """The versions of torch, triton and CUDA, the GPU's name, the memory budget of the compiled
    run (machinery/memory_budget.py) on this GPU, and the runs' plan: their data (training_data) and
    arguments."""
    import torch
    import triton
    cuda = torch.cuda.is_available()
    gpu = "cpu (dry run)" if task.dry else torch.cuda.get_device_name(0) if cuda else "no CUDA GPU"
    versions = dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda or "none",
                    cuda_available=cuda)
    progress(**versions)
    train_files, val_files, data = training_data(task.params["data_dir"], task.dry)
    plan = dict(train_files=train_files, val_files=val_files, data=data, compiled_args=compiled_args(task.dry),
                eager_args=eager_args(task.dry))
    progress(plan=plan)
    import train_gpt as tg
    from machinery import memory_budget
    budget = memory_budget.memory_budget(tg, tg.parse_config(plan["compiled_args"]), 1)
    total = torch.cuda.get_device_properties(0).total_memory if cuda and not task.dry else 80 * 2**30
    largest = sorted(budget.device.items(), key=lambda item: -item[1])[:4]
    return versions | dict(plan=plan, budget=f"memory budget of the compiled run: {budget.summary(total)} (its step "
                                             f"{budget.step / 2**30:.1f} GiB; largest held: "
                           + ", ".join(f"{name} {size / 2**30:.1f}" for name, size in largest) + " GiB)")


def time_kernel(task, progress):
    """The lines of the kernel bench task.params["bench"] (a key of KERNEL_BENCHES)."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    bench = KERNEL_BENCHES[task.params["bench"]]
    lines = bench(DRY_SHAPES if task.dry else GPU_SHAPES, part_device(task.dry), Timer(task.dry), task.dry)
    return dict(lines=[dataclasses.asdict(line) for line in lines])


def time_training(task, progress):
    """Losses and ms of EAGER_STEPS eager steps with the kernel set of task.params["variant"],
    the Triton kernels' under the sync check (the references' attention reads document starts
    on the host)."""
    plan, variant = task.params["plan"], task.params["variant"]
    args = plan["eager_args"] + files_args(plan) + [f"--kernels={TRAINING_VARIANTS[variant]}", "--compile=false",
                                                    "--cuda_graphs=false"]
    return eager_steps(args, part_device(task.dry), EAGER_STEPS, progress, sync_check=variant == "triton")


def routing_token_counts(dry):
    """The micro-batch sizes whose routing is timed: the speedrun's stages' (the dry shapes' one)."""
    import train_gpt as tg
    if dry:
        return [DRY_SHAPES["tokens"]]
    return sorted({s.tokens_per_rank for s in tg.parse_config(GPU_TRAIN_CONFIG).stages})


def time_routing(task, progress):
    """The split table's host routing (ShardedNgramRows.route_of, the batch prefetcher's work) at
    one thread: on a busy host a second thread slowed it down, never up."""
    import torch
    torch.set_num_threads(1)
    routing_ms = routing_host_ms(DRY_SHAPES if task.dry else GPU_SHAPES, routing_token_counts(task.dry),
                                 pin=not task.dry)
    return dict(routing_ms=routing_ms, line=routing_line(routing_ms) + "; at one thread")


# -----------------------------------------------------------------------------------------------
# Environment, GPU tests, report
# -----------------------------------------------------------------------------------------------

def git_commit():
    """HEAD's short hash (+ a note when the tree has changes), or "unknown" without git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=REPO_ROOT, check=True, timeout=GIT_TIMEOUT_S).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=REPO_ROOT, check=True, timeout=GIT_TIMEOUT_S).stdout.strip()
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")


def run_gpu_tests(dry, timeout_s):
    """The GPU tests of tests/test_kernels.py (collected only in the dry mode)."""
    command = [sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py", "-k", "gpu"]
    if dry:
        command.append("--collect-only")
    status, stdout, stderr = run_command(command, timeout_s)
    summary = (stdout.strip().splitlines() or ["(no output)"])[-1]
    if status is None:
        summary = f"stopped at the time limit ({timeout_s:.0f} s); last line: {summary}"
    return dict(ok=status == 0, summary=summary, output=stdout + stderr, timed_out=status is None)


class Report:
    """The markdown section and the raw numbers, built part by part; with an out_dir, results.md
    and bench.json there are rewritten after each part, next to the logs."""

    def __init__(self, out_dir):
        self.blocks = {}              # key -> markdown block, in the section's order
        self.raw = dict(part_seconds={}, errors={})
        self.failures = {}            # part -> its one-line error
        self.last_part = None         # the part that ended last
        self.out_dir = out_dir

    def put(self, key, block, **raw):
        """Add the block under `key`, or replace the one there; save."""
        self.blocks[key] = block
        self.raw.update(raw)
        self.save()

    def record(self, name, outcome):
        """A part's status line on stdout, its seconds, its child's output in parts.log, and, when it
        failed, its error (details on stderr)."""
        print(f"{name}: {outcome.describe()} ({outcome.seconds:.0f} s)", flush=True)
        self.last_part = name
        if outcome.not_run:
            return
        self.raw["part_seconds"][name] = round(outcome.seconds, 1)
        if outcome.log_path:
            self.append_log("parts.log", f"==== {name}: {outcome.describe()}\n{read_log(outcome.log_path)}")
        if is_failure(name, outcome):
            print(f"{name}: FAILED\n{outcome.details}", file=sys.stderr, flush=True)
            self.failures[name] = outcome.error
            self.raw["errors"][name] = f"{outcome.error}\n{outcome.details}"
        self.save()

    def stopped(self, reason):
        after = f" after {self.last_part}" if self.last_part else ""
        self.failures["bench"] = f"stopped from outside ({reason}){after}"
        self.put("stopped", f"stopped from outside ({reason}){after}: the parts above are those that ended")

    def markdown(self):
        blocks = list(self.blocks.values())
        if self.failures:
            blocks.append("FAILED: " + "; ".join(f"{name}: {error}" for name, error in self.failures.items())
                          + " (bench.json has the details)")
        return "\n" + "\n\n".join(blocks) + "\n"

    def save(self):
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "results.md").write_text(self.markdown())
        (self.out_dir / "bench.json").write_text(json.dumps(self.raw | dict(failures=self.failures), indent=1,
                                                            default=str))

    def save_log(self, name, text):
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            (self.out_dir / name).write_text(text)

    def append_log(self, name, text):
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / name, "a") as f:
                f.write(text.rstrip("\n") + "\n")


# -----------------------------------------------------------------------------------------------
# main
# -----------------------------------------------------------------------------------------------

def nvidia_smi(dry):
    if dry:
        return "nvidia-smi: not run (dry)"
    try:
        status, stdout, stderr = run_command(["nvidia-smi"], NVIDIA_SMI_TIMEOUT_S)
    except OSError as error:
        return f"nvidia-smi: could not run ({error})"
    return "```\n" + (stdout or stderr).strip() + "\n```"


def report_environment(runner, report, flags, deadline, work_dir):
    """The header: date, GPU, versions, commit, nvidia-smi, the compiled run's memory budget, and
    the runs' plan (None when the part did not make one). Exits (status 2) on a machine without
    a CUDA GPU."""
    outcome = runner.run("environment", report_versions, deadline.left(PART_LIMITS_S["environment"]),
                         data_dir=str(work_dir))
    versions = dict(gpu="unknown", torch="unknown", triton="unknown", cuda="unknown") | outcome.result
    if not flags.dry and versions.get("cuda_available") is False:
        print("first_contact.py needs a CUDA GPU; run it with --dry to check it on CPU", file=sys.stderr)
        sys.exit(2)
    report.record("environment", outcome)
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               python=platform.python_version(), commit=flags.commit or git_commit())
    env |= {k: v for k, v in versions.items() if k != "plan"}
    report.put("header", f"## {env['date']}, {env['gpu']}\n\npython {env['python']}, torch {env['torch']}, triton "
                         f"{env['triton']}, CUDA {env['cuda']}, commit {env['commit']}\n\n{nvidia_smi(flags.dry)}\n\n"
                         f"{versions.get('budget', 'memory budget: not computed (' + outcome.describe() + ')')}",
               environment=env)
    plan = outcome.result.get("plan") if outcome.finished else None
    if plan:
        report.put("plan", f"data: {plan['data']}; the compiled run's arguments: `{' '.join(plan['compiled_args'])}`")
    return plan


def run_gpu_tests_part(report, dry, deadline):
    seconds = deadline.left(PART_LIMITS_S["tests"])
    if seconds < MIN_PART_S:
        report.record("tests", Outcome({}, not_run="out of time budget"))
        return
    start = time.monotonic()
    tests = run_gpu_tests(dry, seconds)
    outcome = Outcome(dict(ok=tests["ok"], summary=tests["summary"]), time.monotonic() - start,
                      "" if tests["ok"] else tests["summary"], tests["output"][-4000:], tests["timed_out"])
    report.record("tests", outcome)
    report.save_log("gpu_tests.txt", tests["output"])
    verdict = "collected only" if dry else ("ok" if tests["ok"] else "FAILED")
    report.put("tests", f"GPU tests ({verdict}): {tests['summary']}", gpu_tests=outcome.result)


def run_routing_part(runner, report, deadline):
    outcome = runner.run("routing", time_routing, deadline.left(PART_LIMITS_S["routing"]))
    report.record("routing", outcome)
    report.put("routing", outcome.result.get("line") or f"routing: {outcome.describe()}",
               routing_ms=outcome.result.get("routing_ms"))


def run_kernel_parts(runner, report, dry, deadline):
    """One child per kernel bench, all within the kernels' cap; the table is rewritten as each ends;
    then the efficiencies the step model's measured line takes from them (measured_efficiency)."""
    kernels_deadline = time.monotonic() + deadline.left(PART_LIMITS_S["kernels"])
    outcomes = {}
    for key in KERNEL_BENCHES:
        name = f"kernel:{key}"
        left = min(kernels_deadline - time.monotonic(), deadline.left(), deadline.scaled(KERNEL_BENCH_LIMIT_S))
        outcomes[name] = runner.run(name, time_kernel, max(0.0, left), bench=key)
        report.record(name, outcomes[name])
        report.put("kernels", kernel_block(outcomes, dry),
                   kernels=[dataclasses.asdict(line) | {"ratio": line.ratio} for line in kernel_lines(outcomes)])
    lines = [dataclasses.asdict(line) for line in kernel_lines(outcomes)]
    outcome = runner.run("kernel:efficiencies", measure_efficiencies, deadline.left(MEASURE_LIMIT_S), lines=lines)
    found = outcome.result.get("efficiencies")
    if not found:
        return
    text = json.dumps(found, indent=1, sort_keys=True) + "\n"
    report.save_log(MEASURED_EFFICIENCY.name, text)
    if not dry:                    # the step model's measured line reads it (commit it with results.md)
        MEASURED_EFFICIENCY.write_text(text)
    report.put("efficiencies", "measured efficiencies (the step model's measured line, "
               f"bench/{MEASURED_EFFICIENCY.name}{'; dry: not written' if dry else ''}): " + json.dumps(found),
               measured_efficiencies=found)


def measure_efficiencies(task, progress):
    """The kernel lines' efficiencies by structure (kernel_timings.measured_efficiencies)."""
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    from kernel_timings import measured_efficiencies
    return dict(efficiencies=measured_efficiencies([Line(**fields) for fields in task.params["lines"]]))


class TrainingParts:
    """The compiled run and the eager variants, each reported as it ends."""

    def __init__(self, runner, report, flags, deadline, plan):
        self.runner, self.report, self.flags, self.deadline = runner, report, flags, deadline
        self.plan = plan
        self.compiled = None          # what compiled_run returned
        self.eager = {}               # variant -> its losses and ms

    def run_compiled(self, model_ms):
        seconds = self.deadline.left(PART_LIMITS_S["compiled"])
        if self.plan is None or seconds < MIN_PART_S:
            outcome = Outcome({}, not_run="it needs the environment's plan" if self.plan is None else
                              "out of time budget")
            self.report.record("compiled", outcome)
            self.report.put("compiled", f"compiled run: {outcome.describe()}")
            return
        run = compiled_run(self.plan, self.flags.dry, seconds)
        error = run.get("error") or ("" if run["ok"] else IN_TIMED_RUN)
        self.report.record("compiled", Outcome({k: v for k, v in run.items() if k != "output"}, run["wall_s"], error,
                                               run["output"][-4000:], run["exit_status"] is None))
        self.compiled = run
        self.report.save_log("compiled_run.txt", f"$ {run['command']}\n{run['output']}")
        self.report.put("compiled", compiled_run_block(run, model_ms(), self.flags.dry),
                        compiled_run={k: v for k, v in run.items() if k != "output"})

    def time_variant(self, variant):
        name = f"training:{variant}"
        if self.plan is None:
            outcome = Outcome({}, not_run="it needs the environment's plan")
        else:
            outcome = self.runner.run(name, time_training, self.deadline.left(PART_LIMITS_S[name]), variant=variant,
                                      plan=self.plan)
        self.report.record(name, outcome)
        self.eager[variant] = outcome.result
        notes = [f"{key}: {o}" for key, o in ((k, self.eager.get(k)) for k in TRAINING_VARIANTS) if o is None]
        self.report.put("eager", f"eager steps at one micro-batch of the compiled run's first stage (the first "
                                 f"includes the Triton JIT), the same data from the same calibrated start:\n\n"
                                 f"{eager_table(self.eager)}\n\n{host_table_line(self.eager.get('triton'))}"
                        + ("" if not notes else "\n\nnot run: " + "; ".join(notes)), eager=self.eager)


class Stopped(Exception):
    """The run is being stopped from outside (SIGTERM)."""


def raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def injected_failures(flags):
    return {name: "raise" for name in flags.fail_part} | {name: "crash" for name in flags.crash_part}


def parse_flags(argv=None):
    parser = argparse.ArgumentParser(description="The first GPU minutes: versions, the memory budget, a compiled "
                                                 "run of two stages and the untie, the GPU tests, eager steps "
                                                 "with both kernel sets and a host table, the host routing, the "
                                                 "kernel benches and the projection, each part within its cap.")
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton interpreter; writes nothing")
    parser.add_argument("--commit", default=None, help="commit of the tree (a copy without .git cannot tell)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole command may take")
    parser.add_argument("--cache", default=str(DEFAULT_CACHE),
                        help=f"the compile caches to start from, an archive an earlier call wrote (default: "
                             f"bench/{CACHE_NAME} when it is there)")
    parser.add_argument("--start-method", choices=START_METHODS, default="forkserver",
                        help="how the parts' child processes start: forked from a server that has torch imported "
                             "(default), or each from scratch")
    parser.add_argument("--fail-part", action="append", default=[], metavar="NAME",
                        help="for tests: make the child of part NAME raise")
    parser.add_argument("--crash-part", action="append", default=[], metavar="NAME",
                        help="for tests: make the child of part NAME exit at once, reporting nothing")
    parser.add_argument("--routing", action="store_true",
                        help="only time the split n-gram table's host routing on this host, each way, at the "
                             "process's threads (no GPU needed)")
    flags = parser.parse_args(argv)
    flags.parts = set(flags.parts.split(","))
    if not flags.parts <= set(PARTS):
        parser.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}, got {','.join(flags.parts)}")
    unknown = set(flags.fail_part + flags.crash_part) - set(child_part_names())
    if unknown:
        parser.error(f"--fail-part and --crash-part take one of {', '.join(child_part_names())}; "
                     f"got {', '.join(sorted(unknown))}")
    return flags


def prepare_dry_mode():
    """The Triton interpreter for every child (set before any of them imports triton), and the
    tests folder on the path (for its interpreter shim)."""
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(REPO_ROOT / "tests" / "helpers"))


def bench_time_line(part_seconds, total_s):
    """Seconds per part, the kernel benches summed as `kernels`."""
    seconds = collections.defaultdict(float)
    for name, s in part_seconds.items():
        seconds["kernels" if name.startswith("kernel:") else name] += s
    return "bench time: " + "".join(f"{name} {s:.0f} s, " for name, s in seconds.items()) + f"total {total_s:.0f} s"


def routing_main():
    """--routing: the host routing's times each way (ROUTING_WAYS), on this host's CPU."""
    counts = routing_token_counts(dry=False)
    print(routing_line(routing_host_ms(GPU_SHAPES, counts, pin=False)))
    for way in ROUTING_WAYS[1:]:
        ms = routing_host_ms(GPU_SHAPES, counts, pin=False, way=way)
        print(f"{way} (its collectives left out): " + ", ".join(f"{t:,} tokens {m:.1f} ms" for t, m in ms.items()))


def run_parts(runner, report, flags, deadline, work_dir, caches):
    """The parts in PART_LIMITS_S's order, the step model beside them, then the projection; the
    compile caches packed after the compiled run and again at the end (caches: the folder, the
    archive, what was found there at the start)."""
    model_dir = pathlib.Path(work_dir) / "model"
    model_dir.mkdir()
    plan = report_environment(runner, report, flags, deadline, work_dir)
    training = TrainingParts(runner, report, flags, deadline, plan)
    model = start_step_model(plan["compiled_args"], model_dir, flags.dry) if plan else None

    def model_step_ms():
        found = read_model(model_dir, "model.json")
        return found["stages"][0]["ms"] if found else None

    def pack():
        report.put("caches", cache_line(*caches))
    try:
        if "compiled" in flags.parts:
            training.run_compiled(model_step_ms)
            pack()
        if "tests" in flags.parts:
            run_gpu_tests_part(report, flags.dry, deadline)
        for variant in TRAINING_VARIANTS if "training" in flags.parts else ():
            training.time_variant(variant)
        if "routing" in flags.parts:
            run_routing_part(runner, report, deadline)
        if "kernels" in flags.parts:
            run_kernel_parts(runner, report, flags.dry, deadline)
        if model is not None:
            try:
                model.wait(max(1.0, deadline.left() + REPORT_RESERVE_S / 2))
            except subprocess.TimeoutExpired:
                pass
        report.put("projection", projection_line(training.compiled, read_model(model_dir, "model.json"),
                                                 read_model(model_dir, "speedrun.json")),
                   model=read_model(model_dir, "model.json"), speedrun_model=read_model(model_dir, "speedrun.json"))
    finally:
        if model is not None:
            kill_process_group(model.pid)
        pack()


def main(argv=None):
    start = time.monotonic()
    flags = parse_flags(argv)
    if flags.routing:
        return routing_main()
    deadline = Deadline(flags.budget, scale=DRY_SLACK if flags.dry else 1)
    if flags.dry:
        prepare_dry_mode()
    out = os.environ.get("OUT")
    report = Report(pathlib.Path(out) if out and not flags.dry else None)
    signal.signal(signal.SIGTERM, raise_stopped)
    with tempfile.TemporaryDirectory(prefix="first_contact.") as work_dir:
        # the dry mode writes nothing: its caches and their archive stay in the work folder
        cache_dir = pathlib.Path(work_dir) / "cache" if flags.dry else CACHE_DIR
        archive = (pathlib.Path(work_dir) / CACHE_NAME if flags.dry else
                   pathlib.Path(out) / CACHE_NAME if out else pathlib.Path(flags.cache))
        found = unpack_caches(flags.cache if not flags.dry else archive, cache_dir)
        os.environ.update(cache_environment(cache_dir))    # before the first child: they all inherit it
        runner = PartRunner(work_dir, flags.dry, flags.start_method, injected_failures(flags))
        try:
            run_parts(runner, report, flags, deadline, work_dir, (cache_dir, archive, found))
        except (Stopped, KeyboardInterrupt) as stop:
            report.stopped(str(stop) or type(stop).__name__)
    report.put("bench time", bench_time_line(report.raw["part_seconds"], time.monotonic() - start))
    print(report.markdown(), flush=True)
    if not flags.dry:
        with open(RESULTS_PATH, "a") as f:
            f.write(report.markdown())
        print(f"appended to {RESULTS_PATH}" + (f"; written to {out}/results.md" if out else ""))
    if report.failures:
        print("FAILED: " + ", ".join(report.failures), file=sys.stderr)
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
