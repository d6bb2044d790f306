"""Train the tiny model with its n-gram table split across the processes of a torch.distributed
job twice from the same start: with each slice's Route worked out ahead by the batch prefetcher
(from every process's slices, which each process packs itself), and with the tokens gathered
from the processes before each forward; save what each way ends with.

    OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/helpers/routing_worker.py OUT STEPS --key=value ...

Each process writes OUT/rank<r>.pt: {way: {"losses", "state" (the model's state dict), "routes"
(each micro-batch's Route fields)}} for the ways "ahead" and "gathered".
"""
import dataclasses
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
import train_gpt as tg  # noqa: E402
from data.loader import BatchPrefetcher, TrainLoader  # noqa: E402
from machinery.processes import start_process  # noqa: E402


def route_fields(route):
    return {"send": route.send_counts, "recv": route.recv_counts, "asked": route.asked.clone(),
            **{f.name: getattr(route.groups, f.name).clone() for f in dataclasses.fields(route.groups)}}


def train(h, env, steps, ahead):
    trainer = tg.Trainer(h, env, tg.RunLog("unused", active=False))
    loader = TrainLoader(tg.shards_of(h.train_files), tg.batch_tokens(h))
    routes, route_of = [], trainer.tables.router.route_of
    if ahead:
        batches = BatchPrefetcher(loader, functools.partial(tg.batch_shape, h), trainer.mine, pin=False,
                                  router=trainer.tables.router)
    else:                          # the routes fetch works out from the gathered tokens
        trainer.tables.router.route_of = lambda *a: routes.append(route_of(*a)) or routes[-1]
    losses = []
    for step in range(steps):
        trainer.advance_to(step)
        if ahead:
            slices = batches.get(step)
            routes += [s.route for s in slices]
        else:
            stage = h.stages[tg.stage_index(h, step)]
            slices = loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks, trainer.mine)
        losses.append(trainer.train_step(step, slices).tolist())
    if ahead:
        batches.close()
    return {"losses": losses, "state": {k: v.clone() for k, v in trainer.model.state_dict().items()},
            "routes": [route_fields(r) for r in routes]}


def main(out, steps, args):
    h = tg.parse_config(args)
    env = start_process(h)
    result = {way: train(h, env, steps, ahead) for way, ahead in (("ahead", True), ("gathered", False))}
    torch.save(result, os.path.join(out, f"rank{env.rank}.pt"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
