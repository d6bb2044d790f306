"""Tests of the records tools: log writing, parsing, sealing and verification, make_record,
reproduce, and the CPU baseline script.

Logs are written by write_log below, an independent writer of the version-2 format
(records/README.md): its own seal computation, and small fake sources chosen to trip a parser
that scans for markers instead of counting bytes.
"""

import ast
import errno
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from data.shards import fingerprint  # noqa: E402
from records import make_record, reproduce  # noqa: E402
from records.logfile import LogError, LogWriteError, LogWriter, parse_log, verify  # noqa: E402

TRACK = "track_test"
TARGET = 3.5
TOTAL_STEPS = 4
VAL_TOKENS = 512
SOURCES = {
    "train_gpt.py": (
        "def train():\n"
        "    print('=== end source train_gpt.py ===')\n"
        "=== source fake.py sha256=" + "0" * 64 + " bytes=3 ===\n"
        "# caf\u00e9, no trailing newline"
    ).encode("utf-8"),
    "data/shards.py": b"SHARD_MAGIC = 20240520\n",
}
OTHER_SOURCES = {**SOURCES, "train_gpt.py": SOURCES["train_gpt.py"] + b"\n# changed\n"}
VAL_DATA = {"path": "data/x_val_000000.bin", "bytes": 2048, "tokens": 512, "header_sha256": "a" * 64,
            "head_sha256": "b" * 64, "tail_sha256": "c" * 64}
TRAIN_DATA = {**VAL_DATA, "path": "data/x_train_000001.bin", "head_sha256": "d" * 64}
SHARD_MAGIC = 20240520
SHARD_HEADER_INTS = 256
CPU, HOSTNAME, GIT_COMMIT = "Test CPU 9000", "testhost", "0123456789abcdef0123456789abcdef01234567"


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def sealed(prefix, lines):
    """The documented seal: d_0 = sha256(prefix), d_i = sha256(d_{i-1} + line_i), 16 hex digits."""
    digest, out = hashlib.sha256(prefix).digest(), []
    for line in lines:
        digest = hashlib.sha256(digest + line.encode("utf-8")).digest()
        out.append(f"{line} #{digest.hex()[:16]}")
    return out


def write_log(path, final_loss, train_ms, sources=SOURCES, track=TRACK, ending="final", world_size=1, gpu="none",
              seed=0, config_changes=None, val_data=VAL_DATA, version=2, cpu=CPU, hostname=HOSTNAME,
              git_commit=GIT_COMMIT, data=None, total_steps=TOTAL_STEPS):
    """Write a log of a fake run of total_steps (4) steps ending at (final_loss, train_ms); return its path.
    ending: "final", "error" or "interrupted"; data: the data section's fingerprints (default: val_data
    and TRAIN_DATA)."""
    run_id = Path(path).stem
    out = bytearray(f"speedrun-log v{version} run_id={run_id}\n".encode())
    for relpath in sorted(sources):
        content = sources[relpath]
        out += f"=== source {relpath} sha256={sha256(content)} bytes={len(content)} ===\n".encode()
        out += content
        out += f"\n=== end source {relpath} ===\n".encode()
    environment = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "triton": "3.7.1",
        "cuda": "none",
        "gpu": gpu,
        "world_size": world_size,
        "cpu": cpu,
        "hostname": hostname,
        "command": "python train_gpt.py --preset cpu",
        "git_commit": git_commit,
        "started": "2026-11-30T10:00:00+00:00",
    }
    config = {"preset": "cpu", "track": track, "num_iterations": total_steps, "seed": seed}
    config |= {"val_tokens": VAL_TOKENS, "val_files": "data/x_val_*.bin", "entry": "train_gpt.py"}
    config |= config_changes or {}
    text = ["=== environment ===", *(f"{k}: {v}" for k, v in environment.items())]
    data = [val_data, TRAIN_DATA] if data is None else data
    text += ["=== data ===", *map(json.dumps, data), "=== config ===", json.dumps(config)]
    text += ["=== run ==="]
    for step in range(1, total_steps + 1):
        ms = round(train_ms * step / total_steps)
        timing = f"train_time:{ms}ms step_avg:{ms / step:.2f}ms"
        text.append(f"step:{step}/{total_steps} train_loss:{final_loss + 1 / step:.4f} "
                    f"objective:{final_loss + 2 / step:.4f} {timing}")
        if step % 2 == 0:
            val = final_loss + 0.5 * (total_steps - step)
            text.append(f"step:{step}/{total_steps} val_loss:{val:.4f} {timing}")
    text.append("an informational line")
    text.append({
        "final": f"final val_loss:{final_loss:.4f} train_time:{train_ms}ms steps:{total_steps} peak_memory:123MiB",
        "error": "error: RuntimeError: something broke",
        "interrupted": "interrupted: SIGINT at step 3/4",
    }[ending])
    lines = sealed(bytes(out), text) if version == 2 else text
    out += ("\n".join(lines) + "\n").encode()
    Path(path).write_bytes(bytes(out))
    return str(path)


def write_logs(folder, losses, times_ms, prefix="run", **kwargs):
    folder.mkdir(parents=True, exist_ok=True)
    return [
        write_log(folder / f"{prefix}{i}.txt", loss, ms, seed=i, **kwargs)
        for i, (loss, ms) in enumerate(zip(losses, times_ms))
    ]


@pytest.fixture
def site(tmp_path):
    """A records root with one track (target 3.5, p < 0.01, >= 3 runs, its val data) and a README
    with the track's table markers."""
    track_dir = tmp_path / "records" / TRACK
    track_dir.mkdir(parents=True)
    track = {"name": TRACK, "target_val_loss": TARGET, "p_threshold": 0.01, "min_runs": 3}
    track |= {"hardware": "test", "description": "test track", "val_tokens": VAL_TOKENS, "val_data": [VAL_DATA]}
    (track_dir / "track.json").write_text(json.dumps(track))
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Title\n\nintro\n\n<!-- records:track_test:start -->\nstale table\n<!-- records:track_test:end -->\n\nafter\n"
    )
    return tmp_path


def run_tool(site, *args):
    argv = ["--track", TRACK, "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    return make_record.main(argv + [str(a) for a in args])


def snapshot(site):
    """Every file under the records root and the README, with its bytes (to check that nothing was written)."""
    files = [site / "README.md", *sorted((site / "records").rglob("*"))]
    contents = {str(p): p.read_bytes() for p in files if p.is_file()}
    return contents | {"dirs": sorted(map(str, (site / "records").rglob("*")))}


# ----------------------------------------------------------------------------- the log format


def test_parse_log_reads_every_section(tmp_path):
    log = parse_log(write_log(tmp_path / "r1.txt", 3.25, 5000))
    verify(log)
    assert log.run_id == "r1" and log.sealed and log.version == 2
    assert log.sources == SOURCES
    assert log.declared_sha256 == {p: sha256(c) for p, c in SOURCES.items()}
    assert log.environment["world_size"] == "1" and log.environment["gpu"] == "none"
    assert log.data == [VAL_DATA, TRAIN_DATA]
    assert log.config["entry"] == "train_gpt.py" and log.config["track"] == TRACK
    assert [s["step"] for s in log.steps] == [1, 2, 3, 4]
    assert log.steps[0]["train_loss"] == 4.25 and log.steps[0]["objective"] == 5.25
    assert log.val_points == [(2, 4.25, 2500), (4, 3.25, 5000)]
    assert log.final == {"val_loss": 3.25, "train_time_ms": 5000, "steps": 4, "peak_memory_mib": 123.0}
    assert log.info == ["an informational line"]
    assert log.finished and log.ending == "finished"


def test_the_writer_and_the_independent_writer_agree(tmp_path):
    """LogWriter's bytes equal write_log's, from the same content."""
    expected = Path(write_log(tmp_path / "same.txt", 3.25, 5000)).read_bytes()
    text = expected[expected.index(b"=== environment ==="):].decode("utf-8")
    lines = [line.rsplit(" #", 1)[0] for line in text.split("\n")[:-1]]
    writer = LogWriter(tmp_path / "written.txt", "same")
    for relpath in sorted(SOURCES):
        writer.source(relpath, SOURCES[relpath])
    for line in lines:
        writer.line(line)
    writer.close()
    assert (tmp_path / "written.txt").read_bytes() == expected


@pytest.mark.parametrize("ending, phrase", [("error", "stopped with an error (RuntimeError: something broke)"),
                                            ("interrupted", "was interrupted (SIGINT at step 3/4)")])
def test_unfinished_logs_say_how_they_ended(tmp_path, ending, phrase):
    log = parse_log(write_log(tmp_path / "r1.txt", 3.25, 5000, ending=ending))
    assert not log.finished and log.final is None and log.ending == ending
    assert log.describe_ending() == phrase


def test_a_log_cut_by_a_failed_write_is_unfinished_not_malformed(tmp_path):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.rindex(b"final val_loss") + 20])
    log = parse_log(path)
    assert log.ending == "cut" and "cut short in the middle of a line" in log.describe_ending()


def test_an_edited_result_breaks_the_seal_at_that_line(tmp_path):
    """The result a record is made of (train_time of the final line) edited by hand."""
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"train_time:5000ms steps:4", b"train_time:1000ms steps:4"))
    line = raw[: raw.index(b"final val_loss")].count(b"\n") + 1
    with pytest.raises(LogError, match=rf"r1\.txt: line {line} \('final val_loss:3\.2500 train_time:1000ms"):
        parse_log(path)


def test_an_edited_config_breaks_the_seal(tmp_path):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    path.write_bytes(path.read_bytes().replace(b'"val_tokens": 512', b'"val_tokens": 256'))
    with pytest.raises(LogError, match="does not match its seal: the log was changed after it was written"):
        parse_log(path)


def test_an_added_line_has_no_seal(tmp_path):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    path.write_bytes(path.read_bytes().replace(b"an informational", b"hello\nan informational"))
    with pytest.raises(LogError, match="has no seal"):
        parse_log(path)


def test_verify_names_the_tampered_source(tmp_path):
    """An edited source breaks the seals too (they start from every byte before the text), but the
    message names the source."""
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b"def train():", b"def trair():", 1))
    with pytest.raises(LogError, match=r"r1\.txt: embedded source train_gpt\.py has sha256 [0-9a-f]{64}, but the log "
                                       r"declares [0-9a-f]{64}: the log was edited"):
        parse_log(path)
    path.write_bytes(raw.replace(b"run_id=r1", b"run_id=r9", 1))
    with pytest.raises(LogError, match=r"line \d+ \('=== environment ==='\) does not match its seal: .* \(here, in "
                                       r"the first line or in a source block's header\)"):
        parse_log(path)
    log = parse_log(write_log(tmp_path / "r2.txt", 3.25, 5000, version=1))
    Path(log.path).write_bytes(Path(log.path).read_bytes().replace(b"def train():", b"def trair():", 1))
    with pytest.raises(LogError, match=r"r2\.txt: embedded source train_gpt\.py has sha256"):
        verify(parse_log(log.path))


def test_truncated_log_is_refused(tmp_path):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    raw = path.read_bytes()
    path.write_bytes(raw[: raw.index(b"def train():") + 5])
    with pytest.raises(LogError, match="does not end after its declared"):
        parse_log(path)


def test_source_path_escaping_the_tree_is_refused(tmp_path):
    path = write_log(tmp_path / "r1.txt", 3.25, 5000, sources={**SOURCES, "../evil.py": b"x"})
    with pytest.raises(LogError, match="not a plain relative path"):
        parse_log(path)


def test_a_run_id_that_would_escape_a_folder_is_refused(tmp_path):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    path.write_bytes(path.read_bytes().replace(b"run_id=r1", b"run_id=../../x", 1))
    with pytest.raises(LogError, match=r"run id '\.\./\.\./x' is not letters"):
        parse_log(path)


def test_a_binary_file_is_not_echoed(tmp_path):
    path = tmp_path / "image.txt"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(LogError, match=r"not a run log \(its first line is 'binary data'"):
        parse_log(path)


def test_a_crlf_copy_is_named_as_such(tmp_path):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    with pytest.raises(LogError, match=r"r1\.txt: has CRLF \(Windows\) line endings: .*convert it back to LF"):
        parse_log(path)


def test_a_log_missing_only_its_final_newline_says_so(tmp_path):
    """A whole, sealed last line without its newline is not a write cut short by a full disk."""
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(LogError, match=r"r1\.txt: the last line \('final val_loss:3\.2500 .*'\) is whole and matches "
                                       r"its seal but has no final newline"):
        parse_log(path)


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_git_keeps_logs_byte_exact_and_out_of_diffs():
    done = subprocess.run(["git", "check-attr", "text", "linguist-generated", "--",
                           "records/track_cpu/2026-12-01_X/20261201-000000-00000000.txt"],
                          cwd=REPO, capture_output=True, text=True, timeout=30, check=True)
    assert done.stdout.splitlines() == [
        "records/track_cpu/2026-12-01_X/20261201-000000-00000000.txt: text: unset",
        "records/track_cpu/2026-12-01_X/20261201-000000-00000000.txt: linguist-generated: set",
    ]


def test_writer_cuts_back_a_failed_write_to_the_last_whole_line(tmp_path):
    """A file-size limit reached mid-line: LogWriteError, and the file ends at a whole line."""
    import resource
    import signal
    writer = LogWriter(tmp_path / "full.txt", "full")
    writer.source("a.py", b"x = 1\n")
    writer.line("=== environment ===")
    size = (tmp_path / "full.txt").stat().st_size
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, hard))
    try:
        with pytest.raises(LogWriteError, match="the file-size limit was reached while writing .*full.txt"):
            writer.line("a line longer than the ten bytes left")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    writer.close()
    assert (tmp_path / "full.txt").stat().st_size == size


# ----------------------------------------------------------------------------- statistics


def test_one_sample_test_matches_hand_computation():
    # n = 3: mean 3.1, sample std 0.1, t = (3.1 - 3.3) / (0.1 / sqrt(3)) = -2 sqrt(3).
    # With 2 degrees of freedom the t CDF has the closed form 1/2 + t / (2 sqrt(2 + t^2)).
    t, p = make_record.one_sample_test([3.0, 3.1, 3.2], 3.3)
    t_hand = -2 * math.sqrt(3)
    assert t == pytest.approx(t_hand, rel=1e-9)
    assert p == pytest.approx(0.5 + t_hand / (2 * math.sqrt(2 + t_hand**2)), rel=1e-9)
    assert make_record.val_loss_summary([3.0, 3.1, 3.2])["std"] == pytest.approx(0.1, rel=1e-9)


def test_statistics_are_undefined_without_spread():
    assert make_record.one_sample_test([3.0], 3.3) == (None, None)
    assert make_record.one_sample_test([3.0, 3.0, 3.0], 3.3) == (None, None)
    assert make_record.welch_test([3.0, 3.1], [3.2]) is None


# ----------------------------------------------------------------------------- make_record


def test_record_folder_statistics_plot_and_readme_table(site, capsys):
    losses, times = [3.40, 3.42, 3.41], [5000, 5600, 5300]
    logs = write_logs(site / "logs", losses, times)
    description = ["--description", "did a thing"]
    assert run_tool(site, "--name", "Faster", "--date", "2026-11-30", *description, "--logs", *logs) == 0
    folder = site / "records" / TRACK / "2026-11-30_Faster"
    for log in logs:
        assert (folder / Path(log).name).read_bytes() == Path(log).read_bytes()
    assert sorted(p.name for p in folder.iterdir()) == sorted([Path(log).name for log in logs] + [
        "README.md", "statistics.json", "statistics.txt", "val_loss.png"]), "the logs and what the tool computes"
    s = json.loads((folder / "statistics.json").read_text())
    expected = stats.ttest_1samp(losses, TARGET, alternative="less")
    assert s["status"] == "record" and s["n"] == 3
    assert s["val_loss"]["mean"] == pytest.approx(np.mean(losses), rel=1e-12)
    assert s["val_loss"]["std"] == pytest.approx(np.std(losses, ddof=1), rel=1e-12)
    assert s["t_statistic"] == pytest.approx(expected.statistic, rel=1e-12)
    assert s["p_value"] == pytest.approx(expected.pvalue, rel=1e-12) and s["p_value"] < 0.01
    assert s["train_time_ms"] == {"values": times, "mean": 5300, "median": 5300, "min": 5000, "max": 5600}
    assert s["train_time_s"]["max"] == pytest.approx(5.6)
    assert s["code"] == {p: sha256(c) for p, c in sorted(SOURCES.items())}
    assert s["baseline"] is None
    assert "did a thing" in (folder / "README.md").read_text()
    assert f"- machine: CPU `{CPU}`, hostname `{HOSTNAME}` (every run)" in (folder / "README.md").read_text()
    assert f"- commit: `{GIT_COMMIT}` (every run)" in (folder / "README.md").read_text()
    assert s["runs"][0] | {"cpu": CPU, "hostname": HOSTNAME, "git_commit": GIT_COMMIT} == s["runs"][0]
    assert s["mixed_machines_reason"] is None and s["mixed_commits_reason"] is None
    assert "status           record" in (folder / "statistics.txt").read_text()
    assert (folder / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (site / "README.md").read_text()
    assert readme.startswith("# Title\n\nintro\n\n<!-- records:track_test:start -->\n|")
    assert readme.endswith("|\n<!-- records:track_test:end -->\n\nafter\n")
    assert "stale table" not in readme
    assert "[Faster](records/track_test/2026-11-30_Faster)" in readme and "| 5.3 s | 3 | 1.00x |" in readme


def assert_refused(site, capsys, message, *args):
    before = snapshot(site)
    assert run_tool(site, "--name", "X", *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert snapshot(site) == before


def test_tampered_log_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    raw = Path(logs[1]).read_bytes()
    Path(logs[1]).write_bytes(raw.replace(b"SHARD_MAGIC = 2", b"SHARD_MAGIC = 3", 1))
    assert_refused(site, capsys, "run1.txt: embedded source data/shards.py has sha256", "--logs", *logs)


def test_edited_results_refused(site, capsys):
    """A copy of a run whose final train_time was changed by hand to 1000 ms is no record."""
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    raw = Path(logs[0]).read_bytes()
    Path(logs[0]).write_bytes(raw.replace(b"train_time:5000ms steps", b"train_time:1000ms steps"))
    assert_refused(site, capsys, "run0.txt: line ", "--logs", *logs)


def test_unsealed_version_1_logs_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300], version=1)
    assert_refused(site, capsys, "a version-1 log is not sealed", "--logs", *logs)


def test_other_val_data_or_val_tokens_refused(site, capsys):
    """Runs that validated on another file (a train shard, by its content hashes) or on another
    number of tokens do not count, even sealed."""
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "ontrain.txt", 3.41, 5300, val_data=TRAIN_DATA,
                          config_changes={"val_files": "data/x_train_*.bin"}))
    assert_refused(site, capsys, "ontrain.txt: the run's val data (data/x_train_000001.bin) is not the track's",
                   "--logs", *logs)
    logs[2] = write_log(site / "logs" / "short.txt", 3.41, 5300, config_changes={"val_tokens": 256})
    assert_refused(site, capsys, "short.txt: the run validated on val_tokens=256, the track evaluates on 512",
                   "--logs", *logs)


def test_different_configs_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "other.txt", 3.41, 5300, config_changes={"num_iterations": 5}))
    assert_refused(site, capsys, "differ in num_iterations (only seed, log_dir may differ)", "--logs", *logs)


def test_runs_already_in_a_record_refused(site, capsys):
    """The same logs submitted again under a new name add no second row."""
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert run_tool(site, "--name", "First", "--date", "2026-11-30", "--logs", *logs) == 0
    assert_refused(site, capsys, "is already part of the record", "--date", "2026-12-01", "--logs", *logs)


def test_zero_time_runs_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [0, 0, 0])
    assert_refused(site, capsys, "0 ms of training is not a run", "--logs", *logs)


def test_unfinished_log_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "dead.txt", 3.41, 5300, ending="error"))
    assert_refused(site, capsys, "dead.txt: the run stopped with an error", "--logs", *logs)
    logs[2] = write_log(site / "logs" / "stopped.txt", 3.41, 5300, ending="interrupted")
    assert_refused(site, capsys, "stopped.txt: the run was interrupted (SIGINT at step 3/4)", "--logs", *logs)


def test_mixed_code_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "other.txt", 3.41, 5300, sources=OTHER_SOURCES))
    assert_refused(site, capsys, "logs come from different code", "--logs", *logs)
    assert "differ in train_gpt.py" in make_record.describe_code_difference(parse_log(logs[0]), parse_log(logs[2]))


def test_track_mismatch_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300], track="track_cpu")
    assert_refused(site, capsys, "config says track 'track_cpu', not 'track_test'", "--logs", *logs)


def test_other_hardware_refused(site, capsys):
    track_json = site / "records" / TRACK / "track.json"
    required = {"world_size": "8", "gpu": "(NVIDIA H100 80GB HBM3, ){7}NVIDIA H100 80GB HBM3"}
    track_json.write_text(json.dumps(json.loads(track_json.read_text()) | {"required_environment": required}))
    h100s = ", ".join(["NVIDIA H100 80GB HBM3"] * 8)
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600], world_size=8, gpu=h100s)
    logs.append(write_log(site / "logs" / "h200.txt", 3.41, 5300, world_size=1, gpu="NVIDIA H200"))
    assert_refused(site, capsys, "h200.txt: environment world_size is '1', the track requires /8/", "--logs", *logs)
    one_h200 = h100s.replace("H100 80GB HBM3", "H200", 1)
    logs[2] = write_log(site / "logs" / "h200.txt", 3.41, 5300, world_size=8, gpu=one_h200)
    assert_refused(site, capsys, "h200.txt: environment gpu is 'NVIDIA H200, NVIDIA H100", "--logs", *logs)
    logs[2] = write_log(site / "logs" / "h200.txt", 3.41, 5300, world_size=8, gpu=h100s)
    assert run_tool(site, "--name", "H100", "--logs", *logs) == 0


def test_existing_record_folder_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    (site / "records" / TRACK / "2026-11-30_X").mkdir()
    assert_refused(site, capsys, "already exists", "--date", "2026-11-30", "--logs", *logs)


def test_non_significant_result_needs_allow_non_record(site, capsys):
    logs = write_logs(site / "logs", [3.45, 3.52, 3.50], [5000, 5600, 5300])
    assert_refused(site, capsys, "not a record: p = ", "--logs", *logs)
    assert run_tool(site, "--name", "Y", "--date", "2026-11-30", "--allow-non-record", "--logs", *logs) == 0
    folder = site / "records" / TRACK / "2026-11-30_Y"
    assert json.loads((folder / "statistics.json").read_text())["status"] == "not a record"
    assert "**Not a record**" in (folder / "README.md").read_text()
    assert "_No records yet._" in (site / "README.md").read_text()


def test_too_few_runs_are_not_a_record(site, capsys):
    logs = write_logs(site / "logs", [3.10, 3.11], [5000, 5600])
    assert_refused(site, capsys, "only 2 run(s); the track requires at least 3", "--logs", *logs)


def test_baseline_welch_tests_and_speedup(site, capsys):
    losses, times = [3.40, 3.42, 3.41], [5000, 5600, 5300]
    base_losses, base_times = [3.43, 3.44, 3.40, 3.45], [9000, 9500, 8800, 9100]
    logs = write_logs(site / "logs", losses, times)
    base = write_logs(site / "base", base_losses, base_times, prefix="base", sources=OTHER_SOURCES)
    assert_refused(site, capsys, "baseline logs are referenced, not copied, so they must be part of a record",
                   "--logs", *logs, "--baseline-logs", *base)
    assert run_tool(site, "--name", "Base", "--date", "2026-11-29", "--allow-non-record", "--logs", *base) == 0
    base_folder = site / "records" / TRACK / "2026-11-29_Base"
    base = [str(base_folder / Path(b).name) for b in base]
    assert run_tool(site, "--name", "Z", "--date", "2026-11-30", "--logs", *logs, "--baseline-logs", *base) == 0
    folder = site / "records" / TRACK / "2026-11-30_Z"
    b = json.loads((folder / "statistics.json").read_text())["baseline"]
    for key, record, baseline in (("welch_val_loss", losses, base_losses), ("welch_train_time", times, base_times)):
        expected = stats.ttest_ind(record, baseline, equal_var=False, alternative="less")
        assert b[key]["t"] == pytest.approx(expected.statistic, rel=1e-12)
        assert b[key]["p"] == pytest.approx(expected.pvalue, rel=1e-12)
    assert b["speedup"] == pytest.approx(np.mean(base_times) / np.mean(times), rel=1e-12)
    assert b["n"] == 4 and b["code"]["train_gpt.py"] == sha256(OTHER_SOURCES["train_gpt.py"])
    assert b["logs"] == [f"records/{TRACK}/2026-11-29_Base/base{i}.txt" for i in range(4)]
    assert not (folder / "baseline").exists()

    # A record folder given as --baseline-logs stands for the logs of its runs.
    more = write_logs(site / "more", losses, times, prefix="more")
    assert run_tool(site, "--name", "Z2", "--date", "2026-11-30", "--logs", *more, "--baseline-logs", base_folder) == 0
    again = json.loads((folder.parent / "2026-11-30_Z2" / "statistics.json").read_text())["baseline"]
    assert again["runs"] == json.loads((base_folder / "statistics.json").read_text())["runs"]


def test_a_remeasured_baseline_stays_out_of_the_table_and_records_compare_with_it(site, capsys):
    """Records made on another machine give their speed-up over the baseline measured there,
    never over a time from a different machine."""
    base_times, times = [9000, 9500, 8800], [3000, 3100, 2900]
    base = write_logs(site / "base", [3.43, 3.44, 3.40], base_times, prefix="base", sources=OTHER_SOURCES)
    assert_refused(site, capsys, "takes only the baseline's own runs", "--remeasured-baseline",
                   "--logs", *base, "--baseline-logs", *base)
    assert run_tool(site, "--name", "BaseHere", "--date", "2026-11-29", "--remeasured-baseline", "--logs", *base) == 0
    base_folder = site / "records" / TRACK / "2026-11-29_BaseHere"
    s = json.loads((base_folder / "statistics.json").read_text())
    assert s["status"] == "baseline", "a baseline below the target is still the baseline, not a record"
    assert "BaseHere" not in (site / "README.md").read_text()
    first = write_logs(site / "first", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="first")
    assert run_tool(site, "--name", "First", "--date", "2026-11-28", "--logs", *first) == 0
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], times)
    assert run_tool(site, "--name", "Here", "--date", "2026-11-30", "--logs", *logs,
                    "--baseline-logs", base_folder) == 0
    rows = [line for line in (site / "README.md").read_text().splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert "[Here]" in rows[0] and rows[0].endswith(f"| {np.mean(base_times) / np.mean(times):.2f}x |")
    assert "[First]" in rows[1] and rows[1].endswith("| 1.00x |")


def test_a_baseline_folder_without_run_logs_is_one_line(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    broken = site / "records" / TRACK / "2026-11-01_Broken"
    broken.mkdir()
    (broken / "statistics.json").write_text(json.dumps({"runs": [{"run_id": "x"}]}))
    assert_refused(site, capsys, "must be a record folder", "--logs", *logs, "--baseline-logs", broken)


def test_set_target_from_these_logs_then_a_record_against_it(site, capsys):
    track_json = site / "records" / TRACK / "track.json"
    track_json.write_text(json.dumps(json.loads(track_json.read_text()) | {"target_val_loss": None}))
    base_losses = [4.1234, 4.2345, 4.1789]
    base = write_logs(site / "base", base_losses, [9000, 9500, 8800], prefix="base")
    assert_refused(site, capsys, "has no target yet", "--logs", *base)

    set_target = "--set-target-from-these-logs"
    assert run_tool(site, "--name", "Baseline", "--date", "2026-11-01", set_target, "--logs", *base) == 0
    target = json.loads(track_json.read_text())["target_val_loss"]
    assert target == float(np.mean(base_losses))  # exactly, at full precision
    folder = site / "records" / TRACK / "2026-11-01_Baseline"
    s = json.loads((folder / "statistics.json").read_text())
    assert s["status"] == "target" and s["target_val_loss"] == target and s["p_value"] is None
    assert repr(target) in (folder / "README.md").read_text()
    assert_refused(site, capsys, "already has target", set_target, "--logs", *base)

    losses = [4.05, 4.06, 4.04]
    logs = write_logs(site / "logs", losses, [4500, 4700, 4600])
    assert run_tool(site, "--name", "Fast", "--date", "2026-11-30", "--logs", *logs) == 0
    s = json.loads((site / "records" / TRACK / "2026-11-30_Fast" / "statistics.json").read_text())
    assert s["p_value"] == pytest.approx(stats.ttest_1samp(losses, target, alternative="less").pvalue, rel=1e-12)
    rows = [line for line in (site / "README.md").read_text().splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert "[Fast]" in rows[0] and rows[0].endswith(f"| {9100 / 4600:.2f}x |")
    assert "[Baseline]" in rows[1] and "| sets target |" in rows[1] and rows[1].endswith("| 1.00x |")


def test_missing_markers_warn_but_do_not_fail(site, capsys):
    (site / "README.md").write_text("# no markers\n")
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert run_tool(site, "--name", "W", "--logs", *logs) == 0
    assert "<!-- records:track_test:start -->" in capsys.readouterr().err
    assert (site / "README.md").read_text() == "# no markers\n"


def make_first_record(site):
    """A record 2026-11-30_First in the site; its folder."""
    logs = write_logs(site / "first", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="first")
    assert run_tool(site, "--name", "First", "--date", "2026-11-30", "--logs", *logs) == 0
    return site / "records" / TRACK / "2026-11-30_First"


def test_another_records_invalid_statistics_refused_before_anything_is_written(site, capsys):
    stats_path = make_first_record(site) / "statistics.json"
    stats_path.write_text("{not json", encoding="utf-8")
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, f"{stats_path}: not valid JSON (", "--logs", *logs)


def test_a_read_only_readme_refused_before_anything_is_written(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    readme = site / "README.md"
    readme.chmod(0o444)
    try:
        assert_refused(site, capsys, f"{readme} is read-only; make it writable", "--logs", *logs)
    finally:
        readme.chmod(0o644)


def test_a_failed_readme_write_leaves_nothing(site, capsys, monkeypatch):
    """The disk filling up while the new README table is written: one line, no record folder, the old README."""
    staged_file = make_record.staged_file

    def full_disk(path, text):
        if path.name == "README.md":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return staged_file(path, text)

    monkeypatch.setattr(make_record, "staged_file", full_disk)
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, f"{site / 'README.md'}: No space left on device", "--logs", *logs)


def test_the_readme_table_is_replaced_in_one_step(site):
    """The new README is a new file renamed over the old one (a reader sees the old table or the new one)
    with the old one's permissions."""
    readme = site / "README.md"
    readme.chmod(0o640)
    inode = readme.stat().st_ino
    make_first_record(site)
    assert readme.stat().st_ino != inode and readme.stat().st_mode & 0o777 == 0o640
    assert "[First]" in readme.read_text()
    assert [p.name for p in site.iterdir() if p.name.startswith(".")] == []


def test_a_track_readme_with_the_markers_gets_the_table_too(site):
    track_readme = site / "records" / TRACK / "README.md"
    track_readme.write_text("# Track\n\n<!-- records:track_test:start -->\n<!-- records:track_test:end -->\n")
    make_first_record(site)
    assert "| [First](2026-11-30_First) |" in track_readme.read_text()
    assert "| [First](records/track_test/2026-11-30_First) |" in (site / "README.md").read_text()


@pytest.mark.parametrize("key, edit, message", [
    ("val_loss", lambda s: s["val_loss"] | {"mean": 3.0}, "val_loss.mean is 3.0, recomputed 3.41"),
    ("baseline", lambda s: s["baseline"] | {"speedup": 99}, "baseline.speedup is 99, recomputed 1.7"),
    ("runs", lambda s: s["runs"][:2], "lists the logs first0.txt, first1.txt, but the folder holds first0.txt, "
                                      "first1.txt, first2.txt"),
])
def test_an_edited_statistics_json_is_refused_naming_it(site, capsys, key, edit, message):
    """The table is built from every record's statistics.json, recomputed from its sealed logs first."""
    base = write_logs(site / "base", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="base", sources=OTHER_SOURCES)
    assert run_tool(site, "--name", "Base", "--date", "2026-11-29", "--allow-non-record", "--logs", *base) == 0
    first = write_logs(site / "first", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="first")
    base_folder = site / "records" / TRACK / "2026-11-29_Base"
    assert run_tool(site, "--name", "First", "--date", "2026-11-30", "--logs", *first, "--baseline-logs",
                    base_folder) == 0
    stats_path = site / "records" / TRACK / "2026-11-30_First" / "statistics.json"
    s = json.loads(stats_path.read_text())
    stats_path.write_text(json.dumps(s | {key: edit(s)}, indent=2) + "\n")
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, f"{stats_path}: {message}", "--logs", *logs)


def test_the_cpu_records_are_what_their_logs_give():
    """Every record of records/track_cpu recomputes exactly (as json writes the numbers) from its logs,
    and the main README's table is the one they give."""
    track_dir = REPO / "records" / "track_cpu"
    track = json.loads((track_dir / "track.json").read_text())
    records = make_record.checked_track_records(track_dir, track, REPO)
    assert len(records) >= 8
    assert make_record.with_table(REPO / "README.md", records, "track_cpu") == (REPO / "README.md").read_text()


@pytest.mark.parametrize("change, message", [
    ({"hostname": "otherhost"}, f"ran on cpu '{CPU}', hostname '{HOSTNAME}', "),
    ({"cpu": "Other CPU"}, "run2.txt on cpu 'Other CPU', hostname 'testhost': a record's runs and its baseline's run "
                           "on one machine"),
    ({"git_commit": "f" * 40}, f"run2.txt at {'f' * 40}: a record's runs run at one commit"),
])
def test_runs_on_two_machines_or_commits_need_a_reason(site, capsys, change, message):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "run2.txt", 3.41, 5300, seed=2, **change))
    assert_refused(site, capsys, message, "--logs", *logs)
    flag = "--mixed-commits-reason" if "git_commit" in change else "--mixed-machines-reason"
    assert run_tool(site, "--name", "Mixed", "--date", "2026-11-30", flag, "a test of the flag", "--logs", *logs) == 0
    folder = site / "records" / TRACK / "2026-11-30_Mixed"
    s = json.loads((folder / "statistics.json").read_text())
    assert s[flag.removeprefix("--").replace("-", "_")] == "a test of the flag"
    readme = (folder / "README.md").read_text()
    assert "because: a test of the flag" in readme and f"(runs {Path(logs[2]).stem})" in readme
    more = write_logs(site / "more", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="more")
    assert run_tool(site, "--name", "Next", "--logs", *more) == 0, "the mixed record passes its check"


def test_a_reason_for_mixing_without_mixed_runs_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, f"--mixed-machines-reason is given, but every run ran on cpu '{CPU}'",
                   "--mixed-machines-reason", "x", "--logs", *logs)


def test_a_baseline_from_another_machine_refused(site, capsys):
    base = write_logs(site / "base", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="base", hostname="elsewhere")
    assert run_tool(site, "--name", "Base", "--date", "2026-11-29", "--allow-non-record", "--logs", *base) == 0
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, "base0.txt on cpu 'Test CPU 9000', hostname 'elsewhere'", "--logs", *logs,
                   "--baseline-logs", site / "records" / TRACK / "2026-11-29_Base")


def test_make_record_under_a_locale_that_is_not_utf8(site):
    """LC_ALL=C without Python's UTF-8 mode: the files are UTF-8 all the same (the README's '·')."""
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG"))}
    env |= {"LC_ALL": "C", "PYTHONUTF8": "0"}
    done = subprocess.run([sys.executable, str(REPO / "records" / "make_record.py"), "--track", TRACK, "--name", "C",
                           "--date", "2026-11-30", "--description", "caf\u00e9", "--records-dir", site / "records",
                           "--readme", site / "README.md", "--logs", *logs],
                          env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    readme = (site / "records" / TRACK / "2026-11-30_C" / "README.md").read_text(encoding="utf-8")
    assert "\u00b7 date: 2026-11-30" in readme and "caf\u00e9" in readme


def test_records_tools_name_the_encoding_of_every_text_file():
    """open(), read_text(), write_text() and os.fdopen() in text mode pass encoding= (the locale's is not UTF-8
    everywhere)."""
    unnamed = []
    for path in sorted((REPO / "records").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in ("open", "read_text", "write_text", "fdopen"):
                continue
            modes = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            modes += [k.value.value for k in node.keywords if k.arg == "mode" and isinstance(k.value, ast.Constant)]
            if not any("b" in m for m in modes) and not any(k.arg == "encoding" for k in node.keywords):
                unnamed.append(f"{path.name}:{node.lineno}")
    assert unnamed == []


# ----------------------------------------------------------------------------- reproduce


def test_reproduce_recreates_identical_sources_and_config(tmp_path, capsys):
    log_path = write_log(tmp_path / "r1.txt", 3.25, 5000, world_size=8)
    out = tmp_path / "out"
    assert reproduce.main([log_path, "--dir", str(out)]) == 0
    for relpath, content in SOURCES.items():
        assert sha256((out / relpath).read_bytes()) == sha256(content)
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted([*SOURCES, "config.json"])
    assert json.loads((out / "config.json").read_text()) == parse_log(log_path).config
    printed = capsys.readouterr().out
    assert f"-m torch.distributed.run --standalone --nproc_per_node=8 {out / 'train_gpt.py'} --config" in printed
    assert reproduce.main([log_path, "--dir", str(out)]) == 2
    assert "not an empty folder" in capsys.readouterr().err


def test_reproduce_refuses_a_tampered_log(tmp_path, capsys):
    path = Path(write_log(tmp_path / "r1.txt", 3.25, 5000))
    path.write_bytes(path.read_bytes().replace(b"def train():", b"def trair():", 1))
    assert reproduce.main([str(path), "--dir", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


def test_reproduce_copies_the_data_files_its_sources_pin(tmp_path, capsys):
    """A run of train_gpt.py reads data/gpt2_prefix_tokens.bin (and the pairs file) next to the log's
    data/tokenizer.py: the recreated tree gets this checkout's copies, checked against the sha256 the
    log's tokenizer.py pins."""
    tokenizer = (REPO / "data" / "tokenizer.py").read_bytes()
    log_path = write_log(tmp_path / "r1.txt", 3.25, 5000, sources={**SOURCES, "data/tokenizer.py": tokenizer})
    shipped = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "data").glob("*.bin"))
    assert sorted(reproduce.pinned_data_files(parse_log(log_path))) == shipped
    assert reproduce.main([log_path, "--dir", str(tmp_path / "out")]) == 0
    for relpath in shipped:
        assert (tmp_path / "out" / relpath).read_bytes() == (REPO / relpath).read_bytes()
    assert f"{len(shipped)} data file(s) they read" in capsys.readouterr().out

    pin = reproduce.pinned_data_files(parse_log(log_path))["data/gpt2_prefix_tokens.bin"].encode()
    other = write_log(tmp_path / "r2.txt", 3.25, 5000, sources={**SOURCES, "data/tokenizer.py":
                                                                tokenizer.replace(pin, b"0" * 64)})
    assert reproduce.main([other, "--dir", str(tmp_path / "out2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gpt2_prefix_tokens.bin: sha256 is " in err and f"pin {'0' * 64}" in err
    assert not (tmp_path / "out2").exists()


def test_reproduce_run_refuses_other_data_than_the_logs(tmp_path, monkeypatch, capfd):
    """--run compares the files the rerun would read with the log's fingerprints first."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d").mkdir()
    write_shard(tmp_path / "d" / "x_val_000000.bin", range(100))
    write_shard(tmp_path / "d" / "x_train_000000.bin", range(300))
    fingerprints = [fingerprint(f"d/x_{name}_000000.bin") for name in ("val", "train")]
    sources = {**SOURCES, "train_gpt.py": b"open('ran', 'w').close()\n"}
    log_path = write_log(tmp_path / "r1.txt", 3.25, 5000, sources=sources, data=fingerprints,
                         config_changes={"val_files": "d/x_val_*.bin", "train_files": "d/x_train_*.bin"})

    def rerun(*args):
        code = reproduce.main([log_path, "--dir", str(tmp_path / "out"), "--run", *args])
        ran = (tmp_path / "ran").exists()
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        (tmp_path / "ran").unlink(missing_ok=True)
        return code, ran, capfd.readouterr().err

    assert rerun()[:2] == (0, True)
    write_shard(tmp_path / "d" / "x_train_000000.bin", range(1, 301))
    code, ran, err = rerun()
    assert (code, ran) == (2, False) and err.count("\n") == 1
    assert "d/x_train_000000.bin is not the file the run read (its head_sha256, tail_sha256 differ" in err
    assert rerun("--other-data")[:2] == (0, True)
    write_shard(tmp_path / "d" / "x_train_000000.bin", range(300))
    write_shard(tmp_path / "d" / "x_train_000001.bin", range(300))
    assert "d/x_train_000001.bin matches the rerun's train_files (d/x_train_*.bin), but the run did not" in rerun()[2]
    (tmp_path / "d" / "x_train_000001.bin").unlink()
    assert "the run read d/x_val_000000.bin, which is not matched by the rerun's patterns" in \
        rerun("--", "--val_files=d/x_train_*.bin")[2]
    (tmp_path / "d" / "x_val_000000.bin").unlink()
    assert "the run read d/x_val_000000.bin, which is missing in" in rerun()[2]


# ----------------------------------------------------------------------------- the CPU baseline script


def write_shard(path, tokens):
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, 1, len(tokens)
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


def test_baseline_script_writes_a_valid_log_and_reproduces(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("t_train_000000.bin", 3000), ("t_train_000001.bin", 3000), ("t_val_000000.bin", 600)):
        write_shard(tmp_path / name, rng.integers(0, 50257, n))
    # One thread: two threads spin-waiting on a busy 2-core machine make even a tiny step slow.
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=4", "--num_iterations=3"]
    tiny += ["--threads=1"]
    tiny += ["--val_tokens=256", "--val_every=2", "--warmup_iters=1", f"--log_dir={tmp_path / 'logs'}"]
    tiny += [f"--train_files={tmp_path / 't_train_*.bin'}", f"--val_files={tmp_path / 't_val_000000.bin'}"]
    script = REPO / "records" / "track_cpu" / "baseline_adamw.py"
    subprocess.run([sys.executable, str(script), *tiny], check=True, capture_output=True, cwd=tmp_path, timeout=300)
    (log_path,) = (tmp_path / "logs").iterdir()
    log = parse_log(log_path)
    verify(log)
    assert log.finished and log.final["steps"] == 3 and len(log.steps) == 3
    assert [step for step, _, _ in log.val_points] == [2, 3]
    assert log.val_points[-1][1] == log.final["val_loss"]
    assert log.config["track"] == "track_cpu" and log.config["preset"] == "baseline_adamw"
    assert log.config["entry"] == "records/track_cpu/baseline_adamw.py"
    for relpath in ("records/track_cpu/baseline_adamw.py", "data/shards.py"):
        assert log.sources[relpath] == (REPO / relpath).read_bytes()
    assert len(log.data) == 3 and log.data[0]["tokens"] == 3000

    out = tmp_path / "again"
    done = subprocess.run(
        [sys.executable, str(REPO / "records" / "reproduce.py"), str(log_path), "--dir", str(out), "--run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (rerun_path,) = set((tmp_path / "logs").iterdir()) - {log_path}
    rerun = parse_log(rerun_path)
    assert rerun.code_id == log.code_id and rerun.config == log.config
    assert rerun.final["val_loss"] == log.final["val_loss"]
