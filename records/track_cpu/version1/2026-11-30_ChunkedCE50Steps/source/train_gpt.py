"""Train a GPT-2-small-class language model on FineWeb as fast as possible.

Read top-down: the config and its presets; the model; the data loader; the schedules;
the log; the training loop; main(). Kernels live in kernels.py, optimizers in optim.py.

    ./run.sh                                              # picks the preset for this machine
    python train_gpt.py --preset cpu                      # CPU track, tiny offline corpus
    python -m torch.distributed.run --standalone --nproc_per_node=8 train_gpt.py --preset speedrun
    python train_gpt.py --preset cpu --num_iterations=50 --seed=1   # any config key: --key=value

Presets: `speedrun` (8 GPUs), `1gpu` (the same global batch on 1 GPU by gradient accumulation),
`cpu` (the CPU track). Every run writes logs/<run id>.txt: the verbatim source of every project
file it imported, the environment, the data fingerprints, the resolved config, then step lines.
"""
import argparse
import ctypes
import dataclasses
import datetime
import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernels
import optim
from data.shards import ShardError, find_shards, fingerprint, read_shard
from data.tokenizer import BOS_ID, prefix_token_table

REPO_DIR = os.path.dirname(os.path.abspath(__file__))
LOG_FORMAT_VERSION = "v1"
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


@dataclass
class Hyperparameters:
    preset: str = "speedrun"
    track: str = "track_1_short"   # records track a run of this preset belongs to, or "none"
    # data
    train_files: str = "data/fineweb10B/fineweb_train_*.bin"
    val_files: str = "data/fineweb10B/fineweb_val_*.bin"
    val_tokens: int = 10_485_760   # first tokens of the val shard(s) every run is judged on
    val_tokens_per_rank: int = 65_536  # val tokens per rank per forward pass
    val_every: int = 0             # validate every this many steps (0: only at the end)
    batch_ranks: int = 8           # the global batch is this many rank slices; fewer processes accumulate
    # model
    num_layers: int = 11
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    mlp_hidden: int = 3072
    long_window_layers: tuple = (3, 10)  # layers that use the long window; others the short one
    attention_free_layers: tuple = (7,)  # layers with no attention sublayer
    num_value_embeds: int = 3      # value-embedding tables, used by the first and the last layers
    value_embed_gate_dim: int = 12 # the first this-many residual dims drive the per-head gates
    bigram_rows: int = 251_520     # rows of the bigram hash embedding
    rope_base: float = 1024.0      # RoPE base period
    attn_scale: float = 0.1        # softmax scale of QK-normed attention before any YaRN growth
    val_long_window: int = 20      # long window (blocks) of the final validation
    untie_frac: float = 2 / 3      # fraction of training after which lm_head is untied from the embedding
    # schedule
    num_iterations: int = 1194
    stages: list = field(default_factory=lambda: [
        Stage(0.268, 16_384, 896, 1, 3, (1.0, 0.5, 0.25), 0.25),
        Stage(0.570, 32_768, 2048, 3, 7, (1.0, 0.5, 0.0), 0.25),
        Stage(0.927, 49_152, 3072, 5, 11, (1.0, 0.25, 0.0), 0.0),
        Stage(1.000, 49_152, 3072, 6, 13, (1.0, 0.0, 0.0), 0.0),
    ])
    cooldown_start: float = 0.4    # fraction of training where the linear LR cooldown starts
    cooldown_floor: float = 0.15   # LR multiplier at the end of the cooldown
    # optimizers
    optimizer: str = "anvil"       # matrix optimizer: muon | normuon | anvil | adamw (Adam for everything)
    orthogonalize: str = "auto"    # polar_express (record 89) | anvil (record 92) | auto: anvil for anvil
    matrix_lr: float = 0.05
    adamw_matrix_lr: float = 0.008 # Adam's LR for the hidden matrices when optimizer=adamw
    matrix_wd: float = 0.0
    mlp_down_lr_scale: float = 2.0 # extra LR multiplier of the MLP output matrices (anvil)
    momentum: float = 0.95         # muon/normuon momentum after warm-up
    momentum_warmup_start: float = 0.85
    momentum_warmup_steps: int = 300
    anvil_fast_beta: float = 0.85  # beta of the fast momentum rail
    anvil_slow_beta: float = 0.98  # beta of the slow momentum rail
    anvil_blend: float = 0.4385    # weight of the fast rail once blending starts (1.0 before)
    anvil_blend_start: float = 0.43  # fraction of training where blending starts (step 514 of 1194)
    anvil_mu_low: float = 0.85     # Nesterov mu at the start and the end
    anvil_mu_high: float = 0.93    # Nesterov mu in the middle
    anvil_mu_rise: float = 0.2     # fraction of training over which mu rises (240 of 1194 steps)
    anvil_mu_fall: float = 0.042   # final fraction over which mu falls back (50 of 1194 steps)
    embed_lr: float = 0.01         # embedding, value embeddings and bigram table (and the head while tied)
    head_lr: float = 0.008
    scalar_lr: float = 0.04
    adam_betas: tuple = (0.8, 0.95)
    adam_eps: float = 1e-10
    adam_wd: float = 0.0
    # system
    seed: int = 0
    device: str = "auto"           # auto | cuda | cpu
    kernels: str = "auto"          # auto (Triton on CUDA; references on CPU, CE chunked) | triton | reference
    compile: bool = True           # torch.compile the model on CUDA
    fp8_mlp: bool = True           # MLPs as the fused FP8 ReLU^2 kernel pair (CUDA only; bf16 elsewhere)
    warmup_steps: int = 3          # untimed steps per stage shape before timing starts (CUDA only)
    log_every: int = 10            # print a train-loss line every this many steps
    log_dir: str = "logs"
    save_checkpoint: bool = False  # write logs/<run id>_model.pt at the end


def _cpu_preset(h):
    """The CPU track: a 4-layer, width-256 model on the tiny corpus, 2 cores, a few minutes.

    Full-vocabulary softmax throughout: at this scale sampled softmax learns much more slowly
    per step and per second (the rare tokens' logits are rarely pushed down), measured on
    this machine: val 7.42 (16,384 candidates) vs 6.09 (full) after 20 steps.
    """
    h.track = "track_cpu"
    h.train_files = "data/tiny_corpus/tiny_train_*.bin"
    h.val_files = "data/tiny_corpus/tiny_val_*.bin"
    h.val_tokens = 65_536
    h.val_tokens_per_rank = 8_192
    h.batch_ranks = 1
    h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden = 4, 256, 2, 128, 1024
    h.long_window_layers, h.attention_free_layers = (3,), ()
    h.num_value_embeds, h.bigram_rows = 1, 8192
    h.val_long_window = 8
    h.num_iterations = 50          # the CPU-track record's budget (records/track_cpu); 120 reach ~4.98
    h.stages = [
        Stage(0.5, 2048, 512, 1, 2, (1.0, 0.5, 0.25), 0.25),
        Stage(0.8, 4096, 1024, 2, 4, (1.0, 0.5), 0.25),
        Stage(1.0, 4096, 1024, 2, 6, (1.0,), 0.0),
    ]
    h.momentum_warmup_steps = 40   # chosen for 120 steps; the 50-step record kept it
    h.log_every = 5
    h.compile = False


def _one_gpu_preset(h):
    h.track = "none"               # the same dynamics as speedrun, but not an 8xH100 record


PRESETS = {"speedrun": lambda h: None, "1gpu": _one_gpu_preset, "cpu": _cpu_preset}


class ConfigError(Exception):
    """A bad preset, key or value: the message says which and what is allowed."""


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
            raise ConfigError(f"--{key} expects a {type(current).__name__}, got {text!r}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"--{key} expects JSON (a list), got {text!r}") from None


def config_from_dict(d):
    """A Hyperparameters from a resolved-config dict (as written into a log)."""
    d = {k: v for k, v in d.items() if k not in LOG_ONLY_KEYS}
    known = {f.name for f in dataclasses.fields(Hyperparameters)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}")
    h = Hyperparameters(**d)
    return normalize_config(h)


def normalize_config(h):
    """Turn JSON-ish values (lists, dicts) into the dataclass's types and check them."""
    h.stages = [s if isinstance(s, Stage) else Stage(**s) if isinstance(s, dict) else Stage(*s)
                for s in h.stages]
    for s in h.stages:
        s.mtp_weights = tuple(float(w) for w in s.mtp_weights)
    h.long_window_layers = tuple(h.long_window_layers)
    h.attention_free_layers = tuple(h.attention_free_layers)
    h.adam_betas = tuple(h.adam_betas)
    if not h.stages or abs(h.stages[-1].end - 1.0) > 1e-9:
        raise ConfigError("the last stage must end at 1.0 (the fraction of num_iterations)")
    if any(len(s.mtp_weights) > MAX_TARGETS - 1 for s in h.stages):
        raise ConfigError(f"at most {MAX_TARGETS - 1} multi-token targets are supported")
    if h.optimizer not in ("muon", "normuon", "anvil", "adamw"):
        raise ConfigError(f"--optimizer must be muon, normuon, anvil or adamw, got {h.optimizer!r}")
    if h.orthogonalize == "auto":
        h.orthogonalize = "anvil" if h.optimizer == "anvil" else "polar_express"
    if h.kernels not in ("auto", "triton", "reference"):
        raise ConfigError(f"--kernels must be auto, triton or reference, got {h.kernels!r}")
    return h


def parse_config(argv):
    """--preset NAME, --config PATH (a resolved config from a log), then --key=value overrides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=True)
    parser.add_argument("--preset", default=None, help=f"one of {sorted(PRESETS)}")
    parser.add_argument("--config", default=None, help="JSON file of a resolved config")
    args, rest = parser.parse_known_args(argv)
    if args.config and args.preset:
        raise ConfigError("give --preset or --config, not both (a config file already names its preset)")
    if args.config:
        try:
            with open(args.config) as f:
                h = config_from_dict(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read --config {args.config}: {e}") from None
    else:
        preset = args.preset or "speedrun"
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        h = Hyperparameters(preset=preset)
        PRESETS[preset](h)
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    for item in rest:
        if not item.startswith("--") or "=" not in item:
            raise ConfigError(f"expected --key=value, got {item!r}")
        key, text = item[2:].split("=", 1)
        if key not in fields or key == "preset":
            raise ConfigError(f"unknown config key {key!r}; known keys: {', '.join(sorted(fields))}")
        setattr(h, key, _parse_value(key, text, getattr(h, key)))
    return normalize_config(h)


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
YARN_ALPHA = 1.0                   # YaRN: frequencies with fewer rotations per window than this are interpolated fully
YARN_BETA = 32.0                   # YaRN: ... and those with more than this are kept as they are
YARN_ATTN_SCALE = 0.1              # YaRN: attention scale grows by this times ln(window growth)
MAX_TARGETS = 4                    # next token, two more multi-token targets, the prefix target


def rms_norm(x):
    return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    """RoPE on half of the head dims; the other half stays stationary (zero frequency).

    Frequencies follow base period `base` over head_dim/4 rotating pairs. When the attention
    window grows, `grow_window` applies YaRN: low frequencies (few rotations inside the old
    window) are slowed by old/new so the model sees familiar angles at the new distances.
    """

    def __init__(self, head_dim, base, max_tokens):
        super().__init__()
        quarter = head_dim // 4
        freq = (1.0 / base) ** torch.linspace(0, 1, quarter)
        self.register_buffer("freq", torch.cat([freq, freq.new_zeros(quarter)]), persistent=False)
        self.max_tokens = max_tokens
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self._tabulate()

    def _tabulate(self):
        angles = torch.outer(torch.arange(self.max_tokens, dtype=torch.float32,
                                          device=self.freq.device), self.freq)
        self.cos, self.sin = angles.cos(), angles.sin()

    def grow_window(self, old_tokens, new_tokens):
        """YaRN frequency adjustment for a window growing from old_tokens to new_tokens."""
        rotations = old_tokens * self.freq / (2 * math.pi)
        keep = ((rotations - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)
        ratio = old_tokens / new_tokens
        self.freq = self.freq * (ratio + keep * (1 - ratio))
        self._tabulate()

    def forward(self, x):
        T = x.size(0)
        cos, sin = self.cos[:T, None, :].to(x.dtype), self.sin[:T, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


@dataclass
class AttentionArgs:
    """Everything attention needs about the packed batch and the current windows."""
    cu_seqlens: torch.Tensor
    max_seqlen: int
    short_window: int              # tokens
    long_window: int               # tokens
    scale: float


class CausalSelfAttention(nn.Module):
    def __init__(self, h: Hyperparameters, long_window: bool, value_embed: bool, attention_fn):
        super().__init__()
        inner = h.num_heads * h.head_dim
        self.num_heads, self.head_dim, self.long_window = h.num_heads, h.head_dim, long_window
        self.qkv = nn.Parameter(torch.empty(3 * inner, h.model_dim))
        self.out = nn.Parameter(torch.zeros(h.model_dim, inner))
        self.attention_fn = attention_fn
        if value_embed:
            self.ve_gate = nn.Parameter(torch.zeros(h.num_heads, h.value_embed_gate_dim))
        else:
            self.ve_gate = None
        bound = (3 ** 0.5) * 0.5 * h.model_dim ** -0.5
        nn.init.uniform_(self.qkv, -bound, bound)

    def forward(self, x, ve, rotary: Rotary, args: AttentionArgs):
        T = x.size(0)
        q, k, v = F.linear(x, self.qkv.type_as(x)).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = rotary(rms_norm(q)), rotary(rms_norm(k))
        if ve is not None:
            gate = 2 * torch.sigmoid(F.linear(x[:, :self.ve_gate.size(1)], self.ve_gate.type_as(x)))
            v = v + gate[..., None] * ve.view_as(v)
        window = args.long_window if self.long_window else args.short_window
        y = self.attention_fn(q, k, v, args.cu_seqlens, args.max_seqlen, window, args.scale)
        return F.linear(y.reshape(T, -1), self.out.type_as(y))


class MLP(nn.Module):
    """relu(x W_up^T)^2 W_down^T, W_down zero-initialized so each block starts as identity.

    With `fp8_fn` (kernels.fp8_relu2_mlp or its reference) both GEMMs run in FP8 with delayed
    activation/gradient scales kept in the `fp8_state` buffer; otherwise in the autocast dtype.
    """

    def __init__(self, dim, hidden, fp8_fn=None):
        super().__init__()
        self.up = nn.Parameter(torch.empty(hidden, dim))
        self.down = nn.Parameter(torch.zeros(dim, hidden))
        bound = (3 ** 0.5) * 0.5 * dim ** -0.5
        nn.init.uniform_(self.up, -bound, bound)
        self.fp8_fn = fp8_fn
        if fp8_fn is not None:
            self.register_buffer("fp8_state", kernels.new_fp8_mlp_state(self.up.device))

    def forward(self, x):
        if self.fp8_fn is not None:
            return self.fp8_fn(x.to(torch.bfloat16), self.up, self.down, self.fp8_state)
        return F.linear(F.relu(F.linear(x, self.up.type_as(x))).square(), self.down.type_as(x))


class Block(nn.Module):
    def __init__(self, h, layer, fns, value_embed):
        super().__init__()
        has_attn = layer not in h.attention_free_layers
        self.attn = (CausalSelfAttention(h, layer in h.long_window_layers, value_embed, fns.attention)
                     if has_attn else None)
        self.mlp = MLP(h.model_dim, h.mlp_hidden, fns.fp8_mlp)
        # residual mix: x <- lambdas[0] * x + lambdas[1] * x0 before the sublayers
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.0]))

    def forward(self, x, x0, ve, rotary, args):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        if self.attn is not None:
            x = x + self.attn(rms_norm(x), ve, rotary, args)
        return x + self.mlp(rms_norm(x))


def bigram_rows(tokens, is_doc_start, rows):
    """Hash (previous, current) token pairs to table rows; a document's first token gets the last row."""
    cur, prev = tokens.long(), torch.roll(tokens.long(), 1)
    row = ((BIGRAM_MULT_CUR * cur) ^ (BIGRAM_MULT_PREV * prev)) % (rows - 1)
    return torch.where(is_doc_start, rows - 1, row)


def bigram_sign_rows(tokens):
    cur, prev = tokens.long(), torch.roll(tokens.long(), 1)
    return ((SIGN_MULT_CUR * cur) ^ (SIGN_MULT_PREV * prev)) % SIGN_ROWS


class GPT(nn.Module):
    """The speedrun GPT on a packed stream of documents.

    Embedding (+ bigram hash embedding, sign trick) -> RMS norm -> blocks with U-net skips
    (the first half's outputs are added, with learned weights, to the second half's inputs)
    -> RMS norm -> lm_head (tied to the embedding until `untie`) -> softcapped cross-entropy
    over all or a sampled subset of vocabulary columns, with multi-token and prefix targets.
    """

    def __init__(self, h: Hyperparameters, fns: "KernelFns"):
        super().__init__()
        self.cross_entropy_fn = fns.cross_entropy
        self.embed = nn.Embedding(PADDED_VOCAB_SIZE, h.model_dim)
        nn.init.normal_(self.embed.weight, std=h.model_dim ** -0.5)
        self.lm_head = nn.Parameter(torch.zeros(PADDED_VOCAB_SIZE, h.model_dim))
        self.tied = True
        self.bigram = nn.Embedding(h.bigram_rows, h.model_dim)
        nn.init.zeros_(self.bigram.weight)
        signs = torch.randint(0, 2, (SIGN_ROWS, h.model_dim),
                              generator=torch.Generator().manual_seed(SIGN_TABLE_SEED)) * 2 - 1
        self.register_buffer("signs", signs.float(), persistent=False)
        self.value_embeds = nn.ModuleList(nn.Embedding(PADDED_VOCAB_SIZE, h.num_heads * h.head_dim)
                                          for _ in range(h.num_value_embeds))
        for ve in self.value_embeds:
            nn.init.normal_(ve.weight, std=0.01)
        n = h.num_layers
        self.value_embed_layer = {i: i for i in range(h.num_value_embeds)}
        self.value_embed_layer.update({n - h.num_value_embeds + i: i for i in range(h.num_value_embeds)})
        self.blocks = nn.ModuleList(Block(h, i, fns, i in self.value_embed_layer) for i in range(n))
        self.num_skips = n // 2
        self.skip_weights = nn.Parameter(torch.ones(self.num_skips))
        max_tokens = max(max(s.tokens_per_rank for s in h.stages), h.val_tokens_per_rank)
        self.rotary = Rotary(h.head_dim, h.rope_base, max_tokens)
        self.register_buffer("prefix_table", torch.from_numpy(prefix_token_table()).long(), persistent=False)

    def untie(self):
        """From now on lm_head is its own parameter, starting from the embedding's values."""
        with torch.no_grad():
            self.lm_head.copy_(self.embed.weight)
        self.tied = False

    def head_weight(self):
        return self.embed.weight if self.tied else self.lm_head

    def hidden_states(self, tokens, args: AttentionArgs):
        is_start = tokens == BOS_ID
        is_start[0] = True         # a slice may begin inside a document: its first token has no known predecessor
        bigram = self.bigram(bigram_rows(tokens, is_start, self.bigram.num_embeddings))
        x = self.embed(tokens) + bigram * self.signs[bigram_sign_rows(tokens)]
        x = x0 = rms_norm(x)
        ves = [ve(tokens) for ve in self.value_embeds]
        skips = []
        for i, block in enumerate(self.blocks):
            j = i - (len(self.blocks) - self.num_skips)
            if j >= 0:
                x = x + self.skip_weights[j] * skips.pop()
            ve = ves[self.value_embed_layer[i]] if i in self.value_embed_layer else None
            x = block(x, x0, ve, self.rotary, args)
            if i < self.num_skips:
                skips.append(x)
        return rms_norm(x)

    def forward(self, tokens, targets, args: AttentionArgs, target_weights, columns=None):
        """Mean over tokens of the weighted cross-entropy. targets: (T, K) vocab ids, -1 = none.

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
        logits = F.linear(x, weight.type_as(x))
        return self.cross_entropy_fn(logits, all_targets, target_weights).mean()

    @torch.no_grad()
    def validation_loss_sum(self, tokens, targets, args: AttentionArgs, chunk_rows=4096):
        """Sum over tokens of the full-vocabulary next-token loss (never a sampled subset)."""
        x = self.hidden_states(tokens, args)
        weight = self.head_weight().type_as(x)
        total = x.new_zeros((), dtype=torch.float32)
        one = torch.ones(1, device=x.device)
        for s in range(0, x.size(0), chunk_rows):
            logits = F.linear(x[s:s + chunk_rows], weight)
            total += self.cross_entropy_fn(logits, targets[s:s + chunk_rows, :1], one).sum()
        return total


def ids_to_columns(ids, columns):
    """Map vocab ids to their index in the sorted `columns`; ids not among them become -1."""
    pos = torch.searchsorted(columns, ids.clamp(min=0)).clamp(max=columns.numel() - 1)
    return torch.where((ids >= 0) & (columns[pos] == ids), pos, -1)


CANDIDATE_STRIDE = 20011           # coprime to 50304: k -> k * stride mod V visits every id once
CANDIDATE_OFFSET_MULT = 7919       # spreads the walk's starting point across steps and slices


def candidate_columns(targets, count, step, slice_index):
    """Sampled-softmax candidates: every distinct target id plus deterministic uniform negatives.

    Negatives are the first ids, in the order k -> (k * CANDIDATE_STRIDE + offset) mod V, that are
    not targets, until there are `count` columns (more if the batch has more distinct targets).
    """
    V = PADDED_VOCAB_SIZE
    chosen = torch.zeros(V, dtype=torch.bool, device=targets.device)
    chosen[targets[targets >= 0]] = True
    offset = ((step * 8191 + slice_index) * CANDIDATE_OFFSET_MULT) % V
    walk = (torch.arange(V, device=targets.device) * CANDIDATE_STRIDE + offset) % V
    missing = count - chosen.sum()
    fresh = ~chosen[walk]
    chosen[walk[fresh & (fresh.cumsum(0) <= missing)]] = True
    return chosen.nonzero().squeeze(1)


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

    def to(self, device):
        if device.type == "cpu":
            return self
        return Slice(*(t.pin_memory().to(device, non_blocking=True)
                       for t in (self.tokens, self.targets, self.cu_seqlens)))


MIN_DOC_TOKENS = 16                # cu_seqlens has room for T / MIN_DOC_TOKENS documents per slice


def _load_shard(path):
    tokens = np.asarray(read_shard(path))
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

    def next_batch(self, T, max_doc_len, num_slices, mine):
        """The slices with indices in `mine` of the next global batch of num_slices slices."""
        out = []
        for i in range(num_slices):
            pieces, filled = [], 0
            while filled < T and len(pieces) < T // MIN_DOC_TOKENS:
                stream, start, length, end = self._next_piece(min(max_doc_len, T - filled))
                pieces.append((stream, start, length, end))
                filled += length
            if i in mine:
                out.append(_pack(pieces, T))
        return out


def validation_slices(files, val_tokens, T, num_slices, mine):
    """The first val_tokens tokens of the val stream, cut into num_slices slices of T tokens.

    Slices are plain windows of the stream (a document may start before a slice); documents
    inside a slice are separated by their BOS tokens.
    """
    stream = np.concatenate([np.asarray(read_shard(f)) for f in files])
    if stream.size < val_tokens + 1:
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
    tokens = sum(h.stages[stage_index(h, step)].tokens_per_rank for step in range(h.num_iterations))
    return math.ceil(tokens * h.batch_ranks * CUT_DOCUMENT_MARGIN / FINEWEB_SHARD_TOKENS)


def stage_index(h, step):
    frac = step / h.num_iterations
    return next((i for i, s in enumerate(h.stages) if frac < s.end), len(h.stages) - 1)


def lr_multiplier(h, step):
    """Stage multiplier times a linear cooldown from cooldown_start to cooldown_floor at the end."""
    frac = step / h.num_iterations
    cool = 1.0 if frac < h.cooldown_start else (
        1.0 - (frac - h.cooldown_start) / (1.0 - h.cooldown_start) * (1.0 - h.cooldown_floor))
    return h.stages[stage_index(h, step)].lr_mult * cool


def matrix_momentum(h, step):
    frac = min(step / max(h.momentum_warmup_steps, 1), 1.0)
    return (1 - frac) * h.momentum_warmup_start + frac * h.momentum


def anvil_mu(h, step):
    """Nesterov mu: rises from low to high, holds, and falls back to low at the very end."""
    frac = step / h.num_iterations
    rise = min(frac / h.anvil_mu_rise, 1.0)
    fall = min(max((1.0 - frac) / h.anvil_mu_fall, 0.0), 1.0)
    return h.anvil_mu_low + (h.anvil_mu_high - h.anvil_mu_low) * min(rise, fall)


def anvil_blend(h, step):
    return 1.0 if step / h.num_iterations < h.anvil_blend_start else h.anvil_blend


def target_weights(stage, device):
    w = list(stage.mtp_weights) + [0.0] * (MAX_TARGETS - 1 - len(stage.mtp_weights)) + [stage.prefix_weight]
    return torch.tensor(w, dtype=torch.float32, device=device)


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


def environment(world_size):
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
        "cpu_threads": torch.get_num_threads(), "world_size": world_size,
        "hostname": socket.gethostname(), "command": " ".join(sys.argv), "git_commit": git_commit(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


class RunLog:
    """logs/<run id>.txt, created exclusively (never overwritten); only rank 0 writes."""

    def __init__(self, log_dir, active):
        self.run_id = datetime.datetime.now().strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]
        self.path = os.path.join(log_dir, f"{self.run_id}.txt")
        self.file = None
        if active:
            os.makedirs(log_dir, exist_ok=True)
            self.file = open(self.path, "x", encoding="utf-8")
            self.write(f"speedrun-log {LOG_FORMAT_VERSION} run_id={self.run_id}")

    def write(self, line, echo=False):
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()
            if echo:
                print(line, flush=True)

    def header(self, sources, env, data, config):
        for relpath, content in sources:
            digest = hashlib.sha256(content).hexdigest()
            self.write(f"=== source {relpath} sha256={digest} bytes={len(content)} ===")
            if self.file is not None:
                self.file.flush()
                self.file.buffer.write(content)
                self.file.buffer.flush()
            self.write(f"\n=== end source {relpath} ===")
        self.write("=== environment ===")
        for key, value in env.items():
            self.write(f"{key}: {value}")
        self.write("=== data ===")
        for fp in data:
            self.write(json.dumps(fp))
        self.write("=== config ===")
        self.write(json.dumps(config))
        self.write("=== run ===")

    def close(self):
        if self.file is not None:
            self.file.close()


# -----------------------------------------------------------------------------------------------
# Training
# -----------------------------------------------------------------------------------------------

class TrainingError(Exception):
    """The run cannot go on (e.g. a non-finite loss); the log is kept."""


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
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = h.device == "cuda" or (h.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("--device=cuda but no CUDA GPU is visible; use --device=cpu or --preset cpu")
    if want_cuda and local_rank >= torch.cuda.device_count():
        raise ConfigError(f"{world_size} processes per node but only {torch.cuda.device_count()} GPUs: "
                          f"run with --nproc_per_node={torch.cuda.device_count()}")
    if h.batch_ranks % world_size:
        divisors = [d for d in range(1, h.batch_ranks + 1) if h.batch_ranks % d == 0]
        raise ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by the {world_size} processes: "
                          f"run with one of {divisors} processes")
    device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
    if want_cuda:
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group(backend="nccl" if want_cuda else "gloo", device_id=device if want_cuda else None)
    return Dist(rank, world_size, local_rank, device)


@dataclass
class KernelFns:
    """The kernel functions a model calls: the Triton ones or their plain-torch references."""
    attention: object
    cross_entropy: object
    fp8_mlp: object = None         # None: the MLP runs in the autocast dtype


def select_kernels(h, device):
    """Triton on CUDA unless the references are asked for; FP8 MLPs only on CUDA with fp8_mlp."""
    use_triton = h.kernels == "triton" or (h.kernels == "auto" and device.type == "cuda")
    fp8 = h.fp8_mlp and device.type == "cuda"
    if use_triton:
        return KernelFns(kernels.flash_attn_varlen, kernels.softcap_cross_entropy,
                         kernels.fp8_relu2_mlp if fp8 else None)
    # On CPU the chunked cross-entropy is the same algorithm as the kernel, ~3x faster than the
    # reference there; `kernels=reference` keeps the plain reference for A/B runs.
    cross_entropy = (kernels.softcap_cross_entropy_chunked if h.kernels == "auto" and device.type == "cpu"
                     else kernels.softcap_cross_entropy_reference)
    return KernelFns(kernels.attention_reference, cross_entropy, kernels.fp8_relu2_mlp_reference if fp8 else None)


def build_optimizers(h, model):
    """Adam for embeddings, head and scalars; the Muon family (or Adam) for the hidden matrices."""
    matrices = [p for name, p in model.blocks.named_parameters() if p.ndim == 2 and "ve_gate" not in name]
    scalars = [p for name, p in model.named_parameters()
               if p.ndim < 2 or "ve_gate" in name]
    embeds = [model.embed.weight, model.bigram.weight] + [ve.weight for ve in model.value_embeds]
    adam_groups = [
        dict(params=embeds, lr=h.embed_lr, name="embed"),
        dict(params=[model.lm_head], lr=h.head_lr, name="lm_head"),
        dict(params=scalars, lr=h.scalar_lr, name="scalars"),
    ]
    if h.optimizer == "adamw":
        adam_groups.append(dict(params=matrices, lr=h.adamw_matrix_lr, name="matrices"))
    adam = optim.Adam(adam_groups, lr=h.embed_lr, betas=h.adam_betas, eps=h.adam_eps, weight_decay=h.adam_wd)
    if h.optimizer == "adamw":
        return [adam]
    mlp_down = [block.mlp.down for block in model.blocks]
    others = [p for p in matrices if all(p is not q for q in mlp_down)]
    down_scale = h.mlp_down_lr_scale if h.optimizer == "anvil" else 1.0
    muon = optim.Muon([dict(params=others, name="matrices"),
                       dict(params=mlp_down, lr_scale=down_scale, name="mlp_down")],
                      lr=h.matrix_lr, momentum=h.momentum, weight_decay=h.matrix_wd,
                      schedule=h.orthogonalize, variant=h.optimizer,
                      fast_beta=h.anvil_fast_beta, slow_beta=h.anvil_slow_beta)
    return [adam, muon]


class Trainer:
    def __init__(self, h: Hyperparameters, env: Dist, log: RunLog):
        self.h, self.env, self.log = h, env, log
        torch.manual_seed(h.seed)
        self.model = GPT(h, select_kernels(h, env.device)).to(env.device)
        self.optimizers = build_optimizers(h, self.model)
        self.forward = torch.compile(self.model) if (h.compile and env.device.type == "cuda") else self.model
        self.autocast = torch.autocast(env.device.type, dtype=torch.bfloat16)
        self.accum = h.batch_ranks // env.world_size
        self.mine = list(range(env.rank, h.batch_ranks, env.world_size))
        self.attn_scale = h.attn_scale
        self.long_window = h.stages[0].long_window
        self.train_time_ms = 0.0

    # -- schedules applied to the model and the optimizers
    def set_window(self, long_window_blocks):
        """Grow the long window, with the YaRN frequency and attention-scale adjustment."""
        if long_window_blocks > self.long_window:
            self.model.rotary.grow_window(self.long_window * WINDOW_BLOCK, long_window_blocks * WINDOW_BLOCK)
            self.attn_scale *= 1 + YARN_ATTN_SCALE * math.log(long_window_blocks / self.long_window)
            self.long_window = long_window_blocks

    def set_optimizer_schedules(self, step):
        lr = lr_multiplier(self.h, step)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr
        for opt in self.optimizers:
            if isinstance(opt, optim.Muon):
                for group in opt.param_groups:
                    group["momentum"] = matrix_momentum(self.h, step)
                    group["mu"] = anvil_mu(self.h, step)
                    group["blend"] = anvil_blend(self.h, step)

    # -- one step
    def train_step(self, step, slices):
        stage = self.h.stages[stage_index(self.h, step)]
        weights = target_weights(stage, self.env.device)
        total = torch.zeros((), device=self.env.device)
        for slice_index, s in zip(self.mine, slices):
            s = s.to(self.env.device)
            columns = None
            if stage.candidates:
                columns = candidate_columns(s.targets, stage.candidates, step, slice_index)
            args = AttentionArgs(s.cu_seqlens, stage.max_doc_len, stage.short_window * WINDOW_BLOCK,
                                 stage.long_window * WINDOW_BLOCK, self.attn_scale)
            with self.autocast:
                loss = self.forward(s.tokens, s.targets, args, weights, columns) / self.accum
            loss.backward()
            total += loss.detach()
        self.set_optimizer_schedules(step)
        for opt in self.optimizers:
            opt.step()
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return total

    @torch.no_grad()
    def validate(self, slices, long_window_blocks):
        stage = self.h.stages[-1]
        self.model.eval()
        total = torch.zeros((), device=self.env.device)
        for s in slices:
            s = s.to(self.env.device)
            args = AttentionArgs(s.cu_seqlens, self.h.val_tokens_per_rank, stage.short_window * WINDOW_BLOCK,
                                 long_window_blocks * WINDOW_BLOCK, self.attn_scale)
            with self.autocast:
                total += self.model.validation_loss_sum(s.tokens, s.targets, args)
        if self.env.world_size > 1:
            dist.all_reduce(total)
        self.model.train()
        return total.item() / self.h.val_tokens


def check_finite(name, loss, step, log):
    """Stop the run, keeping its log, when `name` (train or val loss) is NaN or infinite."""
    if not math.isfinite(loss):
        raise TrainingError(f"the {name} loss became {loss} at step {step} (train loss checked every "
                            f"log_every steps); the log is kept at {log.path}. Lower the learning rates "
                            f"or check the data.")


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(trainer, train_files):
    """Untimed steps at every stage's shape, tied and untied (compiles, autotunes), then restore
    the initial model and optimizer state so the timed run starts from scratch."""
    h, model = trainer.h, trainer.model
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opts = [opt.state_dict() for opt in trainer.optimizers]
    loader = TrainLoader(train_files, batch_tokens(h))
    for i, stage in enumerate(h.stages):
        first_step = int(math.ceil((h.stages[i - 1].end if i else 0.0) * h.num_iterations))
        if i == len(h.stages) - 1:
            model.untie()
        for _ in range(h.warmup_steps):
            slices = loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
            trainer.train_step(first_step, slices)
    model.tied = True
    model.load_state_dict(saved_model)
    for opt, state in zip(trainer.optimizers, saved_opts):
        opt.load_state_dict(state)
    synchronize(trainer.env.device)


def train(h, env, log):
    train_files = find_shards(h.train_files, hint=FINEWEB_HINT if "fineweb" in h.train_files else TINY_HINT)
    val_files = find_shards(h.val_files, hint=FINEWEB_HINT if "fineweb" in h.val_files else TINY_HINT)
    trainer = Trainer(h, env, log)
    num_val_slices = h.val_tokens // h.val_tokens_per_rank
    if h.val_tokens % (h.val_tokens_per_rank * env.world_size):
        raise ConfigError(f"val_tokens={h.val_tokens} must be a multiple of val_tokens_per_rank x processes "
                          f"= {h.val_tokens_per_rank * env.world_size}")
    val_slices = validation_slices(val_files, h.val_tokens, h.val_tokens_per_rank, num_val_slices,
                                   range(env.rank, num_val_slices, env.world_size))
    log.header(project_sources(), environment(env.world_size),
               [fingerprint(f) for f in val_files + train_files], logged_config(h))
    log.write(f"model parameters: {sum(p.numel() for p in trainer.model.parameters()):,}", echo=True)
    if env.device.type == "cuda" and h.warmup_steps > 0:
        warm_up(trainer, train_files)
    loader = TrainLoader(train_files, batch_tokens(h))
    N, stage_now = h.num_iterations, -1
    synchronize(env.device)
    t0 = time.perf_counter()
    for step in range(N + 1):
        last = step == N
        if last or (h.val_every and step % h.val_every == 0 and step > 0):
            synchronize(env.device)
            trainer.train_time_ms += 1000 * (time.perf_counter() - t0)
            if last:
                trainer.set_window(h.val_long_window)
            val_loss = trainer.validate(val_slices, trainer.long_window)
            log.write(f"step:{step}/{N} val_loss:{val_loss:.4f} train_time:{trainer.train_time_ms:.0f}ms "
                      f"step_avg:{trainer.train_time_ms / max(step, 1):.2f}ms", echo=True)
            check_finite("val", val_loss, step, log)
            synchronize(env.device)
            t0 = time.perf_counter()
        if last:
            break
        s_index = stage_index(h, step)
        stage = h.stages[s_index]
        if s_index != stage_now:
            trainer.set_window(stage.long_window)
            stage_now = s_index
        if step == int(h.untie_frac * N):
            trainer.model.untie()
        slices = loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
        loss = trainer.train_step(step, slices)
        if step % h.log_every == 0 or step == N - 1:
            if env.world_size > 1:
                dist.all_reduce(loss)
            loss = loss.item() / env.world_size
            check_finite("train", loss, step, log)
            elapsed = trainer.train_time_ms + 1000 * (time.perf_counter() - t0)
            log.write(f"step:{step + 1}/{N} train_loss:{loss:.4f} train_time:{elapsed:.0f}ms "
                      f"step_avg:{elapsed / (step + 1):.2f}ms", echo=True)
    peak = (torch.cuda.max_memory_allocated(env.device) if env.device.type == "cuda"
            else _peak_rss_bytes()) // 2**20
    if h.save_checkpoint and env.master:
        path = os.path.join(h.log_dir, f"{log.run_id}_model.pt")
        torch.save({"config": config_to_dict(h), "model": trainer.model.state_dict()}, path)
        log.write(f"checkpoint: {path}", echo=True)
    log.write(f"final val_loss:{val_loss:.4f} train_time:{trainer.train_time_ms:.0f}ms steps:{N} "
              f"peak_memory:{peak}MiB", echo=True)
    return val_loss


M_TRIM_THRESHOLD = -1              # glibc mallopt parameter: free heap kept before returning it to the OS
M_MMAP_MAX = -4                    # glibc mallopt parameter: how many allocations may use their own mmap


def keep_freed_memory_for_reuse():
    """On CPU, serve large tensors from the heap and keep freed memory mapped.

    By default glibc gives every large allocation its own mmap and unmaps it on free, so each
    step faults in gigabytes of fresh pages again (the logits, the table gradients). Measured
    on the CPU preset, 2 cores: 4.4 s/step with sys time ~ user time, 2.1 s/step with this.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:                # not glibc: nothing to tune
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def _peak_rss_bytes():
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv=None):
    log = None
    try:
        h = parse_config(sys.argv[1:] if argv is None else argv)
        env = setup_distributed(h)
        if env.device.type == "cpu":
            keep_freed_memory_for_reuse()
            local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(max(1, os.cpu_count() // local_procs))
        log = RunLog(h.log_dir, env.master)
        if env.master:
            print(f"logging to {log.path}", flush=True)
        train(h, env, log)
        return 0
    except (ConfigError, DataError, ShardError, TrainingError) as e:
        if log is not None:
            log.write(f"error: {e}")
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if log is not None:
            log.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
