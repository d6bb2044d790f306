"""The Triton kernels torch.compile's Inductor generates for one compiled micro-batch of a preset,
counted on a CPU, beside the step model's count of fused-region kernels for the same micro-batch.

    python bench/inductor_census.py                   # speedrun's stage-2 shapes at 256 tokens (a few minutes)
    python bench/inductor_census.py --tokens 1024     # more tokens: closer to the run, slower
    python bench/inductor_census.py --write-code DIR  # also keep the generated forward and backward

How. The micro-batch runs once on CPU tensors with the GPU path's kernels (the Triton interpreter
runs them), compiled by torch.compile with a backend that keeps AOTAutograd's forward and backward
graphs, decomposed with Inductor's own table as Inductor's backend does. Each graph then goes
through Inductor's code generation for its Triton backend (config.cpu_backend = "triton"), which
schedules and fuses as for a GPU and writes each kernel's source; the generated module is read,
not compiled or run. Counted there: the launches of Inductor's Triton kernels (pointwise,
persistent reduction, looped reduction) and the calls of library and custom kernels (matmuls, our
kernels.py ops). The step model fuses each run of fusible ops between two other kernels into one
region and counts a kernel per size of output the region writes, plus one per reduction
(bench/step_model.py, _region_op); that count, at the same shapes, is printed beside.

The n-gram table is made small (--ngram_rows, its rows only change the gather's source) so that
the model fits a CPU's memory; the stage's tokens, document length and sampled softmax width are
this script's, its windows and the schedule's other values the preset's at the stage's first step.
"""
import argparse
import collections
import dataclasses
import os
import pathlib
import re
import sys
import time

if __name__ == "__main__":        # the GPU path's kernels run on the CPU (set before triton is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "bench"))

import step_model as sm  # noqa: E402  (puts the repository and tests/helpers on the path)
import train_gpt  # noqa: E402
from cuda_autocast import cuda_autocast_rules  # noqa: E402
from machinery import ngram_table  # noqa: E402
from machinery.cuda_graphs import MicroBatch  # noqa: E402

KERNEL_KINDS = {"poi": "pointwise", "per": "persistent reduction", "red": "looped reduction"}


def captured_graphs(h, stage, step):
    """[(phase, GraphModule, example inputs)] of the compiled forward and backward of one
    micro-batch of `stage` at `step`: the graphs Inductor would compile."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    graphs = []

    def keep(phase):
        def compiler(gm, inputs):
            graphs.append((phase, gm, inputs))
            return make_boxed_func(gm.forward)
        return compiler
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           decompositions=select_decomp_table())
    T = stage.tokens_per_rank
    generator = torch.Generator().manual_seed(0)
    zeros = MicroBatch.zeros(stage)
    cu_seqlens = torch.full_like(zeros.cu_seqlens, T)   # four documents, the rest of the bounds at the end
    cu_seqlens[:5] = torch.tensor([0, T // 4, T // 2, 3 * T // 4, T])
    batch = MicroBatch(torch.randint(0, train_gpt.VOCAB_SIZE, (T,), generator=generator, dtype=torch.int32),
                       torch.randint(0, train_gpt.VOCAB_SIZE, zeros.targets.shape, generator=generator),
                       cu_seqlens, zeros.candidate_start)
    with cuda_autocast_rules():
        model = train_gpt.build_model(h, sm.kernel_fns(h), ngram_table.TablePlacement(0, 1, h.ngram_cache_rows))
        train_gpt.model_at(model, h, step)
        model.set_loss_unit(1.0 / T)
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
        with model.sinks_of(T):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=h.compute_dtype == "bfloat16"):
                objective, _ = train_gpt.micro_batch_losses(compiled, stage, train_gpt.attention_windows(h, step),
                                                            batch, train_gpt.target_weights(stage, "cpu"))
            objective.backward()
    return graphs


class _Generated(Exception):
    """Raised once Inductor has written a graph's module: nothing after it is needed."""


def inductor_source(gm, inputs, backward):
    """The Python module Inductor's Triton backend generates for one graph, as text."""
    from torch._inductor import config, graph
    from torch._inductor.compile_fx import compile_fx_inner
    import torch.utils._triton
    written = []
    codegen = graph.GraphLowering.codegen

    def keep(self, *args, **kwargs):
        code = codegen(self, *args, **kwargs)
        written.append(code[0] if isinstance(code, tuple) else code)
        raise _Generated

    if not hasattr(torch.utils._triton, "triton_hash_with_backend") or not hasattr(graph.GraphLowering, "codegen"):
        raise SystemExit(f"inductor_census: torch {torch.__version__}'s Inductor lacks the hooks this script uses "
                         "(torch.utils._triton.triton_hash_with_backend, GraphLowering.codegen)")
    hash_fn = torch.utils._triton.triton_hash_with_backend
    torch.utils._triton.triton_hash_with_backend = lambda: "inductor_census"   # no GPU driver to ask
    graph.GraphLowering.codegen = keep
    try:
        with config.patch(cpu_backend="triton"):
            compile_fx_inner(gm, inputs, is_backward=backward)
    except Exception:              # _Generated, or Inductor's error wrapping it
        if not written:
            raise
    finally:
        graph.GraphLowering.codegen = codegen
        torch.utils._triton.triton_hash_with_backend = hash_fn
    return str(getattr(written[0], "value", written[0]))


TINY_ELEMENTS = 64                 # a kernel over at most this many elements: scale and amax bookkeeping
KERNEL_SOURCE = re.compile(r"^(\w+) = async_compile\.triton\('\w+', (?:'''|\"\"\")(.*?)(?:'''|\"\"\")", re.M | re.S)


def kernel_elements(source):
    """{Triton kernel name: elements it covers (xnumel times r0_numel)} of a generated module."""
    elements = {}
    for name, body in KERNEL_SOURCE.findall(source):
        x, r = re.search(r"xnumel = (\d+)", body), re.search(r"r0_numel = (\d+)", body)
        elements[name] = (int(x.group(1)) if x else 1) * (int(r.group(1)) if r else 1)
    return elements


def count_launches(source):
    """({kind: Triton kernel launches}, launches of kernels over at most TINY_ELEMENTS elements,
    library and custom kernel calls) of a generated module."""
    names = re.findall(r"^(\w+) = async_compile\.triton\('", source, re.M)
    kind = {name: KERNEL_KINDS.get(name.split("_")[1], name.split("_")[1]) for name in names}
    elements = kernel_elements(source)
    runs = [name for name in re.findall(r"^\s+(\w+)\.run\(", source, re.M) if name in kind]
    launches = collections.Counter(kind[name] for name in runs)
    tiny = sum(elements.get(name, TINY_ELEMENTS + 1) <= TINY_ELEMENTS for name in runs)
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    library = len(re.findall(r"(?:extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", code))
    return launches, tiny, library


def model_counts(h, index, step):
    """{phase: fused-region kernels} of the step model's census of one micro-batch."""
    census = sm.census_of_stage(h, index, 1, step)
    counts = collections.Counter()
    for op in census.micro_batch:
        if op.family == "pointwise":
            counts[op.phase] += op.kernels
    return counts


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="speedrun")
    p.add_argument("--stage", type=int, default=2, help="the preset's stage whose windows and targets are used")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the micro-batch (also its longest document)")
    p.add_argument("--candidates", type=int, default=1024, help="sampled softmax width (0: the full vocabulary)")
    p.add_argument("--ngram_rows", type=int, default=1 << 20)
    p.add_argument("--write-code", type=pathlib.Path, default=None, help="a folder for the generated modules")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    h = train_gpt.parse_config(["--preset", args.preset, f"--ngram_rows={args.ngram_rows}"])
    stage = dataclasses.replace(h.stages[args.stage], tokens_per_rank=args.tokens, max_doc_len=args.tokens,
                                candidates=args.candidates)
    h = dataclasses.replace(h, stages=[stage if i == args.stage else s for i, s in enumerate(h.stages)])
    step = sm.stage_first_step(h, args.stage)
    sm._fake_process_group(1)
    start = time.perf_counter()
    graphs = captured_graphs(h, stage, step)
    print(f"# Inductor's kernels: `{args.preset}`, stage {args.stage} at {args.tokens:,} tokens, "
          f"{args.candidates or 'all'} candidates, step {step} (graphs captured in {time.perf_counter() - start:.0f} s)\n")
    modelled = model_counts(h, args.stage, step)
    rows = []
    for phase, gm, inputs in graphs:
        source = inductor_source(gm, inputs, phase == "backward")
        if args.write_code:
            args.write_code.mkdir(parents=True, exist_ok=True)
            (args.write_code / f"{phase}.py").write_text(source)
        launches, tiny, library = count_launches(source)
        kinds = ", ".join(f"{kind} {n}" for kind, n in launches.most_common())
        rows.append([phase, sum(launches.values()), kinds, tiny, library, modelled[phase]])
    rows.append(["both", *(sum(r[i] for r in rows) if i != 2 else "" for i in range(1, 6))])
    print(sm.markdown(["graph", "Inductor's Triton launches", "by kind", f"over <= {TINY_ELEMENTS} elements",
                       "library and custom kernel calls", "step model's fused-region kernels"], rows))


if __name__ == "__main__":
    main()
