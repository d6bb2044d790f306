"""The optimization preset trains: its model at a tiny width, its single stage at a tiny batch, on
the CPU, with its optimizers and schedule (untied head from step 0, momentum 0.95 from the first
step, the LR to 0 at the end), and its unremovable bigram table stays at its zero init."""
import math
import os

import numpy as np
from safetensors.numpy import load_file

from data.shards import write_shard
from records.logfile import parse_log
from tiny_runs import run_trainer, synthetic_documents

SMALL = ["--num_layers=2", "--model_dim=64", "--num_heads=2", "--qk_ortho_heads=2", "--head_dim=32",
         "--mlp_hidden=256",
         '--stages=[{"end":1.0,"tokens_per_rank":512,"max_doc_len":128,"short_window":1,"long_window":1}]',
         "--val_long_window=1", "--batch_ranks=1", "--val_tokens=1024", "--val_tokens_per_rank=512",
         "--val_every=2", "--num_iterations=4", "--log_every=1", "--device=cpu", "--compile=false",
         "--compute_dtype=float32"]  # the preset's shape and batch made small enough for a CPU test


def test_the_optimization_preset_trains_with_its_bigram_table_at_zero(tmp_path):
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "o_train_000001.bin", synthetic_documents(rng, 20_000))
    write_shard(tmp_path / "o_val_000000.bin", synthetic_documents(rng, 4_000))
    res = run_trainer(["--preset", "optimization", *SMALL, f"--train_files={tmp_path}/o_train_*.bin",
                       f"--val_files={tmp_path}/o_val_*.bin", f"--log_dir={tmp_path}/logs",
                       "--save_checkpoint=true"])
    assert res.returncode == 0, res.stderr
    [log] = [p for p in os.listdir(tmp_path / "logs") if p.endswith(".txt")]
    run = parse_log(tmp_path / "logs" / log)
    assert (run.config["preset"], run.config["track"], run.config["optimizer"]) == (
        "optimization", "track_3_optimization", "muon")
    assert run.finished and math.isfinite(run.final["val_loss"]) and run.final["val_loss"] < math.log(50_304)
    assert [step for step, _, _ in run.val_points] == [2, 4], "validates every val_every steps and at the end"
    [checkpoint] = [p for p in os.listdir(tmp_path / "logs") if p.endswith(".safetensors")]
    weights = load_file(str(tmp_path / "logs" / checkpoint))
    assert not weights["bigram.weight"].any(), "value_embed_lr 0 keeps the bigram table at its zero init"
    assert weights["lm_head"].any(), "the head is untied from step 0, starting as the embedding's copy"
