"""Hopper (sm_90) compile checks of every production kernel launch, on a machine without a GPU.

bench/sm90_report.py records the launches a training step makes at the speedrun shapes and
compiles each for GPUTarget("cuda", 90, 32) (SPEC 5). The compiles run once, in a worker
process whose Triton is not in interpreter mode (tests/interpreter_shim.py), and take one to
three minutes on two cores; the three tests share them.
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
def test_shared_memory_fits_and_nothing_spills():
    report = hopper_report()
    problems = sm90_report.problems(report)
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(COMMITTED is None or COMMITTED["triton"] != triton.__version__,
                    reason="bench/sm90_resources.json was made with another triton version")
@compiled
def test_committed_resource_report_is_current():
    """bench/sm90_resources.json matches a fresh compile, so a change that moves registers,
    shared memory or instruction counts shows up in review."""
    assert hopper_report() == json.loads(sm90_report.REPORT_PATH.read_text()), (
        "bench/sm90_resources.json is out of date: run `python bench/sm90_report.py --write` and review the diff")
