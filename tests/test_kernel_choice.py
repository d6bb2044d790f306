"""kernel_choice: which implementation each kernel call runs, tested with fake timings on a CPU.

The selection logic alone (candidates that record their runs, a timer that reads a table of
made-up milliseconds, an agreement that plays rank 0 of several processes), then the kernels'
own calls under the Triton interpreter: an FP8 GEMM and attention picking the candidate the fake
timer makes fastest and running it, every implementation checked against the reference first.
"""
import contextlib
import sys

import pytest
import torch

from interpreter_shim import REPO_ROOT, LaunchedKernels, isolated

sys.path.insert(0, str(REPO_ROOT))
from machinery import kernel_choice  # noqa: E402
import kernels  # noqa: E402

interpreted = isolated(interpret=True)


@pytest.fixture(autouse=True)
def fresh_choices():
    kernel_choice.reset()
    yield
    kernel_choice.reset()


class Recorded:
    """Candidates that record each run (and return their name), a timer reading fake ms."""

    def __init__(self, ms):
        self.ms, self.runs = ms, []

    def candidates(self, *names, failing=()):
        def run(name):
            def go():
                self.runs.append(name)
                if name in failing:
                    raise RuntimeError(f"{name} cannot run here")
                return name
            return go
        return [kernel_choice.Candidate(name, run(name)) for name in names]

    def timer(self, fn):
        return self.ms[fn()]


def test_rules_run_the_first_candidate_untimed():
    r = Recorded({})
    chosen = kernel_choice.choose("gemm", (64, 64, 64), r.candidates("rule", "other"))
    assert chosen.name == "rule" and r.runs == []
    (decision,) = kernel_choice.decisions()
    assert (decision.chosen, decision.how, decision.ms) == ("rule", "rule", {})


def test_the_selection_keeps_the_fastest_and_times_each_key_once():
    r = Recorded({"rule": 2.0, "fast": 0.5, "slow": 3.0})
    kernel_choice.begin_selection(timer=r.timer)
    first = kernel_choice.choose("gemm", (1, 2, 3), r.candidates("rule", "fast", "slow"))
    runs = len(r.runs)
    again = kernel_choice.choose("gemm", (1, 2, 3), r.candidates("rule", "fast", "slow"))
    assert first.name == again.name == "fast" and len(r.runs) == runs     # no second timing
    other = kernel_choice.choose("gemm", (4, 5, 6), r.candidates("rule", "slow"))
    assert other.name == "rule"
    decision = kernel_choice.decisions()[0]
    assert decision.how == "timed" and decision.ms == {"rule": 2.0, "fast": 0.5, "slow": 3.0}
    assert "gemm 1x2x3: fast (timed; fast 0.500 ms, rule 2.000 ms, slow 3.000 ms)" == decision.line()


def test_a_candidate_that_fails_or_disagrees_is_dropped_with_its_reason():
    r = Recorded({"rule": 2.0, "broken": 0.1, "wrong": 0.2})
    kernel_choice.begin_selection(timer=r.timer)
    chosen = kernel_choice.choose("gemm", (8,), r.candidates("rule", "broken", "wrong", failing=("broken",)),
                                  check=lambda out: "differs" if out == "wrong" else None)
    assert chosen.name == "rule"
    decision = kernel_choice.decisions()[0]
    assert set(decision.ms) == {"rule"}
    assert decision.dropped["broken"].startswith("RuntimeError: broken cannot run here")
    assert decision.dropped["wrong"] == "differs"


def test_every_process_runs_rank_0s_choice():
    """This process timed "fast" fastest, rank 0 "slow": the agreement (rank 0's index of the
    candidate list, as the trainer broadcasts it) wins."""
    r = Recorded({"rule": 2.0, "fast": 0.5, "slow": 3.0})
    seen = []

    def agree(index):
        seen.append(index)
        return 2
    kernel_choice.begin_selection(timer=r.timer, agree=agree)
    assert kernel_choice.choose("gemm", (1,), r.candidates("rule", "fast", "slow")).name == "slow"
    assert seen == [1]


def test_frozen_choices_stay_and_new_keys_run_their_rule():
    r = Recorded({"rule": 2.0, "fast": 0.5})
    kernel_choice.begin_selection(timer=r.timer)
    kernel_choice.choose("gemm", (1,), r.candidates("rule", "fast"))
    kernel_choice.end_selection()
    runs = len(r.runs)
    assert kernel_choice.choose("gemm", (1,), r.candidates("rule", "fast")).name == "fast"
    assert kernel_choice.choose("gemm", (2,), r.candidates("rule", "fast")).name == "rule"
    assert len(r.runs) == runs
    lines = kernel_choice.run_lines()
    assert lines[-1] == "kernel choice: 2 shapes: 1 timed in the warm-up, 1 by rule"


def test_nothing_is_timed_while_a_graph_is_captured():
    r = Recorded({"rule": 2.0, "fast": 0.5})
    kernel_choice.begin_selection(timer=r.timer, capturing=lambda: True)
    assert kernel_choice.choose("gemm", (1,), r.candidates("rule", "fast")).name == "rule" and r.runs == []


def test_every_candidate_runs_the_other_triton_candidates_too():
    """The sm_90 report's mode: each call runs its other Triton candidates (the rule's launch is
    the caller's), not the others (torch._scaled_mm, flex_attention)."""
    r = Recorded({})
    candidates = r.candidates("rule", "alt") + [kernel_choice.Candidate("torch", lambda: r.runs.append("torch"),
                                                                        triton=False)]
    with kernel_choice.every_candidate():
        assert kernel_choice.choose("gemm", (1,), candidates).name == "rule"
    assert r.runs == ["alt"]


def test_a_cpu_run_selects_nothing():
    kernel_choice.start_run(torch.device("cpu"), selecting=True)
    assert kernel_choice.mode() == kernel_choice.RULES
    assert kernel_choice.end_run() == []


@contextlib.contextmanager
def selecting(timer):
    """Within: a fresh selection with `timer` (the interpreted worker keeps its state between
    tests: none is left behind)."""
    kernel_choice.reset()
    kernel_choice.begin_selection(timer=timer)
    try:
        yield
    finally:
        kernel_choice.reset()


def implementation(fn):
    """The function a candidate's run calls (its partial's)."""
    return getattr(fn, "func", fn).__name__


@interpreted
@pytest.mark.parametrize("fastest,kernel", [("_run_fp8_matmul_pointer", "_fp8_matmul_kernel"),
                                            ("_run_fp8_matmul_tma", "_fp8_matmul_tma_kernel")])
def test_an_fp8_gemm_runs_the_implementation_the_fake_timer_made_fastest(fastest, kernel):
    """A plain FP8 GEMM under the selection: every candidate (the persistent kernel's plans, the
    pointer kernel, torch._scaled_mm) checked against the reference and timed, the fastest by the
    fake timer then runs; the result is the reference's."""
    generator = torch.Generator().manual_seed(3)
    a = (torch.randint(-8, 9, (32, 64), generator=generator) / 4).to(torch.float8_e4m3fn)
    b = (torch.randint(-8, 9, (48, 64), generator=generator) / 4).to(torch.float8_e4m3fn).t()
    one = torch.ones(1)
    timed = []
    kernel_choice.reset()                # the worker process keeps its state between tests

    def timer(fn):
        timed.append(implementation(fn))
        return 1.0 if implementation(fn) == fastest else 5.0
    kernel_choice.begin_selection(timer=timer)
    with LaunchedKernels() as launched:
        out = kernels.fp8_matmul(a, b, one, one)
    decision = kernel_choice.decisions()[0]
    assert decision.how == "timed" and not decision.dropped, decision.line()
    assert {"_run_fp8_matmul_pointer", "_run_fp8_matmul_tma", "fp8_matmul_scaled_mm"} <= set(timed)
    assert launched.names[-1] == kernel
    assert torch.equal(out, kernels.fp8_matmul_reference(a, b, one, one, torch.bfloat16))


@interpreted
def test_attention_selection_checks_times_and_runs_the_chosen_backward():
    """flash_attn_varlen under the selection: the forward's candidates (the window's tiles, the
    other tiles, the descriptor kernel at both, flex_attention) checked against attention_reference, the
    backward's (atomic at two tile sizes, its descriptor variant at both, deterministic) against the
    deterministic backward; the fake timer makes the deterministic backward fastest, and it is
    the one that runs."""
    generator = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(40, 2, 16, generator=generator).requires_grad_(True) for _ in range(3))
    cu_seqlens = torch.tensor([0, 17, 40], dtype=torch.int32)
    with selecting(lambda fn: 0.1 if implementation(fn) == "_run_attn_bwd_two_kernels" else 1.0):
        o = kernels.flash_attn_varlen(q, k, v, cu_seqlens, 9, 0.25)
        with LaunchedKernels() as launched:
            grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        forward, backward = kernel_choice.decisions()
    assert forward.family == "attention_forward" and set(forward.ms) == {"triton 64x32", "triton 128x64", "tma 64x32",
                                                                         "tma 128x64", "flex"}
    assert backward.chosen == "deterministic" and set(backward.ms) == {"atomic 32x64", "atomic 32x128",
                                                                       "tma atomic 32x64", "tma atomic 32x128",
                                                                       "deterministic"}
    assert launched.names[-3:] == ["_attn_bwd_delta_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel"]
    reference = torch.autograd.grad(kernels.attention_reference(q, k, v, cu_seqlens, 9, 0.25), (q, k, v),
                                    torch.ones_like(o))
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
