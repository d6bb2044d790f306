"""Train the tiny model with its n-gram table split across the processes of a torch.distributed
job, and save what each process ends with.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/helpers/ngram_dist_worker.py OUT STEPS --key=value ...

Each process writes OUT/rank<r>.pt: {"first_row", "shard" (its rows of the table), "values"
(the value-embedding tables), "losses" (per step), "val" (the validation loss after the last
step)}. tests/test_sparse_tables.py imports `train_and_validate` to run the same steps in one process,
where the table is whole.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import train_gpt as tg  # noqa: E402
from data.loader import TrainLoader  # noqa: E402
from machinery.processes import start_process  # noqa: E402


def train_and_validate(trainer, h, steps):
    """(per-step [next-token loss, objective], val loss after the steps) from the start of h's data."""
    loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
    losses = []
    for step in range(steps):
        trainer.advance_to(step)
        stage = h.stages[tg.stage_index(h, step)]
        slices = loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
        losses.append(trainer.train_step(step, slices).tolist())
    val = trainer.validate(tg.validation_data(h, trainer.pg, tg.shards_of(h.val_files)), steps, False)
    return losses, val


def main(out, steps, args):
    h = tg.parse_config(args)
    env = start_process(h)
    trainer = tg.Trainer(h, env, tg.RunLog("unused", active=False))
    losses, val = train_and_validate(trainer, h, steps)
    ngram = trainer.model.ngram
    values = [ve.weight.detach().clone() for ve in trainer.model.value_embeds]
    torch.save({"first_row": ngram.first_row, "shard": ngram.table.clone(), "values": values, "losses": losses,
                "val": val},
               os.path.join(out, f"rank{env.rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
