"""The `speedrun` and `record89` presets step for step against the records' own schedules.

Each record's schedules are restated here from its published code, in plain Python and apart
from train_gpt.py: record 92 from the public repository's `track_1_short/` package (config.py,
schedule.py, training.py, optim/anvil.py, ngram_table.py, sampled_softmax.py, tail_average.py),
record 89 from its train_gpt.py. Every step of each run is compared: the stage's batch, document
length and windows, the sampled softmax's width, the LR multiplier, the matrix optimizer's
momenta, the multi-token and prefix weights, when each Adam and each table updates and with
which betas, decay and LR, the untie, and the steps each end-of-training average samples.
Changing any one value of a preset fails a test here."""
import math
import os
import sys
from itertools import accumulate, pairwise

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import optim  # noqa: E402
import train_gpt as tg  # noqa: E402
from machinery import sampled_softmax  # noqa: E402

GPUS = 8                           # both records run on 8 GPUs, one micro-batch each
UNIT = 2048 * GPUS                 # a record's batch sizes are in units of 2,048 tokens a GPU


# -----------------------------------------------------------------------------------------------
# Record 92, restated from track_1_short/
# -----------------------------------------------------------------------------------------------

R92_SCHEDULED, R92_EXTENSION = 1122, 20          # config.py: num_scheduled / num_extension_iterations
R92_DURATIONS = [0.2854, 0.3209, 0.3931]        # config.py: STAGE_DURATIONS (normalized to sum 1)
R92_TAPER, R92_GROWTH, R92_GROWTH_STAGE = 0.06, 52, 2   # config.py: TAPER_DURATION, SCHEDULE_GROWTH_*
R92_COOLDOWN_FRAC, R92_LR_FLOOR = 0.80, 0.30     # config.py: LR_COOLDOWN_FRAC; schedule.py: LR_FLOOR
R92_SPLIT_STAGE, R92_FINAL_LONG = 4, 20          # config.py: SPLIT_EMBED_STAGE, WS_POST_YARN_EXT
# config.py TRAINING_STAGES: (batch units, train_max_seq_len, windows, lr_mul, mtp start, mtp end, prefix weights)
R92_STAGES = [
    (8, 896, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0], (0.25,)),
    (16, 2048, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0], (0.20, 0.15, 0.10, 0.05)),
    (24, 3072, (5, 11), 1.73, [1.0], [1.0], (0.0,)),
    (20, 3072, (5, 11), 1.73 * (20 / 24) ** 0.5, [1.0], [1.0], (0.0,)),
    (8, 3072, (6, 13), 1.0, [1.0], [1.0], (0.0,)),
]
R92_CANDIDATES = {0: (10240,), 1: (10240,), 2: (14336, 14336, 24576)}  # sampled_softmax.py: CANDIDATES_BY_STAGE
R92_RAIL = dict(warmup=240, cooldown=50, low=0.85, high=0.93)  # schedule.py: get_rail_beta's defaults
R92_FAST_BETA, R92_FAST_WEIGHT, R92_ENGAGE = 0.85, 0.4385, 514  # optim/anvil.py: RAIL_FAST_BETA, _WEIGHT, _ENGAGE_STEP
R92_ANVIL_LR, R92_ANVIL_WD = 0.023, 2.25         # training.py: anvil_defaults
R92_ADAM_LR, R92_ADAM_WD, R92_ADAM_EPS = 0.008, 0.005, 1e-10  # training.py: adam_defaults
R92_PERIOD4 = 336                                # ngram_table.py: NGRAM_ADAM_PERIOD4_START
R92_NGRAM = dict(lr_mul=70.0, wd_mul=5.0, wd_mul4=10.0, beta2=0.95)  # ngram_table.py: NGRAM_*
R92_VALUE_EMBED = dict(lr_mul=70.0, betas=(0.75, 0.95), wd_mul=5.0, wd_mul4=10.0)  # training.py: VALUE_EMBED_*


def r92_boundaries():
    """schedule.py TrainingSchedule: stage ends from the durations over the scheduled steps, the
    growth steps added to every end after the growth stage, the extension to the total."""
    durations = [d / sum(R92_DURATIONS) for d in R92_DURATIONS]
    stage_durations = [durations[0], durations[1], durations[2] - R92_TAPER, R92_TAPER]
    total = R92_SCHEDULED + R92_GROWTH + R92_EXTENSION
    ends = [0, *[round(c * R92_SCHEDULED) for c in accumulate(stage_durations)], total]
    ends[R92_GROWTH_STAGE + 1:-1] = [e + R92_GROWTH for e in ends[R92_GROWTH_STAGE + 1:-1]]
    return list(pairwise(ends))


R92_BOUNDS = r92_boundaries()
R92_TOTAL = R92_BOUNDS[-1][1]
R92_MAIN = R92_SCHEDULED + R92_GROWTH           # the steps the LR cooldown spans


def r92_stage(step):
    """(stage index, fraction of the stage done): TrainingSchedule.lookup."""
    for i, (start, end) in enumerate(R92_BOUNDS):
        if step < end:
            return i, (step - start) / (end - start)
    return len(R92_BOUNDS) - 1, 1.0


def r92_lr(step):
    """TrainingSchedule.get_lr."""
    i, _ = r92_stage(step)
    lr = R92_STAGES[i][3]
    start = int(R92_MAIN * (1 - R92_COOLDOWN_FRAC))
    if step >= start:
        t = min(1.0, (step - start) / (R92_MAIN - start))
        lr = lr * (1 - t) + R92_LR_FLOOR * t
    return lr


def r92_rail_beta(step):
    """schedule.get_rail_beta: ANVIL's Nesterov lookahead, and its fast rail's beta before the engage step."""
    cd_start = R92_TOTAL - R92_RAIL["cooldown"]
    if step < R92_RAIL["warmup"]:
        return R92_RAIL["low"] + step / R92_RAIL["warmup"] * (R92_RAIL["high"] - R92_RAIL["low"])
    if step > cd_start:
        return R92_RAIL["high"] - (step - cd_start) / R92_RAIL["cooldown"] * (R92_RAIL["high"] - R92_RAIL["low"])
    return R92_RAIL["high"]


def r92_weights(step):
    """[t+1, t+2, t+3, prefix] loss weights: TrainingSchedule's mtp_weights and prefix_weight."""
    i, t = r92_stage(step)
    _, _, _, _, start, end, prefix = R92_STAGES[i]
    mtp = [a + (b - a) * t for a, b in zip(start, end)]
    return mtp + [0.0] * (3 - len(mtp)) + [prefix[min(len(prefix) - 1, int(t * len(prefix)))]]


def r92_candidates(step):
    """sampled_softmax.candidate_count_at (0: the full softmax)."""
    i, _ = r92_stage(step)
    if i not in R92_CANDIDATES:
        return 0
    start, end = R92_BOUNDS[i]
    counts = R92_CANDIDATES[i]
    return counts[(step - start) * len(counts) // (end - start)]


def r92_table_updates(step):
    """ngram_table.is_update_step: the n-gram table's (and the value embeddings') Adam events."""
    return step % 4 == 3 if step >= R92_PERIOD4 else step % 2 == 1


R92_EMA_WINDOW, R92_EMA_BLEND = 298, 0.65       # tail_average.py: TAIL_EMA_WINDOW, TAIL_EMA_BLEND
R92_AVG_WINDOW, R92_AVG_RATE = 250, 4.0 / 53.0  # tail_average.py: TAIL_AVG_WINDOW, TAIL_AVG_RATE (value embeds too)
R92_BANK_WINDOW, R92_BANK_BLEND, R92_RICHARDSON = 298, 0.55, 0.2007  # tail_average.py: BANK_BLEND_*, RICHARDSON_W


def r92_accumulators(n=R92_TOTAL):
    """tail_average.TailAverages: per accumulator in ship order, its (step, rate) ticks (the first
    seeds), the weights it covers, its blend (None: the weights replaced) and whether they are
    renormalized (DECONTRACTION_LABELS: the embedding, the head and the banks)."""
    r = 2.0 / (R92_EMA_WINDOW + 1)
    ema = [(s, r if s in (n - R92_EMA_WINDOW, n - 1) else -math.expm1(2.0 * math.log1p(-r)))
           for s in range(n - R92_EMA_WINDOW, n) if s % 2 == 1 or s == n - R92_EMA_WINDOW]
    tail = [(s, R92_AVG_RATE) for s in range(n - R92_AVG_WINDOW, n) if (n - 1 - s) % 4 == 0]
    value = [(s, R92_AVG_RATE) for s in range(n - R92_AVG_WINDOW, n) if r92_table_updates(s)]
    bank_rate = 2.0 / (R92_BANK_WINDOW // 4 + 1)
    bank = [(s, bank_rate) for s in range(n - R92_BANK_WINDOW, n) if s % 4 == 1 or s >= n - 2]
    return [("embed_head", ema, R92_EMA_BLEND, True), ("vo_mlp", tail, None, True),
            ("value_embeds", value, None, False), ("qk", bank, R92_BANK_BLEND, True),
            ("vo_mlp", bank, R92_BANK_BLEND - R92_RICHARDSON, True)]


def record92(step):
    """Everything the comparison reads of record 92 at `step`."""
    i, _ = r92_stage(step)
    units, max_len, windows, *_ = R92_STAGES[i]
    engaged = step >= R92_ENGAGE
    period4 = step >= R92_PERIOD4
    lr = r92_lr(step)
    ve_betas = tuple(b ** 2 for b in R92_VALUE_EMBED["betas"]) if period4 else R92_VALUE_EMBED["betas"]
    return dict(
        tokens=units * UNIT // GPUS, max_doc_len=max_len, windows=windows, candidates=r92_candidates(step),
        lr=lr, mu=r92_rail_beta(step), fast_beta=R92_FAST_BETA if engaged else r92_rail_beta(step),
        blend=R92_FAST_WEIGHT if engaged else 1.0, weights=r92_weights(step),
        adam_updates=step % 2 == 1, table_updates=r92_table_updates(step),
        ngram=(R92_ADAM_LR * lr * R92_NGRAM["lr_mul"], R92_NGRAM["beta2"] ** (2 if period4 else 1),
               R92_ADAM_WD * (R92_NGRAM["wd_mul4"] if period4 else R92_NGRAM["wd_mul"])),
        value_embeds=(R92_ADAM_LR * lr * R92_VALUE_EMBED["lr_mul"], ve_betas,
                      R92_ADAM_WD * (R92_VALUE_EMBED["wd_mul4"] if period4 else R92_VALUE_EMBED["wd_mul"])),
        matrices=(R92_ANVIL_LR * lr, R92_ANVIL_WD),
        tied=step <= (R92_BOUNDS[R92_SPLIT_STAGE][0] | 1))  # split_step: its update is the last tied one


# -----------------------------------------------------------------------------------------------
# Record 89, restated from its train_gpt.py
# -----------------------------------------------------------------------------------------------

R89_SCHEDULED, R89_EXTENSION = 1270, 15          # Hyperparameters: num_scheduled / num_extension_iterations
R89_COOLDOWN_FRAC, R89_LR_FLOOR = 0.60, 0.15     # training_schedule's cooldown_frac; get_lr's floor
R89_SPLIT_STAGE = 2                              # TrainingSchedule's split_embed_stage
# TRAINING_STAGES: (batch units, train_max_seq_len, windows, lr_mul, mtp start, mtp end, prefix start, end)
R89_STAGES = [
    (8, 896, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0], 0.25, 0.25),
    (16, 2048, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0], 0.25, 0.0),
    (24, 2048, (5, 11), 1.73, [1.0], [1.0], 0.0, 0.0),
    (24, 2048, (6, 13), 1.0, [1.0], [1.0], 0.0, 0.0),
]
R89_MOMENTUM = dict(warmup=300, cooldown=50, low=0.85, high=0.95)  # get_muon_momentum's defaults


def r89_boundaries():
    ends = [0, *[round(c * R89_SCHEDULED) for c in accumulate([1 / 3, 1 / 3, 1 / 3])], R89_SCHEDULED + R89_EXTENSION]
    return list(pairwise(ends))


R89_BOUNDS = r89_boundaries()
R89_TOTAL = R89_BOUNDS[-1][1]


def record89(step):
    for i, (start, end) in enumerate(R89_BOUNDS):
        if step < end:
            t = (step - start) / (end - start)
            break
    units, max_len, windows, lr_mul, start_w, end_w, p0, p1 = R89_STAGES[i]
    lr = lr_mul
    cd_start = int(R89_SCHEDULED * (1 - R89_COOLDOWN_FRAC))
    if step >= cd_start:
        u = min(1.0, (step - cd_start) / (R89_SCHEDULED - cd_start))
        lr = lr * (1 - u) + R89_LR_FLOOR * u
    m = R89_MOMENTUM
    momentum = m["high"]
    if step < m["warmup"]:
        momentum = m["low"] + step / m["warmup"] * (m["high"] - m["low"])
    elif step > R89_TOTAL - m["cooldown"]:
        momentum = m["high"] - (step - (R89_TOTAL - m["cooldown"])) / m["cooldown"] * (m["high"] - m["low"])
    mtp = [a + (b - a) * t for a, b in zip(start_w, end_w)]
    return dict(tokens=units * UNIT // GPUS, max_doc_len=max_len, windows=windows, candidates=0, lr=lr,
                momentum=momentum, weights=mtp + [0.0] * (3 - len(mtp)) + [p0 + (p1 - p0) * t],
                adam_updates=step % 2 == 1, tied=step <= (R89_BOUNDS[R89_SPLIT_STAGE][0] | 1))


# -----------------------------------------------------------------------------------------------
# The presets, read step by step through train_gpt.py's schedules
# -----------------------------------------------------------------------------------------------

def counted_updates(every_at, steps):
    """The steps whose update is due when an optimizer updates on every every_at(step)-th call of
    its step() (optim.Adam's step_every, SparseTables' cadence), counting calls since the last."""
    due, calls = [], 0
    for step in range(steps):
        calls += 1
        if calls >= every_at(step):
            due.append(True)
            calls = 0
        else:
            due.append(False)
    return due


def config(name, *overrides):
    return tg.parse_config(["--preset", name, *overrides])


def preset_steps(h):
    """Per step, what a config's schedules give, in the record functions' terms."""
    N = h.num_iterations
    weights = tg.step_target_weights(h, "cpu")
    adam = counted_updates(lambda step: h.adam_step_every, N)
    tables = counted_updates(lambda step: tg.table_schedule(h, step).step_every, N)
    rows = []
    for step in range(N):
        stage = h.stages[tg.stage_index(h, step)]
        lr = tg.lr_multiplier(h, step)
        table = tg.table_schedule(h, step)
        row = dict(tokens=stage.tokens_per_rank, max_doc_len=stage.max_doc_len,
                   windows=tg.attention_windows(h, step), candidates=stage.candidates, lr=lr,
                   weights=weights[step].tolist(), adam_updates=adam[step], table_updates=tables[step],
                   ngram=(h.ngram_lr * lr, table.ngram_beta2, h.ngram_wd * table.decay_mult),
                   value_embeds=(h.value_embed_lr * lr, table.value_embed_betas, h.value_embed_wd * table.decay_mult),
                   matrices=(h.matrix_lr * lr, h.matrix_wd), tied=step < tg.untie_step(h),
                   **tg.momentum_schedule(h, step))
        rows.append(row)
    return rows


def mismatches(ours, theirs, keys):
    """The steps (at most a few per key) where a value differs beyond float rounding."""
    def same(a, b):
        if isinstance(a, (tuple, list)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if isinstance(a, float) or isinstance(b, float):
            return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)
        return a == b
    found = {}
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for key in keys:
            if not same(a[key], b[key]) and len(found.setdefault(key, [])) < 3:
                found[key].append((step, a[key], b[key]))
    return found


R92_KEYS = ("tokens", "max_doc_len", "windows", "candidates", "lr", "mu", "fast_beta", "blend", "weights",
            "adam_updates", "table_updates", "ngram", "value_embeds", "matrices", "tied")
R89_KEYS = ("tokens", "max_doc_len", "windows", "candidates", "lr", "momentum", "weights", "adam_updates", "tied")


def test_record_92_restatement_matches_its_published_milestones():
    """The restatement's own milestones, as record 92's code and documentation state them:
    stages from steps 320, 681, 1107 and 1174 of 1194, the cooldown from step 234 to the floor at
    1174, the untie after step 1175's update, the sampled softmax widening at 965."""
    assert R92_BOUNDS == [(0, 320), (320, 681), (681, 1107), (1107, 1174), (1174, 1194)]
    assert int(R92_MAIN * (1 - R92_COOLDOWN_FRAC)) == 234 and R92_MAIN == 1174
    assert [r92_candidates(s) for s in (680, 681, 964, 965, 1106, 1107)] == [10240, 14336, 14336, 24576, 24576, 0]
    assert record92(1175)["tied"] and not record92(1176)["tied"]
    assert [round(r92_weights(s)[3], 6) for s in (319, 320, 410, 411, 500, 501, 590, 591, 680, 681)] == [
        0.25, 0.2, 0.2, 0.15, 0.15, 0.1, 0.1, 0.05, 0.05, 0.0]


@pytest.mark.parametrize("name", ["speedrun", "1gpu"])
def test_speedrun_is_record_92_at_every_step(name):
    h = config(name)
    ours = preset_steps(h)
    assert h.num_iterations == R92_TOTAL
    theirs = [record92(step) for step in range(R92_TOTAL)]
    assert mismatches(ours, theirs, R92_KEYS) == {}, "(step, the preset's, record 92's)"


def ema_coefficients(ticks, changed_at):
    """{step whose update made the weights: its weight in the average} after the (step, rate)
    ticks, the first seeding: each tick samples the weights as the last update before it left
    them (changed_at(step) says whether the weights change at a step's update)."""
    coefficients = {}
    for i, (step, rate) in enumerate(ticks):
        made = max(s for s in range(step + 1) if changed_at(s))
        if i == 0:
            coefficients = {made: 1.0}
            continue
        coefficients = {k: v * (1 - rate) for k, v in coefficients.items()}
        coefficients[made] = coefficients.get(made, 0.0) + rate
    return coefficients


def test_speedrun_averages_are_record_92s_ships():
    """Each average gives every state of its weights the same share in what it ships as record
    92's accumulator does (the embedding and the head change on odd steps, the value embeddings
    at the tables' updates, the banks every step), with the same blend, order and renormalized
    weights, the norms restored per bank."""
    h = config("speedrun")
    N = h.num_iterations
    averages = optim.WeightAverages(h.averages, None, N)
    changed = {"embed_head": lambda s: s % 2 == 1, "value_embeds": r92_table_updates}
    assert len(h.averages) == len(r92_accumulators()) and h.average_norms == "bank"
    for a, (params, ticks, blend, renormalized) in zip(h.averages, r92_accumulators()):
        ours = [(s, a.rate) for s in range(N) if averages.samples_at(a, s)]
        changed_at = changed.get(params, lambda s: True)
        assert ema_coefficients(ours, changed_at) == pytest.approx(ema_coefficients(ticks, changed_at), rel=1e-9)
        assert (a.params, a.blend) == (params, 1.0 if blend is None else pytest.approx(blend))
    renormalized = {params for params, _, _, renormalized in r92_accumulators() if renormalized}
    assert {a.params for a in h.averages if a.renormalize} == renormalized


def test_record89_is_record_89_at_every_step():
    h = config("record89")
    ours = preset_steps(h)
    assert h.num_iterations == R89_TOTAL == 1285
    theirs = [record89(step) for step in range(R89_TOTAL)]
    assert mismatches(ours, theirs, R89_KEYS) == {}, "(step, the preset's, record 89's)"


@pytest.mark.parametrize("key,value", [
    ("--anvil_fast_beta_follows_mu", "false"), ("--anvil_mu_rise", "0.2"), ("--matrix_wd", "1.2"),
    ("--ngram_step_every", "1"), ("--cooldown_start", "0.2"), ("--untie_frac", "0.984"),
    ("--value_embed_lr", "0.6"), ("--anvil_blend_start", "0.42"), ("--adam_step_every", "1"),
])
def test_a_changed_value_fails_the_comparison(key, value):
    """The comparison is not blind: each of these one-key changes (several of them the preset's
    earlier values) shows up as a mismatch."""
    ours = preset_steps(config("speedrun", f"{key}={value}"))
    assert mismatches(ours, [record92(step) for step in range(R92_TOTAL)], R92_KEYS) != {}


def test_stage_table_changes_fail_the_comparison():
    """The taper at 32,768 tokens (its earlier value) or the prefix weight stepped by thirds."""
    for index, key, value in ((4, "tokens_per_rank", 32_768), (1, "prefix_weight_levels", 3)):
        h = config("speedrun")
        setattr(h.stages[index], key, value)
        ours = preset_steps(h)
        assert mismatches(ours, [record92(step) for step in range(R92_TOTAL)], R92_KEYS) != {}, key


def test_candidate_walk_continues_as_record_92s_sweep():
    """sampled_softmax.CandidateBuilder: each step keeps the first `need` non-targets of a window
    of min(V, int(1.7 need) + 256) ids of the sweep k -> 20011 k mod V, and the next step's window
    starts after it. Three steps of one slice through the trainer's walk give those sets."""
    V, count = tg.PADDED_VOCAB_SIZE, 600
    gen = torch.Generator().manual_seed(3)
    sweep = [(20011 * k) % V for k in range(V)]
    offset = start = sampled_softmax.candidate_start(2, 8)
    for _ in range(3):
        targets = torch.randint(0, V, (64, 3), generator=gen)
        targets[:5, 1:] = -1
        marked = set(targets[targets >= 0].tolist())
        need = count - len(marked)
        draw = min(V, int(need * 1.7) + 256)
        window = [sweep[(offset + j) % V] for j in range(draw)]
        negatives = [i for i in window if i not in marked][:need]
        offset = (offset + draw) % V
        expected = sorted(marked | set(negatives))
        got = sampled_softmax.candidate_columns(targets, count, torch.as_tensor(start))
        assert got.tolist() == expected
        start = sampled_softmax.candidate_walk_after(targets, count, torch.as_tensor(start))
        assert int(start) == offset
    full = torch.arange(count).reshape(-1, 3)          # the targets fill the count: nothing drawn, no move
    assert int(sampled_softmax.candidate_walk_after(full, count, torch.as_tensor(offset))) == offset
