"""Tests of the records tools: log writing, parsing, sealing and verification, make_record,
reproduce, and the CPU baseline script.

Logs are written by write_log below, an independent writer of the version-2 format
(records/FORMAT.md): its own seal computation, and small fake sources chosen to trip a parser
that scans for markers instead of counting bytes.
"""

import ast
import atexit
import dataclasses
import errno
import hashlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from data.shards import fingerprint  # noqa: E402
from records import checked_records, make_record, readme_tables, record_writer, reproduce, rules, significance  # noqa: E402
import records.logfile  # noqa: E402
from records.logfile import LogError, LogWriteError, LogWriter, commit_of_sources, parse_log, verify  # noqa: E402

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
NEW_SOURCES = {**SOURCES, "data/shards.py": b"# faster\n"}  # another program than SOURCES
SHARD_MAGIC = 20240520
SHARD_HEADER_INTS = 256
CPU, HOSTNAME = "Test CPU 9000", "testhost"
MACHINE = {"cpu_count": "2", "cpu_flags": "f" * 16, "machine_id": "1" * 16}  # what tells machines of one name apart
STARTED = "2026-11-01T10:00:00+00:00"  # before every --date the tests give


def sha256(data):
    return hashlib.sha256(data).hexdigest()


CHECKOUT_COMMITS = {}              # (sources, message) -> the commit of the tests' checkout holding them


def records_checkout():
    """A git repository (made on first use, removed at exit) with a commit of each set of sources the
    tests' logs embed: the checkout that a site's logs name their commits in (use_test_checkout)."""
    if "repo" not in CHECKOUT_COMMITS:
        repo = Path(tempfile.mkdtemp(prefix="records_checkout_"))
        atexit.register(shutil.rmtree, repo, True)
        subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
        CHECKOUT_COMMITS["repo"] = repo
    return CHECKOUT_COMMITS["repo"]



def checkout_commit(sources, message="the sources"):
    """The commit of the tests' checkout whose files are `sources` {relpath: bytes}, as a clone at it
    has them; another `message`, another commit of the same files."""
    key = (tuple(sorted(sources.items())), message)
    if key not in CHECKOUT_COMMITS:
        repo, ref = records_checkout(), f"refs/heads/c{len(CHECKOUT_COMMITS)}"
        stream = bytearray(f"commit {ref}\ncommitter T <t@example.com> 1700000000 +0000\n".encode())
        stream += b"data %d\n%s\n" % (len(message.encode()), message.encode())
        for relpath, content in sorted(sources.items()):
            stream += b"M 100644 inline %s\ndata %d\n%s\n" % (relpath.encode(), len(content), content)
        subprocess.run(["git", "-C", str(repo), "fast-import", "--quiet"], input=bytes(stream), check=True, timeout=60)
        CHECKOUT_COMMITS[key] = subprocess.run(["git", "-C", str(repo), "rev-parse", ref], capture_output=True,
                                               text=True, check=True, timeout=60).stdout.strip()
    return CHECKOUT_COMMITS[key]


def use_test_checkout(folder):
    """Make `folder` (a site's root, where its README lies) a checkout of the tests' repository."""
    (folder / ".git").write_text(f"gitdir: {records_checkout() / '.git'}\n")
    return folder


GIT_COMMIT = checkout_commit(SOURCES)
ANOTHER_COMMIT = checkout_commit(SOURCES, "the same files again")  # a second commit of the same sources


def sealed(prefix, lines):
    """The documented seal: d_0 = sha256(prefix), d_i = sha256(d_{i-1} + line_i), 16 hex digits."""
    digest, out = hashlib.sha256(prefix).digest(), []
    for line in lines:
        digest = hashlib.sha256(digest + line.encode("utf-8")).digest()
        out.append(f"{line} #{digest.hex()[:16]}")
    return out


def write_log(path, final_loss, train_ms, sources=SOURCES, track=TRACK, ending="final", world_size=1, gpu="none",
              seed=0, config_changes=None, val_data=VAL_DATA, version=2, cpu=CPU, hostname=HOSTNAME,
              git_commit=None, data=None, total_steps=TOTAL_STEPS, started=STARTED, machine=None,
              run_id=None, lines=()):
    """Write a log of a fake run of total_steps (4) steps ending at (final_loss, train_ms); return its path.
    ending: "final", "error" or "interrupted"; data: the data section's fingerprints (default: val_data
    and TRAIN_DATA); machine: the environment's MACHINE values changed; run_id: default the file's stem;
    git_commit: default the commit of `sources` in the tests' checkout; lines: more run lines before the last."""
    run_id = run_id or Path(path).stem
    git_commit = git_commit or checkout_commit(sources)
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
        "started": started,
        **MACHINE,
        **(machine or {}),
    }
    config = {"preset": "cpu", "track": track, "num_iterations": total_steps, "seed": seed}
    config |= {"val_tokens": VAL_TOKENS, "val_files": "data/x_val_*.bin", "train_files": "data/x_train_*.bin",
               "entry": "train_gpt.py"}
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
        if step % 2 == 0 or step == total_steps:
            val = final_loss + 0.5 * (total_steps - step)
            text.append(f"step:{step}/{total_steps} val_loss:{val:.4f} {timing}")
    text.append("an informational line")
    text += lines
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
    track |= {"hardware": "test", "description": "test track", "val_tokens": VAL_TOKENS, "val_data": [VAL_DATA],
              "train_data": [TRAIN_DATA]}
    (track_dir / "track.json").write_text(json.dumps(track))
    use_test_checkout(tmp_path)
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


def git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


@pytest.fixture
def small_repo(tmp_path):
    """A git repository with one commit of a.py and data/b.py; (its folder, that commit)."""
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "a.py").write_bytes(b"print('a')\n")
    (repo / "data" / "b.py").write_bytes(b"B = 2\n")
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    return repo, git(repo, "rev-parse", "HEAD")


def test_a_commit_is_marked_dirty_when_the_sources_are_not_its_files(small_repo):
    repo, head = small_repo
    committed = [("a.py", b"print('a')\n"), ("data/b.py", b"B = 2\n")]
    assert commit_of_sources(head, committed, repo) == head
    assert commit_of_sources(head, [("a.py", b"print('b')\n")], repo) == head + "-dirty"
    assert commit_of_sources(head, committed + [("c.py", b"new\n")], repo) == head + "-dirty", "not committed"
    assert commit_of_sources("none", [("a.py", b"x")], repo) == "none"


def test_the_writer_logs_the_machine_and_marks_a_dirty_tree(small_repo, tmp_path, monkeypatch):
    """header() adds machine_id and cpu_flags (kept where given) and marks git_commit when the run's
    sources differ from that commit's files: what both trainers log, without either computing it."""
    repo, head = small_repo
    monkeypatch.setattr(records.logfile, "REPO_DIR", str(repo))
    (tmp_path / "machine-id").write_bytes(b"0123abcd\n")
    monkeypatch.setattr(records.logfile, "MACHINE_ID_FILES", (str(tmp_path / "missing"), str(tmp_path / "machine-id")))
    machine_id = hashlib.sha256(b"speedrun-log machine id\n0123abcd").hexdigest()[:16]
    for name, sources in (("clean", [("a.py", b"print('a')\n")]), ("dirty", [("a.py", b"print('edited')\n")])):
        writer = LogWriter(tmp_path / f"{name}.txt", name)
        writer.header(iter(sources), {"git_commit": head, "started": STARTED, "cpu_flags": "given"}, [],
                      {"entry": "a.py"})
        writer.close()
        environment = parse_log(tmp_path / f"{name}.txt").environment
        assert environment["git_commit"] == head + ("-dirty" if name == "dirty" else "")
        assert environment["cpu_flags"] == "given" and environment["machine_id"] == machine_id


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
    t, p = significance.one_sample_test([3.0, 3.1, 3.2], 3.3)
    t_hand = -2 * math.sqrt(3)
    assert t == pytest.approx(t_hand, rel=1e-9)
    assert p == pytest.approx(0.5 + t_hand / (2 * math.sqrt(2 + t_hand**2)), rel=1e-9)
    assert significance.val_loss_summary([3.0, 3.1, 3.2])["std"] == pytest.approx(0.1, rel=1e-9)


def test_statistics_are_undefined_without_spread():
    assert significance.one_sample_test([3.0], 3.3) == (None, None)
    assert significance.one_sample_test([3.0, 3.0, 3.0], 3.3) == (None, None)
    assert significance.welch_test([3.0, 3.1], [3.2]) is None
    assert significance.welch_test([3.0, 3.0], [3.2, 3.2]) is None


def test_a_welch_test_with_one_group_without_spread_is_defined():
    """Baseline runs that all took the same time still give a test when the record's runs spread."""
    record, baseline = [3000.0, 3100.0, 2900.0], [5000.0, 5000.0, 5000.0]
    # Welch with one variance 0: t = (3000 - 5000) / sqrt(100^2 / 3), on n - 1 = 2 degrees of freedom.
    t = -2000 / math.sqrt(100.0 ** 2 / 3)
    result = significance.welch_test(record, baseline)
    assert result["t"] == pytest.approx(t, rel=1e-9)
    assert result["p"] == pytest.approx(stats.t.cdf(t, 2), rel=1e-9)


# ----------------------------------------------------------------------------- make_record


def test_record_folder_statistics_plot_and_readme_table(site, capsys):
    losses, times = [3.40, 3.42, 3.41], [5000, 5600, 5300]
    logs = write_logs(site / "logs", losses, times)
    description = ["--description", "did a thing", "--changed", "a thing", "--author", "Ada L."]
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
    assert (f"- machine: CPU `{CPU}`, hostname `{HOSTNAME}`, 2 cores, CPU flags `{MACHINE['cpu_flags']}`, machine id "
            f"`{MACHINE['machine_id']}` (every run)") in (folder / "README.md").read_text()
    assert f"- commit: `{GIT_COMMIT}` (every run)" in (folder / "README.md").read_text()
    assert "status: record · author: Ada L." in (folder / "README.md").read_text()
    assert "In short: a thing." in (folder / "README.md").read_text()
    assert s["runs"][0] | {"cpu": CPU, "hostname": HOSTNAME, "git_commit": GIT_COMMIT, **MACHINE,
                           "started": STARTED} == s["runs"][0]
    assert s["mixed_machines_reason"] is None and s["mixed_commits_reason"] is None
    assert (s["author"], s["changed"], s["current_record"]) == ("Ada L.", "a thing", None)
    assert "status           record" in (folder / "statistics.txt").read_text()
    assert (folder / "val_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    readme = (site / "README.md").read_text()
    assert readme.startswith("# Title\n\nintro\n\n<!-- records:track_test:start -->\n|")
    assert readme.endswith("|\n<!-- records:track_test:end -->\n\nafter\n")
    assert "stale table" not in readme
    assert readme.count("\n| 1 | ") == 1 and "| [Faster](records/track_test/2026-11-30_Faster) | a thing | Test 9000 " \
        "| 3.4100 | 0.002 | 5.3 s | 3 | 1.00x |" in readme


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
    assert_refused(site, capsys, "ontrain.txt: the run read data/x_train_000001.bin as train data and as val data",
                   "--logs", *logs)
    logs[2] = write_log(site / "logs" / "short.txt", 3.41, 5300, config_changes={"val_tokens": 256})
    assert_refused(site, capsys, "short.txt: the run validated on val_tokens=256, the track evaluates on 512",
                   "--logs", *logs)


def test_different_configs_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "other.txt", 3.41, 5300, seed=2, total_steps=5))
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
    assert "differ in train_gpt.py" in rules.describe_code_difference(parse_log(logs[0]), parse_log(logs[2]))


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
    logs[2] = write_log(site / "logs" / "h200.txt", 3.41, 5300, world_size=8, gpu=h100s, seed=2)
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
    assert_refused(site, capsys, "baseline logs are referenced, not copied, so they must be runs of a record of this "
                   "track", "--logs", *logs, "--baseline-logs", *base)
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
    more = write_logs(site / "more", losses, [t - 1000 for t in times], prefix="more", sources=NEW_SOURCES)
    assert run_tool(site, "--name", "Z2", "--date", "2026-11-30", "--logs", *more, "--baseline-logs", base_folder) == 0
    again = json.loads((folder.parent / "2026-11-30_Z2" / "statistics.json").read_text())["baseline"]
    assert again["runs"] == json.loads((base_folder / "statistics.json").read_text())["runs"]


def define_baseline(site, sources=OTHER_SOURCES):
    """The site's track gets a baseline script: train_gpt.py in the version of `sources`, with the
    config write_log gives it (the interleaved rule: every record beats baseline runs of its series)."""
    track_json = site / "records" / TRACK / "track.json"
    config = {k: v for k, v in parse_log(write_log(site / "probe.txt", 3.5, 1)).config.items() if k != "seed"}
    baseline = {"entry": "train_gpt.py", "code": [{p: sha256(c) for p, c in sorted(sources.items())}], "config": config}
    track_json.write_text(json.dumps(json.loads(track_json.read_text()) | {"baseline": baseline}))
    (site / "probe.txt").unlink()


def remeasured_baseline(site, name, times, hostname, date="2026-11-20"):
    """A record folder of baseline runs (--remeasured-baseline) on the machine `hostname`."""
    base = write_logs(site / name, [3.43, 3.44, 3.40], times, prefix=name.lower(), sources=OTHER_SOURCES,
                      hostname=hostname)
    assert run_tool(site, "--name", name, "--date", date, "--remeasured-baseline", "--logs", *base) == 0
    return site / "records" / TRACK / f"{date}_{name}"


def test_on_an_interleaved_track_a_record_beats_the_current_one_in_its_own_series(site, capsys):
    """A track with a baseline script (track_cpu's rule): each record beats its own series' baseline
    runs, and from the second record on the current record re-run in the same series, significantly,
    with a larger speed-up than the current record's; the table ranks by that ratio and never divides
    times from two machines."""
    define_baseline(site)
    base_a = remeasured_baseline(site, "BaseA", [9000, 9500, 8800], "a")
    s = json.loads((base_a / "statistics.json").read_text())
    assert s["status"] == "baseline", "a baseline below the target is still the baseline, not a record"
    assert "BaseA" not in (site / "README.md").read_text()
    first = write_logs(site / "first", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="first", hostname="a")
    assert_refused(site, capsys, "not a record: no baseline runs: a record of this track states its speed-up over "
                   "baseline runs interleaved", "--logs", *first)
    assert run_tool(site, "--name", "First", "--date", "2026-11-21", "--logs", *first, "--baseline-logs", base_a) == 0

    base_b = remeasured_baseline(site, "BaseB", [6000, 6100, 5900], "b", date="2026-11-22")
    new = write_logs(site / "new", [3.40, 3.42, 3.41], [3000, 3100, 2900], prefix="new", hostname="b",
                     sources=SOURCES | {"data/shards.py": b"# faster\n"})
    assert_refused(site, capsys, "not a record: no re-runs of the current record 2026-11-21_First",
                   "--logs", *new, "--baseline-logs", base_b)
    close = write_logs(site / "close", [3.40, 3.42, 3.41], [3050, 3150, 2850], prefix="close", hostname="b")
    assert_refused(site, capsys, "not a record: not significantly faster than the current record 2026-11-21_First "
                   "run in the same series (3.0 s against 3.0 s, Welch p = ", "--logs", *new, "--baseline-logs",
                   base_b, "--current-record-logs", *close)
    lower_ratio = write_logs(site / "lower", [3.40, 3.42, 3.41], [3600, 3700, 3500], prefix="lower", hostname="b",
                             sources=SOURCES | {"data/shards.py": b"# faster\n"})
    slower_reruns = write_logs(site / "slowreruns", [3.40, 3.42, 3.41], [4000, 4100, 3900], prefix="sr", hostname="b")
    assert_refused(site, capsys, f"not a record: its speed-up over its baseline runs, {6000 / 3600:.2f}x, is not above "
                   f"the current record 2026-11-21_First's {9100 / 5300:.2f}x (the table ranks by that ratio)",
                   "--logs", *lower_ratio, "--baseline-logs", base_b, "--current-record-logs", *slower_reruns)
    other_code = write_logs(site / "othercode", [3.40, 3.42, 3.41], [3500] * 3, prefix="oc", hostname="b",
                            sources=OTHER_SOURCES)
    assert_refused(site, capsys, "--current-record-logs: ", "--logs", *new, "--baseline-logs", base_b,
                   "--current-record-logs", *other_code)
    reruns = write_logs(site / "reruns", [3.40, 3.42, 3.41], [3500, 3600, 3400], prefix="rerun", hostname="b")
    assert run_tool(site, "--name", "Here", "--date", "2026-11-23", "--logs", *new, "--baseline-logs", base_b,
                    "--current-record-logs", *reruns) == 0
    folder = site / "records" / TRACK / "2026-11-23_Here"
    s = json.loads((folder / "statistics.json").read_text())
    current = s["current_record"]
    assert (current["record"], current["speedup"]) == ("2026-11-21_First", pytest.approx(9100 / 5300, rel=1e-12))
    expected = stats.ttest_ind([3000, 3100, 2900], [3500, 3600, 3400], equal_var=False, alternative="less")
    assert current["reruns"]["welch_train_time"]["p"] == pytest.approx(expected.pvalue, rel=1e-12)
    assert current["reruns"]["speedup"] == pytest.approx(6000 / 3500, rel=1e-12)
    assert sorted(p.name for p in folder.glob("*.txt") if p.name != "statistics.txt") == sorted(
        Path(p).name for p in new + reruns), "the re-runs are kept with the record"
    readme = (folder / "README.md").read_text()
    assert "Re-runs of the current record 2026-11-21_First in this series (kept here)" in readme
    rows = [line for line in (site / "README.md").read_text().splitlines() if line.startswith(("| 1 ", "| 2 "))]
    assert "[Here]" in rows[0] and rows[0].endswith(f"| {6000 / 3000:.2f}x |")
    assert "[First]" in rows[1] and rows[1].endswith(f"| {9100 / 5300:.2f}x |")

    stats_path = folder / "statistics.json"        # its current record's speed-up lowered, every file made to agree
    s = json.loads(stats_path.read_text())
    s["current_record"]["speedup"] = 1.5
    stats_path.write_text(json.dumps(s, indent=2) + "\n")
    (folder / "statistics.txt").write_text(record_writer.statistics_text(s))
    (folder / "README.md").write_text(record_writer.readme_text(s, f"records/{TRACK}/{folder.name}", s["runs"][0]["log"]))
    argv = ["--track", TRACK, "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    assert make_record.main(argv + ["--tables"]) == 2
    assert "its current_record (2026-11-21_First) is not a record of the track with these values" in \
        capsys.readouterr().err


def test_a_record_slower_than_the_current_record_is_refused_with_its_numbers(site, capsys):
    """Fifteen times slower than the current record, following the submit steps literally (no
    baseline, on a track without a baseline script: compared by mean train time): refused with the
    statistics; --allow-non-record keeps it as "not a record", out of the table."""
    first = write_logs(site / "first", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="first")
    assert run_tool(site, "--name", "First", "--date", "2026-11-21", "--logs", *first) == 0
    slow = write_logs(site / "slow", [3.40, 3.42, 3.41], [75000, 80000, 85000], prefix="slow")
    assert_refused(site, capsys, "not a record: not faster than the current record 2026-11-21_First (80.0 s against "
                   "5.3 s) (n = 3, mean final val loss 3.4100 ± 0.0100 (sample std)", "--logs", *slow)
    assert run_tool(site, "--name", "Slow", "--date", "2026-11-22", "--allow-non-record", "--logs", *slow) == 0
    assert "[Slow]" not in (site / "README.md").read_text()


def test_a_record_slower_than_its_baseline_runs_is_refused(site, capsys):
    """On a track with a baseline script: no baseline runs, or a speed-up of 0.66x (Welch p near 1)
    over the series' baseline runs, is no record; the line says by how much and what the runs took."""
    define_baseline(site)
    base = remeasured_baseline(site, "Base", [52000, 53000, 54000], HOSTNAME)
    slow = write_logs(site / "slow", [3.40, 3.42, 3.41], [75000, 80000, 85000], prefix="slow")
    assert_refused(site, capsys, "not a record: no baseline runs", "--logs", *slow)
    assert_refused(site, capsys, "not a record: not significantly faster than its baseline runs (speed-up 0.66x, "
                   "Welch p = 0.995, not below 0.01)", "--logs", *slow, "--baseline-logs", base)
    assert_refused(site, capsys, "its baseline runs: 53.0 s (n = 3)", "--logs", *slow, "--baseline-logs", base)


def test_a_refusal_for_too_little_evidence_says_how_many_runs_would_do(site, capsys):
    """p just above the threshold: the line gives n, the mean and its spread, and the runs that this
    mean and spread would need (checked against scipy's t distribution here)."""
    losses = [3.40, 3.47, 3.44]
    logs = write_logs(site / "logs", losses, [5000, 5600, 5300])
    mean, std = np.mean(losses), np.std(losses, ddof=1)
    needed = next(n for n in range(2, 100) if stats.t.cdf((mean - TARGET) / (std / math.sqrt(n)), n - 1) < 0.01)
    assert needed > 3
    assert_refused(site, capsys, f"(n = 3, mean final val loss {mean:.4f} ± {std:.4f} (sample std); target 3.5000; "
                   f"p = ", "--logs", *logs)
    assert_refused(site, capsys, f"about {needed} runs would give p < 0.01: run more seeds", "--logs", *logs)
    assert significance.runs_needed([3.6, 3.5, 3.7], TARGET, 0.01) is None, "a mean above the target: no number helps"


def sample_with(mean, std, n):
    """n values with exactly this mean and sample std (deviations +-d around the mean, one 0 when n is odd)."""
    half = n // 2
    d = std * math.sqrt((n - 1) / (2 * half))
    return [mean + d] * half + [mean - d] * half + [mean] * (n % 2)


def test_runs_needed_is_the_fewest_runs_scipy_finds_significant():
    """Against scipy's one-sample t-test of samples with the same mean and spread, n runs each."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        values = list(3.45 + 0.03 * rng.standard_normal(3))
        needed = significance.runs_needed(values, TARGET, 0.01)
        if needed is None:
            continue

        def p_at(n):
            sample = sample_with(np.mean(values), np.std(values, ddof=1), n)
            return stats.ttest_1samp(sample, TARGET, alternative="less").pvalue
        assert p_at(needed) < 0.01 and (needed == 2 or p_at(needed - 1) >= 0.01), (values, needed)


def test_welch_runs_needed_against_scipy():
    """The fewest runs per group that scipy's Welch test (on summaries: n runs each, these means and
    spreads) finds significant, for groups of unequal spread (where Welch's degrees of freedom matter)."""
    rng = np.random.default_rng(1)
    for _ in range(30):
        a = list(3000 + rng.uniform(50, 400) * rng.standard_normal(3))
        b = list(3300 + rng.uniform(1, 50) * rng.standard_normal(3))
        n = significance.welch_runs_needed(a, b, 0.01)
        if n is None:
            continue

        def p_at(k):
            return stats.ttest_ind_from_stats(np.mean(a), np.std(a, ddof=1), k, np.mean(b), np.std(b, ddof=1), k,
                                              equal_var=False, alternative="less").pvalue
        assert p_at(n) < 0.01 and (n == 2 or p_at(n - 1) >= 0.01), (a, b, n)
    assert significance.welch_runs_needed([3300.0, 3400.0], [3000.0, 3100.0], 0.01) is None


def test_a_refused_result_kept_as_not_a_record_gives_its_runs_to_a_later_record(site, capsys):
    """Three seeds refused, kept with --allow-non-record; two more seeds and all five make the record,
    which replaces the folder that held three of them. Only all of its runs, and never a folder
    another record uses as its baseline."""
    losses, times = [3.40, 3.47, 3.44, 3.42, 3.41], [5000, 5600, 5300, 5100, 5200]
    logs = write_logs(site / "logs", losses, times)
    assert run_tool(site, "--name", "Try", "--date", "2026-11-21", "--allow-non-record", "--logs", *logs[:3]) == 0
    kept = site / "records" / TRACK / "2026-11-21_Try"
    assert json.loads((kept / "statistics.json").read_text())["status"] == "not a record"
    assert_refused(site, capsys, f"run run0 is part of {kept} (not a record), with run2: give all of its runs",
                   "--logs", logs[0], logs[1], *logs[3:])
    assert run_tool(site, "--name", "Five", "--date", "2026-11-22", "--logs", *logs) == 0
    assert not kept.exists() and "replaced" in capsys.readouterr().out
    assert json.loads((site / "records" / TRACK / "2026-11-22_Five" / "statistics.json").read_text())["n"] == 5

    base = write_logs(site / "base", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="base", sources=OTHER_SOURCES)
    assert run_tool(site, "--name", "Base", "--date", "2026-11-23", "--allow-non-record", "--logs", *base) == 0
    base_folder = site / "records" / TRACK / "2026-11-23_Base"
    faster = write_logs(site / "faster", [3.40, 3.42, 3.41], [4000, 4100, 3900], prefix="faster", sources=NEW_SOURCES)
    assert run_tool(site, "--name", "Faster", "--date", "2026-11-24", "--logs", *faster, "--baseline-logs",
                    base_folder) == 0
    assert_refused(site, capsys, "which the record 2026-11-24_Faster uses as its baseline", "--allow-non-record",
                   "--logs", *base)


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
    base = write_logs(site / "base", base_losses, [9000, 9500, 8800], prefix="base", sources=OTHER_SOURCES)
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


def test_runs_that_trained_on_the_val_shard_are_refused(site, capsys):
    """The train data is the track's too (by size and content hashes), not only the val data."""
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "onval.txt", 3.41, 5300, data=[VAL_DATA],
                          config_changes={"train_files": "data/x_val_*.bin"}))
    assert_refused(site, capsys, "onval.txt: the run read data/x_val_000000.bin as train data and as val data",
                   "--logs", *logs)
    logs[2] = write_log(site / "logs" / "other.txt", 3.41, 5300, data=[VAL_DATA, TRAIN_DATA | {"tokens": 511}])
    assert_refused(site, capsys, "other.txt: the run's train data (data/x_train_000001.bin) is not the track's",
                   "--logs", *logs)


def test_baseline_logs_are_runs_of_a_record_of_this_track(site, capsys):
    """Baseline logs in a folder that is not a record of this track (another track's record, a
    folder inside a track folder, or beside a record's logs without being listed) are refused."""
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    other_track = site / "records" / "track_other"
    other_track.mkdir()
    (other_track / "track.json").write_text((site / "records" / TRACK / "track.json").read_text().replace(
        TRACK, "track_other"))
    base = write_logs(site / "base", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="base", sources=OTHER_SOURCES,
                      track="track_other")
    argv = ["--track", "track_other", "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    assert make_record.main(argv + ["--name", "B", "--date", "2026-11-29", "--allow-non-record", "--logs", *base]) == 0
    capsys.readouterr()
    elsewhere = other_track / "2026-11-29_B"
    assert_refused(site, capsys, "must be runs of a record of this track", "--logs", *logs, "--baseline-logs",
                   elsewhere)
    nested = site / "records" / TRACK / "version1" / "2026-11-01_Old"
    nested.mkdir(parents=True)
    for path in base:
        shutil.copy(path, nested)
    assert_refused(site, capsys, "must be runs of a record of this track", "--logs", *logs, "--baseline-logs",
                   *sorted(map(str, nested.glob("*.txt"))))


def test_the_baseline_is_the_tracks_baseline_script_with_its_config(site, capsys):
    """On a track that names its baseline script: --remeasured-baseline and --baseline-logs take runs of
    that script, in a version track.json lists, with its config; other code or another config is
    refused (a baseline made slow on purpose would make any record look fast)."""
    define_baseline(site)
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    record_code = write_logs(site / "rc", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="rc")
    assert_refused(site, capsys, "rc0.txt: its train_gpt.py has sha256 " + sha256(SOURCES["train_gpt.py"]) +
                   ", which is not in a version of the track's baseline", "--remeasured-baseline",
                   "--logs", *record_code)
    longer = write_logs(site / "longer", [3.43, 3.44, 3.40], [90000, 95000, 88000], prefix="longer",
                        sources=OTHER_SOURCES, total_steps=40)
    assert_refused(site, capsys, "longer0.txt: the baseline run changes num_iterations of the baseline's config",
                   "--remeasured-baseline", "--logs", *longer)
    other_entry = write_logs(site / "entry", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="entry",
                             sources=OTHER_SOURCES | {"baseline.py": b"x = 1\n"},
                             config_changes={"entry": "baseline.py"})
    assert_refused(site, capsys, "entry0.txt: runs baseline.py, not the track's baseline script train_gpt.py",
                   "--remeasured-baseline", "--logs", *other_entry)
    base = remeasured_baseline(site, "Base", [9000, 9500, 8800], HOSTNAME)
    assert run_tool(site, "--name", "R", "--date", "2026-11-30", "--logs", *logs, "--baseline-logs", base) == 0
    no_definition = site / "records" / TRACK / "track.json"
    no_definition.write_text(json.dumps({k: v for k, v in json.loads(no_definition.read_text()).items()
                                         if k != "baseline"}))
    assert_refused(site, capsys, "defines no baseline script", "--remeasured-baseline", "--logs", *record_code)


def test_a_record_folder_copied_under_a_new_name_is_refused(site, capsys):
    """Its statistics renamed to match: the same runs in two records."""
    first = make_first_record(site)
    copy = first.parent / "2026-11-30_Copy"
    shutil.copytree(first, copy)
    s = json.loads((copy / "statistics.json").read_text())
    (copy / "statistics.json").write_text(json.dumps(s | {"name": "Copy"}, indent=2) + "\n")
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [4000, 4600, 4300])
    assert_refused(site, capsys, f"run first0 is part of two records, {copy} and {first}: a run counts once",
                   "--logs", *logs)


@pytest.mark.parametrize("name, change, message", [
    ("README.md", lambda t: t.replace("5.3", "1.3"), "README.md: is not what make_record.py writes"),
    ("statistics.txt", lambda t: t + "note\n", "statistics.txt: is not what make_record.py writes"),
    ("val_loss.png", lambda t: "not a picture", "val_loss.png: is not the 800x500 PNG make_record.py draws"),
    ("notes.md", lambda t: "extra", "but the folder holds first0.txt, first1.txt, first2.txt, notes.md beside"),
])
def test_every_file_of_another_record_is_what_the_tool_writes(site, capsys, name, change, message):
    first = make_first_record(site)
    path = first / name
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
    path.write_text(change(text), encoding="utf-8")
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [4000, 4600, 4300])
    assert_refused(site, capsys, message, "--logs", *logs)


@pytest.mark.parametrize("made, message", [
    (12345, "made is 12345, not a time with its offset"),
    ("yesterday", 'made is "yesterday", not a time with its offset'),
    ("2026-10-01T10:00:00+00:00", "made 2026-10-01T10:00:00+00:00 is before its last run started"),
])
def test_another_records_made_is_checked(site, capsys, made, message):
    """A made that is no time is one line (not a traceback), and a record is not made before its runs
    started (the order of records comes from their runs' start times, not from made)."""
    first = make_first_record(site)
    s = json.loads((first / "statistics.json").read_text())
    (first / "statistics.json").write_text(json.dumps(s | {"made": made}, indent=2) + "\n")
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [4000, 4600, 4300])
    before = snapshot(site)
    assert run_tool(site, "--name", "X", "--logs", *logs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "statistics.json" in err and message in err, err
    assert snapshot(site) == before


def test_the_date_is_checked_against_the_runs(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300], started="2026-11-30T23:30:00-05:00")
    assert_refused(site, capsys, "--date 2026-11-29 is before the run run0 started (2026-11-30)", "--date",
                   "2026-11-29", "--logs", *logs)
    assert_refused(site, capsys, "--date 2999-01-01 is in the future", "--date", "2999-01-01", "--logs", *logs)
    no_start = write_logs(site / "nostart", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="n", started="soon")
    assert_refused(site, capsys, "n0.txt: its environment has no start time", "--date", "2026-12-01", "--logs",
                   *no_start)
    assert run_tool(site, "--name", "OnTheDay", "--date", "2026-11-30", "--logs", *logs) == 0


@pytest.mark.parametrize("name", ["run0.log", "run0", "run0.txt.bak", "a;touch pwned.txt", "$(id).txt", "r x.txt"])
def test_log_file_names_are_run_ids(site, capsys, name):
    """A log is <run id>.txt: other names would escape the folder's checks or break a command."""
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / name, 3.41, 5300, run_id="r2"))
    assert_refused(site, capsys, f"{name}: a log's file name is its run id and .txt", "--logs", *logs)


def test_a_log_named_after_another_run_is_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    logs.append(write_log(site / "logs" / "renamed.txt", 3.41, 5300, run_id="r2"))
    assert_refused(site, capsys, "renamed.txt: holds run r2, so its name is r2.txt", "--logs", *logs)


def test_the_reproduce_command_in_a_readme_is_quoted():
    """Every path written into a command is quoted for the shell (shlex round trip)."""
    s = {"format": 4, "name": "N", "track": "t", "date": "2026-11-30", "status": "record", "status_reason": "r",
         "author": None, "changed": None, "description": "", "runs": [], "code": {}, "baseline": None,
         "current_record": None, "mixed_machines_reason": None, "mixed_commits_reason": None}
    s |= {"target_val_loss": 3.5, "p_threshold": 0.01, "min_runs": 3, "n": 0, "t_statistic": None, "p_value": None,
          "val_loss": {"mean": 0.0, "std": None, "values": []}, "train_time_s": {k: 0.0 for k in ("mean", "median",
                                                                                                      "min", "max")}}
    text = record_writer.readme_text(s, "records/a b;c", "$(x).txt")
    line = next(line for line in text.splitlines() if line.startswith("python records/reproduce.py"))
    assert shlex.split(line) == ["python", "records/reproduce.py", "records/a b;c/$(x).txt", "--run"]


def test_a_log_from_a_tree_with_uncommitted_changes_is_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300], git_commit=GIT_COMMIT + "-dirty")
    assert_refused(site, capsys, f"run0.txt: ran from a tree with uncommitted changes (git_commit {GIT_COMMIT}-dirty): "
                   "commit the change", "--logs", *logs)


def test_the_records_lock_makes_a_second_writer_wait_and_then_give_up(site, capsys, monkeypatch):
    """While another make_record.py holds the lock (flock on the records root) this one waits, then
    ends with one line and writes nothing."""
    import fcntl
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    holder = os.open(site / "records", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    monkeypatch.setattr(make_record, "LOCK_WAIT_S", 0.3)
    try:
        assert_refused(site, capsys, "another make_record.py is writing", "--logs", *logs)
    finally:
        os.close(holder)
    assert run_tool(site, "--name", "Free", "--logs", *logs) == 0


def test_two_make_records_at_once_keep_both_rows(site):
    """Two processes on one track at the same time: both records, both rows, no run in two records."""
    firsts = write_logs(site / "a", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="a")
    seconds = write_logs(site / "b", [3.40, 3.42, 3.41], [5000, 5600, 5300], prefix="b")
    argv = [sys.executable, str(REPO / "records" / "make_record.py"), "--track", TRACK, "--records-dir",
            str(site / "records"), "--readme", str(site / "README.md"), "--allow-non-record", "--date", "2026-11-30"]
    processes = [subprocess.Popen(argv + ["--name", name, "--logs", *logs], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for name, logs in (("A", firsts), ("B", seconds))]
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs
    readme = (site / "README.md").read_text()
    assert readme.count("| [A](") + readme.count("| [B](") == 1, "one is the record, the other not faster"
    assert sorted(p.name for p in (site / "records" / TRACK).iterdir() if p.is_dir()) == [
        "2026-11-30_A", "2026-11-30_B"]


@pytest.mark.parametrize("flag, value", [("--changed", "a | b"), ("--changed", "x" * 61), ("--author", "two\nlines"),
                                         ("--author", " ")])
def test_short_texts_fit_a_table_cell(site, capsys, flag, value):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, f"{flag} ", flag, value, "--logs", *logs)


def test_a_track_name_is_a_folder_name(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    before = snapshot(site)
    code = make_record.main(["--track", "../records/track_test", "--records-dir", str(site / "records"),
                             "--readme", str(site / "README.md"), "--name", "X", "--logs", *logs])
    assert code == 2 and "is not a track folder name" in capsys.readouterr().err
    assert snapshot(site) == before


def test_a_fifo_given_as_a_log_is_refused_without_waiting(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    os.mkfifo(site / "logs" / "pipe.txt")
    assert_refused(site, capsys, "pipe.txt: cannot read the log (it is a FIFO (named pipe), not a regular file)",
                   "--logs", *logs, str(site / "logs" / "pipe.txt"))


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.replace(b"=== source data/shards.py", b"=== source data/sh\x00rds.py").replace(
        b"=== end source data/shards.py", b"=== end source data/sh\x00rds.py"), "is not a plain relative path"),
    (lambda raw: raw, "a data line is not a file's fingerprint (its path is None)"),
    (lambda raw: raw, "the config's entry is 5, not text"),
], ids=["NUL in a source path", "a data line without its path", "a non-string entry"])
def test_hostile_logs_end_with_one_line(site, capsys, edit, message):
    """Logs made (and sealed) to break a reader: one line from make_record.py and reproduce.py, nothing written."""
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    kwargs = {}
    if "data line" in message:
        kwargs["data"] = [VAL_DATA, {k: v for k, v in TRAIN_DATA.items() if k != "path"}]
    if "entry" in message:
        kwargs["config_changes"] = {"entry": 5}
    path = write_log(site / "logs" / "bad.txt", 3.41, 5300, **kwargs)
    Path(path).write_bytes(edit(Path(path).read_bytes()))
    assert_refused(site, capsys, message, "--logs", *logs, path)
    out = site / "out"
    assert reproduce.main([path, "--dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not out.exists()


def test_remake_rebuilds_a_record_with_the_same_numbers(site, capsys):
    """--remake rewrites a record's files in the current format from its own logs (with --changed and
    --author), keeping every number and its status; --tables rewrites the tables alone."""
    first = make_first_record(site)
    old = json.loads((first / "statistics.json").read_text())
    (site / "README.md").write_text((site / "README.md").read_text().replace("| [First]", "| [Stale]"))
    argv = ["--track", TRACK, "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    assert make_record.main(argv + ["--tables"]) == 0
    assert "| [First](" in (site / "README.md").read_text()
    assert make_record.main(argv + ["--remake", str(first), "--changed", "the first", "--author", "B. Liskov"]) == 0
    new = json.loads((first / "statistics.json").read_text())
    assert new == old | {"changed": "the first", "author": "B. Liskov"}
    assert "| [First](records/track_test/2026-11-30_First) | the first |" in (site / "README.md").read_text()
    assert make_record.main(argv + ["--remake", str(site / "logs")]) == 2
    assert "not a record folder of" in capsys.readouterr().err


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
    staged_file = record_writer.staged_file

    def full_disk(path, text):
        if path.name == "README.md":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return staged_file(path, text)

    monkeypatch.setattr(record_writer, "staged_file", full_disk)
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
    assert [p.name for p in site.iterdir() if p.name.startswith(".")] == [".git"], "the checkout's, no other"


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
    records = checked_records.checked_track_records(track_dir, track, REPO)
    assert len(records) >= 8
    assert readme_tables.with_table(REPO / "README.md", records, "track_cpu") == (REPO / "README.md").read_text()


@pytest.mark.parametrize("change, message", [
    ({"hostname": "otherhost"}, f"run0.txt ran on hostname '{HOSTNAME}', "),
    ({"cpu": "Other CPU"}, "run2.txt on cpu 'Other CPU': a record's runs and its baseline's run on one machine"),
    ({"git_commit": ANOTHER_COMMIT}, f"run2.txt at {ANOTHER_COMMIT}: a record's runs run at one commit"),
    ({"machine": {"machine_id": "2" * 16}}, f"run2.txt on machine_id '{'2' * 16}': a record's runs"),
    ({"machine": {"cpu_flags": "e" * 16}}, f"run2.txt on cpu_flags '{'e' * 16}': a record's runs"),
    ({"machine": {"cpu_count": "4"}}, "run2.txt on cpu_count '4': a record's runs"),
], ids=["hostname", "cpu", "commit", "machine id", "cpu flags", "core count"])
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
    more = write_logs(site / "more", [3.40, 3.42, 3.41], [4000, 4600, 4300], prefix="more", sources=NEW_SOURCES)
    assert run_tool(site, "--name", "Next", "--logs", *more) == 0, "the mixed record passes its check"


def test_a_reason_for_mixing_without_mixed_runs_refused(site, capsys):
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, f"--mixed-machines-reason is given, but every run ran on cpu '{CPU}'",
                   "--mixed-machines-reason", "x", "--logs", *logs)


def test_a_baseline_from_another_machine_refused(site, capsys):
    base = write_logs(site / "base", [3.43, 3.44, 3.40], [9000, 9500, 8800], prefix="base", hostname="elsewhere")
    assert run_tool(site, "--name", "Base", "--date", "2026-11-29", "--allow-non-record", "--logs", *base) == 0
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    assert_refused(site, capsys, "base0.txt on hostname 'elsewhere'", "--logs", *logs,
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
            low_level = isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == "os" \
                and name == "open"         # os.open: a file descriptor, bytes only
            if name not in ("open", "read_text", "write_text", "fdopen") or low_level:
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
    assert reproduce.main([log_path, "--dir", str(out)]) == 0, "this log's recreation is kept"
    assert f"found 2 source file(s) and config.json in {out}" in capsys.readouterr().out
    (out / "train_gpt.py").write_bytes(b"changed")
    assert reproduce.main([log_path, "--dir", str(out)]) == 2
    assert "exists and is neither empty nor this log's recreation" in capsys.readouterr().err


def test_reproduce_takes_a_record_folder_as_its_first_run(tmp_path, capsys):
    """A record's folder stands for the first of its own runs (statistics.json's), never a re-run of
    the record it beat that the folder also keeps (which sorts first there); a folder that is no
    record's is refused in one line."""
    folder = tmp_path / "2026-01-02_Second"
    folder.mkdir()
    rerun = write_log(folder / "20260102-100000-aaaaaaaa.txt", 3.30, 6000, config_changes={"seed": 7})
    own = write_log(folder / "20260102-100500-bbbbbbbb.txt", 3.25, 5000, world_size=8)
    (folder / "statistics.json").write_text(json.dumps({"runs": [{"log": os.path.basename(own)}]}))
    assert sorted(os.listdir(folder))[0] == os.path.basename(rerun)
    out = tmp_path / "out"
    assert reproduce.main([str(folder), "--dir", str(out)]) == 0
    assert json.loads((out / "config.json").read_text()) == parse_log(own).config != parse_log(rerun).config
    (folder / "statistics.json").unlink()
    assert reproduce.main([str(folder), "--dir", str(tmp_path / "other")]) == 2
    assert "is a folder but no record's" in capsys.readouterr().err


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
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "x_val_000000.bin", range(100))
    write_shard(tmp_path / "data" / "x_train_000000.bin", range(300))
    fingerprints = [fingerprint(f"data/x_{name}_000000.bin") for name in ("val", "train")]
    sources = {**SOURCES, "train_gpt.py": b"open('ran', 'w').close()\n"}
    log_path = write_log(tmp_path / "r1.txt", 3.25, 5000, sources=sources, data=fingerprints,
                         config_changes={"val_files": "data/x_val_*.bin", "train_files": "data/x_train_*.bin"})

    def rerun(*args):
        code = reproduce.main([log_path, "--dir", str(tmp_path / "out"), "--run", *args])
        ran = (tmp_path / "ran").exists()
        shutil.rmtree(tmp_path / "out", ignore_errors=True)
        (tmp_path / "ran").unlink(missing_ok=True)
        return code, ran, capfd.readouterr().err

    assert rerun()[:2] == (0, True)
    write_shard(tmp_path / "data" / "x_train_000000.bin", range(1, 301))
    code, ran, err = rerun()
    assert (code, ran) == (2, False) and err.count("\n") == 1
    assert "data/x_train_000000.bin is not the file the run read (its head_sha256, tail_sha256 differ" in err
    assert rerun("--other-data")[:2] == (0, True)
    write_shard(tmp_path / "data" / "x_train_000000.bin", range(300))
    write_shard(tmp_path / "data" / "x_train_000001.bin", range(300))
    assert "data/x_train_000001.bin matches the rerun's train_files (data/x_train_*.bin), but the run did not" in \
        rerun()[2]
    (tmp_path / "data" / "x_train_000001.bin").unlink()
    assert "the run read data/x_val_000000.bin, which is not matched by the rerun's patterns" in \
        rerun("--", "--val_files=data/x_train_*.bin")[2]
    (tmp_path / "data" / "x_val_000000.bin").unlink()
    assert "the run read data/x_val_000000.bin, which is missing in" in rerun()[2]


LOG_DIR_WRITER = (b"import json, os, sys\n"
                  b"config = json.load(open(sys.argv[sys.argv.index('--config') + 1]))\n"
                  b"os.makedirs(config['log_dir'], exist_ok=True)\n"
                  b"open(os.path.join(config['log_dir'], 'wrote'), 'w').close()\n")  # a rerun that writes where told


def test_reproduce_run_writes_under_the_reproduction_never_where_the_log_said(tmp_path, monkeypatch, capsys):
    """The logged log_dir (an absolute temporary folder of the original machine) is not where the
    rerun writes: its config names OUT/logs. A plain recreation, then --run, reuses the folder."""
    monkeypatch.chdir(tmp_path)
    logged_dir = tmp_path / "original_machine_tmp"
    log_path = write_log(tmp_path / "r1.txt", 3.25, 5000, sources={**SOURCES, "train_gpt.py": LOG_DIR_WRITER},
                         data=[], config_changes={"log_dir": str(logged_dir)})
    out = tmp_path / "out"
    assert reproduce.main([log_path, "--dir", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["log_dir"] == str(out / "logs")
    assert reproduce.main([log_path, "--dir", str(out), "--run", "--other-data"]) == 0
    assert (out / "logs" / "wrote").exists() and not logged_dir.exists()
    printed = capsys.readouterr().out
    assert f"note: --run executes the code this log embeds (2 file(s) in {out}, entry train_gpt.py)" in printed
    assert "original run r1: final val_loss 3.2500, train_time 5.0 s, 4 steps" in printed


@pytest.mark.parametrize("where", ["dir", "log_dir"])
def test_reproduce_refuses_to_write_into_records(tmp_path, capsys, where):
    log_path = write_log(tmp_path / "r1.txt", 3.25, 5000, config_changes={"log_dir": "logs"})
    inside = REPO / "records" / f"reproduce-test-{os.getpid()}"
    argv = [log_path, "--dir", str(inside if where == "dir" else tmp_path / "out")]
    argv += [] if where == "dir" else ["--", f"--log_dir={inside}"]
    assert reproduce.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is inside the repository's records/ folder" in err
    assert not inside.exists() and not (tmp_path / "out").exists()


def test_reproduce_refuses_a_fifo_without_waiting(tmp_path, capsys):
    os.mkfifo(tmp_path / "pipe.txt")
    assert reproduce.main([str(tmp_path / "pipe.txt"), "--dir", str(tmp_path / "out")]) == 2
    assert "it is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the CPU baseline script


def write_shard(path, tokens):
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, 1, len(tokens)
    path.write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes())


BASELINE_PROGRAM = """
import hashlib, importlib.util, json, sys
spec = importlib.util.spec_from_file_location("baseline_adamw", sys.argv[1])
module = sys.modules["baseline_adamw"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print(json.dumps({path: hashlib.sha256(data).hexdigest() for path, data in module.project_sources().items()}))
"""  # the sources a run of the baseline script embeds, with their sha256, in a process of its own


def test_the_cpu_tracks_baseline_definition_is_this_checkouts_baseline_script():
    """track_cpu's baseline (track.json "baseline") lists this checkout's baseline program (every
    source a run of baseline_adamw.py embeds) among its versions, and its config is the script's
    defaults as it logs them: a change to either (or to a module it imports) shows here, where a
    reviewer sees it, not first in a refused record."""
    script_path = REPO / "records" / "track_cpu" / "baseline_adamw.py"
    spec = importlib.util.spec_from_file_location("baseline_adamw", script_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    definition = json.loads((REPO / "records" / "track_cpu" / "track.json").read_text())["baseline"]
    done = subprocess.run([sys.executable, "-c", BASELINE_PROGRAM, str(script_path)], capture_output=True, text=True,
                          check=True, timeout=120, cwd=REPO)
    version = json.loads(done.stdout)
    assert definition["entry"] in version
    assert version in definition["code"], ("the checkout's baseline is not a version that track.json baseline.code "
                                           f"lists; if it measures the same baseline, add {json.dumps(version)}")
    defaults = dataclasses.asdict(module.parse_hyperparameters([])) | {"entry": definition["entry"]}
    assert definition["config"] == {k: v for k, v in defaults.items() if k not in rules.FREE_CONFIG_KEYS}


def test_baseline_script_writes_a_valid_log_and_reproduces(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "data").mkdir()
    for name, n in (("t_train_000000.bin", 3000), ("t_train_000001.bin", 3000), ("t_val_000000.bin", 600)):
        write_shard(tmp_path / "data" / name, rng.integers(0, 50257, n))
    # One thread: two threads spin-waiting on a busy 2-core machine make even a tiny step slow.
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=16", "--batch_size=4", "--num_iterations=3"]
    tiny += ["--threads=1"]
    tiny += ["--val_tokens=256", "--val_every=2", "--warmup_iters=1", f"--log_dir={tmp_path / 'logs'}"]
    tiny += ["--train_files=data/t_train_*.bin", "--val_files=data/t_val_000000.bin"]  # from tmp_path
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
    code = json.loads((REPO / "records" / "track_cpu" / "track.json").read_text())["baseline"]["code"]
    assert log.declared_sha256 in code, "a run of the checkout's baseline is a version track.json lists"
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
    assert [p for p in (tmp_path / "logs").iterdir()] == [log_path], "the rerun logs in the reproduction, not here"
    (rerun_path,) = (out / "logs").iterdir()
    rerun = parse_log(rerun_path)
    assert rerun.code_id == log.code_id and rerun.config == log.config | {"log_dir": str(out / "logs")}
    assert rerun.final["val_loss"] == log.final["val_loss"]
    assert f"original run {log.run_id}: final val_loss {log.final['val_loss']:.4f}" in done.stdout
    assert f"this rerun {rerun.run_id}: final val_loss {log.final['val_loss']:.4f}" in done.stdout
    assert "val_loss the same; train_time " in done.stdout and "executes the code this log embeds" in done.stdout
