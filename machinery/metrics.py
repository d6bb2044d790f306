"""An optional metrics sink beside the log: the step lines' train loss, objective and train time and
the validations' val loss, mirrored to TensorBoard (torch.utils.tensorboard, with the tensorboard
package) or to Weights & Biases (the wandb package). The log stays the run's record; a sink only
shows its numbers in the tool a user already has.

--metrics=auto (the default) takes TensorBoard when tensorboard is installed, else W&B when wandb
is installed and set up (WANDB_API_KEY or WANDB_MODE in the environment: a W&B run never asks for
a login), else nothing; --metrics=tensorboard or --metrics=wandb insists (one line when the
package is missing); --metrics=none writes nothing. Only the process that writes the log writes
to a sink.
"""
import importlib
import importlib.util
import os

from machinery.config import ConfigError

WANDB_PROJECT = "gpt2-speedrun"    # the W&B project a run is logged to (WANDB_PROJECT overrides it)
WANDB_SETUP = ("WANDB_API_KEY", "WANDB_MODE")  # either says W&B is set up on this machine
TENSORBOARD_SUFFIX = "_tensorboard"  # <log_dir>/<run id> + this: the run's TensorBoard event folder


class NoSink:
    """Metrics go to the log only."""
    where = None

    def scalars(self, step, values):
        pass

    def close(self):
        pass


class TensorBoardSink:
    def __init__(self, folder):
        self.writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter(folder)
        self.where = f"TensorBoard events in {folder} (tensorboard --logdir {folder})"

    def scalars(self, step, values):
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def close(self):
        self.writer.close()


class WandbSink:
    def __init__(self, run_id, config, folder):
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", WANDB_PROJECT), name=run_id,
                                   config=config, dir=folder)
        self.where = f"Weights & Biases run {run_id} (project {os.environ.get('WANDB_PROJECT', WANDB_PROJECT)})"

    def scalars(self, step, values):
        self.run.log(values, step=step)

    def close(self):
        self.run.finish()


def installed(module):
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def chosen_sink(choice):
    """Which sink --metrics=`choice` means on this machine: "tensorboard", "wandb" or "none"."""
    if choice != "auto":
        return choice
    if installed("tensorboard"):
        return "tensorboard"
    if installed("wandb") and any(os.environ.get(name) for name in WANDB_SETUP):
        return "wandb"
    return "none"


def refuse_missing(choice):
    """A ConfigError when --metrics names a package this machine lacks."""
    package = {"tensorboard": "tensorboard", "wandb": "wandb"}.get(choice)
    if package and not installed(package):
        raise ConfigError(f"--metrics={choice} needs the {package} package, which is not installed: pip install "
                          f"{package}, or --metrics=auto (whatever is installed) or --metrics=none")


def open_sink(h, run_id, config, active):
    """The run's sink (NoSink on a process that does not write the log)."""
    refuse_missing(h.metrics)
    which = chosen_sink(h.metrics) if active else "none"
    if which == "tensorboard":
        return TensorBoardSink(os.path.join(h.log_dir, run_id + TENSORBOARD_SUFFIX))
    if which == "wandb":
        return WandbSink(run_id, config, h.log_dir)
    return NoSink()
