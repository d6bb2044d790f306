"""Write, read and check run logs (the format is described in records/FORMAT.md).

A log is a snapshot of one training run: the verbatim bytes of every project source file the
run used, each with its declared sha256, then the environment, the data fingerprints, the
resolved config and the run's output lines. Sources are read by their byte count, never by
scanning for the end marker, so a source may contain anything (including lines that look like
log headers).

Version 2 seals the text: every line after the sources ends with " #" and 16 hex digits of a
running sha256, d_i = sha256(d_{i-1} || line_i), where d_0 is the sha256 of every byte before
the first text line (the first line and the sources). A line changed, inserted or removed after
it was written no longer matches its seal, nor does any line after it; the reader names the
first such line. Version-1 logs (unsealed, the earliest records) are still read.

LogWriter is the one writer of the format: train_gpt.py and records/track_cpu/baseline_adamw.py
both use it.
"""

import datetime
import errno
import hashlib
import json
import math
import os
import re
import stat
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from machinery.errors import UserError

FORMAT_VERSION = 2                 # what LogWriter writes
LOG_MAX_BYTES = 64 * 2**20         # the largest log a reader reads: the writers' logs hold well under 1 MiB
TRACK_MAX_BYTES = 2**20            # the largest track.json read for a log's target
TRACK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a track folder's name (what a log's config may name)
FORMAT_HEADERS = {"speedrun-log v1": 1, "speedrun-log v2": 2}  # first words of a log's first line -> version
SEAL_HEX_DIGITS = 16               # hex digits of the running sha256 that end each sealed line
SEAL_SEPARATOR = " #"              # between a sealed line's text and its seal
SEALED_LINE = re.compile(r"(?P<text>.*) #(?P<seal>[0-9a-f]{16})")
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # run ids name files: no '/', '.', spaces
SOURCE_HEADER = re.compile(rb"=== source (?P<path>.+) sha256=(?P<sha>[0-9a-f]{64}) bytes=(?P<n>[0-9]+) ===\n")
SECTION_ORDER = ("environment", "data", "config", "run")  # text sections after the sources, in order
TRAIN_LINE = re.compile(
    r"step:(?P<step>\d+)/(?P<total>\d+) train_loss:(?P<loss>\S+) (?:objective:(?P<objective>\S+) )?"
    r"train_time:(?P<ms>\d+)ms step_avg:(?P<avg>\S+)ms"
)
VAL_LINE = re.compile(
    r"step:(?P<step>\d+)/(?P<total>\d+) val_loss:(?P<loss>\S+) "
    r"train_time:(?P<ms>\d+)ms step_avg:(?P<avg>\S+)ms"
)
FINAL_LINE = re.compile(
    r"final val_loss:(?P<loss>\S+) train_time:(?P<ms>\d+)ms steps:(?P<steps>\d+) peak_memory:(?P<mib>\S+)MiB"
)
INTERRUPTED_PREFIX = "interrupted: "  # last line of a run stopped by a signal
ERROR_PREFIX = "error: "           # last line of a run stopped by an error
FINGERPRINT_FIELDS = {"path": str, "bytes": int, "tokens": int, "header_sha256": str, "head_sha256": str,
                      "tail_sha256": str}  # a data line's keys and their types (data/shards.py: fingerprint)
CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")  # never in a source path (a NUL or a line break names no file)
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")  # the OS's id of this machine (systemd, D-Bus)
MACHINE_ID_SALT = b"speedrun-log machine id\n"  # hashed with the id: the log tells machines apart, never shows the id
IDENTITY_HEX_DIGITS = 16           # hex digits of the hashes that name a machine's id and its CPU flags
UNKNOWN = "unknown"                # an environment value this machine does not say
DIRTY_MARK = "-dirty"              # after git_commit: the run's sources are not that commit's files
GIT_TIMEOUT_S = 10                 # for each git command the writer runs
FILE_KINDS = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket",
              stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}  # what a path can be besides a file


class LogError(UserError):
    """A log is malformed, tampered with, or unusable for the requested purpose; the message names the file."""


class LogWriteError(OSError):
    """Writing a log failed (a full disk, a file-size limit, ...); the log ends at its last whole line.
    str() is the line saying so and what to do (write_failure)."""

    def __str__(self):
        return self.strerror


def write_failure(path, error):
    """The line saying that writing `path` failed with the OSError `error`, and what to do."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the disk is full while writing {path}: free space or choose another --log_dir"
    if error.errno == errno.EFBIG:
        return f"the file-size limit was reached while writing {path}: raise it (ulimit -f) or choose another --log_dir"
    return f"writing {path} failed ({error.strerror}): choose another --log_dir"


def read_regular_file(path, limit=None):
    """The bytes of the regular file at `path`, at most `limit` of them: a larger file is refused
    before it is read. Anything else (a FIFO, a device, a folder) is refused before it is opened
    for reading, so that nothing waits on a pipe or reads a device without end: an OSError whose
    strerror says what the path is."""
    kind = next((name for test, name in FILE_KINDS.items() if test(os.stat(path).st_mode)), None)
    if kind is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # never waits, even on a FIFO put there since
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            kind = next((name for test, name in FILE_KINDS.items() if test(mode)), None)
            if kind is None:
                if limit is None:
                    return f.read()
                data = f.read(limit + 1) if os.fstat(fd).st_size <= limit else b""
                if os.fstat(fd).st_size > limit or len(data) > limit:
                    raise OSError(errno.EFBIG, f"it is larger than {limit / 2**20:g} MiB", str(path))
                return data
    raise OSError(errno.EINVAL, f"it is {kind}, not a regular file", str(path))


# ----------------------------------------------------------------------------- writing


def new_run_id():
    """A run id: the local start time and 8 random hex digits, e.g. 20261130-204512-1a2b3c4d."""
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def cpu_model():
    """The CPU's model name from /proc/cpuinfo (the environment section's `cpu`), or "unknown"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        return "unknown"
    return names[0] if names else "unknown"


LOAD_AVERAGE_WINDOW_S = 60         # the 1-minute load average decays with this time constant (s)
IDLE_LOAD = 0.5                    # runnable tasks of other work, beyond the CPUs a run leaves free, that make it busy


def load_average():
    """The machine's 1-minute load average (runnable tasks), or None where the OS does not say."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def other_load(load, cpus, run_threads, run_seconds, load_at_start=None):
    """The load of other work in a 1-minute load average taken run_seconds into a run that keeps
    run_threads threads busy on `cpus` CPUs, when it takes CPUs the run needs (more than IDLE_LOAD
    beyond the CPUs the run leaves free); else None. The average decays as
    L(t) = L(0) d + n (1 - d), d = exp(-t / LOAD_AVERAGE_WINDOW_S), for n runnable tasks during the
    run: given the average at the start, other work is n - run_threads, the work that ended before
    the run (a previous run's) counting nothing; without it, L(0) is taken as other work too,
    and other work is L(t) - run_threads (1 - d)."""
    decay = math.exp(-run_seconds / LOAD_AVERAGE_WINDOW_S)
    if load_at_start is None or decay == 1.0:
        others = load - run_threads * (1 - decay)
    else:
        others = (load - load_at_start * decay) / (1 - decay) - run_threads
    return others if others > max(cpus - run_threads, 0) + IDLE_LOAD else None


def track_target(track):
    """The target val loss of records/<track>/track.json, or None without one (or where `track`, which
    a log names, is no track folder's name)."""
    if not isinstance(track, str) or not TRACK_NAME.fullmatch(track):
        return None
    try:
        return float(json.loads(read_regular_file(os.path.join(REPO_DIR, "records", track, "track.json"),
                                                  TRACK_MAX_BYTES))["target_val_loss"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def machine_identity():
    """What tells this machine from another of the same CPU model and hostname: `machine_id`, a
    hash of the OS's machine id, and `cpu_flags`, a hash of the CPU's flags (/proc/cpuinfo); each
    "unknown" where the machine does not say."""
    identity = {"machine_id": UNKNOWN, "cpu_flags": UNKNOWN}
    for path in MACHINE_ID_FILES:
        try:
            with open(path, "rb") as f:
                machine_id = f.read().strip()
        except OSError:
            continue
        if machine_id:
            identity["machine_id"] = hashlib.sha256(MACHINE_ID_SALT + machine_id).hexdigest()[:IDENTITY_HEX_DIGITS]
            break
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        flags = None
    if flags:
        identity["cpu_flags"] = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:IDENTITY_HEX_DIGITS]
    return identity


def git_blob_id(content):
    """The object id git gives a file of these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def commit_of_sources(commit, sources, repo_dir):
    """`commit`, marked DIRTY_MARK when a source [(relpath, bytes)] is not that commit's file in the
    git repository at repo_dir (changed, or not committed); unmarked when it names no commit."""
    if not re.fullmatch(r"[0-9a-f]{40}", commit):
        return commit
    paths = [relpath for relpath, _ in sources]
    try:
        listing = subprocess.run(["git", "-C", str(repo_dir), "ls-tree", "-z", commit, "--", *paths],
                                 capture_output=True, timeout=GIT_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return commit + DIRTY_MARK       # cannot be shown to be the commit's files
    committed = {}
    for entry in filter(None, listing.split(b"\0")):
        info, _, path = entry.partition(b"\t")
        committed[path.decode("utf-8", "replace")] = info.split()[-1].decode("ascii", "replace")
    clean = all(committed.get(relpath) == git_blob_id(content) for relpath, content in sources)
    return commit if clean else commit + DIRTY_MARK


def next_seal(previous, text):
    """d_i = sha256(d_{i-1} || line_i) of the running seal (32-byte digests)."""
    return hashlib.sha256(previous + text.encode("utf-8")).digest()


class LogWriter:
    """Writes one run's log, created exclusively (an existing file is never overwritten).

    header() writes the first line, the sources and the environment, data and config sections;
    line() appends one sealed run line. Every write goes straight to the file; one that fails
    (a full disk, a file-size limit) is cut back to the last whole line, so the log never ends in
    half a line, and LogWriteError is raised.
    """

    def __init__(self, path, run_id):
        if not RUN_ID.fullmatch(run_id):
            raise ValueError(f"run id {run_id!r}: letters, digits, '-' and '_' only")
        self.path = str(path)
        self.file = open(path, "xb", buffering=0)
        self.size = 0              # bytes of whole lines written so far
        self.prefix = hashlib.sha256()  # of everything before the first sealed line
        self.seal = None           # running seal, from the first sealed line on
        self._append(f"speedrun-log v{FORMAT_VERSION} run_id={run_id}\n".encode())

    def _append(self, data):
        view = memoryview(data)
        try:
            while view:
                view = view[self.file.write(view):]
        except OSError as e:
            self._cut_back()
            raise LogWriteError(e.errno, write_failure(self.path, e), self.path) from None
        if self.seal is None:
            self.prefix.update(data)
        self.size += len(data)

    def _cut_back(self):
        """Drop a partly written line (truncating needs no free space)."""
        try:
            os.ftruncate(self.file.fileno(), self.size)
            os.lseek(self.file.fileno(), self.size, os.SEEK_SET)
        except OSError:
            pass

    def source(self, relpath, content):
        if self.seal is not None:
            raise ValueError("sources come before the first text line")
        digest = hashlib.sha256(content).hexdigest()
        self._append(f"=== source {relpath} sha256={digest} bytes={len(content)} ===\n".encode() + content
                     + f"\n=== end source {relpath} ===\n".encode())

    def line(self, text):
        """Append one sealed line (text without a newline)."""
        if "\n" in text:
            raise ValueError("a log line cannot contain a newline")
        seal = next_seal(self.seal if self.seal is not None else self.prefix.digest(), text)
        self._append(f"{text}{SEAL_SEPARATOR}{seal.hex()[:SEAL_HEX_DIGITS]}\n".encode("utf-8"))
        self.seal = seal

    def header(self, sources, environment, data, config):
        """The snapshot part: sources [(relpath, bytes)], environment {key: value}, data
        fingerprints [dict], the resolved config (a dict); the run section follows. The environment
        gains this machine's identity (machine_identity) where it lacks it, and its git_commit the
        DIRTY_MARK where the sources are not that commit's files in this repository."""
        sources = list(sources)
        environment = {**environment, **{k: v for k, v in machine_identity().items() if k not in environment}}
        if "git_commit" in environment:
            environment["git_commit"] = commit_of_sources(str(environment["git_commit"]), sources, REPO_DIR)
        for relpath, content in sources:
            self.source(relpath, content)
        self.line("=== environment ===")
        for key, value in environment.items():
            self.line(f"{key}: {value}")
        self.line("=== data ===")
        for fingerprint in data:
            self.line(json.dumps(fingerprint))
        self.line("=== config ===")
        self.line(json.dumps(config))
        self.line("=== run ===")

    def close(self):
        self.file.close()


# ----------------------------------------------------------------------------- reading


@dataclass
class Log:
    """The parsed content of one log file."""

    path: str
    run_id: str
    version: int
    sources: dict  # relpath -> the file's bytes, as embedded
    declared_sha256: dict  # relpath -> sha256 written in the source header
    environment: dict  # key -> value (strings)
    data: list  # one fingerprint dict per data file read
    config: dict
    steps: list = field(default_factory=list)  # per train line: step, total, train_loss, objective, train_time_ms
    val_points: list = field(default_factory=list)  # (step, val_loss, train_time_ms)
    info: list = field(default_factory=list)  # every other line of the run section, verbatim
    final: dict | None = None  # val_loss, train_time_ms, steps, peak_memory_mib; None if the run did not finish
    ending: str = "unfinished"  # finished | interrupted | error | cut (a partial last line) | unfinished

    @property
    def finished(self):
        return self.final is not None

    @property
    def sealed(self):
        return self.version >= 2

    @property
    def code_id(self):
        """What "same code" means: the set of (relpath, declared sha256) pairs."""
        return frozenset(self.declared_sha256.items())

    def describe_ending(self):
        """One phrase saying how the run ended, from its last line."""
        last = self.info[-1] if self.info else ""
        return {
            "finished": "finished",
            "interrupted": f"was interrupted ({last.removeprefix(INTERRUPTED_PREFIX)})",
            "error": f"stopped with an error ({last.removeprefix(ERROR_PREFIX)})",
            "cut": "is cut short in the middle of a line (its last write failed, e.g. on a full disk)",
            "unfinished": "did not finish (no final line: still running, killed, or truncated)",
        }[self.ending]


def _safe_relpath(relpath, log_path):
    """Refuse paths that would escape the folder a source tree is recreated in."""
    parts = PurePosixPath(relpath).parts
    if (not parts or relpath.startswith("/") or "\\" in relpath or any(p in ("..", ".") for p in parts)
            or CONTROL_CHARACTER.search(relpath)):
        raise LogError(f"{log_path}: source path {relpath!r} is not a plain relative path inside the project")
    return relpath


def _parse_sources(raw, pos, log_path):
    """Read the source blocks starting at byte `pos`; return (sources, declared hashes, position after them)."""
    sources, declared = {}, {}
    while True:
        header = SOURCE_HEADER.match(raw, pos)
        if header is None:
            return sources, declared, pos
        try:
            relpath = _safe_relpath(header["path"].decode("utf-8"), log_path)
        except UnicodeDecodeError:
            raise LogError(f"{log_path}: a source path is not UTF-8") from None
        if relpath in sources:
            raise LogError(f"{log_path}: source {relpath} is embedded twice")
        start = header.end()
        end = start + int(header["n"])
        footer = f"\n=== end source {relpath} ===\n".encode("utf-8")
        if raw[end : end + len(footer)] != footer:
            raise LogError(
                f"{log_path}: source {relpath} does not end after its declared {int(header['n'])} bytes "
                f"(the log is truncated or the source was edited)"
            )
        sources[relpath] = raw[start:end]
        declared[relpath] = header["sha"].decode("ascii")
        pos = end + len(footer)


def _check_source_hashes(sources, declared, log_path):
    """Raise LogError naming the first embedded source whose bytes do not have its declared sha256."""
    for relpath, content in sorted(sources.items()):
        actual = hashlib.sha256(content).hexdigest()
        if actual != declared[relpath]:
            raise LogError(
                f"{log_path}: embedded source {relpath} has sha256 {actual}, "
                f"but the log declares {declared[relpath]}: the log was edited"
            )


def _refuse_unterminated_last_line(last, seal, log_path):
    """A last line that matches its seal but lacks its newline was whole when written (the writer
    writes a line and its newline at once): the file lost its final byte afterwards."""
    m = SEALED_LINE.fullmatch(last)
    if m and next_seal(seal, m["text"]).hex()[:SEAL_HEX_DIGITS] == m["seal"]:
        raise LogError(f"{log_path}: the last line ({m['text'][:80]!r}) is whole and matches its seal but has no "
                       "final newline: the file lost its last byte after it was written (an editor or a copy "
                       "that strips final newlines); use the original log, or add the newline back")


def _unseal(text, prefix, log_path):
    """The text lines of a version-2 log with their seals checked; (lines, cut) where cut says
    the file ends in a partial line (dropped)."""
    lines = text.split("\n")
    cut = lines[-1] != ""          # a partial last line: the write that should have ended it failed
    last = lines[-1]
    lines = lines[:-1]
    seal = hashlib.sha256(prefix).digest()
    first_line_number = prefix.count(b"\n") + 1
    out = []
    for i, line in enumerate(lines):
        m = SEALED_LINE.fullmatch(line)
        number = first_line_number + i
        if m is None:
            raise LogError(f"{log_path}: line {number} has no seal ({line[:80]!r}): it was added or edited by hand")
        seal = next_seal(seal, m["text"])
        if seal.hex()[:SEAL_HEX_DIGITS] != m["seal"]:
            where = ("here, in the first line or in a source block's header" if i == 0
                     else "here or in an earlier line")
            raise LogError(f"{log_path}: line {number} ({m['text'][:80]!r}) does not match its seal: the log was "
                           f"changed after it was written ({where})")
        out.append(m["text"])
    if cut:
        _refuse_unterminated_last_line(last, seal, log_path)
    return out, cut


def _split_sections(lines, log_path):
    """Split the text lines after the sources into their `=== name ===` sections, in SECTION_ORDER."""
    sections, current = {}, None
    for line in lines:
        heading = re.fullmatch(r"=== (\w+) ===", line)
        if heading and heading[1] in SECTION_ORDER and heading[1] not in sections and current != "run":
            current = heading[1]
            sections[current] = []
        elif current is None:
            if line:
                raise LogError(f"{log_path}: expected a source block or the environment section, found {line[:80]!r}")
        else:
            sections[current].append(line)
    if tuple(sections) != SECTION_ORDER:
        raise LogError(
            f"{log_path}: sections are {list(sections)}, expected {list(SECTION_ORDER)} "
            f"(the log is truncated before its run section, or it is not a run log)"
        )
    return sections


def _parse_environment(lines, log_path):
    environment = {}
    for line in filter(None, lines):
        key, sep, value = line.partition(": ")
        if not sep:
            raise LogError(f"{log_path}: environment line is not 'key: value': {line[:80]!r}")
        environment[key] = value
    return environment


def _parse_json_line(line, what, log_path):
    try:
        value = json.loads(line)
    except json.JSONDecodeError as e:
        raise LogError(f"{log_path}: {what} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise LogError(f"{log_path}: {what} is not a JSON object")
    return value


def _parse_fingerprint(line, log_path):
    """A data line: a JSON object with FINGERPRINT_FIELDS of their types (hashes of 64 hex digits)."""
    fp = _parse_json_line(line, "a data line", log_path)
    for key, kind in FINGERPRINT_FIELDS.items():
        value = fp.get(key)
        if type(value) is not kind or (key.endswith("sha256") and not re.fullmatch(r"[0-9a-f]{64}", value)):
            raise LogError(f"{log_path}: a data line is not a file's fingerprint (its {key} is {value!r}): "
                           f"{line[:80]!r}")
    if CONTROL_CHARACTER.search(fp["path"]):
        raise LogError(f"{log_path}: a data line's path {fp['path']!r} holds a control character")
    return fp


def _parse_config(lines, log_path):
    lines = [line for line in lines if line]
    if len(lines) != 1:
        raise LogError(f"{log_path}: the config section must be exactly one JSON line, found {len(lines)}")
    config = _parse_json_line(lines[0], "the config", log_path)
    for key in ("entry", "track", "train_files", "val_files"):
        if key in config and not isinstance(config[key], str):
            raise LogError(f"{log_path}: the config's {key} is {json.dumps(config[key])[:80]}, not text")
    return config


def _parse_run(lines, log, log_path):
    """Fill the log's steps, val points, info lines, final result and ending from the run section."""
    for line in filter(None, lines):
        if log.final is not None:
            raise LogError(f"{log_path}: line after the final line: {line[:80]!r}")
        if line.startswith("step:"):
            if m := VAL_LINE.fullmatch(line):
                log.val_points.append((int(m["step"]), float(m["loss"]), int(m["ms"])))
            elif m := TRAIN_LINE.fullmatch(line):
                log.steps.append({
                    "step": int(m["step"]),
                    "total": int(m["total"]),
                    "train_loss": float(m["loss"]),
                    "objective": float(m["objective"]) if m["objective"] else None,
                    "train_time_ms": int(m["ms"]),
                })
            else:
                raise LogError(f"{log_path}: malformed step line: {line[:120]!r}")
        elif line.startswith("final "):
            m = FINAL_LINE.fullmatch(line)
            if m is None:
                raise LogError(f"{log_path}: malformed final line: {line[:120]!r}")
            log.final = {
                "val_loss": float(m["loss"]),
                "train_time_ms": int(m["ms"]),
                "steps": int(m["steps"]),
                "peak_memory_mib": float(m["mib"]),
            }
            log.ending = "finished"
        else:
            log.info.append(line)
            if line.startswith(INTERRUPTED_PREFIX):
                log.ending = "interrupted"
            elif line.startswith(ERROR_PREFIX):
                log.ending = "error"


def _refuse_crlf(first, path):
    """A first line ending in a carriage return: the file's line endings were converted to CRLF."""
    if re.fullmatch(rb"speedrun-log v\d+ run_id=\S+\r", first):
        raise LogError(f"{path}: has CRLF (Windows) line endings: a copy converted them (git's autocrlf, an editor, "
                       "a file transfer), which changes the sealed bytes; use the original log, or convert it back "
                       "to LF line endings (e.g. dos2unix)")


def parse_log(path):
    """Parse the log at `path` into a Log; raise LogError if it is not a well-formed log, an embedded
    source does not have its declared sha256 (named before the seals, which it also breaks), or a
    version-2 line does not match its seal. verify(log) checks the hashes again and the entry script."""
    try:
        raw = read_regular_file(path, LOG_MAX_BYTES)
    except OSError as e:
        big = "; a run log is a few MiB at most" if e.errno == errno.EFBIG else ""
        raise LogError(f"{path}: cannot read the log ({e.strerror}{big})") from None
    first_end = raw.find(b"\n")
    first = raw[: first_end if first_end >= 0 else len(raw)]
    _refuse_crlf(first, path)
    m = re.fullmatch(rb"(speedrun-log v\d+) run_id=(\S+)", first)
    if m is None or m[1].decode() not in FORMAT_HEADERS:
        try:
            shown = first[:60].decode("utf-8")
        except UnicodeDecodeError:
            shown = ""
        shown = shown if shown.isprintable() else "binary data"
        raise LogError(f"{path}: not a run log (its first line is {shown!r}, "
                       f"expected 'speedrun-log v{FORMAT_VERSION} run_id=<id>')")
    version, run_id = FORMAT_HEADERS[m[1].decode()], m[2].decode("ascii", errors="replace")
    if not RUN_ID.fullmatch(run_id):
        raise LogError(f"{path}: run id {run_id!r} is not letters, digits, '-' and '_'")
    sources, declared, pos = _parse_sources(raw, first_end + 1, path)
    if not sources:
        raise LogError(f"{path}: the log embeds no source files")
    _check_source_hashes(sources, declared, path)
    try:
        text = raw[pos:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogError(f"{path}: the text after the sources is not UTF-8 ({e})") from None
    if version >= 2:
        lines, cut = _unseal(text, raw[:pos], path)
    else:
        lines, cut = text.split("\n"), False
    sections = _split_sections(lines, path)
    log = Log(
        path=str(path),
        run_id=run_id,
        version=version,
        sources=sources,
        declared_sha256=declared,
        environment=_parse_environment(sections["environment"], path),
        data=[_parse_fingerprint(line, path) for line in sections["data"] if line],
        config=_parse_config(sections["config"], path),
    )
    _parse_run(sections["run"], log, path)
    if cut and not log.finished:
        log.ending = "cut"
    return log


def verify(log):
    """Recompute the sha256 of every embedded source; raise LogError naming the log and the first mismatch.

    Also checks that the config names its entry script and that the entry script is embedded.
    """
    _check_source_hashes(log.sources, log.declared_sha256, log.path)
    entry = log.config.get("entry")
    if entry not in log.sources:
        raise LogError(f"{log.path}: the config's entry script {entry!r} is not among the embedded sources")


# -----------------------------------------------------------------------------------------------
# A training run's log: what train_gpt.py writes through LogWriter
# -----------------------------------------------------------------------------------------------

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class LogFolderError(UserError):
    """The log folder given cannot hold a run's log; the message says what to give instead."""


def project_sources():
    """(relpath, bytes) of every imported module that lives in this repository (the entry script
    among them), sorted: what a log embeds so that records/reproduce.py can recreate the run."""
    files = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if (path and os.path.isabs(path) and path.startswith(REPO_DIR + os.sep) and path.endswith(".py")
                and os.path.isfile(path)):
            files.add(path)
    out = []
    for path in sorted(files):
        with open(path, "rb") as f:
            out.append((os.path.relpath(path, REPO_DIR).replace(os.sep, "/"), f.read()))
    return out


def inside_records(path):
    """Whether `path` (which need not exist) lies in the repository's records/ folder, symbolic
    links followed."""
    records = os.path.realpath(os.path.join(REPO_DIR, "records"))
    return os.path.commonpath([os.path.realpath(path), records]) == records


class RunLog:
    """logs/<run id>.txt through records/logfile.py's LogWriter (the one writer of the format);
    only rank 0 writes. The folder is checked at once, the file created with the header, so a run
    that cannot start (missing data) leaves no log. `progress` says where the run is, for the
    line of an interrupted run."""

    def __init__(self, log_dir, active):
        self.run_id = new_run_id()
        self.log_dir, self.active = log_dir, active
        self.path = os.path.join(log_dir, f"{self.run_id}.txt")
        self.writer = None
        self.progress = "before training"
        if inside_records(log_dir):
            raise LogFolderError(f"--log_dir={log_dir} is inside the repository's records/ folder, which only "
                              f"records/make_record.py writes: log elsewhere (the default is logs/), then make a "
                              f"record from the logs")
        if active:
            self._refuse_unusable_folder(lambda: os.makedirs(log_dir, exist_ok=True))

    def _refuse_unusable_folder(self, action):
        try:
            return action()
        except OSError as e:
            raise LogFolderError(f"--log_dir={self.log_dir}: cannot create a log there ({e.strerror}); "
                              f"give a writable folder") from None

    def write(self, line, echo=False):
        if self.writer is not None:
            self.writer.line(line)
            if echo:
                print(line, flush=True)

    def header(self, sources, pg, data, config):
        """Create the log with its snapshot part (sources, environment, data, config)."""
        if self.active:
            self.writer = self._refuse_unusable_folder(lambda: LogWriter(self.path, self.run_id))
            print(f"logging to {self.path}", flush=True)
            self.writer.header(sources, pg, data, config)

    def seal(self):
        """The seal of the last line written (what a checkpoint records), or "" on other ranks."""
        return self.writer.seal.hex()[:SEAL_HEX_DIGITS] if self.writer is not None else ""

    def write_last_line(self, line):
        """The line saying why the run ended (error, interrupt), written if the disk still allows."""
        try:
            self.write(line)
        except LogWriteError:
            pass

    def close(self):
        if self.writer is not None:
            self.writer.close()
