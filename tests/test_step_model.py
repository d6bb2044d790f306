"""The performance model of a training step (bench/step_model.py): its attention tile census
against brute force, its fusion rule and collective prices against hand counts, and the whole
census moving the right way when a planted change doubles a matrix product, halves a dtype or
widens a window."""
import dataclasses
import io
import re
import sys
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch

from tiny_runs import REPO, tiny_config
import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402

sys.path.insert(0, f"{REPO}/bench")
import step_model as sm  # noqa: E402

# ---------------------------------------------------------------------------------------------
# attention tiles


def brute_force_pairs(lengths, window):
    starts = np.repeat(np.cumsum([0] + lengths[:-1]), lengths)
    q = np.arange(len(starts))[:, None]
    k = np.arange(len(starts))[None, :]
    return int(((k <= q) & (k >= starts[:, None]) & (q - k < window)).sum())


@pytest.mark.parametrize("lengths,window", [([5, 17, 3, 40], 7), ([64], 1000), ([1, 1, 30, 2], 4)])
def test_single_token_tiles_are_exactly_the_visible_pairs(lengths, window):
    """With blocks of one query and one key, the forward/dQ and dK/dV kernels' block ranges visit
    exactly the pairs the mask lets through."""
    pairs = brute_force_pairs(lengths, window)
    assert sm.visible_pairs(lengths, window) == pairs
    assert sm.query_tiles(lengths, window, 1, 1) == pairs
    assert sm.key_tiles(lengths, window, 1, 1) == pairs


def test_production_tiles_cover_the_pairs_and_grow_with_the_window():
    lengths = sm.document_lengths(16_384, 896)
    assert sum(lengths) == 16_384
    for window in (128, 384, 896):
        fwd = sm.query_tiles(lengths, window, 128, 64) * 128 * 64
        kv = sm.key_tiles(lengths, window, 32, 128) * 32 * 128
        assert min(fwd, kv) >= sm.visible_pairs(lengths, window)
    assert sm.query_tiles(lengths, 128, 128, 64) < sm.query_tiles(lengths, 384, 128, 64) < \
        sm.query_tiles(lengths, 896, 128, 64)


# ---------------------------------------------------------------------------------------------
# fusion and prices


def event(name, phase, reads, writes):
    return sm.Event(name, phase, reads, writes, [], [], in_place=name.endswith("_"))


def test_a_fused_region_reads_its_inputs_once_and_writes_what_is_read_after_it():
    """x (1) and y (2) exist; a = x * y; b = a + x; then a matrix product reads b. The region
    reads x and y once and writes only b; when a is also read after the region, a too. An
    in-place update of state that existed before the region is written back."""
    MB = 1 << 20
    region = [event("aten.mul", "forward", [(1, MB), (2, MB)], [(3, MB)]),
              event("aten.add", "forward", [(3, MB), (1, MB)], [(4, MB)])]
    gemm = event("aten.mm", "forward", [(4, MB), (9, MB)], [(5, MB)])
    gemm.inputs = [((256, 1024), torch.bfloat16), ((1024, 256), torch.bfloat16)]
    ops = sm.priced_ops(region + [gemm], [], 1, compiled=("forward", "backward"))
    assert [op.family for op in ops] == ["pointwise", "gemm"]
    assert ops[0].bytes == 3 * MB
    later = event("aten.sum", "backward", [(3, MB)], [(6, 4)])
    assert sm.priced_ops(region + [gemm, later], [], 1, compiled=("forward", "backward"))[0].bytes == 4 * MB
    state = [event("aten.mul", "forward", [(1, MB)], [(3, MB)]), event("aten.add_", "forward", [(7, MB), (3, MB)],
                                                                      [(7, MB)])]
    assert sm.priced_ops(state, [], 1, compiled=("forward", "backward"))[0].bytes == 3 * MB
    # outside a compiled graph every op is a kernel of its own: a is written and read again
    assert sum(op.bytes for op in sm.priced_ops(region, [], 1)) == 6 * MB
    assert ops[1].flops == 2 * 256 * 1024 * 256


def test_an_op_that_updates_an_argument_in_place_also_writes_what_it_returns():
    """fp8_cast records its amax in place and returns the fp8 copy and its transpose: the census
    counts the input read and all three written."""
    import kernels
    from torch._subclasses.fake_tensor import FakeTensorMode
    census = sm.Census()
    with FakeTensorMode():
        x = torch.empty(64, 128, dtype=torch.bfloat16)
        scale, amax = torch.ones(1), torch.zeros(1)
        with census:
            kernels.fp8_cast(x, scale, amax, torch.float8_e4m3fn)
    (cast,) = [e for e in census.events if e.name == "kernels.fp8_cast"]
    assert sorted(nbytes for _, nbytes in cast.writes) == [4, 64 * 128, 64 * 128]
    assert sm._kernel_op(cast, []).bytes == 64 * 128 * 2 + 4 + 4 + 4 + 2 * 64 * 128


def test_a_gather_reads_the_rows_it_takes_not_its_whole_table():
    """An embedding lookup, a row index and an index_select of 6 rows of a 1,000-row table
    read 6 rows of it (and their indices), not the table; a lookup of more rows than the table
    has reads the table at most."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    census = sm.Census()
    with FakeTensorMode():
        table, rows = torch.empty(1000, 16), torch.zeros(6, dtype=torch.int64)
        with census:
            torch.nn.functional.embedding(rows, table)
            table[rows]
            table.index_select(0, rows)
            torch.nn.functional.embedding(torch.zeros(5000, dtype=torch.int64), table)
    gathers = [e for e in census.events if e.name in sm.GATHER_OPS]
    assert [e.name for e in gathers] == ["aten.embedding", "aten.index", "aten.index_select", "aten.embedding"]
    for e in gathers[:3]:
        assert sorted(nbytes for _, nbytes in e.reads) == [6 * 8, 6 * 16 * 4]
    assert sorted(nbytes for _, nbytes in gathers[3].reads) == [5000 * 8, 1000 * 16 * 4]


@pytest.mark.parametrize("rule, launches, weight_reads", [("lagged", 3, 2), ("delayed", 2, 1)])
def test_a_weight_group_cast_is_priced_as_its_launches_and_passes(rule, launches, weight_reads):
    """fp8_cast_weights of two bf16 weights: the scale kernel and the cast, and for a rule that
    reads the weights' own amax the amax pass too, which reads the weights once more. Bytes: the
    weights (once or twice), the states, both fp8 copies of each weight, the scales."""
    import kernels
    from torch._subclasses.fake_tensor import FakeTensorMode
    rules = {"lagged": kernels.WEIGHT_LAG, "delayed": kernels.Delayed(1.12)}
    census = sm.Census()
    with FakeTensorMode():
        weights = [torch.empty(96, 64, dtype=torch.bfloat16) for _ in range(2)]
        states = [kernels.new_fp8_mlp_state() for _ in range(2)]
        with census:
            kernels.fp8_cast_weights(weights, states, kernels.FP8_MLP_SLOTS, "up_weight", rules[rule])
    (cast,) = [e for e in census.events if e.name == "kernels.fp8_cast_weights"]
    op = sm._kernel_op(cast, [])
    state_bytes = 2 * states[0].numel() * 4
    assert op.kernels == launches
    assert op.bytes == weight_reads * 2 * 96 * 64 * 2 + state_bytes + 2 * 2 * 96 * 64 + 2 * kernels.FP8_SLOT_STRIDE * 4


@pytest.mark.parametrize("dtype, per_key", [(torch.int64, 8 + 8 * 2 * (8 + 8)), (torch.float32, 4 + 4 * 2 * (4 + 8))])
def test_a_sort_is_priced_as_a_radix_sort_of_its_keys_and_indices(dtype, per_key):
    """torch.sort of n keys, traced: the keys read once for the digit counts, then per 8-bit digit
    of the key the keys and their int64 indices read and written (8 digits of an int64 key, 4 of
    an fp32 one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    census = sm.Census()
    with FakeTensorMode():
        keys = torch.empty(1000, dtype=dtype)
        with census:
            torch.sort(keys, stable=True)
    (sort,) = [e for e in census.events if e.name == "aten.sort"]
    assert sm._kernel_op(sort, []).bytes == 1000 * per_key


def test_a_fused_region_launches_a_loop_per_size_it_writes_and_ends_with_its_graph():
    """Loops over different sizes do not fuse: a region writing a (1024,) and a (4, 4) result is
    two kernels (plus one per reduction). A compiled update ends with its graph (GRAPH_END): the
    ops on either side of it are two regions, each reading its inputs."""
    KB = 1 << 10
    big = sm.Event("aten.mul", "muon", [(1, 4 * KB)], [(2, 4 * KB)], [((1024,), torch.float32)],
                   [((1024,), torch.float32)])
    small = sm.Event("aten.add", "muon", [(3, 64)], [(4, 64)], [((4, 4), torch.float32)], [((4, 4), torch.float32)])
    norm = sm.Event("aten.sum", "muon", [(2, 4 * KB)], [(5, 4)], [((1024,), torch.float32)], [((), torch.float32)])
    (op,) = sm.priced_ops([big, small, norm], [], 1, compiled=("muon",))
    assert op.kernels == 2 + 1
    end = sm.Event(sm.GRAPH_END, "muon", [], [], [], [])
    again = sm.Event("aten.mul", "muon", [(1, 4 * KB)], [(6, 4 * KB)], [((1024,), torch.float32)],
                     [((1024,), torch.float32)])
    gather = sm.Event("c10d._allgather_base_", "muon", [(2, 4 * KB), (6, 4 * KB)], [(7, 32 * KB)], [], [])
    ops = sm.priced_ops([big, end, again, gather], [], 1, compiled=("muon",))
    assert [op.bytes for op in ops[:2]] == [8 * KB, 8 * KB]   # x read by each graph; 2 and 6 written
    assert sm.priced_ops([big, again, gather], [], 1, compiled=("muon",))[0].bytes == 12 * KB


def test_the_optimizers_updates_are_fused_where_the_run_captures_them():
    """With CUDA graphs the trainer compiles each optimizer update it captures (one graph per Muon
    bank, one for each Adam): the census fuses their pointwise math, which without them runs an
    eager kernel per op, into far fewer launches and less traffic."""
    h = tg.parse_config(["--preset", "speedrun"])
    assert sm.compiled_phases(h) == ("forward", "backward", "muon", "adam", "value_adam")
    assert sm.compiled_phases(tg.parse_config(["--preset", "speedrun", "--cuda_graphs=false"])) == ("forward",
                                                                                                      "backward")
    assert sm.compiled_phases(tg.parse_config(["--preset", "speedrun", "--compile=false"])) == ()
    fused, eager = (census(["--cuda_graphs=" + on])[1] for on in ("true", "false"))
    for phase in ("muon", "adam"):
        pointwise = lambda c: [op for op in getattr(c, phase) if op.family == "pointwise"]  # noqa: E731
        assert sum(op.kernels for op in pointwise(fused)) < sum(op.kernels for op in pointwise(eager)) / 2
        assert sum(op.bytes for op in pointwise(fused)) < sum(op.bytes for op in pointwise(eager))
    assert flops(fused.muon) == flops(eager.muon) > 0


def test_collectives_cost_their_ring_traffic_and_a_latency():
    S = 10 ** 8
    all_reduce = event("c10d.allreduce_", "adam", [(1, S)], [(1, S)])
    (op,) = sm.priced_ops([all_reduce], [], 8)
    assert op.comm == 2 * 7 / 8 * S
    seconds = sm.op_seconds(op, sm.H100, sm.REALISTIC, 8)
    assert seconds == pytest.approx(15e-6 + 2 * 7 / 8 * S / (450e9 * 0.7))
    assert sm.op_seconds(op, sm.H100, sm.REALISTIC, 1) == 0
    gather = event("c10d._allgather_base_", "muon", [(2, S // 8)], [(3, S)])
    assert sm.priced_ops([gather], [], 8)[0].comm == 7 / 8 * S


def test_two_streams_run_a_collective_under_math_that_does_not_wait_for_it():
    """The optimizers' updates on two streams: math that neither reads nor overwrites what a
    collective in flight touches runs beside it; math that reads its result, or writes a buffer
    it reads, waits for it; a collective starts only when the math launched before it is done,
    and after the collective before it."""
    MB = 1 << 20

    def collective(reads, writes):
        return sm.Op("c10d._reduce_scatter_base_", "collective", "muon", comm=100 * MB, kernels=0,
                     reads=frozenset(reads), writes=frozenset(writes))

    def math(reads, writes):
        return sm.Op("fused: mul", "pointwise", "muon", bytes=400 * MB, reads=frozenset(reads), writes=frozenset(writes))

    def seconds(ops):
        return sm.two_stream_seconds(ops, sm.H100, sm.PEAK, 8)

    c, m = (sm.op_seconds(op, sm.H100, sm.PEAK, 8) for op in (collective({1}, {2}), math({3}, {4})))
    assert c > 0 and m > 0
    assert seconds([collective({1}, {2}), math({3}, {4})]) == pytest.approx(max(c, m))     # beside it
    assert seconds([collective({1}, {2}), math({2}, {4})]) == pytest.approx(c + m)          # reads its result
    assert seconds([collective({1}, {2}), math({3}, {2})]) == pytest.approx(c + m)          # overwrites its result
    assert seconds([collective({1}, {2}), math({3}, {1})]) == pytest.approx(c + m)          # overwrites its input
    assert seconds([math({3}, {1}), collective({1}, {2})]) == pytest.approx(m + c)          # launched after the math
    assert seconds([collective({1}, {2}), collective({5}, {6}), math({2}, {7})]) == pytest.approx(c + max(c, m))
    assert seconds([collective({1}, {2}), collective({5}, {6}), math({6}, {7})]) == pytest.approx(2 * c + m)


def test_every_reduction_is_launched_before_the_update_math_and_hidden_under_it():
    """optim.step_together as the census records it on 8 ranks: every reduction (Adam's and both
    of Muon's buckets) launched before any update math and any all-gather; the model's step
    then hides part of the communication (the two streams take less than the ops one by one),
    and the step's sinks still add up to its time."""
    h = tiny_config(["--compile=true", "--cuda_graphs=true", "--adam_step_every=2", "--batch_ranks=8"])
    events, _, _ = sm.trace_stage(h, 0, 8)
    updates = [e for e in events if e.phase in sm.UPDATE_PHASES]
    kinds = [("reduce" if "reduce" in e.name else "gather") if e.name in sm.COLLECTIVE_OPS else "math"
             for e in updates]
    reductions = [i for i, k in enumerate(kinds) if k == "reduce"]
    muon_reductions = [i for i in reductions if updates[i].phase == "muon"]
    assert len(muon_reductions) == 2 and [i for i in reductions if updates[i].phase == "adam"]
    last = max(reductions)
    first_math = min(i for i, k in enumerate(kinds) if k == "math" and not updates[i].name == "aten.copy_"
                     and i > muon_reductions[0])
    assert last < first_math < min(i for i, k in enumerate(kinds) if k == "gather")
    m = sm.RunModel(h, 8, sm.H100, [sm.census_of_stage(h, 0, 8)])
    adam_step, muon_step = 1, 0
    assert m.hidden_seconds(adam_step, sm.REALISTIC) > 0
    assert m.hidden_seconds(muon_step, sm.REALISTIC) > 0     # Muon's second bucket under its first's math
    for step in (adam_step, muon_step):
        alone = sum(sm.op_seconds(op, m.gpu, sm.REALISTIC, 8) * n for op, n in m.step_ops(step))
        assert m.step_seconds(step, sm.REALISTIC) == pytest.approx(alone - m.hidden_seconds(step, sm.REALISTIC))
        assert sum(m.step_sinks(step, sm.REALISTIC, sm.family_of).values()) == pytest.approx(
            m.step_seconds(step, sm.REALISTIC))


def test_the_value_tables_all_reduce_the_rows_the_processes_touched(monkeypatch):
    """A value-table update all-reduces each table's sums at the rows some process's tokens
    touched since the last update, in the table's dtype (bf16 in the speedrun): ring traffic
    2 (w - 1) / w x rows x width x 2 bytes, whatever the vocabulary; with the tiny corpus absent
    the rows are every token's, at most the vocabulary."""
    h = tg.parse_config(["--preset", "speedrun", "--value_embed_sparse=true", "--value_embed_table_cadence=false"])
    spans = []
    monkeypatch.setattr(sm, "distinct_tokens", lambda tokens: (spans.append(tokens) or 1000, "planted"))
    ops = sm.table_ops(h, 0, 8, value_widths=(768, 384)).value_event
    comm = [op.comm for op in ops if op.family == "collective"]
    assert comm == [2 * 7 / 8 * 1000 * 768 * 2, 2 * 7 / 8 * 1000 * 384 * 2]
    assert spans == [16_384 * 8 * 4]   # every process's slices over the longest cadence's 4 steps
    assert not [op for op in sm.table_ops(h, 0, 1, value_widths=(768,)).value_event if op.family == "collective"]
    monkeypatch.undo()
    monkeypatch.setattr(sm, "tiny_corpus_stream", lambda tokens: None)
    assert sm.distinct_tokens(1000)[0] == 1000 and sm.distinct_tokens(10 ** 6)[0] == tg.PADDED_VOCAB_SIZE


def test_a_split_ngram_tables_rows_and_gradients_travel_in_its_dtype(monkeypatch):
    """Per slice, a table split over 8 processes sends each distinct row it does not own both
    ways, the rows to the askers and their summed gradients to the owners, each in the table's
    dtype (bf16 in the speedrun): 7/8 x distinct x width x 2 bytes each way."""
    h = tg.parse_config(["--preset", "speedrun"])
    monkeypatch.setattr(sm, "distinct_fraction", lambda h, tokens: (0.5, "planted"))
    comm = {op.name: op.comm for op in sm.table_ops(h, 0, 8).per_slice if op.family == "collective"}
    distinct = 2 * 16_384 * 0.5
    assert comm == {"n-gram rows: all-to-all to the askers": 7 / 8 * distinct * 768 * 2,
                    "n-gram gradients: all-to-all to the owners": 7 / 8 * distinct * 768 * 2}


def test_a_roofline_takes_the_slower_of_compute_and_memory():
    big = sm.Op("mm", "gemm", "forward", flops=2 * 8192 ** 3, dtype="bf16", bytes=3 * 2 * 8192 ** 2)
    assert sm.op_seconds(big, sm.H100, sm.PEAK, 1) == pytest.approx(2 * 8192 ** 3 / 989.5e12)
    fp8 = sm.Op("mm", "gemm", "forward", flops=2 * 8192 ** 3, dtype="fp8", bytes=3 * 8192 ** 2)
    assert sm.op_seconds(fp8, sm.H100, sm.PEAK, 1) == pytest.approx(sm.op_seconds(big, sm.H100, sm.PEAK, 1) / 2)
    copy = sm.Op("copy", "pointwise", "forward", bytes=2e9)
    assert sm.op_seconds(copy, sm.H200, sm.REALISTIC, 1) == pytest.approx(2e9 / (4.8e12 * 0.8))


# ---------------------------------------------------------------------------------------------
# the census of a run moves the right way


def census(extra=()):
    h = tiny_config(["--fp8_mlp=false", "--fp8_qkv=false", "--fp8_head=false", "--compile=true", *extra])
    return h, sm.census_of_stage(h, 0, 1)


def flops(ops, family="gemm"):
    return sum(op.flops for op in ops if op.family == family)


def seconds(h, c):
    """At the peaks (no kernel floor, which the tiny model's kernels all sit on)."""
    return sum(sm.op_seconds(op, sm.H100, sm.PEAK, 1) for op in c.micro_batch)


def test_the_census_counts_the_step_not_its_setup():
    """The census gives every parameter a gradient first, as a step after the first finds them,
    outside what it records: no forward event makes a zero tensor of the embedding's shape."""
    h = tiny_config(["--compile=true"])
    events, _, _ = sm.trace_stage(h, 0, 1)
    embedding = (tg.PADDED_VOCAB_SIZE, h.model_dim)
    assert [e.phase for e in events][0] == "forward"
    assert not [e for e in events if e.phase in sm.MICRO_BATCH_PHASES and e.name == "aten.zeros_like"
                and e.outputs[0][0] == embedding]


def test_doubling_the_mlp_adds_its_products_flops_exactly():
    """An MLP of hidden width H costs 3 products of T x D x H (up, down) forward and twice that
    backward, on every layer: doubling H adds 2 x 3 x 2 T D H x layers."""
    h, small = census()
    _, double = census([f"--mlp_hidden={2 * h.mlp_hidden}"])
    T, D, H = h.stages[0].tokens_per_rank, h.model_dim, h.mlp_hidden
    assert flops(double.micro_batch) - flops(small.micro_batch) == 2 * 3 * 2 * T * D * H * h.num_layers
    assert seconds(h, double) > seconds(h, small)


def test_halving_the_dtype_halves_the_products_time_and_cuts_the_traffic():
    h, bf16 = census()
    _, fp32 = census(["--compute_dtype=float32"])
    assert {op.dtype for op in bf16.micro_batch if op.family == "gemm"} == {"bf16"}
    assert {op.dtype for op in fp32.micro_batch if op.family == "gemm"} == {"fp32"}
    assert flops(bf16.micro_batch) == flops(fp32.micro_batch)
    memory = lambda c: sum(op.bytes for op in c.micro_batch if op.family == "pointwise")  # noqa: E731
    assert memory(bf16) < memory(fp32)
    assert seconds(h, bf16) < seconds(h, fp32)


def test_widening_the_window_adds_attention_work():
    stages = ('--stages=[{"end":1.0,"tokens_per_rank":4096,"max_doc_len":4096,"short_window":1,'
              '"long_window":%d}]')
    h, narrow = census([stages % 1])
    _, wide = census([stages % 16])
    assert flops(wide.micro_batch, "attention") > flops(narrow.micro_batch, "attention") > 0
    assert seconds(h, wide) > seconds(h, narrow)


def test_the_command_prints_its_tables_and_ends_with_the_prediction():
    out = io.StringIO()
    with redirect_stdout(out):
        sm.main(["--preset", "cpu", "--gpus", "1", "--gpu", "h200", "--", "--num_iterations=200"])  # past 0.0 s
    text = out.getvalue()
    assert "## Per stage" in text and "## The ten largest time sinks" in text
    last = text.strip().splitlines()[-1]
    match = re.fullmatch(r"predicted: cpu on 1xH200: ([\d.]+) s realistic, ([\d.]+) s at peak; band ([\d.]+) s "
                         r"\(record-89 constants\), ([\d.]+) s \(structure-based\), ([\d.]+) s \(pessimistic\)", last)
    assert match and 0 < float(match[2]) < float(match[1]) == float(match[3])
    assert float(match[4]) < float(match[5])
    assert "## The band" in text


def test_record89_is_predicted_within_a_quarter_of_its_logged_step_times():
    """The calibration: the record89 preset's step times on 8xH100, stage by stage, within
    CALIBRATION_TOLERANCE of the public record 89's logged ones (RECORD89_STEP_MS)."""
    h = tg.parse_config(["--preset", "record89"])
    rows = sm.calibration_table(sm.build_model(h, 8, sm.H100))
    assert {int(tokens.replace(",", "")) for _, tokens, *_ in rows} == set(sm.RECORD89_STEP_MS)
    for _, _, predicted, logged, ratio in rows:
        assert abs(float(ratio) - 1) <= sm.CALIBRATION_TOLERANCE, (predicted, logged)


@pytest.mark.parametrize("where, line", [
    ("missing/x.json", "error: --json {dir}/missing/x.json: its folder {dir}/missing does not exist; create it or give "
                       "another path"),
    ("", "error: --json {dir}/ is a folder: give the path of a file"),
], ids=["a missing folder", "a folder"])
def test_a_json_path_that_cannot_be_written_is_refused_before_the_census(tmp_path, monkeypatch, capsys, where, line):
    monkeypatch.setattr(sm, "report", lambda *a: pytest.fail("the census ran"))
    with pytest.raises(SystemExit) as stop:
        sm.main(["--preset", "cpu", "--gpus", "1", "--json", f"{tmp_path}/{where}"])
    assert stop.value.code == 2 and capsys.readouterr().err == line.format(dir=tmp_path) + "\n"


# ---------------------------------------------------------------------------------------------
# pricing by the kernels' structure


def test_the_fp8_structures_reproduce_their_public_figures_at_the_reference_shape():
    """At 8192 x 8192 x 4096 each structure's efficiency is its public figure (PR 5461); fast
    accumulation off costs PROMOTION_COST where a kernel promotes every 128 products (cuBLAS), half
    of that extra time where it promotes every 256 (ours), each within its promoted tile's other
    wave count and split."""
    s = sm.STRUCTURE.structures
    for structure, share in sm.FP8_REFERENCE.items():
        assert sm.gemm_efficiency(*sm.FP8_REFERENCE_SHAPE, True, structure, s) == pytest.approx(share)
    promoted = {st: sm.gemm_efficiency(*sm.FP8_REFERENCE_SHAPE, False, st, s) for st in ("cublas", "descriptor")}
    assert promoted["cublas"] == pytest.approx(sm.FP8_REFERENCE["cublas"] / sm.PROMOTION_COST[0], rel=0.02)
    assert kernels.PROMOTION_K == 2 * sm.PROMOTION_COST_K
    half = 1 + (sm.PROMOTION_COST[0] - 1) / 2
    assert promoted["descriptor"] == pytest.approx(sm.FP8_REFERENCE["descriptor"] / half, rel=0.04)


def test_a_short_k_and_a_partial_wave_cost_the_pointer_kernel_more_than_the_persistent_one():
    """K = 768 (six K steps): the pointer kernel's pipeline fill and epilogue are a third of a
    tile's steps, the persistent kernel's a twelfth: the descriptor kernel's lead over the pointer
    kernel grows. A weight gradient of 144 tiles (1.09 waves) at 49,152 tokens: the pointer kernel
    runs two whole waves, the persistent one splits the last wave's 12 tiles."""
    s = sm.STRUCTURE.structures

    def lead(m, n, k, fast):
        return sm.gemm_efficiency(m, n, k, fast, "descriptor", s) / sm.gemm_efficiency(m, n, k, fast, "pointer", s)
    reference = lead(*sm.FP8_REFERENCE_SHAPE, True)
    assert lead(49152, 2816, 768, True) > 1.1 * reference
    def busiest_products(structure):   # the busiest SM's K steps, in products (the tiles' K steps differ)
        return (sm.gemm_tiles(3072, 768, 49152, False, structure)[3]
                * sm.fp8_config(3072, 768, 49152, False, structure).block_k)
    assert busiest_products("descriptor") < 0.6 * busiest_products("pointer")
    assert lead(3072, 768, 49152, False) > 1.5 * reference


def test_a_call_that_picks_the_fastest_is_priced_at_its_fastest_structure():
    """An FP8 GEMM that may run on three structures is priced at the fastest; pinned to the
    pointer kernel, at that one's price."""
    def op(structures):
        return sm.Op("kernels.fp8_matmul", "gemm", "backward", flops=2.0 * 768 * 49152 * 2304, dtype="fp8",
                     structure=("fp8", 2304, 49152, 768, False, structures, None))
    times = {s: sm.op_seconds(op((s,)), sm.H100, sm.STRUCTURE, 1) for s in ("descriptor", "pointer", "cublas")}
    assert sm.op_seconds(op(("descriptor", "pointer", "cublas")), sm.H100, sm.STRUCTURE, 1) == min(times.values())
    assert times["pointer"] > times["descriptor"]


def test_attention_is_priced_by_the_tiles_of_each_backward_and_the_span_law():
    """The one-kernel backward computes S, dV, dP, dK and dQ once per tile (5 products of the
    deterministic backward's 7, on the same tiles: 2 (3 Dqk + 2 Dv) FLOPs a pair) and adds its dQ
    buffer's traffic; FlashAttention-2-class efficiency grows with the keys a program visits,
    from the figure at 512 causal tokens toward the long-sequence one."""
    s = sm.STRUCTURE.structures
    lengths = [896] * 16
    T, H, d = sum(lengths), 6, 128
    configs = [value for c in kernels.ATTENTION_CONFIGS_NARROW for value in c.as_list()]
    event = sm.Event("kernels.attn_bwd", "backward", [], [],
                     [((T, H, d), None), ((T, H, d), None), ((T, H, d), None), ((T, H, d), None)], [],
                     args=(640, *configs, "auto"))
    found, allowed = sm.attention_implementations(event, lengths)
    assert allowed == ("atomic", "tma", "deterministic", "atomic other", "tma other")
    fused = kernels.ATTENTION_CONFIGS_NARROW[4]
    tiles = sm.key_tiles(lengths, 640, fused.block_m, fused.block_n)
    assert found["atomic"][0].flops == 2.0 * H * tiles * fused.block_m * fused.block_n * 5 * d
    assert found["atomic"][1].bytes == 4 * T * H * d * 2.5 and found["atomic"][1].launches == 2
    assert len(found["deterministic"]) == 3
    assert sm.attention_efficiency(sm.CAUSAL_512_SPAN, False, s) == pytest.approx(
        s.attention_at_512 * sm.CAUSAL_512_TILES)
    assert sm.attention_efficiency(100, False, s) < sm.attention_efficiency(1000, False, s) < s.attention_long
    assert sm.attention_efficiency(1000, True, s) == pytest.approx(sm.attention_efficiency(1000, False, s) *
                                                                   sm.BACKWARD_RATIO)


def test_attention_is_priced_by_the_structure_of_the_implementation_the_call_may_pick():
    """The descriptor variants are implementations of their own: the forward's warp-specialized
    kernel (FlashAttention-3-class: FA3_FACTOR), the one-kernel backward's descriptor variant
    (pipelined, not warp-specialized: FA3_FACTOR x 570/661, FlashAttention-3's ablation), on the
    tiles of the pointer kernels they stand beside; a call that picks the fastest may run them
    (and is priced by the fastest), a call pinned to "tma" runs only them, the others never."""
    s = sm.STRUCTURE.structures
    lengths = [896] * 16
    T, H, d = sum(lengths), 6, 128
    configs = [value for c in kernels.ATTENTION_CONFIGS for value in c.as_list()]

    def event(name, impl):
        inputs = [((T, H, d), None)] * (3 if name == "kernels.attn_fwd" else 4)
        return sm.Event(name, "forward", [], [], inputs, [], args=(1664, *configs, impl))
    found, allowed = sm.attention_implementations(event("kernels.attn_fwd", "auto"), lengths)
    assert allowed == ("triton", "tma", "flex", "triton other", "tma other")
    assert [k.structure for k in found["tma"]] == ["fa3"] and found["triton"][0].structure == "fa2"
    assert found["tma"][0].flops == found["triton"][0].flops and found["tma"][0].span == found["triton"][0].span
    assert sm.attention_implementations(event("kernels.attn_fwd", "tma"), lengths)[1] == ("tma",)
    assert sm.attention_implementations(event("kernels.attn_fwd", "rule"), lengths)[1] == ("triton",)
    found, allowed = sm.attention_implementations(event("kernels.attn_bwd", "tma"), lengths)
    assert allowed == ("tma",) and found["tma"][0].structure == "descriptor"
    assert found["tma"][0].flops == found["atomic"][0].flops
    assert sm.attention_implementations(event("kernels.attn_bwd", "deterministic"), lengths)[1] == ("deterministic",)
    assert sm.DESCRIPTOR_FACTOR == pytest.approx(1.4 * 570 / 661)
    for structure, factor in (("descriptor", sm.DESCRIPTOR_FACTOR), ("fa3", sm.FA3_FACTOR)):
        assert sm.attention_efficiency(700, True, s, structure) == pytest.approx(
            sm.attention_efficiency(700, True, s) * factor)
    # the fastest is what a call that picks the fastest is priced at; the FlashAttention-3-class
    # forward beats the pointer kernel on the same tiles
    op = sm._kernel_op(event("kernels.attn_fwd", "auto"), lengths)
    eff = sm.STRUCTURE
    alone = {impl: sm.structure_seconds(dataclasses.replace(op, structure=("attention", op.structure[1], (impl,))),
                                        sm.H100, eff) for impl in op.structure[2]}
    assert sm.structure_seconds(op, sm.H100, eff) == min(alone.values())
    assert alone["tma"] < alone["triton"] and alone["tma other"] < alone["triton other"]


def test_a_call_that_picks_the_fastest_is_priced_at_both_window_classes_tiles():
    """Under "auto" the selection also times the pointer and descriptor kernels at the other window
    class's tiles (kernels.attention_candidate_tiles): the census prices those too, on their own
    tiles, and a pinned call never runs them. With head dim 64 and a 640-token window, the
    one-kernel backward's 128 keys a program halve its dQ atomics per product: the production
    tiles beat the narrow window's own."""
    lengths = [896] * 16
    T, H, d = sum(lengths), 6, 64
    narrow, production = kernels.ATTENTION_CONFIGS_NARROW, kernels.ATTENTION_CONFIGS
    assert kernels.attention_candidate_tiles(narrow, 4) == (narrow[4], production[4])
    assert kernels.attention_candidate_tiles(production, 0) == (production[0], narrow[0])
    configs = [value for c in narrow for value in c.as_list()]

    def event(name, impl):
        inputs = [((T, H, d), None)] * (3 if name == "kernels.attn_fwd" else 4)
        return sm.Event(name, "backward", [], [], inputs, [], args=(640, *configs, impl))
    found, allowed = sm.attention_implementations(event("kernels.attn_bwd", "auto"), lengths)
    fused = production[4]
    tiles = sm.key_tiles(lengths, 640, fused.block_m, fused.block_n)
    assert found["atomic other"][0].flops == found["tma other"][0].flops == \
        2.0 * H * tiles * fused.block_m * fused.block_n * 5 * d
    assert found["atomic other"][0].bytes == 2 * 4.0 * H * tiles * fused.block_m * d
    assert found["tma other"][0].structure == "descriptor" and found["atomic other"][0].structure == "fa2"
    forward, _ = sm.attention_implementations(event("kernels.attn_fwd", "auto"), lengths)
    assert forward["triton other"][0].flops == 2.0 * H * sm.query_tiles(lengths, 640, production[0].block_m,
                                                                        production[0].block_n) * \
        production[0].block_m * production[0].block_n * 2 * d
    for impl in ("rule", "atomic", "tma", "deterministic"):
        assert not any(name.endswith("other") for name in sm.attention_implementations(
            event("kernels.attn_bwd", impl), lengths)[1])
    op = sm._kernel_op(event("kernels.attn_bwd", "auto"), lengths)
    alone = {impl: sm.structure_seconds(dataclasses.replace(op, structure=("attention", op.structure[1], (impl,))),
                                        sm.H100, sm.STRUCTURE) for impl in op.structure[2]}
    assert min(alone, key=alone.get) == "tma other" and alone["tma other"] < alone["tma"]
    assert sm.structure_seconds(op, sm.H100, sm.STRUCTURE) == alone["tma other"]


def test_the_band_prices_with_measured_efficiencies_when_first_contact_wrote_them(tmp_path):
    """bench/measured_efficiency.json's shares replace the structure-based ones they name; the
    band gains its measured line; without the file there is none."""
    assert sm.measured_efficiency(tmp_path / "absent.json") is None
    path = tmp_path / "measured.json"
    path.write_text('{"fp8": {"descriptor": 0.9}, "attention_long": 0.6, "gap_s": 0.0}')
    measured = sm.measured_efficiency(path)
    assert measured.structures.fp8["descriptor"] == 0.9 and measured.structures.fp8["pointer"] == \
        sm.FP8_REFERENCE["pointer"]
    assert measured.structures.attention_long == 0.6 and measured.gap_s == 0.0
    m = sm.build_model(tiny_config(["--compile=true"]), 1, sm.H100)
    band = sm.band_seconds(m, path)
    assert band["measured"] < band["structure"] < band["pessimistic"]
    assert "measured" not in sm.band_seconds(m, tmp_path / "absent.json")


# ---------------------------------------------------------------------------------------------
# bench/inductor_census.py: what Inductor's Triton backend generates, read on a CPU


def test_inductor_census_reads_the_kernels_inductor_generates():
    """A residual add and an RMS norm, a matmul, then a per-tensor amax of its output, through
    Inductor's Triton code generation on the CPU: the add and the norm fuse into one persistent
    reduction, the matmul is a library call, the amax takes a per-row reduction and a last one
    over the 64 row maxima (a kernel over at most TINY_ELEMENTS elements)."""
    import inductor_census as ic
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    graphs = []

    def keep(gm, inputs):
        graphs.append((gm, inputs))
        return make_boxed_func(gm.forward)

    def norm_matmul_amax(x, r, w):
        y = (x + r).float()
        z = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) @ w
        return z.float().abs().amax(dim=-1).amax()
    generator = torch.Generator().manual_seed(0)
    x, r = (torch.randn(64, 256, generator=generator, dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(256, 128, generator=generator, dtype=torch.bfloat16)
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, decompositions=select_decomp_table())
    torch.compile(norm_matmul_amax, backend=backend, fullgraph=True)(x, r, w)
    source = ic.inductor_source(*graphs[0], backward=False)
    launches, tiny, library = ic.count_launches(source)
    assert launches == {"persistent reduction": 3} and tiny == 1 and library == 1
