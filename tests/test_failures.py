"""Bad input and bad luck, tried as a user would: each ends with one line saying what to do, an
exit status of 2 (130 / 143 for SIGINT / SIGTERM), no traceback, and the run's log (if one was
opened) ending in a whole line that says why. docs/errors.md lists these cases with the line
each gets; the records tools' own refusals (records/FORMAT.md) are tested in tests/test_records.py.
"""
import contextlib
import errno
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import resource
import signal
import socket
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from launch import LineReader, cpu_env, finish, run_distributed
from tiny_runs import REPO, synthetic_documents, uses_checkpoint

sys.path.insert(0, REPO)
import records.logfile  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.loader import DataError  # noqa: E402
from data.shards import write_shard  # noqa: E402
from evaluation import evaluate  # noqa: E402
from machinery import command_line, config  # noqa: E402
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
    (d / "not_utf8.json").write_bytes(b'{"track": "x\xff"}')
    (d / "deep.json").write_text('{"stages": ' + "[" * 40 + "]" * 40 + "}")
    (d / "very_deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (d / "large.json").write_text(json.dumps({"track": "x" * config.CONFIG_FILE_MAX_BYTES}))
    os.mkfifo(d / "fifo.json")
    (d / "newline.json").write_text(json.dumps({"train_files": "a\nb"}))
    (d / "nonsense_preset.json").write_text(json.dumps({"preset": "nonsense"}))
    (d / "huge_iterations.json").write_text(json.dumps({"preset": "cpu", "num_iterations": 10**12}))
    (d / "float_iterations.json").write_text(json.dumps({"preset": "cpu", "num_iterations": 1e12}))
    return d


def files(d, train="ok_train", val="ok_val"):
    return [f"--train_files={d}/{train}_*.bin", f"--val_files={d}/{val}_*.bin", f"--log_dir={d}/logs"]


@pytest.fixture
def run_main(capsys, cpu_only):
    """tg.main(argv) (evaluate.main for a checkpoint's argv) in this process, which sees no GPU (the cases below are those of a CPU-only
    machine): (exit status, stderr lines); signal handlers restored after."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)}

    def run(argv):
        with contextlib.redirect_stdout(io.StringIO()):
            code = (evaluate.main if uses_checkpoint(argv) else tg.main)(argv)
        return code, capsys.readouterr().err.strip().splitlines()
    yield run
    for s, handler in saved.items():
        signal.signal(s, handler)


# (what, extra argv, a regex the one line must match). The data cases take the module's shards.
BAD_CONFIGS = [
    ("--num_iterations=0", ["--num_iterations=0"], r"--num_iterations=0 is not allowed: expects a whole number of steps in \[1, 10,000,000\]"),
    ("--num_iterations=-3", ["--num_iterations=-3"], r"--num_iterations=-3 is not allowed"),
    ("--val_tokens=-1024", ["--val_tokens=-1024"], r"--val_tokens=-1024 is not allowed: expects a whole number of tokens in \[1, "),
    ("--val_tokens=0", ["--val_tokens=0"], r"--val_tokens=0 is not allowed"),
    ("--val_tokens_per_rank=0", ["--val_tokens_per_rank=0"], r"--val_tokens_per_rank=0 is not allowed"),
    ("--val_tokens=1000", ["--val_tokens=1000"], r"val_tokens=1000 must be a multiple of val_tokens_per_rank"),
    ("--log_every=0", ["--log_every=0"], r"--log_every=0 is not allowed: expects a whole number of steps in \[1, "),
    ("--long_window_layers=5", ["--long_window_layers=5"], r"--long_window_layers=5: expects a JSON list"),
    ("--long_window_layers=[7]", ["--long_window_layers=[7]"], r"expects a list of distinct layer indices in \[0, 2\)"),
    ("--stages=[1,2]", ["--stages=[1,2]"], r"--stages: 1 is not a stage; a stage is a JSON object"),
    ("--stages=not json", ["--stages=not json"], r"--stages expects JSON \(a list\), got 'not json'"),
    ("a last stage ending before 1", ['--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,'
                                      '"short_window":1,"long_window":2}]'], r"the last stage must end at 1\.0"),
    ("--embed_betas=[0.9]", ["--embed_betas=[0.9]"], r"--embed_betas=\[0\.9\] is not allowed: expects two numbers"),
    ("--embed_betas=[0.9,1.0]", ["--embed_betas=[0.9,1.0]"],
     r"--embed_betas=\[0\.9, 1\.0\] is not allowed: expects two numbers in \[0, 1\)"),
    ("--seed=1e23", ["--seed=1e23"], r"--seed expects a whole number, got '1e23'"),
    ("--matrix_lr=nan", ["--matrix_lr=nan"], r"--matrix_lr=NaN is not allowed: expects a learning rate >= 0"),
    ("--orthogonalize=foo", ["--orthogonalize=foo"], r'--orthogonalize="foo" is not allowed: expects one of'),
    ("--optimizer=sgd", ["--optimizer=sgd"], r'--optimizer="sgd" is not allowed'),
    ("--kernels=triton on a CPU", ["--kernels=triton"], r"--kernels=triton needs a CUDA GPU"),
    ("--device=foo", ["--device=foo"], r'--device="foo" is not allowed: expects one of auto, cuda, cpu'),
    ("--device=cuda without a GPU", ["--device=cuda"], r"--device=cuda but no CUDA GPU is visible"),
    ("--compile=maybe", ["--compile=maybe"], r"--compile expects true or false"),
    ("--head_dim=30", ["--head_dim=30"], r"--head_dim=30 is not allowed: expects a whole number of dims in \[4, 1,024\], a multiple of 4"),
    ("--no_such_key=1", ["--no_such_key=1"], r"unknown config key 'no_such_key': python train_gpt.py --help lists"),
    ("--matrix-lr=0.06 (dashes)", ["--matrix-lr=0.06"], r"unknown config key 'matrix-lr': did you mean --matrix_lr\?"),
    ("--matrx_lr 0.06 (a typo, space form)", ["--matrx_lr", "0.06"],
     r"unknown config key 'matrx_lr': did you mean --matrix_lr\?"),
    ("--matrix_lr without a value", ["--matrix_lr"], r"--matrix_lr needs a value: --matrix_lr=VALUE"),
    ("a positional argument", ["oops"], r"expected --key=value, got 'oops'"),
    ("--log_dir= (empty)", ["--log_dir="], r'--log_dir="" is not allowed: expects a non-empty path'),
    ("--log_dir that cannot be created", ["--log_dir=/proc/speedrun-logs"],
     r"--log_dir=/proc/speedrun-logs: cannot create a log there"),
    ("the loss diverging", ["--embed_lr=1e30", "--matrix_lr=1e30", "--log_every=1"],
     r"the train loss became nan at step \d+ .*lower the learning rates"),
    ("--seed=-1", ["--seed=-1"], r"--seed=-1 is not allowed: expects a whole number in \[0, 9,223,372,036,854,775,807\]"),
    ("--seed=2**63", [f"--seed={2**63}"], r"--seed=9223372036854775808 is not allowed: expects a whole number in"),
    ("--batch_ranks=10**12", ["--batch_ranks=1000000000000"], r"--batch_ranks=1000000000000 is not allowed: .*in \[1, 4,096\]"),
    ("--ngram_rows=2**40", [f"--ngram_rows={2**40}"], r"--ngram_rows=1099511627776 is not allowed: .*in \[0, 2,147,483,648\]"),
    ("a stage of 10**12 tokens", ['--stages=[{"end":1.0,"tokens_per_rank":1000000000000,"max_doc_len":256,'
                                  '"short_window":1,"long_window":2}]'],
     r"stage 0 has tokens_per_rank=1000000000000: expects a positive whole number, at most 16,777,216"),
    ("a stage with candidates=1", ['--stages=[{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,'
                                   '"long_window":2,"candidates":1}]'],
     r"stage 0 has candidates=1: expects 0 \(full vocabulary\) or 2 to 50304: .*a softmax over the target alone is 1"),
    ("--stages nested 40 deep", ["--stages=" + "[" * 40 + "]" * 40], r"--stages: lists and objects nest deeper than 32"),
    ("--stages nested 100000 deep", ["--stages=" + "[" * 100_000 + "]" * 100_000],
     r"--stages: lists and objects nest deeper than 32"),
    ("--log_dir with a byte that is not UTF-8", [f"--log_dir=/tmp/speedrun-{os.getpid()}-\udcff"],
     r'--log_dir="/tmp/speedrun-\d+-\\udcff" is not allowed: expects UTF-8 text without line breaks'),
    ("--log_dir with a line break", [f"--log_dir=/tmp/speedrun-{os.getpid()}\nlogs"],
     r'--log_dir="/tmp/speedrun-\d+\\nlogs" is not allowed: expects UTF-8 text without line breaks'),
    ("a JSON value with a line break", ['--stages=[\n{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,'
                                        '"short_window":1,"long_window":2}]'],
     r'the argument "--stages=\[\\n.*" cannot be written into the log .*: expects UTF-8 text without line breaks'),
    ("--cooldown_start=1.0", ["--cooldown_start=1.0"],
     r"--cooldown_start=1\.0 and --cooldown_end=1\.0 do not fit together: the cooldown must end after it starts"),
    ("a cooldown that ends where it starts", ["--cooldown_start=0.5", "--cooldown_end=0.5"],
     r"--cooldown_start=0\.5 and --cooldown_end=0\.5 do not fit together"),
    ("--anvil_fast_beta=1", ["--anvil_fast_beta=1"], r"--anvil_fast_beta=1\.0 is not allowed: expects a beta in \[0, 1\)"),
    ("--ngram_beta2=1.0", ["--ngram_beta2=1.0"], r"--ngram_beta2=1\.0 is not allowed: expects a beta in \[0, 1\)"),
    ("a table phase's beta of 1", ['--table_phases=[{"start":1,"ngram_beta2":1.0,"value_embed_beta2":0.9,'
                                   '"step_every":1}]'],
     r"--table_phases: phase 0 has ngram_beta2=1\.0: expects a beta in \[0, 1\)"),
    ("one multi-token weight too many", ['--stages=[{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,'
                                         '"short_window":1,"long_window":2,"mtp_weights":[1,0.5,0.25,0.1]}]'],
     r"stage 0 has mtp_weights=\[1, 0\.5, 0\.25, 0\.1\]: expects 1 to 3 weights >= 0"),
    ("--log_dir inside records/", [f"--log_dir={REPO}/records/speedrun-logs"],
     r"--log_dir=.*/records/speedrun-logs is inside the repository's records/ folder, which only "
     r"records/make_record.py writes"),
]


@pytest.mark.parametrize("what, argv, line", BAD_CONFIGS, ids=[case[0] for case in BAD_CONFIGS])
def test_bad_config_values_end_with_one_line(data, run_main, what, argv, line):
    code, err = run_main(TINY + files(data) + argv)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and re.search(line, err[0]), err
    log_dirs = [a.split("=", 1)[1] for a in argv if a.startswith("--log_dir=")]
    assert not any(os.path.lexists(d) for d in log_dirs if d), "a refused --log_dir is never created"


@pytest.mark.parametrize("argv, line", [
    (["--config", "{d}/list.json"], r"a config must be a JSON object of key: value, got list"),
    (["--config", "{d}/null.json"], r"a config must be a JSON object of key: value, got NoneType"),
    (["--config", "{d}/missing.json"], r"cannot read --config .*missing\.json: No such file or directory"),
    (["--preset", "cpu", "--config", "{d}/list.json"], r"give --preset or --config, not both"),
    (["--preset", "nonsense"], r"unknown preset 'nonsense'"),
    (["--config", "{d}/not_utf8.json"], r"--config .*not_utf8\.json is not UTF-8 text \(byte 0xff at offset 12\): "
                                        r"save it as UTF-8"),
    (["--config", "{d}/deep.json"], r"--config .*deep\.json: lists and objects nest deeper than 32 levels"),
    (["--config", "{d}/very_deep.json"], r"--config .*very_deep\.json: lists and objects nest deeper than 32 levels"),
    (["--config", "{d}/large.json"], r"--config .*large\.json is larger than 1 MiB"),
    (["--config", "{d}/fifo.json"], r"--config .*fifo\.json is not a regular file"),
    (["--config", "{d}/newline.json"], r'--train_files="a\\nb" is not allowed: expects UTF-8 text without line breaks'),
    (["--config", "{d}/nonsense_preset.json"], r"unknown preset 'nonsense'"),
    (["--config", "{d}/huge_iterations.json"], r"--num_iterations=1000000000000 is not allowed: .*in \[1, 10,000,000\]"),
    (["--config", "{d}/float_iterations.json"], r"--num_iterations=1000000000000.0 is not allowed"),
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


@pytest.mark.parametrize("extra, what", [
    ([], "the run computes on the CPU"),
    (["--head_dim=8", "--num_heads=8"], "the run computes on the CPU; its weights alone"),
], ids=["priced", "a step the budget cannot price"])
def test_a_model_too_big_for_a_cpus_memory_is_refused_before_it_is_built(data, run_main, monkeypatch, tmp_path,
                                                                         extra, what):
    """The memory check that CUDA runs get, on a CPU: with 1 GiB available the tiny run (which the
    budget prices at over 3 GiB with its margin) ends with one line, before the model is built;
    its log ends in the same line. A head dim the dry run's GPU kernels refuse (the CPU's references
    run it) leaves the step unpriced, but the weights are still counted."""
    from machinery import memory_budget
    monkeypatch.setattr(memory_budget, "available_memory_bytes", lambda device: 2**30)
    monkeypatch.setattr(tg, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    code, err = run_main(TINY + extra + files(data) + [f"--log_dir={tmp_path}/logs"])
    assert code == 2 and len(err) == 1, err
    line = (rf"error: the run needs \d+\.\d GiB of memory \({re.escape(what)}\), 1\.0 GiB are there; its "
            r"largest items \(GiB\): .*: lower one of those")
    assert re.fullmatch(line + r" \(log: .*\)", err[0]), err
    log = parse_log(err[0].rsplit("(log: ", 1)[1].rstrip(")"))
    assert log.ending == "error" and re.fullmatch(line, log.info[-1])


@pytest.mark.parametrize("value", ["1e308", "inf", "nan", "0", "-1", "2e6"])
@pytest.mark.parametrize("key", ["gpu_gib", "host_gib"])
def test_a_plan_for_memory_no_machine_has_is_one_line(run_main, key, value):
    """--plan's memory sizes are whole GiB counts up to a PiB: 1e308 GiB would overflow the bytes."""
    code, err = run_main(["--plan", "--gpus=1", "--gpu_gib=24", f"--{key}={value}"])
    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(rf"error: --{key}=\S+ is not allowed: expects a positive number of GiB, at most 1,048,576 "
                        r"\(a PiB\)", err[0]), err


def test_every_error_a_user_can_mend_ends_a_run_with_its_one_line(data, run_main, monkeypatch, tmp_path):
    """Each module's user error derives from errors.UserError, and main ends a run on any of them
    (one planted here, which no module knows, too) with its message as the one line and the
    user-error exit status."""
    from data import shards, tokenizer
    from evaluation import downstream
    from machinery import checkpoint, errors, processes
    mendable = [config.ConfigError, DataError, shards.ShardError, tokenizer.TokenizerError, processes.TrainingError,
                tg.optim.OptimConfigError, checkpoint.CheckpointError, records.logfile.LogFolderError,
                records.logfile.LogError, downstream.DownstreamError]
    assert all(issubclass(error, errors.UserError) for error in mendable)

    class PlantedError(errors.UserError):
        pass
    for i, error in enumerate([*mendable, PlantedError]):
        def fail(*args, error=error, **kwargs):
            raise error(f"mend {error.__name__}")
        monkeypatch.setattr(tg, "train", fail)
        code, err = run_main(TINY + files(data) + [f"--log_dir={tmp_path}/logs{i}"])
        assert code == 2 and err == [f"error: mend {error.__name__}"], err


@pytest.mark.parametrize("rows, processes", [(2050, 3), (2054, 4)])
def test_an_ngram_table_that_does_not_split_across_the_processes_is_refused(rows, processes):
    """Any remainder, 1 (2050 over 3) too: each process would hold a different share of the table."""
    h = tg.parse_config(TINY + [f"--ngram_rows={rows}"])
    with pytest.raises(config.ConfigError, match=rf"--ngram_rows={rows} does not split evenly across {processes} "
                                                 rf"processes: use a multiple of {processes}$"):
        tg.check_ngram_table(h, tg.ProcessGroup(0, processes, 0, torch.device("cpu")))


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


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143), ("SIGHUP", 129)])
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


@pytest.mark.parametrize("first", ["error", "SIGTERM"])
def test_a_signal_while_the_run_ends_does_not_cut_its_ending_short(monkeypatch, capsys, first):
    """torch.distributed.run sends SIGTERM to every other process as soon as one exits: one that
    arrives while a run writes its ending (here, while it reports its error or its interruption)
    leaves that ending whole: its one line, its exit code, and the handlers main found."""
    def send_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)                            # the handler runs here, in the ending

    def report_error(launch, line):
        send_sigterm()
        return True

    def interruption_line(launch, signal_name, where):
        send_sigterm()
        return f"interrupted: {signal_name} {where}"

    def run(argv):
        if first == "error":
            raise DataError("its own shard is short: rebuild it")
        send_sigterm()
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(command_line, "report_error", report_error)
    monkeypatch.setattr(command_line, "interruption_line", interruption_line)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ)}
    code = tg.main([], command="train", run=run)
    err = capsys.readouterr().err.strip().splitlines()
    if first == "error":
        assert code == 2 and err == ["error: its own shard is short: rebuild it"], err
    else:
        assert code == 143 and len(err) == 1 and err[0].startswith("interrupted: SIGTERM"), err
    assert {s: signal.getsignal(s) for s in before} == before


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
    assert len(err) == 1 and re.fullmatch(r"error: the file-size limit was reached while writing .*\.txt: raise it "
                                          r"\(ulimit -f\) or choose another --log_dir", err[0]), err
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


PYTHON_LINES_FOR_THE_SHARD_COUNT = 10_000   # a count per step of the longest run allowed runs ~1e7


def test_shards_needed_is_computed_not_counted():
    """The shard count of the longest run allowed takes a bounded number of Python lines (counted
    with a trace function, which stops the call at the bound), not a number that grows with the steps."""
    h = tg.parse_config(["--preset", "speedrun", f"--num_iterations={config.MAX_STEPS}"])
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
    (["--preset=speedrun"], {}, "run.sh: the speedrun preset needs GPUs and FineWeb; this machine has none: run "
                                "./run.sh without --preset (the cpu preset), or with one of: cpu, cpu_optimization"),
    (["--preset", "1gpu"], {}, "run.sh: the 1gpu preset needs GPUs and FineWeb; this machine has none"),
    (["--preset", "cpu_optimisation"], {}, "run.sh: unknown preset 'cpu_optimisation': the presets are "
                                           + ", ".join(tg.PRESETS)),
    ([], {"PYTHON": "/nonexistent/python"}, "run.sh: /nonexistent/python: no such Python"),
])
def test_run_sh_says_what_is_wrong_in_one_line(argv, env, line):
    code, err = run_command(["./run.sh", *argv], **env)
    assert code == 2 and len(err) == 1 and err[0].startswith(line), err


def test_a_machine_that_no_configuration_fits_ends_with_one_line():
    """What run.sh asks (--plan) for 2 GPUs of 8 GiB and 64 GiB of host memory: one line naming
    the least configuration it tried and what that needs."""
    code, err = run_command([sys.executable, "train_gpt.py", "--plan", "--gpus=2", "--gpu_gib=8", "--host_gib=64"])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("error: nothing fits 2 GPUs of 8.0 GiB, 64.0 GiB of host memory; the least configuration "
                             "tried: --preset 1gpu --ngram_cache_rows=0 --ngram_rows=377280 "), err
    assert "GiB of memory on each GPU, 8.0 GiB are there; its largest items (GiB): " in err[0]


def test_run_sh_passes_a_config_without_adding_a_preset(data):
    """./run.sh --config f.json is the config's run: the line comes from train_gpt.py, not a
    complaint about --preset and --config together."""
    code, err = run_command(["./run.sh", "--config", f"{data}/list.json"])
    assert code == 2 and err[-1] == "error: a config must be a JSON object of key: value, got list", err


def test_run_sh_runs_every_preset_that_trains_on_a_cpu(data):
    """cpu_optimization trains on the tiny corpus: run.sh hands it to the trainer (whose line about
    --num_iterations=0 shows it got there) instead of asking for GPUs."""
    code, err = run_command(["./run.sh", "--preset", "cpu_optimization", "--num_iterations=0"])
    assert code == 2 and err[-1].startswith("error: --num_iterations=0 is not allowed"), err


def test_run_sh_reads_relative_paths_from_where_the_user_stands(data, tmp_path):
    """A relative --config and --log_dir name files in the folder run.sh was started from, not in
    the repository it runs from."""
    (tmp_path / "mine.json").write_text(json.dumps([1]))
    done = subprocess.run([os.path.join(REPO, "run.sh"), "--config", "mine.json"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=cpu_env())
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "error: a config must be a JSON object of key: value, got list"), done.stderr
    done = subprocess.run([os.path.join(REPO, "run.sh"), *TINY[2:], *files(data)[:2], "--num_iterations=1",
                           "--log_dir=my logs"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env=cpu_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    (log,) = (tmp_path / "my logs").glob("*.txt")
    assert parse_log(log).finished and not (pathlib.Path(REPO) / "my logs").exists()


# ----------------------------------------------------------------------------- a config file's preset


def test_a_config_file_with_a_preset_starts_from_that_preset(tmp_path):
    """{"preset": "cpu", ...} is the cpu preset with the file's other keys on top; a file without
    a preset key starts from the defaults."""
    (tmp_path / "cpu.json").write_text(json.dumps({"preset": "cpu", "num_iterations": 7}))
    (tmp_path / "plain.json").write_text(json.dumps({"num_iterations": 7}))
    assert tg.parse_config(["--config", str(tmp_path / "cpu.json")]) == tg.parse_config(["--preset", "cpu",
                                                                                         "--num_iterations=7"])
    plain = tg.parse_config(["--config", str(tmp_path / "plain.json")])
    assert plain == config.normalize_config(tg.Hyperparameters(num_iterations=7))


# ----------------------------------------------------------------------------- the launch environment

BAD_LAUNCHES = [
    ({"WORLD_SIZE": "abc"}, r'WORLD_SIZE="abc" is not allowed: expects the number of processes, a whole number >= 1'),
    ({"WORLD_SIZE": "0"}, r'WORLD_SIZE="0" is not allowed: expects the number of processes'),
    ({"LOCAL_WORLD_SIZE": "0"}, r'LOCAL_WORLD_SIZE="0" is not allowed: expects the processes on this machine'),
    ({"WORLD_SIZE": "2"}, r"WORLD_SIZE=2 but RANK is not set: give each process its RANK \(0 to 1\)"),
    ({"RANK": "3", "WORLD_SIZE": "1"}, r'RANK="3" is not allowed: expects this process\'s rank, a whole number in '
                                       r'\[0, WORLD_SIZE=1\) \(torch.distributed.run sets it; unset it'),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "2"},
     r'LOCAL_RANK="2" is not allowed: .*\[0, LOCAL_WORLD_SIZE=2\)'),
    ({"WORLD_SIZE": "2", "RANK": "0"}, r"WORLD_SIZE=2 but MASTER_ADDR is not set"),
    ({"RENDEZVOUS_TIMEOUT_S": "soon"}, r'RENDEZVOUS_TIMEOUT_S="soon" is not allowed'),
    ({"RENDEZVOUS_TIMEOUT_S": "0"}, r'RENDEZVOUS_TIMEOUT_S="0" is not allowed: expects the seconds to wait'),
]


@pytest.mark.parametrize("env, line", BAD_LAUNCHES, ids=[" ".join(f"{k}={v}" for k, v in e.items()) for e, _ in BAD_LAUNCHES])
def test_a_bad_launch_environment_is_refused_before_anything(data, run_main, monkeypatch, tmp_path, env, line):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for argv in (TINY + files(data) + [f"--log_dir={tmp_path}/logs"], [f"--eval={tmp_path}/missing.safetensors"]):
        code, err = run_main(argv)
        assert code == 2 and len(err) == 1 and re.fullmatch(f"error: {line}.*", err[0]), err
    assert not (tmp_path / "logs").exists()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    """Whether a socket of this machine listens on TCP `port` (/proc/net/tcp, tcp6)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":
                    return True
    return False


def lone_rank(data, tmp_path, **env):
    """train_gpt.py as rank 0 of 2 processes whose peer never starts."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "train_gpt.py"), *TINY, *files(data), "--batch_ranks=2",
         f"--log_dir={tmp_path}/logs"], cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=cpu_env(OMP_NUM_THREADS="1", WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    **env))
    return process, port


def test_a_rank_whose_peers_never_come_gives_up_with_one_line(data, tmp_path):
    process, port = lone_rank(data, tmp_path, RENDEZVOUS_TIMEOUT_S="3")
    _, stderr = finish(process, timeout=60)
    err = stderr.strip().splitlines()
    assert process.returncode == 2 and len(err) == 1, stderr
    assert re.fullmatch(rf"error: no peer process joined within 3 s: rank 0 of WORLD_SIZE=2 waited at "
                        rf"MASTER_ADDR:MASTER_PORT=127\.0\.0\.1:{port}; start the other processes .*RENDEZVOUS_TIMEOUT_S",
                        err[0]), err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_while_waiting_for_peers_ends_the_process_at_once(data, tmp_path, signal_name, status):
    process, port = lone_rank(data, tmp_path)       # the default wait, minutes
    try:
        deadline = time.monotonic() + 60
        while not listening(port) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert listening(port), "rank 0 never waited for its peer"
        process.send_signal(getattr(signal, signal_name))
        sent = time.monotonic()
        _, stderr = finish(process, timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == status and time.monotonic() - sent < 10, stderr
    assert stderr.strip().splitlines() == [f"interrupted: {signal_name} while waiting for the other processes"]


# ----------------------------------------------------------------------------- under torch.distributed.run

TWO_RANKS = ["--batch_ranks=2", "--val_tokens=2048", "--num_iterations=100", "--log_every=1"]


def own_lines(stderr):
    """The lines train_gpt.py's processes printed (torch.distributed.run adds its own report,
    with a traceback of its ChildFailedError, which a child process cannot leave out)."""
    return [line for line in stderr.splitlines() if line.startswith(("error:", "interrupted:"))]


def test_under_torchrun_a_bad_input_is_one_line(data, tmp_path):
    done = run_distributed(2, [os.path.join(REPO, "train_gpt.py"), *TINY, *files(data), *TWO_RANKS,
                               f"--log_dir={tmp_path}/logs", "--num_iterations=0"],
                           env=cpu_env(OMP_NUM_THREADS="1"), timeout=60)
    assert done.returncode != 0 and 'train_gpt.py", line' not in done.stderr, done.stderr
    assert own_lines(done.stderr) == ["error: --num_iterations=0 is not allowed: expects a whole number of steps in "
                                      "[1, 10,000,000]"], done.stderr


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_under_torchrun_the_failing_rank_says_why_and_its_peer_that_it_exited(data, tmp_path, failing_rank):
    done = run_distributed(2, [os.path.join(REPO, "tests", "helpers", "peer_failure_worker.py"), str(failing_rank), "2", *TINY,
                               *files(data), *TWO_RANKS, f"--log_dir={tmp_path}/logs"],
                           env=cpu_env(OMP_NUM_THREADS="1"), timeout=60)
    lines = own_lines(done.stderr)
    errors = [line for line in lines if line.startswith("error:")]
    assert done.returncode != 0 and 'worker.py", line' not in done.stderr, done.stderr
    assert len(errors) == 1 and errors[0].startswith(f"error: rank {failing_rank}: its own shard holds"), lines
    assert not any("SIGTERM" in line for line in lines), lines
    if failing_rank == 0:
        assert lines == errors
    else:                          # rank 0, which holds the log, says why it stopped
        (peer,) = set(lines) - set(errors)
        assert re.fullmatch(r"interrupted: a peer process exited \(rank 1, with the error above\) at step \d+/100 "
                            r"\(log: .*\)", peer), lines
        assert parse_log(peer.rsplit("(log: ", 1)[1].rstrip(")")).ending == "interrupted"


# ----------------------------------------------------------------------------- what the data paths name


@pytest.fixture
def odd_files(tmp_path):
    """train_files matches that are not shard files."""
    (tmp_path / "folder_train_000001.bin").mkdir()
    os.symlink("loop_train_000001.bin", tmp_path / "loop_train_000001.bin")
    os.symlink(tmp_path / "missing", tmp_path / "dangling_train_000001.bin")
    os.mkfifo(tmp_path / "fifo_train_000001.bin")
    return tmp_path


@pytest.mark.parametrize("name, line", [
    ("folder", r"is a folder, not a shard file: give a pattern that matches only shard files"),
    ("loop", r"is a symbolic link in a loop \(it leads back to itself\), not a shard file: fix or remove the link"),
    ("dangling", r"is a symbolic link to a missing file, not a shard file: fix or remove the link"),
])
def test_a_match_that_is_not_a_shard_file_says_what_it_is(data, run_main, odd_files, name, line):
    code, err = run_main(TINY + files(data) + [f"--train_files={odd_files}/{name}_train_*.bin"])
    assert code == 2 and err == [f"error: {odd_files}/{name}_train_000001.bin: " + err[0].split(".bin: ", 1)[1]], err
    assert re.search(line, err[0]), err


def test_a_match_that_is_a_fifo_says_so_without_waiting_on_it(data, odd_files):
    done = subprocess.run([sys.executable, os.path.join(REPO, "train_gpt.py"), *TINY, *files(data),
                           f"--train_files={odd_files}/fifo_train_*.bin"], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env=cpu_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {odd_files}/fifo_train_000001.bin: is a FIFO (named pipe), not a shard file: give a pattern that "
        f"matches only shard files (e.g. ending in .bin)"], done.stderr


def test_a_data_folder_that_cannot_be_read_says_so(data, run_main, tmp_path, monkeypatch):
    secret = tmp_path / "secret"
    secret.mkdir()
    write_shard(secret / "ok_train_000001.bin", np.ones(2048, dtype=np.uint16))
    secret.chmod(0)
    if os.geteuid() == 0:          # root reads any folder: the kernel's refusal to another user, made here
        for name in ("scandir", "listdir"):
            def refuse(path=".", real=getattr(os, name)):
                if os.fspath(path).startswith(str(secret)):
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
                return real(path)
            monkeypatch.setattr(os, name, refuse)
    try:
        code, err = run_main(TINY + files(data) + [f"--train_files={secret}/ok_train_*.bin"])
    finally:
        secret.chmod(0o755)
    assert code == 2 and err == [f"error: {secret}/ok_train_*.bin: the folder {secret} cannot be read (Permission "
                                 f"denied): give this user access to it, or choose another folder"], err


def test_a_truncated_shard_is_called_truncated_or_corrupt(data, run_main, tmp_path):
    (tmp_path / "cut_val_000000.bin").write_bytes((data / "ok_val_000000.bin").read_bytes()[:-10])
    code, err = run_main(TINY + files(data) + [f"--val_files={tmp_path}/cut_val_*.bin"])
    assert code == 2 and len(err) == 1 and err[0].endswith(
        "; the file is truncated or corrupt: delete it and fetch/build it again"), err


# ----------------------------------------------------------------------------- a full disk


def test_a_full_disk_ends_with_one_line_saying_so(data, run_main, monkeypatch, tmp_path):
    class FullDisk(records.logfile.LogWriter):
        """A log whose writes after its first line go to /dev/full, where every write fails with ENOSPC."""

        def __init__(self, path, run_id):
            super().__init__(path, run_id)
            self.file.close()
            self.file = open("/dev/full", "wb", buffering=0)

    monkeypatch.setattr(records.logfile, "LogWriter", FullDisk)
    code, err = run_main(TINY + files(data) + [f"--log_dir={tmp_path}/logs"])
    assert code == 2 and len(err) == 1 and re.fullmatch(
        rf"error: the disk is full while writing {re.escape(str(tmp_path))}/logs/[0-9a-f-]+\.txt: free space or "
        rf"choose another --log_dir", err[0]), err


# ----------------------------------------------------------------------------- checkpoints


def with_header(path, out, change):
    """A copy of the safetensors file `path` at `out`, its JSON header changed by change(header)."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    open(out, "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    return out


def _first_matrix(header):
    return next(name for name, entry in header.items() if name != "__metadata__" and len(entry["shape"]) == 2)


CHANGED_HEADERS = {
    "no_hash": lambda h: h["__metadata__"].pop("data_sha256"),
    "wrong_hash": lambda h: h["__metadata__"].update(data_sha256="1" * 64),
    "negative_shape": lambda h: h[_first_matrix(h)].update(shape=[-1, -math.prod(h[_first_matrix(h)]["shape"])]),
    "absurd_shape": lambda h: h.update(absurd={"dtype": "F32", "shape": [2**60, 2**60, 0], "data_offsets": [0, 0]}),
    "huge_iterations": lambda h: h["__metadata__"].update(
        config=json.dumps({**json.loads(h["__metadata__"]["config"]), "num_iterations": 10**22})),
}
CHECKPOINT_LINES = {
    "no_hash": r"its metadata has no data_sha256, so its data cannot be verified \(--trust_checkpoint=true uses it "
               r"anyway\)",
    "wrong_hash": r"damaged: its data does not match the data_sha256 in its metadata \(--trust_checkpoint=true uses "
                  r"it anyway\)",
    "negative_shape": r"tensor '[\w.]+' has shape \[-1, -\d+\]: expects at most 8 whole numbers >= 0 whose product",
    "absurd_shape": r"tensor 'absurd' has shape \[1152921504606846976, 1152921504606846976, 0\]: expects at most 8",
    "huge_iterations": r"its metadata is damaged \(--num_iterations=10000000000000000000000 is not allowed: expects a "
                       r"whole number of steps in \[1, 10,000,000\]\)",
}


@pytest.fixture(scope="module")
def checkpoints(data, tmp_path_factory):
    """{name: path}: the untrained TINY model's checkpoint as save_checkpoint writes it ("good"; the
    model where the schedule has it at the final validation, as --eval rebuilds it), and copies
    with the CHANGED_HEADERS."""
    d = tmp_path_factory.mktemp("checkpoints")
    h = tg.parse_config(TINY + files(data) + ["--device=cpu"])
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), log=None, training=False)
    trainer.advance_to(h.num_iterations, final_validation=True)
    good = d / "good.safetensors"
    tg.save_checkpoint(good, trainer.model, h, "20261201-000000-abcdef12", "0" * 16, 5.0, 100.0)
    return {"good": good, **{name: with_header(good, d / f"{name}.safetensors", change)
                             for name, change in CHANGED_HEADERS.items()}}


@pytest.mark.parametrize("name", [name for name in CHECKPOINT_LINES if name != "huge_iterations"])
def test_a_checkpoint_that_cannot_be_verified_or_read_is_refused(checkpoints, run_main, name):
    for argv in ([f"--eval={checkpoints[name]}"], [f"--sample={checkpoints[name]}", "--prompt=x", "--max_new_tokens=2"]):
        code, err = run_main(argv)
        assert code == 2 and len(err) == 1, err
        assert re.fullmatch(rf"error: {re.escape(str(checkpoints[name]))}: {CHECKPOINT_LINES[name]}.*", err[0]), err


@pytest.mark.parametrize("trust", [False, True])
def test_a_checkpoint_whose_config_is_out_of_range_is_refused_by_eval(checkpoints, trust):
    """The edited config breaks the header's hash; trusted anyway, the config check refuses it."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "evaluation", "evaluate.py"), f"--eval={checkpoints['huge_iterations']}",
                           f"--trust_checkpoint={str(trust).lower()}"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=cpu_env(OMP_NUM_THREADS="1"))
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr
    line = CHECKPOINT_LINES["huge_iterations"] if trust else r"damaged: its header \(tensor names, shapes, offsets"
    assert re.fullmatch(rf"error: .*huge_iterations\.safetensors: {line}.*", err[0]), err


@pytest.mark.parametrize("name", ["good", "no_hash", "wrong_hash"])
def test_trust_checkpoint_uses_a_file_that_cannot_be_verified(checkpoints, run_main, name):
    code, err = run_main([f"--eval={checkpoints[name]}", "--trust_checkpoint=true"])
    assert code == 0 and err == [], err


@pytest.mark.parametrize("argv, line", [
    (["--eval="], r"--eval= names no file: give --eval=PATH of a checkpoint \(a run's logs/<run id>_model\.safetensors\)"),
    (["--sample="], r"--sample= names no file: give --sample=PATH of a checkpoint \(a run's .*\)"),
    (["--eval"], r"evaluate.py --eval=PATH: argument --eval: expected one argument"),
    (["--eval=x.safetensors", "--trust_checkpoint=maybe"], r"--trust_checkpoint expects true or false, got 'maybe'"),
    (["--sample=x.safetensors", "--seed=-1"], r"--sample expects .* and --seed in \[0, 2\^63\)"),
    (["--sample=x.safetensors", f"--seed={2**63}"], r"--sample expects .* and --seed in \[0, 2\^63\)"),
])
def test_checkpoint_commands_name_the_bad_argument(run_main, argv, line):
    code, err = run_main(argv)
    assert code == 2 and len(err) == 1 and re.fullmatch(f"error: {line}", err[0]), err


def test_num_iterations_beyond_the_bound_ends_at_once(data, tmp_path):
    """A run of 10^22 steps is refused, not started (its schedules are made step by step)."""
    done = subprocess.run([sys.executable, os.path.join(REPO, "train_gpt.py"), *TINY, *files(data),
                           "--num_iterations=10000000000000000000000", f"--log_dir={tmp_path}/logs"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=cpu_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: --num_iterations=10000000000000000000000 is not allowed: expects a whole number of steps in [1, "
        "10,000,000]"], done.stderr


# ----------------------------------------------------------------------------- the CPU track's baseline script

BASELINE = os.path.join(REPO, "records", "track_cpu", "baseline_adamw.py")
BAD_BASELINE_CONFIGS = [
    (b'{"seed": 1, "track": "\xff"}', r"is not UTF-8 text \(byte 0xff at offset 22\): save it as UTF-8"),
    (b"[1, 2]", r": a config must be a JSON object of key: value, got list"),
    (b"{", r"is not valid JSON \(Expecting property name"),
    (b"[" * 100_000 + b"]" * 100_000, r": lists and objects nest too deeply; a config is one flat object"),
    (b'{"n_layer": [[1]]}', r": n_layer expects a whole number, got \[\[1\]\]"),
    (b'{"no_such_key": 1}', r": unknown config keys \['no_such_key'\]"),
    (None, r"cannot read --config .*config\.json: No such file or directory"),
]


@pytest.fixture(scope="module")
def baseline():
    spec = importlib.util.spec_from_file_location("baseline_adamw", BASELINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("content, line", BAD_BASELINE_CONFIGS, ids=[line for _, line in BAD_BASELINE_CONFIGS])
def test_the_baseline_refuses_a_bad_config_file_in_one_line(baseline, tmp_path, content, line):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(SystemExit) as stopped:
        baseline.parse_hyperparameters(["--config", str(path)])
    assert re.fullmatch(rf"error: (--config )?.*{line}.*", stopped.value.code) and "\n" not in stopped.value.code


def test_the_baseline_script_ends_with_that_line(tmp_path):
    (tmp_path / "config.json").write_bytes(BAD_BASELINE_CONFIGS[0][0])
    done = subprocess.run([sys.executable, BASELINE, "--config", str(tmp_path / "config.json")], capture_output=True,
                          text=True, timeout=60, cwd=REPO, env=cpu_env())
    assert done.returncode == 1 and done.stderr.strip().splitlines() == [
        f"error: --config {tmp_path}/config.json is not UTF-8 text (byte 0xff at offset 22): save it as UTF-8"]
