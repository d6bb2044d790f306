"""The kernel functions a run's model calls (KernelFns): the Triton kernels or their plain-torch
references, and the FP8 layers with the scale rules its config names. On a CUDA device the Triton
kernels run unless the references are asked for; on a CPU the references, and the Triton kernels
only under the Triton interpreter, where tests rehearse the GPU path."""
import functools
import os
from dataclasses import dataclass

import kernels
from machinery.config import ConfigError


@dataclass
class KernelFns:
    """The kernel functions a model calls: the Triton ones or their plain-torch references."""
    attention: object
    cross_entropy: object
    fp8_mlp: object = None         # fn(x, w_up, w_down, state, weight_casts=None, gain=None); None: the MLP
                                   # runs in the autocast dtype
    xxt: object = None             # X X^T of the Muon family; None: as optim.orthogonalize picks by device
    fp8_qkv: object = None         # fn(x, weight, state, weight_cast=None, gain=None); None: the QKV
                                   # projection runs in the autocast dtype
    fp8_head: object = None        # fn(x, weight, state); None: the head runs in the autocast dtype
    qk_norm_rope: object = kernels.qk_norm_rope_reference  # fn(q, k, cos, sin, stationary, key_doc_start, paired=)
    composed_attention: object = kernels.composed_attention_reference  # fn(q, k, v, doc_start, window, scale, mixes)
    # fn(x, weight, state, targets, weights, grad_scale): the FP8 head and the cross-entropy in one, for
    # the training objective (kernels.fp8_head_cross_entropy); None: the head, then cross_entropy
    fp8_head_loss: object = None
    ema_update: object = kernels.ema_update_reference_  # fn(ema, weight, rate): a weight average's sample
    # fn(q, k, sink_scores, tokens, targets, doc_start, band): the pointer mixture's (p_copy, a_sink)
    pointer_attention: object = kernels.pointer_attention_reference
    # fn(logits, targets, weights, copy_col, p_copy, a_sink, grad_scale, exact_upstream): the cross-entropy
    # with the pointer mixture's next-token term
    pointer_cross_entropy: object = kernels.pointer_mixture_cross_entropy
    # fn(x, weight, state, targets, weights, copy_col, p_copy, a_sink, grad_scale): the FP8 head and it in one
    fp8_head_pointer_loss: object = None
    copy_keys: object = kernels.copy_keys_reference  # fn(tokens, normalized, bos): the document copy feature's keys
    # fn(ups, downs, states) / fn(weights, states): the FP8 MLPs' / QKV projections' weights cast
    # together for one forward (kernels.fp8_mlp_weight_casts, fp8_linear_weight_casts); None: each
    # layer casts its own
    fp8_mlp_weights: object = None
    fp8_qkv_weights: object = None
    # fn(x, weight, state, heads, qk_dim, cos, sin, stationary, key_doc_start, paired=, weight_cast=, gain=): the
    # FP8 QKV projection with the QK norm and RoPE in its op (kernels.fp8_qkv_norm_rope); None: fp8_qkv,
    # then qk_norm_rope
    fp8_qkv_rope: object = None
    triton: bool = False           # the Triton kernels (their JIT, and kernel_choice's selection, in the warm-up)

    @property
    def any_fp8(self):
        return any(fn is not None for fn in (self.fp8_mlp, self.fp8_qkv, self.fp8_head))



def fp8_casts(h):
    """How the Triton FP8 layers cast their activations and gradients: in torch ops that
    torch.compile fuses into the kernels making them, when it compiles; else by the cast kernel."""
    return "fused" if h.compile else "kernel"



def fp8_kernels(h, use_triton):
    """The FP8 layers the config asks for, each with its scale rules: (mlp, qkv, head) functions
    or None."""
    if not use_triton:
        linear = head = kernels.fp8_linear_reference
        mlp = kernels.fp8_relu2_mlp_reference
    else:
        linear = functools.partial(kernels.fp8_linear, gemm=h.fp8_gemm, casts=fp8_casts(h))
        mlp = functools.partial(kernels.fp8_relu2_mlp, gemm=h.fp8_gemm, casts=fp8_casts(h))
        # the head's gradient comes from the cross-entropy kernel, which no cast can join
        head = functools.partial(kernels.fp8_linear, gemm=h.fp8_gemm)
    return (functools.partial(mlp, scales=kernels.MLP_SCALES[h.fp8_mlp_scales]) if h.fp8_mlp else None,
            functools.partial(linear, scales=kernels.QKV_SCALE_RULES[h.fp8_qkv_scales]) if h.fp8_qkv else None,
            functools.partial(head, scales=kernels.HEAD_SCALE_RULES[h.fp8_head_scales]) if h.fp8_head else None)


def fp8_qkv_rope(h, use_triton):
    """The FP8 QKV projection with the QK norm and RoPE in its op, or None: only with the Triton
    kernels, and only where the gradient's scale needs no pass over the gradient itself."""
    scales = kernels.QKV_SCALE_RULES[h.fp8_qkv_scales]
    if not (use_triton and h.fp8_qkv and kernels.fp8_qkv_norm_rope_supports(scales)):
        return None
    return functools.partial(kernels.fp8_qkv_norm_rope, scales=scales, gemm=h.fp8_gemm, casts=fp8_casts(h))


def fp8_weight_casts(h, use_triton):
    """The FP8 MLPs' and QKV projections' weight casts for a forward, (mlp, qkv) functions or
    None: the weight groups' kernels, or their per-layer reference."""
    cast = kernels.fp8_cast_weights if use_triton else kernels.fp8_cast_weights_reference
    return (functools.partial(kernels.fp8_mlp_weight_casts, scales=kernels.MLP_SCALES[h.fp8_mlp_scales], cast=cast)
            if h.fp8_mlp else None,
            functools.partial(kernels.fp8_linear_weight_casts, scales=kernels.QKV_SCALE_RULES[h.fp8_qkv_scales],
                              cast=cast) if h.fp8_qkv else None)



def select_kernels(h, device):
    """Triton on CUDA unless the references are asked for. FP8 layers with the Triton kernels, or
    on CUDA with the references (the A/B twin), or on a CPU with the references when fp8_on_cpu
    asks for the emulation. On a CPU the Triton kernels run only under the Triton interpreter,
    which tests use to rehearse the GPU path."""
    use_triton = h.kernels == "triton" or (h.kernels == "auto" and device.type == "cuda")
    if use_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("--kernels=triton needs a CUDA GPU (on a CPU the Triton kernels only run under the "
                          "interpreter, TRITON_INTERPRET=1, for tests): use --kernels=auto")
    with_fp8 = use_triton or device.type == "cuda" or h.fp8_on_cpu
    mlp, qkv, head = fp8_kernels(h, use_triton) if with_fp8 else (None, None, None)
    mlp_weights, qkv_weights = fp8_weight_casts(h, use_triton) if with_fp8 else (None, None)
    if use_triton:
        head_loss = (functools.partial(kernels.fp8_head_cross_entropy, scales=kernels.HEAD_SCALE_RULES[h.fp8_head_scales],
                                       gemm=h.fp8_gemm, casts=fp8_casts(h)) if h.fp8_head else None)
        pointer_loss = (functools.partial(kernels.fp8_head_pointer_mixture,
                                          scales=kernels.HEAD_SCALE_RULES[h.fp8_head_scales], gemm=h.fp8_gemm,
                                          casts=fp8_casts(h)) if h.fp8_head else None)
        attention = (kernels.flash_attn_varlen if h.attention_impl == "fastest"
                     else functools.partial(kernels.flash_attn_varlen, impl=h.attention_impl))
        return KernelFns(attention, kernels.softcap_cross_entropy, mlp, kernels.xxt, qkv, head,
                         kernels.qk_norm_rope, kernels.composed_attention, head_loss, kernels.ema_update_,
                         pointer_attention=kernels.pointer_attention,
                         pointer_cross_entropy=kernels.pointer_mixture_softcap_cross_entropy,
                         fp8_head_pointer_loss=pointer_loss, copy_keys=kernels.copy_keys, triton=True,
                         fp8_mlp_weights=mlp_weights, fp8_qkv_weights=qkv_weights,
                         fp8_qkv_rope=fp8_qkv_rope(h, use_triton) if with_fp8 else None)
    # Here auto means CPU: the chunked cross-entropy is the kernel's algorithm, ~3x faster than the
    # reference there; `kernels=reference` keeps the plain reference for A/B runs.
    reference = h.kernels == "reference"
    cross_entropy = kernels.softcap_cross_entropy_reference if reference else kernels.softcap_cross_entropy_chunked
    pointer_cross_entropy = (kernels.pointer_mixture_cross_entropy if reference
                             else kernels.pointer_mixture_cross_entropy_chunked)
    return KernelFns(kernels.attention_reference, cross_entropy, mlp, None, qkv, head,
                     pointer_cross_entropy=pointer_cross_entropy, fp8_mlp_weights=mlp_weights,
                     fp8_qkv_weights=qkv_weights)
