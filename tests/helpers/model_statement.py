"""The model and its objective stated a second time, apart from train_gpt: plain torch in float64.

Nothing here calls train_gpt's or kernels' functions or modules. The statement reads the
model's parameters by their state-dict names and its config's fields, and restates everything
else from the definitions, with the published constants written as literals: the n-gram hashes,
the sign table, RoPE with YaRN, attention over documents and windows (narrow, paired, offset
keys, XSA, gates, composed maps), the MLPs, the U-net and dense trunks, the softcap, the
multi-token, prefix and sampled-softmax objective, the canonical mask, the pointer mixture (PR 379's
copy-sink pointer LM), the document copy feature (PR 378), and the loader's targets.

The tests compare it with train_gpt.GPT (tests/test_model_statement.py); a wiring change in
either shows up as a difference far above the rounding both make.
"""
import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

VOCAB = 50304                      # GPT-2's 50,257 ids padded to a multiple of 128
BOS = 50256                        # <|endoftext|>: every document starts with it
SOFTCAP, SOFTCAP_SHIFT, SOFTCAP_TEMP = 23.0, 5.0, 7.5   # z = 23 sigmoid((logit + 5) / 7.5): records 89, 92
MASKED_LOGIT = -60.0               # a non-canonical pair's softcapped logit at validation
SIGN_ROWS, SIGN_SEED = 8192, 1234  # the fixed +/-1 sign table and its generator's seed
BIGRAM = (36313, 27191)            # row hash (current, previous): record 92's ngram_table.py BIGRAM_ROW_MULS
BIGRAM_SIGN = (40351, 51349)       # this repository's sign hash (table_hashes project)
TRIGRAM = (17351, 60961, 45259)    # row hash (current, previous, the one before): ngram_table.py TRIGRAM_ROW_MULS
TRIGRAM_SIGN = (29363, 47119, 13709)  # this repository's sign hash (table_hashes project)
RECORD92_BIGRAM_SIGN = (48271, 30011)           # ngram_table.py BIGRAM_SIGN_MULS: (current, previous)
RECORD92_TRIGRAM_SIGN = (58699, 39779, 26801)   # ngram_table.py TRIGRAM_SIGN_MULS: (current, previous, before)
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp: rotations per old window below alpha interpolate, above beta keep
XSA_EPS = 1e-4                     # F.normalize's floor on |v|
COMPOSED_MIX_EPS = 1e-6            # the RMS norm over heads of composed attention's input mix
SMEAR_DIMS = 12                    # the smear gate reads a token's first 12 embedding dims (records' smear_gate)
TOKEN_GATE_INIT_SCALE = 0.1        # not read: the learned scale is a parameter (token_gates.scale)
DENSE_SCALE = 0.1                  # the dense connections' fixed output scale (records' _mudd_scale)
FINAL_GROUPS = 12                  # record 92's final mix: channel groups with a delta each (model/gpt.py MUDD_GROUPS)
LAST_LAYER_MIX = ("v_input", "v_snapshot", "v_residual", "input", "snapshot", "residual", "ve_lane0", "ve_lane1",
                  "attn_residual", "attn_out", "x0", "hashed", "mlp_residual", "mlp_out")
FINAL_MIX = ("input", "snapshot", "last_input", "value_embed", "skip_source")
CANDIDATE_STRIDE = 20011           # record 92's sampled_softmax.py NEGATIVE_STRIDE
COPY_ID = 50257                    # PR 379: the <copy> slot, whose softmax mass is the pointer's share
COPY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)   # PR 378: the context lengths the copy feature matches
COPY_COUNTS = 3                    # PR 378: a match's bucket tells 1, 2, and 3 or more earlier matches apart
EPS64 = torch.finfo(torch.float64).eps


def rms(x, eps=EPS64):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def mlp(up, down, x):
    return torch.relu(x @ up.T).pow(2) @ down.T


def softcap(logits):
    return SOFTCAP * torch.sigmoid((logits + SOFTCAP_SHIFT) / SOFTCAP_TEMP)


# ---------------------------------------------------------------------------------------------
# data: the loader's slice and its targets, and the sampled-softmax candidates


def loader_slice(stream, T, max_doc_len, targets=3, rule="document", segment=0):
    """(tokens (T,), targets (T, targets), cu_seqlens) of the first slice of a BOS-separated
    stream: whole documents from its start, each cut to max_doc_len and the last to fit, at most
    T // 16 attention segments of them, BOS-padded.

    rule "document": target k of the token at stream position p is stream[p + k + 1] if that is
    at most the next document's BOS, else -1 (so the last token of a document predicts the next
    BOS; a cut document's last kept token still predicts its true successor). rule "packed": the
    slice's tokens followed by one more token, the last piece's true successor when that piece
    was cut to fit the slice (shorter than its document and than max_doc_len), else a BOS (the
    start of the document the next slice takes); target k of slice token i is token i + k + 1 of
    that sequence, -1 past its end, and -1 on padding.

    segment > 0: inside each document, an attention boundary every `segment` tokens."""
    stream = np.asarray(stream)
    starts = [p for p in range(len(stream)) if stream[p] == BOS]
    tokens, tgts, cu, filled, d, used, last = [], [], [0], 0, 0, 0, None

    def segments(length):
        return -(-length // segment) if segment else 1
    while filled < T and used + segments(min(max_doc_len, T - filled)) <= T // 16:
        start = starts[d]
        end = starts[d + 1] if d + 1 < len(starts) else len(stream)
        d += 1
        length = min(end - start, max_doc_len, T - filled)
        for p in range(start, start + length):
            tokens.append(int(stream[p]))
            tgts.append([int(stream[p + k + 1]) if p + k + 1 <= end and p + k + 1 < len(stream) else -1
                         for k in range(targets)])
        for boundary in range(segment, length, segment) if segment else ():
            cu.append(filled + boundary)
        filled += length
        used += segments(length)
        cu.append(filled)
        last = (start, length, end)
    if rule == "packed":
        start, length, end = last
        cut_to_fit = length < end - start and length < max_doc_len
        sequence = tokens + [int(stream[start + length]) if cut_to_fit else BOS]
        tgts = [[sequence[i + k + 1] if i + k + 1 < len(sequence) else -1 for k in range(targets)]
                for i in range(len(tokens))]
    while len(tokens) < T:
        tokens.append(BOS)
        tgts.append([-1] * targets)
    if cu[-1] < T:
        cu.append(T)
    return torch.tensor(tokens), torch.tensor(tgts), torch.tensor(cu)


def candidate_start(slice_index, slices):
    """Record 92: rank r of 8 starts its walk at r x V / 8."""
    return slice_index * (VOCAB // slices)


def candidates(targets, count, start, always=()):
    """Sorted ids: every distinct target id (and the ids `always`: the pointer mixture's <copy>),
    then negatives as record 92 draws them: the ids (k * 20011) mod 50304 for k = start, start + 1,
    ..., 1.7 x as many as it needs + 256, the targets and repeats removed, the first it needs
    kept; `count` in all."""
    chosen = sorted({int(t) for t in targets.flatten().tolist() if t >= 0} | set(always))
    assert len(chosen) <= count
    need = count - len(chosen)
    drawn = [((start + j) * CANDIDATE_STRIDE) % VOCAB for j in range(int(1.7 * need) + 256)]
    negatives = [idx for idx in dict.fromkeys(drawn) if idx not in set(chosen)][:need]
    assert len(negatives) == need
    return torch.tensor(sorted(chosen + negatives))


def prefix_targets(next_tokens, token_bytes, ids_of_bytes):
    """The longest proper byte prefix of each next token that is itself a token, -1 where there is
    none or no next token."""
    out = []
    for t in next_tokens.tolist():
        found = -1
        if 0 <= t < len(token_bytes):
            b = token_bytes[t]
            for length in range(len(b) - 1, 0, -1):
                if b[:length] in ids_of_bytes:
                    found = ids_of_bytes[b[:length]]
                    break
        out.append(found)
    return torch.tensor(out)


# ---------------------------------------------------------------------------------------------
# the parts of a token: starts, n-gram rows, signs


def sign_table(dim):
    g = torch.Generator().manual_seed(SIGN_SEED)
    return (torch.randint(0, 2, (SIGN_ROWS, dim), generator=g) * 2 - 1).double()


def token_context(tokens, cfg):
    """(starts, previous, two back, first two): a token starts a document at position 0 or at a
    BOS (only at position 0 with cfg.cross_documents: the slice is read as one stream); a
    start's predecessor is BOS; the first two tokens of a document have no token two back (BOS
    instead)."""
    T = len(tokens)
    cur = tokens.long()
    starts = torch.tensor([t == 0 or (int(tokens[t]) == BOS and not cfg.cross_documents) for t in range(T)])
    prev = torch.tensor([BOS if starts[t] else int(tokens[t - 1]) for t in range(T)])
    first_two = torch.tensor([bool(starts[t]) or (t >= 1 and bool(starts[t - 1])) for t in range(T)])
    prev2 = torch.tensor([BOS if first_two[t] else int(tokens[t - 2]) for t in range(T)])
    return cur, starts, prev, prev2, first_two


def int32(value):
    """A Python int as a signed 32-bit register holds it (the records' products overflow there)."""
    return (value + 2 ** 31) % 2 ** 32 - 2 ** 31


def record_rows(cfg, tokens, rows, trigram=False):
    """The records' hashed rows of a channel of `rows` rows (the bigram table, or one half of the
    n-gram table, numbered from its start): per token, in int32 arithmetic, its bigram
    (36313 x[t]) xor (27191 x[t-1]), or trigram (17351 x[t]) xor (60961 x[t-1]) xor (45259 x[t-2]),
    modulo rows - 1 (the non-negative remainder); the last row where there is no such n-gram.
    The token after a start reads the last row's id, rows - 1, as its previous token (the
    records hash in place, after the reserved id is written)."""
    cur, starts, prev, prev2, first_two = token_context(tokens, cfg)
    out = []
    for t in range(len(tokens)):
        if (first_two if trigram else starts)[t]:
            out.append(rows - 1)
            continue
        x, p = int(cur[t]), int(prev[t])
        if trigram:
            h = int32(TRIGRAM[0] * x) ^ int32(TRIGRAM[1] * p) ^ int32(TRIGRAM[2] * int(prev2[t]))
        else:
            h = int32(BIGRAM[0] * x) ^ int32(BIGRAM[1] * (rows - 1 if starts[t - 1] else p))
        out.append(h % (rows - 1))
    return torch.tensor(out)


@functools.cache
def normalized_ids():
    """(VOCAB,) each id's normalized id: the smallest id whose text, casefolded, with everything
    but letters and digits removed, is the same; an id keeps its own where that leaves nothing,
    where its bytes are not whole UTF-8, and for BOS and the padding ids."""
    from data.tokenizer import gpt2_encoding   # the token bytes only
    enc, ids, first = gpt2_encoding(), list(range(VOCAB)), {}
    for i in range(BOS):
        try:
            text = enc.decode_single_token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue
        key = "".join(ch for ch in text.casefold() if ch.isalnum())
        if key:
            ids[i] = first.setdefault(key, i)
    return torch.tensor(ids)


def copy_matches(tokens):
    """(candidate, bucket), each (T,), of PR 378's document copy feature. Walking each document
    (from a BOS, or the slice's start) left to right with, per length L, the end positions seen
    so far of each context of L normalized ids: at t, the longest L whose context (inside the
    document) was seen wins; candidate the raw token after its latest end, bucket 3 (L's index) +
    min(ends seen, 3); no match: candidate 0 (unused), bucket 0."""
    raw, ids = tokens.tolist(), normalized_ids()[tokens.long()].tolist()
    candidate, bucket, start, seen = [0] * len(raw), [0] * len(raw), 0, {}
    for t in range(len(raw)):
        if raw[t] == BOS:
            start, seen = t, {}
        contexts = [(L, tuple(ids[t - L + 1:t + 1])) for L in COPY_LENGTHS if t - L + 1 >= start]
        for index, context in reversed(list(enumerate(contexts))):
            ends = seen.get(context)
            if ends:
                candidate[t], bucket[t] = raw[ends[-1] + 1], COPY_COUNTS * index + min(len(ends), COPY_COUNTS)
                break
        for context in contexts:
            seen.setdefault(context, []).append(t)
    return torch.tensor(candidate), torch.tensor(bucket)


def copy_vectors(P, tokens):
    """PR 378's copy vector of each position: scale[bucket] embed[candidate] + bucket_embed[bucket],
    0 where nothing matched."""
    candidate, bucket = copy_matches(tokens)
    v = P["document_copy.scale"][bucket][:, None] * P["embed.weight"][candidate]
    v = v + P["document_copy.bucket_embed"][bucket]
    return torch.where(bucket[:, None] > 0, v, 0.0)


def ngram_rows(cfg, tokens):
    """(bigram row, trigram row, bigram sign row, trigram sign row), each (T,), of the n-gram table
    of cfg.ngram_rows rows: bigrams hash into the first half, whose last row takes a document's
    first token; trigrams into the second half, whose last row takes its first two tokens. The
    records' hashes (cfg.table_hashes "record"): record_rows, and record 92's sign rows, row 0
    where there is no n-gram. With cfg.ngram_normalized every hash reads normalized ids."""
    if getattr(cfg, "ngram_normalized", False):
        tokens = normalized_ids()[tokens.long()]
    cur, starts, prev, prev2, first_two = token_context(tokens, cfg)
    R = cfg.ngram_rows
    half = R // 2
    if cfg.table_hashes == "record":
        brow = record_rows(cfg, tokens, half)
        trow = record_rows(cfg, tokens, R - half, trigram=True) + half
        b, t = RECORD92_BIGRAM_SIGN, RECORD92_TRIGRAM_SIGN
        sign_b = torch.where(starts, 0, ((b[0] * cur) ^ (b[1] * prev)) % SIGN_ROWS)
        sign_t = torch.where(first_two, 0, ((t[0] * cur) ^ (t[1] * prev) ^ (t[2] * prev2)) % SIGN_ROWS)
        return brow, trow, sign_b, sign_t
    brow = torch.where(starts, half - 1, ((BIGRAM[0] * cur) ^ (BIGRAM[1] * prev)) % (half - 1))
    trow = torch.where(first_two, R - 1,
                       ((TRIGRAM[0] * cur) ^ (TRIGRAM[1] * prev) ^ (TRIGRAM[2] * prev2)) % (R - half - 1) + half)
    sign_b = ((BIGRAM_SIGN[0] * cur) ^ (BIGRAM_SIGN[1] * prev)) % SIGN_ROWS
    sign_t = ((TRIGRAM_SIGN[0] * cur) ^ (TRIGRAM_SIGN[1] * prev) ^ (TRIGRAM_SIGN[2] * prev2)) % SIGN_ROWS
    return brow, trow, sign_b, sign_t


def bigram_part(P, cfg, tokens, signs):
    """The bigram embedding's (or the n-gram table's) output per token: each hashed row times its
    sign row (the sign trick). The records' bigram table: record_rows, and record 89's sign row,
    the xor of the two ids (row 0 at a start)."""
    cur, starts, prev, prev2, first_two = token_context(tokens, cfg)
    if cfg.ngram_rows:
        brow, trow, sign_b, sign_t = ngram_rows(cfg, tokens)
        table = P["ngram.table"]
        return table[brow] * signs[sign_b] + table[trow] * signs[sign_t]
    row, sign_b = bigram_table_rows(cfg, tokens)
    return P["bigram.weight"][row] * signs[sign_b]


def bigram_table_rows(cfg, tokens):
    """(row, sign row) of each token in the bigram table of cfg.bigram_rows rows."""
    cur, starts, prev, prev2, first_two = token_context(tokens, cfg)
    rows = cfg.bigram_rows
    if cfg.table_hashes == "record":
        return record_rows(cfg, tokens, rows), torch.where(starts, 0, (cur ^ prev) % SIGN_ROWS)
    row = torch.where(starts, rows - 1, ((BIGRAM[0] * cur) ^ (BIGRAM[1] * prev)) % (rows - 1))
    return row, ((BIGRAM_SIGN[0] * cur) ^ (BIGRAM_SIGN[1] * prev)) % SIGN_ROWS


def value_table_of_layer(cfg):
    if cfg.value_embed_layers:
        return {layer: i for i, layer in enumerate(cfg.value_embed_layers)}
    n, k = cfg.num_layers, cfg.num_value_embeds
    out = {i: i for i in range(k)}
    out.update({n - k + i: i for i in range(k)})
    return out


# ---------------------------------------------------------------------------------------------
# rotary tables


def rotary(cfg, narrow, history, positions):
    """(cos, sin) (positions, D/2) and the softmax scale of a layer after the windows grew through
    `history` = (long windows, short windows) (tokens): a layer follows the long window, a narrow
    one the short window when cfg.narrow_yarn_window is "short". Base frequencies base^(-i/(n-1)),
    i < n, are float32 values as the model stores them: n = D/4 followed by D/4 zeros (stationary
    dims), or n = D/2 (narrow layers, all dims rotate)."""
    history = history[1] if narrow and cfg.narrow_yarn_window == "short" else history[0]
    D = cfg.narrow_qk_dim if narrow else cfg.head_dim
    n = D // 2 if narrow else D // 4
    freq = ((1.0 / cfg.rope_base) ** torch.linspace(0, 1, n, dtype=torch.float32)).double()
    if not narrow:
        freq = torch.cat([freq, torch.zeros(n, dtype=torch.float64)])
    scale = cfg.narrow_qk_attn_scale if narrow else cfg.attn_scale
    for old, new in zip(history, history[1:]):
        turns = old * freq / (2 * math.pi)
        keep = ((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        freq = freq * (old / new + keep * (1 - old / new))
        scale = scale * (1 + cfg.yarn_scale_growth * math.log(new / old))
    angles = torch.arange(positions, dtype=torch.float64)[:, None] * freq[None, :]
    return angles.cos(), angles.sin(), scale, freq == 0


def rope(x, cos, sin):
    """x (N, H, D): dim i and dim i + D/2 turn together by angle[position, i]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c + x2 * s, x2 * c - x1 * s], dim=-1)


# ---------------------------------------------------------------------------------------------
# attention


def masked_softmax_attention(q, k, v, visible, scale):
    """q, k (N, H, d), v (N, H, dv), visible (N, N) bool: softmax over the visible keys."""
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    weights = scores.masked_fill(~visible[None], float("-inf")).softmax(-1)
    return torch.einsum("hij,jhd->ihd", weights, v)


def truncated_backward_attention(q, k, v, visible, scale, backward_windows):
    """masked_softmax_attention's value, its backward truncated per head (PR 371): for head h
    only the pairs less than backward_windows[h] positions apart (<= 0: all), with the full
    window's P and O. y = O + A - A.detach(), A_i = sum_j M_ij exp(S_ij - lse_i) (v_j - O_i) with
    lse and O held fixed: autograd through A gives dV = (M P)^T dO, dS = M P (dO v_j - dO O_i)."""
    N = q.shape[0]
    scores = (torch.einsum("ihd,jhd->hij", q, k) * scale).masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, -1, keepdim=True)
    o = torch.einsum("hij,jhd->ihd", torch.exp(scores - lse), v)
    distance = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    kept = torch.stack([visible & (distance < w) if w > 0 else visible for w in backward_windows])
    p_kept = torch.where(kept, torch.exp(scores - lse.detach()), 0.0)
    a = torch.einsum("hij,jhd->ihd", p_kept, v) - p_kept.sum(-1).t()[..., None] * o.detach()
    return o.detach() + a - a.detach()


def attention_layer(P, cfg, i, x, ve, starts, doc, history, windows, gates):
    """Layer i's attention on the normed residual x (T, dim): returns (T, dim)."""
    a = f"blocks.{i}.attn."
    T, H = x.shape[0], cfg.num_heads
    narrow_qk, narrow_vo = i in cfg.narrow_qk_layers, i in cfg.narrow_vo_layers
    dqk = cfg.narrow_qk_dim if narrow_qk else cfg.head_dim
    dv = cfg.narrow_vo_dim if narrow_vo else cfg.head_dim
    qkv = x @ P[a + "qkv"].T
    dense = cfg.trunk == "dense"
    if dense:
        qkv = qkv * P[a + "sa_lambdas"][0]
    q = qkv[:, :H * dqk].reshape(T, H, dqk)
    k = qkv[:, H * dqk:2 * H * dqk].reshape(T, H, dqk)
    v = qkv[:, 2 * H * dqk:].reshape(T, H, dv)
    if ve is not None:
        if "ve" in gates:
            gate = gates["ve"]
        else:
            g = cfg.value_embed_gate_dim
            inputs = torch.cat([x[:, :g // 2], ve[:, :g // 2]], -1) if cfg.value_embed_gate_reads_value else x[:, :g]
            gate = 2 * torch.sigmoid(inputs @ P[a + "ve_gate"].T)
        v = v + gate[:, :, None] * ve.reshape(T, H, -1)[..., :dv]   # a full-width table: each head's first dv
    if "v" in gates:
        v = v + gates["v"].reshape(T, H, dv)
    paired = i in cfg.paired_head_layers
    record_pairs = paired and cfg.paired_head_layout == "record"
    N = 2 * T if paired else T
    cos, sin, scale, stationary = rotary(cfg, narrow_qk, history, N)
    if record_pairs:               # head h of token t at position 2t + h // (H/2), slot h % (H/2), turned as 2t + h % 2
        turn = 2 * torch.arange(T)[:, None] + torch.arange(H)[None, :] % 2              # (T, H)
        place = 2 * torch.arange(T)[:, None] + torch.arange(H)[None, :] // (H // 2)
        slot = torch.arange(H)[None, :].expand(T, H) % (H // 2)

        def turned(t):
            half = t.shape[-1] // 2
            c, s_ = cos[turn], sin[turn]                                                 # (T, H, d/2)
            t1, t2 = t[..., :half], t[..., half:]
            return torch.cat([t1 * c + t2 * s_, t2 * c - t1 * s_], dim=-1)

        def placed(t):
            out = t.new_zeros(2 * T, H // 2, t.shape[-1])
            out[place, slot] = t
            return out
        q, k, v = placed(turned(rms(q))), placed(turned(rms(k))), placed(v)
        pos_doc = doc.repeat_interleave(2)
    elif paired:                   # position 2t + j holds head 2h + j of token t as head h
        def pair(t):
            return torch.stack([t[:, 0::2], t[:, 1::2]], dim=1).reshape(2 * T, H // 2, t.shape[-1])
        q, k, v = pair(q), pair(k), pair(v)
        pos_doc = doc.repeat_interleave(2)
        q, k = rope(rms(q), cos, sin), rope(rms(k), cos, sin)
    else:
        pos_doc = doc
        q, k = rope(rms(q), cos, sin), rope(rms(k), cos, sin)
    long = i in cfg.long_window_layers
    if cfg.key_offset and long:    # a key's stationary dims come from the previous token of its document
        still = stationary.repeat(2)
        shifted = torch.cat([k[:1], k[:-1]])
        k = torch.where(still[None, None, :] & ~starts[:, None, None], shifted, k)
    window = windows[1] if long else windows[0]
    pos = torch.arange(N)
    reach = window if cfg.window_edge_key else window - 1      # the farthest key back: w, or w - 1
    visible = (pos_doc[:, None] == pos_doc[None, :]) & (pos[None, :] <= pos[:, None]) \
        & (pos[:, None] - pos[None, :] <= reach)
    backward_windows = getattr(cfg, "backward_windows", {}).get(i)   # PR 371's truncated backward
    if backward_windows is None:
        y = masked_softmax_attention(q, k, v, visible, scale)
    else:
        y = truncated_backward_attention(q, k, v, visible, scale, backward_windows)
    if i in cfg.composed_layers:         # composed: the heads' maps over the last composed_window keys, mixed per token
        composed_visible = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]) \
            & (pos[:, None] - pos[None, :] < cfg.composed_window)
        scores = torch.einsum("ihd,jhd->hij", q, k) * scale
        maps = scores.masked_fill(~composed_visible[None], float("-inf")).softmax(-1)      # (H, T, T)
        mix_in = rms(gates["composed_in"], COMPOSED_MIX_EPS)
        mixed = torch.einsum("hij,ih->ij", maps, mix_in)
        y = y + gates["composed_out"][:, :, None] * torch.einsum("ij,jhd->ihd", mixed, v)
    if i in cfg.xsa_layers:
        alpha = gates["xsa"] if "xsa" in gates else P[a + "xsa_alpha"]
        unit = v / v.norm(dim=-1, keepdim=True).clamp_min(XSA_EPS)
        y = y - torch.tanh(alpha)[..., None] * (y * unit).sum(-1, keepdim=True) * unit
    if record_pairs:
        y = y[place, slot]
    elif paired:
        y = torch.stack([y[0::2], y[1::2]], dim=2).reshape(T, H, dv)
    if "attn" in gates:
        y = y * gates["attn"][:, :, None]
    out = y.reshape(T, H * dv) @ P[a + "out"].T
    return out * P[a + "sa_lambdas"][1] if dense else out


def mlps(P, cfg, i, x):
    if i in cfg.mlp_free_layers:
        return 0.0
    out = mlp(P[f"blocks.{i}.mlp.up"], P[f"blocks.{i}.mlp.down"], x)
    if i in cfg.parallel_mlp_layers:
        out = out + mlp(P[f"blocks.{i}.parallel_mlp.up"], P[f"blocks.{i}.parallel_mlp.down"], x)
    return out


# ---------------------------------------------------------------------------------------------
# gates


def injection_sites(cfg):
    """(x0's layers, the bigram's layers): cfg.x0_layers and cfg.hashed_layers, where null means
    every attention layer (but the dense trunk's last, which injects through its own mix)."""
    last = cfg.num_layers - 1 if cfg.trunk == "dense" else -1
    every = [i for i in range(cfg.num_layers) if i not in cfg.attention_free_layers and i != last]
    return (every if cfg.x0_layers is None else list(cfg.x0_layers),
            every if cfg.hashed_layers is None else list(cfg.hashed_layers))


def token_gate_layouts(cfg):
    """Two lists of (layer, kind, width), in output order: layers before the split feed the
    first MLP, the others the second; per layer: the skip's gate (dense, the skip's target), and
    on an attention layer its XSA strengths, output gates, composed mixes (in, out); then the x0
    and bigram injections where injection_sites put them."""
    out = ([], [])
    dense = cfg.trunk == "dense"
    x0_sites, bigram_sites = injection_sites(cfg)
    for i in range(cfg.num_layers):
        group = out[1 if i >= cfg.token_gates_split else 0]
        if dense and i == cfg.skip_layers[1]:
            group.append((i, "skip", 1))
        if i not in cfg.attention_free_layers:
            if i in cfg.xsa_layers:
                group.append((i, "xsa", cfg.num_heads))
            if i in cfg.attn_gate_layers:
                group.append((i, "attn", cfg.num_heads))
            if i in cfg.composed_layers:
                group.append((i, "composed_in", cfg.num_heads))
                group.append((i, "composed_out", cfg.num_heads))
        if i in x0_sites:
            group.append((i, "x0", 1))
        if i in bigram_sites:
            group.append((i, "hashed", 1))
    return out


def token_gates(P, cfg, which, x):
    hidden = F.gelu(x @ P[f"token_gates.w1.{which}"].T)
    out = (hidden @ P[f"token_gates.w2.{which}"].T + P[f"token_gates.b2.{which}"]) * P["token_gates.scale"]
    gates, col = {}, 0
    for layer, kind, width in token_gate_layouts(cfg)[which]:
        gates.setdefault(layer, {})[kind] = out[:, col:col + width]
        col += width
    return gates


def dense_mix(P, which, x):
    hidden = F.gelu(x @ P[f"dense.w1.{which}"].T)
    out = (hidden @ P[f"dense.w2.{which}"].T + P[f"dense.b2.{which}"]) * DENSE_SCALE
    return {name: out[:, j:j + 1] for j, name in enumerate((LAST_LAYER_MIX, FINAL_MIX)[which])}


# ---------------------------------------------------------------------------------------------
# the model


def document_index(cu_seqlens, T):
    cu = cu_seqlens.tolist()
    doc = torch.empty(T, dtype=torch.long)
    for d in range(len(cu) - 1):
        doc[cu[d]:cu[d + 1]] = d
    return doc


def hidden_states(P, cfg, tokens, cu_seqlens, windows, history):
    """The final normed residual (T, dim) of a packed slice; windows (short, long) in tokens,
    history the (long, short) windows (tokens) the RoPE tables were grown through."""
    T = len(tokens)
    cur, starts, *_ = token_context(tokens, cfg)
    doc = document_index(cu_seqlens, T)
    signs = sign_table(cfg.model_dim)
    x = P["embed.weight"][cur]
    if cfg.smear_gate:             # x[t] + lambda sigmoid(w . x[t, :12]) x[t - 1], not at a document start
        gate = P["smear_lambda"] * torch.sigmoid(x[:, :SMEAR_DIMS] @ P["smear_gate"][0])
        x = x + torch.where(starts[:, None], 0.0, gate[:, None] * torch.cat([x[-1:], x[:-1]]))
    copied = copy_vectors(P, tokens) if getattr(cfg, "document_copy", False) else None
    if copied is not None:         # the copy vector, at its input gain
        x = x + P["document_copy.gains"][0] * copied
    bigram = bigram_part(P, cfg, tokens, signs)
    tables = value_table_of_layer(cfg)
    ves = {layer: P[f"value_embeds.{table}.weight"][cur] for layer, table in tables.items()}
    if cfg.trunk == "dense":
        x = dense_trunk(P, cfg, rms(x), bigram, ves, starts, doc, history, windows)
    else:
        x = unet_trunk(P, cfg, x, bigram, ves, starts, doc, history, windows)
    if copied is not None:         # and at its gain before the final norm
        x = x + P["document_copy.gains"][1] * copied
    return rms(x)


def unet_trunk(P, cfg, embedded, bigram, ves, starts, doc, history, windows):
    """Layer i of the second half adds its mirror n - 1 - i's output (weights skip_weights); every
    block first mixes x <- lambdas . (x, x0). Without token gates the bigram joins the embedding
    before the norm; with them it enters at the first gated layer and after later attention."""
    n, gated = cfg.num_layers, cfg.token_gates
    x0 = rms(embedded) if gated else rms(embedded + bigram)
    x, outputs, gates = x0, {}, {}
    first = None
    if gated:
        gates = token_gates(P, cfg, 0, x0)
        first = min(layer for group in token_gate_layouts(cfg) for layer, kind, _ in group if kind == "hashed")
    half = n // 2
    for i in range(n):
        if i >= n - half:
            x = x + P["skip_weights"][i - (n - half)] * outputs[n - 1 - i]
        if gated and i == cfg.token_gates_split:
            gates.update(token_gates(P, cfg, 1, x))
        g = gates.get(i, {})
        if gated and i == first:
            x = x + g["hashed"] * bigram
        lam = P[f"blocks.{i}.lambdas"]
        x = lam[0] * x + lam[1] * x0
        if i not in cfg.attention_free_layers:
            x = x + attention_layer(P, cfg, i, rms(x), ves.get(i), starts, doc, history, windows, g)
            if gated:
                x = x + g["x0"] * x0
                if i != first:
                    x = x + g["hashed"] * bigram
        x = x + mlps(P, cfg, i, rms(x))
        outputs[i] = x
    return x


def dense_trunk(P, cfg, x0, bigram, ves, starts, doc, history, windows):
    """Records 89's and 92's trunk: sublayer scales per layer; layer 0's gate lets the bigram in
    (where it is a bigram site), the other sites inject x0 and the bigram through their gates
    after their attention, or on an attention-free layer after its residual scale; the
    attention-free layer skip_layers[1] adds sigmoid(skip_lambda) x gate x layer skip_layers[0]'s
    output instead; an MLP-free layer scales its residual by its MLP scale alone; layers after
    the snapshot layer attend from its output; the last layer's mixes and a final mix come from
    the dense connections."""
    n, last = cfg.num_layers, cfg.num_layers - 1
    gates = token_gates(P, cfg, 0, x0)
    x = x0 + gates[0]["hashed"] * bigram if "hashed" in gates.get(0, {}) else x0
    saved = {"input": x}
    source, target = cfg.skip_layers
    for i in range(n):
        if i == cfg.token_gates_split:
            gates.update(token_gates(P, cfg, 1, x))
        g = gates.get(i, {})
        attn_in = saved["snapshot"] if i > cfg.snapshot_layer else x
        if i == target:
            x = x + torch.sigmoid(P["skip_lambda"]) * g["skip"] * saved["skip_source"]
        has_attn = i not in cfg.attention_free_layers
        if i < last:
            resid = P[f"blocks.{i}.resid_scales"]
            post = P.get(f"blocks.{i}.post_scales", (0.0, 0.0))   # (a layer with no sublayer has none)
            s = (resid[0], post[0], resid[1], post[1])
            if has_attn:
                y = attention_layer(P, cfg, i, rms(attn_in), ves.get(i), starts, doc, history, windows, g)
                x = s[0] * x + s[1] * y
            elif i != target:
                x = s[0] * x
            if "x0" in g:
                x = x + g["x0"] * x0
            if "hashed" in g and i != 0:
                x = x + g["hashed"] * bigram
            x = s[2] * x + s[3] * mlps(P, cfg, i, rms(x))
        else:
            saved["last_input"] = x
            m = dense_mix(P, 0, x)
            lg = dict(g)
            lg["v"] = m["v_input"] * saved["input"] + m["v_snapshot"] * saved["snapshot"] + m["v_residual"] * x
            if i in ves:
                lanes = torch.cat([m["ve_lane0"], m["ve_lane1"]], -1)
                lg["ve"] = lanes.repeat_interleave(cfg.num_heads // 2, dim=-1)
            x = (1 + m["residual"]) * x + m["input"] * saved["input"] + m["snapshot"] * saved["snapshot"]
            y = attention_layer(P, cfg, i, rms(attn_in), ves.get(i), starts, doc, history, windows, lg)
            x = m["attn_residual"] * x + m["attn_out"] * y + m["x0"] * saved["input"] + m["hashed"] * bigram
            mlp_input = rms(x)
            x = m["mlp_residual"] * x + m["mlp_out"] * mlps(P, cfg, i, mlp_input)
        if i == source:
            saved["skip_source"] = x
        if i == cfg.snapshot_layer:
            saved["snapshot"] = x
    if cfg.final_mix == "record92":
        tables = [ves[layer] for layer in sorted(ves, key=value_table_of_layer(cfg).get)]
        sources = [saved["input"], saved["snapshot"], saved["last_input"], *tables[:1], saved["skip_source"],
                   *tables[1:], mlp_input, rms(saved["snapshot"])]
        return record92_final_mix(P, x, sources)
    f = dense_mix(P, 1, x)
    wide = [layer for layer in sorted(ves) if ves[layer].shape[-1] == cfg.model_dim]
    first_ve = ves[wide[0]] if wide else 0.0
    return (x + f["input"] * saved["input"] + f["snapshot"] * saved["snapshot"] + f["last_input"] * saved["last_input"]
            + f["value_embed"] * first_ve + f["skip_source"] * saved["skip_source"])


def record92_final_mix(P, x, sources):
    """Record 92's mix after the last layer: x + sum_k (c_k + d_kg) source_k, where on channel
    group g (model_dim in FINAL_GROUPS groups) source k's coefficient is c_k, one per token,
    plus d_kg: c = (W2 gelu(W1 x) + b) x 0.1 and d_k = W2g_k gelu(W1 x) x 0.1."""
    hidden = F.gelu(x @ P["dense.w1.1"].T)
    c = (hidden @ P["dense.w2.1"].T + P["dense.b2.1"]) * DENSE_SCALE                        # (T, K)
    d = torch.einsum("th,kgh->tkg", hidden, P["dense.w2_groups"]) * DENSE_SCALE             # (T, K, G)
    width = x.shape[1] // FINAL_GROUPS
    out = x
    for k, source in enumerate(sources):
        out = out + (c[:, k:k + 1] + d[:, k]).repeat_interleave(width, dim=1) * source
    return out


# ---------------------------------------------------------------------------------------------
# objectives


def head_weight(P, tied):
    return P["embed.weight"] if tied else P["lm_head"]


def pointer(P, cfg, tokens, x, band):
    """(p_copy, a_sink) of each position for its next-token target (PR 379's pointer): one head,
    q = gain * rms(x Wq^T), k = rms(x Wk^T), scores q.k / sqrt(D) over the earlier positions of the
    same document (documents start at each BOS and at position 0) whose block of `band` tokens is
    the query's or the one before, and the sink's q.sink / sqrt(D); position j proposes tokens[j]."""
    T, D = len(tokens), cfg.pointer_dim
    q = P["pointer.query_gain"] * rms(x @ P["pointer.query"].T)
    k = rms(x @ P["pointer.key"].T)
    doc = torch.cumsum((tokens == BOS) | (torch.arange(T) == 0), 0)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    seen = (j < i) & (doc[:, None] == doc[None, :]) & (j // band >= i // band - 1)
    scores = torch.cat([torch.where(seen, q @ k.T / math.sqrt(D), -math.inf),
                        (q @ P["pointer.sink_key"] / math.sqrt(D))[:, None]], dim=1)
    a = torch.softmax(scores, dim=1)
    return a, a[:, -1]


def mixture_nll(z, y, copy, a, tokens, targets0, valid):
    """-log p(y) with p(v) = q(v) (1 + alpha a_sink / (1 - alpha)) + alpha p_copy(v), q the softmax
    of z over its columns, alpha = q(<copy>) (column `copy`), p_copy(v) the attention on the earlier
    positions holding v; rows where `valid` is False give 0."""
    q = torch.softmax(z, dim=1)
    alpha = q[:, copy]
    a_sink = a[:, -1]
    p_copy = (a[:, :-1] * (tokens[None, :] == targets0[:, None])).sum(1)
    q_y = q.gather(1, y.clamp(min=0)[:, None])[:, 0]
    p = q_y * (1 + alpha * a_sink / (1 - alpha)) + alpha * p_copy
    return torch.where(valid, -torch.log(torch.where(valid, p, 1.0)), 0.0)


def objective(P, cfg, tokens, targets, cu_seqlens, windows, history, weights, prefix, tied=True, columns=None,
              head_sample=None):
    """(objective, next-token loss), means over the T rows. Row t's objective is
    sum_k weights[k] (logsumexp(z) - z[target k]) over its present targets: t+1, t+2, t+3 and the
    prefix of t+1, each counted only if it is among the softmax's columns (all, or the sampled
    `columns`); z the softcapped logits over those columns. With the pointer mixture the t+1 term
    is the mixture's -log p(t+1) (mixture_nll, the training band) and the next-token loss its mean.
    head_sample: (rows, stride) of PR 371's sampled head weight gradient, or None (sampled_logits)."""
    x = hidden_states(P, cfg, tokens, cu_seqlens, windows, history)
    W = head_weight(P, tied)
    all_targets = torch.cat([targets, prefix[:, None]], dim=1)
    if columns is not None:
        W = W[columns]
        index = {int(c): j for j, c in enumerate(columns.tolist())}
        all_targets = torch.tensor([[index.get(int(t), -1) if t >= 0 else -1 for t in row]
                                    for row in all_targets.tolist()])
    z = softcap(x @ W.T if head_sample is None else sampled_logits(x, W, *head_sample))
    present = all_targets >= 0
    losses = torch.where(present, torch.logsumexp(z, -1, keepdim=True) - z.gather(1, all_targets.clamp(min=0)), 0.0)
    if getattr(cfg, "pointer_mixture", False):
        copy = COPY_ID if columns is None else columns.tolist().index(COPY_ID)
        a, _ = pointer(P, cfg, tokens, x, cfg.pointer_band)
        nll = mixture_nll(z, all_targets[:, 0], copy, a, tokens, targets[:, 0], present[:, 0])
        losses = torch.cat([nll[:, None], losses[:, 1:]], dim=1)
    T = len(tokens)
    return (losses * weights.double()).sum() / T, losses[:, 0].detach().sum() / T


def sampled_logits(x, W, rows, stride):
    """x W^T whose gradient in W comes from `rows` alone, times stride (dx exact): the logits
    x W.detach()^T plus xs W^T - (xs W^T).detach(), xs = stride x[rows] on its rows, 0 elsewhere."""
    xs = torch.zeros_like(x)
    xs[rows] = stride * x.detach()[rows]
    sampled = xs @ W.T
    return x @ W.detach().T + (sampled - sampled.detach())


def validation_loss_sum(P, cfg, tokens, targets, cu_seqlens, windows, history, tied=True, masked_pairs=None):
    """Summed full-vocabulary next-token loss over the rows with a target; with the canonical mask
    the pairs (token, c) in masked_pairs get the logit -60 after the softcap."""
    x = hidden_states(P, cfg, tokens, cu_seqlens, windows, history)
    z = softcap(x @ head_weight(P, tied).T)
    if masked_pairs is not None:
        mask = torch.zeros_like(z, dtype=torch.bool)
        for t, tok in enumerate(tokens.tolist()):
            cols = masked_pairs.get(tok)
            if cols is not None:
                mask[t, cols] = True
        z = z.masked_fill(mask, MASKED_LOGIT)
    lse = torch.logsumexp(z, -1)
    present = targets[:, 0] >= 0
    if getattr(cfg, "pointer_mixture", False):   # the validation band; <copy> is never a masked pair
        a, _ = pointer(P, cfg, tokens, x, cfg.pointer_val_band)
        return mixture_nll(z, targets[:, 0], COPY_ID, a, tokens, targets[:, 0], present).sum()
    picked = z.gather(1, targets[:, :1].clamp(min=0))[:, 0]
    return torch.where(present, lse - picked, 0.0).sum()
