"""bench/first_contact.py on a CPU: its parts run in their order within caps that fill its 9
minutes, the compiled run before the benches; each part runs in a process of its own, so that a
part that raises or whose process dies (as one with a sticky CUDA error does) costs that part
only; a part past its deadline is killed, with what it started, and keeps what it reported; the
projection is made from what finished; the kernel timer asks for medians."""
import json
import pathlib
import re
import subprocess
import sys
import time
import types

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench" / "first_contact.py"
sys.path.insert(0, str(REPO_ROOT / "bench"))
import first_contact  # noqa: E402

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


# What the dry run prints, in the order of its parts: environment, tests, plan, compiled run,
# eager steps, kernel benches, projection.
SECTIONS = ("torch", "nvidia-smi", "memory budget of the compiled run", "GPU tests (collected only)",
            "data: the tiny corpus", "compiled run: median step", "compile: 0 graphs in the warm-up, 0 in the timed run",
            "losses: ", "| step | triton loss | triton ms | reference loss | reference ms |", "fp8_matmul", "fp8_relu2_mlp",
            "fp8_linear", "flash_attn_varlen fwd+bwd d=128 vs flex_attention",
            "flash_attn_varlen fwd+bwd d=64 vs SDPA flash", "softcap_cross_entropy", "qk_norm_rope fwd+bwd",
            "distinct_rows + sum_rows", "sparse_adam_rows_", "flex_attention runs uncompiled", "projection",
            "bench time:")


def test_first_contact_runs_the_compiled_run_before_the_benches_within_nine_minutes():
    """The parts' caps, in the order they run, with the report's reserve fill at most the 9 minutes
    a first GPU command may take; the compiled run (the measurement that matters most) comes
    before the eager steps and the kernel benches, which take what is left."""
    order = list(first_contact.PART_LIMITS_S)
    assert order == ["environment", "tests", "training:plan", "compiled", "training:triton", "training:reference",
                     "kernels"]
    assert sum(first_contact.PART_LIMITS_S.values()) + first_contact.REPORT_RESERVE_S <= first_contact.BUDGET_S <= 540
    assert first_contact.KERNEL_BENCH_LIMIT_S <= first_contact.PART_LIMITS_S["kernels"]


def test_first_contact_dry_run_prints_its_sections_in_order(dry_run_with_failures):
    out = dry_run_with_failures.stdout
    out = out[out.index("\n## "):]     # the section, after the parts' status lines
    at = [out.find(section) for section in SECTIONS]
    missing = [section for section, i in zip(SECTIONS, at) if i < 0]
    assert not missing, f"no {missing} in the dry output:\n{out[-3000:]}"
    assert at == sorted(at), [s for s, i, j in zip(SECTIONS, at, at[1:]) if i > j]


def test_the_benches_run_at_the_presets_widths():
    """The kernel benches' softmax widths are the speedrun's candidate counts, the dominant
    stage's first, and the attention windows the dominant stage's."""
    import train_gpt as tg
    h = tg.parse_config(["--preset", "speedrun"])
    widths = first_contact.GPU_SHAPES["softmax_widths"]
    assert set(widths) == {s.candidates for s in h.stages if s.candidates}
    dominant = h.stages[first_contact.DOMINANT_STAGE]
    assert widths[0] == dominant.candidates and dominant.tokens_per_rank == first_contact.GPU_SHAPES["tokens"]
    assert first_contact.GPU_SHAPES["windows"] == (dominant.short_window * 128, dominant.long_window * 128)


def test_failed_parts_cost_only_themselves(dry_run_with_failures):
    result = dry_run_with_failures
    out = result.stdout
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    kernel_names = {row[0] for row in table_rows(out, r"(fp8|flash|softcap|xxt|qk_norm|distinct|sparse|composed).*")}
    assert "xxt" not in kernel_names
    for name in ("fp8_matmul mlp up (fast accumulation)", "fp8_relu2_mlp fwd+bwd vs bf16", "flash_attn_varlen fwd+bwd d=64 vs SDPA flash",
                 "softcap_cross_entropy fwd+bwd", "qk_norm_rope fwd+bwd vs torch ops (eager)",
                 "sparse_adam_rows_ vs torch reference", "composed attention fwd+bwd vs torch reference (eager)"):
        assert name in kernel_names, f"no {name!r} line in the kernel table:\n{out[-4000:]}"
    steps = table_rows(out, r"\d+")
    assert len(steps) == first_contact.EAGER_STEPS, out[-4000:]
    for step in steps:                 # triton's (reported step by step before the crash) and the reference's
        assert "-" not in step and abs(float(step[1]) - float(step[3])) < 0.01 * float(step[3]), step
    assert "compiled run: median step" in out and "bench time:" in out


def test_failed_parts_are_named_with_their_errors(dry_run_with_failures):
    result = dry_run_with_failures
    out = result.stdout
    raised = "kernel:xxt: RuntimeError: injected by --fail-part kernel:xxt"
    died = "training:triton: its process died (exit status 1) before it reported"
    failures = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert len(failures) == 1 and raised in failures[0] and died in failures[0], out[-4000:]
    assert "not timed: kernel:xxt (RuntimeError: injected by --fail-part kernel:xxt)" in out
    assert result.stderr.strip().splitlines()[-1] == "FAILED: training:triton, kernel:xxt"   # in the parts' order
    assert "projection (an estimate, not a measurement)" in out, "made from what finished"


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
    runner = first_contact.PartRunner(tmp_path, dry=False)
    outcome = runner.run("hangs", reports_then_hangs, DEADLINE_S)
    assert outcome.timed_out and outcome.error == f"stopped at its deadline ({DEADLINE_S} s)"
    sleeper = outcome.result["sleeper"]
    end = time.monotonic() + 10
    while running(sleeper) and time.monotonic() < end:
        time.sleep(0.1)
    assert not running(sleeper), "the part's own process outlived the kill"


def test_a_part_without_time_left_is_not_started(tmp_path):
    outcome = first_contact.PartRunner(tmp_path, dry=False).run("late", reports_then_hangs, 0.5)
    assert outcome.not_run == "out of time budget" and not outcome.error


def test_the_projection_corrects_the_models_compute_by_the_measured_step():
    """8xH100 = (measured / model at the dominant shape on this GPU) x the model's compute time of
    the speedrun + its communication; without a measured step, the model alone, said so."""
    model = dict(stages=[dict(ms=50.0)])
    speedrun = dict(run_s=45.0, peak_s=31.0, compute_s=41.0, communication_s=4.0)
    line = first_contact.projection_line(dict(step_ms=[60.0, 62.0, 61.0]), model, speedrun)
    assert line.startswith("projection (an estimate, not a measurement): 8xH100 speedrun 54.0 s = measured/model 1.22")
    assert "the step model alone: 45.0 s (31.0 s at the peaks)" in line
    failed = first_contact.projection_line(dict(error="exit status 1"), model, speedrun)
    assert "no measured step to correct it" in failed and "45.0 s" in failed
    assert first_contact.projection_line(None, None, None) == ("projection: not available: the step model did not "
                                                              "finish in time")


def test_with_an_out_dir_every_recorded_part_rewrites_the_files(tmp_path):
    out = tmp_path / "out"
    log = tmp_path / "child.log"
    log.write_text("the child's output\n")
    report = first_contact.Report(out)
    report.put("header", "## a header")
    report.record("kernel:xxt", first_contact.Outcome({}, 2.0, "RuntimeError: boom", "Traceback: ...", log_path=str(log)))
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
    assert first_contact.Timer(dry=False)(lambda: None) == 1.5
    assert calls[0]["return_mode"] == "median"
