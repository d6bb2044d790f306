"""GPU check of the speedrun trainer: the GPU tests, kernel timings against torch at the speedrun
shapes, training-step timings of the 1-GPU preset, one compiled run, and a projection of the
8xH100 training time, written as one markdown section.

    OUT=/tmp/out python bench/bench_gpu.py --commit SHA   # on an H100/H200, from the repository root
    python bench/bench_gpu.py --dry                         # on CPU: tiny shapes, Triton interpreter

In order:
  1. versions and commit (--commit, else `git rev-parse`, else "unknown");
  2. pytest tests/test_kernels.py -k gpu;
  3. kernel lines: our time and torch's (ms, median of triton.testing.do_bench), TFLOP/s where the
     work is a matmul (for windowed attention only the visible query-key pairs count), and the
     speed ratio torch_ms / our_ms with the target it must reach:
       fp8_matmul >= 0.9 (torch._scaled_mm, fast accumulation, same operands);
       flash_attn_varlen forward+backward >= 1.0 against compiled flex_attention with the same
         document + causal + sliding-window mask (its block mask built once, outside the timing),
         and >= 1.0 against scaled_dot_product_attention's flash backend on equal-length causal
         documents with no window;
       softcap_cross_entropy forward+backward >= 2.0 (plain torch softcap + F.cross_entropy);
     the fp8 layers against bf16 torch, xxt against x @ x.mT, qk_norm_rope and the n-gram table's
     sparse row kernels (grouping + summing per row, the sparse Adam update) against torch ops
     are informational;
  4. training: the 1gpu preset in this process, eager, on synthetic tokens; for each stage, at its
     first step, one untimed step and the median of TIMED_STEPS timed optimizer steps (8
     micro-batches each), with the Triton kernels (without and with the forward+backward
     captured as a CUDA graph after the untimed step) and with the plain-torch references;
  5. one compiled run of train_gpt.py (CUDA graphs on, as in a real run): a single stage at the
     last stage's shape;
  6. a projection of the 8xH100 training time from 4 and 5 (see `projection`).
The section is printed, appended to bench/results.md and, when $OUT is set, written to
$OUT/results.md with the raw numbers in $OUT/bench.json (rewritten after every part, so a run
stopped from outside still leaves what it measured). Exit status 1 when the GPU tests, a
training run or a benchmark failed; a missed speed target is reported, not a failure.

The dry mode runs every part once at tiny shapes so that this script cannot rot unnoticed; its
numbers mean nothing and it writes no file.
"""
import argparse
import collections
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import pathlib
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_PATH = pathlib.Path(__file__).resolve().parent / "results.md"
sys.path.insert(0, str(REPO_ROOT))

# Per-GPU speedrun shapes and the tiny ones of the dry mode. doc_len: the equal documents of the
# SDPA comparison; doc_median / max_doc_len: the uneven documents of the flex_attention one.
# ngram_rows: one rank's share of the full n-gram table (84,602,880 rows over 8 GPUs).
GPU_SHAPES = dict(tokens=49152, width=768, hidden=2816, vocab=50304, candidates=10240, doc_len=3072,
                  doc_median=600, max_doc_len=3072, window=1664, muon=((16, 768, 768), (8, 768, 2816)),
                  ngram_rows=10_575_360)
DRY_SHAPES = dict(tokens=96, width=32, hidden=64, vocab=300, candidates=100, doc_len=48,
                  doc_median=20, max_doc_len=48, window=20, muon=((2, 32, 32), (2, 32, 64)), ngram_rows=1000)
DOC_LEN_SIGMA = 1.0       # log-normal spread of document lengths (median 600: a mean near 1,000, like FineWeb)
MIN_DOC_LEN = 16          # shortest generated document (the trainer's MIN_DOC_TOKENS)
ATTENTION_MATMULS = 7     # per visible pair and head dim: 2 forward (QK^T, PV), 5 backward (QK^T again, dV, dP, dQ, dK)

# Training: the 1gpu preset eager in this process. The dry mode shrinks the cpu preset to two
# stages of a 2-layer model with sampled softmax, no FP8 layers and Adam only, so that the interpreter
# runs only the attention and a cheap cross-entropy (the kernel part runs the others).
# Its n-gram table is one GPU's share of the speedrun's, resident: the per-GPU work of a speedrun
# step (the preset's whole table, 130 GB in host memory, does not fit the bench machine's RAM).
GPU_TRAIN_CONFIG = ["--preset", "1gpu", f"--ngram_rows={GPU_SHAPES['ngram_rows']}", "--ngram_cache_rows=0"]
DRY_TRAIN_CONFIG = [
    "--preset", "cpu", "--device=cpu", "--num_layers=2", "--model_dim=64", "--num_heads=1", "--head_dim=64",
    "--mlp_hidden=128", "--bigram_rows=1024", "--long_window_layers=[1]", "--narrow_qk_layers=[]", "--fp8_mlp=false",
    "--fp8_qkv=false", "--fp8_head=false", "--optimizer=adamw",
    "--batch_ranks=1", "--num_iterations=4", "--val_tokens=128", "--val_tokens_per_rank=128",
    '--stages=[{"end":0.5,"tokens_per_rank":16,"max_doc_len":16,"short_window":1,"long_window":1,"candidates":128},'
    '{"end":1.0,"tokens_per_rank":32,"max_doc_len":32,"short_window":1,"long_window":1,"candidates":128}]',
]
UNTIMED_STEPS = 1         # steps per stage shape before timing (Triton JIT, allocator warm-up)
TIMED_STEPS = 2           # timed steps per stage shape and kernel set; their median is reported
COMPILED_STEPS = 12       # timed steps of the compiled run
GPU_COMPILED_VAL_TOKENS = 65536  # one validation slice: the compiled run's validation is not what it measures
SYNTHETIC_DOC_LEN = 1000  # tokens between <|endoftext|> tokens in the synthetic shards
BOS = 50256               # <|endoftext|>, which starts every document
TRAIN_SHARD_TOKENS = dict(gpu=1 << 23, dry=1 << 14)  # the loader cycles through the shard
VAL_SHARD_TOKENS = 1 << 17  # more than the compiled run's validation reads

# Projection: per-GPU share of the 1-GPU step; memory-bound kernels slow down by the bandwidth ratio.
H100_BANDWIDTH_TBS = 3.35  # H100 SXM HBM3
H200_BANDWIDTH_TBS = 4.8   # H200 HBM3e

BUDGET_S = 420            # default time budget of the whole command: subprocesses get what is left of it
REPORT_RESERVE_S = 15     # kept back from the budget for the last part's report
GPU_TESTS_LIMIT_S = 180   # longest the GPU tests may take
COMPILED_RUN_LIMIT_S = 240  # longest the compiled run may take, compilation included
DRY_NOTE = ("dry: flex_attention runs uncompiled and forward-only (no CPU backward); SDPA uses its CPU "
            "backend; the compiled run is train_gpt.py with --compile=false")
PARTS = ("tests", "kernels", "training", "compiled")  # what --parts can select


class Deadline:
    """Seconds left of the command's time budget."""

    def __init__(self, budget_s):
        self.end = time.monotonic() + budget_s

    def left(self, limit_s=float("inf")):
        return max(0.0, min(limit_s, self.end - time.monotonic() - REPORT_RESERVE_S))


# -----------------------------------------------------------------------------------------------
# Kernel timings
# -----------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Line:
    """One row of the kernel table."""
    name: str
    shape: str
    ours_ms: float
    torch_ms: float
    flops: float = 0.0       # of one call, for TFLOP/s; 0 when not a matmul-bound line
    target: float = 0.0      # minimum torch_ms / ours_ms; 0 when informational

    @property
    def ratio(self):
        return self.torch_ms / self.ours_ms

    def missed(self):
        return bool(self.target) and self.ratio < self.target

    def cells(self):
        tflops = (lambda ms: f"{self.flops / ms / 1e9:.0f}") if self.flops else (lambda ms: "-")
        verdict = "-" if not self.target else ("MISSED" if self.missed() else "ok")
        return [self.name, self.shape, f"{self.ours_ms:.3f}", f"{self.torch_ms:.3f}", tflops(self.ours_ms),
                tflops(self.torch_ms), f"{self.ratio:.2f}", f">= {self.target}" if self.target else "-", verdict]


KERNEL_HEADER = ["kernel", "shape", "ours ms", "torch ms", "ours TFLOP/s", "torch TFLOP/s", "torch/ours", "target", ""]


def markdown_table(header, rows):
    rows = [header, ["---"] * len(header)] + rows
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


class Timer:
    """Median milliseconds of a callable: triton.testing.do_bench on a GPU, one wall-clock run dry."""

    def __init__(self, dry):
        self.dry = dry

    def __call__(self, fn):
        if self.dry:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100)


def _fp8(shape, device, column_major=False):
    import torch
    t = torch.randn(*shape[::-1] if column_major else shape, device=device).to(torch.float8_e4m3fn)
    return t.t() if column_major else t


def bench_fp8_matmul(shapes, device, timer, dry):
    import torch
    import kernels
    T, D, H = shapes["tokens"], shapes["width"], shapes["hidden"]
    problems = [("mlp up", T, D, H), ("mlp down", T, H, D), ("mlp down wgrad", D, T, H), ("qkv", T, D, 3 * D),
                ("lm_head", T, D, shapes["candidates"])]
    scale = torch.ones((), device=device)
    lines = []
    for name, m, k, n in problems:
        a, b = _fp8((m, k), device), _fp8((k, n), device, column_major=True)
        ours = timer(lambda: kernels.fp8_matmul(a, b, scale, scale, torch.bfloat16))
        theirs = timer(lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16,
                                                use_fast_accum=True))
        lines.append(Line(f"fp8_matmul {name}", f"{m}x{k}x{n}", ours, theirs, 2.0 * m * n * k, target=0.9))
    return lines


def _forward_backward(fn, inputs, grad_output):
    """A callable running fn(*inputs) and its backward (grads of the inputs that require them)."""
    import torch

    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_output)
    return run


def bf16_relu2_mlp(x, w_up, w_down):
    import torch
    return torch.relu(x @ w_up.t()).square() @ w_down.t()


def bench_fp8_layers(shapes, device, timer, dry):
    """The FP8 layers with the trainer's scale rules against bf16 torch: the MLP, the packed QKV
    projection and the head at the candidate width."""
    import torch
    import kernels
    T, D, H, C = shapes["tokens"], shapes["width"], shapes["hidden"], shapes["candidates"]
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    w_up = (torch.randn(H, D, device=device) * 0.02).bfloat16().requires_grad_(True)
    w_down = (torch.randn(D, H, device=device) * 0.02).bfloat16().requires_grad_(True)
    state = kernels.new_fp8_mlp_state(device)
    mlp_fp8 = lambda x, u, d: kernels.fp8_relu2_mlp(x, u, d, state, scales=kernels.MLP_SCALES_RECORD92)  # noqa: E731
    ours = timer(_forward_backward(mlp_fp8, [x, w_up, w_down], grad_y))
    theirs = timer(_forward_backward(bf16_relu2_mlp, [x, w_up, w_down], grad_y))
    lines = [Line("fp8_relu2_mlp fwd+bwd vs bf16", f"{T}x{D}x{H}", ours, theirs, 6 * 2.0 * T * D * H)]
    for name, rows, scales in (("qkv", 3 * D, kernels.QKV_SCALES), ("head", C, kernels.HEAD_SCALES)):
        linear_state = kernels.new_fp8_linear_state(device)
        w = (torch.randn(rows, D, device=device) * 0.02).bfloat16().requires_grad_(True)
        grad = torch.randn(T, rows, device=device, dtype=torch.bfloat16) / T
        kernels.set_fp8_loss_unit(linear_state, 1.0 / T)
        fp8 = lambda x, w: kernels.fp8_linear(x, w, linear_state, scales=scales)  # noqa: E731
        ours = timer(_forward_backward(fp8, [x, w], grad))
        theirs = timer(_forward_backward(lambda x, w: x @ w.t(), [x, w], grad))
        lines.append(Line(f"fp8_linear {name} fwd+bwd vs bf16", f"{T}x{D}x{rows}", ours, theirs,
                          3 * 2.0 * T * D * rows))
    return lines


def uneven_document_lengths(num_tokens, median, max_len, generator):
    """Log-normal document lengths (cut to [MIN_DOC_LEN, max_len]) that fill num_tokens exactly."""
    lengths = []
    while sum(lengths) < num_tokens:
        length = generator.lognormal(np.log(median), DOC_LEN_SIGMA)
        lengths.append(int(np.clip(length, MIN_DOC_LEN, max_len)))
    lengths[-1] -= sum(lengths) - num_tokens
    return lengths


def visible_pairs(lengths, window):
    """Query-key pairs that causal attention within each document and a sliding window sees."""
    total = 0
    for length in lengths:
        w = min(length, window) if window > 0 else length
        total += w * (w + 1) // 2 + (length - w) * w
    return total


def flex_attention_fn(lengths, window, scale, device, dry):
    """flex_attention (compiled on the GPU) with the document + causal + sliding-window mask of
    flash_attn_varlen, on (T, H, D) tensors like ours; its block mask is built here, once."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    T = len(doc)

    def document_window_mask(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    block_mask = create_block_mask(document_window_mask, None, None, T, T, device=device)
    attend = flex_attention if dry else torch.compile(flex_attention, dynamic=False)

    def attention(q, k, v):
        out = attend(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=scale)
        return out.transpose(1, 2).squeeze(0)
    return attention


def sdpa_equal_documents_fn(num_docs, doc_len, scale, dry):
    """scaled_dot_product_attention (flash backend on the GPU) over equal-length causal documents."""
    import torch
    import torch.nn.functional as F

    def attention(q, k, v):
        batch = [as_documents(t, num_docs, doc_len) for t in (q, k, v)]
        if dry:
            return F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale)
    return attention


def as_documents(t, num_docs, doc_len):
    """(T, H, D) packed tokens as a (num_docs, H, doc_len, D) view."""
    return t.view(num_docs, doc_len, *t.shape[1:]).transpose(1, 2)


def bench_attention(shapes, device, timer, dry):
    import torch
    import kernels
    T, L, window = shapes["tokens"], shapes["doc_len"], shapes["window"]
    lengths = uneven_document_lengths(T, shapes["doc_median"], shapes["max_doc_len"], np.random.default_rng(0))
    uneven_cu_seqlens = torch.tensor(np.cumsum([0] + lengths), device=device, dtype=torch.int32)
    equal_cu_seqlens = torch.arange(0, T + 1, L, device=device, dtype=torch.int32)
    lines = []
    for d, heads in ((128, 6), (64, 12)):
        q, k, v = (torch.randn(T, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad_o = torch.randn(T, heads, d, device=device, dtype=torch.bfloat16)
        scale = d ** -0.5
        flops_per_pair = ATTENTION_MATMULS * 2.0 * d * heads

        flex = flex_attention_fn(lengths, window, scale, device, dry)
        ours = timer(_forward_backward(
            lambda q, k, v: kernels.flash_attn_varlen(q, k, v, uneven_cu_seqlens, window, scale), [q, k, v], grad_o))
        theirs = timer(lambda: flex(q.detach(), k.detach(), v.detach())) if dry else \
            timer(_forward_backward(flex, [q, k, v], grad_o))
        lines.append(Line(f"flash_attn_varlen fwd+bwd d={d} vs flex_attention",
                          f"{T} tok in {len(lengths)} docs, window {window}, {heads} heads", ours, theirs,
                          flops_per_pair * visible_pairs(lengths, window), target=1.0))

        ours = timer(_forward_backward(
            lambda q, k, v: kernels.flash_attn_varlen(q, k, v, equal_cu_seqlens, 0, scale), [q, k, v], grad_o))
        theirs = timer(_forward_backward(sdpa_equal_documents_fn(T // L, L, scale, dry), [q, k, v],
                                         as_documents(grad_o, T // L, L)))
        lines.append(Line(f"flash_attn_varlen fwd+bwd d={d} vs SDPA flash",
                          f"{T // L}x{L} tok causal, {heads} heads", ours, theirs,
                          flops_per_pair * visible_pairs([L] * (T // L), 0), target=1.0))
    return lines


def bench_cross_entropy(shapes, device, timer, dry):
    import torch
    import torch.nn.functional as F
    import kernels
    T = shapes["tokens"]
    lines = []
    for columns in (shapes["vocab"], shapes["candidates"]):
        logits = torch.randn(T, columns, device=device, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, columns, (T, 1), device=device)
        weights = torch.ones(1, device=device)
        one = torch.ones((), device=device)
        ours = timer(_forward_backward(lambda x: kernels.softcap_cross_entropy(x, targets, weights)[0].sum(), [logits],
                                       one))
        theirs = timer(_forward_backward(
            lambda x: F.cross_entropy(kernels.softcap(x), targets[:, 0], reduction="sum"), [logits], one))
        lines.append(Line("softcap_cross_entropy fwd+bwd", f"{T}x{columns}", ours, theirs, target=2.0))
    return lines


def bench_xxt(shapes, device, timer, dry):
    import torch
    import kernels
    lines = []
    for shape in shapes["muon"]:
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        ours = timer(lambda: kernels.xxt(x))
        theirs = timer(lambda: x @ x.mT)
        batch, m, n = shape
        lines.append(Line("xxt", "x".join(map(str, shape)), ours, theirs, 2.0 * batch * m * m * n))
    return lines


def bench_qk_norm_rope(shapes, device, timer, dry):
    """The QK norm + RoPE kernel (with the key offset) against the same math in torch ops, both
    forward and backward on q, k views of a packed projection (informational: memory bound)."""
    import torch
    import kernels
    T, D = shapes["tokens"], shapes["width"]
    head_dim = 16 if dry else 128
    heads = D // head_dim
    qkv = torch.randn(T, 3 * D, device=device, dtype=torch.bfloat16, requires_grad=True)
    q, k = qkv[:, :D].view(T, heads, head_dim), qkv[:, D:2 * D].view(T, heads, head_dim)
    angles = torch.rand(T, head_dim // 2, device=device)
    stationary = torch.arange(head_dim, device=device) % (head_dim // 2) >= head_dim // 4
    doc_start = torch.arange(T, device=device) % SYNTHETIC_DOC_LEN == 0
    grads = [torch.randn(T, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2)]

    def run(fn):
        def step():
            outs = fn(q, k, angles.cos(), angles.sin(), stationary, doc_start)
            torch.autograd.grad(outs, [qkv], grads)
        return step
    ours, theirs = timer(run(kernels.qk_norm_rope)), timer(run(kernels.qk_norm_rope_reference))
    return [Line("qk_norm_rope fwd+bwd vs torch ops (eager)", f"{T}x{heads}x{head_dim}", ours, theirs)]


def bench_sparse_rows(shapes, device, timer, dry):
    """The n-gram table's sparse path at one rank's share of the full table (zero rows, as the
    table starts): a bigram and a trigram row per token, skewed towards low rows so that rows
    repeat as frequent n-grams do. Grouping and summing the gradient entries per distinct row
    against torch.unique + index_add_, and the sparse Adam row update against its torch
    reference (informational: memory bound)."""
    import torch
    import kernels
    T, D, rows = shapes["tokens"], shapes["width"], shapes["ngram_rows"]
    generator = torch.Generator(device=device).manual_seed(0)
    entries = (torch.rand(2 * T, device=device, generator=generator) ** 3 * rows).long()
    values = torch.randn(2 * T, D, device=device, dtype=torch.bfloat16)

    def ours_sum():
        return kernels.sum_rows(values, kernels.distinct_rows(entries))

    def torch_sum():
        unique, inverse = torch.unique(entries, return_inverse=True)
        return torch.zeros(unique.numel(), D, device=device).index_add_(0, inverse, values.float())
    lines = [Line("distinct_rows + sum_rows vs unique + index_add_", f"{2 * T}x{D}", timer(ours_sum),
                  timer(torch_sum))]
    table = torch.zeros(rows, D, device=device, dtype=torch.bfloat16)
    moment = torch.zeros(rows, device=device)
    last = torch.zeros(rows, device=device, dtype=torch.int32)
    log_decay_at = torch.zeros(8, device=device, dtype=torch.float64)
    groups, grads = kernels.distinct_rows(entries), ours_sum()
    step = kernels.RowAdamStep(event=1, log_decay=0.0, one_minus_beta2=0.05, bias=0.05, lr=0.01, decay=0.0, eps=1e-10)
    ours = timer(lambda: kernels.sparse_adam_rows_(table, grads, groups, moment, last, log_decay_at, step))
    theirs = timer(lambda: kernels.sparse_adam_rows_reference_(table, grads, groups, moment, last, log_decay_at, step))
    lines.append(Line("sparse_adam_rows_ vs torch reference", f"{rows}x{D} bf16, {2 * T} entries", ours, theirs))
    return lines


COMPOSED_WINDOW = 112     # the speedrun preset's composed-attention window (dc_window)


def bench_composed_attention(shapes, device, timer, dry):
    """Composed local attention (the last layer's: the heads' maps over the last COMPOSED_WINDOW
    tokens, mixed per token) against its blocked torch reference, forward and backward on bf16
    inputs with documents of SYNTHETIC_DOC_LEN tokens (informational)."""
    import torch
    import kernels
    T, D = shapes["tokens"], shapes["width"]
    head_dim = 16 if dry else 128
    heads = D // head_dim
    q, k, v = (torch.randn(T, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mix_in = torch.randn(T, heads, device=device, requires_grad=True)
    mix_out = torch.randn(T, heads, device=device, dtype=torch.bfloat16, requires_grad=True)
    doc_start = (torch.arange(T, device=device) // SYNTHETIC_DOC_LEN * SYNTHETIC_DOC_LEN).int()
    grad = torch.randn(T, heads, head_dim, device=device, dtype=torch.bfloat16)

    def run(fn):
        def step():
            out = fn(q, k, v, doc_start, COMPOSED_WINDOW, head_dim ** -0.5, mix_in, mix_out)
            torch.autograd.grad(out, [q, k, v, mix_in, mix_out], grad)
        return step
    ours, theirs = timer(run(kernels.composed_attention)), timer(run(kernels.composed_attention_reference))
    return [Line("composed attention fwd+bwd vs torch reference (eager)",
                 f"{T}x{heads}x{head_dim}, window {COMPOSED_WINDOW}", ours, theirs)]


# Each takes (shapes, device, timer, dry) and returns its Lines.
KERNEL_BENCHES = (bench_fp8_matmul, bench_fp8_layers, bench_attention, bench_cross_entropy, bench_xxt,
                  bench_qk_norm_rope, bench_sparse_rows, bench_composed_attention)


# -----------------------------------------------------------------------------------------------
# Training timings
# -----------------------------------------------------------------------------------------------

def write_synthetic_shard(path, num_tokens, generator):
    """A .bin shard of random tokens with a document start every SYNTHETIC_DOC_LEN."""
    from data.shards import write_shard
    tokens = generator.integers(0, BOS, size=num_tokens, dtype=np.uint16)
    tokens[::SYNTHETIC_DOC_LEN] = BOS
    write_shard(path, tokens)


def write_synthetic_data(data_dir, dry):
    """(train files, val files) of synthetic shards in data_dir."""
    generator = np.random.default_rng(0)
    train, val = os.path.join(data_dir, "train_000000.bin"), os.path.join(data_dir, "val_000000.bin")
    write_synthetic_shard(train, TRAIN_SHARD_TOKENS["dry" if dry else "gpu"], generator)
    write_synthetic_shard(val, VAL_SHARD_TOKENS, generator)
    return [train], [val]


def training_config(dry, kernel_set):
    import train_gpt as tg
    return tg.parse_config((DRY_TRAIN_CONFIG if dry else GPU_TRAIN_CONFIG)
                           + [f"--kernels={kernel_set}", "--compile=false"])


def stage_first_steps(h):
    """The first step of each stage, in stage order."""
    import train_gpt as tg
    return [next(s for s in range(h.num_iterations) if tg.stage_index(h, s) == i) for i in range(len(h.stages))]


def wall_ms(fn, device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3


def time_stage_steps(h, train_files, device, deadline, graphs=False):
    """Median ms of an optimizer step at the first step of each stage, eager, in this process
    (None for stages left untimed when the time budget ran out). With `graphs`, as the
    trainer's warm-up does: the untimed steps capture the optimizers' updates, then the stage's
    forward+backward is captured, and the timed steps replay both (on a CPU: the same path with
    eager bodies)."""
    import train_gpt as tg
    trainer = tg.Trainer(dataclasses.replace(h, cuda_graphs=graphs), tg.Dist(0, 1, 0, device),
                         tg.RunLog("unused", active=False))
    loader = tg.TrainLoader(train_files, tg.batch_tokens(h))
    medians = []
    for index, step in enumerate(stage_first_steps(h)):
        if not deadline.left():
            medians.append(None)
            continue
        stage = h.stages[index]
        trainer.advance_to(step)
        untimed = UNTIMED_STEPS
        batches = [loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
                   for _ in range(untimed + TIMED_STEPS)]
        if device.type == "cuda":
            batches = [[s.pinned() for s in slices] for slices in batches]
        trainer.graphs.in_warm_up = graphs
        for slices in batches[:untimed]:
            trainer.train_step(step, slices)
        if graphs:
            trainer.capture_graph(step)
        trainer.graphs.in_warm_up = False
        times = [wall_ms(lambda: trainer.train_step(step, slices), device) for slices in batches[untimed:]]
        medians.append(statistics.median(times))
    return medians


def free_device_memory(device):
    """Hand the cached blocks of what is no longer referenced back to the device."""
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


TRAINING_HEADER = ["stage", "first step", "tokens/step", "triton ms/step", "with CUDA graphs", "graphs speed-up",
                   "reference ms/step", "triton tokens/s", "reference tokens/s", "reference/triton", "target", ""]


def training_table(h, triton_ms, graphs_ms, reference_ms):
    def cell(value, fmt):
        return format(value, fmt) if value is not None else "-"

    def tokens_per_s(tokens, ms):
        return tokens / ms * 1e3 if ms else None
    rows = []
    for index, step in enumerate(stage_first_steps(h)):
        tokens = h.stages[index].tokens_per_rank * h.batch_ranks
        ours, graphed, theirs = triton_ms[index], graphs_ms[index], reference_ms[index]
        ratio = theirs / ours if ours and theirs else None
        verdict = "-" if ratio is None else ("ok" if ratio > 1 else "MISSED")
        rows.append([str(index), str(step), str(tokens), cell(ours, ".1f"), cell(graphed, ".1f"),
                     cell(ours / graphed if ours and graphed else None, ".2f"), cell(theirs, ".1f"),
                     cell(tokens_per_s(tokens, ours), ",.0f"), cell(tokens_per_s(tokens, theirs), ",.0f"),
                     cell(ratio, ".2f"), "> 1", verdict])
    return markdown_table(TRAINING_HEADER, rows)


# -----------------------------------------------------------------------------------------------
# The compiled run and the projection
# -----------------------------------------------------------------------------------------------

def run_command(command, timeout_s):
    """(exit status, stdout, stderr) of a child process group; status None when it was killed,
    whole group, at the timeout."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            return None, stdout, stderr
    return process.returncode, stdout, stderr


def compiled_run_command(h, dry, train_files, val_files, log_dir):
    """train_gpt.py on one stage at the last stage's shape, the head untied from step 0 (as at the
    last stage of a real run, and with no second graph for the untie)."""
    last_stage = dataclasses.asdict(h.stages[-1]) | {"end": 1.0}
    settings = (DRY_TRAIN_CONFIG + ["--compile=false"] if dry else
                GPU_TRAIN_CONFIG + [f"--num_iterations={COMPILED_STEPS}", f"--val_tokens={GPU_COMPILED_VAL_TOKENS}"])
    return [sys.executable, "train_gpt.py", *settings, f"--stages={json.dumps([last_stage])}",
            "--untie_frac=0.0", "--sync_check=true", f"--train_files={train_files[0]}",
            f"--val_files={val_files[0]}", f"--log_dir={log_dir}"]


# Lines of train_gpt.py's output: the graph counts and the final summary.
COMPILE_LINE = re.compile(r"compile: (\d+) graphs in the warm-up, (\d+) in the timed run")
CUDA_GRAPHS_LINE = re.compile(r"cuda graphs: (\d+) training steps and (\d+) optimizer updates captured in the "
                              r"warm-up, (\d+) ran eagerly in the timed run")
FINAL_LINE = re.compile(r"final val_loss:\S+ train_time:(\d+)ms steps:(\d+)")


def compiled_run(h, dry, train_files, val_files, timeout_s):
    """Run train_gpt.py compiled; returns a dict of what it reported (ok False on any failure)."""
    with tempfile.TemporaryDirectory() as log_dir:
        command = compiled_run_command(h, dry, train_files, val_files, log_dir)
        start = time.perf_counter()
        status, stdout, stderr = run_command(command, timeout_s)
        seconds = time.perf_counter() - start
    compile_match, final_match = COMPILE_LINE.search(stdout), FINAL_LINE.search(stdout)
    result = dict(command=" ".join(command[1:]), exit_status=status, wall_s=seconds, output=stdout + stderr)
    if compile_match:
        result.update(warm_up_graphs=int(compile_match[1]), timed_graphs=int(compile_match[2]))
    cuda_graphs_match = CUDA_GRAPHS_LINE.search(stdout)   # on CUDA only
    if cuda_graphs_match:
        result.update(captured_steps=int(cuda_graphs_match[1]), captured_updates=int(cuda_graphs_match[2]),
                      eager_runs=int(cuda_graphs_match[3]))
    if final_match:
        result["step_ms"] = int(final_match[1]) / int(final_match[2])
    if status is None:
        result["error"] = f"stopped at the time limit after {seconds:.0f} s"
    elif status != 0 or not (final_match and compile_match):
        last = (stderr.strip() or stdout.strip() or "no output").splitlines()[-1]
        result["error"] = f"exit status {status}: {last}"
    result["ok"] = "error" not in result and result.get("timed_graphs") == 0 and not result.get("eager_runs")
    return result


def compiled_run_line(run, eager_last_ms, dry):
    what = ("train_gpt.py --compile=false (dry), tiny config" if dry else
            f"train_gpt.py 1gpu preset compiled, one stage at the last stage's shape, {COMPILED_STEPS} steps")
    if "error" in run:
        return f"compiled run: FAILED ({run['error']}); {what}"
    eager = (f" (eager Triton {eager_last_ms:.1f} ms: compiled/eager {run['step_ms'] / eager_last_ms:.2f})"
             if eager_last_ms else "")
    graphs = f"compile: {run['warm_up_graphs']} graphs in the warm-up, {run['timed_graphs']} in the timed run"
    if "captured_steps" in run:
        graphs += (f"; CUDA graphs: {run['captured_steps']} training steps and {run['captured_updates']} optimizer "
                   f"updates captured, {run['eager_runs']} eager runs in the timed run")
    verdict = "" if run["ok"] else " (FAILED: graphs built, or steps run without their CUDA graph, in the timed run)"
    return (f"compiled run: step_avg {run['step_ms']:.1f} ms{eager}; {graphs}{verdict}; "
            f"{run['wall_s']:.0f} s wall with compilation; {what}")


def projection(h, triton_ms, compiled_ratio):
    """Projected training time (s) of the whole schedule on h.batch_ranks GPUs: per stage, its
    steps x its 1-GPU eager Triton step time, x the compiled/eager ratio, / h.batch_ranks."""
    import train_gpt as tg
    steps = collections.Counter(tg.stage_index(h, s) for s in range(h.num_iterations))
    eager_ms = sum(count * triton_ms[index] for index, count in steps.items())
    return eager_ms * compiled_ratio / h.batch_ranks / 1e3


def projection_line(h, seconds, compiled_ratio):
    slowdown = H200_BANDWIDTH_TBS / H100_BANDWIDTH_TBS
    gpus = h.batch_ranks
    return (f"projection (an estimate, not a measurement): {gpus}xH100 training time {seconds:.0f} s "
            f"({seconds / 60:.2f} min) for {h.num_iterations} steps, up to {seconds * slowdown:.0f} s if every "
            f"kernel were memory-bound. Method: the sum over stages of (its steps in the schedule) x (its 1-GPU "
            f"eager Triton step time) x (compiled/eager ratio {compiled_ratio:.2f}, measured at the last stage's "
            f"shape) / {gpus}. Assumes perfect {gpus}-way scaling with no communication time, H100 compute "
            f"equal to this GPU's, and memory-bound kernels up to {slowdown:.2f}x slower on an H100 "
            f"({H100_BANDWIDTH_TBS} vs {H200_BANDWIDTH_TBS} TB/s).")


# -----------------------------------------------------------------------------------------------
# Environment, GPU tests, report
# -----------------------------------------------------------------------------------------------

def git_commit():
    """HEAD's short hash (+ a note when the tree has changes), or "unknown" without git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=REPO_ROOT, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=REPO_ROOT, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" (with uncommitted changes)" if dirty else "")


def environment(device, commit):
    import torch
    import triton
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)",
                python=platform.python_version(), torch=torch.__version__, triton=triton.__version__,
                cuda=torch.version.cuda or "none", commit=commit or git_commit())


def run_gpu_tests(dry, timeout_s):
    """The GPU tests of tests/test_kernels.py (collected only in the dry mode)."""
    command = [sys.executable, "-m", "pytest", "-q", "tests/test_kernels.py", "-k", "gpu"]
    if dry:
        command.append("--collect-only")
    status, stdout, stderr = run_command(command, timeout_s)
    summary = (stdout.strip().splitlines() or ["(no output)"])[-1]
    if status is None:
        summary = f"stopped at the time limit ({timeout_s:.0f} s); last line: {summary}"
    return dict(ok=status == 0, summary=summary, output=stdout + stderr)


class Report:
    """The markdown section and the raw numbers, built part by part; saved to $OUT after each."""

    def __init__(self, env, out_dir):
        self.blocks = [f"## {env['date']}, {env['gpu']}",
                       f"python {env['python']}, torch {env['torch']}, triton {env['triton']}, "
                       f"CUDA {env['cuda']}, commit {env['commit']}"]
        self.raw = dict(environment=env, part_seconds={}, errors={})
        self.out_dir = out_dir
        self.failed = False

    @contextlib.contextmanager
    def timing(self, part):
        """Record the seconds the body takes as part_seconds[part]."""
        start = time.perf_counter()
        yield
        self.raw["part_seconds"][part] = round(time.perf_counter() - start, 1)

    def add(self, block, **raw):
        print(f"\n{block}", flush=True)
        self.blocks.append(block)
        self.raw.update(raw)
        self.save()

    def error(self, part, text):
        self.failed = True
        self.raw["errors"][part] = text

    def markdown(self):
        return "\n" + "\n\n".join(self.blocks) + "\n"

    def save(self, *logs):
        """results.md and bench.json under $OUT, plus (name, text) logs."""
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "results.md").write_text(self.markdown())
        (self.out_dir / "bench.json").write_text(json.dumps(self.raw, indent=1, default=str))
        for name, text in logs:
            (self.out_dir / name).write_text(text)


def guarded(report, part, fn, *args):
    """fn(*args), or None when it raised: the error is printed and recorded, the other parts go on."""
    try:
        return fn(*args)
    except Exception:
        text = traceback.format_exc()
        print(f"{part}: FAILED\n{text}", file=sys.stderr, flush=True)
        report.error(part, text)
        return None


# -----------------------------------------------------------------------------------------------
# main
# -----------------------------------------------------------------------------------------------

def run_kernel_benches(report, shapes, device, dry):
    timer = Timer(dry)
    lines, failed = [], []
    for bench in KERNEL_BENCHES:
        result = guarded(report, bench.__name__, bench, shapes, device, timer, dry)
        lines += result or []
        if result is None:
            failed.append(bench.__name__)
    notes = ([DRY_NOTE] if dry else []) + ([f"FAILED: {', '.join(failed)} (bench.json has the errors)"]
                                            if failed else [])
    missed = [line.name for line in lines if line.missed()]
    if missed and not dry:
        notes.append("targets missed: " + ", ".join(missed))
    report.add("\n\n".join([markdown_table(KERNEL_HEADER, [line.cells() for line in lines])] + notes),
               kernels=[dataclasses.asdict(line) | {"ratio": line.ratio} for line in lines])


def measure_training(report, parts, dry, device, deadline):
    """(config, Triton ms per stage, the same with CUDA graphs, reference ms per stage, compiled
    run or None). Runs the eager Triton timings without and with graphs, the compiled run, then
    the eager reference timings: those are the slowest and the projection does not need them, so
    the time budget cuts them first."""
    h = training_config(dry, "triton")
    triton_ms = graphs_ms = reference_ms = [None] * len(h.stages)
    run = None
    with tempfile.TemporaryDirectory() as data_dir:
        train_files, val_files = write_synthetic_data(data_dir, dry)
        if "training" in parts:
            with report.timing("training triton"):
                triton_ms = guarded(report, "training triton", time_stage_steps, h, train_files, device,
                                    deadline) or triton_ms
            free_device_memory(device)
            with report.timing("training triton graphs"):
                graphs_ms = guarded(report, "training triton graphs", time_stage_steps, h, train_files, device,
                                    deadline, True) or graphs_ms
            free_device_memory(device)
        if "compiled" in parts:
            with report.timing("compiled run"):
                run = compiled_run(h, dry, train_files, val_files, deadline.left(COMPILED_RUN_LIMIT_S))
            if not run["ok"]:
                report.error("compiled run", run["output"][-4000:])
        if "training" in parts:
            with report.timing("training reference"):
                reference_ms = guarded(report, "training reference", time_stage_steps,
                                       training_config(dry, "reference"), train_files, device, deadline) \
                    or reference_ms
            free_device_memory(device)
    return h, triton_ms, graphs_ms, reference_ms, run


def report_training(report, h, triton_ms, graphs_ms, reference_ms):
    untimed = [i for i, times in enumerate(zip(triton_ms, graphs_ms, reference_ms)) if None in times]
    note = f"\n\nnot timed (failed or out of time budget): stages {untimed}" if untimed else ""
    report.add(f"training, eager (not compiled), micro-batches per step: {h.batch_ranks}, synthetic tokens (median "
               f"of {TIMED_STEPS} steps after {UNTIMED_STEPS} untimed; with CUDA graphs, the forward+backward "
               f"captured after the untimed steps and replayed):\n\n"
               + training_table(h, triton_ms, graphs_ms, reference_ms) + note,
               training=dict(steps=stage_first_steps(h), triton_ms=triton_ms, graphs_ms=graphs_ms,
                             reference_ms=reference_ms))


def report_compiled_run(report, run, eager_last_ms, dry):
    """Report the compiled run; returns its compiled/eager step-time ratio (None if unknown)."""
    report.add(compiled_run_line(run, eager_last_ms, dry),
               compiled_run={k: v for k, v in run.items() if k != "output"})
    report.save(("compiled_run.txt", f"$ {run['command']}\n{run['output']}"))
    return run["step_ms"] / eager_last_ms if run["ok"] and eager_last_ms else None


def report_projection(report, h, triton_ms, compiled_ratio):
    if None in triton_ms or compiled_ratio is None:
        report.add("projection: not available (it needs every stage's Triton step time and the compiled run)")
        return
    seconds = projection(h, triton_ms, compiled_ratio)
    report.add(projection_line(h, seconds, compiled_ratio),
               projection=dict(seconds=seconds, compiled_ratio=compiled_ratio))


def parse_flags():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton interpreter; writes nothing")
    parser.add_argument("--commit", default=None, help="commit of the tree (a copy without .git cannot tell)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds the whole command may take")
    flags = parser.parse_args()
    flags.parts = set(flags.parts.split(","))
    if not flags.parts <= set(PARTS):
        parser.error(f"--parts takes a comma-separated subset of {','.join(PARTS)}, got {','.join(flags.parts)}")
    return flags


def main():
    start = time.perf_counter()
    flags = parse_flags()
    deadline = Deadline(flags.budget)
    if flags.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from interpreter_shim import install_shim
        install_shim()
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    import torch
    if not flags.dry and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU; run it with --dry to check it on CPU", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cpu") if flags.dry else torch.device("cuda", 0)
    out = os.environ.get("OUT")
    report = Report(environment(device, flags.commit), pathlib.Path(out) if out and not flags.dry else None)
    print("\n\n".join(report.blocks), flush=True)
    torch.manual_seed(0)

    if "tests" in flags.parts:
        with report.timing("tests"):
            tests = run_gpu_tests(flags.dry, deadline.left(GPU_TESTS_LIMIT_S))
        if not tests["ok"]:
            report.error("gpu tests", tests["output"][-4000:])
        verdict = "collected only" if flags.dry else ("ok" if tests["ok"] else "FAILED")
        report.add(f"GPU tests ({verdict}): {tests['summary']}",
                   gpu_tests=dict(ok=tests["ok"], summary=tests["summary"]))
        report.save(("gpu_tests.txt", tests["output"]))
    if "kernels" in flags.parts:
        with report.timing("kernels"):
            run_kernel_benches(report, DRY_SHAPES if flags.dry else GPU_SHAPES, device, flags.dry)
        free_device_memory(device)
    if flags.parts & {"training", "compiled"}:
        h, triton_ms, graphs_ms, reference_ms, run = measure_training(report, flags.parts, flags.dry, device,
                                                                      deadline)
        if "training" in flags.parts:
            report_training(report, h, triton_ms, graphs_ms, reference_ms)
        ratio = report_compiled_run(report, run, triton_ms[-1], flags.dry) if run else None
        report_projection(report, h, triton_ms, ratio)
    report.add("bench time: " + ", ".join(f"{part} {s:.0f} s" for part, s in report.raw["part_seconds"].items())
               + f"; total {time.perf_counter() - start:.0f} s")
    if not flags.dry:
        with open(RESULTS_PATH, "a") as f:
            f.write(report.markdown())
        print(f"appended to {RESULTS_PATH}" + (f"; written to {out}/results.md" if out else ""))
    if report.failed:
        print("FAILED: " + ", ".join(report.raw["errors"]), file=sys.stderr)
    sys.exit(1 if report.failed else 0)


if __name__ == "__main__":
    main()
