"""The trainer: loader alignment, presets, schedules and optimizer groups, end-to-end runs, the
schedule state across steps (untie, FP8 scales, validation), compute dtypes and compiling on a CPU."""
import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from cuda_graph_emulation import CPUCapture, CPUGraph  # noqa: E402
from launch import cpu_env  # noqa: E402
from tiny_runs import (DENSE, FEATURES, NGRAM, TINY, cpu_trainer, data_args, final_line, pending,  # noqa: E402
                       run_trainer, synthetic_documents, tiny_config, tiny_model, write_json)

import kernels  # noqa: E402
import optim  # noqa: E402
import train_gpt as tg  # noqa: E402
from machinery import sampled_softmax  # noqa: E402
from machinery.processes import TrainingError  # noqa: E402
from machinery.warm_up import compiled_graphs, restore, snapshot, warm_up  # noqa: E402
from data.loader import DataError, TrainLoader, _targets, validation_slices  # noqa: E402
from data.shards import read_shard, write_shard  # noqa: E402
from data.tokenizer import BOS_ID  # noqa: E402
from records.logfile import parse_log, verify  # noqa: E402
from machinery.config import ConfigError  # noqa: E402

# ---------------------------------------------------------------------------------------------
# data loader


def test_loader_slices_are_bos_aligned_documents(shards):
    files = tg.shards_of(f"{shards}/t_train_*.bin")
    stream = np.concatenate([np.asarray(read_shard(f)) for f in files])
    loader = TrainLoader(files, 512)
    T, max_doc = 512, 100
    for _ in range(20):
        for s in loader.next_batch(T, max_doc, 2, [0, 1]):
            tokens, targets, cu = s.tokens.numpy(), s.targets.numpy(), s.cu_seqlens.numpy()
            assert tokens.shape == (T,) and targets.shape == (T, tg.MAX_TARGETS - 1)
            assert cu[0] == 0 and cu[-1] == T and np.all(np.diff(cu) >= 0)
            lengths = np.diff(cu)
            starts = cu[:-1][lengths > 0]
            assert np.all(tokens[starts] == BOS_ID), "every document starts with BOS"
            assert lengths.max() <= max_doc
            for a, b in zip(cu[:-1], cu[1:]):
                assert not np.any(tokens[a + 1:b] == BOS_ID), "a BOS inside a document"
            # each document is a verbatim window of the stream, and its targets are the next tokens
            a, b = starts[0], cu[np.searchsorted(cu, starts[0], side="right")]
            hits = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(stream, b - a) == tokens[a:b], 1))
            assert hits.size >= 1
            p = hits[0]
            nxt = stream[p + 1:p + 1 + (b - a)]
            assert np.array_equal(targets[a:b, 0][:len(nxt)], nxt[:b - a])


def test_loader_targets_stop_at_document_end():
    stream = np.array([BOS_ID, 1, 2, 3, BOS_ID, 4, 5, BOS_ID, 6], dtype=np.uint16)
    t = _targets(stream, [0], [4], [4], 3)
    # last token of the document predicts the next BOS; further targets are beyond the document
    assert t.tolist() == [[1, 2, 3], [2, 3, BOS_ID], [3, BOS_ID, -1], [BOS_ID, -1, -1]]


def test_rank_slices_match_the_full_batch(shards):
    files = tg.shards_of(f"{shards}/t_train_*.bin")
    full = [TrainLoader(files, 256).next_batch(256, 64, 4, [0, 1, 2, 3]) for _ in range(1)][0]
    odd = TrainLoader(files, 256).next_batch(256, 64, 4, [1, 3])
    for a, b in zip([full[1], full[3]], odd):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.targets, b.targets)


def test_too_small_or_corrupt_data_is_refused(tmp_path):
    write_shard(tmp_path / "small.bin", np.array([BOS_ID, 1, 2, 3]))
    with pytest.raises(DataError, match="fewer than one global batch"):
        TrainLoader([str(tmp_path / "small.bin")], 512)
    write_shard(tmp_path / "nobos.bin", np.arange(1000) % 500)
    with pytest.raises(DataError, match="no <\\|endoftext\\|>"):
        TrainLoader([str(tmp_path / "nobos.bin")], 100).next_batch(100, 50, 1, [0])


def test_validation_reads_the_leading_tokens_across_files(tmp_path):
    """Slices are consecutive windows of the val stream, which may span files; too few tokens in
    all of them is refused."""
    stream = synthetic_documents(np.random.default_rng(1), 3_000)
    files = [str(tmp_path / "v_000000.bin"), str(tmp_path / "v_000001.bin"), str(tmp_path / "v_000002.bin")]
    for f, part in zip(files, np.split(stream, [700, 2_000])):
        write_shard(f, part)
    T = 256
    slices = validation_slices(files, 4 * T, T, 4, [0, 1, 2, 3])
    for i, s in enumerate(slices):
        assert np.array_equal(s.tokens.numpy(), stream[i * T:(i + 1) * T])
        inside = s.targets[:, 0] >= 0             # targets of the tokens whose document continues
        assert np.array_equal(s.targets[:, 0][inside].numpy(), stream[i * T + 1:(i + 1) * T + 1][inside.numpy()])
    with pytest.raises(DataError, match="hold 3000 tokens but val_tokens=3000"):
        validation_slices(files, 3_000, 1_000, 3, [0])


# ---------------------------------------------------------------------------------------------
# presets, schedules and optimizer groups


def test_multi_token_weights_move_linearly_within_a_stage():
    stages = ('--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2,'
              '"mtp_weights":[1,0.5,0.25],"mtp_weights_end":[1,0.5,0],"prefix_weight":0.25},'
              '{"end":1.0,"tokens_per_rank":512,"max_doc_len":512,"short_window":1,"long_window":3,'
              '"mtp_weights":[1,0.5]}]')
    h = tiny_config([stages, "--num_iterations=8"])
    weights = tg.step_target_weights(h, "cpu")
    assert weights.shape == (8, tg.MAX_TARGETS)
    for step in range(4):                # stage 0: steps 0-3, the t+3 weight from 0.25 toward 0
        assert weights[step].tolist() == pytest.approx([1, 0.5, 0.25 * (1 - step / 4), 0.25])
    for step in range(4, 8):             # stage 1: constant, no prefix target
        assert weights[step].tolist() == [1, 0.5, 0, 0]
    with pytest.raises(ConfigError, match="mtp_weights_end"):
        tiny_config([stages.replace('"mtp_weights_end":[1,0.5,0]', '"mtp_weights_end":[1,0]')])


def test_record89_preset_takes_its_schedule():
    h = tg.parse_config(["--preset", "record89"])
    assert h.num_iterations == 1285 and tg.steps_per_stage(h) == [423, 424, 423, 15]
    assert tg.untie_step(h) == 848, "record 89 unties after step 847's update"
    assert (h.num_layers, h.attention_free_layers, h.xsa_layers, h.attn_gate_layers) == (11, (6,), (1, 3, 4, 7), (3, 10))
    assert (h.trunk, h.skip_layers, h.snapshot_layer, h.composed_layers) == ("dense", (3, 6), 7, (10,))
    assert (h.optimizer, h.orthogonalize, h.bigram_rows, h.canonical_mask) == ("normuon", "polar_express", 377_280,
                                                                             False)
    lr = [tg.lr_multiplier(h, s) for s in (507, 508, 1270, 1284)]
    assert lr == pytest.approx([1.52, 1.52, 0.15, 0.15])
    assert tg.lr_multiplier(h, 1269) == pytest.approx(1.73 + (0.15 - 1.73) * 761 / 762)
    assert [tg.matrix_momentum(h, s) for s in (0, 300, 1235, 1284)] == pytest.approx([0.85, 0.95, 0.95, 0.85 + 0.1 / 50])
    weights = tg.step_target_weights(h, "cpu")
    assert weights[423].tolist() == [1.0, 0.5, 0.0, 0.25] and weights[846, -1] == pytest.approx(0.25 / 424)


@pytest.mark.parametrize("optimizer", ["anvil", "muon", "normuon", "adamw"])
def test_optimizer_groups_cover_every_parameter_once(optimizer):
    for features in (FEATURES, DENSE):
        h = tiny_config([f"--optimizer={optimizer}", *features])
        model = tiny_model(h)
        opts = tg.build_optimizers(h, model, tg.select_kernels(h, torch.device("cpu")))
        seen = [id(p) for opt in opts for g in opt.param_groups for p in g["params"]]
        assert sorted(seen) == sorted(id(p) for p in model.parameters())
    assert h.orthogonalize == ("anvil" if optimizer == "anvil" else "polar_express")


def test_adam_groups_take_their_own_lr_betas_and_decay():
    h = tiny_config(["--smear_gate=true", "--embed_lr=0.1", "--head_lr=0.2", "--value_embed_lr=0.3",
                     "--scalar_lr=0.4", "--gate_lr=0.5", "--smear_gate_lr=0.6", "--embed_betas=[0.5,0.95]",
                     "--value_embed_betas=[0.75,0.95]", "--scalar_betas=[0.9,0.99]", "--embed_wd=0.75",
                     "--value_embed_wd=0.025", "--pointer_mixture=true", "--pointer_lr=0.7"])
    model = tiny_model(h)
    adam = tg.build_optimizers(h, model, tg.select_kernels(h, torch.device("cpu")))[0]
    got = {g["name"]: (g["lr"], tuple(g["betas"]), g["weight_decay"], len(g["params"])) for g in adam.param_groups}
    tables = 1 + len(model.value_embeds)                          # the bigram table and the value embeddings
    gates = sum(b.attn is not None and b.attn.ve_gate is not None for b in model.blocks)
    assert got == {"embed": (0.1, (0.5, 0.95), 0.75, 1), "lm_head": (0.2, (0.5, 0.95), 0.75, 1),
                   "value_embeds": (0.3, (0.75, 0.95), 0.025, tables),
                   "scalars": (0.4, (0.9, 0.99), 0.0, sum(p.ndim < 2 for p in model.parameters())),
                   "gates": (0.5, (0.9, 0.99), 0.0, gates), "smear_gate": (0.6, (0.9, 0.99), 0.0, 1),
                   "pointer": (0.7, (0.9, 0.99), 0.0, 2)}                # the pointer's query and key projections


def test_dense_trunk_adam_groups_split_the_scales_and_decay_the_gate_weights():
    """The dense trunk's residual and output scales in groups of their own (the records' resid and
    post lambdas), the value-embedding gates decayed by gate_wd, and the token-gate and dense-
    connection MLPs' weight matrices by gate_mlp_wd while their biases and scale are not."""
    h = tiny_config([*DENSE, "--num_value_embeds=0", "--value_embed_layers=[0,2]", "--resid_scale_lr=0.04",
                     "--post_scale_lr=0.008", "--scale_betas=[0.9,0.95]", "--gate_wd=0.005", "--gate_mlp_wd=0.007"])
    model = tiny_model(h)
    adam = tg.build_optimizers(h, model, tg.select_kernels(h, torch.device("cpu")))[0]
    got = {g["name"]: g for g in adam.param_groups}
    scaled = [b for b in model.blocks if hasattr(b, "resid_scales")]
    assert [p for p in got["resid_scales"]["params"]] == [b.resid_scales for b in scaled]
    assert [p for p in got["post_scales"]["params"]] == [b.post_scales for b in scaled]
    assert (got["resid_scales"]["lr"], got["post_scales"]["lr"], got["post_scales"]["betas"]) == (0.04, 0.008, (0.9, 0.95))
    assert all(p is not b.resid_scales for p in got["scalars"]["params"] for b in scaled)
    assert got["gates"]["weight_decay"] == 0.005 and got["gates"]["params"]
    for name in ("token_gates", "dense"):
        weights, rest = got[f"{name}_weights"], got[name]
        assert weights["weight_decay"] == 0.007 and all(p.ndim == 2 for p in weights["params"]) and weights["params"]
        assert rest["weight_decay"] == 0.0 and all(p.ndim < 2 for p in rest["params"]) and rest["params"]


def test_the_fp8_layers_take_the_scale_rules_their_keys_name():
    """fp8_qkv_scales and fp8_head_scales pick the QKV projection's and the head's rules: record
    92's static QKV input 8/448 and gradient 1/448, head weight 2/448 and gradient 0.75/8/448."""
    h = tiny_config(["--fp8_on_cpu=true", "--fp8_qkv_scales=record92", "--fp8_head_scales=record92"])
    fns = tg.select_kernels(h, torch.device("cpu"))
    qkv, head = fns.fp8_qkv.keywords["scales"], fns.fp8_head.keywords["scales"]
    assert (qkv.input.scale, qkv.weight, qkv.grad_output.scale) == (8 / 448, kernels.EXACT, 1 / 448)
    assert (head.input.scale, head.weight.scale, head.grad_output.scale) == (100 / 448, 2 / 448, 0.75 / 8 / 448)
    h = tiny_config(["--fp8_on_cpu=true", "--fp8_qkv_scales=project", "--fp8_head_scales=record89"])
    fns = tg.select_kernels(h, torch.device("cpu"))
    assert (fns.fp8_qkv.keywords["scales"], fns.fp8_head.keywords["scales"]) == (kernels.QKV_SCALES, kernels.HEAD_SCALES)


def test_qkv_is_orthogonalized_as_query_and_key_blocks_of_heads_and_one_value_block():
    h = tiny_config(["--num_heads=4", "--head_dim=32", "--qk_ortho_heads=2"])
    assert tg.qkv_row_splits(h) == (64, 64, 64, 64, 128)
    model = tiny_model(h)
    muon = tg.build_optimizers(h, model, tg.select_kernels(h, torch.device("cpu")))[1]
    qkv = next(g for g in muon.param_groups if g["name"] == "qkv")
    assert qkv["row_splits"] == (64, 64, 64, 64, 128) and len(qkv["params"]) == sum(b.attn is not None for b in model.blocks)
    assert tg.qkv_row_splits(tiny_config(["--qk_ortho_heads=0"])) is None


def test_lr_cools_from_the_stage_multiplier_to_the_floor():
    """As the records schedule it: the stage's multiplier until the cooldown starts, then a
    straight line to the floor (not the multiplier times the floor) at cooldown_end."""
    stages = ('--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2},'
              '{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2,"lr_mult":2.0}]')
    h = tiny_config([stages, "--num_iterations=10", "--cooldown_start=0.6", "--cooldown_end=0.8",
                     "--cooldown_floor=0.3"])
    lrs = [tg.lr_multiplier(h, step) for step in range(10)]
    assert lrs == pytest.approx([1, 1, 1, 1, 1, 2, 2, 2 + (0.3 - 2) / 2, 0.3, 0.3])


def test_muon_momentum_warms_up_and_cools_down():
    h = tiny_config(["--num_iterations=100", "--momentum_warmup_steps=10", "--momentum_cooldown_steps=20",
                     "--momentum_warmup_start=0.85", "--momentum=0.95"])
    assert [tg.matrix_momentum(h, s) for s in (0, 5, 10, 80, 90, 99)] == pytest.approx(
        [0.85, 0.90, 0.95, 0.95, 0.90, 0.85 + 0.1 / 20])


def test_prefix_weight_moves_linearly_within_a_stage():
    stages = ('--stages=[{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2,'
              '"mtp_weights":[1,0.5],"prefix_weight":0.25,"prefix_weight_end":0}]')
    weights = tg.step_target_weights(tiny_config([stages, "--num_iterations=4"]), "cpu")
    assert weights[:, -1].tolist() == pytest.approx([0.25, 0.1875, 0.125, 0.0625])
    with pytest.raises(ConfigError, match="prefix_weight_end"):
        tiny_config([stages.replace('"prefix_weight_end":0', '"prefix_weight_end":-1')])


def test_prefix_weight_levels_step_in_equal_parts_of_a_stage():
    """prefix_weight_levels 4 over 10 steps: parts int(4 i / 10) = 0, 0, 0, 1, 1, 2, 2, 2, 3, 3
    holding 0.20, 0.15, 0.10, 0.05 (from prefix_weight to prefix_weight_end)."""
    stages = ('--stages=[{"end":1.0,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2,'
              '"mtp_weights":[1],"prefix_weight":0.2,"prefix_weight_end":0.05,"prefix_weight_levels":4}]')
    weights = tg.step_target_weights(tiny_config([stages, "--num_iterations=10"]), "cpu")
    assert weights[:, -1].tolist() == pytest.approx([0.2, 0.2, 0.2, 0.15, 0.15, 0.1, 0.1, 0.1, 0.05, 0.05])
    with pytest.raises(ConfigError, match="prefix_weight_levels"):
        tiny_config([stages.replace('"prefix_weight_levels":4', '"prefix_weight_levels":-1')])


def test_weight_averages_equal_a_hand_computed_ema():
    """A toy run of 10 steps whose weights are set by hand at every step: the shipped weights
    equal a float64 EMA of the sampled values (every 2nd step of the last 5: steps 5, 7, 9),
    blended as configured, applied in order, and renormalized to the norm before any blend."""
    averages = ('--averages=[{"params":"embed_head","window":4,"rate":0.5,"blend":0.25},'
                '{"params":"vo_mlp","window":5,"every":2,"rate":0.25},'
                '{"params":"vo_mlp","window":3,"rate":0.5,"blend":0.5,"renormalize":true}]')
    h = tiny_config([averages, "--num_iterations=10"])
    model = tiny_model(h)
    block = next(b for b in model.blocks if b.attn is not None)
    qk_rows = 2 * h.num_heads * h.head_dim
    gen = torch.Generator().manual_seed(3)
    values = {name: [torch.randn(w.shape, generator=gen, dtype=torch.float64) for _ in range(10)]
              for name, w in [("embed", model.embed.weight), ("v", block.attn.qkv[qk_rows:]),
                              ("qk", block.attn.qkv[:qk_rows])]}
    averages = optim.WeightAverages(h.averages, model, h.num_iterations)
    for step in range(10):
        model.embed.weight.data.copy_(values["embed"][step])
        block.attn.qkv.data[qk_rows:] = values["v"][step].float()
        block.attn.qkv.data[:qk_rows] = values["qk"][step].float()
        averages.sample(step)

    def ema(samples, rate):
        avg = samples[0]
        for x in samples[1:]:
            avg = avg + rate * (x - avg)
        return avg
    last = {name: v[-1].float().double() for name, v in values.items()}
    embed = last["embed"] + 0.25 * (ema([v.float().double() for v in values["embed"][6:]], 0.5) - last["embed"])
    v = ema([values["v"][i].float().double() for i in (5, 7, 9)], 0.25)          # replaced by the tail average
    v = v + 0.5 * (ema([x.float().double() for x in values["v"][7:]], 0.5) - v)
    v = v * (last["v"].norm() / v.norm())
    assert averages.ship() == 1 + 2 * sum(1 for _ in model.averaged_pieces("vo_mlp"))
    torch.testing.assert_close(model.embed.weight.double(), embed, rtol=0, atol=1e-5)
    torch.testing.assert_close(block.attn.qkv[qk_rows:].double(), v, rtol=0, atol=1e-5)
    assert torch.equal(block.attn.qkv[:qk_rows].double(), last["qk"]), "no average touches the queries and keys"
    assert model.tied, "a tied head is the embedding: nothing else is written"


def test_training_steps_lower_the_loss(shards):
    h = tiny_config(data_args(shards))
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(str(shards), active=False))
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    batch = loader.next_batch(512, 256, 1, [0])
    before = [p.detach().clone() for p in trainer.model.parameters()]
    losses = [trainer.train_step(0, batch)[1].item() for _ in range(8)]
    assert losses[-1] < losses[0] - 0.5, losses
    moved = sum(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    assert moved >= len(before) - 1, "every parameter but the still-tied lm_head moves"


# ---------------------------------------------------------------------------------------------
# end to end


E2E_AVERAGES = '--averages=[{"params":"embed_head","window":3,"rate":0.5},{"params":"qk","window":4,"every":2}]'


def test_end_to_end_run_writes_a_complete_log(shards, tmp_path):
    res = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=6",
                       f"--log_dir={tmp_path}", "--save_checkpoint=true", E2E_AVERAGES])
    assert res.returncode == 0, res.stderr
    logs = [p for p in os.listdir(tmp_path) if p.endswith(".txt")]
    assert len(logs) == 1 and os.path.exists(tmp_path / logs[0].replace(".txt", "_model.safetensors"))
    raw = open(tmp_path / logs[0], "rb").read()
    assert raw.startswith(b"speedrun-log v2 run_id=")
    for name in ("train_gpt.py", "kernels.py", "optim.py", "data/shards.py", "records/logfile.py"):
        content = open(os.path.join(REPO, name), "rb").read()
        header = f"=== source {name} sha256={hashlib.sha256(content).hexdigest()} bytes={len(content)} ===\n"
        at = raw.index(header.encode()) + len(header)
        assert raw[at:at + len(content)] == content
    log = parse_log(tmp_path / logs[0])
    verify(log)                    # every embedded source matches its sha256
    assert log.finished and log.config["num_iterations"] == 6 and log.config["track"] == "track_cpu"
    assert [p[0] for p in log.val_points] == [6]
    attention_layers = 3 - len(tiny_config().attention_free_layers)      # embedding, head (untied at 4), QK rows
    assert f"averages: {2 + attention_layers} blends into the weights" in raw.decode()
    assert tg.parse_config(["--config", str(write_json(tmp_path / "c.json", log.config))]) == \
        tg.parse_config(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=6",
                         f"--log_dir={tmp_path}", "--save_checkpoint=true", E2E_AVERAGES])


def test_two_processes_match_one_with_the_same_global_batch(shards, tmp_path):
    args = ["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=4", "--batch_ranks=2"]
    one = run_trainer([*args, f"--log_dir={tmp_path}/one"])
    two = run_trainer([*args, f"--log_dir={tmp_path}/two"], nproc=2)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    loss = [float(final_line(os.path.join(d, os.listdir(d)[0])).split()[1].split(":")[1])
            for d in (tmp_path / "one", tmp_path / "two")]
    # Same data, same math; only the order of float reductions can differ.
    assert abs(loss[0] - loss[1]) <= 1e-3, loss


def test_a_warm_up_on_a_cpu_changes_nothing_but_the_clock(shards, tmp_path):
    """--warm_up=always runs the untimed warm-up with nothing to compile (every stage shape, the
    untie, each validation, then the initial state restored): the run then trains exactly as
    without it, n-gram table included."""
    args = ["--preset", "cpu", *TINY, *data_args(shards), *NGRAM, "--num_iterations=4", "--untie_frac=0.5",
            "--warmup_steps=1"]
    finals = []
    for warm in ("auto", "always"):
        res = run_trainer([*args, f"--warm_up={warm}", f"--log_dir={tmp_path}/{warm}"])
        assert res.returncode == 0, res.stderr
        untimed = float(res.stdout.split("warm-up: ")[1].split("s untimed")[0])
        assert untimed > 0 if warm == "always" else untimed == 0
        finals.append(final_line(os.path.join(tmp_path, warm, os.listdir(tmp_path / warm)[0])).split()[1])
    assert finals[0] == finals[1]


def test_corrupt_shard_is_named(shards, tmp_path):
    bad = tmp_path / "bad_train_000001.bin"
    bad.write_bytes(open(f"{shards}/t_train_000001.bin", "rb").read()[:5000])
    res = run_trainer(["--preset", "cpu", *TINY, f"--train_files={tmp_path}/bad_train_*.bin",
                       f"--val_files={shards}/t_val_*.bin", "--num_iterations=2", f"--log_dir={tmp_path}"])
    assert res.returncode == 2 and "bad_train_000001.bin" in res.stderr and "Traceback" not in res.stderr


def test_fp8_mlp_path_matches_the_plain_mlp():
    """The FP8 MLP (reference kernels, the A/B twin of the Triton pair) against the bf16 one.

    e4m3 keeps 3 mantissa bits (relative rounding up to 2^-4 per operand) and gradients are e5m2
    (2^-3), so outputs and gradients agree in direction, not to many digits: cosine > 0.99.
    """
    torch.manual_seed(0)
    plain, fp8 = tg.MLP(64, 128), tg.MLP(64, 128, kernels.fp8_relu2_mlp_reference)
    with torch.no_grad():
        plain.down.normal_(0, 0.05)
        fp8.up.copy_(plain.up)
        fp8.down.copy_(plain.down)
    x = torch.randn(256, 64)
    grad_out = torch.randn(256, 64)
    for _ in range(2):             # the first call records the delayed activation and gradient scales
        (fp8(x.bfloat16()).float() * grad_out).sum().backward()
    fp8.zero_grad()
    y8, y = fp8(x.bfloat16()).float(), plain(x)
    cosine = torch.nn.functional.cosine_similarity
    assert cosine(y8.flatten(), y.flatten(), dim=0) > 0.99
    (y8 * grad_out).sum().backward()
    (y * grad_out).sum().backward()
    for a, b in ((fp8.up.grad, plain.up.grad), (fp8.down.grad, plain.down.grad)):
        assert torch.isfinite(a).all() and cosine(a.flatten(), b.flatten(), dim=0) > 0.99


@pytest.mark.parametrize("ce", [kernels.softcap_cross_entropy_reference, kernels.softcap_cross_entropy_chunked])
def test_cpu_cross_entropy_stays_fp32_under_autocast(ce):
    """Per-row losses and their sums must not be rounded to bf16 (val loss is a sum of 65k rows)."""
    torch.manual_seed(0)
    logits = torch.randn(4096, 512)
    targets = torch.randint(0, 512, (4096, 2))
    weights = torch.tensor([1.0, 0.5])
    exact = kernels.softcap_cross_entropy_reference(logits.double(), targets, weights.double())[0].sum()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        rows, _ = ce(logits, targets, weights)
    assert rows.dtype == torch.float32
    assert abs(rows.sum().item() - exact.item()) / exact.item() < 1e-6


def test_cpu_runs_use_the_chunked_cross_entropy_unless_references_are_asked_for():
    cpu = torch.device("cpu")
    assert tg.select_kernels(tg.parse_config(["--preset", "cpu"]), cpu).cross_entropy \
        is kernels.softcap_cross_entropy_chunked
    h = tg.parse_config(["--preset", "cpu", "--kernels=reference"])
    assert tg.select_kernels(h, cpu).cross_entropy is kernels.softcap_cross_entropy_reference


# ---------------------------------------------------------------------------------------------
# schedule state: untie, FP8 scales, validation


def fp8_states(model):
    return {name: state for name, state in model.named_buffers() if name.endswith("fp8_state")}


def test_adam_every_second_step_accumulates_in_between(shards):
    """With adam_step_every=2 the Adam parameters stay put on even steps while their gradients
    accumulate (optim's tests check the update from their mean); the matrices update every step."""
    h = tiny_config(data_args(shards) + ["--num_iterations=4", "--adam_step_every=2"])
    trainer = cpu_trainer(h)
    model = trainer.model
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    embed, matrix = model.embed.weight, model.blocks[0].mlp.down  # (up starts with no gradient: down is 0)
    start = (embed.detach().clone(), matrix.detach().clone())
    trainer.advance_to(0)
    trainer.train_step(0, loader.next_batch(512, 256, 1, [0]))
    assert torch.equal(embed, start[0]) and not torch.equal(matrix, start[1])
    assert pending(embed) and not pending(matrix), "the even step's embedding gradient waits"
    trainer.advance_to(1)
    trainer.train_step(1, loader.next_batch(512, 256, 1, [0]))
    assert not torch.equal(embed, start[0]) and not pending(embed)
    assert trainer.adam.state[embed]["step"] == 1 and trainer.adam.pending_calls == 0


def train_steps(trainer, h, steps, check=lambda step: None):
    """Losses of `steps` training steps from the start of h's data; check(step) after each."""
    loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
    losses = []
    for step in range(steps):
        trainer.advance_to(step)
        stage = h.stages[tg.stage_index(h, step)]
        losses.append(trainer.train_step(step, loader.next_batch(stage.tokens_per_rank, stage.max_doc_len,
                                                                 h.batch_ranks, trainer.mine)).tolist())
        check(step)
    return losses


def test_replayed_steps_train_exactly_as_plain_eager_steps(shards):
    """cuda_graphs on a CPU runs the replay path with eager bodies: input buffers at fixed
    addresses, one gradient tensor per parameter zeroed in place, attached per graph key. With
    and without a warm-up (steps of every key, then the initial state restored), across a stage
    change and the untie, with two micro-batches per step and Adam every second step (so a new
    key can start with gradients pending), losses and weights equal those of plain eager steps
    bit for bit."""
    args = data_args(shards) + ["--num_iterations=6", "--untie_frac=0.8", "--adam_step_every=2", "--batch_ranks=2",
                                "--warmup_steps=1"]
    runs = {}
    for graphs, warm in ((False, False), (True, True), (True, False)):
        h = tiny_config(args + [f"--cuda_graphs={graphs}"])
        trainer = cpu_trainer(h)
        model, seen = trainer.model, {}

        def check(step):
            if graphs:
                assert (model.lm_head.grad is None) == (step < tg.untie_step(h)), step
                seen.setdefault("embed", model.embed.weight.grad)
                assert model.embed.weight.grad is seen["embed"], "a replay keeps its gradient tensors"
        if warm:
            warm_up(tg, trainer, tg.shards_of(h.train_files),
                       tg.validation_data(h, trainer.pg, tg.shards_of(h.val_files)))
            assert sorted(trainer.graphs.steps) == [(0, True), (1, False), (1, True)]
            assert all(p.grad is None for p in model.parameters()), "the warm-up leaves no gradient behind"
        runs[graphs, warm] = train_steps(trainer, h, h.num_iterations, check), model.state_dict()
    eager_losses, eager_state = runs[False, False]
    for variant in ((True, True), (True, False)):
        losses, state = runs[variant]
        assert losses == eager_losses, variant
        for name, value in eager_state.items():
            assert torch.equal(state[name], value), (variant, name)


def dense_attention(q, k, v, cu_seqlens, window, softmax_scale):
    """kernels.attention_reference's definition in one masked product over all T tokens: no
    query block starts where a document does, so no shape or bound depends on the data (the
    reference reads document starts on the host, which a graph cannot replay; the GPU's Triton
    kernel does not)."""
    if isinstance(softmax_scale, torch.Tensor):
        q = (q.float() * softmax_scale.float().reshape(())).to(q.dtype)
        softmax_scale = 1.0
    doc = kernels.document_ids(cu_seqlens, q.shape[0])
    pos = torch.arange(q.shape[0])
    visible = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    if window > 0:
        visible &= pos[:, None] - pos[None, :] < window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=softmax_scale)
    return out.transpose(0, 1).to(q.dtype)


def cpu_graphs(monkeypatch, trainer, fail=None):
    """Give `trainer` CUDA graphs on the CPU: torch.cuda's graph API as CPUGraph and CPUCapture,
    its streams as no-ops. Returns the graphs made, in capture order."""
    graphs = []

    def new_graph():
        graphs.append(CPUGraph())
        return graphs[-1]
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", stream)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", new_graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, stream=None: CPUCapture(graph, pool, fail))
    trainer.graphs.capturing = True
    return graphs


# Two stages of different micro-batch sizes: each has its own loss unit (the objective's weight
# per token), which a captured step must read as the timed step sets it.
UNEQUAL_STAGES = "--stages=" + json.dumps([
    {"end": 0.5, "tokens_per_rank": 512, "max_doc_len": 256, "short_window": 1, "long_window": 2,
     "mtp_weights": [1, 0.5, 0.25], "prefix_weight": 0.25, "candidates": 2048},
    {"end": 1.0, "tokens_per_rank": 256, "max_doc_len": 256, "short_window": 1, "long_window": 3,
     "mtp_weights": [1], "prefix_weight": 0}], separators=(",", ":"))


@pytest.mark.parametrize("features,compile_updates", [([], False), (NGRAM, False), ([], True),
                                                      (["--document_copy=true"], False)],
                         ids=["hashed", "ngram", "compiled-updates", "document-copy"])
def test_the_warm_up_captures_every_key_and_the_run_replays_them(shards, monkeypatch, features, compile_updates):
    """Capture and replay with CUDA graph semantics on a CPU (CPUGraph): the warm-up captures
    each graph key's forward+backward once, each Muon bank's update and Adam's update (tied and
    untied); every timed micro-batch and optimizer update replays a graph (none runs eagerly),
    and the run's losses and weights still equal plain eager steps bit for bit, through a stage
    change, the untie (the head's Adam state copied in place), Adam every second step and the
    scheduled LR and momentum (device scalars refilled before each replay); with the n-gram
    table too (its entries taken from the sink after each replay); with the updates' math
    compiled (aot_eager: dynamo and AOTAutograd's functionalization, the same ops) as a
    compiling run does, one graph per captured update, all in the warm-up. A capture that fails
    ends in one line saying how to run without graphs."""
    args = data_args(shards) + features + ["--num_iterations=6", "--untie_frac=0.8", "--adam_step_every=2",
                                           "--batch_ranks=2", "--warmup_steps=1", UNEQUAL_STAGES]
    select = tg.select_kernels
    monkeypatch.setattr(tg, "select_kernels", lambda h, device: dataclasses.replace(select(h, device),
                                                                                    attention=dense_attention))
    h = tiny_config(args + ["--cuda_graphs=false"])
    eager = cpu_trainer(h)
    eager_losses = train_steps(eager, h, h.num_iterations)
    h = tiny_config(args + ["--cuda_graphs=true"])
    compiler = functools.partial(tg.compile_fn, dataclasses.replace(h, compile_backend="aot_eager"))
    if compile_updates:   # compiled math may round differently: the same compiled updates, not captured, are the reference
        reference = cpu_trainer(h)
        reference.graphs.compiler = compiler
        warm_up(tg, reference, tg.shards_of(h.train_files), tg.validation_data(h, reference.pg,
                                                                              tg.shards_of(h.val_files)))
        reference_losses = train_steps(reference, h, h.num_iterations)
        assert np.allclose(reference_losses, eager_losses, rtol=1e-4, atol=0)
        eager, eager_losses = reference, reference_losses
    trainer = cpu_trainer(h)
    if compile_updates:
        trainer.graphs.compiler = compiler
    graphs = cpu_graphs(monkeypatch, trainer)
    val = tg.validation_data(h, trainer.pg, tg.shards_of(h.val_files))
    compiled_before = compiled_graphs()
    warm_up(tg, trainer, tg.shards_of(h.train_files), val)
    updates = trainer.graphs.optimizer_graphs      # Muon's banks; Adam with the head tied and untied
    assert compiled_graphs() - compiled_before == (len(updates) if compile_updates else 0)
    assert {key[0] for key in updates} == {"muon", "adam"} and sum(key[0] == "adam" for key in updates) == 2
    assert trainer.graphs.captured() == 3 and len(graphs) == 3 + len(updates)
    assert all(len(g.ops) > 20 for g in graphs)
    # every training step is captured after every eager step (the optimizers' updates are captured
    # during them): no eager step runs beside the captured steps' memory
    assert set(graphs[-3:]) == {step.graph for step in trainer.graphs.steps.values()}
    eager_runs, replays = trainer.graphs.eager_runs, [g.replays for g in graphs]
    assert train_steps(trainer, h, h.num_iterations) == eager_losses
    replays = {g: g.replays - before for g, before in zip(graphs, replays)}
    assert sum(replays[step.graph] for step in trainer.graphs.steps.values()) == h.num_iterations * 2
    assert all(replays[g] == h.num_iterations for key, g in updates.items() if key[0] == "muon")
    assert sum(replays[g] for key, g in updates.items() if key[0] == "adam") == h.num_iterations // 2
    assert trainer.graphs.eager_runs == eager_runs, "every micro-batch and optimizer update replays"
    assert compiled_graphs() - compiled_before == (len(updates) if compile_updates else 0)
    for name, value in eager.model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    for eager_opt, opt in zip(eager.optimizers, trainer.optimizers):   # the state the graphs updated in place
        for p_eager, p in zip(eager.model.parameters(), trainer.model.parameters()):
            want, got = eager_opt.state.get(p_eager, {}), opt.state.get(p, {})
            assert want.keys() == got.keys()
            for key in want:
                pairs = zip(want[key], got[key]) if isinstance(want[key], list) else [(want[key], got[key])]
                assert all(torch.equal(a, b) if torch.is_tensor(a) else a == b for a, b in pairs), key

    trainer = cpu_trainer(h)
    cpu_graphs(monkeypatch, trainer, fail="operation not permitted when stream is capturing")
    with pytest.raises(TrainingError, match=r"capturing .* failed \(operation not permitted when stream is "
                                               r"capturing\): rerun with --cuda_graphs=false"):
        warm_up(tg, trainer, tg.shards_of(h.train_files), val)


def test_a_captured_step_reads_the_loss_unit_of_its_replay(shards, monkeypatch):
    """The loss unit (the cross-entropy's upstream gradient: it stores its logit gradient times
    it) is data on the device: a step captured under one unit and replayed under another makes
    the gradients of an eager step under the other, bit for bit."""
    h = tiny_config(data_args(shards) + ["--num_iterations=4"])
    batch = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])
    replayed = cpu_trainer(tiny_config(data_args(shards) + ["--num_iterations=4", "--cuda_graphs=true"]))
    graphs = cpu_graphs(monkeypatch, replayed)
    replayed.forward_backward(0, batch)            # the key's first run, then its capture under 1/512
    replayed.capture_graph(0)
    replayed.zero_grads()
    eager = cpu_trainer(h)
    for trainer in (replayed, eager):
        monkeypatch.setattr(trainer, "loss_unit", lambda stage: 1 / 2048)
        trainer.forward_backward(0, batch)
    assert graphs[0].replays == 1
    for (name, p), q in zip(eager.model.named_parameters(), replayed.model.parameters()):
        assert (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad)), name


def test_the_first_step_after_the_warm_up_has_its_stages_fp8_loss_unit(shards):
    """The warm-up leaves the model at its last graph key's loss unit and then restores the FP8
    states it saved before (with their loss unit); the first step (here the FP8 calibration)
    writes its stage's unit into every FP8 state again, also when it equals the last key's
    (both stages' micro-batches have 512 tokens)."""
    h = tiny_config(data_args(shards) + ["--num_iterations=4", "--warm_up=always", "--warmup_steps=1"])
    trainer = cpu_trainer(h, fp8=True)
    files = tg.shards_of(h.train_files)
    warm_up(tg, trainer, files, tg.validation_data(h, trainer.pg, tg.shards_of(h.val_files)))
    trainer.calibrate_fp8(tg.first_batch(h, files, trainer.mine))
    states = fp8_states(trainer.model)
    assert len(states) > 3 and all(state[-1] == 1 / 512 for state in states.values())


def test_untie_carries_the_embeddings_adam_state_to_the_head(shards):
    """After the untie the head's optimizer state equals the embedding's, so its first update
    continues the embedding's. From fresh moments it would be a sign step: bias-corrected Adam
    moves every entry with a nonzero gradient (all of them: the softmax reaches every row) by
    exactly lr. With the carried state only entries whose whole history is one gradient do."""
    h = tiny_config(data_args(shards) + ["--num_iterations=4", "--untie_frac=0.5", "--stages=[" + json.dumps(
        {"end": 1.0, "tokens_per_rank": 512, "max_doc_len": 256, "short_window": 1, "long_window": 2}) + "]"])
    trainer = cpu_trainer(h)
    model = trainer.model
    batch = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])
    for step in range(2):
        trainer.advance_to(step)
        trainer.train_step(step, batch)
    trainer.advance_to(2)
    assert not model.tied and torch.equal(model.lm_head, model.embed.weight)
    embed_state, head_state = trainer.adam.state[model.embed.weight], trainer.adam.state[model.lm_head]
    assert head_state["step"] == embed_state["step"] == 2
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(head_state[key], embed_state[key]) and head_state[key] is not embed_state[key]
    before = model.lm_head.detach().clone()
    trainer.train_step(2, batch)
    lr = trainer.adam.param_groups[1]["lr"]
    moved = (model.lm_head.detach() - before).abs()
    sign_steps = ((moved - lr).abs() <= 1e-3 * lr).float().mean().item()
    assert sign_steps < 0.1, f"{sign_steps:.0%} of the head's entries moved by exactly lr"
    trainer.advance_to(0)
    assert model.tied


def test_validation_runs_without_fp8_and_leaves_its_state_alone(shards):
    h = tiny_config(data_args(shards))
    trainer = cpu_trainer(h, fp8=True)
    batch = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])
    trainer.train_step(0, batch)
    states = {name: state.clone() for name, state in fp8_states(trainer.model).items()}
    # every MLP and attention layer, and the head
    assert len(states) == h.num_layers + h.num_layers - len(h.attention_free_layers) + 1
    calls = -1 - kernels.FP8_SLOT_STRIDE     # the entry before the loss unit
    assert all(state[:calls].abs().sum() > 0 and state[calls] == 1 for state in states.values())
    val = validation_slices(tg.shards_of(h.val_files), 1024, 1024, 1, [0])
    loss = trainer.validate(val, 0, final_validation=True)
    assert math.isfinite(loss)
    assert all(torch.equal(fp8_states(trainer.model)[name], state) for name, state in states.items())


def test_first_fp8_step_gradients_match_bf16_after_calibration(shards):
    """The first step's FP8 gradients point where the bf16 ones do, after calibration: the MLP
    output matrices' (the matrices that are nonzero at init) and the embedding's (which is the
    head until the untie, so it sees the FP8 head's gradient)."""
    h = tiny_config(data_args(shards))
    batch = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])
    plain = cpu_trainer(h)
    plain.forward_backward(0, batch)
    fp8 = cpu_trainer(h, fp8=True)
    fp8.calibrate_fp8(batch)
    assert all(p.grad is None for p in fp8.model.parameters())
    fp8.forward_backward(0, batch)
    cosine = torch.nn.functional.cosine_similarity
    for a, b in zip(fp8.model.blocks, plain.model.blocks):
        assert cosine(a.mlp.down.grad.flatten(), b.mlp.down.grad.flatten(), dim=0) > 0.99
    assert cosine(fp8.model.embed.weight.grad.flatten(), plain.model.embed.weight.grad.flatten(), dim=0) > 0.99


def test_fp8_static_scales_hold_the_tensors_they_meet(shards):
    """Over two steps the operands with static scales stay inside the range those scales
    represent (no saturation): rms-normed inputs within 448 x 1/16 = 28 (MLP, QKV) and 100
    (head), head weights within 1.6, output gradients within the summed loss's range times the
    loss unit the trainer set (1 / tokens of the micro-batch)."""
    h = tiny_config(data_args(shards))
    trainer = cpu_trainer(h, fp8=True)
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    for step in range(2):
        trainer.advance_to(step)
        trainer.train_step(step, loader.next_batch(512, 256, 1, [0]))
        for name, state in fp8_states(trainer.model).items():
            mlp = state.numel() == kernels.fp8_state_size(kernels.FP8_MLP_SLOTS)
            slots = kernels.FP8_MLP_SLOTS if mlp else kernels.FP8_LINEAR_SLOTS
            scales = (kernels.MLP_SCALES[h.fp8_mlp_scales] if mlp else
                      kernels.HEAD_SCALES if name == "head_fp8_state" else kernels.QKV_SCALES)
            assert state[slots["loss_unit"]] == 1 / 512 and state[slots["calls"]] == step + 1
            for operand, rule in vars(scales).items():
                if isinstance(rule, kernels.Static):
                    gradient = operand.startswith("grad")
                    limit = rule.scale * (57344.0 / 512 if gradient else 448.0)
                    assert 0 < state[slots[operand]] <= limit, f"{name} {operand}: {state[slots[operand]]} > {limit}"


# ---------------------------------------------------------------------------------------------
# compute dtype and compiling on a CPU


def first_step_gradients(h, batch):
    """(objective, {name: gradient}) of step 0 on `batch` from a fresh seeded trainer whose
    zero-initialized matrices are filled (so every gradient is a real signal, not rounding noise)."""
    trainer = cpu_trainer(h)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.ndim >= 2 and p.abs().sum() == 0:
                p.normal_(0, 0.05)
    loss = trainer.forward_backward(0, batch)[1].item()
    return loss, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def assert_gradients_close(a, b, rel):
    assert a.keys() == b.keys()
    for name in a:
        err = (a[name] - b[name]).norm() / a[name].norm().clamp(min=1e-30)
        assert err < rel, f"{name}: relative error {err:.2e}"


def test_float32_compute_matches_bf16_and_keeps_fp32_activations(shards):
    h = tiny_config(data_args(shards))
    batch = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])
    h32 = tiny_config(data_args(shards) + ["--compute_dtype=float32"])
    trainer = cpu_trainer(h32)
    s = batch[0]
    with trainer.autocast:
        hidden = trainer.model.hidden_states(s.tokens, trainer.attention_args(s.cu_seqlens, tg.attention_windows(h, 0)))
    assert hidden.dtype == torch.float32
    loss16, grads16 = first_step_gradients(h, batch)
    loss32, grads32 = first_step_gradients(h32, batch)
    # bf16 keeps 8 significant bits: activations and products differ by ~2^-8 relative
    assert abs(loss32 - loss16) < 2e-2 * loss32
    assert_gradients_close(grads32, grads16, rel=5e-2)
    with pytest.raises(ConfigError, match="compute_dtype"):
        tiny_config(["--compute_dtype=float16"])


def test_compiled_cpu_step_matches_eager(shards):
    """torch.compile on a CPU (aot_eager: dynamo and AOTAutograd, no code generation) with the
    CPU kernels, which run eagerly between the compiled graphs: the same loss and gradients."""
    args = data_args(shards) + ["--compute_dtype=float32"]
    batch = TrainLoader(tg.shards_of(tiny_config(args).train_files), 512).next_batch(512, 256, 1, [0])
    eager_loss, eager = first_step_gradients(tiny_config(args + ["--compile=false"]), batch)
    torch._dynamo.reset()
    compiled_loss, compiled = first_step_gradients(
        tiny_config(args + ["--compile=true", "--compile_backend=aot_eager"]), batch)
    assert compiled_graphs() > 0
    assert compiled_loss == pytest.approx(eager_loss, rel=1e-5)
    assert_gradients_close(eager, compiled, rel=1e-4)


def test_compiling_turns_off_aotautograds_cache(monkeypatch):
    """compile_fn turns AOTAutograd's on-disk cache off: with it, a second run of the cpu preset
    with bf16 weights, inductor and --cuda_graphs=false got the backward of another stage's
    gradient-sink length and failed at the first stage change (a fresh cache, or the cache
    off, ran both times to the same val loss)."""
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", True)
    tg.compile_fn(tiny_config(), lambda x: x)
    assert torch._functorch.config.enable_autograd_cache is False


def test_compiled_cpu_run_compiles_only_in_the_warm_up(shards, tmp_path):
    res = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=4", "--compile=true",
                       "--compile_backend=aot_eager", f"--log_dir={tmp_path}"])
    assert res.returncode == 0, res.stderr
    log = parse_log(tmp_path / next(p for p in os.listdir(tmp_path) if p.endswith(".txt")))
    assert log.finished
    line = next(line for line in log.info if line.startswith("compile: "))
    warm = int(line.split()[1])
    assert warm > 0 and line.endswith(f"{warm} graphs in the warm-up, 0 in the timed run"), line
    assert any(line.startswith("warm-up: ") and "untimed" in line for line in log.info)


def test_cpu_comparison_runs_resumes_and_never_overwrites(shards, tmp_path):
    tool = [sys.executable, os.path.join(REPO, "bench", "cpu_comparison.py"), "--seeds", "1", "--results", "",
            "--out", str(tmp_path / "runs")]
    variant = ["--variant", "tiny", *TINY, *data_args(shards), "--num_iterations=2"]
    env = cpu_env(PYTHONUNBUFFERED="1")   # the tool's runs are those of a CPU-only machine
    first = subprocess.run([*tool, *variant], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert first.returncode == 0, first.stderr
    log_name, = os.listdir(tmp_path / "runs" / "tiny_seed1")
    val = parse_log(tmp_path / "runs" / "tiny_seed1" / log_name).final["val_loss"]
    assert "| tiny |" in first.stdout and f"{val:.4f}" in first.stdout
    again = subprocess.run([*tool, *variant], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert again.returncode == 0 and "finished before, not run again" in again.stdout, again.stderr
    assert os.listdir(tmp_path / "runs" / "tiny_seed1") == [log_name]
    other = subprocess.run([*tool, *variant[:-1], "--num_iterations=3"], capture_output=True, text=True,
                           timeout=300, env=env, cwd=REPO)
    assert other.returncode != 0 and "move it away or give another --out" in other.stderr
    assert os.listdir(tmp_path / "runs" / "tiny_seed1") == [log_name]


def test_weight_averages_count_back_from_an_offset_take_the_last_steps_and_restore_bank_norms():
    """offset 1 samples every 2nd step counted back from the step before the last (steps 6, 8 of
    0-9), last_steps 2 adds steps 8 and 9; with average_norms "bank" the values and outputs are
    rescaled together to their joint norm before the blend (each matrix's own norm moves)."""
    averages = ('--averages=[{"params":"vo_mlp","window":5,"every":2,"offset":1,"rate":0.5,"blend":0.5,'
                '"renormalize":true,"last_steps":2}]')
    h = tiny_config([averages, "--num_iterations=10", "--average_norms=bank"])
    model = tiny_model(h)
    sampled = [s for s in range(10) if optim.WeightAverages(h.averages, None, 10).samples_at(h.averages[0], s)]
    assert sampled == [6, 8, 9]
    block = next(b for b in model.blocks if b.attn is not None)
    qk_rows = 2 * h.num_heads * h.head_dim
    pieces = dict(model.averaged_pieces("vo_mlp"))
    gen = torch.Generator().manual_seed(4)
    values = [{name: torch.randn(w.shape, generator=gen, dtype=torch.float64) for name, w in pieces.items()}
              for _ in range(10)]
    averages = optim.WeightAverages(h.averages, model, h.num_iterations, norms=h.average_norms)
    for step in range(10):
        for name, w in pieces.items():
            w.copy_(values[step][name].float())
        averages.sample(step)
    last = {name: v.float().double() for name, v in values[-1].items()}
    blended = {}
    for name in pieces:
        avg = values[6][name].float().double()
        for s in (8, 9):
            avg = avg + 0.5 * (values[s][name].float().double() - avg)
        blended[name] = last[name] + 0.5 * (avg - last[name])
    for bank, kinds in (("vo", ("v", "out")), ("mlp", ("mlp_up", "mlp_down", "mlp2_up", "mlp2_down"))):
        names = [n for n in pieces if n.rstrip("0123456789") in kinds]
        norm = lambda d: sum(d[n].square().sum() for n in names).sqrt()
        ratio = norm(last) / norm(blended)
        for n in names:
            blended[n] = blended[n] * ratio
    averages.ship()
    for name, w in pieces.items():
        torch.testing.assert_close(w.double(), blended[name], rtol=0, atol=1e-5)
    own = model.averaged_pieces("vo_mlp")
    assert any(abs(float(w.double().norm() / last[n].norm()) - 1) > 1e-3 for n, w in own), "one norm per bank"
    assert torch.equal(block.attn.qkv[:qk_rows], block.attn.qkv[:qk_rows]), "queries and keys untouched"


def test_muon_groups_take_the_record_banks_shapes():
    """matrix_shapes "record_banks": the MLP output matrices take the factor of their hidden x dim
    storage, a narrow-value layer's output matrix (dim x its narrow width here) the factor 1 of a
    dim x dim one, and its values' block equalizes rows, as a padded dim x dim matrix does; "own"
    leaves every matrix to its own shape."""
    features = ["--narrow_vo_layers=[2]", "--narrow_vo_dim=16", "--qk_ortho_heads=1", "--num_value_embeds=0",
                "--value_embed_layers=[0]"]
    h = tiny_config([*features, "--matrix_shapes=record_banks"])
    model = tiny_model(h)
    groups = {g["name"]: g for g in tg.muon_groups(h, model, [p for n, p in model.blocks.named_parameters()
                                                             if p.ndim == 2 and not tg.is_gate(n)])}
    assert groups["mlp_down"]["shape_factor"] == pytest.approx((128 / 64) ** 0.5)
    assert [p is model.blocks[2].attn.out for p in groups["narrow_out"]["params"]] == [True]
    assert groups["narrow_out"]["shape_factor"] == 1.0
    narrow_qkv = [g for g in tg.muon_groups(h, model, []) if g["name"] == "qkv" and g["lanes"]]
    assert len(narrow_qkv) == 1 and narrow_qkv[0]["params"][0] is model.blocks[2].attn.qkv
    assert narrow_qkv[0]["lanes"] == (None,) * 4 + ("rows",)
    h = tiny_config([*features, "--matrix_shapes=own"])
    model = tiny_model(h)
    groups = tg.muon_groups(h, model, [])
    assert {g["name"] for g in groups} == {"matrices", "mlp_down", "qkv"}
    assert all(g.get("shape_factor") is None and g.get("lanes") is None for g in groups)


def test_value_embeddings_adam_follows_the_tables_and_eps_the_summed_loss(shards):
    """value_embed_table_cadence: the value embeddings get an Adam of their own that steps on the
    tables' cadence with their phases' betas and decay; adam_eps_unit "token_sum": every Adam's
    and table's eps is adam_eps over a slice's tokens and the steps an update spans."""
    phase = ('--table_phases=[{"start":3,"ngram_beta2":0.81,"value_embed_beta2":0.64,"step_every":4,'
             '"value_embed_beta1":0.25,"decay_mult":2}]')
    h = tiny_config([*data_args(shards), "--ngram_rows=2048", "--value_embed_table_cadence=true",
                     "--ngram_step_every=2", phase, "--adam_eps_unit=token_sum", "--value_embed_wd=0.1",
                     "--ngram_wd=0.3", "--adam_step_every=2", "--value_embed_betas=[0.5,0.9]"])
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(str(shards), active=False))
    main, value = trainer.adam, trainer.value_adam
    assert [p for g in value.param_groups for p in g["params"]] == [ve.weight for ve in trainer.model.value_embeds]
    assert all(p is not ve.weight for g in main.param_groups for p in g["params"] for ve in trainer.model.value_embeds)
    for step, (every, betas, wd) in {0: (2, (0.5, 0.9), 0.1), 2: (2, (0.5, 0.9), 0.1), 3: (4, (0.25, 0.64), 0.2),
                                     9: (4, (0.25, 0.64), 0.2)}.items():
        trainer.advance_to(step)
        assert value.step_every == every and value.param_groups[0]["betas"] == betas, step
        assert value.param_groups[0]["weight_decay"] == pytest.approx(wd), step
        exact = functools.partial(pytest.approx, rel=1e-9, abs=0)
        assert value.param_groups[0]["eps"] == exact(1e-10 / (512 * every)), step
        assert [g["eps"] for g in main.param_groups] == exact([1e-10 / (512 * 2)] * len(main.param_groups))
        adam = trainer.tables.ngram_adam
        assert (adam.eps, adam.weight_decay) == (exact(1e-10 / (512 * every)), exact(0.3 * wd / 0.1))
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    trainer.advance_to(0)
    updates = []
    for step in range(8):
        trainer.advance_to(step)
        before = trainer.model.value_embeds[0].weight.detach().clone()
        trainer.train_step(step, loader.next_batch(512, 256, 1, [0]))
        updates.append(not torch.equal(before, trainer.model.value_embeds[0].weight))
    assert updates == [False, True, False, False, False, True, False, False], "step 1, then every 4th call"


@pytest.mark.parametrize("walk", ["continue", "restart"])
def test_candidate_walk_continues_from_step_to_step(shards, walk):
    """With candidate_walk "continue" a slice's negatives start where its last sampled step's draw
    ended (candidate_walk_after); with "restart" at the slice's start every step."""
    h = tiny_config([*data_args(shards), f"--candidate_walk={walk}"])
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(str(shards), active=False))
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    start = sampled_softmax.candidate_start(0, 1)
    for step in range(2):
        batch = loader.next_batch(512, 256, 1, [0])
        trainer.train_step(step, batch)
        if walk == "continue":
            start = sampled_softmax.candidate_walk_after(batch[0].targets, h.stages[0].candidates, torch.as_tensor(start))
        assert int(trainer.walk[0]) == int(start)
    assert (int(start) != sampled_softmax.candidate_start(0, 1)) == (walk == "continue")
    restore(trainer, snapshot(trainer))
    assert int(trainer.walk[0]) == sampled_softmax.candidate_start(0, 1), "a restored trainer starts its walk again"
