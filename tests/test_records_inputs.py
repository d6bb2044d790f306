"""The records tools on inputs a careless user or a hostile log brings: files too large to read
whole, folders that are not theirs, globs and numbers from a log, text that markdown and HTML give
meaning to, a README with its markers twice, Ctrl-C. Each ends in one line and exit status 2,
having read no more than it needs and written nothing."""
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import records.logfile
from test_records import (REPO, SOURCES, TRACK, run_tool, site, snapshot, write_log,  # noqa: F401 (site: a fixture)
                          write_logs)
from records import make_record, plot, readme_tables, record_writer, reproduce  # noqa: E402

SMALL_CAP = 2**20                  # the log size cap the tests lower the real one to


@pytest.fixture
def small_cap(monkeypatch):
    monkeypatch.setattr(records.logfile, "LOG_MAX_BYTES", SMALL_CAP)


def oversized_log(path):
    """A file one byte over the cap, a log's header first (so that only the size refuses it)."""
    path.write_bytes(b"speedrun-log v2 run_id=" + path.stem.encode() + b"\n" + b"x" * SMALL_CAP)
    return path


def test_a_log_over_the_size_cap_is_refused_by_every_tool_before_it_is_read(site, capsys, small_cap, monkeypatch):
    logs = write_logs(site / "logs", [3.40, 3.42], [5000, 5600])
    big = oversized_log(site / "logs" / "big.txt")
    before = snapshot(site)
    assert run_tool(site, "--name", "X", "--logs", *logs, big) == 2
    line = f"{big}: cannot read the log (it is larger than 1 MiB; a run log is a few MiB at most)"
    assert capsys.readouterr().err == f"error: {line}\n"
    assert snapshot(site) == before
    assert reproduce.main([str(big), "--dir", str(site / "out")]) == 2
    assert capsys.readouterr().err == f"error: {line}\n" and not (site / "out").exists()
    assert plot.main([str(big), "--out", str(site / "x.png")]) == 2
    assert capsys.readouterr().err == f"error: {line}\n" and not (site / "x.png").exists()


def test_the_real_size_cap_refuses_a_file_from_its_size(tmp_path):
    """A log's header, then 64 MiB of nothing (a sparse file: no disk): refused by its size."""
    path = tmp_path / "huge.txt"
    with open(path, "wb") as f:
        f.write(b"speedrun-log v2 run_id=huge\n")
        f.truncate(records.logfile.LOG_MAX_BYTES + 1)
    with pytest.raises(records.logfile.LogError, match="larger than 64 MiB"):
        records.logfile.parse_log(path)


@pytest.mark.parametrize("changed", ["<!-- records:track_test:end -->",
                                     "**bold** _it_ `code` [x](y) a\\b ~s~ <b>&amp;"],
                         ids=["an end marker", "markdown and HTML"])
def test_table_cells_escape_markdown_and_html(site, capsys, changed):
    """--changed (and a log's CPU text) that markdown or HTML would read: shown as written, the README
    keeps one pair of markers, and the next --tables rewrites it identically (no rows hidden or doubled)."""
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300], cpu="Evil <!-- x --> *9000*")
    assert run_tool(site, "--name", "Esc", "--date", "2026-11-30", "--changed", changed, "--logs", *logs) == 0
    readme = (site / "README.md").read_text()
    assert readme.count(f"<!-- records:{TRACK}:start -->") == 1 and readme.count(f"<!-- records:{TRACK}:end -->") == 1
    row = next(line for line in readme.splitlines() if line.startswith("| 1 |"))
    cells = row.split(" | ")
    assert cells[2] == readme_tables.cell(changed) and "<" not in cells[2] and "**" not in cells[2]
    assert cells[3] == r"Evil &lt;!-- x --&gt; \*9000\*"
    assert run_tool(site, "--tables") == 0
    assert (site / "README.md").read_text() == readme


@pytest.mark.parametrize("text", ["a\\*b", "<x>", "&lt;", "[a](b)", "x|y", "_", "~~"])
def test_a_cell_shows_its_text_as_written(text):
    """What markdown would make of the cell, undone: the escapes and the entities give back the text."""
    shown = readme_tables.cell(text)
    for entity, char in (("&lt;", "<"), ("&gt;", ">"), ("&amp;", "&")):
        shown = shown.replace(entity, char)
    assert re.sub(r"\\(.)", r"\1", shown) == text


def test_a_readme_with_the_markers_twice_is_refused(site, capsys):
    readme = site / "README.md"
    readme.write_text(readme.read_text() * 2)
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    before = snapshot(site)
    assert run_tool(site, "--name", "X", "--logs", *logs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "2 time(s)" in err and "keep one pair" in err, err
    assert snapshot(site) == before
    readme.write_text(f"# T\n\n<!-- records:{TRACK}:start -->\nno end\n")
    assert run_tool(site, "--tables") == 2 and "keep one pair" in capsys.readouterr().err


def test_ctrl_c_in_make_record_is_one_line_and_writes_nothing(site, capsys, monkeypatch):
    """An interrupt while the record is being drawn: the staged folder goes, the README stays."""
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    before = snapshot(site)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(record_writer, "write_plot", interrupted)
    try:
        code = run_tool(site, "--name", "X", "--date", "2026-11-30", "--logs", *logs)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left make_record.main as a traceback")
    assert code == 2
    assert capsys.readouterr().err == ("error: interrupted (Ctrl-C): nothing was written; the records and READMEs are "
                                       "as they were\n")
    assert snapshot(site) == before


def test_ctrl_c_while_make_record_waits_for_the_lock(site):
    """A real SIGINT to a make_record.py process waiting for another's lock: one line, exit 2."""
    import fcntl
    logs = write_logs(site / "logs", [3.40, 3.42, 3.41], [5000, 5600, 5300])
    holder = os.open(site / "records", os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        process = subprocess.Popen([sys.executable, str(REPO / "records" / "make_record.py"), "--track", TRACK,
                                    "--records-dir", str(site / "records"), "--readme", str(site / "README.md"),
                                    "--name", "X", "--logs", *logs], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
        ready, _, _ = select.select([process.stdout], [], [], 60)
        assert ready and process.stdout.readline().startswith("waiting for another make_record.py")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        os.close(holder)
    assert process.returncode == 2 and err.splitlines() == [
        "error: interrupted (Ctrl-C): nothing was written; the records and READMEs are as they were"], err


def test_reproduce_refuses_a_folder_that_is_not_its_recreation_without_reading_it(tmp_path, capsys, monkeypatch):
    """--dir of a folder holding anything else: refused at the first name the recreation lacks; no
    file of it is read. Its own recreation is found again by reading only its files."""
    log = write_log(tmp_path / "r1.txt", 3.25, 5000)
    out = tmp_path / "out"
    assert reproduce.main([log, "--dir", str(out)]) == 0
    read = []
    real = reproduce.read_regular_file
    monkeypatch.setattr(reproduce, "read_regular_file", lambda path, *a: read.append(Path(path)) or real(path, *a))
    assert reproduce.main([log, "--dir", str(out)]) == 0 and "found" in capsys.readouterr().out
    assert sorted(p.relative_to(out).as_posix() for p in read) == sorted([*SOURCES, "config.json"])
    mine = tmp_path / "mine"
    (mine / "deep" / "er").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    (mine / "deep" / "er" / "big.bin").write_bytes(b"\0" * 1000)
    read.clear()
    assert reproduce.main([log, "--dir", str(mine)]) == 2
    assert "exists and is neither empty nor this log's recreation" in capsys.readouterr().err
    assert read == [] and (mine / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("pattern", ["/*/*/*/*/*/*/*/*", "../*/*.bin", "data/../../*", "*.bin", "elsewhere/x_*.bin"])
def test_reproduce_run_refuses_a_glob_outside_the_data_folder_before_listing(tmp_path, capsys, monkeypatch, pattern):
    monkeypatch.chdir(tmp_path)
    log = write_log(tmp_path / "r1.txt", 3.25, 5000, config_changes={"val_files": pattern})
    monkeypatch.setattr(reproduce.glob, "glob", lambda *a, **k: pytest.fail("a pattern was listed"))
    assert reproduce.main([log, "--dir", str(tmp_path / "out"), "--run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reaches outside the repository's data folder (data/)" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("world_size", ["0", "-8", "1000000", "x"])
def test_reproduce_refuses_a_world_size_that_is_no_number_of_processes(tmp_path, capsys, world_size):
    log = write_log(tmp_path / "r1.txt", 3.25, 5000, world_size=world_size)
    assert reproduce.main([log, "--dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"environment world_size {world_size!r} is not" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("out, message", [
    ("x.xyz", "matplotlib writes no .xyz files"),
    ("x", "matplotlib writes no suffix-less files"),
    ("missing/x.png", "its folder missing does not exist"),
    ("mine.png", "--out mine.png exists: plot.py writes a new file, never over one"),
])
def test_plot_checks_its_picture_before_reading_the_logs(tmp_path, capsys, monkeypatch, out, message):
    monkeypatch.chdir(tmp_path)
    log = write_log(tmp_path / "r1.txt", 3.25, 5000)
    (tmp_path / "mine.png").write_bytes(b"my picture")
    monkeypatch.setattr(plot, "parse_log", lambda *a: pytest.fail("the logs were read"))
    assert plot.main([log, "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert (tmp_path / "mine.png").read_bytes() == b"my picture"


def test_plot_of_a_log_naming_no_track_folder_reads_no_track(tmp_path):
    """A log's track (`../../etc`) is no track folder name: no target, nothing read outside records/."""
    assert records.logfile.track_target("../../etc") is None
    assert records.logfile.track_target("track_cpu") == pytest.approx(5.7264, abs=1e-4)
