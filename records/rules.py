"""The rules a record is checked by, in one place: records/FORMAT.md lists them in this order, each
with the line its refusal gets (tests/test_record_rules.py walks both lists).

make_record.py reads a series' logs (the record's runs, its baseline runs, the current record's
re-runs in the same series) into a Series and checks it here. A new record is checked by every
rule; a record made before (every run of the tool checks them all again) by every rule but those
only the moment of making can check (made_only: its commit in this checkout, its --date, the
track's fixed_config, which grows with the trainer's keys), so a record that was accepted never
blocks its track later. A broken rule is one line, a RuleError
ending in "(rule: <name>)".
"""

import datetime
import fnmatch
import math
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from machinery.errors import UserError
from records.logfile import DIRTY_MARK, git_blob_id

FREE_CONFIG_KEYS = ("seed", "log_dir")  # the only config values the runs of one record may differ in
FINGERPRINT_KEYS = ("bytes", "tokens", "header_sha256", "head_sha256", "tail_sha256")  # a data file's identity
MACHINE_KEYS = ("cpu", "hostname")  # the environment lines that name the machine a run ran on
IDENTITY_KEYS = ("cpu_count", "cpu_flags", "machine_id")  # from format 4 on: what tells machines of one name apart
FORMAT_WITH_MACHINES = 3  # the first statistics format whose records name each run's machine and commit
FORMAT_WITH_IDENTITY = 4  # the first with each run's machine identity
COMMIT_KEY = "git_commit"  # the environment line that names the commit a run ran at
UNKNOWN = "unknown"  # a machine or commit value of a log whose environment lacks the line
METRIC_STEPS = "steps"  # track.json "metric" of a track ranked by steps, where time (and so load) does not count
BUSY_WARNING = "warning: the machine was busy"  # how a run's log says that other work held CPUs it needed
COMMIT_ID = re.compile(r"[0-9a-f]{40}")  # a full git commit id
OUTSIDE_GIT = "none"  # the git_commit of a run from a tree outside git (a recreation of reproduce.py)
GIT_TIMEOUT_S = 30  # for each git command that looks up a run's commit


class RuleError(UserError):
    """A series breaks a rule: the line says where and how, and names the rule."""


class Broken(Exception):
    """Raised by a rule's check with what is wrong; check() turns it into the RuleError naming the rule."""


@dataclass
class Series:
    """The logs a record is made of, and what its rules are checked against.

    runs, baseline, reruns: the record's runs, its baseline runs, the current record's re-runs (Logs);
    current: the current record's first log (what the re-runs re-run) and current_name its folder;
    date: the new record's --date (None for a record made before); now: the tool's clock;
    repo_root: the checkout whose commits a new record's logs must name;
    runs_are_baseline: the runs are the track's baseline script (--remeasured-baseline,
    --set-target-from-these-logs)."""

    runs: list
    track: dict
    baseline: list = field(default_factory=list)
    reruns: list = field(default_factory=list)
    current: object = None
    current_name: str = ""
    date: str | None = None
    now: datetime.datetime = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc))
    repo_root: Path | None = None
    statistics_format: int = FORMAT_WITH_IDENTITY
    machines_reason: str | None = None
    commits_reason: str | None = None
    runs_are_baseline: bool = False

    def groups(self):
        """(role, logs) of each group, as refusals name them; empty groups left out."""
        named = (("the", self.runs), ("baseline", self.baseline), ("the current record's re-run", self.reruns))
        return [(role, logs) for role, logs in named if logs]

    def logs(self):
        return [*self.runs, *self.baseline, *self.reruns]

    @property
    def by_time(self):
        """Whether the track ranks its records by train time (not by steps)."""
        return self.track.get("metric") != METRIC_STEPS


@dataclass(frozen=True)
class Rule:
    name: str
    check: object                 # check(series): raises Broken; None for new-program (new_program_refusal)
    made_only: bool = False       # checked when a record is made, not again for the records made before


RULES = []


def rule(name, made_only=False):
    """Register the decorated check as the rule `name`, after the rules defined above it."""
    def register(check):
        RULES.append(Rule(name, check, made_only))
        return check
    return register


def check(series):
    """Refuse the series at the first rule it breaks (every rule for a new record, the ones that are
    not made_only for a record made before)."""
    for r in RULES:
        if r.check is not None and (series.date is not None or not r.made_only):
            try:
                r.check(series)
            except Broken as e:
                raise RuleError(f"{e} (rule: {r.name})") from None


# ----------------------------------------------------------------------------- what a log says


def free_config(log):
    """The config without the values runs of one record may differ in (FREE_CONFIG_KEYS)."""
    return {k: v for k, v in log.config.items() if k not in FREE_CONFIG_KEYS}


def program(log):
    """What a run ran: its code (the sources it embeds, with their sha256) and its config but the free keys."""
    return log.code_id, repr(sorted(free_config(log).items()))


def describe_config_difference(a, b):
    keys = sorted(k for k in set(free_config(a)) | set(free_config(b)) if a.config.get(k) != b.config.get(k))
    return f"{a.path} and {b.path} differ in {', '.join(keys)} (only {', '.join(FREE_CONFIG_KEYS)} may differ)"


def describe_code_difference(a, b):
    """One line naming the source files whose hashes differ between logs a and b."""
    differing = sorted(path for path in set(a.declared_sha256) | set(b.declared_sha256)
                       if a.declared_sha256.get(path) != b.declared_sha256.get(path))
    return f"{a.path} and {b.path} differ in {', '.join(differing)}"


def started_at(log):
    """When the run started (its environment's `started`, with its offset), or None."""
    try:
        when = datetime.datetime.fromisoformat(log.environment.get("started", ""))
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def machine_of(log, statistics_format=FORMAT_WITH_IDENTITY):
    """The machine a run ran on: {cpu, hostname} from its environment, from format 4 on with its core
    count, CPU flags and machine id."""
    keys = MACHINE_KEYS + (IDENTITY_KEYS if statistics_format >= FORMAT_WITH_IDENTITY else ())
    return {key: log.environment.get(key, UNKNOWN) for key in keys}


def commit_of(log):
    return log.environment.get(COMMIT_KEY, UNKNOWN)


def describe_machine(machine):
    return ", ".join(f"{key} {value!r}" for key, value in machine.items())


def data_read(log, pattern_key):
    """The data fingerprints of the log whose paths match its config's pattern `pattern_key`."""
    pattern = log.config.get(pattern_key)
    return [fp for fp in log.data if isinstance(pattern, str) and fnmatch.fnmatch(fp["path"], pattern)]


def data_identity(fingerprints):
    """The distinct (bytes, tokens, hashes) of the fingerprints, in order: what the data is, not where."""
    return list(dict.fromkeys(tuple(fp.get(k) for k in FINGERPRINT_KEYS) for fp in fingerprints))


def final_disagreement(log):
    """How the log's final line disagrees with its step lines and config, or None: a finite val_loss
    (the statistics are computed from it) that repeats the last validation (its step is the run's
    steps, with its val_loss and train_time), no step line past it or counting to another total,
    and the config trained that many steps."""
    final, steps = log.final, log.final["steps"]
    if not math.isfinite(final["val_loss"]):
        return f"its final val_loss is {final['val_loss']}, which no finished run logs"
    iterations = log.config.get("num_iterations")
    if isinstance(iterations, int) and iterations != steps:
        return f"its final line says {steps} steps, its config's num_iterations is {iterations}"
    lines = [(p["step"], p["train_time_ms"]) for p in log.steps] + [(step, ms) for step, _, ms in log.val_points]
    totals = sorted({p["total"] for p in log.steps})
    if totals not in ([], [steps]):
        return f"its final line says {steps} steps, its step lines count to {', '.join(map(str, totals))}"
    beyond = next(((step, ms) for step, ms in lines if step > steps or ms > final["train_time_ms"]), None)
    if beyond:
        return (f"its final line says {steps} steps in {final['train_time_ms']} ms, a step line says step "
                f"{beyond[0]} at {beyond[1]} ms")
    last = log.val_points[-1] if log.val_points else None
    if last is None or last[0] != steps:
        return f"its final line says {steps} steps, but no validation line is at step {steps}"
    if f"{last[1]:.4f}" != f"{final['val_loss']:.4f}" or last[2] != final["train_time_ms"]:
        return (f"its final line says val_loss {final['val_loss']:.4f} at {final['train_time_ms']} ms, its last "
                f"validation {last[1]:.4f} at {last[2]} ms")
    return None


# ----------------------------------------------------------------------------- the rules, each log


@rule("sealed")
def check_sealed(series):
    for log in series.logs():
        if not log.sealed:
            raise Broken(f"{log.path}: a version-{log.version} log is not sealed; records are made from sealed logs "
                         "(this repository's trainer writes them): rerun the run")


@rule("finished")
def check_finished(series):
    for log in series.logs():
        if not log.finished:
            raise Broken(f"{log.path}: the run {log.describe_ending()}; only finished runs make a record")


@rule("track")
def check_track(series):
    name = series.track["name"]
    for log in series.logs():
        if log.config.get("track") != name:
            raise Broken(f"{log.path}: the run's config says track {log.config.get('track')!r}, not {name!r}")


@rule("hardware")
def check_hardware(series):
    """Each environment value the track names fully matches its regex (required_environment)."""
    for log in series.logs():
        for key, pattern in series.track.get("required_environment", {}).items():
            value = log.environment.get(key, "")
            if not re.fullmatch(pattern, value):
                raise Broken(f"{log.path}: environment {key} is {value!r}, the track requires /{pattern}/ (runs on "
                             "other hardware belong in bench/, not in this track)")


@rule("fixed-config", made_only=True)
def check_fixed_config(series):
    """The runs and re-runs keep the setup the track fixes (fixed_config); baseline runs run the baseline's.
    A key a log lacks came after its code, which ran the key's default: a track fixes a key it adds
    at that default, so the key is no change. Made only: the logs of earlier records lack keys."""
    for log in [*series.runs, *series.reruns]:
        for key, value in series.track.get("fixed_config", {}).items():
            if key in log.config and log.config[key] != value:
                raise Broken(f"{log.path}: the run's config changes {key}, which the track fixes (track.json "
                             "fixed_config): an entry may change the optimizer and its schedule, not the setup")


@rule("val-tokens")
def check_val_tokens(series):
    expected = series.track.get("val_tokens")
    for log in series.logs():
        if expected is not None and log.config.get("val_tokens") != expected:
            raise Broken(f"{log.path}: the run validated on val_tokens={log.config.get('val_tokens')}, the track "
                         f"evaluates on {expected}")


@rule("train-val-apart")
def check_train_val_apart(series):
    """A run read val data and train data, and no file (by path or by content) as both."""
    for log in series.logs():
        val, train = data_read(log, "val_files"), data_read(log, "train_files")
        for what, used in (("val", val), ("train", train)):
            if not used:
                raise Broken(f"{log.path}: no data line of the run matches its {what}_files "
                             f"({log.config.get(what + '_files')!r}): a record's run reads its {what} data and says so")
        both = [fp for fp in train if fp["path"] in {v["path"] for v in val}
                or data_identity([fp])[0] in data_identity(val)]
        if both:
            raise Broken(f"{log.path}: the run read {both[0]['path']} as train data and as val data: a run never "
                         "trains on what it is validated on")


@rule("data")
def check_data(series):
    """The files the run's val_files and train_files matched are the track's: its val_data and
    train_data fingerprints (by size and content hashes) where it lists them, else files of the
    names data_names gives."""
    for log in series.logs():
        for key, what in (("val_files", "val"), ("train_files", "train")):
            used = data_read(log, key)
            names = ", ".join(dict.fromkeys(fp["path"] for fp in used)) or "none"
            required = series.track.get(f"{what}_data")
            if required and data_identity(used) != data_identity(required):
                raise Broken(f"{log.path}: the run's {what} data ({names}) is not the track's {what} data "
                             f"({', '.join(fp['path'] for fp in required)}, by size and content hashes)")
            pattern = series.track.get("data_names", {}).get(what)
            if pattern and not all(fnmatch.fnmatchcase(Path(fp["path"]).name, pattern) for fp in used):
                raise Broken(f"{log.path}: the run's {what} data ({names}) is not the track's {what} data (files "
                             f"named {pattern})")


@rule("final-line")
def check_final_line(series):
    for log in series.logs():
        disagreement = final_disagreement(log)
        if disagreement:
            raise Broken(f"{log.path}: {disagreement}: a log's final line is its last step's result (the log was made "
                         "by another writer, or resealed after an edit)")


@rule("started")
def check_started(series):
    """Every log says when its run started, and no run started after the tool's own clock."""
    for log in series.logs():
        when = started_at(log)
        if when is None:
            raise Broken(f"{log.path}: its environment has no start time (started: "
                         f"{log.environment.get('started')!r}), so the record's date cannot be checked")
        if when > series.now:
            raise Broken(f"{log.path}: the run started {when.isoformat()}, after this tool's clock "
                         f"({series.now.isoformat(timespec='seconds')}): a run is logged when it starts; check the "
                         "clock of the machine that ran it")


@rule("idle")
def check_idle(series):
    """On a track ranked by train time, no timed run (the baseline's and the re-runs too) ran beside
    other work: the trainer writes BUSY_WARNING where the load average says it did."""
    if not series.by_time:
        return
    for log in series.logs():
        busy = next((line for line in log.info if line.startswith(BUSY_WARNING)), None)
        if busy:
            raise Broken(f"{log.path}: says {busy[:80]!r}...: its time was measured beside other work, and the "
                         "track times runs on an otherwise idle machine: run the series again on an idle one")


@rule("commit", made_only=True)
def check_commit(series):
    """Each log names a commit this checkout has, and embeds that commit's files: a dirty tree, a
    run outside git (git_commit none) and a commit this checkout lacks are refused. The re-runs
    that reproduce.py recreates run outside git: theirs is the current record's program
    (one-program), whose logs were checked so when it was made."""
    looked_up = {}
    for log in series.logs():
        commit = commit_of(log)
        if commit == OUTSIDE_GIT and series.current is not None and any(log is r for r in series.reruns):
            continue
        if commit.endswith(DIRTY_MARK):
            raise Broken(f"{log.path}: ran from a tree with uncommitted changes ({COMMIT_KEY} {commit}): commit the "
                         "change, then rerun from the clean tree (a clone at that commit)")
        if not COMMIT_ID.fullmatch(commit):
            raise Broken(f"{log.path}: its {COMMIT_KEY} is {commit!r}, not a commit: a record's runs ran from a clone "
                         "of this repository at a commit, which their logs name")
        key = (commit, log.code_id)
        if key not in looked_up:
            looked_up[key] = commit_difference(series.repo_root, commit, log.sources)
        if looked_up[key]:
            raise Broken(f"{log.path}: {looked_up[key]}")


def commit_difference(repo_root, commit, sources):
    """Why the {relpath: bytes} `sources` are not the files of `commit` in the git checkout at
    repo_root (the commit missing, a file not its), or None."""
    def git(*args):
        return subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True, timeout=GIT_TIMEOUT_S)
    try:
        if git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            return (f"names {COMMIT_KEY} {commit}, which this checkout ({repo_root}) does not have: fetch it, or make "
                    "the record in a clone that has it")
        listing = git("ls-tree", "-z", commit, "--", *sources).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot look up {COMMIT_KEY} {commit} in {repo_root} with git ({e})"
    committed = {}
    for entry in filter(None, listing.split(b"\0")):
        info, _, path = entry.partition(b"\t")
        committed[path.decode("utf-8", "replace")] = info.split()[-1].decode("ascii", "replace")
    for relpath, content in sorted(sources.items()):
        if committed.get(relpath) != git_blob_id(content):
            return (f"its embedded {relpath} is not that file of {COMMIT_KEY} {commit}: a log's sources are its "
                    "commit's files")
    return None


# ----------------------------------------------------------------------------- the rules, the series


@rule("one-program")
def check_one_program(series):
    """The logs of each group ran one program: the same code (the same set of (path, sha256)) and the
    same config apart from FREE_CONFIG_KEYS; the re-runs the current record's."""
    for role, logs in series.groups():
        for other in logs[1:]:
            if other.code_id != logs[0].code_id:
                raise Broken(f"{role} logs come from different code: {describe_code_difference(logs[0], other)}")
            if free_config(other) != free_config(logs[0]):
                raise Broken(f"{role} logs ran different configs: {describe_config_difference(logs[0], other)}")
    if series.reruns and series.current is not None:
        first, rerun = series.current, series.reruns[0]
        if rerun.code_id != first.code_id:
            raise Broken(f"--current-record-logs: {describe_code_difference(first, rerun)}: re-runs of the current "
                         f"record {series.current_name} run its code (a clone at its commit)")
        if free_config(rerun) != free_config(first):
            raise Broken(f"--current-record-logs: {describe_config_difference(first, rerun)}: re-runs of the "
                         f"current record {series.current_name} run its config")


@rule("trained")
def check_trained(series):
    for log in series.logs():
        if log.final["train_time_ms"] <= 0:
            raise Broken(f"{log.path}: a run with 0 ms of training is not a run: check its num_iterations")


@rule("distinct-seeds")
def check_distinct_seeds(series):
    """Within each group every run ran another seed: a seed run twice is one run counted twice."""
    for role, logs in series.groups():
        seen = {}
        for log in logs:
            seed = repr(log.config.get("seed"))
            if seed in seen:
                raise Broken(f"{seen[seed].path} and {log.path} both ran seed {seed}: {role} runs are distinct seeds "
                             "(a seed run again repeats a run, it adds no evidence)")
            seen[seed] = log


@rule("baseline-program")
def check_baseline_program(series):
    """Where the track defines its baseline, each baseline run (and each run of --remeasured-baseline
    and --set-target-from-these-logs) runs its entry script with every source it embeds in one of the
    versions baseline.code lists, and the baseline's config (free keys aside)."""
    definition = series.track.get("baseline")
    if not definition:
        return
    for log in [*series.baseline, *(series.runs if series.runs_are_baseline else [])]:
        entry = log.config.get("entry")
        if entry != definition["entry"]:
            raise Broken(f"{log.path}: runs {entry}, not the track's baseline script {definition['entry']} "
                         "(track.json baseline): baseline runs run the baseline")
        versions = definition["code"]
        if not any(log.declared_sha256 == version for version in versions):
            closest = max(versions, key=lambda v: (v.get(entry) == log.declared_sha256.get(entry),
                                                    len(v.items() & log.declared_sha256.items())))
            path = min(p for p in set(closest) | set(log.declared_sha256)
                       if closest.get(p) != log.declared_sha256.get(p))
            raise Broken(f"{log.path}: its {path} has sha256 {log.declared_sha256.get(path)}, which is not in a "
                         "version of the track's baseline (track.json baseline.code lists each version's sources): "
                         "run the baseline as it is")
        changed = sorted(k for k in set(free_config(log)) | set(definition["config"])
                         if log.config.get(k) != definition["config"].get(k))
        if changed:
            raise Broken(f"{log.path}: the baseline run changes {', '.join(changed)} of the baseline's config "
                         "(track.json baseline.config): run the baseline as it is")


@rule("interleaved")
def check_interleaved(series):
    """The runs, the baseline runs and the re-runs ran in one series: no group's first run started
    after another group's last run had started (their spans of start times overlap)."""
    spans = [(role, min(map(started_at, logs)), max(map(started_at, logs))) for role, logs in series.groups()]
    for role, first, _ in spans:
        for other, _, last in spans:
            if first > last:
                raise Broken(f"{role} runs started from {first.isoformat()}, after every {other} run had started "
                             f"(the last at {last.isoformat()}): a record's runs, its baseline's runs and the re-runs "
                             "are interleaved in one series (per seed a baseline run, a re-run, a run)")


@rule("one-machine")
def check_one_machine(series):
    """Every run (the baseline's and the re-runs included) on one machine, or the reason; no reason
    without mixed machines. Records of format 2 name no machines."""
    if series.statistics_format < FORMAT_WITH_MACHINES:
        return
    runs, reason = series.logs(), series.machines_reason
    first = machine_of(runs[0], series.statistics_format)
    other = next((log for log in runs if machine_of(log, series.statistics_format) != first), None)
    if other is not None and not reason:
        theirs = machine_of(other, series.statistics_format)
        keys = [key for key in first if first[key] != theirs[key]]
        raise Broken(f"{runs[0].path} ran on {describe_machine({k: first[k] for k in keys})}, {other.path} on "
                     f"{describe_machine({k: theirs[k] for k in keys})}: a record's runs and its baseline's run on one "
                     'machine (--mixed-machines-reason "why" makes the record anyway and states the reason)')
    if other is None and reason is not None:
        raise Broken(f"--mixed-machines-reason is given, but every run ran on {describe_machine(first)}")


@rule("one-commit")
def check_one_commit(series):
    """The record's runs at one commit, or the reason; no reason where they ran at one."""
    if series.statistics_format < FORMAT_WITH_MACHINES:
        return
    logs, reason = series.runs, series.commits_reason
    other = next((log for log in logs if commit_of(log) != commit_of(logs[0])), None)
    if other is not None and not reason:
        raise Broken(f"{logs[0].path} ran at {COMMIT_KEY} {commit_of(logs[0])}, {other.path} at {commit_of(other)}: "
                     'a record\'s runs run at one commit (--mixed-commits-reason "why" makes the record anyway and '
                     "states the reason)")
    if other is None and reason is not None:
        raise Broken(f"--mixed-commits-reason is given, but every run ran at {COMMIT_KEY} {commit_of(logs[0])}")


@rule("date", made_only=True)
def check_date(series):
    """--date is the day the record is made: not before any run or re-run started (on its own clock)."""
    for log in [*series.runs, *series.reruns]:
        day = started_at(log).date().isoformat()
        if series.date < day:
            raise Broken(f"--date {series.date} is before the run {log.run_id} started ({day}): a record's date is "
                         "the day it is made, after its runs")


def new_program_refusal(log, records):
    """A record's runs (`log`, its first) ran a program no record of the track's table ran:
    `records` [(folder name, its first log)]. The refusal's line, or None."""
    for name, other in records:
        if program(other) == program(log):
            return (f"{log.path}: runs the code and config of the record {name}: a record is a new program (its "
                    "sources or its config differ from every record's); a re-run of a record is not another "
                    "(rule: new-program)")
    return None


RULES.append(Rule("new-program", None))   # checked once the status is known: only a record must be new
