"""Compare the matrix optimizers on the CPU track at an equal number of steps.

Runs `train_gpt.py --preset cpu --optimizer=X --seed=S` for every optimizer and seed (one
thread per run, `--parallel` runs at once), reads each log's final val loss, and prints a
Markdown table of mean and sample std per optimizer, and appends it, with the date, the commit
and the command, to `bench/cpu_results.md`. Everything else is the cpu preset, so the comparison
is at equal steps and equal tokens, not at equal wall time.

    python bench/cpu_optimizer_comparison.py --steps 50 --seeds 0 1 2 --parallel 2
"""
import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from records.logfile import parse_log  # noqa: E402

OPTIMIZERS = ("adamw", "muon", "normuon", "anvil")


def launch(optimizer, seed, steps, log_dir, extra):
    cmd = [sys.executable, os.path.join(REPO, "train_gpt.py"), "--preset", "cpu", f"--optimizer={optimizer}",
           f"--seed={seed}", f"--num_iterations={steps}", f"--log_dir={log_dir}", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", LOCAL_WORLD_SIZE=str(os.cpu_count()))
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_all(jobs, parallel):
    """Run (optimizer, seed, log_dir) jobs, `parallel` at a time; return {(opt, seed): final val loss}."""
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            running.append((job, launch(*job)))
        time.sleep(2)
        for job, proc in list(running):
            if proc.poll() is None:
                continue
            running.remove((job, proc))
            optimizer, seed, _, log_dir, _ = job
            if proc.returncode != 0:
                raise SystemExit(f"{optimizer} seed {seed} failed: {proc.stderr.read().strip()[-500:]}")
            (log_name,) = [f for f in os.listdir(log_dir) if f.endswith(".txt")]
            log = parse_log(os.path.join(log_dir, log_name))
            results[optimizer, seed] = log.final["val_loss"]
            print(f"{optimizer} seed {seed}: val_loss {log.final['val_loss']:.4f} "
                  f"({log.final['train_time_ms'] / 1000:.0f} s)", flush=True)
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="steps per run (default: the cpu preset's 50)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "logs", "optimizer_comparison"))
    parser.add_argument("--results", default=os.path.join(REPO, "bench", "cpu_results.md"),
                        help="append the table here ('' to skip)")
    parser.add_argument("extra", nargs="*", help="more --key=value overrides for every run")
    args = parser.parse_args()
    commit = source_commit()       # before the runs: the code they run
    jobs = []
    for seed in args.seeds:
        for optimizer in args.optimizers:
            log_dir = os.path.join(args.out, f"{optimizer}_seed{seed}")
            os.makedirs(log_dir, exist_ok=False)
            jobs.append((optimizer, seed, args.steps, log_dir, args.extra))
    results = run_all(jobs, args.parallel)
    table = results_table(results, args.optimizers, args.seeds, args.steps)
    print("\n" + table)
    if args.results:
        with open(args.results, "a") as f:
            f.write(f"\n## Optimizer comparison, {datetime.date.today().isoformat()}\n\n"
                    f"- commit: {commit}\n- machine: {platform.machine()}, {os.cpu_count()} cores, no GPU"
                    f"\n- command: `python bench/cpu_optimizer_comparison.py {' '.join(sys.argv[1:])}`\n\n{table}\n")


def results_table(results, optimizers, seeds, steps):
    """Markdown table: per optimizer, mean and sample std of the final val loss over seeds."""
    lines = [f"| optimizer | val loss at {steps} steps: mean | std | runs (seeds {', '.join(map(str, seeds))}) |",
             "|---|---|---|---|"]
    for optimizer in optimizers:
        losses = [results[optimizer, s] for s in seeds]
        std = statistics.stdev(losses) if len(losses) > 1 else float("nan")
        lines.append(f"| {optimizer} | {statistics.mean(losses):.4f} | {std:.4f} | "
                     f"{', '.join(f'{x:.4f}' for x in losses)} |")
    return "\n".join(lines)


def source_commit():
    """HEAD's hash, marked dirty when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


if __name__ == "__main__":
    main()
