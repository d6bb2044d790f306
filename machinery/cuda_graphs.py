"""CUDA graphs of the training step: the forward and backward of each graph key (stage, windows,
tied head) captured once in the untimed warm-up on inputs at fixed addresses (MicroBatch), then
replayed with each micro-batch copied into those inputs; the optimizers' updates likewise
(run_captured), their math compiled first when the run compiles. Where graphs are off (a CPU,
--cuda_graphs=false) every call runs eagerly.
"""
import collections
import functools
from dataclasses import dataclass

import torch

from machinery.config import MAX_TARGETS, MIN_DOC_TOKENS
from machinery.processes import TrainingError

# update function's code -> the dynamo graphs compiled for it in this process (a key each, per StepGraphs)
_GRAPHS_OF_CODE = collections.Counter()


@dataclass
class MicroBatch:
    """One micro-batch on the device, as the step's body reads it."""
    tokens: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    candidate_start: torch.Tensor  # 0-d int64: where the slice's candidate walk starts (an int or a 0-d tensor given)

    @staticmethod
    def zeros(stage, device="cpu"):
        """A micro-batch of zeros shaped like the stage's (for dry runs on fake tensors)."""
        T = stage.tokens_per_rank
        return MicroBatch(torch.zeros(T, dtype=torch.int32, device=device),
                          torch.zeros(T, MAX_TARGETS - 1, dtype=torch.int64, device=device),
                          torch.zeros(T // MIN_DOC_TOKENS + 2, dtype=torch.int32, device=device),
                          torch.zeros((), dtype=torch.int64, device=device))

    @staticmethod
    def of(s, start, device):
        """The slice's own tensors on `device` (a step that is not replayed)."""
        s = s.to(device)
        start = start.clone() if torch.is_tensor(start) else torch.full((), start, device=device)
        return MicroBatch(s.tokens, s.targets, s.cu_seqlens, start)

    @staticmethod
    def buffers_like(s, device):
        """Zeroed buffers shaped like `s`, at addresses a captured graph can keep reading."""
        return MicroBatch(*(torch.zeros_like(t, device=device) for t in (s.tokens, s.targets, s.cu_seqlens)),
                          torch.zeros((), dtype=torch.int64, device=device))

    def fill(self, s, start):
        """Copy the next slice in (queued behind the previous replay; from pinned memory the
        host does not wait)."""
        for buffer, value in ((self.tokens, s.tokens), (self.targets, s.targets), (self.cu_seqlens, s.cu_seqlens)):
            buffer.copy_(value, non_blocking=True)
        self.candidate_start.fill_(start)


@dataclass
class StepGraph:
    """One graph key's forward+backward: its body, its input buffers, the parameters it trains,
    and, once captured, the CUDA graph."""
    body: object                   # body(MicroBatch): forward, backward, loss sums
    inputs: MicroBatch
    trained: list                  # the parameters that get a gradient
    graph: object = None           # torch.cuda.CUDAGraph once captured


class StepGraphs:
    """The training step's forward+backward, one per graph key, at fixed addresses.

    On CUDA, each key's micro-batch is captured once as a CUDA graph in the untimed warm-up,
    after the eager steps that compile it, and replayed in the timed run: one launch per
    micro-batch instead of one per kernel, and no Python in between. The graphs share one memory
    pool: they never run at once, and nothing they allocate outlives a replay. What a replay
    leaves behind (gradients, loss sums, FP8 states) lives in ordinary tensors made before the
    capture. On a CPU (or on CUDA for a key the warm-up did not capture) the same body runs
    eagerly on the same buffers, so one code path is tested everywhere. Disabled (cuda_graphs
    off), every micro-batch runs eagerly from its own tensors, gradients are freed after each
    update, and nothing here is kept.

    Gradients: a captured backward adds into .grad tensors that exist at capture and keep their
    addresses. So every parameter has one gradient tensor for the whole run (`grads`), zeroed in
    place after each update (but the gradient sinks', which are the model's: GPT.sinks_of). Each
    key attaches the gradients of the parameters it trains (its first, eager run finds which) and
    detaches the others, so an optimizer never sees a zero gradient for a parameter that got none
    (the head while it is tied).
    """

    def __init__(self, model, device, enabled, compiler=None):
        """compiler: None, or compiler(fn) -> fn compiled (torch.compile as the run uses it), for
        the optimizers' update math (run_captured)."""
        sinks = model.gradient_sinks()
        self.params = [p for p in model.parameters() if all(p is not s for s in sinks)]
        self.device, self.enabled = device, enabled
        self.capturing = enabled and device.type == "cuda"
        self.grads = {}            # parameter -> its gradient tensor for the run
        self.steps = {}            # graph key -> StepGraph
        self.attached = None       # the StepGraph whose gradients are attached
        self.pool = torch.cuda.graph_pool_handle() if self.capturing else None
        self.optimizer_graphs = {}  # run_captured's key -> its CUDA graph
        self.in_warm_up = False    # run_captured may capture (set by the warm-up)
        self.capture_stream = None  # the side stream every capture and its eager run use (CUDA)
        self.prepared = set()      # keys whose eager run on the capture stream is done
        self.eager_runs = 0        # CUDA runs of a key already seen that had no graph
        self.compiler = compiler
        self.compiled = {}         # an update function -> its compiled form
        self.updates_seen = set()  # run_captured's keys met so far (with a compiler)
        self.keys_compiled = set() # (code of the update function, key) compiled here

    def run(self, key, body, s, start):
        """Forward and backward of micro-batch `s` with the graph of `key` (body makes it); returns
        the MicroBatch it read (which the body may have written: the candidate walk's next start)."""
        if not self.enabled:
            batch = MicroBatch.of(s, start, self.device)
            body(batch)
            return batch
        step = self.steps.get(key)
        if step is None:
            self.steps[key] = step = self._first_run(body, s, start)
            return step.inputs
        self._attach(step)
        step.inputs.fill(s, start)
        if step.graph is not None:
            step.graph.replay()
        else:
            self.eager_runs += self.capturing
            step.body(step.inputs)
        return step.inputs

    def _first_run(self, body, s, start):
        """Run a new key eagerly from fresh buffers and find the parameters it trains: the ones
        with a gradient after a backward that starts with none. Gradients pending from earlier
        micro-batches (accumulation) are added back."""
        step = StepGraph(body, MicroBatch.buffers_like(s, self.device), [])
        step.inputs.fill(s, start)
        pending = {p: p.grad for p in self.params if p.grad is not None}
        for p in self.params:
            p.grad = None
        body(step.inputs)
        step.trained = [p for p in self.params if p.grad is not None]
        for p in step.trained:
            if p in self.grads:
                self.grads[p].add_(p.grad)
            else:
                self.grads[p] = p.grad
        trained = set(step.trained)
        for p, grad in pending.items():
            if p not in trained:
                self.grads[p] = grad   # kept for a later key that trains p
        self.attached = None
        self._attach(step)
        return step

    def _attach(self, step):
        if self.attached is step:
            return
        trained = set(step.trained)
        for p in self.params:
            p.grad = self.grads[p] if p in trained else None
        self.attached = step

    def prepare(self, key):
        """The eager run a capture of `key` needs before it, on the capture stream (CUDA, enabled;
        its first run done): the gradients, loss sums and FP8 states change (the warm-up restores
        them). The warm-up prepares every key before it captures any, so that no eager step runs
        while the graphs' pool holds captured steps (two steps' memory at once)."""
        if not self.capturing or key in self.prepared:
            return
        step = self.steps[key]
        self._attach(step)
        self._on_capture_stream(functools.partial(step.body, step.inputs))
        self.prepared.add(key)

    def capture(self, key):
        """Capture `key`'s forward+backward (prepared first if it was not)."""
        if not self.capturing or self.steps[key].graph is not None:
            return
        self.prepare(key)
        step = self.steps[key]
        self._attach(step)
        step.graph = self._record(functools.partial(step.body, step.inputs), f"training step of graph {key}")

    def run_captured(self, key, fn):
        """fn() (an optimizer's update on tensors at fixed addresses) as a CUDA graph: the first
        call with `key` in the warm-up captures it (after running it eagerly, which does that
        call's work and creates any state lazily), later calls replay it. Off CUDA, or for a key
        the warm-up did not meet, fn runs eagerly.

        With a compiler, fn (a functools.partial) is compiled: one kernel per fused region of
        its math instead of one per op. A key's first call runs the plain fn, so that the state
        it creates exists before a compiled graph reads it (a graph that created state would be
        traced again on the next call); in the warm-up the compiled fn then runs at once, so it
        compiles there (and is what the graph captures). The extra updates are the warm-up's,
        which restores the optimizers' state after it."""
        graph = self.optimizer_graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self.compiler is not None:
            if key not in self.updates_seen:
                self.updates_seen.add(key)
                if not self.in_warm_up:
                    self.eager_runs += self.capturing
                    fn()
                    return
                if self.capturing:
                    self._on_capture_stream(fn)
                else:
                    fn()
            fn = self._compiled(fn, key)
        if self.capturing and self.in_warm_up:
            self.optimizer_graphs[key] = self._capture(fn, f"optimizer update {key[0]}")
        else:
            self.eager_runs += self.capturing
            fn()

    def _compiled(self, fn, key):
        """The partial fn with its function compiled (once per function: each key's arguments
        get a graph of their own in dynamo's cache of that function's code, which must hold
        them all, those of every StepGraphs of the process included)."""
        if fn.func not in self.compiled:
            self.compiled[fn.func] = self.compiler(fn.func)
        code = getattr(fn.func, "__func__", fn.func).__code__
        if (code, key) not in self.keys_compiled:
            self.keys_compiled.add((code, key))
            _GRAPHS_OF_CODE[code] += 1
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, _GRAPHS_OF_CODE[code])
        return functools.partial(self.compiled[fn.func], *fn.args, **fn.keywords)

    def _capture(self, fn, what):
        """A CUDA graph of fn(), after one eager run of it on the capture stream, as capture
        requires (that run also does this call's work: a capture only records)."""
        self._on_capture_stream(fn)
        return self._record(fn, what)

    def _on_capture_stream(self, fn):
        """fn() eagerly on the stream the captures use (made once), ordered after the current
        stream's work and before its next."""
        if self.capture_stream is None:
            self.capture_stream = torch.cuda.Stream()
        self.capture_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.capture_stream):
            fn()
        torch.cuda.current_stream().wait_stream(self.capture_stream)

    def _record(self, fn, what):
        """A CUDA graph of fn() (its eager run done on the capture stream), in the graphs' pool."""
        # The eager runs' freed blocks go back to the driver: a capture allocates in the graphs'
        # own pool, and while it is under way the allocator frees no cached block to make room.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                fn()
        except RuntimeError as error:
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise TrainingError(f"capturing the {what} as a CUDA graph failed ({first_line}): rerun with "
                                f"--cuda_graphs=false") from error
        return graph

    def zero_grads(self):
        """Zero every run gradient in place and detach them all (the state of a fresh run)."""
        for grad in self.grads.values():
            grad.zero_()
        for p in self.params:
            p.grad = None
        self.attached = None

    def captured(self):
        return sum(step.graph is not None for step in self.steps.values())
