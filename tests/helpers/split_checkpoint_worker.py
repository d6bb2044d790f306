"""Run train_gpt.py's main in each process of a torch.distributed job, with the n-gram table split
across the processes and its checkpoint chunks made small (several per shard, the last one
short), and save what each process's model ends with.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/helpers/split_checkpoint_worker.py OUT CHUNK_BYTES --key=value ...

Each process writes OUT/rank<r>.pt: {"exit": main's exit status, "state": its model's state
dict (its own rows of the n-gram table)}.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import train_gpt as tg  # noqa: E402
from machinery import checkpoint  # noqa: E402


def main(out, chunk_bytes, args):
    checkpoint.CHECKPOINT_CHUNK_BYTES = chunk_bytes
    trainers = []

    class KeptTrainer(tg.Trainer):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            trainers.append(self)

    tg.Trainer = KeptTrainer
    code = tg.main(args)
    (trainer,) = trainers
    torch.save({"exit": code, "state": trainer.model.state_dict()},
               os.path.join(out, f"rank{trainer.pg.rank}.pt"))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
