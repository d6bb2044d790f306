"""Kernels for the speedrun trainer.

One section per kernel family. Each section holds the Triton kernel(s), the autograd
wrapper that the trainer calls on CUDA, and a plain-torch reference with the same
signature and the same math. The trainer uses the references on CPU and, when
`kernels="reference"` is configured, on GPU too (for A/B runs).

Families:
  1. FP8 matmul            fp8_matmul_reference
  2. Flash attention       attention_reference (packed documents, sliding window)
  3. Softcapped CE         softcap_cross_entropy_reference (multi-target, column subsets)
  4. Muon helper           xxt_reference (X @ X^T)
"""
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# 1. FP8 matmul
# ---------------------------------------------------------------------------------------------


def fp8_matmul_reference(a, b, scale_a, scale_b, out_dtype=torch.bfloat16):
    """C = (a @ b) * scale_a * scale_b for fp8 operands with per-tensor fp32 scales.

    The semantics of torch._scaled_mm with per-tensor scales: the fp8 values are exact in
    fp32, the product is accumulated in fp32, and the scales multiply the fp32 result.
    """
    c = a.float() @ b.float()
    return (c * (scale_a.float() * scale_b.float())).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# 2. Attention on packed documents with a sliding window
# ---------------------------------------------------------------------------------------------

# Queries per block in the reference: bounds the (block x keys) score matrix it materializes.
REFERENCE_QUERY_BLOCK = 256


def document_ids(cu_seqlens, num_tokens):
    """Index of the document each packed token belongs to (cu_seqlens may end in repeats)."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def attention_reference(q, k, v, cu_seqlens, max_seqlen, window, softmax_scale):
    """Causal attention over packed documents, limited to a sliding window.

    q, k: (T, H, Dqk); v: (T, H, Dv); cu_seqlens: int32 document offsets (0, ..., T), possibly
    padded at the end by repeating T. Key j is visible to query i when both lie in the same
    document, j <= i and i - j < window (window <= 0: no limit). Returns (T, H, Dv) in q's dtype.

    Works block by block over queries so that memory stays O(block * (window + block)) instead
    of O(T^2); each block attends to the keys from the earliest visible position to its end.
    `max_seqlen` is unused here (the Triton kernel sizes its grid with it).
    """
    del max_seqlen
    T = q.shape[0]
    doc = document_ids(cu_seqlens, T)
    doc_start = cu_seqlens.long()[doc]
    pos = torch.arange(T, device=q.device)
    out = []
    for s in range(0, T, REFERENCE_QUERY_BLOCK):
        e = min(s + REFERENCE_QUERY_BLOCK, T)
        lo = int(doc_start[s])
        if window > 0:
            lo = max(lo, s - window + 1)
        qi, kj = pos[s:e, None], pos[None, lo:e]
        visible = (doc[s:e, None] == doc[None, lo:e]) & (kj <= qi)
        if window > 0:
            visible &= qi - kj < window
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[lo:e].transpose(0, 1), v[lo:e].transpose(0, 1),
            attn_mask=visible, scale=softmax_scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# 3. Softcapped cross-entropy with several weighted targets and optional column subsets
# ---------------------------------------------------------------------------------------------

SOFTCAP = 23.0        # logits are squashed into (0, SOFTCAP)
SOFTCAP_SHIFT = 5.0   # raw logit offset before the sigmoid
SOFTCAP_TEMP = 7.5    # sigmoid temperature: the slope at the centre is SOFTCAP / (4 * SOFTCAP_TEMP)


def softcap(logits):
    """SOFTCAP * sigmoid((z + SOFTCAP_SHIFT) / SOFTCAP_TEMP), in fp32."""
    return SOFTCAP * torch.sigmoid((logits.float() + SOFTCAP_SHIFT) / SOFTCAP_TEMP)


def softcap_cross_entropy_reference(logits, targets, weights):
    """Per-row weighted sum of softcapped cross-entropies over the given columns.

    logits: (N, C), the head's raw outputs for C vocabulary columns (all of them, or a sampled
    candidate subset). targets: (N, K) int64 column indices into those C columns, -1 where a
    target is absent or not among the columns (it then contributes nothing). weights: (K,) float.
    Returns (N,) fp32: sum_k weights[k] * (logsumexp(z) - z[targets[:, k]]), z = softcap(logits).
    """
    z = softcap(logits)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    present = targets >= 0
    picked = z.gather(1, targets.clamp(min=0))
    losses = torch.where(present, lse - picked, torch.zeros_like(picked))
    return losses @ weights.to(losses)


# ---------------------------------------------------------------------------------------------
# 4. Muon helper: the Gram matrix X X^T
# ---------------------------------------------------------------------------------------------


def xxt_reference(x):
    """X @ X^T for a batch of matrices (..., m, n) -> (..., m, m)."""
    return x @ x.mT
