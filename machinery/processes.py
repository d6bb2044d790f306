"""The processes of a run: how their launcher describes them (launch_environment), how they meet
(init_processes, start_process), what each of them is (ProcessGroup: its rank and device), how
one reports its error to the others (report_error, failed_peer), and how a signal stops them
(stop_on_signals, interruption_line) with the exit codes a shell reads.
"""
import contextlib
import datetime
import errno
import hashlib
import json
import math
import os
import re
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from machinery.config import ConfigError
from machinery.cpu_runtime import keep_freed_memory_for_reuse
from machinery.errors import UserError
from records.logfile import ERROR_PREFIX, INTERRUPTED_PREFIX


class TrainingError(UserError):
    """The run cannot go on (e.g. a non-finite loss); the log is kept."""


RENDEZVOUS_TIMEOUT_S = 300.0       # how long init_process_group waits for the other processes (RENDEZVOUS_TIMEOUT_S=)
AGENT_STORE_TIMEOUT_S = 5.0        # how long a process waits for torch.distributed.run's store to answer
LAUNCH_HINT = "torch.distributed.run sets it; unset it for a single process"
GLOO_PEER_CLOSED = "Connection closed by peer"  # in gloo's error when a peer's socket closes (its process ended)


@dataclass
class Launch:
    """The processes of this job as their launcher's environment describes them: WORLD_SIZE, RANK,
    LOCAL_WORLD_SIZE and LOCAL_RANK (1, 0, WORLD_SIZE, 0 when unset), where they meet
    (MASTER_ADDR:MASTER_PORT) and for how long rank 0 waits for the others (RENDEZVOUS_TIMEOUT_S,
    seconds). `agent_store` is (host, port) of the store torch.distributed.run keeps for its
    processes (TORCHELASTIC_USE_AGENT_STORE=True), else None; `attempt` its restart count."""
    world_size: int
    rank: int
    local_world_size: int
    local_rank: int
    master: str
    rendezvous_timeout_s: float
    agent_store: tuple
    attempt: str


def _whole_variable(environ, name, default, low, high, what):
    """The whole number in the environment variable `name` (`default` when unset); a ConfigError
    unless it lies in [low, high] (high None: no bound)."""
    text = environ.get(name)
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,18}", text) or int(text) < low or (high is not None and int(text) > high):
        raise ConfigError(f"{name}={json.dumps(text)} is not allowed: expects {what} ({LAUNCH_HINT})")
    return int(text)


def launch_environment(environ=None):
    """The Launch that os.environ (or `environ`) describes; a ConfigError naming the variable
    that does not fit: not a whole number, out of its range (a RANK left from another job), or
    missing (RANK or MASTER_ADDR of a job of several processes)."""
    environ = os.environ if environ is None else environ
    world_size = _whole_variable(environ, "WORLD_SIZE", 1, 1, None, "the number of processes, a whole number >= 1")
    if world_size > 1 and "RANK" not in environ:
        raise ConfigError(f"WORLD_SIZE={world_size} but RANK is not set: give each process its RANK (0 to "
                          f"{world_size - 1}), or launch with python -m torch.distributed.run")
    rank = _whole_variable(environ, "RANK", 0, 0, world_size - 1,
                           f"this process's rank, a whole number in [0, WORLD_SIZE={world_size})")
    local_world_size = _whole_variable(environ, "LOCAL_WORLD_SIZE", world_size, 1, world_size,
                                       f"the processes on this machine, a whole number from 1 to WORLD_SIZE={world_size}")
    local_rank = _whole_variable(environ, "LOCAL_RANK", 0, 0, local_world_size - 1, f"this process's rank on this "
                                 f"machine, a whole number in [0, LOCAL_WORLD_SIZE={local_world_size})")
    text = environ.get("RENDEZVOUS_TIMEOUT_S", str(RENDEZVOUS_TIMEOUT_S))
    try:
        timeout = float(text)
    except ValueError:
        timeout = math.nan
    if not 0 < timeout <= 1e6:
        raise ConfigError(f"RENDEZVOUS_TIMEOUT_S={json.dumps(text)} is not allowed: expects the seconds to wait "
                          f"for the other processes, a number in (0, 1000000]")
    master = ""
    if world_size > 1:
        if not environ.get("MASTER_ADDR"):
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: give every process the host of "
                              f"rank 0 in MASTER_ADDR, or launch with python -m torch.distributed.run")
        port = _whole_variable(environ, "MASTER_PORT", None, 1, 65535, "the port rank 0 listens on, 1 to 65535")
        if port is None:
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_PORT is not set: give every process the port rank "
                              f"0 listens on, or launch with python -m torch.distributed.run")
        master = f"{environ['MASTER_ADDR']}:{port}"
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master
    return Launch(world_size, rank, local_world_size, local_rank, master, timeout,
                  tuple(master.rsplit(":", 1)) if agent else None, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_processes(launch, backend, device_id):
    """dist.init_process_group, which waits in C++ code for the other processes, where Python's
    signal handlers do not run until it returns. Meanwhile a watchdog thread, woken by the
    C-level signal handler through signal.set_wakeup_fd, ends the process (one line on stderr,
    then os._exit) when SIGHUP, SIGINT or SIGTERM arrives, or when the others have not joined within
    launch.rendezvous_timeout_s; the process group's own timeout, for collectives, is torch's
    default. A rendezvous that fails (a port taken) is a ConfigError with torch's first line."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    joined = threading.Event()

    def watch():
        deadline = time.monotonic() + launch.rendezvous_timeout_s
        while True:
            ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            if joined.is_set():
                return
            if not ready:
                line = (f"{ERROR_PREFIX}no peer process joined within {launch.rendezvous_timeout_s:g} s: rank "
                        f"{launch.rank} of WORLD_SIZE={launch.world_size} waited at MASTER_ADDR:MASTER_PORT="
                        f"{launch.master}; start the other processes (or launch with python -m torch.distributed.run), "
                        f"or wait longer with RENDEZVOUS_TIMEOUT_S")
                code, show = EXIT_USER_ERROR, True
                break
            name = signal.Signals(os.read(read_fd, 1)[0]).name
            if name in SIGNAL_EXIT_CODES:
                line = interruption_line(launch, name, "while waiting for the other processes")
                code, show = SIGNAL_EXIT_CODES[name], shows_interruptions(launch)
                break
        if show:
            print(line, file=sys.stderr, flush=True)
        os._exit(code)

    watchdog = threading.Thread(target=watch, name="rendezvous watchdog", daemon=True)
    watchdog.start()
    try:
        dist.init_process_group(backend=backend, device_id=device_id)
    except dist.DistError as e:
        raise ConfigError(f"the processes could not meet at MASTER_ADDR:MASTER_PORT={launch.master}: "
                          f"{str(e).splitlines()[0]}") from None
    finally:
        joined.set()
        os.write(write_fd, b"\0")
        watchdog.join()
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)


def agent_store(launch):
    """A client of the store torch.distributed.run keeps for this job's processes (up before they
    start, and while any runs), or None: outside torch.distributed.run, or when it does not answer
    within AGENT_STORE_TIMEOUT_S."""
    if launch is None or launch.agent_store is None:
        return None
    host, port = launch.agent_store
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=AGENT_STORE_TIMEOUT_S))
    except (RuntimeError, ValueError):
        return None


def _job_key(launch, name):
    return f"train_gpt/attempt_{launch.attempt}/{name}"


def report_error(launch, line):
    """Record in the job's store (agent_store) that this process ends with the error `line`, and
    say whether it is the first of the job's processes to report that line, which alone prints it:
    a bad input fails every process alike, and its line is printed once. Without a store, True."""
    store = agent_store(launch)
    if store is None:
        return True
    try:
        store.compare_set(_job_key(launch, "failed_rank"), "", str(launch.rank))
        digest = hashlib.sha256(line.encode("utf-8", "backslashreplace")).hexdigest()[:16]
        return store.add(_job_key(launch, f"line_{digest}"), 1) == 1
    except RuntimeError:
        return True


def failed_peer(launch):
    """The rank of the first of this job's processes that reported an error (report_error), or
    None (none did, or no store)."""
    store = agent_store(launch)
    key = _job_key(launch, "failed_rank") if store is not None else None
    try:
        return int(store.get(key)) if store is not None and store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


def interruption_line(launch, signal_name, where):
    """The line of a process stopped `where` ("at step 3/100") by `signal_name`, or by a peer's
    end (None: a collective found it gone). A SIGTERM after a peer's error is torch.distributed.run
    ending the job's other processes, and says so."""
    peer = failed_peer(launch) if signal_name != "SIGINT" else None
    if signal_name is not None and peer is None:
        return f"{INTERRUPTED_PREFIX}{signal_name} {where}"
    which = f" (rank {peer}, with the error above)" if peer is not None else ""
    return f"{INTERRUPTED_PREFIX}a peer process exited{which} {where}"


def shows_interruptions(launch):
    """Whether this process prints its interruption line: every process of a job gets the signal
    (or its peer's error is printed already), so rank 0 alone prints it."""
    return launch is None or launch.rank == 0


@dataclass
class ProcessGroup:
    """This process in the run's group of processes: its rank among world_size, its rank on its
    machine and the device it computes on; rank 0 is the master, which writes the log."""
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(h):
    """This process's ProcessGroup: its rank (launch_environment) and device, the processes met."""
    launch = launch_environment()
    world_size, rank, local_rank = launch.world_size, launch.rank, launch.local_rank
    want_cuda = h.device == "cuda" or (h.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA GPU is visible; use --device=cpu or --preset cpu")
    if want_cuda and launch.local_world_size > torch.cuda.device_count():
        raise ConfigError(f"{launch.local_world_size} processes per node but only {torch.cuda.device_count()} GPUs: "
                          f"run with --nproc_per_node={torch.cuda.device_count()}")
    if h.batch_ranks % world_size:
        divisors = [d for d in range(1, h.batch_ranks + 1) if h.batch_ranks % d == 0]
        raise ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by the {world_size} processes: "
                          f"run with one of {divisors} processes")
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        init_processes(launch, "nccl" if want_cuda else "gloo", device if want_cuda else None)
    return ProcessGroup(rank, world_size, local_rank, device)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def syncs_allowed():
    """A stretch that waits for the device by design (a host table's write-back) inside a step
    that --sync_check watches: CUDA's sync debug mode is off in it and restored after."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


class Interrupted(Exception):
    """SIGHUP, SIGINT or SIGTERM arrived: the run stops and its log says where."""

    def __init__(self, signal_name):
        super().__init__(signal_name)
        self.signal_name = signal_name


EXIT_USER_ERROR = 2                # a bad input or environment: one `error:` line says what to do
SIGNAL_EXIT_CODES = {"SIGHUP": 129, "SIGINT": 130, "SIGTERM": 143}  # 128 + the signal number, as shells report them
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write failed for want of room (write_failure)


INTERRUPTING_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)  # a closed terminal, Ctrl-C, kill
STOP_SIGNALS = (*INTERRUPTING_SIGNALS, signal.SIGXFSZ)


def stop_on_signals():
    """SIGHUP (the terminal closed), SIGINT and SIGTERM raise Interrupted in the main thread, once:
    from then on the run is ending (hold_signals). A file-size limit makes a write fail with an
    error (EFBIG) instead of killing the process without a word (SIGXFSZ). Returns the handlers
    it replaced, for restore_signals."""
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}

    def interrupt(signum, frame):
        hold_signals()
        raise Interrupted(signal.Signals(signum).name)
    for s in INTERRUPTING_SIGNALS:
        signal.signal(s, interrupt)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    return previous


def hold_signals():
    """While a run ends (its line, its log, the process group) SIGHUP, SIGINT and SIGTERM no
    longer interrupt it: torch.distributed.run sends SIGTERM to the other processes as soon as
    one exits, and that signal must not cut the ending short."""
    for s in INTERRUPTING_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def restore_signals(previous):
    """Put back the handlers stop_on_signals replaced (main can be called again in one process)."""
    for s, handler in (previous or {}).items():
        signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def peer_exited(launch, error):
    """Whether the RuntimeError `error` of a collective means that a peer process ended: it
    reported an error (failed_peer), or gloo found its socket closed."""
    return dist.is_initialized() and (GLOO_PEER_CLOSED in str(error) or failed_peer(launch) is not None)


def cpu_threads():
    """The threads of one CPU process: OMP_NUM_THREADS when set, else this process's cores shared
    by the processes of its machine (LOCAL_WORLD_SIZE)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    local_procs = launch_environment().local_world_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // local_procs)


def start_process(h):
    """This process's rank and device (see setup_distributed), with the CPU settings of a CPU run."""
    pg = setup_distributed(h)
    if pg.device.type == "cpu":
        keep_freed_memory_for_reuse()
        torch.set_num_threads(cpu_threads())
    return pg
