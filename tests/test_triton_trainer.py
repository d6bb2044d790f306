"""The trainer on the Triton path against the trainer on the reference path, step by step.

Two `Trainer`s from one seed on the same batches: one with --kernels=triton (every Triton kernel
of kernels.py, run by the Triton interpreter with tests/helpers/interpreter_shim.py's fixes, in the
interpreted worker process) and one with --kernels=reference (the plain-torch references, the
FP8 MLP emulated with --fp8_on_cpu). The FP8 calibration pass, then two optimizer steps through
a stage change:
  step 0, stage 0: 32 tokens, full-vocabulary softmax, targets t+1..t+3 and the prefix target,
      windows of 1 block;
  step 1, stage 1: 96 tokens, 512 sampled-softmax candidates, targets t+1, t+2 and the prefix,
      the long window grown to 2 blocks (YaRN rescales the long layer's rotary), the head untied.
The model: 3 layers, width 128, 2 heads of 64; layer 0 paired heads (the doubled sequence, so
its 128-position window spans 64 tokens and cuts into stage 1's documents: the attention
kernels' window masking is exercised) with narrow (32-wide, fully rotated) QK; layer 1
attention-free with a parallel MLP; layer 2 long-window with XSA, composed attention and an
output gate; the dense trunk and token gates; the FP8 MLP (record 92's scale rules); the hashed
n-gram table (bf16) and a sparse value-embedding table, both trained by SparseRowAdam.
The Triton trainer must launch the 15 Triton kernels its calls' rules pick (nothing is timed on a
CPU: the persistent descriptor FP8 GEMMs, the one-kernel attention backward), the reference
trainer none. The comparison runs once more with the pointer mixture (POINTER: its three pointer
kernels, the cross-entropy kernel's mixture term).

What is compared, at every step (and after the calibration):
  - the step's two losses (next-token loss, objective);
  - every gradient the optimizers receive (captured as the first optimizer steps) and the
    n-gram and value-embedding tables' summed row gradients (captured as their Adam steps);
  - every entry of the model's state dict after the step (parameters, the n-gram table, the FP8
    amax buffers) and the sparse Adams' per-row second moments and update events.
After the comparison the Triton trainer is given the reference trainer's whole state (model,
optimizers, table, sparse Adam states), and both start the next step from identical state. So
each step's differences are that step's kernels', not the previous step's noise amplified:
without the resync, step 1 compares the responses to step 0's rounding noise (measured: the
token-gate MLP's gradients differ by 50%, its step-0 update having been lr * the sign of noise,
the MLP weights' gradients and Muon updates by 4-6%). Every piece of state the Triton trainer
wrote is compared before it is replaced, so a kernel that writes a wrong amax or moment still
fails the test.

Precision. The bounds hold only because both trainers compute in fp32:
  --compute_dtype=float32. Under bf16 autocast the two paths round at different points (flash
      attention against SDPA on bf16 inputs; the Triton cross-entropy stores its logit gradient
      in the logits' dtype and rounds it again when the backward scales it by the upstream
      gradient, the reference rounds once), so activations and gradients differ by one bf16 ulp
      (2^-8) in a large share of elements; the FP8 backward re-quantizes them to e5m2 (2 mantissa
      bits), which turns that into ~4e-2 relative gradient differences (measured with bf16
      logits: the Triton cross-entropy alone, all else reference, moved the MLP gradients by
      4e-2). A bound that loose would pass most bugs.
  --fp8_qkv=false --fp8_head=false for the same reason: those layers cast their input to bf16 and
      return bf16, so q, k, v or the logits (and the cross-entropy's gradient) would be bf16.
      The FP8 MLP keeps every FP8 kernel in the comparison (the cast, the matmul, both epilogues
      of the fused matmul+quantize); fp8_linear runs the same kernels with other scale rules,
      which are shared code on both paths.
  Muon orthogonalizes in fp32 on both sides (the Triton trainer's Grams still go through
      kernels.xxt). The Triton path's default is bf16; at step 0 the gradients of the
      zero-initialized output matrices have rank <= 32 (tokens) < 128, and in bf16 the rounding
      (2^-9) fills the null space with singular values ~1e-3 of the largest, which the anvil
      polynomials raise by up to their gain (the product of the six linear coefficients, ~650) to
      O(1): two implementations then differ by percents of the update (measured 1-6% for the MLP
      output matrices, whose gradients agreed to the bit). On a GPU both paths orthogonalize in
      bf16 alike (orthogonalize's CUDA default), so this is no Triton-vs-reference difference.

Bounds (u = 2^-24 ~ 6e-8, fp32's unit roundoff):
  LOSS_RTOL = 1e-5. The forward is the same fp32 math in other summation orders: a row's
      logsumexp over up to 50,304 columns differs by a few u * log2(columns) ~ 1e-6 relative, the
      mean over rows does not grow that; an FP8 code that flips (below) moves one activation by
      2^-4 and the loss by ~1e-7. Measured: both steps' losses equal to the bit.
  GRAD_RTOL = 1e-3 of each gradient's norm, plus GRAD_ATOL_OF_GLOBAL = 1e-6 of the step's
      global gradient norm G. Summation order alone: ~u * sqrt(terms) ~ 1e-5 at most, measured
      <= 5e-6. But the FP8 MLP quantizes bf16 copies of fp32 activations that differ by ~1e-7: a
      bf16 value changes in ~1e-7 / 2^-8 ~ 3e-5 of the elements and then its e4m3 / e5m2 code in
      ~1/16 of those, ~0.1 flips per step here; one flip at (t, j) changes a weight gradient by
      ~2^-4 / sqrt(T * width) ~ 6e-4 of its norm. The bound admits one flip. The floor: a
      gradient that is zero in exact arithmetic (behind the zero-initialized output matrices at
      step 0) is rounding noise of the larger terms that cancel in it, ~u * G * sqrt(terms)
      ~ 1e-6 G (measured <= 1e-7 G; such a tensor's relative difference is O(1)). Measured:
      <= 5e-6 of the norm, 5e-5 for a 5-entry bias whose gradient is 3e-5 of G; the worst
      tensor is at 2% of its bound.
  Muon (hidden matrices): the update differs by at most
      MUON_GAIN * rho_g + MUON_FLOOR of the update's norm, rho_g the tensor's relative gradient
      difference. MUON_GAIN = 2048: the anvil polynomials raise a small singular value's error by
      up to ~650 (the product of their linear coefficients), times up to ~3 for the momentum
      mix (the direction lerp(g, rails, mu) can be shorter than g when the steps' gradients
      disagree). MUON_FLOOR = 1e-3: with identical gradients the Grams still differ in summation
      order (kernels.xxt against X @ X^T), ~1e-6 relative each, raised by the same ~650. The
      lane equalizer rescales lanes and keeps their relative errors. Measured: <= 1.4e-5 of the
      update, 1% of the bound.
  Adam-family (Adam and the tables' SparseRowAdam), elementwise: Adam's first step is
      lr * sign(g) and its second lr * m_hat / sqrt(v_hat), a function of g / |g|: an element
      whose gradient is at the rounding-noise level takes an lr-sized step of either sign, which
      no tolerance below lr can absorb. So elements whose gradients the two paths disagree on by
      more than DETERMINED = 1e-3 of their size are left out (their gradients are compared
      above); elsewhere the update's sensitivity |d(m_hat / sqrt(v_hat)) / dg| <= ~1.5 / |g|
      bounds the difference by ~1.5e-3 lr, and the bound is ADAM_LR_FRACTION = 1e-2 of the
      element's learning rate, plus, for the bf16 n-gram table, one bf16 ulp of the stored value
      (an update that lands near a rounding boundary stores the neighbouring bf16 value).
      Measured: the worst is one such bf16 ulp in the table (0.42 of its bound), elsewhere <= 3e-2
      of the bound; left out are <= 0.4% of the entries of a tensor with a real gradient and most
      of those whose gradient is zero in exact arithmetic.
  Buffers (FP8 amaxes, call counts, loss units), the gradient sinks: BUFFER_RTOL = 1e-3 (an
      amax is a max of values compared to GRAD_RTOL); the sparse Adams' row moments (EMAs of
      mean g^2): 2 * GRAD_RTOL; their events exactly.

A kernel bug moves these by far more. Planted one at a time (in a copy of the repository), each
of these fails the test: in the Triton path the softcap shift of the cross-entropy kernel, the
sign of the RoPE rotation (forward; backward), the attention's window check dropped, an
off-by-one window in the attention's dK/dV kernel (gradients 2e-2 off) and in composed
attention's (3e-2), the X X^T kernel skipping its first K slab, the sparse Adam kernel without
its bias correction, the FP8 casts recording no amax; in the reference path the ReLU^2
gradient's factor 2 dropped, an off-by-one attention window, the RoPE sign, the sparse Adam
bias correction. (X X^T's tiling is not exercised: every matrix here is one 128 x 128 tile.)

Runtime: ~45-55 s on 2 cores, almost all of it the interpreted Triton trainer.
"""
import json
import sys

import numpy as np
import pytest
import torch
from interpreter_shim import REPO_ROOT, isolated

sys.path.insert(0, str(REPO_ROOT))
from tiny_runs import synthetic_documents  # noqa: E402

import kernels  # noqa: E402
import optim  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from data.shards import write_shard  # noqa: E402
from machinery.checkpoint import NGRAM_TABLE_KEY  # noqa: E402
from machinery.warm_up import restore, snapshot  # noqa: E402

interpreted = isolated(interpret=True)

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-3
GRAD_ATOL_OF_GLOBAL = 1e-6
MUON_GAIN = 2048.0
MUON_FLOOR = 1e-3
DETERMINED = 1e-3
ADAM_LR_FRACTION = 1e-2
BUFFER_RTOL = 1e-3

PAIRED_WINDOW_TOKENS = tg.WINDOW_BLOCK // 2   # layer 0's short window (1 block of positions), in tokens
STAGES = [
    dict(end=0.5, tokens_per_rank=32, max_doc_len=32, short_window=1, long_window=1, mtp_weights=[1, 0.5, 0.25],
         prefix_weight=0.25),
    dict(end=1.0, tokens_per_rank=96, max_doc_len=96, short_window=1, long_window=2, mtp_weights=[1, 0.5],
         prefix_weight=0.25, candidates=512),
]
CONFIG = [
    "--preset", "cpu", "--compile=false", "--cuda_graphs=false", "--compute_dtype=float32",
    "--pointer_mixture=false",     # (the pointer: pointer_comparison's, below)
    "--fp8_mlp=true", "--fp8_qkv=false", "--fp8_head=false", "--fp8_on_cpu=true",
    "--num_layers=3", "--model_dim=128", "--num_heads=2", "--head_dim=64", "--mlp_hidden=128",
    "--long_window_layers=[2]", "--attention_free_layers=[1]", "--num_value_embeds=1",
    "--narrow_qk_layers=[0]", "--narrow_qk_dim=32", "--paired_head_layers=[0]",
    "--xsa_layers=[2]", "--composed_layers=[2]", "--composed_window=32", "--attn_gate_layers=[2]",
    "--token_gates=true", "--token_gates_split=2", "--trunk=dense", "--skip_layers=[0,1]", "--snapshot_layer=1",
    "--parallel_mlp_layers=[1]", "--qk_ortho_heads=0",
    "--ngram_rows=4096", "--ngram_dtype=bfloat16", "--ngram_lr=0.02", "--value_embed_sparse=true",
    "--batch_ranks=1", "--num_iterations=2", "--untie_frac=0.5", "--warmup_steps=0",
    "--val_tokens=32", "--val_tokens_per_rank=32",
    "--stages=" + json.dumps(STAGES),
]
TRITON_KERNELS = {"_fp8_cast_kernel", "_fp8_matmul_tma_kernel", "_fp8_matmul_quant_tma_kernel", "_attn_fwd_kernel",
                  "_attn_bwd_fused_kernel", "_softcap_ce_kernel",
                  "_xxt_kernel", "_qk_norm_rope_fwd_kernel", "_qk_norm_rope_bwd_kernel",
                  "_dc_fwd_kernel", "_dc_bwd_mix_kernel", "_dc_bwd_q_kernel", "_dc_bwd_kv_kernel",
                  "_add_row_sums_kernel", "_sparse_adam_rows_kernel",
                  "_weight_amax_kernel", "_weight_scales_kernel", "_weight_cast_kernel"}


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    write_shard(d / "e_train_000001.bin", synthetic_documents(np.random.default_rng(0), 4_000))
    return d


# ---------------------------------------------------------------------------------------------
# The two trainers (in the interpreted worker)


def _trainer(which, shards_dir, extra=()):
    h = tg.parse_config(CONFIG + list(extra) + [f"--kernels={which}", f"--train_files={shards_dir}/e_train_*.bin",
                                  f"--val_files={shards_dir}/e_train_*.bin", f"--log_dir={shards_dir}"])
    trainer = tg.Trainer(h, tg.ProcessGroup(0, 1, 0, torch.device("cpu")), tg.RunLog(shards_dir, active=False))
    for opt in trainer.optimizers:
        if isinstance(opt, optim.Muon):
            opt.ortho_dtype = torch.float32          # see the module docstring
    return h, trainer


def _sparse_adams(trainer):
    """name -> (SparseRowAdam, the state-dict key of its table)."""
    adams = {"ngram": (trainer.tables.ngram_adam, NGRAM_TABLE_KEY)}
    adams.update({f"value_embeds.{i}": (adam, f"value_embeds.{i}.weight")
                  for i, adam in enumerate(trainer.tables.value_adams)})
    return adams


def _capture_gradients(trainer):
    """A dict that each train_step fills with the gradients its optimizers receive: every
    parameter's (as the first optimizer steps) and the sparse tables' row sums, keyed by the
    state-dict key of what they update."""
    grads = {}
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    first = trainer.optimizers[0]
    first_step, sparse_step = first.launch_step, trainer.tables.step   # optim.step_together's first call

    def step():
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        grads[names[id(p)]] = p.grad.detach().double().clone()
        return first_step()

    def step_sparse_tables():
        table = trainer.model.ngram.table
        rows, entries = (torch.cat(parts) for parts in zip(*trainer.tables.ngram_entries))
        grads[NGRAM_TABLE_KEY] = torch.zeros(table.shape, dtype=torch.float64).index_add_(0, rows,
                                                                                             entries.double())
        for i, pending in enumerate(trainer.tables.value_grads):
            grads[f"value_embeds.{i}.weight"] = pending.sums.double().clone()
        return sparse_step()

    first.launch_step, trainer.tables.step = step, step_sparse_tables
    return grads


def _state(trainer):
    """Everything a step can change that is compared: the model's state dict and the sparse
    Adams' moments and events."""
    state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for name, (adam, _) in _sparse_adams(trainer).items():
        state[f"{name}:moment"], state[f"{name}:last"] = adam.moment.clone(), adam.last.clone()
    return state


def _give_state(dst, src):
    """dst takes src's model, optimizer, n-gram table and sparse Adam state."""
    restore(dst, snapshot(src))
    dst.model.ngram.table.copy_(src.model.ngram.table)
    for name, (adam, _) in _sparse_adams(src).items():
        _sparse_adams(dst)[name][0].load_state_dict(adam.state_dict())


def _learning_rates(trainer):
    """State-dict key -> (optimizer kind, the element's learning rate) for every trained tensor."""
    names = {id(p): name for name, p in trainer.model.named_parameters()}
    rates = {}
    for opt in trainer.optimizers:
        kind = "muon" if isinstance(opt, optim.Muon) else "adam"
        for group in opt.param_groups:
            for p in group["params"]:
                rates[names[id(p)]] = (kind, group["lr"] * group.get("lr_scale", 1.0))
    for adam, key in _sparse_adams(trainer).values():
        rates[key] = ("sparse", adam.lr)
    return rates


def _norm(x):
    return x.double().norm().item()


def _compare(before, ref, tri, gref, gtri, rates):
    """The differences of one step (or of the calibration when gref is empty), as numbers."""
    out = dict(grads={}, muon={}, elementwise={}, buffers={}, exact={})
    G = sum(_norm(g) ** 2 for g in gref.values()) ** 0.5
    out["global_grad_norm"] = G
    for key in gref:
        out["grads"][key] = (_norm(gtri[key] - gref[key]), _norm(gref[key]))
    for key in ref:
        a, b = ref[key], tri[key]
        if key.endswith(":last") or key not in rates:
            if a.dtype.is_floating_point:
                out["buffers"][key] = (_norm(b - a), _norm(a))
            else:
                out["exact"][key] = bool(torch.equal(a, b))
            continue
        kind, lr = rates[key]
        step_ref, step_tri = a.double() - before[key].double(), b.double() - before[key].double()
        if kind == "muon":
            out["muon"][key] = (_norm(step_tri - step_ref), _norm(step_ref))
            continue
        g_ref, g_tri = gref.get(key), gtri.get(key)
        if g_ref is None:              # no gradient (the untied head at step 0): it must not move
            moved = _norm(step_tri) + _norm(step_ref) != 0
            out["elementwise"][key] = (float("inf") if moved else 0.0, 0, a.numel())
            continue
        g_ref, g_tri = g_ref.reshape(a.shape), g_tri.reshape(a.shape)
        determined = (g_tri - g_ref).abs() <= DETERMINED * g_ref.abs()
        tol = ADAM_LR_FRACTION * lr
        if a.dtype == torch.bfloat16:  # one bf16 ulp of the stored value
            tol = tol + torch.ldexp(torch.ones_like(a, dtype=torch.float64),
                                    torch.frexp(a.double())[1] - 8).masked_fill(a == 0, 0)
        ratio = ((step_tri - step_ref).abs() / tol)[determined]
        worst = ratio.max().item() if ratio.numel() else 0.0
        if not torch.isfinite(step_tri).all():   # a NaN gradient leaves every element undetermined
            worst = float("nan")
        out["elementwise"][key] = (worst, int((~determined).sum()), a.numel())
    return out


@interpreted
def compare_trainers(shards_dir, extra=()):
    """Calibrate and run two steps on both trainers; returns the differences of each (a list
    of _compare's dicts with the losses and the batches' longest documents), the Triton
    kernels each trainer launched, and which kernel functions each trainer picked."""
    launched = {"reference": set(), "triton": set()}
    side = ["reference"]
    original = kernels._launch

    def recorded(kernel, grid, config, **args):
        launched[side[0]].add(kernel.__name__)
        original(kernel, grid, config, **args)
    kernels._launch = recorded
    try:
        h, ref = _trainer("reference", shards_dir, extra)
        _, tri = _trainer("triton", shards_dir, extra)
        picked = {name: (trainer.kernels.attention.__name__, trainer.kernels.fp8_mlp.func.__name__,
                         trainer.kernels.xxt is not None)
                  for name, trainer in (("reference", ref), ("triton", tri))}
        gref, gtri = _capture_gradients(ref), _capture_gradients(tri)
        files = tg.shards_of(h.train_files)
        calibration = tg.first_batch(h, files, ref.mine)
        before = _state(ref)
        unequal = [k for k, v in _state(tri).items() if not torch.equal(v, before[k])]
        assert not unequal, f"the trainers start from different states: {unequal}"
        ref.calibrate_fp8(calibration)
        side[0] = "triton"
        tri.calibrate_fp8(calibration)
        side[0] = "reference"
        results = [dict(step="calibration", **_compare(before, _state(ref), _state(tri), {}, {}, {}))]
        _give_state(tri, ref)
        loader = TrainLoader(files, tg.batch_tokens(h))
        for step in range(h.num_iterations):
            ref.advance_to(step)
            tri.advance_to(step)
            before = _state(ref)
            unequal = [k for k, v in _state(tri).items() if not torch.equal(v, before[k])]
            assert not unequal, f"step {step} starts from different states: {unequal}"
            stage = h.stages[tg.stage_index(h, step)]
            slices = loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, ref.mine)
            rates = _learning_rates(ref)
            gref.clear()
            gtri.clear()
            loss_ref = ref.train_step(step, slices).tolist()
            side[0] = "triton"
            loss_tri = tri.train_step(step, slices).tolist()
            side[0] = "reference"
            result = _compare(before, _state(ref), _state(tri), gref, gtri, rates)
            result.update(step=step, loss=(loss_ref, loss_tri),
                          longest_document=max(int(s.cu_seqlens.diff().max()) for s in slices))
            results.append(result)
            _give_state(tri, ref)
    finally:
        kernels._launch = original
    return results, launched, picked


@pytest.fixture(scope="module")
def comparison(shards):
    return compare_trainers(str(shards))


# The pointer mixture (PR 379) on the same model: its pointer kernels, and the cross-entropy
# kernel with the mixture's next-token term (the sampled stage holds the <copy> slot).
POINTER = ["--pointer_mixture=true", "--pointer_dim=16", "--pointer_band=32", "--pointer_val_band=32"]
POINTER_KERNELS = {"_pointer_fwd_kernel", "_pointer_bwd_q_kernel", "_pointer_bwd_k_kernel"}


@pytest.fixture(scope="module")
def pointer_comparison(shards):
    return compare_trainers(str(shards), POINTER)


# ---------------------------------------------------------------------------------------------
# The checks


def test_the_two_trainers_run_their_own_kernels(comparison):
    _, launched, picked = comparison
    assert launched == {"reference": set(), "triton": TRITON_KERNELS}
    assert picked["triton"] == ("flash_attn_varlen", "fp8_relu2_mlp", True)
    assert picked["reference"] == ("attention_reference", "fp8_relu2_mlp_reference", False)


def test_the_schedule_reaches_what_the_comparison_needs(comparison):
    """Stage 1's documents are longer than the paired layer's window, so the window masks."""
    results = comparison[0]
    assert [r["step"] for r in results] == ["calibration", 0, 1]
    assert results[2]["longest_document"] > PAIRED_WINDOW_TOKENS


def test_the_step_losses_agree(comparison):
    for r in comparison[0][1:]:
        (ref, tri) = r["loss"]
        for name, a, b in zip(("next-token loss", "objective"), ref, tri):
            assert abs(a - b) <= LOSS_RTOL * abs(a), f"step {r['step']} {name}: reference {a}, triton {b}"


def test_the_gradients_agree(comparison):
    for r in comparison[0][1:]:
        floor = GRAD_ATOL_OF_GLOBAL * r["global_grad_norm"]
        bad = {k: f"{d:.3g} of {n:.3g}" for k, (d, n) in r["grads"].items() if not d <= GRAD_RTOL * n + floor}
        assert not bad, f"step {r['step']}: gradients differ: {bad}"


def test_the_updates_agree(comparison):
    for r in comparison[0][1:]:
        floor = GRAD_ATOL_OF_GLOBAL * r["global_grad_norm"]
        bad = {}
        for key, (d, n) in r["muon"].items():
            dg, ng = r["grads"][key]
            if 0 < ng <= floor:        # a gradient at the noise level orthogonalizes to noise
                continue
            rho = dg / ng if ng else 0.0
            if not d <= (MUON_GAIN * rho + MUON_FLOOR) * n:
                bad[key] = f"{d / max(n, 1e-300):.3g} of the update (gradients {rho:.3g})"
        for key, (worst, _, _) in r["elementwise"].items():
            if not worst <= 1.0:
                bad[key] = f"{worst:.3g} times the bound"
        assert not bad, f"step {r['step']}: updates differ: {bad}"


def test_the_buffers_and_optimizer_tables_agree(comparison):
    for r in comparison[0]:
        bad = {}
        for key, (d, n) in r["buffers"].items():
            rtol = 2 * GRAD_RTOL if key.endswith(":moment") else BUFFER_RTOL
            if not d <= rtol * n:
                bad[key] = f"{d:.3g} of {n:.3g}"
        bad.update({key: "differs" for key, equal in r["exact"].items() if not equal})
        assert not bad, f"{r['step']}: state differs: {bad}"


def test_the_pointer_mixture_agrees_on_both_paths(pointer_comparison):
    """With the pointer mixture the Triton trainer launches the pointer kernels too, and its
    losses, gradients (the pointer head's included), updates and state agree with the reference
    trainer's within the bounds above."""
    _, launched, _ = pointer_comparison
    assert launched == {"reference": set(), "triton": TRITON_KERNELS | POINTER_KERNELS}
    for check in (test_the_step_losses_agree, test_the_gradients_agree, test_the_updates_agree,
                  test_the_buffers_and_optimizer_tables_agree):
        check(pointer_comparison)
    for r in pointer_comparison[0][1:]:
        assert {"pointer.query", "pointer.key", "pointer.sink_key", "pointer.query_gain"} <= set(r["grads"])
