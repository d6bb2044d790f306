"""The CPU track's plain baseline: a nanoGPT-style GPT trained with AdamW on the tiny offline corpus.

Model: learned token and position embeddings, pre-norm blocks of LayerNorm ->
causal self-attention and LayerNorm -> GELU MLP (4x width), a final LayerNorm
and an lm_head tied to the token embedding. Training: fixed-length blocks read
in order from the train stream (no shuffling, no document masking), AdamW with
linear warmup then cosine decay to a tenth of the peak rate, gradient clipping,
bf16 autocast (bf16 products as fp32 GEMMs on CPUs without bf16 instructions:
machinery/cpu_runtime.py). Validation: mean next-token cross-entropy over the full padded
vocabulary on the first `val_tokens` tokens of the val shard.

The run writes its log (records/README.md; records/logfile.py writes it) to `<log_dir>/<run_id>.txt`.
Its full-budget mean final val loss sets the CPU track's target.

    python records/track_cpu/baseline_adamw.py [--config PATH] [--key=value ...]
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import resource
import shlex
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[2]  # the project root: sources are logged relative to it
sys.path.insert(0, str(REPO_ROOT))
from machinery.cpu_runtime import bf16_gemm_path, bf16_gemms, keep_freed_memory_for_reuse  # noqa: E402
from data.shards import ShardError, find_shards, fingerprint, read_shard  # noqa: E402
from records.logfile import (ERROR_PREFIX, INTERRUPTED_PREFIX, LogWriteError, LogWriter,  # noqa: E402
                             cpu_model, new_run_id)

BUILD_CORPUS = "python data/tiny_corpus.py"  # the command that creates the tiny corpus shards
CONFIG_MAX_BYTES = 2**20  # the largest --config file read (a resolved config is ~1 KB)
KIB_PER_MIB = 1024  # ru_maxrss is in KiB on Linux


@dataclass
class Hyperparameters:
    train_files: str = "data/tiny_corpus/tiny_train_*.bin"  # glob of train shards, read in sorted order
    val_files: str = "data/tiny_corpus/tiny_val_000000.bin"  # the val shard
    val_tokens: int = 65536  # validate on this many leading tokens of the val shard
    val_every: int = 0  # validate every this many steps (0: only at the end)
    vocab_size: int = 50304  # GPT-2's 50257 tokens padded to a multiple of 128
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 256  # model width
    block_size: int = 256  # tokens per sequence
    batch_size: int = 16  # sequences per step
    num_iterations: int = 200  # a full run: ~1.3 s/step on the idle 2-core track machine, so ~4.5 minutes
    learning_rate: float = 3e-3  # peak AdamW learning rate
    warmup_iters: int = 20  # steps of linear warmup from 0 to the peak
    min_lr_frac: float = 0.1  # the cosine decay ends at this fraction of the peak
    weight_decay: float = 0.1  # applied to matrices only, not to norms
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    grad_clip: float = 1.0  # max global gradient norm
    init_std: float = 0.02  # std of the normal init of every weight matrix and embedding (GPT-2)
    threads: int = 0  # torch CPU threads; 0: one per core (os.cpu_count())
    seed: int = 1337  # seeds the initialization (the data order is fixed)
    log_dir: str = "logs"  # the log goes to <log_dir>/<run_id>.txt
    preset: str = "baseline_adamw"  # names this script's settings in the log
    track: str = "track_cpu"  # the records track these runs belong to


# ----------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=False)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd, bias=False)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, n_layer, n_head, n_embd, init_std):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self._init_weights(n_layer, init_std)

    def _init_weights(self, n_layer, init_std):
        """GPT-2 init: N(0, init_std) everywhere, with residual output projections scaled by 1/sqrt(2 * n_layer)."""
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = init_std / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else init_std
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx, targets):
        """Mean next-token cross-entropy of `targets` given `idx`, both (B, T) int64."""
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        # The softmax over 50k entries runs in fp32: bf16 log-sum-exp loses the small differences the loss is made of.
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------- data


class SequentialBlocks:
    """Consecutive (batch_size, block_size) input/target blocks from the concatenated train shards.

    Each step consumes batch_size * block_size tokens; the targets are the inputs
    shifted by one token. When the stream is exhausted it starts again from the
    beginning (a new epoch).
    """

    def __init__(self, tokens, batch_size, block_size):
        self.tokens = tokens
        self.span = batch_size * block_size
        self.shape = (batch_size, block_size)
        if tokens.size < self.span + 1:
            raise ShardError(f"the train shards hold {tokens.size} tokens, fewer than one batch ({self.span + 1})")
        self.position = 0
        self.epoch = 0

    def next_batch(self):
        if self.position + self.span + 1 > self.tokens.size:
            self.position = 0
            self.epoch += 1
        chunk = torch.from_numpy(self.tokens[self.position : self.position + self.span + 1].astype(np.int64))
        self.position += self.span
        return chunk[:-1].view(self.shape), chunk[1:].view(self.shape)


def load_val_blocks(path, val_tokens, block_size):
    """The first val_tokens tokens of the val shard as (inputs, targets), each of shape (-1, block_size)."""
    if val_tokens % block_size:
        raise ValueError(f"val_tokens={val_tokens} must be a multiple of block_size={block_size}")
    tokens = read_shard(path)
    if tokens.size < val_tokens + 1:
        raise ShardError(f"{path}: holds {tokens.size} tokens, fewer than val_tokens + 1 = {val_tokens + 1}")
    chunk = torch.from_numpy(tokens[: val_tokens + 1].astype(np.int64))
    return chunk[:-1].view(-1, block_size), chunk[1:].view(-1, block_size)


# ----------------------------------------------------------------------------- training


def lr_at(step, hp):
    """Linear warmup over warmup_iters steps, then cosine decay from the peak to min_lr_frac * peak."""
    if step < hp.warmup_iters:
        return hp.learning_rate * (step + 1) / hp.warmup_iters
    progress = (step - hp.warmup_iters) / max(1, hp.num_iterations - hp.warmup_iters)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return hp.learning_rate * (hp.min_lr_frac + (1.0 - hp.min_lr_frac) * cosine)


def make_optimizer(model, hp):
    """AdamW with weight decay on matrices and embeddings only (nanoGPT's grouping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2))


@torch.no_grad()
def evaluate(model, val_inputs, val_targets, batch_size):
    """Mean cross-entropy over every val token: each batch's mean loss weighted by its token count."""
    model.eval()
    total = 0.0
    for start in range(0, val_inputs.size(0), batch_size):
        x, y = val_inputs[start : start + batch_size], val_targets[start : start + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total += model(x, y).item() * x.numel()
    model.train()
    return total / val_inputs.numel()


# ----------------------------------------------------------------------------- config and log


def refuse(message):
    """End the script before the run starts, with one `error:` line (exit status 1)."""
    sys.exit(f"{ERROR_PREFIX}{message}")


def read_config(path):
    """The settings of the --config file at `path`: a regular file of at most CONFIG_MAX_BYTES of
    UTF-8 JSON, an object whose keys are Hyperparameters fields (and "entry", which the log adds)
    with values of their types; refused with one line otherwise. Opened without blocking, so a
    FIFO is refused rather than waited on."""
    try:
        with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                refuse(f"--config {path} is not a regular file: give a JSON file")
            raw = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        refuse(f"cannot read --config {path}: {e.strerror}")
    if len(raw) > CONFIG_MAX_BYTES:
        refuse(f"--config {path} is larger than {CONFIG_MAX_BYTES // 2**20} MiB: a config file holds one resolved "
               f"config (a few hundred bytes of JSON)")
    try:
        loaded = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        refuse(f"--config {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): save it as UTF-8")
    except json.JSONDecodeError as e:
        refuse(f"--config {path} is not valid JSON ({e})")
    except RecursionError:
        refuse(f"--config {path}: lists and objects nest too deeply; a config is one flat object")
    if not isinstance(loaded, dict):
        refuse(f"--config {path}: a config must be a JSON object of key: value, got {type(loaded).__name__}")
    loaded.pop("entry", None)  # derived from where the script lives, not a setting
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    unknown = sorted(set(loaded) - set(fields))
    if unknown:
        refuse(f"--config {path}: unknown config keys {unknown}")
    for name, value in loaded.items():
        kinds, what = {int: ((int,), "a whole number"), float: ((int, float), "a number"),
                       str: ((str,), "a string")}[fields[name].type]
        if isinstance(value, bool) or not isinstance(value, kinds):
            refuse(f"--config {path}: {name} expects {what}, got {json.dumps(value)[:80]}")
    return loaded


def parse_hyperparameters(argv):
    """Defaults, then the JSON file given by --config, then --key=value overrides."""
    fields = {f.name: f for f in dataclasses.fields(Hyperparameters)}
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="JSON file of a resolved config (as written in a log)")
    for name, f in fields.items():
        parser.add_argument(f"--{name}", type=f.type, default=None)
    args = parser.parse_args(argv)
    values = read_config(args.config) if args.config else {}
    values.update({name: getattr(args, name) for name in fields if getattr(args, name) is not None})
    hp = Hyperparameters(**values)
    if hp.n_embd % hp.n_head:
        refuse(f"n_embd={hp.n_embd} must be a multiple of n_head={hp.n_head}")
    return hp


def project_sources():
    """{relpath: bytes} of this script and every project module it imported (not installed packages)."""
    sources = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not isinstance(file, str) or not os.path.isabs(file):  # builtins and synthetic modules have no file
            continue
        path = Path(file).resolve()
        in_project = path.is_relative_to(REPO_ROOT) and "site-packages" not in path.parts
        if in_project and path.suffix == ".py" and path.is_file():
            sources[path.relative_to(REPO_ROOT).as_posix()] = path.read_bytes()
    return dict(sorted(sources.items()))


def git_commit():
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "none"
    return out.stdout.strip()


def package_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def environment():
    """The log's environment section: software versions, machine, command, commit, start time."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "cuda": torch.version.cuda or "none",
        "gpu": "none",
        "world_size": 1,
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "bf16_gemm": bf16_gemm_path(torch.device("cpu")),
        "command": shlex.join([sys.executable] + sys.argv),
        "git_commit": git_commit(),
        "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }


class RunLog:
    """This run's log (records/logfile.py's LogWriter): the snapshot at creation, then each run
    line appended and echoed as it happens; `step` is where the run is, for an interrupted run."""

    def __init__(self, path, run_id, sources, environment, data_fingerprints, config):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.writer = LogWriter(path, run_id)
        self.writer.header(sources.items(), environment, data_fingerprints, config)
        self.step = 0

    def line(self, text):
        """Append one run line to the log and echo it."""
        print(text, flush=True)
        self.writer.line(text)

    def close(self):
        self.writer.close()


def train(hp, batches, val_inputs, val_targets, log):
    """Train for hp.num_iterations steps; return (final val loss, train time in ms)."""
    torch.manual_seed(hp.seed)
    model = GPT(hp.vocab_size, hp.block_size, hp.n_layer, hp.n_head, hp.n_embd, hp.init_std)
    optimizer = make_optimizer(model, hp)
    log.line(f"parameters: {sum(p.numel() for p in model.parameters())}")
    total, train_ms = hp.num_iterations, 0.0

    def timing(step):
        return f"train_time:{round(train_ms)}ms step_avg:{train_ms / max(step, 1):.2f}ms"

    for step in range(total):
        log.step = step
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, hp)
        x, y = batches.next_batch()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_loss = loss.item()
        train_ms += 1000.0 * (time.perf_counter() - start)
        log.line(f"step:{step + 1}/{total} train_loss:{train_loss:.4f} {timing(step + 1)}")
        if not math.isfinite(train_loss):
            raise FloatingPointError(f"train loss is {train_loss} at step {step + 1}")
        if hp.val_every and (step + 1) % hp.val_every == 0 and step + 1 < total:
            val_loss = evaluate(model, val_inputs, val_targets, hp.batch_size)
            log.line(f"step:{step + 1}/{total} val_loss:{val_loss:.4f} {timing(step + 1)}")
    if batches.epoch:
        log.line(f"train stream wrapped {batches.epoch} time(s)")
    val_loss = evaluate(model, val_inputs, val_targets, hp.batch_size)
    log.line(f"step:{total}/{total} val_loss:{val_loss:.4f} {timing(total)}")
    return val_loss, train_ms


def main(argv=None):
    hp = parse_hyperparameters(argv)
    torch.set_num_threads(hp.threads or os.cpu_count())
    keep_freed_memory_for_reuse()
    try:
        train_paths = find_shards(hp.train_files, hint=BUILD_CORPUS)
        val_paths = find_shards(hp.val_files, hint=BUILD_CORPUS)
        if len(val_paths) != 1:
            raise ShardError(f"{hp.val_files}: matches {len(val_paths)} files, expected exactly one val shard")
        train_tokens = np.concatenate([read_shard(p) for p in train_paths])
        batches = SequentialBlocks(train_tokens, hp.batch_size, hp.block_size)
        val_inputs, val_targets = load_val_blocks(val_paths[0], hp.val_tokens, hp.block_size)
        data = [fingerprint(p) for p in train_paths + val_paths]
    except (ShardError, ValueError) as e:
        sys.exit(f"error: {e}")
    run_id = new_run_id()
    config = dataclasses.asdict(hp) | {"entry": Path(__file__).resolve().relative_to(REPO_ROOT).as_posix()}
    log_path = Path(hp.log_dir) / f"{run_id}.txt"
    try:
        log = RunLog(log_path, run_id, project_sources(), environment(), data, config)
    except OSError as e:
        sys.exit(f"error: cannot create the log {log_path}: {e.strerror}")
    try:
        with bf16_gemms(bf16_gemm_path(torch.device("cpu"))):
            val_loss, train_ms = train(hp, batches, val_inputs, val_targets, log)
    except KeyboardInterrupt:
        log.line(f"{INTERRUPTED_PREFIX}SIGINT at step {log.step}/{hp.num_iterations}")
        log.close()
        print(f"interrupted at step {log.step} (log: {log.path})", file=sys.stderr)
        sys.exit(130)
    except LogWriteError as e:
        sys.exit(f"error: {e}")
    except FloatingPointError as e:
        log.line(f"{ERROR_PREFIX}{e}")
        log.close()
        sys.exit(f"error: {e} (log: {log.path})")
    except BaseException as e:  # the log must say why the run has no final line
        log.line(f"{ERROR_PREFIX}{type(e).__name__}: {e}")
        log.close()
        raise
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / KIB_PER_MIB
    log.line(
        f"final val_loss:{val_loss:.4f} train_time:{round(train_ms)}ms "
        f"steps:{hp.num_iterations} peak_memory:{peak_mib:.0f}MiB"
    )
    log.close()


if __name__ == "__main__":
    main()
