"""Training across machines: two "nodes" of one process each, meeting at a c10d rendezvous over
loopback (gloo), train exactly as one node of two processes (the same ranks, the same
collectives on the same values): the same step losses and the same final weights."""
import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from launch import cpu_env, run_distributed, run_nodes  # noqa: E402
from records.logfile import parse_log  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from tiny_runs import TINY, data_args  # noqa: E402

TIMEOUT_S = 300


def only_file(folder, suffix):
    files = [name for name in os.listdir(folder) if name.endswith(suffix)]
    assert len(files) == 1, (folder, files)
    return os.path.join(folder, files[0])


def losses(log_path):
    """Each train line's (step, train loss, objective), each validation's (step, val loss) and the
    final val loss of a log."""
    log = parse_log(log_path)
    return ([(s["step"], s["train_loss"], s["objective"]) for s in log.steps],
            [(step, val) for step, val, _ in log.val_points], log.final["val_loss"])


def test_two_nodes_of_one_process_train_as_one_node_of_two(shards, tmp_path):
    args = ["--preset", "cpu", *TINY, *data_args(shards), "--num_iterations=4", "--batch_ranks=2",
            "--save_checkpoint=true"]
    env = cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    script = os.path.join(REPO, "train_gpt.py")
    one = run_distributed(2, [script, *args, f"--log_dir={tmp_path}/one"], env, TIMEOUT_S)
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-2000:]
    nodes = run_nodes(2, [script, *args, f"--log_dir={tmp_path}/two"], env, TIMEOUT_S)
    for node in nodes:
        assert node.returncode == 0, node.stdout[-2000:] + node.stderr[-2000:]
    logs = [only_file(tmp_path / d, ".txt") for d in ("one", "two")]
    assert losses(logs[0]) == losses(logs[1]) and len(losses(logs[0])[0]) == 4
    weights = [load_file(only_file(tmp_path / d, ".safetensors")) for d in ("one", "two")]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        assert torch.equal(tensor, weights[1][name]), name
