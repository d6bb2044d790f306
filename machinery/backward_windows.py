"""The choice of each attention head's truncated backward window (PR 371).

At the choice steps every attention layer's inputs and output gradient are kept (the model's
probes); for each candidate window w below the layer's forward window, the layer's backward is
run again with every head truncated to w, and each head's error is the largest relative L2
distance ||g_w - g|| / ||g|| of its dQ, dK and dV from the exact backward's, over that head's
rows. The largest error over the choice steps and the ranks (an all-reduce of the maximum, so
that every rank chooses alike) picks, per head, the smallest candidate within the bound, or the
full window (0) where none is. The cost: per layer and choice step one exact and one truncated
backward per candidate, each with its forward (attention_fn recomputes it), outside any graph.
"""
import contextlib

import torch

FULL = 0                           # a head whose backward stays exact


def candidates_below(candidates, forward_window):
    """The candidate windows that truncate anything: those below the forward window (tokens)."""
    return tuple(w for w in sorted(candidates) if w < forward_window)


def _gradients(attention_fn, q, k, v, grad_o, cu_seqlens, window, scale, backward_windows=None):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        if backward_windows is None:
            o = attention_fn(*leaves, cu_seqlens, window, scale)
        else:
            o = attention_fn(*leaves, cu_seqlens, window, scale, backward_windows=backward_windows)
        return torch.autograd.grad(o, leaves, grad_o.to(o.dtype))


def relative_errors(got, exact):
    """(H,): the largest over the gradients (T, H, D) of ||got - exact|| / ||exact|| per head
    (fp32 sums; a head whose exact gradient is zero counts its error as ||got||)."""
    worst = None
    for g, e in zip(got, exact):
        g, e = g.float(), e.float()
        error = (g - e).norm(dim=(0, 2)) / e.norm(dim=(0, 2)).clamp_min(torch.finfo(torch.float32).tiny)
        worst = error if worst is None else torch.maximum(worst, error)
    return worst


def backward_window_errors(attention_fn, q, k, v, grad_o, cu_seqlens, window, scale, candidates):
    """(len(candidates), H) fp32: each candidate window's error per head (relative_errors) against
    the exact backward of attention_fn (flash_attn_varlen or attention_reference) on q, k, v
    (T, H, D) and the output gradient grad_o of one call."""
    exact = _gradients(attention_fn, q, k, v, grad_o, cu_seqlens, window, scale)
    rows = []
    for w in candidates:
        table = torch.full((q.shape[1],), w, dtype=torch.int32, device=q.device)
        rows.append(relative_errors(_gradients(attention_fn, q, k, v, grad_o, cu_seqlens, window, scale, table), exact))
    return torch.stack(rows) if rows else q.new_zeros((0, q.shape[1]), dtype=torch.float32)


def pick_windows(errors, candidates, bound):
    """int64 (H,): per head the smallest of `candidates` (ascending, one row of `errors` each)
    whose error is at most `bound`; FULL where none is."""
    chosen = torch.full((errors.shape[1],), FULL, dtype=torch.int64)
    for row in reversed(range(len(candidates))):       # the smallest passing one is written last
        chosen = torch.where(errors[row].cpu() <= bound, candidates[row], chosen)
    return chosen


class WindowChoice:
    """The errors seen so far, per attention layer: the maximum over the choice steps."""

    def __init__(self, candidates, bound):
        self.candidates, self.bound = tuple(sorted(candidates)), bound
        # layer -> ((len(candidates), H) errors, how many of the candidates some call measured)
        self.errors = {}

    def observe(self, layer, attention_fn, probe):
        """One call's probe (q, k, v, grad_o, cu_seqlens, window, scale) of `layer`. A candidate at
        least as wide as the call's window leaves its backward exact: error 0 there. Calls of one
        layer may have different windows (choice steps in two stages): the errors are the maximum
        per candidate, and only candidates some call truncated (measured) can be chosen."""
        q, k, v, grad_o, cu_seqlens, window, scale = probe
        offered = candidates_below(self.candidates, window)
        errors = torch.zeros((len(self.candidates), q.shape[1]), dtype=torch.float32, device=q.device)
        errors[:len(offered)] = backward_window_errors(attention_fn, q, k, v, grad_o, cu_seqlens, window, scale,
                                                       offered)
        before, measured = self.errors.get(layer, (errors, 0))
        self.errors[layer] = (torch.maximum(before, errors), max(measured, len(offered)))

    @contextlib.contextmanager
    def probing(self, blocks, attention_fn, on):
        """While on (a choice step), every attention layer of `blocks` keeps its calls' inputs and
        output gradients (its `probe`); after the step each call's errors are observed."""
        layers = [(i, block.attn) for i, block in enumerate(blocks) if block.attn is not None] if on else []
        for _, attn in layers:
            attn.probe = []
        try:
            yield
        finally:
            for i, attn in layers:
                for probe in attn.probe:
                    self.observe(i, attention_fn, probe)
                attn.probe = None

    def apply(self, blocks, all_reduce_max=None):
        """Choose (see choose) and write each layer's windows into its table in place; returns the
        log's line of the choice."""
        chosen = self.choose(all_reduce_max)
        for i, windows in chosen.items():
            blocks[i].attn.set_backward_windows(windows)
        return choice_line(chosen)

    def choose(self, all_reduce_max=None):
        """{layer: int64 (H,) windows}; all_reduce_max(tensor) makes the errors every rank's maximum."""
        chosen = {}
        for layer, (errors, measured) in sorted(self.errors.items()):
            if all_reduce_max is not None:
                all_reduce_max(errors)
            chosen[layer] = pick_windows(errors[:measured], self.candidates[:measured], self.bound)
        return chosen


def choice_line(chosen):
    """The log's line of the chosen windows: each layer's heads, 'full' where exact."""
    parts = [f"layer {layer}: " + " ".join("full" if w == FULL else str(int(w)) for w in windows.tolist())
             for layer, windows in sorted(chosen.items())]
    return "attention backward windows: " + ("; ".join(parts) if parts else "none (no attention layer)")
