"""GPU check of the speedrun trainer: the GPU tests, kernel timings against torch at the speedrun
shapes, training-step timings of the 1-GPU preset, one compiled run, and a projection of the
8xH100 training time, written as one markdown section.

    OUT=/tmp/out python bench/bench_gpu.py --commit SHA   # on an H100/H200, from the repository root
    python bench/bench_gpu.py --dry                         # on CPU: tiny shapes, Triton interpreter

In order:
  1. versions and commit (--commit, else `git rev-parse`, else "unknown");
  2. pytest tests/test_kernels.py -k gpu;
  3. kernel lines (the benches of bench/kernel_timings.py): our time and torch's (ms, median of
     triton.testing.do_bench), TFLOP/s where the work is a matmul (for windowed attention only the
     visible query-key pairs count), and the speed ratio torch_ms / our_ms with the target it must reach:
       fp8_matmul >= 0.9 (torch._scaled_mm, fast accumulation, same operands);
       flash_attn_varlen forward+backward >= 1.0 against compiled flex_attention with the same
         document + causal + sliding-window mask (its block mask built once, outside the timing),
         and >= 1.0 against scaled_dot_product_attention's flash backend on equal-length causal
         documents with no window;
       softcap_cross_entropy forward+backward >= 2.0 (plain torch softcap + F.cross_entropy);
     the fp8 layers against bf16 torch, xxt against x @ x.mT, qk_norm_rope and the n-gram table's
     sparse row kernels (grouping + summing per row, the sparse Adam update) against torch ops
     are informational;
  4. training: the 1gpu preset, eager, on synthetic tokens; for each stage, at its first step, one
     untimed step and the median of TIMED_STEPS timed optimizer steps (8 micro-batches each), with
     the Triton kernels (without and with the forward+backward captured as a CUDA graph after the
     untimed step) and with the plain-torch references;
  5. one compiled run of train_gpt.py (CUDA graphs on, as in a real run): a single stage at the
     last stage's shape;
  6. a projection of the 8xH100 training time from 4 and 5 (see `projection`), made from what
     finished: a missing part is named in its line.

Isolation. This process imports neither torch nor triton: every part runs in a process of its
own, so that a sticky CUDA error or a crash costs that part only. The GPU tests and the compiled
run are programs of their own (pytest, train_gpt.py). The versions, each kernel bench, the
training plan (config and synthetic shards) and each training variant run in a child forked from
a server that has torch and triton imported (`--start-method spawn` starts every child from
scratch instead). A child reports through a JSON file that it rewrites as it goes. Every part
gets a deadline: what is left of the budget, and no more than its own limit; a part still running
at its deadline is killed with its process group and reported as timed out with what it had
reported. The one timeout that is no failure is the reference timings': the budget cuts them by
design.

Output. The section is printed at the end and appended to bench/results.md; with $OUT set,
results.md and bench.json there are rewritten after every part, so a run stopped from outside
still leaves what it measured (bench/README.md lists the files). Exit status 1 when a part failed
(the GPU tests, a kernel bench, a training run, the compiled run); a missed speed target is
reported, not a failure; 2 without a CUDA GPU.

For tests only: `--fail-part NAME` makes the child of part NAME raise once its work is done,
`--crash-part NAME` makes it exit then without reporting its result, as a process killed by a
CUDA error does (NAME: a part that runs in a child, see `child_part_names`); what it reported
as it went is kept.

The dry mode runs every part once at tiny shapes, in the same processes, so that this script
cannot rot unnoticed; its numbers mean nothing and it writes no file.
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
import tempfile
import time
import traceback
import warnings

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_PATH = pathlib.Path(__file__).resolve().parent / "results.md"
sys.path.insert(0, str(REPO_ROOT))

from kernel_timings import (BOS, KERNEL_BENCHES, KERNEL_HEADER, ROUTING_WAYS, SYNTHETIC_DOC_LEN,  # noqa: E402
                            Line, Timer, markdown_table, routing_host_ms, routing_line)

# Per-GPU speedrun shapes and the tiny ones of the dry mode. doc_len: the equal documents of the
# SDPA comparison; doc_median / max_doc_len: the uneven documents of the flex_attention one.
# ngram_rows: one rank's share of the full n-gram table (84,602,880 rows over 8 GPUs).
GPU_SHAPES = dict(tokens=49152, width=768, hidden=2816, vocab=50304, candidates=10240, doc_len=3072,
                  doc_median=600, max_doc_len=3072, window=1664, muon=((16, 768, 768), (8, 768, 2816)),
                  ngram_rows=10_575_360)
DRY_SHAPES = dict(tokens=96, width=32, hidden=64, vocab=300, candidates=100, doc_len=48,
                  doc_median=20, max_doc_len=48, window=20, muon=((2, 32, 32), (2, 32, 64)), ngram_rows=1000)

# Training: the 1gpu preset eager, in a child process per variant. The dry mode shrinks the cpu preset to two
# stages of a 2-layer model with sampled softmax, no FP8 layers and Adam only, so that the interpreter
# runs only the attention and a cheap cross-entropy (the kernel part runs the others).
# Its n-gram table is one GPU's share of the speedrun's, resident: the per-GPU work of a speedrun
# step (the preset's whole table, 130 GB in host memory, does not fit the bench machine's RAM).
GPU_TRAIN_CONFIG = ["--preset", "1gpu", f"--ngram_rows={GPU_SHAPES['ngram_rows']}", "--ngram_cache_rows=0"]
DRY_TRAIN_CONFIG = [
    "--preset", "cpu", "--device=cpu", "--num_layers=2", "--model_dim=64", "--num_heads=1", "--head_dim=64",
    "--mlp_hidden=128", "--bigram_rows=1024", "--ngram_rows=0", "--long_window_layers=[1]", "--narrow_qk_layers=[]", "--fp8_mlp=false",
    "--fp8_qkv=false", "--fp8_head=false", "--optimizer=adamw",
    "--batch_ranks=1", "--num_iterations=4", "--val_tokens=128", "--val_tokens_per_rank=128",
    '--stages=[{"end":0.5,"tokens_per_rank":16,"max_doc_len":16,"short_window":1,"long_window":1,"candidates":128},'
    '{"end":1.0,"tokens_per_rank":32,"max_doc_len":32,"short_window":1,"long_window":1,"candidates":128}]',
]
UNTIMED_STEPS = 1         # steps per stage shape before timing (Triton JIT, allocator warm-up)
TIMED_STEPS = 2           # timed steps per stage shape and kernel set; their median is reported
COMPILED_STEPS = 12       # timed steps of the compiled run
GPU_COMPILED_VAL_TOKENS = 65536  # one validation slice: the compiled run's validation is not what it measures
TRAIN_SHARD_TOKENS = dict(gpu=1 << 23, dry=1 << 14)  # the loader cycles through the shard
VAL_SHARD_TOKENS = 1 << 17  # more than the compiled run's validation reads


# Projection: per-GPU share of the 1-GPU step; memory-bound kernels slow down by the bandwidth ratio.
H100_BANDWIDTH_TBS = 3.35  # H100 SXM HBM3
H200_BANDWIDTH_TBS = 4.8   # H200 HBM3e

BUDGET_S = 420            # default time budget of the whole command: each part gets what is left of it
REPORT_RESERVE_S = 15     # kept back from the budget for the last part's report
SETUP_LIMIT_S = 120       # longest the versions or the training plan may take (the first child waits for the server)
GPU_TESTS_LIMIT_S = 180   # longest the GPU tests may take
KERNEL_BENCH_LIMIT_S = 150  # longest one kernel bench may take (the attention one compiles flex_attention twice)
COMPILED_RUN_LIMIT_S = 240  # longest the compiled run may take, compilation included
MIN_PART_S = 1            # a part with less time left than this is not started
DRY_NOTE = ("dry: flex_attention runs uncompiled and forward-only (no CPU backward); SDPA uses its CPU "
            "backend; the compiled run is train_gpt.py with --compile=false")
PARTS = ("tests", "kernels", "training", "compiled")  # what --parts can select

# Child processes: the modules their server imports once (third-party only: each child imports
# the trainer's own modules, so that an error in one is that child's to report), how long a
# killed child may take to go, and how much of its output a failure quotes.
PRELOADED_MODULES = ("numpy", "torch", "torch._dynamo", "triton", "triton.language")
START_METHODS = ("forkserver", "spawn")
KILL_WAIT_S = 30
QUOTED_OUTPUT_LINES = 20
GIT_TIMEOUT_S = 30


class Deadline:
    """Seconds left of a time budget, less a reserve kept back for the report."""

    def __init__(self, budget_s, reserve_s=REPORT_RESERVE_S):
        self.end = time.monotonic() + budget_s
        self.reserve_s = reserve_s

    def left(self, limit_s=float("inf")):
        return max(0.0, min(limit_s, self.end - time.monotonic() - self.reserve_s))


def kernel_block(outcomes, dry):
    """The kernel table of the benches that finished, with a note for those that did not."""
    lines = kernel_lines(outcomes)
    notes = [DRY_NOTE] if dry else []
    untimed = [f"{name} ({outcome.describe()})" for name, outcome in outcomes.items() if not outcome.finished]
    if untimed:
        notes.append("not timed: " + "; ".join(untimed))
    missed = [line.name for line in lines if line.missed()]
    if missed and not dry:
        notes.append("targets missed: " + ", ".join(missed))
    return "\n\n".join([markdown_table(KERNEL_HEADER, [line.cells() for line in lines])] + notes)


def kernel_lines(outcomes):
    return [Line(**fields) for outcome in outcomes.values() for fields in outcome.result.get("lines", [])]


# -----------------------------------------------------------------------------------------------
# Training timings
# -----------------------------------------------------------------------------------------------

# Each: (--kernels, with CUDA graphs); a variant's key names its part, training:KEY. In run order,
# the compiled run between graphs and reference.
TRAINING_VARIANTS = dict(triton=("triton", False), graphs=("triton", True), reference=("reference", False))


def write_synthetic_shard(path, num_tokens, generator):
    """A .bin shard of random tokens with a document start every SYNTHETIC_DOC_LEN."""
    from data.shards import write_shard
    tokens = generator.integers(0, BOS, size=num_tokens, dtype=np.uint16)
    tokens[::SYNTHETIC_DOC_LEN] = BOS
    write_shard(path, tokens)


def write_synthetic_data(data_dir, dry):
    """(train files, val files) of synthetic shards in data_dir."""
    generator = np.random.default_rng(0)
    train, val = os.path.join(data_dir, "train_000000.bin"), os.path.join(data_dir, "val_000000.bin")
    write_synthetic_shard(train, TRAIN_SHARD_TOKENS["dry" if dry else "gpu"], generator)
    write_synthetic_shard(val, VAL_SHARD_TOKENS, generator)
    return [train], [val]


def training_config(dry, kernel_set):
    import train_gpt as tg
    return tg.parse_config((DRY_TRAIN_CONFIG if dry else GPU_TRAIN_CONFIG)
                           + [f"--kernels={kernel_set}", "--compile=false"])


def stage_first_steps(h):
    """The first step of each stage, in stage order."""
    import train_gpt as tg
    return [next(s for s in range(h.num_iterations) if tg.stage_index(h, s) == i) for i in range(len(h.stages))]


def training_plan(h):
    """What the report needs of the training config, as JSON values: each stage's first step,
    tokens per optimizer step and steps in the schedule, the micro-batches per step, the
    schedule's length, and the last stage (the compiled run's shape)."""
    import train_gpt as tg
    steps = collections.Counter(tg.stage_index(h, s) for s in range(h.num_iterations))
    return dict(first_steps=stage_first_steps(h), tokens_per_step=[s.tokens_per_rank * h.batch_ranks for s in h.stages],
                stage_steps=[steps[i] for i in range(len(h.stages))], batch_ranks=h.batch_ranks,
                num_iterations=h.num_iterations, last_stage=dataclasses.asdict(h.stages[-1]) | {"end": 1.0})


def wall_ms(fn, device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def time_stage_steps(h, train_files, device, deadline, graphs=False, progress=lambda medians: None):
    """Median ms of an optimizer step at the first step of each stage, eager, in this process
    (None for stages left untimed when the time budget ran out); `progress` gets the medians so
    far after each stage. With `graphs`, as the trainer's warm-up does: the untimed steps capture
    the optimizers' updates, then the stage's forward+backward is captured, and the timed steps
    replay both (on a CPU: the same path with eager bodies)."""
    import train_gpt as tg
    trainer = tg.Trainer(dataclasses.replace(h, cuda_graphs=graphs), tg.ProcessGroup(0, 1, 0, device),
                         tg.RunLog("unused", active=False))
    loader = tg.TrainLoader(train_files, tg.batch_tokens(h))
    medians = []
    for index, step in enumerate(stage_first_steps(h)):
        medians.append(time_stage(h, trainer, loader, index, step, device, graphs) if deadline.left() else None)
        progress(medians)
    return medians


def time_stage(h, trainer, loader, index, step, device, graphs):
    """Median ms of TIMED_STEPS optimizer steps at `step` of stage `index`, after UNTIMED_STEPS
    untimed ones."""
    stage = h.stages[index]
    trainer.advance_to(step)
    batches = [loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
               for _ in range(UNTIMED_STEPS + TIMED_STEPS)]
    if device.type == "cuda":
        batches = [[s.pinned() for s in slices] for slices in batches]
    trainer.graphs.in_warm_up = graphs
    for slices in batches[:UNTIMED_STEPS]:
        trainer.train_step(step, slices)
    if graphs:
        trainer.capture_graph(step)
    trainer.graphs.in_warm_up = False
    return statistics.median(wall_ms(lambda: trainer.train_step(step, slices), device)
                             for slices in batches[UNTIMED_STEPS:])


TRAINING_HEADER = ["stage", "first step", "tokens/step", "triton ms/step", "with CUDA graphs", "graphs speed-up",
                   "reference ms/step", "triton tokens/s", "reference tokens/s", "reference/triton", "target", ""]


def training_table(plan, triton_ms, graphs_ms, reference_ms):
    def cell(value, fmt):
        return format(value, fmt) if value is not None else "-"

    def tokens_per_s(tokens, ms):
        return tokens / ms * 1e3 if ms else None
    rows = []
    for index, (step, tokens) in enumerate(zip(plan["first_steps"], plan["tokens_per_step"])):
        ours, graphed, theirs = triton_ms[index], graphs_ms[index], reference_ms[index]
        ratio = theirs / ours if ours and theirs else None
        verdict = "-" if ratio is None else ("ok" if ratio > 1 else "MISSED")
        rows.append([str(index), str(step), str(tokens), cell(ours, ".1f"), cell(graphed, ".1f"),
                     cell(ours / graphed if ours and graphed else None, ".2f"), cell(theirs, ".1f"),
                     cell(tokens_per_s(tokens, ours), ",.0f"), cell(tokens_per_s(tokens, theirs), ",.0f"),
                     cell(ratio, ".2f"), "> 1", verdict])
    return markdown_table(TRAINING_HEADER, rows)


# -----------------------------------------------------------------------------------------------
# The compiled run and the projection
# -----------------------------------------------------------------------------------------------

def run_command(command, timeout_s):
    """(exit status, stdout, stderr) of a program run in a process group of its own; status None
    when it was killed, whole group, at the timeout. An interruption (SIGTERM, Ctrl-C) kills the
    group too before it goes on."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                          start_new_session=True) as process:
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
    """train_gpt.py on one stage at the last stage's shape, the head untied from step 0 (as at the
    last stage of a real run, and with no second graph for the untie)."""
    settings = (DRY_TRAIN_CONFIG + ["--compile=false"] if dry else
                GPU_TRAIN_CONFIG + [f"--num_iterations={COMPILED_STEPS}", f"--val_tokens={GPU_COMPILED_VAL_TOKENS}"])
    return [sys.executable, "train_gpt.py", *settings, f"--stages={json.dumps([plan['last_stage']])}",
            "--untie_frac=0.0", "--sync_check=true", f"--train_files={plan['train_files'][0]}",
            f"--val_files={plan['val_files'][0]}", f"--log_dir={log_dir}"]


# Lines of train_gpt.py's output: the graph counts and the final summary.
COMPILE_LINE = re.compile(r"compile: (\d+) graphs in the warm-up, (\d+) in the timed run")
CUDA_GRAPHS_LINE = re.compile(r"cuda graphs: (\d+) training steps and (\d+) optimizer updates captured in the "
                              r"warm-up, (\d+) ran eagerly in the timed run")
FINAL_LINE = re.compile(r"final val_loss:\S+ train_time:(\d+)ms steps:(\d+)")


def compiled_run(plan, dry, timeout_s):
    """Run train_gpt.py compiled; returns a dict of what it reported (ok False on any failure)."""
    with tempfile.TemporaryDirectory() as log_dir:
        command = compiled_run_command(plan, dry, log_dir)
        start = time.perf_counter()
        status, stdout, stderr = run_command(command, timeout_s)
        seconds = time.perf_counter() - start
    compile_match, final_match = COMPILE_LINE.search(stdout), FINAL_LINE.search(stdout)
    result = dict(command=" ".join(command[1:]), exit_status=status, wall_s=seconds, output=stdout + stderr)
    if compile_match:
        result.update(warm_up_graphs=int(compile_match[1]), timed_graphs=int(compile_match[2]))
    cuda_graphs_match = CUDA_GRAPHS_LINE.search(stdout)   # on CUDA only
    if cuda_graphs_match:
        result.update(captured_steps=int(cuda_graphs_match[1]), captured_updates=int(cuda_graphs_match[2]),
                      eager_runs=int(cuda_graphs_match[3]))
    if final_match:
        result["step_ms"] = int(final_match[1]) / int(final_match[2])
    if status is None:
        result["error"] = f"stopped at the time limit after {seconds:.0f} s"
    elif status != 0 or not (final_match and compile_match):
        last = (stderr.strip() or stdout.strip() or "no output").splitlines()[-1]
        result["error"] = f"exit status {status}: {last}"
    result["ok"] = "error" not in result and result.get("timed_graphs") == 0 and not result.get("eager_runs")
    return result


GRAPHS_IN_TIMED_RUN = "graphs built, or steps run without their CUDA graph, in the timed run"


def compiled_run_line(run, eager_last_ms, dry):
    what = ("train_gpt.py --compile=false (dry), tiny config" if dry else
            f"train_gpt.py 1gpu preset compiled, one stage at the last stage's shape, {COMPILED_STEPS} steps")
    if "error" in run:
        return f"compiled run: FAILED ({run['error']}); {what}"
    eager = (f" (eager Triton {eager_last_ms:.1f} ms: compiled/eager {run['step_ms'] / eager_last_ms:.2f})"
             if eager_last_ms else "")
    graphs = f"compile: {run['warm_up_graphs']} graphs in the warm-up, {run['timed_graphs']} in the timed run"
    if "captured_steps" in run:
        graphs += (f"; CUDA graphs: {run['captured_steps']} training steps and {run['captured_updates']} optimizer "
                   f"updates captured, {run['eager_runs']} eager runs in the timed run")
    verdict = "" if run["ok"] else f" (FAILED: {GRAPHS_IN_TIMED_RUN})"
    return (f"compiled run: step_avg {run['step_ms']:.1f} ms{eager}; {graphs}{verdict}; "
            f"{run['wall_s']:.0f} s wall with compilation; {what}")


def projection(plan, triton_ms, compiled_ratio):
    """Projected training time (s) of the whole schedule on plan["batch_ranks"] GPUs: per stage, its
    steps x the longer of its GPU step (its 1-GPU eager Triton step time x the compiled/eager
    ratio / the GPUs) and the split table's host routing of one micro-batch (plan["routing_ms"],
    done a step ahead in the batch prefetcher's thread: hidden when shorter). A stage without a
    step time counts 0."""
    gpus, routing = plan["batch_ranks"], plan.get("routing_ms") or [0.0] * len(plan["stage_steps"])
    return sum(count * max(ms * compiled_ratio / gpus, host) for count, ms, host
               in zip(plan["stage_steps"], triton_ms, routing) if ms is not None) / 1e3


def projection_line(plan, seconds, compiled_ratio, lacks):
    """The projection and its method; `lacks` (what it is made without) closes the line."""
    slowdown = H200_BANDWIDTH_TBS / H100_BANDWIDTH_TBS
    gpus = plan["batch_ranks"]
    ratio = (f"compiled/eager ratio {compiled_ratio:.2f}, measured at the last stage's shape"
             if compiled_ratio is not None else "no compiled/eager ratio: eager times as they are")
    routing = plan.get("routing_ms")
    host = (f"the longer of that and the split n-gram table's host routing of one micro-batch (measured on this "
            f"host: {', '.join(f'{ms:.1f}' for ms in routing)} ms by stage), which the batch prefetcher's thread "
            f"does a step ahead (assumes that thread has a core of its own and holds the GIL only between torch ops)"
            if routing else "no host routing time (not measured)")
    line = (f"projection (an estimate, not a measurement): {gpus}xH100 training time {seconds:.0f} s "
            f"({seconds / 60:.2f} min) for {plan['num_iterations']} steps, up to {seconds * slowdown:.0f} s if every "
            f"kernel were memory-bound. Method: the sum over stages of (its steps in the schedule) x (its 1-GPU "
            f"eager Triton step time) x ({ratio}) / {gpus}, per step {host}. Assumes perfect {gpus}-way scaling "
            f"with no communication time, H100 compute equal to this GPU's, and memory-bound kernels up to "
            f"{slowdown:.2f}x slower on an H100 ({H100_BANDWIDTH_TBS} vs {H200_BANDWIDTH_TBS} TB/s).")
    return line + (f" Incomplete: it lacks {'; '.join(lacks)}." if lacks else "")


def projection_block(plan, triton_ms, triton_why, compiled_ratio, ratio_why):
    """(markdown line, raw numbers) of the projection from what finished, naming what it lacks
    (the whys say what happened to it)."""
    if plan is None:
        lacks = [f"the training plan ({triton_why})"]
    elif all(ms is None for ms in triton_ms):
        lacks = [f"every stage's eager Triton step time ({triton_why})"]
    else:
        return partial_projection(plan, triton_ms, triton_why, compiled_ratio, ratio_why)
    return f"projection: not available: it lacks {lacks[0]}", dict(seconds=None, lacks=lacks)


def partial_projection(plan, triton_ms, triton_why, compiled_ratio, ratio_why):
    untimed = [index for index, ms in enumerate(triton_ms) if ms is None]
    lacks = []
    if untimed:
        steps = sum(plan["stage_steps"][index] for index in untimed)
        lacks.append(f"the eager Triton step time of stages {', '.join(map(str, untimed))} ({triton_why}): "
                     f"{steps} of the {plan['num_iterations']} steps count 0, so the time is a lower bound")
    if compiled_ratio is None:
        lacks.append(f"the compiled/eager ratio ({ratio_why}), so the time is eager")
    seconds = projection(plan, triton_ms, compiled_ratio or 1.0)
    return projection_line(plan, seconds, compiled_ratio, lacks), dict(seconds=seconds, compiled_ratio=compiled_ratio,
                                                                       lacks=lacks)


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
    """Seed torch; in the dry mode, install the interpreter shim (tests/interpreter_shim.py)."""
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
        process = self.context.Process(target=child_main, args=(task,), name=f"bench_gpu {name}")
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
    return (["environment"] + [f"kernel:{key}" for key in KERNEL_BENCHES] + ["training:plan"]
            + [f"training:{key}" for key in TRAINING_VARIANTS])


def part_device(dry):
    import torch
    return torch.device("cpu") if dry else torch.device("cuda", 0)


def report_versions(task, progress):
    """The versions of torch, triton and CUDA, and the GPU's name."""
    import torch
    import triton
    cuda = torch.cuda.is_available()
    gpu = "cpu (dry run)" if task.dry else torch.cuda.get_device_name(0) if cuda else "no CUDA GPU"
    return dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda or "none",
                cuda_available=cuda)


def time_kernel(task, progress):
    """The lines of the kernel bench task.params["bench"] (a key of KERNEL_BENCHES)."""
    bench = KERNEL_BENCHES[task.params["bench"]]
    lines = bench(DRY_SHAPES if task.dry else GPU_SHAPES, part_device(task.dry), Timer(task.dry), task.dry)
    return dict(lines=[dataclasses.asdict(line) for line in lines])


def make_training_plan(task, progress):
    """The training plan (`training_plan`), the synthetic shards, written to task.params["data_dir"],
    and the host routing time of the speedrun's split table at each stage's slice length."""
    h = training_config(task.dry, "triton")
    train_files, val_files = write_synthetic_data(task.params["data_dir"], task.dry)
    counts = sorted({s.tokens_per_rank for s in h.stages})
    routing = routing_host_ms(DRY_SHAPES if task.dry else GPU_SHAPES, counts, pin=not task.dry)
    return training_plan(h) | dict(train_files=train_files, val_files=val_files,
                                   routing_ms=[routing[s.tokens_per_rank] for s in h.stages])


def time_training(task, progress):
    """Step ms per stage of the training variant task.params["variant"] (a key of TRAINING_VARIANTS),
    reported stage by stage."""
    kernel_set, graphs = TRAINING_VARIANTS[task.params["variant"]]
    medians = time_stage_steps(training_config(task.dry, kernel_set), task.params["train_files"],
                               part_device(task.dry), Deadline(task.seconds, reserve_s=0), graphs,
                               lambda medians: progress(ms=medians))
    return dict(ms=medians)


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

def report_environment(runner, report, flags, deadline):
    """The header: date, GPU, versions, commit. Exits (status 2) on a machine without a CUDA GPU."""
    outcome = runner.run("environment", report_versions, deadline.left(SETUP_LIMIT_S))
    versions = dict(gpu="unknown", torch="unknown", triton="unknown", cuda="unknown") | outcome.result
    if not flags.dry and versions.get("cuda_available") is False:
        print("bench_gpu.py needs a CUDA GPU; run it with --dry to check it on CPU", file=sys.stderr)
        sys.exit(2)
    report.record("environment", outcome)
    env = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               python=platform.python_version(), commit=flags.commit or git_commit()) | versions
    report.put("header", f"## {env['date']}, {env['gpu']}\n\npython {env['python']}, torch {env['torch']}, triton "
                         f"{env['triton']}, CUDA {env['cuda']}, commit {env['commit']}", environment=env)


def run_gpu_tests_part(report, dry, deadline):
    seconds = deadline.left(GPU_TESTS_LIMIT_S)
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


def run_kernel_parts(runner, report, dry, deadline):
    """One child per kernel bench; the table is rewritten as each ends."""
    outcomes = {}
    for key in KERNEL_BENCHES:
        name = f"kernel:{key}"
        outcomes[name] = runner.run(name, time_kernel, deadline.left(KERNEL_BENCH_LIMIT_S), bench=key)
        report.record(name, outcomes[name])
        report.put("kernels", kernel_block(outcomes, dry),
                   kernels=[dataclasses.asdict(line) | {"ratio": line.ratio} for line in kernel_lines(outcomes)])


class TrainingParts:
    """The training plan (config and synthetic shards), the timed variants, the compiled run and the
    projection, each reported as it ends."""

    def __init__(self, runner, report, flags, deadline, data_dir):
        self.runner, self.report, self.flags, self.deadline = runner, report, flags, deadline
        self.data_dir = data_dir
        self.plan = None
        self.outcomes = {}            # part name -> Outcome
        self.compiled = None          # what compiled_run returned

    def run(self):
        """Triton eager, then with CUDA graphs, then the compiled run, then the references: the
        slowest, which the projection does not need, so that the time budget cuts them first."""
        self.make_plan()
        selected = self.flags.parts
        for variant in ("triton", "graphs") if "training" in selected else ():
            self.time_variant(variant)
        if "compiled" in selected:
            self.run_compiled()
        if "training" in selected:
            self.time_variant("reference")
        line, numbers = self.projection_block()
        self.report.put("projection", line, projection=numbers)

    def make_plan(self):
        outcome = self.record("training:plan", self.runner.run("training:plan", make_training_plan,
                                                               self.deadline.left(SETUP_LIMIT_S),
                                                               data_dir=str(self.data_dir)))
        self.plan = outcome.result if outcome.finished else None

    def record(self, name, outcome):
        self.outcomes[name] = outcome
        self.report.record(name, outcome)
        return outcome

    def without_plan(self):
        return Outcome({}, not_run=f"it needs the training plan (training:plan: {self.shortfall('training:plan')})")

    def time_variant(self, variant):
        name = f"training:{variant}"
        if self.plan is None:
            self.record(name, self.without_plan())
        else:
            self.record(name, self.runner.run(name, time_training, self.deadline.left(), variant=variant,
                                              train_files=self.plan["train_files"]))
        self.report.put("training", self.training_block(),
                        training=dict(steps=self.plan and self.plan["first_steps"],
                                      **{f"{key}_ms": self.stage_ms(key) for key in TRAINING_VARIANTS}))

    def stage_ms(self, variant):
        """The variant's step ms per stage, None where it has none."""
        stages = len(self.plan["first_steps"]) if self.plan else 0
        outcome = self.outcomes.get(f"training:{variant}")
        ms = list(outcome.result.get("ms", [])) if outcome else []
        return (ms + [None] * stages)[:stages]

    def shortfall(self, name):
        """Why the part left something out: not in --parts, its error or why it did not start, or,
        when it finished, the time budget."""
        outcome = self.outcomes.get(name)
        if outcome is None:
            return "not in --parts"
        return "out of time budget" if outcome.finished else outcome.describe()

    def training_block(self):
        if self.plan is None:
            return f"training: not timed: training:plan: {self.shortfall('training:plan')}"
        triton_ms, graphs_ms, reference_ms = (self.stage_ms(key) for key in TRAINING_VARIANTS)
        untimed = [index for index, times in enumerate(zip(triton_ms, graphs_ms, reference_ms)) if None in times]
        notes = [f"not timed (failed or out of time budget): stages {untimed}"] if untimed else []
        notes += [f"{name}: {outcome.describe()}" for name, outcome in self.outcomes.items()
                  if name.startswith("training:") and not outcome.finished]
        return (f"training, eager (not compiled), micro-batches per step: {self.plan['batch_ranks']}, synthetic "
                f"tokens (median of {TIMED_STEPS} steps after {UNTIMED_STEPS} untimed; with CUDA graphs, the "
                f"forward+backward captured after the untimed steps and replayed):\n\n"
                + "\n\n".join([training_table(self.plan, triton_ms, graphs_ms, reference_ms)] + notes))

    def run_compiled(self):
        seconds = self.deadline.left(COMPILED_RUN_LIMIT_S)
        if self.plan is None or seconds < MIN_PART_S:
            outcome = self.record("compiled", self.without_plan() if self.plan is None else
                                  Outcome({}, not_run="out of time budget"))
            self.report.put("compiled", f"compiled run: {outcome.describe()}")
            return
        run = compiled_run(self.plan, self.flags.dry, seconds)
        error = run.get("error") or ("" if run["ok"] else GRAPHS_IN_TIMED_RUN)
        self.record("compiled", Outcome({k: v for k, v in run.items() if k != "output"}, run["wall_s"], error,
                                        run["output"][-4000:], run["exit_status"] is None))
        self.compiled = run
        self.report.save_log("compiled_run.txt", f"$ {run['command']}\n{run['output']}")
        self.report.put("compiled", compiled_run_line(run, self.stage_ms("triton")[-1], self.flags.dry),
                        compiled_run=self.outcomes["compiled"].result)

    def compiled_ratio(self):
        """The compiled run's step time over the eager Triton one at the last stage (None if either is missing)."""
        eager_last = self.stage_ms("triton")[-1] if self.plan else None
        if self.compiled and self.compiled["ok"] and eager_last:
            return self.compiled["step_ms"] / eager_last
        return None

    def projection_block(self):
        if self.compiled and self.compiled["ok"]:
            ratio_why = "no eager Triton step time of the last stage"
        else:
            ratio_why = f"compiled: {self.shortfall('compiled')}"
        lacking = "training:triton" if self.plan else "training:plan"
        triton_why = f"{lacking}: {self.shortfall(lacking)}"
        return projection_block(self.plan, self.stage_ms("triton"), triton_why, self.compiled_ratio(), ratio_why)


class Stopped(Exception):
    """The run is being stopped from outside (SIGTERM)."""


def raise_stopped(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def injected_failures(flags):
    return {name: "raise" for name in flags.fail_part} | {name: "crash" for name in flags.crash_part}


def parse_flags():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton interpreter; writes nothing")
    parser.add_argument("--commit", default=None, help="commit of the tree (a copy without .git cannot tell)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole command may take")
    parser.add_argument("--start-method", choices=START_METHODS, default="forkserver",
                        help="how the parts' child processes start: forked from a server that has torch imported "
                             "(default), or each from scratch")
    parser.add_argument("--fail-part", action="append", default=[], metavar="NAME",
                        help="for tests: make the child of part NAME raise")
    parser.add_argument("--crash-part", action="append", default=[], metavar="NAME",
                        help="for tests: make the child of part NAME exit at once, reporting nothing")
    parser.add_argument("--routing", action="store_true",
                        help="only time the split n-gram table's host routing on this host (no GPU needed), "
                             "as the projection does, and the fetch that worked it out before")
    flags = parser.parse_args()
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
    sys.path.insert(0, str(REPO_ROOT / "tests"))


def bench_time_line(part_seconds, total_s):
    """Seconds per part, the kernel benches summed as `kernels`."""
    seconds = collections.defaultdict(float)
    for name, s in part_seconds.items():
        seconds["kernels" if name.startswith("kernel:") else name] += s
    return "bench time: " + "".join(f"{name} {s:.0f} s, " for name, s in seconds.items()) + f"total {total_s:.0f} s"


def routing_main():
    """--routing: the host routing's times each way (ROUTING_WAYS), on this host's CPU."""
    counts = sorted({s.tokens_per_rank for s in training_config(False, "triton").stages})
    print(routing_line(routing_host_ms(GPU_SHAPES, counts, pin=False)))
    for way in ROUTING_WAYS[1:]:
        ms = routing_host_ms(GPU_SHAPES, counts, pin=False, way=way)
        print(f"{way} (its collectives left out): " + ", ".join(f"{t:,} tokens {m:.1f} ms" for t, m in ms.items()))


def main():
    start = time.monotonic()
    flags = parse_flags()
    if flags.routing:
        return routing_main()
    deadline = Deadline(flags.budget)
    if flags.dry:
        prepare_dry_mode()
    out = os.environ.get("OUT")
    report = Report(pathlib.Path(out) if out and not flags.dry else None)
    signal.signal(signal.SIGTERM, raise_stopped)
    with tempfile.TemporaryDirectory(prefix="bench_gpu.") as work_dir:
        runner = PartRunner(work_dir, flags.dry, flags.start_method, injected_failures(flags))
        try:
            report_environment(runner, report, flags, deadline)
            if "tests" in flags.parts:
                run_gpu_tests_part(report, flags.dry, deadline)
            if "kernels" in flags.parts:
                run_kernel_parts(runner, report, flags.dry, deadline)
            if flags.parts & {"training", "compiled"}:
                TrainingParts(runner, report, flags, deadline, work_dir).run()
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
