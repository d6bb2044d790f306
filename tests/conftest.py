"""What every test shares: the same environment whatever the user's shell has set.

The variables below are removed before the test modules are imported (some libraries read
them at import: huggingface_hub's HF_HUB_OFFLINE), for every test, and so for every process a
test starts; a test that needs one sets it itself (monkeypatch.setenv, or its subprocess's env).
    HF_* / HUGGINGFACE_*: the hub's offline flag, cache folders and token;
    WORLD_SIZE, RANK, LOCAL_RANK, ..., MASTER_ADDR / MASTER_PORT, TORCHELASTIC_*, PET_*: a
        torch.distributed job's (PET_* are torch.distributed.run's defaults for its options);
        left set, a one-process run would take itself for a rank of a job that does not exist;
    OMP_NUM_THREADS: the processes that care set it; under pytest-xdist it is each worker's share
        of the cores (its processes and those they start would otherwise each take every core,
        and OpenMP threads that wait for a core spin);
    TRITON_INTERPRET: tests/helpers/interpreter_shim.py and the tests that want it set it;
    LC_*, LANG, LANGUAGE, PYTHONIOENCODING, PYTHONUTF8: the locale and encodings; subprocesses
        get PYTHONUTF8=1 (UTF-8 for files and pipes, whatever locale they start in).
CUDA_VISIBLE_DEVICES is the user's choice of GPUs and stays: tests that need a GPU skip
without one, and tests that must see none make a CPU-only process for themselves (the
`cpu_only` fixture below; tests/helpers/launch.py's cpu_env for subprocesses).

A pytest command started in a locale whose encoding is not UTF-8 (LC_ALL=C, PYTHONUTF8=0, ...)
starts itself again, once, in the environment above and Python's UTF-8 mode, so that the files
this process opens without an encoding (records/make_record.py's, torch._inductor's templates)
are read and written as UTF-8.
"""
import locale
import os
import sys

import pytest

# the tests' helpers: shared configs and runs, launchers, workers, the interpreter shim, CUDA's rules on a CPU
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))

REMOVED = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
           "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "TRITON_INTERPRET",
           "LANG", "LANGUAGE", "PYTHONIOENCODING", "PYTHONUTF8")
REMOVED_PREFIXES = ("HF_", "HUGGINGFACE_", "TORCHELASTIC_", "PET_", "LC_")
SET = {"PYTHONUTF8": "1"}

RESTARTED = "SPEEDRUN_TESTS_RESTARTED_IN_UTF8"   # set in the environment of the pytest started again

_session = pytest.MonkeyPatch()


def worker_threads():
    """Under pytest-xdist, the threads each worker's processes may use: its share of the cores
    (None in a plain pytest process)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    return max(1, len(os.sched_getaffinity(0)) // int(workers)) if workers else None


def clean(monkeypatch):
    for name in list(os.environ):
        if name in REMOVED or name.startswith(REMOVED_PREFIXES):
            monkeypatch.delenv(name)
    for name, value in SET.items():
        monkeypatch.setenv(name, value)
    if worker_threads():
        monkeypatch.setenv("OMP_NUM_THREADS", str(worker_threads()))


def started_as_pytest_command():
    """Whether this process is `python -m pytest` or the pytest script (not pytest.main() called
    from another program, nor a pytest-xdist worker)."""
    main = sys.argv[0] if sys.argv else ""
    return ((os.path.basename(main) in ("pytest", "py.test") or main.endswith(os.path.join("pytest", "__main__.py")))
            and "PYTEST_XDIST_WORKER" not in os.environ and hasattr(sys, "orig_argv"))


def restart_in_utf8_if_needed():
    """Runs in pytest_configure, when pytest has released stdout and stderr (their capture starts
    with the collection)."""
    encoding = locale.getpreferredencoding(False).lower().replace("-", "")
    if sys.flags.utf8_mode or encoding == "utf8" or RESTARTED in os.environ or not started_as_pytest_command():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-X", "utf8", *sys.orig_argv[1:]], dict(os.environ, **{RESTARTED: "1"}))


# -n auto: one pytest-xdist worker per core this process may use, at most this many (each worker's
# tests start training processes and Triton workers of their own, about 1-2 GiB each).
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


def pytest_configure(config):
    clean(_session)
    if worker_threads():
        import torch
        torch.set_num_threads(worker_threads())
    restart_in_utf8_if_needed()
    _session.delenv(RESTARTED, raising=False)


def pytest_unconfigure(config):
    _session.undo()


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The environment above for each test, also after an earlier test changed os.environ."""
    clean(monkeypatch)


@pytest.fixture
def cpu_only(monkeypatch):
    """This process, and the processes it starts, see no GPU, as on a machine without one."""
    import torch
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A folder of synthetic train and val shards (tests/helpers/tiny_runs.py's data_args reads it)."""
    from tiny_runs import write_tiny_shards
    return write_tiny_shards(tmp_path_factory.mktemp("shards"))
