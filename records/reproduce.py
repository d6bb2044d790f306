"""Recreate the exact source files a log embeds, and optionally rerun them with the logged config.

    python records/reproduce.py LOG [--dir OUT] [--run] [-- extra args for the training script]

The log is verified first (every line must match its seal, every embedded
source its sha256; the earliest, version-1 logs have no seals). The
sources are written to OUT (default: reproduce_<run_id> in the system's temp
folder; OUT must not exist or be empty) under their logged paths, and the
logged config to OUT/config.json. The command that reruns the run is printed;
with --run it is executed from the current directory (run this from the
repository root, which the data paths in the config are relative to):

    python OUT/<entry> --config OUT/config.json                      (world_size 1)
    python -m torch.distributed.run --standalone --nproc_per_node=N \\
        OUT/<entry> --config OUT/config.json                         (world_size N)
"""

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from records.logfile import LogError, parse_log, verify  # noqa: E402

EXIT_REFUSED = 2  # exit code when the log or the output folder is refused
CONFIG_NAME = "config.json"


def default_output_dir(run_id):
    return Path(tempfile.gettempdir()) / f"reproduce_{run_id}"


def recreate_sources(log, out):
    """Write the log's sources under `out` and its config to out/config.json; `out` must be absent or empty."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise LogError(f"{out}: exists and is not an empty folder; choose another --dir or remove it")
    out.mkdir(parents=True, exist_ok=True)
    for relpath, content in log.sources.items():
        dest = out / relpath
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(content)
    (out / CONFIG_NAME).write_text(json.dumps(log.config, indent=2) + "\n")


def rerun_command(log, out, extra_args):
    """The argv that reruns the log's entry script from `out` with the logged config and world size."""
    logged = log.environment.get("world_size", "1")
    try:
        world_size = int(logged)
    except ValueError:
        raise LogError(f"{log.path}: environment world_size {logged!r} is not an integer") from None
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
    parser.add_argument("log", help="a run log")
    parser.add_argument("--dir", type=Path, help="output folder (default: <tmp>/reproduce_<run_id>)")
    parser.add_argument("--run", action="store_true", help="run the recreated script from the current directory")
    args = parser.parse_args(argv)
    args.extra = extra
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        log = parse_log(args.log)
        verify(log)
        out = args.dir or default_output_dir(log.run_id)
        recreate_sources(log, out)
        command = rerun_command(log, out, args.extra)
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as e:
        print(f"error: {e.filename or out}: {e.strerror}; choose another --dir", file=sys.stderr)
        return EXIT_REFUSED
    print(f"recreated {len(log.sources)} source file(s) and {CONFIG_NAME} in {out}")
    if not log.sealed:
        print(f"note: a version-{log.version} log has no seals: only its sources' sha256 were checked")
    if not log.finished:
        print(f"note: the logged run {log.describe_ending()}")
    print("rerun with:", shlex.join(command))
    if not args.run:
        return 0
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
