"""The untimed warm-up of a run, on the recipe it is given (train_gpt, whose schedule says which
graphs the timed run uses): every graph key's training steps (torch.compile and the Triton JIT
do their work, kernel_choice times its candidates), each key's CUDA graph captured, each distinct
validation forward, then the initial state restored; each part's line logged as it ends. Also
the guard that makes a host sync an error on CUDA."""
import contextlib
import copy
import functools
import time

import torch

from machinery.checkpoint import NGRAM_TABLE_KEY
from machinery.processes import synchronize


def compiled_graphs():
    """Graphs torch.compile has built in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]



@contextlib.contextmanager
def host_syncs_are_errors(enabled):
    """With `enabled` (CUDA only), any operation that makes the CPU wait for the GPU raises."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")



def warm_up_steps_per_key(h):
    """The warm-up's training steps per graph key: warmup_steps, and with CUDA graphs enough for
    Adam to update under it (and be captured)."""
    return max(h.warmup_steps, h.adam_step_every if h.cuda_graphs and h.warmup_steps else 0)



def warm_up_validations(recipe, h):
    """The validation forwards the warm-up runs: one per distinct (windows, tied head)."""
    return len({(recipe.attention_windows(h, step, final), step < recipe.untie_step(h))
                for step, final in recipe.validation_points(h)})



def warm_up_line(recipe, trainer, seconds, graphs):
    """What the untimed warm-up did on this device, and what this device had no need of."""
    h, did, not_here = trainer.h, [], []
    if trainer.needs_warm_up():
        did.append(f"{len(recipe.graph_changes(h)) * warm_up_steps_per_key(h)} training steps and "
                   f"{warm_up_validations(recipe, h)} validation forward(s) at every shape the run uses")
    for done, what, missing in ((h.compile, f"torch.compile of {graphs} graphs", "no compilation"),
                                (trainer.kernels.triton, "the Triton kernels' JIT", "no Triton JIT"),
                                (trainer.graphs.capturing, f"{trainer.graphs.captured()} CUDA graphs captured",
                                 "no CUDA graphs"),
                                (trainer.kernels.any_fp8, "FP8 calibration", "no FP8 calibration")):
        (did if done else not_here).append(what if done else missing)
    on_device = f"; on this {trainer.pg.device.type}: {', '.join(not_here)}" if not_here else ""
    return (f"warm-up: {seconds:.1f}s untimed ({', '.join(did) or 'none: nothing to compile or warm'}{on_device}); "
            f"train_time counts from step 0")



@contextlib.contextmanager
def warm_up_part(trainer, what):
    """One part of the warm-up: its line (WARM_UP_PART) once it is done, with its seconds and the
    graphs torch.compile built in it, so that a run stopped in the warm-up has said how far it
    came and what each compile cost."""
    log = trainer.log
    log.progress = f"in the warm-up ({what})"
    start, graphs = time.perf_counter(), compiled_graphs()
    yield
    synchronize(trainer.pg.device)
    log.write(f"{WARM_UP_PART}{what}: {time.perf_counter() - start:.1f} s, {compiled_graphs() - graphs} graph(s) "
              f"compiled", echo=True)



WARM_UP_PART = "warm-up part: "    # starts each line warm_up_part writes



def key_text(recipe, h, step):
    """`step`'s graph key in words: its stage and whether the head is tied."""
    stage, tied = recipe.graph_key(h, step)[:2]
    return f"stage {stage} ({h.stages[stage].tokens_per_rank:,} tokens), head {'tied' if tied else 'untied'}"



def warm_up(recipe, trainer, train_files, val_slices, progress=None):
    """Untimed: run every graph the timed run will use (each stage's shape, the untie, each
    validation's windows), so that torch.compile and the Triton JIT do their work here, then
    capture each training step's CUDA graph: after every key's eager steps, so that no eager step
    runs beside the graphs' memory pool (a stage's step plus the pool would be two steps' memory
    at once); then restore the initial model, optimizer and schedule state. Each part's seconds
    are logged as it ends (warm_up_part); `progress` (a progress.Progress) says each step, capture
    and validation forward before it starts. Returns the graphs torch.compile built."""
    h, part = trainer.h, functools.partial(warm_up_part, trainer)
    say = progress.say if progress is not None else lambda piece: None
    before = compiled_graphs()
    saved = snapshot(trainer)
    loader = recipe.train_loader(h, train_files)
    trainer.graphs.in_warm_up = trainer.tables.frozen = True
    steps_per_key, keys = warm_up_steps_per_key(h), recipe.graph_changes(h)
    for k, step in enumerate(keys):
        with part(f"{steps_per_key} training step(s) of {key_text(recipe, h, step)}"):
            trainer.advance_to(step)
            stage = h.stages[recipe.stage_index(h, step)]
            for i in range(steps_per_key):
                say(f"training step {k * steps_per_key + i + 1}/{len(keys) * steps_per_key} (graph {k + 1}/"
                    f"{len(keys)}: the shape of step {step})")
                trainer.train_step(step, loader.next_batch(stage.tokens_per_rank, stage.max_doc_len, h.batch_ranks,
                                                           trainer.mine))
            if h.warmup_steps:
                trainer.capture_graph(step, prepare_only=True)
    for k, step in enumerate(keys if h.warmup_steps and trainer.graphs.capturing else ()):
        say(f"capturing graph {k + 1}/{len(keys)}")
        with part(f"the CUDA graph of {key_text(recipe, h, step)}"):
            trainer.advance_to(step)
            trainer.capture_graph(step)
    for adam in trainer.tables.adams():     # the frozen tables' updates, on scratch tables
        adam.launch_on_scratch()
    trainer.averages.launch_on_scratch()
    trainer.graphs.in_warm_up = trainer.tables.frozen = False
    seen = set()
    for step, final in recipe.validation_points(h):
        graph = (recipe.attention_windows(h, step, final), step < recipe.untie_step(h))
        if graph not in seen:
            seen.add(graph)
            say(f"validation forward {len(seen)}/{warm_up_validations(recipe, h)}")
            with part(f"a validation forward, windows {graph[0]}, head {'tied' if graph[1] else 'untied'}"):
                trainer.advance_to(step, final)
                trainer.validate(val_slices[:1], step, final)
    restore(trainer, saved)
    trainer.advance_to(0)
    synchronize(trainer.pg.device)
    return compiled_graphs() - before


def snapshot(trainer):
    """Copies of the trainer's model and optimizer state (see restore), but the n-gram table's:
    it can be as large as memory, and it does not move while the tables are frozen."""
    return ({k: v.clone() for k, v in trainer.model.state_dict().items() if k != NGRAM_TABLE_KEY},
            [copy.deepcopy(opt.state_dict()) for opt in trainer.optimizers])


def restore(trainer, saved):
    """The snapshot's model and optimizer state, with no gradient pending and every candidate
    walk at its start, as at step 0."""
    model_state, optimizer_states = saved
    missing, unexpected = trainer.model.load_state_dict(model_state, strict=False)
    assert set(missing) <= {NGRAM_TABLE_KEY} and not unexpected, (missing, unexpected)
    for opt, state in zip(trainer.optimizers, optimizer_states):
        opt.load_state_dict(copy.deepcopy(state))
    trainer.zero_grads()
    trainer.reset_walk()
