"""The README's record recipe works on a machine whose identity matches no committed log.

In a git checkout of this tree whose CPU track is redefined for tiny runs (its data: synthetic
shards under the tiny corpus's names; its baseline: baseline_adamw.py at a tiny config; a first
record made there), the README's commands run as written, in bash, with the placeholders filled,
arguments appended that make each run tiny, the corpus copied in before `tiny_corpus.py
--if-missing` (no network here), and the machine made to read as idle (IDLE_MACHINE: the runs of
a test share the machine with other work). They end in a record folder. This machine logs its CPU flags and
machine id; no committed log has them, so none of the committed baselines could serve. The test
keeps the README's commands in RECIPE: a change to them fails it until the test follows."""
import datetime
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from tiny_runs import REPO, TINY, synthetic_documents

sys.path.insert(0, REPO)
from data.shards import fingerprint, write_shard  # noqa: E402
from records.logfile import machine_identity, parse_log  # noqa: E402
from records.rules import UNKNOWN  # noqa: E402

ROOT = Path(REPO)
RECIPE = """\
git clone . /tmp/series && cd /tmp/series && python data/tiny_corpus.py --if-missing
for seed in 1 2 3; do
    python records/track_cpu/baseline_adamw.py --seed=$seed --log_dir=/tmp/logs/baseline
    python records/reproduce.py records/track_cpu/<current record> --dir /tmp/current --run -- --seed=$seed
    python train_gpt.py --preset cpu --seed=$seed --log_dir=/tmp/logs/new
done
cd - && python records/make_record.py --track track_cpu --name AdamWBaseline<Machine> \\
    --remeasured-baseline --logs /tmp/logs/baseline/*.txt
python records/make_record.py --track track_cpu --name <Idea> --author "<you>" --changed "<what changed>" \\
    --logs /tmp/logs/new/*.txt --baseline-logs records/track_cpu/<today>_AdamWBaseline<Machine> \\
    --current-record-logs /tmp/current/logs/*.txt
"""
TINY_BASELINE = ["--n_layer=1", "--n_head=2", "--n_embd=32", "--block_size=128", "--batch_size=8",
                 "--num_iterations=60", "--warmup_iters=5", "--val_tokens=2048", "--threads=1"]
TRACK_TARGET = 11.5                # above any tiny run's val loss (ln 50,304 = 10.83 at the start)
CURRENT_STEPS, NEW_STEPS = 6, 2    # the first record's steps, and the new record's (the change)
STEP_TIMEOUT_S = 600               # each bash command of the recipe
SEEDS = (1, 2, 3)
# Every Python the recipe starts imports this (PYTHONPATH): the machine reads as idle, and the runs'
# clocks count their process's CPU seconds, which other work on a shared machine hardly moves.
IDLE_MACHINE = """import os, time
os.getloadavg = lambda: (0.0, 0.0, 0.0)
time.perf_counter = time.process_time
"""


def readme_recipe():
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- recipe:start -->\n")[1].split("<!-- recipe:end -->")[0]
    return block.removeprefix("```bash\n").removesuffix("```\n")


def test_the_readme_states_the_recipe_this_test_follows():
    assert readme_recipe() == RECIPE


def sh(command, cwd, env):
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=STEP_TIMEOUT_S * 20)
    assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
    return done


def copy_tree(checkout):
    """This tree's files (tracked and untracked, not ignored), without any track's record folders."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, files):
        parts = Path(name).parts
        if parts[0] == "records" and len(parts) > 3 and parts[1].startswith("track_"):
            continue
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)


def write_corpus(folder):
    """Synthetic shards under the tiny corpus's names, with the stats.json --if-missing reads."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    names = {"train": ["tiny_train_000000.bin", "tiny_train_000001.bin"], "val": ["tiny_val_000000.bin"]}
    sizes = {"tiny_train_000000.bin": 40_000, "tiny_train_000001.bin": 30_000, "tiny_val_000000.bin": 8_000}
    for name, size in sizes.items():
        write_shard(folder / name, synthetic_documents(rng, size))
    stats = {"train_shards": names["train"], "val_shards": names["val"],
             "tokens": {"train": 70_000, "val": 8_000}, "documents": {"train": 0, "val": 0},
             "tokens_by_source": {}, "unigram_val_cross_entropy_nats": 0.0, "val_unigram_entropy_nats": 0.0}
    (folder / "stats.json").write_text(json.dumps(stats))
    return names


def git(checkout, *args):
    subprocess.run(["git", *args], cwd=checkout, check=True, capture_output=True, timeout=120)


def commit_all(checkout, message):
    git(checkout, "add", "-A")
    git(checkout, "-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-q", "-m", message)


def track_of(checkout, names, baseline_log):
    """track_cpu redefined: the synthetic data's fingerprints, a target above tiny runs, and the
    tiny baseline (its sources and config, from one of its logs)."""
    path = checkout / "records" / "track_cpu" / "track.json"
    track = json.loads(path.read_text())
    def fingerprints(kind):
        return [fingerprint(str(checkout / "data" / "tiny_corpus" / n)) | {"path": f"data/tiny_corpus/{n}"}
                for n in names[kind]]
    track |= {"target_val_loss": TRACK_TARGET, "val_tokens": 2048, "val_data": fingerprints("val"),
              "train_data": fingerprints("train"),
              "baseline": {"entry": "records/track_cpu/baseline_adamw.py", "code": [baseline_log.declared_sha256],
                           "config": {k: v for k, v in baseline_log.config.items() if k not in ("seed", "log_dir")}}}
    path.write_text(json.dumps(track, indent=2))


def test_the_readme_recipe_makes_a_record_on_a_machine_no_committed_log_ran_on(tmp_path):
    committed = [parse_log(p) for p in sorted(ROOT.glob("records/track_cpu/*AdamWBaseline*/[0-9]*.txt"))[:3]]
    here = machine_identity()
    assert all(log.environment.get(key, UNKNOWN) != here[key] for log in committed for key in here)

    checkout = tmp_path / "checkout"
    copy_tree(checkout)
    names = write_corpus(checkout / "data" / "tiny_corpus")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(IDLE_MACHINE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    git(checkout, "init", "-q")
    commit_all(checkout, "the tree")

    # the track's first record, in its own series: tiny baseline runs and tiny cpu-preset runs
    tiny = " ".join(f"'{a}'" for a in TINY)
    setup = tmp_path / "setup"
    for seed in SEEDS:
        sh(f"python records/track_cpu/baseline_adamw.py --seed={seed} --log_dir={setup}/baseline "
           f"{' '.join(TINY_BASELINE)}", checkout, env)
        sh(f"python train_gpt.py --preset cpu --seed={seed} --log_dir={setup}/first {tiny} "
           f"--num_iterations={CURRENT_STEPS}", checkout, env)
    track_of(checkout, names, parse_log(next((setup / "baseline").glob("*.txt"))))
    day = datetime.date.today().isoformat()
    sh(f"python records/make_record.py --track track_cpu --name AdamWBaselineSetup --remeasured-baseline "
       f"--logs {setup}/baseline/*.txt", checkout, env)
    sh(f"python records/make_record.py --track track_cpu --name First --author test --changed first "
       f"--logs {setup}/first/*.txt --baseline-logs records/track_cpu/{day}_AdamWBaselineSetup", checkout, env)
    commit_all(checkout, "the first record")

    # the README's recipe, as written
    script = RECIPE
    for placeholder, value in (("/tmp/series", str(tmp_path / "series")), ("/tmp/logs", str(tmp_path / "logs")),
                               ("/tmp/current", str(tmp_path / "current")), ("<current record>", f"{day}_First"),
                               ("<Machine>", "Here"), ("<Idea>", "TwoSteps"), ("<you>", "test"),
                               ("<what changed>", "two steps"), ("<today>", day)):
        script = script.replace(placeholder, value)
    script = script.replace("python data/tiny_corpus.py --if-missing",
                            f"cp -r {checkout}/data/tiny_corpus data/ && python data/tiny_corpus.py --if-missing")
    script = script.replace("--log_dir=" + str(tmp_path / "logs/baseline"),
                            "--log_dir=" + str(tmp_path / "logs/baseline") + " " + " ".join(TINY_BASELINE))
    script = script.replace("--log_dir=" + str(tmp_path / "logs/new"),
                            "--log_dir=" + str(tmp_path / "logs/new") + f" {tiny} --num_iterations={NEW_STEPS}")
    assert script.count(" ".join(TINY_BASELINE)) == 1 and script.count(f"{tiny} --num_iterations={NEW_STEPS}") == 1
    sh(script, checkout, env)

    record = checkout / "records" / "track_cpu" / f"{day}_TwoSteps"
    statistics = json.loads((record / "statistics.json").read_text())
    assert statistics["status"] == "record" and statistics["current_record"]["record"] == f"{day}_First"
    machines = {run["machine_id"] for run in statistics["runs"] + statistics["baseline"]["runs"]}
    assert machines == {here["machine_id"]}
    assert f"[TwoSteps](records/track_cpu/{day}_TwoSteps)" in (checkout / "README.md").read_text()
