"""Each preset states its whole recipe: the schema's defaults (a plain GPT) give it nothing but
how a run executes (config.RUN_KEYS); an edit to one preset moves no other, but the presets built
on it; --print_config says where every value came from."""
import subprocess
import sys

import pytest
from tiny_runs import REPO

import train_gpt as tg  # noqa: E402
from machinery import config  # noqa: E402

# Presets that are another preset with some differences: the presets built on each.
BUILT_ON = {"speedrun": {"1gpu", "1gpu_24gb", "frontier"}, "1gpu": {"1gpu_24gb"}}
RECIPE_KEYS = set(config.SCHEMA) - set(config.RUN_KEYS)


@pytest.mark.parametrize("name", sorted(tg.PRESETS))
def test_every_preset_states_its_whole_recipe(name):
    stated = set()
    config.preset_config(name, tg.PRESETS, stated)
    assert RECIPE_KEYS - stated == set(), f"{name} relies on the schema's defaults for these"


def resolved(name):
    return config.config_to_dict(tg.parse_config(["--preset", name]))


@pytest.mark.parametrize("name", sorted(tg.PRESETS))
def test_an_edit_to_one_preset_moves_no_other_but_those_built_on_it(name, monkeypatch):
    before = {other: resolved(other) for other in tg.PRESETS}
    original = tg.PRESETS[name]

    def edited(h):
        original(h)
        h.matrix_lr = 0.0123
    monkeypatch.setattr(tg, original.__name__, edited)   # what the presets built on it call
    monkeypatch.setitem(tg.PRESETS, name, edited)
    moved = {other for other in tg.PRESETS if resolved(other) != before[other]}
    assert moved == {name} | BUILT_ON.get(name, set())


def test_print_config_names_each_values_origin():
    out = subprocess.run([sys.executable, "train_gpt.py", "--preset", "speedrun", "--print_config", "--seed=3"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    note, *lines = out.stdout.splitlines()
    assert note.startswith("# preset speedrun: Record 92, the whole recipe")
    rows = {line.split()[0]: (line.split()[1], line.split()[-1]) for line in lines}
    assert set(rows) == set(config.SCHEMA)
    assert rows["matrix_lr"] == (str(tg.parse_config([]).matrix_lr), "preset") and rows["seed"] == ("3", "line")
    assert rows["log_dir"][1] == "default" and rows["preset"] == ('"speedrun"', "--preset")
    assert {origin for key, (_, origin) in rows.items() if key in RECIPE_KEYS} == {"preset"}


def test_the_frontier_is_record_92_with_the_stacked_techniques_at_their_places():
    """`frontier`: speedrun's recipe but the stacked techniques' keys and the run's length; PR 371's
    steps at their shares of the shorter run; said by --print_config to be a stack no run has measured."""
    frontier, speedrun = tg.parse_config(["--preset", "frontier"]), tg.parse_config(["--preset", "speedrun"])
    theirs = config.config_to_dict(speedrun)
    changed = {k for k, v in config.config_to_dict(frontier).items() if v != theirs[k]}
    assert changed == {"preset", "track", "num_iterations", "ngram_normalized", "pointer_mixture", "head_grad_stride",
                       "head_grad_start",
                       "attn_bwd_windows", "attn_bwd_choice_steps", "attn_bwd_start", "approx_exact_last_steps"}
    assert frontier.num_iterations == 1050 and frontier.track == "none"
    assert (frontier.head_grad_start, frontier.attn_bwd_choice_steps, frontier.attn_bwd_start,
            frontier.approx_exact_last_steps) == (281, (521, 522), 523, 77)   # 320, 592, 594, 87 of 1194
    assert frontier.stages == speedrun.stages       # ends are shares of the run
    out = subprocess.run([sys.executable, "train_gpt.py", "--preset", "frontier", "--print_config"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.stdout.startswith("# preset frontier: A stack no run has measured"), out.stdout[:200]
