"""The kernel part of bench/first_contact.py: each kernel family timed against its torch peer at
the shapes it is given (the speedrun's per-GPU shapes on a GPU, tiny ones in the dry mode), the
outputs compared, and the step model's time beside each; and the split n-gram table's host
routing. Every bench takes (shapes, device, timer, dry) and returns its table rows (`Line`);
`KERNEL_BENCHES` names them. torch and the project's modules are imported inside each bench, so
that first_contact.py's parent process never loads them."""
import dataclasses
import functools
import statistics
import time

import numpy as np

ATTENTION_MATMULS = 7     # per visible pair and head dim: 2 forward (QK^T, PV), 5 backward (QK^T again, dV, dP, dQ, dK)
SYNTHETIC_DOC_LEN = 1000  # tokens between <|endoftext|> tokens in the synthetic shards
BOS = 50256               # <|endoftext|>, which starts every document

# The split n-gram table's host routing (sparse_tables.ShardedNgramRows.route_of), timed on the host:
# rank 0 of SPEEDRUN_PROCESSES, one micro-batch per stage shape, on synthetic tokens.
SPEEDRUN_PROCESSES = 8
ROUTING_SLICES = 8        # micro-batches timed per shape (the median is reported)
ZIPF_OFFSET = 2.7         # synthetic token ids: p(rank r) ~ 1 / (r + 2.7) over a shuffled vocabulary (Zipf-Mandelbrot)


@dataclasses.dataclass
class Line:
    """One row of the kernel table."""
    name: str
    shape: str
    ours_ms: float
    torch_ms: float
    flops: float = 0.0       # of one call, for TFLOP/s; 0 when not a matmul-bound line
    target: float = 0.0      # minimum torch_ms / ours_ms; 0 when informational
    model_ms: float = 0.0    # the step model's time of our call (bench/step_model.py, an H200, its efficiencies)
    error: float = -1.0      # relative Frobenius distance of our output from torch's (-1: not compared)
    tolerance: float = 0.0   # the largest error expected from the two computations' roundings
    # what the step model's structure-based line prices the call at (ms) and the structure it
    # names ("descriptor", "pointer", "cublas", "attention"): measured_efficiencies' inputs
    structure_ms: float = 0.0
    structure: str = ""

    @property
    def ratio(self):
        return self.torch_ms / self.ours_ms

    def missed(self):
        return bool(self.target) and self.ratio < self.target

    def disagrees(self):
        return self.error > self.tolerance

    def cells(self):
        tflops = (lambda ms: f"{self.flops / ms / 1e9:.0f}") if self.flops else (lambda ms: "-")
        verdict = "-" if not self.target else ("MISSED" if self.missed() else "ok")
        agree = "-" if self.error < 0 else f"{self.error:.1e}" + (" DIFFERS" if self.disagrees() else "")
        return [self.name, self.shape, f"{self.ours_ms:.3f}", f"{self.model_ms:.3f}" if self.model_ms else "-",
                f"{self.torch_ms:.3f}", tflops(self.ours_ms), tflops(self.torch_ms), f"{self.ratio:.2f}",
                f">= {self.target}" if self.target else "-", verdict, agree]


KERNEL_HEADER = ["kernel", "shape", "ours ms", "model ms", "torch ms", "ours TFLOP/s", "torch TFLOP/s", "torch/ours",
                 "target", "", "vs torch"]


def modelled_ms(flops=0.0, nbytes=0.0, family="gemm", dtype="fp8"):
    """The step model's time of a kernel (an H200 at bench/step_model.py's efficiencies)."""
    import step_model
    op = step_model.Op("bench", family, "bench", flops=flops, dtype=dtype, bytes=nbytes)
    return 1e3 * step_model.op_seconds(op, step_model.H200, step_model.REALISTIC, 1)


def relative_error(ours, theirs):
    """||ours - theirs|| / ||theirs||, in float64."""
    theirs = theirs.double()
    return float((ours.double() - theirs).norm() / theirs.norm().clamp_min(1e-30))


def markdown_table(header, rows):
    rows = [header, ["---"] * len(header)] + rows
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


class Timer:
    """Median milliseconds of a callable: triton.testing.do_bench on a GPU, one wall-clock run dry."""

    def __init__(self, dry):
        self.dry = dry

    def __call__(self, fn):
        if self.dry:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _fp8(shape, device, column_major=False):
    import torch
    t = torch.randn(*shape[::-1] if column_major else shape, device=device).to(torch.float8_e4m3fn)
    return t.t() if column_major else t


FP8_GEMM_TOLERANCE = 2 ** -7  # bf16 outputs of the same exact fp8 products, summed in other orders


# The implementations of a plain FP8 GEMM the kernel bench times, each by kernels.fp8_matmul's impl,
# with the structure the step model prices it by.
FP8_IMPLEMENTATIONS = (("tma", "descriptor"), ("pointer", "pointer"))


def structure_ms(flops, nbytes, m, k, n, fast, structure):
    """The step model's structure-based time of one FP8 GEMM on one structure (an H200)."""
    import step_model
    op = step_model.Op("bench", "gemm", "bench", flops=flops, dtype="fp8", bytes=nbytes,
                       structure=("fp8", m, k, n, fast, (structure,), None))
    return 1e3 * step_model.op_seconds(op, step_model.H200, step_model.STRUCTURE, 1)


def bench_fp8_matmul(shapes, device, timer, dry):
    """Each implementation of our FP8 GEMM (the persistent descriptor kernel with its split-K
    plan, the pointer kernel) against torch._scaled_mm in the accumulation mode production uses
    for each, every one's output compared with torch's before it is timed: the forward GEMMs with
    the fast accumulator (the MLP's, QKV's, the head's at every softmax width of the speedrun),
    the backward ones with fp32 accumulation every BLOCK_K (the weight gradient over the tokens,
    the head's input gradient over its columns). A line per implementation; torch's own line
    prices cuBLAS's structure."""
    import torch

    import kernels
    T, D, H = shapes["tokens"], shapes["width"], shapes["hidden"]
    forward = [("mlp up", T, D, H), ("mlp down", T, H, D), ("qkv", T, D, 3 * D)]
    forward += [(f"lm_head {w}", T, D, w) for w in shapes["softmax_widths"]]
    backward = [("mlp down wgrad", D, T, H), (f"lm_head dgrad {shapes['softmax_widths'][-1]}", T,
                                             shapes["softmax_widths"][-1], D)]
    scale = torch.ones((), device=device)
    lines = []
    for fast, problems in ((True, forward), (False, backward)):
        for name, m, k, n in problems:
            a, b = _fp8((m, k), device), _fp8((k, n), device, column_major=True)
            theirs_fn = lambda: torch._scaled_mm(a, b, scale_a=scale, scale_b=scale,  # noqa: E731
                                                 out_dtype=torch.bfloat16, use_fast_accum=fast)
            theirs = theirs_fn()
            theirs_ms = timer(theirs_fn)
            flops, nbytes = 2.0 * m * n * k, m * k + k * n + 2 * m * n
            accumulation = "fast" if fast else "fp32"
            for impl, structure in FP8_IMPLEMENTATIONS:
                ours_fn = lambda: kernels.fp8_matmul(a, b, scale, scale, torch.bfloat16, fast_accumulation=fast,  # noqa: E731
                                                     impl=impl)
                error = relative_error(ours_fn(), theirs)     # checked before it is timed
                lines.append(Line(f"fp8_matmul {name} ({accumulation} accumulation) [{impl}]", f"{m}x{k}x{n}",
                                  timer(ours_fn), theirs_ms, flops, target=0.9, model_ms=modelled_ms(flops, nbytes),
                                  error=error, tolerance=FP8_GEMM_TOLERANCE,
                                  structure_ms=structure_ms(flops, nbytes, m, k, n, fast, structure),
                                  structure=structure))
            lines.append(Line(f"fp8_matmul {name} ({accumulation} accumulation) [torch._scaled_mm]", f"{m}x{k}x{n}",
                              theirs_ms, theirs_ms, flops, model_ms=modelled_ms(flops, nbytes),
                              structure_ms=structure_ms(flops, nbytes, m, k, n, fast, "cublas"), structure="cublas"))
    return lines


def _forward_backward(fn, inputs, grad_output):
    """A callable running fn(*inputs) and its backward (grads of the inputs that require them)."""
    import torch

    def run():
        out = fn(*inputs)
        torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad_output)
    return run


def bf16_relu2_mlp(x, w_up, w_down):
    import torch
    return torch.relu(x @ w_up.t()).square() @ w_down.t()


def bench_fp8_layers(shapes, device, timer, dry):
    """The FP8 layers with the trainer's scale rules against bf16 torch: the MLP, the packed QKV
    projection and the head at the dominant stage's candidate width."""
    import torch

    import kernels
    T, D, H, C = shapes["tokens"], shapes["width"], shapes["hidden"], shapes["softmax_widths"][0]
    x = torch.randn(T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(T, D, device=device, dtype=torch.bfloat16)
    w_up = (torch.randn(H, D, device=device) * 0.02).bfloat16().requires_grad_(True)
    w_down = (torch.randn(D, H, device=device) * 0.02).bfloat16().requires_grad_(True)
    state = kernels.new_fp8_mlp_state(device)
    mlp_fp8 = lambda x, u, d: kernels.fp8_relu2_mlp(x, u, d, state, scales=kernels.MLP_SCALES_RECORD92)  # noqa: E731
    ours = timer(_forward_backward(mlp_fp8, [x, w_up, w_down], grad_y))
    theirs = timer(_forward_backward(bf16_relu2_mlp, [x, w_up, w_down], grad_y))
    lines = [Line("fp8_relu2_mlp fwd+bwd vs bf16", f"{T}x{D}x{H}", ours, theirs, 6 * 2.0 * T * D * H)]
    for name, rows, scales in (("qkv", 3 * D, kernels.QKV_SCALES), ("head", C, kernels.HEAD_SCALES)):
        linear_state = kernels.new_fp8_linear_state(device)
        w = (torch.randn(rows, D, device=device) * 0.02).bfloat16().requires_grad_(True)
        grad = torch.randn(T, rows, device=device, dtype=torch.bfloat16) / T
        kernels.set_fp8_loss_unit(linear_state, 1.0 / T)
        fp8 = lambda x, w: kernels.fp8_linear(x, w, linear_state, scales=scales)  # noqa: E731
        ours = timer(_forward_backward(fp8, [x, w], grad))
        theirs = timer(_forward_backward(lambda x, w: x @ w.t(), [x, w], grad))
        lines.append(Line(f"fp8_linear {name} fwd+bwd vs bf16", f"{T}x{D}x{rows}", ours, theirs,
                          3 * 2.0 * T * D * rows))
    return lines


def zipf_slices(count, num_tokens, median_doc, generator):
    """`count` slices of num_tokens synthetic token ids (int32), each id drawn independently with
    p(rank r) ~ 1 / (r + ZIPF_OFFSET) over a shuffled vocabulary, a document start (BOS) before
    each log-normal document. Independent draws: more distinct bigrams and trigrams than text."""
    import step_model
    import torch
    vocab = np.arange(BOS)
    p = 1.0 / (vocab + ZIPF_OFFSET)
    ids = generator.permutation(BOS)
    out = []
    for _ in range(count):
        tokens = ids[generator.choice(vocab, size=num_tokens, p=p / p.sum())].astype(np.int32)
        tokens[np.cumsum([0] + step_model.uneven_document_lengths(num_tokens, median_doc, num_tokens,
                                                                  generator))[:-1]] = BOS
        out.append(torch.from_numpy(tokens))
    return out


ROUTING_WAYS = ("route_of", "fetch with the route", "fetch gathering")


def routing_host_ms(shapes, token_counts, pin, way="route_of"):
    """{tokens per slice: median ms of the split table's host routing of one micro-batch} on this
    host, as rank 0 of SPEEDRUN_PROCESSES with the speedrun's table, `way` one of ROUTING_WAYS:
    ShardedNgramRows.route_of from every process's slice (`pin`: into pinned memory, as on a GPU;
    the batch prefetcher's work); the training loop's fetch given that route; or the fetch that
    gathers the tokens first (the gather simulated, its time left out) and works the route out on
    its way. The fetches' collectives are left out; on a CPU their gather of the asked rows is
    host work, on a GPU a kernel."""
    import torch
    import torch.distributed as dist

    import train_gpt as tg
    from machinery import ngram_table
    from machinery import sparse_tables
    world, generator = SPEEDRUN_PROCESSES, np.random.default_rng(0)
    cpu = torch.device("cpu")
    table = ngram_table.NgramTable(shapes["ngram_rows"] * world, 8, max(token_counts), torch.bfloat16,
                                   ngram_table.TablePlacement(0, world, 0, cpu))    # 8 wide: the routing does not read the values
    router = sparse_tables.ShardedNgramRows(table, None, tg.ProcessGroup(0, world, 0, cpu))
    router._pinned = (lambda host: host.pin_memory()) if pin else router._pinned
    medians = {}
    for tokens in token_counts:
        times = []
        for _ in range(ROUTING_SLICES + 1):     # the first one untimed
            everyone = zipf_slices(world, tokens, shapes["doc_median"], generator)
            route = router.route_of(everyone[0], everyone) if way == "fetch with the route" else None
            gather, move = dist.all_gather, dist.all_to_all_single
            dist.all_gather = lambda out, mine, group=None: [o.copy_(t) for o, t in zip(out, everyone)]
            dist.all_to_all_single = lambda *args, **kwargs: None
            try:
                start = time.perf_counter()
                if way == "route_of":
                    router.route_of(everyone[0], everyone)
                else:
                    router.fetch(everyone[0], route=route)
                times.append(1000 * (time.perf_counter() - start))
            finally:
                dist.all_gather, dist.all_to_all_single = gather, move
        medians[tokens] = statistics.median(times[1:])
    return medians


def routing_line(routing_ms):
    return ("split n-gram table's host routing per micro-batch (ShardedNgramRows.route_of, rank 0 of "
            f"{SPEEDRUN_PROCESSES}, synthetic Zipf tokens, median of {ROUTING_SLICES}): "
            + ", ".join(f"{t:,} tokens {ms:.1f} ms" for t, ms in sorted(routing_ms.items()))
            + "; the batch prefetcher's thread does it a step ahead")


def visible_pairs(lengths, window):
    """Query-key pairs that causal attention within each document and a sliding window sees."""
    total = 0
    for length in lengths:
        w = min(length, window) if window > 0 else length
        total += w * (w + 1) // 2 + (length - w) * w
    return total


def flex_attention_fn(lengths, window, scale, device, dry):
    """flex_attention (compiled on the GPU) with the document + causal + sliding-window mask of
    flash_attn_varlen, on (T, H, D) tensors like ours; its block mask is built here, once."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device))
    T = len(doc)

    def document_window_mask(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    block_mask = create_block_mask(document_window_mask, None, None, T, T, device=device)
    attend = flex_attention if dry else torch.compile(flex_attention, dynamic=False)

    def attention(q, k, v):
        out = attend(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)), block_mask=block_mask, scale=scale)
        return out.transpose(1, 2).squeeze(0)
    return attention


def sdpa_equal_documents_fn(num_docs, doc_len, scale, dry):
    """scaled_dot_product_attention (flash backend on the GPU) over equal-length causal documents."""
    import torch
    import torch.nn.functional as F

    def attention(q, k, v):
        batch = [as_documents(t, num_docs, doc_len) for t in (q, k, v)]
        if dry:
            return F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*batch, is_causal=True, scale=scale)
    return attention


def as_documents(t, num_docs, doc_len):
    """(T, H, D) packed tokens as a (num_docs, H, doc_len, D) view."""
    return t.view(num_docs, doc_len, *t.shape[1:]).transpose(1, 2)


ATTENTION_TOLERANCE = 2 ** -6   # bf16 outputs of two FlashAttention-style kernels (P rounded to bf16 in each)


def _structure_efficiency():
    import step_model
    return step_model.STRUCTURE


def _attention_and_grads(fn, q, k, v, grad_o):
    """[output, dq, dk, dv] of fn on detached copies of q, k, v."""
    import torch
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    return [out.detach(), *torch.autograd.grad(out, leaves, grad_o)]


def measured_efficiencies(lines):
    """The efficiencies the step model's measured line takes from the kernel bench: per FP8
    structure (the persistent descriptor kernel, the pointer kernel, cuBLAS) and for attention,
    the structure-based share times the median over its lines of (the structure-based line's time
    / the measured time). None without such lines."""
    import step_model
    ratios = {}
    for line in lines:
        if line.structure and line.structure_ms and line.ours_ms > 0:
            ratios.setdefault(line.structure, []).append(line.structure_ms / line.ours_ms)
    if not ratios:
        return None
    base = step_model.STRUCTURE.structures
    found = {"fp8": {s: base.fp8[s] * statistics.median(r) for s, r in ratios.items() if s in base.fp8}}
    if "attention" in ratios:
        found["attention_long"] = base.attention_long * statistics.median(ratios["attention"])
    return found


def attention_events(lengths, window, d, heads, impl):
    """The step model's census events of one flash_attn_varlen call (forward, backward) with the
    window's launch configs and implementation `impl`."""
    import kernels
    import step_model
    T = sum(lengths)
    configs = [value for c in kernels.attention_configs(window) for value in c.as_list()]
    meta = [((T, heads, d), None)] * 4
    return [step_model.Event(name, "bench", [], [], meta, [], args=(window, *configs, impl))
            for name in ("kernels.attn_fwd", "kernels.attn_bwd")]


def modelled_attention_ms(lengths, window, d, heads, impl="auto", eff=None):
    """The step model's forward+backward time of flash_attn_varlen with `impl`: the tiles its
    kernels visit at this window (kernels.attention_configs), at the record-89 attention
    efficiency (eff None) or priced by structure (eff step_model.STRUCTURE)."""
    import step_model
    total = 0.0
    for event in attention_events(lengths, window, d, heads, impl):
        op = step_model._kernel_op(event, lengths)
        total += step_model.op_seconds(op, step_model.H200, eff or step_model.REALISTIC, 1)
    return 1e3 * total


# Our attention's backwards the kernel bench times beside each other.
ATTENTION_BACKWARDS = ("atomic", "deterministic")


def bench_attention(shapes, device, timer, dry):
    """Our attention against compiled flex_attention with the same document and window mask, at
    the dominant stage's windows (the short layers' and the long ones': each picks its tiles), and
    against SDPA's flash backend on equal causal documents; the forward outputs compared."""
    import step_model
    import torch

    import kernels
    T, L = shapes["tokens"], shapes["doc_len"]
    lengths = step_model.uneven_document_lengths(T, shapes["doc_median"], shapes["max_doc_len"],
                                                 np.random.default_rng(0))
    uneven_cu_seqlens = torch.tensor(np.cumsum([0] + lengths), device=device, dtype=torch.int32)
    equal_cu_seqlens = torch.arange(0, T + 1, L, device=device, dtype=torch.int32)
    lines = []
    for d, heads in ((128, 6), (64, 12)):
        q, k, v = (torch.randn(T, heads, d, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad_o = torch.randn(T, heads, d, device=device, dtype=torch.bfloat16)
        scale = d ** -0.5
        flops_per_pair = ATTENTION_MATMULS * 2.0 * d * heads

        for window in shapes["windows"]:
            flex = flex_attention_fn(lengths, window, scale, device, dry)
            theirs = timer(lambda: flex(q.detach(), k.detach(), v.detach())) if dry else \
                timer(_forward_backward(flex, [q, k, v], grad_o))
            reference = _attention_and_grads(lambda q, k, v: kernels.attention_reference(q, k, v, uneven_cu_seqlens,
                                                                                         window, scale), q, k, v, grad_o)
            for impl in ATTENTION_BACKWARDS:
                ours_fn = functools.partial(kernels.flash_attn_varlen, cu_seqlens=uneven_cu_seqlens, window=window,
                                            softmax_scale=scale, impl=impl)
                # checked against the reference (forward and gradients) before it is timed
                error = max(relative_error(g, r) for g, r in zip(_attention_and_grads(
                    lambda q, k, v: ours_fn(q, k, v), q, k, v, grad_o), reference))
                ours = timer(_forward_backward(lambda q, k, v: ours_fn(q, k, v), [q, k, v], grad_o))
                lines.append(Line(f"flash_attn_varlen fwd+bwd d={d} [{impl}] vs flex_attention",
                                  f"{T} tok in {len(lengths)} docs, window {window}, {heads} heads", ours, theirs,
                                  flops_per_pair * visible_pairs(lengths, window), target=1.0,
                                  model_ms=modelled_attention_ms(lengths, window, d, heads, impl), error=error,
                                  tolerance=ATTENTION_TOLERANCE, structure_ms=modelled_attention_ms(
                                      lengths, window, d, heads, impl, _structure_efficiency()),
                                  structure="attention"))

        ours = timer(_forward_backward(
            lambda q, k, v: kernels.flash_attn_varlen(q, k, v, equal_cu_seqlens, 0, scale), [q, k, v], grad_o))
        theirs = timer(_forward_backward(sdpa_equal_documents_fn(T // L, L, scale, dry), [q, k, v],
                                         as_documents(grad_o, T // L, L)))
        lines.append(Line(f"flash_attn_varlen fwd+bwd d={d} vs SDPA flash",
                          f"{T // L}x{L} tok causal, {heads} heads", ours, theirs,
                          flops_per_pair * visible_pairs([L] * (T // L), 0), target=1.0))
    return lines


def bench_cross_entropy(shapes, device, timer, dry):
    import torch
    import torch.nn.functional as F

    import kernels
    T = shapes["tokens"]
    lines = []
    for columns in (*shapes["softmax_widths"], shapes["vocab"]):
        logits = torch.randn(T, columns, device=device, dtype=torch.bfloat16, requires_grad=True)
        targets = torch.randint(0, columns, (T, 1), device=device)
        weights = torch.ones(1, device=device)
        one = torch.ones((), device=device)
        ours_fn = lambda x: kernels.softcap_cross_entropy(x, targets, weights)[0].sum()  # noqa: E731
        theirs_fn = lambda x: F.cross_entropy(kernels.softcap(x), targets[:, 0], reduction="sum")  # noqa: E731
        ours, theirs = timer(_forward_backward(ours_fn, [logits], one)), timer(_forward_backward(theirs_fn, [logits], one))
        with torch.no_grad():
            error = relative_error(ours_fn(logits), theirs_fn(logits))
        # one pass reading the logits and writing their gradient
        lines.append(Line("softcap_cross_entropy fwd+bwd", f"{T}x{columns}", ours, theirs, target=2.0,
                          model_ms=modelled_ms(nbytes=4.0 * T * columns, family="kernel"), error=error,
                          tolerance=1e-5))
    return lines


def bench_xxt(shapes, device, timer, dry):
    import torch

    import kernels
    lines = []
    for shape in shapes["muon"]:
        x = torch.randn(*shape, device=device, dtype=torch.bfloat16)
        ours = timer(lambda: kernels.xxt(x))
        theirs = timer(lambda: x @ x.mT)
        batch, m, n = shape
        lines.append(Line("xxt", "x".join(map(str, shape)), ours, theirs, 2.0 * batch * m * m * n))
    return lines


def bench_qk_norm_rope(shapes, device, timer, dry):
    """The QK norm + RoPE kernel (with the key offset) against the same math in torch ops, both
    forward and backward on q, k views of a packed projection (informational: memory bound)."""
    import torch

    import kernels
    T, D = shapes["tokens"], shapes["width"]
    head_dim = 16 if dry else 128
    heads = D // head_dim
    qkv = torch.randn(T, 3 * D, device=device, dtype=torch.bfloat16, requires_grad=True)
    q, k = qkv[:, :D].view(T, heads, head_dim), qkv[:, D:2 * D].view(T, heads, head_dim)
    angles = torch.rand(T, head_dim // 2, device=device)
    stationary = torch.arange(head_dim, device=device) % (head_dim // 2) >= head_dim // 4
    doc_start = torch.arange(T, device=device) % SYNTHETIC_DOC_LEN == 0
    grads = [torch.randn(T, heads, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2)]

    def run(fn):
        def step():
            outs = fn(q, k, angles.cos(), angles.sin(), stationary, doc_start)
            torch.autograd.grad(outs, [qkv], grads)
        return step
    ours, theirs = timer(run(kernels.qk_norm_rope)), timer(run(kernels.qk_norm_rope_reference))
    return [Line("qk_norm_rope fwd+bwd vs torch ops (eager)", f"{T}x{heads}x{head_dim}", ours, theirs)]


def bench_sparse_rows(shapes, device, timer, dry):
    """The n-gram table's sparse path at one rank's share of the full table (zero rows, as the
    table starts): a bigram and a trigram row per token, skewed towards low rows so that rows
    repeat as frequent n-grams do. Grouping and summing the gradient entries per distinct row
    against torch.unique + index_add_, and the sparse Adam row update against its torch
    reference (informational: memory bound)."""
    import torch

    import kernels
    T, D, rows = shapes["tokens"], shapes["width"], shapes["ngram_rows"]
    generator = torch.Generator(device=device).manual_seed(0)
    entries = (torch.rand(2 * T, device=device, generator=generator) ** 3 * rows).long()
    values = torch.randn(2 * T, D, device=device, dtype=torch.bfloat16)

    def ours_sum():
        return kernels.sum_rows(values, kernels.distinct_rows(entries))

    def torch_sum():
        unique, inverse = torch.unique(entries, return_inverse=True)
        return torch.zeros(unique.numel(), D, device=device).index_add_(0, inverse, values.float())
    lines = [Line("distinct_rows + sum_rows vs unique + index_add_", f"{2 * T}x{D}", timer(ours_sum),
                  timer(torch_sum))]
    table = torch.zeros(rows, D, device=device, dtype=torch.bfloat16)
    moment = torch.zeros(rows, device=device)
    last = torch.zeros(rows, device=device, dtype=torch.int32)
    log_decay_at = torch.zeros(8, device=device, dtype=torch.float64)
    groups, grads = kernels.distinct_rows(entries), ours_sum()
    step = kernels.RowAdamStep(event=1, log_decay=0.0, one_minus_beta2=0.05, bias=0.05, lr=0.01, decay=0.0, eps=1e-10)
    ours = timer(lambda: kernels.sparse_adam_rows_(table, grads, groups, moment, last, log_decay_at, step))
    theirs = timer(lambda: kernels.sparse_adam_rows_reference_(table, grads, groups, moment, last, log_decay_at, step))
    lines.append(Line("sparse_adam_rows_ vs torch reference", f"{rows}x{D} bf16, {2 * T} entries", ours, theirs))
    return lines


COMPOSED_WINDOW = 112     # the speedrun preset's composed-attention window (composed_window)


def bench_composed_attention(shapes, device, timer, dry):
    """Composed local attention (the last layer's: the heads' maps over the last COMPOSED_WINDOW
    tokens, mixed per token) against its blocked torch reference, forward and backward on bf16
    inputs with documents of SYNTHETIC_DOC_LEN tokens (informational)."""
    import torch

    import kernels
    T, D = shapes["tokens"], shapes["width"]
    head_dim = 16 if dry else 128
    heads = D // head_dim
    q, k, v = (torch.randn(T, heads, head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    mix_in = torch.randn(T, heads, device=device, requires_grad=True)
    mix_out = torch.randn(T, heads, device=device, dtype=torch.bfloat16, requires_grad=True)
    doc_start = (torch.arange(T, device=device) // SYNTHETIC_DOC_LEN * SYNTHETIC_DOC_LEN).int()
    grad = torch.randn(T, heads, head_dim, device=device, dtype=torch.bfloat16)

    def run(fn):
        def step():
            out = fn(q, k, v, doc_start, COMPOSED_WINDOW, head_dim ** -0.5, mix_in, mix_out)
            torch.autograd.grad(out, [q, k, v, mix_in, mix_out], grad)
        return step
    ours, theirs = timer(run(kernels.composed_attention)), timer(run(kernels.composed_attention_reference))
    return [Line("composed attention fwd+bwd vs torch reference (eager)",
                 f"{T}x{heads}x{head_dim}, window {COMPOSED_WINDOW}", ours, theirs)]


# Each takes (shapes, device, timer, dry) and returns its Lines; a bench's key names its part, kernel:KEY.
KERNEL_BENCHES = dict(fp8_matmul=bench_fp8_matmul, fp8_layers=bench_fp8_layers, attention=bench_attention,
                      cross_entropy=bench_cross_entropy, xxt=bench_xxt, qk_norm_rope=bench_qk_norm_rope,
                      sparse_rows=bench_sparse_rows, composed_attention=bench_composed_attention)


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(
        description=__doc__.split(";")[0] + ".",
        epilog=f"The benches: {', '.join(KERNEL_BENCHES)}. They run inside bench/first_contact.py, which sets "
               f"up their shapes, device and timer: python bench/first_contact.py --parts kernels (on a GPU), "
               f"or --dry (on a CPU, tiny shapes).").parse_args()
    raise SystemExit("error: bench/kernel_timings.py holds the kernel benches of bench/first_contact.py: run "
                     "python bench/first_contact.py --parts kernels (see --help)")
