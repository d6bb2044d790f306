"""The CPU trainers' bf16 GEMM path: fp32 products of widened bf16 inputs, rounded to bf16, equal a
bf16 GEMM (fp32 accumulation) up to the order of the sums."""

import contextlib

import torch
import torch.nn.functional as F

from machinery.cpu_runtime import Bf16GemmsInFp32, bf16_gemm_path, bf16_gemms, cpu_has_native_bf16

BF16_ULP = 2.0 ** -7               # bf16 spacing relative to a value: 8 significant bits


def rounded_float64_product(a, b):
    """The exactly computed product of the bf16 inputs, rounded once to bf16: the ideal bf16 GEMM."""
    return (a.double() @ b.double()).to(torch.bfloat16)


def test_products_match_float64_within_one_rounding():
    torch.manual_seed(0)
    a = torch.randn(33, 300).bfloat16()
    b = torch.randn(300, 17).bfloat16()
    bias = torch.randn(17).bfloat16()
    batch_a, batch_b = torch.randn(3, 9, 40).bfloat16(), torch.randn(3, 40, 5).bfloat16()
    with Bf16GemmsInFp32():
        products = {
            "mm": (a @ b, rounded_float64_product(a, b)),
            "addmm": (torch.addmm(bias, a, b), (bias.double() + a.double() @ b.double()).to(torch.bfloat16)),
            "bmm": (torch.bmm(batch_a, batch_b), rounded_float64_product(batch_a, batch_b)),
        }
    for name, (got, want) in products.items():
        assert got.dtype == torch.bfloat16, name
        # fp32 sums of 300 exact products, then one rounding: at most one bf16 step from the ideal
        tolerance = BF16_ULP * want.double().abs() + 1e-30
        assert ((got.double() - want.double()).abs() <= tolerance).all(), name


def test_native_bf16_gemm_agrees():
    torch.manual_seed(1)
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 24).bfloat16()
    native = a @ b
    with Bf16GemmsInFp32():
        widened = a @ b
    assert ((widened.double() - native.double()).abs() <= BF16_ULP * native.double().abs() + 1e-30).all()


def test_autocast_training_step_matches_native_gradients():
    """Forward and autograd's backward products both take the fp32 path; gradients keep their dtypes."""
    torch.manual_seed(2)
    x = torch.randn(8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)

    def grads(context):
        x.grad = w.grad = None
        with context:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = F.linear(F.relu(F.linear(x, w)), w.t())
            y.float().square().mean().backward()
        return y.detach().clone(), x.grad.clone(), w.grad.clone()

    native = grads(contextlib.nullcontext())
    widened = grads(Bf16GemmsInFp32())
    assert widened[0].dtype == torch.bfloat16 and widened[1].dtype == widened[2].dtype == torch.float32
    for got, want in zip(widened, native):
        torch.testing.assert_close(got.float(), want.float(), rtol=4 * BF16_ULP, atol=4 * BF16_ULP)


def test_other_ops_and_mixed_dtypes_are_untouched():
    calls = []

    class Spy(Bf16GemmsInFp32):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    a32, b32 = torch.randn(4, 4), torch.randn(4, 4)
    with Spy():
        exact = a32 @ b32
        summed = a32 + b32
    assert torch.equal(exact, a32 @ b32) and exact.dtype == torch.float32
    assert torch.equal(summed, a32 + b32)
    assert torch.ops.aten.mm.default in calls


def test_path_choice():
    assert bf16_gemm_path(torch.device("cuda")) == "native"
    assert bf16_gemm_path(torch.device("cpu"), compiling=True) == "native"
    assert bf16_gemm_path(torch.device("cpu"), bf16_compute=False) == "none"
    expected = "native" if cpu_has_native_bf16() else "fp32"
    assert bf16_gemm_path(torch.device("cpu")) == expected
    assert isinstance(bf16_gemms("fp32"), Bf16GemmsInFp32)
    assert not isinstance(bf16_gemms("native"), Bf16GemmsInFp32)
