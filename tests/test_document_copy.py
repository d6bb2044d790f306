"""PR 378's document copy feature: the keys of every length's context (the Triton kernel under the
interpreter, its plain-torch reference, and the hash's definition in Python integers) and the
match (candidate, bucket) against a brute-force scan of each position's document, on token
streams with planted repeats; the feature never reads a token after its position."""
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from interpreter_shim import REPO_ROOT, isolated

sys.path.insert(0, str(REPO_ROOT))
import kernels  # noqa: E402  (interpreted inside the worker)

interpreted = isolated(interpret=True)

BOS = 50256                        # GPT-2's <|endoftext|>: a document starts at each
LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)   # PR 378's match lengths
MASK64 = 2 ** 64 - 1


def normalized_table():
    """Each id's normalized id: the shipped table (padding ids map to themselves)."""
    from data.tokenizer import normalized_tokens
    ids = torch.arange(50304)
    ids[:50257] = torch.from_numpy(normalized_tokens()).long()
    return ids


def repetitive_stream(seed, length, vocab=3000, bos_first=True, variants=None):
    """Documents of 20-200 tokens built of fresh random pieces, copies of their own earlier spans
    (1-40 tokens) and a chorus (their last 24-40 tokens) sung three more times after a fresh token
    or two, so that contexts of every match length repeat up to 3 times and more; ids below
    `vocab`. With `variants` (normalized id -> the ids below vocab that share it) a copied id
    becomes another of its variants with probability 1/4 (" the" for "The"). The stream may start
    inside a document."""
    rng = np.random.default_rng(seed)
    swap = lambda ids: [int(rng.choice(variants[x])) if variants and rng.random() < 0.25 else x  # noqa: E731
                        for x in ids]
    fresh = lambda most: rng.integers(0, vocab, int(rng.integers(1, most))).tolist()  # noqa: E731
    out = [] if bos_first else fresh(6)
    while len(out) < length:
        doc, size = [BOS], int(rng.integers(20, 200))
        while len(doc) < size:
            draw = rng.random()
            if len(doc) > 4 and draw < 0.4:
                start = int(rng.integers(1, len(doc)))
                doc += swap(doc[start:start + int(rng.integers(1, 41))])
            elif len(doc) > 40 and draw < 0.45:
                chorus = doc[-int(rng.integers(24, 41)):]
                for _ in range(3):
                    doc += fresh(3) + swap(chorus)
            else:
                doc += fresh(6)
        out += doc
    return torch.tensor(out[:length])


def variants_of(normalized, vocab=3000):
    ids = {}
    for i, n in enumerate(normalized[:vocab].tolist()):
        ids.setdefault(n, []).append(i)
    return {i: ids[n] for i, n in enumerate(normalized[:vocab].tolist())}


def brute_force(tokens, normalized):
    """(candidate, bucket) by definition: for each t, its document's start s (the latest BOS at
    or before t, else 0); for each length L, longest first, whose window t-L+1 >= s: the earlier
    ends j (s + L - 1 <= j < t) whose L normalized ids equal t's; the first length with any wins,
    candidate the raw token after the latest j, bucket 3 (length index) + min(#ends, 3)."""
    raw = tokens.tolist()
    ids = normalized[tokens.long()].tolist()
    candidate, bucket, start = [-1] * len(raw), [0] * len(raw), 0
    for t in range(len(raw)):
        if raw[t] == BOS:
            start = t
        for index in reversed(range(len(LENGTHS))):
            L = LENGTHS[index]
            if t - L + 1 < start:
                continue
            ends = [j for j in range(start + L - 1, t) if ids[j - L + 1:j + 1] == ids[t - L + 1:t + 1]]
            if ends:
                candidate[t], bucket[t] = raw[ends[-1] + 1], 3 * index + min(len(ends), 3)
                break
    return torch.tensor(candidate), torch.tensor(bucket)


def keys_by_definition(tokens, normalized, t):
    """Row l's key at t in Python integers: sum_{k<L} (norm[x[t-k]] + 1) M^k mod 2^64, xor L times
    the length multiplier, xor the document's index (BOS tokens up to t) times the document
    multiplier, as int64; -1 - t where the window starts before t's document."""
    raw, ids = tokens.tolist(), normalized[tokens.long()].tolist()
    doc = sum(1 for x in raw[:t + 1] if x == BOS)
    start = max([j for j in range(t + 1) if raw[j] == BOS], default=0)
    out = []
    for L in LENGTHS:
        if t - L + 1 < start:
            out.append(-1 - t)
            continue
        h = sum((ids[t - k] + 1) * pow(0x9E3779B97F4A7C15, k, 2 ** 64) for k in range(L)) & MASK64
        key = h ^ ((L * 0x2545F4914F6CDD1D) & MASK64) ^ ((doc * 0x5851F42D4C957F2D) & MASK64)
        out.append(key - 2 ** 64 if key >= 2 ** 63 else key)
    return out


def features(tokens, normalized, keys_fn=kernels.copy_keys_reference):
    return kernels.document_copy_matches(tokens, keys_fn(tokens, normalized, BOS))


@pytest.mark.parametrize("bos_first", [True, False])
def test_the_reference_keys_are_the_hash_by_definition(bos_first):
    """Every position of a 120-token stream, every length (the windows near each document's
    start among them; a stream that starts inside a document): the reference's keys equal the
    hash computed in Python integers."""
    normalized = normalized_table()
    tokens = repetitive_stream(1, 120, bos_first=bos_first)
    keys = kernels.copy_keys_reference(tokens, normalized, BOS)
    want = torch.tensor([keys_by_definition(tokens, normalized, t) for t in range(len(tokens))]).T
    assert torch.equal(keys, want)
    assert (keys < 0).any() and (keys[:, 40:] > 2 ** 62).any(), "keys use all 64 bits"


@interpreted
@pytest.mark.parametrize("dtype, block, bos_first", [(torch.int64, 64, True), (torch.int32, 32, False),
                                                     (torch.int32, 256, True)])
def test_the_keys_kernel_equals_the_reference(dtype, block, bos_first):
    """The Triton kernel's keys, bit for bit: several documents (one of one token, two BOS in a
    row), a stream that starts inside a document, a length no multiple of the block, blocks
    smaller and larger than the stream's documents."""
    normalized = normalized_table()
    tokens = repetitive_stream(2, 301, bos_first=bos_first)
    tokens[[60, 61, 200]] = BOS
    tokens = tokens.to(dtype)
    got = kernels.copy_keys(tokens, normalized, BOS, kernels.LaunchConfig(block_m=block, block_n=0))
    want = kernels.copy_keys_reference(tokens, normalized, BOS)
    assert torch.equal(got, want)
    candidate, bucket = kernels.document_copy_matches(tokens, got)
    want_candidate, want_bucket = brute_force(tokens, normalized)
    assert torch.equal(candidate, want_candidate) and torch.equal(bucket, want_bucket)


@pytest.mark.parametrize("seed", [1, 2, 4])
def test_the_match_is_the_longest_latest_earlier_context_of_the_document(seed):
    """Candidate and bucket of every position against the brute-force scan; the streams reach
    every length and every count bucket, and normalization matches contexts whose raw ids differ."""
    normalized = normalized_table()
    tokens = repetitive_stream(seed, 700, bos_first=seed != 4, variants=variants_of(normalized))
    candidate, bucket = features(tokens, normalized)
    want_candidate, want_bucket = brute_force(tokens, normalized)
    assert torch.equal(bucket, want_bucket)
    assert torch.equal(candidate, want_candidate)
    assert set(want_bucket.tolist()) == set(range(kernels.COPY_BUCKETS)), "every bucket occurs"
    _, raw_bucket = brute_force(tokens, torch.arange(len(normalized)))
    assert (raw_bucket != want_bucket).any(), "some contexts match only after normalization"


def test_no_feature_reads_a_token_after_its_position():
    """For cut points across a stream, changing every later token (BOS tokens and copies of the
    stream included) changes no feature at or before the cut."""
    normalized = normalized_table()
    tokens = repetitive_stream(6, 400)
    candidate, bucket = features(tokens, normalized)
    g = torch.Generator().manual_seed(0)
    for cut in (0, 1, 37, 150, 151, 398):
        changed = tokens.clone()
        later = torch.randint(0, 3000, (len(tokens) - cut - 1,), generator=g)
        later[::7] = BOS
        changed[cut + 1:] = torch.where(torch.rand(later.shape, generator=g) < 0.5, later, tokens[:len(later)])
        got_candidate, got_bucket = features(changed, normalized)
        assert torch.equal(got_candidate[:cut + 1], candidate[:cut + 1]), cut
        assert torch.equal(got_bucket[:cut + 1], bucket[:cut + 1]), cut


def test_the_match_compiles_with_fullgraph():
    """torch.compile(fullgraph=True) traces the keys and the match (no host value, fixed shapes):
    the same features."""
    normalized = normalized_table()
    tokens = repetitive_stream(7, 300)
    compiled = torch.compile(features, backend="aot_eager", fullgraph=True, dynamic=False)
    for got, want in zip(compiled(tokens, normalized), features(tokens, normalized)):
        assert torch.equal(got, want)


@interpreted
def test_the_keys_kernel_compiles_with_fullgraph():
    """The kernel's custom op traces under torch.compile(fullgraph=True) by its fake (meta)
    implementation, with the match after it: the eager features."""
    normalized = normalized_table()
    tokens = repetitive_stream(8, 200).int()
    run = lambda t, n: features(t, n, kernels.copy_keys)  # noqa: E731
    compiled = torch.compile(run, backend="aot_eager", fullgraph=True, dynamic=False)
    for got, want in zip(compiled(tokens, normalized), features(tokens, normalized)):
        assert torch.equal(got, want)


@interpreted
def test_the_keys_op_passes_opcheck():
    """The custom op's schema, fake (meta) implementation and dispatch (torch.library.opcheck)."""
    normalized = normalized_table()
    tokens = repetitive_stream(9, 100)
    doc = kernels.copy_document_index(tokens, BOS)
    config = kernels.LaunchConfig(block_m=32, block_n=0).as_list()
    torch.library.opcheck(kernels._copy_keys_op, (tokens, normalized, doc, BOS, config),
                          test_utils=("test_schema", "test_faketensor"))


# ops that wait for the device (a value read back, a size that depends on the data) or make a
# tensor from host data (lift_fresh: torch.tensor of a Python list, a host copy in a captured step)
UNCAPTURABLE = {"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero", "masked_select", "_unique2",
                "unique_consecutive", "bincount", "repeat_interleave", "lift_fresh", "lift_fresh_copy"}


class OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names, self.mask_indexed = set(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names.add(name)
        if name in ("index", "index_put", "index_put_") and len(args) > 1:
            self.mask_indexed |= any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        return func(*args, **(kwargs or {}))


def test_the_features_can_be_captured():
    """The keys (reference) and the match, and the model's copy vectors from them: no op waits for
    the device or copies host data (UNCAPTURABLE, a boolean-mask index)."""
    import train_gpt as tg
    normalized = normalized_table()
    tokens = repetitive_stream(10, 300)
    module = tg.DocumentCopy(16, kernels.copy_keys_reference)
    embed = torch.nn.Embedding(50304, 16)
    with OpNames() as ops:
        features(tokens, normalized)
        module(tokens, embed)
    assert "sort" in ops.names and not ops.names & UNCAPTURABLE and not ops.mask_indexed
