"""The statistics a record is judged by: summaries of its runs, the one-sided t-tests (a mean
below the track's target; a record's mean below its baseline's), and the public optimization
track's two statistics (the margin of n runs below the target, the pairwise comparison of two
records a number of steps apart)."""
import math
import warnings

import numpy as np
from scipy import stats


def finite_or_none(x):
    x = float(x)
    return x if math.isfinite(x) else None


def t_test_applicable(*samples):
    """A t-test needs two or more values per sample and a nonzero standard error (some spread somewhere)."""
    return all(len(s) >= 2 for s in samples) and any(np.ptp(s) > 0 for s in samples)


def summary(values):
    return {
        "values": list(values),
        "mean": float(np.mean(values)),
        "median": float(np.median(values)),
        "min": float(np.min(values)),
        "max": float(np.max(values)),
    }


def val_loss_summary(values):
    return {
        "values": list(values),
        "mean": float(np.mean(values)),
        "std": float(np.std(values, ddof=1)) if len(values) > 1 else None,
    }


def one_sample_test(values, target):
    """One-sided one-sample t-test of H1: mean(values) < target; (t, p), or (None, None) when undefined."""
    if target is None or not t_test_applicable(values):
        return None, None
    result = stats.ttest_1samp(values, target, alternative="less")
    return finite_or_none(result.statistic), finite_or_none(result.pvalue)


def welch_test(record, baseline):
    """One-sided Welch t-test of H1: mean(record) < mean(baseline); a dict, or None when undefined."""
    if not t_test_applicable(record, baseline):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = stats.ttest_ind(record, baseline, equal_var=False, alternative="less")
    return {
        "alternative": "record mean < baseline mean",
        "t": finite_or_none(result.statistic),
        "p": finite_or_none(result.pvalue),
    }


def margin_statistic(values, target):
    """The public optimization track's significance statistic: (target - mean) x sqrt(n)."""
    return (target - float(np.mean(values))) * math.sqrt(len(values))


def pairwise_statistic(new, old, loss_per_step):
    """The public optimization track's pairwise statistic of record `new` over record `old`:
    (old mean - new mean + (old steps - new steps) x loss_per_step) / sqrt(1 / n_old + 1 / n_new)."""
    gain = old["val_loss"]["mean"] - new["val_loss"]["mean"] + (old["steps"] - new["steps"]) * loss_per_step
    return gain / math.sqrt(1 / old["n"] + 1 / new["n"])


MAX_RUNS_ESTIMATED = 1000          # runs_needed and welch_runs_needed look no further


def runs_needed(values, target, threshold):
    """The fewest runs whose one-sided t-test of H1: mean < target reaches p < threshold if more runs
    kept this mean and sample std; None when the mean is not below the target, the runs have no
    spread, or more than MAX_RUNS_ESTIMATED would be needed."""
    mean, std = float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
    if not mean < target or not std > 0:
        return None
    for n in range(2, MAX_RUNS_ESTIMATED + 1):
        if stats.t.cdf((mean - target) / (std / math.sqrt(n)), n - 1) < threshold:
            return n
    return None


def welch_runs_needed(record, other, threshold):
    """The fewest runs per group whose one-sided Welch t-test of H1: mean(record) < mean(other)
    reaches p < threshold if both groups kept their means and sample stds; None when the record's
    mean is not below the other's, a group has fewer than 2 runs or neither has spread, or more than
    MAX_RUNS_ESTIMATED would be needed."""
    if len(record) < 2 or len(other) < 2 or not np.mean(record) < np.mean(other):
        return None
    v1, v2 = float(np.var(record, ddof=1)), float(np.var(other, ddof=1))
    if not v1 + v2 > 0:
        return None
    gap = float(np.mean(other) - np.mean(record))
    for n in range(2, MAX_RUNS_ESTIMATED + 1):
        se2 = (v1 + v2) / n
        df = se2 ** 2 / ((v1 / n) ** 2 / (n - 1) + (v2 / n) ** 2 / (n - 1))
        if stats.t.cdf(-gap / math.sqrt(se2), df) < threshold:
            return n
    return None
