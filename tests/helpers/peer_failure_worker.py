"""Run train_gpt.py's main in each process of a torch.distributed job, where the process of rank
RANK alone fails at step STEP, with the DataError of a shard only it reads.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/helpers/peer_failure_worker.py RANK STEP --key=value ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import train_gpt as tg  # noqa: E402
from data.loader import DataError  # noqa: E402

FAILURE = "its own shard holds token 60000 at 321, outside GPT-2's vocabulary: rebuild it"


def main(rank, step, args):
    class FailingTrainer(tg.Trainer):
        def train_step(self, at, slices):
            if self.pg.rank == rank and at == step:
                raise DataError(f"rank {rank}: {FAILURE}")
            return super().train_step(at, slices)

    tg.Trainer = FailingTrainer
    return tg.main(args)


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]))
