"""Generation's key-value cache: a document's keys and values so far, per attention layer, and the
attention of its newest tokens over them."""
import torch
import torch.nn.functional as F


class KVCache:
    """The keys and values of one document's tokens so far, per attention layer, for generation:
    each new token computes only its own q, k, v and attends to the cached keys of its window, so
    a token costs the same at position 10 as at position 5,000. Buffers are allocated once, for
    `capacity` tokens, at the first use of each layer (twice the rows for a paired-head layer,
    whose k, v hold two positions per token)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.length = 0            # tokens cached so far (the position of the next token)
        self.tokens = None         # the cached tokens: the document copy feature matches over them
        self.last_tokens = None    # (up to 2,) the last cached tokens: the n-grams of the next one need them
        self.layers = {}           # attention module -> (keys, values), each (capacity, heads, dim)

    def extend(self, layer, k, v, rows_per_token=1):
        """Store this layer's k, v of the new tokens; return the keys and values of all tokens so far."""
        start, end = self.length * rows_per_token, self.length * rows_per_token + k.size(0)
        if end > self.capacity * rows_per_token:
            raise ValueError(f"KVCache holds {self.capacity} tokens; {end // rows_per_token} were given")
        if layer not in self.layers:
            rows = self.capacity * rows_per_token
            self.layers[layer] = (k.new_empty(rows, *k.shape[1:]), v.new_empty(rows, *v.shape[1:]))
        keys, values = self.layers[layer]
        keys[start:end], values[start:end] = k, v
        return keys[:end], values[:end]

    def advance(self, tokens):
        """The forward pass over `tokens` is done: they are now part of the cached document."""
        self.length += tokens.size(0)
        self.tokens = tokens if self.tokens is None else torch.cat([self.tokens, tokens])
        self.last_tokens = self.tokens[-2:]


def cached_attention(q, k, v, window, softmax_scale):
    """Attention of the last q.size(0) tokens of one document over all its keys so far, with the
    same rule as kernels.attention_reference: key j is visible to query i when j <= i and
    i - j < window (window <= 0: no limit). q: (n, H, D); k, v: (L, H, D) with L >= n. Only the
    keys inside the window of the first query are read."""
    q = (q.float() * softmax_scale.float().reshape(())).to(q.dtype)
    n, L = q.size(0), k.size(0)
    first = L - n                  # position of the first query
    lo = max(0, first - window + 1) if window > 0 else 0
    qi = torch.arange(first, L, device=q.device)[:, None]
    kj = torch.arange(lo, L, device=q.device)[None, :]
    visible = (kj <= qi) & ((qi - kj < window) if window > 0 else True)
    y = F.scaled_dot_product_attention(q.transpose(0, 1), k[lo:].transpose(0, 1), v[lo:].transpose(0, 1),
                                       attn_mask=visible, scale=1.0)
    return y.transpose(0, 1).to(q.dtype)
