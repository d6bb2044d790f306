"""GPU check of kernels.py (SPEC section 7): GPU tests, kernel timings against the torch path at
the speedrun shapes, a few training steps of the 1-GPU preset on synthetic tokens, one table.

    python bench/bench_gpu.py            # on an H100/H200: appends the table to bench/results.md
    python bench/bench_gpu.py --dry      # on CPU: tiny shapes under the Triton interpreter, no file written

Each kernel line: our time and torch's (ms, median of triton.testing.do_bench), TFLOP/s where
the work is a matmul, and the speed ratio torch_ms / our_ms with the target it must reach:
  fp8_matmul >= 0.9 (torch._scaled_mm, fast accumulation, same operands);
  flash_attn_varlen forward+backward >= 1.0 (scaled_dot_product_attention's flash backend on the
    same work: equal-length causal documents, no window);
  softcap_cross_entropy forward+backward >= 2.0 (plain torch softcap + F.cross_entropy).
Other lines (fp8 layers against bf16 torch, windowed attention, X X^T) are informational.
The dry mode runs every line once at tiny shapes so that this script cannot rot unnoticed; its
numbers mean nothing.
"""
import argparse
import dataclasses
import datetime
import os
import pathlib
import subprocess
import sys
import tempfile
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS_PATH = pathlib.Path(__file__).resolve().parent / "results.md"

# Per-GPU speedrun shapes (SPEC 3) and the tiny ones of the dry mode.
GPU_SHAPES = dict(tokens=49152, width=768, hidden=3072, vocab=50304, candidates=10240, doc_len=3072,
                  window=1664, muon=((16, 768, 768), (8, 768, 3072)))
DRY_SHAPES = dict(tokens=96, width=32, hidden=64, vocab=300, candidates=100, doc_len=48,
                  window=20, muon=((2, 32, 32), (2, 32, 64)))
TRAIN_STEPS = 20          # training steps timed on the GPU (each stage shape gets its warm-up steps)
# The dry mode trains one step of a shrunken CPU preset: it checks the command line, not speed.
DRY_TRAIN_OVERRIDES = ["--preset", "cpu", "--device=cpu", "--num_iterations=1", "--val_tokens=8192", "--num_layers=2",
                       "--model_dim=64", "--num_heads=1", "--head_dim=64", "--mlp_hidden=128", "--bigram_rows=1024",
                       "--long_window_layers=[1]"]
SYNTHETIC_DOC_LEN = 1000  # tokens between <|endoftext|> tokens in the synthetic shards
BOS = 50256               # <|endoftext|>, which starts every document
SHARD_MAGIC, SHARD_VERSION, SHARD_HEADER_INTS = 20240520, 1, 256


@dataclasses.dataclass
class Line:
    """One row of the table."""
    name: str
    shape: str
    ours_ms: float
    torch_ms: float
    flops: float = 0.0       # of one call, for TFLOP/s; 0 when not a matmul-bound line
    target: float = 0.0      # minimum torch_ms / ours_ms; 0 when informational

    @property
    def ratio(self):
        return self.torch_ms / self.ours_ms

    def cells(self):
        tflops = (lambda ms: f"{self.flops / ms / 1e9:.0f}") if self.flops else (lambda ms: "-")
        verdict = "-" if not self.target else ("ok" if self.ratio >= self.target else "MISSED")
        return [self.name, self.shape, f"{self.ours_ms:.3f}", f"{self.torch_ms:.3f}", tflops(self.ours_ms),
                tflops(self.torch_ms), f"{self.ratio:.2f}", f">= {self.target}" if self.target else "-", verdict]


HEADER = ["kernel", "shape", "ours ms", "torch ms", "ours TFLOP/s", "torch TFLOP/s", "torch/ours", "target", ""]


def markdown_table(lines):
    rows = [HEADER, ["---"] * len(HEADER)] + [line.cells() for line in lines]
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


class Timer:
    """Median milliseconds of a callable: triton.testing.do_bench on a GPU, one wall-clock run dry."""

    def __init__(self, dry):
        self.dry = dry

    def __call__(self, fn):
        if self.dry:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100)


def _fp8(shape, device, column_major=False):
    import torch
    t = torch.randn(*shape[::-1] if column_major else shape, device=device).to(torch.float8_e4m3fn)
    return t.t() if column_major else t


def bench_fp8_matmul(shapes, device, timer):
    import torch
    import kernels
    T, D, H = shapes["tokens"], shapes["width"], shapes["hidden"]
    problems = [("mlp up", T, D, H), ("mlp down", T, H, D), ("mlp down wgrad", D, T, H), ("qkv", T, D, 3 * D),
                ("lm_head", T, D, shapes["candidates"])]
    scale = torch.ones((), device=device)
    lines = []
    for name, m, k, n in problems:
        a, b = _fp8((m, k), device), _fp8((k, n), device, column_major=True)
        ours = timer(lambda: kernels.fp8_matmul(a, b, scale, scale, torch.bfloat16))
        theirs = timer(lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16,
                                                use_fast_accum=True))
        lines.append(Line(f"fp8_matmul {name}", f"{m}x{k}x{n}", ours, theirs, 2.0 * m * n * k, target=0.9))
    return lines


def _forward_backward(fn, inputs, grad_output=None):
    """A callable running fn(*inputs) and its backward (grads of the inputs that require them)."""
    import torch

    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad],
                            grad_output if grad_output is not None else torch.ones_like(out))
    return run


def bench_fp8_layers(shapes, device, timer):
    import torch
    import kernels
    T, D, H = shapes["tokens"], shapes["width"], shapes["hidden"]
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    w_up = (torch.randn(H, D, device=device) * 0.02).bfloat16().requires_grad_(True)
    w_down = (torch.randn(D, H, device=device) * 0.02).bfloat16().requires_grad_(True)
    state = kernels.new_fp8_mlp_state(device)
    ours = timer(_forward_backward(lambda x, u, d: kernels.fp8_relu2_mlp(x, u, d, state), [x, w_up, w_down]))
    theirs = timer(_forward_backward(lambda x, u, d: bf16_relu2_mlp(x, u, d), [x, w_up, w_down]))
    mlp = Line("fp8_relu2_mlp fwd+bwd vs bf16", f"{T}x{D}x{H}", ours, theirs, 6 * 2.0 * T * D * H)
    linear_state = kernels.new_fp8_linear_state(device)
    w_qkv = (torch.randn(3 * D, D, device=device) * 0.02).bfloat16().requires_grad_(True)
    ours = timer(_forward_backward(lambda x, w: kernels.fp8_linear(x, w, linear_state), [x, w_qkv]))
    theirs = timer(_forward_backward(lambda x, w: x @ w.t(), [x, w_qkv]))
    linear = Line("fp8_linear fwd+bwd vs bf16", f"{T}x{D}x{3 * D}", ours, theirs, 3 * 2.0 * T * D * 3 * D)
    return [mlp, linear]


def bf16_relu2_mlp(x, w_up, w_down):
    import torch
    return torch.relu(x @ w_up.t()).square() @ w_down.t()


def bench_attention(shapes, device, timer, dry):
    import torch
    import torch.nn.functional as F
    import kernels
    T, L = shapes["tokens"], shapes["doc_len"]
    docs = T // L
    lines = []
    for d, heads in ((128, 6), (64, 12)):
        q, k, v = (torch.randn(T, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad_o = torch.randn(T, heads, d, device=device, dtype=torch.bfloat16)
        cu_seqlens = torch.arange(0, T + 1, L, device=device, dtype=torch.int32)
        scale = d ** -0.5
        flops = 3.5 * 2.0 * docs * heads * L * L * d  # causal: forward 2 L^2 d per head, backward 2.5x
        ours = timer(_forward_backward(lambda q, k, v: kernels.flash_attn_varlen(q, k, v, cu_seqlens, L, 0, scale),
                                       [q, k, v], grad_o))

        def sdpa(q, k, v):
            batch = [t.view(docs, L, heads, d).transpose(1, 2) for t in (q, k, v)]
            if dry:
                return F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale)
        theirs = timer(_forward_backward(sdpa, [q, k, v], grad_o.view(docs, L, heads, d).transpose(1, 2)))
        lines.append(Line(f"flash_attn_varlen fwd+bwd d={d}", f"{docs}x{L} tok, {heads} heads", ours, theirs,
                          flops, target=1.0))
        windowed = timer(_forward_backward(
            lambda q, k, v: kernels.flash_attn_varlen(q, k, v, cu_seqlens, L, shapes["window"], scale),
            [q, k, v], grad_o))
        lines.append(Line(f"  same, window {shapes['window']}", f"{docs}x{L} tok, {heads} heads", windowed, theirs))
    return lines


def bench_cross_entropy(shapes, device, timer):
    import torch
    import torch.nn.functional as F
    import kernels
    T = shapes["tokens"]
    lines = []
    for columns in (shapes["vocab"], shapes["candidates"]):
        logits = torch.randn(T, columns, device=device, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, columns, (T, 1), device=device)
        weights = torch.ones(1, device=device)
        ours = timer(_forward_backward(lambda x: kernels.softcap_cross_entropy(x, targets, weights).sum(), [logits]))
        theirs = timer(_forward_backward(
            lambda x: F.cross_entropy(kernels.softcap(x), targets[:, 0], reduction="sum"), [logits]))
        lines.append(Line("softcap_cross_entropy fwd+bwd", f"{T}x{columns}", ours, theirs, target=2.0))
    return lines


def bench_xxt(shapes, device, timer):
    import torch
    import kernels
    lines = []
    for shape in shapes["muon"]:
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        ours = timer(lambda: kernels.xxt(x))
        theirs = timer(lambda: x @ x.mT)
        batch, m, n = shape
        lines.append(Line("xxt", "x".join(map(str, shape)), ours, theirs, 2.0 * batch * m * m * n))
    return lines


def run_gpu_tests(dry):
    """The GPU tests of tests/test_kernels.py (collected only in the dry mode)."""
    command = [sys.executable, "-m", "pytest", "-q", str(REPO_ROOT / "tests" / "test_kernels.py"), "-k", "gpu"]
    if dry:
        command.append("--collect-only")
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
    summary = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
    return result.returncode == 0, summary, result.stdout[-4000:] + result.stderr[-2000:]


def write_synthetic_shard(path, num_tokens, generator):
    """A .bin shard (SPEC 3.5) of random tokens with a document start every SYNTHETIC_DOC_LEN."""
    import numpy as np
    tokens = generator.integers(0, BOS, size=num_tokens, dtype=np.uint16)
    tokens[::SYNTHETIC_DOC_LEN] = BOS
    header = np.zeros(SHARD_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, num_tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def time_training(dry, steps):
    """Run train_gpt.py on synthetic shards: `steps` steps of the 1-GPU preset, or in the dry
    mode one step of a shrunken CPU preset. Returns (ok, a one-line summary, output tail)."""
    import numpy as np
    generator = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as data_dir:
        train_tokens = (1 << 16) if dry else (1 << 25)
        write_synthetic_shard(os.path.join(data_dir, "train_000000.bin"), train_tokens, generator)
        write_synthetic_shard(os.path.join(data_dir, "val_000000.bin"), 1 << 17, generator)
        settings = DRY_TRAIN_OVERRIDES if dry else ["--preset", "1gpu", f"--num_iterations={steps}",
                                                    "--val_tokens=65536"]
        command = [sys.executable, str(REPO_ROOT / "train_gpt.py"), *settings,
                   f"--train_files={data_dir}/train_*.bin", f"--val_files={data_dir}/val_*.bin",
                   f"--log_dir={data_dir}/logs"]
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO_ROOT)
        seconds = time.perf_counter() - start
    output = (result.stdout[-3000:] + result.stderr[-3000:]).strip()
    last_step = next((line for line in reversed(result.stdout.splitlines()) if "step_avg" in line), "no step line")
    what = "1 step of a shrunken cpu preset" if dry else f"{steps} steps of the 1gpu preset"
    summary = f"training: {what} on synthetic tokens, {seconds:.1f} s wall with start-up; last line: {last_step}"
    return result.returncode == 0, summary, output


def environment_line(device):
    import torch
    import triton
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO_ROOT).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                           cwd=REPO_ROOT).stdout.strip()
    gpu = torch.cuda.get_device_name(device) if device == "cuda" else "cpu (dry run)"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (f"{date}, {gpu}, torch {torch.__version__}, triton {triton.__version__}, "
            f"commit {commit}{' (with uncommitted changes)' if dirty else ''}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="CPU, tiny shapes, Triton interpreter; writes nothing")
    parser.add_argument("--train-steps", type=int, default=TRAIN_STEPS, help="training steps to time (0: skip)")
    flags = parser.parse_args()
    if flags.dry:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is first imported
        sys.path.insert(0, str(REPO_ROOT / "tests"))
        from interpreter_shim import install_shim
        install_shim()
    sys.path.insert(0, str(REPO_ROOT))
    import torch
    if not flags.dry and not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA GPU; run it with --dry to check it on CPU", file=sys.stderr)
        sys.exit(2)
    device = "cpu" if flags.dry else "cuda"
    shapes = DRY_SHAPES if flags.dry else GPU_SHAPES
    timer = Timer(flags.dry)
    torch.manual_seed(0)

    tests_ok, tests_summary, tests_output = run_gpu_tests(flags.dry)
    print(f"GPU tests: {tests_summary}")
    if not tests_ok:
        print(tests_output)
    lines = (bench_fp8_matmul(shapes, device, timer) + bench_fp8_layers(shapes, device, timer)
             + bench_attention(shapes, device, timer, flags.dry) + bench_cross_entropy(shapes, device, timer)
             + bench_xxt(shapes, device, timer))
    table = markdown_table(lines)
    print(table)

    train_note = "training: skipped"
    train_ok = True
    if flags.train_steps:
        train_ok, summary, output = time_training(flags.dry, flags.train_steps)
        train_note = summary if train_ok else f"training: FAILED\n```\n{output}\n```"
        print(train_note)

    report = (f"\n## {environment_line(device)}\n\nGPU tests: {tests_summary}\n\n{table}\n\n{train_note}\n")
    if not flags.dry:
        with open(RESULTS_PATH, "a") as f:
            f.write(report)
        print(f"appended to {RESULTS_PATH}")
    missed = [line.name for line in lines if line.target and line.ratio < line.target]
    if missed and not flags.dry:
        print("targets missed: " + ", ".join(missed))
    sys.exit(0 if tests_ok and train_ok else 1)


if __name__ == "__main__":
    main()
