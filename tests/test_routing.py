"""The routes of a split n-gram table (sparse_tables.ShardedNgramRows): worked out on the host from
the slices' tokens against a reference made of sets, and worked out ahead by the batch
prefetcher against those of the tokens gathered before each forward, in a 2-process job."""
import os
import sys

import numpy as np
import torch
from launch import cpu_env, run_distributed
from tiny_runs import NGRAM, REPO, SPARSE_VALUES, TINY, data_args, synthetic_documents

sys.path.insert(0, REPO)
import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.shards import write_shard  # noqa: E402
from machinery import ngram_table, sparse_tables  # noqa: E402

STEPS = 3


def test_a_route_asks_each_owner_for_its_rows_and_answers_every_process():
    """Process 1 of 4, a table of 4096 rows (1024 per process), four slices of 300 tokens: it asks
    each process for the distinct rows of its slice that the process holds, and every process
    (itself included) for the distinct rows of that process's slice that it holds, in their order
    (reference: Python sets, sorted)."""
    rank, world, rows = 1, 4, 4096
    table = ngram_table.NgramTable(rows, 8, max_tokens=300, placement=ngram_table.TablePlacement(rank, world))
    router = sparse_tables.ShardedNgramRows(table, None, tg.ProcessGroup(rank, world, rank, torch.device("cpu")))
    g = torch.Generator().manual_seed(0)
    slices = [torch.randint(0, 3000, (300,), generator=g, dtype=torch.int32) for _ in range(world)]
    for s in slices:
        s[::37] = tg.BOS_ID
    route = router.route_of(slices[rank], slices)

    def distinct(tokens):
        return sorted(set(ngram_table.ngram_rows(tokens, ngram_table.document_starts(tokens), rows).reshape(-1).tolist()))
    mine = distinct(slices[rank])
    assert route.send_counts == [sum(1 for r in mine if r // 1024 == p) for p in range(world)]
    assert route.groups.distinct[:int(route.groups.count)].tolist() == mine
    asked = [[r - 1024 for r in distinct(s) if r // 1024 == rank] for s in slices]
    assert route.recv_counts == [len(a) for a in asked] and route.asked.tolist() == sum(asked, [])
    assert sum(route.send_counts) == len(mine) and 0 < min(route.recv_counts)


def test_a_split_tables_gradients_travel_in_its_dtype(monkeypatch):
    """A bf16 table's gradients go to their owners in bf16: each distinct row's entries summed in
    fp32 over the slice, divided by the processes and rounded once (reference: float64 sums per
    row). Process 0 of 2, both holding the same slice, so that what process 1 sends it is what it
    sends itself: the all-to-all is played by copies."""
    rows, dim, tokens = 4096, 8, 300
    table = ngram_table.NgramTable(rows, dim, max_tokens=tokens, dtype=torch.bfloat16, placement=ngram_table.TablePlacement(0, 2))
    router = sparse_tables.ShardedNgramRows(table, kernels.sum_rows_reference, tg.ProcessGroup(0, 2, 0, torch.device("cpu")))
    travelled = []

    def all_to_all_of_two_equal_processes(output, input, output_split_sizes, input_split_sizes):
        travelled.append(input.dtype)
        mine = input[:input_split_sizes[0]]            # what this process sends itself ...
        output[:len(mine)] = mine
        if output_split_sizes == [len(mine)] * 2:      # ... and process 1, the gradients of the same rows
            output[len(mine):] = mine
    monkeypatch.setattr(sparse_tables.dist, "all_to_all_single", all_to_all_of_two_equal_processes)
    g = torch.Generator().manual_seed(2)
    slice_tokens = torch.randint(0, 3000, (tokens,), generator=g, dtype=torch.int32)
    router.fetch(slice_tokens, route=router.route_of(slice_tokens, [slice_tokens, slice_tokens]))
    grads = torch.randn(2 * tokens, dim, generator=g) * 1e-3
    asked, received = router.entries(grads)
    assert travelled == [torch.bfloat16, torch.bfloat16] and received.dtype == torch.bfloat16
    token_rows = table.slice_rows(slice_tokens).reshape(-1)
    mine = sorted(r for r in set(token_rows.tolist()) if r < rows // 2)
    assert asked.tolist() == mine * 2
    expected = torch.stack([grads.double()[token_rows == r].sum(0) / 2 for r in mine * 2])
    torch.testing.assert_close(received.double(), expected.to(torch.bfloat16).double(), rtol=2 ** -8, atol=0)
    assert (received.double() != expected).any()    # rounded: it travelled in bf16


def test_routes_worked_out_ahead_are_the_gathered_ones_and_train_the_same(tmp_path):
    """Two processes, two micro-batches each a step: the routes the batch prefetcher works out a
    step ahead from every process's slices (packed by each process itself) equal those worked
    out from the tokens the processes gather before each forward, and the two runs end with the
    same losses and model, bit for bit."""
    rng = np.random.default_rng(0)
    write_shard(tmp_path / "t_train_000001.bin", synthetic_documents(rng, 40_000))
    write_shard(tmp_path / "t_val_000000.bin", synthetic_documents(rng, 8_000))
    args = ["--preset", "cpu", *TINY, *data_args(tmp_path), *NGRAM, *SPARSE_VALUES, "--batch_ranks=4",
            f"--num_iterations={STEPS}", "--ngram_step_every=2", "--compute_dtype=float32"]
    done = run_distributed(2, [os.path.join(REPO, "tests", "helpers", "routing_worker.py"), str(tmp_path), str(STEPS), *args],
                           env=cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        ahead, gathered = result["ahead"], result["gathered"]
        assert len(ahead["routes"]) == len(gathered["routes"]) == 2 * STEPS
        for a, b in zip(ahead["routes"], gathered["routes"]):
            assert a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)
        assert ahead["losses"] == gathered["losses"]
        assert all(torch.equal(v, gathered["state"][k]) for k, v in ahead["state"].items())
