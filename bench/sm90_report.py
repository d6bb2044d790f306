"""Compile every production kernel launch of kernels.py for Hopper (sm_90) without a GPU, and
report its resources: registers, shared memory, spills, instruction counts, tensor-core use.

Two sets of launches, recorded with kernels._launch replaced by a recorder, so that the
arguments carry the block sizes, dtypes, layouts and specializations (unit strides, 16-aligned
pointers, 16-divisible sizes) exactly as the JIT sees them:
  - the trainer's: one training step of every stage of the speedrun preset, the optimizer
    step and the final validation, at full size, traced on fake tensors under CUDA's autocast
    rules (tests/cuda_autocast.py); each kernel op it calls is then made again on real CPU
    tensors that are allocated but never touched, which records the launch without running it;
  - the library's other production variants (LIBRARY_SHAPES: head dims 64, the FP8 linear,
    sampled-softmax widths, both weight dtypes), from the public wrappers on untouched tensors.
Each distinct launch is compiled with triton.compile for GPUTarget("cuda", 90, 32) and
inspected with the cuobjdump that ships inside the triton wheel; "trainer" in an entry says
whether the trainer makes that launch.

    python bench/sm90_report.py            # print the report
    python bench/sm90_report.py --write    # also store it in bench/sm90_resources.json (another
                                           # triton than requirements.txt's: sm90_resources_triton<v>.json)

tests/test_kernels_sm90.py runs the same compiles and checks the limits below.
"""
import argparse
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))

import kernels  # noqa: E402
import train_gpt  # noqa: E402
import triton  # noqa: E402
from cuda_autocast import cuda_autocast_rules  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402



def report_path(version=triton.__version__):
    """Where the report of a triton version is kept: sm90_resources.json for the version
    requirements.txt pins, sm90_resources_triton<version>.json for another (the GPU image's)."""
    pinned = next(line.split("==")[1].strip() for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
                  if line.startswith("triton=="))
    name = "sm90_resources.json" if version == pinned else f"sm90_resources_triton{version}.json"
    return pathlib.Path(__file__).resolve().parent / name


REPORT_PATH = report_path()        # this process's triton
HOPPER = GPUTarget("cuda", 90, 32)
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes of shared memory one block may use on H100/H200

TRAINER_PRESET = "speedrun"        # its per-GPU shapes are also the 1gpu preset's
# Shapes of the library variants: packed tokens per GPU, model width, MLP width, vocabulary
# (full and the smallest sampled-softmax candidate set), a document length and window.
LIBRARY_SHAPES = dict(tokens=49152, width=768, hidden=3072, vocab=50304, candidates=10240,
                      max_doc=3072, window=1664, heads_by_dim={128: 6, 64: 12})
ATTENTION_HEAD_DIMS = ((128, 128), (64, 64), (128, 64), (64, 128))  # (Dqk, Dv)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)  # master weights of the fp8 layers (bf16 or fp32)
CE_TARGET_COUNTS = (1, 2, 3, 4)  # next token alone ... three future tokens plus the prefix target
NGRAM_TABLE_ROWS = 65536          # rows of the n-gram table shard the report's launches address
# Muon's Gram matrices: a bank of square attention matrices and the wide MLP matrices.
XXT_SHAPES = ((16, 768, 768), (8, 768, 3072))

# Kernels that must run on the tensor cores (wgmma in PTX, HGMMA/QGMMA in SASS).
MATRIX_KERNELS = ("_fp8_matmul_kernel", "_fp8_matmul_quant_kernel", "_attn_fwd_kernel", "_attn_bwd_kv_kernel",
                  "_attn_bwd_q_kernel", "_xxt_kernel", "_dc_fwd_kernel", "_dc_bwd_mix_kernel", "_dc_bwd_q_kernel",
                  "_dc_bwd_kv_kernel")
SASS_COUNTED = ("HGMMA", "QGMMA", "HMMA", "LDL", "STL", "LDS", "STS", "LDG", "STG", "BAR", "MUFU")

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.float8_e4m3fn: "fp8e4nv",
                 torch.float8_e5m2: "fp8e5"}
_DIVISIBILITY = [["tt.divisibility", 16]]


def _untouched(*shape, dtype=torch.bfloat16, requires_grad=False):
    """A CPU tensor whose memory is reserved but never written (large shapes cost no RAM)."""
    return torch.empty(*shape, dtype=dtype).requires_grad_(requires_grad)


def _library_calls():
    """The wrappers' production variants at LIBRARY_SHAPES, forward and backward."""
    s = LIBRARY_SHAPES
    T, D, H = s["tokens"], s["width"], s["hidden"]
    x = _untouched(T, D, requires_grad=True)
    for weight_dtype in WEIGHT_DTYPES:
        for out_features in (3 * D, D, s["candidates"]):  # packed QKV, attention output, lm_head
            weight = _untouched(out_features, D, dtype=weight_dtype, requires_grad=True)
            y = kernels.fp8_linear(x, weight, kernels.new_fp8_linear_state())
            y.backward(torch.empty_like(y))
        w_up = _untouched(H, D, dtype=weight_dtype, requires_grad=True)
        w_down = _untouched(D, H, dtype=weight_dtype, requires_grad=True)
        y = kernels.fp8_relu2_mlp(x, w_up, w_down, kernels.new_fp8_mlp_state())
        y.backward(torch.empty_like(y))

    cu_seqlens = torch.arange(0, T + 1, s["max_doc"], dtype=torch.int32)
    for d_qk, d_v in ATTENTION_HEAD_DIMS:
        heads = s["heads_by_dim"][max(d_qk, d_v)]
        q, k = (_untouched(T, heads, d_qk, requires_grad=True) for _ in range(2))
        v = _untouched(T, heads, d_v, requires_grad=True)
        o = kernels.flash_attn_varlen(q, k, v, cu_seqlens, s["window"], d_qk ** -0.5)
        o.backward(torch.empty_like(o))
        angles = _untouched(T, d_qk // 2, dtype=torch.float32)
        q, k = kernels.qk_norm_rope(q, k, angles, angles, _untouched(d_qk, dtype=torch.bool),
                                    _untouched(T, dtype=torch.bool))
        (q.float().sum() + k.float().sum()).backward()

    for columns in (s["vocab"], s["candidates"]):
        for num_targets in CE_TARGET_COUNTS:
            logits = _untouched(T, columns, requires_grad=True)
            targets = torch.zeros(T, num_targets, dtype=torch.int64)
            loss, _ = kernels.softcap_cross_entropy(logits, targets, torch.ones(num_targets))
            loss.backward(torch.empty_like(loss))
    with torch.no_grad():  # validation: full vocabulary, next token only, no gradient
        kernels.softcap_cross_entropy(_untouched(T, s["vocab"]), torch.zeros(T, 1, dtype=torch.int64), torch.ones(1))

    for shape in XXT_SHAPES:
        kernels.xxt(_untouched(*shape))

    # composed attention (the last layer's), at the model's head width
    heads = s["heads_by_dim"][128]
    q, k, v = (_untouched(T, heads, 128, requires_grad=True) for _ in range(3))
    mix_in = _untouched(T, heads, dtype=torch.float32, requires_grad=True)
    mix_out = _untouched(T, heads, requires_grad=True)
    o = kernels.composed_attention(q, k, v, _untouched(T, dtype=torch.int32), 112, 128 ** -0.5, mix_in, mix_out)
    o.backward(torch.empty_like(o))

    # the hashed n-gram table: a bigram and a trigram row per token, their gradients summed per
    # distinct row, sparse Adam on those rows of a table shard (its row count changes no launch)
    groups = kernels.distinct_rows(torch.randint(0, NGRAM_TABLE_ROWS, (2 * T,)))
    for dtype in WEIGHT_DTYPES:
        grads = kernels.sum_rows(_untouched(2 * T, D, dtype=dtype), groups)
        step = kernels.RowAdamStep(event=7, log_decay=-0.35, one_minus_beta2=0.05, bias=0.05, lr=0.01, decay=0.0,
                                   eps=1e-10)
        kernels.sparse_adam_rows_(_untouched(NGRAM_TABLE_ROWS, D, dtype=dtype), grads, groups,
                                  _untouched(NGRAM_TABLE_ROWS, dtype=torch.float32),
                                  _untouched(NGRAM_TABLE_ROWS, dtype=torch.int32),
                                  _untouched(NGRAM_TABLE_ROWS, dtype=torch.float64), step)


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """What the JIT specializes on for a tensor argument (the recorder keeps no tensors, so
    that autograd can still reuse their memory)."""
    dtype: torch.dtype
    aligned: bool  # data pointer divisible by 16


def recorded_argument(value):
    """A launch argument as the JIT specializes on it (tensors: dtype and 16-byte alignment)."""
    return TensorArg(value.dtype, value.data_ptr() % 16 == 0) if isinstance(value, torch.Tensor) else value


def record_launches(calls):
    """[(kernel, config, args)] of every launch that calls() makes, none of them run."""
    recorded = []
    original = kernels._launch

    def record(kernel, grid, config, **args):
        recorded.append((kernel, config, {name: recorded_argument(value) for name, value in args.items()}))

    kernels._launch = record
    try:
        calls()
    finally:
        kernels._launch = original
    return recorded


@dataclasses.dataclass(frozen=True)
class FakeArg:
    """A tensor argument of a kernel op call made on fake tensors: its layout in its storage."""
    shape: tuple
    stride: tuple
    storage_offset: int
    dtype: torch.dtype

    def untouched(self):
        """A CPU tensor with this layout (and so this alignment) whose memory is never written."""
        extent = self.storage_offset + sum((n - 1) * st for n, st in zip(self.shape, self.stride)) + 1
        return torch.empty(extent, dtype=self.dtype).as_strided(self.shape, self.stride, self.storage_offset)


class KernelOpCalls(TorchDispatchMode):
    """Records the calls of this repository's kernel ops (namespace "kernels") with their layouts."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "kernels":
            def layout(v):
                if isinstance(v, torch.Tensor):
                    return FakeArg(tuple(v.shape), tuple(v.stride()), v.storage_offset(), v.dtype)
                return v
            self.calls.append((func, tree_map(layout, args), tree_map(layout, kwargs)))
        return func(*args, **kwargs)


def trainer_kernel_calls(preset=TRAINER_PRESET):
    """Every kernel op call of the trainer for `preset`, at full size: a training step of each
    stage (forward, backward, optimizer) and the final validation, on fake tensors under CUDA's
    autocast rules, with the Triton kernel functions. No memory is used and nothing launches."""
    h = train_gpt.parse_config(["--preset", preset])
    mlp, qkv, head = train_gpt.fp8_kernels(h, use_triton=True)
    fns = train_gpt.KernelFns(kernels.flash_attn_varlen, kernels.softcap_cross_entropy, mlp, kernels.xxt, qkv, head,
                              kernels.qk_norm_rope, kernels.composed_attention)
    with cuda_autocast_rules(), FakeTensorMode(allow_non_fake_inputs=True), KernelOpCalls() as recorder:
        model = train_gpt.build_model(h, fns)
        optimizers = train_gpt.build_optimizers(h, model, fns)
        for index, stage in enumerate(h.stages):
            T = stage.tokens_per_rank
            tokens = torch.zeros(T, dtype=torch.int32)
            targets = torch.zeros(T, train_gpt.MAX_TARGETS - 1, dtype=torch.int64)
            cu_seqlens = torch.arange(0, T + 1, stage.max_doc_len, dtype=torch.int32)
            args = train_gpt.AttentionArgs(cu_seqlens, stage.short_window * train_gpt.WINDOW_BLOCK,
                                           stage.long_window * train_gpt.WINDOW_BLOCK)
            columns = torch.arange(stage.candidates) if stage.candidates else None
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _ = model(tokens, targets, args, train_gpt.target_weights(stage, "cpu"), columns)
            loss.backward()
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        model.eval()
        T = h.val_tokens_per_rank
        args = train_gpt.AttentionArgs(torch.tensor([0, T], dtype=torch.int32),
                                       h.stages[-1].short_window * train_gpt.WINDOW_BLOCK,
                                       h.val_long_window * train_gpt.WINDOW_BLOCK)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            model.validation_loss_sum(torch.zeros(T, dtype=torch.int32), torch.zeros(T, 1, dtype=torch.int64), args)
    return recorder.calls


def replay_untouched(calls):
    """Make each recorded kernel op call again on untouched CPU tensors of the same layouts."""
    def real(v):
        return v.untouched() if isinstance(v, FakeArg) else v
    for func, args, kwargs in calls:
        func(*tree_map(real, args), **tree_map(real, kwargs))


def specialize(kernel, args):
    """(signature, constexprs, attrs) as Triton's JIT derives them from these arguments: tensors
    become typed pointers (16-byte aligned ones marked divisible by 16), integers equal to 1
    become constants, integers divisible by 16 are marked so, floats are fp32."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        name, value = param.name, args[param.name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, TensorArg):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
            if value.aligned:
                attrs[(index,)] = _DIVISIBILITY
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{kernel.__name__}: unexpected argument {name}={value!r}")
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
            if value % 16 == 0:
                attrs[(index,)] = _DIVISIBILITY
    return signature, constexprs, attrs


def _cuobjdump(flag, cubin):
    tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def _resource_usage(cubin):
    """{"REG": .., "STACK": .., "SHARED": .., "LOCAL": ..} of the kernel in the cubin."""
    line = next(text for text in _cuobjdump("--dump-resource-usage", cubin).splitlines() if "REG:" in text)
    fields = dict(item.split(":") for item in line.split() if ":" in item)
    return {key: int(fields[key]) for key in ("REG", "STACK", "SHARED", "LOCAL")}


def _opcode(sass_line):
    """'HGMMA' from '/*0160*/  @P0 HGMMA.64x128x16.F32.BF16 R24, ... ;'."""
    tokens = sass_line.split("*/", 1)[1].split()
    if tokens[0].startswith("@"):
        tokens = tokens[1:]
    return tokens[0].split(".")[0]


def _describe(kernel, config, signature, constexprs):
    """'kernel (pointer dtypes) CONSTEXPR=value ... warps=W stages=S', one line per variant."""
    pointers = ",".join(t[1:] for t in signature.values() if t.startswith("*"))
    shown = " ".join(f"{k}={v}" for k, v in constexprs.items()
                     if k.isupper() and k not in ("GROUP_M", "SOFTCAP", "SHIFT", "TEMP"))
    return f"{kernel.__name__} ({pointers}) {shown} warps={config.num_warps} stages={config.num_stages}"


def compile_launch(kernel, config, args):
    """Compile one recorded launch for sm_90 and return its report entry."""
    signature, constexprs, attrs = specialize(kernel, args)
    compiled = triton.compile(triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                                        attrs=attrs),
                              target=HOPPER, options={"num_warps": config.num_warps,
                                                      "num_stages": config.num_stages})
    cubin = compiled.asm["cubin"]
    sass = _cuobjdump("--dump-sass", cubin)
    instructions = [line for line in sass.splitlines() if line.strip().startswith("/*") and ";" in line]
    usage = _resource_usage(cubin)
    return {
        "kernel": kernel.__name__,
        "variant": _describe(kernel, config, signature, constexprs),
        "registers": usage["REG"],
        "shared_bytes": compiled.metadata.shared,
        "local_bytes": usage["LOCAL"],
        "stack_bytes": usage["STACK"],
        "ptx_wgmma": compiled.asm["ptx"].count("wgmma.mma_async"),
        "sass_instructions": len(instructions),
        "sass_counts": {op: sum(_opcode(line) == op for line in instructions) for op in SASS_COUNTED},
    }


def _variant_key(kernel, config, args):
    signature, constexprs, attrs = specialize(kernel, args)
    return (kernel.__name__, json.dumps(signature, sort_keys=True), repr(sorted(constexprs.items())),
            repr(sorted(attrs)), config.num_warps, config.num_stages)


def production_launches():
    """(trainer launches, library launches) as record_launches gives them."""
    trainer = record_launches(lambda: replay_untouched(trainer_kernel_calls()))
    return trainer, record_launches(_library_calls)


def build_report(launches=None):
    """The report: Triton version and one entry per distinct launch of `launches` (default: the
    trainer's and the library's production launches)."""
    trainer_keys = set()
    if launches is None:
        trainer, library = production_launches()
        trainer_keys = {_variant_key(*launch) for launch in trainer}
        launches = trainer + library
    entries, seen = [], set()
    for kernel, config, args in launches:
        key = _variant_key(kernel, config, args)
        if key not in seen:
            seen.add(key)
            entries.append({**compile_launch(kernel, config, args), "trainer": key in trainer_keys})
    entries.sort(key=lambda e: e["variant"])
    return {"triton": triton.__version__, "target": "cuda sm_90", "kernels": entries}


def problems(report):
    """Every violated limit, as one line each: tensor cores unused, shared memory over the
    limit, register spills."""
    found = []
    for entry in report["kernels"]:
        name = entry["variant"]
        gmma = entry["sass_counts"]["HGMMA"] + entry["sass_counts"]["QGMMA"]
        if entry["kernel"] in MATRIX_KERNELS and (entry["ptx_wgmma"] == 0 or gmma == 0):
            found.append(f"{name}: no wgmma / GMMA instructions")
        if entry["shared_bytes"] > SHARED_MEMORY_LIMIT:
            found.append(f"{name}: {entry['shared_bytes']} bytes of shared memory > {SHARED_MEMORY_LIMIT}")
        spills = entry["local_bytes"] + entry["sass_counts"]["LDL"] + entry["sass_counts"]["STL"]
        if spills:
            found.append(f"{name}: spills ({entry['local_bytes']} local bytes, "
                         f"{entry['sass_counts']['LDL']} LDL, {entry['sass_counts']['STL']} STL)")
    return found


def format_report(report):
    lines = [f"sm_90 resources (triton {report['triton']}; * = launched by the trainer)",
             f"{'variant':<122} {'regs':>4} {'smem':>7} {'instr':>6} {'GMMA':>5} {'wgmma':>5} {'LDL/STL':>7} "
             f"{'MUFU':>5}"]
    for e in report["kernels"]:
        counts = e["sass_counts"]
        mark = "*" if e.get("trainer") else " "
        lines.append(f"{mark} {e['variant']:<120} {e['registers']:>4} {e['shared_bytes']:>7} "
                     f"{e['sass_instructions']:>6} {counts['HGMMA'] + counts['QGMMA']:>5} {e['ptx_wgmma']:>5} "
                     f"{counts['LDL'] + counts['STL']:>7} {counts['MUFU']:>5}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"store the report in {REPORT_PATH.name}")
    flags = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("sm90_report.py compiles kernels: unset TRITON_INTERPRET", file=sys.stderr)
        sys.exit(2)
    report = build_report()
    print(format_report(report))
    for line in problems(report):
        print("PROBLEM", line)
    if flags.write:
        REPORT_PATH.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
        print(f"wrote {REPORT_PATH}")
    sys.exit(1 if problems(report) else 0)


if __name__ == "__main__":
    main()
