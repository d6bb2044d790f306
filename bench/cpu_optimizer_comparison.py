"""Compare the matrix optimizers on the CPU track at an equal number of steps.

Runs `train_gpt.py --preset cpu --optimizer=X --seed=S` for every optimizer and seed (one
thread per run, `--parallel` runs at once), reads each log's final val loss, and prints a
Markdown table of mean and sample std per optimizer. Everything else is the cpu preset, so
the comparison is at equal steps and equal tokens, not at equal wall time.

    python bench/cpu_optimizer_comparison.py --steps 120 --seeds 0 1 2 --parallel 2
"""
import argparse
import os
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
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS))
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "logs", "optimizer_comparison"))
    parser.add_argument("extra", nargs="*", help="more --key=value overrides for every run")
    args = parser.parse_args()
    jobs = []
    for seed in args.seeds:
        for optimizer in args.optimizers:
            log_dir = os.path.join(args.out, f"{optimizer}_seed{seed}")
            os.makedirs(log_dir, exist_ok=False)
            jobs.append((optimizer, seed, args.steps, log_dir, args.extra))
    results = run_all(jobs, args.parallel)
    print(f"\n| optimizer | val loss at {args.steps} steps: mean | std | runs |\n|---|---|---|---|")
    for optimizer in args.optimizers:
        losses = [results[optimizer, s] for s in args.seeds]
        std = statistics.stdev(losses) if len(losses) > 1 else float("nan")
        print(f"| {optimizer} | {statistics.mean(losses):.4f} | {std:.4f} | "
              f"{', '.join(f'{x:.4f}' for x in losses)} |")


if __name__ == "__main__":
    main()
