"""The training step on paper: a performance model of every launch of a preset's run at full size.

    python bench/step_model.py --preset speedrun                  # 8xH100
    python bench/step_model.py --preset 1gpu --gpu h200 --gpus 1
    python bench/step_model.py --preset record89                  # with record 89's logged step times
    python bench/step_model.py --write                            # regenerate bench/results/step_model.md (STANDARD_RUNS)

The census. One micro-batch of every stage is traced on fake tensors (shapes without memory:
nothing is allocated or computed) under CUDA's autocast rules (tests/helpers/cuda_autocast.py), with the
Triton kernel functions the GPU path runs and a fake process group of the run's size, so that the
optimizers' collectives appear as the GPUs would make them: the forward, the backward, each
optimizer's update and the weight averages' samples, every op recorded with the storages it
reads and writes. The process traced is rank 0, which owns a full share of every Muon bank (a
bank's padding is its last matrices), so it is the busiest rank. The sparse tables move rows
whose routes are host data, so their traffic is counted from the rows a slice touches
(table_ops), not traced.

The price of an op is a roofline: max(FLOPs / (peak of its dtype x efficiency), HBM bytes /
(bandwidth x efficiency), KERNEL_FLOOR_S per kernel):
  - matrix products (aten mm, addmm, bmm, baddbmm, _scaled_mm; the FP8 GEMMs; X X^T): 2 M N K
    FLOPs at their operands' dtype (X X^T: the tiles of one triangle); bytes: each operand read
    once, the output written once;
  - attention: the FLOPs of the tiles the kernels visit (attention_tiles: the kernels' own block
    ranges, on FineWeb-like document lengths cut at the stage's max_doc_len), at the attention
    efficiency;
  - the pointer mixture's kernels (pointer_mixture): the tiles they visit (pointer_flops), at the
    attention efficiency, 2 D FLOPs a score forward and 4 D in each backward kernel;
  - other kernels (cross-entropy, QK norm + RoPE, FP8 casts, row sums, sparse Adam, the document
    copy feature's keys): their inputs read and outputs written once; a sort (aten.sort: CUB's
    radix sort on CUDA) reads its keys once for the digit counts, then reads and writes its keys
    and indices once per 8-bit digit of the key (sort_bytes);
  - the memory-bound aten ops: under torch.compile (the model's forward and backward; with CUDA
    graphs also each optimizer update the trainer captures, one graph per Muon bank and one for
    Adam) Inductor fuses them, modelled so: the ops between two launches it cannot fuse into
    (matrix products, custom kernels, collectives, sorts, the end of a graph) form one region,
    one pass over memory in which each storage read from outside the region is read once, and a
    storage the region writes is written only if something after the region reads it or it
    existed before the region (state updated in place); one kernel per size of output the region
    writes (loops over different sizes do not fuse) plus one per reduction in it. Saved
    activations are kept as eager autograd keeps them (Inductor's partitioner may recompute some
    instead: the model counts more traffic there, not less). Outside the compiled graphs (the
    weight averages, eager runs) every op is a kernel of its own;
  - collectives: ring traffic (all-reduce 2 (n-1)/n of the buffer, reduce-scatter and all-gather
    (n-1)/n of the full buffer, all-to-all (n-1)/n of what a rank sends) over NVLink's bus
    bandwidth x efficiency, plus COLLECTIVE_LATENCY_S each. The optimizers' updates run on two
    streams (two_stream_seconds: their collectives under their math, as optim.step_together
    launches them); everything else runs one op after another, so the gradients' reduction
    waits for the whole backward.

A step is the micro-batches of its stage (batch_ranks / GPUs of them), Muon's update, Adam's on
the steps it updates (adam_step_every), the tables' per-slice traffic and their events, and the
averages' samples; the run is the sum of its steps (the validations are off the clock). The host
is not modelled (CUDA graphs replay the steps; the loader works a step ahead).
"""
import argparse
import collections
import dataclasses
import functools
import json
import math
import pathlib
import sys

import numpy as np
import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests" / "helpers"))
sys.path.insert(0, str(REPO_ROOT / "bench"))

import kernels  # noqa: E402
import optim  # noqa: E402
import train_gpt  # noqa: E402
from machinery import ngram_table  # noqa: E402
from machinery.cuda_graphs import MicroBatch  # noqa: E402
from machinery.config import ConfigError  # noqa: E402

# -----------------------------------------------------------------------------------------------
# Every constant of the model, with its source
# -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Gpu:
    """Peak rates of one GPU (dense, no sparsity) and its NVLink bus bandwidth."""
    name: str
    tflops: dict                   # operand dtype -> peak TFLOP/s
    hbm_tb_s: float                # HBM bandwidth
    link_gb_s: float               # NVLink bandwidth per direction (what a ring's bus bandwidth can reach)
    memory_gib: float


# NVIDIA H100 Tensor Core GPU datasheet, SXM5: FP8 3,958 and BF16 1,979 TFLOP/s with sparsity (half
# dense), TF32 989 with sparsity, FP32 67; HBM3 3.35 TB/s; NVLink 900 GB/s (both directions); 80 GB.
H100 = Gpu("H100 SXM", {"fp8": 1979.0, "bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 66.9}, 3.35, 450.0, 80)
# NVIDIA H200 datasheet, SXM: the H100's compute, HBM3e 4.8 TB/s, NVLink 900 GB/s, 141 GB.
H200 = Gpu("H200 SXM", H100.tflops, 4.8, 450.0, 141)
GPUS = {"h100": H100, "h200": H200}


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Shares of the peaks a well-tuned kernel reaches (assumed, not measured here). With
    `structures`, the matrix products and attention are priced by the structure of the kernel
    that runs them instead (Structures); `gap_s` is added per kernel (the gap between dependent
    kernels); `floors`: the per-kernel and per-collective minimum times apply."""
    gemm: float = 0.65             # of the tensor cores' peak, large GEMMs
    attention: float = 0.45        # of the bf16 peak, FlashAttention-2-style kernels on sliding windows
    hbm: float = 0.80              # of HBM bandwidth, memory-bound kernels
    link: float = 0.70             # of NVLink bus bandwidth, NCCL collectives
    structures: object = None
    gap_s: float = 0.0
    floors: bool = True


# The record-89 constants: GEMM 65%, attention 45%, which reproduce record 89's logged step times
# (calibration_table); record 89 ran cuBLAS, a persistent descriptor Triton GEMM and FlashAttention-3.
REALISTIC = Efficiency()
PEAK = Efficiency(1.0, 1.0, 1.0, 1.0, floors=False)
KERNEL_FLOOR_S = 2e-6              # the shortest kernel a CUDA-graph replay runs (launch and drain)
COLLECTIVE_LATENCY_S = 15e-6       # per NCCL collective on 8 GPUs of one node, beside its bytes
# FineWeb-like documents for the attention census: log-normal lengths, median 600 tokens (a mean
# near 1,000, like FineWeb's GPT-2 tokens), cut at the stage's max_doc_len (bench/kernel_timings.py).
DOC_MEDIAN, DOC_SEED = 600, 0
# Record 89's logged step times, ms per step at 16,384 / 32,768 / 49,152 tokens per GPU: the means of
# its 13 public runs (KellerJordan/modded-nanogpt records/track_1_short/2026-07-17_FP8DownProjection/
# this_pr/*.txt, train_time from step 5 to 455, 465 to 915 and 925 to 1375 of 1390; 8xH100).
RECORD89_STEP_MS = {16_384: 31.42, 32_768: 56.95, 49_152: 82.79}
CALIBRATION_TOLERANCE = 0.25       # the model's record89 step times within this share of the logged ones
# The runs bench/results/step_model.md holds: (preset, GPUs, GPU kind).
STANDARD_RUNS = (("speedrun", 8, "h100"), ("frontier", 8, "h100"), ("1gpu", 1, "h200"), ("medium", 8, "h100"),
                 ("record89", 8, "h100"))
TABLES_PATH = pathlib.Path(__file__).resolve().parent / "results" / "step_model.md"

# -----------------------------------------------------------------------------------------------
# Kernel structures: the efficiency each implementation's structure reaches, from public figures
# -----------------------------------------------------------------------------------------------

# FP8 GEMM 8192 x 8192 x 4096 on one H100 SXM, TFLOP/s (triton-lang/triton PR 5461): a Triton
# kernel of one program per tile with pointer loads 1,209, persistent 1,285, persistent with
# in-kernel tensor descriptors 1,331, cuBLAS 1,278; as shares of the dense FP8 peak.
FP8_REFERENCE_SHAPE = (8192, 8192, 4096)
FP8_REFERENCE = {"pointer": 1209 / 1979, "descriptor": 1331 / 1979, "cublas": 1278 / 1979}
# Turning fast accumulation off (an fp32 promotion every BLOCK_K = 128 products) costs 10-17% (the
# same PR's measurements, and torch._scaled_mm's use_fast_accum=False): the time 1.135x, 1.17x
# pessimistic. Each promotion waits for the tensor cores' sum: a kernel promoting every P
# products pays that extra time times PROMOTION_COST_K / P (the model's, not a measurement).
PROMOTION_COST = (1.135, 1.17)
PROMOTION_COST_K = 128
# K steps of a tile that run no tensor-core work: a one-tile-per-program kernel fills its
# pipeline (num_stages - 1 = 2 slabs in flight before the first product) and drains its epilogue
# before the SM's next program starts: 2 steps; a persistent kernel whose tile loop is flattened
# into the K loop loads the next tile's slabs during the epilogue: half a step (the store's
# drain). cuBLAS is counted as persistent. These two counts are the model's (structure, not a
# measurement); the public figures above include them at 32 K steps, which calibrates the rest.
TILE_OVERHEAD_STEPS = {"pointer": 2.0, "descriptor": 0.5, "cublas": 0.5}
# FlashAttention-2-class kernels (pointer loads pipelined by cp.async, no warp specialization,
# ours and flex_attention's): the forward on long sequences 329-477 TFLOP/s at head dim 128
# (Triton's tutorial kernel, pytorch/benchmark PR 2391): 0.33-0.48 of the bf16 peak, 0.40 taken,
# 0.33 pessimistic; at sequence length 512 such kernels reach 15-33% (0.24 taken, 0.15
# pessimistic). Those benchmarks count a causal square's useful half; the census counts the
# tiles a kernel computes, masked pairs included: at 512 causal tokens on 128 x 64 tiles 20 tiles
# for 16 tiles of useful pairs (1.25x), and each query block visits 320 keys on average, which
# fixes the span law's overhead (attention_efficiency). FlashAttention-3 (warp-specialized, TMA,
# record 89's): about 1.4x (430-621 TFLOP/s in the same benchmark).
ATTENTION_LONG = (0.40, 0.33)
ATTENTION_AT_512 = (0.24, 0.15)
CAUSAL_512_TILES = 20 / 16         # computed over useful pairs, causal 512 tokens, 128 x 64 tiles
CAUSAL_512_SPAN = 320              # keys a query block visits there (20 tiles x 64 keys / 4 blocks)
FA3_FACTOR = 1.4
# A kernel with FlashAttention-3's descriptor (TMA) loads and pipelined loop but no warp
# specialization: FlashAttention-3's ablation (Shah et al. 2024, arXiv 2407.08608, table 2: H100,
# bf16, head dim 128, 8K tokens) runs 661 TFLOP/s with both of its overlaps and 582 and 570 with
# one of them (the GEMM-softmax pipelining, the warp specialization) removed; the lower share,
# 570 / 661, of FA3_FACTOR is taken.
DESCRIPTOR_FACTOR = FA3_FACTOR * 570 / 661
# An attention kernel's structure -> its speed over the FlashAttention-2-class figures above:
# "fa2" pointer loads (cp.async), no warp specialization (the pointer kernels, flex_attention);
# "descriptor" tensor-descriptor loads, pipelined; "fa3" descriptor loads, pipelined and
# warp-specialized (kernels.ATTENTION_WARP_SPECIALIZE says which descriptor variant is; the sm_90
# reports show each one's partitions and setmaxnreg).
ATTENTION_STRUCTURE_FACTOR = {"fa2": 1.0, "descriptor": DESCRIPTOR_FACTOR, "fa3": FA3_FACTOR}
# A backward runs at 63% of the peak where its forward runs at 73% (FlashAttention-2's paper, A100).
BACKWARD_RATIO = 63 / 73
# The gap between two dependent kernels (the drain of one and the start of the next, a CUDA-graph
# replay's launches included): 1 us, 2 us pessimistic.
KERNEL_GAP_S = (1e-6, 2e-6)
FLEX_BLOCK = 128                   # flex_attention's query and key blocks
# bf16 products (torch.mm, cuBLAS) and X X^T keep the record-89 GEMM constant (no structure of ours).
BF16_GEMM = 0.65
# Measured efficiencies written by bench/first_contact.py (measured_efficiencies): when present,
# the band's fourth line prices with them.
MEASURED_PATH = pathlib.Path(__file__).resolve().parent / "measured_efficiency.json"


@dataclasses.dataclass(frozen=True)
class Structures:
    """The structure-based prices of one line of the band (see the constants above)."""
    fp8: dict                      # structure -> share of the FP8 peak at FP8_REFERENCE_SHAPE
    promotion_cost: float
    attention_long: float
    attention_at_512: float
    backward_ratio: float = BACKWARD_RATIO

    @property
    def span_overhead(self):
        """Keys per query block whose cost a program's setup and drain add: eff(span) = long *
        span / (span + o), with eff(CAUSAL_512_SPAN) = attention_at_512 in computed FLOPs."""
        return CAUSAL_512_SPAN * (self.attention_long / (self.attention_at_512 * CAUSAL_512_TILES) - 1)


STRUCTURE = Efficiency(structures=Structures(FP8_REFERENCE, PROMOTION_COST[0], ATTENTION_LONG[0],
                                             ATTENTION_AT_512[0]), gap_s=KERNEL_GAP_S[0])
PESSIMISTIC = Efficiency(hbm=0.70, link=0.60, structures=Structures(
    {k: v * FP8_REFERENCE["pointer"] / FP8_REFERENCE["cublas"] for k, v in FP8_REFERENCE.items()},
    PROMOTION_COST[1], ATTENTION_LONG[1], ATTENTION_AT_512[1]), gap_s=KERNEL_GAP_S[1])


def measured_efficiency(path=MEASURED_PATH):
    """The Efficiency of first contact's measurements (a JSON of {"fp8": {structure: share at the
    reference shape}, "attention_long": share, "backward_ratio": ratio, "gap_s": s}; keys it lacks
    keep the structure-based values), or None when there is no such file."""
    path = pathlib.Path(path)
    if not path.is_file():
        return None
    found = json.loads(path.read_text())
    base = STRUCTURE.structures
    structures = Structures({**base.fp8, **found.get("fp8", {})}, base.promotion_cost,
                            found.get("attention_long", base.attention_long),
                            found.get("attention_at_512", base.attention_at_512),
                            found.get("backward_ratio", base.backward_ratio))
    return dataclasses.replace(STRUCTURE, structures=structures, gap_s=found.get("gap_s", STRUCTURE.gap_s))


def fp8_config(m, n, k, fast, structure, epilogue=None):
    """The tile a kernel of `structure` runs an (m, k) x (k, n) FP8 GEMM on, as kernels.py picks it
    (16-bit outputs; epilogue: "relu2" or "relu2_grad" for the fused MLP GEMMs). cuBLAS is priced on
    the persistent kernel's tiles with K steps of PROMOTION_COST_K, the promotion interval of the
    public figure (its own is not published)."""
    device = torch.device("cpu")
    if structure == "pointer":
        if epilogue == "relu2_grad":
            return kernels.FP8_MATMUL_RELU2_GRAD
        return kernels.fp8_matmul_config(m, n, device, fast or epilogue == "relu2")
    if epilogue is not None:
        return kernels.fp8_tma_quant_config(m, n, epilogue, device)
    if structure == "cublas" and not fast:    # fp8_tma_config's promoted tile of 128-product K steps (fp32 C)
        return kernels.fp8_tma_config(m, n, k, device, fast, out_dtype=torch.float32)
    return kernels.fp8_tma_config(m, n, k, device, fast)


def gemm_tiles(m, n, k, fast, structure, sms=132, epilogue=None):
    """(output tiles, K steps, tile elements, the busiest SM's K steps) of an FP8 GEMM run by a
    kernel of `structure`, with the tiles and split-K plan kernels.py picks (fp8_config)."""
    config = fp8_config(m, n, k, fast, structure, epilogue)
    tiles = math.ceil(m / config.block_m) * math.ceil(n / config.block_n)
    k_steps = math.ceil(k / config.block_k)
    overhead = TILE_OVERHEAD_STEPS[structure]
    if structure == "pointer":
        busy = math.ceil(tiles / sms) * (k_steps + overhead)
    else:
        full, rest, split = (kernels.split_k_plan(tiles, k_steps, sms, config.block_m * config.block_n)
                             if config.split_k > 1 else (tiles, 0, 1))
        units = full + rest * split
        per_range = math.ceil(k_steps / split) if rest else 0
        busy = full / sms * k_steps + math.ceil(rest * split / sms) * per_range + math.ceil(units / sms) * overhead
        if rest:                   # the partials' workspace and their reduction
            busy += 8 * rest * split * config.block_m * config.block_n * kernels.SPLIT_K_BYTE_STEPS / sms
    return tiles, k_steps, config.block_m * config.block_n, busy


def gemm_efficiency(m, n, k, fast, structure, structures, epilogue=None):
    """Share of the FP8 peak of an (m, k) x (k, n) GEMM by a kernel of `structure`: its public
    figure at the reference shape, times the share of the busiest SM's steps that are products at
    this shape over that share at the reference shape (waves on 132 SMs, K depth, split-K), slower
    by the promotion's cost where the accumulation is promoted (PROMOTION_COST_K)."""
    def useful(shape_m, shape_n, shape_k, fast_accumulation, kind=None):
        tiles, k_steps, _, busy = gemm_tiles(shape_m, shape_n, shape_k, fast_accumulation, structure, epilogue=kind)
        return tiles * k_steps / 132 / busy
    share = structures.fp8[structure] * useful(m, n, k, fast, epilogue) / useful(*FP8_REFERENCE_SHAPE, True)
    if fast:
        return share
    block_k = fp8_config(m, n, k, fast, structure, epilogue).block_k
    return share / (1 + (structures.promotion_cost - 1) * PROMOTION_COST_K / block_k)


def attention_efficiency(span, backward, structures, structure="fa2"):
    """Share of the bf16 peak of an attention kernel of `structure` (ATTENTION_STRUCTURE_FACTOR)
    whose programs visit `span` keys (queries, in the key-block backward) each: a
    FlashAttention-2-class kernel's eff(span) = long * span / (span + overhead), the backward at
    BACKWARD_RATIO of it, times the structure's factor."""
    share = structures.attention_long * span / (span + structures.span_overhead)
    return share * (structures.backward_ratio if backward else 1.0) * ATTENTION_STRUCTURE_FACTOR[structure]


# -----------------------------------------------------------------------------------------------
# The census: what a step dispatches
# -----------------------------------------------------------------------------------------------

GEMM_OPS = {"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm", "kernels.fp8_matmul",
            "kernels.fp8_matmul_quant", "kernels.xxt"}
ATTENTION_OPS = {"kernels.attn_fwd", "kernels.attn_bwd", "kernels.composed_attn_fwd", "kernels.composed_attn_bwd"}
# the cross-entropy kernels: plain, with the pointer mixture's next-token term, and the backward's row scaling
CROSS_ENTROPY_OPS = {"kernels.softcap_ce", "kernels.softcap_ce_fp8", "kernels.pointer_ce", "kernels.pointer_ce_fp8",
                     "kernels.scale_rows_"}
POINTER_OPS = {"kernels.pointer_fwd", "kernels.pointer_bwd"}   # the pointer mixture's: forward; dQ and dK kernels
COLLECTIVE_OPS = {"c10d.allreduce_", "c10d._reduce_scatter_base_", "c10d._allgather_base_", "c10d.alltoall_base_",
                  "c10d.reduce_scatter_tensor_coalesced_", "c10d.allgather_into_tensor_coalesced_"}
# aten ops Inductor leaves to a library kernel of their own (nothing fuses into them)
EXTERN_ATEN_OPS = {"aten.sort", "aten.topk", "aten.searchsorted", "aten.cumsum", "aten.unique_consecutive",
                   "aten._unique2", "aten.nonzero"}
REDUCTION_OPS = {"aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.linalg_vector_norm",
                 "aten.norm", "aten.any", "aten.all", "aten.argmax", "aten.var_mean", "aten.prod", "aten.logsumexp"}
# ops that make a tensor without reading their tensor arguments' values
NO_READ_OPS = {"aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.new_zeros",
               "aten.new_empty", "aten.new_full", "aten.new_ones", "aten.empty_strided", "aten.empty",
               "aten.zeros", "aten.ones", "aten.full", "aten.arange", "aten.scalar_tensor", "aten.zero_",
               "aten.fill_", "aten.new_empty_strided", "aten.randn", "aten.rand", "aten.normal_"}
NO_WRITE_OPS = {"aten.empty_like", "aten.new_empty", "aten.empty_strided", "aten.empty", "aten.new_empty_strided"}
# Gathers read the rows they take from their first argument (a table), at most what they write.
GATHER_OPS = {"aten.embedding", "aten.index", "aten.index_select"}
PHASES = ("forward", "backward", "tables", "muon", "adam", "value_adam", "averages")
MICRO_BATCH_PHASES = ("forward", "backward")
UPDATE_PHASES = ("muon", "adam", "value_adam")   # the optimizers' updates
GRAPH_END = "census.graph_end"     # the event that closes one captured (and compiled) update


def compiled_phases(h):
    """The phases torch.compile builds graphs of: the forward and backward when the run compiles,
    and the optimizers' updates when it also captures them as CUDA graphs (StepGraphs.run_captured)."""
    if not h.compile:
        return ()
    return MICRO_BATCH_PHASES + (UPDATE_PHASES if h.cuda_graphs else ())


@dataclasses.dataclass
class Event:
    """One dispatched op: what it reads and writes, as (storage id, bytes), and its tensors' metas."""
    name: str
    phase: str
    reads: list
    writes: list
    inputs: list                   # [(shape, dtype)] of its tensor arguments, in order
    outputs: list
    args: tuple = ()               # its non-tensor arguments (windows, launch configs)
    in_place: bool = False         # it writes into tensors it was given (which existed before it)


def _op_name(func):
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}"


def _tensor_bytes(t):
    """Bytes a tensor view spans: its elements, at most its storage (an expanded view reads its storage)."""
    return min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


class Census(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op dispatched under it as an Event of the current phase. Storages get ids
    by identity; every tensor seen is kept alive, so that an id is never reused."""

    def __init__(self):
        super().__init__()
        self.events, self.phase, self._ids, self._alive = [], "forward", {}, []

    def run_bank(self, key, fn):
        """The optimizers' run_bank as the trainer's CUDA graphs run it: fn() is one graph, which
        ends with it (GRAPH_END)."""
        fn()
        self.events.append(Event(GRAPH_END, self.phase, [], [], [], []))

    def storage(self, t):
        key = t.untyped_storage()._cdata
        if key not in self._ids:
            self._ids[key] = len(self._ids)
            self._alive.append(t)
        return self._ids[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim" or func.is_view:
            return out
        name = _op_name(func)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        outputs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        mutated = [a for a, arg in zip(args, func._schema.arguments)
                   if isinstance(a, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write]
        reads = [] if name in NO_READ_OPS else [(self.storage(t), _tensor_bytes(t)) for t in tensors]
        if name == "aten.copy_":   # copy_(dst, src) reads src only
            reads = [(self.storage(args[1]), _tensor_bytes(args[1]))]
        if name in GATHER_OPS and outputs:
            reads[0] = (reads[0][0], min(reads[0][1], sum(_tensor_bytes(t) for t in outputs)))
        written = mutated + [t for t in outputs if not any(t is m for m in mutated)]
        writes = [] if name in NO_WRITE_OPS else [(self.storage(t), _tensor_bytes(t)) for t in written]
        for t in outputs:
            self.storage(t)
        self.events.append(Event(name, self.phase, reads, writes, [(tuple(t.shape), t.dtype) for t in tensors],
                                 [(tuple(t.shape), t.dtype) for t in outputs],
                                 tuple(a for a in flat if not isinstance(a, torch.Tensor)), bool(mutated)))
        return out


@dataclasses.dataclass
class Op:
    """One priced launch (or fused region) of the census."""
    name: str                      # the op, or "fused: op, op, ..." for a region
    family: str                    # gemm | attention | cross-entropy | kernel | pointwise | collective | tables
    phase: str
    flops: float = 0.0
    dtype: str = "bf16"            # of the FLOPs
    bytes: float = 0.0             # HBM traffic
    comm: float = 0.0              # bytes a collective moves per rank (ring factor applied)
    kernels: int = 1
    count: float = 1.0             # times it runs per micro-batch (or per update)
    reads: frozenset = frozenset()   # storage ids it reads (a region: from outside it) ...
    writes: frozenset = frozenset()  # ... and writes (a region: those something after it reads)
    # what structure pricing needs: ("fp8", m, k, n, fast, structures it may run on) or
    # ("attention", {implementation: [Kernel, ...]}, the implementations it may run on)
    structure: tuple = ()


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel of an attention implementation: its FLOPs, the keys (queries) its programs
    visit each, its HBM bytes, whether it is a backward kernel, the launches it stands for, and
    its structure (a key of ATTENTION_STRUCTURE_FACTOR)."""
    flops: float
    span: float
    bytes: float
    backward: bool
    launches: int = 1
    structure: str = "fa2"


def _dtype_class(dtype):
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "fp8"
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "fp32")


RADIX_DIGIT_BITS = 8               # torch.sort on CUDA: CUB's onesweep radix sort, one pass per 8-bit digit


def sort_bytes(event):
    """HBM bytes of a radix sort of n keys with their int64 indices: the keys read once (the digit
    counts), then one read and one write of the keys and the indices per digit of the key's bits."""
    (shape, dtype), = event.inputs
    n, key_bytes = math.prod(shape), dtype.itemsize
    digits = math.ceil(8 * key_bytes / RADIX_DIGIT_BITS)
    return float(n * key_bytes + digits * 2 * n * (key_bytes + 8))


def _read_write_bytes(event):
    seen = {}
    for sid, nbytes in event.reads + event.writes:
        seen[sid] = max(seen.get(sid, 0), nbytes)
    return float(sum(dict(event.reads).values()) + sum(dict(event.writes).values()))


def gemm_flops(event):
    """(FLOPs, dtype class) of a matrix-product event."""
    shapes = [s for s, _ in event.inputs]
    dtype = _dtype_class(event.inputs[0][1])
    if event.name == "kernels.xxt":       # X (B, M, K) -> X X^T: the tiles of one triangle
        *batch, m, k = shapes[0]
        tiles = math.ceil(m / kernels.XXT.block_m)
        return 2.0 * math.prod(batch) * tiles * (tiles + 1) / 2 * kernels.XXT.block_m * kernels.XXT.block_n * k, dtype
    if event.name in ("aten.addmm", "aten.baddbmm"):
        shapes = shapes[1:3]
    a, b = shapes[0], shapes[1]
    batch = math.prod(a[:-2])
    return 2.0 * batch * a[-2] * a[-1] * b[-1], dtype


# -----------------------------------------------------------------------------------------------
# Attention: the tiles the kernels visit
# -----------------------------------------------------------------------------------------------

DOC_LEN_SIGMA = 1.0       # log-normal spread of document lengths (median 600: a mean near 1,000, like FineWeb)
MIN_DOC_LEN = 16          # shortest generated document (the trainer's MIN_DOC_TOKENS)


def uneven_document_lengths(num_tokens, median, max_len, generator):
    """Log-normal document lengths (cut to [MIN_DOC_LEN, max_len]) that fill num_tokens exactly."""
    lengths = []
    while sum(lengths) < num_tokens:
        length = generator.lognormal(np.log(median), DOC_LEN_SIGMA)
        lengths.append(int(np.clip(length, MIN_DOC_LEN, max_len)))
    lengths[-1] -= sum(lengths) - num_tokens
    return lengths


def document_lengths(tokens, max_doc_len, seed=DOC_SEED):
    """FineWeb-like document lengths filling `tokens` (uneven_document_lengths at DOC_MEDIAN)."""
    return uneven_document_lengths(tokens, DOC_MEDIAN, max_doc_len, np.random.default_rng(seed))


def _doc_bounds(lengths):
    """Per token: the first token of its document and one past its last."""
    lengths = np.asarray(lengths)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    return np.repeat(starts, lengths), np.repeat(ends, lengths)


def query_tiles(lengths, window, block_m, block_n):
    """(query block, key block) tiles the forward and the dQ kernels visit: for each block of
    block_m queries, the key blocks from (its first query's document start or window edge) to
    its last query (kernels._key_blocks)."""
    doc_start, _ = _doc_bounds(lengths)
    T = len(doc_start)
    q_first = np.arange(0, T, block_m)
    q_last = np.minimum(q_first + block_m, T) - 1
    lo = np.maximum(doc_start[q_first], q_first - window + 1) // block_n
    hi = q_last // block_n + 1
    return int(np.sum(hi - lo))


def key_tiles(lengths, window, block_m, block_n):
    """Tiles the dK/dV kernel visits: for each block of block_n keys, the query blocks from its
    first key to (its last key's window or document end) (kernels._query_blocks)."""
    _, doc_end = _doc_bounds(lengths)
    T = len(doc_end)
    k_first = np.arange(0, T, block_n)
    k_last = np.minimum(k_first + block_n, T) - 1
    lo = k_first // block_m
    hi = -(-np.minimum(k_last + window, doc_end[k_last]) // block_m)
    return int(np.sum(hi - lo))


def visible_pairs(lengths, window):
    """(query, key) pairs the mask lets through: key <= query in one document, query - key < window."""
    return sum(min(n, window) * (min(n, window) + 1) // 2 + max(n - window, 0) * window for n in lengths)


def _launch_configs(values):
    """The attention op's launch configs from their flat ints (this tree's LaunchConfig, or a tree
    whose configs had six fields and four configs)."""
    fields = getattr(kernels, "CONFIG_FIELDS", 6)
    fields = fields if len(values) % fields == 0 else 6
    return [kernels.LaunchConfig(*values[i:i + fields]) for i in range(0, len(values), fields)]


def attention_op_args(event):
    """(window, [LaunchConfig], implementation) of an attention event ("" where the tree's op
    names none: its one backward, the deterministic one)."""
    args = list(event.args)
    impl = args.pop() if args and isinstance(args[-1], str) else ""
    return args[0], _launch_configs(args[1:]), impl


# PR 371's truncated attention backward on paper: the windows are chosen in the run, so the census
# prices every head's backward at the smallest candidate of attn_bwd_windows (its best case; set by
# census_of_stage from the config); None: no truncated backward in the config.
TRUNCATED_BACKWARD_WINDOW = None
ATTENTION_BACKWARD_TENSORS = 9     # kernels.attn_bwd's tensor inputs; a tenth: the per-head windows


def attention_implementations(event, lengths):
    """{implementation: [Kernel]} of an attention event on documents of `lengths`, from the tiles
    each implementation's kernels visit, and the implementations the call may run (all of them
    where it picks the fastest). A truncated backward (a per-head window table among its inputs)
    visits the tiles of TRUNCATED_BACKWARD_WINDOW."""
    window, configs, impl = attention_op_args(event)
    window = window if window > 0 else kernels.NO_WINDOW
    if event.name == "kernels.attn_bwd" and len(event.inputs) > ATTENTION_BACKWARD_TENSORS and \
            TRUNCATED_BACKWARD_WINDOW is not None:
        window = min(window, TRUNCATED_BACKWARD_WINDOW)
    q_shape = event.inputs[0][0] if event.name == "kernels.attn_fwd" else event.inputs[1][0]
    (T, H, d_qk), d_v = q_shape, (event.inputs[2][0] if event.name == "kernels.attn_fwd" else event.inputs[3][0])[2]

    def forward(config, structure="fa2"):
        tiles = query_tiles(lengths, window, config.block_m, config.block_n)
        span = tiles * config.block_n / max(1, math.ceil(T / config.block_m))
        return Kernel(2.0 * H * tiles * config.block_m * config.block_n * (d_qk + d_v), span, 0.0, False,
                      structure=structure)
    descriptor = descriptor_structures()
    # a call that picks the fastest also times the pointer and descriptor kernels at the other
    # window class's tiles (kernels.attention_candidate_tiles): the implementations "... other"
    index = 0 if event.name == "kernels.attn_fwd" else 4
    other = kernels.attention_candidate_tiles(configs, index)[1:] if impl == "auto" and len(configs) > index else ()
    if event.name == "kernels.attn_fwd":
        found = {"triton": [forward(configs[0])],
                 "flex": [forward(kernels.LaunchConfig(FLEX_BLOCK, FLEX_BLOCK))]}
        allowed = {"auto": ("triton", "flex"), "flex": ("flex",)}.get(impl, ("triton",))
        if descriptor:             # the descriptor kernel at the forward's tiles
            found["tma"] = [forward(configs[0], descriptor["forward"])]
            allowed = {"auto": ("triton", "tma", "flex"), "tma": ("tma",)}.get(impl, allowed)
        for config in other:
            found["triton other"] = [forward(config)]
            found.update({"tma other": [forward(config, descriptor["forward"])]} if descriptor else {})
        return found, allowed + tuple(name for name in ("triton other", "tma other") if name in found)
    kv, q = configs[1], configs[2]
    kv_tiles = key_tiles(lengths, window, kv.block_m, kv.block_n)
    q_tiles = query_tiles(lengths, window, q.block_m, q.block_n)
    delta_bytes = 2.0 * T * H * d_v * 2 + 4.0 * T * H
    # dK/dV: S again, dV = P^T dO, dP = dO V^T, dK = dS^T Q; dQ: S, dP, dQ = dS K
    found = {"deterministic": [
        Kernel(0.0, 0.0, delta_bytes, True),
        Kernel(2.0 * H * kv_tiles * kv.block_m * kv.block_n * (2 * d_qk + 2 * d_v),
               kv_tiles * kv.block_m / max(1, math.ceil(T / kv.block_n)), 0.0, True),
        Kernel(2.0 * H * q_tiles * q.block_m * q.block_n * (2 * d_qk + d_v),
               q_tiles * q.block_n / max(1, math.ceil(T / q.block_m)), 0.0, True)]}
    allowed = ("deterministic",)
    if len(configs) >= 5:          # the one-kernel backward: S, dV, dP, dK, dQ once per tile
        dq = 4.0 * T * H * d_qk

        def one_kernel(fused, structure):
            tiles = key_tiles(lengths, window, fused.block_m, fused.block_n)
            atomics = 2 * 4.0 * H * tiles * fused.block_m * d_qk          # each tile's dQ read and written in L2/HBM
            return [Kernel(2.0 * H * tiles * fused.block_m * fused.block_n * (3 * d_qk + 2 * d_v),
                           tiles * fused.block_m / max(1, math.ceil(T / fused.block_n)), atomics, True,
                           structure=structure),
                    Kernel(0.0, 0.0, dq + dq + dq / 2, True, launches=2)]     # zeroed, read, cast to bf16
        found["atomic"] = one_kernel(configs[4], "fa2")
        allowed = {"auto": ("atomic", "deterministic"), "deterministic": ("deterministic",)}.get(impl, ("atomic",))
        if descriptor:             # the one-kernel backward's descriptor variant, at its tiles
            found["tma"] = one_kernel(configs[4], descriptor["backward"])
            allowed = {"auto": ("atomic", "tma", "deterministic"), "tma": ("tma",)}.get(impl, allowed)
        for config in other:
            found["atomic other"] = one_kernel(config, "fa2")
            found.update({"tma other": one_kernel(config, descriptor["backward"])} if descriptor else {})
        allowed += tuple(name for name in ("atomic other", "tma other") if name in found)
    return found, allowed


def descriptor_structures():
    """{"forward": structure, "backward": structure} of this tree's descriptor attention variants
    ("fa3" where warp-specialized, else "descriptor"), or {} for a tree without them."""
    warp_specialized = getattr(kernels, "ATTENTION_WARP_SPECIALIZE", None)
    if warp_specialized is None:
        return {}
    return {key: "fa3" if warp_specialized[key] else "descriptor" for key in ("forward", "backward")}


def attention_flops(event, lengths):
    """FLOPs of an attention event on documents of `lengths`: the tiles the kernels of its rule
    visit (the first implementation it may run)."""
    if event.name not in ("kernels.attn_fwd", "kernels.attn_bwd"):   # composed attention
        (T, H, d_qk), d_v = event.inputs[0][0], event.inputs[2][0][2]
        span = kernels.COMPOSED_FORWARD
        pairs = math.ceil(T / span.block_m) * span.block_m * span.block_n * H
        per_pair = 2 * (d_qk + d_v) if event.name.endswith("fwd") else 2 * (3 * d_qk + 3 * d_v)
        return float(pairs * per_pair)
    found, allowed = attention_implementations(event, lengths)
    return sum(k.flops for k in found[allowed[0]])


def pointer_flops(event, lengths):
    """FLOPs of a pointer event on documents of `lengths`: the tiles its kernels visit
    (query_tiles, key_tiles: from a document's start, reaching back at most two band blocks, the
    window taken as 2 x band), 2 D per score in the forward (q.k; the target mass is a masked
    sum), 4 D per score in each backward kernel (the score again, then dS K or dS^T Q)."""
    D, band = event.inputs[0][0][1], event.args[0]
    forward, dq, dk = _launch_configs(event.args[1:])
    if event.name == "kernels.pointer_fwd":
        return float(query_tiles(lengths, 2 * band, forward.block_m, forward.block_n)
                     * forward.block_m * forward.block_n * 2 * D)
    return float((query_tiles(lengths, 2 * band, dq.block_m, dq.block_n) * dq.block_m * dq.block_n
                  + key_tiles(lengths, 2 * band, dk.block_m, dk.block_n) * dk.block_m * dk.block_n) * 4 * D)


FP8_STRUCTURES = {"auto": ("descriptor", "pointer", "cublas"), "rule": ("descriptor",), "tma": ("descriptor",),
                  "pointer": ("pointer",), "scaled_mm": ("cublas",)}


def fp8_structure(event):
    """("fp8", m, k, n, fast, structures, epilogue) of an FP8 GEMM event: the kernels it may run
    on (all three where it picks the fastest: the persistent descriptor kernel, the pointer
    kernel, cuBLAS), its accumulation and the fused MLP GEMMs' epilogue (None: a plain GEMM)."""
    (m, k), n = event.inputs[0][0], event.inputs[1][0][1]
    args = list(event.args)
    impl = args[-1] if args and isinstance(args[-1], str) and args[-1] in FP8_STRUCTURES else ""
    if event.name == "aten._scaled_mm":
        fast = bool(next((a for a in reversed(args) if isinstance(a, bool)), False))
        return ("fp8", m, k, n, fast, ("cublas",), None)
    if event.name == "kernels.fp8_matmul_quant":
        epilogue = next(a for a in args if a in ("relu2", "relu2_grad"))
        fast = epilogue == "relu2" or (bool(impl) and kernels.fp8_fast_accumulation(k))
        structures = ("descriptor", "pointer") if impl == "auto" else FP8_STRUCTURES.get(impl, ("pointer",))
        return ("fp8", m, k, n, fast, structures, epilogue)
    fast = bool(next(a for a in reversed(args) if isinstance(a, bool)))
    return ("fp8", m, k, n, fast, FP8_STRUCTURES.get(impl, ("pointer",)), None)


# -----------------------------------------------------------------------------------------------
# From events to priced ops
# -----------------------------------------------------------------------------------------------

def _collective_op(event, world):
    name, nbytes = event.name, float(sum(b for _, b in event.reads))
    if name in ("c10d.allreduce_",):
        moved = 2 * (world - 1) / world * nbytes
    elif "reduce_scatter" in name:
        moved = (world - 1) / world * float(event.reads[-1][1])
    elif "allgather" in name:
        moved = (world - 1) / world * float(event.writes[0][1])
    else:                          # all-to-all: what this rank sends to the others
        moved = (world - 1) / world * float(event.reads[-1][1])
    return Op(name, "collective", event.phase, comm=moved, kernels=0, **_storages(event))


def _storages(event):
    return dict(reads=frozenset(sid for sid, _ in event.reads), writes=frozenset(sid for sid, _ in event.writes))


def _kernel_op(event, lengths):
    name = event.name
    if name in GEMM_OPS:
        flops, dtype = gemm_flops(event)
        structure = fp8_structure(event) if dtype == "fp8" else ()
        return Op(name, "gemm", event.phase, flops=flops, dtype=dtype, bytes=_read_write_bytes(event),
                  structure=structure, **_storages(event))
    if name in ("kernels.attn_fwd", "kernels.attn_bwd"):
        found, allowed = attention_implementations(event, lengths)
        rule = found[allowed[0]]
        return Op(name, "attention", event.phase, flops=sum(k.flops for k in rule), dtype="bf16",
                  bytes=_read_write_bytes(event), kernels=sum(k.launches for k in rule),
                  structure=("attention", found, allowed), **_storages(event))
    if name in ATTENTION_OPS:
        return Op(name, "attention", event.phase, flops=attention_flops(event, lengths), dtype="bf16",
                  bytes=_read_write_bytes(event), **_storages(event))
    if name in POINTER_OPS:
        return Op(name, "pointer", event.phase, flops=pointer_flops(event, lengths), dtype="bf16",
                  bytes=_read_write_bytes(event), kernels=1 if name.endswith("fwd") else 2, **_storages(event))
    if name == "kernels.fp8_cast_weights":    # an amax pass where the rule reads the weights' own amax,
        exact = event.args[2] >= kernels.RULE_EXACT   # the scale kernel, the cast
        weight_bytes = sum(nbytes for _, nbytes in event.reads[:len(event.reads) // 2])
        return Op(name, "kernel", event.phase, bytes=_read_write_bytes(event) + exact * weight_bytes,
                  kernels=3 if exact else 2, **_storages(event))
    family = "cross-entropy" if name in CROSS_ENTROPY_OPS else "kernel"
    nbytes = sort_bytes(event) if name == "aten.sort" else _read_write_bytes(event)
    return Op(name, family, event.phase, bytes=nbytes, **_storages(event))


def _fusible(event):
    return not (event.name in GEMM_OPS or event.name in ATTENTION_OPS or event.name in COLLECTIVE_OPS
                or event.name in EXTERN_ATEN_OPS or event.name.startswith(("kernels.", "c10d.", "census.")))


def _later_reads(events):
    """storage id -> the indices of the events that read it."""
    readers = collections.defaultdict(list)
    for i, e in enumerate(events):
        for sid, _ in e.reads:
            readers[sid].append(i)
    return readers


def _region_op(events, first, last, readers, created, fused=True):
    """One fused region: events[first:last] (fusible ops of one phase); not fused: one eager op,
    which writes every output."""
    reads, writes = {}, {}
    made_here = set()
    for i in range(first, last):
        e = events[i]
        for sid, nbytes in e.reads:
            if sid not in made_here:
                reads[sid] = max(reads.get(sid, 0), nbytes)
        for sid, nbytes in e.writes:
            if created.get(sid, -1) >= first:
                made_here.add(sid)
            writes[sid] = max(writes.get(sid, 0), nbytes)
    kept = {sid: nbytes for sid, nbytes in writes.items()
            if not fused or created.get(sid, -1) < first or any(j >= last for j in readers[sid])}
    names = collections.Counter(events[i].name.split(".", 1)[1] for i in range(first, last))
    reductions = sum(events[i].name in REDUCTION_OPS for i in range(first, last))
    sizes = {math.prod(shape) for i in range(first, last) if events[i].name not in REDUCTION_OPS
             for shape, _ in events[i].outputs}
    label = "fused: " + ", ".join(n for n, _ in names.most_common(4)) + (", ..." if len(names) > 4 else "")
    return Op(label, "pointwise", events[first].phase, bytes=float(sum(reads.values()) + sum(kept.values())),
              kernels=max(1, len(sizes)) + reductions, reads=frozenset(reads), writes=frozenset(kept))


def recomputed_casts(events):
    """The events with the backward reading, for each widening cast the forward made, the cast's
    source instead: Inductor's partitioner, which saves as few bytes as it can, recomputes such a
    cast in the backward rather than saving its output (an fp32 copy of a bf16 activation saved
    for a norm's backward, say)."""
    source = {}
    for e in events:
        if (e.phase == "forward" and e.name == "aten._to_copy" and len(e.reads) == 1 and len(e.writes) == 1
                and e.reads[0][1] < e.writes[0][1]):
            source[e.writes[0][0]] = e.reads[0]
    return [dataclasses.replace(e, reads=[source.get(sid, (sid, nbytes)) for sid, nbytes in e.reads])
            if e.phase == "backward" else e for e in events]


def priced_ops(events, lengths, world, compiled=()):
    """The Ops of a census: kernels and collectives one each; the fusible aten ops fused into
    regions inside the `compiled` phases (with the forward's casts recomputed in a compiled
    backward), one op each elsewhere."""
    if "backward" in compiled:
        events = recomputed_casts(events)
    readers = _later_reads(events)
    created, seen = {}, set()      # storage id -> the event that made it (absent: it existed before)
    for i, e in enumerate(events):
        if not e.in_place:
            created.update({sid: i for sid, _ in e.writes if sid not in seen})
        seen.update(sid for sid, _ in e.reads + e.writes)
    ops, i = [], 0
    while i < len(events):
        e = events[i]
        if e.name in COLLECTIVE_OPS:
            ops.append(_collective_op(e, world))
        elif not _fusible(e):
            ops.append(_kernel_op(e, lengths))
        elif e.phase in compiled:
            j = i + 1
            while j < len(events) and _fusible(events[j]) and events[j].phase == e.phase:
                j += 1
            ops.append(_region_op(events, i, j, readers, created))
            i = j
            continue
        else:
            ops.append(_region_op(events, i, i + 1, readers, created, fused=False))
            ops[-1].name = e.name
        i += 1
    return [op for op in ops if op.bytes or op.flops or op.comm]


# -----------------------------------------------------------------------------------------------
# Tracing a run's micro-batches and updates
# -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class StageCensus:
    """The priced ops of one stage: per micro-batch, and of the optimizers' updates."""
    micro_batch: list
    updates: list                  # Muon's and Adam's ops in launch order (optim.step_together)
    averages: dict                 # index of an Average -> ops of one sample of it
    tables: "TableOps"

    @property
    def muon(self):
        return [op for op in self.updates if op.phase == "muon"]

    @property
    def adam(self):
        return [op for op in self.updates if op.phase in ("adam", "value_adam")]


def kernel_fns(h):
    """The kernel functions the GPU path runs (train_gpt.select_kernels on CUDA)."""
    return train_gpt.select_kernels(dataclasses.replace(h, kernels="auto", device="cuda"), torch.device("cuda"))


@functools.lru_cache(maxsize=4)
def _fake_process_group(world):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    if dist.is_initialized():
        dist.destroy_process_group()
    if world > 1:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    return world


def stage_first_step(h, index):
    return sum(train_gpt.steps_per_stage(h)[:index])


def trace_stage(h, index, world, step=None):
    """Events of one micro-batch of stage `index` (forward, backward) and of the updates after it
    (Muon, Adam, each average's sample), at the stage's first step (or `step`), on rank 0 of `world`."""
    from cuda_autocast import cuda_autocast_rules
    from torch._subclasses.fake_tensor import FakeTensorMode
    _fake_process_group.cache_clear()
    _fake_process_group(world)
    stage, step = h.stages[index], stage_first_step(h, index) if step is None else step
    fns = kernel_fns(h)
    census = Census()
    with torch.random.fork_rng(devices=[]), cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True):
        model = train_gpt.build_model(h, fns, ngram_table.TablePlacement(0, world, h.ngram_cache_rows))
        optimizers = train_gpt.build_optimizers(h, model, fns, census.run_bank if h.cuda_graphs else None)
        train_gpt.model_at(model, h, step)
        T = stage.tokens_per_rank
        model.set_loss_unit(1.0 / (T * (h.batch_ranks // world)))   # as the trainer does: the objective's weight
        with model.sinks_of(T):
            for p in model.parameters():   # gradients exist after the first step; the backward adds into them
                p.grad = torch.zeros_like(p) if p.requires_grad else None
        with model.sinks_of(T), census:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.compute_dtype == "bfloat16"):
                objective, _ = train_gpt.micro_batch_losses(model, stage, train_gpt.attention_windows(h, step),
                                                            MicroBatch.zeros(stage),
                                                            train_gpt.target_weights(stage, "cpu"))
            census.phase = "backward"
            objective.backward()
            for phase in ("first update", None):   # the first update makes the state; the second is every later one's
                for opt in optimizers:
                    if hasattr(opt, "step_every"):
                        opt.pending_calls = opt.step_every - 1   # this call updates
                optim.step_together([_Labelled(census, opt, phase or update_phase(opt)) for opt in optimizers])
            ships = {}
            for i, average in enumerate(h.averages):
                census.phase = f"averages{i}"
                single = optim.WeightAverages([average], model, h.num_iterations, fns.ema_update)
                single.sample(h.num_iterations - 1)   # seeds the EMA (a copy)
                start = len(census.events)
                single.sample(h.num_iterations - 1)   # an EMA update, what the other samples cost
                ships[i] = start
        widths = [ve.embedding_dim for ve in model.value_embeds] if h.value_embed_sparse else []
    _fake_process_group.cache_clear()
    _fake_process_group(1)
    return census.events, ships, widths


def update_phase(optimizer):
    """The phase an optimizer's update ops are priced under: Muon's every step, Adam's on the steps
    it updates, the value embeddings' Adam (value_embed_table_cadence) on the tables' cadence."""
    if isinstance(optimizer, optim.Muon):
        return "muon"
    return "value_adam" if getattr(optimizer, "name", "") == "value_embed_adam" else "adam"


class _Labelled:
    """An optimizer whose calls record their ops under `phase` in the census (step_together
    interleaves the optimizers' parts: each op is labelled with the optimizer it belongs to)."""

    def __init__(self, census, optimizer, phase):
        self.census, self.optimizer, self.phase = census, optimizer, phase

    def __getattr__(self, name):
        method = getattr(self.optimizer, name)

        def labelled(*args, **kwargs):
            self.census.phase = self.phase
            return method(*args, **kwargs)
        return labelled


def census_of_stage(h, index, world, step=None):
    global TRUNCATED_BACKWARD_WINDOW
    TRUNCATED_BACKWARD_WINDOW = min(h.attn_bwd_windows) if h.attn_bwd_windows else None
    stage = h.stages[index]
    events, ships, widths = trace_stage(h, index, world, step)
    lengths = document_lengths(stage.tokens_per_rank, stage.max_doc_len)
    ops = priced_ops([e for e in events if not e.phase.startswith(("averages", "first update"))], lengths, world,
                     compiled_phases(h))
    averages = {}
    for i, start in ships.items():
        sampled = [e for e in events[start:] if e.phase == f"averages{i}"]
        for e in sampled:
            e.phase = "averages"
        averages[i] = priced_ops(sampled, lengths, world)
    return StageCensus([op for op in ops if op.phase in MICRO_BATCH_PHASES],
                       [op for op in ops if op.phase in UPDATE_PHASES], averages, table_ops(h, index, world, widths))


# -----------------------------------------------------------------------------------------------
# The sparse tables, from the rows a slice touches
# -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TableOps:
    per_slice: list                # after each micro-batch
    ngram_event: list              # the n-gram table's Adam event
    value_event: list              # the value tables' Adam event


def tiny_corpus_stream(tokens):
    """The first `tokens` tokens of the tiny corpus's text (int64), or None when it is not built
    (python data/tiny_corpus.py) or shorter."""
    from data.shards import read_shard
    parts, have = [], 0
    for file in sorted(REPO_ROOT.glob("data/tiny_corpus/tiny_train_*.bin")):
        if have >= tokens:
            break
        parts.append(torch.from_numpy(read_shard(str(file)).astype(np.int64)))
        have += len(parts[-1])
    return torch.cat(parts)[:tokens] if have >= tokens else None


def distinct_tokens(tokens):
    """Distinct tokens among `tokens` of text, measured on the tiny corpus when it is built (its
    vocabulary is narrower than FineWeb's, so this is low), else min(vocabulary, tokens), an upper
    bound."""
    stream = tiny_corpus_stream(tokens)
    if stream is None:
        return min(train_gpt.PADDED_VOCAB_SIZE, tokens), "upper bound: every token distinct"
    return torch.unique(stream).numel(), "measured on the tiny corpus: low for FineWeb's wider vocabulary"


def distinct_fraction(h, tokens):
    """Distinct n-gram rows among a slice's 2 T lookups, measured on the tiny corpus's text when it
    is built (python data/tiny_corpus.py), else 1 (every lookup a row of its own: an upper bound)."""
    stream = tiny_corpus_stream(tokens) if h.ngram_rows else None
    if stream is None:
        return 1.0, "upper bound: every lookup a distinct row"
    starts = stream == train_gpt.BOS_ID
    rows = ngram_table.ngram_rows(stream, starts, h.ngram_rows).reshape(-1)
    return torch.unique(rows).numel() / rows.numel(), f"measured on {len(stream):,} tokens of the tiny corpus"


def table_ops(h, index, world, value_widths=()):
    """The sparse tables' traffic: per micro-batch (a split table's rows fetched and their summed
    gradients sent back by all-to-all; the row sums and their accumulation; the value tables' row
    sums) and per Adam event (the touched rows' update; the value tables' all-reduce of the rows
    any process touched)."""
    stage = h.stages[index]
    T, D = stage.tokens_per_rank, h.model_dim
    sink = 2 if h.param_dtype == "bfloat16" else 4   # bytes of a gradient sink's element (the weights' dtype)
    per_slice, ngram_event, value_event = [], [], []
    if h.ngram_rows:
        row = D * getattr(torch, h.ngram_dtype).itemsize
        fraction, _ = distinct_fraction(h, T)
        distinct = 2 * T * fraction
        split = world > 1 and not h.ngram_cache_rows
        if split:
            remote = distinct * (world - 1) / world
            per_slice += [Op("n-gram rows: gather for the askers", "tables", "tables", bytes=2 * distinct * row),
                          Op("n-gram rows: all-to-all to the askers", "collective", "tables", comm=remote * row,
                             kernels=0),
                          Op("n-gram gradients: all-to-all to the owners", "collective", "tables",
                             comm=remote * row, kernels=0)]        # in the table's dtype
        if split:                  # summed per row for the owners (every slot written), then the received sums added
            per_slice += [Op("n-gram gradients: sum per row", "tables", "tables",
                             bytes=2 * T * D * sink + 2 * T * row + 2 * T * D * sink),   # read, write, zero the sink
                          Op("n-gram gradients: add to the pending sums", "tables", "tables",
                             bytes=distinct * row + 2 * distinct * D * 4)]
        else:                      # the sink's entries summed straight into the pending rows (add_row_sums_)
            per_slice += [Op("n-gram gradients: add to the pending sums", "tables", "tables",
                             bytes=2 * T * D * sink + 2 * distinct * D * 4 + 2 * T * D * sink)]   # and zero the sink
        every = max([h.ngram_step_every, *(p.step_every for p in h.table_phases)])
        rows = min(sparse_event_rows(h, world, distinct, every), h.ngram_rows // world)
        ngram_event.append(Op("n-gram sparse Adam", "tables", "tables",
                              bytes=rows * (2 * row + D * 4 + 2 * 8)))
    if h.value_embed_sparse:
        vocab = train_gpt.PADDED_VOCAB_SIZE
        every = max([h.ngram_step_every, *(p.step_every for p in h.table_phases)])
        touched, _ = distinct_tokens(T * h.batch_ranks * every)   # every process's slices since the last event
        for width in value_widths:
            row = width * 4
            per_slice.append(Op(f"value table {width}: row sums", "tables", "tables",   # added into the table's
                                bytes=2 * T * width * sink + 2 * min(T, vocab) * row))   # and the sink zeroed
            if world > 1:          # in the table's dtype: cast there and back to fp32
                value_event.append(Op(f"value table {width}: all-reduce of the touched rows' sums", "collective",
                                      "tables", comm=2 * (world - 1) / world * touched * width * sink, kernels=0))
                value_event.append(Op(f"value table {width}: the touched rows' sums cast for the all-reduce and back",
                                      "tables", "tables", bytes=2 * touched * width * (4 + sink), kernels=2))
            value_event.append(Op(f"value table {width}: gather the touched rows, sparse Adam, clear", "tables",
                                  "tables", bytes=touched * row * 4 + touched * width * (2 * 4 + 4) + vocab * row))
    return TableOps(per_slice, ngram_event, value_event)


def sparse_event_rows(h, world, distinct_per_slice, every):
    """Rows one process's n-gram Adam event updates: the distinct rows of every slice since the
    last event (no overlap counted between slices: an upper bound)."""
    slices = every * h.batch_ranks
    return distinct_per_slice * slices / world if world > 1 and not h.ngram_cache_rows else distinct_per_slice * slices


# -----------------------------------------------------------------------------------------------
# Prices
# -----------------------------------------------------------------------------------------------

def op_seconds(op, gpu, eff, world):
    """The roofline time of one op (priced by its kernels' structure where `eff` has structures),
    and the gaps before its kernels."""
    if op.family == "collective":
        if world <= 1:
            return 0.0
        return COLLECTIVE_LATENCY_S * eff.floors + op.comm / (gpu.link_gb_s * 1e9 * eff.link)
    if eff.structures is not None and op.structure:
        return structure_seconds(op, gpu, eff)
    rate = eff.attention if op.family in ("attention", "pointer") else eff.gemm
    if eff.structures is not None and op.family == "gemm":
        rate = BF16_GEMM
    compute = op.flops / (gpu.tflops[op.dtype] * 1e12 * rate) if op.flops else 0.0
    memory = op.bytes / (gpu.hbm_tb_s * 1e12 * eff.hbm)
    return max(compute, memory, KERNEL_FLOOR_S * op.kernels * eff.floors) + eff.gap_s * op.kernels


def structure_seconds(op, gpu, eff):
    """An FP8 GEMM's or attention's time by the structure of each kernel that can run it (the
    fastest where the call picks the fastest), with a gap before each kernel."""
    s = eff.structures
    memory = op.bytes / (gpu.hbm_tb_s * 1e12 * eff.hbm)
    if op.structure[0] == "fp8":
        _, m, k, n, fast, structures, epilogue = op.structure
        times = []
        for structure in structures:
            launches = 1
            if structure == "descriptor" and epilogue is None:
                tiles, k_steps, elements, _ = gemm_tiles(m, n, k, fast, structure)
                launches += kernels.split_k_plan(tiles, k_steps, 132, elements)[1] > 0
            compute = op.flops / (gpu.tflops["fp8"] * 1e12 * gemm_efficiency(m, n, k, fast, structure, s, epilogue))
            times.append(max(compute, memory, KERNEL_FLOOR_S * launches) + eff.gap_s * launches)
        return min(times)
    _, found, allowed = op.structure
    times = []
    for impl in allowed:
        total = 0.0
        for kernel in found[impl]:
            compute = (kernel.flops / (gpu.tflops["bf16"] * 1e12 * attention_efficiency(
                kernel.span, kernel.backward, s, kernel.structure)) if kernel.flops else 0.0)
            total += max(compute, kernel.bytes / (gpu.hbm_tb_s * 1e12 * eff.hbm), KERNEL_FLOOR_S * kernel.launches)
            total += eff.gap_s * kernel.launches
        times.append(total)
    return max(min(times), memory)


def ops_seconds(ops, gpu, eff, world):
    return sum(op_seconds(op, gpu, eff, world) * op.count for op in ops)


def two_stream_seconds(ops, gpu, eff, world):
    """Seconds of `ops`, in launch order, on a GPU's two streams. Each collective runs on the
    communication stream, in launch order, from the later of its launch (when the compute stream
    has done every op launched before it: the communication stream waits for the launching one)
    and the stream's previous collective. Every other op runs on the compute stream after the
    ops before it and after each collective that writes a storage it reads or writes, or reads
    one it writes (the wait() before a result is used, or its buffer reused). Done when both
    streams are."""
    compute = comm = 0.0
    collectives = []               # (done at, reads, writes)
    for op in ops:
        seconds = op_seconds(op, gpu, eff, world)
        if op.family == "collective":
            comm = max(comm, compute) + seconds
            collectives.append((comm, op.reads, op.writes))
            continue
        start = compute
        for done, reads, writes in collectives:
            if writes & (op.reads | op.writes) or reads & op.writes:
                start = max(start, done)
        compute = start + seconds
    return max(compute, comm)


# The communication the optimizers' update math hides, a negative entry of the sinks.
HIDDEN = Op("collectives under the update math", "hidden", "optimizers")


@dataclasses.dataclass
class RunModel:
    """A preset's census and its prices on a GPU."""
    h: object
    world: int
    gpu: Gpu
    stages: list                   # StageCensus per stage
    # (stage, approximate_backward_at) -> StageCensus where PR 371's approximate backward changes
    # inside a stage (traced at the first step of the stage in that state)
    variants: dict = dataclasses.field(default_factory=dict)

    @property
    def accum(self):
        return self.h.batch_ranks // self.world

    def tables_update(self, step):
        """Whether the tables (and the value embeddings' Adam on their cadence) update at `step`:
        every step_every-th step (counted from step 0: a close enough share across a phase's start)."""
        return (step + 1) % train_gpt.table_schedule(self.h, step).step_every == 0

    def update_ops(self, step):
        """The optimizers' ops of one step in launch order: Muon's, Adam's on the steps it updates,
        the value embeddings' Adam on the tables'."""
        due = {"muon": True, "adam": (step + 1) % self.h.adam_step_every == 0, "value_adam": self.tables_update(step)}
        return [op for op in self.stages[train_gpt.stage_index(self.h, step)].updates if due[op.phase]]

    def hidden_seconds(self, step, eff):
        """Seconds of the optimizers' communication that their math hides (two_stream_seconds):
        the sum of their ops' times less the two streams' time."""
        ops = self.update_ops(step)
        alone = sum(op_seconds(op, self.gpu, eff, self.world) for op in ops)
        return alone - two_stream_seconds(ops, self.gpu, eff, self.world)

    def step_ops(self, step):
        """(op, times it runs) of one training step, each priced alone (hidden_seconds overlaps
        the updates' communication with their math)."""
        h, index = self.h, train_gpt.stage_index(self.h, step)
        s = self.variants.get((index, train_gpt.approximate_backward_at(h, step)), self.stages[index])
        ops = [(op, self.accum) for op in s.micro_batch + s.tables.per_slice] + [(op, 1) for op in self.update_ops(step)]
        if self.tables_update(step):
            ops += [(op, 1) for op in s.tables.ngram_event + s.tables.value_event]
        averages = optim.WeightAverages(h.averages, None, h.num_iterations)
        for i, average in enumerate(h.averages):
            if averages.samples_at(average, step):
                ops += [(op, 1) for op in s.averages[i]]
        return ops

    def step_seconds(self, step, eff):
        return (sum(op_seconds(op, self.gpu, eff, self.world) * n for op, n in self.step_ops(step))
                - self.hidden_seconds(step, eff))

    def run_seconds(self, eff):
        return sum(self.step_seconds(step, eff) for step in range(self.h.num_iterations))

    def stage_steps(self):
        steps = collections.defaultdict(list)
        for step in range(self.h.num_iterations):
            steps[train_gpt.stage_index(self.h, step)].append(step)
        return steps

    def step_sinks(self, step, eff, key):
        """Seconds of one step by key(op); the communication its updates hide under key(HIDDEN),
        negative, so that the values add up to the step."""
        total = collections.Counter()
        for op, n in self.step_ops(step):
            total[key(op)] += op_seconds(op, self.gpu, eff, self.world) * n
        total[key(HIDDEN)] -= self.hidden_seconds(step, eff)
        return total

    def sinks(self, eff, key):
        """Seconds of the whole run by key(op) (step_sinks)."""
        total = collections.Counter()
        for step in range(self.h.num_iterations):
            total.update(self.step_sinks(step, eff, key))
        return total


def family_of(op):
    if op.family == "gemm":
        return f"GEMM {op.dtype}"
    if op.family == "collective":
        return "communication"
    if op.family == "hidden":
        return "communication under the optimizers' math (hidden)"
    if op.phase in ("muon", "adam", "value_adam", "averages") and op.family != "gemm":
        return f"{'adam' if op.phase == 'value_adam' else op.phase} (memory)"
    return {"pointwise": "pointwise, norms, residual (fused)", "kernel": "other kernels",
            "pointer": "pointer mixture kernels"}.get(op.family, op.family)


def build_model(h, world, gpu):
    _fake_process_group(1)
    return RunModel(h, world, gpu, [census_of_stage(h, i, world) for i in range(len(h.stages))],
                    approximate_variants(h, world))


def approximate_variants(h, world):
    """StageCensus of each (stage, approximate-backward state) that its stage's first step does
    not have (PR 371's steps 594-1106 begin inside a stage), traced at its first step."""
    variants, first = {}, {}
    for step in range(h.num_iterations):
        index = train_gpt.stage_index(h, step)
        first.setdefault((index, train_gpt.approximate_backward_at(h, step)), step)
    for (index, state), step in first.items():
        if step != stage_first_step(h, index):
            variants[index, state] = census_of_stage(h, index, world, step)
    return variants


# -----------------------------------------------------------------------------------------------
# The report
# -----------------------------------------------------------------------------------------------

def markdown(header, rows):
    lines = [header, ["---"] * len(header)] + rows
    return "\n".join("| " + " | ".join(str(c) for c in row) + " |" for row in lines)


def stage_table(m):
    rows = []
    for index, steps in sorted(m.stage_steps().items()):
        stage = m.h.stages[index]
        ms = [1000 * statistics_mean(m.step_seconds(s, eff) for s in steps) for eff in (REALISTIC, PEAK)]
        seconds = sum(m.step_seconds(s, REALISTIC) for s in steps)
        rows.append([index, f"{steps[0]}-{steps[-1]}", f"{stage.tokens_per_rank:,}", m.accum,
                     stage.candidates or train_gpt.PADDED_VOCAB_SIZE, f"{stage.short_window}/{stage.long_window}",
                     f"{ms[0]:.1f}", f"{ms[1]:.1f}", f"{seconds:.2f}"])
    return markdown(["stage", "steps", "tokens/GPU", "micro-batches", "softmax width", "windows (blocks)",
                     "ms/step", "ms/step at peak", "s in the run"], rows)


def statistics_mean(values):
    values = list(values)
    return sum(values) / len(values)


def family_table(m):
    by_stage = {}
    for index, steps in sorted(m.stage_steps().items()):
        totals = collections.Counter()
        for step in steps:
            totals.update({f: s / len(steps) for f, s in m.step_sinks(step, REALISTIC, family_of).items()})
        by_stage[index] = totals
    whole = m.sinks(REALISTIC, family_of)
    families = [f for f, _ in whole.most_common()]
    rows = [[f] + [f"{1000 * by_stage[i][f]:.2f}" for i in sorted(by_stage)] + [f"{whole[f]:.2f}"]
            for f in families]
    return markdown(["family"] + [f"stage {i} ms/step" for i in sorted(by_stage)] + ["s in the run"], rows)


def sink_table(m, count=10):
    sinks = m.sinks(REALISTIC, lambda op: (op.phase, op.family, op.name))
    total = sum(sinks.values())
    rows = [[phase, family, name, f"{seconds:.2f}", f"{100 * seconds / total:.1f}%"]
            for (phase, family, name), seconds in sinks.most_common(count)]
    return markdown(["phase", "family", "op", "s in the run", "share"], rows)


def calibration_table(m):
    """The model's step time beside record 89's logged one, for each stage with a logged batch."""
    rows = []
    for index, steps in sorted(m.stage_steps().items()):
        stage = m.h.stages[index]
        logged = RECORD89_STEP_MS.get(stage.tokens_per_rank * m.accum if m.world == 8 else None)
        if logged is None or index in [r[0] for r in rows]:
            continue
        predicted = 1000 * statistics_mean(m.step_seconds(s, REALISTIC) for s in steps)
        rows.append([index, f"{stage.tokens_per_rank:,}", f"{predicted:.1f}", f"{logged:.2f}",
                     f"{predicted / logged:.2f}"])
    return rows


def report(h, world, gpu_name):
    gpu = GPUS[gpu_name]
    m = build_model(h, world, gpu)
    realistic, peak = m.run_seconds(REALISTIC), m.run_seconds(PEAK)
    fraction, source = distinct_fraction(h, h.stages[0].tokens_per_rank)
    touched, touched_source = distinct_tokens(h.stages[0].tokens_per_rank * h.batch_ranks * h.ngram_step_every)
    lines = [f"# Step model: `{h.preset}` on {world}x{gpu.name}", "",
             f"Efficiencies: GEMM {REALISTIC.gemm:.0%}, attention {REALISTIC.attention:.0%}, HBM {REALISTIC.hbm:.0%}, "
             f"NVLink {REALISTIC.link:.0%} + {COLLECTIVE_LATENCY_S * 1e6:.0f} us a collective, a kernel at least "
             f"{KERNEL_FLOOR_S * 1e6:.0f} us ('at peak': 100% and no floors). Distinct n-gram rows per lookup: "
             f"{fraction:.3f} ({source}). Distinct tokens a value-table update spans in stage 0: "
             f"{touched:,} ({touched_source}).", "",
             "## Per stage", "", stage_table(m), "",
             "## By family (ms per step, the mean of each stage's steps; seconds in the whole run)", "", family_table(m), "",
             "## The ten largest time sinks", "", sink_table(m), ""]
    if h.preset == "record89":
        rows = calibration_table(m)
        lines += ["## Calibration against record 89's logged step times", "",
                  markdown(["stage", "tokens/GPU", "model ms/step", "record 89 ms/step", "ratio"], rows), ""]
    kind = gpu_name.upper()
    band = band_seconds(m)
    lines += ["## The band", "", band_text(band), ""]
    lines.append(f"predicted: {h.preset} on {world}x{kind}: {realistic:.1f} s realistic, {peak:.1f} s at peak; "
                 f"band {band['record89']:.1f} s (record-89 constants), {band['structure']:.1f} s (structure-based), "
                 f"{band['pessimistic']:.1f} s (pessimistic)"
                 + (f", {band['measured']:.1f} s (measured)" if "measured" in band else ""))
    return "\n".join(lines), m


def band_seconds(m, measured_path=MEASURED_PATH):
    """The run's seconds under each line of the band: the record-89 constants, the structure-based
    prices (STRUCTURE), the pessimistic ones (PESSIMISTIC), and with first contact's measured
    efficiencies when bench/measured_efficiency.json exists."""
    band = {"record89": m.run_seconds(REALISTIC), "structure": m.run_seconds(STRUCTURE),
            "pessimistic": m.run_seconds(PESSIMISTIC)}
    measured = measured_efficiency(measured_path)
    if measured is not None:
        band["measured"] = m.run_seconds(measured)
    return band


def band_text(band):
    """The band's lines, each with what prices it."""
    s, p = STRUCTURE.structures, PESSIMISTIC.structures
    rows = [("record-89 constants", band["record89"], "GEMM 65%, attention 45% of the peaks, no gap between kernels "
                                                      "(what reproduces record 89's cuBLAS/FlashAttention-3 step times)"),
            ("structure-based", band["structure"],
             f"each kernel by its structure: FP8 persistent descriptor {s.fp8['descriptor']:.1%}, pointer "
             f"{s.fp8['pointer']:.1%}, cuBLAS {s.fp8['cublas']:.1%} at 8192x8192x4096, scaled by waves and K depth, "
             f"promoted accumulation {s.promotion_cost:.3f}x the time every {PROMOTION_COST_K} products (every "
             f"{kernels.PROMOTION_K}: that extra share x{PROMOTION_COST_K / kernels.PROMOTION_K:g}); attention FlashAttention-2-class "
             f"{s.attention_long:.0%} on long spans, {s.attention_at_512:.0%} at 512 keys, backward "
             f"x{s.backward_ratio:.2f}, descriptor loads x{DESCRIPTOR_FACTOR:.2f}, warp-specialized too "
             f"(FlashAttention-3-class) x{FA3_FACTOR:.2f}; {STRUCTURE.gap_s * 1e6:.0f} us between kernels"),
            ("pessimistic", band["pessimistic"],
             f"the low ends: FP8 kernels at pointer/cuBLAS of those shares, promotion {p.promotion_cost:.2f}x, "
             f"attention {p.attention_long:.0%} / {p.attention_at_512:.0%}, HBM {PESSIMISTIC.hbm:.0%}, NVLink "
             f"{PESSIMISTIC.link:.0%}, {PESSIMISTIC.gap_s * 1e6:.0f} us between kernels")]
    if "measured" in band:
        rows.append(("measured", band["measured"], f"first contact's efficiencies ({MEASURED_PATH.name})"))
    return markdown(["line", "s", "priced by"], [[name, f"{seconds:.1f}", what] for name, seconds, what in rows])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="The performance model of a preset's training run at full size: "
                                            "an op census on fake tensors, priced by a roofline per op.")
    p.add_argument("--preset", default="speedrun", help="the preset to model (default: speedrun)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the GPU kind (default: h100)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in the run (default: 8; must divide batch_ranks)")
    p.add_argument("--write", action="store_true", help=f"regenerate {TABLES_PATH.name}: the reports of STANDARD_RUNS")
    p.add_argument("--json", metavar="PATH", help="also write the predictions as JSON (per stage, the run, communication)")
    p.add_argument("overrides", nargs="*", help="config overrides, --key=value after '--'")
    return p.parse_args(argv)


def write_tables():
    """bench/results/step_model.md: the report of every run of STANDARD_RUNS, regenerated whole."""
    sections = ["# The step model's predictions", "",
                "Made by `python bench/step_model.py --write` (every table below is regenerated by it; the "
                "model and its constants are in bench/step_model.py). Projections, not measurements: no run of "
                "these presets on a GPU exists yet.", ""]
    for preset, gpus, kind in STANDARD_RUNS:
        text, _ = report(train_gpt.parse_config(["--preset", preset]), gpus, kind)
        sections += ["#" + text.replace("\n## ", "\n### "), ""]
        print(text.splitlines()[-1], flush=True)
    TABLES_PATH.write_text("\n".join(sections))


def refuse(line):
    """End with one line on stderr and exit status 2 (a bad argument)."""
    print(f"error: {line}", file=sys.stderr)
    raise SystemExit(2)


def json_path_refusal(path):
    """Why --json cannot be written at `path` (checked before the census, which takes a while), or None."""
    target = pathlib.Path(path)
    if target.is_dir():
        return f"--json {path} is a folder: give the path of a file"
    if not target.parent.is_dir():
        return f"--json {path}: its folder {target.parent} does not exist; create it or give another path"
    return None


def main(argv=None):
    args = parse_args(argv)
    if args.write:
        write_tables()
        return
    if args.json and (refusal := json_path_refusal(args.json)):
        refuse(refusal)
    try:
        h = train_gpt.parse_config(["--preset", args.preset, *args.overrides])
    except ConfigError as e:
        refuse(e)
    if args.gpus < 1 or h.batch_ranks % args.gpus:
        refuse(f"--gpus={args.gpus} must divide the preset's batch_ranks ({h.batch_ranks})")
    text, m = report(h, args.gpus, args.gpu)
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(predictions(m), indent=1))


def predictions(m):
    """A RunModel's numbers as JSON values: each stage's mean ms per step (realistic and at the
    peaks), the whole run, and its seconds of communication (what the optimizers' math does not
    hide) and of compute (the rest)."""
    stages = []
    for index, steps in sorted(m.stage_steps().items()):
        stages.append(dict(index=index, steps=len(steps), tokens_per_rank=m.h.stages[index].tokens_per_rank,
                           ms=1e3 * statistics_mean(m.step_seconds(s, REALISTIC) for s in steps),
                           ms_peak=1e3 * statistics_mean(m.step_seconds(s, PEAK) for s in steps)))
    families = m.sinks(REALISTIC, family_of)
    run = m.run_seconds(REALISTIC)
    exposed = families["communication"] + families[family_of(HIDDEN)]
    return dict(preset=m.h.preset, gpus=m.world, gpu=m.gpu.name, stages=stages, run_s=run,
                peak_s=m.run_seconds(PEAK), communication_s=exposed, compute_s=run - exposed, band=band_seconds(m))


if __name__ == "__main__":
    main()
