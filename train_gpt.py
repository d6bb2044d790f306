"""Train a GPT-2-small-class language model on FineWeb as fast as possible.

This file is the recipe a record changes. Read top-down: the presets; the model; the schedules;
the kernels and optimizers a run picks; the Trainer and the training loop; main(). Beside it:
kernels.py (Triton kernels and their references), optim.py (the optimizers), data/ (the shards
and the loader that packs them), machinery/ (the config's schema, the n-gram table's hashes and
placement, the sampled softmax's candidates, CUDA graphs, the memory budget and launch, how a
command ends, the checkpoint format: docs/README.md lists them),
evaluation/ (a checkpoint's validation, sampling, downstream tasks), records/logfile.py (the run log).

    ./run.sh                                              # picks the preset for this machine
    python train_gpt.py --plan                            # what run.sh starts here, and why (launch_plan)
    python train_gpt.py --plan --gpus=1 --gpu_gib=23.6    # ... on another machine (docs/gpu.md)
    python train_gpt.py --help                            # every config key: type, range, meaning
    python train_gpt.py --preset cpu                      # CPU track, tiny offline corpus
    python -m torch.distributed.run --standalone --nproc_per_node=8 train_gpt.py --preset speedrun
    python train_gpt.py --preset cpu --num_iterations=50 --seed=1   # any config key: --key=value

Presets: `speedrun` (8 GPUs), `frontier` (speedrun with the open pull requests' techniques: a stack
no run has measured), `1gpu` (the same global batch on fewer GPUs by gradient
accumulation: on one, the n-gram table in host memory; with --ngram_cache_rows=0, split across
2 or 4), `1gpu_24gb` (one 24 GB card: a smaller table, 4 micro-batches a slice), `cpu` (the CPU
track), `record89` (a control run), `medium` (the GPT-2 medium track), `optimization` (the
optimization track's fixed setup). Every run writes logs/<run id>.txt: the
verbatim source of every project file it imported, the environment, the data fingerprints, the
resolved config, then step lines.
"""
import contextlib
import functools
import gc
import itertools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, replace

# The oldest Python the pinned requirements install on (numpy 2.4.6 and scipy 1.17.1 ship no
# wheels for 3.10), checked before any package is imported: an older one ends with this line.
if sys.version_info < (MIN_PYTHON := (3, 11)):
    print(f"error: train_gpt.py needs Python {'.'.join(map(str, MIN_PYTHON))} or newer (the pinned numpy and scipy "
          f"have no wheels for older ones); this is Python {'.'.join(map(str, sys.version_info[:3]))} at "
          f"{sys.executable}: run it with a newer one (./run.sh takes PYTHON=python3.11)", file=sys.stderr)
    sys.exit(2)

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import record_function

import kernels
import optim
from data.loader import BatchPrefetcher, TrainLoader, check_validation_split, shards_of, validation_data
from data.shards import fingerprint
from data.tokenizer import BOS_ID, prefix_token_table
from machinery import backward_windows, command_line, config, kernel_choice, memory_budget, metrics, resume
from machinery.canonical_mask import NoncanonicalPairs
from machinery.checkpoint import save_checkpoint, send_table_shard, split_ngram_table
from machinery.config import (FINAL_MIX_GROUPS, MAX_TARGETS, MODEL_FIELDS, PADDED_VOCAB_SIZE, POINTER_COPY_ID,
                              SMEAR_GATE_DIMS, VOCAB_SIZE, WINDOW_BLOCK, Average, Hyperparameters, ModelConfig, Stage,
                              TablePhase, config_to_dict, head_dims, injection_layers, value_embed_tables,
                              value_embed_width)
from machinery.cpu_runtime import bf16_gemm_path, cpu_has_native_bf16
from machinery.cuda_graphs import MicroBatch, StepGraphs
from machinery.kernel_set import KernelFns, select_kernels
from machinery.kv_cache import KVCache, cached_attention
from machinery.ngram_table import (SIGN_ROWS, SIGN_TABLE_SEED, NgramTable, TablePlacement, bigram_rows,
                                    bigram_sign_rows, first_rows, normalized_ids, token_starts)
from machinery.processes import ProcessGroup, synchronize
from machinery.progress import Progress, RunClock
from machinery.run_report import (DeferredLossLines, check_finite, environment, peak_memory_mib,
                                  run_threads, start_load_note, target_line, validation_progress,
                                  write_execution_lines, write_load_lines, write_loss_lines)
from machinery.sampled_softmax import (candidate_columns, candidate_start, candidate_walk_after, copy_column,
                                        ids_to_columns)
from machinery.sparse_tables import SparseTables, check_ngram_table
from machinery.warm_up import compiled_graphs, host_syncs_are_errors, warm_up, warm_up_line
from records.logfile import RunLog, load_average, project_sources

REPO_DIR = os.path.dirname(os.path.abspath(__file__))

# -----------------------------------------------------------------------------------------------
# Presets
# -----------------------------------------------------------------------------------------------

def _project_rules(h):
    """This project's rules where the public records differ; the presets named for a record take
    the record's (docs/recipe.md's fidelity table compares them)."""
    h.target_rule, h.attention_segment_tokens = "document", 0
    h.paired_head_layout, h.window_edge_key, h.attn_out_init, h.narrow_yarn_window = "adjacent", False, "zero", "long"
    h.cross_documents, h.table_hashes = False, "project"
    h.mlp_free_layers, h.x0_layers, h.hashed_layers = (), None, None
    h.final_mix, h.value_embed_full_width = "record89", False
    _past_record_92_off(h)


def _past_record_92_off(h):
    """The open pull requests' techniques off (docs/recipe.md's techniques off in every preset but
    frontier): the n-gram hashes read the tokens as they are (PR 375's normalization), the head's
    weight gradient and the attention backward exact on every step (PR 371), no pointer mixture
    (PR 379; its head's size, bands and LR at PR 379's values), no document copy feature (PR 378,
    off in frontier too; its LR PR 378's Adam LR)."""
    h.ngram_normalized = False
    h.head_grad_stride, h.head_grad_start, h.approx_exact_last_steps = 1, 0, 0
    h.attn_bwd_windows, h.attn_bwd_error_bound, h.attn_bwd_choice_steps, h.attn_bwd_start = (), 0.2, (), 0
    h.pointer_mixture, h.pointer_dim, h.pointer_band, h.pointer_val_band, h.pointer_lr = False, 128, 2048, 8192, 0.008
    h.document_copy, h.document_copy_lr = False, 0.008


def _shared_constants(h):
    """Keys every preset but speedrun gives one value, set before the preset's own: ANVIL's rails
    and mu schedule and AdamW's matrix LR (read only by those optimizers), the token gates' and
    dense connections' LRs (record 89), the tables' Adam when a preset has no table, a candidate
    walk that restarts each step, the averages' norms per matrix, optimizer lanes and LR factors
    from each matrix's own shape, Adam's eps for the mean loss, and the FP8 scale rules."""
    h.anvil_fast_beta, h.anvil_slow_beta, h.anvil_blend, h.anvil_blend_start = 0.85, 0.98, 0.4385, 0.43
    h.anvil_mu_low, h.anvil_mu_high, h.anvil_mu_rise, h.anvil_mu_fall = 0.85, 0.93, 0.2, 0.042
    h.anvil_fast_beta_follows_mu, h.value_embed_table_cadence, h.adamw_matrix_lr = False, False, 0.008
    h.token_gate_lr, h.dense_lr, h.gate_wd, h.gate_mlp_wd = 0.0008, 0.002, 0.0, 0.0
    h.ngram_lr, h.ngram_wd, h.ngram_beta2, h.ngram_step_every, h.table_phases = 0.01, 0.0, 0.95, 1, []
    h.candidate_walk, h.average_norms, h.matrix_shapes, h.adam_eps_unit = "restart", "matrix", "own", "mean"
    h.fp8_mlp_scales, h.fp8_qkv_scales, h.fp8_head_scales = "record92", "project", "record89"


def _cpu_preset(h):
    """The CPU track's current record (PointerMixture20Steps), its whole recipe: a 4-layer,
    width-256 model with the hashed n-gram table and the pointer mixture on the tiny corpus, 2
    cores, under a minute. Each choice's
    measurement is under the heading named beside it, in bench/results/ (2026-12-01_cpu-epyc.md,
    2026-12-01_cpu-epyc-avx512bf16.md, 2026-12-01_cpu.md or 2026-12-02_cpu-xeon.md).

    The full softmax throughout (at this scale a sampled softmax learns much more slowly per
    step: "Two earlier cpu-preset measurements"); validation without the canonical mask
    (the track's rule is the full softmax, as the baseline's). The compute dtype is the CPU's
    fast one: bf16 where it has bf16 units (AVX512-BF16 or AMX), fp32 elsewhere, where a bf16
    product runs as an fp32 GEMM plus casts (machinery/cpu_runtime.py); the val loss is the same either way.
    """
    _project_rules(h)
    _shared_constants(h)
    h.track = "track_cpu"
    h.train_files = "data/tiny_corpus/tiny_train_*.bin"
    h.val_files = "data/tiny_corpus/tiny_val_*.bin"
    h.val_tokens, h.val_tokens_per_rank, h.batch_ranks = 65_536, 8_192, 1

    # model: 4 layers of 256, 2 heads of 128, a U-net trunk; none of record 89's per-layer
    # features (within the seeds' spread at this scale: docs/recipe.md)
    h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden = 4, 256, 2, 128, 1024
    h.long_window_layers, h.attention_free_layers = (3,), ()
    h.narrow_qk_layers, h.narrow_qk_dim = (0, 1, 2), 64  # QK 64 with full RoPE on the short layers
    h.narrow_qk_attn_scale, h.attn_scale = 0.13, 0.1     # ("record-89/92 constants ...")
    h.narrow_vo_layers, h.narrow_vo_dim, h.parallel_mlp_layers = (), 64, ()
    h.rope_base, h.yarn_scale_growth, h.embed_init_std = 1024.0, 0.1, 0.0  # embedding std model_dim^-0.5
    h.smear_gate, h.key_offset, h.xsa_layers, h.paired_head_layers = False, False, (), ()
    h.token_gates, h.token_gates_split, h.attn_gate_layers = False, 4, ()
    h.composed_layers, h.composed_window = (), 112
    h.trunk, h.skip_layers, h.snapshot_layer = "unet", (3, 6), 7  # (the skips and snapshot: dense trunk only)
    # one value-embedding table, its rows of the batch only by the tables' sparse Adam ("sparse
    # value embeddings at 26 steps, 5 seeds, with the tanh cross-entropy")
    h.num_value_embeds, h.value_embed_layers, h.value_embed_sparse = 1, (), True
    h.value_embed_gate_dim, h.value_embed_gate_reads_value = 12, False
    # the hashed bigram+trigram table ("the hashed bigram+trigram table"); bigram_rows: with --ngram_rows=0
    h.ngram_rows, h.ngram_dtype, h.bigram_rows = 1 << 20, "float32", 8192
    h.canonical_mask = False
    # the pointer mixture ("the pointer mixture's fewest steps ..."); its band the longest document a
    # step trains on (max_doc_len), so that every query sees its whole document
    h.pointer_mixture, h.pointer_band = True, 1024
    h.param_dtype = "float32"
    h.compute_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    h.fp8_mlp = h.fp8_qkv = h.fp8_head = True  # (FP8 layers only on a GPU, or with --fp8_on_cpu)

    # schedule: 20 steps, twice the batch from the middle (LR x1.52 = (4096/2048)^0.6, as record 89
    # scales it); the cooldown from 40% to 0.15; untied at 2/3
    h.num_iterations = 20          # the fewest that beat the target ("the pointer mixture's fewest steps ...")
    h.stages = [
        Stage(end=0.5, tokens_per_rank=2048, max_doc_len=512, short_window=1, long_window=2,
              mtp_weights=(1.0, 0.5, 0.25), prefix_weight=0.25),
        Stage(end=0.8, tokens_per_rank=4096, max_doc_len=1024, short_window=2, long_window=4,
              mtp_weights=(1.0, 0.5), prefix_weight=0.25, lr_mult=1.52),
        Stage(end=1.0, tokens_per_rank=4096, max_doc_len=1024, short_window=2, long_window=6, lr_mult=1.52),
    ]
    h.val_long_window, h.yarn_at_final_window = 8, True
    h.untie_frac = 2 / 3
    h.cooldown_start, h.cooldown_end, h.cooldown_floor = 0.4, 1.0, 0.15
    h.averages = []

    # optimizers: NorMuon for the matrices ("NorMuon at 25 steps on the SparseValueEmbeds26Steps preset")
    h.optimizer, h.orthogonalize = "normuon", "auto"
    h.matrix_lr, h.matrix_wd, h.mlp_down_lr_scale = 0.05, 0.0, 2.0
    h.qk_ortho_heads = 1           # queries and keys orthogonalized per head ("record-89/92 constants ...")
    h.momentum, h.momentum_warmup_start, h.momentum_warmup_steps, h.momentum_cooldown_steps = 0.95, 0.85, 300, 0
    h.embed_lr, h.value_embed_lr, h.head_lr = 0.02, 0.02, 0.016  # ("steps, Adam LRs, ...")
    h.scalar_lr = h.gate_lr = h.smear_gate_lr = 0.04
    # record 89's Adam betas and decay ("record-89 Adam betas and decay, fewer steps")
    h.embed_betas, h.value_embed_betas, h.scalar_betas = (0.5, 0.95), (0.75, 0.95), (0.9, 0.99)
    h.resid_scale_lr, h.post_scale_lr, h.scale_betas = h.scalar_lr, h.scalar_lr, h.scalar_betas
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5
    h.adam_eps, h.adam_step_every = 1e-10, 1
    # the tables' sparse Adam at twice the default LR ("the hashed bigram+trigram table")
    h.ngram_lr, h.ngram_wd, h.ngram_beta2, h.ngram_step_every, h.table_phases = 0.02, 0.0, 0.95, 1, []

    # the run on a CPU
    h.log_every = 5
    h.compile = False              # inductor saves less than the drift ("Eager against compiled, interleaved")
    h.warm_up, h.warmup_steps = "always", 1  # map each shape's memory untimed ("the n-gram table's cost: ...")
    h.cuda_graphs = False          # no launches to save on a CPU; the replay's buffers cost time ("Two earlier ...")


def fixed_track_config(h, track):
    """Set what a steps-ranked track fixes (records/<track>/track.json's fixed_config: the model,
    the data, the batch, the objective), the one place those values live."""
    with open(os.path.join(REPO_DIR, "records", track, "track.json")) as f:
        config.config_from_dict(json.load(f)["fixed_config"], base=h)


def _cpu_optimization_preset(h):
    """The CPU optimization track's setup: what every entry runs, read from its track.json (the
    cpu preset's model, data and batch schedule as the track's first records ran them, with the
    value embeddings under dense Adam), and the first records' optimizer, which an entry changes:
    ANVIL at 27 steps, the LRs and schedule of that cpu preset."""
    _project_rules(h)
    _shared_constants(h)
    h.track = "track_3_cpu_optimization"
    fixed_track_config(h, h.track)
    h.num_iterations, h.val_tokens_per_rank = 27, 8_192
    h.cooldown_start, h.cooldown_end, h.cooldown_floor, h.averages = 0.4, 1.0, 0.15, []
    h.optimizer, h.orthogonalize = "anvil", "auto"   # auto: polar_express for an entry's muon or normuon
    h.matrix_lr, h.matrix_wd, h.mlp_down_lr_scale, h.qk_ortho_heads = 0.05, 0.0, 2.0, 1
    h.momentum, h.momentum_warmup_start, h.momentum_warmup_steps, h.momentum_cooldown_steps = 0.95, 0.85, 300, 0
    h.embed_lr, h.value_embed_lr, h.head_lr = 0.02, 0.02, 0.016
    h.scalar_lr = h.gate_lr = h.smear_gate_lr = 0.04
    h.embed_betas, h.value_embed_betas, h.scalar_betas = (0.5, 0.95), (0.75, 0.95), (0.9, 0.99)
    h.resid_scale_lr, h.post_scale_lr, h.scale_betas = h.scalar_lr, h.scalar_lr, h.scalar_betas
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5
    h.adam_eps, h.adam_step_every = 1e-10, 1
    h.ngram_lr, h.ngram_wd, h.ngram_beta2, h.ngram_step_every, h.table_phases = 0.02, 0.0, 0.95, 1, []
    h.embed_init_std = 0.0
    h.compute_dtype = "bfloat16" if cpu_has_native_bf16() else "float32"
    h.log_every, h.compile, h.cuda_graphs = 5, False, False
    h.warm_up, h.warmup_steps = "always", 1


# Record 92's sampled softmax: candidate columns per stage (steps 0-680, then the thirds of 681-1106:
# 14,336 for the first two, 24,576 for the last), the full vocabulary from step 1107.
SOFTMAX_EARLY, SOFTMAX_LATE, SOFTMAX_LAST = 10_240, 14_336, 24_576
NGRAM_RECORD_ROWS = 84_602_880     # record 92's n-gram table: 10,575,360 rows on each of 8 GPUs
NGRAM_LATE_STEP = 336              # record 92's step from which the tables' beta2 is squared, an update every 4th
RECORD92_VO_MLP_BLEND = 0.55 - 0.2007  # record 92: the banks' blend less its Richardson correction for V, O, MLP
ATTENTION_SEGMENT_TOKENS = 2560    # record 92: documents longer than this attend in segments this long


def _speedrun_preset(h):
    """Record 92, the whole recipe: record 89's features and constants on record 92's model and
    schedule. Its layers keep records 89's and 92's numbers, 0-10: record 92 removed layer 7's
    attention and MLP, and the layer keeps its two residual scales and its x0 injection.
    docs/recipe.md compares it with record 92's code part by part and lists what still differs."""
    h.track = "track_1_short"
    _past_record_92_off(h)
    # data: FineWeb's GPT-2 tokens, judged on the first 10,485,760 of the val shard
    h.train_files = "data/fineweb10B/fineweb_train_*.bin"
    h.val_files = "data/fineweb10B/fineweb_val_*.bin"
    h.val_tokens, h.val_tokens_per_rank, h.batch_ranks = 10_485_760, 262_144, 8  # val_batch_size 4 x 64 x 1024 x 8
    h.target_rule, h.attention_segment_tokens = "packed", ATTENTION_SEGMENT_TOKENS

    # model: 11 layers of 768, 6 heads of 128; 7 attention sublayers, 10 MLPs
    h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden = 11, 768, 6, 128, 2816
    h.attention_free_layers = (4, 6, 7, 9)     # attention on 0, 1, 2, 3, 5, 8, 10
    h.mlp_free_layers = (7,)                   # layer 7: its residual scales and x0 injection only
    h.long_window_layers = (3, 10)
    h.narrow_qk_layers, h.narrow_qk_dim = (0, 1, 2, 5, 8), 64  # QK 64 with full RoPE
    h.narrow_qk_attn_scale, h.attn_scale = 0.13, 0.085  # the QK-64 layers' scale; 0.085 on the QK-128 layers
    h.narrow_yarn_window = "short"             # the QK-64 layers' YaRN follows the short window
    h.narrow_vo_layers, h.narrow_vo_dim = (1, 8), 64
    h.parallel_mlp_layers = (8,)
    h.rope_base, h.yarn_scale_growth = 1024.0, 0.2  # RoPE base period; YaRN scale x (1 + 0.2 ln(growth))
    h.embed_init_std = 0.005                   # the head's init, which the tied embedding copies
    # record 89's features, on the layers that still have attention
    h.smear_gate, h.key_offset = True, True
    h.cross_documents, h.table_hashes = True, "record"  # the smear, key offset and hashes see the slice, not documents
    h.num_value_embeds, h.value_embed_layers = 0, (1, 2, 8, 10)  # record 89's, but 9 (no attention)
    h.value_embed_gate_dim, h.value_embed_gate_reads_value = 12, True  # gates read x[:6] and ve[:6]
    h.xsa_layers = (1, 3)                      # record 89's, but 4 and 7 (no attention)
    h.paired_head_layers = (0, 2, 5)           # record 89's, but 9 (no attention)
    h.paired_head_layout, h.window_edge_key, h.attn_out_init = "record", True, "uniform"
    h.token_gates, h.token_gates_split = True, 4  # XSA strengths, output gates, x0 and bigram injection per token
    h.attn_gate_layers = (3, 10)
    h.composed_layers, h.composed_window = (), 112  # record 92 has no composed attention (record 89: on 10)
    h.trunk, h.skip_layers = "dense", (3, 6)   # per-sublayer scales, the skip from 3 into 6, dense connections
    h.snapshot_layer = 7                       # the layers after 7 read its output
    h.x0_layers = (0, 1, 2, 4, 5, 7)           # record 92's injection sites: x0 after these layers,
    h.hashed_layers = (0, 1, 4, 5, 9)          # the n-gram embedding after these (layer 0's before it)
    # record 92's hashed n-gram table, split across the GPUs (bigram_rows: the table when ngram_rows=0)
    h.ngram_rows, h.ngram_dtype, h.bigram_rows = NGRAM_RECORD_ROWS, "bfloat16", 251_520
    # record 92's final mix adds every value-embedding table, so its tables of layers 1 and 8 are
    # 768 wide (the narrow-value layers read the leading half of each head)
    h.value_embed_full_width, h.final_mix = True, "record92"
    h.canonical_mask = True        # record 92 validates with the canonical mask
    # precision: bf16 weights and activations (fp32 in the optimizers' sidecars), FP8 MLP, QKV, head
    h.param_dtype, h.compute_dtype = "bfloat16", "bfloat16"
    h.fp8_mlp, h.fp8_qkv, h.fp8_head, h.fp8_mlp_scales = True, True, True, "record92"
    h.fp8_qkv_scales, h.fp8_head_scales = "record92", "record92"

    # schedule: record 92's 1194 steps (1122 scheduled + 52 grown into the third stage + 20 at the
    # end); its third stage in two here, where its sampled softmax widens for the last third
    h.num_iterations = N = 1194
    h.stages = [
        Stage(end=320 / N, tokens_per_rank=16_384, max_doc_len=896, short_window=1, long_window=3,
              mtp_weights=(1.0, 0.5, 0.25), mtp_weights_end=(1.0, 0.5, 0.0), prefix_weight=0.25,
              candidates=SOFTMAX_EARLY, lr_mult=1.0),
        Stage(end=681 / N, tokens_per_rank=32_768, max_doc_len=2048, short_window=3, long_window=7,
              mtp_weights=(1.0, 0.5), mtp_weights_end=(1.0, 0.0), prefix_weight=0.20, prefix_weight_end=0.05,
              prefix_weight_levels=4, candidates=SOFTMAX_EARLY, lr_mult=1.52),   # prefix 0.20/0.15/0.10/0.05
        Stage(end=965 / N, tokens_per_rank=49_152, max_doc_len=3072, short_window=5, long_window=11,
              candidates=SOFTMAX_LATE, lr_mult=1.73),
        Stage(end=1107 / N, tokens_per_rank=49_152, max_doc_len=3072, short_window=5, long_window=11,
              candidates=SOFTMAX_LAST, lr_mult=1.73),
        Stage(end=1174 / N, tokens_per_rank=40_960, max_doc_len=3072, short_window=5, long_window=11,
              lr_mult=1.73 * (20 / 24) ** 0.5),   # the taper: 20 of the 24 units, the LR scaled by sqrt
        Stage(end=1.0, tokens_per_rank=16_384, max_doc_len=3072, short_window=6, long_window=13),
    ]
    h.candidate_walk = "continue"  # each step's negatives follow the last sampled step's in the walk
    h.val_long_window, h.yarn_at_final_window = 20, False  # the final window widens, the rotary tables stay
    h.untie_frac = 1176 / N        # record 92 unties after step 1175's update: 1176 is the first untied step
    h.cooldown_start, h.cooldown_end, h.cooldown_floor = 234 / N, 1174 / N, 0.30  # int(0.2 x 1174), to the floor
    h.averages = [                 # record 92's "ships", blended in this order, then the banks' norms restored
        Average("embed_head", window=298, rate=2 / 299, blend=0.65, renormalize=True),
        Average("vo_mlp", window=250, every=4, rate=4 / 53),   # replaced by their tail average
        Average("value_embeds", window=250, every=4, offset=2, rate=4 / 53),  # at their updates (steps 3 mod 4)
        Average("qk", window=298, every=4, rate=2 / 75, blend=0.55, renormalize=True, last_steps=2),
        Average("vo_mlp", window=298, every=4, rate=2 / 75, blend=RECORD92_VO_MLP_BLEND, renormalize=True,
                last_steps=2),
    ]
    h.average_norms = "bank"

    # optimizers: ANVIL for the matrices (queries and keys orthogonalized per pair of heads), its
    # LR factors and lanes from the matrices' shapes in record 92's banks
    h.optimizer, h.orthogonalize, h.matrix_shapes = "anvil", "anvil", "record_banks"
    h.matrix_lr, h.matrix_wd, h.mlp_down_lr_scale, h.qk_ortho_heads = 0.023, 2.25, 2.0, 2
    h.anvil_fast_beta, h.anvil_slow_beta = 0.85, 0.98
    h.anvil_blend, h.anvil_blend_start = 0.4385, 514 / N  # the fast rail's weight from step 514
    h.anvil_fast_beta_follows_mu = True                  # before it, the fast rail alone, at beta mu
    h.anvil_mu_low, h.anvil_mu_high = 0.85, 0.93       # Nesterov mu: 0.85 -> 0.93 over 240 steps,
    h.anvil_mu_rise, h.anvil_mu_fall = 240 / N, 50 / N  # back to 0.85 over the last 50
    h.momentum, h.momentum_warmup_start, h.momentum_warmup_steps, h.momentum_cooldown_steps = 0.95, 0.85, 300, 0
    h.adamw_matrix_lr = 0.008      # (--optimizer=adamw: Adam's LR for the matrices)
    # Adam: base LR 0.008 and decay 0.005 times per-group multipliers (the decay scales with lr^2),
    # an update on odd steps only, eps for the summed loss's gradient
    h.embed_lr = h.head_lr = 0.008
    h.value_embed_lr = 0.008 * 70  # value embeddings and the n-gram table
    h.scalar_lr, h.gate_lr, h.smear_gate_lr = 0.008 * 5, 0.008, 0.008 * 0.01
    h.token_gate_lr, h.dense_lr = 0.0008, 0.002
    h.embed_betas, h.value_embed_betas, h.scalar_betas = (0.5, 0.95), (0.75, 0.95), (0.9, 0.99)
    # the dense trunk's residual scales (LR x5) and output scales (x1), betas (0.9, 0.95); the
    # value-embedding gates and the gate and dense-connection MLPs' weights decayed as Adam's default
    h.resid_scale_lr, h.post_scale_lr, h.scale_betas = 0.008 * 5, 0.008, (0.9, 0.95)
    h.gate_wd = h.gate_mlp_wd = 0.005
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5
    h.adam_eps, h.adam_step_every, h.adam_eps_unit = 1e-10, 2, "token_sum"
    # the tables: the n-gram table's sparse Adam and the value embeddings' dense Adam, on odd steps,
    # then every 4th from step 336 with both betas squared and the decay doubled
    h.ngram_lr, h.ngram_wd, h.ngram_beta2, h.ngram_step_every = 0.008 * 70, 0.005 * 5, 0.95, 2
    h.value_embed_sparse, h.value_embed_table_cadence = False, True
    h.table_phases = [TablePhase(start=NGRAM_LATE_STEP, ngram_beta2=0.95 ** 2, value_embed_beta2=0.95 ** 2,
                                 step_every=4, value_embed_beta1=0.75 ** 2, decay_mult=2.0)]


def _record89_preset(h):
    """Record 89, the control run, its whole recipe on this code: 11 layers, the bigram table,
    1270 scheduled steps in three equal stages plus 15 at the final windows and LR, NorMuon with
    Polar Express, the cooldown from 40% of the scheduled steps to 0.15, no canonical mask, no
    sampled softmax, no averages."""
    _shared_constants(h)
    h.track = "track_1_short"
    _past_record_92_off(h)
    h.train_files = "data/fineweb10B/fineweb_train_*.bin"
    h.val_files = "data/fineweb10B/fineweb_val_*.bin"
    h.val_tokens, h.val_tokens_per_rank, h.batch_ranks = 10_485_760, 262_144, 8  # val_batch_size 4 x 64 x 1024 x 8
    h.target_rule, h.attention_segment_tokens = "packed", 0

    # model: 11 layers of 768, 6 heads of 128, MLP 3072; no attention on layer 6
    h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden = 11, 768, 6, 128, 3072
    h.attention_free_layers, h.long_window_layers = (6,), (3, 10)
    h.narrow_qk_layers, h.narrow_qk_dim, h.narrow_qk_attn_scale = (), 64, 0.13  # QK 128 everywhere
    h.narrow_vo_layers, h.narrow_vo_dim, h.parallel_mlp_layers = (), 64, ()
    h.attn_scale, h.rope_base, h.yarn_scale_growth = 0.1, 1024.0, 0.2
    h.embed_init_std = 0.005       # the head's init, which the tied embedding copies
    h.smear_gate, h.key_offset, h.cross_documents, h.table_hashes = True, True, True, "record"
    h.num_value_embeds, h.value_embed_layers = 0, (1, 2, 8, 9, 10)  # five tables, one per layer
    h.value_embed_gate_dim, h.value_embed_gate_reads_value = 12, True  # gates read x[:6] and ve[:6]
    h.value_embed_sparse = False
    h.xsa_layers, h.paired_head_layers = (1, 3, 4, 7), (0, 2, 5, 9)
    h.paired_head_layout, h.window_edge_key, h.attn_out_init, h.narrow_yarn_window = "record", True, "uniform", "long"
    h.token_gates, h.token_gates_split = True, 4  # XSA strengths, output gates, x0 and bigram injection per token
    h.attn_gate_layers = (3, 10)
    h.composed_layers, h.composed_window = (10,), 112
    h.trunk, h.skip_layers, h.snapshot_layer = "dense", (3, 6), 7
    h.mlp_free_layers, h.x0_layers, h.hashed_layers = (), None, None  # injections after every attention layer
    h.final_mix, h.value_embed_full_width = "record89", True
    h.ngram_rows, h.ngram_dtype, h.bigram_rows = 0, "float32", 50304 * 15 // 2  # the bigram table: 377,280 rows
    h.canonical_mask = False
    # precision: record 89's bf16 weights and activations; FP8 MLP forward and head, QKV in bf16
    h.param_dtype, h.compute_dtype = "bfloat16", "bfloat16"
    h.fp8_mlp, h.fp8_qkv, h.fp8_head, h.fp8_mlp_scales = True, False, True, "record89"

    # schedule
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
    h.val_long_window, h.yarn_at_final_window = 20, False
    h.untie_frac = 848 / N         # record 89 unties after step 847's update: 848 is the first untied step
    h.cooldown_start, h.cooldown_end, h.cooldown_floor = 508 / N, 1270 / N, 0.15
    h.averages = []

    # optimizers: NorMuon with Polar Express, queries and keys orthogonalized per pair of heads, the
    # LR factors and lanes from the matrices' shapes in record 89's banks
    h.optimizer, h.orthogonalize, h.matrix_shapes = "normuon", "polar_express", "record_banks"
    h.matrix_lr, h.matrix_wd, h.mlp_down_lr_scale, h.qk_ortho_heads = 0.023, 1.2, 2.0, 2
    h.momentum, h.momentum_warmup_start, h.momentum_warmup_steps, h.momentum_cooldown_steps = 0.95, 0.85, 300, 50
    # Adam: base LR 0.008 and decay 0.005 times per-group multipliers, an update on odd steps only,
    # eps for the summed loss's gradient
    h.embed_lr = h.head_lr = 0.008
    h.value_embed_lr = 0.008 * 75  # value embeddings and the bigram table
    h.scalar_lr, h.gate_lr, h.smear_gate_lr = 0.008 * 5, 0.008, 0.008 * 0.01
    h.embed_betas, h.value_embed_betas, h.scalar_betas = (0.5, 0.95), (0.75, 0.95), (0.9, 0.99)
    # the dense trunk's residual scales (LR x5) and output scales (x1), betas (0.9, 0.95); the
    # value-embedding gates and the gate and dense-connection MLPs' weights decayed as Adam's default
    h.resid_scale_lr, h.post_scale_lr, h.scale_betas = 0.008 * 5, 0.008, (0.9, 0.95)
    h.gate_wd = h.gate_mlp_wd = 0.005
    h.embed_wd, h.value_embed_wd = 0.005 * 150, 0.005 * 5
    h.adam_eps, h.adam_step_every, h.adam_eps_unit = 1e-10, 2, "token_sum"


def _one_gpu_preset(h):
    _speedrun_preset(h)
    h.track = "track_1gpu"         # the same dynamics as speedrun: the single-GPU track's recipe
    # the table (130 GB in bf16) in host memory; the device caches 4.5 Mi rows (7.2 GB), more than
    # min_cache_rows: 2 rows a token of an update's 4 steps, the next step's and a validation slice's
    h.ngram_cache_rows = 4_718_592


# PR 371's approximate backward at its published steps (of record 92's 1194): the head's weight
# gradient from one row in four from step 320, each head's attention backward truncated to the
# smallest of 64/128/256 keys within a relative L2 error of 0.2, chosen at steps 592-593 and used
# from 594, the last 87 steps exact.
PR371_HEAD_GRAD_STRIDE = 4         # PR 371: one activation/gradient row pair in four
PR371_HEAD_GRAD_START = 320        # PR 371: the first step with the sampled head gradient
PR371_ATTN_BWD_WINDOWS = (64, 128, 256)  # PR 371: the candidate backward windows, in tokens
PR371_ATTN_BWD_ERROR_BOUND = 0.2   # PR 371: the largest relative L2 error of dQ, dK, dV a window may have
PR371_ATTN_BWD_CHOICE_STEPS = (592, 593)  # PR 371: the steps that measure the errors
PR371_ATTN_BWD_START = 594         # PR 371: the first step with the truncated backward
PR371_EXACT_LAST_STEPS = 87        # PR 371: the last steps, with the exact backward (1107-1193 of 1194)
FRONTIER_STEPS = 1050              # PR 379: the steps of the stack's most step-saving published claim


def _frontier_preset(h):
    """A stack no run has measured: record 92 (speedrun) with the open pull requests' techniques
    that compose, at FRONTIER_STEPS. PR 379's pointer mixture (the next-token distribution),
    PR 375's normalized n-gram hashing (the table's hashes) and PR 371's sampled head gradient
    and truncated attention backward (the head's weight gradient, the attention backward) change
    disjoint parts of the step, so they stack (the FP8 head samples its weight gradient with the
    mixture's loss too); PR 378's document copy feature stays off: a second way to copy from the
    document, never measured beside the pointer, whose gain the pointer's may hold. The run is
    as long as PR 379's, the claim that sets it, none of the others' step savings added. The
    schedules that record 92 states as shares of the run (stages, cooldown, untying, ANVIL's
    ramps) keep their shares; PR 371's steps keep their place in the run (scaled_step). docs/recipe.md says
    what each source published and what differs here."""
    _speedrun_preset(h)
    h.track = "none"               # no run of this stack exists: not a record attempt
    record_steps, h.num_iterations = h.num_iterations, FRONTIER_STEPS
    at = functools.partial(scaled_step, record_steps, FRONTIER_STEPS)
    h.ngram_normalized, h.pointer_mixture = True, True
    h.head_grad_stride, h.head_grad_start = PR371_HEAD_GRAD_STRIDE, at(PR371_HEAD_GRAD_START)
    h.attn_bwd_windows, h.attn_bwd_error_bound = PR371_ATTN_BWD_WINDOWS, PR371_ATTN_BWD_ERROR_BOUND
    first = at(PR371_ATTN_BWD_CHOICE_STEPS[0])   # then consecutive choice steps, the truncation right after
    h.attn_bwd_choice_steps = tuple(range(first, first + len(PR371_ATTN_BWD_CHOICE_STEPS)))
    h.attn_bwd_start = first + PR371_ATTN_BWD_START - PR371_ATTN_BWD_CHOICE_STEPS[0]
    h.approx_exact_last_steps = at(PR371_EXACT_LAST_STEPS)


def scaled_step(steps, new_steps, step):
    """`step` of a run of `steps` moved to the same share of a run of `new_steps` (rounded)."""
    return round(step * new_steps / steps)


ONE_CARD_NGRAM_ROWS = NGRAM_RECORD_ROWS // 64   # 1,321,920 rows (2 GB in bf16): the largest a 24 GB card holds
ONE_CARD_SPLIT = 4                 # each slice in 4 micro-batches: 12,288 tokens at most


def _one_card_24gb_preset(h):
    """One 24 GB card (an RTX 3090 or 4090): the 1gpu preset with these differences, which is
    what `train_gpt.py --plan --gpus=1 --gpu_gib=24` picks (docs/gpu.md):
    - the n-gram table at 1/64 of the record's rows, whole on the card (--ngram_cache_rows=0):
      the record's table would need 146 GiB of host memory and, even there, a device cache and
      pending gradients of 15 GiB; by the public table-size test of record 92 a smaller table
      costs val loss (84.6M rows 3.2791, 21.15M 3.2825-3.2863, 377k 3.3149), so this run ends
      above the 3.28 target;
    - each slice of the global batch in ONE_CARD_SPLIT micro-batches (the same global batch and
      schedules, a quarter of the step's activations)."""
    _one_gpu_preset(h)
    h.track = "none"               # a 24 GB card is not the single-GPU track's H100 or H200
    h.ngram_rows, h.ngram_cache_rows = ONE_CARD_NGRAM_ROWS, 0
    memory_budget.split_micro_batches(h, ONE_CARD_SPLIT)


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
    _project_rules(h)
    _shared_constants(h)
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
    h.resid_scale_lr, h.post_scale_lr, h.scale_betas = h.scalar_lr, h.scalar_lr, h.scalar_betas
    h.gate_lr = 0.015 * 0.1            # public medium record: value_embed_gate NorMuon lr_mul 0.1 (ours: Adam)
    h.adam_eps = 1e-8                  # public medium record: DistAdam eps 1e-8
    h.adam_step_every = 2              # public medium record: Adam on odd steps only
    # what the public medium record does not have, off
    h.value_embed_layers, h.value_embed_gate_reads_value, h.value_embed_sparse = (), False, False
    h.xsa_layers, h.paired_head_layers, h.parallel_mlp_layers, h.attn_gate_layers, h.composed_layers = (), (), (), (), ()
    h.narrow_qk_layers, h.narrow_qk_dim, h.narrow_qk_attn_scale, h.narrow_vo_layers, h.narrow_vo_dim = (), 64, 0.13, (), 64
    h.token_gates, h.token_gates_split, h.composed_window = False, 4, 112
    h.trunk, h.skip_layers, h.snapshot_layer = "unet", (3, 6), 7
    h.bigram_rows, h.ngram_rows, h.ngram_dtype = 251_520, 0, "float32"  # (ours: the bigram table, zero at init)
    h.rope_base, h.attn_scale, h.canonical_mask, h.averages = 1024.0, 0.1, False, []
    h.train_files = "data/fineweb10B/fineweb_train_*.bin"
    h.val_files = "data/fineweb10B/fineweb_val_*.bin"
    h.val_tokens = 10_485_760
    h.param_dtype, h.compute_dtype, h.fp8_mlp_scales = "float32", "bfloat16", "record92"


OPT_STEPS = 3250                   # public optimization track baseline: train_steps
OPT_VAL_EVERY = 125                # public optimization track baseline: validation every 125 steps


def _optimization_preset(h):
    """The optimization track (fewest steps to val loss 3.28): the public optimization track's
    baseline (modded-nanogpt's records/track_3_optimization/train_gpt_simple.py, tuned Muon and
    AdamW, 3250 steps) on this repository's model code. What an entry may not change (a 12-layer,
    width-768 model with 6 heads of 128, ReLU^2 MLP 3072, QK norm, half RoPE at base 1024, every
    layer causal over 1024 tokens; one global batch of 8 x 64 x 1024 tokens a step) is the track's
    fixed_config (fixed_track_config); here is what an entry changes: Muon lr 0.025 for the hidden
    matrices, AdamW for the rest, the LR flat for 30% of the steps, then linear to 0. Facts that
    our model cannot express, and every value mapped with a difference, are listed in
    records/track_3_optimization/README.md."""
    _project_rules(h)
    _shared_constants(h)
    h.track = "track_3_optimization"
    fixed_track_config(h, h.track)
    h.num_iterations = OPT_STEPS
    h.val_every = OPT_VAL_EVERY    # public: every 125 steps (then every 25 in the last 10%: not expressible)
    h.val_tokens_per_rank = 65_536  # public: 8 x 64 x 1024 a step, over 8 ranks
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
    h.resid_scale_lr, h.post_scale_lr, h.scale_betas = h.scalar_lr, h.scalar_lr, h.scalar_betas
    h.adam_eps = 1e-10             # public: eps 1e-10
    h.embed_wd = 0.001 / 0.7       # public: p *= 1 - lr x 0.001; ours lr^2 x wd: equal for the embedding at its peak
    # public: embedding N(0, 1), head zero; ours unties at step 0 by copying the embedding into the head,
    # so the embedding keeps its default N(0, 1 / 768) (logits ~N(0, 1) at the start, not N(0, 768))
    h.embed_init_std, h.compute_dtype, h.averages = 0.0, "bfloat16", []
    h.gate_lr = h.smear_gate_lr = 0.04
    h.value_embed_betas, h.value_embed_wd, h.adam_step_every = (0.8, 0.95), 0.0, 1


PRESETS = {"speedrun": _speedrun_preset, "frontier": _frontier_preset, "1gpu": _one_gpu_preset,
           "1gpu_24gb": _one_card_24gb_preset, "cpu": _cpu_preset, "record89": _record89_preset,
           "medium": _medium_preset, "optimization": _optimization_preset,
           "cpu_optimization": _cpu_optimization_preset}


def parse_config(argv):
    """The run's config from the command line: --preset NAME (default speedrun; main() puts the
    machine's in front: with_machine_preset) or --config PATH, then --key=value overrides
    (config.parse_config)."""
    return config.parse_config(argv, PRESETS, "speedrun", description=__doc__.split("\n")[0])


def logged_config(h):
    """The resolved config as a log records it: the settings plus the entry script's path."""
    return {**config_to_dict(h), "entry": os.path.basename(__file__)}


# -----------------------------------------------------------------------------------------------
# Model
# -----------------------------------------------------------------------------------------------

HEAD_SAMPLE_SEED_MULT = 1_000_003  # a step's head-gradient sample seed: run seed x this + step (a prime)
YARN_ALPHA = 1.0                   # YaRN: frequencies with fewer rotations per window than this are interpolated fully
YARN_BETA = 32.0                   # YaRN: ... and those with more than this are kept as they are


def rms_norm(x):
    """Weightless RMS norm; the statistic in fp32 where autocast asks, the result in x's dtype."""
    return F.rms_norm(x, (x.size(-1),)).type_as(x)


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
    # training: this forward's FP8 weights by layer (GPT.cast_fp8_weights: an FP8 layer's fp8_key ->
    # its casts); a layer not in it casts its own
    fp8_weights: dict | None = None


XSA_NORM_EPS = 1e-4               # values shorter than this are not normalized further (their direction is noise)


def remove_self_value(y, v, alpha):
    """XSA: each head's output y (T, H, D) less tanh(alpha) times its projection on the head's
    own value direction v/|v|, the part of the output that repeats the token's own value; alpha
    (H,) per head or (T, H) per token and head.
    alpha starts at 0: the layer starts as plain attention and learns how much to remove.
    The direction and the projection are taken in y's dtype (CUDA autocast gives a norm and a
    sum in fp32, which would carry the output and the tensors saved for its backward in fp32)."""
    direction = F.normalize(v, dim=-1, eps=XSA_NORM_EPS).type_as(y)
    along = (y * direction).sum(-1, keepdim=True).type_as(y)
    return y - torch.tanh(alpha).type_as(y)[..., None] * along * direction


COMPOSED_MIX_EPS = 1e-6                  # the RMS norm over heads of the map mix


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
        self.paired, self.record_pairs = paired, paired and cfg.paired_head_layout == "record"
        self.edge_keys = int(cfg.window_edge_key)  # keys a window shows beyond its length: the one w back
        self.qkv = nn.Parameter(torch.empty(cfg.num_heads * (2 * self.qk_dim + self.v_dim), cfg.model_dim))
        self.out = nn.Parameter(torch.zeros(cfg.model_dim, cfg.num_heads * self.v_dim))
        self.attention_fn, self.qk_norm_rope, self.composed_fn = fns.attention, fns.qk_norm_rope, fns.composed_attention
        self.fp8_qkv = fns.fp8_qkv  # in training, the projection runs in FP8 with its state in fp8_state
        self.fp8_qkv_rope = fns.fp8_qkv_rope   # the same with the norm and RoPE in its op (or None)
        self.fp8_key = ("qkv", layer)  # its weight's cast in AttentionArgs.fp8_weights
        if fns.fp8_qkv is not None:
            self.register_buffer("fp8_state", kernels.new_fp8_linear_state())
        mixed_densely = cfg.trunk == "dense" and layer == cfg.num_layers - 1  # gets its gates from DenseConnections
        if value_embed and not mixed_densely:
            self.ve_gate = nn.Parameter(torch.zeros(cfg.num_heads, cfg.value_embed_gate_dim))
        else:
            self.ve_gate = None
        self.ve_gate_reads_value = cfg.value_embed_gate_reads_value
        self.xsa = xsa             # with token gates the strengths come per token from them
        self.composed_window = cfg.composed_window if layer in cfg.composed_layers else 0
        self.xsa_alpha = nn.Parameter(torch.zeros(cfg.num_heads)) if xsa and not cfg.token_gates else None
        # dense trunk: learned scales of the QKV projection's output (taken by v alone) and of the output projection
        self.sa_lambdas = nn.Parameter(torch.tensor(DENSE_SA_LAMBDAS)) if cfg.trunk == "dense" else None
        bound = (3 ** 0.5) * 0.5 * cfg.model_dim ** -0.5
        nn.init.uniform_(self.qkv, -bound, bound)
        if cfg.attn_out_init == "uniform":
            nn.init.uniform_(self.out, -bound, bound)
        # the truncated backward (PR 371): each head's backward window, tokens (0: exact), read by the
        # kernels where `truncated` says (set_truncated); `probe` collects the choice steps' calls
        self.backward_windows, self.truncated, self.probe = None, False, None

    def set_truncated(self, truncated):
        """Whether the attention backward is truncated to backward_windows (made at the first call:
        int32, one per head, 0 until the choice writes them in place, so a captured graph reads
        the chosen windows)."""
        if truncated and self.backward_windows is None:
            self.backward_windows = torch.zeros(self.num_heads, dtype=torch.int32, device=self.qkv.device)
        self.truncated = truncated

    def set_backward_windows(self, windows):
        """The chosen windows (tokens, 0: exact) of the heads of this layer's attention call,
        written in place (the heads past them, which a paired layer's call does not have, exact)."""
        if self.backward_windows is None:
            self.backward_windows = torch.zeros(self.num_heads, dtype=torch.int32, device=self.qkv.device)
        self.backward_windows.zero_()
        self.backward_windows[:windows.numel()].copy_(windows.to(torch.int32))

    def attention(self, q, k, v, cu_seqlens, window, scale):
        """attention_fn, with the truncated backward where it is on; the choice steps' probe keeps
        the call's inputs and, in the backward, its output gradient."""
        if self.truncated:
            y = self.attention_fn(q, k, v, cu_seqlens, window, scale,
                                  backward_windows=self.backward_windows[:q.size(1)])
        else:
            y = self.attention_fn(q, k, v, cu_seqlens, window, scale)
        if self.probe is not None and y.requires_grad:
            kept = (q.detach(), k.detach(), v.detach())
            y.register_hook(lambda g: self.probe.append((*kept, g.detach(), cu_seqlens, window, scale)))
        return y

    def composed(self, q, k, v, doc_start, rotary, gates):
        """Composed attention (kernels.composed_attention) with this layer's head mixes from the
        token gates (the input mix RMS-normed over the heads)."""
        mix_in = F.rms_norm(gates["composed_in"].float(), (self.num_heads,), eps=COMPOSED_MIX_EPS)
        return self.composed_fn(q, k, v, doc_start, self.composed_window, rotary.attn_scale, mix_in,
                                gates["composed_out"])

    def value_embed_gate(self, x, ve):
        """(T, heads) gates in (0, 2), 1 at the start: 2 sigmoid(W g), where g holds the first dims
        of the residual x, or the first half-as-many of x and of the value embedding ve."""
        dims = self.ve_gate.size(1)
        if self.ve_gate_reads_value:
            inputs = torch.cat([x[:, :dims // 2], ve[:, :dims // 2].type_as(x)], dim=-1)
        else:
            inputs = x[:, :dims]
        return 2 * torch.sigmoid(F.linear(inputs, self.ve_gate.type_as(x)))

    def forward(self, x, ve, doc_start, rotary: Rotary, args: AttentionArgs, gates=None, out_gain=None):
        """x (T, model_dim) normed; ve: this layer's value embeddings or None; doc_start (T,) bool:
        True where a document (or the slice) starts; gates: this layer's TokenGates or None (its
        "xsa" (T, heads) replace the learned per-head XSA strengths; its "attn" (T, heads) scale
        the heads' outputs; from the dense connections, "ve" (T, heads) replaces the
        value-embedding gate and "v" (T, heads x value width) is added to the values).

        A paired layer runs on a doubled sequence (rotated), two positions per token: RoPE, the
        document offsets and the cache count positions, and the window (in positions) spans half
        as many tokens."""
        T = x.size(0)
        gates = gates or {}
        weight_cast = (args.fp8_weights or {}).get(self.fp8_key)
        window = (args.long_window if self.long_window else args.short_window) + self.edge_keys
        if args.cache is None:
            q, k, v = self.rotated_projection(x, ve, doc_start, rotary, gates, weight_cast)
            y, own_values = self.attend_packed(q, k, v, rotary, args, window, gates)
        else:
            q, k, v = self.project(x, ve, gates, weight_cast)
            y, own_values = self.attend_cached(q, k, v, rotary, args, window, gates)
        if self.xsa:
            y = remove_self_value(y, own_values, gates["xsa"] if "xsa" in gates else self.xsa_alpha)
        if self.paired:
            y = y.reshape(T, self.num_heads, -1) if self.record_pairs else deinterleave_head_pairs(y)
        if "attn" in gates:
            y = y * gates["attn"].type_as(y)[..., None]
        return F.linear(y.reshape(T, -1), self.out_weight(out_gain).type_as(y))

    def out_weight(self, out_gain=None):
        """The output projection's weight times its 0-D gains (the dense trunk's sa_lambdas[1] and
        the caller's out_gain): on the weight, a gain's gradient is a sum over the weight's
        entries, not over every token's output."""
        gain = None if self.sa_lambdas is None else self.sa_lambdas[1]
        if out_gain is not None:
            gain = out_gain if gain is None else gain * out_gain
        return self.out if gain is None else gain * self.out

    def project(self, x, ve, gates, weight_cast=None):
        """q, k, v (T, heads, dims) of the normed x: the packed QKV projection (FP8 in training, on
        weight_cast where the forward cast its weight), the value embedding added through its gate,
        and the dense connections' values."""
        T = x.size(0)
        if self.fp8_qkv is not None and self.training:
            qkv = self.fp8_qkv(x.to(torch.bfloat16), self.qkv, self.fp8_state, weight_cast=weight_cast,
                               gain=self.qkv_gain())
        else:
            qkv = F.linear(x, self.qkv.type_as(x) if self.sa_lambdas is None else
                           (self.qkv_gain() * self.qkv).type_as(x))
        H, qk_rows = self.num_heads, self.num_heads * self.qk_dim
        q, k, v = (t.view(T, H, -1) for t in qkv.split([qk_rows, qk_rows, H * self.v_dim], dim=-1))
        return q, k, self.values(v, x, ve, gates).to(qkv.dtype)

    def qkv_gain(self):
        """The dense trunk's 0-D scale of the QKV projection (sa_lambdas[0]), taken on its weight
        (q and k are RMS-normed next: it scales v), or None."""
        return None if self.sa_lambdas is None else self.sa_lambdas[0]

    def values(self, v, x, ve, gates):
        """The values (T, heads, v_dim) of the projection's v: the value embedding added through
        its gate and the dense connections' values."""
        T, H = v.shape[:2]
        if ve is not None:
            gate = gates["ve"] if "ve" in gates else self.value_embed_gate(x, ve)
            v = v + gate[..., None] * ve.view(T, H, -1)[..., :self.v_dim]   # (a wider table: each head's first dims)
        if "v" in gates:
            v = v + gates["v"].view_as(v)
        # Attention takes one dtype, the projection's: CUDA autocast runs the value-embedding sum in fp32.
        return v

    def rotated_projection(self, x, ve, doc_start, rotary, gates, weight_cast=None):
        """q, k, v of a packed slice in the attention's layout (rotated): in FP8 training, with the
        norm and RoPE inside the projection's op (fp8_qkv_rope: its backward casts the three
        gradients to fp8 in the kernel that takes q's and k's back through the rotation and the
        norm), except where the adjacent paired layout reorders the heads before the rotation."""
        key_starts = doc_start if self.key_offset else None
        if self.fp8_qkv_rope is None or not self.training or (self.paired and not self.record_pairs):
            return self.rotated(*self.project(x, ve, gates, weight_cast), rotary, 0, key_starts)
        T, H = x.size(0), self.num_heads
        positions = 2 * T if self.record_pairs else T
        q, k, v = self.fp8_qkv_rope(x.to(torch.bfloat16), self.qkv, self.fp8_state, H, self.qk_dim,
                                    *rotary.angles(0, positions), rotary.stationary, key_starts,
                                    paired=self.record_pairs, weight_cast=weight_cast, gain=self.qkv_gain())
        v = self.values(v, x, ve, gates).to(q.dtype)
        if self.record_pairs:
            return tuple(t.reshape(2 * T, H // 2, -1) for t in (q, k, v))
        return q, k, v

    def rotated(self, q, k, v, rotary, start, key_starts):
        """q and k normed and rotated (the first at position `start`), and v, in the attention's
        layout, q's dtype v's: (T, heads, D), or on a paired layer the doubled sequence (2T,
        heads/2, D). The records' layout puts head h of token t at position 2t + h // (heads/2),
        rotated as 2t + h % 2 (the heads h and h + heads/2 pair): the rotation writes it in place
        and the doubled sequence is a view; the adjacent layout interleaves the heads first."""
        if self.record_pairs:
            T, H = q.shape[:2]
            q, k = self.qk_norm_rope(q, k, *rotary.angles(start, 2 * T), rotary.stationary, key_starts, paired=True)
            return tuple(t.to(v.dtype).reshape(2 * T, H // 2, -1) for t in (q, k, v))
        if self.paired:
            q, k, v = (interleave_head_pairs(t) for t in (q, k, v))
        q, k = self.qk_norm_rope(q, k, *rotary.angles(start, q.size(0)), rotary.stationary, key_starts)
        return q.to(v.dtype), k.to(v.dtype), v

    def attend_packed(self, q, k, v, rotary, args, window, gates):
        """Training and validation: attention of the rotated q, k, v within each document of the
        packed slice (args.cu_seqlens), plus composed attention on its layers. The key offset (a
        key's stationary dims from the previous token: with them one layer can do induction, a
        query matching token a finding the token after an earlier a) came with the norm and RoPE.
        Returns the heads' outputs and the values XSA removes."""
        rows_per_token = 2 if self.paired else 1
        y = self.attention(q, k, v, args.cu_seqlens * rows_per_token, window, rotary.attn_scale)
        if self.composed_window:   # (never on a paired layer: q has one row per token)
            y = y + self.composed(q, k, v, kernels.document_bounds(args.cu_seqlens, q.size(0))[0], rotary, gates)
        return y, v

    def attend_cached(self, q, k, v, rotary, args, window, gates):
        """Generation: the new tokens of one document over all its keys so far (args.cache, which
        keeps the keys as computed); the key offset applies to the whole cached sequence, whose
        first key starts the document. The same math as attend_packed on the whole document."""
        cache, rows_per_token = args.cache, 2 if self.paired else 1
        q, k, v = self.rotated(q, k, v, rotary, cache.length * rows_per_token, None)
        own_values = v
        k, v = cache.extend(self, k, v, rows_per_token)
        if self.key_offset:
            k = kernels.offset_keys_reference(k, rotary.stationary, torch.arange(k.size(0), device=k.device) == 0)
        y = cached_attention(q, k, v, window, rotary.attn_scale)
        if self.composed_window:   # the new tokens are the last T of the cached document: pad in front
            earlier = k.size(0) - q.size(0)
            padded = {kind: F.pad(gates[kind], (0, 0, earlier, 0)) for kind in ("composed_in", "composed_out")}
            one_document = torch.zeros(k.size(0), dtype=torch.long, device=k.device)
            y = y + self.composed(F.pad(q, (0, 0, 0, 0, earlier, 0)), k, v, one_document, rotary, padded)[earlier:]
        return y, own_values


class MLP(nn.Module):
    """relu(x W_up^T)^2 W_down^T, W_down zero-initialized so each block starts as identity.

    With `fp8_fn` (kernels.fp8_relu2_mlp or its reference) both GEMMs run in FP8 while training,
    with the amax history of the scales in the `fp8_state` buffer; evaluation runs in the
    autocast dtype and leaves that buffer alone.
    """

    def __init__(self, dim, hidden, fp8_fn=None, fp8_key=None):
        super().__init__()
        self.up = nn.Parameter(torch.empty(hidden, dim))
        self.down = nn.Parameter(torch.zeros(dim, hidden))
        bound = (3 ** 0.5) * 0.5 * dim ** -0.5
        nn.init.uniform_(self.up, -bound, bound)
        self.fp8_fn, self.fp8_key = fp8_fn, fp8_key   # fp8_key: its weights' casts in AttentionArgs.fp8_weights
        if fp8_fn is not None:
            self.register_buffer("fp8_state", kernels.new_fp8_mlp_state())

    def forward(self, x, fp8_weights=None, gain=None):
        """gain: None, or a 0-D tensor that scales the output, taken on the down weight (its
        gradient a sum over that weight, not over the tokens)."""
        if self.fp8_fn is not None and self.training:
            casts = (fp8_weights or {}).get(self.fp8_key)
            return self.fp8_fn(x.to(torch.bfloat16), self.up, self.down, self.fp8_state, weight_casts=casts, gain=gain)
        down = self.down if gain is None else gain * self.down
        return F.linear(F.relu(F.linear(x, self.up.type_as(x))).square(), down.type_as(x))


DENSE_SKIP_LAMBDA = -1.5          # dense trunk: the skip's strength is sigmoid of this learned scalar (0.18 at init)
DENSE_SA_LAMBDAS = (0.5, 1.0)      # dense trunk: initial scales of the values (q, k are RMS-normed) and the attention's
DENSE_RESID_SCALES = (1.1 ** 0.5, 1.1 ** 0.5)  # dense: initial residual scales before attention, MLP (record 89)
DENSE_POST_SCALES = (1.0, 1.0)     # dense: initial scales of the attention's and the MLP's outputs (record 89)


class Block(nn.Module):
    """Attention (unless attention-free) and an MLP (or two side by side, or none), each on the
    normed residual. The U-net trunk mixes x0 into the residual first (forward); the dense trunk
    scales the residual and each sublayer's output by learned scalars (forward_dense)."""

    def __init__(self, cfg: ModelConfig, layer, fns, value_embed):
        super().__init__()
        has_attn = layer not in cfg.attention_free_layers
        self.attn = (CausalSelfAttention(cfg, layer, layer in cfg.long_window_layers, value_embed,
                                         layer in cfg.xsa_layers, layer in cfg.paired_head_layers, fns)
                     if has_attn else None)
        self.mlp = (MLP(cfg.model_dim, cfg.mlp_hidden, fns.fp8_mlp, ("mlp", layer))
                    if layer not in cfg.mlp_free_layers else None)
        parallel = layer in cfg.parallel_mlp_layers
        self.parallel_mlp = (MLP(cfg.model_dim, cfg.mlp_hidden, fns.fp8_mlp, ("parallel_mlp", layer))
                             if parallel else None)
        if cfg.trunk == "unet":    # residual mix: x <- lambdas[0] * x + lambdas[1] * x0 before the sublayers
            self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))
        elif layer < cfg.num_layers - 1:  # x <- resid[0] x + post[0] attention, then resid[1], post[1] for the MLP
            self.resid_scales = nn.Parameter(torch.tensor(DENSE_RESID_SCALES))  # (the last layer's: DenseConnections)
            if has_attn or self.mlp is not None:  # (a layer with neither has no output to scale)
                self.post_scales = nn.Parameter(torch.tensor(DENSE_POST_SCALES))
        # dense: an attention-free layer scales its residual by resid_scales[0] all the same, but the
        # skip's target, where the skip takes the attention's place
        self.scales_without_attention = not has_attn and cfg.trunk == "dense" and layer != cfg.skip_layers[1]

    def mlps(self, normed, args=None, gain=None):
        casts = args.fp8_weights if args is not None else None
        if self.parallel_mlp is not None:
            return self.mlp(normed, casts, gain) + self.parallel_mlp(normed, casts, gain)
        return self.mlp(normed, casts, gain)

    def forward(self, x, x0, ve, doc_start, rotary, args, gates=None, hashed=None):
        """gates: this layer's TokenGates or None; with them the attention sublayer is followed by
        the gated injections of x0 and (unless None) of the hashed embedding."""
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), ve, doc_start, rotary, args, gates)
            if gates is not None:
                x = x + gates["x0"] * x0
                if hashed is not None:
                    x = x + gates["hashed"] * hashed
        return x if self.mlp is None else x + self.mlps(rms_norm(x), args)

    def forward_dense(self, x, attn_in, x0, ve, doc_start, rotary, args, gates, hashed):
        """The dense trunk's layer: attention reads attn_in (the residual, or a snapshot), then x0
        and the hashed embedding enter where the token gates have a lane for them (hashed None:
        not here)."""
        gates = gates or {}
        if self.attn is not None:
            y = self.attn(rms_norm(attn_in), ve, doc_start, rotary, args, gates, out_gain=self.post_scales[0])
            x = self.resid_scales[0] * x + y
        elif self.scales_without_attention:
            x = self.resid_scales[0] * x
        if "x0" in gates:
            x = x + gates["x0"] * x0
        if "hashed" in gates and hashed is not None:
            x = x + gates["hashed"] * hashed
        if self.mlp is None:
            return self.resid_scales[1] * x
        return self.resid_scales[1] * x + self.mlps(rms_norm(x), args, gain=self.post_scales[1])

    def forward_mixed(self, x, attn_in, x0, ve, doc_start, rotary, args, gates, hashed, mix):
        """The dense trunk's last layer: `mix`, its coefficients from the dense connections, in
        place of the scales and the token gates' injections (its x0 is the trunk's input).
        Returns its output and its MLP's normed input."""
        y = self.attn(rms_norm(attn_in), ve, doc_start, rotary, args, gates)
        x = mix["attn_residual"] * x + mix["attn_out"] * y + mix["x0"] * x0 + mix["hashed"] * hashed
        normed = rms_norm(x)
        out = self.mlps(normed, args)
        return mix["mlp_residual"] * x + mix["mlp_out"] * out, normed


TOKEN_GATE_HIDDEN = 64             # hidden width of the token-gate MLPs
TOKEN_GATE_SCALE = 0.1             # initial output scale: a gate is (W2 gelu(W1 x) + b) * scale, scale learned
TOKEN_GATE_INIT = {"xsa": 0.0, "attn": 0.25, "x0": 0.0, "hashed": 0.05, "skip": 0.5,  # values at init (W2 = 0)
                   "composed_in": 1.0, "composed_out": 0.0}


def token_gate_layout(cfg: ModelConfig):
    """[(layer, kind, width)] of the gates each of the two MLPs makes, in output order: for
    every attention layer before token_gates_split (first MLP) or from it on (second), the
    per-head XSA strengths (on XSA layers), the per-head output gates (on attn_gate_layers),
    the head mixes of composed attention (on composed_layers), then the x0 and hashed-embedding injection
    gates (on their injection_layers). The dense trunk adds the skip's gate, and takes the last
    layer's injections from its dense connections instead."""
    layouts = ([], [])
    dense = cfg.trunk == "dense"
    x0_layers, hashed_layers = injection_layers(cfg)
    for layer in range(cfg.num_layers):
        layout = layouts[layer >= cfg.token_gates_split]
        if dense and layer == cfg.skip_layers[1]:
            layout.append((layer, "skip", 1))
        if layer not in cfg.attention_free_layers:
            if layer in cfg.xsa_layers:
                layout.append((layer, "xsa", cfg.num_heads))
            if layer in cfg.attn_gate_layers:
                layout.append((layer, "attn", cfg.num_heads))
            if layer in cfg.composed_layers:
                layout += [(layer, "composed_in", cfg.num_heads), (layer, "composed_out", cfg.num_heads)]
        layout += [(layer, kind, 1) for kind, sites in (("x0", x0_layers), ("hashed", hashed_layers))
                   if layer in sites]
    return layouts


class TokenGates(nn.Module):
    """Two small MLPs that make per-token gates for the layers: the first from x0 (the normed
    embedding) for the layers before token_gates_split, the second from the residual entering
    that layer for the rest. Each gate starts at TOKEN_GATE_INIT[kind] for every token (W2 is
    zero, the bias holds the value) and learns to depend on the token. The hashed embedding
    enters the residual through them: before the first attention layer, after the others'
    attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layouts = token_gate_layout(cfg)
        self.first_layer = min((layer for layout in self.layouts for layer, kind, _ in layout
                                if kind == "hashed"), default=None)    # takes the hashed embedding first
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
# its residual and attention output; the injections of the trunk's input and the hashed embedding; the
# scales of its residual and MLP output.
LAST_LAYER_MIX = {"v_input": 0.0, "v_snapshot": 0.0, "v_residual": 0.0, "input": 0.0, "snapshot": 0.0,
                  "residual": 0.0, "ve_lane0": 2.0, "ve_lane1": 2.0, "attn_residual": 1.1 ** 0.5, "attn_out": 1.0,
                  "x0": 0.0, "hashed": 0.05, "mlp_residual": 1.1 ** 0.5, "mlp_out": 1.0}
# After the last layer the residual adds these times the trunk's input, the snapshot, the last
# layer's input, the value embedding of the first layer whose values are as wide as the
# residual (none: 0), and the skip's source; the snapshot's -0.5 at init takes half of it back
# out of the prediction.
FINAL_MIX = {"input": 0.0, "snapshot": -0.5, "last_input": 0.0, "value_embed": 0.0, "skip_source": 0.0}


def final_mix_record92(tables):
    """Record 92's final mix over a model with `tables` value-embedding tables: the trunk's input,
    the snapshot, the last layer's input, the first table, the skip's source, the other tables,
    the last layer's normed MLP input and its normed attention input (the snapshot's), each
    coefficient at 0 at init but the snapshot's -0.5."""
    names = ["input", "snapshot", "last_input", *[f"value_embed{t}" for t in range(tables)][:1], "skip_source",
             *[f"value_embed{t}" for t in range(1, tables)], "mlp_input", "attn_input"]
    return {name: -0.5 if name == "snapshot" else 0.0 for name in names}


class DenseConnections(nn.Module):
    """Record 89's dense connections (MUDD: per-token coefficients from small MLPs that mix
    earlier layers' states back in): one MLP on the residual entering the last layer makes
    LAST_LAYER_MIX, one on the residual after it makes the final mix's coefficients (FINAL_MIX;
    record 92's, final_mix_record92, add a delta per channel group from the same hidden layer)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        final = final_mix_record92(len(set(value_embed_tables(cfg).values())))
        self.mixes = (LAST_LAYER_MIX, final if cfg.final_mix == "record92" else FINAL_MIX)
        self.w1 = nn.ParameterList(nn.Parameter(torch.empty(DENSE_HIDDEN, cfg.model_dim)) for _ in self.mixes)
        self.w2 = nn.ParameterList(nn.Parameter(torch.zeros(len(mix), DENSE_HIDDEN)) for mix in self.mixes)
        self.b2 = nn.ParameterList(nn.Parameter(torch.tensor([v / DENSE_SCALE for v in mix.values()]))
                                   for mix in self.mixes)
        self.w2_groups = (nn.Parameter(torch.zeros(len(final), FINAL_MIX_GROUPS, DENSE_HIDDEN))
                          if cfg.final_mix == "record92" else None)
        for w in self.w1:
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))   # nn.Linear's default init

    def forward(self, which, x):
        """{name: (T, 1)} of mix `which` (0: the last layer's, 1: the final one) on x (T, model_dim)."""
        hidden = F.gelu(F.linear(x, self.w1[which].type_as(x)))
        out = (F.linear(hidden, self.w2[which].type_as(x)) + self.b2[which].type_as(x)) * DENSE_SCALE
        return dict(zip(self.mixes[which], out.split(1, dim=-1)))

    def grouped_mix(self, x, sources):
        """Record 92's final mix: x plus each source of `sources` ({name: (T, model_dim)}) times its
        coefficient plus its delta per channel group (model_dim in FINAL_MIX_GROUPS groups)."""
        hidden = F.gelu(F.linear(x, self.w1[1].type_as(x)))
        coefficients = (F.linear(hidden, self.w2[1].type_as(x)) + self.b2[1].type_as(x)) * DENSE_SCALE  # (T, K)
        deltas = torch.einsum("td,kgd->tkg", hidden, self.w2_groups.type_as(x)) * DENSE_SCALE           # (T, K, G)
        grouped = x.unflatten(-1, (FINAL_MIX_GROUPS, -1))
        for k, name in enumerate(self.mixes[1]):
            share = coefficients[:, k, None] + deltas[:, k]
            grouped = grouped + share[..., None] * sources[name].unflatten(-1, (FINAL_MIX_GROUPS, -1))
        return grouped.flatten(-2)


class PointerHead(nn.Module):
    """PR 379's pointer: one attention head over the final hidden state x (normed). Queries
    q = g rms(x W_q^T) (g a learned gain), keys k = rms(x W_k^T), D = pointer_dim; each query sees
    the earlier positions of its document inside the band and a learned sink key (its score
    q . sink / sqrt(D)); position j proposes its token. Returns (p_copy, a_sink) of each position's
    next-token target (kernels.pointer_attention_reference states the attention).
    Parameters: 2 D dim + D + 1 (196,737 at D = 128, dim = 768, as PR 379 counts)."""

    def __init__(self, dim, pointer_dim, attention_fn):
        super().__init__()
        self.attention_fn = attention_fn
        self.query = nn.Parameter(torch.randn(pointer_dim, dim) * dim ** -0.5)
        self.key = nn.Parameter(torch.randn(pointer_dim, dim) * dim ** -0.5)
        self.sink_key = nn.Parameter(torch.zeros(pointer_dim))
        self.query_gain = nn.Parameter(torch.ones(()))

    def forward(self, x, tokens, next_tokens, band):
        q = self.query_gain.type_as(x) * rms_norm(F.linear(x, self.query.type_as(x)))
        k = rms_norm(F.linear(x, self.key.type_as(x)))
        sink_scores = (q.float() @ self.sink_key.float()) * self.query.shape[0] ** -0.5
        doc_start = kernels.pointer_document_starts(tokens, BOS_ID)
        return self.attention_fn(q, k, sink_scores, tokens, next_tokens, doc_start, band)


COPY_SITE_GAINS = (0.5, 1.0)       # PR 378: the copy vector's initial gains at the input and before the final norm


class DocumentCopy(nn.Module):
    """PR 378's document copy feature: each position's candidate next token and bucket
    (kernels.document_copy_matches: the token after the latest earlier match of its longest
    matching context in its document) become v = scale[bucket] embed(candidate) +
    bucket_embed[bucket], 0 where nothing matches; the model adds gains[0] v to its input before the
    first norm and gains[1] v to the trunk's output before the final norm. Scales and bucket
    embeddings start at 0: the feature starts off."""

    def __init__(self, dim, copy_keys):
        super().__init__()
        self.copy_keys = copy_keys
        self.scale = nn.Parameter(torch.zeros(kernels.COPY_BUCKETS))
        self.bucket_embed = nn.Parameter(torch.zeros(kernels.COPY_BUCKETS, dim))
        self.gains = nn.Parameter(torch.tensor(COPY_SITE_GAINS))
        self.register_buffer("normalized", normalized_ids(), persistent=False)

    def forward(self, context, embed, seen=0):
        """The copy vectors of context[seen:], matched over the whole context."""
        candidate, bucket = kernels.document_copy_matches(context, self.copy_keys(context, self.normalized, BOS_ID))
        candidate, bucket = candidate[seen:], bucket[seen:]
        v = embed(candidate.clamp(min=0)) * F.embedding(bucket, self.scale[:, None])
        v = v + F.embedding(bucket, self.bucket_embed)
        return torch.where(bucket[:, None] > 0, v, 0.0)


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
        self.fp8_head_loss = fns.fp8_head_loss
        # in training, each kind of FP8 layer's weights cast together at the start of the forward
        self.fp8_mlp_weights, self.fp8_qkv_weights = fns.fp8_mlp_weights, fns.fp8_qkv_weights
        if fns.fp8_head is not None:
            self.register_buffer("head_fp8_state", kernels.new_fp8_linear_state())
        # the weight the objective gives one token's loss (set_loss_unit), on the device: the
        # cross-entropy reads it there, so that no compiled or captured step holds one stage's value
        self.register_buffer("loss_unit", torch.ones(1), persistent=False)
        self.loss_unit_value = None   # what loss_unit and the FP8 states hold (None: not known, rewrite them)
        self.exact_upstream = False   # the trainer sets a loss unit: training's upstream gradient is known
        # the sampled head weight gradient (PR 371): rows a sampled row stands for (1: exact), and
        # its draw's seed on the device (made at the first sampled step, written in place per step)
        self.head_grad_stride, self.head_sample_seed = 1, None
        self.register_load_state_dict_post_hook(GPT.forget_loss_unit)   # a load rewrites the FP8 states' unit
        if cfg.smear_gate:         # both zero: the smear starts off, and its strength learns first
            self.smear_gate = nn.Parameter(torch.zeros(1, SMEAR_GATE_DIMS))
            self.smear_lambda = nn.Parameter(torch.zeros(()))
        else:
            self.smear_gate = None
        self.cross_documents, self.record_hashes = cfg.cross_documents, cfg.table_hashes == "record"
        if cfg.ngram_rows:
            self.bigram, self.ngram = None, NgramTable(cfg.ngram_rows, cfg.model_dim, max_tokens,
                                                       getattr(torch, cfg.ngram_dtype), placement,
                                                       cfg.cross_documents, cfg.table_hashes == "record",
                                                       cfg.ngram_normalized)
        else:
            self.bigram, self.ngram = nn.Embedding(cfg.bigram_rows, cfg.model_dim), None
            nn.init.zeros_(self.bigram.weight)
        signs = torch.randint(0, 2, (SIGN_ROWS, cfg.model_dim),
                              generator=torch.Generator().manual_seed(SIGN_TABLE_SEED)) * 2 - 1
        self.register_buffer("signs", signs.float(), persistent=False)
        self.value_embed_layer = value_embed_tables(cfg)
        value_widths = {table: value_embed_width(cfg, layer) for layer, table in
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
                    if value_embed_width(cfg, layer) == cfg.model_dim]
            self.final_value_embed_layer = wide[0] if wide else None
            self.grouped_final_mix = cfg.final_mix == "record92"
        self.token_gates = TokenGates(cfg) if cfg.token_gates else None
        self.token_gates_split = cfg.token_gates_split
        self.max_tokens = max_tokens
        positions = max_tokens * (2 if cfg.paired_head_layers else 1)   # a paired layer: two per token
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, positions, cfg.attn_scale, cfg.yarn_scale_growth)
        self.narrow_rotary = (Rotary(cfg.narrow_qk_dim, cfg.rope_base, positions, cfg.narrow_qk_attn_scale,
                                     cfg.yarn_scale_growth, rotate_all=True) if cfg.narrow_qk_layers else None)
        self.narrow_yarn_short = cfg.narrow_yarn_window == "short"
        self.register_buffer("prefix_table", torch.from_numpy(prefix_token_table()).long(), persistent=False)
        self.canonical_mask = NoncanonicalPairs() if cfg.canonical_mask else None
        self.pointer = (PointerHead(cfg.model_dim, cfg.pointer_dim, fns.pointer_attention)
                        if cfg.pointer_mixture else None)
        self.pointer_band, self.pointer_val_band = cfg.pointer_band, cfg.pointer_val_band
        self.document_copy = DocumentCopy(cfg.model_dim, fns.copy_keys) if cfg.document_copy else None
        self.pointer_cross_entropy_fn, self.fp8_head_pointer_loss = fns.pointer_cross_entropy, fns.fp8_head_pointer_loss
        if cfg.param_dtype == "bfloat16":   # weights, gradient sinks and the sign table; the FP8 states stay fp32
            for module in self.modules():
                for name, p in module.named_parameters(recurse=False):
                    setattr(module, name, nn.Parameter(p.detach().bfloat16(), requires_grad=p.requires_grad))
            self.signs = self.signs.bfloat16()

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

    def set_windows(self, long_windows, short_windows=()):
        """RoPE tables and attention scales after the long window grew through `long_windows` and
        the short one through `short_windows` (tokens): the narrow layers' follow the short one
        where narrow_yarn_window says so."""
        self.rotary.set_windows(long_windows)
        if self.narrow_rotary is not None:
            self.narrow_rotary.set_windows(short_windows if self.narrow_yarn_short else long_windows)

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

    def averaged_pieces(self, params):
        """(name, tensor) of each matrix of a parameter family (AVERAGED_PARAMS), as views of the
        weights, so that writing into one writes the weights. "head" is the head as the model uses
        it: the embedding while tied (so its average starts as the embedding's), lm_head after."""
        if params == "embed_head":
            return [("embed", self.embed.weight.data), ("head", self.head_weight().data)]
        if params == "value_embeds":
            return [(f"value_embed{i}", ve.weight.data) for i, ve in enumerate(self.value_embeds)]
        pieces = []
        for i, block in enumerate(self.blocks):
            attn = block.attn
            qk_rows = 2 * attn.num_heads * attn.qk_dim if attn is not None else 0
            if params == "qk" and attn is not None:
                pieces.append((f"qk{i}", attn.qkv.data[:qk_rows]))
            elif params == "vo_mlp":
                if attn is not None:
                    pieces += [(f"v{i}", attn.qkv.data[qk_rows:]), (f"out{i}", attn.out.data)]
                if block.mlp is not None:
                    pieces += [(f"mlp_up{i}", block.mlp.up.data), (f"mlp_down{i}", block.mlp.down.data)]
                if block.parallel_mlp is not None:
                    pieces += [(f"mlp2_up{i}", block.parallel_mlp.up.data),
                               (f"mlp2_down{i}", block.parallel_mlp.down.data)]
        return pieces

    def head(self, x, weight, sample=None):
        """Logits of the normed x over the rows of `weight` (the head, or its candidate rows);
        sample: (rows, stride) of the sampled weight gradient (head_sample), or None."""
        if self.fp8_head is not None and self.training:
            if sample is None:
                return self.fp8_head(x.to(torch.bfloat16), weight, self.head_fp8_state)
            return self.fp8_head(x.to(torch.bfloat16), weight, self.head_fp8_state, sample=sample)
        if sample is not None:
            return kernels.sampled_linear(x, weight.type_as(x), *sample)
        return F.linear(x, weight.type_as(x))

    def set_approximate_backward(self, head_grad_stride, truncated):
        """PR 371's approximations at a step: the head's weight gradient sampled one row in
        head_grad_stride (1: exact), the attention backward truncated to the chosen windows."""
        if head_grad_stride > 1 and self.head_sample_seed is None:
            self.head_sample_seed = torch.zeros((), dtype=torch.int64, device=self.embed.weight.device)
        self.head_grad_stride = head_grad_stride
        for block in self.blocks:
            if block.attn is not None:
                block.attn.set_truncated(truncated)

    def set_head_sample_seed(self, seed):
        """The seed of this step's sampled rows (the same on every rank), written in place."""
        if self.head_sample_seed is not None:
            self.head_sample_seed.fill_(seed)

    def head_sample(self, num_rows):
        """(rows, stride) of the sampled head weight gradient in training, or None (exact)."""
        if not self.training or self.head_grad_stride == 1:
            return None
        return kernels.head_sample_rows(num_rows, self.head_grad_stride, self.head_sample_seed), self.head_grad_stride

    def set_loss_unit(self, unit):
        """Tell the FP8 layers (their static gradient scales are the summed loss's) and the
        cross-entropy (the upstream gradient it stores its gradient times) the weight the objective
        gives one token's loss. Writes the device's copies (loss_unit, each FP8 state's) only when
        it changes; they are data, read by the kernels, so one compiled or captured step serves
        every unit."""
        if unit != self.loss_unit_value:
            self.loss_unit.fill_(unit)
            for name, state in self.named_buffers():
                if name.endswith("fp8_state"):
                    kernels.set_fp8_loss_unit(state, unit)
            self.loss_unit_value = unit
        self.exact_upstream = True

    @staticmethod
    def forget_loss_unit(model, incompatible_keys=None):
        """After a state dict is loaded (the FP8 states' loss units are then the saved ones), the
        next set_loss_unit writes every copy."""
        model.loss_unit_value = None

    def smear(self, x, doc_start):
        """x[t] + lambda * sigmoid(w . x[t, :SMEAR_GATE_DIMS]) * x[t-1]: each token embedding takes a
        share of its predecessor's, gated by the token itself; a document's first token takes none."""
        gate = self.smear_lambda * torch.sigmoid(F.linear(x[:, :SMEAR_GATE_DIMS], self.smear_gate.type_as(x)))
        return x + torch.where(doc_start[:, None], 0.0, gate * torch.roll(x, 1, dims=0))

    def cast_fp8_weights(self):
        """{fp8_key: casts} of this forward's FP8 layers: the MLPs' weights and the QKV
        projections' cast together by kind (fns.fp8_mlp_weights, fns.fp8_qkv_weights), in place
        of a cast per layer. The casts read the weights as they are now: an optimizer step
        between two forwards is in the next one's casts."""
        casts = {}
        mlps = [m for m in self.modules() if isinstance(m, MLP) and m.fp8_fn is not None]
        if mlps and self.fp8_mlp_weights is not None:
            made = self.fp8_mlp_weights([m.up for m in mlps], [m.down for m in mlps], [m.fp8_state for m in mlps])
            casts.update((m.fp8_key, c) for m, c in zip(mlps, made))
        projections = [m for m in self.modules() if isinstance(m, CausalSelfAttention) and m.fp8_qkv is not None]
        if projections and self.fp8_qkv_weights is not None:
            made = self.fp8_qkv_weights([m.qkv for m in projections], [m.fp8_state for m in projections])
            casts.update((m.fp8_key, c) for m, c in zip(projections, made))
        return casts

    def hidden_states(self, tokens, args: AttentionArgs):
        # With a cache the tokens continue its document: the bigram and trigram (and the smear) of
        # the first ones need the cache's last two tokens. A slice may begin inside a document: its
        # first token has no known predecessor either.
        if self.training:
            args = replace(args, fp8_weights=self.cast_fp8_weights())
        cache = args.cache
        context = tokens if cache is None or cache.length == 0 else torch.cat([cache.last_tokens, tokens])
        seen = context.size(0) - tokens.size(0)
        is_start = token_starts(context, self.cross_documents)
        doc_start = is_start[seen:]
        if self.smear_gate is None:
            x = self.embed(tokens)
        else:
            x = self.smear(self.embed(context), is_start)[seen:]
        copied = None
        if self.document_copy is not None:   # matched over the cached document and the new tokens
            history = tokens if cache is None or cache.length == 0 else torch.cat([cache.tokens, tokens])
            copied = self.document_copy(history, self.embed, history.size(0) - tokens.size(0))
            x = x + self.document_copy.gains[0] * copied
        if self.ngram is not None:
            hashed = self.ngram(context, is_start, seen, self.signs, lookup=cache is not None)
        else:
            rows = bigram_rows(context, is_start, self.bigram.num_embeddings, self.record_hashes)
            rule = "record89" if self.record_hashes else "project"
            hashed = self.bigram(rows[seen:]) * self.signs[bigram_sign_rows(context, is_start, rule)[seen:]]
        ves = self.value_embeddings(tokens)
        if self.trunk == "dense":
            x = self.dense_trunk(rms_norm(x), hashed, ves, doc_start, args)
        elif self.token_gates is None:   # the hashed embedding joins the token's once, before the norm
            x = self.unet_trunk(rms_norm(x + hashed), None, ves, doc_start, args)
        else:                            # or enters through the token gates
            x = self.unet_trunk(rms_norm(x), hashed, ves, doc_start, args)
        if cache is not None:
            cache.advance(tokens)
        return rms_norm(x if copied is None else x + self.document_copy.gains[1] * copied)

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

    def unet_trunk(self, x0, hashed, ves, doc_start, args):
        """U-net: the first half's outputs are added, with learned weights, to the second half's
        inputs; x0 is mixed into every block. With token gates, the hashed embedding (otherwise
        already in x0) enters before the first gated layer and after the later ones' attention."""
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
                x = x + gates[i]["hashed"] * hashed
            ve, rotary = self.layer_inputs(i, ves)
            x = block(x, x0, ve, doc_start, rotary, args, gates.get(i), None if first else hashed)
            if i < self.num_skips:
                skips.append(x)
        return x

    def dense_trunk(self, x0, hashed, ves, doc_start, args):
        """Record 89's trunk: the hashed embedding enters through the token gates (before the first layer,
        then after each attention); the attention-free layer skip_layers[1] adds a gated copy of
        layer skip_layers[0]'s output; the layers after snapshot_layer read its output as their
        attention input; the last layer's mixes and a final mix of earlier states come from the
        dense connections."""
        gates = self.token_gates(0, x0)
        x = x0 + gates[0]["hashed"] * hashed if "hashed" in gates.get(0, {}) else x0
        saved = {"input": x}
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            if i == self.token_gates_split:
                gates.update(self.token_gates(1, x))
            ve, rotary = self.layer_inputs(i, ves)
            attn_in = saved["snapshot"] if i > self.snapshot_layer else x
            if i == self.skip_layers[1]:
                x = x + torch.sigmoid(self.skip_lambda) * gates[i]["skip"] * saved["skip_source"]
            if i < last:            # (layer 0's hashed embedding is already in)
                x = block.forward_dense(x, attn_in, x0, ve, doc_start, rotary, args, gates.get(i),
                                        None if i == 0 else hashed)
            else:
                saved["last_input"] = x
                mix = self.dense(0, x)
                layer_gates = dict(gates.get(i, {}))
                layer_gates["v"] = (mix["v_input"] * saved["input"] + mix["v_snapshot"] * saved["snapshot"]
                                    + mix["v_residual"] * x)
                if ve is not None:         # one gate lane per half of the heads
                    lanes = torch.cat([mix["ve_lane0"], mix["ve_lane1"]], dim=-1)
                    layer_gates["ve"] = lanes.repeat_interleave(block.attn.num_heads // 2, dim=-1)
                x = (1 + mix["residual"]) * x + mix["input"] * saved["input"] + mix["snapshot"] * saved["snapshot"]
                x, saved["mlp_input"] = block.forward_mixed(x, attn_in, saved["input"], ve, doc_start, rotary, args,
                                                            layer_gates, hashed, mix)
            if i == self.skip_layers[0]:
                saved["skip_source"] = x
            if i == self.snapshot_layer:
                saved["snapshot"] = x
        if self.grouped_final_mix:
            tables = {f"value_embed{t}": ve for t, ve in enumerate(ves)}
            return self.dense.grouped_mix(x, {**saved, **tables, "attn_input": rms_norm(saved["snapshot"])})
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
        # The upstream gradient the loss will get: in training the trainer has set it (the loss unit:
        # its backward of the mean over the step's micro-batches), and the cross-entropy hands its
        # stored gradient on untouched; elsewhere a hint (the mean's) that any backward may differ from.
        exact = self.training and self.exact_upstream
        upstream = self.loss_unit if exact else 1.0 / x.size(0)
        sample = self.head_sample(x.size(0))
        extra = {} if sample is None else {"sample": sample}
        if self.pointer is not None:   # the next-token term is the pointer mixture's
            p_copy, a_sink = self.pointer(x, tokens, targets[:, 0], self.pointer_band)
            copy = copy_column(columns)
            if exact and self.fp8_head_pointer_loss is not None:
                objective, next_token = self.fp8_head_pointer_loss(x.to(torch.bfloat16), weight, self.head_fp8_state,
                                                                   all_targets, target_weights, copy, p_copy, a_sink,
                                                                   grad_scale=upstream, **extra)
            else:
                objective, next_token = self.pointer_cross_entropy_fn(self.head(x, weight, sample), all_targets,
                                                                      target_weights, copy, p_copy, a_sink,
                                                                      grad_scale=upstream, exact_upstream=exact)
        elif exact and self.fp8_head_loss is not None:   # the logit gradient written once, in FP8
            objective, next_token = self.fp8_head_loss(x.to(torch.bfloat16), weight, self.head_fp8_state,
                                                       all_targets, target_weights, grad_scale=upstream, **extra)
        else:
            objective, next_token = self.cross_entropy_fn(self.head(x, weight, sample), all_targets, target_weights,
                                                          grad_scale=upstream, exact_upstream=exact)
        return objective.mean(), next_token.mean()

    @torch.no_grad()
    def validation_loss_sum(self, tokens, targets, args: AttentionArgs, chunk_rows=4096):
        """Sum over tokens of the full-vocabulary next-token loss (never a sampled subset)."""
        x = self.hidden_states(tokens, args)
        weight = self.head_weight().type_as(x)
        total = x.new_zeros((), dtype=torch.float32)
        one = torch.ones(1, device=x.device)
        if self.pointer is not None:
            p_copy, a_sink = self.pointer(x, tokens, targets[:, 0], self.pointer_val_band)
        for s in range(0, x.size(0), chunk_rows):
            logits = F.linear(x[s:s + chunk_rows], weight)
            if self.pointer is not None:   # <copy> is no GPT-2 pair's continuation: the mask never hides it
                z = (kernels.softcap(logits) if self.canonical_mask is None
                     else self.canonical_mask.masked_logits(logits, tokens[s:s + chunk_rows]))
                total += kernels.pointer_mixture_nll(z, targets[s:s + chunk_rows, 0], POINTER_COPY_ID,
                                                     p_copy[s:s + chunk_rows], a_sink[s:s + chunk_rows]).sum()
            elif self.canonical_mask is None:
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


# -----------------------------------------------------------------------------------------------
# Data
# -----------------------------------------------------------------------------------------------

def train_loader(h, train_files):
    """The run's TrainLoader (data/loader.py): its largest global batch, target rule and attention
    segments."""
    return TrainLoader(train_files, batch_tokens(h), h.target_rule, h.attention_segment_tokens)


def batch_shape(h, step):
    """(tokens per slice, longest document, slices) of step's global batch."""
    stage = h.stages[stage_index(h, step)]
    return stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks


def loader_at(h, files, step):
    """A TrainLoader that has walked the batches of steps 0..step-1, packing none: where the run's
    loader is at `step`."""
    loader = train_loader(h, files)
    for done in range(step):
        loader.next_batch(*batch_shape(h, done), mine=())
    return loader


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


def anvil_fast_beta(h, step):
    """The fast rail's beta: anvil_fast_beta, or with anvil_fast_beta_follows_mu the scheduled
    mu until blending starts (the fast rail alone is the momentum then)."""
    if h.anvil_fast_beta_follows_mu and anvil_blend(h, step) == 1.0:
        return anvil_mu(h, step)
    return h.anvil_fast_beta


def momentum_schedule(h, step):
    """The scheduled scalars of the Muon family at `step`, those its variant reads: ANVIL's
    Nesterov mu, rail blend and fast rail's beta, or the muon/normuon momentum."""
    if h.optimizer == "anvil":
        return dict(mu=anvil_mu(h, step), blend=anvil_blend(h, step), fast_beta=anvil_fast_beta(h, step))
    return dict(momentum=matrix_momentum(h, step))


def prefix_weight(stage, progress):
    """The prefix target's weight at `progress` in [0, 1) through the stage: from prefix_weight
    toward prefix_weight_end linearly, or with prefix_weight_levels = n in n equal parts of the
    stage, one weight each, the first prefix_weight and the last prefix_weight_end."""
    end = stage.prefix_weight if stage.prefix_weight_end is None else stage.prefix_weight_end
    n = stage.prefix_weight_levels
    if n:
        progress = min(int(progress * n), n - 1) / max(n - 1, 1)
    return stage.prefix_weight + (end - stage.prefix_weight) * progress


def target_weights(stage, device, progress=0.0):
    """(MAX_TARGETS,) loss weights of the targets t+1, t+2, t+3 and of the prefix target, at
    `progress` in [0, 1) through the stage: the multi-token weights go linearly from mtp_weights
    at the stage's first step toward mtp_weights_end at its end (constant without an end), the
    prefix target's as prefix_weight says."""
    end = stage.mtp_weights_end or stage.mtp_weights
    mtp = [a + (b - a) * progress for a, b in zip(stage.mtp_weights, end)]
    prefix = prefix_weight(stage, progress)
    w = mtp + [0.0] * (MAX_TARGETS - 1 - len(mtp)) + [prefix]
    return torch.tensor(w, dtype=torch.float32, device=device)


def step_target_weights(h, device):
    """(num_iterations, MAX_TARGETS): the target weights of every step, made once, so a step reads
    its row without a host-to-device copy."""
    rows = [target_weights(stage, "cpu", i / steps)
            for stage, steps in zip(h.stages, steps_per_stage(h)) for i in range(steps)]
    return torch.stack(rows).to(device)


@dataclass
class TableSchedule:
    """The tables' Adam at a step (the last TablePhase started by then; before the first, the
    base keys): the n-gram table's beta2, the value embeddings' betas, one update every
    `step_every` steps, and the multiplier of both tables' weight decay."""
    ngram_beta2: float
    value_embed_betas: tuple
    step_every: int
    decay_mult: float


def table_schedule(h, step):
    started = [p for p in h.table_phases if p.start <= step]
    if not started:
        return TableSchedule(h.ngram_beta2, tuple(h.value_embed_betas), h.ngram_step_every, 1.0)
    p = started[-1]
    beta1 = h.value_embed_betas[0] if p.value_embed_beta1 is None else p.value_embed_beta1
    return TableSchedule(p.ngram_beta2, (beta1, p.value_embed_beta2), p.step_every, p.decay_mult)


def adam_eps(h, step, steps_per_update):
    """Adam's epsilon (the tables' too) for an update over `steps_per_update` steps at `step`, in
    this objective's gradient scale: adam_eps, or with adam_eps_unit "token_sum" adam_eps over the
    tokens of a rank's slice and the steps, the factor between the gradient of a loss summed over
    them (averaged over the ranks) and this objective's (a mean over the global batch's tokens
    and the steps). An update whose steps span a stage boundary takes its last step's tokens."""
    if h.adam_eps_unit == "mean":
        return h.adam_eps
    return h.adam_eps / (h.stages[stage_index(h, step)].tokens_per_rank * steps_per_update)


def head_sample_seed(h, step):
    """The seed of step's sampled head-gradient rows: the run's seed and the step, 31 bits."""
    return (h.seed * HEAD_SAMPLE_SEED_MULT + step) & kernels.MASK31


def untie_step(h):
    """The first step at which lm_head is its own parameter."""
    return int(h.untie_frac * h.num_iterations)


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
    return growth_history(blocks)


def short_window_history(h, step):
    """The short window's history, as long_window_history's (the final validation keeps it)."""
    return growth_history([h.stages[i].short_window for i in range(stage_index(h, step) + 1)])


def growth_history(blocks):
    """The first window (tokens) of `blocks` and each one wider than all before it."""
    history = []
    for b in blocks:
        if not history or b * WINDOW_BLOCK > history[-1]:
            history.append(b * WINDOW_BLOCK)
    return history


def approximate_backward_at(h, step):
    """(head gradient stride, truncated attention backward) at `step` (PR 371): the sampled
    head gradient from head_grad_start, the truncated backward from attn_bwd_start, both until
    approx_exact_last_steps before the end; (1, False) is the exact backward."""
    end = h.num_iterations - h.approx_exact_last_steps
    sampled = h.head_grad_stride > 1 and h.head_grad_start <= step < end
    return (h.head_grad_stride if sampled else 1), bool(h.attn_bwd_windows) and h.attn_bwd_start <= step < end


def model_at(model, h, step, final_validation=False):
    """Put the model where the schedule has it at `step` (or at the final validation): the long
    window's history (RoPE frequencies and attention scales under YaRN), the head tied or
    untied and the approximate backward. Returns True when this call untied the head (its
    optimizer state then follows)."""
    model.set_windows(long_window_history(h, step, final_validation), short_window_history(h, step))
    if h.head_grad_stride > 1 or h.attn_bwd_windows:
        model.set_approximate_backward(*approximate_backward_at(h, step))
    tied = step < untie_step(h)
    if tied and not model.tied:
        model.tie()
    elif not tied and model.tied:
        model.untie()
        return True
    return False


def graph_changes(h):
    """Steps whose training step differs in shape or structure from the step before: the start
    of every stage and the untie. A compiled model needs one graph for each."""
    N = h.num_iterations
    starts = {s for s in range(1, N) if stage_index(h, s) != stage_index(h, s - 1)}
    approximate = {s for s in range(1, N) if approximate_backward_at(h, s) != approximate_backward_at(h, s - 1)}
    return sorted({0} | starts | approximate | ({untie_step(h)} & set(range(N))))


def validation_points(h):
    """(step, final) of every validation, intermediate ones first."""
    N = h.num_iterations
    middle = [(s, False) for s in range(h.val_every, N, h.val_every)] if h.val_every else []
    return middle + [(N, True)]


# -----------------------------------------------------------------------------------------------
# Kernels and optimizers
# -----------------------------------------------------------------------------------------------


def is_gate(name):
    """Gate weights (value-embedding and smear gates) are small matrices trained with the scalars."""
    return name.endswith("_gate")


def adam_groups(h, model):
    """Adam's parameter groups, each with its LR, betas and (cautious, lr^2-scaled) weight decay.
    The head shares the embedding's betas and decay: it starts as a copy of the embedding. The
    pointer head's projections (pointer_mixture) have a group of their own; its sink key and gain
    are scalars. The document copy feature's parameters are a group, undecayed (PR 378: Adam's
    base LR, betas (0.9, 0.99))."""
    gates = [p for name, p in model.named_parameters() if is_gate(name) and name != "smear_gate"]
    token_gates = list(model.token_gates.parameters()) if model.token_gates is not None else []
    dense = list(model.dense.parameters()) if model.trunk == "dense" else []
    resid = [b.resid_scales for b in model.blocks if hasattr(b, "resid_scales")]
    post = [b.post_scales for b in model.blocks if hasattr(b, "post_scales")]
    copied = list(model.document_copy.parameters()) if model.document_copy is not None else []
    scalars = [p for p in model.parameters()
               if p.ndim < 2 and all(p is not q for q in token_gates + dense + resid + post + copied)]
    bigram = [model.bigram.weight] if model.bigram is not None else []    # (the n-gram table is SparseRowAdam's)
    dense_value_embeds = model.value_sinks is None and not h.value_embed_table_cadence   # (else value_embed_adam's)
    value_embeds = bigram + ([ve.weight for ve in model.value_embeds] if dense_value_embeds else [])
    groups = [
        dict(name="embed", params=[model.embed.weight], lr=h.embed_lr, betas=h.embed_betas, weight_decay=h.embed_wd),
        dict(name="lm_head", params=[model.lm_head], lr=h.head_lr, betas=h.embed_betas, weight_decay=h.embed_wd),
        dict(name="value_embeds", params=value_embeds, lr=h.value_embed_lr, betas=h.value_embed_betas,
             weight_decay=h.value_embed_wd),
        dict(name="scalars", params=scalars, lr=h.scalar_lr, betas=h.scalar_betas, weight_decay=0.0),
        dict(name="resid_scales", params=resid, lr=h.resid_scale_lr, betas=h.scale_betas, weight_decay=0.0),
        dict(name="post_scales", params=post, lr=h.post_scale_lr, betas=h.scale_betas, weight_decay=0.0),
        dict(name="gates", params=gates, lr=h.gate_lr, betas=h.scalar_betas, weight_decay=h.gate_wd),
        dict(name="pointer", params=[model.pointer.query, model.pointer.key] if model.pointer is not None else [],
             lr=h.pointer_lr, betas=h.scalar_betas, weight_decay=0.0),
        dict(name="document_copy", params=copied, lr=h.document_copy_lr, betas=h.scalar_betas, weight_decay=0.0),
        *[dict(name=f"{name}{'_weights' if decayed else ''}", lr=lr, betas=h.scalar_betas,
               weight_decay=h.gate_mlp_wd if decayed else 0.0,
               params=[p for p in params if (p.ndim >= 2) == decayed])
          for name, params, lr in (("token_gates", token_gates, h.token_gate_lr), ("dense", dense, h.dense_lr))
          for decayed in (True, False)],
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


def value_embed_adam(h, model, run_bank=None):
    """With value_embed_table_cadence, the dense value embeddings' own Adam, which steps on the
    tables' cadence with their phases' betas and decay (Trainer.advance_to sets them); else None."""
    if not h.value_embed_table_cadence or model.value_sinks is not None or not model.value_embeds:
        return None
    group = dict(name="value_embeds", params=[ve.weight for ve in model.value_embeds], lr=h.value_embed_lr,
                 betas=h.value_embed_betas, weight_decay=h.value_embed_wd)
    return optim.Adam([group], eps=h.adam_eps, step_every=h.ngram_step_every, run_bank=run_bank,
                      name="value_embed_adam")


def muon_groups(h, model, matrices):
    """The Muon family's groups: the MLP output matrices (lr_scale mlp_down_lr_scale), the QKV
    weights by their row splits, the rest. With matrix_shapes "record_banks" each takes the
    shape factor and lanes of the records' banks: the MLP output matrices stored hidden x dim,
    the narrow-value layers' values and outputs stored dim x dim (a narrow layer uses part of
    each head of full-width bank matrices; the rest stays zero and changes nothing)."""
    banks = h.matrix_shapes == "record_banks"
    mlp_down = [mlp.down for block in model.blocks for mlp in (block.mlp, block.parallel_mlp) if mlp is not None]
    narrow_out = [block.attn.out for i, block in enumerate(model.blocks)
                  if banks and block.attn is not None and i in h.narrow_vo_layers]
    qkv = {}                       # (row splits, value lanes) -> the QKV weights split that way
    for i, block in enumerate(model.blocks):
        if block.attn is not None:
            splits = qkv_row_splits(h, i)
            value_rows = banks and splits is not None and i in h.narrow_vo_layers
            qkv.setdefault((splits, value_rows), []).append(block.attn.qkv)
    packed = mlp_down + narrow_out + [p for params in qkv.values() for p in params]
    groups = [dict(params=[p for p in matrices if all(p is not q for q in packed)], name="matrices"),
              dict(params=mlp_down, lr_scale=h.mlp_down_lr_scale, name="mlp_down",
                   shape_factor=optim.shape_lr_multiplier(h.mlp_hidden, h.model_dim) if banks else None)]
    if narrow_out:
        groups.append(dict(params=narrow_out, name="narrow_out", shape_factor=1.0))
    for (splits, value_rows), params in qkv.items():
        lanes = (None,) * (len(splits) - 1) + ("rows",) if value_rows else None
        groups.append(dict(params=params, row_splits=splits, lanes=lanes, name="qkv"))
    return groups


def build_optimizers(h, model, fns, run_bank=None):
    """Adam for embeddings, head, gates and scalars (the value embeddings' own on the tables'
    cadence); the Muon family (or Adam) for the hidden matrices, orthogonalized in bf16 with the
    Triton X X^T wherever the Triton kernels run. run_bank: how the optimizers run their update
    math (StepGraphs.run_captured: CUDA graphs)."""
    matrices = [p for name, p in model.blocks.named_parameters() if p.ndim == 2 and not is_gate(name)]
    groups = adam_groups(h, model)
    if h.optimizer == "adamw":
        groups.append(dict(name="matrices", params=matrices, lr=h.adamw_matrix_lr, betas=h.embed_betas,
                           weight_decay=0.0))
    adams = [optim.Adam(groups, eps=h.adam_eps, step_every=h.adam_step_every, run_bank=run_bank),
             value_embed_adam(h, model, run_bank)]
    adams = [adam for adam in adams if adam is not None]
    if h.optimizer == "adamw":
        return adams
    muon = optim.Muon(muon_groups(h, model, matrices),
                      lr=h.matrix_lr, momentum=h.momentum, weight_decay=h.matrix_wd,
                      schedule=h.orthogonalize, variant=h.optimizer,
                      fast_beta=h.anvil_fast_beta, slow_beta=h.anvil_slow_beta,
                      ortho_dtype=torch.bfloat16 if fns.xxt else None, xxt=fns.xxt, run_bank=run_bank)
    return adams + [muon]


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
    # AOTAutograd's on-disk cache hands a later run the backward compiled for another stage's
    # gradient-sink length (the sinks change shape through .data, GPT.sinks_of): a second run of
    # a bf16 preset with --cuda_graphs=false failed at the first stage change. Inductor's own
    # cache of generated kernels stays on.
    torch._functorch.config.enable_autograd_cache = False
    return torch.compile(fn, dynamic=False, fullgraph=fullgraph, backend=h.compile_backend)


def graph_key(h, step):
    """What a training step's forward+backward fixes besides its tensors' values: the stage
    (shapes, windows, candidate count, targets), whether the head is tied and, where PR 371's
    approximate backward is on, its state (approximate_backward_at). Steps with one key replay
    one graph; graph_changes(h) lists the first step of each."""
    key = (stage_index(h, step), step < untie_step(h))
    approximate = approximate_backward_at(h, step)
    return key if approximate == (1, False) else key + approximate


def micro_batch_losses(forward, stage, windows, batch: MicroBatch, target_weights, walk=False):
    """(objective, next-token loss) of one micro-batch by `forward` (the model, or its compiled
    form) at a stage and its (short, long) windows in WINDOW_BLOCKs: the sampled softmax's
    candidates, the attention arguments, the forward. Every step's forward goes through here:
    the trainer's, and those the memory budget and the benches trace on fake tensors. walk: the
    candidate walk continues, so batch.candidate_start is moved past this step's draw."""
    columns = None
    if stage.candidates:
        always = (POINTER_COPY_ID,) if getattr(forward, "pointer", None) is not None else ()
        columns = candidate_columns(batch.targets, stage.candidates, batch.candidate_start, always)
        if walk:
            batch.candidate_start.copy_(candidate_walk_after(batch.targets, stage.candidates, batch.candidate_start))
    args = Trainer.attention_args(batch.cu_seqlens, windows)
    return forward(batch.tokens, batch.targets, args, target_weights, columns)


FP8_CALIBRATION_PASSES = 1         # forward+backward passes that record the FP8 amaxes before the first step


# -----------------------------------------------------------------------------------------------
# The Trainer and the training loop
# -----------------------------------------------------------------------------------------------


class Trainer:
    """The model, its optimizers and the schedules that drive them, on one process."""

    def __init__(self, h: Hyperparameters, pg: ProcessGroup, log: RunLog, training=True):
        """training=False: for an evaluation or sampling, which needs no training's memory budget."""
        self.h, self.pg, self.log = h, pg, log
        torch.manual_seed(h.seed)
        self.kernels = select_kernels(h, pg.device)
        check_ngram_table(h, pg)
        # on a CPU too: a run that cannot fit ends at once
        budget = memory_budget.check_memory(this_recipe(), h, pg) if training else None
        self.budget = budget if pg.device.type == "cuda" else None
        self.model = build_model(h, self.kernels, TablePlacement(pg.rank, pg.world_size, h.ngram_cache_rows,
                                                                 pg.device))
        self.model.to(pg.device)
        self.graphs = StepGraphs(self.model, pg.device, h.cuda_graphs,
                                 compiler=functools.partial(compile_fn, h) if h.compile else None)
        self.optimizers = build_optimizers(h, self.model, self.kernels,
                                           self.graphs.run_captured if h.cuda_graphs else None)
        self.adam = next(opt for opt in self.optimizers if isinstance(opt, optim.Adam))
        self.value_adam = next((opt for opt in self.optimizers if getattr(opt, "name", "") == "value_embed_adam"), None)
        self.tables = SparseTables(h, self.model, pg, use_triton=self.kernels.xxt is not None)
        self.forward, self.validation_loss_sum = self.model, self.model.validation_loss_sum
        if h.compile:
            fullgraph = not any(kernels.breaks_graphs(fn) for fn in (self.kernels.attention,
                                                                     self.kernels.cross_entropy))
            self.forward = compile_fn(h, self.model, fullgraph)
            self.validation_loss_sum = compile_fn(h, self.model.validation_loss_sum, fullgraph)
        self.autocast = torch.autocast(pg.device.type, dtype=torch.bfloat16,
                                       enabled=h.compute_dtype == "bfloat16")
        self.accum = h.batch_ranks // pg.world_size
        self.mine = list(range(pg.rank, h.batch_ranks, pg.world_size))
        self.step_weights = step_target_weights(h, pg.device)
        self.weights = self.step_weights[0].clone()  # this step's row: one tensor the model always reads
        self.step_losses = torch.zeros(2, device=pg.device)  # the step's (next-token loss, objective)
        self.train_time_ms = 0.0
        self.averages = optim.WeightAverages(h.averages, self.model, h.num_iterations, self.kernels.ema_update,
                                       h.average_norms)
        self.window_choice = backward_windows.WindowChoice(h.attn_bwd_windows, h.attn_bwd_error_bound)
        self.reset_walk()
        self.advance_to(0)

    def needs_warm_up(self):
        """Whether the first steps would compile something (torch.compile or the Triton JIT), or
        the config asks for a warm-up anyway: the first step of each shape also maps its memory,
        page faults whose cost on a CPU grows with the memory the process already holds (a 16M-row
        n-gram table made them 7x slower than a 1M-row one)."""
        return self.h.warmup_steps > 0 and (self.h.compile or self.kernels.triton or self.h.warm_up == "always")

    # -- the schedule
    def advance_to(self, step, final_validation=False):
        """Put the model and the optimizers where the schedule has them at `step` (or at the final
        validation): attention windows with their YaRN frequencies and scale, the head tied or
        untied, learning rates and momenta. Every schedule goes through here; the training loop
        and the warm-up both call it, in any order. Values change in place, so a compiled step
        reads them without recompiling (the tie flag picks one of two graphs the warm-up built)."""
        h = self.h
        if model_at(self.model, h, step, final_validation):   # untied here: lm_head continues the embedding
            self.adam.copy_state(self.model.embed.weight, self.model.lm_head)
        lr, tables = lr_multiplier(h, step), table_schedule(h, step)
        self.tables.set_schedule(lr, tables, adam_eps(h, step, tables.step_every))
        for opt in self.optimizers:
            if opt is self.value_adam:     # on the tables' cadence, with their phases' betas and decay
                opt.step_every = tables.step_every
                for group in opt.param_groups:
                    group.update(betas=tables.value_embed_betas, weight_decay=h.value_embed_wd * tables.decay_mult)
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr
                if isinstance(opt, optim.Muon):
                    group.update(momentum_schedule(h, step))
                else:
                    group["eps"] = adam_eps(h, step, opt.step_every)

    @staticmethod
    def attention_args(cu_seqlens, windows):
        """The attention arguments of a slice for (short, long) windows in WINDOW_BLOCKs."""
        return AttentionArgs(cu_seqlens, windows[0] * WINDOW_BLOCK, windows[1] * WINDOW_BLOCK)

    # -- steps
    def micro_batch(self, stage, windows, batch: MicroBatch, forward=None):
        """Forward and backward of one micro-batch: the gradients and self.step_losses accumulate.
        Everything it reads is a tensor that keeps its address or fixed by the graph key (stage,
        windows, tied head), so it can be captured and replayed. forward: the model's own (the
        probed choice steps, eager) instead of self.forward."""
        with self.autocast, record_function("forward"):
            objective, next_token = micro_batch_losses(forward or self.forward, stage, windows, batch, self.weights,
                                                       walk=self.h.candidate_walk == "continue")
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
        self.model.set_loss_unit(self.loss_unit(stage))
        self.model.set_head_sample_seed(head_sample_seed(self.h, step))
        choosing = bool(self.h.attn_bwd_windows) and step in self.h.attn_bwd_choice_steps
        probing = self.window_choice.probing(self.model.blocks, self.kernels.attention, choosing)
        with self.model.sinks_of(stage.tokens_per_rank), probing:
            for slice_index, s in zip(self.mine, slices):
                self.tables.fetch(s.tokens, route=s.route)
                if choosing:               # eager and uncompiled: the probes' hooks see every call
                    batch = MicroBatch.of(s, self.walk_start(slice_index), self.pg.device)
                    self.micro_batch(stage, attention_windows(self.h, step), batch, forward=self.model)
                else:
                    batch = self.graphs.run(graph_key(self.h, step), body, s, self.walk_start(slice_index))
                if self.h.candidate_walk == "continue":
                    self.walk[slice_index].copy_(batch.candidate_start)
                self.tables.take_entries(s)
        if choosing and step == self.h.attn_bwd_choice_steps[-1]:   # every rank's largest errors choose
            reduce_max = (lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX)) if self.pg.world_size > 1 else None
            self.log.write(self.window_choice.apply(self.model.blocks, reduce_max), echo=True)
        return self.step_losses.clone()

    def walk_start(self, slice_index):
        """Where the candidate walk of a slice starts this step: its fixed start, or (continue)
        where its last sampled step left it (a device scalar)."""
        if self.h.candidate_walk == "continue":
            return self.walk[slice_index]
        return candidate_start(slice_index, self.h.batch_ranks)

    def reset_walk(self):
        """Every slice's candidate walk back at its start, as at step 0."""
        self.walk = torch.tensor([candidate_start(i, self.h.batch_ranks) for i in range(self.h.batch_ranks)],
                                 dtype=torch.int64).to(self.pg.device)

    def train_step(self, step, slices):
        """One optimizer step on the global batch; advance_to(step) has set the schedule."""
        loss = self.forward_backward(step, slices)
        with record_function("optimizers"):
            stepped = optim.step_together(self.optimizers)
        for opt, updated in zip(self.optimizers, stepped):
            if updated:   # an Adam between its updates keeps accumulating gradients
                opt.zero_grad(set_to_none=not self.h.cuda_graphs)  # a graph adds into the same tensors
        if self.tables.any:
            with record_function("optimizer: SparseRowAdam"):
                self.tables.step()
        return loss

    def loss_unit(self, stage):
        """The weight the objective gives one token's loss in `stage`: its mean over each
        micro-batch's tokens, averaged over this process's micro-batches."""
        return 1.0 / (stage.tokens_per_rank * self.accum)

    def capture_graph(self, step, prepare_only=False):
        """Capture the forward+backward of `step`'s graph key (on CUDA with cuda_graphs; a step of
        that key must have run), or only run the eager step on the capture stream that its
        capture needs first (StepGraphs.prepare), with the key's stage's loss unit set as its
        timed steps set it."""
        stage = self.h.stages[stage_index(self.h, step)]
        self.model.set_loss_unit(self.loss_unit(stage))
        with self.model.sinks_of(stage.tokens_per_rank):
            (self.graphs.prepare if prepare_only else self.graphs.capture)(graph_key(self.h, step))

    def calibrate_fp8(self, slices):
        """Record the FP8 amaxes of the initial weights on the first step's batch (gradients
        discarded), so that the first step's delayed scales fit its tensors instead of starting
        from the uncalibrated defaults."""
        if not self.kernels.any_fp8:
            return
        for _ in range(FP8_CALIBRATION_PASSES):
            self.forward_backward(0, slices)
        self.zero_grads()
        self.reset_walk()

    def zero_grads(self):
        """No gradient pending anywhere, as at the start of a run."""
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        self.graphs.zero_grads()
        for sink in self.model.gradient_sinks():   # zeroed in place: captured graphs add into them
            if sink.grad is not None:
                sink.grad.zero_()
        self.tables.drop_entries()

    @torch.no_grad()
    def validate(self, slices, step, final_validation, before_slice=None):
        """Mean full-vocabulary loss over `slices` (and the other ranks' as many), in the compute
        dtype with no FP8; before_slice(i) is called before the i-th slice (0-based)."""
        self.model.eval()
        total = torch.zeros((), device=self.pg.device)
        for i, s in enumerate(slices):
            if before_slice is not None:
                before_slice(i)
            self.tables.fetch(s.tokens, training=False)
            s = s.to(self.pg.device)
            with self.autocast:
                args = self.attention_args(s.cu_seqlens, attention_windows(self.h, step, final_validation))
                total += self.validation_loss_sum(s.tokens, s.targets, args)
        if self.pg.world_size > 1:
            dist.all_reduce(total)
        self.model.train()
        return total.item() / (len(slices) * self.h.val_tokens_per_rank * self.pg.world_size)


def first_batch(h, train_files, mine):
    """This rank's slices of step 0's batch (a fresh loader starts where the run's does)."""
    stage = h.stages[0]
    return train_loader(h, train_files).next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, mine)


def tokens_after_steps(h):
    """[tokens trained after each of 0..N steps]: the global batch of each step's stage, summed."""
    per_step = [s.tokens_per_rank * h.batch_ranks for s, steps in zip(h.stages, steps_per_stage(h))
                for _ in range(steps)]
    return list(itertools.accumulate(per_step, initial=0))


def run_clock(h, pg, val_slices):
    """The RunClock of this run's schedule: its tokens per step, its validations, this process's
    validation slices. A step's time follows its tokens (later stages have larger batches)."""
    return RunClock(tokens_after_steps(h), [step for step, _ in validation_points(h)], len(val_slices),
                    h.val_tokens_per_rank, pg.world_size)


def train(h, pg, log, resumed=None):
    """Train h on the process group pg, logging to log; `resumed`: a resume state (machinery/resume.py) to
    continue from."""
    train_files, val_files = shards_of(h.train_files), shards_of(h.val_files)
    check_validation_split(h, pg)
    if h.resume_every or resumed:
        resume.refuse_unresumable(h, pg.world_size)
    metrics.refuse_missing(h.metrics)
    started, load_at_start, threads = time.perf_counter(), load_average(), run_threads(pg)
    log.header(project_sources(), environment(pg.world_size, gemm_path(h, pg.device), load_at_start),
               [fingerprint(f) for f in val_files + train_files], logged_config(h))
    if note := start_load_note(load_at_start, threads):
        log.write(note, echo=True)
    val_slices = validation_data(h, pg, val_files)
    trainer = Trainer(h, pg, log)
    log.write(f"model parameters: {trainer.model.num_parameters():,}", echo=True)
    if trainer.budget is not None:
        total = torch.cuda.get_device_properties(pg.device).total_memory
        log.write(f"memory budget: {trainer.budget.summary(total)} on each GPU (its step "
                  f"{trainer.budget.step / 2**30:.1f} GiB)", echo=True)
    sink = metrics.open_sink(h, log.run_id, logged_config(h), log.active)
    if sink.where:
        log.write(f"metrics: {sink.where}", echo=True)
    log.progress = "in the warm-up"
    untimed_t0 = time.perf_counter()
    kernel_choice.start_run(pg.device, selecting=trainer.kernels.triton and trainer.needs_warm_up())
    warm_graphs = (warm_up(this_recipe(), trainer, train_files, val_slices, Progress(log, "warming up"))
                   if trainer.needs_warm_up() else 0)
    for line in kernel_choice.end_run():    # each shape's implementation, timed in the warm-up or by rule
        log.write(line, echo=False)
    if trainer.kernels.any_fp8:
        trainer.calibrate_fp8(first_batch(h, train_files, trainer.mine))
    log.write(warm_up_line(this_recipe(), trainer, time.perf_counter() - untimed_t0, warm_graphs), echo=True)
    start = resumed["step"] if resumed else 0
    if resumed:
        resume.restore_state(trainer, resumed)
        log.write(f"resumed: from {resumed['path']} at step {start} of run {resumed['run_id']}, train_time "
                  f"{trainer.train_time_ms:.0f}ms so far", echo=True)
    gc.collect()
    gc.freeze()                    # the warm-up's objects leave the collector's view: shorter pauses in the timed run
    trainer.tables.start_timing()
    batches = BatchPrefetcher(loader_at(h, train_files, start), functools.partial(batch_shape, h), trainer.mine,
                              pin=pg.device.type == "cuda", router=trainer.tables.router, start=start)
    if resumed:
        resume.check_data_position(resumed["path"], resumed, batches.peek())
    next_save = start + h.resume_every
    losses, clock = DeferredLossLines(pg.device), run_clock(h, pg, val_slices)
    N = h.num_iterations
    synchronize(pg.device)
    graphs_before_timing, eager_before_timing = compiled_graphs(), trainer.graphs.eager_runs
    t0 = time.perf_counter()
    try:
        for step in range(start, N + 1):
            log.progress = f"at step {step}/{N}"
            last = step == N
            if h.resume_every and next_save <= step < N and resume.nothing_pending(trainer):
                synchronize(pg.device)
                trainer.train_time_ms += 1000 * (time.perf_counter() - t0)
                resume.save_resume_state(trainer, step, batches, log)
                next_save, t0 = step + h.resume_every, time.perf_counter()
            if last and h.averages:
                shipped = trainer.averages.ship()
            if last or (h.val_every and step % h.val_every == 0 and step > 0):
                synchronize(pg.device)
                trainer.train_time_ms += 1000 * (time.perf_counter() - t0)
                write_loss_lines(log, losses.ready(wait=True), h, clock, sink)
                trainer.advance_to(step, final_validation=last)
                val_t0, before_slice = time.perf_counter(), validation_progress(trainer, step, last, len(val_slices))
                val_loss = trainer.validate(val_slices, step, last, before_slice)
                clock.validated(time.perf_counter() - val_t0)
                log.write(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{trainer.train_time_ms:.0f}ms "
                          f"step_avg:{trainer.train_time_ms / max(step, 1):.2f}ms", echo=True)
                check_finite("val", val_loss, step, log)
                sink.scalars(step, {"val/loss": val_loss})
                synchronize(pg.device)
                t0 = time.perf_counter()
            if last:
                break
            trainer.advance_to(step)
            slices = batches.get(step)
            with host_syncs_are_errors(h.sync_check and pg.device.type == "cuda"):
                loss = trainer.train_step(step, slices)
            trainer.averages.sample(step)
            trainer.tables.after_step(batches if step + 1 < N else None)
            if step % h.log_every == 0 or step == N - 1:
                if pg.world_size > 1:
                    dist.all_reduce(loss)
                elapsed = trainer.train_time_ms + 1000 * (time.perf_counter() - t0)
                losses.add(step + 1, elapsed, loss / pg.world_size)
            write_loss_lines(log, losses.ready(), h, clock, sink)
    finally:
        batches.close()
        sink.close()
    if h.averages:
        log.write(f"averages: {shipped} blends into the weights before the final validation", echo=True)
    write_execution_lines(log, trainer, warm_graphs, compiled_graphs() - graphs_before_timing,
                          trainer.graphs.eager_runs - eager_before_timing)
    peak = peak_memory_mib(pg.device)
    if h.save_checkpoint and pg.master:
        path = os.path.join(h.log_dir, f"{log.run_id}_model.safetensors")
        data_sha256 = save_checkpoint(path, trainer.model, h, log.run_id, log.seal(), val_loss, trainer.train_time_ms)
        log.write(f"checkpoint: {path} data_sha256={data_sha256}", echo=True)
    elif h.save_checkpoint and (shard := split_ngram_table(trainer.model)) is not None:
        send_table_shard(shard)    # rank 0 writes this process's rows of the table into the checkpoint
    write_load_lines(log, load_at_start, time.perf_counter() - started, threads)
    log.write(f"final val_loss:{val_loss:.4f} train_time:{trainer.train_time_ms:.0f}ms steps:{N} "
              f"peak_memory:{peak}MiB", echo=True)
    if pg.master:
        print(target_line(h, val_loss, log.path, parse_config(["--preset", "speedrun"])), flush=True)
    return val_loss


# -----------------------------------------------------------------------------------------------
# main: how a run ends
# -----------------------------------------------------------------------------------------------


def this_recipe():
    """This module, the recipe the memory budget runs on fake tensors (under `python train_gpt.py`,
    the script itself: __main__)."""
    return sys.modules[__name__]


def main(argv=None, command=None, run=None):
    """Train (or --plan) from the command line; `run(argv)` instead runs another entry point's
    `command` (evaluation/evaluate.py's eval and sample) under the same ending
    (machinery/command_line.py: an error or a signal is one line, never a traceback)."""
    return command_line.run_command(this_recipe(), argv, command, run)


if __name__ == "__main__":
    sys.exit(main())
