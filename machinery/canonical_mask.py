"""The canonical mask: at validation, the continuations GPT-2's encoder never emits after a
token get no probability (record 92 validates with it; data/tokenizer.py derives the pairs).
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from data.tokenizer import noncanonical_pairs
from machinery.config import PADDED_VOCAB_SIZE

MASKED_LOGIT = -60.0               # a masked pair's softcapped logit: exp(-60 - 23) ~ 1e-36 of the mass


class NoncanonicalPairs(nn.Module):
    """The (previous, current) token pairs GPT-2's encoder never emits (data/tokenizer.py says
    how they are derived), as a bit matrix: bit c of row p is set when c never follows p
    (PADDED_VOCAB_SIZE^2 bits, 316 MB). Validation-only: sets those logits to MASKED_LOGIT after
    the softcap, so a continuation the tokenizer cannot produce gets no probability. Fixed
    shapes, no host sync: a compiled validation keeps one graph."""

    def __init__(self):
        super().__init__()
        pairs = noncanonical_pairs()
        bits = np.zeros((PADDED_VOCAB_SIZE, PADDED_VOCAB_SIZE // 8), dtype=np.uint8)
        np.bitwise_or.at(bits, (pairs[:, 0], pairs[:, 1] // 8), (1 << (pairs[:, 1] % 8)).astype(np.uint8))
        self.register_buffer("bits", torch.from_numpy(bits), persistent=False)
        self.register_buffer("bit_values", 1 << torch.arange(8, dtype=torch.uint8), persistent=False)

    def masked_logits(self, logits, previous):
        """Softcapped fp32 logits (N, V) with the pairs (previous[i], column) set to MASKED_LOGIT."""
        rows = self.bits[previous.long()]                                  # (N, V / 8)
        mask = (rows.unsqueeze(-1) & self.bit_values) != 0                 # (N, V / 8, 8): column 8j + b
        return kernels.softcap(logits).masked_fill(mask.flatten(1), MASKED_LOGIT)

    def cross_entropy_sum(self, logits, previous, targets):
        """Summed next-token loss of the masked logits over the rows with a target (>= 0)."""
        return F.cross_entropy(self.masked_logits(logits, previous), targets, ignore_index=-1, reduction="sum")
