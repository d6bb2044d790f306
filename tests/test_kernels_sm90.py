"""Hopper (sm_90) compile checks of every production kernel launch, on a machine without a GPU.

bench/sm90_report.py records the launches of the trainer at the speedrun shapes (a step of
every stage, the optimizer and the final validation, traced under CUDA's autocast rules) and
the library's other production variants, and compiles each for GPUTarget("cuda", 90, 32). The
compiles run once, in a worker process whose Triton is not in interpreter mode
(tests/interpreter_shim.py), and take one to three minutes on two cores; the tests share them.
"""
import functools
import json
import sys

import pytest
import triton

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
    casts and GEMMs (MLP, QKV, head), the QK norm + RoPE, attention forward and backward at head
    dims 64 and 128 with bf16 q, k, v, composed attention, the cross-entropy and its backward, and
    the optimizer's X X^T."""
    trainer = [e for e in hopper_report()["kernels"] if e["trainer"]]
    assert {e["kernel"] for e in trainer} == {
        "_fp8_cast_kernel", "_fp8_matmul_kernel", "_fp8_matmul_quant_kernel", "_attn_fwd_kernel",
        "_attn_bwd_delta_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel", "_softcap_ce_kernel",
        "_scale_rows_kernel", "_xxt_kernel", "_qk_norm_rope_fwd_kernel", "_qk_norm_rope_bwd_kernel",
        "_dc_fwd_kernel", "_dc_bwd_mix_kernel", "_dc_bwd_q_kernel", "_dc_bwd_kv_kernel"}
    for e in trainer:
        if e["kernel"] in ("_attn_fwd_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel"):
            assert e["variant"].split("(")[1].startswith("bf16,bf16,bf16,"), e["variant"]


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
