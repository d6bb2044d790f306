"""The schedules of train_gpt.py and the presets' published constants, against values worked out
by hand from each schedule's definition: stage multipliers and the LR cooldown, momentum, ANVIL's
mu and blend, stage boundaries, multi-token and prefix weights, attention windows and their
YaRN history, the untie, graph changes, validations, the weight averages' samples, the n-gram
table's late phase, and what Trainer.advance_to writes into the optimizers.

The mechanics are tested on a fixture config of this file's own numbers; the speedrun's numbers
are in one table, RECORD_92, which a record that changes the speedrun changes."""
import dataclasses
import json
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import optim  # noqa: E402
import train_gpt as tg  # noqa: E402


def preset(name, *extra):
    """A preset's config; the cpu preset at 30 steps, the length the hand-computed numbers use."""
    steps = ["--num_iterations=30"] if name == "cpu" else []
    return tg.parse_config(["--preset", name, *steps, *extra])


# The schedule fixture: 100 steps in five stages from steps 25, 55, 80 and 90 (LR multipliers 1,
# 1.5, 1.75, 1.6, 1), the cooldown from step 20 to 0.3 at the end, ANVIL's mu from 0.85 up to 0.93
# over 20 steps and back over the last 5, the rails blended 0.4 from step 45, the untie at step
# 95, two averages, 8 ranks.
FIXTURE_STAGES = [
    dict(end=0.25, tokens_per_rank=512, max_doc_len=256, short_window=1, long_window=3,
         mtp_weights=[1.0, 0.5, 0.25], mtp_weights_end=[1.0, 0.5, 0.0], prefix_weight=0.25),
    dict(end=0.55, tokens_per_rank=1024, max_doc_len=512, short_window=3, long_window=7, mtp_weights=[1.0, 0.5],
         mtp_weights_end=[1.0, 0.0], prefix_weight=0.25, prefix_weight_end=0.0, lr_mult=1.5),
    dict(end=0.8, tokens_per_rank=1536, max_doc_len=768, short_window=5, long_window=11, lr_mult=1.75),
    dict(end=0.9, tokens_per_rank=1024, max_doc_len=768, short_window=5, long_window=11, lr_mult=1.6),
    dict(end=1.0, tokens_per_rank=512, max_doc_len=768, short_window=6, long_window=13),
]
FIXTURE_AVERAGES = [dict(params="embed_head", window=30, rate=0.1, blend=0.5),
                    dict(params="qk", window=21, every=4, rate=0.2, renormalize=True)]
FIXTURE = [
    "--num_iterations=100", "--stages=" + json.dumps(FIXTURE_STAGES), "--batch_ranks=8",
    "--cooldown_start=0.2", "--cooldown_end=1.0", "--cooldown_floor=0.3",
    "--optimizer=anvil", "--anvil_mu_low=0.85", "--anvil_mu_high=0.93", "--anvil_mu_rise=0.2", "--anvil_mu_fall=0.05",
    "--anvil_blend=0.4", "--anvil_blend_start=0.45", "--untie_frac=0.95",
    "--val_long_window=20", "--yarn_at_final_window=false", "--averages=" + json.dumps(FIXTURE_AVERAGES),
]


def fixture(*extra):
    return tg.parse_config(["--preset", "cpu", *FIXTURE, *extra])


# ---------------------------------------------------------------------------------------------
# The presets' published constants
# ---------------------------------------------------------------------------------------------

def stage_rows(h):
    return [(s.end, s.tokens_per_rank, s.max_doc_len, s.short_window, s.long_window, s.mtp_weights,
             s.mtp_weights_end, s.prefix_weight, s.prefix_weight_end, s.prefix_weight_levels, s.lr_mult, s.candidates)
            for s in h.stages]


def average_rows(h):
    return [(a.params, a.window, a.every, a.offset, a.last_steps, a.rate, a.blend, a.renormalize) for a in h.averages]


N92 = 1194
# Record 92's recipe as the speedrun preset states it, with what follows from it: (value, where it
# comes from: public files are record 92's track_1_short/ package, "record 89" its train_gpt.py).
# The one table a record that changes the speedrun changes; tests/test_record_schedules.py walks
# every step of the schedules against the record's code restated.
RECORD_92 = {
    # model
    "num_layers": (11, "record 92: NUM_LAYERS (model/gpt.py)"),
    "attention_free_layers": ((4, 6, 7, 9), "record 92: NO_ATTN_LAYERS"),
    "mlp_free_layers": ((7,), "record 92: NO_MLP_LAYERS"),
    "long_window_layers": ((3, 10), "record 92"), "mlp_hidden": (2816, "record 92"),
    "narrow_qk_layers": ((0, 1, 2, 5, 8), "record 92"), "narrow_vo_layers": ((1, 8), "record 92"),
    "parallel_mlp_layers": ((8,), "record 92"), "narrow_qk_attn_scale": (0.13, "record 92"),
    "attn_scale": (0.085, "record 92"), "yarn_scale_growth": (0.2, "record 89"), "embed_init_std": (0.005, "record 89"),
    "value_embed_layers": ((1, 2, 8, 10), "record 92: VALUE_EMBED_LAYERS"), "num_value_embeds": (0, "record 89"),
    "value_embed_gate_reads_value": (True, "record 89"), "smear_gate": (True, "record 89"),
    "key_offset": (True, "record 89"), "xsa_layers": ((1, 3), "record 89"), "paired_head_layers": ((0, 2, 5), "record 89"),
    "token_gates": (True, "record 89"), "token_gates_split": (4, "record 89"),
    "attn_gate_layers": ((3, 10), "record 92"),
    "trunk": ("dense", "record 89"), "skip_layers": ((3, 6), "record 89"),
    "snapshot_layer": (7, "record 92: the later layers read cache[7]"),
    "x0_layers": ((0, 1, 2, 4, 5, 7), "record 92: X0_INJECT_LAYERS"),
    "hashed_layers": ((0, 1, 4, 5, 9), "record 92: BIGRAM_INJECT_LAYERS"),
    "composed_layers": ((), "record 92 has none"), "composed_window": (112, "record 89"),
    "ngram_rows": (84_602_880, "record 92"), "ngram_dtype": ("bfloat16", "record 92"),
    "value_embed_sparse": (False, "record 92: value_embeds is an Adam parameter (training.py)"),
    "canonical_mask": (True, "record 92"),
    "fp8_mlp_scales": ("record92", "model/gpt.py FP8_MLP_*, FP8_EXACT_SCALE_CALLS"),
    "fp8_qkv_scales": ("record92", "model/gpt.py FP8_ATTN_X_SCALE, FP8_ATTN_GRAD_SCALE; exact weights"),
    "fp8_head_scales": ("record92", "model/gpt.py lm_head's x_s, w_s, grad_s"),
    "value_embed_full_width": (True, "record 92: one 768-wide plane per layer (model/gpt.py)"),
    "final_mix": ("record92", "record 92: 10 sources, 12 channel groups (model/gpt.py)"),
    "param_dtype": ("bfloat16", "records 89 and 92"),
    "target_rule": ("packed", "record 92: the targets are the packed batch shifted by one (data.py)"),
    "paired_head_layout": ("record", "record 92: head h at 2t + h // 3, turned as 2t + h % 2 (qkv_rope.py)"),
    "window_edge_key": (True, "record 92: FA3's window_size=(w, 0) (model/attention.py)"),
    "attn_out_init": ("uniform", "record 92: vo_bank uniform, O included (model/gpt.py)"),
    "narrow_yarn_window": ("short", "record 92: the QK-64 tables follow the short window (training.py)"),
    "cross_documents": (True, "record 92: smear, key offset and hashes stop at the slice's start only"),
    "table_hashes": ("record", "record 92: int32 row hashes and its sign multipliers (ngram_table.py)"),
    "attention_segment_tokens": (2560, "record 92: VIRTUAL_SEQ_CAP (config.py)"),
    # schedule
    "num_iterations": (N92, "config.py: 1122 scheduled + 52 growth + 20 extension"),
    "stages": ([
        (320 / N92, 16_384, 896, 1, 3, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.25, None, 0, 1.0, 10_240),
        (681 / N92, 32_768, 2048, 3, 7, (1.0, 0.5), (1.0, 0.0), 0.20, 0.05, 4, 1.52, 10_240),
        (965 / N92, 49_152, 3072, 5, 11, (1.0,), (), 0.0, None, 0, 1.73, 14_336),    # two thirds of 681-1106
        (1107 / N92, 49_152, 3072, 5, 11, (1.0,), (), 0.0, None, 0, 1.73, 24_576),   # its last third
        (1174 / N92, 40_960, 3072, 5, 11, (1.0,), (), 0.0, None, 0, 1.73 * (20 / 24) ** 0.5, 0),
        (1.0, 16_384, 3072, 6, 13, (1.0,), (), 0.0, None, 0, 1.0, 0),
    ], "config.py TRAINING_STAGES, sampled_softmax.py CANDIDATES_BY_STAGE; stage 2 split where the softmax widens"),
    "cooldown": ((234 / N92, 1174 / N92, 0.30), "config.py LR_COOLDOWN_FRAC 0.8 of 1174; schedule.py LR_FLOOR"),
    "val_long_window": (20, "config.py WS_POST_YARN_EXT"), "yarn_at_final_window": (False, "training.py"),
    "batch_ranks": (8, "record 92"), "candidate_walk": ("continue", "sampled_softmax.py CandidateBuilder"),
    "val_tokens": (10_485_760, "config.py val_tokens"),
    "val_tokens_per_rank": (262_144, "config.py val_batch_size 4 x 64 x 1024 x 8 over 8 GPUs, one window each"),
    "averages": ([
        ("embed_head", 298, 1, 0, 0, 2 / 299, 0.65, True),
        ("vo_mlp", 250, 4, 0, 0, 4 / 53, 1.0, False),
        ("value_embeds", 250, 4, 2, 0, 4 / 53, 1.0, False),
        ("qk", 298, 4, 0, 2, 2 / 75, 0.55, True),
        ("vo_mlp", 298, 4, 0, 2, 2 / 75, 0.55 - 0.2007, True),
    ], "tail_average.py"),
    "average_norms": ("bank", "tail_average.py DECONTRACTION_LABELS"),
    # optimizers
    "muon": (("anvil", "anvil", 0.023, 2.25, 2.0, 2, "record_banks"), "training.py anvil_defaults, optim/anvil.py"),
    "anvil_rails": ((0.85, 0.98, 0.4385, 514 / N92, True), "optim/anvil.py RAIL_*, training.py step_optimizers"),
    "anvil_mu": ((0.85, 0.93, 240 / N92, 50 / N92), "schedule.py get_rail_beta"),
    "adam_betas": (((0.5, 0.95), (0.75, 0.95), (0.9, 0.99)), "training.py param_table"),
    "adam_decay": ((0.56, 0.75, 0.025), "training.py VALUE_EMBED_LR_MUL 70, wd_mul 150 and 5 of 0.005"),
    "adam": ((2, 1e-10, "token_sum"), "training.py is_adam_step, adam_defaults; the CE's summed gradient"),
    "adam_scales": ((0.04, 0.008, (0.9, 0.95)), "training.py param_table: resid_lambdas x5, post_lambdas x1"),
    "adam_gate_decay": ((0.005, 0.005), "training.py: ve_gate_bank, mudd_w*, mudd_gate_w* take Adam's decay"),
    "tables": ((0.56, 0.025, 0.95, 2, True, [(336, 4, 0.9025, 0.5625, 0.9025, 2.0)]),
               "ngram_table.py NGRAM_*, training.py VALUE_EMBED_*: squared betas, doubled decay, every 4th from 336"),
    # what follows
    "steps_per_stage": ([320, 361, 284, 142, 67, 20], "config.py"),
    "untie_step": (1176, "schedule.py split_step 1174 | 1: its update is the last tied one"),
    "graph_changes": ([0, 320, 681, 965, 1107, 1174, 1176], "the stages and the untie"),
    "first_cooldown_step": (235, "schedule.py: t = 0 at step 234"),
    "first_blend_step": (514, "optim/anvil.py RAIL_ENGAGE_STEP"),
    "final_windows": ((6, 20), "config.py"),
    "average_samples": ([(896, 298), (945, 63), (947, 62), (897, 76), (897, 76)],
                        "(first step, samples): tail_average.py's ticks"),
    "train_shards": (5, "41,082,880 tokens a rank x 8 x 1.5 in shards of 100M"),
}


def speedrun_facts(h):
    """RECORD_92's keys, read from a config."""
    facts = {key: getattr(h, key) for key in RECORD_92 if hasattr(h, key)}
    averages = optim.WeightAverages(h.averages, None, h.num_iterations)
    sampled = [[step for step in range(h.num_iterations) if averages.samples_at(a, step)] for a in h.averages]
    return {**facts, "stages": stage_rows(h), "averages": average_rows(h),
            "cooldown": (h.cooldown_start, h.cooldown_end, h.cooldown_floor),
            "muon": (h.optimizer, h.orthogonalize, h.matrix_lr, h.matrix_wd, h.mlp_down_lr_scale, h.qk_ortho_heads,
                     h.matrix_shapes),
            "anvil_rails": (h.anvil_fast_beta, h.anvil_slow_beta, h.anvil_blend, h.anvil_blend_start,
                            h.anvil_fast_beta_follows_mu),
            "anvil_mu": (h.anvil_mu_low, h.anvil_mu_high, h.anvil_mu_rise, h.anvil_mu_fall),
            "adam_betas": (h.embed_betas, h.value_embed_betas, h.scalar_betas),
            "adam_decay": pytest.approx((h.value_embed_lr, h.embed_wd, h.value_embed_wd)),
            "adam": (h.adam_step_every, h.adam_eps, h.adam_eps_unit),
            "adam_scales": (pytest.approx(h.resid_scale_lr), pytest.approx(h.post_scale_lr), h.scale_betas),
            "adam_gate_decay": (h.gate_wd, h.gate_mlp_wd),
            "tables": (pytest.approx(h.ngram_lr), pytest.approx(h.ngram_wd), h.ngram_beta2, h.ngram_step_every,
                       h.value_embed_table_cadence,
                       [(p.start, p.step_every, p.ngram_beta2, p.value_embed_beta1, p.value_embed_beta2, p.decay_mult)
                        for p in h.table_phases]),
            "steps_per_stage": tg.steps_per_stage(h), "untie_step": tg.untie_step(h),
            "graph_changes": tg.graph_changes(h),
            "first_cooldown_step": next(s for s in range(h.num_iterations) if tg.lr_multiplier(h, s) != 1.0),
            "first_blend_step": next(s for s in range(h.num_iterations) if tg.anvil_blend(h, s) != 1.0),
            "final_windows": tg.attention_windows(h, h.num_iterations, final_validation=True),
            "average_samples": [(s[0], len(s)) for s in sampled], "train_shards": tg.train_shards_needed(h)}


def test_speedrun_is_record_92():
    facts = speedrun_facts(preset("speedrun"))
    wrong = {key: (facts[key], value, source) for key, (value, source) in RECORD_92.items() if facts[key] != value}
    assert wrong == {}, "speedrun differs from RECORD_92: key: (speedrun's, the table's, where it comes from)"


def test_record89_and_cpu_presets_publish_their_schedules():
    h = preset("record89")
    N = 1285
    assert h.num_iterations == N
    assert [(s.end, s.short_window, s.long_window, s.lr_mult) for s in h.stages] == [
        (423 / N, 1, 3, 1.0), (847 / N, 3, 7, 1.52), (1270 / N, 5, 11, 1.73), (1.0, 6, 13, 1.0)]
    assert (h.cooldown_start, h.cooldown_end, h.cooldown_floor) == (508 / N, 1270 / N, 0.15)
    assert (h.optimizer, h.orthogonalize) == ("normuon", "polar_express")
    assert (h.momentum_warmup_start, h.momentum, h.momentum_warmup_steps, h.momentum_cooldown_steps) == (
        0.85, 0.95, 300, 50)
    h = preset("cpu")
    assert h.num_iterations == 30 and (h.cooldown_start, h.cooldown_end, h.cooldown_floor) == (0.4, 1.0, 0.15)
    assert [(s.end, s.tokens_per_rank, s.short_window, s.long_window, s.lr_mult) for s in h.stages] == [
        (0.5, 2048, 1, 2, 1.0), (0.8, 4096, 2, 4, 1.52), (1.0, 4096, 2, 6, 1.52)]
    assert (h.val_long_window, h.yarn_at_final_window, h.untie_frac) == (8, True, 2 / 3)


def test_medium_preset_publishes_the_public_medium_records_schedule_and_constants():
    """The public train_gpt_medium.py: 4700 + 40 steps; 12 phases of the batch schedule
    (131,072, 262,144, 393,216, then 524,288 global tokens) and of the long window (3, 7, 11, 13,
    ..., 21, 23, 23, 23, 23 blocks, the short one min(11, long // 2)), phase k from the first step s
    with 12 s / 4700 >= k; the extension at 524,288 tokens and windows (11, 23). Here in 16 slices
    of a global batch (docs/medium.md: the public 8 do not fit the memory budget)."""
    h = preset("medium")
    N = 4740
    assert (h.num_iterations, h.batch_ranks, h.track) == (N, 16, "track_2_medium")
    stages = [(s.end, s.tokens_per_rank * h.batch_ranks, s.max_doc_len, s.short_window, s.long_window, s.mtp_weights,
               s.mtp_weights_end, s.prefix_weight, s.lr_mult, s.candidates) for s in h.stages]
    assert stages == [
        (392 / N, 131_072, 4096, 1, 3, (1.0, 0.5, 0.25), (1.0, 0.5, 0.0), 0.0, 1.0, 0),
        (784 / N, 262_144, 4096, 3, 7, (1.0, 0.5), (1.0, 0.0), 0.0, 1.52, 0),
        (1175 / N, 393_216, 4096, 5, 11, (1.0,), (), 0.0, 1.73, 0),
        (1567 / N, 524_288, 4096, 6, 13, (1.0,), (), 0.0, 2.0, 0),
        (1959 / N, 524_288, 4096, 7, 15, (1.0,), (), 0.0, 2.0, 0),
        (2350 / N, 524_288, 4096, 8, 17, (1.0,), (), 0.0, 2.0, 0),
        (2742 / N, 524_288, 4096, 9, 19, (1.0,), (), 0.0, 2.0, 0),
        (3134 / N, 524_288, 4096, 10, 21, (1.0,), (), 0.0, 2.0, 0),
        (4700 / N, 524_288, 4096, 11, 23, (1.0,), (), 0.0, 2.0, 0),      # phases 8-11
        (1.0, 524_288, 4096, 11, 23, (1.0,), (), 0.0, 2.0, 0),           # the 40 extension steps
    ]
    assert (h.cooldown_start, h.cooldown_end, h.cooldown_floor) == (1410 / N, 4700 / N, 0.1)
    assert (h.optimizer, h.orthogonalize, h.matrix_lr, h.matrix_wd, h.mlp_down_lr_scale, h.qk_ortho_heads) == (
        "normuon", "polar_express", 0.015, 1.2, 4.0, 8)
    assert (h.momentum_warmup_start, h.momentum, h.momentum_warmup_steps, h.momentum_cooldown_steps) == (
        0.85, 0.95, 300, 50)
    assert (h.embed_lr, h.head_lr, h.embed_betas, h.value_embed_betas, h.adam_eps, h.adam_step_every) == (
        0.004, 0.004, (0.8, 0.95), (0.8, 0.95), 1e-8, 2)
    assert (h.value_embed_lr, h.embed_wd, h.value_embed_wd, h.smear_gate_lr) == pytest.approx((0.3, 0.75, 0.025, 4e-5))
    assert (h.scalar_lr, h.scalar_betas, h.gate_lr) == (0.04, (0.9, 0.99), pytest.approx(0.0015))
    assert (h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden) == (16, 1024, 8, 128, 4096)
    assert (h.attention_free_layers, h.long_window_layers, h.num_value_embeds, h.value_embed_gate_dim) == (
        (), (0, 4, 11, 15), 5, 16)
    assert tg.value_embed_tables(tg.model_config(h)) == {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 11: 0, 12: 1, 13: 2, 14: 3,
                                                        15: 4}
    assert (h.smear_gate, h.key_offset, h.embed_init_std, h.attn_scale, h.yarn_scale_growth) == (
        True, True, 0.005, 0.1, 0.2)
    assert (h.val_long_window, h.yarn_at_final_window, h.val_tokens_per_rank, h.val_every) == (27, False, 262_144, 250)
    assert (h.fp8_mlp, h.fp8_qkv, h.fp8_head, h.canonical_mask, h.averages) == (False, False, False, False, [])

# ---------------------------------------------------------------------------------------------
# Learning rate
# ---------------------------------------------------------------------------------------------

def test_lr_is_the_stage_multiplier_then_a_line_to_the_floor():
    """The fixture: from 20% of training (step 20) each step's value is its stage's multiplier m
    moved toward 0.3 by (step / 100 - 0.2) / 0.8; the floor at the final validation."""
    h = fixture()
    expected = {
        0: 1.0, 19: 1.0, 20: 1.0,               # the line starts at the stage's multiplier
        24: 1 - 0.7 * 0.05, 25: 1.5 - 1.2 * 0.0625, 54: 1.5 - 1.2 * 0.425, 55: 1.75 - 1.45 * 0.4375,
        79: 1.75 - 1.45 * 0.7375, 80: 1.6 - 1.3 * 0.75, 89: 1.6 - 1.3 * 0.8625, 90: 1.0 - 0.7 * 0.875,
        99: 1.0 - 0.7 * 0.9875, 100: 0.3,
    }
    assert {step: tg.lr_multiplier(h, step) for step in expected} == pytest.approx(expected)


def test_record89_lr_cools_from_step_508_to_the_floor_at_step_1270():
    h = preset("record89")

    def cooling(m, step):
        return m + (0.15 - m) * (step - 508) / 762
    expected = {0: 1.0, 422: 1.0, 423: 1.52, 507: 1.52, 508: 1.52, 846: cooling(1.52, 846),
                847: cooling(1.73, 847), 1269: cooling(1.73, 1269), 1270: 0.15, 1284: 0.15, 1285: 0.15}
    assert expected[847] == pytest.approx(1.73 - 1.58 * 339 / 762)
    assert {step: tg.lr_multiplier(h, step) for step in expected} == pytest.approx(expected)


def test_cpu_lr_cools_from_40_percent_to_the_floor_at_the_end():
    """30 steps, stages from steps 15 and 24 with multipliers 1, 1.52, 1.52; from step 12 the
    value moves from the multiplier toward 0.15 by (step / 30 - 0.4) / 0.6."""
    h = preset("cpu")
    expected = {0: 1.0, 11: 1.0, 12: 1.0, 14: 1 - 0.85 / 9, 15: 1.52 - 1.37 / 6, 23: 1.52 - 1.37 * 11 / 18,
                24: 1.52 - 1.37 * 2 / 3, 29: 1.52 - 1.37 * 17 / 18, 30: 0.15}
    assert {step: tg.lr_multiplier(h, step) for step in expected} == pytest.approx(expected)


def test_optimization_preset_publishes_the_public_optimization_baselines_setup():
    """The public train_gpt_simple.py: 12 x 768, head_dim 128, MLP 4 x 768, attention scale 0.12,
    3250 steps of 8 x 64 x 1024 tokens over a 1024-token context, Muon lr 0.025 (mu 0.95 from the
    start), AdamW lr 0.7 / 0.004 / 0.015, betas (0.8, 0.95), eps 1e-10, validation every 125 steps."""
    h = preset("optimization")
    assert (h.track, h.num_iterations, h.batch_ranks, h.val_tokens) == ("track_3_optimization", 3250, 8, 10_485_760)
    assert (h.num_layers, h.model_dim, h.num_heads, h.head_dim, h.mlp_hidden) == (12, 768, 6, 128, 3072)
    assert (h.attention_free_layers, h.long_window_layers, h.num_value_embeds, h.value_embed_layers) == ((), (), 0, ())
    assert (h.attn_scale, h.rope_base, h.untie_frac, h.bigram_rows, h.value_embed_lr) == (0.12, 1024.0, 0.0, 2, 0.0)
    assert not (h.fp8_mlp or h.fp8_qkv or h.fp8_head or h.canonical_mask or h.smear_gate or h.averages)
    [stage] = h.stages
    assert (stage.tokens_per_rank * h.batch_ranks, stage.max_doc_len) == (8 * 64 * 1024, 1024)
    assert (stage.short_window, stage.long_window, h.val_long_window) == (8, 8, 8)
    assert (stage.mtp_weights, stage.prefix_weight, stage.candidates, stage.lr_mult) == ((1.0,), 0.0, 0, 1.0)
    assert (h.optimizer, h.matrix_lr, h.mlp_down_lr_scale, h.qk_ortho_heads) == ("muon", 0.025, 1.0, 6)
    assert (h.embed_lr, h.head_lr, h.scalar_lr, h.embed_betas, h.scalar_betas, h.adam_eps) == (
        0.7, 0.004, 0.015, (0.8, 0.95), (0.8, 0.95), 1e-10)
    assert h.matrix_wd * h.matrix_lr == pytest.approx(0.05) and h.embed_wd * h.embed_lr == pytest.approx(0.001)
    assert [tg.matrix_momentum(h, step) for step in (0, 1, 1000, 3249)] == [0.95] * 4
    points = tg.validation_points(h)
    assert points[:2] == [(125, False), (250, False)] and points[-2:] == [(3125, False), (3250, True)]
    assert len(points) == 26 and tg.untie_step(h) == 0


def test_optimization_lr_is_the_public_set_hparams():
    """The public set_hparams(step, cooldown_frac=0.7): 1 while step / 3250 < 0.3, then
    (1 - step / 3250) / 0.7; at every step of the run."""
    h = preset("optimization")
    for step in range(3250):
        progress = step / 3250
        public = 1.0 if progress < 1 - 0.7 else (1 - progress) / 0.7
        assert tg.lr_multiplier(h, step) == pytest.approx(public, abs=1e-12), step


def test_medium_lr_is_the_public_get_lr():
    """The public get_lr, x = step / 4700: 1 up to x = 1/12, 1.52 above it, 1.73 above 2/12, 2.0
    above 3/12; from x >= 0.3 (step 1411; at 1410 the line still gives 2.0) w = (1 - x) / 0.7 and
    the LR is 2.0 w + 0.1 (1 - w); 0.1 after step 4700. Step 1175 is x = 3/12 exactly: the public
    LR is 1.73 there for one step, ours is already the next stage's 2.0 (docs/medium.md)."""
    h = preset("medium")
    expected = {
        0: 1.0, 391: 1.0, 392: 1.52, 783: 1.52, 784: 1.73, 1174: 1.73, 1176: 2.0, 1409: 2.0, 1410: 2.0,
        1411: 2.0 - 1.9 / 3290, 3055: 1.05, 4699: 0.1 + 1.9 / 3290, 4700: 0.1, 4701: 0.1, 4739: 0.1,
        4740: 0.1,                             # the final validation
    }
    assert {step: tg.lr_multiplier(h, step) for step in expected} == pytest.approx(expected)
    assert tg.lr_multiplier(h, 1175) == 2.0, "public: 1.73 (x > 3/12 is false at x = 3/12)"

# ---------------------------------------------------------------------------------------------
# Momentum, mu, blend
# ---------------------------------------------------------------------------------------------

def test_record89_momentum_warms_up_over_300_steps_and_cools_over_the_last_50():
    h = preset("record89")
    expected = {0: 0.85, 1: 0.85 + 0.1 / 300, 150: 0.90, 299: 0.85 + 0.1 * 299 / 300, 300: 0.95, 1000: 0.95,
                1235: 0.95, 1236: 0.948, 1260: 0.90, 1284: 0.852, 1285: 0.85}
    assert {step: tg.matrix_momentum(h, step) for step in expected} == pytest.approx(expected)
    h = preset("cpu")              # 30 steps: the warm-up is a tenth done at the end, no cooldown
    assert [tg.matrix_momentum(h, s) for s in (0, 29)] == pytest.approx([0.85, 0.85 + 0.1 * 29 / 300])


def test_medium_momentum_is_the_public_get_muon_momentum():
    """0.85 + 0.1 step / 300 below step 300; 0.95; above step 4740 - 50 = 4690,
    0.95 - 0.1 (step - 4690) / 50."""
    h = preset("medium")
    expected = {0: 0.85, 1: 0.85 + 0.1 / 300, 150: 0.90, 299: 0.85 + 0.1 * 299 / 300, 300: 0.95, 2000: 0.95,
                4690: 0.95, 4691: 0.948, 4700: 0.93, 4715: 0.90, 4739: 0.852, 4740: 0.85}
    assert {step: tg.matrix_momentum(h, step) for step in expected} == pytest.approx(expected)


def test_anvil_mu_rises_over_the_first_20_percent_and_falls_over_the_last_5():
    """The fixture: 0.85 -> 0.93 over steps 0-20, held, and back to 0.85 over steps 95-100."""
    h = fixture()
    expected = {0: 0.85, 10: 0.89, 19: 0.85 + 0.08 * 0.95, 20: 0.93, 60: 0.93, 95: 0.93, 96: 0.85 + 0.08 * 0.8,
                99: 0.85 + 0.08 * 0.2, 100: 0.85}
    assert {step: tg.anvil_mu(h, step) for step in expected} == pytest.approx(expected)


def test_anvil_blend_is_one_before_45_percent_then_0_4():
    h = fixture()
    expected = {0: 1.0, 20: 1.0, 44: 1.0, 45: 0.4, 60: 0.4, 99: 0.4, 100: 0.4}
    assert {step: tg.anvil_blend(h, step) for step in expected} == expected

# ---------------------------------------------------------------------------------------------
# Stages and what they carry
# ---------------------------------------------------------------------------------------------

# The first step of each stage after the first: the first step with step / N >= the end of the
# stage before (the fixture's 25, 55, 80, 90; 423/1285 ...; 0.5 * 30 = 15, 0.8 * 30 = 24; medium:
# the public phases' first steps ceil(4700 k / 12) for k = 1-8, then the extension's 4700).
STAGE_STARTS = {"fixture": (100, [25, 55, 80, 90]), "record89": (1285, [423, 847, 1270]),
                "cpu": (30, [15, 24]), "medium": (4740, [392, 784, 1175, 1567, 1959, 2350, 2742, 3134, 4700]),
                "optimization": (3250, [])}


@pytest.mark.parametrize("name", sorted(STAGE_STARTS))
def test_stage_of_every_step_and_the_steps_per_stage(name):
    h = fixture() if name == "fixture" else preset(name)
    N, starts = STAGE_STARTS[name]
    assert [tg.stage_index(h, step) for step in range(N + 1)] == [
        sum(step >= first for first in starts) for step in range(N + 1)]
    assert tg.steps_per_stage(h) == {"fixture": [25, 30, 25, 10, 10], "record89": [423, 424, 423, 15],
                                     "cpu": [15, 9, 6],
                                     "medium": [392, 392, 391, 392, 392, 391, 392, 392, 1566, 40],
                                     "optimization": [3250]}[name]


def test_steps_per_stage_counts_what_stage_index_decides_where_floats_round():
    """Ends 0.07, 0.075, 0.078, 0.29 of 100 steps: stage 0 is steps 0-6 (step 7 is at 7 / 100 =
    0.07, where it ends, though 0.07 * 100 is 7.000000000000001 in floats), stage 1 step 7,
    stage 2 none (no step from 7.5 to 7.8), stage 3 steps 8-28 (0.29 * 100 is 28.999999999999996;
    29 / 100 = 0.29), stage 4 steps 29-99."""
    stages = ",".join('{"end":%s,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2}' % end
                      for end in ("0.07", "0.075", "0.078", "0.29", "1.0"))
    h = preset("cpu", f"--stages=[{stages}]", "--num_iterations=100")
    assert tg.steps_per_stage(h) == [7, 1, 0, 21, 71]
    assert [tg.stage_index(h, step) for step in range(100)] == [0] * 7 + [1] + [3] * 21 + [4] * 71


def test_target_weights_move_linearly_across_each_stage():
    """The fixture's stage 0 (25 steps): t+3's weight from 0.25 toward 0, the prefix's 0.25
    throughout; stage 1 (30 steps): t+2's from 0.5 toward 0 and the prefix's from 0.25 toward 0;
    then t+1 alone."""
    h = fixture()
    weights = tg.step_target_weights(h, "cpu")
    assert weights.shape == (100, 4) and weights.dtype == torch.float32
    expected = {
        0: [1, 0.5, 0.25, 0.25], 10: [1, 0.5, 0.15, 0.25], 24: [1, 0.5, 0.01, 0.25],
        25: [1, 0.5, 0, 0.25], 40: [1, 0.25, 0, 0.125], 54: [1, 0.5 / 30, 0, 0.25 / 30], 55: [1, 0, 0, 0],
        90: [1, 0, 0, 0], 99: [1, 0, 0, 0],
    }
    for step, want in expected.items():
        assert weights[step].tolist() == pytest.approx(want, rel=1e-6, abs=1e-12), step
    assert tg.target_weights(h.stages[1], "cpu", 0.5).tolist() == pytest.approx([1, 0.25, 0, 0.125])
    assert tg.target_weights(h.stages[0], "cpu", 0.75).tolist() == pytest.approx([1, 0.5, 0.0625, 0.25])


def test_attention_windows_per_stage_and_at_the_final_validation():
    h = fixture()
    assert [tg.attention_windows(h, s) for s in (0, 24, 25, 54, 55, 79, 80, 89, 90, 99)] == [
        (1, 3), (1, 3), (3, 7), (3, 7), (5, 11), (5, 11), (5, 11), (5, 11), (6, 13), (6, 13)]
    assert tg.attention_windows(h, 100, final_validation=True) == (6, 20)
    h = preset("cpu")
    assert [tg.attention_windows(h, s) for s in (0, 14, 15, 23, 24, 29)] == [
        (1, 2), (1, 2), (2, 4), (2, 4), (2, 6), (2, 6)]
    assert tg.attention_windows(h, 30, final_validation=True) == (2, 8)


def test_long_window_history_grows_with_the_stages_and_yarn_at_the_final_window_adds_one():
    """Blocks of 128 tokens. The fixture's long window: 3, 7, 11, 11 (no growth), 13 blocks; the
    final validation's 20 adds to the history only with yarn_at_final_window (cpu: 8 blocks)."""
    h = fixture()
    assert [tg.long_window_history(h, s) for s in (0, 24, 25, 55, 80, 89, 90)] == [
        [384], [384], [384, 896], [384, 896, 1408], [384, 896, 1408], [384, 896, 1408], [384, 896, 1408, 1664]]
    assert tg.long_window_history(h, 100, final_validation=True) == [384, 896, 1408, 1664]
    h = fixture("--yarn_at_final_window=true")
    assert tg.long_window_history(h, 100, final_validation=True) == [384, 896, 1408, 1664, 2560]
    assert tg.long_window_history(h, 99) == [384, 896, 1408, 1664], "only the final validation widens"
    h = preset("cpu")
    assert tg.long_window_history(h, 29) == [256, 512, 768]
    assert tg.long_window_history(h, 30, final_validation=True) == [256, 512, 768, 1024]


def test_untie_step_and_graph_changes():
    """The untie: the fixture's 0.95 of 100 steps, record89 848 (the step after record 89's last
    tied update), cpu 2/3 of 30. The graphs change at 0, at every stage start and at the untie."""
    assert [tg.untie_step(h) for h in (fixture(), preset("record89"), preset("cpu"))] == [95, 848, 20]
    assert tg.graph_changes(fixture()) == [0, 25, 55, 80, 90, 95]
    assert tg.graph_changes(fixture("--untie_frac=0.8")) == [0, 25, 55, 80, 90], "at a stage start: one change"
    assert tg.graph_changes(preset("record89")) == [0, 423, 847, 848, 1270]
    assert tg.graph_changes(preset("cpu")) == [0, 15, 20, 24]
    assert tg.graph_changes(preset("cpu", "--untie_frac=1.0")) == [0, 15, 24], "an untie at N never happens"


def test_validation_points():
    assert tg.validation_points(fixture("--val_every=0")) == [(100, True)]
    assert tg.validation_points(fixture("--val_every=40")) == [(40, False), (80, False), (100, True)]
    assert tg.validation_points(fixture("--val_every=50")) == [(50, False), (100, True)]
    assert tg.validation_points(preset("cpu", "--val_every=10")) == [(10, False), (20, False), (30, True)]


def test_weight_averages_sample_their_windows_counted_back_from_the_last_step():
    """Steps 0-99: the 30-step average samples 70-99; every 4th step back from 99 within the last
    21 steps, the other samples 79, 83, ..., 99."""
    h = fixture()
    averages = optim.WeightAverages(h.averages, None, h.num_iterations)
    sampled = [[step for step in range(100) if averages.samples_at(a, step)] for a in h.averages]
    assert sampled == [list(range(70, 100)), [79, 83, 87, 91, 95, 99]]


def test_train_shards_needed(monkeypatch):
    """Steps per stage times each stage's tokens per rank, times the ranks, 1.5 times that for the
    documents' cut tails, in whole shards: the fixture reads 97,280 tokens a rank, 1,167,360 in
    all, 12 shards of 100,000 tokens."""
    tokens = 25 * 512 + 30 * 1024 + 25 * 1536 + 10 * 1024 + 10 * 512
    assert tokens == 97_280 and tokens * 8 * 1.5 == 1_167_360
    monkeypatch.setattr(tg, "FINEWEB_SHARD_TOKENS", 100_000)
    assert tg.train_shards_needed(fixture()) == 12
    assert tg.train_shards_needed(fixture("--batch_ranks=1")) == 2
    monkeypatch.undo()
    tokens = 423 * 16_384 + 424 * 32_768 + (423 + 15) * 49_152      # record 89: 508,231,680 -> 6
    assert tokens * 8 * 1.5 == 508_231_680 and tg.train_shards_needed(preset("record89")) == 6


def test_medium_target_weights_follow_the_public_multi_token_schedule():
    """The public weights, x = step / 1175: [1, .5, .25 (1 - 3x)] below x = 1/3 (steps 0-391),
    [1, .5 (2 - 3x)] below 2/3 (392-783), then [1]. Ours go linearly across the stage's own
    steps (392 each), so they differ from the public by at most 0.25 / 392 (0.0006) and
    0.5 / 392 (0.0013); no prefix target."""
    h = preset("medium")
    weights = tg.step_target_weights(h, "cpu")
    assert weights.shape == (4740, 4)
    ours = {0: [1, 0.5, 0.25, 0], 196: [1, 0.5, 0.125, 0], 391: [1, 0.5, 0.25 / 392, 0], 392: [1, 0.5, 0, 0],
            588: [1, 0.25, 0, 0], 783: [1, 0.5 / 392, 0, 0], 784: [1, 0, 0, 0], 4739: [1, 0, 0, 0]}
    public = {0: [1, 0.5, 0.25, 0], 196: [1, 0.5, 0.25 * (1 - 3 * 196 / 1175), 0],
              391: [1, 0.5, 0.25 * (1 - 3 * 391 / 1175), 0], 392: [1, 0.5 * (2 - 3 * 392 / 1175), 0, 0],
              588: [1, 0.5 * (2 - 3 * 588 / 1175), 0, 0], 783: [1, 0.5 * (2 - 3 * 783 / 1175), 0, 0],
              784: [1, 0, 0, 0], 4739: [1, 0, 0, 0]}
    for step in ours:
        assert weights[step].tolist() == pytest.approx(ours[step], rel=1e-6, abs=1e-12), step
        assert weights[step].tolist() == pytest.approx(public[step], abs=0.0013), step


def test_medium_windows_untie_validations_and_shards():
    """The public get_ws at each phase's first step, (11, 23) through the extension, (11, 27) at
    the final validation; the untie after the public split step ceil(4700 * 2/3/4) | 1 = 785, so
    step 786 is the first untied; a validation every 250 steps; the shards for 4740 steps."""
    h = preset("medium")
    steps = (0, 391, 392, 784, 1175, 1567, 1959, 2350, 2742, 3133, 3134, 4699, 4700, 4739)
    assert [tg.attention_windows(h, s) for s in steps] == [
        (1, 3), (1, 3), (3, 7), (5, 11), (6, 13), (7, 15), (8, 17), (9, 19), (10, 21), (10, 21), (11, 23), (11, 23),
        (11, 23), (11, 23)]
    assert tg.attention_windows(h, 4740, final_validation=True) == (11, 27)
    # ours applies YaRN at every growth of the long window; the public stops after 13 blocks (1664 tokens)
    assert tg.long_window_history(h, 4740, final_validation=True) == [
        384, 896, 1408, 1664, 1920, 2176, 2432, 2688, 2944]
    assert tg.untie_step(h) == 786
    assert tg.graph_changes(h) == [0, 392, 784, 786, 1175, 1567, 1959, 2350, 2742, 3134, 4700]
    assert tg.validation_points(h) == [(250 * k, False) for k in range(1, 19)] + [(4740, True)]
    # global tokens: 392 x 131,072 + 392 x 262,144 + 391 x 393,216 + (4740 - 1175) x 524,288
    tokens = 51_380_224 + 102_760_448 + 153_747_456 + 1_869_086_720
    assert tokens == 2_176_974_848 and tokens * 1.5 == 3_265_462_272
    assert tg.train_shards_needed(h) == 33


# ---------------------------------------------------------------------------------------------
# What the Trainer's advance_to writes
# ---------------------------------------------------------------------------------------------

# A tiny model with the n-gram table and sparse value embeddings, 10 steps in two stages
# (multipliers 1 and 2), a cooldown from step 6 to the floor 0.3 at step 9, momentum 0.85 -> 0.95
# over 4 steps and back over the last 3, mu 0.85 -> 0.93 over 2 steps and back over the last
# 2.5, blending from step 5, rails of betas 0.8 and 0.9, the tables' late phase from step 3.
SCHEDULED = [
    "--num_layers=3", "--model_dim=64", "--num_heads=2", "--head_dim=32", "--mlp_hidden=128",
    "--long_window_layers=[2]", "--attention_free_layers=[1]", "--num_value_embeds=1", "--narrow_qk_layers=[]",
    "--bigram_rows=1024", "--val_long_window=4", "--batch_ranks=1", "--num_iterations=10",
    '--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2},'
    '{"end":1.0,"tokens_per_rank":512,"max_doc_len":512,"short_window":1,"long_window":3,"lr_mult":2.0}]',
    "--cooldown_start=0.6", "--cooldown_end=0.9", "--cooldown_floor=0.3",
    "--optimizer=normuon", "--momentum_warmup_steps=4", "--momentum_cooldown_steps=3",
    "--anvil_mu_rise=0.2", "--anvil_mu_fall=0.25", "--anvil_blend_start=0.5", "--anvil_blend=0.4",
    "--ngram_rows=2048", "--smear_gate=true", "--value_embed_sparse=true",
    "--ngram_lr=0.05", "--ngram_beta2=0.9", "--ngram_step_every=2", "--anvil_fast_beta=0.8", "--anvil_slow_beta=0.9",
    '--table_phases=[{"start":3,"ngram_beta2":0.81,"value_embed_beta2":0.64,"step_every":4},'
    '{"start":7,"ngram_beta2":0.5,"value_embed_beta2":0.25,"step_every":3}]',
    "--value_embed_lr=0.03", "--value_embed_betas=[0.8,0.8]",
]
# step: (lr multiplier, momentum, mu, blend), from the definitions
ADVANCED = {
    0: (1.0, 0.85, 0.85, 1.0),
    1: (1.0, 0.875, 0.89, 1.0),
    2: (1.0, 0.90, 0.93, 1.0),
    3: (1.0, 0.925, 0.93, 1.0),
    4: (1.0, 0.95, 0.93, 1.0),
    5: (2.0, 0.95, 0.93, 0.4),
    6: (2.0, 0.95, 0.93, 0.4),
    7: (2.0 - 1.7 / 3, 0.95, 0.93, 0.4),
    8: (2.0 - 1.7 * 2 / 3, 0.85 + 0.1 * 2 / 3, 0.85 + 0.08 * 0.8, 0.4),
    9: (0.3, 0.85 + 0.1 / 3, 0.85 + 0.08 * 0.4, 0.4),
    10: (0.3, 0.85, 0.85, 0.4),
}


@pytest.fixture(scope="module")
def trainer():
    h = preset("cpu", *SCHEDULED)
    return tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog("unused", active=False))


def test_advance_to_writes_every_groups_lr_and_the_muon_momenta(trainer):
    h = trainer.h
    adam, muon = trainer.optimizers
    assert isinstance(adam, optim.Adam) and isinstance(muon, optim.Muon)
    initial = {g["name"]: g["initial_lr"] for opt in trainer.optimizers for g in opt.param_groups}
    # (no bigram beside the n-gram table, and the sparse value embeddings are SparseRowAdam's)
    assert initial == {"embed": h.embed_lr, "lm_head": h.head_lr, "scalars": h.scalar_lr, "gates": h.gate_lr,
                       "smear_gate": h.smear_gate_lr, "pointer": h.pointer_lr, "matrices": h.matrix_lr,
                       "mlp_down": h.matrix_lr, "qkv": h.matrix_lr}
    scale = {g["name"]: g["lr_scale"] for g in muon.param_groups}
    assert scale == {"matrices": 1.0, "mlp_down": 2.0, "qkv": 1.0}, "the MLP output matrices move twice as far"
    downs = next(g for g in muon.param_groups if g["name"] == "mlp_down")["params"]
    assert len(downs) == 3 and all(any(p is b.mlp.down for b in trainer.model.blocks) for p in downs)
    assert {(g["fast_beta"], g["slow_beta"]) for g in muon.param_groups} == {(0.8, 0.9)}
    for step in (9, 0, 1, 2, 3, 4, 5, 6, 7, 8, 10):          # in any order
        trainer.advance_to(step, final_validation=step == 10)
        lr, momentum, mu, blend = ADVANCED[step]
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                assert group["lr"] == pytest.approx(group["initial_lr"] * lr), (step, group["name"])
        for group in muon.param_groups:      # (the cpu preset's NorMuon reads the momentum)
            assert group["momentum"] == pytest.approx(momentum), step
        anvil = dataclasses.replace(h, optimizer="anvil")
        assert tg.momentum_schedule(anvil, step) == pytest.approx(dict(mu=mu, blend=blend, fast_beta=0.8)), step
        follows = dataclasses.replace(anvil, anvil_fast_beta_follows_mu=True)   # the fast rail at mu until the blend
        assert tg.momentum_schedule(follows, step)["fast_beta"] == pytest.approx(mu if step < 5 else 0.8), step
        assert trainer.tables.ngram_adam.lr == pytest.approx(0.05 * lr)
        assert [adam.lr for adam in trainer.tables.value_adams] == pytest.approx([0.03 * lr])
        assert trainer.model.tied == (step < 6), "the head unties at int(2/3 * 10) = 6"


def test_advance_to_moves_the_tables_through_their_phases(trainer):
    """Before step 3: beta2 0.9 (the table) and 0.8 (value embeddings), an update every 2nd step;
    from step 3: 0.81 and 0.64, every 4th; from step 7: 0.5 and 0.25, every 3rd. No phases: the
    base values throughout."""
    expected = {0: (2, 0.9, 0.8), 3: (4, 0.81, 0.64), 7: (3, 0.5, 0.25)}
    for step in (5, 0, 2, 3, 4, 10, 7, 6, 1, 8):
        trainer.advance_to(step)
        cadence, beta2, value_beta2 = expected[max(s for s in expected if s <= step)]
        assert trainer.tables.step_every == cadence, step
        assert trainer.tables.ngram_adam.beta2 == beta2, step
        assert [adam.beta2 for adam in trainer.tables.value_adams] == [value_beta2], step
    phases, trainer.h.table_phases = trainer.h.table_phases, []
    try:
        trainer.advance_to(9)
        tables = trainer.tables
        assert (tables.step_every, tables.ngram_adam.beta2, tables.value_adams[0].beta2) == (2, 0.9, 0.8)
    finally:
        trainer.h.table_phases = phases
