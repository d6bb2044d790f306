"""bench/first_contact.py on a CPU: its parts run in their order within caps that leave room for a
second call in the device time, the compiled run (two stages and the untie) first with most of
the time; each part runs in a process of its own, so that a part that raises or whose process
dies (as one with a sticky CUDA error does) costs that part only; a part past its deadline is
killed, with what it started, and keeps what it reported; a compiled run stopped in its warm-up
says how far it came; the compile caches travel in one archive; the tokens that stand in for the
tiny corpus have its statistics; the projection is made from what finished; the kernel timer
asks for medians."""
import dataclasses
import json
import pathlib
import re
import subprocess
import sys
import time
import types

import numpy as np
import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench" / "first_contact.py"
sys.path.insert(0, str(REPO_ROOT / "bench"))
import first_contact  # noqa: E402
import representative_tokens  # noqa: E402
from data.shards import read_shard  # noqa: E402
from data.tokenizer import BOS_ID  # noqa: E402

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
    raises and the eager reference training variant's process dies, each after its work."""
    return subprocess.run([sys.executable, str(BENCH), "--dry", "--fail-part", "kernel:xxt",
                           "--crash-part", "training:reference"],
                          capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)


# What the dry run prints, in the order of its parts: environment (with the data), the compiled
# run (its stages, its warm-up's parts, the caches), the GPU tests, the eager steps and the host
# table, the routing, the kernel benches, the projection.
SECTIONS = ("torch", "nvidia-smi", "memory budget of the compiled run", "data: ",
            "compiled run: stage 0: median step", "; stage 1: median step",
            "compile: 0 graphs in the warm-up, 0 in the timed run", "warm-up parts: ", "losses: ",
            "kernel choices: none logged", "compile caches: cold", "GPU tests (collected only)",
            "| step | triton loss | reference loss | difference | triton ms | reference ms |", "host table: ",
            "host routing per micro-batch", "at one thread", "fp8_matmul", "fp8_relu2_mlp",
            "fp8_linear", "flash_attn_varlen fwd+bwd d=128 [atomic] vs flex_attention",
            "flash_attn_varlen fwd+bwd d=128 [deterministic] vs flex_attention",
            "flash_attn_varlen fwd+bwd d=64 vs SDPA flash", "softcap_cross_entropy", "qk_norm_rope fwd+bwd",
            "distinct_rows + sum_rows", "sparse_adam_rows_", "flex_attention runs uncompiled",
            "measured efficiencies (the step model's measured line", "projection",
            "bench time:")


def test_the_compiled_run_comes_first_with_most_of_the_time_and_a_second_call_fits():
    """The parts' caps, in the order they run: the compiled run right after the environment, with
    half the budget or more and more than any other part; the caps and the report's reserve fill
    at most the budget; a call (a cold machine's start-up, the budget, the transfers) fits twice
    in the device time a task is lent, so a call stopped by a cold compile can be made again."""
    fc = first_contact
    order = list(fc.PART_LIMITS_S)
    assert order == ["environment", "compiled", "tests", "training:triton", "training:reference", "routing",
                     "kernels"]
    caps = fc.PART_LIMITS_S
    assert caps["compiled"] >= fc.BUDGET_S / 2 and all(caps["compiled"] > s for name, s in caps.items()
                                                       if name != "compiled")
    assert sum(caps.values()) + fc.REPORT_RESERVE_S <= fc.BUDGET_S
    assert 2 * (fc.START_UP_S + fc.BUDGET_S + fc.TRANSFER_S) <= fc.DEVICE_TIME_S == 900
    assert fc.KERNEL_BENCH_LIMIT_S <= caps["kernels"]


@pytest.mark.parametrize("dry", [False, True], ids=["gpu", "dry"])
def test_the_compiled_run_has_two_stages_of_different_sizes_and_the_untie_inside_the_second(dry):
    """Two stages of different micro-batches, each with steps timed after its first, and the
    head untied inside the second: three training graphs, each with its own loss unit and shape.
    On a GPU the stages are the speedrun's 2 (the dominant shape) and 4."""
    import train_gpt as tg
    h = tg.parse_config(first_contact.compiled_args(dry))
    first, second = h.stages
    assert first.tokens_per_rank != second.tokens_per_rank
    steps = tg.steps_per_stage(h)
    assert min(steps) >= 2 and steps[0] < tg.untie_step(h) < h.num_iterations
    assert [tg.graph_key(h, step) for step in tg.graph_changes(h)] == [(0, True), (1, True), (1, False)]
    if not dry:
        speedrun = tg.parse_config(["--preset", "speedrun"]).stages
        assert [dataclasses.replace(s, end=1.0) for s in h.stages] == [dataclasses.replace(speedrun[i], end=1.0)
                                                                       for i in (2, 4)]
        assert first.tokens_per_rank == first_contact.GPU_SHAPES["tokens"]


def test_first_contact_dry_run_prints_its_sections_in_order(dry_run_with_failures):
    out = dry_run_with_failures.stdout
    out = out[out.index("\n## "):]     # the section, after the parts' status lines
    at = [out.find(section) for section in SECTIONS]
    missing = [section for section, i in zip(SECTIONS, at) if i < 0]
    assert not missing, f"no {missing} in the dry output:\n{out[-3000:]}"
    assert at == sorted(at), [s for s, i, j in zip(SECTIONS, at, at[1:]) if i > j]
    data = out[at[SECTIONS.index("data: ")]:].splitlines()[0]
    corpus = first_contact.TINY_CORPUS.is_dir()
    assert data.startswith("data: the tiny corpus (real text)" if corpus else "data: tokens drawn from the tiny corpus's"), data


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


def test_the_dry_run_warms_up_each_graph_and_writes_host_rows_back(dry_run_with_failures):
    """The compiled run's warm-up reports each part as it ends: a stage's graph, the other
    stage's, the untied one, the validation; the eager Triton run's host table wrote rows back."""
    out = dry_run_with_failures.stdout
    (parts,) = [line for line in out.splitlines() if line.startswith("warm-up parts: ")]
    keys = re.findall(r"training step\(s\) of (stage \d \(\d+ tokens\), head \w+) [\d.]+ s \(\d+ graphs\)", parts)
    assert keys == ["stage 0 (64 tokens), head tied", "stage 1 (32 tokens), head tied",
                    "stage 1 (32 tokens), head untied"], parts
    assert "a validation forward" in parts
    (host,) = re.findall(r"host table: ([\d,]+) rows written back to host memory in (\d+) round", out)
    assert int(host[0].replace(",", "")) > 0 and int(host[1]) > 0


def test_failed_parts_cost_only_themselves(dry_run_with_failures):
    result = dry_run_with_failures
    out = result.stdout
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    kernel_names = {row[0] for row in table_rows(out, r"(fp8|flash|softcap|xxt|qk_norm|distinct|sparse|composed).*")}
    assert "xxt" not in kernel_names
    for name in ("fp8_matmul mlp up (fast accumulation) [tma]", "fp8_matmul mlp up (fast accumulation) [pointer]",
                 "fp8_matmul mlp up (fast accumulation) [torch._scaled_mm]", "fp8_relu2_mlp fwd+bwd vs bf16",
                 "flash_attn_varlen fwd+bwd d=64 vs SDPA flash",
                 "softcap_cross_entropy fwd+bwd", "qk_norm_rope fwd+bwd vs torch ops (eager)",
                 "sparse_adam_rows_ vs torch reference", "composed attention fwd+bwd vs torch reference (eager)"):
        assert name in kernel_names, f"no {name!r} line in the kernel table:\n{out[-4000:]}"
    steps = table_rows(out, r"\d+")
    assert len(steps) == first_contact.EAGER_STEPS, out[-4000:]
    for step in steps:                 # triton's and the reference's (reported step by step before the crash)
        assert "-" not in step and abs(float(step[1]) - float(step[2])) < 0.01 * float(step[2]), step
    assert "compiled run: stage 0: median step" in out and "bench time:" in out


def test_failed_parts_are_named_with_their_errors(dry_run_with_failures):
    result = dry_run_with_failures
    out = result.stdout
    raised = "kernel:xxt: RuntimeError: injected by --fail-part kernel:xxt"
    died = "training:reference: its process died (exit status 1) before it reported"
    failures = [line for line in out.splitlines() if line.startswith("FAILED: ")]
    assert len(failures) == 1 and raised in failures[0] and died in failures[0], out[-4000:]
    assert "not timed: kernel:xxt (RuntimeError: injected by --fail-part kernel:xxt)" in out
    assert result.stderr.strip().splitlines()[-1] == "FAILED: training:reference, kernel:xxt"   # in the parts' order
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
    line = first_contact.projection_line(dict(stage_ms=[[60.0, 62.0, 61.0], [40.0]]), model, speedrun)
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


def test_a_compiled_run_stopped_in_its_warm_up_says_how_far_it_came(monkeypatch):
    """A cold compile outlasting the cap: the run is killed in its warm-up, and the report names
    the warm-up's parts that ended, with their seconds and graphs, and the last of them."""
    said = ("warm-up part: 2 training step(s) of stage 0 (49,152 tokens), head tied: 141.5 s, 31 graph(s) compiled\n"
            "warm-up part: 2 training step(s) of stage 1 (32,768 tokens), head tied: 52.0 s, 30 graph(s) compiled\n")
    monkeypatch.setattr(first_contact, "run_command", lambda command, timeout_s, env=None: (None, said, ""))
    plan = dict(compiled_args=["--preset", "1gpu"], train_files=["t.bin"], val_files=["v.bin"])
    run = first_contact.compiled_run(plan, dry=False, timeout_s=150)
    assert not run["ok"] and run["error"].startswith("stopped at the time limit after ")
    assert run["error"].endswith("in the warm-up, after 2 training step(s) of stage 1 (32,768 tokens), head tied")
    block = first_contact.compiled_run_block(run, None, dry=False)
    assert ("warm-up parts: 2 training step(s) of stage 0 (49,152 tokens), head tied 141.5 s (31 graphs); "
            "2 training step(s) of stage 1 (32,768 tokens), head tied 52.0 s (30 graphs)") in block


def test_the_compile_caches_travel_in_one_archive(tmp_path, monkeypatch):
    """pack_caches writes the cache folder into one archive that unpack_caches puts back file for
    file; an archive too large to come back leaves Triton's intermediate code out and keeps each
    kernel's metadata and binary (what a cache hit reads)."""
    cache = tmp_path / "cache"
    files = {"triton/abc/kernel.json": b"{}", "triton/abc/kernel.cubin": b"\x7fELF" * 64,
             "triton/abc/kernel.ptx": b"// ptx " * 4096, "triton/abc/__grp__kernel.json": b"{}",
             "inductor/fxgraph/xy/entry": b"graph" * 100}
    for name, data in files.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    archive = tmp_path / "out" / first_contact.CACHE_NAME
    assert first_contact.pack_caches(cache, archive)[::2] == (len(files), False)
    back = tmp_path / "back"
    assert first_contact.unpack_caches(archive, back) == f"compile caches: warm, {len(files)} files from {archive.name}"
    assert {str(p.relative_to(back)): p.read_bytes() for p in back.rglob("*") if p.is_file()} == files
    monkeypatch.setattr(first_contact, "RETURNED_FILE_BYTES", archive.stat().st_size - 1)
    count, size, lean = first_contact.pack_caches(cache, archive)
    lean_back = tmp_path / "lean"
    first_contact.unpack_caches(archive, lean_back)
    assert lean and count == len(files) - 1 and size < archive.stat().st_size + 1
    assert sorted(str(p.relative_to(lean_back)) for p in lean_back.rglob("*") if p.is_file()) == sorted(
        name for name in files if not name.endswith(".ptx"))
    assert first_contact.unpack_caches(tmp_path / "none.tgz", tmp_path / "x").startswith("compile caches: cold")


def test_tokens_drawn_from_the_tiny_corpus_statistics_repeat_as_text_does(tmp_path):
    """The shards that stand in for the tiny corpus: documents of its lengths, each opened by
    BOS, and in a 49,152-token slice as many distinct tokens as independent draws from its
    unigram distribution give (sum over tokens of 1 - (1 - p)^n), near the corpus's own ~5,600
    and far from uniform ids' ~31,000."""
    tokens, p, lengths = representative_tokens.load_statistics()
    assert 15_000 < tokens.size < 30_000 and lengths.max() <= 1024 and abs(p.sum() - 1) < 1e-9
    path = tmp_path / "shard.bin"
    representative_tokens.write_representative_shard(path, 1 << 18, np.random.default_rng(0))
    stream = np.asarray(read_shard(path)).astype(np.int64)
    starts = np.flatnonzero(stream == BOS_ID)
    assert starts[0] == 0 and np.isin(np.diff(starts), lengths).all()
    window = stream[:49152]
    n = (window != BOS_ID).sum()
    expected = (1 - (1 - p) ** n).sum()
    assert abs(np.unique(window[window != BOS_ID]).size / expected - 1) < 0.03
    assert 4_000 < expected < 8_000


@pytest.mark.skipif(not first_contact.TINY_CORPUS.is_dir(), reason="data/tiny_corpus is not built here")
def test_the_token_statistics_are_the_tiny_corpus():
    """bench/tiny_corpus_tokens.npz is the statistics of the corpus built here."""
    with np.load(representative_tokens.TOKEN_STATS) as stats:
        committed = (stats["tokens"], stats["counts"], stats["doc_lengths"])
    assert all(np.array_equal(a, b) for a, b in zip(committed, representative_tokens.corpus_statistics()))
