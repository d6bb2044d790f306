"""Which implementation runs each kernel call of a shape: the fastest one this machine has.

kernels.py offers several implementations of some operations (an FP8 GEMM: the persistent
tensor-descriptor kernel with its split-K plans, the pointer-load tile kernel, cuBLAS through
torch._scaled_mm; attention: the one-kernel backward with atomic dQ, the deterministic two-kernel
backward, torch's flex_attention). Each call of such an operation asks `choose(family, key,
candidates)` which one to run, at run time (inside the kernel op, with the real tensors), where
`key` names the call's shape (sizes, dtypes, layouts, window) and `candidates` are the
implementations that can run it, the family's rule first (what runs when nothing is timed).

Modes (`begin_selection`, `end_selection`; a process starts in "rules"):
  rules      every key runs its rule (the first candidate); nothing is timed;
  select     the first call of each key checks every candidate's output against the
             operation's reference (a candidate that disagrees is dropped and says why), times the
             others with `timer` (median ms), and keeps the fastest; with several processes every
             process runs the one rank 0 chose (`agree`, set by the trainer: rank 0's index of
             the candidate list, broadcast). A key first met while a CUDA graph is being captured
             runs its rule untimed (nothing may synchronize there);
  frozen     keys chosen in the selection keep their choice, new keys run their rule; after the
             warm-up, so that nothing is timed on the clock.
A call that names one implementation (the config's fp8_gemm or attention_impl other than
"fastest") does not ask `choose` at all.

Every decision is kept (`decisions()`): the key, the chosen candidate, each candidate's ms or
why it was not timed; the trainer logs them after the warm-up and first contact reports them.
The timer and the agreement are functions, so that tests drive the selection on a CPU with fake
timings.
"""
import contextlib
import dataclasses
import math
import statistics
import time

RULES, SELECT, FROZEN = "rules", "select", "frozen"
# Timing of one candidate on a GPU (triton.testing.do_bench): warm-up and measured milliseconds.
# Short: the warm-up times every candidate of every shape of a run (tens of shapes).
TIMING_WARMUP_MS = 5
TIMING_REP_MS = 25


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One implementation of a call: its name, and a function running it on the call's
    tensors (returns the call's outputs). `triton`: whether it is one of this project's Triton
    kernels (the sm_90 report compiles every such candidate)."""
    name: str
    run: object
    triton: bool = True


@dataclasses.dataclass
class Decision:
    """What `choose` decided for one key: the candidate's name, how ("rule" or "timed"),
    each timed candidate's median ms, and the candidates dropped with their reason."""
    family: str
    key: tuple
    chosen: str
    how: str
    ms: dict = dataclasses.field(default_factory=dict)
    dropped: dict = dataclasses.field(default_factory=dict)

    def line(self):
        """'family key: chosen (how; name ms, ...; dropped name: why)'."""
        parts = [self.how]
        if self.ms:
            parts.append(", ".join(f"{name} {ms:.3f} ms" for name, ms in sorted(self.ms.items(), key=lambda kv: kv[1])))
        parts += [f"dropped {name}: {why}" for name, why in self.dropped.items()]
        return f"{self.family} {describe_key(self.key)}: {self.chosen} ({'; '.join(parts)})"


def describe_key(key):
    return "x".join(str(k) for k in key) if all(isinstance(k, int) for k in key) else " ".join(map(str, key))


@dataclasses.dataclass
class _State:
    mode: str = RULES
    decided: dict = dataclasses.field(default_factory=dict)     # (family, key) -> Decision
    timer: object = None
    agree: object = None
    capturing: object = None
    record_all: bool = False


_STATE = _State()


def cuda_timer(fn):
    """Median ms of fn() on the GPU (triton.testing.do_bench, short: TIMING_*_MS)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=TIMING_WARMUP_MS, rep=TIMING_REP_MS, return_mode="median")


def wall_timer(fn, repeats=3):
    """Median ms of fn() by the wall clock (a CPU: the interpreter's kernels, for tests)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def _is_capturing():
    if _STATE.capturing is not None:
        return _STATE.capturing()
    try:
        import torch
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except RuntimeError:
        return False


def begin_selection(timer=None, agree=None, capturing=None):
    """Time the candidates of each key at its first call from now on (see the module docstring).
    timer(fn) -> ms (default: cuda_timer); agree(index) -> rank 0's index (default: this
    process's own); capturing() -> whether a CUDA graph is being captured."""
    _STATE.mode = SELECT
    _STATE.timer = timer or cuda_timer
    _STATE.agree = agree
    _STATE.capturing = capturing


def end_selection():
    """Keep every choice made; new keys run their rule, untimed."""
    _STATE.mode = FROZEN


def reset():
    """Forget every choice; back to the rules (tests, and a new run in one process)."""
    global _STATE
    _STATE = _State()


def mode():
    return _STATE.mode


def decisions():
    """Every Decision made, in the order the keys were first met."""
    return list(_STATE.decided.values())


def choice_of(family, key):
    """The name chosen for (family, key), or None when the key has not been met."""
    decision = _STATE.decided.get((family, key))
    return decision.chosen if decision else None


@contextlib.contextmanager
def every_candidate():
    """Within: every call also runs each of its Triton candidates (then the rule's): how the sm_90
    report records every kernel variant a run could choose."""
    before = _STATE.record_all
    _STATE.record_all = True
    try:
        yield
    finally:
        _STATE.record_all = before


def choose(family, key, candidates, check=None):
    """The candidate to run for one call (see the module docstring). candidates: [Candidate],
    the rule first. check(outputs) -> None when a candidate's outputs agree with the
    reference, else the reason they do not (called in the selection only)."""
    if not candidates:
        raise ValueError(f"{family}: no implementation can run {describe_key(key)}")
    by_name = {c.name: c for c in candidates}
    if _STATE.record_all:
        for c in candidates[1:]:
            if c.triton:
                c.run()
        return candidates[0]
    known = _STATE.decided.get((family, key))
    if known is not None and known.chosen in by_name:
        return by_name[known.chosen]
    if _STATE.mode != SELECT or len(candidates) == 1 or _is_capturing():
        _keep(Decision(family, key, candidates[0].name, "rule"))
        return candidates[0]
    decision = Decision(family, key, candidates[0].name, "timed")
    timed = []
    for c in candidates:
        why = _failure(c, check)
        if why:
            decision.dropped[c.name] = why
            continue
        decision.ms[c.name] = _STATE.timer(c.run)
        timed.append(c)
    index = min(range(len(timed)), key=lambda i: decision.ms[timed[i].name]) if timed else -1
    index = _agreed(candidates, timed, index)
    decision.chosen = candidates[index].name if index >= 0 else candidates[0].name
    _keep(decision)
    return by_name[decision.chosen]


def _failure(candidate, check):
    """Why a candidate cannot run or disagrees with the reference, or None."""
    try:
        outputs = candidate.run()
    except Exception as e:      # noqa: BLE001 - an implementation this machine cannot run is skipped, and says why
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
    return check(outputs) if check is not None else None


def _agreed(candidates, timed, index):
    """Rank 0's choice as an index into `candidates` (this process's own without an agreement)."""
    mine = candidates.index(timed[index]) if index >= 0 else -1
    return _STATE.agree(mine) if _STATE.agree is not None else mine


def _keep(decision):
    _STATE.decided.setdefault((decision.family, decision.key), decision)


def relative_error(ours, reference):
    """||ours - reference|| / ||reference|| in float64 (0 for two zero tensors)."""
    ours, reference = ours.double(), reference.double()
    norm = float(reference.norm())
    diff = float((ours - reference).norm())
    return diff / norm if norm > 0 else (0.0 if diff == 0 else math.inf)


def agreement_check(reference, tolerance, what="outputs"):
    """check(outputs) for choose: every output within `tolerance` relative error of `reference`
    (a tensor or a tuple of tensors, compared in order)."""
    references = reference if isinstance(reference, (tuple, list)) else (reference,)

    def check(outputs):
        outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        for i, (ours, ref) in enumerate(zip(outputs, references)):
            error = relative_error(ours, ref)
            if not error <= tolerance:
                return f"{what}[{i}] differs from the reference by {error:.2e} (> {tolerance:.0e})"
        return None
    return check


# -- a training run's selection (train_gpt.py calls these around its warm-up)

LOG_PREFIX = "kernel choice: "     # starts each line run_lines writes


def start_run(device, selecting):
    """Forget earlier choices; with `selecting` on a CUDA device, time the candidates of each key
    from now on, every process taking rank 0's choice (a broadcast of its index, when
    torch.distributed runs several processes)."""
    reset()
    if not selecting or device.type != "cuda":
        return
    import torch
    import torch.distributed as dist

    def agree(index):
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return index
        chosen = torch.tensor([index], dtype=torch.int64, device=device)
        dist.broadcast(chosen, src=0)
        return int(chosen.item())
    begin_selection(cuda_timer, agree)


def end_run():
    """The selection is over (the warm-up's end): keep the choices; returns run_lines()."""
    if _STATE.mode == SELECT:
        end_selection()
    return run_lines()


def run_lines():
    """One log line per decision, then a summary (how many keys were timed, ruled)."""
    found = decisions()
    timed = sum(d.how == "timed" for d in found)
    lines = [LOG_PREFIX + d.line() for d in found]
    if found:
        lines.append(f"{LOG_PREFIX}{len(found)} shapes: {timed} timed in the warm-up, {len(found) - timed} by rule")
    return lines


def lazy_check(reference, tolerance, what="outputs"):
    """agreement_check against reference() (called once, at the first check: a key whose
    candidates are not timed computes no reference)."""
    found = []

    def check(outputs):
        if not found:
            found.append(agreement_check(reference(), tolerance, what))
        return found[0](outputs)
    return check
