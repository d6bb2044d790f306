"""CUDA's autocast rules on CPU tensors, for rehearsing the GPU code path on a machine without one.

torch.autocast("cpu") and torch.autocast("cuda") cast different ops: CUDA runs rms_norm,
layer_norm, pow (so x.square()), exp, log, softmax, sum, ... in fp32 and einsum, mv, addmv in
the low-precision dtype, where CPU autocast leaves them alone, and CPU autocast has rules of its
own (cat, stack, ...) that CUDA lacks. So the dtypes that reach a kernel differ between the two.

`cuda_autocast_rules()` replaces, while it is active, the AutocastCPU kernel of every op that
has an autocast rule on either device with a Python kernel that applies CUDA's rule for it
(CUDA_POLICIES: the ops registered for AutocastCUDA in torch, grouped by their cast policy as
torch's autocast_mode.cpp defines them), and with a pass-through for ops that only CPU autocast
handles. Inside `torch.autocast("cpu", dtype=torch.bfloat16)` a CPU model then gets the dtypes
a CUDA model gets inside `torch.autocast("cuda", dtype=torch.bfloat16)`, also when torch.compile
traces it.

The context manager yields a list that collects every call that went through one of these
kernels (op, argument shapes and dtypes, output dtypes). `replay_with_cuda_autocast(calls)`
makes each call again on fake CUDA tensors under torch's own CUDA autocast, which runs without a
GPU, and returns the calls whose output dtypes differ: the test that the emulation is CUDA's.
"""
import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

# Cast policies of the ops with an AutocastCUDA kernel (torch's names for the policies), in the
# torch versions this repository runs on; a name the running torch lacks is skipped (torch 2.11
# has no rule for rms_norm: its CUDA rms_norm is a fused kernel that keeps the input dtype).
CUDA_POLICIES = {
    "lower_precision_fp": [
        "_convolution", "_convolution.deprecated", "_cudnn_rnn", "_scaled_dot_product_flash_attention",
        "_thnn_fused_gru_cell", "_thnn_fused_lstm_cell", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm",
        "chain_matmul", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d.input",
        "conv_transpose3d.input", "convolution", "cudnn_convolution", "cudnn_convolution_transpose", "einsum",
        "gru_cell", "linalg_multi_dot", "linalg_vecdot", "linear", "lstm_cell", "matmul", "mm", "mv", "prelu",
        "rnn_relu_cell", "rnn_tanh_cell", "scaled_dot_product_attention",
    ],
    "fp32": [
        "_upsample_bicubic2d_aa", "_upsample_bilinear2d_aa", "_upsample_nearest_exact1d", "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d", "acos", "asin", "binary_cross_entropy_with_logits", "cdist", "cosh",
        "cosine_embedding_loss", "cosine_similarity", "dist", "erfinv", "exp", "expm1", "frobenius_norm.dim",
        "group_norm", "hinge_embedding_loss", "huber_loss", "kl_div", "l1_loss", "layer_norm", "log", "log10",
        "log1p", "log2", "logsumexp", "margin_ranking_loss", "mse_loss", "multi_margin_loss",
        "multilabel_margin_loss", "native_layer_norm", "nll_loss", "nll_loss2d", "nuclear_norm", "nuclear_norm.dim",
        "pdist", "poisson_nll_loss", "pow.Scalar", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "reciprocal", "renorm",
        "rms_norm", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softplus", "tan", "triplet_margin_loss",
        "upsample_bicubic2d", "upsample_bilinear2d", "upsample_linear1d", "upsample_nearest1d", "upsample_nearest2d",
        "upsample_nearest3d", "upsample_trilinear3d",
    ],
    # fp32 through the op's optional dtype argument, when the caller left it unset
    "fp32_set_opt_dtype": [
        "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
        "linalg_vector_norm", "log_softmax.Dimname", "log_softmax.int", "prod", "prod.dim_Dimname", "prod.dim_int",
        "softmax.Dimname", "softmax.int", "sum", "sum.dim_DimnameList", "sum.dim_IntList",
    ],
    # redispatched to the overload that takes a dtype, with dtype=fp32
    "fp32_append_dtype": ["norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim"],
    # every floating input cast to the widest floating dtype among them (at least the low-precision one)
    "promote": ["addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "grid_sampler", "index_put",
                "scatter_add", "tensordot", "vdot"],
    "banned": ["binary_cross_entropy"],
}
APPEND_DTYPE_OVERLOAD = {"norm.Scalar": "ScalarOpt_dtype", "norm.ScalarOpt_dim": "ScalarOpt_dim_dtype",
                         "norm.names_ScalarOpt_dim": "names_ScalarOpt_dim_dtype"}

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def registered(dispatch_key):
    """Names ("op" or "op.overload") of the aten ops with a kernel for `dispatch_key`."""
    return {name.removeprefix("aten::") for name in torch._C._dispatch_get_registrations_for_dispatch_key(dispatch_key)
            if name.startswith("aten::")}


def _op(name):
    op_name, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op_name), overload or "default")


def _eligible(value):
    """What autocast casts: defined floating-point tensors other than float64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _cast(args, kwargs, dtype):
    def cast(value):
        return value.to(dtype) if _eligible(value) and value.dtype != dtype else value
    return tree_map(cast, args), tree_map(cast, kwargs)


def _first_tensor(args):
    return next((a for a in args if isinstance(a, torch.Tensor)), None)


def _below_autocast(op, args, kwargs):
    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
        return op(*args, **kwargs)


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    """What a recorded call keeps of a tensor argument."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of an op through an autocast kernel: enough to make it again elsewhere."""
    name: str
    args: tuple
    kwargs: dict
    out_dtypes: tuple


def _meta(value):
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), tuple(value.stride()), value.dtype)
    return value


def _dtypes(value):
    return tuple(t.dtype for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _kernel(name, policy, calls):
    """A Python AutocastCPU kernel for op `name` applying CUDA's `policy` (None: no cast); each
    call is appended to `calls`."""
    def kernel(*args, **kwargs):
        out = _apply_policy(name, policy, args, kwargs)
        calls.append(Call(name, tree_map(_meta, args), tree_map(_meta, kwargs), _dtypes(out)))
        return out

    return kernel


def _apply_policy(name, policy, args, kwargs):
    """Op `name` called with CUDA autocast's cast `policy` applied to its arguments."""
    op, low = _op(name), torch.get_autocast_dtype("cpu")
    if policy == "lower_precision_fp":
        args, kwargs = _cast(args, kwargs, low)
    elif policy == "fp32":
        args, kwargs = _cast(args, kwargs, torch.float32)
    elif policy == "fp32_set_opt_dtype":
        if _eligible(_first_tensor(args)) and kwargs.get("dtype") is None:
            kwargs = {**kwargs, "dtype": torch.float32}
    elif policy == "fp32_append_dtype":
        if _eligible(_first_tensor(args)):
            op = getattr(getattr(torch.ops.aten, name.partition(".")[0]), APPEND_DTYPE_OVERLOAD[name])
            kwargs = {**kwargs, "dtype": torch.float32}
    elif policy == "promote":
        widest = low
        for value in tree_leaves((args, kwargs)):
            if _eligible(value):
                widest = torch.promote_types(widest, value.dtype)
        args, kwargs = _cast(args, kwargs, widest)
    elif policy == "banned":
        raise RuntimeError(f"{name} is unsafe to autocast (CUDA autocast refuses it)")
    return _below_autocast(op, args, kwargs)


@contextlib.contextmanager
def cuda_autocast_rules():
    """While active, CPU autocast applies CUDA's cast rules (see the module docstring)."""
    policy_of = {name: policy for policy, names in CUDA_POLICIES.items() for name in names}
    unknown = registered("AutocastCUDA") - set(policy_of)
    if unknown:
        raise RuntimeError(f"this torch has CUDA autocast rules for {sorted(unknown)}, which CUDA_POLICIES lacks")
    library = torch.library.Library("aten", "IMPL")
    calls = []
    try:
        for name in registered("AutocastCUDA") | registered("AutocastCPU"):
            library.impl(name, _kernel(name, policy_of.get(name), calls), "AutocastCPU")
        yield calls
    finally:
        library._destroy()


def replay_with_cuda_autocast(calls, dtype=torch.bfloat16):
    """[(call, CUDA's output dtypes)] for the recorded calls whose outputs CUDA autocast (torch's
    own kernels, on fake CUDA tensors) types differently from the emulation."""
    def fake_cuda(value):
        if isinstance(value, TensorMeta):
            return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="cuda")
        return value

    differences = []
    enabled, previous_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            for call in calls:
                out = _op(call.name)(*tree_map(fake_cuda, call.args), **tree_map(fake_cuda, call.kwargs))
                if _dtypes(out) != call.out_dtypes:
                    differences.append((call, _dtypes(out)))
    finally:
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", previous_dtype)
    return differences
