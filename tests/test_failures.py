"""Bad input and bad luck, tried as a user would: each ends with one line saying what to do, an
exit status of 2 (130 / 143 for SIGINT / SIGTERM), no traceback, and the run's log (if one was
opened) ending in a whole line that says why. records/README.md lists these cases with the line
each gets; the records tools' own refusals are tested in tests/test_records.py.
"""
import contextlib
import io
import json
import os
import re
import resource
import signal
import subprocess
import sys

import numpy as np
import pytest

from launch import LineReader, cpu_env, finish
from test_train import REPO, synthetic_documents

sys.path.insert(0, REPO)
import train_gpt as tg  # noqa: E402
from data.shards import write_shard  # noqa: E402
from records.logfile import parse_log  # noqa: E402

# The smallest trainer config that exercises the loop (2 layers, one stage).
TINY = ["--preset", "cpu", "--num_layers=2", "--model_dim=64", "--num_heads=1", "--head_dim=64", "--mlp_hidden=128",
        "--long_window_layers=[1]", "--num_value_embeds=1", "--narrow_qk_layers=[]", "--bigram_rows=1024", "--ngram_rows=0",
        "--num_iterations=3",
        "--val_tokens=1024", "--val_tokens_per_rank=1024",
        '--stages=[{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2}]']
BAD_TOKEN = 60_000                 # an id outside GPT-2's vocabulary
BAD_POSITION = 321                 # where the shards below hold it: inside what validation reads


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("failures")
    stream = synthetic_documents(np.random.default_rng(0), 40_000)
    write_shard(d / "ok_train_000001.bin", stream)
    write_shard(d / "ok_val_000000.bin", stream[:8_000])
    bad = stream.copy()
    bad[BAD_POSITION] = BAD_TOKEN
    write_shard(d / "badtok_train_000001.bin", bad)
    write_shard(d / "badtok_val_000000.bin", bad[:8_000])
    (d / "a_file").write_text("x")
    (d / "list.json").write_text(json.dumps([1, 2]))
    (d / "null.json").write_text("null")
    return d


def files(d, train="ok_train", val="ok_val"):
    return [f"--train_files={d}/{train}_*.bin", f"--val_files={d}/{val}_*.bin", f"--log_dir={d}/logs"]


@pytest.fixture
def run_main(capsys, cpu_only):
    """tg.main(argv) in this process, which sees no GPU (the cases below are those of a CPU-only
    machine): (exit status, stderr lines); signal handlers restored after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)}

    def run(argv):
        with contextlib.redirect_stdout(io.StringIO()):
            code = tg.main(argv)
        return code, capsys.readouterr().err.strip().splitlines()
    yield run
    for s, handler in saved.items():
        signal.signal(s, handler)


# (what, extra argv, a regex the one line must match). The data cases take the module's shards.
BAD_CONFIGS = [
    ("--num_iterations=0", ["--num_iterations=0"], r"--num_iterations=0 is not allowed: expects a whole number of steps >= 1"),
    ("--num_iterations=-3", ["--num_iterations=-3"], r"--num_iterations=-3 is not allowed"),
    ("--val_tokens=-1024", ["--val_tokens=-1024"], r"--val_tokens=-1024 is not allowed: expects a positive"),
    ("--val_tokens=0", ["--val_tokens=0"], r"--val_tokens=0 is not allowed"),
    ("--val_tokens_per_rank=0", ["--val_tokens_per_rank=0"], r"--val_tokens_per_rank=0 is not allowed"),
    ("--val_tokens=1000", ["--val_tokens=1000"], r"val_tokens=1000 must be a multiple of val_tokens_per_rank"),
    ("--log_every=0", ["--log_every=0"], r"--log_every=0 is not allowed: expects a positive number of steps"),
    ("--long_window_layers=5", ["--long_window_layers=5"], r"--long_window_layers=5: expects a JSON list"),
    ("--long_window_layers=[7]", ["--long_window_layers=[7]"], r"expects a list of distinct layer indices in \[0, 2\)"),
    ("--stages=[1,2]", ["--stages=[1,2]"], r"--stages: 1 is not a stage; a stage is a JSON object"),
    ("--stages=not json", ["--stages=not json"], r"--stages expects JSON \(a list\), got 'not json'"),
    ("a last stage ending before 1", ['--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,'
                                      '"short_window":1,"long_window":2}]'], r"the last stage must end at 1\.0"),
    ("--embed_betas=[0.9]", ["--embed_betas=[0.9]"], r"--embed_betas=\[0\.9\] is not allowed: expects two numbers"),
    ("--seed=1e23", ["--seed=1e23"], r"--seed expects a whole number, got '1e23'"),
    ("--matrix_lr=nan", ["--matrix_lr=nan"], r"--matrix_lr=NaN is not allowed: expects a learning rate >= 0"),
    ("--orthogonalize=foo", ["--orthogonalize=foo"], r'--orthogonalize="foo" is not allowed: expects one of'),
    ("--optimizer=sgd", ["--optimizer=sgd"], r'--optimizer="sgd" is not allowed'),
    ("--kernels=triton on a CPU", ["--kernels=triton"], r"--kernels=triton needs a CUDA GPU"),
    ("--device=foo", ["--device=foo"], r'--device="foo" is not allowed: expects one of auto, cuda, cpu'),
    ("--device=cuda without a GPU", ["--device=cuda"], r"--device=cuda but no CUDA GPU is visible"),
    ("--compile=maybe", ["--compile=maybe"], r"--compile expects true or false"),
    ("--head_dim=30", ["--head_dim=30"], r"--head_dim=30 is not allowed: expects a multiple of 4"),
    ("--no_such_key=1", ["--no_such_key=1"], r"unknown config key 'no_such_key'"),
    ("a positional argument", ["oops"], r"expected --key=value, got 'oops'"),
    ("--log_dir= (empty)", ["--log_dir="], r'--log_dir="" is not allowed: expects a non-empty path'),
    ("--log_dir that cannot be created", ["--log_dir=/proc/speedrun-logs"],
     r"--log_dir=/proc/speedrun-logs: cannot create a log there"),
    ("the loss diverging", ["--embed_lr=1e30", "--matrix_lr=1e30", "--log_every=1"],
     r"the train loss became nan at step \d+ .*lower the learning rates"),
]


@pytest.mark.parametrize("what, argv, line", BAD_CONFIGS, ids=[case[0] for case in BAD_CONFIGS])
def test_bad_config_values_end_with_one_line(data, run_main, what, argv, line):
    code, err = run_main(TINY + files(data) + argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and re.search(line, err[0]), err


@pytest.mark.parametrize("argv, line", [
    (["--config", "{d}/list.json"], r"a config must be a JSON object of key: value, got list"),
    (["--config", "{d}/null.json"], r"a config must be a JSON object of key: value, got NoneType"),
    (["--config", "{d}/missing.json"], r"cannot read --config .*missing\.json: No such file or directory"),
    (["--preset", "cpu", "--config", "{d}/list.json"], r"give --preset or --config, not both"),
    (["--preset", "nonsense"], r"unknown preset 'nonsense'"),
])
def test_bad_configs_end_with_one_line(data, run_main, argv, line):
    code, err = run_main([a.format(d=data) for a in argv])
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and re.search(line, err[0]), err


@pytest.mark.parametrize("which", ["train", "val"])
def test_a_token_id_outside_the_vocabulary_is_named_with_its_position(data, run_main, which):
    shards = {"train": "badtok_train", "val": "ok_val"} if which == "train" else {"train": "ok_train",
                                                                                   "val": "badtok_val"}
    code, err = run_main(TINY + files(data, **shards))
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(rf"error: .*badtok_{which}_000000?1?\.bin: token {BAD_POSITION} is {BAD_TOKEN}, outside "
                        r"GPT-2's vocabulary .*", err[0]), err
    if "(log: " in err[0]:
        log = parse_log(err[0].rsplit("(log: ", 1)[1].rstrip(")"))
        assert log.ending == "error" and f"token {BAD_POSITION}" in log.info[-1]


def test_a_log_dir_that_is_a_file(data, run_main):
    code, err = run_main(TINY + files(data) + [f"--log_dir={data}/a_file"])
    assert code == 2 and err == [f"error: --log_dir={data}/a_file: cannot create a log there (File exists); "
                                 f"give a writable folder"]


# ----------------------------------------------------------------------------- in a subprocess


def trainer(argv, **kwargs):
    """train_gpt.py started in a process that sees no GPU."""
    return subprocess.Popen([sys.executable, os.path.join(REPO, "train_gpt.py"), *argv], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), **kwargs)


def log_path_of(stdout):
    return stdout.split("logging to ", 1)[1].split()[0]


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_ends_the_run_with_one_line_and_the_step(data, signal_name, status):
    process = trainer(TINY + files(data) + ["--num_iterations=100000", "--log_every=1"])
    stdout, stderr = LineReader(process.stdout), LineReader(process.stderr)
    try:
        running = stdout.wait_for(lambda line: line.startswith("step:2/"), timeout=120)   # training runs
        assert running, "".join(stderr.lines)[-3000:]
        process.send_signal(getattr(signal, signal_name))
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    stdout, stderr = stdout.text(timeout=30), stderr.text(timeout=30)
    assert process.returncode == status, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(rf"interrupted: {signal_name} at step \d+/100000 \(log: .*\)", err[0]), err
    log = parse_log(log_path_of(stdout))
    assert log.ending == "interrupted" and re.fullmatch(rf"interrupted: {signal_name} at step \d+/100000",
                                                        log.info[-1])


def test_a_full_disk_mid_run_ends_with_one_line_and_a_whole_last_line(data, tmp_path):
    """A file-size limit stands in for a full disk: the first run measures where the log's run
    section starts, the second may write only a few lines past it."""
    done = trainer(TINY + files(data) + [f"--log_dir={tmp_path}/first"])
    stdout, stderr = finish(done, timeout=300)
    assert done.returncode == 0, stderr
    raw = open(log_path_of(stdout), "rb").read()
    run_section = raw.rindex(b"\n=== run === #")
    limit = run_section + 300
    process = trainer(TINY + files(data) + [f"--log_dir={tmp_path}/second"],
                      preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    stdout, stderr = finish(process, timeout=300)
    assert process.returncode == 2, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(r"error: .*: writing the log failed \(File too large\): free some space "
                                          r"\(or raise the file-size limit\); the log ends at its last whole line", err[0])
    cut = open(log_path_of(stdout), "rb").read()
    assert cut.endswith(b"\n") and len(cut) <= limit
    assert parse_log(log_path_of(stdout)).ending == "unfinished"


# ----------------------------------------------------------------------------- data and run.sh


def run_command(argv, **env):
    """argv run in a process that sees no GPU: (exit status, stderr lines)."""
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120, env=cpu_env(**env))
    return done.returncode, done.stderr.strip().splitlines()


def test_download_with_a_damaged_shard_and_no_hub(tmp_path):
    (tmp_path / "fineweb_val_000000.bin").write_bytes(b"not a shard")
    code, err = run_command([sys.executable, "data/cached_fineweb10B.py", "1", "--dir", str(tmp_path)],
                            HF_HUB_OFFLINE="1")
    assert code == 2 and len(err) == 1 and "offline, and the copy there is damaged" in err[0], err


def test_download_into_a_folder_that_cannot_be_created():
    code, err = run_command([sys.executable, "data/cached_fineweb10B.py", "1", "--dir", "/proc/fineweb"],
                            HF_HUB_OFFLINE="1")
    assert code == 1 and err == ["error: /proc/fineweb: No such file or directory; choose a writable --dir"], err


PYTHON_LINES_FOR_THE_SHARD_COUNT = 10_000   # a count per step of a billion steps runs ~1e9


def test_shards_needed_is_computed_not_counted():
    """The shard count of a billion-step run takes a bounded number of Python lines (counted with
    a trace function, which stops the call at the bound), not a number that grows with the steps."""
    h = tg.parse_config(["--preset", "speedrun", "--num_iterations=1000000000"])
    executed = 0

    def count_lines(frame, event, arg):
        nonlocal executed
        if event == "line":
            executed += 1
            if executed > PYTHON_LINES_FOR_THE_SHARD_COUNT:
                raise AssertionError(f"train_shards_needed ran over {PYTHON_LINES_FOR_THE_SHARD_COUNT} lines")
        return count_lines

    previous = sys.gettrace()
    sys.settrace(count_lines)
    try:
        shards = tg.train_shards_needed(h)
    finally:
        sys.settrace(previous)
    assert shards > 1000 and 0 < executed <= PYTHON_LINES_FOR_THE_SHARD_COUNT


@pytest.mark.parametrize("argv, env, line", [     # run.sh on a machine without a GPU (run_command)
    (["--preset=speedrun"], {}, "run.sh: the speedrun preset needs GPUs and FineWeb; this machine has none"),
    (["--preset", "1gpu"], {}, "run.sh: the 1gpu preset needs GPUs and FineWeb; this machine has none"),
    ([], {"PYTHON": "/nonexistent/python"}, "run.sh: /nonexistent/python: no such Python"),
])
def test_run_sh_says_what_is_wrong_in_one_line(argv, env, line):
    code, err = run_command(["./run.sh", *argv], **env)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err


def test_a_machine_that_no_configuration_fits_ends_with_one_line():
    """What run.sh asks (--plan) for 2 GPUs of 24 GiB and 64 GiB of host memory: one line naming
    each configuration it tried and what each needs."""
    code, err = run_command([sys.executable, "train_gpt.py", "--plan", "--gpus=2", "--gpu_gib=24", "--host_gib=64"])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: nothing fits 2 GPU(s) of 24.0 GiB and 64.0 GiB of host memory: "
                             "--preset 1gpu --ngram_cache_rows=0 on 2 processes: --ngram_rows=84602880 needs "), err
    assert "; --preset 1gpu on 1 process: --ngram_rows=84602880 needs " in err[0] and "lower --ngram_rows" in err[0]


def test_run_sh_passes_a_config_without_adding_a_preset(data):
    """./run.sh --config f.json is the config's run: the line comes from train_gpt.py, not a
    complaint about --preset and --config together."""
    code, err = run_command(["./run.sh", "--config", f"{data}/list.json"])
    assert code == 2 and err[-1] == "error: a config must be a JSON object of key: value, got list", err
