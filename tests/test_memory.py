"""The memory budget (memory_budget.MemoryBudget) against what a CPU run holds, item by item, and
against the peak of a CPU run's micro-batch; what it decides for the 1gpu preset on an 80 GB H100
with the n-gram table's pending gradients kept as entries and as row sums; RowGradientSums
against a plain sum of the entries, and the trainer's table update against the update from the
concatenated entries; the gradient sinks cut to a micro-batch's rows."""
import dataclasses
import json
import math
import sys
import weakref

import pytest
import torch
from tiny_runs import NGRAM, REPO, SPARSE_VALUES, cpu_trainer, data_args, tiny_config, with_every_sublayer_on
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, REPO)
import kernels  # noqa: E402
import optim  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from machinery import memory_budget  # noqa: E402
from machinery import sparse_tables  # noqa: E402

H100 = 81_559 * 2**20              # an 80 GB H100 SXM's memory as nvidia-smi reports it (MiB)
HOST = 1024 * 2**30                # a GPU server's host memory
# Averages whose windows cover every step of the tiny run, so each holds its EMAs from step 0.
AVERAGES = [{"params": "embed_head", "window": 30}, {"params": "vo_mlp", "window": 30, "every": 2},
            {"params": "qk", "window": 30}, {"params": "value_embeds", "window": 30}]
# The stated factor between the budget's step (a dry run of the Triton kernels' functions on
# fake tensors) and the peak of a CPU run's micro-batch (the torch references): measured 0.97.
STEP_FACTOR = 1.5


def budget_config(shards, *extra):
    """The tiny model with the n-gram table, sparse value embeddings, averages, the untie at step
    3, an Adam event of the table every 2nd step, two micro-batches a step, CUDA graphs' layout."""
    return tiny_config(data_args(shards) + NGRAM + SPARSE_VALUES + [
        "--cuda_graphs=true", "--untie_frac=0.1", "--ngram_step_every=2", "--batch_ranks=2",
        "--averages=" + json.dumps(AVERAGES), *extra])


def held_by_the_run(trainer):
    """The bytes a CPU trainer holds, by budget item, counted from its own tensors."""
    model = trainer.model
    sinks = model.gradient_sinks()
    params = [p for p in model.parameters() if all(p is not s for s in sinks)]
    state = 0
    for opt in trainer.optimizers:
        for value in (v for per_param in opt.state.values() for v in per_param.values()):
            state += sum(t.nbytes for t in (value if isinstance(value, list) else [value]) if torch.is_tensor(t))
        for pair in getattr(opt, "scratch_buffers", {}).values():
            state += sum(t.nbytes for t in pair)
        for flat, mine in getattr(opt, "buffers", {}).values():
            state += flat.nbytes + (mine.nbytes if mine is not flat else 0)
    pending = trainer.tables.ngram_grads
    return {
        "parameters": sum(p.nbytes for p in params),
        "buffers": sum(b.nbytes for name, b in model.named_buffers()
                       if name not in ("ngram.table", "ngram.fetched", "ngram.slots")),
        "gradients": sum(g.nbytes for g in trainer.graphs.grads.values()),
        "optimizer state": state,
        "weight averages": sum(t.nbytes for ema in trainer.averages.ema for t in ema.values()),
        "gradient sinks": sum(s.nbytes + s.grad.nbytes for s in sinks),
        "value tables' sums": sum(p.sums.nbytes for p in trainer.tables.value_grads)
        + sum(a.moment.nbytes + a.last.nbytes for a in trainer.tables.value_adams),
        "n-gram table": model.ngram.table.nbytes + trainer.tables.ngram_adam.moment.nbytes + trainer.tables.ngram_adam.last.nbytes,
        "pending n-gram gradients": sum(t.nbytes for t in (pending.sums, pending.slot_of, pending.row_of,
                                                           pending.count)),
    }


def train_past_the_untie(h):
    trainer = cpu_trainer(h, fp8=True)     # the FP8 layers' states, as on a GPU
    loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
    for step in range(tg.untie_step(h) + 1):
        trainer.advance_to(step)
        trainer.train_step(step, loader.next_batch(512, 256, 2, [0, 1]))
        trainer.averages.sample(step)
    assert not trainer.model.tied and all(trainer.averages.ema)
    return trainer


def test_the_budget_counts_what_a_cpu_run_holds(shards):
    """Every item the budget knows exactly equals what a CPU run holds after its first steps (the
    head untied, every average sampled, Adam events of every optimizer): the parameters, buffers,
    gradients, optimizer state (Adam's moments and scratch pairs; ANVIL's rails, lane moments and banks), the
    averages' EMAs, the sinks with their gradients, the value tables' sums and row state, the
    n-gram table with its row state, and its pending gradients. (Adam's and the banks' device
    scalars, a few floats, are in neither.)"""
    h = budget_config(shards)
    held = held_by_the_run(train_past_the_untie(h))
    budget = memory_budget.memory_budget(tg, h, 1)
    assert held["optimizer state"] > held["parameters"] > 0 and held["weight averages"] > 0
    assert {item: budget.device[item] for item in held} == held


class PeakBytes(TorchDispatchMode):
    """The most bytes of storages made under it that were alive at once; a storage is alive until
    its last holder (a tensor, or autograd's saved copy) lets go. Storages of `existing` tensors
    are not counted."""

    def __init__(self, existing):
        super().__init__()
        self.counted = {t.untyped_storage().data_ptr() for t in existing}
        self.live = self.peak = 0

    def _gone(self, ptr, nbytes):
        self.counted.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.counted:
                storage = t.untyped_storage()
                self.counted.add(storage.data_ptr())
                self.live += storage.nbytes()
                weakref.finalize(storage, self._gone, storage.data_ptr(), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def test_the_budgets_step_is_a_cpu_micro_batchs_peak_within_the_stated_factor(shards):
    """The budget's step, a dry run at the largest stage (full softmax here), against the bytes a
    CPU trainer's forward and backward of one micro-batch there makes alive at once beyond what it
    holds; and its logits' share, against the logits and their gradient of that stage."""
    h = budget_config(shards, "--batch_ranks=1")
    trainer = cpu_trainer(h)       # bf16 layers (the FP8 references dequantize to fp32: no GPU's memory)
    index = memory_budget.largest_stage(tg, h)
    step, stage = sum(tg.steps_per_stage(h)[:index]), h.stages[index]
    assert stage.candidates == 0 and index == len(h.stages) - 1
    batch = TrainLoader(tg.shards_of(h.train_files), stage.tokens_per_rank).next_batch(
        stage.tokens_per_rank, stage.max_doc_len, 1, [0])
    trainer.advance_to(step)
    trainer.forward_backward(step, batch)          # every gradient made, as after a first step
    model = trainer.model
    held = [*model.parameters(), *model.buffers(), *trainer.graphs.grads.values(),
            *(s.grad for s in model.gradient_sinks()), *vars(trainer.tables.ngram_grads).values(),
            *(p.sums for p in trainer.tables.value_grads)]
    with PeakBytes([t for t in held if torch.is_tensor(t)]) as peak:
        trainer.forward_backward(step, batch)
    budget = memory_budget.memory_budget(tg, h, 1)
    assert 1 / STEP_FACTOR <= budget.step / peak.peak <= STEP_FACTOR, (budget.step, peak.peak)
    logits = stage.tokens_per_rank * tg.PADDED_VOCAB_SIZE * 2       # bf16
    assert logits <= budget.logits <= 2 * logits and budget.logits < budget.step


def entries_kept_as_before(budget, h):
    """The budget with the table's pending gradients as they were kept before RowGradientSums:
    every entry since the last event (2 per token, fp32, and its row), and at the event their
    concatenation, its division by the steps and sum_rows's output, each as large; and the
    sinks' whole zero-filled gradient within the step (a slice's backward)."""
    cadence = max([h.ngram_step_every, *(p.step_every for p in h.table_phases)])
    entries = cadence * h.batch_ranks * 2 * max(s.tokens_per_rank for s in h.stages)
    device = {**budget.device, "pending n-gram gradients": entries * (4 * h.model_dim + 8)}
    passing = {**budget.passing, "table update": 3 * entries * 4 * h.model_dim}
    step = budget.step + budget.device["gradient sinks"] // 2
    return memory_budget.MemoryBudget(device, passing, step, budget.logits, budget.graphs, budget.host)


def stage_alone(h, index):
    """h with stage `index` alone (ending at 1.0) and the head tied or untied as at the stage's
    first step in h."""
    first = sum(tg.steps_per_stage(h)[:index])
    untied = first >= tg.untie_step(h)
    return dataclasses.replace(h, stages=[dataclasses.replace(h.stages[index], end=1.0)],
                               untie_frac=0.0 if untied else 1.0)


@pytest.mark.parametrize("preset", ["speedrun", "1gpu", "1gpu_24gb", "record89", "medium"])
def test_the_budgets_step_is_the_largest_of_its_stages_steps(preset):
    """largest_stage is the stage whose step needs the most memory, and the budget's step is that
    stage's: against each stage's step measured in a config of that stage alone. The speedrun's
    taper, stage 4 (40,960 tokens x the full 50,304), needs 1.2 GiB more than its stage 3 (49,152
    tokens x 24,576 candidates), which has the most tokens."""
    h = tg.parse_config(["--preset", preset])
    alone = [memory_budget.step_memory(tg, memory_budget.dry_run_key(stage_alone(h, i)))[0]
             for i in range(len(h.stages))]
    index = memory_budget.largest_stage(tg, h)
    assert alone[index] == max(alone) and memory_budget.memory_budget(tg, h, 1).step == max(alone)
    if preset == "speedrun":
        assert index == 4 and (alone[4] - alone[3]) / 2**30 > 1


def test_1gpu_on_an_h100_with_its_pending_gradients_summed_per_row_and_as_entries():
    """The 1gpu preset (the table in host memory) on one 80 GB H100, with fp32 weights and the full
    softmax in every stage (its largest step: 49,152 tokens x 50,304 logits). Its late phase's
    entries, kept as before (4 steps x 8 micro-batches x 49,152 tokens x 2 rows x 768 fp32 = 9.7 GB), and
    their update's three copies of them leave less than 2 GiB of the GPU beyond the budget's
    margin; summed per row in one buffer, the budget accepts the run with over 10 GiB to spare.
    Its host memory: the pinned table's 2^37 bytes (130 GB rounded up), under 150 GiB in all."""
    h = tg.parse_config(["--preset", "1gpu", "--param_dtype=float32"])
    h.stages = [dataclasses.replace(s, candidates=0) for s in h.stages]
    budget = memory_budget.memory_budget(tg, h, 1)
    old = entries_kept_as_before(budget, h)
    assert old.device["pending n-gram gradients"] == 4 * 8 * 49_152 * 2 * (768 * 4 + 8)
    assert H100 - 2 * 2**30 < old.device_total(H100), old.device_total(H100) / 2**30
    assert budget.check(H100, HOST) is None and H100 - budget.device_total(H100) > 10 * 2**30
    assert budget.device["pending n-gram gradients"] < old.device["pending n-gram gradients"] + 2**30
    assert budget.passing["table update"] < old.passing["table update"] / 10
    assert budget.host["n-gram table (host)"] == 2**37 and budget.host_total() < 150 * 2**30


def test_medium_fits_8_h100s_in_16_slices_and_not_in_the_public_8():
    """The medium preset on 8 H100s: 819,463,477 fp32 parameters (7 tables of 50,304 x 1024: the
    embedding, the head, 5 value embeddings; the bigram table's 251,520 x 1024; 16 layers of
    (3072 + 1024 + 4096 + 4096) x 1024 matrices; 10 value-embedding gates of 8 x 16; 32 + 8 + 13
    scalars), no host table. The public global batch in 16 slices (two 32,768-token micro-batches
    per GPU) fits with over 5 GiB to spare; in the public's 8 (one 65,536-token slice per GPU) the
    budget's step, about twice as large, does not."""
    h = tg.parse_config(["--preset", "medium"])
    params = 7 * 50_304 * 1024 + 251_520 * 1024 + 16 * 12_288 * 1024 + 10 * 8 * 16 + 32 + 8 + 13
    assert params == 819_463_477
    budget = memory_budget.memory_budget(tg, h, 8)
    assert budget.device["parameters"] == budget.device["gradients"] == 4 * params and not budget.host
    assert budget.check(H100, HOST) is None and H100 - budget.device_total(H100) > 5 * 2**30
    whole = [dict(vars(s), tokens_per_rank=2 * s.tokens_per_rank) for s in h.stages]
    public = tg.parse_config(["--preset", "medium", "--batch_ranks=8", "--stages=" + json.dumps(whole)])
    assert [s.tokens_per_rank for s in public.stages[:4]] == [16_384, 32_768, 49_152, 65_536]
    budget_8 = memory_budget.memory_budget(tg, public, 8)
    assert budget_8.step > 1.9 * budget.step
    assert budget_8.check(H100, HOST).startswith("the run needs ")


def test_the_optimization_preset_fits_an_h100_in_its_8_slices():
    """The optimization preset: 162,203,166 fp32 parameters (the embedding and the head, 50,304 x
    768 each; the 2-row bigram table; 12 layers of (2304 + 768 + 3072 + 3072) x 768 matrices; 6
    skip weights and 12 x 2 residual mixes), no host table; one 65,536-token slice per GPU fits an
    80 GB H100 with over 25 GiB to spare, on 8 processes and on one."""
    h = tg.parse_config(["--preset", "optimization"])
    params = 2 * 50_304 * 768 + 2 * 768 + 12 * (2304 + 768 + 3072 + 3072) * 768 + 6 + 12 * 2
    assert params == 162_203_166
    for processes in (8, 1):
        budget = memory_budget.memory_budget(tg, h, processes)
        assert budget.device["parameters"] == 4 * params and not budget.host
        assert budget.check(H100, HOST) is None and H100 - budget.device_total(H100) > 25 * 2**30


def test_row_gradient_sums_equal_the_entries_summed_per_row():
    """Three micro-batches' entries, rows repeated within and across them, into a buffer of exactly
    as many slots as distinct rows: the sums of each row (a float64 index_add_ reference), each
    row in one slot, divided by the calls; cleared, nothing is left and new rows start at slot 0."""
    g = torch.Generator().manual_seed(0)
    batches = [torch.tensor([5, 9, 5, 0, 63]), torch.tensor([9, 9, 17, 40]), torch.tensor([63, 2, 5])]
    distinct = sorted({int(r) for rows in batches for r in rows})
    sums = sparse_tables.RowGradientSums(64, 3, len(distinct), torch.device("cpu"), kernels.add_row_sums_reference_)
    expected = torch.zeros(64, 3, dtype=torch.float64)
    for rows in batches:
        grads = torch.randn(len(rows), 3, generator=g)
        sums.add(rows, grads)
        expected.index_add_(0, rows, grads.double())
    groups, summed = sums.summed(calls=2)
    rows = groups.distinct[:int(groups.count)]
    assert sorted(rows.tolist()) == distinct and int(groups.count) == len(distinct) == summed.shape[0]
    torch.testing.assert_close(summed.double(), expected[rows] / 2, rtol=1e-6, atol=1e-7)
    sums.clear()
    assert not sums.sums.any() and int(sums.count) == 0 and (sums.slot_of[:64] == -1).all()
    sums.add(torch.tensor([33, 33]), torch.ones(2, 3))
    groups, summed = sums.summed(calls=1)
    assert groups.distinct[:1].tolist() == [33] and summed[0].tolist() == [2.0, 2.0, 2.0]


def test_the_table_update_equals_the_one_from_the_concatenated_entries(shards):
    """An Adam event of the table every 2nd step, two micro-batches a step (four micro-batches of
    entries per event): the table and its row state after the trainer's event against the same
    event made as before, from the concatenation of every micro-batch's entries divided by the
    steps (optim.SparseRowAdam.step). Equal up to the order of the float additions."""
    h = budget_config(shards, "--ngram_lr=0.05")
    trainer = cpu_trainer(h)
    entries = []
    add = trainer.tables.ngram_grads.add
    trainer.tables.ngram_grads.add = lambda rows, grads: (entries.append((rows.clone(), grads.clone())), add(rows, grads))
    loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
    for step in range(2):          # the event of step 1 takes steps 0 and 1
        trainer.advance_to(step)
        trainer.train_step(step, loader.next_batch(512, 256, 2, [0, 1]))
    entries.clear()
    adam = trainer.tables.ngram_adam
    before = (trainer.model.ngram.table.clone(), adam.moment.clone(), adam.last.clone(), adam.events,
              list(adam.log_decay), adam.log_decay_at.clone())
    for step in (2, 3):            # step 3's event takes steps 2 and 3
        trainer.advance_to(step)
        trainer.train_step(step, loader.next_batch(512, 256, 2, [0, 1]))
    assert len(entries) == 4 and adam.events == before[3] + 1
    table = before[0].clone()
    old = optim.SparseRowAdam(table, lr=adam.lr, beta2=adam.beta2, eps=adam.eps, weight_decay=adam.weight_decay)
    old.load_state_dict(dict(moment=before[1], last=before[2], events=before[3], log_decay=before[4],
                             log_decay_at=before[5]))
    rows, grads = (torch.cat(parts) for parts in zip(*entries))
    old.step(rows, grads / 2)
    moved = (table != before[0]).any(1)
    assert moved.sum() > 100 and torch.equal(moved, (trainer.model.ngram.table != before[0]).any(1))
    scale = (table - before[0]).abs().max().item()
    assert (trainer.model.ngram.table - table).abs().max().item() <= 1e-5 * scale
    torch.testing.assert_close(adam.moment, old.moment, rtol=1e-5, atol=0)
    assert torch.equal(adam.last, old.last)


class Shapes(TorchDispatchMode):
    """The first dimension of every tensor the ops under it make on memory of their own (not a
    view or an alias of an input)."""

    def __init__(self):
        super().__init__()
        self.rows = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        self.rows |= {t.shape[0] for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.ndim
                      and t.untyped_storage().data_ptr() not in inputs}
        return out


def test_a_micro_batch_gives_the_sinks_gradients_of_its_own_rows(shards):
    """A stage of 256 tokens with sinks of max_tokens (1024) rows: the micro-batch's backward
    makes no tensor of the sinks' rows (a slice's backward would make a zero-filled one of all of
    them); its gradients land in the first 256 rows of the sinks' whole gradients, which are
    back on the sinks after the step, with every row past 256 still zero."""
    stages = [{"end": 1.0, "tokens_per_rank": 256, "max_doc_len": 256, "short_window": 1, "long_window": 2}]
    h = budget_config(shards, "--stages=" + json.dumps(stages), "--batch_ranks=1")
    trainer = cpu_trainer(h)
    with_every_sublayer_on(trainer.model)      # a gradient for every sink from the first step
    sinks = trainer.model.gradient_sinks()
    rows = tg.max_positions(h)
    assert rows == 1024 and len(sinks) == 2
    loader = TrainLoader(tg.shards_of(h.train_files), 256)
    trainer.advance_to(0)
    trainer.forward_backward(0, loader.next_batch(256, 256, 1, [0]))   # the sinks' gradients made
    whole = [s.grad for s in sinks]
    captured = []
    take = trainer.tables.take_entries
    trainer.tables.take_entries = lambda s: (captured.append([sink.grad[:256].clone() for sink in sinks]), take(s))
    with Shapes() as shapes:
        trainer.forward_backward(0, loader.next_batch(256, 256, 1, [0]))
    assert rows not in shapes.rows and 256 in shapes.rows
    assert all(g.abs().sum() > 0 for g in captured[0])
    assert [s.shape[0] for s in sinks] == [rows, rows] and all(s.grad is g for s, g in zip(sinks, whole))
    assert all(not g.any() for g in whole), "the entries were taken and the sinks cleared"


@pytest.mark.parametrize("rows, pinned", [(1, 1), (3, 4), (4096, 4096), (4097, 8192), (129_952_542_720, 2**37)])
def test_pinned_host_memory_rounds_up_to_a_power_of_two(rows, pinned):
    assert memory_budget.pinned_bytes(rows) == pinned and math.log2(pinned).is_integer()
