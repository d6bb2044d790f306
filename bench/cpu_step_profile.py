"""Where the time of a cpu-preset training step goes: data, forward, backward, each optimizer.

Builds the trainer exactly as `train_gpt.py --preset cpu` does (any --key=value override
applies), runs --warmup untimed steps, then profiles --steps steps with torch.profiler. The
phases are the trainer's own record_function ranges ("forward", "backward", "optimizer: ...")
plus the batch fetch, so the loop measured is the training loop; a CPU executes synchronously,
so a range's wall time is the phase's time. Prints a Markdown section (phases, then the
operators with the most self time) and appends it to bench/results/<date>_<machine>.md with the
date, the commit, the machine and the command.

    python bench/cpu_step_profile.py --at 2 --steps 4 [--key=value ...]

Time it on an idle machine: other jobs on the cores slow every phase.
"""
import argparse
import datetime
import functools
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "bench"))

from cpu_comparison import append_section, results_file, source_commit  # noqa: E402

import train_gpt as tg  # noqa: E402
from data.loader import shards_of  # noqa: E402
from machinery.cpu_runtime import bf16_gemms  # noqa: E402
from records.logfile import cpu_model  # noqa: E402
from machinery.processes import start_process  # noqa: E402

DATA_RANGE = "data"                # the batch fetch (the loader packs the next batch in a thread)
TOP_OPERATORS = 12                 # operator rows in the table


def profile_steps(h, at, warmup, steps):
    """(profiler, wall seconds per step) of `steps` steps of the schedule from step `at`, after
    `warmup` untimed steps just before it (the earlier steps only fetch their batches)."""
    env = start_process(h)
    trainer = tg.Trainer(h, env, log=None)
    train_files = shards_of(h.train_files)
    batches = tg.BatchPrefetcher(tg.train_loader(h, train_files), functools.partial(tg.batch_shape, h), trainer.mine, pin=False)
    try:
        with bf16_gemms(tg.gemm_path(h, env.device)):
            for step in range(at):
                slices = batches.get(step)
                if step >= at - warmup:
                    trainer.advance_to(step)
                    trainer.train_step(step, slices)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for step in range(at, at + steps):
                    trainer.advance_to(step)
                    with record_function(DATA_RANGE):
                        slices = batches.get(step)
                    trainer.train_step(step, slices)
                seconds = (time.perf_counter() - t0) / steps
    finally:
        batches.close()
    return prof, seconds


def phase_table(prof, steps, seconds):
    """Markdown rows: each labelled range's ms per step and share of the step."""
    ranges = {e.key: e.cpu_time_total / 1000 / steps for e in prof.key_averages()
              if e.key in ("forward", "backward", DATA_RANGE) or e.key.startswith("optimizer: ")}
    step_ms = 1000 * seconds
    rows = ["| phase | ms per step | share |", "|---|---|---|"]
    for name in [DATA_RANGE, "forward", "backward"] + sorted(k for k in ranges if k.startswith("optimizer: ")):
        if name in ranges:
            rows.append(f"| {name} | {ranges[name]:.0f} | {ranges[name] / step_ms:.0%} |")
    other = step_ms - sum(ranges.values())
    rows.append(f"| other (schedule, zero_grad, loop) | {other:.0f} | {other / step_ms:.0%} |")
    rows.append(f"| **step** | **{step_ms:.0f}** | 100% |")
    return "\n".join(rows)


def operator_table(prof, steps, seconds):
    """Markdown rows: the operators with the most self time (time not spent in operators they called)."""
    events = sorted((e for e in prof.key_averages() if not e.key.startswith(("forward", "backward", "optimizer: ",
                                                                               DATA_RANGE, "ProfilerStep"))),
                    key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_OPERATORS]
    step_ms = 1000 * seconds
    rows = ["| operator | self ms per step | share of the step | calls per step |", "|---|---|---|---|"]
    for e in events:
        ms = e.self_cpu_time_total / 1000 / steps
        rows.append(f"| `{e.key}` | {ms:.0f} | {ms / step_ms:.0%} | {e.count / steps:.0f} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--at", type=int, default=2, help="the first profiled step of the schedule")
    parser.add_argument("--steps", type=int, default=4, help="profiled steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps just before --at")
    parser.add_argument("--title", default="cpu preset", help="what this profile is of (the section title)")
    parser.add_argument("--results", default=results_file(),
                        help="append the section here ('' to skip; default: bench/results/<today>_<machine>.md)")
    args, overrides = parser.parse_known_args()
    h = tg.parse_config(["--preset", "cpu", *overrides])
    commit = source_commit()
    if not (0 <= args.at - args.warmup and args.at + args.steps <= h.num_iterations and args.steps > 0):
        parser.error(f"need 0 <= --at - --warmup and --at + --steps <= {h.num_iterations} (the schedule's steps)")
    prof, seconds = profile_steps(h, args.at, args.warmup, args.steps)
    device = torch.device("cpu")
    section = (f"\n## Step profile: {args.title}, {datetime.date.today().isoformat()}\n\n"
               f"- commit: {commit}\n- machine: {cpu_model()}, {os.cpu_count()} cores, torch threads "
               f"{torch.get_num_threads()}, bf16 products: {tg.gemm_path(h, device)}\n"
               f"- command: `python bench/cpu_step_profile.py {' '.join(sys.argv[1:])}`\n"
               f"- steps {args.at}-{args.at + args.steps - 1} of {h.num_iterations}, "
               f"{h.stages[tg.stage_index(h, args.at)].tokens_per_rank} tokens per step at the first\n\n"
               f"{phase_table(prof, args.steps, seconds)}\n\n{operator_table(prof, args.steps, seconds)}\n")
    print(section)
    if args.results:
        append_section(args.results, section)


if __name__ == "__main__":
    main()
