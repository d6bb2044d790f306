"""The training data as the trainer reads it: BOS-aligned packed slices of the token shards.

A slice is T tokens of whole documents (each from its BOS, cut at max_doc_len), their targets
(the next tokens of the same document, or of the packed stream with the packed rule) and the
documents' offsets (cu_seqlens, cut into attention segments where a run asks); a global batch is
num_slices consecutive slices, each process building only its own. TrainLoader walks the train
shards (the next one read in a background thread), BatchPrefetcher builds each step's slices a
step ahead (pinned, and routed for a split n-gram table), validation_slices cuts the leading
tokens of the val stream into plain windows.
"""
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from data.shards import find_shards, read_shard
from data.tokenizer import BOS_ID
from machinery.config import MAX_TARGETS, MIN_DOC_TOKENS, VOCAB_SIZE, ConfigError
from machinery.errors import UserError


class DataError(UserError):
    """Missing, corrupt or too-small data: the message names the file and what to do."""


@dataclass
class Slice:
    """One rank's packed micro-batch: T tokens, their targets and document offsets."""
    tokens: torch.Tensor           # (T,) int32
    targets: torch.Tensor          # (T, MAX_TARGETS - 1) int64 vocab ids of t+1, t+2, ...; -1 = none
    cu_seqlens: torch.Tensor       # (T // MIN_DOC_TOKENS + 2,) int32, padded by repeating T
    route: object = None           # a split n-gram table: its Route, worked out ahead (BatchPrefetcher)

    def pinned(self):
        """The same slice in page-locked memory, so that copies to the GPU need not wait."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory()
                                            for name in ("tokens", "targets", "cu_seqlens")})

    def to(self, device):
        """The slice on `device`; from pinned memory the copies are queued, not waited for."""
        if device.type == "cpu":
            return self
        return Slice(*(t.to(device, non_blocking=True) for t in (self.tokens, self.targets, self.cu_seqlens)))


def check_token_ids(tokens, path, offset=0):
    """Refuse a shard holding ids outside GPT-2's vocabulary, naming the file and the first one."""
    bad = np.flatnonzero(tokens >= VOCAB_SIZE)
    if bad.size:
        raise DataError(f"{path}: token {offset + int(bad[0])} is {int(tokens[bad[0]])}, outside GPT-2's vocabulary "
                        f"(ids 0..{VOCAB_SIZE - 1}): the shard was not made with the GPT-2 tokenizer; rebuild it")


def _load_shard(path):
    tokens = np.asarray(read_shard(path))
    check_token_ids(tokens, path)
    bos = np.flatnonzero(tokens == BOS_ID)
    if bos.size == 0:
        raise DataError(f"{path}: no <|endoftext|> ({BOS_ID}) token, so no document starts in it; "
                        f"every document must begin with one: rebuild the shard")
    return tokens, bos


def _targets(stream, starts, lengths, ends, num_targets):
    """targets[i, k] = stream[p + k + 1] for token p when p + k + 1 <= its document's end, else -1."""
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    doc_end = np.repeat(ends, lengths)
    out = np.full((pos.size, num_targets), -1, dtype=np.int64)
    for k in range(num_targets):
        p = pos + k + 1
        ok = (p <= doc_end) & (p < stream.size)
        out[ok, k] = stream[p[ok]]
    return out


def _packed_targets(buffer, num_targets):
    """targets[i, k] = buffer[i + k + 1] where that is in the buffer, else -1: the packed rule,
    buffer being a slice's tokens and the one that follows its last."""
    out = np.full((buffer.size - 1, num_targets), -1, dtype=np.int64)
    for k in range(num_targets):
        out[:buffer.size - 1 - k, k] = buffer[k + 1:]
    return out


def attention_segment_ends(offset, length, segment_tokens):
    """The ends of a piece's attention segments, the piece being tokens [offset, offset + length)
    of the slice: one every segment_tokens tokens inside it (0: none), then its end."""
    inner = range(offset + segment_tokens, offset + length, segment_tokens) if segment_tokens else ()
    return [*inner, offset + length]


def _packed_tokens(pieces, T):
    """The (T,) int32 tokens _pack makes of the pieces, without their targets."""
    tokens = np.concatenate([stream[start:start + length] for stream, start, length, _ in pieces]).astype(np.int32)
    return torch.from_numpy(np.concatenate([tokens, np.full(T - tokens.size, BOS_ID, dtype=np.int32)]))


def _pack(pieces, T, target_rule="document", segment_tokens=0, following=BOS_ID):
    """Concatenate (stream, start, length, doc_end) pieces into one Slice of exactly T tokens: the
    targets by target_rule (packed: `following` is the token after the last piece), the
    documents' attention segments at most segment_tokens long (0: no limit)."""
    tokens, targets, cu = [], [], [0]
    for stream, start, length, end in pieces:
        tokens.append(stream[start:start + length].astype(np.int32))
        if target_rule == "document":
            targets.append(_targets(stream, [start], [length], [end], MAX_TARGETS - 1))
        cu += attention_segment_ends(cu[-1], length, segment_tokens)
    filled = cu[-1]
    if target_rule == "packed":
        targets.append(_packed_targets(np.concatenate([*tokens, [following]]), MAX_TARGETS - 1))
    if filled < T:                 # too many tiny documents: pad with loss-free BOS tokens
        tokens.append(np.full(T - filled, BOS_ID, dtype=np.int32))
        targets.append(np.full((T - filled, MAX_TARGETS - 1), -1, dtype=np.int64))
        cu.append(T)
    width = T // MIN_DOC_TOKENS + 2
    cu = np.array(cu + [T] * (width - len(cu)), dtype=np.int32)
    return Slice(torch.from_numpy(np.concatenate(tokens)), torch.from_numpy(np.concatenate(targets)),
                 torch.from_numpy(cu))


class TrainLoader:
    """BOS-aligned packed batches from the train shards, cycling through them.

    Each global batch is `num_slices` consecutive slices of T tokens; a slice is whole documents,
    each starting at a BOS and cut at `max_doc_len` tokens (the rest of a cut document is skipped),
    the last one cut to fit. Every process walks the same stream and builds only its own slices.
    The next shard is read in a background thread while the current one is used. target_rule
    and segment_tokens: _pack's (a run's are train_loader's).
    """

    def __init__(self, files, batch_tokens, target_rule="document", segment_tokens=0):
        total = sum(read_shard(f).size for f in files)
        if total < batch_tokens:
            raise DataError(f"the train files ({', '.join(files)}) hold {total} tokens, fewer than one "
                            f"global batch needs ({batch_tokens}): add shards or lower tokens_per_rank")
        self.files, self.target_rule, self.segment_tokens = files, target_rule, segment_tokens
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.next_file = 0
        self.future = self._prefetch()
        self._advance_shard()

    def _prefetch(self):
        path = self.files[self.next_file % len(self.files)]
        self.next_file += 1
        return self.pool.submit(_load_shard, path)

    def _advance_shard(self):
        self.stream, self.bos = self.future.result()
        self.future = self._prefetch()
        self.doc = 0               # index into self.bos of the next document to use

    def _next_piece(self, max_len):
        while self.doc >= len(self.bos):
            self._advance_shard()
        start = int(self.bos[self.doc])
        end = int(self.bos[self.doc + 1]) if self.doc + 1 < len(self.bos) else self.stream.size
        self.doc += 1
        return self.stream, start, min(end - start, max_len), end

    def next_batch(self, T, max_doc_len, num_slices, mine, every_tokens=False):
        """The slices with indices in `mine` of the next global batch of num_slices slices; with
        every_tokens, also the tokens (T,) of each of its slices, in order (a list)."""
        out, tokens = [], []
        for i in range(num_slices):
            pieces, filled, segments = [], 0, 0
            while filled < T and segments + self.segments_of(min(max_doc_len, T - filled)) <= T // MIN_DOC_TOKENS:
                stream, start, length, end = self._next_piece(min(max_doc_len, T - filled))
                pieces.append((stream, start, length, end))
                filled += length
                segments += self.segments_of(length)
            if i in mine:
                following = following_token(pieces, max_doc_len)
                out.append(_pack(pieces, T, self.target_rule, self.segment_tokens, following))
            if every_tokens:
                tokens.append(out[-1].tokens if i in mine else _packed_tokens(pieces, T))
        return (out, tokens) if every_tokens else out

    def segments_of(self, length):
        """Attention segments of a piece of `length` tokens: a slice's cu_seqlens holds at most
        T // MIN_DOC_TOKENS of them."""
        return -(-length // self.segment_tokens) if self.segment_tokens else 1


def following_token(pieces, max_doc_len):
    """The token after a slice's last piece, where the packed targets end: the rest of its document
    when the piece was cut to fit the slice, else the next document's BOS."""
    stream, start, length, _ = pieces[-1]
    return int(stream[start + length]) if length < max_doc_len and start + length < stream.size else BOS_ID


class BatchPrefetcher:
    """The slices of each step's batch, built in a background thread one step ahead.

    The loader reads, packs and (for a GPU) pins the next step's slices while the current step
    runs, so the training loop only queues their copies. With a split n-gram table (`router`, its
    ShardedNgramRows) the thread also packs the tokens of every process's slices of the step, all
    processes' loaders being the same, and works out each of this process's slices' Route from
    them: the loop then only moves the rows, with no gather of the tokens and no hashing on its
    way. Steps must be asked for in order, from `start` (a loader that has walked the steps before).
    """

    def __init__(self, loader, batch_shape, mine, pin, router=None, start=0):
        self.loader, self.batch_shape, self.mine, self.pin, self.router = loader, batch_shape, mine, pin, router
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.step, self.future = start, self.pool.submit(self._build, start)

    def _build(self, step):
        T, max_doc_len, num_slices = self.batch_shape(step)
        if self.router is None:
            slices = self.loader.next_batch(T, max_doc_len, num_slices, self.mine)
        else:                      # micro-batch j of process p is slice p + j * processes
            slices, tokens = self.loader.next_batch(T, max_doc_len, num_slices, self.mine, every_tokens=True)
            world = self.router.pg.world_size
            slices = [dataclasses.replace(s, route=self.router.route_of(
                s.tokens, [tokens[i - i % world + p] for p in range(world)])) for i, s in zip(self.mine, slices)]
        return [s.pinned() for s in slices] if self.pin else slices

    def peek(self):
        """The slices of the step after the last one got (waiting for them to be built)."""
        return self.future.result()

    def get(self, step):
        if step != self.step:
            raise ValueError(f"batches are built in order: asked for step {step}, next is {self.step}")
        slices = self.future.result()
        self.step, self.future = step + 1, self.pool.submit(self._build, step + 1)
        return slices

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


def validation_slices(files, val_tokens, T, num_slices, mine):
    """The first val_tokens tokens of the val stream, cut into num_slices slices of T tokens.

    Slices are plain windows of the stream (a document may start before a slice); documents
    inside a slice are separated by their BOS tokens.
    """
    needed, parts = val_tokens + 1, []
    for f in files:                # only the leading tokens: a FineWeb val shard holds 100M
        parts.append(np.asarray(read_shard(f)[:needed]))
        check_token_ids(parts[-1], f)
        needed -= parts[-1].size
        if needed <= 0:
            break
    stream = np.concatenate(parts)
    if needed > 0:
        raise DataError(f"the val files {files} hold {stream.size} tokens but val_tokens={val_tokens} "
                        f"needs {val_tokens + 1}: lower --val_tokens or use a bigger val shard")
    out = []
    for i in mine:
        s = i * T
        bos = np.flatnonzero(stream[s:s + T] == BOS_ID) + s
        starts = np.unique(np.concatenate([[s], bos]))
        ends = np.append(starts[1:], s + T)
        pieces = [(stream, a, b - a, b) for a, b in zip(starts, ends)]
        out.append(_pack(pieces, T))
    return out


FINEWEB_HINT = "python data/cached_fineweb10B.py N"   # the command that downloads FineWeb shards
TINY_HINT = "python data/tiny_corpus.py"               # the command that writes the tiny corpus


def shards_of(pattern):
    """The shard files matching `pattern`; a ShardError says how to make them when none match."""
    return find_shards(pattern, hint=FINEWEB_HINT if "fineweb" in pattern else TINY_HINT)


def check_validation_split(h, pg):
    """Refuse a val_tokens that the processes cannot split into whole val_tokens_per_rank slices."""
    if h.val_tokens % (h.val_tokens_per_rank * pg.world_size):
        raise ConfigError(f"val_tokens={h.val_tokens} must be a multiple of val_tokens_per_rank x processes "
                          f"= {h.val_tokens_per_rank * pg.world_size}")


def validation_data(h, pg, val_files):
    """This rank's share of the val_tokens every validation reads."""
    check_validation_split(h, pg)
    num_slices = h.val_tokens // h.val_tokens_per_rank
    return validation_slices(val_files, h.val_tokens, h.val_tokens_per_rank, num_slices,
                             range(pg.rank, num_slices, pg.world_size))
