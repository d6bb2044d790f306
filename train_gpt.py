"""Train a GPT-2-small-class language model on FineWeb as fast as possible.

Read top-down: the config and its presets; the model; the data loader; the schedules; the log;
the training loop and its memory budget; checkpoints, evaluation and sampling; main(). Kernels
live in kernels.py, optimizers in optim.py.

    ./run.sh                                              # picks the preset for this machine
    python train_gpt.py --plan                            # what run.sh starts here, and why (launch_plan)
    python train_gpt.py --preset cpu                      # CPU track, tiny offline corpus
    python -m torch.distributed.run --standalone --nproc_per_node=8 train_gpt.py --preset speedrun
    python train_gpt.py --preset cpu --num_iterations=50 --seed=1   # any config key: --key=value

Presets: `speedrun` (8 GPUs), `1gpu` (the same global batch on fewer GPUs by gradient
accumulation: on one, the n-gram table in host memory; with --ngram_cache_rows=0, split across
2 or 4), `cpu` (the CPU track). Every run writes logs/<run id>.txt: the verbatim source of every project
file it imported, the environment, the data fingerprints, the resolved config, then step lines.
"""
import argparse
import codecs
import contextlib
import copy
import dataclasses
import datetime
import errno
import functools
import gc
import hashlib
import json
import math
import os
import platform
import re
import select
import signal
import socket
import struct
import subprocess
import stat
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
import optim
from cpu_runtime import bf16_gemm_path, bf16_gemms, cpu_has_native_bf16, keep_freed_memory_for_reuse
from data.shards import ShardError, find_shards, fingerprint, read_shard
from data.tokenizer import BOS_ID, TokenizerError, gpt2_encoding, noncanonical_pairs, prefix_token_table
from records.logfile import (ERROR_PREFIX, INTERRUPTED_PREFIX, SEAL_HEX_DIGITS, LogWriteError, LogWriter, cpu_model,
                             new_run_id, write_failure)

REPO_DIR = os.path.dirname(os.path.abspath(__file__))
FINEWEB_HINT = "python data/cached_fineweb10B.py N"
TINY_HINT = "python data/tiny_corpus.py"

# -----------------------------------------------------------------------------------------------
# Config
# -----------------------------------------------------------------------------------------------

VOCAB_SIZE = 50257                 # GPT-2 tokens
PADDED_VOCAB_SIZE = 50304          # vocab rounded up to a multiple of 128 for the matmuls
WINDOW_BLOCK = 128                 # sliding windows are counted in blocks of this many tokens


@dataclass
class Stage:
    """A stretch of training with one batch shape, one attention window and one loss mix."""
    end: float                     # fraction of num_iterations at which this stage ends
    tokens_per_rank: int           # tokens in one rank's slice of the global batch
    max_doc_len: int               # documents are cut to this many tokens
    short_window: int              # window of the short-window layers, in WINDOW_BLOCKs
    long_window: int               # window of the long-window layers, in WINDOW_BLOCKs
    mtp_weights: tuple = (1.0,)    # loss weights of the targets t+1, t+2, ...
    prefix_weight: float = 0.0     # weight of the byte-prefix auxiliary target
    candidates: int = 0            # sampled-softmax candidate columns; 0 = full vocabulary
    lr_mult: float = 1.0           # learning-rate multiplier for this stage
    mtp_weights_end: tuple = ()    # if given: mtp_weights move linearly to these across the stage
    prefix_weight_end: float = None  # if given: prefix_weight moves linearly to this across the stage


@dataclass
class Average:
    """One end-of-training weight average: an EMA of some parameters over the last steps,
    blended into them after the last step, before the final validation (and on the clock)."""
    params: str                    # which parameters: one of AVERAGED_PARAMS
    window: int                    # sampled over the last this-many steps
    every: int = 1                 # one sample every this-many steps, counted back from the last step
    rate: float = 0.1              # EMA weight of each sample after the first (which seeds the average)
    blend: float = 1.0             # at the end p <- lerp(p, average, blend); 1 replaces p
    renormalize: bool = False      # then rescale each matrix to its Frobenius norm before any average


# Parameter families an Average can take: the token embedding and the head; the value-embedding
# tables; the query and key rows of each QKV weight; its value rows with the attention output
# and both MLP matrices.
AVERAGED_PARAMS = ("embed_head", "value_embeds", "qk", "vo_mlp")
NORM_FLOOR = 1e-12                 # an all-zero matrix keeps its zeros when renormalized


@dataclass
class ModelConfig:
    """The model's shape and features: everything GPT reads, and nothing else."""
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 3072
    long_window_layers: tuple = (3, 10)  # layers that use the long window; others the short one
    attention_free_layers: tuple = (6,)  # layers with no attention sublayer
    num_value_embeds: int = 3      # value-embedding tables, each shared by one of the first and one of the last layers
    value_embed_layers: tuple = () # or: these layers, each with a table of its own (then num_value_embeds = 0)
    value_embed_gate_dim: int = 12 # inputs of the per-head value-embedding gates
    value_embed_gate_reads_value: bool = False  # gates read half their inputs from the value embedding
    value_embed_sparse: bool = False  # value embeddings trained like the n-gram table: sparse Adam, its cadence
    bigram_rows: int = 251_520     # rows of the bigram hash embedding
    ngram_rows: int = 0            # rows of the hashed bigram+trigram table trained sparsely (0: the bigram embedding)
    ngram_dtype: str = "float32"   # the table's storage: float32 | bfloat16 (half the bytes; updates rounded to nearest)
    embed_init_std: float = 0.0    # std of the (tied) embedding's normal init; 0: model_dim^-0.5
    rope_base: float = 1024.0      # RoPE base period
    attn_scale: float = 0.1        # softmax scale of QK-normed attention before any YaRN growth
    yarn_scale_growth: float = 0.1 # YaRN: the attention scale grows by this times ln(window growth)
    canonical_mask: bool = False   # validation: no probability for token pairs GPT-2's encoder never emits
    smear_gate: bool = False       # each token's embedding gets a gated share of its predecessor's
    key_offset: bool = False       # long-window layers: a key's stationary dims come from the previous token
    xsa_layers: tuple = ()         # layers whose heads remove a learned share of their output along their own value
    paired_head_layers: tuple = () # layers where adjacent heads' queries also attend to each other's keys
    narrow_qk_layers: tuple = ()   # layers whose queries and keys are narrow_qk_dim wide per head, rotated in full
    narrow_qk_dim: int = 64
    narrow_qk_attn_scale: float = 0.13  # their softmax scale before any YaRN growth (attn_scale: the others')
    narrow_vo_layers: tuple = ()   # layers whose values (and head outputs) are narrow_vo_dim wide per head
    narrow_vo_dim: int = 64
    parallel_mlp_layers: tuple = ()  # layers with a second MLP beside the first, on the same input
    token_gates: bool = False      # per-token gates from two small MLPs (TokenGates): XSA, output, injections
    token_gates_split: int = 4     # layers before this take gates made from x0, later ones from the residual there
    attn_gate_layers: tuple = ()   # layers whose heads' outputs are scaled by a per-token gate (needs token_gates)
    dc_layers: tuple = ()          # layers that add composed local attention (needs token_gates; not paired layers)
    dc_window: int = 112           # its window, in tokens (at most kernels.COMPOSED_MAX_WINDOW)
    trunk: str = "unet"            # unet: U-net skips, x0 mixed into every block | dense: see DenseConnections
    skip_layers: tuple = (3, 6)    # dense: layer [1] (attention-free) adds a gated copy of layer [0]'s output
    snapshot_layer: int = 7        # dense: the layers after it read its output as their attention input


MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]


@dataclass
class Hyperparameters(ModelConfig):
    """A run's config: the model's fields (ModelConfig) plus data, schedule, optimizers and system.
    One flat set of keys, so that every key is one --key=value and one entry of a logged config."""
    preset: str = "speedrun"
    track: str = "track_1_short"   # records track a run of this preset belongs to, or "none"
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760   # first tokens of the val shard(s) every run is judged on
    val_tokens_per_rank: int = 65_536  # val tokens per rank per forward pass
    val_every: int = 0             # validate every this many steps (0: only at the end)
    batch_ranks: int = 8           # the global batch is this many rank slices; fewer processes accumulate
    # model schedule (the model's own fields are ModelConfig's)
    val_long_window: int = 20      # long window (blocks) of the final validation
    yarn_at_final_window: bool = True  # YaRN also for the final validation's wider window (else RoPE stays)
    untie_frac: float = 2 / 3      # fraction of training after which lm_head is untied from the embedding
    # schedule
    num_iterations: int = 1194
    stages: list = field(default_factory=lambda: [
        # multi-token weights as record 89 moves them: [1, .5, .25] -> [1, .5, 0] -> [1, 0] -> [1]
        Stage(end=0.268, tokens_per_rank=16_384, max_doc_len=896, short_window=1, long_window=3,
              mtp_weights=(1.0, 0.5, 0.25), mtp_weights_end=(1.0, 0.5, 0.0), prefix_weight=0.25),
        Stage(end=0.570, tokens_per_rank=32_768, max_doc_len=2048, short_window=3, long_window=7,
              mtp_weights=(1.0, 0.5), mtp_weights_end=(1.0, 0.0), prefix_weight=0.25),
        Stage(end=0.927, tokens_per_rank=49_152, max_doc_len=3072, short_window=5, long_window=11),
        Stage(end=1.000, tokens_per_rank=49_152, max_doc_len=3072, short_window=6, long_window=13),
    ])
    cooldown_start: float = 0.4    # fraction of training where the linear LR cooldown starts
    cooldown_floor: float = 0.15   # LR multiplier at the end of the cooldown
    cooldown_end: float = 1.0      # fraction of training where the cooldown reaches the floor
    averages: list = field(default_factory=list)  # end-of-training weight averages (Average), applied in order
    # optimizers
    optimizer: str = "anvil"       # matrix optimizer: muon | normuon | anvil | adamw (Adam for everything)
    orthogonalize: str = "auto"    # polar_express (record 89) | anvil (record 92) | auto: anvil for anvil
    matrix_lr: float = 0.05
    adamw_matrix_lr: float = 0.008 # Adam's LR for the hidden matrices when optimizer=adamw
    matrix_wd: float = 0.0
    mlp_down_lr_scale: float = 2.0 # extra LR multiplier of the MLP output matrices
    qk_ortho_heads: int = 0        # 0: QKV orthogonalized as one matrix; n: queries and keys in blocks of n heads
    momentum: float = 0.95         # muon/normuon momentum after warm-up
    momentum_warmup_start: float = 0.85  # muon/normuon (anvil's Nesterov mu schedule replaces the warm-up)
    momentum_warmup_steps: int = 300     # muon/normuon: steps from the start momentum to `momentum`
    momentum_cooldown_steps: int = 0     # muon/normuon: last steps over which momentum falls back to the start
    anvil_fast_beta: float = 0.85  # beta of the fast momentum rail
    anvil_slow_beta: float = 0.98  # beta of the slow momentum rail
    anvil_blend: float = 0.4385    # weight of the fast rail once blending starts (1.0 before)
    anvil_blend_start: float = 0.43  # fraction of training where blending starts (step 514 of 1194)
    anvil_mu_low: float = 0.85     # Nesterov mu at the start and the end
    anvil_mu_high: float = 0.93    # Nesterov mu in the middle
    anvil_mu_rise: float = 0.2     # fraction of training over which mu rises (240 of 1194 steps)
    anvil_mu_fall: float = 0.042   # final fraction over which mu falls back (50 of 1194 steps)
    # Adam groups; weight decay is cautious and of strength lr^2 * wd per update (optim.Adam)
    embed_lr: float = 0.01         # token embedding (and the head while tied)
    head_lr: float = 0.008
    value_embed_lr: float = 0.01   # value embeddings and the bigram table
    scalar_lr: float = 0.04        # scalars: residual mixes, skip weights, XSA and smear strengths
    gate_lr: float = 0.04          # value-embedding gate matrices
    smear_gate_lr: float = 0.04    # the smear gate's weights
    token_gate_lr: float = 0.0008  # the token-gate MLPs
    dense_lr: float = 0.002        # the dense-connection MLPs
    embed_betas: tuple = (0.8, 0.95)   # embedding and head
    value_embed_betas: tuple = (0.8, 0.95)  # (sparse value embeddings: beta1 = 0, beta2 their rows' moments')
    scalar_betas: tuple = (0.8, 0.95)  # scalars and gates
    embed_wd: float = 0.0          # embedding and head
    value_embed_wd: float = 0.0    # (scalars and gates are never decayed)
    adam_eps: float = 1e-10
    adam_step_every: int = 1       # Adam updates every this-many steps, from the gradients' mean over them
    ngram_lr: float = 0.01         # the n-gram table's sparse Adam (beta1 = 0, one second moment per row)
    ngram_beta2: float = 0.95
    ngram_wd: float = 0.0
    ngram_step_every: int = 1      # the table (and sparse value embeddings) update every this-many steps
    ngram_late_step: int = 0       # from this step on (0: never) the sparse tables' beta2 and cadence are the late ones
    ngram_late_beta2: float = 0.9025   # record 92's late beta2: 0.95 squared
    ngram_late_step_every: int = 4     # record 92's late cadence: an update every 4th step
    value_embed_late_beta2: float = 0.9025  # sparse value embeddings' beta2 from ngram_late_step (0.95 squared)
    ngram_cache_rows: int = 0      # > 0: the table lives in host memory and this many of its rows on the device
    # system
    seed: int = 0
    device: str = "auto"           # auto | cuda | cpu
    kernels: str = "auto"          # auto (Triton on CUDA; references on CPU, CE chunked) | triton | reference
    compile: bool = True           # torch.compile the training step and the validation
    compile_backend: str = "inductor"  # torch.compile backend; aot_eager traces the same graphs without codegen
    compute_dtype: str = "bfloat16"  # activations and matrix products: bfloat16 (autocast) | float32 (no autocast)
    # FP8 layers run with the Triton kernels or on CUDA (or emulated: fp8_on_cpu); evaluation is bf16
    fp8_mlp: bool = True           # MLPs as the fused FP8 ReLU^2 kernel pair
    fp8_mlp_scales: str = "record92"  # the MLP's scale rules: record92 | record89 | delayed (kernels.MLP_SCALES)
    fp8_qkv: bool = True           # the packed QKV projection as an FP8 linear (kernels.QKV_SCALES)
    fp8_head: bool = True          # the head at the candidate width as an FP8 linear (kernels.HEAD_SCALES)
    fp8_on_cpu: bool = False       # on a CPU, run the FP8 layers through their torch references (checks numerics)
    warmup_steps: int = 3          # untimed steps per graph before timing starts (when something compiles)
    warm_up: str = "auto"          # auto: warm up when something compiles; always: also to map each shape's memory
    cuda_graphs: bool = True       # capture forward+backward and the optimizers' updates in the warm-up, replay them
    sync_check: bool = False       # CUDA: any host sync inside a timed training step is an error
    log_every: int = 10            # print a train-loss line every this many steps
    log_dir: str = "logs"
    save_checkpoint: bool = False  # write logs/<run id>_model.safetensors at the end


def _cpu_preset(h):
    """The CPU track's current record (NgramTable1M27Steps): a 4-layer, width-256 model with the
    hashed n-gram table on the tiny corpus, 2 cores, under a minute. Measurements behind each
    choice: bench/cpu_results.md.

    Full-vocabulary softmax throughout: at this scale sampled softmax learns much more slowly per
    step (the rare tokens' logits are rarely pushed down): val 7.42 (16,384 candidates) against
    6.09 (full) after 20 steps. The compute dtype is the CPU's fast one: bf16 where it has bf16
    units (AVX512-BF16 or AMX), fp32 elsewhere (there a bf16 product runs as an fp32 GEMM plus
    casts, cpu_runtime.py); the val loss is the same either way. Eager: inductor saves less than
    the machine's drift. Validation without the canonical mask: the track's rule is the full
    softmax, as the baseline's.
    """
    h.track = "track_cpu"
    h.train_files = "data/tiny_corpus/tiny_train_*.bin"
    h.val_files = "data/tiny_corpus/tiny_val_*.bin"
    h.val_tokens = 65_536
    h.val_tokens_per_rank = 8_192
    h.batch_ranks = 1
    h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden = 4, 256, 2, 128, 1024
    h.long_window_layers, h.attention_free_layers = (3,), ()
    h.num_value_embeds, h.bigram_rows = 1, 8192   # the bigram embedding's rows with --ngram_rows=0
    h.ngram_rows, h.ngram_lr = 1 << 20, 0.02   # hashed bigram+trigram table, sparse Adam at twice the default LR
    h.val_long_window = 8
    h.num_iterations = 27          # the CPU-track record NgramTable1M27Steps: val 5.689 against the target 5.7264
    h.stages = [                   # twice the batch: LR x1.52 = (4096/2048)^0.6, as record 89 scales it
        Stage(end=0.5, tokens_per_rank=2048, max_doc_len=512, short_window=1, long_window=2,
              mtp_weights=(1.0, 0.5, 0.25), prefix_weight=0.25),
        Stage(end=0.8, tokens_per_rank=4096, max_doc_len=1024, short_window=2, long_window=4,
              mtp_weights=(1.0, 0.5), prefix_weight=0.25, lr_mult=1.52),
        Stage(end=1.0, tokens_per_rank=4096, max_doc_len=1024, short_window=2, long_window=6, lr_mult=1.52),
    ]
    # twice the default LRs: at 36-40 steps val -0.08; three times is worse
    h.embed_lr, h.value_embed_lr, h.head_lr = 0.02, 0.02, 0.016
    # record 89's Adam betas and decay: at 36 steps val 5.562 against 5.655 (3 seeds each)
    h.embed_betas, h.value_embed_betas, h.scalar_betas = (0.5, 0.95), (0.75, 0.95), (0.9, 0.99)
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5
    h.qk_ortho_heads = 1           # queries and keys orthogonalized per head: val -0.005
    h.narrow_qk_layers, h.narrow_qk_dim = (0, 1, 2), 64  # QK 64 with full RoPE on the short layers: val -0.011
    h.log_every = 5
    h.compute_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    h.compile = False
    # No launches to save on a CPU, and the replay path's fixed buffers cost time there: 29.9 s
    # against 29.3 s (medians of 6 interleaved 30-step runs, bit-identical losses)
    h.cuda_graphs = False


NGRAM_RECORD_ROWS = 84_602_880     # record 92's n-gram table: 10,575,360 rows on each of 8 GPUs
NGRAM_LATE_STEP = 336              # record 92's step from which the table's beta2 is squared and updates every 4th


def _record89_features(h):
    """The model features and optimizer constants that records 89 and 92 share."""
    h.smear_gate = True
    h.key_offset = True
    h.xsa_layers = (1, 3, 4, 7)
    h.paired_head_layers = (0, 2, 5, 9)
    h.num_value_embeds, h.value_embed_layers = 0, (1, 2, 8, 9, 10)  # five tables, one per layer
    h.value_embed_gate_reads_value = True  # gates read x[:6] and ve[:6]
    h.embed_init_std = 0.005       # the head's init, which the tied embedding copies
    h.yarn_scale_growth = 0.2
    h.yarn_at_final_window = False # the final window widens, the rotary tables stay
    h.token_gates, h.token_gates_split = True, 4  # XSA strengths, output gates, x0 and bigram injection per token
    h.trunk, h.skip_layers = "dense", (3, 6)  # per-sublayer scales, the skip from 3 into 6, dense connections
    h.matrix_lr, h.matrix_wd = 0.023, 1.2
    h.qk_ortho_heads = 2           # queries and keys orthogonalized per pair of heads
    # Adam: base LR 0.008 and decay 0.005 times per-group multipliers (the decay scales with lr^2)
    h.embed_lr = h.head_lr = 0.008
    h.value_embed_lr = 0.008 * 75  # value embeddings and the bigram table
    h.scalar_lr = 0.008 * 5
    h.gate_lr = 0.008
    h.smear_gate_lr = 0.008 * 0.01
    h.embed_betas, h.value_embed_betas, h.scalar_betas = (0.5, 0.95), (0.75, 0.95), (0.9, 0.99)
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5
    h.adam_step_every = 2          # Adam updates on odd steps only


def _speedrun_preset(h):
    """Record 92: record 89's features and constants on record 92's model and schedule. Record 92
    removed record 89's layer 7; its layers keep record 89's numbers there (0-6, 8-10) and are
    0-9 here. The README's fidelity table compares every value with records 89 and 92 and lists
    what is not built yet."""
    _record89_features(h)
    h.canonical_mask = True        # record 92 validates with the canonical mask
    h.num_layers, h.mlp_hidden = 10, 2816
    h.attention_free_layers = (4, 6, 8)        # record 92's 4, 6, 9: attention on 0, 1, 2, 3, 5, 8, 10
    h.long_window_layers = (3, 9)              # its 3, 10
    h.narrow_qk_layers = (0, 1, 2, 5, 7)       # its 0, 1, 2, 5, 8: QK 64 with full RoPE
    h.narrow_qk_dim, h.narrow_qk_attn_scale, h.attn_scale = 64, 0.13, 0.085  # 0.085 on the QK-128 layers
    h.narrow_vo_layers, h.narrow_vo_dim = (1, 7), 64  # its 1, 8
    h.parallel_mlp_layers = (7,)               # its 8
    # record 89's per-layer features, on the layers that still have attention
    h.value_embed_layers = (1, 2, 7, 9)        # record 89's 1, 2, 8, 10 (its 9 lost its attention)
    h.xsa_layers = (1, 3)                      # record 89's 1, 3 (its 4 lost its attention, its 7 is gone)
    h.paired_head_layers = (0, 2, 5)           # record 89's 0, 2, 5 (its 9 lost its attention)
    h.attn_gate_layers = (3, 9)                # record 89's 3, 10
    h.snapshot_layer = 6                       # record 89's 7 is gone: the layers after 6 read its output
    h.dc_layers = (9,)                         # record 89's 10: composed attention over 112 tokens
    h.ngram_rows, h.ngram_dtype = NGRAM_RECORD_ROWS, "bfloat16"   # the hashed n-gram table, split across the GPUs
    h.ngram_lr, h.ngram_wd = h.value_embed_lr, h.value_embed_wd   # record 89's bigram table's LR and decay
    h.ngram_late_step = NGRAM_LATE_STEP                           # then beta2 0.95^2, an update every 4th step
    h.value_embed_sparse = True    # the value embeddings on the table's path: sparse Adam, the same cadence
    N = h.num_iterations           # 1194
    h.stages = [                   # record 92's boundaries; the tails' batches as the public ANVIL record's
        Stage(end=320 / N, tokens_per_rank=16_384, max_doc_len=896, short_window=1, long_window=3,
              mtp_weights=(1.0, 0.5, 0.25), mtp_weights_end=(1.0, 0.5, 0.0), prefix_weight=0.25, lr_mult=1.0),
        Stage(end=681 / N, tokens_per_rank=32_768, max_doc_len=2048, short_window=3, long_window=7,
              mtp_weights=(1.0, 0.5), mtp_weights_end=(1.0, 0.0), prefix_weight=0.25, prefix_weight_end=0.0,
              lr_mult=1.52),
        Stage(end=1107 / N, tokens_per_rank=49_152, max_doc_len=3072, short_window=5, long_window=11,
              lr_mult=1.73),
        Stage(end=1175 / N, tokens_per_rank=32_768, max_doc_len=3072, short_window=5, long_window=11,
              lr_mult=1.579),
        Stage(end=1.0, tokens_per_rank=16_384, max_doc_len=3072, short_window=6, long_window=13),
    ]
    h.untie_frac = 1175 / N        # record 92 unties at step 1175, where the last tail starts
    h.cooldown_start, h.cooldown_floor = 0.2, 0.30
    h.averages = [                 # record 92's "ships", applied in this order
        Average("embed_head", window=298, rate=2 / 299, blend=0.65),
        Average("value_embeds", window=298, rate=2 / 299, blend=0.65),
        Average("vo_mlp", window=250, every=4, rate=4 / 53),   # replaced by their tail average
        Average("qk", window=298, every=4, rate=2 / 75, blend=0.55, renormalize=True),
        Average("vo_mlp", window=298, every=4, rate=2 / 75, blend=0.3493, renormalize=True),
    ]


def _record89_preset(h):
    """Record 89, the control run: 1270 scheduled steps in three equal stages plus 15 at the final
    windows and LR, NorMuon with Polar Express, the cooldown from 40% of the scheduled steps to 0.15."""
    _record89_features(h)
    h.num_iterations = N = 1270 + 15
    h.stages = [
        Stage(end=423 / N, tokens_per_rank=16_384, max_doc_len=896, short_window=1, long_window=3,
              mtp_weights=(1.0, 0.5, 0.25), mtp_weights_end=(1.0, 0.5, 0.0), prefix_weight=0.25, lr_mult=1.0),
        Stage(end=847 / N, tokens_per_rank=32_768, max_doc_len=2048, short_window=3, long_window=7,
              mtp_weights=(1.0, 0.5), mtp_weights_end=(1.0, 0.0), prefix_weight=0.25, prefix_weight_end=0.0,
              lr_mult=1.52),      # (16/8)^0.6
        Stage(end=1270 / N, tokens_per_rank=49_152, max_doc_len=2048, short_window=5, long_window=11,
              lr_mult=1.73),      # (24/8)^0.5
        Stage(end=1.0, tokens_per_rank=49_152, max_doc_len=2048, short_window=6, long_window=13),
    ]
    h.untie_frac = (847 + 0.5) / N  # untie at step 847, the first of the third stage
    h.cooldown_start, h.cooldown_end, h.cooldown_floor = 508 / N, 1270 / N, 0.15
    h.optimizer, h.orthogonalize = "normuon", "polar_express"
    h.momentum, h.momentum_warmup_start, h.momentum_warmup_steps, h.momentum_cooldown_steps = 0.95, 0.85, 300, 50
    h.bigram_rows = 50304 * 15 // 2  # 377,280
    h.attn_gate_layers = (3, 10)
    h.snapshot_layer = 7
    h.dc_layers = (10,)
    h.fp8_qkv, h.fp8_mlp_scales = False, "record89"  # record 89: FP8 MLP forward and head, QKV in bf16


def _one_gpu_preset(h):
    _speedrun_preset(h)
    h.track = "none"               # the same dynamics as speedrun, but not an 8xH100 record
    # the table (130 GB in bf16) in host memory; the device caches the rows of 5 steps (more than
    # min_cache_rows: an update every 4th step, the next step's prefetch and a validation slice)
    h.ngram_cache_rows = 4_194_304


MEDIUM_SCHEDULED_STEPS = 4700      # public medium record: the steps its batch, window and LR schedules span
MEDIUM_EXTENSION_STEPS = 40        # public medium record: then this many at the last batch and windows, LR 0.1
MEDIUM_DOC_LEN = 4096              # public medium record: train_max_seq_len 128 x 16 x 2, in every phase
MEDIUM_BATCH_RANKS = 16            # rank slices of a global batch: the public 8, halved to fit (docs/medium.md)


def _medium_preset(h):
    """The GPT-2 medium track (val loss 2.92 on 8xH100): the public medium record's facts
    (modded-nanogpt's train_gpt_medium.py, 4700 scheduled steps + 40) on this repository's model
    code and kernels. Its schedule has 12 phases; phase k starts at the first step s with
    12 s / 4700 >= k (392, 784, 1175, 1567, 1959, 2350, 2742, 3134, 3525, 3917, 4309). Each
    phase where the batch, the windows or the LR multiplier change is a stage; phases 8-11 are
    equal and one stage; the 40 extension steps are the last (the same batch and windows, at
    the floor of the cooldown). Nothing is added to the model: what the public model has that
    ours lacks, and every value that maps with a difference, is in docs/medium.md."""
    h.track = "track_2_medium"
    h.num_layers, h.model_dim, h.num_heads, h.head_dim = 16, 1024, 8, 128  # public: 16 layers of 1024, 8 heads of 128
    h.mlp_hidden = 4096            # public medium record: MLP hidden 4 x 1024, ReLU^2
    h.attention_free_layers = ()   # public medium record: attention in all 16 layers
    h.long_window_layers = (0, 4, 11, 15)  # public medium record: bm_sizes long on layers 0, 4, 11, 15
    h.num_value_embeds = 5         # public medium record: 5 value embeddings, table i on layers i and 11 + i
    h.value_embed_gate_dim = 16    # public medium record: value-embedding gates 2 sigmoid(W x[:16])
    h.smear_gate = True            # public medium record: smear gate (ours reads SMEAR_GATE_DIMS = 12 dims, not 16)
    h.key_offset = True            # public medium record: partial key offset on the long-window layers
    h.embed_init_std = 0.005       # public medium record: lm_head N(0, 0.005), the embedding tied to it
    h.yarn_scale_growth = 0.2      # public medium record: YaRN attention scale x (0.2 ln(new / old) + 1), from 0.1
    h.yarn_at_final_window = False # public medium record: no YaRN for the final validation's widening
    h.val_long_window = 27         # public medium record: ws_validate_post_yarn_ext 27 blocks
    h.fp8_mlp = h.fp8_qkv = h.fp8_head = False  # public medium record: bf16 products (CastedLinear's FP8 off)
    h.val_tokens_per_rank = 262_144  # public medium record: val_batch_size 4 x 64 x 1024 x 8 over 8 ranks
    h.val_every = 250              # public medium record: val_loss_every 250
    h.num_iterations = N = MEDIUM_SCHEDULED_STEPS + MEDIUM_EXTENSION_STEPS   # public medium record: 4740
    h.batch_ranks = R = MEDIUM_BATCH_RANKS  # the public global batches, in 16 slices: two per GPU on 8
    d = MEDIUM_DOC_LEN
    h.stages = [                   # tokens_per_rank: the public global batch over R slices
        # public phase 0, steps 0-391: 131,072 tokens, windows (1, 3), LR x1, MTP [1, .5, .25 -> 0]
        Stage(end=392 / N, tokens_per_rank=131_072 // R, max_doc_len=d, short_window=1, long_window=3,
              mtp_weights=(1.0, 0.5, 0.25), mtp_weights_end=(1.0, 0.5, 0.0), lr_mult=1.0),
        # public phase 1, steps 392-783: 262,144 tokens, windows (3, 7), LR x1.52, MTP [1, .5 -> 0]
        Stage(end=784 / N, tokens_per_rank=262_144 // R, max_doc_len=d, short_window=3, long_window=7,
              mtp_weights=(1.0, 0.5), mtp_weights_end=(1.0, 0.0), lr_mult=1.52),
        # public phase 2, steps 784-1174: 393,216 tokens, windows (5, 11), LR x1.73, MTP [1]
        Stage(end=1175 / N, tokens_per_rank=393_216 // R, max_doc_len=d, short_window=5, long_window=11, lr_mult=1.73),
        # public phase 3, steps 1175-1566: 524,288 tokens, windows (6, 13), LR x2.0 (public: x1.73 at step 1175)
        Stage(end=1567 / N, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=6, long_window=13, lr_mult=2.0),
        # public phase 4, steps 1567-1958: windows (7, 15)
        Stage(end=1959 / N, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=7, long_window=15, lr_mult=2.0),
        # public phase 5, steps 1959-2349: windows (8, 17)
        Stage(end=2350 / N, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=8, long_window=17, lr_mult=2.0),
        # public phase 6, steps 2350-2741: windows (9, 19)
        Stage(end=2742 / N, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=9, long_window=19, lr_mult=2.0),
        # public phase 7, steps 2742-3133: windows (10, 21)
        Stage(end=3134 / N, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=10, long_window=21, lr_mult=2.0),
        # public phases 8-11, steps 3134-4699: windows (11, 23) (short: min(11, long // 2))
        Stage(end=4700 / N, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=11, long_window=23, lr_mult=2.0),
        # public extension, steps 4700-4739: train_bs_extension 32 x 2048 x 8, ws_final 23 (short 11), LR 0.1
        Stage(end=1.0, tokens_per_rank=524_288 // R, max_doc_len=d, short_window=11, long_window=23, lr_mult=2.0),
    ]
    h.cooldown_start = 1410 / N    # public medium record: cooldown_frac 0.70 of 4700: from step 1410 (x = 0.3)
    h.cooldown_end = 4700 / N      # public medium record: ... linearly to 0.1 at step 4700, the end of the schedule
    h.cooldown_floor = 0.1         # public medium record: LR multiplier 0.1 at the end and through the extension
    h.untie_frac = 786.5 / N       # public medium record: split_embed_frac 2/3/4: split after step 785, 786 untied
    # optimizers: NorMuon with Polar Express for the matrices
    h.optimizer, h.orthogonalize = "normuon", "polar_express"  # public medium record: NorMuon, polar_express
    h.matrix_lr, h.matrix_wd = 0.015, 1.2  # public medium record: NorMuon lr 0.015, weight_decay 1.2 (cautious)
    h.mlp_down_lr_scale = 4.0      # public medium record: c_proj lr_mul 2 x its stored (4096, 1024) shape's 2
    # (the public shape factor max(1, 4096 / 1024)^0.5 = 2 also lifts Q, K, V and O; ours gives square blocks 1)
    h.qk_ortho_heads = 8           # public medium record: Q, K and V orthogonalized as separate 1024 x 1024 blocks
    h.momentum, h.momentum_warmup_start = 0.95, 0.85  # public medium record: momentum_max 0.95, momentum_min 0.85
    h.momentum_warmup_steps = 300  # public medium record: muon_warmup_steps 300
    h.momentum_cooldown_steps = 50 # public medium record: muon_cooldown_steps 50 (down to 0.85 at step 4740)
    # Adam (DistAdam lr 0.004, betas (0.8, 0.95), eps 1e-8, wd 0.005 as lr^2 x wd, per-parameter multipliers)
    h.embed_lr = h.head_lr = 0.004     # public medium record: DistAdam lr 0.004 for lm_head and embed
    h.value_embed_lr = 0.004 * 75      # public medium record: value_embeds lr_mul 75
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5  # public medium record: wd 0.005, wd_mul 150 and 5
    h.embed_betas = h.value_embed_betas = (0.8, 0.95)   # public medium record: DistAdam betas (0.8, 0.95)
    h.smear_gate_lr = 0.004 * 0.01     # public medium record: smear_gate lr_mul 0.01, no decay
    h.scalar_lr = 0.008 * 5            # public medium record: scalar DistAdam lr 0.008, scalars lr_mul 5
    h.scalar_betas = (0.9, 0.99)       # public medium record: scalar DistAdam betas (0.9, 0.99)
    h.gate_lr = 0.015 * 0.1            # public medium record: value_embed_gate NorMuon lr_mul 0.1 (ours: Adam)
    h.adam_eps = 1e-8                  # public medium record: DistAdam eps 1e-8
    h.adam_step_every = 2              # public medium record: Adam on odd steps only


OPT_STEPS = 3250                   # public optimization track baseline: train_steps
OPT_CONTEXT = 1024                 # public optimization track baseline: causal context of every sequence (tokens)
OPT_VAL_EVERY = 125                # public optimization track baseline: validation every 125 steps


def _optimization_preset(h):
    """The optimization track (fewest steps to val loss 3.28): the public optimization track's
    baseline (modded-nanogpt's records/track_3_optimization/train_gpt_simple.py, tuned Muon and
    AdamW, 3250 steps) on this repository's model code. A 12-layer, width-768 model with 6 heads
    of 128, ReLU^2 MLP 3072, QK norm, half RoPE at base 1024, every layer causal over 1024
    tokens; one global batch of 8 x 64 x 1024 tokens a step; Muon lr 0.025 for the hidden
    matrices, AdamW for the rest; the LR flat for 30% of the steps, then linear to 0. Facts
    that our model cannot express, and every value mapped with a difference, are listed in
    records/track_3_optimization/README.md."""
    h.track = "track_3_optimization"
    h.num_layers, h.model_dim, h.num_heads, h.head_dim = 12, 768, 6, 128  # public: 12 x 768, head_dim 128
    h.mlp_hidden = 4 * 768         # public: MLP 4 x dim, ReLU^2
    h.attention_free_layers, h.long_window_layers = (), ()  # public: attention in every layer, one window
    h.num_value_embeds, h.value_embed_layers = 0, ()        # public: no value embeddings
    h.bigram_rows, h.value_embed_lr = 2, 0.0  # public: no bigram table; ours, the smallest, stays at its zero init
    h.attn_scale, h.rope_base = 0.12, 1024.0  # public: scale=0.12, angular_freq (1/1024)^linspace on half the dims
    h.fp8_mlp = h.fp8_qkv = h.fp8_head = False  # public: bf16 products
    h.untie_frac = 0.0             # public: untied embedding and head from the start
    h.num_iterations = OPT_STEPS
    w = OPT_CONTEXT // WINDOW_BLOCK
    h.stages = [Stage(end=1.0, tokens_per_rank=64 * OPT_CONTEXT, max_doc_len=OPT_CONTEXT, short_window=w,
                      long_window=w)]  # public: 8 x 64 sequences of 1024 tokens a step, one loss: next token
    h.val_long_window = w
    h.val_every = OPT_VAL_EVERY    # public: every 125 steps (then every 25 in the last 10%: not expressible)
    h.cooldown_start, h.cooldown_end, h.cooldown_floor = 0.3, 1.0, 0.0  # public: cooldown_frac 0.7, linear to 0
    h.optimizer, h.orthogonalize = "muon", "polar_express"  # public: Muon (Newton-Schulz, 12 cubic iterations)
    h.matrix_lr = 0.025            # public: Muon lr 0.025
    h.matrix_wd = 0.05 / 0.025     # public: p *= 1 - lr x 0.05; ours decays lr x lr_eff x wd: equal at the peak LR
    h.mlp_down_lr_scale = 1.0      # public: max(1, rows / cols)^0.5 only: 2 for the MLP up, 1 for its down
    h.qk_ortho_heads = h.num_heads  # public: q, k and v are separate 768 x 768 matrices
    h.momentum = h.momentum_warmup_start = 0.95  # public: mu 0.95 (Nesterov) from the first step
    h.momentum_warmup_steps, h.momentum_cooldown_steps = 0, 0
    h.embed_lr, h.head_lr, h.scalar_lr = 0.7, 0.004, 0.015  # public: AdamW lr 0.7 / 0.004 / 0.015
    h.embed_betas = h.scalar_betas = (0.8, 0.95)  # public: betas (0.8, 0.95)
    h.adam_eps = 1e-10             # public: eps 1e-10
    h.embed_wd = 0.001 / 0.7       # public: p *= 1 - lr x 0.001; ours lr^2 x wd: equal for the embedding at its peak
    # public: embedding N(0, 1), head zero; ours unties at step 0 by copying the embedding into the head,
    # so the embedding keeps its default N(0, 1 / 768) (logits ~N(0, 1) at the start, not N(0, 768))


PRESETS = {"speedrun": _speedrun_preset, "1gpu": _one_gpu_preset, "cpu": _cpu_preset, "record89": _record89_preset,
           "medium": _medium_preset, "optimization": _optimization_preset}


class ConfigError(Exception):
    """A bad preset, key or value: the message says which and what is allowed."""


TYPE_NAMES = {int: "a whole number", float: "a number", str: "a string"}  # for the messages of _parse_value
MAX_JSON_DEPTH = 32                # lists and objects nest at most this deep in a config (a resolved one: 3)
CONFIG_FILE_MAX_BYTES = 2**20      # the largest --config file read (a resolved config is ~5 KB)


def json_depth(value):
    """How deep lists and dicts nest in a parsed JSON value (1 for a flat list; 0 for a number)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, (list, dict)):
            deepest = max(deepest, depth)
            todo.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


def load_json(what, text):
    """json.loads(text); a ConfigError naming `what` when lists and objects nest deeper than
    MAX_JSON_DEPTH (json.JSONDecodeError when it is not JSON)."""
    too_deep = ConfigError(f"{what}: lists and objects nest deeper than {MAX_JSON_DEPTH} levels; a config nests "
                           f"them a few levels deep")
    try:
        value = json.loads(text)
    except RecursionError:
        raise too_deep from None
    if json_depth(value) > MAX_JSON_DEPTH:
        raise too_deep
    return value


def _parse_value(key, text, current):
    if isinstance(current, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"--{key} expects true or false, got {text!r}")
    if isinstance(current, (int, float, str)):
        try:
            return type(current)(text)
        except ValueError:
            raise ConfigError(f"--{key} expects {TYPE_NAMES[type(current)]}, got {text!r}") from None
    try:
        return load_json(f"--{key}", text)
    except json.JSONDecodeError:
        raise ConfigError(f"--{key} expects JSON (a list), got {text!r}") from None


# Keys of configs logged before Adam's groups had their own betas and decay -> the keys that replaced them.
LEGACY_KEYS = {"adam_betas": ("embed_betas", "value_embed_betas", "scalar_betas"),
               "adam_wd": ("embed_wd", "value_embed_wd")}


def _upgrade_legacy_keys(d):
    """A logged config in today's keys: a legacy key's value goes to every key that replaced it
    (the scalars were decayed with the embeddings then; adam_wd was 0 in every preset)."""
    d = dict(d)
    for old, new_keys in LEGACY_KEYS.items():
        if old in d:
            value = d.pop(old)
            d.update({key: value for key in new_keys if key not in d})
    return d


def config_from_dict(d, base=None):
    """A Hyperparameters from a resolved-config dict (as written into a log): its keys set on
    `base` (a Hyperparameters, e.g. a preset's), or on the defaults when base is None."""
    if not isinstance(d, dict):
        raise ConfigError(f"a config must be a JSON object of key: value, got {type(d).__name__}")
    d = _upgrade_legacy_keys({k: v for k, v in d.items() if k not in LOG_ONLY_KEYS})
    known = {f.name for f in dataclasses.fields(Hyperparameters)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}")
    if base is None:
        h = Hyperparameters(**d)
    else:
        h = base
        for key, value in d.items():
            setattr(h, key, value)
    return normalize_config(h)


STAGE_FIELDS = [f.name for f in dataclasses.fields(Stage)]


def _stage(value):
    """A Stage from a Stage, a JSON object or a JSON list; ConfigError naming what is wrong."""
    if isinstance(value, Stage):
        return value
    try:
        stage = Stage(**value) if isinstance(value, dict) else Stage(*value)
    except TypeError:
        raise ConfigError(f"--stages: {json.dumps(value)} is not a stage; a stage is a JSON object with keys "
                          f"{STAGE_FIELDS} (the first five required)") from None
    for key in ("mtp_weights", "mtp_weights_end"):
        if not isinstance(getattr(stage, key), (list, tuple)):
            raise ConfigError(f"--stages: {key} must be a list of numbers, got {getattr(stage, key)!r}")
        setattr(stage, key, tuple(getattr(stage, key)))
    return stage


AVERAGE_FIELDS = [f.name for f in dataclasses.fields(Average)]


def _average(value):
    """An Average from an Average or a JSON object; ConfigError naming what is wrong."""
    if isinstance(value, Average):
        return value
    try:
        return Average(**value)
    except TypeError:
        raise ConfigError(f"--averages: {json.dumps(value)} is not an average; an average is a JSON object with "
                          f"keys {AVERAGE_FIELDS} (params and window required)") from None


def _check_averages(averages):
    for i, a in enumerate(averages):
        def refuse(what):
            raise ConfigError(f"--averages: average {i} ({a.params}) {what}")
        if a.params not in AVERAGED_PARAMS:
            refuse(f"has params={a.params!r}: expects one of {', '.join(AVERAGED_PARAMS)}")
        if not _number(a.window, integer=True) or not 1 <= a.window <= MAX_STEPS:
            refuse(f"has window={a.window!r}: expects a number of steps >= 1, at most {MAX_STEPS:,}")
        if not _number(a.every, integer=True) or not 1 <= a.every <= MAX_STEPS:
            refuse(f"has every={a.every!r}: expects a number of steps >= 1, at most {MAX_STEPS:,}")
        if not _number(a.rate) or not 0 < a.rate <= 1:
            refuse(f"has rate={a.rate!r}: expects an EMA weight in (0, 1]")
        if not _number(a.blend) or not 0 <= a.blend <= 1:
            refuse(f"has blend={a.blend!r}: expects a weight in [0, 1]")
        if not isinstance(a.renormalize, bool):
            refuse(f"has renormalize={a.renormalize!r}: expects true or false")


def _sequence(key, value):
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"--{key}={json.dumps(value)}: expects a JSON list, e.g. --{key}=[1,2]")
    return tuple(value)


def normalize_config(h):
    """Turn JSON-ish values (lists, dicts) into the dataclass's types, then check every value."""
    if not isinstance(h.stages, (list, tuple)) or not h.stages:
        raise ConfigError(f"--stages: expects a non-empty JSON list of stages, got {json.dumps(h.stages)}")
    h.stages = [_stage(s) for s in h.stages]
    if not isinstance(h.averages, (list, tuple)):
        raise ConfigError(f"--averages: expects a JSON list of averages, got {json.dumps(h.averages)}")
    h.averages = [_average(a) for a in h.averages]
    for key in LAYER_LIST_KEYS + BETAS_KEYS + ("skip_layers",):
        setattr(h, key, _sequence(key, getattr(h, key)))
    if h.orthogonalize == "auto":
        h.orthogonalize = "anvil" if h.optimizer == "anvil" else "polar_express"
    check_config(h)
    return h


def _number(value, integer=False):
    """Whether value is a finite number (an int, not a bool, when integer)."""
    if isinstance(value, bool):
        return False
    if integer:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


# Upper bounds of the whole-number keys: far above any run's, finite so that no value loops or
# allocates without end.
MAX_STEPS = 10_000_000             # steps of a run (and every count of steps)
MAX_VAL_TOKENS = 2**40             # tokens of a validation
MAX_SLICE_TOKENS = 2**24           # tokens of one rank's slice (a stage's tokens_per_rank, val_tokens_per_rank)
MAX_BATCH_RANKS = 4096             # rank slices of a global batch
MAX_LAYERS = 256                   # layers
MAX_WIDTH = 65_536                 # model_dim and the widths read from it
MAX_HIDDEN = 262_144               # mlp_hidden
MAX_HEADS = 1024                   # attention heads
MAX_HEAD_DIM = 1024                # dims of one head
MAX_TABLE_ROWS = 2**31             # rows of a hashed table (bigram, n-gram, the n-gram cache)
MAX_WINDOW_BLOCKS = 65_536         # an attention window, in WINDOW_BLOCKs

# (key, kind, low, high, what is allowed): numbers must lie in [low, high] (None: no bound).
NUMERIC_RULES = [
    ("num_iterations", int, 1, MAX_STEPS, f"a whole number of steps >= 1, at most {MAX_STEPS:,}"),
    ("val_tokens", int, 1, MAX_VAL_TOKENS, f"a positive number of tokens, at most {MAX_VAL_TOKENS:,}"),
    ("val_tokens_per_rank", int, 1, MAX_SLICE_TOKENS, f"a positive number of tokens, at most {MAX_SLICE_TOKENS:,}"),
    ("val_every", int, 0, MAX_STEPS, f"0 (only at the end) or a positive number of steps, at most {MAX_STEPS:,}"),
    ("batch_ranks", int, 1, MAX_BATCH_RANKS, f"a positive number of rank slices, at most {MAX_BATCH_RANKS:,}"),
    ("num_layers", int, 1, MAX_LAYERS, f"a positive number of layers, at most {MAX_LAYERS}"),
    ("model_dim", int, 1, MAX_WIDTH, f"a positive width, at most {MAX_WIDTH:,}"),
    ("num_heads", int, 1, MAX_HEADS, f"a positive number of heads, at most {MAX_HEADS:,}"),
    ("head_dim", int, 4, MAX_HEAD_DIM, f"a multiple of 4 (RoPE rotates pairs in half of the dims), at most {MAX_HEAD_DIM:,}"),
    ("narrow_qk_dim", int, 4, MAX_HEAD_DIM, f"a multiple of 4, at most {MAX_HEAD_DIM:,}"),
    ("narrow_qk_attn_scale", float, 1e-9, None, "a positive scale"),
    ("narrow_vo_dim", int, 1, MAX_HEAD_DIM, f"a positive width, at most {MAX_HEAD_DIM:,}"),
    ("token_gates_split", int, 0, MAX_LAYERS, "a layer index in [0, num_layers]"),
    ("dc_window", int, 1, kernels.COMPOSED_MAX_WINDOW, f"a window of 1 to {kernels.COMPOSED_MAX_WINDOW} tokens"),
    ("snapshot_layer", int, 0, MAX_LAYERS, "a layer index"),
    ("mlp_hidden", int, 1, MAX_HIDDEN, f"a positive width, at most {MAX_HIDDEN:,}"),
    ("num_value_embeds", int, 0, MAX_LAYERS // 2, "0 or more tables, at most num_layers / 2"),
    ("value_embed_gate_dim", int, 1, MAX_WIDTH, "a positive number of dims, at most model_dim"),
    ("bigram_rows", int, 2, MAX_TABLE_ROWS, f"at least 2 rows, at most {MAX_TABLE_ROWS:,}"),
    ("ngram_rows", int, 0, MAX_TABLE_ROWS, f"0 (off) or an even number of rows, at least 4, at most {MAX_TABLE_ROWS:,}"),
    ("embed_init_std", float, 0.0, None, "a std >= 0 (0: model_dim^-0.5)"),
    ("rope_base", float, 1e-9, None, "a positive period"),
    ("attn_scale", float, 1e-9, None, "a positive scale"),
    ("yarn_scale_growth", float, 0.0, None, "a growth rate >= 0"),
    ("val_long_window", int, 1, MAX_WINDOW_BLOCKS, f"a positive number of window blocks, at most {MAX_WINDOW_BLOCKS:,}"),
    ("untie_frac", float, 0.0, 1.0, "a fraction of training in [0, 1]"),
    ("cooldown_start", float, 0.0, 1.0, "a fraction of training in [0, 1]"),
    ("cooldown_floor", float, 0.0, 1.0, "an LR multiplier in [0, 1]"),
    ("cooldown_end", float, 1e-9, 1.0, "a fraction of training in (0, 1], after cooldown_start"),
    ("matrix_lr", float, 0.0, None, "a learning rate >= 0"),
    ("adamw_matrix_lr", float, 0.0, None, "a learning rate >= 0"),
    ("matrix_wd", float, 0.0, None, "a weight decay >= 0"),
    ("mlp_down_lr_scale", float, 0.0, None, "an LR multiplier >= 0"),
    ("qk_ortho_heads", int, 0, MAX_HEADS, "0 (QKV as one matrix) or a number of heads that divides num_heads"),
    ("momentum", float, 0.0, 1.0, "a momentum in [0, 1]"),
    ("momentum_warmup_start", float, 0.0, 1.0, "a momentum in [0, 1]"),
    ("momentum_warmup_steps", int, 0, MAX_STEPS, f"0 or more steps, at most {MAX_STEPS:,}"),
    ("momentum_cooldown_steps", int, 0, MAX_STEPS, f"0 or more steps, at most {MAX_STEPS:,}"),
    ("anvil_fast_beta", float, 0.0, 1.0, "a beta in [0, 1]"),
    ("anvil_slow_beta", float, 0.0, 1.0, "a beta in [0, 1]"),
    ("anvil_blend", float, 0.0, 1.0, "a weight in [0, 1]"),
    ("anvil_blend_start", float, 0.0, 1.0, "a fraction of training in [0, 1]"),
    ("anvil_mu_low", float, 0.0, 1.0, "a Nesterov weight in [0, 1]"),
    ("anvil_mu_high", float, 0.0, 1.0, "a Nesterov weight in [0, 1]"),
    ("anvil_mu_rise", float, 1e-9, 1.0, "a fraction of training in (0, 1]"),
    ("anvil_mu_fall", float, 1e-9, 1.0, "a fraction of training in (0, 1]"),
    ("embed_lr", float, 0.0, None, "a learning rate >= 0"),
    ("head_lr", float, 0.0, None, "a learning rate >= 0"),
    ("value_embed_lr", float, 0.0, None, "a learning rate >= 0"),
    ("scalar_lr", float, 0.0, None, "a learning rate >= 0"),
    ("gate_lr", float, 0.0, None, "a learning rate >= 0"),
    ("smear_gate_lr", float, 0.0, None, "a learning rate >= 0"),
    ("token_gate_lr", float, 0.0, None, "a learning rate >= 0"),
    ("dense_lr", float, 0.0, None, "a learning rate >= 0"),
    ("embed_wd", float, 0.0, None, "a weight decay >= 0"),
    ("value_embed_wd", float, 0.0, None, "a weight decay >= 0"),
    ("adam_eps", float, 0.0, None, "an epsilon >= 0"),
    ("adam_step_every", int, 1, MAX_STEPS, f"a positive number of steps, at most {MAX_STEPS:,}"),
    ("ngram_lr", float, 0.0, None, "a learning rate >= 0"),
    ("ngram_beta2", float, 0.0, 1.0, "a beta in [0, 1]"),
    ("ngram_wd", float, 0.0, None, "a weight decay >= 0"),
    ("ngram_step_every", int, 1, MAX_STEPS, f"a positive number of steps, at most {MAX_STEPS:,}"),
    ("ngram_late_step", int, 0, MAX_STEPS, f"a step >= 0 (0: never), at most {MAX_STEPS:,}"),
    ("ngram_late_beta2", float, 0.0, 1.0, "a beta in [0, 1]"),
    ("ngram_late_step_every", int, 1, MAX_STEPS, f"a positive number of steps, at most {MAX_STEPS:,}"),
    ("value_embed_late_beta2", float, 0.0, 1.0, "a beta in [0, 1]"),
    ("ngram_cache_rows", int, 0, MAX_TABLE_ROWS, f"0 (the table on the device) or a number of rows, at most {MAX_TABLE_ROWS:,}"),
    ("seed", int, 0, 2**63 - 1, "a whole number in [0, 2^63)"),
    ("warmup_steps", int, 0, MAX_STEPS, f"0 or more steps, at most {MAX_STEPS:,}"),
    ("log_every", int, 1, MAX_STEPS, f"a positive number of steps, at most {MAX_STEPS:,}"),
]
# (key, allowed values)
CHOICE_RULES = [
    ("track", ("track_1_short", "track_2_medium", "track_cpu", "track_3_optimization", "track_3_cpu_optimization",
               "none")),
    ("optimizer", ("muon", "normuon", "anvil", "adamw")),
    ("orthogonalize", tuple(optim.SCHEDULES)),
    ("device", ("auto", "cuda", "cpu")),
    ("kernels", ("auto", "triton", "reference")),
    ("compile_backend", ("inductor", "aot_eager", "eager")),
    ("compute_dtype", ("bfloat16", "float32")),
    ("warm_up", ("auto", "always")),
    ("trunk", ("unet", "dense")),
    ("fp8_mlp_scales", tuple(kernels.MLP_SCALES)),
    ("ngram_dtype", ("float32", "bfloat16")),
]
BOOL_KEYS = ("compile", "cuda_graphs", "fp8_mlp", "fp8_qkv", "fp8_head", "fp8_on_cpu", "sync_check", "save_checkpoint",
             "canonical_mask", "smear_gate", "key_offset", "yarn_at_final_window", "value_embed_gate_reads_value",
             "token_gates", "value_embed_sparse")
NONEMPTY_STRING_KEYS = ("train_files", "val_files", "log_dir")
BETAS_KEYS = ("embed_betas", "value_embed_betas", "scalar_betas")


def _refuse(key, value, allowed):
    raise ConfigError(f"--{key}={json.dumps(value)} is not allowed: expects {allowed}")


def _check_range(key, value, kind, low, high, allowed):
    if not _number(value, integer=kind is int) or (low is not None and value < low) or \
            (high is not None and value > high):
        _refuse(key, value, allowed)


def loggable(text):
    """Whether `text` can be one line of a log, which is UTF-8: no line breaks, and no lone
    surrogates (what Python makes of a command-line or file-name byte that is not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return text.splitlines() in ([text], [])


def json_strings(value):
    """Every string in a JSON-like value: the value itself, or inside its lists, tuples and
    dicts (keys included)."""
    todo = [value]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            yield value
        elif isinstance(value, dict):
            todo.extend([*value.keys(), *value.values()])
        elif isinstance(value, (list, tuple)):
            todo.extend(value)


def check_config(h):
    """Every value's type and range, so that a bad one ends the run before any work, with one
    line naming the key, the value and what is allowed."""
    for key, value in config_to_dict(h).items():
        if not all(loggable(text) for text in json_strings(value)):
            _refuse(key, value, "UTF-8 text without line breaks (the log records it)")
    for key, kind, low, high, allowed in NUMERIC_RULES:
        _check_range(key, getattr(h, key), kind, low, high, allowed)
    for key, choices in CHOICE_RULES:
        if getattr(h, key) not in choices:
            _refuse(key, getattr(h, key), "one of " + ", ".join(choices))
    for key in BOOL_KEYS:
        if not isinstance(getattr(h, key), bool):
            _refuse(key, getattr(h, key), "true or false")
    for key in NONEMPTY_STRING_KEYS:
        if not isinstance(getattr(h, key), str) or not getattr(h, key):
            _refuse(key, getattr(h, key), "a non-empty path")
    check_model_config(h)
    if h.cooldown_end <= h.cooldown_start < 1.0:
        _conflict(h, ("cooldown_start", "cooldown_end"), "the cooldown must end after it starts")
    if h.qk_ortho_heads and h.num_heads % h.qk_ortho_heads:
        _conflict(h, ("qk_ortho_heads", "num_heads"), "the query and key blocks must split the heads evenly")
    for key in BETAS_KEYS:
        betas = getattr(h, key)
        if len(betas) != 2 or not all(_number(b) and 0 <= b < 1 for b in betas):
            _refuse(key, list(betas), "two numbers in [0, 1), e.g. [0.8, 0.95]")
    _check_stages(h.stages)
    _check_averages(h.averages)
    _check_fp8(h)


def _check_fp8(h):
    """The static scale of rms-normed FP8 inputs holds rows up to kernels.NORMED_INPUT_MAX_DIM wide."""
    static = [key for key, on in (("fp8_qkv", h.fp8_qkv),
                                  ("fp8_mlp_scales", h.fp8_mlp and h.fp8_mlp_scales == "record92")) if on]
    if static and h.model_dim > kernels.NORMED_INPUT_MAX_DIM:
        _conflict(h, ("model_dim", *static), f"their static input scale saturates rows wider than "
                  f"{kernels.NORMED_INPUT_MAX_DIM}; use --fp8_qkv=false and --fp8_mlp_scales=delayed")


SMEAR_GATE_DIMS = 12               # the smear gate reads the first this-many dims of a token's embedding


def _conflict(m, keys, why):
    settings = " and ".join(f"--{key}={json.dumps(getattr(m, key))}" for key in keys)
    raise ConfigError(f"{settings} do not fit together: {why}")


LAYER_LIST_KEYS = ("long_window_layers", "attention_free_layers", "xsa_layers", "value_embed_layers",
                   "paired_head_layers", "narrow_qk_layers", "narrow_vo_layers", "parallel_mlp_layers",
                   "attn_gate_layers", "dc_layers")


def check_model_config(m):
    """The rules a model config must meet to be built (each value's own range is checked with the
    rest of the config): a broken one is refused with one line naming the keys involved."""
    if m.head_dim % 4:
        _refuse("head_dim", m.head_dim, "a multiple of 4 (RoPE rotates pairs in half of the dims)")
    if m.narrow_qk_dim % 4:
        _refuse("narrow_qk_dim", m.narrow_qk_dim, "a multiple of 4 (RoPE rotates pairs of dims)")
    for key in LAYER_LIST_KEYS:
        layers = getattr(m, key)
        in_range = all(_number(i, integer=True) and 0 <= i < m.num_layers for i in layers)
        if not in_range or len(set(layers)) < len(layers):
            _refuse(key, list(layers), f"a list of distinct layer indices in [0, {m.num_layers})")
    if m.ngram_rows and (m.ngram_rows < 4 or m.ngram_rows % 2):
        _refuse("ngram_rows", m.ngram_rows, "0 (off) or an even number of rows, at least 4 (two halves: bigrams, "
                "trigrams)")
    if m.value_embed_gate_dim > m.model_dim:
        _conflict(m, ("value_embed_gate_dim", "model_dim"), "the gates read at most model_dim residual dims")
    if 2 * m.num_value_embeds > m.num_layers:
        _conflict(m, ("num_value_embeds", "num_layers"), f"at most num_layers / 2 = {m.num_layers // 2} tables "
                  "(each serves one of the first and one of the last layers)")
    if m.num_value_embeds and m.value_embed_layers:
        _conflict(m, ("num_value_embeds", "value_embed_layers"), "give shared tables or per-layer tables, not both: "
                  "set one of them to 0 or []")
    ve_key = "value_embed_layers" if m.value_embed_layers else "num_value_embeds"
    unused = sorted(set(value_embed_tables(m)) & set(m.attention_free_layers))
    if unused:
        _conflict(m, (ve_key, "attention_free_layers"), f"value embeddings go to layers {unused}, "
                  "which have no attention to add them to")
    if m.value_embed_gate_reads_value and m.value_embed_gate_dim % 2:
        _conflict(m, ("value_embed_gate_reads_value", "value_embed_gate_dim"), "the gates read half their inputs "
                  "from the residual and half from the value embedding: an even number")
    if set(m.long_window_layers) & set(m.attention_free_layers):
        _conflict(m, ("long_window_layers", "attention_free_layers"), "a long-window layer needs attention")
    if set(m.xsa_layers) & set(m.attention_free_layers):
        _conflict(m, ("xsa_layers", "attention_free_layers"), "XSA acts on a layer's attention output")
    if set(m.paired_head_layers) & set(m.attention_free_layers):
        _conflict(m, ("paired_head_layers", "attention_free_layers"), "pairing acts on a layer's attention")
    if m.paired_head_layers and m.num_heads % 2:
        _conflict(m, ("paired_head_layers", "num_heads"), "heads pair up: an even number of heads")
    if set(m.paired_head_layers) & set(m.xsa_layers):
        _conflict(m, ("paired_head_layers", "xsa_layers"), "a paired layer's values do not line up with its "
                  "outputs head by head, which XSA needs")
    if m.key_offset and set(m.paired_head_layers) & set(m.long_window_layers):
        _conflict(m, ("key_offset", "paired_head_layers", "long_window_layers"), "the key offset shifts by one "
                  "token, which a paired layer's doubled sequence does not have")
    if m.key_offset and not m.long_window_layers:
        _conflict(m, ("key_offset", "long_window_layers"), "the key offset acts on long-window layers only: "
                  "name one, or set --key_offset=false")
    for key in ("narrow_qk_layers", "narrow_vo_layers"):
        if set(getattr(m, key)) & set(m.attention_free_layers):
            _conflict(m, (key, "attention_free_layers"), "a narrow layer needs attention")
    if m.key_offset and set(m.narrow_qk_layers) & set(m.long_window_layers):
        _conflict(m, ("key_offset", "narrow_qk_layers", "long_window_layers"), "a narrow layer rotates all of "
                  "its query and key dims, so it has no stationary dims for the key offset")
    widths = {}
    for layer, table in value_embed_tables(m).items():
        widths.setdefault(table, set()).add(head_dims(m, layer)[1])
    if any(len(w) > 1 for w in widths.values()):
        _conflict(m, ("num_value_embeds", "narrow_vo_layers"), "a shared value-embedding table serves layers "
                  "of one value width: give per-layer tables with --value_embed_layers")
    if m.attn_gate_layers and not m.token_gates:
        _conflict(m, ("attn_gate_layers", "token_gates"), "the output gates come from the token gates: "
                  "set --token_gates=true")
    if set(m.attn_gate_layers) & set(m.attention_free_layers):
        _conflict(m, ("attn_gate_layers", "attention_free_layers"), "an output gate acts on a layer's attention")
    if m.dc_layers and not m.token_gates:
        _conflict(m, ("dc_layers", "token_gates"), "the head mixes come from the token gates: set --token_gates=true")
    if set(m.dc_layers) & (set(m.attention_free_layers) | set(m.paired_head_layers)):
        _conflict(m, ("dc_layers", "attention_free_layers", "paired_head_layers"), "composed attention mixes the "
                  "maps of a layer's own heads: a layer with attention, not paired")
    if m.token_gates and m.token_gates_split > m.num_layers:
        _conflict(m, ("token_gates_split", "num_layers"), "the split is a layer index, or num_layers for one MLP")
    if m.token_gates and len(m.attention_free_layers) == m.num_layers:
        _conflict(m, ("token_gates", "attention_free_layers"), "the token gates act on attention layers: "
                  "there are none")
    if m.trunk == "dense":
        _check_dense_trunk(m)
    if m.smear_gate and m.model_dim < SMEAR_GATE_DIMS:
        _conflict(m, ("smear_gate", "model_dim"), f"the smear gate reads the first {SMEAR_GATE_DIMS} dims")


def _check_dense_trunk(m):
    last = m.num_layers - 1
    if not m.token_gates:
        _conflict(m, ("trunk", "token_gates"), "the dense trunk injects x0 and the bigram through the token gates: "
                  "set --token_gates=true")
    source, target = (tuple(m.skip_layers) + (None, None))[:2]
    if len(m.skip_layers) != 2 or not all(_number(i, integer=True) for i in m.skip_layers) \
            or not 0 <= source < target <= last:
        _refuse("skip_layers", list(m.skip_layers), f"[from, to]: two layer indices, from < to < {m.num_layers}")
    if target not in m.attention_free_layers:
        _conflict(m, ("skip_layers", "attention_free_layers"), "the skip takes the place of the attention of "
                  "an attention-free layer")
    if 0 in m.attention_free_layers or m.token_gates_split < 1:
        _conflict(m, ("trunk", "attention_free_layers", "token_gates_split"), "the dense trunk's input is x0 with "
                  "the bigram let in by layer 0's gate from the first token-gate MLP: layer 0 needs attention, "
                  "and the split must come after it")
    if m.snapshot_layer >= last:
        _conflict(m, ("snapshot_layer", "num_layers"), "the snapshot is read by later layers: it comes before the last")
    if last in m.attention_free_layers or m.num_heads * head_dims(m, last)[1] != m.model_dim:
        _conflict(m, ("trunk", "attention_free_layers", "narrow_vo_layers"), "the dense connections mix residual "
                  "vectors into the last layer's values: it needs attention with num_heads x head_dim = model_dim")
    if m.num_heads % 2:
        _conflict(m, ("trunk", "num_heads"), "the last layer's value-embedding gate has one lane per half of the "
                  "heads: an even number")


def _check_stages(stages):
    def refuse(i, what):
        raise ConfigError(f"--stages: stage {i} {what}")

    previous_end = 0.0
    for i, s in enumerate(stages):
        if not _number(s.end) or not previous_end < s.end <= 1.0:
            refuse(i, f"ends at {s.end!r}: stage ends must increase within (0, 1]")
        previous_end = s.end
        for key, high in (("tokens_per_rank", MAX_SLICE_TOKENS), ("max_doc_len", MAX_SLICE_TOKENS),
                          ("short_window", MAX_WINDOW_BLOCKS), ("long_window", MAX_WINDOW_BLOCKS)):
            if not _number(getattr(s, key), integer=True) or not 1 <= getattr(s, key) <= high:
                refuse(i, f"has {key}={getattr(s, key)!r}: expects a positive whole number, at most {high:,}")
        if s.tokens_per_rank < MIN_DOC_TOKENS:
            refuse(i, f"has tokens_per_rank={s.tokens_per_rank}: expects at least {MIN_DOC_TOKENS}")
        if not 1 <= len(s.mtp_weights) <= MAX_TARGETS - 1 or not all(_number(w) and w >= 0 for w in s.mtp_weights):
            refuse(i, f"has mtp_weights={list(s.mtp_weights)}: expects 1 to {MAX_TARGETS - 1} weights >= 0")
        if s.mtp_weights_end and (len(s.mtp_weights_end) != len(s.mtp_weights) or
                                  not all(_number(w) and w >= 0 for w in s.mtp_weights_end)):
            refuse(i, f"has mtp_weights_end={list(s.mtp_weights_end)}: expects [] (constant weights) or "
                      f"{len(s.mtp_weights)} weights >= 0, one per mtp_weights entry")
        if not _number(s.prefix_weight) or s.prefix_weight < 0:
            refuse(i, f"has prefix_weight={s.prefix_weight!r}: expects a weight >= 0")
        if s.prefix_weight_end is not None and (not _number(s.prefix_weight_end) or s.prefix_weight_end < 0):
            refuse(i, f"has prefix_weight_end={s.prefix_weight_end!r}: expects null (constant) or a weight >= 0")
        if not _number(s.candidates, integer=True) or not (s.candidates == 0 or 2 <= s.candidates <= PADDED_VOCAB_SIZE):
            refuse(i, f"has candidates={s.candidates!r}: expects 0 (full vocabulary) or 2 to {PADDED_VOCAB_SIZE}: "
                      f"the candidates are the target and negatives, and a softmax over the target alone is 1 "
                      f"whatever the logits (loss 0, no gradient)")
        if not _number(s.lr_mult) or s.lr_mult < 0:
            refuse(i, f"has lr_mult={s.lr_mult!r}: expects a multiplier >= 0")
    if stages[-1].end != 1.0:
        raise ConfigError("--stages: the last stage must end at 1.0 (the fraction of num_iterations)")


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose refusals are ConfigErrors (one `error:` line), not a usage
    message and an exit."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}")


def preset_config(preset):
    """The Hyperparameters of the preset named `preset`."""
    if not isinstance(preset, str) or preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    h = Hyperparameters(preset=preset)
    PRESETS[preset](h)
    return h


def read_config_file(path):
    """The JSON value of the --config file at `path`: a regular file of at most
    CONFIG_FILE_MAX_BYTES of UTF-8 JSON, nested at most MAX_JSON_DEPTH deep (ConfigError saying
    which it is not). Opened without blocking, so a FIFO is refused rather than waited on."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"--config {path} is not a regular file: give a JSON file")
            raw = f.read(CONFIG_FILE_MAX_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror}") from None
    if len(raw) > CONFIG_FILE_MAX_BYTES:
        raise ConfigError(f"--config {path} is larger than {CONFIG_FILE_MAX_BYTES // 2**20} MiB: a config file holds "
                          f"one resolved config (a few KB of JSON)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): "
                          f"save it as UTF-8") from None
    try:
        return load_json(f"--config {path}", text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config {path} is not valid JSON ({e})") from None


def parse_config(argv):
    """--preset NAME, --config PATH (a resolved config from a log), then --key=value overrides."""
    parser = ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    parser.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)}")
    parser.add_argument("--config", default=None, help="JSON file of a resolved config")
    args, rest = parser.parse_known_args(argv)
    if args.config and args.preset:
        raise ConfigError("give --preset or --config, not both (a config file already names its preset)")
    if args.config:
        d = read_config_file(args.config)
        h = config_from_dict(d, base=preset_config(d["preset"]) if isinstance(d, dict) and "preset" in d else None)
    else:
        h = preset_config(args.preset or "speedrun")
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    for item in rest:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"expected --key=value, got {item!r}")
        key, text = item[2:].split("=", 1)
        if key not in fields or key == "preset":
            raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(fields))}")
        setattr(h, key, _parse_value(key, text, getattr(h, key)))
    h = normalize_config(h)
    for item in argv:
        if not loggable(item):
            raise ConfigError(f"the argument {json.dumps(item)} cannot be written into the log (it records the "
                              f"command line): expects UTF-8 text without line breaks")
    return h


LOG_ONLY_KEYS = ("entry",)          # written into a log's config for the records tools, not settings


def config_to_dict(h):
    return dataclasses.asdict(h)


def logged_config(h):
    """The resolved config as a log records it: the settings plus the entry script's path."""
    return {**config_to_dict(h), "entry": os.path.basename(__file__)}


# -----------------------------------------------------------------------------------------------
# Model
# -----------------------------------------------------------------------------------------------

BIGRAM_MULT_CUR = 36313            # bigram row hash: multiplier of the current token
BIGRAM_MULT_PREV = 27191           # bigram row hash: multiplier of the previous token
SIGN_ROWS = 8192                   # rows of the fixed random +/-1 sign table
SIGN_MULT_CUR = 40351              # sign-row hash: multiplier of the current token
SIGN_MULT_PREV = 51349             # sign-row hash: multiplier of the previous token
SIGN_TABLE_SEED = 1234             # the sign table is the same in every run
TRIGRAM_MULT_CUR = 17351           # trigram row hash: multiplier of the current token
TRIGRAM_MULT_PREV = 60961          # trigram row hash: multiplier of the previous token
TRIGRAM_MULT_PREV2 = 45259         # trigram row hash: multiplier of the token before that
TRIGRAM_SIGN_MULTS = (29363, 47119, 13709)  # the trigram channel's sign-row hash (current, previous, before)
YARN_ALPHA = 1.0                   # YaRN: frequencies with fewer rotations per window than this are interpolated fully
YARN_BETA = 32.0                   # YaRN: ... and those with more than this are kept as they are
MAX_TARGETS = 4                    # next token, two more multi-token targets, the prefix target


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


def yarn_frequencies(freq, old_tokens, new_tokens):
    """YaRN for a window growing from old_tokens to new_tokens: low frequencies (few rotations
    inside the old window) are slowed by old/new, so the model sees familiar angles at the new
    distances; high ones are kept."""
    rotations = old_tokens * freq / (2 * math.pi)
    keep = ((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
    ratio = old_tokens / new_tokens
    return freq * (ratio + keep * (1 - ratio))


class Rotary(nn.Module):
    """RoPE on half of the head dims (the other half stays stationary, zero frequency), or on all
    of them (`rotate_all`), and the attention scale that YaRN adjusts together with the
    frequencies as the long window grows.

    Frequencies follow base period `base` over head_dim/4 rotating pairs (head_dim/2 with
    rotate_all). `set_windows` derives the frequency table and the scale from the whole history
    of long windows, so they depend on where training is, not on the order of calls. Both live
    in buffers updated in place: a compiled model reads the new values without recompiling.
    """

    def __init__(self, head_dim, base, max_tokens, attn_scale, scale_growth, rotate_all=False):
        super().__init__()
        quarter = head_dim // 4
        freq = (1.0 / base) ** torch.linspace(0, 1, 2 * quarter if rotate_all else quarter)
        self.register_buffer("base_freq", freq if rotate_all else torch.cat([freq, freq.new_zeros(quarter)]),
                             persistent=False)
        # (head_dim,) True on the dims that never rotate (zero frequency), in forward's layout
        self.register_buffer("stationary", (self.base_freq == 0).repeat(2), persistent=False)
        self.register_buffer("cos", torch.empty(max_tokens, 2 * quarter), persistent=False)
        self.register_buffer("sin", torch.empty(max_tokens, 2 * quarter), persistent=False)
        self.register_buffer("attn_scale", torch.empty(()), persistent=False)
        self.initial_attn_scale, self.scale_growth = attn_scale, scale_growth
        self.windows = None        # the long-window history (in tokens) the tables were made for
        self.set_windows([])

    @torch.no_grad()
    def set_windows(self, long_windows):
        """Frequencies and attention scale after the long window grew through `long_windows` (tokens)."""
        if self.windows == list(long_windows):
            return
        freq, scale = self.base_freq, self.initial_attn_scale
        for old, new in zip(long_windows, long_windows[1:]):
            freq = yarn_frequencies(freq, old, new)
            scale *= 1 + self.scale_growth * math.log(new / old)
        angles = torch.outer(torch.arange(self.cos.size(0), dtype=torch.float32, device=freq.device), freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())
        self.attn_scale.fill_(scale)
        self.windows = list(long_windows)

    def angles(self, start, rows):
        """(cos, sin), each (rows, head_dim / 2): the tables of positions start, ..., start + rows - 1."""
        return self.cos[start:start + rows], self.sin[start:start + rows]

    def forward(self, x, start=0):
        """Rotate x (T, heads, head_dim) as the tokens at positions start, ..., start + T - 1."""
        return kernels.rope_reference(x, *self.angles(start, x.size(0)))


@dataclass
class AttentionArgs:
    """Everything attention needs about the packed batch and the current windows."""
    cu_seqlens: torch.Tensor | None  # document offsets of the packed batch (None with a cache)
    short_window: int              # tokens
    long_window: int               # tokens
    cache: "KVCache | None" = None  # generation: the tokens are the next ones of the cached document


class KVCache:
    """The keys and values of one document's tokens so far, per attention layer, for generation:
    each new token computes only its own q, k, v and attends to the cached keys of its window, so
    a token costs the same at position 10 as at position 5,000. Buffers are allocated once, for
    `capacity` tokens, at the first use of each layer (twice the rows for a paired-head layer,
    whose k, v hold two positions per token)."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.length = 0            # tokens cached so far (the position of the next token)
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
        self.last_tokens = (tokens if self.last_tokens is None else torch.cat([self.last_tokens, tokens]))[-2:]


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


XSA_NORM_EPS = 1e-4               # values shorter than this are not normalized further (their direction is noise)


def remove_self_value(y, v, alpha):
    """XSA: each head's output y (T, H, D) less tanh(alpha) times its projection on the head's
    own value direction v/|v|, the part of the output that repeats the token's own value; alpha
    (H,) per head or (T, H) per token and head.
    alpha starts at 0: the layer starts as plain attention and learns how much to remove."""
    direction = F.normalize(v, dim=-1, eps=XSA_NORM_EPS)
    along = (y * direction).sum(-1, keepdim=True)
    return y - torch.tanh(alpha).type_as(y)[..., None] * along * direction


DC_MIX_EPS = 1e-6                  # the RMS norm over heads of the map mix


def interleave_head_pairs(x):
    """(T, H, D) -> (2T, H/2, D): heads 2h and 2h+1 of token t become head h at positions 2t and
    2t+1. Under one causal mask over the doubled sequence, each of the two queries then sees
    both heads' keys of the earlier tokens (and head 2h+1 also head 2h's key of its own token)."""
    T, H, D = x.shape
    return x.view(T, H // 2, 2, D).transpose(1, 2).reshape(2 * T, H // 2, D)


def deinterleave_head_pairs(y):
    """The inverse of interleave_head_pairs: (2T, H/2, D) -> (T, H, D)."""
    T2, half, D = y.shape
    return y.view(T2 // 2, 2, half, D).transpose(1, 2).reshape(T2 // 2, 2 * half, D)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer, long_window: bool, value_embed: bool, xsa: bool, paired: bool,
                 fns):
        super().__init__()
        self.num_heads, self.long_window = cfg.num_heads, long_window
        self.qk_dim, self.v_dim = head_dims(cfg, layer)
        self.narrow_qk = layer in cfg.narrow_qk_layers    # rotated in full, with their own scale
        self.key_offset = cfg.key_offset and long_window
        self.paired = paired
        self.qkv = nn.Parameter(torch.empty(cfg.num_heads * (2 * self.qk_dim + self.v_dim), cfg.model_dim))
        self.out = nn.Parameter(torch.zeros(cfg.model_dim, cfg.num_heads * self.v_dim))
        self.attention_fn, self.qk_norm_rope, self.composed_fn = fns.attention, fns.qk_norm_rope, fns.composed_attention
        self.fp8_qkv = fns.fp8_qkv  # in training, the projection runs in FP8 with its state in fp8_state
        if fns.fp8_qkv is not None:
            self.register_buffer("fp8_state", kernels.new_fp8_linear_state())
        mixed_densely = cfg.trunk == "dense" and layer == cfg.num_layers - 1  # gets its gates from DenseConnections
        if value_embed and not mixed_densely:
            self.ve_gate = nn.Parameter(torch.zeros(cfg.num_heads, cfg.value_embed_gate_dim))
        else:
            self.ve_gate = None
        self.ve_gate_reads_value = cfg.value_embed_gate_reads_value
        self.xsa = xsa             # with token gates the strengths come per token from them
        self.dc_window = cfg.dc_window if layer in cfg.dc_layers else 0
        self.xsa_alpha = nn.Parameter(torch.zeros(cfg.num_heads)) if xsa and not cfg.token_gates else None
        # dense trunk: learned scales of the QKV projection's output and of the output projection
        self.sa_lambdas = nn.Parameter(torch.tensor(DENSE_SA_LAMBDAS)) if cfg.trunk == "dense" else None
        bound = (3 ** 0.5) * 0.5 * cfg.model_dim ** -0.5
        nn.init.uniform_(self.qkv, -bound, bound)

    def composed(self, q, k, v, doc_start, rotary, gates):
        """Composed attention (kernels.composed_attention) with this layer's head mixes from the
        token gates (the input mix RMS-normed over the heads)."""
        mix_in = F.rms_norm(gates["dc_in"].float(), (self.num_heads,), eps=DC_MIX_EPS)
        return self.composed_fn(q, k, v, doc_start, self.dc_window, rotary.attn_scale, mix_in, gates["dc_out"])

    def value_embed_gate(self, x, ve):
        """(T, heads) gates in (0, 2), 1 at the start: 2 sigmoid(W g), where g holds the first dims
        of the residual x, or the first half-as-many of x and of the value embedding ve."""
        dims = self.ve_gate.size(1)
        if self.ve_gate_reads_value:
            inputs = torch.cat([x[:, :dims // 2], ve[:, :dims // 2].type_as(x)], dim=-1)
        else:
            inputs = x[:, :dims]
        return 2 * torch.sigmoid(F.linear(inputs, self.ve_gate.type_as(x)))

    def forward(self, x, ve, doc_start, rotary: Rotary, args: AttentionArgs, gates=None):
        """x (T, model_dim) normed; ve: this layer's value embeddings or None; doc_start (T,) bool:
        True where a document (or the slice) starts; gates: this layer's TokenGates or None (its
        "xsa" (T, heads) replace the learned per-head XSA strengths; its "attn" (T, heads) scale
        the heads' outputs; from the dense connections, "ve" (T, heads) replaces the
        value-embedding gate and "v" (T, heads x value width) is added to the values).

        A paired layer runs on the doubled sequence of interleave_head_pairs, two positions per
        token: RoPE, the document offsets and the cache count positions, and the window (in
        positions) spans half as many tokens."""
        T = x.size(0)
        if self.fp8_qkv is not None and self.training:
            qkv = self.fp8_qkv(x.to(torch.bfloat16), self.qkv, self.fp8_state)
        else:
            qkv = F.linear(x, self.qkv.type_as(x))
        if self.sa_lambdas is not None:
            qkv = qkv * self.sa_lambdas[0].type_as(qkv)
        H, qk_rows = self.num_heads, self.num_heads * self.qk_dim
        q, k, v = (t.view(T, H, -1) for t in qkv.split([qk_rows, qk_rows, H * self.v_dim], dim=-1))
        gates = gates or {}
        if ve is not None:
            gate = gates["ve"] if "ve" in gates else self.value_embed_gate(x, ve)
            v = v + gate[..., None] * ve.view_as(v)
        if "v" in gates:
            v = v + gates["v"].view_as(v)
        rows_per_token = 2 if self.paired else 1
        if self.paired:
            q, k, v = (interleave_head_pairs(t) for t in (q, k, v))
        start = args.cache.length * rows_per_token if args.cache is not None else 0
        # The key offset (a key's stationary dims from the previous token: with them one layer can
        # do induction, a query matching token a finding the token after an earlier a) comes with
        # the norm and RoPE; with a cache, after the new keys join the cached ones.
        key_starts = doc_start if self.key_offset and args.cache is None else None
        q, k = self.qk_norm_rope(q, k, *rotary.angles(start, q.size(0)), rotary.stationary, key_starts)
        # Attention takes one dtype, the projection's: CUDA autocast runs the value-embedding sum in fp32.
        q, k, v = (t.to(qkv.dtype) for t in (q, k, v))
        own_values = v
        window = args.long_window if self.long_window else args.short_window
        if args.cache is None:
            y = self.attention_fn(q, k, v, args.cu_seqlens * rows_per_token, window, rotary.attn_scale)
            if self.dc_window:
                y = y + self.composed(q, k, v, kernels.document_bounds(args.cu_seqlens, T)[0], rotary, gates)
        else:
            k, v = args.cache.extend(self, k, v, rows_per_token)  # the cache keeps the keys as computed
            if self.key_offset:
                k = kernels.offset_keys_reference(k, rotary.stationary,
                                                  torch.arange(k.size(0), device=k.device) == 0)
            y = cached_attention(q, k, v, window, rotary.attn_scale)
            if self.dc_window:     # the new tokens are the last T of the cached document: pad in front
                earlier = k.size(0) - T
                padded = {kind: F.pad(gates[kind], (0, 0, earlier, 0)) for kind in ("dc_in", "dc_out")}
                one_document = torch.zeros(k.size(0), dtype=torch.long, device=k.device)
                y = y + self.composed(F.pad(q, (0, 0, 0, 0, earlier, 0)), k, v, one_document, rotary, padded)[earlier:]
        if self.xsa:
            y = remove_self_value(y, own_values, gates["xsa"] if "xsa" in gates else self.xsa_alpha)
        if self.paired:
            y = deinterleave_head_pairs(y)
        if "attn" in gates:
            y = y * gates["attn"].type_as(y)[..., None]
        y = F.linear(y.reshape(T, -1), self.out.type_as(y))
        return y if self.sa_lambdas is None else y * self.sa_lambdas[1].type_as(y)


class MLP(nn.Module):
    """relu(x W_up^T)^2 W_down^T, W_down zero-initialized so each block starts as identity.

    With `fp8_fn` (kernels.fp8_relu2_mlp or its reference) both GEMMs run in FP8 while training,
    with the amax history of the scales in the `fp8_state` buffer; evaluation runs in the
    autocast dtype and leaves that buffer alone.
    """

    def __init__(self, dim, hidden, fp8_fn=None):
        super().__init__()
        self.up = nn.Parameter(torch.empty(hidden, dim))
        self.down = nn.Parameter(torch.zeros(dim, hidden))
        bound = (3 ** 0.5) * 0.5 * dim ** -0.5
        nn.init.uniform_(self.up, -bound, bound)
        self.fp8_fn = fp8_fn
        if fp8_fn is not None:
            self.register_buffer("fp8_state", kernels.new_fp8_mlp_state())

    def forward(self, x):
        if self.fp8_fn is not None and self.training:
            return self.fp8_fn(x.to(torch.bfloat16), self.up, self.down, self.fp8_state)
        return F.linear(F.relu(F.linear(x, self.up.type_as(x))).square(), self.down.type_as(x))


DENSE_SKIP_LAMBDA = -1.5          # dense trunk: the skip's strength is sigmoid of this learned scalar (0.18 at init)
DENSE_SA_LAMBDAS = (0.5, 1.0)      # dense trunk: initial scales of the QKV projection's output and the attention's
DENSE_SUBLAYER_SCALES = (1.1 ** 0.5, 1.0, 1.1 ** 0.5, 1.0)  # dense: initial (residual, output) scales of attention, MLP


class Block(nn.Module):
    """Attention (unless attention-free) and an MLP (or two side by side), each on the normed
    residual. The U-net trunk mixes x0 into the residual first (forward); the dense trunk scales
    the residual and each sublayer's output by learned scalars (forward_dense)."""

    def __init__(self, cfg: ModelConfig, layer, fns, value_embed):
        super().__init__()
        has_attn = layer not in cfg.attention_free_layers
        self.attn = (CausalSelfAttention(cfg, layer, layer in cfg.long_window_layers, value_embed,
                                         layer in cfg.xsa_layers, layer in cfg.paired_head_layers, fns)
                     if has_attn else None)
        self.mlp = MLP(cfg.model_dim, cfg.mlp_hidden, fns.fp8_mlp)
        parallel = layer in cfg.parallel_mlp_layers
        self.parallel_mlp = MLP(cfg.model_dim, cfg.mlp_hidden, fns.fp8_mlp) if parallel else None
        if cfg.trunk == "unet":    # residual mix: x <- lambdas[0] * x + lambdas[1] * x0 before the sublayers
            self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))
        elif layer < cfg.num_layers - 1:  # x <- scales[0] x + scales[1] attention, then [2], [3] for the MLP
            self.scales = nn.Parameter(torch.tensor(DENSE_SUBLAYER_SCALES))  # (the last layer's: DenseConnections)

    def mlps(self, normed):
        if self.parallel_mlp is not None:
            return self.mlp(normed) + self.parallel_mlp(normed)
        return self.mlp(normed)

    def forward(self, x, x0, ve, doc_start, rotary, args, gates=None, bigram=None):
        """gates: this layer's TokenGates or None; with them the attention sublayer is followed by
        the gated injections of x0 and (unless None) of the bigram embedding."""
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), ve, doc_start, rotary, args, gates)
            if gates is not None:
                x = x + gates["x0"] * x0
                if bigram is not None:
                    x = x + gates["bigram"] * bigram
        return x + self.mlps(rms_norm(x))

    def forward_dense(self, x, attn_in, x0, ve, doc_start, rotary, args, gates, bigram, mix=None):
        """The dense trunk's layer: attention reads attn_in (the residual, or a snapshot), then x0
        and the bigram are injected through the token gates; `mix`, the last layer's coefficients
        from the dense connections, replaces the scales and the injections (its x0 is the
        trunk's input)."""
        if self.attn is not None:
            y = self.attn(rms_norm(attn_in), ve, doc_start, rotary, args, gates)
            if mix is not None:
                x = mix["attn_residual"] * x + mix["attn_out"] * y + mix["x0"] * x0 + mix["bigram"] * bigram
            else:
                x = self.scales[0] * x + self.scales[1] * y + gates["x0"] * x0
                if bigram is not None:
                    x = x + gates["bigram"] * bigram
        out = self.mlps(rms_norm(x))
        if mix is not None:
            return mix["mlp_residual"] * x + mix["mlp_out"] * out
        return self.scales[2] * x + self.scales[3] * out


TOKEN_GATE_HIDDEN = 64             # hidden width of the token-gate MLPs
TOKEN_GATE_SCALE = 0.1             # initial output scale: a gate is (W2 gelu(W1 x) + b) * scale, scale learned
TOKEN_GATE_INIT = {"xsa": 0.0, "attn": 0.25, "x0": 0.0, "bigram": 0.05, "skip": 0.5,  # values at init (W2 = 0)
                   "dc_in": 1.0, "dc_out": 0.0}


def token_gate_layout(cfg: ModelConfig):
    """[(layer, kind, width)] of the gates each of the two MLPs makes, in output order: for
    every attention layer before token_gates_split (first MLP) or from it on (second), the
    per-head XSA strengths (on XSA layers), the per-head output gates (on attn_gate_layers),
    the head mixes of composed attention (on dc_layers), then the x0 and bigram injection
    gates. The dense trunk adds the skip's gate, and takes the last layer's injections from its
    dense connections instead."""
    layouts = ([], [])
    dense = cfg.trunk == "dense"
    for layer in range(cfg.num_layers):
        layout = layouts[layer >= cfg.token_gates_split]
        if dense and layer == cfg.skip_layers[1]:
            layout.append((layer, "skip", 1))
        if layer in cfg.attention_free_layers:
            continue
        if layer in cfg.xsa_layers:
            layout.append((layer, "xsa", cfg.num_heads))
        if layer in cfg.attn_gate_layers:
            layout.append((layer, "attn", cfg.num_heads))
        if layer in cfg.dc_layers:
            layout += [(layer, "dc_in", cfg.num_heads), (layer, "dc_out", cfg.num_heads)]
        if not (dense and layer == cfg.num_layers - 1):
            layout += [(layer, "x0", 1), (layer, "bigram", 1)]
    return layouts


class TokenGates(nn.Module):
    """Two small MLPs that make per-token gates for the layers: the first from x0 (the normed
    embedding) for the layers before token_gates_split, the second from the residual entering
    that layer for the rest. Each gate starts at TOKEN_GATE_INIT[kind] for every token (W2 is
    zero, the bias holds the value) and learns to depend on the token. The bigram embedding
    enters the residual through them: before the first attention layer, after the others'
    attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layouts = token_gate_layout(cfg)
        self.first_layer = min(layer for layout in self.layouts for layer, kind, _ in layout  # gets the bigram first
                               if kind == "bigram")
        widths = [sum(width for _, _, width in layout) for layout in self.layouts]
        self.w1 = nn.ParameterList(nn.Parameter(torch.empty(TOKEN_GATE_HIDDEN, cfg.model_dim)) for _ in widths)
        self.w2 = nn.ParameterList(nn.Parameter(torch.zeros(w, TOKEN_GATE_HIDDEN)) for w in widths)
        self.b2 = nn.ParameterList(nn.Parameter(torch.tensor(
            [TOKEN_GATE_INIT[kind] / TOKEN_GATE_SCALE for _, kind, width in layout for _ in range(width)]))
            for layout in self.layouts)
        self.scale = nn.Parameter(torch.tensor(TOKEN_GATE_SCALE))
        for w in self.w1:
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))   # nn.Linear's default init

    def forward(self, which, x):
        """{layer: {kind: (T, width)}} of MLP `which` (0 or 1) on x (T, model_dim)."""
        hidden = F.gelu(F.linear(x, self.w1[which].type_as(x)))
        out = (F.linear(hidden, self.w2[which].type_as(x)) + self.b2[which].type_as(x)) * self.scale.type_as(x)
        gates, start = {}, 0
        for layer, kind, width in self.layouts[which]:
            gates.setdefault(layer, {})[kind] = out[:, start:start + width]
            start += width
        return gates


DENSE_HIDDEN = 64                  # hidden width of the dense-connection MLPs
DENSE_SCALE = 0.1                  # their fixed output scale: coefficients are (W2 gelu(W1 x) + b) * scale
# The last layer's coefficients, in output order, with their values at init (W2 = 0): its values
# take a mix of the trunk's input, the snapshot and the residual; the residual itself is
# recombined from them; its value-embedding gate (one lane per half of the heads); the scales of
# its residual and attention output; the injections of the trunk's input and of the bigram; the
# scales of its residual and MLP output.
LAST_LAYER_MIX = {"v_input": 0.0, "v_snapshot": 0.0, "v_residual": 0.0, "input": 0.0, "snapshot": 0.0,
                  "residual": 0.0, "ve_lane0": 2.0, "ve_lane1": 2.0, "attn_residual": 1.1 ** 0.5, "attn_out": 1.0,
                  "x0": 0.0, "bigram": 0.05, "mlp_residual": 1.1 ** 0.5, "mlp_out": 1.0}
# After the last layer the residual adds these times the trunk's input, the snapshot, the last
# layer's input, the value embedding of the first layer whose values are as wide as the
# residual (none: 0), and the skip's source; the snapshot's -0.5 at init takes half of it back
# out of the prediction.
FINAL_MIX = {"input": 0.0, "snapshot": -0.5, "last_input": 0.0, "value_embed": 0.0, "skip_source": 0.0}


class DenseConnections(nn.Module):
    """Record 89's dense connections (MUDD: per-token coefficients from small MLPs that mix
    earlier layers' states back in): one MLP on the residual entering the last layer makes
    LAST_LAYER_MIX, one on the residual after it makes FINAL_MIX."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.mixes = (LAST_LAYER_MIX, FINAL_MIX)
        self.w1 = nn.ParameterList(nn.Parameter(torch.empty(DENSE_HIDDEN, cfg.model_dim)) for _ in self.mixes)
        self.w2 = nn.ParameterList(nn.Parameter(torch.zeros(len(mix), DENSE_HIDDEN)) for mix in self.mixes)
        self.b2 = nn.ParameterList(nn.Parameter(torch.tensor([v / DENSE_SCALE for v in mix.values()]))
                                   for mix in self.mixes)
        for w in self.w1:
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))   # nn.Linear's default init

    def forward(self, which, x):
        """{name: (T, 1)} of mix `which` (0: the last layer's, 1: the final one) on x (T, model_dim)."""
        hidden = F.gelu(F.linear(x, self.w1[which].type_as(x)))
        out = (F.linear(hidden, self.w2[which].type_as(x)) + self.b2[which].type_as(x)) * DENSE_SCALE
        return dict(zip(self.mixes[which], out.split(1, dim=-1)))


def document_starts(context):
    """Whether each token starts a document: BOS, or the first token of the slice (whose
    predecessor, if any, is not known)."""
    return torch.cat([context.new_ones(1, dtype=torch.bool), context[1:] == BOS_ID])


def previous_tokens(tokens, is_doc_start):
    """Each token's predecessor in its document; BOS for a document's first token, whose real
    predecessor (another document's last token, or nothing) it must not see."""
    return torch.where(is_doc_start, BOS_ID, torch.roll(tokens, 1))


def bigram_rows(tokens, is_doc_start, rows):
    """Hash (previous, current) token pairs to table rows; a document's first token gets the last row."""
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    row = ((BIGRAM_MULT_CUR * cur) ^ (BIGRAM_MULT_PREV * prev)) % (rows - 1)
    return torch.where(is_doc_start, rows - 1, row)


def bigram_sign_rows(tokens, is_doc_start):
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    return ((SIGN_MULT_CUR * cur) ^ (SIGN_MULT_PREV * prev)) % SIGN_ROWS


def two_tokens_back(tokens, is_doc_start):
    """(the token two positions back in its document, BOS where there is none; whether the
    token is one of its document's first two, which have no trigram)."""
    after_start = torch.cat([is_doc_start.new_zeros(1), is_doc_start[:-1]])  # the token before starts a document
    first_two = is_doc_start | after_start
    return torch.where(first_two, BOS_ID, torch.roll(tokens, 2)), first_two


def ngram_rows(tokens, is_doc_start, rows):
    """(T, 2) rows of the n-gram table: each token's bigram row in [0, rows/2) (bigram_rows of
    that half: a document's first token takes its last row) and its trigram row in
    [rows/2, rows), where a document's first two tokens take the last row."""
    half = rows // 2
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    prev2, first_two = two_tokens_back(tokens, is_doc_start)
    trigram = ((TRIGRAM_MULT_CUR * cur) ^ (TRIGRAM_MULT_PREV * prev) ^ (TRIGRAM_MULT_PREV2 * prev2.long())) \
        % (rows - half - 1)
    return torch.stack([bigram_rows(tokens, is_doc_start, half), torch.where(first_two, rows - 1, trigram + half)],
                       dim=1)


def trigram_sign_rows(tokens, is_doc_start):
    cur, prev = tokens.long(), previous_tokens(tokens, is_doc_start).long()
    prev2 = two_tokens_back(tokens, is_doc_start)[0].long()
    a, b, c = TRIGRAM_SIGN_MULTS
    return ((a * cur) ^ (b * prev) ^ (c * prev2)) % SIGN_ROWS


@dataclass(frozen=True)
class TablePlacement:
    """Where the n-gram table's rows live: this process's share (shard of shards), on the device,
    or (cache_rows > 0, one process) in host memory with that many rows cached on the device.
    The table and its cache are made on `device` directly, not copied there: they can be most of it."""
    shard: int = 0
    shards: int = 1
    cache_rows: int = 0
    device: torch.device = torch.device("cpu")


class NgramTable(nn.Module):
    """The hashed bigram+trigram embedding: one table of `rows` x dim, bigram rows in the first
    half and trigram rows in the second, zero at the start. A token's output is its bigram row
    times a sign row plus its trigram row times another (the sign trick: tokens that share a
    hashed row see it with different signs in each dim).

    The table is a buffer, not a parameter: no dense gradient or optimizer state of its size
    exists. In training the gathered rows add `sink[:T]` (zeros), so the backward leaves each
    token's two row gradients in sink.grad[:T] (T, 2, dim), the entries the trainer hands to
    optim.SparseRowAdam with the rows they belong to (`rows_of`). (The trainer cuts the sink to T
    rows while it trains, GPT.sinks_of: then the sink is added whole.)

    Where the rows live (TablePlacement): all in `table` on the device; or split across
    processes, this one holding rows [first_row, first_row + rows / shards) in `table`; or in
    `table` in host memory (which .to(device) leaves there), with `fetched` a device cache of
    cache_rows of them. Split or on the host, a forward reads each token's two rows from
    `fetched` at `slots` (T, 2), which the trainer fills before the forward (ShardedNgramRows,
    HostNgramRows)."""

    def __init__(self, rows, dim, max_tokens, dtype=torch.float32, placement=None):
        super().__init__()
        placement = placement or TablePlacement()
        self.rows, self.on_host = rows, placement.cache_rows > 0
        self.gathered = placement.shards > 1 or self.on_host
        self.first_row = placement.shard * (rows // placement.shards)
        device = placement.device
        table = (torch.zeros(rows, dim, dtype=dtype, pin_memory=torch.cuda.is_available()) if self.on_host else
                 torch.zeros(rows // placement.shards, dim, dtype=dtype, device=device))
        self.register_buffer("table", table)
        self.sink = nn.Parameter(torch.zeros(max_tokens, 2, dim))
        if self.gathered:          # split: a slice's distinct rows; on the host: the cache
            fetched = placement.cache_rows or 2 * max_tokens
            self.register_buffer("fetched", torch.zeros(fetched, dim, dtype=dtype, device=device), persistent=False)
            self.register_buffer("slots", torch.zeros(max_tokens, 2, dtype=torch.int64), persistent=False)

    def _apply(self, fn, recurse=True):
        """Module.to() and friends, but a table in host memory stays there."""
        if not self.on_host:
            return super()._apply(fn, recurse)
        table = self._buffers.pop("table")
        try:
            return super()._apply(fn, recurse)
        finally:
            self._buffers["table"] = table

    def rows_of(self, context, is_start):
        return ngram_rows(context, is_start, self.rows)

    def slice_rows(self, tokens):
        """The (2T,) rows of a slice's tokens (T,): each token's bigram row, then its trigram row."""
        return self.rows_of(tokens, document_starts(tokens)).reshape(-1)

    def forward(self, context, is_start, seen, signs, lookup=False):
        """(T, dim) for the last T = len(context) - seen tokens of `context`; with `lookup` (a
        generation step) the rows are read from `table` even if the trainer fetches them."""
        count = context.shape[0] - seen
        if self.gathered and not lookup:
            entries = self.fetched[self.slots[:count]]
        else:
            rows = self.rows_of(context, is_start)[seen:]
            entries = self.table[rows.to(self.table.device)].to(context.device)
        if self.training:
            entries = entries + first_rows(self.sink, count)
        sign = torch.stack([signs[bigram_sign_rows(context, is_start)[seen:]],
                            signs[trigram_sign_rows(context, is_start)[seen:]]], dim=1)
        return (entries * sign).sum(1)


def first_rows(t, n):
    """t[:n], or t itself when it has n rows: a slice's backward makes a zero-filled gradient of
    all of t's rows."""
    return t if t.shape[0] == n else t[:n]


def head_dims(cfg: ModelConfig, layer):
    """(query and key, value) widths per head of a layer's attention."""
    return (cfg.narrow_qk_dim if layer in cfg.narrow_qk_layers else cfg.head_dim,
            cfg.narrow_vo_dim if layer in cfg.narrow_vo_layers else cfg.head_dim)


def value_embed_tables(cfg: ModelConfig):
    """{layer: its value-embedding table}: with value_embed_layers, table i serves the i-th layer
    listed; otherwise table i serves layer i and layer num_layers - num_value_embeds + i."""
    if cfg.value_embed_layers:
        return {layer: i for i, layer in enumerate(cfg.value_embed_layers)}
    n, tables = cfg.num_layers, cfg.num_value_embeds
    return {**{i: i for i in range(tables)}, **{n - tables + i: i for i in range(tables)}}


class GPT(nn.Module):
    """The speedrun GPT on a packed stream of documents.

    Embedding (+ smear gate) -> RMS norm -> the blocks, in a U-net trunk (unet_trunk) or record
    89's dense one (dense_trunk), with the bigram hash embedding (sign trick) added to the
    embedding or let in through per-token gates -> RMS norm -> lm_head (tied to the embedding
    until `untie`) -> softcapped
    cross-entropy over all or a sampled subset of vocabulary columns, with multi-token and
    prefix targets. max_tokens: the longest slice a forward pass will see (RoPE's table).
    placement: where the n-gram table's rows live (TablePlacement).
    """

    def __init__(self, cfg: ModelConfig, fns: "KernelFns", max_tokens: int, placement: TablePlacement = None):
        super().__init__()
        self.cross_entropy_fn = fns.cross_entropy
        self.embed = nn.Embedding(PADDED_VOCAB_SIZE, cfg.model_dim)
        nn.init.normal_(self.embed.weight, std=cfg.embed_init_std or cfg.model_dim ** -0.5)
        self.lm_head = nn.Parameter(torch.zeros(PADDED_VOCAB_SIZE, cfg.model_dim))
        self.tied = True
        self.fp8_head = fns.fp8_head   # in training, the head runs in FP8 with its state in head_fp8_state
        if fns.fp8_head is not None:
            self.register_buffer("head_fp8_state", kernels.new_fp8_linear_state())
        self.fp8_loss_unit = 1.0
        if cfg.smear_gate:         # both zero: the smear starts off, and its strength learns first
            self.smear_gate = nn.Parameter(torch.zeros(1, SMEAR_GATE_DIMS))
            self.smear_lambda = nn.Parameter(torch.zeros(()))
        else:
            self.smear_gate = None
        if cfg.ngram_rows:
            self.bigram, self.ngram = None, NgramTable(cfg.ngram_rows, cfg.model_dim, max_tokens,
                                                       getattr(torch, cfg.ngram_dtype), placement)
        else:
            self.bigram, self.ngram = nn.Embedding(cfg.bigram_rows, cfg.model_dim), None
            nn.init.zeros_(self.bigram.weight)
        signs = torch.randint(0, 2, (SIGN_ROWS, cfg.model_dim),
                              generator=torch.Generator().manual_seed(SIGN_TABLE_SEED)) * 2 - 1
        self.register_buffer("signs", signs.float(), persistent=False)
        self.value_embed_layer = value_embed_tables(cfg)
        value_widths = {table: cfg.num_heads * head_dims(cfg, layer)[1] for layer, table in
                        sorted(self.value_embed_layer.items())}
        self.value_embeds = nn.ModuleList(nn.Embedding(PADDED_VOCAB_SIZE, value_widths[table])
                                          for table in sorted(value_widths))
        for ve in self.value_embeds:
            nn.init.normal_(ve.weight, std=0.01)
        self.value_sinks = None
        if cfg.value_embed_sparse:  # as the n-gram table: a sink takes each token's gradient, sparse Adam the rest
            for ve in self.value_embeds:
                ve.weight.requires_grad_(False)
            self.value_sinks = nn.ParameterList(nn.Parameter(torch.zeros(max_tokens, ve.embedding_dim))
                                                for ve in self.value_embeds)
        n = cfg.num_layers
        self.blocks = nn.ModuleList(Block(cfg, i, fns, i in self.value_embed_layer) for i in range(n))
        self.trunk = cfg.trunk
        if cfg.trunk == "unet":
            self.num_skips = n // 2
            self.skip_weights = nn.Parameter(torch.ones(self.num_skips))
        else:
            self.dense = DenseConnections(cfg)
            self.skip_layers, self.snapshot_layer = tuple(cfg.skip_layers), cfg.snapshot_layer
            self.skip_lambda = nn.Parameter(torch.tensor(DENSE_SKIP_LAMBDA))
            wide = [layer for layer in sorted(self.value_embed_layer)     # value embeddings the final mix can add
                    if cfg.num_heads * head_dims(cfg, layer)[1] == cfg.model_dim]
            self.final_value_embed_layer = wide[0] if wide else None
        self.token_gates = TokenGates(cfg) if cfg.token_gates else None
        self.token_gates_split = cfg.token_gates_split
        self.max_tokens = max_tokens
        positions = max_tokens * (2 if cfg.paired_head_layers else 1)   # a paired layer: two per token
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, positions, cfg.attn_scale, cfg.yarn_scale_growth)
        self.narrow_rotary = (Rotary(cfg.narrow_qk_dim, cfg.rope_base, positions, cfg.narrow_qk_attn_scale,
                                     cfg.yarn_scale_growth, rotate_all=True) if cfg.narrow_qk_layers else None)
        self.register_buffer("prefix_table", torch.from_numpy(prefix_token_table()).long(), persistent=False)
        self.canonical_mask = NoncanonicalPairs() if cfg.canonical_mask else None

    def num_parameters(self):
        """Trained values: the parameters (but the gradient sinks) and the n-gram table."""
        sinks = self.gradient_sinks()
        table = self.ngram.rows * self.ngram.table.shape[1] if self.ngram is not None else 0
        return sum(p.numel() for p in self.parameters() if all(p is not s for s in sinks)) + table

    def gradient_sinks(self):
        """The zero parameters whose gradients are the sparse tables' per-token gradients."""
        return ([self.ngram.sink] if self.ngram is not None else []) + list(self.value_sinks or [])

    @contextlib.contextmanager
    def sinks_of(self, count):
        """The gradient sinks cut to their first `count` rows, values and gradients alike (views
        of the whole ones, at fixed addresses), while micro-batches of `count` tokens run: their
        backward then adds a gradient of `count` rows into each sink's, not a zero-filled one of
        max_tokens rows. Between uses each sink is whole, with its whole gradient (made, zero,
        on the first use)."""
        sinks = self.gradient_sinks()
        whole = [(s.data, torch.zeros_like(s) if s.grad is None else s.grad) for s in sinks]
        for s, (value, grad) in zip(sinks, whole):
            s.data, s.grad = value[:count], grad[:count]
        try:
            yield
        finally:
            for s, (value, grad) in zip(sinks, whole):
                s.data, s.grad = value, grad

    def set_windows(self, long_windows):
        """RoPE tables and attention scales after the long window grew through `long_windows`."""
        for rotary in (self.rotary, self.narrow_rotary):
            if rotary is not None:
                rotary.set_windows(long_windows)

    def untie(self):
        """From now on lm_head is its own parameter, starting from the embedding's values."""
        with torch.no_grad():
            self.lm_head.copy_(self.embed.weight)
        self.tied = False

    def tie(self):
        """Use the embedding as the head again (lm_head's values are then unused)."""
        self.tied = True

    def head_weight(self):
        return self.embed.weight if self.tied else self.lm_head

    def head(self, x, weight):
        """Logits of the normed x over the rows of `weight` (the head, or its candidate rows)."""
        if self.fp8_head is not None and self.training:
            return self.fp8_head(x.to(torch.bfloat16), weight, self.head_fp8_state)
        return F.linear(x, weight.type_as(x))

    def set_fp8_loss_unit(self, unit):
        """Tell the FP8 layers the weight the objective gives one token's loss (their static
        gradient scales are the summed loss's). Writes the devices' state only when it changes."""
        if unit != self.fp8_loss_unit:
            for name, state in self.named_buffers():
                if name.endswith("fp8_state"):
                    kernels.set_fp8_loss_unit(state, unit)
            self.fp8_loss_unit = unit

    def smear(self, x, doc_start):
        """x[t] + lambda * sigmoid(w . x[t, :SMEAR_GATE_DIMS]) * x[t-1]: each token embedding takes a
        share of its predecessor's, gated by the token itself; a document's first token takes none."""
        gate = self.smear_lambda * torch.sigmoid(F.linear(x[:, :SMEAR_GATE_DIMS], self.smear_gate.type_as(x)))
        return x + torch.where(doc_start[:, None], 0.0, gate * torch.roll(x, 1, dims=0))

    def hidden_states(self, tokens, args: AttentionArgs):
        # With a cache the tokens continue its document: the bigram and trigram (and the smear) of
        # the first ones need the cache's last two tokens. A slice may begin inside a document: its
        # first token has no known predecessor either.
        cache = args.cache
        context = tokens if cache is None or cache.length == 0 else torch.cat([cache.last_tokens, tokens])
        seen = context.size(0) - tokens.size(0)
        is_start = document_starts(context)
        doc_start = is_start[seen:]
        if self.smear_gate is None:
            x = self.embed(tokens)
        else:
            x = self.smear(self.embed(context), is_start)[seen:]
        if self.ngram is not None:
            bigram = self.ngram(context, is_start, seen, self.signs, lookup=cache is not None)
        else:
            bigram = self.bigram(bigram_rows(context, is_start, self.bigram.num_embeddings)[seen:])
            bigram = bigram * self.signs[bigram_sign_rows(context, is_start)[seen:]]
        ves = self.value_embeddings(tokens)
        if self.trunk == "dense":
            x = self.dense_trunk(rms_norm(x), bigram, ves, doc_start, args)
        elif self.token_gates is None:   # the bigram joins the embedding once, before the norm
            x = self.unet_trunk(rms_norm(x + bigram), None, ves, doc_start, args)
        else:                            # or enters through the token gates
            x = self.unet_trunk(rms_norm(x), bigram, ves, doc_start, args)
        if cache is not None:
            cache.advance(tokens)
        return rms_norm(x)

    def value_embeddings(self, tokens):
        """Each value-embedding table's rows of `tokens`; sparse and in training, plus its sink."""
        ves = [ve(tokens) for ve in self.value_embeds]
        if self.value_sinks is not None and self.training:
            ves = [v + first_rows(sink, tokens.shape[0]) for v, sink in zip(ves, self.value_sinks)]
        return ves

    def layer_inputs(self, i, ves):
        """(value embeddings or None, rotary) of layer i."""
        block = self.blocks[i]
        narrow = block.attn is not None and block.attn.narrow_qk
        return (ves[self.value_embed_layer[i]] if i in self.value_embed_layer else None,
                self.narrow_rotary if narrow else self.rotary)

    def unet_trunk(self, x0, bigram, ves, doc_start, args):
        """U-net: the first half's outputs are added, with learned weights, to the second half's
        inputs; x0 is mixed into every block. With token gates, the bigram (otherwise already in
        x0) enters before the first gated layer and after the later ones' attention."""
        x, gates, skips = x0, {}, []
        if self.token_gates is not None:
            gates = self.token_gates(0, x0)
        for i, block in enumerate(self.blocks):
            j = i - (len(self.blocks) - self.num_skips)
            if j >= 0:
                x = x + self.skip_weights[j] * skips.pop()
            if self.token_gates is not None and i == self.token_gates_split:
                gates.update(self.token_gates(1, x))
            first = self.token_gates is not None and i == self.token_gates.first_layer
            if first:
                x = x + gates[i]["bigram"] * bigram
            ve, rotary = self.layer_inputs(i, ves)
            x = block(x, x0, ve, doc_start, rotary, args, gates.get(i), None if first else bigram)
            if i < self.num_skips:
                skips.append(x)
        return x

    def dense_trunk(self, x0, bigram, ves, doc_start, args):
        """Record 89's trunk: the bigram enters through the token gates (before the first layer,
        then after each attention); the attention-free layer skip_layers[1] adds a gated copy of
        layer skip_layers[0]'s output; the layers after snapshot_layer read its output as their
        attention input; the last layer's mixes and a final mix of earlier states come from the
        dense connections."""
        gates = self.token_gates(0, x0)
        x = x0 + gates[self.token_gates.first_layer]["bigram"] * bigram
        saved = {"input": x}
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            if i == self.token_gates_split:
                gates.update(self.token_gates(1, x))
            ve, rotary = self.layer_inputs(i, ves)
            attn_in = saved["snapshot"] if i > self.snapshot_layer else x
            if i == self.skip_layers[1]:
                x = x + torch.sigmoid(self.skip_lambda) * gates[i]["skip"] * saved["skip_source"]
            if i < last:
                first = i == self.token_gates.first_layer
                x = block.forward_dense(x, attn_in, x0, ve, doc_start, rotary, args, gates.get(i),
                                        None if first else bigram)
            else:
                saved["last_input"] = x
                mix = self.dense(0, x)
                layer_gates = dict(gates.get(i, {}))
                layer_gates["v"] = mix["v_input"] * saved["input"] + mix["v_snapshot"] * saved["snapshot"] \
                    + mix["v_residual"] * x
                if ve is not None:         # one gate lane per half of the heads
                    lanes = torch.cat([mix["ve_lane0"], mix["ve_lane1"]], dim=-1)
                    layer_gates["ve"] = lanes.repeat_interleave(block.attn.num_heads // 2, dim=-1)
                x = (1 + mix["residual"]) * x + mix["input"] * saved["input"] + mix["snapshot"] * saved["snapshot"]
                x = block.forward_dense(x, attn_in, saved["input"], ve, doc_start, rotary, args, layer_gates, bigram,
                                        mix)
            if i == self.skip_layers[0]:
                saved["skip_source"] = x
            if i == self.snapshot_layer:
                saved["snapshot"] = x
        final = self.dense(1, x)
        layer = self.final_value_embed_layer
        first_ve = ves[self.value_embed_layer[layer]] if layer is not None else 0.0
        return (x + final["input"] * saved["input"] + final["snapshot"] * saved["snapshot"]
                + final["last_input"] * saved["last_input"] + final["value_embed"] * first_ve
                + final["skip_source"] * saved["skip_source"])

    def forward(self, tokens, targets, args: AttentionArgs, target_weights, columns=None):
        """(objective, next-token loss): the means over tokens of the weighted cross-entropy that
        training minimizes and of the plain next-token loss (not differentiable, for logging; over
        the candidate columns with sampled softmax). targets: (T, K) vocab ids, -1 = none.

        columns: sorted candidate vocabulary ids (sampled softmax) or None (full vocabulary).
        target_weights: (K + 1,) weights of the K token targets and of the prefix target.
        """
        x = self.hidden_states(tokens, args)
        prefix = torch.where(targets[:, :1] >= 0, self.prefix_table[targets[:, :1].clamp(min=0)], -1)
        all_targets = torch.cat([targets, prefix], dim=1)
        weight = self.head_weight()
        if columns is not None:
            weight = weight[columns]
            all_targets = ids_to_columns(all_targets, columns)
        objective, next_token = self.cross_entropy_fn(self.head(x, weight), all_targets, target_weights)
        return objective.mean(), next_token.mean()

    @torch.no_grad()
    def validation_loss_sum(self, tokens, targets, args: AttentionArgs, chunk_rows=4096):
        """Sum over tokens of the full-vocabulary next-token loss (never a sampled subset)."""
        x = self.hidden_states(tokens, args)
        weight = self.head_weight().type_as(x)
        total = x.new_zeros((), dtype=torch.float32)
        one = torch.ones(1, device=x.device)
        for s in range(0, x.size(0), chunk_rows):
            logits = F.linear(x[s:s + chunk_rows], weight)
            if self.canonical_mask is None:
                total += self.cross_entropy_fn(logits, targets[s:s + chunk_rows, :1], one)[0].sum()
            else:
                total += self.canonical_mask.cross_entropy_sum(logits, tokens[s:s + chunk_rows],
                                                               targets[s:s + chunk_rows, 0])
        return total


    @torch.no_grad()
    def next_token_logits(self, tokens, args: AttentionArgs):
        """Softcapped fp32 logits over the GPT-2 vocabulary (the padding columns left out) of the
        token that follows `tokens`: what sampling draws from."""
        x = self.hidden_states(tokens, args)[-1:]
        return kernels.softcap(F.linear(x, self.head_weight().type_as(x)))[0, :VOCAB_SIZE]


def model_config(h: Hyperparameters) -> ModelConfig:
    """The model's part of a run config."""
    return ModelConfig(**{name: getattr(h, name) for name in MODEL_FIELDS})


def max_positions(h: Hyperparameters):
    """The longest slice a forward pass of the run sees, in training or validation."""
    return max(max(s.tokens_per_rank for s in h.stages), h.val_tokens_per_rank)


def build_model(h: Hyperparameters, fns: "KernelFns", placement: TablePlacement = None):
    return GPT(model_config(h), fns, max_positions(h), placement)


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


def ids_to_columns(ids, columns):
    """Map vocab ids to their index in the sorted `columns`; ids not among them become -1."""
    pos = torch.searchsorted(columns, ids.clamp(min=0)).clamp(max=columns.numel() - 1)
    return torch.where((ids >= 0) & (columns[pos] == ids), pos, -1)


CANDIDATE_STRIDE = 20011           # coprime to 50304: k -> k * stride mod V visits every id once
CANDIDATE_STRIDE_INVERSE = pow(CANDIDATE_STRIDE, -1, PADDED_VOCAB_SIZE)  # id -> its position k in the walk
CANDIDATE_OFFSET_MULT = 7919       # spreads the walk's starting point across steps and slices
CANDIDATE_SLICES_PER_STEP = 8191   # more than any step's slice count: (step, slice) -> distinct seeds


def candidate_offset(step, slice_index):
    """Where the candidate walk of micro-batch `slice_index` of `step` starts."""
    return ((step * CANDIDATE_SLICES_PER_STEP + slice_index) * CANDIDATE_OFFSET_MULT) % PADDED_VOCAB_SIZE


def candidate_columns(targets, count, offset):
    """Sampled-softmax candidates: `count` sorted vocabulary ids, every distinct target id of the
    batch plus deterministic uniform negatives.

    Negatives are the first non-target ids of the walk k -> (k * CANDIDATE_STRIDE + offset) mod V,
    offset = candidate_offset(step, slice), an int or a 0-d int64 tensor on targets' device (a
    captured step reads it from a buffer). Each id gets a priority, its position in the walk,
    raised by V for non-targets; the `count` lowest win. The size is fixed, so the step needs no
    host sync: if a batch ever had more than `count` distinct targets, those latest in the walk
    would be left out of its softmax.
    """
    V = PADDED_VOCAB_SIZE
    ids = torch.arange(V, device=targets.device)
    walk_position = ((ids - offset) * CANDIDATE_STRIDE_INVERSE) % V
    present = torch.where(targets >= 0, targets, V).flatten()      # absent targets land on a spare slot
    is_target = torch.zeros(V + 1, dtype=torch.bool, device=targets.device).index_fill_(0, present, True)[:V]
    priority = walk_position + V * (~is_target)
    return priority.topk(count, largest=False, sorted=False).indices.sort().values


# -----------------------------------------------------------------------------------------------
# Data
# -----------------------------------------------------------------------------------------------

class DataError(Exception):
    """Missing, corrupt or too-small data: the message names the file and what to do."""


@dataclass
class Slice:
    """One rank's packed micro-batch: T tokens, their targets and document offsets."""
    tokens: torch.Tensor           # (T,) int32
    targets: torch.Tensor          # (T, MAX_TARGETS - 1) int64 vocab ids of t+1, t+2, ...; -1 = none
    cu_seqlens: torch.Tensor       # (T // MIN_DOC_TOKENS + 2,) int32, padded by repeating T
    route: object = None           # a split n-gram table: its Route, worked out ahead (BatchPrefetcher)

    def pinned(self):
        """The same slice in page-locked memory, so that copies to the GPU need not wait."""
        return dataclasses.replace(self, **{name: getattr(self, name).pin_memory()
                                            for name in ("tokens", "targets", "cu_seqlens")})

    def to(self, device):
        """The slice on `device`; from pinned memory the copies are queued, not waited for."""
        if device.type == "cpu":
            return self
        return Slice(*(t.to(device, non_blocking=True) for t in (self.tokens, self.targets, self.cu_seqlens)))


MIN_DOC_TOKENS = 16                # cu_seqlens has room for T / MIN_DOC_TOKENS documents per slice


def check_token_ids(tokens, path, offset=0):
    """Refuse a shard holding ids outside GPT-2's vocabulary, naming the file and the first one."""
    bad = np.flatnonzero(tokens >= VOCAB_SIZE)
    if bad.size:
        raise DataError(f"{path}: token {offset + int(bad[0])} is {int(tokens[bad[0]])}, outside GPT-2's vocabulary "
                        f"(ids 0..{VOCAB_SIZE - 1}): the shard was not made with the GPT-2 tokenizer; rebuild it")


def _load_shard(path):
    tokens = np.asarray(read_shard(path))
    check_token_ids(tokens, path)
    bos = np.flatnonzero(tokens == BOS_ID)
    if bos.size == 0:
        raise DataError(f"{path}: no <|endoftext|> ({BOS_ID}) token, so no document starts in it; "
                        f"every document must begin with one: rebuild the shard")
    return tokens, bos


def _targets(stream, starts, lengths, ends, num_targets):
    """targets[i, k] = stream[p + k + 1] for token p when p + k + 1 <= its document's end, else -1."""
    pos = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
    doc_end = np.repeat(ends, lengths)
    out = np.full((pos.size, num_targets), -1, dtype=np.int64)
    for k in range(num_targets):
        p = pos + k + 1
        ok = (p <= doc_end) & (p < stream.size)
        out[ok, k] = stream[p[ok]]
    return out


def _packed_tokens(pieces, T):
    """The (T,) int32 tokens _pack makes of the pieces, without their targets."""
    tokens = np.concatenate([stream[start:start + length] for stream, start, length, _ in pieces]).astype(np.int32)
    return torch.from_numpy(np.concatenate([tokens, np.full(T - tokens.size, BOS_ID, dtype=np.int32)]))


def _pack(pieces, T):
    """Concatenate (stream, start, length, doc_end) pieces into one Slice of exactly T tokens."""
    tokens, targets, cu = [], [], [0]
    for stream, start, length, end in pieces:
        tokens.append(stream[start:start + length].astype(np.int32))
        targets.append(_targets(stream, [start], [length], [end], MAX_TARGETS - 1))
        cu.append(cu[-1] + length)
    filled = cu[-1]
    if filled < T:                 # too many tiny documents: pad with loss-free BOS tokens
        tokens.append(np.full(T - filled, BOS_ID, dtype=np.int32))
        targets.append(np.full((T - filled, MAX_TARGETS - 1), -1, dtype=np.int64))
        cu.append(T)
    width = T // MIN_DOC_TOKENS + 2
    cu = np.array(cu + [T] * (width - len(cu)), dtype=np.int32)
    return Slice(torch.from_numpy(np.concatenate(tokens)), torch.from_numpy(np.concatenate(targets)),
                 torch.from_numpy(cu))


class TrainLoader:
    """BOS-aligned packed batches from the train shards, cycling through them.

    Each global batch is `num_slices` consecutive slices of T tokens; a slice is whole documents,
    each starting at a BOS and cut at `max_doc_len` tokens (the rest of a cut document is skipped),
    the last one cut to fit. Every process walks the same stream and builds only its own slices.
    The next shard is read in a background thread while the current one is used.
    """

    def __init__(self, files, batch_tokens):
        total = sum(read_shard(f).size for f in files)
        if total < batch_tokens:
            raise DataError(f"the train files ({', '.join(files)}) hold {total} tokens, fewer than one "
                            f"global batch needs ({batch_tokens}): add shards or lower tokens_per_rank")
        self.files = files
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.next_file = 0
        self.future = self._prefetch()
        self._advance_shard()

    def _prefetch(self):
        path = self.files[self.next_file % len(self.files)]
        self.next_file += 1
        return self.pool.submit(_load_shard, path)

    def _advance_shard(self):
        self.stream, self.bos = self.future.result()
        self.future = self._prefetch()
        self.doc = 0               # index into self.bos of the next document to use

    def _next_piece(self, max_len):
        while self.doc >= len(self.bos):
            self._advance_shard()
        start = int(self.bos[self.doc])
        end = int(self.bos[self.doc + 1]) if self.doc + 1 < len(self.bos) else self.stream.size
        self.doc += 1
        return self.stream, start, min(end - start, max_len), end

    def next_batch(self, T, max_doc_len, num_slices, mine, every_tokens=False):
        """The slices with indices in `mine` of the next global batch of num_slices slices; with
        every_tokens, also the tokens (T,) of each of its slices, in order (a list)."""
        out, tokens = [], []
        for i in range(num_slices):
            pieces, filled = [], 0
            while filled < T and len(pieces) < T // MIN_DOC_TOKENS:
                stream, start, length, end = self._next_piece(min(max_doc_len, T - filled))
                pieces.append((stream, start, length, end))
                filled += length
            if i in mine:
                out.append(_pack(pieces, T))
            if every_tokens:
                tokens.append(out[-1].tokens if i in mine else _packed_tokens(pieces, T))
        return (out, tokens) if every_tokens else out


class BatchPrefetcher:
    """The slices of each step's batch, built in a background thread one step ahead.

    The loader reads, packs and (for a GPU) pins the next step's slices while the current step
    runs, so the training loop only queues their copies. With a split n-gram table (`router`, its
    ShardedNgramRows) the thread also packs the tokens of every process's slices of the step, all
    processes' loaders being the same, and works out each of this process's slices' Route from
    them: the loop then only moves the rows, with no gather of the tokens and no hashing on its
    way. Steps must be asked for in order.
    """

    def __init__(self, loader, h, mine, pin, router=None):
        self.loader, self.h, self.mine, self.pin, self.router = loader, h, mine, pin, router
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.step, self.future = 0, self.pool.submit(self._build, 0)

    def _build(self, step):
        stage, h = self.h.stages[stage_index(self.h, step)], self.h
        if self.router is None:
            slices = self.loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, self.mine)
        else:                      # micro-batch j of process p is slice p + j * processes
            slices, tokens = self.loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks,
                                                    self.mine, every_tokens=True)
            world = self.router.env.world_size
            slices = [dataclasses.replace(s, route=self.router.route_of(
                s.tokens, [tokens[i - i % world + p] for p in range(world)])) for i, s in zip(self.mine, slices)]
        return [s.pinned() for s in slices] if self.pin else slices

    def peek(self):
        """The slices of the step after the last one got (waiting for them to be built)."""
        return self.future.result()

    def get(self, step):
        if step != self.step:
            raise ValueError(f"batches are built in order: asked for step {step}, next is {self.step}")
        slices = self.future.result()
        self.step, self.future = step + 1, self.pool.submit(self._build, step + 1)
        return slices

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


def validation_slices(files, val_tokens, T, num_slices, mine):
    """The first val_tokens tokens of the val stream, cut into num_slices slices of T tokens.

    Slices are plain windows of the stream (a document may start before a slice); documents
    inside a slice are separated by their BOS tokens.
    """
    needed, parts = val_tokens + 1, []
    for f in files:                # only the leading tokens: a FineWeb val shard holds 100M
        parts.append(np.asarray(read_shard(f)[:needed]))
        check_token_ids(parts[-1], f)
        needed -= parts[-1].size
        if needed <= 0:
            break
    stream = np.concatenate(parts)
    if needed > 0:
        raise DataError(f"the val files {files} hold {stream.size} tokens but val_tokens={val_tokens} "
                        f"needs {val_tokens + 1}: lower --val_tokens or use a bigger val shard")
    out = []
    for i in mine:
        s = i * T
        bos = np.flatnonzero(stream[s:s + T] == BOS_ID) + s
        starts = np.unique(np.concatenate([[s], bos]))
        ends = np.append(starts[1:], s + T)
        pieces = [(stream, a, b - a, b) for a, b in zip(starts, ends)]
        out.append(_pack(pieces, T))
    return out


# -----------------------------------------------------------------------------------------------
# Schedules
# -----------------------------------------------------------------------------------------------

def batch_tokens(h):
    """Tokens in the largest global batch of the run."""
    return max(s.tokens_per_rank for s in h.stages) * h.batch_ranks


FINEWEB_SHARD_TOKENS = 100_000_000  # tokens per FineWeb train shard
CUT_DOCUMENT_MARGIN = 1.5          # documents cut at max_doc_len waste tokens: fetch this much more


def train_shards_needed(h):
    """FineWeb train shards a run reads, with room for the tokens skipped by document cuts."""
    tokens = sum(s.tokens_per_rank * steps for s, steps in zip(h.stages, steps_per_stage(h)))
    return math.ceil(tokens * h.batch_ranks * CUT_DOCUMENT_MARGIN / FINEWEB_SHARD_TOKENS)


def steps_per_stage(h):
    """How many of the num_iterations steps fall in each stage (stage_index's boundaries)."""
    N, firsts = h.num_iterations, [0]
    for s in h.stages[:-1]:        # the first step with step / N >= end, exactly as stage_index decides
        first = min(math.ceil(s.end * N), N)
        while first > 0 and (first - 1) / N >= s.end:
            first -= 1
        while first < N and first / N < s.end:
            first += 1
        firsts.append(max(first, firsts[-1]))
    return [b - a for a, b in zip(firsts, firsts[1:] + [N])]


def stage_index(h, step):
    frac = step / h.num_iterations
    return next((i for i, s in enumerate(h.stages) if frac < s.end), len(h.stages) - 1)


def lr_multiplier(h, step):
    """The stage's multiplier until cooldown_start, then linearly from it to cooldown_floor at
    cooldown_end (fractions of training), then the floor."""
    frac, mult = step / h.num_iterations, h.stages[stage_index(h, step)].lr_mult
    if frac < h.cooldown_start:
        return mult
    t = min((frac - h.cooldown_start) / (h.cooldown_end - h.cooldown_start), 1.0)
    return mult + (h.cooldown_floor - mult) * t


def rise_hold_fall(x, low, high, rise, fall, end=1.0):
    """The momenta's schedule shape: low at x = 0, linearly up to high at x = rise, high until
    end - fall, then linearly back to low at x = end (rise or fall 0: no ramp that side)."""
    up = min(x / rise, 1.0) if rise > 0 else 1.0
    down = min(max((end - x) / fall, 0.0), 1.0) if fall > 0 else 1.0
    return low + (high - low) * min(up, down)


def matrix_momentum(h, step):
    """muon/normuon momentum, in steps: from momentum_warmup_start up to `momentum` over the
    warm-up steps (at least one), back down over the last momentum_cooldown_steps."""
    return rise_hold_fall(step, h.momentum_warmup_start, h.momentum, max(h.momentum_warmup_steps, 1),
                          h.momentum_cooldown_steps, end=h.num_iterations)


def anvil_mu(h, step):
    """ANVIL's Nesterov mu, in fractions of the run: from anvil_mu_low up to anvil_mu_high over the
    first anvil_mu_rise, back down over the last anvil_mu_fall."""
    return rise_hold_fall(step / h.num_iterations, h.anvil_mu_low, h.anvil_mu_high, h.anvil_mu_rise, h.anvil_mu_fall)


def anvil_blend(h, step):
    return 1.0 if step / h.num_iterations < h.anvil_blend_start else h.anvil_blend


def target_weights(stage, device, progress=0.0):
    """(MAX_TARGETS,) loss weights of the targets t+1, t+2, t+3 and of the prefix target, at
    `progress` in [0, 1) through the stage: the multi-token weights go linearly from mtp_weights
    at the stage's first step toward mtp_weights_end at its end (constant without an end)."""
    end = stage.mtp_weights_end or stage.mtp_weights
    mtp = [a + (b - a) * progress for a, b in zip(stage.mtp_weights, end)]
    prefix_end = stage.prefix_weight if stage.prefix_weight_end is None else stage.prefix_weight_end
    prefix = stage.prefix_weight + (prefix_end - stage.prefix_weight) * progress
    w = mtp + [0.0] * (MAX_TARGETS - 1 - len(mtp)) + [prefix]
    return torch.tensor(w, dtype=torch.float32, device=device)


def step_target_weights(h, device):
    """(num_iterations, MAX_TARGETS): the target weights of every step, made once, so a step reads
    its row without a host-to-device copy."""
    rows = [target_weights(stage, "cpu", i / steps)
            for stage, steps in zip(h.stages, steps_per_stage(h)) for i in range(steps)]
    return torch.stack(rows).to(device)


def untie_step(h):
    """The first step at which lm_head is its own parameter."""
    return int(h.untie_frac * h.num_iterations)


def averaged_pieces(model, params):
    """(name, tensor) of each matrix of a parameter family (AVERAGED_PARAMS), as views of the
    weights, so that writing into one writes the weights. "head" is the head as the model uses
    it: the embedding while tied (so its average starts as the embedding's), lm_head after."""
    if params == "embed_head":
        return [("embed", model.embed.weight.data), ("head", model.head_weight().data)]
    if params == "value_embeds":
        return [(f"value_embed{i}", ve.weight.data) for i, ve in enumerate(model.value_embeds)]
    pieces = []
    for i, block in enumerate(model.blocks):
        attn = block.attn
        qk_rows = 2 * attn.num_heads * attn.qk_dim if attn is not None else 0
        if params == "qk" and attn is not None:
            pieces.append((f"qk{i}", attn.qkv.data[:qk_rows]))
        elif params == "vo_mlp":
            if attn is not None:
                pieces += [(f"v{i}", attn.qkv.data[qk_rows:]), (f"out{i}", attn.out.data)]
            pieces += [(f"mlp_up{i}", block.mlp.up.data), (f"mlp_down{i}", block.mlp.down.data)]
            if block.parallel_mlp is not None:
                pieces += [(f"mlp2_up{i}", block.parallel_mlp.up.data), (f"mlp2_down{i}", block.parallel_mlp.down.data)]
    return pieces


class WeightAverages:
    """The end-of-training weight averages of a run (h.averages): sample() after each step's
    update keeps an fp32 EMA per matrix over each average's window, ship() blends them into the
    weights after the last step. A tied head is not written: the embedding is the head."""

    def __init__(self, averages, model, num_iterations):
        self.averages, self.model, self.N = averages, model, num_iterations
        self.ema = [dict() for _ in averages]

    def samples_at(self, average, step):
        return step >= self.N - average.window and (self.N - 1 - step) % average.every == 0

    @torch.no_grad()
    def sample(self, step):
        for average, ema in zip(self.averages, self.ema):
            if not self.samples_at(average, step):
                continue
            for name, weight in averaged_pieces(self.model, average.params):
                if name not in ema:
                    ema[name] = weight.to(torch.float32, copy=True)
                else:
                    ema[name].lerp_(weight.float(), average.rate)

    @torch.no_grad()
    def ship(self):
        """Blend every average into its weights, in order; then rescale the matrices of averages
        with renormalize to the Frobenius norms they had before any blend. Returns the number of
        blends."""
        def shipped(average, ema):
            return [(name, weight) for name, weight in averaged_pieces(self.model, average.params)
                    if name in ema and not (name == "head" and self.model.tied)]
        norms = {name: weight.float().norm() for average, ema in zip(self.averages, self.ema)
                 if average.renormalize for name, weight in shipped(average, ema)}
        blends = 0
        for average, ema in zip(self.averages, self.ema):
            for name, weight in shipped(average, ema):
                weight.copy_(torch.lerp(weight.float(), ema[name], average.blend))
                blends += 1
        for average, ema in zip(self.averages, self.ema):
            for name, weight in shipped(average, ema):
                if name in norms:
                    weight.copy_(weight.float() * (norms.pop(name) / weight.float().norm().clamp_min(NORM_FLOOR)))
        return blends


def attention_windows(h, step, final_validation=False):
    """(short, long) attention windows in WINDOW_BLOCKs at `step`; the final validation uses the
    last stage's short window and val_long_window."""
    stage = h.stages[stage_index(h, step)]
    return stage.short_window, (h.val_long_window if final_validation else stage.long_window)


def long_window_history(h, step, final_validation=False):
    """The long window (tokens) at the start and after each time it grew, up to `step`: what
    YaRN's frequency and attention-scale adjustment is computed from."""
    blocks = [h.stages[i].long_window for i in range(stage_index(h, step) + 1)]
    if final_validation and h.yarn_at_final_window:
        blocks.append(h.val_long_window)
    history = []
    for b in blocks:
        if not history or b * WINDOW_BLOCK > history[-1]:
            history.append(b * WINDOW_BLOCK)
    return history


def graph_changes(h):
    """Steps whose training step differs in shape or structure from the step before: the start
    of every stage and the untie. A compiled model needs one graph for each."""
    N = h.num_iterations
    starts = {s for s in range(1, N) if stage_index(h, s) != stage_index(h, s - 1)}
    return sorted({0} | starts | ({untie_step(h)} & set(range(N))))


def validation_points(h):
    """(step, final) of every validation, intermediate ones first."""
    N = h.num_iterations
    middle = [(s, False) for s in range(h.val_every, N, h.val_every)] if h.val_every else []
    return middle + [(N, True)]


# -----------------------------------------------------------------------------------------------
# Logging
# -----------------------------------------------------------------------------------------------

def project_sources():
    """(relpath, bytes) of every imported module that lives in this repository, sorted."""
    files = {os.path.abspath(__file__)}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if (path and os.path.isabs(path) and path.startswith(REPO_DIR + os.sep) and path.endswith(".py")
                and os.path.isfile(path)):
            files.add(path)
    out = []
    for path in sorted(files):
        with open(path, "rb") as f:
            out.append((os.path.relpath(path, REPO_DIR).replace(os.sep, "/"), f.read()))
    return out


def environment(world_size, bf16_gemm):
    def git_commit():
        try:
            return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_DIR, capture_output=True,
                                  text=True, timeout=10).stdout.strip() or "none"
        except (OSError, subprocess.SubprocessError):
            return "none"
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "python": platform.python_version(), "torch": torch.__version__, "triton": triton_version,
        "cuda": torch.version.cuda or "none", "gpu": ", ".join(gpus) or "none",
        "cpu": cpu_model(), "cpu_count": os.cpu_count(), "cpu_threads": torch.get_num_threads(),
        "bf16_gemm": bf16_gemm, "world_size": world_size,
        "hostname": socket.gethostname(), "command": " ".join(sys.argv), "git_commit": git_commit(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


class DeferredLossLines:
    """Train-loss lines written once their value has reached the host, so that logging never
    makes the CPU wait for the GPU: at a logged step the loss is copied (non-blocking) to pinned
    memory and an event is recorded; the line is written at a later step once the event has
    passed, or when the loop synchronizes anyway (validation, the end)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.pending = []          # (step, elapsed_ms, host tensor, event or None)

    def add(self, step, elapsed_ms, losses):
        """losses: a small fp32 device tensor (the values of one line)."""
        host = torch.empty(losses.shape, dtype=torch.float32, pin_memory=self.cuda)
        host.copy_(losses, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((step, elapsed_ms, host, event))

    def ready(self, wait=False):
        """(step, elapsed_ms, values) of the pending lines whose values have arrived, in order."""
        out = []
        while self.pending and (wait or self.pending[0][3] is None or self.pending[0][3].query()):
            step, elapsed_ms, host, event = self.pending.pop(0)
            if event is not None:
                event.synchronize()
            out.append((step, elapsed_ms, host.tolist()))
        return out


def inside_records(path):
    """Whether `path` (which need not exist) lies in the repository's records/ folder, symbolic
    links followed."""
    records = os.path.realpath(os.path.join(REPO_DIR, "records"))
    return os.path.commonpath([os.path.realpath(path), records]) == records


class RunLog:
    """logs/<run id>.txt through records/logfile.py's LogWriter (the one writer of the format);
    only rank 0 writes. The folder is checked at once, the file created with the header, so a run
    that cannot start (missing data) leaves no log. `progress` says where the run is, for the
    line of an interrupted run."""

    def __init__(self, log_dir, active):
        self.run_id = new_run_id()
        self.log_dir, self.active = log_dir, active
        self.path = os.path.join(log_dir, f"{self.run_id}.txt")
        self.writer = None
        self.progress = "before training"
        if inside_records(log_dir):
            raise ConfigError(f"--log_dir={log_dir} is inside the repository's records/ folder, which only "
                              f"records/make_record.py writes: log elsewhere (the default is logs/), then make a "
                              f"record from the logs")
        if active:
            self._refuse_unusable_folder(lambda: os.makedirs(log_dir, exist_ok=True))

    def _refuse_unusable_folder(self, action):
        try:
            return action()
        except OSError as e:
            raise ConfigError(f"--log_dir={self.log_dir}: cannot create a log there ({e.strerror}); "
                              f"give a writable folder") from None

    def write(self, line, echo=False):
        if self.writer is not None:
            self.writer.line(line)
            if echo:
                print(line, flush=True)

    def header(self, sources, env, data, config):
        """Create the log with its snapshot part (sources, environment, data, config)."""
        if self.active:
            self.writer = self._refuse_unusable_folder(lambda: LogWriter(self.path, self.run_id))
            print(f"logging to {self.path}", flush=True)
            self.writer.header(sources, env, data, config)

    def seal(self):
        """The seal of the last line written (what a checkpoint records), or "" on other ranks."""
        return self.writer.seal.hex()[:SEAL_HEX_DIGITS] if self.writer is not None else ""

    def write_last_line(self, line):
        """The line saying why the run ended (error, interrupt), written if the disk still allows."""
        try:
            self.write(line)
        except LogWriteError:
            pass

    def close(self):
        if self.writer is not None:
            self.writer.close()


# -----------------------------------------------------------------------------------------------
# Training
# -----------------------------------------------------------------------------------------------

class TrainingError(Exception):
    """The run cannot go on (e.g. a non-finite loss); the log is kept."""


RENDEZVOUS_TIMEOUT_S = 300.0       # how long init_process_group waits for the other processes (RENDEZVOUS_TIMEOUT_S=)
AGENT_STORE_TIMEOUT_S = 5.0        # how long a process waits for torch.distributed.run's store to answer
LAUNCH_HINT = "torch.distributed.run sets it; unset it for a single process"
GLOO_PEER_CLOSED = "Connection closed by peer"  # in gloo's error when a peer's socket closes (its process ended)


@dataclass
class Launch:
    """The processes of this job as their launcher's environment describes them: WORLD_SIZE, RANK,
    LOCAL_WORLD_SIZE and LOCAL_RANK (1, 0, WORLD_SIZE, 0 when unset), where they meet
    (MASTER_ADDR:MASTER_PORT) and for how long rank 0 waits for the others (RENDEZVOUS_TIMEOUT_S,
    seconds). `agent_store` is (host, port) of the store torch.distributed.run keeps for its
    processes (TORCHELASTIC_USE_AGENT_STORE=True), else None; `attempt` its restart count."""
    world_size: int
    rank: int
    local_world_size: int
    local_rank: int
    master: str
    rendezvous_timeout_s: float
    agent_store: tuple
    attempt: str


def _whole_variable(environ, name, default, low, high, what):
    """The whole number in the environment variable `name` (`default` when unset); a ConfigError
    unless it lies in [low, high] (high None: no bound)."""
    text = environ.get(name)
    if text is None:
        return default
    if not re.fullmatch(r"[0-9]{1,18}", text) or int(text) < low or (high is not None and int(text) > high):
        raise ConfigError(f"{name}={json.dumps(text)} is not allowed: expects {what} ({LAUNCH_HINT})")
    return int(text)


def launch_environment(environ=None):
    """The Launch that os.environ (or `environ`) describes; a ConfigError naming the variable
    that does not fit: not a whole number, out of its range (a RANK left from another job), or
    missing (RANK or MASTER_ADDR of a job of several processes)."""
    environ = os.environ if environ is None else environ
    world_size = _whole_variable(environ, "WORLD_SIZE", 1, 1, None, "the number of processes, a whole number >= 1")
    if world_size > 1 and "RANK" not in environ:
        raise ConfigError(f"WORLD_SIZE={world_size} but RANK is not set: give each process its RANK (0 to "
                          f"{world_size - 1}), or launch with python -m torch.distributed.run")
    rank = _whole_variable(environ, "RANK", 0, 0, world_size - 1,
                           f"this process's rank, a whole number in [0, WORLD_SIZE={world_size})")
    local_world_size = _whole_variable(environ, "LOCAL_WORLD_SIZE", world_size, 1, world_size,
                                       f"the processes on this machine, a whole number from 1 to WORLD_SIZE={world_size}")
    local_rank = _whole_variable(environ, "LOCAL_RANK", 0, 0, local_world_size - 1, f"this process's rank on this "
                                 f"machine, a whole number in [0, LOCAL_WORLD_SIZE={local_world_size})")
    text = environ.get("RENDEZVOUS_TIMEOUT_S", str(RENDEZVOUS_TIMEOUT_S))
    try:
        timeout = float(text)
    except ValueError:
        timeout = math.nan
    if not 0 < timeout <= 1e6:
        raise ConfigError(f"RENDEZVOUS_TIMEOUT_S={json.dumps(text)} is not allowed: expects the seconds to wait "
                          f"for the other processes, a number in (0, 1000000]")
    master = ""
    if world_size > 1:
        if not environ.get("MASTER_ADDR"):
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: give every process the host of "
                              f"rank 0 in MASTER_ADDR, or launch with python -m torch.distributed.run")
        port = _whole_variable(environ, "MASTER_PORT", None, 1, 65535, "the port rank 0 listens on, 1 to 65535")
        if port is None:
            raise ConfigError(f"WORLD_SIZE={world_size} but MASTER_PORT is not set: give every process the port rank "
                              f"0 listens on, or launch with python -m torch.distributed.run")
        master = f"{environ['MASTER_ADDR']}:{port}"
    agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and master
    return Launch(world_size, rank, local_world_size, local_rank, master, timeout,
                  tuple(master.rsplit(":", 1)) if agent else None, environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_processes(launch, backend, device_id):
    """dist.init_process_group, which waits in C++ code for the other processes, where Python's
    signal handlers do not run until it returns. Meanwhile a watchdog thread, woken by the
    C-level signal handler through signal.set_wakeup_fd, ends the process (one line on stderr,
    then os._exit) when SIGINT or SIGTERM arrives, or when the others have not joined within
    launch.rendezvous_timeout_s; the process group's own timeout, for collectives, is torch's
    default. A rendezvous that fails (a port taken) is a ConfigError with torch's first line."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    joined = threading.Event()

    def watch():
        deadline = time.monotonic() + launch.rendezvous_timeout_s
        while True:
            ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            if joined.is_set():
                return
            if not ready:
                line = (f"{ERROR_PREFIX}no peer process joined within {launch.rendezvous_timeout_s:g} s: rank "
                        f"{launch.rank} of WORLD_SIZE={launch.world_size} waited at MASTER_ADDR:MASTER_PORT="
                        f"{launch.master}; start the other processes (or launch with python -m torch.distributed.run), "
                        f"or wait longer with RENDEZVOUS_TIMEOUT_S")
                code, show = EXIT_USER_ERROR, True
                break
            name = signal.Signals(os.read(read_fd, 1)[0]).name
            if name in SIGNAL_EXIT_CODES:
                line = interruption_line(launch, name, "while waiting for the other processes")
                code, show = SIGNAL_EXIT_CODES[name], shows_interruptions(launch)
                break
        if show:
            print(line, file=sys.stderr, flush=True)
        os._exit(code)

    watchdog = threading.Thread(target=watch, name="rendezvous watchdog", daemon=True)
    watchdog.start()
    try:
        dist.init_process_group(backend=backend, device_id=device_id)
    except dist.DistError as e:
        raise ConfigError(f"the processes could not meet at MASTER_ADDR:MASTER_PORT={launch.master}: "
                          f"{str(e).splitlines()[0]}") from None
    finally:
        joined.set()
        os.write(write_fd, b"\0")
        watchdog.join()
        signal.set_wakeup_fd(previous)
        os.close(read_fd)
        os.close(write_fd)


def agent_store(launch):
    """A client of the store torch.distributed.run keeps for this job's processes (up before they
    start, and while any runs), or None: outside torch.distributed.run, or when it does not answer
    within AGENT_STORE_TIMEOUT_S."""
    if launch is None or launch.agent_store is None:
        return None
    host, port = launch.agent_store
    try:
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=AGENT_STORE_TIMEOUT_S))
    except (RuntimeError, ValueError):
        return None


def _job_key(launch, name):
    return f"train_gpt/attempt_{launch.attempt}/{name}"


def report_error(launch, line):
    """Record in the job's store (agent_store) that this process ends with the error `line`, and
    say whether it is the first of the job's processes to report that line, which alone prints it:
    a bad input fails every process alike, and its line is printed once. Without a store, True."""
    store = agent_store(launch)
    if store is None:
        return True
    try:
        store.compare_set(_job_key(launch, "failed_rank"), "", str(launch.rank))
        digest = hashlib.sha256(line.encode("utf-8", "backslashreplace")).hexdigest()[:16]
        return store.add(_job_key(launch, f"line_{digest}"), 1) == 1
    except RuntimeError:
        return True


def failed_peer(launch):
    """The rank of the first of this job's processes that reported an error (report_error), or
    None (none did, or no store)."""
    store = agent_store(launch)
    key = _job_key(launch, "failed_rank") if store is not None else None
    try:
        return int(store.get(key)) if store is not None and store.check([key]) else None
    except (RuntimeError, ValueError):
        return None


def interruption_line(launch, signal_name, where):
    """The line of a process stopped `where` ("at step 3/100") by `signal_name`, or by a peer's
    end (None: a collective found it gone). A SIGTERM after a peer's error is torch.distributed.run
    ending the job's other processes, and says so."""
    peer = failed_peer(launch) if signal_name != "SIGINT" else None
    if signal_name is not None and peer is None:
        return f"{INTERRUPTED_PREFIX}{signal_name} {where}"
    which = f" (rank {peer}, with the error above)" if peer is not None else ""
    return f"{INTERRUPTED_PREFIX}a peer process exited{which} {where}"


def shows_interruptions(launch):
    """Whether this process prints its interruption line: every process of a job gets the signal
    (or its peer's error is printed already), so rank 0 alone prints it."""
    return launch is None or launch.rank == 0


@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def master(self):
        return self.rank == 0


def setup_distributed(h):
    """This process's Dist: its rank (launch_environment) and device, the processes met."""
    launch = launch_environment()
    world_size, rank, local_rank = launch.world_size, launch.rank, launch.local_rank
    want_cuda = h.device == "cuda" or (h.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA GPU is visible; use --device=cpu or --preset cpu")
    if want_cuda and launch.local_world_size > torch.cuda.device_count():
        raise ConfigError(f"{launch.local_world_size} processes per node but only {torch.cuda.device_count()} GPUs: "
                          f"run with --nproc_per_node={torch.cuda.device_count()}")
    if h.batch_ranks % world_size:
        divisors = [d for d in range(1, h.batch_ranks + 1) if h.batch_ranks % d == 0]
        raise ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by the {world_size} processes: "
                          f"run with one of {divisors} processes")
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        init_processes(launch, "nccl" if want_cuda else "gloo", device if want_cuda else None)
    return Dist(rank, world_size, local_rank, device)


@dataclass
class KernelFns:
    """The kernel functions a model calls: the Triton ones or their plain-torch references."""
    attention: object
    cross_entropy: object
    fp8_mlp: object = None         # fn(x, w_up, w_down, state); None: the MLP runs in the autocast dtype
    xxt: object = None             # X X^T of the Muon family; None: as optim.orthogonalize picks by device
    fp8_qkv: object = None         # fn(x, weight, state); None: the QKV projection runs in the autocast dtype
    fp8_head: object = None        # fn(x, weight, state); None: the head runs in the autocast dtype
    qk_norm_rope: object = kernels.qk_norm_rope_reference  # fn(q, k, cos, sin, stationary, key_doc_start)
    composed_attention: object = kernels.composed_attention_reference  # fn(q, k, v, doc_start, window, scale, mixes)

    @property
    def any_fp8(self):
        return any(fn is not None for fn in (self.fp8_mlp, self.fp8_qkv, self.fp8_head))


def fp8_kernels(h, use_triton):
    """The FP8 layers the config asks for, each with its scale rules: (mlp, qkv, head) functions
    or None."""
    linear = kernels.fp8_linear if use_triton else kernels.fp8_linear_reference
    mlp = kernels.fp8_relu2_mlp if use_triton else kernels.fp8_relu2_mlp_reference
    return (functools.partial(mlp, scales=kernels.MLP_SCALES[h.fp8_mlp_scales]) if h.fp8_mlp else None,
            functools.partial(linear, scales=kernels.QKV_SCALES) if h.fp8_qkv else None,
            functools.partial(linear, scales=kernels.HEAD_SCALES) if h.fp8_head else None)


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
    if use_triton:
        return KernelFns(kernels.flash_attn_varlen, kernels.softcap_cross_entropy, mlp, kernels.xxt, qkv, head,
                         kernels.qk_norm_rope, kernels.composed_attention)
    # Here auto means CPU: the chunked cross-entropy is the kernel's algorithm, ~3x faster than the
    # reference there; `kernels=reference` keeps the plain reference for A/B runs.
    cross_entropy = (kernels.softcap_cross_entropy_reference if h.kernels == "reference"
                     else kernels.softcap_cross_entropy_chunked)
    return KernelFns(kernels.attention_reference, cross_entropy, mlp, None, qkv, head)


def is_gate(name):
    """Gate weights (value-embedding and smear gates) are small matrices trained with the scalars."""
    return name.endswith("_gate")


def adam_groups(h, model):
    """Adam's parameter groups, each with its LR, betas and (cautious, lr^2-scaled) weight decay.
    The head shares the embedding's betas and decay: it starts as a copy of the embedding."""
    gates = [p for name, p in model.named_parameters() if is_gate(name) and name != "smear_gate"]
    token_gates = list(model.token_gates.parameters()) if model.token_gates is not None else []
    dense = list(model.dense.parameters()) if model.trunk == "dense" else []
    scalars = [p for p in model.parameters() if p.ndim < 2 and all(p is not q for q in token_gates + dense)]
    bigram = [model.bigram.weight] if model.bigram is not None else []    # (the n-gram table is SparseRowAdam's)
    value_embeds = bigram + ([] if model.value_sinks is not None else [ve.weight for ve in model.value_embeds])
    groups = [
        dict(name="embed", params=[model.embed.weight], lr=h.embed_lr, betas=h.embed_betas, weight_decay=h.embed_wd),
        dict(name="lm_head", params=[model.lm_head], lr=h.head_lr, betas=h.embed_betas, weight_decay=h.embed_wd),
        dict(name="value_embeds", params=value_embeds, lr=h.value_embed_lr, betas=h.value_embed_betas,
             weight_decay=h.value_embed_wd),
        dict(name="scalars", params=scalars, lr=h.scalar_lr, betas=h.scalar_betas, weight_decay=0.0),
        dict(name="gates", params=gates, lr=h.gate_lr, betas=h.scalar_betas, weight_decay=0.0),
        dict(name="token_gates", params=token_gates, lr=h.token_gate_lr, betas=h.scalar_betas, weight_decay=0.0),
        dict(name="dense", params=dense, lr=h.dense_lr, betas=h.scalar_betas, weight_decay=0.0),
    ]
    if model.smear_gate is not None:
        groups.append(dict(name="smear_gate", params=[model.smear_gate], lr=h.smear_gate_lr, betas=h.scalar_betas,
                           weight_decay=0.0))
    return [g for g in groups if g["params"]]


def qkv_row_splits(h, layer=0):
    """How the Muon family splits a layer's packed QKV weight (queries, keys, values: heads x
    their widths rows each) into matrices it orthogonalizes separately: the whole, or
    (qk_ortho_heads > 0) the queries and the keys in blocks of that many heads and the values as
    one block."""
    if h.qk_ortho_heads == 0:
        return None
    qk_dim, v_dim = head_dims(h, layer)
    block = h.qk_ortho_heads * qk_dim
    return (block,) * (2 * h.num_heads // h.qk_ortho_heads) + (h.num_heads * v_dim,)


def build_optimizers(h, model, fns, run_bank=None):
    """Adam for embeddings, head, gates and scalars; the Muon family (or Adam) for the hidden
    matrices, orthogonalized in bf16 with the Triton X X^T wherever the Triton kernels run.
    run_bank: how the optimizers run their update math (StepGraphs.run_captured: CUDA graphs)."""
    matrices = [p for name, p in model.blocks.named_parameters() if p.ndim == 2 and not is_gate(name)]
    groups = adam_groups(h, model)
    if h.optimizer == "adamw":
        groups.append(dict(name="matrices", params=matrices, lr=h.adamw_matrix_lr, betas=h.embed_betas,
                           weight_decay=0.0))
    adam = optim.Adam(groups, eps=h.adam_eps, step_every=h.adam_step_every, run_bank=run_bank)
    if h.optimizer == "adamw":
        return [adam]
    mlp_down = [mlp.down for block in model.blocks for mlp in (block.mlp, block.parallel_mlp) if mlp is not None]
    qkv = {}                       # row splits -> the QKV weights split that way
    for i, block in enumerate(model.blocks):
        if block.attn is not None:
            qkv.setdefault(qkv_row_splits(h, i), []).append(block.attn.qkv)
    packed = mlp_down + [p for params in qkv.values() for p in params]
    others = [p for p in matrices if all(p is not q for q in packed)]
    muon_groups = [dict(params=others, name="matrices"),
                   dict(params=mlp_down, lr_scale=h.mlp_down_lr_scale, name="mlp_down")]
    muon_groups += [dict(params=params, row_splits=splits, name="qkv") for splits, params in qkv.items()]
    muon = optim.Muon(muon_groups,
                      lr=h.matrix_lr, momentum=h.momentum, weight_decay=h.matrix_wd,
                      schedule=h.orthogonalize, variant=h.optimizer,
                      fast_beta=h.anvil_fast_beta, slow_beta=h.anvil_slow_beta,
                      ortho_dtype=torch.bfloat16 if fns.xxt else None, xxt=fns.xxt, run_bank=run_bank)
    return [adam, muon]


def compiled_graphs():
    """Graphs torch.compile has built in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def gemm_path(h, device, compiling=None):
    """How this run's bf16 products run (cpu_runtime.bf16_gemm_path); `compiling` defaults to h.compile."""
    return bf16_gemm_path(device, h.compile if compiling is None else compiling, h.compute_dtype == "bfloat16")


def compile_fn(h, fn, fullgraph=True):
    """fn compiled as the timed run needs it: one static graph per shape (dynamic shapes make
    slower kernels), no graph breaks unless a kernel runs eagerly (`fullgraph=False`: the CPU
    references), and room in dynamo's per-function cache for every graph the schedule uses
    (past the limit dynamo would fall back to eager without a word)."""
    graphs_needed = max(len(graph_changes(h)), len(validation_points(h)))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs_needed)
    return torch.compile(fn, dynamic=False, fullgraph=fullgraph, backend=h.compile_backend)


# -----------------------------------------------------------------------------------------------
# CUDA graphs
# -----------------------------------------------------------------------------------------------

def graph_key(h, step):
    """What a training step's forward+backward fixes besides its tensors' values: the stage
    (shapes, windows, candidate count, targets) and whether the head is tied. Steps with one key
    replay one graph; graph_changes(h) lists the first step of each."""
    return stage_index(h, step), step < untie_step(h)


@dataclass
class MicroBatch:
    """One micro-batch on the device, as the step's body reads it."""
    tokens: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    candidate_offset: torch.Tensor  # 0-d int64: candidate_offset(step, slice)

    @staticmethod
    def of(s: Slice, offset, device):
        """The slice's own tensors on `device` (a step that is not replayed)."""
        s = s.to(device)
        return MicroBatch(s.tokens, s.targets, s.cu_seqlens, torch.full((), offset, device=device))

    @staticmethod
    def buffers_like(s: Slice, device):
        """Zeroed buffers shaped like `s`, at addresses a captured graph can keep reading."""
        return MicroBatch(*(torch.zeros_like(t, device=device) for t in (s.tokens, s.targets, s.cu_seqlens)),
                          torch.zeros((), dtype=torch.int64, device=device))

    def fill(self, s: Slice, offset):
        """Copy the next slice in (queued behind the previous replay; from pinned memory the
        host does not wait)."""
        for buffer, value in ((self.tokens, s.tokens), (self.targets, s.targets), (self.cu_seqlens, s.cu_seqlens)):
            buffer.copy_(value, non_blocking=True)
        self.candidate_offset.fill_(offset)


@dataclass
class StepGraph:
    """One graph key's forward+backward: its body, its input buffers, the parameters it trains,
    and, once captured, the CUDA graph."""
    body: object                   # body(MicroBatch): forward, backward, loss sums
    inputs: MicroBatch
    trained: list                  # the parameters that get a gradient
    graph: object = None           # torch.cuda.CUDAGraph once captured


class StepGraphs:
    """The training step's forward+backward, one per graph key, at fixed addresses.

    On CUDA, each key's micro-batch is captured once as a CUDA graph in the untimed warm-up,
    after the eager steps that compile it, and replayed in the timed run: one launch per
    micro-batch instead of one per kernel, and no Python in between. The graphs share one memory
    pool: they never run at once, and nothing they allocate outlives a replay. What a replay
    leaves behind (gradients, loss sums, FP8 states) lives in ordinary tensors made before the
    capture. On a CPU (or on CUDA for a key the warm-up did not capture) the same body runs
    eagerly on the same buffers, so one code path is tested everywhere. Disabled (cuda_graphs
    off), every micro-batch runs eagerly from its own tensors, gradients are freed after each
    update, and nothing here is kept.

    Gradients: a captured backward adds into .grad tensors that exist at capture and keep their
    addresses. So every parameter has one gradient tensor for the whole run (`grads`), zeroed in
    place after each update (but the gradient sinks', which are the model's: GPT.sinks_of). Each
    key attaches the gradients of the parameters it trains (its first, eager run finds which) and
    detaches the others, so an optimizer never sees a zero gradient for a parameter that got none
    (the head while it is tied).
    """

    def __init__(self, model, device, enabled):
        sinks = model.gradient_sinks()
        self.params = [p for p in model.parameters() if all(p is not s for s in sinks)]
        self.device, self.enabled = device, enabled
        self.capturing = enabled and device.type == "cuda"
        self.grads = {}            # parameter -> its gradient tensor for the run
        self.steps = {}            # graph key -> StepGraph
        self.attached = None       # the StepGraph whose gradients are attached
        self.pool = torch.cuda.graph_pool_handle() if self.capturing else None
        self.optimizer_graphs = {}  # run_captured's key -> its CUDA graph
        self.in_warm_up = False    # run_captured may capture (set by the warm-up)
        self.eager_runs = 0        # CUDA runs of a key already seen that had no graph

    def run(self, key, body, s: Slice, offset):
        """Forward and backward of micro-batch `s` with the graph of `key` (body makes it)."""
        if not self.enabled:
            body(MicroBatch.of(s, offset, self.device))
            return
        step = self.steps.get(key)
        if step is None:
            self.steps[key] = self._first_run(body, s, offset)
            return
        self._attach(step)
        step.inputs.fill(s, offset)
        if step.graph is not None:
            step.graph.replay()
        else:
            self.eager_runs += self.capturing
            step.body(step.inputs)

    def _first_run(self, body, s, offset):
        """Run a new key eagerly from fresh buffers and find the parameters it trains: the ones
        with a gradient after a backward that starts with none. Gradients pending from earlier
        micro-batches (accumulation) are added back."""
        step = StepGraph(body, MicroBatch.buffers_like(s, self.device), [])
        step.inputs.fill(s, offset)
        pending = {p: p.grad for p in self.params if p.grad is not None}
        for p in self.params:
            p.grad = None
        body(step.inputs)
        step.trained = [p for p in self.params if p.grad is not None]
        for p in step.trained:
            if p in self.grads:
                self.grads[p].add_(p.grad)
            else:
                self.grads[p] = p.grad
        trained = set(step.trained)
        for p, grad in pending.items():
            if p not in trained:
                self.grads[p] = grad   # kept for a later key that trains p
        self.attached = None
        self._attach(step)
        return step

    def _attach(self, step):
        if self.attached is step:
            return
        trained = set(step.trained)
        for p in self.params:
            p.grad = self.grads[p] if p in trained else None
        self.attached = step

    def capture(self, key):
        """Capture `key`'s forward+backward (CUDA, enabled; its first run done). Runs it once
        more eagerly first, so the gradients, loss sums and FP8 states change: the warm-up
        restores them afterwards."""
        if not self.capturing or self.steps[key].graph is not None:
            return
        step = self.steps[key]
        self._attach(step)
        step.graph = self._capture(functools.partial(step.body, step.inputs), f"training step of graph {key}")

    def run_captured(self, key, fn):
        """fn() (an optimizer's update on tensors at fixed addresses) as a CUDA graph: the first
        call with `key` in the warm-up captures it (after running it eagerly, which does that
        call's work and creates any state lazily), later calls replay it. Off CUDA, or for a key
        the warm-up did not meet, fn runs eagerly."""
        graph = self.optimizer_graphs.get(key)
        if graph is not None:
            graph.replay()
        elif self.capturing and self.in_warm_up:
            self.optimizer_graphs[key] = self._capture(fn, f"optimizer update {key[0]}")
        else:
            self.eager_runs += self.capturing
            fn()

    def _capture(self, fn, what):
        """A CUDA graph of fn(), after one eager run of it on a side stream, as capture requires
        (that run also does this call's work: a capture only records)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        # The eager runs' freed blocks go back to the driver: a capture allocates in the graphs'
        # own pool, and while it is under way the allocator frees no cached block to make room.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                fn()
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TrainingError(f"capturing the {what} as a CUDA graph failed ({first_line}): rerun with "
                                f"--cuda_graphs=false") from error
        return graph

    def zero_grads(self):
        """Zero every run gradient in place and detach them all (the state of a fresh run)."""
        for grad in self.grads.values():
            grad.zero_()
        for p in self.params:
            p.grad = None
        self.attached = None

    def captured(self):
        return sum(step.graph is not None for step in self.steps.values())


FP8_CALIBRATION_PASSES = 1         # forward+backward passes that record the FP8 amaxes before the first step
NGRAM_TABLE_KEY = "ngram.table"    # the n-gram table in the model's state dict
NGRAM_ROW_STATE_BYTES = 8          # sparse Adam's state per table row: an fp32 moment and an int32 event
NGRAM_ROW_MAP_BYTES = 4            # a host table's map from each row to its cache slot (int32)


def available_memory_bytes(device):
    """Free memory of the device (CUDA) or available host memory (/proc/meminfo), or None."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def check_ngram_table(h, env, available=None):
    """Refuse, before anything is allocated, an n-gram table that cannot be split evenly across
    the processes or whose shard cannot fit where it would live (`available`: device -> free
    bytes, available_memory_bytes)."""
    if not h.ngram_rows:
        return
    if h.ngram_rows % env.world_size:
        raise ConfigError(f"--ngram_rows={h.ngram_rows} does not split evenly across {env.world_size} processes: "
                          f"use a multiple of {env.world_size}")
    row_bytes = h.model_dim * getattr(torch, h.ngram_dtype).itemsize + NGRAM_ROW_STATE_BYTES
    if h.ngram_cache_rows:
        if env.world_size > 1:
            raise ConfigError(f"--ngram_cache_rows={h.ngram_cache_rows} keeps the table in one process's host "
                              f"memory, but {env.world_size} processes split it: set --ngram_cache_rows=0")
        least = min_cache_rows(h, env)
        if h.ngram_cache_rows < least:
            raise ConfigError(f"--ngram_cache_rows={h.ngram_cache_rows} is fewer than the {least} rows the device "
                              f"cache must hold at once (an update's slices, the next step's and a validation "
                              f"slice's, 2 rows per token): raise it to at least {least}")
        places = [(h.ngram_rows, row_bytes + NGRAM_ROW_MAP_BYTES, torch.device("cpu"), "in host memory"),
                  (h.ngram_cache_rows, row_bytes, env.device, f"its cache of {h.ngram_cache_rows} rows")]
    else:
        shard = h.ngram_rows // env.world_size
        places = [(shard, row_bytes, env.device, f"{shard} rows in each of {env.world_size} processes"
                   if env.world_size > 1 else "all in one process")]
    for rows, per_row, device, where in places:
        free = (available or available_memory_bytes)(device)
        if free is not None and rows * per_row > free:
            raise ConfigError(f"--ngram_rows={h.ngram_rows} needs {rows * per_row / 2**30:.1f} GiB on the "
                              f"{device.type} ({where}: {per_row} B per row, {h.ngram_dtype} values of "
                              f"{h.model_dim} and the optimizer state), {free / 2**30:.1f} GiB are "
                              f"available: lower --ngram_rows{' or --ngram_cache_rows' if h.ngram_cache_rows else ''}")


def ngram_event_rows(h, world_size):
    """The most distinct rows of the n-gram table one process's Adam event can take gradients for:
    every entry since the last event (2 per token of every slice of the longest cadence's steps,
    all processes' when the table is split, each process then asked for its own rows), and no
    more than the rows it trains (its shard, or the device cache of a host table)."""
    cadence = max(h.ngram_step_every, h.ngram_late_step_every if h.ngram_late_step else 1)
    entries = 2 * cadence * h.batch_ranks * max(s.tokens_per_rank for s in h.stages)
    return min(entries, h.ngram_cache_rows or h.ngram_rows // world_size)


def min_cache_rows(h, env):
    """Rows the device cache of a host table must hold at once: those of the slices since the
    table's last Adam event (its longest cadence), of the next step's (prefetched) and of a
    validation slice, 2 per token."""
    cadence = max(h.ngram_step_every, h.ngram_late_step_every if h.ngram_late_step else 1)
    longest = max(s.tokens_per_rank for s in h.stages)
    return 2 * ((cadence + 1) * (h.batch_ranks // env.world_size) * longest + h.val_tokens_per_rank)


class VocabRowGradients:
    """The gradients of a vocabulary-sized table (a value-embedding table) summed per row since
    its last update. Memory: the table's size in fp32, however far apart
    the updates are; keeping the entries instead would grow with the tokens in between (32
    micro-batches of 49,152 in the 1gpu preset's late phase: 4.8 GB for a 768-wide table).

    add(groups, grads), after each micro-batch: its entries summed per row in token order
    (sum_rows: deterministic), then added, one addition per row. touched(capacity): the
    RowGroups of the rows whose sum is not zero, at a capacity the host knows (no host sync). A row
    whose gradients summed to exactly zero is left out: its update would be its moment's decay
    alone, which the catch-up applies when the row is next updated."""

    def __init__(self, rows, dim, device, sum_rows):
        self.sums = torch.zeros(rows + 1, dim, device=device)   # row `rows` takes the unused slots' zeros
        self.entries = 0           # entries added since the last clear (host)
        self.sum_rows = sum_rows

    def add(self, groups, grads):
        spare = torch.full_like(groups.distinct, self.sums.shape[0] - 1)
        self.sums.index_add_(0, torch.where(groups.distinct >= 0, groups.distinct, spare),
                             self.sum_rows(grads, groups))
        self.entries += grads.shape[0]

    def touched(self, capacity):
        """RowGroups of an index vector of `capacity` entries (at least the number of rows with a
        gradient) that lists every such row once and then repeats the first: its distinct rows are
        those rows."""
        flagged = self.sums[:-1].ne(0).any(1)
        vector = flagged.int().argmax().expand(capacity + 1).clone()   # the first flagged row
        slot = torch.where(flagged, flagged.cumsum(0) - 1, capacity)   # unflagged rows land past the end
        vector.scatter_(0, slot, torch.arange(flagged.numel(), device=flagged.device))
        return kernels.distinct_rows(vector[:capacity])

    def clear(self):
        self.sums.zero_()
        self.entries = 0


class RowGradientSums:
    """A sparse table's gradients since its last Adam event, summed per row, in memory fixed at
    the start: `capacity` fp32 rows of sums, at least the distinct rows an event can see.

    add(rows, grads), after each micro-batch: its entries, (N,) rows of the table the Adam trains
    and their (N, D) gradients, summed per row in entry order (sum_rows: deterministic), each
    row's sum then added to the row's slot; a row takes the next free slot when it first has a
    gradient since the last event. Slots are handed out on the device (slot_of, row_of, count):
    no host sync. summed(calls): the RowGroups of the rows with a slot and their sums divided in
    place by `calls`, for SparseRowAdam.step_summed. The sums add the same entries as one sum
    over all of them, in another order: equal up to float rounding."""

    def __init__(self, rows, dim, capacity, device, sum_rows):
        self.rows, self.capacity, self.sum_rows = rows, capacity, sum_rows
        self.sums = torch.zeros(capacity + 1, dim, device=device)   # slot `capacity` takes the padding's zeros
        self.slot_of = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)  # row `rows`: the padding
        self.row_of = torch.full((capacity + 1,), rows, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)   # slots in use
        self.entries = 0           # entries added since the last clear (host): at least the slots in use
        self.clear()

    def add(self, rows, grads):
        groups = kernels.distinct_rows(rows)
        row = torch.where(groups.distinct >= 0, groups.distinct, self.rows)
        slot = self.slot_of[row].long()
        new = slot < 0
        slot = torch.where(new, self.count + new.cumsum(0) - 1, slot)
        self.slot_of[row], self.row_of[slot] = slot.int(), row   # the padding's writes repeat its values
        self.count += new.sum()
        self.sums.index_add_(0, slot, self.sum_rows(grads, groups))   # one addition per slot
        self.entries += rows.numel()

    def in_use(self):
        """A host bound on the slots in use: they are the first this many."""
        return min(self.entries, self.capacity)

    def summed(self, calls):
        n = self.in_use()
        if calls > 1:
            self.sums[:n].div_(calls)
        return kernels.RowGroups(self.row_of[:n], self.count, None, None, None), self.sums[:n]

    def clear(self):
        n = self.in_use()
        self.slot_of[self.row_of[:n]] = -1
        self.slot_of[self.rows] = self.capacity
        self.row_of[:n] = self.rows
        self.sums[:n].zero_()
        self.count.zero_()
        self.entries = 0


@dataclass
class Route:
    """Where a slice's n-gram rows come from and where their gradients go, with the table split
    across the processes (ShardedNgramRows), worked out on the host (pinned with a GPU)."""
    groups: object                 # kernels.RowGroups of the slice's rows (2 per token)
    send_counts: list              # how many of its distinct rows each process holds
    recv_counts: list              # how many rows of this process's shard each process asks for
    asked: torch.Tensor            # those rows, as indices into this shard, process by process


class ShardedNgramRows:
    """The n-gram table split by rows across the processes: process r holds rows [r S, (r + 1) S)
    (S = rows / processes) and their optimizer state, nothing else of the table.

    route_of(tokens, everyone), on the host: from the host tokens of this process's slice and of
    every process's slice of the same micro-batch, the Route: the distinct rows it needs from
    every owner and the rows of its own that every process needs. Host work per slice: the
    hashes of every process's tokens, and the distinct rows of its own slice and of its rows in
    the others'; the batch prefetcher's thread does it a step ahead (BatchPrefetcher). fetch(tokens,
    route), before a forward: with no route, the processes gather each other's tokens first (an
    all_gather on a host group: the hosts wait for each other, never for a device) and work it
    out. One all_to_all then moves the values, owners to askers, with sizes the host knows: no
    host sync. The values land in the model's `fetched` buffer and `slots` says where each
    token's two rows landed.
    entries(grads), after the backward: each distinct row's gradient, summed over the slice's
    tokens (in token order: deterministic), goes back to its owner by the same routes, and each
    process returns the entries it received for its own rows (repeats across senders add up in
    SparseRowAdam). Traffic and memory per slice: its distinct rows, whatever the table's size.

    The gradients are divided by the processes: each process's loss is scaled to its share of
    the micro-batches, so the owners' sum is that many times the mean gradient the dense
    parameters get (their all-reduce averages)."""

    def __init__(self, table: NgramTable, sum_rows, env: Dist):
        self.table, self.sum_rows, self.env = table, sum_rows, env
        self.shard_rows = table.table.shape[0]
        # host tokens travel on gloo; a CPU run's default group is one already
        self.host_group = dist.new_group(backend="gloo") if env.device.type == "cuda" else None
        self.route = None          # the last fetch's RowGroups (device), send and receive counts, asked rows

    def _pinned(self, host):
        """`host`, in pinned memory on CUDA, from where a copy to the device does not make the host wait."""
        return host.pin_memory() if self.env.device.type == "cuda" else host

    def _rows_asked_of_me(self, tokens):
        """The distinct rows of this process's shard that a slice of host `tokens` reads, sorted
        (the order in which the process holding the slice asks for them)."""
        rows = self.table.slice_rows(tokens)
        return torch.unique(rows[rows // self.shard_rows == self.env.rank])

    @torch.no_grad()
    def route_of(self, tokens, everyone):
        """The Route of this process's slice of host `tokens` (T,), `everyone` holding every
        process's slice of the micro-batch (this one's included). Host work only."""
        groups = kernels.distinct_rows(self.table.slice_rows(tokens))   # on the host, where the tokens are
        distinct = groups.distinct[:int(groups.count)]        # sorted, so grouped by owner
        send_counts = torch.bincount(distinct // self.shard_rows, minlength=self.env.world_size).tolist()
        asked = [distinct[distinct // self.shard_rows == self.env.rank] if process == self.env.rank
                 else self._rows_asked_of_me(theirs) for process, theirs in enumerate(everyone)]
        return Route(kernels.RowGroups(**{f.name: self._pinned(getattr(groups, f.name))
                                          for f in dataclasses.fields(groups)}),
                     send_counts, [len(rows) for rows in asked], self._pinned(torch.cat(asked) - self.table.first_row))

    @torch.no_grad()
    def fetch(self, tokens, training=True, route=None):
        """Fill the table's `fetched` and `slots` for the host tokens (T,) of the next forward
        (`training` matters to a host table's cache, not here), by `route` (None: gathered and
        worked out here). Every process calls it for a slice of the same length."""
        if route is None:
            everyone = [torch.empty_like(tokens) for _ in range(self.env.world_size)]
            dist.all_gather(everyone, tokens, group=self.host_group)
            route = self.route_of(tokens, everyone)
        device = self.env.device
        asked = route.asked.to(device, non_blocking=True)
        dist.all_to_all_single(self.table.fetched[:sum(route.send_counts)], self.table.table[asked],
                               output_split_sizes=route.send_counts, input_split_sizes=route.recv_counts)
        self.table.slots[:tokens.numel()].copy_(route.groups.inverse.view(-1, 2), non_blocking=True)
        groups = kernels.RowGroups(**{f.name: getattr(route.groups, f.name).to(device, non_blocking=True)
                                      for f in dataclasses.fields(route.groups)})
        self.route = (groups, route.send_counts, route.recv_counts, asked)

    @torch.no_grad()
    def entries(self, grads):
        """(rows of this shard, their gradients) for the entries `grads` (T * 2, D) of the last
        fetched slice: this process's share of every process's summed gradients."""
        groups, send_counts, recv_counts, asked = self.route
        summed = self.sum_rows(grads, groups)[:sum(send_counts)]
        received = grads.new_empty(len(asked), grads.shape[1])
        dist.all_to_all_single(received, summed, output_split_sizes=recv_counts, input_split_sizes=send_counts)
        return asked, received / self.env.world_size


class HostNgramRows:
    """The n-gram table in host memory (pinned with a GPU) and a device cache of its rows.

    The cache is the table's `fetched` (cache_rows x dim). SparseRowAdam trains the cached rows
    in place, with each slot's moment and last event, so the math is the resident table's, row
    for row and bit for bit. The host keeps every row's value, moment and last event, and each
    row's slot (-1: not cached).

    fetch(tokens), before a forward: the slice's distinct rows that are not cached are copied
    from the host into free slots with their state (prefetch() does this for the next step's
    slices while the current one runs, on a copy stream with a GPU), and `slots` gets each
    token's two slots. A training slice's rows stay pinned in the cache until the table's next
    Adam event has used their gradients (release()). When free slots run short, the least
    recently used unpinned rows go back to the host (values and state), a quarter of the cache
    at a time: the host waits for the device then, once per such round. flush() writes every
    cached row back, so that the host table is whole (for a checkpoint)."""

    def __init__(self, table: NgramTable, adam: optim.SparseRowAdam, device):
        self.table, self.adam, self.device = table, adam, device
        capacity, pin = table.fetched.shape[0], device.type == "cuda"
        self.moment = torch.zeros(table.rows, dtype=torch.float32, pin_memory=pin)  # every row's Adam state
        self.last = torch.zeros(table.rows, dtype=torch.int32, pin_memory=pin)
        self.slot_of = torch.full((table.rows,), -1, dtype=torch.int32)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64)  # -1: a free slot
        self.used = torch.zeros(capacity, dtype=torch.int64)          # the fetch that last read the slot
        self.pinned = torch.zeros(capacity, dtype=torch.bool)
        self.copies = torch.cuda.Stream(device) if pin else None
        self.last_slots = None     # the last fetched slice's slots, 2 per token, on the device
        self.reset_counts()

    def reset_counts(self):
        """Start counting fetches, row lookups, hits and write-backs anew."""
        self.fetches = self.lookups = self.hits = self.evicted = self.rounds = 0

    @torch.no_grad()
    def fetch(self, tokens, training=True, route=None):
        """Make the rows of the host tokens (T,) cached and fill the table's `slots` for them;
        a training slice's rows are pinned until release(). (`route` is a split table's.)"""
        distinct, inverse = torch.unique(self.table.slice_rows(tokens), sorted=True, return_inverse=True)
        token_slots = self._cache(distinct, pin=training)[inverse]
        if self.copies is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copies)
        self.last_slots = token_slots.to(self.device, non_blocking=True)
        self.table.slots[:tokens.numel()].copy_(self.last_slots.view(-1, 2))

    @torch.no_grad()
    def prefetch(self, slices):
        """Copy the rows of the next step's slices into the cache now, and pin them."""
        stream = torch.cuda.stream(self.copies) if self.copies is not None else contextlib.nullcontext()
        with stream:
            for s in slices:
                self._cache(torch.unique(self.table.slice_rows(s.tokens)), pin=True)

    def entries(self, grads):
        """(cache slots, gradients) for the entries `grads` (T * 2, D) of the last fetched slice."""
        return self.last_slots, grads

    def release(self):
        """The table's Adam event has used every pending gradient: no row needs to stay cached."""
        self.pinned.zero_()

    def _cache(self, distinct, pin):
        """The slots of the (host) rows `distinct`, loading those not cached."""
        slots = self.slot_of[distinct].long()
        missing = slots < 0
        count = int(missing.sum())
        self.fetches, self.lookups, self.hits = self.fetches + 1, self.lookups + distinct.numel(), \
            self.hits + distinct.numel() - count
        if count:
            free = self._free_slots(count, keep=slots[~missing])
            rows = distinct[missing]
            self._load(rows, free)
            slots[missing] = free
            self.slot_of[rows], self.row_of[free] = free.int(), rows
        self.used[slots] = self.fetches
        if pin:
            self.pinned[slots] = True
        return slots

    def _free_slots(self, count, keep):
        free = torch.nonzero(self.row_of < 0).squeeze(1)
        if free.numel() < count:
            self._evict(max(count - free.numel(), self.row_of.numel() // 4), keep)
            free = torch.nonzero(self.row_of < 0).squeeze(1)
        if free.numel() < count:
            raise TrainingError(f"the n-gram table's device cache of {self.row_of.numel()} rows has no room for "
                                f"{count} more: raise --ngram_cache_rows")
        return free[:count]

    def _evict(self, count, keep):
        """Write the `count` least recently used unpinned rows (but `keep`) back to the host."""
        candidate = (self.row_of >= 0) & ~self.pinned
        candidate[keep] = False
        count = min(count, int(candidate.sum()))
        if not count:
            return
        victims = torch.topk(torch.where(candidate, self.used, torch.iinfo(torch.int64).max), count,
                             largest=False).indices
        self._write_back(victims)
        self.slot_of[self.row_of[victims]] = -1
        self.row_of[victims] = -1
        self.evicted, self.rounds = self.evicted + count, self.rounds + 1

    def _write_back(self, slots):
        """Host rows of `slots` <- their cached values and state. The host waits for the device
        (both streams): the rows' last update must be done, and no queued work may still read a
        slot that a load is about to fill."""
        synchronize(self.device)
        rows, on_device = self.row_of[slots], slots.to(self.device)
        self.table.table[rows] = self.table.fetched[on_device].cpu()
        self.moment[rows] = self.adam.moment[on_device].cpu()
        self.last[rows] = self.adam.last[on_device].cpu()

    def _load(self, rows, slots):
        """Cache slots <- host rows with their state, queued on the current stream."""
        pin = self.copies is not None
        on_device = slots.to(self.device, non_blocking=True)
        for host, cached in ((self.table.table, self.table.fetched), (self.moment, self.adam.moment),
                             (self.last, self.adam.last)):
            picked = torch.empty((rows.numel(), *host.shape[1:]), dtype=host.dtype, pin_memory=pin)
            torch.index_select(host, 0, rows, out=picked)
            cached.index_copy_(0, on_device, picked.to(self.device, non_blocking=True))

    def flush(self):
        """Write every cached row back; they stay cached."""
        self._write_back(torch.nonzero(self.row_of >= 0).squeeze(1))

    def summary(self):
        return (f"n-gram cache: {self.table.fetched.shape[0]} rows on the device, hit rate "
                f"{self.hits / max(self.lookups, 1):.1%} ({self.hits}/{self.lookups} distinct rows of "
                f"{self.fetches} slices), {self.evicted} rows written back in {self.rounds} rounds")


# -----------------------------------------------------------------------------------------------
# Memory budget
# -----------------------------------------------------------------------------------------------

# Allowances, not measurements (no GPU run yet):
MEMORY_MARGIN_BYTES = 3 * 2**30    # a GPU's memory beside the budget's items: the CUDA context, cuBLAS, NCCL
MEMORY_MARGIN_FRACTION = 0.05      # and this share of the GPU: the caching allocator's rounding and fragmentation
HOST_MARGIN_BYTES = 16 * 2**30     # host memory beside a host table: the processes, the data shards, the OS
# What shrinks each item, for a refusal to name.
BUDGET_SETTINGS = {
    "n-gram table": "--ngram_rows or --ngram_cache_rows, or more processes to split the table",
    "pending n-gram gradients": "--ngram_late_step_every (the longest cadence) or the stages' tokens_per_rank",
    "step": "the stages' tokens_per_rank (or candidates)",
    "n-gram table (host)": "--ngram_rows",
}


@dataclass
class MemoryBudget:
    """The bytes a run needs on each process's GPU and in the host's memory, by item, from the
    shapes alone (memory_budget), so that a run that cannot fit is refused before anything large
    is allocated.

    Held on the GPU for the whole run:
      parameters, buffers      the model's (but the n-gram table, its gathered rows, the mask)
      gradients                one per trained parameter, for the whole run (StepGraphs)
      optimizer state          Adam's moments (and its summed gradients with several processes
                               and CUDA graphs); the Muon family's momentum (ANVIL: two rails),
                               lane moments and banks (stacked gradients, new values)
      weight averages          the end-of-training EMAs (fp32)
      n-gram table             this device's rows (all, a shard, or a host table's cache) and
                               their sparse Adam state (NGRAM_ROW_STATE_BYTES a row)
      n-gram rows in flight    a split table's gathered rows (`fetched`) and every table's slots
      gradient sinks           values and gradients, max_tokens rows
      value tables' sums       the sparse value-embedding tables' row sums and sparse Adam state
      pending n-gram gradients RowGradientSums: ngram_event_rows fp32 rows and their maps
      canonical mask           the validation's bit matrix
    The step: one micro-batch's forward and backward at the largest stage (activations, the logits
    and their gradient, the backward's transients; step_memory's dry run); with CUDA graphs it
    stays held in their pool, else it is freed after each backward. Never at once, and not
    during a step: the table update (per micro-batch, its entries summed per row and grouped,
    and a split table's rows and gradients on their way; per event, the value tables' touched
    rows) and a validation forward (validation_memory). Then the margin: MEMORY_MARGIN_BYTES
    and MEMORY_MARGIN_FRACTION of the GPU.

    In host memory, with the table there: the table and its row state, pinned (the CUDA host
    allocator rounds each block up to a power of two), the row-to-slot map, the cache's slot
    bookkeeping, and HOST_MARGIN_BYTES."""
    device: dict                   # held item -> bytes
    passing: dict                  # item -> bytes, one at a time
    step: int
    logits: int                    # of the step, at its peak
    graphs: bool                   # the step stays in the CUDA-graph pool
    host: dict = field(default_factory=dict)

    def device_total(self, gpu_bytes):
        held = sum(self.device.values()) + (self.step if self.graphs else 0)
        passing = max([*self.passing.values(), 0 if self.graphs else self.step])
        return held + passing + MEMORY_MARGIN_BYTES + MEMORY_MARGIN_FRACTION * gpu_bytes

    def host_total(self):
        return sum(self.host.values()) + HOST_MARGIN_BYTES if self.host else 0

    def refusal(self, what, needed, available, items):
        """The one line that refuses the run: what it needs, what there is, its largest items."""
        largest = sorted(items.items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"{name} {size / 2**30:.1f}" + (f" ({BUDGET_SETTINGS[name]})" if name in BUDGET_SETTINGS
                                                         else "") for name, size in largest)
        return (f"the run needs {needed / 2**30:.1f} GiB of {what}, {available / 2**30:.1f} GiB are there; "
                f"its largest items (GiB): {named}: lower one of those")

    def check(self, gpu_bytes, host_bytes):
        """None, or the refusal of a run on a GPU of gpu_bytes with host_bytes of host memory
        (either None: not checked)."""
        needed = self.device_total(gpu_bytes or 0)
        if gpu_bytes is not None and needed > gpu_bytes:
            return self.refusal("memory on each GPU", needed, gpu_bytes,
                                {**self.device, **self.passing, "step": self.step})
        if host_bytes is not None and self.host and self.host_total() > host_bytes:
            return self.refusal("host memory", self.host_total(), host_bytes, self.host)
        return None

    def summary(self, gpu_bytes):
        return f"{self.device_total(gpu_bytes) / 2**30:.1f} of {gpu_bytes / 2**30:.1f} GiB"


def pinned_bytes(nbytes):
    """What pinning `nbytes` of host memory takes: the CUDA host allocator's power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the ops under it make while they are alive, and their peak;
    `logits` counts those of 2-d tensors `logits_width` wide (the head's), at that peak. The
    storages of `existing` tensors (parameters, gradients, buffers) are not counted."""

    def __init__(self, logits_width, existing=()):
        super().__init__()
        self.live = self.peak = self.logits = self.peak_logits = 0
        self.width, self.seen = logits_width, {id(t.untyped_storage()) for t in existing}

    def _free(self, key, nbytes, logits):
        self.seen.discard(key)
        self.live -= nbytes
        self.logits -= nbytes if logits else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.seen:
                storage, logits = t.untyped_storage(), t.ndim == 2 and t.shape[-1] == self.width
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                self.logits += storage.nbytes() if logits else 0
                weakref.finalize(storage, self._free, id(storage), storage.nbytes(), logits)
        if self.live > self.peak:
            self.peak, self.peak_logits = self.live, self.logits
        return out


def largest_stage(h):
    """The index of the stage whose step makes the most memory: the most tokens times head width."""
    return max(range(len(h.stages)), key=lambda i: h.stages[i].tokens_per_rank * (h.stages[i].candidates or
                                                                                  PADDED_VOCAB_SIZE))


def fake_model(h):
    """The run's model on fake tensors (shapes without memory) with the Triton kernels' functions,
    its n-gram table whole; no canonical mask (validation_memory fakes one)."""
    fns = select_kernels(dataclasses.replace(h, kernels="auto"), torch.device("cuda"))
    cfg = dataclasses.replace(model_config(h), canonical_mask=False)
    return GPT(cfg, fns, max_positions(h))


def dry_run(h, run):
    """run(model) on the fake model, under a LiveBytes of the head's width and h's autocast, with
    the global random state left as it was: (its LiveBytes, the model)."""
    with torch.random.fork_rng(devices=[]), torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(h)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.compute_dtype == "bfloat16")
        tracker = run(model, autocast)
    return tracker, model


# Keys that do not change what the dry runs count (the table's placement: they run it whole).
DRY_RUN_FREE_KEYS = ("preset", "track", "seed", "ngram_cache_rows", "train_files", "val_files", "log_dir", "log_every",
                     "save_checkpoint", "sync_check")


def dry_run_key(h):
    return json.dumps({k: v for k, v in config_to_dict(h).items() if k not in DRY_RUN_FREE_KEYS}, sort_keys=True)


@functools.lru_cache(maxsize=8)
def step_memory(config_json):
    """(peak bytes, logits bytes at the peak) of one micro-batch's forward and backward at the
    run's largest stage (largest_stage), with the Triton kernels: the tensors it makes, alive at
    once at its peak, counted on fake tensors (no memory, no compute). The parameters and their
    gradients exist before it (the budget counts them apart), as in a run after its first step.
    The eager step: a compiled one fuses ops and may keep less."""
    h = config_from_dict(json.loads(config_json))
    index = largest_stage(h)
    stage, step = h.stages[index], sum(steps_per_stage(h)[:index])   # the stage and its first step

    def run(model, autocast):
        model.set_windows(long_window_history(h, step))
        model.tied = step < untie_step(h)
        T = stage.tokens_per_rank
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        tokens = torch.zeros(T, dtype=torch.int32)
        targets = torch.zeros(T, MAX_TARGETS - 1, dtype=torch.int64)
        args = Trainer.attention_args(torch.zeros(T // MIN_DOC_TOKENS + 2, dtype=torch.int32),
                                      attention_windows(h, step))
        with model.sinks_of(T):
            existing = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()
                                                                 if p.grad is not None)]
            tracker = LiveBytes(stage.candidates or PADDED_VOCAB_SIZE, existing)
            with tracker, autocast:
                columns = candidate_columns(targets, stage.candidates, 0) if stage.candidates else None
                objective, _ = model(tokens, targets, args, target_weights(stage, "cpu"), columns)
                objective.backward()
        return tracker
    tracker, _ = dry_run(h, run)
    return tracker.peak, tracker.peak_logits


@functools.lru_cache(maxsize=8)
def validation_memory(config_json):
    """Peak bytes of a final validation forward of one slice (val_tokens_per_rank tokens, the
    canonical mask if on), counted as step_memory counts."""
    h = config_from_dict(json.loads(config_json))

    def run(model, autocast):
        if h.canonical_mask:       # its bits' shape, not GPT-2's pairs
            model.canonical_mask = mask = NoncanonicalPairs.__new__(NoncanonicalPairs)
            nn.Module.__init__(mask)
            mask.register_buffer("bits", torch.zeros(PADDED_VOCAB_SIZE, PADDED_VOCAB_SIZE // 8, dtype=torch.uint8))
            mask.register_buffer("bit_values", 1 << torch.arange(8, dtype=torch.uint8))
        model.eval()
        model.set_windows(long_window_history(h, h.num_iterations, final_validation=True))
        T = h.val_tokens_per_rank
        args = Trainer.attention_args(torch.zeros(T // MIN_DOC_TOKENS + 2, dtype=torch.int32),
                                      attention_windows(h, h.num_iterations, final_validation=True))
        tracker = LiveBytes(PADDED_VOCAB_SIZE, [*model.parameters(), *model.buffers()])
        with tracker, autocast, torch.no_grad():
            model.validation_loss_sum(torch.zeros(T, dtype=torch.int32), torch.zeros(T, MAX_TARGETS - 1,
                                                                                     dtype=torch.int64), args)
        return tracker
    return dry_run(h, run)[0].peak


def optimizer_bytes(h, model, world_size):
    """Bytes of the optimizers' state for the model (fake tensors will do), as build_optimizers
    makes them and their first steps fill them in: see MemoryBudget."""
    optimizers = build_optimizers(h, model, KernelFns(None, None), run_bank=None)
    nbytes = lambda p: p.numel() * 4                             # noqa: E731  (fp32 state of fp32 parameters)
    total = 0
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        if isinstance(opt, optim.Adam):
            total += 2 * sum(map(nbytes, params))                 # exp_avg, exp_avg_sq
            if world_size > 1 and h.cuda_graphs:                  # the summed gradients at fixed addresses
                total += sum(nbytes(p) // (world_size if optim.shards_rows(p, world_size) else 1) for p in params)
            continue
        rails = 2 if h.optimizer == "anvil" else 1
        total += rails * sum(map(nbytes, params))
        for group in opt.param_groups:
            banks = {}             # Muon's banks: a group's matrices of one shape and dtype
            for p in group["params"]:
                banks.setdefault((tuple(p.shape), p.dtype), []).append(p)
                if group["equalize"]:                             # one second moment per lane of each block
                    total += 4 * sum(max(rows, p.shape[1]) for rows in group.get("row_splits") or (p.shape[0],))
            for bank in banks.values():                          # stacked gradients, new values, the shard
                per_rank = -(-len(bank) // world_size)
                total += nbytes(bank[0]) * per_rank * (world_size + 1 + (world_size > 1))
    return total


def memory_budget(h, world_size):
    """The MemoryBudget of h on world_size processes (one GPU each)."""
    config_json = dry_run_key(h)
    step, logits = step_memory(config_json)
    with torch.random.fork_rng(devices=[]), torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(h)
        sinks = model.gradient_sinks()
        params = [p for p in model.parameters() if all(p is not s for s in sinks)]
        table_buffers = {"ngram.table", "ngram.fetched", "ngram.slots"}
        device = {
            "parameters": sum(p.nbytes for p in params),
            "buffers": sum(b.nbytes for name, b in model.named_buffers() if name not in table_buffers),
            "gradients": sum(p.nbytes for p in params if p.requires_grad),
            "optimizer state": optimizer_bytes(h, model, world_size),
            "weight averages": sum(4 * w.numel() for a in h.averages for _, w in averaged_pieces(model, a.params)),
            "gradient sinks": 2 * sum(s.nbytes for s in sinks),
        }
        value_widths = [ve.embedding_dim for ve in model.value_embeds] if model.value_sinks is not None else []
    D, passing = h.model_dim, {}
    longest, tokens = max(s.tokens_per_rank for s in h.stages), max_positions(h)
    device["value tables' sums"] = sum(4 * (PADDED_VOCAB_SIZE + 1) * w + NGRAM_ROW_STATE_BYTES * PADDED_VOCAB_SIZE
                                       for w in value_widths)
    passing["table update"] = sum(2 * 4 * PADDED_VOCAB_SIZE * w for w in value_widths)   # the touched rows' sums
    host = {}
    if h.ngram_rows:
        cache, dtype_bytes = h.ngram_cache_rows, getattr(torch, h.ngram_dtype).itemsize
        rows = cache or h.ngram_rows // world_size
        split = world_size > 1 and not cache
        capacity = ngram_event_rows(h, world_size)
        device["n-gram table"] = rows * (D * dtype_bytes + NGRAM_ROW_STATE_BYTES)
        if split or cache:     # the slots of a slice's rows; split, the rows gathered for it
            device["n-gram rows in flight"] = 8 * 2 * tokens + (2 * tokens * D * dtype_bytes if split else 0)
        device["pending n-gram gradients"] = (capacity + 1) * (4 * D + 8) + 4 * (rows + 1) + 8
        # per micro-batch: its entries summed per row and their grouping (7 int64 vectors); split:
        # every process's asks of this one, the rows sent, the gradients received and sent
        entries = 2 * longest * (world_size if split else 1)
        update = entries * (4 * D + 7 * 8)
        if split:
            update += entries * (dtype_bytes * D + 4 * D) + 2 * longest * (4 * D + 7 * 8)
        passing["table update"] = max(passing["table update"], update)
        if cache:
            host = {"n-gram table (host)": pinned_bytes(h.ngram_rows * D * dtype_bytes),
                    "n-gram row state (host)": 2 * pinned_bytes(4 * h.ngram_rows) + 4 * h.ngram_rows,
                    "n-gram cache slots (host)": cache * (8 + 8 + 1)}
    if h.canonical_mask:
        device["canonical mask"] = PADDED_VOCAB_SIZE * PADDED_VOCAB_SIZE // 8
    passing["validation"] = validation_memory(config_json)
    return MemoryBudget(device, passing, step, logits, h.cuda_graphs, host)


def check_memory(h, env, available=None):
    """Refuse, before anything large is allocated, a run whose MemoryBudget does not fit this
    process's GPU (its free memory) or, with the table in host memory, the host's. `available`:
    device -> free bytes (available_memory_bytes)."""
    available = available or available_memory_bytes
    budget = memory_budget(h, env.world_size)
    refusal = budget.check(available(env.device), available(torch.device("cpu")) if budget.host else None)
    if refusal:
        raise ConfigError(refusal)
    return budget


def launch_plan(gpus, argv=(), available=None):
    """(preset arguments, processes, reason): what run.sh starts on `gpus` GPUs, for train_gpt.py's
    arguments `argv`. Without a --preset or --config among them, the first of these that passes
    the start-up checks (the config's, the batch and validation splits, check_ngram_table,
    check_memory): the speedrun preset on 8 GPUs (the record's configuration); the 1gpu preset
    (the same training, off the record track) with its n-gram table split across the GPUs
    (--ngram_cache_rows=0) on the largest process count below 8 that divides the batch's slices;
    the 1gpu preset on one process, its table in host memory. With one, the user's config on the
    most processes that pass. `available`: device -> free bytes (available_memory_bytes; GPU 0
    stands for every GPU). ConfigError when nothing passes, with each refusal."""
    available = available or available_memory_bytes
    gpu, host = available(torch.device("cuda", 0)), available(torch.device("cpu"))
    if any(a in ("--preset", "--config") or a.startswith(("--preset=", "--config=")) for a in argv):
        ranks = parse_config(argv).batch_ranks
        candidates = [((), n, "the most processes it passes on") for n in range(min(gpus, ranks), 0, -1)
                      if ranks % n == 0]
    else:
        ranks = parse_config(["--preset", "1gpu", *argv]).batch_ranks
        candidates = ([(("--preset", "speedrun"), 8, "the record's configuration")] if gpus >= 8 else []) + [
            (("--preset", "1gpu", "--ngram_cache_rows=0"), n, f"the n-gram table split across the {n} GPUs")
            for n in range(min(gpus, ranks - 1), 1, -1) if ranks % n == 0] + [
            (("--preset", "1gpu"), 1, "the n-gram table in host memory")]
    refused = []
    for args, n, why in candidates:
        h = parse_config([*args, *argv])
        env = Dist(0, n, 0, torch.device("cuda", 0))
        what = f"{' '.join(args) or 'the config'} on {n} process{'es' * (n > 1)}"
        try:
            if h.batch_ranks % n:
                raise ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by {n}")
            check_validation_split(h, env)
            check_ngram_table(h, env, available)
            budget = check_memory(h, env, available)
        except ConfigError as e:
            refused.append(f"{what}: {e}")
            continue
        fits = f"the budget: {budget.summary(gpu)} on each GPU" + (
            f", {budget.host_total() / 2**30:.1f} of {host / 2**30:.1f} GiB of host memory" if budget.host else "")
        not_chosen = f"; not {refused[-1].split('; ')[0]}" if refused else ""   # its first clause
        return args, n, f"{gpus} GPU(s) of {gpu / 2**30:.1f} GiB: {what} ({why}; {fits}){not_chosen}"
    raise ConfigError(f"nothing fits {gpus} GPU(s) of {gpu / 2**30:.1f} GiB and {host / 2**30:.1f} GiB of host "
                      f"memory: {'; '.join(refused)}")


class Trainer:
    """The model, its optimizers and the schedules that drive them, on one process."""

    def __init__(self, h: Hyperparameters, env: Dist, log: RunLog, training=True):
        """training=False: for an evaluation or sampling, which needs no training's memory budget."""
        self.h, self.env, self.log = h, env, log
        torch.manual_seed(h.seed)
        self.kernels = select_kernels(h, env.device)
        check_ngram_table(h, env)
        if training and env.device.type == "cuda":
            check_memory(h, env)
        self.model = build_model(h, self.kernels, TablePlacement(env.rank, env.world_size, h.ngram_cache_rows,
                                                                 env.device))
        self.model.to(env.device)
        self.graphs = StepGraphs(self.model, env.device, h.cuda_graphs)
        self.optimizers = build_optimizers(h, self.model, self.kernels,
                                           self.graphs.run_captured if h.cuda_graphs else None)
        self.adam = next(opt for opt in self.optimizers if isinstance(opt, optim.Adam))
        self.ngram_adam = None     # the n-gram table's (its shard's, its cache's) sparse Adam
        self.ngram_fetch = None    # split or on the host: what fetches a slice's rows (and routes their gradients)
        self.ngram_cache = None    # on the host: that same HostNgramRows (its prefetch, flush, counts)
        self.ngram_grads = None    # the table's gradients since its last Adam event (RowGradientSums)
        self.ngram_router = None   # split: that same ShardedNgramRows (the batch prefetcher works out its routes)
        ngram = self.model.ngram
        if ngram is not None:
            self.ngram_adam = optim.SparseRowAdam(ngram.fetched if ngram.on_host else ngram.table, lr=h.ngram_lr,
                                                  beta2=h.ngram_beta2, eps=h.adam_eps, weight_decay=h.ngram_wd,
                                                  use_triton=self.kernels.xxt is not None)
            if ngram.on_host:
                self.ngram_fetch = self.ngram_cache = HostNgramRows(ngram, self.ngram_adam, env.device)
            elif ngram.gathered:
                self.ngram_fetch = self.ngram_router = ShardedNgramRows(ngram, self.ngram_adam.sum_rows, env)
            self.ngram_grads = RowGradientSums(self.ngram_adam.table.shape[0], h.model_dim,
                                               ngram_event_rows(h, env.world_size), env.device,
                                               self.ngram_adam.sum_rows)
        self.value_adams = []      # sparse value embeddings: each table's sparse Adam (every process's table whole)
        self.value_grads = []      # and its rows' gradients since its last update (VocabRowGradients)
        if self.model.value_sinks is not None:
            for ve in self.model.value_embeds:
                adam = optim.SparseRowAdam(ve.weight, lr=h.value_embed_lr, beta2=h.value_embed_betas[1],
                                           eps=h.adam_eps, weight_decay=h.value_embed_wd,
                                           use_triton=self.kernels.xxt is not None)
                self.value_adams.append(adam)
                self.value_grads.append(VocabRowGradients(PADDED_VOCAB_SIZE, ve.embedding_dim, env.device,
                                                          adam.sum_rows))
        self.sparse = ngram is not None or bool(self.value_adams)  # any table trained from gradient entries
        self.drop_sparse_entries()  # no pending gradients, and no steps since the last event
        self.sparse_step_every = h.ngram_step_every
        self.freeze_table = False  # set by the warm-up: the table keeps its values
        self.forward, self.validation_loss_sum = self.model, self.model.validation_loss_sum
        if h.compile:
            fullgraph = not any(kernels.breaks_graphs(fn) for fn in (self.kernels.attention,
                                                                     self.kernels.cross_entropy))
            self.forward = compile_fn(h, self.model, fullgraph)
            self.validation_loss_sum = compile_fn(h, self.model.validation_loss_sum, fullgraph)
        self.autocast = torch.autocast(env.device.type, dtype=torch.bfloat16,
                                       enabled=h.compute_dtype == "bfloat16")
        self.accum = h.batch_ranks // env.world_size
        self.mine = list(range(env.rank, h.batch_ranks, env.world_size))
        self.step_weights = step_target_weights(h, env.device)
        self.weights = self.step_weights[0].clone()  # this step's row: one tensor the model always reads
        self.step_losses = torch.zeros(2, device=env.device)  # the step's (next-token loss, objective)
        self.train_time_ms = 0.0
        self.averages = WeightAverages(h.averages, self.model, h.num_iterations)
        self.advance_to(0)

    def needs_warm_up(self):
        """Whether the first steps would compile something (torch.compile or the Triton JIT), or
        the config asks for a warm-up anyway: the first step of each shape also maps its memory,
        page faults whose cost on a CPU grows with the memory the process already holds (a 16M-row
        n-gram table made them 7x slower than a 1M-row one)."""
        triton_kernels = self.kernels.attention is kernels.flash_attn_varlen
        return self.h.warmup_steps > 0 and (self.h.compile or triton_kernels or self.h.warm_up == "always")

    # -- the schedule
    def advance_to(self, step, final_validation=False):
        """Put the model and the optimizers where the schedule has them at `step` (or at the final
        validation): attention windows with their YaRN frequencies and scale, the head tied or
        untied, learning rates and momenta. Every schedule goes through here; the training loop
        and the warm-up both call it, in any order. Values change in place, so a compiled step
        reads them without recompiling (the tie flag picks one of two graphs the warm-up built)."""
        h = self.h
        self.model.set_windows(long_window_history(h, step, final_validation))
        self.set_tied(step < untie_step(h))
        lr = lr_multiplier(h, step)
        late = 0 < h.ngram_late_step <= step
        self.sparse_step_every = h.ngram_late_step_every if late else h.ngram_step_every
        if self.ngram_adam is not None:
            self.ngram_adam.lr = h.ngram_lr * lr
            self.ngram_adam.beta2 = h.ngram_late_beta2 if late else h.ngram_beta2
        for adam in self.value_adams:
            adam.lr = h.value_embed_lr * lr
            adam.beta2 = h.value_embed_late_beta2 if late else h.value_embed_betas[1]
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr
                if isinstance(opt, optim.Muon):
                    group["momentum"] = matrix_momentum(h, step)
                    group["mu"] = anvil_mu(h, step)
                    group["blend"] = anvil_blend(h, step)

    def set_tied(self, tied):
        """Tie or untie the head. Untying starts lm_head from the embedding's values and from its
        Adam state, so that its first update continues the embedding's instead of a sign step."""
        if tied and not self.model.tied:
            self.model.tie()
        elif not tied and self.model.tied:
            self.model.untie()
            self.adam.copy_state(self.model.embed.weight, self.model.lm_head)

    @staticmethod
    def attention_args(cu_seqlens, windows):
        """The attention arguments of a slice for (short, long) windows in WINDOW_BLOCKs."""
        return AttentionArgs(cu_seqlens, windows[0] * WINDOW_BLOCK, windows[1] * WINDOW_BLOCK)

    # -- steps
    def micro_batch(self, stage, windows, batch: MicroBatch):
        """Forward and backward of one micro-batch: the gradients and self.step_losses accumulate.
        Everything it reads is a tensor that keeps its address or fixed by the graph key (stage,
        windows, tied head), so it can be captured and replayed."""
        columns = (candidate_columns(batch.targets, stage.candidates, batch.candidate_offset) if stage.candidates
                   else None)
        args = self.attention_args(batch.cu_seqlens, windows)
        with self.autocast, record_function("forward"):
            objective, next_token = self.forward(batch.tokens, batch.targets, args, self.weights, columns)
        with record_function("backward"):
            (objective / self.accum).backward()
        self.step_losses += torch.stack([next_token, objective.detach()]) / self.accum

    def forward_backward(self, step, slices):
        """This rank's micro-batches of the step, gradients accumulated; returns the (2,) device
        tensor of the next-token loss and the objective, averaged over them (nothing here waits
        for the device)."""
        stage = self.h.stages[stage_index(self.h, step)]
        body = functools.partial(self.micro_batch, stage, attention_windows(self.h, step))
        self.weights.copy_(self.step_weights[step])
        self.step_losses.zero_()
        with self.model.sinks_of(stage.tokens_per_rank):
            for slice_index, s in zip(self.mine, slices):
                self.model.set_fp8_loss_unit(1.0 / (s.tokens.numel() * self.accum))  # the objective's weight per token
                if self.ngram_fetch is not None:
                    self.ngram_fetch.fetch(s.tokens, route=s.route)
                self.graphs.run(graph_key(self.h, step), body, s, candidate_offset(step, slice_index))
                if self.sparse:
                    self.take_sparse_entries(s)
        return self.step_losses.clone()

    def take_sparse_entries(self, s):
        """Add the sparse tables' gradient entries of the micro-batch that just ran, from their
        sinks, to the tables' row sums, and clear the sinks for the next one: the n-gram table's
        two rows per token (with a split table, the entries the other processes sent for this
        one's rows) and each sparse value-embedding table's row per token (the token itself)."""
        count = s.tokens.numel()
        ngram = self.model.ngram
        resident = ngram is not None and self.ngram_fetch is None   # its rows come from the device tokens
        tokens = s.tokens.to(self.env.device, non_blocking=True) if resident or self.value_adams else None
        if ngram is not None:
            grads = ngram.sink.grad[:count]
            entries = grads.reshape(2 * count, -1)
            self.ngram_grads.add(*(self.ngram_fetch.entries(entries) if self.ngram_fetch is not None
                                   else (ngram.slice_rows(tokens), entries)))
            grads.zero_()
        if self.value_adams:
            groups = kernels.distinct_rows(tokens.long())
            for sink, pending in zip(self.model.value_sinks, self.value_grads):
                grads = sink.grad[:count]
                pending.add(groups, grads)
                grads.zero_()

    def step_sparse_tables(self):
        """Every ngram_step_every-th step (ngram_late_step_every from ngram_late_step): update the
        sparse tables from the mean of their gradients over those steps. The n-gram table's touched
        rows take their summed entries (RowGradientSums); the value-embedding tables' rows, see
        step_value_table. The warm-up discards its gradients."""
        self.sparse_calls += 1
        if self.freeze_table or self.sparse_calls >= self.sparse_step_every:
            if not self.freeze_table:
                if self.ngram_adam is not None:
                    self.ngram_adam.step_summed(*self.ngram_grads.summed(self.sparse_calls))
                for adam, pending in zip(self.value_adams, self.value_grads):
                    self.step_value_table(adam, pending)
            self.drop_sparse_entries()

    def sparse_adams(self):
        """The sparse tables' optimizers: the n-gram table's and the value-embedding tables'."""
        return [adam for adam in (self.ngram_adam, *self.value_adams) if adam is not None]

    def step_value_table(self, adam, pending: VocabRowGradients):
        """Update a value-embedding table's rows with a gradient from the mean over the steps and
        the processes. Every process holds the table whole: they all-reduce their sums and make
        the same update."""
        world = self.env.world_size
        if world > 1:
            dist.all_reduce(pending.sums)
        groups = pending.touched(min(PADDED_VOCAB_SIZE, pending.entries * world))
        adam.step_summed(groups, pending.sums[groups.distinct.clamp(min=0)] / (self.sparse_calls * world))

    def drop_sparse_entries(self):
        """No gradient pending (a host table's cache may let their rows go)."""
        self.sparse_calls = 0
        if self.ngram_grads is not None:
            self.ngram_grads.clear()
        for pending in self.value_grads:
            pending.clear()
        if self.ngram_cache is not None:
            self.ngram_cache.release()

    @property
    def ngram_entries(self):
        """The n-gram table's pending gradients as [(rows, their summed gradients)], each row with
        a gradient once ([] when none), for inspection: it waits for the device."""
        pending = self.ngram_grads
        count = int(pending.count) if pending is not None and pending.entries else 0
        return [(pending.row_of[:count], pending.sums[:count])] if count else []

    def train_step(self, step, slices):
        """One optimizer step on the global batch; advance_to(step) has set the schedule."""
        loss = self.forward_backward(step, slices)
        for opt in self.optimizers:
            with record_function(f"optimizer: {type(opt).__name__}"):
                stepped = opt.step()
            if stepped is not False:   # an Adam between its updates keeps accumulating gradients
                opt.zero_grad(set_to_none=not self.h.cuda_graphs)  # a graph adds into the same tensors
        if self.sparse:
            with record_function("optimizer: SparseRowAdam"):
                self.step_sparse_tables()
        return loss

    def capture_graph(self, step):
        """Capture the forward+backward of `step`'s graph key (on CUDA with cuda_graphs; a step of
        that key must have run)."""
        with self.model.sinks_of(self.h.stages[stage_index(self.h, step)].tokens_per_rank):
            self.graphs.capture(graph_key(self.h, step))

    def calibrate_fp8(self, slices):
        """Record the FP8 amaxes of the initial weights on the first step's batch (gradients
        discarded), so that the first step's delayed scales fit its tensors instead of starting
        from the uncalibrated defaults."""
        if not self.kernels.any_fp8:
            return
        for _ in range(FP8_CALIBRATION_PASSES):
            self.forward_backward(0, slices)
        self.zero_grads()

    def zero_grads(self):
        """No gradient pending anywhere, as at the start of a run."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.graphs.zero_grads()
        for sink in self.model.gradient_sinks():   # zeroed in place: captured graphs add into them
            if sink.grad is not None:
                sink.grad.zero_()
        self.drop_sparse_entries()

    @torch.no_grad()
    def validate(self, slices, step, final_validation):
        """Mean full-vocabulary loss over `slices` (and the other ranks' as many), in the compute
        dtype with no FP8."""
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        for s in slices:
            if self.ngram_fetch is not None:
                self.ngram_fetch.fetch(s.tokens, training=False)
            s = s.to(self.env.device)
            with self.autocast:
                args = self.attention_args(s.cu_seqlens, attention_windows(self.h, step, final_validation))
                total += self.validation_loss_sum(s.tokens, s.targets, args)
        if self.env.world_size > 1:
            dist.all_reduce(total)
        self.model.train()
        return total.item() / (len(slices) * self.h.val_tokens_per_rank * self.env.world_size)

    # -- state
    def snapshot(self):
        """Copies of the model's and the optimizers' state (see restore), but the n-gram table's:
        it can be as large as memory, and it does not move while `freeze_table` is set."""
        return ({k: v.clone() for k, v in self.model.state_dict().items() if k != NGRAM_TABLE_KEY},
                [copy.deepcopy(opt.state_dict()) for opt in self.optimizers])

    def restore(self, snapshot):
        """The snapshot's model and optimizer state, with no gradient pending."""
        model_state, optimizer_states = snapshot
        missing, unexpected = self.model.load_state_dict(model_state, strict=False)
        assert set(missing) <= {NGRAM_TABLE_KEY} and not unexpected, (missing, unexpected)
        for opt, state in zip(self.optimizers, optimizer_states):
            opt.load_state_dict(copy.deepcopy(state))
        self.zero_grads()


def check_finite(name, loss, step, log):
    """Stop the run, keeping its log, when `name` (train or val loss) is NaN or infinite."""
    if not math.isfinite(loss):
        raise TrainingError(f"the {name} loss became {loss} at step {step} (train loss checked every "
                            f"log_every steps): lower the learning rates or check the data")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def host_syncs_are_errors(enabled):
    """With `enabled` (CUDA only), any operation that makes the CPU wait for the GPU raises."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def first_batch(h, train_files, mine):
    """This rank's slices of step 0's batch (a fresh loader starts where the run's does)."""
    stage = h.stages[0]
    return TrainLoader(train_files, batch_tokens(h)).next_batch(stage.tokens_per_rank, stage.max_doc_len,
                                                                h.batch_ranks, mine)


def warm_up(trainer, train_files, val_slices):
    """Untimed: run every graph the timed run will use (each stage's shape, the untie, each
    validation's windows), so that torch.compile and the Triton JIT do their work here, and
    capture each training step's CUDA graph after its eager steps; then restore the initial
    model, optimizer and schedule state. Returns the graphs torch.compile built."""
    h = trainer.h
    before = compiled_graphs()
    saved = trainer.snapshot()
    loader = TrainLoader(train_files, batch_tokens(h))
    trainer.graphs.in_warm_up = trainer.freeze_table = True
    # with CUDA graphs, enough steps per graph key for Adam to update under it (and be captured)
    steps_per_key = max(h.warmup_steps, h.adam_step_every if h.cuda_graphs and h.warmup_steps else 0)
    for step in graph_changes(h):
        trainer.advance_to(step)
        stage = h.stages[stage_index(h, step)]
        for _ in range(steps_per_key):
            trainer.train_step(step, loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks,
                                                       trainer.mine))
        if h.warmup_steps:
            trainer.capture_graph(step)
    for adam in trainer.sparse_adams():     # the frozen tables' updates, on scratch tables
        adam.launch_on_scratch()
    trainer.graphs.in_warm_up = trainer.freeze_table = False
    seen = set()
    for step, final in validation_points(h):
        graph = (attention_windows(h, step, final), step < untie_step(h))
        if graph not in seen:
            seen.add(graph)
            trainer.advance_to(step, final)
            trainer.validate(val_slices[:1], step, final)
    trainer.restore(saved)
    trainer.advance_to(0)
    synchronize(trainer.env.device)
    return compiled_graphs() - before


def write_loss_lines(log, lines, N):
    """Step lines: the next-token train loss (comparable with val_loss) and the objective."""
    for step, elapsed, (loss, objective) in lines:
        check_finite("train", objective, step - 1, log)
        log.write(f"step:{step}/{N} train_loss:{loss:.4f} objective:{objective:.4f} train_time:{elapsed:.0f}ms "
                  f"step_avg:{elapsed / step:.2f}ms", echo=True)


def shards_of(pattern):
    """The shard files matching `pattern`; a ShardError says how to make them when none match."""
    return find_shards(pattern, hint=FINEWEB_HINT if "fineweb" in pattern else TINY_HINT)


def check_validation_split(h, env):
    if h.val_tokens % (h.val_tokens_per_rank * env.world_size):
        raise ConfigError(f"val_tokens={h.val_tokens} must be a multiple of val_tokens_per_rank x processes "
                          f"= {h.val_tokens_per_rank * env.world_size}")


def validation_data(h, env, val_files):
    """This rank's share of the val_tokens every validation reads."""
    check_validation_split(h, env)
    num_slices = h.val_tokens // h.val_tokens_per_rank
    return validation_slices(val_files, h.val_tokens, h.val_tokens_per_rank, num_slices,
                             range(env.rank, num_slices, env.world_size))


def train(h, env, log):
    train_files, val_files = shards_of(h.train_files), shards_of(h.val_files)
    check_validation_split(h, env)
    log.header(project_sources(), environment(env.world_size, gemm_path(h, env.device)),
               [fingerprint(f) for f in val_files + train_files], logged_config(h))
    val_slices = validation_data(h, env, val_files)
    trainer = Trainer(h, env, log)
    log.write(f"model parameters: {trainer.model.num_parameters():,}", echo=True)
    log.progress = "in the warm-up"
    untimed_t0 = time.perf_counter()
    warm_graphs = warm_up(trainer, train_files, val_slices) if trainer.needs_warm_up() else 0
    if trainer.kernels.any_fp8:
        trainer.calibrate_fp8(first_batch(h, train_files, trainer.mine))
    log.write(f"warm-up: {time.perf_counter() - untimed_t0:.1f}s untimed (compilation, Triton JIT, CUDA graph "
              f"capture, FP8 calibration); train_time counts from step 0", echo=True)
    gc.collect()
    gc.freeze()                    # the warm-up's objects leave the collector's view: shorter pauses in the timed run
    if trainer.ngram_cache is not None:
        trainer.ngram_cache.reset_counts()
    batches = BatchPrefetcher(TrainLoader(train_files, batch_tokens(h)), h, trainer.mine,
                              pin=env.device.type == "cuda", router=trainer.ngram_router)
    losses = DeferredLossLines(env.device)
    N = h.num_iterations
    synchronize(env.device)
    graphs_before_timing, eager_before_timing = compiled_graphs(), trainer.graphs.eager_runs
    t0 = time.perf_counter()
    try:
        for step in range(N + 1):
            log.progress = f"at step {step}/{N}"
            last = step == N
            if last and h.averages:
                shipped = trainer.averages.ship()
            if last or (h.val_every and step % h.val_every == 0 and step > 0):
                synchronize(env.device)
                trainer.train_time_ms += 1000 * (time.perf_counter() - t0)
                write_loss_lines(log, losses.ready(wait=True), N)
                trainer.advance_to(step, final_validation=last)
                val_loss = trainer.validate(val_slices, step, final_validation=last)
                log.write(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{trainer.train_time_ms:.0f}ms "
                          f"step_avg:{trainer.train_time_ms / max(step, 1):.2f}ms", echo=True)
                check_finite("val", val_loss, step, log)
                synchronize(env.device)
                t0 = time.perf_counter()
            if last:
                break
            trainer.advance_to(step)
            slices = batches.get(step)
            with host_syncs_are_errors(h.sync_check and env.device.type == "cuda"):
                loss = trainer.train_step(step, slices)
            trainer.averages.sample(step)
            if trainer.ngram_cache is not None and step + 1 < N:
                trainer.ngram_cache.prefetch(batches.peek())
            if step % h.log_every == 0 or step == N - 1:
                if env.world_size > 1:
                    dist.all_reduce(loss)
                elapsed = trainer.train_time_ms + 1000 * (time.perf_counter() - t0)
                losses.add(step + 1, elapsed, loss / env.world_size)
            write_loss_lines(log, losses.ready(), N)
    finally:
        batches.close()
    if h.averages:
        log.write(f"averages: {shipped} blends into the weights before the final validation", echo=True)
    timed_graphs = compiled_graphs() - graphs_before_timing
    log.write(f"compile: {warm_graphs} graphs in the warm-up, {timed_graphs} in the timed run", echo=True)
    if trainer.ngram_cache is not None:
        trainer.ngram_cache.flush()  # the host table whole: for the checkpoint, and for the model after the run
        log.write(trainer.ngram_cache.summary(), echo=True)
    if trainer.graphs.capturing:
        log.write(f"cuda graphs: {trainer.graphs.captured()} training steps and "
                  f"{len(trainer.graphs.optimizer_graphs)} optimizer updates captured in the warm-up, "
                  f"{trainer.graphs.eager_runs - eager_before_timing} ran eagerly in the timed run", echo=True)
    if timed_graphs:
        log.write(f"warning: torch.compile built {timed_graphs} graph(s) inside the timed run: the warm-up "
                  f"missed a shape or a guard, and the train time includes compilation", echo=True)
    peak = (torch.cuda.max_memory_allocated(env.device) if env.device.type == "cuda"
            else _peak_rss_bytes()) // 2**20
    if h.save_checkpoint and env.master:
        path = os.path.join(h.log_dir, f"{log.run_id}_model.safetensors")
        data_sha256 = save_checkpoint(path, trainer.model, h, log.run_id, log.seal(), val_loss, trainer.train_time_ms)
        log.write(f"checkpoint: {path} data_sha256={data_sha256}", echo=True)
    elif h.save_checkpoint and (shard := split_ngram_table(trainer.model)) is not None:
        send_table_shard(shard)    # rank 0 writes this process's rows of the table into the checkpoint
    log.write(f"final val_loss:{val_loss:.4f} train_time:{trainer.train_time_ms:.0f}ms steps:{N} "
              f"peak_memory:{peak}MiB", echo=True)
    return val_loss


def _peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# -----------------------------------------------------------------------------------------------
# Checkpoints: keep the trained model, evaluate it again, sample from it
# -----------------------------------------------------------------------------------------------

CHECKPOINT_FORMAT = "speedrun-checkpoint v1"  # the metadata "format" of the files save_checkpoint writes
SAFETENSORS_DTYPES = {             # torch dtype -> its name in a safetensors header
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
SAFETENSORS_HEADER_ALIGN = 8       # the JSON header is padded with spaces to a multiple of this many bytes
SAFETENSORS_MAX_HEADER = 100 * 2**20  # the format's limit on the JSON header, in bytes
SAFETENSORS_MAX_DIMS = 8           # dimensions of a tensor read (the model's have at most 3)
SAFETENSORS_MAX_ELEMENTS = 2**48   # elements of a tensor read, a zero dimension counted as 1
TRUST_HINT = "--trust_checkpoint=true uses it anyway"
HASH_PLACEHOLDER = "0" * 64        # the header's data_sha256 while the data is written (then patched)


class CheckpointError(Exception):
    """A checkpoint cannot be written or read, or does not fit the request; the message names the file."""


def _tensor_bytes(t):
    """The bytes of t, row-major, in the machine's (little-endian) byte order."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


@dataclass
class RowPieces:
    """A tensor that write_safetensors takes in pieces, never whole: its shape and dtype, and
    `pieces`, an iterable of tensors (that dtype, any device) whose rows, one piece after the
    other, are the tensor's rows. The iterable is consumed once, a piece at a time."""
    shape: tuple
    dtype: torch.dtype
    pieces: object


def _data_bytes(path, name, t):
    """The bytes of the tensor or RowPieces t, in order, a piece at a time; refuses pieces that
    do not make up exactly t's bytes."""
    if not isinstance(t, RowPieces):
        yield _tensor_bytes(t)
        return
    expected, count = math.prod(t.shape) * t.dtype.itemsize, 0
    for piece in t.pieces:
        if piece.dtype != t.dtype or piece.shape[1:] != tuple(t.shape[1:]):
            raise CheckpointError(f"{path}: a piece of tensor {name} is {piece.dtype} {list(piece.shape)}, "
                                  f"not rows of {t.dtype} {list(t.shape)}")
        data = _tensor_bytes(piece)
        count += data.nbytes
        yield data
    if count != expected:
        raise CheckpointError(f"{path}: the pieces of tensor {name} hold {count} bytes, its shape and dtype "
                              f"{expected}")


def write_safetensors(path, tensors, metadata):
    """Write {name: tensor or RowPieces} and metadata {str: str} as a safetensors file: 8 bytes of
    little-endian header size, the JSON header (per tensor its dtype, shape and [begin, end) byte
    offsets into the data; "__metadata__"), then the tensors' bytes back to back. One pass over
    the data, which is hashed on the way into the metadata's data_sha256 (patched into the header
    at the end). Written here, not by the safetensors package, so that saving works on any image
    torch runs on; the tests read these files with that package.

    Memory: a host copy of one tensor at a time (none for a tensor already in host memory), or
    of one piece at a time for RowPieces, which is how a tensor larger than memory is written.

    The file is written under a temporary name and renamed when complete: it appears whole or not
    at all, and an existing file is never replaced.
    """
    names = sorted(tensors)
    header, offset = {}, 0
    for name in names:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{path}: tensor {name} has dtype {t.dtype}, which safetensors cannot store")
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {**metadata, "data_sha256": HASH_PLACEHOLDER}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % SAFETENSORS_HEADER_ALIGN)
    hash_key = f'"data_sha256":"{HASH_PLACEHOLDER}"'.encode()
    hash_at = 8 + text.index(hash_key) + len(hash_key) - len(HASH_PLACEHOLDER) - 1
    if os.path.exists(path):
        raise CheckpointError(f"{path} exists already; a checkpoint is never overwritten")
    partial = f"{path}.partial-{os.getpid()}"
    digest = hashlib.sha256()
    try:
        with open(partial, "xb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for name in names:
                for data in _data_bytes(path, name, tensors[name]):
                    digest.update(data)
                    f.write(data)
            f.seek(hash_at)
            f.write(digest.hexdigest().encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except OSError as e:
        raise CheckpointError(f"{write_failure(path, e)}; nothing was kept") from None
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return digest.hexdigest()


def read_safetensors(path, trust=False):
    """(tensors, metadata) of a safetensors file. Every size, shape and offset is checked before a
    byte of data is used or a tensor allocated, so a truncated, damaged or foreign file ends in one
    CheckpointError line. A data_sha256 in the metadata is checked against the data, unless
    `trust`."""
    def refuse(why):
        return CheckpointError(f"{path}: {why}")
    try:
        with open(path, "rb") as f:
            raw = bytearray(os.fstat(f.fileno()).st_size)
            del raw[f.readinto(raw):]
    except OSError as e:
        raise refuse(f"cannot read it ({e.strerror})") from None
    if len(raw) < 8:
        raise refuse(f"not a safetensors checkpoint (only {len(raw)} bytes)")
    n = struct.unpack("<Q", raw[:8])[0]
    if n > min(SAFETENSORS_MAX_HEADER, len(raw) - 8):
        raise refuse("not a safetensors checkpoint (its first 8 bytes are not a header size that fits the file)")
    try:
        header = load_json("its header", raw[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError, ConfigError):
        raise refuse("not a safetensors checkpoint (its header is not JSON of the format)") from None
    if not isinstance(header, dict):
        raise refuse("not a safetensors checkpoint (its header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise refuse("not a safetensors checkpoint (its __metadata__ is not a JSON object)")
    dtypes = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
    data = memoryview(raw)[8 + n:]
    entries, end = [], 0
    for name, entry in header.items():
        try:
            dtype, shape, (begin, stop) = dtypes[entry["dtype"]], list(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise refuse(f"tensor {name!r} has an unreadable header entry") from None
        if len(shape) > SAFETENSORS_MAX_DIMS or not all(_number(d, integer=True) and d >= 0 for d in shape) \
                or math.prod(max(d, 1) for d in shape) > SAFETENSORS_MAX_ELEMENTS:
            raise refuse(f"tensor {name!r} has shape {json.dumps(shape)[:200]}: expects at most "
                         f"{SAFETENSORS_MAX_DIMS} whole numbers >= 0 whose product (zeros counted as 1) is at most 2^48")
        if not all(_number(x, integer=True) and x >= 0 for x in (begin, stop)):
            raise refuse(f"tensor {name!r} has data_offsets {json.dumps([begin, stop])[:200]}: expects two whole "
                         f"numbers >= 0")
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise refuse(f"tensor {name!r}: its byte range does not fit its shape and dtype")
        entries.append((begin, stop, name, dtype, shape))
    for begin, stop, name, dtype, shape in sorted(entries):
        if begin != end:
            raise refuse(f"tensor {name!r} does not start where the previous one ends (a damaged file)")
        end = stop
    if end != len(data):
        raise refuse(f"truncated or damaged: its header describes {end} bytes of data, the file holds {len(data)}")
    expected = metadata.get("data_sha256")
    if expected is not None and not trust and hashlib.sha256(data).hexdigest() != expected:
        raise refuse(f"damaged: its data does not match the data_sha256 in its metadata ({TRUST_HINT})")
    tensors = {name: torch.frombuffer(data[begin:stop], dtype=dtype).reshape(shape).clone() if stop > begin
               else torch.empty(shape, dtype=dtype) for begin, stop, name, dtype, shape in entries}
    return tensors, metadata


CHECKPOINT_CHUNK_BYTES = 64 * 2**20  # a split n-gram table travels to the writer in chunks of at most this many bytes


def split_ngram_table(model):
    """This process's rows of the model's n-gram table when the table is split across the
    processes (ShardedNgramRows), else None (no table, or the whole table here or on the host)."""
    ngram = model.ngram
    return ngram.table if ngram is not None and ngram.table.shape[0] < ngram.rows else None


def row_chunks(shard):
    """The rows of `shard` as views of at most CHECKPOINT_CHUNK_BYTES (at least one row each)."""
    rows = max(1, CHECKPOINT_CHUNK_BYTES // max(1, math.prod(shard.shape[1:]) * shard.element_size()))
    return [shard[i:i + rows] for i in range(0, shard.shape[0], rows)]


def whole_table_pieces(shard, processes):
    """On rank 0, the whole n-gram table split across `processes` as RowPieces, in row order:
    rank 0's own shard, then each other rank's, received chunk by chunk (dist.recv into one
    buffer on the shard's device, the chunks send_table_shard sends). Memory beyond rank 0's
    shard: one chunk, and write_safetensors's host copy of it."""
    def pieces():
        chunks = row_chunks(shard)
        yield from chunks
        buffer = torch.empty_like(chunks[0])
        for rank in range(1, processes):
            for chunk in chunks:   # every shard has the same rows, so the same chunks
                received = buffer[:chunk.shape[0]]
                dist.recv(received, src=rank)
                yield received
    return RowPieces((shard.shape[0] * processes, *shard.shape[1:]), shard.dtype, pieces())


def send_table_shard(shard):
    """On a rank other than 0: send its shard of the n-gram table to rank 0, chunk by chunk
    (see whole_table_pieces), and wait until the device has sent the last one."""
    for chunk in row_chunks(shard):
        dist.send(chunk, dst=0)
    synchronize(shard.device)


def checkpoint_tensors(model):
    """The tensors of the model's checkpoint, {state-dict key: tensor or RowPieces}: its state
    dict, where a split n-gram table is whole (whole_table_pieces: every other rank must call
    send_table_shard at the same time). Every other tensor is replicated on every rank."""
    tensors = model.state_dict()
    shard = split_ngram_table(model)
    if shard is not None:
        tensors[NGRAM_TABLE_KEY] = whole_table_pieces(shard, model.ngram.rows // shard.shape[0])
    return tensors


def save_checkpoint(path, model, h, run_id, log_seal, val_loss, train_time_ms):
    """The trained model as logs/<run id>_model.safetensors, written by rank 0: every parameter and
    persistent buffer (the head too, tied or not; the n-gram table whole, even when it is split
    across the processes: see checkpoint_tensors), with the metadata to rebuild and judge it:
    the resolved config, whether the head is tied, the run id, the seal of the log's last line
    before the checkpoint (the log then names the checkpoint's data_sha256), the final val loss
    and train time."""
    metadata = {
        "format": CHECKPOINT_FORMAT, "config": json.dumps(config_to_dict(h)), "tied": json.dumps(model.tied),
        "run_id": run_id, "log_seal": log_seal, "val_loss": repr(val_loss), "train_time_ms": repr(train_time_ms),
    }
    return write_safetensors(path, checkpoint_tensors(model), metadata)


def load_checkpoint(path, trust=False):
    """(config, state dict, metadata) of a file written by save_checkpoint, whose data matches the
    data_sha256 of its metadata (unless `trust`), and whose config passes check_config."""
    state, metadata = read_safetensors(path, trust)
    if metadata.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path}: a safetensors file, but not a checkpoint written by train_gpt.py "
                              f"(its metadata has no format {CHECKPOINT_FORMAT!r})")
    if "data_sha256" not in metadata and not trust:
        raise CheckpointError(f"{path}: its metadata has no data_sha256, so its data cannot be verified "
                              f"({TRUST_HINT})")
    try:
        h = config_from_dict(load_json("its config", metadata["config"]))
        metadata = {**metadata, "tied": json.loads(metadata["tied"]), "val_loss": float(metadata["val_loss"]),
                    "train_time_ms": float(metadata["train_time_ms"])}
    except (KeyError, ValueError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{path}: its metadata is damaged ({e})") from None
    return normalize_config(h), state, metadata


EVAL_KEYS = ("val_files", "val_tokens", "val_tokens_per_rank", "device", "kernels", "compile", "compile_backend",
             "ngram_cache_rows")    # config keys an --eval command may override
SAMPLE_KEYS = ("device", "ngram_cache_rows")   # config keys a --sample command may override
# (--ngram_cache_rows: one process can hold, in host memory, a table trained split across several devices)


def this_process_rows(state, model):
    """The checkpoint's state dict with its whole n-gram table cut to this process's rows when
    the model's table is split across the processes (a view: no copy); else `state` as it is."""
    shard = split_ngram_table(model)
    table = state.get(NGRAM_TABLE_KEY)
    if shard is None or table is None or table.shape[0] != model.ngram.rows:
        return state
    first = model.ngram.first_row
    return {**state, NGRAM_TABLE_KEY: table[first:first + shard.shape[0]]}


def trained_model(path, overrides, allowed, trust=False):
    """A Trainer holding the checkpoint's model, put where the schedule has it at the final
    validation (windows, YaRN, head tied or not), with `overrides` ["--key=value"] of the
    `allowed` config keys applied; `trust` skips the check of its data_sha256. Returns
    (trainer, metadata)."""
    h, state, metadata = load_checkpoint(path, trust)
    for item in overrides:
        key, _, text = item.removeprefix("--").partition("=")
        if key not in allowed or not item.startswith("--") or "=" not in item:
            raise ConfigError(f"{item!r}: with a checkpoint only --key=value of {', '.join(allowed)} may be given")
        setattr(h, key, _parse_value(key, text, getattr(h, key)))
    h = normalize_config(h)
    check_config(h)
    trainer = Trainer(h, start_process(h), log=None, training=False)
    trainer.advance_to(h.num_iterations, final_validation=True)
    if trainer.model.tied != metadata["tied"]:
        raise CheckpointError(f"{path}: its head is {'tied' if metadata['tied'] else 'untied'}, but its config "
                              f"ends {'tied' if trainer.model.tied else 'untied'}: the file is damaged")
    state = this_process_rows(state, trainer.model)
    expected = trainer.model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and (state[k].shape, state[k].dtype) != (expected[k].shape,
                                                                                          expected[k].dtype)]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{path}: its tensors do not fit the model its config describes (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, other shape or dtype {wrong[:3]})")
    trainer.model.load_state_dict(state)
    return trainer, metadata


def checkpoint_arguments(parser, command):
    """Add --COMMAND=PATH (a checkpoint, not empty) and --trust_checkpoint=BOOL to `parser`."""
    def path(text):
        if not text:
            raise ConfigError(f"--{command}= names no file: give --{command}=PATH of a checkpoint (a run's "
                              f"logs/<run id>_model.safetensors)")
        return text
    parser.add_argument(f"--{command}", required=True, type=path)
    parser.add_argument("--trust_checkpoint", default=False, type=lambda text: _parse_value("trust_checkpoint",
                                                                                             text, False))


def eval_arguments(argv):
    """(PATH, the other arguments, whether to trust the file) of --eval=PATH
    [--trust_checkpoint=BOOL] [--key=value ...]."""
    parser = ArgumentParser(prog="train_gpt.py --eval=PATH")
    checkpoint_arguments(parser, "eval")
    args, rest = parser.parse_known_args(argv)
    return args.eval, rest, args.trust_checkpoint


def evaluate_checkpoint(path, overrides, trust=False):
    """Recompute the final validation of the run that wrote `path` (same tokens, windows and full
    softmax) and print its val line; with the run's config on the same machine it equals the
    logged one. Returns the val loss."""
    trainer, metadata = trained_model(path, overrides, EVAL_KEYS, trust)
    h, env = trainer.h, trainer.env
    val_slices = validation_data(h, env, shards_of(h.val_files))
    N = h.num_iterations
    with bf16_gemms(gemm_path(h, env.device)):
        val_loss = trainer.validate(val_slices, N, final_validation=True)
    if env.master:
        ms = metadata["train_time_ms"]
        print(f"step:{N}/{N} val_loss:{val_loss:.4f} train_time:{ms:.0f}ms step_avg:{ms / N:.2f}ms", flush=True)
        print(f"checkpoint of run {metadata['run_id']}: the run logged final val_loss:{metadata['val_loss']:.4f}",
              flush=True)
    return val_loss


def pick_token(logits, temperature, top_k, generator):
    """A token id drawn from softmax(logits / temperature) restricted to the top_k largest logits
    (top_k = 0: all of them); temperature 0 is greedy decoding (the argmax)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model, h, prompt_ids, max_new_tokens, temperature, top_k, seed, autocast=contextlib.nullcontext()):
    """Yield up to max_new_tokens sampled token ids that continue the document prompt_ids (which
    starts with BOS), one at a time, with a KV cache; stops after an end-of-text token. The model
    attends with the final validation's windows."""
    device = model.embed.weight.device
    model.eval()
    short, long = attention_windows(h, h.num_iterations, final_validation=True)
    args = AttentionArgs(None, short * WINDOW_BLOCK, long * WINDOW_BLOCK, KVCache(len(prompt_ids) + max_new_tokens))
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor(prompt_ids, dtype=torch.int32, device=device)
    for _ in range(max_new_tokens):
        with autocast:
            logits = model.next_token_logits(tokens, args)
        token = pick_token(logits, temperature, top_k, generator)
        yield token
        if token == BOS_ID:
            return
        tokens = torch.tensor([token], dtype=torch.int32, device=device)


def sample_from_checkpoint(argv):
    """--sample=PATH --prompt=TEXT [--max_new_tokens --temperature --top_k --seed --device]:
    print the prompt, then the continuation as it is generated."""
    parser = ArgumentParser(prog="train_gpt.py --sample=PATH")
    checkpoint_arguments(parser, "sample")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not math.isfinite(args.temperature) \
            or not 0 <= args.seed < 2**63:
        raise ConfigError("--sample expects --max_new_tokens >= 1, a finite --temperature >= 0, --top_k >= 0 and "
                          "--seed in [0, 2^63)")
    enc = gpt2_encoding()
    trainer, _ = trained_model(args.sample, rest, SAMPLE_KEYS, args.trust_checkpoint)
    prompt_ids = [BOS_ID] + enc.encode_ordinary(args.prompt)
    positions = trainer.model.max_tokens
    if len(prompt_ids) + args.max_new_tokens > positions:
        raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) and --max_new_tokens={args.max_new_tokens} exceed "
                          f"the {positions} positions this model has tables for")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    print(args.prompt, end="", flush=True)
    count, t0 = 0, time.perf_counter()
    with bf16_gemms(gemm_path(trainer.h, trainer.env.device, compiling=False)):
        for token in generate(trainer.model, trainer.h, prompt_ids, args.max_new_tokens, args.temperature, args.top_k,
                              args.seed, trainer.autocast):
            count += 1
            if token != BOS_ID:
                print(text.decode(enc.decode_single_token_bytes(token)), end="", flush=True)
    print(text.decode(b"", final=True), flush=True)
    elapsed = time.perf_counter() - t0
    print(f"[{count} tokens in {elapsed:.1f} s: {count / elapsed:.1f} tokens/s]", file=sys.stderr, flush=True)
    return 0


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: the run stops and its log says where."""

    def __init__(self, signal_name):
        super().__init__(signal_name)
        self.signal_name = signal_name


EXIT_USER_ERROR = 2                # a bad input or environment: one `error:` line says what to do
SIGNAL_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}  # 128 + the signal number, as shells report them
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write failed for want of room (write_failure)


def stop_on_signals():
    """SIGINT and SIGTERM raise Interrupted in the main thread; a file-size limit makes a write
    fail with an error (EFBIG) instead of killing the process without a word (SIGXFSZ)."""
    def interrupt(signum, frame):
        raise Interrupted(signal.Signals(signum).name)
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def stop(log, line, code, show=True):
    """End the run: `line` as the log's last line (if there is a log and room), and on stderr when
    `show`. A line a log cannot hold (a file name with a line break in an error) is escaped as in
    JSON, so that it stays one line."""
    line = line if loggable(line) else json.dumps(line)[1:-1]
    if log is not None:
        log.write_last_line(line)
        if log.writer is not None:
            line += f" (log: {log.path})"
    if show:
        print(line, file=sys.stderr, flush=True)
    return code


def peer_exited(launch, error):
    """Whether the RuntimeError `error` of a collective means that a peer process ended: it
    reported an error (failed_peer), or gloo found its socket closed."""
    return dist.is_initialized() and (GLOO_PEER_CLOSED in str(error) or failed_peer(launch) is not None)


def where_the_run_is(log, command):
    """Where a stopped process was, for its line: the log's progress, or the command."""
    return log.progress if log is not None else (f"during --{command}" if command else "before training")


def cpu_threads():
    """The threads of one CPU process: OMP_NUM_THREADS when set, else this process's cores shared
    by the processes of its machine (LOCAL_WORLD_SIZE)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    local_procs = launch_environment().local_world_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores // local_procs)


def start_process(h):
    """This process's rank and device (see setup_distributed), with the CPU settings of a CPU run."""
    env = setup_distributed(h)
    if env.device.type == "cpu":
        keep_freed_memory_for_reuse()
        torch.set_num_threads(cpu_threads())
    return env


def plan_command(argv):
    """--plan [--gpus=N --gpu_gib=X --host_gib=Y] [train_gpt.py arguments]: print launch_plan's
    answer for this machine (or for N GPUs of X GiB and Y GiB of host memory), in three lines:
    the processes, the preset arguments, the reason. run.sh asks it."""
    parser = ArgumentParser(prog="train_gpt.py --plan", allow_abbrev=False)
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--gpus", type=int, default=None)
    parser.add_argument("--gpu_gib", type=float, default=None)
    parser.add_argument("--host_gib", type=float, default=None)
    args, rest = parser.parse_known_args(argv)
    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    if gpus < 1:
        raise ConfigError("--plan is for GPUs and this machine has none: ./run.sh runs the cpu preset here")

    def available(device):
        given = args.gpu_gib if device.type == "cuda" else args.host_gib
        return available_memory_bytes(device) if given is None else int(given * 2**30)
    preset_args, processes, reason = launch_plan(gpus, rest, available)
    print(processes, " ".join(preset_args), reason, sep="\n")
    return 0


def checkpoint_command(argv):
    """"eval" or "sample" when argv asks to use a checkpoint (--eval=PATH, --sample=PATH), else None."""
    for item in argv:
        for command in ("eval", "sample"):
            if item.startswith(f"--{command}=") or item == f"--{command}":
                return command
    return None


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    log, command, launch = None, None, None
    try:
        launch = launch_environment()
        stop_on_signals()
        command = checkpoint_command(argv)
        if "--plan" in argv:
            return plan_command(argv)
        if command == "sample":
            return sample_from_checkpoint(argv)
        if command == "eval":
            path, rest, trust = eval_arguments(argv)
            evaluate_checkpoint(path, rest, trust)
            return 0
        h = parse_config(argv)
        env = start_process(h)
        log = RunLog(h.log_dir, env.master)
        with bf16_gemms(gemm_path(h, env.device)):
            train(h, env, log)
        return 0
    except Interrupted as e:
        return stop(log, interruption_line(launch, e.signal_name, where_the_run_is(log, command)),
                    SIGNAL_EXIT_CODES[e.signal_name], shows_interruptions(launch))
    except (ConfigError, DataError, ShardError, TrainingError, optim.OptimConfigError, CheckpointError,
            TokenizerError) as e:
        return stop(log, f"{ERROR_PREFIX}{e}", EXIT_USER_ERROR, report_error(launch, f"{ERROR_PREFIX}{e}"))
    except LogWriteError as e:
        return stop(None, f"{ERROR_PREFIX}{e}", EXIT_USER_ERROR, report_error(launch, f"{ERROR_PREFIX}{e}"))
    except OSError as e:
        path = e.filename or "a file"
        line = ERROR_PREFIX + (write_failure(path, e) if e.errno in DISK_FULL_ERRNOS else f"{path}: {e.strerror}")
        return stop(log, line, EXIT_USER_ERROR, report_error(launch, line))
    except RuntimeError as e:
        if not peer_exited(launch, e):
            raise
        return stop(log, interruption_line(launch, None, where_the_run_is(log, command)), EXIT_USER_ERROR,
                    shows_interruptions(launch))
    finally:
        if log is not None:
            log.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
