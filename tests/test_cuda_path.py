"""The trainer's CUDA code path, rehearsed on a CPU.

On a GPU the trainer runs the Triton kernels (FP8 MLP, flash attention, cross-entropy, X X^T),
under CUDA's autocast rules, compiled with torch.compile after an untimed warm-up. None of that
runs in a plain CPU test: there the trainer takes the torch references under CPU autocast. This
module runs that path anyway, at a tiny scale:
  - the Triton kernels under the Triton interpreter (tests/helpers/interpreter_shim.py),
  - CUDA's autocast rules on CPU tensors (tests/helpers/cuda_autocast.py), checked op by op against
    torch's own CUDA autocast on fake CUDA tensors,
  - torch.compile with the aot_eager backend (dynamo and AOTAutograd as on the GPU, no code
    generation), fullgraph, static shapes,
through every stage of a three-stage schedule with sampled softmax, multi-token and prefix
targets, the untie, intermediate and final validations. It asserts that the warm-up builds every
graph and the timed run none, and records every kernel launch (dtypes, strides, constexprs) to
compile it for sm_90 (bench/sm90_report.py) with the tensor-core, shared-memory and spill checks,
and to check that every kernel variant the timed run launches was launched in the warm-up (so
that the Triton JIT compiles nothing on the clock).
"""
import contextlib
import dataclasses
import math
import re
import sys

import numpy as np
import pytest
import torch
from interpreter_shim import REPO_ROOT, isolated
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "bench"))
import sm90_report  # noqa: E402
from cuda_autocast import Call, TensorMeta, cuda_autocast_rules, replay_with_cuda_autocast  # noqa: E402
from tiny_runs import synthetic_documents  # noqa: E402

import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from machinery.warm_up import WARM_UP_PART, warm_up  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from data.shards import write_shard  # noqa: E402
from records.logfile import parse_log  # noqa: E402

interpreted = isolated(interpret=True)
compiled = isolated(interpret=False)

# A model with production head dims (64) and every feature of the GPU path, as small as the
# interpreter needs (its cost is per program and op: a cast or GEMM over the full vocabulary
# is hundreds of programs). 5 steps in 3 stages, every one with sampled softmax as the
# speedrun's (the full vocabulary in the validations only, one cross-entropy program per
# token): step 0 with multi-token and prefix targets; steps 1-2 and 3-4 with growing windows and,
# in the last stage, two query blocks of 128; the untie at step 4; a validation at step 3 (tied)
# and the final one (untied, wider window).
REHEARSAL = [
    "--preset", "cpu", "--kernels=triton", "--compile=true", "--compile_backend=aot_eager", "--fp8_mlp=true",
    "--cuda_graphs=true", "--pointer_mixture=false",   # (the pointer: the frontier variant's, below)
    "--num_layers=3", "--model_dim=128", "--num_heads=2", "--head_dim=64", "--mlp_hidden=256",
    "--long_window_layers=[2]", "--attention_free_layers=[1]", "--num_value_embeds=1", "--bigram_rows=1024",
    "--batch_ranks=1", "--num_iterations=5", "--untie_frac=0.8", "--val_every=3", "--val_long_window=3",
    "--val_tokens=32", "--val_tokens_per_rank=32", "--warmup_steps=1", "--log_every=1",
    "--momentum_warmup_steps=4", "--compute_dtype=bfloat16", "--param_dtype=bfloat16",
    # record 89's features: token gates, the dense trunk, composed attention, a narrow QK layer, a
    # parallel MLP, per-head QK orthogonalization and an end-of-training average
    "--token_gates=true", "--token_gates_split=2", "--trunk=dense", "--skip_layers=[0,1]", "--snapshot_layer=1",
    "--composed_layers=[2]", "--composed_window=32", "--attn_gate_layers=[2]", "--xsa_layers=[0]", "--narrow_qk_layers=[0]",
    "--narrow_qk_dim=32", "--parallel_mlp_layers=[1]", "--qk_ortho_heads=1",
    '--averages=[{"params":"qk","window":2}]',
    # the records' rules: windows of w + 1 keys, the smear and hashes across documents with the
    # records' hashes, the packed targets, attention segments, O's uniform init
    "--window_edge_key=true", "--cross_documents=true", "--table_hashes=record", "--target_rule=packed",
    "--attention_segment_tokens=64", "--attn_out_init=uniform",
    # record 92's hashed n-gram table in place of the bigram embedding, and the value embeddings,
    # trained by sparse Adam, every step and then (from step 3) every 2nd
    "--ngram_rows=4096", "--ngram_dtype=bfloat16", "--ngram_lr=0.02", "--value_embed_sparse=true",
    '--table_phases=[{"start":3,"ngram_beta2":0.9025,"value_embed_beta2":0.9025,"step_every":2}]',
    '--stages=[{"end":0.2,"tokens_per_rank":32,"max_doc_len":32,"short_window":1,"long_window":1,'
    '"mtp_weights":[1,0.5,0.25],"prefix_weight":0.25,"candidates":256},'
    '{"end":0.6,"tokens_per_rank":96,"max_doc_len":96,"short_window":1,"long_window":2,'
    '"mtp_weights":[1,0.5],"prefix_weight":0.25,"candidates":512},'
    '{"end":1.0,"tokens_per_rank":160,"max_doc_len":160,"short_window":1,"long_window":2,"mtp_weights":[1],'
    '"candidates":512}]',
]
# Graphs the schedule needs: the training step at steps 0, 1, 3 (stages) and 4 (untie); the
# validation at step 3 (tied) and the final one (untied, wider window); the optimizers' update
# math, one graph per update the CUDA graphs capture: Muon's five banks (the 128x128 and 256x128
# matrices, the MLP down projections, the two QKV shapes) and Adam's, with the head tied and untied.
CHANGES = [0, 1, 3, 4]
OPTIMIZER_UPDATES = 5 + 2
EXPECTED_GRAPHS = len(CHANGES) + 2 + OPTIMIZER_UPDATES
# The open pull requests' techniques (the frontier preset's) on the rehearsal model, for the
# capture checks below: the pointer mixture with bands that bind, the normalized hashes, the
# sampled head gradient (one row in four) from step 0, the truncated attention backward chosen
# at step 2 (eager and probed: no graph) and used from step 3, the last two steps exact.
FRONTIER = ["--pointer_mixture=true", "--pointer_dim=16", "--pointer_band=48", "--pointer_val_band=64",
            "--ngram_normalized=true", "--head_grad_stride=4", "--head_grad_start=0", "--attn_bwd_windows=[16,32]",
            "--attn_bwd_choice_steps=[2]", "--attn_bwd_start=3", "--approx_exact_last_steps=2"]
VARIANTS = {"records": [], "frontier": FRONTIER}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    write_shard(d / "r_train_000001.bin", synthetic_documents(rng, 20_000))
    write_shard(d / "r_val_000000.bin", synthetic_documents(rng, 2_000))
    return d


def data_args(shards, log_dir):
    return [f"--train_files={shards}/r_train_*.bin", f"--val_files={shards}/r_val_*.bin", f"--log_dir={log_dir}"]


# ---------------------------------------------------------------------------------------------
# CUDA autocast, emulated


def rehearsal_model_step(h):
    """Forward and backward of a training step and a validation forward of the rehearsal model
    with the Triton kernel functions, on fake CPU tensors (the kernels' fake implementations
    run, nothing launches). Returns the loss."""
    model = tg.build_model(h, tg.select_kernels(dataclasses.replace(h, kernels="auto", device="cuda"),
                                                torch.device("cuda")))
    T = h.stages[0].tokens_per_rank
    tokens = torch.randint(0, 3000, (T,), dtype=torch.int32)
    targets = torch.randint(0, 3000, (T, tg.MAX_TARGETS - 1))
    args = tg.AttentionArgs(torch.tensor([0, 100, T], dtype=torch.int32), 128, 256)
    model.set_loss_unit(1.0 / T)   # as the trainer does: the objective's upstream gradient is known
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(tokens, targets, args, tg.target_weights(h.stages[0], "cpu"))
    loss.backward()
    model.eval()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        model.validation_loss_sum(tokens, targets, args)
    return loss


def test_emulated_autocast_is_cudas_for_every_call_of_a_step():
    """Every call that reaches an autocast kernel in a training step and a validation, made
    again on fake CUDA tensors under torch's own CUDA autocast, gives the same output dtypes."""
    h = tg.parse_config(REHEARSAL)
    with cuda_autocast_rules() as calls, FakeTensorMode(allow_non_fake_inputs=True):
        rehearsal_model_step(h)
    assert {"linear", "pow.Tensor_Scalar", "sum"} <= {call.name for call in calls}
    assert replay_with_cuda_autocast(calls) == []


def test_the_replay_notices_cpu_autocasts_rules():
    """The check has teeth: CPU autocast leaves x.pow(2) of a bf16 x in bf16, CUDA's runs it in fp32."""
    cpu_rule = Call("pow.Tensor_Scalar", (TensorMeta((4, 8), (8, 1), torch.bfloat16), 2), {}, (torch.bfloat16,))
    assert [dtypes for _, dtypes in replay_with_cuda_autocast([cpu_rule])] == [(torch.float32,)]


class KernelInputDtypes(TorchDispatchMode):
    """Records the dtypes of the tensors each custom kernel op receives."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kernels":
            dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
            self.seen.append((func.__name__, dtypes))
        return func(*args, **(kwargs or {}))


def test_kernels_get_one_dtype_under_cuda_autocast():
    """Under CUDA's rules the norms (so q and k) and the value-embedding sum come out in fp32
    and the projections in bf16; the model hands attention bf16 q, k, v all the same, and the
    FP8 MLP and the cross-entropy bf16 activations."""
    h = tg.parse_config(REHEARSAL)
    with cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True), KernelInputDtypes() as recorder:
        rehearsal_model_step(h)
    by_op = {}
    for name, dtypes in recorder.seen:
        by_op.setdefault(name.split(".")[0], []).append(dtypes)
    for q, k, v, *_ in by_op["attn_fwd"]:
        assert q == k == v == torch.bfloat16
    for grad_o, q, k, v, *_ in by_op["attn_bwd"]:
        assert grad_o == q == k == v == torch.bfloat16
    assert all(dtypes[0] == torch.bfloat16 for dtypes in by_op["softcap_ce"] + by_op["softcap_ce_fp8"])
    # compiled, the FP8 layers cast their activations and gradients in torch ops (fused into the
    # kernels making them), the transpose kernel copying the fp8 result; the cast kernel, the weights
    assert all(dtypes[0] == torch.bfloat16 for dtypes in by_op["fp8_cast"] if dtypes[0].itemsize == 2)
    assert by_op["transpose"] and all(dtypes[0].itemsize == 1 for dtypes in by_op["transpose"])


def test_xsa_stays_in_the_heads_dtype_under_cuda_autocast():
    """CUDA's rules give XSA's value norm and projection sum in fp32; the removal still returns
    the heads' dtype and saves no fp32 tensor of the heads' size for its backward (a compiled
    graph fuses the fp32 steps in between; saved or returned, they would be written)."""
    y, v = (torch.randn(8, 2, 16).bfloat16().requires_grad_(True) for _ in range(2))
    alpha = torch.zeros(2, requires_grad=True)
    saved = []

    def keep(t):   # (elements its memory holds, dtype): an expanded (T, H, 1) norm holds T H
        saved.append((t.untyped_storage().nbytes() // t.element_size(), t.dtype))
        return t
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.bfloat16), \
            torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = tg.remove_self_value(y, v, alpha)
    assert out.dtype == torch.bfloat16 and (8 * 2 * 16, torch.bfloat16) in saved
    assert (8 * 2 * 16, torch.float32) not in saved
    assert (8 * 2, torch.float32) in saved   # the norm itself: the rules are CUDA's


def test_the_scaled_mm_fallback_moves_only_the_plain_gemms():
    """--fp8_gemm=scaled_mm: every plain FP8 GEMM of the step runs on torch._scaled_mm (bf16
    outputs from e4m3/e5m2 operands), the relu2 epilogue GEMMs, the weights' casts and the
    transposed copies stay Triton."""
    counts = {}
    for gemm in ("triton", "scaled_mm"):
        h = tg.parse_config(REHEARSAL + [f"--fp8_gemm={gemm}"])
        with cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True), KernelInputDtypes() as recorder:
            rehearsal_model_step(h)
        names = [name.split(".")[0] for name, _ in recorder.seen]
        counts[gemm] = {op: names.count(op) for op in ("fp8_matmul", "fp8_matmul_quant", "fp8_cast", "transpose")}
    with cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True), ScaledMMCalls() as calls:
        rehearsal_model_step(tg.parse_config(REHEARSAL + ["--fp8_gemm=scaled_mm"]))
    assert counts["triton"]["fp8_matmul"] > 0 and counts["scaled_mm"]["fp8_matmul"] == 0
    assert calls.count == counts["triton"]["fp8_matmul"]
    for op in ("fp8_matmul_quant", "fp8_cast", "transpose"):
        assert counts["scaled_mm"][op] == counts["triton"][op] > 0


class ScaledMMCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func.__name__.startswith("_scaled_mm")
        return func(*args, **(kwargs or {}))


class UnalignedInputs(TorchDispatchMode):
    """Records the tensor arguments of the kernel ops (and of searchsorted) that start at an
    offset of their storage that is not a multiple of 16 bytes."""

    def __init__(self):
        super().__init__()
        self.unaligned, self.calls = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "kernels" or func.__name__.startswith("searchsorted"):
            self.calls += 1
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                if isinstance(a, torch.Tensor) and (a.storage_offset() * a.element_size()) % 16:
                    self.unaligned.append((func.__name__, tuple(a.shape), a.storage_offset()))
        return func(*args, **(kwargs or {}))


def test_every_kernel_input_is_16_byte_aligned():
    """Inductor marks a custom op's outputs unaligned when one of its inputs is (and everything
    computed from them loses its vectorized loads): the FP8 scale slots, the document offsets
    searchsorted reads and every other kernel input of a training step and a validation start
    at a 16-byte offset of their storage."""
    h = tg.parse_config(REHEARSAL)
    with cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True), UnalignedInputs() as recorder:
        rehearsal_model_step(h)
    assert recorder.calls > 50 and recorder.unaligned == [], recorder.unaligned[:10]


# ---------------------------------------------------------------------------------------------
# The rehearsal


def _recorded_launches(launches):
    """Wrap kernels._launch so that every launch is recorded (kernel, config, grid, arguments as
    the JIT specializes on them) and then run."""
    original = kernels._launch

    def record_and_launch(kernel, grid, config, **args):
        launches.append((kernel.__name__, config, tuple(grid),
                         {name: sm90_report.recorded_argument(value) for name, value in args.items()}))
        original(kernel, grid, config, **args)
    return original, record_and_launch


# The line tg.train writes when the warm-up (and the FP8 calibration) is over: every launch after
# it belongs to the timed run, validations included.
WARM_UP_LINE = "warm-up: "


class TimedRunStart:
    """Wraps a RunLog's write: `at` becomes the number of launches recorded when the trainer
    logged WARM_UP_LINE (None until then)."""

    def __init__(self, log, launches):
        self.write, self.launches, self.at = log.write, launches, None

    def __call__(self, line, echo=False):
        if self.at is None and line.startswith(WARM_UP_LINE):
            self.at = len(self.launches)
        return self.write(line, echo)


@interpreted
def rehearse(shards, log_dir):
    """Train the rehearsal config on the CUDA path (interpreter, CUDA autocast rules, aot_eager)
    through tg.train; returns the final val loss, the log path, every kernel launch, the graph
    breaks and the index of the timed run's first launch."""
    torch._dynamo.reset()
    launches = []
    original, kernels._launch = _recorded_launches(launches)
    try:
        with cuda_autocast_rules():
            h = tg.parse_config(REHEARSAL + data_args(shards, log_dir))
            log = tg.RunLog(str(log_dir), active=True)
            log.write = timed = TimedRunStart(log, launches)
            try:
                val_loss = tg.train(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), log)
            finally:
                log.close()
    finally:
        kernels._launch = original
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    return val_loss, log.path, launches, breaks, timed.at


@compiled
def compile_for_hopper(launches):
    """sm90_report entries and problems of the distinct recorded launches."""
    report = sm90_report.build_report([(getattr(kernels, name), config, args) for name, config, _, args in launches])
    return report, sm90_report.problems(report)


def kernel_variants(launches):
    """The distinct kernel variants of recorded launches, as the Triton JIT tells them apart
    (sm90_report._variant_key: the specialized signature, constexprs, options)."""
    return {sm90_report._variant_key(getattr(kernels, name), config, args) for name, config, _, args in launches}


def variants_missing_from_the_warm_up(launches, timed_from):
    """The kernel variants the timed run launches that the warm-up did not: each one is a
    Triton compile inside the timed run on a GPU. Readable lines, one per variant."""
    warm = kernel_variants(launches[:timed_from])
    missing = kernel_variants(launches[timed_from:]) - warm
    return sorted(f"{name}: {signature} constexprs {constexprs} attrs {attrs}"
                  for name, signature, constexprs, attrs, *_ in missing)


@pytest.fixture(scope="module")
def rehearsal(shards, tmp_path_factory):
    return rehearse(str(shards), str(tmp_path_factory.mktemp("rehearsal_logs")))


def test_rehearsal_trains_through_every_transition(rehearsal):
    val_loss, log_path, _, breaks, _ = rehearsal
    log = parse_log(log_path)
    assert log.finished and math.isfinite(val_loss) and breaks == {}
    assert [step for step, _, _ in log.val_points] == [3, 5]
    assert [s["step"] for s in log.steps] == list(range(1, 6))
    assert log.steps[-1]["train_loss"] < log.steps[0]["train_loss"]


def test_rehearsal_compiles_only_in_the_warm_up(rehearsal):
    """Every graph of the run (stage shapes, the untie, each validation, each optimizer update)
    is built in the warm-up; the timed run, including the validations, builds none."""
    log = parse_log(rehearsal[1])
    assert f"compile: {EXPECTED_GRAPHS} graphs in the warm-up, 0 in the timed run" in log.info


def test_rehearsal_logs_each_warm_up_part_as_it_ends(rehearsal):
    """The warm-up logs each part with its seconds and the graphs compiled in it: the training
    steps of each graph key (each compiling its forward and backward, the first also the
    optimizers' updates) and each validation's, all the warm-up's graphs among them."""
    log = parse_log(rehearsal[1])
    parts = [re.fullmatch(r"warm-up part: (.*): [\d.]+ s, (\d+) graph\(s\) compiled", line)
             for line in log.info if line.startswith(WARM_UP_PART)]
    assert all(parts) and len(parts) == len(CHANGES) + 2
    training = [re.match(r"\d+ training step\(s\) of stage", p[1]) is not None for p in parts]
    assert training == [True] * len(CHANGES) + [False] * 2
    graphs = [int(p[2]) for p in parts]
    assert all(graphs) and sum(graphs) == EXPECTED_GRAPHS and graphs[0] > graphs[1]


def test_rehearsal_launches_every_kernel_with_one_dtype(rehearsal):
    launches = rehearsal[2]
    names = {name for name, *_ in launches}
    assert names == {"_fp8_cast_kernel", "_fp8_matmul_tma_kernel", "_fp8_matmul_quant_tma_kernel", "_attn_fwd_kernel",
                     "_attn_bwd_fused_kernel", "_softcap_ce_kernel", "_transpose_kernel",
                     "_xxt_kernel", "_qk_norm_rope_fwd_kernel", "_qkv_grad_fp8_kernel",
                     "_dc_fwd_kernel", "_dc_bwd_mix_kernel", "_dc_bwd_q_kernel", "_dc_bwd_kv_kernel",
                     "_sum_rows_kernel", "_add_row_sums_kernel", "_sparse_adam_rows_kernel", "_ema_update_kernel",
                     "_weight_amax_kernel", "_weight_scales_kernel", "_weight_cast_kernel"}
    for name, _, _, args in launches:
        if name.startswith("_attn") and name != "_attn_bwd_delta_kernel":
            assert {args[p].dtype for p in ("q_ptr", "k_ptr", "v_ptr")} == {torch.bfloat16}, name


def test_rehearsal_warm_up_launches_every_variant_of_the_timed_run(rehearsal):
    """Every kernel variant the timed run launches (the JIT's specializations included: an
    integer argument that is 1 or a multiple of 16, 16-byte alignment) was launched in the
    warm-up, so on a GPU nothing compiles on the clock."""
    launches, timed_from = rehearsal[2], rehearsal[4]
    assert timed_from is not None and 0 < timed_from < len(launches)
    missing = variants_missing_from_the_warm_up(launches, timed_from)
    assert not missing, "launched first in the timed run:\n" + "\n".join(missing)


def test_the_warm_up_coverage_check_has_teeth():
    """A variant that only the timed run launches is reported; one the warm-up launched too is
    not: the integer 1 specializes (a constexpr), 7 does not, 16 is marked divisible."""
    T = sm90_report.TensorArg
    config = kernels.SUM_ROWS

    def launch(width):
        pointers = dict(values_ptr=T(torch.float32, True), order_ptr=T(torch.int64, True),
                        starts_ptr=T(torch.int64, True), out_ptr=T(torch.float32, True))
        return "_sum_rows_kernel", config, (4, 1), dict(pointers, scale=1.0, D=width, stride_v=width, stride_o=width,
                                                            BLOCK_D=256)
    assert variants_missing_from_the_warm_up([launch(7), launch(7)], 1) == []
    assert len(variants_missing_from_the_warm_up([launch(7), launch(16), launch(1)], 1)) == 2


def test_rehearsal_attention_grid_is_the_packed_batch(rehearsal):
    """One program per block of the packed batch and head, whatever the documents."""
    for name, config, grid, args in rehearsal[2]:
        if name in ("_attn_fwd_kernel", "_attn_bwd_q_kernel"):
            assert grid == (-(-args["num_tokens"] // config.block_m), 2), (name, grid)
        if name == "_attn_bwd_kv_kernel":
            assert grid == (-(-args["num_tokens"] // config.block_n), 2), (name, grid)


def test_rehearsal_launches_compile_for_hopper(rehearsal):
    """Each distinct launch of the rehearsal compiles for sm_90 with the tensor cores, within
    the shared memory and without spills; every tensor-core kernel but the fallbacks (which only
    a timed warm-up or a pinning key runs: nothing is timed on a CPU) is among them."""
    report, problems = compile_for_hopper(rehearsal[2])
    assert not problems, "\n".join(problems)
    matrix = [e for e in report["kernels"] if e["kernel"] in sm90_report.MATRIX_KERNELS]
    assert {e["kernel"] for e in matrix} == set(sm90_report.MATRIX_KERNELS) - set(sm90_report.FALLBACK_KERNELS)


# ---------------------------------------------------------------------------------------------
# No host sync in a training step

# aten ops that make the host wait for the device: a value read back (item, bool(), equal) or an
# output whose size depends on the data (nonzero, boolean masks, unique).
HOST_SYNC_OPS = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "masked_select",
                 "_unique", "_unique2", "unique_dim", "unique_consecutive", "bincount", "repeat_interleave"}
BOOLEAN_INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}  # sync when indexed by a mask


class HostSyncs(TorchDispatchMode):
    """Raises on any op that would make the CPU wait for the GPU (HOST_SYNC_OPS, mask indexing)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in HOST_SYNC_OPS or _boolean_mask_index(func, args):
            raise AssertionError(f"{func} waits for the device")
        return func(*args, **(kwargs or {}))


def _boolean_mask_index(func, args):
    """x[mask] and x[mask] = v: the number of selected elements must come back to the host."""
    if func.overloadpacket.__name__ not in BOOLEAN_INDEX_OPS:
        return False
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_training_step_never_waits_for_the_device(shards, tmp_path, monkeypatch, variant):
    """A step of each graph of the rehearsal (each stage, sampled softmax included, and the
    untie; with the frontier's techniques, each state of the approximate backward too) on the
    CUDA path, eager, with HostSyncs active. Whether an op syncs does not depend on the values,
    so the kernel launches are skipped (their outputs stay uninitialized): the guard watches the
    trainer's own torch ops, the wrappers' and the optimizers'."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # lets select_kernels pick the Triton path on a CPU
    monkeypatch.setattr(kernels, "_launch", lambda kernel, grid, config, **args: None)
    steps = [] if variant == "records" else ["--num_iterations=15"]
    h = tg.parse_config(REHEARSAL + VARIANTS[variant] + steps + data_args(shards, tmp_path) + ["--compile=false"])
    checked = []
    with cuda_autocast_rules():
        trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(str(tmp_path), active=False))
        assert trainer.kernels.attention is kernels.flash_attn_varlen and trainer.kernels.fp8_mlp is not None
        loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
        for step in tg.graph_changes(h):
            trainer.advance_to(step)
            stage = h.stages[tg.stage_index(h, step)]
            slices = loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
            with HostSyncs():
                trainer.train_step(step, slices)
            checked.append(step)
    if variant == "records":
        assert checked == CHANGES
    else:                          # stages at 0, 3, 9, the untie at 12, the truncation at 3, exact from 13
        assert checked == [0, 3, 9, 12, 13]
        assert {tg.approximate_backward_at(h, step) for step in checked} == {(4, False), (4, True), (1, False)}


def test_the_sync_guard_has_teeth():
    with pytest.raises(AssertionError, match="waits for the device"), HostSyncs():
        torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="waits for the device"), HostSyncs():
        torch.arange(4)[torch.arange(4) > 1]


# ---------------------------------------------------------------------------------------------
# What a captured step bakes in
#
# A CUDA graph replays the kernels its capture recorded: the same ops, with the same scalar
# arguments, reading and writing the same addresses. So a step can be captured once per graph
# key only if two steps of one key make the same calls with the same non-tensor arguments and
# touch the same tensors from outside the step (parameters, gradients, optimizer-free state,
# input buffers). Tensors the step makes itself come from the graph's pool and may differ.

class StepTrace(TorchDispatchMode):
    """Each op of a step: its name, non-tensor arguments and, for each tensor argument, its
    shape, dtype, strides and either the address of its storage (a tensor from outside the step)
    or "made here" (an output of an earlier op of the step)."""

    def __init__(self):
        super().__init__()
        self.ops, self.made = [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":   # record_function's markers: host-side, not in a graph
            return func(*args, **kwargs)
        inputs = torch.utils._pytree.tree_leaves((args, kwargs))
        self.ops.append((str(func), tuple(self.describe(a) for a in inputs)))
        out = func(*args, **kwargs)
        read = {a.untyped_storage().data_ptr() for a in inputs if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in read:
                self.made.add(t.untyped_storage().data_ptr())
        return out

    def describe(self, a):
        if not isinstance(a, torch.Tensor):
            return repr(a)
        ptr = a.untyped_storage().data_ptr()
        return (tuple(a.shape), a.dtype, a.stride(), "made here" if ptr in self.made else ptr)


def _traced_launches(launches):
    """kernels._launch that records each launch's kernel, grid, config and non-tensor
    arguments (tensors made inside a kernel wrapper are invisible to StepTrace) and runs nothing."""
    def record(kernel, grid, config, **args):
        launches.append((kernel.__name__, tuple(grid), config,
                         {k: (tuple(v.shape), v.dtype, v.stride()) if isinstance(v, torch.Tensor) else v
                          for k, v in args.items()}))
    return record


# The sparse tables' Adam runs eagerly after each replay: its scalars (the event, its decay)
# change every update.
EAGER_LAUNCHES = ("_sum_rows_kernel", "_sparse_adam_rows_kernel")


@pytest.mark.parametrize("variant", VARIANTS)
def test_two_steps_of_one_graph_key_make_the_same_calls_on_the_same_tensors(shards, tmp_path, monkeypatch, variant):
    """For every graph key of a schedule with three stages and the untie (with the frontier's
    techniques, the keys of the approximate backward's states, the probed choice step left out:
    it runs eagerly): the first step finds the key's gradients, the later ones are replays; those
    must all record the same graph (ops, scalars, outside addresses, kernel launches). Eager,
    with the Triton launches skipped (values do not matter, calls do), on the CUDA path under
    CUDA's autocast rules."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    monkeypatch.setattr(kernels, "_launch", _traced_launches(launches))
    h = tg.parse_config(REHEARSAL + VARIANTS[variant] + data_args(shards, tmp_path)
                        + ["--compile=false", "--num_iterations=15"])
    keys, traces = {}, []
    with cuda_autocast_rules():
        trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(str(tmp_path), active=False))
        body = trainer.micro_batch

        def traced_body(*args, **kwargs):   # what a capture records: the body, not the buffer fills around it
            with traces[-1]:
                body(*args, **kwargs)
        trainer.micro_batch = traced_body
        loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
        for step in range(h.num_iterations):
            trainer.advance_to(step)
            stage = h.stages[tg.stage_index(h, step)]
            launches.clear()
            traces.append(StepTrace())
            trainer.train_step(step, loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks,
                                                       trainer.mine))
            captured = [launch for launch in launches if launch[0] not in EAGER_LAUNCHES]
            if step not in h.attn_bwd_choice_steps:
                keys.setdefault(tg.graph_key(h, step), []).append((step, traces[-1].ops, captured))
    replayed = sorted(key for key, steps in keys.items() if len(steps) >= 3)
    if variant == "records":
        assert sorted(keys) == replayed == [(0, True), (1, True), (2, False), (2, True)]
    else:                          # (stage, tied, head gradient stride, truncated)
        assert replayed == [(1, True, 4, True), (2, True, 4, True)]
    for key in replayed:
        steps = keys[key]
        step_a, ops_a, launches_a = steps[1]
        for step_b, ops_b, launches_b in steps[2:]:
            assert len(ops_a) == len(ops_b) and len(ops_a) > 100, key
            for a, b in zip(ops_a, ops_b):
                assert a == b, f"graph {key}: step {step_a} made {a}, step {step_b} made {b}"
            assert launches_a == launches_b and launches_a, key


def test_the_trace_notices_a_baked_scalar_and_a_moved_tensor():
    """The check has teeth: a step number as a Python scalar, or an input copied to a new
    tensor instead of into a buffer, changes the trace."""
    weight = torch.ones(4)

    def trace(step, fresh):
        with StepTrace() as t:
            x = fresh.clone() if step else fresh
            (x * weight + step).sum()
        return t.ops
    assert trace(3, torch.ones(4)) != trace(4, torch.ones(4))
    buffer = torch.ones(4)
    assert trace(0, buffer) == trace(0, buffer)
    assert trace(0, torch.ones(4)) != trace(0, torch.ones(4) + 1)


def _streams_as_no_ops(monkeypatch):
    """torch.cuda's streams as no-ops, for the capture path on a CPU."""
    stream = type("Stream", (), {"wait_stream": lambda self, other: None})
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", stream)


@pytest.mark.parametrize("variant", VARIANTS)
def test_what_the_warm_up_captures_is_what_a_timed_step_makes(shards, tmp_path, monkeypatch, variant):
    """The forward+backward the warm-up captures for each graph key (the graph every timed step
    of that key replays) makes the same calls, with the same scalars, on the same tensors as a
    timed micro-batch of the key: three stages of different micro-batch sizes (each its own loss
    unit, the cross-entropy's upstream gradient) with two micro-batches a step, and the untie;
    with the frontier's techniques, each state of the approximate backward (the probed choice
    step runs eagerly, not from a graph).
    The capture is traced where StepGraphs would record a CUDA graph, and leaves none, so the
    timed run's micro-batches run the same bodies eagerly, traced too; launches skipped, CUDA's
    autocast rules."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    launches = []
    monkeypatch.setattr(kernels, "_launch", _traced_launches(launches))
    _streams_as_no_ops(monkeypatch)
    steps = [] if variant == "records" else ["--num_iterations=15"]
    h = tg.parse_config(REHEARSAL + VARIANTS[variant] + steps + data_args(shards, tmp_path)
                        + ["--compile=false", "--batch_ranks=2"])
    captured, timed = {}, []

    def traced(fn):
        """fn() under a StepTrace: (its ops, its captured kernel launches)."""
        launches.clear()
        with StepTrace() as trace:
            fn()
        return trace.ops, [launch for launch in launches if launch[0] not in EAGER_LAUNCHES]

    def record(fn, what):          # StepGraphs._record: the capture traced, no graph kept
        captured[what] = traced(fn)
    with cuda_autocast_rules():
        trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(str(tmp_path), active=False))
        trainer.graphs.capturing = True
        monkeypatch.setattr(trainer.graphs, "_record", record)
        warm_up(tg, trainer, tg.shards_of(h.train_files), tg.validation_data(h, trainer.pg,
                                                                            tg.shards_of(h.val_files)))
        for key, step in trainer.graphs.steps.items():
            step.body = lambda inputs, body=step.body, key=key: timed.append((key, traced(lambda: body(inputs))))
        loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
        for step in range(h.num_iterations):
            trainer.advance_to(step)
            stage = h.stages[tg.stage_index(h, step)]
            trainer.train_step(step, loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks,
                                                       trainer.mine))
    assert [key for key, _ in timed] == [tg.graph_key(h, step) for step in range(h.num_iterations) for _ in range(2)
                                         if step not in h.attn_bwd_choice_steps]
    for key, (ops, step_launches) in timed:
        capture_ops, capture_launches = captured[f"training step of graph {key}"]
        assert len(ops) == len(capture_ops) and len(ops) > 100, key
        for a, b in zip(capture_ops, ops):
            assert a == b, f"graph {key}: the capture made {a}, a timed step {b}"
        assert capture_launches == step_launches and step_launches, key
