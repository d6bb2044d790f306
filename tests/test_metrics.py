"""The optional metrics sink: with a W&B package on the path (a stand-in here, which records what it
is given) a run mirrors each step line's train loss and each validation's val loss to it; with no
sink package installed --metrics=auto writes nothing and the run is as before; a sink asked for
by name whose package is missing is one line."""
import json
import os
import sys

import pytest
from tiny_runs import REPO, TINY, data_args, run_trainer

from records.logfile import parse_log

sys.path.insert(0, REPO)
from machinery import metrics  # noqa: E402

STAND_IN = '''"""A stand-in for the wandb package: what a run gives it, as JSON lines in $WANDB_RECORD."""
import json, os

class Run:
    def __init__(self, **kwargs):
        self.out = open(os.environ["WANDB_RECORD"], "a")
        self.out.write(json.dumps({"init": {k: kwargs[k] for k in ("project", "name")}}) + "\\n")

    def log(self, values, step):
        self.out.write(json.dumps({"step": step, **values}) + "\\n")

    def finish(self):
        self.out.write(json.dumps({"finish": True}) + "\\n")
        self.out.close()

def init(**kwargs):
    return Run(**kwargs)
'''


def test_a_run_mirrors_its_losses_to_an_installed_sink(shards, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "wandb.py").write_text(STAND_IN)
    record = tmp_path / "record.jsonl"
    done = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=3", "--metrics=auto",
                        f"--log_dir={tmp_path}/logs"],
                       env_extra={"PYTHONPATH": str(tmp_path / "site"), "WANDB_MODE": "offline",
                                  "WANDB_RECORD": str(record)})
    assert done.returncode == 0, done.stderr
    (path,) = (tmp_path / "logs").glob("*.txt")
    log = parse_log(path)
    entries = [json.loads(line) for line in record.read_text().splitlines()]
    assert entries[0] == {"init": {"project": "gpt2-speedrun", "name": log.run_id}} and entries[-1] == {"finish": True}
    trained = [(e["step"], round(e["train/loss"], 4)) for e in entries if "train/loss" in e]
    assert trained == [(s["step"], s["train_loss"]) for s in log.steps]
    assert [(e["step"], round(e["val/loss"], 4)) for e in entries if "val/loss" in e] == [
        (step, loss) for step, loss, _ in log.val_points]
    assert f"metrics: Weights & Biases run {log.run_id} (project gpt2-speedrun)" in log.info


def test_without_a_sink_package_a_run_writes_only_its_log(shards, tmp_path):
    if metrics.installed("tensorboard") or metrics.installed("wandb"):
        pytest.skip("a sink package is installed here")
    done = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=2",
                        f"--log_dir={tmp_path}"])
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(tmp_path)) == [n for n in os.listdir(tmp_path) if n.endswith(".txt")]
    assert "metrics:" not in done.stdout


def test_a_sink_named_but_not_installed_is_one_line(shards, tmp_path):
    missing = next((name for name in ("tensorboard", "wandb") if not metrics.installed(name)), None)
    if missing is None:
        pytest.skip("both sink packages are installed here")
    done = run_trainer(["--preset", "cpu", *TINY, *data_args(shards), f"--metrics={missing}",
                        f"--log_dir={tmp_path}"])
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: --metrics={missing} needs the {missing} package, which is not installed: pip install {missing}, "
        f"or --metrics=auto (whatever is installed) or --metrics=none"]
    assert not list(tmp_path.glob("*.txt"))     # refused before the log
