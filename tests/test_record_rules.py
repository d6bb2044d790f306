"""The rules a record is checked by (records/rules.py): records/FORMAT.md lists them one to one, a
fair series on a track ranked by train time is a record, and a series built to break each rule
(the fair one changed in that one respect) is refused with one line naming the rule, nothing
written."""
import json
import re
import shutil
from pathlib import Path

import pytest

from test_records import (NEW_SOURCES, OTHER_SOURCES, REPO, SOURCES, TRAIN_DATA, VAL_DATA, VAL_TOKENS, checkout_commit,
                          sha256, snapshot, use_test_checkout, write_log)
from records import make_record, rules  # noqa: E402
from records.logfile import parse_log  # noqa: E402

TRACK = "track_rules"
HOST = "rulehost"
SERIES_DAY = "2026-11-25"          # the fair series' runs start on this day, from 10:00
RECORD_DAY = "2026-11-26"          # the new record's --date


def started(minute, day=SERIES_DAY):
    return f"{day}T10:{minute:02d}:00+00:00"


def logs(folder, prefix, times, minutes, day=SERIES_DAY, **kwargs):
    """Seeds 1-3 in `folder` as <prefix><seed>.txt, started at those minutes of `day` on HOST."""
    folder.mkdir(parents=True, exist_ok=True)
    kwargs.setdefault("track", TRACK)
    return [write_log(folder / f"{prefix}{seed}.txt", loss, ms, seed=seed, started=started(minute, day),
                      hostname=HOST, **kwargs)
            for seed, loss, ms, minute in zip((1, 2, 3), (3.40, 3.42, 3.41), times, minutes)]


def run_tool(site, *args):
    argv = ["--track", TRACK, "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    return make_record.main(argv + [str(a) for a in args])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A site whose track (ranked by train time, with a baseline script, its data and hardware) has a
    first record over one baseline series, and a second series' baseline runs kept as a record
    folder: what the fair series is made against."""
    site = use_test_checkout(tmp_path_factory.mktemp("rules"))
    track_dir = site / "records" / TRACK
    track_dir.mkdir(parents=True)
    probe = parse_log(write_log(site / "probe.txt", 3.5, 1, sources=OTHER_SOURCES, track=TRACK))
    (site / "probe.txt").unlink()
    baseline = {"entry": "train_gpt.py", "code": [{p: sha256(c) for p, c in sorted(OTHER_SOURCES.items())}],
                "config": {k: v for k, v in probe.config.items() if k != "seed"}}
    track = {"name": TRACK, "target_val_loss": 3.5, "p_threshold": 0.01, "min_runs": 3, "hardware": "test",
             "description": "test track", "val_tokens": VAL_TOKENS, "val_data": [VAL_DATA], "train_data": [TRAIN_DATA],
             "required_environment": {"gpu": "none"}, "fixed_config": {"preset": "cpu"}, "baseline": baseline}
    (track_dir / "track.json").write_text(json.dumps(track))
    (site / "README.md").write_text(f"# T\n\n<!-- records:{TRACK}:start -->\n<!-- records:{TRACK}:end -->\n")
    base_a = logs(site / "a", "basea", [9000, 9500, 8800], [0, 2, 4], day="2026-11-20", sources=OTHER_SOURCES)
    first = logs(site / "a", "first", [5000, 5600, 5300], [1, 3, 5], day="2026-11-20")
    base_b = logs(site / "b", "baseb", [6000, 6100, 5900], [0, 3, 6], sources=OTHER_SOURCES)
    for name, date, runs, extra in (("BaseA", "2026-11-20", base_a, ["--remeasured-baseline"]),
                                    ("First", "2026-11-21", first, ["--baseline-logs", track_dir / "2026-11-20_BaseA"]),
                                    ("BaseB", SERIES_DAY, base_b, ["--remeasured-baseline"])):
        assert run_tool(site, "--name", name, "--date", date, "--logs", *runs, *extra) == 0
    return site


@pytest.fixture
def site(prepared, tmp_path):
    copy = tmp_path / "site"
    shutil.copytree(prepared, copy)
    return copy


def fair_series(site, runs=None, reruns=None):
    """The arguments of the fair series: new runs (NEW_SOURCES, about 3.0 s) interleaved with BaseB's
    runs (6.0 s) and re-runs of First (3.5 s) in the tree reproduce.py recreates, outside git; runs,
    reruns: write_log arguments changed for them."""
    new = logs(site / "new", "new", [3000, 3100, 2900], [2, 5, 8], **{"sources": NEW_SOURCES, **(runs or {})})
    again = logs(site / "again", "rerun", [3500, 3600, 3400], [1, 4, 7], **{"git_commit": "none", **(reruns or {})})
    return ["--name", "New", "--date", RECORD_DAY, "--logs", *new, "--baseline-logs",
            site / "records" / TRACK / f"{SERIES_DAY}_BaseB", "--current-record-logs", *again]


def one_changed(site, change, role="--logs"):
    """The fair series with the first log of `role` (the runs, or the re-runs) written otherwise."""
    args = fair_series(site)
    path = Path(args[args.index(role) + 1])
    run = {"--logs": {"sources": NEW_SOURCES, "train_ms": 3000, "started": started(2)},
           "--current-record-logs": {"sources": SOURCES, "train_ms": 3500, "started": started(1),
                                     "git_commit": "none"}}[role]
    kwargs = {"seed": 1, "hostname": HOST, "track": TRACK, **run, **change}
    write_log(path, 3.40, kwargs.pop("train_ms"), **kwargs)
    return args


def with_date(args, date):
    args = list(args)
    args[args.index("--date") + 1] = date
    return args


def baseline_with_another_module(site):
    """Baseline runs whose imported module forces one thread: the script is a version track.json
    lists, the program (every source) is not."""
    slow = {**OTHER_SOURCES, "cpu_runtime.py": b"torch.set_num_threads(1)\n"}
    runs = logs(site / "slow", "slow", [9000, 9100, 8900], [0, 1, 2], sources=slow)
    return ["--name", "Slow", "--date", RECORD_DAY, "--remeasured-baseline", "--logs", *runs]


BUSY = "warning: the machine was busy at the start: a 1-minute load average of 1.90 on 2 CPUs, about 1.9 of it other"
BREAKERS = {  # rule: the arguments of a series built to break that rule alone
    "sealed": lambda site: one_changed(site, {"version": 1}),
    "finished": lambda site: one_changed(site, {"ending": "interrupted"}),
    "track": lambda site: fair_series(site, runs={"track": "track_other"}),
    "hardware": lambda site: one_changed(site, {"gpu": "NVIDIA H100 80GB HBM3"}),
    "fixed-config": lambda site: fair_series(site, runs={"config_changes": {"preset": "fast"}}),
    "val-tokens": lambda site: one_changed(site, {"config_changes": {"val_tokens": VAL_TOKENS // 2}}),
    "train-val-apart": lambda site: one_changed(site, {"data": [VAL_DATA],
                                                       "config_changes": {"train_files": "data/x_val_*.bin"}}),
    "data": lambda site: one_changed(site, {"data": [VAL_DATA, TRAIN_DATA | {"tokens": 511}]}),
    "final-line": lambda site: one_changed(site, {"config_changes": {"num_iterations": 1}}),
    "started": lambda site: one_changed(site, {"started": "2999-01-01T10:02:00+00:00"}),
    "idle": lambda site: one_changed(site, {"lines": [BUSY]}, role="--current-record-logs"),
    "commit": lambda site: fair_series(site, runs={"git_commit": "none"}),
    "one-program": lambda site: fair_series(site, reruns={"sources": OTHER_SOURCES}),
    "trained": lambda site: one_changed(site, {"train_ms": 0}),
    "distinct-seeds": lambda site: one_changed(site, {"seed": 2}),
    "baseline-program": baseline_with_another_module,
    "interleaved": lambda site: fair_series(site, runs={"day": RECORD_DAY}),
    "one-machine": lambda site: one_changed(site, {"hostname": "elsewhere"}),
    "one-commit": lambda site: one_changed(site, {"git_commit": checkout_commit(NEW_SOURCES, "again")}),
    "date": lambda site: with_date(fair_series(site), "2026-11-24"),
    "new-program": lambda site: fair_series(site, runs={"sources": SOURCES}),
}


def format_rules():
    """(name, checked, refusal) of each row of records/FORMAT.md's table of rules."""
    text = (REPO / "records" / "FORMAT.md").read_text(encoding="utf-8")
    section = text.split("### The rules a record is checked by", 1)[1].split("\n### ", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return [(row[0].removeprefix("| ").strip("`"), row[2], row[3]) for row in rows]


def test_the_format_lists_the_rules_one_to_one():
    """FORMAT.md's table names the rules rules.py checks, in its order, says which only a new record
    is checked by, and shows a refusal line naming each."""
    listed = format_rules()
    assert [name for name, _, _ in listed] == [r.name for r in rules.RULES]
    for (name, checked, refusal), r in zip(listed, rules.RULES):
        assert checked.startswith("when made" if r.made_only else "always"), name
        assert f"(rule: {name})" in refusal, name


def test_every_rule_has_a_series_that_breaks_it():
    assert set(BREAKERS) == {r.name for r in rules.RULES}


def test_a_fair_series_is_a_record_that_every_later_run_accepts(site, capsys):
    """The control: the fair series is a record; --tables (every later run's check) accepts it."""
    assert run_tool(site, *fair_series(site)) == 0, capsys.readouterr().err
    assert json.loads((site / "records" / TRACK / f"{RECORD_DAY}_New" / "statistics.json").read_text())[
        "status"] == "record"
    assert run_tool(site, "--tables") == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", list(BREAKERS))
def test_a_series_that_breaks_a_rule_is_refused_naming_it(site, capsys, name):
    args = BREAKERS[name](site)
    before = snapshot(site)
    assert run_tool(site, *args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and err.endswith(f"(rule: {name})\n"), err
    assert snapshot(site) == before


@pytest.mark.parametrize("sources, commit, message", [
    (NEW_SOURCES, "0" * 40, f"names git_commit {'0' * 40}, which this checkout"),
    (NEW_SOURCES, checkout_commit(SOURCES), "its embedded data/shards.py is not that file of git_commit"),
    (NEW_SOURCES, checkout_commit(NEW_SOURCES) + "-dirty", "ran from a tree with uncommitted changes"),
], ids=["a commit the checkout lacks", "sources not the commit's", "a dirty tree"])
def test_a_log_names_a_commit_of_this_checkout_whose_files_it_embeds(site, capsys, sources, commit, message):
    args = one_changed(site, {"sources": sources, "git_commit": commit})
    assert run_tool(site, *args) == 2
    err = capsys.readouterr().err
    assert message in err and err.endswith("(rule: commit)\n"), err


@pytest.mark.parametrize("edit, message", [
    (dict(total_steps=2, config_changes={"num_iterations": 1}), "its final line says 2 steps, its config's "
                                                                "num_iterations is 1"),
    (dict(total_steps=1, lines=["step:2/2 val_loss:3.4000 train_time:20100ms step_avg:10050.00ms"]),
     "its final line says 1 steps in 5000 ms, a step line says step 2 at 20100 ms"),
    (dict(lines=["step:3/4 val_loss:3.4000 train_time:20100ms step_avg:6700.00ms"]),
     "its final line says 4 steps in 5000 ms, a step line says step 3 at 20100 ms"),
    (dict(), "its final val_loss is nan, which no finished run logs"),
], ids=["num_iterations", "steps beyond the final", "time beyond the final", "a NaN result"])
def test_the_final_line_agrees_with_the_step_lines(tmp_path, edit, message):
    """A "1 steps" run whose steps reach 2/2, a 5.0 s run whose step lines say 20.1 s."""
    log = parse_log(write_log(tmp_path / "r.txt", 3.40 if edit else float("nan"), 5000, **edit))
    assert message in rules.final_disagreement(log)
    assert rules.final_disagreement(parse_log(write_log(tmp_path / "fair.txt", 3.40, 5000))) is None


def names_site(tmp_path):
    """A track like the 8xH100 ones: data by file name (data_names), no fingerprints, no baseline."""
    site = use_test_checkout(tmp_path)
    track_dir = site / "records" / TRACK
    track_dir.mkdir(parents=True)
    names = {"val": "x_val_000000.bin", "train": "x_train_[0-9][0-9][0-9][0-9][0-9][0-9].bin"}
    (track_dir / "track.json").write_text(json.dumps({
        "name": TRACK, "target_val_loss": 3.5, "p_threshold": 0.01, "min_runs": 3, "hardware": "test",
        "description": "test", "val_tokens": VAL_TOKENS, "data_names": names}))
    (site / "README.md").write_text(f"# T\n\n<!-- records:{TRACK}:start -->\n<!-- records:{TRACK}:end -->\n")
    return site


@pytest.mark.parametrize("change, rule", [
    ({}, None),
    ({"data": [TRAIN_DATA, TRAIN_DATA], "config_changes": {"val_files": "data/x_train_*.bin"}}, "train-val-apart"),
    ({"data": [VAL_DATA, VAL_DATA | {"path": "data/x_val_000001.bin", "head_sha256": "e" * 64}],
      "config_changes": {"train_files": "data/x_val_000001.bin", "val_files": "data/x_val_000000.bin"}}, "data"),
    ({"data": [VAL_DATA]}, "train-val-apart"),
    ({"data": [VAL_DATA, VAL_DATA | {"path": "data/x_train_000001.bin"}]}, "train-val-apart"),
], ids=["fair", "validated on a train shard", "trained on another val shard", "no train data",
        "the val shard copied under a train name"])
def test_a_track_without_fingerprints_keeps_train_and_val_apart_by_name(tmp_path, capsys, change, rule):
    site = names_site(tmp_path)
    runs = logs(site / "logs", "run", [5000, 5600, 5300], [0, 1, 2], **change)
    code = run_tool(site, "--name", "R", "--date", RECORD_DAY, "--logs", *runs)
    err = capsys.readouterr().err
    assert (code, err) == (0, "") if rule is None else code == 2 and err.endswith(f"(rule: {rule})\n"), err


def test_the_repositorys_tracks_that_name_no_fingerprints_name_their_files():
    for track in ("track_1_short", "track_2_medium", "track_3_optimization"):
        definition = json.loads((REPO / "records" / track / "track.json").read_text())
        assert "val_data" in definition or re.fullmatch(r"fineweb_val_\d+\.bin", definition["data_names"]["val"])
        assert definition["data_names"]["train"].startswith("fineweb_train_")


@pytest.mark.parametrize("gpu, world_size, made", [
    ("NVIDIA H100 80GB HBM3", 1, True),
    ("NVIDIA H200", 1, True),
    ("NVIDIA H100 80GB HBM3, NVIDIA H100 80GB HBM3", 1, False),    # a second GPU visible to the run
    ("NVIDIA H100 80GB HBM3", 2, False),
    ("NVIDIA GeForce RTX 4090", 1, False),
    ("none", 1, False),
], ids=["H100", "H200", "two GPUs seen", "two processes", "RTX 4090", "no GPU"])
def test_the_single_gpu_track_takes_runs_of_one_h100_or_h200(tmp_path, capsys, gpu, world_size, made):
    """The repository's track_1gpu definition (its data named as a test site's files, its target
    above the fake runs' losses): a series on one H100 or H200 in one process is a record; any other
    hardware is refused by the hardware rule."""
    site = use_test_checkout(tmp_path)
    track = json.loads((REPO / "records" / "track_1gpu" / "track.json").read_text())
    track |= {"target_val_loss": 3.5, "val_tokens": VAL_TOKENS, "data_names": {"val": "x_val_000000.bin",
                                                       "train": "x_train_[0-9][0-9][0-9][0-9][0-9][0-9].bin"}}
    (site / "records" / "track_1gpu").mkdir(parents=True)
    (site / "records" / "track_1gpu" / "track.json").write_text(json.dumps(track))
    (site / "README.md").write_text("# T\n\n<!-- records:track_1gpu:start -->\n<!-- records:track_1gpu:end -->\n")
    runs = logs(site / "logs", "run", [5000, 5600, 5300], [0, 1, 2], track="track_1gpu", gpu=gpu,
                world_size=world_size)
    argv = ["--track", "track_1gpu", "--records-dir", str(site / "records"), "--readme", str(site / "README.md")]
    code = make_record.main(argv + ["--name", "One", "--date", RECORD_DAY, "--logs", *runs])
    err = capsys.readouterr().err
    assert (code == 0) == made, err
    assert made or err.endswith("(rule: hardware)\n")


def test_the_single_gpu_preset_is_the_single_gpu_tracks_recipe():
    import train_gpt as tg
    track = json.loads((REPO / "records" / "track_1gpu" / "track.json").read_text())
    one, speedrun = tg.parse_config(["--preset", "1gpu"]), tg.parse_config(["--preset", "speedrun"])
    assert one.track == "track_1gpu" and tg.parse_config(["--preset", "1gpu_24gb"]).track == "none"
    assert (one.val_tokens, one.val_files, one.train_files) == (track["val_tokens"], speedrun.val_files,
                                                                speedrun.train_files)
    assert track["target_val_loss"] == json.loads((REPO / "records" / "track_1_short" / "track.json").read_text())[
        "target_val_loss"]
    readme = (REPO / "README.md").read_text()
    assert "<!-- records:track_1gpu:start -->\n_No records yet._\n<!-- records:track_1gpu:end -->" in readme
