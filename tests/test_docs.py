"""The documentation a reader follows: the README stays a front door (at most 10 KiB) that links
the docs' index, which links every document of docs/; what a contributor must read (the README,
the documents it links and records/FORMAT.md) fits in one sitting; and every relative link in
the README, docs/, bench/, data/ and the records' READMEs (the record folders' own READMEs
excepted: the tool writes them) points at a file or folder of the repository."""
import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parent.parent
README_MAX_BYTES = 10 * 1024
ONE_SITTING_BYTES = 60 * 1024      # the README, the documents it links and records/FORMAT.md
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")   # [text](target)


def documents():
    yield REPO / "README.md"
    for folder in ("docs", "bench", "data"):
        yield from sorted((REPO / folder).glob("*.md"))
    yield REPO / "records" / "README.md"
    yield from sorted((REPO / "records").glob("track_*/README.md"))


def relative_links(path):
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            yield target.split("#")[0]


def test_the_readme_is_a_front_door():
    readme = REPO / "README.md"
    assert readme.stat().st_size <= README_MAX_BYTES
    assert "docs/README.md" in set(relative_links(readme))
    index = set(relative_links(REPO / "docs" / "README.md"))
    for document in sorted((REPO / "docs").glob("*.md")):
        assert document.name == "README.md" or document.name in index, f"docs/README.md does not link {document.name}"


def test_what_a_contributor_must_read_fits_in_one_sitting():
    """The README, the Markdown documents it links directly and records/FORMAT.md."""
    readme = REPO / "README.md"
    linked = {(REPO / target).resolve() for target in relative_links(readme) if target.endswith(".md")}
    must_read = linked | {readme, REPO / "records" / "FORMAT.md"}
    assert sum(path.stat().st_size for path in must_read) <= ONE_SITTING_BYTES, sorted(
        (path.stat().st_size, str(path.relative_to(REPO))) for path in must_read)


def test_every_relative_link_resolves():
    broken = [f"{path.relative_to(REPO)}: {target}" for path in documents() for target in relative_links(path)
              if not (path.parent / target).exists()]
    assert not broken, "\n".join(broken)


# ----------------------------------------------------------------------------- numbers the docs state

def recipe():
    import sys
    sys.path.insert(0, str(REPO))
    import train_gpt
    return train_gpt


def track(name):
    import json
    return json.loads((REPO / "records" / name / "track.json").read_text())


# The keys whose record value the record presets set in place of this repository's own variant.
RECORD_RULE_KEYS = ("target_rule", "cross_documents", "table_hashes", "paired_head_layout", "window_edge_key",
                    "attn_out_init", "narrow_yarn_window", "attention_segment_tokens", "final_mix",
                    "value_embed_full_width", "matrix_shapes", "adam_eps_unit", "candidate_walk", "value_embed_sparse",
                    "average_norms", "anvil_fast_beta_follows_mu", "value_embed_table_cadence", "fp8_qkv_scales",
                    "fp8_head_scales", "mlp_free_layers", "x0_layers", "hashed_layers", "prefix_weight_levels",
                    "gate_wd", "gate_mlp_wd", "resid_scale_lr", "post_scale_lr")


def test_the_fidelity_notes_name_every_record_rule_and_only_keys_that_exist():
    """docs/recipe.md names each key that switches between a record's behaviour and this
    repository's, and every --key=value it gives is one the config accepts."""
    text = (REPO / "docs" / "recipe.md").read_text()
    tg = recipe()
    missing = [key for key in RECORD_RULE_KEYS if f"`{key}" not in text and f"--{key}=" not in text]
    assert missing == []
    for span in re.findall(r"`(--\w+=[^`]+)`", text):      # a span's flags together
        tg.parse_config(["--preset", "speedrun", *span.split()])


def test_the_cpu_presets_step_count_in_the_recipe():
    steps = recipe().parse_config(["--preset", "cpu"]).num_iterations
    assert f"the `cpu` preset's {steps} steps" in (REPO / "docs" / "recipe.md").read_text()


def test_the_baselines_loss_in_the_optimizer_notes_is_the_cpu_tracks_target():
    cpu = track("track_cpu")
    said = f"reaches {cpu['target_val_loss']:.4f} in {cpu['baseline']['config']['num_iterations']} steps"
    assert said in (REPO / "docs" / "optimizers.md").read_text()


def test_the_cpu_tracks_baseline_times_are_its_records():
    """The track README's sentence on a baseline run's length names each baseline record's mean
    train time (statistics.json), the target's first."""
    import json
    text = (REPO / "records" / "track_cpu" / "README.md").read_text()
    sentence = next(line for line in text.splitlines() if "A full run trains for" in line).split("A full run")[1]
    stats = [json.loads((folder / "statistics.json").read_text())
             for folder in sorted((REPO / "records" / "track_cpu").glob("*_AdamWBaseline*"))]
    assert stats[0]["status"] == "target"
    assert [f"{s['train_time_s']['mean']:,.1f} s" for s in stats] == re.findall(r"[\d,]+\.\d s", sentence)


def test_the_model_sizes_in_the_usage_notes():
    """usage.md's sizes of a cpu and a speedrun model: their parameters and persistent buffers but
    the gradient sinks, and the n-gram table among them, counted on fake tensors."""
    import torch

    from machinery.memory_budget import fake_model
    tg = recipe()
    text = " ".join((REPO / "docs" / "usage.md").read_text().split())
    sizes = {}
    for preset in ("cpu", "speedrun"):
        with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
            model = fake_model(tg, tg.parse_config(["--preset", preset]))
            sinks = {name for name, p in model.named_parameters() if any(p is s for s in model.gradient_sinks())}
            values = sum(t.nbytes for name, t in model.state_dict().items() if name not in sinks)
            sizes[preset] = values, model.ngram.table.nbytes, model.ngram.table.shape
    (cpu, cpu_table, (cpu_rows, cpu_dim)), (speedrun, table, (rows, dim)) = sizes["cpu"], sizes["speedrun"]
    assert (f"A `cpu` model holds {cpu / 1e9:.2f} GB of values (its parameters and persistent buffers, the gradient "
            f"sinks aside), {cpu_table / 1e9:.2f} GB of them the n-gram table's {cpu_rows:,} rows of {cpu_dim} fp32 "
            f"values; a `speedrun` model about {round(speedrun / 1e9)} GB, almost all of it the table's {rows:,} rows "
            f"of {dim} bf16 values ({table / 1e9:.2f} GB)") in text


def test_the_usage_notes_name_every_preset():
    text = (REPO / "docs" / "usage.md").read_text()
    assert all(f"`{name}`" in text for name in recipe().PRESETS)


def test_the_cpu_tracks_readme_lists_every_record_folder_of_the_track():
    """The CPU track's own table has a row for each folder of the track holding a statistics.json,
    with its mean val loss and mean train time as the statistics give them."""
    import json
    text = (REPO / "records" / "track_cpu" / "README.md").read_text()
    rows = {line.split("](")[0].removeprefix("| ["): line for line in text.splitlines() if line.startswith("| [20")}
    folders = sorted(p.parent for p in (REPO / "records" / "track_cpu").glob("*/statistics.json"))
    assert sorted(rows) == [folder.name for folder in folders]
    for folder in folders:
        stats = json.loads((folder / "statistics.json").read_text())
        row = rows[folder.name]
        assert f"| {stats['val_loss']['mean']:.4f}" in row and f"| {stats['train_time_s']['mean']:.1f} s |" in row, row
