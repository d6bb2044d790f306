"""How both CPU trainers (train_gpt.py and the CPU track's baseline) run on a CPU.

Two process settings that change how fast a step runs, not what it computes:

1. `keep_freed_memory_for_reuse`: glibc's allocator keeps freed memory mapped, so the
   logits are not faulted back in page by page every step.
2. `bf16_gemms_in_fp32`: on CPUs without bf16 instructions (no AVX512-BF16, no AMX), PyTorch
   runs bf16 matrix products in a scalar loop. Measured on a 2-core AMD EPYC (AVX2): the lm
   head's backward product (4096, 50304) @ (50304, 256) took 338 s in bf16 and 1.1 s in fp32.
   A bf16 GEMM multiplies bf16 inputs exactly, accumulates in fp32 and rounds the output to
   bf16; the same product computed as an fp32 GEMM of the (exactly) widened inputs, rounded
   to bf16, differs only in the order of the fp32 sums.

Both trainers log which GEMM path ran (`bf16_gemm` in the log's environment).
"""

import contextlib
import ctypes

import torch
from torch.utils._python_dispatch import TorchDispatchMode

M_TRIM_THRESHOLD = -1              # glibc mallopt parameter: free heap kept before returning it to the OS
M_MMAP_MAX = -4                    # glibc mallopt parameter: how many allocations may use their own mmap

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs with native bf16 products

_aten = torch.ops.aten
BF16_GEMMS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)


def keep_freed_memory_for_reuse():
    """Serve large tensors from the heap and keep freed memory mapped.

    By default glibc gives every large allocation its own mmap and unmaps it on free, so each
    step faults in gigabytes of fresh pages again (the logits, the table gradients). Measured
    on train_gpt.py's CPU preset, 2 cores: 4.4 s/step with sys time ~ user time, 2.1 s/step
    with this.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:                # not glibc: nothing to tune
        return
    libc.mallopt(M_MMAP_MAX, 0)
    libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)


def cpu_has_native_bf16():
    """Whether this CPU multiplies bf16 matrices in hardware (AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: ask the CPU itself
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read().split()
        except OSError:
            return False
        return any(flag in flags for flag in CPU_BF16_FLAGS)


class Bf16GemmsInFp32(TorchDispatchMode):
    """Runs every all-bf16 mm / addmm / bmm / baddbmm as the fp32 product of the widened inputs,
    rounded to bf16: what a bf16 GEMM returns, up to the order of its fp32 sums. Forward and
    backward products alike (autograd's products pass through the same dispatcher). Other ops,
    and products with any non-bf16 operand, run unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in BF16_GEMMS and all(a.dtype == torch.bfloat16 for a in args if isinstance(a, torch.Tensor)):
            widened = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*widened, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


def bf16_gemm_path(device, compiling=False, bf16_compute=True):
    """'native', 'fp32' or 'none': how bf16 products run on `device`. Only eager CPU runs on CPUs
    without bf16 instructions take the fp32 path (a compiled graph and a GPU keep their own
    GEMMs); a run that computes in fp32 has no bf16 products ('none'), so nothing intercepts its
    ops (the dispatch mode costs a Python call per op)."""
    if not bf16_compute:
        return "none"
    if device.type != "cpu" or compiling or cpu_has_native_bf16():
        return "native"
    return "fp32"


def bf16_gemms(path):
    """The context a run's steps and evaluations execute in for the path bf16_gemm_path chose."""
    return Bf16GemmsInFp32() if path == "fp32" else contextlib.nullcontext()
