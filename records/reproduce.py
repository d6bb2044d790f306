"""Recreate the exact source files a log embeds, and optionally rerun them with the logged config.

    python records/reproduce.py LOG [--dir OUT] [--run [--other-data]] [-- extra args for the training script]

The log is verified first (every line must match its seal, every embedded
source its sha256; the earliest, version-1 logs have no seals). The
sources are written to OUT (default: reproduce_<run_id> in the system's temp
folder) under their logged paths, and the logged config to OUT/config.json, its
log_dir set to OUT/logs: the rerun's log (and checkpoint) go there, never where
the original run wrote. OUT must not exist, be empty, or hold this log's
recreation already (from an earlier reproduce.py LOG, then reused); it is filled
in a hidden folder next to it and renamed into place, so it appears whole or not
at all. Next to the sources go the data files they read from their own folder:
an embedded source that defines
`<NAME>_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "<file>")`
and `<NAME>_SHA256 = "<hex>"` (data/tokenizer.py's prefix-token table and
non-canonical pairs) gets a copy of this checkout's <file>, which must have the
sha256 that the embedded source pins. The command that reruns the run is
printed; with --run it is executed from the current directory (run this from the
repository root, which the data paths in the config are relative to), after the
data files the rerun will read (the config's train_files and val_files, or their
--key=value overrides after `--`) are compared with the log's fingerprints of the
files the run read: other, missing or extra files are refused unless --other-data
is given. --run executes the code the log embeds (it says so first): read it in
OUT before running a log that is not your own. Afterwards it prints the logged
result beside the rerun's. Nothing is written when the log or the data are
refused; neither OUT nor a --log_dir given after `--` may lie in this
repository's records/ folder, which only make_record.py writes.

    python OUT/<entry> --config OUT/config.json                      (world_size 1)
    python -m torch.distributed.run --standalone --nproc_per_node=N \\
        OUT/<entry> --config OUT/config.json                         (world_size N)
"""

import argparse
import glob
import hashlib
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path, PurePosixPath

REPO = Path(__file__).resolve().parents[1]  # the checkout whose data files are copied next to the sources
sys.path.insert(0, str(REPO))
from data.shards import ShardError, fingerprint  # noqa: E402
from records.logfile import LogError, parse_log, read_regular_file, verify  # noqa: E402

EXIT_REFUSED = 2  # exit code when the log, the data or the output folder is refused
CONFIG_NAME = "config.json"
LOGS_NAME = "logs"  # the rerun's log folder inside OUT
REBUILT = ("__pycache__",)  # folders a rerun leaves among the recreated sources
DATA_PATTERN_KEYS = ("val_files", "train_files")  # config keys naming the data files a run reads (glob patterns)
DATA_FOLDER = "data"  # the repository's data folder, relative to the repository root: where a rerun's data lies
MAX_WORLD_SIZE = 1024  # the most processes a logged run can have had
PINNED_MAX_BYTES = 64 * 2**20  # the largest data file a log's sources pin (data/tokenizer.py's tables: a few MiB)
FINGERPRINT_KEYS = ("bytes", "tokens", "header_sha256", "head_sha256", "tail_sha256")  # a data file's identity
PINNED_PATH = re.compile(  # a source's data file next to it: NAME_PATH = os.path.join(<its folder>, "file")
    r'^(?P<name>[A-Z][A-Z0-9_]*)_PATH = os\.path\.join\(os\.path\.dirname\(os\.path\.abspath\(__file__\)\), '
    r'"(?P<file>(?!\.\.?")[^"/\\]+)"\)$', re.M)


def default_output_dir(run_id):
    return Path(tempfile.gettempdir()) / f"reproduce_{run_id}"


def pinned_data_files(log):
    """{relpath: sha256} of the data files the log's sources read from their own folder and pin
    (PINNED_PATH with a NAME_SHA256 constant of 64 hex digits in the same source)."""
    pinned = {}
    for relpath, content in sorted(log.sources.items()):
        text = content.decode("utf-8", errors="replace")
        for m in PINNED_PATH.finditer(text):
            sha = re.search(rf'^{m["name"]}_SHA256 = "([0-9a-f]{{64}})"$', text, re.M)
            if sha:
                pinned[posixpath.join(posixpath.dirname(relpath), m["file"])] = sha[1]
    return pinned


def checkout_data_files(log, checkout=REPO):
    """{relpath: bytes} of the pinned data files (pinned_data_files), read from `checkout`; refuses a
    file that is missing or whose sha256 is not the pinned one."""
    files = {}
    for relpath, expected in pinned_data_files(log).items():
        path = checkout / relpath
        try:
            content = read_regular_file(path, PINNED_MAX_BYTES)
        except OSError as e:
            raise LogError(f"{path}: cannot read it ({e.strerror}); the log's sources read it (its sha256 is pinned "
                           f"in the log's copy of {posixpath.dirname(relpath) or '.'}/): restore it") from None
        actual = hashlib.sha256(content).hexdigest()
        if actual != expected:
            raise LogError(f"{path}: sha256 is {actual}, but the log's sources pin {expected}: this checkout has "
                           f"another version of the file than the run read (the run's commit: "
                           f"{log.environment.get('git_commit', 'unknown')})")
        files[relpath] = content
    return files


def inside_records(path):
    """Whether `path` (which need not exist) lies in this repository's records/ folder, symbolic
    links followed."""
    records = os.path.realpath(REPO / "records")
    return os.path.commonpath([os.path.realpath(path), records]) == records


def rerun_config(log, out):
    """The logged config, its log_dir (where it has one) OUT/logs: the rerun writes there."""
    config = dict(log.config)
    if "log_dir" in config:
        config["log_dir"] = str(out / LOGS_NAME)
    return config


def recreation(log, out, data_files):
    """{relpath: bytes} of the files the recreated tree holds: the sources, the data files, the config."""
    files = {**log.sources, **data_files}
    top = {relpath.split("/", 1)[0] for relpath in files}
    clash = next((name for name in (CONFIG_NAME, LOGS_NAME) if name in top), None)
    if clash:
        raise LogError(f"{log.path}: an embedded source or data file is named {clash}, which the recreated tree "
                       f"keeps for the rerun's {'config' if clash == CONFIG_NAME else 'log'}: not a run of this "
                       f"repository")
    config = json.dumps(rerun_config(log, out), indent=2) + "\n"
    return {**files, CONFIG_NAME: config.encode("utf-8")}


def holds_recreation(out, files):
    """Whether the folder `out` holds exactly the {relpath: bytes} `files` (besides the rerun's logs and
    byte-code caches), found without reading anything else: a name the recreation lacks ends the look,
    a folder it lacks is never listed, each file is read up to its expected size."""
    folders = {"/".join(parts[:i]) for parts in (relpath.split("/") for relpath in files) for i in range(1, len(parts))}
    found, pending = 0, [""]
    while pending:
        folder = pending.pop()
        with os.scandir(out / folder) as entries:
            for entry in entries:
                rel = posixpath.join(folder, entry.name) if folder else entry.name
                if rel == LOGS_NAME or entry.name in REBUILT:
                    continue
                if entry.is_dir(follow_symlinks=False) and rel in folders:
                    pending.append(rel)
                elif entry.is_file(follow_symlinks=False) and rel in files and same_bytes(entry.path, files[rel]):
                    found += 1
                else:
                    return False
    return found == len(files)


def same_bytes(path, expected):
    """Whether the regular file at `path` holds `expected`, read up to its size."""
    try:
        return read_regular_file(path, len(expected)) == expected
    except OSError:
        return False


def recreate_sources(log, out, data_files=None):
    """Write the log's sources under `out`, the `data_files` {relpath: bytes} next to them and the
    config (rerun_config) to out/config.json, in a hidden folder next to `out` renamed into place.
    `out` must be absent, empty, or hold exactly this recreation (then it is kept: True)."""
    files = recreation(log, out, data_files or {})
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if out.is_dir() and holds_recreation(out, files):
            return True
        raise LogError(f"{out}: exists and is neither empty nor this log's recreation; choose another --dir or "
                       f"remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        for relpath, content in files.items():
            dest = staging / relpath
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(content)
        staging.chmod(0o755)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return False


def data_patterns(log, extra_args):
    """The glob patterns of the data the rerun reads: the config's, or their last --key=value in extra_args."""
    patterns = {key: log.config[key] for key in DATA_PATTERN_KEYS if isinstance(log.config.get(key), str)}
    for arg in extra_args:
        key, sep, value = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and sep and key in DATA_PATTERN_KEYS:
            patterns[key] = value
    return patterns


def data_difference(log, extra_args):
    """The first way the data the rerun would read (from the current directory) differs from what the
    logged run read (its fingerprints), as a phrase; None when they are the same files."""
    logged = {fp.get("path"): fp for fp in log.data}
    patterns = data_patterns(log, extra_args)
    outside = next(((key, p) for key, p in patterns.items() if not inside_data_folder(p)), None)
    if outside:
        return (f"its {outside[0]} {outside[1]!r} reaches outside the repository's data folder ({DATA_FOLDER}/), where "
                "a rerun's data lies (this tool lists only the files there)")
    read = {}
    for key, pattern in patterns.items():
        for path in sorted(glob.glob(pattern)):
            read.setdefault(path, key)
    for path in logged:
        if path not in read:
            where = "is not matched by the rerun's patterns" if Path(path).exists() else f"is missing in {Path.cwd()}"
            return f"the run read {path}, which {where}"
    for path, key in read.items():
        if path not in logged:
            return f"{path} matches the rerun's {key} ({patterns[key]}), but the run did not read it"
        try:
            now = fingerprint(path)
        except ShardError as e:
            return str(e)
        changed = [k for k in FINGERPRINT_KEYS if now.get(k) != logged[path].get(k)]
        if changed:
            return f"{path} is not the file the run read (its {', '.join(changed)} differ from the log's fingerprint)"
    return None


def inside_data_folder(pattern):
    """Whether the glob pattern names files under DATA_FOLDER (relative, no '..', no absolute path)."""
    parts = PurePosixPath(pattern).parts
    return len(parts) > 1 and parts[0] == DATA_FOLDER and ".." not in parts and "\\" not in pattern


def check_data(log, extra_args):
    """Refuse a rerun on other data than the logged run's (data_difference)."""
    difference = data_difference(log, extra_args)
    if difference:
        raise LogError(f"{log.path}: {difference}; a rerun on other data does not reproduce the run: fetch or build "
                       "the run's data (the CPU track's: python data/tiny_corpus.py), "
                       "or pass --other-data to run anyway")


def rerun_command(log, out, extra_args):
    """The argv that reruns the log's entry script from `out` with the logged config and world size
    (a whole number of processes, checked before it becomes an argument)."""
    logged = log.environment.get("world_size", "1")
    try:
        world_size = int(logged)
    except ValueError:
        raise LogError(f"{log.path}: environment world_size {logged!r} is not an integer") from None
    if not 1 <= world_size <= MAX_WORLD_SIZE:
        raise LogError(f"{log.path}: environment world_size {logged!r} is not a number of processes (1 to "
                       f"{MAX_WORLD_SIZE}): not a run of this repository's trainer")
    script = [str(out / log.config["entry"]), "--config", str(out / CONFIG_NAME), *extra_args]
    if world_size == 1:
        return [sys.executable, *script]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
    return [sys.executable, *launcher, *script]


def parse_args(argv):
    """Split off the arguments after '--' (passed to the training script), then parse the rest."""
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    else:
        extra = []
    parser = argparse.ArgumentParser(description="Recreate a logged run's sources and (with --run) rerun it.")
    parser.add_argument("log", help="a run log, or a record's folder (its first run)")
    parser.add_argument("--dir", type=Path, help="output folder (default: <tmp>/reproduce_<run_id>)")
    parser.add_argument("--run", action="store_true", help="run the recreated script from the current directory")
    parser.add_argument("--other-data", action="store_true",
                        help="with --run: run even if the data files differ from the logged run's fingerprints")
    args = parser.parse_args(argv)
    args.extra = extra
    return args


def refuse_records_folders(log, out, extra_args):
    """Neither the recreated tree nor a --log_dir given after `--` may lie in this repository's
    records/ folder (the rerun's own check compares with the recreated tree's records/)."""
    if inside_records(out):
        raise LogError(f"--dir {out} is inside the repository's records/ folder, which only records/make_record.py "
                       f"writes: recreate the run elsewhere (the default is {default_output_dir(log.run_id)})")
    for arg in extra_args:
        key, sep, value = arg.removeprefix("--").partition("=")
        if arg.startswith("--") and sep and key == "log_dir" and value and inside_records(value):
            raise LogError(f"--log_dir={value} is inside the repository's records/ folder, which only "
                           f"records/make_record.py writes: log elsewhere (the default is {out / LOGS_NAME})")


def run_logs(out):
    """The logs in the rerun's log folder OUT/logs."""
    return set((out / LOGS_NAME).glob("*.txt")) if (out / LOGS_NAME).is_dir() else set()


def describe_result(log):
    if not log.finished:
        return f"the run {log.describe_ending()}"
    return (f"final val_loss {log.final['val_loss']:.4f}, train_time {log.final['train_time_ms'] / 1000:.1f} s, "
            f"{log.final['steps']} steps")


def compare_with_original(log, new_logs):
    """The lines that put the rerun's result (its one new log) beside the logged one."""
    if len(new_logs) != 1:
        return [f"original run {log.run_id}: {describe_result(log)}"]
    (path,) = new_logs
    try:
        rerun = parse_log(path)
    except LogError as e:
        return [f"original run {log.run_id}: {describe_result(log)}", f"rerun: its log cannot be read ({e})"]
    lines = [f"original run {log.run_id}: {describe_result(log)}",
             f"this rerun {rerun.run_id}: {describe_result(rerun)}"]
    if log.finished and rerun.finished:
        same = "the same" if f"{rerun.final['val_loss']:.4f}" == f"{log.final['val_loss']:.4f}" else \
            f"{rerun.final['val_loss'] - log.final['val_loss']:+.4f}"
        ratio = rerun.final["train_time_ms"] / max(log.final["train_time_ms"], 1)
        lines.append(f"val_loss {same}; train_time {ratio:.2f}x the original's (log: {path})")
    return lines


def run_log_path(path):
    """`path`, or for a record's folder the log of its first run (statistics.json's runs: the
    folder also keeps the re-runs of the record it beat)."""
    if not os.path.isdir(path):
        return path
    try:
        with open(os.path.join(path, "statistics.json"), encoding="utf-8") as f:
            return os.path.join(path, json.load(f)["runs"][0]["log"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise LogError(f"{path} is a folder but no record's (no statistics.json naming its runs): give a run log "
                       f"or a record's folder") from None


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    out = args.dir
    try:
        log = parse_log(run_log_path(args.log))
        verify(log)
        out = (args.dir or default_output_dir(log.run_id)).absolute()
        refuse_records_folders(log, out, args.extra)
        command = rerun_command(log, out, args.extra)
        data_files = checkout_data_files(log)
        if args.run and not args.other_data:
            check_data(log, args.extra)
        kept = recreate_sources(log, out, data_files)
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:
        print(f"error: {e.filename or out}: {e.strerror}; choose another --dir", file=sys.stderr)
        return EXIT_REFUSED
    shipped = f", {len(data_files)} data file(s) they read ({', '.join(data_files)})" if data_files else ""
    done = "found" if kept else "recreated"
    print(f"{done} {len(log.sources)} source file(s){shipped} and {CONFIG_NAME} in {out}")
    if not log.sealed:
        print(f"note: a version-{log.version} log has no seals: only its sources' sha256 were checked")
    if not log.finished:
        print(f"note: the logged run {log.describe_ending()}")
    print("rerun with:", shlex.join(command))
    if not args.run:
        return 0
    print(f"note: --run executes the code this log embeds ({len(log.sources)} file(s) in {out}, entry "
          f"{log.config['entry']}): read it first if the log is not your own", flush=True)
    before = run_logs(out)
    code = subprocess.run(command).returncode
    for line in compare_with_original(log, run_logs(out) - before):
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
