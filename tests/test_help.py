"""What --help tells: train_gpt.py lists every config key with its type, its allowed values and its
meaning, read from the schema (machinery/config.py's fields, their metadata and their comments), with the
named preset's values; every bench script and --plan answer --help."""
import pathlib
import re
import subprocess
import sys

import pytest
from launch import cpu_env
from tiny_runs import REPO

sys.path.insert(0, REPO)
import train_gpt as tg  # noqa: E402
from machinery import config  # noqa: E402

TYPE_WORDS = {int: "INT", float: "FLOAT", bool: "true|false", str: "STR", tuple: "JSON-LIST", list: "JSON-LIST"}
# A schema field with a comment on its own line: `    name: type = ...  # the comment`
COMMENTED_FIELD = re.compile(r"^    (\w+): \w+ = .*?  # (.+)$")


def help_text(*args):
    done = subprocess.run([sys.executable, "train_gpt.py", *args, "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cpu_env())
    assert done.returncode == 0 and not done.stderr, done.stderr
    return done.stdout


def key_lines(text):
    """{key: its line} of the help's list of keys."""
    return {m[1]: line for line in text.splitlines() if (m := re.match(r"  --(\w+)=", line))}


def test_help_lists_every_key_with_its_type_range_and_meaning():
    lines = key_lines(help_text())
    assert set(lines) == set(config.SCHEMA) - {"preset"}
    comments = {m[1]: m[2] for line in pathlib.Path(REPO, "machinery", "config.py").read_text().splitlines()
                if (m := COMMENTED_FIELD.match(line))}
    assert len(comments) > 60     # most fields say what they are on their own line
    for name, f in config.SCHEMA.items():
        if name == "preset":
            continue
        line = lines[name]
        kind = "|".join(f.metadata["choices"]) if "choices" in f.metadata else TYPE_WORDS[f.type]
        assert line.startswith(f"  --{name}={kind} "), line
        if "allowed" in f.metadata:
            assert f.metadata["allowed"] in line, line
        if name in comments:
            assert comments[name] in line, line
    # a comment above its field, and the heading above that one left out
    assert "long window (blocks) of the final validation" in lines["val_long_window"]
    assert "model schedule" not in lines["val_long_window"]
    assert lines["train_files"].split(None, 1)[1].startswith("the train shards; a path (or glob) [")


def help_groups(text):
    """[(heading, [keys])] of the help's list of keys, in order."""
    groups = []
    for line in text.split("every key, as --key=value")[1].split("\n each entry of")[0].splitlines()[1:]:
        if re.fullmatch(r" \S.*:", line):
            groups.append((line.strip().rstrip(":"), []))
        elif m := re.match(r"  --(\w+)=", line):
            groups[-1][1].append(m[1])
    return groups


def test_help_groups_every_key_by_purpose_each_with_a_meaning():
    """Each key is under one heading of config.HELP_GROUPS (none under "other keys"), and each
    line says what the key is, beyond its type and range."""
    text = help_text("--preset", "cpu")
    groups = help_groups(text)
    assert [heading for heading, _ in groups] == list(config.HELP_GROUPS)
    placed = [key for _, keys in groups for key in keys]
    assert sorted(placed) == sorted(set(config.SCHEMA) - {"preset"}) and len(placed) == len(set(placed))
    meanings = config.field_comments(config.ModelConfig) | config.field_comments(config.Hyperparameters)
    for key, line in key_lines(text).items():
        assert meanings[key] and line.split(None, 1)[1].startswith(meanings[key]), line
    keys_of = dict(groups)
    assert {"matrix_lr", "momentum_warmup_start"} <= set(keys_of["matrix optimizer (Muon, NorMuon, ANVIL, or Adam)"])
    assert "track" in keys_of["the run: its track, seed, device, log and outputs"]
    assert "kernels" in keys_of["kernels, compilation, FP8 and the warm-up"]
    assert not re.search(r"^ (auto|muon/normuon|the table|run):$", text, re.M)   # comments taken for headings
    assert "one stage: causal attention" not in key_lines(text)["stages"]          # the default's comment is not its meaning


def test_help_shows_the_named_presets_values():
    cpu = tg.parse_config(["--preset", "cpu"])
    lines = key_lines(help_text("--preset", "cpu"))
    assert lines["num_iterations"].endswith(f"[cpu: {cpu.num_iterations}]")
    assert lines["optimizer"].endswith(f'[cpu: "{cpu.optimizer}"]')
    speedrun = tg.parse_config(["--preset", "speedrun"]).num_iterations
    assert key_lines(help_text("--preset", "speedrun"))["num_iterations"].endswith(f"[speedrun: {speedrun}]")


def test_help_lists_the_keys_of_a_stage():
    text = help_text()
    stage = text.split("each entry of --stages")[1].split("\n\n")[0]
    assert "  tokens_per_rank: tokens in one rank's slice of the global batch" in stage
    assert [line.split(":")[0].strip() for line in stage.splitlines()[1:]] == config.STAGE_FIELDS


@pytest.mark.parametrize("script", sorted(p.name for p in pathlib.Path(REPO, "bench").glob("*.py")))
def test_every_bench_script_answers_help(script):
    done = subprocess.run([sys.executable, f"bench/{script}", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=cpu_env())
    assert done.returncode == 0 and done.stdout.startswith("usage: "), (done.stdout, done.stderr)


def test_plan_answers_help():
    done = subprocess.run([sys.executable, "train_gpt.py", "--plan", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cpu_env())
    assert done.returncode == 0 and "--gpu_gib GPU_GIB" in done.stdout and "--host_gib HOST_GIB" in done.stdout
