"""Download GPT-2-tokenized FineWeb-10B shards from the Hugging Face hub.

    python data/cached_fineweb10B.py 8            # val shard + train shards 1..8 (800M tokens)
    python data/cached_fineweb10B.py 8 --dir D    # into D instead of data/fineweb10B/

Each shard holds 100M tokens (about 200 MB; the last train shard the rest).
Files already present are skipped when they are whole shards of the hub's size:
a valid header, a length that matches it, and the hub's token count. Any other
file under a shard's name is fetched again. huggingface-hub downloads into an
`.incomplete` file and renames it when done, so a shard never appears
half-written under its final name; each file is checked again after its
download.
"""

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/cached_fineweb10B.py`: make `data` importable
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import httpx2  # huggingface-hub 2.x's HTTP client: its TransportError is a network failure mid-transfer
from huggingface_hub import constants as hub_constants
from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

from data.shards import ShardError, read_header
from machinery.errors import UserError

HUB_REPO_ID = "kjj0/fineweb10B-gpt2"  # the public cache of FineWeb-10B in GPT-2 tokens
HUB_REPO_TYPE = "dataset"
NUM_HUB_TRAIN_SHARDS = 103  # train shards in the hub repo, numbered from 1
HUB_SHARD_TOKENS = 100_000_000  # tokens in each of its shards but the last train shard, which holds at most this many
VAL_SHARD_NAME = "fineweb_val_000000.bin"
TRAIN_SHARD_NAME = "fineweb_train_{:06d}.bin"  # format with the shard number (1-based)
DEFAULT_DIR = Path(__file__).resolve().parent / "fineweb10B"
EXIT_HUB_UNREACHABLE = 2  # exit status when the hub cannot be reached
EXIT_FAILED = 1  # exit status for any other failure


class HubUnreachableError(UserError):
    """The Hugging Face hub could not be reached (offline, no network, HF_HUB_OFFLINE=1)."""


class DownloadError(UserError):
    """The hub answered but a shard could not be fetched; the message names the shard."""


def shard_names(num_train_shards):
    """The val shard, then train shards 1..num_train_shards."""
    return [VAL_SHARD_NAME] + [TRAIN_SHARD_NAME.format(i) for i in range(1, num_train_shards + 1)]


def shard_problem(path, name):
    """Why the file at `path` is not the hub's shard `name` (a damaged header, a length that does not
    match it, another token count than the hub's), or None."""
    try:
        tokens = read_header(path)
    except ShardError as e:
        return str(e)
    last = name == TRAIN_SHARD_NAME.format(NUM_HUB_TRAIN_SHARDS)
    if tokens == HUB_SHARD_TOKENS or (last and 0 < tokens < HUB_SHARD_TOKENS):
        return None
    expected = f"at most {HUB_SHARD_TOKENS:,}" if last else f"{HUB_SHARD_TOKENS:,}"
    return f"{path}: holds {tokens:,} tokens, but {name} of {HUB_REPO_ID} holds {expected}: not the hub's file"


def _unreachable(name, out_dir, reason):
    return HubUnreachableError(
        f"could not reach the Hugging Face hub to fetch {name} from {HUB_REPO_ID} ({reason}); "
        f"retry with network access (and HF_HUB_OFFLINE unset), or copy the shards into {out_dir}/ by hand")


def _fetch(name, out_dir, replace_damaged, local_files_only):
    if replace_damaged and (local_files_only or hub_constants.HF_HUB_OFFLINE):
        raise _unreachable(name, out_dir, "offline, and the copy there is damaged")
    try:
        return hf_hub_download(
            repo_id=HUB_REPO_ID,
            filename=name,
            repo_type=HUB_REPO_TYPE,
            local_dir=out_dir,
            force_download=replace_damaged,
            local_files_only=local_files_only,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.TransportError, ConnectionError, TimeoutError) as e:
        raise _unreachable(name, out_dir, type(e).__name__) from e
    except (EntryNotFoundError, HfHubHTTPError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DownloadError(f"{HUB_REPO_ID}/{name}: the hub refused the download: {first_line}") from e


def download(num_train_shards, out_dir=DEFAULT_DIR, local_files_only=False):
    """Make sure the val shard and train shards 1..num_train_shards are in `out_dir`; return their paths.

    A file already there with a valid header is kept as is. A damaged one is
    fetched again. Every fetched file is validated; a bad one is deleted and
    reported. `local_files_only` forbids network access (as HF_HUB_OFFLINE=1 does).
    """
    if not 1 <= num_train_shards <= NUM_HUB_TRAIN_SHARDS:
        raise ValueError(f"number of train shards must be in [1, {NUM_HUB_TRAIN_SHARDS}], got {num_train_shards}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in shard_names(num_train_shards):
        path = out_dir / name
        problem = shard_problem(path, name) if path.exists() else "missing"
        if problem is None:
            print(f"{path}: present and valid, skipped")
        else:
            damaged = path.exists()
            if damaged:
                print(f"{path}: present but damaged ({problem.removeprefix(f'{path}: ')}), fetching it again")
            _fetch(name, out_dir, damaged, local_files_only)
            problem = shard_problem(path, name) if path.exists() else "missing"
            if problem is not None:
                reason = "missing after the download" if not path.exists() else f"damaged after the download " \
                    f"({problem.removeprefix(f'{path}: ')})"
                path.unlink(missing_ok=True)
                raise DownloadError(f"{path}: {reason}; it was deleted, run this script again")
        paths.append(str(path))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description="Download GPT-2-tokenized FineWeb-10B shards (100M tokens each).")
    parser.add_argument(
        "num_train_shards", nargs="?", type=int, default=NUM_HUB_TRAIN_SHARDS,
        help=f"train shards to fetch, 1..{NUM_HUB_TRAIN_SHARDS} (default: all)",
    )
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"output folder (default: {DEFAULT_DIR})")
    args = parser.parse_args(argv)
    if not 1 <= args.num_train_shards <= NUM_HUB_TRAIN_SHARDS:
        parser.error(f"num_train_shards must be in [1, {NUM_HUB_TRAIN_SHARDS}], got {args.num_train_shards}")
    try:
        paths = download(args.num_train_shards, args.dir)
    except HubUnreachableError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_HUB_UNREACHABLE
    except DownloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except OSError as e:
        print(f"error: {e.filename or args.dir}: {e.strerror}; choose a writable --dir", file=sys.stderr)
        return EXIT_FAILED
    print(f"{len(paths)} shards ready in {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
