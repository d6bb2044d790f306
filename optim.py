"""Optimizers for the speedrun trainer: the Muon family for weight matrices, Adam for the rest.

Muon (Keller Jordan) runs SGD with Nesterov momentum on a weight matrix and then replaces the
update by (approximately) the nearest semi-orthogonal matrix, U V^T from the update's SVD
U S V^T. Every direction the update touches then moves by the same amount, so rare directions
are not drowned out by the few dominant ones that raw gradients of transformer matrices have.
The orthogonalization is an odd matrix polynomial X <- aX + (bA + cA^2)X with A = X X^T,
iterated a few times in bf16 after scaling X so that its singular values are at most ~1; each
step pushes every singular value towards 1 (`orthogonalize`, with two published schedules).

NorMuon adds a lane equalizer: after orthogonalization the rows (or columns) of the update can
still have unequal sizes; an EMA of their mean squares rescales each lane to unit RMS, and the
whole update is then rescaled to the Frobenius norm it had, so only the shape changes.

ANVIL-style (variant "anvil") keeps two momentum rails, a fast one that follows recent
gradients and a slow one (beta 0.98) that averages noise away, blends them, applies Nesterov
with a scheduled mu, orthogonalizes with a 6-step schedule, equalizes lanes, and decays a
weight only where the slow rail agrees in sign with it (cautious weight decay: decay never
fights the long-run direction of the gradient).

Adam (bias-corrected) trains embeddings, the head, gates and scalars, with cautious weight
decay of strength lr^2 * wd on coordinates where the update and the weight share a sign, and
can step every k-th call with gradients accumulated in between.

bf16 parameters: the optimizer keeps the low 16 bits of an fp32 master weight in its state
(the "mantissa" sidecar); the bf16 parameter holds the high 16 bits. Updates are computed and
applied in fp32 on the reassembled master, so many small steps do not vanish in bf16 rounding.
The bf16 parameter the model sees is the master truncated towards zero.

Distribution (no DDP; each rank backpropagates its own micro-batches and calls step()):
  - Muon packs the gradients of a dtype's matrices into one buffer of `world` shares (one
    reduce-scatter), each matrix in the share of the rank that owns it (MuonLayout: dealt by
    size, so the ranks' shares are near equal). A rank updates only its matrices (their momentum
    and sidecar live only there) and all-gathers the new values.
  - Adam reduce-scatters large matrices along their first dimension (each rank updates its own
    rows, with state for those rows only, then all-gathers) and all-reduces small parameters
    (every rank updates all of them identically).
  step_together(optimizers) interleaves the optimizers' steps: every reduction launched first,
  then each update with its all-gather launched as soon as the update is done, then the gathers
  awaited, so that one optimizer's communication runs under another's update math.
  Sums are divided by the world size (gloo has no AVG). With one process every collective is
  the identity and the same code runs. All ranks end each step with bitwise-identical weights.
  Optimizer state is therefore per rank: each rank saves and loads its own state_dict(), and a
  checkpoint resumes only on the same world size.

CUDA graphs (run_bank): the update math between the collectives (a Muon bank's, all of Adam's)
can be handed to a function that captures it once and replays it. For that, everything the math
touches keeps its address: buffers made once for stacked and reduced gradients and new values,
the scheduled scalars as views of one device tensor refilled by a single copy per update, and
state loaded (or copied at the untie) into the existing tensors. The results are the same bits
as without run_bank.

SparseRowAdam trains a table of rows of which each step touches few (beta1 = 0, one second
moment per row, an exact catch-up of the decay a row missed), from its gradient entries.
"""
import dataclasses
import functools
import importlib
import importlib.util
import math

import torch
import torch.distributed as dist

from machinery.errors import UserError


class OptimConfigError(UserError, ValueError):
    """An optimizer was given an unknown name, a bad value, or a parameter it cannot train."""


# ---------------------------------------------------------------------------------------------
# Orthogonalization
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class OrthoSchedule:
    """One published way to run the odd polynomial iteration X <- aX + (bA + cA^2)X."""
    coefficients: tuple      # (a, b, c) for each step, in order
    norm_factor: float       # X is first divided by norm_factor * ||X||_F: singular values < 1
    reuse_first_gram: bool   # take ||X||_F^2 = trace(X X^T) and reuse that Gram in step 1


# Record 89: Polar Express (Amsel, Persson, Musco, Gower 2025), 5 steps, each step's polynomial
# optimal for the worst case left by the previous ones; normalized by 1.02 * Frobenius norm.
POLAR_EXPRESS = OrthoSchedule(
    coefficients=(
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    ),
    norm_factor=1.02,
    reuse_first_gram=False,
)

# Record 92 (ANVIL2): 6 tuned steps, normalized by 1.05 * sqrt(trace(X X^T)), which saves the
# separate norm computation because the first step needs X X^T anyway.
ANVIL = OrthoSchedule(
    coefficients=(
        (3.923798038567, -6.095026865488, 3.905234618423),
        (3.278126713798, -3.328923386476, 0.989127286973),
        (3.505298394150, -5.137358782410, 1.968325560615),
        (2.815058591845, -3.685181239622, 1.417196497642),
        (2.245503932403, -2.443826979899, 0.963091710461),
        (2.256537145403, -2.166840097229, 0.929501253245),
    ),
    norm_factor=1.05,
    reuse_first_gram=True,
)

SCHEDULES = {"polar_express": POLAR_EXPRESS, "anvil": ANVIL}

NORM_EPS = 1e-7  # added to norms before dividing: an all-zero update stays zero instead of NaN


def get_schedule(name):
    """The OrthoSchedule called `name`; raises OptimConfigError naming the valid choices."""
    if name not in SCHEDULES:
        raise OptimConfigError(f"unknown orthogonalization schedule {name!r}; "
                               f"choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


@functools.cache
def _xxt_kernel():
    """kernels.xxt (Triton symmetric X X^T) if kernels.py provides it, else None."""
    if importlib.util.find_spec("kernels") is None:
        return None
    return getattr(importlib.import_module("kernels"), "xxt", None)


def gram(X, alpha=1.0, beta=0.0):
    """alpha X @ X^T + beta X for a batch of matrices (..., m, n) -> (..., m, m) (beta != 0: X
    square and symmetric), one product with its sum in the epilogue.

    On CUDA this uses the symmetric Triton kernel when kernels.py has one (it computes one
    triangle and mirrors it: half the FLOPs); elsewhere one baddbmm.
    """
    if X.is_cuda:
        xxt = _xxt_kernel()
        if xxt is not None:
            return xxt(X, alpha=alpha, beta=beta)
    if beta == 0.0:
        return alpha * (X @ X.mT) if alpha != 1.0 else X @ X.mT
    return _batched(torch.baddbmm, X, X, X.mT, beta=beta, alpha=alpha)


def _batched(fn, C, A, B, **scalars):
    """fn (baddbmm) on (..., m, k) operands viewed as one batch, in C's shape."""
    shape = C.shape
    return fn(C.reshape(-1, *shape[-2:]), A.reshape(-1, *A.shape[-2:]), B.reshape(-1, *B.shape[-2:]),
              **scalars).reshape(shape)


def add_product(X, B, a):
    """a X + B @ X for a batch of matrices as one GEMM (baddbmm: cuBLAS adds a X in its epilogue)."""
    return _batched(torch.baddbmm, X, B, X, beta=a)


def orthogonalize(G, schedule="polar_express", dtype=None, xxt=None):
    """Approximate U V^T for each matrix U S V^T of the batch G (..., m, n).

    Works on the wide orientation (transposing when m > n) so that the Gram A = X X^T is the
    small side. X is scaled so that its singular values are below 1, then each step of the
    schedule maps every singular value s to a*s + b*s^3 + c*s^5, driving them towards 1:
    X <- a X + (b A + c A^2) X with A = X X^T, two products per step after the Gram, each with
    its sum in the epilogue (A^2 = gram(A) as A is symmetric). The math runs in `dtype`: by
    default bf16 on CUDA (fast and accurate enough, as the iteration corrects its own rounding)
    and float32 elsewhere. `xxt` computes the Grams (default: gram; xxt(A, alpha=c, beta=b) = b A + c A^2).
    Returns the result in that dtype with G's shape.

    Caveat: the anvil polynomials are tuned up to s = 1/1.05 exactly and diverge just past it.
    In bf16 the rounded normalization can cross that edge when one direction holds nearly all
    of G's norm (s_max / ||G||_F >= ~0.995, measured); real gradients are far from rank one.
    """
    plan = get_schedule(schedule)
    if dtype is None:
        dtype = torch.bfloat16 if G.is_cuda else torch.float32
    xxt = xxt or gram
    tall = G.size(-2) > G.size(-1)
    X = G.to(dtype)
    if tall:
        X = X.mT
    A = None
    if plan.reuse_first_gram:
        A = xxt(X)
        trace = A.diagonal(dim1=-2, dim2=-1).sum(dim=-1)[..., None, None]
        scale = plan.norm_factor * trace.sqrt() + NORM_EPS
        X = X / scale
        A = A / (scale * scale)
    else:
        X = X / (plan.norm_factor * X.norm(dim=(-2, -1), keepdim=True) + NORM_EPS)
    for a, b, c in plan.coefficients:
        if A is None:
            A = xxt(X)
        X = add_product(X, xxt(A, alpha=c, beta=b), a)
        A = None
    return X.mT if tall else X


# ---------------------------------------------------------------------------------------------
# fp32 master weights for bf16 parameters
# ---------------------------------------------------------------------------------------------

LOW_HALF_MASK = 0xFFFF  # low 16 bits of an int32
INT16_SIGN_BIT = 0x8000  # used to map [0, 65535] onto int16's [-32768, 32767] without overflow


def master_from_bf16(param, mantissa):
    """fp32 tensor whose high 16 bits are the bf16 `param` and low 16 bits the int16 `mantissa`."""
    high = param.view(torch.int16).to(torch.int32) << 16
    low = mantissa.to(torch.int32) & LOW_HALF_MASK
    return (high | low).view(torch.float32)


def split_master_into_bf16(master, param, mantissa):
    """Write the high 16 bits of fp32 `master` into bf16 `param` and the low 16 into `mantissa`."""
    bits = master.view(torch.int32)
    param.view(torch.int16).copy_(bits >> 16)
    mantissa.copy_(((bits & LOW_HALF_MASK) ^ INT16_SIGN_BIT) - INT16_SIGN_BIT)


def _load_master(param, state):
    """The fp32 value to update: the reassembled master for bf16, the parameter itself for fp32."""
    if param.dtype == torch.bfloat16:
        if "mantissa" not in state:
            state["mantissa"] = torch.zeros_like(param, dtype=torch.int16)
        return master_from_bf16(param, state["mantissa"])
    return param


def _store_master(param, state, master):
    if param.dtype == torch.bfloat16:
        split_master_into_bf16(master, param, state["mantissa"])


SUPPORTED_PARAM_DTYPES = (torch.float32, torch.bfloat16)  # bf16 gets the mantissa sidecar


def _restore_saved_state(optimizer, state_dict):
    """Put the saved state tensors back with their own dtypes after Optimizer.load_state_dict.

    torch casts every floating state tensor to its parameter's dtype on load, which for a bf16
    parameter would round the fp32 moments and turn the int16 mantissa into bf16 numbers.
    """
    for group, saved_group in zip(optimizer.param_groups, state_dict["param_groups"]):
        for p, saved_id in zip(group["params"], saved_group["params"]):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if torch.is_tensor(value):
                    optimizer.state[p][key] = value.to(device=p.device, copy=True)
                elif isinstance(value, (list, tuple)) and all(torch.is_tensor(v) for v in value):
                    optimizer.state[p][key] = [v.to(device=p.device, copy=True) for v in value]


def _load_state(optimizer, state_dict, in_place):
    """torch's Optimizer.load_state_dict with the saved dtypes kept (_restore_saved_state). With
    in_place, the state tensors that existed before stay, with the loaded values written into
    them (zeros where the loaded state has none: what a fresh start would create): an update
    captured as a CUDA graph keeps reading and writing the tensors it was captured with."""
    current = {p: dict(optimizer.state[p]) for p in optimizer.state} if in_place else {}
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    _restore_saved_state(optimizer, state_dict)
    for p, old in current.items():
        loaded = optimizer.state[p]
        for key, value in list(old.items()):
            if torch.is_tensor(value) or isinstance(value, list):
                saved = loaded.get(key)
                for i, tensor in enumerate(value if isinstance(value, list) else [value]):
                    source = saved[i] if isinstance(saved, list) else saved
                    if source is None:
                        tensor.zero_()
                    else:
                        tensor.copy_(source)
            elif key in loaded:
                old[key] = loaded[key]
            else:
                del old[key]
        old.update({key: value for key, value in loaded.items() if key not in old})
        optimizer.state[p] = old


def _check_param_dtypes(params, optimizer_name):
    for p in params:
        if p.dtype not in SUPPORTED_PARAM_DTYPES:
            raise OptimConfigError(f"{optimizer_name} trains float32 or bfloat16 parameters; "
                                   f"got one of dtype {p.dtype}: convert it first")


# ---------------------------------------------------------------------------------------------
# Collectives: the same calls for any world size, identities for one process
# ---------------------------------------------------------------------------------------------

def world_size_and_rank():
    """(world size, rank) of torch.distributed when initialized, else (1, 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _reduce_scatter_op():
    # torch 2.13 renamed reduce_scatter_tensor (same arguments); the GPU machine runs 2.11.
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_op():
    # torch 2.13 renamed all_gather_into_tensor (same arguments); the GPU machine runs 2.11.
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _InFlight:
    """A launched collective; wait() blocks until it is done and returns its result tensor."""

    def __init__(self, work, result):
        self.work, self.result = work, result

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.result


def _launch_reduce_scatter_sum(stacked, world, out=None):
    """Sum `stacked` over ranks; rank r gets rows [r*n/world, (r+1)*n/world) of the sum (in
    `out` when given)."""
    if world == 1:
        return _InFlight(None, stacked)
    if out is None:
        out = stacked.new_empty((stacked.shape[0] // world, *stacked.shape[1:]))
    return _InFlight(_reduce_scatter_op()(out, stacked, op=dist.ReduceOp.SUM, async_op=True), out)


def _launch_all_gather(full, shard, world):
    """Fill `full` with every rank's `shard`, in rank order (for one process, shard is full)."""
    if world == 1:
        return _InFlight(None, full)
    return _InFlight(_all_gather_op()(full, shard, async_op=True), full)


# ---------------------------------------------------------------------------------------------
# Muon family
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _Share:
    """A rank's matrices of one bank, side by side at `offset` (elements) of its share of a bucket."""
    bank: int                      # index into MuonLayout.banks
    params: list


MUON_BUCKETS = 2  # buckets per dtype on several ranks: one's update math runs while another's collective does


@dataclasses.dataclass
class MuonLayout:
    """Where each Muon matrix is updated: each matrix owned by one rank, in one of MUON_BUCKETS
    buckets of its dtype. A bucket's gradients travel as one buffer of `world` equal shares (one
    reduce-scatter, one all-gather), each share holding its rank's matrices bank by bank (a bank:
    a group's matrices of one shape and dtype), then zeros up to the bucket's busiest share.
    Matrices are dealt largest first over the world x MUON_BUCKETS (bucket, rank) slots, each to
    the slot with the fewest elements so far (ties: the first bucket, then the lowest rank), so
    each bucket's busiest share, and each rank's total, stay near the mean instead of a whole
    bank's padding to a multiple of the ranks."""
    banks: list                    # (index of the param group, [params]): the group is looked up at each
    # step (load_state_dict replaces the group dicts that the schedule then writes)
    buckets: dict                  # (dtype, index) -> (share size in elements, [[_Share] per rank])

    @staticmethod
    def of(param_groups, world, per_dtype=MUON_BUCKETS):
        banks = []
        for index, group in enumerate(param_groups):
            by_shape = {}
            for p in group["params"]:
                by_shape.setdefault((tuple(p.shape), p.dtype), []).append(p)
            banks += [(index, params) for params in by_shape.values()]
        buckets = {}
        for dtype in dict.fromkeys(params[0].dtype for _, params in banks):
            matrices = [(i, j, p) for i, (_, params) in enumerate(banks) if params[0].dtype == dtype
                        for j, p in enumerate(params)]
            loads, owned = [0] * (per_dtype * world), [[] for _ in range(per_dtype * world)]
            for i, j, p in sorted(matrices, key=lambda m: -m[2].numel()):   # stable: bank order on ties
                slot = loads.index(min(loads))      # slot = bucket * world + rank
                loads[slot] += p.numel()
                owned[slot].append((i, j))
            for b in range(per_dtype):
                slots = range(b * world, (b + 1) * world)
                if not any(owned[slot] for slot in slots):
                    continue
                shares = []
                for slot in slots:
                    per_bank = {}
                    for i, j in sorted(owned[slot]):
                        per_bank.setdefault(i, []).append(banks[i][1][j])
                    shares.append([_Share(i, params) for i, params in per_bank.items()])
                buckets[(dtype, b)] = (max(loads[slot] for slot in slots), shares)
        return MuonLayout(banks, buckets)

    @staticmethod
    def offsets(shares):
        """Each share's element offset in its rank's share of the bucket."""
        offsets, at = [], 0
        for share in shares:
            offsets.append(at)
            at += len(share.params) * share.params[0].numel()
        return offsets


class _DeviceScalars:
    """The floats an update reads (a list of {name: float or list of floats}, one dict per
    matrix bank or parameter) as 0-d views of one fp32 device tensor, at fixed addresses for a
    captured update. write() refreshes them all with one host-to-device copy, queued: from
    pageable memory CUDA stages the values before the call returns, so nothing waits. Their fp32
    rounding is the one an op applies to a Python float, so the math gives the same bits."""

    def __init__(self, hypers, device):
        self.values = torch.zeros(len(self._flat(hypers)), device=device)
        flat = iter(self.values)   # 0-d views, in _flat's order
        self.views = [{name: [next(flat) for _ in v] if isinstance(v, list) else next(flat)
                       for name, v in hyper.items()} for hyper in hypers]

    @staticmethod
    def _flat(hypers):
        return [x for hyper in hypers for v in hyper.values() for x in (v if isinstance(v, list) else [v])]

    def write(self, hypers):
        self.values.copy_(torch.tensor(self._flat(hypers), dtype=torch.float32), non_blocking=True)


MUON_VARIANTS = ("muon", "normuon", "anvil")
# Whether each variant applies the NorMuon lane equalizer; only anvil lets a group choose.
EQUALIZE_BY_VARIANT = {"muon": False, "normuon": True, "anvil": True}


def shape_lr_multiplier(rows, cols):
    """max(1, rows/cols)^0.5. An orthogonalized update has spectral norm 1; measured from input
    RMS to output RMS, a tall (out > in) matrix of spectral norm 1 changes outputs by only
    sqrt(cols/rows), so tall matrices get this factor to move their outputs like square ones."""
    return max(1.0, rows / cols) ** 0.5


def lanes_are_rows(rows, cols, lanes=None):
    """Whether the equalizer's lanes of a (rows, cols) update are its rows: `lanes` "rows" or
    "cols" when given, else the longer dimension's (rows when rows >= cols)."""
    return rows >= cols if lanes is None else lanes == "rows"


def equalize_lanes(update, second_moment, beta2, eps, row_lanes=None):
    """NorMuon: give every lane of `update` (rows, cols) the same RMS, keeping its Frobenius norm.

    A lane is one index of the longer dimension (a row when rows >= cols, else a column; or as
    `row_lanes` says): after orthogonalization the shorter dimension's lanes are already
    orthonormal, the longer ones are not. `second_moment` (rows, 1) or (1, cols) is the EMA
    (beta2) of each lane's mean square, updated in place; the update is divided by
    sqrt(second_moment + eps), then rescaled to the Frobenius norm it had before.
    """
    rows, cols = update.shape
    row_lanes = rows >= cols if row_lanes is None else row_lanes
    mean_square = update.square().mean(dim=-1 if row_lanes else -2, keepdim=True)
    second_moment.lerp_(mean_square, 1 - beta2)
    norm_before = update.norm()
    equalized = update * (second_moment + eps).rsqrt()
    return equalized * (norm_before / equalized.norm().clamp_min(NORM_EPS))


def same_sign_or_zero(a, b):
    """sign(a) * sign(b) >= 0, elementwise."""
    return torch.sign(a) * torch.sign(b) >= 0


class Muon(torch.optim.Optimizer):
    """Muon / NorMuon / ANVIL-style optimizer for 2-D weight matrices (out, in), sharded by matrix.

    Group keys (all read at every step, so the trainer schedules them by writing to the groups):
      lr            step size; `initial_lr` is set to it at construction (torch convention)
      momentum      muon/normuon: momentum beta, also the Nesterov weight (0.85 -> 0.95 warm-up)
      weight_decay  cautious decoupled decay: strength lr * lr_eff * weight_decay per step
      schedule      orthogonalization schedule name: "polar_express" or "anvil"
      variant       "muon", "normuon" or "anvil"
      equalize      apply the lane equalizer (forced by muon/normuon; anvil: default True)
      beta2, eps    lane equalizer EMA beta and the epsilon inside its rsqrt
      fast_beta     anvil: beta of the fast momentum rail
      slow_beta     anvil: beta of the slow momentum rail
      blend         anvil: w in m = w * fast + (1 - w) * slow
      mu            anvil: Nesterov weight in u = lerp(g, m, mu)
      lr_scale      extra LR multiplier of the group (e.g. 2 for the MLP output matrices)
      shape_factor  None (each block's max(1, rows/cols)^0.5), or the factor every block takes
      lanes         None (each block's longer dimension), or per block "rows" or "cols": the
                    equalizer's lanes
      row_splits    None, or row counts that split each matrix of the group into independent
                    matrices (e.g. a packed QKV weight into per-head-pair query and key blocks
                    and the value block): each block is orthogonalized, equalized and
                    LR-scaled as a matrix of its own. Momentum is elementwise, so this equals
                    Muon on each block separately.

    One step for a matrix theta with averaged gradient g (muon/normuon):
      buf <- lerp(buf, g, 1 - momentum);  u <- lerp(g, buf, momentum)
    (anvil):
      fast <- lerp(fast, g, 1 - fast_beta);  slow <- lerp(slow, g, 1 - slow_beta)
      u <- lerp(g, blend * fast + (1 - blend) * slow, mu)
    then O = orthogonalize(u), optionally O = equalize_lanes(O), and with
      lr_eff = lr * lr_scale * max(1, rows/cols)^0.5   (rows of the block, with row_splits;
                                                        or shape_factor)
      theta <- theta - lr_eff * O - lr * lr_eff * weight_decay * theta * [gate]
    where the decay gate is sign(slow) * sign(theta) >= 0 for anvil and sign(O) * sign(theta)
    >= 0 otherwise. step() returns True (it always updates every matrix that has a gradient).

    ortho_dtype and xxt: the dtype and the X X^T of the orthogonalization (default: as
    `orthogonalize` picks them by device); a trainer that rehearses its GPU path on a CPU passes
    bf16 and the Triton kernel.

    run_bank: None, or a function run_bank(key, fn) that runs fn() and may capture it as a CUDA
    graph to replay on later calls with the same key (the trainer's CUDA graphs). fn is a bank's
    update math (momentum, orthogonalization, equalizer, weight update) between its reduction
    and its gather. With run_bank, everything fn touches keeps its address from step to step:
    the summed gradients and new values live in the buckets' buffers, made once, the scheduled
    scalars (lr, momentum, mu, blend and what follows from them) are 0-d device tensors
    refilled before each step, and load_state_dict writes into the state tensors in place.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, weight_decay=0.0, schedule="polar_express",
                 variant="muon", equalize=None, beta2=0.9, eps=1e-10, fast_beta=0.85,
                 slow_beta=0.98, blend=1.0, mu=0.85, lr_scale=1.0, row_splits=None, shape_factor=None,
                 lanes=None, ortho_dtype=None, xxt=None, run_bank=None):
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay, schedule=schedule,
                        variant=variant, equalize=equalize, beta2=beta2, eps=eps,
                        fast_beta=fast_beta, slow_beta=slow_beta, blend=blend, mu=mu,
                        lr_scale=lr_scale, row_splits=row_splits, shape_factor=shape_factor, lanes=lanes)
        super().__init__(params, defaults)
        self.ortho_dtype, self.xxt, self.run_bank = ortho_dtype, xxt, run_bank
        self.layouts = {}          # world size -> MuonLayout
        self.buffers = {}          # bucket key -> (every rank's shares, this rank's share) of a bucket
        self.scalars = {}          # with run_bank: bank key -> _DeviceScalars
        self._launched, self._gathers = [], []   # a step between its parts: reductions, then gathers in flight

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("initial_lr", group["lr"])
        variant = group["variant"]
        if variant not in MUON_VARIANTS:
            raise OptimConfigError(f"unknown Muon variant {variant!r}; choose one of "
                                   f"{list(MUON_VARIANTS)}")
        get_schedule(group["schedule"])
        if group["equalize"] is None:
            group["equalize"] = EQUALIZE_BY_VARIANT[variant]
        elif variant != "anvil" and group["equalize"] != EQUALIZE_BY_VARIANT[variant]:
            other = "normuon" if variant == "muon" else "muon"
            raise OptimConfigError(f"variant {variant!r} fixes equalize="
                                   f"{EQUALIZE_BY_VARIANT[variant]}: use variant={other!r} instead")
        for p in group["params"]:
            if p.ndim != 2:
                raise OptimConfigError(f"Muon trains 2-D matrices only; got shape "
                                       f"{tuple(p.shape)}: give it to Adam")
        if group["row_splits"] is not None:
            group["row_splits"] = tuple(group["row_splits"])
            if any(sum(group["row_splits"]) != p.shape[0] for p in group["params"]):
                raise OptimConfigError(f"row_splits {list(group['row_splits'])} must add up to the rows of "
                                       f"every matrix of the group; got shapes "
                                       f"{sorted({tuple(p.shape) for p in group['params']})}")
        if group["lanes"] is not None:
            group["lanes"] = tuple(group["lanes"])
            blocks = len(group["row_splits"] or (None,))
            if len(group["lanes"]) != blocks or not set(group["lanes"]) <= {"rows", "cols", None}:
                raise OptimConfigError(f"lanes {list(group['lanes'])} must give \"rows\", \"cols\" or None for each "
                                       f"of the group's {blocks} block(s)")
        _check_param_dtypes(group["params"], "Muon")

    def load_state_dict(self, state_dict):
        _load_state(self, state_dict, in_place=self.run_bank is not None)

    def layout(self, world):
        """The MuonLayout of this optimizer's matrices on `world` ranks (made once: owners never
        change); one bucket per dtype on one rank, which has no communication to overlap."""
        if world not in self.layouts:
            self.layouts[world] = MuonLayout.of(self.param_groups, world, MUON_BUCKETS if world > 1 else 1)
        return self.layouts[world]

    def _hyper(self, group, shape):
        """The scheduled scalars of a bank's update, computed on the host from the group:
        momentum and 1 - momentum, blend, mu, 1 - fast_beta, and per row block lr_eff and decay."""
        splits = group["row_splits"] or (shape[0],)
        factor = group["shape_factor"]
        lr_eff = [group["lr"] * group["lr_scale"] * (shape_lr_multiplier(rows, shape[1]) if factor is None else factor)
                  for rows in splits]
        return dict(momentum=group["momentum"], one_minus_momentum=1 - group["momentum"], blend=group["blend"],
                    mu=group["mu"], one_minus_fast_beta=1 - group["fast_beta"], lr_eff=lr_eff,
                    decay=[group["lr"] * e * group["weight_decay"] for e in lr_eff])

    @staticmethod
    def _momentum_direction(group, hyper, state, g):
        """The Nesterov direction u for a matrix with averaged fp32 gradient g (its state updated)."""
        if group["variant"] == "anvil":
            if "fast_rail" not in state:
                state["fast_rail"] = torch.zeros_like(g)
                state["slow_rail"] = torch.zeros_like(g)
            state["fast_rail"].lerp_(g, hyper["one_minus_fast_beta"])
            state["slow_rail"].lerp_(g, 1 - group["slow_beta"])
            blended = torch.lerp(state["slow_rail"], state["fast_rail"], hyper["blend"])
            return torch.lerp(g, blended, hyper["mu"])
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(g)
        state["momentum_buffer"].lerp_(g, hyper["one_minus_momentum"])
        return torch.lerp(g, state["momentum_buffer"], hyper["momentum"])

    @staticmethod
    def _apply(group, hyper, p, state, update):
        """Equalize (if on) the orthogonalized fp32 `update`, block by block with row_splits, and
        apply it to p's master weight."""
        splits = group["row_splits"] or (p.shape[0],)
        lanes = group["lanes"] or (None,) * len(splits)
        row_lanes = [lanes_are_rows(rows, p.shape[1], lane) for rows, lane in zip(splits, lanes)]
        if group["equalize"] and "lane_second_moment" not in state:
            state["lane_second_moment"] = [update.new_zeros((rows, 1) if by_row else (1, p.shape[1]))
                                           for rows, by_row in zip(splits, row_lanes)]
        master = _load_master(p.data, state)
        slow = state["slow_rail"].split(splits) if group["variant"] == "anvil" else [None] * len(splits)
        for i, (block, weights, slow_block) in enumerate(zip(update.split(splits), master.split(splits), slow)):
            if group["equalize"]:
                block = equalize_lanes(block, state["lane_second_moment"][i], group["beta2"], group["eps"],
                                       row_lanes[i])
            lr_eff, decay = hyper["lr_eff"][i], hyper["decay"][i]
            gate_source = block if slow_block is None else slow_block
            decayed = same_sign_or_zero(gate_source, weights) * weights
            weights.sub_(lr_eff * block + decay * decayed)   # a view: writes the master's rows
        _store_master(p.data, state, master)

    def _orthogonalize(self, group, directions):
        """orthogonalize() of each (rows, cols) matrix of `directions`, or of each of their row
        blocks with row_splits (blocks of one shape batched together)."""
        splits = group["row_splits"]
        if splits is None:
            return orthogonalize(directions, group["schedule"], self.ortho_dtype, self.xxt).float()
        blocks = directions.split(splits, dim=1)
        result = torch.empty_like(directions, dtype=torch.float32)
        out_blocks = result.split(splits, dim=1)
        for rows in sorted(set(splits)):
            same = [i for i, r in enumerate(splits) if r == rows]
            ortho = orthogonalize(torch.cat([blocks[i] for i in same]), group["schedule"], self.ortho_dtype,
                                  self.xxt).float()
            for i, part in zip(same, ortho.split(directions.shape[0])):
                out_blocks[i].copy_(part)
        return result

    def _update_share(self, group, hyper, params, states, summed, world):
        """Update the matrices `params` of one bank this rank owns, whose optimizer states are
        `states`, from `summed` (k, rows, cols), their gradients summed over the ranks, and write
        their new values into `summed` (for the all-gather; a matrix without a gradient keeps
        its slot's zeros). It reads no other state: a compiled update depends on its bank's
        alone."""
        owned = [(j, p) for j, p in enumerate(params) if p.grad is not None]
        if not owned:
            return
        directions = torch.stack([
            self._momentum_direction(group, hyper, states[j], summed[j].float() / world) for j, _ in owned])
        orthogonal = self._orthogonalize(group, directions)
        for (j, p), update in zip(owned, orthogonal):
            self._apply(group, hyper, p, states[j], update)
            summed[j].copy_(p.data)

    def _buffers(self, key, size, world, device):
        """A bucket's buffers: all ranks' shares (world x size) and, with several ranks, this
        rank's (size); made once, at fixed addresses (a captured update keeps reading them)."""
        if key not in self.buffers:
            dtype = key[0]
            flat = torch.zeros(world * size, dtype=dtype, device=device)
            self.buffers[key] = (flat, torch.zeros(size, dtype=dtype, device=device) if world > 1 else flat)
        return self.buffers[key]

    @staticmethod
    def _views(buffer, share, offset):
        """The share's matrices in `buffer` from `offset`: (k, rows, cols)."""
        shape = share.params[0].shape
        return buffer[offset:offset + len(share.params) * share.params[0].numel()].view(len(share.params), *shape)

    def _update_bucket(self, layout, bucket, shares, summed, world):
        """This rank's banks of a bucket (its key), from its summed share: each bank's update math
        runs here, or with run_bank by its captured math (its scalars at fixed addresses)."""
        for share, offset in zip(shares, MuonLayout.offsets(shares)):
            group = self.param_groups[layout.banks[share.bank][0]]
            views = self._views(summed, share, offset)
            hyper = self._hyper(group, share.params[0].shape)
            states = [self.state[p] if p.grad is not None else None for p in share.params]
            if self.run_bank is None:
                self._update_share(group, hyper, share.params, states, views, world)
                continue
            key = ("muon", bucket, share.bank, tuple(p.grad is not None for p in share.params))
            if key not in self.scalars:
                self.scalars[key] = _DeviceScalars([hyper], share.params[0].device)
            self.scalars[key].write([hyper])
            self.run_bank(key, functools.partial(self._update_share, group, self.scalars[key].views[0],
                                                 share.params, states, views, world))

    @torch.no_grad()
    def launch_step(self):
        """The step's first part: the gradients packed into their buckets and each bucket's
        reduce-scatter launched. Returns True (every call updates)."""
        world, _ = world_size_and_rank()
        layout = self.layout(world)
        self._launched = []
        for key, (size, shares) in layout.buckets.items():
            everyone = [p for per_rank in shares for share in per_rank for p in share.params]
            if all(p.grad is None for p in everyone):
                continue
            flat, mine = self._buffers(key, size, world, everyone[0].device)
            for r, per_rank in enumerate(shares):
                for share, offset in zip(per_rank, MuonLayout.offsets(per_rank)):
                    for p, view in zip(share.params, self._views(flat, share, r * size + offset)):
                        view.copy_(p.grad) if p.grad is not None else view.zero_()
            self._launched.append((key, flat, _launch_reduce_scatter_sum(flat, world, mine if world > 1 else None)))
        return True

    @torch.no_grad()
    def update_step(self):
        """The second: each bucket's reduction awaited, this rank's matrices updated, the new
        values' all-gather launched."""
        world, rank = world_size_and_rank()
        layout = self.layout(world)
        self._gathers = []
        for key, flat, reduction in self._launched:
            size, shares = layout.buckets[key]
            summed = reduction.wait()
            self._update_bucket(layout, key, shares[rank], summed, world)
            self._gathers.append((shares, size, _launch_all_gather(flat, summed, world)))
        self._launched = []

    @torch.no_grad()
    def finish_step(self):
        """The last: the gathers awaited and the other ranks' new matrices copied in."""
        _, rank = world_size_and_rank()
        for shares, size, gather in self._gathers:
            full = gather.wait()
            for r, per_rank in enumerate(shares):
                if r == rank:
                    continue
                for share, offset in zip(per_rank, MuonLayout.offsets(per_rank)):
                    for p, value in zip(share.params, self._views(full, share, r * size + offset)):
                        if p.grad is not None:
                            p.data.copy_(value)
        self._gathers = []

    def step(self):
        """Sum the gradients over ranks (one reduce-scatter per bucket), update each matrix on
        its owner, share the new values (one all-gather per bucket): step_together([self])."""
        return step_together([self])[0]


# ---------------------------------------------------------------------------------------------
# Adam
# ---------------------------------------------------------------------------------------------

MIN_SHARDED_NUMEL_PER_RANK = 1024  # below this many elements per rank, all-reduce the whole param


def shards_rows(param, world):
    """Whether Adam reduce-scatters `param` by rows: big enough and evenly divisible."""
    return (param.ndim >= 2 and param.shape[0] % world == 0 and param.is_contiguous()
            and param.numel() >= MIN_SHARDED_NUMEL_PER_RANK * world)


class Adam(torch.optim.Optimizer):
    """Adam with cautious weight decay, for embeddings, the head, gates and scalars.

    Group keys: lr (the per-group LR multiplier is simply the group's lr; `initial_lr` is set to
    it at construction), betas (beta1, beta2), eps, weight_decay, and any label the caller adds
    (e.g. name). For a parameter theta with averaged gradient g at its t-th update:
      m <- lerp(m, g, 1 - beta1);  v <- lerp(v, g^2, 1 - beta2)
      u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps)
      theta <- theta - lr * u - lr^2 * weight_decay * theta * [u * theta > 0]
    The decay is cautious (only where the update already pulls theta towards zero) and scaled by
    lr^2 so that it fades with the LR schedule faster than the step itself.

    step_every = k: step() updates on every k-th call and returns True then; on the calls in
    between it does nothing at all (no communication) and returns False, so the caller keeps the
    gradients accumulating and zeroes them only after a True. The update uses the mean of the
    accumulated gradients (their sum divided by the number of calls). `step_every` may be
    changed between calls; it and the count of pending calls are saved in state_dict().

    run_bank: as Muon's. With it, one update of every parameter with a gradient is the function
    handed over (it may be captured and replayed): the summed gradients (the gradients
    themselves with one process), the state and each parameter's scalars (its LR over its bias
    correction, 1 / sqrt(1 - beta2^t), lr^2 * wd, the betas, eps and the gradient's divisor)
    keep their addresses from step to step, so any group key and step_every may change between
    replays.
    """

    def __init__(self, params, lr=1e-3, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.0,
                 step_every=1, run_bank=None, name="adam"):
        if step_every < 1:
            raise OptimConfigError(f"step_every must be a positive integer, got {step_every}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.name = name           # its captured updates' key (a run may have several Adams)
        self.step_every = step_every
        self.pending_calls = 0
        self.run_bank = run_bank
        self.reduce_buffers = {}   # with run_bank and several processes: parameter -> its summed gradient
        self.scalars = {}          # with run_bank: update key -> _DeviceScalars
        self.scratch_buffers = {}  # (shape, device) -> the two buffers of scratch()
        # a step between its parts: the calls it sums, its parameters, reductions and gathers in flight
        self._calls, self._launched, self._reductions, self._gathers = 0, [], None, []

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        group.setdefault("initial_lr", group["lr"])
        _check_param_dtypes(group["params"], "Adam")

    def state_dict(self):
        state = super().state_dict()
        state["step_every"] = self.step_every
        state["pending_calls"] = self.pending_calls
        return state

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        self.step_every = state_dict.pop("step_every")
        self.pending_calls = state_dict.pop("pending_calls")
        _load_state(self, state_dict, in_place=self.run_bank is not None)

    def copy_state(self, source, target):
        """Start `target`'s state (moments, step count, mantissa sidecar) as a copy of `source`'s,
        as when a head tied to the embedding becomes its own parameter with the embedding's
        values: its first update then continues the embedding's instead of starting from zero
        moments (whose first bias-corrected step is lr * sign(g) on every entry)."""
        if source.shape != target.shape or source.dtype != target.dtype:
            raise OptimConfigError(f"copy_state needs parameters of one shape and dtype; got "
                                   f"{tuple(source.shape)} {source.dtype} and {tuple(target.shape)} {target.dtype}")
        target_state = self.state[target]
        for key, value in self.state[source].items():
            if torch.is_tensor(value) and key in target_state:
                target_state[key].copy_(value)   # in place: a captured update keeps its tensors
            else:
                target_state[key] = value.clone() if torch.is_tensor(value) else value

    @staticmethod
    def _hyper(group, t, divisor):
        """The scalars of a parameter's t-th update, computed on the host: everything the update
        reads that a schedule may change (LR, betas, eps, decay) and the divisor of its summed
        gradient (ranks x calls), so that a captured update replays with any of their values."""
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        return dict(step_scale=lr / (1 - beta1 ** t), inv_sqrt_bias2=(1 - beta2 ** t) ** -0.5,
                    decay=lr * lr * group["weight_decay"], one_minus_beta1=1 - beta1, beta2=beta2,
                    one_minus_beta2=1 - beta2, eps=group["eps"], divisor=float(divisor))

    def _update(self, group, hyper, state, param, g):
        """One Adam step on `param` (the whole parameter or this rank's rows) with fp32 grad g
        and the step's scalars `hyper` (floats, or 0-d device tensors holding them).

        The bias corrections and the LR are folded into two scalars and the update and the
        cautious decay are built in two scratch buffers the optimizer keeps per shape (scratch),
        so a step allocates nothing and makes ~12 in-place passes over the parameter's size (the
        tables are large; on a CPU a fresh buffer of their size costs more than a pass).
        """
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(g, hyper["one_minus_beta1"])
        update, decayed = self.scratch(m)
        if torch.is_tensor(hyper["one_minus_beta2"]):   # (addcmul's value must be a number: the same products)
            v.mul_(hyper["beta2"]).addcmul_(g, torch.mul(g, hyper["one_minus_beta2"], out=update))
        else:
            v.mul_(hyper["beta2"]).addcmul_(g, g, value=hyper["one_minus_beta2"])
        torch.sqrt(v, out=update).mul_(hyper["inv_sqrt_bias2"]).add_(hyper["eps"])
        torch.div(m, update, out=update).mul_(hyper["step_scale"])   # lr * u
        master = _load_master(param, state)
        if group["weight_decay"]:
            torch.mul(update, master, out=decayed).gt_(0).mul_(master)   # theta where u * theta > 0, else 0
            master.sub_(decayed.mul_(hyper["decay"]))   # a diverging LR gives inf, not an error
        master.sub_(update)
        _store_master(param, state, master)

    def scratch(self, like):
        """Two fp32 buffers of `like`'s shape and device, the same ones at every call (_update's
        update and decay are built in them; one parameter at a time)."""
        key = (tuple(like.shape), like.device)
        if key not in self.scratch_buffers:
            self.scratch_buffers[key] = (torch.empty_like(like, dtype=torch.float32),
                                         torch.empty_like(like, dtype=torch.float32))
        return self.scratch_buffers[key]

    def _reduce_rows(self, p, world):
        """Launch the sum of a large p's gradient over ranks, its rows reduce-scattered (into a
        fixed buffer with run_bank)."""
        out = None
        if self.run_bank is not None:
            if p not in self.reduce_buffers:
                self.reduce_buffers[p] = p.grad.new_empty((p.shape[0] // world, *p.shape[1:]))
            out = self.reduce_buffers[p]
        return _launch_reduce_scatter_sum(p.grad.contiguous(), world, out)

    def _reduce_bucket(self, params, world):
        """Launch one all-reduce of the gradients of `params` (small ones, one dtype), packed into
        one buffer (made once with run_bank): returns {p: its summed gradient, a view of it}."""
        key = tuple(params)
        bucket = self.reduce_buffers.get(key)
        if bucket is None:
            bucket = params[0].grad.new_empty(sum(p.numel() for p in params))
            if self.run_bank is not None:
                self.reduce_buffers[key] = bucket
        views, at = {}, 0
        for p in params:
            views[p] = bucket[at:at + p.numel()].view_as(p.grad).copy_(p.grad)
            at += p.numel()
        return _InFlight(dist.all_reduce(bucket, op=dist.ReduceOp.SUM, async_op=True), views)

    def _launch_reductions(self, params, world):
        """Launch the sums of the gradients of `params` over ranks: the large parameters' rows
        reduce-scattered one by one, the others all-reduced in one bucket per dtype. Returns
        (bucket reductions, {p: its rows' reduction})."""
        rows = {p: self._reduce_rows(p, world) for p in params if shards_rows(p, world)}
        small = [p for p in params if not shards_rows(p, world)]
        buckets = [self._reduce_bucket([p for p in small if p.grad.dtype == dtype], world)
                   for dtype in dict.fromkeys(p.grad.dtype for p in small)]
        return buckets, rows

    @staticmethod
    def _await_reductions(reductions, params):
        """{p: its gradient summed over ranks} once the launched reductions are done (with one
        process, none launched: the gradients themselves)."""
        if reductions is None:
            return {p: p.grad for p in params}
        buckets, rows = reductions
        summed = {p: value for bucket in buckets for p, value in bucket.wait().items()}
        return summed | {p: reduction.wait() for p, reduction in rows.items()}

    def _update_all(self, updates):
        for group, hyper, state, weights, summed in updates:
            g = summed.float()
            if torch.is_tensor(hyper["divisor"]) or hyper["divisor"] != 1:
                g = g / hyper["divisor"]
            self._update(group, hyper, state, weights, g)

    @torch.no_grad()
    def launch_step(self):
        """The step's first part: on every step_every-th call the gradients' reductions launched
        (returns True); on the others the call only counted (False: nothing more to do, the
        gradients keep accumulating)."""
        self.pending_calls += 1
        if self.pending_calls < self.step_every:
            return False
        self._calls, self.pending_calls = self.pending_calls, 0
        world, _ = world_size_and_rank()
        self._launched = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        params = [p for _, p in self._launched]
        self._reductions = self._launch_reductions(params, world) if world > 1 else None
        return True

    @torch.no_grad()
    def update_step(self):
        """The second: the reductions awaited, this rank's rows and every small parameter
        updated, the rows' all-gathers launched."""
        world, rank = world_size_and_rank()
        launched, calls = self._launched, self._calls
        reductions = self._await_reductions(self._reductions, [p for _, p in launched])
        updates, gathers = [], []          # updates: (group, scalars, state, weights, summed gradient)
        for group, p in launched:
            summed, state = reductions[p], self.state[p]
            if "exp_avg" not in state:     # (a state loaded in place as fresh keeps its zeroed tensors)
                state.update(exp_avg=torch.zeros_like(summed, dtype=torch.float32),
                             exp_avg_sq=torch.zeros_like(summed, dtype=torch.float32))
            state["step"] = state.get("step", 0) + 1
            weights = p.data
            if shards_rows(p, world):
                rows = p.shape[0] // world
                weights = p.data[rank * rows:(rank + 1) * rows]
                gathers.append((p, weights))
            updates.append([group, self._hyper(group, state["step"], world * calls), state, weights, summed])
        if self.run_bank is None or not updates:
            self._update_all(updates)
        else:
            key = (self.name, tuple(p.grad is not None for group in self.param_groups for p in group["params"]))
            if key not in self.scalars:
                self.scalars[key] = _DeviceScalars([u[1] for u in updates], updates[0][3].device)
            self.scalars[key].write([u[1] for u in updates])
            for update, views in zip(updates, self.scalars[key].views):
                update[1] = views
            self.run_bank(key, functools.partial(self._update_all, updates))
        self._gathers = [_launch_all_gather(p.data, weights, world) for p, weights in gathers]
        self._launched, self._reductions = [], None

    @torch.no_grad()
    def finish_step(self):
        """The last: the gathers awaited (each writes the parameter in place)."""
        for gather in self._gathers:
            gather.wait()
        self._gathers = []

    def step(self):
        """Update on every step_every-th call (returns True); otherwise only count (False):
        step_together([self])."""
        return step_together([self])[0]


def step_together(optimizers):
    """One step of each optimizer, their parts interleaved so that one's collectives run while
    another computes: every reduction launched first (in the optimizers' order), then each
    update (its all-gather launched as soon as it is done), then every gather awaited. The
    results are those of stepping the optimizers one after another (each part touches only its
    own optimizer's tensors); what changes is when the GPU's communication stream has work.
    Returns each optimizer's step() result (False: an Adam between its updates).

    With one process there is no communication to hide, so each optimizer steps whole, one
    after another: only one optimizer's temporaries are alive at a time (a lower peak)."""
    if world_size_and_rank()[0] == 1:
        return [_step_whole(opt) for opt in optimizers]
    stepping = [opt.launch_step() for opt in optimizers]
    for opt, steps in zip(optimizers, stepping):
        if steps:
            opt.update_step()
    for opt, steps in zip(optimizers, stepping):
        if steps:
            opt.finish_step()
    return stepping


def _step_whole(opt):
    """launch_step, update_step and finish_step of one optimizer; its step() result."""
    steps = opt.launch_step()
    if steps:
        opt.update_step()
        opt.finish_step()
    return steps


# ---------------------------------------------------------------------------------------------
# Sparse Adam for tables of rows
# ---------------------------------------------------------------------------------------------

def _row_kernels(use_triton):
    """(sum_rows, add_row_sums_, sparse_adam_rows_): the Triton kernels or their references."""
    kernels = importlib.import_module("kernels")
    if use_triton:
        return kernels.sum_rows, kernels.add_row_sums_, kernels.sparse_adam_rows_
    return kernels.sum_rows_reference, kernels.add_row_sums_reference_, kernels.sparse_adam_rows_reference_


class SparseRowAdam:
    """Adam for a table whose steps each touch few of its rows (the hashed n-gram embedding).

    beta1 = 0, so a row without a gradient has no update, and one fp32 second moment per row
    (the mean square of its gradient), not per entry. For Adam event t (one call of step) and a
    touched row r with summed gradient g (D values):
      v_r <- v_r * prod_{s = last_r + 1 .. t} beta2_s + (1 - beta2_t) mean(g^2)
      u = g / (sqrt(v_r / (1 - prod_{s <= t} beta2_s)) + eps)
      theta_r <- theta_r - lr^2 wd theta_r [u theta_r > 0] - lr u
    where last_r is the event of r's previous update. This is dense Adam with beta1 = 0 and
    row-shared second moments on the full gradient, zero rows included: a zero row's update is 0
    (so its weights and its cautious decay stay put) and only its moment decays, which the
    product catches up on when the row next gets a gradient. Work per event: the touched rows.

    The table (rows, D), fp32 or bf16 (rounded to nearest on each store), is updated in place.
    `lr`, `beta2` and `weight_decay` are attributes the trainer schedules; step() reads them.
    Each event's ln(prod beta2) is kept on the host and in a float64 device table indexed by
    event (8 bytes per event). use_triton: the Triton kernels (CUDA, or the interpreter) or
    their torch references.
    """

    def __init__(self, table, lr, beta2=0.95, eps=1e-10, weight_decay=0.0, use_triton=False):
        if table.ndim != 2 or table.dtype not in SUPPORTED_PARAM_DTYPES:
            raise OptimConfigError(f"SparseRowAdam trains a (rows, D) fp32 or bf16 table; got "
                                   f"{tuple(table.shape)} {table.dtype}")
        self.table, self.lr, self.beta2, self.eps, self.weight_decay = table, lr, beta2, eps, weight_decay
        self.sum_rows, self.add_row_sums, self.update_rows = _row_kernels(use_triton)
        self.moment = torch.zeros(table.shape[0], dtype=torch.float32, device=table.device)
        self.last = torch.zeros(table.shape[0], dtype=torch.int32, device=table.device)
        self.events = 0
        self.log_decay = [0.0]     # per event: sum of ln(beta2) over the events so far
        self.log_decay_at = torch.zeros(64, dtype=torch.float64, device=table.device)

    def _record_event(self):
        """Count an event and store its log_decay on the device (a fill: no host sync)."""
        self.events += 1
        self.log_decay.append(self.log_decay[-1] + math.log(self.beta2))
        if self.events >= self.log_decay_at.numel():
            grown = torch.zeros(2 * self.log_decay_at.numel(), dtype=torch.float64, device=self.table.device)
            grown[:self.log_decay_at.numel()] = self.log_decay_at
            self.log_decay_at = grown
        self.log_decay_at[self.events].fill_(self.log_decay[-1])

    @torch.no_grad()
    def step(self, rows, grads):
        """One Adam event from the gradient entries `grads` (N, D) of table rows `rows` (N,),
        repeats allowed (their gradients add up)."""
        groups = importlib.import_module("kernels").distinct_rows(rows.long())
        self.step_summed(groups, self.sum_rows(grads, groups))

    @torch.no_grad()
    def step_summed(self, groups, summed):
        """One Adam event from the rows' gradients summed already: summed[s] (fp32) is the
        gradient of row groups.distinct[s], for the slots s below groups.count."""
        kernels = importlib.import_module("kernels")
        self._record_event()
        event = kernels.RowAdamStep(
            event=self.events, log_decay=self.log_decay[-1], one_minus_beta2=1.0 - self.beta2,
            bias=-math.expm1(self.log_decay[-1]), lr=self.lr, decay=self.lr * self.lr * self.weight_decay,
            eps=self.eps)
        self.update_rows(self.table, summed, groups, self.moment, self.last, self.log_decay_at, event)

    @torch.no_grad()
    def launch_on_scratch(self):
        """Run one event on a scratch table of this table's dtype and width (two rows, fresh
        state): the kernels an event launches get compiled, and this optimizer's table and state
        do not change. The trainer's warm-up calls it, so that nothing compiles on the clock."""
        width, device = self.table.shape[1], self.table.device
        scratch = SparseRowAdam(torch.zeros(2, width, dtype=self.table.dtype, device=device), self.lr,
                                self.beta2, self.eps, self.weight_decay)
        scratch.sum_rows, scratch.add_row_sums, scratch.update_rows = self.sum_rows, self.add_row_sums, self.update_rows
        scratch.step(torch.tensor([1, 0, 1], device=device), torch.ones(3, width, device=device))

    def state_dict(self):
        return dict(moment=self.moment, last=self.last, events=self.events, log_decay=list(self.log_decay),
                    log_decay_at=self.log_decay_at)

    def load_state_dict(self, state):
        self.moment.copy_(state["moment"])
        self.last.copy_(state["last"])
        self.events, self.log_decay = state["events"], list(state["log_decay"])
        self.log_decay_at = state["log_decay_at"].clone().to(self.table.device)


NORM_FLOOR = 1e-12                 # an all-zero matrix keeps its zeros when renormalized



class WeightAverages:
    """The end-of-training weight averages of a run (h.averages): sample() after each step's
    update keeps an fp32 EMA per matrix over each average's window, ship() blends them into the
    weights after the last step. A tied head is not written: the embedding is the head. The
    matrices are the model's averaged_pieces(params); `ema_update` (kernels.ema_update_, by
    default its reference) moves an EMA toward a weight."""

    def __init__(self, averages, model, num_iterations, ema_update=None, norms="matrix"):
        self.averages, self.model, self.N, self.norms = averages, model, num_iterations, norms
        self.ema_update = ema_update or importlib.import_module("kernels").ema_update_reference_
        self.ema = [dict() for _ in averages]

    def samples_at(self, average, step):
        """Whether `average` samples the weights after `step`: in its window, every every-th step
        counted back from `offset` steps before the last, and each of its last_steps."""
        return step >= self.N - average.window and ((self.N - 1 - step) % average.every == average.offset
                                                     or step >= self.N - average.last_steps)

    @torch.no_grad()
    def sample(self, step):
        for average, ema in zip(self.averages, self.ema):
            if not self.samples_at(average, step):
                continue
            for name, weight in self.model.averaged_pieces(average.params):
                if name not in ema:
                    ema[name] = weight.to(torch.float32, copy=True)
                else:
                    self.ema_update(ema[name], weight, average.rate)

    @torch.no_grad()
    def launch_on_scratch(self):
        """Each sample's update once per piece into a scratch EMA (the pieces untouched), so that
        the warm-up compiles every kernel variant the samples will launch."""
        for average in self.averages:
            for _, weight in self.model.averaged_pieces(average.params):
                self.ema_update(torch.zeros_like(weight, dtype=torch.float32), weight, average.rate)

    def norm_group(self, name):
        """What a piece's renormalization measures it with: the piece itself, or (norms "bank")
        its bank: all layers' queries and keys, values and outputs, MLP matrices."""
        if self.norms == "matrix":
            return name
        kind = name.rstrip("0123456789")
        return {"v": "vo", "out": "vo", "mlp_up": "mlp", "mlp_down": "mlp", "mlp2_up": "mlp",
                "mlp2_down": "mlp"}.get(kind, kind)

    @torch.no_grad()
    def ship(self):
        """Blend every average into its weights, in order; then rescale the matrices of averages
        with renormalize to the Frobenius norms they (or their banks: norm_group) had before any
        blend. Returns the number of blends."""
        def shipped(average, ema):
            return [(name, weight) for name, weight in self.model.averaged_pieces(average.params)
                    if name in ema and not (name == "head" and self.model.tied)]
        renormalized = {name: weight for average, ema in zip(self.averages, self.ema)
                        if average.renormalize for name, weight in shipped(average, ema)}

        def norms():
            squares = {}
            for name, weight in renormalized.items():
                group = self.norm_group(name)
                squares[group] = squares.get(group, 0.0) + weight.float().square().sum()
            return {group: square.sqrt() for group, square in squares.items()}
        before = norms()
        blends = 0
        for average, ema in zip(self.averages, self.ema):
            for name, weight in shipped(average, ema):
                weight.copy_(torch.lerp(weight.float(), ema[name], average.blend))
                blends += 1
        after = norms()
        for name, weight in renormalized.items():
            group = self.norm_group(name)
            weight.copy_(weight.float() * (before[group] / after[group].clamp_min(NORM_FLOOR)))
        return blends
