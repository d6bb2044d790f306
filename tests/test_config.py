"""The config's schema (machinery/config.py): presets resolve, values parse by their annotated types and
round-trip through a log, bad values and keys that do not fit together are refused naming them,
every field carries the rule its type needs, and the cpu preset is the CPU track's current record."""
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tiny_runs import DENSE, tiny_config  # noqa: E402

import train_gpt as tg  # noqa: E402
from machinery import config  # noqa: E402
from records.logfile import parse_log  # noqa: E402
from machinery.config import ConfigError  # noqa: E402


def test_presets_resolve_and_overrides_parse():
    for name in tg.PRESETS:
        h = tg.parse_config(["--preset", name])
        assert h.preset == name and h.stages[-1].end == 1.0
    h = tg.parse_config(["--preset", "cpu", "--num_iterations=7", "--seed=3", "--compile=false",
                         "--long_window_layers=[0,2]"])
    assert (h.num_iterations, h.seed, h.compile, h.long_window_layers) == (7, 3, False, (0, 2))
    assert tg.parse_config(["--preset", "1gpu"]).batch_ranks == tg.parse_config([]).batch_ranks == 8


def test_config_round_trips_through_json(tmp_path):
    h = tg.parse_config(["--preset", "cpu", "--seed=5"])
    path = tmp_path / "c.json"
    path.write_text(json.dumps(tg.config_to_dict(h)))
    assert tg.parse_config(["--config", str(path)]) == h


@pytest.mark.parametrize("args, keys", [
    (["--head_dim=30"], ["head_dim"]),
    (["--long_window_layers=[5]"], ["long_window_layers"]),
    (["--value_embed_gate_dim=100"], ["value_embed_gate_dim", "model_dim"]),
    (["--num_value_embeds=2"], ["num_value_embeds", "num_layers"]),
    (["--attention_free_layers=[0]"], ["num_value_embeds", "attention_free_layers"]),
    (["--num_value_embeds=0", "--attention_free_layers=[2]"], ["long_window_layers", "attention_free_layers"]),
    (["--key_offset=true", "--long_window_layers=[]"], ["key_offset", "long_window_layers"]),
    (["--xsa_layers=[3]"], ["xsa_layers"]),
    (["--paired_head_layers=[1]"], ["paired_head_layers", "attention_free_layers"]),
    (["--paired_head_layers=[0]", "--xsa_layers=[0]"], ["paired_head_layers", "xsa_layers"]),
    (["--paired_head_layers=[2]", "--key_offset=true"], ["key_offset", "paired_head_layers", "long_window_layers"]),
    (["--paired_head_layers=[0]", "--num_heads=3"], ["paired_head_layers", "num_heads"]),
    (["--value_embed_layers=[0]"], ["num_value_embeds", "value_embed_layers"]),
    (["--num_value_embeds=0", "--value_embed_layers=[1]"], ["value_embed_layers", "attention_free_layers"]),
    (["--value_embed_gate_reads_value=true", "--value_embed_gate_dim=5"],
     ["value_embed_gate_reads_value", "value_embed_gate_dim"]),
    (["--xsa_layers=[1]"], ["xsa_layers", "attention_free_layers"]),
    (["--smear_gate=true", "--model_dim=8", "--value_embed_gate_dim=4"], ["smear_gate", "model_dim"]),
    (["--qk_ortho_heads=3", "--num_heads=2"], ["qk_ortho_heads", "num_heads"]),
    (["--narrow_qk_layers=[1]"], ["narrow_qk_layers", "attention_free_layers"]),
    (["--narrow_vo_layers=[1]"], ["narrow_vo_layers", "attention_free_layers"]),
    (["--narrow_qk_layers=[2]", "--key_offset=true"], ["key_offset", "narrow_qk_layers", "long_window_layers"]),
    (["--narrow_vo_layers=[0]"], ["num_value_embeds", "narrow_vo_layers"]),
    (["--narrow_qk_layers=[3]"], ["narrow_qk_layers"]),
    (["--attn_gate_layers=[0]"], ["attn_gate_layers", "token_gates"]),
    (["--token_gates=true", "--attn_gate_layers=[1]"], ["attn_gate_layers", "attention_free_layers"]),
    (["--token_gates=true", "--token_gates_split=4"], ["token_gates_split", "num_layers"]),
    (["--trunk=dense"], ["trunk", "token_gates"]),
    (["--composed_layers=[2]"], ["composed_layers", "token_gates"]),
    (["--token_gates=true", "--composed_layers=[0]", "--paired_head_layers=[0]"],
     ["composed_layers", "attention_free_layers", "paired_head_layers"]),
    ([*DENSE, "--skip_layers=[0,2]"], ["skip_layers", "attention_free_layers"]),
    ([*DENSE, "--snapshot_layer=2"], ["snapshot_layer", "num_layers"]),
    ([*DENSE, "--narrow_vo_layers=[2]", "--num_value_embeds=0"], ["trunk", "attention_free_layers", "narrow_vo_layers"]),
    ([*DENSE, "--x0_layers=[0,1]"], ["x0_layers", "skip_layers", "num_layers"]),
    ([*DENSE, "--hashed_layers=[0,2]"], ["hashed_layers", "skip_layers", "num_layers"]),
    ([*DENSE, "--mlp_free_layers=[2]"], ["mlp_free_layers", "num_layers"]),
    (["--x0_layers=[0]"], ["x0_layers", "hashed_layers", "trunk"]),
    (["--mlp_free_layers=[1]", "--parallel_mlp_layers=[1]"], ["mlp_free_layers", "parallel_mlp_layers"]),
    ([*DENSE, "--final_mix=record92", "--model_dim=104", "--head_dim=52"], ["final_mix", "model_dim"]),
    ([*DENSE, "--final_mix=record92", "--num_value_embeds=0", "--value_embed_layers=[0]", "--narrow_vo_layers=[0]",
      "--narrow_vo_dim=16"], ["final_mix", "value_embed_full_width", "narrow_vo_layers"]),
    (["--cooldown_start=0.5", "--cooldown_end=0.4"], ["cooldown_start", "cooldown_end"]),
])
def test_a_model_config_that_cannot_be_built_is_refused_naming_its_keys(args, keys):
    with pytest.raises(ConfigError) as refused:
        tiny_config(args)
    message = str(refused.value)
    assert "\n" not in message and all(f"--{key}=" in message for key in keys), message


def test_a_config_with_keys_the_schema_does_not_have_is_refused_by_name():
    d = tg.config_to_dict(tiny_config())
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['adam_betas', 'adam_wd'\]"):
        config.config_from_dict({**d, "adam_betas": [0.7, 0.9], "adam_wd": 0.5})


def test_averages_refuse_unknown_params_and_bad_values():
    for bad, what in [('{"params":"all","window":3}', "params"), ('{"params":"qk","window":0}', "window"),
                      ('{"params":"qk","window":3,"rate":0}', "rate"), ('{"params":"qk","window":3,"blend":2}', "blend"),
                      ('{"params":"qk"}', "window required")]:
        with pytest.raises(ConfigError, match=what):
            tiny_config([f"--averages=[{bad}]"])


def test_cpu_preset_is_the_current_cpu_record(tmp_path):
    """`./run.sh` on a CPU (the cpu preset) trains what the CPU track's current record (the first
    row of the README's table) ran: its logged config, apart from the seed and the log folder
    (keys added since take defaults that change nothing)."""
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    table = readme.split("<!-- records:track_cpu:start -->")[1].split("<!-- records:track_cpu:end -->")[0]
    first = next(line for line in table.splitlines() if line.startswith("| 1 "))
    folder = os.path.join(REPO, first.split("](")[1].split(")")[0])
    with open(os.path.join(folder, "statistics.json"), encoding="utf-8") as f:
        runs = json.load(f)["runs"]         # the record's own runs (its folder also keeps the re-runs it beat)
    log = parse_log(os.path.join(folder, runs[0]["log"]))
    logged = {k: v for k, v in log.config.items() if k not in ("seed", "log_dir", "entry")}
    preset = tg.config_to_dict(tg.parse_config(["--preset", "cpu"]))
    preset = json.loads(json.dumps({k: v for k, v in preset.items() if k not in ("seed", "log_dir", "entry")}))
    for key in ("stages", "averages", "table_phases"):    # (fields of their entries added since: their defaults)
        preset[key] = [{k: v for k, v in entry.items() if k in old} for entry, old in zip(preset[key], logged[key])]
    assert {k: v for k, v in preset.items() if k in logged} == logged   # keys added since: their defaults
    (tmp_path / "record.json").write_text(json.dumps(logged))
    assert tg.parse_config(["--config", str(tmp_path / "record.json")]) == tg.parse_config(["--preset", "cpu"])


def test_every_field_carries_the_rule_its_type_needs():
    """A number has a range, a string its choices (or is a path), a tuple is a list of layers,
    betas or ascending whole numbers (skip_layers: the dense trunk's pair); so no key escapes the
    checks."""
    for f in config.SCHEMA.values():
        rule = f.metadata
        if f.type in (int, float):
            assert "allowed" in rule and rule.get("integer", False) == (f.type is int), f.name
        elif f.type is str:
            assert "choices" in rule or rule.get("path") or f.name == "preset", f.name
        elif f.type is tuple:
            assert rule.get("layers") or rule.get("betas") or rule.get("ascending") or f.name == "skip_layers", f.name
        else:
            assert f.type in (bool, list), f.name


@pytest.mark.parametrize("key, value, allowed", [
    ("num_iterations", 0, r"a whole number of steps in \[1, 10,000,000\]"),
    ("head_dim", 30, r"a multiple of 4"),
    ("ngram_rows", 3, r"a multiple of 2"),
    ("cooldown_end", 0.0, r"a fraction of training in \(0, 1\]"),
    ("matrix_lr", -1e-3, r"a learning rate >= 0"),
    ("anvil_slow_beta", 1.5, r"a beta in \[0, 1\)"),
    ("trunk", "tree", r"one of unet, dense"),
    ("log_dir", "", r"a non-empty path"),
    ("xsa_layers", (0, 0), r"distinct layer indices"),
    ("x0_layers", (7,), r"distinct layer indices in \[0, 4\)"),
    ("fp8_head", 1, r"true or false"),
])
def test_each_rule_refuses_a_value_outside_it(key, value, allowed):
    h = tg.parse_config(["--preset", "cpu"])
    setattr(h, key, value)
    with pytest.raises(config.ConfigError, match=rf"--{key}=.* is not allowed: expects .*{allowed}"):
        config.check_config(h)
    config.check_config(tg.parse_config(["--preset", "cpu"]))     # the preset itself passes


PHASE = '{{"start":{},"ngram_beta2":{},"value_embed_beta2":0.9,"step_every":{}}}'


@pytest.mark.parametrize("phases, refusal", [
    (f"[{PHASE.format(0, 0.9, 2)}]", r"phase 0 starts at 0: phases start at increasing steps >= 1"),
    (f"[{PHASE.format(5, 0.9, 2)},{PHASE.format(5, 0.8, 4)}]", r"phase 1 starts at 5"),
    (f"[{PHASE.format(5, 1.5, 2)}]", r"phase 0 has ngram_beta2=1.5: expects a beta in \[0, 1\)"),
    (f"[{PHASE.format(5, 0.9, 0)}]", r"phase 0 has step_every=0"),
    ('[{"start":5}]', r"is not a phase; a phase is a JSON object with keys"),
])
def test_bad_table_phases_are_refused_naming_the_phase(phases, refusal):
    with pytest.raises(config.ConfigError, match=r"--table_phases: .*" + refusal):
        tg.parse_config(["--preset", "cpu", f"--table_phases={phases}"])
    h = tg.parse_config(["--preset", "cpu", f"--table_phases=[{PHASE.format(5, 0.9, 2)},{PHASE.format(9, 0.8, 4)}]"])
    assert [(p.start, p.step_every) for p in h.table_phases] == [(5, 2), (9, 4)]


def launch_of(processes, rank=0):
    from machinery import processes as p
    return p.Launch(world_size=processes, rank=rank, local_world_size=processes, local_rank=rank, master="",
                    rendezvous_timeout_s=1.0, agent_store=None, attempt="0")


def test_without_a_preset_train_gpt_runs_what_run_sh_runs_on_this_machine(monkeypatch, capsys):
    """No GPU: the cpu preset (as ./run.sh); GPUs: launch_plan's choice for this launch's processes,
    said in one line; a plan for another process count is refused; a named preset stays."""
    import subprocess

    from launch import cpu_env
    done = subprocess.run([sys.executable, "train_gpt.py", "--print_config"], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env=cpu_env())
    assert done.returncode == 0 and '"cpu"' in next(line for line in done.stdout.splitlines()
                                                     if line.startswith("preset ")), done
    monkeypatch.setattr(tg.torch.cuda, "is_available", lambda: False)
    assert tg.memory_budget.with_machine_preset(tg, ["--seed=1"], launch_of(1)) == ["--preset", "cpu", "--seed=1"]
    assert tg.memory_budget.with_machine_preset(tg, ["--preset=medium"], launch_of(1)) == ["--preset=medium"]
    monkeypatch.setattr(tg.torch.cuda, "is_available", lambda: True)
    plans = []

    def plan(recipe, gpus, argv=(), available=None):
        plans.append((gpus, list(argv)))
        return ["--preset", "1gpu", "--ngram_cache_rows=0"], 1, "1 GPU of 79.6 GiB: the reason"
    monkeypatch.setattr(tg.memory_budget, "launch_plan", plan)
    assert tg.memory_budget.with_machine_preset(tg, ["--seed=1", "--help"], launch_of(1)) == [
        "--preset", "1gpu", "--ngram_cache_rows=0", "--seed=1", "--help"]
    assert plans == [(1, ["--seed=1"])]
    assert capsys.readouterr().err == "train_gpt.py: no --preset given, as ./run.sh here: 1 GPU of 79.6 GiB: the reason\n"
    with pytest.raises(config.ConfigError, match=r"on 8 process\(es\) of this machine the plan needs 1: run ./run.sh"):
        tg.memory_budget.with_machine_preset(tg, [], launch_of(8))


def test_a_key_and_its_value_may_be_two_arguments():
    h = tg.parse_config(["--preset", "cpu", "--matrix_lr", "0.06", "--seed", "3", "--compile=false"])
    assert (h.matrix_lr, h.seed, h.compile) == (0.06, 3, False)
