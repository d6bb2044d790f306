"""Hopper (sm_90) compile checks of every production kernel launch, on a machine without a GPU.

bench/sm90_report.py records the launches of the trainer runs (the speedrun, 1gpu, record89 and medium
presets and bench/first_contact.py's compiled run: a step of every stage, the optimizer, the
final validation, traced under CUDA's autocast rules, and the sparse tables' largest updates) and
the library's other production variants, and compiles each for GPUTarget("cuda", 90, 32). The
compiles run once, in a worker process whose Triton is not in interpreter mode
(tests/helpers/interpreter_shim.py), and take one to three minutes on two cores; the tests share them,
and the index audit reads the same compiles' TTIR.
"""
import functools
import json
import sys

import pytest
import torch
import triton
import triton.language as tl

from interpreter_shim import REPO_ROOT, isolated

sys.path.insert(0, str(REPO_ROOT / "bench"))
import sm90_report  # noqa: E402

compiled = isolated(interpret=False)
COMMITTED = json.loads(sm90_report.REPORT_PATH.read_text()) if sm90_report.REPORT_PATH.exists() else None


@functools.cache
def hopper_report():
    return sm90_report.build_report()


@compiled
def test_matrix_kernels_use_the_tensor_cores():
    """wgmma in the PTX and HGMMA/QGMMA in the SASS of every matmul and attention kernel."""
    report = hopper_report()
    compiled_kernels = {entry["kernel"] for entry in report["kernels"]}
    assert set(sm90_report.MATRIX_KERNELS) <= compiled_kernels, "a production kernel was not launched"
    for entry in report["kernels"]:
        if entry["kernel"] in sm90_report.MATRIX_KERNELS:
            gmma = entry["sass_counts"]["HGMMA"] + entry["sass_counts"]["QGMMA"]
            assert entry["ptx_wgmma"] > 0 and gmma > 0, f"{entry['variant']}: no tensor-core instructions"


@compiled
def test_every_kernel_the_trainer_launches_is_in_the_report():
    """The speedrun trainer's own launches (not a hand-written list) feed the report: the FP8
    GEMMs (MLP, QKV, head), the casts of their weights (the MLPs' and QKV projections' by kind:
    amax pass, scales, cast) and the transposed copies of their
    activations and gradients (compiled, cast in the kernels that make them), the QK norm +
    RoPE (and the FP8 QKV projection's gradient through it, cast to fp8 in one pass), attention forward and backward at head dims 64 and 128 with bf16 q, k, v, composed
    attention, the cross-entropy (its gradient written in e5m2 for the head's backward GEMMs,
    and transposed), and the optimizer's X X^T, the sparse tables' row sums (summed, and added
    into the pending sums) and Adam."""
    trainer = [e for e in hopper_report()["kernels"] if e["trainer"]]
    assert {e["kernel"] for e in trainer} == {
        "_fp8_cast_kernel", "_fp8_matmul_kernel", "_fp8_matmul_quant_kernel", "_fp8_matmul_tma_kernel",
        "_fp8_matmul_quant_tma_kernel", "_split_k_reduce_kernel", "_attn_fwd_kernel", "_attn_bwd_fused_kernel",
        "_attn_fwd_tma_kernel", "_attn_bwd_fused_tma_kernel", "_attn_bwd_delta_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel", "_softcap_ce_kernel", "_transpose_kernel",
        "_xxt_kernel", "_qk_norm_rope_fwd_kernel", "_qk_norm_rope_bwd_kernel", "_qkv_grad_fp8_kernel",
        "_dc_fwd_kernel", "_dc_bwd_mix_kernel", "_dc_bwd_q_kernel", "_dc_bwd_kv_kernel", "_sum_rows_kernel",
        "_add_row_sums_kernel", "_sparse_adam_rows_kernel", "_weight_amax_kernel", "_weight_scales_kernel",
        "_weight_cast_kernel"}
    for e in trainer:
        if e["kernel"] in ("_attn_fwd_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel", "_attn_bwd_fused_kernel",
                           *sm90_report.DESCRIPTOR_ATTENTION_KERNELS):
            assert e["variant"].split("(")[1].startswith("bf16,bf16,bf16,"), e["variant"]


@compiled
def test_the_weight_groups_load_their_weights_sixteen_bytes_at_a_time():
    """The weight groups read each weight through an address loaded from a table, which the
    compiler cannot know the alignment of: the trainer's (bf16) amax and cast kernels take it as
    16-byte aligned, so a thread's 32 bytes of an amax block are 2 loads and its 64 of a 64 x 64
    cast tile 4, beside the table's addresses (and the cast's scale): 3 and 7 loads in all, where
    2-byte loads would be 17 and 35."""
    most = {"_weight_amax_kernel": 3, "_weight_cast_kernel": 7}
    trainer = [e for e in hopper_report()["kernels"] if e["trainer"] and e["kernel"] in most]
    assert {e["kernel"] for e in trainer} == set(most)
    for e in trainer:
        assert e["sass_counts"]["LDG"] <= most[e["kernel"]], e["variant"]


def rule_launches(run="speedrun"):
    """The launches of a trainer run's calls with each call's rule alone (what runs where the
    warm-up timed nothing), not every candidate."""
    return sm90_report.record_launches(lambda: sm90_report.replay_untouched(sm90_report.trainer_kernel_calls(run)))


@compiled
def test_the_hot_fp8_gemms_are_persistent_descriptor_kernels_on_the_tensor_cores():
    """Every FP8 GEMM of the speedrun's step runs, by its rule, the persistent tensor-descriptor
    kernel: no pointer-kernel GEMM is launched, and every variant of those kernels (the trainer's
    and the library's, every candidate the selection may take) loads by descriptor (UTMALDG),
    stores by descriptor (UTMASTG), multiplies on the FP8 tensor cores (QGMMA, wgmma in the PTX)
    and spills nothing."""
    names = [launch.kernel.__name__ for launch in rule_launches()]
    assert "_fp8_matmul_tma_kernel" in names and "_fp8_matmul_quant_tma_kernel" in names
    assert not {"_fp8_matmul_kernel", "_fp8_matmul_quant_kernel"} & set(names)
    hot = [e for e in hopper_report()["kernels"] if e["kernel"] in sm90_report.DESCRIPTOR_KERNELS]
    assert {e["kernel"] for e in hot} == set(sm90_report.DESCRIPTOR_KERNELS)
    for e in hot:
        counts = e["sass_counts"]
        assert counts["UTMALDG"] > 0 and counts["UTMASTG"] > 0, e["variant"]
        assert counts["QGMMA"] > 0 and e["ptx_wgmma"] > 0, e["variant"]
        assert e["local_bytes"] == counts["LDL"] == counts["STL"] == 0, e["variant"]


@compiled
def test_the_attention_backward_is_one_kernel_per_layer():
    """By its rule each attention call of the speedrun's step launches one forward kernel and one
    backward kernel (the one-kernel backward, dQ reduced by descriptor: UTMAREDG), as many of each
    as the step has attention calls; every variant of that kernel runs on the tensor cores without
    spills."""
    calls = sm90_report.trainer_kernel_calls("speedrun")
    forward_calls = sum(func.__name__.startswith("attn_fwd") for func, _, _ in calls)
    backward_calls = sum(func.__name__.startswith("attn_bwd") for func, _, _ in calls)
    names = [launch.kernel.__name__ for launch in rule_launches()]
    assert backward_calls > 0 and names.count("_attn_bwd_fused_kernel") == backward_calls
    assert names.count("_attn_fwd_kernel") == forward_calls
    assert not {"_attn_bwd_delta_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel"} & set(names)
    fused = [e for e in hopper_report()["kernels"] if e["kernel"] == "_attn_bwd_fused_kernel"]
    assert fused and all(e["sass_counts"]["HGMMA"] > 0 and e["sass_counts"]["UTMAREDG"] > 0
                         and e["local_bytes"] + e["sass_counts"]["LDL"] + e["sass_counts"]["STL"] == 0 for e in fused)


@compiled
def test_the_attention_descriptor_variants_have_flashattention3s_structure():
    """The descriptor variants the warm-up can choose for every attention call of the trainer runs
    (and the library's head dims): every variant loads its tiles by tensor descriptor (UTMALDG),
    stores by descriptor (UTMASTG), multiplies on the tensor cores (HGMMA, wgmma) and spills
    nothing; the backward adds dQ by descriptor reductions (UTMAREDG); the forward's key loop is
    warp-specialized: partitions in the TTGIR, more warps than the launch's
    ATTENTION_DESCRIPTOR_WARPS (a producer and consumer warp groups), setmaxnreg in the PTX and
    USETMAXREG in the SASS."""
    entries = [e for e in hopper_report()["kernels"] if e["kernel"] in sm90_report.DESCRIPTOR_ATTENTION_KERNELS]
    assert {e["kernel"] for e in entries if e["trainer"]} == set(sm90_report.DESCRIPTOR_ATTENTION_KERNELS)
    assert sm90_report.ATTENTION_WARP_SPECIALIZED == ("_attn_fwd_tma_kernel",)
    for e in entries:
        counts = e["sass_counts"]
        assert counts["UTMALDG"] > 0 and counts["UTMASTG"] > 0, e["variant"]
        assert counts["HGMMA"] > 0 and e["ptx_wgmma"] > 0, e["variant"]
        assert e["local_bytes"] == counts["LDL"] == counts["STL"] == 0, e["variant"]
        if e["kernel"] == "_attn_bwd_fused_tma_kernel":
            assert counts["UTMAREDG"] > 0, e["variant"]
        else:
            assert e["warp_specialized"] and e["warps"] > sm90_report.kernels.ATTENTION_DESCRIPTOR_WARPS, e["variant"]
            assert e["ptx_setmaxnreg"] > 0 and counts["USETMAXREG"] > 0, e["variant"]


@compiled
def test_shared_memory_fits_and_nothing_spills():
    report = hopper_report()
    problems = sm90_report.problems(report)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(COMMITTED is None or COMMITTED["triton"] != triton.__version__,
                    reason=f"no {sm90_report.REPORT_PATH.name} for triton {triton.__version__}")
@compiled
def test_committed_resource_report_is_current():
    """The committed report of this triton version (bench/sm90_resources*.json) matches a fresh
    compile, so a change that moves registers, shared memory or instruction counts shows up in
    review."""
    assert hopper_report() == json.loads(sm90_report.REPORT_PATH.read_text()), (
        f"bench/{sm90_report.REPORT_PATH.name} is out of date: run `python bench/sm90_report.py --write` "
        f"and review the diff")


@compiled
def test_sparse_row_kernels_cover_both_table_widths():
    """The n-gram table is 768 wide (sparse Adam's BLOCK_D 1024) and bf16 with the speedrun's bf16
    weights: the trainer launches that variant. Value tables updated by sparse Adam
    (value_embed_sparse) are 768 wide, or 6 heads x 64 = 384 on the narrow_vo layers (BLOCK_D 512),
    of either weight dtype: the library compiles those variants, which no production preset
    launches (their value embeddings take dense Adam)."""
    adam = {e["variant"].split(") ")[0].split("(")[1] + " " + e["variant"].split()[2]: e["trainer"]
            for e in hopper_report()["kernels"] if e["kernel"] == "_sparse_adam_rows_kernel"}
    assert adam == {"fp32,fp32,i64,i64,fp32,i32,fp64 BLOCK_D=1024": False,
                    "fp32,fp32,i64,i64,fp32,i32,fp64 BLOCK_D=512": False,
                    "bf16,fp32,i64,i64,fp32,i32,fp64 BLOCK_D=1024": True,
                    "bf16,fp32,i64,i64,fp32,i32,fp64 BLOCK_D=512": False}, adam


def test_sparse_adam_event_is_not_specialized():
    """The event number changes with every update: 1 (which the JIT would make a constant), a
    multiple of 16 and any other value give one variant, so no update compiles a new one."""
    T = sm90_report.TensorArg
    config = sm90_report.kernels.SPARSE_ADAM

    def key(event):
        args = dict(table_ptr=T(torch.bfloat16, True), grad_ptr=T(torch.float32, True),
                    distinct_ptr=T(torch.int64, True), count_ptr=T(torch.int64, True),
                    moment_ptr=T(torch.float32, True), last_ptr=T(torch.int32, True),
                    log_decay_ptr=T(torch.float64, True), D=768, stride_t=768, stride_g=768, event=event,
                    log_decay=-0.1, one_minus_beta2=0.05, bias=0.1, lr=0.01, decay=0.0, eps=1e-10, BLOCK_D=1024)
        return sm90_report._variant_key(sm90_report.kernels._sparse_adam_rows_kernel, config, args)
    assert key(1) == key(16) == key(7) == key(2 ** 20)
    assert json.loads(key(1)[1])["event"] == "i32"


@compiled
def test_sparse_updates_are_recorded_at_the_runs_largest_sizes():
    """The recorded n-gram updates have the entry counts a run makes at its longest cadence with
    all its micro-batches: 2 rows x 49,152 tokens x 8 micro-batches x 4 steps for the 1gpu preset,
    one micro-batch for each of 8 processes (speedrun), and first_contact.py's compiled run, whose
    dozen steps (49,152 tokens, then 32,768) all come before the tables' late phase, where the
    table steps every second step: two steps' 8 micro-batches of 49,152."""
    expected = {"speedrun": 2 * 49152 * 4, "1gpu": 2 * 49152 * 8 * 4, "bench": 2 * 8 * 49152 * 2}
    for run, entries in expected.items():
        grids = {launch.grid[0] for launch in sm90_report.trainer_launches(run)
                 if launch.kernel.__name__ == "_sum_rows_kernel"}
        assert max(grids) == entries, (run, sorted(grids))
    assert not any(launch.kernel.__name__ == "_sparse_adam_rows_kernel"
                   for launch in sm90_report.trainer_launches("record89"))


@compiled
def test_index_audit_finds_no_overflow_in_the_production_launches():
    """Every launch of the trainer runs and the library, at its largest sizes: no pointer
    argument whose offsets reach 2^31 elements is indexed in i32 (or in i64 extended from an i32
    product with a program id) beyond what the launch's grid and arguments bound below 2^31. The
    audit sees the large arguments: the logits and their gradient, the head's fp8 gradient
    operands, the n-gram table, and the 1gpu and bench n-gram updates' summed gradients."""
    hopper_report()        # the compiles, shared
    runs, library = sm90_report.production_launches()
    launches = [launch for run in runs.values() for launch in run] + library
    large = {launch.kernel.__name__ for launch in launches if any(
        isinstance(v, sm90_report.TensorArg) and v.max_offset >= sm90_report.I32_LIMIT for v in launch.args.values())}
    assert {"_softcap_ce_kernel", "_scale_rows_kernel", "_fp8_cast_kernel", "_fp8_matmul_kernel",
            "_fp8_matmul_tma_kernel", "_sum_rows_kernel", "_sparse_adam_rows_kernel", "_transpose_kernel"} <= large, large
    findings = sm90_report.index_findings(launches)
    assert not findings, "\n".join(findings)


@triton.jit
def _rows_i32_kernel(x_ptr, out_ptr, stride, BLOCK: tl.constexpr):
    """out[row] = x[row] for one row per program, the row offset computed in i32."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride + cols, tl.load(x_ptr + row * stride + cols))


@triton.jit
def _rows_widened_kernel(x_ptr, out_ptr, stride, BLOCK: tl.constexpr):
    """The same with the i32 product widened to i64 after it is formed (still overflows)."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    offset = (row * stride).to(tl.int64)
    tl.store(out_ptr + offset + cols, tl.load(x_ptr + offset + cols))


@triton.jit
def _rows_i64_kernel(x_ptr, out_ptr, stride, BLOCK: tl.constexpr):
    """The same with the program id widened before the product."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    tl.store(out_ptr + row * stride + cols, tl.load(x_ptr + row * stride + cols))


def _row_copy_launch(kernel, rows, width=768):
    arg = sm90_report.TensorArg(torch.float32, True, rows * width - 1)
    return sm90_report.Launch(kernel, sm90_report.kernels.LaunchConfig(block_m=1, block_n=1024),
                              dict(x_ptr=arg, out_ptr=arg, stride=width, BLOCK=1024), (rows,))


@compiled
def test_index_audit_finds_a_program_id_times_stride_in_i32():
    """The audit has teeth: a row copy whose offset row * stride is i32 (the pattern of the sum
    and Adam row kernels' output and gradient rows) is found at 3,145,728 rows of 768 (2.4e9
    elements), for both arguments, and so is the same product widened to i64 after it is formed;
    not at 2,796,202 rows (offsets below 2^31), nor with the program id widened first."""
    big, small = 3_145_728, 2_796_202
    findings = sm90_report.index_findings([_row_copy_launch(_rows_i32_kernel, big)])
    assert len(findings) == 2 and all("arith.muli" in f and "i32" in f for f in findings), findings
    assert {f.split(": ")[1].split()[0] for f in findings} == {"x_ptr", "out_ptr"}
    widened = sm90_report.index_findings([_row_copy_launch(_rows_widened_kernel, big)])
    assert len(widened) == 2 and all("i64 offset from an i32 product" in f for f in widened), widened
    assert sm90_report.index_findings([_row_copy_launch(_rows_i32_kernel, small)]) == []
    assert sm90_report.index_findings([_row_copy_launch(_rows_i64_kernel, big)]) == []


@triton.jit
def _flat_descriptor_kernel(x_ptr, rows, width, BLOCK: tl.constexpr):
    """A copy through a one-dimensional descriptor whose size rows * width is formed in i32."""
    desc = tl.make_tensor_descriptor(x_ptr, shape=[rows * width], strides=[1], block_shape=[BLOCK])
    desc.store([tl.program_id(0) * BLOCK], desc.load([tl.program_id(0) * BLOCK]))


@triton.jit
def _row_descriptor_kernel(x_ptr, rows, width, BLOCK: tl.constexpr):
    """The same copy through a (rows, width) descriptor: each coordinate below its dimension."""
    desc = tl.make_tensor_descriptor(x_ptr, shape=[rows, width], strides=[width, 1], block_shape=[1, BLOCK])
    desc.store([tl.program_id(0), 0], desc.load([tl.program_id(0), 0]))


@compiled
def test_index_audit_checks_the_dimensions_of_tensor_descriptors():
    """A tensor descriptor's addresses are formed by the copy engine from i32 coordinates and
    64-bit strides: the audit accepts an argument reached only through a descriptor whose every
    dimension is bounded below 2^31 (3,145,728 rows of 768), and finds one whose dimension is an
    i32 product that is not (the flat 2.4e9-element view)."""
    def launch(kernel, rows):
        arg = sm90_report.TensorArg(torch.float32, True, rows * 768 - 1)
        return sm90_report.Launch(kernel, sm90_report.kernels.LaunchConfig(block_m=1, block_n=1024),
                                  dict(x_ptr=arg, rows=rows, width=768, BLOCK=256), (rows,))
    findings = sm90_report.index_findings([launch(_flat_descriptor_kernel, 3_145_728)])
    assert len(findings) == 1 and "tensor descriptor dimension" in findings[0], findings
    assert sm90_report.index_findings([launch(_row_descriptor_kernel, 3_145_728)]) == []
