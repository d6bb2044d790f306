"""The sparse tables (machinery/sparse_tables.py): the n-gram table's and the sparse value embeddings'
gradient entries, their sums per row, sparse Adam on the touched rows at the table's cadence
and late phase, the host table with its device cache and the table split across processes, each
against a dense or single-process statement of the same training."""
import math
import os
import sys
import types

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from launch import cpu_env, run_distributed  # noqa: E402
from tiny_runs import (NGRAM, SPARSE_VALUES, TINY, cpu_trainer, data_args, final_line, run_trainer,  # noqa: E402
                       synthetic_documents, tiny_config, tiny_model, with_every_sublayer_on)

import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from data.shards import write_shard  # noqa: E402
from machinery import ngram_table, sparse_tables  # noqa: E402
from machinery.config import ConfigError  # noqa: E402


def test_ngram_entries_are_the_tables_gradient(shards):
    """The sink's entries, summed per row, are the table's dense gradient (the same backward
    with the table itself differentiable), and no dense gradient is kept in training."""
    h = tiny_config(data_args(shards) + NGRAM)
    model = tiny_model(h)
    s = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])[0]
    model.ngram.table.requires_grad_(True)
    objective, _ = model(s.tokens, s.targets, tg.AttentionArgs(s.cu_seqlens, 128, 256),
                         tg.target_weights(h.stages[0], "cpu"))
    objective.backward()
    rows = model.ngram.rows_of(s.tokens, ngram_table.document_starts(s.tokens)).reshape(-1)
    entries = model.ngram.sink.grad[:512].reshape(rows.numel(), -1)
    summed = torch.zeros_like(model.ngram.table).index_add_(0, rows, entries)
    assert rows.unique().numel() > 500 and entries.abs().sum() > 0
    torch.testing.assert_close(summed, model.ngram.table.grad, rtol=1e-5, atol=1e-9)
    assert not any(p is model.ngram.table for p in model.parameters()), "the table is no parameter"


def test_sparse_value_embedding_entries_are_the_tables_gradient(shards):
    """With value_embed_sparse, each value-embedding table's sink entries, summed per token, are
    the table's dense gradient (the same backward with the table differentiable), no dense
    gradient of a table is kept in training, and Adam's groups leave the tables out."""
    h = tiny_config(data_args(shards) + SPARSE_VALUES + ["--num_value_embeds=1", "--compute_dtype=float32"])
    model = tiny_model(h)
    s = TrainLoader(tg.shards_of(h.train_files), 512).next_batch(512, 256, 1, [0])[0]
    (ve,), (sink,) = model.value_embeds, model.value_sinks
    assert not ve.weight.requires_grad
    ve.weight.requires_grad_(True)
    objective, _ = model(s.tokens, s.targets, tg.AttentionArgs(s.cu_seqlens, 128, 256),
                         tg.target_weights(h.stages[0], "cpu"))
    objective.backward()
    summed = torch.zeros_like(ve.weight).index_add_(0, s.tokens.long(), sink.grad[:512])
    assert sink.grad[:512].abs().sum() > 0
    torch.testing.assert_close(summed, ve.weight.grad, rtol=1e-5, atol=1e-9)
    trainer = cpu_trainer(h)
    trained = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
    assert all(p is not q for p in trained for q in [*trainer.model.value_sinks, trainer.model.value_embeds[0].weight])
    assert trainer.model.num_parameters() == tiny_model(tiny_config(data_args(shards))).num_parameters()


def test_vocab_row_gradients_sum_per_row_and_list_the_rows_they_hold():
    """Two micro-batches' entries, repeats included, summed per row (a plain index_add_
    reference); among candidate rows, those with a gradient as RowGroups at the candidates'
    capacity (each once, sorted) with their sums slot by slot: a candidate whose sum is zero
    (row 9: never touched; row 12: its entries cancel) is left out."""
    g = torch.Generator().manual_seed(0)
    pending = sparse_tables.VocabRowGradients(50, 3, torch.device("cpu"), kernels.add_row_sums_reference_)
    expected = torch.zeros(50, 3)
    for rows in (torch.tensor([7, 3, 7, 41, 12]), torch.tensor([3, 0, 12])):
        grads = torch.randn(len(rows), 3, generator=g)
        if len(rows) == 3:
            grads[2] = -pending.sums[12]   # row 12's entries add up to zero
        pending.add(kernels.distinct_rows(rows), grads)
        expected.index_add_(0, rows, grads)
    torch.testing.assert_close(pending.sums, expected)
    assert pending.entries == 8
    groups, summed = pending.touched(torch.tensor([0, 3, 7, 9, 12, 41]))
    assert groups.distinct.numel() == 6 and int(groups.count) == 4
    assert groups.distinct[:4].tolist() == [0, 3, 7, 41]
    torch.testing.assert_close(summed[:4], expected[[0, 3, 7, 41]])
    assert not summed[4:].any()
    pending.clear()
    assert not (pending.sums.any() or pending.entries)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_value_table_sums_travel_in_the_tables_dtype(monkeypatch, dtype):
    """Across processes, a value table's row sums are all-reduced in the table's dtype (a bf16
    table's rounded once, as the dense gradients travel), then divided in fp32 by the steps and
    the processes for the update. Two processes with equal sums stand in for the all-reduce."""
    pending = sparse_tables.VocabRowGradients(64, 4, torch.device("cpu"), kernels.add_row_sums_reference_)
    pending.sums[[3, 10, 40]] = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)) / 3
    travelled = []

    def all_reduce_of_two_equal_processes(tensor):
        travelled.append(tensor.dtype)
        tensor.mul_(2)
    monkeypatch.setattr(sparse_tables.dist, "all_reduce", all_reduce_of_two_equal_processes)

    class RecordingAdam:
        table = torch.zeros(64, 4, dtype=dtype)

        def step_summed(self, groups, summed):
            self.update = groups, summed
    adam, trainer_tables = RecordingAdam(), types.SimpleNamespace(pg=types.SimpleNamespace(world_size=2), calls=3)
    sparse_tables.SparseTables._step_value_table(trainer_tables, adam, pending, torch.tensor([3, 10, 20, 40]))
    assert travelled == [dtype]
    groups, summed = adam.update
    assert int(groups.count) == 3 and groups.distinct[:3].tolist() == [3, 10, 40]
    assert summed.dtype == torch.float32
    expected = pending.sums[[3, 10, 40]].to(dtype).double() * 2 / (3 * 2)
    torch.testing.assert_close(summed[:3].double(), expected, rtol=2 ** -23, atol=0)   # one fp32 division
    assert (expected != pending.sums[[3, 10, 40]].double() / 3).any() == (dtype == torch.bfloat16)


def test_sparse_value_embeddings_update_by_sparse_adam_from_the_steps_mean_entries(shards):
    """An update every 2nd step: the value-embedding table keeps its values at step 0, and at
    step 1 its touched rows take one beta1 = 0 Adam step with a per-row second moment from the
    mean of the two steps' entries (a float64 reference), cautious decay included; every other
    row keeps its value bit for bit."""
    h = tiny_config(data_args(shards) + SPARSE_VALUES + ["--ngram_step_every=2", "--value_embed_wd=3.0",
                                                         "--compute_dtype=float32"])
    trainer = cpu_trainer(h)
    with_every_sublayer_on(trainer.model)   # a gradient for the table from the first step on
    table = trainer.model.value_embeds[0].weight
    table.requires_grad_(True)     # the reference: its dense gradient, summed over the steps (no optimizer has it)
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    start = table.detach().clone()
    trainer.advance_to(0)
    trainer.train_step(0, loader.next_batch(512, 256, 1, [0]))
    assert torch.equal(table, start) and trainer.tables.value_grads[0].sums.any(), "step 0's gradients wait"
    trainer.advance_to(1)
    trainer.train_step(1, loader.next_batch(512, 256, 1, [0]))
    g = table.grad.double() / 2
    beta2, lr, wd = h.value_embed_betas[1], h.value_embed_lr * tg.lr_multiplier(h, 1), h.value_embed_wd
    v = (1 - beta2) * g.square().mean(1, keepdim=True)
    u = g / ((v / (1 - beta2)).sqrt() + h.adam_eps)
    theta = start.double()
    expected = theta - lr * lr * wd * theta * (u * theta > 0) - lr * u
    touched = (g != 0).any(1)
    assert (lr * lr * wd * theta.abs() * (u * theta > 0))[touched].max() > 1e-7, "the decay matters here"
    torch.testing.assert_close(table[touched].double(), expected[touched], rtol=1e-5, atol=1e-7)
    assert torch.equal(table[~touched].detach(), start[~touched]) and 0 < touched.sum() < table.shape[0]
    pending = trainer.tables.value_grads[0]
    assert trainer.tables.value_adams[0].events == 1 and not (pending.sums.any() or pending.entries)


@pytest.mark.parametrize("step_every,dtype", [(1, "float32"), (2, "float32"), (1, "bfloat16")])
def test_the_ngram_table_moves_only_the_rows_a_batch_touches(shards, step_every, dtype):
    """Steps of the trainer with the table: the touched rows move (every step_every-th step,
    from the entries of those steps), every other row keeps its value bit for bit, and the
    dense optimizers never see the table or its sink."""
    h = tiny_config(data_args(shards) + NGRAM + [f"--ngram_step_every={step_every}", "--ngram_lr=0.05",
                                                 f"--ngram_dtype={dtype}"])
    trainer = cpu_trainer(h)
    table = trainer.model.ngram.table
    assert table.dtype == getattr(torch, dtype)
    assert all(p is not trainer.model.ngram.sink for opt in trainer.optimizers for g in opt.param_groups
               for p in g["params"])
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    touched = torch.zeros(table.shape[0], dtype=torch.bool)
    before = table.clone()
    for step in range(2):
        trainer.advance_to(step)
        batch = loader.next_batch(512, 256, 1, [0])
        touched[trainer.model.ngram.rows_of(batch[0].tokens, ngram_table.document_starts(batch[0].tokens)).reshape(-1)] = True
        trainer.train_step(step, batch)
        moved = (table != before).any(1)
        if step + 1 < step_every:
            assert not moved.any(), "the table waits for its step"
    assert torch.equal(moved, touched) and 0 < touched.sum() < table.shape[0]


def test_the_ngram_tables_late_phase_changes_its_beta2_and_cadence(shards):
    """From a table phase's start the table's Adam events use its beta2 and come every
    step_every steps (the entries between them wait); each event's decay enters the
    catch-up table."""
    phase = '[{"start":1,"ngram_beta2":0.81,"value_embed_beta2":0.64,"step_every":2}]'
    h = tiny_config(data_args(shards) + NGRAM + ["--ngram_lr=0.05", "--ngram_beta2=0.9", f"--table_phases={phase}"] +
                    SPARSE_VALUES + ["--value_embed_betas=[0.8,0.8]"])
    trainer = cpu_trainer(h)
    tables = [trainer.model.ngram.table] + [ve.weight for ve in trainer.model.value_embeds]
    adams = [trainer.tables.ngram_adam] + trainer.tables.value_adams
    loader = TrainLoader(tg.shards_of(h.train_files), 512)
    betas, moved = [], []
    for step in range(4):
        trainer.advance_to(step)
        before = [t.clone() for t in tables]
        trainer.train_step(step, loader.next_batch(512, 256, 1, [0]))
        betas.append([adam.beta2 for adam in adams])
        moved.append([not torch.equal(t, b) for t, b in zip(tables, before)])
    assert betas == [[0.9, 0.8], [0.81, 0.64], [0.81, 0.64], [0.81, 0.64]]
    # (the value embeddings' first gradient is 0: they reach the loss through zero-initialized projections)
    assert moved == [[True, False], [False, False], [True, True], [False, False]], "value embeddings on its cadence"
    assert adams[0].log_decay == pytest.approx([0.0, math.log(0.9), math.log(0.9) + math.log(0.81)])
    assert adams[1].log_decay == pytest.approx([0.0, math.log(0.8), math.log(0.8) + math.log(0.64)])
    assert len(trainer.tables.ngram_entries) == 1 and trainer.tables.value_grads[0].sums.any(), \
        "step 3's gradients wait for the next event"


def test_a_host_table_with_a_device_cache_trains_bit_for_bit_as_a_resident_one(shards, tmp_path):
    """The table in host memory with a device cache (of the fewest rows allowed, so that rows
    go back to the host and return, and with the next step's rows prefetched) against the table
    on the device: the same step losses, validation losses, table and optimizer state, bit for
    bit, across Adam events every 2nd step. (Documents over a wide vocabulary: many n-grams.)"""
    from ngram_dist_worker import train_and_validate
    rng = np.random.default_rng(1)
    write_shard(tmp_path / "w_train_000001.bin", synthetic_documents(rng, 30_000, vocab=50_000))
    write_shard(tmp_path / "w_val_000000.bin", synthetic_documents(rng, 4_096, vocab=50_000))
    steps = 8
    args = [f"--train_files={tmp_path}/w_train_*.bin", f"--val_files={tmp_path}/w_val_*.bin", "--ngram_rows=65536",
            "--smear_gate=true", "--ngram_lr=0.05", "--batch_ranks=2", "--ngram_step_every=2",
            f"--num_iterations={steps}"]
    h = tiny_config(args)
    resident = cpu_trainer(h)
    losses, val = train_and_validate(resident, h, steps)
    least = sparse_tables.min_cache_rows(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")))
    assert least == 2 * (3 * 2 * 512 + 1024)
    h = tiny_config(args + [f"--ngram_cache_rows={least}"])
    host = cpu_trainer(h)
    cache = host.tables.fetcher
    loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
    batches = [loader.next_batch(512, h.stages[tg.stage_index(h, step)].max_doc_len, 2, [0, 1])
               for step in range(steps + 1)]
    host_losses = []
    for step in range(steps):
        host.advance_to(step)
        host_losses.append(host.train_step(step, batches[step]).tolist())
        cache.prefetch(batches[step + 1])
    host_val = host.validate(tg.validation_data(h, host.pg, tg.shards_of(h.val_files)), steps, False)
    assert host_losses == losses and host_val == val
    assert cache.rounds > 0 and 0 < cache.hits < cache.lookups, "rows left the cache, and some were found there"
    assert host.model.ngram.table.device.type == "cpu" and host.model.ngram.fetched.shape[0] == least
    cache.flush()
    assert torch.equal(host.model.ngram.table, resident.model.ngram.table)
    adam = resident.tables.ngram_adam
    assert torch.equal(cache.moment, adam.moment) and torch.equal(cache.last, adam.last)
    assert (resident.model.ngram.table != 0).any(1).sum() > least, "the table outgrew the cache"


def test_a_host_tables_cache_keeps_pending_rows_and_lets_the_least_recently_used_go():
    """A training slice's rows stay cached until release(), however many rows later fetches
    need; the rows that go back to the host are the least recently used; released, they may go."""
    table = ngram_table.NgramTable(4096, 8, max_tokens=64, placement=ngram_table.TablePlacement(cache_rows=256))
    cache = sparse_tables.HostNgramRows(table, tg.optim.SparseRowAdam(table.fetched, lr=0.1), torch.device("cpu"))
    slice_of = lambda seed: torch.randint(1, 50_000, (64,), generator=torch.Generator().manual_seed(seed))  # noqa: E731
    cached = lambda: set(cache.row_of[cache.row_of >= 0].tolist())  # noqa: E731
    cache.fetch(slice_of(0))                                          # training: pinned
    pending = cached()
    for seed in range(1, 12):      # up to 128 new rows each: 11 of them overflow 256 slots
        cache.fetch(slice_of(seed), training=False)
        assert pending <= cached()
    assert cache.rounds > 0
    cache.release()
    newest = set(ngram_table.ngram_rows(slice_of(11), ngram_table.document_starts(slice_of(11)), 4096).reshape(-1).tolist())
    cache.fetch(slice_of(12), training=False)
    assert not pending <= cached(), "released, the oldest rows go first"
    assert newest <= cached(), "the last slice's rows stay"


def test_a_host_tables_write_back_waits_for_the_device_with_the_sync_check_lifted(monkeypatch):
    """--sync_check makes a host sync inside a training step an error (CUDA's sync debug mode,
    "error" is 2); a host table's write-back waits for the device by design: it waits with the
    mode off (0) and restores it after, so the step's other syncs stay errors."""
    table = ngram_table.NgramTable(4096, 8, max_tokens=64, placement=ngram_table.TablePlacement(cache_rows=256))
    cache = sparse_tables.HostNgramRows(table, tg.optim.SparseRowAdam(table.fetched, lr=0.1), torch.device("cpu"))
    mode = {"now": 2}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda value: mode.update(now=value))
    waits = []
    monkeypatch.setattr(sparse_tables, "synchronize", lambda device: waits.append(mode["now"]))
    for seed in range(12):         # up to 128 new rows each: the cache overflows
        cache.fetch(torch.randint(1, 50_000, (64,), generator=torch.Generator().manual_seed(seed)), training=False)
    assert cache.rounds > 0 and waits and set(waits) == {0} and mode["now"] == 2


def test_an_ngram_table_that_cannot_be_split_or_does_not_fit_is_refused():
    h = tiny_config(["--ngram_rows=2050"])
    with pytest.raises(ConfigError, match="does not split evenly across 4 processes: use a multiple of 4"):
        tg.check_ngram_table(h, tg.ProcessGroup(0, 4, 0, torch.device("cpu")))
    tg.check_ngram_table(tiny_config(["--ngram_rows=2048", "--save_checkpoint=true"]),
                         tg.ProcessGroup(0, 2, 0, torch.device("cpu")))   # a split table is checkpointed whole
    memory = lambda device: 16 * 2**30   # 16 GiB free wherever the table would live
    h = tiny_config(["--ngram_rows=" + str(2 ** 31)])
    with pytest.raises(ConfigError, match=r"--ngram_rows=2147483648 needs 528.0 GiB on the cpu \(all in one "
                                             r"process: 264 B per row.* lower --ngram_rows$"):
        tg.check_ngram_table(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), memory)
    with pytest.raises(ConfigError, match=r"needs 66.0 GiB on the cpu \(268435456 rows in each of 8 "):
        tg.check_ngram_table(h, tg.ProcessGroup(0, 8, 0, torch.device("cpu")), memory)
    one = tg.ProcessGroup(0, 1, 0, torch.device("cpu"))
    h = tiny_config(["--ngram_rows=" + str(2 ** 31), "--ngram_cache_rows=4096"])   # 2 * (2 * 512 + 1024) rows
    with pytest.raises(ConfigError, match=r"needs 536.0 GiB on the cpu \(in host memory: 268 B per row"):
        tg.check_ngram_table(h, one, memory)
    h = tiny_config(["--ngram_rows=65536", "--ngram_cache_rows=4095"])
    with pytest.raises(ConfigError, match="fewer than the 4096 rows the device cache must hold at once .* raise"):
        tg.check_ngram_table(h, one)
    h = tiny_config(["--ngram_rows=65536", "--ngram_cache_rows=4096"])
    tg.check_ngram_table(h, one)
    with pytest.raises(ConfigError, match="host memory, but 2 processes split it: set --ngram_cache_rows=0"):
        tg.check_ngram_table(h, tg.ProcessGroup(0, 2, 0, torch.device("cpu")))


@pytest.mark.parametrize("late", [False, True], ids=["every_step", "late_every_2"])
def test_a_table_split_across_two_processes_trains_as_one(shards, tmp_path, late):
    """Two processes (gloo), each holding half the table's rows and its slices' rows fetched from
    their owners, end with the table, step losses (the mean of the processes' micro-batch losses)
    and validation loss of one process holding the whole table, up to the order of float sums
    (fp32 compute, so that the dense weights' tiny differences are not rounded to bf16). With
    `late`, the table switches to its late beta2 and updates every 2nd step from step 2. The value
    embeddings are sparse too: every process ends with the same tables, those of one process.

    Adam's epsilon is 1e-4 here (the presets' 1e-10 would make the comparison chaotic). Adam
    divides an update by the size of its gradient (per entry, or per row in the sparse tables),
    so any gradient well above eps moves its weights by about lr, in the direction of its sign.
    The two runs sum the same gradients in another order and differ by rounding (up to 1.4e-9 at
    the first step here): with eps 1e-10 (or 1e-6) an entry whose gradient is of rounding size
    can get +lr in one run and -lr in the other, and the difference spreads through the later
    steps (the tables ended up to 1.5e-3 apart, over 100 times the tolerance). With eps 1e-4
    such an entry moves by lr * 1e-9 / 1e-4, about 1e-5 of lr, and the tables agree within a
    tenth of the tolerance, while the n-gram rows' gradients (rms mostly 1e-4 to 2e-3) still get
    Adam-sized updates: a moved entry moves by ~lr, and a row updated from another row's
    gradient ends ~lr off."""
    from ngram_dist_worker import train_and_validate
    steps = 4
    args = ["--preset", "cpu", *TINY, *data_args(shards), *NGRAM, f"--num_iterations={steps}", "--batch_ranks=2",
            "--ngram_lr=0.05", "--compute_dtype=float32", *SPARSE_VALUES, "--adam_eps=1e-4"] + \
        (['--table_phases=[{"start":2,"ngram_beta2":0.95,"value_embed_beta2":0.95,"step_every":2}]'] if late else [])
    res = run_distributed(2, [os.path.join(REPO, "tests", "helpers", "ngram_dist_worker.py"), str(tmp_path), str(steps), *args],
                          env=cpu_env(OMP_NUM_THREADS="1"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    h = tg.parse_config(args)
    trainer = cpu_trainer(h)
    initial = [ve.weight.detach().clone() for ve in trainer.model.value_embeds]
    losses, val = train_and_validate(trainer, h, steps)
    table = trainer.model.ngram.table
    assert [r["first_row"] for r in ranks] == [0, table.shape[0] // 2]
    split = torch.cat([r["shard"] for r in ranks])
    moved = (table != 0).any(1)
    assert 0 < moved.sum() < table.shape[0] and torch.equal((split != 0).any(1), moved)
    torch.testing.assert_close(split, table, rtol=1e-4, atol=1e-5)
    for ve, start, one, other in zip(trainer.model.value_embeds, initial, ranks[0]["values"], ranks[1]["values"]):
        assert torch.equal(one, other), "every process makes the same update"
        assert ((one - start).abs() > 1e-3).any(1).sum() > 100, "the tables moved"
        torch.testing.assert_close(one, ve.weight.detach(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose((np.array(ranks[0]["losses"]) + ranks[1]["losses"]) / 2, losses, rtol=1e-5)
    assert ranks[0]["val"] == ranks[1]["val"] == pytest.approx(val, rel=1e-5)


def test_a_run_with_the_table_in_host_memory_ends_as_with_it_on_the_device(shards, tmp_path):
    """train_gpt.py end to end with a host table and the smallest device cache (prefetching the
    next step's rows, writing rows back, flushing before the checkpoint): the same final val
    loss as with the table on the device, a hit-rate line, and a checkpoint whose evaluation
    gives the logged val loss."""
    args = ["--preset", "cpu", *TINY, *data_args(shards), "--ngram_rows=65536", "--ngram_lr=0.05",
            "--num_iterations=6"]
    finals = []
    for cache in (0, 4096):
        res = run_trainer([*args, f"--ngram_cache_rows={cache}", f"--log_dir={tmp_path}/{cache}",
                           "--save_checkpoint=true"])
        assert res.returncode == 0, res.stderr
        assert ("n-gram cache: 4096 rows on the device, hit rate" in res.stdout) == (cache > 0)
        finals.append(final_line(next((tmp_path / str(cache)).glob("*.txt"))).split()[1])
    assert finals[0] == finals[1]
    checkpoint = next((tmp_path / "4096").glob("*_model.safetensors"))
    res = run_trainer([f"--eval={checkpoint}"])
    assert res.returncode == 0, res.stderr
    assert f"val_loss:{finals[1].split(':')[1]}" in res.stdout
