"""What kernels.py defines its Triton kernels with where triton is not installed: a CPU-only
install (requirements/train.txt leaves triton to CUDA torch, which pins it), where the trainer
runs the kernels' torch references. The decorator keeps a kernel's function and refuses to launch
it; the annotation and the grid helpers are plain Python."""
from machinery.errors import UserError

TRITON_NEEDED = ("the Triton kernels need the triton package, which is not installed: install CUDA torch "
                 "(pip install -r requirements/train.txt on a machine with a GPU brings it), or run on a CPU "
                 "with --kernels=auto")


class TritonMissing(UserError):
    """A Triton kernel was launched on a machine without triton."""


class UnlaunchableKernel:
    """A kernel defined without triton: its function, and a launch that says triton is needed."""

    def __init__(self, fn):
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def __getitem__(self, grid):
        raise TritonMissing(TRITON_NEEDED)


class constexpr:
    """A compile-time constant of a kernel: an annotation, or a module's named value."""

    def __init__(self, value=None):
        self.value = value


class language:
    """triton.language's names that kernels.py reads when it defines its kernels."""
    constexpr = constexpr


class triton:
    """triton's names that kernels.py reads outside a launch."""
    language = language

    @staticmethod
    def jit(fn=None, **options):
        """@triton.jit, or @triton.jit(options) (do_not_specialize=...)."""
        return UnlaunchableKernel(fn) if fn is not None else UnlaunchableKernel

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)

    @staticmethod
    def next_power_of_2(n):
        return 1 << max(n - 1, 0).bit_length()


tl = language
