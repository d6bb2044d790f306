"""Compare variants of the cpu preset by final val loss, over seeds.

Each variant is a name and the --key=value overrides that make it; every variant runs
`train_gpt.py --preset cpu <overrides> --seed=S` for every seed (one thread per run,
`--parallel` runs at once). Prints a Markdown table of the mean and sample std of the final val
loss per variant and appends it, with the date, the commit and the command, to
`bench/results/<date>_<machine>.md` (`results_file`). Runs share the cores, so their train times
say nothing about speed: time a variant alone on an idle machine (or with records/make_record.py
from interleaved runs).

    python bench/cpu_comparison.py --seeds 1 2 3 --title "36 vs 40 steps" \\
        --variant 36steps --num_iterations=36 --variant 40steps --num_iterations=40

A run whose log folder (`--out`/<variant>_seed<S>) already holds a finished log of the same
config is not run again, so an interrupted comparison resumes; any other content there stops
the tool before it runs anything (nothing is overwritten).
"""
import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import train_gpt as tg  # noqa: E402
from machinery import config  # noqa: E402
from records.logfile import cpu_model, parse_log  # noqa: E402
from records.significance import welch_test  # noqa: E402
from machinery.config import ConfigError  # noqa: E402


def split_variants(argv):
    """(the tool's own arguments, [(variant name, its overrides)]) from the command line."""
    own, variants = [], []
    for arg in argv:
        if variants and variants[-1][0] is None:
            variants[-1] = (arg, [])
        elif arg == "--variant":
            variants.append((None, []))
        elif variants:
            variants[-1][1].append(arg)
        else:
            own.append(arg)
    if variants and variants[-1][0] is None:
        raise SystemExit("error: --variant needs a name: --variant NAME [--key=value ...]")
    names = [name for name, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"variant names must differ, got {names}")
    return own, variants


def run_config(overrides, seed, log_dir):
    """The run's config as its log will hold it, ConfigError if it cannot be resolved."""
    return tg.logged_config(tg.parse_config(["--preset", "cpu", *overrides, f"--seed={seed}", f"--log_dir={log_dir}"]))


def same_run(a, b):
    """Whether two logged configs train the same run: equal once read back as the trainer reads
    a logged config (a key added since the log was written takes its default, which keeps the
    old behaviour), wherever the log was written."""
    def settings(logged):
        read = config.normalize_config(config.config_from_dict(logged))
        return {k: v for k, v in tg.config_to_dict(read).items() if k != "log_dir"}
    return settings(a) == settings(b)


def finished_log(log_dir, config):
    """The finished log of `config` in log_dir, None if the folder is empty or missing; SystemExit
    if it holds anything else."""
    if not os.path.isdir(log_dir) or not os.listdir(log_dir):
        return None
    logs = [f for f in os.listdir(log_dir) if f.endswith(".txt")]
    if len(logs) == 1:
        log = parse_log(os.path.join(log_dir, logs[0]))
        if log.finished and same_run(log.config, config):
            return log
    raise SystemExit(f"{log_dir} holds something other than one finished run of this variant and seed: "
                     f"move it away or give another --out")


def launch(overrides, seed, log_dir):
    cmd = [sys.executable, os.path.join(REPO, "train_gpt.py"), "--preset", "cpu", *overrides, f"--seed={seed}",
           f"--log_dir={log_dir}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")   # one thread per run: the runs share the cores
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def report(name, seed, log, how):
    print(f"{name} seed {seed}: val_loss {log.final['val_loss']:.4f}{how}", flush=True)
    return log


def run_all(jobs, parallel):
    """Run (name, seed, overrides, log_dir) jobs, `parallel` at a time; return {(name, seed): log}."""
    pending, running, results = list(jobs), [], {}
    while pending or running:
        while pending and len(running) < parallel:
            name, seed, overrides, log_dir = job = pending.pop(0)
            running.append((job, launch(overrides, seed, log_dir)))
        time.sleep(2)
        for job, proc in list(running):
            if proc.poll() is None:
                continue
            running.remove((job, proc))
            name, seed, _, log_dir = job
            if proc.returncode != 0:
                raise SystemExit(f"{name} seed {seed} failed: {proc.stderr.read().strip()[-500:]}")
            (log_name,) = [f for f in os.listdir(log_dir) if f.endswith(".txt")]
            results[name, seed] = report(name, seed, parse_log(os.path.join(log_dir, log_name)), "")
    return results


def results_table(results, variants, seeds):
    """Markdown table: per variant, its overrides, the mean and sample std of the final val loss, and
    the one-sided Welch p-value of its mean being below the first variant's (the baseline)."""
    lines = [f"| variant | overrides of the cpu preset | steps | val loss: mean | std | p (below {variants[0][0]}) | "
             f"runs (seeds {', '.join(map(str, seeds))}) |", "|---|---|---|---|---|---|---|"]
    baseline = [results[variants[0][0], s].final["val_loss"] for s in seeds]
    for name, overrides in variants:
        logs = [results[name, s] for s in seeds]
        losses = [log.final["val_loss"] for log in logs]
        std = statistics.stdev(losses) if len(losses) > 1 else float("nan")
        test = welch_test(losses, baseline) if name != variants[0][0] else None
        p = "" if test is None or test["p"] is None else f"{test['p']:.3g}"
        lines.append(f"| {name} | `{' '.join(overrides) or '(none)'}` | {logs[0].config['num_iterations']} | "
                     f"{statistics.mean(losses):.4f} | {std:.4f} | {p} | {', '.join(f'{x:.4f}' for x in losses)} |")
    return "\n".join(lines)


# /proc/cpuinfo flags of a CPU's widest matrix units, the first found naming it: (flag, its name in a file name)
MATRIX_UNITS = (("amx_bf16", "amx"), ("avx512_bf16", "avx512bf16"), ("avx512f", "avx512"), ("avx2", "avx2"))


def machine_name(model=None, flags=None):
    """This CPU as a file name: "cpu", its model without vendor, trademarks and filler, and its
    widest matrix units: "AMD EPYC 7B13" with avx512_bf16 -> "cpu-epyc-7b13-avx512bf16"."""
    if flags is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
    model = re.sub(r"\((R|TM|r|tm)\)|\b(AMD|Intel|Processor|CPU|unknown)\b|@.*$|\d+-Core", " ",
                   cpu_model() if model is None else model)
    words = re.findall(r"[a-z0-9]+", model.lower())
    units = next((name for flag, name in MATRIX_UNITS if flag in flags), None)
    return "-".join(["cpu", *words, *([units] if units else [])])


def results_file(day=None):
    """bench/results/<day>_<machine>.md: where a measurement made today on this machine goes."""
    day = day or datetime.date.today().isoformat()
    return os.path.join(REPO, "bench", "results", f"{day}_{machine_name()}.md")


def append_section(path, section):
    """Appends a Markdown section (starting with a blank line) to `path`, making its folder, and a
    title line naming the CPU where the file is new."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        if f.tell() == 0:
            f.write(f"# CPU measurements, {datetime.date.today().isoformat()}, {cpu_model()}\n")
        f.write(section)


def source_commit():
    """HEAD's hash, marked dirty when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "HEAD") or "unknown"
    return head + (" (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else "")


def main():
    own, variants = split_variants(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     usage="%(prog)s [options] --variant NAME [--key=value ...] [--variant ...]")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="the seeds each variant runs")
    parser.add_argument("--parallel", type=int, default=2, help="runs at once, one thread each")
    parser.add_argument("--title", default="cpu preset variants", help="what is compared (the section title)")
    parser.add_argument("--out", default=os.path.join(REPO, "logs", "cpu_comparison"),
                        help="the runs' log folders go here, one per variant and seed")
    parser.add_argument("--results", default=results_file(),
                        help="append the table here ('' to skip; default: bench/results/<today>_<machine>.md)")
    args = parser.parse_args(own)
    if not variants:
        raise SystemExit("error: give at least one variant: --variant NAME [--key=value ...] (see --help)")
    commit = source_commit()       # before the runs: the code they run
    jobs, results = [], {}
    for seed in args.seeds:
        for name, overrides in variants:
            log_dir = os.path.join(args.out, f"{name}_seed{seed}")
            try:
                config = run_config(overrides, seed, log_dir)
            except ConfigError as e:
                raise SystemExit(f"variant {name}: {e}") from None
            done = finished_log(log_dir, config)
            if done:
                results[name, seed] = report(name, seed, done, " (finished before, not run again)")
            else:
                jobs.append((name, seed, overrides, log_dir))
    results.update(run_all(jobs, args.parallel))
    table = results_table(results, variants, args.seeds)
    print("\n" + table)
    if args.results:
        append_section(args.results, f"\n## {args.title}, {datetime.date.today().isoformat()}\n\n"
                       f"- commit: {commit}\n- machine: {cpu_model()}, {os.cpu_count()} cores, no GPU, "
                       f"{args.parallel} runs at a time with one thread each\n"
                       f"- command: `python bench/cpu_comparison.py {' '.join(sys.argv[1:])}`\n\n{table}\n")


if __name__ == "__main__":
    main()
