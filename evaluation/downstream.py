"""Downstream evaluation of a train_gpt.py checkpoint with EleutherAI's lm-evaluation-harness.

    python evaluation/downstream.py logs/<run id>_model.safetensors --tasks hellaswag [--limit N] [--batch_size B]
    python evaluation/downstream.py CHECKPOINT --tasks tiny_choice --include_path tests/lm_eval_tasks
    python evaluation/downstream.py --prefetch --tasks hellaswag      # fetch the tasks' data once (then cached), no model

The tasks' data is loaded (downloaded once, then read from the cache) before the model, so a
task whose data cannot be fetched ends with one line at once.

SpeedrunLM serves a checkpoint as an lm-eval model, registered as "speedrun":
    loglikelihood: requests packed as documents (BOS, context, continuation) into one forward
        pass, each scored as if alone; the full-vocabulary softmax of the softcapped logits over
        the GPT-2 vocabulary (the padding columns left out, as GPT.next_token_logits does);
    loglikelihood_rolling: a whole text in lm-eval's rolling windows of the model's max length;
    generate_until: greedy decoding (sampling when a task asks) with a KV cache, stopping at a
        stop string, max_gen_toks or end-of-text.
The model runs in eval mode with the final validation's windows (as trained_model leaves it),
in the checkpoint's compute dtype. The canonical mask of the speedrun validation is not applied.
"""
import argparse
import itertools
import json
import logging
import math
import os
import re
import sys
import tempfile

import torch
import torch.nn.functional as F

try:                               # lm-eval and what it brings (datasets, tqdm): main says how to install them
    import datasets
    from lm_eval import simple_evaluate
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import get_rolling_token_windows, handle_non_serializable, make_disjoint_window, make_table
    from tqdm import tqdm
    MISSING_PACKAGE = None
except ImportError as e:
    MISSING_PACKAGE = e.name or "lm_eval"
    TemplateLM = object

    def register_model(name):
        return lambda cls: cls

# Everything this module takes from the training code.
REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # train_gpt.py's folder
sys.path.insert(0, REPO_DIR)
import kernels  # noqa: E402
from data.tokenizer import BOS_ID, ENDOFTEXT, gpt2_encoding  # noqa: E402
from evaluation.evaluate import generate, trained_model  # noqa: E402
from machinery.config import VOCAB_SIZE, WINDOW_BLOCK  # noqa: E402
from machinery.cpu_runtime import bf16_gemms  # noqa: E402
from machinery.errors import UserError  # noqa: E402
from train_gpt import AttentionArgs, attention_windows, gemm_path  # noqa: E402

MODEL_NAME = "speedrun"            # the name lm-eval knows SpeedrunLM by
CHECKPOINT_KEYS = ("device", "ngram_cache_rows", "compute_dtype")  # config keys SpeedrunLM may override
DEFAULT_MAX_GEN_TOKS = 256         # lm-eval's default for generate_until (HFLM's)
HEAD_ROWS = 1024                   # positions per block of head + softmax: 1024 x 50,257 fp32 = 206 MB
EXIT_USER_ERROR = 2                # as train_gpt.py: a bad input or environment, one `error:` line
LM_EVAL_REQUIREMENT = "lm-eval==0.4.13"  # the version requirements.txt pins
DOWNLOAD_LOGGERS = ("datasets", "huggingface_hub", "fsspec", "urllib3")  # whose retry warnings the error line replaces
OFFLINE_HINT = ("HF_DATASETS_OFFLINE or HF_HUB_OFFLINE forbids downloading it and no copy is cached under {cache}: "
                "run once without them where huggingface.co can be reached (the copy is then cached), or point "
                "HF_HOME at a cache that has it")
NETWORK_HINT = ("run where huggingface.co can be reached (the dataset is then cached under {cache}), or set "
                "HF_DATASETS_OFFLINE=1 with a cached copy of it (HF_HOME)")


class DownstreamError(UserError):
    """A request, task or dataset this command cannot serve; the message says what to do."""


def scored_document(context_ids, continuation_ids, max_length):
    """The tokens of one loglikelihood document: BOS (unless the context starts with it), the
    context, the continuation. When longer than max_length + 1 (the forward pass sees all but the
    last), the context loses tokens from the left, after the BOS, as lm-eval's HF model truncates."""
    if len(continuation_ids) > max_length:
        raise DownstreamError(f"a continuation of {len(continuation_ids)} tokens is longer than the "
                              f"{max_length} positions this model has")
    body = list(context_ids[1:] if context_ids[:1] == [BOS_ID] else context_ids) + list(continuation_ids)
    return [BOS_ID] + body[-max_length:]


def rolling_documents(token_ids, max_length):
    """lm-eval's rolling windows over one text (get_rolling_token_windows with context_len 1,
    made disjoint): [(window tokens, how many of its last tokens are scored)]. Every token is
    scored once: the first window is BOS and up to max_length tokens, all scored; each later one
    is max_length + 1 tokens of the text, of which the last max_length (fewer in the last window)
    are scored."""
    windows = map(make_disjoint_window, get_rolling_token_windows(token_ids, BOS_ID, max_length, context_len=1))
    return [(context + scored, len(scored)) for context, scored in windows]


def packs(documents, max_tokens, max_documents):
    """Consecutive groups of document indices, each one forward pass: at most max_tokens input
    tokens (a document's input is all its tokens but the last) and max_documents documents. A
    document that does not start with BOS (a rolling window inside a text) opens a group: the
    model takes BOS tokens and the first token of a pass for document starts."""
    group, used = [], 0
    for i, (tokens, _) in enumerate(documents):
        size = len(tokens) - 1
        if group and (used + size > max_tokens or len(group) == max_documents or tokens[0] != BOS_ID):
            yield group
            group, used = [], 0
        group.append(i)
        used += size
    if group:
        yield group


def stop_strings_cut(text, until):
    """The text before the first occurrence of any non-empty stop string (lm-eval's rule)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


def parse_batch_size(value):
    """'auto' (None: as many documents as fit the model's max length) or a positive count."""
    if value is None or str(value) == "auto":
        return None
    if not str(value).isdigit() or int(value) < 1:
        raise DownstreamError(f"batch_size {value!r}: give a positive number of requests per forward pass, or auto")
    return int(value)


@register_model(MODEL_NAME)
class SpeedrunLM(TemplateLM):
    """A train_gpt.py checkpoint as an lm-eval model.

    checkpoint: the path of logs/<run id>_model.safetensors. device: auto | cpu | cuda (or
    cuda:0; default: the checkpoint's config, auto). batch_size: the most requests packed into
    one forward pass, or auto (as many as fit max_length tokens; then max_batch_size, if given,
    is the most); a pass never exceeds max_length tokens, the model's longest slice (its config's
    max positions). compute_dtype: bfloat16 | float32 (default: the checkpoint's).
    ngram_cache_rows: keep an n-gram table in host memory with this many rows cached on the
    device (as for --eval). seed: of sampling, for tasks that ask for do_sample.
    """

    def __init__(self, checkpoint, device=None, batch_size="auto", max_batch_size=None, compute_dtype=None,
                 ngram_cache_rows=None, seed=0):
        super().__init__()
        device = "cuda" if device == "cuda:0" else device    # lm-eval's spelling of the first GPU
        settings = {"device": device, "compute_dtype": compute_dtype, "ngram_cache_rows": ngram_cache_rows}
        overrides = [f"--{key}={value}" for key, value in settings.items() if value is not None]
        self.trainer, self.metadata = trained_model(checkpoint, overrides, CHECKPOINT_KEYS)
        self.checkpoint = str(checkpoint)
        self.model, self.h = self.trainer.model.eval(), self.trainer.h
        self._device = self.trainer.pg.device
        self.max_length = self.model.max_tokens
        self.max_documents = parse_batch_size(batch_size) or parse_batch_size(max_batch_size)
        self.seed = int(seed)
        self.encoding = gpt2_encoding()
        short, long = attention_windows(self.h, self.h.num_iterations, final_validation=True)
        self.windows = (short * WINDOW_BLOCK, long * WINDOW_BLOCK)
        self.gemm_path = gemm_path(self.h, self._device, compiling=False)

    # -- tokens
    @property
    def eot_token_id(self):
        return BOS_ID

    def tok_encode(self, string, add_special_tokens=None, **kwargs):
        """GPT-2 tokens of the text, special tokens encoded as ordinary text (as --sample does)."""
        return self.encoding.encode_ordinary(string)

    def tok_decode(self, tokens):
        return self.encoding.decode(list(tokens))

    def get_model_info(self):
        """What simple_evaluate records of the model in its results' config."""
        return {"checkpoint": self.checkpoint, "run_id": self.metadata["run_id"],
                "val_loss": self.metadata["val_loss"], "max_length": self.max_length,
                "compute_dtype": self.h.compute_dtype}

    # -- the forward pass
    @torch.no_grad()
    def target_scores(self, tokens, cu_seqlens, rows, targets):
        """(log-probability, whether it is the argmax) (R,) of each target token after its row of
        the packed documents `tokens` (int32, offsets cu_seqlens): the log_softmax of the
        softcapped fp32 logits over the GPT-2 vocabulary, in blocks of HEAD_ROWS rows."""
        if self.trainer.tables.fetcher is not None:   # a table split or in host memory: its rows for this pass
            self.trainer.tables.fetcher.fetch(tokens, training=False)
        args = AttentionArgs(cu_seqlens.to(self._device), *self.windows)
        targets = targets.to(self._device)
        logprobs, greedy = [], []
        with bf16_gemms(self.gemm_path), self.trainer.autocast:
            x = self.model.hidden_states(tokens.to(self._device), args)[rows.to(self._device)]
            weight = self.model.head_weight().type_as(x)
            for s in range(0, x.size(0), HEAD_ROWS):
                logits = kernels.softcap(F.linear(x[s:s + HEAD_ROWS], weight))[:, :VOCAB_SIZE]
                picked = targets[s:s + HEAD_ROWS]
                logprobs.append(torch.log_softmax(logits, dim=-1).gather(1, picked[:, None])[:, 0])
                greedy.append(logits.argmax(dim=-1) == picked)
        return torch.cat(logprobs), torch.cat(greedy)

    def score_pack(self, documents):
        """[(sum of the log-probabilities of the scored tokens, whether each is the argmax)] of
        documents [(tokens, number of scored last tokens)], packed into one forward pass."""
        inputs = [tokens[:-1] for tokens, _ in documents]
        ends = torch.tensor([len(x) for x in inputs]).cumsum(0)
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).int()
        rows = torch.cat([torch.arange(end - n, end) for end, (_, n) in zip(ends.tolist(), documents)])
        targets = torch.tensor([t for tokens, n in documents for t in tokens[-n:]])
        tokens = torch.tensor(list(itertools.chain.from_iterable(inputs)), dtype=torch.int32)
        logprobs, greedy = self.target_scores(tokens, cu_seqlens, rows, targets)
        counts = [n for _, n in documents]
        return [(float(lp.double().sum()), bool(g.all()))
                for lp, g in zip(logprobs.split(counts), greedy.split(counts))]

    def score_documents(self, documents, disable_tqdm=True):
        """score_pack over all documents, in as few passes as packs() allows; in their order. A
        document with nothing to score (an empty continuation) scores (0.0, True) with no pass."""
        results = [(0.0, True)] * len(documents)
        scored = [i for i, (_, n) in enumerate(documents) if n > 0]
        groups = list(packs([documents[i] for i in scored], self.max_length, self.max_documents or len(documents)))
        for group in tqdm(groups, desc="speedrun forward passes", disable=disable_tqdm):
            for j, result in zip(group, self.score_pack([documents[scored[j]] for j in group])):
                results[scored[j]] = result
        return results

    # -- lm-eval's requests
    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
        """[(log-probability of the continuation, whether greedy decoding gives it)] of
        requests [((context, continuation), context tokens, continuation tokens)], the tokens
        split by TemplateLM as HFLM splits them (context + continuation encoded together)."""
        documents = [(scored_document(context, continuation, self.max_length), len(continuation))
                     for _, context, continuation in requests]
        results = self.score_documents(documents, disable_tqdm)
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        """The log-probability of each request's whole text after BOS, summed over lm-eval's
        rolling windows of max_length tokens."""
        per_text = [rolling_documents(self.tok_encode(text), self.max_length) for (text,) in
                    (req.args for req in requests)]
        scores = iter(self.score_documents([d for windows in per_text for d in windows], disable_tqdm))
        totals = []
        for req, windows in zip(requests, per_text):
            totals.append(sum(next(scores)[0] for _ in windows))
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, totals[-1])
        return totals

    def generated_text(self, prompt_ids, max_new_tokens, until, temperature, top_k):
        """The continuation of prompt_ids (starting with BOS) up to the first stop string, after
        at most max_new_tokens tokens or an end-of-text token."""
        tokens = []
        with bf16_gemms(self.gemm_path):
            for token in generate(self.model, self.h, prompt_ids, max_new_tokens, temperature, top_k, self.seed,
                                  self.trainer.autocast):
                if token == BOS_ID:
                    break
                tokens.append(token)
                if any(stop and stop in self.tok_decode(tokens) for stop in until):
                    break
        return stop_strings_cut(self.tok_decode(tokens), until)

    def generate_until(self, requests, disable_tqdm=False):
        """Each request's (context, gen_kwargs) continued one token at a time with a KV cache:
        greedy unless gen_kwargs ask for do_sample (temperature, top_k); the context loses tokens
        from the left (after its BOS) so that it and max_gen_toks fit max_length."""
        results = []
        for req in tqdm(requests, desc="speedrun generation", disable=disable_tqdm):
            context, gen_kwargs = req.args
            kwargs = normalize_gen_kwargs(gen_kwargs, DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=ENDOFTEXT)
            max_new = kwargs["max_gen_toks"]
            if not 0 <= max_new < self.max_length:
                raise DownstreamError(f"max_gen_toks={max_new}: this model generates at most {self.max_length - 1} "
                                      f"tokens after a context of at least BOS")
            context_ids = self.tok_encode(context)
            prompt = [BOS_ID] + context_ids[max(0, len(context_ids) - (self.max_length - max_new - 1)):]
            temperature = float(kwargs.get("temperature") or 0.0) if kwargs.get("do_sample") else 0.0
            text = (self.generated_text(prompt, max_new, until, temperature, int(kwargs.get("top_k") or 0))
                    if max_new else "")
            self.cache_hook.add_partial("generate_until", req.args, text)
            results.append(text)
        return results


# -----------------------------------------------------------------------------------------------
# The command


def task_manager(tasks, include_path):
    """lm-eval's TaskManager for `tasks`: only include_path's tasks when they hold them all (the
    built-in index of some 14,000 names takes seconds to build), else those and the built-in ones."""
    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(name in local.all_tasks for name in tasks):
            return local
    manager = TaskManager(include_path=include_path or None)
    unknown = [name for name in tasks if name not in manager.all_tasks and not os.path.isfile(name)]
    if unknown:
        raise DownstreamError(f"no task named {', '.join(unknown)} (list them with `python -m lm_eval ls tasks`; "
                              f"a local task's folder goes in --include_path)")
    return manager


def unreachable(error):
    """The DownstreamError of a dataset that could not be fetched: datasets' first line ("Couldn't
    reach '<dataset>' on the Hub (<reason>)") and what to do."""
    hint = OFFLINE_HINT if datasets.config.HF_HUB_OFFLINE else NETWORK_HINT
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return DownstreamError(f"{first}: {hint.format(cache=datasets.config.HF_DATASETS_CACHE)}")


def load_tasks(manager, tasks):
    """{task name: its lm-eval task} with its data loaded: downloaded once, then from the cache."""
    try:
        return manager.load(list(tasks))["tasks"]
    except ConnectionError as e:
        raise unreachable(e) from None


def evaluate(lm, tasks, include_path=None, limit=None, num_fewshot=None, log_samples=False, bootstrap_iters=100_000,
             manager=None):
    """lm_eval.simple_evaluate of `lm` on `tasks` (names), found by `manager` (default:
    task_manager(tasks, include_path)); a dataset that cannot be fetched raises DownstreamError."""
    manager = manager or task_manager(tasks, include_path)
    try:
        return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit, num_fewshot=num_fewshot,
                               log_samples=log_samples, bootstrap_iters=bootstrap_iters)
    except ConnectionError as e:   # datasets: "Couldn't reach '<dataset>' on the Hub (<reason>)"
        raise unreachable(e) from None


def results_path(checkpoint, tasks):
    """<checkpoint without .safetensors>_lm_eval_<tasks>.json, next to the checkpoint."""
    stem = re.sub(r"\.safetensors$", "", str(checkpoint))
    return f"{stem}_lm_eval_{re.sub(r'[^A-Za-z0-9_.-]+', '_', '+'.join(tasks))[:100]}.json"


def parse_arguments(argv):
    parser = argparse.ArgumentParser(prog="downstream.py", description="Run lm-evaluation-harness tasks on a "
                                     "checkpoint written by train_gpt.py --save_checkpoint=true.")
    parser.add_argument("checkpoint", nargs="?", help="logs/<run id>_model.safetensors")
    parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task names, e.g. hellaswag")
    parser.add_argument("--prefetch", action="store_true", help="only fetch the tasks' data (then cached); no "
                        "checkpoint")
    parser.add_argument("--limit", type=float, default=None, help="at most this many documents per task (or a "
                        "fraction of them when below 1)")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--batch_size", default="auto", help="requests per forward pass, or auto (as many as fit "
                        "the model's max length)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="default: the checkpoint's")
    parser.add_argument("--compute_dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: the checkpoint's")
    parser.add_argument("--ngram_cache_rows", type=int, default=None, help="an n-gram table in host memory, this "
                        "many rows of it cached on the device")
    parser.add_argument("--include_path", action="append", default=None, help="a folder of task YAMLs (repeatable)")
    parser.add_argument("--output", default=None, help="the results JSON (default: next to the checkpoint)")
    parser.add_argument("--log_samples", action="store_true", help="also write each document's requests and "
                        "scores into the JSON")
    return parser.parse_args(argv)


def check_arguments(args):
    """The arguments' values (what argparse leaves to us): task names, a limit, a few-shot count, a
    batch size, a checkpoint unless --prefetch. args.tasks becomes the list of names, args.limit a
    count (int) or a fraction."""
    text = args.tasks
    args.tasks = [t.strip() for t in text.split(",")]
    if not all(args.tasks):
        raise DownstreamError(f"--tasks {text!r} names an empty task: give lm-eval task names separated by commas, "
                              f"e.g. --tasks hellaswag,arc_easy")
    limit = args.limit
    if limit is not None and not (math.isfinite(limit) and (0 < limit < 1 or (limit >= 1 and limit == int(limit)))):
        raise DownstreamError(f"--limit {limit}: expects a whole number of documents per task (>= 1) or a fraction "
                              f"of them in (0, 1)")
    if limit is not None and limit >= 1:
        args.limit = int(limit)
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise DownstreamError(f"--num_fewshot {args.num_fewshot}: expects a number of examples >= 0")
    parse_batch_size(args.batch_size)
    if not args.prefetch and not args.checkpoint:
        raise DownstreamError("give a checkpoint (logs/<run id>_model.safetensors), or --prefetch to only fetch the "
                              "tasks' data")
    if not args.prefetch:
        args.output = checked_output(args.output or results_path(args.checkpoint, args.tasks), args.checkpoint)


def checked_output(output, checkpoint):
    """The results' path, refused before any work where writing it would replace a file (the
    checkpoint above all) or where its folder cannot take it: an evaluation's results are never
    thrown away after it ran."""
    if os.path.lexists(output):
        same = os.path.exists(checkpoint) and os.path.exists(output) and os.path.samefile(output, checkpoint)
        raise DownstreamError(f"--output {output} " + ("is the checkpoint" if same else "exists") + ": downstream.py "
                              "writes its results to a new file, never over one; give --output a new path")
    folder = os.path.dirname(output) or "."
    if not os.path.isdir(folder):
        raise DownstreamError(f"--output {output}: its folder {folder} does not exist; create it or give another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise DownstreamError(f"--output {output}: its folder {folder} is not writable; give another path")
    return output


def write_results(results, output):
    """The results as JSON in `output`, created (a file put there while the tasks ran is not replaced:
    the results go to a new file beside it, which the line names)."""
    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    try:
        with open(output, "x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        fd, kept = tempfile.mkstemp(dir=os.path.dirname(output) or ".", prefix="results.", suffix=".json")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        raise DownstreamError(f"--output {output} appeared while the tasks ran; the results are in {kept}") from None


def quiet_downloads():
    """The download libraries' warnings (each retry of a failed request) off: a dataset that cannot
    be fetched ends with the one line load_tasks says."""
    for name in DOWNLOAD_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def main(argv=None):
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    if MISSING_PACKAGE is not None:
        print(f"error: downstream.py needs EleutherAI's lm-evaluation-harness ({MISSING_PACKAGE} is not installed): "
              f"pip install {LM_EVAL_REQUIREMENT} (or pip install -r requirements.txt)", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    try:
        check_arguments(args)
        quiet_downloads()
        manager = task_manager(args.tasks, args.include_path)    # an unknown task is refused before the model loads
        loaded = load_tasks(manager, args.tasks)                 # and a task whose data cannot be fetched
        if args.prefetch:
            for name, task in loaded.items():
                print(f"{name}: its data is ready ({len(list(task.eval_docs))} documents to evaluate; datasets "
                      f"cache: {datasets.config.HF_DATASETS_CACHE})")
            return 0
        lm = SpeedrunLM(args.checkpoint, device=args.device, batch_size=args.batch_size,
                        compute_dtype=args.compute_dtype, ngram_cache_rows=args.ngram_cache_rows)
        results = evaluate(lm, args.tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                           log_samples=args.log_samples, manager=manager)
        output = args.output
        write_results(results, output)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except OSError as e:
        print(f"error: {e.filename or 'a file'}: {e.strerror}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"checkpoint of run {lm.metadata['run_id']} (val_loss {lm.metadata['val_loss']:.4f}); results: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
