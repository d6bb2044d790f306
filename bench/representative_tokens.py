"""Token shards with the tiny corpus's statistics, for a machine that lacks the corpus (the GPU
image cannot build it: no network, no tokenizer package).

    python bench/representative_tokens.py --write       # TOKEN_STATS from data/tiny_corpus's train shards

The statistics (TOKEN_STATS, about 100 kB): how often each of the corpus's distinct tokens
occurs (its unigram distribution, BOS left out) and every train document's length. A shard
drawn from them has documents of the corpus's lengths, each BOS then tokens drawn one by one from
the unigram distribution: a 49,152-token slice holds about 6,000 distinct tokens (the corpus's own
slices about 5,600; uniformly random ids about 31,000), so sampled softmax, the n-gram table's
rows and the losses see text-like repetition. Its word order is not the corpus's: the loss
settles at the unigram entropy (about 6.4 nats), never below.
"""
import argparse
import pathlib
import sys

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from data.shards import read_shard, write_shard  # noqa: E402
from data.tiny_corpus import DEFAULT_DIR, TRAIN_SHARD_NAME  # noqa: E402
from data.tokenizer import BOS_ID  # noqa: E402

TOKEN_STATS = pathlib.Path(__file__).resolve().parent / "tiny_corpus_tokens.npz"


def corpus_statistics(corpus_dir=DEFAULT_DIR):
    """(tokens, counts, document lengths) of a tiny corpus's train shards: each distinct token but
    BOS with its count, ascending ids; each document's length, BOS included, in shard order."""
    files = sorted(pathlib.Path(corpus_dir).glob(TRAIN_SHARD_NAME.replace("{:06d}", "*")))
    if not files:
        raise SystemExit(f"no train shards in {corpus_dir}: build them with `python data/tiny_corpus.py`")
    stream = np.concatenate([np.asarray(read_shard(f)) for f in files])
    starts = np.flatnonzero(stream == BOS_ID)
    lengths = np.diff(np.append(starts, stream.size))
    tokens, counts = np.unique(stream[stream != BOS_ID], return_counts=True)
    return tokens.astype(np.uint16), counts.astype(np.uint32), lengths.astype(np.uint16)


def write_statistics(corpus_dir=DEFAULT_DIR, path=TOKEN_STATS):
    tokens, counts, lengths = corpus_statistics(corpus_dir)
    np.savez_compressed(path, tokens=tokens, counts=counts, doc_lengths=lengths)
    return path


def load_statistics(path=TOKEN_STATS):
    """(tokens, their probabilities, document lengths) of TOKEN_STATS."""
    with np.load(path) as stats:
        counts = stats["counts"].astype(np.float64)
        return stats["tokens"].astype(np.int64), counts / counts.sum(), stats["doc_lengths"].astype(np.int64)


def representative_tokens(num_tokens, generator, path=TOKEN_STATS):
    """num_tokens of documents with the statistics' lengths, each BOS then unigram draws."""
    tokens, probabilities, lengths = load_statistics(path)
    chosen = generator.choice(lengths, size=num_tokens // int(lengths.min()) + 1)
    chosen = chosen[:np.searchsorted(np.cumsum(chosen), num_tokens) + 1]
    stream = generator.choice(tokens, size=int(chosen.sum()), p=probabilities).astype(np.uint16)
    stream[np.cumsum(chosen) - chosen] = BOS_ID
    return stream[:num_tokens]


def write_representative_shard(path, num_tokens, generator):
    write_shard(path, representative_tokens(num_tokens, generator))


def main(argv=None):
    parser = argparse.ArgumentParser(description="The tiny corpus's token statistics, for shards that stand in "
                                                 "for it where it is absent.")
    parser.add_argument("--write", action="store_true", help=f"write {TOKEN_STATS.name} from the corpus")
    parser.add_argument("--corpus", default=str(DEFAULT_DIR), help="the corpus folder (data/tiny_corpus)")
    args = parser.parse_args(argv)
    if not args.write:
        parser.error("nothing to do: pass --write")
    print(f"wrote {write_statistics(args.corpus)}")


if __name__ == "__main__":
    main()
