"""Tests of kernels.py: the Triton kernels run under the Triton interpreter on CPU and are
compared with the plain-torch references and with independent oracles (torch._scaled_mm,
float64 attention with an explicit mask, float64 cross-entropy and Gram matrices).

The interpreted kernels run in a worker process (tests/helpers/interpreter_shim.py: Triton's mode is
fixed per process) with the shim that routes bf16/fp8 conversions through torch and upcasts
bf16 dot operands; the kernels themselves compute in fp32 after loading, as on the GPU.

Tolerances (each test says which applies):
  EXACT   fp8 tests use operands on a coarse grid (multiples of 1/4, power-of-two scales) so
          every product and partial sum is exact in fp32 in any order: results must be bitwise
          equal to the float64 oracle, which asserts that precondition (exact_sums).
  FP32    fp32 sums of n terms in a different order than the oracle's differ by at most
          n * 2^-24 * sum|terms| (the standard recursive-summation bound); the tests compute
          that bound from the data, plus one rounding per extra fp32 operation.
  BF16    a bf16 result carries one rounding, 2^-8 relative, on top of the fp32 bound.
  ATTN    fp32 attention vs float64: a score q.k of D terms is off by up to D * 2^-24 *
          sum|q_d k_d| * scale, and exp turns that into the same relative error of P, O and the
          gradients: with unit-normal inputs and D <= 128 that is below 1e-4 of the output
          scale, the tolerance used. bf16 attention (P rounded to bf16 before P V, bf16
          outputs): the FlashAttention test criterion, max error at most twice that of torch's
          own op-by-op bf16 attention on the same inputs, plus 1e-5.
  CE      cross-entropy bounds derived in ce_tolerances.
"""
import dataclasses
import functools
import itertools
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from interpreter_shim import REPO_ROOT, LaunchedKernels, isolated

sys.path.insert(0, str(REPO_ROOT))
import kernels  # noqa: E402  (interpreted inside the worker)

interpreted = isolated(interpret=True)
on_gpu = isolated(interpret=False)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U32 = 2.0 ** -24    # unit roundoff of fp32
U_BF16 = 2.0 ** -8  # unit roundoff of bf16 (8 significand bits)

# Interpreter-sized blocks: several blocks per dimension on tiny shapes, M != N != K.
SMALL_MATMUL = kernels.LaunchConfig(block_m=16, block_n=32, block_k=32, group_m=2)
SMALL_CAST = kernels.LaunchConfig(block_m=16, block_n=32)
SMALL_ATTENTION = (kernels.LaunchConfig(block_m=16, block_n=16), kernels.LaunchConfig(block_m=16, block_n=32),
                   kernels.LaunchConfig(block_m=32, block_n=16), kernels.LaunchConfig(block_m=32, block_n=1),
                   kernels.LaunchConfig(block_m=16, block_n=32))
# The backward implementations the attention tests run: the one kernel with atomic dQ, the two.
ATTENTION_BACKWARDS = ("atomic", "deterministic")
SMALL_CE = kernels.LaunchConfig(block_m=1, block_n=64)
SMALL_XXT = kernels.LaunchConfig(block_m=16, block_n=16, block_k=32)


def grid_values(*shape, generator, limit=8, dtype=torch.float32):
    """Multiples of 1/4 in [-limit/4, limit/4]: exact in e4m3, e5m2 and bf16."""
    return (torch.randint(-limit, limit + 1, shape, generator=generator).float() / 4).to(dtype)


def assert_within(got, want, bound, what):
    """|got - want| <= bound elementwise; the message shows the worst element."""
    got, want, bound = torch.broadcast_tensors(got.detach().cpu().double(), want.detach().cpu().double(),
                                               torch.as_tensor(bound).cpu().double())
    excess = (got - want).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (f"{what}: |{got.flatten()[worst]} - {want.flatten()[worst]}| > "
                               f"{bound.flatten()[worst]} at flat index {worst}")


def fp32_sum_bound(a, b, terms):
    """Largest fp32 error of a @ b summed in any order: terms * 2^-24 * (|a| @ |b|)."""
    return terms * U32 * (a.double().abs() @ b.double().abs())


# ---------------------------------------------------------------------------------------------
# FP8 matmul
# ---------------------------------------------------------------------------------------------

def _granularity(t):
    """The largest power of two dividing every entry of t (1 for an all-zero tensor)."""
    values = [v for v in t.double().abs().unique().tolist() if v > 0]
    return min(((n & -n) / d for n, d in (v.as_integer_ratio() for v in values)), default=1.0)


def exact_sums(a, b, bits=24):
    """True when every partial sum of a @ b, in any order, is exact in a float with `bits`
    significand bits: all products are multiples of g and sum_k |a_ik b_kj| < 2^bits g."""
    g = _granularity(a) * _granularity(b)
    return bool(((a.double().abs() @ b.double().abs()) < 2.0 ** bits * g).all())


def matmul_oracle(a, b, scale_a, scale_b, out_dtype, bits=24):
    """EXACT oracle of a scaled fp8 matmul: the float64 sum (checked to be exact with `bits`
    significand bits, 24 for fp32; None: not checked), rounded to fp32, times scale_a * scale_b
    in fp32, rounded to out_dtype."""
    assert bits is None or exact_sums(a, b, bits), "test data violates the EXACT precondition"
    return ((a.double() @ b.double()).float() * (scale_a * scale_b)).to(out_dtype)


def _fp8_operands(m, k, n, a_dtype, b_dtype, b_column_major, generator, limit=8):
    a = grid_values(m, k, generator=generator, limit=limit).to(a_dtype)
    b = grid_values(k, n, generator=generator, limit=limit)
    b = (b.t().contiguous().t() if b_column_major else b).to(b_dtype)
    return a, b


@interpreted
@pytest.mark.parametrize("a_dtype,b_dtype,b_column_major,out_dtype,k", [
    (E4M3, E4M3, True, torch.bfloat16, 72),
    (E4M3, E5M2, False, torch.float32, 64),
    (E5M2, E4M3, True, torch.float32, 45),
    (E4M3, E4M3, False, torch.float16, 96),
])
def test_fp8_matmul_matches_scaled_mm_exactly(a_dtype, b_dtype, b_column_major, out_dtype, k):
    """EXACT: grid operands, power-of-two scales; both layouts of b; K both a multiple of
    BLOCK_K and not; M, N not multiples of the tile; both accumulation modes."""
    generator = torch.Generator().manual_seed(k)
    a, b = _fp8_operands(37, k, 45, a_dtype, b_dtype, b_column_major, generator)
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(4.0)
    for fast_accumulation in (True, False):   # (the interpreter sums in fp32 either way)
        out = kernels.fp8_matmul(a, b, scale_a, scale_b, out_dtype, config=SMALL_MATMUL,
                                 fast_accumulation=fast_accumulation)
        assert out.dtype == out_dtype and out.shape == (37, 45)
        assert torch.equal(out, matmul_oracle(a, b, scale_a, scale_b, out_dtype))
        assert torch.equal(out, torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype))
        assert torch.equal(out, kernels.fp8_matmul_reference(a, b, scale_a, scale_b, out_dtype))


@interpreted
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_matmul_random_operands_within_rounding_bound(out_dtype):
    """FP32 (+ BF16 for bf16 output): unit-normal fp8 operands and arbitrary scales against
    float64; also the production tile (a single partial tile here)."""
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(50, 80, generator=generator).to(E4M3)
    b = torch.randn(61, 80, generator=generator).to(E4M3).t()
    scale_a, scale_b = torch.tensor(0.37), torch.tensor(1.9)
    exact = (a.double() @ b.double()) * (0.37 * 1.9)
    bound = fp32_sum_bound(a, b, terms=80 + 2) * 0.37 * 1.9
    if out_dtype == torch.bfloat16:
        bound = bound * (1 + U_BF16) + U_BF16 * exact.abs()
    for config in (SMALL_MATMUL, None):
        out = kernels.fp8_matmul(a, b, scale_a, scale_b, out_dtype, config=config)
        assert_within(out, exact, bound, f"fp8_matmul with {config}")


def test_fp8_matmul_rejects_bad_operands():
    a, b, one = torch.zeros(4, 16, dtype=E5M2), torch.zeros(16, 8, dtype=E5M2), torch.ones(1)
    with pytest.raises(ValueError, match="both be float8_e5m2"):
        kernels.fp8_matmul(a, b, one, one)
    with pytest.raises(ValueError, match=r"a \(M, K\) and b \(K, N\)"):
        kernels.fp8_matmul(a.to(E4M3), b[:8], one, one)
    with pytest.raises(ValueError, match="per-tensor scales"):
        kernels.fp8_matmul(a.to(E4M3), b, torch.ones(2), one)


def quantize(x, scale, fp8_dtype):
    """x times the fp32 reciprocal of scale, saturated to the fp8 range and rounded to nearest
    even (torch's cast)."""
    fp8_max = torch.finfo(fp8_dtype).max
    return (x.float() * (1.0 / scale)).clamp(-fp8_max, fp8_max).to(fp8_dtype)


@interpreted
@pytest.mark.parametrize("cast", ["kernel", "fused"])
@pytest.mark.parametrize("x_dtype,fp8_dtype", [(torch.float32, E4M3), (torch.bfloat16, E5M2)])
def test_fp8_cast_saturates_transposes_and_records_amax(x_dtype, fp8_dtype, cast):
    """Bitwise against torch's casts, the cast kernel and the fused cast (torch ops, then the
    transpose kernel): values beyond the fp8 range saturate, the transposed copy is q.T, and
    amax becomes max(amax, max |x|). (Under the interpreter the in-kernel fp8 rounding itself
    is torch's, through the shim; on the GPU it is the hardware's.)"""
    _check_fp8_cast((37, 45), x_dtype, fp8_dtype, "cpu", SMALL_CAST, kernels.FP8_CASTS[cast])


def _check_fp8_cast(shape, x_dtype, fp8_dtype, device, config, cast=kernels.fp8_cast):
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=generator) * 3).to(x_dtype)
    x[3, 4], x[30, 40] = 1e6, -1e6
    scale = torch.tensor([0.0123])
    for start in (0.0, 2e6):
        amax = torch.tensor([start], device=device)
        q, qt = cast(x.to(device), scale.to(device), amax, fp8_dtype, config=config)
        expected = quantize(x, scale, fp8_dtype)
        assert torch.equal(q.cpu().view(torch.uint8), expected.view(torch.uint8))
        assert torch.equal(qt.cpu().view(torch.uint8), expected.t().contiguous().view(torch.uint8))
        assert amax.item() == max(start, x.float().abs().max().item())


def _bits_equal(got, want):
    return got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@interpreted
@pytest.mark.parametrize("rule", [kernels.EXACT, kernels.WEIGHT_LAG, kernels.Delayed(1.12), kernels.Static(0.004)],
                         ids=["exact", "lagged", "delayed", "static"])
def test_fp8_cast_weights_equals_each_layers_own_cast(rule):
    """The weight groups' casts (amax pass, scale kernel, cast, over tables of addresses) against
    each layer's _operand_scale and reference cast: the same fp8 bytes in both layouts, the same
    scales, the same states afterwards (amax slot: this cast's max |w|). Layers of two shapes and
    two dtypes (three groups); the lagged rule's exact calls and its delayed ones in one batch;
    a layer with no recorded amax (the uncalibrated scale); the tail of the amax pass's blocks; a
    group with a weight off the 16-byte alignment (the kernels' unaligned loads)."""
    generator = torch.Generator().manual_seed(12)
    slots = kernels.FP8_MLP_SLOTS
    weights = [(torch.randn(40, 24, generator=generator) * (i + 1)).bfloat16() for i in range(3)]
    unaligned = (torch.randn(24 * 40 + 1, generator=generator) * 0.01)[1:].view(24, 40)
    weights += [torch.randn(24, 40, generator=generator), unaligned]
    assert unaligned.data_ptr() % 16 != 0
    weights[1][5, 7] = 300.0                     # saturates under a lagged scale
    states = [kernels.new_fp8_mlp_state() for _ in weights]
    for i, state in enumerate(states):
        if i != 2:
            state[slots["up_weight"]] = 0.5 + i
        state[slots["calls"]] = [3.0, 20.0, 16.0, 15.0, 40.0][i]
    want_states = [state.clone() for state in states]
    got = kernels.fp8_cast_weights(weights, states, slots, "up_weight", rule, SMALL_CAST)
    want = kernels.fp8_cast_weights_reference(weights, want_states, slots, "up_weight", rule)
    for i, ((q, qt, scale), (q_ref, qt_ref, scale_ref)) in enumerate(zip(got, want)):
        assert _bits_equal(q, q_ref) and _bits_equal(qt, qt_ref), f"layer {i}"
        assert torch.equal(scale, scale_ref) and scale.shape == (1,), f"layer {i}: {scale} != {scale_ref}"
        assert torch.equal(states[i], want_states[i]), f"layer {i}'s state"
        assert states[i][slots["up_weight"]] == weights[i].float().abs().max()


def test_fp8_cast_weights_loads_a_group_as_aligned_only_when_every_weight_is(monkeypatch):
    """ALIGNED (16-byte loads of the weights) where every weight of a group starts at a multiple
    of 16 bytes, and not where one is a view off it (the launches recorded, not run)."""
    launched = []
    monkeypatch.setattr(kernels, "_launch", lambda kernel, grid, config, **args: launched.append(args.get("ALIGNED")))
    aligned = [torch.randn(8, 16) for _ in range(2)]
    off = torch.randn(8 * 16 + 1)[1:].view(8, 16)
    for weights, want in ((aligned, True), ([aligned[0], off], False)):
        launched.clear()
        kernels.fp8_cast_weights(weights, [kernels.new_fp8_mlp_state() for _ in weights], kernels.FP8_MLP_SLOTS,
                                 "up_weight", kernels.EXACT)
        assert [a for a in launched if a is not None] == [want, want]     # the amax pass and the cast


def test_fp8_cast_weights_rejects_mismatched_groups():
    state = kernels.new_fp8_mlp_state()
    with pytest.raises(ValueError, match="one state per weight"):
        kernels.fp8_cast_weights([torch.randn(4, 4)], [], kernels.FP8_MLP_SLOTS, "up_weight", kernels.EXACT)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.fp8_cast_weights([torch.randn(4, 6).t()], [state], kernels.FP8_MLP_SLOTS, "up_weight", kernels.EXACT)


def _check_large_tile(m, k, n, device):
    """EXACT: the production forward tile FP8_MATMUL_LARGE (128 x 256 x 128, 3 stages), plain and
    with the relu2 epilogue, against the oracle (a K sum within FAST_ACCUMULATOR_BITS: grid
    values of at most 1/2) and the reference, bitwise."""
    generator = torch.Generator().manual_seed(5)
    a, b = _fp8_operands(m, k, n, E4M3, E4M3, True, generator, limit=2)
    one, half, two = (torch.full((1,), value) for value in (1.0, 0.5, 2.0))
    expected = matmul_oracle(a, b, one, half, torch.bfloat16, FAST_ACCUMULATOR_BITS)
    large = kernels.FP8_MATMUL_LARGE
    got = kernels.fp8_matmul(a.to(device), b.to(device), one.to(device), half.to(device), torch.bfloat16, large)
    assert torch.equal(got.cpu(), expected), "plain GEMM"
    amax = torch.zeros(1, device=device)
    q, qt = kernels.fp8_matmul_relu2(a.to(device), b.to(device), one.to(device), half.to(device), two.to(device),
                                     amax, large)
    want_amax = torch.zeros(1)
    want_q, want_qt = kernels.fp8_matmul_relu2_reference(a, b, one, half, two, want_amax)
    assert _bits_equal(q.cpu(), want_q) and _bits_equal(qt.cpu(), want_qt), "relu2 epilogue"
    assert amax.item() == want_amax.item()


@interpreted
def test_fp8_large_tile_matches_oracle_exactly():
    """_check_large_tile on 2 x 2 of the large tiles, two K blocks (the GPU test runs it at a
    training shape)."""
    _check_large_tile(256, 256, 512, "cpu")


@interpreted
def test_fp8_matmul_relu2_epilogues_match_oracle_exactly():
    """EXACT: relu(h)^2 and its gradient epilogue against the oracle and the references; the
    activation is read through a transposed view."""
    generator = torch.Generator().manual_seed(3)
    x8, w8 = _fp8_operands(40, 48, 70, E4M3, E4M3, True, generator)
    one, half, two, quarter = (torch.full((1,), value) for value in (1.0, 0.5, 2.0, 0.25))
    h = matmul_oracle(x8, w8, one, half, torch.float32)
    a = torch.relu(h) * torch.relu(h)
    for matmul_relu2 in (kernels.fp8_matmul_relu2, kernels.fp8_matmul_relu2_reference):
        amax = torch.zeros(1)
        a8, a8_t = matmul_relu2(x8, w8, one, half, two, amax, config=SMALL_MATMUL)
        assert _bits_equal(a8, quantize(a, two, E4M3)) and _bits_equal(a8_t, a8.t().contiguous())
        assert amax.item() == a.max().item()

    g8, w_down8 = _fp8_operands(40, 32, 70, E5M2, E4M3, True, generator)
    grad_h = 2.0 * torch.sqrt(a8.float() * two) * matmul_oracle(g8, w_down8, one, half, torch.float32)
    for matmul_relu2_grad in (kernels.fp8_matmul_relu2_grad, kernels.fp8_matmul_relu2_grad_reference):
        amax = torch.zeros(1)
        gh8, gh8_t = matmul_relu2_grad(g8, w_down8, one, half, a8_t.t(), two, quarter, amax, config=SMALL_MATMUL)
        assert _bits_equal(gh8, quantize(grad_h, quarter, E5M2)) and _bits_equal(gh8_t, gh8.t().contiguous())
        assert amax.item() == grad_h.abs().max().item()


# The persistent descriptor kernels' tiles in the interpreter: 16 x 32 tiles, K steps of 32.
SMALL_TMA = kernels.LaunchConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)


class SmCount:
    """Within: kernels see `count` SMs (the split-K plan's waves at interpreter sizes)."""

    def __init__(self, count):
        self.count = count

    def __enter__(self):
        self._original, kernels.H100_SM_COUNT = kernels.H100_SM_COUNT, self.count

    def __exit__(self, *exc):
        kernels.H100_SM_COUNT = self._original


@interpreted
@pytest.mark.parametrize("split_k,sms", [(1, 132), (3, 132), (4, 4)])
@pytest.mark.parametrize("a_dtype,b_dtype,out_dtype,fast", [(E4M3, E4M3, torch.bfloat16, True),
                                                             (E5M2, E4M3, torch.float32, False),
                                                             (E4M3, E5M2, torch.float16, False)])
def test_fp8_tma_matmul_matches_scaled_mm_exactly(split_k, sms, a_dtype, b_dtype, out_dtype, fast):
    """EXACT: the persistent descriptor GEMM against the oracle and torch._scaled_mm, bitwise: M
    not a multiple of the tile (rows past it read as zeros, stores clipped), K = 80 not a multiple
    of BLOCK_K (the last K step's tail read as zeros), 6 output tiles; whole tiles (split 1), every
    tile split into 3 K ranges (6 tiles on 132 SMs: one partial wave), and with 4 SMs one whole
    wave of 4 tiles then 2 tiles in 4 K ranges each (the ranges of 3 K steps: some empty)."""
    generator = torch.Generator().manual_seed(split_k * sms)
    a, b = _fp8_operands(37, 80, 48, a_dtype, b_dtype, True, generator)
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(4.0)
    config = dataclasses.replace(SMALL_TMA, split_k=split_k)
    with SmCount(sms), LaunchedKernels() as launched:
        out = kernels.fp8_matmul(a, b, scale_a, scale_b, out_dtype, config=config, fast_accumulation=fast,
                                 impl="tma")
    expected = ["_fp8_matmul_tma_kernel"] + (["_split_k_reduce_kernel"] if split_k > 1 else [])
    assert launched.names == expected
    assert torch.equal(out, matmul_oracle(a, b, scale_a, scale_b, out_dtype))
    assert torch.equal(out, torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype))


def test_promoted_gemms_take_the_promotion_interval_as_their_k_step():
    """A promoted GEMM (an fp32 sum every BLOCK_K products) runs on K steps of PROMOTION_K, on the
    pointer kernel and the persistent one, whole or split (two stages then: its shared memory);
    an fp32 output and fast accumulation keep their 128-product tiles, and the warm-up is also
    offered the persistent kernel promoting every 128 products."""
    cuda = torch.device("cuda")
    assert kernels.PROMOTION_K == 256 and kernels.fp8_matmul_config(49152, 768, cuda, False).block_k == 256
    whole = kernels.fp8_tma_config(2 * 132 * 128, 128, 2816, cuda, False)
    assert (whole.block_k, whole.split_k, whole.num_stages) == (256, 1, 3)
    split = kernels.fp8_tma_config(768, 1536, 49152, cuda, False)          # 72 tiles: one partial wave
    assert (split.block_k, split.num_stages) == (256, kernels.FP8_TMA_PROMOTED_SPLIT_STAGES) and split.split_k > 1
    assert kernels.fp8_tma_config(2 * 132 * 128, 128, 2816, cuda, False, out_dtype=torch.float32).block_k == 128
    for config in (kernels.fp8_tma_config(49152, 2816, 768, cuda), kernels.fp8_matmul_config(49152, 2816, cuda)):
        assert config.block_k == 128
    a = torch.empty(768, 49152, dtype=E5M2)
    b = torch.empty(1536, 49152, dtype=E4M3).t()
    one = torch.ones(1)
    names = [c.name for c in kernels._fp8_matmul_candidates(a, b, one, one, torch.bfloat16, False)]
    assert names[0].startswith("tma 128x128x256 split") and "tma 128x128x128 split 1" in names
    assert "pointer 128x128x256" in names


@interpreted
@pytest.mark.parametrize("impl,config", [
    ("pointer", kernels.FP8_MATMUL_PROMOTED), ("tma", kernels.FP8_TMA_PROMOTED),
    ("tma", dataclasses.replace(kernels.FP8_TMA_PROMOTED, split_k=2, num_stages=kernels.FP8_TMA_PROMOTED_SPLIT_STAGES))])
def test_fp8_promoted_tile_matches_oracle_exactly(impl, config):
    """EXACT: the production promoted tile (128 x 128, K steps of 256) on a backward GEMM's
    operands: K = 640, two and a half K steps (the last one's tail masked or read as zeros), M and
    N past a tile; split, the K steps cut into two ranges on one SM."""
    generator = torch.Generator().manual_seed(11)
    a, b = _fp8_operands(136, 640, 130, E5M2, E4M3, True, generator, limit=2)
    one, half = torch.full((1,), 1.0), torch.full((1,), 0.5)
    with SmCount(1):
        got = kernels.fp8_matmul(a, b, one, half, torch.bfloat16, config=config, fast_accumulation=False, impl=impl)
    assert torch.equal(got, matmul_oracle(a, b, one, half, torch.bfloat16))


def test_split_k_plan_splits_only_the_last_wave_where_it_pays():
    """Whole waves stay whole; a last wave of few tiles with a long K is cut (12 tiles over 132
    SMs after a whole wave, 384 K steps: 11 ranges), a nearly full one or a short K is not."""
    tile = 128 * 128
    assert kernels.split_k_plan(264, 384, 132, tile) == (264, 0, 1)
    assert kernels.split_k_plan(144, 384, 132, tile) == (132, 12, 11)
    assert kernels.split_k_plan(130, 384, 132, tile) == (130, 0, 1)
    assert kernels.split_k_plan(144, 6, 132, tile) == (144, 0, 1)
    full, rest, split = kernels.split_k_plan(30, 384, 132, tile)
    assert (full, rest) == (0, 30) and split == 4


@interpreted
@pytest.mark.parametrize("config", [SMALL_TMA, dataclasses.replace(SMALL_TMA, block_n=16)])
def test_fp8_tma_relu2_epilogues_match_oracle_exactly(config):
    """EXACT: the persistent descriptor kernel's relu(h)^2 and gradient epilogues against the
    oracle and the references, bitwise: q stored by descriptor, qt by a descriptor of the
    transposed tile, the activation read by descriptor from the transposed copy; 48 x 64 outputs
    of 16 x 32 (and 16 x 16) tiles over 2 SMs."""
    generator = torch.Generator().manual_seed(30)
    x8, w8 = _fp8_operands(48, 48, 64, E4M3, E4M3, True, generator)
    one, half, two, quarter = (torch.full((1,), value) for value in (1.0, 0.5, 2.0, 0.25))
    h = matmul_oracle(x8, w8, one, half, torch.float32)
    a = torch.relu(h) * torch.relu(h)
    amax = torch.zeros(1)
    with SmCount(2), LaunchedKernels() as launched:
        a8, a8_t = kernels.fp8_matmul_relu2(x8, w8, one, half, two, amax, config=config, impl="tma")
    assert launched.names == ["_fp8_matmul_quant_tma_kernel"]
    assert _bits_equal(a8, quantize(a, two, E4M3)) and _bits_equal(a8_t, a8.t().contiguous())
    assert amax.item() == a.max().item()

    g8, w_down8 = _fp8_operands(48, 32, 64, E5M2, E4M3, True, generator)
    grad_h = 2.0 * torch.sqrt(a8.float() * two) * matmul_oracle(g8, w_down8, one, half, torch.float32)
    amax = torch.zeros(1)
    with SmCount(2), LaunchedKernels() as launched:
        gh8, gh8_t = kernels.fp8_matmul_relu2_grad(g8, w_down8, one, half, a8_t.t(), two, quarter, amax,
                                                   config=config, impl="tma")
    assert launched.names == ["_fp8_matmul_quant_tma_kernel"]
    assert _bits_equal(gh8, quantize(grad_h, quarter, E5M2)) and _bits_equal(gh8_t, gh8.t().contiguous())
    assert amax.item() == grad_h.abs().max().item()


def test_fp8_tma_takes_only_describable_layouts():
    """The persistent kernel needs K-major operands with rows of a multiple of 16 bytes; other
    calls run the pointer kernel (the rule) and the candidates say so."""
    a, b = torch.zeros(32, 48, dtype=E4M3), torch.zeros(64, 48, dtype=E4M3).t()
    assert kernels._tma_plain_ok(a, b, torch.bfloat16)
    assert not kernels._tma_plain_ok(a, b.contiguous(), torch.bfloat16)             # b row-major
    assert not kernels._tma_plain_ok(torch.zeros(32, 40, dtype=E4M3), torch.zeros(64, 40, dtype=E4M3).t(),
                                     torch.bfloat16)                                 # rows of 40 bytes
    assert not kernels._tma_plain_ok(a, torch.zeros(36, 48, dtype=E4M3).t(), torch.bfloat16)  # 72-byte output rows
    names = [c.name for c in kernels._fp8_matmul_candidates(a, b.contiguous(), torch.ones(1), torch.ones(1),
                                                            torch.bfloat16, True)]
    assert names[0].startswith("pointer") and not any(name.startswith("tma") for name in names)


def test_backward_gemms_use_fast_accumulation_only_for_short_sums():
    """The MLP's hidden gradient (K = the model width) sums in the fast accumulator; the QKV
    input gradient (2,304), the MLP's (2,816), the head's and every weight gradient promote."""
    assert kernels.fp8_fast_accumulation(768) and kernels.fp8_fast_accumulation(1024)
    assert not any(kernels.fp8_fast_accumulation(k) for k in (2304, 2816, 10240, 16384, 49152))


def delayed_scale(amax, fp8_max, headroom):
    """The documented delayed scale: amax * headroom / fp8_max; for an unset amax 1 (e4m3) or
    2^-14 (e5m2)."""
    unset = 1.0 if fp8_max == 448.0 else 2.0 ** -14
    return torch.where(amax > 0, amax * (headroom / fp8_max), torch.full_like(amax, unset))


def exact_scale(x, fp8_max=448.0):
    """The documented exact scale: max |x| / fp8_max (1 for an all-zero tensor)."""
    amax = x.abs().amax().float().reshape(1)
    return torch.where(amax > 0, amax * (1.0 / fp8_max), torch.ones_like(amax))


def rule_scale(rule, x, previous_amax, fp8_max, calls, loss_unit):
    """The scale an operand gets by its documented rule (x: None for epilogue outputs)."""
    if isinstance(rule, kernels.Static):
        return torch.tensor([rule.scale]) * (loss_unit if fp8_max == 57344.0 else 1.0)
    if isinstance(rule, kernels.Delayed):
        return delayed_scale(previous_amax, fp8_max, rule.headroom)
    if isinstance(rule, kernels.ExactThenDelayed) and calls >= rule.calls:
        return delayed_scale(previous_amax, fp8_max, rule.headroom)
    return exact_scale(x, fp8_max)


STATE_STRIDE = 4   # a state buffer's entries sit 16 bytes apart (4 fp32), zeros between them


def state_buffer(entries):
    """A state buffer holding `entries` (amaxes, the call count, the loss unit) STATE_STRIDE apart."""
    state = torch.zeros(STATE_STRIDE * (len(entries) - 1) + 1)
    state[::STATE_STRIDE] = torch.stack([e.reshape(()) for e in entries])
    return state


class OracleScales:
    """The scales of one oracle call from a state buffer read before it (amaxes by operand name,
    then the call count and the loss unit, STATE_STRIDE apart) and the layer's rules."""

    def __init__(self, state, scales):
        names = [f.name for f in dataclasses.fields(scales)]
        entries = state[::STATE_STRIDE]
        self.previous = {name: entries[i:i + 1].clone() for i, name in enumerate(names)}
        self.calls, self.loss_unit = entries[len(names)].item(), entries[len(names) + 1].item()
        self.scales, self.seen = scales, {}

    def __call__(self, name, x, fp8_max):
        """The scale of operand `name`; x's amax is what the call records for it."""
        return rule_scale(getattr(self.scales, name), x, self.previous[name], fp8_max, self.calls, self.loss_unit)

    def record(self, name, x):
        self.seen[name] = x.float().abs().max()

    def state_after(self):
        """The state the call leaves: each operand's amax, one more call, the same loss unit."""
        amaxes = [self.seen.get(name, torch.tensor(0.0)) for name in self.previous]
        return state_buffer([*amaxes, torch.tensor(self.calls + 1.0), torch.tensor(self.loss_unit)])


def linear_oracle(x, weight, state, grad_y, bits=24, scales=kernels.FP8LinearScales()):
    """EXACT oracle of fp8_linear from the recipe in kernels.py's docstring: (y, grad_x, grad_w, new state)."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    s = OracleScales(state, scales)
    s_x, s_w, s_g = s("input", x2, 448.0), s("weight", weight, 448.0), s("grad_output", g2, 57344.0)
    for name, t in (("input", x2), ("weight", weight), ("grad_output", g2)):
        s.record(name, t)
    x8, w8, g8 = quantize(x2, s_x, E4M3), quantize(weight, s_w, E4M3), quantize(g2, s_g, E5M2)
    y = matmul_oracle(x8, w8.t(), s_x, s_w, x.dtype, bits)
    grad_x = matmul_oracle(g8, w8, s_g, s_w, x.dtype, bits)
    grad_w = matmul_oracle(g8.t(), x8, s_g, s_x, weight.dtype, bits)
    return [y.reshape(*x.shape[:-1], -1), grad_x.reshape(x.shape), grad_w], s.state_after()


def mlp_oracle(x, w_up, w_down, state, grad_y, bits=24, scales=kernels.FP8MLPScales()):
    """EXACT oracle of fp8_relu2_mlp: a = relu(h)^2 in e4m3, dL/dh = dL/da * 2 sqrt(a) in e5m2."""
    x2, g2 = x.reshape(-1, x.shape[-1]), grad_y.reshape(-1, grad_y.shape[-1])
    s = OracleScales(state, scales)
    s_x, s_up, s_down = s("input", x2, 448.0), s("up_weight", w_up, 448.0), s("down_weight", w_down, 448.0)
    s_a, s_g, s_h = s("hidden", None, 448.0), s("grad_output", g2, 57344.0), s("grad_hidden", None, 57344.0)
    x8, up8, down8, g8 = (quantize(x2, s_x, E4M3), quantize(w_up, s_up, E4M3), quantize(w_down, s_down, E4M3),
                          quantize(g2, s_g, E5M2))
    h = matmul_oracle(x8, up8.t(), s_x, s_up, torch.float32, bits)
    a = torch.relu(h) * torch.relu(h)
    a8 = quantize(a, s_a, E4M3)
    y = matmul_oracle(a8, down8.t(), s_a, s_down, x.dtype, bits)
    grad_h = 2.0 * torch.sqrt(a8.float() * s_a) * matmul_oracle(g8, down8, s_g, s_down, torch.float32, bits)
    gh8 = quantize(grad_h, s_h, E5M2)
    grad_down = matmul_oracle(g8.t(), a8, s_g, s_a, w_down.dtype, bits)
    grad_x = matmul_oracle(gh8, up8, s_h, s_up, x.dtype, bits)
    grad_up = matmul_oracle(gh8.t(), x8, s_h, s_x, w_up.dtype, bits)
    for name, t in (("input", x2), ("up_weight", w_up), ("down_weight", w_down), ("hidden", a),
                    ("grad_output", g2), ("grad_hidden", grad_h)):
        s.record(name, t)
    return [y.reshape(*x.shape[:-1], -1), grad_x.reshape(x.shape), grad_up, grad_down], s.state_after()


def amax_for_scale(scale, fp8_max, headroom):
    """An amax whose delayed scale is exactly `scale` (a power of two), found next to
    scale / (headroom / fp8_max) since that factor need not be a power of two."""
    guess = torch.tensor([scale / (headroom / fp8_max)])
    for step in range(-4, 5):
        candidate = guess + step * torch.finfo(torch.float32).eps * guess
        if delayed_scale(candidate, fp8_max, headroom).item() == scale:
            return candidate
    raise AssertionError(f"no amax gives the delayed scale {scale}")


def _grid_weight(rows, cols, generator, dtype, limit=3):
    """Grid values with max |w| = 1.75 = 448 / 256, so the exact weight scale is 2^-8."""
    w = grid_values(rows, cols, generator=generator, limit=limit)
    w[0, 0] = 1.75
    return w.to(dtype)


def _run_layer(layer, inputs, state, grad_output, config=SMALL_MATMUL):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    out = layer(*leaves, state, config)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_output)]


def linear_with_weight_cast(x, weight, state, config, scales, cast=kernels.fp8_cast_weights, layer=kernels.fp8_linear):
    """fp8_linear on its weight cast beforehand by the weight groups' cast (as a model's forward does)."""
    (weight_cast,) = kernels.fp8_linear_weight_casts([weight], [state], scales, cast)
    return layer(x, weight, state, config, scales=scales, weight_cast=weight_cast)


def mlp_with_weight_casts(x, w_up, w_down, state, config, scales, cast=kernels.fp8_cast_weights,
                          layer=kernels.fp8_relu2_mlp):
    """fp8_relu2_mlp on its weights cast beforehand by the weight groups' casts."""
    (weight_casts,) = kernels.fp8_mlp_weight_casts([w_up], [w_down], [state], scales, cast)
    return layer(x, w_up, w_down, state, config, scales=scales, weight_casts=weight_casts)


# Power-of-two scales the second call of test_fp8_layers_match_oracle_exactly gives each operand
# with a delayed rule (weights 2^-7, not their exact 2^-8, so the lagged branch shows).
DELAYED_TARGETS = {"input": 0.5, "weight": 2.0 ** -7, "up_weight": 2.0 ** -7, "down_weight": 2.0 ** -7,
                   "hidden": 2.0, "grad_output": 2.0 ** -3, "grad_hidden": 1.0}


def state_for_targets(scales, loss_unit, calls):
    """A state buffer whose delayed rules give the DELAYED_TARGETS scales (other amaxes 3.0,
    which exact and static rules must ignore)."""
    amaxes = []
    for field in dataclasses.fields(scales):
        rule, fp8_max = getattr(scales, field.name), 57344.0 if field.name.startswith("grad") else 448.0
        if isinstance(rule, (kernels.Delayed, kernels.ExactThenDelayed)):
            amaxes.append(amax_for_scale(DELAYED_TARGETS[field.name], fp8_max, rule.headroom))
        else:
            amaxes.append(torch.tensor([3.0]))
    return state_buffer([*amaxes, torch.tensor(float(calls)), torch.tensor(loss_unit)])


@interpreted
@pytest.mark.parametrize("layer,scales,config", [
    ("linear", kernels.FP8LinearScales(), SMALL_MATMUL), ("linear", kernels.QKV_SCALES, SMALL_MATMUL),
    ("mlp", kernels.FP8MLPScales(), SMALL_MATMUL), ("mlp", kernels.MLP_SCALES_RECORD92, SMALL_MATMUL),
    ("mlp", kernels.MLP_SCALES_RECORD89, None)])
def test_fp8_layers_match_oracle_exactly(layer, scales, config):
    """EXACT: forward and backward of fp8_linear / fp8_relu2_mlp and their references against
    the oracle written from the rules, bitwise, including the state buffer (the Triton layers with
    their own GEMMs and with torch._scaled_mm's, the fallback). Two calls: a fresh
    buffer (the uncalibrated scales: 1 for activations, 2^-14 for gradients; exact weights),
    also with gemm="tma" (48 tokens, every operand of a multiple of 16 bytes: each GEMM runs the
    persistent descriptor kernel, config its tile),
    then a buffer past the weights' exact calls whose amaxes give power-of-two delayed scales
    other than 1, with loss unit 2^-3; also with the weights cast beforehand by the weight
    groups' kernels (and their reference), as a model's forward casts them. Inputs and weights
    have max |x| = 1.75 = 448 / 256 (exact scale 2^-8); the static scales of these rules are
    powers of two. config None: the production tiles."""
    generator = torch.Generator().manual_seed(4)
    x = grid_values(2, 24, 32, generator=generator, limit=4, dtype=torch.bfloat16)
    x[0, 0, 0] = 1.75
    if layer == "linear":
        weights = [_grid_weight(80, 32, generator, torch.float32)]
        layers, oracle, new_state = (kernels.fp8_linear, functools.partial(kernels.fp8_linear, gemm="scaled_mm"),
                                     functools.partial(kernels.fp8_linear, gemm="tma"),
                                     kernels.fp8_linear_reference, linear_with_weight_cast,
                                     functools.partial(linear_with_weight_cast, cast=kernels.fp8_cast_weights_reference,
                                                       layer=kernels.fp8_linear_reference)
                                     ), linear_oracle, kernels.new_fp8_linear_state
    else:
        weights = [_grid_weight(48, 32, generator, torch.float32), _grid_weight(32, 48, generator, torch.bfloat16)]
        layers, oracle, new_state = (kernels.fp8_relu2_mlp, functools.partial(kernels.fp8_relu2_mlp, gemm="scaled_mm"),
                                     functools.partial(kernels.fp8_relu2_mlp, gemm="tma"),
                                     kernels.fp8_relu2_mlp_reference, mlp_with_weight_casts,
                                     functools.partial(mlp_with_weight_casts, cast=kernels.fp8_cast_weights_reference,
                                                       layer=kernels.fp8_relu2_mlp_reference)
                                     ), mlp_oracle, kernels.new_fp8_mlp_state
    grad_y = grid_values(2, 24, weights[-1].shape[0], generator=generator, limit=4, dtype=torch.bfloat16)
    lagged = kernels.WEIGHT_LAG.calls
    for state_before in (new_state(), state_for_targets(scales, 2.0 ** -3, lagged)):
        expected, expected_state = oracle(x, *weights, state_before, grad_y, scales=scales)
        for run in layers:
            state = state_before.clone()
            with LaunchedKernels() as launched:
                got = _run_layer(functools.partial(run, scales=scales), [x, *weights], state, grad_y, config)
            label = getattr(run, "__name__", None) or str(run.keywords)
            if label == str({"gemm": "tma"}):
                assert not {"_fp8_matmul_kernel", "_fp8_matmul_quant_kernel"} & set(launched.names), launched.names
            for name, g, e in zip(("out", "grad_x", "grad_w1", "grad_w2"), got, expected):
                assert g.dtype == e.dtype and torch.equal(g, e), f"{label}: {name} differs from the oracle"
            assert torch.equal(state, expected_state), f"{label}: state {state} != {expected_state}"


def test_fp8_weight_scale_turns_delayed_after_its_exact_calls():
    """ExactThenDelayed on the reference layer: calls 1..16 quantize the weight with its own
    amax, call 17 with call 16's amax times 1.12 (weights doubled each call, so the two differ)."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(8, 32, generator=generator).bfloat16()
    weight = torch.randn(16, 32, generator=generator) * 0.1
    scales = kernels.FP8LinearScales(weight=kernels.WEIGHT_LAG)
    state = kernels.new_fp8_linear_state()
    for call in range(kernels.WEIGHT_LAG.calls + 1):
        w = weight * 2.0 ** (call % 3)
        previous = state[kernels.FP8_LINEAR_SLOTS["weight"]].clone()
        y = kernels.fp8_linear_reference(x, w, state, scales=scales)
        lagged = call >= kernels.WEIGHT_LAG.calls
        s_w = delayed_scale(previous.reshape(1), 448.0, 1.12) if lagged else exact_scale(w)
        s_x = exact_scale(x.float())
        expected = matmul_oracle(quantize(x, s_x, E4M3), quantize(w, s_w, E4M3).t(), s_x, s_w, torch.bfloat16,
                                 bits=None)
        assert torch.equal(y, expected), f"call {call + 1}"
        assert state[kernels.FP8_LINEAR_SLOTS["calls"]] == call + 1
    assert delayed_scale(previous.reshape(1), 448.0, 1.12) != exact_scale(w)


def test_fp8_static_gradient_scale_follows_the_loss_unit():
    """A static gradient scale is one of the summed loss: a mean over T tokens with loss unit
    1/T gives the summed loss's fp8 gradients times 1/T, exactly (T a power of two), and the
    state records the mean loss's gradient amax."""
    generator = torch.Generator().manual_seed(8)
    x = torch.randn(16, 32, generator=generator).bfloat16()
    weight = torch.randn(24, 32, generator=generator) * 0.1
    target = torch.randn(16, 24, generator=generator)
    grads = []
    for unit, reduce in ((1.0, torch.sum), (1 / 16, torch.mean)):
        state = kernels.new_fp8_linear_state()
        kernels.set_fp8_loss_unit(state, unit)
        w = weight.clone().requires_grad_(True)
        y = kernels.fp8_linear_reference(x, w, state, scales=kernels.HEAD_SCALES)
        reduce((y.float() * target).sum(dim=1)).backward()
        grads.append(w.grad)
        assert state[kernels.FP8_LINEAR_SLOTS["grad_output"]] == (target.bfloat16().float() * unit).abs().max()
    assert torch.equal(grads[0] / 16, grads[1])


def test_fp8_scale_rules_are_checked():
    with pytest.raises(ValueError, match="epilogue output"):
        kernels.fp8_relu2_mlp_reference(torch.zeros(2, 8), torch.zeros(16, 8), torch.zeros(8, 16),
                                        kernels.new_fp8_mlp_state(), scales=kernels.FP8MLPScales(hidden=kernels.EXACT))
    with pytest.raises(ValueError, match="FP8LinearScales"):
        kernels.fp8_linear_reference(torch.zeros(2, 8), torch.zeros(16, 8), kernels.new_fp8_linear_state(),
                                     scales=kernels.FP8MLPScales())


@interpreted
def test_fp8_mlp_computes_only_the_gradients_needed():
    """EXACT: with only w_down trainable the backward runs one GEMM, matching the oracle, and
    leaves the amax slot of the (uncomputed) pre-activation gradient alone."""
    generator = torch.Generator().manual_seed(6)
    x = grid_values(24, 32, generator=generator, limit=4, dtype=torch.bfloat16)
    w_up, w_down = _grid_weight(48, 32, generator, torch.float32), _grid_weight(32, 48, generator, torch.float32)
    grad_y = grid_values(24, 32, generator=generator, limit=4, dtype=torch.bfloat16)
    state = kernels.new_fp8_mlp_state()
    expected, expected_state = mlp_oracle(x, w_up, w_down, state, grad_y)
    trainable = w_down.clone().requires_grad_(True)
    out = kernels.fp8_relu2_mlp(x, w_up, trainable, state, SMALL_MATMUL)
    grad_down, = torch.autograd.grad(out, trainable, grad_y)
    assert torch.equal(out, expected[0]) and torch.equal(grad_down, expected[3])
    skipped = kernels.FP8_MLP_SLOTS["grad_hidden"]
    assert torch.equal(state[:skipped], expected_state[:skipped]) and state[skipped] == 0
    assert torch.equal(state[skipped + 1:], expected_state[skipped + 1:])


@interpreted
def test_fp8_linear_random_inputs_within_rounding_bound():
    """FP32 + BF16: unit-normal bf16 inputs with delayed scales from a previous call; Triton
    and reference quantize identically and differ only by summation order, so y and the
    gradients agree within the fp32 bound (computed from |x| |w|, 1.3 covering the fp8
    rounding of the operands) plus one bf16 rounding on each side."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(30, 64, generator=generator).bfloat16()
    weight = torch.randn(40, 64, generator=generator) * 0.05
    grad_y = torch.randn(30, 40, generator=generator).bfloat16()
    states = [kernels.new_fp8_linear_state(), kernels.new_fp8_linear_state()]
    for _ in range(2):
        (y1, gx1, gw1), (y2, gx2, gw2) = (_run_layer(layer, [x, weight], state, grad_y) for layer, state in
                                          zip((kernels.fp8_linear, kernels.fp8_linear_reference), states))
        assert torch.equal(states[0], states[1])
    magnitude = 1.3 * 1.3
    bound_y = fp32_sum_bound(x, weight.t(), 64 + 2) * magnitude
    bound_gx = fp32_sum_bound(grad_y, weight, 40 + 2) * magnitude
    bound_gw = fp32_sum_bound(grad_y.t(), x, 30 + 2) * magnitude
    for name, got, want, bound, rounded in (("y", y1, y2, bound_y, True), ("grad_x", gx1, gx2, bound_gx, True),
                                            ("grad_w", gw1, gw2, bound_gw, False)):
        assert_within(got, want, bound + (2 * U_BF16 * want.double().abs() if rounded else 0), name)


@interpreted
def test_fp8_layers_with_fused_casts_match_the_cast_kernel_bitwise():
    """casts="fused" (a compiled model's) changes where the casts run, not what they compute:
    the FP8 linear layer and MLP give the same outputs, gradients and state bit for bit as with
    the cast kernel, over two calls (exact, then delayed scales)."""
    generator = torch.Generator().manual_seed(9)
    x = torch.randn(24, 32, generator=generator).bfloat16()
    weight, w_up = torch.randn(40, 32, generator=generator) * 0.05, torch.randn(48, 32, generator=generator) * 0.05
    w_down = torch.randn(32, 48, generator=generator) * 0.05
    for inputs, grad_y, new_state, layer in (
            ([x, weight], torch.randn(24, 40, generator=generator).bfloat16(), kernels.new_fp8_linear_state,
             kernels.fp8_linear),
            ([x, w_up, w_down], torch.randn(24, 32, generator=generator).bfloat16(), kernels.new_fp8_mlp_state,
             kernels.fp8_relu2_mlp)):
        states = {casts: new_state() for casts in kernels.FP8_CASTS}
        for _ in range(2):
            results = {casts: _run_layer(functools.partial(layer, casts=casts), inputs, states[casts], grad_y)
                       for casts in kernels.FP8_CASTS}
            assert all(torch.equal(a, b) for a, b in zip(results["fused"], results["kernel"]))
            assert torch.equal(states["fused"], states["kernel"])


@interpreted
def test_fp8_layers_take_a_gain_on_the_weight():
    """gain (a 0-D tensor) makes the layer's weight gain * W without casting gain * W: at g = 1/2
    (a power of two, so every scale product is exact) the output is half the gainless layer's and
    so is the weight's gradient, bit for bit (of the QKV projection: v and its weight rows; q and
    k are normed); gain's gradient is the float64 sum of W times the gradient of gain W; the
    input's gradient is half the gainless one's within the fp8 rounding of the gradients behind
    it. fp8_linear, fp8_relu2_mlp (the gain on the down weight) and
    fp8_qkv_norm_rope, Triton and reference bit for bit. A gain that is not 0-D is refused."""
    generator = torch.Generator().manual_seed(12)
    T, K, H, D = 24, 32, 2, 16
    x = torch.randn(T, K, generator=generator).bfloat16()
    weight = torch.randn(H * 3 * D, K, generator=generator) * 0.1
    w_up, w_down = torch.randn(48, K, generator=generator) * 0.1, torch.randn(K, 48, generator=generator) * 0.1
    angles = torch.outer(torch.arange(T, dtype=torch.float32), torch.rand(D // 2, generator=generator))
    rope = (H, D, angles.cos(), angles.sin(), torch.zeros(D, dtype=torch.bool))
    linear_scales = kernels.FP8LinearScales(grad_output=kernels.Static(2.0 ** -4))
    mlp_scales = kernels.FP8MLPScales(grad_output=kernels.Static(2.0 ** -4), grad_hidden=kernels.Static(2.0 ** -6))
    rope_config = kernels.LaunchConfig(block_m=8, block_n=0)

    def composed_qkv(x, w, state, gain):       # what fp8_qkv_norm_rope fuses, bit for bit
        q, k, v = kernels.fp8_linear(x, w, state, SMALL_MATMUL, linear_scales, gain=gain).view(T, 3 * H, D).split(H, 1)
        return (*kernels.qk_norm_rope(q, k, *rope[2:], None, rope_config), v)
    layers = {   # name: ([(layer, its reference)], inputs, the weight with the gain, new state, output gradients)
        "linear": ([(functools.partial(kernels.fp8_linear, config=SMALL_MATMUL, scales=linear_scales),
                     functools.partial(kernels.fp8_linear_reference, scales=linear_scales))],
                   [x, weight], 1, kernels.new_fp8_linear_state, [torch.randn(T, 3 * H * D, generator=generator)]),
        "mlp": ([(functools.partial(kernels.fp8_relu2_mlp, config=SMALL_MATMUL, scales=mlp_scales),
                  functools.partial(kernels.fp8_relu2_mlp_reference, scales=mlp_scales))],
                [x, w_up, w_down], 2, kernels.new_fp8_mlp_state, [torch.randn(T, K, generator=generator)]),
        "qkv": ([(lambda x, w, state, gain: kernels.fp8_qkv_norm_rope(x, w, state, *rope, config=SMALL_MATMUL,
                                                                      scales=linear_scales, rope_config=rope_config,
                                                                      gain=gain),
                  lambda x, w, state, gain: composed_qkv(x, w, state, gain))],
                [x, weight], 1, kernels.new_fp8_linear_state,
                [torch.randn(T, H, D, generator=generator) for _ in range(3)]),
    }
    for name, (fns, inputs, gained, new_state, grads) in layers.items():
        grads = [g.bfloat16() for g in grads]
        results = []
        for fn in fns[0]:
            for gain in (None, torch.tensor(0.5, requires_grad=True)):
                leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
                out = fn(*leaves, new_state(), gain=gain)
                out = out if isinstance(out, tuple) else (out,)
                got = torch.autograd.grad(out, leaves + ([gain] if gain is not None else []), grads)
                results.append(([t.detach() for t in out], list(got)))
        (plain_out, plain_grads), (out, grads_gained) = results[0], results[1]
        assert all(_bits_equal(a.reshape(-1), b.reshape(-1)) for r, t in zip(results[:2], results[2:])
                   for a, b in zip(r[0] + r[1], t[0] + t[1])), name
        # q and k are normed (the gain leaves them, and doubles their gradients before the norm): v's rows
        rows = slice(2 * H * D, None) if name == "qkv" else slice(None)
        for o, p in list(zip(out, plain_out))[-1 if name == "qkv" else 0:]:
            assert _bits_equal(o, (0.5 * p.float()).to(p.dtype)), name
        got_w, plain_w = grads_gained[gained], plain_grads[gained]
        assert _bits_equal(got_w[rows], (0.5 * plain_w[rows].double()).to(plain_w.dtype)), name
        want = (got_w.double() / 0.5 * inputs[gained].double()).sum()
        assert grads_gained[-1].double().sub(want).abs() <= 1e-5 * want.abs() + 1e-6, name
        if name != "qkv":
            got_x, want_x = grads_gained[0].double(), 0.5 * plain_grads[0].double()
            assert (got_x - want_x).norm() <= 0.05 * want_x.norm(), name
    with pytest.raises(ValueError, match="0-D"):
        kernels.fp8_linear(x, weight, kernels.new_fp8_linear_state(), gain=torch.ones(1))


def test_fp8_layers_reject_a_wrong_state():
    with pytest.raises(ValueError, match="new_fp8_mlp_state"):
        kernels.fp8_relu2_mlp(torch.zeros(2, 8), torch.zeros(16, 8), torch.zeros(8, 16), kernels.new_fp8_linear_state())


# ---------------------------------------------------------------------------------------------
# Flash attention
# ---------------------------------------------------------------------------------------------

def uneven_documents(num_tokens, generator, padding=2):
    """cu_seqlens of documents with random lengths (one of length 1), padded at the end by
    repeating num_tokens, as the trainer does."""
    lengths = [1]
    while sum(lengths) < num_tokens:
        lengths.append(int(torch.randint(2, 70, (1,), generator=generator)))
    lengths[-1] -= sum(lengths) - num_tokens
    lengths = [length for length in lengths if length > 0]
    bounds = torch.tensor([0] + lengths).cumsum(0).tolist() + [num_tokens] * padding
    return torch.tensor(bounds, dtype=torch.int32), max(lengths)


def visibility_mask(cu_seqlens, num_tokens, window):
    """(T, T) bool: key j visible to query i, built document by document from the definition."""
    visible = torch.zeros(num_tokens, num_tokens, dtype=torch.bool)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        for i in range(start, end):
            first = start if window <= 0 else max(start, i - window + 1)
            visible[i, first:i + 1] = True
    return visible.to(cu_seqlens.device)


def attention_oracle(q, k, v, cu_seqlens, window, scale):
    """float64 attention with an explicit visibility mask (pass float64 leaves for gradients)."""
    o = F.scaled_dot_product_attention(q.double().transpose(0, 1), k.double().transpose(0, 1),
                                       v.double().transpose(0, 1),
                                       attn_mask=visibility_mask(cu_seqlens, q.shape[0], window), scale=scale)
    return o.transpose(0, 1)


def attention_naive(q, k, v, cu_seqlens, window, scale):
    """Attention op by op in the inputs' dtype: each matmul, the scaling and the softmax round
    to bf16 for bf16 inputs (the baseline of the FlashAttention tests)."""
    visible = visibility_mask(cu_seqlens, q.shape[0], window)
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~visible, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def _attention_and_grads(attention, q, k, v, grad_o, *args):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    o = attention(*leaves, *args)
    return [o.detach(), *torch.autograd.grad(o, leaves, grad_o.to(o.dtype))]


def _attention_inputs(T, H, d_qk, d_v, seed, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, H, d_qk, generator=generator).to(dtype) for _ in range(2))
    v = torch.randn(T, H, d_v, generator=generator).to(dtype)
    grad_o = torch.randn(T, H, d_v, generator=generator).to(dtype)
    return q, k, v, grad_o, generator


def _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, configs, scale=None, impl="atomic"):
    """ATTN: forward and backward (impl: which backward) against the float64 oracle and
    attention_reference; the kernel gets the scale as a one-element tensor, the reference as a
    number."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    got = _attention_and_grads(functools.partial(kernels.flash_attn_varlen, impl=impl), q, k, v, grad_o, cu_seqlens,
                               window, torch.tensor([scale]), configs)
    oracle = _attention_and_grads(attention_oracle, q.double(), k.double(), v.double(), grad_o, cu_seqlens, window,
                                  scale)
    reference = _attention_and_grads(kernels.attention_reference, q, k, v, grad_o, cu_seqlens, window, scale)
    for name, g, o, r in zip(("out", "dq", "dk", "dv"), got, oracle, reference):
        torch.testing.assert_close(g.double(), o, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} vs float64: {m}")
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} vs reference: {m}")


@interpreted
@pytest.mark.parametrize("impl", ATTENTION_BACKWARDS)
@pytest.mark.parametrize("d_qk,d_v,window", [(64, 64, 0), (128, 128, 9), (64, 128, 40), (128, 64, 1000)])
def test_attention_every_head_dim_pair(d_qk, d_v, window, impl):
    """ATTN, fp32: uneven documents (one of length 1, zero-length padding), T not a multiple of
    any block, windows none / smaller / larger than documents; both backwards."""
    q, k, v, grad_o, generator = _attention_inputs(150, 2, d_qk, d_v, seed=d_qk + d_v + window)
    cu_seqlens, _ = uneven_documents(150, generator)
    _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, SMALL_ATTENTION, impl=impl)


@interpreted
@pytest.mark.parametrize("impl", ATTENTION_BACKWARDS)
@pytest.mark.parametrize("window", [1, 5, 16, 33])
def test_attention_window_edges(window, impl):
    """ATTN, fp32: windows of one token, below, equal to and above the block sizes, with query
    blocks twice the key blocks in the forward and the reverse in the key/value backwards."""
    q, k, v, grad_o, generator = _attention_inputs(120, 2, 64, 64, seed=window)
    cu_seqlens, _ = uneven_documents(120, generator)
    configs = (kernels.LaunchConfig(32, 16), kernels.LaunchConfig(16, 32), kernels.LaunchConfig(16, 16),
               kernels.LaunchConfig(64, 1), kernels.LaunchConfig(16, 32))
    _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, configs, scale=0.37, impl=impl)


# The presets' windows are whole blocks of train_gpt.WINDOW_BLOCK (128) tokens: 1 to 13 in
# training, 20 at the final validation. Scaled down to blocks of 16 tokens with the tests' tiles
# (the same window arithmetic at an eighth of the size), documents longer than the windows.
SCALED_WINDOW_BLOCK = 16


@interpreted
@pytest.mark.parametrize("impl", ATTENTION_BACKWARDS)
@pytest.mark.parametrize("blocks", [1, 5, 13, 20])
def test_attention_at_the_presets_windows_in_blocks(blocks, impl):
    """ATTN, fp32: windows of 1, 5, 13 and 20 blocks (of SCALED_WINDOW_BLOCK tokens), documents
    of up to 24 blocks and a short one."""
    T = 26 * SCALED_WINDOW_BLOCK
    q, k, v, grad_o, _ = _attention_inputs(T, 1, 32, 32, seed=blocks)
    cu_seqlens = torch.tensor([0, 24 * SCALED_WINDOW_BLOCK - 5, T - 3, T], dtype=torch.int32)
    _check_attention_fp32(q, k, v, grad_o, cu_seqlens, blocks * SCALED_WINDOW_BLOCK, SMALL_ATTENTION, impl=impl)


@interpreted
@pytest.mark.parametrize("impl", ATTENTION_BACKWARDS)
@pytest.mark.parametrize("window", [128, 640])
def test_attention_production_tiles_at_whole_block_windows(window, impl):
    """ATTN, fp32, with the production launch configs the window picks, at the speedrun's first
    short and long windows (1 and 5 blocks of 128 tokens) on documents up to stage 0's 896."""
    q, k, v, grad_o, _ = _attention_inputs(1000, 1, 64, 64, seed=window)
    cu_seqlens = torch.tensor([0, 896, 990, 1000], dtype=torch.int32)
    _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, kernels.attention_configs(window), impl=impl)


@interpreted
@pytest.mark.parametrize("window", [150, 1500])
def test_attention_production_blocks(window):
    """ATTN, fp32, with the production launch configs the window picks (the narrow windows' small
    tiles at 150, the production tiles beyond NARROW_WINDOW): documents longer than several
    blocks, a window that is not a multiple of the blocks."""
    assert kernels.attention_configs(window) == (kernels.ATTENTION_CONFIGS_NARROW if window == 150
                                                 else kernels.ATTENTION_CONFIGS)
    q, k, v, grad_o, _ = _attention_inputs(400, 1, 64, 64, seed=8)
    cu_seqlens = torch.tensor([0, 7, 300, 400, 400], dtype=torch.int32)
    for impl in ATTENTION_BACKWARDS:
        _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, kernels.attention_configs(window), impl=impl)


@interpreted
def test_attention_strided_inputs():
    """ATTN, fp32: q, k, v as views of one packed (T, 3, H, D) tensor, a non-contiguous output
    gradient, a single document."""
    generator = torch.Generator().manual_seed(6)
    qkv = torch.randn(90, 3, 2, 64, generator=generator)
    grad_o = torch.randn(2, 90, 64, generator=generator).transpose(0, 1)
    cu_seqlens = torch.tensor([0, 90], dtype=torch.int32)
    for impl in ATTENTION_BACKWARDS:
        _check_attention_fp32(qkv[:, 0], qkv[:, 1], qkv[:, 2], grad_o, cu_seqlens, 30, SMALL_ATTENTION, impl=impl)


def _check_attention_bf16(q, k, v, grad_o, cu_seqlens, window, configs, impl=None):
    """ATTN, bf16: the error against float64 of the kernel's output and gradients is at most
    twice that of torch's op-by-op bf16 attention (attention_naive) plus 1e-5."""
    scale = q.shape[-1] ** -0.5
    got = _attention_and_grads(functools.partial(kernels.flash_attn_varlen, impl=impl), q, k, v, grad_o, cu_seqlens,
                               window, scale, *configs)
    naive = _attention_and_grads(attention_naive, q, k, v, grad_o, cu_seqlens, window, scale)
    oracle = _attention_and_grads(attention_oracle, q.double(), k.double(), v.double(), grad_o, cu_seqlens, window,
                                  scale)
    for name, g, t, o in zip(("out", "dq", "dk", "dv"), got, naive, oracle):
        assert g.dtype == torch.bfloat16
        error, torch_error = (g.double() - o).abs().max().item(), (t.double() - o).abs().max().item()
        assert error <= 2 * torch_error + 1e-5, f"{name}: error {error} vs torch's {torch_error}"


@interpreted
@pytest.mark.parametrize("d_qk,d_v,window,impl", [(64, 64, 30, "atomic"), (128, 128, 0, "deterministic"),
                                                  (64, 128, 7, "atomic"), (128, 64, 24, "deterministic")])
def test_attention_bf16_error_at_most_twice_torch(d_qk, d_v, window, impl):
    q, k, v, grad_o, generator = _attention_inputs(130, 2, d_qk, d_v, seed=7, dtype=torch.bfloat16)
    cu_seqlens, _ = uneven_documents(130, generator)
    _check_attention_bf16(q, k, v, grad_o, cu_seqlens, window, [SMALL_ATTENTION], impl)


# The descriptor variants (impl="tma": _attn_fwd_tma_kernel, _attn_bwd_fused_tma_kernel) against
# the float64 oracle and attention_reference: uneven documents (one of length 1), T not a
# multiple of any block (the descriptors' bounds stand in for the row masks), windows none,
# smaller and larger than the blocks and documents, every head-dim pair, q, k, v as views of one
# packed tensor.
@interpreted
@pytest.mark.parametrize("d_qk,d_v,window,T", [(64, 64, 0, 150), (128, 64, 9, 150), (32, 128, 40, 150),
                                               (32, 32, 16, 137), (64, 64, 33, 120)])
def test_attention_descriptor_variants_match_float64(d_qk, d_v, window, T):
    q, k, v, grad_o, generator = _attention_inputs(T, 2, d_qk, d_v, seed=d_qk + d_v + window)
    cu_seqlens, _ = uneven_documents(T, generator)
    with LaunchedKernels() as launched:
        _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, SMALL_ATTENTION, impl="tma")
    assert {"_attn_fwd_tma_kernel", "_attn_bwd_fused_tma_kernel"} <= set(launched.names)


@interpreted
@pytest.mark.parametrize("blocks", [1, 5, 13])
def test_attention_descriptor_variants_at_the_presets_windows_in_blocks(blocks):
    """ATTN, fp32, impl="tma": windows of whole blocks of SCALED_WINDOW_BLOCK tokens, documents of
    up to 24 blocks and a short one, window-edge tiles twice the key blocks in the forward."""
    T = 26 * SCALED_WINDOW_BLOCK
    q, k, v, grad_o, _ = _attention_inputs(T, 1, 32, 32, seed=100 + blocks)
    cu_seqlens = torch.tensor([0, 24 * SCALED_WINDOW_BLOCK - 5, T - 3, T], dtype=torch.int32)
    configs = (kernels.LaunchConfig(32, 16), *SMALL_ATTENTION[1:])
    _check_attention_fp32(q, k, v, grad_o, cu_seqlens, blocks * SCALED_WINDOW_BLOCK, configs, impl="tma")


@interpreted
def test_attention_descriptor_variants_take_strided_views_and_production_tiles():
    """ATTN, fp32, impl="tma": q, k, v as views of one packed (T, 3, H, D) tensor and a
    non-contiguous output gradient (per-head descriptors over the packed rows), then the
    production tiles of a narrow and a wide window."""
    generator = torch.Generator().manual_seed(61)
    qkv = torch.randn(90, 3, 2, 64, generator=generator)
    grad_o = torch.randn(2, 90, 64, generator=generator).transpose(0, 1)
    cu_seqlens = torch.tensor([0, 90], dtype=torch.int32)
    _check_attention_fp32(qkv[:, 0], qkv[:, 1], qkv[:, 2], grad_o, cu_seqlens, 30, SMALL_ATTENTION, impl="tma")
    q, k, v, grad_o, _ = _attention_inputs(400, 1, 64, 64, seed=62)
    cu_seqlens = torch.tensor([0, 7, 300, 400, 400], dtype=torch.int32)
    for window in (150, 1500):
        _check_attention_fp32(q, k, v, grad_o, cu_seqlens, window, kernels.attention_configs(window), impl="tma")


@interpreted
def test_attention_descriptor_variants_bf16_error_at_most_twice_torch():
    q, k, v, grad_o, generator = _attention_inputs(130, 2, 64, 128, seed=63, dtype=torch.bfloat16)
    cu_seqlens, _ = uneven_documents(130, generator)
    _check_attention_bf16(q, k, v, grad_o, cu_seqlens, 24, [SMALL_ATTENTION], "tma")


def test_attention_descriptor_variants_need_describable_layouts():
    """A tensor whose token stride is not a multiple of 16 bytes cannot be described: impl="tma"
    runs the pointer kernels there, and the warm-up offers no descriptor candidate."""
    q = torch.zeros(10, 3, 32)
    assert kernels._descriptor_layout_ok(q, q[:, :2], q.transpose(0, 1).contiguous().transpose(0, 1))
    odd = torch.zeros(10, 1, 36)[..., :32]          # token stride 36 floats = 144 bytes: fine
    assert kernels._descriptor_layout_ok(odd)
    assert not kernels._descriptor_layout_ok(torch.zeros(10, 1, 34)[..., :32])  # 136-byte rows
    assert not kernels._descriptor_layout_ok(torch.zeros(10, 1, 33)[:, :, 1:])  # base 4 bytes in


def test_attention_rejects_bad_inputs():
    q = torch.zeros(10, 2, 64)
    cu_seqlens = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="head dims"):
        kernels.flash_attn_varlen(q[..., :48], q[..., :48], q, cu_seqlens, 0, 1.0)
    with pytest.raises(ValueError, match="int32"):
        kernels.flash_attn_varlen(q, q, q, torch.tensor([0, 10]), 0, 1.0)
    with pytest.raises(ValueError, match="one-element float32"):
        kernels.flash_attn_varlen(q, q, q, cu_seqlens, 0, torch.ones(2))


def test_attention_refuses_mixed_dtypes_and_fp32_on_the_gpu():
    """What CUDA autocast hands over when q and k come out of an fp32 norm and v out of a bf16
    matmul: the kernels' dots would mix dtypes (and fp32 tiles do not fit on sm_90), so the
    wrapper refuses before any launch, also under fake tensors (torch.compile's tracing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cu_seqlens = torch.tensor([0, 10], dtype=torch.int32)
    q, v = torch.zeros(10, 2, 64), torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="in one dtype"):
        kernels.flash_attn_varlen(q, q, v, cu_seqlens, 0, 1.0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(10, 2, 64, device="cuda")
        with pytest.raises(ValueError, match="bf16 or fp16 on the GPU"):
            kernels.flash_attn_varlen(q, q, q, torch.zeros(2, dtype=torch.int32, device="cuda"), 0, 1.0)


@pytest.mark.parametrize("impl,backward", [
    ("auto", ["_attn_bwd_fused_kernel"]),
    ("deterministic", ["_attn_bwd_delta_kernel", "_attn_bwd_kv_kernel", "_attn_bwd_q_kernel"])])
def test_attention_launches_one_program_per_block_of_the_packed_batch(impl, backward):
    """The grid covers the packed batch, not (longest document x document slots): at most as
    many programs as there are (document, block) work items, with no slack, even with the
    loader's padded cu_seqlens (here 3,074 document slots for 49,152 tokens, 20 documents). By
    default (the rule where nothing was timed) the backward is one kernel; the deterministic
    one is three."""
    T, H, block = 49152, 6, kernels.ATTENTION_FORWARD.block_m
    lengths = [3072] * 12 + [1536] * 8
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()] + [T] * (T // 16 + 2 - 21),
                              dtype=torch.int32)
    work_items = sum(-(-n // block) for n in lengths) * H
    grids = []
    original = kernels._launch
    kernels._launch = lambda kernel, grid, config, **args: grids.append((kernel.__name__, grid))
    try:
        q = torch.empty(T, H, 128, dtype=torch.bfloat16, requires_grad=True)
        o = kernels.flash_attn_varlen(q, q, q, cu_seqlens, 1664, 0.1, impl=impl)
        o.backward(torch.empty_like(o))
    finally:
        kernels._launch = original
    assert [name for name, _ in grids] == ["_attn_fwd_kernel", *backward]
    for name, grid in grids:
        programs = math.prod(grid)
        assert programs <= work_items, f"{name}: {programs} programs for {work_items} work items"


# ---------------------------------------------------------------------------------------------
# Softcapped cross-entropy
# ---------------------------------------------------------------------------------------------

# Composed local attention: the tests' blocks hold the longest window (span >= block + 127).
SMALL_COMPOSED = [value for _ in range(4) for value in kernels.LaunchConfig(block_m=16, block_n=256).as_list()]


def composed_oracle(q, k, v, cu_seqlens, window, scale, mix_in, mix_out):
    """float64 composed attention from the definition, with the (T, T) visibility mask: every
    head's softmax over the visible keys, mixed per token by mix_in into one map, applied to each
    head's values and scaled by mix_out (pass float64 leaves for gradients)."""
    visible = visibility_mask(cu_seqlens, q.shape[0], window)
    maps = (scale * torch.einsum("ihd,jhd->hij", q, k)).masked_fill(~visible, float("-inf")).softmax(-1)
    mixed = torch.einsum("hij,ih->ij", maps, mix_in)
    return torch.einsum("ij,jhd->ihd", mixed, v) * mix_out[..., None]


def _composed_inputs(T, H, d_qk, d_v, seed, dtype=torch.float32):
    q, k, v, grad_o, generator = _attention_inputs(T, H, d_qk, d_v, seed, dtype)
    mix_in, mix_out = torch.randn(T, H, generator=generator), torch.randn(T, H, generator=generator).to(dtype)
    cu_seqlens, _ = uneven_documents(T, generator)
    return (q, k, v, mix_in, mix_out), grad_o, cu_seqlens


def _composed_and_grads(composed, inputs, grad_o, doc_start, window, scale, *configs):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    q, k, v, mix_in, mix_out = leaves
    o = composed(q, k, v, doc_start, window, scale, mix_in, mix_out, *configs)
    return [o.detach(), *torch.autograd.grad(o, leaves, grad_o.to(o.dtype))]


COMPOSED_OUTPUTS = ("out", "dq", "dk", "dv", "dmix_in", "dmix_out")


@pytest.mark.parametrize("window", [1, 40, kernels.COMPOSED_MAX_WINDOW])
def test_composed_attention_reference_equals_its_definition(window):
    """The blocked reference, forward and every gradient, against the float64 oracle."""
    inputs, grad_o, cu_seqlens = _composed_inputs(300, 3, 8, 8, seed=9)
    doc_start = kernels.document_bounds(cu_seqlens, 300)[0]
    got = _composed_and_grads(kernels.composed_attention_reference, inputs, grad_o, doc_start, window, 0.3)
    want = _composed_and_grads(lambda q, k, v, _, w, s, mi, mo: composed_oracle(q, k, v, cu_seqlens, w, s, mi, mo),
                               [t.double() for t in inputs], grad_o.double(), doc_start, window, 0.3)
    for name, g, w in zip(COMPOSED_OUTPUTS, got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


@interpreted
@pytest.mark.parametrize("d_qk,d_v,window,configs", [
    (16, 16, 1, SMALL_COMPOSED), (32, 16, 40, SMALL_COMPOSED), (16, 32, 128, SMALL_COMPOSED),
    (16, 16, 112, kernels.COMPOSED_CONFIGS)])
def test_composed_attention_matches_float64(d_qk, d_v, window, configs):
    """ATTN: the kernel's output and the gradients of q, k, v and both mixes against the float64
    oracle and the reference, fp32 inputs, uneven documents (one of a single token), a length
    that is no multiple of the block; the scale is a one-element tensor, as the model's."""
    T = 150
    inputs, grad_o, cu_seqlens = _composed_inputs(T, 2, d_qk, d_v, seed=21)
    doc_start = kernels.document_bounds(cu_seqlens, T)[0]
    scale = d_qk ** -0.5
    got = _composed_and_grads(kernels.composed_attention, inputs, grad_o, doc_start, window, torch.tensor([scale]),
                              configs)
    oracle = _composed_and_grads(lambda q, k, v, _, w, s, mi, mo: composed_oracle(q, k, v, cu_seqlens, w, s, mi, mo),
                                 [t.double() for t in inputs], grad_o.double(), doc_start, window, scale)
    reference = _composed_and_grads(kernels.composed_attention_reference, inputs, grad_o, doc_start, window, scale)
    for name, g, o, r in zip(COMPOSED_OUTPUTS, got, oracle, reference):
        atol = 1e-4 * max(1.0, float(o.abs().max()))
        torch.testing.assert_close(g.double(), o, rtol=1e-4, atol=atol, msg=lambda m: f"{name} vs float64: {m}")
        torch.testing.assert_close(g, r, rtol=1e-4, atol=atol, msg=lambda m: f"{name} vs reference: {m}")


@interpreted
def test_composed_attention_bf16_error_at_most_twice_the_references():
    """bf16 inputs (the model's): the kernel's error against float64, per output and gradient,
    is at most twice the bf16 reference's, plus 1e-5 of the output scale."""
    _check_composed_bf16(150, 2, 32, "cpu", SMALL_COMPOSED)


def _check_composed_bf16(T, H, D, device, configs):
    window = 112
    inputs, grad_o, cu_seqlens = _composed_inputs(T, H, D, D, seed=22, dtype=torch.bfloat16)
    doc_start = kernels.document_bounds(cu_seqlens, T)[0]
    got = [t.cpu() for t in _composed_and_grads(kernels.composed_attention, [t.to(device) for t in inputs],
                                                grad_o.to(device), doc_start.to(device), window,
                                                torch.tensor([0.2], device=device), configs)]
    reference = _composed_and_grads(kernels.composed_attention_reference, inputs, grad_o, doc_start, window, 0.2)
    oracle = _composed_and_grads(lambda q, k, v, _, w, s, mi, mo: composed_oracle(q, k, v, cu_seqlens, w, s, mi, mo),
                                 [t.double() for t in inputs], grad_o.double(), doc_start, window, 0.2)
    for name, g, r, o in zip(COMPOSED_OUTPUTS, got, reference, oracle):
        kernel_error, reference_error = ((t.double() - o).abs().max() for t in (g, r))
        assert kernel_error <= 2 * reference_error + 1e-5 * o.abs().max(), (name, kernel_error, reference_error)


def test_composed_attention_rejects_bad_inputs():
    q = torch.randn(20, 2, 16)
    mix, doc_start = torch.randn(20, 2), torch.zeros(20, dtype=torch.int32)
    with pytest.raises(ValueError, match="windows of 1 to 128"):
        kernels.composed_attention(q, q, q, doc_start, 129, 0.25, mix, mix)
    with pytest.raises(ValueError, match=r"mix_in \(fp32\) and mix_out of shape \(20, 2\)"):
        kernels.composed_attention(q, q, q, doc_start, 8, 0.25, mix.bfloat16(), mix)
    with pytest.raises(ValueError, match="one query block and one key span"):
        kernels.composed_attention(q, q, q, doc_start, 8, 0.25, mix, mix,
                                   kernels.LaunchConfig(block_m=16, block_n=128).as_list() * 4)


def cross_entropy_oracle(logits, targets, weights):
    """float64 loss (differentiable, for the gradient) and softmax from the formula of the reference."""
    z = 23.0 * torch.sigmoid((logits + 5.0) / 7.5)
    lse = torch.logsumexp(z, dim=1)
    loss = torch.zeros(logits.shape[0], dtype=torch.float64)
    for row in range(logits.shape[0]):
        for column, weight in zip(targets[row].tolist(), weights.tolist()):
            if 0 <= column < logits.shape[1]:
                loss[row] = loss[row] + weight * (lse[row] - z[row, column])
    return loss, torch.softmax(z.detach(), dim=1)


Z_ERROR = 5 * 23.0 * U32  # z = 23 sigmoid(u): exp, add, divide, multiply, each within an ulp of 23


def ce_tolerances(targets, weights, softmax, columns, block):
    """FP32 bounds of the fused cross-entropy per row (loss) and per entry (gradient).

    lse = 23 + log(sum exp(z - 23)) inherits the z error (Z_ERROR) and the relative error of a
    blocked sum of C terms, (C / block + log2(block) + 4) 2^-24; each target's loss adds its own
    z error. A gradient entry W p dz/dx - w [target] dz/dx, with dz/dx <= 23 / 30, is off by
    (p + [target]) * W * (the loss error + 10 ulps) at most."""
    sum_error = (columns / block + math.log2(block) + 4) * U32
    per_target = Z_ERROR + sum_error + Z_ERROR
    total_weight = weights.abs().sum().item()
    is_target = torch.zeros_like(softmax)
    for row, row_targets in enumerate(targets.tolist()):
        is_target[row, [t for t in row_targets if 0 <= t < columns]] = 1.0
    return total_weight * per_target, total_weight * (softmax + is_target) * (per_target + 10 * U32)


def _cross_entropy_inputs(rows, columns, num_targets, seed, dtype):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, columns, generator=generator) * 6).to(dtype)
    targets = torch.randint(0, columns, (rows, num_targets), generator=generator)
    targets[0, -1] = -1                        # absent
    targets[1 % rows, 0] = columns + 3         # outside the candidate columns
    if num_targets > 1:
        targets[2 % rows, 1] = targets[2 % rows, 0]  # duplicate target
    weights = torch.tensor([1.0, 0.5, 0.25, 0.25][:num_targets])
    grad_loss = torch.rand(rows, generator=generator) + 0.5
    return logits, targets, weights, grad_loss


def _check_cross_entropy(ce, block, logits, targets, weights, grad_loss):
    """Loss and logit gradient of ce(logits, targets, weights), whose sums over a row run in
    blocks of `block` columns, against the float64 oracle (ce_tolerances; a bf16 gradient adds
    two roundings, 2 * 2^-8 relative: the forward stores it in bf16, the backward rescales it
    by the upstream gradient) and the loss against the reference; the next-token loss against
    the oracle's loss with the first target alone."""
    x = logits.clone().requires_grad_(True)
    loss, next_loss = ce(x, targets, weights)
    assert not next_loss.requires_grad
    grad, = torch.autograd.grad(loss, x, grad_loss)
    x64 = logits.cpu().double().requires_grad_(True)
    loss64, softmax = cross_entropy_oracle(x64, targets.cpu(), weights.cpu())
    grad64, = torch.autograd.grad(loss64, x64, grad_loss.cpu().double())
    loss_tolerance, grad_tolerance = ce_tolerances(targets.cpu(), weights.cpu(), softmax, logits.shape[1], block)
    grad_tolerance = grad_tolerance * grad_loss.cpu().double()[:, None]
    if logits.dtype == torch.bfloat16:
        grad_tolerance = grad_tolerance * (1 + 2 * U_BF16) + 2 * U_BF16 * (1 + U_BF16) * grad64.abs()
    assert loss.dtype == torch.float32 and grad.dtype == logits.dtype
    assert_within(loss.cpu(), loss64, loss_tolerance, "loss")
    assert_within(grad.cpu(), grad64, grad_tolerance, "logit gradient")
    reference, reference_next = kernels.softcap_cross_entropy_reference(logits, targets, weights)
    assert_within(loss, reference, 2 * loss_tolerance, "loss vs reference")
    first_only = torch.tensor([1.0] + [0.0] * (targets.shape[1] - 1))
    next64, _ = cross_entropy_oracle(logits.cpu().double(), targets.cpu(), first_only)
    next_tolerance, _ = ce_tolerances(targets.cpu(), first_only, softmax, logits.shape[1], block)
    assert_within(next_loss.cpu(), next64, next_tolerance, "next-token loss")
    assert_within(reference_next, next64, next_tolerance, "reference next-token loss")
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(ce(logits, targets, weights), (loss, next_loss)))


@interpreted
@pytest.mark.parametrize("rows,columns,num_targets,dtype", [
    (24, 300, 3, torch.float32), (17, 257, 1, torch.float32), (9, 333, 4, torch.bfloat16)])
def test_cross_entropy_matches_float64(rows, columns, num_targets, dtype):
    """Absent, out-of-range and duplicate targets, a non-uniform upstream gradient, C not a
    multiple of the column block."""
    ce = functools.partial(kernels.softcap_cross_entropy, config=SMALL_CE, scale_config=SMALL_CE)
    _check_cross_entropy(ce, SMALL_CE.block_n, *_cross_entropy_inputs(rows, columns, num_targets, columns, dtype))


@interpreted
def test_cross_entropy_full_vocabulary_width():
    """The production column blocks on all 50,304 columns (3 rows)."""
    _check_cross_entropy(kernels.softcap_cross_entropy, kernels.CROSS_ENTROPY.block_n,
                         *_cross_entropy_inputs(3, 50304, 2, 8, torch.float32))


@pytest.mark.parametrize("rows,columns,num_targets,dtype,block_rows", [
    (24, 300, 3, torch.float32, 5), (17, 257, 1, torch.float32, 64), (9, 333, 4, torch.bfloat16, 4)])
def test_chunked_cross_entropy_matches_float64(rows, columns, num_targets, dtype, block_rows):
    """The CPU path, with row blocks that do not divide the rows: the same oracle and bounds as
    the Triton kernel, with torch's row sums bounded as sequential ones (block 1)."""
    ce = functools.partial(kernels.softcap_cross_entropy_chunked, rows=block_rows)
    _check_cross_entropy(ce, 1, *_cross_entropy_inputs(rows, columns, num_targets, columns + 1, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_with_an_announced_upstream_gradient(dtype):
    """The CPU path's grad_scale: with the announced upstream gradient on every row (the mean
    over 24 tokens of one of 2 micro-batches, 1/48) the backward's result is the gradient the
    forward stored; a non-uniform one stays within the float64 oracle's bounds."""
    logits, targets, weights, grad_loss = _cross_entropy_inputs(24, 300, 3, 21, dtype)
    ce = functools.partial(kernels.softcap_cross_entropy_chunked, rows=5, grad_scale=1 / 48)
    _check_cross_entropy(ce, 1, logits, targets, weights, grad_loss)
    _check_cross_entropy(ce, 1, logits, targets, weights, torch.full((24,), 1 / 48))
    x = logits.clone().requires_grad_(True)
    loss = ce(x, targets, weights)[0]
    (stored,) = loss.grad_fn.saved_tensors
    (loss.mean() / 2).backward()
    assert torch.equal(x.grad, stored)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_with_an_announced_upstream_gradient(dtype):
    """grad_scale: the forward stores the gradient times the announced upstream gradient. The
    trainer's (the mean over 24 tokens of one of 2 micro-batches: 1/48 for every row) leaves the
    stored gradient as the backward's result, bitwise; any other upstream gradient (non-uniform)
    stays within the float64 oracle's bounds."""
    logits, targets, weights, grad_loss = _cross_entropy_inputs(24, 300, 3, 21, dtype)
    ce = functools.partial(kernels.softcap_cross_entropy, config=SMALL_CE, scale_config=SMALL_CE, grad_scale=1 / 48)
    _check_cross_entropy(ce, SMALL_CE.block_n, logits, targets, weights, grad_loss)
    _check_cross_entropy(ce, SMALL_CE.block_n, logits, targets, weights, torch.full((24,), 1 / 48))
    x = logits.clone().requires_grad_(True)
    (ce(x, targets, weights)[0].mean() / 2).backward()
    on_device = logits.clone().requires_grad_(True)   # the trainer's loss unit: a tensor, read by the kernel
    (ce(on_device, targets, weights, grad_scale=torch.tensor([1 / 48]))[0].mean() / 2).backward()
    assert torch.equal(on_device.grad, x.grad)
    _, _, stored = kernels._softcap_ce_op(logits, targets, weights.float(), True, torch.tensor([1 / 48]),
                                          SMALL_CE.as_list())
    assert torch.equal(x.grad, stored)


@interpreted
def test_cross_entropy_backward_scales_its_gradient_in_place_once():
    """The backward returns the saved gradient, scaled in place: a second backward through the
    same forward is refused by autograd's version check instead of scaling it twice."""
    logits, targets, weights, _ = _cross_entropy_inputs(6, 100, 2, 22, torch.float32)
    x = logits.clone().requires_grad_(True)
    loss, _ = kernels.softcap_cross_entropy(x, targets, weights, config=SMALL_CE, scale_config=SMALL_CE)
    loss.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.sum().backward()


def _backward_graph_ops(exact_upstream, logits, targets, weights):
    """The ops of the backward graph torch.compile (AOTAutograd) builds for the trainer's use of
    the cross-entropy: the mean over 24 tokens of one of 2 micro-batches (upstream 1/48)."""
    from functorch.compile import aot_function, make_boxed_func
    graphs = []

    def keep(graph, example_inputs):
        graphs.append(graph)
        return make_boxed_func(graph.forward)

    def step(x, targets, weights):
        loss = kernels.softcap_cross_entropy(x, targets, weights, config=SMALL_CE, scale_config=SMALL_CE,
                                             grad_scale=1 / 48, exact_upstream=exact_upstream)[0]
        return loss.mean() / 2
    compiled = aot_function(step, fw_compiler=lambda graph, inputs: make_boxed_func(graph.forward), bw_compiler=keep)
    x = logits.clone().requires_grad_(True)
    compiled(x, targets, weights).backward()
    (graph,) = graphs
    return [str(node.target) for node in graph.graph.nodes if node.op == "call_function"], x.grad


@interpreted
def test_an_exact_upstream_hands_the_stored_gradient_on_with_no_op_even_compiled():
    """With exact_upstream (the trainer's objective), the compiled backward is the stored
    gradient itself: no scaling kernel and no copy of the (N, C) buffer; without it, the graph
    scales a copy. Both give the stored gradient, bitwise, for the announced upstream."""
    logits, targets, weights, _ = _cross_entropy_inputs(24, 300, 3, 24, torch.bfloat16)
    _, _, stored = kernels._softcap_ce_op(logits, targets, weights.float(), True, torch.tensor([1 / 48]),
                                          SMALL_CE.as_list())
    exact_ops, exact_grad = _backward_graph_ops(True, logits, targets, weights)
    writes = ("scale_rows", "auto_functionalized", "copy", "clone")   # an in-place op made functional: a copy
    assert not [op for op in exact_ops if any(w in op for w in writes)], exact_ops
    assert torch.equal(exact_grad, stored)
    checked_ops, checked_grad = _backward_graph_ops(False, logits, targets, weights)
    assert any("auto_functionalized" in op for op in checked_ops), checked_ops
    assert torch.equal(checked_grad, stored)


@interpreted
def test_transpose_copies_every_tile_including_the_edges():
    x = torch.arange(37 * 70, dtype=torch.float32).reshape(37, 70).to(E5M2)
    y = kernels.transpose(x, kernels.LaunchConfig(block_m=16, block_n=32))
    assert y.shape == (70, 37) and torch.equal(y.float(), x.float().t())


@interpreted
def test_fp8_head_cross_entropy_writes_the_logit_gradient_once_in_e5m2():
    """The FP8 head and the cross-entropy in one, for the objective's own upstream gradient (the
    mean over 24 tokens of one of 2 micro-batches, 1/48): the losses are the plain kernel's on the
    same FP8 logits, bitwise; the saved e5m2 gradient and its transpose are the cross-entropy
    kernel's fp32 gradient quantized by the torch quantizer at the head's static scale, bitwise,
    and the state records its amax; the input and weight gradients match the float64 gradient
    of the head within the e5m2 rounding of the logit gradient (2^-3 relative, or half its
    smallest subnormal) and the fp32 and bf16 roundings of the GEMMs."""
    generator = torch.Generator().manual_seed(31)
    N, D, C = 24, 32, 150
    x = (torch.randn(N, D, generator=generator) * 3).bfloat16()
    weight = torch.randn(C, D, generator=generator) * 0.4
    _, targets, weights, _ = _cross_entropy_inputs(N, C, 3, 32, torch.float32)
    states = [kernels.new_fp8_linear_state(), kernels.new_fp8_linear_state()]
    for state in states:
        kernels.set_fp8_loss_unit(state, 1 / 48)
    logits = kernels.fp8_linear(x, weight, states[0], SMALL_MATMUL, scales=kernels.HEAD_SCALES)
    loss, next_loss = kernels.softcap_cross_entropy(logits, targets, weights, SMALL_CE, grad_scale=1 / 48,
                                                    exact_upstream=True)
    xs, ws = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused, fused_next = kernels.fp8_head_cross_entropy(xs, ws, states[1], targets, weights, 1 / 48,
                                                       SMALL_MATMUL, SMALL_CE)
    assert torch.equal(fused, loss) and torch.equal(fused_next, next_loss)

    _, w8_t, _, w_scale, g8, g8_t, g_scale = fused.grad_fn.saved_tensors
    _, _, g32 = kernels._softcap_ce_op(logits.float(), targets, weights, True, torch.tensor([1 / 48]),
                                       SMALL_CE.as_list())
    amax = torch.zeros(1)
    assert g_scale == torch.tensor(0.75 / kernels.FP8_E4M3_MAX) * torch.tensor(1 / 48)   # static, times the loss unit
    assert torch.equal(g8.float(), kernels._quantize_reference(g32, g_scale, amax, E5M2).float())
    assert torch.equal(g8_t.float(), g8.float().t())
    slot = kernels.FP8_LINEAR_SLOTS["grad_output"]
    assert states[1][slot] == amax[0] == g32.abs().max()
    assert torch.equal(states[1][:slot], states[0][:slot])

    (fused.mean() / 2).backward()
    w8 = w8_t.double().t() * w_scale.double()              # the head's weight as the GEMMs read it
    z = logits.double().requires_grad_(True)
    ref, _ = kernels.softcap_cross_entropy_reference(z, targets, weights)
    G, = torch.autograd.grad(ref.mean() / 2, z)
    G_bound = 2.0 ** -3 * G.abs() + 2.0 ** -17 * g_scale.double()
    x8 = kernels._quantize_reference(x.float(), kernels.HEAD_SCALES.input.scale * torch.ones(1), torch.zeros(1),
                                     E4M3).double() * kernels.HEAD_SCALES.input.scale
    for name, got, g, g_bound, operand in (("grad_x", xs.grad, G, G_bound, w8),
                                           ("grad_w", ws.grad, G.t(), G_bound.t(), x8)):
        want, bound = g @ operand, g_bound @ operand.abs()
        fp32 = fp32_sum_bound(g.abs() + g_bound, operand, max(C, N) + 2)
        assert_within(got, want, bound + fp32 + 2 * U_BF16 * (want.abs() + bound), name)


@interpreted
def test_scale_rows_scales_in_place_and_skips_unit_factors():
    """x[r] *= factor[r] in place, in fp32 then rounded to x's dtype (bitwise against torch);
    rows with factor 1 keep their values; C not a multiple of the column block."""
    generator = torch.Generator().manual_seed(23)
    x = torch.randn(5, 300, generator=generator).bfloat16()
    factor = torch.tensor([1.0, 0.37, 1.0, 3.0, -2.0])
    y = x.clone()
    kernels._scale_rows_op(y, factor, SMALL_CE.as_list())
    assert torch.equal(y, (x.float() * factor[:, None]).bfloat16())
    assert torch.equal(y[[0, 2]], x[[0, 2]]) and not torch.equal(y[1], x[1])


def test_cross_entropy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="one weight per target"):
        kernels.softcap_cross_entropy(torch.zeros(4, 10), torch.zeros(4, 2, dtype=torch.long), torch.ones(3))
    with pytest.raises(ValueError, match="grad_scale must be a nonzero finite number"):
        kernels.softcap_cross_entropy(torch.zeros(4, 10), torch.zeros(4, 2, dtype=torch.long), torch.ones(2),
                                      grad_scale=0.0)


# ---------------------------------------------------------------------------------------------
# X X^T
# ---------------------------------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_xxt_matches_float64_and_is_symmetric(dtype):
    """Batched (2, 3, m, n) with m not a multiple of the tile, a transposed (strided) input,
    and a batch whose sizes are multiples of the blocks (the unmasked path). FP32 bound over n
    terms; bf16 / fp16 outputs add one rounding (2^-8 / 2^-11 relative). The mirrored output is
    exactly symmetric."""
    generator = torch.Generator().manual_seed(9)
    unit_roundoff = {torch.float32: 0.0, torch.bfloat16: U_BF16, torch.float16: 2.0 ** -11}[dtype]
    for x in (torch.randn(2, 3, 40, 70, generator=generator).to(dtype),
              torch.randn(45, 36, generator=generator).to(dtype).mT,
              torch.randn(3, 32, 64, generator=generator).to(dtype)):
        out = kernels.xxt(x, config=SMALL_XXT)
        exact = x.double() @ x.double().mT
        bound = fp32_sum_bound(x, x.mT, x.shape[-1]) * (1 + unit_roundoff) + unit_roundoff * exact.abs()
        assert out.dtype == dtype and out.shape == exact.shape
        assert_within(out, exact, bound, "xxt")
        assert torch.equal(out, out.mT)
        assert_within(kernels.xxt_reference(x), exact, bound, "xxt_reference")


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_xxt_with_beta_is_b_a_plus_c_a_squared(dtype):
    """xxt(A, alpha=c, beta=b) = b A + c A A^T for symmetric A (a Gram matrix, as Newton-Schulz
    feeds it): m not a multiple of the tile and a multiple of it (the unmasked path), a batch, and
    an anvil step's coefficients. The fp32 sum bound times |c|, a few fp32 roundings of the
    epilogue's two terms, and one output rounding; the result is exactly symmetric."""
    generator = torch.Generator().manual_seed(11)
    b, c = -6.095026865488, 3.905234618423
    unit_roundoff = {torch.float32: 0.0, torch.bfloat16: U_BF16}[dtype]
    for shape in ((2, 40, 56), (32, 64)):
        x = torch.randn(*shape, generator=generator)
        a = (x @ x.mT / shape[-1]).to(dtype)           # symmetric, exactly representable in dtype
        out = kernels.xxt(a, config=SMALL_XXT, alpha=c, beta=b)
        a64 = a.double()
        exact = c * (a64 @ a64.mT) + b * a64
        magnitude = abs(c) * (a64.abs() @ a64.abs().mT) + abs(b) * a64.abs()
        bound = (abs(c) * fp32_sum_bound(a, a.mT, a.shape[-1]) + 4 * U32 * magnitude) * (1 + unit_roundoff) \
            + unit_roundoff * exact.abs()
        assert out.dtype == dtype and out.shape == exact.shape
        assert_within(out, exact, bound, "xxt(alpha, beta)")
        assert torch.equal(out, out.mT)
        assert_within(kernels.xxt_reference(a, alpha=c, beta=b), exact, bound, "xxt_reference(alpha, beta)")
    with pytest.raises(ValueError, match="square"):
        kernels.xxt(torch.randn(8, 12), config=SMALL_XXT, beta=1.0)


# ---------------------------------------------------------------------------------------------
# torch.library registration and torch.compile
# ---------------------------------------------------------------------------------------------

@interpreted
def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementations and dispatch of every custom op (torch.library.opcheck)."""
    generator = torch.Generator().manual_seed(10)
    a, b = _fp8_operands(20, 32, 24, E4M3, E4M3, True, generator)
    one, config = torch.ones(1), SMALL_MATMUL.as_list()
    q, k, v, grad_o, _ = _attention_inputs(24, 1, 16, 16, seed=10)
    cu_seqlens = torch.tensor([0, 10, 24], dtype=torch.int32)
    attention_configs = [value for c in SMALL_ATTENTION for value in c.as_list()]
    doc_start, doc_end = kernels.document_bounds(cu_seqlens, 24)
    scale = torch.tensor([0.25])
    o, lse = kernels._attn_fwd_op(q, k, v, doc_start, doc_end, scale, 5, attention_configs)
    logits, targets, weights, grad_loss = _cross_entropy_inputs(4, 50, 2, 10, torch.float32)
    cases = [
        (kernels._fp8_matmul_op, (a, b, one, one, torch.bfloat16, config, True)),
        (kernels._fp8_matmul_op, (a, b, one, one, torch.bfloat16, config, False)),
        (kernels._fp8_cast_op, (torch.randn(20, 24), one, torch.zeros(1), E4M3, SMALL_CAST.as_list())),
        (kernels._fp8_matmul_quant_op, (a, b, one, one, a, one, one, torch.zeros(1), E4M3, "relu2", config)),
        (kernels._attn_fwd_op, (q, k, v, doc_start, doc_end, scale, 5, attention_configs)),
        (kernels._attn_bwd_op, (grad_o, q, k, v, o, lse, doc_start, doc_end, scale, 5, attention_configs)),
        (kernels._softcap_ce_op, (logits, targets, weights, True, torch.tensor([0.125]), SMALL_CE.as_list())),
        (kernels._softcap_ce_op, (logits, targets, weights, False, torch.ones(1), SMALL_CE.as_list())),
        (kernels._scale_rows_op, (logits.clone(), grad_loss, SMALL_CE.as_list())),
        (kernels._xxt_op, (torch.randn(2, 20, 24), SMALL_XXT.as_list())),
        (kernels._xxt_op, (torch.randn(2, 20, 20), SMALL_XXT.as_list(), 2.0, -0.5)),
        (kernels._transpose_op, (torch.randn(20, 24), SMALL_CAST.as_list())),
        (kernels._fp8_cast_weights_op, ([torch.randn(20, 24), torch.randn(20, 24)],
                                        [kernels.new_fp8_mlp_state(), kernels.new_fp8_mlp_state()],
                                        kernels.FP8_MLP_SLOTS["up_weight"], kernels.FP8_MLP_SLOTS["calls"],
                                        kernels._rule_code(kernels.WEIGHT_LAG), SMALL_CAST.as_list())),
        (kernels._ema_update_op, (torch.randn(4, 40), torch.randn(4, 40).bfloat16(), 0.1,
                                  kernels.LaunchConfig(block_m=64, block_n=0).as_list())),
    ]
    _, values, groups = _row_batch(32, 20, 12, torch.float32, seed=10)
    table, moment, last, log_decay_at, row_step = _row_adam_state(32, 12, torch.float32, seed=10)
    cases += [
        (kernels._sum_rows_op, (values, groups.order, groups.starts, 0.5, torch.bfloat16, SMALL_SUM_ROWS.as_list())),
        (kernels._add_row_sums_op, (torch.zeros(32, 12), groups.distinct.clamp_min(0), values, groups.order,
                                    groups.starts, SMALL_SUM_ROWS.as_list())),
        (kernels._sparse_adam_rows_op, (table, kernels.sum_rows_reference(values, groups), groups.distinct,
                                        groups.count, moment, last, log_decay_at, *dataclasses.astuple(row_step),
                                        kernels.SPARSE_ADAM.as_list())),
    ]
    (q, k, v, mix_in, mix_out), grad_c, cu_composed = _composed_inputs(24, 2, 16, 16, seed=10)
    start = kernels.document_bounds(cu_composed, 24)[0]
    c, mixed, c_lse = kernels._dc_fwd_op(q, k, v, mix_in, mix_out, start, scale, 9, SMALL_COMPOSED)
    cases += [
        (kernels._dc_fwd_op, (q, k, v, mix_in, mix_out, start, scale, 9, SMALL_COMPOSED)),
        (kernels._dc_bwd_op, (grad_c, q, k, v, mix_in, mix_out, start, scale, mixed, c_lse, 9, SMALL_COMPOSED)),
    ]
    fp8_operand_ops = (kernels._fp8_matmul_op, kernels._fp8_matmul_quant_op)
    for op, args in cases:
        # opcheck's schema test does arithmetic on the inputs, which CPU torch lacks for fp8
        # operands; those two ops mutate nothing, and their fake implementations are checked.
        checks = ("test_faketensor",) if op in fp8_operand_ops else ("test_schema", "test_faketensor")
        torch.library.opcheck(op, args, test_utils=checks)


@interpreted
def test_wrappers_compile_with_fullgraph():
    """torch.compile(fullgraph=True) traces every wrapper (aot_eager: the kernels stay opaque
    custom ops) and the compiled step gives the eager results and amax buffers bitwise."""
    generator = torch.Generator().manual_seed(11)
    x = grid_values(24, 32, generator=generator, limit=4, dtype=torch.bfloat16)
    w_qkv = _grid_weight(3 * 32, 32, generator, torch.float32)
    w_up, w_down = _grid_weight(64, 32, generator, torch.float32), _grid_weight(32, 64, generator, torch.float32)
    w_head = _grid_weight(40, 32, generator, torch.float32)
    targets = torch.randint(0, 40, (24, 2), generator=generator)
    cu_seqlens = torch.tensor([0, 9, 24, 24], dtype=torch.int32)

    angles = torch.outer(torch.arange(24.0), torch.cat([torch.ones(4) / 8, torch.zeros(4)]))
    stationary, doc_start = torch.arange(16) % 8 >= 4, torch.zeros(24, dtype=torch.bool)
    doc_start[[0, 9]] = True

    def step(x, w_qkv, w_up, w_down, w_head, linear_state, mlp_state):
        qkv = kernels.fp8_linear(x, w_qkv, linear_state[0], scales=kernels.QKV_SCALES).view(24, 3, 2, 16)
        q, k = kernels.qk_norm_rope(qkv[:, 0], qkv[:, 1], angles.cos(), angles.sin(), stationary, doc_start,
                                    kernels.LaunchConfig(block_m=8, block_n=0))
        h = kernels.flash_attn_varlen(q, k, qkv[:, 2], cu_seqlens, 6, 0.25, SMALL_ATTENTION).reshape(24, 32)
        h = h + kernels.fp8_relu2_mlp(h, w_up, w_down, mlp_state, SMALL_MATMUL, kernels.MLP_SCALES_RECORD92)
        logits = kernels.fp8_linear(h, w_head, linear_state[1], SMALL_MATMUL, kernels.HEAD_SCALES)
        loss = kernels.softcap_cross_entropy(logits, targets, torch.tensor([1.0, 0.5]), SMALL_CE, SMALL_CE)[0].mean()
        return loss + kernels.xxt(w_up.detach(), SMALL_XXT).float().mean()

    results = []
    for run in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        params = [t.clone().requires_grad_(True) for t in (w_qkv, w_up, w_down, w_head)]
        linear_state = torch.stack([kernels.new_fp8_linear_state(), kernels.new_fp8_linear_state()])
        mlp_state = kernels.new_fp8_mlp_state()
        loss = run(x, *params, linear_state, mlp_state)
        grads = torch.autograd.grad(loss, params)
        results.append([loss.detach(), *grads, linear_state, mlp_state])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


# ---------------------------------------------------------------------------------------------
# QK norm + RoPE
# ---------------------------------------------------------------------------------------------

def qk_norm_rope_oracle(x, cos, sin, stationary, doc_start, eps):
    """float64 statement of one of q, k: each row x / sqrt(mean(x^2) + eps), its halves rotated
    by the row's angles; with doc_start, a row's stationary dims from the previous row unless it
    starts a document."""
    x = x.double()
    z = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    z1, z2 = z.chunk(2, dim=-1)
    y = torch.cat([z1 * c + z2 * s, z2 * c - z1 * s], dim=-1)
    if doc_start is not None:
        for t in range(1, y.shape[0]):
            if not doc_start[t]:
                y[t, :, stationary] = z[t - 1][:, stationary]
    return y


def _qk_inputs(T, H, D, dtype, seed):
    """q and k as strided views of a packed (T, H * (2D + D)) projection, the angle tables of
    positions 5..T+4 with the second quarter of the dims stationary, and documents at 0, 9, 20."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, 3 * H * D, generator=generator) * 3).to(dtype)
    q, k = qkv[:, :H * D].view(T, H, D), qkv[:, H * D:2 * H * D].view(T, H, D)
    freq = torch.cat([(1 / 64) ** torch.linspace(0, 1, D // 4), torch.zeros(D // 4)])
    angles = torch.outer(torch.arange(5, T + 5, dtype=torch.float32), freq)
    doc_start = torch.zeros(T, dtype=torch.bool)
    doc_start[[0, 9, 20]] = True
    grads = [torch.randn(T, H, D, generator=generator).to(dtype) for _ in range(2)]
    return q, k, angles.cos(), angles.sin(), (freq == 0).repeat(2), doc_start, grads


@interpreted
@pytest.mark.parametrize("dtype,offset", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_qk_norm_rope_matches_float64(dtype, offset):
    """FP32 (BF16): forward and backward of the Triton kernel and of the torch reference against
    the float64 statement (autograd of it for the gradients). Each output is a handful of fp32
    operations on normalized values of order 1 (the norm's sum of D squares, the rotation's two
    products): 2D * 2^-24 bounds their error relative to the row's scale; bf16 adds one rounding
    of the output (2^-8). The bf16 reference normalizes in fp32 (F.rms_norm of a bf16 input, with
    fp32's eps) and rounds the normed values, then rotates in bf16 ops: with cos and sin rounded
    and each product rounded, an output z1 c + z2 s carries 3 * 2^-8 (|z1 c| + |z2 s|) + 2^-8 |y|
    <= 4 * 2^-8 * sqrt(z1^2 + z2^2). In a normed row (mean square 1) that root, and each |z|, is at
    most sqrt(D) = 4: the factor 4 of the bounds."""
    _check_qk_norm_rope(30, 2, 16, dtype, offset, "cpu", kernels.LaunchConfig(block_m=8, block_n=0))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_paired_is_the_interleaved_rotation_in_the_records_layout(dtype):
    """paired=True (head h of token t turned at position 2t + h % 2, written in place) against
    the copies it replaces: the heads interleaved into the doubled sequence, rotated there, and
    moved back to (T, heads, D), whose (2T, heads/2, D) view is the records' layout. Kernel and
    reference, on strided q and k as the QKV split gives them: outputs and input gradients bit
    for bit. The key offset is refused on paired heads."""
    T, H, D = 12, 4, 16
    generator = torch.Generator().manual_seed(23)
    packed = torch.randn(T, 3 * H, D, generator=generator).to(dtype)
    q, k = packed[:, :H], packed[:, H:2 * H]
    angles = torch.outer(torch.arange(2 * T, dtype=torch.float32), torch.rand(D // 2, generator=generator))
    cos, sin, stationary = angles.cos(), angles.sin(), torch.zeros(D, dtype=torch.bool)
    grads = [torch.randn(T, H, D, generator=generator).to(dtype) for _ in range(2)]

    def interleave(x):             # (T, H, D) -> (2T, H/2, D): head h of token t at row 2t + h % 2
        return x.reshape(T, H // 2, 2, D).transpose(1, 2).reshape(2 * T, H // 2, D)

    def deinterleave(y):
        return y.reshape(T, 2, H // 2, D).transpose(1, 2).reshape(T, H, D)

    config = kernels.LaunchConfig(block_m=8, block_n=0)
    for fn in (kernels.qk_norm_rope, kernels.qk_norm_rope_reference):
        paired_in = [t.detach().clone().requires_grad_(True) for t in (q, k)]
        copied_in = [t.detach().clone().requires_grad_(True) for t in (q, k)]
        paired = fn(*paired_in, cos, sin, stationary, None, config, paired=True)
        copied = [deinterleave(t) for t in fn(*(interleave(t) for t in copied_in), cos, sin, stationary, None, config)]
        for got, want in zip(paired, copied):
            assert got.shape == (T, H, D) and got.is_contiguous() and _bits_equal(got.detach(), want.detach())
        for got, want in zip(torch.autograd.grad(paired, paired_in, grads),
                             torch.autograd.grad(copied, copied_in, grads)):
            assert _bits_equal(got, want), fn.__name__
        with pytest.raises(ValueError, match="paired"):
            fn(q, k, cos, sin, stationary, torch.ones(T, dtype=torch.bool), config, paired=True)


@interpreted
@pytest.mark.parametrize("offset,paired,v_dim", [(True, False, 16), (False, True, 32), (False, False, 16)],
                         ids=["key-offset", "paired", "plain"])
def test_fp8_qkv_norm_rope_is_the_projection_then_the_rotation_bit_for_bit(offset, paired, v_dim):
    """fp8_qkv_norm_rope against what it fuses: fp8_linear, the split, then qk_norm_rope (the
    Triton kernels, with the cast kernel and with casts="fused"). q, k, v, the gradients of x and
    of the weight, and the FP8 state bit for bit over two calls (the first at the uncalibrated
    gradient scale, the second at the delayed one the first recorded): with the key offset, with
    paired heads (their value width twice the head dim), plain. The composition itself is held to
    float64 by the fp8_linear and qk_norm_rope tests. A gradient rule that reads the gradient is
    refused."""
    T, H, D, K = 24, 2, 16, 32
    generator = torch.Generator().manual_seed(31)
    x = torch.randn(T, K, generator=generator).bfloat16()
    weight = torch.randn(H * (2 * D + v_dim), K, generator=generator) * 0.1
    freq = torch.cat([(1 / 64) ** torch.linspace(0, 1, D // 4), torch.zeros(D // 4)])
    angles = torch.outer(torch.arange(2 * T if paired else T, dtype=torch.float32), freq)
    cos, sin, stationary = angles.cos(), angles.sin(), (freq == 0).repeat(2)
    doc_start = torch.zeros(T, dtype=torch.bool)
    doc_start[[0, 9, 20]] = True
    key_starts = doc_start if offset else None
    grads = [torch.randn(T, H, d, generator=generator).bfloat16() for d in (D, D, v_dim)]
    rope = kernels.LaunchConfig(block_m=8, block_n=0)

    def fused(x, weight, state, casts):
        return kernels.fp8_qkv_norm_rope(x, weight, state, H, D, cos, sin, stationary, key_starts, paired=paired,
                                         config=SMALL_MATMUL, casts=casts, rope_config=rope)

    def composed(x, weight, state, casts):
        qkv = kernels.fp8_linear(x, weight, state, SMALL_MATMUL, casts=casts)
        q, k, v = (t.view(T, H, -1) for t in qkv.split([H * D, H * D, H * v_dim], dim=-1))
        return (*kernels.qk_norm_rope(q, k, cos, sin, stationary, key_starts, rope, paired=paired), v)
    for casts in kernels.FP8_CASTS:
        states = {fn: kernels.new_fp8_linear_state() for fn in (fused, composed)}
        for _ in range(2):
            results = {}
            for fn, state in states.items():
                leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight)]
                out = fn(*leaves, state, casts)
                results[fn] = [t.detach() for t in out] + list(torch.autograd.grad(out, leaves, grads))
            for got, want in zip(results[fused], results[composed]):
                assert _bits_equal(got, want), casts
            assert torch.equal(states[fused], states[composed])
    assert states[fused][kernels.FP8_LINEAR_SLOTS["grad_output"]] > 0
    with pytest.raises(ValueError, match="Static or Delayed"):
        kernels.fp8_qkv_norm_rope(x, weight, kernels.new_fp8_linear_state(), H, D, cos, sin, stationary,
                                  scales=kernels.FP8LinearScales(grad_output=kernels.EXACT))


def _check_qk_norm_rope(T, H, D, dtype, offset, device, config):
    """test_qk_norm_rope_matches_float64's check: the kernel (on `device`, with `config`) and the
    reference (on the CPU) against the float64 statement."""
    q, k, cos, sin, stationary, doc_start, (grad_q, grad_k) = _qk_inputs(T, H, D, dtype, seed=21)
    key_starts = doc_start if offset else None
    leaves = [q.detach().double().requires_grad_(True), k.detach().double().requires_grad_(True)]
    eps = 2.0 ** -23               # fp32's machine epsilon: F.rms_norm's default for fp32 and bf16 inputs
    want_q = qk_norm_rope_oracle(leaves[0], cos, sin, stationary, None, eps)
    want_k = qk_norm_rope_oracle(leaves[1], cos, sin, stationary, key_starts, eps)
    want_grads = torch.autograd.grad([want_q, want_k], leaves, [grad_q.double(), grad_k.double()])
    for fn, where, fn_config in ((kernels.qk_norm_rope, device, config), (kernels.qk_norm_rope_reference, "cpu", None)):
        inputs = [t.detach().clone().to(where).requires_grad_(True) for t in (q, k)]
        extra = [t.to(where) if t is not None else None for t in (cos, sin, stationary, key_starts)]
        got_q, got_k = fn(*inputs, *extra, fn_config)
        assert got_q.dtype == got_k.dtype == dtype and got_q.is_contiguous() and got_k.is_contiguous()
        got_grads = [g.cpu() for g in torch.autograd.grad([got_q, got_k], inputs, [grad_q.to(where), grad_k.to(where)])]
        got_q, got_k = got_q.detach().cpu(), got_k.detach().cpu()
        roundings = 0 if dtype == torch.float32 else 4 if fn is kernels.qk_norm_rope_reference else 1
        unit = 2 * D * U32 + roundings * U_BF16
        for name, got, want in (("q", got_q, want_q), ("k", got_k, want_k)):
            assert_within(got, want.detach(), unit * 4, f"{fn.__name__} {name}")
        for name, got, want, x in (("dq", got_grads[0], want_grads[0], q), ("dk", got_grads[1], want_grads[1], k)):
            # dx = rstd (dz - z mean(dz z)): errors of order unit x |dz| x rstd, |dz| <= 2 |dy| (the offset adds rows)
            rstd = 1 / x.double().square().mean(-1, keepdim=True).sqrt()
            bound = unit * 8 * rstd * (grad_q.double().abs().amax() + grad_k.double().abs().amax())
            assert_within(got, want, bound, f"{fn.__name__} {name}")


# ---------------------------------------------------------------------------------------------
# Sparse rows
# ---------------------------------------------------------------------------------------------

SMALL_SUM_ROWS = kernels.LaunchConfig(block_m=1, block_n=16)


def _row_batch(num_rows, n, d, dtype, seed):
    """n gradient entries of width d for rows drawn from the first half of a num_rows table
    (repeats, and rows never touched), and their RowGroups."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, num_rows // 2, (n,), generator=generator)
    values = (torch.randn(n, d, generator=generator) * 2).to(dtype)
    return rows, values, kernels.distinct_rows(rows)


def test_distinct_rows_are_unique_rows_at_fixed_capacity():
    rows, _, groups = _row_batch(64, 50, 4, torch.float32, seed=30)
    unique, inverse = torch.unique(rows, return_inverse=True)
    count = int(groups.count)
    assert count == unique.numel() < rows.numel()
    assert torch.equal(groups.distinct[:count], unique) and (groups.distinct[count:] == -1).all()
    assert torch.equal(groups.inverse, inverse) and torch.equal(groups.distinct[groups.inverse], rows)
    assert torch.equal(rows[groups.order], rows.sort().values)
    for s in range(rows.numel()):  # slot s's entries, in position order; none past the count
        entries = groups.order[groups.starts[s]:groups.starts[s + 1]]
        assert torch.equal(entries, (rows == unique[s]).nonzero().flatten() if s < count else entries[:0])


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_rows_matches_float64(dtype):
    """FP32: a slot's sum of k entries is within k * 2^-24 * sum|entries| of float64; kernel and
    reference both add in token order in fp32, so they agree bitwise. D = 40 spans three column
    blocks of 16, the last one masked."""
    _check_sum_rows(64, 50, 40, dtype, "cpu", SMALL_SUM_ROWS)


@interpreted
def test_sum_rows_scales_and_rounds_once_into_the_asked_dtype():
    """With scale 1/3 and a bf16 output (the split n-gram table's gradients for their owners):
    each slot's fp32 sum times the fp32 scale, rounded to nearest bf16 once: the fp32 sums
    (checked against float64 above) scaled and cast by torch, to the same bits; the reference
    too."""
    _, values, groups = _row_batch(64, 50, 40, torch.bfloat16, seed=32)
    got = kernels.sum_rows(values, groups, SMALL_SUM_ROWS, scale=1 / 3, out_dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16 and (got[int(groups.count):] == 0).all()
    summed = kernels.sum_rows(values, groups, SMALL_SUM_ROWS)
    assert torch.equal(got, (summed * (1 / 3)).to(torch.bfloat16))
    assert torch.equal(got, kernels.sum_rows_reference(values, groups, scale=1 / 3, out_dtype=torch.bfloat16))
    assert not torch.equal(got.float(), summed / 3)      # rounded: bf16 holds fewer bits


def _check_sum_rows(num_rows, n, d, dtype, device, config):
    rows, values, groups = _row_batch(num_rows, n, d, dtype, seed=31)
    oracle = torch.zeros(n, d, dtype=torch.float64).index_add_(0, groups.inverse, values.double())
    repeats = torch.bincount(groups.inverse, minlength=n).double()[:, None]
    bound = repeats * U32 * torch.zeros_like(oracle).index_add_(0, groups.inverse, values.double().abs())
    on_device = kernels.RowGroups(**{f.name: getattr(groups, f.name).to(device) for f in dataclasses.fields(groups)})
    got = kernels.sum_rows(values.to(device), on_device, config).cpu()
    assert got.dtype == torch.float32 and (got[int(groups.count):] == 0).all()
    assert_within(got, oracle, bound, "sum_rows")
    assert torch.equal(got, kernels.sum_rows_reference(values, groups))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_row_sums_adds_each_slots_sum_into_its_target_row(dtype):
    """add_row_sums_ against float64: each distinct row's entries summed and added into an fp32
    accumulator that already holds values, at the row itself (a vocabulary table's sums) and at
    a slot handed to the row (a sparse table's): within the sum's bound plus one rounding of
    the addition; kernel and reference (sum_rows_reference, then index_add_) to the same bits.
    Rows no entry touched, and the targets of the slots past the count (-1, or a row that must
    not move), are left as they were: rows of -0.0, whose sign bits an added zero would flip,
    stand at that row and just below the sums (row -1)."""
    _check_add_row_sums(64, 50, 40, dtype, "cpu", SMALL_SUM_ROWS)


def _check_add_row_sums(num_rows, n, d, dtype, device, config):
    rows, values, groups = _row_batch(num_rows, n, d, dtype, seed=32)
    count = int(groups.count)
    slots = torch.randperm(num_rows - 1, generator=torch.Generator().manual_seed(33))[:n]   # distinct targets
    for targets, past_count in ((groups.distinct, -1), (slots, num_rows - 1)):
        targets = targets.clone()
        targets[count:] = past_count             # never read: -1 (a vocabulary table's) or a row that must stay
        start = torch.randn(num_rows, d, generator=torch.Generator().manual_seed(34))
        start[num_rows - 1] = -0.0              # adding zeros to it would flip its sign bits
        untouched = torch.ones(num_rows, dtype=torch.bool)
        untouched[targets[:count]] = False
        assert untouched[num_rows - 1]
        slot_sums = torch.zeros(n, d, dtype=torch.float64).index_add_(0, groups.inverse, values.double())
        oracle = start.double().index_add_(0, targets[:count], slot_sums[:count])
        repeats = torch.bincount(groups.inverse, minlength=n).double()[:, None]
        slot_bound = repeats * U32 * torch.zeros_like(slot_sums).index_add_(0, groups.inverse, values.double().abs())
        bound = torch.zeros_like(oracle).index_add_(0, targets[:count], slot_bound[:count]) + U32 * oracle.abs()
        on_device = kernels.RowGroups(**{f.name: getattr(groups, f.name).to(device)
                                         for f in dataclasses.fields(groups)})
        below = torch.full((1, d), -0.0, device=device)   # the row before the sums: where row -1 would be
        got = torch.cat([below, start.to(device)])[1:]
        kernels.add_row_sums_(got, targets.to(device), values.to(device), on_device, config)
        assert torch.equal(got._base[0].signbit().cpu(), torch.ones(d, dtype=torch.bool)), "a write to row -1"
        got = got.cpu()
        assert_within(got, oracle, bound, "add_row_sums_")
        assert torch.equal(got[untouched], start[untouched]) and got[num_rows - 1].signbit().all()
        want = start.clone()
        kernels.add_row_sums_reference_(want, targets, values, groups)
        assert torch.equal(got, want)


def _row_adam_state(num_rows, d, dtype, seed):
    """A table, per-row moments and last events (0 = never updated) after 5 events whose beta2
    moved from 0.95 to 0.9025, and event 6's scalars."""
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(num_rows, d, generator=generator).to(dtype)
    moment = torch.rand(num_rows, generator=generator) * 4
    last = torch.randint(0, 6, (num_rows,), generator=generator, dtype=torch.int32)
    moment[last == 0] = 0.0
    beta2s = [0.95, 0.95, 0.95, 0.9025, 0.9025, 0.9025]
    log_decay_at = torch.tensor([0.0] + list(itertools.accumulate(math.log(b) for b in beta2s)), dtype=torch.float64)
    step = kernels.RowAdamStep(event=6, log_decay=float(log_decay_at[6]), one_minus_beta2=1 - beta2s[-1],
                               bias=1 - math.exp(float(log_decay_at[6])), lr=0.05, decay=0.05 ** 2 * 4.0, eps=1e-10)
    return table, moment, last, log_decay_at, step


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_adam_rows_kernel_matches_reference_and_touches_only_its_rows(dtype):
    """The Triton update against the torch reference: rows outside the batch bitwise
    untouched, with their moments and last events; touched rows' moments within FP32 bounds
    (the mean of D squares summed in another order: D * 2^-24 relative, plus the catch-up's
    exp) and their weights within lr times that relative error of the update (bf16: plus one
    rounding of the stored weight); every touched row's last event is the step's."""
    _check_sparse_adam_rows(64, 50, 24, dtype, "cpu")


def _check_sparse_adam_rows(num_rows, n, d, dtype, device):
    _, grads_in, groups = _row_batch(num_rows, n, d, torch.float32, seed=32)
    grads = kernels.sum_rows_reference(grads_in, groups)
    table, moment, last, log_decay_at, step = _row_adam_state(num_rows, d, dtype, seed=33)
    results = []
    for fn, where in ((kernels.sparse_adam_rows_, device), (kernels.sparse_adam_rows_reference_, "cpu")):
        t, m, l, g, decay = (x.clone().to(where) for x in (table, moment, last, grads, log_decay_at))
        fn(t, g, kernels.RowGroups(**{f.name: getattr(groups, f.name).to(where) for f in dataclasses.fields(groups)}),
           m, l, decay, step)
        results.append(tuple(x.cpu() for x in (t, m, l)))
    (t, m, l), (t_ref, m_ref, l_ref) = results
    touched = torch.zeros(num_rows, dtype=torch.bool)
    touched[groups.distinct[:int(groups.count)]] = True
    assert torch.equal(t[~touched], table[~touched]) and torch.equal(m[~touched], moment[~touched])
    assert torch.equal(l[~touched], last[~touched]) and (l[touched] == 6).all() and torch.equal(l, l_ref)
    assert_within(m, m_ref, 4 * d * U32 * m_ref, "moment")
    rounding = U_BF16 * table.double().abs() * 2 if dtype == torch.bfloat16 else 0
    assert_within(t, t_ref, 4 * d * U32 * step.lr * 10 + rounding, "table")
    assert not torch.equal(t[touched], table[touched])


# ---------------------------------------------------------------------------------------------
# The bench script's CPU dry mode
# ---------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------
# On a GPU (run by bench/first_contact.py on the H200; skipped elsewhere)
# ---------------------------------------------------------------------------------------------

# Hopper's fp8 tensor cores accumulate with about 14 significand bits (DeepSeek-V3 report) in
# their fast mode: the forward GEMMs sum all of K there, the backward GEMMs each BLOCK_K products
# before adding them into fp32. GPU tests that demand exact sums keep those sums within 13 bits.
FAST_ACCUMULATOR_BITS = 13


@needs_cuda
@on_gpu
def test_gpu_fp8_matmul_matches_oracle():
    """EXACT on the tensor cores with the production tiles, both layouts of b."""
    generator = torch.Generator().manual_seed(12)
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(2.0)
    for b_column_major in (True, False):
        a, b = _fp8_operands(1000, 256, 2304, E4M3, E4M3, b_column_major, generator, limit=2)
        expected = matmul_oracle(a, b, scale_a, scale_b, torch.float32, FAST_ACCUMULATOR_BITS)
        out = kernels.fp8_matmul(a.cuda(), b.cuda(), scale_a.cuda(), scale_b.cuda(), torch.float32)
        assert torch.equal(out.cpu(), expected)


@needs_cuda
@on_gpu
def test_gpu_fp8_large_tile_at_a_training_shape():
    """The tile every training-size forward GEMM runs (49,152 tokens x 768 -> 2,816: 2,112 tiles,
    which fp8_matmul_config gives FP8_MATMUL_LARGE), plain and relu2, EXACT."""
    assert kernels.fp8_matmul_config(49152, 2816, torch.device("cuda")) == kernels.FP8_MATMUL_LARGE
    _check_large_tile(49152, 768, 2816, "cuda")


@needs_cuda
@on_gpu
def test_gpu_kernel_families_match_their_references():
    """Each kernel family once on the GPU with its production launch config, by the CPU tests'
    checks: the FP8 cast (bitwise against torch's cast), QK norm + RoPE with the key offset,
    composed attention (bf16 criterion), the row sums and sparse Adam on a 768-wide table."""
    _check_fp8_cast((4096, 768), torch.bfloat16, E4M3, "cuda", kernels.FP8_CAST)
    _check_fp8_cast((4096, 768), torch.bfloat16, E5M2, "cuda", kernels.FP8_CAST)
    _check_qk_norm_rope(4096, 6, 128, torch.bfloat16, True, "cuda", kernels.QK_NORM_ROPE)
    _check_composed_bf16(1024, 6, 128, "cuda", kernels.COMPOSED_CONFIGS)
    _check_sum_rows(1 << 16, 20_000, 768, torch.bfloat16, "cuda", kernels.SUM_ROWS)
    _check_add_row_sums(1 << 16, 20_000, 768, torch.bfloat16, "cuda", kernels.SUM_ROWS)
    _check_sparse_adam_rows(1 << 14, 20_000, 768, torch.bfloat16, "cuda")


@needs_cuda
@on_gpu
def test_gpu_fused_casts_compiled_by_inductor_match_the_cast_kernel():
    """casts="fused" as a compiled model runs it: Inductor's code for the casts (forward and
    backward, two calls: exact, then delayed scales) gives the FP8 linear layer's outputs,
    gradients and state bit for bit as the cast kernel does, eagerly."""
    generator = torch.Generator().manual_seed(14)
    x = torch.randn(1024, 256, generator=generator).bfloat16().cuda()
    weight = (torch.randn(768, 256, generator=generator) * 0.05).cuda()
    grad_y = torch.randn(1024, 768, generator=generator).bfloat16().cuda()
    fused = torch.compile(functools.partial(kernels.fp8_linear, casts="fused"), backend="inductor", fullgraph=True)
    states = [kernels.new_fp8_linear_state("cuda") for _ in range(2)]
    for _ in range(2):
        got = _run_layer(lambda *args: fused(*args[:3]), [x, weight], states[0], grad_y, None)
        want = _run_layer(kernels.fp8_linear, [x, weight], states[1], grad_y, None)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert torch.equal(states[0], states[1])


@needs_cuda
@on_gpu
def test_gpu_fp8_layers_match_oracle():
    """fp8_linear EXACT against its oracle on CUDA (sums within FAST_ACCUMULATOR_BITS).
    fp8_relu2_mlp: its second GEMMs sum arbitrary e4m3 activations, which the fast accumulator
    rounds, and a rounded sum can move an intermediate fp8 value by one step (2^-4 relative for
    e4m3, 2^-3 for e5m2); the output and gradients must stay within 2^-4 of the oracle in
    relative Frobenius norm."""
    generator = torch.Generator().manual_seed(13)
    x = grid_values(512, 128, generator=generator, limit=2, dtype=torch.bfloat16)
    w = _grid_weight(256, 128, generator, torch.float32, limit=1)
    grad_y = grid_values(512, 256, generator=generator, limit=2, dtype=torch.bfloat16)
    expected, expected_state = linear_oracle(x, w, kernels.new_fp8_linear_state(), grad_y, FAST_ACCUMULATOR_BITS)
    state = kernels.new_fp8_linear_state("cuda")
    got = _run_layer(kernels.fp8_linear, [x.cuda(), w.cuda()], state, grad_y.cuda(), None)
    for name, g, e in zip(("out", "grad_x", "grad_w"), got, expected):
        assert torch.equal(g.cpu(), e), f"fp8_linear {name}"
    assert torch.equal(state.cpu(), expected_state)

    w_down = _grid_weight(128, 256, generator, torch.bfloat16, limit=1)
    grad_y = grid_values(512, 128, generator=generator, limit=2, dtype=torch.bfloat16)
    expected, _ = mlp_oracle(x, w, w_down, kernels.new_fp8_mlp_state(), grad_y, bits=None)
    got = _run_layer(kernels.fp8_relu2_mlp, [x.cuda(), w.cuda(), w_down.cuda()], kernels.new_fp8_mlp_state("cuda"),
                     grad_y.cuda(), None)
    for name, g, e in zip(("out", "grad_x", "grad_up", "grad_down"), got, expected):
        error = (g.cpu().double() - e.double()).norm() / e.double().norm()
        assert error <= 2 ** -4, f"fp8_relu2_mlp {name}: relative error {error}"


def _positive_grid(*shape, generator, dtype):
    """Multiples of 1/4 in [1/4, 1]: exact in e4m3 and e5m2 at scale 1/4 (1, 2, 3, 4)."""
    return (torch.randint(1, 5, shape, generator=generator).float() / 4).to(dtype)


def _chunk_sums_exact(a, b, chunk, bits):
    """exact_sums for every chunk of `chunk` consecutive terms of the K sum of a @ b."""
    return all(exact_sums(a[:, k:k + chunk], b[k:k + chunk], bits) for k in range(0, a.shape[1], chunk))


def _check_fp8_backward_accumulation(tokens, outputs, device):
    """fp8_linear's gradients against the float64 product of the same dequantized operands.

    Static power-of-two scales (1/4) quantize positive multiples of 1/4 up to 1 exactly, so the
    dequantized operands are the inputs themselves, every product is a multiple of 1/16 <= 1,
    each BLOCK_K = PROMOTION_K = 256 chunk of a sum is at most 256 (2^12 sixteenths: exact within
    FAST_ACCUMULATOR_BITS) and a whole sum at most 50,304 (2^20 sixteenths: exact in fp32). So
    fp32 accumulation of the chunks (max_num_imprecise_acc = BLOCK_K) gives the float64 result
    exactly, and the check is equality: grad_w sums over `tokens`, grad_x over `outputs`. The
    whole sums do not fit in FAST_ACCUMULATOR_BITS (asserted): the fast accumulator alone would
    hold sums of ~0.39 K (K/4 on average for K = 49,152: 19,000, spacing 2 at ~14 bits) and lose
    the low bits of every product added past 2^13 / 16 = 512, leaving them off by thousands of
    sixteenths (near 2^14 if it truncates)."""
    generator = torch.Generator().manual_seed(tokens + outputs)
    x = _positive_grid(tokens, 128, generator=generator, dtype=torch.bfloat16)
    w = _positive_grid(outputs, 128, generator=generator, dtype=torch.float32)
    grad_y = _positive_grid(tokens, outputs, generator=generator, dtype=torch.bfloat16)
    quarter = kernels.Static(0.25)
    scales = kernels.FP8LinearScales(input=quarter, weight=quarter, grad_output=quarter)
    leaves = [t.to(device).requires_grad_(True) for t in (x, w)]
    y = kernels.fp8_linear(*leaves, kernels.new_fp8_linear_state(device), scales=scales)
    grad_x, grad_w = torch.autograd.grad(y, leaves, grad_y.to(device))
    for a, b, got, what in ((grad_y, w, grad_x, "input gradient"), (grad_y.t(), x, grad_w, "weight gradient")):
        assert _chunk_sums_exact(a, b, kernels.PROMOTION_K, FAST_ACCUMULATOR_BITS)
        assert exact_sums(a, b) and (a.shape[1] < 1024 or not exact_sums(a, b, FAST_ACCUMULATOR_BITS))
        assert torch.equal(got.cpu().double(), (a.double() @ b.double()).to(got.dtype).double()), what


@needs_cuda
@on_gpu
def test_gpu_fp8_backward_gemms_accumulate_in_fp32():
    """The FP8 weight gradient at K = 49,152 tokens and the input gradient at K = 50,304 outputs
    (the head's) are exact where fp32 accumulation is (_check_fp8_backward_accumulation)."""
    _check_fp8_backward_accumulation(49152, 256, "cuda")
    _check_fp8_backward_accumulation(256, 50304, "cuda")


@needs_cuda
@on_gpu
@pytest.mark.parametrize("d_qk,d_v", [(128, 128), (64, 64), (128, 64), (64, 128)])
def test_gpu_attention_error_at_most_twice_torch(d_qk, d_v):
    """ATTN bf16 criterion on CUDA with the production blocks: 2,000 tokens, windows of 384."""
    q, k, v, grad_o, generator = _attention_inputs(2000, 4, d_qk, d_v, seed=d_qk + d_v, dtype=torch.bfloat16)
    cu_seqlens, longest = uneven_documents(2000, generator)
    q, k, v, grad_o, cu_seqlens = (t.cuda() for t in (q, k, v, grad_o, cu_seqlens))
    _check_attention_bf16(q, k, v, grad_o, cu_seqlens, 384, [])


@needs_cuda
@on_gpu
def test_gpu_cross_entropy_and_xxt():
    """Cross-entropy (bf16 logits, full vocabulary) and X X^T (bf16) on CUDA, tolerances as on CPU."""
    logits, targets, weights, grad_loss = _cross_entropy_inputs(64, 50304, 4, 14, torch.bfloat16)
    _check_cross_entropy(kernels.softcap_cross_entropy, kernels.CROSS_ENTROPY.block_n,
                         logits.cuda(), targets.cuda(), weights.cuda(), grad_loss.cuda())

    x = torch.randn(4, 768, 3072, generator=torch.Generator().manual_seed(15)).bfloat16()
    out = kernels.xxt(x.cuda()).cpu()
    exact = x.double() @ x.double().mT
    bound = fp32_sum_bound(x, x.mT, 3072) * (1 + U_BF16) + U_BF16 * exact.abs()
    assert_within(out, exact, bound, "xxt")
    assert torch.equal(out, out.mT)


# ---------------------------------------------------------------------------------------------
# Weight averages
# ---------------------------------------------------------------------------------------------

@interpreted
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rate", [0.0067, 0.75])
def test_ema_update_moves_the_ema_as_torch_lerp_does(weight_dtype, rate):
    """Against torch.lerp_ toward the weight's fp32 copy (both of its formulas: rate below and
    above 1/2), the weight read in its own dtype: within one fp32 rounding of the product (the
    kernel's fma is exact on a GPU; the interpreter rounds the product first), every element of
    a size that ends inside a block moved and none past it."""
    generator = torch.Generator().manual_seed(11)
    ema = torch.randn(3, 700, generator=generator)
    weight = torch.randn(3, 700, generator=generator).to(weight_dtype)
    expected = ema.clone().lerp_(weight.float(), rate)
    padded = torch.cat([ema.flatten(), torch.full((100,), 7.0)])
    kernels.ema_update_(padded[:2100].view(3, 700), weight, rate, config=kernels.LaunchConfig(block_m=256, block_n=0))
    product = (weight.double() - ema.double()).abs() * max(rate, 1 - rate)
    assert_within(padded[:2100].view(3, 700), expected, U32 * (product + 2 * expected.double().abs()), "ema")
    assert torch.equal(padded[2100:], torch.full((100,), 7.0))


def test_ema_update_checks_its_inputs():
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.ema_update_(torch.zeros(4, 4, dtype=torch.bfloat16), torch.zeros(4, 4), 0.1)
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.ema_update_reference_(torch.zeros(4, 4), torch.zeros(4, 4).t()[:, :3], 0.1)


# ---------------------------------------------------------------------------------------------
# the pointer mixture: the pointer's attention and the mixture's loss

SMALL_POINTER = [v for config in (kernels.LaunchConfig(block_m=16, block_n=16), kernels.LaunchConfig(block_m=16, block_n=32),
                                  kernels.LaunchConfig(block_m=32, block_n=16)) for v in config.as_list()]
POINTER_OUTPUTS = ("p_copy", "a_sink", "dq", "dk", "dsink")
POINTER_BOS = 7                    # the documents' first token in these tests


def pointer_oracle(q, k, sink_scores, tokens, targets, bos, band):
    """float64 pointer from the definition, query by query: the keys of its own document (from the
    last `bos` at or before it, or position 0) before it and at or after the start of the band
    block before its own, then the sink; (p_copy, a_sink)."""
    T, D = q.shape
    p_copy, a_sink, start = [], [], 0
    for i in range(T):
        if tokens[i] == bos:
            start = i
        first = max(start, (i // band - 1) * band, 0)
        scores = torch.cat([k[first:i] @ q[i] / math.sqrt(D), sink_scores[i:i + 1]])
        w = scores.softmax(0)
        p_copy.append((w[:-1] * (tokens[first:i] == targets[i])).sum())
        a_sink.append(w[-1])
    return torch.stack(p_copy), torch.stack(a_sink)


def _pointer_inputs(T, D, seed, vocab=5):
    """fp32 inputs: documents of uneven lengths (one of a single token), a small vocabulary so that
    targets repeat, some absent targets (-1)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    sink_scores = torch.randn(T, generator=g)
    tokens = torch.randint(0, vocab, (T,), generator=g)
    tokens[[0, 23, 24, 61, T - 30]] = POINTER_BOS
    targets = torch.randint(-1, vocab, (T,), generator=g)
    grads = torch.randn(T, generator=g), torch.randn(T, generator=g)
    return (q, k, sink_scores), tokens, targets, grads


def _pointer_and_grads(fn, inputs, tokens, targets, grads, band):
    q, k, s0 = (t.detach().clone().requires_grad_(True) for t in inputs)
    p_copy, a_sink = fn(q, k, s0, tokens, targets, band)
    (p_copy.double() * grads[0].double() + a_sink.double() * grads[1].double()).sum().backward()
    return [t.detach().double() for t in (p_copy, a_sink, q.grad, k.grad, s0.grad)]


def _pointer_fn(impl, configs=None):
    def run(q, k, s0, tokens, targets, band):
        doc_start = kernels.pointer_document_starts(tokens, POINTER_BOS)
        if configs is None:
            return impl(q, k, s0, tokens, targets, doc_start, band)
        return impl(q, k, s0, tokens, targets, doc_start, band, configs)
    return run


def _oracle_fn(q, k, s0, tokens, targets, band):
    return pointer_oracle(q, k, s0, tokens, targets, POINTER_BOS, band)


@pytest.mark.parametrize("band", [1, 16, 40, 1000])
def test_pointer_attention_reference_equals_its_definition(band):
    """The reference (band by band, padded to whole bands) against the oracle in float64: p_copy,
    a_sink and the gradients of q, k and the sink's scores; bands that bind inside documents,
    that do not divide T, and one longer than the slice."""
    inputs, tokens, targets, grads = _pointer_inputs(150, 8, seed=3)
    inputs = [t.double() for t in inputs]
    got = _pointer_and_grads(_pointer_fn(kernels.pointer_attention_reference), inputs, tokens, targets, grads, band)
    want = _pointer_and_grads(_oracle_fn, inputs, tokens, targets, grads, band)
    for name, g, w in zip(POINTER_OUTPUTS, got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")
    assert (want[0] > 0).sum() > 20 and (want[1] < 1).sum() > 100, "targets repeat in documents: the pointer has mass"


@interpreted
@pytest.mark.parametrize("D,band,configs", [(16, 32, SMALL_POINTER), (32, 48, SMALL_POINTER),
                                             (16, 1000, SMALL_POINTER), (16, 64, kernels.POINTER_CONFIGS)])
def test_pointer_attention_matches_float64(D, band, configs):
    """ATTN: the kernels' p_copy, a_sink and the gradients of q, k and the sink's scores against the
    float64 oracle and the reference, fp32 inputs, documents of uneven length (one of a single
    token), a length that is no multiple of the blocks, bands that bind and one that does not,
    the band's block boundaries off the kernels' blocks (48), and the production tiles."""
    T = 150
    inputs, tokens, targets, grads = _pointer_inputs(T, D, seed=5)
    got = _pointer_and_grads(_pointer_fn(kernels.pointer_attention, configs), inputs, tokens, targets, grads, band)
    oracle = _pointer_and_grads(_oracle_fn, [t.double() for t in inputs], tokens, targets, grads, band)
    reference = _pointer_and_grads(_pointer_fn(kernels.pointer_attention_reference), inputs, tokens, targets, grads,
                                   band)
    for name, g, o, r in zip(POINTER_OUTPUTS, got, oracle, reference):
        atol = 1e-4 * max(1.0, float(o.abs().max()))
        torch.testing.assert_close(g, o, rtol=1e-4, atol=atol, msg=lambda m: f"{name} vs float64: {m}")
        torch.testing.assert_close(g, r, rtol=1e-4, atol=atol, msg=lambda m: f"{name} vs reference: {m}")


def test_the_pointer_mixture_is_a_distribution_and_its_loss_the_definition():
    """pointer_mixture_nll over every target column of a row sums (as probabilities) to 1 when the
    pointer's mass and the sink's do (the <copy> column itself is no target); and
    pointer_mixture_cross_entropy's next-token term is -log(p_full(y) (1 + a a_sink / (1 - a)) +
    a p_copy) in float64 (PR 379's form), its other terms the plain softcapped cross-entropy."""
    g = torch.Generator().manual_seed(11)
    C, copy = 40, 17
    logits = torch.randn(3, C, generator=g, dtype=torch.float64) * 8
    z = kernels.softcap(logits).double()
    a_sink = torch.tensor([0.3, 0.0, 0.9], dtype=torch.float64)
    share = torch.rand(3, C, generator=g, dtype=torch.float64)
    share[:, copy] = 0
    share = share / share.sum(1, keepdim=True) * (1 - a_sink[:, None])   # the pointer's mass on each token
    total = torch.zeros(3, dtype=torch.float64)
    for y in range(C):
        if y != copy:
            nll = kernels.pointer_mixture_nll(z, torch.full((3,), y), copy, share[:, y], a_sink)
            total += torch.exp(-nll)
    torch.testing.assert_close(total, torch.ones(3, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    targets = torch.tensor([[3, 5, -1], [-1, 2, 9], [39, 0, 1]])
    weights = torch.tensor([1.0, 0.5, 0.25])
    p_copy = share.gather(1, targets[:, :1].clamp(min=0))[:, 0]
    loss, next_loss = kernels.pointer_mixture_cross_entropy(logits, targets, weights, copy, p_copy, a_sink)
    q = z.softmax(1)
    alpha = q[:, copy]
    full = q.gather(1, targets[:, :1].clamp(min=0))[:, 0]
    want0 = torch.where(targets[:, 0] >= 0, -torch.log(full * (1 + alpha * a_sink / (1 - alpha)) + alpha * p_copy), 0)
    plain = torch.where(targets >= 0, torch.logsumexp(z, 1, keepdim=True) - z.gather(1, targets.clamp(min=0)), 0)
    torch.testing.assert_close(next_loss.double(), want0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss.double(), want0 + (plain[:, 1:] * weights[1:].double()).sum(1), rtol=1e-5, atol=1e-6)


def _mixture_inputs(N, C, copy_col, seed):
    """Logits (fp32, N x C), three targets a row (one absent, one outside the columns, none the
    <copy> column), weights, and the pointer's (p_copy, a_sink) with p_copy <= 1 - a_sink."""
    logits, targets, weights, grad_loss = _cross_entropy_inputs(N, C, 3, seed, torch.float32)
    targets[targets == copy_col] = copy_col + 1
    g = torch.Generator().manual_seed(seed + 1)
    a_sink = torch.rand(N, generator=g)
    p_copy = torch.rand(N, generator=g) * (1 - a_sink)
    p_copy[::5] = 0.0                  # targets the pointer never saw
    return logits, targets, weights, grad_loss, p_copy, a_sink


def mixture_oracle(logits, targets, weights, copy_col, p_copy, a_sink):
    """float64 per-row loss from the definition (PR 379's form): the first target's term
    -log(q(y) (1 + a a_sink / (1 - a)) + a p_copy), q = softmax(softcap(logits)), a = q(copy); the
    others lse - z; targets outside the columns count 0."""
    z = 23.0 * torch.sigmoid((logits.double() + 5.0) / 7.5)
    q = z.softmax(1)
    alpha = q[:, copy_col]
    present = (targets >= 0) & (targets < z.shape[1])
    t = torch.where(present, targets, 0)
    mixed = q.gather(1, t[:, :1])[:, 0] * (1 + alpha * a_sink / (1 - alpha)) + alpha * p_copy
    first = torch.where(present[:, 0], -torch.log(torch.where(present[:, 0], mixed, 1.0)), 0.0)
    rest = torch.where(present[:, 1:], torch.logsumexp(z, 1, keepdim=True) - z.gather(1, t[:, 1:]), 0.0)
    return first * weights[0] + (rest * weights[1:].double()).sum(1), first


def check_against_mixture_oracle(run, inputs, targets, weights, copy_col, grad_loss, grad_rtol, grad_atol):
    """run(logits, p_copy, a_sink) -> (loss, next_loss) on leaf copies of `inputs`: the losses
    against mixture_oracle in float64, and the gradients of (loss * grad_loss).sum() within
    grad_rtol and grad_atol x the largest oracle gradient; the inputs left unchanged. Returns the
    oracle's next-token loss."""
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    loss, next_loss = run(*leaves)
    (loss * grad_loss).sum().backward()
    assert all(torch.equal(leaf.detach(), t) for leaf, t in zip(leaves, inputs)), "inputs changed"
    oracle_leaves = [t.double().requires_grad_(True) for t in inputs]
    want, want_next = mixture_oracle(oracle_leaves[0], targets, weights, copy_col, *oracle_leaves[1:])
    (want * grad_loss.double()).sum().backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(next_loss.double(), want_next.detach(), rtol=1e-5, atol=1e-5)
    for name, got, oracle in zip(("logits", "p_copy", "a_sink"), leaves, oracle_leaves):
        atol = grad_atol * float(oracle.grad.abs().max())
        torch.testing.assert_close(got.grad.double(), oracle.grad, rtol=grad_rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")
    return want_next


@interpreted
@pytest.mark.parametrize("exact", [False, True])
def test_the_pointer_mixture_cross_entropy_kernel_matches_float64(exact):
    """The mixture inside the cross-entropy kernel (MIXTURE): loss, next-token loss, and the
    gradients of the logits, p_copy and a_sink against the float64 oracle, for an arbitrary
    upstream gradient (the backward rescales) and for the trainer's own (exact_upstream: the
    forward's stored gradient handed on); fp32 logits, several column blocks, the <copy> column in
    the middle of one."""
    N, C, copy_col = 24, 150, 77
    logits, targets, weights, grad_loss, p_copy, a_sink = _mixture_inputs(N, C, copy_col, seed=41)
    if exact:
        grad_loss = torch.full((N,), 1 / 48)

    def run(logits, p_copy, a_sink):
        return kernels.pointer_mixture_softcap_cross_entropy(logits, targets, weights, copy_col, p_copy, a_sink,
                                                             SMALL_CE, SMALL_CE, grad_scale=1 / 48 if exact else 1.0,
                                                             exact_upstream=exact)
    want_next = check_against_mixture_oracle(run, (logits, p_copy, a_sink), targets, weights, copy_col, grad_loss,
                                             1e-4, 1e-5)
    assert (want_next[targets[:, 0] >= C] == 0).all()


@pytest.mark.parametrize("exact,dtype,copy_col", [(False, torch.float32, 77), (True, torch.float32, 149),
                                                   (False, torch.bfloat16, 0)])
def test_the_chunked_pointer_mixture_cross_entropy_matches_float64(exact, dtype, copy_col):
    """The CPU path of the mixture (row blocks of 5 that do not divide 24 rows, the <copy> column
    inside the row and at either end, given as a 0-d tensor as the sampled softmax gives it): loss,
    next-token loss and the gradients of the logits, p_copy and a_sink against the float64 oracle,
    for an arbitrary upstream gradient and for the trainer's announced one (the stored gradient
    handed on); the inputs unchanged."""
    N, C = 24, 150
    logits, targets, weights, grad_loss, p_copy, a_sink = _mixture_inputs(N, C, copy_col, seed=47)
    if exact:
        grad_loss = torch.full((N,), 1 / 48)

    def run(logits, p_copy, a_sink):
        return kernels.pointer_mixture_cross_entropy_chunked(logits, targets, weights, torch.tensor(copy_col), p_copy,
                                                             a_sink, grad_scale=1 / 48 if exact else 1.0,
                                                             exact_upstream=exact, rows=5)
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-4
    check_against_mixture_oracle(run, (logits.to(dtype), p_copy, a_sink), targets, weights, copy_col, grad_loss,
                                 tolerance, tolerance)


@interpreted
def test_fp8_head_pointer_mixture_is_the_mixture_kernel_on_the_fp8_logits():
    """The FP8 head and the mixture's cross-entropy in one: the losses and the p_copy and a_sink
    gradients are the mixture kernel's on the same FP8 logits, bitwise, and the saved e5m2
    gradient is that kernel's fp32 gradient quantized at the head's static scale."""
    generator = torch.Generator().manual_seed(43)
    N, D, C, copy_col = 24, 32, 150, 120
    x = (torch.randn(N, D, generator=generator) * 3).bfloat16()
    weight = torch.randn(C, D, generator=generator) * 0.4
    _, targets, weights, _, p_copy, a_sink = _mixture_inputs(N, C, copy_col, seed=44)
    states = [kernels.new_fp8_linear_state(), kernels.new_fp8_linear_state()]
    for state in states:
        kernels.set_fp8_loss_unit(state, 1 / 48)
    logits = kernels.fp8_linear(x, weight, states[0], SMALL_MATMUL, scales=kernels.HEAD_SCALES)
    plain = [t.clone().requires_grad_(True) for t in (p_copy, a_sink)]
    loss, next_loss = kernels.pointer_mixture_softcap_cross_entropy(logits, targets, weights, copy_col, *plain,
                                                                    SMALL_CE, grad_scale=1 / 48, exact_upstream=True)
    (loss.sum() / 48).backward()
    xs, ws = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    fused_leaves = [t.clone().requires_grad_(True) for t in (p_copy, a_sink)]
    fused, fused_next = kernels.fp8_head_pointer_mixture(xs, ws, states[1], targets, weights, torch.tensor(copy_col),
                                                         *fused_leaves, 1 / 48, SMALL_MATMUL, SMALL_CE)
    assert torch.equal(fused, loss) and torch.equal(fused_next, next_loss)
    saved = fused.grad_fn.saved_tensors
    g8, g_scale = saved[-5], saved[-3]
    _, _, g32, _, _ = kernels._pointer_ce_op(logits.float(), targets, weights, True, torch.tensor([1 / 48]),
                                             p_copy, a_sink, torch.tensor([copy_col], dtype=torch.int32),
                                             SMALL_CE.as_list())
    assert torch.equal(g8.float(), kernels._quantize_reference(g32, g_scale, torch.zeros(1), E5M2).float())
    (fused.sum() / 48).backward()
    for a, b in zip(fused_leaves, plain):
        assert torch.equal(a.grad, b.grad)
    assert torch.isfinite(xs.grad.float()).all() and xs.grad.abs().sum() > 0 and ws.grad.abs().sum() > 0
