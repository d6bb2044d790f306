"""evaluation/downstream.py: a checkpoint served to lm-evaluation-harness. The scores lm-eval logs for a local
multiple-choice task equal our own forward pass of one document at a time, rolling
log-likelihoods equal a direct sum over lm-eval's windows, generation stops at its stop strings,
and a task whose dataset cannot be fetched ends with one line. Everything runs offline."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from launch import cpu_env
from tiny_runs import FEATURES, REPO, TINY, data_args, run_trainer, synthetic_documents

pytest.importorskip("lm_eval", reason="lm-eval is not installed: pip install -r requirements.txt")
sys.path.insert(0, REPO)
import datasets  # noqa: E402
import huggingface_hub.constants  # noqa: E402
import lm_eval.api.registry  # noqa: E402
import lm_eval.evaluator  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

import kernels  # noqa: E402
import train_gpt as tg  # noqa: E402
from data.shards import write_shard  # noqa: E402
from data.tokenizer import BOS_ID, gpt2_encoding  # noqa: E402
from evaluation import downstream as ds  # noqa: E402

TASKS = os.path.join("tests", "lm_eval_tasks")     # relative to REPO, as the YAMLs' data_files are
TOLERANCE = 1e-4   # nats per summed score: fp32, a packed pass against one document alone (summation order)
ROLLING_TOLERANCE = 1e-3   # nats for a text of ~1,300 tokens, scored in three windows
KJV = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
       "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. ")


def offline(mp, cache):
    """No download from the Hub: the variables, and the values datasets and huggingface_hub read
    from them at import; the datasets cache in `cache`."""
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        mp.setenv(name, "1")
    mp.setenv("HF_HOME", str(cache))
    mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache / "datasets")
    mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    mp.chdir(REPO)


def without_environment_report(mp):
    """simple_evaluate without its report of the environment (torch's collect_env: seconds of
    subprocesses here), which the tests do not read."""
    mp.setattr(lm_eval.evaluator, "add_env_info", lambda results: results.update(pretty_env_info="not collected"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 3-step fp32 run of the tiny model with the model features on, and its checkpoint
    (max_length 512 tokens: the longest slice)."""
    d = tmp_path_factory.mktemp("downstream_run")
    rng = np.random.default_rng(0)
    write_shard(d / "t_train_000001.bin", synthetic_documents(rng, 20_000))
    write_shard(d / "t_val_000000.bin", synthetic_documents(rng, 4_000))
    res = run_trainer(["--preset", "cpu", *TINY, *FEATURES, *data_args(d), "--num_iterations=3", "--val_tokens=1024",
                       "--val_tokens_per_rank=512", "--compute_dtype=float32", f"--log_dir={d}/logs",
                       "--save_checkpoint=true"])
    assert res.returncode == 0, res.stderr
    (name,) = [p for p in os.listdir(d / "logs") if p.endswith(".safetensors")]
    return d / "logs" / name


@pytest.fixture(scope="module")
def lm(checkpoint):
    return ds.SpeedrunLM(checkpoint)


@pytest.fixture(scope="module")
def tiny_choice(lm, tmp_path_factory):
    """simple_evaluate of the local task tiny_choice, with its logged samples."""
    with pytest.MonkeyPatch.context() as mp:
        offline(mp, tmp_path_factory.mktemp("hf"))
        without_environment_report(mp)
        return ds.evaluate(lm, ["tiny_choice"], include_path=TASKS, log_samples=True)


def direct_logprobs(lm, tokens):
    """(T, VOCAB_SIZE) log_softmax over the GPT-2 vocabulary of the softcapped logits after each
    of `tokens`, one document alone in its forward pass."""
    t = torch.tensor(tokens, dtype=torch.int32)
    short, long = tg.attention_windows(lm.h, lm.h.num_iterations, final_validation=True)
    args = tg.AttentionArgs(torch.tensor([0, len(tokens)], dtype=torch.int32), short * tg.WINDOW_BLOCK,
                            long * tg.WINDOW_BLOCK)
    with torch.no_grad():
        x = lm.model.hidden_states(t, args)
        logits = kernels.softcap(F.linear(x, lm.model.head_weight()))[:, :tg.VOCAB_SIZE]
    return torch.log_softmax(logits.float(), dim=-1)


def direct_score(lm, tokens, scored):
    """(sum of the log-probabilities of the last `scored` tokens given those before them, whether
    each is its position's argmax): a plain loop over one document."""
    logprobs = direct_logprobs(lm, tokens[:-1])
    total, greedy = 0.0, True
    for position in range(len(tokens) - 1 - scored, len(tokens) - 1):
        target = tokens[position + 1]
        total += float(logprobs[position, target])
        greedy &= int(logprobs[position].argmax()) == target
    return total, greedy


def pair_tokens(context, continuation):
    """BOS, then context + continuation encoded together; how many tokens the continuation has
    (the tokens after those of the context alone). As lm-eval splits a pair, the context's
    trailing whitespace belongs to the continuation."""
    enc = gpt2_encoding()
    stripped = context.rstrip()
    context, continuation = stripped, context[len(stripped):] + continuation
    whole = enc.encode_ordinary(context + continuation)
    return [BOS_ID] + whole, len(whole) - len(enc.encode_ordinary(context))


def requests(kind, *arguments):
    return [Instance(kind, {}, args, i) for i, args in enumerate(arguments)]


# ---------------------------------------------------------------------------------------------
# loglikelihood through lm-eval


def test_lm_eval_scores_each_choice_as_our_forward_does(lm, tiny_choice):
    samples = tiny_choice["samples"]["tiny_choice"]
    assert len(samples) == 8
    worst, correct = 0.0, []
    for sample in samples:
        doc = sample["doc"]
        assert [tuple(a) for a in sample["arguments"]] == [(doc["question"], " " + c) for c in doc["choices"]]
        direct = [direct_score(lm, *pair_tokens(doc["question"], " " + c)) for c in doc["choices"]]
        for (ll, greedy), (want_ll, want_greedy) in zip(sample["filtered_resps"], direct):
            worst = max(worst, abs(ll - want_ll))
            assert greedy == want_greedy
        correct.append(int(np.argmax([ll for ll, _ in direct])) == doc["answer"])
        assert sample["acc"] == float(correct[-1])
    assert worst <= TOLERANCE, f"packed against alone: {worst:.2e} nats"
    assert tiny_choice["results"]["tiny_choice"]["acc,none"] == pytest.approx(np.mean(correct), abs=1e-12)


def test_requests_pack_into_one_pass_and_any_batch_size_gives_the_same_scores(lm, monkeypatch):
    pairs = [("And God said,", " Let there be light"), ("The LORD", " is my shepherd"), ("", "In the beginning"),
             ("Thou shalt", " not"), ("Amen", "")]     # an empty continuation: (0.0, True), no forward pass
    passes = []
    score_pack = lm.score_pack
    monkeypatch.setattr(lm, "score_pack", lambda docs: passes.append(len(docs)) or score_pack(docs))
    packed = lm.loglikelihood(requests("loglikelihood", *pairs), disable_tqdm=True)
    monkeypatch.setattr(lm, "max_documents", 1)
    alone = lm.loglikelihood(requests("loglikelihood", *pairs), disable_tqdm=True)
    assert passes == [4, 1, 1, 1, 1]
    for (ll, greedy), (ll1, greedy1), (context, continuation) in zip(packed, alone, pairs):
        want = direct_score(lm, *pair_tokens(context, continuation))
        assert abs(ll - want[0]) <= TOLERANCE and abs(ll1 - want[0]) <= TOLERANCE and greedy == greedy1 == want[1]


def test_a_context_ending_in_spaces_is_split_where_lm_eval_splits_it(lm):
    spaced, plain = lm.loglikelihood(requests("loglikelihood", ("Give us this day our daily  ", "bread"),
                                              ("Give us this day our daily", "  bread")), disable_tqdm=True)
    assert abs(spaced[0] - plain[0]) <= TOLERANCE and spaced[1] == plain[1]
    assert abs(spaced[0] - direct_score(lm, *pair_tokens("Give us this day our daily", "  bread"))[0]) <= TOLERANCE


def test_a_long_context_loses_its_first_tokens_after_bos(lm):
    enc = gpt2_encoding()
    context, continuation = (KJV * 20).rstrip(), " And God saw the light"     # ~850 tokens of context
    tokens, scored = pair_tokens(context, continuation)
    assert len(tokens) > lm.max_length + 1
    (ll, greedy), = lm.loglikelihood(requests("loglikelihood", (context, continuation)), disable_tqdm=True)
    kept = [BOS_ID] + tokens[1:][-lm.max_length:]
    assert len(kept) - 1 == lm.max_length and scored == len(enc.encode_ordinary(continuation))
    want = direct_score(lm, kept, scored)
    assert abs(ll - want[0]) <= TOLERANCE and greedy == want[1]


def test_a_continuation_longer_than_the_model_is_refused(lm):
    with pytest.raises(ds.DownstreamError, match="longer than the 512 positions this model has$"):
        lm.loglikelihood(requests("loglikelihood", ("A", " b" * 600)), disable_tqdm=True)


def test_packs_respect_the_token_budget_the_count_and_documents_inside_a_text():
    docs = [([BOS_ID] + [1] * 5, 1), ([BOS_ID] + [1] * 3, 1), ([2] * 4, 1), ([BOS_ID] + [1] * 6, 1),
            ([BOS_ID] * 2, 1)]
    assert list(ds.packs(docs, max_tokens=8, max_documents=10)) == [[0, 1], [2], [3, 4]]
    assert list(ds.packs(docs, max_tokens=100, max_documents=10)) == [[0, 1], [2, 3, 4]]
    assert list(ds.packs(docs, max_tokens=100, max_documents=2)) == [[0, 1], [2, 3], [4]]


# ---------------------------------------------------------------------------------------------
# rolling log-likelihood


def test_rolling_loglikelihood_is_the_direct_sum_over_lm_eval_windows(lm):
    text = KJV * 30                # ~1,300 tokens: two full windows and a last one that scores fewer
    tokens = gpt2_encoding().encode_ordinary(text)
    L = lm.max_length
    assert 2 * L < len(tokens) < 3 * L
    want = direct_score(lm, [BOS_ID] + tokens[:L], L)[0]     # the first L tokens after BOS
    want += direct_score(lm, tokens[L - 1:2 * L], L)[0]      # the next L, after one token of the text
    want += direct_score(lm, tokens[-L - 1:], len(tokens) - 2 * L)[0]  # the rest, after a full window
    short = "And God called the light Day."
    got, got_short = lm.loglikelihood_rolling(requests("loglikelihood_rolling", (text,), (short,)), disable_tqdm=True)
    assert abs(got - want) <= ROLLING_TOLERANCE, (got, want)
    (as_continuation, _), = lm.loglikelihood(requests("loglikelihood", ("", short)), disable_tqdm=True)
    assert abs(got_short - as_continuation) <= TOLERANCE


# ---------------------------------------------------------------------------------------------
# generation


def greedy_by_full_forward(lm, prompt, steps):
    """Greedy continuation by the full forward pass (no cache): the argmax after each prefix."""
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(direct_logprobs(lm, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_generate_until_is_greedy_and_stops_at_the_first_stop_string(lm, monkeypatch):
    context, steps = "And the LORD said", 12
    greedy = greedy_by_full_forward(lm, [BOS_ID] + gpt2_encoding().encode_ordinary(context), steps)
    assert BOS_ID not in greedy
    full_text = gpt2_encoding().decode(greedy)
    yielded = []
    generate = ds.generate
    monkeypatch.setattr(ds, "generate", lambda *a, **k: (yielded.append(t) or t for t in generate(*a, **k)))
    (text,) = lm.generate_until(requests("generate_until", (context, {"until": [], "max_gen_toks": steps})))
    assert text == full_text and len(yielded) == steps
    stop = full_text[len(gpt2_encoding().decode(greedy[:2])):][:3]   # text of the third token on
    yielded.clear()
    (text,) = lm.generate_until(requests("generate_until", (context, {"until": ["never", stop],
                                                                      "max_gen_toks": steps})))
    assert text == full_text.split(stop)[0] and len(yielded) < steps, (text, stop, full_text)


# ---------------------------------------------------------------------------------------------
# the command


def test_the_command_prints_the_table_and_writes_the_results(checkpoint, tmp_path, monkeypatch, capsys):
    offline(monkeypatch, tmp_path / "hf")
    without_environment_report(monkeypatch)
    output = tmp_path / "results.json"
    assert ds.main([str(checkpoint), "--tasks", "tiny_choice", "--include_path", TASKS, "--limit", "4",
                    "--batch_size", "3", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    assert "|tiny_choice|" in out and "|acc     |" in out and f"results: {output}" in out
    results = json.loads(output.read_text())
    assert results["n-samples"]["tiny_choice"] == {"original": 8, "effective": 4}
    assert results["config"]["checkpoint"] == str(checkpoint)
    assert lm_eval.api.registry.get_model("speedrun") is ds.SpeedrunLM


def test_a_dataset_that_cannot_be_fetched_ends_with_one_line(checkpoint, tmp_path):
    env = cpu_env(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    res = subprocess.run([sys.executable, os.path.join(REPO, "evaluation", "downstream.py"), str(checkpoint), "--tasks", "hub_only",
                          "--include_path", TASKS], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert res.returncode == 2 and res.stdout == ""
    (line,) = res.stderr.strip().splitlines()
    assert line.startswith("error: Couldn't reach 'speedrun-tests/not-a-cached-dataset' on the Hub")
    assert line.endswith("or point HF_HOME at a cache that has it")


@pytest.mark.parametrize("argv, line", [
    (["--tasks", ","], "error: --tasks ',' names an empty task: give lm-eval task names separated by commas"),
    (["--tasks", "tiny_choice,"], "error: --tasks 'tiny_choice,' names an empty task"),
    (["--tasks", "tiny_choice", "--limit", "nan"], "error: --limit nan: expects a whole number of documents per task"),
    (["--tasks", "tiny_choice", "--limit", "-1"], "error: --limit -1.0: expects a whole number of documents per task"),
    (["--tasks", "tiny_choice", "--limit", "0"], "error: --limit 0.0: expects a whole number"),
    (["--tasks", "tiny_choice", "--limit", "2.5"], "error: --limit 2.5: expects a whole number"),
    (["--tasks", "tiny_choice", "--limit", "inf"], "error: --limit inf: expects a whole number"),
    (["--tasks", "tiny_choice", "--num_fewshot", "-1"], "error: --num_fewshot -1: expects a number of examples >= 0"),
    (["--tasks", "tiny_choice", "--batch_size", "0"], "error: batch_size '0': give a positive number"),
], ids=["comma", "trailing comma", "nan limit", "negative limit", "zero limit", "fractional count", "inf limit",
        "negative few-shot", "zero batch"])
def test_bad_arguments_end_with_one_line_before_anything_loads(checkpoint, monkeypatch, capsys, argv, line):
    monkeypatch.setattr(ds, "SpeedrunLM", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(ds, "task_manager", lambda *a, **k: pytest.fail("the tasks were looked up"))
    assert ds.main([str(checkpoint), *argv, "--include_path", TASKS]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err


@pytest.mark.parametrize("output, line", [
    ("model.safetensors", "--output {dir}/model.safetensors is the checkpoint: downstream.py writes its results to a "
                          "new file, never over one; give --output a new path"),
    ("old.json", "--output {dir}/old.json exists: downstream.py writes its results to a new file"),
    ("missing/results.json", "--output {dir}/missing/results.json: its folder {dir}/missing does not exist"),
    ("sub", "--output {dir}/sub exists"),
], ids=["the checkpoint", "an existing file", "a missing folder", "a folder"])
def test_an_output_that_would_replace_a_file_or_lose_the_results_is_refused_first(tmp_path, monkeypatch, capsys,
                                                                                  output, line):
    """Checked before the tasks or the model load, so no evaluation runs only to be thrown away."""
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"the weights")
    (tmp_path / "old.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    monkeypatch.setattr(ds, "SpeedrunLM", lambda *a, **k: pytest.fail("the model was loaded"))
    monkeypatch.setattr(ds, "task_manager", lambda *a, **k: pytest.fail("the tasks were looked up"))
    assert ds.main([str(model), "--tasks", "tiny_choice", "--output", str(tmp_path / output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: " + line.format(dir=tmp_path)), err
    assert model.read_bytes() == b"the weights" and (tmp_path / "old.json").read_text() == "{}"


def test_the_default_output_next_to_the_checkpoint_is_checked_too(tmp_path, monkeypatch, capsys):
    model = tmp_path / "model.safetensors"
    model.write_bytes(b"the weights")
    previous = tmp_path / "model_lm_eval_tiny_choice.json"
    previous.write_text("{}")
    monkeypatch.setattr(ds, "task_manager", lambda *a, **k: pytest.fail("the tasks were looked up"))
    assert ds.main([str(model), "--tasks", "tiny_choice"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --output {previous} exists")


def test_results_that_find_their_file_taken_are_kept_beside_it(tmp_path):
    """A file put where the results go while the tasks ran: kept, and the results go to a new file."""
    taken = tmp_path / "results.json"
    taken.write_text("theirs")
    with pytest.raises(ds.DownstreamError, match="appeared while the tasks ran; the results are in "):
        ds.write_results({"results": {}}, str(taken))
    assert taken.read_text() == "theirs"
    (kept,) = [p for p in tmp_path.iterdir() if p != taken]
    assert json.loads(kept.read_text()) == {"results": {}}


def test_without_a_checkpoint_only_prefetch_runs(capsys):
    assert ds.main(["--tasks", "tiny_choice"]) == 2
    assert capsys.readouterr().err.startswith("error: give a checkpoint (logs/<run id>_model.safetensors), or "
                                              "--prefetch")


def test_prefetch_loads_the_tasks_data_without_a_model(tmp_path, monkeypatch, capsys):
    offline(monkeypatch, tmp_path / "hf")
    monkeypatch.setattr(ds, "SpeedrunLM", lambda *a, **k: pytest.fail("the model was loaded"))
    assert ds.main(["--prefetch", "--tasks", "tiny_choice", "--include_path", TASKS]) == 0
    assert capsys.readouterr().out.startswith("tiny_choice: its data is ready (8 documents to evaluate; ")


def test_the_data_is_loaded_before_the_model(checkpoint, tmp_path, monkeypatch, capsys):
    """A task whose data cannot be fetched ends before the model is loaded (the 1.27 GB one of a cpu
    run takes a while); with data that loads, the model comes after it."""
    offline(monkeypatch, tmp_path / "hf")
    order = []
    load_tasks = ds.load_tasks
    monkeypatch.setattr(ds, "load_tasks", lambda *a: order.append("data") or load_tasks(*a))
    monkeypatch.setattr(ds, "SpeedrunLM", lambda *a, **k: order.append("model") or pytest.fail("stop here"))
    assert ds.main([str(checkpoint), "--tasks", "hub_only", "--include_path", TASKS]) == 2
    assert order == ["data"] and "Couldn't reach 'speedrun-tests/not-a-cached-dataset'" in capsys.readouterr().err
    with pytest.raises(pytest.fail.Exception, match="stop here"):
        ds.main([str(checkpoint), "--tasks", "tiny_choice", "--include_path", TASKS])
    assert order == ["data", "data", "model"]


def test_without_lm_eval_the_command_says_how_to_install_it(checkpoint):
    """lm-eval (or a package it brings) missing: one line naming the pinned install, not an import traceback."""
    blocker = ("import runpy, sys; sys.modules['lm_eval'] = None; sys.argv = sys.argv[1:]; "
               "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", blocker, os.path.join(REPO, "evaluation", "downstream.py"), str(checkpoint),
                           "--tasks", "hellaswag"], capture_output=True, text=True, timeout=120, env=cpu_env(),
                          cwd=REPO)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: downstream.py needs EleutherAI's lm-evaluation-harness (lm_eval is not installed): pip install "
        "lm-eval==0.4.13 (or pip install -r requirements.txt)"], done.stderr
