"""Running the Triton code of kernels.py on a machine without a GPU, for tests.

Isolated worker processes. Triton decides when it is first imported, and when each
`@triton.jit` function is defined, whether kernels are interpreted (TRITON_INTERPRET=1) or
compiled; its own library functions (tl.cdiv, tl.sigmoid, ...) follow the same rule. One
process cannot have both, and which one a pytest process gets would depend on which test module
happened to import triton first. Tests decorated with `@isolated(interpret=...)` therefore run
their body in a worker process started with the environment they need (one worker per mode,
kept for the session); failures come back as the worker's exception and traceback.

The interpreter shim. The interpreter of triton 3.7 has wrong results for some float work:
  - bf16 `tl.dot` operands and bf16 arithmetic are processed as their raw uint16 bit patterns;
  - fp32 -> fp8 casts round wrongly (7.93 -> 4.0 in e4m3);
  - fp32 -> bf16 casts truncate instead of rounding to nearest even.
`install_shim` patches the interpreter so that every float conversion that involves bf16 or
fp8 goes through torch (round to nearest even, as the GPU does) and `tl.dot` upcasts bf16 and
fp8 operands to fp32 before multiplying (products of such operands are exact in fp32, like the
tensor cores' products; only the summation order differs from the hardware). The kernels upcast
to fp32 right after loading, so no bf16 arithmetic needs fixing. Interpreted workers install it.

Triton 3.6's interpreter (`_patch_lang_tensor`) makes `tensor.__index__`, which
`range(0, tl.cdiv(K, BLOCK_K))` calls, return `int()` of the scalar's one-element numpy array, which
numpy >= 2.4 refuses (triton 3.7 takes the array's `.squeeze()` first). Where that `__index__`
raises, `install_shim` makes it return `int()` of the array's `.item()`, the same value. The float
patches use names that triton 3.6 and 3.7 share (`InterpreterBuilder.cast_impl`, `create_fp_to_fp`,
`create_dot`, `TensorHandle`, `_ir.ROUNDING_MODE`).
"""
import atexit
import concurrent.futures
import functools
import importlib
import multiprocessing
import operator
import os
import pathlib
import sys
import time

import numpy as np
import torch

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# A hang guard, not a speed check: an isolated test counts as hung when its worker (and what the
# worker started) used no CPU for WORKER_IDLE_S; a slow or loaded machine keeps using CPU.
WORKER_IDLE_S = 300
WORKER_POLL_S = 10


def _torch_dtype(tl_dtype):
    """The torch dtype of a Triton scalar float type (None for other types)."""
    import triton.language as tl
    return {
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
        tl.bfloat16: torch.bfloat16,
        tl.float16: torch.float16,
        tl.float32: torch.float32,
        tl.float64: torch.float64,
    }.get(tl_dtype)


def _numpy_to_torch(data, dtype):
    """Reinterpret the interpreter's numpy storage (raw bits for bf16 and fp8) as a torch tensor."""
    data = np.ascontiguousarray(data)
    if dtype == torch.bfloat16:
        return torch.from_numpy(data.view(np.int16)).view(torch.bfloat16)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return torch.from_numpy(data.view(np.uint8)).view(dtype)
    return torch.from_numpy(data)


def _torch_to_numpy(tensor):
    """The inverse of _numpy_to_torch: bf16 and fp8 come back as raw uint16 and uint8 bits."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return tensor.view(torch.uint8).numpy()
    return tensor.numpy()


def _is_low_precision_float(tl_dtype):
    dtype = _torch_dtype(tl_dtype)
    return dtype is not None and (dtype == torch.bfloat16 or dtype.itemsize == 1)


def _scalar_index(tensor):
    """`tensor.__index__` of a scalar tensor: its one-element numpy array as a Python int."""
    return int(tensor.handle.data.item())


def _scalar_index_fails(interpreter):
    """Whether the interpreter's own `tensor.__index__` raises on a scalar (a one-element array)."""
    import triton.language as tl

    class Probe:
        pass

    interpreter._patch_lang_tensor(Probe, interpreter._LangPatchScope())
    probe = Probe()
    probe.handle = interpreter.TensorHandle(np.ones(1, dtype=np.int32), tl.int32)
    try:
        operator.index(probe)
    except TypeError:
        return True
    return False


def _patch_scalar_index(interpreter):
    """Make the tensor patches of each interpreted launch use `_scalar_index` for `__index__`."""
    original_patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", _scalar_index)

    interpreter._patch_lang_tensor = patch_lang_tensor


def install_shim():
    """Patch the interpreter's float conversions and dot, and its scalar `__index__` where it fails
    (see the module docstring). Idempotent."""
    import triton.language as tl
    from triton.runtime import interpreter
    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_speedrun_shim", False):
        return
    if _scalar_index_fails(interpreter):
        _patch_scalar_index(interpreter)
    original_cast = builder.cast_impl
    original_dot = builder.create_dot

    def convert(src, dst_type):
        out = _numpy_to_torch(src.data, _torch_dtype(src.dtype.scalar)).to(_torch_dtype(dst_type.scalar))
        return interpreter.TensorHandle(_torch_to_numpy(out), dst_type.scalar)

    def cast_impl(self, src, dst_type):
        both_floats = _torch_dtype(src.dtype.scalar) is not None and _torch_dtype(dst_type.scalar) is not None
        if both_floats and (_is_low_precision_float(src.dtype.scalar) or _is_low_precision_float(dst_type.scalar)):
            return convert(src, dst_type)
        return original_cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if rounding_mode not in (None, interpreter._ir.ROUNDING_MODE.RTNE):
            raise NotImplementedError("the interpreter shim only rounds to nearest even")
        return convert(src, dst_type)

    def upcast(handle):
        if not _is_low_precision_float(handle.dtype.scalar):
            return handle
        value = _numpy_to_torch(handle.data, _torch_dtype(handle.dtype.scalar)).float().numpy()
        return interpreter.TensorHandle(value, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, upcast(a), upcast(b), d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_dot = create_dot
    builder._speedrun_shim = True


def _init_worker(interpret):
    """Runs first in a worker: fixes the Triton mode before anything imports triton."""
    if interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    for path in (str(REPO_ROOT), str(REPO_ROOT / "tests"), str(REPO_ROOT / "tests" / "helpers")):
        if path not in sys.path:
            sys.path.insert(0, path)
    if interpret:
        install_shim()


@functools.cache
def _worker(interpret):
    executor = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker, initargs=(interpret,))
    atexit.register(executor.shutdown, cancel_futures=True)
    return executor


def _call_in_worker(module_name, function_name, args, kwargs):
    function = getattr(importlib.import_module(module_name), function_name)
    return function.__wrapped__(*args, **kwargs)


def isolated(interpret):
    """Decorator: run the test in the worker process of the given Triton mode."""
    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            executor = _worker(interpret)
            future = executor.submit(_call_in_worker, test.__module__, test.__name__, args, kwargs)
            return _result_unless_idle(future, executor)
        return run
    return decorate


def _cpu_seconds(pids):
    """CPU seconds used so far by the processes `pids` and all their descendants (Linux /proc)."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    tree = set(pids)
    for _ in range(8):             # descendants a few generations down
        tree |= {pid for pid, (parent, _) in stats.items() if parent in tree}
    return sum(cpu for pid, (_, cpu) in stats.items() if pid in tree)


def _result_unless_idle(future, executor):
    """The test's result; TimeoutError once its worker has used no CPU for WORKER_IDLE_S."""
    last_cpu, idle_since = -1.0, time.monotonic()
    while True:
        try:
            return future.result(timeout=WORKER_POLL_S)
        except concurrent.futures.TimeoutError:
            cpu = _cpu_seconds(list(executor._processes))
            if cpu > last_cpu:
                last_cpu, idle_since = cpu, time.monotonic()
            elif time.monotonic() - idle_since > WORKER_IDLE_S:
                for process in list(executor._processes.values()):   # a hung worker serves no later test
                    process.kill()
                _worker.cache_clear()
                raise TimeoutError(f"the isolated test used no CPU for {WORKER_IDLE_S} s: it hangs") from None


class LaunchedKernels:
    """Within: the names of the Triton kernels kernels.py launches (they still run)."""

    def __enter__(self):
        import kernels
        self.kernels, self.names, self._original = kernels, [], kernels._launch

        def launch(kernel, grid, config, **args):
            self.names.append(kernel.__name__)
            self._original(kernel, grid, config, **args)
        kernels._launch = launch
        return self

    def __exit__(self, *exc):
        self.kernels._launch = self._original
