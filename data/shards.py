"""The token shard format shared by FineWeb and the tiny corpus.

A shard is a header of 256 little-endian int32 (magic, version, token count,
then zeros) followed by the tokens as little-endian uint16. Every reader
validates the header against the file size before touching the tokens, so a
truncated download or a half-copied file is refused with a message that names
the file, instead of silently training on garbage.
"""

import errno
import glob
import hashlib
import os
import re
import stat
import tempfile

import numpy as np

from machinery.errors import UserError

SHARD_MAGIC = 20240520  # first header int: identifies the format
SHARD_VERSION = 1  # second header int: layout of the token payload (uint16)
HEADER_INTS = 256  # header length in int32 values
HEADER_BYTES = HEADER_INTS * 4  # 1024: where the tokens start
TOKEN_DTYPE = np.dtype("<u2")  # tokens on disk: little-endian uint16
HEADER_DTYPE = np.dtype("<i4")  # header values on disk: little-endian int32
MAX_TOKEN_ID = 65535  # largest id a uint16 token can hold
FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of the file for its fingerprint
SHARD_FILE_MODE = 0o644  # shards are data for every user; mkstemp would leave them owner-only

REFETCH = "delete it and fetch/build it again"  # the remedy for any damaged shard


class ShardError(UserError):
    """A shard file is missing, damaged or not a shard; the message names the file and the remedy."""


def _header_values(num_tokens):
    header = np.zeros(HEADER_INTS, dtype=HEADER_DTYPE)
    header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, num_tokens
    return header


def write_shard(path, tokens):
    """Write `tokens` (1-D integers in [0, 65535]) as a shard at `path`, atomically.

    The bytes go to a temporary file in the destination folder, which is then
    renamed over `path` (os.replace is atomic on one file system), so a crash
    leaves either the old file or the complete new one, never a partial shard.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"{path}: tokens must be a 1-D array, got shape {tokens.shape}")
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be integers, got dtype {tokens.dtype}")
    if tokens.size and (tokens.min() < 0 or tokens.max() > MAX_TOKEN_ID):
        raise ValueError(
            f"{path}: token ids must lie in [0, {MAX_TOKEN_ID}], got [{tokens.min()}, {tokens.max()}]"
        )
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, SHARD_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(_header_values(tokens.size).tobytes())
            f.write(tokens.astype(TOKEN_DTYPE).tobytes())
        os.replace(tmp_path, path)
    except BaseException:
        os.unlink(tmp_path)
        raise


def _regular_file_size(path):
    """The size of the regular file at `path`; a ShardError saying what is there instead (nothing,
    a folder, a FIFO, a symbolic link that leads nowhere or in a loop) or why it cannot be read."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ShardError(f"{path}: is a symbolic link to a missing file, not a shard file: fix or remove the link") from None
        raise ShardError(f"{path}: no such shard file; fetch or build it first") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ShardError(f"{path}: is a symbolic link in a loop (it leads back to itself), not a shard file: "
                             f"fix or remove the link") from None
        raise ShardError(f"{path}: cannot be read ({e.strerror}); fix the path or its permissions") from None
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    kind = next((name for test, name in kinds.items() if test(info.st_mode)), None)
    if kind is not None:
        raise ShardError(f"{path}: is {kind}, not a shard file: give a pattern that matches only shard files "
                         f"(e.g. ending in .bin)")
    return info.st_size


def read_header(path):
    """Validate the shard at `path` and return its token count.

    Checks, in order: the file exists and is a regular file, holds a whole header,
    carries the magic and version, and is exactly HEADER_BYTES + 2 * count bytes long.
    """
    size = _regular_file_size(path)
    if size < HEADER_BYTES:
        raise ShardError(
            f"{path}: file is {size} bytes, shorter than the {HEADER_BYTES}-byte shard header; "
            f"the file is truncated or not a shard: {REFETCH}"
        )
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype=HEADER_DTYPE)
    magic, version, num_tokens = (int(v) for v in header[:3])
    if magic != SHARD_MAGIC:
        raise ShardError(
            f"{path}: header magic is {magic}, expected {SHARD_MAGIC}; "
            f"this is not a token shard or it is corrupt: {REFETCH}"
        )
    if version != SHARD_VERSION:
        raise ShardError(
            f"{path}: shard version is {version}, this code reads version {SHARD_VERSION}; "
            f"the file is corrupt or from another tool: {REFETCH}"
        )
    expected = HEADER_BYTES + TOKEN_DTYPE.itemsize * num_tokens
    if num_tokens < 0 or size != expected:
        damage = "is truncated or corrupt" if size < expected else "has extra bytes or is corrupt"
        raise ShardError(
            f"{path}: file is {size} bytes but its header declares {num_tokens} tokens "
            f"(expected {expected} bytes); the file {damage}: {REFETCH}"
        )
    return num_tokens


def read_shard(path):
    """Return the tokens of the shard at `path` as a read-only uint16 memmap (validated first)."""
    num_tokens = read_header(path)
    if num_tokens == 0:  # np.memmap refuses an empty mapping
        empty = np.zeros(0, dtype=TOKEN_DTYPE)
        empty.setflags(write=False)
        return empty
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(num_tokens,))


def _sha256_of_range(f, start, length):
    f.seek(start)
    return hashlib.sha256(f.read(length)).hexdigest()


def fingerprint(path):
    """A cheap identity of a shard for logs: size, token count and hashes of its header, first and last MiB."""
    num_tokens = read_header(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        return {
            "path": str(path),
            "bytes": size,
            "tokens": num_tokens,
            "header_sha256": _sha256_of_range(f, 0, HEADER_BYTES),
            "head_sha256": _sha256_of_range(f, 0, FINGERPRINT_SPAN),
            "tail_sha256": _sha256_of_range(f, max(0, size - FINGERPRINT_SPAN), FINGERPRINT_SPAN),
        }


def find_shards(pattern, hint=None):
    """Return the files matching the glob `pattern`, sorted; raise ShardError if there are none.

    `hint` is the command that creates the files, quoted in the error.
    """
    paths = sorted(glob.glob(pattern))
    if not paths:
        folder = _fixed_folder(pattern)
        try:
            os.listdir(folder)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise ShardError(f"{pattern}: the folder {folder} cannot be read ({e.strerror}): give this user "
                             f"access to it, or choose another folder") from None
        remedy = f"create them with `{hint}`" if hint else "fetch or build them first"
        raise ShardError(f"{pattern}: no shard files match this pattern; {remedy}")
    return paths


def _fixed_folder(pattern):
    """The folder of a glob pattern before its first wildcard: "a/b" of "a/b/x_*.bin" and of
    "a/b/*/x.bin"; "." for a pattern without a folder."""
    fixed = []
    for part in pattern.split(os.sep)[:-1]:
        if re.search(r"[*?[]", part):
            break
        fixed.append(part)
    return os.sep.join(fixed) or (os.sep if pattern.startswith(os.sep) else ".")
