"""Run every optimizer case on the ranks of a torch.distributed job and save the parameters.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/helpers/optim_dist_worker.py --out RESULT.pt

Each rank builds the same parameters (fixed seed), gets its own gradients each step, calls the
optimizers as the trainer does (no DDP, no manual all-reduce) and snapshots the parameters after
each step. Rank 0 saves {"world_size": W, "ranks": [snapshots of rank 0, rank 1, ...]}.

tests/test_optim.py imports this file to run the same cases in one process on the average of
the ranks' gradients. Gradients are small multiples of 1/16, so their sums and averages are
exact in fp32 and bf16: any difference between the runs comes from the optimizers alone.
"""
import argparse
import os
import sys
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import optim  # noqa: E402

PARAM_SEED = 1234  # every rank builds identical parameters from this seed
GRAD_LEVELS = 8  # gradients are integers in [-GRAD_LEVELS, GRAD_LEVELS] ...
GRAD_UNIT = 1 / 16  # ... times this unit: sums of a few of them are exact in bf16
NUM_STEPS = 4  # step() calls per case; snapshots after each
ANVIL_BLEND_LATE = 0.4385  # anvil blend weight after the early phase (record 92)
LATE_ADAM_PARAM = 5  # index of the Adam head, which has no gradient before LATE_ADAM_STEP
LATE_ADAM_STEP = 2
SKIPPING_MATRIX = 1  # index of the Muon matrix that has no gradient on SKIPPED_STEP
SKIPPED_STEP = 1
ADAM_EPS = 0.05  # comparable to the gradients, so Adam's update depends on their scale


def muon_params():
    """Matrix banks: an odd count of one shape, a tall shape, a bf16 bank, a lone matrix in
    a second group (with an extra LR multiplier) that only one rank owns, and packed matrices
    orthogonalized by row blocks in a third."""
    gen = torch.Generator().manual_seed(PARAM_SEED)
    bank = [torch.randn(16, 24, generator=gen) for _ in range(3)]
    tall = [torch.randn(24, 16, generator=gen) for _ in range(2)]
    bf16 = [torch.randn(16, 16, generator=gen).bfloat16() for _ in range(2)]
    lone = [torch.randn(16, 48, generator=gen) / 4]
    packed = [torch.randn(20, 16, generator=gen) for _ in range(2)]
    main = [torch.nn.Parameter(t) for t in bank + tall + bf16]
    return [{"params": main}, {"params": [torch.nn.Parameter(t) for t in lone], "lr_scale": 2.0},
            {"params": [torch.nn.Parameter(t) for t in packed], "row_splits": (4, 4, 12)}]


def adam_params():
    """Sharded by rows (fp32 and bf16), too small or indivisible rows (all-reduced), a vector,
    and a head that has no gradient for the first steps."""
    gen = torch.Generator().manual_seed(PARAM_SEED)
    embed = torch.randn(128, 16, generator=gen)
    embed_bf16 = torch.randn(128, 16, generator=gen).bfloat16()
    odd_rows = torch.randn(33, 64, generator=gen)
    small = torch.randn(8, 16, generator=gen)
    scalars = torch.randn(7, generator=gen)
    head = torch.randn(64, 32, generator=gen)
    P = torch.nn.Parameter
    return [
        {"params": [P(embed), P(embed_bf16)], "lr": 0.05, "name": "embed", "weight_decay": 2.0},
        {"params": [P(odd_rows), P(small)], "lr": 0.02, "betas": (0.9, 0.99), "name": "gates"},
        {"params": [P(scalars)], "lr": 0.1, "name": "scalars", "weight_decay": 5.0},
        {"params": [P(head)], "lr": 0.01, "name": "head"},
    ]


def run_eagerly(key, fn):
    fn()


def make_muon(variant, run_bank=None):
    """run_bank=run_eagerly: the path the trainer's CUDA graphs use (fixed-address buffers,
    device scalars), run without graphs."""
    def build():
        schedule = "anvil" if variant == "anvil" else "polar_express"
        return optim.Muon(muon_params(), lr=0.05, momentum=0.9, weight_decay=3.0,
                          schedule=schedule, variant=variant, run_bank=run_bank)
    return build


def make_adam(step_every, run_bank=None):
    def build():
        return optim.Adam(adam_params(), lr=0.01, betas=(0.8, 0.95), eps=ADAM_EPS,
                          weight_decay=1.0, step_every=step_every, run_bank=run_bank)
    return build


class Together:
    """Optimizers stepped as the trainer steps them, with optim.step_together: every reduction
    launched, then each update, then the gathers awaited."""

    def __init__(self, optimizers):
        self.optimizers, self.stepped = optimizers, []

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self):
        self.stepped = optim.step_together(self.optimizers)
        return self.stepped

    def zero_grad(self, set_to_none=True):
        for opt, stepped in zip(self.optimizers, self.stepped):
            if stepped:
                opt.zero_grad(set_to_none=set_to_none)


def make_together():
    """A Muon (ANVIL, fixed buffers) and an Adam updating every 2nd call: on the Adam steps both
    optimizers' collectives are in flight together."""
    return Together([make_muon("anvil", run_eagerly)(), make_adam(2, run_eagerly)()])


CASES = {
    "muon": make_muon("muon"),
    "normuon": make_muon("normuon"),
    "anvil": make_muon("anvil"),
    "anvil_fixed_buffers": make_muon("anvil", run_eagerly),
    "adam": make_adam(1),
    "adam_every2": make_adam(2),
    "adam_every2_fixed_buffers": make_adam(2, run_eagerly),
    "muon_and_adam_together": make_together,
}


def schedule_groups(case, optimizer, step):
    """What the trainer does between steps: write step-dependent values into the groups."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] * (1.0 - 0.1 * step)
        if case.startswith("anvil"):
            group["blend"] = 1.0 if step == 0 else ANVIL_BLEND_LATE
            group["mu"] = 0.85 + 0.02 * step


def has_grad(case, param_index, step):
    """Which parameters get no gradient on a step (all ranks agree, as the trainer guarantees)."""
    if case.startswith("adam"):
        return not (param_index == LATE_ADAM_PARAM and step < LATE_ADAM_STEP)
    return not (param_index == SKIPPING_MATRIX and step == SKIPPED_STEP)


def rank_grad(case, param_index, step, rank, param):
    """This rank's gradient for one parameter on one step (None when it has none)."""
    if not has_grad(case, param_index, step):
        return None
    seed = zlib.crc32(f"{case}/{param_index}/{step}/{rank}".encode())
    gen = torch.Generator().manual_seed(seed)
    levels = torch.randint(-GRAD_LEVELS, GRAD_LEVELS + 1, param.shape, generator=gen)
    return (levels * GRAD_UNIT).to(param.dtype)


def average_grad(case, param_index, step, world_size, param):
    """The mean of all ranks' gradients, what a single process is given instead."""
    grads = [rank_grad(case, param_index, step, r, param) for r in range(world_size)]
    if grads[0] is None:
        return None
    return sum(grads[1:], grads[0]) / world_size


def run_case(case, grad_fn):
    """Step the case's optimizer NUM_STEPS times; grad_fn(param_index, step, param) gives the
    gradient to accumulate. Returns the parameters after each step, and step()'s results."""
    optimizer = CASES[case]()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    snapshots, updated = [], []
    for step in range(NUM_STEPS):
        for i, p in enumerate(params):
            g = grad_fn(i, step, p)
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        schedule_groups(case, optimizer, step)
        did_update = optimizer.step()
        updated.append(did_update)
        if did_update:
            optimizer.zero_grad(set_to_none=True)
        snapshots.append([p.detach().clone() for p in params])
    return snapshots, updated


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="file to save rank 0's collected results")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    results = {case: run_case(case, lambda i, step, p, c=case: rank_grad(c, i, step, rank, p))
               for case in CASES}
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(results, gathered, dst=0)
    if rank == 0:
        torch.save({"world_size": world_size, "ranks": gathered}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
