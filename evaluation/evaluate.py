"""Use a checkpoint of a run (logs/<run id>_model.safetensors, written with --save_checkpoint=true):

    python evaluation/evaluate.py --eval=PATH [--key=value of EVAL_KEYS]     # its final validation again
    python evaluation/evaluate.py --sample=PATH --prompt=TEXT [--max_new_tokens=N --temperature=T --top_k=K --seed=S]

--eval recomputes the run's final validation (same tokens, windows and full softmax) and prints
its val line; with the run's config on the same machine it equals the logged one. --sample
continues the prompt with the KV cache, printing the text as it is generated. A checkpoint's
data must match the sha256 its metadata names; --trust_checkpoint=true reads it anyway.
Errors end with one line, as train_gpt.py's.
"""
import codecs
import contextlib
import math
import os
import sys
import time

import torch

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # train_gpt.py's folder
sys.path.insert(0, REPO_DIR)
import train_gpt  # noqa: E402
from data.loader import shards_of, validation_data  # noqa: E402
from data.tokenizer import BOS_ID, gpt2_encoding  # noqa: E402
from machinery.checkpoint import NGRAM_TABLE_KEY, CheckpointError, load_checkpoint, split_ngram_table  # noqa: E402
from machinery.config import (WINDOW_BLOCK, ArgumentParser, ConfigError, apply_overrides, check_config,  # noqa: E402
                              parse_value)
from machinery.cpu_runtime import bf16_gemms  # noqa: E402
from machinery.kv_cache import KVCache  # noqa: E402
from machinery.processes import EXIT_USER_ERROR, start_process  # noqa: E402
from train_gpt import AttentionArgs, Trainer, attention_windows, gemm_path  # noqa: E402

EVAL_KEYS = ("val_files", "val_tokens", "val_tokens_per_rank", "device", "kernels", "compile", "compile_backend",
             "ngram_cache_rows")    # config keys an --eval command may override
SAMPLE_KEYS = ("device", "ngram_cache_rows")   # config keys a --sample command may override


def this_process_rows(state, model):
    """The checkpoint's state dict with its whole n-gram table cut to this process's rows when
    the model's table is split across the processes (a view: no copy); else `state` as it is."""
    shard = split_ngram_table(model)
    table = state.get(NGRAM_TABLE_KEY)
    if shard is None or table is None or table.shape[0] != model.ngram.rows:
        return state
    first = model.ngram.first_row
    return {**state, NGRAM_TABLE_KEY: table[first:first + shard.shape[0]]}


def trained_model(path, overrides, allowed, trust=False):
    """A Trainer holding the checkpoint's model, put where the schedule has it at the final
    validation (windows, YaRN, head tied or not), with `overrides` ["--key=value"] of the
    `allowed` config keys applied; `trust` skips the check of its data_sha256. Returns
    (trainer, metadata)."""
    h, state, metadata = load_checkpoint(path, trust)
    check_config(apply_overrides(h, overrides, allowed))  # scalars: nothing to normalize
    trainer = Trainer(h, start_process(h), log=None, training=False)
    trainer.advance_to(h.num_iterations, final_validation=True)
    if trainer.model.tied != metadata["tied"]:
        raise CheckpointError(f"{path}: its head is {'tied' if metadata['tied'] else 'untied'}, but its config "
                              f"ends {'tied' if trainer.model.tied else 'untied'}: the file is damaged")
    state = this_process_rows(state, trainer.model)
    expected = trainer.model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and (state[k].shape, state[k].dtype) != (expected[k].shape,
                                                                                          expected[k].dtype)]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{path}: its tensors do not fit the model its config describes (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}, other shape or dtype {wrong[:3]})")
    trainer.model.load_state_dict(state)
    return trainer, metadata


def checkpoint_arguments(parser, command):
    """Add --COMMAND=PATH (a checkpoint, not empty) and --trust_checkpoint=BOOL to `parser`."""
    def path(text):
        if not text:
            raise ConfigError(f"--{command}= names no file: give --{command}=PATH of a checkpoint (a run's "
                              f"logs/<run id>_model.safetensors)")
        return text
    parser.add_argument(f"--{command}", required=True, type=path)
    parser.add_argument("--trust_checkpoint", default=False, type=lambda text: parse_value("trust_checkpoint", text,
                                                                                            bool))


def eval_arguments(argv):
    """(PATH, the other arguments, whether to trust the file) of --eval=PATH
    [--trust_checkpoint=BOOL] [--key=value ...]."""
    parser = ArgumentParser(prog="evaluate.py --eval=PATH")
    checkpoint_arguments(parser, "eval")
    args, rest = parser.parse_known_args(argv)
    return args.eval, rest, args.trust_checkpoint


def evaluate_checkpoint(path, overrides, trust=False):
    """Recompute the final validation of the run that wrote `path` (same tokens, windows and full
    softmax) and print its val line; with the run's config on the same machine it equals the
    logged one. Returns the val loss."""
    trainer, metadata = trained_model(path, overrides, EVAL_KEYS, trust)
    h, pg = trainer.h, trainer.pg
    val_slices = validation_data(h, pg, shards_of(h.val_files))
    N = h.num_iterations
    with bf16_gemms(gemm_path(h, pg.device)):
        val_loss = trainer.validate(val_slices, N, final_validation=True)
    if pg.master:
        ms = metadata["train_time_ms"]
        print(f"step:{N}/{N} val_loss:{val_loss:.4f} train_time:{ms:.0f}ms step_avg:{ms / N:.2f}ms", flush=True)
        print(f"checkpoint of run {metadata['run_id']}: the run logged final val_loss:{metadata['val_loss']:.4f}",
              flush=True)
    return val_loss


def pick_token(logits, temperature, top_k, generator):
    """A token id drawn from softmax(logits / temperature) restricted to the top_k largest logits
    (top_k = 0: all of them); temperature 0 is greedy decoding (the argmax)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.double()
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    # In float64 and from the largest logit down, so that no temperature overflows: the largest
    # scaled logit is 0 and the others at most 0 (-inf where they underflow).
    scaled = (logits - logits.max()) / temperature
    return int(torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model, h, prompt_ids, max_new_tokens, temperature, top_k, seed, autocast=contextlib.nullcontext()):
    """Yield up to max_new_tokens sampled token ids that continue the document prompt_ids (which
    starts with BOS), one at a time, with a KV cache; stops after an end-of-text token. The model
    attends with the final validation's windows. A model whose logits are not finite (NaN weights)
    is refused: no token can be drawn from them."""
    device = model.embed.weight.device
    model.eval()
    short, long = attention_windows(h, h.num_iterations, final_validation=True)
    args = AttentionArgs(None, short * WINDOW_BLOCK, long * WINDOW_BLOCK, KVCache(len(prompt_ids) + max_new_tokens))
    generator = torch.Generator(device=device).manual_seed(seed)
    tokens = torch.tensor(prompt_ids, dtype=torch.int32, device=device)
    for _ in range(max_new_tokens):
        with autocast:
            logits = model.next_token_logits(tokens, args)
        if not bool(torch.isfinite(logits).all()):
            raise CheckpointError("the model's next-token logits are NaN or infinite: its weights are not finite (its "
                                  "run diverged?), so there is nothing to sample; use another checkpoint")
        token = pick_token(logits, temperature, top_k, generator)
        yield token
        if token == BOS_ID:
            return
        tokens = torch.tensor([token], dtype=torch.int32, device=device)


def sample_from_checkpoint(argv):
    """--sample=PATH --prompt=TEXT [--max_new_tokens --temperature --top_k --seed --device]:
    print the prompt, then the continuation as it is generated."""
    parser = ArgumentParser(prog="evaluate.py --sample=PATH")
    checkpoint_arguments(parser, "sample")
    parser.add_argument("--prompt", default="")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top_k", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not math.isfinite(args.temperature) \
            or not 0 <= args.seed < 2**63:
        raise ConfigError("--sample expects --max_new_tokens >= 1, a finite --temperature >= 0, --top_k >= 0 and "
                          "--seed in [0, 2^63)")
    enc = gpt2_encoding()
    trainer, _ = trained_model(args.sample, rest, SAMPLE_KEYS, args.trust_checkpoint)
    prompt_ids = [BOS_ID] + enc.encode_ordinary(args.prompt)
    positions = trainer.model.max_tokens
    if len(prompt_ids) + args.max_new_tokens > positions:
        raise ConfigError(f"the prompt ({len(prompt_ids)} tokens) and --max_new_tokens={args.max_new_tokens} exceed "
                          f"the {positions} positions this model has tables for")
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")
    print(args.prompt, end="", flush=True)
    count, t0 = 0, time.perf_counter()
    with bf16_gemms(gemm_path(trainer.h, trainer.pg.device, compiling=False)):
        for token in generate(trainer.model, trainer.h, prompt_ids, args.max_new_tokens, args.temperature, args.top_k,
                              args.seed, trainer.autocast):
            count += 1
            if token != BOS_ID:
                print(text.decode(enc.decode_single_token_bytes(token)), end="", flush=True)
    print(text.decode(b"", final=True), flush=True)
    elapsed = time.perf_counter() - t0
    print(f"[{count} tokens in {elapsed:.1f} s: {count / elapsed:.1f} tokens/s]", file=sys.stderr, flush=True)
    return 0


def checkpoint_command(argv):
    """"eval" or "sample" when argv asks to use a checkpoint (--eval=PATH, --sample=PATH), else None."""
    for item in argv:
        for command in ("eval", "sample"):
            if item.startswith(f"--{command}=") or item == f"--{command}":
                return command
    return None


def run(argv):
    """The checkpoint command argv asks for (checkpoint_command)."""
    if checkpoint_command(argv) == "sample":
        return sample_from_checkpoint(argv)
    path, rest, trust = eval_arguments(argv)
    evaluate_checkpoint(path, rest, trust)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    command = checkpoint_command(argv)
    if command is None and any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    if command is None:
        print("error: give --eval=PATH or --sample=PATH of a checkpoint (python evaluation/evaluate.py --help: the usage)",
              file=sys.stderr)
        return EXIT_USER_ERROR
    return train_gpt.main(argv, command=command, run=run)


if __name__ == "__main__":
    sys.exit(main())
