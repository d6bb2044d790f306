"""--resume: a run that writes its state every few steps (resume_every), continued from that state
by another process, trains on as the run that was not stopped, bit for bit: the same step lines
and final val loss, and a final model of the same bytes (the checkpoints' data_sha256). The run
exercises every state a resume must bring back: the matrix optimizer's, two Adams' (the value
embeddings on the tables' cadence), the n-gram table's sparse Adam, a weight average, the
candidate walk's positions (a sampled softmax that continues its walk), an Adam that updates every
2nd step (so the state waits for a step without pending gradients) and the untie after the
resume point. Refusals are one line."""
import json
import re

import pytest

from tiny_runs import NGRAM, TINY, data_args, run_trainer
from records.logfile import parse_log

SAMPLED_STAGES = ('--stages=[{"end":0.5,"tokens_per_rank":512,"max_doc_len":256,"short_window":1,"long_window":2,'
                  '"mtp_weights":[1,0.5],"candidates":2048},{"end":1.0,"tokens_per_rank":512,"max_doc_len":512,'
                  '"short_window":1,"long_window":3,"candidates":1024}]')
RUN = [*TINY, *NGRAM, SAMPLED_STAGES, "--candidate_walk=continue", "--value_embed_table_cadence=true",
       "--num_iterations=7", "--untie_frac=0.7", "--adam_step_every=2", '--averages=[{"params":"qk","window":3}]',
       "--save_checkpoint=true"]
WRITTEN = re.compile(r"resume state: step (\d+) written to (\S+) ")


def log_in(folder):
    (path,) = folder.glob("*.txt")
    return parse_log(path)


def checkpoint_sha(log):
    return next(line.split("data_sha256=")[1] for line in log.info if line.startswith("checkpoint: "))


def test_a_resumed_run_continues_bit_for_bit(shards, tmp_path):
    whole = run_trainer(["--preset", "cpu", *RUN, *data_args(shards), "--resume_every=3", f"--log_dir={tmp_path}/a"])
    assert whole.returncode == 0, whole.stderr
    a = log_in(tmp_path / "a")
    written = [WRITTEN.match(line) for line in a.info if line.startswith("resume state: ")]
    # step 3 has an Adam update pending (every 2nd step): the state waits for step 4; then step 7 is the end
    assert [int(m[1]) for m in written] == [4]
    resumed = run_trainer([f"--resume={written[0][2]}", f"--log_dir={tmp_path}/b"])
    assert resumed.returncode == 0, resumed.stderr
    b = log_in(tmp_path / "b")
    assert any(line.startswith(f"resumed: from {written[0][2]} at step 4 of run {a.run_id}") for line in b.info)
    assert [(s["step"], s["train_loss"], s["objective"]) for s in b.steps] == [
        (s["step"], s["train_loss"], s["objective"]) for s in a.steps if s["step"] > 4]
    assert b.final["val_loss"] == a.final["val_loss"]
    assert checkpoint_sha(b) == checkpoint_sha(a)
    assert {k: v for k, v in b.config.items() if k != "log_dir"} == {k: v for k, v in a.config.items() if k != "log_dir"}


@pytest.mark.parametrize("args, line", [
    (["--resume=/nonexistent/x_resume.pt"], r"--resume=/nonexistent/x_resume\.pt: no such file"),
    (["--resume"], r"--resume needs the path of a resume state: --resume=PATH"),
    (["--resume=/etc/hostname"], r"--resume=/etc/hostname: not a resume state written by train_gpt\.py"),
    (["--resume=/x.pt", "--preset", "cpu"], r"--resume continues a run with its own config: give no --preset"),
])
def test_a_resume_that_cannot_be_is_one_line(args, line):
    done = run_trainer(args)
    assert done.returncode == 2 and re.fullmatch(r"error: " + line + ".*", done.stderr.strip()), done.stderr


def test_a_resume_state_takes_only_the_keys_of_where_a_run_reports(shards, tmp_path):
    done = run_trainer(["--preset", "cpu", *RUN, *data_args(shards), "--num_iterations=3", "--adam_step_every=1",
                        "--resume_every=1", f"--log_dir={tmp_path}/a"])
    assert done.returncode == 0, done.stderr
    (state,) = (tmp_path / "a").glob("*_resume.pt")
    refused = run_trainer([f"--resume={state}", "--matrix_lr=0.1"])
    assert refused.returncode == 2 and "with a checkpoint only --key=value of log_dir" in refused.stderr
    assert json.loads(json.dumps(log_in(tmp_path / "a").config))["resume_every"] == 1
