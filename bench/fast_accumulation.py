"""The error of the tensor cores' fast FP8 accumulation against promoted accumulation, at the K
depths of the speedrun's backward GEMMs, measured on a CPU against float64.

    python bench/fast_accumulation.py            # the table (about a minute on two cores)

What is emulated. An sm_90 FP8 wgmma adds the products of one instruction's K slice (32 for fp8)
into its accumulator with a limited precision: DeepSeek-V3's technical report (arXiv 2412.19437,
section 3.3.2) measured about 14 bits retained on H800. Two models of it bound the behaviour:
  truncate   the accumulator, after each 32-product slice, cut toward zero to 14 significand bits
             (a biased model: every cut shrinks the sum);
  nearest    the same, rounded to nearest (unbiased).
"fast" sums every slice of the K loop that way (torch._scaled_mm's use_fast_accum=True, Triton's
default for fp8 dots); "promoted P" does so within each P products (P / 32 slices, the
accumulator started from zero) and adds that into an fp32 sum, rounded to nearest (a dot of
K = P with max_num_imprecise_acc = P: the backward GEMMs' BLOCK_K). Both are compared with the
float64 sum of the same fp8 operands: the relative Frobenius error of an (M, N) output. Beside them: the error of rounding
that output to bf16 (the dtype the gradients are stored in), and the error the fp8 quantization
of the operands itself makes (float64 sums of the quantized against the unquantized operands),
the noise FP8 training already carries.

The decision (`decision`): fast accumulation where even the biased model's error is below the
output's own bf16 rounding, so that it cannot show in the stored gradient; else promoted, every
P products for the longest P of PROMOTION_INTERVALS whose biased error is below that rounding
(kernels.PROMOTION_K is at most the shortest of them over the promoted GEMMs, and as long as its
tiles' shared memory allows).

The operands: what each backward GEMM sums over, with the trainer's casts (per-tensor scale at
the amax, e5m2 gradients, e4m3 activations and weights): gradients heavy-tailed (Student t with
3 degrees of freedom), activations unit-normal (rms-normed rows) or relu^2 of a normal (the MLP's
hidden activation), weights normal; a gradient carries a per-column mean of a tenth of its
spread, so a weight gradient's K terms do not cancel to zero (its sum grows with K).
"""
import argparse
import dataclasses

import torch

SLICE = 32                 # products one fp8 wgmma instruction adds (its K)
PROMOTION_INTERVALS = (128, 256, 512)   # products between promotions measured (a dot's BLOCK_K)
ACC_BITS = 14              # significand bits the fast accumulator keeps (DeepSeek-V3, H800)
FP32_BITS = 24
MEAN_SHARE = 0.1           # a gradient column's mean, as a share of its spread
OUTPUT = (32, 32)          # (M, N) of each measured output: 1,024 sums of K products
SEED = 0


@dataclasses.dataclass(frozen=True)
class Gemm:
    """A backward GEMM of the speedrun: what it sums over and the operands' kinds."""
    name: str
    k: int
    a: str                 # operand kinds: "grad", "act", "relu2", "weight"
    b: str


# The speedrun's backward GEMMs and their sums (train_gpt's speedrun preset: width 768, MLP 2,816,
# packed QKV up to 2,304 wide, 16,384-49,152 tokens a micro-batch, 10,240-50,304 head columns).
GEMMS = (
    Gemm("MLP hidden gradient (relu2_grad: dL/dy @ W_down)", 768, "grad", "weight"),
    Gemm("QKV input gradient (dL/dqkv @ W_qkv)", 2304, "grad", "weight"),
    Gemm("MLP input gradient (dL/dh @ W_up)", 2816, "grad", "weight"),
    Gemm("head input gradient, fewest candidates", 10240, "grad", "weight"),
    Gemm("head input gradient, full vocabulary", 50304, "grad", "weight"),
    Gemm("weight gradients, 16,384 tokens", 16384, "grad", "act"),
    Gemm("weight gradients, 49,152 tokens", 49152, "grad", "act"),
    Gemm("MLP down weight gradient, 49,152 tokens", 49152, "grad", "relu2"),
)


def operand(kind, rows, k, generator):
    """(rows, k) float64 values of an operand kind, unquantized (see the module docstring)."""
    if kind == "grad":
        t = torch.distributions.StudentT(3.0).sample((rows, k)).double()
        return t + MEAN_SHARE * t.std() * torch.randn(rows, 1, generator=generator, dtype=torch.float64)
    x = torch.randn(rows, k, generator=generator, dtype=torch.float64)
    return torch.relu(x) ** 2 if kind == "relu2" else x


def quantized(x, dtype):
    """x at a per-tensor scale mapping its amax to the fp8 maximum, cast to fp8, back in float64
    (at that scale: the products are exact in float64)."""
    scale = x.abs().max() / torch.finfo(dtype).max
    return (x / scale).to(dtype).double() * scale


def round_bits(x, bits, mode):
    """x rounded to `bits` significand bits: toward zero ("truncate") or to nearest ("nearest")."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(1e-300)))
    ulp = torch.exp2(exponent - (bits - 1))
    scaled = x / ulp
    return (torch.trunc(scaled) if mode == "truncate" else torch.round(scaled)) * ulp


def slice_sums(a, b):
    """(M, N, K / SLICE) float64 sums of each slice's products (exact: fp8 products and 32 of them
    fit float64's significand)."""
    m, k = a.shape
    slices = k // SLICE
    return torch.einsum("msj,sjn->mns", a.reshape(m, slices, SLICE), b.reshape(slices, SLICE, -1))


def accumulate(sums, mode, promote_every=None):
    """The fast accumulator over the slices (promote_every: slices between promotions into an
    fp32 sum, None: never)."""
    acc = torch.zeros(sums.shape[:2], dtype=torch.float64)
    total = torch.zeros_like(acc)
    for s in range(sums.shape[2]):
        acc = round_bits(acc + sums[..., s], ACC_BITS, mode)
        if promote_every and (s + 1) % promote_every == 0:
            total = round_bits(total + acc, FP32_BITS, "nearest")
            acc.zero_()
    return round_bits(total + acc, FP32_BITS, "nearest") if promote_every else acc


def relative(x, exact):
    return float((x - exact).norm() / exact.norm())


def measure(gemm, generator):
    """{column: relative Frobenius error} of one GEMM (see the module docstring)."""
    m, n = OUTPUT
    fp8 = {"grad": torch.float8_e5m2, "act": torch.float8_e4m3fn, "relu2": torch.float8_e4m3fn,
           "weight": torch.float8_e4m3fn}
    a = operand(gemm.a, m, gemm.k, generator)
    b = operand(gemm.b, n, gemm.k, generator).t()
    qa, qb = quantized(a, fp8[gemm.a]), quantized(b, fp8[gemm.b])
    exact = qa @ qb
    sums = slice_sums(qa, qb)
    row = {"quantization": relative(exact, a @ b), "bf16 rounding": relative(exact.to(torch.bfloat16).double(), exact)}
    for mode in ("truncate", "nearest"):
        row[f"fast {mode}"] = relative(accumulate(sums, mode), exact)
    for interval in PROMOTION_INTERVALS:
        row[f"promoted {interval} truncate"] = relative(accumulate(sums, "truncate", interval // SLICE), exact)
    row["promoted 128 nearest"] = relative(accumulate(sums, "nearest", PROMOTION_INTERVALS[0] // SLICE), exact)
    return row


COLUMNS = ("fast truncate", "fast nearest", *(f"promoted {p} truncate" for p in PROMOTION_INTERVALS),
           "promoted 128 nearest", "bf16 rounding", "quantization")


def decision(row):
    """"fast" where the fast accumulator's error under the biased model stays below the output's
    own bf16 rounding, else "promote every P" for the longest such P (see the module docstring);
    "promote every 128" where none is below it."""
    if row["fast truncate"] <= row["bf16 rounding"]:
        return "fast"
    safe = [p for p in PROMOTION_INTERVALS if row[f"promoted {p} truncate"] <= row["bf16 rounding"]]
    return f"promote every {max(safe, default=PROMOTION_INTERVALS[0])}"


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    torch.manual_seed(SEED)
    generator = torch.Generator().manual_seed(SEED)
    print("| GEMM | K | " + " | ".join(COLUMNS) + " | accumulation |")
    print("| --- | --- |" + " --- |" * (len(COLUMNS) + 1))
    for gemm in GEMMS:
        row = measure(gemm, generator)
        cells = " | ".join(f"{row[c]:.1e}" for c in COLUMNS)
        print(f"| {gemm.name} | {gemm.k:,} | {cells} | {decision(row)} |", flush=True)


if __name__ == "__main__":
    main()
