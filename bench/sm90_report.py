"""Compile every production kernel launch of kernels.py for Hopper (sm_90) without a GPU, and
report its resources: registers, shared memory, spills, instruction counts, tensor-core use,
tensor-descriptor copies and warp specialization (the compiled warps, partitions, setmaxnreg).

Two sets of launches, recorded with kernels._launch replaced by a recorder, so that the
arguments carry the block sizes, dtypes, layouts and specializations (unit strides, 16-aligned
pointers, 16-divisible sizes) exactly as the JIT sees them, with each launch's grid and each
tensor argument's largest element offset:
  - the trainer's, for each run of TRAINER_RUNS (the speedrun, 1gpu, record89 and medium presets and
    bench/first_contact.py's compiled run): one training step of every stage, the
    optimizer step and the final validation, at full size, traced on fake tensors under CUDA's
    autocast rules (tests/helpers/cuda_autocast.py), and the sparse tables' updates at the largest
    sizes the run makes (sparse_row_calls); each kernel op it calls is then made again on real
    CPU tensors that are allocated but never touched, which records the launch without running it;
  - the library's other production variants (LIBRARY_SHAPES: head dims 64, the FP8 linear,
    sampled-softmax widths (the cross-entropy alone and with the FP8 head), both weight dtypes, both value-table widths), from the public
    wrappers on untouched tensors.
Each distinct launch is compiled with triton.compile for GPUTarget("cuda", 90, 32) and
inspected with the cuobjdump that ships inside the triton wheel; "trainer" in an entry says
whether a trainer run makes that launch.

The index audit (index_findings) reads each compiled variant's TTIR: for every pointer argument
whose largest offset in some launch is >= 2^31 elements, each offset added to it (tt.addptr,
traced back through splat, broadcast, expand_dims, loop-carried pointers ... to the argument)
must be computable without overflow: an i32 offset, or an i64 one extended (arith.extsi) from an
i32 value that multiplies a program id, has its value bounded from the launch's grid and scalar
arguments (interval arithmetic over the TTIR), and a bound >= 2^31 or none is a finding.

    python bench/sm90_report.py            # print the report and the audit's findings
    python bench/sm90_report.py --write    # also store it in bench/sm90_resources.json (another
                                           # triton than requirements.txt's: sm90_resources_triton<v>.json)

tests/test_kernels_sm90.py runs the same compiles and checks the limits below and the audit.
"""
import argparse
import dataclasses
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import typing

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "helpers"))
sys.path.insert(0, str(REPO_ROOT / "bench"))

import triton  # noqa: E402
from cuda_autocast import cuda_autocast_rules  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

import kernels  # noqa: E402
import train_gpt  # noqa: E402
from machinery import kernel_choice, ngram_table, sparse_tables  # noqa: E402
from machinery.cuda_graphs import MicroBatch  # noqa: E402


def report_path(version=triton.__version__):
    """Where the report of a triton version is kept: sm90_resources.json for the version
    requirements pin (requirements/dev.txt; CUDA torch pins the same), sm90_resources_triton<version>.json for
    another."""
    pinned = next(line.split("==")[1].strip() for line in (REPO_ROOT / "requirements" / "dev.txt").read_text().splitlines()
                  if line.startswith("triton=="))
    name = "sm90_resources.json" if version == pinned else f"sm90_resources_triton{version}.json"
    return pathlib.Path(__file__).resolve().parent / name


REPORT_PATH = report_path()        # this process's triton
HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes of shared memory one block may use on H100/H200

# The trainer runs whose launches are recorded: (config arguments, processes, schedule). A
# preset's schedule is its timed run, steps 0 .. N-1 in order; "bench" is bench/first_contact.py's
# compiled run (the 1gpu preset with one GPU's share of the n-gram table resident, the speedrun's
# stages 2 and 4, the head untied in the second).
TRAINER_RUNS = {"speedrun": (["--preset", "speedrun"], 8, "preset"),
                "1gpu": (["--preset", "1gpu"], 1, "preset"),
                "record89": (["--preset", "record89"], 8, "preset"),
                "medium": (["--preset", "medium"], 8, "preset"),
                "bench": (None, 1, "bench")}
# Shapes of the library variants: packed tokens per GPU, model width, MLP width, vocabulary
# (full and the smallest sampled-softmax candidate set), a document length and window.
LIBRARY_SHAPES = dict(tokens=49152, width=768, hidden=3072, vocab=50304, candidates=10240,
                      max_doc=3072, window=1664, heads_by_dim={128: 6, 64: 12})
ATTENTION_HEAD_DIMS = ((128, 128), (64, 64), (128, 64), (64, 128))  # (Dqk, Dv)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)  # master weights of the fp8 layers (bf16 or fp32)
CE_TARGET_COUNTS = (1, 2, 3, 4)  # next token alone ... three future tokens plus the prefix target
NGRAM_TABLE_ROWS = 65536          # rows of the n-gram table shard the report's launches address
# Sparse Adam events of the library launches: the first (1: a constant for a specializing JIT),
# a multiple of 16 and another; the kernel does not specialize on the event, so they share one variant.
SPARSE_ADAM_EVENTS = (1, 16, 7)
# Muon's Gram matrices: a bank of square attention matrices and the wide MLP matrices.
XXT_SHAPES = ((16, 768, 768), (8, 768, 3072))

# Kernels that must run on the tensor cores (wgmma in PTX, HGMMA/QGMMA in SASS).
MATRIX_KERNELS = ("_fp8_matmul_kernel", "_fp8_matmul_quant_kernel", "_fp8_matmul_tma_kernel",
                  "_fp8_matmul_quant_tma_kernel", "_attn_fwd_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel",
                  "_attn_bwd_fused_kernel", "_attn_fwd_tma_kernel", "_attn_bwd_fused_tma_kernel", "_xxt_kernel",
                  "_dc_fwd_kernel", "_dc_bwd_mix_kernel", "_dc_bwd_q_kernel", "_dc_bwd_kv_kernel")
# The persistent FP8 GEMMs: every variant loads its operands by tensor descriptor (UTMALDG) and
# stores by descriptor (UTMASTG).
DESCRIPTOR_KERNELS = ("_fp8_matmul_tma_kernel", "_fp8_matmul_quant_tma_kernel")
# The attention kernels of FlashAttention-3's structure: every variant loads its tiles by tensor
# descriptor (UTMALDG) and stores by descriptor (UTMASTG); those of ATTENTION_WARP_SPECIALIZED
# are warp-specialized too: the compiled kernel has the loop's partitions (ttg.warp_specialize in
# the TTGIR, more warps than the launch asked for) and rebalances registers between the producer
# and the consumer warp groups (setmaxnreg in the PTX, USETMAXREG in the SASS).
DESCRIPTOR_ATTENTION_KERNELS = ("_attn_fwd_tma_kernel", "_attn_bwd_fused_tma_kernel")
ATTENTION_WARP_SPECIALIZED = tuple(name for name, key in zip(DESCRIPTOR_ATTENTION_KERNELS, ("forward", "backward"))
                                   if kernels.ATTENTION_WARP_SPECIALIZE[key])
# The implementations a call's rule never launches: only where kernel_choice's warm-up timed them
# fastest or a key pins them (the pointer-load FP8 GEMMs, the deterministic two-kernel attention
# backward, the descriptor attention kernels).
FALLBACK_KERNELS = ("_fp8_matmul_kernel", "_fp8_matmul_quant_kernel", "_attn_bwd_delta_kernel", "_attn_bwd_kv_kernel",
                    "_attn_bwd_q_kernel", *DESCRIPTOR_ATTENTION_KERNELS)
# SASS opcodes counted per variant: the tensor cores' (HGMMA bf16/fp16, QGMMA fp8, HMMA: mma.sync),
# spills (LDL/STL), shared and global memory (LDGSTS: asynchronous copies into shared memory, the
# pipelined pointer loads), the tensor-descriptor copies (UTMALDG loads, UTMASTG stores, UTMAREDG
# reductions), barriers, the special-function unit and the register rebalancing of warp-specialized
# kernels (USETMAXREG: setmaxnreg).
SASS_COUNTED = ("HGMMA", "QGMMA", "HMMA", "LDL", "STL", "LDS", "STS", "LDG", "STG", "LDGSTS", "UTMALDG", "UTMASTG",
                "UTMAREDG", "BAR", "MUFU", "USETMAXREG")

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv",
                 torch.float8_e5m2: "fp8e5"}
_DIVISIBILITY = [["tt.divisibility", 16]]


def _untouched(*shape, dtype=torch.bfloat16, requires_grad=False):
    """A CPU tensor whose memory is reserved but never written (large shapes cost no RAM)."""
    return torch.empty(*shape, dtype=dtype).requires_grad_(requires_grad)


def _library_calls():
    """The wrappers' production variants at LIBRARY_SHAPES, forward and backward."""
    s = LIBRARY_SHAPES
    T, D, H = s["tokens"], s["width"], s["hidden"]
    x = _untouched(T, D, requires_grad=True)
    for weight_dtype in WEIGHT_DTYPES:
        # packed QKV, attention output, lm_head (at the candidates and the vocabulary, whose gradient
        # cast addresses more than 2^31 elements)
        for out_features in (3 * D, D, s["candidates"], s["vocab"]):
            weight = _untouched(out_features, D, dtype=weight_dtype, requires_grad=True)
            y = kernels.fp8_linear(x, weight, kernels.new_fp8_linear_state())
            y.backward(torch.empty_like(y))
        w_up = _untouched(H, D, dtype=weight_dtype, requires_grad=True)
        w_down = _untouched(D, H, dtype=weight_dtype, requires_grad=True)
        y = kernels.fp8_relu2_mlp(x, w_up, w_down, kernels.new_fp8_mlp_state())
        y.backward(torch.empty_like(y))
        # a compiled model's casts (casts="fused"): torch ops, then the transpose kernel, at the
        # QKV's and the MLP's sizes (the head's gradient is the cross-entropy's own)
        weight = _untouched(3 * D, D, dtype=weight_dtype, requires_grad=True)
        y = kernels.fp8_linear(x, weight, kernels.new_fp8_linear_state(), casts="fused")
        y.backward(torch.empty_like(y))
        y = kernels.fp8_relu2_mlp(x, w_up, w_down, kernels.new_fp8_mlp_state(), casts="fused")
        y.backward(torch.empty_like(y))

    cu_seqlens = torch.arange(0, T + 1, s["max_doc"], dtype=torch.int32)
    for d_qk, d_v in ATTENTION_HEAD_DIMS:
        heads = s["heads_by_dim"][max(d_qk, d_v)]
        q, k = (_untouched(T, heads, d_qk, requires_grad=True) for _ in range(2))
        v = _untouched(T, heads, d_v, requires_grad=True)
        o = kernels.flash_attn_varlen(q, k, v, cu_seqlens, s["window"], d_qk ** -0.5)
        o.backward(torch.empty_like(o))
        angles = _untouched(T, d_qk // 2, dtype=torch.float32)
        q, k = kernels.qk_norm_rope(q, k, angles, angles, _untouched(d_qk, dtype=torch.bool),
                                    _untouched(T, dtype=torch.bool))
        (q.float().sum() + k.float().sum()).backward()

    for columns in (s["vocab"], s["candidates"]):
        for num_targets in CE_TARGET_COUNTS:
            logits = _untouched(T, columns, requires_grad=True)
            targets = torch.zeros(T, num_targets, dtype=torch.int64)
            loss, _ = kernels.softcap_cross_entropy(logits, targets, torch.ones(num_targets))
            loss.backward(torch.empty_like(loss))
            # the FP8 head with the cross-entropy: the gradient written in e5m2, then transposed
            weight = _untouched(columns, D, requires_grad=True)
            loss, _ = kernels.fp8_head_cross_entropy(x, weight, kernels.new_fp8_linear_state(), targets,
                                                     torch.ones(num_targets), 1 / T)
            loss.sum().backward()
    with torch.no_grad():  # validation: full vocabulary, next token only, no gradient
        kernels.softcap_cross_entropy(_untouched(T, s["vocab"]), torch.zeros(T, 1, dtype=torch.int64), torch.ones(1))

    for shape in XXT_SHAPES:
        kernels.xxt(_untouched(*shape))
        kernels.xxt(_untouched(*shape[:2], shape[1]), alpha=2.0, beta=-1.5)   # b A + c A^2 of the Gram A

    # the FP8 layers' weights of a forward, cast together: each rule (the scale kernel's RULE;
    # the amax pass where it reads the weights' own amax), each master-weight dtype
    for dtype in WEIGHT_DTYPES:
        for rule in (kernels.WEIGHT_LAG, kernels.EXACT, kernels.Delayed(kernels.GRAD_HEADROOM), kernels.Static(1.0)):
            kernels.fp8_cast_weights([_untouched(s["hidden"], D, dtype=dtype) for _ in range(2)],
                                     [kernels.new_fp8_mlp_state() for _ in range(2)], kernels.FP8_MLP_SLOTS,
                                     "up_weight", rule)

    # composed attention (the last layer's), at the model's head width
    heads = s["heads_by_dim"][128]
    q, k, v = (_untouched(T, heads, 128, requires_grad=True) for _ in range(3))
    mix_in = _untouched(T, heads, dtype=torch.float32, requires_grad=True)
    mix_out = _untouched(T, heads, requires_grad=True)
    o = kernels.composed_attention(q, k, v, _untouched(T, dtype=torch.int32), 112, 128 ** -0.5, mix_in, mix_out)
    o.backward(torch.empty_like(o))

    # the hashed n-gram table (width D) and the value-embedding tables (D and, for the narrow_vo
    # layers, D / 2): a token's rows' gradients summed per distinct row, sparse Adam on those
    # rows of a table (its row count changes no launch), at several events; the row sums added
    # into an fp32 table of sums
    groups = kernels.distinct_rows(torch.randint(0, NGRAM_TABLE_ROWS, (2 * T,)))
    for width in (D, D // 2):
        for dtype in WEIGHT_DTYPES:
            grads = kernels.sum_rows(_untouched(2 * T, width, dtype=dtype), groups)
            if width == D:         # a split table's sums for their owners, in the table's dtype
                kernels.sum_rows(_untouched(2 * T, width, dtype=dtype), groups, scale=1 / 8, out_dtype=dtype)
            kernels.add_row_sums_(_untouched(NGRAM_TABLE_ROWS, width, dtype=torch.float32), groups.distinct,
                                  _untouched(2 * T, width, dtype=dtype), groups)
            for event in SPARSE_ADAM_EVENTS:
                step = kernels.RowAdamStep(event=event, log_decay=-0.35, one_minus_beta2=0.05, bias=0.05, lr=0.01,
                                           decay=0.0, eps=1e-10)
                kernels.sparse_adam_rows_(_untouched(NGRAM_TABLE_ROWS, width, dtype=dtype), grads, groups,
                                          _untouched(NGRAM_TABLE_ROWS, dtype=torch.float32),
                                          _untouched(NGRAM_TABLE_ROWS, dtype=torch.int32),
                                          _untouched(NGRAM_TABLE_ROWS, dtype=torch.float64), step)
    # the weight averages' samples: an fp32 EMA moved toward a weight of each dtype
    for dtype in WEIGHT_DTYPES:
        ema = _untouched(s["vocab"], D, dtype=torch.float32)
        kernels.ema_update_(ema, _untouched(s["vocab"], D, dtype=dtype), 0.01)


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """What the JIT specializes on for a tensor argument (the recorder keeps no tensors, so
    that autograd can still reuse their memory), and the largest element offset the tensor
    spans from its data pointer (what the kernel's index arithmetic must reach)."""
    dtype: torch.dtype
    aligned: bool  # data pointer divisible by 16
    max_offset: int = 0


def largest_offset(t):
    """sum over dims of (size - 1) * stride: the largest element offset of t from its data pointer."""
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0


def recorded_argument(value):
    """A launch argument as the JIT specializes on it (tensors: dtype and 16-byte alignment,
    and their largest offset)."""
    if isinstance(value, torch.Tensor):
        return TensorArg(value.dtype, value.data_ptr() % 16 == 0, largest_offset(value))
    return value


class Launch(typing.NamedTuple):
    """One recorded kernel launch: the kernel, its LaunchConfig, its arguments as recorded_argument
    gives them, and its grid (a tuple of program counts)."""
    kernel: object
    config: object
    args: dict
    grid: tuple = (1,)


def record_launches(calls):
    """[Launch] of every launch that calls() makes, none of them run."""
    recorded = []
    original = kernels._launch

    def record(kernel, grid, config, **args):
        recorded.append(Launch(kernel, config, {name: recorded_argument(value) for name, value in args.items()},
                               tuple(grid)))

    kernels._launch = record
    try:
        calls()
    finally:
        kernels._launch = original
    return recorded


@dataclasses.dataclass(frozen=True)
class FakeArg:
    """A tensor argument of a kernel op call made on fake tensors: its layout in its storage."""
    shape: tuple
    stride: tuple
    storage_offset: int
    dtype: torch.dtype

    def untouched(self):
        """A CPU tensor with this layout (and so this alignment) whose memory is never written."""
        extent = self.storage_offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride)) + 1
        return torch.empty(extent, dtype=self.dtype).as_strided(self.shape, self.stride, self.storage_offset)


class KernelOpCalls(TorchDispatchMode):
    """Records the calls of this repository's kernel ops (namespace "kernels") with their layouts."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kernels":
            def layout(v):
                if isinstance(v, torch.Tensor):
                    return FakeArg(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype)
                return v
            self.calls.append((func, tree_map(layout, args), tree_map(layout, kwargs)))
        return func(*args, **kwargs)


def run_config(run):
    """(config, processes, train steps in order) of a run of TRAINER_RUNS."""
    args, processes, schedule = TRAINER_RUNS[run]
    if schedule == "bench":
        import first_contact
        h = train_gpt.parse_config(first_contact.compiled_args(dry=False))
        return h, processes, list(range(h.num_iterations))
    h = train_gpt.parse_config(args)
    return h, processes, list(range(h.num_iterations))


def sparse_update_entries(h, processes, steps):
    """The largest number of gradient entries one process's n-gram table update takes in a run
    of `steps`, and the largest number of tokens one update of the value tables spans, counted
    as SparseTables.step does: every step adds 2 entries and 1 token per token of each
    of the process's micro-batches (batch_ranks / processes), and the tables update once
    as many steps as the tables' cadence (train_gpt.table_schedule) have accumulated."""
    accum = h.batch_ranks // processes
    calls = tokens = largest = 0
    for step in steps:
        every = train_gpt.table_schedule(h, step).step_every
        calls += 1
        tokens += h.stages[train_gpt.stage_index(h, step)].tokens_per_rank * accum
        if calls >= every:
            largest = max(largest, tokens)
            calls = tokens = 0
    return 2 * largest, largest


def sparse_row_calls(h, model, processes, steps):
    """The sparse tables' kernel calls at the largest sizes of the run (sparse_update_entries),
    made as the trainer makes them on fake tensors: the n-gram table's update (SparseRowAdam.step:
    the entries summed per distinct row, then Adam on the table the trainer trains: this
    process's shard, or the device cache of a table in host memory) and a micro-batch's entries
    added to its pending sums (RowGradientSums.add: the slice's own, in the sink's dtype, or
    with a split table the fp32 sums every process sent for this one's rows); per value-embedding
    table a micro-batch's row sums added to the table's (VocabRowGradients.add) and Adam on as
    many rows as the processes' tokens since the last update can touch (step_summed at the
    largest capacity VocabRowGradients.touched can take)."""
    entries, tokens = sparse_update_entries(h, processes, steps)
    event = kernels.RowAdamStep(event=2, log_decay=-0.1, one_minus_beta2=0.05, bias=0.1, lr=0.01, decay=0.0, eps=1e-10)
    ngram = model.ngram
    micro_batch = max(stage.tokens_per_rank for stage in h.stages)
    if ngram is not None and entries:
        table = ngram.fetched if ngram.on_host else ngram.table
        grads = torch.zeros(entries, table.shape[1])
        groups = kernels.distinct_rows(torch.zeros(entries, dtype=torch.int64))
        summed = kernels.sum_rows(grads, groups)
        rows = table.shape[0]
        kernels.sparse_adam_rows_(table, summed, groups, torch.zeros(rows), torch.zeros(rows, dtype=torch.int32),
                                  torch.zeros(64, dtype=torch.float64), event)
        split = ngram.gathered and not ngram.on_host
        n = 2 * micro_batch * (processes if split else 1)
        capacity = sparse_tables.ngram_event_rows(h, processes)
        slice_groups = kernels.distinct_rows(torch.zeros(n, dtype=torch.int64))
        kernels.add_row_sums_(torch.zeros(capacity + 1, table.shape[1]), slice_groups.distinct,
                              torch.zeros(n, table.shape[1], dtype=torch.float32 if split else ngram.sink.dtype),
                              slice_groups)
    if model.value_sinks is not None and tokens:
        capacity = min(train_gpt.PADDED_VOCAB_SIZE, tokens * processes)
        for ve, sink in zip(model.value_embeds, model.value_sinks):
            token_groups = kernels.distinct_rows(torch.zeros(micro_batch, dtype=torch.int64))
            kernels.add_row_sums_(torch.zeros(train_gpt.PADDED_VOCAB_SIZE, sink.shape[1]), token_groups.distinct,
                                  torch.zeros(micro_batch, sink.shape[1], dtype=sink.dtype), token_groups)
            groups = kernels.distinct_rows(torch.zeros(capacity, dtype=torch.int64))
            rows = ve.weight.shape[0]
            kernels.sparse_adam_rows_(ve.weight.detach(), torch.zeros(capacity, ve.weight.shape[1]), groups,
                                      torch.zeros(rows), torch.zeros(rows, dtype=torch.int32),
                                      torch.zeros(64, dtype=torch.float64), event)


def trainer_kernel_calls(run="speedrun"):
    """Every kernel op call of a trainer run of TRAINER_RUNS, at full size: a training step of
    each stage (forward, backward, optimizer) and the final validation (training_step_calls),
    then the sparse tables' largest updates with the run's n-gram table placement
    (sparse_row_calls). No memory is used and nothing launches."""
    h, processes, steps = run_config(run)
    with FakeTensorMode(allow_non_fake_inputs=True), KernelOpCalls() as recorder, torch.no_grad():
        model = train_gpt.build_model(h, _kernel_fns(h), ngram_table.TablePlacement(0, processes, h.ngram_cache_rows))
        sparse_row_calls(h, model, processes, steps)
    return training_step_calls(h) + recorder.calls


def _kernel_fns(h):
    """The kernel functions the trainer picks on a GPU (train_gpt.select_kernels)."""
    return train_gpt.select_kernels(dataclasses.replace(h, kernels="auto", device="cuda"), torch.device("cuda"))


# Config fields that move the n-gram table or name the run, and change no training step's kernel calls.
_TABLE_AND_NAME_FIELDS = ("preset", "track", "ngram_rows", "ngram_cache_rows")
_STEP_CALLS = {}


def training_step_calls(h):
    """The kernel op calls of a training step of every stage (forward, backward, optimizer) and
    of the final validation, at full size, on fake tensors under CUDA's autocast rules, with the
    Triton kernel functions; traced once per process for configs that differ only in
    _TABLE_AND_NAME_FIELDS."""
    config = {k: v for k, v in dataclasses.asdict(h).items() if k not in _TABLE_AND_NAME_FIELDS}
    key = json.dumps(config, sort_keys=True, default=repr)
    if key not in _STEP_CALLS:
        _STEP_CALLS[key] = _trace_training_steps(h)
    return _STEP_CALLS[key]


def _trace_training_steps(h):
    fns = _kernel_fns(h)
    with cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True), KernelOpCalls() as recorder:
        model = train_gpt.build_model(h, fns)
        optimizers = train_gpt.build_optimizers(h, model, fns)
        for index, stage in enumerate(h.stages):
            step = sum(train_gpt.steps_per_stage(h)[:index])     # the stage's first
            train_gpt.model_at(model, h, step)
            model.set_loss_unit(1.0 / (stage.tokens_per_rank * h.batch_ranks))   # the trainer's objective weight
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = train_gpt.micro_batch_losses(model, stage, train_gpt.attention_windows(h, step),
                                                       MicroBatch.zeros(stage),
                                                       train_gpt.target_weights(stage, "cpu"))
            loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        model.eval()
        T = h.val_tokens_per_rank
        args = train_gpt.AttentionArgs(torch.tensor([0, T], dtype=torch.int32),
                                       h.stages[-1].short_window * train_gpt.WINDOW_BLOCK,
                                       h.val_long_window * train_gpt.WINDOW_BLOCK)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            model.validation_loss_sum(torch.zeros(T, dtype=torch.int32), torch.zeros(T, 1, dtype=torch.int64), args)
    return recorder.calls


def replay_untouched(calls):
    """Make each recorded kernel op call again on untouched CPU tensors of the same layouts."""
    def real(v):
        return v.untouched() if isinstance(v, FakeArg) else v
    for func, args, kwargs in calls:
        func(*tree_map(real, args), **tree_map(real, kwargs))


def specialize(kernel, args):
    """(signature, constexprs, attrs) as Triton's JIT derives them from these arguments: tensors
    become typed pointers (16-byte aligned ones marked divisible by 16), integers equal to 1
    become constants, integers divisible by 16 are marked so, floats are fp32; a parameter in
    the kernel's do_not_specialize gets neither of the integer specializations."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        name, value = param.name, args[param.name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, TensorArg):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            if value.aligned and not param.do_not_specialize_on_alignment:
                attrs[(index,)] = _DIVISIBILITY
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{kernel.__name__}: unexpected argument {name}={value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1 and not param.do_not_specialize:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0 and not (param.do_not_specialize or param.do_not_specialize_on_alignment):
                attrs[(index,)] = _DIVISIBILITY
    return signature, constexprs, attrs


def _cuobjdump(flag, cubin):
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def _resource_usage(cubin):
    """{"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..} of the kernel in the cubin."""
    line = next(text for text in _cuobjdump("--dump-resource-usage", cubin).splitlines() if "REG:" in text)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return {key: int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}


def _opcode(sass_line):
    """'HGMMA' from '/*0160*/  @P0 HGMMA.64x128x16.F32.BF16 R24, ... ;'."""
    tokens = sass_line.split("*/", 1)[1].split()
    if tokens[0].startswith("@"):
        tokens = tokens[1:]
    return tokens[0].split(".")[0]


def _describe(kernel, config, signature, constexprs):
    """'kernel (pointer dtypes) CONSTEXPR=value ... warps=W stages=S', one line per variant."""
    pointers = ",".join(t[1:] for t in signature.values() if t.startswith("*"))
    shown = " ".join(f"{k}={v}" for k, v in constexprs.items()
                     if k.isupper() and k not in ("GROUP_M", "SOFTCAP", "SHIFT", "TEMP"))
    return f"{kernel.__name__} ({pointers}) {shown} warps={config.num_warps} stages={config.num_stages}"


_COMPILED = {}   # variant key -> triton's compiled kernel, for the report and the audit


def compiled_variant(kernel, config, args):
    """triton.compile of the launch's variant for sm_90, once per variant and process."""
    key = _variant_key(kernel, config, args)
    if key not in _COMPILED:
        signature, constexprs, attrs = specialize(kernel, args)
        _COMPILED[key] = triton.compile(
            triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
            target=HOPPER, options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    return _COMPILED[key]


def compile_launch(kernel, config, args):
    """Compile one recorded launch for sm_90 and return its report entry."""
    signature, constexprs, _ = specialize(kernel, args)
    compiled = compiled_variant(kernel, config, args)
    cubin = compiled.asm["cubin"]
    sass = _cuobjdump("--dump-sass", cubin)
    instructions = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    usage = _resource_usage(cubin)
    return {
        "kernel": kernel.__name__,
        "variant": _describe(kernel, config, signature, constexprs),
        "registers": usage["REG"],
        "shared_bytes": compiled.metadata.shared,
        "local_bytes": usage["LOCAL"],
        "stack_bytes": usage["STACK"],
        "ptx_wgmma": compiled.asm["ptx"].count("wgmma.mma_async"),
        "ptx_setmaxnreg": compiled.asm["ptx"].count("setmaxnreg."),
        "warps": compiled.metadata.num_warps,
        "warp_specialized": "ttg.warp_specialize(" in compiled.asm["ttgir"],
        "sass_instructions": len(instructions),
        "sass_counts": {op: sum(_opcode(line) == op for line in instructions) for op in SASS_COUNTED},
    }


def _variant_key(kernel, config, args):
    signature, constexprs, attrs = specialize(kernel, args)
    return (kernel.__name__, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
            repr(sorted(attrs)), config.num_warps, config.num_stages)


@functools.cache
def trainer_launches(run):
    """The recorded launches of a trainer run (TRAINER_RUNS), once per process: each call's rule
    and every other Triton implementation kernel_choice could pick for it."""
    with kernel_choice.every_candidate():
        return record_launches(lambda: replay_untouched(trainer_kernel_calls(run)))


def production_launches():
    """({run: its trainer launches}, library launches) as record_launches gives them."""
    with kernel_choice.every_candidate():
        library = record_launches(_library_calls)
    return {run: trainer_launches(run) for run in TRAINER_RUNS}, library


def build_report(launches=None):
    """The report: Triton version and one entry per distinct launch of `launches` (Launch or
    (kernel, config, args); default: the trainer runs' and the library's production launches)."""
    trainer_keys = set()
    if launches is None:
        runs, library = production_launches()
        trainer = [launch for run_launches in runs.values() for launch in run_launches]
        trainer_keys = {_variant_key(*launch[:3]) for launch in trainer}
        launches = trainer + library
    entries, seen = [], set()
    for kernel, config, args in (launch[:3] for launch in launches):
        key = _variant_key(kernel, config, args)
        if key not in seen:
            seen.add(key)
            entries.append({**compile_launch(kernel, config, args), "trainer": key in trainer_keys})
    entries.sort(key=lambda e: e["variant"])
    return {"triton": triton.__version__, "target": "cuda sm_90", "kernels": entries}


# ---------------------------------------------------------------------------------------------
# The index audit
# ---------------------------------------------------------------------------------------------

I32_LIMIT = 2 ** 31               # element offsets from here on need 64-bit index arithmetic
_PASS_THROUGH = ("tt.splat", "tt.broadcast", "tt.expand_dims", "tt.reshape", "tt.trans", "arith.extsi",
                 "arith.extui", "arith.trunci")
_WRAPPING = ("arith.addi", "arith.subi", "arith.muli", "arith.shli")  # the i32 ops that can overflow
_STOPS = ("arg", "tt.load", "scf.for.iter_arg", "scf.for.result", "scf.if.result")  # no value arithmetic behind


@dataclasses.dataclass
class TTIROp:
    """An operation of a TTIR function that defines a value: its name, its operand values, its
    result type and its text (attributes, constants); loop headers and the function's arguments
    define values too (names "scf.for.iv", "scf.for.iter_arg", "scf.for.result", "arg")."""
    name: str
    operands: list
    type: str = ""
    text: str = ""


_RESULT = re.compile(r"^\s*(%[\w.$-]+)(?::(\d+))? = (\S+) ?(.*)$")
_VALUE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_FOR = re.compile(r"scf\.for (%[\w.$-]+) = (%[\w.$#-]+) to (%[\w.$#-]+) step (%[\w.$#-]+)(?: iter_args\((.*?)\))?")
_ARGUMENT = re.compile(r"(%[\w.$-]+): ([^ ,{)]+)")


@dataclasses.dataclass
class TTIRFunction:
    """A kernel's TTIR as the audit reads it: its arguments in order (name, type), the defining
    op of every value, every tt.addptr as (pointer value, offset value, offset type), and every
    tt.make_tensor_descriptor as (base pointer value, [dimension size values])."""
    arguments: list
    ops: dict
    addptrs: list
    descriptors: list = dataclasses.field(default_factory=list)


def parse_ttir(ttir):
    """The TTIRFunction of a compiled kernel's asm["ttir"] (triton 3.6 and 3.7 print the same
    syntax; value names differ, positions do not)."""
    raw = [line for line in ttir.splitlines() if not line.startswith("#")]
    header = next(line for line in raw if "tt.func" in line)
    arguments = _ARGUMENT.findall(header[header.index("(") + 1:])   # loc("name"(#loc)) holds no %
    lines = [re.sub(r"\s*loc\(.*$", "", line) for line in raw]
    ops = {name: TTIROp("arg", [], type_) for name, type_ in arguments}
    addptrs, descriptors, regions = [], [], []    # regions: (op name, results of an scf.if) of each open region
    for line in lines[raw.index(header) + 1:]:
        body = line.strip()
        if body.startswith("}"):
            closed = regions.pop() if regions else None
            if body.endswith("{"):     # } else {
                regions.append(closed)
            continue
        match = _RESULT.match(line)
        result, count, name, rest = match.groups() if match else (None, None, body.split(" ")[0], body)
        results = [f"{result}#{i}" for i in range(int(count))] if count else [result] if result else []
        if name == "scf.for":
            iv, lb, ub, step, iter_args = _FOR.search(body).groups()
            ops[iv] = TTIROp("scf.for.iv", [lb, ub, step])
            for i, pair in enumerate(iter_args.split(", ") if iter_args else []):
                block_arg, init = pair.split(" = ")
                ops[block_arg] = TTIROp("scf.for.iter_arg", [init])
                if i < len(results):
                    ops[results[i]] = TTIROp("scf.for.result", [init])
        elif name == "scf.if":
            for value in results:
                ops[value] = TTIROp("scf.if.result", [])
        elif name == "scf.yield":
            if regions and regions[-1][0] == "scf.if":
                for value, yielded in zip(regions[-1][1], _VALUE.findall(rest.split(" : ")[0])):
                    ops[value].operands.append(yielded)
        elif results:
            operand_text, _, type_text = rest.rpartition(" : ")
            operands = _VALUE.findall(operand_text)
            for value in results:
                ops[value] = TTIROp(name, operands, re.split(r" -> | to ", type_text)[-1], operand_text)
            if name == "tt.addptr":
                addptrs.append((operands[0], operands[1], type_text.rsplit(", ", 1)[1]))
            if name == "tt.make_tensor_descriptor":   # base, [sizes], [strides]
                descriptors.append((operands[0], operands[1:1 + (len(operands) - 1) // 2]))
        if body.endswith("{"):
            regions.append((name, results))
    return TTIRFunction(arguments, ops, addptrs, descriptors)


def _element_type(type_text):
    """'i32' of 'tensor<128x256xi32>' or of 'i32'; 'ptr' for pointers."""
    if "ptr" in type_text:
        return "ptr"
    found = re.findall(r"(?:^|x|<)([if]\d+|bf16)>?$", type_text.strip())
    return found[0] if found else type_text.strip()


def _tdiv(a, b):
    """a / b rounded toward zero (arith.divsi)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


class IndexBounds:
    """Bounds of the integer values of one launch of a TTIR function: program ids from the
    grid, scalar arguments from their recorded values, constants, ranges and loop counters,
    carried through the integer ops by interval arithmetic on unbounded integers. A value with
    no bound (loaded, loop-carried, or an op not modelled) is None."""

    def __init__(self, function: TTIRFunction, scalars: dict, grid: tuple):
        self.ops, self.scalars, self.grid = function.ops, scalars, tuple(grid) + (1, 1)
        self._intervals, self._pid = {}, {}

    def interval(self, value):
        if value not in self._intervals:
            self._intervals[value] = None           # a cycle (loop-carried value) has no bound
            self._intervals[value] = self._interval(value)
        return self._intervals[value]

    def _interval(self, value):
        op = self.ops.get(value)
        if op is None:
            return None
        get = [self.interval(v) for v in op.operands] if op.name not in _STOPS else []
        if op.name == "arg":
            v = self.scalars.get(value)
            return (v, v) if isinstance(v, int) else None
        if op.name == "arith.constant":
            number = re.fullmatch(r"(?:dense<)?(-?\d+|true|false)>?", op.text.strip())
            if not number:
                return None
            v = {"true": 1, "false": 0}.get(number[1], None)
            v = int(number[1]) if v is None else v
            return (v, v)
        if op.name == "tt.get_program_id":
            return (0, self.grid["xyz".index(op.text.strip())] - 1)
        if op.name == "tt.get_num_programs":
            n = self.grid["xyz".index(op.text.strip())]
            return (n, n)
        if op.name == "tt.make_range":
            start, end = (int(re.search(rf"{k} = (-?\d+)", op.text)[1]) for k in ("start", "end"))
            return (start, end - 1)
        if op.name == "scf.for.iv":
            lb, ub, step = get
            if lb is None or ub is None or step is None or step[0] <= 0:
                return None
            return (lb[0], max(lb[0], ub[1] - 1))
        if op.name == "arith.cmpi":
            return (0, 1)
        if op.name == "arith.select":
            a, b = get[1], get[2]
            return None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
        if any(g is None for g in get):
            return None
        if op.name in _PASS_THROUGH:
            return get[0]
        if op.name in ("arith.addi", "arith.subi", "arith.muli"):
            (a0, a1), (b0, b1) = get
            if op.name == "arith.addi":
                return (a0 + b0, a1 + b1)
            if op.name == "arith.subi":
                return (a0 - b1, a1 - b0)
            products = [a0 * b0, a0 * b1, a1 * b0, a1 * b1]
            return (min(products), max(products))
        if op.name in ("arith.divsi", "arith.divui"):
            (a0, a1), (b0, b1) = get
            if b0 <= 0:
                return None
            quotients = [_tdiv(a, b) for a in (a0, a1) for b in (b0, b1)]
            return (min(quotients), max(quotients))
        if op.name in ("arith.remsi", "arith.remui"):
            (a0, a1), (b0, b1) = get
            if b0 <= 0:
                return None
            return (0, min(a1, b1 - 1)) if a0 >= 0 else (-(b1 - 1), b1 - 1)
        if op.name in ("arith.minsi", "arith.maxsi"):
            (a0, a1), (b0, b1) = get
            pick = min if op.name == "arith.minsi" else max
            return (pick(a0, b0), pick(a1, b1))
        if op.name == "arith.andi" and get[0][0] >= 0 and get[1][0] >= 0:
            return (0, min(get[0][1], get[1][1]))
        if op.name == "arith.shli" and get[1][0] == get[1][1] >= 0:
            return (get[0][0] << get[1][0], get[0][1] << get[1][0])
        return None

    def uses_program_id(self, value):
        """Whether the value is computed from a program id."""
        if value not in self._pid:
            self._pid[value] = False
            op = self.ops.get(value)
            self._pid[value] = op is not None and (op.name == "tt.get_program_id" or any(
                self.uses_program_id(v) for v in op.operands))
        return self._pid[value]

    def i32_overflow(self, value, seen=None):
        """The first i32 op (add, sub, mul, shift) computing `value` whose result has no bound or
        one outside the i32 range, as 'op: bound', or None if there is none."""
        seen = set() if seen is None else seen
        op = self.ops.get(value)
        if op is None or value in seen or op.name in _STOPS:
            return None
        seen.add(value)
        for v in op.operands:
            found = self.i32_overflow(v, seen)
            if found:
                return found
        if op.name in _WRAPPING and _element_type(op.type) == "i32":
            excess = _beyond_i32(self.interval(value))
            if excess:
                return f"{op.name} {op.text} in i32, {excess}"
        return None

    def i64_overflow(self, value, seen=None):
        """For an i64 offset: an i32 value it extends (arith.extsi) that multiplies a program id
        and can overflow (i32_overflow), or None."""
        seen = set() if seen is None else seen
        op = self.ops.get(value)
        if op is None or value in seen or op.name in _STOPS:
            return None
        seen.add(value)
        if op.name == "arith.extsi":
            source = op.operands[0]
            if self._multiplies_program_id(source, set()):
                return self.i32_overflow(source)
            return None
        for v in op.operands:
            found = self.i64_overflow(v, seen)
            if found:
                return found
        return None

    def _multiplies_program_id(self, value, seen):
        op = self.ops.get(value)
        if op is None or value in seen or op.name in _STOPS:
            return False
        seen.add(value)
        if op.name == "arith.muli" and any(self.uses_program_id(v) for v in op.operands):
            return True
        return any(self._multiplies_program_id(v, seen) for v in op.operands)


def pointer_roots(function: TTIRFunction, value):
    """The function arguments a pointer value is derived from (through addptr, splat, broadcast,
    loop-carried values, selects and ifs)."""
    roots, todo, seen = set(), [value], set()
    while todo:
        v = todo.pop()
        op = function.ops.get(v)
        if v in seen or op is None:
            continue
        seen.add(v)
        if op.name == "arg":
            roots.add(v)
        elif op.name in ("tt.addptr",) + _PASS_THROUGH or op.name.startswith("scf.for."):
            todo.append(op.operands[0])
        elif op.name == "arith.select":
            todo += op.operands[1:]
        elif op.name == "scf.if.result":
            todo += op.operands
    return roots


@functools.cache
def _variant_function(key):
    return parse_ttir(_COMPILED[key].asm["ttir"])


def launch_offset_risks(launch):
    """[(pointer argument, reason)] of one launch: each pointer argument whose largest offset is
    >= 2^31 elements and whose address arithmetic can overflow there (an i32 offset, or an i64
    one extended from an i32 product with a program id, without a bound < 2^31)."""
    kernel, config, args, grid = launch
    large = {name for name, v in args.items() if isinstance(v, TensorArg) and v.max_offset >= I32_LIMIT}
    if not large:
        return []
    compiled_variant(kernel, config, args)
    function = _variant_function(_variant_key(kernel, config, args))
    signature, _, _ = specialize(kernel, args)
    runtime = [name for name, type_ in signature.items() if type_ != "constexpr"]
    assert len(runtime) == len(function.arguments), (kernel.__name__, runtime, function.arguments)
    by_value = {value: name for (value, _), name in zip(function.arguments, runtime)}
    bounds = IndexBounds(function, {value: args[name] for value, name in by_value.items()}, grid)
    risks, traced = set(), set()
    for pointer, offset, offset_type in function.addptrs:
        for root in pointer_roots(function, pointer):
            name = by_value[root]
            if name not in large:
                continue
            traced.add(name)
            if _element_type(offset_type) == "i32":
                reason = bounds.i32_overflow(offset) or _bounded(bounds, offset)
            else:
                reason = bounds.i64_overflow(offset)
                reason = reason and f"i64 offset from an i32 product with a program id: {reason}"
            if reason:
                risks.add((name, reason))
    # a tensor descriptor's copy engine forms each address from i32 coordinates (one per
    # dimension, below its size) and 64-bit strides: safe when every size is bounded below 2^31
    for base, sizes in function.descriptors:
        for root in pointer_roots(function, base):
            name = by_value[root]
            if name not in large:
                continue
            traced.add(name)
            for size in sizes:
                excess = _beyond_i32(bounds.interval(size))
                if excess:
                    risks.add((name, f"tensor descriptor dimension {excess}"))
    risks |= {(name, "no address arithmetic traced back to it") for name in large - traced}
    return sorted(risks)


def _beyond_i32(bound):
    """None for a bound inside the i32 range, else what it is ('unbounded', 'up to N')."""
    if bound is None:
        return "unbounded"
    if bound[0] < -I32_LIMIT or bound[1] >= I32_LIMIT:
        return f"up to {max(map(abs, bound)):,}"
    return None


def _bounded(bounds, offset):
    """None when the i32 offset's bound lies inside the i32 range, else why not."""
    excess = _beyond_i32(bounds.interval(offset))
    return excess and f"i32 offset {excess}"


def _audit_key(launch):
    kernel, config, args, grid = launch
    scalars = tuple(sorted((k, v.max_offset if isinstance(v, TensorArg) else repr(v)) for k, v in args.items()))
    return _variant_key(kernel, config, args), tuple(grid), scalars


def index_findings(launches):
    """One line per (kernel variant, pointer argument, reason) of the launches' offset risks
    (launch_offset_risks), each launch with a distinct variant, grid and arguments checked once."""
    findings, seen = set(), set()
    for launch in launches:
        key = _audit_key(launch)
        if key in seen:
            continue
        seen.add(key)
        signature, constexprs, _ = specialize(launch.kernel, launch.args)
        variant = _describe(launch.kernel, launch.config, signature, constexprs)
        for name, reason in launch_offset_risks(launch):
            offset = launch.args[name].max_offset
            findings.add(f"{variant}: {name} reaches offset {offset:,} (grid {launch.grid}): {reason}")
    return sorted(findings)


def problems(report):
    """Every violated limit, as one line each: tensor cores unused, shared memory over the
    limit, register spills."""
    found = []
    for entry in report["kernels"]:
        name = entry["variant"]
        gmma = entry["sass_counts"]["HGMMA"] + entry["sass_counts"]["QGMMA"]
        if entry["kernel"] in MATRIX_KERNELS and (entry["ptx_wgmma"] == 0 or gmma == 0):
            found.append(f"{name}: no wgmma / GMMA instructions")
        if entry["kernel"] in DESCRIPTOR_KERNELS and not (entry["sass_counts"]["UTMALDG"]
                                                          and entry["sass_counts"]["UTMASTG"]):
            found.append(f"{name}: no tensor-descriptor loads and stores (UTMALDG, UTMASTG)")
        if entry["kernel"] in DESCRIPTOR_ATTENTION_KERNELS and not (entry["sass_counts"]["UTMALDG"]
                                                                    and entry["sass_counts"]["UTMASTG"]):
            found.append(f"{name}: no tensor-descriptor loads and stores (UTMALDG, UTMASTG)")
        if entry["kernel"] in ATTENTION_WARP_SPECIALIZED and not (entry["warp_specialized"]
                                                                  and entry["ptx_setmaxnreg"]):
            found.append(f"{name}: its loop is not warp-specialized (no partitions or no setmaxnreg)")
        if entry["shared_bytes"] > SHARED_MEMORY_LIMIT:
            found.append(f"{name}: {entry['shared_bytes']} bytes of shared memory > {SHARED_MEMORY_LIMIT}")
        spills = entry["local_bytes"] + entry["sass_counts"]["LDL"] + entry["sass_counts"]["STL"]
        if spills:
            found.append(f"{name}: spills ({entry['local_bytes']} local bytes, "
                         f"{entry['sass_counts']['LDL']} LDL, {entry['sass_counts']['STL']} STL)")
    return found


def format_report(report):
    lines = [f"sm_90 resources (triton {report['triton']}; * = launched by the trainer; TMA ld/st/red: "
             f"tensor-descriptor loads, stores, reductions; warps: compiled (WS: warp-specialized, "
             f"setmaxnreg count))",
             f"{'variant':<122} {'regs':>4} {'smem':>7} {'instr':>6} {'GMMA':>5} {'wgmma':>5} {'LDL/STL':>7} "
             f"{'TMA ld/st/red':>13} {'MUFU':>5} {'warps':>10}"]
    for e in report["kernels"]:
        counts = e["sass_counts"]
        mark = "*" if e.get("trainer") else " "
        tma = f"{counts['UTMALDG']}/{counts['UTMASTG']}/{counts['UTMAREDG']}"
        warps = f"{e['warps']} WS {e['ptx_setmaxnreg']}" if e["warp_specialized"] else f"{e['warps']}"
        lines.append(f"{mark} {e['variant']:<120} {e['registers']:>4} {e['shared_bytes']:>7} "
                     f"{e['sass_instructions']:>6} {counts['HGMMA'] + counts['QGMMA']:>5} {e['ptx_wgmma']:>5} "
                     f"{counts['LDL'] + counts['STL']:>7} {tma:>13} {counts['MUFU']:>5} {warps:>10}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store the report in {REPORT_PATH.name}")
    flags = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sm90_report.py compiles kernels: unset TRITON_INTERPRET", file=sys.stderr)
        sys.exit(2)
    report = build_report()
    print(format_report(report))
    for line in problems(report):
        print("PROBLEM", line)
    if flags.write:
        REPORT_PATH.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        print(f"wrote {REPORT_PATH}")
    sys.exit(1 if problems(report) else 0)


if __name__ == "__main__":
    main()
