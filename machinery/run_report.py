"""What a run reports about itself: the environment its log opens with, the warning when other
work held the CPUs it needed, the train-loss lines written once their values reached the host
(never making the CPU wait for the GPU) and the stop at a non-finite loss, the validation's
progress, how the run executed (graphs compiled and captured, the measured memory beside the
budget) and the load it ran under, and how a stopped run ends."""
import datetime
import math
import json
import os
import platform
import socket
import subprocess
import sys

import torch

from machinery.config import loggable
from machinery.processes import TrainingError, launch_environment, synchronize
from machinery.progress import Progress
from records.logfile import cpu_model, load_average, other_load, track_target

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: its git commit


def environment(world_size, bf16_gemm, load):
    def git_commit():
        try:
            return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True,
                                  text=True, timeout=10).stdout.strip() or "none"
        except (OSError, subprocess.SubprocessError):
            return "none"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
        "cuda": torch.version.cuda or "none", "gpu": ", ".join(gpus) or "none",
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads(),
        "bf16_gemm": bf16_gemm, "world_size": world_size,
        "hostname": socket.gethostname(), "command": " ".join(sys.argv), "git_commit": git_commit(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average": "unknown" if load is None else f"{load:.2f}",
    }


def run_threads(pg):
    """The CPU threads this machine's processes of the run keep busy: torch's threads on a CPU,
    one per process driving a GPU."""
    return launch_environment().local_world_size * (torch.get_num_threads() if pg.device.type == "cpu" else 1)


def busy_warning(load, seconds, threads, load_at_start):
    """The warning line when, by the 1-minute load averages at the start and `seconds` into the
    run, other work held CPUs the run's `threads` need (records.logfile.other_load); else None."""
    cpus = os.cpu_count() or 1
    others = None if load is None else other_load(load, cpus, threads, seconds, load_at_start)
    if others is None:
        return None
    return (f"warning: the machine was busy during the run: a 1-minute load average of {load:.2f} on {cpus} CPUs "
            f"({'unknown' if load_at_start is None else f'{load_at_start:.2f}'} at the start), about {others:.1f} "
            f"runnable tasks of other work beside this run's {threads} thread(s): its times are slower than an idle "
            f"machine's, and a record's runs need an idle machine")


def start_load_note(load, threads):
    """A note when the 1-minute load average at the start counts more work than the CPUs the run
    leaves free: work of the last minute, which may have ended (a previous run's) or go on; the
    run's end tells which (busy_warning). None otherwise."""
    cpus = os.cpu_count() or 1
    if load is None or other_load(load, cpus, threads, 0.0) is None:
        return None
    return (f"note: a 1-minute load average of {load:.2f} on {cpus} CPUs at the start: work of the last minute "
            f"beside this run's {threads} thread(s); if it goes on, the run's end warns that the machine was busy")


class DeferredLossLines:
    """Train-loss lines written once their value has reached the host, so that logging never
    makes the CPU wait for the GPU: at a logged step the loss is copied (non-blocking) to pinned
    memory and an event is recorded; the line is written at a later step once the event has
    passed, or when the loop synchronizes anyway (validation, the end)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.pending = []          # (step, elapsed_ms, host tensor, event or None)

    def add(self, step, elapsed_ms, losses):
        """losses: a small fp32 device tensor (the values of one line)."""
        host = torch.empty(losses.shape, dtype=torch.float32, pin_memory=self.cuda)
        host.copy_(losses, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, elapsed_ms, host, event))

    def ready(self, wait=False):
        """(step, elapsed_ms, values) of the pending lines whose values have arrived, in order."""
        out = []
        while self.pending and (wait or self.pending[0][3] is None or self.pending[0][3].query()):
            step, elapsed_ms, host, event = self.pending.pop(0)
            if event is not None:
                event.synchronize()
            out.append((step, elapsed_ms, host.tolist()))
        return out


def memory_line(budget, device):
    """The run's measured GPU memory beside what its MemoryBudget predicted."""
    total = torch.cuda.get_device_properties(device).total_memory
    return (f"memory: peak allocated {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB, reserved "
            f"{torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB; the budget {budget.summary(total)} "
            f"(its step {budget.step / 2**30:.1f} GiB)")


def peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def stop(log, line, code, show=True):
    """End the run: `line` as the log's last line (if there is a log and room), and on stderr when
    `show`. A line a log cannot hold (a file name with a line break in an error) is escaped as in
    JSON, so that it stays one line."""
    line = line if loggable(line) else json.dumps(line)[1:-1]
    if log is not None:
        log.write_last_line(line)
        if log.writer is not None:
            line += f" (log: {log.path})"
    if show:
        print(line, file=sys.stderr, flush=True)
    return code


def where_the_run_is(log, command):
    """Where a stopped process was, for its line: the log's progress, or the command."""
    return log.progress if log is not None else (f"during --{command}" if command else "before training")


def check_finite(name, loss, step, log):
    """Stop the run, keeping its log, when `name` (train or val loss) is NaN or infinite."""
    if not math.isfinite(loss):
        raise TrainingError(f"the {name} loss became {loss} at step {step} (train loss checked every "
                            f"log_every steps): lower the learning rates or check the data")


def write_loss_lines(log, lines, h, clock, sink):
    """Step lines: the next-token train loss (comparable with val_loss) and the objective; on the
    terminal also the time the rest of the run will take (clock, a progress.RunClock); the same
    numbers to the metrics sink."""
    N = h.num_iterations
    for step, elapsed, (loss, objective) in lines:
        check_finite("train", objective, step - 1, log)
        sink.scalars(step, {"train/loss": loss, "train/objective": objective, "train/time_ms": elapsed})
        line = (f"step:{step}/{N} train_loss:{loss:.4f} objective:{objective:.4f} train_time:{elapsed:.0f}ms "
                f"step_avg:{elapsed / step:.2f}ms")
        log.write(line)
        if log.active:
            print(f"{line} eta:{clock.eta_text(elapsed, step)}", flush=True)


def validation_progress(trainer, step, final, slices):
    """before_slice of a validation of `slices` slices: the final one says each slice in the log
    and on the terminal, an intermediate one on the terminal only (once the device caught up, so
    the seconds are real)."""
    progress = Progress(trainer.log, f"validating at step {step}/{trainer.h.num_iterations}", in_log=final)

    def before_slice(i):
        synchronize(trainer.pg.device)
        progress.say(f"slice {i + 1}/{slices}")
    return before_slice


def write_execution_lines(log, trainer, warm_graphs, timed_graphs, eager_steps):
    """The log's lines on how the run executed, after its timed loop: the graphs torch.compile built
    (a warning when any was built inside the timed run), the sparse tables' timing, the CUDA graphs
    captured and the steps that ran eagerly, the memory budget against the peak."""
    log.write(f"compile: {warm_graphs} graphs in the warm-up, {timed_graphs} in the timed run", echo=True)
    tables_line = trainer.tables.finish()
    if tables_line:
        log.write(tables_line, echo=True)
    if trainer.graphs.capturing:
        log.write(f"cuda graphs: {trainer.graphs.captured()} training steps and "
                  f"{len(trainer.graphs.optimizer_graphs)} optimizer updates captured in the warm-up, "
                  f"{eager_steps} ran eagerly in the timed run", echo=True)
    if timed_graphs:
        log.write(f"warning: torch.compile built {timed_graphs} graph(s) inside the timed run: the warm-up "
                  f"missed a shape or a guard, and the train time includes compilation", echo=True)
    if trainer.budget is not None:
        log.write(memory_line(trainer.budget, trainer.pg.device), echo=True)


def peak_memory_mib(device):
    """The run's peak memory in MiB: the GPU's allocated peak, or on a CPU the process's peak RSS."""
    return (torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss_bytes()) // 2**20


def write_load_lines(log, load_at_start, seconds, threads):
    """The load average at the start and the end of a run of `seconds` (log only), and a warning
    when other work shared the machine (busy_warning)."""
    load_at_end = load_average()
    if load_at_start is not None and load_at_end is not None:
        log.write(f"load average: {load_at_start:.2f} at the start, {load_at_end:.2f} at the end (1 minute; "
                  f"{os.cpu_count()} CPUs, this run's {threads} thread(s))")
    if warning := busy_warning(load_at_end, seconds, threads, load_at_start):
        log.write(warning, echo=True)


def target_line(h, val_loss, log_path, speedrun):
    """The run's last line on the terminal: the target val loss of its track (for a run on no
    track that validates on the `speedrun` config's tokens, that config's track's, for
    comparison), whether this run's val loss is below it, and where the log is."""
    track, note = h.track, ""
    if track == "none" and (h.val_files, h.val_tokens) == (speedrun.val_files, speedrun.val_tokens):
        track, note = speedrun.track, ", for comparison: this run is on no track"
    target = None if track == "none" else track_target(track)
    if target is None:
        return f"target: none (the run is on no track); log: {log_path}"
    reached = "met" if val_loss < target else "not met"
    return (f"target: val_loss below {target:.4f} ({track}{note}): {reached}, {val_loss:.4f} (one run: a record "
            f"takes several, records/{track}/README.md); log: {log_path}")
