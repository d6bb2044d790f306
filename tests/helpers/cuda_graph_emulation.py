"""CUDA graph semantics on a CPU, for tests of code that the trainer captures and replays.

A CUDA graph records the kernels a stretch of code launches during a capture and relaunches
them on each replay: the same kernels, the same scalar arguments, the same memory addresses.
Code is safe to capture when every replay should do exactly that. CPUGraph emulates it: the
capture records the torch ops the code dispatches, and a replay runs them again on the
addresses they used, so a test can compare a captured-and-replayed run against plain eager
steps without a GPU.
"""
import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CPUGraph:
    """A CUDA graph's semantics on a CPU. The capture records every op the body dispatches, with
    its arguments (it also runs them, which a real capture does not). A replay runs the recorded
    ops again with the captured scalars, addressing memory as the capture did: a tensor on
    memory from outside the graph (parameters, gradients, buffers) is used as it was at the
    capture (same memory, sizes and strides), and one on
    memory an earlier recorded op made is rebuilt, same offset, sizes and strides, on the memory
    that op's replay made. So a replay reads and writes what the capture saw, as a CUDA graph
    does: a value the body took from Python, or a tensor it found somewhere that has since been
    replaced, stays as it was at capture."""

    def __init__(self):
        self.ops = []              # (op, args, kwargs, outputs) as captured; keeps their memory alive
        self.replays = 0

    def replay(self):
        self.replays += 1
        made = {}                  # address of memory a captured op made -> the replay's storage

        def on_replayed_memory(t):
            storage = made.get(t.untyped_storage().data_ptr()) if isinstance(t, torch.Tensor) else None
            if storage is None:
                return t
            return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())
        with torch.no_grad():
            for op, args, kwargs, outputs in self.ops:
                args, kwargs = torch.utils._pytree.tree_map(on_replayed_memory, (args, kwargs))
                result = op(*args, **kwargs)
                for old, new in zip(torch.utils._pytree.tree_leaves(outputs), torch.utils._pytree.tree_leaves(result)):
                    if isinstance(old, torch.Tensor) and old.untyped_storage().data_ptr():
                        made[old.untyped_storage().data_ptr()] = new.untyped_storage()


class CPUCapture(TorchDispatchMode):
    """torch.cuda.graph(graph) for a CPUGraph: records the ops dispatched inside it."""

    def __init__(self, graph, pool=None, fail=None):
        super().__init__()
        self.graph, self.fail = graph, fail

    @classmethod
    def ignore_compile_internals(cls):
        """A compiled function runs compiled under the capture, which records the ops its compiled
        code runs, as a CUDA graph records the kernels compiled code launches (a mode without
        this makes torch.compile skip the frame and run it uncompiled)."""
        return True

    def __enter__(self):
        if self.fail:
            raise RuntimeError(self.fail)
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func.namespace != "profiler":   # record_function's markers are host-side
            self.graph.ops.append(torch.utils._pytree.tree_map(as_captured, (func, args, kwargs, result)))
        return result


def as_captured(value):
    """What a capture keeps of an op's argument or output: a tensor's memory, sizes and strides as
    they were (a detached alias: a later change of the tensor's .data, or its autograd graph,
    is none of a replay's business, and the capture keeps no autograd node alive), anything
    else as it is."""
    return value.detach() if isinstance(value, torch.Tensor) else value
