"""The sampled softmax's candidates: which vocabulary columns a sampled step's cross-entropy
covers (every distinct target plus negatives from a fixed walk over the vocabulary, record 92's
rule), the targets mapped to those columns, and where the walk goes on from. Fixed sizes and no
host value: a captured step computes them on the device.
"""
import torch

from machinery.config import PADDED_VOCAB_SIZE, POINTER_COPY_ID

CANDIDATE_STRIDE = 20011           # record 92's walk k -> k * 20011 mod V: coprime to 50304, it visits every id once
CANDIDATE_STRIDE_INVERSE = pow(CANDIDATE_STRIDE, -1, PADDED_VOCAB_SIZE)  # id -> its position k in the walk
NEGATIVE_DRAW_FACTOR, NEGATIVE_DRAW_EXTRA = 1.7, 256  # record 92: a step draws 1.7 x its negatives + 256 ids


def copy_column(columns):
    """The <copy> slot's column: its id (full vocabulary), or its index among the sorted
    candidate `columns` (which hold it: candidate_columns' `always`), as a 0-d tensor."""
    if columns is None:
        return POINTER_COPY_ID
    return (columns < POINTER_COPY_ID).sum()   # on the device, from no host value: a captured step can hold it


def ids_to_columns(ids, columns):
    """Map vocab ids to their index in the sorted `columns`; ids not among them become -1."""
    pos = torch.searchsorted(columns, ids.clamp(min=0)).clamp(max=columns.numel() - 1)
    return torch.where((ids >= 0) & (columns[pos] == ids), pos, -1)


def candidate_start(slice_index, slices):
    """Where the candidate walk of the global batch's slice `slice_index` of `slices` starts:
    slice x V / slices, record 92's rank x V / 8 (each GPU's slice, on fewer GPUs each micro-batch)."""
    return slice_index * PADDED_VOCAB_SIZE // slices


def candidate_columns(targets, count, start, always=()):
    """Sampled-softmax candidates: `count` sorted vocabulary ids, every distinct target id of the
    batch plus deterministic uniform negatives.

    Negatives are the first non-target ids of the walk k -> k * CANDIDATE_STRIDE mod V from
    k = start = candidate_start(slice, slices), an int or a 0-d int64 tensor on targets' device
    (a captured step reads it from a buffer): record 92's rule (it draws 1.7 x the negatives it
    needs + 256 from the walk, removes the targets and duplicates, and keeps the first). Each id
    gets a priority, its position in the walk after `start`, raised by V for non-targets; the
    `count` lowest win. The size is fixed, so the step needs no host sync: if a batch ever had
    more than `count` distinct targets, those latest in the walk would be left out of its softmax.
    `always`: ids taken as targets are (the pointer mixture's <copy> slot, as PR 379 forces it in).
    """
    V = PADDED_VOCAB_SIZE
    ids = torch.arange(V, device=targets.device)
    walk_position = (ids * CANDIDATE_STRIDE_INVERSE - start) % V
    present = torch.where(targets >= 0, targets, V).flatten()      # absent targets land on a spare slot
    is_target = torch.zeros(V + 1, dtype=torch.bool, device=targets.device).index_fill_(0, present, True)[:V]
    for i in always:               # filled in place from a Python scalar: x[i] = True would copy a host tensor
        is_target.narrow(0, i, 1).fill_(True)
    priority = walk_position + V * (~is_target)
    return priority.topk(count, largest=False, sorted=False).indices.sort().values

def candidate_walk_after(targets, count, start):
    """Where the next sampled step's walk starts (candidate_walk "continue"): record 92 moves it past
    the ids it drew, min(V, int(1.7 x need) + 256) for the `need` = count - distinct targets
    negatives (none drawn when the targets fill the count). A 0-d tensor: no host sync."""
    V = PADDED_VOCAB_SIZE
    present = torch.where(targets >= 0, targets, V).flatten()
    distinct = torch.zeros(V + 1, dtype=torch.bool, device=targets.device).index_fill_(0, present, True)[:V].sum()
    need = count - distinct
    draw = torch.clamp((need.double() * NEGATIVE_DRAW_FACTOR).floor().long() + NEGATIVE_DRAW_EXTRA, max=V)
    return (start + torch.where(need > 0, draw, 0)) % V
