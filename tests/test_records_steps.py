"""make_record.py on tracks ranked by steps (track.json "metric": "steps"): the margin rule and the
t-test, the fixed config, the steps table with its pairwise statistic, and the repository's two
steps tracks (their fixed configs against the presets, the CPU twin's records against their logs)."""
import datetime
import json
import math
import sys

import pytest

from test_records import REPO, VAL_DATA, VAL_TOKENS, use_test_checkout, write_log

sys.path.insert(0, str(REPO))
import train_gpt as tg  # noqa: E402
from records import checked_records, make_record, readme_tables, record_files, series_stats, significance  # noqa: E402
from records.logfile import parse_log  # noqa: E402

TRACK = "track_steps"
TARGET = 3.28
MARGIN = 0.004                     # the public optimization track's margin: 3.09 sigma of 0.0013
LOSS_PER_STEP = 0.0045 / 100       # the public optimization track's loss per step
MAKE_LOG_CHANGES = {"matrix_lr": 0.05}  # a config value that steps tracks leave free


def steps_site(tmp_path, **track_changes):
    """A records root with one steps track (target 3.28, the margin rule, one run enough, a fixed
    config) and a README with its table markers."""
    track_dir = tmp_path / "records" / TRACK
    track_dir.mkdir(parents=True)
    track = {"name": TRACK, "target_val_loss": TARGET, "metric": "steps", "z_margin": MARGIN,
             "loss_per_step": LOSS_PER_STEP, "pairwise_margin": MARGIN, "p_threshold": 0.01, "min_runs": 1,
             "hardware": "test", "description": "test steps track", "val_tokens": VAL_TOKENS, "val_data": [VAL_DATA],
             "fixed_config": {"preset": "cpu", "val_files": "data/x_val_*.bin"}}
    track = {k: v for k, v in (track | track_changes).items() if v is not None}
    (track_dir / "track.json").write_text(json.dumps(track))
    (tmp_path / "README.md").write_text(f"# T\n\n<!-- records:{TRACK}:start -->\n<!-- records:{TRACK}:end -->\n")
    return use_test_checkout(tmp_path)


def logs_at(site, prefix, losses, steps, **kwargs):
    folder = site / "logs"
    folder.mkdir(exist_ok=True)
    return [write_log(folder / f"{prefix}{i}.txt", loss, 1000, seed=i, total_steps=steps, track=TRACK, **kwargs)
            for i, loss in enumerate(losses)]


def run_tool(site, name, date, logs, *extra):
    argv = ["--track", TRACK, "--records-dir", str(site / "records"), "--readme", str(site / "README.md"),
            "--name", name, "--date", date, "--logs", *logs, *extra]
    return make_record.main([str(a) for a in argv])


def statistics(site, folder):
    return json.loads((site / "records" / TRACK / folder / "statistics.json").read_text())


def table_rows(site):
    text = (site / "README.md").read_text()
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| #")]


def test_pairwise_statistic_gives_the_public_tracks_worked_examples():
    """The public optimization track's README: result #12 (3.2790, n = 20, 3325 steps) over #6
    (3.2788, n = 20, 3375 steps) gives 0.00648; #13 (3.2785, n = 10, 3210 steps) over #8 (3.2778,
    n = 16, 3250 steps), about 0.0027 (the README's n1 and n2 the other way round; the sum is
    symmetric)."""
    def record(mean, n, steps):
        return {"val_loss": {"mean": mean}, "n": n, "steps": steps}
    assert significance.pairwise_statistic(record(3.2790, 20, 3325), record(3.2788, 20, 3375),
                                          LOSS_PER_STEP) == pytest.approx(0.00648, abs=5e-6)
    assert significance.pairwise_statistic(record(3.2785, 10, 3210), record(3.2778, 16, 3250),
                                          LOSS_PER_STEP) == pytest.approx(0.0027, abs=5e-5)


def test_the_margin_rule_decides_and_the_statistics_carry_the_steps(tmp_path, capsys):
    """One run at 3.2755: (3.28 - 3.2755) x 1 = 0.0045 >= 0.004, a record; four runs averaging
    3.2785: 0.0015 x 2 = 0.003 < 0.004, refused without --allow-non-record."""
    site = steps_site(tmp_path)
    assert run_tool(site, "One", "2026-12-02", logs_at(site, "a", [3.2755], 100)) == 0
    s = statistics(site, "2026-12-02_One")
    assert (s["status"], s["metric"], s["steps"], s["n"]) == ("record", "steps", 100, 1)
    assert s["margin_statistic"] == pytest.approx(0.0045, abs=1e-12) and s["z_margin"] == MARGIN
    assert "steps            100 (the track ranks records by steps" in capsys.readouterr().out
    four = logs_at(site, "b", [3.2775, 3.2795, 3.2780, 3.2790], 90)
    assert run_tool(site, "Four", "2026-12-02", four) == 2
    assert "(target - mean) x sqrt(n) = 0.003 is not at least 0.004" in capsys.readouterr().err
    assert run_tool(site, "Four", "2026-12-02", four, "--allow-non-record") == 0
    assert statistics(site, "2026-12-02_Four")["status"] == "not a record"
    assert len(table_rows(site)) == 1, "a non-record stays out of the table"


def test_the_table_ranks_by_steps_with_the_pairwise_statistic_against_the_previous_record(tmp_path):
    """Made in this order: A (100 steps, 3.270), B (90 steps, 3.272), C (95 steps, 3.260). The
    table: B, C, A. B is compared with A (the record before it), C with B (the best record when C
    was made), A is the first."""
    site = steps_site(tmp_path)
    made = [("A", "2026-12-01", [3.270], 100), ("B", "2026-12-02", [3.271, 3.273], 90),
            ("C", "2026-12-03", [3.260], 95)]
    for name, date, losses, steps in made:
        assert run_tool(site, name, date, logs_at(site, name, losses, steps)) == 0
    b_over_a = ((3.270 - 3.272) + 10 * LOSS_PER_STEP) / math.sqrt(1 / 1 + 1 / 2)
    c_over_b = ((3.272 - 3.260) - 5 * LOSS_PER_STEP) / math.sqrt(1 / 2 + 1 / 1)
    assert table_rows(site) == [
        f"| 1 | [B](records/{TRACK}/2026-12-02_B) | - | Test 9000 | 90 | 3.2720 | 0.0113 | 2 "
        f"| {b_over_a:.4f} vs A (not significant at 0.004) |",
        f"| 2 | [C](records/{TRACK}/2026-12-03_C) | - | Test 9000 | 95 | 3.2600 | 0.0200 | 1 "
        f"| {c_over_b:.4f} vs B (significant at 0.004) |",
        f"| 3 | [A](records/{TRACK}/2026-12-01_A) | - | Test 9000 | 100 | 3.2700 | 0.0100 | 1 | first record |",
    ]


def test_records_of_one_day_are_ordered_by_when_their_runs_started_not_by_made(tmp_path):
    """A and B made on one day, B's runs after A's: B is compared with A. Another record's `made`
    edited (to a time after B's) changes nothing in the table: the order comes from the sealed logs."""
    site = steps_site(tmp_path)
    a = logs_at(site, "a", [3.270], 100, started="2026-12-02T08:00:00+00:00")
    b = logs_at(site, "b", [3.272], 90, started="2026-12-02T09:00:00+00:00")
    assert run_tool(site, "A", "2026-12-02", a, "--changed", "plain") == 0
    assert run_tool(site, "B", "2026-12-02", b, "--changed", "fewer steps") == 0
    rows = table_rows(site)
    assert rows[0].startswith(f"| 1 | [B](records/{TRACK}/2026-12-02_B) | fewer steps |") and "vs A" in rows[0]
    b_made = datetime.datetime.fromisoformat(statistics(site, "2026-12-02_B")["made"])
    path = site / "records" / TRACK / "2026-12-02_A" / "statistics.json"
    s = json.loads(path.read_text())
    later = (b_made + datetime.timedelta(minutes=1)).isoformat()
    path.write_text(json.dumps(s | {"made": later}, indent=2) + "\n")
    argv = ["--track", TRACK, "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    assert make_record.main(argv + ["--tables"]) == 0
    assert table_rows(site) == rows, "B is still compared with A"


def test_a_steps_track_with_the_t_test_shows_p(tmp_path):
    """Without z_margin the t-test decides (p < 0.01 over at least 3 runs), and the table shows p."""
    site = steps_site(tmp_path, z_margin=None, min_runs=3)
    assert run_tool(site, "T", "2026-12-02", logs_at(site, "t", [3.20, 3.21, 3.22], 50)) == 0
    s = statistics(site, "2026-12-02_T")
    assert s["status"] == "record" and s["p_value"] < 0.01 and s["margin_statistic"] is None
    assert table_rows(site) == [f"| 1 | [T](records/{TRACK}/2026-12-02_T) | - | Test 9000 | 50 | 3.2100 "
                                f"| {s['p_value']:.2g} | 3 | first record |"]
    assert "| p | runs |" in (site / "README.md").read_text()


def test_a_run_that_changes_the_fixed_config_is_refused(tmp_path, capsys):
    site = steps_site(tmp_path)
    logs = logs_at(site, "f", [3.27], 100, config_changes={"preset": "speedrun"})
    assert run_tool(site, "F", "2026-12-02", logs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the run's config changes preset, which the track fixes" in err
    free = logs_at(site, "g", [3.27], 100, config_changes=MAKE_LOG_CHANGES)
    assert run_tool(site, "G", "2026-12-02", free) == 0, "keys outside fixed_config are free"


def test_a_fixed_key_the_runs_code_did_not_have_yet_is_no_change(tmp_path):
    """A key added to fixed_config after a run: its log lacks it, its code ran the key's default."""
    site = steps_site(tmp_path, fixed_config={"preset": "cpu", "val_files": "data/x_val_*.bin", "a_later_key": 1})
    assert run_tool(site, "L", "2026-12-02", logs_at(site, "l", [3.27], 100)) == 0


def test_runs_of_one_record_train_the_same_steps(tmp_path, capsys):
    """One config, so one num_iterations; a run whose final line says other steps than its config is refused."""
    site = steps_site(tmp_path)
    logs = [*logs_at(site, "s", [3.27], 100), *logs_at(site, "u", [3.27], 99, config_changes={"num_iterations": 100})]
    assert run_tool(site, "S", "2026-12-02", logs) == 2
    assert "u0.txt: its final line says 99 steps, its config's num_iterations is 100" in capsys.readouterr().err
    with pytest.raises(record_files.RecordError, match="the runs trained 99, 100 steps"):
        series_stats.common_steps([parse_log(path) for path in logs])


# ----------------------------------------------------------------------------- the repository's tracks

FIXED_KEYS = [k for k in tg.MODEL_FIELDS if k != "embed_init_std"] + [
    "train_files", "val_files", "val_tokens", "batch_ranks", "stages", "val_long_window", "yarn_at_final_window",
    "untie_frac", "fp8_mlp", "fp8_qkv", "fp8_head", "fp8_on_cpu", "target_rule",
    "attention_segment_tokens"]  # the model, the data, the batch, the objective


@pytest.mark.parametrize("track, argv, extra", [
    ("track_3_optimization", ["--preset", "optimization"], ["value_embed_lr"]),
    ("track_3_cpu_optimization", ["--preset", "cpu_optimization"], []),
])
def test_a_steps_tracks_fixed_config_is_its_presets(track, argv, extra):
    """Each fixed key of the track holds the preset's logged value; the optimizer keys stay free."""
    definition = json.loads((REPO / "records" / track / "track.json").read_text())
    logged = json.loads(json.dumps(tg.logged_config(tg.parse_config(argv))))
    assert sorted(definition["fixed_config"]) == sorted(FIXED_KEYS + extra)
    assert definition["fixed_config"] == {k: logged[k] for k in definition["fixed_config"]}
    assert logged["track"] == track and definition["metric"] == "steps"
    assert not {"optimizer", "matrix_lr", "num_iterations", "seed"} & set(definition["fixed_config"])


def test_the_cpu_twins_records_are_what_their_logs_give():
    """Every record of records/track_3_cpu_optimization recomputes from its logs, and its README's
    table is the one they give."""
    track_dir = REPO / "records" / "track_3_cpu_optimization"
    track = json.loads((track_dir / "track.json").read_text())
    records = checked_records.checked_track_records(track_dir, track, REPO)
    assert len(records) >= 4
    readme = track_dir / "README.md"
    assert readme_tables.with_table(readme, records, track["name"], track) == readme.read_text()
