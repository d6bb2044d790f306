"""The tables trained from sparse gradients: the hashed n-gram table and the sparse value
embeddings. Each token's rows get one gradient entry per step; the entries are summed per row
(RowGradientSums, VocabRowGradients) and a sparse Adam updates only the touched rows every
few steps. `SparseTables` is what the Trainer owns: the optimizers, the pending gradients, the
cadence and, for a table that is not whole on the device, what fetches a slice's rows:
ShardedNgramRows when the table is split across the processes (each holds rows/processes of
it and its optimizer state), HostNgramRows when it lives in host memory with a device cache.
check_ngram_table refuses at start-up a table this machine cannot hold.
"""
import contextlib
import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

import kernels
import optim
from machinery.config import PADDED_VOCAB_SIZE, ConfigError
from machinery.processes import ProcessGroup, TrainingError, synchronize, syncs_allowed

NGRAM_ROW_STATE_BYTES = 8          # sparse Adam's state per table row: an fp32 moment and an int32 event
NGRAM_ROW_MAP_BYTES = 4            # a host table's map from each row to its cache slot (int32)


def available_memory_bytes(device):
    """Free memory of the device (CUDA) or available host memory (/proc/meminfo), or None."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def ngram_row_bytes(h):
    """Device bytes of one n-gram table row: its values and its optimizer state."""
    return h.model_dim * getattr(torch, h.ngram_dtype).itemsize + NGRAM_ROW_STATE_BYTES


def check_ngram_table(h, pg, available=None):
    """Refuse, before anything is allocated, an n-gram table that cannot be split evenly across
    the processes or whose shard cannot fit where it would live (`available`: device -> free
    bytes, available_memory_bytes)."""
    if not h.ngram_rows:
        return
    if h.ngram_rows % pg.world_size:
        raise ConfigError(f"--ngram_rows={h.ngram_rows} does not split evenly across {pg.world_size} processes: "
                          f"use a multiple of {pg.world_size}")
    row_bytes = ngram_row_bytes(h)
    if h.ngram_cache_rows:
        if pg.world_size > 1:
            raise ConfigError(f"--ngram_cache_rows={h.ngram_cache_rows} keeps the table in one process's host "
                              f"memory, but {pg.world_size} processes split it: set --ngram_cache_rows=0")
        least = min_cache_rows(h, pg)
        if h.ngram_cache_rows < least:
            raise ConfigError(f"--ngram_cache_rows={h.ngram_cache_rows} is fewer than the {least} rows the device "
                              f"cache must hold at once (an update's slices, the next step's and a validation "
                              f"slice's, 2 rows per token): raise it to at least {least}")
        places = [(h.ngram_rows, row_bytes + NGRAM_ROW_MAP_BYTES, torch.device("cpu"), "in host memory"),
                  (h.ngram_cache_rows, row_bytes, pg.device, f"its cache of {h.ngram_cache_rows} rows")]
    else:
        shard = h.ngram_rows // pg.world_size
        places = [(shard, row_bytes, pg.device, f"{shard} rows in each of {pg.world_size} processes"
                   if pg.world_size > 1 else "all in one process")]
    for rows, per_row, device, where in places:
        free = (available or available_memory_bytes)(device)
        if free is not None and rows * per_row > free:
            raise ConfigError(f"--ngram_rows={h.ngram_rows} needs {rows * per_row / 2**30:.1f} GiB on the "
                              f"{device.type} ({where}: {per_row} B per row, {h.ngram_dtype} values of "
                              f"{h.model_dim} and the optimizer state), {free / 2**30:.1f} GiB are "
                              f"available: lower --ngram_rows{' or --ngram_cache_rows' if h.ngram_cache_rows else ''}")


def ngram_event_rows(h, world_size):
    """The most distinct rows of the n-gram table one process's Adam event can take gradients for:
    every entry since the last event (2 per token of every slice of the longest cadence's steps,
    all processes' when the table is split, each process then asked for its own rows), and no
    more than the rows it trains (its shard, or the device cache of a host table)."""
    cadence = max([h.ngram_step_every, *(p.step_every for p in h.table_phases)])
    entries = 2 * cadence * h.batch_ranks * max(s.tokens_per_rank for s in h.stages)
    return min(entries, h.ngram_cache_rows or h.ngram_rows // world_size)


def min_cache_rows(h, pg):
    """Rows the device cache of a host table must hold at once: those of the slices since the
    table's last Adam event (its longest cadence), of the next step's (prefetched) and of a
    validation slice, 2 per token."""
    cadence = max([h.ngram_step_every, *(p.step_every for p in h.table_phases)])
    longest = max(s.tokens_per_rank for s in h.stages)
    return 2 * ((cadence + 1) * (h.batch_ranks // pg.world_size) * longest + h.val_tokens_per_rank)


class VocabRowGradients:
    """The gradients of a vocabulary-sized table (a value-embedding table) summed per row since
    its last update. Memory: the table's size in fp32, however far apart
    the updates are; keeping the entries instead would grow with the tokens in between (32
    micro-batches of 49,152 in the 1gpu preset's late phase: 4.8 GB for a 768-wide table).

    add(groups, grads), after each micro-batch: its entries summed per row in token order and
    added, one addition per row (add_row_sums_: deterministic). touched(rows, summed): of the
    candidate rows `rows` (sorted, distinct; their number known on the host, so no host sync),
    the RowGroups of those whose sum is not zero and their sums, slot by slot. A row whose
    gradients summed to exactly zero is left out: its update would be its moment's decay alone,
    which the catch-up applies when the row is next updated."""

    def __init__(self, rows, dim, device, add_row_sums):
        self.sums = torch.zeros(rows, dim, device=device)
        self.entries = 0           # entries added since the last clear (host)
        self.add_row_sums = add_row_sums

    def add(self, groups, grads):
        self.add_row_sums(self.sums, groups.distinct, grads, groups)
        self.entries += grads.shape[0]

    def touched(self, rows, summed=None):
        """(RowGroups, sums): the rows among `rows` (N,) whose gradient sum is not zero, at
        capacity N, and their sums (N, D) slot by slot, zeros past the count. `summed` (N, D) is
        the rows' sums (default: this process's, self.sums[rows])."""
        summed = self.sums[rows] if summed is None else summed
        flagged = summed.ne(0).any(1)
        order = torch.sort((~flagged).to(torch.uint8), stable=True).indices   # the flagged rows first, in order
        first = rows[order[:1]]    # the smallest flagged row: it stands in for the unflagged ones
        vector = torch.where(flagged[order], rows[order], first)
        return kernels.distinct_rows(vector), summed[order]   # an unflagged row's sum is zero

    def clear(self):
        self.sums.zero_()
        self.entries = 0


class RowGradientSums:
    """A sparse table's gradients since its last Adam event, summed per row, in memory fixed at
    the start: `capacity` fp32 rows of sums, at least the distinct rows an event can see.

    add(rows, grads), after each micro-batch: its entries, (N,) rows of the table the Adam trains
    and their (N, D) gradients, summed per row in entry order and added to the row's slot in one
    pass (add_row_sums_: deterministic); a row takes the next free slot when it first has a
    gradient since the last event. Slots are handed out on the device (slot_of, row_of, count):
    no host sync. summed(calls): the RowGroups of the rows with a slot and their sums divided in
    place by `calls`, for SparseRowAdam.step_summed. The sums add the same entries as one sum
    over all of them, in another order: equal up to float rounding."""

    def __init__(self, rows, dim, capacity, device, add_row_sums):
        self.rows, self.capacity, self.add_row_sums = rows, capacity, add_row_sums
        self.sums = torch.zeros(capacity + 1, dim, device=device)   # slot `capacity` takes the padding's zeros
        self.slot_of = torch.full((rows + 1,), -1, dtype=torch.int32, device=device)  # row `rows`: the padding
        self.row_of = torch.full((capacity + 1,), rows, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int64, device=device)   # slots in use
        self.entries = 0           # entries added since the last clear (host): at least the slots in use
        self.clear()

    def add(self, rows, grads):
        groups = kernels.distinct_rows(rows)
        row = torch.where(groups.distinct >= 0, groups.distinct, self.rows)
        slot = self.slot_of[row].long()
        new = slot < 0
        slot = torch.where(new, self.count + new.cumsum(0) - 1, slot)
        self.slot_of[row], self.row_of[slot] = slot.int(), row   # the padding's writes repeat its values
        self.count += new.sum()
        self.add_row_sums(self.sums, slot, grads, groups)   # one addition per slot
        self.entries += rows.numel()

    def in_use(self):
        """A host bound on the slots in use: they are the first this many."""
        return min(self.entries, self.capacity)

    def summed(self, calls):
        n = self.in_use()
        if calls > 1:
            self.sums[:n].div_(calls)
        return kernels.RowGroups(self.row_of[:n], self.count, None, None, None), self.sums[:n]

    def clear(self):
        n = self.in_use()
        self.slot_of[self.row_of[:n]] = -1
        self.slot_of[self.rows] = self.capacity
        self.row_of[:n] = self.rows
        self.sums[:n].zero_()
        self.count.zero_()
        self.entries = 0


@dataclass
class Route:
    """Where a slice's n-gram rows come from and where their gradients go, with the table split
    across the processes (ShardedNgramRows), worked out on the host (pinned with a GPU)."""
    groups: object                 # kernels.RowGroups of the slice's rows (2 per token)
    send_counts: list              # how many of its distinct rows each process holds
    recv_counts: list              # how many rows of this process's shard each process asks for
    asked: torch.Tensor            # those rows, as indices into this shard, process by process


class ShardedNgramRows:
    """The n-gram table split by rows across the processes: process r holds rows [r S, (r + 1) S)
    (S = rows / processes) and their optimizer state, nothing else of the table.

    route_of(tokens, everyone), on the host: from the host tokens of this process's slice and of
    every process's slice of the same micro-batch, the Route: the distinct rows it needs from
    every owner and the rows of its own that every process needs. Host work per slice: the
    hashes of every process's tokens, and the distinct rows of its own slice and of its rows in
    the others'; the batch prefetcher's thread does it a step ahead (BatchPrefetcher). fetch(tokens,
    route), before a forward: with no route, the processes gather each other's tokens first (an
    all_gather on a host group: the hosts wait for each other, never for a device) and work it
    out. One all_to_all then moves the values, owners to askers, with sizes the host knows: no
    host sync. The values land in the model's `fetched` buffer and `slots` says where each
    token's two rows landed.
    entries(grads), after the backward: each distinct row's gradient, summed over the slice's
    tokens (in token order: deterministic), goes back to its owner by the same routes, and each
    process returns the entries it received for its own rows (repeats across senders add up in
    SparseRowAdam). Traffic and memory per slice: its distinct rows, whatever the table's size.

    The gradients are divided by the processes: each process's loss is scaled to its share of
    the micro-batches, so the owners' sum is that many times the mean gradient the dense
    parameters get (their all-reduce averages). They travel in the table's dtype (a bf16 table's
    sums rounded once, after the sum over the slice's tokens in fp32); the owner adds them up
    in fp32."""

    def __init__(self, table, sum_rows, pg: ProcessGroup):
        self.table, self.sum_rows, self.pg = table, sum_rows, pg
        self.shard_rows = table.table.shape[0]
        # host tokens travel on gloo; a CPU run's default group is one already
        self.host_group = dist.new_group(backend="gloo") if pg.device.type == "cuda" else None
        self.route = None          # the last fetch's RowGroups (device), send and receive counts, asked rows

    def _pinned(self, host):
        """`host`, in pinned memory on CUDA, from where a copy to the device does not make the host wait."""
        return host.pin_memory() if self.pg.device.type == "cuda" else host

    def _rows_asked_of_me(self, tokens):
        """The distinct rows of this process's shard that a slice of host `tokens` reads, sorted
        (the order in which the process holding the slice asks for them)."""
        rows = self.table.slice_rows(tokens)
        return torch.unique(rows[rows // self.shard_rows == self.pg.rank])

    @torch.no_grad()
    def route_of(self, tokens, everyone):
        """The Route of this process's slice of host `tokens` (T,), `everyone` holding every
        process's slice of the micro-batch (this one's included). Host work only."""
        groups = kernels.distinct_rows(self.table.slice_rows(tokens))   # on the host, where the tokens are
        distinct = groups.distinct[:int(groups.count)]        # sorted, so grouped by owner
        send_counts = torch.bincount(distinct // self.shard_rows, minlength=self.pg.world_size).tolist()
        asked = [distinct[distinct // self.shard_rows == self.pg.rank] if process == self.pg.rank
                 else self._rows_asked_of_me(theirs) for process, theirs in enumerate(everyone)]
        return Route(kernels.RowGroups(**{f.name: self._pinned(getattr(groups, f.name))
                                          for f in dataclasses.fields(groups)}),
                     send_counts, [len(rows) for rows in asked], self._pinned(torch.cat(asked) - self.table.first_row))

    @torch.no_grad()
    def fetch(self, tokens, training=True, route=None):
        """Fill the table's `fetched` and `slots` for the host tokens (T,) of the next forward
        (`training` matters to a host table's cache, not here), by `route` (None: gathered and
        worked out here). Every process calls it for a slice of the same length."""
        if route is None:
            everyone = [torch.empty_like(tokens) for _ in range(self.pg.world_size)]
            dist.all_gather(everyone, tokens, group=self.host_group)
            route = self.route_of(tokens, everyone)
        device = self.pg.device
        asked = route.asked.to(device, non_blocking=True)
        dist.all_to_all_single(self.table.fetched[:sum(route.send_counts)], self.table.table[asked],
                               output_split_sizes=route.send_counts, input_split_sizes=route.recv_counts)
        self.table.slots[:tokens.numel()].copy_(route.groups.inverse.view(-1, 2), non_blocking=True)
        groups = kernels.RowGroups(**{f.name: getattr(route.groups, f.name).to(device, non_blocking=True)
                                      for f in dataclasses.fields(route.groups)})
        self.route = (groups, route.send_counts, route.recv_counts, asked)

    @torch.no_grad()
    def entries(self, grads):
        """(rows of this shard, their gradients) for the entries `grads` (T * 2, D) of the last
        fetched slice: this process's share of every process's summed gradients."""
        groups, send_counts, recv_counts, asked = self.route
        # in the table's dtype, as the dense gradients travel
        sent = self.sum_rows(grads, groups, scale=1.0 / self.pg.world_size,
                             out_dtype=self.table.table.dtype)[:sum(send_counts)]
        received = sent.new_empty(len(asked), grads.shape[1])
        dist.all_to_all_single(received, sent, output_split_sizes=recv_counts, input_split_sizes=send_counts)
        return asked, received


class HostNgramRows:
    """The n-gram table in host memory (pinned with a GPU) and a device cache of its rows.

    The cache is the table's `fetched` (cache_rows x dim). SparseRowAdam trains the cached rows
    in place, with each slot's moment and last event, so the math is the resident table's, row
    for row and bit for bit. The host keeps every row's value, moment and last event, and each
    row's slot (-1: not cached).

    fetch(tokens), before a forward: the slice's distinct rows that are not cached are copied
    from the host into free slots with their state (prefetch() does this for the next step's
    slices while the current one runs, on a copy stream with a GPU), and `slots` gets each
    token's two slots. A training slice's rows stay pinned in the cache until the table's next
    Adam event has used their gradients (release()). When free slots run short, the least
    recently used unpinned rows go back to the host (values and state), a quarter of the cache
    at a time: the host waits for the device then, once per such round. flush() writes every
    cached row back, so that the host table is whole (for a checkpoint)."""

    def __init__(self, table, adam: optim.SparseRowAdam, device):
        self.table, self.adam, self.device = table, adam, device
        capacity, pin = table.fetched.shape[0], device.type == "cuda"
        self.moment = torch.zeros(table.rows, dtype=torch.float32, pin_memory=pin)  # every row's Adam state
        self.last = torch.zeros(table.rows, dtype=torch.int32, pin_memory=pin)
        self.slot_of = torch.full((table.rows,), -1, dtype=torch.int32)
        self.row_of = torch.full((capacity,), -1, dtype=torch.int64)  # -1: a free slot
        self.used = torch.zeros(capacity, dtype=torch.int64)          # the fetch that last read the slot
        self.pinned = torch.zeros(capacity, dtype=torch.bool)
        self.copies = torch.cuda.Stream(device) if pin else None
        self.last_slots = None     # the last fetched slice's slots, 2 per token, on the device
        self.reset_counts()

    def reset_counts(self):
        """Start counting fetches, row lookups, hits and write-backs anew."""
        self.fetches = self.lookups = self.hits = self.evicted = self.rounds = 0

    @torch.no_grad()
    def fetch(self, tokens, training=True, route=None):
        """Make the rows of the host tokens (T,) cached and fill the table's `slots` for them;
        a training slice's rows are pinned until release(). (`route` is a split table's.)"""
        distinct, inverse = torch.unique(self.table.slice_rows(tokens), sorted=True, return_inverse=True)
        token_slots = self._cache(distinct, pin=training)[inverse]
        if self.copies is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.copies)
        self.last_slots = token_slots.to(self.device, non_blocking=True)
        self.table.slots[:tokens.numel()].copy_(self.last_slots.view(-1, 2))

    @torch.no_grad()
    def prefetch(self, slices):
        """Copy the rows of the next step's slices into the cache now, and pin them."""
        stream = torch.cuda.stream(self.copies) if self.copies is not None else contextlib.nullcontext()
        with stream:
            for s in slices:
                self._cache(torch.unique(self.table.slice_rows(s.tokens)), pin=True)

    def entries(self, grads):
        """(cache slots, gradients) for the entries `grads` (T * 2, D) of the last fetched slice."""
        return self.last_slots, grads

    def release(self):
        """The table's Adam event has used every pending gradient: no row needs to stay cached."""
        self.pinned.zero_()

    def _cache(self, distinct, pin):
        """The slots of the (host) rows `distinct`, loading those not cached."""
        slots = self.slot_of[distinct].long()
        missing = slots < 0
        count = int(missing.sum())
        self.fetches, self.lookups, self.hits = self.fetches + 1, self.lookups + distinct.numel(), \
            self.hits + distinct.numel() - count
        if count:
            free = self._free_slots(count, keep=slots[~missing])
            rows = distinct[missing]
            self._load(rows, free)
            slots[missing] = free
            self.slot_of[rows], self.row_of[free] = free.int(), rows
        self.used[slots] = self.fetches
        if pin:
            self.pinned[slots] = True
        return slots

    def _free_slots(self, count, keep):
        free = torch.nonzero(self.row_of < 0).squeeze(1)
        if free.numel() < count:
            self._evict(max(count - free.numel(), self.row_of.numel() // 4), keep)
            free = torch.nonzero(self.row_of < 0).squeeze(1)
        if free.numel() < count:
            raise TrainingError(f"the n-gram table's device cache of {self.row_of.numel()} rows has no room for "
                                f"{count} more: raise --ngram_cache_rows")
        return free[:count]

    def _evict(self, count, keep):
        """Write the `count` least recently used unpinned rows (but `keep`) back to the host."""
        candidate = (self.row_of >= 0) & ~self.pinned
        candidate[keep] = False
        count = min(count, int(candidate.sum()))
        if not count:
            return
        victims = torch.topk(torch.where(candidate, self.used, torch.iinfo(torch.int64).max), count,
                             largest=False).indices
        self._write_back(victims)
        self.slot_of[self.row_of[victims]] = -1
        self.row_of[victims] = -1
        self.evicted, self.rounds = self.evicted + count, self.rounds + 1

    def _write_back(self, slots):
        """Host rows of `slots` <- their cached values and state, copied from the device into
        pinned buffers (the copy engine writes them directly; a pageable destination takes a
        second copy through a staging buffer) and from there into the host's tables. The host
        waits for the device (both streams) before: the rows' last update must be done, and no
        queued work may still read a slot that a load is about to fill; and after, for the copies.
        Those waits are the write-back's by design: --sync_check lets them be (syncs_allowed)."""
        with syncs_allowed():
            synchronize(self.device)
            rows, on_device = self.row_of[slots], slots.to(self.device)
            staged = [self._staged(cached[on_device]) for cached in (self.table.fetched, self.adam.moment,
                                                                     self.adam.last)]
            synchronize(self.device)
        for host, values in zip((self.table.table, self.moment, self.last), staged):
            host[rows] = values

    def _staged(self, values):
        """A host copy of the device tensor `values`, in pinned memory with a GPU; with a GPU it is
        complete once the device has been synchronized."""
        staging = torch.empty(values.shape, dtype=values.dtype, pin_memory=self.copies is not None)
        return staging.copy_(values, non_blocking=True)

    def _load(self, rows, slots):
        """Cache slots <- host rows with their state, queued on the current stream."""
        pin = self.copies is not None
        on_device = slots.to(self.device, non_blocking=True)
        for host, cached in ((self.table.table, self.table.fetched), (self.moment, self.adam.moment),
                             (self.last, self.adam.last)):
            picked = torch.empty((rows.numel(), *host.shape[1:]), dtype=host.dtype, pin_memory=pin)
            torch.index_select(host, 0, rows, out=picked)
            cached.index_copy_(0, on_device, picked.to(self.device, non_blocking=True))

    def flush(self):
        """Write every cached row back; they stay cached."""
        self._write_back(torch.nonzero(self.row_of >= 0).squeeze(1))

    def summary(self):
        return (f"n-gram cache: {self.table.fetched.shape[0]} rows on the device, hit rate "
                f"{self.hits / max(self.lookups, 1):.1%} ({self.hits}/{self.lookups} distinct rows of "
                f"{self.fetches} slices), {self.evicted} rows written back in {self.rounds} rounds")


class SparseTables:
    """The sparse tables of one process's model and everything that trains them: the n-gram
    table's sparse Adam and pending row gradients, with what fetches a slice's rows when the
    table is not whole on the device (`fetcher`: HostNgramRows or ShardedNgramRows), and each
    sparse value-embedding table's Adam and pending gradients; the cadence (an update every
    `step_every` calls of step()) and the schedule of their learning rates and beta2."""

    def __init__(self, h, model, pg, use_triton):
        self.h, self.model, self.pg = h, model, pg
        self.ngram_adam = None     # the n-gram table's (its shard's, its cache's) sparse Adam
        self.fetcher = None        # split or on the host: what fetches a slice's rows (and routes their gradients)
        self.ngram_grads = None    # the table's gradients since its last Adam event (RowGradientSums)
        ngram = model.ngram
        if ngram is not None:
            self.ngram_adam = optim.SparseRowAdam(ngram.fetched if ngram.on_host else ngram.table, lr=h.ngram_lr,
                                                  beta2=h.ngram_beta2, eps=h.adam_eps, weight_decay=h.ngram_wd,
                                                  use_triton=use_triton)
            if ngram.on_host:
                self.fetcher = HostNgramRows(ngram, self.ngram_adam, pg.device)
            elif ngram.gathered:
                self.fetcher = ShardedNgramRows(ngram, self.ngram_adam.sum_rows, pg)
            self.ngram_grads = RowGradientSums(self.ngram_adam.table.shape[0], h.model_dim,
                                               ngram_event_rows(h, pg.world_size), pg.device,
                                               self.ngram_adam.add_row_sums)
        self.value_adams = []      # sparse value embeddings: each table's sparse Adam (every process's table whole)
        self.value_grads = []      # and its rows' gradients since its last update (VocabRowGradients)
        self.value_rows_seen = None  # host (numpy, V) bool: the tokens of this process's slices since the last update
        if model.value_sinks is not None:
            for ve in model.value_embeds:
                adam = optim.SparseRowAdam(ve.weight, lr=h.value_embed_lr, beta2=h.value_embed_betas[1],
                                           eps=h.adam_eps, weight_decay=h.value_embed_wd,
                                           use_triton=use_triton)
                self.value_adams.append(adam)
                self.value_grads.append(VocabRowGradients(PADDED_VOCAB_SIZE, ve.embedding_dim, pg.device,
                                                          adam.add_row_sums))
            self.value_rows_seen = np.zeros(PADDED_VOCAB_SIZE, dtype=bool)
        # the processes' host masks meet on gloo; a CPU run's default group is one already
        self.host_group = (dist.new_group(backend="gloo") if self.value_adams and pg.world_size > 1
                           and pg.device.type == "cuda" else None)
        self.any = ngram is not None or bool(self.value_adams)  # any table trained from gradient entries
        self.step_every = h.ngram_step_every
        self.frozen = False        # set by the warm-up: the tables keep their values
        self.drop_entries()        # no pending gradients, and no steps since the last event

    @property
    def host(self):
        """The host table's HostNgramRows (its prefetch, flush and counts), or None."""
        return self.fetcher if isinstance(self.fetcher, HostNgramRows) else None

    @property
    def router(self):
        """The split table's ShardedNgramRows (the batch prefetcher works out its routes), or None."""
        return self.fetcher if isinstance(self.fetcher, ShardedNgramRows) else None

    def start_timing(self):
        """The timed run begins: a host table counts its fetches, lookups and hits anew."""
        if self.host is not None:
            self.host.reset_counts()

    def after_step(self, batches):
        """After a training step: a host table copies the rows of the next step's slices
        (`batches.peek()`; None after the last step) into its cache while the device works."""
        if self.host is not None and batches is not None:
            self.host.prefetch(batches.peek())

    def finish(self):
        """After the run: a host table's cached rows written back (the table whole, for the
        checkpoint and the model after the run); its summary line, else None."""
        if self.host is None:
            return None
        self.host.flush()
        return self.host.summary()

    def set_schedule(self, lr, schedule, eps):
        """The tables' learning rates at LR multiplier `lr`, and from `schedule` (a TableSchedule)
        their beta2, weight decay and cadence (one update every `schedule.step_every` calls of
        step()); `eps` their Adam's epsilon."""
        self.step_every = schedule.step_every
        if self.ngram_adam is not None:
            self.ngram_adam.lr = self.h.ngram_lr * lr
            self.ngram_adam.beta2 = schedule.ngram_beta2
            self.ngram_adam.weight_decay = self.h.ngram_wd * schedule.decay_mult
            self.ngram_adam.eps = eps
        for adam in self.value_adams:
            adam.lr = self.h.value_embed_lr * lr
            adam.beta2 = schedule.value_embed_betas[1]
            adam.weight_decay = self.h.value_embed_wd * schedule.decay_mult
            adam.eps = eps

    def fetch(self, tokens, **kwargs):
        """Bring the rows of `tokens` to the device when the table is not whole there."""
        if self.fetcher is not None:
            self.fetcher.fetch(tokens, **kwargs)

    def take_entries(self, s):
        """Add the sparse tables' gradient entries of the micro-batch that just ran, from their
        sinks, to the tables' row sums, and clear the sinks for the next one: the n-gram table's
        two rows per token (with a split table, the entries the other processes sent for this
        one's rows) and each sparse value-embedding table's row per token (the token itself)."""
        if not self.any:
            return
        count = s.tokens.numel()
        ngram = self.model.ngram
        resident = ngram is not None and self.fetcher is None   # its rows come from the device tokens
        tokens = s.tokens.to(self.pg.device, non_blocking=True) if resident or self.value_adams else None
        if ngram is not None:
            grads = ngram.sink.grad[:count]
            entries = grads.reshape(2 * count, -1)
            self.ngram_grads.add(*(self.fetcher.entries(entries) if self.fetcher is not None
                                   else (ngram.slice_rows(tokens), entries)))
            grads.zero_()
        if self.value_adams:
            self.value_rows_seen[s.tokens.numpy()] = True   # the host's tokens: no device work
            groups = kernels.distinct_rows(tokens.long())
            for sink, pending in zip(self.model.value_sinks, self.value_grads):
                grads = sink.grad[:count]
                pending.add(groups, grads)
                grads.zero_()

    def step(self):
        """Every step_every-th call (the cadence set_schedule set): update the sparse tables from
        the mean of their gradients over those steps. The n-gram table's touched rows take their
        summed entries (RowGradientSums); the value-embedding tables' rows, see
        _step_value_table. The warm-up discards its gradients."""
        self.calls += 1
        if self.frozen or self.calls >= self.step_every:
            if not self.frozen:
                if self.ngram_adam is not None:
                    self.ngram_adam.step_summed(*self.ngram_grads.summed(self.calls))
                if self.value_adams:
                    rows = self._value_rows()
                    for adam, pending in zip(self.value_adams, self.value_grads):
                        self._step_value_table(adam, pending, rows)
            self.drop_entries()

    def adams(self):
        """The sparse tables' optimizers: the n-gram table's and the value-embedding tables'."""
        return [adam for adam in (self.ngram_adam, *self.value_adams) if adam is not None]

    def _value_rows(self):
        """The rows that any process's value-table entries may touch since the last update: the
        union of the processes' host masks (gathered on the host group: the hosts wait for each
        other, never for a device), sorted, on the device. Its size is known on the host, so the
        update needs no host sync."""
        seen = self.value_rows_seen
        if self.pg.world_size > 1:
            everyone = [torch.empty(seen.shape, dtype=torch.uint8) for _ in range(self.pg.world_size)]
            dist.all_gather(everyone, torch.from_numpy(seen.view(np.uint8)), group=self.host_group)
            seen = np.stack([t.numpy() for t in everyone]).any(0)
        rows = torch.from_numpy(np.flatnonzero(seen))
        return (rows.pin_memory() if self.pg.device.type == "cuda" else rows).to(self.pg.device, non_blocking=True)

    def _step_value_table(self, adam, pending: VocabRowGradients, rows):
        """Update a value-embedding table's rows with a gradient from the mean over the steps and
        the processes. Every process holds the table whole: they all-reduce their sums at `rows`
        (the rows any of them touched: _value_rows), and make the same update."""
        if not rows.numel():
            return
        summed = pending.sums[rows]
        world = self.pg.world_size
        if world > 1:   # in the table's dtype, as the dense gradients travel; summed up in fp32 after
            travelling = summed.to(adam.table.dtype)
            dist.all_reduce(travelling)
            summed = travelling.float()
        groups, summed = pending.touched(rows, summed)
        adam.step_summed(groups, summed / (self.calls * world))

    def drop_entries(self):
        """No gradient pending (a host table's cache may let their rows go)."""
        self.calls = 0
        if self.ngram_grads is not None:
            self.ngram_grads.clear()
        for pending in self.value_grads:
            pending.clear()
        if self.value_rows_seen is not None:
            self.value_rows_seen[:] = False
        if self.host is not None:
            self.host.release()

    @property
    def ngram_entries(self):
        """The n-gram table's pending gradients as [(rows, their summed gradients)], each row with
        a gradient once ([] when none), for inspection: it waits for the device."""
        pending = self.ngram_grads
        count = int(pending.count) if pending is not None and pending.entries else 0
        return [(pending.row_of[:count], pending.sums[:count])] if count else []
