"""The checkpoint format: a trained model as one safetensors file (write_safetensors,
read_safetensors: the format's header and data, written here without the safetensors package)
with the metadata to rebuild and judge it (save_checkpoint, load_checkpoint): the resolved
config, whether the head is tied, the run id, the seal of its log, the sha256 of its data and
the sha256 of its whole header (metadata, tensor names, shapes, offsets) and data, both verified
on reading. A table split across the processes is gathered into the file whole, chunk by chunk.
Evaluating and sampling a checkpoint: evaluation/evaluate.py.
"""
import errno
import hashlib
import json
import math
import os
import stat
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

from machinery.config import ConfigError, config_from_dict, config_to_dict, is_number, load_json, normalize_config
from machinery.errors import UserError
from machinery.processes import synchronize
from records.logfile import write_failure

NGRAM_TABLE_KEY = "ngram.table"    # the n-gram table in the model's state dict


CHECKPOINT_FORMAT = "speedrun-checkpoint v1"  # the metadata "format" of the files save_checkpoint writes
SAFETENSORS_DTYPES = {             # torch dtype -> its name in a safetensors header
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
SAFETENSORS_HEADER_ALIGN = 8       # the JSON header is padded with spaces to a multiple of this many bytes
SAFETENSORS_MAX_HEADER = 100 * 2**20  # the format's limit on the JSON header, in bytes
SAFETENSORS_MAX_DIMS = 8           # dimensions of a tensor read (the model's have at most 3)
SAFETENSORS_MAX_ELEMENTS = 2**48   # elements of a tensor read, a zero dimension counted as 1
TRUST_HINT = "--trust_checkpoint=true uses it anyway"
HASH_PLACEHOLDER = "0" * 64        # the header's data_sha256 and sha256 while the data is written (then patched)
HASH_KEYS = ("data_sha256", "sha256")  # the metadata's hashes: of the data; of the header without them and the data


class CheckpointError(UserError):
    """A checkpoint cannot be written or read, or does not fit the request; the message names the file."""


def _tensor_bytes(t):
    """The bytes of t, row-major, in the machine's (little-endian) byte order."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


@dataclass
class RowPieces:
    """A tensor that write_safetensors takes in pieces, never whole: its shape and dtype, and
    `pieces`, an iterable of tensors (that dtype, any device) whose rows, one piece after the
    other, are the tensor's rows. The iterable is consumed once, a piece at a time."""
    shape: tuple
    dtype: torch.dtype
    pieces: object


def _data_bytes(path, name, t):
    """The bytes of the tensor or RowPieces t, in order, a piece at a time; refuses pieces that
    do not make up exactly t's bytes."""
    if not isinstance(t, RowPieces):
        yield _tensor_bytes(t)
        return
    expected, count = math.prod(t.shape) * t.dtype.itemsize, 0
    for piece in t.pieces:
        if piece.dtype != t.dtype or piece.shape[1:] != tuple(t.shape[1:]):
            raise CheckpointError(f"{path}: a piece of tensor {name} is {piece.dtype} {list(piece.shape)}, "
                                  f"not rows of {t.dtype} {list(t.shape)}")
        data = _tensor_bytes(piece)
        count += data.nbytes
        yield data
    if count != expected:
        raise CheckpointError(f"{path}: the pieces of tensor {name} hold {count} bytes, its shape and dtype "
                              f"{expected}")


def header_digest(header):
    """A sha256 that has hashed the header's content, its metadata's HASH_KEYS left out: the JSON
    of its tensors' names, dtypes, shapes and offsets and its metadata, keys sorted, no spaces (so
    that the hash covers what the header says, not how it is spaced), and a NUL before the data."""
    metadata = {k: v for k, v in header.get("__metadata__", {}).items() if k not in HASH_KEYS}
    content = {**header, "__metadata__": metadata}
    return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode() + b"\0")


def write_safetensors(path, tensors, metadata):
    """Write {name: tensor or RowPieces} and metadata {str: str} as a safetensors file: 8 bytes of
    little-endian header size, the JSON header (per tensor its dtype, shape and [begin, end) byte
    offsets into the data; "__metadata__"), then the tensors' bytes back to back. One pass over
    the data, which is hashed on the way into the metadata's data_sha256, and with the header's
    content (header_digest) into its sha256 (both patched into the header at the end). Written
    here, not by the safetensors package, so that saving works on any image torch runs on; the
    tests read these files with that package. Returns the data's sha256.

    Memory: a host copy of one tensor at a time (none for a tensor already in host memory), or
    of one piece at a time for RowPieces, which is how a tensor larger than memory is written.

    The file is written under a temporary name and renamed when complete: it appears whole or not
    at all, and an existing file is never replaced.
    """
    names = sorted(tensors)
    header, offset = {}, 0
    for name in names:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {**metadata, **{key: HASH_PLACEHOLDER for key in HASH_KEYS}}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % SAFETENSORS_HEADER_ALIGN)
    hash_at = {}
    for key in HASH_KEYS:
        quoted = f'"{key}":"{HASH_PLACEHOLDER}"'.encode()
        hash_at[key] = 8 + text.index(quoted) + len(quoted) - len(HASH_PLACEHOLDER) - 1
    if os.path.exists(path):
        raise CheckpointError(f"{path} exists already; a checkpoint is never overwritten")
    partial = f"{path}.partial-{os.getpid()}"
    digest, whole = hashlib.sha256(), header_digest(header)
    try:
        with open(partial, "xb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name in names:
                for data in _data_bytes(path, name, tensors[name]):
                    digest.update(data)
                    whole.update(data)
                    f.write(data)
            for key, value in (("data_sha256", digest), ("sha256", whole)):
                f.seek(hash_at[key])
                f.write(value.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as e:
        raise CheckpointError(f"{write_failure(path, e)}; nothing was kept") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return digest.hexdigest()


FILE_KINDS = {stat.S_ISDIR: "a folder", stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket",
              stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}  # what a path can be besides a file


def _read_regular_file(path):
    """The bytes of the regular file at `path` (a bytearray: one copy in memory); anything else (a
    FIFO, a device) is refused before it is opened for reading, so that nothing waits on it."""
    def kind(mode):
        return next((name for test, name in FILE_KINDS.items() if test(mode)), None)
    what = kind(os.stat(path).st_mode)
    if what is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(fd)
            what = kind(info.st_mode)
            if what is None:
                raw = bytearray(info.st_size)
                del raw[f.readinto(raw):]
                return raw
    raise OSError(errno.EINVAL, f"it is {what}, not a checkpoint file")


def read_safetensors(path, trust=False):
    """(tensors, metadata) of a safetensors file. Every size, shape and offset is checked before a
    byte of data is used or a tensor allocated, so a truncated, damaged or foreign file ends in one
    CheckpointError line. A data_sha256 in the metadata is checked against the data, and a sha256
    against the header's content and the data (header_digest), unless `trust`."""
    def refuse(why):
        return CheckpointError(f"{path}: {why}")
    try:
        raw = _read_regular_file(path)
    except OSError as e:
        raise refuse(f"cannot read it ({e.strerror})") from None
    if len(raw) < 8:
        raise refuse(f"not a safetensors checkpoint (only {len(raw)} bytes)")
    n = struct.unpack("<Q", raw[:8])[0]
    if n > min(SAFETENSORS_MAX_HEADER, len(raw) - 8):
        raise refuse("not a safetensors checkpoint (its first 8 bytes are not a header size that fits the file)")
    try:
        header = load_json("its header", raw[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError, ConfigError):
        raise refuse("not a safetensors checkpoint (its header is not JSON of the format)") from None
    if not isinstance(header, dict):
        raise refuse("not a safetensors checkpoint (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise refuse("not a safetensors checkpoint (its __metadata__ is not a JSON object)")
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    data = memoryview(raw)[8 + n:]
    entries, end = [], 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = dtypes[entry["dtype"]], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise refuse(f"tensor {name!r} has an unreadable header entry") from None
        if len(shape) > SAFETENSORS_MAX_DIMS or not all(is_number(d, integer=True) and d >= 0 for d in shape) \
                or math.prod(max(d, 1) for d in shape) > SAFETENSORS_MAX_ELEMENTS:
            raise refuse(f"tensor {name!r} has shape {json.dumps(shape)[:200]}: expects at most "
                         f"{SAFETENSORS_MAX_DIMS} whole numbers >= 0 whose product (zeros counted as 1) is at most 2^48")
        if not all(is_number(x, integer=True) and x >= 0 for x in (begin, stop)):
            raise refuse(f"tensor {name!r} has data_offsets {json.dumps([begin, stop])[:200]}: expects two whole "
                         f"numbers >= 0")
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise refuse(f"tensor {name!r}: its byte range does not fit its shape and dtype")
        entries.append((begin, stop, name, dtype, shape))
    for begin, stop, name, dtype, shape in sorted(entries):
        if begin != end:
            raise refuse(f"tensor {name!r} does not start where the previous one ends (a damaged file)")
        end = stop
    if end != len(data):
        raise refuse(f"truncated or damaged: its header describes {end} bytes of data, the file holds {len(data)}")
    expected = metadata.get("data_sha256")
    if expected is not None and not trust and hashlib.sha256(data).hexdigest() != expected:
        raise refuse(f"damaged: its data does not match the data_sha256 in its metadata ({TRUST_HINT})")
    expected = metadata.get("sha256")
    if expected is not None and not trust:
        whole = header_digest({**header, "__metadata__": metadata})
        whole.update(data)
        if whole.hexdigest() != expected:
            raise refuse(f"damaged: its header (tensor names, shapes, offsets, metadata) and data do not match the "
                         f"sha256 in its metadata ({TRUST_HINT})")
    tensors = {name: torch.frombuffer(data[begin:stop], dtype=dtype).reshape(shape).clone() if stop > begin
               else torch.empty(shape, dtype=dtype) for begin, stop, name, dtype, shape in entries}
    return tensors, metadata


CHECKPOINT_CHUNK_BYTES = 64 * 2**20  # a split n-gram table travels to the writer in chunks of at most this many bytes


def split_ngram_table(model):
    """This process's rows of the model's n-gram table when the table is split across the
    processes (ShardedNgramRows), else None (no table, or the whole table here or on the host)."""
    ngram = model.ngram
    return ngram.table if ngram is not None and ngram.table.shape[0] < ngram.rows else None


def row_chunks(shard):
    """The rows of `shard` as views of at most CHECKPOINT_CHUNK_BYTES (at least one row each)."""
    rows = max(1, CHECKPOINT_CHUNK_BYTES // max(1, math.prod(shard.shape[1:]) * shard.element_size()))
    return [shard[i:i + rows] for i in range(0, shard.shape[0], rows)]


def whole_table_pieces(shard, processes):
    """On rank 0, the whole n-gram table split across `processes` as RowPieces, in row order:
    rank 0's own shard, then each other rank's, received chunk by chunk (dist.recv into one
    buffer on the shard's device, the chunks send_table_shard sends). Memory beyond rank 0's
    shard: one chunk, and write_safetensors's host copy of it."""
    def pieces():
        chunks = row_chunks(shard)
        yield from chunks
        buffer = torch.empty_like(chunks[0])
        for rank in range(1, processes):
            for chunk in chunks:   # every shard has the same rows, so the same chunks
                received = buffer[:chunk.shape[0]]
                dist.recv(received, src=rank)
                yield received
    return RowPieces((shard.shape[0] * processes, *shard.shape[1:]), shard.dtype, pieces())


def send_table_shard(shard):
    """On a rank other than 0: send its shard of the n-gram table to rank 0, chunk by chunk
    (see whole_table_pieces), and wait until the device has sent the last one."""
    for chunk in row_chunks(shard):
        dist.send(chunk, dst=0)
    synchronize(shard.device)


def checkpoint_tensors(model):
    """The tensors of the model's checkpoint, {state-dict key: tensor or RowPieces}: its state
    dict, where a split n-gram table is whole (whole_table_pieces: every other rank must call
    send_table_shard at the same time). Every other tensor is replicated on every rank."""
    tensors = model.state_dict()
    shard = split_ngram_table(model)
    if shard is not None:
        tensors[NGRAM_TABLE_KEY] = whole_table_pieces(shard, model.ngram.rows // shard.shape[0])
    return tensors


def save_checkpoint(path, model, h, run_id, log_seal, val_loss, train_time_ms):
    """The trained model as logs/<run id>_model.safetensors, written by rank 0: every parameter and
    persistent buffer (the head too, tied or not; the n-gram table whole, even when it is split
    across the processes: see checkpoint_tensors), with the metadata to rebuild and judge it:
    the resolved config, whether the head is tied, the run id, the seal of the log's last line
    before the checkpoint (the log then names the checkpoint's data_sha256), the final val loss
    and train time."""
    metadata = {
        "format": CHECKPOINT_FORMAT, "config": json.dumps(config_to_dict(h)), "tied": json.dumps(model.tied),
        "run_id": run_id, "log_seal": log_seal, "val_loss": repr(val_loss), "train_time_ms": repr(train_time_ms),
    }
    return write_safetensors(path, checkpoint_tensors(model), metadata)


def load_checkpoint(path, trust=False):
    """(config, state dict, metadata) of a file written by save_checkpoint, whose data matches the
    data_sha256 of its metadata (unless `trust`), and whose config passes check_config."""
    state, metadata = read_safetensors(path, trust)
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: a safetensors file, but not a checkpoint written by train_gpt.py "
                              f"(its metadata has no format {CHECKPOINT_FORMAT!r})")
    if "data_sha256" not in metadata and not trust:
        raise CheckpointError(f"{path}: its metadata has no data_sha256, so its data cannot be verified "
                              f"({TRUST_HINT})")
    if "sha256" not in metadata and not trust:
        raise CheckpointError(f"{path}: its metadata has no sha256 of its header and data (a checkpoint written "
                              f"before headers were hashed), so its tensor names, shapes and offsets cannot be "
                              f"verified ({TRUST_HINT})")
    try:
        h = normalize_config(config_from_dict(load_json("its config", metadata["config"])))
        metadata = {**metadata, "tied": json.loads(metadata["tied"]), "val_loss": float(metadata["val_loss"]),
                    "train_time_ms": float(metadata["train_time_ms"])}
    except (KeyError, ValueError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path}: its metadata is damaged ({e})") from None
    return h, state, metadata
