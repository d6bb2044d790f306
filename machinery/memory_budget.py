"""What a run needs in memory, and where it fits.

memory_budget(h, world_size) counts, from the shapes alone, the bytes each process's GPU and the
host hold for a run: named items (parameters, gradients, optimizer state, the n-gram table, ...)
plus one training step's and one validation's peak, measured by running them on fake tensors
(no memory, no compute). check_memory refuses a run that does not fit with one line naming what
shrinks each item; launch_plan picks what run.sh starts on a machine's GPUs: the largest
configuration that fits (n-gram table size, where it lives, micro-batches). Each takes the
recipe it measures (`recipe`: the training script's module, train_gpt), whose model, step,
optimizers and config parser it runs; this module never imports it.
"""
import dataclasses
import functools
import json
import math
import sys
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import optim
from data.loader import check_validation_split
from machinery.canonical_mask import NoncanonicalPairs
from machinery.config import (MAX_TARGETS, MIN_DOC_TOKENS, PADDED_VOCAB_SIZE, ArgumentParser, ConfigError,
                              config_from_dict, config_to_dict, normalize_config)
from machinery.cuda_graphs import MicroBatch
from machinery.processes import ProcessGroup
from machinery.sparse_tables import (NGRAM_ROW_STATE_BYTES, available_memory_bytes, check_ngram_table, ngram_event_rows,
                                     ngram_row_bytes)
from records.logfile import track_target

# Allowances, not measurements (no GPU run yet):
MEMORY_MARGIN_BYTES = 3 * 2**30    # a GPU's memory beside the budget's items: the CUDA context, cuBLAS, NCCL
MEMORY_MARGIN_FRACTION = 0.05      # and this share of the GPU: the caching allocator's rounding and fragmentation
HOST_MARGIN_BYTES = 16 * 2**30     # host memory beside a host table: the processes, the data shards, the OS
MANTISSA_BYTES = 2                 # the optimizers' sidecar per bf16 weight: its fp32 master's low 16 bits
# What shrinks each item, for a refusal to name.
BUDGET_SETTINGS = {
    "n-gram table": "--ngram_rows or --ngram_cache_rows, or more processes to split the table",
    "pending n-gram gradients": "the longest cadence (--ngram_step_every, --table_phases) or the stages' tokens_per_rank",
    "step": "the stages' tokens_per_rank (or candidates)",
    "n-gram table (host)": "--ngram_rows",
}


@dataclass
class MemoryBudget:
    """The bytes a run needs on each process's GPU and in the host's memory, by item, from the
    shapes alone (memory_budget), so that a run that cannot fit is refused before anything large
    is allocated.

    Held on the GPU for the whole run:
      parameters, buffers      the model's (but the n-gram table, its gathered rows, the mask)
      gradients                one per trained parameter, for the whole run (StepGraphs)
      optimizer state          Adam's moments of this process's rows, its update's two scratch
                               buffers per shape (and its summed gradients with several processes
                               and CUDA graphs); the Muon family's momentum (ANVIL: two rails),
                               lane moments and banks (stacked gradients, new values)
      weight averages          the end-of-training EMAs (fp32)
      n-gram table             this device's rows (all, a shard, or a host table's cache) and
                               their sparse Adam state (NGRAM_ROW_STATE_BYTES a row)
      n-gram rows in flight    a split table's gathered rows (`fetched`) and every table's slots
      gradient sinks           values and gradients, max_tokens rows
      value tables' sums       the sparse value-embedding tables' row sums and sparse Adam state
      pending n-gram gradients RowGradientSums: ngram_event_rows fp32 rows and their maps
      canonical mask           the validation's bit matrix
    The step: one micro-batch's forward and backward at the stage where it makes the most
    (activations, the logits and their gradient, the backward's transients; each distinct
    stage's step measured by a dry run, largest_stage); with CUDA graphs it
    stays held in their pool (the warm-up runs every stage's eager steps before it captures any,
    so no eager step runs beside the pool), else it is freed after each backward. Never at once,
    and not during a step: the table update (per micro-batch, its entries summed per row and grouped,
    and a split table's rows and gradients on their way; per event, the value tables' touched
    rows) and a validation forward (validation_memory). Then the margin: MEMORY_MARGIN_BYTES
    and MEMORY_MARGIN_FRACTION of the GPU.

    In host memory, with the table there: the table and its row state, pinned (the CUDA host
    allocator rounds each block up to a power of two), the row-to-slot map, the cache's slot
    bookkeeping, and HOST_MARGIN_BYTES."""
    device: dict                   # held item -> bytes
    passing: dict                  # item -> bytes, one at a time
    step: int
    logits: int                    # of the step, at its peak
    graphs: bool                   # the step stays in the CUDA-graph pool
    host: dict = field(default_factory=dict)

    def device_total(self, gpu_bytes):
        held = sum(self.device.values()) + (self.step if self.graphs else 0)
        passing = max([*self.passing.values(), 0 if self.graphs else self.step])
        return held + passing + MEMORY_MARGIN_BYTES + MEMORY_MARGIN_FRACTION * gpu_bytes

    def host_total(self):
        return sum(self.host.values()) + HOST_MARGIN_BYTES if self.host else 0

    @staticmethod
    def refusal(what, needed, available, items):
        """The one line that refuses the run: what it needs, what there is, its largest items."""
        largest = sorted(items.items(), key=lambda item: -item[1])[:3]
        named = ", ".join(f"{name} {size / 2**30:.1f}" + (f" ({BUDGET_SETTINGS[name]})" if name in BUDGET_SETTINGS
                                                         else "") for name, size in largest)
        return (f"the run needs {needed / 2**30:.1f} GiB of {what}, {available / 2**30:.1f} GiB are there; "
                f"its largest items (GiB): {named}: lower one of those")

    def check(self, gpu_bytes, host_bytes):
        """None, or the refusal of a run on a GPU of gpu_bytes with host_bytes of host memory
        (either None: not checked)."""
        needed = self.device_total(gpu_bytes or 0)
        if gpu_bytes is not None and needed > gpu_bytes:
            return self.refusal("memory on each GPU", needed, gpu_bytes,
                                {**self.device, **self.passing, "step": self.step})
        if host_bytes is not None and self.host and self.host_total() > host_bytes:
            return self.refusal("host memory", self.host_total(), host_bytes, self.host)
        return None

    def summary(self, gpu_bytes):
        return f"{self.device_total(gpu_bytes) / 2**30:.1f} of {gpu_bytes / 2**30:.1f} GiB"


def pinned_bytes(nbytes):
    """What pinning `nbytes` of host memory takes: the CUDA host allocator's power of two."""
    return 1 << max(nbytes - 1, 0).bit_length()


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the ops under it make while they are alive, and their peak;
    `logits` counts those of 2-d tensors `logits_width` wide (the head's), at that peak. The
    storages of `existing` tensors (parameters, gradients, buffers) are not counted."""

    def __init__(self, logits_width, existing=()):
        super().__init__()
        self.live = self.peak = self.logits = self.peak_logits = 0
        self.width, self.seen = logits_width, {id(t.untyped_storage()) for t in existing}

    def _free(self, key, nbytes, logits):
        self.seen.discard(key)
        self.live -= nbytes
        self.logits -= nbytes if logits else 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.seen:
                storage, logits = t.untyped_storage(), t.ndim == 2 and t.shape[-1] == self.width
                self.seen.add(id(storage))
                self.live += storage.nbytes()
                self.logits += storage.nbytes() if logits else 0
                weakref.finalize(storage, self._free, id(storage), storage.nbytes(), logits)
        if self.live > self.peak:
            self.peak, self.peak_logits = self.live, self.logits
        return out


def distinct_stages(h, recipe):
    """The first index of each stage that has steps and whose step differs from every earlier
    one's in more than its schedule (the end and the LR multiplier change no tensor)."""
    seen, firsts = [], []
    for index, (stage, steps) in enumerate(zip(h.stages, recipe.steps_per_stage(h))):
        key = dataclasses.replace(stage, end=1.0, lr_mult=1.0)
        if steps and key not in seen:
            seen.append(key)
            firsts.append(index)
    return firsts


def largest_stage(recipe, h):
    """The index of the stage whose training step makes the most memory, every distinct stage's
    step measured (stage_memory). Tokens times head width does not rank them: every activation
    grows with the tokens alone, so the speedrun's 49,152 tokens x 24,576 candidates peak above
    its 32,768 x 50,304."""
    config_json = dry_run_key(h)
    return max(distinct_stages(h, recipe), key=lambda index: stage_memory(recipe, config_json, index)[0])


def fake_model(recipe, h):
    """The run's model on fake tensors (shapes without memory) with the Triton kernels' functions,
    its n-gram table whole; no canonical mask (validation_memory fakes one)."""
    fns = recipe.select_kernels(dataclasses.replace(h, kernels="auto"), torch.device("cuda"))
    cfg = dataclasses.replace(recipe.model_config(h), canonical_mask=False)
    return recipe.GPT(cfg, fns, recipe.max_positions(h))


def dry_run(recipe, h, run):
    """run(model) on the fake model, under a LiveBytes of the head's width and h's autocast, with
    the global random state left as it was: (its LiveBytes, the model)."""
    with torch.random.fork_rng(devices=[]), torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(recipe, h)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.compute_dtype == "bfloat16")
        tracker = run(model, autocast)
    return tracker, model


# Keys that do not change what the dry runs count (the table's placement: they run it whole).
DRY_RUN_FREE_KEYS = ("preset", "track", "seed", "ngram_cache_rows", "train_files", "val_files", "log_dir", "log_every",
                     "save_checkpoint", "sync_check")


NGRAM_DRY_RUN_ROWS = 4             # the dry runs' n-gram table, whatever its rows: a step's tensors never scale with them


def dry_run_key(h):
    """The config the dry runs read, as JSON: h but the keys they do not count, and any n-gram
    table at NGRAM_DRY_RUN_ROWS rows (a step gathers and updates rows per token, never per row
    of the table), so that the plans that differ only there share one dry run."""
    d = {k: v for k, v in config_to_dict(h).items() if k not in DRY_RUN_FREE_KEYS}
    d["ngram_rows"] = min(d["ngram_rows"], NGRAM_DRY_RUN_ROWS)
    return json.dumps(d, sort_keys=True)


def step_memory(recipe, config_json):
    """(peak bytes, logits bytes at the peak) of one micro-batch's forward and backward at the
    stage whose step makes the most (largest_stage)."""
    h = normalize_config(config_from_dict(json.loads(config_json)))
    return stage_memory(recipe, config_json, largest_stage(recipe, h))


@functools.lru_cache(maxsize=128)
def stage_memory(recipe, config_json, index):
    """(peak bytes, logits bytes at the peak) of one micro-batch's forward and backward at the
    first step of stage `index`, with the Triton kernels: the tensors it makes, alive at once at
    its peak, counted on fake tensors (no memory, no compute). The parameters and their
    gradients exist before it (the budget counts them apart), as in a run after its first step.
    The eager step: a compiled one fuses ops and may keep less."""
    h = normalize_config(config_from_dict(json.loads(config_json)))
    stage, step = h.stages[index], sum(recipe.steps_per_stage(h)[:index])   # the stage and its first step

    def run(model, autocast):
        recipe.model_at(model, h, step)
        T = stage.tokens_per_rank
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if p.requires_grad else None
        batch = MicroBatch.zeros(stage)
        with model.sinks_of(T):
            existing = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()
                                                                 if p.grad is not None)]
            tracker = LiveBytes(stage.candidates or PADDED_VOCAB_SIZE, existing)
            with tracker, autocast:
                objective, _ = recipe.micro_batch_losses(model, stage, recipe.attention_windows(h, step), batch,
                                                         recipe.target_weights(stage, "cpu"))
                objective.backward()
        return tracker
    tracker, _ = dry_run(recipe, h, run)
    return tracker.peak, tracker.peak_logits


@functools.lru_cache(maxsize=32)
def validation_memory(recipe, config_json):
    """Peak bytes of a final validation forward of one slice (val_tokens_per_rank tokens, the
    canonical mask if on), counted as stage_memory counts."""
    h = normalize_config(config_from_dict(json.loads(config_json)))

    def run(model, autocast):
        if h.canonical_mask:       # its bits' shape, not GPT-2's pairs
            model.canonical_mask = mask = NoncanonicalPairs.__new__(NoncanonicalPairs)
            nn.Module.__init__(mask)
            mask.register_buffer("bits", torch.zeros(PADDED_VOCAB_SIZE, PADDED_VOCAB_SIZE // 8, dtype=torch.uint8))
            mask.register_buffer("bit_values", 1 << torch.arange(8, dtype=torch.uint8))
        model.eval()
        recipe.model_at(model, h, h.num_iterations, final_validation=True)
        T = h.val_tokens_per_rank
        args = recipe.Trainer.attention_args(torch.zeros(T // MIN_DOC_TOKENS + 2, dtype=torch.int32),
                                             recipe.attention_windows(h, h.num_iterations, final_validation=True))
        tracker = LiveBytes(PADDED_VOCAB_SIZE, [*model.parameters(), *model.buffers()])
        with tracker, autocast, torch.no_grad():
            model.validation_loss_sum(torch.zeros(T, dtype=torch.int32), torch.zeros(T, MAX_TARGETS - 1,
                                                                                     dtype=torch.int64), args)
        return tracker
    return dry_run(recipe, h, run)[0].peak


def optimizer_bytes(recipe, h, model, world_size):
    """Bytes of the optimizers' state for the model (fake tensors will do), as train_gpt.build_optimizers
    makes them and their first steps fill them in: see MemoryBudget."""
    optimizers = recipe.build_optimizers(h, model, recipe.KernelFns(None, None), run_bank=None)
    total = 0
    for opt in optimizers:
        params = [p for group in opt.param_groups for p in group["params"]]
        if isinstance(opt, optim.Adam):
            sharded = {p: optim.shards_rows(p, world_size) for p in params}
            mine = {p: (p.shape[0] // world_size, *p.shape[1:]) if sharded[p] else tuple(p.shape) for p in params}
            total += 2 * 4 * sum(math.prod(shape) for shape in mine.values())  # exp_avg, exp_avg_sq of its rows
            total += 2 * 4 * sum(math.prod(shape) for shape in set(mine.values()))  # the update's scratch pair
            total += sum(MANTISSA_BYTES * math.prod(mine[p]) for p in params if p.dtype == torch.bfloat16)
            if world_size > 1 and h.cuda_graphs:                  # the summed gradients at fixed addresses
                total += sum(p.element_size() * math.prod(mine[p]) for p in params)
            continue
        rails = 2 if h.optimizer == "anvil" else 1
        for (dtype, _), (size, _) in opt.layout(world_size).buckets.items():   # the busiest rank's matrices
            total += size * (rails * 4 + (MANTISSA_BYTES if dtype == torch.bfloat16 else 0))
        for group in opt.param_groups:
            for p in group["params"]:
                if group["equalize"]:                             # one second moment per lane of each block
                    total += 4 * sum(max(rows, p.shape[1]) for rows in group.get("row_splits") or (p.shape[0],))
        for (dtype, _), (size, _) in opt.layout(world_size).buckets.items():   # every rank's shares, and its own
            total += dtype.itemsize * size * (world_size + (world_size > 1))
    return total


def memory_budget(recipe, h, world_size):
    """The MemoryBudget of h on world_size processes (one GPU each)."""
    config_json = dry_run_key(h)
    step, logits = step_memory(recipe, config_json)
    with torch.random.fork_rng(devices=[]), torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(recipe, h)
        sinks = model.gradient_sinks()
        params = [p for p in model.parameters() if all(p is not s for s in sinks)]
        table_buffers = {"ngram.table", "ngram.fetched", "ngram.slots"}
        device = {
            "parameters": sum(p.nbytes for p in params),
            "buffers": sum(b.nbytes for name, b in model.named_buffers() if name not in table_buffers),
            "gradients": sum(p.nbytes for p in params if p.requires_grad),
            "optimizer state": optimizer_bytes(recipe, h, model, world_size),
            "weight averages": sum(4 * w.numel() for a in h.averages
                                   for _, w in model.averaged_pieces(a.params)),
            "gradient sinks": 2 * sum(s.nbytes for s in sinks),
        }
        value_widths = [ve.embedding_dim for ve in model.value_embeds] if model.value_sinks is not None else []
    D, passing = h.model_dim, {}
    longest, tokens = max(s.tokens_per_rank for s in h.stages), recipe.max_positions(h)
    device["value tables' sums"] = sum(4 * PADDED_VOCAB_SIZE * w + NGRAM_ROW_STATE_BYTES * PADDED_VOCAB_SIZE
                                       for w in value_widths)
    passing["table update"] = sum(2 * 4 * PADDED_VOCAB_SIZE * w for w in value_widths)   # the touched rows' sums
    host = {}
    if h.ngram_rows:
        cache, dtype_bytes = h.ngram_cache_rows, getattr(torch, h.ngram_dtype).itemsize
        rows = cache or h.ngram_rows // world_size
        split = world_size > 1 and not cache
        capacity = ngram_event_rows(h, world_size)
        device["n-gram table"] = rows * ngram_row_bytes(h)
        if split or cache:     # the slots of a slice's rows; split, the rows gathered for it
            device["n-gram rows in flight"] = 8 * 2 * tokens + (2 * tokens * D * dtype_bytes if split else 0)
        device["pending n-gram gradients"] = (capacity + 1) * (4 * D + 8) + 4 * (rows + 1) + 8
        # per micro-batch: its entries summed per row and their grouping (7 int64 vectors); split:
        # every process's asks of this one, the rows sent, the gradients received and sent
        entries = 2 * longest * (world_size if split else 1)
        update = entries * (4 * D + 7 * 8)
        if split:
            update += entries * (dtype_bytes * D + 4 * D) + 2 * longest * (4 * D + 7 * 8)
        passing["table update"] = max(passing["table update"], update)
        if cache:
            host = {"n-gram table (host)": pinned_bytes(h.ngram_rows * D * dtype_bytes),
                    "n-gram row state (host)": 2 * pinned_bytes(4 * h.ngram_rows) + 4 * h.ngram_rows,
                    "n-gram cache slots (host)": cache * (8 + 8 + 1)}
    if h.canonical_mask:
        device["canonical mask"] = PADDED_VOCAB_SIZE * PADDED_VOCAB_SIZE // 8
    passing["validation"] = validation_memory(recipe, config_json)
    return MemoryBudget(device, passing, step, logits, h.cuda_graphs, host)


CPU_RUNTIME_BYTES = 2**30          # on a CPU, in place of MEMORY_MARGIN_BYTES: the Python process and torch's runtime


def check_memory(recipe, h, pg, available=None):
    """Refuse, before anything large is allocated, a run whose MemoryBudget does not fit this
    process's GPU (its free memory) or, with the table in host memory, the host's; on a CPU, the
    host's available memory, which then holds what a GPU would and the host table too (with
    CPU_RUNTIME_BYTES for both margins). `available`: device -> free bytes (available_memory_bytes)."""
    available = available or available_memory_bytes
    if pg.device.type == "cpu":
        try:
            budget = memory_budget(recipe, h, pg.world_size)
        except (ValueError, RuntimeError):   # a shape the dry run's GPU kernels refuse (a head dim of 8),
            return check_cpu_weights(recipe, h, available(pg.device))  # which the CPU's reference path runs
        free = available(pg.device)
        needed = budget.device_total(free or 0) - MEMORY_MARGIN_BYTES + CPU_RUNTIME_BYTES + sum(budget.host.values())
        if free is not None and needed > free:
            raise ConfigError(budget.refusal("memory (the run computes on the CPU)", needed, free,
                                             {**budget.device, **budget.passing, "step": budget.step, **budget.host}))
        return budget
    budget = memory_budget(recipe, h, pg.world_size)
    refusal = budget.check(available(pg.device), available(torch.device("cpu")) if budget.host else None)
    if refusal:
        raise ConfigError(refusal)
    return budget


def check_cpu_weights(recipe, h, free):
    """Where the step cannot be priced, the weights still can (on fake tensors): refuse, before
    anything is allocated, a CPU run whose parameters, buffers and gradients alone (with
    CPU_RUNTIME_BYTES) exceed the `free` bytes. No budget (None) either way."""
    with torch.random.fork_rng(devices=[]), torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
        model = fake_model(recipe, h)
        items = {"parameters": sum(p.nbytes for p in model.parameters()),
                 "buffers": sum(b.nbytes for b in model.buffers()),
                 "gradients": sum(p.nbytes for p in model.parameters() if p.requires_grad)}
    needed = sum(items.values()) + CPU_RUNTIME_BYTES
    if free is not None and needed > free:
        raise ConfigError(MemoryBudget.refusal("memory (the run computes on the CPU; its weights alone)", needed, free,
                                               items))
    return None


PLAN_KEYS = ("--ngram_rows", "--batch_ranks", "--stages", "--val_tokens_per_rank")  # the levers; one the user sets stays
# The public table-size test of record 92 on 8xH100 (n-gram rows: train time in s, val loss low
# and high over its runs): what a smaller table costs.
PUBLIC_TABLE_SIZES = {84_602_880: (39.52, 3.2791, 3.2791), 21_150_720: (39.35, 3.2825, 3.2863),
                      377_280: (39.00, 3.3149, 3.3149)}


@dataclass
class Candidate:
    """A configuration launch_plan may start: the preset arguments, the process count, and
    what it keeps and gives up, in words."""
    args: tuple
    processes: int
    rows: int                      # of the n-gram table (0: none)
    where: str                     # where the table lives
    split: int                     # micro-batches per slice of the global batch


def table_sizes(h, floor_rows):
    """The n-gram table sizes the planner tries, largest first: h's, halved while the half stays
    above floor_rows (record 89's bigram table's size) and a multiple of 16 (two halves, bigrams
    and trigrams, that split evenly across 8 processes), then floor_rows."""
    sizes, rows = [h.ngram_rows], h.ngram_rows
    while rows // 2 > floor_rows and (rows // 2) % 16 == 0:
        rows //= 2
        sizes.append(rows)
    return sizes + [floor_rows] if h.ngram_rows > floor_rows else sizes


def stages_argument(stages):
    """--stages=JSON of `stages`, each with the keys whose values are not a Stage's defaults,
    without spaces (one word for run.sh)."""
    from machinery.config import Stage
    defaults = {f.name: f.default for f in dataclasses.fields(Stage)}
    kept = [{k: v for k, v in dataclasses.asdict(s).items() if k not in defaults or v != defaults[k]} for s in stages]
    return "--stages=" + json.dumps(kept, separators=(",", ":"))


def plan_candidates(recipe, gpus, argv):
    """Every configuration launch_plan tries on `gpus` GPUs, in its order of preference: for each
    n-gram table size (table_sizes: the largest first, what decides the val loss), where the
    table lives (the fastest first: split across 8 GPUs in the speedrun preset, across fewer in
    the 1gpu preset, whole on one GPU, in host memory), then micro-batches (micro_batch_splits:
    the fewest first)."""
    base = recipe.parse_config(["--preset", "1gpu", *argv])
    fixed = {key for key in PLAN_KEYS for a in argv if a.split("=")[0] == key}
    floor_rows = recipe.parse_config(["--preset", "record89"]).bigram_rows
    sizes = [base.ngram_rows] if "--ngram_rows" in fixed or not base.ngram_rows else table_sizes(base, floor_rows)
    splits = [1] if fixed & {"--batch_ranks", "--stages", "--val_tokens_per_rank"} else micro_batch_splits(base)
    for rows in sizes:
        rows_args = () if rows == base.ngram_rows else (f"--ngram_rows={rows}",)
        places = [(("--preset", "speedrun"), 8, "split across the 8 GPUs")] if gpus >= 8 else []
        places += [(("--preset", "1gpu", "--ngram_cache_rows=0"), n, f"split across the {n} GPUs")
                   for n in range(min(gpus, base.batch_ranks - 1), 1, -1) if base.batch_ranks % n == 0]
        places += [(("--preset", "1gpu", "--ngram_cache_rows=0"), 1, "whole on the GPU")]
        if rows > base.ngram_cache_rows:
            places += [(("--preset", "1gpu"), 1, "in host memory, its rows cached on the GPU")]
        for args, n, where in places:
            for k in splits:
                split = split_micro_batches(recipe.parse_config([*args, *argv]), k)
                split_args = () if k == 1 else (f"--batch_ranks={split.batch_ranks}", stages_argument(split.stages),
                                                f"--val_tokens_per_rank={split.val_tokens_per_rank}")
                yield Candidate((*args, *rows_args, *split_args), n, rows, where, k)


def millions(rows):
    return f"{rows / 1e6:.2f}M" if rows >= 1e6 else f"{rows / 1e3:.0f}k"


def table_cost(rows):
    """What an n-gram table of `rows` rows costs by PUBLIC_TABLE_SIZES, in words: its measured
    val loss and time, or the measured sizes it lies between."""
    def measured(r):
        time_s, low, high = PUBLIC_TABLE_SIZES[r]
        return f"{millions(r)} rows val {low:.4f}" + (f"-{high:.4f}" if high != low else "") + f" in {time_s:.2f} s"
    record = max(PUBLIC_TABLE_SIZES)
    if rows in PUBLIC_TABLE_SIZES:
        said = measured(rows) + ("" if rows == record else f" (the record's {millions(record)}: "
                                 f"{PUBLIC_TABLE_SIZES[record][1]:.4f} in {PUBLIC_TABLE_SIZES[record][0]:.2f} s)")
    else:
        above = min(r for r in PUBLIC_TABLE_SIZES if r > rows)
        below = max([r for r in PUBLIC_TABLE_SIZES if r < rows], default=min(PUBLIC_TABLE_SIZES))
        said = f"between {measured(above)} and {measured(below)}"
    low = min(PUBLIC_TABLE_SIZES[r][1] for r in PUBLIC_TABLE_SIZES if r <= rows) if rows < record else None
    target = track_target("track_1_short")     # the test was of that track's record
    missed = f": above the {target:g} target" if low is not None and target is not None and low > target else ""
    return f"by the public table-size test on 8xH100, {said}{missed}"


def describe(candidate, h, record_rows, floor_rows):
    """What `candidate` keeps and gives up, for the plan's line."""
    if not candidate.rows:
        table = "no n-gram table"
    else:
        share = "the record's" if candidate.rows == record_rows else (
            f"1/{record_rows // candidate.rows} of the record's" if record_rows % candidate.rows == 0 else
            "record 89's bigram table's size" if candidate.rows == floor_rows else "fewer than the record's")
        table = (f"n-gram table {candidate.rows:,} rows ({share}) {candidate.where}, "
                 + table_cost(candidate.rows))
    longest = max(s.tokens_per_rank for s in h.stages)
    batch = ("micro-batches as the record's" if candidate.split == 1 else
             f"each slice of the global batch in {candidate.split} micro-batches of at most {longest:,} tokens "
             f"(the same global batch; smaller, slower products)")
    return f"{table}; {batch}"


def shown(args):
    """Preset arguments as the plan's line shows them: a --stages list as [...] (the line says
    what it holds)."""
    return " ".join("--stages=[...]" if a.startswith("--stages=") else a for a in args)


def launch_plan(recipe, gpus, argv=(), available=None):
    """(preset arguments, processes, reason): what run.sh starts on `gpus` GPUs, for train_gpt.py's
    arguments `argv`. Without a --preset or --config among them: the first of plan_candidates
    that passes the start-up checks (check_start_up, check_memory), so the largest n-gram table
    that fits, placed the fastest way it fits, with the fewest micro-batches; as a named preset
    when it is one. With one, the user's config on the most processes that pass. `available`:
    device -> free bytes (available_memory_bytes; GPU 0 stands for every GPU). The reason is one
    line: the machine, the choice and what it costs, its budget, and why the configuration before
    it was refused. ConfigError when nothing passes, with the refusal of the least one tried."""
    available = available or available_memory_bytes
    gpu, host = available(torch.device("cuda", 0)), available(torch.device("cpu"))
    machine = f"{gpus} GPU{'s' * (gpus > 1)} of {gpu / 2**30:.1f} GiB, {host / 2**30:.1f} GiB of host memory"
    users = any(a in ("--preset", "--config") or a.startswith(("--preset=", "--config=")) for a in argv)
    if users:
        ranks = recipe.parse_config(argv).batch_ranks
        candidates = [Candidate((), n, 0, "", 1) for n in range(min(gpus, ranks), 0, -1) if ranks % n == 0]
    else:
        candidates = plan_candidates(recipe, gpus, argv)
    record_rows = recipe.parse_config(["--preset", "1gpu"]).ngram_rows
    floor_rows = recipe.parse_config(["--preset", "record89"]).bigram_rows
    refused = []
    for candidate in candidates:
        n = candidate.processes
        h = recipe.parse_config([*candidate.args, *argv])
        on = f"on {n} process{'es' * (n > 1)}"
        chose = "the most processes it passes on" if users else describe(candidate, h, record_rows, floor_rows)
        try:
            check_start_up(recipe, h, n, available)
            budget = check_memory(recipe, h, ProcessGroup(0, n, 0, torch.device("cuda", 0)), available)
        except ConfigError as e:
            refused.append(f"{shown(candidate.args) or 'the config'} {on} ({chose.split(', by ')[0]}): {e}")
            continue
        args = candidate.args if users else named_preset(recipe, candidate.args, h, argv)
        fits = f"budget {budget.summary(gpu)} on each GPU" + (
            f", {budget.host_total() / 2**30:.1f} of {host / 2**30:.1f} GiB of host memory" if budget.host else "")
        not_chosen = f"; not {refused[-1].split('; ')[0]}" if refused else ""
        return args, n, f"{machine}: {shown(args) or 'the config'} {on}: {chose}; {fits}{not_chosen}"
    raise ConfigError(f"nothing fits {machine}; the least configuration tried: {refused[-1]}" if refused
                      else f"nothing fits {machine}")


def check_start_up(recipe, h, processes, available):
    """The checks each of `processes` processes makes before it allocates (but the memory
    budget's): the batch and validation splits and check_ngram_table; ConfigError names the first
    that fails."""
    pg = ProcessGroup(0, processes, 0, torch.device("cuda", 0))
    if h.batch_ranks % processes:
        raise ConfigError(f"batch_ranks={h.batch_ranks} is not divisible by {processes}")
    check_validation_split(h, pg)
    check_ngram_table(h, pg, available)


def named_preset(recipe, args, h, argv):
    """args, or ("--preset", NAME) when the configuration they make (with argv) is a named preset's:
    every key but the preset's name, and the track when the preset files its runs under none (a
    configuration for a machine no track takes, as 1gpu_24gb's 24 GB card)."""
    for name in recipe.PRESETS:
        other = config_to_dict(recipe.parse_config(["--preset", name, *argv]))
        ignored = ("preset", "track") if other["track"] == "none" else ("preset",)
        mine = {k: v for k, v in config_to_dict(h).items() if k not in ignored}
        if name != h.preset and {k: v for k, v in other.items() if k not in ignored} == mine:
            return ("--preset", name)
    return args


PLAN_MAX_GIB = 2**20               # the most memory --plan takes for a GPU or a host: a PiB


def plan_command(recipe, argv):
    """--plan [--gpus=N --gpu_gib=X --host_gib=Y] [train_gpt.py arguments]: print launch_plan's
    answer (for `recipe`, train_gpt) for this machine (or for N GPUs of X GiB and Y GiB of host memory, on any machine), in
    three lines: the processes, the preset arguments, the reason. run.sh asks it."""
    parser = ArgumentParser(prog="train_gpt.py --plan", allow_abbrev=False,
                            description="What ./run.sh starts on a machine's GPUs, and why (docs/gpu.md). Any other "
                                        "--key=value is the run's, as for training.")
    parser.add_argument("--plan", action="store_true", help="print the plan: processes, preset arguments, reason")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to plan for (default: this machine's)")
    parser.add_argument("--gpu_gib", type=float, default=None,
                        help="free memory of each GPU in GiB, e.g. 79.6 for an 80 GB H100 (default: GPU 0's now)")
    parser.add_argument("--host_gib", type=float, default=None,
                        help="host memory in GiB the run may use (default: this machine's available memory)")
    args, rest = parser.parse_known_args(argv)
    gpus = torch.cuda.device_count() if args.gpus is None else args.gpus
    if gpus < 1:
        raise ConfigError("--plan is for GPUs and this machine has none (./run.sh runs the cpu preset here); to plan "
                          "for a GPU machine, name it: --gpus=N --gpu_gib=G [--host_gib=H]")
    if args.gpu_gib is None and not torch.cuda.is_available():
        raise ConfigError(f"--plan for {gpus} GPU(s) on a machine without one needs their memory: add --gpu_gib=G "
                          f"(GiB each, e.g. 79.6 for an 80 GB H100, 23.6 for a 24 GB card)")
    for key, value in (("gpu_gib", args.gpu_gib), ("host_gib", args.host_gib)):
        if value is not None and not 0 < value <= PLAN_MAX_GIB:
            raise ConfigError(f"--{key}={value} is not allowed: expects a positive number of GiB, at most "
                              f"{PLAN_MAX_GIB:,} (a PiB)")

    def available(device):
        given = args.gpu_gib if device.type == "cuda" else args.host_gib
        return available_memory_bytes(device) if given is None else int(given * 2**30)
    preset_args, processes, reason = launch_plan(recipe, gpus, rest, available)
    print(processes, " ".join(preset_args), reason, sep="\n")
    return 0


def names_a_config(argv):
    """Whether argv names its config: a --preset or a --config."""
    return any(a in ("--preset", "--config") or a.startswith(("--preset=", "--config=")) for a in argv)


def with_machine_preset(recipe, argv, launch):
    """argv as ./run.sh would start it on this machine when it names no preset: the cpu preset
    without a GPU; with GPUs, launch_plan's choice for the processes this launch has, said in one
    line (by rank 0). A plan for another number of processes is refused with what to run instead."""
    if names_a_config(argv):
        return argv
    if not torch.cuda.is_available():
        return ["--preset", "cpu", *argv]
    asked = [a for a in argv if a not in ("-h", "--help", "--print_config")]
    preset_args, processes, reason = launch_plan(recipe, launch.world_size, asked)
    if processes != launch.world_size:
        raise ConfigError(f"no --preset given, and on {launch.world_size} process(es) of this machine the plan needs "
                          f"{processes}: run ./run.sh, or name a preset (--preset NAME)")
    if launch.rank == 0:
        print(f"train_gpt.py: no --preset given, as ./run.sh here: {reason}", file=sys.stderr, flush=True)
    return [*preset_args, *argv]


def micro_batch_splits(h):
    """The k that split_micro_batches(h, k) takes: powers of two that divide every stage's
    tokens_per_rank and leave each micro-batch at least its stage's max_doc_len (a shorter one
    would cut the documents the stage keeps whole)."""
    k, splits = 1, []
    while all(s.tokens_per_rank % k == 0 and s.tokens_per_rank // k >= s.max_doc_len for s in h.stages):
        splits.append(k)
        k *= 2
    return splits


def split_micro_batches(h, k):
    """h with each slice of the global batch trained as k micro-batches by gradient accumulation:
    k times the slices (batch_ranks), each stage's tokens_per_rank divided by k. The global batch
    and the schedules stay; a step's activations shrink about k-fold. The validation's windows
    (val_tokens_per_rank) shrink k-fold too, so its forward does: a window's edge cuts a document,
    so k times as many documents are cut (a slightly higher val loss)."""
    h.batch_ranks *= k
    h.stages = [dataclasses.replace(s, tokens_per_rank=s.tokens_per_rank // k) for s in h.stages]
    if h.val_tokens_per_rank % k == 0:
        h.val_tokens_per_rank //= k
    return h
