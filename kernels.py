"""Kernels for the speedrun trainer.

One section per kernel family. Each section holds the Triton kernel(s), the wrapper that the
trainer calls on CUDA (autograd-aware where the family is differentiable), and a plain-torch
reference with the same signature and the same math. The trainer uses the references on CPU
(the cross-entropy in its chunked form, softcap_cross_entropy_chunked, unless
`kernels="reference"`) and, when `kernels="reference"` is configured, on GPU too (for A/B runs).

Families:
  1. FP8 matmul       fp8_matmul, fp8_linear, fp8_relu2_mlp          (+ *_reference)
                      (a persistent tensor-descriptor kernel and a
                      pointer-load tile kernel; torch._scaled_mm);
                      fp8_cast_weights (several layers' weights)
  2. Flash attention  flash_attn_varlen (one-kernel backward with    attention_reference
                      atomic dQ, or the deterministic two-kernel one;
                      descriptor variants, the forward warp-specialized)
  3. Softcapped CE    softcap_cross_entropy                          softcap_cross_entropy_reference
                      (on CPU: softcap_cross_entropy_chunked, the same algorithm in plain torch);
                      fp8_head_cross_entropy (the FP8 head and the    fp8_linear_reference, then
                      cross-entropy in one; transpose)                softcap_cross_entropy_reference
  4. Muon helper      xxt (alpha X X^T + beta X)                     xxt_reference
  5. QK norm + RoPE   qk_norm_rope                                   qk_norm_rope_reference
                      fp8_qkv_norm_rope (the FP8 QKV projection       fp8_qkv_norm_rope_reference
                      with it; one backward pass to the fp8 gradient)
  6. Sparse rows      distinct_rows (plain torch), sum_rows,         sum_rows_reference,
                      add_row_sums_, sparse_adam_rows_               add_row_sums_reference_,
                                                                     sparse_adam_rows_reference_
  7. Composed attn    composed_attention                             composed_attention_reference
  8. Weight averages  ema_update_                                    ema_update_reference_
  9. Pointer mixture  pointer_attention                              pointer_attention_reference;
                      (the mixture's loss: pointer_mixture_cross_entropy, plain torch;
                      on CPU pointer_mixture_cross_entropy_chunked, section 3's algorithm)
 10. Document copy    copy_keys                                      copy_keys_reference;
                      (the match: document_copy_matches, plain torch)

How the trainer uses the FP8 layers. A module that owns an FP8 weight also owns a small fp32
state buffer, created once with `new_fp8_linear_state(device)` (a plain linear) or
`new_fp8_mlp_state(device)` (the fused MLP), registered with `register_buffer` so that it moves
with the module and lands in checkpoints:

    y = kernels.fp8_linear(x, self.weight, self.fp8_state, scales=QKV_SCALES)  # x @ weight.T
    y = kernels.fp8_relu2_mlp(x, self.w_up, self.w_down, self.fp8_state)     # relu(x w_up.T)^2 w_down.T

Weights use nn.Linear's (out, in) layout and any float dtype (their gradients come back in it);
x is bf16 of shape (..., in) and y has x's dtype. Forward operands are e4m3, gradients e5m2, all
with per-tensor scales that map an amax to the fp8 maximum. The forward GEMMs accumulate in the
tensor cores' fast fp8 accumulator (as torch._scaled_mm(use_fast_accum=True)); the backward GEMMs
whose sums are long (up to 49,152 tokens for weight gradients, 50,304 vocabulary columns for the
head's input gradient) add that accumulator into an fp32 sum after every BLOCK_K products
(fp8_matmul's fast_accumulation=False), the short ones (the MLP's hidden gradient, K = the model
width) keep the fast accumulator (FAST_ACCUMULATION_MAX_K). Each GEMM runs the implementation
kernel_choice picks for its shape (fp8_matmul's impl). Each operand's scale follows a rule
(FP8LinearScales, FP8MLPScales): Exact (this call's amax: one more pass over the tensor),
Delayed (the amax the previous call recorded, times a headroom: no extra pass), Static (a
constant; for gradients, one of the summed loss times the state's loss unit, which
set_fp8_loss_unit sets to the weight the objective gives one token), or ExactThenDelayed
(weights: exact for the first calls, then delayed). Every cast records its operand's amax in
the state, which also counts the calls. A zero amax (a fresh buffer, or a tensor that was all
zeros) gives the default scale UNCALIBRATED_SCALE; calibration calls (forward and backward,
results discarded) before the first real one record real amaxes, as the trainer does. Values
beyond the fp8 range saturate. A compiled model passes casts="fused": the activations and
gradients are then cast in torch ops that Inductor fuses into the kernel making them (a norm, a
residual's gradient), and only the transposed copy is a kernel of ours (fp8_cast_fused); the
weights keep the cast kernel. A model with many FP8 layers casts their weights together at the
start of a forward (fp8_linear_weight_casts, fp8_mlp_weight_casts: a few launches per group of
same-shaped weights, the same scales, bytes and state updates as each layer's own cast) and
passes each layer its casts (weight_cast, weight_casts). A learned 0-D scale of a layer's output
(the dense trunk's) rides its weight (gain=): the weight's GEMM scale times it, its gradient a
sum over the weight. The `*_reference` functions take the
same arguments, update the state the same way and quantize identically with torch casts: the
trainer's A/B switch, and its FP8 emulation on a CPU.

The other families need no state of their own: flash_attn_varlen(q, k, v, cu_seqlens, window,
softmax_scale), softcap_cross_entropy(logits, targets, weights), xxt(x), qk_norm_rope and the
sparse row functions take the same arguments as their references (every Triton wrapper also
accepts launch configs, which the tests shrink); sparse_adam_rows_ updates the table and the
per-row state that optim.SparseRowAdam owns.

Which implementation runs: where several can run a call (fp8_matmul's impl, flash_attn_varlen's),
the call asks kernel_choice at run time, inside its custom op: the fastest candidate the warm-up
timed at that shape, else its rule (see machinery/kernel_choice.py).

torch.compile: every kernel launch sits inside a torch.library custom op with a fake (meta)
implementation, and the autograd wrappers are torch.autograd.Functions built from those ops, so
the trainer can compile its model with fullgraph=True (checked on CPU with the aot_eager
backend); the kernels stay opaque to Inductor (fp8_cast_fused's torch ops are what it fuses).
Two CPU functions are marked `runs_eagerly`: a compiled model calls them outside its graphs
(see the mark).
"""
import collections
import dataclasses
import functools
import math
import os
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from machinery import kernel_choice

try:
    import triton
    import triton.language as tl
except ImportError:                # a CPU-only install: the references run, and a launch says what is missing
    from machinery.no_triton import tl, triton

_OPS = "kernels"  # namespace of this file's torch.library custom ops


def runs_eagerly(fn):
    """Mark fn to run eagerly inside a torch.compile'd caller (a graph break around each call).
    Callers that compile with fullgraph=True must not use it: `breaks_graphs(fn)` says so."""
    fn = torch.compiler.disable(fn)
    fn.breaks_graphs = True
    return fn


def breaks_graphs(fn):
    return getattr(fn, "breaks_graphs", False)


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch options of one kernel.

    block_m / block_n: the output tile (matmul, X X^T), query / key block (attention), rows /
    columns per program (casts); block_n is the column block of the cross-entropy. block_k: the
    reduction step of matmuls. group_m: row tiles walked together for L2 reuse (matmul only).
    split_k: the persistent FP8 GEMM's K splits of the tiles of its last, partial wave (1: none).
    """
    block_m: int
    block_n: int
    block_k: int = 16
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 1
    split_k: int = 1

    def as_list(self):
        """The fields as a list of ints: how a config crosses a custom-op boundary."""
        return [self.block_m, self.block_n, self.block_k, self.group_m, self.num_warps, self.num_stages, self.split_k]


def _config_from_list(values):
    return LaunchConfig(*values)


CONFIG_FIELDS = len(dataclasses.fields(LaunchConfig))   # ints of one config in a flat list


def _configs_from_list(values, count):
    """`count` LaunchConfigs from their flat list (as_list of each, concatenated)."""
    if len(values) != count * CONFIG_FIELDS:
        raise ValueError(f"expected {count} launch configs of {CONFIG_FIELDS} ints, flattened; got {len(values)} ints")
    return tuple(_config_from_list(values[i * CONFIG_FIELDS:(i + 1) * CONFIG_FIELDS]) for i in range(count))


def _launch(kernel, grid, config, **args):
    """Start a Triton kernel. Every launch goes through here, so that the sm_90 compile check
    can record the launches of the production configurations instead of running them."""
    kernel[grid](**args, num_warps=config.num_warps, num_stages=config.num_stages)


# Streaming multiprocessors of an H100 SXM: the tile-count rule below assumes it off-GPU.
H100_SM_COUNT = 132


def _sm_count(device):
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H100_SM_COUNT


# ---------------------------------------------------------------------------------------------
# 1. FP8 matmul, the FP8 linear layer and the fused FP8 ReLU^2 MLP
# ---------------------------------------------------------------------------------------------

FP8_E4M3_MAX = 448.0       # largest finite float8_e4m3fn value (forward operands)
FP8_E5M2_MAX = 57344.0     # largest finite float8_e5m2 value (gradients)

# Output tiles of 128 x 256 when they fill every SM at least twice, else 128 x 128. The backward
# GEMMs (fp32 accumulation every BLOCK_K) keep a second accumulator of the tile's size for the
# fast partial sums: at 128 x 256 that spills on sm_90 (84 LDL, 113 STL), so they take 128 x 128.
FP8_MATMUL_LARGE = LaunchConfig(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3)
FP8_MATMUL_SMALL = LaunchConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
# The relu2_grad epilogue (activation tile, square root, two fp8 stores) spills with 128 x 256.
FP8_MATMUL_RELU2_GRAD = FP8_MATMUL_SMALL
# The backward GEMMs that sum at most this many products accumulate in the tensor cores' fast
# accumulator, the others add it into fp32 every PROMOTION_K products. Measured against float64
# (bench/fast_accumulation.py, its emulation of a 14-bit accumulator cut toward zero after each
# 32-product slice): the fast sum's relative error is 6.2e-4 at K = 768 (the MLP's hidden gradient),
# below the 1.6e-3 of the output's own bf16 rounding, and 1.9e-3 at 2,304 (the QKV input
# gradient), 2.3e-3 at 2,816, 1.3e-2 at 16,384 and 3.8e-2 at 49,152 (weight gradients), above it.
# The error grows about linearly with K.
FAST_ACCUMULATION_MAX_K = 1024
# Products between the promotions of a promoted GEMM (its BLOCK_K: one dot per K step with
# max_num_imprecise_acc = BLOCK_K). The same emulation's error of every promoted sum is at most
# 1.3e-4 every 128 products, 2.3e-4 every 256 and 4.4e-4 every 512, all below the bf16 rounding;
# 256 is the longest whose 128 x 128 tile keeps three pipeline stages in shared memory
# (3 x 64 KB), and each promotion waits for the tensor cores, so fewer of them cost less.
PROMOTION_K = 256
# The promoted GEMMs' tile: 128 x 128 (a second accumulator of the tile's size holds the fast
# partial sum), K steps of PROMOTION_K, three stages.
FP8_MATMUL_PROMOTED = LaunchConfig(block_m=128, block_n=128, block_k=PROMOTION_K, group_m=8, num_warps=8,
                                   num_stages=3)
# Tiles of the stand-alone fp8 cast (row-major and transposed copies, memory bound).
FP8_CAST = LaunchConfig(block_m=64, block_n=64, num_warps=4)
# Tiles of the transpose kernel (an fp8 copy for a GEMM that reads its operand K-major).
TRANSPOSE = LaunchConfig(block_m=64, block_n=64, num_warps=4)


# How an operand's per-tensor scale is chosen (see the module docstring). Each layer has one
# rule per operand: FP8LinearScales, FP8MLPScales.
@dataclasses.dataclass(frozen=True)
class Exact:
    """This call's own amax mapped to the fp8 maximum (one extra reduction over the tensor)."""


@dataclasses.dataclass(frozen=True)
class Delayed:
    """The amax the previous call recorded, times `headroom` for growth since then."""
    headroom: float


@dataclasses.dataclass(frozen=True)
class Static:
    """A fixed scale. For a gradient it is the scale of the summed loss (each token's loss with
    weight 1, as the records train) and is multiplied by the state's loss unit."""
    scale: float


@dataclasses.dataclass(frozen=True)
class ExactThenDelayed:
    """Exact for the layer's first `calls` calls, while the weights move fast, then Delayed."""
    calls: int
    headroom: float


EXACT = Exact()
GRAD_HEADROOM = 1.25         # gradients vary between micro-batches; e5m2 keeps 2^-16 of the maximum below it
HIDDEN_HEADROOM = 1.8        # relu(h)^2 squares the growth of h between calls (record 89's down-projection input)
# Rms-normed rows of width d have |x_i| <= sqrt(d) (27.7 at d = 768): a static scale of 1/16 maps
# 448 / 16 = 28 to the e4m3 maximum, never saturates up to d = 784 and needs no reduction.
NORMED_INPUT_SCALE = 1 / 16
NORMED_INPUT_MAX_DIM = int((FP8_E4M3_MAX * NORMED_INPUT_SCALE) ** 2)  # 784: widest row that scale holds
# Weights move fast while Adam and Muon warm up: their own amax for the first calls (record 89
# bootstraps its down projection for 16 steps), then the previous call's amax with 12% headroom,
# which the cast records in the same pass.
WEIGHT_LAG = ExactThenDelayed(calls=16, headroom=1.12)


@dataclasses.dataclass(frozen=True)
class FP8LinearScales:
    """The rules of fp8_linear's three operands. The defaults calibrate themselves."""
    input: object = EXACT
    weight: object = EXACT
    grad_output: object = Delayed(GRAD_HEADROOM)


@dataclasses.dataclass(frozen=True)
class FP8MLPScales:
    """The rules of fp8_relu2_mlp's six operands (hidden: relu(h)^2; grad_hidden: dL/dh). The
    defaults calibrate themselves."""
    input: object = EXACT
    up_weight: object = EXACT
    down_weight: object = EXACT
    hidden: object = Delayed(HIDDEN_HEADROOM)
    grad_output: object = Delayed(GRAD_HEADROOM)
    grad_hidden: object = Delayed(GRAD_HEADROOM)


# Record 92's MLP: static input and output-gradient scales, the activation's amax grows little
# between calls (1.03), lagged weights. 2^-6 maps |g| <= 896 of a summed loss into e5m2.
MLP_SCALES_RECORD92 = FP8MLPScales(input=Static(NORMED_INPUT_SCALE), up_weight=WEIGHT_LAG, down_weight=WEIGHT_LAG,
                                   hidden=Delayed(1.03), grad_output=Static(2.0 ** -6),
                                   grad_hidden=Delayed(GRAD_HEADROOM))
# Record 89's MLP forward: exact input and up weight, lagged down weight, activation headroom 1.8.
# (Record 89 runs the MLP backward in bf16; here it runs in fp8 with the self-calibrating rules.)
MLP_SCALES_RECORD89 = FP8MLPScales(down_weight=WEIGHT_LAG)
MLP_SCALES = {"record92": MLP_SCALES_RECORD92, "record89": MLP_SCALES_RECORD89, "delayed": FP8MLPScales()}
# The packed QKV projection reads rms-normed rows; its weight changes every step (exact); the
# gradients of q, k, v come back through the QK norm and RoPE with no known bound (delayed).
QKV_SCALES = FP8LinearScales(input=Static(NORMED_INPUT_SCALE))
# Record 89's static lm_head scales: inputs up to 100, weights up to 1.6, logit gradients up to
# 0.75 x 57344 / 448 = 96 per token (the softcap's slope is at most 23 / 30).
HEAD_SCALES = FP8LinearScales(input=Static(100 / FP8_E4M3_MAX), weight=Static(1.6 / FP8_E4M3_MAX),
                              grad_output=Static(0.75 / FP8_E4M3_MAX))
# Record 92's packed QKV: a static input scale that saturates normed entries beyond 8, the weight's
# exact amax, a static gradient scale of the summed loss.
QKV_SCALES_RECORD92 = FP8LinearScales(input=Static(8 / FP8_E4M3_MAX), grad_output=Static(1 / FP8_E4M3_MAX))
# Record 92's lm_head: weights up to 2.0, the logit gradient's scale a binade below record 89's.
HEAD_SCALES_RECORD92 = FP8LinearScales(input=Static(100 / FP8_E4M3_MAX), weight=Static(2.0 / FP8_E4M3_MAX),
                                       grad_output=Static(0.75 / 8 / FP8_E4M3_MAX))
QKV_SCALE_RULES = {"project": QKV_SCALES, "record92": QKV_SCALES_RECORD92}
HEAD_SCALE_RULES = {"record89": HEAD_SCALES, "record92": HEAD_SCALES_RECORD92}


# Entries of a layer's state sit this many fp32 apart (16 bytes): an entry is passed to the
# kernels as a one-element view, and a view at a 16-byte offset lets torch.compile treat every
# output computed from it as aligned (vectorized loads in the fused kernels).
FP8_SLOT_STRIDE = 4


def _slots(scales_class):
    """Offsets of the entries of a layer's state buffer: an amax per operand (what its last cast
    saw), the count of forward calls, and the loss unit, FP8_SLOT_STRIDE apart."""
    names = [field.name for field in dataclasses.fields(scales_class)] + ["calls", "loss_unit"]
    return {name: FP8_SLOT_STRIDE * i for i, name in enumerate(names)}  # loss_unit last: see set_fp8_loss_unit


def fp8_state_size(slots):
    """Elements of a state buffer with these slots (its last element is the loss unit)."""
    return max(slots.values()) + 1


FP8_LINEAR_SLOTS = _slots(FP8LinearScales)
FP8_MLP_SLOTS = _slots(FP8MLPScales)
# Scale before any amax is known: 1 for e4m3 activations (of order 1); 2^-14 for e5m2 gradients of
# a mean loss, far below 1 (at scale 1 e5m2 flushes |g| < 2^-16, at 2^-14 it keeps 2^-30 to 3.5).
UNCALIBRATED_SCALE = {FP8_E4M3_MAX: 1.0, FP8_E5M2_MAX: 2.0 ** -14}

_FP8_MAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}


def fp8_fast_accumulation(k):
    """Whether a backward GEMM summing k products uses the fast accumulator (FAST_ACCUMULATION_MAX_K)."""
    return k <= FAST_ACCUMULATION_MAX_K


def fp8_matmul_config(m, n, device, fast_accumulation=True):
    """The production tile for an (m, n) output on `device` (see FP8_MATMUL_LARGE; promoted
    accumulation: FP8_MATMUL_PROMOTED)."""
    if not fast_accumulation:
        return FP8_MATMUL_PROMOTED
    large_tiles = triton.cdiv(m, FP8_MATMUL_LARGE.block_m) * triton.cdiv(n, FP8_MATMUL_LARGE.block_n)
    return FP8_MATMUL_LARGE if large_tiles >= 2 * _sm_count(device) else FP8_MATMUL_SMALL


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program `pid`: programs walk GROUP_M row tiles column by column,
    so the programs running together share A rows and B columns in L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    tiles_per_group = GROUP_M * tiles_n
    first_m = (pid // tiles_per_group) * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % tiles_per_group) % group_size
    tile_n = (pid % tiles_per_group) // group_size
    return tile_m, tile_n


@triton.jit
def _fp8_dot_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, tile_m, tile_n,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  FAST_ACC: tl.constexpr):
    """fp32 accumulator of A[rows, :] @ B[:, cols] for one (BLOCK_M, BLOCK_N) output tile.

    Rows and columns past the matrix wrap around (modulo M, N) so the loads need no mask; those
    results are never stored. K is masked only when it is not a multiple of BLOCK_K. Offsets are
    64-bit: the lm_head's operands can exceed 2^31 elements.

    FAST_ACC: on sm_90 the tensor cores sum every fp8 product of the K loop in their fast
    accumulator (about 14 significand bits; Triton's default for fp8 dots there). Otherwise each
    BLOCK_K step's products are summed in it and then added into the fp32 accumulator
    (max_num_imprecise_acc = BLOCK_K, the dot's K: the largest value tl.dot accepts), so the fast
    accumulator never holds a sum of more than BLOCK_K products.
    """
    rows = ((tile_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M).to(tl.int64)
    cols = ((tile_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - step * BLOCK_K
            a = tl.load(a_ptrs, mask=ks[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=ks[:, None] < k_left, other=0.0)
        if FAST_ACC:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _fp8_matmul_kernel(a_ptr, b_ptr, c_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                       stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, FAST_ACC: tl.constexpr):
    """C = (A @ B) * scale_a * scale_b for fp8 A (M, K), B (K, N), any strides.

    One program per output tile; the K loop streams a (BLOCK_M, BLOCK_K) slab of A and a
    (BLOCK_K, BLOCK_N) slab of B through shared memory into the tensor cores (fp32 accumulator;
    FAST_ACC as in _fp8_dot_tile).
    Traffic: A is read N / BLOCK_N times and B M / BLOCK_M times (mostly from L2 thanks to the
    grouped order), C written once.
    """
    tile_m, tile_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _fp8_dot_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, tile_m, tile_n,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FAST_ACC)
    acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_tile(x, rows, cols, M, N, q_ptr, qt_ptr, scale, amax_ptr, Q_MAX: tl.constexpr):
    """Store the fp32 tile x (rows, cols of an (M, N) matrix; 64-bit indices) as fp8:
    q = clamp(x * (1 / scale)) into the row-major q (M, N) and the row-major transposed copy
    qt (N, M); fold max |x| of the tile into *amax_ptr. One division per tile, not per element
    (the special-function unit would otherwise bound the cast)."""
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.where(mask, x, 0.0)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    q = tl.clamp(x * tl.div_rn(1.0, scale), -Q_MAX, Q_MAX).to(q_ptr.dtype.element_ty)
    tl.store(q_ptr + rows[:, None] * N + cols[None, :], q, mask=mask)
    tl.store(qt_ptr + cols[None, :] * M + rows[:, None], q, mask=mask)


@triton.jit
def _fp8_cast_kernel(x_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, M, N, stride_xm, stride_xn,
                     Q_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """q = fp8(x / scale) and its transpose, recording max |x|.

    One (BLOCK_M, BLOCK_N) tile per program. Traffic: x read once, q and qt written once each.
    """
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xn, mask=mask, other=0.0)
    _quantize_tile(x.to(tl.float32), rows, cols, M, N, q_ptr, qt_ptr, tl.load(scale_ptr), amax_ptr, Q_MAX)


@triton.jit
def _fp8_matmul_quant_kernel(a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, act_ptr, act_scale_ptr,
                             q_ptr, qt_ptr, q_scale_ptr, amax_ptr, M, N, K,
                             stride_am, stride_ak, stride_bk, stride_bn, stride_actm, stride_actn,
                             EPILOGUE: tl.constexpr, Q_MAX: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, FAST_ACC: tl.constexpr):
    """Y = (A @ B) * scale_a * scale_b, transformed and stored as fp8 (row-major and transposed).

    EPILOGUE "relu2":      out = relu(Y)^2, the MLP activation (act_ptr unused); a forward GEMM.
    EPILOGUE "relu2_grad": out = Y * 2 relu(h), the gradient of the MLP pre-activation h, where
                           relu(h) = sqrt(act * act_scale) comes from the fp8 activation relu(h)^2
                           saved by the forward (so h itself is never stored). The GPU takes
                           its fast square root (within a few fp32 ulp; out keeps 2 mantissa
                           bits in e5m2): the exact one costs 30% more registers on sm_90.
    FAST_ACC as in _fp8_dot_tile: the forward GEMM's, and the backward's where its K is short
    (fp8_fast_accumulation).
    Like _fp8_matmul_kernel, plus: the activation tile read once ("relu2_grad"), out written twice
    in fp8 (M*N bytes each) instead of once in bf16, max |out| recorded for the next delayed scale.
    """
    tile_m, tile_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _fp8_dot_tile(a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, tile_m, tile_n,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FAST_ACC)
    y = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    if EPILOGUE == "relu2":
        r = tl.maximum(y, 0.0)
        out = r * r
    else:
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        act = tl.load(act_ptr + rows[:, None] * stride_actm + cols[None, :] * stride_actn, mask=mask, other=0.0)
        out = 2.0 * tl.sqrt(act.to(tl.float32) * tl.load(act_scale_ptr)) * y
    _quantize_tile(out, rows, cols, M, N, q_ptr, qt_ptr, tl.load(q_scale_ptr), amax_ptr, Q_MAX)


# Persistent FP8 GEMMs fed by tensor descriptors (TMA on sm_90). One program per SM walks the
# output tiles (a stride of the program count apart, in the grouped order of _grouped_tile): the
# loop over tiles and their K steps is flattened, so the software pipeline keeps loading the next
# tile's operands while the current tile's epilogue runs (a K = 768 GEMM has six K steps a tile);
# operands come in by descriptor loads (the copy engine writes the swizzled shared-memory tile, no
# address arithmetic in the threads; rows and columns past the matrix read as zeros, so K needs no
# mask); the results leave by descriptor stores. Both operands are K-major: A (M, K) row-major and
# B (K, N) given as the row-major (N, K) matrix it transposes (the layers' layouts).
# Split-K for the last wave: when the output tiles do not fill the SMs a whole number of times,
# the tiles of the last, partial wave are cut into split_k ranges of K steps, each range a work
# unit of its own that stores its fp32 partial sum in a workspace; a second kernel adds each such
# tile's partials in a fixed order (deterministic), scales, casts and stores it (split_k_plan).
# Descriptors need 16-byte aligned base pointers and row strides (fp8: rows of a multiple of 16
# elements); calls that do not meet that run the pointer kernel (_tma_layout_ok).

# Tiles of the persistent kernel. Fast accumulation: 128 x 256 (two consumer warpgroups of 64 x 256)
# when the output has at least two waves of them; promoted accumulation (and fewer tiles): 128 x
# 128, one accumulator copy more per thread than 128 x 256 could hold without spilling on sm_90.
FP8_TMA_LARGE = LaunchConfig(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3)
FP8_TMA_SMALL = LaunchConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
# The relu2 epilogues write two fp8 tiles (row-major and transposed) from shared memory: 128 x 128;
# the forward one also 128 x 256 with 3 stages (the gradient one, which reads the activation's
# tile too, needs 240 KB of shared memory and spills there).
FP8_TMA_QUANT = LaunchConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
FP8_TMA_RELU2_LARGE = LaunchConfig(block_m=128, block_n=256, block_k=128, group_m=8, num_warps=8, num_stages=3)
# A split-K launch stages the C tile and an fp32 partial tile for its epilogues: 3 pipeline stages
# (4 need 262 KB of shared memory with an fp32 C).
FP8_TMA_SPLIT_STAGES = 3
# Promoted accumulation: K steps of PROMOTION_K (FP8_MATMUL_PROMOTED's tile) for 16-bit outputs,
# 229,400 bytes of shared memory with a bf16 C tile (sm_90 allows 232,448); a split-K launch of it
# keeps two stages (one 64 KB slab in flight, as many bytes as three stages of 128) for its fp32
# partial tile. An fp32 output keeps FP8_TMA_SMALL: three stages and an fp32 C tile need 262,168.
FP8_TMA_PROMOTED = LaunchConfig(block_m=128, block_n=128, block_k=PROMOTION_K, group_m=8, num_warps=8, num_stages=3)
FP8_TMA_PROMOTED_SPLIT_STAGES = 2
MAX_SPLIT_K = 16            # most K ranges a last-wave tile is cut into
MIN_SPLIT_K_STEPS = 8       # fewest K steps (of BLOCK_K) a split-K range keeps, to fill its pipeline
# A K step of a 128 x 128 x 128 fp8 tile moves 32 KB of operands from L2/HBM into shared memory
# and the workspace costs 8 bytes per fp32 partial element (written, read back); split_k_plan
# counts a workspace byte as this share of a K step's 4.2 MFLOP: an SM's share of HBM bandwidth
# (3.35 TB/s / 132 = 25 GB/s) against its fp8 rate (1,979 TFLOP/s / 132 = 15 TFLOP/s).
SPLIT_K_BYTE_STEPS = (1979e12 / 3.35e12) / (2 * 128 * 128 * 128)


def split_k_plan(tiles, k_steps, sm_count, tile_elements, max_split=MAX_SPLIT_K):
    """(full tiles, split tiles, split_k) of a persistent GEMM with `tiles` output tiles of
    `tile_elements` elements and `k_steps` K steps each on `sm_count` SMs: the tiles of whole waves
    run whole; the last wave's tiles are cut into split_k K ranges when that shortens the run, by
    a count of K steps per SM (the busiest SM's: whole waves, then its share of the split units)
    plus the workspace's traffic (SPLIT_K_BYTE_STEPS per byte, spread over the SMs)."""
    full = tiles // sm_count * sm_count
    rest = tiles - full

    def steps(split):
        if split == 1:
            return full // sm_count * k_steps + (k_steps if rest else 0)
        units = rest * split
        workspace = 8 * units * tile_elements * SPLIT_K_BYTE_STEPS / sm_count
        return full // sm_count * k_steps + math.ceil(units / sm_count) * math.ceil(k_steps / split) + workspace
    splits = [s for s in range(1, max_split + 1) if s == 1 or (rest and k_steps // s >= MIN_SPLIT_K_STEPS)]
    best = min(splits, key=lambda s: (steps(s), s))
    return (full, rest, best) if best > 1 else (tiles, 0, 1)


def fp8_tma_config(m, n, k, device, fast_accumulation=True, split=True, out_dtype=torch.bfloat16):
    """The persistent kernel's tile for an (m, n) output over k, with its split-K plan (split: the
    plain GEMM's; the relu2 epilogues do not split)."""
    sms = _sm_count(device)
    large_tiles = triton.cdiv(m, FP8_TMA_LARGE.block_m) * triton.cdiv(n, FP8_TMA_LARGE.block_n)
    if not fast_accumulation:
        config = FP8_TMA_PROMOTED if out_dtype.itemsize <= 2 else FP8_TMA_SMALL
    else:
        config = FP8_TMA_LARGE if large_tiles >= 2 * sms else FP8_TMA_SMALL
    if not split:
        return config
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    _, _, split_k = split_k_plan(tiles, triton.cdiv(k, config.block_k), sms, config.block_m * config.block_n)
    if split_k > 1:                # a split kernel stages two epilogue tiles (C and an fp32 partial)
        stages = FP8_TMA_PROMOTED_SPLIT_STAGES if config is FP8_TMA_PROMOTED else FP8_TMA_SPLIT_STAGES
        return dataclasses.replace(config, split_k=split_k, num_stages=stages)
    return config


@triton.jit
def _tma_unit(unit, full_tiles, split_tiles, split_k, k_steps):
    """(tile, first K step, end K step, workspace slot) of work unit `unit`: units below
    full_tiles are whole tiles; unit full_tiles + j * split_tiles + r is K range j of tile
    full_tiles + r (slot j * split_tiles + r; -1 for a whole tile)."""
    split = unit >= full_tiles
    v = tl.maximum(unit - full_tiles, 0)
    r = v % tl.maximum(split_tiles, 1)
    j = v // tl.maximum(split_tiles, 1)
    tile = tl.where(split, full_tiles + r, unit)
    k_lo = tl.where(split, j * k_steps // split_k, 0)
    k_hi = tl.where(split, (j + 1) * k_steps // split_k, k_steps)
    slot = tl.where(split, j * split_tiles + r, -1)
    return tile, k_lo, k_hi, slot


@triton.jit
def _tma_dot_tile(a_desc, b_desc, tile_m, tile_n, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, FAST_ACC: tl.constexpr):
    """fp32 sum of A[rows, K steps k_lo..k_hi) @ B[...]^T for one tile, loaded by descriptor
    (FAST_ACC as in _fp8_dot_tile)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(k_lo, k_hi):
        a = a_desc.load([tile_m * BLOCK_M, step * BLOCK_K])
        b = b_desc.load([tile_n * BLOCK_N, step * BLOCK_K])
        if FAST_ACC:
            acc = tl.dot(a, b.T, acc)
        else:
            acc = tl.dot(a, b.T, acc, max_num_imprecise_acc=BLOCK_K)
    return acc


@triton.jit
def _fp8_matmul_tma_kernel(a_ptr, b_ptr, c_ptr, ws_ptr, scale_a_ptr, scale_b_ptr, M, N, K,
                           stride_am, stride_bn, stride_cm, full_tiles, split_tiles, split_k,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           GROUP_M: tl.constexpr, SPLIT: tl.constexpr, FAST_ACC: tl.constexpr):
    """C = (A @ B) * scale_a * scale_b, persistent, descriptor loads and stores (see above).

    Work units: full_tiles whole tiles, then split_tiles tiles in split_k K ranges each (SPLIT:
    split_tiles > 0), walked by the programs a program count apart. A whole tile is scaled,
    cast and stored by descriptor into C; a K range's fp32 sum goes to workspace slot
    (range, tile) for _split_k_reduce_kernel. Traffic: A and B streamed through shared memory
    once per tile (from L2 mostly: the grouped order), C written once; split tiles' partials
    written and read once (4 bytes an element per range).
    """
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    scale = tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    k_steps = tl.cdiv(K, BLOCK_K)
    units = full_tiles + split_tiles * split_k
    if SPLIT:
        ws_desc = tl.make_tensor_descriptor(ws_ptr, shape=[split_k * split_tiles, BLOCK_M, BLOCK_N],
                                            strides=[BLOCK_M * BLOCK_N, BLOCK_N, 1],
                                            block_shape=[1, BLOCK_M, BLOCK_N])
    for unit in tl.range(tl.program_id(0), units, tl.num_programs(0), flatten=True):
        tile, k_lo, k_hi, slot = _tma_unit(unit, full_tiles, split_tiles, split_k, k_steps)
        tile_m, tile_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_dot_tile(a_desc, b_desc, tile_m, tile_n, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K, FAST_ACC)
        if SPLIT:
            if slot >= 0:
                ws_desc.store([slot, 0, 0], acc.reshape(1, BLOCK_M, BLOCK_N))
            else:
                c_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], (acc * scale).to(c_desc.dtype))
        else:
            c_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], (acc * scale).to(c_desc.dtype))


@triton.jit
def _split_k_reduce_kernel(ws_ptr, c_ptr, scale_a_ptr, scale_b_ptr, M, N, stride_cm, full_tiles, split_tiles,
                           split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """C[tile] = (sum over its K ranges of the workspace partials) * scale_a * scale_b for the
    split tiles, one per program, the ranges added in order. Traffic: split_k partial tiles read
    (fp32), one tile of C written."""
    r = tl.program_id(0)
    tile_m, tile_n = _grouped_tile(full_tiles + r, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in range(0, split_k):
        acc += tl.load(ws_ptr + (j * split_tiles + r).to(tl.int64) * (BLOCK_M * BLOCK_N) + local)
    acc = acc * (tl.load(scale_a_ptr) * tl.load(scale_b_ptr))
    rows = (tile_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tile_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _fp8_matmul_quant_tma_kernel(a_ptr, b_ptr, scale_a_ptr, scale_b_ptr, act_ptr, act_scale_ptr,
                                 q_ptr, qt_ptr, q_scale_ptr, amax_ptr, M, N, K, stride_am, stride_bn, stride_actn,
                                 EPILOGUE: tl.constexpr, Q_MAX: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, FAST_ACC: tl.constexpr):
    """_fp8_matmul_quant_kernel's epilogues on the persistent descriptor GEMM (no split-K: the
    MLP's (tokens x hidden) outputs have thousands of tiles).

    The activation of "relu2_grad" is read by descriptor from the transposed fp8 copy the forward
    stored (act (M, N) is its transposed view, stride_actn its row stride), the tile transposed
    in registers; out is stored by descriptor into q (M, N) and, transposed, into qt (N, M);
    max |out| of each tile is folded into *amax_ptr. FAST_ACC as in _fp8_matmul_quant_kernel.
    Traffic: as the pointer kernel's, the operand loads and output stores by the copy engine.
    """
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, BLOCK_K])
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    qt_desc = tl.make_tensor_descriptor(qt_ptr, shape=[N, M], strides=[M, 1], block_shape=[BLOCK_N, BLOCK_M])
    if EPILOGUE == "relu2_grad":
        act_desc = tl.make_tensor_descriptor(act_ptr, shape=[N, M], strides=[stride_actn, 1],
                                             block_shape=[BLOCK_N, BLOCK_M])
    scale = tl.load(scale_a_ptr) * tl.load(scale_b_ptr)
    inv_q_scale = tl.div_rn(1.0, tl.load(q_scale_ptr))
    k_steps = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), flatten=True):
        tile_m, tile_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_dot_tile(a_desc, b_desc, tile_m, tile_n, 0, k_steps, BLOCK_M, BLOCK_N, BLOCK_K, FAST_ACC)
        y = acc * scale
        if EPILOGUE == "relu2":
            r = tl.maximum(y, 0.0)
            out = r * r
        else:
            act = tl.trans(act_desc.load([tile_n * BLOCK_N, tile_m * BLOCK_M])).to(tl.float32)
            out = 2.0 * tl.sqrt(act * tl.load(act_scale_ptr)) * y
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        out = tl.where((rows[:, None] < M) & (cols[None, :] < N), out, 0.0)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(out), axis=1), axis=0))
        q = tl.clamp(out * inv_q_scale, -Q_MAX, Q_MAX).to(q_desc.dtype)
        q_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], q)
        qt_desc.store([tile_n * BLOCK_N, tile_m * BLOCK_M], tl.trans(q))


def _check_fp8_operands(a, b, scale_a, scale_b):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fp8_matmul needs a (M, K) and b (K, N); got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype not in _FP8_MAX or b.dtype not in _FP8_MAX:
        raise ValueError(f"fp8_matmul operands must be float8_e4m3fn or float8_e5m2; got {a.dtype}, {b.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError("fp8_matmul: a and b cannot both be float8_e5m2 (as in torch._scaled_mm)")
    for scale in (scale_a, scale_b):
        if scale.numel() != 1 or scale.dtype != torch.float32:
            raise ValueError("fp8_matmul takes per-tensor scales: one-element float32 tensors")


def _matmul_args(a, b, config):
    return dict(M=a.shape[0], N=b.shape[1], K=a.shape[1],
                stride_am=a.stride(0), stride_ak=a.stride(1), stride_bk=b.stride(0), stride_bn=b.stride(1),
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                GROUP_M=config.group_m, EVEN_K=a.shape[1] % config.block_k == 0)


def _matmul_grid(a, b, config):
    return (triton.cdiv(a.shape[0], config.block_m) * triton.cdiv(b.shape[1], config.block_n),)


# How a call picks its FP8 GEMM: "auto" (kernel_choice: the fastest candidate where the warm-up
# timed them, else the rule), "rule" (the persistent descriptor kernel where the operands' layout
# allows it, else the pointer kernel), or one implementation by name: "tma", "pointer",
# "scaled_mm" (torch._scaled_mm, the plain GEMM only; a call it cannot take runs the rule).
FP8_IMPLS = ("auto", "rule", "tma", "pointer", "scaled_mm")
# The selection's agreement check of an FP8 GEMM candidate: relative Frobenius distance from the
# fp32 reference (bf16 outputs round at 2^-9; fast accumulation adds ~2^-14 per product summed).
FP8_CHOICE_TOLERANCE = 2.0 ** -7
# Agreement of the relu2 epilogues' fp8 outputs (e5m2 rounds at 2^-3: a tie or a last-bit
# difference of the sum moves an element by one fp8 step).
FP8_QUANT_CHOICE_TOLERANCE = 2.0 ** -4
# Threads that sum a split-K tile's partials (one 128 x 128 fp32 tile per program).
SPLIT_K_REDUCE_WARPS = 8
_TMA_ALLOCATOR = {}        # device index -> whether triton's allocator for in-kernel descriptors is set


def _tma_layout_ok(*matrices):
    """Whether every matrix can be read or written by a tensor descriptor: row-major (unit column
    stride), a 16-byte aligned base and a row stride of a multiple of 16 bytes."""
    return all(t.dim() == 2 and t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0
               and t.data_ptr() % 16 == 0 and t.shape[0] > 0 and t.shape[1] > 0 for t in matrices)


def _set_tma_allocator(device):
    """In-kernel descriptors live in a global scratch buffer that triton asks an allocator for at
    each launch (on CUDA; the interpreter needs none): torch's caching allocator on `device`."""
    if device.type == "cuda" and not _TMA_ALLOCATOR.get(device.index):
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
        _TMA_ALLOCATOR[device.index] = True


def _dtype_name(dtype):
    return {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.bfloat16: "bf16", torch.float16: "fp16",
            torch.float32: "fp32"}.get(dtype, str(dtype))


def _run_fp8_matmul_pointer(a, b, scale_a, scale_b, out_dtype, config, fast_accumulation):
    c = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(_fp8_matmul_kernel, _matmul_grid(a, b, config), config,
            a_ptr=a, b_ptr=b, c_ptr=c, scale_a_ptr=scale_a, scale_b_ptr=scale_b,
            stride_cm=c.stride(0), stride_cn=c.stride(1), FAST_ACC=fast_accumulation, **_matmul_args(a, b, config))
    return c


def _split_tiles(tiles, device, split_k):
    """(whole tiles, split tiles) of a persistent launch: the last partial wave's tiles are split."""
    if split_k <= 1:
        return tiles, 0
    full = tiles // _sm_count(device) * _sm_count(device)
    return full, tiles - full


def _run_fp8_matmul_tma(a, b, scale_a, scale_b, out_dtype, config, fast_accumulation):
    """The persistent descriptor GEMM (and, with split tiles, the reduction of their partials)."""
    M, K = a.shape
    N = b.shape[1]
    bt = b.t()                                # the row-major (N, K) matrix b transposes
    c = torch.empty(M, N, dtype=out_dtype, device=a.device)
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    full_tiles, split_tiles = _split_tiles(tiles, a.device, config.split_k)
    split_k = config.split_k if split_tiles else 1
    # the partials' workspace (without split tiles the one-element scale_a stands in, unread)
    ws = (torch.empty(split_k * split_tiles, config.block_m, config.block_n, dtype=torch.float32, device=a.device)
          if split_tiles else scale_a)
    units = full_tiles + split_tiles * split_k
    _set_tma_allocator(a.device)
    _launch(_fp8_matmul_tma_kernel, (min(units, _sm_count(a.device)),), config,
            a_ptr=a, b_ptr=bt, c_ptr=c, ws_ptr=ws, scale_a_ptr=scale_a, scale_b_ptr=scale_b, M=M, N=N, K=K,
            stride_am=a.stride(0), stride_bn=bt.stride(0), stride_cm=c.stride(0), full_tiles=full_tiles,
            split_tiles=split_tiles, split_k=split_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, GROUP_M=config.group_m, SPLIT=split_tiles > 0, FAST_ACC=fast_accumulation)
    if split_tiles:
        _launch(_split_k_reduce_kernel, (split_tiles,),
                LaunchConfig(block_m=config.block_m, block_n=config.block_n, num_warps=SPLIT_K_REDUCE_WARPS),
                ws_ptr=ws, c_ptr=c, scale_a_ptr=scale_a, scale_b_ptr=scale_b, M=M, N=N, stride_cm=c.stride(0),
                full_tiles=full_tiles, split_tiles=split_tiles, split_k=split_k, BLOCK_M=config.block_m,
                BLOCK_N=config.block_n, GROUP_M=config.group_m)
    return c


def _tma_plain_ok(a, b, out_dtype):
    """Whether the persistent kernel takes this plain GEMM: K-major operands and an output whose
    rows a descriptor can store."""
    c_row_bytes = b.shape[1] * torch.empty((), dtype=out_dtype).element_size()
    return _tma_layout_ok(a, b.t()) and c_row_bytes % 16 == 0


def _scaled_mm_ok(a, b, out_dtype):
    """Whether torch._scaled_mm takes the operands: a row-major, b column-major, sizes multiples of 16."""
    return (a.stride(1) == 1 and b.stride(0) == 1 and all(n % 16 == 0 for n in (*a.shape, b.shape[1]))
            and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


def _fp8_matmul_candidates(a, b, scale_a, scale_b, out_dtype, fast_accumulation):
    """Every implementation of this plain GEMM, the rule first: the persistent kernel with its
    planned tile and split (and without the split, and at the other tile), the pointer kernel at
    its production tile, torch._scaled_mm."""
    M, K = a.shape
    N = b.shape[1]
    args = (a, b, scale_a, scale_b, out_dtype)
    found = []
    if _tma_plain_ok(a, b, out_dtype):
        plan = fp8_tma_config(M, N, K, a.device, fast_accumulation, out_dtype=out_dtype)
        configs = [plan, dataclasses.replace(plan, split_k=1)]
        if fast_accumulation:      # the other tile
            configs.append(FP8_TMA_SMALL if plan.block_n == FP8_TMA_LARGE.block_n else FP8_TMA_LARGE)
        else:                      # promoted every 128 products
            configs.append(FP8_TMA_SMALL)
        for config in dict.fromkeys(configs):
            found.append(kernel_choice.Candidate(
                f"tma {config.block_m}x{config.block_n}x{config.block_k} split {config.split_k}",
                functools.partial(_run_fp8_matmul_tma, *args, config, fast_accumulation)))
    pointer = fp8_matmul_config(M, N, a.device, fast_accumulation)
    found.append(kernel_choice.Candidate(f"pointer {pointer.block_m}x{pointer.block_n}x{pointer.block_k}",
                                         functools.partial(_run_fp8_matmul_pointer, *args, pointer,
                                                           fast_accumulation)))
    if _scaled_mm_ok(a, b, out_dtype):
        found.append(kernel_choice.Candidate("scaled_mm", functools.partial(
            fp8_matmul_scaled_mm, a, b, scale_a, scale_b, out_dtype, None, fast_accumulation), triton=False))
    return found


def _fp8_matmul_key(a, b, out_dtype, fast_accumulation):
    """A plain GEMM's shape as kernel_choice keys it: M, K, N, dtypes, accumulation, layouts."""
    layout = ("K-major" if a.stride(1) == 1 and b.stride(0) == 1 else "strided")
    return (a.shape[0], a.shape[1], b.shape[1], _dtype_name(a.dtype), _dtype_name(b.dtype), _dtype_name(out_dtype),
            "fast" if fast_accumulation else "promoted", layout)


def _launch_fp8_matmul(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype,
                       config: list[int], fast_accumulation: bool, impl: str = "pointer") -> Tensor:
    args = (a, b, scale_a, scale_b, out_dtype)
    if impl == "pointer":
        config = _config_from_list(config) if config else fp8_matmul_config(a.shape[0], b.shape[1], a.device,
                                                                            fast_accumulation)
        return _run_fp8_matmul_pointer(*args, config, fast_accumulation)
    if impl == "tma" and _tma_plain_ok(a, b, out_dtype):
        config = _config_from_list(config) if config else fp8_tma_config(a.shape[0], b.shape[1], a.shape[1],
                                                                         a.device, fast_accumulation,
                                                                         out_dtype=out_dtype)
        return _run_fp8_matmul_tma(*args, config, fast_accumulation)
    candidates = _fp8_matmul_candidates(*args, fast_accumulation)
    if impl == "scaled_mm" and candidates[-1].name == "scaled_mm":
        return candidates[-1].run()
    if impl != "auto":
        return candidates[0].run()
    check = kernel_choice.lazy_check(lambda: fp8_matmul_reference(*args), FP8_CHOICE_TOLERANCE, "fp8_matmul")
    return kernel_choice.choose("fp8_matmul", _fp8_matmul_key(a, b, out_dtype, fast_accumulation), candidates,
                                check).run()


def _launch_fp8_cast(x: Tensor, scale: Tensor, amax: Tensor, fp8_dtype: torch.dtype,
                     config: list[int]) -> tuple[Tensor, Tensor]:
    config = _config_from_list(config)
    M, N = x.shape
    q = torch.empty(M, N, dtype=fp8_dtype, device=x.device)
    qt = torch.empty(N, M, dtype=fp8_dtype, device=x.device)
    _launch(_fp8_cast_kernel, (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n)), config,
            x_ptr=x, q_ptr=q, qt_ptr=qt, scale_ptr=scale, amax_ptr=amax, M=M, N=N,
            stride_xm=x.stride(0), stride_xn=x.stride(1), Q_MAX=_FP8_MAX[fp8_dtype],
            BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    return q, qt


def _run_fp8_matmul_quant_pointer(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, out_dtype,
                                  epilogue, config):
    M, N = a.shape[0], b.shape[1]
    q = torch.empty(M, N, dtype=out_dtype, device=a.device)
    qt = torch.empty(N, M, dtype=out_dtype, device=a.device)
    _launch(_fp8_matmul_quant_kernel, _matmul_grid(a, b, config), config,
            a_ptr=a, b_ptr=b, scale_a_ptr=scale_a, scale_b_ptr=scale_b, act_ptr=act, act_scale_ptr=act_scale,
            q_ptr=q, qt_ptr=qt, q_scale_ptr=out_scale, amax_ptr=out_amax,
            stride_actm=act.stride(0), stride_actn=act.stride(1), EPILOGUE=epilogue, Q_MAX=_FP8_MAX[out_dtype],
            FAST_ACC=_quant_fast_accumulation(a, epilogue), **_matmul_args(a, b, config))
    return q, qt


def _quant_fast_accumulation(a, epilogue):
    """The relu2 forward GEMM sums in the fast accumulator; relu2_grad where its K allows."""
    return epilogue == "relu2" or fp8_fast_accumulation(a.shape[1])


def _run_fp8_matmul_quant_tma(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, out_dtype, epilogue,
                              config):
    M, K = a.shape
    N = b.shape[1]
    bt = b.t()
    q = torch.empty(M, N, dtype=out_dtype, device=a.device)
    qt = torch.empty(N, M, dtype=out_dtype, device=a.device)
    tiles = triton.cdiv(M, config.block_m) * triton.cdiv(N, config.block_n)
    _set_tma_allocator(a.device)
    # the activation's row-major (N, M) copy that act transposes ("relu2" reads no activation)
    act_t = act.t() if epilogue == "relu2_grad" else bt
    _launch(_fp8_matmul_quant_tma_kernel, (min(tiles, _sm_count(a.device)),), config,
            a_ptr=a, b_ptr=bt, scale_a_ptr=scale_a, scale_b_ptr=scale_b, act_ptr=act_t, act_scale_ptr=act_scale,
            q_ptr=q, qt_ptr=qt, q_scale_ptr=out_scale, amax_ptr=out_amax, M=M, N=N, K=K, stride_am=a.stride(0),
            stride_bn=bt.stride(0), stride_actn=act_t.stride(0), EPILOGUE=epilogue, Q_MAX=_FP8_MAX[out_dtype],
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            FAST_ACC=_quant_fast_accumulation(a, epilogue))
    return q, qt


def _tma_quant_ok(a, b, act, epilogue):
    """Whether the persistent kernel takes this epilogue GEMM: K-major operands, outputs whose rows
    (N and M fp8 elements) a descriptor can store, the activation's transposed copy describable."""
    M, N = a.shape[0], b.shape[1]
    return (_tma_layout_ok(a, b.t()) and M % 16 == 0 and N % 16 == 0
            and (epilogue != "relu2_grad" or _tma_layout_ok(act.t())))


def _fp8_matmul_quant_candidates(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, out_dtype, epilogue):
    """The relu2 epilogue GEMM's implementations, the rule first: the persistent descriptor kernel,
    the pointer kernel."""
    args = (a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, out_dtype, epilogue)
    found = []
    if _tma_quant_ok(a, b, act, epilogue):
        configs = [fp8_tma_quant_config(a.shape[0], b.shape[1], epilogue, a.device), FP8_TMA_QUANT]
        configs += [FP8_TMA_RELU2_LARGE] if epilogue == "relu2" else []
        for config in dict.fromkeys(configs):
            found.append(kernel_choice.Candidate(f"tma {config.block_m}x{config.block_n}x{config.block_k}",
                                                 functools.partial(_run_fp8_matmul_quant_tma, *args, config)))
    pointer = _quant_pointer_config(a, b, epilogue)
    found.append(kernel_choice.Candidate(f"pointer {pointer.block_m}x{pointer.block_n}x{pointer.block_k}",
                                         functools.partial(_run_fp8_matmul_quant_pointer, *args, pointer)))
    return found


def fp8_tma_quant_config(m, n, epilogue, device):
    """The persistent kernel's tile for a relu2 epilogue GEMM with an (m, n) output: the forward's
    128 x 256 where the output has at least two waves of them, else 128 x 128."""
    large_tiles = triton.cdiv(m, FP8_TMA_RELU2_LARGE.block_m) * triton.cdiv(n, FP8_TMA_RELU2_LARGE.block_n)
    large = epilogue == "relu2" and large_tiles >= 2 * _sm_count(device)
    return FP8_TMA_RELU2_LARGE if large else FP8_TMA_QUANT


def _quant_pointer_config(a, b, epilogue):
    if epilogue == "relu2":
        return fp8_matmul_config(a.shape[0], b.shape[1], a.device)
    return FP8_MATMUL_RELU2_GRAD


def _launch_fp8_matmul_quant(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, act: Tensor,
                             act_scale: Tensor, out_scale: Tensor, out_amax: Tensor, out_dtype: torch.dtype,
                             epilogue: str, config: list[int], impl: str = "pointer") -> tuple[Tensor, Tensor]:
    args = (a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, out_dtype, epilogue)
    if impl == "pointer":
        config = _config_from_list(config) if config else _quant_pointer_config(a, b, epilogue)
        return _run_fp8_matmul_quant_pointer(*args, config)
    if impl == "tma" and _tma_quant_ok(a, b, act, epilogue):
        return _run_fp8_matmul_quant_tma(*args, _config_from_list(config) if config else FP8_TMA_QUANT)
    candidates = _fp8_matmul_quant_candidates(*args)
    if impl != "auto":
        return candidates[0].run()

    def reference():
        found = (fp8_matmul_relu2_reference(a, b, scale_a, scale_b, out_scale, out_amax.clone())
                 if epilogue == "relu2" else
                 fp8_matmul_relu2_grad_reference(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax.clone()))
        return [t.float() for t in found]
    compare = kernel_choice.lazy_check(reference, FP8_QUANT_CHOICE_TOLERANCE, f"fp8_matmul_{epilogue}")

    def check(outputs):
        return compare([t.float() for t in outputs])
    key = (a.shape[0], a.shape[1], b.shape[1], _dtype_name(a.dtype), _dtype_name(b.dtype))
    return kernel_choice.choose(f"fp8_matmul_{epilogue}", key, candidates, check).run()


_fp8_matmul_op = torch.library.custom_op(f"{_OPS}::fp8_matmul", _launch_fp8_matmul, mutates_args=())
_fp8_cast_op = torch.library.custom_op(f"{_OPS}::fp8_cast", _launch_fp8_cast, mutates_args=("amax",))
_fp8_matmul_quant_op = torch.library.custom_op(f"{_OPS}::fp8_matmul_quant", _launch_fp8_matmul_quant,
                                               mutates_args=("out_amax",))


@_fp8_matmul_op.register_fake
def _(a, b, scale_a, scale_b, out_dtype, config, fast_accumulation, impl="pointer"):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@_fp8_cast_op.register_fake
def _(x, scale, amax, fp8_dtype, config):
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty(x.shape[::-1], dtype=fp8_dtype)


@_fp8_matmul_quant_op.register_fake
def _(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, out_dtype, epilogue, config, impl="pointer"):
    M, N = a.shape[0], b.shape[1]
    return a.new_empty(M, N, dtype=out_dtype), a.new_empty(N, M, dtype=out_dtype)


def fp8_matmul(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, config=None, fast_accumulation=True, impl=None):
    """(a @ b) * scale_a * scale_b, what torch._scaled_mm returns for per-tensor fp32 scales.

    a (M, K), b (K, N): float8_e4m3fn or float8_e5m2 (not both e5m2), any strides (b row- or
    column-major; column-major b, i.e. b = w.t() for a row-major w, is the fast layout and the
    one the persistent descriptor kernel takes). out_dtype: bf16, fp16 or fp32.
    fast_accumulation: the tensor cores sum all K products in their fast, reduced-precision
    accumulator, as torch._scaled_mm(..., use_fast_accum=True); False: that accumulator is added
    into an fp32 sum after every config.block_k products, as use_fast_accum=False.
    impl: one of FP8_IMPLS; None: "pointer" with an explicit config (the pointer kernel's tile),
    else "auto". config: the tile (and split_k) of the "pointer" or "tma" kernel.
    """
    _check_fp8_operands(a, b, scale_a, scale_b)
    impl = impl or ("pointer" if config is not None else "auto")
    if impl not in FP8_IMPLS:
        raise ValueError(f"fp8_matmul: impl must be one of {FP8_IMPLS}; got {impl!r}")
    return _fp8_matmul_op(a, b, scale_a.reshape(1), scale_b.reshape(1), out_dtype,
                          config.as_list() if config is not None else [], bool(fast_accumulation), impl)


def fp8_matmul_scaled_mm(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, config=None, fast_accumulation=True):
    """fp8_matmul on torch._scaled_mm (cuBLAS on a GPU): the FP8 layers' plain GEMMs where it is
    faster than the Triton kernel. a row-major, b column-major (the layers' layouts); config unused."""
    return torch._scaled_mm(a, b, scale_a=scale_a.reshape(()), scale_b=scale_b.reshape(()), out_dtype=out_dtype,
                            use_fast_accum=fast_accumulation)


def fp8_matmul_reference(a, b, scale_a, scale_b, out_dtype=torch.bfloat16, config=None, fast_accumulation=True):
    """C = (a @ b) * scale_a * scale_b for fp8 operands with per-tensor fp32 scales.

    The semantics of torch._scaled_mm with per-tensor scales: the fp8 values are exact in
    fp32, the product is accumulated in fp32, and the scales multiply the fp32 result.
    """
    c = a.float() @ b.float()
    return (c * (scale_a.float() * scale_b.float())).to(out_dtype)


def fp8_cast(x, scale, amax, fp8_dtype, config=FP8_CAST):
    """(q, qt): x (M, N) / scale saturated to fp8, row-major and transposed; amax (one fp32
    element) becomes max(amax, max |x|)."""
    return _fp8_cast_op(x, scale, amax, fp8_dtype, config.as_list())


def fp8_cast_reference(x, scale, amax, fp8_dtype, config=None):
    q = _quantize_reference(x.float(), scale, amax, fp8_dtype)
    return q, q.t().contiguous()


@triton.jit
def _transpose_kernel(x_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """y = x^T: x (M, N) and y (N, M) both row-major. One (BLOCK_M, BLOCK_N) tile of x per
    program, transposed in registers (through shared memory), so that the loads run along x's
    rows and the stores along y's. Traffic: x read once, y written once."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N))
    tl.store(y_ptr + cols[:, None] * M + rows[None, :], tl.trans(x), mask=(cols[:, None] < N) & (rows[None, :] < M))


def _launch_transpose(x: Tensor, config: list[int]) -> Tensor:
    config = _config_from_list(config)
    M, N = x.shape
    y = torch.empty(N, M, dtype=x.dtype, device=x.device)
    _launch(_transpose_kernel, (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n)), config,
            x_ptr=x, y_ptr=y, M=M, N=N, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    return y


_transpose_op = torch.library.custom_op(f"{_OPS}::transpose", _launch_transpose, mutates_args=())


@_transpose_op.register_fake
def _(x, config):
    return x.new_empty(x.shape[::-1])


def transpose(x, config=TRANSPOSE):
    """x.t().contiguous() of a contiguous (M, N) x, by a Triton kernel."""
    return _transpose_op(x.contiguous(), config.as_list())


def fp8_cast_fused(x, scale, amax, fp8_dtype, config=TRANSPOSE):
    """fp8_cast for a compiled graph: the cast and its amax in torch ops, which torch.compile
    fuses into the kernel that makes x (a norm, a residual's gradient), so x is not stored in
    bf16 and read back to be cast. The amax is taken per row first, a reduction over the rows
    that kernel already walks (the tensor's max is then a pass over one value per row), and the
    transposed copy is the transpose kernel's: stored from a row-wise kernel, it would go out a
    byte at a time. The same values as fp8_cast: one rounding of x * (1 / scale). Run eagerly
    (the memory budget's trace), it holds one fp32 copy of x at a time."""
    amax.copy_(torch.maximum(amax, x.abs().amax(dim=-1).amax().float().reshape(1)))
    fp8_max = _FP8_MAX[fp8_dtype]
    q = (x * (1.0 / scale)).clamp_(-fp8_max, fp8_max).to(fp8_dtype)   # x times an fp32 tensor: in fp32
    return q, transpose(q, config)


def _quant_impl(config, impl):
    """(impl, config list) of a relu2 epilogue call: "scaled_mm" runs the rule (cuBLAS has no such
    epilogue); None as in fp8_matmul."""
    impl = impl or ("pointer" if config is not None else "auto")
    if impl not in FP8_IMPLS:
        raise ValueError(f"the relu2 epilogue GEMMs take impl in {FP8_IMPLS}; got {impl!r}")
    return ("rule" if impl == "scaled_mm" else impl), (config.as_list() if config is not None else [])


def fp8_matmul_relu2(a, b, scale_a, scale_b, out_scale, out_amax, config=None, impl=None):
    """(q, qt): relu(a @ b * scale_a * scale_b)^2 as float8_e4m3fn with scale out_scale,
    row-major and transposed; out_amax records its max. config, impl as in fp8_matmul
    ("scaled_mm" runs the rule: cuBLAS has no such epilogue)."""
    impl, config = _quant_impl(config, impl)
    # this epilogue reads no activation: a and scale_a stand in for the unused act arguments
    return _fp8_matmul_quant_op(a, b, scale_a, scale_b, a, scale_a, out_scale, out_amax,
                                torch.float8_e4m3fn, "relu2", config, impl)


def fp8_matmul_relu2_reference(a, b, scale_a, scale_b, out_scale, out_amax, config=None):
    h = fp8_matmul_reference(a, b, scale_a, scale_b, torch.float32)
    q = _quantize_reference(torch.relu(h) * torch.relu(h), out_scale, out_amax, torch.float8_e4m3fn)
    return q, q.t().contiguous()


def fp8_matmul_relu2_grad(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, config=None, impl=None):
    """(q, qt): (a @ b * scale_a * scale_b) * 2 sqrt(act * act_scale) as float8_e5m2 with scale
    out_scale, row-major and transposed; out_amax records its max. act (M, N) is the fp8
    activation relu(h)^2 (any strides), so the result is the gradient at the pre-activation h.
    A backward GEMM: accumulated as fp8_fast_accumulation says for its K (a.shape[1]).
    config, impl as in fp8_matmul_relu2."""
    impl, config = _quant_impl(config, impl)
    return _fp8_matmul_quant_op(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax,
                                torch.float8_e5m2, "relu2_grad", config, impl)


def fp8_matmul_relu2_grad_reference(a, b, scale_a, scale_b, act, act_scale, out_scale, out_amax, config=None):
    grad = fp8_matmul_reference(a, b, scale_a, scale_b, torch.float32)
    grad_h = 2.0 * torch.sqrt(act.float() * act_scale) * grad
    q = _quantize_reference(grad_h, out_scale, out_amax, torch.float8_e5m2)
    return q, q.t().contiguous()


def _quantize_reference(x, scale, amax, fp8_dtype):
    """The torch form of _quantize_tile: fp32 x * (1 / scale) saturated to fp8; amax records max |x|."""
    amax.copy_(torch.maximum(amax, x.abs().amax().reshape(1)))
    fp8_max = _FP8_MAX[fp8_dtype]
    return (x * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(fp8_dtype)


def _scale_for_amax(amax, fp8_max, headroom):
    """Per-tensor scale mapping amax * headroom to the fp8 maximum; UNCALIBRATED_SCALE where amax
    is 0 (unknown)."""
    unknown = torch.full_like(amax, UNCALIBRATED_SCALE[fp8_max])
    return torch.where(amax > 0, amax * (headroom / fp8_max), unknown)


def _operand_scale(state, slots, rule, name, fp8_max, x):
    """(scale, amax slot) of the operand `name` of a layer, by its rule (x: the operand, needed
    by the exact rules only). The slot is left for this call's cast to record the operand's amax
    in: the next call's delayed scale, and for a static scale how close it came to saturating.
    Everything stays on the device: no rule waits for a value on the host."""
    amax = state[slots[name]:slots[name] + 1]
    if isinstance(rule, Static):
        scale = torch.full_like(amax, rule.scale)
        if fp8_max == FP8_E5M2_MAX:
            scale = scale * state[slots["loss_unit"]]
    elif isinstance(rule, Delayed):
        scale = _scale_for_amax(amax, fp8_max, rule.headroom)
    else:
        own = _scale_for_amax(x.detach().abs().amax().float().reshape(1), fp8_max, 1.0)
        if isinstance(rule, ExactThenDelayed):
            delayed = _scale_for_amax(amax, fp8_max, rule.headroom)
            scale = torch.where(state[slots["calls"]] < rule.calls, own, delayed)
        else:
            scale = own
    amax.zero_()
    return scale, amax


# The FP8 weights of the layers of one kind, cast together at the start of a forward: per group
# of same-shaped weights an amax pass (rules that need the weight's own amax), a scale kernel and
# one cast launch, where each layer would otherwise launch its scale's reductions, its where and
# its cast. The weights are read through a table of their addresses, as they are.
WEIGHT_AMAX_PARTS = 32             # programs per weight in the amax pass; the scale kernel reduces their maxima
WEIGHT_AMAX_BLOCK = 2048           # elements an amax program takes at a time
FP8_WEIGHT_CAST = LaunchConfig(block_m=64, block_n=64, num_warps=4)
WEIGHT_FLOATS = ("float32", "bfloat16", "float16")   # the weight dtypes the group kernels read (tl's names)
RULE_STATIC, RULE_DELAYED, RULE_EXACT, RULE_EXACT_THEN_DELAYED = range(4)   # the scale kernel's RULE


def _rule_code(rule):
    """[kind, static scale, headroom, exact calls] of a weight's scale rule, as floats for the op."""
    if isinstance(rule, Static):
        return [float(RULE_STATIC), rule.scale, 1.0, 0.0]
    if isinstance(rule, Delayed):
        return [float(RULE_DELAYED), 0.0, rule.headroom, 0.0]
    if isinstance(rule, ExactThenDelayed):
        return [float(RULE_EXACT_THEN_DELAYED), 0.0, rule.headroom, float(rule.calls)]
    return [float(RULE_EXACT), 0.0, 1.0, 0.0]


@triton.jit
def _weight_address(w_table, layer, W_DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The layer's weight's address from the table; ALIGNED (every weight at a multiple of 16
    bytes, as the allocator places a tensor) lets the loads go 16 bytes at a time, which the
    compiler cannot know of an address read from memory."""
    w_ptr = tl.load(w_table + layer).to(tl.pointer_type(W_DTYPE))
    if ALIGNED:
        w_ptr = tl.multiple_of(w_ptr, 16)
    return w_ptr


@triton.jit
def _weight_amax_kernel(w_table, partial_ptr, numel, W_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
                        PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """partial[layer, part] = max |w| over the part-th of every PARTS blocks of the layer's weight,
    whose address is w_table[layer]. Traffic: each weight read once."""
    layer = tl.program_id(0)
    part = tl.program_id(1)
    w_ptr = _weight_address(w_table, layer, W_DTYPE, ALIGNED)
    offsets = tl.arange(0, BLOCK).to(tl.int64)
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(part * BLOCK, numel, PARTS * BLOCK):
        index = start + offsets
        top = tl.maximum(top, tl.abs(tl.load(w_ptr + index, mask=index < numel, other=0.0).to(tl.float32)))
    tl.store(partial_ptr + layer * PARTS + part, tl.max(top, axis=0))


@triton.jit
def _weight_scales_kernel(s_table, partial_ptr, scales_ptr, amax_slot, calls_slot, static_scale, headroom_over_max,
                          exact_calls, RULE: tl.constexpr, PARTS: tl.constexpr, Q_MAX: tl.constexpr,
                          SCALE_STRIDE: tl.constexpr):
    """scales[layer] by the rule (_operand_scale's arithmetic) from the layer's state (address
    s_table[layer]): its amax slot (the previous cast's) and call count, and for the exact rules
    the amax pass's PARTS partial maxima; then the amax slot is zeroed for this call's cast."""
    layer = tl.program_id(0)
    state = tl.load(s_table + layer).to(tl.pointer_type(tl.float32))
    if RULE == 0:
        scale = static_scale
    else:
        recorded = tl.load(state + amax_slot)
        scale = tl.where(recorded > 0, recorded * headroom_over_max, 1.0)
        if RULE >= 2:
            own = tl.max(tl.load(partial_ptr + layer * PARTS + tl.arange(0, PARTS)), axis=0)
            exact = tl.where(own > 0, own * (1.0 / Q_MAX), 1.0)
            if RULE == 2:
                scale = exact
            else:
                scale = tl.where(tl.load(state + calls_slot) < exact_calls, exact, scale)
    tl.store(scales_ptr + layer * SCALE_STRIDE, scale)
    tl.store(state + amax_slot, 0.0)


@triton.jit
def _weight_cast_kernel(w_table, s_table, scales_ptr, q_ptr, qt_ptr, amax_slot, M, N, W_DTYPE: tl.constexpr,
                        ALIGNED: tl.constexpr, Q_MAX: tl.constexpr, SCALE_STRIDE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """q[layer] = fp8(w / scales[layer]) (M, N) and qt[layer] its transpose, recording max |w| in
    the layer's amax slot: _fp8_cast_kernel over a batch of weights. Traffic: each weight read once,
    its two fp8 copies written once."""
    layer = tl.program_id(2)
    w_ptr = _weight_address(w_table, layer, W_DTYPE, ALIGNED)
    state = tl.load(s_table + layer).to(tl.pointer_type(tl.float32))
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    x = tl.load(w_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N), other=0.0)
    offset = layer.to(tl.int64) * M * N
    _quantize_tile(x.to(tl.float32), rows, cols, M, N, q_ptr + offset, qt_ptr + offset,
                   tl.load(scales_ptr + layer * SCALE_STRIDE), state + amax_slot, Q_MAX)


_POINTER_TABLES = {}               # (device, addresses) -> int64 tensor of those addresses on the device


def _pointer_table(tensors):
    """An int64 device tensor of the tensors' addresses, made once per set of addresses (a CUDA
    graph's capture cannot copy one in, so the warm-up's call makes it)."""
    key = (str(tensors[0].device), *(t.data_ptr() for t in tensors))
    table = _POINTER_TABLES.get(key)
    if table is None:
        if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fp8_cast_weights: a new set of weights inside a CUDA graph's capture; "
                               "run the forward once before capturing it")
        table = _POINTER_TABLES[key] = torch.tensor(key[1:], dtype=torch.int64, device=tensors[0].device)
    return table


def _launch_fp8_cast_weights(weights: list[Tensor], states: list[Tensor], amax_slot: int, calls_slot: int,
                             rule: list[float], config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    config = _config_from_list(config)
    (M, N), layers, device = weights[0].shape, len(weights), weights[0].device
    w_table, s_table = _pointer_table(weights), _pointer_table(states)
    q = torch.empty(layers, M, N, dtype=torch.float8_e4m3fn, device=device)
    qt = torch.empty(layers, N, M, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(layers, FP8_SLOT_STRIDE, dtype=torch.float32, device=device)
    kind, static_scale, headroom, exact_calls = rule
    w_dtype = getattr(tl, str(weights[0].dtype).removeprefix("torch."))
    aligned = all(w.data_ptr() % 16 == 0 for w in weights)
    partial = scales
    if kind >= RULE_EXACT:
        partial = torch.empty(layers, WEIGHT_AMAX_PARTS, dtype=torch.float32, device=device)
        _launch(_weight_amax_kernel, (layers, WEIGHT_AMAX_PARTS), config, w_table=w_table, partial_ptr=partial,
                numel=M * N, W_DTYPE=w_dtype, ALIGNED=aligned, PARTS=WEIGHT_AMAX_PARTS, BLOCK=WEIGHT_AMAX_BLOCK)
    _launch(_weight_scales_kernel, (layers,), LaunchConfig(1, 1, num_warps=1), s_table=s_table, partial_ptr=partial,
            scales_ptr=scales, amax_slot=amax_slot, calls_slot=calls_slot, static_scale=static_scale,
            headroom_over_max=headroom / FP8_E4M3_MAX, exact_calls=exact_calls, RULE=int(kind),
            PARTS=WEIGHT_AMAX_PARTS, Q_MAX=FP8_E4M3_MAX, SCALE_STRIDE=FP8_SLOT_STRIDE)
    _launch(_weight_cast_kernel, (triton.cdiv(M, config.block_m), triton.cdiv(N, config.block_n), layers), config,
            w_table=w_table, s_table=s_table, scales_ptr=scales, q_ptr=q, qt_ptr=qt, amax_slot=amax_slot, M=M, N=N,
            W_DTYPE=w_dtype, ALIGNED=aligned, Q_MAX=FP8_E4M3_MAX, SCALE_STRIDE=FP8_SLOT_STRIDE,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    return q, qt, scales


_fp8_cast_weights_op = torch.library.custom_op(f"{_OPS}::fp8_cast_weights", _launch_fp8_cast_weights,
                                               mutates_args=("states",))


@_fp8_cast_weights_op.register_fake
def _(weights, states, amax_slot, calls_slot, rule, config):
    (M, N), layers = weights[0].shape, len(weights)
    return (weights[0].new_empty(layers, M, N, dtype=torch.float8_e4m3fn),
            weights[0].new_empty(layers, N, M, dtype=torch.float8_e4m3fn),
            weights[0].new_empty(layers, FP8_SLOT_STRIDE, dtype=torch.float32))


def _check_weight_group(weights, states):
    if len(weights) != len(states) or not weights:
        raise ValueError(f"fp8_cast_weights: {len(weights)} weights and {len(states)} states; "
                         "give one state per weight")
    for w in weights:
        if w.dim() != 2 or not w.is_contiguous() or str(w.dtype).removeprefix("torch.") not in WEIGHT_FLOATS:
            raise ValueError(f"fp8_cast_weights: weights must be contiguous 2-d float tensors; got {w.dtype} "
                             f"{tuple(w.shape)}{'' if w.is_contiguous() else ' (not contiguous)'}")


def fp8_cast_weights(weights, states, slots, name, rule, config=FP8_WEIGHT_CAST):
    """[(w8, w8_t, scale)] of each weight: what _operand_scale and the cast kernel give one layer's
    operand `name` (its rule, its state's slots: the amax slot zeroed, then the cast's amax
    recorded), for all the layers at once: one amax pass, one scale kernel and one cast per group
    of weights of the same shape and dtype. The state's call count is read, not advanced (each
    layer counts its own call)."""
    _check_weight_group(weights, states)
    weights = [w.detach() for w in weights]
    groups = collections.defaultdict(list)
    for i, w in enumerate(weights):
        groups[tuple(w.shape), w.dtype].append(i)
    casts = [None] * len(weights)
    for members in groups.values():
        q, qt, scales = _fp8_cast_weights_op([weights[i] for i in members], [states[i] for i in members],
                                             slots[name], slots["calls"], _rule_code(rule), config.as_list())
        for j, i in enumerate(members):
            casts[i] = (q[j], qt[j], scales[j, :1])
    return casts


def fp8_cast_weights_reference(weights, states, slots, name, rule, config=None):
    """fp8_cast_weights one layer at a time: _operand_scale, then fp8_cast_reference."""
    _check_weight_group(weights, states)
    casts = []
    for w, state in zip((w.detach() for w in weights), states):
        scale, amax = _operand_scale(state, slots, rule, name, FP8_E4M3_MAX, w)
        casts.append((*fp8_cast_reference(w, scale, amax, torch.float8_e4m3fn), scale))
    return casts


@dataclasses.dataclass(frozen=True)
class _FP8Primitives:
    """The FP8 building blocks a layer is made of: Triton kernels or their torch references.
    `cast` casts the activations and gradients, `cast_weight` the weights (a parameter comes
    from no kernel a cast could be fused into, so it keeps the cast kernel's one launch)."""
    cast: object
    cast_weight: object
    matmul: object
    matmul_relu2: object
    matmul_relu2_grad: object


def _gemm_primitives(impl):
    return _FP8Primitives(fp8_cast, fp8_cast, functools.partial(fp8_matmul, impl=impl),
                          functools.partial(fp8_matmul_relu2, impl=impl), functools.partial(fp8_matmul_relu2_grad,
                                                                                           impl=impl))


# Which GEMMs the FP8 layers run (the config's fp8_gemm): "fastest", at each shape the candidate
# the warm-up timed fastest (kernel_choice; the rule where nothing was timed); "triton", the
# rule (the persistent descriptor kernel where the layout allows, else the pointer kernel);
# "tma" and "pointer", that kernel; "scaled_mm", the plain GEMMs on torch._scaled_mm (a torch op
# of the graph), the relu2 epilogues by the rule. The casts stay Triton in every case.
FP8_GEMMS = {"fastest": _gemm_primitives("auto"), "triton": _gemm_primitives("rule"), "tma": _gemm_primitives("tma"),
             "pointer": _gemm_primitives("pointer"),
             "scaled_mm": dataclasses.replace(_gemm_primitives("rule"), matmul=fp8_matmul_scaled_mm)}
# How the activations and gradients are cast: "kernel", the cast kernel (one pass: read, write
# both layouts); "fused", torch ops that torch.compile fuses into the kernel making the input.
FP8_CASTS = {"kernel": fp8_cast, "fused": fp8_cast_fused}
_PRIMITIVES = {(gemm, casts): dataclasses.replace(prims, cast=cast)
               for gemm, prims in FP8_GEMMS.items() for casts, cast in FP8_CASTS.items()}
_REFERENCE_FP8 = _FP8Primitives(fp8_cast_reference, fp8_cast_reference, fp8_matmul_reference,
                                fp8_matmul_relu2_reference, fp8_matmul_relu2_grad_reference)


def _new_state(slots, device):
    state = torch.zeros(fp8_state_size(slots), dtype=torch.float32, device=device)
    state[slots["loss_unit"]] = 1.0
    return state


def new_fp8_linear_state(device=None):
    """The state buffer of one fp8_linear layer: no amax known yet, no calls, loss unit 1."""
    return _new_state(FP8_LINEAR_SLOTS, device)


def new_fp8_mlp_state(device=None):
    """The state buffer of one fp8_relu2_mlp layer: no amax known yet, no calls, loss unit 1."""
    return _new_state(FP8_MLP_SLOTS, device)


def set_fp8_loss_unit(state, unit):
    """Set the weight the training objective gives one token's loss (1 / tokens for a mean over
    tokens; 1 for a sum), by which a layer multiplies its static gradient scales. It is the
    last entry of every layer's state."""
    state[-1] = unit


def _count_call(state, slots):
    state[slots["calls"]:slots["calls"] + 1].add_(1.0)


def _backward_matmul(prims):
    """The backward GEMMs' matmul, accumulated as fp8_fast_accumulation says for its K: their sums
    run over the tokens (weight gradients: up to 49,152 in the speedrun) or the layer's outputs
    (input gradients: 2,304 for the QKV projection, 50,304 for the head), where the fast
    accumulator's ~14 significand bits would drop the low bits of every later product."""
    def matmul(a, b, *args, **kwargs):
        return prims.matmul(a, b, *args, fast_accumulation=fp8_fast_accumulation(a.shape[1]), **kwargs)
    return matmul


# The sampled weight gradient (PR 371's head): dW = sum over rows of g_r^T x_r taken from one row of
# each group of `stride` consecutive rows, times stride; the input gradient stays exact. Which row
# of a group: a hash of (seed, group), so that every rank draws the same rows at a step.
HEAD_SAMPLE_MULT = 0x9E3779B1       # spreads the group index before the hash (the golden ratio, 32 bits)
HEAD_SAMPLE_MIX = 0x45D9F3B         # the hash's multiplier (an xorshift-multiply integer hash)
MASK31 = 0x7FFFFFFF


def _mix31(x):
    """A 31-bit integer hash of x (int64 tensors in [0, 2^31)): products stay below 2^58."""
    for _ in range(2):
        x = ((x ^ (x >> 16)) * HEAD_SAMPLE_MIX) & MASK31
    return x ^ (x >> 16)


def head_sample_rows(num_rows, stride, seed):
    """int64 (num_rows / stride,): the row sampled from each group of `stride` consecutive rows,
    group g's being g * stride + hash(seed, g) mod stride. seed: an int or an int64 device tensor
    (a step's seed, written in place so that one captured graph serves every step). num_rows must
    be a multiple of stride (each sampled row then stands for exactly `stride` rows)."""
    if num_rows % stride:
        raise ValueError(f"head_sample_rows: {num_rows} rows do not split into groups of {stride}")
    device = seed.device if isinstance(seed, Tensor) else None
    groups = torch.arange(num_rows // stride, dtype=torch.int64, device=device)
    seed = seed.long() & MASK31 if isinstance(seed, Tensor) else int(seed) & MASK31
    offsets = _mix31(((groups * HEAD_SAMPLE_MULT) & MASK31) ^ seed) % stride
    return groups * stride + offsets


def _gather_rows(t, rows):
    """Rows `rows` of a 2-d tensor (fp8 ones through a uint8 view: index_select takes no fp8)."""
    if t.element_size() == 1 and t.dtype != torch.uint8:
        return t.view(torch.uint8).index_select(0, rows).view(t.dtype)
    return t.index_select(0, rows)


def _gather_columns(t, rows):
    """Columns `rows` of a 2-d tensor, contiguous: the transposed operands' sampled rows."""
    return _gather_rows(t.t(), rows).t().contiguous()


class _SampledLinear(torch.autograd.Function):
    """y = x W^T (the autocast dtype's GEMM); dx = dy W exact; dW = stride x dy[rows]^T x[rows].

    The weight-gradient GEMM reduces over len(rows) = T / stride rows instead of T: its FLOPs and
    its reads of dy and x fall by the stride; the gather reads and writes the sampled rows once
    (dy: rows x N, x: rows x K). The torch reference of the sampled head gradient."""

    @staticmethod
    def forward(ctx, x, weight, rows, stride):
        ctx.save_for_backward(x, weight, rows)
        ctx.stride = stride
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_y):
        """In the output gradient's dtype (the forward's under autocast), each gradient returned in
        its input's dtype."""
        x, weight, rows = ctx.saved_tensors
        dtype = grad_y.dtype
        grad_x = (grad_y @ weight.to(dtype)).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y.index_select(0, rows).t() @ x.index_select(0, rows).to(dtype)) * ctx.stride
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None


def sampled_linear(x, weight, rows, stride):
    """x @ weight.T whose weight gradient is sampled: from rows `rows` of x and of the output's
    gradient (head_sample_rows), scaled by `stride`, an unbiased estimate of the exact one when
    each row stands for `stride` rows; the input gradient is exact. x (N, K), weight (M, K)."""
    return _SampledLinear.apply(x, weight, rows, stride)


class _FP8Linear(torch.autograd.Function):
    """y = x W^T with e4m3 operands; backward with e5m2 output gradients. Three GEMMs:
    forward x8 W8^T (fast accumulator), input gradient g8 W8 and weight gradient g8^T x8 (fp32
    accumulation every BLOCK_K where K is long: _backward_matmul). Each operand is cast once
    into a row-major and a transposed copy, so every GEMM reads both operands K-major.
    With sample_rows (the sampled weight gradient, sampled_linear): the forward keeps only the
    sampled columns of x8^T (rows x K bytes, not T x K), the backward gathers the same columns of
    g8^T, and the weight-gradient GEMM reduces over them at the gradient's scale times stride.
    With w8, w8_t, w_scale (fp8_cast_weights' cast of the weight for this call) the weight is not
    cast again. With gain (a 0-D tensor) the layer's weight is gain W (_weight_gain)."""

    @staticmethod
    def forward(ctx, x, weight, state, scales, prims, config, sample_rows=None, stride=1, w8=None, w8_t=None,
                w_scale=None, gain=None):
        y, saved = _fp8_linear_forward(x, weight, state, scales, prims, config, (w8, w8_t, w_scale), gain)
        if sample_rows is not None:
            saved = (_gather_columns(saved[0], sample_rows), *saved[1:])
        ctx.save_for_backward(*saved, sample_rows, *_gain_saved(weight, gain))
        ctx.state, ctx.scales, ctx.prims, ctx.config = state, scales, prims, config
        ctx.dtypes = (x.dtype, weight.dtype)
        ctx.sampled, ctx.stride = sample_rows is not None, stride
        return y

    @staticmethod
    def backward(ctx, grad_y):
        g_scale, g_amax = _operand_scale(ctx.state, FP8_LINEAR_SLOTS, ctx.scales.grad_output, "grad_output",
                                         FP8_E5M2_MAX, grad_y)
        g8, g8_t = ctx.prims.cast(grad_y, g_scale, g_amax, torch.float8_e5m2)
        *saved, rows, weight, gain = ctx.saved_tensors
        if ctx.sampled:
            g8_t = _gather_columns(g8_t, rows)
        grad_x, grad_w = _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale, ctx.stride)
        grad_w, grad_gain = _weight_gain_grads(grad_w, weight, gain, ctx.needs_input_grad[11])
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, grad_gain


def _weight_gain(w_scale, gain):
    """The weight's scale in the GEMMs with a 0-D gain on the weight: x (gain W)^T is the GEMM
    of the cast of W with its scale times gain, so the weight is cast as it is (once per forward,
    by kind) and a learned gain on a layer's output costs one scalar product. Its gradient is
    the sum over the weight's entries of W times the gradient of gain W (_weight_gain_grads),
    not a sum over every token's output."""
    return w_scale if gain is None else w_scale * gain.detach().float().reshape(1)


def _gain_saved(weight, gain):
    """(weight, gain) for a backward that takes gain's gradient, (None, None) without a gain."""
    return (weight, gain) if gain is not None else (None, None)


def _weight_gain_grads(grad_effective, weight, gain, need_gain):
    """(grad W, grad gain) from the gradient of the effective weight gain W."""
    if gain is None or grad_effective is None:
        return grad_effective, None
    grad_gain = (grad_effective.float() * weight.float()).sum().to(gain.dtype) if need_gain else None
    return grad_effective * gain.detach().to(grad_effective.dtype), grad_gain


def _fp8_linear_forward(x, weight, state, scales, prims, config, weight_cast=(None, None, None), gain=None):
    """(y, the tensors its backward needs): _FP8Linear's forward, its operands cast (the weight
    unless weight_cast holds its (w8, w8_t, scale)) and the call counted in `state`; with gain,
    of the weight gain W (_weight_gain)."""
    slots = FP8_LINEAR_SLOTS
    x_scale, x_amax = _operand_scale(state, slots, scales.input, "input", FP8_E4M3_MAX, x)
    x8, x8_t = prims.cast(x, x_scale, x_amax, torch.float8_e4m3fn)
    w8, w8_t, w_scale = weight_cast
    if w8 is None:
        w_scale, w_amax = _operand_scale(state, slots, scales.weight, "weight", FP8_E4M3_MAX, weight)
        w8, w8_t = prims.cast_weight(weight, w_scale, w_amax, torch.float8_e4m3fn)
    _count_call(state, slots)
    w_scale = _weight_gain(w_scale, gain)
    y = prims.matmul(x8, w8.t(), x_scale, w_scale, x.dtype, config)
    return y, (x8_t, w8_t, x_scale, w_scale)


def _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale, stride=1):
    """(grad_x, grad_w) of an FP8 linear layer from its output gradient in e5m2 (g8 and its
    transpose g8_t, at scale g_scale), each only where ctx.needs_input_grad asks for it. stride > 1:
    g8_t and x8_t hold the sampled rows only, and grad_w is their product times stride."""
    x8_t, w8_t, x_scale, w_scale = saved
    need_x, need_w = ctx.needs_input_grad[:2]
    matmul = _backward_matmul(ctx.prims)
    grad_x = matmul(g8, w8_t.t(), g_scale, w_scale, ctx.dtypes[0], ctx.config) if need_x else None
    w_scale_g = g_scale if stride == 1 else g_scale * stride
    grad_w = matmul(g8_t, x8_t.t(), w_scale_g, x_scale, ctx.dtypes[1], ctx.config) if need_w else None
    return grad_x, grad_w


class _FP8ReLU2MLP(torch.autograd.Function):
    """y = relu(x W_up^T)^2 W_down^T with all six GEMMs in fp8.

    Accumulation as in _FP8Linear: fast in the forward GEMMs and the hidden gradient's, fp32 every
    BLOCK_K in the backward GEMMs that sum over the tokens or the hidden width.
    Forward: the up-projection's epilogue squares the ReLU and emits the activation
    a = relu(h)^2 in e4m3 twice (row-major for the down-projection, transposed for the W_down
    gradient); h is never stored. Backward: the input-gradient GEMM of the down-projection
    multiplies by 2 relu(h) = 2 sqrt(a) in its epilogue and emits dL/dh in e5m2 (row-major and
    transposed), which feeds the two up-projection gradient GEMMs.
    With up8, ..., down_scale (fp8_cast_weights' casts of both weights for this call) the weights
    are not cast again. With down_gain (a 0-D tensor) the down-projection's weight is
    down_gain W_down (_weight_gain): a learned gain on the MLP's output.
    """

    @staticmethod
    def forward(ctx, x, w_up, w_down, state, scales, prims, config, up8=None, up8_t=None, up_scale=None,
                down8=None, down8_t=None, down_scale=None, down_gain=None):
        slots = FP8_MLP_SLOTS
        x_scale, x_amax = _operand_scale(state, slots, scales.input, "input", FP8_E4M3_MAX, x)
        x8, x8_t = prims.cast(x, x_scale, x_amax, torch.float8_e4m3fn)
        if up8 is None:
            up_scale, up_amax = _operand_scale(state, slots, scales.up_weight, "up_weight", FP8_E4M3_MAX, w_up)
            up8, up8_t = prims.cast_weight(w_up, up_scale, up_amax, torch.float8_e4m3fn)
            down_scale, down_amax = _operand_scale(state, slots, scales.down_weight, "down_weight", FP8_E4M3_MAX,
                                                   w_down)
            down8, down8_t = prims.cast_weight(w_down, down_scale, down_amax, torch.float8_e4m3fn)
        a_scale, a_amax = _operand_scale(state, slots, scales.hidden, "hidden", FP8_E4M3_MAX, None)
        _count_call(state, slots)
        a8, a8_t = prims.matmul_relu2(x8, up8.t(), x_scale, up_scale, a_scale, a_amax, config)
        down_scale = _weight_gain(down_scale, down_gain)
        y = prims.matmul(a8, down8.t(), a_scale, down_scale, x.dtype, config)
        ctx.save_for_backward(x8_t, up8_t, down8_t, a8_t, x_scale, up_scale, down_scale, a_scale,
                              *_gain_saved(w_down, down_gain))
        ctx.state, ctx.scales, ctx.prims, ctx.config = state, scales, prims, config
        ctx.dtypes = (x.dtype, w_up.dtype, w_down.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x8_t, up8_t, down8_t, a8_t, x_scale, up_scale, down_scale, a_scale, w_down, down_gain = ctx.saved_tensors
        prims, config, state, scales = ctx.prims, ctx.config, ctx.state, ctx.scales
        g_scale, g_amax = _operand_scale(state, FP8_MLP_SLOTS, scales.grad_output, "grad_output", FP8_E5M2_MAX,
                                         grad_y)
        g8, g8_t = prims.cast(grad_y, g_scale, g_amax, torch.float8_e5m2)
        need_x, need_up, need_down = ctx.needs_input_grad[:3]
        need_gain = ctx.needs_input_grad[13]
        grad_x = grad_up = grad_down = grad_gain = None
        matmul = _backward_matmul(prims)
        if need_down or need_gain:
            grad_down = matmul(g8_t, a8_t.t(), g_scale, a_scale, ctx.dtypes[2], config)
            grad_down, grad_gain = _weight_gain_grads(grad_down, w_down, down_gain, need_gain)
            grad_down = grad_down if need_down else None
        if need_x or need_up:
            h_scale, h_amax = _operand_scale(state, FP8_MLP_SLOTS, scales.grad_hidden, "grad_hidden",
                                             FP8_E5M2_MAX, None)
            gh8, gh8_t = prims.matmul_relu2_grad(g8, down8_t.t(), g_scale, down_scale, a8_t.t(), a_scale,
                                                 h_scale, h_amax, config)
            if need_x:
                grad_x = matmul(gh8, up8_t.t(), h_scale, up_scale, ctx.dtypes[0], config)
            if need_up:
                grad_up = matmul(gh8_t, x8_t.t(), h_scale, x_scale, ctx.dtypes[1], config)
        return grad_x, grad_up, grad_down, None, None, None, None, None, None, None, None, None, None, grad_gain


def _check_fp8_state(state, slots, constructor):
    size = fp8_state_size(slots)
    if state.dtype != torch.float32 or state.shape != (size,):
        raise ValueError(f"the fp8 state buffer must be float32 of shape ({size},), as made by {constructor}")


def _check_scales(scales, kind):
    if not isinstance(scales, kind):
        raise ValueError(f"the scales must be a {kind.__name__}; got {type(scales).__name__}")
    for field in dataclasses.fields(scales):
        rule = getattr(scales, field.name)
        if not isinstance(rule, (Exact, Delayed, Static, ExactThenDelayed)):
            raise ValueError(f"{kind.__name__}.{field.name}: not a scale rule ({rule!r})")
        if field.name in ("hidden", "grad_hidden") and isinstance(rule, (Exact, ExactThenDelayed)):
            raise ValueError(f"{kind.__name__}.{field.name}: an epilogue output cannot take its own amax "
                             "(it is never stored in high precision): use Delayed or Static")


def _check_gain(gain):
    if gain is not None and (not isinstance(gain, Tensor) or gain.dim() != 0):
        raise ValueError(f"an FP8 layer's gain must be a 0-D tensor or None; got {gain!r}")
    return gain


def _sample_args(sample):
    """_FP8Linear's (sample_rows, stride) of a (rows, stride) sample, or none."""
    return (None, 1) if sample is None else sample


def fp8_linear(x, weight, state, config=None, scales=FP8LinearScales(), gemm="fastest", casts="kernel", sample=None,
               weight_cast=None, gain=None):
    """x @ weight.T in fp8 (see the module docstring). x (..., K) bf16, weight (N, K), state from
    new_fp8_linear_state, scales: an FP8LinearScales. config: the GEMM tile of the pointer kernel
    (or, with gemm="tma", of the persistent one; None: each shape's own). gemm: a key of FP8_GEMMS.
    casts: "kernel" or "fused" (FP8_CASTS: "fused" where torch.compile builds the graph).
    sample: None, or (rows, stride) of the sampled weight gradient (sampled_linear), rows of x's
    flattened leading dims. weight_cast: None, or this call's (w8, w8_t, scale) of the weight from
    fp8_linear_weight_casts. gain: None, or a 0-D tensor: the layer's weight is gain * weight."""
    _check_fp8_state(state, FP8_LINEAR_SLOTS, "new_fp8_linear_state")
    _check_scales(scales, FP8LinearScales)
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), weight, state, scales, _PRIMITIVES[gemm, casts], config,
                         *_sample_args(sample), *(weight_cast or (None,) * 3), _check_gain(gain))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear_reference(x, weight, state, config=None, scales=FP8LinearScales(), sample=None, weight_cast=None,
                         gain=None):
    """fp8_linear with torch casts and fp8_matmul_reference: same scales, same buffer updates."""
    _check_fp8_state(state, FP8_LINEAR_SLOTS, "new_fp8_linear_state")
    _check_scales(scales, FP8LinearScales)
    y = _FP8Linear.apply(x.reshape(-1, x.shape[-1]), weight, state, scales, _REFERENCE_FP8, config,
                         *_sample_args(sample), *(weight_cast or (None,) * 3), _check_gain(gain))
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_relu2_mlp(x, w_up, w_down, state, config=None, scales=FP8MLPScales(), gemm="fastest", casts="kernel",
                  weight_casts=None, gain=None):
    """relu(x @ w_up.T)^2 @ (gain w_down).T in fp8 (see _FP8ReLU2MLP). x (..., D) bf16, w_up (H, D),
    w_down (D, H), state from new_fp8_mlp_state, scales: an FP8MLPScales. config, gemm and casts
    as in fp8_linear (the relu2 GEMMs are Triton's whatever gemm says). weight_casts: None, or
    this call's (up8, up8_t, up_scale, down8, down8_t, down_scale) from fp8_mlp_weight_casts.
    gain: None (1), or a 0-D tensor."""
    _check_fp8_state(state, FP8_MLP_SLOTS, "new_fp8_mlp_state")
    _check_scales(scales, FP8MLPScales)
    y = _FP8ReLU2MLP.apply(x.reshape(-1, x.shape[-1]), w_up, w_down, state, scales, _PRIMITIVES[gemm, casts],
                           config, *(weight_casts or (None,) * 6), _check_gain(gain))
    return y.reshape(*x.shape[:-1], w_down.shape[0])


def fp8_relu2_mlp_reference(x, w_up, w_down, state, config=None, scales=FP8MLPScales(), weight_casts=None,
                            gain=None):
    """fp8_relu2_mlp with torch casts and fp8_matmul_reference: same scales, same buffer updates."""
    _check_fp8_state(state, FP8_MLP_SLOTS, "new_fp8_mlp_state")
    _check_scales(scales, FP8MLPScales)
    y = _FP8ReLU2MLP.apply(x.reshape(-1, x.shape[-1]), w_up, w_down, state, scales, _REFERENCE_FP8, config,
                           *(weight_casts or (None,) * 6), _check_gain(gain))
    return y.reshape(*x.shape[:-1], w_down.shape[0])


def fp8_linear_weight_casts(weights, states, scales=FP8LinearScales(), cast=fp8_cast_weights):
    """[(w8, w8_t, scale)] of several fp8_linear layers' weights for this call (their
    weight_cast), cast together (fp8_cast_weights, or its reference)."""
    _check_scales(scales, FP8LinearScales)
    return cast(weights, states, FP8_LINEAR_SLOTS, "weight", scales.weight)


def fp8_mlp_weight_casts(ups, downs, states, scales=FP8MLPScales(), cast=fp8_cast_weights):
    """[(up8, up8_t, up_scale, down8, down8_t, down_scale)] of several fp8_relu2_mlp layers'
    weights for this call (their weight_casts), each weight kind cast together."""
    _check_scales(scales, FP8MLPScales)
    up = cast(ups, states, FP8_MLP_SLOTS, "up_weight", scales.up_weight)
    down = cast(downs, states, FP8_MLP_SLOTS, "down_weight", scales.down_weight)
    return [(*u, *d) for u, d in zip(up, down)]


# ---------------------------------------------------------------------------------------------
# 2. Attention on packed documents with a sliding window
# ---------------------------------------------------------------------------------------------
#
# FlashAttention-2 on a packed stream of documents. The work is tiled over the packed stream
# itself: a program owns BLOCK_M consecutive tokens (or BLOCK_N keys in the key/value backward)
# and one head, whatever documents they belong to, so the grid is cdiv(T, BLOCK) x heads, every
# program has real work, and no program is launched for padding or for blocks past the end of a
# short document. Document boundaries enter through two per-token int32 tables computed once
# per call from cu_seqlens: doc_start[i] (first token of i's document) and doc_end[i] (one past
# its last token). Key j is visible to query i when j <= i < doc_end[j] and i - j < window.
# A program visits only the blocks of the other side that hold a visible pair (found from the
# tables at its first and last token) and masks only those that cross the diagonal, the window
# edge or a document boundary (reading doc_end of the block's keys there).
# Backward, two ways. One kernel over key blocks (_attn_bwd_fused_kernel): S and dP once per
# tile, dK and dV in registers, dQ added atomically into an fp32 buffer (five tile products; the
# additions' order varies from run to run, so dQ is not reproducible bit for bit). Or,
# deterministic: delta = rowsum(dO * O) first, then one kernel over key blocks for dK and dV and
# one over query blocks for dQ, both recomputing P from the saved log-sum-exp (seven tile
# products, no atomics). flash_attn_varlen's impl picks (kernel_choice: the faster one at each
# shape where the warm-up timed them). The softmax scale is read from a one-element fp32
# tensor, so a scale that changes during training (YaRN) changes no compiled code.
# Descriptor variants of the forward and of the one-kernel backward (_attn_fwd_tma_kernel,
# _attn_bwd_fused_tma_kernel: FlashAttention-3's structure as Triton expresses it, see their
# notes) are further candidates of the warm-up, and impl "tma" pins them; the pointer kernels
# stay the rule.

# Head dims the kernels take (64 and 128 are the production ones, compiled for sm_90 by the tests).
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
# Input dtypes; fp32 only off the GPU (tests): its dQ tiles would need 256 KB of shared memory on sm_90.
ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Queries per block in the reference: bounds the (block x keys) score matrix it materializes.
REFERENCE_QUERY_BLOCK = 256
# Window passed to the kernels for "no limit": longer than any packed batch.
NO_WINDOW = 1 << 30
LOG2_E = tl.constexpr(1.4426950408889634)  # the kernels work with exp2: exp(x) = exp2(x * LOG2_E)

# Production blocks for H100/H200, every (Dqk, Dv) in {64, 128}^2 (bench/sm90_resources.json: no
# spills; the forward spills with 3 stages at 128/128, the key/value kernel with 64 queries).
ATTENTION_FORWARD = LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
ATTENTION_BACKWARD_KV = LaunchConfig(block_m=32, block_n=128, num_warps=8, num_stages=2)
ATTENTION_BACKWARD_Q = LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
ATTENTION_BACKWARD_DELTA = LaunchConfig(block_m=128, block_n=1, num_warps=4)
# The one-kernel backward: 128 keys a program, 32 queries a step (its dQ tile and the O tile of
# delta beside dK and dV: 252 registers at 128/128 with 3 stages, which spill with 2 or 64 queries).
ATTENTION_BACKWARD_FUSED = LaunchConfig(block_m=32, block_n=128, num_warps=8, num_stages=3)
# Forward, key/value-gradient, query-gradient, delta (the deterministic backward's three) and
# one-kernel backward configs, in that order.
ATTENTION_CONFIGS = (ATTENTION_FORWARD, ATTENTION_BACKWARD_KV, ATTENTION_BACKWARD_Q, ATTENTION_BACKWARD_DELTA,
                     ATTENTION_BACKWARD_FUSED)
ATTENTION_CONFIG_COUNT = len(ATTENTION_CONFIGS)
# Windows up to NARROW_WINDOW tokens take smaller tiles: a tile that crosses the window's edge or
# a document boundary computes its masked pairs too, and the production tiles compute 2.2x the
# visible pairs at a 128-token window on FineWeb-like documents, these 1.6x (bench/step_model.py's
# attention_tiles); at 1,408 tokens the production tiles' waste is 1.2x. Wgmma, no spills on sm_90.
NARROW_WINDOW = 1024
ATTENTION_CONFIGS_NARROW = (LaunchConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
                            LaunchConfig(block_m=32, block_n=64, num_warps=4, num_stages=2),
                            LaunchConfig(block_m=64, block_n=32, num_warps=4, num_stages=2),
                            ATTENTION_BACKWARD_DELTA,
                            LaunchConfig(block_m=32, block_n=64, num_warps=8, num_stages=3))
# How flash_attn_varlen runs (the config's attention_impl): "auto", the forward's tiles or
# flex_attention and the backward, each the fastest the warm-up timed at the call's shape
# (kernel_choice; the rule where nothing was timed); "rule", the window's tiles and the
# one-kernel backward; "atomic" the same; "deterministic", the two-kernel backward (no atomics:
# gradients reproducible bit for bit); "flex", the forward by torch's flex_attention, the
# backward by the rule; "tma", the descriptor variants of the forward and of the one-kernel
# backward at the window's tiles (the rule's kernels where a tensor's layout cannot be
# described: _descriptor_layout_ok).
ATTENTION_IMPLS = ("auto", "rule", "atomic", "deterministic", "flex", "tma")
_FORWARD_IMPL = {"auto": "auto", "rule": "rule", "atomic": "rule", "deterministic": "rule", "flex": "flex",
                 "tma": "tma"}
_BACKWARD_IMPL = {"auto": "auto", "rule": "atomic", "atomic": "atomic", "deterministic": "deterministic",
                  "flex": "atomic", "tma": "tma"}
# The selection's agreement check of an attention candidate (relative Frobenius distance from the
# reference): bf16 outputs of FlashAttention-style computations, P rounded to bf16 in each.
ATTENTION_CHOICE_TOLERANCE = 2.0 ** -6
# Whether each descriptor variant's loop (_attn_fwd_tma_kernel, _attn_bwd_fused_tma_kernel) is
# warp-specialized. The forward's is (sm_90: a producer warp group issuing the copies, two
# consumer warp groups with setmaxnreg; bench/sm90_resources*.json). The backward's is not: the
# Hopper pass of triton 3.6.0 and 3.7.1 fails on its loop (five products and the dQ reduction:
# "Unexpected asyncTaskIds.size()" in its data partitioning, at every tile and warp count tried),
# so it is descriptor-loaded and pipelined only.
ATTENTION_WARP_SPECIALIZE = {"forward": True, "backward": False}
# A warp-specialized variant runs the pointer kernel's tiles and stages with this many warps a
# warp group: Triton's Hopper warp specialization partitions the loop of a 4-warp kernel into a
# producer and two consumer warp groups (12 warps; it leaves an 8-warp kernel's loop as it is).
# The other variants keep the pointer kernel's warps (the backward's dK and dV sums spill with 4).
ATTENTION_DESCRIPTOR_WARPS = 4


def attention_configs(window):
    """The launch configs of flash_attn_varlen for a window of `window` tokens (<= 0: none)."""
    return ATTENTION_CONFIGS_NARROW if 0 < window <= NARROW_WINDOW else ATTENTION_CONFIGS


@triton.jit
def _key_blocks(q_first, q_last, first_start, last_start, window, BLOCK_N: tl.constexpr):
    """Key blocks seen by the queries [q_first, q_last], whose documents start at first_start
    (that of q_first) ... last_start (that of q_last), as block indices t (keys t*BLOCK_N + [0, BLOCK_N)).

    Returns lo <= mid_lo <= mid_hi <= hi: blocks [lo, hi) hold every visible key; those in
    [mid_lo, mid_hi) are visible to every query of the block, so they need no mask.
    """
    lo = tl.maximum(first_start, q_first - window + 1) // BLOCK_N
    hi = q_last // BLOCK_N + 1
    # every key inside every query's document and window: first key >= this
    mid_lo = tl.cdiv(tl.maximum(last_start, q_last - window + 1), BLOCK_N)
    # at or before every query: last key <= q_first
    mid_hi = (q_first + 1) // BLOCK_N
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _query_blocks(k_first, k_last, first_end, last_end, window, BLOCK_M: tl.constexpr):
    """Query blocks that see one of the keys [k_first, k_last], whose documents end at first_end
    (that of k_first) ... last_end (that of k_last), as block indices u (queries u*BLOCK_M + [0, BLOCK_M)).

    Returns lo <= mid_lo <= mid_hi <= hi: blocks [lo, hi) hold every query that sees one of the
    keys; those in [mid_lo, mid_hi) see all of them (no mask).
    """
    lo = k_first // BLOCK_M
    hi = tl.cdiv(tl.minimum(k_last + window, last_end), BLOCK_M)
    # at or after every key: first query >= k_last
    mid_lo = tl.cdiv(k_last, BLOCK_M)
    # every key inside every query's window and document: last query < k_first + window, < first_end
    mid_hi = tl.minimum((k_first + window) // BLOCK_M, first_end // BLOCK_M)
    mid_lo = tl.minimum(tl.maximum(mid_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(mid_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _visible(rows, cols, col_end, window):
    """(queries, keys) pairs where the key is visible: key <= query < the key's document end,
    query - key < window."""
    return (cols[None, :] <= rows[:, None]) & (rows[:, None] < col_end[None, :]) & \
        (rows[:, None] - cols[None, :] < window)


@triton.jit
def _load_keys(k_ptr, v_ptr, cols, stride_kt, stride_vt, num_tokens, D_QK: tl.constexpr, D_V: tl.constexpr,
               MASKED: tl.constexpr):
    """K (BLOCK_N, D_QK) and V (BLOCK_N, D_V) rows `cols`; masked blocks may run past the
    packed batch (zeros there), unmasked ones lie inside it."""
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    k_ptrs = k_ptr + cols[:, None] * stride_kt + d_qk[None, :]
    v_ptrs = v_ptr + cols[:, None] * stride_vt + d_v[None, :]
    if MASKED:
        key_ok = cols[:, None] < num_tokens
        k = tl.load(k_ptrs, mask=key_ok, other=0.0)
        v = tl.load(v_ptrs, mask=key_ok, other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    return k, v


@triton.jit
def _masked_scores(s, rows, cols, doc_end_ptr, num_tokens, window):
    """Scores of invisible pairs set to -inf; keys past the batch get document end 0 (invisible)."""
    col_end = tl.load(doc_end_ptr + cols, mask=cols < num_tokens, other=0)
    return tl.where(_visible(rows, cols, col_end, window), s, -float("inf"))


@triton.jit
def _attn_fwd_blocks(acc, l_i, m_i, q, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt, num_tokens, window,
                     qk_scale, t_begin, t_end, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_N: tl.constexpr,
                     MASKED: tl.constexpr):
    """Online softmax over key blocks [t_begin, t_end): acc = sum p v, l_i = sum p, m_i = max
    score (log2 units), with p = exp2(score - m_i) rescaled whenever m_i grows."""
    for t in range(t_begin, t_end):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = _load_keys(k_ptr, v_ptr, cols, stride_kt, stride_vt, num_tokens, D_QK, D_V, MASKED)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = _masked_scores(s, rows, cols, doc_end_ptr, num_tokens, window)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED:
            # rows with no visible key yet keep m = -inf; subtract 0 so that p = 0, not NaN
            m_new = tl.where(m_new == -float("inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, doc_start_ptr, doc_end_ptr, scale_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                     num_tokens, window,
                     D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """O = softmax(Q K^T * scale + mask) V for BLOCK_M consecutive queries of the packed batch and
    one head (FlashAttention-2 forward). Grid: (cdiv(T, BLOCK_M), heads).

    Only key blocks that hold a visible key are visited (_key_blocks), and only those crossing
    the diagonal, the window edge or a document boundary are masked. Traffic per program: Q block
    read once, K and V (and doc_end for masked blocks) read for the visited blocks (at most
    window + BLOCK_M keys), O and the log-sum-exp (log2 units, for the backward) written once.
    """
    q_first = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    q_last = tl.minimum(q_first + BLOCK_M, num_tokens) - 1
    rows = q_first + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qt + d_qk[None, :], mask=row_ok[:, None], other=0.0)
    k_ptr += head * stride_kh
    v_ptr += head * stride_vh
    qk_scale = tl.load(scale_ptr) * LOG2_E

    acc = tl.zeros((BLOCK_M, D_V), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _key_blocks(q_first, q_last, tl.load(doc_start_ptr + q_first),
                                         tl.load(doc_start_ptr + q_last), window, BLOCK_N)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt,
                                     num_tokens, window, qk_scale, lo, mid_lo, D_QK, D_V, BLOCK_N, True)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt,
                                     num_tokens, window, qk_scale, mid_lo, mid_hi, D_QK, D_V, BLOCK_N, False)
    acc, l_i, m_i = _attn_fwd_blocks(acc, l_i, m_i, q, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt,
                                     num_tokens, window, qk_scale, mid_hi, hi, D_QK, D_V, BLOCK_N, True)
    l_i = tl.where(row_ok, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(o_ptr + head * stride_oh + rows[:, None] * stride_ot + d_v[None, :], o.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    tl.store(lse_ptr + head * num_tokens + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _backward_window(window, head_window_ptr, head, HEAD_WINDOWS: tl.constexpr):
    """The window a backward program of `head` works over: the forward's, or with HEAD_WINDOWS
    the smaller of it and the head's entry of the int32 table head_window_ptr (the truncated
    backward). P is recomputed from the forward's log-sum-exp over the full window and delta
    from the forward's O, so the truncated backward keeps each kept pair's exact P (no
    renormalization) and drops the pairs further back than the head's window: the key blocks
    that lie wholly beyond it are never visited (the saving), and the rest are masked."""
    if HEAD_WINDOWS:
        window = tl.minimum(window, tl.load(head_window_ptr + head))
    return window


@triton.jit
def _attn_bwd_delta_kernel(o_ptr, do_ptr, delta_ptr, stride_ot, stride_oh, stride_dot, stride_doh, num_tokens,
                           D_V: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) per token and head, the softmax-gradient correction term.
    Traffic: O and dO read once, delta written (fp32, (heads, tokens))."""
    head = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d_v = tl.arange(0, D_V)
    mask = rows[:, None] < num_tokens
    o = tl.load(o_ptr + head * stride_oh + rows[:, None] * stride_ot + d_v[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + head * stride_doh + rows[:, None] * stride_dot + d_v[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + head * num_tokens + rows, delta, mask=rows < num_tokens)


@triton.jit
def _attn_bwd_kv_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt, stride_dot,
                        num_tokens, window, qk_scale, u_begin, u_end,
                        D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dK += dS^T Q and dV += P^T dO over query blocks [u_begin, u_end), in the
    transposed (keys x queries) orientation: P^T = exp2(K Q^T * scale - lse), dS^T = P^T (dP^T - delta)."""
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    for u in range(u_begin, u_end):
        rows = u * BLOCK_M + tl.arange(0, BLOCK_M)
        q_ptrs = q_ptr + rows[:, None] * stride_qt + d_qk[None, :]
        do_ptrs = do_ptr + rows[:, None] * stride_dot + d_v[None, :]
        if MASKED:
            row_ok = rows < num_tokens
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_ptr + rows)
            delta = tl.load(delta_ptr + rows)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        if MASKED:
            # key j, query i: j <= i, i - j < window, i before the end of j's document
            visible_t = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window) & \
                (rows[None, :] < col_end[:, None])
            s_t = tl.where(visible_t, s_t, -float("inf"))
        p_t = tl.exp2(s_t - lse[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q)
    return dk, dv


@triton.jit
def _attn_bwd_kv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, doc_end_ptr, scale_ptr,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                        stride_dkt, stride_dkh, stride_dvt, stride_dvh, num_tokens, window, head_window_ptr,
                        D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        HEAD_WINDOWS: tl.constexpr = False):
    """dK and dV for BLOCK_N consecutive keys of the packed batch and one head (FlashAttention-2).
    Grid: (cdiv(T, BLOCK_N), heads). HEAD_WINDOWS: the truncated backward (_backward_window).

    Visits only the query blocks that see one of the keys (_query_blocks), recomputing P from the
    saved log-sum-exp. Traffic per program: K, V block read once; Q, dO, lse, delta read for the
    visited query blocks (at most window + BLOCK_N queries); dK, dV written once. No atomics.
    """
    k_first = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1)
    window = _backward_window(window, head_window_ptr, head, HEAD_WINDOWS)
    k_last = tl.minimum(k_first + BLOCK_N, num_tokens) - 1
    cols = k_first + tl.arange(0, BLOCK_N)
    col_ok = cols < num_tokens
    col_end = tl.load(doc_end_ptr + cols, mask=col_ok, other=0)
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    k = tl.load(k_ptr + head * stride_kh + cols[:, None] * stride_kt + d_qk[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + head * stride_vh + cols[:, None] * stride_vt + d_v[None, :], mask=col_ok[:, None], other=0.0)
    q_ptr += head * stride_qh
    do_ptr += head * stride_doh
    lse_ptr += head * num_tokens
    delta_ptr += head * num_tokens
    sm_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * LOG2_E

    dk = tl.zeros((BLOCK_N, D_QK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D_V), dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_blocks(k_first, k_last, tl.load(doc_end_ptr + k_first),
                                           tl.load(doc_end_ptr + k_last), window, BLOCK_M)
    dk, dv = _attn_bwd_kv_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                 stride_dot, num_tokens, window, qk_scale, lo, mid_lo, D_QK, D_V, BLOCK_M, True)
    dk, dv = _attn_bwd_kv_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                 stride_dot, num_tokens, window, qk_scale, mid_lo, mid_hi, D_QK, D_V, BLOCK_M, False)
    dk, dv = _attn_bwd_kv_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, lse_ptr, delta_ptr, stride_qt,
                                 stride_dot, num_tokens, window, qk_scale, mid_hi, hi, D_QK, D_V, BLOCK_M, True)
    tl.store(dk_ptr + head * stride_dkh + cols[:, None] * stride_dkt + d_qk[None, :],
             (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + head * stride_dvh + cols[:, None] * stride_dvt + d_v[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _attn_bwd_q_blocks(dq, q, do, lse, delta, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt, num_tokens,
                       window, qk_scale, t_begin, t_end, D_QK: tl.constexpr, D_V: tl.constexpr,
                       BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Accumulate dQ += dS K over key blocks [t_begin, t_end), with P = exp2(Q K^T * scale - lse)
    and dS = P (dO V^T - delta)."""
    for t in range(t_begin, t_end):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        k, v = _load_keys(k_ptr, v_ptr, cols, stride_kt, stride_vt, num_tokens, D_QK, D_V, MASKED)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = _masked_scores(s, rows, cols, doc_end_ptr, num_tokens, window)
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def _attn_bwd_q_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, doc_start_ptr, doc_end_ptr, scale_ptr,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                       stride_dqt, stride_dqh, num_tokens, window, head_window_ptr,
                       D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       HEAD_WINDOWS: tl.constexpr = False):
    """dQ for BLOCK_M consecutive queries of the packed batch and one head (FlashAttention-2).
    Grid and visited key blocks as in _attn_fwd_kernel. Traffic per program: Q, dO, lse, delta
    read once, K and V for the visited key blocks, dQ written once. HEAD_WINDOWS: the truncated
    backward (_backward_window)."""
    q_first = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    window = _backward_window(window, head_window_ptr, head, HEAD_WINDOWS)
    q_last = tl.minimum(q_first + BLOCK_M, num_tokens) - 1
    rows = q_first + tl.arange(0, BLOCK_M)
    row_ok = rows < num_tokens
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    q = tl.load(q_ptr + head * stride_qh + rows[:, None] * stride_qt + d_qk[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + head * stride_doh + rows[:, None] * stride_dot + d_v[None, :], mask=row_ok[:, None],
                 other=0.0)
    lse = tl.load(lse_ptr + head * num_tokens + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + head * num_tokens + rows, mask=row_ok, other=0.0)
    k_ptr += head * stride_kh
    v_ptr += head * stride_vh
    sm_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * LOG2_E

    dq = tl.zeros((BLOCK_M, D_QK), dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _key_blocks(q_first, q_last, tl.load(doc_start_ptr + q_first),
                                         tl.load(doc_start_ptr + q_last), window, BLOCK_N)
    dq = _attn_bwd_q_blocks(dq, q, do, lse, delta, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt,
                            num_tokens, window, qk_scale, lo, mid_lo, D_QK, D_V, BLOCK_N, True)
    dq = _attn_bwd_q_blocks(dq, q, do, lse, delta, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt,
                            num_tokens, window, qk_scale, mid_lo, mid_hi, D_QK, D_V, BLOCK_N, False)
    dq = _attn_bwd_q_blocks(dq, q, do, lse, delta, rows, doc_end_ptr, k_ptr, v_ptr, stride_kt, stride_vt,
                            num_tokens, window, qk_scale, mid_hi, hi, D_QK, D_V, BLOCK_N, True)
    tl.store(dq_ptr + head * stride_dqh + rows[:, None] * stride_dqt + d_qk[None, :],
             (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _attn_bwd_fused_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, o_ptr, lse_ptr, dq_ptr, dq_desc,
                           stride_qt, stride_dot, stride_ot, stride_dqt, num_tokens, window, qk_scale, sm_scale,
                           u_begin, u_end, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr,
                           MASKED: tl.constexpr, DQ_DESCRIPTOR: tl.constexpr):
    """Over query blocks [u_begin, u_end), from one S and one dP per block (transposed: keys x
    queries): dV += P^T dO, dK += dS^T Q, and dQ += dS K added atomically into the fp32 dQ sums
    (by a descriptor's reduction where DQ_DESCRIPTOR, else by atomic adds of the tile's elements).
    delta = rowsum(dO * O) of each query block is formed here from its O and dO tiles."""
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    for u in range(u_begin, u_end):
        rows = u * BLOCK_M + tl.arange(0, BLOCK_M)
        q_ptrs = q_ptr + rows[:, None] * stride_qt + d_qk[None, :]
        do_ptrs = do_ptr + rows[:, None] * stride_dot + d_v[None, :]
        o_ptrs = o_ptr + rows[:, None] * stride_ot + d_v[None, :]
        row_ok = rows < num_tokens
        if MASKED:
            q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
            do = tl.load(do_ptrs, mask=row_ok[:, None], other=0.0)
            o = tl.load(o_ptrs, mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            o = tl.load(o_ptrs)
            lse = tl.load(lse_ptr + rows)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        if MASKED:
            # key j, query i: j <= i, i - j < window, i before the end of j's document
            visible_t = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window) & \
                (rows[None, :] < col_end[:, None])
            s_t = tl.where(visible_t, s_t, -float("inf"))
        p_t = tl.exp2(s_t - lse[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        dq = tl.dot(tl.trans(ds_t), k) * sm_scale
        if DQ_DESCRIPTOR:
            dq_desc.atomic_add([u * BLOCK_M, 0], dq)          # rows past the batch fall outside the descriptor
        else:
            tl.atomic_add(dq_ptr + rows[:, None] * stride_dqt + d_qk[None, :], dq, mask=row_ok[:, None])
    return dk, dv


@triton.jit
def _attn_bwd_fused_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, doc_end_ptr,
                           scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot,
                           stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt, stride_dkh,
                           stride_dvt, stride_dvh, num_tokens, window, head_window_ptr,
                           D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           DQ_DESCRIPTOR: tl.constexpr, HEAD_WINDOWS: tl.constexpr = False):
    """The whole attention backward for BLOCK_N consecutive keys of the packed batch and one head,
    in one kernel. Grid: (cdiv(T, BLOCK_N), heads).

    Visits the query blocks that see one of the keys (_query_blocks), recomputing S = Q K^T and
    P from the saved log-sum-exp, and dP = dO V^T, once per (query block, key block) tile: five
    tile products (S, dV, dP, dK, dQ) where separate dK/dV and dQ kernels take seven. dK and dV
    stay in registers and are stored once; dQ is summed over the key blocks by atomic adds into
    the fp32 (T, heads, D_QK) buffer dq_ptr, zeroed before the launch (scaled by the softmax scale
    here). The order of those additions varies from run to run: dQ is not reproducible bit for
    bit (the deterministic backward is _attn_bwd_kv_kernel with _attn_bwd_q_kernel).
    Traffic per program: K, V read once; Q, dO, O, lse read for the visited query blocks (at most
    window + BLOCK_N queries); dK, dV written once; BLOCK_M x D_QK fp32 added into dQ per tile.
    HEAD_WINDOWS: the truncated backward (_backward_window).
    """
    k_first = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1)
    window = _backward_window(window, head_window_ptr, head, HEAD_WINDOWS)
    k_last = tl.minimum(k_first + BLOCK_N, num_tokens) - 1
    cols = k_first + tl.arange(0, BLOCK_N)
    col_ok = cols < num_tokens
    col_end = tl.load(doc_end_ptr + cols, mask=col_ok, other=0)
    d_qk = tl.arange(0, D_QK)
    d_v = tl.arange(0, D_V)
    k = tl.load(k_ptr + head * stride_kh + cols[:, None] * stride_kt + d_qk[None, :], mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + head * stride_vh + cols[:, None] * stride_vt + d_v[None, :], mask=col_ok[:, None], other=0.0)
    q_ptr += head * stride_qh
    do_ptr += head * stride_doh
    o_ptr += head * stride_oh
    dq_ptr += head * stride_dqh
    lse_ptr += head * num_tokens
    sm_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * LOG2_E
    dq_desc = dq_ptr
    if DQ_DESCRIPTOR:
        dq_desc = tl.make_tensor_descriptor(dq_ptr, shape=[num_tokens, D_QK], strides=[stride_dqt, 1],
                                            block_shape=[BLOCK_M, D_QK])

    dk = tl.zeros((BLOCK_N, D_QK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D_V), dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_blocks(k_first, k_last, tl.load(doc_end_ptr + k_first),
                                           tl.load(doc_end_ptr + k_last), window, BLOCK_M)
    dk, dv = _attn_bwd_fused_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, o_ptr, lse_ptr, dq_ptr, dq_desc,
                                    stride_qt, stride_dot, stride_ot, stride_dqt, num_tokens, window, qk_scale,
                                    sm_scale, lo, mid_lo, D_QK, D_V, BLOCK_M, True, DQ_DESCRIPTOR)
    dk, dv = _attn_bwd_fused_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, o_ptr, lse_ptr, dq_ptr, dq_desc,
                                    stride_qt, stride_dot, stride_ot, stride_dqt, num_tokens, window, qk_scale,
                                    sm_scale, mid_lo, mid_hi, D_QK, D_V, BLOCK_M, False, DQ_DESCRIPTOR)
    dk, dv = _attn_bwd_fused_blocks(dk, dv, k, v, cols, col_end, q_ptr, do_ptr, o_ptr, lse_ptr, dq_ptr, dq_desc,
                                    stride_qt, stride_dot, stride_ot, stride_dqt, num_tokens, window, qk_scale,
                                    sm_scale, mid_hi, hi, D_QK, D_V, BLOCK_M, True, DQ_DESCRIPTOR)
    tl.store(dk_ptr + head * stride_dkh + cols[:, None] * stride_dkt + d_qk[None, :],
             (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + head * stride_dvh + cols[:, None] * stride_dvt + d_v[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


# The descriptor variants (FlashAttention-3's structure, as far as Triton expresses it): the same
# tiles, visits, masks and arithmetic as the kernels above, with every tile of the other side
# (K and V in the forward; Q, dO and O in the backward) loaded by tensor descriptor (the copy
# engine: TMA, UTMALDG in SASS), the outputs stored by descriptor, and the loop over that side
# software-pipelined (num_stages tiles in flight) and, where WARP_SPECIALIZE, warp-specialized:
# Triton's Hopper pass splits the loop into a producer warp group that issues the copies and
# consumer warp groups that run the products and the softmax, with their registers rebalanced
# (setmaxnreg). A descriptor's bounds stand in for the pointer kernels' row masks: rows past
# the packed batch load as zeros and are not stored. Each kernel walks its visited blocks in one
# loop, every tile masked (the mask is all true on the interior tiles: the same numbers), where
# the pointer kernels run three (masked, unmasked, masked): Triton's Hopper warp specialization
# (3.6.0, 3.7.1) fails on the forward with three loops ("operation destroyed but still has
# uses"), and the backward's three pipelined loops spill at head dim 128 (255 registers) where
# one loop does not. The masks cost a few integer operations a score, not a product.

@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, v, MASKED: tl.constexpr):
    """One key block of the online softmax (as in _attn_fwd_blocks): m_i grows to the block's
    row maxima, acc and l_i are rescaled by exp2(old - new) and the block's p = exp2(s - m_i)
    added (p rounded to v's dtype before P V)."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        # rows with no visible key yet keep m = -inf; subtract 0 so that p = 0, not NaN
        m_new = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def _attn_fwd_tma_blocks(acc, l_i, m_i, q, rows, doc_end_ptr, k_desc, v_desc, num_tokens, window, qk_scale,
                         t_begin, t_end, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """_attn_fwd_blocks over key blocks [t_begin, t_end) with K and V loaded by descriptor (keys
    past the batch read as zeros, and their scores are masked), the loop pipelined (and
    warp-specialized where WARP_SPECIALIZE)."""
    for t in tl.range(t_begin, t_end, warp_specialize=WARP_SPECIALIZE):
        key_first = t * BLOCK_N
        k = k_desc.load([key_first, 0])
        v = v_desc.load([key_first, 0])
        s = tl.dot(q, tl.trans(k)) * qk_scale
        if MASKED:
            s = _masked_scores(s, rows, key_first + tl.arange(0, BLOCK_N), doc_end_ptr, num_tokens, window)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, s, v, MASKED)
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_tma_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, doc_start_ptr, doc_end_ptr, scale_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                         num_tokens, window,
                         D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         WARP_SPECIALIZE: tl.constexpr):
    """_attn_fwd_kernel (the same grid, visited blocks, masks and online softmax) with Q, K and V
    loaded and O stored by tensor descriptor, the key loop pipelined and, where WARP_SPECIALIZE,
    warp-specialized, over every visited block in one loop (see the notes above). Grid:
    (cdiv(T, BLOCK_M), heads).

    Traffic per program: the Q block read once, K, V and doc_end read for the visited blocks (at
    most window + BLOCK_M keys), O and the log-sum-exp written once.
    """
    q_first = tl.program_id(0) * BLOCK_M
    head = tl.program_id(1)
    q_last = tl.minimum(q_first + BLOCK_M, num_tokens) - 1
    rows = q_first + tl.arange(0, BLOCK_M)
    q_desc = tl.make_tensor_descriptor(q_ptr + head * stride_qh, shape=[num_tokens, D_QK], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, D_QK])
    k_desc = tl.make_tensor_descriptor(k_ptr + head * stride_kh, shape=[num_tokens, D_QK], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, D_QK])
    v_desc = tl.make_tensor_descriptor(v_ptr + head * stride_vh, shape=[num_tokens, D_V], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, D_V])
    o_desc = tl.make_tensor_descriptor(o_ptr + head * stride_oh, shape=[num_tokens, D_V], strides=[stride_ot, 1],
                                       block_shape=[BLOCK_M, D_V])
    q = q_desc.load([q_first, 0])
    qk_scale = tl.load(scale_ptr) * LOG2_E

    acc = tl.zeros((BLOCK_M, D_V), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    lo, _, _, hi = _key_blocks(q_first, q_last, tl.load(doc_start_ptr + q_first), tl.load(doc_start_ptr + q_last),
                               window, BLOCK_N)
    # every visited block in one loop, each tile masked (see the notes above)
    acc, l_i, m_i = _attn_fwd_tma_blocks(acc, l_i, m_i, q, rows, doc_end_ptr, k_desc, v_desc, num_tokens,
                                         window, qk_scale, lo, hi, BLOCK_N, True, WARP_SPECIALIZE)
    row_ok = rows < num_tokens
    l_i = tl.where(row_ok, l_i, 1.0)
    o_desc.store([q_first, 0], (acc / l_i[:, None]).to(o_desc.dtype))
    tl.store(lse_ptr + head * num_tokens + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _attn_bwd_fused_tma_blocks(dk, dv, k, v, cols, col_end, q_desc, do_desc, o_desc, lse_ptr, dq_ptr, dq_desc,
                               stride_dqt, num_tokens, window, qk_scale, sm_scale, u_begin, u_end,
                               D_QK: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                               DQ_DESCRIPTOR: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """_attn_bwd_fused_blocks over query blocks [u_begin, u_end) with Q, dO and O loaded by
    descriptor (rows past the batch read as zeros), the loop pipelined (and warp-specialized
    where WARP_SPECIALIZE): dV += P^T dO, dK += dS^T Q, dQ += dS K added into the fp32 sums."""
    for u in tl.range(u_begin, u_end, warp_specialize=WARP_SPECIALIZE):
        query_first = u * BLOCK_M
        rows = query_first + tl.arange(0, BLOCK_M)
        q = q_desc.load([query_first, 0])
        do = do_desc.load([query_first, 0])
        o = o_desc.load([query_first, 0])
        if MASKED:
            lse = tl.load(lse_ptr + rows, mask=rows < num_tokens, other=0.0)
        else:
            lse = tl.load(lse_ptr + rows)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
        s_t = tl.dot(k, tl.trans(q)) * qk_scale
        if MASKED:
            # key j, query i: j <= i, i - j < window, i before the end of j's document
            seen = (cols[:, None] <= rows[None, :]) & (rows[None, :] - cols[:, None] < window) & \
                (rows[None, :] < col_end[:, None])
            s_t = tl.where(seen, s_t, -float("inf"))
        p_t = tl.exp2(s_t - lse[None, :])
        dv += tl.dot(p_t.to(do.dtype), do)
        ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk += tl.dot(ds_t, q)
        dq_tile = tl.dot(tl.trans(ds_t), k) * sm_scale
        if DQ_DESCRIPTOR:
            dq_desc.atomic_add([query_first, 0], dq_tile)      # rows past the batch fall outside the descriptor
        else:
            tl.atomic_add(dq_ptr + rows[:, None] * stride_dqt + tl.arange(0, D_QK)[None, :], dq_tile,
                          mask=rows[:, None] < num_tokens)
    return dk, dv


@triton.jit
def _attn_bwd_fused_tma_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, doc_end_ptr,
                               scale_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                               stride_ot, stride_oh, stride_dot, stride_doh, stride_dqt, stride_dqh, stride_dkt,
                               stride_dkh, stride_dvt, stride_dvh, num_tokens, window,
                               D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               DQ_DESCRIPTOR: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """_attn_bwd_fused_kernel (the same grid, visited query blocks, masks, five tile products and
    atomic fp32 dQ) with K and V loaded, Q, dO and O streamed and dK, dV stored by tensor
    descriptor, the query loop pipelined and, where WARP_SPECIALIZE, warp-specialized. Grid:
    (cdiv(T, BLOCK_N), heads). dQ is not reproducible bit for bit (atomic additions).

    Traffic per program: K, V read once; Q, dO, O, lse read for the visited query blocks (at most
    window + BLOCK_N queries); dK, dV written once; BLOCK_M x D_QK fp32 added into dQ per tile.
    """
    k_first = tl.program_id(0) * BLOCK_N
    head = tl.program_id(1)
    k_last = tl.minimum(k_first + BLOCK_N, num_tokens) - 1
    cols = k_first + tl.arange(0, BLOCK_N)
    col_end = tl.load(doc_end_ptr + cols, mask=cols < num_tokens, other=0)
    k_desc = tl.make_tensor_descriptor(k_ptr + head * stride_kh, shape=[num_tokens, D_QK], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, D_QK])
    v_desc = tl.make_tensor_descriptor(v_ptr + head * stride_vh, shape=[num_tokens, D_V], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, D_V])
    q_desc = tl.make_tensor_descriptor(q_ptr + head * stride_qh, shape=[num_tokens, D_QK], strides=[stride_qt, 1],
                                       block_shape=[BLOCK_M, D_QK])
    do_desc = tl.make_tensor_descriptor(do_ptr + head * stride_doh, shape=[num_tokens, D_V], strides=[stride_dot, 1],
                                        block_shape=[BLOCK_M, D_V])
    o_desc = tl.make_tensor_descriptor(o_ptr + head * stride_oh, shape=[num_tokens, D_V], strides=[stride_ot, 1],
                                       block_shape=[BLOCK_M, D_V])
    dk_desc = tl.make_tensor_descriptor(dk_ptr + head * stride_dkh, shape=[num_tokens, D_QK],
                                        strides=[stride_dkt, 1], block_shape=[BLOCK_N, D_QK])
    dv_desc = tl.make_tensor_descriptor(dv_ptr + head * stride_dvh, shape=[num_tokens, D_V],
                                        strides=[stride_dvt, 1], block_shape=[BLOCK_N, D_V])
    k = k_desc.load([k_first, 0])
    v = v_desc.load([k_first, 0])
    dq_ptr += head * stride_dqh
    lse_ptr += head * num_tokens
    sm_scale = tl.load(scale_ptr)
    qk_scale = sm_scale * LOG2_E
    dq_desc = dq_ptr
    if DQ_DESCRIPTOR:
        dq_desc = tl.make_tensor_descriptor(dq_ptr, shape=[num_tokens, D_QK], strides=[stride_dqt, 1],
                                            block_shape=[BLOCK_M, D_QK])

    dk = tl.zeros((BLOCK_N, D_QK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D_V), dtype=tl.float32)
    lo, _, _, hi = _query_blocks(k_first, k_last, tl.load(doc_end_ptr + k_first), tl.load(doc_end_ptr + k_last),
                                 window, BLOCK_M)
    # every visited block in one loop, each tile masked (see the notes above)
    dk, dv = _attn_bwd_fused_tma_blocks(dk, dv, k, v, cols, col_end, q_desc, do_desc, o_desc, lse_ptr, dq_ptr,
                                        dq_desc, stride_dqt, num_tokens, window, qk_scale, sm_scale, lo, hi,
                                        D_QK, BLOCK_M, True, DQ_DESCRIPTOR, WARP_SPECIALIZE)
    dk_desc.store([k_first, 0], (dk * sm_scale).to(dk_desc.dtype))
    dv_desc.store([k_first, 0], dv.to(dv_desc.dtype))


def attention_grid(num_tokens, block, num_heads):
    """(programs along the packed batch, heads): one program per `block` tokens and head."""
    return (triton.cdiv(num_tokens, block), num_heads)


def _run_attn_fwd(q, k, v, doc_start, doc_end, scale, window, config):
    T, H, d_qk = q.shape
    d_v = v.shape[2]
    o = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, T, dtype=torch.float32, device=q.device)
    _launch(_attn_fwd_kernel, attention_grid(T, config.block_m, H), config,
            q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, lse_ptr=lse, doc_start_ptr=doc_start, doc_end_ptr=doc_end,
            scale_ptr=scale,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
            num_tokens=T, window=window, D_QK=d_qk, D_V=d_v, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    return o, lse


# flex_attention's block (queries and keys) and the compiled function per (tokens, window, device):
# its mask reads the documents' ends from a buffer refilled at each call, so that a new batch
# of documents compiles nothing.
FLEX_BLOCK = 128
_FLEX = {}


def _flex_state(num_tokens, window, device):
    key = (num_tokens, window, str(device))
    if key not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        doc_end = torch.zeros(num_tokens, dtype=torch.int32, device=device)
        scale = torch.ones(1, dtype=torch.float32, device=device)

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx - kv_idx < window) & (q_idx < doc_end[kv_idx])

        def score_mod(score, b, h, q_idx, kv_idx):
            return score * scale[0]
        attend = torch.compile(flex_attention, dynamic=False) if device.type == "cuda" else flex_attention
        _FLEX[key] = (doc_end, scale, mask_mod, score_mod, attend)
    return _FLEX[key]


def _flex_block_mask(doc_start, window, mask_mod, num_tokens):
    """flex_attention's BlockMask of the visible pairs, from the documents' starts: per query block
    the key blocks _key_blocks visits (partial ones masked by mask_mod, full ones not)."""
    from torch.nn.attention.flex_attention import BlockMask
    blocks = triton.cdiv(num_tokens, FLEX_BLOCK)
    device = doc_start.device
    q_first = torch.arange(blocks, device=device) * FLEX_BLOCK
    q_last = torch.clamp(q_first + FLEX_BLOCK, max=num_tokens) - 1
    first_start, last_start = doc_start[q_first].long(), doc_start[q_last].long()
    lo = torch.maximum(first_start, q_first - window + 1) // FLEX_BLOCK
    hi = q_last // FLEX_BLOCK + 1
    mid_lo = torch.minimum(torch.maximum(-(-torch.maximum(last_start, q_last - window + 1) // FLEX_BLOCK), lo), hi)
    mid_hi = torch.minimum(torch.maximum((q_first + 1) // FLEX_BLOCK, mid_lo), hi)
    j = torch.arange(blocks, device=device)[None, :]
    before = (mid_lo - lo)[:, None]
    partial = torch.where(j < before, lo[:, None] + j, mid_hi[:, None] + j - before)
    partial_count = (mid_lo - lo) + (hi - mid_hi)
    partial = torch.where(j < partial_count[:, None], partial, 0)
    full = torch.where(j < (mid_hi - mid_lo)[:, None], mid_lo[:, None] + j, 0)

    def shaped(t):
        return t.to(torch.int32)[None, None].contiguous()
    return BlockMask.from_kv_blocks(shaped(partial_count), shaped(partial), shaped(mid_hi - mid_lo), shaped(full),
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(num_tokens, num_tokens))


def _run_attn_fwd_flex(q, k, v, doc_start, doc_end, scale, window):
    """(o, lse) by torch's flex_attention with the same mask (compiled on CUDA): o in the kernels'
    contiguous layout, lse in log2 units as _attn_fwd_kernel writes it."""
    T = q.shape[0]
    end, scale_buffer, mask_mod, score_mod, attend = _flex_state(T, min(window, T), q.device)
    end.copy_(doc_end)
    scale_buffer.copy_(scale.reshape(1))
    block_mask = _flex_block_mask(doc_start, min(window, T), mask_mod, T)
    o, lse = attend(*(t.detach().unsqueeze(0).transpose(1, 2) for t in (q, k, v)), score_mod=score_mod,
                    block_mask=block_mask, scale=1.0, return_lse=True)
    return o[0].transpose(0, 1).contiguous(), (lse[0] * LOG2_E.value).float().contiguous()


def _attention_key(q, v, window):
    """An attention call's shape as kernel_choice keys it: tokens, heads, head dims, window, dtype."""
    T, H, d_qk = q.shape
    return (T, H, d_qk, v.shape[2], "window", window if window < NO_WINDOW else 0, _dtype_name(q.dtype))


def _tile_name(config):
    return f"{config.block_m}x{config.block_n}"


def attention_candidate_tiles(configs, index):
    """The tiles the selection times kernel `index` of ATTENTION_CONFIGS at: the window's
    (configs[index], the rule's) first, then the other window class's."""
    mine = configs[index]
    other = ATTENTION_CONFIGS[index] if mine == ATTENTION_CONFIGS_NARROW[index] else ATTENTION_CONFIGS_NARROW[index]
    return tuple(dict.fromkeys((mine, other)))


def _attention_forward_candidates(q, k, v, doc_start, doc_end, scale, window, configs):
    """The forward's implementations, the rule first: the kernel at the window's tiles and at the
    other tiles, the descriptor kernel at both (where the layouts allow), and flex_attention."""
    args = (q, k, v, doc_start, doc_end, scale, window)
    tiles = attention_candidate_tiles(configs, 0)
    found = [kernel_choice.Candidate(f"triton {_tile_name(c)}", functools.partial(_run_attn_fwd, *args, c))
             for c in tiles]
    if _descriptor_layout_ok(q, k, v):
        found += [kernel_choice.Candidate(f"tma {_tile_name(c)}", functools.partial(_run_attn_fwd_tma, *args, c))
                  for c in tiles]
    found.append(kernel_choice.Candidate("flex", functools.partial(_run_attn_fwd_flex, *args), triton=False))
    return found


def _launch_attn_fwd(q: Tensor, k: Tensor, v: Tensor, doc_start: Tensor, doc_end: Tensor, scale: Tensor,
                     window: int, configs: list[int], impl: str = "rule") -> tuple[Tensor, Tensor]:
    configs = _configs_from_list(configs, ATTENTION_CONFIG_COUNT)
    args = (q, k, v, doc_start, doc_end, scale, window)
    if impl == "flex":
        return _run_attn_fwd_flex(*args)
    if impl == "tma" and _descriptor_layout_ok(q, k, v):
        return _run_attn_fwd_tma(*args, configs[0])
    if impl != "auto":
        return _run_attn_fwd(*args, configs[0])

    compare = kernel_choice.lazy_check(
        lambda: attention_reference(q, k, v, _cu_seqlens_of(doc_start, doc_end), window, scale),
        ATTENTION_CHOICE_TOLERANCE, "attention")

    def check(outputs):
        return compare(outputs[0])
    candidates = _attention_forward_candidates(*args, configs)
    return kernel_choice.choose("attention_forward", _attention_key(q, v, window), candidates, check).run()


def _cu_seqlens_of(doc_start, doc_end):
    """The document offsets (0, ..., T) of the per-token tables."""
    starts = torch.unique(doc_start)
    return torch.cat([starts, doc_end[-1:]]).to(torch.int32)


def _descriptor_reductions():
    """Whether the fused backward adds dQ by descriptor reductions: compiled kernels yes, the
    interpreter (which has no descriptor reductions) no."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def _head_window_args(head_windows, doc_end):
    """The backward kernels' per-head window arguments: the int32 (heads,) table, or without one
    a stand-in pointer that HEAD_WINDOWS=False never reads (the exact backward's code unchanged)."""
    if head_windows is None:
        return dict(head_window_ptr=doc_end, HEAD_WINDOWS=False)
    return dict(head_window_ptr=head_windows, HEAD_WINDOWS=True)


def _run_attn_bwd_fused(grad_o, q, k, v, o, lse, doc_start, doc_end, scale, window, config, head_windows=None):
    """(dq, dk, dv) by _attn_bwd_fused_kernel: dQ summed in an fp32 buffer, then cast to q's dtype."""
    T, H, d_qk = q.shape
    dq = torch.zeros(T, H, d_qk, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    descriptor = _descriptor_reductions()
    if descriptor:
        _set_tma_allocator(q.device)
    _launch(_attn_bwd_fused_kernel, attention_grid(T, config.block_n, H), config,
            q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, do_ptr=grad_o, lse_ptr=lse, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv,
            doc_end_ptr=doc_end, scale_ptr=scale,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
            stride_dot=grad_o.stride(0), stride_doh=grad_o.stride(1), stride_dqt=dq.stride(0), stride_dqh=dq.stride(1),
            stride_dkt=dk.stride(0), stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1),
            num_tokens=T, window=window, D_QK=d_qk, D_V=v.shape[2], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            DQ_DESCRIPTOR=descriptor, **_head_window_args(head_windows, doc_end))
    return dq.to(q.dtype), dk, dv


def _run_attn_bwd_two_kernels(grad_o, q, k, v, o, lse, doc_start, doc_end, scale, window, kv_config, q_config,
                              delta_config, head_windows=None):
    """(dq, dk, dv) by the delta, dK/dV and dQ kernels: no atomics, reproducible bit for bit."""
    T, H, d_qk = q.shape
    d_v = v.shape[2]
    delta = torch.empty(H, T, dtype=torch.float32, device=q.device)
    _launch(_attn_bwd_delta_kernel, attention_grid(T, delta_config.block_m, H), delta_config,
            o_ptr=o, do_ptr=grad_o, delta_ptr=delta, stride_ot=o.stride(0), stride_oh=o.stride(1),
            stride_dot=grad_o.stride(0), stride_doh=grad_o.stride(1), num_tokens=T, D_V=d_v,
            BLOCK_M=delta_config.block_m)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(q_ptr=q, k_ptr=k, v_ptr=v, do_ptr=grad_o, lse_ptr=lse, delta_ptr=delta, doc_end_ptr=doc_end,
                  scale_ptr=scale,
                  stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
                  stride_vt=v.stride(0), stride_vh=v.stride(1), stride_dot=grad_o.stride(0),
                  stride_doh=grad_o.stride(1), num_tokens=T, window=window, D_QK=d_qk, D_V=d_v,
                  **_head_window_args(head_windows, doc_end))
    _launch(_attn_bwd_kv_kernel, attention_grid(T, kv_config.block_n, H), kv_config,
            dk_ptr=dk, dv_ptr=dv, stride_dkt=dk.stride(0), stride_dkh=dk.stride(1),
            stride_dvt=dv.stride(0), stride_dvh=dv.stride(1), BLOCK_M=kv_config.block_m, BLOCK_N=kv_config.block_n,
            **common)
    _launch(_attn_bwd_q_kernel, attention_grid(T, q_config.block_m, H), q_config,
            dq_ptr=dq, doc_start_ptr=doc_start, stride_dqt=dq.stride(0), stride_dqh=dq.stride(1),
            BLOCK_M=q_config.block_m, BLOCK_N=q_config.block_n, **common)
    return dq, dk, dv


def _descriptor_layout_ok(*tensors):
    """Whether every (T, H, D) tensor can be read or written by per-head tensor descriptors:
    unit last stride, 16-byte aligned base, token and head strides of multiples of 16 bytes."""
    return all(t.stride(2) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0
               and (t.stride(1) * t.element_size()) % 16 == 0 and t.shape[0] > 0 for t in tensors)


def attention_descriptor_config(config, warp_specialize):
    """A descriptor variant's launch config from its pointer kernel's: the same tiles and stages;
    warp-specialized, ATTENTION_DESCRIPTOR_WARPS warps a warp group (the loop's partitions add
    theirs), else the same warps."""
    return dataclasses.replace(config, num_warps=ATTENTION_DESCRIPTOR_WARPS) if warp_specialize else config


def _run_attn_fwd_tma(q, k, v, doc_start, doc_end, scale, window, config):
    """(o, lse) by _attn_fwd_tma_kernel at `config`'s tiles (attention_descriptor_config)."""
    T, H, d_qk = q.shape
    d_v = v.shape[2]
    warp_specialize = ATTENTION_WARP_SPECIALIZE["forward"]
    config = attention_descriptor_config(config, warp_specialize)
    o = torch.empty(T, H, d_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(H, T, dtype=torch.float32, device=q.device)
    _set_tma_allocator(q.device)
    _launch(_attn_fwd_tma_kernel, attention_grid(T, config.block_m, H), config,
            q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, lse_ptr=lse, doc_start_ptr=doc_start, doc_end_ptr=doc_end,
            scale_ptr=scale,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
            num_tokens=T, window=window, D_QK=d_qk, D_V=d_v, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            WARP_SPECIALIZE=warp_specialize)
    return o, lse


def _run_attn_bwd_fused_tma(grad_o, q, k, v, o, lse, doc_start, doc_end, scale, window, config):
    """(dq, dk, dv) by _attn_bwd_fused_tma_kernel at `config`'s tiles: dQ summed in an fp32
    buffer, then cast to q's dtype."""
    T, H, d_qk = q.shape
    warp_specialize = ATTENTION_WARP_SPECIALIZE["backward"]
    config = attention_descriptor_config(config, warp_specialize)
    dq = torch.zeros(T, H, d_qk, dtype=torch.float32, device=q.device)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _set_tma_allocator(q.device)
    _launch(_attn_bwd_fused_tma_kernel, attention_grid(T, config.block_n, H), config,
            q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=o, do_ptr=grad_o, lse_ptr=lse, dq_ptr=dq, dk_ptr=dk, dv_ptr=dv,
            doc_end_ptr=doc_end, scale_ptr=scale,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
            stride_dot=grad_o.stride(0), stride_doh=grad_o.stride(1), stride_dqt=dq.stride(0), stride_dqh=dq.stride(1),
            stride_dkt=dk.stride(0), stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1),
            num_tokens=T, window=window, D_QK=d_qk, D_V=v.shape[2], BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            DQ_DESCRIPTOR=_descriptor_reductions(), WARP_SPECIALIZE=warp_specialize)
    return dq.to(q.dtype), dk, dv


def _attention_backward_candidates(args, configs, head_windows=None):
    """The backward's implementations, the rule first: the one-kernel backward (atomic dQ) at the
    window's tiles and at the other window class's, its descriptor variant at both (where the
    layouts allow), the deterministic two-kernel backward (last: the others' check)."""
    tiles = attention_candidate_tiles(configs, 4)
    found = [kernel_choice.Candidate(f"atomic {_tile_name(c)}",
                                     functools.partial(_run_attn_bwd_fused, *args, c, head_windows=head_windows))
             for c in tiles]
    if head_windows is None and _descriptor_layout_ok(*args[:5]):   # (no per-head truncation in it)
        found += [kernel_choice.Candidate(f"tma atomic {_tile_name(c)}",
                                          functools.partial(_run_attn_bwd_fused_tma, *args, c)) for c in tiles]
    found.append(kernel_choice.Candidate("deterministic", functools.partial(_run_attn_bwd_two_kernels, *args,
                                                                            *configs[1:4], head_windows=head_windows)))
    return found


def _launch_attn_bwd(grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, doc_start: Tensor,
                     doc_end: Tensor, scale: Tensor, window: int, configs: list[int],
                     impl: str = "deterministic", head_windows: Optional[Tensor] = None
                     ) -> tuple[Tensor, Tensor, Tensor]:
    configs = _configs_from_list(configs, ATTENTION_CONFIG_COUNT)
    args = (grad_o, q, k, v, o, lse, doc_start, doc_end, scale, window)
    if impl == "deterministic":
        return _run_attn_bwd_two_kernels(*args, *configs[1:4], head_windows=head_windows)
    if impl == "tma" and head_windows is None and _descriptor_layout_ok(grad_o, q, k, v, o):
        return _run_attn_bwd_fused_tma(*args, configs[4])
    if impl != "auto":
        return _run_attn_bwd_fused(*args, configs[4], head_windows=head_windows)
    candidates = _attention_backward_candidates(args, configs, head_windows)
    # checked against the deterministic backward (tested against float64 on a CPU)
    check = kernel_choice.lazy_check(candidates[-1].run, ATTENTION_CHOICE_TOLERANCE, "attention gradients")
    key = _attention_key(q, v, window) + (("truncated",) if head_windows is not None else ())
    return kernel_choice.choose("attention_backward", key, candidates, check).run()


_attn_fwd_op = torch.library.custom_op(f"{_OPS}::attn_fwd", _launch_attn_fwd, mutates_args=())
_attn_bwd_op = torch.library.custom_op(f"{_OPS}::attn_bwd", _launch_attn_bwd, mutates_args=())


@_attn_fwd_op.register_fake
def _(q, k, v, doc_start, doc_end, scale, window, configs, impl="rule"):
    _check_attention_dtypes(q, k, v)
    T, H, _ = q.shape
    return q.new_empty(T, H, v.shape[2]), q.new_empty(H, T, dtype=torch.float32)


@_attn_bwd_op.register_fake
def _(grad_o, q, k, v, o, lse, doc_start, doc_end, scale, window, configs, impl="deterministic", head_windows=None):
    _check_attention_dtypes(q, k, v, grad_o)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _FlashAttention(torch.autograd.Function):
    """Differentiable flash attention: forward saves the log-sum-exp, backward recomputes P."""

    @staticmethod
    def forward(ctx, q, k, v, doc_start, doc_end, scale, window, configs, impl, head_windows=None):
        o, lse = _attn_fwd_op(q, k, v, doc_start, doc_end, scale, window, configs, _FORWARD_IMPL[impl])
        ctx.save_for_backward(q, k, v, o, lse, doc_start, doc_end, scale)
        ctx.args = (window, configs, _BACKWARD_IMPL[impl])
        ctx.head_windows = head_windows
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, o, lse, doc_start, doc_end, scale = ctx.saved_tensors
        if ctx.head_windows is None:
            dq, dk, dv = _attn_bwd_op(_last_dim_contiguous(grad_o), q, k, v, o, lse, doc_start, doc_end, scale,
                                      *ctx.args)
        else:
            dq, dk, dv = _attn_bwd_op(_last_dim_contiguous(grad_o), q, k, v, o, lse, doc_start, doc_end, scale,
                                      *ctx.args, ctx.head_windows)
        return dq, dk, dv, None, None, None, None, None, None, None


def _last_dim_contiguous(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_attention_dtypes(*tensors, name="flash_attn_varlen"):
    """One dtype for q, k, v (and dO) that the tensor cores take; fp32 only off the GPU."""
    dtypes = {t.dtype for t in tensors}
    dtype = tensors[0].dtype
    if len(dtypes) != 1 or dtype not in ATTENTION_DTYPES:
        raise ValueError(f"{name} needs q, k and v (and their gradient) in one dtype of "
                         f"{ATTENTION_DTYPES}; got {[str(t.dtype) for t in tensors]}: cast them before the call")
    if dtype == torch.float32 and tensors[0].device.type == "cuda":
        raise ValueError(f"{name} takes bf16 or fp16 on the GPU (fp32 tiles do not fit in shared "
                         "memory): cast q, k and v to bf16")


def _check_attention_inputs(q, k, v, cu_seqlens, scale):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"flash_attn_varlen needs q, k (T, H, Dqk) and v (T, H, Dv); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    for d in (q.shape[2], v.shape[2]):
        if d not in ATTENTION_HEAD_DIMS:
            raise ValueError(f"flash_attn_varlen supports head dims {ATTENTION_HEAD_DIMS}; got {d}")
    _check_attention_dtypes(q, k, v)
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise ValueError("cu_seqlens must be a 1-d int32 tensor of document offsets")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError("the softmax scale must be a number or a one-element float32 tensor")


def softmax_scale_tensor(softmax_scale, device):
    """The softmax scale as the one-element fp32 tensor the kernels read (a tensor is used as is)."""
    if isinstance(softmax_scale, Tensor):
        return softmax_scale.reshape(-1)
    return torch.full((1,), float(softmax_scale), dtype=torch.float32, device=device)


def document_bounds(cu_seqlens, num_tokens):
    """(doc_start, doc_end): int32 (T,), the first token of each token's document and one past
    its last (cu_seqlens may end in repeats of T)."""
    doc = document_ids(cu_seqlens, num_tokens)
    return cu_seqlens[doc], cu_seqlens[doc + 1]


def flash_attn_varlen(q, k, v, cu_seqlens, window, softmax_scale, configs=None, impl=None, backward_windows=None):
    """Causal attention over packed documents, limited to a sliding window (see
    attention_reference for the semantics); differentiable.

    q, k (T, H, Dqk) and v (T, H, Dv), one dtype (bf16 on the GPU), Dqk, Dv in
    ATTENTION_HEAD_DIMS, any token and head strides; cu_seqlens int32 (num_docs + 1,), possibly
    padded at the end by repeating T; window in tokens (<= 0: no limit); softmax_scale a number
    or a one-element fp32 tensor (read by the kernels on the device: changing it recompiles
    nothing). fp32 softmax state; the matmuls run on the tensor cores in the inputs' dtype (P
    and dS are rounded to it). configs: the ATTENTION_CONFIG_COUNT launch configs (forward,
    dK/dV, dQ, delta, one-kernel backward; default: the window's, attention_configs). impl: one of
    ATTENTION_IMPLS; None: "rule" with explicit configs, else "auto". With the one-kernel backward
    ("atomic", and "auto" or "rule" where it is chosen) dQ is summed by atomic adds in an order that
    varies from run to run: the gradients are not reproducible bit for bit ("deterministic" is).
    backward_windows: None (the exact backward) or (H,) ints, each head's truncated backward
    window in tokens (backward_window_table): its dQ, dK, dV from the pairs less than that far
    apart only, with P from the full window's forward (attention_truncated_reference states it).
    """
    scale = softmax_scale_tensor(softmax_scale, q.device)
    _check_attention_inputs(q, k, v, cu_seqlens, scale)
    impl = impl or ("rule" if configs is not None else "auto")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"flash_attn_varlen: impl must be one of {ATTENTION_IMPLS}; got {impl!r}")
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    doc_start, doc_end = document_bounds(cu_seqlens, q.shape[0])
    window = window if window > 0 else NO_WINDOW
    configs = tuple(configs or attention_configs(window))
    if len(configs) != ATTENTION_CONFIG_COUNT:
        raise ValueError(f"flash_attn_varlen takes {ATTENTION_CONFIG_COUNT} launch configs (forward, dK/dV, dQ, "
                         f"delta, one-kernel backward); got {len(configs)}")
    flat_configs = [value for config in configs for value in config.as_list()]
    if backward_windows is None:
        return _FlashAttention.apply(q, k, v, doc_start, doc_end, scale, window, flat_configs, impl)
    head_windows = backward_window_table(backward_windows, q.shape[1], q.device)
    return _FlashAttention.apply(q, k, v, doc_start, doc_end, scale, window, flat_configs, impl, head_windows)


def backward_window_table(backward_windows, num_heads, device):
    """The kernels' per-head backward windows: int32 (num_heads,) on `device`, each in [1, NO_WINDOW]
    (<= 0, or beyond the forward's window: the head's backward is exact)."""
    table = torch.as_tensor(backward_windows, device=device).reshape(-1)
    if table.numel() != num_heads:
        raise ValueError(f"backward_windows: one window per head ({num_heads}); got {table.numel()}")
    table = table.to(torch.int64)
    return torch.where(table > 0, table.clamp(max=NO_WINDOW), NO_WINDOW).to(torch.int32).contiguous()


def document_ids(cu_seqlens, num_tokens):
    """Index of the document each packed token belongs to (cu_seqlens may end in repeats)."""
    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    # the whole offsets, not cu_seqlens[1:]: a view 4 bytes in would make every result unaligned
    return torch.searchsorted(cu_seqlens, positions, right=True) - 1


# Eager in a compiled model: its query blocks start where the documents' offsets say, values
# that a static graph cannot depend on.
@runs_eagerly
def attention_reference(q, k, v, cu_seqlens, window, softmax_scale, backward_windows=None):
    """Causal attention over packed documents, limited to a sliding window.

    q, k: (T, H, Dqk); v: (T, H, Dv); cu_seqlens: int32 document offsets (0, ..., T), possibly
    padded at the end by repeating T. Key j is visible to query i when both lie in the same
    document, j <= i and i - j < window (window <= 0: no limit). softmax_scale: a number, or a
    one-element tensor, which is then applied to q (rounded once to q's dtype) before scores
    are formed. Returns (T, H, Dv) in q's dtype.

    Works block by block over queries so that memory stays O(block * (window + block)) instead
    of O(T^2); each block attends to the keys from the earliest visible position to its end.
    backward_windows: as flash_attn_varlen's (the truncated backward, _TruncatedAttention).
    """
    if isinstance(softmax_scale, Tensor):
        q = (q.float() * softmax_scale.float().reshape(())).to(q.dtype)
        softmax_scale = 1.0
    if backward_windows is not None:
        table = backward_window_table(backward_windows, q.shape[1], q.device)
        return _TruncatedAttention.apply(q, k, v, cu_seqlens, window, float(softmax_scale), table)
    out = []
    for s, e, lo, visible, _ in _reference_blocks(cu_seqlens, q.shape[0], window, q.device):
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[lo:e].transpose(0, 1), v[lo:e].transpose(0, 1),
            attn_mask=visible, scale=softmax_scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out).to(q.dtype)


def _reference_blocks(cu_seqlens, T, window, device):
    """(s, e, lo, visible) of attention_reference's query blocks: queries [s, e) see keys [lo, e)
    where `visible` (e - s, e - lo) says."""
    doc = document_ids(cu_seqlens, T)
    doc_start = cu_seqlens.long()[doc]
    pos = torch.arange(T, device=device)
    for s in range(0, T, REFERENCE_QUERY_BLOCK):
        e = min(s + REFERENCE_QUERY_BLOCK, T)
        lo = int(doc_start[s])
        if window > 0:
            lo = max(lo, s - window + 1)
        qi, kj = pos[s:e, None], pos[None, lo:e]
        visible = (doc[s:e, None] == doc[None, lo:e]) & (kj <= qi)
        if window > 0:
            visible &= qi - kj < window
        yield s, e, lo, visible, qi - kj


class _TruncatedAttention(torch.autograd.Function):
    """attention_reference's forward; its backward truncated per head (the kernels' HEAD_WINDOWS).

    Per query block: S = scale Q K^T over the visible keys, P = softmax(S) (the full window's),
    O = P V, delta = rowsum(dO * O). With M the pairs of head h less than head_windows[h] apart:
    dV = (M P)^T dO, dS = M P (dO V^T - delta), dQ = scale dS K, dK = scale dS^T Q. Where M
    keeps every visible pair this is the exact backward; where it drops some, the kept pairs'
    P are not renormalized. Scores in fp32 (float64 for float64 inputs); memory O(H x block x
    (window + block)) a block."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, window, scale, head_windows):
        ctx.save_for_backward(q, k, v, cu_seqlens, head_windows)
        ctx.window, ctx.scale = window, scale
        return attention_reference(q, k, v, cu_seqlens, window, scale)

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, cu_seqlens, head_windows = ctx.saved_tensors
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf, gf = (t.to(work) for t in (q, k, v, grad_o))
        dq, dk, dv = torch.zeros_like(qf), torch.zeros_like(kf), torch.zeros_like(vf)
        for s, e, lo, visible, distance in _reference_blocks(cu_seqlens, q.shape[0], ctx.window, q.device):
            scores = torch.einsum("ihd,jhd->hij", qf[s:e], kf[lo:e]) * ctx.scale
            p = scores.masked_fill(~visible[None], float("-inf")).softmax(-1).nan_to_num(0.0)
            o = torch.einsum("hij,jhd->ihd", p, vf[lo:e])
            delta = (gf[s:e] * o).sum(-1)                              # (i, h)
            kept = p * (distance[None] < head_windows.long()[:, None, None])
            dv[lo:e] += torch.einsum("hij,ihd->jhd", kept, gf[s:e])
            dp = torch.einsum("ihd,jhd->hij", gf[s:e], vf[lo:e])
            ds = kept * (dp - delta.t()[:, :, None]) * ctx.scale
            dq[s:e] += torch.einsum("hij,jhd->ihd", ds, kf[lo:e])
            dk[lo:e] += torch.einsum("hij,ihd->jhd", ds, qf[s:e])
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# ---------------------------------------------------------------------------------------------
# 3. Softcapped cross-entropy with several weighted targets and optional column subsets
# ---------------------------------------------------------------------------------------------

SOFTCAP = 23.0        # logits are squashed into (0, SOFTCAP)
SOFTCAP_SHIFT = 5.0   # raw logit offset before the sigmoid
SOFTCAP_TEMP = 7.5    # sigmoid temperature: the slope at the centre is SOFTCAP / (4 * SOFTCAP_TEMP)

# One row per program, block_n columns per step.
CROSS_ENTROPY = LaunchConfig(block_m=1, block_n=4096, num_warps=8)
# Rows x columns per program of the backward's in-place row scaling.
CROSS_ENTROPY_SCALE = LaunchConfig(block_m=1, block_n=4096, num_warps=8)


@triton.jit
def _softcap_tile(x, SOFTCAP: tl.constexpr, SHIFT: tl.constexpr, TEMP: tl.constexpr):
    """SOFTCAP * sigmoid((x + SHIFT) / TEMP) of an fp32 tile."""
    return SOFTCAP * tl.sigmoid((x + SHIFT) / TEMP)


@triton.jit
def _softcap_ce_kernel(logits_ptr, grad_ptr, targets_ptr, weights_ptr, loss_ptr, next_loss_ptr, num_cols,
                       stride_lr, stride_gr, stride_tr, grad_scale_ptr, q_scale_ptr, amax_ptr,
                       p_copy_ptr, a_sink_ptr, copy_col_ptr, d_p_copy_ptr, d_a_sink_ptr,
                       NUM_TARGETS: tl.constexpr, TARGETS_PAD: tl.constexpr, SOFTCAP: tl.constexpr,
                       SHIFT: tl.constexpr, TEMP: tl.constexpr, BLOCK_C: tl.constexpr, WITH_GRAD: tl.constexpr,
                       Q_MAX: tl.constexpr, MIXTURE: tl.constexpr):
    """Loss and logit gradient of one row: z = softcap(x), lse = log sum exp z,
    loss = sum_k w_k (lse - z[t_k]), dloss/dx = (W softmax(z) - sum_k w_k onehot(t_k)) * dz/dx,
    with W = sum of the weights of the targets present among the columns; also the unweighted
    loss of the first target alone, lse - z[t_0] (0 when absent): the next-token loss. The
    gradient is stored times *grad_scale_ptr (one fp32 element: the upstream gradient the caller
    expects, read here so that a captured launch follows it; 1: none).

    Q_MAX > 0: the gradient is stored in fp8 (grad_ptr's dtype) as the FP8 head's backward GEMMs
    read it, g * (1 / q_scale) saturated to +-Q_MAX, and max |g| of the row is folded into
    *amax_ptr (q_scale_ptr, amax_ptr: one fp32 element each; unused when Q_MAX is 0).

    Two passes over the row: the first sums exp(z - SOFTCAP) (z < SOFTCAP, so no running max is
    needed), the second writes the gradient (WITH_GRAD only). Traffic: the row read twice (the
    second time mostly from L2), the gradient written once, targets and weights read once.

    MIXTURE (the pointer mixture, PR 379): the first target's term is -log p(y) of
    pointer_mixture_nll, p = p_full(y) (1 - a (1 - a_sink)) / (1 - a) + a p_copy with a =
    softmax(z)[copy] (column *copy_col_ptr; p_copy, a_sink per row). Its logit gradient is
    w0 (g_lse softmax + g_y onehot(y) + g_c onehot(copy)) with the row scalars
    g_y = -p_full B / ((1 - a) p), g_c = -a (p_full a_sink / (1 - a)^2 + p_copy) / p, g_lse = -(g_y + g_c),
    so the same two passes write it; d loss / d p_copy = -w0 a / p and d loss / d a_sink =
    -w0 a p_full / ((1 - a) p) are stored per row (for an upstream gradient of 1).
    """
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * stride_lr
    grad_ptr += row * stride_gr
    cols = tl.arange(0, BLOCK_C)

    sum_exp = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, num_cols, BLOCK_C):
        mask = start + cols < num_cols
        x = tl.load(logits_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        z = _softcap_tile(x, SOFTCAP, SHIFT, TEMP)
        sum_exp += tl.where(mask, tl.exp(z - SOFTCAP), 0.0)
    lse = SOFTCAP + tl.log(tl.sum(sum_exp, axis=0))

    k = tl.arange(0, TARGETS_PAD)
    targets = tl.load(targets_ptr + row * stride_tr + k, mask=k < NUM_TARGETS, other=-1)
    present = (targets >= 0) & (targets < num_cols)
    weights = tl.where(present, tl.load(weights_ptr + k, mask=k < NUM_TARGETS, other=0.0), 0.0)
    x_target = tl.load(logits_ptr + targets, mask=present, other=0.0).to(tl.float32)
    z_target = _softcap_tile(x_target, SOFTCAP, SHIFT, TEMP)
    hit_weights = weights
    weight_total = tl.sum(weights, axis=0)
    if MIXTURE:
        copy_col = tl.load(copy_col_ptr)
        alpha = tl.exp(_softcap_tile(tl.load(logits_ptr + copy_col).to(tl.float32), SOFTCAP, SHIFT, TEMP) - lse)
        present0 = tl.sum(tl.where((k == 0) & present, 1, 0), axis=0) > 0
        w0 = tl.sum(tl.where(k == 0, weights, 0.0), axis=0)                 # 0 when the first target is absent
        p_full = tl.exp(tl.sum(tl.where(k == 0, z_target, 0.0), axis=0) - lse)
        p_copy = tl.load(p_copy_ptr + row)
        a_sink = tl.load(a_sink_ptr + row)
        r = 1.0 / (1.0 - alpha)
        keep = 1.0 - alpha * (1.0 - a_sink)
        mixed = p_full * r * keep + alpha * p_copy
        inv = tl.where(present0, 1.0 / mixed, 0.0)
        nll0 = tl.where(present0, -tl.log(tl.where(present0, mixed, 1.0)), 0.0)
        g_y = -p_full * r * keep * inv
        g_c = -alpha * (p_full * a_sink * r * r + p_copy) * inv
        tl.store(loss_ptr + row, tl.sum(tl.where(k == 0, 0.0, weights * (lse - z_target)), axis=0) + w0 * nll0)
        tl.store(next_loss_ptr + row, nll0)
        tl.store(d_p_copy_ptr + row, -w0 * alpha * inv)
        tl.store(d_a_sink_ptr + row, -w0 * alpha * p_full * r * inv)
        hit_weights = tl.where(k == 0, -w0 * g_y, weights)
        weight_total = weight_total - w0 - w0 * (g_y + g_c)
        copy_weight = -w0 * g_c
    else:
        tl.store(loss_ptr + row, tl.sum(weights * (lse - z_target), axis=0))
        tl.store(next_loss_ptr + row, tl.sum(tl.where((k == 0) & present, lse - z_target, 0.0), axis=0))
    if not WITH_GRAD:
        return

    grad_scale = tl.load(grad_scale_ptr)
    if Q_MAX > 0:
        inv_q_scale = tl.div_rn(1.0, tl.load(q_scale_ptr))
    amax = tl.zeros((BLOCK_C,), dtype=tl.float32)
    for start in range(0, num_cols, BLOCK_C):
        mask = start + cols < num_cols
        x = tl.load(logits_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        z = _softcap_tile(x, SOFTCAP, SHIFT, TEMP)
        hits = tl.sum(tl.where((start + cols)[:, None] == targets[None, :], hit_weights[None, :], 0.0), axis=1)
        if MIXTURE:
            hits += tl.where(start + cols == copy_col, copy_weight, 0.0)
        grad_z = weight_total * tl.exp(z - lse) - hits
        # dz/dx = SOFTCAP * s (1 - s) / TEMP with s = z / SOFTCAP
        grad = grad_z * z * (1.0 - z / SOFTCAP) / TEMP * grad_scale
        if Q_MAX > 0:
            amax = tl.maximum(amax, tl.where(mask, tl.abs(grad), 0.0))
            grad = tl.clamp(grad * inv_q_scale, -Q_MAX, Q_MAX)
        tl.store(grad_ptr + start + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)
    if Q_MAX > 0:
        tl.atomic_max(amax_ptr, tl.max(amax, axis=0))


@triton.jit
def _scale_rows_kernel(x_ptr, factor_ptr, num_cols, stride_xr, BLOCK_C: tl.constexpr):
    """x[r, :] *= factor[r] in place, in fp32, for one row and one block of columns per program.
    A row whose factor is exactly 1 is left as it is. Traffic: the factors read once, each row
    with another factor read and written once."""
    row = tl.program_id(0).to(tl.int64)
    factor = tl.load(factor_ptr + row)
    if factor != 1.0:
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = cols < num_cols
        x_ptrs = x_ptr + row * stride_xr + cols
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptrs, (x * factor).to(x_ptr.dtype.element_ty), mask=mask)


def _launch_ce_kernel(logits, targets, weights, grad, grad_scale, q_scale, amax, q_max, config, mixture=None):
    """(loss, next_loss), and with `mixture` = (p_copy, a_sink, copy_col) also (d_p_copy, d_a_sink)."""
    N, C = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    next_loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    extra = {}
    if mixture is not None:
        d_p_copy, d_a_sink = torch.empty_like(loss), torch.empty_like(loss)
        extra = dict(p_copy_ptr=mixture[0], a_sink_ptr=mixture[1], copy_col_ptr=mixture[2], d_p_copy_ptr=d_p_copy,
                     d_a_sink_ptr=d_a_sink, MIXTURE=True)
    else:
        extra = dict(p_copy_ptr=loss, a_sink_ptr=loss, copy_col_ptr=loss, d_p_copy_ptr=loss, d_a_sink_ptr=loss,
                     MIXTURE=False)
    _launch(_softcap_ce_kernel, (N,), config,
            logits_ptr=logits, grad_ptr=grad, targets_ptr=targets, weights_ptr=weights, loss_ptr=loss,
            next_loss_ptr=next_loss, num_cols=C, stride_lr=logits.stride(0), stride_gr=grad.stride(0),
            stride_tr=targets.stride(0), grad_scale_ptr=grad_scale, q_scale_ptr=q_scale, amax_ptr=amax,
            NUM_TARGETS=targets.shape[1], TARGETS_PAD=triton.next_power_of_2(targets.shape[1]),
            SOFTCAP=SOFTCAP, SHIFT=SOFTCAP_SHIFT, TEMP=SOFTCAP_TEMP, BLOCK_C=config.block_n,
            WITH_GRAD=grad.shape[0] > 0, Q_MAX=q_max, **extra)
    if mixture is not None:
        return loss, next_loss, d_p_copy, d_a_sink
    return loss, next_loss


def _launch_softcap_ce(logits: Tensor, targets: Tensor, weights: Tensor, with_grad: bool, grad_scale: Tensor,
                       config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    N, C = logits.shape
    grad = torch.empty((N, C) if with_grad else (0, C), dtype=logits.dtype, device=logits.device)
    loss, next_loss = _launch_ce_kernel(logits, targets, weights, grad, grad_scale, weights, weights, 0.0,
                                        _config_from_list(config))
    return loss, next_loss, grad


def _launch_softcap_ce_fp8(logits: Tensor, targets: Tensor, weights: Tensor, grad_scale: Tensor, q_scale: Tensor,
                           amax: Tensor, fp8_dtype: torch.dtype, config: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    grad = torch.empty(logits.shape, dtype=fp8_dtype, device=logits.device)
    loss, next_loss = _launch_ce_kernel(logits, targets, weights, grad, grad_scale, q_scale, amax,
                                        _FP8_MAX[fp8_dtype], _config_from_list(config))
    return loss, next_loss, grad


def _launch_scale_rows_(x: Tensor, factor: Tensor, config: list[int]) -> None:
    config = _config_from_list(config)
    _launch(_scale_rows_kernel, (x.shape[0], triton.cdiv(x.shape[1], config.block_n)), config,
            x_ptr=x, factor_ptr=factor, num_cols=x.shape[1], stride_xr=x.stride(0), BLOCK_C=config.block_n)


_softcap_ce_op = torch.library.custom_op(f"{_OPS}::softcap_ce", _launch_softcap_ce, mutates_args=())
_softcap_ce_fp8_op = torch.library.custom_op(f"{_OPS}::softcap_ce_fp8", _launch_softcap_ce_fp8,
                                             mutates_args=("amax",))
_scale_rows_op = torch.library.custom_op(f"{_OPS}::scale_rows_", _launch_scale_rows_, mutates_args=("x",))


@_softcap_ce_op.register_fake
def _(logits, targets, weights, with_grad, grad_scale, config):
    N, C = logits.shape
    return (logits.new_empty(N, dtype=torch.float32), logits.new_empty(N, dtype=torch.float32),
            logits.new_empty((N, C) if with_grad else (0, C)))


@_scale_rows_op.register_fake
def _(x, factor, config):
    return None


@_softcap_ce_fp8_op.register_fake
def _(logits, targets, weights, grad_scale, q_scale, amax, fp8_dtype, config):
    N, C = logits.shape
    return (logits.new_empty(N, dtype=torch.float32), logits.new_empty(N, dtype=torch.float32),
            logits.new_empty((N, C), dtype=fp8_dtype))


class _SoftcapCrossEntropy(torch.autograd.Function):
    """The forward computes loss and logit gradient together (the gradient only when the logits
    require one), the gradient times grad_scale (one fp32 element on the device); backward scales
    the saved gradient's rows in
    place by upstream gradient / grad_scale, skipping the rows where that is exactly 1, and
    returns it. Correct for any upstream gradient; with the one the caller announced (a uniform
    grad_scale), no row is read or written again. The saved gradient is modified in place, so
    a second backward through the same forward fails autograd's version check (in eager mode).
    Under torch.compile, functionalization copies the saved gradient before the in-place op (one
    pass over it); a caller that knows its upstream gradient is grad_scale (exact_upstream: the
    trainer's objective) gets the saved gradient handed on with no op at all, compiled or not.
    The next-token loss is a by-product for logging, not differentiable."""

    @staticmethod
    def forward(ctx, logits, targets, weights, grad_scale, config, scale_config, exact_upstream):
        loss, next_loss, grad = _softcap_ce_op(logits, targets, weights, ctx.needs_input_grad[0], grad_scale,
                                               config)
        ctx.save_for_backward(grad, grad_scale)
        ctx.scale_config, ctx.exact_upstream = scale_config, exact_upstream
        ctx.mark_non_differentiable(next_loss)
        return loss, next_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_next_loss):
        grad, grad_scale = ctx.saved_tensors
        if not ctx.exact_upstream:
            _scale_rows_op(grad, (grad_loss.float() / grad_scale).contiguous(), ctx.scale_config)
        return grad, None, None, None, None, None, None


def softcap_cross_entropy(logits, targets, weights, config=CROSS_ENTROPY, scale_config=CROSS_ENTROPY_SCALE,
                          grad_scale=1.0, exact_upstream=False):
    """Per-row weighted softcapped cross-entropy (see softcap_cross_entropy_reference), with the
    gradient with respect to the logits computed in the forward pass when the logits require
    one (a (N, C) buffer in the logits' dtype, kept until backward, which scales it in place and
    hands it on). logits (N, C) with unit column stride, for all vocabulary columns or a
    candidate subset; targets (N, K) int64 column indices (outside [0, C): no target); weights
    (K,). Returns (loss, next_token_loss), both (N,) fp32; only the first is differentiable.

    grad_scale (a nonzero finite number, or a one-element floating-point tensor on the logits'
    device that holds one): the upstream gradient the caller expects for every row of the loss,
    e.g. 1 / (N x micro-batches) for a mean over the tokens of each of the step's micro-batches.
    A tensor is read on the device when the kernel runs, so a compiled or captured step follows
    the value it holds then (the trainer's loss unit). The forward stores the gradient times it
    (one rounding instead of two), so the backward passes over the (N, C) gradient only for rows
    whose upstream gradient differs; any upstream gradient gives the right result. exact_upstream=True is the caller's promise
    that every row's upstream gradient is grad_scale: the backward then hands the stored
    gradient on without looking (another upstream gradient would go unseen)."""
    _check_cross_entropy_inputs(logits.shape, targets, weights, grad_scale)
    logits = _last_dim_contiguous(logits)
    targets = _last_dim_contiguous(targets.long())
    return _SoftcapCrossEntropy.apply(logits, targets, weights.float().contiguous(),
                                      device_scalar(grad_scale, logits.device), config.as_list(),
                                      scale_config.as_list(), bool(exact_upstream))


def _check_cross_entropy_inputs(logits_shape, targets, weights, grad_scale):
    if len(logits_shape) != 2 or targets.dim() != 2 or targets.shape[0] != logits_shape[0]:
        raise ValueError(f"softcap_cross_entropy needs logits (N, C) and targets (N, K); got "
                         f"{tuple(logits_shape)} and {tuple(targets.shape)}")
    if weights.shape != (targets.shape[1],):
        raise ValueError(f"softcap_cross_entropy needs one weight per target column; got {tuple(weights.shape)}")
    _check_grad_scale(grad_scale, "softcap_cross_entropy")


def _check_grad_scale(grad_scale, caller):
    """A number must be nonzero and finite; a tensor must be one floating-point element (its
    value is the device's: whoever fills it checks it)."""
    if isinstance(grad_scale, torch.Tensor):
        if grad_scale.numel() != 1 or not grad_scale.is_floating_point():
            raise ValueError(f"{caller}: a grad_scale tensor must hold one floating-point element; got "
                             f"{tuple(grad_scale.shape)} {grad_scale.dtype}")
    elif not (math.isfinite(grad_scale) and grad_scale != 0):
        raise ValueError(f"{caller}: grad_scale must be a nonzero finite number; got {grad_scale}")


def device_scalar(value, device):
    """`value` as one fp32 element on `device`: a one-element fp32 tensor as it is (a view), one
    of another dtype converted, a number as a new tensor."""
    if isinstance(value, torch.Tensor):
        return value.reshape(1).float()
    return torch.full((1,), value, dtype=torch.float32, device=device)


# The FP8 head and the cross-entropy in one: the logit gradient written once, in e5m2.

def _weight_gradient_operands(saved, g8, sample_rows=None):
    """(saved, g8_t): an FP8 head's forward state and the transposed e5m2 logit gradient its
    weight-gradient GEMM reads; with sample_rows only those rows of both (x8^T's columns, g8's
    rows: rows x K and rows x N bytes instead of T x K and T x N)."""
    if sample_rows is None:
        return saved, transpose(g8)
    return (_gather_columns(saved[0], sample_rows), *saved[1:]), transpose(_gather_rows(g8, sample_rows))


class _FP8HeadCrossEntropy(torch.autograd.Function):
    """softcap_cross_entropy(fp8_linear(x, W)) for the objective's own upstream gradient. The
    forward is _FP8Linear's, then the cross-entropy kernel, which stores the logit gradient (for
    the upstream gradient grad_scale on every row) straight in e5m2 at the head's gradient scale,
    and a transpose kernel copies it for the weight gradient; the backward is the two gradient
    GEMMs. Against fp8_linear followed by softcap_cross_entropy this saves writing the gradient
    in bf16 and reading it again to cast it (2 x 2 bytes an element, of 4 + 2); the gradient is
    rounded once, from fp32 to e5m2, instead of through bf16.
    With sample_rows (the sampled weight gradient, sampled_linear): the transpose kernel copies only
    the sampled rows of the gradient (reads and writes rows x N bytes where the exact one moves
    T x N each way, after a gather of rows x N), the forward keeps the sampled columns of x8^T,
    and the weight-gradient GEMM reduces over T / stride rows at the gradient's scale times stride."""

    @staticmethod
    def forward(ctx, x, weight, state, targets, weights, grad_scale, scales, prims, config, ce_config,
                sample_rows=None, stride=1):
        logits, saved = _fp8_linear_forward(x, weight, state, scales, prims, config)
        g_scale, g_amax = _operand_scale(state, FP8_LINEAR_SLOTS, scales.grad_output, "grad_output", FP8_E5M2_MAX,
                                         None)
        loss, next_loss, g8 = _softcap_ce_fp8_op(logits, targets, weights, grad_scale, g_scale, g_amax,
                                                 torch.float8_e5m2, ce_config)
        saved, g8_t = _weight_gradient_operands(saved, g8, sample_rows)
        ctx.save_for_backward(*saved, g8, g8_t, g_scale)
        ctx.prims, ctx.config, ctx.dtypes, ctx.stride = prims, config, (x.dtype, weight.dtype), stride
        ctx.mark_non_differentiable(next_loss)
        return loss, next_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_next_loss):
        *saved, g8, g8_t, g_scale = ctx.saved_tensors
        grad_x, grad_w = _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale, ctx.stride)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None


def fp8_head_cross_entropy(x, weight, state, targets, weights, grad_scale, config=None, ce_config=CROSS_ENTROPY,
                           scales=HEAD_SCALES, gemm="fastest", casts="kernel", sample=None):
    """softcap_cross_entropy(fp8_linear(x, weight, state, scales=scales), targets, weights,
    grad_scale=grad_scale, exact_upstream=True) with its logit gradient written once, in e5m2
    (_FP8HeadCrossEntropy): (loss, next_token_loss), both (N,) fp32. The caller promises that
    every row's upstream gradient is grad_scale (the trainer's objective); the gradient scale
    must not need the gradient itself (a Static or Delayed rule). Without a gradient to take
    (no grad mode, or neither x nor weight requiring one) it is the two functions composed.
    gemm, casts and sample (the sampled weight gradient) as in fp8_linear."""
    _check_fp8_state(state, FP8_LINEAR_SLOTS, "new_fp8_linear_state")
    _check_scales(scales, FP8LinearScales)
    if not isinstance(scales.grad_output, (Static, Delayed)):
        raise ValueError("fp8_head_cross_entropy: the gradient's scale rule must be Static or Delayed (the "
                         "cross-entropy writes the gradient in fp8 as it computes it)")
    _check_cross_entropy_inputs((x.shape[0], weight.shape[0]), targets, weights, grad_scale)
    targets = _last_dim_contiguous(targets.long())
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        logits = fp8_linear(x, weight, state, config, scales, gemm, casts)
        return softcap_cross_entropy(logits, targets, weights, ce_config, grad_scale=grad_scale, exact_upstream=True)
    return _FP8HeadCrossEntropy.apply(x, weight, state, targets, weights.float().contiguous(),
                                      device_scalar(grad_scale, x.device), scales, _PRIMITIVES[gemm, casts], config,
                                      ce_config.as_list(), *_sample_args(sample))


def softcap(logits):
    """SOFTCAP * sigmoid((z + SOFTCAP_SHIFT) / SOFTCAP_TEMP), in fp32."""
    return SOFTCAP * torch.sigmoid((logits.float() + SOFTCAP_SHIFT) / SOFTCAP_TEMP)


def softcap_cross_entropy_reference(logits, targets, weights, grad_scale=1.0, exact_upstream=False):
    """Per-row weighted sum of softcapped cross-entropies over the given columns.

    logits: (N, C), the head's raw outputs for C vocabulary columns (all of them, or a sampled
    candidate subset). targets: (N, K) int64 column indices into those C columns; an index
    outside [0, C) (-1 by convention) marks a target that is absent or not among the columns,
    and it contributes nothing. weights: (K,) float.
    Returns (loss, next_token_loss), both (N,) fp32: loss = sum_k weights[k] * (logsumexp(z) -
    z[targets[:, k]]) with z = softcap(logits), and the unweighted loss of the first target alone
    (0 where it is absent), detached. grad_scale and exact_upstream: softcap_cross_entropy's
    hints, which change no result (accepted so that the functions are interchangeable).
    """
    z = softcap(logits)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    present = (targets >= 0) & (targets < z.shape[1])
    picked = z.gather(1, torch.where(present, targets, 0))
    losses = torch.where(present, lse - picked, torch.zeros_like(picked))
    # An elementwise product, not a matmul: autocast would run a matmul (and its sum) in bf16.
    return (losses * weights.to(losses)).sum(dim=1), losses[:, 0].detach()


CHUNKED_CE_ROWS = 8   # rows per block of the CPU cross-entropy: two 8 x 50,304 fp32 scratch blocks = 3.2 MB, in L2


class _ChunkedSoftcapCrossEntropy(torch.autograd.Function):
    """softcap_cross_entropy's algorithm in plain torch, for CPUs: the forward walks the rows in
    blocks of `rows` and, per block, computes the loss and, when the logits require a gradient,
    the logit gradient times grad_scale, in two fp32 scratch blocks reused from block to block
    (cache-sized: no (N, C) temporary), so autograd keeps one (N, C) gradient in the logits'
    dtype. The softcap is written with tanh, which costs a CPU less than a sigmoid:
        z = SOFTCAP * sigmoid(u) = H * (1 + tanh(u / 2)),   u = (logits + SOFTCAP_SHIFT) / SOFTCAP_TEMP,
        H = SOFTCAP / 2,   dz/dlogits = H / (2 SOFTCAP_TEMP) * (1 - tanh(u / 2)^2).
    z lies in (0, SOFTCAP), so exp(z - H) cannot overflow and its row sum needs no max
    subtraction; the exponentials are reused for softmax. With a = sum_k weights[k] over the
    present targets:
        dloss/dz = a * softmax(z) - sum_k weights[k] * onehot(targets[:, k]).
    With a pointer mixture (copy_col, p_copy, a_sink: pointer_mixture_cross_entropy's), the first
    target's term is the mixture's -log p(y) = -log(p_lm(y) (1 - alpha (1 - a_sink)) + alpha p_copy),
    alpha = softmax(z)[copy], p_lm the softmax over the other columns. In the block's exponentials,
    t = sum over the columns but <copy>, e_c at <copy>, e_y at y (both formed before the loop from
    the two logits a row needs), u = e_y + e_c p_copy, v = e_y e_c a_sink and n = t u + v:
        p(y) = n / (t (t + e_c)),
        dloss/dz = w0 ((1 + v (t + e_c) / (t n)) softmax(z) - e_y (t + e_c a_sink) / n onehot(y)
                       - (e_c p_copy t + v + e_c v / t) / n onehot(copy)),
        dloss/dp_copy = -w0 e_c t / n,   dloss/da_sink = -w0 e_c e_y / n,
    every term a sum of positives (t excludes <copy>: no 1 - alpha by cancellation), and all but
    the logit gradient computed once, over the whole rows, after the loop.
    Passes per block: one read of the logits, 10 over the two scratch blocks, one write of the
    gradient. The backward returns the stored gradient itself when the upstream gradient is
    grad_scale on every row (the trainer's mean), else a scaled copy.
    """

    @staticmethod
    def forward(ctx, logits, targets, weights, rows, grad_scale, exact_upstream, copy_col=None, p_copy=None,
                a_sink=None):
        num_rows, num_cols = logits.shape
        present = (targets >= 0) & (targets < num_cols)
        columns = torch.where(present, targets, 0)
        target_weights = torch.where(present, weights.float(), 0.0)   # (N, K): absent targets weigh 0
        half = SOFTCAP / 2
        slope = grad_scale * half / (2 * SOFTCAP_TEMP)                  # dz/dlogits at tanh = 0, times grad_scale

        def exp_z(x):                                                   # exp(z - H) of raw logits, in place
            return x.add_(SOFTCAP_SHIFT).mul_(0.5 / SOFTCAP_TEMP).tanh_().mul_(half).exp_()

        mixture = copy_col is not None
        if mixture:   # the first target's weight moves to the mixture's terms: w0 below
            w0 = target_weights[:, :1].clone()
            target_weights[:, 0] = 0.0
            e_c = exp_z(logits.index_select(1, copy_col).float())
            e_y = exp_z(logits.gather(1, columns[:, :1]).float())
            q = p_copy.float()[:, None]
            u = e_y + e_c * q
            v = e_y * e_c * a_sink.float()[:, None]
            w0_v, w0_e_y, e_c_q, e_c_v = w0 * v, w0 * e_y, e_c * q, e_c * v
            e_c_sink = e_c * a_sink.float()[:, None]
            t_rows = torch.empty_like(e_c)
        loss = torch.empty(num_rows, device=logits.device, dtype=torch.float32)
        next_loss = torch.empty(num_rows, device=logits.device, dtype=torch.float32)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        th_block = torch.empty(min(rows, num_rows), num_cols, device=logits.device, dtype=torch.float32)
        e_block = torch.empty_like(th_block)
        for s in range(0, num_rows, rows):
            e = min(s + rows, num_rows)
            th, ex = th_block[:e - s], e_block[:e - s]
            th.copy_(logits[s:e]).add_(SOFTCAP_SHIFT).mul_(0.5 / SOFTCAP_TEMP).tanh_()
            torch.mul(th, half, out=ex).exp_()                          # exp(z - H)
            if mixture:
                t = ex.index_fill_(1, copy_col, 0.0).sum(dim=1, keepdim=True)
                ex.index_copy_(1, copy_col, e_c[s:e])
                t_rows[s:e] = t
                total = t + e_c[s:e]
            else:
                total = ex.sum(dim=1, keepdim=True)
            w = target_weights[s:e]
            th_targets = th.gather(1, columns[s:e])
            per_target = total.log() - half * th_targets                # log sum exp(z) - z at each target
            loss[s:e] = (per_target * w).sum(dim=1)
            next_loss[s:e] = torch.where(present[s:e, 0], per_target[:, 0], 0.0)
            if grad is not None:
                a = w.sum(dim=1, keepdim=True)
                if mixture:
                    n = torch.addcmul(v[s:e], t, u[s:e])
                    a = a + w0[s:e] + w0_v[s:e] * total / (t * n)       # w0 g_lse
                    w = w.clone()
                    w[:, :1] = w0_e_y[s:e] * (t + e_c_sink[s:e]) / n    # minus w0 g_y: the scatter's sign
                ex.mul_(a * slope / total)                              # a * softmax(z) * slope
                ex.scatter_add_(1, columns[s:e], w * -slope)            # minus the weighted one-hot targets
                if mixture:                                             # plus w0 g_c at <copy>
                    ex.index_add_(1, copy_col, (w0[s:e] * -slope) * (torch.addcmul(v[s:e], t, e_c_q[s:e])
                                                                       .add_(e_c_v[s:e] / t) / n))
                ex.addcmul_(ex, th.mul_(th), value=-1.0)                # times 1 - tanh^2
                grad[s:e] = ex
        if mixture:
            n = torch.addcmul(v, t_rows, u)
            nll = torch.where(present[:, :1], t_rows.log() + (t_rows + e_c).log() - n.log(), 0.0)
            loss += (w0 * nll)[:, 0]
            next_loss = nll[:, 0]
            d_p_copy, d_a_sink = (-w0 * e_c * t_rows / n)[:, 0], (-w0 * e_c * e_y / n)[:, 0]
        ctx.save_for_backward(grad, *((d_p_copy, d_a_sink) if mixture else ()))
        ctx.rows, ctx.grad_scale, ctx.exact_upstream = rows, grad_scale, exact_upstream
        ctx.dtypes = (p_copy.dtype, a_sink.dtype) if mixture else None
        ctx.mark_non_differentiable(next_loss)
        return loss, next_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_next_loss):
        grad, *mixture = ctx.saved_tensors
        pointer_grads = (None, None, None)
        if mixture:
            upstream = grad_loss.float()
            pointer_grads = (None, (mixture[0] * upstream).to(ctx.dtypes[0]), (mixture[1] * upstream).to(ctx.dtypes[1]))
        if grad is None or ctx.exact_upstream or bool((grad_loss == ctx.grad_scale).all()):
            return grad, None, None, None, None, None, *pointer_grads
        scale = grad_loss.float()[:, None] / ctx.grad_scale
        out = torch.empty_like(grad)
        for s in range(0, grad.shape[0], ctx.rows):
            out[s:s + ctx.rows] = grad[s:s + ctx.rows].float().mul_(scale[s:s + ctx.rows])
        return out, None, None, None, None, None, *pointer_grads


def _chunked_grad_scale(grad_scale, device):
    return device_scalar(grad_scale, device) if isinstance(grad_scale, torch.Tensor) else float(grad_scale)


# Eager in a compiled model: its row loop is a memory plan. Inductor compiled it into one graph
# that ran a 24 GB machine out of memory on the cpu preset's 2,048 x 50,304 logits (measured).
@runs_eagerly
def softcap_cross_entropy_chunked(logits, targets, weights, rows=CHUNKED_CE_ROWS, grad_scale=1.0,
                                  exact_upstream=False):
    """softcap_cross_entropy for CPUs (same arguments and result), in row blocks with the
    gradient formed in the forward pass: on the CPU preset's 4096 x 50,304 logits it replaces
    the reference's chain of full-size fp32 tensors and their autograd copies. grad_scale, the
    upstream gradient the caller expects for every row (a number, or a one-element tensor),
    lets the backward hand the stored gradient on without a pass over it; any upstream gradient
    gives the right result."""
    _check_grad_scale(grad_scale, "softcap_cross_entropy_chunked")
    return _ChunkedSoftcapCrossEntropy.apply(logits, targets.long(), weights, rows,
                                             _chunked_grad_scale(grad_scale, logits.device), bool(exact_upstream))


@runs_eagerly
def pointer_mixture_cross_entropy_chunked(logits, targets, weights, copy_col, p_copy, a_sink, grad_scale=1.0,
                                          exact_upstream=False, rows=CHUNKED_CE_ROWS):
    """pointer_mixture_cross_entropy for CPUs (same arguments and result) by
    softcap_cross_entropy_chunked's row blocks: no (N, C) temporary beside the stored gradient;
    differentiable in logits, p_copy and a_sink."""
    _check_grad_scale(grad_scale, "pointer_mixture_cross_entropy_chunked")
    return _ChunkedSoftcapCrossEntropy.apply(logits, targets.long(), weights, rows,
                                             _chunked_grad_scale(grad_scale, logits.device), bool(exact_upstream),
                                             torch.as_tensor(copy_col, device=logits.device).long().reshape(1),
                                             p_copy, a_sink)


# ---------------------------------------------------------------------------------------------
# 4. Muon helper: the Gram matrix X X^T
# ---------------------------------------------------------------------------------------------

XXT = LaunchConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)


@triton.jit
def _xxt_kernel(x_ptr, c_ptr, m, n, stride_xb, stride_xm, stride_xn, stride_cb, stride_cm, stride_cn, alpha, beta,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, ADD_INPUT: tl.constexpr):
    """C = alpha X X^T + beta X for one matrix of a batch, one (BLOCK_M, BLOCK_M) tile per program.

    Programs enumerate only the lower-triangle tiles (i, j), j <= i; each computes
    X[i rows] X[j rows]^T and stores it at (i, j) and, transposed, at (j, i); a diagonal tile
    keeps its lower triangle and mirrors it, so the result is exactly symmetric (the tensor
    cores need not sum (r, c) and (c, r) in the same order). Half the FLOPs of X @ X^T.
    ADD_INPUT (X square and symmetric, as a Gram matrix is): the epilogue adds beta X[i, j] to
    the fp32 tile, so b A + c A^2 of a Newton-Schulz step is one kernel; the mirrored store
    then holds beta X[j, i] because X is symmetric.
    Traffic per tile: 2 * BLOCK_M * n elements of X read (ADD_INPUT: one tile more), one or two
    tiles written.
    EVEN (m a multiple of BLOCK_M, n of BLOCK_K, as for Muon's matrices): loads need no mask.
    """
    tile = tl.program_id(0)
    batch = tl.program_id(1)
    # tile = i (i + 1) / 2 + j with 0 <= j <= i: invert the triangular number, then fix rounding
    i = ((tl.sqrt_rn(8.0 * tile + 1.0) - 1.0) * 0.5).to(tl.int32)
    i = tl.where((i + 1) * (i + 2) // 2 <= tile, i + 1, i)
    i = tl.where(i * (i + 1) // 2 > tile, i - 1, i)
    j = tile - i * (i + 1) // 2

    x_ptr += batch * stride_xb
    rows_i = i * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_j = j * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    for start in range(0, n, BLOCK_K):
        a_ptrs = x_ptr + rows_i[:, None] * stride_xm + (start + ks[None, :]) * stride_xn
        b_ptrs = x_ptr + rows_j[:, None] * stride_xm + (start + ks[None, :]) * stride_xn
        if EVEN:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = start + ks[None, :] < n
            a = tl.load(a_ptrs, mask=(rows_i[:, None] < m) & k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=(rows_j[:, None] < m) & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)

    if i == j:
        # a diagonal tile's two triangles come from different sums: mirror the lower one
        acc = tl.where(rows_i[:, None] >= rows_j[None, :], acc, tl.trans(acc))
    mask = (rows_i[:, None] < m) & (rows_j[None, :] < m)
    acc = acc * alpha
    if ADD_INPUT:
        tile = tl.load(x_ptr + rows_i[:, None] * stride_xm + rows_j[None, :] * stride_xn, mask=mask, other=0.0)
        acc += beta * tile.to(tl.float32)
    c_ptr += batch * stride_cb
    out = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows_i[:, None] * stride_cm + rows_j[None, :] * stride_cn, out, mask=mask)
    if i != j:
        tl.store(c_ptr + rows_j[None, :] * stride_cm + rows_i[:, None] * stride_cn, out, mask=mask)


def _launch_xxt(x: Tensor, config: list[int], alpha: float = 1.0, beta: float = 0.0) -> Tensor:
    config = _config_from_list(config)
    batch, m, n = x.shape
    c = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(m, config.block_m)
    _launch(_xxt_kernel, (tiles * (tiles + 1) // 2, batch), config,
            x_ptr=x, c_ptr=c, m=m, n=n, stride_xb=x.stride(0), stride_xm=x.stride(1), stride_xn=x.stride(2),
            stride_cb=c.stride(0), stride_cm=c.stride(1), stride_cn=c.stride(2), alpha=alpha, beta=beta,
            BLOCK_M=config.block_m, BLOCK_K=config.block_k,
            EVEN=m % config.block_m == 0 and n % config.block_k == 0, ADD_INPUT=beta != 0.0)
    return c


_xxt_op = torch.library.custom_op(f"{_OPS}::xxt", _launch_xxt, mutates_args=())


@_xxt_op.register_fake
def _(x, config, alpha=1.0, beta=0.0):
    return x.new_empty(x.shape[0], x.shape[1], x.shape[1])


def _check_xxt_input(x, beta):
    if beta != 0.0 and x.shape[-1] != x.shape[-2]:
        raise ValueError(f"xxt with beta != 0 adds beta X to X X^T: X must be square, got {tuple(x.shape)}")


def xxt(x, config=XXT, alpha=1.0, beta=0.0):
    """alpha X X^T + beta X for a batch of matrices (..., m, n) -> (..., m, m) in x's dtype (fp32
    accumulation, one rounding; fp32 inputs multiply in tf32 on the GPU), computing one triangle
    of tiles and mirroring it, so the result is exactly symmetric. beta != 0 takes square
    symmetric X (a Gram matrix A: b A + c A^2 is xxt(A, alpha=c, beta=b)). Not differentiable."""
    _check_xxt_input(x, beta)
    m, n = x.shape[-2:]
    return _xxt_op(x.reshape(-1, m, n), config.as_list(), float(alpha), float(beta)).reshape(*x.shape[:-2], m, m)


def xxt_reference(x, alpha=1.0, beta=0.0):
    """alpha X @ X^T + beta X for a batch of matrices (..., m, n) -> (..., m, m), in at least fp32
    and rounded once to x's dtype."""
    _check_xxt_input(x, beta)
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    gram = alpha * (wide @ wide.mT)
    return (gram + beta * wide if beta != 0.0 else gram).to(x.dtype)


# ---------------------------------------------------------------------------------------------
# 5. QK norm + RoPE (+ the key offset), forward and backward
# ---------------------------------------------------------------------------------------------
#
# Queries and keys come out of the packed QKV projection as strided (T, heads, D) views. Each
# row is RMS-normed over its D dims, rotated by its position's angles and written contiguous in
# the attention kernel's layout; with the key offset (keys of long-window layers) a row's
# stationary dims (zero frequency) take the previous row's normed values, except at a document
# start. Paired heads in the records' layout (PAIRED): head h of token t is rotated at position
# 2t + h % 2 and written in place in (T, heads, D), which the attention reads as the doubled
# sequence's (2T, heads/2, D) view: no copy into or out of that layout. Per row: one read of D
# values (two with the offset: the previous row's too), one write, one fp32 rstd saved for the
# backward; four torch ops and their intermediates become one pass. The math in fp32, the output
# in the input's dtype:
#     z = x rstd, rstd = (mean(x^2) + eps)^-1/2;   y1 = z1 cos + z2 sin,  y2 = z2 cos - z1 sin
# (x1, x2: the two halves of the D dims; cos, sin: (positions, D/2) tables, 1 and 0 on the
# stationary pairs). Backward: the offset's gradient goes back to the row it came from, the
# rotation is transposed, and dx = rstd (dz - z mean(dz z)).

QK_NORM_EPS = torch.finfo(torch.float32).eps  # F.rms_norm's default for fp32, where autocast runs it
QK_NORM_ROPE = LaunchConfig(block_m=32, block_n=0, num_warps=4)  # block_m rows of one head per program


@triton.jit
def _load_halves(ptr, rows, cols, stride_t, mask, HALF: tl.constexpr):
    offsets = rows[:, None] * stride_t + cols[None, :]
    x1 = tl.load(ptr + offsets, mask=mask[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(ptr + offsets + HALF, mask=mask[:, None], other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _angle_rows(rows, head, PAIRED: tl.constexpr):
    """The rows of the angle tables that rows of `head` turn by: their positions, or with paired
    heads 2t + head % 2."""
    if PAIRED:
        return 2 * rows + head % 2
    return rows


@triton.jit
def _qk_norm_rope_fwd_kernel(x_ptr, y_ptr, rstd_ptr, cos_ptr, sin_ptr, stationary_ptr, doc_start_ptr, num_rows,
                             stride_xt, stride_xh, stride_yt, stride_yh, stride_cos, eps,
                             OFFSET: tl.constexpr, PAIRED: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    head, num_heads = tl.program_id(1), tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HALF)
    in_range = rows < num_rows
    x1, x2 = _load_halves(x_ptr + head * stride_xh, rows, cols, stride_xt, in_range, HALF)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
    table = _angle_rows(rows, head, PAIRED)[:, None] * stride_cos + cols[None, :]
    cos = tl.load(cos_ptr + table, mask=in_range[:, None], other=1.0)
    sin = tl.load(sin_ptr + table, mask=in_range[:, None], other=0.0)
    y1 = (x1 * cos + x2 * sin) * rstd[:, None]
    y2 = (x2 * cos - x1 * sin) * rstd[:, None]
    if OFFSET:
        has_previous = in_range & (rows > 0)
        p1, p2 = _load_halves(x_ptr + head * stride_xh, rows - 1, cols, stride_xt, has_previous, HALF)
        p_rstd = 1.0 / tl.sqrt((tl.sum(p1 * p1, 1) + tl.sum(p2 * p2, 1)) / (2 * HALF) + eps)
        shifted = (tl.load(doc_start_ptr + rows, mask=in_range, other=1) == 0)[:, None]
        take1 = shifted & (tl.load(stationary_ptr + cols) != 0)[None, :]
        take2 = shifted & (tl.load(stationary_ptr + HALF + cols) != 0)[None, :]
        y1 = tl.where(take1, p1 * p_rstd[:, None], y1)
        y2 = tl.where(take2, p2 * p_rstd[:, None], y2)
    out = y_ptr + head * stride_yh + rows[:, None] * stride_yt + cols[None, :]
    tl.store(out, y1.to(y_ptr.dtype.element_ty), mask=in_range[:, None])
    tl.store(out + HALF, y2.to(y_ptr.dtype.element_ty), mask=in_range[:, None])
    tl.store(rstd_ptr + rows * num_heads + head, rstd, mask=in_range)


@triton.jit
def _qk_norm_rope_grad(dy_ptr, x_ptr, rstd_ptr, cos_ptr, sin_ptr, stationary_ptr, doc_start_ptr, rows, head,
                       num_heads, num_rows, stride_dyt, stride_xt, stride_cos, OFFSET: tl.constexpr,
                       PAIRED: tl.constexpr, HALF: tl.constexpr):
    """(dx1, dx2) in fp32: the two halves of the gradient of rows `rows` of one head's input x,
    from dy, the gradient of its normed and rotated output (dy_ptr and x_ptr at the head's first
    element)."""
    cols = tl.arange(0, HALF)
    in_range = rows < num_rows
    dy1, dy2 = _load_halves(dy_ptr, rows, cols, stride_dyt, in_range, HALF)
    if OFFSET:   # stationary dims: this row's output kept them at a document start; the next took them
        stat1 = (tl.load(stationary_ptr + cols) != 0)[None, :]
        stat2 = (tl.load(stationary_ptr + HALF + cols) != 0)[None, :]
        starts = (tl.load(doc_start_ptr + rows, mask=in_range, other=1) != 0)[:, None]
        has_next = in_range & (rows + 1 < num_rows)
        next_takes = (tl.load(doc_start_ptr + rows + 1, mask=has_next, other=1) == 0)[:, None]
        n1, n2 = _load_halves(dy_ptr, rows + 1, cols, stride_dyt, has_next, HALF)
        dy1 = tl.where(stat1, tl.where(starts, dy1, 0.0) + tl.where(next_takes, n1, 0.0), dy1)
        dy2 = tl.where(stat2, tl.where(starts, dy2, 0.0) + tl.where(next_takes, n2, 0.0), dy2)
    table = _angle_rows(rows, head, PAIRED)[:, None] * stride_cos + cols[None, :]
    cos = tl.load(cos_ptr + table, mask=in_range[:, None], other=1.0)
    sin = tl.load(sin_ptr + table, mask=in_range[:, None], other=0.0)
    dz1 = dy1 * cos - dy2 * sin
    dz2 = dy1 * sin + dy2 * cos
    x1, x2 = _load_halves(x_ptr, rows, cols, stride_xt, in_range, HALF)
    rstd = tl.load(rstd_ptr + rows * num_heads + head, mask=in_range, other=0.0)[:, None]
    z1, z2 = x1 * rstd, x2 * rstd
    mean_dz_z = (tl.sum(dz1 * z1, 1) + tl.sum(dz2 * z2, 1)) / (2 * HALF)
    return rstd * (dz1 - z1 * mean_dz_z[:, None]), rstd * (dz2 - z2 * mean_dz_z[:, None])


@triton.jit
def _qk_norm_rope_bwd_kernel(dy_ptr, x_ptr, rstd_ptr, dx_ptr, cos_ptr, sin_ptr, stationary_ptr, doc_start_ptr,
                             num_rows, stride_dyt, stride_dyh, stride_xt, stride_xh, stride_dxt, stride_dxh,
                             stride_cos, OFFSET: tl.constexpr, PAIRED: tl.constexpr, HALF: tl.constexpr,
                             BLOCK_T: tl.constexpr):
    head, num_heads = tl.program_id(1), tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HALF)
    in_range = rows < num_rows
    dx1, dx2 = _qk_norm_rope_grad(dy_ptr + head * stride_dyh, x_ptr + head * stride_xh, rstd_ptr, cos_ptr, sin_ptr,
                                  stationary_ptr, doc_start_ptr, rows, head, num_heads, num_rows, stride_dyt,
                                  stride_xt, stride_cos, OFFSET, PAIRED, HALF)
    out = dx_ptr + head * stride_dxh + rows[:, None] * stride_dxt + cols[None, :]
    tl.store(out, dx1.to(dx_ptr.dtype.element_ty), mask=in_range[:, None])
    tl.store(out + HALF, dx2.to(dx_ptr.dtype.element_ty), mask=in_range[:, None])


def _qk_grid(rows, heads, config):
    return (triton.cdiv(rows, config.block_m), heads)


def _launch_qk_norm_rope_fwd(x: Tensor, cos: Tensor, sin: Tensor, stationary: Tensor, doc_start: Tensor,
                             offset: bool, paired: bool, config: list[int]) -> tuple[Tensor, Tensor]:
    config = _config_from_list(config)
    T, H, D = x.shape
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    rstd = torch.empty(T, H, dtype=torch.float32, device=x.device)
    _launch(_qk_norm_rope_fwd_kernel, _qk_grid(T, H, config), config,
            x_ptr=x, y_ptr=y, rstd_ptr=rstd, cos_ptr=cos, sin_ptr=sin, stationary_ptr=stationary,
            doc_start_ptr=doc_start, num_rows=T, stride_xt=x.stride(0), stride_xh=x.stride(1),
            stride_yt=y.stride(0), stride_yh=y.stride(1), stride_cos=cos.stride(0), eps=QK_NORM_EPS,
            OFFSET=offset, PAIRED=paired, HALF=D // 2, BLOCK_T=config.block_m)
    return y, rstd


def _launch_qk_norm_rope_bwd(dy: Tensor, x: Tensor, rstd: Tensor, cos: Tensor, sin: Tensor, stationary: Tensor,
                             doc_start: Tensor, offset: bool, paired: bool, config: list[int]) -> Tensor:
    config = _config_from_list(config)
    T, H, D = x.shape
    dx = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    _launch(_qk_norm_rope_bwd_kernel, _qk_grid(T, H, config), config,
            dy_ptr=dy, x_ptr=x, rstd_ptr=rstd, dx_ptr=dx, cos_ptr=cos, sin_ptr=sin, stationary_ptr=stationary,
            doc_start_ptr=doc_start, num_rows=T, stride_dyt=dy.stride(0), stride_dyh=dy.stride(1),
            stride_xt=x.stride(0), stride_xh=x.stride(1), stride_dxt=dx.stride(0), stride_dxh=dx.stride(1),
            stride_cos=cos.stride(0), OFFSET=offset, PAIRED=paired, HALF=D // 2, BLOCK_T=config.block_m)
    return dx


_qk_norm_rope_fwd_op = torch.library.custom_op(f"{_OPS}::qk_norm_rope_fwd", _launch_qk_norm_rope_fwd,
                                               mutates_args=())
_qk_norm_rope_bwd_op = torch.library.custom_op(f"{_OPS}::qk_norm_rope_bwd", _launch_qk_norm_rope_bwd,
                                               mutates_args=())


@_qk_norm_rope_fwd_op.register_fake
def _(x, cos, sin, stationary, doc_start, offset, paired, config):
    return x.new_empty(x.shape), x.new_empty(x.shape[:2], dtype=torch.float32)


@_qk_norm_rope_bwd_op.register_fake
def _(dy, x, rstd, cos, sin, stationary, doc_start, offset, paired, config):
    return x.new_empty(x.shape)


class _QKNormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, stationary, doc_start, offset, paired, config):
        y, rstd = _qk_norm_rope_fwd_op(x, cos, sin, stationary, doc_start, offset, paired, config)
        ctx.save_for_backward(x, rstd, cos, sin, stationary, doc_start)
        ctx.args = (offset, paired, config)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd, cos, sin, stationary, doc_start = ctx.saved_tensors
        dx = _qk_norm_rope_bwd_op(_last_dim_contiguous(dy), x, rstd, cos, sin, stationary, doc_start, *ctx.args)
        return dx, None, None, None, None, None, None, None


def _check_qk_inputs(q, k, cos, sin, stationary, key_doc_start, paired):
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.shape[2] % 2 or t.stride(2) != 1 or (paired and t.shape[1] % 2):
            raise ValueError(f"qk_norm_rope: {name} must be (T, heads, D) with even D{' and heads' if paired else ''} "
                             f"and contiguous last dim; got shape {tuple(t.shape)}, strides {t.stride()}")
    _check_rope_tables(q.shape[0], q.shape[2], cos, sin, stationary, key_doc_start, paired)


def _check_rope_tables(T, qk_dim, cos, sin, stationary, key_doc_start, paired):
    positions = T * (2 if paired else 1)
    if cos.shape != sin.shape or cos.shape != (positions, qk_dim // 2) or stationary.shape != (qk_dim,):
        raise ValueError(f"qk_norm_rope: cos and sin must be ({'2T' if paired else 'T'}, D/2) = ({positions}, "
                         f"{qk_dim // 2}) and stationary (D,); got {tuple(cos.shape)}, {tuple(sin.shape)}, "
                         f"{tuple(stationary.shape)}")
    if paired and key_doc_start is not None:
        raise ValueError("qk_norm_rope: the key offset is not defined on paired heads")


def _rope_inputs(cos, sin, stationary, key_doc_start, device):
    """(cos, sin, stationary, doc_start, offset) as the QK norm + RoPE kernels read them."""
    offset = key_doc_start is not None
    doc_start = (key_doc_start if offset else torch.ones(1, dtype=torch.bool, device=device)).to(torch.int8)
    return cos.float().contiguous(), sin.float().contiguous(), stationary.to(torch.int8), doc_start, offset


def qk_norm_rope(q, k, cos, sin, stationary, key_doc_start=None, config=QK_NORM_ROPE, paired=False):
    """(q', k'): q and k (T, heads, D), any strides with a contiguous last dim, RMS-normed per row
    and rotated by the (T, D/2) angle tables cos, sin, contiguous in q's and k's dtype. With
    key_doc_start ((T,) bool, True at document starts and at row 0) a key row's stationary dims
    ((D,) bool) hold the previous row's normed values, except at a document start. paired: head h
    of token t is rotated at position 2t + h % 2 of (2T, D/2) tables, the records' paired heads,
    which attention reads as the (2T, heads/2, D) view of the result."""
    _check_qk_inputs(q, k, cos, sin, stationary, key_doc_start, paired)
    cos, sin, stationary, doc_start, offset = _rope_inputs(cos, sin, stationary, key_doc_start, q.device)
    q_out = _QKNormRope.apply(q, cos, sin, stationary, doc_start, False, paired, config.as_list())
    k_out = _QKNormRope.apply(k, cos, sin, stationary, doc_start, offset, paired, config.as_list())
    return q_out, k_out


# The packed QKV projection with the norm and RoPE inside its op (fp8_qkv_norm_rope): the
# forward is fp8_linear's, then the two qk_norm_rope passes; the backward takes q's and k's
# gradients back through the rotation and the norm and casts them, with v's, to the e5m2 output
# gradient of the projection in both layouts, in one pass (_qkv_grad_fp8_kernel). Unfused, the
# rotation's backward writes dq and dk in bf16, a pass concatenates them with dv and casts the
# result, and the transpose kernel makes the second layout: per token, 2 x 2 x H x D bytes
# written and read again and H (2 D + Dv) bytes read again, and two launches, are saved.


@triton.jit
def _qkv_grad_fp8_kernel(dq_ptr, dk_ptr, dv_ptr, qk_ptr, rstd_q_ptr, rstd_k_ptr, cos_ptr, sin_ptr, stationary_ptr,
                         doc_start_ptr, g_ptr, gt_ptr, scale_ptr, amax_ptr, num_rows, num_cols, stride_dqt, stride_dqh,
                         stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_xt, stride_cos, OFFSET: tl.constexpr,
                         PAIRED: tl.constexpr, HALF: tl.constexpr, V_DIM: tl.constexpr, Q_MAX: tl.constexpr,
                         BLOCK_T: tl.constexpr):
    """g = [dq | dk | dv], the packed projection's output gradient (T, H (2 D + V_DIM)), as fp8
    g / scale row-major and transposed (_quantize_tile), for BLOCK_T rows of one head: q's and
    k's gradients taken back through the rotation and the norm (_qk_norm_rope_grad; the key
    offset is k's) and rounded to the projection's dtype, as the unfused backward stores them,
    v's as it comes; max |g| folded into *amax_ptr (qk_ptr: the projection's q and k columns, rows
    stride_xt apart). Traffic: dq, dk, dv and the projection's q and k read once (dk's next row
    again with the offset), g written twice in fp8."""
    head, num_heads = tl.program_id(1), tl.num_programs(1)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, HALF).to(tl.int64)
    scale = tl.load(scale_ptr)
    dtype = qk_ptr.dtype.element_ty
    for part in tl.static_range(2):          # q, then k
        if part == 0:
            dx1, dx2 = _qk_norm_rope_grad(dq_ptr + head * stride_dqh, qk_ptr + head * 2 * HALF, rstd_q_ptr, cos_ptr,
                                          sin_ptr, stationary_ptr, doc_start_ptr, rows, head, num_heads, num_rows,
                                          stride_dqt, stride_xt, stride_cos, False, PAIRED, HALF)
        else:
            dx1, dx2 = _qk_norm_rope_grad(dk_ptr + head * stride_dkh, qk_ptr + (num_heads + head) * 2 * HALF,
                                          rstd_k_ptr, cos_ptr, sin_ptr, stationary_ptr, doc_start_ptr, rows, head,
                                          num_heads, num_rows, stride_dkt, stride_xt, stride_cos, OFFSET, PAIRED, HALF)
        first = (part * num_heads + head) * 2 * HALF
        _quantize_tile(dx1.to(dtype).to(tl.float32), rows.to(tl.int64), first + cols, num_rows, num_cols, g_ptr,
                       gt_ptr, scale, amax_ptr, Q_MAX)
        _quantize_tile(dx2.to(dtype).to(tl.float32), rows.to(tl.int64), first + HALF + cols, num_rows, num_cols,
                       g_ptr, gt_ptr, scale, amax_ptr, Q_MAX)
    v_cols = tl.arange(0, V_DIM).to(tl.int64)
    dv = tl.load(dv_ptr + head * stride_dvh + rows[:, None].to(tl.int64) * stride_dvt + v_cols[None, :],
                 mask=(rows < num_rows)[:, None], other=0.0)
    _quantize_tile(dv.to(tl.float32), rows.to(tl.int64), 2 * num_heads * 2 * HALF + head * V_DIM + v_cols, num_rows,
                   num_cols, g_ptr, gt_ptr, scale, amax_ptr, Q_MAX)


def _launch_qkv_grad_fp8(dq: Tensor, dk: Tensor, dv: Tensor, qk: Tensor, rstd_q: Tensor, rstd_k: Tensor, cos: Tensor,
                         sin: Tensor, stationary: Tensor, doc_start: Tensor, scale: Tensor, amax: Tensor, offset: bool,
                         paired: bool, config: list[int]) -> tuple[Tensor, Tensor]:
    config = _config_from_list(config)
    T, (H, D), v_dim = qk.shape[0], dq.shape[1:], dv.shape[2]
    N = H * (2 * D + v_dim)
    g = torch.empty(T, N, dtype=torch.float8_e5m2, device=qk.device)
    gt = torch.empty(N, T, dtype=torch.float8_e5m2, device=qk.device)
    _launch(_qkv_grad_fp8_kernel, _qk_grid(T, H, config), config,
            dq_ptr=dq, dk_ptr=dk, dv_ptr=dv, qk_ptr=qk, rstd_q_ptr=rstd_q, rstd_k_ptr=rstd_k, cos_ptr=cos, sin_ptr=sin,
            stationary_ptr=stationary, doc_start_ptr=doc_start, g_ptr=g, gt_ptr=gt, scale_ptr=scale, amax_ptr=amax,
            num_rows=T, num_cols=N, stride_dqt=dq.stride(0), stride_dqh=dq.stride(1), stride_dkt=dk.stride(0),
            stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1), stride_xt=qk.stride(0),
            stride_cos=cos.stride(0), OFFSET=offset, PAIRED=paired, HALF=D // 2, V_DIM=v_dim,
            Q_MAX=FP8_E5M2_MAX, BLOCK_T=config.block_m)
    return g, gt


_qkv_grad_fp8_op = torch.library.custom_op(f"{_OPS}::qkv_grad_fp8", _launch_qkv_grad_fp8, mutates_args=("amax",))


@_qkv_grad_fp8_op.register_fake
def _(dq, dk, dv, qk, rstd_q, rstd_k, cos, sin, stationary, doc_start, scale, amax, offset, paired, config):
    T, N = qk.shape[0], dq.shape[1] * (2 * dq.shape[2] + dv.shape[2])
    return qk.new_empty(T, N, dtype=torch.float8_e5m2), qk.new_empty(N, T, dtype=torch.float8_e5m2)


class _FP8QKVNormRope(torch.autograd.Function):
    """q, k, v of the packed projection x W^T (_FP8Linear's forward), q and k normed and rotated
    (the qk_norm_rope kernel); backward: _qkv_grad_fp8_kernel makes the projection's e5m2 output
    gradient in both layouts from the three gradients, then _FP8Linear's two GEMMs. The
    gradient's scale comes from a rule that does not read the gradient (Static, Delayed)."""

    @staticmethod
    def forward(ctx, x, weight, state, scales, prims, config, heads, qk_dim, cos, sin, stationary, doc_start, offset,
                paired, rope_config, w8=None, w8_t=None, w_scale=None, gain=None):
        qkv, saved = _fp8_linear_forward(x, weight, state, scales, prims, config, (w8, w8_t, w_scale), gain)
        T, width = x.shape[0], heads * qk_dim
        q, k, v = (t.view(T, heads, -1) for t in (qkv[:, :width], qkv[:, width:2 * width], qkv[:, 2 * width:]))
        q_out, rstd_q = _qk_norm_rope_fwd_op(q, cos, sin, stationary, doc_start, False, paired, rope_config)
        k_out, rstd_k = _qk_norm_rope_fwd_op(k, cos, sin, stationary, doc_start, offset, paired, rope_config)
        ctx.save_for_backward(*saved, qkv[:, :2 * width], rstd_q, rstd_k, cos, sin, stationary, doc_start,
                              *_gain_saved(weight, gain))
        ctx.state, ctx.scales, ctx.prims, ctx.config = state, scales, prims, config
        ctx.dtypes, ctx.rope = (x.dtype, weight.dtype), (offset, paired, rope_config)
        return q_out, k_out, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        *saved, qk, rstd_q, rstd_k, cos, sin, stationary, doc_start, weight, gain = ctx.saved_tensors
        g_scale, g_amax = _operand_scale(ctx.state, FP8_LINEAR_SLOTS, ctx.scales.grad_output, "grad_output",
                                         FP8_E5M2_MAX, None)
        g8, g8_t = _qkv_grad_fp8_op(_last_dim_contiguous(dq), _last_dim_contiguous(dk), _last_dim_contiguous(dv), qk,
                                    rstd_q, rstd_k, cos, sin, stationary, doc_start, g_scale, g_amax, *ctx.rope)
        grad_x, grad_w = _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale)
        grad_w, grad_gain = _weight_gain_grads(grad_w, weight, gain, ctx.needs_input_grad[18])
        return (grad_x, grad_w) + (None,) * 16 + (grad_gain,)


def fp8_qkv_norm_rope_supports(scales):
    """Whether fp8_qkv_norm_rope takes these FP8LinearScales: its backward casts the gradient in
    the kernel that makes it, so the gradient's rule must not read the gradient (Static, Delayed)."""
    return isinstance(scales.grad_output, (Static, Delayed))


def fp8_qkv_norm_rope(x, weight, state, heads, qk_dim, cos, sin, stationary, key_doc_start=None, paired=False,
                      config=None, scales=FP8LinearScales(), gemm="fastest", casts="kernel", weight_cast=None,
                      rope_config=QK_NORM_ROPE, gain=None):
    """(q, k, v) of the packed QKV projection x @ weight.T in fp8: q and k (T, heads, qk_dim)
    as qk_norm_rope(q, k, cos, sin, stationary, key_doc_start, paired=paired) returns them, v
    (T, heads, v_dim) the projection's own view; weight (heads (2 qk_dim + v_dim), K) holds the
    q, k and v rows in that order. The values, the gradients and the state's updates are those
    of fp8_linear followed by qk_norm_rope, bit for bit; the backward makes the projection's fp8
    output gradient in one pass (_qkv_grad_fp8_kernel). x (T, K) bf16; config, scales (with a
    gradient rule fp8_qkv_norm_rope_supports), gemm, casts, weight_cast and gain as in fp8_linear."""
    _check_fp8_state(state, FP8_LINEAR_SLOTS, "new_fp8_linear_state")
    _check_scales(scales, FP8LinearScales)
    if not fp8_qkv_norm_rope_supports(scales):
        raise ValueError("fp8_qkv_norm_rope: the gradient's scale rule must be Static or Delayed (an exact scale "
                         "needs the gradient before its cast): use fp8_linear and qk_norm_rope")
    if (x.dim() != 2 or weight.shape[0] % heads or weight.shape[0] // heads <= 2 * qk_dim or qk_dim % 2
            or (paired and heads % 2)):
        raise ValueError(f"fp8_qkv_norm_rope: x must be (T, K) and weight (heads (2 qk_dim + v_dim), K), with an "
                         f"even qk_dim{' and heads' if paired else ''}; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}, {heads} heads of {qk_dim}")
    _check_rope_tables(x.shape[0], qk_dim, cos, sin, stationary, key_doc_start, paired)
    rope = _rope_inputs(cos, sin, stationary, key_doc_start, x.device)
    return _FP8QKVNormRope.apply(x, weight, state, scales, _PRIMITIVES[gemm, casts], config, heads, qk_dim, *rope,
                                 paired, rope_config.as_list(), *(weight_cast or (None,) * 3), _check_gain(gain))


def fp8_qkv_norm_rope_reference(x, weight, state, heads, qk_dim, cos, sin, stationary, key_doc_start=None,
                                paired=False, config=None, scales=FP8LinearScales(), weight_cast=None, gain=None):
    """fp8_qkv_norm_rope as fp8_linear_reference, then qk_norm_rope_reference."""
    qkv = fp8_linear_reference(x, weight, state, config, scales, weight_cast=weight_cast, gain=gain)
    width = heads * qk_dim
    q, k, v = (t.view(x.shape[0], heads, -1) for t in (qkv[:, :width], qkv[:, width:2 * width], qkv[:, 2 * width:]))
    return (*qk_norm_rope_reference(q, k, cos, sin, stationary, key_doc_start, paired=paired), v)


def rope_reference(x, cos, sin):
    """x (T, heads, D) rotated by the (T, D/2) tables, or (T, heads, D/2) ones (a table row per
    head): (x1 cos + x2 sin, x2 cos - x1 sin)."""
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


def offset_keys_reference(k, stationary, doc_start):
    """Keys (T, H, D) whose stationary dims hold the previous row's, except at a document start
    (doc_start (T,) bool, True at row 0), so nothing from another document leaks in."""
    take_previous = stationary & ~doc_start[:, None, None]          # (T, 1, D)
    return torch.where(take_previous, torch.roll(k, 1, dims=0), k)


def qk_norm_rope_reference(q, k, cos, sin, stationary, key_doc_start=None, config=None, paired=False):
    """qk_norm_rope in torch ops: rms_norm, rope_reference, offset_keys_reference."""
    _check_qk_inputs(q, k, cos, sin, stationary, key_doc_start, paired)
    if paired:                     # head h of token t turns by table row 2t + h % 2
        T, H = q.shape[:2]
        rows = 2 * torch.arange(T, device=q.device)[:, None] + torch.arange(H, device=q.device) % 2
        cos, sin = cos[rows], sin[rows]
    q_out = rope_reference(F.rms_norm(q, (q.size(-1),)), cos, sin).to(q.dtype)
    k_out = rope_reference(F.rms_norm(k, (k.size(-1),)), cos, sin).to(k.dtype)
    if key_doc_start is not None:
        k_out = offset_keys_reference(k_out, stationary, key_doc_start)
    return q_out, k_out


# ---------------------------------------------------------------------------------------------
# 6. Sparse rows: a batch's distinct rows, their summed gradients, and Adam on those rows
# ---------------------------------------------------------------------------------------------
#
# A hashed n-gram table has far more rows than a step touches. A step's gradient is N rows (one
# per token and channel, with repeats) of width D; the optimizer wants one summed gradient per
# distinct row and updates only those rows. Every buffer has a fixed size (capacity N) and the
# number of distinct rows stays on the device, so no step waits for the host:
#   distinct_rows(rows)          stable sort, mark first occurrences, number them (plain torch)
#   sum_rows(values, groups)     each distinct row's values summed in token order: deterministic
#   add_row_sums_(sums, ...)     the same sums added into rows of an fp32 accumulator in one pass
#   sparse_adam_rows_(...)       Adam with beta1 = 0 and one fp32 second moment per row; a row's
#                                moment first catches up on the decay of the events it missed

@dataclasses.dataclass
class RowGroups:
    """The distinct rows of an index vector `rows` (N,), at fixed capacity N.

    distinct: (N,) the distinct rows in increasing order, then -1
    count:    (1,) how many there are
    inverse:  (N,) the slot in `distinct` of each rows[i]
    order:    (N,) positions of `rows` sorted by row, ties in position order
    starts:   (N + 1,) slot s's entries are order[starts[s]:starts[s + 1]]; N from slot `count` on
    """
    distinct: Tensor
    count: Tensor
    inverse: Tensor
    order: Tensor
    starts: Tensor


def distinct_rows(rows):
    """RowGroups of an int64 index vector, without a host sync (no nonzero, no mask indexing)."""
    n = rows.numel()
    sorted_rows, order = torch.sort(rows, stable=True)
    first = torch.ones_like(sorted_rows, dtype=torch.bool)
    first[1:] = sorted_rows[1:] != sorted_rows[:-1]
    slot = first.cumsum(0) - 1                       # slot of each sorted entry
    distinct = torch.full_like(rows, -1).scatter_(0, slot, sorted_rows)  # repeats write equal values
    inverse = torch.empty_like(rows).scatter_(0, order, slot)
    positions = torch.arange(n, device=rows.device)
    starts = torch.full((n + 1,), n, dtype=torch.int64, device=rows.device)
    starts.scatter_reduce_(0, slot, positions, "amin")
    return RowGroups(distinct, slot[-1:] + 1, inverse, order, starts)


SUM_ROWS = LaunchConfig(block_m=1, block_n=256, num_warps=4)  # block_n columns of one slot per program


@triton.jit
def _sum_rows_kernel(values_ptr, order_ptr, starts_ptr, out_ptr, scale, D, stride_v, stride_o,
                     BLOCK_D: tl.constexpr):
    """out[s] = scale * (sum over p in [starts[s], starts[s + 1]) of values[order[p]]), summed in
    fp32 and stored in out's dtype (rounded to nearest once), for one slot s and one block of
    columns per program. Slots past the count have an empty range and store zeros. Each value
    row is read once and each slot written once: (N + capacity) * D elements of traffic, and
    the sum runs in token order, so the result does not depend on scheduling (no atomics). Row
    offsets are 64-bit: a late-phase n-gram update sums 3,145,728 entries of width 768 (1gpu
    preset), 2.4e9 elements."""
    s = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_row = cols < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for p in range(tl.load(starts_ptr + s), tl.load(starts_ptr + s + 1)):
        source = tl.load(order_ptr + p)
        acc += tl.load(values_ptr + source * stride_v + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(out_ptr + s * stride_o + cols, (acc * scale).to(out_ptr.dtype.element_ty), mask=in_row)


def _launch_sum_rows(values: Tensor, order: Tensor, starts: Tensor, scale: float, out_dtype: torch.dtype,
                     config: list[int]) -> Tensor:
    config = _config_from_list(config)
    n, d = values.shape
    out = torch.empty(n, d, dtype=out_dtype, device=values.device)
    _launch(_sum_rows_kernel, (n, triton.cdiv(d, config.block_n)), config,
            values_ptr=values, order_ptr=order, starts_ptr=starts, out_ptr=out, scale=scale, D=d,
            stride_v=values.stride(0), stride_o=out.stride(0), BLOCK_D=config.block_n)
    return out


_sum_rows_op = torch.library.custom_op(f"{_OPS}::sum_rows", _launch_sum_rows, mutates_args=())


@_sum_rows_op.register_fake
def _(values, order, starts, scale, out_dtype, config):
    return values.new_empty(values.shape, dtype=out_dtype)


def _check_row_values(values, groups):
    if values.ndim != 2 or values.shape[0] != groups.inverse.numel() or values.stride(1) != 1:
        raise ValueError(f"values must be (N, D) with unit column stride and N = {groups.inverse.numel()} "
                         f"rows; got shape {tuple(values.shape)}, strides {values.stride()}")


def sum_rows(values, groups: RowGroups, config=SUM_ROWS, scale=1.0, out_dtype=torch.float32):
    """(N, D) in out_dtype: row s holds `scale` times the sum of the values (N, D) of the entries
    in slot s of `groups` (distinct_rows of their indices), summed in fp32; zeros past the count."""
    _check_row_values(values, groups)
    return _sum_rows_op(values, groups.order, groups.starts, float(scale), out_dtype, config.as_list())


def sum_rows_reference(values, groups: RowGroups, config=None, scale=1.0, out_dtype=torch.float32):
    _check_row_values(values, groups)
    out = torch.zeros(values.shape, dtype=torch.float32, device=values.device)
    out.index_add_(0, groups.inverse, values.float())
    return (out * scale if scale != 1.0 else out).to(out_dtype)


@triton.jit
def _add_row_sums_kernel(values_ptr, order_ptr, starts_ptr, targets_ptr, sums_ptr, D, stride_v, stride_s,
                         BLOCK_D: tl.constexpr):
    """sums[targets[s]] += sum over p in [starts[s], starts[s + 1]) of values[order[p]], for one
    slot s and one block of columns per program; the sum in fp32 and in token order, as
    _sum_rows_kernel's, then one addition into the fp32 row. Slots past the count have an empty
    range and touch nothing. Traffic: each value row read once and each used slot's target row
    read and written once, N + 2 * count rows, where sum_rows and an index_add_ of its output
    move N + 4 * N (every slot written, read back, and its target read and written). The targets
    of the slots in use are distinct (the caller's contract: distinct rows, or slots handed to
    distinct rows), so no two programs write one row: no atomics, and the result does not
    depend on scheduling. Row offsets are 64-bit (see _sum_rows_kernel)."""
    s = tl.program_id(0).to(tl.int64)
    start, end = tl.load(starts_ptr + s), tl.load(starts_ptr + s + 1)
    if end > start:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_row = cols < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for p in range(start, end):
            source = tl.load(order_ptr + p)
            acc += tl.load(values_ptr + source * stride_v + cols, mask=in_row, other=0.0).to(tl.float32)
        target = sums_ptr + tl.load(targets_ptr + s).to(tl.int64) * stride_s + cols
        tl.store(target, tl.load(target, mask=in_row, other=0.0) + acc, mask=in_row)


def _launch_add_row_sums(sums: Tensor, targets: Tensor, values: Tensor, order: Tensor, starts: Tensor,
                         config: list[int]) -> None:
    config = _config_from_list(config)
    n, d = values.shape
    _launch(_add_row_sums_kernel, (n, triton.cdiv(d, config.block_n)), config,
            values_ptr=values, order_ptr=order, starts_ptr=starts, targets_ptr=targets, sums_ptr=sums, D=d,
            stride_v=values.stride(0), stride_s=sums.stride(0), BLOCK_D=config.block_n)


_add_row_sums_op = torch.library.custom_op(f"{_OPS}::add_row_sums_", _launch_add_row_sums, mutates_args=("sums",))


@_add_row_sums_op.register_fake
def _(sums, targets, values, order, starts, config):
    return None


def _check_row_sums(sums, targets, values, groups):
    _check_row_values(values, groups)
    if sums.dtype != torch.float32 or sums.ndim != 2 or sums.shape[1] != values.shape[1] or sums.stride(1) != 1:
        raise ValueError(f"sums must be fp32 (rows, {values.shape[1]}) with unit column stride; got "
                         f"{sums.dtype} {tuple(sums.shape)}, strides {sums.stride()}")
    if targets.shape != groups.distinct.shape:
        raise ValueError(f"targets must hold one row of sums per slot: shape {tuple(groups.distinct.shape)}, "
                         f"got {tuple(targets.shape)}")


def add_row_sums_(sums, targets, values, groups: RowGroups, config=SUM_ROWS):
    """sums[targets[s]] += the sum of the values (N, D) of the entries in slot s of `groups`,
    for each slot s in use (s < count): sum_rows(values, groups) added into the fp32 rows
    `targets` of `sums` in one pass, without the (N, D) sums in between. The targets of the slots
    in use must be distinct; those of the slots past the count are never read."""
    _check_row_sums(sums, targets, values, groups)
    _add_row_sums_op(sums, targets, values, groups.order, groups.starts, config.as_list())


def add_row_sums_reference_(sums, targets, values, groups: RowGroups, config=None):
    """add_row_sums_ by sum_rows_reference and index_add_ (a slot past the count adds its zeros
    into row 0)."""
    _check_row_sums(sums, targets, values, groups)
    sums.index_add_(0, targets.clamp_min(0), sum_rows_reference(values, groups))


@dataclasses.dataclass(frozen=True)
class RowAdamStep:
    """The scalars of one sparse Adam event (optim.SparseRowAdam computes them on the host).

    event: this event's number t (1, 2, ...); log_decay: sum over events s <= t of ln(beta2_s);
    one_minus_beta2: 1 - beta2_t; bias: 1 - prod_{s<=t} beta2_s; lr; decay: lr^2 * weight decay.
    """
    event: int
    log_decay: float
    one_minus_beta2: float
    bias: float
    lr: float
    decay: float
    eps: float


SPARSE_ADAM = LaunchConfig(block_m=1, block_n=0, num_warps=4)  # one row per program (block_n: the row width)


# `event` changes with every update: not specialized (its value 1 and multiples of 16 would each
# compile a variant of their own, the first of them inside the timed run).
@triton.jit(do_not_specialize=["event"])
def _sparse_adam_rows_kernel(table_ptr, grad_ptr, distinct_ptr, count_ptr, moment_ptr, last_ptr, log_decay_ptr,
                             D, stride_t, stride_g, event, log_decay, one_minus_beta2, bias, lr, decay, eps,
                             BLOCK_D: tl.constexpr):
    """Adam (beta1 = 0, one second moment per row) on the distinct row in slot s: the row's
    moment first decays by exp(log_decay - log_decay_at[last[row]]), the product of the beta2
    of every event since its last update, this one included; then it takes (1 - beta2) mean(g^2)
    and the row moves by -lr g / (sqrt(v / bias) + eps), after the cautious decay. Traffic per
    touched row: its gradient and its table row read, the row written, three scalars. Offsets are
    64-bit: slots (the gradient's rows) reach 3,145,728 x 768 elements, table rows 8.1e9."""
    s = tl.program_id(0).to(tl.int64)
    if s < tl.load(count_ptr):
        row = tl.load(distinct_ptr + s)
        cols = tl.arange(0, BLOCK_D)
        in_row = cols < D
        g = tl.load(grad_ptr + s * stride_g + cols, mask=in_row, other=0.0)
        missed = log_decay - tl.load(log_decay_ptr + tl.load(last_ptr + row))
        v = tl.load(moment_ptr + row) * tl.exp(missed).to(tl.float32) + one_minus_beta2 * (tl.sum(g * g, 0) / D)
        update = g / (tl.sqrt(v / bias) + eps)
        w = tl.load(table_ptr + row * stride_t + cols, mask=in_row, other=0.0).to(tl.float32)
        w = w - decay * tl.where(update * w > 0, w, 0.0)
        w = w - lr * update
        tl.store(table_ptr + row * stride_t + cols, w.to(table_ptr.dtype.element_ty), mask=in_row)
        tl.store(moment_ptr + row, v)
        tl.store(last_ptr + row, event)


def _launch_sparse_adam_rows(table: Tensor, grads: Tensor, distinct: Tensor, count: Tensor, moment: Tensor,
                             last: Tensor, log_decay_at: Tensor, event: int, log_decay: float,
                             one_minus_beta2: float, bias: float, lr: float, decay: float, eps: float,
                             config: list[int]) -> None:
    config = _config_from_list(config)
    d = table.shape[1]
    _launch(_sparse_adam_rows_kernel, (distinct.numel(),), config,
            table_ptr=table, grad_ptr=grads, distinct_ptr=distinct, count_ptr=count, moment_ptr=moment,
            last_ptr=last, log_decay_ptr=log_decay_at, D=d, stride_t=table.stride(0), stride_g=grads.stride(0),
            event=event, log_decay=log_decay, one_minus_beta2=one_minus_beta2, bias=bias, lr=lr, decay=decay,
            eps=eps, BLOCK_D=triton.next_power_of_2(d))


_sparse_adam_rows_op = torch.library.custom_op(f"{_OPS}::sparse_adam_rows", _launch_sparse_adam_rows,
                                               mutates_args=("table", "moment", "last"))


def _check_sparse_adam(table, grads, groups, moment, last, log_decay_at):
    if table.ndim != 2 or table.stride(1) != 1 or grads.shape != (groups.distinct.numel(), table.shape[1]):
        raise ValueError(f"table must be (rows, D) with unit column stride and grads (N, D) fp32 for the N slots "
                         f"of the groups; got {tuple(table.shape)} and {tuple(grads.shape)}")
    if moment.dtype != torch.float32 or last.dtype != torch.int32 or log_decay_at.dtype != torch.float64:
        raise ValueError(f"moment must be fp32, last int32 and log_decay_at float64; got {moment.dtype}, "
                         f"{last.dtype}, {log_decay_at.dtype}")


def sparse_adam_rows_(table, grads, groups: RowGroups, moment, last, log_decay_at, step: RowAdamStep,
                      config=SPARSE_ADAM):
    """In place: Adam with beta1 = 0 on the rows of `table` (rows, D) in groups.distinct, with
    their summed fp32 gradients `grads` (N, D; slot s is distinct[s]). moment (rows,) fp32 and
    last (rows,) int32 (the event of each row's last update, 0 = never) are updated for those
    rows; log_decay_at (events + 1,) float64 holds, for each event, the log_decay of RowAdamStep
    (0 at event 0) and must hold this step's."""
    _check_sparse_adam(table, grads, groups, moment, last, log_decay_at)
    _sparse_adam_rows_op(table, grads, groups.distinct, groups.count, moment, last, log_decay_at, step.event,
                         step.log_decay, step.one_minus_beta2, step.bias, step.lr, step.decay, step.eps,
                         config.as_list())


def sparse_adam_rows_reference_(table, grads, groups: RowGroups, moment, last, log_decay_at, step: RowAdamStep,
                                config=None):
    _check_sparse_adam(table, grads, groups, moment, last, log_decay_at)
    # Slots past the count redo slot 0 (always a real row): their writes repeat its values.
    slots = torch.where(torch.arange(groups.distinct.numel(), device=table.device) < groups.count,
                        torch.arange(groups.distinct.numel(), device=table.device), 0)
    rows, g = groups.distinct[slots], grads[slots]
    missed = step.log_decay - log_decay_at[last[rows].long()]
    v = moment[rows] * torch.exp(missed).float() + step.one_minus_beta2 * ((g * g).sum(1) / g.shape[1])
    update = g / (torch.sqrt(v / step.bias) + step.eps)[:, None]
    w = table[rows].float()
    w = w - step.decay * torch.where(update * w > 0, w, 0.0)
    w = w - step.lr * update
    table.index_put_((rows,), w.to(table.dtype))
    moment.index_put_((rows,), v)
    last.index_put_((rows,), torch.full_like(rows, step.event, dtype=last.dtype))


# ---------------------------------------------------------------------------------------------
# 7. Composed local attention: the heads' maps mixed per token
# ---------------------------------------------------------------------------------------------
#
# Each head's map of a query over the last `window` keys of its document, P_h = softmax(scale
# q_h.k_h), is mixed per token into one map A = sum_h mix_in[:, h] P_h, and head h outputs
# mix_out[:, h] * (A @ V_h). A block of BLOCK_Q queries reads a span of SPAN keys that ends with
# its last query, so every window up to COMPOSED_MAX_WINDOW fits (SPAN >= BLOCK_Q + window - 1).
#
# Forward, one program per query block: the heads' scores and softmaxes, summed into A
# (BLOCK_Q x SPAN fp32, on chip), then A @ V_h per head. It stores the output, A and each head's
# row log-sum-exp. Traffic per block: its queries, SPAN keys and values of every head (each key
# is read by SPAN / BLOCK_Q blocks), the output, and A (SPAN fp32 per token).
# Backward, in three passes without atomics (every sum in a fixed order):
#   per query block: dA = sum_h mix_out_h dO_h V_h^T (stored, like A) and
#     d mix_out_h = rowsum(dO_h * (A V_h));
#   per query block and head, with P_h recomputed from the log-sum-exp: dP_h = mix_in_h dA,
#     d mix_in_h = rowsum(dA * P_h), Delta_h = rowsum(dP_h * P_h) = mix_in_h d mix_in_h (stored)
#     and dQ_h = scale (P_h * (dP_h - Delta_h)) K_h, over the span in two halves;
#   per key block and head: dV_h = sum over the SPAN / BLOCK_Q query blocks whose spans hold the
#     keys of (mix_out_h A)^T dO_h, and dK_h likewise of scale dS_h^T Q_h, from the stored A and
#     dA tiles.
# Registers bound the split: the dA pass holds A (as a bf16 dot operand) and dA, the dQ pass
# half-span tiles, the dK dV pass BLOCK_Q x BLOCK_Q tiles; at 8 warps none spills on sm_90
# (bench/sm90_report.py checks), where one pass for dA and dQ together did.

COMPOSED_MAX_WINDOW = 128          # the longest window of composed attention (the reference's block)
COMPOSED_FORWARD = LaunchConfig(block_m=64, block_n=256, num_warps=8)     # block_m queries, block_n keys (the span)
COMPOSED_BACKWARD_MIX = LaunchConfig(block_m=64, block_n=256, num_warps=8)
COMPOSED_BACKWARD_Q = LaunchConfig(block_m=64, block_n=256, num_warps=8)
COMPOSED_BACKWARD_KV = LaunchConfig(block_m=64, block_n=256, num_warps=8)  # block_m keys per program
COMPOSED_CONFIGS = [value for config in (COMPOSED_FORWARD, COMPOSED_BACKWARD_MIX, COMPOSED_BACKWARD_Q,
                                         COMPOSED_BACKWARD_KV) for value in config.as_list()]


@triton.jit
def _dc_visible(rows, cols, doc_start_ptr, num_tokens, window):
    """(rows, cols): key col is visible to query row: at or before it, inside the window, in its
    document. Rows past the end see nothing."""
    row_ok = rows < num_tokens
    first = tl.load(doc_start_ptr + rows, mask=row_ok, other=0)
    return (row_ok[:, None] & (cols[None, :] <= rows[:, None]) & (rows[:, None] - cols[None, :] < window)
            & (cols[None, :] >= first[:, None]))


@triton.jit
def _dc_load_heads(x_ptr, positions, h, stride_t, stride_h, num_tokens, D: tl.constexpr):
    """(len(positions), D) of head h; positions outside [0, num_tokens) read zeros."""
    ok = (positions >= 0) & (positions < num_tokens)
    return tl.load(x_ptr + positions[:, None] * stride_t + h * stride_h + tl.arange(0, D)[None, :],
                   mask=ok[:, None], other=0.0)


@triton.jit
def _dc_head_map(q, k, lse_ptr, rows, visible, h, num_tokens, scale):
    """P_h of the queries `rows` over keys k, from their stored log-sum-exp."""
    lse = tl.load(lse_ptr + h * num_tokens + rows, mask=rows < num_tokens, other=0.0)
    return tl.where(visible, tl.exp(tl.dot(q, tl.trans(k)) * scale - lse[:, None]), 0.0)


@triton.jit
def _dc_fwd_kernel(q_ptr, k_ptr, v_ptr, mix_in_ptr, mix_out_ptr, doc_start_ptr, scale_ptr, o_ptr, a_ptr, lse_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   num_tokens, num_heads, window,
                   D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_Q: tl.constexpr, SPAN: tl.constexpr):
    block = tl.program_id(0)
    rows = block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = block * BLOCK_Q + BLOCK_Q - SPAN + tl.arange(0, SPAN)
    row_ok = rows < num_tokens
    visible = _dc_visible(rows, cols, doc_start_ptr, num_tokens, window)
    scale = tl.load(scale_ptr)
    mixed = tl.zeros((BLOCK_Q, SPAN), dtype=tl.float32)
    for h in range(num_heads):
        q = _dc_load_heads(q_ptr, rows, h, stride_qt, stride_qh, num_tokens, D_QK)
        k = _dc_load_heads(k_ptr, cols, h, stride_kt, stride_kh, num_tokens, D_QK)
        s = tl.where(visible, tl.dot(q, tl.trans(k)) * scale, float("-inf"))
        m = tl.where(row_ok, tl.max(s, axis=1), 0.0)    # every real query sees at least itself
        p = tl.exp(s - m[:, None])
        total = tl.where(row_ok, tl.sum(p, axis=1), 1.0)
        tl.store(lse_ptr + h * num_tokens + rows, m + tl.log(total), mask=row_ok)
        mix = tl.load(mix_in_ptr + rows * num_heads + h, mask=row_ok, other=0.0)
        mixed += (mix / total)[:, None] * p
    tile = block * BLOCK_Q * SPAN + tl.arange(0, BLOCK_Q)[:, None] * SPAN + tl.arange(0, SPAN)[None, :]
    tl.store(a_ptr + tile, mixed)
    for h in range(num_heads):
        v = _dc_load_heads(v_ptr, cols, h, stride_vt, stride_vh, num_tokens, D_V)
        mix = tl.load(mix_out_ptr + rows * num_heads + h, mask=row_ok, other=0.0).to(tl.float32)
        out = tl.dot(mixed.to(v.dtype), v) * mix[:, None]
        tl.store(o_ptr + rows[:, None] * stride_ot + h * stride_oh + tl.arange(0, D_V)[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dc_bwd_mix_kernel(v_ptr, do_ptr, mix_out_ptr, a_ptr, da_ptr, dmix_out_ptr,
                       stride_vt, stride_vh, stride_dot, stride_doh, num_tokens, num_heads,
                       D_V: tl.constexpr, BLOCK_Q: tl.constexpr, SPAN: tl.constexpr):
    """dA = sum_h mix_out_h dO_h V_h^T of one query block (stored) and d mix_out."""
    block = tl.program_id(0)
    rows = block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    cols = block * BLOCK_Q + BLOCK_Q - SPAN + tl.arange(0, SPAN)
    row_ok = rows < num_tokens
    tile = block * BLOCK_Q * SPAN + tl.arange(0, BLOCK_Q)[:, None] * SPAN + tl.arange(0, SPAN)[None, :]
    mixed = tl.load(a_ptr + tile).to(v_ptr.dtype.element_ty)    # only a dot operand here
    grad_mixed = tl.zeros((BLOCK_Q, SPAN), dtype=tl.float32)
    for h in range(num_heads):
        v = _dc_load_heads(v_ptr, cols, h, stride_vt, stride_vh, num_tokens, D_V)
        do = _dc_load_heads(do_ptr, rows, h, stride_dot, stride_doh, num_tokens, D_V)
        mix = tl.load(mix_out_ptr + rows * num_heads + h, mask=row_ok, other=0.0).to(tl.float32)
        unmixed = tl.dot(mixed, v)                              # A @ V_h, before the output mix
        tl.store(dmix_out_ptr + rows * num_heads + h,
                 tl.sum(do.to(tl.float32) * unmixed, axis=1).to(dmix_out_ptr.dtype.element_ty), mask=row_ok)
        grad_mixed += mix[:, None] * tl.dot(do, tl.trans(v))
    tl.store(da_ptr + tile, grad_mixed)


@triton.jit
def _dc_half_span(q, k_ptr, lse_ptr, da_ptr, doc_start_ptr, block, half, rows, h, stride_kt, stride_kh, num_tokens,
                  window, scale, D_QK: tl.constexpr, BLOCK_Q: tl.constexpr, SPAN: tl.constexpr):
    """(K_h, P_h, dA) on one half of a query block's span."""
    offsets = half * (SPAN // 2) + tl.arange(0, SPAN // 2)
    cols = block * BLOCK_Q + BLOCK_Q - SPAN + offsets
    k = _dc_load_heads(k_ptr, cols, h, stride_kt, stride_kh, num_tokens, D_QK)
    p = _dc_head_map(q, k, lse_ptr, rows, _dc_visible(rows, cols, doc_start_ptr, num_tokens, window), h, num_tokens,
                     scale)
    grad_mixed = tl.load(da_ptr + block * BLOCK_Q * SPAN + tl.arange(0, BLOCK_Q)[:, None] * SPAN + offsets[None, :])
    return k, p, grad_mixed


@triton.jit
def _dc_bwd_q_kernel(q_ptr, k_ptr, mix_in_ptr, doc_start_ptr, scale_ptr, lse_ptr, da_ptr, delta_ptr, dq_ptr,
                     dmix_in_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_dqt, stride_dqh, num_tokens,
                     num_heads, window, D_QK: tl.constexpr, BLOCK_Q: tl.constexpr, SPAN: tl.constexpr):
    """For one query block and head, with P_h recomputed from the log-sum-exp, in two sweeps over
    the span's halves: d mix_in_h = rowsum(dA * P_h) and Delta_h = mix_in_h d mix_in_h (stored),
    then dQ_h = scale (P_h * (mix_in_h dA - Delta_h)) K_h."""
    block, h = tl.program_id(0), tl.program_id(1)
    rows = block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < num_tokens
    scale = tl.load(scale_ptr)
    q = _dc_load_heads(q_ptr, rows, h, stride_qt, stride_qh, num_tokens, D_QK)
    mix = tl.load(mix_in_ptr + rows * num_heads + h, mask=row_ok, other=0.0)
    grad_mix = tl.zeros((BLOCK_Q,), dtype=tl.float32)
    for half in range(2):
        k, p, grad_mixed = _dc_half_span(q, k_ptr, lse_ptr, da_ptr, doc_start_ptr, block, half, rows, h, stride_kt,
                                         stride_kh, num_tokens, window, scale, D_QK, BLOCK_Q, SPAN)
        grad_mix += tl.sum(grad_mixed * p, axis=1)
    tl.store(dmix_in_ptr + rows * num_heads + h, grad_mix, mask=row_ok)
    delta = mix * grad_mix
    tl.store(delta_ptr + h * num_tokens + rows, delta, mask=row_ok)
    dq = tl.zeros((BLOCK_Q, D_QK), dtype=tl.float32)
    for half in range(2):
        k, p, grad_mixed = _dc_half_span(q, k_ptr, lse_ptr, da_ptr, doc_start_ptr, block, half, rows, h, stride_kt,
                                         stride_kh, num_tokens, window, scale, D_QK, BLOCK_Q, SPAN)
        dq += tl.dot((p * (mix[:, None] * grad_mixed - delta[:, None])).to(k.dtype), k)
    tl.store(dq_ptr + rows[:, None] * stride_dqt + h * stride_dqh + tl.arange(0, D_QK)[None, :],
             (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _dc_bwd_kv_kernel(q_ptr, k_ptr, do_ptr, mix_in_ptr, mix_out_ptr, doc_start_ptr, scale_ptr, a_ptr, lse_ptr,
                      da_ptr, delta_ptr, dk_ptr, dv_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh,
                      stride_dkt, stride_dkh, stride_dvt, stride_dvh, num_tokens, num_heads, window,
                      D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_Q: tl.constexpr, SPAN: tl.constexpr):
    block, h = tl.program_id(0), tl.program_id(1)
    keys = block * BLOCK_Q + tl.arange(0, BLOCK_Q)
    key_ok = keys < num_tokens
    k = _dc_load_heads(k_ptr, keys, h, stride_kt, stride_kh, num_tokens, D_QK)
    scale = tl.load(scale_ptr)
    dk = tl.zeros((BLOCK_Q, D_QK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_Q, D_V), dtype=tl.float32)
    for m in range(SPAN // BLOCK_Q):      # query block `block + m` holds these keys in its span
        rows = (block + m) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        row_ok = rows < num_tokens
        first_col = SPAN - BLOCK_Q - m * BLOCK_Q
        tile = ((block + m) * BLOCK_Q * SPAN + tl.arange(0, BLOCK_Q)[:, None] * SPAN + first_col
                + tl.arange(0, BLOCK_Q)[None, :])
        mixed = tl.load(a_ptr + tile, mask=row_ok[:, None], other=0.0)
        grad_mixed = tl.load(da_ptr + tile, mask=row_ok[:, None], other=0.0)
        do = _dc_load_heads(do_ptr, rows, h, stride_dot, stride_doh, num_tokens, D_V)
        mix_out = tl.load(mix_out_ptr + rows * num_heads + h, mask=row_ok, other=0.0).to(tl.float32)
        dv += tl.dot(tl.trans((mixed * mix_out[:, None]).to(do.dtype)), do)
        q = _dc_load_heads(q_ptr, rows, h, stride_qt, stride_qh, num_tokens, D_QK)
        visible = _dc_visible(rows, keys, doc_start_ptr, num_tokens, window)
        p = _dc_head_map(q, k, lse_ptr, rows, visible, h, num_tokens, scale)
        mix_in = tl.load(mix_in_ptr + rows * num_heads + h, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + h * num_tokens + rows, mask=row_ok, other=0.0)
        grad_s = p * (mix_in[:, None] * grad_mixed - delta[:, None])
        dk += tl.dot(tl.trans(grad_s.to(q.dtype)), q)
    tl.store(dk_ptr + keys[:, None] * stride_dkt + h * stride_dkh + tl.arange(0, D_QK)[None, :],
             (dk * scale).to(dk_ptr.dtype.element_ty), mask=key_ok[:, None])
    tl.store(dv_ptr + keys[:, None] * stride_dvt + h * stride_dvh + tl.arange(0, D_V)[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=key_ok[:, None])


def _composed_configs(configs):
    """(forward, backward dA, backward dQ, backward dK dV) launch configs from their flat list."""
    return _configs_from_list(configs, 4)


def _launch_dc_fwd(q: Tensor, k: Tensor, v: Tensor, mix_in: Tensor, mix_out: Tensor, doc_start: Tensor,
                   scale: Tensor, window: int, configs: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    config = _composed_configs(configs)[0]
    T, H, d_qk = q.shape
    d_v = v.shape[2]
    blocks = triton.cdiv(T, config.block_m)
    o = torch.empty(T, H, d_v, dtype=v.dtype, device=q.device)
    mixed = torch.empty(blocks, config.block_m, config.block_n, dtype=torch.float32, device=q.device)
    lse = torch.empty(H, T, dtype=torch.float32, device=q.device)
    _launch(_dc_fwd_kernel, (blocks,), config, q_ptr=q, k_ptr=k, v_ptr=v, mix_in_ptr=mix_in, mix_out_ptr=mix_out,
            doc_start_ptr=doc_start, scale_ptr=scale, o_ptr=o, a_ptr=mixed, lse_ptr=lse,
            stride_qt=q.stride(0), stride_qh=q.stride(1), stride_kt=k.stride(0), stride_kh=k.stride(1),
            stride_vt=v.stride(0), stride_vh=v.stride(1), stride_ot=o.stride(0), stride_oh=o.stride(1),
            num_tokens=T, num_heads=H, window=window, D_QK=d_qk, D_V=d_v, BLOCK_Q=config.block_m,
            SPAN=config.block_n)
    return o, mixed, lse


def _launch_dc_bwd(grad_o: Tensor, q: Tensor, k: Tensor, v: Tensor, mix_in: Tensor, mix_out: Tensor,
                   doc_start: Tensor, scale: Tensor, mixed: Tensor, lse: Tensor, window: int,
                   configs: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _, mix_config, q_config, kv_config = _composed_configs(configs)
    T, H, d_qk = q.shape
    d_v = v.shape[2]
    grad_mixed, delta = torch.empty_like(mixed), torch.empty_like(lse)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dmix_in, dmix_out = torch.empty_like(mix_in), torch.empty_like(mix_out)
    blocks, block, span = triton.cdiv(T, q_config.block_m), q_config.block_m, q_config.block_n
    _launch(_dc_bwd_mix_kernel, (blocks,), mix_config, v_ptr=v, do_ptr=grad_o, mix_out_ptr=mix_out, a_ptr=mixed,
            da_ptr=grad_mixed, dmix_out_ptr=dmix_out, stride_vt=v.stride(0), stride_vh=v.stride(1),
            stride_dot=grad_o.stride(0), stride_doh=grad_o.stride(1), num_tokens=T, num_heads=H, D_V=d_v,
            BLOCK_Q=block, SPAN=span)
    common = dict(q_ptr=q, k_ptr=k, mix_in_ptr=mix_in, doc_start_ptr=doc_start, scale_ptr=scale, lse_ptr=lse,
                  da_ptr=grad_mixed, delta_ptr=delta, stride_qt=q.stride(0), stride_qh=q.stride(1),
                  stride_kt=k.stride(0), stride_kh=k.stride(1), num_tokens=T, num_heads=H, window=window,
                  D_QK=d_qk, BLOCK_Q=block, SPAN=span)
    _launch(_dc_bwd_q_kernel, (blocks, H), q_config, dq_ptr=dq, dmix_in_ptr=dmix_in, stride_dqt=dq.stride(0),
            stride_dqh=dq.stride(1), **common)
    _launch(_dc_bwd_kv_kernel, (blocks, H), kv_config, do_ptr=grad_o, mix_out_ptr=mix_out, a_ptr=mixed, dk_ptr=dk,
            dv_ptr=dv, stride_dot=grad_o.stride(0), stride_doh=grad_o.stride(1), stride_dkt=dk.stride(0),
            stride_dkh=dk.stride(1), stride_dvt=dv.stride(0), stride_dvh=dv.stride(1), D_V=d_v, **common)
    return dq, dk, dv, dmix_in, dmix_out


_dc_fwd_op = torch.library.custom_op(f"{_OPS}::composed_attn_fwd", _launch_dc_fwd, mutates_args=())
_dc_bwd_op = torch.library.custom_op(f"{_OPS}::composed_attn_bwd", _launch_dc_bwd, mutates_args=())


@_dc_fwd_op.register_fake
def _(q, k, v, mix_in, mix_out, doc_start, scale, window, configs):
    config = _composed_configs(configs)[0]
    T, H, _ = q.shape
    return (v.new_empty(T, H, v.shape[2]),
            q.new_empty(triton.cdiv(T, config.block_m), config.block_m, config.block_n, dtype=torch.float32),
            q.new_empty(H, T, dtype=torch.float32))


@_dc_bwd_op.register_fake
def _(grad_o, q, k, v, mix_in, mix_out, doc_start, scale, mixed, lse, window, configs):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(mix_in),
            torch.empty_like(mix_out))


class _ComposedAttention(torch.autograd.Function):
    """Differentiable composed attention: forward saves A and the heads' log-sum-exps."""

    @staticmethod
    def forward(ctx, q, k, v, mix_in, mix_out, doc_start, scale, window, configs):
        o, mixed, lse = _dc_fwd_op(q, k, v, mix_in, mix_out, doc_start, scale, window, configs)
        ctx.save_for_backward(q, k, v, mix_in, mix_out, doc_start, scale, mixed, lse)
        ctx.args = (window, configs)
        return o

    @staticmethod
    def backward(ctx, grad_o):
        q, k, v, mix_in, mix_out, doc_start, scale, mixed, lse = ctx.saved_tensors
        dq, dk, dv, dmix_in, dmix_out = _dc_bwd_op(_last_dim_contiguous(grad_o), q, k, v, mix_in, mix_out,
                                                   doc_start, scale, mixed, lse, *ctx.args)
        return dq, dk, dv, dmix_in, dmix_out, None, None, None, None


def _check_composed_inputs(q, k, v, doc_start, window, mix_in, mix_out, configs):
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"composed_attention needs q, k (T, H, Dqk) and v (T, H, Dv); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    T, H = q.shape[:2]
    if mix_in.shape != (T, H) or mix_out.shape != (T, H) or mix_in.dtype != torch.float32:
        raise ValueError(f"composed_attention needs mix_in (fp32) and mix_out of shape {(T, H)}; got "
                         f"{tuple(mix_in.shape)} {mix_in.dtype}, {tuple(mix_out.shape)}")
    if doc_start.shape != (T,) or doc_start.dtype not in (torch.int32, torch.int64):
        raise ValueError("composed_attention needs doc_start: (T,) int, the first position of each token's document")
    if not 1 <= window <= COMPOSED_MAX_WINDOW:
        raise ValueError(f"composed_attention takes windows of 1 to {COMPOSED_MAX_WINDOW} tokens; got {window}")
    if len(configs) != len(COMPOSED_CONFIGS):
        raise ValueError("composed_attention takes four launch configs (forward, dA, dQ, dK and dV), flattened")
    for config in _composed_configs(configs):
        if (config.block_m, config.block_n) != (configs[0], configs[1]) or \
                config.block_n < config.block_m + COMPOSED_MAX_WINDOW - 1 or config.block_n % config.block_m:
            raise ValueError("composed_attention's four configs need one query block and one key span, the span "
                             "a multiple of the block holding the block and the longest window")


def composed_attention(q, k, v, doc_start, window, scale, mix_in, mix_out, configs=COMPOSED_CONFIGS):
    """Composed local attention (see the section's notes): (T, H, Dv), the additions to the heads'
    outputs. q, k (T, H, Dqk), v (T, H, Dv) in one dtype; doc_start (T,) the first position of
    each token's document; window <= COMPOSED_MAX_WINDOW; scale a number or a one-element fp32
    tensor; mix_in (T, H) fp32 and mix_out (T, H), the per-token head mixes."""
    _check_composed_inputs(q, k, v, doc_start, window, mix_in, mix_out, configs)
    _check_attention_dtypes(q, k, v, name="composed_attention")
    scale = softmax_scale_tensor(scale, q.device).float()
    return _ComposedAttention.apply(_last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v),
                                    mix_in.contiguous(), mix_out.contiguous(), doc_start.contiguous(), scale,
                                    window, configs)


# the reference's queries per block, each block against its own and the previous block's keys
COMPOSED_REFERENCE_BLOCK = COMPOSED_MAX_WINDOW


def composed_attention_reference(q, k, v, doc_start, window, scale, mix_in, mix_out, configs=None):
    """The definition in plain torch: each head's map P_h[t] over the last `window` keys of the
    query's document (softmax of the same scaled q.k) is mixed into one map per token,
    A[t] = sum_h mix_in[t, h] P_h[t]; head h gets mix_out[t, h] * A[t] @ V_h. Queries go in blocks,
    each against its own and the previous block's keys, so the maps take O(T x 2 block x H)
    memory and every shape is static."""
    T, H, _ = q.shape
    block = COMPOSED_REFERENCE_BLOCK
    n, pad = -(-T // block), -T % block

    def blocks(x, front):          # (T, ...) -> (n, block, ...), `front` zero blocks before
        return F.pad(x, (0, 0) * (x.dim() - 1) + (front * block, pad)).view(n + front, block, *x.shape[1:])

    def key_windows(x):            # (n, 2 block, ...): the block before each query block, then that block
        b = blocks(x, 1)
        return torch.cat([b[:-1], b[1:]], dim=1)
    q_pos = torch.arange(n * block, device=q.device).view(n, block)
    k_pos = q_pos[:, :1] - block + torch.arange(2 * block, device=q.device)
    first = F.pad(doc_start, (0, pad)).view(n, block)
    visible = ((k_pos[:, None, :] <= q_pos[:, :, None]) & (q_pos[:, :, None] - k_pos[:, None, :] < window)
               & (k_pos[:, None, :] >= first[:, :, None]))                       # (n, queries, keys)
    scores = torch.einsum("nihd,njhd->nhij", blocks(q, 0), key_windows(k)).float() * scale
    maps = scores.masked_fill(~visible[:, None], float("-inf")).softmax(dim=-1)
    mixed = torch.einsum("nhij,nih->nij", maps, blocks(mix_in.float(), 0))
    out = torch.einsum("nij,njhd->nihd", mixed.to(v.dtype), key_windows(v)) * blocks(mix_out, 0)[..., None].to(v.dtype)
    return out.reshape(n * block, H, -1)[:T]


# ---------------------------------------------------------------------------------------------
# 8. Weight averages: an fp32 EMA moved toward a weight of any float dtype
# ---------------------------------------------------------------------------------------------
#
# ema <- lerp(ema, w, rate), torch.lerp's formula: ema + rate (w - ema) for rate < 0.5, else
# w - (1 - rate) (w - ema). torch.lerp_ needs w in the EMA's dtype, an fp32 copy of a bf16
# weight written and read back (4 + 4 bytes an element and a launch more); the kernel reads w
# as it is: 4 + 2 + 4 bytes an element for a bf16 weight.

EMA_UPDATE = LaunchConfig(block_m=1024, block_n=0, num_warps=4)  # block_m elements per program


@triton.jit
def _ema_update_kernel(ema_ptr, w_ptr, n, rate, BLOCK: tl.constexpr):
    offsets = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    mask = offsets < n
    ema = tl.load(ema_ptr + offsets, mask=mask, other=0.0)
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    step = w - ema
    moved = tl.where(rate < 0.5, tl.fma(step, rate, ema), tl.fma(-step, 1.0 - rate, w))
    tl.store(ema_ptr + offsets, moved, mask=mask)


def _launch_ema_update(ema: Tensor, weight: Tensor, rate: float, config: list[int]) -> None:
    config = _config_from_list(config)
    n = ema.numel()
    _launch(_ema_update_kernel, (triton.cdiv(n, config.block_m),), config,
            ema_ptr=ema, w_ptr=weight, n=n, rate=rate, BLOCK=config.block_m)


_ema_update_op = torch.library.custom_op(f"{_OPS}::ema_update", _launch_ema_update, mutates_args=("ema",))


def _check_ema_inputs(ema, weight):
    if ema.dtype != torch.float32 or ema.shape != weight.shape or not (ema.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"ema_update_: the EMA must be contiguous float32 of the weight's shape and the weight "
                         f"contiguous; got {ema.dtype} {tuple(ema.shape)} and {weight.dtype} {tuple(weight.shape)}")


def ema_update_(ema, weight, rate, config=EMA_UPDATE):
    """ema (fp32) <- lerp(ema, weight, rate) in place, reading weight (any float dtype) as it is."""
    _check_ema_inputs(ema, weight)
    _ema_update_op(ema, weight, float(rate), config.as_list())
    return ema


def ema_update_reference_(ema, weight, rate, config=None):
    _check_ema_inputs(ema, weight)
    return ema.lerp_(weight.float(), rate)


# ---------------------------------------------------------------------------------------------
# 9. Pointer mixture: one attention head over the document's earlier tokens, with a sink
# ---------------------------------------------------------------------------------------------
#
# The next-token distribution mixes the LM's softmax with a pointer (PR 379's copy-sink pointer
# LM). Query i attends to the earlier positions j < i of its own document inside a band (query
# block b = i // band sees keys from block b - 1 on) and to a learned sink key. Position j
# proposes its own token, tokens[j]; the pointer's probability of the target y_i is the mass on
# the positions proposing it, p_copy_i = sum_j a_ij [tokens[j] == y_i], and the sink's mass
# a_sink_i goes back to the LM. pointer_attention computes (p_copy, a_sink) without the (T, T)
# score matrix; pointer_mixture_cross_entropy turns them and the logits into the loss.

POINTER_FORWARD = LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)   # block_m queries, block_n keys
POINTER_BACKWARD_Q = LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
POINTER_BACKWARD_K = LaunchConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)  # block_n keys per program
POINTER_CONFIGS = [value for config in (POINTER_FORWARD, POINTER_BACKWARD_Q, POINTER_BACKWARD_K)
                   for value in config.as_list()]


def pointer_band_start(positions, band):
    """The first key a query at `positions` may see: block b = position // band sees from block
    b - 1 on (PR 379's band: whole documents when they are at most `band` tokens)."""
    return torch.clamp((positions // band - 1) * band, min=0)


def pointer_document_starts(tokens, bos):
    """(T,) int64: the first position of each token's document, a document starting at every
    `bos` token and at position 0."""
    T = tokens.shape[0]
    positions = torch.arange(T, device=tokens.device)
    starts = (tokens == bos) | (positions == 0)
    return torch.cummax(torch.where(starts, positions, 0), dim=0).values


@triton.jit
def _pointer_scores(q, k_ptr, keys, key_ok, rows, first_key, scale, D: tl.constexpr):
    """The (BLOCK_M, BLOCK_N) scores q.k * scale of one key block, -inf where the query may not
    see the key (j < i, j >= its first visible key)."""
    k = tl.load(k_ptr + keys.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], mask=key_ok[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    visible = (keys[None, :] < rows[:, None]) & (keys[None, :] >= first_key[:, None]) & key_ok[None, :]
    return tl.where(visible, s, float("-inf")), k


@triton.jit
def _pointer_fwd_kernel(q_ptr, k_ptr, s0_ptr, tok_ptr, tgt_ptr, doc_ptr, p_ptr, a_ptr, lse_ptr, T, band, scale,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One block of BLOCK_M queries: an online softmax over the key blocks from the block's
    first visible key to its last query, started at the sink (running max = the sink's score,
    running sum = 1, so a query with no visible key is all sink), accumulating beside the sum
    the mass on keys whose token is the query's target. Writes p_copy = that mass / sum, a_sink
    = exp(s0 - max) / sum and the log-sum-exp for the backward. Traffic: the block's queries once
    and each visited key block once (D values a key, one token); no score matrix in memory."""
    start = tl.program_id(0) * BLOCK_M
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
    s0 = tl.load(s0_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    doc = tl.load(doc_ptr + rows, mask=row_ok, other=0)
    first_key = tl.maximum(doc, tl.maximum((rows // band - 1) * band, 0))
    lo = (tl.min(tl.where(row_ok, first_key, T), axis=0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start + BLOCK_M, T)
    m_i = s0
    l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    hit = tl.zeros([BLOCK_M], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < T
        s, _ = _pointer_scores(q, k_ptr, keys, key_ok, rows, first_key, scale, D)
        tok = tl.load(tok_ptr + keys, mask=key_ok, other=-2)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        hit = hit * alpha + tl.sum(tl.where(tok[None, :] == tgt[:, None], p, 0.0), axis=1)
        m_i = m_new
    tl.store(p_ptr + rows, hit / l_i, mask=row_ok)
    tl.store(a_ptr + rows, tl.exp(s0 - m_i) / l_i, mask=row_ok)
    tl.store(lse_ptr + rows, m_i + tl.log(l_i), mask=row_ok)


@triton.jit
def _pointer_dscores(s, lse, tok, tgt, g_p, delta):
    """dL/ds_ij = a_ij (g_p_i [tokens[j] == y_i] - delta_i), a_ij = exp(s_ij - lse_i), with
    delta_i = g_p_i p_copy_i + g_a_i a_sink_i (0 where the key is not visible: s = -inf)."""
    a = tl.exp(s - lse[:, None])
    hit = tok[None, :] == tgt[:, None]
    return a * (tl.where(hit, g_p[:, None], 0.0) - delta[:, None])


@triton.jit
def _pointer_bwd_q_kernel(q_ptr, k_ptr, tok_ptr, tgt_ptr, doc_ptr, lse_ptr, gp_ptr, delta_ptr, dq_ptr, T, band, scale,
                          D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dq of one query block: the forward's key blocks again, dq_i = scale sum_j dL/ds_ij k_j
    (the sink's share, through the sink's score, is the caller's). Traffic as the forward's."""
    start = tl.program_id(0) * BLOCK_M
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    doc = tl.load(doc_ptr + rows, mask=row_ok, other=0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    g_p = tl.load(gp_ptr + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    first_key = tl.maximum(doc, tl.maximum((rows // band - 1) * band, 0))
    lo = (tl.min(tl.where(row_ok, first_key, T), axis=0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start + BLOCK_M, T)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        key_ok = keys < T
        s, k = _pointer_scores(q, k_ptr, keys, key_ok, rows, first_key, scale, D)
        tok = tl.load(tok_ptr + keys, mask=key_ok, other=-2)
        ds = _pointer_dscores(s, lse, tok, tgt, g_p, delta)
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(dq_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], dq * scale, mask=row_ok[:, None])


@triton.jit
def _pointer_bwd_k_kernel(q_ptr, k_ptr, tok_ptr, tgt_ptr, doc_ptr, end_ptr, lse_ptr, gp_ptr, delta_ptr, dk_ptr, T,
                          band, scale, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk of one block of BLOCK_N keys: the query blocks that can see them, from the block's
    first key to its last key's document end or band end (a key of block c is seen by queries
    up to block c + 1), dk_j = scale sum_i dL/ds_ij q_i. Traffic: the block's keys once, each
    visited query block's queries and row statistics once."""
    start = tl.program_id(0) * BLOCK_N
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < T
    k = tl.load(k_ptr + keys.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], mask=key_ok[:, None], other=0.0)
    tok = tl.load(tok_ptr + keys, mask=key_ok, other=-2)
    last = tl.minimum(start + BLOCK_N, T) - 1
    hi = tl.minimum(tl.minimum(tl.load(end_ptr + last), (last // band + 2) * band), T)
    lo = (start // BLOCK_M) * BLOCK_M
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    for m0 in range(lo, hi, BLOCK_M):
        rows = m0 + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], mask=row_ok[:, None],
                    other=0.0)
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        doc = tl.load(doc_ptr + rows, mask=row_ok, other=T)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        g_p = tl.load(gp_ptr + rows, mask=row_ok, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
        first_key = tl.maximum(doc, tl.maximum((rows // band - 1) * band, 0))
        s = tl.dot(q, tl.trans(k)) * scale
        visible = (keys[None, :] < rows[:, None]) & (keys[None, :] >= first_key[:, None]) & key_ok[None, :] \
            & row_ok[:, None]
        s = tl.where(visible, s, float("-inf"))
        ds = _pointer_dscores(s, lse, tok, tgt, g_p, delta)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(dk_ptr + keys.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], dk * scale, mask=key_ok[:, None])


def _pointer_configs(configs):
    """(forward, backward dQ, backward dK) launch configs from their flat list."""
    return _configs_from_list(configs, 3)


def _launch_pointer_fwd(q: Tensor, k: Tensor, s0: Tensor, tokens: Tensor, targets: Tensor, doc: Tensor, band: int,
                        configs: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    config = _pointer_configs(configs)[0]
    T, D = q.shape
    p, a, lse = (torch.empty(T, dtype=torch.float32, device=q.device) for _ in range(3))
    _launch(_pointer_fwd_kernel, (triton.cdiv(T, config.block_m),), config, q_ptr=q, k_ptr=k, s0_ptr=s0,
            tok_ptr=tokens, tgt_ptr=targets, doc_ptr=doc, p_ptr=p, a_ptr=a, lse_ptr=lse, T=T, band=band,
            scale=D ** -0.5, D=D, BLOCK_M=config.block_m, BLOCK_N=config.block_n)
    return p, a, lse


def _launch_pointer_bwd(q: Tensor, k: Tensor, tokens: Tensor, targets: Tensor, doc: Tensor, doc_end: Tensor,
                        lse: Tensor, g_p: Tensor, delta: Tensor, band: int,
                        configs: list[int]) -> tuple[Tensor, Tensor]:
    _, q_config, k_config = _pointer_configs(configs)
    T, D = q.shape
    dq = torch.empty(T, D, dtype=torch.float32, device=q.device)
    dk = torch.empty_like(dq)
    common = dict(q_ptr=q, k_ptr=k, tok_ptr=tokens, tgt_ptr=targets, doc_ptr=doc, lse_ptr=lse, gp_ptr=g_p,
                  delta_ptr=delta, T=T, band=band, scale=D ** -0.5, D=D)
    _launch(_pointer_bwd_q_kernel, (triton.cdiv(T, q_config.block_m),), q_config, dq_ptr=dq,
            BLOCK_M=q_config.block_m, BLOCK_N=q_config.block_n, **common)
    _launch(_pointer_bwd_k_kernel, (triton.cdiv(T, k_config.block_n),), k_config, end_ptr=doc_end, dk_ptr=dk,
            BLOCK_M=k_config.block_m, BLOCK_N=k_config.block_n, **common)
    return dq, dk


_pointer_fwd_op = torch.library.custom_op(f"{_OPS}::pointer_fwd", _launch_pointer_fwd, mutates_args=())
_pointer_bwd_op = torch.library.custom_op(f"{_OPS}::pointer_bwd", _launch_pointer_bwd, mutates_args=())


@_pointer_fwd_op.register_fake
def _(q, k, s0, tokens, targets, doc, band, configs):
    return tuple(q.new_empty(q.shape[0], dtype=torch.float32) for _ in range(3))


@_pointer_bwd_op.register_fake
def _(q, k, tokens, targets, doc, doc_end, lse, g_p, delta, band, configs):
    return q.new_empty(q.shape, dtype=torch.float32), q.new_empty(q.shape, dtype=torch.float32)


class _PointerAttention(torch.autograd.Function):
    """Differentiable pointer attention: the forward saves each query's log-sum-exp (sink
    included), the backward recomputes the scores tile by tile. With delta_i = g_p_i p_i + g_a_i a_i:
    dL/ds0_i = a_i (g_a_i - delta_i) (the sink's score), dq and dk from the kernels."""

    @staticmethod
    def forward(ctx, q, k, s0, tokens, targets, doc, doc_end, band, configs):
        p, a, lse = _pointer_fwd_op(q, k, s0, tokens, targets, doc, band, configs)
        ctx.save_for_backward(q, k, tokens, targets, doc, doc_end, lse, p, a)
        ctx.args = (band, configs)
        return p, a

    @staticmethod
    def backward(ctx, g_p, g_a):
        q, k, tokens, targets, doc, doc_end, lse, p, a = ctx.saved_tensors
        g_p = torch.zeros_like(p) if g_p is None else g_p.float().contiguous()
        g_a = torch.zeros_like(a) if g_a is None else g_a.float().contiguous()
        delta = (g_p * p + g_a * a).contiguous()
        dq, dk = _pointer_bwd_op(q, k, tokens, targets, doc, doc_end, lse, g_p, delta, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), a * (g_a - delta), None, None, None, None, None, None


def _check_pointer_inputs(q, k, sink_scores, tokens, targets, doc_start, band):
    if q.dim() != 2 or k.shape != q.shape or q.dtype != k.dtype:
        raise ValueError(f"pointer_attention needs q and k (T, D) of one dtype; got {tuple(q.shape)} {q.dtype} and "
                         f"{tuple(k.shape)} {k.dtype}")
    T = q.shape[0]
    if any(t.shape != (T,) for t in (sink_scores, tokens, targets, doc_start)):
        raise ValueError("pointer_attention needs sink_scores, tokens, targets and doc_start of shape (T,)")
    if band < 1:
        raise ValueError(f"pointer_attention needs a band of at least one token; got {band}")


def pointer_attention(q, k, sink_scores, tokens, targets, doc_start, band, configs=None):
    """(p_copy, a_sink), both (T,) fp32, differentiable in q, k and sink_scores (see
    pointer_attention_reference for the semantics), by the flash-style Triton kernels: no (T, T)
    scores in memory. q, k (T, D) of one dtype, D a power of two >= 16; sink_scores (T,) fp32, the
    sink's scaled scores; tokens, targets (T,) ints (-1: no target); doc_start (T,) the first
    position of each token's document (pointer_document_starts); band in tokens. configs: the
    three launch configs, flattened (default POINTER_CONFIGS)."""
    _check_pointer_inputs(q, k, sink_scores, tokens, targets, doc_start, band)
    T = q.shape[0]
    doc = doc_start.to(torch.int32).contiguous()
    positions = torch.arange(T, device=q.device, dtype=torch.int32)
    is_start = doc == positions
    # one past each token's document: the next start after it (searchsorted over the starts' positions)
    starts = torch.where(is_start, positions, T).sort().values
    doc_end = starts[torch.searchsorted(starts, positions, right=True).clamp(max=T - 1)].to(torch.int32)
    doc_end = torch.where(doc_end > positions, doc_end, T).contiguous()
    return _PointerAttention.apply(_last_dim_contiguous(q), _last_dim_contiguous(k), sink_scores.float().contiguous(),
                                   tokens.to(torch.int32).contiguous(), targets.to(torch.int32).contiguous(), doc,
                                   doc_end, int(band), list(configs or POINTER_CONFIGS))


def pointer_attention_reference(q, k, sink_scores, tokens, targets, doc_start, band, configs=None):
    """(p_copy, a_sink), both (T,) fp32 (float64 for float64 inputs), in plain torch.

    Scores s_ij = q_i . k_j / sqrt(D) for the keys query i may see: j < i, j >= doc_start[i] (its
    own document), j >= pointer_band_start(i, band); and the sink's sink_scores[i]. a = softmax
    over those and the sink; p_copy_i = sum_j a_ij [tokens[j] == targets[i]], a_sink_i the sink's
    share. Computed band by band: the queries of block b against the keys of blocks b - 1 and b
    ((band, 2 band) scores at a time), so memory grows with T x band, not T^2."""
    _check_pointer_inputs(q, k, sink_scores, tokens, targets, doc_start, band)
    T, D = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, s0 = q.to(dtype), k.to(dtype), sink_scores.to(dtype)
    L = min(int(band), max(T, 1))  # a band past T sees what one of T sees: every earlier key
    blocks = -(-T // L)
    pad = blocks * L - T
    positions = torch.arange(blocks * L, device=q.device)

    def padded(x, value):
        return torch.cat([x, x.new_full((pad, *x.shape[1:]), value)]) if pad else x
    qb = padded(q, 0.0).view(blocks, L, D)
    kb = torch.cat([k.new_zeros(L, D), padded(k, 0.0)]).unfold(0, 2 * L, L).transpose(1, 2)     # (blocks, 2L, D)
    key_pos = torch.cat([positions.new_full((L,), -1), positions]).unfold(0, 2 * L, L)          # (blocks, 2L)
    key_tok = torch.cat([tokens.new_full((L,), -2), padded(tokens, -2)]).unfold(0, 2 * L, L)
    first = padded(torch.maximum(doc_start.long(), pointer_band_start(positions[:T], L)), 0).view(blocks, L, 1)
    qpos = positions.view(blocks, L, 1)
    visible = (key_pos[:, None, :] < qpos) & (key_pos[:, None, :] >= first)
    scores = torch.where(visible, qb @ kb.transpose(1, 2) * D ** -0.5, float("-inf"))
    s0b = padded(s0, 0.0).view(blocks, L, 1)
    top = torch.maximum(scores.amax(-1, keepdim=True), s0b).detach()
    e = torch.exp(scores - top)
    e0 = torch.exp(s0b - top)
    total = e.sum(-1, keepdim=True) + e0
    hit = key_tok[:, None, :] == padded(targets, -1).view(blocks, L, 1)
    p_copy = (torch.where(hit, e, 0.0).sum(-1, keepdim=True) / total).reshape(-1)[:T]
    a_sink = (e0 / total).reshape(-1)[:T]
    return p_copy, a_sink


def pointer_mixture_nll(z, targets, copy_col, p_copy, a_sink):
    """(T,) -log p(y) of the mixture, from softcapped logits z (T, C) whose column copy_col (an
    int or a 0-d int tensor) is the <copy> slot: the gate alpha = softmax(z)[copy], the LM over
    the other columns p_lm(y) = softmax of z without the copy column, and
        p(y) = p_lm(y) (1 - alpha (1 - a_sink)) + alpha p_copy,
    which sums to 1 over the vocabulary (PR 379's mixture). targets (T,) column indices; a row
    whose target is outside [0, C) gets 0."""
    columns = torch.arange(z.shape[1], device=z.device)
    is_copy = columns == copy_col
    lse = torch.logsumexp(z, dim=-1)
    lse_lm = torch.logsumexp(z.masked_fill(is_copy, float("-inf")), dim=-1)
    alpha = torch.exp((z * is_copy).sum(-1) - lse)
    present = (targets >= 0) & (targets < z.shape[1])
    z_target = z.gather(1, torch.where(present, targets, 0)[:, None])[:, 0]
    p_lm = torch.exp(z_target - lse_lm)
    mixed = p_lm * (1.0 - alpha * (1.0 - a_sink)) + alpha * p_copy
    return torch.where(present, -torch.log(torch.where(present, mixed, 1.0)), 0.0)


def pointer_mixture_cross_entropy(logits, targets, weights, copy_col, p_copy, a_sink, grad_scale=1.0,
                                  exact_upstream=False):
    """softcap_cross_entropy_reference with the next-token term (column 0 of targets) replaced by
    the mixture's -log p(y) (pointer_mixture_nll); the other targets (multi-token, prefix) keep
    the softcapped cross-entropy over all C columns, <copy> included (PR 379's default). Returns
    (loss, next_token_loss), (T,) fp32: the weighted sum, and the mixture's next-token loss
    (detached). Plain torch, differentiable in logits, p_copy and a_sink; its logit gradient is
    w0 (g_lse softmax + g_y [v = y] + g_c [v = copy]) for three row scalars, which the fused
    cross-entropy (pointer_mixture_softcap_cross_entropy) writes in its one pass; this reference
    materializes z and its gradient. grad_scale and exact_upstream: hints, as in
    softcap_cross_entropy_reference."""
    z = softcap(logits)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    present = (targets >= 0) & (targets < z.shape[1])
    picked = z.gather(1, torch.where(present, targets, 0))
    losses = torch.where(present, lse - picked, torch.zeros_like(picked))
    mixture = pointer_mixture_nll(z, targets[:, 0], copy_col, p_copy.float(), a_sink.float())
    losses = torch.cat([mixture[:, None].to(losses), losses[:, 1:]], dim=1)
    return (losses * weights.to(losses)).sum(dim=1), mixture.detach()


# The mixture inside the softcapped cross-entropy kernel (_softcap_ce_kernel's MIXTURE): one pass
# over the logits as without the pointer, plus two row scalars out.

def _mixture_inputs(p_copy, a_sink, copy_col, device):
    """(p_copy, a_sink) fp32 contiguous and copy_col as one int32 element on `device` (a number or
    a 0-d tensor: a captured step reads it on the device)."""
    col = (copy_col.reshape(1).to(device=device, dtype=torch.int32) if isinstance(copy_col, torch.Tensor)
           else torch.full((1,), int(copy_col), dtype=torch.int32, device=device))
    return p_copy.float().contiguous(), a_sink.float().contiguous(), col


def _launch_pointer_ce(logits: Tensor, targets: Tensor, weights: Tensor, with_grad: bool, grad_scale: Tensor,
                       p_copy: Tensor, a_sink: Tensor, copy_col: Tensor,
                       config: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    N, C = logits.shape
    grad = torch.empty((N, C) if with_grad else (0, C), dtype=logits.dtype, device=logits.device)
    loss, next_loss, d_p_copy, d_a_sink = _launch_ce_kernel(logits, targets, weights, grad, grad_scale, weights,
                                                            weights, 0.0, _config_from_list(config),
                                                            (p_copy, a_sink, copy_col))
    return loss, next_loss, grad, d_p_copy, d_a_sink


def _launch_pointer_ce_fp8(logits: Tensor, targets: Tensor, weights: Tensor, grad_scale: Tensor, q_scale: Tensor,
                           amax: Tensor, fp8_dtype: torch.dtype, p_copy: Tensor, a_sink: Tensor, copy_col: Tensor,
                           config: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grad = torch.empty(logits.shape, dtype=fp8_dtype, device=logits.device)
    loss, next_loss, d_p_copy, d_a_sink = _launch_ce_kernel(logits, targets, weights, grad, grad_scale, q_scale, amax,
                                                            _FP8_MAX[fp8_dtype], _config_from_list(config),
                                                            (p_copy, a_sink, copy_col))
    return loss, next_loss, grad, d_p_copy, d_a_sink


_pointer_ce_op = torch.library.custom_op(f"{_OPS}::pointer_ce", _launch_pointer_ce, mutates_args=())
_pointer_ce_fp8_op = torch.library.custom_op(f"{_OPS}::pointer_ce_fp8", _launch_pointer_ce_fp8, mutates_args=("amax",))


@_pointer_ce_op.register_fake
def _(logits, targets, weights, with_grad, grad_scale, p_copy, a_sink, copy_col, config):
    N, C = logits.shape
    rows = [logits.new_empty(N, dtype=torch.float32) for _ in range(4)]
    return rows[0], rows[1], logits.new_empty((N, C) if with_grad else (0, C)), rows[2], rows[3]


@_pointer_ce_fp8_op.register_fake
def _(logits, targets, weights, grad_scale, q_scale, amax, fp8_dtype, p_copy, a_sink, copy_col, config):
    N, C = logits.shape
    rows = [logits.new_empty(N, dtype=torch.float32) for _ in range(4)]
    return rows[0], rows[1], logits.new_empty((N, C), dtype=fp8_dtype), rows[2], rows[3]


class _PointerMixtureCrossEntropy(torch.autograd.Function):
    """_SoftcapCrossEntropy with the mixture's next-token term: the forward also stores the
    loss's derivatives in p_copy and a_sink (per unit upstream gradient), which the backward
    scales by the upstream gradient."""

    @staticmethod
    def forward(ctx, logits, targets, weights, p_copy, a_sink, copy_col, grad_scale, config, scale_config,
                exact_upstream):
        loss, next_loss, grad, d_p_copy, d_a_sink = _pointer_ce_op(logits, targets, weights, ctx.needs_input_grad[0],
                                                                   grad_scale, p_copy, a_sink, copy_col, config)
        ctx.save_for_backward(grad, grad_scale, d_p_copy, d_a_sink)
        ctx.scale_config, ctx.exact_upstream = scale_config, exact_upstream
        ctx.mark_non_differentiable(next_loss)
        return loss, next_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_next_loss):
        grad, grad_scale, d_p_copy, d_a_sink = ctx.saved_tensors
        if not ctx.exact_upstream and grad.shape[0]:
            _scale_rows_op(grad, (grad_loss.float() / grad_scale).contiguous(), ctx.scale_config)
        upstream = grad_loss.float()
        return (grad if grad.shape[0] else None, None, None, d_p_copy * upstream, d_a_sink * upstream, None, None,
                None, None, None)


def pointer_mixture_softcap_cross_entropy(logits, targets, weights, copy_col, p_copy, a_sink, config=CROSS_ENTROPY,
                                          scale_config=CROSS_ENTROPY_SCALE, grad_scale=1.0, exact_upstream=False):
    """pointer_mixture_cross_entropy by the softcapped cross-entropy kernel (softcap_cross_entropy's
    arguments and hints, plus the <copy> column and the pointer's (p_copy, a_sink) per row): one
    pass over the logits as without the pointer; differentiable in logits, p_copy and a_sink."""
    _check_cross_entropy_inputs(logits.shape, targets, weights, grad_scale)
    p_copy, a_sink, col = _mixture_inputs(p_copy, a_sink, copy_col, logits.device)
    return _PointerMixtureCrossEntropy.apply(_last_dim_contiguous(logits), _last_dim_contiguous(targets.long()),
                                             weights.float().contiguous(), p_copy, a_sink, col,
                                             device_scalar(grad_scale, logits.device), config.as_list(),
                                             scale_config.as_list(), bool(exact_upstream))


class _FP8HeadPointerMixture(torch.autograd.Function):
    """_FP8HeadCrossEntropy with the mixture's next-token term (the e5m2 logit gradient written
    once, in the cross-entropy kernel), and the loss's derivatives in p_copy and a_sink; with
    sample_rows the weight gradient sampled as _FP8HeadCrossEntropy samples it."""

    @staticmethod
    def forward(ctx, x, weight, state, targets, weights, p_copy, a_sink, copy_col, grad_scale, scales, prims, config,
                ce_config, sample_rows=None, stride=1):
        logits, saved = _fp8_linear_forward(x, weight, state, scales, prims, config)
        g_scale, g_amax = _operand_scale(state, FP8_LINEAR_SLOTS, scales.grad_output, "grad_output", FP8_E5M2_MAX,
                                         None)
        loss, next_loss, g8, d_p_copy, d_a_sink = _pointer_ce_fp8_op(logits, targets, weights, grad_scale, g_scale,
                                                                     g_amax, torch.float8_e5m2, p_copy, a_sink,
                                                                     copy_col, ce_config)
        saved, g8_t = _weight_gradient_operands(saved, g8, sample_rows)
        ctx.save_for_backward(*saved, g8, g8_t, g_scale, d_p_copy, d_a_sink)
        ctx.prims, ctx.config, ctx.dtypes, ctx.stride = prims, config, (x.dtype, weight.dtype), stride
        ctx.mark_non_differentiable(next_loss)
        return loss, next_loss

    @staticmethod
    def backward(ctx, grad_loss, grad_next_loss):
        *saved, g8, g8_t, g_scale, d_p_copy, d_a_sink = ctx.saved_tensors
        grad_x, grad_w = _fp8_linear_grads(ctx, saved, g8, g8_t, g_scale, ctx.stride)
        upstream = grad_loss.float()
        return (grad_x, grad_w, None, None, None, d_p_copy * upstream, d_a_sink * upstream, None, None, None, None,
                None, None, None, None)


def fp8_head_pointer_mixture(x, weight, state, targets, weights, copy_col, p_copy, a_sink, grad_scale, config=None,
                             ce_config=CROSS_ENTROPY, scales=HEAD_SCALES, gemm="fastest", casts="kernel", sample=None):
    """fp8_head_cross_entropy with the pointer mixture's next-token term (PR 379 runs the mixture
    inside its FP8 cross-entropy so): (loss, next_token_loss), the logit gradient written once in
    e5m2; differentiable in x, weight, p_copy and a_sink. The caller promises grad_scale as every
    row's upstream gradient for the logits' gradient (the trainer's objective). sample: the sampled
    weight gradient, as in fp8_linear."""
    _check_fp8_state(state, FP8_LINEAR_SLOTS, "new_fp8_linear_state")
    _check_scales(scales, FP8LinearScales)
    if not isinstance(scales.grad_output, (Static, Delayed)):
        raise ValueError("fp8_head_pointer_mixture: the gradient's scale rule must be Static or Delayed")
    _check_cross_entropy_inputs((x.shape[0], weight.shape[0]), targets, weights, grad_scale)
    targets = _last_dim_contiguous(targets.long())
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        logits = fp8_linear(x, weight, state, config, scales, gemm, casts)
        return pointer_mixture_softcap_cross_entropy(logits, targets, weights, copy_col, p_copy, a_sink, ce_config,
                                                     grad_scale=grad_scale, exact_upstream=True)
    p_copy, a_sink, col = _mixture_inputs(p_copy, a_sink, copy_col, x.device)
    return _FP8HeadPointerMixture.apply(x, weight, state, targets, weights.float().contiguous(), p_copy, a_sink, col,
                                        device_scalar(grad_scale, x.device), scales, _PRIMITIVES[gemm, casts], config,
                                        ce_config.as_list(), *_sample_args(sample))


# ---------------------------------------------------------------------------------------------
# 10. Document copy: each position's longest earlier match of its context in its document
# ---------------------------------------------------------------------------------------------
#
# PR 378's document-local copy feature. For each match length L in COPY_LENGTHS the context of
# position t is its last L tokens x[t-L+1..t], read as normalized ids (case and punctuation
# folded: data/tokenizer.py's normalized_tokens), when they all lie in t's document (documents
# start at each BOS). The context matches at an earlier position j < t of the document when
# x[j-L+1..j] holds the same normalized ids. The longest L with a match wins, and its latest match
# j gives the candidate, the raw token x[j + 1] (j + 1 <= t: nothing after t is read). The bucket
# says which L and how many earlier matches the context has in the document (1, 2, 3 or more):
# bucket = 3 l + min(count, 3) for the length's index l, 0 where no length matches.
#
# Matching by hashing: every (L, t) gets a 64-bit key (copy_keys), equal for equal contexts of
# one document; one stable sort of all COPY_LENGTHS x T keys puts each entry right after the
# latest earlier entry with its key (document_copy_matches). Two different contexts share a key
# with probability about (10 T)^2 / 2^65 a slice (1e-8 at 49,152 tokens): a wrong candidate at
# worst, never a later token (a match must end before t).

COPY_LENGTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)   # PR 378: the match lengths, in tokens
COPY_COUNTS = 3                    # PR 378: earlier matches of the context told apart: 1, 2, 3 or more
COPY_BUCKETS = len(COPY_LENGTHS) * COPY_COUNTS + 1  # PR 378: 31 buckets, 0 for no match
COPY_HASH_MUL = 0x9E3779B97F4A7C15  # PR 378: the rolling hash's multiplier M (odd: 2^64 / the golden ratio)
COPY_LENGTH_MUL = 0x2545F4914F6CDD1D  # PR 378: a key's length mix is L times this
COPY_DOC_MUL = 0x5851F42D4C957F2D  # PR 378: a key's document mix is the document's index times this
COPY_KEYS = LaunchConfig(block_m=256, block_n=0, num_warps=4)   # block_m positions per program


def wrap_int64(value):
    """A Python int modulo 2^64, as the signed int64 that holds those bits."""
    return (value + 2 ** 63) % 2 ** 64 - 2 ** 63


COPY_LENGTH_ENDS = sum(1 << (L - 1) for L in COPY_LENGTHS)   # bit k set: a length ends at offset k


def copy_hash_powers(longest, device):
    """(longest,) int64: M^k mod 2^64 for k = 0 .. longest - 1, made on the device (a running
    product whose int64 products wrap), so that a captured step copies no host tensor."""
    ones = torch.ones(1, dtype=torch.int64, device=device)
    multipliers = torch.full((longest - 1,), wrap_int64(COPY_HASH_MUL), dtype=torch.int64, device=device)
    return torch.cat([ones, multipliers.cumprod(0)])


def copy_document_index(tokens, bos):
    """(T,) int64: each position's document, counted by the BOS tokens up to it (0 before the first)."""
    return torch.cumsum(tokens == bos, 0)


@triton.jit
def _copy_keys_kernel(tok_ptr, norm_ptr, doc_ptr, keys_ptr, T, bos, hash_mul, length_mul, doc_mul,
                      ENDS: tl.constexpr, LONGEST: tl.constexpr, BLOCK: tl.constexpr):
    """The keys of BLOCK positions t for every length, in one pass over the offsets k = 0 ..
    LONGEST - 1: h += (norm[x[t-k]] + 1) M^k (int64 products and sums wrap: mod 2^64); where a
    length L = k + 1 ends (bit k of ENDS) the next row of keys gets h ^ L length_mul ^ doc[t]
    doc_mul, or -1 - t where the window leaves t's document: it starts before position 0, or a
    BOS lies at an offset below k (a BOS at offset k itself starts the document and the window).
    Traffic: each program reads its positions' LONGEST-token history (the tokens from DRAM once,
    the overlapping windows and the normalized ids from cache), their documents' indices once,
    and writes len(COPY_LENGTHS) keys of 8 bytes a position."""
    t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = t < T
    doc_mix = tl.load(doc_ptr + t, mask=ok, other=0) * doc_mul
    h = tl.zeros([BLOCK], dtype=tl.int64)
    power = tl.full([BLOCK], 1, dtype=tl.int64)
    crossed = t < 0                # a BOS at an offset below k: the window left the document
    row = 0
    for k in tl.static_range(LONGEST):
        inside = ok & (t >= k)
        x = tl.load(tok_ptr + (t - k), mask=inside, other=0).to(tl.int64)
        y = tl.load(norm_ptr + x, mask=inside, other=-1).to(tl.int64) + 1
        h += y * power
        power = power * hash_mul
        if (ENDS >> k) & 1:
            key = tl.where(inside & ~crossed, h ^ ((k + 1) * length_mul) ^ doc_mix, -1 - t)
            tl.store(keys_ptr + row * T + t, key, mask=ok)
            row += 1
        crossed = crossed | (inside & (x == bos))


def _launch_copy_keys(tokens: Tensor, normalized: Tensor, doc: Tensor, bos: int, config: list[int]) -> Tensor:
    config = _config_from_list(config)
    T = tokens.shape[0]
    keys = torch.empty(len(COPY_LENGTHS), T, dtype=torch.int64, device=tokens.device)
    _launch(_copy_keys_kernel, (triton.cdiv(T, config.block_m),), config, tok_ptr=tokens, norm_ptr=normalized,
            doc_ptr=doc, keys_ptr=keys, T=T, bos=bos, hash_mul=wrap_int64(COPY_HASH_MUL),
            length_mul=COPY_LENGTH_MUL, doc_mul=COPY_DOC_MUL, ENDS=COPY_LENGTH_ENDS, LONGEST=max(COPY_LENGTHS),
            BLOCK=config.block_m)
    return keys


_copy_keys_op = torch.library.custom_op(f"{_OPS}::copy_keys", _launch_copy_keys, mutates_args=())


@_copy_keys_op.register_fake
def _(tokens, normalized, doc, bos, config):
    return tokens.new_empty(len(COPY_LENGTHS), tokens.shape[0], dtype=torch.int64)


def _check_copy_inputs(tokens, normalized):
    if tokens.ndim != 1 or tokens.dtype not in (torch.int32, torch.int64) or normalized.dtype != torch.int64:
        raise ValueError(f"copy_keys: tokens must be (T,) int32 or int64 and the normalized ids int64; got "
                         f"{tokens.dtype} {tuple(tokens.shape)} and {normalized.dtype}")


def copy_keys(tokens, normalized, bos, config=COPY_KEYS):
    """(len(COPY_LENGTHS), T) int64: the key of every length's context at every position
    (copy_keys_reference states them), by the Triton kernel. tokens (T,) int32 or int64;
    normalized: each id's normalized id, int64; bos: the id that starts a document."""
    _check_copy_inputs(tokens, normalized)
    return _copy_keys_op(tokens.contiguous(), normalized.contiguous(), copy_document_index(tokens, bos), int(bos),
                         config.as_list())


def copy_keys_reference(tokens, normalized, bos, config=None):
    """copy_keys in plain torch: row l, position t holds, for L = COPY_LENGTHS[l] and y the
    normalized ids plus one,
        (sum_{k < L} y[t-k] M^k  mod 2^64)  xor  L COPY_LENGTH_MUL  xor  d(t) COPY_DOC_MUL
    (d(t) the document's index, copy_document_index), as int64; -1 - t where t - L + 1 is before
    t's document (its latest BOS, or position 0). Each position's LONGEST window products in one
    (T, LONGEST) int64 block, summed by a wrapping cumulative sum."""
    _check_copy_inputs(tokens, normalized)
    T, longest = tokens.shape[0], max(COPY_LENGTHS)
    positions = torch.arange(T, device=tokens.device)
    y = F.pad(normalized[tokens.long()] + 1, (longest - 1, 0))
    history = y.unfold(0, longest, 1).flip(1)            # (T, LONGEST): column k holds y[t-k], 0 before t = 0
    prefix = torch.cumsum(history * copy_hash_powers(longest, tokens.device), dim=1)   # column k: k + 1 tokens
    doc_mix = copy_document_index(tokens, bos) * COPY_DOC_MUL
    doc_start = torch.cummax(torch.where(tokens == bos, positions, 0), dim=0).values
    keys = []
    for L in COPY_LENGTHS:
        inside = positions - L + 1 >= doc_start
        keys.append(torch.where(inside, prefix[:, L - 1] ^ wrap_int64(L * COPY_LENGTH_MUL) ^ doc_mix, -1 - positions))
    return torch.stack(keys)


def document_copy_matches(tokens, keys):
    """(candidate, bucket), each (T,) int64, from the keys of every length's context (copy_keys):
    one stable sort of the COPY_LENGTHS x T keys, whose equal keys then sit in position order,
    so each entry's predecessor there is its latest earlier match and its distance to its key's
    first entry the number of earlier matches. An entry matches when that predecessor exists and
    ends before t (keys of windows that leave the document, -1 - t, are alike only at t itself);
    the longest matching length wins. candidate: the token after its latest match (-1: no match);
    bucket: 3 l + min(count, 3) for the length's index l (0: no match). Fixed shapes, no host
    value: a compiled or captured step holds it."""
    lengths, T = keys.shape
    sorted_keys, order = torch.sort(keys.reshape(-1), stable=True)
    position = order % T
    same = sorted_keys[1:] == sorted_keys[:-1]
    previous = torch.cat([position.new_full((1,), -1), torch.where(same, position[:-1], -1)])
    count = torch.arange(order.numel(), device=keys.device) - torch.searchsorted(sorted_keys, sorted_keys)
    previous = torch.empty_like(previous).scatter_(0, order, previous).view(lengths, T)
    count = torch.empty_like(count).scatter_(0, order, count).view(lengths, T)
    t = torch.arange(T, device=keys.device)
    matched = (previous >= 0) & (previous < t)
    longest = torch.where(matched, torch.arange(1, lengths + 1, device=keys.device)[:, None], 0).amax(0)
    row = (longest - 1).clamp(min=0)[None]
    latest, count = previous.gather(0, row)[0], count.gather(0, row)[0]
    candidate = torch.where(longest > 0, tokens.long()[(latest + 1).clamp(0, T - 1)], -1)
    bucket = torch.where(longest > 0, (longest - 1) * COPY_COUNTS + count.clamp(1, COPY_COUNTS), 0)
    return candidate, bucket
