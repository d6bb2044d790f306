"""The run's config: one schema, read once.

`Hyperparameters` is every key of a run (the model's keys are `ModelConfig`'s, which is all GPT
reads); each field's type is its annotation and its range or choices stand beside it (`count`,
`real`, `choice`, `layers`, ...). `parse_config` reads --preset NAME or --config PATH (a logged
config) and then --key=value overrides; `normalize_config` turns JSON values into the schema's
types and checks every value once, each field by its own rule and then the rules that tie keys
together, so that a bad value ends the run before any work with one line naming the key, the
value and what is allowed. The presets themselves are in train_gpt.py.
"""
import argparse
import ast
import dataclasses
import difflib
import io
import json
import math
import os
import stat
import tokenize
from dataclasses import dataclass, field

import kernels
import optim
from machinery.errors import UserError

VOCAB_SIZE = 50257                 # GPT-2 tokens
PADDED_VOCAB_SIZE = 50304          # vocab rounded up to a multiple of 128 for the matmuls
WINDOW_BLOCK = 128                 # sliding windows are counted in blocks of this many tokens
MAX_TARGETS = 4                    # next token, two more multi-token targets, the prefix target
MIN_DOC_TOKENS = 16                # a slice's cu_seqlens has room for T / MIN_DOC_TOKENS documents
SMEAR_GATE_DIMS = 12               # the smear gate reads the first this-many dims of a token's embedding
FINAL_MIX_GROUPS = 12              # record 92: channel groups of its final mix, each with its own coefficient delta
MAX_HEAD_GRAD_STRIDE = 64          # rows one sampled head-gradient row may stand for
POINTER_COPY_ID = 50257            # PR 379: the <copy> slot, the first padding row of the head; its mass gates the pointer

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
MAX_SEED = 2**63 - 1               # torch's seeds are signed 64-bit
MLP_SCALE_RULES = tuple(kernels.MLP_SCALES)  # the FP8 MLP's scale rules (a field named kernels hides the module)
QKV_SCALE_RULES = tuple(kernels.QKV_SCALE_RULES)  # the FP8 QKV projection's
HEAD_SCALE_RULES = tuple(kernels.HEAD_SCALE_RULES)  # the FP8 head's
ORTHOGONALIZATIONS = tuple(optim.SCHEDULES)  # the Muon family's orthogonalization schedules


class ConfigError(UserError):
    """A bad preset, key or value: the message says which and what is allowed."""


# -----------------------------------------------------------------------------------------------
# The rules a field can carry (dataclass field metadata), written beside the field
# -----------------------------------------------------------------------------------------------

def count(default, low, high, unit, multiple=1):
    """A whole number in [low, high] (a multiple of `multiple`); `unit` names what it counts
    ("steps"), or is the whole description when it starts with "a " ("a layer index")."""
    what = unit if unit.startswith("a ") else f"a whole number of {unit}"
    allowed = f"{what} in [{low:,}, {high:,}]" + (f", a multiple of {multiple}" if multiple > 1 else "")
    return field(default=default, metadata={"low": low, "high": high, "integer": True, "multiple": multiple,
                                            "allowed": allowed})


def real(default, what, low=0.0, high=None, above=None, below=None):
    """A finite number >= low (> above when given), at most high (None: no bound; < below when given)."""
    opening = f"({above:g}" if above is not None else f"[{low:g}"
    if below is not None:
        allowed = f"{what} in {opening}, {below:g})"
    elif high is not None:
        allowed = f"{what} in {opening}, {high:g}]"
    else:
        allowed = f"{what} > {above:g}" if above is not None else f"{what} >= {low:g}"
    return field(default=default, metadata={"low": low, "high": high, "above": above, "below": below,
                                            "allowed": allowed})


def rate(default):
    return real(default, "a learning rate")


def decay(default):
    return real(default, "a weight decay")


def fraction(default, above=None):
    """A fraction of training, in [0, 1] (or (above, 1])."""
    return real(default, "a fraction of training", high=1.0, above=above)


def beta(default):
    """A moving average's decay in [0, 1): at 1 the average never moves from where it starts."""
    return real(default, "a beta", below=1.0)


def choice(default, *others):
    """The default or one of `others`."""
    return field(default=default, metadata={"choices": (default, *[c for c in others if c != default])})


def layers(default=(), nullable=False):
    """A list of distinct layer indices in [0, num_layers) (or, nullable, null: the default)."""
    return field(default=None if nullable else default, metadata={"layers": True, "nullable": nullable})


def ascending(what, low=1, high=None):
    """A list of ascending, distinct whole numbers in [low, high] (high None: steps of the run,
    below num_iterations); `what` names them; the default [] is none."""
    return field(default=(), metadata={"ascending": True, "what": what, "low": low, "high": high})


def betas(default):
    """Adam's (beta1, beta2), each in [0, 1)."""
    return field(default=default, metadata={"betas": True})


def path(default):
    """A non-empty path (or glob)."""
    return field(default=default, metadata={"path": True})


# -----------------------------------------------------------------------------------------------
# The schema
# -----------------------------------------------------------------------------------------------

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
    # n > 0: ... in n equal parts of the stage, one weight each, from prefix_weight to prefix_weight_end
    prefix_weight_levels: int = 0


@dataclass
class TablePhase:
    """From step `start` on (until a later phase starts), the sparse tables' Adam: the n-gram
    table's beta2, the value embeddings' beta2 (and beta1 when they train on the tables' cadence),
    one update every `step_every` steps, and a multiplier of both tables' weight decay. Before the
    first phase they are ngram_beta2, value_embed_betas, ngram_step_every and 1."""
    start: int                     # the step this phase starts at
    ngram_beta2: float             # the n-gram table's beta2 from here
    value_embed_beta2: float       # the value embeddings' beta2 from here
    step_every: int                # the tables update every this-many steps from here
    value_embed_beta1: float = None  # if given: the dense value embeddings' beta1 from here (table cadence)
    decay_mult: float = 1.0        # the tables' weight decays (ngram_wd, value_embed_wd) times this from here


@dataclass
class Average:
    """One end-of-training weight average: an EMA of some parameters over the last steps,
    blended into them after the last step, before the final validation (and on the clock)."""
    params: str                    # which parameters: one of AVERAGED_PARAMS
    window: int                    # sampled over the last this-many steps
    every: int = 1                 # one sample every this-many steps, counted back from the last step
    rate: float = 0.1              # EMA weight of each sample after the first (which seeds the average)
    blend: float = 1.0             # at the end p <- lerp(p, average, blend); 1 replaces p
    renormalize: bool = False      # then rescale its matrices to their Frobenius norms before any average
    offset: int = 0                # samples counted back from this many steps before the last
    last_steps: int = 0            # and every one of the last this-many steps sampled too


# Parameter families an Average can take: the token embedding and the head; the value-embedding
# tables; the query and key rows of each QKV weight; its value rows with the attention output
# and both MLP matrices.
AVERAGED_PARAMS = ("embed_head", "value_embeds", "qk", "vo_mlp")


@dataclass
class ModelConfig:
    """The model's shape and features: everything GPT reads, and nothing else."""
    num_layers: int = count(12, 1, MAX_LAYERS, "layers")  # transformer blocks
    model_dim: int = count(768, 1, MAX_WIDTH, "dims")  # width of the residual stream
    num_heads: int = count(6, 1, MAX_HEADS, "heads")  # attention heads of a layer
    # dims of a head (RoPE rotates pairs in half of them)
    head_dim: int = count(128, 4, MAX_HEAD_DIM, "dims", multiple=4)
    mlp_hidden: int = count(3072, 1, MAX_HIDDEN, "dims")  # hidden width of an MLP
    long_window_layers: tuple = layers(())  # layers that use the long window; others the short one
    attention_free_layers: tuple = layers(())  # layers with no attention sublayer
    mlp_free_layers: tuple = layers(())  # layers with no MLP sublayer
    # value-embedding tables, each shared by one of the first and one of the last layers
    num_value_embeds: int = count(0, 0, MAX_LAYERS // 2, "tables")
    # or: these layers, each with a table of its own (then num_value_embeds = 0)
    value_embed_layers: tuple = layers(())
    value_embed_gate_dim: int = count(12, 1, MAX_WIDTH, "dims")  # inputs of the per-head value-embedding gates
    value_embed_gate_reads_value: bool = False  # gates read half their inputs from the value embedding
    value_embed_sparse: bool = False   # value embeddings trained like the n-gram table: sparse Adam, its cadence
    # every table num_heads x head_dim wide, a narrow-value layer adding each head's first
    # narrow_vo_dim dims (else a table is as wide as its layer's values)
    value_embed_full_width: bool = False
    bigram_rows: int = count(2, 2, MAX_TABLE_ROWS, "rows")  # rows of the bigram hash embedding (zero at init)
    # rows of the hashed bigram+trigram table trained sparsely (0: the bigram embedding); even, >= 4
    ngram_rows: int = count(0, 0, MAX_TABLE_ROWS, "rows", multiple=2)
    # the table's storage: float32 | bfloat16 (half the bytes; updates rounded to nearest)
    ngram_dtype: str = choice("float32", "bfloat16")
    embed_init_std: float = real(0.0, "a standard deviation")  # std of the (tied) embedding's normal init; 0: model_dim^-0.5
    rope_base: float = real(1024.0, "a period", above=0.0)  # RoPE base period
    # softmax scale of QK-normed attention before any YaRN growth
    attn_scale: float = real(0.1, "a scale", above=0.0)
    # YaRN: the attention scale grows by this times ln(window growth)
    yarn_scale_growth: float = real(0.0, "a growth rate")
    canonical_mask: bool = False       # validation: no probability for token pairs GPT-2's encoder never emits
    smear_gate: bool = False           # each token's embedding gets a gated share of its predecessor's
    key_offset: bool = False           # long-window layers: a key's stationary dims come from the previous token
    # the smear, the key offset and the hashed tables read across documents: only a slice's first
    # token has no predecessor (else every document's first)
    cross_documents: bool = False
    # the hashed tables' hashes: project (int64 products; multiplied ids for the sign rows) | record
    # (int32 products that wrap; the bigram table's sign rows the xor of the ids, the n-gram
    # table's other multipliers, row 0 at a start; the token after a start hashed with the
    # reserved row's id as its previous token)
    table_hashes: str = choice("project", "record")
    # the n-gram table hashes each token by its normalized id (case, whitespace and punctuation
    # stripped: data/gpt2_normalized_tokens.bin), so " The", "the" and "THE" share rows
    ngram_normalized: bool = False
    xsa_layers: tuple = layers(())     # layers whose heads remove a learned share of their output along their own value
    paired_head_layers: tuple = layers(())  # layers where adjacent heads' queries also attend to each other's keys
    # their layout: adjacent (heads 2h and 2h+1 at positions 2t and 2t+1 of the doubled sequence,
    # each rotated at its position) | record (head h of token t at position 2t + h // (heads/2),
    # rotated at 2t + h % 2: heads h and h + heads/2 pair)
    paired_head_layout: str = choice("adjacent", "record")
    # a sliding window of w tokens also shows the key w tokens back: w + 1 keys (FA3's window_size=(w, 0))
    window_edge_key: bool = False
    # the attention output projection's init: zero | uniform (the QKV projection's bound)
    attn_out_init: str = choice("zero", "uniform")
    # layers whose queries and keys are narrow_qk_dim wide per head, rotated in full
    narrow_qk_layers: tuple = layers(())
    narrow_qk_dim: int = count(64, 4, MAX_HEAD_DIM, "dims", multiple=4)  # their query and key dims per head
    # their softmax scale before any YaRN growth (attn_scale: the others')
    narrow_qk_attn_scale: float = real(0.13, "a scale", above=0.0)
    # the window whose growth their RoPE tables and scale follow under YaRN: long | short
    narrow_yarn_window: str = choice("long", "short")
    narrow_vo_layers: tuple = layers(())  # layers whose values (and head outputs) are narrow_vo_dim wide per head
    narrow_vo_dim: int = count(64, 1, MAX_HEAD_DIM, "dims")  # their value dims per head
    parallel_mlp_layers: tuple = layers(())  # layers with a second MLP beside the first, on the same input
    token_gates: bool = False          # per-token gates from two small MLPs (TokenGates): XSA, output, injections
    # layers before this take gates made from x0, later ones from the residual there
    token_gates_split: int = count(4, 0, MAX_LAYERS, "a layer index")
    # layers whose heads' outputs are scaled by a per-token gate (needs token_gates)
    attn_gate_layers: tuple = layers(())
    composed_layers: tuple = layers(())      # layers that add composed local attention (needs token_gates; not paired layers)
    # its window, in tokens (at most kernels.COMPOSED_MAX_WINDOW)
    composed_window: int = count(112, 1, kernels.COMPOSED_MAX_WINDOW, "tokens")
    trunk: str = choice("unet", "dense")  # unet: U-net skips, x0 mixed into every block | dense: see DenseConnections
    skip_layers: tuple = (3, 6)        # dense: layer [1] (attention-free) adds a gated copy of layer [0]'s output
    # dense: the layers after it read its output as their attention input
    snapshot_layer: int = count(7, 0, MAX_LAYERS, "a layer index")
    # dense: the layers whose residual takes x0 through a token gate, after their attention (on an
    # attention-free layer, after its residual scale); null: every attention layer but the last
    x0_layers: tuple = layers(nullable=True)
    # dense: the same for the hashed embedding; layer 0's enters the trunk's input, before layer 0
    hashed_layers: tuple = layers(nullable=True)
    # dense: the mix after the last layer: record89 (5 earlier states, a coefficient each per token)
    # | record92 (every value-embedding table and the last layer's MLP and attention inputs too, 10
    # sources with record 92's tables, each coefficient plus a delta per channel group)
    final_mix: str = choice("record89", "record92")
    # the weights' storage: float32 | bfloat16 (then the activations are bf16 too; the optimizers
    # keep each weight's fp32 precision in a 16-bit mantissa sidecar)
    param_dtype: str = choice("float32", "bfloat16")
    # the next-token distribution mixes the LM's softmax with a pointer over the document's earlier
    # tokens (PR 379's copy-sink pointer LM): p(y) = p_lm(y) (1 - a (1 - a_sink)) + a p_copy(y), the
    # gate a the softmax mass of the <copy> slot (id 50257), the pointer one QK-normed head with a sink
    pointer_mixture: bool = False
    pointer_dim: int = count(128, 16, MAX_HEAD_DIM, "dims", multiple=16)  # the pointer head's query and key dims
    # training: the queries of each block of this many tokens point into it and the block before
    pointer_band: int = count(2048, 1, MAX_SLICE_TOKENS, "tokens")
    pointer_val_band: int = count(8192, 1, MAX_SLICE_TOKENS, "tokens")  # the same at validation
    # PR 378's document copy feature: each position's candidate next token, the one after the latest
    # earlier match in its document of its longest matching context (1 to 32 normalized ids), is
    # embedded, scaled and added with a bucket embedding at the input and before the final norm
    document_copy: bool = False


@dataclass
class Hyperparameters(ModelConfig):
    """A run's config: the model's fields (ModelConfig) plus data, schedule, optimizers and system.
    One flat set of keys, so that every key is one --key=value and one entry of a logged config."""
    preset: str = "none"              # the preset the run started from ("none": these defaults)
    # records track a run of this preset belongs to, or "none"
    track: str = choice("track_1_short", "track_2_medium", "track_cpu", "track_3_optimization",
                        "track_3_cpu_optimization", "track_1gpu", "none")
    # -- data --
    train_files: str = path("data/fineweb10B/fineweb_train_*.bin")  # the train shards
    val_files: str = path("data/fineweb10B/fineweb_val_*.bin")  # the val shards
    # first tokens of the val shard(s) every run is judged on
    val_tokens: int = count(10_485_760, 1, MAX_VAL_TOKENS, "tokens")
    val_tokens_per_rank: int = count(65_536, 1, MAX_SLICE_TOKENS, "tokens")  # val tokens per rank per forward pass
    val_every: int = count(0, 0, MAX_STEPS, "steps")  # validate every this many steps (0: only at the end)
    # the global batch is this many rank slices; fewer processes accumulate
    batch_ranks: int = count(8, 1, MAX_BATCH_RANKS, "rank slices")
    # training targets: document (they stop at each document's end; a cut document's last token
    # predicts its true successor) | packed (the next tokens of the packed slice, across documents;
    # a cut document's last token predicts the next document's BOS)
    target_rule: str = choice("document", "packed")
    # documents longer than this are cut into attention segments this long (0: never); the
    # tokens, targets, smear and hashes still see whole documents
    attention_segment_tokens: int = count(0, 0, MAX_SLICE_TOKENS, "tokens")
    # -- model schedule (the model's own fields are ModelConfig's) --
    # long window (blocks) of the final validation
    val_long_window: int = count(8, 1, MAX_WINDOW_BLOCKS, "window blocks")
    yarn_at_final_window: bool = True  # YaRN also for the final validation's wider window (else RoPE stays)
    untie_frac: float = fraction(1.0)  # fraction of training after which lm_head is untied from the embedding
    # -- approximate backward (PR 371; off by default: stride 1, no windows) --
    # the head's weight gradient from one row of each group of this many (the same rows on every
    # rank, a seeded draw per step), scaled by it: unbiased; the input gradient stays exact. 1: exact
    head_grad_stride: int = count(1, 1, MAX_HEAD_GRAD_STRIDE, "rows a sampled row stands for")
    head_grad_start: int = count(0, 0, MAX_STEPS, "a step index")  # the first step with the sampled head gradient
    # the truncated attention backward's candidate windows (tokens, ascending); (): off
    attn_bwd_windows: tuple = ascending("window sizes in tokens", 1, MAX_WINDOW_BLOCKS * WINDOW_BLOCK)
    # a window is chosen for a head when the relative L2 error of its dQ, dK and dV is at most this
    attn_bwd_error_bound: float = real(0.2, "a relative L2 error", above=0.0)
    attn_bwd_choice_steps: tuple = ascending("steps", 0)  # the steps that measure each window's error (eager, probed)
    attn_bwd_start: int = count(0, 0, MAX_STEPS, "a step index")  # the first step with the chosen windows
    # both approximations stop this many steps before the end: the last steps' backward is exact
    approx_exact_last_steps: int = count(0, 0, MAX_STEPS, "steps")
    # -- schedule --
    num_iterations: int = count(1000, 1, MAX_STEPS, "steps")  # training steps
    # the stages of training (Stage), in order (the default: one stage of 1024-token documents)
    stages: list = field(default_factory=lambda: [
        Stage(end=1.0, tokens_per_rank=16_384, max_doc_len=1024, short_window=8, long_window=8)])
    # sampled softmax: where a step's negatives start in the candidate walk: restart (at its slice's
    # start every step) | continue (after the previous sampled step's draw, per slice: record 92)
    candidate_walk: str = choice("restart", "continue")
    cooldown_start: float = fraction(0.5)  # fraction of training where the linear LR cooldown starts
    cooldown_floor: float = real(0.0, "an LR multiplier", high=1.0)  # LR multiplier at the end of the cooldown
    # fraction of training where the cooldown reaches the floor
    cooldown_end: float = fraction(1.0, above=0.0)
    averages: list = field(default_factory=list)  # end-of-training weight averages (Average), applied in order
    # the Frobenius norms renormalize restores: each matrix's | each bank's (all layers' matrices of a
    # kind together: queries and keys, values and outputs, MLPs; the embedding; the head)
    average_norms: str = choice("matrix", "bank")
    # -- optimizers --
    # matrix optimizer: muon | normuon | anvil | adamw (Adam for everything)
    optimizer: str = choice("adamw", "muon", "normuon", "anvil")
    orthogonalize: str = choice("auto", *ORTHOGONALIZATIONS)  # polar_express (record 89) | anvil (record 92) | auto: anvil for anvil
    matrix_lr: float = rate(0.05)      # the matrix optimizer's LR for the hidden matrices
    adamw_matrix_lr: float = rate(0.008)  # Adam's LR for the hidden matrices when optimizer=adamw
    matrix_wd: float = decay(0.0)      # the hidden matrices' weight decay
    mlp_down_lr_scale: float = real(2.0, "an LR multiplier")  # extra LR multiplier of the MLP output matrices
    # the matrix shapes that set the Muon family's LR factor max(1, rows/cols)^0.5 and its equalizer's
    # lanes: own (each matrix or block as this model stores it) | record_banks (as the records' banks
    # store them: MLP output matrices hidden x dim, narrow-value layers' values and outputs dim x dim)
    matrix_shapes: str = choice("own", "record_banks")
    # 0: QKV orthogonalized as one matrix; n: queries and keys in blocks of n heads
    qk_ortho_heads: int = count(0, 0, MAX_HEADS, "heads")
    momentum: float = real(0.95, "a momentum", high=1.0)  # muon/normuon momentum after warm-up
    # muon/normuon: momentum at the start of its warm-up (anvil's Nesterov mu schedule replaces it)
    momentum_warmup_start: float = real(0.85, "a momentum", high=1.0)
    # muon/normuon: steps from the start momentum to `momentum`
    momentum_warmup_steps: int = count(300, 0, MAX_STEPS, "steps")
    # muon/normuon: last steps over which momentum falls back to the start
    momentum_cooldown_steps: int = count(0, 0, MAX_STEPS, "steps")
    anvil_fast_beta: float = beta(0.85)  # beta of the fast momentum rail
    anvil_slow_beta: float = beta(0.98)  # beta of the slow momentum rail
    # weight of the fast rail once blending starts (1.0 before)
    anvil_blend: float = real(0.4385, "a weight", high=1.0)
    anvil_blend_start: float = fraction(0.43)  # fraction of training where blending starts
    anvil_fast_beta_follows_mu: bool = False  # before blending starts, the fast rail's beta is the scheduled mu
    anvil_mu_low: float = real(0.85, "a Nesterov weight", high=1.0)  # Nesterov mu at the start and the end
    anvil_mu_high: float = real(0.93, "a Nesterov weight", high=1.0)  # Nesterov mu in the middle
    # fraction of training over which mu rises
    anvil_mu_rise: float = fraction(0.2, above=0.0)
    # final fraction over which mu falls back
    anvil_mu_fall: float = fraction(0.042, above=0.0)
    # Adam groups; weight decay is cautious and of strength lr^2 * wd per update (optim.Adam)
    embed_lr: float = rate(0.01)       # token embedding (and the head while tied)
    head_lr: float = rate(0.008)       # the head once untied
    value_embed_lr: float = rate(0.01)  # value embeddings and the bigram table
    scalar_lr: float = rate(0.04)      # scalars: residual mixes, skip weights, XSA and smear strengths
    gate_lr: float = rate(0.04)        # value-embedding gate matrices
    smear_gate_lr: float = rate(0.04)  # the smear gate's weights
    token_gate_lr: float = rate(0.0008)  # the token-gate MLPs
    dense_lr: float = rate(0.002)      # the dense-connection MLPs
    pointer_lr: float = rate(0.008)    # the pointer head's query and key projections (pointer_mixture)
    document_copy_lr: float = rate(0.008)  # the copy feature's bucket scales and embeddings and its two gains
    embed_betas: tuple = betas((0.8, 0.95))  # embedding and head
    value_embed_betas: tuple = betas((0.8, 0.95))  # (sparse value embeddings: beta1 = 0, beta2 their rows' moments')
    scalar_betas: tuple = betas((0.8, 0.95))  # scalars and gates
    resid_scale_lr: float = rate(0.04)  # the dense trunk's per-layer scales of the residual
    post_scale_lr: float = rate(0.04)  # the dense trunk's per-layer scales of the sublayers' outputs
    scale_betas: tuple = betas((0.9, 0.99))  # both of those scales
    embed_wd: float = decay(0.0)       # embedding and head
    value_embed_wd: float = decay(0.0)  # (scalars are never decayed)
    gate_wd: float = decay(0.0)        # the value-embedding gates
    # the weight matrices of the token-gate and dense-connection MLPs (not their biases and scales)
    gate_mlp_wd: float = decay(0.0)
    adam_eps: float = real(1e-10, "an epsilon")  # Adam's epsilon, at the gradient scale adam_eps_unit
    # the gradient scale adam_eps is stated at (also the tables'): mean (this objective's gradient, the
    # mean over the global batch's tokens and an update's steps) | token_sum (the gradient of the loss
    # summed over a rank's tokens and an update's steps, averaged over the ranks: records 89 and 92)
    adam_eps_unit: str = choice("mean", "token_sum")
    # Adam updates every this-many steps, from the gradients' mean over them
    adam_step_every: int = count(1, 1, MAX_STEPS, "steps")
    ngram_lr: float = rate(0.01)       # the n-gram table's sparse Adam (beta1 = 0, one second moment per row)
    ngram_beta2: float = beta(0.95)    # the n-gram table's beta2
    ngram_wd: float = decay(0.0)       # the n-gram table's weight decay
    # the n-gram table (and sparse value embeddings) update every this-many steps
    ngram_step_every: int = count(1, 1, MAX_STEPS, "steps")
    table_phases: list = field(default_factory=list)  # later phases of the sparse tables' Adam (TablePhase)
    # dense value embeddings (value_embed_sparse false) update on the tables' cadence and phases, not
    # on Adam's adam_step_every with the other groups
    value_embed_table_cadence: bool = False
    # > 0: the table lives in host memory and this many of its rows on the device
    ngram_cache_rows: int = count(0, 0, MAX_TABLE_ROWS, "rows")
    # -- system --
    seed: int = count(0, 0, MAX_SEED, "a whole number")  # seeds the initial weights
    device: str = choice("auto", "cuda", "cpu")  # where the run trains; auto: CUDA when there is a GPU
    # the kernels: auto (Triton on CUDA; references on CPU, CE chunked) | triton | reference
    kernels: str = choice("auto", "triton", "reference")
    # torch.compile the training step, the validation and (with cuda_graphs) the optimizers' updates
    compile: bool = True
    # torch.compile backend; aot_eager traces the same graphs without codegen
    compile_backend: str = choice("inductor", "aot_eager", "eager")
    # activations and matrix products: bfloat16 (autocast) | float32 (no autocast)
    compute_dtype: str = choice("bfloat16", "float32")
    # FP8 layers run with the Triton kernels or on CUDA (or emulated: fp8_on_cpu); evaluation is bf16
    fp8_mlp: bool = False              # MLPs as the fused FP8 ReLU^2 kernel pair
    # the MLP's scale rules: record92 | record89 | delayed (kernels.MLP_SCALES)
    fp8_mlp_scales: str = choice(*MLP_SCALE_RULES)
    fp8_qkv: bool = False              # the packed QKV projection as an FP8 linear
    # its scale rules: project (a static 1/16 input, delayed gradients) | record92 (kernels.QKV_SCALE_RULES)
    fp8_qkv_scales: str = choice(*QKV_SCALE_RULES)
    fp8_head: bool = False             # the head at the candidate width as an FP8 linear
    # its static scale rules: record89 | record92 (kernels.HEAD_SCALE_RULES)
    fp8_head_scales: str = choice(*HEAD_SCALE_RULES)
    # the FP8 layers' GEMMs: fastest (at each shape the implementation the warm-up timed fastest) |
    # triton (the persistent descriptor kernel where the layout allows, else the pointer kernel) |
    # tma | pointer | scaled_mm (the plain GEMMs on torch._scaled_mm, cuBLAS); the casts stay Triton
    fp8_gemm: str = choice("fastest", "triton", "tma", "pointer", "scaled_mm")
    # attention: fastest (the forward's tiles or flex_attention, and the backward, each the fastest
    # the warm-up timed) | atomic (one backward kernel, dQ added atomically: not reproducible bit
    # for bit) | deterministic (dK/dV and dQ kernels, no atomics) | flex (flex_attention's forward) |
    # tma (the forward and the one-kernel backward loading by tensor descriptor, the forward warp-specialized)
    attention_impl: str = choice("fastest", "atomic", "deterministic", "flex", "tma")
    fp8_on_cpu: bool = False           # on a CPU, run the FP8 layers through their torch references (checks numerics)
    # untimed steps per graph before timing starts (when something compiles)
    warmup_steps: int = count(3, 0, MAX_STEPS, "steps")
    # auto: warm up when something compiles; always: also to map each shape's memory
    warm_up: str = choice("auto", "always")
    cuda_graphs: bool = True           # capture forward+backward and the optimizers' updates in the warm-up, replay them
    sync_check: bool = False           # CUDA: any host sync inside a timed training step is an error
    log_every: int = count(10, 1, MAX_STEPS, "steps")  # print a train-loss line every this many steps
    log_dir: str = path("logs")          # the folder of the run's log (and checkpoint)
    save_checkpoint: bool = False      # write logs/<run id>_model.safetensors at the end
    # write the run's state every this many steps to logs/<run id>_resume.pt, for --resume=PATH (0: never)
    resume_every: int = count(0, 0, MAX_STEPS, "steps")
    # the metrics' other sink beside the log: auto (TensorBoard or W&B when installed) | none | tensorboard | wandb
    metrics: str = choice("auto", "none", "tensorboard", "wandb")


MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelConfig)]
# Keys that say how a run executes, not what it trains: a preset may leave them at their defaults.
# Every other key is the recipe's, which a preset states whole (the schema's defaults are inert).
RUN_KEYS = ("preset", "seed", "device", "kernels", "compile", "compile_backend", "fp8_gemm", "attention_impl",
            "fp8_on_cpu",
            "warmup_steps", "warm_up", "cuda_graphs", "sync_check", "val_every", "log_every", "log_dir",
            "save_checkpoint", "ngram_cache_rows", "resume_every", "metrics")
STAGE_FIELDS = [f.name for f in dataclasses.fields(Stage)]
AVERAGE_FIELDS = [f.name for f in dataclasses.fields(Average)]
TABLE_PHASE_FIELDS = [f.name for f in dataclasses.fields(TablePhase)]
LOG_ONLY_KEYS = ("entry",)          # written into a log's config for the records tools, not settings


def head_dims(cfg: ModelConfig, layer):
    """(query and key, value) widths per head of a layer's attention."""
    return (cfg.narrow_qk_dim if layer in cfg.narrow_qk_layers else cfg.head_dim,
            cfg.narrow_vo_dim if layer in cfg.narrow_vo_layers else cfg.head_dim)


def injection_layers(cfg: ModelConfig):
    """(x0's, the hashed embedding's) layers of the token gates' injections: x0_layers and
    hashed_layers, or (null) every attention layer but the dense trunk's last."""
    last = cfg.num_layers - 1 if cfg.trunk == "dense" else None
    every = tuple(i for i in range(cfg.num_layers) if i not in cfg.attention_free_layers and i != last)
    return (every if cfg.x0_layers is None else tuple(cfg.x0_layers),
            every if cfg.hashed_layers is None else tuple(cfg.hashed_layers))


def value_embed_width(cfg: ModelConfig, layer):
    """The width of layer `layer`'s value-embedding table."""
    return cfg.num_heads * (cfg.head_dim if cfg.value_embed_full_width else head_dims(cfg, layer)[1])


def value_embed_tables(cfg: ModelConfig):
    """{layer: its value-embedding table}: with value_embed_layers, table i serves the i-th layer
    listed; otherwise table i serves layer i and layer num_layers - num_value_embeds + i."""
    if cfg.value_embed_layers:
        return {layer: i for i, layer in enumerate(cfg.value_embed_layers)}
    n, tables = cfg.num_layers, cfg.num_value_embeds
    return {**{i: i for i in range(tables)}, **{n - tables + i: i for i in range(tables)}}


# -----------------------------------------------------------------------------------------------
# Reading a config: presets, config files, --key=value
# -----------------------------------------------------------------------------------------------

MAX_JSON_DEPTH = 32                # lists and objects nest at most this deep in a config (a resolved one: 3)
CONFIG_FILE_MAX_BYTES = 2**20      # the largest --config file read (a resolved config is ~5 KB)
TYPE_NAMES = {int: "a whole number", float: "a number", str: "a string"}  # for the messages of parse_value
SCHEMA = {f.name: f for f in dataclasses.fields(Hyperparameters)}


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


def parse_value(key, text, kind):
    """The value of --key=text for a field of type `kind` (bool, int, float, str; else JSON)."""
    if kind is bool:
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(f"--{key} expects true or false, got {text!r}")
    if kind in (int, float, str):
        try:
            return kind(text)
        except ValueError:
            raise ConfigError(f"--{key} expects {TYPE_NAMES[kind]}, got {text!r}") from None
    try:
        return load_json(f"--{key}", text)
    except json.JSONDecodeError:
        raise ConfigError(f"--{key} expects JSON (a list), got {text!r}") from None


def config_from_dict(d, base=None):
    """A Hyperparameters from a resolved-config dict (as written into a log): its keys set on
    `base` (a Hyperparameters, e.g. a preset's), or on the defaults when base is None. Not yet
    normalized: normalize_config does that once all values are in."""
    if not isinstance(d, dict):
        raise ConfigError(f"a config must be a JSON object of key: value, got {type(d).__name__}")
    d = {k: v for k, v in d.items() if k not in LOG_ONLY_KEYS}
    unknown = sorted(set(d) - set(SCHEMA))
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}")
    h = Hyperparameters() if base is None else base
    for key, value in d.items():
        setattr(h, key, value)
    return h


class StatedKeys:
    """A Hyperparameters as a preset function sees it: reads and writes go through to it, and
    `stated` collects the keys the preset wrote (its recipe, as --print_config shows it)."""

    def __init__(self, h):
        object.__setattr__(self, "_h", h)
        object.__setattr__(self, "stated", set())

    def __getattr__(self, key):
        return getattr(self._h, key)

    def __setattr__(self, key, value):
        self.stated.add(key)
        setattr(self._h, key, value)


def preset_config(name, presets, stated=None):
    """The Hyperparameters of the preset `name`: the defaults, then presets[name](h); the keys the
    preset wrote are added to the set `stated` when one is given."""
    if not isinstance(name, str) or name not in presets:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(presets)}")
    h = Hyperparameters(preset=name)
    view = StatedKeys(h)
    presets[name](view)
    if stated is not None:
        stated |= view.stated
    return h


def print_config(h, origins, preset_fn=None):
    """--print_config: a comment line with the first sentence of the preset's docstring (what it
    is, and whether a run has measured it), then every key of the resolved config, its value and
    where it came from."""
    doc = " ".join((getattr(preset_fn, "__doc__", None) or "").split())
    if doc:
        print(f"# preset {h.preset}: {doc.split('. ')[0].rstrip('.')}")
    width = max(map(len, SCHEMA))
    for key, value in config_to_dict(h).items():
        print(f"{key:<{width}}  {json.dumps(value, default=str):<40}  {origins.get(key, 'default')}")


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


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose refusals are ConfigErrors (one `error:` line), not a usage
    message and an exit."""

    def error(self, message):
        raise ConfigError(f"{self.prog}: {message}")


# -----------------------------------------------------------------------------------------------
# --help: every key with its type, its range and its meaning, read from the schema
# -----------------------------------------------------------------------------------------------

HELP_TYPES = {int: "INT", float: "FLOAT", bool: "true|false", str: "STR", tuple: "JSON-LIST", list: "JSON-LIST"}
LIST_ITEMS = {"stages": Stage, "averages": Average, "table_phases": TablePhase}  # list keys: what each entry is
HELP_VALUE_CHARS = 40              # a preset's value is shown when its JSON is at most this long
HELP_KEY_WIDTH = 38                # the column of --key=TYPE before a key's meaning
SECTION_MARK = "--"                # a schema comment "-- name --" heads a part of the source, and says no key's meaning
# --help's groups, by what a key is for, in the order listed; every key but preset in exactly one.
HELP_GROUPS = {
    "the run: its track, seed, device, log and outputs": (
        "track", "seed", "device", "log_dir", "log_every", "save_checkpoint", "resume_every", "metrics"),
    "data and validation": (
        "train_files", "val_files", "val_tokens", "val_tokens_per_rank", "val_every", "batch_ranks", "target_rule",
        "attention_segment_tokens"),
    "model: size and storage": ("num_layers", "model_dim", "num_heads", "head_dim", "mlp_hidden", "param_dtype"),
    "model: attention": (
        "long_window_layers", "attention_free_layers", "rope_base", "attn_scale", "yarn_scale_growth", "key_offset",
        "xsa_layers", "paired_head_layers", "narrow_qk_layers", "narrow_qk_dim", "narrow_qk_attn_scale",
        "narrow_vo_layers", "narrow_vo_dim", "composed_layers", "composed_window", "paired_head_layout",
        "window_edge_key", "attn_out_init", "narrow_yarn_window"),
    "model: embeddings and hashed tables": (
        "embed_init_std", "num_value_embeds", "value_embed_layers", "value_embed_gate_dim",
        "value_embed_gate_reads_value", "value_embed_sparse", "bigram_rows", "ngram_rows", "ngram_dtype",
        "smear_gate", "canonical_mask", "cross_documents", "table_hashes", "ngram_normalized",
        "value_embed_full_width"),
    "model: the pointer mixture (PR 379)": ("pointer_mixture", "pointer_dim", "pointer_band", "pointer_val_band"),
    "model: the document copy feature (PR 378)": ("document_copy",),
    "model: trunk, MLPs and gates": (
        "trunk", "skip_layers", "snapshot_layer", "parallel_mlp_layers", "mlp_free_layers", "token_gates",
        "token_gates_split", "attn_gate_layers", "x0_layers", "hashed_layers", "final_mix"),
    "schedule: steps, stages, windows, LR": (
        "num_iterations", "stages", "val_long_window", "yarn_at_final_window", "untie_frac", "candidate_walk",
        "cooldown_start", "cooldown_floor", "cooldown_end"),
    "approximate backward (sampled head gradient, truncated attention backward)": (
        "head_grad_stride", "head_grad_start", "attn_bwd_windows", "attn_bwd_error_bound", "attn_bwd_choice_steps",
        "attn_bwd_start", "approx_exact_last_steps"),
    "end-of-training weight averages": ("averages", "average_norms"),
    "matrix optimizer (Muon, NorMuon, ANVIL, or Adam)": (
        "optimizer", "orthogonalize", "matrix_lr", "adamw_matrix_lr", "matrix_wd", "mlp_down_lr_scale",
        "matrix_shapes", "qk_ortho_heads", "momentum", "momentum_warmup_start", "momentum_warmup_steps",
        "momentum_cooldown_steps", "anvil_fast_beta", "anvil_slow_beta", "anvil_blend", "anvil_blend_start",
        "anvil_fast_beta_follows_mu", "anvil_mu_low", "anvil_mu_high", "anvil_mu_rise", "anvil_mu_fall"),
    "Adam: embeddings, head, scalars, gates": (
        "embed_lr", "head_lr", "value_embed_lr", "scalar_lr", "gate_lr", "smear_gate_lr", "token_gate_lr",
        "dense_lr", "pointer_lr", "document_copy_lr", "resid_scale_lr", "post_scale_lr", "embed_betas",
        "value_embed_betas", "scalar_betas", "scale_betas", "embed_wd", "value_embed_wd", "gate_wd", "gate_mlp_wd",
        "adam_eps", "adam_eps_unit", "adam_step_every"),
    "sparse tables: the n-gram table and sparse value embeddings": (
        "ngram_lr", "ngram_beta2", "ngram_wd", "ngram_step_every", "table_phases", "value_embed_table_cadence",
        "ngram_cache_rows"),
    "kernels, compilation, FP8 and the warm-up": (
        "kernels", "compile", "compile_backend", "compute_dtype", "fp8_mlp", "fp8_mlp_scales", "fp8_qkv",
        "fp8_qkv_scales", "fp8_head", "fp8_head_scales", "fp8_gemm", "attention_impl", "fp8_on_cpu", "cuda_graphs",
        "sync_check", "warm_up", "warmup_steps"),
}
UNGROUPED = "other keys"           # --help's heading for a key HELP_GROUPS does not place


def is_section_heading(text):
    """Whether a comment's text is a heading of the source ("-- data --"), not a key's meaning."""
    return text.startswith(SECTION_MARK) and text.endswith(SECTION_MARK)


def field_comments(cls):
    """{field: its meaning} for a dataclass of this module, from the source's comments: the one on
    the field's line, else the block of comment lines just above it (headings left out)."""
    source = open(__file__, encoding="utf-8").read()
    comments = {}                  # line -> (text, whether the line is only a comment)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = (token.string.lstrip("#").strip(), token.line.strip().startswith("#"))
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    meanings = {}
    for item in node.body:
        if not isinstance(item, ast.AnnAssign):
            continue
        trailing = [comments[line][0] for line in range(item.lineno, item.end_lineno + 1)
                    if line in comments and not comments[line][1]]
        above, line = [], item.lineno - 1
        while line in comments and comments[line][1] and not is_section_heading(comments[line][0]):
            above.insert(0, comments[line][0])
            line -= 1
        meanings[item.target.id] = trailing[0] if trailing else " ".join(above)
    return meanings


def allowed_values(f):
    """What field f takes, in words, from its metadata and type."""
    rule = f.metadata
    if "allowed" in rule:
        return rule["allowed"]
    if "choices" in rule or f.type is bool:
        return ""                  # the type says it
    if rule.get("layers"):
        return "distinct layer indices in [0, num_layers)" + (", or null" if rule["nullable"] else "")
    if rule.get("betas"):
        return "two numbers in [0, 1), e.g. [0.8, 0.95]"
    if rule.get("path"):
        return "a path (or glob)"
    if f.name in LIST_ITEMS:
        return f"a list of objects with keys {', '.join(x.name for x in dataclasses.fields(LIST_ITEMS[f.name]))}"
    return "a list" if f.type is tuple else ""


def help_groups():
    """[(heading, keys)] of --help: HELP_GROUPS, then any key it does not place (under UNGROUPED)."""
    placed = {key for keys in HELP_GROUPS.values() for key in keys}
    rest = tuple(name for name in SCHEMA if name not in placed and name != "preset")
    return [*HELP_GROUPS.items(), *([(UNGROUPED, rest)] if rest else [])]


def key_help_line(name, meaning, values, preset):
    """One key's line of --help: --key=TYPE, its meaning and allowed values, the preset's value."""
    f = SCHEMA[name]
    kind = "|".join(f.metadata["choices"]) if "choices" in f.metadata else HELP_TYPES.get(f.type, "JSON")
    value = json.dumps(values[name]) if values and name in values else ""
    shown = f" [{preset}: {value}]" if value and len(value) <= HELP_VALUE_CHARS else ""
    said = "; ".join(text for text in (meaning, allowed_values(f)) if text)
    return f"  {f'--{name}={kind}':<{HELP_KEY_WIDTH}} {said}{shown}"


def keys_help(values=None, preset=""):
    """The help's list of keys: each on one line with its type, meaning and allowed values (and its
    value in `values`, the named preset's config as a dict), grouped by what the key is for
    (HELP_GROUPS); then the keys of a stage, an average and a table phase."""
    meanings = field_comments(ModelConfig) | {k: v for k, v in field_comments(Hyperparameters).items() if v}
    lines = ["every key, as --key=value or --key value (lists and objects as JSON):"]
    for heading, keys in help_groups():
        lines.append(f"\n {heading}:")
        lines += [key_help_line(name, meanings.get(name, ""), values, preset) for name in keys]
    for key, cls in LIST_ITEMS.items():
        item_meanings = field_comments(cls)
        lines.append(f"\n each entry of --{key} ({' '.join(cls.__doc__.split()).split('. ')[0].rstrip('.')}):")
        lines += [f"  {f.name}: {item_meanings.get(f.name) or f.type.__name__}" for f in dataclasses.fields(cls)]
    return "\n".join(lines)


def preset_named(argv, default_preset):
    """The --preset NAME or --preset=NAME of argv (else default_preset; None with --config)."""
    for i, item in enumerate(argv):
        if item == "--preset" and i + 1 < len(argv):
            return argv[i + 1]
        if item.startswith("--preset="):
            return item.split("=", 1)[1]
        if item == "--config" or item.startswith("--config="):
            return None
    return default_preset


KEY_MATCH_CUTOFF = 0.6             # difflib's similarity from which an unknown key's nearest one is suggested


def unknown_key_message(key):
    """The refusal of an unknown --key: the nearest key (dashes read as underscores), or --help."""
    near = difflib.get_close_matches(key.replace("-", "_"), [k for k in SCHEMA if k != "preset"], n=1,
                                     cutoff=KEY_MATCH_CUTOFF)
    hint = f"did you mean --{near[0]}?" if near else "python train_gpt.py --help lists every key"
    return f"unknown config key {key!r}: {hint}"


def joined_values(items):
    """The overrides `items` with each `--key value` pair of a schema key written `--key=value`."""
    out, i = [], 0
    while i < len(items):
        item, following = items[i], items[i + 1] if i + 1 < len(items) else None
        if (item.startswith("--") and "=" not in item and item[2:] in SCHEMA and following is not None
                and not following.startswith("--")):
            out.append(f"{item}={following}")
            i += 2
        else:
            out.append(item)
            i += 1
    return out


def apply_overrides(h, items, allowed=None):
    """Set each "--key=value" (or "--key value") of `items` on h (parsed by the key's annotated
    type); `allowed`: the keys that may be given (None: every key but preset)."""
    for item in joined_values(items):
        key, equals, text = item.removeprefix("--").partition("=")
        if not item.startswith("--"):
            raise ConfigError(f"expected --key=value, got {item!r}")
        if allowed is not None and key not in allowed:
            raise ConfigError(f"{item!r}: with a checkpoint only --key=value of {', '.join(allowed)} may be given")
        if key not in SCHEMA or key == "preset":
            raise ConfigError(unknown_key_message(key))
        if not equals:
            raise ConfigError(f"--{key} needs a value: --{key}=VALUE (python train_gpt.py --help says what it takes)")
        setattr(h, key, parse_value(key, text, SCHEMA[key].type))
    return h


def parse_config(argv, presets, default_preset, description=None):
    """--preset NAME (of `presets`, else default_preset), or --config PATH (a resolved config
    from a log), then --key=value overrides; normalized and checked."""
    epilog = None
    if any(item in ("-h", "--help") for item in argv):   # the list of keys, with the named preset's values
        name = preset_named(argv, default_preset)
        values = config_to_dict(preset_config(name, presets)) if name in presets else None
        epilog = keys_help(values, name)
    parser = ArgumentParser(description=description, add_help=True, epilog=epilog,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default=None, help=f"one of {sorted(presets)} (train_gpt.py without one: "
                                                       f"what ./run.sh runs on this machine, the cpu preset without "
                                                       f"a GPU)")
    parser.add_argument("--config", default=None, help="JSON file of a resolved config (a log's)")
    parser.add_argument("--resume", metavar="PATH", help="continue the run whose state is PATH (<log_dir>/<run id>"
                                                         "_resume.pt, written with --resume_every=K), in its config")
    parser.add_argument("--print_config", action="store_true",
                        help="print the resolved config, each key with its origin (preset, default, --config "
                             "file, command line), and exit")
    args, rest = parser.parse_known_args(argv)
    if args.config and args.preset:
        raise ConfigError("give --preset or --config, not both (a config file already names its preset)")
    stated = set()
    if args.config:
        d = read_config_file(args.config)
        named = isinstance(d, dict) and d.get("preset", "none") != "none"   # "none": the schema's defaults
        h = config_from_dict(d, base=preset_config(d["preset"], presets, stated) if named else None)
        origins = {key: "preset" for key in stated} | {key: "--config file" for key in d}
    else:
        h = preset_config(args.preset or default_preset, presets, stated)
        origins = {key: "preset" for key in stated}
    h = normalize_config(apply_overrides(h, rest))
    origins |= {item.removeprefix("--").partition("=")[0]: "command line" for item in joined_values(rest)}
    origins["preset"] = "--preset" if args.preset else "--config file" if args.config else "default"
    for item in argv:
        if not loggable(item):
            raise ConfigError(f"the argument {json.dumps(item)} cannot be written into the log (it records the "
                              f"command line): expects UTF-8 text without line breaks")
    if args.print_config:
        print_config(h, origins, presets.get(h.preset))
        raise SystemExit(0)
    return h


def config_to_dict(h):
    return dataclasses.asdict(h)


# -----------------------------------------------------------------------------------------------
# Normalizing and checking, once
# -----------------------------------------------------------------------------------------------

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


def _objects(key, values, cls, noun, fields, required=""):
    """A list of `cls` from `values`, a JSON list of objects (or of cls already): --key's list of
    `noun`s ("an average"); ConfigError naming what is wrong."""
    plural = noun.split(" ", 1)[1] + "s"
    if not isinstance(values, (list, tuple)):
        raise ConfigError(f"--{key}: expects a JSON list of {plural}, got {json.dumps(values)}")
    out = []
    for value in values:
        try:
            out.append(value if isinstance(value, cls) else cls(**value))
        except TypeError:
            raise ConfigError(f"--{key}: {json.dumps(value)} is not {noun}; {noun} is a JSON object with keys "
                              f"{fields}{required}") from None
    return out


def normalize_config(h):
    """Turn JSON values (lists, dicts) into the schema's types, resolve orthogonalize=auto, then
    check every value (check_config). Returns h."""
    if not isinstance(h.stages, (list, tuple)) or not h.stages:
        raise ConfigError(f"--stages: expects a non-empty JSON list of stages, got {json.dumps(h.stages)}")
    h.stages = [_stage(s) for s in h.stages]
    h.averages = _objects("averages", h.averages, Average, "an average", AVERAGE_FIELDS,
                          " (params and window required)")
    h.table_phases = _objects("table_phases", h.table_phases, TablePhase, "a phase", TABLE_PHASE_FIELDS)
    for key, f in SCHEMA.items():
        if f.type is tuple:
            value = getattr(h, key)
            if value is None and f.metadata.get("nullable"):
                continue
            if not isinstance(value, (list, tuple)):
                raise ConfigError(f"--{key}={json.dumps(value)}: expects a JSON list, e.g. --{key}=[1,2]")
            setattr(h, key, tuple(value))
    if h.orthogonalize == "auto":
        h.orthogonalize = "anvil" if h.optimizer == "anvil" else "polar_express"
    check_config(h)
    return h


def is_number(value, integer=False):
    """Whether value is a finite number (an int, not a bool, when integer)."""
    if isinstance(value, bool):
        return False
    if integer:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


def _refuse(key, value, allowed):
    raise ConfigError(f"--{key}={json.dumps(value)} is not allowed: expects {allowed}")


def _conflict(m, keys, why):
    settings = " and ".join(f"--{key}={json.dumps(getattr(m, key))}" for key in keys)
    raise ConfigError(f"{settings} do not fit together: {why}")


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


def check_field(h, f):
    """The rule of field `f` (its annotation and metadata) on h's value."""
    value, rule = getattr(h, f.name), f.metadata
    if f.type is bool and not isinstance(value, bool):
        _refuse(f.name, value, "true or false")
    if "allowed" in rule:
        low, high, above, below = rule["low"], rule["high"], rule.get("above"), rule.get("below")
        if not is_number(value, integer=rule.get("integer", False)) or value < low or \
                (above is not None and value <= above) or (high is not None and value > high) or \
                (below is not None and value >= below) or (rule.get("integer") and value % rule["multiple"]):
            _refuse(f.name, value, rule["allowed"])
    if "choices" in rule and value not in rule["choices"]:
        _refuse(f.name, value, "one of " + ", ".join(rule["choices"]))
    if rule.get("path") and (not isinstance(value, str) or not value):
        _refuse(f.name, value, "a non-empty path")
    if rule.get("layers") and not (value is None and rule["nullable"]):
        in_range = all(is_number(i, integer=True) and 0 <= i < h.num_layers for i in value)
        if not in_range or len(set(value)) < len(value):
            _refuse(f.name, list(value), f"a list of distinct layer indices in [0, {h.num_layers})")
    if rule.get("ascending"):
        high = h.num_iterations - 1 if rule["high"] is None else rule["high"]
        if not all(is_number(x, integer=True) and rule["low"] <= x <= high for x in value) or \
                list(value) != sorted(set(value)):
            _refuse(f.name, list(value), f"a list of ascending, distinct {rule['what']} in [{rule['low']:,}, {high:,}]")
    if rule.get("betas") and (len(value) != 2 or not all(is_number(b) and 0 <= b < 1 for b in value)):
        _refuse(f.name, list(value), "two numbers in [0, 1), e.g. [0.8, 0.95]")


def check_config(h):
    """Every value's own rule (check_field, in the schema's order), then the rules that tie keys
    together: a bad value ends the run before any work, with one line naming the key, the
    value and what is allowed."""
    for key, value in config_to_dict(h).items():
        if not all(loggable(text) for text in json_strings(value)):
            _refuse(key, value, "UTF-8 text without line breaks (the log records it)")
    for f in SCHEMA.values():
        if not f.metadata.get("layers") and not f.metadata.get("ascending"):
            check_field(h, f)
    for f in SCHEMA.values():                # layer and step lists once num_layers and num_iterations are valid
        if f.metadata.get("layers") or f.metadata.get("ascending"):
            check_field(h, f)
    check_model_config(h)
    if h.cooldown_end <= h.cooldown_start:
        _conflict(h, ("cooldown_start", "cooldown_end"), "the cooldown must end after it starts (its slope divides "
                  "by its length); to keep the LR up to the end, let it start late, e.g. --cooldown_start=0.99")
    if h.qk_ortho_heads and h.num_heads % h.qk_ortho_heads:
        _conflict(h, ("qk_ortho_heads", "num_heads"), "the query and key blocks must split the heads evenly")
    _check_stages(h.stages)
    _check_averages(h.averages)
    _check_table_phases(h.table_phases)
    _check_fp8(h)
    _check_approximate_backward(h)


def _check_approximate_backward(h):
    """The truncated backward's windows are measured at steps before the first that uses them; a
    sampled head gradient's groups split every stage's slice."""
    windows, steps = h.attn_bwd_windows, h.attn_bwd_choice_steps
    if windows and (not steps or steps[-1] >= h.attn_bwd_start):
        _conflict(h, ("attn_bwd_windows", "attn_bwd_choice_steps", "attn_bwd_start"),
                  "the truncated backward needs its choice steps, all before attn_bwd_start")
    if h.head_grad_stride > 1:
        uneven = [s.tokens_per_rank for s in h.stages if s.tokens_per_rank % h.head_grad_stride]
        if uneven:
            _conflict(h, ("head_grad_stride",), f"a slice of {uneven[0]:,} tokens does not split into groups of "
                      f"{h.head_grad_stride} rows")


def _check_fp8(h):
    """The static scale of rms-normed FP8 inputs holds rows up to kernels.NORMED_INPUT_MAX_DIM wide."""
    static = [key for key, on in (("fp8_qkv", h.fp8_qkv),
                                  ("fp8_mlp_scales", h.fp8_mlp and h.fp8_mlp_scales == "record92")) if on]
    if static and h.model_dim > kernels.NORMED_INPUT_MAX_DIM:
        _conflict(h, ("model_dim", *static), f"their static input scale saturates rows wider than "
                  f"{kernels.NORMED_INPUT_MAX_DIM}; use --fp8_qkv=false and --fp8_mlp_scales=delayed")


def check_model_config(m):
    """The rules that tie a model config's keys together (each value's own rule is its field's):
    a broken one is refused with one line naming the keys involved."""
    if 0 < m.ngram_rows < 4:
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
        widths.setdefault(table, set()).add(value_embed_width(m, layer))
    if any(len(w) > 1 for w in widths.values()):
        _conflict(m, ("num_value_embeds", "narrow_vo_layers"), "a shared value-embedding table serves layers "
                  "of one value width: give per-layer tables with --value_embed_layers")
    if m.attn_gate_layers and not m.token_gates:
        _conflict(m, ("attn_gate_layers", "token_gates"), "the output gates come from the token gates: "
                  "set --token_gates=true")
    if set(m.attn_gate_layers) & set(m.attention_free_layers):
        _conflict(m, ("attn_gate_layers", "attention_free_layers"), "an output gate acts on a layer's attention")
    if m.composed_layers and not m.token_gates:
        _conflict(m, ("composed_layers", "token_gates"), "the head mixes come from the token gates: set --token_gates=true")
    if set(m.composed_layers) & (set(m.attention_free_layers) | set(m.paired_head_layers)):
        _conflict(m, ("composed_layers", "attention_free_layers", "paired_head_layers"), "composed attention mixes the "
                  "maps of a layer's own heads: a layer with attention, not paired")
    if set(m.mlp_free_layers) & set(m.parallel_mlp_layers):
        _conflict(m, ("mlp_free_layers", "parallel_mlp_layers"), "a parallel MLP sits beside the layer's MLP")
    if m.trunk != "dense" and (m.x0_layers is not None or m.hashed_layers is not None):
        _conflict(m, ("x0_layers", "hashed_layers", "trunk"), "the injection sites are the dense trunk's: "
                  "set them to null")
    if m.token_gates and m.token_gates_split > m.num_layers:
        _conflict(m, ("token_gates_split", "num_layers"), "the split is a layer index, or num_layers for one MLP")
    if m.token_gates and len(m.attention_free_layers) == m.num_layers:
        _conflict(m, ("token_gates", "attention_free_layers"), "the token gates act on attention layers: "
                  "there are none")
    if m.trunk == "dense":
        _check_dense_trunk(m)
    if m.pointer_dim & (m.pointer_dim - 1):
        _refuse("pointer_dim", m.pointer_dim, "a power of two, at least 16 (the pointer kernel's tiles)")
    if m.smear_gate and m.model_dim < SMEAR_GATE_DIMS:
        _conflict(m, ("smear_gate", "model_dim"), f"the smear gate reads the first {SMEAR_GATE_DIMS} dims")


def _check_dense_trunk(m):
    last = m.num_layers - 1
    if not m.token_gates:
        _conflict(m, ("trunk", "token_gates"), "the dense trunk injects x0 and the bigram through the token gates: "
                  "set --token_gates=true")
    source, target = (tuple(m.skip_layers) + (None, None))[:2]
    if len(m.skip_layers) != 2 or not all(is_number(i, integer=True) for i in m.skip_layers) \
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
    for key in ("x0_layers", "hashed_layers"):
        if set(getattr(m, key) or ()) & {target, last}:
            _conflict(m, (key, "skip_layers", "num_layers"), "the skip's target takes no injection, and the last "
                      "layer takes its own from the dense connections")
    if last in m.mlp_free_layers:
        _conflict(m, ("mlp_free_layers", "num_layers"), "the dense connections mix the last layer's MLP output")
    if last in m.attention_free_layers or m.num_heads * head_dims(m, last)[1] != m.model_dim:
        _conflict(m, ("trunk", "attention_free_layers", "narrow_vo_layers"), "the dense connections mix residual "
                  "vectors into the last layer's values: it needs attention with num_heads x head_dim = model_dim")
    if m.num_heads % 2:
        _conflict(m, ("trunk", "num_heads"), "the last layer's value-embedding gate has one lane per half of the "
                  "heads: an even number")
    if m.final_mix == "record92" and any(value_embed_width(m, layer) != m.model_dim for layer in value_embed_tables(m)):
        _conflict(m, ("final_mix", "value_embed_full_width", "narrow_vo_layers"), "record 92's final mix adds "
                  "every value-embedding table to the residual: each as wide as model_dim")
    if m.final_mix == "record92" and m.model_dim % FINAL_MIX_GROUPS:
        _conflict(m, ("final_mix", "model_dim"), f"record 92's final mix has a coefficient delta for each of "
                  f"{FINAL_MIX_GROUPS} channel groups: a multiple of {FINAL_MIX_GROUPS} dims")


def _check_stages(stages):
    def refuse(i, what):
        raise ConfigError(f"--stages: stage {i} {what}")

    previous_end = 0.0
    for i, s in enumerate(stages):
        if not is_number(s.end) or not previous_end < s.end <= 1.0:
            refuse(i, f"ends at {s.end!r}: stage ends must increase within (0, 1]")
        previous_end = s.end
        for key, high in (("tokens_per_rank", MAX_SLICE_TOKENS), ("max_doc_len", MAX_SLICE_TOKENS),
                          ("short_window", MAX_WINDOW_BLOCKS), ("long_window", MAX_WINDOW_BLOCKS)):
            if not is_number(getattr(s, key), integer=True) or not 1 <= getattr(s, key) <= high:
                refuse(i, f"has {key}={getattr(s, key)!r}: expects a positive whole number, at most {high:,}")
        if s.tokens_per_rank < MIN_DOC_TOKENS:
            refuse(i, f"has tokens_per_rank={s.tokens_per_rank}: expects at least {MIN_DOC_TOKENS}")
        if not 1 <= len(s.mtp_weights) <= MAX_TARGETS - 1 or not all(is_number(w) and w >= 0 for w in s.mtp_weights):
            refuse(i, f"has mtp_weights={list(s.mtp_weights)}: expects 1 to {MAX_TARGETS - 1} weights >= 0")
        if s.mtp_weights_end and (len(s.mtp_weights_end) != len(s.mtp_weights) or
                                  not all(is_number(w) and w >= 0 for w in s.mtp_weights_end)):
            refuse(i, f"has mtp_weights_end={list(s.mtp_weights_end)}: expects [] (constant weights) or "
                      f"{len(s.mtp_weights)} weights >= 0, one per mtp_weights entry")
        if not is_number(s.prefix_weight) or s.prefix_weight < 0:
            refuse(i, f"has prefix_weight={s.prefix_weight!r}: expects a weight >= 0")
        if s.prefix_weight_end is not None and (not is_number(s.prefix_weight_end) or s.prefix_weight_end < 0):
            refuse(i, f"has prefix_weight_end={s.prefix_weight_end!r}: expects null (constant) or a weight >= 0")
        if not is_number(s.prefix_weight_levels, integer=True) or not 0 <= s.prefix_weight_levels <= MAX_STEPS:
            refuse(i, f"has prefix_weight_levels={s.prefix_weight_levels!r}: expects 0 (a linear move) or a "
                      f"number of equal parts, at most {MAX_STEPS:,}")
        if not is_number(s.candidates, integer=True) or not (s.candidates == 0 or 2 <= s.candidates <= PADDED_VOCAB_SIZE):
            refuse(i, f"has candidates={s.candidates!r}: expects 0 (full vocabulary) or 2 to {PADDED_VOCAB_SIZE}: "
                      f"the candidates are the target and negatives, and a softmax over the target alone is 1 "
                      f"whatever the logits (loss 0, no gradient)")
        if not is_number(s.lr_mult) or s.lr_mult < 0:
            refuse(i, f"has lr_mult={s.lr_mult!r}: expects a multiplier >= 0")
    if stages[-1].end != 1.0:
        raise ConfigError("--stages: the last stage must end at 1.0 (the fraction of num_iterations)")


def _check_averages(averages):
    for i, a in enumerate(averages):
        def refuse(what):
            raise ConfigError(f"--averages: average {i} ({a.params}) {what}")
        if a.params not in AVERAGED_PARAMS:
            refuse(f"has params={a.params!r}: expects one of {', '.join(AVERAGED_PARAMS)}")
        if not is_number(a.window, integer=True) or not 1 <= a.window <= MAX_STEPS:
            refuse(f"has window={a.window!r}: expects a number of steps >= 1, at most {MAX_STEPS:,}")
        if not is_number(a.every, integer=True) or not 1 <= a.every <= MAX_STEPS:
            refuse(f"has every={a.every!r}: expects a number of steps >= 1, at most {MAX_STEPS:,}")
        if not is_number(a.rate) or not 0 < a.rate <= 1:
            refuse(f"has rate={a.rate!r}: expects an EMA weight in (0, 1]")
        if not is_number(a.blend) or not 0 <= a.blend <= 1:
            refuse(f"has blend={a.blend!r}: expects a weight in [0, 1]")
        if not isinstance(a.renormalize, bool):
            refuse(f"has renormalize={a.renormalize!r}: expects true or false")
        if not is_number(a.offset, integer=True) or not 0 <= a.offset < a.every:
            refuse(f"has offset={a.offset!r}: expects a whole number of steps below every={a.every}")
        if not is_number(a.last_steps, integer=True) or not 0 <= a.last_steps <= MAX_STEPS:
            refuse(f"has last_steps={a.last_steps!r}: expects a number of steps >= 0, at most {MAX_STEPS:,}")


def _check_table_phases(phases):
    previous = 0
    for i, p in enumerate(phases):
        def refuse(what):
            raise ConfigError(f"--table_phases: phase {i} {what}")
        if not is_number(p.start, integer=True) or not previous < p.start <= MAX_STEPS:
            refuse(f"starts at {p.start!r}: phases start at increasing steps >= 1, at most {MAX_STEPS:,}")
        previous = p.start
        for key in ("ngram_beta2", "value_embed_beta2"):
            if not is_number(getattr(p, key)) or not 0 <= getattr(p, key) < 1:
                refuse(f"has {key}={getattr(p, key)!r}: expects a beta in [0, 1)")
        if not is_number(p.step_every, integer=True) or not 1 <= p.step_every <= MAX_STEPS:
            refuse(f"has step_every={p.step_every!r}: expects a whole number of steps in [1, {MAX_STEPS:,}]")
        if p.value_embed_beta1 is not None and (not is_number(p.value_embed_beta1) or not 0 <= p.value_embed_beta1 < 1):
            refuse(f"has value_embed_beta1={p.value_embed_beta1!r}: expects null (unchanged) or a beta in [0, 1)")
        if not is_number(p.decay_mult) or not 0 <= p.decay_mult < math.inf:
            refuse(f"has decay_mult={p.decay_mult!r}: expects a multiplier >= 0")
