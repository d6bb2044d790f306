"""bench/bench_gpu.py on a CPU: each part runs in a process of its own, so that a part that raises
or whose process dies (as one with a sticky CUDA error does) costs that part only; a part past its
deadline is killed, with what it started, and keeps what it reported; the projection is made
from what finished and names what it lacks; the kernel timer asks for medians."""
import json
import pathlib
import re
import subprocess
import sys
import time
import types

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench" / "bench_gpu.py"
sys.path.insert(0, str(REPO_ROOT / "bench"))
import bench_gpu  # noqa: E402

HANG_S = 600              # longer than any test: a process that sleeps this long must have been killed
DEADLINE_S = 3


def table_rows(text, first_cell):
    """The cells of the markdown rows of `text` whose first cell matches the regex first_cell."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [row for row in rows if re.fullmatch(first_cell, row[0])]


@pytest.fixture(scope="module")
def dry_run_with_failures():
    """A dry run (every part once, tiny shapes, the Triton interpreter) in which the xxt bench
    raises and the eager Triton training variant's process dies, each after its work."""
    return subprocess.run([sys.executable, str(BENCH), "--dry", "--fail-part", "kernel:xxt",
                           "--crash-part", "training:triton"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)


def test_the_dry_run_prints_every_section(dry_run_with_failures):
    out = dry_run_with_failures.stdout
    for section in ("torch", "GPU tests (collected only)", "fp8_matmul", "fp8_relu2_mlp", "fp8_linear",
                    "flash_attn_varlen fwd+bwd d=128 vs flex_attention", "flash_attn_varlen fwd+bwd d=64 vs SDPA flash",
                    "flex_attention runs uncompiled", "softcap_cross_entropy", "qk_norm_rope fwd+bwd",
                    "distinct_rows + sum_rows", "sparse_adam_rows_",
                    "| stage | first step | tokens/step | triton ms/step | with CUDA graphs | graphs speed-up | reference ms/step",
                    "compiled run: step_avg", "compile: 0 graphs in the warm-up, 0 in the timed run", "bench time:"):
        assert section in out, f"no {section!r} in the dry output:\n{out[-3000:]}"


def test_failed_parts_cost_only_themselves(dry_run_with_failures):
    result = dry_run_with_failures
    out = result.stdout
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    kernel_names = {row[0] for row in table_rows(out, r"(fp8|flash|softcap|xxt|qk_norm|distinct|sparse|composed).*")}
    assert "xxt" not in kernel_names
    for name in ("fp8_matmul mlp up", "fp8_relu2_mlp fwd+bwd vs bf16", "flash_attn_varlen fwd+bwd d=64 vs SDPA flash",
                 "softcap_cross_entropy fwd+bwd", "qk_norm_rope fwd+bwd vs torch ops (eager)",
                 "sparse_adam_rows_ vs torch reference", "composed attention fwd+bwd vs torch reference (eager)"):
        assert name in kernel_names, f"no {name!r} line in the kernel table:\n{out[-4000:]}"
    stages = table_rows(out, r"\d+")
    assert len(stages) == 2, out[-4000:]
    for stage in stages:               # triton ms (reported stage by stage before the crash), with CUDA graphs, ...
        assert stage[3] != "-" and stage[4] != "-" and stage[6] != "-", stage
    assert "compiled run: step_avg" in out and "bench time:" in out


def test_failed_parts_are_named_with_their_errors(dry_run_with_failures):
    result = dry_run_with_failures
    out = result.stdout
    raised = "kernel:xxt: RuntimeError: injected by --fail-part kernel:xxt"
    died = "training:triton: its process died (exit status 1) before it reported"
    failures = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert len(failures) == 1 and raised in failures[0] and died in failures[0], out[-4000:]
    assert "not timed: kernel:xxt (RuntimeError: injected by --fail-part kernel:xxt)" in out
    assert result.stderr.strip().splitlines()[-1] == "FAILED: kernel:xxt, training:triton"
    assert "projection (an estimate, not a measurement)" in out, "made from the stages the crashed part reported"


def test_an_unknown_part_to_fail_is_refused_in_one_line():
    result = subprocess.run([sys.executable, str(BENCH), "--dry", "--fail-part", "kernel:nonesuch"],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("got kernel:nonesuch")


def reports_then_hangs(task, progress):
    """A part that starts a sleeping process, reports its pid, then sleeps past any deadline."""
    sleeper = subprocess.Popen(["sleep", str(HANG_S)])
    progress(sleeper=sleeper.pid)
    time.sleep(HANG_S)


def running(pid):
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


def test_a_part_past_its_deadline_is_killed_with_what_it_started(tmp_path):
    runner = bench_gpu.PartRunner(tmp_path, dry=False)
    outcome = runner.run("hangs", reports_then_hangs, DEADLINE_S)
    assert outcome.timed_out and outcome.error == f"stopped at its deadline ({DEADLINE_S} s)"
    sleeper = outcome.result["sleeper"]
    end = time.monotonic() + 10
    while running(sleeper) and time.monotonic() < end:
        time.sleep(0.1)
    assert not running(sleeper), "the part's own process outlived the kill"


def test_a_part_without_time_left_is_not_started(tmp_path):
    outcome = bench_gpu.PartRunner(tmp_path, dry=False).run("late", reports_then_hangs, 0.5)
    assert outcome.not_run == "out of time budget" and not outcome.error


def test_the_projection_is_made_from_what_finished_and_names_what_it_lacks():
    plan = dict(stage_steps=[300, 100], batch_ranks=8, num_iterations=400)
    line, numbers = bench_gpu.projection_block(plan, [800.0, None], "training:triton: stopped at its deadline (60 s)",
                                               None, "compiled: not in --parts")
    assert numbers["seconds"] == pytest.approx(300 * 0.8 / 8)
    assert line.startswith("projection (an estimate, not a measurement): 8xH100 training time 30 s")
    assert ("it lacks the eager Triton step time of stages 1 (training:triton: stopped at its deadline (60 s)): "
            "100 of the 400 steps count 0, so the time is a lower bound") in line
    assert "the compiled/eager ratio (compiled: not in --parts), so the time is eager" in line
    complete, numbers = bench_gpu.projection_block(plan, [800.0, 400.0], "", 0.5, "")
    assert numbers["seconds"] == pytest.approx((300 * 0.8 + 100 * 0.4) * 0.5 / 8) and "lacks" not in complete


def test_with_an_out_dir_every_recorded_part_rewrites_the_files(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "child.log"
    log.write_text("the child's output\n")
    report = bench_gpu.Report(out)
    report.put("header", "## a header")
    report.record("kernel:xxt", bench_gpu.Outcome({}, 2.0, "RuntimeError: boom", "Traceback: ...", log_path=str(log)))
    failures = "FAILED: kernel:xxt: RuntimeError: boom (bench.json has the details)"
    assert (out / "results.md").read_text() == f"\n## a header\n\n{failures}\n"
    raw = json.loads((out / "bench.json").read_text())
    assert raw["part_seconds"] == {"kernel:xxt": 2.0} and raw["errors"]["kernel:xxt"].startswith("RuntimeError: boom")
    assert "the child's output" in (out / "parts.log").read_text()
    assert sorted(path.name for path in out.iterdir()) == ["bench.json", "parts.log", "results.md"]


def test_the_kernel_timer_asks_do_bench_for_the_median(monkeypatch):
    calls = []
    testing = types.ModuleType("triton.testing")
    testing.do_bench = lambda fn, **options: calls.append(options) or 1.5
    triton = types.ModuleType("triton")
    triton.testing = testing
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setitem(sys.modules, "triton.testing", testing)
    assert bench_gpu.Timer(dry=False)(lambda: None) == 1.5
    assert calls[0]["return_mode"] == "median"
