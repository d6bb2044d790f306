"""Resuming a run from the state it wrote.

With resume_every=K a run writes its state every K steps to <log_dir>/<run id>_resume.pt (each
time whole under a temporary name, then renamed over the previous one), at the start of a step
where no optimizer holds gradients it has not applied yet (an Adam or a table that updates every
few steps waits for its update), off the clock. `python train_gpt.py --resume=PATH` continues
from it in a new log: the same config (only the keys of RESUME_KEYS may be given beside it), the
model (its FP8 scale histories too), every optimizer's state (the matrix optimizer, the Adams, the
sparse tables'), the weight averages, each slice's candidate-walk position, the train time so
far, torch's random state, and the data position: the loader replays the steps before, and the
first batch it then builds must be the one the file records. The schedule (LRs, windows, YaRN,
the head's untie) is put where it was by Trainer.advance_to. On a CPU the continuation is the
run that was not stopped, bit for bit (tests/test_checkpoint.py).

One process, with the n-gram table on its device: a run of several processes or with the table
in host memory (ngram_cache_rows > 0) is refused with one line.
"""
import hashlib
import os

import torch

from machinery.config import (ConfigError, apply_overrides, check_config, config_from_dict, config_to_dict,
                              normalize_config)
from machinery.errors import UserError
from records.logfile import write_failure

RESUME_FORMAT = "speedrun-resume v1"  # the "format" of the files save_state writes
RESUME_SUFFIX = "_resume.pt"       # <run id> + this, in the log folder
# The keys a resumed run may set beside --resume: where and how it reports, not what it trains.
RESUME_KEYS = ("log_dir", "log_every", "save_checkpoint", "resume_every", "metrics")


class ResumeError(UserError):
    """A state file cannot be written or read, or does not fit this run; the message names the file."""


def state_path(log_dir, run_id):
    return os.path.join(log_dir, f"{run_id}{RESUME_SUFFIX}")


def refuse_unresumable(h, world_size):
    """A ConfigError when this run cannot write or take a resume state (see the module's doc)."""
    if world_size > 1:
        raise ConfigError(f"--resume_every and --resume run in one process; this run has {world_size}: set "
                          f"--resume_every=0")
    if h.ngram_cache_rows > 0:
        raise ConfigError("--resume_every and --resume need the n-gram table on the device; this run keeps it in "
                          "host memory (--ngram_cache_rows > 0): set --resume_every=0 or --ngram_cache_rows=0")


def nothing_pending(trainer):
    """Whether every optimizer has applied every gradient it took (a state can be written here)."""
    return (all(getattr(opt, "pending_calls", 0) == 0 for opt in trainer.optimizers)
            and getattr(trainer.tables, "calls", 0) == 0)


def batch_digest(slices):
    """The sha256 of a step's slices' tokens: what says the data position is the same."""
    digest = hashlib.sha256()
    for s in slices:
        digest.update(s.tokens.cpu().numpy().tobytes())
    return digest.hexdigest()


def trainer_state(trainer):
    """Everything of the trainer that training changes and the config does not give."""
    return {
        "model": trainer.model.state_dict(),
        "optimizers": [opt.state_dict() for opt in trainer.optimizers],
        "tables": [adam.state_dict() for adam in trainer.tables.adams()],
        "averages": trainer.averages.ema,
        "walk": trainer.walk,
        "train_time_ms": trainer.train_time_ms,
        "rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if trainer.pg.device.type == "cuda" else None,
    }


def save_state(path, trainer, step, next_batch, run_id):
    """Write the trainer's state at the start of `step` (whose slices are `next_batch`) to `path`,
    whole: a temporary file renamed over it."""
    state = {"format": RESUME_FORMAT, "config": config_to_dict(trainer.h), "step": step, "run_id": run_id,
             "batch_sha256": batch_digest(next_batch), **trainer_state(trainer)}
    partial = f"{path}.partial"
    try:
        torch.save(state, partial)
        os.replace(partial, path)
    except OSError as e:
        if os.path.exists(partial):
            os.unlink(partial)
        raise ResumeError(write_failure(path, e)) from None


def load_state(path):
    """The state a run wrote (save_state), read without unpickling code (weights_only)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ResumeError(f"--resume={path}: no such file (a run writes <log_dir>/<run id>{RESUME_SUFFIX} with "
                          f"--resume_every=K)") from None
    except IsADirectoryError:
        raise ResumeError(f"--resume={path}: is a folder; give the run's {RESUME_SUFFIX} file") from None
    except Exception as e:         # a truncated or foreign file: whatever the unpickler raises
        raise ResumeError(f"--resume={path}: not a resume state written by train_gpt.py ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format") != RESUME_FORMAT:
        raise ResumeError(f"--resume={path}: not a resume state written by train_gpt.py (no format "
                          f"{RESUME_FORMAT!r})")
    return state


def resume_argument(argv):
    """(PATH of --resume=PATH or --resume PATH, or None; the other arguments)."""
    for i, item in enumerate(argv):
        if item.startswith("--resume="):
            return item.split("=", 1)[1], [*argv[:i], *argv[i + 1:]]
        if item == "--resume":
            if i + 1 == len(argv):
                raise ConfigError("--resume needs the path of a resume state: --resume=PATH")
            return argv[i + 1], [*argv[:i], *argv[i + 2:]]
    return None, list(argv)


def resumed_config(path, overrides):
    """(config, state) of --resume=PATH with the --key=value `overrides` (RESUME_KEYS only)."""
    if any(item.startswith(("--preset", "--config")) for item in overrides):
        raise ConfigError("--resume continues a run with its own config: give no --preset or --config")
    state = load_state(path)
    state["path"] = path
    h = config_from_dict(state["config"])
    apply_overrides(h, overrides, allowed=RESUME_KEYS)
    h = normalize_config(h)
    check_config(h)
    return h, state


def restore_state(trainer, state):
    """The trainer as it was when `state` was written: its schedule at the step before (the loop's
    advance_to(step) then does what the run did next), then every state the run had."""
    step = state["step"]
    trainer.advance_to(max(step - 1, 0))
    trainer.model.load_state_dict(state["model"])
    for opt, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        opt.load_state_dict(saved)
    for adam, saved in zip(trainer.tables.adams(), state["tables"], strict=True):
        adam.load_state_dict(saved)
    trainer.averages.ema = [{name: t.to(trainer.pg.device) for name, t in ema.items()} for ema in state["averages"]]
    trainer.walk.copy_(state["walk"])
    trainer.train_time_ms = state["train_time_ms"]
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"] is not None and trainer.pg.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"])


def check_data_position(path, state, first_batch):
    """Refuse a resume whose loader, replayed to the state's step, builds another batch than the run's."""
    if batch_digest(first_batch) != state["batch_sha256"]:
        raise ResumeError(f"--resume={path}: the train data gives step {state['step']} another batch than the run "
                          f"had (other train files?): resume with the run's --train_files")


def save_resume_state(trainer, step, batches, log):
    """Write the run's state at the start of `step` for --resume (resume.save_state), and say so."""
    path = state_path(trainer.h.log_dir, log.run_id)
    if trainer.pg.master:
        save_state(path, trainer, step, batches.peek(), log.run_id)
    log.write(f"resume state: step {step} written to {path} (python train_gpt.py --resume={path})", echo=True)
