"""The hashed n-gram table: which rows each token reads (the hashes of the token and the one or
two before it in its document, with the sign trick's rows), where the rows live
(TablePlacement) and the module that reads them (NgramTable). The table trains from sparse
gradients: machinery/sparse_tables.py holds its optimizer and what fetches a slice's rows.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

from data.tokenizer import BOS_ID, normalized_tokens
from machinery.config import PADDED_VOCAB_SIZE, VOCAB_SIZE

BIGRAM_MULT_CUR = 36313            # records 89 and 92: the bigram row hash's multiplier of the current token
BIGRAM_MULT_PREV = 27191           # records 89 and 92: ... and of the previous token
SIGN_ROWS = 8192                   # rows of the fixed random +/-1 sign table
SIGN_MULT_CUR = 40351              # this project's sign-row hash: multiplier of the current token
SIGN_MULT_PREV = 51349             # sign-row hash: multiplier of the previous token
SIGN_TABLE_SEED = 1234             # the sign table is the same in every run
TRIGRAM_MULT_CUR = 17351           # record 92: the trigram row hash's multiplier of the current token
TRIGRAM_MULT_PREV = 60961          # record 92: ... of the previous token
TRIGRAM_MULT_PREV2 = 45259         # record 92: ... and of the token before that
TRIGRAM_SIGN_MULTS = (29363, 47119, 13709)  # this project's trigram sign-row hash (current, previous, before)
RECORD_BIGRAM_SIGN_MULTS = (48271, 30011)  # record 92: the n-gram table's bigram sign hash (current, previous)
RECORD_TRIGRAM_SIGN_MULTS = (58699, 39779, 26801)  # record 92: its trigram sign hash (current, previous, before)


def document_starts(context):
    """Whether each token starts a document: BOS, or the first token of the slice (whose
    predecessor, if any, is not known)."""
    return torch.cat([context.new_ones(1, dtype=torch.bool), context[1:] == BOS_ID])


def token_starts(context, cross_documents):
    """Whether each token has no predecessor for the smear, the key offset and the hashed tables:
    a document's first (document_starts), or with cross_documents only the slice's first."""
    if cross_documents:
        return torch.arange(context.shape[0], device=context.device) == 0
    return document_starts(context)


def previous_tokens(tokens, is_doc_start):
    """Each token's predecessor in its document; BOS for a document's first token, whose real
    predecessor (another document's last token, or nothing) it must not see."""
    return torch.where(is_doc_start, BOS_ID, torch.roll(tokens, 1))


def after_starts(is_doc_start):
    """Whether the token before each one starts a document."""
    return torch.cat([is_doc_start.new_zeros(1), is_doc_start[:-1]])


def wrap_int32(x):
    """int64 products as the records' int32 arithmetic leaves them: wrapped into [-2^31, 2^31)."""
    return (x + 2 ** 31) % 2 ** 32 - 2 ** 31


def bigram_rows(tokens, is_doc_start, rows, record=False):
    """Hash (previous, current) token pairs to table rows; a document's first token gets the last
    row. record: the records' arithmetic, int32 products that wrap, and the token after a start
    hashed with the reserved row's id as its previous token."""
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    if record:
        prev = torch.where(after_starts(is_doc_start), rows - 1, prev)
        row = (wrap_int32(BIGRAM_MULT_CUR * cur) ^ wrap_int32(BIGRAM_MULT_PREV * prev)) % (rows - 1)
    else:
        row = ((BIGRAM_MULT_CUR * cur) ^ (BIGRAM_MULT_PREV * prev)) % (rows - 1)
    return torch.where(is_doc_start, rows - 1, row)


def bigram_sign_rows(tokens, is_doc_start, rule="project"):
    """Rows of the sign table for (previous, current) pairs: ours (multiplied ids), or the records'
    with row 0 at a start: record89's xor of the raw ids, record92's multiplied ids."""
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    if rule == "project":
        return ((SIGN_MULT_CUR * cur) ^ (SIGN_MULT_PREV * prev)) % SIGN_ROWS
    a, b = (1, 1) if rule == "record89" else RECORD_BIGRAM_SIGN_MULTS
    return torch.where(is_doc_start, 0, ((a * cur) ^ (b * prev)) % SIGN_ROWS)


def two_tokens_back(tokens, is_doc_start):
    """(the token two positions back in its document, BOS where there is none; whether the
    token is one of its document's first two, which have no trigram)."""
    first_two = is_doc_start | after_starts(is_doc_start)
    return torch.where(first_two, BOS_ID, torch.roll(tokens, 2)), first_two


def ngram_rows(tokens, is_doc_start, rows, record=False):
    """(T, 2) rows of the n-gram table: each token's bigram row in [0, rows/2) (bigram_rows of
    that half: a document's first token takes its last row) and its trigram row in
    [rows/2, rows), where a document's first two tokens take the last row. record: the records'
    int32 arithmetic (bigram_rows)."""
    half = rows // 2
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    prev2, first_two = two_tokens_back(tokens, is_doc_start)
    products = (TRIGRAM_MULT_CUR * cur, TRIGRAM_MULT_PREV * prev, TRIGRAM_MULT_PREV2 * prev2.long())
    if record:
        products = [wrap_int32(p) for p in products]
    trigram = (products[0] ^ products[1] ^ products[2]) % (rows - half - 1)
    return torch.stack([bigram_rows(tokens, is_doc_start, half, record),
                        torch.where(first_two, rows - 1, trigram + half)], dim=1)


def trigram_sign_rows(tokens, is_doc_start, record=False):
    """Rows of the sign table for the trigrams: ours, or record 92's (row 0 for a document's
    first two tokens)."""
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    prev2, first_two = two_tokens_back(tokens, is_doc_start)
    a, b, c = RECORD_TRIGRAM_SIGN_MULTS if record else TRIGRAM_SIGN_MULTS
    rows = ((a * cur) ^ (b * prev) ^ (c * prev2.long())) % SIGN_ROWS
    return torch.where(first_two, 0, rows) if record else rows


@dataclass(frozen=True)
class TablePlacement:
    """Where the n-gram table's rows live: this process's share (shard of shards), on the device,
    or (cache_rows > 0, one process) in host memory with that many rows cached on the device.
    The table and its cache are made on `device` directly, not copied there: they can be most of it."""
    shard: int = 0
    shards: int = 1
    cache_rows: int = 0
    device: torch.device = torch.device("cpu")


class NgramTable(nn.Module):
    """The hashed bigram+trigram embedding: one table of `rows` x dim, bigram rows in the first
    half and trigram rows in the second, zero at the start. A token's output is its bigram row
    times a sign row plus its trigram row times another (the sign trick: tokens that share a
    hashed row see it with different signs in each dim).

    The table is a buffer, not a parameter: no dense gradient or optimizer state of its size
    exists. In training the gathered rows add `sink[:T]` (zeros), so the backward leaves each
    token's two row gradients in sink.grad[:T] (T, 2, dim), the entries the trainer hands to
    optim.SparseRowAdam with the rows they belong to (`rows_of`). (The trainer cuts the sink to T
    rows while it trains, GPT.sinks_of: then the sink is added whole.)

    Where the rows live (TablePlacement): all in `table` on the device; or split across
    processes, this one holding rows [first_row, first_row + rows / shards) in `table`; or in
    `table` in host memory (which .to(device) leaves there), with `fetched` a device cache of
    cache_rows of them. Split or on the host, a forward reads each token's two rows from
    `fetched` at `slots` (T, 2), which the trainer fills before the forward (ShardedNgramRows,
    HostNgramRows)."""

    def __init__(self, rows, dim, max_tokens, dtype=torch.float32, placement=None, cross_documents=False,
                 record_hashes=False, normalized=False):
        super().__init__()
        placement = placement or TablePlacement()
        self.rows, self.on_host = rows, placement.cache_rows > 0
        self.cross_documents, self.record_hashes = cross_documents, record_hashes  # (token_starts, ngram_rows)
        # normalized: each token hashed as its normalized id; a copy on the host too, where the
        # trainer computes a slice's rows
        self.normalized_on_host = normalized_ids() if normalized else None
        self.register_buffer("normalized", self.normalized_on_host, persistent=False)
        self.gathered = placement.shards > 1 or self.on_host
        self.first_row = placement.shard * (rows // placement.shards)
        device = placement.device
        table = (torch.zeros(rows, dim, dtype=dtype, pin_memory=torch.cuda.is_available()) if self.on_host else
                 torch.zeros(rows // placement.shards, dim, dtype=dtype, device=device))
        self.register_buffer("table", table)
        self.sink = nn.Parameter(torch.zeros(max_tokens, 2, dim))
        if self.gathered:          # split: a slice's distinct rows; on the host: the cache
            fetched = placement.cache_rows or 2 * max_tokens
            self.register_buffer("fetched", torch.zeros(fetched, dim, dtype=dtype, device=device), persistent=False)
            self.register_buffer("slots", torch.zeros(max_tokens, 2, dtype=torch.int64), persistent=False)

    def _apply(self, fn, recurse=True):
        """Module.to() and friends, but a table in host memory stays there."""
        if not self.on_host:
            return super()._apply(fn, recurse)
        table = self._buffers.pop("table")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers["table"] = table

    def hashed(self, context):
        """The ids the hashes read: the tokens, or with normalized ones their normalized ids."""
        if self.normalized is None:
            return context
        ids = self.normalized if self.normalized.device == context.device else self.normalized_on_host
        return ids[context.long()]

    def rows_of(self, context, is_start):
        return ngram_rows(self.hashed(context), is_start, self.rows, self.record_hashes)

    def slice_rows(self, tokens):
        """The (2T,) rows of a slice's tokens (T,): each token's bigram row, then its trigram row."""
        return self.rows_of(tokens, token_starts(tokens, self.cross_documents)).reshape(-1)

    def forward(self, context, is_start, seen, signs, lookup=False):
        """(T, dim) for the last T = len(context) - seen tokens of `context`; with `lookup` (a
        generation step) the rows are read from `table` even if the trainer fetches them."""
        count = context.shape[0] - seen
        if self.gathered and not lookup:
            entries = self.fetched[self.slots[:count]]
        else:
            rows = self.rows_of(context, is_start)[seen:]
            entries = self.table[rows.to(self.table.device)].to(context.device)
        if self.training:
            entries = entries + first_rows(self.sink, count)
        rule, ids = "record92" if self.record_hashes else "project", self.hashed(context)
        return (entries[:, 0] * signs[bigram_sign_rows(ids, is_start, rule)[seen:]]
                + entries[:, 1] * signs[trigram_sign_rows(ids, is_start, self.record_hashes)[seen:]])


def normalized_ids():
    """(PADDED_VOCAB_SIZE,) int64: each token id's normalized id (data/tokenizer.normalized_tokens);
    the padding ids, which no text holds, map to themselves."""
    ids = torch.arange(PADDED_VOCAB_SIZE)
    ids[:VOCAB_SIZE] = torch.from_numpy(normalized_tokens()).long()
    return ids


def first_rows(t, n):
    """t[:n], or t itself when it has n rows: a slice's backward makes a zero-filled gradient of
    all of t's rows."""
    return t if t.shape[0] == n else t[:n]
