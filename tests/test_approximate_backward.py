"""The approximate backward (PR 371): the sampled head weight gradient and the truncated
attention backward, against independent float64 statements.

The truncated backward's oracle is plain float64 attention whose backward alone is restricted:
y = O + A - A.detach() with A_i = sum_j M_ij exp(S_ij - lse_i) (v_j - O_i), lse and O detached,
M the pairs within the head's backward window. Its value is O, and autograd through A gives
dV = (M P)^T dO and dS = M P (dP - rowsum(dO O)): the kernels' rule, stated another way. The
windows 64/128/256 of the PR run here at an eighth of their size (8/16/32 tokens, the kernel
tests' SCALED_WINDOW_BLOCK), against forward windows of 5 and 11 scaled blocks.
Tolerances: ATTN of tests/test_kernels.py (1e-4) for fp32 kernels; the sampled gradients are
sums of the same terms as their oracles' (float64, or fp8 grid values exact in fp32).
"""
import functools
import sys

import pytest
import torch
import torch.nn.functional as F

import model_statement as ref
from interpreter_shim import REPO_ROOT, isolated

sys.path.insert(0, str(REPO_ROOT))
import kernels  # noqa: E402
from machinery import backward_windows as bw  # noqa: E402
from machinery.config import ConfigError  # noqa: E402

interpreted = isolated(interpret=True)

SMALL_ATTENTION = (kernels.LaunchConfig(block_m=16, block_n=16), kernels.LaunchConfig(block_m=16, block_n=32),
                   kernels.LaunchConfig(block_m=32, block_n=16), kernels.LaunchConfig(block_m=32, block_n=1),
                   kernels.LaunchConfig(block_m=16, block_n=32))
SCALED_WINDOW_BLOCK = 16           # 128-token blocks at an eighth of their size
SCALED_CANDIDATES = (8, 16, 32)    # PR 371's backward windows 64, 128, 256 at an eighth
SMALL_MATMUL = kernels.LaunchConfig(block_m=16, block_n=32, block_k=32, group_m=2)
SMALL_CE = kernels.LaunchConfig(block_m=1, block_n=64)


# ---------------------------------------------------------------------------------------------
# the truncated attention backward


def visibility(cu_seqlens, T, window):
    """(T, T) bool, from the definition: same document, j <= i, i - j < window (<= 0: none)."""
    doc = torch.searchsorted(cu_seqlens.long(), torch.arange(T), right=True) - 1
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    visible = (doc[:, None] == doc[None, :]) & (j <= i)
    return visible & (i - j < window) if window > 0 else visible


def truncated_oracle(q, k, v, cu_seqlens, window, scale, backward_windows):
    """float64 attention (T, H, Dv) whose backward keeps, for head h, only the pairs less than
    backward_windows[h] apart (<= 0: all), with P and O of the full window: the float64
    statement's truncated_backward_attention over `visibility`."""
    q, k, v = (t.double() for t in (q, k, v))
    return ref.truncated_backward_attention(q, k, v, visibility(cu_seqlens, q.shape[0], window), scale,
                                            backward_windows)


def grads(attention, q, k, v, grad_o, *args, **kwargs):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = attention(*leaves, *args, **kwargs)
    return [o.detach(), *torch.autograd.grad(o, leaves, grad_o.to(o.dtype))]


def inputs(T, H, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, H, d, generator=g) for _ in range(4)]


def check_truncated(got, want, what):
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-4, msg=lambda m: f"{what} {name}: {m}")


def test_the_oracle_with_full_windows_is_the_exact_backward():
    """The oracle's construction: backward windows at or beyond the forward's give autograd's
    gradients of plain attention."""
    q, k, v, grad_o = inputs(40, 2, 8, 0)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    exact = grads(kernels.attention_reference, q.double(), k.double(), v.double(), grad_o, cu, 12, 0.3)
    check_truncated(grads(truncated_oracle, q, k, v, grad_o, cu, 12, 0.3, (0, 12)), exact, "oracle")


@pytest.mark.parametrize("window, backward", [(5 * SCALED_WINDOW_BLOCK, (8, 16, 32, 0)),
                                              (11 * SCALED_WINDOW_BLOCK + 1, (32, 8, 500, 16))])
def test_the_reference_truncated_backward_equals_the_oracle(window, backward):
    """attention_reference's truncated backward (what the trainer runs on a CPU) in fp32 and in
    float64, per-head windows 8/16/32 (PR 371's 64/128/256 scaled), exact (0) and beyond the window."""
    T = 220
    q, k, v, grad_o = inputs(T, 4, 16, window)
    cu = torch.tensor([0, 3, 150, 212, T, T], dtype=torch.int32)
    want = grads(truncated_oracle, q, k, v, grad_o, cu, window, 0.25, backward)
    for dtype in (torch.float32, torch.float64):
        got = grads(kernels.attention_reference, *(t.to(dtype) for t in (q, k, v)), grad_o, cu, window, 0.25,
                    backward_windows=torch.tensor(backward))
        check_truncated(got, want, f"reference {dtype}")
    truncated = [g for g in want[1:]]
    exact = grads(truncated_oracle, q, k, v, grad_o, cu, window, 0.25, (0, 0, 0, 0))[1:]
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(truncated, exact)), "the windows bind"


@interpreted
@pytest.mark.parametrize("impl", ("atomic", "deterministic"))
@pytest.mark.parametrize("window, backward", [(5 * SCALED_WINDOW_BLOCK, (8, 16, 32, 0)),
                                              (11 * SCALED_WINDOW_BLOCK + 1, (32, 8, 500, 16))])
def test_the_kernels_truncated_backward_equals_the_oracle(window, backward, impl):
    """ATTN, fp32: flash_attn_varlen with per-head backward windows (both backwards; key blocks
    wholly outside a head's window are skipped, the rest masked), documents longer and shorter
    than the windows; the forward is the full window's."""
    T = 220
    q, k, v, grad_o = inputs(T, 4, 16, window + 1)
    cu = torch.tensor([0, 3, 150, 212, T, T], dtype=torch.int32)
    got = grads(functools.partial(kernels.flash_attn_varlen, impl=impl), q, k, v, grad_o, cu, window,
                torch.tensor([0.25]), SMALL_ATTENTION, backward_windows=torch.tensor(backward))
    check_truncated(got, grads(truncated_oracle, q, k, v, grad_o, cu, window, 0.25, backward), f"kernel {impl}")


@interpreted
def test_the_kernels_truncated_backward_at_the_production_tiles():
    """ATTN, fp32: the narrow windows' production tiles (64 x 32) with PR 371's own windows
    64/128/256 and a 640-token forward window (stage 2's short window of 5 blocks)."""
    T = 700
    q, k, v, grad_o = inputs(T, 3, 16, 5)
    cu = torch.tensor([0, 690, T], dtype=torch.int32)
    backward = (64, 128, 256)
    got = grads(functools.partial(kernels.flash_attn_varlen, impl="atomic"), q, k, v, grad_o, cu, 640,
                torch.tensor([0.25]), kernels.attention_configs(640), backward_windows=torch.tensor(backward))
    check_truncated(got, grads(truncated_oracle, q, k, v, grad_o, cu, 640, 0.25, backward), "production tiles")


# ---------------------------------------------------------------------------------------------
# the window chooser


def test_the_chooser_takes_the_smallest_window_within_the_bound():
    """Per head: the smallest candidate whose error (the largest over dQ, dK, dV, the
    observations and the ranks) is within the bound; none: the full window (0); candidates not
    below the forward window are not offered."""
    errors = torch.tensor([[0.5, 0.1, 0.3, 0.25],      # window 8
                           [0.2, 0.05, 0.21, 0.3],     # 16
                           [0.1, 0.0, 0.19, 0.21]])    # 32
    assert bw.pick_windows(errors, (8, 16, 32), 0.2).tolist() == [16, 8, 32, 0]
    assert bw.candidates_below((64, 128, 256), 129) == (64, 128)


def test_the_chooser_measures_relative_l2_per_head_against_the_exact_backward():
    """backward_window_errors: for each candidate and head, max over dQ, dK, dV of
    ||g_w - g|| / ||g|| over that head's rows, equal to the oracle's; a window beyond every
    document's reach has error 0."""
    T, window = 120, 64
    q, k, v, grad_o = inputs(T, 2, 8, 11)
    cu = torch.tensor([0, 50, T], dtype=torch.int32)
    candidates = (8, 16, 70)
    errors = bw.backward_window_errors(kernels.attention_reference, q, k, v, grad_o, cu, window, 0.3, candidates)
    exact = grads(truncated_oracle, q, k, v, grad_o, cu, window, 0.3, (0, 0))[1:]
    for c, w in enumerate(candidates):
        got = grads(truncated_oracle, q, k, v, grad_o, cu, window, 0.3, (w, w))[1:]
        want = torch.stack([((a - b).norm(dim=(0, 2)) / b.norm(dim=(0, 2))) for a, b in zip(got, exact)]).amax(0)
        torch.testing.assert_close(errors[c].double(), want.double(), rtol=1e-4, atol=1e-6)
    assert errors[2].max() <= 1e-6 and errors[0].min() > 0.01


def test_the_chooser_takes_calls_of_one_layer_with_different_windows():
    """Choice steps in two stages: a layer's calls at windows 24 and 40 offer candidates (8, 16)
    and (8, 16, 32). Each candidate's error is its largest over the calls that truncate with it
    (0 where it is as wide as the window: exact there); 32, measured at the wider call only, can
    be chosen; the choice equals picking from the calls' errors by hand."""
    T = 120
    cu = torch.tensor([0, 50, T], dtype=torch.int32)
    calls = [(*inputs(T, 2, 8, seed), cu, window, 0.3) for seed, window in ((12, 24), (13, 40))]
    choice = bw.WindowChoice((8, 16, 32), bound=0.5)
    for probe in calls:
        choice.observe(3, kernels.attention_reference, probe)
    by_hand = [bw.backward_window_errors(kernels.attention_reference, *probe[:6], 0.3, offered)
               for probe, offered in zip(calls, ((8, 16), (8, 16, 32)))]
    worst = torch.cat([torch.maximum(by_hand[0], by_hand[1][:2]), by_hand[1][2:]])
    assert torch.equal(choice.errors[3][0], worst) and choice.errors[3][1] == 3
    assert torch.equal(choice.choose()[3], bw.pick_windows(worst, (8, 16, 32), 0.5))


# ---------------------------------------------------------------------------------------------
# the sampled head weight gradient


def test_the_sampled_rows_are_one_per_group_and_the_same_for_a_seed():
    rows = kernels.head_sample_rows(4096, 4, 7)
    assert rows.shape == (1024,) and torch.equal(rows // 4, torch.arange(1024))
    assert torch.equal(rows, kernels.head_sample_rows(4096, 4, torch.tensor(7)))
    assert not torch.equal(rows, kernels.head_sample_rows(4096, 4, 8))
    counts = torch.bincount(rows % 4, minlength=4)
    assert counts.min() > 200, f"offsets spread over the group: {counts.tolist()}"
    assert torch.equal(kernels.head_sample_rows(64, 1, 3), torch.arange(64))
    with pytest.raises(ValueError, match="groups of 4"):
        kernels.head_sample_rows(30, 4, 0)


def test_sampled_linear_at_stride_one_is_the_exact_linear():
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(32, 12, generator=g), torch.randn(20, 12, generator=g), torch.randn(32, 20, generator=g)
    want = grads_linear(F.linear, x, w, dy)
    got = grads_linear(lambda a, b: kernels.sampled_linear(a, b, kernels.head_sample_rows(32, 1, 5), 1), x, w, dy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_sampled_linear_under_autocast_gives_each_gradient_in_its_inputs_dtype():
    """Under bf16 autocast (the trainer's compute dtype on a CPU with bf16 units) the forward runs in
    bf16 while the head's weight stays fp32: the backward's GEMMs run in the output gradient's dtype
    and return dx in x's dtype and dW in the weight's, as F.linear's autograd does."""
    g = torch.Generator().manual_seed(3)
    x, w, dy = torch.randn(32, 12, generator=g), torch.randn(20, 12, generator=g), torch.randn(32, 20, generator=g)
    def autocast(fn):              # the forward under autocast, the backward outside it, as the trainer runs them
        def run(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*args)
        return run

    want = grads_linear(autocast(F.linear), x, w, dy.bfloat16())
    got = grads_linear(autocast(lambda a, b: kernels.sampled_linear(a, b, kernels.head_sample_rows(32, 1, 5), 1)), x, w,
                       dy.bfloat16())
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def grads_linear(fn, x, w, dy):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w)]
    y = fn(*leaves)
    return [y.detach(), *torch.autograd.grad(y, leaves, dy)]


def test_sampled_linear_at_stride_four_is_four_times_the_sampled_rows_and_unbiased():
    """dW = 4 x the float64 sum over the sampled rows; dx exact; and over the four choices of
    offset in every group (each equally likely) the mean of dW is the exact gradient."""
    g = torch.Generator().manual_seed(2)
    x, w, dy = (torch.randn(*s, generator=g).double() for s in ((64, 12), (20, 12), (64, 20)))
    rows = kernels.head_sample_rows(64, 4, 9)
    _, dx, dw = grads_linear(lambda a, b: kernels.sampled_linear(a, b, rows, 4), x, w, dy)
    torch.testing.assert_close(dw, 4 * dy[rows].t() @ x[rows], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, dy @ w, rtol=1e-12, atol=1e-12)
    mean = sum(grads_linear(lambda a, b: kernels.sampled_linear(a, b, torch.arange(o, 64, 4), 4), x, w, dy)[2]
               for o in range(4)) / 4
    torch.testing.assert_close(mean, dy.t() @ x, rtol=1e-12, atol=1e-12)


@interpreted
def test_the_fp8_heads_sampled_weight_gradient_is_four_times_the_sampled_rows():
    """fp8_head_cross_entropy (Triton, interpreted) with the sample: the input gradient equals
    the unsampled call's bitwise, and the weight gradient equals 4 x the weight gradient of the
    same call on the sampled rows alone (the cross-entropy's gradient is row by row, the head's
    scales static), at the same upstream gradient. fp8_linear with the sample: its torch
    reference's gradients, and 4 x the float64 product of the sampled rows within fp8 rounding."""
    g = torch.Generator().manual_seed(3)
    N, D, C = 32, 32, 96
    x = (torch.randint(-8, 9, (N, D), generator=g).float() / 4).bfloat16()
    weight = torch.randint(-8, 9, (C, D), generator=g).float() / 16
    targets = torch.randint(0, C, (N, 2), generator=g)
    weights = torch.tensor([1.0, 0.5])
    rows = kernels.head_sample_rows(N, 4, 11)

    def head_grads(xs, tg, sample):
        state = kernels.new_fp8_linear_state()
        kernels.set_fp8_loss_unit(state, 1 / 32)
        leaves = [xs.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        loss, _ = kernels.fp8_head_cross_entropy(*leaves, state, tg, weights, 1 / 32, SMALL_MATMUL, SMALL_CE,
                                                 sample=sample)
        loss.sum().backward()
        return [t.grad for t in leaves]

    exact_dx, _ = head_grads(x, targets, None)
    dx, dw = head_grads(x, targets, (rows, 4))
    _, dw_rows = head_grads(x[rows], targets[rows], None)
    assert torch.equal(dx, exact_dx)
    torch.testing.assert_close(dw, 4 * dw_rows, rtol=1e-6, atol=1e-6)

    dy = torch.randint(-8, 9, (N, C), generator=g).float().bfloat16() / 4

    def linear_grads(layer, xs, sample):
        state = kernels.new_fp8_linear_state()
        leaves = [xs.clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        layer(leaves[0], leaves[1], state, SMALL_MATMUL, sample=sample).backward(dy)
        return [t.grad for t in leaves]

    exact_dx, exact_dw = linear_grads(kernels.fp8_linear, x, None)
    dx, dw = linear_grads(kernels.fp8_linear, x, (rows, 4))
    ref_dx, ref_dw = linear_grads(kernels.fp8_linear_reference, x, (rows, 4))
    assert torch.equal(dx, exact_dx) and torch.equal(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw, rtol=1e-6, atol=1e-6)
    want = 4 * dy.double()[rows].t() @ x.double()[rows]      # within the operands' fp8 rounding
    assert (dw.double() - want).abs().max() <= 0.1 * want.abs().max()
    assert (dw.double() - 4 * dy.double()[rows].t() @ x.double()[rows]).abs().max() < \
        (dw.double() - dy.double().t() @ x.double()).abs().max(), "the sample, not the whole batch"


# ---------------------------------------------------------------------------------------------
# the schedule


PR371 = ["--head_grad_stride=4", "--head_grad_start=320", "--attn_bwd_windows=[64,128,256]",
         "--attn_bwd_choice_steps=[592,593]", "--attn_bwd_start=594", "--approx_exact_last_steps=87"]


@interpreted
def test_the_fp8_pointer_heads_sampled_weight_gradient_is_four_times_the_sampled_rows():
    """PR 371's sampled head gradient composed with PR 379's pointer mixture: the FP8 head with the
    mixture's next-token term (Triton, interpreted) and the sample keeps the unsampled input
    gradient bitwise, and its weight gradient is 4 x the same call's on the sampled rows alone,
    their p_copy and a_sink with them (the mixture's gradient is row by row too)."""
    g = torch.Generator().manual_seed(4)
    N, D, C, copy_col = 32, 32, 96, 80
    x = (torch.randint(-8, 9, (N, D), generator=g).float() / 4).bfloat16()
    weight = torch.randint(-8, 9, (C, D), generator=g).float() / 16
    targets = torch.randint(0, copy_col, (N, 2), generator=g)
    weights = torch.tensor([1.0, 0.5])
    a_sink = torch.rand(N, generator=g)
    p_copy = torch.rand(N, generator=g) * (1 - a_sink)
    rows = kernels.head_sample_rows(N, 4, 11)

    def head_grads(keep, sample):
        state = kernels.new_fp8_linear_state()
        kernels.set_fp8_loss_unit(state, 1 / 32)
        leaves = [x[keep].clone().requires_grad_(True), weight.clone().requires_grad_(True)]
        loss, _ = kernels.fp8_head_pointer_mixture(*leaves, state, targets[keep], weights, torch.tensor(copy_col),
                                                   p_copy[keep], a_sink[keep], 1 / 32, SMALL_MATMUL, SMALL_CE,
                                                   sample=sample)
        loss.sum().backward()
        return [t.grad for t in leaves]

    every = torch.arange(N)
    exact_dx, _ = head_grads(every, None)
    dx, dw = head_grads(every, (rows, 4))
    _, dw_rows = head_grads(rows, None)
    assert torch.equal(dx, exact_dx)
    torch.testing.assert_close(dw, 4 * dw_rows, rtol=1e-6, atol=1e-6)


def test_the_approximations_follow_pr_371s_steps():
    """speedrun with PR 371's keys: the sampled head gradient on 320-1106, the truncated backward
    on 594-1106, the last 87 steps exact; each change starts a graph of its own. Without the keys
    (the preset) the graph keys and changes are the preset's own."""
    import train_gpt as tg
    h = tg.parse_config(["--preset", "speedrun", *PR371])
    at = {s: tg.approximate_backward_at(h, s) for s in (0, 319, 320, 593, 594, 1106, 1107, 1193)}
    assert at == {0: (1, False), 319: (1, False), 320: (4, False), 593: (4, False), 594: (4, True),
                  1106: (4, True), 1107: (1, False), 1193: (1, False)}
    assert {320, 594, 1107} <= set(tg.graph_changes(h))
    assert tg.graph_key(h, 594) != tg.graph_key(h, 593) and tg.graph_key(h, 1107) == (4, True)
    plain = tg.parse_config(["--preset", "speedrun"])
    assert all(len(tg.graph_key(plain, s)) == 2 for s in range(plain.num_iterations))
    assert 594 not in tg.graph_changes(plain)
    with pytest.raises(ConfigError, match="attn_bwd_start"):
        tg.parse_config(["--preset", "speedrun", *PR371, "--attn_bwd_start=593"])
    with pytest.raises(ConfigError, match="head_grad_stride"):
        tg.parse_config(["--preset", "speedrun", "--head_grad_stride=3"])
