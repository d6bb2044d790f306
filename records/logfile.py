"""Read and check run logs (format version 1, described in records/README.md).

A log is a snapshot of one training run: the verbatim bytes of every project
source file the run used, each with its declared sha256, then the environment,
the data fingerprints, the resolved config and the run's output lines. Sources
are read by their byte count, never by scanning for the end marker, so a source
may contain anything (including lines that look like log headers).
"""

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import PurePosixPath

FORMAT_HEADER = "speedrun-log v1"  # first words of the first line of every version-1 log
SOURCE_HEADER = re.compile(rb"=== source (?P<path>.+) sha256=(?P<sha>[0-9a-f]{64}) bytes=(?P<n>[0-9]+) ===\n")
SECTION_ORDER = ("environment", "data", "config", "run")  # text sections after the sources, in order
TRAIN_LINE = re.compile(
    r"step:(?P<step>\d+)/(?P<total>\d+) train_loss:(?P<loss>\S+) "
    r"train_time:(?P<ms>\d+)ms step_avg:(?P<avg>\S+)ms"
)
VAL_LINE = re.compile(
    r"step:(?P<step>\d+)/(?P<total>\d+) val_loss:(?P<loss>\S+) "
    r"train_time:(?P<ms>\d+)ms step_avg:(?P<avg>\S+)ms"
)
FINAL_LINE = re.compile(
    r"final val_loss:(?P<loss>\S+) train_time:(?P<ms>\d+)ms steps:(?P<steps>\d+) peak_memory:(?P<mib>\S+)MiB"
)


class LogError(Exception):
    """A log is malformed, tampered with, or unusable for the requested purpose; the message names the file."""


@dataclass
class Log:
    """The parsed content of one log file."""

    path: str
    run_id: str
    sources: dict  # relpath -> the file's bytes, as embedded
    declared_sha256: dict  # relpath -> sha256 written in the source header
    environment: dict  # key -> value (strings)
    data: list  # one fingerprint dict per data file read
    config: dict
    steps: list = field(default_factory=list)  # one dict per train line: step, total, train_loss, train_time_ms
    val_points: list = field(default_factory=list)  # (step, val_loss, train_time_ms)
    info: list = field(default_factory=list)  # every other line of the run section, verbatim
    final: dict | None = None  # val_loss, train_time_ms, steps, peak_memory_mib; None if the run did not finish

    @property
    def finished(self):
        return self.final is not None

    @property
    def code_id(self):
        """What "same code" means: the set of (relpath, declared sha256) pairs."""
        return frozenset(self.declared_sha256.items())


def _safe_relpath(relpath, log_path):
    """Refuse paths that would escape the folder a source tree is recreated in."""
    parts = PurePosixPath(relpath).parts
    if not parts or relpath.startswith("/") or "\\" in relpath or any(p in ("..", ".") for p in parts):
        raise LogError(f"{log_path}: source path {relpath!r} is not a plain relative path inside the project")
    return relpath


def _parse_sources(raw, pos, log_path):
    """Read the source blocks starting at byte `pos`; return (sources, declared hashes, position after them)."""
    sources, declared = {}, {}
    while True:
        header = SOURCE_HEADER.match(raw, pos)
        if header is None:
            return sources, declared, pos
        relpath = _safe_relpath(header["path"].decode("utf-8"), log_path)
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


def _split_sections(text, log_path):
    """Split the text after the sources into its `=== name ===` sections, which must come in SECTION_ORDER."""
    sections, current = {}, None
    for line in text.split("\n"):
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
            f"(the log is truncated or not a version-1 log)"
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


def _parse_config(lines, log_path):
    lines = [line for line in lines if line]
    if len(lines) != 1:
        raise LogError(f"{log_path}: the config section must be exactly one JSON line, found {len(lines)}")
    return _parse_json_line(lines[0], "the config", log_path)


def _parse_run(lines, log, log_path):
    """Fill the log's steps, val points, info lines and final result from the run section."""
    for line in filter(None, lines):
        if log.final is not None:
            raise LogError(f"{log_path}: line after the final line: {line[:80]!r}")
        if line.startswith("step:"):
            if m := VAL_LINE.fullmatch(line):
                log.val_points.append((int(m["step"]), float(m["loss"]), int(m["ms"])))
            elif m := TRAIN_LINE.fullmatch(line):
                log.steps.append(
                    {
                        "step": int(m["step"]),
                        "total": int(m["total"]),
                        "train_loss": float(m["loss"]),
                        "train_time_ms": int(m["ms"]),
                    }
                )
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
        else:
            log.info.append(line)


def parse_log(path):
    """Parse the log at `path` into a Log; raise LogError if it is not a well-formed version-1 log.

    Parsing does not check the source hashes: call verify(log) for that.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise LogError(f"{path}: cannot read the log ({e.strerror})") from None
    first_end = raw.find(b"\n")
    first = raw[: first_end if first_end >= 0 else len(raw)].decode("utf-8", errors="replace")
    m = re.fullmatch(re.escape(FORMAT_HEADER) + r" run_id=(\S+)", first)
    if m is None:
        raise LogError(f"{path}: first line is {first[:80]!r}, expected '{FORMAT_HEADER} run_id=<id>'")
    sources, declared, pos = _parse_sources(raw, first_end + 1, path)
    if not sources:
        raise LogError(f"{path}: the log embeds no source files")
    try:
        text = raw[pos:].decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogError(f"{path}: the text after the sources is not UTF-8 ({e})") from None
    sections = _split_sections(text, path)
    log = Log(
        path=str(path),
        run_id=m[1],
        sources=sources,
        declared_sha256=declared,
        environment=_parse_environment(sections["environment"], path),
        data=[_parse_json_line(line, "a data line", path) for line in sections["data"] if line],
        config=_parse_config(sections["config"], path),
    )
    _parse_run(sections["run"], log, path)
    return log


def verify(log):
    """Recompute the sha256 of every embedded source; raise LogError naming the log and the first mismatch.

    Also checks that the config names its entry script and that the entry script is embedded.
    """
    for relpath, content in sorted(log.sources.items()):
        actual = hashlib.sha256(content).hexdigest()
        if actual != log.declared_sha256[relpath]:
            raise LogError(
                f"{log.path}: embedded source {relpath} has sha256 {actual}, "
                f"but the log declares {log.declared_sha256[relpath]}: the log was edited"
            )
    entry = log.config.get("entry")
    if entry not in log.sources:
        raise LogError(f"{log.path}: the config's entry script {entry!r} is not among the embedded sources")
