"""Turn the logs of N runs into a record folder and update the README's table for the track.

    python records/make_record.py --track track_cpu --name MyChange --logs logs/a.txt logs/b.txt logs/c.txt \
        [--baseline-logs ...] [--current-record-logs ...] [--description "what changed, in full"] \
        [--changed "what changed, in a few words"] [--author NAME] [--date YYYY-MM-DD] \
        [--mixed-machines-reason "why"] [--mixed-commits-reason "why"]
    python records/make_record.py --track track_cpu --remake records/track_cpu/<record> [--changed ...] [--author ...]
    python records/make_record.py --track track_cpu --tables

Every log (the runs, the baseline runs, the current record's re-runs) is parsed and verified
(records/logfile.py): a regular file named <run id>.txt, every line matching its seal, every
embedded source its sha256. The series they make is checked by the rules a record claims
(records/rules.py, listed in records/FORMAT.md): sealed and finished runs of the track's data,
hardware and setup, whose final lines agree with their steps, started before now on an idle
machine, at a commit of this checkout whose files they embed; one program per group, distinct
seeds, the baseline's own program, interleaved in one series on one machine at one commit (or
a reason); a record a new program. Baseline logs are runs of a record folder of the track
(referenced, not copied); no run id is part of a record already. Every other record of the track
must still be what its logs give, by the same rules (all but the made-only ones): its
statistics.json recomputed from its sealed logs and compared value for value, its README.md and
statistics.txt with what this tool writes from them, and the folder holding nothing else, before
any table is built from it. Any refusal prints one line and exits with code 2 before anything is
written; a refused result's line carries its statistics and what would change them.

One make_record.py at a time writes a records root: each takes its lock (waiting up to
LOCK_WAIT_S for another) before it reads the records and keeps it until it has written.

The tables are rewritten in the main README (--readme) and in the track's own README.md where
it holds the track's markers (records/FORMAT.md, "The README tables"). Nothing is visible before
every check has passed: the record folder is built in a hidden folder next to its destination,
the README tables (and track.json, with --set-target-from-these-logs) in temporary files next to
theirs; then the folder is renamed into place and each temporary file renamed over its
destination.

The record folder records/<track>/<date>_<name>/ holds the logs (and the current record's re-runs)
and what this tool computes from them: statistics.json and statistics.txt, val_loss.png and a
README, which names the author, what changed, the machine and the commit the runs ran on. A log
is its run's snapshot (records/reproduce.py recreates the sources from it). The statistics: n,
mean and sample std of the final val loss, a one-sided one-sample t-test of H1 "mean < target",
train time summaries, and with baseline logs one-sided Welch t-tests of H1 "record < baseline" on
final val loss and on train time, plus the speed-up of mean train times; with the current
record's re-runs the Welch test of the train time against them.

A result is a record when it has at least the track's min_runs runs and p < p_threshold, and on
a track ranked by train time when it is faster than the current record (decide_status): on a
track that defines its baseline (track_cpu) significantly faster than its interleaved baseline
runs, significantly faster than the current record's re-runs of the same series, and with a
speed-up over its baseline above the current record's. Anything else is refused unless
--allow-non-record is given, which writes the folder marked "not a record" (kept out of the
README table); such a folder gives its runs up to a later record made with all of them, which
replaces it. A track whose target is still null (the CPU track before its baseline) needs
--set-target-from-these-logs: the mean final val loss of these logs becomes the target in
track.json, and the record is marked as the one that set it. --remeasured-baseline keeps the
track's baseline runs on another machine (status "baseline", not in the table) for the records
made there.

A track whose track.json says "metric": "steps" (the optimization tracks) ranks its records by
the steps their runs trained, fewest first; a run that changes a value of the track's
fixed_config (its model, data, batch, validation) is refused; with z_margin the public
optimization track's rule decides a record, (target - mean) x sqrt(n) >= z_margin, else the
t-test; its table gives each record's pairwise statistic against the previous record (ordered
by date, then by when its runs started).

--remake rebuilds an existing record folder from its own logs with this tool's files (the same
numbers and status; --changed and --author may be given); --tables rebuilds the track's tables.
"""

import argparse
import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

RECORDS_DIR = Path(__file__).resolve().parent  # default root of the track folders
sys.path.insert(0, str(RECORDS_DIR.parent))
from records import rules  # noqa: E402
from records.logfile import read_regular_file  # noqa: E402
from records.rules import RuleError, Series  # noqa: E402
from records.checked_records import checked_track_records, first_log_of, record_folder_logs  # noqa: E402
from records.readme_tables import current_record, table_files  # noqa: E402
from records.record_files import (DATE_PATTERN, METADATA_KEYS, REASON_KEYS, RecordError, SHORT_TEXT_MAX,  # noqa: E402
                                  STATISTICS_FORMAT, STATUS_BASELINE, STATUS_NOT_RECORD, STATUS_RECORD, STATUS_TARGET,
                                  TEXT_MAX_BYTES, expand_record_folders, read_log, recorded_runs, refuse_same_names,
                                  superseded_folders)
from records.record_writer import publish, publish_files, refuse_read_only, statistics_text, write_record  # noqa: E402
from records.series_stats import record_statistics, refusal_details  # noqa: E402

EXIT_REFUSED = 2  # exit code of every refusal
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # record and track names become folder names
LOCK_WAIT_S = 120.0  # how long make_record.py waits for another one holding the records root's lock
LOCK_POLL_S = 0.1  # how often it tries meanwhile


# ----------------------------------------------------------------------------- the lock


@contextlib.contextmanager
def records_lock(records_dir):
    """Hold the records root's lock (flock on the folder itself) inside the block: one
    make_record.py at a time reads the records and writes them. Waits up to LOCK_WAIT_S for another."""
    fd = os.open(records_dir, os.O_RDONLY | os.O_DIRECTORY)
    wait_s = LOCK_WAIT_S
    try:
        deadline, said = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            if time.monotonic() >= deadline:
                raise RecordError(f"another make_record.py is writing {records_dir} (it has held its lock for over "
                                  f"{wait_s:g} s): wait for it to finish, then run this again")
            if not said:
                print(f"waiting for another make_record.py writing {records_dir} ...", flush=True)
                said = True
            time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)                   # closing the folder releases the lock



@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C ignored inside the block: what makes a record visible (the renames) and says so runs
    to its end, so that an interrupt before it leaves nothing written and none comes in between."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:             # not the main thread, which no signal interrupts
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


# ----------------------------------------------------------------------------- command line


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description="Build a record folder from run logs and update the README table.",
        epilog="Exit code 2 (and nothing written) when the logs are refused.",
    )
    parser.add_argument("--track", required=True, help="track folder name, e.g. track_cpu")
    parser.add_argument("--name", help="record name (letters, digits, '_', '-', '.')")
    parser.add_argument("--logs", nargs="+", default=[], help="logs of the runs (<run id>.txt)")
    parser.add_argument(
        "--baseline-logs", nargs="+", default=[], help="logs (or a record folder) to compare against: Welch t-tests"
    )
    parser.add_argument(
        "--current-record-logs", nargs="+", default=[],
        help="the track's current record re-run in the same series as --logs and --baseline-logs (on a track ranked "
        "by train time that defines its baseline, a record beats them significantly)",
    )
    parser.add_argument("--description", default="", help="what changed, in full (goes into the record README)")
    parser.add_argument("--changed", help=f"what changed, in at most {SHORT_TEXT_MAX} characters (the tables' "
                        "what-changed column)")
    parser.add_argument("--author", help=f"who made the change (at most {SHORT_TEXT_MAX} characters), credited in "
                        "the record")
    parser.add_argument("--date", default=None, help="YYYY-MM-DD (default: today)")
    parser.add_argument("--allow-non-record", action="store_true", help="write the folder even if not a record")
    parser.add_argument(
        "--set-target-from-these-logs",
        action="store_true",
        help="for a track whose target is null: set it to the mean final val loss of these logs",
    )
    parser.add_argument(
        "--remeasured-baseline",
        action="store_true",
        help="these runs re-measure the track's baseline on another machine: written with status "
        "'baseline', kept out of the README table, for records made there to pass as --baseline-logs",
    )
    parser.add_argument(
        "--mixed-machines-reason",
        help="why the runs (or the baseline's runs) ran on more than one machine (cpu, hostname): without it such "
        "logs are refused; the record's README and statistics state it",
    )
    parser.add_argument(
        "--mixed-commits-reason",
        help="why the runs ran at more than one git commit: without it such logs are refused; the record's README "
        "and statistics state it",
    )
    parser.add_argument("--remake", type=Path, help="rebuild this record folder of the track from its own logs "
                        "(the same numbers and status; --changed and --author may be given)")
    parser.add_argument("--tables", action="store_true", help="rebuild the track's tables from its records")
    parser.add_argument("--records-dir", type=Path, default=RECORDS_DIR, help="root of the track folders")
    parser.add_argument("--readme", type=Path, default=RECORDS_DIR.parent / "README.md", help="README to update")
    return parser.parse_args(argv)



def load_track(track_dir):
    path = track_dir / "track.json"
    try:
        track = json.loads(read_regular_file(path, TEXT_MAX_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise RecordError(f"{path}: no such track definition; is --track spelled right?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:
        raise RecordError(f"{path}: cannot read it ({e.strerror})") from None
    return track



def utf8_argument(value, flag):
    """A command-line value as text. Under a locale whose encoding is not UTF-8, Python hands the
    non-ASCII bytes of argv over as surrogate escapes; os.fsencode gives the bytes back, read as UTF-8."""
    if value is None:
        return None
    try:
        return os.fsencode(value).decode("utf-8")
    except UnicodeError:
        raise RecordError(f"{flag}: not UTF-8 text") from None



def decode_text_arguments(args):
    """The free-text arguments (which records keep) as UTF-8 text (utf8_argument)."""
    for flag in ("description", "mixed_machines_reason", "mixed_commits_reason", "changed", "author"):
        setattr(args, flag, utf8_argument(getattr(args, flag), "--" + flag.replace("_", "-")))



def check_short_text(value, flag):
    """--changed and --author go into table cells: one line, no '|', at most SHORT_TEXT_MAX characters."""
    if value is not None and (not value.strip() or len(value) > SHORT_TEXT_MAX or "|" in value
                              or any(c in value for c in "\r\n\t")):
        raise RecordError(f"{flag} {value[:80]!r}: give 1 to {SHORT_TEXT_MAX} characters on one line, without '|' "
                          f"(it goes into a table cell)")



def check_arguments(args, track, today):
    if not args.name:
        raise RecordError("--name is required (with --logs) to make a record")
    if not args.logs:
        raise RecordError("--logs is required (the logs of the record's runs)")
    if not NAME_PATTERN.fullmatch(args.name):
        raise RecordError(f"--name {args.name!r}: use letters, digits, '_', '-', '.', starting with a letter or digit")
    args.date = args.date or today.isoformat()
    try:
        if not DATE_PATTERN.fullmatch(args.date):
            raise ValueError
        datetime.date.fromisoformat(args.date)
    except ValueError:
        raise RecordError(f"--date {args.date!r} is not a date in the form YYYY-MM-DD") from None
    if args.date > today.isoformat():
        raise RecordError(f"--date {args.date} is in the future (today is {today.isoformat()}): give the day the "
                          f"record is made, or leave --date out")
    if args.set_target_from_these_logs and track["target_val_loss"] is not None:
        raise RecordError(
            f"track {args.track} already has target {track['target_val_loss']}; "
            "--set-target-from-these-logs only sets a null target"
        )
    if not args.set_target_from_these_logs and track["target_val_loss"] is None:
        raise RecordError(
            f"track {args.track} has no target yet (target_val_loss is null); "
            "its baseline record sets it with --set-target-from-these-logs"
        )
    if args.remeasured_baseline and (args.set_target_from_these_logs or args.baseline_logs):
        raise RecordError("--remeasured-baseline takes only the baseline's own runs: no --set-target-from-these-logs, "
                          "no --baseline-logs")
    if args.remeasured_baseline and "baseline" not in track:
        raise RecordError(f"track {args.track} defines no baseline script (track.json \"baseline\"), so there is no "
                          f"baseline to re-measure")
    if args.set_target_from_these_logs and len(args.logs) < track.get("min_runs", 1):
        raise RecordError(f"setting the target needs at least {track['min_runs']} runs, got {len(args.logs)}")



def track_folder(args):
    if not NAME_PATTERN.fullmatch(args.track):
        raise RecordError(f"--track {args.track!r} is not a track folder name (letters, digits, '_', '-', '.')")
    return args.records_dir / args.track



def current_record_runs(args, track, track_dir, records):
    """(the current record to beat, its first log, its re-runs in this series): on a track ranked by
    train time the best-ranked record, whose re-runs (--current-record-logs) run its program (the
    one-program rule)."""
    current = current_record(records, track)
    if current is None:
        if args.current_record_logs:
            raise RecordError(f"--current-record-logs: track {args.track} has no current record to compare with")
        return None, None, []
    if not args.current_record_logs:
        return current, None, []
    return current, first_log_of(track_dir / current["record"]), [read_log(p) for p in args.current_record_logs]



def refuse_an_old_program(s, first_log, records, track_dir):
    """A record (or a target) runs a program no record of the track's table ran (rules.new_program_refusal)."""
    if s["status"] not in (STATUS_RECORD, STATUS_TARGET):
        return
    table = [folder for folder, other in records if other["status"] in (STATUS_RECORD, STATUS_TARGET)]
    refusal = rules.new_program_refusal(first_log, [(folder.name, first_log_of(folder)) for folder in table])
    if refusal:
        raise RuleError(refusal)



def make_record(args):
    """Under the records root's lock (records_lock): remake, or check everything, then make the
    record folder, the target (if asked) and the README tables visible together (publish)."""
    decode_text_arguments(args)
    track_dir = track_folder(args)
    track = load_track(track_dir)
    with records_lock(args.records_dir):
        if args.remake or args.tables:
            remake(args, track_dir, track)
        else:
            make_new_record(args, track_dir, track)



def make_new_record(args, track_dir, track):
    """Check everything, then make the record folder, the target (if asked) and the README tables
    visible together (publish)."""
    today = datetime.date.today()
    check_arguments(args, track, today)
    check_short_text(args.changed, "--changed")
    check_short_text(args.author, "--author")
    folder = track_dir / f"{args.date}_{args.name}"
    if folder.exists():
        raise RecordError(f"{folder} already exists; choose another --name or --date")
    repo_root = args.readme.resolve().parent
    logs = [read_log(path) for path in args.logs]
    baseline_logs = [read_log(path) for path in expand_record_folders(args.baseline_logs, track_dir)]
    refuse_same_names(baseline_logs)
    records = checked_track_records(track_dir, track, repo_root)
    current, current_first, reruns = current_record_runs(args, track, track_dir, records)
    refuse_same_names(logs + reruns)
    series = Series(logs, track, baseline_logs, reruns, current_first, current["record"] if current else "",
                    date=args.date, repo_root=repo_root, machines_reason=args.mixed_machines_reason,
                    commits_reason=args.mixed_commits_reason,
                    runs_are_baseline=args.remeasured_baseline or args.set_target_from_these_logs)
    rules.check(series)
    recorded = recorded_runs(args.records_dir)
    superseded = superseded_folders(logs + reruns, recorded, records)
    flags = args.set_target_from_these_logs or args.remeasured_baseline
    s = {
        "format": STATISTICS_FORMAT,
        "track": args.track,
        "name": args.name,
        "date": args.date,
        "made": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "description": args.description,
        "mixed_machines_reason": args.mixed_machines_reason,
        "mixed_commits_reason": args.mixed_commits_reason,
        "author": args.author,
        "changed": args.changed,
        **record_statistics(logs, baseline_logs, track, args.set_target_from_these_logs, repo_root,
                            args.remeasured_baseline, STATISTICS_FORMAT, None if flags else current, reruns),
    }
    if s["status"] == STATUS_NOT_RECORD and not args.allow_non_record:
        raise RecordError(f"not a record: {s['status_reason']} ({refusal_details(s, track)}) (use --allow-non-record "
                          f"to keep it anyway)")
    refuse_an_old_program(s, logs[0], records, track_dir)

    kept = [(f, other) for f, other in records if f not in superseded]
    files, notes = table_files(args, track_dir, track, kept + [(folder, s)])
    if args.set_target_from_these_logs:
        track["target_val_loss"] = s["target_val_loss"]
        track["target_note"] = f"mean final val loss of the {s['n']} runs of record {folder.name}"
        files[track_dir / "track.json"] = json.dumps(track, indent=2) + "\n"
    for path in files:
        refuse_read_only(path)

    staging = Path(tempfile.mkdtemp(dir=track_dir, prefix=f".{folder.name}."))
    try:
        folder_rel = Path(os.path.relpath(folder, repo_root)).as_posix()
        write_record(staging, s, logs, baseline_logs, folder_rel, reruns)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    with interrupts_held():
        publish(staging, folder, files, superseded)
        print(statistics_text(s), end="")
        print(f"wrote {folder}")
        for old in superseded:
            print(f"replaced {old} (not a record): its runs are part of this record")
        for warning in notes:
            print(warning, file=sys.stderr)



def remake(args, track_dir, track):
    """--tables: rewrite the track's tables from its checked records. --remake FOLDER: rebuild one
    record folder with this tool's files (the current format) from its own logs, keeping its
    numbers, status and command-line values (--changed, --author replace theirs), then the tables."""
    repo_root = args.readme.resolve().parent
    records = checked_track_records(track_dir, track, repo_root)
    replaced = []
    if args.remake:
        check_short_text(args.changed, "--changed")
        check_short_text(args.author, "--author")
        folder = args.remake.resolve()
        old = next((s for f, s in records if f.resolve() == folder), None)
        if old is None:
            raise RecordError(f"--remake {args.remake}: not a record folder of {track_dir}")
        s, logs, baseline_logs, reruns = remade_statistics(folder, old, track, repo_root, args)
        records = [(f, s if f.resolve() == folder else other) for f, other in records]
        staging = Path(tempfile.mkdtemp(dir=track_dir, prefix=f".{folder.name}."))
        try:
            write_record(staging, s, logs, baseline_logs, Path(os.path.relpath(folder, repo_root)).as_posix(), reruns)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        replaced = [folder]
    files, notes = table_files(args, track_dir, track, records)
    for path in files:
        refuse_read_only(path)
    with interrupts_held():
        if replaced:
            publish(staging, replaced[0], files, replaced)
            print(f"re-made {replaced[0]}")
        else:
            publish_files(files)
            print(f"rewrote the {args.track} tables")
        for warning in notes:
            print(warning, file=sys.stderr)



def remade_statistics(folder, old, track, repo_root, args):
    """The statistics of the record in `folder` as this tool writes them now, from its logs and its
    command-line values; refused where a number or the status would change."""
    logs, reruns = record_folder_logs(folder, old)
    baseline_logs = [read_log(repo_root / path) for path in old["baseline"]["logs"]] if old["baseline"] else []
    current = ({key: old["current_record"][key] for key in ("record", "mean_train_time_ms", "speedup")}
               if old.get("current_record") else None)
    s = {key: old[key] for key in METADATA_KEYS} | {"format": STATISTICS_FORMAT}
    s |= {key: old.get(key) for key in REASON_KEYS}
    s |= {"author": args.author or old.get("author"), "changed": args.changed or old.get("changed")}
    s |= record_statistics(logs, baseline_logs, track, old["status"] == STATUS_TARGET, repo_root,
                           old["status"] == STATUS_BASELINE, STATISTICS_FORMAT, current, reruns)
    rules.check(Series(logs, track, baseline_logs, reruns, statistics_format=STATISTICS_FORMAT,
                       machines_reason=s["mixed_machines_reason"], commits_reason=s["mixed_commits_reason"]))
    s = json.loads(json.dumps(s))
    for key in ("status", "target_val_loss", "t_statistic", "p_value", "val_loss", "train_time_ms", "n"):
        if s[key] != old[key]:
            raise RecordError(f"--remake {folder}: its {key} would change ({json.dumps(old[key])[:60]} -> "
                              f"{json.dumps(s[key])[:60]}); a re-made record keeps its numbers and status")
    for key in ("speedup", "welch_train_time", "welch_val_loss"):
        if old["baseline"] and s["baseline"][key] != old["baseline"][key]:
            raise RecordError(f"--remake {folder}: its baseline.{key} would change; a re-made record keeps its "
                              f"numbers")
    return s, logs, baseline_logs, reruns


def main(argv=None):
    args = parse_args(argv)
    try:
        make_record(args)
    except (RecordError, RuleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:
        print(f"error: {e.filename or 'a file'}: {e.strerror}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("error: interrupted (Ctrl-C): nothing was written; the records and READMEs are as they were",
              file=sys.stderr)
        return EXIT_REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main())
