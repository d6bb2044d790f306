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
BUILT_ON = {"speedrun": {"1gpu", "1gpu_24gb"}, "1gpu": {"1gpu_24gb"}}
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
    rows = {line.split()[0]: (line.split()[1], line.split()[-1]) for line in out.stdout.splitlines()}
    assert set(rows) == set(config.SCHEMA)
    assert rows["matrix_lr"] == (str(tg.parse_config([]).matrix_lr), "preset") and rows["seed"] == ("3", "line")
    assert rows["log_dir"][1] == "default" and rows["preset"] == ('"speedrun"', "--preset")
    assert {origin for key, (_, origin) in rows.items() if key in RECIPE_KEYS} == {"preset"}
