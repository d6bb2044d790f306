"""What the model and trainer tests share: a tiny config with every feature's switch, synthetic
documents with learnable structure, and ways to run the trainer on a CPU (in this process, or as
the train_gpt.py / evaluation/evaluate.py commands in processes that see no GPU)."""
import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/helpers/ -> the repository
sys.path.insert(0, REPO)

from launch import cpu_env, run_distributed  # noqa: E402

import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.shards import write_shard  # noqa: E402
from data.tokenizer import BOS_ID  # noqa: E402

# A model small enough for a CPU test: every feature on, tiny widths.
TINY = [
    "--num_layers=3", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--mlp_hidden=128",
    "--long_window_layers=[2]", "--attention_free_layers=[1]", "--num_value_embeds=1", "--narrow_qk_layers=[]",
    "--bigram_rows=1024", "--ngram_rows=0", "--val_long_window=4", "--batch_ranks=1",
    '--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2,'
    '"mtp_weights":[1,0.5,0.25],"prefix_weight":0.25,"candidates":2048},'
    '{"end":1.0,"tokens_per_rank":512,"max_doc_len":512,"short_window":1,"long_window":3,'
    '"mtp_weights":[1],"prefix_weight":0}]',
    "--val_tokens=2048", "--val_tokens_per_rank=1024", "--log_every=1", "--momentum_warmup_steps=4",
    "--compute_dtype=bfloat16",    # the GPU's autocast (the cpu preset computes in fp32 on CPUs without bf16 units)
    # these tests' model and optimizers, whatever the cpu preset's record chose since
    "--value_embed_sparse=false", "--optimizer=anvil", "--num_iterations=27", "--warm_up=auto",
]


def synthetic_documents(rng, num_tokens, vocab=3000):
    """A BOS-separated stream of documents with learnable structure (arithmetic sequences)."""
    out, total = [], 0
    while total < num_tokens:
        length = int(rng.integers(5, 400))
        doc = (rng.integers(0, vocab) + 7 * np.arange(length)) % vocab
        out.append(np.concatenate([[BOS_ID], doc]))
        total += length + 1
    return np.concatenate(out)[:num_tokens]


def data_args(shards):
    return [f"--train_files={shards}/t_train_*.bin", f"--val_files={shards}/t_val_*.bin"]


def tiny_config(extra=()):
    return tg.parse_config(["--preset", "cpu", *TINY, *extra])


def tiny_model(h, seed=0):
    torch.manual_seed(seed)
    model = tg.build_model(h, tg.KernelFns(kernels.attention_reference, kernels.softcap_cross_entropy_reference))
    return with_every_sublayer_on(model)


@torch.no_grad()
def with_every_sublayer_on(model):
    """The model with its zero-initialized weights made random (zeros hide leaks, and keep early
    gradients from reaching some weights), but the gradient sinks, which only collect gradients."""
    sinks = model.gradient_sinks()
    for p in model.parameters():
        if p.abs().sum() == 0 and all(p is not sink for sink in sinks):
            p.normal_(0, 0.05) if p.ndim >= 2 else p.fill_(0.5)
    if model.ngram is not None:
        model.ngram.table.normal_(0, 0.05)
    return model


FEATURES = ["--smear_gate=true", "--key_offset=true", "--xsa_layers=[2]",  # the model features off by default
            "--paired_head_layers=[0]", "--num_value_embeds=0", "--value_embed_layers=[0,2]",
            "--value_embed_gate_reads_value=true", "--narrow_qk_layers=[0]", "--narrow_qk_dim=16",
            "--narrow_vo_layers=[2]", "--narrow_vo_dim=16", "--parallel_mlp_layers=[1]", "--token_gates=true",
            "--token_gates_split=2", "--attn_gate_layers=[0]", "--composed_layers=[2]", "--composed_window=24"]


DENSE = ["--trunk=dense", "--token_gates=true", "--token_gates_split=1", "--skip_layers=[0,1]",  # record 89's trunk
         "--snapshot_layer=1", "--xsa_layers=[0]", "--attn_gate_layers=[2]", "--key_offset=true"]


NGRAM = ["--ngram_rows=2048", "--smear_gate=true"]   # the hashed bigram+trigram table instead of the bigram


SPARSE_VALUES = ["--value_embed_sparse=true", "--value_embed_lr=0.05"]  # value embeddings trained as the table is


def uses_checkpoint(argv):
    """Whether argv is evaluation/evaluate.py's: --eval=PATH or --sample=PATH."""
    return any(a.startswith(("--eval", "--sample")) for a in argv)


def run_trainer(args, nproc=1, env_extra=None, timeout=300):
    """train_gpt.py (evaluation/evaluate.py for --eval=PATH or --sample=PATH) in nproc processes that see no
    GPU (the runs of a CPU-only machine)."""
    env = cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env_extra or {}))
    script = os.path.join(REPO, "evaluation/evaluate.py" if uses_checkpoint(args) else "train_gpt.py")
    if nproc > 1:
        return run_distributed(nproc, [script, *args], env=env, timeout=timeout)
    cmd = [sys.executable, script, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


def write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


def final_line(log_path):
    lines = open(log_path, encoding="utf-8").read().splitlines()
    return next(line for line in reversed(lines) if line.startswith("final "))


def cpu_trainer(h, fp8=False):
    """A Trainer on the CPU; with fp8 its MLPs, QKV projections and head run the FP8 references
    (the emulation of fp8_on_cpu, the A/B twin of the Triton kernels)."""
    if fp8:
        h = dataclasses.replace(h, fp8_on_cpu=True)
    return tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog("unused", active=False))


def pending(param):
    """Whether param holds a gradient not yet used by an update (a replayed step zeroes its
    gradients in place instead of freeing them)."""
    return param.grad is not None and bool(param.grad.any())


def write_tiny_shards(d):
    """Two train shards and a val shard of synthetic documents in folder d (what data_args reads)."""
    rng = np.random.default_rng(0)
    write_shard(d / "t_train_000001.bin", synthetic_documents(rng, 40_000))
    write_shard(d / "t_train_000002.bin", synthetic_documents(rng, 30_000))
    write_shard(d / "t_val_000000.bin", synthetic_documents(rng, 8_000))
    return d
